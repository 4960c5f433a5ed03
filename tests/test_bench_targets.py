"""kvlab.bench.targets: issue 4's goals read off benchmark rows (CPU; the rows are data)."""
import json
from pathlib import Path

import pytest

from kvlab.bench import cli, targets

ROOT = Path(__file__).resolve().parents[1]
DEC = "B=32 L=8192 32/8 d=128"


def _row(impl, ms, ratio, notes="", case=DEC, suite="decode", frac=None):
    return dict(suite=suite, case=case, impl=impl, median_ms=ms, bytes=1, gbps=1.0,
                frac_of_copy=frac, ratio_vs_baseline=ratio, notes=notes)


def _int4_target():
    return next(t for t in targets.TARGETS if t.suite == "decode" and t.fmt == "int4_per_token_head"
                and t.metric == "ratio_vs_baseline")


def test_the_default_kernel_is_read_even_when_another_is_faster():
    rows = [_row("torch SDPA bf16 (baseline)", 0.25, 1.0),
            _row("kvlab int4_per_token_head [per_head]", 0.070, 0.28),
            _row("kvlab int4_per_token_head [paged]", 0.090, 0.36, notes="paged; " + targets.DEFAULT_MARK),
            _row("kvlab int4_per_token_head (whole call, kept plan)", 0.010, 0.04)]
    (c,) = targets.check(rows, [_int4_target()])
    assert c["row"]["impl"] == "kvlab int4_per_token_head [paged]"
    assert c["value"] == 0.36 and c["status"] == "missed"
    assert c["limit_ms"] == pytest.approx(0.090 / 0.36 * 0.32)   # = SDPA's 0.25 ms × 0.32


def test_without_a_mark_the_fastest_kvlab_row_is_read_and_whole_calls_never():
    rows = [_row("kvlab int4_per_token_head [per_head]", 0.0790, 0.316),
            _row("kvlab int4_per_token_head [paged]", 0.0800, 0.32),
            _row("kvlab int4_per_token_head (whole call, planned afresh)", 0.001, 0.004),
            _row("read floor [int4 bytes]", 0.0001, 0.0004)]
    (c,) = targets.check(rows, [_int4_target()])
    assert c["row"]["impl"] == "kvlab int4_per_token_head [per_head]" and c["status"] == "met"


@pytest.mark.parametrize("value, status", [(0.32, "met"), (0.3201, "missed"), (0.1, "met")])
def test_the_limit_itself_is_met(value, status):
    (c,) = targets.check([_row("kvlab int4_per_token_head [paged]", 0.08, value)], [_int4_target()])
    assert c["status"] == status


def test_copy_fraction_target_and_paged_floor_distance():
    t = next(t for t in targets.TARGETS if t.metric == "frac_of_copy")
    assert (t.op, t.limit, t.fmt) == (">=", 0.75, "int4_per_token_head")
    rows = [_row("kvlab int4_per_token_head [paged]", 0.0600, 0.43, targets.DEFAULT_MARK, case=t.case, frac=0.65),
            _row("paged read floor [int4 bytes]", 0.0460, 0.34, case=t.case),
            _row("paged read floor [nvfp4 bytes]", 0.0100, 0.1, case=t.case)]
    (c,) = targets.check(rows, [t])
    assert c["status"] == "missed" and c["value"] == 0.65
    assert c["over_paged_floor"] == pytest.approx(0.0600 / 0.0460)
    assert c["paged_floor_ms"] == 0.0460   # the int4 floor row, not nvfp4's
    assert c["limit_ms"] == pytest.approx(0.0600 * 0.65 / 0.75)   # the time at 0.75 of copy
    rows[0]["frac_of_copy"] = 0.75
    assert targets.check(rows, [t])[0]["status"] == "met"


def test_a_target_without_its_row_is_not_measured_and_never_met():
    out = targets.check([_row("kvlab int4_per_token_head [paged]", 0.08, 0.30, case="B=1 L=1024 32/8 d=128")])
    assert {c["status"] for c in out} == {"not measured"}
    assert all(c["row"] is None and c["value"] is None for c in out)


def test_markdown_section_only_for_suites_with_targets():
    assert targets.markdown_lines([_row("x", 1.0, 1.0, suite="write")]) == []
    md = cli.markdown([_row("kvlab int4_per_token_head [paged]", 0.08, 0.37, targets.DEFAULT_MARK)], {"gpu": "test"})
    tail = md.split("## issue-4 targets")[1]
    assert "| decode 32 × 8k: int4" in tail and "**missed**" in tail
    assert "prefill 4k" not in tail            # the prefill suite did not run: no prefill lines
    assert "not measured" in tail              # the other decode targets are missing from these rows


def _model_rows(slope=1.02, fixed_ms=0.010, floors=(0.02, 0.05, 0.1, 0.3, 0.6), small=0.006):
    """int4 paged rows exactly on ``slope · floor + fixed`` over cases of those paged floors, plus
    one case with a floor below the fit's minimum whose kernel time is far off the line."""
    rows = []
    for i, fl in enumerate((*floors, small)):
        case = DEC if i == 0 else f"B={i} L=8192 32/8 d=128"
        ms = slope * fl + fixed_ms if fl != small else 10 * small
        rows += [_row("kvlab int4_per_token_head [paged]", ms, ms / 0.25, targets.DEFAULT_MARK, case=case),
                 _row("paged read floor [int4 bytes]", fl, fl / 0.25, case=case),
                 _row("paged read floor [int8/fp8 bytes]", 2 * fl, 2 * fl / 0.25, case=case)]
    return rows


def test_cost_model_recovers_slope_and_fixed_cost_and_skips_small_floors():
    m = targets.cost_model(_model_rows(), "kvlab int4_per_token_head [paged]")
    assert m["n"] == 5                          # the 6 µs floor's case is not fitted (its time is off the line)
    assert m["slope"] == pytest.approx(1.02, rel=1e-9)
    assert m["fixed_us"] == pytest.approx(10.0, rel=1e-7)
    assert m["max_resid_us"] < 1e-6
    # the int4 floor row is the one read, not int8's twice-as-large one
    assert sorted(c[1] for c in m["cases"]) == [0.02, 0.05, 0.1, 0.3, 0.6]
    assert targets.cost_model(_model_rows(), "torch SDPA bf16 (baseline)") is None


def test_cost_model_needs_three_cases_of_different_floors():
    assert targets.cost_model(_model_rows(floors=(0.02, 0.05)), "kvlab int4_per_token_head [paged]") is None
    assert targets.cost_model(_model_rows(floors=(0.05, 0.05, 0.05)), "kvlab int4_per_token_head [paged]") is None


def test_check_gives_the_fixed_cost_the_limit_leaves():
    (c,) = targets.check(_model_rows(), [_int4_target()])
    # SDPA is 0.25 ms in every row (ratio = ms / 0.25): limit 0.32 × 0.25 = 0.08 ms; floor 0.02 ms
    assert c["limit_ms"] == pytest.approx(0.08)
    assert c["fixed_allowed_us"] == pytest.approx(1e3 * (0.08 - 1.02 * 0.02))
    assert c["model"]["fixed_us"] == pytest.approx(10.0)
    md = "\n".join(targets.markdown_lines(_model_rows(), [_int4_target()]))
    assert "### what the decode targets leave" in md and "| 1.020 | 10.0 | 0.0 | 59.6 |" in md
    (p,) = [t for t in targets.TARGETS if t.suite == "prefill" and t.fmt == "nvfp4"]
    (c,) = targets.check([_row("kvlab nvfp4 wgmma", 0.3, 1.2, suite="prefill", case=p.case)], [p])
    assert c["model"] is None and c["fixed_allowed_us"] is None
    assert "### what the decode" not in "\n".join(targets.markdown_lines([c["row"]], [p]))


def _committed_rows():
    rows = []
    for suite in ("decode", "prefill"):
        rows += json.loads((ROOT / f"benchmarks/latest/{suite}/results.json").read_text())["rows"]
    return rows


def test_committed_runs_measure_every_target_on_the_default_kernel():
    """The committed H200 tables hold every target's row, and each is the default's (marked)
    kernel or, for the prefill run written before the mark, the fastest — the wgmma row, which is
    the default on the H200 (compute capability 9.0)."""
    rows = _committed_rows()
    out = targets.check(rows)
    assert len(out) == len(targets.TARGETS)
    for c in out:
        assert c["status"] in ("met", "missed"), c["target"]
        assert c["value"] == c["row"][c["target"].metric]
        if c["target"].suite == "decode":
            assert targets.DEFAULT_MARK in c["row"]["notes"]
            assert c["over_paged_floor"] and c["over_paged_floor"] > 0.9
            # the grid has enough cases for the cost model of every decode kernel, and a line
            # describes each of them to within a few µs (the fit is a summary, not a stretch)
            m = c["model"]
            assert m["n"] >= 10 and m["max_resid_us"] < 10 and 0.9 < m["slope"] < 2.0
        else:
            assert c["row"]["impl"].endswith(" wgmma")


def test_script_prints_the_committed_table(capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_targets", ROOT / "scripts/bench_targets.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main([]) == 0
    out = capsys.readouterr().out
    table, costs = out.split("### what the decode targets leave")
    assert table.count("| decode ") == 6 and table.count("| prefill ") == 2
    assert costs.count("| decode ") == 6 and "| prefill " not in costs
    assert "H200" in out
    assert mod.main([str(ROOT / "nonexistent.json")]) == 2


def test_targets_plot_draws_one_bar_per_measured_target():
    import matplotlib

    matplotlib.use("Agg")
    from kvlab.lab.bench_view import latest_results, targets_plot

    assert targets_plot([_row("x", 1.0, 1.0, suite="write")]) is None
    env, rows = latest_results()
    fig = targets_plot(rows)
    ax = fig.axes[0]
    assert len(ax.patches) == len(targets.TARGETS)
    limits = {c["target"].what: c for c in targets.check(rows)}
    label_at = {round(float(y)): t.get_text() for y, t in zip(ax.get_yticks(), ax.get_yticklabels())}
    for bar in ax.patches:
        c = limits[label_at[round(bar.get_y() + bar.get_height() / 2)]]
        assert bar.get_width() == pytest.approx(c["row"]["median_ms"] / c["limit_ms"])
        assert (bar.get_width() <= 1.0 + 1e-12) == (c["status"] == "met")


def test_cost_plot_one_panel_per_decode_target_with_its_fit():
    import matplotlib

    matplotlib.use("Agg")
    from kvlab.lab.bench_view import cost_plot, latest_results

    assert cost_plot([_row("x", 1.0, 1.0, suite="write")]) is None
    env, rows = latest_results()
    fig = cost_plot(rows)
    checked = [c for c in targets.check(rows) if c["model"] is not None]
    panels = [ax for ax in fig.axes if ax.has_data()]
    assert len(panels) == len(checked) == 6
    for ax, c in zip(panels, checked):
        pts = ax.collections[0].get_offsets()
        assert len(pts) == c["model"]["n"]
        cross = ax.lines[1]
        floor = c["row"]["median_ms"] / c["over_paged_floor"]
        assert cross.get_xdata()[0] == pytest.approx(floor)
        assert cross.get_ydata()[0] == pytest.approx(1e3 * (c["limit_ms"] - floor))


def test_cost_model_of_a_target_fits_its_own_shape_only():
    """Cases of another head shape on another line (d = 64: a steeper slope, more fixed cost) would
    pull a fit over all cases; the target's model keeps to its case's heads and head size."""
    rows = _model_rows()
    for i, fl in enumerate((0.03, 0.2, 0.9)):
        case = f"B={i + 1} L=131072 9/3 d=64"
        ms = 1.14 * fl + 0.030
        rows += [_row("kvlab int4_per_token_head [paged]", ms, ms / 0.25, targets.DEFAULT_MARK, case=case),
                 _row("paged read floor [int4/nvfp4 bytes]", fl, fl / 0.25, case=case)]
    impl = "kvlab int4_per_token_head [paged]"
    mixed = targets.cost_model(rows, impl)
    assert mixed["n"] == 8 and mixed["slope"] != pytest.approx(1.02, rel=1e-3)
    own = targets.cost_model(rows, impl, "32/8 d=128")
    assert own["n"] == 5 and own["slope"] == pytest.approx(1.02, rel=1e-9)
    assert own["fixed_us"] == pytest.approx(10.0, rel=1e-7)
    small = targets.cost_model(rows, impl, "9/3 d=64")
    assert small["slope"] == pytest.approx(1.14, rel=1e-9) and small["fixed_us"] == pytest.approx(30.0, rel=1e-7)
    (c,) = targets.check(rows, [_int4_target()])
    assert c["model"]["n"] == 5 and c["model"]["slope"] == pytest.approx(1.02, rel=1e-9)
    assert targets.case_shape("B=32 L=8192 32/8 d=128") == "32/8 d=128"
    with pytest.raises(ValueError, match="not a decode case name"):
        targets.case_shape("T=4096 causal 32/8 d=128")

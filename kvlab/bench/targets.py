"""The performance targets of issue 4, read off a benchmark run's rows.

Issue 4 sets its speed goals on the H200 as ratios measured by ``python -m kvlab bench decode
prefill`` (decode: batch 32 × 8,192 tokens, 32 / 8 heads, d = 128, block 16; batch 1 × 128k for
the copy fraction; prefill: a 4,096-token causal prompt). :data:`TARGETS` writes each goal down
once; :func:`check` finds the row it is about in a run's rows and says whether it is met, and
:func:`markdown_lines` renders that as the table ``results.md`` ends with (``kvlab.bench.cli``)
and ``scripts/bench_targets.py`` prints for committed ``results.json`` files.

Which row a target reads: the **default's kernel** — the kvlab row of that format and case whose
notes say ``the default (auto) picks this kernel here`` (both suites mark it), else, for runs
written before the mark existed, the fastest kvlab row of the format in that case (its ``impl``
is named in the table, so the choice is visible). The whole-call rows of the decode target case
(``(whole call, …)``) time the host too and are not what the targets measure.

A target whose case or format is missing from the rows (a ``--quick`` run, another GPU, a suite
not run) is reported as ``not measured``, never as met or missed.

Why a decode target is missed: :func:`cost_model` fits, per decode kernel, its time over the run's
cases of the target's heads and head size (32 / 8, d = 128: other shapes stream at other rates
per byte) as ``slope × (the paged read floor of the same bytes) + fixed`` — the loop's cost per
byte against a pure reader's, and what a call costs beyond that whatever its size (the split
merge, the start before the first data, the epilogue, the idle SMs). Each decode target then
says how much fixed cost it leaves at the fitted slope (:func:`check`'s ``fixed_allowed_us``),
to be set against the fitted ``fixed``.
"""
from __future__ import annotations

import dataclasses

DEFAULT_MARK = "the default (auto) picks this kernel here"


@dataclasses.dataclass(frozen=True)
class Target:
    """One goal: the row of ``fmt`` in ``suite``'s ``case`` has ``metric`` ``op`` ``limit``.

    ``metric`` is a row key (``ratio_vs_baseline``: time / the suite's baseline, torch SDPA bf16;
    ``frac_of_copy``: GB/s / the copy's GB/s on the same bytes); ``op`` is ``"<="`` or ``">="``."""
    suite: str
    case: str
    fmt: str
    metric: str
    op: str
    limit: float
    what: str

    def met(self, value: float) -> bool:
        return value <= self.limit if self.op == "<=" else value >= self.limit


_DEC = "B=32 L=8192 32/8 d=128"
_PF = "T=4096 causal 32/8 d=128"
TARGETS = (
    Target("decode", _DEC, "int4_per_token_head", "ratio_vs_baseline", "<=", 0.32,
           "decode 32 × 8k: int4 ≤ 0.32× SDPA bf16 (byte floor 0.266×)"),
    Target("decode", _DEC, "nvfp4", "ratio_vs_baseline", "<=", 0.34,
           "decode 32 × 8k: nvfp4 ≤ 0.34× SDPA bf16 (byte floor 0.281×)"),
    Target("decode", _DEC, "int8_per_token_head", "ratio_vs_baseline", "<=", 0.58,
           "decode 32 × 8k: int8 ≤ 0.58× SDPA bf16 (byte floor 0.52×)"),
    Target("decode", _DEC, "fp8_per_token_head", "ratio_vs_baseline", "<=", 0.58,
           "decode 32 × 8k: fp8 ≤ 0.58× SDPA bf16 (byte floor 0.52×)"),
    Target("decode", _DEC, "auto", "ratio_vs_baseline", "<=", 1.10,
           "decode 32 × 8k: kvlab auto within 1.1× SDPA bf16"),
    Target("decode", "B=1 L=131072 32/8 d=128", "int4_per_token_head", "frac_of_copy", ">=", 0.75,
           "decode 1 × 128k: int4 ≥ 0.75 of copy bandwidth"),
    Target("prefill", _PF, "int4_per_token_head", "ratio_vs_baseline", "<=", 1.50,
           "prefill 4k causal: int4 within 1.5× SDPA bf16"),
    Target("prefill", _PF, "nvfp4", "ratio_vs_baseline", "<=", 1.50,
           "prefill 4k causal: nvfp4 within 1.5× SDPA bf16"),
)


def _fmt_of(impl: str) -> str | None:
    """``"kvlab int4_per_token_head [paged]"`` / ``"kvlab nvfp4 wgmma"`` -> the format name; None
    for baselines, floors and the whole-call rows."""
    if not impl.startswith("kvlab ") or "whole call" in impl:
        return None
    return impl.split()[1]


def pick_row(rows, suite: str, case: str, fmt: str) -> dict | None:
    """The row a target of ``fmt`` in ``case`` reads (module docstring): the default's kernel,
    else the fastest kvlab row of the format; None when the run has no such row."""
    mine = [r for r in rows if r.get("suite") == suite and r.get("case") == case
            and _fmt_of(str(r.get("impl", ""))) == fmt and r.get("median_ms") is not None]
    if not mine:
        return None
    marked = [r for r in mine if DEFAULT_MARK in str(r.get("notes") or "")]
    return (marked or sorted(mine, key=lambda r: r["median_ms"]))[0]


def _paged_floor_ms(rows, case: str, fmt: str) -> float | None:
    """The decode suite's paged read floor of ``fmt``'s bytes in ``case`` (its head size from the
    case name, ``… d=128``), or None."""
    from .suite_decode import floor_label   # suite_decode imports this module

    label = floor_label(fmt, int(case.rsplit("d=", 1)[1]))
    for r in rows:
        if (r.get("suite") == "decode" and r.get("case") == case
                and r.get("impl") == f"paged read floor [{label} bytes]"):
            return r.get("median_ms")
    return None


#: the cost model's cases: a paged floor of at least this many ms. Shorter calls (batch 1 × 1k:
#: 8 CTAs) do not fill the GPU, so their kernel is not streaming at the rate the floor's reader
#: (which picks its own CTA count) gets, and they would weigh the fit with something else.
FIT_MIN_FLOOR_MS = 0.015


def case_shape(case: str) -> str:
    """The heads and head size of a decode case name: ``"B=32 L=8192 32/8 d=128"`` → ``"32/8 d=128"``."""
    parts = case.split(" ", 2)
    if len(parts) != 3 or not parts[0].startswith("B=") or not parts[1].startswith("L="):
        raise ValueError(f"case: not a decode case name 'B=… L=… Hq/Hkv d=…': {case!r}")
    return parts[2]


def cost_model(rows, impl: str, shape: str | None = None) -> dict | None:
    """Least-squares fit of the decode kernel ``impl`` (e.g. ``"kvlab int4_per_token_head
    [paged]"``) over the run's cases: ``median_ms ≈ slope · floor_ms + fixed_ms``, ``floor_ms``
    the paged read floor of the format's bytes in the same case (cases whose floor is below
    :data:`FIT_MIN_FLOOR_MS` are left out; with ``shape``, e.g. ``"32/8 d=128"``, only the cases
    of those heads and head size: at B = 32 × 128k int4 ran 1.14× its floor at 9 / 3, d = 64,
    1.06× at 32 / 8, d = 64 and 1.02× at 32 / 8, d = 128 on the H100 (session 37), so one line over
    all shapes lets the few long d = 64 cases set the fixed cost). Returns ``slope``, ``fixed_us``, ``max_resid_us`` (the
    largest |measured − fitted|), ``n`` (cases) and ``cases`` (``(case, floor_ms, ms)``), or None
    with fewer than 3 cases or floors all alike (nothing to fit a line to)."""
    fmt = _fmt_of(impl)
    if fmt is None:
        return None
    pts = []
    for r in rows:
        if r.get("suite") != "decode" or r.get("impl") != impl or r.get("median_ms") is None:
            continue
        if shape is not None and case_shape(r["case"]) != shape:
            continue
        fl = _paged_floor_ms(rows, r["case"], fmt)
        if fl is not None and fl >= FIT_MIN_FLOOR_MS:
            pts.append((r["case"], fl, r["median_ms"]))
    if len(pts) < 3:
        return None
    n = len(pts)
    mx = sum(p[1] for p in pts) / n
    my = sum(p[2] for p in pts) / n
    sxx = sum((p[1] - mx) ** 2 for p in pts)
    if sxx <= 1e-12 * max(mx * mx, 1e-30):
        return None
    slope = sum((p[1] - mx) * (p[2] - my) for p in pts) / sxx
    fixed = my - slope * mx
    resid = max(abs(p[2] - (slope * p[1] + fixed)) for p in pts)
    return dict(impl=impl, slope=slope, fixed_us=1e3 * fixed, max_resid_us=1e3 * resid, n=n, cases=pts)


def check(rows, targets=TARGETS) -> list[dict]:
    """One dict per target: ``target`` (the :class:`Target`), ``row`` (the row read, or None),
    ``value`` (its ``metric``, or None), ``status`` (``"met"``, ``"missed"`` or
    ``"not measured"``), ``limit_ms`` (the most time the row may take to meet the limit: the
    baseline's time × ``limit`` for a ratio, the time at ``limit`` of the copy's GB/s for a copy
    fraction), ``paged_floor_ms`` (decode: the paged read floor of the row's bytes in the same
    run, else None), ``over_paged_floor`` (the row's time over it, else None), ``model`` (decode: :func:`cost_model` of
    the row's kernel over the run's cases of the target's shape, else None) and ``fixed_allowed_us`` (decode: the fixed cost
    the limit leaves at the model's slope, ``limit_ms − slope · floor``, in µs; negative when even
    a call without fixed costs would miss; else None)."""
    out = []
    for t in targets:
        row = pick_row(rows, t.suite, t.case, t.fmt)
        value = None if row is None else row.get(t.metric)
        status = "not measured" if value is None else ("met" if t.met(value) else "missed")
        limit_ms = fl = over = model = allowed = None
        if row is not None and value:
            # the time at which the metric would sit on its limit: it is proportional to the
            # time (ratio_vs_baseline) or to its inverse (frac_of_copy), at the row's bytes
            limit_ms = (row["median_ms"] / value * t.limit if t.metric == "ratio_vs_baseline"
                        else row["median_ms"] * value / t.limit)
        if row is not None and t.suite == "decode":
            fl = _paged_floor_ms(rows, t.case, t.fmt)
            over = row["median_ms"] / fl if fl else None
            model = cost_model(rows, row["impl"], case_shape(t.case))
            if model is not None and fl and limit_ms is not None:
                allowed = 1e3 * (limit_ms - model["slope"] * fl)
        out.append(dict(target=t, row=row, value=value, status=status, limit_ms=limit_ms,
                        paged_floor_ms=fl, over_paged_floor=over, model=model,
                        fixed_allowed_us=allowed))
    return out


def markdown_lines(rows, targets=TARGETS) -> list[str]:
    """The targets as a Markdown table (a heading, then one line per target); [] when the rows
    hold none of the targets' suites."""
    suites = {r.get("suite") for r in rows}
    checked = [c for c in check(rows, targets) if c["target"].suite in suites]
    if not checked:
        return []
    lines = ["## issue-4 targets", "",
             "Read off the rows above: the default's kernel per format (the row marked "
             f"'{DEFAULT_MARK}', else the fastest; `kvlab/bench/targets.py`). The goals are set "
             "for the H200.", "",
             "| target | row | ms | measured | limit | limit ms | over paged floor | status |",
             "|---|---|---|---|---|---|---|---|"]
    for c in checked:
        t, row = c["target"], c["row"]
        unit = "×" if t.metric == "ratio_vs_baseline" else " of copy"
        measured = "" if c["value"] is None else f"{c['value']:.2f}{unit}"
        lines.append("| " + " | ".join([
            t.what,
            "" if row is None else str(row["impl"]).replace("|", "/"),
            "" if row is None else f"{row['median_ms']:.4f}",
            measured,
            f"{'≤' if t.op == '<=' else '≥'} {t.limit:g}{unit}",
            "" if c["limit_ms"] is None else f"{c['limit_ms']:.4f}",
            "" if c["over_paged_floor"] is None else f"{c['over_paged_floor']:.2f}×",
            f"**{c['status']}**" if c["status"] == "missed" else c["status"],
        ]) + " |")
    lines.append("")
    lines += _cost_lines(checked)
    return lines


def _cost_lines(checked) -> list[str]:
    """The cost-model table under the targets (decode targets with a model only)."""
    cs = [c for c in checked if c["model"] is not None and c["fixed_allowed_us"] is not None]
    if not cs:
        return []
    lines = ["### what the decode targets leave for a call's fixed costs", "",
             "Each kernel's time over this run's cases of the target's heads and head size "
             "(its `cases`) with a paged floor ≥ "
             f"{1e3 * FIT_MIN_FLOOR_MS:g} µs, fitted as `slope × paged floor + fixed` "
             "(`targets.cost_model`); `allowed` is the fixed cost the target's limit leaves at "
             "that slope (`limit ms − slope × floor`): below the fitted `fixed`, the target needs "
             "the call's fixed costs cut to it (negative: the loop alone would miss).", "",
             "| target | kernel | cases | slope | fixed µs | max resid µs | allowed µs |",
             "|---|---|---|---|---|---|---|"]
    for c in cs:
        m = c["model"]
        lines.append("| " + " | ".join([
            c["target"].what, str(m["impl"]).replace("|", "/"), str(m["n"]), f"{m['slope']:.3f}",
            f"{m['fixed_us']:.1f}", f"{m['max_resid_us']:.1f}", f"{c['fixed_allowed_us']:.1f}",
        ]) + " |")
    lines.append("")
    return lines

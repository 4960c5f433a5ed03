"""The decode suite's grid against device memory (kvlab/bench/suite_decode.py), without a GPU:
every issue-4 case is in the grid, a case runs only where its peak estimate fits the free memory,
a case that does not fit (or runs out of memory anyway) leaves one ``not run (device memory)``
row whose numbers are empty, the progress bar still advances by the case's steps, and the grid
goes on. The timed side is the GPU run of ``python -m kvlab bench decode``."""
from __future__ import annotations

import pytest

from kvlab.bench import floors, suite_decode, targets

GiB = 2 ** 30


def test_full_grid_has_every_batch_and_context():
    """Issue 4: batch 1, 8, 32, 64 × 1k, 8k, 32k, 128k at 32/8, d = 128, none left out by a token
    cap (memory decides at run time), plus 64 × 4k; 128k for the smaller head shapes too."""
    grid = dict(suite_decode._grid(False))
    assert set(grid[(32, 8, 128)]) == {(b, c) for b in (1, 8, 32, 64) for c in (1024, 8192, 32768, 131072)} | {
        (64, 4096)}
    for shape in ((9, 3, 64), (32, 8, 64)):
        assert set(grid[shape]) == {(1, 8192), (1, 131072), (32, 8192), (32, 131072)}


@pytest.mark.parametrize("B, ctx, Hkv, d", [(64, 131072, 8, 128), (32, 131072, 8, 128), (1, 1024, 8, 128),
                                            (32, 131072, 3, 64), (7, 1000, 2, 256)])
def test_case_peak_bytes_counts_the_sdpa_phase(B, ctx, Hkv, d):
    """The peak is the SDPA phase: the bf16 K/V twice (the caches' source, SDPA's contiguous copy)
    and the largest SDPA-at-equal-bytes prefix (int8/fp8's), plus 16 B a token of slots and the
    block table. Computed here from the formats' row bytes, independently of the suite."""
    tokens = B * ctx
    bf16 = 2 * tokens * Hkv * d * 2
    int8_row = d + 4          # one byte a value, a float32 scale per row (SPEC 2.3)
    ctx_eq = round(ctx * int8_row / (2 * d))
    assert ctx_eq == floors.equal_bytes_context(ctx, int8_row, d)
    eq = 2 * B * ctx_eq * Hkv * 2 * d
    want = 2 * bf16 + eq + 16 * tokens + 4 * B * -(-ctx // 16)
    assert suite_decode.case_peak_bytes(B, ctx, Hkv, d) == want


def test_the_largest_case_needs_an_h200():
    """B = 64 × 128k at 32/8, d = 128 (32 GiB of bf16 K/V) does not fit an H100's ~79 GiB but fits
    an H200's ~140 GiB; B = 32 × 128k fits both."""
    need = suite_decode.case_peak_bytes(64, 131072, 8, 128) + suite_decode.MEM_MARGIN
    assert 79 * GiB < need < 130 * GiB
    assert suite_decode.case_peak_bytes(32, 131072, 8, 128) + suite_decode.MEM_MARGIN < 60 * GiB


class _Progress:
    def __init__(self):
        self.n, self.announced, self.msgs = 0, 0, []

    def total(self, n):
        self.announced += n

    def __call__(self, msg=""):
        self.n += 1
        self.msgs.append(msg)


def _fake_rows(case):
    return [dict(suite="decode", case=case, impl="kvlab int4_per_token_head [paged]", median_ms=0.1, bytes=10,
                 gbps=1.0, frac_of_copy=0.5, ratio_vs_baseline=0.3, notes="")]


def _stub_run(monkeypatch, free_bytes, oom_case=None):
    """``run`` with the device stubbed: ``free_bytes`` free, every case's rows faked (and the one
    named ``oom_case`` raising torch's out-of-memory error after two progress steps)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("cupy")
    ran, freed = [], []

    def fake_case(torch_, case, B, ctx, Hq, Hkv, d, repeats, progress):
        progress(f"{case} sdpa")
        if case == oom_case:
            progress(f"{case} floor")
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 32.00 GiB")
        for _ in range(suite_decode._case_steps(d) - 1):
            progress(case)
        ran.append(case)
        return _fake_rows(case)

    monkeypatch.setattr(suite_decode, "_run_case", fake_case)
    monkeypatch.setattr(suite_decode, "_device_free_bytes", lambda t: free_bytes)
    monkeypatch.setattr(suite_decode, "_free_pools", lambda t=None: freed.append(1))
    return ran, freed


def test_cases_that_do_not_fit_are_reported_not_dropped(monkeypatch):
    free = 79 * GiB   # an H100
    ran, _ = _stub_run(monkeypatch, free)
    prog = _Progress()
    rows = suite_decode.run(False, prog)
    grid = [(f"B={B} L={ctx} {Hq}/{Hkv} d={d}", B, ctx, Hkv, d)
            for (Hq, Hkv, d), cases in suite_decode._grid(False) for B, ctx in cases]
    skipped = [r for r in rows if r["impl"] == suite_decode.NOT_RUN]
    want_skip = [c for c, B, ctx, Hkv, d in grid
                 if suite_decode.case_peak_bytes(B, ctx, Hkv, d) + suite_decode.MEM_MARGIN > free]
    assert [r["case"] for r in skipped] == want_skip == ["B=64 L=131072 32/8 d=128"]
    assert ran == [c for c, *_ in grid if c not in want_skip]
    (s,) = skipped
    assert s["median_ms"] is None and s["ratio_vs_baseline"] is None and s["frac_of_copy"] is None
    assert "GiB of device memory" in s["notes"] and "79.0 GiB free" in s["notes"]
    # every case's steps were counted, run or not: the bar ends full
    assert prog.n == prog.announced == sum(len(c) * suite_decode._case_steps(d)
                                           for (_, _, d), c in suite_decode._grid(False))
    # the targets, the cost model and the notebook's plots skip the row (no numbers in it)
    assert targets.check(rows) is not None


def test_an_out_of_memory_case_is_reported_and_the_grid_goes_on(monkeypatch):
    oom = "B=32 L=131072 32/8 d=128"
    ran, freed = _stub_run(monkeypatch, 200 * GiB, oom_case=oom)
    prog = _Progress()
    rows = suite_decode.run(False, prog)
    bad = [r for r in rows if r["case"] == oom]
    assert len(bad) == 1 and bad[0]["impl"] == suite_decode.NOT_RUN
    assert "ran out of memory anyway: OutOfMemoryError: CUDA out of memory" in bad[0]["notes"]
    assert oom not in ran and "B=64 L=131072 32/8 d=128" in ran and "B=32 L=131072 9/3 d=64" in ran
    assert prog.n == prog.announced
    assert len(freed) >= len(ran) + 1   # the pools are handed back after every case


def test_not_run_row_renders_in_the_results_table():
    from kvlab.bench import cli

    row = suite_decode._not_run_row("B=64 L=131072 32/8 d=128", 64, 131072, 8, 128, 90 * GiB, 70 * GiB)
    md = cli.markdown([row], {"gpu": "test"})
    line = next(ln for ln in md.splitlines() if "not run" in ln)
    assert "| B=64 L=131072 32/8 d=128 | not run (device memory) |  |  |  |  |  |" in line
    assert "needs ~90.0 GiB" in line and "70.0 GiB free" in line and "32.0 GiB twice" in line

"""Per-CTA timeline of the paged decode kernel: where the fixed ~30 µs of a decode call go.
(docs/perf-notes.md, "Session 10": time = ~33 µs + bytes / 3.96 TB/s across the int4 grid.)

    KVLAB_NVRTC_OPTIONS=-DKVLAB_DECODE_TIMELINE python3 scripts/decode_cta_timeline.py \
        [int4_per_token_head:32:8192:paged ...] [--repeats 3] [--out DIR]

The measurement-only build ``-DKVLAB_DECODE_TIMELINE`` (kernels_cu/paged_attention.cu) makes
thread 0 of every CTA of ``paged_attention_decode_paged`` record %globaltimer and clock64 at five
points: start (e0), after the prologue's barrier (e1), stage 0's data in (e2), after the last
stage's math (e3), after the epilogue (e4); plus its SM and stage count, and clock64 at four
points inside the prologue (its parts are printed in cycles; with
-DKVLAB_DECODE_SERIAL_QUERY_COLUMNS also at the start of each query column: column 0's cycles
and the median of the others). Each case (as
scripts/profile_decode.py: FORMAT:B:CTX:VARIANT[:HQ/HKV/D], 32/8 heads and d = 128 unless
named, block 16, shuffled blocks)
runs warm, then ``--repeats`` times with L2 flushed before each run; the table gives, per case,
the medians over repeats of: the launch skew (last CTA start − first), the phases per CTA (median
and max over CTAs), the tail (last CTA end − median CTA end), the kernel's span (first start →
last end), and the whole ``plan.run`` (kernel + split merge) timed by CUDA events.
``--l2 dirty|clean|warm`` picks what precedes each run (is the prologue slow because the L2 is
full of the flush's dirty lines, because the code and metadata are cold, or neither?).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TL_MAX_CTAS, TL_WORDS = 8192, 24   # as in paged_attention.cu


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cases", nargs="*", default=["int4_per_token_head:32:8192:paged",
                                                 "int4_per_token_head:1:131072:paged",
                                                 "int4_per_token_head:64:32768:paged",
                                                 "nvfp4:32:8192:paged"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--l2", choices=("dirty", "clean", "warm"), default="dirty",
                    help="before each run: 'dirty' overwrites a buffer of twice the L2 (as the "
                         "benchmark timer does: L2 is left full of dirty lines that the run's first "
                         "misses must write back), 'clean' does that and then reads another such "
                         "buffer (the write-backs happen before the run), 'warm' does nothing")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if "KVLAB_DECODE_TIMELINE" not in os.environ.get("KVLAB_NVRTC_OPTIONS", ""):
        sys.exit("run with KVLAB_NVRTC_OPTIONS=-DKVLAB_DECODE_TIMELINE (the measurement-only build)")

    import cupy
    import torch

    from kvlab.bench.timing import _flush_buffer
    from kvlab.cuda import loader
    from profile_decode import decode_case

    dev = cupy.cuda.Device().id
    g = torch.Generator(device="cuda").manual_seed(0)
    rows, raw = [], {}
    for case in args.cases:
        run_args, plan, cache = decode_case(case, g, shuffled=True)
        if plan.decode_variant != "paged":
            print(f"{case}: the plan took {plan.decode_variant} ({plan.decode_variant_note}); skipped")
            continue
        n = plan.n_items
        if n > TL_MAX_CTAS:
            sys.exit(f"{case}: {n} CTAs > {TL_MAX_CTAS}")
        mod, _ = loader._module("paged_attention", dev)
        tl = cupy.ndarray((TL_MAX_CTAS * TL_WORDS,), cupy.uint64, memptr=mod.get_global("kvlab_decode_timeline"))
        for _ in range(3):
            plan.run(*run_args)
        flush = _flush_buffer(dev)
        reread = cupy.empty_like(flush) if args.l2 == "clean" else None
        if reread is not None:
            reread.fill(2)
        reps = []
        for _ in range(args.repeats):
            tl.fill(0)
            if args.l2 != "warm":
                flush.fill(1)
            if reread is not None:
                int(reread.sum(dtype=cupy.uint64))   # reads every line: evicts the dirty ones
            cupy.cuda.runtime.deviceSynchronize()
            e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
            e0.record()
            plan.run(*run_args)
            e1.record()
            e1.synchronize()
            a = cupy.asnumpy(tl[: n * TL_WORDS]).reshape(n, TL_WORDS).astype(np.int64)
            t, cyc = a[:, 0:5], a[:, 5:10]
            if not np.all(t > 0):
                sys.exit(f"{case}: {np.count_nonzero(t == 0)} marks missing (not a TIMELINE build?)")
            t0 = t[:, 0].min()
            ends = t[:, 4] - t0
            us = lambda x: float(x) / 1e3   # noqa: E731  (globaltimer: ns)
            ph = np.diff(t, axis=1)   # prologue, first data, loop, epilogue (ns)
            nst = a[:, 11]
            reps.append(dict(
                run_ms=cupy.cuda.get_elapsed_time(e0, e1),
                skew_us=us(t[:, 0].max() - t0),
                prologue_med_us=us(np.median(ph[:, 0])), prologue_max_us=us(ph[:, 0].max()),
                first_data_med_us=us(np.median(ph[:, 1])), first_data_max_us=us(ph[:, 1].max()),
                start_to_data_med_us=us(np.median(t[:, 2] - t[:, 0])),
                loop_med_us=us(np.median(ph[:, 2])), loop_min_us=us(ph[:, 2].min()), loop_max_us=us(ph[:, 2].max()),
                per_stage_med_us=us(np.median(ph[:, 2] / np.maximum(nst - 1, 1))),
                epilogue_med_us=us(np.median(ph[:, 3])), epilogue_max_us=us(ph[:, 3].max()),
                end_med_us=us(np.median(ends)), span_us=us(ends.max()), tail_us=us(ends.max() - np.median(ends)),
                prologue_med_cycles=float(np.median(cyc[:, 1] - cyc[:, 0])),
                # the prologue's parts in cycles (thread 0): early copies, query staging, Q operand,
                # the rest up to the barrier, the barrier wait
                pro_issue_cyc=float(np.median(a[:, 12] - cyc[:, 0])),
                pro_stage_cyc=float(np.median(a[:, 13] - a[:, 12])),
                pro_qop_cyc=float(np.median(a[:, 14] - a[:, 13])),
                pro_rest_cyc=float(np.median(a[:, 15] - a[:, 14])),
                pro_barrier_cyc=float(np.median(cyc[:, 1] - a[:, 15])),
                # serial-columns build only (words 16 … 23: the start of each query column):
                # column 0, and the median of columns 1 … 7 (0 when the build has no such marks)
                pro_col0_cyc=float(np.median(a[:, 17] - a[:, 16])) if np.all(a[:, 16:24] > 0) else 0.0,
                pro_col1_7_cyc=float(np.median(np.diff(np.concatenate([a[:, 17:24], a[:, 13:14]], axis=1),
                                                       axis=1))) if np.all(a[:, 16:24] > 0) else 0.0,
                # dual-ring CTA (NH = 2) only: half 1's loop end − half 0's (word 23 − mark 3), median
                # and the largest gap either way (0 without such marks)
                halves_gap_med_us=(us(np.median(a[:, 23] - t[:, 3])) if np.all(a[:, 23] > 0)
                                   and not np.all(a[:, 16:23] > 0) else 0.0),
                halves_gap_absmax_us=(us(np.abs(a[:, 23] - t[:, 3]).max()) if np.all(a[:, 23] > 0)
                                      and not np.all(a[:, 16:23] > 0) else 0.0),
                stages_med=float(np.median(nst)), ctas=n, sms=int(len(np.unique(a[:, 10]))),
            ))
            raw.setdefault(case, []).append(a.tolist())
        med = {k: float(np.median([r[k] for r in reps])) for k in reps[0]}
        med["case"] = case
        rows.append(med)
        print(json.dumps(med), flush=True)
        del cache, run_args, plan
        torch.cuda.empty_cache()
    cols = [("case", "case"), ("ctas", "CTAs"), ("stages_med", "stages"), ("run_ms", "run ms"),
            ("span_us", "kernel span µs"), ("skew_us", "start skew"), ("prologue_med_us", "prologue"),
            ("first_data_med_us", "→ data"), ("start_to_data_med_us", "start → data"),
            ("loop_med_us", "loop med"), ("loop_max_us", "loop max"), ("per_stage_med_us", "µs/stage"),
            ("epilogue_med_us", "epilogue"), ("tail_us", "tail"),
            ("pro_issue_cyc", "pro: copies cyc"), ("pro_stage_cyc", "pro: q staging cyc"),
            ("pro_qop_cyc", "pro: Q operand cyc"), ("pro_rest_cyc", "pro: rest cyc"),
            ("pro_barrier_cyc", "pro: barrier cyc"), ("pro_col0_cyc", "pro: column 0 cyc"),
            ("pro_col1_7_cyc", "pro: columns 1-7 cyc each"), ("halves_gap_med_us", "half 1 − half 0 end"),
            ("halves_gap_absmax_us", "|halves gap| max")]
    lines = ["| " + " | ".join(h for _, h in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(str(r[k]) if isinstance(r[k], str) else
                                       (f"{r[k]:.0f}" if k in ("ctas",) else f"{r[k]:.4f}" if k == "run_ms" else f"{r[k]:.1f}")
                                       for k, _ in cols) + " |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "decode_cta_timeline.md").write_text(
            "Per-CTA timeline of paged_attention_decode_paged (-DKVLAB_DECODE_TIMELINE), medians over "
            f"{args.repeats} runs, L2 before each: {args.l2}; µs unless named\n\n" + table + "\n")
        (out / "decode_cta_timeline.json").write_text(json.dumps(dict(rows=rows, raw=raw)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

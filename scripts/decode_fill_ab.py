"""A/B of the paged decode's work list in one process: ``_slot_filled`` always
(KVLAB_DECODE_SLOT_FILL=2) against session 15's ``_wave_weighted`` (=0), on the same caches. The
default (=1) takes the filled list only where the model says it pays (``_fill_pays``); the table
says which list the default would take. ``--ab VAR=A/B`` compares two other settings of a
variable read when a plan is built, e.g. the paged decode's CTA forms
(``--ab KVLAB_DECODE_PAGED_DUAL=0/1``: two CTAs per SM against the dual-ring CTA, each with its
default work list).

    python3 scripts/decode_fill_ab.py [--repeats 30] [--out DIR] [--ab VAR=A/B] [--only CASES]
                                      [--shape HQ/HKV/D] [--formats F1,F2] [--batches BxL,...]

Cases (32/8 heads, d = 128 unless ``--shape``, block 16, shuffled blocks): the issue-4 targets
(B = 32 × 8k, batch 1 × 128k, 64 × 4k) for int4, nvfp4, int8 and fp8, batch 1 × 32k and two
ragged batches (lengths below) for int4 and int8 (``--formats``: these formats for every case).
Each case builds its cache once, plans it both ways (the switch is read when the plan is built),
and times the two plans alternately (A B A B, ``bench_ms``, cold L2); it also checks that the two
outputs agree (relative L2 < 1e-2: the same attention, cut differently; the float64 comparison
is the GPU tests' job). ``--batches 2x8192,8x32768``: these uniform batches instead of the
built-in cases. Prints a Markdown table, writes it with a JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RAGGED = {
    "ragged 40 × 300 + 4 × 60k": [300] * 40 + [60000] * 4,
    "ragged 16 × 2k … 32k": list(range(2000, 32001, 2000)),
}
FORMATS = ("int4_per_token_head", "nvfp4", "int8_per_token_head", "fp8_per_token_head")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", default="")
    ap.add_argument("--only", default="", help="comma-separated substrings of case names (e.g. 'B=32,ragged')")
    ap.add_argument("--ab", default="KVLAB_DECODE_SLOT_FILL=0/2",
                    help="VAR=A/B: the two settings compared (default: the work list, =0 against =2)")
    ap.add_argument("--shape", default="32/8/128", help="HQ/HKV/D: query heads, KV heads, head size")
    ap.add_argument("--batches", default="", help="comma-separated BxL uniform batches instead of the built-in cases")
    ap.add_argument("--formats", default="", help="comma-separated formats for every case "
                    "(default: all four for the target cases, int4 and int8 for the ragged ones)")
    args = ap.parse_args()
    try:
        HQ, HKV, D = (int(x) for x in args.shape.split("/"))
    except ValueError:
        ap.error(f"--shape: expected HQ/HKV/D, got {args.shape!r}")
    fmts = tuple(f for f in args.formats.split(",") if f)
    bad = [f for f in fmts if f not in FORMATS]
    if bad:
        ap.error(f"--formats: unknown {bad}, choose from {FORMATS}")
    var, _, vals = args.ab.partition("=")
    va, _, vb = vals.partition("/")
    if not var or not va or not vb:
        ap.error(f"--ab: expected VAR=A/B, got {args.ab!r}")

    import torch

    import kvlab
    from kvlab.bench.suite_decode import BLOCK_SIZE, build_batch
    from kvlab.bench.timing import bench_ms
    from kvlab.cuda.attention import plan_paged_attention

    cases = [(f"B={b} L={c}", [c] * b, f)
             for b, c in ((32, 8192), (1, 131072), (64, 4096)) for f in fmts or FORMATS]
    cases += [("B=1 L=32768", [32768], f) for f in fmts or FORMATS[::2]]
    cases += [(name, lens, f) for name, lens in RAGGED.items() for f in fmts or FORMATS[::2]]
    if args.batches:
        try:
            bl = [tuple(int(x) for x in b.split("x")) for b in args.batches.split(",")]
        except ValueError:
            bl = []
        if not bl or not all(len(t) == 2 and t[0] > 0 and t[1] > 0 for t in bl):
            ap.error(f"--batches: expected BxL,..., got {args.batches!r}")
        cases = [(f"B={b} L={c}", [c] * b, f) for b, c in bl for f in fmts or FORMATS]
    lines = [f"{HQ}/{HKV} heads, d = {D}", "",
             f"| case | format | CTAs {va} / {vb} | ms, {var}={va} | ms, {var}={vb} | change | outputs rel L2 | "
             f"lists filled {va} / {vb} | default (unset) |",
             "|---|---|---|---|---|---|---|---|---|"]
    if args.only:
        cases = [c for c in cases if any(x in c[0] for x in args.only.split(","))]
    rows, built = [], {}
    for name, lens, fmt in cases:
        if name not in built:
            built.clear()
            torch.cuda.empty_cache()
            built[name] = build_batch(torch, None, None, HQ, HKV, D, lens=lens)
        b = built[name]
        cache = kvlab.allocate_cache(fmt, b["num_blocks"], BLOCK_SIZE, HKV, D, like=b["key"])
        kvlab.reshape_and_cache(b["key"], b["value"], cache, b["slots"], kv_cache_dtype=fmt)
        a = (b["q"], cache, b["block_table"], b["seq_lens"], b["query_start_loc"])
        plans, outs = {}, {}
        for fill, mode in (("0", va), ("1", vb)):
            os.environ[var] = mode
            plans[fill] = plan_paged_attention(*a, fmt, decode_variant="paged")
            outs[fill] = torch.empty_like(b["q"])
            plans[fill].run(*a, out=outs[fill])
        os.environ.pop(var, None)
        dp = plan_paged_attention(*a, fmt, decode_variant="paged")
        default_s = f"{'filled' if dp.slot_fill else 'weighted'}, {dp.paged_halves} ring(s)"
        fills = " / ".join("yes" if plans[k].slot_fill else "no" for k in ("0", "1"))
        torch.cuda.synchronize()
        o0, o1 = outs["0"].double(), outs["1"].double()
        rel = float(torch.linalg.norm(o1 - o0) / torch.linalg.norm(o0))
        t = {"0": [], "1": []}
        for _ in range(2):
            for fill in ("0", "1"):
                t[fill].append(bench_ms(lambda: plans[fill].run(*a, out=outs[fill]), args.repeats)["median_ms"])
        m0, m1 = sum(t["0"]) / 2, sum(t["1"]) / 2
        line = (f"| {name} | {fmt} | {plans['0'].n_items} / {plans['1'].n_items} | "
                f"{t['0'][0]:.4f} / {t['0'][1]:.4f} | {t['1'][0]:.4f} / {t['1'][1]:.4f} | "
                f"{100 * (m1 / m0 - 1):+.1f} % | {rel:.1e} | {fills} | {default_s} |")
        print(line, flush=True)
        lines.append(line)
        rows.append(dict(case=name, format=fmt, ab=args.ab, ctas=[plans["0"].n_items, plans["1"].n_items],
                         ms_a=t["0"], ms_b=t["1"], rel_l2=rel, slot_fill=[plans["0"].slot_fill, plans["1"].slot_fill],
                         default_fills=dp.slot_fill, default_halves=dp.paged_halves))
        if rel > 1e-2:
            print(f"  outputs disagree: rel L2 {rel:.3e}", flush=True)
        del cache, plans, outs
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "fill_ab.md").write_text("\n".join(lines) + "\n")
        (out / "fill_ab.json").write_text(json.dumps(rows, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

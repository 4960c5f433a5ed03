"""Static per-tile SASS count of the decode kernels' main loop (no GPU), from a --dump of sass_stats.py.

    python scripts/sass_stats.py paged_attention 'decode' --dump all.sass      # whole family: see below
    python scripts/sass_tile_count.py all.sass 'paged_attention_decode_pagedILi3ELi128E13__nv_bfloat16'

For the largest loop of the function (the KV loop) it prints
  * the loop's instruction count,
  * the same without the online-softmax rescale blocks (the instructions between a
    ``VOTE.ANY`` + ``@!P BRA`` and that branch's target: skipped unless some column's max grew,
    i.e. on almost every tile),
  * the number of tile bodies in the loop (HMMA count / (D/16): the P·V mma of one tile) and the
    count per body (masked and full bodies, the paged kernel's producer code and the per-head
    kernel's load pipeline included),
  * with --blocks, the basic blocks of the loop (index range, size, opcode mix), to count one
    path by hand (e.g. the full-tile path of chunk 0 of the paged kernel).

Compile the *whole family* for a dump that is compared with another: NVRTC allocates registers
differently when only a subset of the instantiations is in the program.
"""
from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sass_stats as ss  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sass")
    ap.add_argument("function", help="substring of the mangled name")
    ap.add_argument("--d", type=int, default=128, help="head size (tile body = D/16 HMMA)")
    ap.add_argument("--blocks", action="store_true")
    args = ap.parse_args()
    funcs = ss.parse(Path(args.sass).read_text())
    names = [f for f in funcs if args.function in f]
    if len(names) != 1:
        sys.exit(f"{len(names)} functions match {args.function!r}")
    ins = funcs[names[0]]
    labels = {lab: i for i, (_, _, _, lab) in enumerate(ins) if lab}
    loops = []
    for i, (_, op, opd, _) in enumerate(ins):
        m = re.search(r"`\(\.(L_x_\d+)\)", opd)
        if op.startswith("BRA") and m and m.group(1) in labels and labels[m.group(1)] <= i:
            loops.append((labels[m.group(1)], i))
    a, b = max(loops, key=lambda ab: ab[1] - ab[0])
    skip = set()
    for i in range(a, b + 1):
        if ins[i][1].startswith("VOTE.ANY"):
            for k in range(i + 1, min(i + 4, b + 1)):
                op, opd = ins[k][1], ins[k][2]
                m = re.search(r"`\(\.(L_x_\d+)\)", opd)
                if op.startswith("BRA") and m and labels.get(m.group(1), -1) > k:
                    skip.update(range(k + 1, labels[m.group(1)]))
                    break
    body = [ins[i] for i in range(a, b + 1) if i not in skip]
    mix = collections.Counter(ss.op_class(op) for _, op, _, _ in body)
    nbody = mix.get("HMMA", 0) / (args.d // 16)
    print(f"{names[0][:80]}")
    print(f"  loop [{a}..{b}]: {b - a + 1} instructions, {len(skip)} in rescale blocks, "
          f"{len(body)} without them")
    print(f"  tile bodies: {nbody:g}  ->  {len(body) / nbody:.1f} instructions per body (rescale excluded)")
    print("  mix: " + ", ".join(f"{k} {v}" for k, v in mix.most_common(30)))
    if args.blocks:
        lead = {a}
        for i in range(a, b + 1):
            if ins[i][3]:
                lead.add(i)
            if ins[i][1].startswith(("BRA", "EXIT", "RET", "BRX", "CALL", "WARPSYNC", "BSYNC")):
                lead.add(i + 1)
        lead = sorted(x for x in lead if a <= x <= b) + [b + 1]
        for s, e in zip(lead, lead[1:]):
            blk = ins[s:e]
            bm = collections.Counter(ss.op_class(op) for _, op, _, _ in blk)
            tag = " (rescale)" if s in skip else ""
            last = blk[-1][1] + (" " + blk[-1][2].strip() if blk[-1][1].startswith("BRA") else "")
            print(f"  [{s:5d}..{e - 1:5d}] {e - s:4d} {blk[0][3] or '':10s}{tag} last={last[:50]}  "
                  + ",".join(f"{k}{v}" for k, v in bm.most_common(6)))


if __name__ == "__main__":
    main()

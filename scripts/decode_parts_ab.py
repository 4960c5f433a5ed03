"""Does the paged decode's loop keep its rate on fewer SMs? Parts per sequence, A B A B.

    python3 scripts/decode_parts_ab.py [--cases 32x8192:4,3;64x4096:2] [--formats ...]
                                       [--repeats 30] [--out DIR]

A question for a design (docs/perf-notes.md, "Session 33"): at B = 32 × 8k the plan cuts each
sequence into 4 parts (128 dual-ring CTAs) and merges them with a second kernel (~5 µs). Four
parts cannot meet in one thread-block cluster (clusters of 4 fit only 120 dual-ring CTAs), three
can (96 CTAs), and a merge through distributed shared memory inside the cluster would replace
the merge kernel. That only pays if the loop on 96 SMs streams about as fast as on 128.

For each case ``BxL:s1,s2,…`` and format this times, in one process, the plan with each forced
split count ``s`` (``plan_paged_attention(num_splits=s)``): the whole call (decode + merge) and
the decode kernel alone (``n_red = 0``: the partials are written, the output is not attention),
alternating A B A B; and the paged read floor's fastest one-CTA-per-SM ring form
(``floors.paged_floor_configs``) reading the same bytes with as many CTAs as each plan launches.
Timing: ``kvlab.bench.timing.bench_ms`` (cold L2, launch hidden). 32 / 8 heads, d = 128, block
16, shuffled blocks (the decode suite's ``build_batch``). Prints a Markdown table, writes it and
a JSON to ``--out``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FORMATS = ("int8_per_token_head", "fp8_per_token_head", "int4_per_token_head")


def parse_cases(text: str) -> list[tuple[int, int, tuple[int, ...]]]:
    """``"32x8192:4,3;64x4096:2"`` -> ``[(32, 8192, (4, 3)), (64, 4096, (2,))]``."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        shape, _, splits = part.partition(":")
        b, _, ctx = shape.partition("x")
        try:
            ss = tuple(int(s) for s in splits.split(",")) if splits else ()
            out.append((int(b), int(ctx), ss))
        except ValueError:
            raise SystemExit(f"--cases: expected BxL:s1,s2 separated by ';', got {part!r}") from None
        if not ss or min(ss) < 1 or int(b) < 1 or int(ctx) < 16:
            raise SystemExit(f"--cases: {part!r} needs B ≥ 1, L ≥ 16 and at least one split count ≥ 1")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="32x8192:4,3;64x4096:2")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    cases = parse_cases(args.cases)

    import cupy
    import torch

    import kvlab
    from kvlab.bench import floors
    from kvlab.bench.suite_decode import BLOCK_SIZE, build_batch
    from kvlab.bench.timing import bench_ms
    from kvlab.cuda.attention import plan_paged_attention

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from decode_ceiling import case_arrays, case_bytes, fastest_one_per_sm, probe_ms

    Hq, Hkv, d = 32, 8, 128
    n_sm = cupy.cuda.Device().attributes["MultiProcessorCount"]
    name_gpu = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    head = f"{name_gpu}, {n_sm} SMs; 32/8 heads, d = {d}, block {BLOCK_SIZE}; medians of {args.repeats}, A B A B"
    print(head, flush=True)
    lines = ["| case | format | splits | CTAs (form) | call ms (two runs) | decode alone ms | merge µs | "
             "reader at these CTAs ms |", "|---|---|---|---|---|---|---|---|"]
    rows = []
    for B, ctx, splits in cases:
        b = build_batch(torch, B, ctx, Hq, Hkv, d)
        for name in args.formats.split(","):
            a, out = case_arrays(kvlab, torch, b, name, Hkv, d)
            plans = {s: plan_paged_attention(*a, name, num_splits=s, decode_variant="paged") for s in splits}
            t = {s: {"call": [], "bare": []} for s in splits}
            for _ in range(2):
                for s, plan in plans.items():
                    bare = dataclasses.replace(plan, n_red=0)
                    t[s]["call"].append(bench_ms(lambda: plan.run(*a, out=out), args.repeats)["median_ms"])
                    t[s]["bare"].append(bench_ms(lambda: bare.run(*a, out=out), args.repeats)["median_ms"])
            nbytes, block = case_bytes(name, B, ctx, Hkv, d)
            src = floors._SOURCE.get(2 * nbytes)
            one_cfg = fastest_one_per_sm(block, n_sm, nbytes, src, args.repeats)
            if one_cfg is None:
                raise SystemExit(f"{name}: the paged read floor has no one-CTA-per-SM form for {block}-byte blocks")
            grids = sorted({n_sm, *(min(p.n_items, n_sm) for p in plans.values())})
            reader = {g: [] for g in grids}
            for _ in range(2):
                for g in grids:
                    ms, nread = probe_ms(one_cfg, g, nbytes, src, args.repeats)
                    reader[g].append(ms * nbytes / nread)
            floors.release()
            for s, plan in plans.items():
                mc, mb = (sum(v) / 2 for v in (t[s]["call"], t[s]["bare"]))
                g = min(plan.n_items, n_sm)
                form = "dual ring" if plan.paged_halves == 2 else "two per SM"
                line = (f"| B={B} × {ctx} | {name} | {s} | {plan.n_items} ({form}) | "
                        f"{t[s]['call'][0]:.4f} / {t[s]['call'][1]:.4f} | "
                        f"{t[s]['bare'][0]:.4f} / {t[s]['bare'][1]:.4f} | {(mc - mb) * 1e3:.1f} | "
                        f"{reader[g][0]:.4f} / {reader[g][1]:.4f} |")
                print(line, flush=True)
                lines.append(line)
                rows.append(dict(case=f"B={B} L={ctx}", format=name, splits=s, ctas=plan.n_items,
                                 halves=plan.paged_halves, n_red=plan.n_red, call_ms=t[s]["call"],
                                 bare_ms=t[s]["bare"], reader_ms=reader[g], reader_grid=g))
            line = (f"| B={B} × {ctx} | {name} | reader, all {n_sm} SMs | {one_cfg.name} | | | | "
                    f"{reader[n_sm][0]:.4f} / {reader[n_sm][1]:.4f} |")
            print(line, flush=True)
            lines.append(line)
            del a, out, plans
        del b
        torch.cuda.empty_cache()
    text = head + "\n\n" + "\n".join(lines)
    print(text)
    if args.out:
        o = Path(args.out)
        o.mkdir(parents=True, exist_ok=True)
        (o / "decode_parts_ab.md").write_text(text + "\n")
        (o / "decode_parts_ab.json").write_text(json.dumps(dict(header=head, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

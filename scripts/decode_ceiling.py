"""How much could the paged decode gain from its fixed parts? Two ceilings, measured in one
process on the target cases (docs/perf-notes.md "Session 28"):

* **the merge's share**: the plan's call (decode kernel + split merge) against the same plan with
  the merge left out (``n_red = 0``: the decode kernel alone, which writes the split partials; its
  output is *not* the attention output). The difference is what any change to the merge —
  fused into the decode's last CTA, flags, clusters — could save at most.
* **the idle SMs' share**: the paged read floor's fastest ring form (``floors.paged_floor_configs``)
  reading the case's bytes with one CTA per SM (the SM count) against the same form with as many
  CTAs as the plan launches (B = 32 × 8k: 128 for 132 SMs), equal bytes per CTA. Where that form
  runs two CTAs per SM, "all slots" is 264 CTAs against the plan's 128 at one per SM: the
  difference then mixes the 4 idle SMs with half the bytes in flight per SM, an upper bound
  (session 30). So a second pair isolates the SM count: the fastest **one-CTA-per-SM** form at
  one CTA per SM against the same form at the plan's CTA count (only where the plan launches at
  most one CTA per SM; the dual-ring decode CTA holds its SM alone, as this form's CTA does).

    python3 scripts/decode_ceiling.py [--repeats 30] [--out DIR] [--cases 32x8192,1x131072,64x4096]
                                      [--formats int4_per_token_head,nvfp4,...]

Timing: ``kvlab.bench.timing.bench_ms`` (cold L2, launch hidden), A B A B. 32 / 8 heads, d = 128,
block 16, shuffled blocks (the decode suite's ``build_batch``). Prints a Markdown table and writes
it with a JSON.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FORMATS = ("int4_per_token_head", "nvfp4", "int8_per_token_head", "fp8_per_token_head")


def probe_ms(cfg, grid, nbytes, src, repeats):
    """Median ms of ``cfg`` reading ~``nbytes`` as ``grid`` CTAs of equal chunk counts, scaled to
    exactly ``nbytes`` (the chunk count per CTA is rounded); returns (ms, bytes read)."""
    import cupy

    from kvlab.bench.timing import bench_ms
    from kvlab.cuda.ring_probe import THREADS, chunk_offsets, stream

    per_cta = max(1, round(nbytes / cfg.chunk / grid))
    nread = grid * per_cta * cfg.chunk
    offs = cupy.asarray(chunk_offsets(cfg, grid, per_cta))
    sink = cupy.empty(grid * THREADS, cupy.uint32)
    stream(cfg, src, offs, grid, per_cta, sink)
    cupy.cuda.runtime.deviceSynchronize()
    r = bench_ms(lambda: stream(cfg, src, offs, grid, per_cta, sink), repeats=repeats)
    return r["median_ms"], nread


def case_arrays(kvlab, torch, b, name, Hkv, d):
    """The case ``b`` (``build_batch``) written into a fresh ``name`` cache: the five arguments of
    ``plan_paged_attention`` / ``AttentionPlan.run`` and an output buffer shaped like q."""
    from kvlab.bench.suite_decode import BLOCK_SIZE

    cache = kvlab.allocate_cache(name, b["num_blocks"], BLOCK_SIZE, Hkv, d, like=b["key"])
    kvlab.reshape_and_cache(b["key"], b["value"], cache, b["slots"], kv_cache_dtype=name)
    return (b["q"], cache, b["block_table"], b["seq_lens"], b["query_start_loc"]), torch.empty_like(b["q"])


def case_bytes(name, B, ctx, Hkv, d):
    """(bytes of the K and V rows the case reads, bytes of one cache block, K and V) for format
    ``name`` at the decode suite's block size."""
    from kvlab.bench.suite_decode import BLOCK_SIZE, _row_bytes

    rb = _row_bytes(name, d)
    return 2 * B * ctx * Hkv * rb, 2 * BLOCK_SIZE * Hkv * rb


def fastest_one_per_sm(block, n_sm, nbytes, src, repeats):
    """The paged read floor's fastest ring form with one CTA per SM (timed once on all ``n_sm``
    SMs), or None when ``floors.paged_floor_configs(block)`` has none."""
    from kvlab.bench import floors

    ones = [c for c in floors.paged_floor_configs(block) if c.ctas_per_sm == 1]
    return min(ones, key=lambda c: probe_ms(c, n_sm, nbytes, src, repeats)[0]) if ones else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", default="")
    ap.add_argument("--cases", default="32x8192,1x131072,64x4096")
    ap.add_argument("--formats", default=",".join(FORMATS))
    args = ap.parse_args()

    import cupy
    import torch

    import kvlab
    from kvlab.bench import floors
    from kvlab.bench.suite_decode import build_batch
    from kvlab.bench.timing import bench_ms
    from kvlab.cuda.attention import plan_paged_attention

    Hq, Hkv, d = 32, 8, 128
    n_sm = cupy.cuda.Device().attributes["MultiProcessorCount"]
    lines = ["| case | format | plan CTAs | call ms (A/A) | no merge ms (B/B) | merge share µs | "
             "probe 1/SM ms | probe at plan CTAs ms | idle-SM share µs | probe form | "
             "1-CTA/SM form: all SMs / plan CTAs ms | idle SMs alone µs |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    rows = []
    for case in args.cases.split(","):
        B, ctx = (int(x) for x in case.split("x"))
        b = build_batch(torch, B, ctx, Hq, Hkv, d)
        for name in args.formats.split(","):
            a, out = case_arrays(kvlab, torch, b, name, Hkv, d)
            plan = plan_paged_attention(*a, name)
            bare = dataclasses.replace(plan, n_red=0)
            t = {"call": [], "bare": []}
            for _ in range(2):
                t["call"].append(bench_ms(lambda: plan.run(*a, out=out), args.repeats)["median_ms"])
                t["bare"].append(bench_ms(lambda: bare.run(*a, out=out), args.repeats)["median_ms"])
            nbytes, block = case_bytes(name, B, ctx, Hkv, d)
            pf = floors.paged_read_floor(nbytes, block, args.repeats)
            cfg = next(c for c in floors.paged_floor_configs(block) if c.name == pf["config"])
            src = floors._SOURCE.get(2 * nbytes)
            grid_full = cfg.ctas_per_sm * n_sm
            grid_plan = plan.n_items if cfg.ctas_per_sm == 1 else min(plan.n_items, grid_full)
            p = {"full": [], "plan": []}
            for _ in range(2):
                for key, g in (("full", grid_full), ("plan", grid_plan)):
                    ms, nread = probe_ms(cfg, g, nbytes, src, args.repeats)
                    p[key].append(ms * nbytes / nread)
            # the SM count alone: the fastest form with one CTA per SM, n_sm CTAs against the plan's
            one = {"full": [], "plan": []}
            one_cfg = None
            if plan.n_items <= n_sm:
                one_cfg = fastest_one_per_sm(block, n_sm, nbytes, src, args.repeats)
                if one_cfg:
                    for _ in range(2):
                        for key, g in (("full", n_sm), ("plan", plan.n_items)):
                            ms, nread = probe_ms(one_cfg, g, nbytes, src, args.repeats)
                            one[key].append(ms * nbytes / nread)
            floors.release()
            row = dict(case=f"B={B} L={ctx}", format=name, plan_ctas=plan.n_items, n_red=plan.n_red,
                       variant=plan.decode_variant, call_ms=t["call"], bare_ms=t["bare"],
                       probe_full_ms=p["full"], probe_plan_ms=p["plan"], probe_config=cfg.name,
                       grid_full=grid_full, grid_plan=grid_plan, paged_floor_ms=pf["median_ms"],
                       one_cta_config=one_cfg.name if one_cfg else None, one_cta_full_ms=one["full"],
                       one_cta_plan_ms=one["plan"])
            rows.append(row)
            mc, mb = (sum(v) / 2 for v in (t["call"], t["bare"]))
            pfm, ppm = (sum(v) / 2 for v in (p["full"], p["plan"]))
            lines.append(f"| B={B} × {ctx} | {name} | {plan.n_items} ({plan.decode_variant}, {plan.n_red} merges) | "
                         f"{t['call'][0]:.4f} / {t['call'][1]:.4f} | {t['bare'][0]:.4f} / {t['bare'][1]:.4f} | "
                         f"{(mc - mb) * 1e3:.1f} | {p['full'][0]:.4f} / {p['full'][1]:.4f} ({grid_full}) | "
                         f"{p['plan'][0]:.4f} / {p['plan'][1]:.4f} ({grid_plan}) | {(ppm - pfm) * 1e3:.1f} | {cfg.name} | "
                         + (f"{sum(one['full']) / 2:.4f} / {sum(one['plan']) / 2:.4f} ({one_cfg.name}) | "
                            f"{(sum(one['plan']) - sum(one['full'])) / 2 * 1e3:.1f} |" if one_cfg else "n/a | n/a |"))
            print(lines[-1], flush=True)
            del a, out, plan, bare
        del b
        torch.cuda.empty_cache()
    text = "\n".join(lines)
    print(text)
    if args.out:
        o = Path(args.out)
        o.mkdir(parents=True, exist_ok=True)
        (o / "decode_ceiling.md").write_text(text + "\n")
        (o / "decode_ceiling.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

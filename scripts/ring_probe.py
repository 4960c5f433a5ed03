"""Sweep the ring probe (kernels_cu/ring_probe.cu) on the GPU: which way of streaming a paged
cache from HBM into the SMs reaches the copy bandwidth? (docs/perf-notes.md, "Session 10").

    python3 scripts/ring_probe.py [--mb 285] [--repeats 30] [--only NAME,NAME] [--out DIR]
    python3 scripts/ring_probe.py --mb 553.6 --only "tensor,int8 blocks,auto (32"   # session 22

Each configuration reads the same number of bytes (``--mb``, default the int4 cache of the
decode target, B = 32 × 8k × 8 heads × d = 128) once per timed call, L2 flushed before each call
(kvlab.bench.timing.bench_ms). Prints a Markdown table (GB/s of bytes read, fraction of the
device-to-device copy measured in the same process) and writes it with a JSON next to it.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvlab.cuda.ring_probe import THREADS, RingConfig, chunk_offsets, stream, tensor_rows  # noqa: E402

# The paged decode at the int4 target: 4 chunks of 16 tokens × 8 heads × 68 B per stage (K and
# V of two blocks), 3 stages, thread 0 issues, 2 CTAs per SM, shuffled blocks.
BASE = RingConfig("decode int4 (as built)")


def configs() -> list[RingConfig]:
    b = BASE
    return [
        b,
        replace(b, name="  grid 256 (as the bench)", grid=256),
        replace(b, name="  contiguous", layout="contig"),
        replace(b, name="  no touch", touch=False),
        replace(b, name="  evict_first", evict_first=True),
        replace(b, name="  nbuf 2", nbuf=2),
        replace(b, name="  1 CTA/SM, nbuf 3", ctas_per_sm=1),
        replace(b, name="  1 CTA/SM, nbuf 6", ctas_per_sm=1, nbuf=6),
        replace(b, name="  3 CTAs/SM, nbuf 2", ctas_per_sm=3, nbuf=2),
        replace(b, name="  4 CTAs/SM, 2 chunks/stage, nbuf 3", ctas_per_sm=4, per_stage=2, nbuf=3),
        replace(b, name="  8 CTAs/SM, 1 chunk/stage, nbuf 2", ctas_per_sm=8, per_stage=1, nbuf=2),
        replace(b, name="  split 2 (4.3 KB copies)", split=2),
        replace(b, name="  split 4 (2.2 KB copies)", split=4),
        replace(b, name="  split 8 (1.1 KB copies)", split=8),
        replace(b, name="  warp issues", mode="bulk_warp"),
        replace(b, name="  warp issues, split 4", mode="bulk_warp", split=4),
        replace(b, name="  warp issues, split 8", mode="bulk_warp", split=8),
        replace(b, name="  warp issues, split 4, 1 CTA/SM nbuf 6", mode="bulk_warp", split=4,
                ctas_per_sm=1, nbuf=6),
        RingConfig("auto (32 KB chunks, 2/stage, 1 CTA/SM)", chunk=32768, per_stage=2, nbuf=3, ctas_per_sm=1),
        RingConfig("  warp issues, split 8", mode="bulk_warp", chunk=32768, per_stage=2, nbuf=3,
                   ctas_per_sm=1, split=8),
        # the int8 decode's dual ring stages one 16-token block (8 heads × 132 B) per copy
        RingConfig("int8 blocks (16.9 KB chunks, 2/stage, 4 stages, 1 CTA/SM)", chunk=16896, per_stage=2,
                   nbuf=4, ctas_per_sm=1),
        # a split by KV heads (docs/perf-notes.md "Session 22"): each CTA stages 2 of the 8 int8
        # heads (264 B of each 1,056 B token row) of one sequence's shuffled blocks, a 2-D tensor
        # copy per block side (16 rows × 272 B; the 4th group's boxes run 8 B past the row)
        *[RingConfig(f"tensor int8 2 heads, {ps} boxes/stage, {nb} stages, grid {g}", mode="tensor",
                     layout="heads", chunk=16 * 272, per_stage=ps, nbuf=nb, row_bytes=1056, col_step=264,
                     grid=g)
          for ps, nb, g in ((4, 4, 128), (4, 8, 128), (8, 4, 128), (2, 8, 128), (4, 4, 256), (4, 2, 256))],
        # int4 (8 heads × 68 B): 4 heads a box (272 B), so 2 column groups
        RingConfig("tensor int4 4 heads, 4 boxes/stage, 4 stages, grid 128", mode="tensor", layout="heads",
                   chunk=16 * 272, per_stage=4, nbuf=4, row_bytes=544, col_step=272, grid=128),
        RingConfig("loads, 4 CTAs/SM, paged", mode="loads", ctas_per_sm=4),
        RingConfig("loads, 8 CTAs/SM, paged", mode="loads", ctas_per_sm=8),
        RingConfig("loads, 8 CTAs/SM, contiguous", mode="loads", ctas_per_sm=8, layout="contig"),
    ]


def _per_cta(c: RingConfig, grid: int, nbytes: int) -> int:
    """Chunks per CTA (even: a block's K and V) so that the grid reads ~``nbytes``."""
    return max(2, int(round(nbytes / c.chunk / grid / 2)) * 2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=285.2, help="bytes read per call, MB (default 285.2)")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--only", default="", help="comma-separated substrings of configuration names")
    ap.add_argument("--out", default="", help="folder for ring_probe.md / ring_probe.json")
    args = ap.parse_args()

    import cupy

    from kvlab.bench.timing import bench_ms, copy_bandwidth_gbps, gbps

    dev = cupy.cuda.Device()
    n_sm = dev.attributes["MultiProcessorCount"]
    nbytes_target = int(args.mb * 1e6)
    cfgs = [c for c in configs() if not args.only or any(s in c.name for s in args.only.split(","))]
    max_bytes = max(nbytes_target + 4 * c.chunk * (c.grid or c.ctas_per_sm * n_sm) for c in cfgs)
    for c in cfgs:   # a tensor-mode source holds whole rows of every column group
        if c.mode == "tensor":
            g = c.grid or c.ctas_per_sm * n_sm
            max_bytes = max(max_bytes, tensor_rows(c, g, _per_cta(c, g, nbytes_target)) * c.row_bytes)
    src = cupy.random.randint(0, 2**31 - 1, size=(max_bytes + 15) // 4, dtype=cupy.int32).view(cupy.uint8)
    sink = cupy.zeros(max((c.grid or c.ctas_per_sm * n_sm) for c in cfgs) * THREADS, cupy.uint32)
    copy = copy_bandwidth_gbps(2 * nbytes_target)
    props = cupy.cuda.runtime.getDeviceProperties(dev.id)
    head = (f"{props['name'].decode()}, {n_sm} SMs; {args.mb:.1f} MB read per call; d2d copy "
            f"{copy:.0f} GB/s (read + write); median of {args.repeats} calls, L2 flushed before each")
    print(head, flush=True)
    rows = []
    lines = ["| configuration | mode | chunk B | chunks/stage | nbuf | split | CTAs | smem KB/SM | ms | GB/s | of copy |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in cfgs:
        grid = c.grid or c.ctas_per_sm * n_sm
        per_cta = _per_cta(c, grid, nbytes_target)
        offs = cupy.asarray(chunk_offsets(c, grid, per_cta))
        nbytes = grid * per_cta * c.chunk
        try:
            stream(c, src, offs, grid, per_cta, sink)
            cupy.cuda.runtime.deviceSynchronize()
            t = bench_ms(lambda: stream(c, src, offs, grid, per_cta, sink), repeats=args.repeats)
        except Exception as e:  # noqa: BLE001 — a config that does not launch is a row, not a crash
            print(f"{c.name}: {type(e).__name__}: {e}", flush=True)
            rows.append(dict(asdict(c), error=str(e)))
            continue
        bw = gbps(nbytes, t["median_ms"])
        per_sm = -(-grid // n_sm)
        line = (f"| {c.name} | {c.mode} | {c.chunk} | {c.per_stage} | {c.nbuf if c.mode != 'loads' else '-'} | "
                f"{c.split} | {grid} | {per_sm * c.smem_bytes() / 1024:.0f} | {t['median_ms']:.4f} | {bw:.0f} | "
                f"{bw / copy:.2f} |")
        print(line, flush=True)
        lines.append(line)
        rows.append(dict(asdict(c), grid=grid, chunks_per_cta=per_cta, bytes=nbytes, gbps=bw,
                         of_copy=bw / copy, **t))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "ring_probe.md").write_text(head + "\n\n" + "\n".join(lines) + "\n")
        (out / "ring_probe.json").write_text(json.dumps(dict(header=head, copy_gbps=copy, rows=rows), indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

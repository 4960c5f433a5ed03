"""Which 2-D tensor-copy geometries run on this GPU? (a diagnostic for the ring probe's tensor mode,
docs/perf-notes.md "Session 22"). Each case runs in a fresh process (an illegal instruction
leaves its CUDA context unusable): one small probe launch with the case's tensor-map element
size, box and L2 promotion, checked word for word against the NumPy model.

    python3 scripts/tensor_copy_check.py
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# (row_bytes, col_step, box row bytes, box rows, L2 promotion)
# (boxes start at each group's first byte rounded down to 16: ring_probe.group_starts; session 22's
# first runs, with starts at 264-byte steps, raised an illegal instruction)
CASES = [
    (1056, 264, 272, 16, 3), (1056, 264, 272, 16, 0), (1024, 256, 256, 16, 0),
    (1024, 256, 272, 16, 0),   # the last group's box runs 16 B past the row's end
    (1024, 512, 512, 8, 0), (544, 272, 272, 16, 0), (256, 128, 128, 8, 0), (256, 128, 128, 8, 3),
]

CHILD = r"""
import sys, numpy as np, cupy
sys.path.insert(0, {root!r})
import kvlab.cuda.ring_probe as rp
from kvlab.cuda.ring_probe import RingConfig, chunk_offsets, expected_sink, stream, tensor_rows, THREADS
row, step, bb, br, l2 = {case!r}
cfg = RingConfig("c", mode="tensor", layout="heads", chunk=bb * br, box_rows=br, per_stage=2, nbuf=2,
                 row_bytes=row, col_step=step)
cfg.check()
orig = rp._tensor_map.__wrapped__
rp._tensor_map = lambda *a: orig(*a[:7], l2)
grid, per = 4, 4
src = np.random.default_rng(0).integers(0, 256, tensor_rows(cfg, grid, per) * row, dtype=np.uint8)
offs = chunk_offsets(cfg, grid, per, seed=1)
sink = cupy.full(grid * THREADS, 0xDEADBEEF, cupy.uint32)
stream(cfg, cupy.asarray(src), cupy.asarray(offs), grid, per, sink)
got = cupy.asnumpy(sink)
print("match" if np.array_equal(got, expected_sink(cfg, src, offs, grid, per)) else "MISMATCH")
"""


def main() -> int:
    for case in CASES:
        r = subprocess.run([sys.executable, "-c", CHILD.format(root=str(ROOT), case=case)],
                           capture_output=True, text=True, timeout=120)
        last = (r.stdout.strip().splitlines() or [""])[-1]
        err = [x for x in r.stderr.splitlines() if "Error" in x][-1:] if r.returncode else []
        print(f"row {case[0]:5d} B, step {case[1]:4d}, box {case[2]:3d} B x {case[3]:2d}, L2 {case[4]}: "
              f"{last or 'rc ' + str(r.returncode)} {' '.join(err)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

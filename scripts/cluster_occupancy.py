"""How many thread-block clusters of the paged decode kernels can be resident at once (sm_90).

    python3 scripts/cluster_occupancy.py [--sizes 1,2,4,8]

A question for a design, not a benchmark: a cluster of the CTAs that share one sequence could
merge their softmax states through distributed shared memory (DSMEM) instead of the split merge
kernel (docs/perf-notes.md, "Session 21"), but only if the GPU can hold the whole work list as
clusters in one wave. For each paged-decode kernel of the B = 32 × 8k benchmark shape (32/8
heads, d = 128, its dynamic shared memory as the plan sizes it) the driver's
cuOccupancyMaxActiveClusters answers, per cluster size, how many clusters fit at once; the
table prints that number times the cluster size (CTAs resident) next to the SM count.
"""
from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvlab.cuda import attention, launch, loader  # noqa: E402

CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1,2,4,8", help="cluster sizes (comma-separated, ≤ 8)")
    a = ap.parse_args()
    import cupy

    sizes = [int(s) for s in a.sizes.split(",")]
    if any(s < 1 or s > 8 for s in sizes):
        raise SystemExit("--sizes: 1 … 8 (portable cluster sizes)")
    lib = ctypes.CDLL("libcuda.so.1")
    fn = lib.cuOccupancyMaxActiveClusters
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_void_p, ctypes.POINTER(launch._LaunchConfig)]
    n_sm = cupy.cuda.Device().attributes["MultiProcessorCount"]
    H, ny, d = 8, 8, 128
    print(f"{cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}, {n_sm} SMs; 32/8 heads, d = {d}")
    print("| kernel | threads | dynamic smem | " + " | ".join(f"cluster {s}: CTAs resident" for s in sizes) + " |")
    print("|---|---|---|" + "---|" * len(sizes))
    for code, name in ((1, "int8"), (2, "fp8"), (3, "int4"), (4, "nvfp4")):
        for nh in (1, 2):
            spec = loader.KernelSpec(attention.FAMILY, "paged_attention_decode_paged",
                                     (code, d, "bfloat16") if nh == 1 else (code, d, "bfloat16", 2))
            try:
                k = loader.get_kernel(spec)
            except ValueError:
                continue
            nbuf = 2
            smem = attention.paged_smem_bytes(code, d, H, ny, nbuf, nh)
            k.max_dynamic_shared_size_bytes = int(smem)
            func = getattr(k, "kernel", k)   # cupy.RawKernel -> its cupy.cuda.Function
            cells = []
            for s in sizes:
                attr = launch._LaunchAttribute()
                attr.id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
                dims = (ctypes.c_uint * 3).from_buffer(attr.value)
                dims[0], dims[1], dims[2] = s, 1, 1
                cfg = launch._LaunchConfig(s * 16, 1, 1, ny * 32 * nh, 1, 1, int(smem), None,
                                           ctypes.pointer(attr), 1)
                out = ctypes.c_int(-1)
                rc = fn(ctypes.byref(out), ctypes.c_void_p(func.ptr), ctypes.byref(cfg))
                cells.append(f"{out.value * s} ({out.value} clusters)" if rc == 0 else f"CUresult {rc}")
            form = "dual ring" if nh == 2 else "two per SM"
            print(f"| {name} {form} | {ny * 32 * nh} | {smem} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()

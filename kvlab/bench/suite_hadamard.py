"""Benchmark suite ``hadamard``: the standalone RHT / WHT along the last axis.

bf16 rows, 2^27 elements in total per case (256 MiB in + 256 MiB out, far above L2):
head sizes 64, 128, 256, 512 for the RHT, and at 128 also the WHT and the inverse RHT.
Bytes = input read + output written. Baselines in the same process: a device-to-device copy
of the same bytes, and torch ``x @ (diag(s)·H)`` in bf16 (a tensor-core matmul with the
±1 matrix — the "rotation as a GEMM" path).
"""
from __future__ import annotations

from .timing import bench_ms, copy_bench, gbps

NAME = "hadamard"
TOTAL_ELEMENTS = 1 << 27
CASES = ((128, "rht"), (128, "inverse_rht"), (128, "wht"), (64, "rht"), (256, "rht"), (512, "rht"))


def run(quick: bool, progress) -> list[dict]:
    import numpy as np
    import torch

    from kvlab.cuda.hadamard import launch_rows
    from kvlab.reference.hadamard import hadamard_matrix, rht_signs

    repeats = 10 if quick else 50
    progress.total(len(CASES))
    rows = []
    for d, mode in CASES:
        n = TOTAL_ELEMENTS // d
        g = torch.Generator(device="cuda").manual_seed(d)
        x = torch.randn((n, d), device="cuda", dtype=torch.bfloat16, generator=g)
        out = torch.empty_like(x)
        nbytes = 2 * x.numel() * x.element_size()
        case = f"{n} rows x d={d} bf16"

        m = hadamard_matrix(d)
        if mode == "rht":
            m = rht_signs(d)[:, None] * m                       # y = x · diag(s) · H
        elif mode == "inverse_rht":
            m = m * rht_signs(d)[None, :] / d                   # x = y · H · diag(s) / d
        mat = torch.from_numpy(np.ascontiguousarray(m, dtype=np.float32)).to("cuda", torch.bfloat16)
        out_t = torch.empty_like(x)
        base = bench_ms(lambda: torch.matmul(x, mat, out=out_t), repeats)
        cp = copy_bench(nbytes, repeats)
        r = bench_ms(lambda: launch_rows(x, out, mode), repeats)
        bw = gbps(nbytes, r["median_ms"])
        rows.append(dict(suite=NAME, case=f"{case} {mode}", impl=f"kvlab {mode}", median_ms=r["median_ms"],
                         bytes=nbytes, gbps=bw, frac_of_copy=bw / cp["gbps"],
                         ratio_vs_baseline=r["median_ms"] / base["median_ms"],
                         notes=f"copy {cp['gbps']:.0f} GB/s at these bytes",
                         p10_ms=r["p10_ms"], p90_ms=r["p90_ms"], copy_gbps=cp["gbps"]))
        bwt = gbps(nbytes, base["median_ms"])
        rows.append(dict(suite=NAME, case=f"{case} {mode}", impl="torch bf16 matmul (baseline)",
                         median_ms=base["median_ms"], bytes=nbytes, gbps=bwt, frac_of_copy=bwt / cp["gbps"],
                         ratio_vs_baseline=1.0, notes="x @ (±1 matrix), tensor cores",
                         p10_ms=base["p10_ms"], p90_ms=base["p90_ms"]))
        progress(f"{case} {mode}")
        del x, out, out_t
        torch.cuda.empty_cache()
    return rows

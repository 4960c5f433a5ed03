"""Benchmark suite ``write``: fused quantize-and-write (``reshape_and_cache``) for every format.

Shapes: 65,536 tokens × 8 KV heads × head size 128, bf16 K/V in (the issue-3 target shape),
and 4,096 tokens (the shape of the quoted vLLM Triton INT4 measurement). Block size 16,
slots = whole blocks in random block order (how prefill fills a paged cache).

Bytes per operation = K + V read (2·T·H·d·2) + cache rows written (2·T·H·row_bytes)
+ slot_mapping read (8·T). Baselines in the same process:

* a device-to-device copy moving the same bytes (``frac_of_copy``);
* torch: ``index_copy_`` of K and V into a bf16 paged cache — the bf16 write every format is
  compared with (``ratio_vs_baseline`` = time / that time);
* vLLM's Triton INT4 write, 0.27 ms for 4,096 × 8 × 128 on an H200 (issue 3; 0.12 ms of it
  the rotation pass) — quoted, not run here; the int4 rows' notes give the per-token ratio.
"""
from __future__ import annotations

from .timing import bench_ms, copy_bench, gbps

NAME = "write"
FORMATS = ("auto", "int8_per_token_head", "fp8_per_token_head", "int4_per_token_head", "nvfp4")
H, D, BLOCK_SIZE = 8, 128, 16
TOKENS = (65536, 4096)
VLLM_TRITON_INT4_MS = 0.27      # 4,096 tokens × 8 heads × 128, H200 (issue 3)
VLLM_TRITON_INT4_TOKENS = 4096


def run(quick: bool, progress) -> list[dict]:
    import torch

    import kvlab
    from kvlab.cuda.cache import launch_reshape_and_cache

    repeats = 10 if quick else 50
    progress.total(len(TOKENS) * (len(FORMATS) + 1))
    rows = []
    for T in TOKENS:
        g = torch.Generator(device="cuda").manual_seed(1234 + T)
        key = torch.randn((T, H, D), device="cuda", dtype=torch.bfloat16, generator=g)
        value = torch.randn((T, H, D), device="cuda", dtype=torch.bfloat16, generator=g)
        nb = T // BLOCK_SIZE
        perm = torch.randperm(nb, device="cuda", generator=g)
        t = torch.arange(T, device="cuda")
        slots = (perm[t // BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE).to(torch.int64)
        read_bytes = 2 * T * H * D * 2 + 8 * T
        case = f"T={T} H={H} d={D} bf16"

        # torch baseline: index_copy_ of K and V into a bf16 paged cache (NHD, K/V interleaved per block)
        cache_bf16 = torch.empty((nb, 2, BLOCK_SIZE, H, D), device="cuda", dtype=torch.bfloat16)
        flat = cache_bf16.view(nb * 2 * BLOCK_SIZE, H, D)
        k_rows = (slots // BLOCK_SIZE) * 2 * BLOCK_SIZE + slots % BLOCK_SIZE
        v_rows = k_rows + BLOCK_SIZE

        def torch_write():
            flat.index_copy_(0, k_rows, key)
            flat.index_copy_(0, v_rows, value)

        base = bench_ms(torch_write, repeats)
        nbytes_bf16 = read_bytes + 2 * T * H * D * 2
        cp = copy_bench(nbytes_bf16, repeats)
        rows.append(dict(suite=NAME, case=case, impl="d2d copy (bf16 write's bytes)", median_ms=cp["median_ms"],
                         bytes=nbytes_bf16, gbps=cp["gbps"], frac_of_copy=1.0,
                         ratio_vs_baseline=cp["median_ms"] / base["median_ms"], notes="bandwidth ceiling"))
        rows.append(dict(suite=NAME, case=case, impl="torch index_copy_ bf16 (baseline)",
                         median_ms=base["median_ms"], bytes=nbytes_bf16,
                         gbps=gbps(nbytes_bf16, base["median_ms"]),
                         frac_of_copy=gbps(nbytes_bf16, base["median_ms"]) / cp["gbps"],
                         ratio_vs_baseline=1.0, notes="auto format, 2 torch kernels",
                         p10_ms=base["p10_ms"], p90_ms=base["p90_ms"]))
        progress(f"{case} torch baseline")
        del cache_bf16, flat

        for name in FORMATS:
            fmt = kvlab.get_format(name)
            cache = kvlab.allocate_cache(name, nb, BLOCK_SIZE, H, D, like=key)
            row_bytes = 2 * D if name == "auto" else fmt.row_bytes(D)
            nbytes = read_bytes + 2 * T * H * row_bytes

            def fn(cache=cache, fmt=fmt):
                launch_reshape_and_cache(key, value, cache, slots, fmt, 1.0, 1.0)

            r = bench_ms(fn, repeats)
            c = copy_bench(nbytes, repeats)
            bw = gbps(nbytes, r["median_ms"])
            notes = f"copy {c['gbps']:.0f} GB/s at these bytes"
            extra = {}
            if name == "int4_per_token_head":
                ns_tok = r["median_ms"] * 1e6 / T
                vllm_ns_tok = VLLM_TRITON_INT4_MS * 1e6 / VLLM_TRITON_INT4_TOKENS
                notes += (f"; {ns_tok:.2f} ns/token vs vLLM Triton int4 {vllm_ns_tok:.1f} ns/token "
                          f"(quoted): {vllm_ns_tok / ns_tok:.1f}x faster per token")
                extra = dict(ns_per_token=ns_tok, vllm_speedup_per_token=vllm_ns_tok / ns_tok)
            rows.append(dict(suite=NAME, case=case, impl=f"kvlab {name}", median_ms=r["median_ms"],
                             bytes=nbytes, gbps=bw, frac_of_copy=bw / c["gbps"],
                             ratio_vs_baseline=r["median_ms"] / base["median_ms"], notes=notes,
                             p10_ms=r["p10_ms"], p90_ms=r["p90_ms"], copy_gbps=c["gbps"], **extra))
            progress(f"{case} {name}")
            del cache
        if T == VLLM_TRITON_INT4_TOKENS:
            nbytes = read_bytes + 2 * T * H * kvlab.get_format("int4_per_token_head").row_bytes(D)
            rows.append(dict(suite=NAME, case=case, impl="vLLM Triton int4 (quoted, not run)",
                             median_ms=VLLM_TRITON_INT4_MS, bytes=nbytes,
                             gbps=gbps(nbytes, VLLM_TRITON_INT4_MS), frac_of_copy=None,
                             ratio_vs_baseline=VLLM_TRITON_INT4_MS / base["median_ms"],
                             notes="issue 3: H200, rotation pass (0.12 ms) + quantize kernel"))
        del key, value
        torch.cuda.empty_cache()
    return rows

"""Benchmark suite ``prefill``: causal prompts of 4,096 and 16,384 tokens (:func:`_grid`): 32 query /
8 KV heads at d = 128 (the target shape; ``--quick``: 4,096 tokens only), the shipped model's
9 / 3 heads at d = 64, and 32 / 8 heads at d = 64.

One sequence whose whole prompt is the query (query length = KV length, causal), read from
a paged cache of each format (block size 16, blocks in random order). Baseline in the same
process: torch ``scaled_dot_product_attention(is_causal=True, enable_gqa=True)`` on
contiguous bf16 q/K/V — ``ratio_vs_baseline`` = time / its time. Prefill is compute-bound,
so the notes give TFLOP/s (causal: 2 · 2 · H_q · d · T² / 2 flops); ``bytes`` counts the
cache bytes read once. kvlab rows time :meth:`AttentionPlan.run` (plan built once).

On a compute capability 9.0 GPU every format is timed twice in the same process: the portable
prefill kernel (``prefill_variant="mma"``, rows ``kvlab <format>``) and the Hopper wgmma one
(``prefill_variant="wgmma"``, rows ``kvlab <format> wgmma``), on the same cache and plan inputs.
The row of the kernel that the default (``prefill_variant="auto"``: wgmma on compute capability
9.0, else mma) runs says so in its notes. ``KVLAB_BENCH_PREFILL_VARIANTS`` (e.g. ``wgmma``)
restricts the variants timed.
"""
from __future__ import annotations

import math
import os

from .targets import DEFAULT_MARK
from .timing import bench_ms, copy_bandwidth_gbps, gbps

NAME = "prefill"
FORMATS = ("auto", "int8_per_token_head", "fp8_per_token_head", "int4_per_token_head", "nvfp4")
BLOCK_SIZE = 16


def _grid(quick: bool) -> list:
    """(query heads, KV heads, head size, prompt lengths) of the suite."""
    if quick:
        return [(32, 8, 128, (4096,))]
    return [(32, 8, 128, (4096, 16384)), (9, 3, 64, (4096, 16384)), (32, 8, 64, (4096,))]


def prefill_variants() -> tuple:
    """Prefill kernels to time on this GPU: ("mma", "wgmma") on sm_90, ("mma",) elsewhere."""
    import cupy

    want = tuple(os.environ.get("KVLAB_BENCH_PREFILL_VARIANTS", "mma wgmma").split())
    if int(cupy.cuda.Device().compute_capability) != 90:
        want = tuple(v for v in want if v != "wgmma")
    return want or ("mma",)


def run(quick: bool, progress) -> list[dict]:
    import torch

    import kvlab
    from kvlab.cuda.attention import _resolve_prefill_variant, plan_paged_attention

    from .suite_decode import build_batch

    repeats = 5 if quick else 15
    variants = prefill_variants()
    default_pv = _resolve_prefill_variant(None, torch.cuda.current_device())   # the default's kernel
    grid = [(HQ, HKV, D, T) for HQ, HKV, D, lengths in _grid(quick) for T in lengths]
    progress.total(len(grid) * (len(FORMATS) * len(variants) + 1))
    rows = []
    for HQ, HKV, D, T in grid:
        case = f"T={T} causal {HQ}/{HKV} d={D}"
        b = build_batch(torch, 1, T, HQ, HKV, D, seed=7)
        g = torch.Generator(device="cuda").manual_seed(11)
        q = torch.randn((T, HQ, D), device="cuda", dtype=torch.bfloat16, generator=g)
        qsl = torch.tensor([0, T], device="cuda", dtype=torch.int32)
        flops = 2 * 2 * HQ * D * T * T / 2
        q_c = q.transpose(0, 1).unsqueeze(0).contiguous()
        k_c = b["key"].transpose(0, 1).unsqueeze(0).contiguous()
        v_c = b["value"].transpose(0, 1).unsqueeze(0).contiguous()
        F = torch.nn.functional

        def sdpa():
            return F.scaled_dot_product_attention(q_c, k_c, v_c, is_causal=True, enable_gqa=True,
                                                  scale=1.0 / math.sqrt(D))

        base = bench_ms(sdpa, repeats)
        bytes_bf16 = 2 * T * HKV * D * 2
        rows.append(dict(suite=NAME, case=case, impl="torch SDPA bf16 causal (baseline)",
                         median_ms=base["median_ms"], bytes=bytes_bf16,
                         gbps=gbps(bytes_bf16, base["median_ms"]), frac_of_copy=None,
                         ratio_vs_baseline=1.0,
                         notes=f"{flops / base['median_ms'] / 1e9:.0f} TFLOP/s"))
        progress(f"{case} sdpa")
        del q_c, k_c, v_c
        for name in FORMATS:
            fmt = kvlab.get_format(name)
            cache = kvlab.allocate_cache(name, b["num_blocks"], BLOCK_SIZE, HKV, D, like=b["key"])
            kvlab.reshape_and_cache(b["key"], b["value"], cache, b["slots"], kv_cache_dtype=name)
            args = (q, cache, b["block_table"], b["seq_lens"], qsl)
            for pv in variants:
                plan = plan_paged_attention(*args, name, prefill_variant=pv)
                out = torch.empty_like(q)
                r = bench_ms(lambda: plan.run(*args, out=out), repeats)
                row_bytes = 2 * D if name == "auto" else fmt.row_bytes(D)
                nbytes = 2 * T * HKV * row_bytes
                impl = f"kvlab {name}" + ("" if pv == "mma" else f" {pv}")
                rows.append(dict(suite=NAME, case=case, impl=impl, median_ms=r["median_ms"],
                                 bytes=nbytes, gbps=gbps(nbytes, r["median_ms"]),
                                 frac_of_copy=gbps(nbytes, r["median_ms"]) / copy_bandwidth_gbps(nbytes, repeats),
                                 ratio_vs_baseline=r["median_ms"] / base["median_ms"],
                                 notes=f"{flops / r['median_ms'] / 1e9:.0f} TFLOP/s; {plan.n_pf}x{plan.num_kv_heads} "
                                       f"prefill CTAs ({pv})"
                                       + (f"; {DEFAULT_MARK}" if pv == default_pv else "")))
                progress(f"{case} {impl}")
                del plan, out
            del cache
        del b, q
        torch.cuda.empty_cache()
    return rows

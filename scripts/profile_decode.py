"""Decode launches for Nsight Compute (scripts/gpu_run.sh PROFILE=1, scripts/gpu_ab.sh PROFILE_DECODE).

    python scripts/profile_decode.py                          # int4 + nvfp4, B = 32 x 8k, default variant
    python scripts/profile_decode.py int4_per_token_head:32:8192:paged int4_per_token_head:1:131072:per_head

Each argument is FORMAT[:BATCH[:CONTEXT[:VARIANT]]] (32/8 heads, d = 128, block 16; VARIANT is
the plan's decode_variant: auto, paged or per_head). One kvlab.paged_attention call per argument,
on a cache written from random bf16 K/V (random data: the kernels' time does not depend on the
values, and a zero cache would hide nothing here but is never what a model writes).
"""
import sys

import torch

import kvlab
from kvlab.cuda.attention import plan_paged_attention

HQ, HKV, D, BS = 32, 8, 128, 16
cases = sys.argv[1:] or ["int4_per_token_head", "nvfp4"]
g = torch.Generator(device="cuda").manual_seed(0)
for case in cases:
    parts = case.split(":")
    fmt = parts[0]
    B = int(parts[1]) if len(parts) > 1 else 32
    CTX = int(parts[2]) if len(parts) > 2 else 8192
    variant = parts[3] if len(parts) > 3 else "auto"
    nb = B * CTX // BS
    cache = kvlab.allocate_cache(fmt, nb, BS, HKV, D, like=torch.empty(1, device="cuda", dtype=torch.bfloat16))
    kv = torch.randn((nb * BS, HKV, D), generator=g, device="cuda").to(torch.bfloat16)
    kvlab.reshape_and_cache(kv, kv, cache, torch.arange(nb * BS, device="cuda"), fmt)
    del kv
    bt = torch.arange(nb, device="cuda", dtype=torch.int32).reshape(B, CTX // BS)
    sl = torch.full((B,), CTX, device="cuda", dtype=torch.int32)
    qsl = torch.arange(B + 1, device="cuda", dtype=torch.int32)
    q = torch.randn((B, HQ, D), generator=g, device="cuda").to(torch.bfloat16)
    plan = plan_paged_attention(q, cache, bt, sl, qsl, fmt, decode_variant=variant)
    plan.run(q, cache, bt, sl, qsl)
    torch.cuda.synchronize()
    print(f"profiled {case}: {plan.decode_variant}, {plan.n_items} items")
    del cache

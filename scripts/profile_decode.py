"""Decode launches for Nsight Compute (scripts/gpu_run.sh PROFILE=1, scripts/gpu_ab.sh PROFILE_DECODE).

    python scripts/profile_decode.py                          # int4 + nvfp4, B = 32 x 8k, default variant
    python scripts/profile_decode.py int4_per_token_head:32:8192:paged int4_per_token_head:1:131072:per_head

Each argument is FORMAT[:BATCH[:CONTEXT[:VARIANT[:HQ/HKV/D]]]] (32/8 heads, d = 128 unless the
fifth field says otherwise, e.g. ``int4_per_token_head:32:8192:paged:9/3/64`` for the shipped
model's shape; block 16; VARIANT is the plan's decode_variant: auto, paged or per_head). One kvlab.paged_attention call per argument,
on a cache written from random bf16 K/V (the kernels' time does not depend on the values).
:func:`decode_case` builds a case; scripts/decode_timeline.py uses it too.
"""
import sys

import torch

import kvlab
from kvlab.cuda.attention import plan_paged_attention

HQ_DEFAULT, HKV_DEFAULT, D_DEFAULT, BS = 32, 8, 128, 16


def decode_case(case: str, g, shuffled: bool = False):
    """``FORMAT[:B[:CTX[:VARIANT[:HQ/HKV/D]]]]`` -> (args of plan.run, plan, cache). ``shuffled``:
    slots and blocks in random order (as an engine's pages are), else in order."""
    parts = case.split(":")
    fmt = parts[0]
    B = int(parts[1]) if len(parts) > 1 else 32
    CTX = int(parts[2]) if len(parts) > 2 else 8192
    variant = parts[3] if len(parts) > 3 else "auto"
    HQ, HKV, D = (int(x) for x in parts[4].split("/")) if len(parts) > 4 else (HQ_DEFAULT, HKV_DEFAULT, D_DEFAULT)
    if len(parts) > 5 or HQ % HKV:
        raise SystemExit(f"{case!r}: expected FORMAT[:B[:CTX[:VARIANT[:HQ/HKV/D]]]] with HKV dividing HQ")
    nb = B * CTX // BS
    order = torch.randperm if shuffled else torch.arange
    cache = kvlab.allocate_cache(fmt, nb, BS, HKV, D, like=torch.empty(1, device="cuda", dtype=torch.bfloat16))
    kv = torch.randn((nb * BS, HKV, D), generator=g, device="cuda").to(torch.bfloat16)
    kvlab.reshape_and_cache(kv, kv, cache, order(nb * BS, device="cuda"), fmt)
    del kv
    bt = order(nb, device="cuda").to(torch.int32).reshape(B, CTX // BS)
    sl = torch.full((B,), CTX, device="cuda", dtype=torch.int32)
    qsl = torch.arange(B + 1, device="cuda", dtype=torch.int32)
    q = torch.randn((B, HQ, D), generator=g, device="cuda").to(torch.bfloat16)
    args = (q, cache, bt, sl, qsl)
    return args, plan_paged_attention(*args, fmt, decode_variant=variant), cache


if __name__ == "__main__":
    g = torch.Generator(device="cuda").manual_seed(0)
    for case in sys.argv[1:] or ["int4_per_token_head", "nvfp4"]:
        args, plan, cache = decode_case(case, g)
        plan.run(*args)
        torch.cuda.synchronize()
        print(f"profiled {case}: {plan.decode_variant}, {plan.n_items} items")
        del cache

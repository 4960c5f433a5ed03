"""One prefill launch per prefill variant at the benchmark shape (4,096-token causal prompt, 32/8
heads, d = 128, block 16), for Nsight Compute:

    ncu --clock-control none --set full -k regex:paged_attention_prefill -c 2 \\
        python3 scripts/profile_prefill.py [format] [variants...]

(defaults: int4_per_token_head, mma wgmma; wgmma needs an sm_90 GPU). ``PREFILL_T`` sets the prompt
length (default 4096; e.g. 256 for a short compute-sanitizer run)."""
import os
import sys

import torch

import kvlab
from kvlab.cuda.attention import plan_paged_attention

T, HQ, HKV, D, BS = int(os.environ.get("PREFILL_T", "4096")), 32, 8, 128, 16
fmt = sys.argv[1] if len(sys.argv) > 1 else "int4_per_token_head"
variants = sys.argv[2:] or ["mma", "wgmma"]
nb = T // BS
g = torch.Generator(device="cuda").manual_seed(0)
cache = kvlab.allocate_cache(fmt, nb, BS, HKV, D, like=torch.empty(1, device="cuda", dtype=torch.bfloat16))
k = torch.randn((T, HKV, D), generator=g, device="cuda").to(torch.bfloat16)
v = torch.randn((T, HKV, D), generator=g, device="cuda").to(torch.bfloat16)
kvlab.reshape_and_cache(k, v, cache, torch.arange(T, device="cuda"), fmt)
bt = torch.arange(nb, device="cuda", dtype=torch.int32).reshape(1, nb)
sl = torch.tensor([T], device="cuda", dtype=torch.int32)
qsl = torch.tensor([0, T], device="cuda", dtype=torch.int32)
q = torch.randn((T, HQ, D), generator=g, device="cuda").to(torch.bfloat16)
for pv in variants:
    plan = plan_paged_attention(q, cache, bt, sl, qsl, fmt, prefill_variant=pv)
    plan.run(q, cache, bt, sl, qsl)
    torch.cuda.synchronize()
print("profiled", fmt, variants)

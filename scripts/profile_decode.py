"""One int4 and one nvfp4 decode launch at the target shape (batch 32 x 8,192 context, 32/8 heads,
d=128, block 16), for Nsight Compute (scripts/gpu_run.sh with PROFILE=1)."""
import numpy as np
import torch

import kvlab

B, CTX, HQ, HKV, D, BS = 32, 8192, 32, 8, 128, 16
nb = B * CTX // BS
g = torch.Generator(device="cuda").manual_seed(0)
for fmt in ("int4_per_token_head", "nvfp4"):
    cache = kvlab.allocate_cache(fmt, nb, BS, HKV, D, like=torch.empty(1, device="cuda", dtype=torch.bfloat16))
    kv = torch.randn((nb * BS, HKV, D), generator=g, device="cuda").to(torch.bfloat16)
    kvlab.reshape_and_cache(kv, kv, cache, torch.arange(nb * BS, device="cuda"), fmt)
    bt = torch.arange(nb, device="cuda", dtype=torch.int32).reshape(B, CTX // BS)
    sl = torch.full((B,), CTX, device="cuda", dtype=torch.int32)
    qsl = torch.arange(B + 1, device="cuda", dtype=torch.int32)
    q = torch.randn((B, HQ, D), generator=g, device="cuda").to(torch.bfloat16)
    kvlab.paged_attention(q, cache, bt, sl, qsl, fmt)
    torch.cuda.synchronize()
    del cache, kv
print("profiled", np.__version__)

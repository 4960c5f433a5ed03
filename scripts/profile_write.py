"""One reshape_and_cache launch per format at the issue-3 target shape (65,536 tokens × 8 KV heads
× d=128, bf16 in, block 16), for Nsight Compute (scripts/gpu_run.sh with PROFILE_WRITE=1).
Formats: argv[1:] (default fp8, int8, int4, auto, nvfp4)."""
import sys

import torch

import kvlab
from kvlab.cuda.cache import launch_reshape_and_cache

T, H, D, BS = 65536, 8, 128, 16
fmts = sys.argv[1:] or ["fp8_per_token_head", "int8_per_token_head", "int4_per_token_head", "auto", "nvfp4"]
g = torch.Generator(device="cuda").manual_seed(0)
key = torch.randn((T, H, D), generator=g, device="cuda").to(torch.bfloat16)
value = torch.randn((T, H, D), generator=g, device="cuda").to(torch.bfloat16)
# whole blocks in random block order, as the write benchmark does
perm = torch.randperm(T // BS, generator=g, device="cuda")
t = torch.arange(T, device="cuda")
slots = (perm[t // BS] * BS + t % BS).to(torch.int64)
for fmt in fmts:
    cache = kvlab.allocate_cache(fmt, T // BS, BS, H, D, like=key)
    launch_reshape_and_cache(key, value, cache, slots, kvlab.get_format(fmt), 1.0, 1.0)
    torch.cuda.synchronize()
    del cache
print("profiled", ", ".join(fmts))

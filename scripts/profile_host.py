"""Where the host time of one ``kvlab.paged_attention`` call goes (needs a GPU).

    python scripts/profile_host.py            # B=32 x 8k, 32/8 heads, d=128, int4, torch bf16
    python scripts/profile_host.py --times    # the four times only (A/B runs of two trees)
    python scripts/profile_host.py --format=int8_per_token_head

Prints the wall time per call (the fastest of 7 blocks of 40 calls) of (a) the whole call with
its kept plan (the same index arrays every call: ``paged_attention``'s plan cache), (b) the whole
call planned afresh (cache cleared first), (c) ``plan_paged_attention`` alone and (d) ``AttentionPlan.run`` alone (launches only,
one synchronization after all calls), then a cProfile of the whole planned-afresh call's
Python functions sorted by cumulative time, then by own time, then what the plan's own
functions call (``print_callees``). The decode benchmark times (d);
an engine builds the plan once per step and runs it for every layer.
"""
import cProfile
import pstats
import sys
import time

import torch

import kvlab
from kvlab.cuda.attention import clear_plan_cache, plan_paged_attention

B, CTX, HQ, HKV, D, BS = 32, 8192, 32, 8, 128, 16
FMT = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--format=")), "int4_per_token_head")
nb = B * CTX // BS
g = torch.Generator(device="cuda").manual_seed(0)
cache = kvlab.allocate_cache(FMT, nb, BS, HKV, D, like=torch.empty(1, device="cuda", dtype=torch.bfloat16))
kv = torch.randn((nb * BS, HKV, D), generator=g, device="cuda").to(torch.bfloat16)
kvlab.reshape_and_cache(kv, kv, cache, torch.arange(nb * BS, device="cuda"), FMT)
del kv
bt = torch.arange(nb, device="cuda", dtype=torch.int32).reshape(B, CTX // BS)
sl = torch.full((B,), CTX, device="cuda", dtype=torch.int32)
qsl = torch.arange(B + 1, device="cuda", dtype=torch.int32)
q = torch.randn((B, HQ, D), generator=g, device="cuda").to(torch.bfloat16)
args = (q, cache, bt, sl, qsl)


def per_call_ms(fn, n=40, blocks=7):
    """ms per call of ``fn`` in a loop: the fastest of ``blocks`` blocks of ``n`` calls, each
    block ended by one synchronization (the lent machine's host is shared, so single blocks
    vary by ±40 %; the fastest block is the least disturbed)."""
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(blocks):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t) / n * 1e3)
    return best


def fresh_call():
    clear_plan_cache()
    return kvlab.paged_attention(*args, kv_cache_dtype=FMT)


plan = plan_paged_attention(*args, FMT)
out = plan.run(*args)
print(f"whole call, kept plan     {per_call_ms(lambda: kvlab.paged_attention(*args, kv_cache_dtype=FMT)):.3f} ms")
print(f"whole call, plan afresh   {per_call_ms(fresh_call):.3f} ms")
print(f"plan only                 {per_call_ms(lambda: plan_paged_attention(*args, FMT)):.3f} ms")
print(f"run only (queued)         {per_call_ms(lambda: plan.run(*args, out=out)):.3f} ms")

if "--times" in sys.argv[1:]:
    sys.exit(0)
prof = cProfile.Profile()
prof.enable()
for _ in range(50):
    fresh_call()
torch.cuda.synchronize()
prof.disable()
st = pstats.Stats(prof)
st.sort_stats("cumulative").print_stats(40)
st.sort_stats("tottime").print_stats(30)
st.sort_stats("cumulative").print_callees("plan_paged_attention|_cached_plan|check_paged_attention")

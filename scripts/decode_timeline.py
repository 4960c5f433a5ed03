"""GPU timeline of one decode call (``AttentionPlan.run``): each kernel's duration and the gaps
between them, from CUPTI through torch.profiler (needs a GPU).

    python scripts/decode_timeline.py [FORMAT:B:CTX:VARIANT ...]   # default: int4 paged B=32 x 8k

Runs the call 20 times after a warm-up and prints, per case, the median duration of the decode
kernel, of the split merge (``paged_attention_reduce``) and of the gap between them, next to the
median of the benchmark timer (``kvlab.bench.timing.bench_ms``, cold L2) for the same call.
"""
import os
import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from kvlab.bench.timing import bench_ms

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profile_decode import decode_case  # noqa: E402

cases = sys.argv[1:] or ["int4_per_token_head:32:8192:paged"]
g = torch.Generator(device="cuda").manual_seed(0)
for case in cases:
    args, plan, cache = decode_case(case, g, shuffled=True)
    q = args[0]
    out = torch.empty_like(q)
    bench = bench_ms(lambda: plan.run(*args, out=out), 30)
    for _ in range(3):
        plan.run(*args, out=out)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            plan.run(*args, out=out)
            torch.cuda.synchronize()
    ev = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                 and "paged_attention" in e.name), key=lambda e: e.time_range.start)
    dec = [e for e in ev if "reduce" not in e.name]
    red = [e for e in ev if "reduce" in e.name]
    gaps = []
    for d_ev in dec:
        nxt = [r for r in red if r.time_range.start >= d_ev.time_range.end]
        if nxt:
            gaps.append(nxt[0].time_range.start - d_ev.time_range.end)

    def med(xs):
        return statistics.median(xs) if xs else float("nan")

    print(f"{case}: {plan.decode_variant}, {plan.n_items} items, {plan.n_red} reductions | "
          f"decode kernel {med([e.time_range.elapsed_us() for e in dec]):.1f} us, "
          f"reduce {med([e.time_range.elapsed_us() for e in red]):.1f} us, gap {med(gaps):.1f} us | "
          f"bench_ms (cold L2) {bench['median_ms'] * 1e3:.1f} us, host {bench['host_ms'] * 1e3:.1f} us/call")
    del cache
    torch.cuda.empty_cache()

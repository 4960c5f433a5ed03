"""µs per call of the two ways to ask torch for its current stream's handle (needs a GPU):
``torch.cuda.current_stream(device).cuda_stream`` and ``torch._C._cuda_getCurrentRawStream``
(what ``kvlab.cuda.launch.stream_ptr`` uses where it exists), and of ``stream_ptr`` itself."""
import time

import torch

from kvlab.cuda import launch as L

x = torch.empty(1, device="cuda")
dev = x.device


def us(fn, n=20000):
    fn()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t) / n * 1e6)
    return best


assert torch._C._cuda_getCurrentRawStream(dev.index) == torch.cuda.current_stream(dev).cuda_stream
print(f"torch.cuda.current_stream(dev).cuda_stream  {us(lambda: torch.cuda.current_stream(dev).cuda_stream):.2f} us")
print(f"torch._C._cuda_getCurrentRawStream(index)   {us(lambda: torch._C._cuda_getCurrentRawStream(dev.index)):.2f} us")
print(f"kvlab.cuda.launch.stream_ptr(x)             {us(lambda: L.stream_ptr(x)):.2f} us")

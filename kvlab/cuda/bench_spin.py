"""GPU-side wait for the benchmark timer (``kernels_cu/bench_spin.cu``); used by
:func:`kvlab.bench.timing.bench_ms`. No reference: it computes nothing."""
from __future__ import annotations

from .loader import KernelSpec, get_kernel, register

SPECS = register("bench_spin", [KernelSpec("bench_spin", "gpu_spin")])


def spin(ns: int) -> None:
    """Queue a one-thread kernel that waits ``ns`` nanoseconds on the GPU's global timer, on the
    current CuPy stream (the legacy default stream unless the caller changed it)."""
    import cupy

    if ns < 0:
        raise ValueError(f"ns: expected >= 0, got {ns}")
    k = get_kernel(SPECS[0])
    k((1,), (32,), (cupy.int64(int(ns)),))

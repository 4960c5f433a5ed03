"""Timing for memory-bound kernels: CUDA events, warm-up, a cold L2 between repeats.

API used by every suite (``suite_*.py``):

* :func:`bench_ms` ``(fn, repeats, cold_l2=True) -> dict(median_ms, p10_ms, p90_ms, repeats)``
  times ``fn()`` (which launches GPU work on the current CuPy/torch stream — both are the
  legacy default stream unless the caller changed them) with CUDA events around each call.
  With ``cold_l2`` a buffer of twice the L2 size is overwritten before each repeat (outside
  the timed interval), so no repeat reads its inputs from L2. With ``hide_launch`` (the
  default) a one-thread GPU wait (``kernels_cu/bench_spin.cu``) is queued between the flush and
  the start event, longer than the host takes to enqueue ``fn()``: the GPU reaches the start
  event only once the whole call is queued, so the events time the kernels (and the GPU-side
  gaps between them), not the host's Python and launch work. Without it a call whose host part
  outlasts the flush shows that excess as GPU idle time inside the timed interval (measured on
  the H200 in session 9: ~15 µs on every kvlab attention call, ``docs/perf-notes.md``).
  ``hide_launch=False`` is for rows that mean to include the host (the decode suite's "whole
  call").
* ``KVLAB_BENCH_L2=dirty|clean`` (:func:`l2_flush_mode`): how ``cold_l2`` flushes. ``dirty``
  (the default; nvbench and Triton's ``do_bench`` flush this way) overwrites the buffer, so each
  timed call starts with up to an L2 of dirty lines whose write-backs its first misses wait
  on; ``clean`` then also reads a second buffer of the same size, so the write-backs happen
  before the start event. An open question of session 10 (docs/perf-notes.md): the decode's
  ~10 µs prologue may be those write-backs.
* :func:`copy_bandwidth_gbps` ``(nbytes) -> float``: GB/s of a device-to-device copy that
  moves ``nbytes`` in total (``nbytes/2`` read + ``nbytes/2`` written) — the bandwidth
  ceiling a kernel moving ``nbytes`` is compared with, measured in the same process.
* :func:`gbps` ``(nbytes, ms)``: 1e9 bytes per second.
"""
from __future__ import annotations

import functools

import numpy as np


def gbps(nbytes: float, ms: float) -> float:
    return float(nbytes) / (ms * 1e-3) / 1e9


@functools.cache
def l2_bytes(device_id: int = 0) -> int:
    import cupy

    return int(cupy.cuda.runtime.deviceGetAttribute(cupy.cuda.runtime.cudaDevAttrL2CacheSize, device_id))


@functools.cache
def _flush_buffer(device_id: int):
    import cupy

    with cupy.cuda.Device(device_id):
        return cupy.empty(max(2 * l2_bytes(device_id), 8 << 20), dtype=cupy.uint8)


L2_MODES = ("dirty", "clean")


def l2_flush_mode() -> str:
    """``KVLAB_BENCH_L2`` (``dirty`` unless set): see the module docstring."""
    import os

    mode = os.environ.get("KVLAB_BENCH_L2", "").strip() or "dirty"
    if mode not in L2_MODES:
        raise ValueError(f"KVLAB_BENCH_L2: expected one of {L2_MODES}, got {mode!r}")
    return mode


@functools.cache
def _reread_buffer(device_id: int):
    import cupy

    with cupy.cuda.Device(device_id):
        b = cupy.empty_like(_flush_buffer(device_id))
        b.fill(3)
        return b


def synchronize() -> None:
    import cupy

    cupy.cuda.runtime.deviceSynchronize()


#: bounds of the GPU wait queued ahead of each timed call (ns): at least 200 µs, at most 50 ms
SPIN_MIN_NS, SPIN_MAX_NS = 200_000, 50_000_000


def bench_ms(fn, repeats: int = 50, cold_l2: bool = True, warmup: int = 3, hide_launch: bool = True) -> dict:
    """Median and 10th/90th percentile milliseconds of ``fn()`` over ``repeats`` timed calls.

    The first ``warmup`` calls (compilation, allocator warm-up) are not timed; the last of them
    also measures the host's enqueue time of one call (``host_ms`` in the result, wall clock
    from the call to its return, GPU work not waited for). With ``hide_launch`` the GPU waits
    ``clip(3 · host_ms, 0.2 ms, 50 ms)`` before each start event (see the module docstring).
    """
    import time

    import cupy

    for _ in range(max(warmup - 1, 0)):
        fn()
    synchronize()
    t_host = time.perf_counter()
    fn()
    host_ms = (time.perf_counter() - t_host) * 1e3
    synchronize()
    spin_ns = 0
    if hide_launch:
        from ..cuda.bench_spin import spin

        spin_ns = int(min(max(3 * host_ms * 1e6, SPIN_MIN_NS), SPIN_MAX_NS))
    dev = cupy.cuda.runtime.getDevice()
    flush = _flush_buffer(dev) if cold_l2 else None
    reread = _reread_buffer(dev) if cold_l2 and l2_flush_mode() == "clean" else None
    sink = cupy.empty((), cupy.uint64) if reread is not None else None
    starts = [cupy.cuda.Event() for _ in range(repeats)]
    ends = [cupy.cuda.Event() for _ in range(repeats)]
    for i in range(repeats):
        if flush is not None:
            flush.fill(i & 0xFF)  # overwrite 2x L2 so the next call starts cold
        if reread is not None:
            reread.sum(dtype=cupy.uint64, out=sink)  # read 2x L2: the dirty lines are written back now
        if spin_ns:
            spin(spin_ns)  # the GPU waits while the host queues fn(): the events see no host time
        starts[i].record()
        fn()
        ends[i].record()
    ends[-1].synchronize()
    synchronize()
    t = np.array([cupy.cuda.get_elapsed_time(s, e) for s, e in zip(starts, ends)])
    return dict(median_ms=float(np.median(t)), p10_ms=float(np.percentile(t, 10)),
                p90_ms=float(np.percentile(t, 90)), repeats=int(repeats), host_ms=float(host_ms),
                hide_launch=bool(hide_launch), l2=(l2_flush_mode() if cold_l2 else "warm"))


@functools.cache
def _copy_result(nbytes: int, repeats: int) -> dict:
    import cupy

    half = max(int(nbytes) // 2, 1)
    src = cupy.empty(half, dtype=cupy.uint8)
    dst = cupy.empty(half, dtype=cupy.uint8)
    src.fill(1)

    def copy():
        dst.data.copy_from_device_async(src.data, half)

    r = bench_ms(copy, repeats=repeats, cold_l2=True)
    r["gbps"] = gbps(2 * half, r["median_ms"])
    del src, dst
    return r


def copy_bench(nbytes: int, repeats: int = 50) -> dict:
    """:func:`bench_ms` of a D2D copy moving ``nbytes`` (read + write), plus its ``gbps``. Cached per size."""
    return dict(_copy_result(int(nbytes), int(repeats)))


def copy_bandwidth_gbps(nbytes: int, repeats: int = 50) -> float:
    """GB/s (read + write counted) of a device-to-device copy moving ``nbytes`` in total."""
    return copy_bench(nbytes, repeats)["gbps"]

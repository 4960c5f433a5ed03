"""The benchmark timer (kvlab/bench/timing.py) times GPU work, not the host's enqueue work.

A call that spends ~2 ms on the host before launching ~0.05 ms of GPU work: with
``hide_launch`` (the default) the GPU wait queued ahead of the start event covers the host part,
so the median is far below the host time; without it the host time shows up inside the timed
interval. Both directions are asserted, so the test fails if the wait stops working or if the
timer stops seeing host gaps at all.
"""
import time

import pytest

pytestmark = pytest.mark.gpu
cupy = pytest.importorskip("cupy")

from kvlab.bench.timing import SPIN_MIN_NS, bench_ms  # noqa: E402
from kvlab.cuda.bench_spin import spin  # noqa: E402

HOST_S = 2e-3  # host work per call, far above the GPU work and above the timer's noise


def _slow_host_call(buf):
    def fn():
        time.sleep(HOST_S)   # the host's Python / validation work of a real call, exaggerated
        buf.fill(1.0)        # then a short GPU kernel (8 MB write, a few µs on any GPU)
    return fn


def test_hide_launch_times_the_gpu_work_only():
    buf = cupy.empty(2 << 20, dtype=cupy.float32)
    fn = _slow_host_call(buf)
    hidden = bench_ms(fn, repeats=10, cold_l2=False)
    shown = bench_ms(fn, repeats=10, cold_l2=False, hide_launch=False)
    assert hidden["host_ms"] >= HOST_S * 1e3 * 0.9
    # GPU work is a few µs: well under a quarter of the host time when the host part is hidden
    assert hidden["median_ms"] < 0.25 * HOST_S * 1e3, hidden
    # the host part inside the timed interval without the wait
    assert shown["median_ms"] > 0.8 * HOST_S * 1e3, shown


def test_spin_waits_at_least_the_requested_time():
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    spin(SPIN_MIN_NS)
    end.record()
    end.synchronize()
    ms = cupy.cuda.get_elapsed_time(start, end)
    assert ms >= SPIN_MIN_NS * 1e-6 * 0.95, ms
    assert ms < 50 * SPIN_MIN_NS * 1e-6, ms   # and returns: a generous bound for a busy machine
    with pytest.raises(ValueError, match="ns: expected >= 0"):
        spin(-1)


@pytest.mark.parametrize("mode", ["dirty", "clean"])
def test_l2_flush_modes_are_recorded(mode, monkeypatch):
    """KVLAB_BENCH_L2 reaches the timer and its result names it; without cold_l2 the result says
    "warm". (Whether a clean flush changes a kernel's time is a measurement, not a test.)"""
    monkeypatch.setenv("KVLAB_BENCH_L2", mode)
    buf = cupy.empty(2 << 20, dtype=cupy.float32)
    r = bench_ms(lambda: buf.fill(1.0), repeats=5)
    assert r["l2"] == mode and r["median_ms"] > 0
    assert bench_ms(lambda: buf.fill(1.0), repeats=5, cold_l2=False)["l2"] == "warm"

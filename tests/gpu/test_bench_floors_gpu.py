"""The decode suite's read floor (kvlab/bench/floors.py) on the GPU: it times every
configuration, keeps the fastest, and reports the bytes that configuration read (the probe's
bytes themselves are checked word for word in test_ring_probe_gpu.py, floor configurations
included). Timing values are not asserted beyond being positive and consistent: benchmarks
are not timed tests."""
import pytest

pytestmark = pytest.mark.gpu
cupy = pytest.importorskip("cupy")

from kvlab.bench import floors  # noqa: E402


def test_read_floor_keeps_the_fastest_configuration():
    nbytes = 12_345_678
    r = floors.read_floor(nbytes, repeats=5)
    n_sm = cupy.cuda.Device().attributes["MultiProcessorCount"]
    ran = {k: v for k, v in r["per_config"].items() if isinstance(v, float)}
    if cupy.cuda.Device().compute_capability >= "90":
        assert set(ran) == {c.name for c in floors.READ_FLOOR_CONFIGS}, r["per_config"]
    assert ran and r["config"] in ran
    assert r["median_ms"] == min(ran.values()) > 0
    cfg = next(c for c in floors.READ_FLOOR_CONFIGS if c.name == r["config"])
    assert r["bytes"] == floors.probe_shape(nbytes, cfg, n_sm)[2]
    floors.release()
    assert floors._SOURCE.buf is None


def test_paged_read_floor_keeps_the_fastest_configuration():
    nbytes, block = 17408 * 700 + 5000, 17408
    r = floors.paged_read_floor(nbytes, block, repeats=5)
    n_sm = cupy.cuda.Device().attributes["MultiProcessorCount"]
    cfgs = floors.paged_floor_configs(block)
    ran = {k: v for k, v in r["per_config"].items() if isinstance(v, float)}
    if cupy.cuda.Device().compute_capability >= "90":
        assert set(ran) == {c.name for c in cfgs}, r["per_config"]
    assert ran and r["config"] in ran
    assert r["median_ms"] == min(ran.values()) > 0
    cfg = next(c for c in cfgs if c.name == r["config"])
    assert r["bytes"] == floors.probe_shape(nbytes, cfg, n_sm)[2]
    floors.release()

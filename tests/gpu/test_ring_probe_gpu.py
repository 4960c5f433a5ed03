"""Ring probe kernel (kernels_cu/ring_probe.cu): every mode reads exactly the bytes its
configuration names. Each thread's XOR of the words it loaded is compared word for word with
the NumPy model (kvlab.cuda.ring_probe.expected_sink) on fresh random bytes, shuffled blocks,
several ring shapes; a probe that skipped, repeated or misplaced a copy would not match."""
import numpy as np
import pytest

pytestmark = pytest.mark.gpu
cupy = pytest.importorskip("cupy")

from kvlab.bench.floors import READ_FLOOR_CONFIGS, paged_floor_configs  # noqa: E402
from kvlab.cuda.ring_probe import THREADS, RingConfig, chunk_offsets, expected_sink, stream  # noqa: E402


def _bulk_ok():
    return cupy.cuda.Device().compute_capability >= "90"


CASES = [
    RingConfig("loads", mode="loads", chunk=8704, per_stage=4, layout="paged"),
    RingConfig("loads odd stage", mode="loads", chunk=1024, per_stage=3, layout="contig"),
    RingConfig("thread", chunk=8704, per_stage=4, nbuf=3),
    RingConfig("thread split 4", chunk=8704, per_stage=4, nbuf=2, split=4),
    RingConfig("warp split 8", mode="bulk_warp", chunk=8704, per_stage=4, nbuf=3, split=8),
    RingConfig("warp evict_first", mode="bulk_warp", chunk=4096, per_stage=2, nbuf=4, evict_first=True),
    RingConfig("thread no touch", chunk=4096, per_stage=2, nbuf=2, touch=False),
    *READ_FLOOR_CONFIGS,   # the decode suite's read-floor rows (kvlab/bench/floors.py)
    # its paged read-floor rows: int4 blocks at d = 128 (8 KV heads) and at d = 64 (3 KV heads)
    *paged_floor_configs(17408), *paged_floor_configs(3456),
]


@pytest.mark.parametrize("cfg", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("chunks_per_cta", [2, 14])
def test_probe_reads_the_named_bytes(cfg, chunks_per_cta):
    if cfg.mode != "loads" and not _bulk_ok():
        pytest.skip("bulk copies need sm_90")
    grid = 6
    rng = np.random.default_rng(chunks_per_cta)
    n = grid * chunks_per_cta * cfg.chunk
    src_h = rng.integers(0, 256, n, dtype=np.uint8)
    offs_h = chunk_offsets(cfg, grid, chunks_per_cta, seed=chunks_per_cta)
    sink = cupy.full(grid * THREADS, 0xDEADBEEF, cupy.uint32)   # poisoned: every word must be written
    stream(cfg, cupy.asarray(src_h), cupy.asarray(offs_h), grid, chunks_per_cta, sink)
    want = expected_sink(cfg, src_h, offs_h, grid, chunks_per_cta)
    got = cupy.asnumpy(sink)
    assert np.array_equal(got, want), f"{np.count_nonzero(got != want)} of {got.size} words differ"


def test_probe_refuses_a_short_sink():
    cfg = RingConfig("x", mode="loads", chunk=1024, layout="contig")
    offs = cupy.asarray(chunk_offsets(cfg, 2, 2))
    with pytest.raises(ValueError, match="sink"):
        stream(cfg, cupy.zeros(4096, cupy.uint8), offs, 2, 2, cupy.zeros(THREADS, cupy.uint32))


TENSOR_CASES = [
    # int8, d = 128, 8 KV heads: a CTA stages 2 heads (264 B) in 272-byte box rows from 16-byte
    # aligned starts (bytes 0, 256, 528, 784: the last box ends at the row's end)
    RingConfig("tensor int8 2 heads", mode="tensor", layout="heads", chunk=16 * 272, per_stage=4, nbuf=3,
               row_bytes=1056, col_step=264),
    # int4, d = 128: 4 heads of 68 B a box, two column groups
    RingConfig("tensor int4 4 heads", mode="tensor", layout="heads", chunk=16 * 272, per_stage=2, nbuf=2,
               row_bytes=544, col_step=272),
    # 8-row boxes, 1,040-byte rows, groups of 260 B from 0, 256, 512, 768
    RingConfig("tensor 8-row boxes", mode="tensor", layout="heads", chunk=8 * 272, per_stage=3, nbuf=2,
               row_bytes=1040, col_step=260, box_rows=8),
    # the last group's 272-byte boxes start at 768 of 1,024-byte rows: 16 bytes past the row's end
    RingConfig("tensor box past the row", mode="tensor", layout="heads", chunk=16 * 272, per_stage=2, nbuf=3,
               row_bytes=1024, col_step=256),
]


@pytest.mark.parametrize("cfg", TENSOR_CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("chunks_per_cta", [2, 14])
def test_tensor_probe_reads_the_named_boxes(cfg, chunks_per_cta):
    """The tensor-copy ring (ring_stream_tensor, a CUtensorMap passed by value): each stage's
    boxes land in shared memory as the NumPy model lays them out (rows ``row_bytes`` apart,
    zeros past a row's end), on random bytes and shuffled blocks."""
    from kvlab.cuda.ring_probe import tensor_rows

    if not _bulk_ok():
        pytest.skip("tensor copies need sm_90")
    grid = 10
    rng = np.random.default_rng(100 + chunks_per_cta)
    src_h = rng.integers(0, 256, tensor_rows(cfg, grid, chunks_per_cta) * cfg.row_bytes, dtype=np.uint8)
    offs_h = chunk_offsets(cfg, grid, chunks_per_cta, seed=chunks_per_cta)
    sink = cupy.full(grid * THREADS, 0xDEADBEEF, cupy.uint32)
    stream(cfg, cupy.asarray(src_h), cupy.asarray(offs_h), grid, chunks_per_cta, sink)
    want = expected_sink(cfg, src_h, offs_h, grid, chunks_per_cta)
    got = cupy.asnumpy(sink)
    assert np.array_equal(got, want), f"{np.count_nonzero(got != want)} of {got.size} words differ"

"""Ring probe (kvlab/cuda/ring_probe.py, a measurement tool): its configurations refuse bad
parameters, its chunk offsets cover the buffer as stated, and its NumPy model of the sink follows
the kernel's thread assignment (checked here on a hand-sized case; the GPU test compares the
kernel with it)."""
import numpy as np
import pytest

from kvlab.cuda.ring_probe import THREADS, RingConfig, chunk_offsets, expected_sink


@pytest.mark.parametrize("kw, msg", [
    (dict(mode="tma"), "mode"), (dict(layout="random"), "layout"), (dict(chunk=100), "chunk"),
    (dict(nbuf=1), "nbuf"), (dict(nbuf=9), "nbuf"), (dict(split=3), "split"),
])
def test_config_refuses_bad_parameters(kw, msg):
    with pytest.raises(ValueError, match=msg):
        RingConfig("x", **kw).check()


def test_loads_mode_ignores_ring_parameters():
    RingConfig("x", mode="loads", nbuf=1, split=3).check()
    assert RingConfig("x", mode="loads").smem_bytes() == 0
    assert RingConfig("x").smem_bytes() == 3 * 4 * 8704


@pytest.mark.parametrize("layout", ["paged", "contig"])
def test_offsets_cover_every_chunk_once(layout):
    cfg = RingConfig("x", chunk=64, layout=layout)
    offs = chunk_offsets(cfg, grid=5, chunks_per_cta=6, seed=3)
    assert offs.dtype == np.int64 and offs.shape == (30,)
    assert sorted(offs.tolist()) == [64 * i for i in range(30)]
    if layout == "paged":
        # a block's K and V chunks are adjacent and in that order; blocks are shuffled
        assert np.all(offs[1::2] - offs[0::2] == 64) and np.all(offs[0::2] % 128 == 0)
        assert not np.all(np.diff(offs) == 64)
    else:
        assert np.all(np.diff(offs) == 64)


def test_paged_layout_needs_even_chunks_per_cta():
    with pytest.raises(ValueError, match="even"):
        chunk_offsets(RingConfig("x"), grid=2, chunks_per_cta=3)


def _words(n, seed):
    return np.random.default_rng(seed).integers(0, 2**32, n, dtype=np.uint32)


def test_sink_model_loads_hand_case():
    # 1 CTA, 2 chunks of 16 B each (one 16-byte vector), 2 per stage: vector 0 → thread 0,
    # vector 1 → thread 1; each thread XORs its vector's 4 words
    w = _words(8, 0)
    cfg = RingConfig("x", mode="loads", chunk=16, per_stage=2, layout="contig")
    got = expected_sink(cfg, w.view(np.uint8), np.array([0, 16]), grid=1, chunks_per_cta=2)
    want = np.zeros(THREADS, np.uint32)
    want[0] = w[0] ^ w[1] ^ w[2] ^ w[3]
    want[1] = w[4] ^ w[5] ^ w[6] ^ w[7]
    assert np.array_equal(got, want)


def test_sink_model_loads_wraps_threads():
    # one stage of 2 × 4096 B = 2 × 256 vectors: thread t gets vectors t and t + 256
    w = _words(2 * 4096 // 4, 1)
    cfg = RingConfig("x", mode="loads", chunk=4096, per_stage=2, layout="contig")
    got = expected_sink(cfg, w.view(np.uint8), np.array([0, 4096]), grid=1, chunks_per_cta=2)
    v = np.bitwise_xor.reduce(w.reshape(-1, 4), axis=1)
    assert np.array_equal(got, v[:THREADS] ^ v[THREADS:])


def test_sink_model_bulk_touch_reads_word_tid_of_each_stage():
    # two stages of one 4096-B chunk, placed in reverse order: thread t XORs vector t of both
    w = _words(2 * 4096 // 4, 2)
    cfg = RingConfig("x", chunk=4096, per_stage=1, layout="contig")
    got = expected_sink(cfg, w.view(np.uint8), np.array([4096, 0]), grid=1, chunks_per_cta=2)
    v = np.bitwise_xor.reduce(w.reshape(-1, 4), axis=1)
    assert np.array_equal(got, v[:THREADS] ^ v[256:256 + THREADS])
    assert not np.any(expected_sink(RingConfig("x", chunk=4096, per_stage=1, touch=False),
                                    w.view(np.uint8), np.array([4096, 0]), 1, 2))

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


@pytest.mark.parametrize("layout", ["paged", "blocks", "contig"])
def test_offsets_cover_every_chunk_once(layout):
    cfg = RingConfig("x", chunk=64, layout=layout)
    offs = chunk_offsets(cfg, grid=5, chunks_per_cta=6, seed=3)
    assert offs.dtype == np.int64 and offs.shape == (30,)
    assert sorted(offs.tolist()) == [64 * i for i in range(30)]
    if layout == "paged":
        # a block's K and V chunks are adjacent and in that order; blocks are shuffled
        assert np.all(offs[1::2] - offs[0::2] == 64) and np.all(offs[0::2] % 128 == 0)
        assert not np.all(np.diff(offs) == 64)
    elif layout == "blocks":
        # every chunk (a whole block) at its own shuffled place; odd counts per CTA allowed
        assert not np.all(np.diff(offs) == 64)
        odd = chunk_offsets(cfg, grid=3, chunks_per_cta=5, seed=1)
        assert sorted(odd.tolist()) == [64 * i for i in range(15)]
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


TENSOR = dict(mode="tensor", layout="heads", chunk=16 * 272, per_stage=4, nbuf=4, ctas_per_sm=1,
              row_bytes=1056, col_step=264)   # int8, d = 128, 8 KV heads: 2 heads a CTA


@pytest.mark.parametrize("kw, msg", [
    (dict(layout="paged"), "layout"), (dict(chunk=16 * 264), "chunk"), (dict(row_bytes=1050), "row_bytes"),
    (dict(col_step=1056), "row_bytes"), (dict(split=2), "split"), (dict(box_rows=1, chunk=4096), "box"),
    (dict(col_step=262), "cover"),   # group 2 starts at 512, 12 B before its bytes: 262 + 12 > 272
])
def test_tensor_config_refuses_bad_parameters(kw, msg):
    RingConfig("x", **TENSOR).check()
    with pytest.raises(ValueError, match=msg):
        RingConfig("x", **{**TENSOR, **kw}).check()
    with pytest.raises(ValueError, match="layout"):
        RingConfig("x", layout="heads").check()          # the heads layout is the tensor mode's


def test_heads_offsets_split_a_sequence_by_columns():
    """CTAs 4s … 4s + 3 stage the same blocks of sequence s (K box, then V box, shuffled blocks)
    at the four column groups, each from its first byte (g · 264) rounded down to 16 — bytes 0,
    256, 528, 784 = elements 0, 64, 132, 196 —; every block of the tensor is staged by exactly
    one sequence."""
    from kvlab.cuda.ring_probe import head_groups, tensor_rows

    cfg = RingConfig("x", **TENSOR)
    grid, per_cta = 8, 6
    offs = chunk_offsets(cfg, grid, per_cta, seed=5).reshape(grid, per_cta)
    rows, cols = offs >> 20, offs & 0xFFFFF
    assert head_groups(cfg) == 4 and cfg.elem_bytes() == 4
    assert np.all(cols == np.array([0, 64, 132, 196])[np.arange(grid) % 4][:, None])
    for s in range(2):
        assert np.all(rows[4 * s:4 * s + 4] == rows[4 * s])
    assert np.all(rows[:, 1::2] - rows[:, 0::2] == 16) and np.all(rows[:, 0::2] % 32 == 0)
    blocks = np.sort(np.concatenate([rows[0, 0::2], rows[4, 0::2]]) // 32)
    assert blocks.tolist() == list(range(tensor_rows(cfg, grid, per_cta) // 32))


def test_sink_model_tensor_hand_case():
    # a 16-row tensor of 32-byte rows, boxes of 8 rows × 16 bytes at column group 1 (bytes
    # 16 … 31): box row r is words 8r + 4 … 8r + 7, vector r of the stage, read by thread r
    w = _words(16 * 8, 2)
    cfg = RingConfig("x", mode="tensor", layout="heads", chunk=128, box_rows=8, per_stage=1, nbuf=2,
                     row_bytes=32, col_step=16)
    got = expected_sink(cfg, w.view(np.uint8), np.array([0 << 20 | 4, 8 << 20 | 4]), grid=1, chunks_per_cta=2)
    want = np.zeros(THREADS, np.uint32)
    for box_row0 in (0, 8):
        for r in range(8):
            want[r] ^= np.bitwise_xor.reduce(w[8 * (box_row0 + r) + 4:8 * (box_row0 + r) + 8])
    assert np.array_equal(got, want)
    # a box that runs past the row's end has zeros there (the tensor copy fills them): column
    # group 1 of 48-byte rows at byte 40, so bytes 40 … 47 of each row and 8 zero bytes
    cfg2 = RingConfig("x", mode="tensor", layout="heads", chunk=128, box_rows=8, per_stage=1, nbuf=2,
                      row_bytes=48, col_step=40)
    w2 = _words(8 * 12, 3)
    got2 = expected_sink(cfg2, w2.view(np.uint8), np.array([0 << 20 | 10]), grid=1, chunks_per_cta=1)
    assert np.array_equal(got2[:8], [w2[12 * r + 10] ^ w2[12 * r + 11] for r in range(8)])

"""NumPy emulation of the tensor-core int4 write (``-DKVLAB_INT4_WRITE_MMA``): fragment algebra of
kernels_cu/int4_write_mma.cuh and the warp/row mapping of ``reshape_and_cache_int4_mma``
(kernels_cu/reshape_and_cache.cu), against the reference RHT and the reference cache bytes.

The kernel's index algebra is the set of ``// [layout]`` functions in int4_write_mma.cuh; this
test reads their ``return`` expressions from the source and evaluates them as Python, so it checks
the kernel's own formulas. What the kernel does with them (which registers it fills, the mma, the
H_NA butterflies, where each output lands) is transcribed here step by step, and the
``mma.m16n8k16`` fragment layout is modelled as the PTX ISA defines it — independently of the
kernel — so a wrong formula shows up as a wrong rotated vector or a wrong cache byte:

  A (16×16, row major, 16-bit): register i of lane (g, c) holds A[row][k], A[row][k+1] (low half
      first) with row = g + 8·(i & 1), k = 2c + 8·(i >> 1)
  B (16×8, 16-bit):  register i holds B[k][g], B[k+1][g] with k = 2c + 8·i
  D (16×8, float32): d_i = D[g + 8·(i >> 1)][2c + (i & 1)]
  (g = lane >> 2, c = lane & 3)

The emulation sums exactly (float64, as the reference does), so the bytes must be identical;
a float32 variant checks that float32 accumulation stays within the GPU test's bar.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

from kvlab.arrays import NUMPY_BF16
from kvlab.cuda import loader
from kvlab.formats import get_format
from kvlab.formats.int4_per_token_head import int4_codes, int4_qparams, round_to_input_dtype, scale_word
from kvlab.reference import cache as ref_cache
from kvlab.reference.hadamard import rht, rht_signs

INT4 = "int4_per_token_head"
DTYPES = {"bfloat16": NUMPY_BF16, "float16": np.dtype(np.float16)}
ONE_BITS = {"bfloat16": 0x3F80, "float16": 0x3C00}  # MmaOne<T>::BITS


# ----------------------------------------------------------------------------- the kernel's formulas
_LAYOUT = re.compile(
    r"//\s*\[layout\][^\n]*\n(?://[^\n]*\n)*"
    r"__host__ __device__ constexpr int (\w+)\(([^)]*)\)\s*\{\s*return ([^;]*);\s*\}")


def layout_functions(text: str | None = None) -> dict:
    """The ``// [layout]`` functions of int4_write_mma.cuh as Python callables (name -> function)."""
    if text is None:
        text = (loader.kernels_dir() / "int4_write_mma.cuh").read_text()
    out = {}
    for name, args, expr in _LAYOUT.findall(text):
        params = [a.split()[-1] for a in args.split(",")]
        expr = " ".join(expr.split())
        # only operators that mean the same in C and Python on non-negative ints
        assert re.fullmatch(r"[\w\s+*()&^|>]*", expr), f"{name}: {expr!r} is not portable"
        out[name] = eval(f"lambda {', '.join(params)}: {expr}")  # noqa: S307 (our own source)
    return out


F = layout_functions()


def test_layout_functions_found():
    assert set(F) == {"mma_in_elem", "mma_group", "mma_a_reg", "mma_b_neg", "mma_out_slot", "mma_out_elem",
                      "mma8_pair", "mma8_half", "mma8_out_group"}


# ----------------------------------------------------------------------------- PTX fragment model
def a_position(lane, i, half):
    """(row, k) of element `half` (0 low, 1 high) of A register i of `lane` (PTX m16n8k16)."""
    g, c = lane >> 2, lane & 3
    return g + 8 * (i & 1), 2 * c + 8 * (i >> 1) + half


def b_position(lane, i, half):
    g, c = lane >> 2, lane & 3
    return 2 * c + 8 * i + half, g


def d_position(lane, i):
    g, c = lane >> 2, lane & 3
    return g + 8 * (i >> 1), 2 * c + (i & 1)


def f16_value(bits: int, dtype_name: str) -> float:
    return float(np.array([bits], np.uint16).view(DTYPES[dtype_name])[0])


def mma(regs_a, regs_b, dtype_name, acc=np.float64):
    """D = A · B from per-lane registers (32 lanes × 4 A words, 32 lanes × 2 B words), PTX layout.
    Every matrix position must be covered exactly once. Returns d[lane][i] (acc dtype)."""
    A = np.full((16, 16), np.nan)
    B = np.full((16, 8), np.nan)
    for lane in range(32):
        for i in range(4):
            for half in range(2):
                r, k = a_position(lane, i, half)
                assert np.isnan(A[r, k]), "A position written twice"
                A[r, k] = f16_value((regs_a[lane][i] >> (16 * half)) & 0xFFFF, dtype_name)
        for i in range(2):
            for half in range(2):
                k, n = b_position(lane, i, half)
                assert np.isnan(B[k, n]), "B position written twice"
                B[k, n] = f16_value((regs_b[lane][i] >> (16 * half)) & 0xFFFF, dtype_name)
    assert not np.isnan(A).any() and not np.isnan(B).any()
    if acc is np.float32:
        # products exact; float32 sums in k order (one valid float32 accumulation order)
        D = np.zeros((16, 8), np.float32)
        for k in range(16):
            D = (D + (A[:, k:k + 1] * B[k:k + 1, :]).astype(np.float32)).astype(np.float32)
    else:
        D = A @ B
    return [[D[d_position(lane, i)] for i in range(4)] for lane in range(32)]


# ----------------------------------------------------------------------------- the kernel, emulated
def sign_mask_bits(d):
    """kRhtSignMask16 as per-element 16-bit XOR masks (0x8000 where the RHT sign is -1)."""
    return np.where(rht_signs(d) < 0, 0x8000, 0).astype(np.uint32)


def h16_fragments(lane, one):
    """mma_h16_fragments: b[tile][kh], low half k = 2c + 8·kh, high half k + 1, column g + 8·tile."""
    g, c = lane >> 2, lane & 3
    b = [[0, 0], [0, 0]]
    for tile in range(2):
        for kh in range(2):
            n, k = g + 8 * tile, 2 * c + 8 * kh
            b[tile][kh] = (one | (one << 16)) | (F["mma_b_neg"](k, n) << 15) | (F["mma_b_neg"](k + 1, n) << 31)
    return b


def rht_mma_rows(bits, d, dtype_name, acc=np.float64):
    """rht_mma_rows for one warp: bits (16, d) uint16 raw input of the warp's rows (zeros for
    missing rows). Returns the rotated rows (16, d) as the lanes hold them, placed by
    mma_out_slot / mma_out_elem (every output exactly once)."""
    NC, NA, EPT = d // 32, d // 16, d // 4
    mask = sign_mask_bits(d)
    A = [[[0] * 4 for _ in range(NA)] for _ in range(32)]   # A[lane][a][i]
    for lane in range(32):
        g, c = lane >> 2, lane & 3
        for L in range(NC):
            for r in range(2):
                elems = [F["mma_in_elem"](L, c, m) for m in range(8)]
                assert elems == list(range(elems[0], elems[0] + 8)), "a 16-byte load is 8 consecutive elements"
                raw = [int(bits[g + 8 * r, e]) ^ int(mask[e]) for e in elems]
                words = [raw[2 * wd] | (raw[2 * wd + 1] << 16) for wd in range(4)]
                for wd in range(4):
                    A[lane][F["mma_group"](L, wd)][F["mma_a_reg"](wd, r)] = words[wd]
    one = ONE_BITS[dtype_name]
    Bf = [h16_fragments(lane, one) for lane in range(32)]
    z = [[[None, None] for _ in range(NA)] for _ in range(32)]  # z[lane][a][tile] = d0..d3
    for a in range(NA):
        for tile in range(2):
            d_t = mma([A[lane][a] for lane in range(32)], [Bf[lane][tile] for lane in range(32)], dtype_name, acc)
            for lane in range(32):
                z[lane][a][tile] = list(d_t[lane])
    group_butterflies(z, NA, acc)                  # H_NA over a
    y = np.full((16, d), np.nan)
    for lane in range(32):
        g, c = lane >> 2, lane & 3
        for a in range(NA):
            for tile in range(2):
                for i in range(4):
                    s = F["mma_out_slot"](a, tile, i & 1)
                    assert 0 <= s < EPT
                    e = F["mma_out_elem"](s, c)
                    row = g + 8 * (i >> 1)
                    assert np.isnan(y[row, e]), "an output element placed twice"
                    y[row, e] = z[lane][a][tile][i]
    assert not np.isnan(y).any(), "an output element never placed"
    return y


def quad_row_bytes(y_rounded, d):
    """quantize_store_int4 with Int4QuadGeometry (VEC 8, LANES 4) for one row: lane lig's slots
    s = 8·ch + j hold output mma_out_elem(s, lig); its code word ch (code j at bits 4j) is
    stored at byte (ch·VEC·LANES + lig·VEC) / 2, lane 0 stores the scale word at d/2.
    Codes and qparams are the reference's (the tail is the existing, separately tested code)."""
    row = np.full(d // 2 + 4, -1, np.int32)
    scale, zp = int4_qparams(y_rounded[None])
    q = int4_codes(y_rounded[None], scale, zp)[0]
    for lig in range(4):
        for ch in range(d // 32):
            w = 0
            for j in range(8):
                w |= int(q[F["mma_out_elem"](8 * ch + j, lig)]) << (4 * j)
            off = (ch * 8 * 4 + lig * 8) // 2
            for b in range(4):
                assert row[off + b] == -1, "a code byte stored twice"
                row[off + b] = (w >> (8 * b)) & 0xFF
    word = int(scale_word(scale, zp)[0])
    row[d // 2:] = [(word >> (8 * b)) & 0xFF for b in range(4)]
    assert (row >= 0).all(), "a code byte never stored"
    return row.astype(np.uint8)


def warp_rows(warp, lane, H):
    """reshape_and_cache_int4_mma: (token, h) of lane's rows g and g + 8 (one division, then the wrap)."""
    row0 = warp * 16 + (lane >> 2)
    t0 = row0 // H
    h0 = row0 - t0 * H
    wrap = (h0 + 8) // H
    return [(t0, h0), (t0 + wrap, h0 + 8 - wrap * H)]


def group_butterflies(z, n, acc, h=1):
    """The in-register H_n stages over the group index a of z[lane][a][tile][k] (every k), from
    stride h on: (u, v) -> (u + v, u - v), each rounded by ``acc``."""
    while h < n:
        for lane in range(32):
            for a in range(n):
                if a & h == 0:
                    for tile in range(2):
                        for k in range(len(z[lane][a][tile])):
                            u, v = z[lane][a][tile][k], z[lane][a + h][tile][k]
                            z[lane][a][tile][k], z[lane][a + h][tile][k] = acc(u + v), acc(u - v)
        h *= 2


def scatter_rows(y, rows, x, slots, side, cache, y_k, block_size, d):  # noqa: PLR0913
    """The emulated kernels' tail: rotated row y[r] of (token t, head h) for each (r, (t, h)) in
    ``rows`` — kept in y_k for the K side, rounded to the input dtype and stored as its cache row;
    rows past the end (t >= T) and skipped slots store nothing."""
    T = x.shape[0]
    for r, (t, h) in rows:
        if t >= T:
            continue
        if side == 0:
            y_k[t, h] = y[r]
        s = int(slots[t])
        if s < 0:
            continue
        yr = round_to_input_dtype(y[r], x.dtype)
        cache[s // block_size, side, s % block_size, h] = quad_row_bytes(yr, d)


def emulate_write(key, value, cache, slots, acc=np.float64):
    """The whole tensor-core int4 write (warp tiles, partial last warp, slot < 0 skipped) into
    `cache` (uint8, (num_blocks, 2, block_size, H, d/2 + 4)), emulated. Returns the rotated
    vectors (T, H, d) of K as computed (before rounding)."""
    T, H, d = key.shape
    dtype_name = "bfloat16" if key.dtype == NUMPY_BF16 else "float16"
    block_size = cache.shape[2]
    rows = T * H
    lanes_per_row = 2                                   # kvlab/cuda/cache.py _write_lanes
    threads = -(-(rows * lanes_per_row) // 256) * 256   # the launch grid
    y_k = np.full((T, H, d), np.nan)
    for warp in range(threads // 32):
        # which (token, h) each tile row is; rows past the end load nothing (zeros)
        tile_rows = {}
        for lane in range(0, 32, 4):
            for r, (t, h) in enumerate(warp_rows(warp, lane, H)):
                row = warp * 16 + (lane >> 2) + 8 * r
                assert (t, h) == divmod(row, H), "the wrap formula"
                tile_rows[(lane >> 2) + 8 * r] = (t, h)
        for side, x in enumerate((key, value)):
            bits = np.zeros((16, d), np.uint16)
            for tr, (t, h) in tile_rows.items():
                if t < T:
                    bits[tr] = x[t, h].view(np.uint16)
            y = rht_mma_rows(bits, d, dtype_name, acc)
            scatter_rows(y, tile_rows.items(), x, slots, side, cache, y_k, block_size, d)
    return y_k


# ----------------------------------------------------------------------------- tests
def random_kv(rng, shape, dtype):
    x = rng.standard_normal(shape) * rng.uniform(0.05, 8.0, size=shape[:-1] + (1,))
    x[..., rng.integers(0, shape[-1])] *= 15.0  # an outlier channel
    return x.astype(dtype)


def ragged_slots(rng, T, num_blocks, block_size):
    slots = rng.permutation(num_blocks * block_size)[:T].astype(np.int64)
    slots[rng.random(T) < 0.2] = -1
    return slots


CASES = [  # (d, dtype, T, H): H = 8 is the benchmark's; T·H not a multiple of 16 -> partial warp
    (128, "bfloat16", 9, 8),
    (128, "float16", 7, 3),
    (128, "bfloat16", 5, 5),
    (64, "bfloat16", 11, 2),
    (64, "float16", 6, 7),
]


def check_emulated_write(emulate, rng, d, dtype_name, T, H, skip_first=False, **kw):
    """An emulated write on fresh random rows and a ragged slot mapping with skipped (-1) slots,
    into a poisoned cache: rotated vectors = the float64 reference RHT; cache bytes = the
    reference's, untouched rows (skipped and never-written slots) included."""
    dt = DTYPES[dtype_name]
    fmt = get_format(INT4)
    block_size = 16
    num_blocks = -(-T // block_size) + 2
    key, value = random_kv(rng, (T, H, d), dt), random_kv(rng, (T, H, d), dt)
    slots = ragged_slots(rng, T, num_blocks, block_size)
    if skip_first:
        slots[0] = -1
    assert (slots < 0).any()
    poison = rng.integers(0, 256, size=fmt.cache_shape(num_blocks, block_size, H, d), dtype=np.uint8)
    want = poison.copy()
    ref_cache.reshape_and_cache(key, value, want, slots, INT4)
    got = poison.copy()
    y = emulate(key, value, got, slots, **kw)
    np.testing.assert_allclose(y, rht(key), rtol=1e-12, atol=0)
    assert np.array_equal(got, want)


@pytest.mark.parametrize("d,dtype_name,T,H", CASES)
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_emulated_write_matches_reference(d, dtype_name, T, H, seed):
    """16 rows per warp; T·H not a multiple of 16 (a partial last warp)."""
    assert (T * H) % 16 != 0
    check_emulated_write(emulate_write, np.random.default_rng([seed, d, T, H]), d, dtype_name, T, H)


def assert_codes_within_one(got, want, d):
    """float32 accumulation (as the GPU) against the float64 reference: codes within 1, ≤ 1 % of
    the bytes differ (rounding ties of the rotated value, SPEC 2.1)."""
    lo = np.abs((got[..., : d // 2] & 0xF).astype(int) - (want[..., : d // 2] & 0xF))
    hi = np.abs((got[..., : d // 2] >> 4).astype(int) - (want[..., : d // 2] >> 4))
    assert max(lo.max(), hi.max()) <= 1
    assert np.mean(got != want) <= 0.01


def check_float32_accumulation(emulate, seed, **kw):
    """With float32 accumulation (the tensor core's class; SPEC 2.1's bar): codes within 1,
    >= 99 % of written bytes equal."""
    rng = np.random.default_rng(seed)
    T, H, d = 16, 8, 128
    fmt = get_format(INT4)
    key, value = random_kv(rng, (T, H, d), NUMPY_BF16), random_kv(rng, (T, H, d), NUMPY_BF16)
    slots = np.arange(T, dtype=np.int64)
    want = np.zeros(fmt.cache_shape(1, 16, H, d), np.uint8)
    ref_cache.reshape_and_cache(key, value, want, slots, INT4)
    got = np.zeros_like(want)
    emulate(key, value, got, slots, acc=np.float32, **kw)
    assert_codes_within_one(got, want, d)


def test_float32_accumulation_within_gpu_bar():
    check_float32_accumulation(emulate_write, 7)


def assert_each_perturbation_breaks(broken: dict, emulate, seed: int):
    """Perturbing any one [layout] function (``name: (old text, new text)`` in int4_write_mma.cuh)
    must break ``emulate``'s rotation or cache bytes: the emulation is sensitive to each formula."""
    global F
    text = (loader.kernels_dir() / "int4_write_mma.cuh").read_text()
    rng = np.random.default_rng(seed)
    key = random_kv(rng, (2, 8, 128), NUMPY_BF16)
    good = F
    try:
        for name, (old, new) in broken.items():
            assert text.count(old) == 1, (name, old)
            F = layout_functions(text.replace(old, new))
            with pytest.raises(AssertionError):
                cache = np.zeros(get_format(INT4).cache_shape(1, 16, 8, 128), np.uint8)
                want = cache.copy()
                ref_cache.reshape_and_cache(key, key, want, np.arange(2), INT4)
                y = emulate(key, key, cache, np.arange(2))
                np.testing.assert_allclose(y, rht(key), rtol=1e-12, atol=0)
                assert np.array_equal(cache, want)
    finally:
        F = good


def test_a_broken_index_is_caught():
    """The emulation is sensitive to each formula: perturbing any one [layout] function breaks it."""
    assert_each_perturbation_breaks({
        "mma_in_elem": ("32 * L + 8 * c + m", "32 * L + 8 * c + (m ^ 1)"),
        "mma_group": ("2 * L + (wd >> 1)", "2 * L + (wd & 1)"),
        "mma_a_reg": ("2 * (wd & 1) + r", "2 * r + (wd & 1)"),
        "mma_b_neg": ("((k & n) >> 3)) & 1", "((k & n) >> 2)) & 1"),
        "mma_out_slot": ("4 * (aout & 1) + 2 * tile + col", "4 * (aout & 1) + tile + 2 * col"),
        "mma_out_elem": ("32 * (s >> 3) + 8 * c + (s & 7)", "32 * (s >> 3) + 8 * c + (s & 7 ^ 1)"),
    }, emulate_write, 11)


def test_host_reads_the_switch(monkeypatch):
    """kvlab/cuda/cache.py launches 2 threads per row exactly where the kernel takes the tensor-core
    path (int4_write_uses_mma in reshape_and_cache.cu: the macro defined, int4, 16-bit, d 64/128)."""
    pytest.importorskip("cupy")
    from kvlab.cuda import cache

    assert cache.int4_write_mma_enabled(["-std=c++17", "-DKVLAB_INT4_WRITE_MMA"])
    assert cache.int4_write_mma_enabled(["-DKVLAB_INT4_WRITE_MMA=1"])
    assert cache.int4_write_mma_enabled(["--define-macro=KVLAB_INT4_WRITE_MMA"])
    assert not cache.int4_write_mma_enabled(["-DKVLAB_INT4_WRITE_MMAX", "-lineinfo"])
    monkeypatch.setenv("KVLAB_NVRTC_OPTIONS", "-lineinfo")
    assert cache._write_lanes(INT4, 128, 2) == 4 and cache._write_lanes(INT4, 64, 2) == 2
    monkeypatch.setenv("KVLAB_NVRTC_OPTIONS", "-lineinfo -DKVLAB_INT4_WRITE_MMA")
    for d in (64, 128):
        assert cache._write_lanes(INT4, d, 2) == 2
    assert cache._write_lanes(INT4, 128, 4) == 4                  # float32: the old path
    assert cache._write_lanes(INT4, 256, 2) == 8                  # d = 256: the old path
    assert cache._write_lanes("int8_per_token_head", 128, 2) == 4
    src = (loader.kernels_dir() / "reshape_and_cache.cu").read_text()
    assert "sizeof(T) == 2 && (D == 64 || D == 128)" in src, "update int4_write_uses_mma in cache.py too"



# ----------------------------------------------------------------------------- 8 rows per warp
# MMA8, the default at d = 128 (rht_mma8_row in int4_write_mma.cuh, reshape_and_cache_int4_mma8 in
# reshape_and_cache.cu): lane (g, c) owns row g of the warp's 8 rows (group = thread / 4, the base
# kernel's geometry); fragment row g carries group a, fragment row g + 8 group a + 4 of the SAME
# row (mma8_pair / mma8_half); accumulator d_i of mma p is group mma8_out_group(p, i).
def rht_mma8_rows(bits, d, dtype_name, acc=np.float64, h2_mma=False):
    """rht_mma8_row for one warp: bits (8, d) uint16 raw input of the warp's rows. Returns the
    rotated rows (8, d) placed by mma_out_slot / mma_out_elem (every output exactly once).
    h2_mma: the H_2 stage through the accumulator (mma p + 1 onto mma p, ±X_{p+1}), tried and not
    kept (a spill at 80 registers, docs/notes-int4-write-mma.md); emulated to record it was exact."""
    assert d == 128
    mask = sign_mask_bits(d)
    A = [[[None] * 4 for _ in range(4)] for _ in range(32)]   # A[lane][p][i]
    for lane in range(32):
        g, c = lane >> 2, lane & 3
        for L in range(4):
            elems = [F["mma_in_elem"](L, c, m) for m in range(8)]
            assert elems == list(range(elems[0], elems[0] + 8)), "a 16-byte load is 8 consecutive elements"
            raw = [int(bits[g, e]) ^ int(mask[e]) for e in elems]
            words = [raw[2 * wd] | (raw[2 * wd + 1] << 16) for wd in range(4)]
            for wd in range(4):
                a = F["mma_group"](L, wd)
                p, i = F["mma8_pair"](a), F["mma_a_reg"](wd, F["mma8_half"](a))
                assert A[lane][p][i] is None, "an A register filled twice"
                A[lane][p][i] = words[wd]
    assert all(w is not None for lane in A for p in lane for w in p), "an A register never filled"
    one = ONE_BITS[dtype_name]
    Bf = [h16_fragments(lane, one) for lane in range(32)]    # = make_mma_h16_table (same formula)

    def run(p, tile, neg=False):
        regs = [[w ^ (0x80008000 if neg else 0) for w in A[lane][p]] for lane in range(32)]
        return mma(regs, [Bf[lane][tile] for lane in range(32)], dtype_name, acc)

    z = [[[[None] * 2 for _ in range(2)] for _ in range(8)] for _ in range(32)]  # z[lane][a][tile][col]
    for tile in range(2):
        if h2_mma:
            for p in (0, 2):
                zp, zq, zn = run(p, tile), run(p + 1, tile), run(p + 1, tile, neg=True)
                for lane in range(32):
                    for i in range(4):
                        z[lane][F["mma8_out_group"](p, i)][tile][i & 1] = acc(zp[lane][i] + zq[lane][i])
                        z[lane][F["mma8_out_group"](p + 1, i)][tile][i & 1] = acc(zp[lane][i] + zn[lane][i])
        else:
            for p in range(4):
                dd = run(p, tile)
                for lane in range(32):
                    for i in range(4):
                        a = F["mma8_out_group"](p, i)
                        assert z[lane][a][tile][i & 1] is None
                        z[lane][a][tile][i & 1] = dd[lane][i]
    group_butterflies(z, 8, acc, 2 if h2_mma else 1)
    y = np.full((8, d), np.nan)
    for lane in range(32):
        g, c = lane >> 2, lane & 3
        for a in range(8):
            for tile in range(2):
                for col in range(2):
                    s = F["mma_out_slot"](a, tile, col)
                    e = F["mma_out_elem"](s, c)
                    assert np.isnan(y[g, e]), "an output element placed twice"
                    y[g, e] = z[lane][a][tile][col]
    assert not np.isnan(y).any(), "an output element never placed"
    return y


def emulate_write_mma8(key, value, cache, slots, acc=np.float64, h2_mma=False):  # noqa: PLR0913
    """reshape_and_cache_int4_mma8, emulated: 4 threads per row (cache.py _write_lanes, unchanged),
    warp w = rows 8w … 8w + 7, grid rounded up to whole 256-thread blocks; rows past the end load
    the last token's rows and store nothing; slot < 0 stores nothing. Returns K's rotated rows."""
    T, H, d = key.shape
    dtype_name = "bfloat16" if key.dtype == NUMPY_BF16 else "float16"
    block_size = cache.shape[2]
    from kvlab.cuda.cache import _write_lanes  # noqa: PLC0415 (cupy-free import)
    lanes = _write_lanes(INT4, d, 2)
    assert lanes == 4
    threads = -(-(T * H * lanes) // 256) * 256
    y_k = np.full((T, H, d), np.nan)
    for warp in range(threads // 32):
        rows = []
        for g in range(8):
            group = (warp * 32 + 4 * g) // lanes     # (blockIdx.x·blockDim.x + threadIdx.x) / LANES
            token, h = divmod(group, H)
            rows.append((token, h))
        for side, x in enumerate((key, value)):
            bits = np.zeros((8, d), np.uint16)
            for g, (t, h) in enumerate(rows):
                bits[g] = x[min(t, T - 1), h].view(np.uint16)   # tl = valid ? token : num_tokens - 1
            y = rht_mma8_rows(bits, d, dtype_name, acc, h2_mma)
            scatter_rows(y, enumerate(rows), x, slots, side, cache, y_k, block_size, d)
    return y_k


MMA8_CASES = [(128, "bfloat16", 9, 8), (128, "float16", 7, 3), (128, "bfloat16", 5, 5), (128, "float16", 3, 1)]


@pytest.mark.parametrize("h2_mma", [False, True])
@pytest.mark.parametrize("d,dtype_name,T,H", MMA8_CASES)
@pytest.mark.parametrize("seed", [1, 2])
def test_emulated_write_mma8_matches_reference(d, dtype_name, T, H, seed, h2_mma):
    """8 rows per warp (the grid tail loads the last token's rows and stores nothing)."""
    check_emulated_write(emulate_write_mma8, np.random.default_rng([seed, d, T, H, 8]), d, dtype_name, T, H,
                         skip_first=True, h2_mma=h2_mma)


@pytest.mark.parametrize("h2_mma", [False, True])
def test_mma8_float32_accumulation_within_gpu_bar(h2_mma):
    check_float32_accumulation(emulate_write_mma8, 17, h2_mma=h2_mma)


def test_mma8_broken_index_is_caught():
    """Perturbing any one of the 8-row [layout] functions breaks the emulated bytes."""
    assert_each_perturbation_breaks({
        "mma8_pair": ("return a & 3;", "return (a >> 1) & 3;"),
        "mma8_half": ("return a >> 2;", "return a & 1;"),
        "mma8_out_group": ("return p + 4 * (i >> 1);", "return p + 4 * (i & 1);"),
    }, emulate_write_mma8, 12)


def test_mma8_is_d128_16bit_only_and_needs_no_host_change():
    """int4_write_uses_mma8 (reshape_and_cache.cu) is the d = 128, 16-bit int4 case, whose launch
    geometry (4 threads per row) is the base kernel's: cache.py's _write_lanes is unchanged."""
    from kvlab.cuda.cache import _write_lanes  # noqa: PLC0415

    src = (loader.kernels_dir() / "reshape_and_cache.cu").read_text()
    assert "return FMT == FMT_INT4 && sizeof(T) == 2 && D == 128;" in src
    assert _write_lanes(INT4, 128, 2) == 4

"""CPU emulation of pieces of the default int4 write at d = 128 ("MMA8",
kernels_cu/reshape_and_cache.cu; ``-DKVLAB_INT4_WRITE_CUDA_CORES`` is the path without them).
Its tail is the lean one since session 7 (quantize_store_int4_lean, section
``-DKVLAB_INT4_WRITE_LEAN`` below); ``-DKVLAB_INT4_WRITE_PLAIN_TAIL`` builds the previous one,
quantize_store_int4<…, BYTE_CODES, ZP_RECIP>, called "the plain tail" here:

* ``int4_chunk_codes_bytes`` (the plain tail's codes; the lean tail's clamping fallback): the magic
  words ``bits(RZ(v + 2^22 + 0.5)) = 0x4A800000 + floor(2v + 1)`` of even and odd elements packed
  into the bytes of two words, then shifted and masked into nibbles — checked against the
  reference code rule on every tie of [-0.5, 15.5), its float32 neighbours and random values, in
  every position of the word, with and without the clamp.
* ``int4_qparams_recip`` (the plain tail; int4_qparams_lean computes the zero point the same
  way): the zero point's division as Markstein's correction, with exact arithmetic, against the
  float32 division.

* LEAN2, the lean write's index math since session 8 (the default; end of the file): udiv_small /
  udiv_wide (the index divisions by float reciprocals) against integer division, the row index
  against the byte offset of ``-DKVLAB_INT4_WRITE_DIV64`` (session 7's index math, kept for A/B),
  the zero point's rounding against DIV64's.

(The shared-memory exchange variant of session 5, unmeasured, is on branch
``experiment/int4-write-variants`` with its emulation.)
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
from kvlab.reference.rounding import round_half_away

INT4 = "int4_per_token_head"
SRC = (loader.kernels_dir() / "reshape_and_cache.cu").read_text()


# ----------------------------------------------------------------------------- byte-split codes
def f32_rz(s: np.ndarray) -> np.ndarray:
    """float64 values (exact sums) rounded toward zero to float32."""
    r = s.astype(np.float32)
    over = np.abs(r.astype(np.float64)) > np.abs(s)
    r[over] = np.nextafter(r[over], np.float32(0))
    return r


def magic_bits(v: np.ndarray, clamp: bool) -> np.ndarray:
    """bits(RZ(v + 2^22 + 0.5)) of float32 v (clamped to [0, 15] first for the clamping variant)."""
    v = v.astype(np.float32)
    if clamp:
        v = np.minimum(np.maximum(v, np.float32(0)), np.float32(15))
    return f32_rz(v.astype(np.float64) + 4194304.5).view(np.uint32).astype(np.uint64)


def bytes_codes_word(v8: np.ndarray, clamp: bool) -> np.ndarray:
    """int4_chunk_codes_bytes on rows of 8 values: even elements' magic words into the bytes of e,
    odd ones' into o (mod 2^32, constants removed once), then ((e >> 1) & 0x0F0F0F0F) |
    ((o << 3) & 0xF0F0F0F0)."""
    M = np.uint64(0xFFFFFFFF)
    t = magic_bits(v8.ravel(), clamp).reshape(v8.shape)
    B = 0x4A800000
    bias = np.uint64((B + (B << 8) + (B << 16) + (B << 24)) & 0xFFFFFFFF)
    e = np.full(v8.shape[0], (np.uint64(1 << 32) - bias) & M, np.uint64)
    o = e.copy()
    for j in range(8):
        sh = np.uint64(8 * (j >> 1))
        if j & 1:
            o = (o + ((t[:, j] << sh) & M)) & M
        else:
            e = (e + ((t[:, j] << sh) & M)) & M
    return (((e >> np.uint64(1)) & np.uint64(0x0F0F0F0F)) | ((o << np.uint64(3)) & np.uint64(0xF0F0F0F0))) & M


def reference_code(v: np.ndarray) -> np.ndarray:
    return np.clip(round_half_away(v.astype(np.float32)), 0, 15).astype(np.int64)


def reference_word(v8: np.ndarray) -> np.ndarray:
    w = np.zeros(v8.shape[0], np.uint64)
    for j in range(8):
        w |= reference_code(v8[:, j]).astype(np.uint64) << np.uint64(4 * j)
    return w


def tie_neighbourhood(lo=-0.5, hi=15.5, ulps=48):
    vals = []
    for k in range(-1, 17):
        t = np.float32(k + 0.5)
        a = b = t
        vals.append(t)
        for _ in range(ulps):
            a = np.nextafter(a, np.float32(-np.inf))
            b = np.nextafter(b, np.float32(np.inf))
            vals += [a, b]
        vals += [np.float32(k), np.nextafter(np.float32(k), np.float32(-1)), np.nextafter(np.float32(k), np.float32(99))]
    v = np.array(vals, np.float32)
    return v[(v >= lo) & (v < hi)]


def as_rows_of_8(v: np.ndarray, rng) -> np.ndarray:
    """Every value in every one of the 8 positions (so each lands in each byte and nibble)."""
    v = v[: len(v) // 8 * 8] if len(v) >= 8 else np.resize(v, 8)
    rows = [np.roll(v, k).reshape(-1, 8) for k in range(8)]
    return np.concatenate(rows + [rng.permutation(v).reshape(-1, 8)])


@pytest.mark.parametrize("clamp", [False, True])
def test_byte_codes_equal_reference_codes(clamp):
    rng = np.random.default_rng(5)
    if clamp:   # the clamping variant takes any v
        v = np.concatenate([tie_neighbourhood(-40.0, 40.0), rng.uniform(-30, 30, 100_000).astype(np.float32),
                            np.float32([-1e30, -16.0, -0.5, 15.5, 16.0, 1e30, 0.0, 15.0])])
    else:       # the caller has checked v in [-0.5, 15.5)
        v = np.concatenate([tie_neighbourhood(), rng.uniform(-0.5, 15.5, 200_000).astype(np.float32),
                            np.float32([-0.5, np.nextafter(np.float32(15.5), np.float32(0))])])
        v = v[(v >= -0.5) & (v < 15.5)]
    v8 = as_rows_of_8(v, rng)
    assert np.array_equal(bytes_codes_word(v8, clamp), reference_word(v8))


def test_byte_codes_through_the_product_and_sum():
    """v = RN(RN(y · inv) + zp) from real rotated rows: the packed words equal int4_codes'."""
    rng = np.random.default_rng(8)
    y = round_to_input_dtype(rht(rng.standard_normal((3000, 128)).astype(NUMPY_BF16)), NUMPY_BF16)
    scale, zp = int4_qparams(y)
    inv = (np.float32(1.0) / scale).astype(np.float32)[:, None]
    v = ((y * inv).astype(np.float32) + zp.astype(np.float32)[:, None]).astype(np.float32)
    clamp = not ((v >= -0.5) & (v < 15.5)).all()
    q = int4_codes(y, scale, zp).reshape(-1, 8).astype(np.uint64)
    want = np.zeros(q.shape[0], np.uint64)
    for j in range(8):
        want |= q[:, j] << np.uint64(4 * j)
    assert np.array_equal(bytes_codes_word(v.reshape(-1, 8), clamp), want)


def test_variant_tail_is_switch_only():
    """The other int4 paths (d != 128, float32 input, -DKVLAB_INT4_WRITE_CUDA_CORES) keep
    int4_chunk_codes and int4_qparams: their SASS is the pre-MMA8 kernel's."""
    assert "bool BYTE_CODES = false" in SRC and "bool ZP_RECIP = false" in SRC
    assert "quantize_store_int4<D, T, G>(x, mn, mx, active, lig, row, src);" in SRC


# ----------------------------------------------------------------------------- zero point by Markstein
def f32_rn(fr) -> np.float32:
    """A Fraction rounded to nearest-even float32, exactly (no double rounding)."""
    from fractions import Fraction  # noqa: PLC0415

    c = np.float32(float(fr))
    cands = [np.nextafter(c, np.float32(-np.inf)), c, np.nextafter(c, np.float32(np.inf))]
    best = min(cands, key=lambda v: (abs(Fraction(float(v)) - fr), int(np.array(v).view(np.uint32)) & 1))
    return np.float32(best)


def zp_recip(mn: np.float32, scale: np.float32) -> tuple:
    """int4_qparams_recip's zero point: q0 = RN(x·inv), q1 = RN(q0 + RN(x − scale·q0)·inv) (two FMAs,
    each rounded once), q0 kept where |q0| >= 16. Returns (q, zp)."""
    from fractions import Fraction  # noqa: PLC0415

    x = np.float32(-mn)
    inv = np.float32(np.float32(1.0) / scale)
    q0 = np.float32(x * inv)
    if not abs(q0) < 16:
        q = q0
    else:
        rem = f32_rn(Fraction(float(x)) - Fraction(float(scale)) * Fraction(float(q0)))
        q = f32_rn(Fraction(float(rem)) * Fraction(float(inv)) + Fraction(float(q0)))
    return q, int(np.clip(round_half_away(np.float32(q)), 0, 15))


def test_zero_point_by_recip_equals_division():
    """int4_qparams_recip (the plain MMA8 tail; int4_qparams_lean's zero point is the same): the zero point equals int4_qparams' on
    random vectors' extremes, on pairs built so that -mn/scale is exactly a tie k + 0.5 or an
    integer, and where the quotient overflows float32; below 16 the quotient itself is the
    correctly rounded one."""
    rng = np.random.default_rng(9)
    pairs = []
    y = round_to_input_dtype(rht(rng.standard_normal((3000, 128)).astype(NUMPY_BF16)
                                 * rng.uniform(1e-3, 1e3, (3000, 1))), NUMPY_BF16)
    pairs += list(zip(y.min(-1), y.max(-1)))
    for _ in range(3000):   # -mn / scale = k + 0.5 or k exactly (s with few significant bits)
        s = np.float32(rng.integers(1, 64) * 2.0 ** int(rng.integers(-20, 20)))
        k = rng.integers(0, 16) + rng.choice([0.0, 0.5])
        mn = np.float32(-k * float(s))
        pairs.append((mn, np.float32(float(mn) + 15 * float(s))))
    pairs += [(np.float32(-3e38), np.float32(-3e38)), (np.float32(2e30), np.float32(2e30)),
              (np.float32(-1e33), np.float32(-1e33)), (np.float32(0), np.float32(0))]
    for mn, mx in pairs:
        mn, mx = np.float32(mn), np.float32(mx)
        with np.errstate(over="ignore", invalid="ignore"):
            scale, zp = int4_qparams(np.array([[mn, mx]], np.float32))
            s = np.float32(scale[0])
            q, z = zp_recip(mn, s)
            want = np.float32(np.float32(-mn) / s)
        assert z == int(zp[0]), (mn, mx, s, q, want)
        if abs(want) < 16 and (want == 0 or abs(want) >= np.finfo(np.float32).tiny):
            assert q == want, (mn, mx, s, q, want)


def test_byte_codes_emulation_is_the_kernels():
    """The emulation above transcribes these lines of int4_chunk_codes_bytes; a change there must
    change the emulation too."""
    for line in ("constexpr uint32_t B = 0x4A800000u;  // bits(2^22)",
                 "constexpr uint32_t BIAS = B + (B << 8) + (B << 16) + (B << 24);",
                 "const uint32_t t = __float_as_uint(__fadd_rz(v, 4194304.5f));",
                 "if (j & 1) o += t << (8 * (j >> 1));",
                 "else e += t << (8 * (j >> 1));",
                 "return ((e >> 1) & 0x0F0F0F0Fu) | ((o << 3) & 0xF0F0F0F0u);"):
        assert line in SRC, line


# ----------------------------------------------------------------------------- the lean MMA8 tail
# quantize_store_int4_lean (reshape_and_cache.cu), the default MMA8 tail since session 7 (its A/B
# name -DKVLAB_INT4_WRITE_LEAN; -DKVLAB_INT4_WRITE_PLAIN_TAIL builds the plain one): nibble codes from
# RN(t + zph), the packed quad min / max, the reciprocal without its range test.
M_EVEN, M_ONE = 8388608.0, 13631488.0      # 2^23 (bits 0x4B000000), 2^23 + 5·2^20 (0x4B500000)
PRED_HALF = np.float32(0.49999997)          # 0.5 - 2^-25


def lean_zph(zp) -> np.ndarray:
    """int4_qparams_lean: zph = RN(zp + pred(0.5)) in float32."""
    return (np.asarray(zp, np.float32) + PRED_HALF).astype(np.float32)


def lean_code_bits(v: np.ndarray, magic: float) -> np.ndarray:
    """bits(RZ(v' + M)) of float32 v'."""
    return f32_rz(v.astype(np.float32).astype(np.float64) + magic).view(np.uint32).astype(np.uint64)


def nibble_word(t8: np.ndarray, zph: np.ndarray, m_one: float = M_ONE) -> np.ndarray:
    """int4_chunk_codes_nibbles on rows of 8 products t = RN(y·inv): v' = RN(t + zph) (float32),
    word = sum_j bits(RZ(v'_j + M_j)) << 4j mod 2^32 (M_1 = m_one, the others 2^23)."""
    M = np.uint64(0xFFFFFFFF)
    v = (t8.astype(np.float32) + np.asarray(zph, np.float32).reshape(-1, 1)).astype(np.float32)
    w = np.zeros(t8.shape[0], np.uint64)
    for j in range(8):
        b = lean_code_bits(v[:, j], m_one if j == 1 else M_EVEN)
        w = (w + ((b << np.uint64(4 * j)) & M)) & M
    return w


def reference_codes_from_t(t: np.ndarray, zp: np.ndarray) -> tuple:
    """SPEC 2.1 step 4 from the product t: v = RN(t + zp), code = clip(round_half_away(v), 0, 15).
    Returns (codes, v)."""
    v = (t.astype(np.float32) + np.asarray(zp, np.float32)).astype(np.float32)
    return np.clip(round_half_away(v), 0, 15).astype(np.int64), v


def t_neighbourhood(zp: int, ulps: int = 40) -> np.ndarray:
    """Products t around every threshold k - 0.5 - zp (k = 0..16) of a zero point, ±ulps float32
    steps, plus the thresholds of the exact sum t + zp one ulp of k - 0.5 below (the double
    rounding of RN(t + zp))."""
    vals = []
    for k in range(0, 17):
        c = np.float32(k - 0.5 - zp)
        a = b = c
        vals.append(c)
        for _ in range(ulps):
            a = np.nextafter(a, np.float32(-np.inf))
            b = np.nextafter(b, np.float32(np.inf))
            vals += [a, b]
    vals += [np.float32(0.5) - np.float32(2.0 ** -25), np.float32(-0.5) - np.float32(2.0 ** -24),
             np.float32(0.0), np.float32(-0.0), np.float32(1e-30), np.float32(-1e-30)]
    return np.array(vals, np.float32)


def lean_codes_vs_reference(zph_of=lean_zph, strict=True, m_one=M_ONE) -> int:
    """Mismatches of the nibble codes against the reference over every zero point's thresholds,
    each value in each of the 8 positions; the domain is the kernel's noclamp test on v
    (-0.5 < v < 15.5, or -0.5 <= v when not strict)."""
    rng = np.random.default_rng(11)
    bad = 0
    for zp in range(16):
        t = t_neighbourhood(zp)
        t = np.concatenate([t, rng.uniform(-zp - 0.5, 15.5 - zp, 20_000).astype(np.float32)])
        want, v = reference_codes_from_t(t, np.float32(zp))
        ok = ((v > -0.5) if strict else (v >= -0.5)) & (v < 15.5)
        t, want = t[ok], want[ok]
        n = len(t) // 8 * 8
        for k in range(8):   # each value in each position
            tt = np.roll(t, k)[:n].reshape(-1, 8)
            ww = np.roll(want, k)[:n].reshape(-1, 8)
            ref = np.zeros(tt.shape[0], np.uint64)
            for j in range(8):
                ref |= ww[:, j].astype(np.uint64) << np.uint64(4 * j)
            bad += int((nibble_word(tt, np.full(tt.shape[0], zph_of(zp), np.float32), m_one) != ref).sum())
    return bad


def test_lean_nibble_codes_equal_reference_on_every_threshold():
    """floor(RN(t + zph)) = the reference code floor(RN(t + zp) + 0.5) for every zero point, on the
    float32 neighbourhoods of every threshold (ties and double-rounding cases included) and random
    products, wherever the strict noclamp test holds; the magic constants cancel mod 2^32."""
    assert lean_codes_vs_reference() == 0


def test_lean_nibble_codes_perturbations_fail():
    """The three choices the proof needs, each broken on its own, give wrong words: zph = zp + 0.5
    at zp = 0 (t = 0.5 - 2^-25 rounds up to 1), the non-strict -0.5 bound (t = -0.5 at zp = 0
    gives v' < 0), and M_1 = 2^23 (the constants no longer cancel)."""
    assert lean_codes_vs_reference(zph_of=lambda zp: np.float32(zp + 0.5)) > 0
    assert lean_codes_vs_reference(strict=False) > 0
    assert lean_codes_vs_reference(m_one=M_EVEN) > 0
    # the cancellation itself
    assert (0x4B000000 + ((0x4B500000 << 4) & 0xFFFFFFFF)) & 0xFFFFFFFF == 0
    assert all(((0x4B000000 << (4 * j)) & 0xFFFFFFFF) == 0 for j in range(2, 8))
    assert np.float32(M_ONE).view(np.uint32) == 0x4B500000 and np.float32(M_EVEN).view(np.uint32) == 0x4B000000


def lean_row_words(y: np.ndarray):
    """The lean tail on rounded rows y (n, 128) float32: reference qparams, inv = RN(1/scale),
    strict noclamp per row, nibble words of the 16 chunks of 8 (in element order). Returns
    (words (n, 16), noclamp (n,))."""
    scale, zp = int4_qparams(y)
    inv = (np.float32(1.0) / scale).astype(np.float32)
    t = (y * inv[:, None]).astype(np.float32)
    v = (t + zp.astype(np.float32)[:, None]).astype(np.float32)
    noclamp = (v.min(-1) > -0.5) & (v.max(-1) < 15.5)
    zph = lean_zph(zp)
    words = np.stack([nibble_word(t[:, 8 * c:8 * c + 8], zph) for c in range(16)], axis=1)
    return words, noclamp


@pytest.mark.parametrize("dtype", [NUMPY_BF16, np.dtype(np.float16)])
def test_lean_nibble_codes_through_real_rows(dtype):
    """Real rotated rows (random magnitudes, one-signed rows with zp = 0, zero rows): where the
    strict noclamp test holds the nibble words are the reference's codes; it holds for almost
    every row (a warp whose test fails takes int4_chunk_codes_bytes<true>, the plain tail's)."""
    rng = np.random.default_rng(12)
    x = rng.standard_normal((4000, 128)) * rng.uniform(1e-3, 50.0, (4000, 1))
    x[:200] = np.abs(x[:200]) + 3.0       # rows whose rotation is mostly one-signed
    x[200:210] = 0.0                      # zero rows: scale 1e-6, zp 0
    y = round_to_input_dtype(rht(x.astype(dtype)), dtype)
    y[210:400] = np.abs(y[210:400])        # one-signed rotated rows: zp = 0
    words, noclamp = lean_row_words(y)
    scale, zp = int4_qparams(y)
    q = int4_codes(y, scale, zp).astype(np.uint64).reshape(len(y), 16, 8)
    want = np.zeros((len(y), 16), np.uint64)
    for j in range(8):
        want |= q[:, :, j] << np.uint64(4 * j)
    assert noclamp.mean() > 0.95 and noclamp[200:400].any() and (zp[210:400] == 0).all()
    assert np.array_equal(words[noclamp], want[noclamp])


# packed quad min / max
def _hmin_nan(a, b):
    return np.where(np.isnan(a) | np.isnan(b), np.float32(np.nan), np.minimum(a, b)).astype(np.float32)


def _hmax_nan(a, b):
    return np.where(np.isnan(a) | np.isnan(b), np.float32(np.nan), np.maximum(a, b)).astype(np.float32)


def quad_min_max_lean(lanes: np.ndarray, negate=True):
    """quad_min_max_packed on the quad's 4 lanes × 16 pairs (values of T as float32): lane min
    pair and max pair, the max pair negated (sign bit), (min.lo, -max.lo) and (min.hi, -max.hi)
    folded with a packed min, then packed min with lane ^ 1 and lane ^ 2. Returns (mn, mx) per
    lane."""
    vmin = lanes[:, 0, :].copy()
    vmax = lanes[:, 0, :].copy()
    for j in range(1, 16):
        vmin, vmax = _hmin_nan(vmin, lanes[:, j, :]), _hmax_nan(vmax, lanes[:, j, :])
    nmax = -vmax if negate else vmax
    w = _hmin_nan(np.stack([vmin[:, 0], nmax[:, 0]], 1), np.stack([vmin[:, 1], nmax[:, 1]], 1))
    for o in (1, 2):
        w = _hmin_nan(w, w[np.arange(4) ^ o])
    return w[:, 0], -w[:, 1]


def quad_min_max_plain(lanes: np.ndarray):
    """minmax_unpack + the lane flag + group_min / group_max (fminf / fmaxf) of the plain tail."""
    mn_l = np.array([np.float32(np.nan) if np.isnan(l).any() else l.min() for l in lanes], np.float32)
    mx_l = np.array([np.float32(np.nan) if np.isnan(l).any() else l.max() for l in lanes], np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        flag_l = ~((mx_l - mn_l).astype(np.float32) <= np.float32(3.402823466e38))
    return np.fmin.reduce(mn_l), np.fmax.reduce(mx_l), flag_l


@pytest.mark.parametrize("dtype", [NUMPY_BF16, np.dtype(np.float16)])
def test_lean_quad_min_max_equals_plain(dtype):
    """For finite quads the packed (min, -max) reduction gives the plain tail's group min and max
    in every lane; a quad with any lane the plain tail flags (NaN, ±inf, lane range overflow) has
    a quad range that fails !(mx - mn <= MAX), so the lean tail enters its rare branch, where the
    plain tail's own lane test decides. Negating nothing breaks it."""
    rng = np.random.default_rng(13)
    big = float(np.finfo(np.float32).max) if dtype == NUMPY_BF16 else 65504.0
    broken = 0
    for it in range(3000):
        scale = 10.0 ** rng.uniform(-6, 3)
        lanes = (rng.standard_normal((4, 16, 2)) * scale).astype(dtype).astype(np.float32)
        kind = it % 6
        if kind == 1:
            lanes[rng.integers(4), rng.integers(16), rng.integers(2)] = np.nan
        elif kind == 2:
            lanes[rng.integers(4), rng.integers(16), rng.integers(2)] = rng.choice([np.inf, -np.inf])
        elif kind == 3 and dtype == NUMPY_BF16:   # lane range overflows float32
            l = rng.integers(4)
            lanes[l, 0, 0], lanes[l, 1, 1] = np.float32(3.3e38), np.float32(-3.3e38)
        elif kind == 4 and dtype == NUMPY_BF16:   # only the quad's range overflows
            lanes[0, 0, 0], lanes[3, 1, 1] = np.float32(3.3e38), np.float32(-3.3e38)
        elif kind == 5:
            lanes[rng.integers(4), rng.integers(16), rng.integers(2)] = big
        mn, mx = quad_min_max_lean(lanes)
        assert (mn == mn[0]).all() | np.isnan(mn).all() and ((mx == mx[0]).all() | np.isnan(mx).all())
        dmn, dmx, flag_l = quad_min_max_plain(lanes)
        with np.errstate(over="ignore", invalid="ignore"):
            quad_flag = not (np.float32(mx[0] - mn[0]) <= np.float32(3.402823466e38))
        if flag_l.any():
            assert quad_flag, (it, lanes)
        if not quad_flag:
            assert mn[0] == dmn and mx[0] == dmx, (it, mn[0], dmn, mx[0], dmx)
        bmn, bmx = quad_min_max_lean(lanes, negate=False)
        broken += int(not (np.isnan(dmx) or bmx[0] == dmx))
    assert broken > 0


def test_lean_rcp_range_is_the_fast_path():
    """Every int4 scale (1e-6 .. RN(MAX / 15)) has a biased exponent in [1, 252], where __frcp_rn's
    range test ((bits + 0x1800000) & 0x7f800000 > 0x1ffffff) takes the fast path that
    rcp_rn_scale copies; the test excludes exactly exponents 0, 253, 254, 255."""
    lo = np.float32(1e-6).view(np.uint32)
    hi = (np.float32(3.402823466e38) / np.float32(15.0)).astype(np.float32).view(np.uint32)
    for b in (lo, hi):
        assert ((int(b) + 0x1800000) & 0x7F800000) > 0x1FFFFFF
    fast = [e for e in range(256) if (((e << 23) + 0x1800000) & 0x7F800000) > 0x1FFFFFF]
    assert fast == list(range(1, 253))
    assert 1 <= int(lo) >> 23 and int(hi) >> 23 <= 252


def test_lean_emulation_is_the_kernels():
    """The emulations above transcribe these lines of the lean tail."""
    for line in ('zph = __fadd_rn(z, 0.49999997f);  // pred(0.5) = 0.5 - 2^-25',
                 "const float v = __fadd_rn(__fmul_rn(x[c * 8 + j], inv_scale), zph);",
                 "const uint32_t t = __float_as_uint(__fadd_rz(v, j == 1 ? 13631488.0f : 8388608.0f));",
                 "w += t << (4 * j);",
                 "const bool noclamp = __all_sync(0xffffffffu, bad || (vlo > -0.5f && vhi < 15.5f));",
                 "const uint32_t b = *reinterpret_cast<const uint32_t*>(&vmax) ^ 0x80008000u;",
                 "const uint32_t lo = __byte_perm(a, b, 0x5410), hi = __byte_perm(a, b, 0x7632);",
                 "if (!(rng <= FMAX)) {  // quad-uniform",
                 "const bool flag = !(__fsub_rn(lmx, lmn) <= FMAX);",
                 '"fma.rn.f32 e, ns, r, 0f3F800000;\\n\\t"'):
        assert line in SRC, line


# ----------------------------------------------------------------------------- LEAN2 (the default)
# The lean write's index math since session 8 (reshape_and_cache.cu, `#if
# defined(KVLAB_INT4_WRITE_LEAN2)`, defined unless -DKVLAB_INT4_WRITE_DIV64): the same cache bytes
# as DIV64 (session 7's index math) with fewer instructions outside the per-element work —
# udiv_small for token/head (float reciprocal, no correction step), udiv_wide for block/slot (the
# same with one float64 Newton step), the K row's index (slot + blk·block_size)·H + h, and the
# zero point's rounding without the copysign.
def lean2_udiv(n: np.ndarray, d: int, rd_step: int = 0, half: bool = True) -> np.ndarray:
    """udiv_small: trunc(RN_f32(n·rd + rd/2)) (one FFMA), rd = rcp.approx(d) = RN(1/d) moved by
    rd_step ulps (rcp.approx.ftz.f32 is within 1 ulp: -1, 0, +1 cover every value it may return).
    half=False drops the +rd/2 (a broken variant). n·rd + rd/2 = rd·(2n + 1)/2 has at most 46
    significant bits, so float64 holds it exactly and its cast to float32 is the single rounding."""
    rd = np.float32(1.0) / np.float32(d)
    for _ in range(abs(rd_step)):
        rd = np.nextafter(rd, np.float32(np.inf if rd_step > 0 else 0.0))
    rd = np.float64(rd)
    nf = n.astype(np.float64)
    p = (nf * rd + (rd / 2 if half else 0.0)).astype(np.float32)
    return np.trunc(p.astype(np.float64)).astype(np.int64)


LEAN2_N_MAX = 1 << 21   # udiv_small's range: n < 2^21, 1 <= d < 2^32


def lean2_divisors() -> list:
    rng = np.random.default_rng(21)
    ds = list(range(1, 1025)) + [(1 << k) + e for k in range(10, 24) for e in (-1, 0, 1) if (1 << k) + e < 1 << 24]
    ds += [int(v) for v in rng.integers(1025, 1 << 24, 300)] + [(1 << 24) - 1, 3 * 5 * 7 * 11 * 13 * 17, 999_983]
    ds += [(1 << 24) + 1, (1 << 25) + 3, (1 << 31) - 1, (1 << 32) - 1] + [int(v) for v in rng.integers(1 << 24, 1 << 32, 20)]
    return sorted(set(ds))


def lean2_udiv_failures(n_max: int = LEAN2_N_MAX, half: bool = True, ds=None) -> int:
    """Wrong quotients of udiv_small over: every n at and next to each multiple of d near the top of
    [0, n_max) and at the bottom, and random n, for each divisor and each rd in RN(1/d) ± 1 ulp."""
    rng = np.random.default_rng(22)
    bad = 0
    for d in (ds or lean2_divisors()):
        kmax = (n_max - 1) // d
        ks = np.unique(np.concatenate([np.arange(0, min(kmax, 2000) + 1),
                                       np.arange(max(0, kmax - 2000), kmax + 1),
                                       rng.integers(0, kmax + 1, 2000)]))
        n = np.concatenate([ks * d - 1, ks * d, ks * d + 1, ks * d + d - 1, rng.integers(0, n_max, 2000)])
        n = np.unique(n[(n >= 0) & (n < n_max)])
        for step in (-1, 0, 1):
            bad += int(np.count_nonzero(lean2_udiv(n, d, step, half) != n // d))
    return bad


def test_lean2_udiv_is_exact_in_its_range():
    """udiv_small(n, d) = floor(n / d) for n < 2^21 and 1 <= d < 2^32, whichever value within 1 ulp
    of 1/float(d) the hardware reciprocal returns: every divisor up to 1024, powers of two ± 1 up to
    2^24, 300 random ones, and divisors beyond 2^24 (float(d) rounded); at each, every multiple's
    neighbours at both ends of the range and random n."""
    assert lean2_udiv_failures() == 0


@pytest.mark.parametrize("d", [1, 2, 3, 7, 8, 68, 1000, (1 << 21) - 1, (1 << 24) - 1])
def test_lean2_udiv_exhaustive(d):
    """Every n in [0, 2^21) for a few divisors (the token/head split at H = 1, 2, 8; block sizes)."""
    n = np.arange(LEAN2_N_MAX, dtype=np.int64)
    for step in (-1, 0, 1):
        assert np.array_equal(lean2_udiv(n, d, step), n // d), (d, step)


def test_lean2_udiv_perturbations_fail():
    """The emulation can fail: without the +rd/2 the quotient of n = k·d is k - 1 when rd is below
    1/d; far beyond the range (n up to 2^24) the single rounding is no longer enough."""
    assert lean2_udiv_failures(half=False, ds=[3, 7, 10, 1000]) > 0
    n = np.arange(1 << 23, (1 << 24), 3, dtype=np.int64)
    assert any(np.count_nonzero(lean2_udiv(n, d, s) != n // d) for d in (3, 5, 7, 11) for s in (-1, 1))


def lean2_udiv_wide(n: int, d: int, rf_step: int = 0, newton: bool = True, half: bool = True) -> int:
    """udiv_wide, exactly (fractions): rf = rcp.approx.f32(float32(d)) = RN(1/float32(d)) moved by rf_step
    ulps; r0 = (double)rf; e = RN64(1 - d·r0); r1 = RN64(r0 + r0·e) (DFMA: one rounding each);
    p = RN64(n·r1 + r1/2); trunc(p). newton=False keeps r1 = r0, half=False drops r1/2 (broken)."""
    from fractions import Fraction as F  # noqa: PLC0415

    rf = np.float32(1.0) / np.float32(d)
    for _ in range(abs(rf_step)):
        rf = np.nextafter(rf, np.float32(np.inf if rf_step > 0 else 0.0))
    r0 = float(rf)
    r1 = r0
    if newton:
        e = float(1 - F(d) * F(r0))
        r1 = float(F(r0) + F(r0) * F(e))
    p = float(F(n) * F(r1) + (F(r1) / 2 if half else 0))
    return int(p)


def lean2_wide_cases(seed: int = 25, per_d: int = 24):
    rng = np.random.default_rng(seed)
    ds = [1, 2, 3, 5, 7, 16, 17, 32, 68, 255, 256, 257, 1000, 4095, 65537, (1 << 24) - 1, (1 << 24) + 1,
          (1 << 31) - 1] + [int(v) for v in rng.integers(2, 1 << 31, 12)]
    for d in ds:
        top = (1 << 32) - 1
        ks = [top // d, top // d - 1, (1 << 31) // d, (1 << 31) // d + 1, 1, 0] + \
             [int(v) for v in rng.integers(0, top // d + 1, per_d)]
        ns = {k * d + o for k in ks for o in (-1, 0, 1, d - 1)} | {int(v) for v in rng.integers(0, 1 << 32, 8)}
        yield d, sorted(n for n in ns if 0 <= n <= top)


def test_lean2_udiv_wide_is_exact():
    """udiv_wide(n, d) = floor(n / d) for every n < 2^32 (the kernel uses it below 2^31), 1 <= d < 2^31,
    whichever float32 reciprocal within 1 ulp the hardware returns: multiples' neighbours at the top
    of the range, at 2^31 and at the bottom, random n, for small, power-of-two-adjacent, prime-ish
    and random divisors."""
    bad = [(n, d, st) for d, ns in lean2_wide_cases() for n in ns for st in (-1, 0, 1)
           if lean2_udiv_wide(n, d, st) != n // d]
    assert not bad, bad[:5]


def test_lean2_udiv_wide_perturbations_fail():
    """Without the Newton step (the float32 reciprocal alone) or without the +r1/2, wrong quotients
    appear in the same cases."""
    cases = list(lean2_wide_cases(26, 8))
    assert any(lean2_udiv_wide(n, d, st, newton=False) != n // d for d, ns in cases for n in ns for st in (-1, 1))
    assert any(lean2_udiv_wide(n, d, st, half=False) != n // d for d, ns in cases for n in ns for st in (-1, 1))


def test_lean2_row_index_is_div64s_offset():
    """row_k: DIV64's blk·2·side_bytes + (t·H + h)·ROW equals (slot + blk·bs)·H + h rows of
    ROW bytes mod 2^64 (the LEAN2 fast path computes the first factor in 32 bits: < 2^22 there)."""
    rng = np.random.default_rng(23)
    ROW = 68
    M = (1 << 64) - 1
    cases = [(int(s), int(bs), int(H)) for s, bs, H in zip(rng.integers(0, 1 << 40, 3000), rng.integers(1, 1 << 20, 3000),
                                                             rng.integers(1, 1 << 12, 3000))]
    cases += [(s, bs, H) for s in (0, 1, 15, 16, 17, (1 << 21) - 1, (1 << 31) - 1) for bs in (1, 16, 17, 256, (1 << 24) - 1)
              for H in (1, 8, 64, (1 << 24) - 1)]
    for s, bs, H in cases:
        blk, t = divmod(s, bs)
        h = (s * 7 + 3) % H
        side = bs * H * ROW
        div64 = (blk * 2 * side + (t * H + h) * ROW) & M
        ridx = (s + blk * bs) * H + h
        assert (ridx * ROW) & M == div64
        if s < 1 << 31:
            assert s + blk * bs < 1 << 32  # LEAN2 forms it in 32 bits below 2^31


def lean2_zero_point(q: np.ndarray) -> np.ndarray:
    """LEAN2: min(trunc(RZ(max(q, 0) + 0.5)), 15) in float32 (-ftz: a subnormal q counts as 0)."""
    q = q.astype(np.float32)
    q = np.where(np.abs(q) < np.finfo(np.float32).tiny, np.float32(0), q)
    m = np.maximum(q, np.float32(0))
    with np.errstate(invalid="ignore"):
        r = f32_rz(m.astype(np.float64) + 0.5)
    return np.minimum(np.trunc(r), np.float32(15))


def div64_zero_point(q: np.ndarray) -> np.ndarray:
    """-DKVLAB_INT4_WRITE_DIV64 (the default until session 8): min(max(round_half_away(q), 0), 15)."""
    with np.errstate(invalid="ignore"):
        r = round_half_away(q.astype(np.float32)).astype(np.float32)
    return np.minimum(np.maximum(r, np.float32(0)), np.float32(15))


def lean2_zero_point_domain() -> np.ndarray:
    rng = np.random.default_rng(24)
    base = [np.float32(k / 2) for k in range(-40, 41)]
    vals = []
    for b in base:
        v = np.full(81, b, np.float32)
        up, dn = v.copy(), v.copy()
        for i in range(1, 41):
            up[i] = np.nextafter(up[i - 1], np.float32(np.inf))
            dn[i] = np.nextafter(dn[i - 1], np.float32(-np.inf))
        vals += [up[:41], dn[:41]]
    vals += [rng.uniform(-40, 40, 200_000).astype(np.float32),
             (rng.standard_normal(50_000) * 10.0 ** rng.uniform(-30, 30, 50_000)).astype(np.float32),
             np.array([0.0, -0.0, 1e-45, -1e-45, 1e-38, -1e-38, 3.4e38, -3.4e38, np.inf, -np.inf,
                       2 ** 23, 2 ** 23 + 1, 2 ** 24, -(2 ** 23), 15.5, 15.499999, 14.5, 0.49999997, -0.5,
                       -0.49999997, 0.5], np.float32)]
    return np.concatenate(vals)


def test_lean2_zero_point_equals_div64():
    """int4_qparams_lean under LEAN2: the zero point (and so p.zp up to the sign of a zero, zph and
    p.word) equals DIV64's for every q around every half-integer in [-20, 20] (±40 ulps),
    random, huge, infinite and subnormal q."""
    q = lean2_zero_point_domain()
    a, b = lean2_zero_point(q), div64_zero_point(q)
    assert a.dtype == b.dtype == np.float32 and np.array_equal(a, b), q[a != b][:10]
    assert np.array_equal((a + np.float32(0.49999997)).view(np.uint32), (b + np.float32(0.49999997)).view(np.uint32))


def test_lean2_zero_point_perturbations_fail():
    """Round to nearest instead of toward zero fails (q = pred(0.5) -> 1), so does dropping the
    clamp below (q <= -1 gives negative zero points)."""
    q = lean2_zero_point_domain()
    b = div64_zero_point(q)
    qq = np.where(np.abs(q) < np.finfo(np.float32).tiny, np.float32(0), q)
    rn = np.minimum(np.trunc((np.maximum(qq, np.float32(0)) + np.float32(0.5)).astype(np.float32)), np.float32(15))
    assert np.count_nonzero(rn != b) > 0
    with np.errstate(invalid="ignore"):
        noclamp = np.minimum(np.trunc(f32_rz(qq.astype(np.float64) + 0.5)), np.float32(15))
    assert np.count_nonzero(noclamp != b) > 0


def test_lean2_emulation_is_the_kernels():
    """The emulations above transcribe these lines of the LEAN2 code (and DIV64's zero point); a
    change there must change them too. All of it is inside KVLAB_INT4_WRITE_LEAN2, which the
    default build defines (the lean MMA8 write without -DKVLAB_INT4_WRITE_DIV64)."""
    for line in ('asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(rd) : "f"(__uint2float_rn(d)));',
                 "return __float2uint_rz(__fmaf_rn(__uint2float_rn(n), rd, 0.5f * rd));",
                 'asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(rf) : "f"(__uint2float_rn(d)));',
                 'asm("cvt.f64.f32 %0, %1;" : "=d"(r0) : "f"(rf));',
                 "const double r1 = __fma_rn(r0, __fma_rn(-dd, r0, 1.0), r0);",
                 "return __double2uint_rz(__fma_rn(static_cast<double>(n), r1, 0.5 * r1));",
                 "if (gthread < (1ull << 23)) {",
                 "const unsigned g = static_cast<unsigned>(gthread) / LANES, q = udiv_small(g, static_cast<unsigned>(H));",
                 "h = static_cast<int>(g - q * static_cast<unsigned>(H));",
                 "if (slot < (1ll << 31)) {",
                 "const unsigned blk = udiv_wide(sl, bs);  // float64 at half the float32 rate (A100, H100/H200)",
                 "ridx = static_cast<unsigned long long>(sl + blk * bs) * static_cast<unsigned>(H) + static_cast<unsigned>(h);",
                 "ridx = static_cast<unsigned long long>((slot + blk * block_size) * H + h);",
                 "uint8_t* row_k = cache + ridx * ROW;",
                 "const float z = fminf(truncf(__fadd_rz(fmaxf(q, 0.0f), 0.5f)), 15.0f);",
                 "const float z = fminf(fmaxf(round_half_away(q), 0.0f), 15.0f);"):
        assert line in SRC, line
    assert ("#if defined(KVLAB_INT4_WRITE_MMA8) && defined(KVLAB_INT4_WRITE_LEAN) && !defined(KVLAB_INT4_WRITE_DIV64)\n"
            "#define KVLAB_INT4_WRITE_LEAN2\n") in SRC
    i = SRC.index("#if defined(KVLAB_INT4_WRITE_LEAN2)\n// floor(n / d)")
    assert SRC.index("__device__ __forceinline__ unsigned udiv_small") > i

"""CPU emulation of two pieces of the default int4 write at d = 128 ("MMA8",
kernels_cu/reshape_and_cache.cu; ``-DKVLAB_INT4_WRITE_CUDA_CORES`` is the path without them):

* ``int4_chunk_codes_bytes``: the magic
  words ``bits(RZ(v + 2^22 + 0.5)) = 0x4A800000 + floor(2v + 1)`` of even and odd elements packed
  into the bytes of two words, then shifted and masked into nibbles — checked against the
  reference code rule on every tie of [-0.5, 15.5), its float32 neighbours and random values, in
  every position of the word, with and without the clamp.
* ``int4_qparams_recip``: the zero point's division as Markstein's
  correction, with exact arithmetic, against the float32 division.

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
    """int4_qparams_recip (the -DKVLAB_INT4_WRITE_MMA8 tail): the zero point equals int4_qparams' on
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

"""int4_per_token_head reference codec (kvlab/formats/int4_per_token_head.py), SPEC 2.1."""
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlab
from kvlab.arrays import NUMPY_BF16
from kvlab.formats.int4_per_token_head import int4_qparams, split_scale_word
from kvlab.reference.hadamard import inverse_rht, rht

FMT = kvlab.get_format("int4_per_token_head")


def _x_for_rotated(y):
    """An input whose RHT is exactly ``y`` (integers → H·y/16 is exact in float32)."""
    return inverse_rht(np.asarray(y, np.float64)).astype(np.float32)


def test_hand_worked_vector():
    # Choose the rotated vector y; x = s ⊙ (H y) / 16 is exact, so rht(x) == y exactly.
    y = np.array([-3, -1, 0, 1, 2, 4, 5, 12, -2, 3, 6, 7, 8, 9, 10, 11], np.float64)
    x = _x_for_rotated(y)
    np.testing.assert_array_equal(rht(x), y)
    row = FMT.quantize_rows(x)
    # mn = -3, mx = 12 -> scale = 15/15 = 1.0; zp = round(3/1) = 3; q = y + 3
    # q = [0,2,3,4,5,7,8,15,1,6,9,10,11,12,13,14] -> bytes (lo | hi << 4):
    packed = [0x20, 0x43, 0x75, 0xF8, 0x61, 0xA9, 0xCB, 0xED]
    # scale word: bits(1.0f) = 0x3F800000, low 4 bits := zp = 3 -> 0x3F800003, little-endian
    word = [0x03, 0x00, 0x80, 0x3F]
    np.testing.assert_array_equal(row, packed + word)
    assert FMT.row_bytes(16) == 12
    np.testing.assert_array_equal(FMT.dequantize_rotated(row, 16), y)   # exact: scale 1.0
    np.testing.assert_array_equal(FMT.dequantize_rows(row, 16), x)


def test_round_half_away_ties_in_codes():
    # y in [0, 7.5] -> scale 0.5, zp 0, codes = round_half_away(2y)
    y = np.array([0, 7.5, 0.25, 0.75, 1.25, 1.75, 2.25, 3.0, 0.5, 1, 2, 4, 5, 6, 7, 6.75])
    row = FMT.quantize_rows(_x_for_rotated(y))
    q = np.empty(16, np.uint8)
    q[0::2], q[1::2] = row[:8] & 0xF, row[:8] >> 4
    # 2y = 0, 15, 0.5->1, 1.5->2, 2.5->3 (half-even would give 2), 3.5->4, 4.5->5, 6, 1, 2, 4, 8, 10, 12, 14, 13.5->14
    np.testing.assert_array_equal(q, [0, 15, 1, 2, 3, 4, 5, 6, 1, 2, 4, 8, 10, 12, 14, 14])
    scale, zp = split_scale_word(row[8:12].view("<u4"))
    assert float(scale[0]) == 0.5 and int(zp[0]) == 0


def test_rotation_is_rounded_to_input_dtype(rng):
    """vLLM rounds y to bf16 before quantizing; so does the reference."""
    x = rng.standard_normal((4, 128)).astype(NUMPY_BF16)
    y = FMT.rotate(x)
    np.testing.assert_array_equal(y, rht(x).astype(NUMPY_BF16).astype(np.float32))
    x32 = x.astype(np.float32)
    np.testing.assert_array_equal(FMT.rotate(x32), rht(x32).astype(np.float32))


@pytest.mark.parametrize("d", [16, 64, 128, 256, 512])
def test_degenerate_vectors_are_finite(d):
    zero = np.zeros((1, d), np.float32)
    row = FMT.quantize_rows(zero)
    np.testing.assert_array_equal(FMT.dequantize_rows(row, d), zero)   # exact: all codes 0, zp 0
    for dt in (np.float32, np.float16, NUMPY_BF16):
        big = float(ml_dtypes.finfo(dt).max)  # the rotation (×d) saturates: defined, finite
        for c in (1.0, -3.5, 1e-30, big, -big):
            x = np.full((1, d), c, np.float32).astype(dt)
            with np.errstate(over="ignore"):
                out = FMT.dequantize_rows(FMT.quantize_rows(x), d)
            assert np.all(np.isfinite(out)), (c, dt)


def test_zero_point_clamp_limits():
    """When the rotated range excludes 0 the zero point clamps and the error is not bounded by a step.

    A one-hot input x = s_0·e_0 rotates to the constant vector y = 1: scale hits its 1e-6
    floor, zp clamps to 0 and every code saturates at 15 → y ≈ 1.5e-5. This is the format as
    specified (vLLM's too); the lab measures how often real keys come near it.
    """
    d = 64
    x = np.zeros((1, d), np.float32)
    x[0, 0] = kvlab.reference.rht_signs(d)[0]
    y_hat = FMT.dequantize_rotated(FMT.quantize_rows(x), d)
    np.testing.assert_allclose(y_hat, 15 * np.float32(1e-6) * np.ones((1, d)), rtol=1e-5)


@settings(max_examples=80, deadline=None)
@given(d=st.sampled_from([16, 32, 64, 128, 256]), seed=st.integers(0, 2**32 - 1),
       scale=st.floats(1e-3, 1e3), dtype=st.sampled_from(["bf16", "fp16", "fp32"]))
def test_error_within_half_step_in_rotated_domain(d, seed, scale, dtype):
    dt = {"bf16": NUMPY_BF16, "fp16": np.float16, "fp32": np.float32}[dtype]
    x = (np.random.default_rng(seed).standard_normal((8, d)) * scale).astype(dt)
    y = FMT.rotate(x)                           # the value the format quantizes
    s, zp = int4_qparams(y)
    y_hat = FMT.dequantize_rotated(FMT.quantize_rows(x), d)
    spans_zero = (y.min(-1) <= 0) & (y.max(-1) >= 0)
    # half a step, plus float32 rounding of y·(1/s)+zp (a few ulp of 15) and the 4 mantissa bits
    # the scale word gives up (relative 2^-19 per step, ≤ 15 steps):
    bound = s * (0.5 + 16 * 2.0**-23 * 16) + np.abs(y).max(-1) * 2.0**-18
    err = np.abs(y_hat - y).max(-1)
    assert np.all(err[spans_zero] <= bound[spans_zero]), (err / s)[spans_zero].max()

"""int8_per_token_head / fp8_per_token_head reference codecs (kvlab/formats/per_token_head.py), SPEC 2.2."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlab
from kvlab.arrays import NUMPY_BF16
from kvlab.reference.fp_codecs import e4m3_decode

INT8 = kvlab.get_format("int8_per_token_head")
FP8 = kvlab.get_format("fp8_per_token_head")


def test_int8_hand_case_round_half_away():
    x = np.zeros(16, np.float32)
    x[:6] = [127, 2.5, -2.5, 0.5, -0.5, -127]     # absmax 127 -> scale 1.0 exactly
    x[6:] = [1.49, -1.51, 3, 4, 5, 6, 7, 8, 9, 10]
    row = INT8.quantize_rows(x)
    assert row.shape == (20,)
    codes = row[:16].view(np.int8)
    np.testing.assert_array_equal(codes, [127, 3, -3, 1, -1, -127, 1, -2, 3, 4, 5, 6, 7, 8, 9, 10])
    np.testing.assert_array_equal(row[16:], [0x00, 0x00, 0x80, 0x3F])  # float32 1.0, little-endian
    np.testing.assert_array_equal(INT8.dequantize_rows(row, 16), codes.astype(np.float64))


def test_fp8_hand_case():
    x = np.zeros(16, np.float32)
    x[:4] = [448, -448, 1.0, 464 / 1.0]          # absmax 464 -> scale 464/448
    row = FP8.quantize_rows(x)
    scale = np.float32(np.float32(464) / np.float32(448))
    assert row[16:].view("<f4")[0] == scale
    v = (x * (np.float32(1) / scale)).astype(np.float32)
    assert int(row[3]) == 0x7E                     # 464 -> 448 after scaling: the largest code
    np.testing.assert_allclose(FP8.dequantize_rows(row, 16)[:4], e4m3_decode(row[:4]) * scale)
    assert v[3] == np.float32(448.0) or abs(v[3] - 448) < 1e-3


@pytest.mark.parametrize("fmt", [INT8, FP8], ids=lambda f: f.name)
@pytest.mark.parametrize("d", [16, 64, 128, 256, 512])
def test_degenerate_vectors(fmt, d):
    z = np.zeros((2, d), np.float32)
    np.testing.assert_array_equal(fmt.dequantize_rows(fmt.quantize_rows(z), d), z)
    for c in (1.0, -7.25, 1e-30, 3.3e38):
        x = np.full((2, d), c, np.float32)
        out = fmt.dequantize_rows(fmt.quantize_rows(x), d)
        assert np.all(np.isfinite(out))
        if abs(c) > 1e-5:  # the scale floor 1e-6 makes tiny vectors quantize to 0
            np.testing.assert_allclose(out, x, rtol=2e-2)


@settings(max_examples=60, deadline=None)
@given(d=st.sampled_from([16, 64, 128, 256]), seed=st.integers(0, 2**32 - 1),
       mag=st.floats(1e-3, 1e4), dtype=st.sampled_from(["bf16", "fp16", "fp32"]))
def test_int8_error_within_half_step(d, seed, mag, dtype):
    dt = {"bf16": NUMPY_BF16, "fp16": np.float16, "fp32": np.float32}[dtype]
    x = (np.random.default_rng(seed).standard_normal((6, d)) * mag).astype(dt).astype(np.float32)
    rows = INT8.quantize_rows(x)
    scale = rows[:, d:].copy().view("<f4")[:, 0].astype(np.float64)
    err = np.abs(INT8.dequantize_rows(rows, d) - x).max(-1)
    # half a step, plus float32 rounding of x·(1/scale) (≤ 127 · 2^-23 steps)
    assert np.all(err <= scale * (0.5 + 127 * 2.0**-22))


@settings(max_examples=60, deadline=None)
@given(d=st.sampled_from([16, 64, 128]), seed=st.integers(0, 2**32 - 1), mag=st.floats(1e-3, 1e4))
def test_fp8_error_within_half_step(d, seed, mag):
    x = (np.random.default_rng(seed).standard_normal((6, d)) * mag).astype(np.float32)
    rows = FP8.quantize_rows(x)
    scale = rows[:, d:].copy().view("<f4")[:, 0].astype(np.float64)[:, None]
    v = x / scale                                  # in code units, |v| ≤ 448
    err = np.abs(FP8.dequantize_rows(rows, d) / scale - v)
    # E4M3 step at |v|: 2^(e-3) for normals (e = floor(log2|v|) ≥ -6), 2^-9 for subnormals
    e = np.floor(np.log2(np.maximum(np.abs(v), 2.0**-6)))
    half_step = 0.5 * 2.0 ** (e - 3)
    assert np.all(err <= half_step * (1 + 1e-5) + 1e-6 * np.abs(v))


def test_row_layout_and_views(rng):
    cache = kvlab.allocate_cache("int8_per_token_head", 3, 16, 2, 64)
    assert cache.shape == (3, 2, 16, 2, 68) and cache.dtype == np.uint8
    key = rng.standard_normal((5, 2, 64)).astype(np.float32)
    val = rng.standard_normal((5, 2, 64)).astype(np.float32)
    kvlab.reshape_and_cache(key, val, cache, np.array([0, 17, 33, 47, 2]), "int8_per_token_head")
    data, scales = INT8.split_views(cache, "v")
    assert data.shape == (3, 16, 2, 64) and data.dtype == np.int8
    assert scales.shape == (3, 16, 2) and scales.dtype == np.float32
    # slot 17 = block 1, offset 1
    np.testing.assert_array_equal(data[1, 1], INT8.quantize_rows(val[1])[:, :64].view(np.int8))
    np.testing.assert_array_equal(scales[1, 1], np.abs(val[1]).max(-1).astype(np.float32) / np.float32(127))

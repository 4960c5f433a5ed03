"""Degenerate and hostile data, defined (SPEC 7): zeros, constants, huge, tiny, NaN/Inf, empty."""
import ml_dtypes
import numpy as np
import pytest

import kvlab
from kvlab.arrays import NUMPY_BF16
from kvlab.formats.base import NAN_SCALE_WORD
from tests.helpers import make_paged_batch

QUANTIZED = [n for n in kvlab.FORMAT_NAMES if n != "auto"]


@pytest.mark.parametrize("name", QUANTIZED)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nonfinite_vector_is_the_invalid_row(name, bad, rng):
    fmt = kvlab.get_format(name)
    d = 64
    x = rng.standard_normal((3, 2, d)).astype(np.float32)
    x[1, 0, 17] = bad
    rows = fmt.quantize_rows(x)
    # only the poisoned (token, head) changes: the others equal their own quantization
    np.testing.assert_array_equal(rows[0], fmt.quantize_rows(x[0]))
    np.testing.assert_array_equal(rows[1, 1], fmt.quantize_rows(x[1, 1]))
    bad_row = rows[1, 0]
    data = bad_row[: fmt.data_bytes(d)]
    assert not data.any(), "codes of the invalid row are 0"
    if name == "int4_per_token_head":
        assert bad_row[d // 2:].view("<u4")[0] == NAN_SCALE_WORD
    elif name == "nvfp4":
        assert np.all(bad_row[d // 2:] == 0x7F)
    else:
        assert np.isnan(bad_row[d:].view("<f4")[0])
    out = fmt.dequantize_rows(rows, d)
    assert np.all(np.isnan(out[1, 0]))
    assert np.all(np.isfinite(np.delete(out.reshape(6, d), 2, axis=0)))


@pytest.mark.parametrize("name", kvlab.FORMAT_NAMES)
def test_nan_row_reaches_only_queries_that_attend_to_it(name, rng):
    """A NaN key at position 5 of a 40-token prefill: queries 0–4 stay finite, 5–39 are NaN;
    with a sliding window of 8, queries ≥ 13 no longer see it and are finite again."""
    batch = make_paged_batch(rng, name, [40], [40], 1, 2, 64, 16)
    k = batch.k[0].copy()
    k[5, 0, 3] = np.nan
    kvlab.reshape_and_cache(k, batch.v[0], batch.kv_cache, batch.slots[0], name)
    for window, finite in ((None, lambda j: j < 5), (8, lambda j: j < 5 or j >= 13)):
        out = kvlab.reference.paged_attention(batch.q, batch.kv_cache, batch.block_table, batch.seq_lens,
                                              batch.query_start_loc, name, sliding_window=window,
                                              out_dtype=np.float64)
        for j in range(40):
            assert np.all(np.isfinite(out[j])) == finite(j), (window, j)
            if not finite(j):
                assert np.all(np.isnan(out[j]))


@pytest.mark.parametrize("name", QUANTIZED)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_huge_and_tiny_magnitudes_are_finite(name, dtype):
    fmt = kvlab.get_format(name)
    dt = NUMPY_BF16 if dtype == "bfloat16" else np.dtype(dtype)
    big = float(ml_dtypes.finfo(dt).max)
    tiny = float(ml_dtypes.finfo(dt).smallest_subnormal)
    for x in (np.full((2, 128), big), np.full((2, 128), -big), np.full((2, 128), tiny),
              np.where(np.arange(128) % 2, big, -tiny)[None]):
        x = x.astype(dt)
        with np.errstate(over="ignore"):
            out = fmt.dequantize_rows(fmt.quantize_rows(x), 128)
        assert np.all(np.isfinite(out)), (name, dtype, x.ravel()[:2])


@pytest.mark.parametrize("name", QUANTIZED)
def test_subnormal_inputs_quantize_to_zero_like_flush_to_zero(name):
    """Scale floors (1e-6) make the codes of subnormal inputs the same with and without FTZ:
    the vector dequantizes to (nearly) 0 either way."""
    fmt = kvlab.get_format(name)
    x = np.full((1, 64), 1e-40, np.float32)
    ftz = np.zeros((1, 64), np.float32)
    np.testing.assert_array_equal(fmt.quantize_rows(x), fmt.quantize_rows(ftz))


@pytest.mark.parametrize("name", kvlab.FORMAT_NAMES)
def test_constant_and_zero_vectors(name):
    fmt = kvlab.get_format(name)
    for c in (0.0, 1.0, -2.0, 1e-3):
        x = np.full((3, 2, 128), c, np.float32).astype(NUMPY_BF16)
        out = fmt.dequantize_rows(fmt.quantize_rows(x), 128)
        assert np.all(np.isfinite(out))
        if c == 0.0:
            assert np.all(out == 0)


def test_global_scale_bounds():
    key = np.ones((1, 1, 16), np.float32)
    cache = kvlab.allocate_cache("nvfp4", 1, 16, 1, 16)
    for bad in (1e-40, 1e31):
        with pytest.raises(ValueError, match="k_scale: expected a value in"):
            kvlab.reshape_and_cache(key, key, cache, np.array([0]), "nvfp4", k_scale=bad)


def test_zero_length_sequences_and_empty_batch(rng):
    batch = make_paged_batch(rng, "nvfp4", [0, 12, 0], [0, 2, 0], 2, 2, 64, 16)
    out = kvlab.paged_attention(batch.q, batch.kv_cache, batch.block_table, batch.seq_lens,
                                batch.query_start_loc, "nvfp4")
    assert out.shape == (2, 4, 64) and np.all(np.isfinite(out.astype(np.float32)))
    empty_q = np.zeros((0, 4, 64), np.float32)
    out = kvlab.paged_attention(empty_q, batch.kv_cache, np.zeros((0, 1), np.int32), np.zeros(0, np.int32),
                                np.zeros(1, np.int32), "nvfp4")
    assert out.shape == (0, 4, 64)

"""Degenerate and hostile data on the GPU follow the reference's rules (issue 6; formats/base.py):
zero/constant/huge/tiny vectors, NaN/Inf rows (the invalid row, confined in attention to the
queries that attend to it), empty batches and zero-length queries."""
import ml_dtypes
import numpy as np
import pytest

import kvlab
from kvlab.arrays import NUMPY_BF16
from tests.gpu import device_arrays as dev_arrays
from tests.helpers import make_paged_batch

pytestmark = pytest.mark.gpu

QUANTIZED = [n for n in kvlab.FORMAT_NAMES if n != "auto"]


def _dev(a):
    return dev_arrays.to_dev(a, "torch")


def _host(x):
    return dev_arrays.to_host(x)


def _hostile_rows(dtype):
    """(T=8, H=2, d=128) bf16/fp16 rows: zeros, constants, the dtype's max, subnormals, mixed."""
    big = float(ml_dtypes.finfo(dtype).max)
    tiny = float(ml_dtypes.finfo(dtype).smallest_subnormal)
    d = 128
    rows = [np.zeros(d), np.full(d, 1.0), np.full(d, -3.5), np.full(d, big), np.full(d, -big),
            np.full(d, tiny), np.where(np.arange(d) % 2, big, -tiny), np.linspace(-big, big, d)]
    x = np.stack([np.stack([r, r[::-1]]) for r in rows])
    return x.astype(dtype)


@pytest.mark.parametrize("name", QUANTIZED)
@pytest.mark.parametrize("dtype", [NUMPY_BF16, np.float16], ids=["bf16", "fp16"])
def test_hostile_magnitudes_match_reference(name, dtype):
    """Every row here is finite, so no row may be the invalid row. For int4 the rows of the
    dtype's max rotate beyond its range (and, for bf16, beyond float32 inside the rotation):
    the reference saturates at the dtype's max (formats/int4_per_token_head.py) and so must the
    kernel (its rare path in encode_store_int4, kernels_cu/reshape_and_cache.cu)."""
    x = _hostile_rows(dtype)
    T, H, d = x.shape
    fmt = kvlab.get_format(name)
    ref = kvlab.allocate_cache(name, 1, 16, H, d)
    with np.errstate(over="ignore", invalid="ignore"):
        kvlab.reshape_and_cache(x, x[::-1].copy(), ref, np.arange(T), name)
    gpu = _dev(np.zeros_like(ref))
    kvlab.reshape_and_cache(_dev(x), _dev(x[::-1].copy()), gpu, _dev(np.arange(T)), name)
    got = _host(gpu)
    if name == "int4_per_token_head":
        # the rotation's float32 sums may round differently at bf16/fp16 ties (SPEC 2.1): codes
        # within 1, everything finite; all other formats are bit-exact
        lo = np.abs((got[..., : d // 2] & 0xF).astype(int) - (ref[..., : d // 2] & 0xF))
        hi = np.abs((got[..., : d // 2] >> 4).astype(int) - (ref[..., : d // 2] >> 4))
        assert max(lo.max(), hi.max()) <= 1
        words = np.ascontiguousarray(got[..., d // 2:]).view("<u4")[..., 0]
        assert not np.any(words == 0x7FC00000), "a finite row was written as the invalid row"
    else:
        np.testing.assert_array_equal(got, ref)
    k, v = kvlab.dequantize_cache(gpu, name)
    k, v = _host(k)[0, :T], _host(v)[0, :T]
    if name == "int4_per_token_head":
        # dequantize_cache.cu rotates the integer codes back first and multiplies by the scale
        # after, in float32: (sum of up to 15·d) · scale overflows for scales near FLT_MAX/15
        # (bf16 rows near its max). Checked only where that product stays finite.
        w = np.ascontiguousarray(got[0, :, :T, :, d // 2:]).view("<u4")[..., 0]
        fits = (w & 0xFFFFFFF0).view(np.float32).astype(np.float64) * 15 * d < 3.4e38
        k, v = k[fits[0]], v[fits[1]]
    assert np.all(np.isfinite(k)) and np.all(np.isfinite(v))


def _int4_overflow_rows(dtype, rng):
    """(T=16, H=2, d=128) rows whose int4 rotation exceeds the dtype's range, and two rows with
    a non-finite element among such values. bf16: values near its max overflow float32 inside
    the rotation too; fp16: |sum| > 65504."""
    big = float(ml_dtypes.finfo(dtype).max)
    d = 128
    c = big if dtype == NUMPY_BF16 else 1000.0      # fp16: 128 · 1000 > 65504
    alt = np.where(np.arange(d) % 2, c, -c)
    rows = [np.full(d, c), np.full(d, -c), alt, alt[::-1], np.where(np.arange(d) < 64, c, 0.0),
            rng.standard_normal(d) * (0.2 * big if dtype == NUMPY_BF16 else 8000.0),
            rng.standard_normal(d) * (0.02 * big if dtype == NUMPY_BF16 else 3000.0),
            np.linspace(-c, c, d)]
    x = np.stack([np.stack([r, rng.permutation(r)]) for r in rows])
    x = np.concatenate([x, x[::-1]]).astype(dtype)
    x[3, 0, 7] = np.inf                                # non-finite input among huge ones
    x[12, 1, 100] = np.nan
    return x


@pytest.mark.parametrize("dtype", [NUMPY_BF16, np.float16], ids=["bf16", "fp16"])
def test_int4_rotation_overflow_saturates(dtype, rng):
    """int4 saturation rule (docs/formats.md): rotated values beyond the dtype's finite range
    become ± its max, as in the reference; only rows with a non-finite input are invalid."""
    name = "int4_per_token_head"
    x = _int4_overflow_rows(dtype, rng)
    T, H, d = x.shape
    v = np.ascontiguousarray(x[::-1])
    ref = kvlab.allocate_cache(name, 1, 16, H, d)
    with np.errstate(over="ignore", invalid="ignore"):
        kvlab.reshape_and_cache(x, v, ref, np.arange(T), name)
    gpu = _dev(np.zeros_like(ref))
    kvlab.reshape_and_cache(_dev(x), _dev(v), gpu, _dev(np.arange(T)), name)
    got = _host(gpu)
    wg = np.ascontiguousarray(got[..., d // 2:]).view("<u4")[..., 0]
    wr = np.ascontiguousarray(ref[..., d // 2:]).view("<u4")[..., 0]
    invalid_ref = wr == 0x7FC00000
    assert invalid_ref.sum() == 4                      # K and V of the two non-finite rows
    np.testing.assert_array_equal(wg == 0x7FC00000, invalid_ref)
    np.testing.assert_array_equal(got[invalid_ref], ref[invalid_ref])
    # finite rows: the float32 rotation may round differently at dtype ties (codes within 1,
    # scale within 2 dtype ulps); the structured rows (first five of each half) are exact
    lo = np.abs((got[..., : d // 2] & 0xF).astype(int) - (ref[..., : d // 2] & 0xF))
    hi = np.abs((got[..., : d // 2] >> 4).astype(int) - (ref[..., : d // 2] >> 4))
    assert max(lo.max(), hi.max()) <= 1
    sg = (wg & 0xFFFFFFF0).view(np.float32).astype(np.float64)
    sr = (wr & 0xFFFFFFF0).view(np.float32).astype(np.float64)
    ok = ~invalid_ref
    m = 7 if dtype == NUMPY_BF16 else 10
    assert np.all(np.abs(sg[ok] - sr[ok]) <= (2 * 2.0 ** -m + 2.0 ** -18) * sr[ok])
    # tokens 0-4 and 11-15 hold the structured rows (sums of ±c: exact in float32 after the
    # rare path's 2^-10 scaling) on both sides; cache (1, 2, 16, H, row) -> (side, t, h)
    exact = np.zeros((2, 16, H), bool)
    exact[:, [0, 1, 2, 3, 4, 11, 12, 13, 14, 15]] = True
    exact &= ok[0]
    np.testing.assert_array_equal(got[0][exact], ref[0][exact])
    k, _ = kvlab.dequantize_cache(gpu, name)
    kh = _host(k)[0]
    # (dequantize_cache.cu overflows float32 for scales near FLT_MAX/15, see above)
    fits = ~invalid_ref[0, 0] & (sg[0, 0] * 15 * d < 3.4e38)
    assert np.all(np.isfinite(kh[fits]))


@pytest.mark.parametrize("name", kvlab.FORMAT_NAMES)
@pytest.mark.parametrize("variant", ["per_head", "paged"])
def test_nan_row_is_confined_to_queries_that_see_it(name, variant, rng, monkeypatch):
    monkeypatch.setenv("KVLAB_DECODE_VARIANT", variant)
    batch = make_paged_batch(rng, name, [40], [40], 1, 2, 64, 16, dtype=NUMPY_BF16)
    k = batch.k[0].copy()
    k[5, 0, 3] = np.nan
    kvlab.reshape_and_cache(k, batch.v[0], batch.kv_cache, batch.slots[0], name)
    cache = _dev(batch.kv_cache)
    args = (_dev(batch.block_table), _dev(batch.seq_lens), _dev(batch.query_start_loc))
    for window, finite in ((None, lambda j: j < 5), (8, lambda j: j < 5 or j >= 13)):
        out = _host(kvlab.paged_attention(_dev(batch.q), cache, *args, name, sliding_window=window))
        out = out.astype(np.float32)
        for j in range(40):
            if finite(j):
                assert np.all(np.isfinite(out[j])), (window, j)
            else:
                assert np.all(np.isnan(out[j])), (window, j)


@pytest.mark.parametrize("name", kvlab.FORMAT_NAMES)
def test_empty_batch_and_zero_length_queries(name, rng):
    batch = make_paged_batch(rng, name, [0, 12, 30], [0, 2, 0], 2, 2, 64, 16, dtype=NUMPY_BF16)
    ref = kvlab.reference.paged_attention(batch.q, batch.kv_cache, batch.block_table, batch.seq_lens,
                                          batch.query_start_loc, name, out_dtype=np.float64)
    cache = _dev(batch.kv_cache)
    out = kvlab.paged_attention(_dev(batch.q), cache, _dev(batch.block_table), _dev(batch.seq_lens),
                                _dev(batch.query_start_loc), name)
    out = _host(out).astype(np.float64)
    assert out.shape == (2, 4, 64)
    # bf16 output rounding (2^-9 relative) bounds the agreement
    assert np.linalg.norm(out - ref) <= 5e-3 * np.linalg.norm(ref)
    empty = kvlab.paged_attention(_dev(batch.q[:0]), cache, _dev(np.zeros((0, 1), np.int32)),
                                  _dev(np.zeros(0, np.int32)), _dev(np.zeros(1, np.int32)), name)
    assert tuple(empty.shape) == (0, 4, 64)
    z = np.zeros((0, 2, 64), NUMPY_BF16)
    before = _host(cache).copy()
    kvlab.reshape_and_cache(_dev(z), _dev(z), cache, _dev(np.zeros(0, np.int64)), name)
    np.testing.assert_array_equal(_host(cache), before)

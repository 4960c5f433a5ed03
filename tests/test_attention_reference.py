"""Reference paged_attention (kvlab/reference/attention.py) against plain dense attention."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvlab
from kvlab.reference import paged_attention
from tests.helpers import dense_attention, make_paged_batch


def _dequantized(fmt, x, gs=1.0):
    d = x.shape[-1]
    return fmt.dequantize_rows(fmt.quantize_rows(x, global_scale=gs), d, global_scale=gs)


def _check(batch, d, sliding_window=None):
    out = paged_attention(batch.q, batch.kv_cache, batch.block_table, batch.seq_lens,
                          batch.query_start_loc, batch.fmt, k_scale=batch.k_scale,
                          v_scale=batch.v_scale, sliding_window=sliding_window, out_dtype=np.float64)
    scale = 1 / np.sqrt(d)
    for i in range(len(batch.seq_lens)):
        q0, q1 = batch.query_start_loc[i], batch.query_start_loc[i + 1]
        if q1 == q0:
            continue
        k = _dequantized(batch.fmt, batch.k[i], batch.k_scale)
        v = _dequantized(batch.fmt, batch.v[i], batch.v_scale)
        ref = dense_attention(batch.q[q0:q1], k, v, scale, sliding_window)
        # both float64; int4 goes through the rotated domain (RHT of q, inverse RHT of o):
        # differences are float64 rounding only
        np.testing.assert_allclose(out[q0:q1], ref, rtol=1e-9, atol=1e-11)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    fmt=st.sampled_from(kvlab.FORMAT_NAMES),
    gqa=st.sampled_from([1, 3, 4, 8]),
    block_size=st.sampled_from([16, 32]),
    d=st.sampled_from([64, 128]),
    lens=st.lists(st.tuples(st.integers(1, 90), st.integers(0, 90)), min_size=1, max_size=4),
    window=st.sampled_from([None, 1, 7, 40]),
    seed=st.integers(0, 2**32 - 1),
)
def test_matches_dense_causal_attention(fmt, gqa, block_size, d, lens, window, seed):
    rng = np.random.default_rng(seed)
    seq_lens = [L for L, _ in lens]
    query_lens = [min(L, 1 + ql % L) for L, ql in lens]      # decode (1), prefill (= L), chunked
    batch = make_paged_batch(rng, fmt, seq_lens, query_lens, num_kv_heads=2, gqa=gqa,
                             head_size=d, block_size=block_size)
    _check(batch, d, window)


@pytest.mark.parametrize("fmt", ["nvfp4", "int8_per_token_head"])
def test_global_scales(fmt, rng):
    batch = make_paged_batch(rng, fmt, [40, 17], [1, 17], 2, 4, 64, 16, k_scale=0.01, v_scale=0.003,
                             scale=2.0)
    _check(batch, 64)


def test_zero_length_query_sequence_and_output_dtype(rng):
    from kvlab.arrays import NUMPY_BF16
    batch = make_paged_batch(rng, "auto", [20, 5, 33], [3, 0, 1], 1, 2, 64, 16)
    _check(batch, 64)
    q = batch.q.astype(NUMPY_BF16)
    out = kvlab.paged_attention(q, batch.kv_cache, batch.block_table, batch.seq_lens,
                                batch.query_start_loc)
    assert out.dtype == NUMPY_BF16 and out.shape == q.shape


def test_int4_rotated_path_equals_unrotated(rng):
    """The rotated-domain computation (SPEC 2.1) equals attention over the dequantized cache."""
    batch = make_paged_batch(rng, "int4_per_token_head", [70, 3], [70, 1], 2, 4, 128, 16)
    out = paged_attention(batch.q, batch.kv_cache, batch.block_table, batch.seq_lens,
                          batch.query_start_loc, "int4_per_token_head", out_dtype=np.float64)
    k, v = kvlab.reference.dequantize_cache_float64(batch.kv_cache, "int4_per_token_head")
    auto_cache = np.stack([k, v], axis=1)   # a float64 "auto" view of the same values
    ref = paged_attention(batch.q, auto_cache.astype(np.float32), batch.block_table, batch.seq_lens,
                          batch.query_start_loc, "auto", out_dtype=np.float64)
    # the float32 cast of the dequantized cache bounds the agreement
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)

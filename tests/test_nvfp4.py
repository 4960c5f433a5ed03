"""nvfp4 reference codec and page layout (kvlab/formats/nvfp4.py), SPEC 2.3."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlab
from kvlab.formats.nvfp4 import swizzle_index
from kvlab.reference.fp_codecs import e2m1_decode, e4m3_decode

FMT = kvlab.get_format("nvfp4")


def test_hand_case_one_group():
    # amax 6 with global scale 1 -> sf = e4m3(6/6) = 1.0 (0x38); x/1 encoded directly
    x = np.array([6, -6, 0.25, 0.75, 2.5, 5, -0.1, 1.5, 3, 4, -1, -2, 0.5, 1, 0, -3], np.float32)
    row = FMT.quantize_rows(x)
    assert row.shape == (9,) and FMT.row_bytes(16) == 9
    codes = [0x7, 0xF, 0x0, 0x2, 0x4, 0x6, 0x8, 0x3, 0x5, 0x6, 0xA, 0xC, 0x1, 0x2, 0x0, 0xD]
    packed = [codes[2 * i] | codes[2 * i + 1] << 4 for i in range(8)]
    np.testing.assert_array_equal(row[:8], packed)
    assert row[8] == 0x38


def test_global_scale_is_a_dequant_multiplier():
    x = np.linspace(-1, 1, 16).astype(np.float32) * 1000
    gs = kvlab.calibrate_global_scale(x)
    assert gs == pytest.approx(1000 / (6 * 448))
    row = FMT.quantize_rows(x, global_scale=gs)
    sf = e4m3_decode(row[8:9])[0]
    assert sf == 448.0          # amax / 6 / gs = 448 exactly -> the largest E4M3
    np.testing.assert_allclose(FMT.dequantize_rows(row, 16, global_scale=gs)[[0, -1]], [-1000, 1000],
                               rtol=1e-6)


def test_zero_scale_group_encodes_zero():
    x = np.zeros(32, np.float32)
    x[16:] = 1e-9            # amax/6 below half the smallest E4M3 subnormal -> sf == 0 -> codes 0
    row = FMT.quantize_rows(x)
    assert row[16] == 0 and row[17] == 0 and not row[:16].any()
    assert np.all(FMT.dequantize_rows(row, 32) == 0)


@settings(max_examples=60, deadline=None)
@given(d=st.sampled_from([16, 64, 128, 256]), seed=st.integers(0, 2**32 - 1), mag=st.floats(1e-2, 1e2))
def test_error_within_half_step(d, seed, mag):
    x = (np.random.default_rng(seed).standard_normal((4, d)) * mag).astype(np.float32)
    for gs in (1.0, kvlab.calibrate_global_scale(x)):
        rows = FMT.quantize_rows(x, global_scale=gs)
        sf = e4m3_decode(rows[:, d // 2:])                   # (4, d/16)
        denom = np.repeat(sf, 16, axis=-1) * np.float32(gs)
        v = x / denom                                        # E2M1 units
        deq = FMT.dequantize_rows(rows, d, global_scale=gs) / denom
        err = np.abs(deq - v)
        # E2M1 spacing: 0.5 below 2, 1 in [2, 4), 2 in [4, 6]
        step = np.where(np.abs(v) < 2, 0.5, np.where(np.abs(v) < 4, 1.0, 2.0))
        inside = np.abs(v) <= 6
        assert np.all(err[inside] <= step[inside] / 2 + 1e-6)
        # beyond 6 (the E4M3 scale rounded down) values saturate to ±6
        assert np.all(np.abs(deq[~inside]) == 6)
        normal_sf = np.repeat(sf >= 2.0**-6, 16, axis=-1)
        # with a normal scale the E4M3 rounding is ≤ 2^-4 relative, so |v| ≤ 6·(1+2^-4)
        assert np.all(np.abs(v[normal_sf]) <= 6 * (1 + 2.0**-4) + 1e-5)


def _fresh(rng, T, H, d):
    return (rng.standard_normal((T, H, d)) * 3).astype(np.float32)


def test_slab_byte_offsets(rng):
    nb, bs, H, d = 2, 4, 2, 64
    R = d // 2 + d // 16                                     # 36
    cache = kvlab.allocate_cache("nvfp4", nb, bs, H, d)
    assert cache.shape == (nb, 2, bs, H, R)
    k, v = _fresh(rng, 1, H, d), _fresh(rng, 1, H, d)
    kvlab.reshape_and_cache(k, v, cache, np.array([1 * bs + 1]), "nvfp4")   # block 1, offset 1
    flat = cache.reshape(-1)
    slab = bs * H * R                                        # 288 bytes per (block, side)
    krow, vrow = FMT.quantize_rows(k[0]), FMT.quantize_rows(v[0])
    for side, rows in ((0, krow), (1, vrow)):
        base = (1 * 2 + side) * slab
        for h in range(H):
            data_off = base + (1 * H + h) * (d // 2)
            scale_off = base + bs * H * (d // 2) + (1 * H + h) * (d // 16)
            np.testing.assert_array_equal(flat[data_off:data_off + d // 2], rows[h, :d // 2])
            np.testing.assert_array_equal(flat[scale_off:scale_off + d // 16], rows[h, d // 2:])
    written = np.count_nonzero(flat)
    assert written <= 2 * H * R and flat[: 2 * slab].sum() == 0   # block 0 untouched


def test_v_scale_swizzle_byte_offsets(rng):
    nb, bs, H, d = 1, 8, 2, 64            # S = 4 scales per head, S/4 = 1
    fmt = kvlab.get_format("nvfp4", swizzle_v_scales=True)
    cache = kvlab.allocate_cache(fmt, nb, bs, H, d)
    k, v = _fresh(rng, bs, H, d), _fresh(rng, bs, H, d)
    kvlab.reshape_and_cache(k, v, cache, np.arange(bs), fmt)
    S, R = d // 16, d // 2 + d // 16
    flat = cache.reshape(-1)
    vbase = bs * H * R + bs * H * (d // 2)   # V slab's scale part
    kbase = bs * H * (d // 2)
    vrows, krows = FMT.quantize_rows(v), FMT.quantize_rows(k)
    for t in range(bs):
        for h in range(H):
            for g in range(S):
                tp = (t // 4) * 4 + g // (S // 4)
                gp = (g % (S // 4)) * 4 + t % 4
                assert flat[vbase + (tp * H + h) * S + gp] == vrows[t, h, d // 2 + g]
                assert flat[kbase + (t * H + h) * S + g] == krows[t, h, d // 2 + g]   # K not swizzled
    # and reading back undoes the swizzle
    k2, v2 = kvlab.dequantize_cache(cache, fmt)
    np.testing.assert_array_equal(v2[0], FMT.dequantize_rows(vrows, d).astype(np.float32))


def test_swizzle_is_a_permutation():
    for bs, S in ((16, 4), (32, 8), (16, 32)):
        tp, gp = swizzle_index(bs, S)
        assert len(set(zip(tp.ravel(), gp.ravel()))) == bs * S


def test_swizzle_constraints():
    fmt = kvlab.get_format("nvfp4", swizzle_v_scales=True)
    with pytest.raises(ValueError, match="block_size"):
        fmt.cache_shape(4, 18, 2, 128)
    with pytest.raises(ValueError, match="head_size"):
        fmt.cache_shape(4, 16, 2, 32)
    with pytest.raises(ValueError, match="swizzle_v_scales"):
        kvlab.get_format("int8_per_token_head", swizzle_v_scales=True)


def test_split_views_shapes():
    cache = kvlab.allocate_cache("nvfp4", 3, 16, 4, 128)
    data, scales = FMT.split_views(cache, "k")
    assert data.shape == (3, 16, 4, 64) and scales.shape == (3, 16, 4, 8)
    assert np.shares_memory(data, cache) and np.shares_memory(scales, cache)


def test_degenerate_vectors():
    for c in (0.0, 1.0, -2.5, 1e-30, 3e38):
        x = np.full((2, 64), c, np.float32)
        out = FMT.dequantize_rows(FMT.quantize_rows(x), 64)
        assert np.all(np.isfinite(out))
    np.testing.assert_array_equal(e2m1_decode(FMT.quantize_rows(np.zeros(16, np.float32))[:8] & 0xF), 0)

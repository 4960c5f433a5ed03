"""GPU dequantize_cache (kernels_cu/dequantize_cache.cu) and the device E2M1/E4M3 codecs vs the reference.

dequantize_cache is exact by construction (see the kernel's header: every output is one
correctly rounded float32 operation of exact values, as is the float64 reference rounded
to float32), so the comparison is bit-for-bit. The caches are filled by the *reference*
writer so that this test checks the read side independently of the GPU write side.
"""
from __future__ import annotations

import numpy as np
import pytest

import kvlab
from kvlab.arrays import NUMPY_BF16
from kvlab.reference import cache as ref_cache
from kvlab.reference import fp_codecs

from tests.gpu.device_arrays import NP_DTYPES, to_dev, to_host

pytestmark = pytest.mark.gpu


FORMATS = ("auto", "int8_per_token_head", "fp8_per_token_head", "int4_per_token_head", "nvfp4")


def filled_cache(rng, fmt, num_blocks, block_size, H, d, dtype_name, k_scale=1.0, v_scale=1.0):
    """A cache whose every slot was written by the reference from fresh random K/V."""
    n = num_blocks * block_size
    shape = (n, H, d)
    scale = rng.uniform(0.05, 8.0, size=(n, H, 1))
    key = (rng.standard_normal(shape) * scale).astype(NP_DTYPES[dtype_name])
    value = (rng.standard_normal(shape) * scale[::-1]).astype(NP_DTYPES[dtype_name])
    cache = kvlab.allocate_cache(fmt.name, num_blocks, block_size, H, d,
                                 dtype=dtype_name if fmt.name == "auto" else None)
    slots = rng.permutation(n).astype(np.int64)
    ref_cache.reshape_and_cache(key, value, cache, slots, fmt, k_scale, v_scale)
    return cache


def case_list():
    out = []
    for f in FORMATS:
        for d in (16, 64, 128, 256, 512):
            out.append((f, d, "bfloat16", "torch"))
        out.append((f, 128, "float16", "cupy"))
        out.append((f, 64, "float32", "cupy"))
    return out


@pytest.mark.parametrize("fmt_name,d,dtype_name,kind", case_list())
def test_matches_reference_exactly(rng, fmt_name, d, dtype_name, kind):
    fmt = kvlab.get_format(fmt_name)
    H = int(rng.integers(1, 9))
    bs = int(rng.choice([16, 32]))
    nb = int(rng.integers(2, 6))
    cache = filled_cache(rng, fmt, nb, bs, H, d, dtype_name)
    kw, vw = ref_cache.dequantize_cache(cache, fmt)
    cd = to_dev(cache, kind)
    k, v = kvlab.dequantize_cache(cd, kv_cache_dtype=fmt)
    assert type(k) is type(cd) and type(v) is type(cd)
    kg, vg = to_host(k), to_host(v)
    assert kg.dtype == np.float32 and kg.shape == (nb, bs, H, d)
    # exact: see the module docstring
    assert np.array_equal(kg, kw), f"K differs in {np.mean(kg != kw):.4%} of elements"
    assert np.array_equal(vg, vw), f"V differs in {np.mean(vg != vw):.4%} of elements"


@pytest.mark.parametrize("swizzle", [False, True])
def test_nvfp4_global_scales_and_swizzle(rng, swizzle):
    fmt = kvlab.get_format("nvfp4", swizzle_v_scales=swizzle)
    cache = filled_cache(rng, fmt, 3, 16, 4, 128, "bfloat16", k_scale=0.2, v_scale=0.05)
    kw, vw = ref_cache.dequantize_cache(cache, fmt, 0.2, 0.05)
    k, v = kvlab.dequantize_cache(to_dev(cache, "torch"), kv_cache_dtype=fmt, k_scale=0.2, v_scale=0.05)
    assert np.array_equal(to_host(k), kw)
    assert np.array_equal(to_host(v), vw)


@pytest.mark.parametrize("fmt_name", FORMATS)
def test_gpu_round_trip_matches_reference_round_trip(rng, fmt_name):
    """GPU write then GPU read vs reference write then reference read.

    Exact except int4, whose written codes may differ from the reference's by rounding ties
    of the rotation (counted in test_reshape_and_cache_gpu.compare_int4). For int4 the GPU read
    of the GPU-written cache must equal the *reference* read of that same cache exactly, and
    its error against the input must be the reference's own quantization error to within 1%
    (a handful of codes one step apart cannot move the relative error further).
    """
    fmt = kvlab.get_format(fmt_name)
    H, d, bs, nb = 4, 128, 16, 4
    n = nb * bs
    key = (rng.standard_normal((n, H, d)) * 3).astype(NUMPY_BF16)
    value = (rng.standard_normal((n, H, d)) * 0.5).astype(NUMPY_BF16)
    slots = rng.permutation(n).astype(np.int64)
    cache = kvlab.allocate_cache(fmt_name, nb, bs, H, d, dtype="bfloat16" if fmt_name == "auto" else None)
    ref_cache.reshape_and_cache(key, value, cache, slots, fmt)
    kw, vw = ref_cache.dequantize_cache(cache, fmt)
    cd = to_dev(np.zeros_like(cache), "torch")
    kvlab.reshape_and_cache(to_dev(key, "torch"), to_dev(value, "torch"), cd, to_dev(slots, "torch"),
                            kv_cache_dtype=fmt_name)
    k, v = kvlab.dequantize_cache(cd, kv_cache_dtype=fmt_name)
    kg, vg = to_host(k), to_host(v)
    if fmt_name != "int4_per_token_head":
        assert np.array_equal(kg, kw) and np.array_equal(vg, vw)
        return
    kr, vr = ref_cache.dequantize_cache(to_host(cd), fmt)
    assert np.array_equal(kg, kr) and np.array_equal(vg, vr)
    for got, want, x in ((kg, kw, key), (vg, vw, value)):
        xs = np.zeros_like(got)
        xs.reshape(n, H, d)[slots] = x.astype(np.float32)
        e_gpu = np.linalg.norm(got - xs) / np.linalg.norm(xs)
        e_ref = np.linalg.norm(want - xs) / np.linalg.norm(xs)
        assert e_gpu <= 1.01 * e_ref, f"int4 round-trip error {e_gpu:.4g} vs reference {e_ref:.4g}"


def test_e2m1_e4m3_encoders_match_reference(rng):
    """Device codecs on random magnitudes over 1e-8…1e4, every rounding midpoint, and specials."""
    import cupy

    from kvlab.cuda import cache as gpu

    x = rng.standard_normal(200_000) * 10.0 ** rng.uniform(-8, 4, 200_000)
    e4 = fp_codecs.e4m3_decode(np.arange(256, dtype=np.uint8))
    mags = np.unique(np.abs(e4[np.isfinite(e4)]))
    mids = (mags[1:] + mags[:-1]) / 2                   # exact ties of E4M3 (RNE decides)
    e2 = np.unique(np.abs(fp_codecs.E2M1_VALUES))
    mids2 = ((e2[1:] + e2[:-1]) / 2).astype(np.float32)  # ties of E2M1
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 448, 464, 465, 480, 1e9, -1e9,
                        2.0 ** -9, 2.0 ** -10, 3 * 2.0 ** -11, 2.0 ** -6, 6, 7, -0.1, -0.24])
    allx = np.concatenate([x, mids, -mids, mids2, -mids2, np.nextafter(mids2, np.float32(0)),
                           np.nextafter(mids2, np.float32(10)), special]).astype(np.float32)
    c2, c4, c4x2 = gpu.codec_probe(cupy.asarray(allx))
    with np.errstate(invalid="ignore"):
        want2, want4 = fp_codecs.e2m1_encode(allx), fp_codecs.e4m3_encode(allx)
    got2, got4, got4x2 = cupy.asnumpy(c2), cupy.asnumpy(c4), cupy.asnumpy(c4x2)
    # the paired encoder (hardware cvt on sm_89+) is specified for non-NaN inputs only
    fin = ~np.isnan(allx)
    assert np.array_equal(got4x2[fin], want4[fin]), f"E4M3x2 differs at x={allx[fin][got4x2[fin] != want4[fin]][:5]}"
    # CuPy compiles with -ftz: float32 denormal inputs read as ±0. They are far below both
    # formats' smallest rounding point, so the codes are the same either way; no exclusion needed.
    assert np.array_equal(got2, want2), f"E2M1 differs at x={allx[got2 != want2][:5]}"
    assert np.array_equal(got4, want4), f"E4M3 differs at x={allx[got4 != want4][:5]}"


def test_e2m1_e4m3_decoders_match_reference():
    import cupy

    from kvlab.cuda import cache as gpu

    t2, t4 = gpu.codec_tables(cupy.zeros(1, dtype=cupy.float32))
    w2 = fp_codecs.e2m1_decode(np.arange(16)).astype(np.float32)
    w4 = fp_codecs.e4m3_decode(np.arange(256, dtype=np.uint8)).astype(np.float32)
    g2, g4 = cupy.asnumpy(t2), cupy.asnumpy(t4)
    assert np.array_equal(g2.view(np.uint32), w2.view(np.uint32))   # -0.0 included
    nan = np.isnan(w4)
    assert np.array_equal(np.isnan(g4), nan)
    assert np.array_equal(g4[~nan].view(np.uint32), w4[~nan].view(np.uint32))


def test_errors_name_the_argument():
    import cupy

    from kvlab.cuda import cache as gpu

    with pytest.raises(ValueError, match="kv_cache"):
        gpu.dequantize_cache(cupy.zeros((2, 3, 16, 2, 68), dtype=cupy.uint8), "int4_per_token_head")
    with pytest.raises(TypeError, match="kv_cache"):
        gpu.dequantize_cache(cupy.zeros((2, 2, 16, 2, 68), dtype=cupy.float32), "int4_per_token_head")
    with pytest.raises(ValueError, match="k_scale"):
        gpu.dequantize_cache(cupy.zeros((2, 2, 16, 2, 72), dtype=cupy.uint8), "nvfp4", k_scale=0.0)

"""The write kernel's exact-rounding shortcuts (kernels_cu/reshape_and_cache.cu) at the inputs
where they could go wrong: every int8 rounding tie, every nvfp4 E2M1 decision point, signed
zeros and subnormals. Random data hits these rarely; here every row is built from them.
All formats compared bit for bit with the NumPy reference (the whole cache).
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import kvlab
from kvlab import arrays
from kvlab.arrays import NUMPY_BF16
from tests.gpu.device_arrays import to_dev, to_host

pytestmark = pytest.mark.gpu

DTYPES = [NUMPY_BF16, np.float16]
IDS = ["bf16", "fp16"]


def _write_both(x, name, k_scale=1.0, v_scale=1.0):
    """(reference cache, GPU cache) after writing K = x, V = x reversed along tokens."""
    T, H, d = x.shape
    fmt = kvlab.get_format(name) if isinstance(name, str) else name
    nb = -(-T // 16)
    v = np.ascontiguousarray(x[::-1])
    ref = kvlab.allocate_cache(fmt, nb, 16, H, d, dtype=arrays.dtype_name(x) if fmt.name == "auto" else None)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        kvlab.reshape_and_cache(x, v, ref, np.arange(T), fmt, k_scale, v_scale)
    gpu = to_dev(np.zeros_like(ref))
    kvlab.reshape_and_cache(to_dev(x), to_dev(v), gpu, to_dev(np.arange(T)), fmt, k_scale, v_scale)
    return ref, to_host(gpu)


def _int8_tie_rows(dtype, rng):
    """Rows whose amax is 127·2^j (scale 2^j exactly, 1/scale exact), every other element an
    exact tie (k + 0.5)·2^j of the round-half-away rule, both signs; plus ±0 and subnormals."""
    d = 128
    ties = np.arange(-127, 127) + 0.5                     # 254 ties, |k + 0.5| <= 126.5
    rows = []
    for j in (-8, -3, 0, 2, 5):
        for start in range(0, ties.size, d - 1):
            body = ties[start:start + d - 1]
            body = np.concatenate([body, rng.permutation(ties)[: d - 1 - body.size]])
            rows.append(np.concatenate([[127.0], body]) * 2.0 ** j)
            rows.append(np.concatenate([[-127.0], rng.permutation(ties)[: d - 1]]) * 2.0 ** j)
    tiny = float(ml_dtypes.finfo(dtype).smallest_subnormal)
    z = np.zeros(d)
    z[0], z[1], z[2], z[3] = 1.0, -0.0, tiny, -tiny
    rows.insert(0, z)
    x = np.stack(rows).astype(dtype)
    assert np.signbit(x[0, 1].astype(np.float32))  # -0.0 survives astype
    n = (x.shape[0] // 2) * 2
    return x[:n].reshape(n // 2, 2, d)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("name", ["int8_per_token_head", "fp8_per_token_head"])
def test_int8_fp8_rounding_ties_exact(name, dtype, rng):
    x = _int8_tie_rows(dtype, rng)
    ref, got = _write_both(x, name)
    np.testing.assert_array_equal(got, ref)


def _nvfp4_decision_rows(dtype):
    """Groups of 16 whose amax is 6·sf for an E4M3 value sf (so the block scale is sf exactly)
    and whose other elements are t·sf for every E2M1 decision point t (the ties of RNE) and the
    dtype's neighbours of 1.25·sf / 1.75·sf, with both signs; one group of ±0 and subnormals."""
    sfs = np.arange(0x08, 0x70, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    t = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    groups = []
    for sf in sfs:
        g = np.concatenate([[6.0 * sf], t * sf, -(t * sf)])
        g = np.concatenate([g, [-6.0 * sf]])[:16]
        groups.append(g)
        a = (np.array([1.25, 1.75, 2.5, 0.25]) * sf).astype(dtype)
        up = np.nextafter(a, np.array(np.inf, dtype=dtype))
        dn = np.nextafter(a, np.array(0, dtype=dtype))
        groups.append(np.concatenate([[6.0 * sf], up.astype(np.float64), dn.astype(np.float64),
                                      -up.astype(np.float64), [0.5 * sf, -0.0, 0.0]]))
    # scale bytes that are subnormal E4M3 (amax/6 < 2^-6) or saturated (amax/6 > 448): there
    # |x|/denom can exceed 7 and the kernel's E2M1 encode must saturate (e2m1_pack8<true>)
    for amax in (6 * 1.4 * 2.0 ** -9, 6 * 3.3 * 2.0 ** -9, 0.05, 3000.0, 9000.0):
        groups.append(np.concatenate([[amax, -amax], amax * np.linspace(-0.99, 0.99, 14)]))
    tiny = float(ml_dtypes.finfo(dtype).smallest_subnormal)
    groups.append(np.array([1.0, -0.0, 0.0, tiny, -tiny] + [0.0] * 11))
    groups.append(np.array([-0.0] * 16))
    while len(groups) % 16:
        groups.append(groups[len(groups) % 7])
    x = np.concatenate(groups).astype(dtype)
    if dtype == np.float16:
        x = np.where(np.isfinite(x), x, 0).astype(dtype)
    return x.reshape(-1, 2, 128)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("scales", [(1.0, 1.0), (1.0, 0.37), (3.0e-3, 1.0)], ids=["gs1", "gsV", "gsK"])
@pytest.mark.parametrize("swizzle", [False, True])
def test_nvfp4_decision_points_exact(dtype, scales, swizzle):
    """Global scale 1.0 takes the 2-instruction division by an E4M3 divisor, other global
    scales Markstein's correction; both must give the reference's codes at every tie."""
    x = _nvfp4_decision_rows(dtype)
    fmt = kvlab.get_format("nvfp4", swizzle_v_scales=swizzle)
    ref, got = _write_both(x, fmt, *scales)
    np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_auto_copies_bytes(dtype, rng):
    """auto stores the input bytes as given (NaN payloads and -0 included)."""
    x = rng.standard_normal((8, 2, 64)).astype(dtype)
    bits = x.view(np.uint16)
    bits[0, 0, :4] = [0x7FC1, 0xFFC3, 0x7F81, 0x8000] if dtype == NUMPY_BF16 else [0x7E01, 0xFE03, 0x7C01, 0x8000]
    ref, got = _write_both(x, "auto")
    np.testing.assert_array_equal(got.view(np.uint16), ref.view(np.uint16))

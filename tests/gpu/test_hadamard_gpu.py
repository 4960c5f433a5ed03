"""GPU Walsh–Hadamard / RHT (kernels_cu/hadamard.cu, kvlab/cuda/hadamard.py) vs kvlab.reference.hadamard.

Needs a GPU (skipped otherwise). bf16 goes through torch CUDA tensors (CuPy has no bf16),
fp16/float32 through both CuPy and torch.
"""
from __future__ import annotations

import numpy as np
import pytest

from kvlab.reference import hadamard as ref
from tests.gpu.device_arrays import NP_DTYPES, to_dev, to_host, torch

pytestmark = pytest.mark.gpu

HEAD_SIZES = (16, 32, 64, 128, 256, 512)
MANTISSA_BITS = {"bfloat16": 7, "float16": 10, "float32": 23}


def random_rows(rng, shape, dtype_name):
    """Fresh random data, never zeros: normal rows with a random per-row scale and outliers."""
    x = rng.standard_normal(shape) * rng.uniform(0.05, 8.0, size=shape[:-1] + (1,))
    x[..., rng.integers(0, shape[-1])] *= 20.0  # an outlier channel, as real K has
    return x.astype(NP_DTYPES[dtype_name])


def ulp(v: np.ndarray, dtype_name: str) -> np.ndarray:
    """One unit in the last place of |v| in the dtype (normal range; smallest normal below it)."""
    m = MANTISSA_BITS[dtype_name]
    min_exp = {"bfloat16": -126, "float16": -14, "float32": -126}[dtype_name]
    e = np.floor(np.log2(np.maximum(np.abs(v), 2.0 ** min_exp)))
    return 2.0 ** (e - m)


def cases():
    out = []
    for d in HEAD_SIZES:
        out.append((d, "bfloat16", "torch"))
        out.append((d, "float16", "cupy"))
        out.append((d, "float32", "torch" if d % 64 else "cupy"))
    return out


@pytest.mark.parametrize("d,dtype_name,kind", cases())
@pytest.mark.parametrize("mode", ["wht", "rht", "inverse_rht"])
def test_transform_matches_reference(rng, d, dtype_name, kind, mode):
    from kvlab.cuda import hadamard as gpu

    if kind == "torch" and torch is None:
        pytest.skip("torch not installed")
    x = random_rows(rng, (int(rng.integers(1, 40)), 3, d), dtype_name)
    xd = to_dev(x, kind)
    if mode == "wht":
        out, ref64 = gpu.wht(xd), ref.wht(x.astype(np.float64))
    elif mode == "rht":
        out, ref64 = gpu.rht(xd), ref.rht(x)
    else:
        out, ref64 = gpu.rht(xd, inverse=True), ref.inverse_rht(x)
    assert type(out) is type(xd)
    got = to_host(out)
    assert got.dtype == x.dtype and got.shape == x.shape
    got64 = got.astype(np.float64)
    # Tolerance. The kernel sums in float32 and rounds once to the dtype; the reference is
    # float64. Float32 butterflies err by at most log2(d)·2^-24·Σ|x_j| per element (the
    # classic bound for a log2(d)-stage sum; the inverse divides it by d), and the final
    # rounding adds half an ulp of the dtype (one ulp allowed: the float32 error can push a
    # near-tie the other way). Nothing looser: a wrong sign, index or stride is off by O(|x|).
    l1 = np.abs(x.astype(np.float64)).sum(axis=-1, keepdims=True)
    f32_err = np.log2(d) * 2.0 ** -24 * l1 / (d if mode == "inverse_rht" else 1)
    tol = ulp(ref64, dtype_name) + f32_err
    err = np.abs(got64 - ref64)
    assert np.all(err <= tol), f"max err/tol {np.max(err / tol):.3g} (d={d}, {dtype_name}, {mode})"
    if dtype_name != "float32":
        # and the rounded result is the reference's own rounding almost everywhere: only
        # float32 sums that land within 2^-24 relative of a bf16/fp16 tie may differ
        same = np.mean(got64 == ref64.astype(x.dtype).astype(np.float64))
        assert same >= 0.99, f"only {same:.4f} of elements equal the rounded reference"


@pytest.mark.parametrize("d", HEAD_SIZES)
def test_rht_round_trip_float32(rng, d):
    """inverse(rht(x)) == x to float32 rounding (both directions on the GPU)."""
    import cupy
    from kvlab.cuda import hadamard as gpu

    x = rng.standard_normal((33, d)).astype(np.float32)
    back = cupy.asnumpy(gpu.rht(gpu.rht(cupy.asarray(x)), inverse=True))
    # two float32 transforms: 2·log2(d) rounding steps, each ≤ 2^-24·Σ|x| (scaled back by d)
    tol = 2 * np.log2(d) * 2.0 ** -24 * np.abs(x).sum(axis=-1, keepdims=True) + 1e-30
    assert np.all(np.abs(back.astype(np.float64) - x) <= tol)


def test_signs_are_vllms(rng):
    """The kernel's constant sign table is exactly kvlab's VLLM_SIGNS_512: rht(e_i) = s_i · H[i]."""
    import cupy
    from kvlab.cuda import hadamard as gpu

    d = 512
    eye = np.eye(d, dtype=np.float32)
    y = cupy.asnumpy(gpu.rht(cupy.asarray(eye)))
    expect = ref.rht_signs(d)[:, None] * ref.hadamard_matrix(d)
    assert np.array_equal(y.astype(np.float64), expect)


def test_errors_name_the_argument():
    import cupy
    from kvlab.cuda import hadamard as gpu

    with pytest.raises(ValueError, match="x"):
        gpu.rht(cupy.zeros((4, 24), dtype=cupy.float32))          # unsupported head size
    with pytest.raises(TypeError, match="x"):
        gpu.rht(cupy.zeros((4, 64), dtype=cupy.int32))             # dtype
    with pytest.raises(ValueError, match="x"):
        gpu.wht(cupy.zeros((64, 8), dtype=cupy.float32).T)         # non-contiguous
    with pytest.raises(TypeError, match="x"):
        gpu.rht(np.zeros((4, 64), dtype=np.float32))               # host array
    flat = cupy.ones(4 * 64 + 8, dtype=cupy.float16)
    with pytest.raises(ValueError, match=r"^x: its data must start on a 16-byte boundary"):
        gpu.rht(flat[1:1 + 4 * 64].reshape(4, 64))                 # contiguous, 2 bytes off
    # and the device is still usable afterwards (no kernel ran on the misaligned view)
    assert float(gpu.wht(flat[8:8 + 4 * 64].reshape(4, 64)).astype(cupy.float32)[0, 0]) == 64.0

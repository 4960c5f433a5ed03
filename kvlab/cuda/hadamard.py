"""GPU Walsh–Hadamard transform and RHT (``kernels_cu/hadamard.cu``).

Reference: :mod:`kvlab.reference.hadamard`. Along the last axis, head sizes
16 … 512 (powers of two), bf16/fp16/float32 in and out: computed in float32
registers and warp shuffles, the output rounded once to the input dtype.
"""
from __future__ import annotations

from .. import arrays, checks
from ..reference.hadamard import SUPPORTED_HEAD_SIZES
from . import launch as L
from .loader import KernelSpec, get_kernel, register

THREADS = 256
#: rows per lane group (all loads issued before the math: 16·ROWS bytes in flight per lane)
ROWS = 2
DTYPES = ("bfloat16", "float16", "float32")
MODES = {"wht": 0, "rht": 1, "inverse_rht": 2}
_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}

SPECS = register("hadamard", [
    KernelSpec("hadamard", "hadamard_rows", (d, dt, m, ROWS))
    for d in SUPPORTED_HEAD_SIZES for dt in DTYPES for m in MODES.values()
])


def _lanes(d: int, dtype_name: str) -> int:
    """Lanes per row, as ``RowGeometry`` in ``kernels_cu/quant_formats.cuh``."""
    vec = 16 // _ITEMSIZE[dtype_name]
    return max(1, min(32, d // vec))


def _check(x, name: str):
    checks.check_array(x, name, dtypes=DTYPES, contiguous=True)
    k = checks.check_array_like(x, name)
    if k == "numpy":
        raise TypeError(f"{name}: kvlab.cuda.hadamard takes CuPy arrays or torch CUDA tensors; "
                        "use kvlab.reference.hadamard for NumPy")
    checks.check_last_dim_in(x, name, SUPPORTED_HEAD_SIZES)
    checks.check_aligned16(x, name)   # 16-byte row vectors


def launch_rows(x, out, mode: str) -> None:
    """No-validation launcher (benchmarks): ``out = transform(x)`` along the last axis.

    x, out: contiguous, same shape and dtype, on one device.
    """
    s = arrays.shape(x)
    d = s[-1]
    n_rows = 1
    for v in s[:-1]:
        n_rows *= v
    if n_rows == 0:
        return
    dt = arrays.dtype_name(x)
    spec = KernelSpec("hadamard", "hadamard_rows", (d, dt, MODES[mode], ROWS))
    groups_per_block = THREADS // _lanes(d, dt)
    grid = -(-n_rows // (groups_per_block * ROWS))
    with L.stream_of(x):
        k = get_kernel(spec, arrays.device_id(x))
        L.launch(k, (grid,), (THREADS,), (L.ptr(x), L.ptr(out), L.i64(n_rows)))


def _run(x, mode: str, name: str):
    _check(x, name)
    out = L.empty(x, arrays.shape(x), arrays.dtype_name(x))
    launch_rows(x, out, mode)
    return out


def wht(x):
    """Unnormalized WHT ``y = H · x`` along the last axis. ``(..., d)`` → ``(..., d)``, same dtype and kind."""
    return _run(x, "wht", "x")


def rht(x, inverse: bool = False):
    """vLLM's RHT ``y = H · (s ⊙ x)`` (or, with ``inverse``, ``x = s ⊙ (H · y) / d``) along the last axis.

    x: CuPy array or torch CUDA tensor ``(..., d)``, bf16/fp16/float32, C-contiguous,
    ``d`` in 16 … 512. Returns the same kind, shape and dtype (rounded once from float32).
    """
    return _run(x, "inverse_rht" if inverse else "rht", "y" if inverse else "x")

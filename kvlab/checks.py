"""Input validation: one place, messages that name the argument, the expectation and the value.

Every public entry point calls these *before* any work or kernel launch
(SPEC 7). Never ``assert`` for user input.
"""
from __future__ import annotations

import numbers
from typing import Iterable, Sequence

import numpy as np

from . import arrays

FLOAT_DTYPES = ("bfloat16", "float16", "float32")
HALF_DTYPES = ("bfloat16", "float16")


def check_choice(value, name: str, choices: Sequence) -> None:
    if isinstance(value, (bool, np.bool_)) or value not in tuple(choices):
        raise ValueError(f"{name}: expected one of {list(choices)}, got {value!r}")


def check_int(value, name: str, lo: int | None = None, hi: int | None = None) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    v = int(value)
    if lo is not None and v < lo:
        raise ValueError(f"{name}: expected >= {lo}, got {v}")
    if hi is not None and v > hi:
        raise ValueError(f"{name}: expected <= {hi}, got {v}")
    return v


def check_float(value, name: str, positive: bool = False, finite: bool = True) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a float, got {type(value).__name__} {value!r}")
    v = float(value)
    if finite and not np.isfinite(v):
        raise ValueError(f"{name}: expected a finite number, got {v}")
    if positive and not v > 0:
        raise ValueError(f"{name}: expected > 0, got {v}")
    return v


def check_power_of_two(value, name: str, lo: int = 1, hi: int = 1 << 30) -> int:
    v = check_int(value, name)
    if v < lo or v > hi or v & (v - 1):
        raise ValueError(f"{name}: expected a power of two in [{lo}, {hi}], got {v}")
    return v


def check_array_like(x, name: str) -> str:
    k = arrays.kind(x)
    if k == "other":
        raise TypeError(
            f"{name}: expected a NumPy array, CuPy array or torch tensor, got {type(x).__name__}"
        )
    if k == "torch_cpu":
        raise TypeError(
            f"{name}: torch CPU tensors are not accepted; pass a CUDA tensor or "
            f"a NumPy array (tensor.numpy()), got a tensor on {x.device}"
        )
    return k


def check_array(
    x,
    name: str,
    *,
    dtypes: Iterable[str] | None = None,
    ndim: int | None = None,
    shape: Sequence | None = None,
    contiguous: bool = False,
) -> None:
    """Validate one array. ``shape`` entries may be ``None`` (any size)."""
    check_array_like(x, name)
    if dtypes is not None:
        dtypes = tuple(dtypes)
        got = arrays.dtype_name(x)
        if got not in dtypes:
            raise TypeError(f"{name}: expected dtype in {list(dtypes)}, got {got}")
    s = arrays.shape(x)
    if ndim is not None and len(s) != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got {len(s)} (shape {s})")
    if shape is not None:
        if len(s) != len(shape) or any(e is not None and e != g for e, g in zip(shape, s)):
            want = tuple("*" if e is None else e for e in shape)
            raise ValueError(f"{name}: expected shape {want}, got {s}")
    if contiguous and not arrays.is_contiguous(x):
        raise ValueError(f"{name}: expected a C-contiguous array, got strides of a non-contiguous view")


def check_aligned16(x, name: str) -> None:
    """``x``'s data must start on a 16-byte boundary, for kernels that access it only in 16-byte
    pieces (a paged cache's rows and bulk copies, the RHT's rows): a misaligned address would stop
    them with a fault that leaves the CUDA context unusable. Every allocation is aligned; a
    contiguous view that begins mid-row need not be. (The attention kernels' ``q`` and ``out`` have
    element-wise paths and are not checked; the write copies such key / value rows, ``cuda.cache``.)"""
    off = arrays.data_address(x) % 16
    if off:
        raise ValueError(f"{name}: its data must start on a 16-byte boundary (the kernels access it "
                         f"in 16-byte vectors or bulk copies); this array starts {off} bytes past one, "
                         f"e.g. a view that begins mid-row: pass a copy")


def check_last_dim_in(x, name: str, sizes: Sequence[int]) -> None:
    s = np.shape(x) if isinstance(x, np.ndarray) else arrays.shape(x)
    if len(s) < 1 or s[-1] not in tuple(sizes):
        got = s[-1] if len(s) else "a 0-d array"
        raise ValueError(f"{name}: head size (last dim) must be one of {list(sizes)}, got {got}")


def check_same_backend(named: dict) -> str:
    """All arrays are NumPy, or all are on one GPU. Returns "numpy" or "cuda"."""
    kinds = {n: check_array_like(a, n) for n, a in named.items() if a is not None}
    host = [n for n, k in kinds.items() if k == "numpy"]
    dev = [n for n, k in kinds.items() if k in ("cupy", "torch")]
    if host and dev:
        raise TypeError(
            f"arrays must all be NumPy (reference) or all on the GPU (kernels): "
            f"{host} are NumPy but {dev} are GPU arrays"
        )
    if dev:
        devices = {n: arrays.device_id(named[n]) for n in dev}
        if len(set(devices.values())) > 1:
            raise ValueError(f"arrays must be on one GPU, got devices {devices}")
        return "cuda"
    return "numpy"


def check_index_range(x, name: str, lo: int, hi: int, allow_negative_one: bool = False) -> None:
    """All entries in ``[lo, hi)`` (or ``-1``/negative when allowed, meaning skip)."""
    h = arrays.to_host(x)
    if h.size == 0:
        return
    vals = h[h >= 0] if allow_negative_one else h
    bad = (vals < lo) | (vals >= hi)
    if np.any(bad):
        v = vals[bad][0]
        rng = f"[{lo}, {hi})" + (" or negative (skip)" if allow_negative_one else "")
        raise ValueError(f"{name}: entries must be in {rng}, got {int(v)} (first offender)")

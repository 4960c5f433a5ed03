"""Launch helper: pointers, explicitly typed scalars, the caller's stream, outputs of the caller's kind.

CuPy's ``RawKernel`` checks nothing: a Python ``int`` becomes a ``long long``
and array views are ignored. So every argument goes through :func:`arg`
(pointer as ``uint64``, ``np.int32``/``np.int64``/``np.float32`` scalars), and
ops validate contiguity before launching.
"""
from __future__ import annotations

import contextlib

import numpy as np

from .. import arrays


def ptr(x) -> np.uint64:
    """Device pointer of a CuPy array or torch CUDA tensor."""
    k = arrays.kind(x)
    if k == "cupy":
        return np.uint64(x.data.ptr)
    if k == "torch":
        return np.uint64(x.data_ptr())
    raise TypeError(f"expected a CuPy array or torch CUDA tensor, got {type(x).__name__}")


def i32(v) -> np.int32:
    v = int(v)
    if not -(2**31) <= v < 2**31:
        raise OverflowError(f"{v} does not fit int32")
    return np.int32(v)


def i64(v) -> np.int64:
    return np.int64(int(v))


def f32(v) -> np.float32:
    return np.float32(v)


@contextlib.contextmanager
def stream_of(x):
    """Run launches on the stream the caller's framework is using (torch's current stream for tensors)."""
    import cupy

    k = arrays.kind(x)
    dev = arrays.device_id(x)
    with cupy.cuda.Device(dev):
        if k == "torch":
            import torch

            s = torch.cuda.current_stream(x.device)
            with cupy.cuda.ExternalStream(s.cuda_stream, dev):
                yield
        else:
            yield


def empty(like, shape, dtype_name: str):
    """Uninitialized array of the same kind and device as ``like``."""
    k = arrays.kind(like)
    if k == "torch":
        import torch

        return torch.empty(shape, dtype=getattr(torch, dtype_name), device=like.device)
    import cupy

    if dtype_name == "bfloat16":
        raise TypeError("CuPy has no bfloat16 dtype; use torch tensors for bf16")
    with cupy.cuda.Device(arrays.device_id(like)):
        return cupy.empty(shape, dtype=dtype_name)


def launch(kernel, grid, block, args, shared_mem: int = 0):
    """Launch ``kernel`` with already-typed ``args`` (see :func:`ptr`, :func:`i32`, :func:`f32`)."""
    for a in args:
        if not isinstance(a, (np.generic,)):
            raise TypeError(f"kernel argument {a!r}: pass typed NumPy scalars or ptr(array)")
    kernel(tuple(int(g) for g in grid), tuple(int(b) for b in block), tuple(args),
           shared_mem=int(shared_mem))

"""Launch helper: pointers, explicitly typed scalars, the caller's stream, outputs of the caller's kind.

CuPy's ``RawKernel`` checks nothing: a Python ``int`` becomes a ``long long``
and array views are ignored. So every argument goes through :func:`arg`
(pointer as ``uint64``, ``np.int32``/``np.int64``/``np.float32`` scalars), and
ops validate contiguity before launching.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools

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

            ptr = torch.cuda.current_stream(x.device).cuda_stream
            ext = _EXTERNAL_STREAMS.get((ptr, dev))
            if ext is None:   # one CuPy handle per torch stream (creating one costs µs per launch)
                if len(_EXTERNAL_STREAMS) > 64:
                    _EXTERNAL_STREAMS.clear()
                ext = _EXTERNAL_STREAMS[(ptr, dev)] = cupy.cuda.ExternalStream(ptr, dev)
            with ext:
                yield
        else:
            yield


#: (torch stream handle, device) -> the CuPy ExternalStream that wraps it (stream_of)
_EXTERNAL_STREAMS: dict = {}


def stream_ptr(x) -> int:
    """The handle of the stream :func:`stream_of` ``(x)`` launches on (torch's current stream
    for tensors, CuPy's current stream of ``x``'s device otherwise)."""
    import cupy

    dev = arrays.device_id(x)
    if arrays.kind(x) == "torch":
        import torch

        return int(torch.cuda.current_stream(x.device).cuda_stream)
    with cupy.cuda.Device(dev):
        return int(cupy.cuda.get_current_stream().ptr)


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


def _check_args(args):
    for a in args:
        if not isinstance(a, (np.generic,)):
            raise TypeError(f"kernel argument {a!r}: pass typed NumPy scalars or ptr(array)")


def launch(kernel, grid, block, args, shared_mem: int = 0):
    """Launch ``kernel`` with already-typed ``args`` (see :func:`ptr`, :func:`i32`, :func:`f32`)."""
    _check_args(args)
    kernel(tuple(int(g) for g in grid), tuple(int(b) for b in block), tuple(args),
           shared_mem=int(shared_mem))


# ---- programmatic dependent launch (sm_90): cuLaunchKernelEx through the driver API, because
# CuPy's launches take no launch attributes. The two structs mirror cuda.h (CUDA 12 and 13):
# CUlaunchAttribute = {CUlaunchAttributeID id; 4 bytes padding; 64-byte value union} and
# CUlaunchConfig = {grid x/y/z, block x/y/z, sharedMemBytes, hStream, attrs, numAttrs}; a CPU
# test pins the sizes and offsets (72 and 56 bytes; hStream, attrs, numAttrs at 32, 40, 48).
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class _LaunchAttribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int64 * 8)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


@functools.cache
def _cu_launch_kernel_ex():
    lib = ctypes.CDLL("libcuda.so.1")
    fn = lib.cuLaunchKernelEx
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                   ctypes.c_void_p]
    return fn


def launch_dependent(kernel, grid, block, args, shared_mem: int = 0):
    """:func:`launch` as a *programmatic dependent* of the previous kernel of the stream
    (``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION``): the kernel may start once every
    CTA of that kernel has executed ``griddepcontrol.launch_dependents`` (or exited), and must
    itself execute ``griddepcontrol.wait`` before it reads anything that kernel writes. sm_90+.
    Raises ``RuntimeError`` with the driver's ``CUresult`` if the launch fails."""
    import cupy

    _check_args(args)
    # every argument's bytes in an 8-byte slot of one buffer, and the array of pointers to the
    # slots (the driver copies the values at the launch); one buffer, not one per argument,
    # saves ~20 µs of host time per launch
    if any(a.nbytes > 8 for a in args):
        raise TypeError("kernel arguments of launch_dependent: scalars of at most 8 bytes")
    blob = b"".join(a.tobytes().ljust(8, b"\0") for a in args) or b"\0" * 8
    buf = ctypes.create_string_buffer(blob, len(blob))
    base = ctypes.addressof(buf)
    params = (ctypes.c_void_p * max(len(args), 1))(*range(base, base + 8 * max(len(args), 1), 8))
    attr = _LaunchAttribute()
    attr.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value[0] = 1   # programmaticStreamSerializationAllowed (the union's first int)
    g = tuple(int(x) for x in grid) + (1,) * (3 - len(grid))
    b = tuple(int(x) for x in block) + (1,) * (3 - len(block))
    cfg = _LaunchConfig(g[0], g[1], g[2], b[0], b[1], b[2], int(shared_mem),
                        ctypes.c_void_p(cupy.cuda.get_current_stream().ptr), ctypes.pointer(attr), 1)
    func = getattr(kernel, "kernel", kernel)   # cupy.RawKernel -> its cupy.cuda.Function
    rc = _cu_launch_kernel_ex()(ctypes.byref(cfg), ctypes.c_void_p(func.ptr), params, None)
    if rc != 0:
        raise RuntimeError(f"cuLaunchKernelEx failed: CUresult {rc}")

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
    """Device pointer of a CuPy array or torch CUDA tensor (``arrays.data_address``, device kinds only)."""
    if arrays.kind(x) in ("cupy", "torch"):
        return np.uint64(arrays.data_address(x))
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
            ptr = stream_ptr(x)
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

    if arrays.kind(x) == "torch":
        import torch

        # the raw handle, as triton's launcher asks for it (no torch.cuda.Stream object built;
        # measured in docs/perf-notes.md "Session 23"), where this torch has it
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        if raw is not None:
            return int(raw(x.device.index))
        return int(torch.cuda.current_stream(x.device).cuda_stream)
    dev = arrays.device_id(x)
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
    launch_ex(kernel, grid, block, args, shared_mem, dependent=True)


def launch_ex(kernel, grid, block, args, shared_mem: int = 0, dependent: bool = False):
    """Launch through the driver's ``cuLaunchKernelEx`` on CuPy's current stream: ``args`` are
    typed NumPy scalars of at most 8 bytes (:func:`ptr`, :func:`i32`, …) or ``bytes`` for a
    by-value struct parameter (e.g. a ``CUtensorMap``, :func:`encode_tensor_map_2d`);
    ``dependent``: a programmatic dependent launch (:func:`launch_dependent`). Raises
    ``RuntimeError`` with the driver's ``CUresult`` if the launch fails."""
    import cupy

    for a in args:
        if not (isinstance(a, bytes) or (isinstance(a, np.generic) and a.nbytes <= 8)):
            raise TypeError(f"kernel argument {a!r}: typed NumPy scalars of at most 8 bytes, or bytes")
    # every argument's bytes at its own offset of one buffer (8-byte slots; a struct at a 64-byte
    # boundary), and the array of pointers to them: the driver copies the values at the launch.
    # One buffer, not one per argument, saves ~20 µs of host time per launch.
    offs, blob = [], bytearray()
    for a in args:
        raw = a if isinstance(a, bytes) else a.tobytes()
        align = 64 if isinstance(a, bytes) else 8
        blob += b"\0" * (-len(blob) % align)
        offs.append(len(blob))
        blob += raw
    blob += b"\0" * (-len(blob) % 8) if blob else b"\0" * 8
    buf = ctypes.create_string_buffer(bytes(blob), len(blob))
    base = ctypes.addressof(buf)
    params = (ctypes.c_void_p * max(len(offs), 1))(*[base + o for o in offs])
    attr = _LaunchAttribute()
    attr.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value[0] = 1   # programmaticStreamSerializationAllowed (the union's first int)
    g = tuple(int(x) for x in grid) + (1,) * (3 - len(grid))
    b = tuple(int(x) for x in block) + (1,) * (3 - len(block))
    cfg = _LaunchConfig(g[0], g[1], g[2], b[0], b[1], b[2], int(shared_mem),
                        ctypes.c_void_p(cupy.cuda.get_current_stream().ptr),
                        ctypes.pointer(attr) if dependent else None, 1 if dependent else 0)
    func = getattr(kernel, "kernel", kernel)   # cupy.RawKernel -> its cupy.cuda.Function
    rc = _cu_launch_kernel_ex()(ctypes.byref(cfg), ctypes.c_void_p(func.ptr), params, None)
    if rc != 0:
        raise RuntimeError(f"cuLaunchKernelEx failed: CUresult {rc}")


# cuda.h's CUtensorMapDataType values of the unsigned integer element types
_TMAP_DTYPES = {1: 0, 2: 1, 4: 2, 8: 4}


@functools.cache
def _cu_tensor_map_encode_tiled():
    lib = ctypes.CDLL("libcuda.so.1")
    fn = lib.cuTensorMapEncodeTiled
    fn.restype = ctypes.c_int
    u32p, u64p = ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint64)
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p, u64p, u32p, u32p,
                   ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    return fn


def encode_tensor_map_2d(address: int, elem_bytes: int, cols: int, rows: int, row_stride: int,
                         box_cols: int, box_rows: int, l2_promotion: int = 3) -> bytes:
    """The 128 bytes of a ``CUtensorMap`` (``cuTensorMapEncodeTiled``) for a 2-D row-major tensor of
    unsigned ``elem_bytes``-byte elements at device ``address``: ``rows`` rows of ``cols`` elements,
    ``row_stride`` bytes apart; boxes of ``box_rows × box_cols`` elements, no interleave, no swizzle
    (a box lands in shared memory as dense rows of ``box_cols · elem_bytes`` bytes), out-of-bounds
    elements zero-filled; ``l2_promotion`` cuda.h's ``CUtensorMapL2promotion`` (3: 256 B). The
    driver's limits apply (address 16-byte aligned, ``row_stride`` a multiple of 16, box sides ≤
    256, a box row a multiple of 16 bytes); it refuses others with ``CUDA_ERROR_INVALID_VALUE``,
    raised here as ``ValueError``. The copies add one rule the encoder does not check: a box must
    start at a 16-byte aligned column (on the H200 a box at a 264-byte column raised an illegal
    instruction; ``kvlab.cuda.ring_probe.group_starts``)."""
    if elem_bytes not in _TMAP_DTYPES:
        raise ValueError(f"elem_bytes: one of {sorted(_TMAP_DTYPES)}, got {elem_bytes}")
    store = ctypes.create_string_buffer(128 + 64)
    at = -(-ctypes.addressof(store) // 64) * 64   # the map must be 64-byte aligned
    dims = (ctypes.c_uint64 * 2)(int(cols), int(rows))
    strides = (ctypes.c_uint64 * 1)(int(row_stride))
    box = (ctypes.c_uint32 * 2)(int(box_cols), int(box_rows))
    estr = (ctypes.c_uint32 * 2)(1, 1)
    rc = _cu_tensor_map_encode_tiled()(ctypes.c_void_p(at), _TMAP_DTYPES[elem_bytes], 2,
                                       ctypes.c_void_p(int(address)), dims, strides, box, estr, 0, 0,
                                       int(l2_promotion), 0)
    if rc != 0:
        raise ValueError(f"cuTensorMapEncodeTiled refused the map (CUresult {rc}): {cols} x {rows} "
                         f"elements of {elem_bytes} B, row stride {row_stride} B, box {box_cols} x {box_rows}")
    return ctypes.string_at(at, 128)


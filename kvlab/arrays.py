"""Which kind of array is this? NumPy, CuPy or a PyTorch tensor — one vocabulary.

The backend follows the arrays (SPEC 2.5, 3): NumPy arrays run the reference,
CuPy arrays and PyTorch CUDA tensors run the kernels. This module names dtypes
uniformly ("bfloat16", "float16", "float32", "uint8", "int32", …) so the
validation code in :mod:`kvlab.checks` is written once for all three.
"""
from __future__ import annotations

import sys

import ml_dtypes
import numpy as np

NUMPY_BF16 = np.dtype(ml_dtypes.bfloat16)
NUMPY_E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
#: largest finite bfloat16 (0x7F7F)
BF16_MAX = float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)


def _is_torch(x) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _is_cupy(x) -> bool:
    cupy = sys.modules.get("cupy")
    return cupy is not None and isinstance(x, cupy.ndarray)


#: kind of each Python type seen so far (``kind`` runs ~100 times per attention call, so its
#: answer is looked up by type instead of asked again; a torch tensor's device is still read
#: per call)
_TYPE_KINDS: dict = {}


def _type_kind(x) -> str:
    if isinstance(x, np.ndarray):
        return "numpy"
    if _is_cupy(x):
        return "cupy"
    if _is_torch(x):
        return "torch"
    return "other"


def kind(x) -> str:
    """``"numpy"``, ``"cupy"``, ``"torch"`` (CUDA tensor), ``"torch_cpu"`` or ``"other"``."""
    t = type(x)
    k = _TYPE_KINDS.get(t)
    if k is None:
        k = _type_kind(x)
        if k != "other":   # arbitrary objects are not remembered (the table stays small)
            _TYPE_KINDS[t] = k
    if k == "torch":
        return "torch" if x.is_cuda else "torch_cpu"
    return k


def dtype_name(x) -> str:
    """Uniform dtype name of a NumPy/CuPy array or torch tensor."""
    k = kind(x)
    if k in ("torch", "torch_cpu"):
        return str(x.dtype).replace("torch.", "").replace("float8_e4m3fn", "float8_e4m3fn")
    dt = np.dtype(x.dtype)
    if dt == NUMPY_BF16:
        return "bfloat16"
    if dt == NUMPY_E4M3:
        return "float8_e4m3fn"
    return dt.name


def shape(x) -> tuple:
    return tuple(int(s) for s in x.shape)


def is_contiguous(x) -> bool:
    k = kind(x)
    if k in ("torch", "torch_cpu"):
        return bool(x.is_contiguous())
    return bool(x.flags.c_contiguous)


def data_address(x) -> int:
    """Address of the first element (device address for CuPy / torch CUDA, host address for NumPy
    and torch CPU): what a kernel's vector loads need aligned."""
    k = kind(x)
    if k == "cupy":
        return int(x.data.ptr)
    if k in ("torch", "torch_cpu"):
        return int(x.data_ptr())
    return int(np.asarray(x).__array_interface__["data"][0])


def device_id(x):
    """GPU ordinal for CuPy/torch CUDA arrays, ``None`` for host arrays."""
    k = kind(x)
    if k == "cupy":
        return int(x.device.id)
    if k == "torch":
        return int(x.device.index)
    return None


def to_host(x) -> np.ndarray:
    """Copy small index arrays (slot_mapping, block_table, …) to the host for validation."""
    k = kind(x)
    if k == "numpy":
        return x
    if k == "cupy":
        return x.get()
    if k in ("torch", "torch_cpu"):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def to_host_many(*xs) -> list:
    """:func:`to_host` of several GPU arrays of one kind and dtype with **one** device-to-host
    copy (a device-side concatenation first): each copy synchronizes with the device and costs
    tens of microseconds, which matters for per-call validation. Falls back to one copy each
    when the arrays differ in kind or dtype, or are on the host already."""
    kinds = {kind(x) for x in xs}
    dts = {dtype_name(x) for x in xs}
    if len(xs) < 2 or len(kinds) != 1 or len(dts) != 1 or kinds & {"numpy", "other", "torch_cpu"}:
        return [to_host(x) for x in xs]
    k = kinds.pop()
    if k == "cupy":
        import cupy

        with cupy.cuda.Device(device_id(xs[0])):
            flat = cupy.concatenate([x.ravel() for x in xs]).get()
    else:
        import torch

        flat = torch.cat([x.detach().reshape(-1) for x in xs]).cpu().numpy()
    out, o = [], 0
    for x in xs:
        n = int(np.prod(shape(x), dtype=np.int64))
        out.append(flat[o:o + n].reshape(shape(x)))
        o += n
    return out

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


def kind(x) -> str:
    """``"numpy"``, ``"cupy"``, ``"torch"`` (CUDA tensor), ``"torch_cpu"`` or ``"other"``."""
    if isinstance(x, np.ndarray):
        return "numpy"
    if _is_cupy(x):
        return "cupy"
    if _is_torch(x):
        return "torch" if x.is_cuda else "torch_cpu"
    return "other"


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

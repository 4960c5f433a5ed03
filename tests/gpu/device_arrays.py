"""NumPy ↔ GPU arrays for the GPU tests (bf16 goes through torch: CuPy has no bf16 dtype)."""
from __future__ import annotations

import numpy as np

from kvlab.arrays import NUMPY_BF16

try:
    import torch
except ImportError:  # pragma: no cover - the GPU machines have torch
    torch = None

NP_DTYPES = {"bfloat16": NUMPY_BF16, "float16": np.dtype(np.float16), "float32": np.dtype(np.float32)}


def to_dev(a: np.ndarray, kind: str = "torch"):
    """A NumPy array on the GPU as a torch CUDA tensor (``kind="torch"``) or a CuPy array."""
    if kind == "torch":
        if a.dtype == NUMPY_BF16:
            return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16).cuda()
        return torch.from_numpy(np.ascontiguousarray(a)).cuda()
    import cupy

    return cupy.asarray(a)


def to_host(x) -> np.ndarray:
    """A torch CUDA tensor or CuPy array back as NumPy (bf16 as ml_dtypes bfloat16)."""
    if isinstance(x, np.ndarray):
        return x
    if torch is not None and isinstance(x, torch.Tensor):
        if x.dtype == torch.bfloat16:
            return x.view(torch.int16).cpu().numpy().view(NUMPY_BF16)
        return x.cpu().numpy()
    import cupy

    return cupy.asnumpy(x)


def off_boundary(x, off: int = 2):
    """A C-contiguous copy of ``x`` (torch CUDA, CuPy or NumPy) whose data starts ``off`` bytes past
    a 16-byte boundary — a view into a larger buffer, as a caller's slice of a flat tensor can be
    (the input checks and copies for the kernels' 16-byte accesses)."""
    if isinstance(x, np.ndarray):   # host buffers need not start on a 16-byte boundary themselves
        buf = np.empty(x.nbytes + 32, np.uint8)
        start = (-buf.ctypes.data) % 16 + off
        v = buf[start:start + x.nbytes].view(x.dtype).reshape(x.shape)
        v[...] = x
        assert v.flags.c_contiguous and v.ctypes.data % 16 == off
        return v
    if torch is not None and isinstance(x, torch.Tensor):
        n = x.numel() * x.element_size()
        buf = torch.empty(n + 32, device=x.device, dtype=torch.uint8)
        v = buf[off:off + n].view(x.dtype).view(x.shape)
        v.copy_(x)
        assert v.is_contiguous()
        addr = v.data_ptr()
    else:
        import cupy

        buf = cupy.empty(x.nbytes + 32, dtype=cupy.uint8)
        v = buf[off:off + x.nbytes].view(x.dtype).reshape(x.shape)
        v[...] = x
        assert v.flags.c_contiguous
        addr = v.data.ptr
    assert addr % 16 == off
    return v

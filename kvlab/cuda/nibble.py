"""GPU nibble pack/unpack (``kernels_cu/nibble.cu``). Reference: :mod:`kvlab.reference.nibble`."""
from __future__ import annotations

from .. import arrays, checks
from . import launch as L
from .loader import KernelSpec, get_kernel, register

VEC = 4
THREADS = 256

SPECS = register("nibble", [
    KernelSpec("nibble", "pack_nibbles", (VEC,)),
    KernelSpec("nibble", "unpack_nibbles", (VEC,)),
])


def pack_nibbles(codes):
    """uint8 codes ``(..., n)`` (values 0…15, n even; contiguous) → uint8 ``(..., n/2)``, same kind.

    Codes above 15 are masked to their low nibble (validation of the range would cost a
    pass over the data; the reference rejects them).
    """
    checks.check_array(codes, "codes", dtypes=("uint8",), contiguous=True)
    s = arrays.shape(codes)
    if len(s) < 1 or s[-1] % 2:
        raise ValueError(f"codes: expected an even last dimension, got shape {s}")
    out = L.empty(codes, s[:-1] + (s[-1] // 2,), "uint8")
    n = 1
    for v in s:
        n *= v
    n //= 2
    if n:
        with L.stream_of(codes):
            k = get_kernel(SPECS[0], arrays.device_id(codes))
            grid = (-(-n // (THREADS * VEC)),)
            L.launch(k, grid, (THREADS,), (L.ptr(codes), L.ptr(out), L.i64(n)))
    return out


def unpack_nibbles(packed):
    """uint8 ``(..., m)`` → uint8 codes ``(..., 2m)`` (low nibble first), same kind."""
    checks.check_array(packed, "packed", dtypes=("uint8",), contiguous=True)
    s = arrays.shape(packed)
    if len(s) < 1:
        raise ValueError(f"packed: expected at least 1 dimension, got shape {s}")
    out = L.empty(packed, s[:-1] + (2 * s[-1],), "uint8")
    n = 1
    for v in s:
        n *= v
    if n:
        with L.stream_of(packed):
            k = get_kernel(SPECS[1], arrays.device_id(packed))
            grid = (-(-n // (THREADS * VEC)),)
            L.launch(k, grid, (THREADS,), (L.ptr(packed), L.ptr(out), L.i64(n)))
    return out

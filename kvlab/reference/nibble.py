"""Nibble packing: two 4-bit codes per byte. Reference for ``kernels_cu/nibble.cu``.

Element ``2i`` goes in the low nibble of byte ``i``, element ``2i+1`` in the
high nibble (SPEC 2.1 step 5, and E2M1 in 2.3).
"""
from __future__ import annotations

import numpy as np

from .. import checks

__all__ = ["pack_nibbles", "unpack_nibbles"]


def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """Pack 4-bit codes ``(..., n)`` (integers in [0, 15], n even) into uint8 ``(..., n/2)``."""
    codes = np.asarray(codes)
    if not np.issubdtype(codes.dtype, np.integer):
        raise TypeError(f"codes: expected an integer dtype, got {codes.dtype}")
    if codes.ndim < 1 or codes.shape[-1] % 2:
        raise ValueError(f"codes: expected an even last dimension, got shape {codes.shape}")
    if codes.size and (codes.min() < 0 or codes.max() > 15):
        raise ValueError(
            f"codes: expected values in [0, 15], got range [{codes.min()}, {codes.max()}]"
        )
    c = codes.astype(np.uint8)
    return (c[..., 0::2] | (c[..., 1::2] << 4)).astype(np.uint8)


def unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    """Unpack uint8 ``(..., m)`` into 4-bit codes uint8 ``(..., 2m)`` (low nibble first)."""
    packed = np.asarray(packed)
    checks.check_array(packed, "packed", dtypes=("uint8",))
    if packed.ndim < 1:
        raise ValueError(f"packed: expected at least 1 dimension, got shape {packed.shape}")
    out = np.empty(packed.shape[:-1] + (2 * packed.shape[-1],), dtype=np.uint8)
    out[..., 0::2] = packed & 0x0F
    out[..., 1::2] = packed >> 4
    return out

"""Reference (NumPy) paged-cache operations: write, read back. Mirrors ``kernels_cu/reshape_and_cache.cu`` and ``kernels_cu/dequantize_cache.cu``."""
from __future__ import annotations

import numpy as np

from .. import validate


def reshape_and_cache(key, value, kv_cache, slot_mapping, kv_cache_dtype="auto",
                      k_scale=1.0, v_scale=1.0) -> None:
    """Quantize ``key``/``value`` and write them into ``kv_cache`` at ``slot_mapping`` (in place).

    key, value: ``(num_tokens, num_kv_heads, head_size)``, bf16/fp16/float32 (NumPy, ml_dtypes bf16).
    kv_cache: ``(num_blocks, 2, block_size, num_kv_heads, row)``, C-contiguous, uint8 (or the
    key dtype for ``auto``). slot_mapping: int64/int32 ``(num_tokens,)``, ``slot = block ·
    block_size + offset``; negative entries are skipped. Duplicate slots: the last token wins.
    """
    fmt, dims, backend, ks, vs = validate.check_reshape_and_cache(
        key, value, kv_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale
    )
    if backend != "numpy":
        raise TypeError("kvlab.reference.reshape_and_cache takes NumPy arrays; use kvlab.reshape_and_cache")
    slots = np.asarray(slot_mapping).astype(np.int64)
    keep = np.nonzero(slots >= 0)[0]
    if keep.size == 0:
        return
    # last writer wins for duplicate slots: keep only each slot's last occurrence
    _, last = np.unique(slots[keep][::-1], return_index=True)
    keep = keep[::-1][last]
    blocks, offsets = slots[keep] // dims.block_size, slots[keep] % dims.block_size
    for side, x, gs in ((0, key, ks), (1, value, vs)):
        rows = fmt.quantize_rows(np.asarray(x)[keep], global_scale=gs)
        if fmt.stores_model_dtype:
            rows = rows.astype(kv_cache.dtype)
        fmt.scatter_rows(kv_cache, side, blocks, offsets, rows)


def dequantize_cache_float64(kv_cache, kv_cache_dtype="auto", k_scale=1.0, v_scale=1.0):
    """As :func:`dequantize_cache` but float64, for references and tests."""
    fmt = validate.get_format(kv_cache_dtype)
    dims = validate.check_kv_cache(kv_cache, fmt)
    ks = validate.check_global_scale(k_scale, "k_scale")
    vs = validate.check_global_scale(v_scale, "v_scale")
    rows = fmt.gather_rows(np.asarray(kv_cache))
    k = fmt.dequantize_rows(rows[:, 0], dims.head_size, global_scale=ks)
    v = fmt.dequantize_rows(rows[:, 1], dims.head_size, global_scale=vs)
    return k, v


def dequantize_cache(kv_cache, kv_cache_dtype="auto", k_scale=1.0, v_scale=1.0):
    """Whole cache → dense ``(k, v)``, each float32 ``(num_blocks, block_size, num_kv_heads, head_size)``."""
    k, v = dequantize_cache_float64(kv_cache, kv_cache_dtype, k_scale, v_scale)
    return k.astype(np.float32), v.astype(np.float32)

"""The public entry points (SPEC 2.5). The backend follows the arrays.

NumPy arrays run the reference (:mod:`kvlab.reference`); CuPy arrays and
PyTorch CUDA tensors run the kernels (:mod:`kvlab.cuda`) and come back as the
same kind. Arguments are validated before any work (:mod:`kvlab.validate`).
"""
from __future__ import annotations

import numpy as np

from . import arrays, checks
from .formats import get_format
from .reference import attention as _ref_attention
from .reference import cache as _ref_cache


def allocate_cache(kv_cache_dtype, num_blocks, block_size, num_kv_heads, head_size, like=None,
                   dtype=None):
    """A zero-filled cache of ``fmt.cache_shape(...)``.

    like: a NumPy array, CuPy array or torch CUDA tensor; the cache is allocated
    with the same library on the same device (NumPy when ``None``). For ``auto``
    the cache dtype is ``dtype`` or ``like``'s dtype (bf16 by default); otherwise uint8.
    """
    fmt = get_format(kv_cache_dtype)
    shape = fmt.cache_shape(num_blocks, block_size, num_kv_heads, head_size)
    k = "numpy" if like is None else checks.check_array_like(like, "like")
    if fmt.stores_model_dtype:
        name = dtype or (arrays.dtype_name(like) if like is not None else "bfloat16")
        checks.check_choice(name, "dtype", checks.FLOAT_DTYPES)
    else:
        if dtype is not None and dtype != "uint8":
            raise ValueError(f"dtype: {fmt.name} caches are uint8, got {dtype!r}")
        name = "uint8"
    if k == "numpy":
        np_dt = arrays.NUMPY_BF16 if name == "bfloat16" else np.dtype(name)
        return np.zeros(shape, dtype=np_dt)
    if k == "cupy":
        import cupy as cp
        with cp.cuda.Device(arrays.device_id(like)):
            if name == "bfloat16":  # CuPy has no bf16 dtype: allocate 16-bit storage
                raise TypeError("like: CuPy has no bfloat16 dtype; pass a torch tensor or dtype='float16'")
            return cp.zeros(shape, dtype=name)
    import torch
    return torch.zeros(shape, dtype=getattr(torch, name), device=like.device)


def reshape_and_cache(key, value, kv_cache, slot_mapping, kv_cache_dtype="auto", k_scale=1.0,
                      v_scale=1.0):
    """Quantize ``key``/``value`` ``(num_tokens, num_kv_heads, head_size)`` into ``kv_cache`` in place.

    ``slot_mapping`` int64 ``(num_tokens,)``: ``block · block_size + offset``, negative = skip.
    ``k_scale``/``v_scale``: nvfp4's global (dequantization) scales; ignored by other formats.
    """
    backend = checks.check_same_backend(
        {"key": key, "value": value, "kv_cache": kv_cache, "slot_mapping": slot_mapping}
    )
    if backend == "numpy":
        return _ref_cache.reshape_and_cache(key, value, kv_cache, slot_mapping, kv_cache_dtype,
                                            k_scale, v_scale)
    from .cuda import cache as _cuda_cache
    return _cuda_cache.reshape_and_cache(key, value, kv_cache, slot_mapping, kv_cache_dtype,
                                         k_scale, v_scale)


def dequantize_cache(kv_cache, kv_cache_dtype="auto", k_scale=1.0, v_scale=1.0):
    """Whole cache → ``(k, v)``, each float32 ``(num_blocks, block_size, num_kv_heads, head_size)``."""
    backend = checks.check_same_backend({"kv_cache": kv_cache})
    if backend == "numpy":
        return _ref_cache.dequantize_cache(kv_cache, kv_cache_dtype, k_scale, v_scale)
    from .cuda import cache as _cuda_cache
    return _cuda_cache.dequantize_cache(kv_cache, kv_cache_dtype, k_scale, v_scale)


def paged_attention(q, kv_cache, block_table, seq_lens, query_start_loc, kv_cache_dtype="auto",
                    softmax_scale=None, k_scale=1.0, v_scale=1.0, sliding_window=None):
    """Paged attention (SPEC 2.4) → ``(num_tokens, num_q_heads, head_size)`` in q's dtype."""
    backend = checks.check_same_backend(
        {"q": q, "kv_cache": kv_cache, "block_table": block_table, "seq_lens": seq_lens,
         "query_start_loc": query_start_loc}
    )
    if backend == "numpy":
        return _ref_attention.paged_attention(q, kv_cache, block_table, seq_lens, query_start_loc,
                                              kv_cache_dtype, softmax_scale, k_scale, v_scale,
                                              sliding_window)
    from .cuda import attention as _cuda_attention
    return _cuda_attention.paged_attention(q, kv_cache, block_table, seq_lens, query_start_loc,
                                           kv_cache_dtype, softmax_scale, k_scale, v_scale,
                                           sliding_window)

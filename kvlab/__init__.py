"""kvlab — low-bit KV-cache quantization: exact formats, CUDA kernels, and a lab on real data.

Public surface (SPEC 2.5)::

    fmt = kvlab.get_format("int4_per_token_head")
    kv_cache = kvlab.allocate_cache("nvfp4", num_blocks, block_size, num_kv_heads, head_size, like=key)
    kvlab.reshape_and_cache(key, value, kv_cache, slot_mapping, kv_cache_dtype="nvfp4")
    out = kvlab.paged_attention(q, kv_cache, block_table, seq_lens, query_start_loc, kv_cache_dtype="nvfp4")
    k, v = kvlab.dequantize_cache(kv_cache, kv_cache_dtype="nvfp4")

NumPy arrays run the reference; CuPy arrays and torch CUDA tensors run the kernels.
"""
from .api import allocate_cache, dequantize_cache, paged_attention, reshape_and_cache
from .formats import FORMAT_NAMES, CacheFormat, calibrate_global_scale, get_format

__version__ = "0.1.0"

__all__ = [
    "get_format", "CacheFormat", "FORMAT_NAMES", "calibrate_global_scale",
    "allocate_cache", "reshape_and_cache", "dequantize_cache", "paged_attention",
]

"""``auto`` — the model dtype (bf16, fp16 or float32) copied into the paged layout.

Cache shape ``(num_blocks, 2, block_size, num_kv_heads, head_size)`` in the
dtype of the keys; no quantization. The baseline every format is measured against.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .base import SIDES, CacheFormat


@dataclass(frozen=True)
class Auto(CacheFormat):
    name: str = "auto"
    description: str = "model dtype (bf16/fp16/fp32), no quantization"
    supported_head_sizes: tuple = (16, 32, 64, 128, 256, 512)
    stores_model_dtype: bool = True

    def row_bytes(self, head_size, itemsize: int = 2):
        return head_size * itemsize

    def row_elements(self, head_size):
        return head_size

    def data_bytes(self, head_size, itemsize: int = 2):
        return head_size * itemsize

    def head_size_from_cache(self, cache):
        return int(cache.shape[-1])

    def quantize_rows(self, x, global_scale: float = 1.0):
        """Identity (the rows are the model-dtype vectors)."""
        return np.asarray(x)

    def dequantize_rows(self, rows, head_size, global_scale: float = 1.0):
        return np.asarray(rows).astype(np.float64)

    def split_views(self, cache, side):
        return cache[:, SIDES[side]], None


AUTO = Auto()

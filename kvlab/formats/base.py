"""What every cache format knows: its row layout, its cache shape, and how to read and write rows.

A *row* is the bytes of one (token, KV head) vector in a given format. For all
formats but ``nvfp4`` the row is stored contiguously at
``cache[block, side, offset, head, :]``. ``nvfp4`` stores its rows split into
a data part and a scale part of each ``(block, side)`` slab (SPEC 2.3); its
*logical* row is ``data ‖ scales`` and :meth:`CacheFormat.gather_rows` /
:meth:`CacheFormat.scatter_rows` translate.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass

import numpy as np

from .. import arrays, checks

SIDES = {"k": 0, "v": 1}

#: NaN/Inf rule, the same in the reference and the kernels: a (token, head) vector with any
#: non-finite element is stored as the format's *invalid row* — every code 0 and a NaN scale
#: (int4: scale word 0x7FC00000; int8/fp8: float32 NaN; nvfp4: every E4M3 scale byte 0x7F) —
#: so it dequantizes to all-NaN: the error stays visible and confined to that row. ``auto``
#: stores values as given. Attention outputs that attend to such a row are NaN; rows outside a
#: query's causal/sliding window never affect it.
NAN_SCALE_WORD = 0x7FC00000


def nonfinite_rows(x) -> np.ndarray:
    """Boolean ``(...)``: which head vectors ``(..., d)`` hold a NaN or ±Inf."""
    x = np.asarray(x)
    with np.errstate(invalid="ignore"):
        return ~np.isfinite(x.astype(np.float32)).all(axis=-1)


@dataclass(frozen=True)
class CacheFormat(abc.ABC):
    """A KV-cache format (abstract). Each subclass in kvlab/formats/ defines its row layout and
    its codec — the NumPy reference of the format."""

    name: str
    #: short description for tables
    description: str = ""

    # ---- layout -----------------------------------------------------------------
    supported_head_sizes: tuple = (16, 32, 64, 128, 256, 512)
    #: True when the cache stores the model dtype (``auto``), False for uint8 caches
    stores_model_dtype: bool = False

    def check_head_size(self, head_size, name: str = "head_size") -> int:
        checks.check_int(head_size, name)
        if head_size not in self.supported_head_sizes:
            raise ValueError(
                f"{name}: {self.name} supports head sizes {list(self.supported_head_sizes)}, "
                f"got {head_size}"
            )
        return int(head_size)

    @abc.abstractmethod
    def row_bytes(self, head_size: int) -> int:
        """Bytes of one (token, head) row: the last dimension of the uint8 cache."""
        raise NotImplementedError

    def row_elements(self, head_size: int) -> int:
        """Size of the cache's last dimension in elements of the cache dtype."""
        return self.row_bytes(head_size)

    def bits_per_element(self, head_size: int, model_itemsize: int = 2) -> float:
        """Storage bits per head-vector element, scales and zero points included."""
        if self.stores_model_dtype:
            return 8.0 * model_itemsize
        return 8.0 * self.row_bytes(head_size) / head_size

    def cache_shape(self, num_blocks, block_size, num_kv_heads, head_size) -> tuple:
        """``(num_blocks, 2, block_size, num_kv_heads, last)`` as in SPEC 2."""
        num_blocks = checks.check_int(num_blocks, "num_blocks", lo=1)
        block_size = checks.check_int(block_size, "block_size", lo=1)
        num_kv_heads = checks.check_int(num_kv_heads, "num_kv_heads", lo=1)
        head_size = self.check_head_size(head_size)
        self.check_block_size(block_size, head_size)
        return (num_blocks, 2, block_size, num_kv_heads, self.row_elements(head_size))

    def check_block_size(self, block_size: int, head_size: int) -> None:
        """Format-specific block-size rule; the row formats have none (nvfp4 overrides this)."""

    def head_size_from_cache(self, cache) -> int:
        """Recover the head size from a cache's last dimension."""
        last = arrays.shape(cache)[-1]
        for d in self.supported_head_sizes:
            if self.row_elements(d) == last:
                return d
        raise ValueError(
            f"kv_cache: last dimension {last} matches no {self.name} head size "
            f"(row sizes {[self.row_elements(d) for d in self.supported_head_sizes]})"
        )

    # ---- codec (reference) --------------------------------------------------------
    def _head_vectors(self, x):
        """``x`` ``(..., d)`` → ``(rows (n, d), lead shape, d, non-finite mask (n,))`` for a codec."""
        x = np.asarray(x)
        d = x.shape[-1] if x.ndim else 0
        self.check_head_size(d, "x.shape[-1]")
        rows = x.reshape(-1, d)
        return rows, x.shape[:-1], d, nonfinite_rows(rows)

    @abc.abstractmethod
    def quantize_rows(self, x: np.ndarray, global_scale: float = 1.0) -> np.ndarray:
        """Head vectors ``(..., d)`` → rows uint8 ``(..., row_bytes)`` (logical layout)."""
        raise NotImplementedError

    @abc.abstractmethod
    def dequantize_rows(self, rows: np.ndarray, head_size: int, global_scale: float = 1.0) -> np.ndarray:
        """Rows ``(..., row_bytes)`` → float64 head vectors ``(..., d)``."""
        raise NotImplementedError

    # ---- data / scale views -------------------------------------------------------
    @abc.abstractmethod
    def data_bytes(self, head_size: int) -> int:
        """Bytes of the code part of a row."""
        raise NotImplementedError

    def scale_bytes(self, head_size: int) -> int:
        return self.row_bytes(head_size) - self.data_bytes(head_size)

    @abc.abstractmethod
    def split_views(self, cache: np.ndarray, side: str):
        """``(data, scales)`` views of one side (``"k"`` or ``"v"``) of a NumPy uint8 cache.

        data: uint8 ``(num_blocks, block_size, num_kv_heads, data_bytes)``;
        scales: per format (float32 ``(num_blocks, block_size, num_kv_heads)`` for the
        per-token-head formats, uint8 E4M3 codes ``(…, d/16)`` for nvfp4).
        """
        raise NotImplementedError

    # ---- physical <-> logical rows -------------------------------------------------
    def gather_rows(self, cache: np.ndarray) -> np.ndarray:
        """Logical rows of a NumPy cache, ``(num_blocks, 2, block_size, num_kv_heads, row_bytes)``."""
        return cache

    def scatter_rows(self, cache: np.ndarray, side: int, blocks, offsets, rows: np.ndarray) -> None:
        """Write logical rows ``(n, num_kv_heads, row_bytes)`` at (block, offset) of ``side``."""
        cache[blocks, side, offsets] = rows

"""``int4_per_token_head`` — 4-bit asymmetric codes after an RHT, zero point hidden in the scale.

SPEC 2.1 (vLLM #40835 compatible). Row of ``d/2 + 4`` bytes::

    bytes [0, d/2)      packed codes, element 2i in the low nibble of byte i
    bytes [d/2, d/2+4)  scale word, little-endian uint32:
                        bits(float32 scale) with its 4 low mantissa bits = zp

Write path per head vector ``x`` (float32 arithmetic where noted):

1. ``y = H · (s ⊙ x)`` in float64, rounded to the input dtype (bf16/fp16;
   float32 stays float32) — what vLLM does before quantizing.
2. ``scale = max((mx − mn) / 15, 1e-6)`` in float32.
   (saturated to the dtype's finite range: see :func:`round_to_input_dtype`).
3. ``zp = clamp(round_half_away(−mn / scale), 0, 15)`` (float32 division).
4. ``q = clamp(round_half_away(y · (1/scale) + zp), 0, 15)`` — the product and
   the sum each rounded to float32 (no fused multiply-add; the kernels use
   ``__fmul_rn``/``__fadd_rn`` to match).
5. pack, 6. ``word = (bits(scale) & ~0xF) | zp``.

Read path: ``y = (q − zp) · float(word & ~0xF)``, ``x = s ⊙ (H · y) / d``.
Note the *stored* scale lost its 4 low mantissa bits (a relative change below
2^-19), while the codes were computed with the full scale.

Non-finite input: the invalid row of ``formats/base.py`` (codes 0, scale word
0x7FC00000 → dequantizes to NaN).

Degenerate vectors: all-zero → scale 1e-6, zp 0, codes 0 (exact). A constant
vector is rotated to a spike, which quantizes like any other vector.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import arrays
from ..reference.hadamard import SUPPORTED_HEAD_SIZES, inverse_rht, rht
from ..reference.nibble import pack_nibbles, unpack_nibbles
from ..reference.rounding import round_half_away
from .base import NAN_SCALE_WORD, CacheFormat

SCALE_FLOOR = np.float32(1e-6)


def round_to_input_dtype(y64: np.ndarray, dtype) -> np.ndarray:
    """The rotated vector rounded as vLLM stores it: to bf16/fp16, else float32. Returns float32.

    Saturating: values beyond the dtype's finite range become ± its max (vLLM would store
    ±inf and produce a NaN scale; kvlab defines the result instead). The RHT grows the
    largest element by up to ``d``, so fp16 inputs above ``65504 / d`` can reach this.
    """
    dt = np.dtype(dtype)
    if dt not in (arrays.NUMPY_BF16, np.dtype(np.float16)):
        dt = np.dtype(np.float32)
    big = float(np.finfo(dt).max) if dt != arrays.NUMPY_BF16 else float(arrays.BF16_MAX)
    return np.clip(y64, -big, big).astype(dt).astype(np.float32)


def int4_qparams(y: np.ndarray):
    """Scale (float32) and zero point (uint8) of rotated vectors ``y`` float32 ``(..., d)``."""
    y = np.asarray(y, dtype=np.float32)
    mn = y.min(axis=-1)
    mx = y.max(axis=-1)
    with np.errstate(over="ignore"):
        rng = (mx - mn).astype(np.float32)  # can overflow to inf only for |y| near float32 max
    rng = np.minimum(rng, np.float32(np.finfo(np.float32).max))
    scale = np.maximum(rng / np.float32(15.0), SCALE_FLOOR).astype(np.float32)
    zp = np.clip(round_half_away((-mn / scale).astype(np.float32)), 0, 15).astype(np.uint8)
    return scale, zp


def int4_codes(y: np.ndarray, scale: np.ndarray, zp: np.ndarray) -> np.ndarray:
    """4-bit codes uint8 ``(..., d)`` of ``y`` float32 with per-vector ``scale``/``zp``."""
    inv = (np.float32(1.0) / scale).astype(np.float32)[..., None]
    v = (y.astype(np.float32) * inv).astype(np.float32)
    v = (v + zp.astype(np.float32)[..., None]).astype(np.float32)
    return np.clip(round_half_away(v), 0, 15).astype(np.uint8)


def scale_word(scale: np.ndarray, zp: np.ndarray) -> np.ndarray:
    """uint32 word: float32 bits of ``scale`` with the 4 low mantissa bits replaced by ``zp``."""
    bits = np.asarray(scale, dtype=np.float32).view(np.uint32)
    return ((bits & np.uint32(0xFFFFFFF0)) | zp.astype(np.uint32)).astype(np.uint32)


def split_scale_word(word: np.ndarray):
    """uint32 word → (stored scale float32, zp uint8)."""
    word = np.asarray(word, dtype=np.uint32)
    zp = (word & np.uint32(0xF)).astype(np.uint8)
    scale = (word & np.uint32(0xFFFFFFF0)).view(np.float32)
    return scale, zp


@dataclass(frozen=True)
class Int4PerTokenHead(CacheFormat):
    name: str = "int4_per_token_head"
    description: str = "4-bit asymmetric per (token, head), RHT, zero point in the scale word"
    supported_head_sizes: tuple = SUPPORTED_HEAD_SIZES

    def row_bytes(self, head_size):
        return head_size // 2 + 4

    def data_bytes(self, head_size):
        return head_size // 2

    def rotate(self, x: np.ndarray, signs=None) -> np.ndarray:
        """Step 1: the rotated vector as stored, float32 ``(..., d)``."""
        x = np.asarray(x)
        return round_to_input_dtype(rht(x, signs), x.dtype)

    def quantize_rows(self, x, global_scale: float = 1.0, signs=None):
        x, lead, d, bad = self._head_vectors(x)  # (n, d) rows; reshaped back to lead at the end
        with np.errstate(invalid="ignore", over="ignore"):
            y = self.rotate(np.where(bad[..., None], 0, x).astype(x.dtype), signs)
        scale, zp = int4_qparams(y)
        q = int4_codes(y, scale, zp)
        q[bad] = 0
        word = scale_word(scale, zp)
        word[bad] = NAN_SCALE_WORD              # the invalid row (NaN/Inf rule, formats/base.py)
        rows = np.empty(x.shape[:-1] + (self.row_bytes(d),), dtype=np.uint8)
        rows[..., : d // 2] = pack_nibbles(q)
        rows[..., d // 2 :] = word.astype("<u4")[..., None].view(np.uint8)
        return rows.reshape(lead + rows.shape[-1:])

    def dequantize_rotated(self, rows, head_size: int) -> np.ndarray:
        """Rows → the rotated-domain values ``y`` (float64), no inverse RHT."""
        rows = np.asarray(rows, dtype=np.uint8)
        d = head_size
        q = unpack_nibbles(np.ascontiguousarray(rows[..., : d // 2])).astype(np.float64)
        word = np.ascontiguousarray(rows[..., d // 2 : d // 2 + 4]).view("<u4")[..., 0]
        scale, zp = split_scale_word(word)
        return (q - zp[..., None].astype(np.float64)) * scale[..., None].astype(np.float64)

    def dequantize_rows(self, rows, head_size, global_scale: float = 1.0, signs=None):
        return inverse_rht(self.dequantize_rotated(rows, head_size), signs)

    def split_views(self, cache, side):
        from .base import SIDES
        d = self.head_size_from_cache(cache)
        s = cache[:, SIDES[side]]
        # row_bytes = d/2 + 4 is a multiple of 4, so the scale words are a real uint32 view
        words = np.ascontiguousarray(cache).view("<u4")[:, SIDES[side]]
        return s[..., : d // 2], words[..., d // 8]


INT4_PER_TOKEN_HEAD = Int4PerTokenHead()

"""``int8_per_token_head`` and ``fp8_per_token_head`` — symmetric 8-bit codes, one float32 scale per (token, head).

SPEC 2.2 (vLLM #38378 compatible). Row of ``d + 4`` bytes: ``d`` code bytes
(int8 two's complement, or E4M3), then the float32 scale, little-endian.

All arithmetic in float32, as the kernels do:
``scale = max(absmax(x) / QMAX, 1e-6)``, ``v = x · (1/scale)``;
int8 (QMAX 127): ``code = clamp(round_half_away(v), −128, 127)``;
fp8 (QMAX 448): ``code = e4m3_rne(clamp(v, −448, 448))``.
Dequant: ``code · scale``. No rotation. Non-finite input: the invalid row of
``formats/base.py`` (codes 0, NaN scale).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..reference.fp_codecs import e4m3_decode, e4m3_encode
from ..reference.rounding import round_half_away
from .base import SIDES, CacheFormat

SCALE_FLOOR = np.float32(1e-6)


def symmetric_scale(x: np.ndarray, qmax: float) -> np.ndarray:
    """float32 per-vector scale ``max(absmax / qmax, 1e-6)`` of ``x`` ``(..., d)``."""
    amax = np.abs(np.asarray(x, dtype=np.float32)).max(axis=-1)
    return np.maximum(amax / np.float32(qmax), SCALE_FLOOR).astype(np.float32)


@dataclass(frozen=True)
class PerTokenHead8(CacheFormat):
    name: str = "int8_per_token_head"
    description: str = "8-bit symmetric per (token, head), float32 scale"
    #: "int8" or "fp8"
    code: str = "int8"

    @property
    def qmax(self) -> float:
        return 127.0 if self.code == "int8" else 448.0

    def row_bytes(self, head_size):
        return head_size + 4

    def data_bytes(self, head_size):
        return head_size

    def codes(self, x: np.ndarray, scale: np.ndarray) -> np.ndarray:
        """Code bytes uint8 ``(..., d)`` of ``x`` given per-vector float32 ``scale``."""
        inv = (np.float32(1.0) / scale).astype(np.float32)[..., None]
        v = (np.asarray(x, dtype=np.float32) * inv).astype(np.float32)
        if self.code == "int8":
            return np.clip(round_half_away(v), -128, 127).astype(np.int8).view(np.uint8)
        return e4m3_encode(np.clip(v, -448.0, 448.0))

    def decode(self, codes: np.ndarray) -> np.ndarray:
        codes = np.asarray(codes, dtype=np.uint8)
        if self.code == "int8":
            return codes.view(np.int8).astype(np.float64)
        return e4m3_decode(codes)

    def quantize_rows(self, x, global_scale: float = 1.0):
        x, lead, d, bad = self._head_vectors(x)  # (n, d) rows; reshaped back to lead at the end
        x = np.where(bad[..., None], 0, x.astype(np.float32))
        scale = symmetric_scale(x, self.qmax)
        codes = self.codes(x, scale)
        codes[bad] = 0
        scale[bad] = np.float32(np.nan)         # the invalid row (NaN/Inf rule, formats/base.py)
        rows = np.empty(x.shape[:-1] + (d + 4,), dtype=np.uint8)
        rows[..., :d] = codes
        rows[..., d:] = scale.astype("<f4")[..., None].view(np.uint8)
        return rows.reshape(lead + rows.shape[-1:])

    def dequantize_rows(self, rows, head_size, global_scale: float = 1.0):
        rows = np.asarray(rows, dtype=np.uint8)
        d = head_size
        scale = np.ascontiguousarray(rows[..., d : d + 4]).view("<f4")[..., 0]
        return self.decode(rows[..., :d]) * scale[..., None].astype(np.float64)

    def split_views(self, cache, side):
        d = self.head_size_from_cache(cache)
        s = cache[:, SIDES[side]]
        scales = np.ascontiguousarray(cache).view("<f4")[:, SIDES[side]][..., d // 4]
        data = s[..., :d].view(np.int8) if self.code == "int8" else s[..., :d]
        return data, scales


INT8_PER_TOKEN_HEAD = PerTokenHead8()
FP8_PER_TOKEN_HEAD = PerTokenHead8(
    name="fp8_per_token_head",
    description="FP8 E4M3 symmetric per (token, head), float32 scale",
    code="fp8",
)

"""E2M1 (FP4) and E4M3 (FP8) encode/decode. Reference for ``kernels_cu/fp_codecs.cuh``.

Both use round-to-nearest-even (through ``ml_dtypes``) and *saturate*: the
formats clamp to the largest finite value (±6 for E2M1, ±448 for E4M3) before
rounding, since ``ml_dtypes``' E4M3 maps out-of-range values to NaN.

Codes:

* E2M1 — a 4-bit code, sign in bit 3, magnitudes ``{0, .5, 1, 1.5, 2, 3, 4, 6}``
  for codes 0…7. Negative values that round to zero keep their sign (code 8,
  −0), like the hardware ``cvt.rn.satfinite.e2m1x2.f32``.
* E4M3 (``float8_e4m3fn``) — 1 sign, 4 exponent (bias 7), 3 mantissa bits; no
  infinities; ``0x7F``/``0xFF`` are NaN; max 448; subnormals down to 2^-9.

NaN rule: a NaN input encodes to E4M3 NaN (``0x7F``) and to E2M1 code 8 (−0);
E2M1 has no NaN. (The quantizers in this package define what happens to NaN
in a head vector; see :mod:`kvlab.reference.nvfp4`.)
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

__all__ = [
    "E2M1_MAX", "E4M3_MAX", "E2M1_VALUES",
    "e2m1_encode", "e2m1_decode", "e4m3_encode", "e4m3_decode", "e4m3_round",
]

E2M1_MAX = 6.0
E4M3_MAX = 448.0
#: value of each E2M1 code 0…15
E2M1_VALUES = np.array(
    [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float64
)


def e2m1_encode(x) -> np.ndarray:
    """Real values → E2M1 codes (uint8 in [0, 15]), RNE, saturating to ±6."""
    x = np.asarray(x, dtype=np.float64)
    # float64 → float32 first is exact for every tie point of E2M1; clamp, then RNE.
    xc = np.clip(x, -E2M1_MAX, E2M1_MAX).astype(np.float32)
    return xc.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & np.uint8(0x0F)


def e2m1_decode(codes) -> np.ndarray:
    """E2M1 codes (uint8 in [0, 15]) → float64 values."""
    codes = np.asarray(codes)
    return E2M1_VALUES[codes.astype(np.intp) & 0x0F]


def e4m3_encode(x) -> np.ndarray:
    """Real values → E4M3 bytes (uint8), RNE with saturation to ±448 (NaN stays NaN)."""
    x = np.asarray(x, dtype=np.float64)
    xc = np.clip(x, -E4M3_MAX, E4M3_MAX)  # NaN passes through clip unchanged
    # The format quantizers pass float32 values here (as the kernels compute in
    # float32), so the only rounding is the one to E4M3.
    return xc.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def e4m3_decode(codes) -> np.ndarray:
    """E4M3 bytes (uint8) → float64 values."""
    codes = np.asarray(codes, dtype=np.uint8)
    return codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64)


def e4m3_round(x) -> np.ndarray:
    """Round to the nearest E4M3 value (saturating): ``decode(encode(x))``, float64."""
    return e4m3_decode(e4m3_encode(x))

// kvlab — software E2M1 (FP4) and E4M3 (FP8) codecs, shared by the write and read kernels.
// Reference: kvlab/reference/fp_codecs.py (ml_dtypes, RNE, saturating).
//
// Software on purpose: sm_80/sm_90 have no FP4 conversion instructions, and the
// rules here (saturation, NaN codes, sign of values rounding to zero) are the
// format's, not whatever a hardware cvt does. All are a handful of integer /
// compare instructions, cheap next to the memory traffic they sit in.
//
// Codes:
//   E2M1: 4-bit, sign in bit 3, magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6} for codes 0..7.
//         RNE, saturating to ±6; a negative value rounding to zero keeps its sign
//         (code 8); NaN -> code 8 (E2M1 has no NaN).
//   E4M3 (float8_e4m3fn): 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities;
//         0x7F/0xFF NaN; max 448; subnormals m·2^-9. RNE, saturating to ±448; NaN -> 0x7F.
//
// Note: CuPy compiles with -ftz=true, so float32 *denormal* inputs read as ±0 here;
// both codecs' smallest nonzero magnitudes (0.25 / 2^-10 rounding points) are far above
// the float32 denormal range, so no code changes because of it.
#pragma once
#include "common.cuh"

namespace kvlab {

// ---------------------------------------------------------------- E2M1
// float -> 4-bit code. The seven rounding points between neighbouring magnitudes are
// 0.25 0.75 1.25 1.75 2.5 3.5 5; at an exact tie RNE picks the even code, which is the
// lower neighbour at 0.25, 1.25, 2.5, 5 (strict >) and the upper one at 0.75, 1.75, 3.5 (>=).
__device__ __forceinline__ uint32_t e2m1_encode(float x) {
  const uint32_t bits = __float_as_uint(x);
  const uint32_t sign = (bits >> 28) & 0x8u;
  const float a = __uint_as_float(bits & 0x7FFFFFFFu);
  if (!(a == a)) return 0x8u;  // NaN -> -0 (E2M1 has no NaN)
  uint32_t m = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) +
               (a >= 3.5f) + (a > 5.0f);  // saturates at code 7 (6.0) for a > 5, +inf included
  return sign | m;
}

// 4-bit code (low 4 bits of `code`) -> float. Exponent field e = bits 1..2, mantissa bit 0:
// e == 0: 0 or 0.5 (subnormal); else (1 + m/2)·2^(e-1).
__device__ __forceinline__ float e2m1_decode(uint32_t code) {
  const uint32_t c = code & 0x7u;
  const uint32_t e = c >> 1, m = c & 1u;
  uint32_t mag = e ? (((e + 126u) << 23) | (m << 22)) : (m ? 0x3F000000u /*0.5f*/ : 0u);
  return __uint_as_float(mag | ((code & 0x8u) << 28));
}

// ---------------------------------------------------------------- E4M3
// float -> E4M3 byte (float8_e4m3fn), RNE with saturation to ±448, NaN -> 0x7F.
__device__ __forceinline__ uint32_t e4m3_encode(float x) {
  const uint32_t bits = __float_as_uint(x);
  const uint32_t sign = (bits >> 24) & 0x80u;
  float a = __uint_as_float(bits & 0x7FFFFFFFu);
  if (!(a == a)) return 0x7Fu;
  a = fminf(a, 448.0f);  // saturate (448 = 0x7E is the largest finite E4M3)
  uint32_t code;
  if (a < 0.015625f) {
    // below the smallest normal 2^-6: multiples of 2^-9. a·512 is exact (power of two), and
    // rounding it to an integer with RNE is the E4M3 rounding; 8 lands on 0x08 = 2^-6, correct.
    code = static_cast<uint32_t>(__float2int_rn(a * 512.0f));
  } else {
    // normal: round the 23-bit float32 mantissa to 3 bits (RNE), carry may bump the exponent;
    // float exponent E (bias 127) -> E4M3 exponent E - 120.
    const uint32_t b = __float_as_uint(a);
    const uint32_t r = b + 0x7FFFFu + ((b >> 20) & 1u);
    code = (r >> 20) - (120u << 3);
  }
  return sign | code;
}

// E4M3 byte (low 8 bits) -> float; 0x7F/0xFF -> NaN.
__device__ __forceinline__ float e4m3_decode(uint32_t byte) {
  const uint32_t b = byte & 0xFFu;
  const uint32_t e = (b >> 3) & 0xFu, m = b & 0x7u;
  float v;
  if (e == 0) {
    v = static_cast<float>(m) * 0.001953125f;  // m·2^-9, exact
  } else if (e == 15 && m == 7) {
    v = __uint_as_float(0x7FC00000u);
  } else {
    v = __uint_as_float(((e + 120u) << 23) | (m << 20));
  }
  return (b & 0x80u) ? -v : v;
}

}  // namespace kvlab

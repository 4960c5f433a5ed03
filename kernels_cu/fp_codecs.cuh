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
// Magnitude code (0..7) of a >= 0 (not NaN; +inf saturates), RNE, saturating to 6.
// E2M1 is a float with 1 mantissa bit, exponent bias 1 and subnormal step 0.5, so within the
// binade of max(a, 1) = 2^e (e = 0, 1, 2) the grid step is 2^(e-1). Adding C = 2^(22+e), whose
// float32 ulp is exactly that step, rounds a to the grid with RNE in one add; the low bits of
// the sum are k = rounded / step, and the code is k + 2e (e = 0: k = rint(2a) in 0..4 is the
// code itself, 4 meaning 2.0). Ties go to even k, which is E2M1's even mantissa.
__device__ __forceinline__ uint32_t e2m1_encode_abs(float a) {
  a = fminf(a, 6.0f);
  const uint32_t eb = __float_as_uint(fmaxf(a, 1.0f)) & 0x7F800000u;  // 2^e as float bits
  const float c = __uint_as_float(eb + (22u << 23));                    // 2^(22+e)
  const uint32_t k = __float_as_uint(__fadd_rn(a, c)) & 0x7u;
  return k + (eb >> 22) - 254u;                                          // + 2e
}

// float -> 4-bit code: sign in bit 3 (a negative value rounding to zero keeps it: code 8),
// NaN -> code 8 (E2M1 has no NaN).
__device__ __forceinline__ uint32_t e2m1_encode(float x) {
  const uint32_t bits = __float_as_uint(x);
  const float a = __uint_as_float(bits & 0x7FFFFFFFu);
  if (!(a == a)) return 0x8u;
  return ((bits >> 28) & 0x8u) | e2m1_encode_abs(a);
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

// Two E4M3 bytes (lo in bits 0-7, hi in bits 8-15), RNE with saturation to ±448, for finite
// inputs (NaN inputs: the hardware path gives an E4M3 NaN whose sign may differ from 0x7F;
// callers never store codes of NaN inputs). On sm_89+ one cvt.rn.satfinite.e4m3x2.f32 —
// the same rounding and saturation as the software codec (tests/gpu compare both with the
// reference); on sm_80 the software codec.
__device__ __forceinline__ uint32_t e4m3x2_encode(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  unsigned short r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return static_cast<uint32_t>(r);
#else
  return e4m3_encode(lo) | (e4m3_encode(hi) << 8);
#endif
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

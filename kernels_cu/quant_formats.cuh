// kvlab — per-format encode/decode pieces of the cache formats (SPEC 2), shared by the
// write kernels (reshape_and_cache.cu), dequantize_cache.cu and the attention kernels.
// References: kvlab/formats/{int4_per_token_head,per_token_head,nvfp4,auto}.py.
//
// Rounding: where the reference rounds each step to float32, so do these functions
// (__fmul_rn / __fadd_rn / __fdiv_rn / __frcp_rn keep the compiler from fusing or
// approximating), so that codes match the reference bit for bit except where the *inputs*
// differ (the RHT's float32 summation order, see reshape_and_cache.cu).
#pragma once
#include "common.cuh"
#include "fp_codecs.cuh"

namespace kvlab {

// Format ids used as template parameters (kvlab/cuda/cache.py has the same table).
constexpr int FMT_AUTO = 0;
constexpr int FMT_INT8 = 1;  // int8_per_token_head
constexpr int FMT_FP8 = 2;   // fp8_per_token_head
constexpr int FMT_INT4 = 3;  // int4_per_token_head
constexpr int FMT_NVFP4 = 4; // nvfp4

constexpr float PER_TOKEN_HEAD_SCALE_FLOOR = 1e-6f;

// Bytes of one (token, head) row of a uint8 cache (the cache's last dimension).
template <int FMT> __host__ __device__ constexpr int row_bytes(int d) {
  return FMT == FMT_INT8 || FMT == FMT_FP8 ? d + 4
       : FMT == FMT_INT4                   ? d / 2 + 4
       : FMT == FMT_NVFP4                  ? d / 2 + d / 16
                                           : -1;  // auto: model dtype, not bytes
}

// NaN/Inf rule (kvlab/formats/base.py): a (token, head) vector with any non-finite element
// is stored as the format's invalid row — every code 0 and a NaN scale (int4 word 0x7FC00000,
// int8/fp8 float32 NaN, nvfp4 every E4M3 scale byte 0x7F) — so it dequantizes to all-NaN.
constexpr uint32_t INVALID_SCALE_BITS = 0x7FC00000u;
constexpr uint32_t NVFP4_INVALID_SCALE_BYTE = 0x7Fu;

// Whether any of this lane's elements is NaN or ±Inf, or-reduced over the LANES-lane group.
template <int LANES, int EPT>
__device__ __forceinline__ bool group_any_nonfinite(const float (&x)[EPT]) {
  bool bad = false;
#pragma unroll
  for (int j = 0; j < EPT; ++j) bad |= !isfinite(x[j]);
  unsigned b = bad ? 1u : 0u;
#pragma unroll
  for (int o = LANES / 2; o > 0; o >>= 1) b |= __shfl_xor_sync(0xffffffffu, b, o);
  return b != 0;
}

// max that propagates NaN (PTX max.NaN, sm_80+): an absmax taken with it is NaN when any
// element is NaN and +inf when any is ±inf, so "absmax is not finite" is the NaN/Inf rule's
// test for free (fmaxf would skip the NaN).
__device__ __forceinline__ float fmax_nan(float a, float b) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

// Round half away from zero (C roundf) — the rule int4/int8 codes use.
__device__ __forceinline__ float round_half_away(float v) { return roundf(v); }

// ================================================================ int4_per_token_head
// qparams of a rotated vector y with min mn, max mx (SPEC 2.1 steps 2-3):
//   scale = max((mx - mn) / 15, 1e-6), zp = clamp(round_half_away(-mn / scale), 0, 15).
struct Int4Params {
  float scale;      // full float32 scale (codes are computed with it)
  float inv_scale;  // float32(1 / scale)
  float zp;         // zero point as float (0..15)
  uint32_t word;    // stored scale word: (bits(scale) & ~0xF) | zp
};

// Correctly rounded x / d from r = RN(1/d) (see div_rn_by_recip below).
__device__ __forceinline__ float div_rn_by_recip(float x, float denom, float r);

// (mx - mn) / 15 as a Markstein correction with the constant RN(1/15) (div_rn_by_recip:
// correctly rounded for quotients in the normal range; a smaller one only meets max(·, 1e-6)).
__device__ __forceinline__ Int4Params int4_qparams(float mn, float mx) {
  Int4Params p;
  // mx - mn overflows float32 only for saturated bf16 extremes; the reference caps it too
  const float rng = fminf(__fsub_rn(mx, mn), 3.402823466e38f);
  p.scale = fmaxf(div_rn_by_recip(rng, 15.0f, 0.06666667014360428f /* RN(1/15) */), 1e-6f);
  p.inv_scale = __frcp_rn(p.scale);
  const float z = fminf(fmaxf(round_half_away(__fdiv_rn(-mn, p.scale)), 0.0f), 15.0f);
  p.zp = z;
  p.word = (__float_as_uint(p.scale) & 0xFFFFFFF0u) | static_cast<uint32_t>(z);
  return p;
}

// floor(v + 0.5) for 0 <= v < 2^21, as the bits of one float add, no float->int conversion
// (those run at 1/8 of the FP32 rate): the exact sum 2^22 + 0.5 + v rounded toward zero onto
// the 0.5-spaced grid of [2^22, 2^23) is 2^22 + m/2 with m = floor(2v + 1), whose float bits
// are 0x4A800000 + m; floor(v + 0.5) = m >> 1. This is round-half-away for v >= 0.
// Returns the float bits >> 1: the low bits are floor(v + 0.5), the high bits a constant
// (callers mask).
__device__ __forceinline__ uint32_t round_half_up_bits(float v) {
  return __float_as_uint(__fadd_rz(v, 4194304.5f)) >> 1;
}

// SPEC 2.1 step 4: q = clamp(round_half_away(y · inv_scale + zp), 0, 15), each step rounded
// to float32 (no FMA). Clamping first is equivalent (0 and 15 are integers, rounding is
// monotonic) and keeps the argument of the rounding in [0, 15].
__device__ __forceinline__ uint32_t int4_encode(float y, const Int4Params& p) {
  const float v = fminf(fmaxf(__fadd_rn(__fmul_rn(y, p.inv_scale), p.zp), 0.0f), 15.0f);
  return round_half_up_bits(v) & 0xFu;
}

// Read path: word -> (stored scale, zero point).
__device__ __forceinline__ void int4_split_word(uint32_t word, float& scale, float& zp) {
  scale = __uint_as_float(word & 0xFFFFFFF0u);
  zp = static_cast<float>(word & 0xFu);
}

// Rotated-domain value of one code: (q - zp) · scale (exact: 5-bit integer × 20-bit scale).
__device__ __forceinline__ float int4_decode(uint32_t q, float scale, float zp) {
  return __fmul_rn(static_cast<float>(q) - zp, scale);
}

// ================================================================ int8 / fp8 per_token_head
// scale = max(absmax / QMAX, 1e-6) (float32 division); QMAX 127 (int8) or 448 (fp8).
template <int FMT> __device__ __forceinline__ float per_token_head_scale(float absmax) {
  static_assert(FMT == FMT_INT8 || FMT == FMT_FP8, "int8/fp8 only");
  constexpr float qmax = FMT == FMT_INT8 ? 127.0f : 448.0f;
  return fmaxf(__fdiv_rn(absmax, qmax), PER_TOKEN_HEAD_SCALE_FLOOR);
}

// One code byte of x given inv_scale = float32(1 / scale).
// int8: clamp(round_half_away(v), -128, 127) = sign · floor(min(|v|, 128) + 0.5), capped at
// 127 for v >= 0 — computed without float->int conversions (round_half_up_bits).
// int8 code of v = x · (1/scale), as float bits whose low byte is the code (two's complement).
// Reference: clamp(round_half_away(v), -128, 127). The clamp never acts: scale >= absmax/127
// (rounded up to within 2^-24) and 1/scale is rounded to within 2^-24, so |v| <= 127·(1 + 3·2^-24)
// < 127.5 (and with the 1e-6 scale floor |v| = |x|·1e6 < 127); so only the rounding is done,
// exactly, with float adds (no float->int conversion, which runs at 1/8 of the FP32 rate):
//   u = RZ(v + copysign(0.5, v))            truncating keeps floor(|v| + 0.5) intact;
//   t = RZ(u + c2), c2 = copysign(2^23, u)  = ±(2^23 + trunc|u|)  (grid 1 above 2^23);
//   t + (1.5·2^23 - c2)                     = 1.5·2^23 + round_half_away(v), exact, whose
//                                             float bits hold the code in the low byte.
__device__ __forceinline__ uint32_t int8_code_bits(float v) {
  const uint32_t sgn = __float_as_uint(v) & 0x80000000u;
  const float u = __fadd_rz(v, __uint_as_float(sgn | 0x3F000000u));  // ± 0.5
  const float c2 = __uint_as_float(sgn | 0x4B000000u);                 // ± 2^23
  const float t = __fadd_rz(u, c2);
  return __float_as_uint(__fadd_rn(t, __fsub_rn(12582912.0f, c2)));
}

// One code byte of x given inv_scale = float32(1 / scale).
template <int FMT> __device__ __forceinline__ uint32_t per_token_head_encode(float x, float inv_scale) {
  const float v = __fmul_rn(x, inv_scale);
  if constexpr (FMT == FMT_INT8) {
    return int8_code_bits(v) & 0xFFu;
  } else {
    return e4m3_encode(fminf(fmaxf(v, -448.0f), 448.0f));
  }
}

// Four code bytes of x0..x3 (x0 in the low byte), packed with byte permutes. fp8 uses the
// paired E4M3 conversion (one hardware instruction per pair on sm_89+, see fp_codecs.cuh);
// saturation to ±448 is part of it.
template <int FMT>
__device__ __forceinline__ uint32_t per_token_head_encode4(float x0, float x1, float x2, float x3,
                                                           float inv_scale) {
  if constexpr (FMT == FMT_INT8) {
    const uint32_t b0 = int8_code_bits(__fmul_rn(x0, inv_scale));
    const uint32_t b1 = int8_code_bits(__fmul_rn(x1, inv_scale));
    const uint32_t b2 = int8_code_bits(__fmul_rn(x2, inv_scale));
    const uint32_t b3 = int8_code_bits(__fmul_rn(x3, inv_scale));
    return __byte_perm(__byte_perm(b0, b1, 0x0040), __byte_perm(b2, b3, 0x0040), 0x5410);
  } else {
    const uint32_t lo = e4m3x2_encode(__fmul_rn(x0, inv_scale), __fmul_rn(x1, inv_scale));
    const uint32_t hi = e4m3x2_encode(__fmul_rn(x2, inv_scale), __fmul_rn(x3, inv_scale));
    return __byte_perm(lo, hi, 0x5410);
  }
}

// Code byte -> value before the scale (int8: two's complement; fp8: E4M3).
template <int FMT> __device__ __forceinline__ float per_token_head_decode(uint32_t byte) {
  if constexpr (FMT == FMT_INT8) {
    return static_cast<float>(static_cast<int>(static_cast<int8_t>(byte & 0xFFu)));
  } else {
    return e4m3_decode(byte);
  }
}

// ================================================================ nvfp4
constexpr int NVFP4_GROUP = 16;

// E4M3 block-scale byte of a 16-element group: e4m3(amax / 6 / global_scale), two float32
// divisions as the reference does (the plain form; the write kernel uses the _fast variant).
__device__ __forceinline__ uint32_t nvfp4_scale_encode(float amax16, float global_scale) {
  return e4m3_encode(__fdiv_rn(__fdiv_rn(amax16, 6.0f), global_scale));
}

// Correctly rounded x / d from r = RN(1/d) (see div_rn_by_recip below).
__device__ __forceinline__ float div_rn_by_recip(float x, float denom, float r);

// The same scale byte with both divisions as Markstein corrections (3 FMA-pipe instructions
// each): RN(1/6) is a constant and RN(1/global_scale) is computed once per thread (inv_gs).
// For finite amax16 (NaN/Inf rows are replaced by the invalid row anyway). A quotient that
// overflows float32 is recomputed with the IEEE division (the correction step needs a finite
// q0); subnormal quotients flush to zero, as in the reference they round to E4M3 zero.
__device__ __forceinline__ uint32_t nvfp4_scale_encode_fast(float amax16, float global_scale,
                                                            float inv_gs) {
  const float q = div_rn_by_recip(amax16, 6.0f, 0.16666667163372040f /* RN(1/6) */);
  float s = global_scale == 1.0f ? q : div_rn_by_recip(q, global_scale, inv_gs);
  if (!(fabsf(s) <= 3.0e38f)) s = __fdiv_rn(q, global_scale);
  return e4m3x2_encode(s, 0.0f) & 0xFFu;
}

// Divisor of a group: float32(sf · global_scale); codes are e2m1(x / denom), 0 when sf == 0.
__device__ __forceinline__ float nvfp4_denom(uint32_t sf_byte, float global_scale) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  // hardware E4M3 -> f16 (exact: every E4M3 value is an fp16 value), then -> f32 (exact)
  unsigned int h2;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(static_cast<unsigned short>(sf_byte & 0xFFu)));
  const float sf = __half2float(__ushort_as_half(static_cast<unsigned short>(h2 & 0xFFFFu)));
#else
  const float sf = e4m3_decode(sf_byte);
#endif
  return global_scale == 1.0f ? sf : __fmul_rn(sf, global_scale);
}
// (the plain form of one code; the write kernel divides with div_rn_by_recip instead)
__device__ __forceinline__ uint32_t nvfp4_encode(float x, float denom) {
  return denom == 0.0f ? 0u : e2m1_encode(__fdiv_rn(x, denom));
}

// The same with the division done as Markstein's correction step from the correctly rounded
// reciprocal r = RN(1/denom) (computed once per 16-element group): q0 = RN(x·r) is within one
// ulp of x/denom, the remainder x - denom·q0 is exact in one FMA, and RN(q0 + rem·r) is the
// correctly rounded quotient RN(x/denom) (Markstein 1990; Muller et al., Handbook of
// Floating-Point Arithmetic, the theorem behind IA-64 division) — for quotients in the normal
// range, which holds here (|x/denom| is at most about 6·2^-9/2^-10 or flushes to a zero code).
// Three FMA-pipe instructions instead of a full IEEE division per element; the GPU tests
// compare every code with the reference's true division.
__device__ __forceinline__ float div_rn_by_recip(float x, float denom, float r) {
  const float q0 = __fmul_rn(x, r);
  const float rem = fmaf(-denom, q0, x);
  return fmaf(rem, r, q0);
}
// Division by a divisor with few significant bits (global scale 1.0: denom is an E4M3 value,
// <= 4 bits) in 2 FMA-pipe instructions. With r = RN(1/denom):
//   e = 1 - denom·r is exact in one FMA (|e| <= 2^-24 and denom·r is a multiple of 2^-27 for
//       a 4-bit denom, so e fits in float32), r_lo = RN(e·r); r + r_lo = 1/denom to ~2^-47;
//   q = FMA(a, r, RN(a·r_lo)) = a/denom within ~2^-46.6 relative, before its one rounding.
// A quotient a/denom that is not a float32 midpoint is at least 2^-29 (relative) away from
// every midpoint (a·2^k and denom have <= 24 and <= 4 significant bits, so a - M·denom is a
// multiple of a grid 2^-29·M fine), and it is never exactly a midpoint (M·denom would need
// > 24 bits) — so q = RN(a/denom), the reference's float32 division, whenever a·r_lo does
// not flush to zero (quotients above ~2^-90; smaller ones give E2M1 code 0 either way). Checked
// exhaustively against e2m1(RN(a/denom)) for every E4M3 denom and every finite bf16/fp16 a
// (tests/test_write_kernel_emulation.py). Not valid for a general divisor (global scale != 1): callers use
// div_rn_by_recip there.
__device__ __forceinline__ float nvfp4_recip_lo(float denom, float r) {
  return __fmul_rn(fmaf(-denom, r, 1.0f), r);
}
__device__ __forceinline__ float nvfp4_div_e4m3(float a, float r, float r_lo) {
  return fmaf(a, r, __fmul_rn(a, r_lo));
}

__device__ __forceinline__ uint32_t nvfp4_encode_fast(float x, float denom, float r) {
  return denom == 0.0f ? 0u : e2m1_encode(div_rn_by_recip(x, denom, r));
}

// Value of one element: e2m1 · sf · global_scale (e2m1 · sf is exact in float32).
__device__ __forceinline__ float nvfp4_decode(uint32_t code, float sf, float global_scale) {
  return __fmul_rn(__fmul_rn(e2m1_decode(code), sf), global_scale);
}

// Byte offsets inside one (block, side) slab of block_size · H · (d/2 + d/16) bytes,
// laid out [data (bs, H, d/2) | scales (bs, H, d/16)] (SPEC 2.3).
__device__ __forceinline__ long long nvfp4_data_offset(int t, int h, int H, int d) {
  return (static_cast<long long>(t) * H + h) * (d / 2);
}
// Scale g of token t, head h; with `swizzle` (V side, vLLM SM100 order) (t, g) is stored at
// t' = (t/4)·4 + g/(S/4), g' = (g % (S/4))·4 + t % 4, S = d/16.
__device__ __forceinline__ long long nvfp4_scale_offset(int t, int h, int g, int block_size, int H,
                                                        int d, bool swizzle) {
  const int S = d / NVFP4_GROUP;
  if (swizzle) {
    const int q = S / 4;
    const int tp = (t / 4) * 4 + g / q;
    const int gp = (g % q) * 4 + t % 4;
    t = tp;
    g = gp;
  }
  return static_cast<long long>(block_size) * H * (d / 2) + (static_cast<long long>(t) * H + h) * S + g;
}

// ================================================================ vector row I/O
// EPT consecutive elements of type T as float32 (16-byte loads where EPT·sizeof(T) allows;
// the pointer must be aligned to min(16, EPT·sizeof(T)) bytes).
template <typename T, int EPT>
__device__ __forceinline__ void load_elems(const T* __restrict__ p, float (&x)[EPT]) {
  constexpr int BYTES = EPT * static_cast<int>(sizeof(T));
  static_assert(BYTES % 4 == 0, "at least 4 bytes per lane");
  constexpr int CHUNK = BYTES >= 16 ? 16 : BYTES;  // bytes per load instruction
  constexpr int PER = CHUNK / static_cast<int>(sizeof(T));
#pragma unroll
  for (int c = 0; c < EPT / PER; ++c) {
    uint4 raw;  // CHUNK bytes used
    if constexpr (CHUNK == 16) raw = __ldg(reinterpret_cast<const uint4*>(p) + c);
    else if constexpr (CHUNK == 8) { uint2 r = __ldg(reinterpret_cast<const uint2*>(p) + c); raw.x = r.x; raw.y = r.y; }
    else raw.x = __ldg(reinterpret_cast<const unsigned int*>(p) + c);
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int j = 0; j < PER; ++j) x[c * PER + j] = to_float(e[j]);
  }
}

template <typename T, int EPT>
__device__ __forceinline__ void store_elems(T* __restrict__ p, const float (&x)[EPT]) {
  constexpr int BYTES = EPT * static_cast<int>(sizeof(T));
  constexpr int CHUNK = BYTES >= 16 ? 16 : BYTES;
  constexpr int PER = CHUNK / static_cast<int>(sizeof(T));
#pragma unroll
  for (int c = 0; c < EPT / PER; ++c) {
    uint4 raw;
    T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
    for (int j = 0; j < PER; ++j) e[j] = from_float<T>(x[c * PER + j]);
    if constexpr (CHUNK == 16) reinterpret_cast<uint4*>(p)[c] = raw;
    else if constexpr (CHUNK == 8) reinterpret_cast<uint2*>(p)[c] = make_uint2(raw.x, raw.y);
    else reinterpret_cast<uint32_t*>(p)[c] = raw.x;
  }
}

// Lane geometry of one head vector of D elements of T: 16 bytes per lane where possible,
// at most 32 lanes (then more elements per lane).
template <int D, typename T> struct RowGeometry {
  static constexpr int VEC = 16 / static_cast<int>(sizeof(T));   // elements per 16 bytes
  static constexpr int LANES = D / VEC < 32 ? (D / VEC < 1 ? 1 : D / VEC) : 32;
  static constexpr int EPT = D / LANES;                           // elements per lane
  static_assert(D >= 16 && D <= 512 && (D & (D - 1)) == 0, "head size: power of two in 16..512");
  static_assert(EPT * LANES == D, "lanes tile the row");
};

}  // namespace kvlab

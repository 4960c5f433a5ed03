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

__device__ __forceinline__ Int4Params int4_qparams(float mn, float mx) {
  Int4Params p;
  p.scale = fmaxf(__fdiv_rn(__fsub_rn(mx, mn), 15.0f), 1e-6f);
  p.inv_scale = __frcp_rn(p.scale);
  const float z = fminf(fmaxf(round_half_away(__fdiv_rn(-mn, p.scale)), 0.0f), 15.0f);
  p.zp = z;
  p.word = (__float_as_uint(p.scale) & 0xFFFFFFF0u) | static_cast<uint32_t>(z);
  return p;
}

// SPEC 2.1 step 4: q = clamp(round_half_away(y · inv_scale + zp), 0, 15), each step rounded
// to float32 (no FMA).
__device__ __forceinline__ uint32_t int4_encode(float y, const Int4Params& p) {
  const float v = __fadd_rn(__fmul_rn(y, p.inv_scale), p.zp);
  return static_cast<uint32_t>(fminf(fmaxf(round_half_away(v), 0.0f), 15.0f));
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
template <int FMT> __device__ __forceinline__ uint32_t per_token_head_encode(float x, float inv_scale) {
  const float v = __fmul_rn(x, inv_scale);
  if constexpr (FMT == FMT_INT8) {
    const int q = static_cast<int>(fminf(fmaxf(round_half_away(v), -128.0f), 127.0f));
    return static_cast<uint32_t>(q) & 0xFFu;
  } else {
    return e4m3_encode(fminf(fmaxf(v, -448.0f), 448.0f));
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
// divisions as the reference does.
__device__ __forceinline__ uint32_t nvfp4_scale_encode(float amax16, float global_scale) {
  return e4m3_encode(__fdiv_rn(__fdiv_rn(amax16, 6.0f), global_scale));
}

// Divisor of a group: float32(sf · global_scale); codes are e2m1(x / denom), 0 when sf == 0.
__device__ __forceinline__ float nvfp4_denom(uint32_t sf_byte, float global_scale) {
  return __fmul_rn(e4m3_decode(sf_byte), global_scale);
}
__device__ __forceinline__ uint32_t nvfp4_encode(float x, float denom) {
  return denom == 0.0f ? 0u : e2m1_encode(__fdiv_rn(x, denom));
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

// kvlab — Walsh–Hadamard transform and RHT of one head vector held by a group of lanes.
// Shared by kernels_cu/hadamard.cu (standalone op), kernels_cu/reshape_and_cache.cu
// (INT4 write, fused) and the attention kernels (query rotation, output inverse rotation).
// Reference: kvlab/reference/hadamard.py; SPEC 2.1.
//
// Data layout in registers: a vector of D elements is spread over LANES consecutive lanes
// (LANES a power of two <= 32, the group aligned to LANES inside the warp); lane l of the
// group holds the EPT = D / LANES consecutive elements [l·EPT, (l+1)·EPT). That is the
// layout a vectorized row load produces, so no shuffle is needed to load or store.
//
// Butterflies with stride h < EPT are in-register; stride EPT·2^k pairs lane l with lane
// l ^ 2^k (one __shfl_xor_sync per element). Computed in float32; the unnormalized H is used
// (H·H = D·I), as in the reference.
//
// Contract: every lane named in `mask` must call these functions (they shuffle); callers
// keep inactive lanes running on dummy data rather than returning early.
#pragma once
#include "common.cuh"

namespace kvlab {

// vLLM's RHT sign vector (SPEC 2.1), 512 signs as bits: bit i%32 of word i/32 is 1 when
// sign i is -1. Generated from kvlab.reference.hadamard.VLLM_SIGNS_512;
// tests/test_kernels_compile.py re-derives it from that string and compares with this table.
// Shorter head sizes use a prefix.
__constant__ uint32_t kRhtNegBits[16] = {
    0x9A8CA6F2u, 0x7F7FCA4Eu, 0x59BBC293u, 0x9480ABC7u, 0xB55B747Eu, 0x54503BBEu,
    0xCDF467B7u, 0x05DFBC5Fu, 0xB291E3CCu, 0x57563834u, 0xE46AE225u, 0x67FC4CA6u,
    0xCFC78691u, 0x32D9DFF1u, 0x365FDB89u, 0x75625346u};

// The same bits as a constexpr table, for tables computed at compile time below.
constexpr uint32_t kRhtNegBitsConst[16] = {
    0x9A8CA6F2u, 0x7F7FCA4Eu, 0x59BBC293u, 0x9480ABC7u, 0xB55B747Eu, 0x54503BBEu,
    0xCDF467B7u, 0x05DFBC5Fu, 0xB291E3CCu, 0x57563834u, 0xE46AE225u, 0x67FC4CA6u,
    0xCFC78691u, 0x32D9DFF1u, 0x365FDB89u, 0x75625346u};

// Sign masks laid out like the raw input data, so the signs are applied to loaded words with
// one XOR per 32-bit word (no per-element bit extraction): for 16-bit types word k holds the
// sign bits of elements 2k (bit 15) and 2k+1 (bit 31); for float32 word k is element k's bit 31.
struct __align__(16) RhtSignMask16 { uint32_t w[256]; };
struct __align__(16) RhtSignMask32 { uint32_t w[512]; };
__host__ __device__ constexpr uint32_t rht_neg_bit(int i) { return (kRhtNegBitsConst[i >> 5] >> (i & 31)) & 1u; }
__host__ __device__ constexpr RhtSignMask16 make_sign_mask16() {
  RhtSignMask16 t{};
  for (int k = 0; k < 256; ++k) t.w[k] = (rht_neg_bit(2 * k) << 15) | (rht_neg_bit(2 * k + 1) << 31);
  return t;
}
__host__ __device__ constexpr RhtSignMask32 make_sign_mask32() {
  RhtSignMask32 t{};
  for (int k = 0; k < 512; ++k) t.w[k] = rht_neg_bit(k) << 31;
  return t;
}
__device__ const RhtSignMask16 kRhtSignMask16 = make_sign_mask16();
__device__ const RhtSignMask32 kRhtSignMask32 = make_sign_mask32();

// 16 bytes of raw input holding elements [first, first + 16/sizeof(T)) with the RHT signs applied.
template <typename T>
__device__ __forceinline__ uint4 rht_signs_raw16(uint4 raw, int first) {
  const uint4 m = sizeof(T) == 2 ? __ldg(reinterpret_cast<const uint4*>(kRhtSignMask16.w + first / 2))
                                 : __ldg(reinterpret_cast<const uint4*>(kRhtSignMask32.w + first));
  return make_uint4(raw.x ^ m.x, raw.y ^ m.y, raw.z ^ m.z, raw.w ^ m.w);
}

// x[j] *= s[first + j] for j < EPT (exact: flips the sign bit). `first` is a multiple of
// EPT and EPT <= 32, so the EPT bits sit in one word.
template <int EPT>
__device__ __forceinline__ void apply_rht_signs(float (&x)[EPT], int first) {
  static_assert(EPT >= 1 && EPT <= 32 && (EPT & (EPT - 1)) == 0, "EPT: power of two <= 32");
  const uint32_t w = kRhtNegBits[first >> 5] >> (first & 31);
#pragma unroll
  for (int j = 0; j < EPT; ++j)
    x[j] = __uint_as_float(__float_as_uint(x[j]) ^ (((w >> j) & 1u) << 31));
}

// The in-register butterfly stages of a WHT: register strides h = 1, 2, 4, … < EPT of the
// lane's EPT elements, pair (x[i], x[i + h]) -> (a + b, a - b). Which element strides these
// are depends on the layout (wht_group: h; wht_chunked: h within a chunk, h·LANES between).
template <int EPT>
__device__ __forceinline__ void wht_register_stages(float (&x)[EPT]) {
#pragma unroll
  for (int h = 1; h < EPT; h <<= 1) {
#pragma unroll
    for (int i = 0; i < EPT; ++i) {
      if ((i & h) == 0) {
        const float a = x[i], b = x[i + h];
        x[i] = a + b;
        x[i + h] = a - b;
      }
    }
  }
}

// y = H · x over the D = EPT·LANES elements of the group (unnormalized, in place).
// lane_in_group = lane index within the group (0 .. LANES-1).
template <int EPT, int LANES>
__device__ __forceinline__ void wht_group(float (&x)[EPT], int lane_in_group,
                                          unsigned mask = 0xffffffffu) {
  static_assert(LANES >= 1 && LANES <= 32 && (LANES & (LANES - 1)) == 0, "LANES: power of two <= 32");
  wht_register_stages<EPT>(x);
#pragma unroll
  for (int m = 1; m < LANES; m <<= 1) {
    const bool upper = (lane_in_group & m) != 0;
#pragma unroll
    for (int j = 0; j < EPT; ++j) {
      const float p = __shfl_xor_sync(mask, x[j], m);
      // pair (a, b) = (lower, upper) -> (a + b, a - b)
      x[j] = upper ? (p - x[j]) : (x[j] + p);
    }
  }
}

// WHT over a *chunked* layout: lane l of a LANES-lane group holds EPT = NC·VEC elements as NC
// chunks of VEC consecutive elements, chunk c covering [c·VEC·LANES + l·VEC, … + VEC). This is
// the layout of NC coalesced 16-byte loads per lane (the group reads VEC·LANES contiguous
// elements per load), and it keeps most butterfly stages in registers: index bits below
// log2(VEC) and above log2(VEC·LANES) are in-register, only log2(LANES) stages shuffle.
// (The Hadamard transform factors over index bits, so the stage order is free.)
template <int EPT, int LANES, int VEC>
__device__ __forceinline__ void wht_chunked(float (&x)[EPT], int lane_in_group,
                                            unsigned mask = 0xffffffffu) {
  static_assert(EPT % VEC == 0 && (VEC & (VEC - 1)) == 0, "chunks of VEC elements");
  constexpr int NC = EPT / VEC;
  static_assert((NC & (NC - 1)) == 0, "power-of-two chunk count");
  // register strides h < VEC: within a chunk; VEC <= h < EPT: between chunks (element stride
  // h·LANES). Both run in the order h = 1, 2, 4, …, as wht_group's.
  wht_register_stages<EPT>(x);
#pragma unroll
  for (int m = 1; m < LANES; m <<= 1) {  // between lanes (element stride VEC·m)
    const float sgn = (lane_in_group & m) ? -1.0f : 1.0f;
#pragma unroll
    for (int j = 0; j < EPT; ++j) {
      const float p = __shfl_xor_sync(mask, x[j], m);
      // lower lane: x + p; upper lane: p - x. One exactly rounded FMA either way.
      x[j] = fmaf(x[j], sgn, p);
    }
  }
}

// RHT forward, y = H · (s ⊙ x).
template <int EPT, int LANES>
__device__ __forceinline__ void rht_group(float (&x)[EPT], int lane_in_group,
                                          unsigned mask = 0xffffffffu) {
  apply_rht_signs<EPT>(x, lane_in_group * EPT);
  wht_group<EPT, LANES>(x, lane_in_group, mask);
}

// RHT inverse, x = s ⊙ (H · y) / D. The division by D (a power of two) is exact.
template <int EPT, int LANES>
__device__ __forceinline__ void inverse_rht_group(float (&x)[EPT], int lane_in_group,
                                                  unsigned mask = 0xffffffffu) {
  wht_group<EPT, LANES>(x, lane_in_group, mask);
  constexpr float inv_d = 1.0f / static_cast<float>(EPT * LANES);
#pragma unroll
  for (int j = 0; j < EPT; ++j) x[j] *= inv_d;
  apply_rht_signs<EPT>(x, lane_in_group * EPT);
}

}  // namespace kvlab

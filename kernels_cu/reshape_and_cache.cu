// kvlab — fused quantize-and-write of K and V into a paged cache, every format, one pass.
// Python op: kvlab/cuda/cache.py. Reference: kvlab/reference/cache.py + kvlab/formats/*.py.
// Measurements and the reasoning behind the instruction-level choices: docs/perf-notes.md.
//
// One lane group owns one (token, head) and writes both its K and its V row: all loads are
// issued before any math and each cache byte is written once. Per (token, head) at d = 128,
// bf16 in: reads 2·256 bytes, writes 2·row bytes (auto 256, int8/fp8 132, int4 68, nvfp4 72).
// Consecutive groups are consecutive heads of one token, so K/V reads and cache-row writes are
// contiguous across a warp.
//   auto, int8, fp8, nvfp4: RowGeometry — 16 bytes of input per lane (bf16 d=128: 16 lanes × 8).
//   int4: Int4Geometry — up to 32 elements per lane as 16-byte chunks (bf16 d=128: 4 lanes ×
//         4 chunks), so the RHT runs mostly in registers (wht_chunked: 2 shuffle stages).
// At these sizes the kernels are limited by instruction issue, not by DRAM (134 M elements at
// ~0.1 ms leave ~20 issue slots per element), hence: no float->int conversions (exact magic
// adds instead), no per-element IEEE division (Markstein correction from a per-group
// reciprocal), hardware E4M3 conversion on sm_89+, signs XORed into the raw loads.
//
// Skipped tokens (slot < 0) and the grid tail keep running on zeros (the shuffles need every
// lane) but load and store nothing: their cache rows are untouched.
//
// Bit-exactness vs the reference: every rounding step of the formats is done with the same
// float32 operation or an exactly equivalent one (quant_formats.cuh, fp_codecs.cuh). The one
// difference is the int4 RHT: the reference sums in float64 and rounds to the input dtype, the
// kernel sums in float32 and rounds to the input dtype; the two agree unless the float32 sum is
// off by an ulp right at a rounding tie of the (8- or 11-bit) input dtype — rare, and counted
// by tests/gpu/test_reshape_and_cache_gpu.py. For float32 inputs the rotated vector itself is
// float32, so there last-bit differences are common and the test bounds codes to ±1 and scales
// to float32 rounding.
//
// NaN/Inf inputs follow the rule of kvlab/formats/base.py, as the reference does: a vector
// with any non-finite element is written as the format's invalid row (codes 0, NaN scale);
// auto copies values as given. int8/fp8/nvfp4 detect it from a NaN-propagating absmax, int4
// from max - min of the rotated vector (every rotated element depends on every input).
// (A finite int4 input so large that its rotation overflows float32, |x| ~ 1e36, is flagged
// invalid here but not by the reference, which rotates in float64.)
#include "common.cuh"
#include "fp_codecs.cuh"
#include "hadamard.cuh"
#include "quant_formats.cuh"

namespace {

using namespace kvlab;

// Store EPT 4-bit codes, already packed into words (code j at bits 4·(j%8) of w[j/8]: element
// 2i in the low nibble of byte i), as EPT/2 bytes at p. Word stores when p is aligned (always
// for int4; the nvfp4 data part of a slab starts unaligned only at d = 16/32 with an odd
// block_size·H, then bytes are stored).
template <int EPT>
__device__ __forceinline__ void store_nibbles(uint8_t* p, const uint32_t (&w)[EPT >= 8 ? EPT / 8 : 1]) {
  static_assert(EPT % 4 == 0, "at least 4 codes per lane");
  constexpr uintptr_t ALIGN = EPT >= 8 ? 4 : 2;
  if ((reinterpret_cast<uintptr_t>(p) & (ALIGN - 1)) != 0) {
#pragma unroll
    for (int i = 0; i < EPT / 2; ++i) p[i] = static_cast<uint8_t>(w[i / 4] >> (8 * (i % 4)));
  } else if constexpr (EPT >= 8) {
#pragma unroll
    for (int k = 0; k < EPT / 8; ++k) reinterpret_cast<uint32_t*>(p)[k] = w[k];
  } else {
    *reinterpret_cast<uint16_t*>(p) = static_cast<uint16_t>(w[0]);
  }
}

// Store EPT byte codes packed into EPT/4 words (code j at bits 8·(j%4) of w[j/4]); p 4-aligned.
template <int EPT>
__device__ __forceinline__ void store_bytes(uint8_t* p, const uint32_t (&w)[EPT / 4]) {
#pragma unroll
  for (int k = 0; k < EPT / 4; ++k) reinterpret_cast<uint32_t*>(p)[k] = w[k];
}

// Quantize one head vector (held by the lane group, EPT elements per lane) and store its row.
// `row` points at the start of the (token, head) row for the row-contiguous formats; for nvfp4
// `slab` is the (block, side) slab and (t, h) locate the data and scale bytes.
template <int FMT, int D, typename T, bool SWIZZLE>
__device__ __forceinline__ void encode_store(float (&x)[RowGeometry<D, T>::EPT], bool active, int lig,
                                             uint8_t* row, uint8_t* slab, int t, int h, int H,
                                             int block_size, float global_scale) {
  using G = RowGeometry<D, T>;
  constexpr int EPT = G::EPT, LANES = G::LANES;
  if constexpr (FMT == FMT_AUTO) {
    if (active) store_elems<T, EPT>(reinterpret_cast<T*>(row) + lig * EPT, x);
  } else if constexpr (FMT == FMT_INT8 || FMT == FMT_FP8) {
    // row: d code bytes | float32 scale
    float amax = 0.0f;
#pragma unroll
    for (int j = 0; j < EPT; ++j) amax = fmax_nan(amax, fabsf(x[j]));
#pragma unroll
    for (int o = LANES / 2; o > 0; o >>= 1) amax = fmax_nan(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const bool bad = !(amax <= 3.402823466e38f);  // NaN or Inf in the vector
    float scale = per_token_head_scale<FMT>(amax);
    const float inv = __frcp_rn(scale);
    uint32_t w[EPT / 4];
#pragma unroll
    for (int k = 0; k < EPT / 4; ++k) {
      const uint32_t c = per_token_head_encode4<FMT>(x[4 * k], x[4 * k + 1], x[4 * k + 2], x[4 * k + 3], inv);
      w[k] = bad ? 0u : c;
    }
    if (bad) scale = __uint_as_float(INVALID_SCALE_BITS);
    if (active) {
      store_bytes<EPT>(row + lig * EPT, w);
      if (lig == 0) *reinterpret_cast<float*>(row + D) = scale;
    }
  } else {
    static_assert(FMT == FMT_NVFP4, "unknown format");
    // groups of 16 elements: either LPG lanes per group (EPT < 16) or EPT/16 groups per lane
    constexpr int LPG = EPT >= NVFP4_GROUP ? 1 : NVFP4_GROUP / EPT;
    constexpr int GPL = EPT >= NVFP4_GROUP ? EPT / NVFP4_GROUP : 1;
    constexpr int GE = EPT >= NVFP4_GROUP ? NVFP4_GROUP : EPT;  // elements of one group in this lane
    uint32_t w[EPT >= 8 ? EPT / 8 : 1] = {};
    uint32_t sf[GPL];
    float amax_g[GPL];
    float amax_all = 0.0f;
#pragma unroll
    for (int g = 0; g < GPL; ++g) {
      float amax = 0.0f;
#pragma unroll
      for (int j = 0; j < GE; ++j) amax = fmax_nan(amax, fabsf(x[g * GE + j]));
#pragma unroll
      for (int o = LPG / 2; o > 0; o >>= 1) amax = fmax_nan(amax, __shfl_xor_sync(0xffffffffu, amax, o));
      amax_g[g] = amax;
      amax_all = fmax_nan(amax_all, amax);
    }
    // NaN/Inf anywhere in the vector (max.NaN propagates it through the group amaxes)
#pragma unroll
    for (int o = LANES / 2; o >= LPG; o >>= 1)
      amax_all = fmax_nan(amax_all, __shfl_xor_sync(0xffffffffu, amax_all, o));
    const bool bad = !(amax_all <= 3.402823466e38f);
    const float inv_gs = global_scale == 1.0f ? 1.0f : __frcp_rn(global_scale);
#pragma unroll
    for (int g = 0; g < GPL; ++g) {
      sf[g] = nvfp4_scale_encode_fast(amax_g[g], global_scale, inv_gs);
      const float denom = nvfp4_denom(sf[g], global_scale);
      const float r = __frcp_rn(denom);                       // once per group
      const bool zero = bad || denom == 0.0f;  // codes 0 when sf == 0 (and for the invalid row)
      uint32_t gw[GE >= 8 ? GE / 8 : 1] = {};  // this group's codes, packed
#pragma unroll
      for (int j = 0; j < GE; ++j) {
        // |x| / denom (the sign of x / denom is x's, -0 included: code 8 as in the reference)
        const float q = div_rn_by_recip(fabsf(x[g * GE + j]), denom, r);
        const uint32_t code = ((__float_as_uint(x[g * GE + j]) >> 28) & 0x8u) | e2m1_encode_abs(q);
        gw[j / 8] |= code << (4 * (j % 8));
      }
#pragma unroll
      for (int k = 0; k < (GE >= 8 ? GE / 8 : 1); ++k) {
        const int e0 = g * GE + 8 * k;  // first element of this word
        w[e0 / 8] |= (zero ? 0u : gw[k]) << (4 * (e0 % 8));
      }
      if (bad) sf[g] = NVFP4_INVALID_SCALE_BYTE;
    }
    if (active) {
      store_nibbles<EPT>(slab + nvfp4_data_offset(t, h, H, D) + lig * (EPT / 2), w);
      if (lig % LPG == 0) {
        const int g0 = (lig * EPT) / NVFP4_GROUP;
#pragma unroll
        for (int g = 0; g < GPL; ++g)
          slab[nvfp4_scale_offset(t, h, g0 + g, block_size, H, D, SWIZZLE)] = static_cast<uint8_t>(sf[g]);
      }
    }
  }
}

// int4 lane geometry: up to 32 elements per lane as NC chunks of VEC (16 bytes), so that a
// d=128 vector spans 4 lanes and the RHT needs 2 shuffle stages instead of 4 (see wht_chunked).
template <int D, typename T> struct Int4Geometry {
  static constexpr int VEC = 16 / static_cast<int>(sizeof(T));
  static constexpr int EPT = D < 32 ? D : 32;
  static constexpr int LANES = D / EPT;
  static constexpr int NC = EPT / VEC;
  static_assert(NC >= 1 && EPT % VEC == 0, "whole 16-byte chunks per lane");
};

template <typename T> struct Pair;
template <> struct Pair<__nv_bfloat16> {
  using V = __nv_bfloat162;
  static __device__ __forceinline__ V pack(float a, float b) { return __floats2bfloat162_rn(a, b); }
  static __device__ __forceinline__ float2 unpack(V v) { return __bfloat1622float2(v); }
};
template <> struct Pair<__half> {
  using V = __half2;
  static __device__ __forceinline__ V pack(float a, float b) { return __floats2half2_rn(a, b); }
  static __device__ __forceinline__ float2 unpack(V v) { return __half22float2(v); }
};

// 16 raw bytes -> VEC floats at x[off …].
template <typename T, int EPT>
__device__ __forceinline__ void raw16_to_float(uint4 raw, float (&x)[EPT], int off) {
  const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int j = 0; j < 16 / static_cast<int>(sizeof(T)); ++j) x[off + j] = to_float(e[j]);
}

// int4_per_token_head: x holds s ⊙ (head vector) already (signs applied to the raw loads) in
// the chunked layout. Rotate, round to T, min/max, codes, one 16-byte chunk -> VEC/2 code bytes.
template <int D, typename T>
__device__ __forceinline__ void encode_store_int4(float (&x)[Int4Geometry<D, T>::EPT], bool active,
                                                  int lig, uint8_t* row) {
  using G = Int4Geometry<D, T>;
  constexpr int EPT = G::EPT, LANES = G::LANES, VEC = G::VEC, NC = G::NC;
  wht_chunked<EPT, LANES, VEC>(x, lig);
  float mn, mx;
  if constexpr (sizeof(T) == 2) {
    // round to the input dtype two at a time; min/max on the packed pairs
    using P = Pair<T>;
    typename P::V vmin, vmax;
#pragma unroll
    for (int j = 0; j < EPT / 2; ++j) {
      const typename P::V v = P::pack(x[2 * j], x[2 * j + 1]);
      if (j == 0) {
        vmin = v;
        vmax = v;
      } else {
        vmin = __hmin2(vmin, v);
        vmax = __hmax2(vmax, v);
      }
      const float2 f = P::unpack(v);
      x[2 * j] = f.x;
      x[2 * j + 1] = f.y;
    }
    const float2 a = P::unpack(vmin), b = P::unpack(vmax);
    mn = fminf(a.x, a.y);
    mx = fmaxf(b.x, b.y);
  } else {
    mn = x[0];
    mx = x[0];
#pragma unroll
    for (int j = 1; j < EPT; ++j) {
      mn = fminf(mn, x[j]);
      mx = fmaxf(mx, x[j]);
    }
  }
  mn = group_min<LANES>(mn);
  mx = group_max<LANES>(mx);
  // NaN/Inf rule: every rotated element depends on every input with weight ±1, so a NaN or
  // Inf input makes every output non-finite, and mx - mn is then non-finite too.
  const bool bad = !isfinite(mx - mn);
  const Int4Params p = int4_qparams(mn, mx);
#pragma unroll
  for (int c = 0; c < NC; ++c) {
    uint32_t w = 0;
#pragma unroll
    for (int j = 0; j < VEC; ++j) w |= int4_encode(x[c * VEC + j], p) << (4 * j);
    if (bad) w = 0;
    uint8_t* dst = row + (c * VEC * LANES + lig * VEC) / 2;
    if (active) {
      if constexpr (VEC == 8) *reinterpret_cast<uint32_t*>(dst) = w;
      else *reinterpret_cast<uint16_t*>(dst) = static_cast<uint16_t>(w);
    }
  }
  if (active && lig == 0) *reinterpret_cast<uint32_t*>(row + D / 2) = bad ? INVALID_SCALE_BITS : p.word;
}

}  // namespace

// key/value: (num_tokens, H, D) with token stride key_stride / value_stride (elements; the
// (H, D) part contiguous, rows 16-byte aligned). cache: (num_blocks, 2, block_size, H, row)
// contiguous, uint8 (or T for auto). slot_mapping: int64 (num_tokens,), < 0 = skip.
// k_scale / v_scale: nvfp4 global (dequantization) scales, unused otherwise.
// SWIZZLE: nvfp4 V scales in vLLM's SM100 order.
template <int FMT, int D, typename T, bool SWIZZLE>
__global__ void __launch_bounds__(256, (FMT == kvlab::FMT_INT4 && sizeof(T) == 2 && D <= 256) ? 3 : 2) reshape_and_cache(
    const T* __restrict__ key, const T* __restrict__ value, long long key_stride,
    long long value_stride, uint8_t* __restrict__ cache, const long long* __restrict__ slot_mapping,
    long long num_tokens, int H, int block_size, float k_scale, float v_scale) {
  static_assert(!SWIZZLE || FMT == FMT_NVFP4, "the V-scale swizzle is nvfp4's");
  if constexpr (FMT == FMT_INT4) {
    using G = Int4Geometry<D, T>;
    constexpr int EPT = G::EPT, LANES = G::LANES, VEC = G::VEC, NC = G::NC;
    const int lig = threadIdx.x & (LANES - 1);
    const long long group = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) / LANES;
    const long long token = group / H;
    const int h = static_cast<int>(group - token * H);
    long long slot = -1;
    if (token < num_tokens) slot = slot_mapping[token];
    const bool active = slot >= 0;
    // all 2·NC 16-byte loads first; the RHT signs are XORed into the raw words
    uint4 rk[NC], rv[NC];
#pragma unroll
    for (int c = 0; c < NC; ++c) {
      const int first = c * VEC * LANES + lig * VEC;
      if (active) {
        rk[c] = __ldg(reinterpret_cast<const uint4*>(key + token * key_stride + h * D + first));
        rv[c] = __ldg(reinterpret_cast<const uint4*>(value + token * value_stride + h * D + first));
      } else {
        rk[c] = make_uint4(0, 0, 0, 0);
        rv[c] = make_uint4(0, 0, 0, 0);
      }
    }
    const long long blk = active ? slot / block_size : 0;
    const int t = active ? static_cast<int>(slot - blk * block_size) : 0;
    constexpr long long ROW = row_bytes<FMT_INT4>(D);
    const long long side_bytes = static_cast<long long>(block_size) * H * ROW;
    uint8_t* row_k = cache + blk * 2 * side_bytes + (static_cast<long long>(t) * H + h) * ROW;
    // K, then V: only one side's floats are live at a time (V waits as raw words), which keeps
    // the register count low enough for more resident warps to hide the shuffle latencies
    {
      float x[EPT];
#pragma unroll
      for (int c = 0; c < NC; ++c)
        raw16_to_float<T, EPT>(rht_signs_raw16<T>(rk[c], c * VEC * LANES + lig * VEC), x, c * VEC);
      encode_store_int4<D, T>(x, active, lig, row_k);
    }
    {
      float x[EPT];
#pragma unroll
      for (int c = 0; c < NC; ++c)
        raw16_to_float<T, EPT>(rht_signs_raw16<T>(rv[c], c * VEC * LANES + lig * VEC), x, c * VEC);
      encode_store_int4<D, T>(x, active, lig, row_k + side_bytes);
    }
  } else {
  using G = RowGeometry<D, T>;
  constexpr int EPT = G::EPT, LANES = G::LANES;
  static_assert(!SWIZZLE || D >= 64, "the V-scale swizzle needs d/16 % 4 == 0");
  const int lig = threadIdx.x & (LANES - 1);
  const long long group = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) / LANES;
  const long long token = group / H;
  const int h = static_cast<int>(group - token * H);
  long long slot = -1;
  if (token < num_tokens) slot = slot_mapping[token];
  const bool active = slot >= 0;

  float xk[EPT], xv[EPT];
  if (active) {
    load_elems<T, EPT>(key + token * key_stride + h * D + lig * EPT, xk);
    load_elems<T, EPT>(value + token * value_stride + h * D + lig * EPT, xv);
  } else {
#pragma unroll
    for (int j = 0; j < EPT; ++j) { xk[j] = 0.0f; xv[j] = 0.0f; }
  }
  const long long blk = active ? slot / block_size : 0;
  const int t = active ? static_cast<int>(slot - blk * block_size) : 0;

  constexpr long long ROW = FMT == FMT_AUTO ? static_cast<long long>(D) * sizeof(T) : row_bytes<FMT>(D);
  const long long side_bytes = static_cast<long long>(block_size) * H * ROW;  // one (block, side) slab
  uint8_t* slab_k = cache + (blk * 2 + 0) * side_bytes;
  uint8_t* slab_v = slab_k + side_bytes;
  const long long row_off = (static_cast<long long>(t) * H + h) * ROW;
  encode_store<FMT, D, T, false>(xk, active, lig, slab_k + row_off, slab_k, t, h, H, block_size, k_scale);
  encode_store<FMT, D, T, SWIZZLE>(xv, active, lig, slab_v + row_off, slab_v, t, h, H, block_size, v_scale);
  }
}

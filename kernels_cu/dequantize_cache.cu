// kvlab — paged cache -> dense float32 K and V, every format (debugging, the lab, tests).
// Python op: kvlab/cuda/cache.py. Reference: kvlab/reference/cache.py (dequantize_cache).
//
// One lane group per (block, offset, head, side) row; output k, v float32
// (num_blocks, block_size, H, D). Exact: every output is one correctly rounded float32
// operation of exact inputs, as in the float64 reference rounded to float32:
//   int8/fp8:  code · scale                      (one rounding)
//   nvfp4:     (e2m1 · sf) · global_scale        (e2m1 · sf is exact; one rounding)
//   int4:      s ⊙ (H · (q - zp)) · scale / D    (the WHT runs on small integers, exact in
//              float32; then one rounding by the scale; /D and the signs are exact)
//   auto:      widening copy.
// (Exact barring float32 denormal results, which CuPy's -ftz flushes to zero.)
//
// Also the tiny probe kernels tests use to compare the E2M1/E4M3 device codecs with the
// reference on arbitrary float32 inputs.
#include "common.cuh"
#include "fp_codecs.cuh"
#include "hadamard.cuh"
#include "quant_formats.cuh"

namespace {
template <bool C, typename A, typename B> struct pick { using type = A; };
template <typename A, typename B> struct pick<false, A, B> { using type = B; };
}  // namespace

// T: the cache element type for auto (ignored, uint8_t, for the quantized formats).
template <int FMT, int D, typename T, bool SWIZZLE>
__global__ void __launch_bounds__(256) dequantize_cache(const uint8_t* __restrict__ cache,
                                                        float* __restrict__ k_out,
                                                        float* __restrict__ v_out, long long num_blocks,
                                                        int block_size, int H, float k_scale,
                                                        float v_scale) {
  using namespace kvlab;
  // auto reads T rows; quantized formats use the 16-bit geometry (8 elements per lane at
  // most sizes: 4 packed bytes or 8 code bytes in, two 16-byte float4 stores out)
  using G = RowGeometry<D, typename pick<FMT == FMT_AUTO, T, __half>::type>;
  constexpr int EPT = G::EPT, LANES = G::LANES;
  static_assert(!SWIZZLE || FMT == FMT_NVFP4, "the V-scale swizzle is nvfp4's");
  const int lig = threadIdx.x & (LANES - 1);
  const long long group = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) / LANES;
  // group -> (block, side, t, h): row-major over the cache's first four dimensions
  const long long rows_total = num_blocks * 2 * block_size * H;
  const bool active = group < rows_total;
  const long long g = active ? group : 0;
  const int h = static_cast<int>(g % H);
  const int t = static_cast<int>((g / H) % block_size);
  const int side = static_cast<int>((g / (static_cast<long long>(H) * block_size)) % 2);
  const long long blk = g / (2LL * H * block_size);

  constexpr long long ROW = FMT == FMT_AUTO ? static_cast<long long>(D) * sizeof(T) : row_bytes<FMT>(D);
  const long long side_bytes = static_cast<long long>(block_size) * H * ROW;
  const uint8_t* slab = cache + (blk * 2 + side) * side_bytes;
  const uint8_t* row = slab + (static_cast<long long>(t) * H + h) * ROW;
  float x[EPT];
#pragma unroll
  for (int j = 0; j < EPT; ++j) x[j] = 0.0f;

  if constexpr (FMT == FMT_AUTO) {
    if (active) load_elems<T, EPT>(reinterpret_cast<const T*>(row) + lig * EPT, x);
  } else if constexpr (FMT == FMT_INT8 || FMT == FMT_FP8) {
    if (active) {
      const float scale = *reinterpret_cast<const float*>(row + D);
#pragma unroll
      for (int w = 0; w < EPT / 4; ++w) {
        const uint32_t word = reinterpret_cast<const uint32_t*>(row + lig * EPT)[w];
#pragma unroll
        for (int j = 0; j < 4; ++j)
          x[4 * w + j] = __fmul_rn(per_token_head_decode<FMT>(word >> (8 * j)), scale);
      }
    }
  } else if constexpr (FMT == FMT_INT4) {
    float scale = 0.0f, zp = 0.0f;
    if (active) {
      int4_split_word(*reinterpret_cast<const uint32_t*>(row + D / 2), scale, zp);
#pragma unroll
      for (int w = 0; w < EPT / 8; ++w) {
        const uint32_t word = reinterpret_cast<const uint32_t*>(row + lig * (EPT / 2))[w];
#pragma unroll
        for (int j = 0; j < 8; ++j) x[8 * w + j] = static_cast<float>((word >> (4 * j)) & 0xFu) - zp;
      }
    }
    wht_group<EPT, LANES>(x, lig);  // integers of at most 13 bits: exact
    constexpr float inv_d = 1.0f / static_cast<float>(D);
#pragma unroll
    for (int j = 0; j < EPT; ++j) x[j] = __fmul_rn(x[j], scale) * inv_d;
    apply_rht_signs<EPT>(x, lig * EPT);
  } else {
    static_assert(FMT == FMT_NVFP4, "unknown format");
    if (active) {
      const float gs = side ? v_scale : k_scale;
      const uint8_t* data = slab + nvfp4_data_offset(t, h, H, D) + lig * (EPT / 2);
#pragma unroll
      for (int w = 0; w < EPT / 8; ++w) {
        // the data part of a slab is 4-byte aligned except at d = 16/32 with odd block_size·H
        const uint32_t word =
            (reinterpret_cast<uintptr_t>(data) & 3u) == 0
                ? reinterpret_cast<const uint32_t*>(data)[w]
                : (static_cast<uint32_t>(data[4 * w]) | (static_cast<uint32_t>(data[4 * w + 1]) << 8) |
                   (static_cast<uint32_t>(data[4 * w + 2]) << 16) | (static_cast<uint32_t>(data[4 * w + 3]) << 24));
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const int e = lig * EPT + 8 * w + j;  // element index in the head vector
          const float sf = e4m3_decode(slab[nvfp4_scale_offset(t, h, e / NVFP4_GROUP, block_size, H,
                                                               D, SWIZZLE && side == 1)]);
          x[8 * w + j] = nvfp4_decode(word >> (4 * j), sf, gs);
        }
      }
    }
  }
  if (active) {
    float* out = (side ? v_out : k_out) + ((blk * block_size + t) * H + h) * static_cast<long long>(D);
    store_elems<float, EPT>(out + lig * EPT, x);
  }
}

// Probe kernels for the codec tests: codes of x (E2M1 in e2m1[i], E4M3 in e4m3[i]), and the
// value of every code (16 E2M1, 256 E4M3).
// e4m3x2[i]: byte of x[i] from the paired encoder (x[i] as the low half, x[i ^ 1] as the high
// half: both halves of the instruction are exercised).
extern "C" __global__ void fp_codecs_encode_probe(const float* __restrict__ x, uint8_t* __restrict__ e2m1,
                                                  uint8_t* __restrict__ e4m3, uint8_t* __restrict__ e4m3x2,
                                                  long long n) {
  const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) {
    e2m1[i] = static_cast<uint8_t>(kvlab::e2m1_encode(x[i]));
    e4m3[i] = static_cast<uint8_t>(kvlab::e4m3_encode(x[i]));
    const long long k = (i ^ 1) < n ? (i ^ 1) : i;
    const uint32_t pair = (i & 1) ? kvlab::e4m3x2_encode(x[k], x[i]) : kvlab::e4m3x2_encode(x[i], x[k]);
    e4m3x2[i] = static_cast<uint8_t>((i & 1) ? (pair >> 8) : pair);
  }
}

extern "C" __global__ void fp_codecs_decode_probe(float* __restrict__ e2m1_values,
                                                  float* __restrict__ e4m3_values) {
  const int i = threadIdx.x;  // launch with 256 threads
  if (i < 16) e2m1_values[i] = kvlab::e2m1_decode(i);
  e4m3_values[i] = kvlab::e4m3_decode(i);
}

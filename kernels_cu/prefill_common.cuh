// kvlab — building blocks of the paged prefill kernel (kernels_cu/paged_prefill.cu).
//
// The prefill kernel dequantizes each KV tile ONCE per CTA into shared memory as plain
// 16-bit mma operands laid out [token][dim] (K and V alike) and feeds the tensor cores with
// ldmatrix (K: plain, as the col-major B operand of S = Q·K^T; V: .trans, as the B operand
// of O = P·V). Unlike the decode kernel's operands (attention_common.cuh), the values in
// shared memory are the cache's exact values up to a per-token (int4/int8/fp8) or global
// (nvfp4) scale, zero points already subtracted:
//   * int4:  K fp16 (1024 + c) − (1024 + zp) = c − zp; V bf16 (128 + c) − (128 + zp) = c − zp
//            (integers in [−15, 15]: exact in both types; no Σq / Σ P'·zp correction terms);
//   * int8:  K fp16 (1152 + c) − 1152 = c; V the same integer moved to bf16 (exact, |c| ≤ 128);
//   * fp8:   K fp16 (cvt, exact); V bf16 bits of value·2^-120 (as the decode kernel);
//   * nvfp4: fp16 E2M1·2^-14 · (E4M3 group scale·2^7) = value·sf·2^-7 (as the decode kernel);
//   * auto:  the cache's 16-bit values, copied with cp.async, no decode.
// Dim order inside each 8-dim unit: whatever the decode produces cheapest (see unit_dim);
// the query is stored in the same order (a dot product is invariant under a common
// permutation) and the output is unpermuted in the epilogue.
#pragma once
#include "common.cuh"
#include "attention_common.cuh"

namespace kvlab {
namespace pf {

using attn::AUTO;
using attn::FP8;
using attn::INT4;
using attn::INT8;
using attn::NVFP4;

// ---------------------------------------------------------------- dim order within a unit
// Stored position p (0..7) of an 8-dim unit -> the dim (0..7) it holds.
template <int FMT>
__host__ __device__ constexpr int unit_dim(int p) {
  if (FMT == INT4 || FMT == NVFP4) return (p >> 1) + 4 * (p & 1);            // nibbles (i, i+4)
  if (FMT == INT8) return 4 * ((p >> 2) & 1) + ((p >> 1) & 1) + 2 * (p & 1);  // bytes (0,2),(1,3)
  return p;                                                                   // fp8, auto
}
// Dim o (0..7) of an 8-dim unit -> its stored position (inverse of unit_dim).
template <int FMT>
__host__ __device__ constexpr int unit_pos(int o) {
  if (FMT == INT4 || FMT == NVFP4) return 2 * (o & 3) + (o >> 2);
  if (FMT == INT8) return (o & 4) | ((o & 1) << 1) | ((o >> 1) & 1);
  return o;
}
template <int FMT>
__host__ __device__ constexpr bool unit_identity() {
  return !(FMT == INT4 || FMT == NVFP4 || FMT == INT8);
}

// ---------------------------------------------------------------- shared memory / mma feeding
__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
// Four 8x8 b16 matrices; lane l gives the row address of matrix l/8, row l%8.
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
// 16 bytes global -> shared; zeros (nothing read) when !pred.
__device__ __forceinline__ void cp_async16_zfill(unsigned dst, const void* src, bool pred) {
  const int n = pred ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n)
               : "memory");
}

// Make values opaque to the compiler so that it keeps them in registers instead of
// re-deriving them (address arithmetic from the thread index) inside the tile loop.
__device__ __forceinline__ void pin_reg(unsigned& a, unsigned& b, unsigned& c) {
  asm volatile("" : "+r"(a), "+r"(b), "+r"(c));
}

__device__ __forceinline__ uint32_t hsub2_h(uint32_t a, uint32_t b) {
  __half2 r = __hsub2(*reinterpret_cast<__half2*>(&a), *reinterpret_cast<__half2*>(&b));
  return *reinterpret_cast<uint32_t*>(&r);
}
__device__ __forceinline__ uint32_t hsub2_bf(uint32_t a, uint32_t b) {
  __nv_bfloat162 r = __hsub2(*reinterpret_cast<__nv_bfloat162*>(&a), *reinterpret_cast<__nv_bfloat162*>(&b));
  return *reinterpret_cast<uint32_t*>(&r);
}

// ---------------------------------------------------------------- unit decode
// One 8-dim unit of a K (ISV = false) or V (ISV = true) row -> 4 words of 16-bit pairs in the
// order of unit_dim. w0 (and w1 for the 8-bit formats) are the unit's cache bytes; prm:
//   int4: the zero-point pair (K: fp16 bits 0x6400|zp twice, V: bf16 bits 0x4300|zp twice);
//   nvfp4: fp16x2 of the group scale·2^7 (both halves equal); otherwise unused.
template <int FMT, bool ISV>
__device__ __forceinline__ uint4 dec_unit(uint32_t w0, uint32_t w1, uint32_t prm) {
  uint4 o;
  if constexpr (FMT == INT4) {
    // (x & 0x000F000F) | BASE as one lop3 (lut 0xEA = (a & b) | c) with the mask in a register:
    // the compiler otherwise re-materialises the second constant before every use
    constexpr uint32_t BASE = ISV ? 0x43004300u : 0x64006400u;
    uint32_t a0, a1, a2, a3;
    const uint32_t M = 0x000F000Fu;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(a0) : "r"(w0), "r"(M), "n"(BASE));
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(a1) : "r"(w0 >> 4), "r"(M), "n"(BASE));
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(a2) : "r"(w0 >> 8), "r"(M), "n"(BASE));
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(a3) : "r"(w0 >> 12), "r"(M), "n"(BASE));
    if constexpr (ISV) {
      o.x = hsub2_bf(a0, prm); o.y = hsub2_bf(a1, prm); o.z = hsub2_bf(a2, prm); o.w = hsub2_bf(a3, prm);
    } else {
      o.x = hsub2_h(a0, prm); o.y = hsub2_h(a1, prm); o.z = hsub2_h(a2, prm); o.w = hsub2_h(a3, prm);
    }
  } else if constexpr (FMT == NVFP4) {
    o.x = attn::hmul2_bits(attn::e2m1x2_to_h2_scaled<0>(w0), prm);
    o.y = attn::hmul2_bits(attn::e2m1x2_to_h2_scaled<4>(w0), prm);
    o.z = attn::hmul2_bits(attn::e2m1x2_to_h2_scaled<8>(w0), prm);
    o.w = attn::hmul2_bits(attn::e2m1x2_to_h2_scaled<12>(w0), prm);
  } else if constexpr (FMT == INT8) {
    constexpr uint32_t OFF = 0x64806480u;  // fp16 1152 twice
    uint32_t h[4];
    h[0] = hsub2_h(attn::prmt(w0, 0x64646464u, 0x4240u) ^ 0x00800080u, OFF);
    h[1] = hsub2_h(attn::prmt(w0, 0x64646464u, 0x4341u) ^ 0x00800080u, OFF);
    h[2] = hsub2_h(attn::prmt(w1, 0x64646464u, 0x4240u) ^ 0x00800080u, OFF);
    h[3] = hsub2_h(attn::prmt(w1, 0x64646464u, 0x4341u) ^ 0x00800080u, OFF);
    if constexpr (ISV) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h[i]));
        h[i] = attn::pack_f2<__nv_bfloat16>(f.x, f.y);  // |c| <= 128: exact
      }
    }
    o.x = h[0]; o.y = h[1]; o.z = h[2]; o.w = h[3];
  } else if constexpr (FMT == FP8) {
    if constexpr (ISV) {
      // bytes (0,1) -> bytes 1, 3; bf16 bits (b & 0x7F) << 4 | sign << 15 = value·2^-120, exact
      auto v2 = [](uint32_t w, uint32_t sel) {
        const uint32_t x = attn::prmt(w, 0u, sel);
        return ((x >> 4) & 0x07F007F0u) | (x & 0x80008000u);
      };
      o.x = v2(w0, 0x1404u); o.y = v2(w0, 0x3424u); o.z = v2(w1, 0x1404u); o.w = v2(w1, 0x3424u);
    } else {
      o.x = attn::e4m3x2_to_h2(w0); o.y = attn::e4m3x2_to_h2(w0 >> 16);
      o.z = attn::e4m3x2_to_h2(w1); o.w = attn::e4m3x2_to_h2(w1 >> 16);
    }
  } else {
    o.x = o.y = o.z = o.w = 0u;  // auto: not decoded (cp.async)
  }
  return o;
}

}  // namespace pf
}  // namespace kvlab

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

// KVLAB_PF_PACKED_DECODE (default since session 14; -DKVLAB_PF_NO_PACKED_DECODE for A/B): the
// prefill producers' nvfp4 words through e2m1x8_to_h2x4_scaled and two E4M3 scales per conversion
// (pf_group_scale2), int8 V straight to bf16 (dec_unit). Measured on the H200 (4k causal 32/8
// d = 128, wgmma, same call, two runs each): nvfp4 0.4791 / 0.4786 → 0.4673 / 0.4674 ms (−2.4 %),
// int8 0.5652 / 0.5634 → 0.5607 / 0.5611 (−0.6 %); the other formats' code is unchanged.
#if !defined(KVLAB_PF_NO_PACKED_DECODE) && !defined(KVLAB_PF_PACKED_DECODE)
#define KVLAB_PF_PACKED_DECODE
#endif
#if defined(KVLAB_PF_NO_PACKED_DECODE) && defined(KVLAB_PF_PACKED_DECODE)
#error "KVLAB_PF_PACKED_DECODE (default) and KVLAB_PF_NO_PACKED_DECODE exclude each other"
#endif
// KVLAB_PF_NVFP4_SCALE_WORDS (default since session 14; -DKVLAB_PF_NO_NVFP4_SCALE_WORDS for A/B): the
// wgmma producer (PfTileLoader) loads a half row's nvfp4 group scales as one 32-bit / 16-bit word
// per side instead of byte by byte. Measured on the H200 (4k causal 32/8 d = 128, same call, three
// runs each): nvfp4 0.4664 / 0.4668 / 0.4661 → 0.3671 / 0.3677 / 0.3684 ms (−21 %, 1.40× SDPA);
// the other formats' code is unchanged.
#if !defined(KVLAB_PF_NO_NVFP4_SCALE_WORDS) && !defined(KVLAB_PF_NVFP4_SCALE_WORDS)
#define KVLAB_PF_NVFP4_SCALE_WORDS
#endif
#if defined(KVLAB_PF_NO_NVFP4_SCALE_WORDS) && defined(KVLAB_PF_NVFP4_SCALE_WORDS)
#error "KVLAB_PF_NVFP4_SCALE_WORDS (default) and KVLAB_PF_NO_NVFP4_SCALE_WORDS exclude each other"
#endif
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
__device__ __forceinline__ uint32_t hmul2_bf(uint32_t a, uint32_t b) {
  __nv_bfloat162 r = __hmul2(*reinterpret_cast<__nv_bfloat162*>(&a), *reinterpret_cast<__nv_bfloat162*>(&b));
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
#if defined(KVLAB_PF_PACKED_DECODE)
    uint32_t h[4];
    attn::e2m1x8_to_h2x4_scaled(w0, h);
    o.x = attn::hmul2_bits(h[0], prm); o.y = attn::hmul2_bits(h[1], prm);
    o.z = attn::hmul2_bits(h[2], prm); o.w = attn::hmul2_bits(h[3], prm);
#else
    o.x = attn::hmul2_bits(attn::e2m1x2_to_h2_scaled<0>(w0), prm);
    o.y = attn::hmul2_bits(attn::e2m1x2_to_h2_scaled<4>(w0), prm);
    o.z = attn::hmul2_bits(attn::e2m1x2_to_h2_scaled<8>(w0), prm);
    o.w = attn::hmul2_bits(attn::e2m1x2_to_h2_scaled<12>(w0), prm);
#endif
  } else if constexpr (FMT == INT8) {
    uint32_t h[4];
#if defined(KVLAB_PF_PACKED_DECODE)
    if constexpr (ISV) {
      // bf16 straight from the signed byte b: 0x43 above b & 0x7F is 128 + (b & 0x7F), 0x43 above
      // b & 0x80 is 128 or 256 (bf16 0x4300 / 0x4380); their difference is b as a signed integer,
      // exact (|b| <= 128). PRMT + 2 LOP3 + HSUB2 per pair instead of going through fp16 and fp32.
      auto v2 = [](uint32_t w, uint32_t sel) {
        const uint32_t x = attn::prmt(w, 0x43434343u, sel);
        return hsub2_bf(x & 0xFF7FFF7Fu, x & 0xFF80FF80u);
      };
      h[0] = v2(w0, 0x4240u); h[1] = v2(w0, 0x4341u); h[2] = v2(w1, 0x4240u); h[3] = v2(w1, 0x4341u);
    } else {
      // the byte's bias flip once per word instead of once per pair
      constexpr uint32_t OFF = 0x64806480u;  // fp16 1152 twice
      const uint32_t x0 = w0 ^ 0x80808080u, x1 = w1 ^ 0x80808080u;
      h[0] = hsub2_h(attn::prmt(x0, 0x64646464u, 0x4240u), OFF);
      h[1] = hsub2_h(attn::prmt(x0, 0x64646464u, 0x4341u), OFF);
      h[2] = hsub2_h(attn::prmt(x1, 0x64646464u, 0x4240u), OFF);
      h[3] = hsub2_h(attn::prmt(x1, 0x64646464u, 0x4341u), OFF);
    }
#else
    constexpr uint32_t OFF = 0x64806480u;  // fp16 1152 twice
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
#endif
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


// ================================================================ shared by the prefill kernels
// paged_attention_prefill (paged_prefill.cu, mma.sync + ldmatrix, sm_80+) and
// paged_attention_prefill_wgmma (paged_prefill_wgmma.cu, wgmma, sm_90a) run the same algorithm
// on the same 128-row / 64-token tiles; they differ in the shared-memory layout of the 16-bit
// tiles (LAYOUT below) and in how the two products are issued. Everything else is here.
// The mma.sync kernel calls pf_epilogue (and dec_unit above); it still keeps its own inline
// copies of the tile decode, query prologue and softmax, which these functions reproduce line
// for line: calling them from there compiled to the same instruction counts and registers but
// a different schedule / register assignment (checked with scripts/sass_stats.py), and that
// kernel cannot be re-measured before the next H200 run. Fold it onto these after that run.
using namespace attn;

// Where element (row, dim) of a 16-bit [row][dim] tile sits, in bytes from the tile start.
// PfPadded: rows of D + 8 halves (16-byte pad, conflict-free ldmatrix; the mma.sync kernel).
// UNIT: halves between consecutive 8-dim units of a row.
template <int D>
struct PfPadded {
  static constexpr int RS = D + 8;
  static constexpr int UNIT = 8;
  static __device__ __forceinline__ int idx(int row, int dim) { return row * RS + dim; }  // in halves
};

// nvfp4: the dec_unit parameter of scale group i (0..3), E4M3 byte i of sb: fp16x2 of the scale·2^7,
// both halves equal (exact: E4M3 ⊂ fp16, and 448·2^7 < 65504). Both wgmma-kernel loaders.
// -DKVLAB_PF_PACKED_DECODE: two bytes per conversion (cvt e4m3x2 -> f16x2, HMUL2 by 2^7 — exact as
// well — and a PRMT to spread a half), where the default takes each byte through float32.
__device__ __forceinline__ uint32_t pf_group_scale2(uint32_t sb, int i) {
#if defined(KVLAB_PF_PACKED_DECODE)
  const uint32_t h = hmul2_bits(e4m3x2_to_h2(i < 2 ? sb : sb >> 16), 0x58005800u);  // fp16 128 twice
  return prmt(h, 0u, (i & 1) ? 0x3232u : 0x1010u);
#else
  const uint16_t hs = bits16<__half>(e4m3_to_float((sb >> (8 * i)) & 0xFFu) * 128.f);
  return pack2(hs, hs);
#endif
}

// -DKVLAB_WGMMA_V_PRESCALE (int4, row-group loads; measured in session 13, not adopted: int4
// −1.5 % at 4k causal 32/8 d = 128, against a numerics change the gain does not justify): the producer
// stores V already multiplied by its per-token scale, (c − zp)·s_v rounded to bf16 (bf16 has
// fp32's range: nothing overflows or flushes that the fp32 product would not), and the
// consumers skip the V-scale loads and the per-P multiply: P' = P rounded to bf16. Numerics:
// two bf16 roundings of each V element (the scale, the product) where the default rounds P·s_v
// once and keeps V exact.
template <int FMT>
__host__ __device__ constexpr bool pf_v_prescaled() {
#if defined(KVLAB_WGMMA_V_PRESCALE)
  return FMT == INT4;
#else
  return false;
#endif
}

// KVLAB_WGMMA_KV_PRESCALE (int4, row-group loads; the default since session 15,
// -DKVLAB_WGMMA_NO_KV_PRESCALE for A/B; -DKVLAB_WGMMA_V_PRESCALE builds session 13's V half alone
// instead; -DKVLAB_WGMMA_NO_ROWGROUP turns it off with the loader it lives in): the producer stores
// both sides already multiplied by their per-token scales, and the consumers carry no per-token work (no
// scale loads, no multiply of S by the K scales before the row max, none of P by the V scales:
// TOKSC false for int4), the path nvfp4 already takes with its group scales.
//   K = (c − zp)·(s_k·2^-4) in fp16: Q·K stays on fp16 operands (the query keeps its fp16 rounding,
//     2^-12; a first try with both in bf16 missed the tests' 5e-3 on peaked softmaxes: 5.2e-3 …
//     7.7e-3). The factor 2^-4 (PF_K_PRESCALE, folded back into the row's softmax scale, exact)
//     moves fp16's range to |k| ≤ 2^20: a token whose s_k exceeds 2^16 (15·s_k could leave it)
//     gets NaN for a scale, so its rows' outputs are NaN, never a silently dropped or clipped key.
//     At the small end, where s_k·2^-4 or the product falls under fp16's normal range (2^-14), a K
//     element keeps an absolute error below 2^-17 (16 ulps of 2^-24, times 2^4): far below what
//     moves a softmax.
//   V = (c − zp)·s_v in bf16 (bf16 has fp32's range: nothing to guard), as -DKVLAB_WGMMA_V_PRESCALE.
// Numerics: each K element rounded to fp16 twice (the scale, the product: 2^-11 each), each V
// element to bf16 twice (2^-9 each); the NO_ build keeps both exact and rounds P·s_v once.
#if !defined(KVLAB_WGMMA_NO_KV_PRESCALE) && !defined(KVLAB_WGMMA_KV_PRESCALE) && !defined(KVLAB_WGMMA_V_PRESCALE) && \
    !defined(KVLAB_WGMMA_NO_ROWGROUP)
#define KVLAB_WGMMA_KV_PRESCALE
#endif
#if defined(KVLAB_WGMMA_KV_PRESCALE) && defined(KVLAB_WGMMA_NO_ROWGROUP)
#error "KVLAB_WGMMA_KV_PRESCALE is built into the row-group loader: not with KVLAB_WGMMA_NO_ROWGROUP"
#endif
#if defined(KVLAB_WGMMA_NO_KV_PRESCALE) && defined(KVLAB_WGMMA_KV_PRESCALE)
#error "KVLAB_WGMMA_KV_PRESCALE (default) and KVLAB_WGMMA_NO_KV_PRESCALE exclude each other"
#endif
template <int FMT>
__host__ __device__ constexpr bool pf_kv_prescaled() {
#if defined(KVLAB_WGMMA_KV_PRESCALE)
  return FMT == INT4;
#else
  return false;
#endif
}
constexpr float PF_K_PRESCALE = 0.0625f;        // 2^-4, the factor on the prescaled K tile
constexpr float PF_K_PRESCALE_MAX_SCALE = 65536.f;  // s_k above this: NaN (see above)
#if defined(KVLAB_WGMMA_KV_PRESCALE) && defined(KVLAB_WGMMA_V_PRESCALE)
#error "KVLAB_WGMMA_KV_PRESCALE already prescales V: do not combine it with KVLAB_WGMMA_V_PRESCALE"
#endif
// Per-token scales of a 64-token tile in the wgmma kernel's order ("PERM"): the consumer lane with
// column pair c (lane % 4) needs the scales of tokens 8nt + 2c + e (nt = 0..7, e = 0, 1) and reads
// them as four 16-byte loads, float4 i holding (nt, e) = (2i, 0), (2i, 1), (2i+1, 0), (2i+1, 1).
// pf_par_pos(token) is where the producer stores a token's scale, pf_par_off(c, i) where the
// consumer's float4 i starts (floats from the K or V half).
//   default (since session 13): token at 16(nt >> 1) + 4c + 2(nt & 1) + e, float4 at 16i + 4c:
//            the four float4 that the 8 lanes of a 16-byte load phase (c = 0..3 twice) read are
//            64 adjacent bytes, one wavefront per phase. Measured on the H200 (session 13, 4k
//            causal 32/8 d = 128, same call): int4 -5.2 %, int8 -5.6 %, fp8 -5.7 %.
//   -DKVLAB_WGMMA_NO_SCALES_CF (the order until session 13, for A/B): token at 16c + 2nt + e,
//            float4 at 16c + 4i. A phase reads banks 0-3, 16-19, 0-3, 16-19 (+4i): c = 0 and 2
//            conflict (Nsight Compute, session 8: 11.6 wavefronts per load).
__host__ __device__ constexpr int pf_par_pos(int lt) {
#if !defined(KVLAB_WGMMA_NO_SCALES_CF)
  return 16 * (lt >> 4) + 4 * ((lt >> 1) & 3) + 2 * ((lt >> 3) & 1) + (lt & 1);
#else
  return 16 * ((lt >> 1) & 3) + 2 * (lt >> 3) + (lt & 1);
#endif
}
__host__ __device__ constexpr int pf_par_off(int c, int i) {
#if !defined(KVLAB_WGMMA_NO_SCALES_CF)
  return 16 * i + 4 * c;
#else
  return 16 * c + 4 * i;
#endif
}

// int4/int8/fp8: a row's K and V per-token scales from its parameter words (int4: the zero point
// sits in the low 4 bits; fp8 V: times FP8_V_P, the 2^64 that P' carries, attention_common.cuh).
// Both wgmma-kernel loaders.
template <int FMT>
__device__ __forceinline__ void pf_token_scales(uint32_t kp, uint32_t vp, float& ksc, float& vsc) {
  if constexpr (FMT == INT4) {
    ksc = __uint_as_float(kp & ~0xFu);
    vsc = __uint_as_float(vp & ~0xFu);
  } else if constexpr (FMT == INT8) {
    ksc = __uint_as_float(kp); vsc = __uint_as_float(vp);
  } else {
    ksc = __uint_as_float(kp); vsc = __uint_as_float(vp) * FP8_V_P;
  }
}

// The thread's part of a tile's decode: token lt = tid % KT of the tile, part `part` =
// tid / KT of its K and V rows (D/PARTS dims each: quarters with 4·KT threads, halves with
// 2·KT). Raw cache bytes of the next tile wait in
// registers (load_raw) until they are decoded into shared memory (store_unit / store_params)
// as the exact 16-bit values described at the top of this file; auto tiles are copied with
// cp.async instead (copy). LAYOUT: PfPadded<D> or the wgmma core-matrix layout.
template <int FMT, int D, typename T, int KT, class LAYOUT, int PARTS = 4>
struct PfTileLoader {
  using TR = Traits<FMT, D, T>;
  static_assert(PARTS == 2 || PARTS == 4, "quarter or half rows per thread");
  static constexpr int PB = TR::KB * 4 / PARTS;                 // raw bytes per side (D/PARTS dims)
  static constexpr int PD = D / PARTS;                          // dims per side
  static constexpr int KW = PB / 4;                             // raw words per side
  static constexpr int UPT = PD / 8;                            // 8-dim units per side
  static constexpr int NGK = (FMT == NVFP4) ? PD / 16 : 1;      // nvfp4 scale groups per side
  static constexpr int RB = (FMT == NVFP4) ? D / 2 : TR::ROW;  // bytes between rows of the data part
  static constexpr bool TOKSC = (FMT == INT4 || FMT == INT8 || FMT == FP8);

  uint32_t rk[KW], rv[KW];
  uint32_t rkp = 0u, rvp = 0u;  // int4/int8/fp8: the rows' parameter words; nvfp4: scale bytes
  const uint8_t* cache;
  const int* bt;
  unsigned side_stride, slab2, data_part;
  int L, bs_log2, BS, num_kv_heads, kvh, lt, part, swizzle_v;

  // The block id of the thread's token of tile p0 (0 past the sequence). The wgmma kernel loads
  // it a tile ahead of load_raw / copy: a block id loaded right before the row loads that need
  // it stalls every warp for a global-memory latency per tile.
  __device__ __forceinline__ int block_of(int p0) const {
    const int p = p0 + lt;
    return p < L ? __ldg(bt + (p >> bs_log2)) : 0;
  }
  __device__ __forceinline__ void load_raw(int p0) { load_raw(p0, block_of(p0)); }
  __device__ __forceinline__ void load_raw(int p0, int blk) {
    const int p = p0 + lt;
    const bool in = p < L;
    const int tt = p & (BS - 1);
    const unsigned rowi = static_cast<unsigned>(tt * num_kv_heads + kvh);
    const uint8_t* kslab = cache + static_cast<size_t>(static_cast<unsigned>(blk)) * slab2;
    const uint8_t* kr = kslab + rowi * RB;
    const uint8_t* vr = kr + side_stride;
    load_words<PB, TR::ALIGN>(kr + part * PB, rk, in);
    load_words<PB, TR::ALIGN>(vr + part * PB, rv, in);
    if constexpr (FMT == INT4 || FMT == INT8 || FMT == FP8) {
      constexpr int OFF = (FMT == INT4) ? D / 2 : D;
      rkp = in ? __ldg(reinterpret_cast<const unsigned*>(kr + OFF)) : 0u;
      rvp = in ? __ldg(reinterpret_cast<const unsigned*>(vr + OFF)) : 0u;
    } else if constexpr (FMT == NVFP4) {
      constexpr int S = D / 16;
      uint32_t kb = 0u, vb = 0u;
#if defined(KVLAB_PF_NVFP4_SCALE_WORDS)
      // KVLAB_PF_NVFP4_SCALE_WORDS (the default): a side's NGK scale bytes (contiguous in the row's
      // scale part, aligned to NGK) as one 32-bit (d = 128) or 16-bit (d = 64) load instead of NGK
      // byte loads; V too when its scales are not swizzled (kvlab's own layout), else byte by byte
      // as before. Session 13's profile had the first uses of the bytes at 11 % of all nvfp4 stall
      // samples; the word loads took nvfp4's prefill from 0.466 to 0.367 ms.
      static_assert(NGK == 4 || NGK == 2, "nvfp4 scale groups per half row: 4 (d = 128) or 2 (d = 64)");
      if (in) {
        const uint8_t* ks = kslab + data_part + rowi * S + part * NGK;
        const uint8_t* vs = ks + side_stride;
        if constexpr (NGK == 4) {
          kb = __ldg(reinterpret_cast<const unsigned*>(ks));
          if (!swizzle_v) vb = __ldg(reinterpret_cast<const unsigned*>(vs));
        } else {
          kb = __ldg(reinterpret_cast<const unsigned short*>(ks));
          if (!swizzle_v) vb = __ldg(reinterpret_cast<const unsigned short*>(vs));
        }
        if (swizzle_v) {
#pragma unroll
          for (int i = 0; i < NGK; ++i) {
            int t2, gg;
            v_scale_pos<S>(tt, part * NGK + i, true, t2, gg);
            vb |= static_cast<uint32_t>(__ldg(kslab + side_stride + data_part +
                                              static_cast<unsigned>((t2 * num_kv_heads + kvh) * S + gg)))
                  << (8 * i);
          }
        }
      }
#else
      if (in) {
        const uint8_t* ks = kslab + data_part + rowi * S;
#pragma unroll
        for (int i = 0; i < NGK; ++i) {
          const int grp = part * NGK + i;
          kb |= static_cast<uint32_t>(__ldg(ks + grp)) << (8 * i);
          int t2, gg;
          v_scale_pos<S>(tt, grp, swizzle_v, t2, gg);
          const uint8_t* vs = kslab + side_stride + data_part +
                              static_cast<unsigned>((t2 * num_kv_heads + kvh) * S + gg);
          vb |= static_cast<uint32_t>(__ldg(vs)) << (8 * i);
        }
      }
#endif
      rkp = kb; rvp = vb;
    }
  }
  // raw registers -> unit u (8 dims) of the thread's K and V part rows in the tiles at
  // ktile / vtile (shared memory)
  __device__ __forceinline__ void store_unit(uint8_t* ktile, uint8_t* vtile, int u) {
    if constexpr (FMT != AUTO) {
      uint16_t* kt = reinterpret_cast<uint16_t*>(ktile) + LAYOUT::idx(lt, part * PD) + LAYOUT::UNIT * u;
      uint16_t* vt = reinterpret_cast<uint16_t*>(vtile) + LAYOUT::idx(lt, part * PD) + LAYOUT::UNIT * u;
      uint4 ko, vo;
      if constexpr (FMT == NVFP4) {
        const int i = u >> 1;  // 16-dim group of the unit
        ko = dec_unit<FMT, false>(rk[u], 0u, pf_group_scale2(rkp, i));
        vo = dec_unit<FMT, true>(rv[u], 0u, pf_group_scale2(rvp, i));
      } else if constexpr (FMT == INT4) {
        ko = dec_unit<FMT, false>(rk[u], 0u, (0x6400u | (rkp & 0xFu)) * 0x10001u);
        vo = dec_unit<FMT, true>(rv[u], 0u, (0x4300u | (rvp & 0xFu)) * 0x10001u);
      } else {
        ko = dec_unit<FMT, false>(rk[2 * u], rk[2 * u + 1], 0u);
        vo = dec_unit<FMT, true>(rv[2 * u], rv[2 * u + 1], 0u);
      }
      *reinterpret_cast<uint4*>(kt) = ko;
      *reinterpret_cast<uint4*>(vt) = vo;
    }
  }
  // per-token scales of the tile: par[0..KT) K, par[KT..2KT) V (int4/int8/fp8). PERM (the wgmma
  // kernel's order): token lt at pf_par_pos(lt), so that the consumer lane with column pair c
  // reads its 16 K (V) scales as 4 16-byte loads (pf_par_off).
  template <bool PERM = false>
  __device__ __forceinline__ void store_params(float* par) {
    static_assert(!PERM || KT == 64, "PERM: 64-token tiles (8 n-tiles of 8 tokens)");
    if constexpr (TOKSC) {
      float ksc, vsc;
      pf_token_scales<FMT>(rkp, rvp, ksc, vsc);
      if (part == 0) {
        const int pos = PERM ? pf_par_pos(lt) : lt;
        par[pos] = ksc;
        par[KT + pos] = vsc;
      }
    }
  }
  template <bool PERM = false>
  __device__ __forceinline__ void store_tile(uint8_t* ktile, uint8_t* vtile, float* par) {
#pragma unroll
    for (int u = 0; u < UPT; ++u) store_unit(ktile, vtile, u);
    store_params<PERM>(par);
  }
  // auto: 16-byte cp.async copies of the thread's part rows of tile p0 to the tiles at the
  // shared-window addresses kt / vt
  __device__ __forceinline__ void copy(int p0, unsigned kt, unsigned vt) { copy(p0, block_of(p0), kt, vt); }
  __device__ __forceinline__ void copy(int p0, int blk, unsigned kt, unsigned vt) {
    const int p = p0 + lt;
    const bool in = p < L;
    const unsigned rowi = static_cast<unsigned>((p & (BS - 1)) * num_kv_heads + kvh);
    const uint8_t* kr = cache + static_cast<size_t>(static_cast<unsigned>(blk)) * slab2 + rowi * RB + part * PB;
    const uint8_t* vr = kr + side_stride;
    const unsigned kd = kt + 2 * LAYOUT::idx(lt, part * PD);
    const unsigned vd = vt + 2 * LAYOUT::idx(lt, part * PD);
#pragma unroll
    for (int i = 0; i < PB / 16; ++i) {
      cp_async16_zfill(kd + 2 * LAYOUT::UNIT * i, kr + 16 * i, in);
      cp_async16_zfill(vd + 2 * LAYOUT::UNIT * i, vr + 16 * i, in);
    }
    cp_async_commit();
  }
};

// The wgmma producer's tile loads in row groups (paged_prefill_wgmma.cu: ws_rowgroup; same interface as
// PfTileLoader<…, PARTS = 2>, same shared-memory result). PfTileLoader gives each thread one
// token's half row: a warp's 32 lanes read 32 different rows per load instruction (rows of one
// head are num_kv_heads·ROW bytes apart), and int4/int8/fp8 rows are only 4-byte aligned, so every
// 4-byte load touches 32 cache lines (Nsight Compute, session 8: 85 % of the producer's L1
// sectors excessive, 730 load wavefronts per tile on the L1 data pipe, which ran 87 % busy).
// Here warp w (of the 128 producer threads) owns tokens 16w .. 16w+15 of the 64-token tile, lane
// l = 8q + r the tokens 16w + r and 16w + 8 + r (row groups g = 0, 1) and, of each, the 8-dim
// units q + 4k (int4/int8/fp8: a load instruction reads 16 or 32 consecutive bytes of 8 rows) or
// UL·q .. UL·q + UL-1 (nvfp4, 16-byte aligned rows: one 16-byte (8-byte at d = 64) load per row
// and side). The 8 lanes of a 16-byte store phase (r = 0..7) write one unit of 8 consecutive
// tokens: one 128-byte core matrix of the wgmma layout, conflict-free as before. A lane's two
// rows lie in one cache block (block sizes >= 16, tiles start at multiples of 64): one block id.
template <int FMT, int D, typename T, class LAYOUT>
struct PfRowGroupLoader {
  using TR = Traits<FMT, D, T>;
  static constexpr int KT = 64;
  static constexpr int U = D / 8;                                  // 8-dim units per row
  static constexpr int UL = U / 4;                                 // units per lane and row
  static constexpr int WU = (FMT == INT8 || FMT == FP8) ? 2 : 1;   // 32-bit words per unit
  static constexpr int NW = UL * WU;                               // raw words per row and side
  static constexpr int DB = U * 4 * WU;                            // data bytes per row (not auto)
  static constexpr int RB = (FMT == NVFP4) ? D / 2 : TR::ROW;      // bytes between rows of the data part
  static constexpr int S = D / 16;                                 // nvfp4 scale groups per row
  static constexpr int NG = (FMT == NVFP4) ? UL / 2 : 1;           // nvfp4 groups per lane and row
  // per-token scales stored for the consumers (none for int4 under -DKVLAB_WGMMA_KV_PRESCALE)
  static constexpr bool TOKSC = (FMT == INT4 || FMT == INT8 || FMT == FP8) && !pf_kv_prescaled<FMT>();
  static_assert(U % 4 == 0 && (FMT != NVFP4 || UL % 2 == 0), "d = 64 or 128");

  uint32_t rk[2][NW], rv[2][NW];
  uint32_t rkp[2] = {0u, 0u}, rvp[2] = {0u, 0u};  // int4/int8/fp8: parameter words; nvfp4: scale bytes
  const uint8_t* cache;
  const int* bt;
  unsigned side_stride, slab2, data_part;
  int L, bs_log2, num_kv_heads, kvh, w, r, q, swizzle_v;

  __device__ __forceinline__ void init(int tid) { w = tid >> 5; r = tid & 7; q = (tid >> 3) & 3; }
  // the lane's k-th unit of a row
  __device__ __forceinline__ int unit(int k) const { return FMT == NVFP4 ? UL * q + k : q + 4 * k; }
  // the block id of the warp's 16 tokens of tile p0 (0 past the sequence)
  __device__ __forceinline__ int block_of(int p0) const {
    const int p = p0 + 16 * w;
    return p < L ? __ldg(bt + (p >> bs_log2)) : 0;
  }
  __device__ __forceinline__ void load_raw(int p0) { load_raw(p0, block_of(p0)); }
  __device__ __forceinline__ void load_raw(int p0, int blk) {
    const uint8_t* slab = cache + static_cast<size_t>(static_cast<unsigned>(blk)) * slab2;
#pragma unroll
    for (int g = 0; g < 2; ++g) {
      const int p = p0 + 16 * w + 8 * g + r;
      const bool in = p < L;
      const int tt = p & ((1 << bs_log2) - 1);
      const unsigned rowi = static_cast<unsigned>(tt * num_kv_heads + kvh);
      const uint8_t* kr = slab + rowi * RB;
      const uint8_t* vr = kr + side_stride;
      if constexpr (FMT == NVFP4) {
        load_words<4 * NW, 16>(kr + 4 * NW * q, rk[g], in);
        load_words<4 * NW, 16>(vr + 4 * NW * q, rv[g], in);
        uint32_t kb = 0u, vb = 0u;
        if (in) {
          const uint8_t* ks = slab + data_part + rowi * S;
#pragma unroll
          for (int i = 0; i < NG; ++i) {
            const int grp = NG * q + i;
            kb |= static_cast<uint32_t>(__ldg(ks + grp)) << (8 * i);
            int t2, gg;
            v_scale_pos<S>(tt, grp, swizzle_v, t2, gg);
            const uint8_t* vs = slab + side_stride + data_part +
                                static_cast<unsigned>((t2 * num_kv_heads + kvh) * S + gg);
            vb |= static_cast<uint32_t>(__ldg(vs)) << (8 * i);
          }
        }
        rkp[g] = kb; rvp[g] = vb;
      } else if constexpr (FMT != AUTO) {
#pragma unroll
        for (int k = 0; k < UL; ++k)
#pragma unroll
          for (int j = 0; j < WU; ++j) {
            const int off = 4 * (WU * (q + 4 * k) + j);
            rk[g][WU * k + j] = in ? __ldg(reinterpret_cast<const unsigned*>(kr + off)) : 0u;
            rv[g][WU * k + j] = in ? __ldg(reinterpret_cast<const unsigned*>(vr + off)) : 0u;
          }
        rkp[g] = in ? __ldg(reinterpret_cast<const unsigned*>(kr + DB)) : 0u;
        rvp[g] = in ? __ldg(reinterpret_cast<const unsigned*>(vr + DB)) : 0u;
      }
    }
  }
  template <bool PERM = true>
  __device__ __forceinline__ void store_tile(uint8_t* ktile, uint8_t* vtile, float* par) {
    static_assert(PERM, "the wgmma kernel's scale order");
    if constexpr (FMT != AUTO) {
#pragma unroll
      for (int g = 0; g < 2; ++g) {
        const int row = 16 * w + 8 * g + r;
#pragma unroll
        for (int k = 0; k < UL; ++k) {
          const int u = unit(k);
          uint16_t* kt = reinterpret_cast<uint16_t*>(ktile) + LAYOUT::idx(row, 8 * u);
          uint16_t* vt = reinterpret_cast<uint16_t*>(vtile) + LAYOUT::idx(row, 8 * u);
          uint4 ko, vo;
          if constexpr (FMT == NVFP4) {
            const int i = k >> 1;  // the lane's group of the unit
            ko = dec_unit<FMT, false>(rk[g][k], 0u, pf_group_scale2(rkp[g], i));
            vo = dec_unit<FMT, true>(rv[g][k], 0u, pf_group_scale2(rvp[g], i));
          } else if constexpr (FMT == INT4) {
            // the differences c − zp, exact (dec_unit): K in fp16, V in bf16; prescaled (pf_kv_prescaled,
            // pf_v_prescaled): times the scale, K = (c − zp)·(s_k·2^-4) in fp16 with a NaN scale past
            // the range, V = (c − zp)·s_v in bf16 (one rounding of the scale, one of the product)
            constexpr bool PK = pf_kv_prescaled<FMT>(), PV = PK || pf_v_prescaled<FMT>();
            const float sk = __uint_as_float(rkp[g] & ~0xFu), sv = __uint_as_float(rvp[g] & ~0xFu);
            const float skp = sk <= PF_K_PRESCALE_MAX_SCALE ? sk * PF_K_PRESCALE : __uint_as_float(0x7fc00000u);
            const uint32_t ks2 = PK ? pack_f2<__half>(skp, skp) : 0u, vs2 = PV ? pack_f2<__nv_bfloat16>(sv, sv) : 0u;
            ko = dec_unit<FMT, false>(rk[g][k], 0u, (0x6400u | (rkp[g] & 0xFu)) * 0x10001u);
            vo = dec_unit<FMT, true>(rv[g][k], 0u, (0x4300u | (rvp[g] & 0xFu)) * 0x10001u);
            if constexpr (PK) {
              ko.x = attn::hmul2_bits(ko.x, ks2); ko.y = attn::hmul2_bits(ko.y, ks2);
              ko.z = attn::hmul2_bits(ko.z, ks2); ko.w = attn::hmul2_bits(ko.w, ks2);
            }
            if constexpr (PV) {
              vo.x = hmul2_bf(vo.x, vs2); vo.y = hmul2_bf(vo.y, vs2); vo.z = hmul2_bf(vo.z, vs2); vo.w = hmul2_bf(vo.w, vs2);
            }
          } else {
            ko = dec_unit<FMT, false>(rk[g][2 * k], rk[g][2 * k + 1], 0u);
            vo = dec_unit<FMT, true>(rv[g][2 * k], rv[g][2 * k + 1], 0u);
          }
          *reinterpret_cast<uint4*>(kt) = ko;
          *reinterpret_cast<uint4*>(vt) = vo;
        }
      }
    }
    if constexpr (TOKSC) {
      if (q == 0) {
#pragma unroll
        for (int g = 0; g < 2; ++g) {
          float ksc, vsc;
          pf_token_scales<FMT>(rkp[g], rvp[g], ksc, vsc);
          const int pos = pf_par_pos(16 * w + 8 * g + r);
          par[pos] = ksc;
          par[KT + pos] = vsc;
        }
      }
    }
  }
  // auto: 16-byte cp.async copies (one unit each) of the lane's units of its two rows of tile p0
  // to the tiles at the shared-window addresses kt / vt: 8 rows x 64 consecutive bytes per copy
  __device__ __forceinline__ void copy(int p0, unsigned kt, unsigned vt) { copy(p0, block_of(p0), kt, vt); }
  __device__ __forceinline__ void copy(int p0, int blk, unsigned kt, unsigned vt) {
    const uint8_t* slab = cache + static_cast<size_t>(static_cast<unsigned>(blk)) * slab2;
#pragma unroll
    for (int g = 0; g < 2; ++g) {
      const int row = 16 * w + 8 * g + r;
      const int p = p0 + row;
      const bool in = p < L;
      const unsigned rowi = static_cast<unsigned>((p & ((1 << bs_log2) - 1)) * num_kv_heads + kvh);
      const uint8_t* kr = slab + rowi * RB;
      const uint8_t* vr = kr + side_stride;
#pragma unroll
      for (int k = 0; k < UL; ++k) {
        const int u = q + 4 * k;
        cp_async16_zfill(kt + 2 * LAYOUT::idx(row, 8 * u), kr + 16 * u, in);
        cp_async16_zfill(vt + 2 * LAYOUT::idx(row, 8 * u), vr + 16 * u, in);
      }
    }
    cp_async_commit();
  }
};

// Query rows -> shared memory (16-bit Q·K operands at LAYOUT, dims in the tiles' order,
// rotated for int4, prescaled) and cs_sm[r] = the row's softmax scale in log2 units (nvfp4:
// times the global K scale), one warp per row. Rows r >= nrow are zeros.
template <int FMT, int D, typename T, int ROWS, int NWARPS, class LAYOUT>
__device__ __forceinline__ void pf_stage_queries(uint16_t* q_sm, float* cs_sm, const T* __restrict__ q,
                                                 int warp, int lane, int nrow, int tok0, int G, int qs,
                                                 int num_q_heads, int kvh, float scale_log2, float k_scale) {
  using CTQ = typename Traits<FMT, D, T>::CT_QK;
  constexpr int E = D / 32;
  const float kfold = (FMT == NVFP4) ? 128.f * k_scale : 1.f;  // nvfp4: global K scale
  // The warp's rows r = warp + i·NWARPS in batches of QB: all loads of a batch are issued before
  // any row's rotation and reductions, so a warp waits one load latency per batch, not per row
  // (the profile of the one-row-at-a-time loop put 6.9 % of the kernel's stall samples on these
  // loads). QB·E 16-bit values are live per lane during a batch's loads.
  static_assert(ROWS % NWARPS == 0, "every warp stages the same number of rows");
  constexpr int NR = ROWS / NWARPS;
  constexpr int QB = NR < 8 ? NR : 8;
  static_assert(NR % QB == 0, "whole batches");
#pragma unroll 1
  for (int b = 0; b < NR; b += QB) {
    T raw[QB][E];
#pragma unroll
    for (int i = 0; i < QB; ++i) {
      const int r = warp + (b + i) * NWARPS;
      if (r < nrow) {
        const int tok = tok0 + r / G;
        const int qhead = kvh * G + r % G;
        const T* qr = q + (static_cast<size_t>(qs + tok) * num_q_heads + qhead) * D + lane * E;
#pragma unroll
        for (int j = 0; j < E; ++j) raw[i][j] = qr[j];
      } else {
#pragma unroll
        for (int j = 0; j < E; ++j) raw[i][j] = from_float<T>(0.f);
      }
    }
#pragma unroll
    for (int i = 0; i < QB; ++i) {
      const int r = warp + (b + i) * NWARPS;
      float x[E];
#pragma unroll
      for (int j = 0; j < E; ++j) x[j] = to_float(raw[i][j]);
      const float pre = query_vector_prescale<FMT, D>(x, lane);
#pragma unroll
      for (int j = 0; j < E; ++j) {
        const int dim = lane * E + j;
        q_sm[LAYOUT::idx(r, (dim & ~7) + unit_pos<FMT>(dim & 7))] =
            bits16<CTQ>(x[j] * pre);
      }
      if (lane == 0) cs_sm[r] = scale_log2 * kfold / pre;
    }
  }
}

// Lean query prologue (the wgmma kernel since session 8; no other caller): the
// same values in q_sm / cs_sm as pf_stage_queries, with 4 lanes per row instead of 32. Lane
// (rr = lane / 4, qc = lane % 4) holds dims qc·D/4 … +D/4 of row warp + (b + rr)·NWARPS, so a warp
// stages 8 rows at once; the int4 rotation runs D/4-element register stages and 2 shuffle
// stages (rht_group<D/4, 4>, written as apply_rht_signs + wht_chunked<D/4, 4, D/4>, whose shuffle
// stages are one FFMA x·(±1) + p each, bit-identical to wht_group's select of x + p / p − x: the
// same H·(s ⊙ x) over dim index qc·D/4 + j as rht_group<D/32, 32>, summed in another order:
// fp32-level differences before the fp16 rounding), the row's |max|
// over the 4 lanes (max is exact), and each 8-dim unit leaves as one 16-byte store in the stored
// order of unit_dim. pf_stage_queries spends ~200 instructions per row (20 shuffles, 16-bit
// stores, index math per element); this ~60.
template <int FMT, int D, typename T, int ROWS, int NWARPS, class LAYOUT>
__device__ __forceinline__ void pf_stage_queries_quad(uint16_t* q_sm, float* cs_sm, const T* __restrict__ q,
                                                      int warp, int lane, int nrow, int tok0, int G, int qs,
                                                      int num_q_heads, int kvh, float scale_log2, float k_scale) {
  using CTQ = typename Traits<FMT, D, T>::CT_QK;
  constexpr int QD = D / 4;
  // nvfp4: the global K scale; int4 under -DKVLAB_WGMMA_KV_PRESCALE: 2^4 (PF_K_PRESCALE undone)
  const float kfold = (FMT == NVFP4) ? 128.f * k_scale : pf_kv_prescaled<FMT>() ? 1.f / PF_K_PRESCALE : 1.f;
  static_assert(ROWS % (8 * NWARPS) == 0, "8 rows per warp and pass");
  static_assert(sizeof(T) == 2 && QD % 8 == 0, "16-bit queries, whole 16-byte chunks per lane");
  const int rr = lane >> 2, qc = lane & 3;
  // 4 lanes per row: element-wise 16-bit loads would touch 32 sectors per warp instruction (each
  // lane alone in its sector); with a 16-byte aligned base every lane's chunk is 16-byte aligned
  const bool vec = (reinterpret_cast<uintptr_t>(q) & 15u) == 0;
#pragma unroll 1
  for (int b = 0; b < ROWS / NWARPS; b += 8) {
    const int r = warp + (b + rr) * NWARPS;
    float x[QD];
    if (r < nrow) {
      const int tok = tok0 + r / G;
      const int qhead = kvh * G + r % G;
      const T* qr = q + (static_cast<size_t>(qs + tok) * num_q_heads + qhead) * D + qc * QD;
      if (vec) {  // 16-byte loads: a row chunk is QD·2 >= 32 bytes at a multiple of 32 bytes
#pragma unroll
        for (int v = 0; v < QD / 8; ++v) {
          const uint4 w = __ldg(reinterpret_cast<const uint4*>(qr) + v);
          const uint32_t ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            x[8 * v + 2 * i] = from_bits16<T>(static_cast<uint16_t>(ws[i] & 0xFFFFu));
            x[8 * v + 2 * i + 1] = from_bits16<T>(static_cast<uint16_t>(ws[i] >> 16));
          }
        }
      } else {
        T raw[QD];
#pragma unroll
        for (int j = 0; j < QD; ++j) raw[j] = qr[j];
#pragma unroll
        for (int j = 0; j < QD; ++j) x[j] = to_float(raw[j]);
      }
    } else {
#pragma unroll
      for (int j = 0; j < QD; ++j) x[j] = 0.f;
    }
    if constexpr (FMT == INT4) {  // rht_group<QD, 4> with the shuffle stages as one FFMA (x·±1 + p)
      apply_rht_signs<QD>(x, qc * QD);
      wht_chunked<QD, 4, QD>(x, qc);
    }
    float amax = 0.f;
#pragma unroll
    for (int j = 0; j < QD; ++j) amax = fmaxf(amax, fabsf(x[j]));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
    float pre = 1.f;
    if constexpr (FMT != AUTO) {  // as query_vector_prescale: |q| < 2^15 in fp16, exact
      const int ex = static_cast<int>((__float_as_uint(amax) >> 23) & 0xFF) - 127;
      pre = ex > 14 ? __uint_as_float(static_cast<uint32_t>(127 - (ex - 14)) << 23) : 1.f;
    }
#pragma unroll
    for (int u = 0; u < QD / 8; ++u) {
      uint4 w;
      w.x = pack_f2<CTQ>(x[8 * u + unit_dim<FMT>(0)] * pre, x[8 * u + unit_dim<FMT>(1)] * pre);
      w.y = pack_f2<CTQ>(x[8 * u + unit_dim<FMT>(2)] * pre, x[8 * u + unit_dim<FMT>(3)] * pre);
      w.z = pack_f2<CTQ>(x[8 * u + unit_dim<FMT>(4)] * pre, x[8 * u + unit_dim<FMT>(5)] * pre);
      w.w = pack_f2<CTQ>(x[8 * u + unit_dim<FMT>(6)] * pre, x[8 * u + unit_dim<FMT>(7)] * pre);
      *reinterpret_cast<uint4*>(q_sm + LAYOUT::idx(r, qc * QD + 8 * u)) = w;
    }
    if (qc == 0) cs_sm[r] = scale_log2 * kfold / pre;
  }
}

// One tile's scores s (rows r0 = g and r1 = g + 8 of the warp, s[nt][0..1] = row r0, tokens
// p0 + 8nt + 2c, +1; s[nt][2..3] = row r1) -> per-token K scale, causal / window mask unless
// `full`, row maxima, running max (m, in score units) and sum (l) update, accumulator rescale
// (skipped when no row max of the warp moved). nm0 / nm1: the exponent offsets of the rows
// (P = exp2(s·cs + nm)).
template <bool TOKSC, int NT, int ON>
__device__ __forceinline__ void pf_softmax_update(float (&s)[NT][4], float (&acc)[ON][4], const float* par,
                                                  bool full, int p0, int qp0, int qp1, int window, int c,
                                                  float cs0, float cs1, float& m0, float& m1, float& l0,
                                                  float& l1, float& nm0, float& nm1) {
  if constexpr (TOKSC) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const float2 ks = *reinterpret_cast<const float2*>(par + nt * 8 + 2 * c);
      s[nt][0] *= ks.x; s[nt][1] *= ks.y; s[nt][2] *= ks.x; s[nt][3] *= ks.y;
    }
  }
  if (!full) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int kp = p0 + nt * 8 + 2 * c + e;
        const bool ok0 = kp <= qp0 && (window <= 0 || kp > qp0 - window);
        const bool ok1 = kp <= qp1 && (window <= 0 || kp > qp1 - window);
        if (!ok0) s[nt][e] = neg_inf();
        if (!ok1) s[nt][2 + e] = neg_inf();
      }
    }
  }
  float mx0 = neg_inf(), mx1 = neg_inf();
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    mx0 = fmaxf(mx0, fmaxf(s[nt][0], s[nt][1]));
    mx1 = fmaxf(mx1, fmaxf(s[nt][2], s[nt][3]));
  }
  mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
  mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
  mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
  mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
  // running max in score units (cs > 0): exponent = s·cs − m·cs, one FFMA per element
  const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
  const float al0 = ex2_approx((m0 - mn0) * cs0), al1 = ex2_approx((m1 - mn1) * cs1);
  m0 = mn0; m1 = mn1;
  nm0 = mn0 == NEG_BIG ? 0.f : -mn0 * cs0;  // row fully masked so far: exponents -inf
  nm1 = mn1 == NEG_BIG ? 0.f : -mn1 * cs1;
  l0 *= al0; l1 *= al1;
  if (__any_sync(0xffffffffu, al0 != 1.f || al1 != 1.f)) {
#pragma unroll
    for (int j = 0; j < ON; ++j) {
      acc[j][0] *= al0; acc[j][1] *= al0; acc[j][2] *= al1; acc[j][3] *= al1;
    }
  }
}

// Lazy variant of pf_softmax_update (the wgmma kernel since session 8; no other
// caller; per-token scales in the PERM order of PfTileLoader::store_params). The reference max m of a row (the exponent offset nm = −m·cs, state kept across tiles
// by the caller, nm = 0 while m = NEG_BIG) is moved only when some row of the warp would see an
// exponent above PF_LAZY_TAU (log2 units: P ≤ 2^PF_LAZY_TAU), and then every row of the warp takes
// its exact new max (the accumulator rescale, 2·ON·2 FMUL, runs anyway for the warp). Between
// moves P = exp2(s·cs − m·cs) uses a stale m ≤ the true running max: the same algebra (O and l
// carry the same factor exp2(−m·cs), which cancels in O / l), only the magnitudes of P, P', O and l
// are up to 2^PF_LAZY_TAU larger, which changes no relative rounding (fp32 accumulators; P' in
// bf16 or, nvfp4 / fp16 auto, fp16 with max 65504 ≫ 2^8; ex2.approx has a relative error).
// tests/test_prefill_softmax_lean.py emulates both paths in float32.
#ifndef PF_LAZY_TAU
#define PF_LAZY_TAU 8.0f
#endif
// pf_softmax_update_lazy in two parts, for a caller whose P'·V of the previous tile may still be in
// flight (the wgmma kernel's -DKVLAB_WGMMA_S_FIRST): pf_softmax_max_lazy touches only the scores, the
// running max / offsets and the row sums, and returns whether the warp moved its max (al0 / al1
// the factors); pf_rescale_acc then applies the factors to the accumulator, once that product has
// completed. pf_softmax_update_lazy is the two back to back.
// The K scales of the lane's 16 tokens (column pair c) in the PERM order of
// PfTileLoader::store_params (pf_par_pos / pf_par_off): four 16-byte loads (TOKSC formats only).
template <bool TOKSC>
__device__ __forceinline__ void pf_load_k_scales(float4 (&ks)[4], const float* par, int c) {
  if constexpr (TOKSC) {
#pragma unroll
    for (int i = 0; i < 4; ++i) ks[i] = *reinterpret_cast<const float4*>(par + pf_par_off(c, i));
  }
}
template <bool TOKSC, int NT>
__device__ __forceinline__ bool pf_softmax_max_lazy(float (&s)[NT][4], const float4 (&ks)[4], bool full, int p0,
                                                    int qp0, int qp1, int window, int c, float cs0, float cs1,
                                                    float& m0, float& m1, float& l0, float& l1, float& nm0,
                                                    float& nm1, float& al0, float& al1) {
  if constexpr (TOKSC) {
    static_assert(NT == 8, "PERM scale order: 64-token tiles");
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      s[2 * i][0] *= ks[i].x; s[2 * i][1] *= ks[i].y; s[2 * i][2] *= ks[i].x; s[2 * i][3] *= ks[i].y;
      s[2 * i + 1][0] *= ks[i].z; s[2 * i + 1][1] *= ks[i].w; s[2 * i + 1][2] *= ks[i].z; s[2 * i + 1][3] *= ks[i].w;
    }
  }
  if (!full) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int kp = p0 + nt * 8 + 2 * c + e;
        const bool ok0 = kp <= qp0 && (window <= 0 || kp > qp0 - window);
        const bool ok1 = kp <= qp1 && (window <= 0 || kp > qp1 - window);
        if (!ok0) s[nt][e] = neg_inf();
        if (!ok1) s[nt][2 + e] = neg_inf();
      }
    }
  }
#if defined(KVLAB_WGMMA_TREE_REDUCE)
  // the row maxima as a balanced tree (depth log2(2·NT) instead of a chain of NT + 1 FMNMX)
  float t0[NT], t1[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    t0[nt] = fmaxf(s[nt][0], s[nt][1]);
    t1[nt] = fmaxf(s[nt][2], s[nt][3]);
  }
#pragma unroll
  for (int w = NT / 2; w > 0; w /= 2) {
#pragma unroll
    for (int i = 0; i < w; ++i) {
      t0[i] = fmaxf(t0[i], t0[i + w]);
      t1[i] = fmaxf(t1[i], t1[i + w]);
    }
  }
  float mx0 = t0[0], mx1 = t1[0];
#else
  float mx0 = neg_inf(), mx1 = neg_inf();
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    mx0 = fmaxf(mx0, fmaxf(s[nt][0], s[nt][1]));
    mx1 = fmaxf(mx1, fmaxf(s[nt][2], s[nt][3]));
  }
#endif
  mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
  mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
  mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
  mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
  // a row needs a move when its largest exponent would exceed TAU (m = NEG_BIG: any finite score;
  // a fully masked row, mx = -inf, never)
  const bool need = (mx0 - m0) * cs0 > PF_LAZY_TAU || (mx1 - m1) * cs1 > PF_LAZY_TAU;
  if (__any_sync(0xffffffffu, need)) {
    const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
    al0 = ex2_approx((m0 - mn0) * cs0); al1 = ex2_approx((m1 - mn1) * cs1);
    m0 = mn0; m1 = mn1;
    nm0 = mn0 == NEG_BIG ? 0.f : -mn0 * cs0;
    nm1 = mn1 == NEG_BIG ? 0.f : -mn1 * cs1;
    l0 *= al0; l1 *= al1;
    return true;
  }
  return false;
}
template <int ON>
__device__ __forceinline__ void pf_rescale_acc(float (&acc)[ON][4], float al0, float al1) {
#pragma unroll
  for (int j = 0; j < ON; ++j) {
    acc[j][0] *= al0; acc[j][1] *= al0; acc[j][2] *= al1; acc[j][3] *= al1;
  }
}
template <bool TOKSC, int NT, int ON>
__device__ __forceinline__ void pf_softmax_update_lazy(float (&s)[NT][4], float (&acc)[ON][4], const float* par,
                                                       bool full, int p0, int qp0, int qp1, int window, int c,
                                                       float cs0, float cs1, float& m0, float& m1, float& l0,
                                                       float& l1, float& nm0, float& nm1) {
  float4 ks[4];
  pf_load_k_scales<TOKSC>(ks, par, c);
  float al0, al1;
  if (pf_softmax_max_lazy<TOKSC>(s, ks, full, p0, qp0, qp1, window, c, cs0, cs1, m0, m1, l0, l1, nm0, nm1, al0, al1))
    pf_rescale_acc(acc, al0, al1);
}

// P' of k-chunk kc (tokens 16kc .. 16kc+15 = S n-tiles 2kc, 2kc+1) as the A operand of the
// P·V product (mma.sync m16n8k16 and wgmma m64nNk16 share this fragment layout); adds the
// unscaled P to the row sums; int4/int8/fp8: P' = P·(per-token V scale).
template <bool TOKSC, typename CTV, int NT, int KT>
__device__ __forceinline__ void pf_p_operand(uint32_t (&pa)[4], const float (&s)[NT][4], int kc, const float* par,
                                             int c, float cs0, float cs1, float nm0, float nm1, float& l0,
                                             float& l1) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int nt = 2 * kc + h;
    float e00 = ex2_approx(fmaf(s[nt][0], cs0, nm0)), e01 = ex2_approx(fmaf(s[nt][1], cs0, nm0));
    float e10 = ex2_approx(fmaf(s[nt][2], cs1, nm1)), e11 = ex2_approx(fmaf(s[nt][3], cs1, nm1));
    l0 += e00 + e01;
    l1 += e10 + e11;
    if constexpr (TOKSC) {
      const float2 vs = *reinterpret_cast<const float2*>(par + KT + nt * 8 + 2 * c);
      e00 *= vs.x; e01 *= vs.y; e10 *= vs.x; e11 *= vs.y;
    }
    pa[2 * h] = pack_f2<CTV>(e00, e01);
    pa[2 * h + 1] = pack_f2<CTV>(e10, e11);
  }
}

// pf_p_operand with the per-token V scales in the PERM order of PfTileLoader::store_params (the
// wgmma kernel's lean switch): k-chunk kc's four (tokens 16kc + 2c, +1, 16kc + 8 + 2c, +1) are
// one 16-byte load at par + KT + pf_par_off(c, kc). Same arithmetic as pf_p_operand. TOKSC = false:
// no V scale (auto, nvfp4, and int4 under -DKVLAB_WGMMA_V_PRESCALE, whose V tile carries it).
// The two halves of pf_p_operand_perm, for the wgmma kernel's -DKVLAB_WGMMA_S_FIRST, where the
// exponentials of a tile are taken while the previous tile's P'·V still reads the P' registers:
// pf_exp_chunk turns the scores of k-chunk kc (n-tiles 2kc, 2kc + 1) into P, adding them to the
// row sums; pf_pack_chunk multiplies P by the chunk's V scales vs4 (TOKSC) and packs it.
template <int NT>
__device__ __forceinline__ void pf_exp_chunk(float (&e)[2][4], const float (&s)[NT][4], int kc, float cs0, float cs1,
                                             float nm0, float nm1, float& l0, float& l1) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int nt = 2 * kc + h;
    e[h][0] = ex2_approx(fmaf(s[nt][0], cs0, nm0)); e[h][1] = ex2_approx(fmaf(s[nt][1], cs0, nm0));
    e[h][2] = ex2_approx(fmaf(s[nt][2], cs1, nm1)); e[h][3] = ex2_approx(fmaf(s[nt][3], cs1, nm1));
    l0 += e[h][0] + e[h][1];
    l1 += e[h][2] + e[h][3];
  }
}
template <bool TOKSC, typename CTV>
__device__ __forceinline__ void pf_pack_chunk(uint32_t (&pa)[4], float (&e)[2][4], float4 vs4) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if constexpr (TOKSC) {
      const float vx = h ? vs4.z : vs4.x, vy = h ? vs4.w : vs4.y;
      e[h][0] *= vx; e[h][1] *= vy; e[h][2] *= vx; e[h][3] *= vy;
    }
    pa[2 * h] = pack_f2<CTV>(e[h][0], e[h][1]);
    pa[2 * h + 1] = pack_f2<CTV>(e[h][2], e[h][3]);
  }
}
template <bool TOKSC, int KT>
__device__ __forceinline__ float4 pf_v_scales_perm(const float* par, int c, int kc) {
  if constexpr (TOKSC) return *reinterpret_cast<const float4*>(par + KT + pf_par_off(c, kc));
  return make_float4(1.f, 1.f, 1.f, 1.f);
}

// pf_p_operand with the per-token V scales in the PERM order of PfTileLoader::store_params (the
// wgmma kernel's lean switch): k-chunk kc's four (tokens 16kc + 2c, +1, 16kc + 8 + 2c, +1) are
// one 16-byte load at par + KT + pf_par_off(c, kc). Same arithmetic as pf_p_operand. TOKSC = false:
// no V scale (auto, nvfp4, and int4 under -DKVLAB_WGMMA_V_PRESCALE, whose V tile carries it).
template <bool TOKSC, typename CTV, int NT, int KT>
__device__ __forceinline__ void pf_p_operand_perm(uint32_t (&pa)[4], const float (&s)[NT][4], int kc,
                                                  const float* par, int c, float cs0, float cs1, float nm0,
                                                  float nm1, float& l0, float& l1) {
  float4 vs4 = make_float4(1.f, 1.f, 1.f, 1.f);
  if constexpr (TOKSC) vs4 = *reinterpret_cast<const float4*>(par + KT + pf_par_off(c, kc));
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int nt = 2 * kc + h;
    float e00 = ex2_approx(fmaf(s[nt][0], cs0, nm0)), e01 = ex2_approx(fmaf(s[nt][1], cs0, nm0));
    float e10 = ex2_approx(fmaf(s[nt][2], cs1, nm1)), e11 = ex2_approx(fmaf(s[nt][3], cs1, nm1));
    l0 += e00 + e01;
    l1 += e10 + e11;
    if constexpr (TOKSC) {
      const float vx = h ? vs4.z : vs4.x, vy = h ? vs4.w : vs4.y;
      e00 *= vx; e01 *= vy; e10 *= vx; e11 *= vy;
    }
    pa[2 * h] = pack_f2<CTV>(e00, e01);
    pa[2 * h + 1] = pack_f2<CTV>(e10, e11);
  }
}

// Epilogue: row sums across the 4 lanes of a row, output rows (acc: rows r0 / r1 of the warp,
// acc[j][0..1] = row r0, stored dims 8j + 2c, +1) through shared memory o_sm (ROWS x ORS
// floats; the caller's tile buffers, free once every thread passed the barrier here) for the
// int4 inverse rotation and the dim order, then out. Contains two CTA barriers: __syncthreads
// (BAR = 0), or, for a kernel whose other warps do not take part (the warp-specialised wgmma
// kernel's producer), named barrier BAR over the NWARPS calling warps. __syncthreads is an
// aligned barrier: every thread of the CTA must reach the same instruction.
template <int BAR, int NWARPS>
__device__ __forceinline__ void pf_cta_barrier() {
  if constexpr (BAR == 0) {
    __syncthreads();
  } else {
    asm volatile("bar.sync %0, %1;\n" ::"n"(BAR), "n"(NWARPS * 32) : "memory");
  }
}
template <int FMT, int D, typename T, int ROWS, int NWARPS, int ORS, int BAR = 0, int ON>
__device__ __forceinline__ void pf_epilogue(const float (&acc)[ON][4], float l0, float l1, float* o_sm,
                                            T* __restrict__ out, int r0, int r1, int c, int warp, int lane,
                                            int nrow, int tok0, int G, int qs, int num_q_heads, int kvh,
                                            float v_scale) {
  constexpr int E = D / 32;
  l0 += __shfl_xor_sync(0xffffffffu, l0, 1); l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 1); l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
  const float vfac = (FMT == NVFP4) ? 128.f * v_scale : (FMT == FP8) ? FP8_V_OUT : 1.f;
  const float inv0 = l0 > 0.f ? vfac / l0 : 0.f, inv1 = l1 > 0.f ? vfac / l1 : 0.f;
  if constexpr (FMT == AUTO) cp_async_wait<0>();
  pf_cta_barrier<BAR, NWARPS>();  // tile buffers -> output rows
#pragma unroll
  for (int j = 0; j < ON; ++j) {
    if constexpr (unit_identity<FMT>()) {
      const int dim = 8 * j + 2 * c;
      *reinterpret_cast<float2*>(o_sm + r0 * ORS + dim) = make_float2(acc[j][0] * inv0, acc[j][1] * inv0);
      *reinterpret_cast<float2*>(o_sm + r1 * ORS + dim) = make_float2(acc[j][2] * inv1, acc[j][3] * inv1);
    } else {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int dim = 8 * j + unit_dim<FMT>(2 * c + h);
        o_sm[r0 * ORS + dim] = acc[j][h] * inv0;
        o_sm[r1 * ORS + dim] = acc[j][2 + h] * inv1;
      }
    }
  }
  pf_cta_barrier<BAR, NWARPS>();
  for (int r = warp; r < nrow; r += NWARPS) {
    float x[E];
#pragma unroll
    for (int j = 0; j < E; ++j) x[j] = o_sm[r * ORS + lane * E + j];
    if constexpr (FMT == INT4) inverse_rht_group<E, 32>(x, lane);
    const int tok = tok0 + r / G;
    T* orow = out + (static_cast<size_t>(qs + tok) * num_q_heads + kvh * G + r % G) * D + lane * E;
#pragma unroll
    for (int j = 0; j < E; ++j) orow[j] = from_float<T>(x[j]);
  }
}

// Lean epilogue (the wgmma kernel since session 8; no other caller): pf_epilogue's
// first part unchanged (row sums, output rows into o_sm, the two barriers), then 4 lanes per
// output row as in pf_stage_queries_quad: lane (rr, qc) reads dims qc·D/4 … of row
// warp + (b + rr)·NWARPS with 16-byte loads, the int4 inverse rotation runs as
// inverse_rht_group<D/4, 4> (wht_chunked's FFMA shuffle stages; all lanes, so the shuffles see the
// whole warp; rows past nrow are computed and not stored).
template <int FMT, int D, typename T, int ROWS, int NWARPS, int ORS, int BAR = 0, int ON>
__device__ __forceinline__ void pf_epilogue_quad(const float (&acc)[ON][4], float l0, float l1, float* o_sm,
                                                 T* __restrict__ out, int r0, int r1, int c, int warp, int lane,
                                                 int nrow, int tok0, int G, int qs, int num_q_heads, int kvh,
                                                 float v_scale) {
  constexpr int QD = D / 4;
  static_assert(ROWS % (8 * NWARPS) == 0 && ORS % 4 == 0, "8 rows per warp and pass, 16-byte rows");
  l0 += __shfl_xor_sync(0xffffffffu, l0, 1); l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 1); l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
  const float vfac = (FMT == NVFP4) ? 128.f * v_scale : (FMT == FP8) ? FP8_V_OUT : 1.f;
  const float inv0 = l0 > 0.f ? vfac / l0 : 0.f, inv1 = l1 > 0.f ? vfac / l1 : 0.f;
  if constexpr (FMT == AUTO) cp_async_wait<0>();
  pf_cta_barrier<BAR, NWARPS>();  // tile buffers -> output rows
#pragma unroll
  for (int j = 0; j < ON; ++j) {
    if constexpr (unit_identity<FMT>()) {
      const int dim = 8 * j + 2 * c;
      *reinterpret_cast<float2*>(o_sm + r0 * ORS + dim) = make_float2(acc[j][0] * inv0, acc[j][1] * inv0);
      *reinterpret_cast<float2*>(o_sm + r1 * ORS + dim) = make_float2(acc[j][2] * inv1, acc[j][3] * inv1);
    } else {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int dim = 8 * j + unit_dim<FMT>(2 * c + h);
        o_sm[r0 * ORS + dim] = acc[j][h] * inv0;
        o_sm[r1 * ORS + dim] = acc[j][2 + h] * inv1;
      }
    }
  }
  pf_cta_barrier<BAR, NWARPS>();
  const int rr = lane >> 2, qc = lane & 3;
  static_assert(sizeof(T) == 2 && QD % 8 == 0, "16-bit outputs, whole 16-byte chunks per lane");
  const bool vec = (reinterpret_cast<uintptr_t>(out) & 15u) == 0;
#pragma unroll 1
  for (int b = 0; b < ROWS / NWARPS && warp + b * NWARPS < nrow; b += 8) {
    const int r = warp + (b + rr) * NWARPS;
    float x[QD];
#pragma unroll
    for (int i = 0; i < QD / 4; ++i) {
      const float4 v = *reinterpret_cast<const float4*>(o_sm + r * ORS + qc * QD + 4 * i);
      x[4 * i] = v.x; x[4 * i + 1] = v.y; x[4 * i + 2] = v.z; x[4 * i + 3] = v.w;
    }
    if constexpr (FMT == INT4) {  // inverse_rht_group<QD, 4>, shuffle stages as one FFMA each
      wht_chunked<QD, 4, QD>(x, qc);
#pragma unroll
      for (int j = 0; j < QD; ++j) x[j] *= 1.0f / static_cast<float>(D);
      apply_rht_signs<QD>(x, qc * QD);
    }
    if (r < nrow) {
      const int tok = tok0 + r / G;
      T* orow = out + (static_cast<size_t>(qs + tok) * num_q_heads + kvh * G + r % G) * D + qc * QD;
      if (vec) {  // 16-byte stores (see pf_stage_queries_quad)
#pragma unroll
        for (int v = 0; v < QD / 8; ++v) {
          uint4 w;
          w.x = pack_f2<T>(x[8 * v], x[8 * v + 1]);
          w.y = pack_f2<T>(x[8 * v + 2], x[8 * v + 3]);
          w.z = pack_f2<T>(x[8 * v + 4], x[8 * v + 5]);
          w.w = pack_f2<T>(x[8 * v + 6], x[8 * v + 7]);
          *reinterpret_cast<uint4*>(orow + 8 * v) = w;
        }
      } else {
#pragma unroll
        for (int j = 0; j < QD; ++j) orow[j] = from_float<T>(x[j]);
      }
    }
  }
}

}  // namespace pf
}  // namespace kvlab

// kvlab — building blocks of the paged-attention kernels (kernels_cu/paged_attention.cu):
// tensor-core mma wrappers, 16-bit packing, and the per-format "tile codecs" that turn
// cache bytes into mma operands in registers.
//
// Why the operands are not plain dequantized values. Every format is read *exactly*:
//   * int4: code c (0..15) -> fp16 bits 0x6400|c = 1024 + c (exact); the zero point and
//     the 1024 are folded into the dot product: q·((c - zp)·s) = s·(q·(1024 + c) - (1024 + zp)·Σq)
//     (SPEC 2.1 read path, in the rotated domain). For V the offset is bf16 0x4300|c = 128 + c
//     and Σ_t P'_t·(128 + zp_t) is subtracted per query column. The decode kernels' Q·K of int4
//     does not use the fp16 operands: it runs on the integer tensor cores with the nibbles as
//     they are stored (ImmaQK below); the prefill kernels use the fp16 form.
//   * int8: byte b -> fp16 bits 0x6400|(b ^ 0x80) = 1152 + c (exact), fold 1152·Σq.
//   * fp8 E4M3: K: cvt to fp16 (exact: E4M3 ⊂ fp16); V: bits moved into bf16 as value·2^-120
//     (exact), the 2^120 split between P' (2^64) and the output (2^56).
//   * nvfp4: E2M1 nibble -> fp16 bits (mag << 9 | sign << 15) = value·2^-14 (exact, also the
//     subnormal 0.5), times the group's E4M3 scale ·2^7 in fp16: value·sf·2^-7, exact
//     (≤ 6 significant bits, ≥ 2^-17, fp16 keeps ≥ 7 bits there); ·2^7·global_scale is
//     applied in float32 after the mma.
//   * auto: the model dtype as it is.
// Dot products Q·K run in fp16 for the quantized formats (q is converted per vector with a
// power-of-two prescale so it cannot overflow fp16; fp16 keeps 11 significant bits, more
// than bf16's 8, so a bf16 q converts exactly). P·V runs in bf16 when the per-token V scale
// is folded into P (int4/int8/fp8: P' = P·s_t needs float32's range), in fp16 for nvfp4
// (P in [0, 1]) and in the model dtype for auto.
//
// Permutation freedom. A dot product over d is invariant under any permutation of d applied
// to both operands, so each thread owns *contiguous* bytes of a cache row and the query is
// packed in the matching order (see the DIM maps below). For P·V the output dims are
// permuted instead and unpermuted on the way out.
#pragma once
#include "common.cuh"
#include "hadamard.cuh"
#include <cuda_fp8.h>

// Decode-kernel operand switches (session 14, docs/perf-notes.md "Session 14"):
// KVLAB_DECODE_PACKED_E2M1 (default; -DKVLAB_DECODE_NO_PACKED_E2M1 for A/B): nvfp4 K and V operands
//   through e2m1x8_to_h2x4_scaled. Measured on the H200 (B = 32 × 8k, 32/8, d = 128, same call, two
//   runs each): nvfp4 paged 0.1273 / 0.1276 → 0.1230 / 0.1236 ms (−3.3 %), per_head −2.6 %,
//   batch 1 × 128k −3.3 %.
// KVLAB_E2M1_SELECT (default since session 35; -DKVLAB_NO_E2M1_SELECT for A/B; every kernel that
//   decodes E2M1 words: the decodes and both prefills): e2m1x8_to_h2x4_scaled builds its two byte
//   words with one shared sign mask and two bit-selects (6 instructions a word instead of 7; the
//   words are equal bit for bit). Loops (sm_90 SASS): nvfp4 decode dual ring 2,430 -> 2,347, two per
//   SM 2,705 -> 2,622, d = 256 2,437 -> 2,338; prefill mma 2,142 -> 2,118, wgmma 2,092 -> 2,060.
//   Measured on an H100 only (session 35, call 4): flat within the noise (nvfp4 paged +0.2 / -0.6 /
//   -1.4 us at B = 32 x 8k / 1 x 128k / 64 x 4k), as predicted where the loop is not issue-bound.
// -DKVLAB_DECODE_INT8_V_PRMT (measured, not adopted): int8 V operands as bf16 from the signed byte
//   without I2F, K's byte-bias flip once per word. int8 paged 0.1616 / 0.1609 → 0.1653 / 0.1617 ms:
//   flat, so the decode's int8 rows are not bound by the conversion pipe.
#if !defined(KVLAB_DECODE_NO_PACKED_E2M1) && !defined(KVLAB_DECODE_PACKED_E2M1)
#define KVLAB_DECODE_PACKED_E2M1
#endif
#if defined(KVLAB_DECODE_NO_PACKED_E2M1) && defined(KVLAB_DECODE_PACKED_E2M1)
#error "KVLAB_DECODE_PACKED_E2M1 (default) and KVLAB_DECODE_NO_PACKED_E2M1 exclude each other"
#endif
#if !defined(KVLAB_NO_E2M1_SELECT) && !defined(KVLAB_E2M1_SELECT)
#define KVLAB_E2M1_SELECT
#endif
#if defined(KVLAB_NO_E2M1_SELECT) && defined(KVLAB_E2M1_SELECT)
#error "KVLAB_E2M1_SELECT (default) and KVLAB_NO_E2M1_SELECT exclude each other"
#endif

namespace kvlab {
namespace attn {

enum Fmt : int { AUTO = 0, INT8 = 1, FP8 = 2, INT4 = 3, NVFP4 = 4 };

// ---------------------------------------------------------------- softmax / scaling constants
constexpr float NEG_BIG = -1.0e30f;  // running-max start: exp2(NEG_BIG - NEG_BIG) = 1, no NaN
__device__ __forceinline__ float neg_inf() { return __uint_as_float(0xff800000u); }
// fp8 V operands are value·2^-120 (see the fp8 operand below): P' carries 2^64, the output 2^56.
constexpr float FP8_V_P = 18446744073709551616.0f;   // 2^64
constexpr float FP8_V_OUT = 72057594037927936.0f;    // 2^56

// ---------------------------------------------------------------- mma
// D += A·B, m16n8k16, A row-major 16x16, B col-major 16x8, float32 accumulate.
// Fragments (g = lane/4, c = lane%4): a[0] = (row g, k 2c..2c+1), a[1] = (row g+8, k 2c..),
// a[2] = (row g, k 2c+8..), a[3] = (row g+8, k 2c+8..); b[0] = (k 2c..2c+1, col g),
// b[1] = (k 2c+8.., col g); d[0..1] = (row g, col 2c..2c+1), d[2..3] = (row g+8, col 2c..).
template <typename CT> struct Mma;
template <> struct Mma<__half> {
  static __device__ __forceinline__ void run(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                             uint32_t a3, uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
};
template <> struct Mma<__nv_bfloat16> {
  static __device__ __forceinline__ void run(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                             uint32_t a3, uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
};

// ---------------------------------------------------------------- integer Q·K (int4, int8 decode)
// The decode kernels compute S = Q·K^T of int4 (and, as an option, int8) caches on the
// integer tensor cores: the cache codes are the B operand as they are stored (int8 bytes; int4
// nibbles split into bytes with one mask each), and the query is a 16-bit fixed-point vector
// (per column: q ≈ δ·q̂, δ = max|q| / Q_FIX, q̂ = RN(q/δ) ∈ [-Q_FIX, Q_FIX]) held as two
// signed bytes, q̂ = 256·hi + lo (hi = ⌊(q̂ + 128) / 256⌋ ∈ [-127, 127], lo ∈ [-128, 127]),
// hi limbs in rows g, lo limbs in rows g + 8 of the A operand (imma_dim gives the dim order).
// Products and sums are exact in int32 (|Σ q̂·c| ≤ D·Q_FIX·128 = 1.07e9 < 2^31 at D = 256 for
// int8, ·15 for int4), so the only rounding of Q·K is q → q̂ (error ≤ δ/2 per
// element, i.e. 2^-16 of the column's largest element; fp16 operands round each element to
// 2^-12 of itself) and the float32 conversion of the integer sum. int4's zero point is exact
// too: Σ q̂·(c − z) = Σ q̂·c − z·Σ q̂, all integers.
// On by default for int4 (measured faster on the H200, docs/perf-notes.md session 5);
// -DKVLAB_DECODE_FP16_QK turns it off, -DKVLAB_DECODE_IMMA_INT8 turns it on for int8.
template <int FMT> struct ImmaQK {
#ifdef KVLAB_DECODE_FP16_QK
  static constexpr bool value = false;
#elif defined(KVLAB_DECODE_IMMA_INT8)
  static constexpr bool value = (FMT == INT4 || FMT == INT8);
#else
  static constexpr bool value = (FMT == INT4);
#endif
};
constexpr float Q_FIX = 32639.0f;   // ⌊(Q_FIX + 128) / 256⌋ = 127: hi fits a signed byte

// D += A·B, m16n8k32, A s8 row-major 16x32, B col-major 32x8 of u8 (BU: int4 nibbles) or s8
// (int8 codes), int32 accumulate. Fragments (g = lane/4, c = lane%4): a[0] = (row g, k 4c..4c+3),
// a[1] = (row g+8, k 4c..), a[2] = (row g, k 16+4c..), a[3] = (row g+8, k 16+4c..), byte i of a
// register = k + i; b[0] = (k 4c..4c+3, col g), b[1] = (k 16+4c.., col g); d as Mma.
template <bool BU>
__device__ __forceinline__ void imma_s8(int (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                        uint32_t b0, uint32_t b1) {
  if constexpr (BU) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.u8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}

// Dim of k-index 4c + i (h = 0) or 16 + 4c + i (h = 1) of k-step s (32 dims) in the integer
// Q·K, for the words thread c owns (RowWords: row words c, c+4, …): int4 word s of the thread,
// even nibbles (h = 0, `w & 0x0F0F0F0F`) and odd nibbles (h = 1, `(w >> 4) & 0x0F0F0F0F`);
// int8 the thread's words 2s (h = 0) and 2s + 1 (h = 1) as they are.
template <int FMT>
__device__ __forceinline__ int imma_dim(int c, int s, int h, int i) {
  static_assert(FMT == INT4 || FMT == INT8, "integer Q·K: int4, int8");
  if constexpr (FMT == INT4) return 8 * (c + 4 * s) + 2 * i + h;
  else return 4 * (c + 4 * (2 * s + h)) + i;
}

// The A registers of the integer Q·K for column row `qrow` (16-bit entries hi << 8 | lo as
// stage_query_column writes them) and thread c: k-step s -> qa[2s][0] (hi, h = 0),
// qa[2s][1] (lo, h = 0), qa[2s + 1][0] (hi, h = 1), qa[2s + 1][1] (lo, h = 1).
template <int FMT, int D>
__device__ __forceinline__ void imma_query_regs(const uint16_t* qrow, int c, uint32_t (&qa)[D / 16][2]) {
#pragma unroll
  for (int s = 0; s < D / 32; ++s)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      uint32_t hi = 0u, lo = 0u;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint32_t v = qrow[imma_dim<FMT>(c, s, h, i)];
        hi |= (v >> 8) << (8 * i);
        lo |= (v & 0xFFu) << (8 * i);
      }
      qa[2 * s + h][0] = hi;
      qa[2 * s + h][1] = lo;
    }
}

// ---------------------------------------------------------------- 16-bit packing
template <typename CT> __device__ __forceinline__ uint16_t bits16(float x);
template <> __device__ __forceinline__ uint16_t bits16<__half>(float x) {
  return __half_as_ushort(__float2half_rn(x));
}
template <> __device__ __forceinline__ uint16_t bits16<__nv_bfloat16>(float x) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(x));
}
template <typename CT> __device__ __forceinline__ float from_bits16(uint16_t b);
template <> __device__ __forceinline__ float from_bits16<__half>(uint16_t b) {
  return __half2float(__ushort_as_half(b));
}
template <> __device__ __forceinline__ float from_bits16<__nv_bfloat16>(uint16_t b) {
  return __bfloat162float(__ushort_as_bfloat16(b));
}
__device__ __forceinline__ uint32_t pack2(uint16_t lo, uint16_t hi) {
  return static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
}
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  return __byte_perm(a, b, sel);
}

// Two E4M3 bytes (low 16 bits of x, first element in the low byte) -> fp16x2 bits, exact.
__device__ __forceinline__ uint32_t e4m3x2_to_h2(uint32_t x) {
  __half2_raw r = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(x & 0xFFFFu),
                                             __NV_E4M3);
  return static_cast<uint32_t>(r.x) | (static_cast<uint32_t>(r.y) << 16);
}

// Two E4M3 bytes (low 16 bits of x) -> fp16x2 bits of their values·2^7 (the nvfp4 group scales
// of the decode operands, "sf·2^7"): the cvt and the fp16 product are exact (|sf| ≤ 448, so
// |sf·2^7| ≤ 57344 < 65504; E4M3's subnormals m·2^-9 are fp16 normals), so each half equals
// the float32 path bits16<__half>(e4m3_to_float(b) * 128.f) bit for bit (NaN stays NaN).
__device__ __forceinline__ uint32_t e4m3x2_to_h2_x128(uint32_t x) {
  uint32_t h = e4m3x2_to_h2(x);
  const uint32_t k128 = 0x58005800u;   // fp16x2 (128, 128)
  const __half2 r = __hmul2(*reinterpret_cast<const __half2*>(&h), *reinterpret_cast<const __half2*>(&k128));
  return *reinterpret_cast<const uint32_t*>(&r);
}
// (lo, lo) / (hi, hi) of an fp16x2 word: the group scale pair of a K operand (both halves of a
// K word belong to one token and one group)
__device__ __forceinline__ uint32_t h2_bcast_lo(uint32_t x) {
  const __half2 r = __low2half2(*reinterpret_cast<const __half2*>(&x));
  return *reinterpret_cast<const uint32_t*>(&r);
}
__device__ __forceinline__ uint32_t h2_bcast_hi(uint32_t x) {
  const __half2 r = __high2half2(*reinterpret_cast<const __half2*>(&x));
  return *reinterpret_cast<const uint32_t*>(&r);
}

// One E4M3 byte -> float (exact).
__device__ __forceinline__ float e4m3_to_float(uint32_t byte) {
  __half_raw r = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(byte & 0xFFu), __NV_E4M3);
  return __half2float(__half(r));
}

// E2M1 nibbles at bits [s, s+4) and [s+16, s+20) of w -> fp16x2 bits of value·2^-14
// (exact, the subnormal 0.5 included): magnitude to bits 9..11, sign to bit 15.
template <int S>
__device__ __forceinline__ uint32_t e2m1x2_to_h2_scaled(uint32_t w) {
  const uint32_t mag = (S <= 9 ? (w << (9 - S)) : (w >> (S - 9))) & 0x0E000E00u;
  const uint32_t sgn = (S <= 12 ? (w << (12 - S)) : (w >> (S - 12))) & 0x80008000u;
  return mag | sgn;
}

// All 8 E2M1 nibbles of w at once -> the same four fp16x2 words as e2m1x2_to_h2_scaled<0, 4, 8, 12>
// (h[i] = nibbles i and i + 4). The fp16 of value·2^-14 has a zero low byte and the high byte
// hb(n) = (n & 7) << 1 | (n & 8) << 4, so the high bytes of the four even nibbles (E) and of the
// four odd ones (O) are built byte-parallel and then moved into place by PRMT: 6 logic / shift
// instructions + 4 PRMT instead of 15 (tests/test_packed_decode_bits.py emulates it exhaustively
// per nibble).
// KVLAB_E2M1_SELECT: s = w & 0x88888888 holds every nibble's sign (bits 3 and 7 of each byte).
// E = select(0x0E0E0E0E ? w << 1 : s << 4): bits 1-3 of a byte take the even nibble's magnitude,
// the others s << 4, which is the even nibble's sign at bit 7 and zero at bits 0, 4-6.
// O = select(0x0E0E0E0E ? w >> 3 : s): the odd nibble's magnitude, its sign already at bit 7.
// Written in PTX: from C, the compiler proves (s << 4) & ~mask == (w << 4) & 0x80808080 and
// rebuilds the 7-instruction form, losing the shared s.
__device__ __forceinline__ void e2m1x8_to_h2x4_scaled(uint32_t w, uint32_t (&h)[4]) {
#if defined(KVLAB_E2M1_SELECT)
  uint32_t e, o;  // bytes: e = hb(n0, n2, n4, n6), o = hb(n1, n3, n5, n7); lop3 0xE4 = c ? a : b
  asm("{\n\t.reg .b32 s, t, u, v;\n\t"
      "and.b32 s, %2, 0x88888888;\n\t"
      "shl.b32 t, %2, 1;\n\t"
      "shl.b32 u, s, 4;\n\t"
      "shr.b32 v, %2, 3;\n\t"
      "lop3.b32 %0, t, u, 0x0E0E0E0E, 0xE4;\n\t"
      "lop3.b32 %1, v, s, 0x0E0E0E0E, 0xE4;\n\t}"
      : "=r"(e), "=r"(o) : "r"(w));
#else
  const uint32_t e = ((w << 1) & 0x0E0E0E0Eu) | ((w << 4) & 0x80808080u);  // bytes: hb(n0, n2, n4, n6)
  const uint32_t o = ((w >> 3) & 0x0E0E0E0Eu) | (w & 0x80808080u);         // bytes: hb(n1, n3, n5, n7)
#endif
  h[0] = prmt(e, 0u, 0x2404u);  // (n0, n4): bytes 0, 2 of e into the high bytes, zeros below
  h[1] = prmt(o, 0u, 0x2404u);  // (n1, n5)
  h[2] = prmt(e, 0u, 0x3414u);  // (n2, n6)
  h[3] = prmt(o, 0u, 0x3414u);  // (n3, n7)
}

// a - b on bf16x2 bits
__device__ __forceinline__ uint32_t bsub2_bits(uint32_t a, uint32_t b) {
  __nv_bfloat162 r = __hsub2(*reinterpret_cast<__nv_bfloat162*>(&a), *reinterpret_cast<__nv_bfloat162*>(&b));
  return *reinterpret_cast<uint32_t*>(&r);
}
__device__ __forceinline__ uint32_t hmul2_bits(uint32_t a, uint32_t b) {
  __half2 r = __hmul2(*reinterpret_cast<__half2*>(&a), *reinterpret_cast<__half2*>(&b));
  return *reinterpret_cast<uint32_t*>(&r);
}

// A 32-bit constant held in a register for the whole kernel: the compiler cannot recompute the
// result of a volatile asm, so it does not rematerialize it (an IMAD.MOV before each use)
// when registers are tight. The int4 nibble masks of the decode tile math (a LOP3 takes one
// immediate; the other constant of `(x & mask) | bias` must come from a register).
template <uint32_t V>
__device__ __forceinline__ uint32_t pinned_u32() {
  // min(V, d | V) = V for any d; with d a special register ptxas cannot see through it (a
  // plain mov of an immediate, or a shuffle of one, is folded back into the uses)
  uint32_t r;
  asm volatile("{ .reg .u32 t; mov.u32 t, %%dynamic_smem_size; or.b32 t, t, %1; min.u32 %0, t, %1; }"
               : "=r"(r) : "n"(V));
  return r;
}

// ---------------------------------------------------------------- loads
// NBYTES bytes at p (aligned to ALIGN) into 32-bit words; zeros when !pred.
template <int NBYTES, int ALIGN>
__device__ __forceinline__ void load_words(const uint8_t* p, uint32_t* w, bool pred) {
  static_assert(NBYTES % 4 == 0, "rows are made of 32-bit words");
  constexpr int VB = (ALIGN >= 16 && NBYTES % 16 == 0) ? 16 : (ALIGN >= 8 && NBYTES % 8 == 0) ? 8 : 4;
  if (pred) {
#pragma unroll
    for (int i = 0; i < NBYTES / VB; ++i) {
      if constexpr (VB == 16) {
        uint4 v = __ldg(reinterpret_cast<const uint4*>(p) + i);
        w[4 * i] = v.x; w[4 * i + 1] = v.y; w[4 * i + 2] = v.z; w[4 * i + 3] = v.w;
      } else if constexpr (VB == 8) {
        uint2 v = __ldg(reinterpret_cast<const uint2*>(p) + i);
        w[2 * i] = v.x; w[2 * i + 1] = v.y;
      } else {
        w[i] = __ldg(reinterpret_cast<const unsigned int*>(p) + i);
      }
    }
  } else {
#pragma unroll
    for (int i = 0; i < NBYTES / 4; ++i) w[i] = 0u;
  }
}

// NW words at p, p + STRIDE, p + 2·STRIDE, … (global memory, 4-byte aligned) into w; zeros
// when !pred. The interleaved rows of int4/int8 (RowWords).
template <int NW, int STRIDE>
__device__ __forceinline__ void load_words_strided(const uint8_t* p, uint32_t* w, bool pred) {
#pragma unroll
  for (int i = 0; i < NW; ++i) w[i] = pred ? __ldg(reinterpret_cast<const unsigned int*>(p + i * STRIDE)) : 0u;
}

// ---------------------------------------------------------------- cp.async (sm_80+)
// Groups of cp.async copies (the prefill kernel's cp_async16_zfill): commit after issuing a
// stage, wait until at most N are pending.
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// NBYTES bytes at p in *shared* memory (aligned to ALIGN) into 32-bit words; zeros when !pred.
template <int NBYTES, int ALIGN>
__device__ __forceinline__ void smem_words(const uint8_t* p, uint32_t* w, bool pred) {
  static_assert(NBYTES % 4 == 0, "rows are made of 32-bit words");
  constexpr int VB = (ALIGN >= 16 && NBYTES % 16 == 0) ? 16 : (ALIGN >= 8 && NBYTES % 8 == 0) ? 8 : 4;
#pragma unroll
  for (int i = 0; i < NBYTES / VB; ++i) {
    if constexpr (VB == 16) {
      const uint4 v = reinterpret_cast<const uint4*>(p)[i];
      w[4 * i] = pred ? v.x : 0u; w[4 * i + 1] = pred ? v.y : 0u;
      w[4 * i + 2] = pred ? v.z : 0u; w[4 * i + 3] = pred ? v.w : 0u;
    } else if constexpr (VB == 8) {
      const uint2 v = reinterpret_cast<const uint2*>(p)[i];
      w[2 * i] = pred ? v.x : 0u; w[2 * i + 1] = pred ? v.y : 0u;
    } else {
      const uint32_t v = reinterpret_cast<const uint32_t*>(p)[i];
      w[i] = pred ? v : 0u;
    }
  }
}

// NW words of an interleaved row in shared memory (word i at base + off[i]) into w in order,
// read in the order i + o (o = 0 or 1, per lane; off[i] is the offset of word (i + o) mod NW,
// precomputed) and put back in order with one select stage. The paged decode kernel gives the
// two lanes whose K rows share banks different o (paged_attention.cu, paged kernel prologue),
// so that no word load of a warp has a bank conflict. base is warp-uniform: the K rows g and
// g + 8 share the per-lane offsets.
template <int NW>
__device__ __forceinline__ void smem_words_rot1(const uint8_t* base, const uint32_t (&off)[NW], bool pred, int o,
                                                uint32_t (&w)[NW]) {
  uint32_t x[NW];
#pragma unroll
  for (int i = 0; i < NW; ++i) x[i] = *reinterpret_cast<const uint32_t*>(base + off[i]);
#pragma unroll
  for (int j = 0; j < NW; ++j) w[j] = pred ? (o ? x[(j + NW - 1) % NW] : x[j]) : 0u;
}

// NW words at p, p + STRIDE, … (shared memory, 4-byte aligned) into w; zeros when !pred.
template <int NW, int STRIDE>
__device__ __forceinline__ void smem_words_strided(const uint8_t* p, uint32_t* w, bool pred) {
#pragma unroll
  for (int i = 0; i < NW; ++i) {
    const uint32_t v = *reinterpret_cast<const uint32_t*>(p + i * STRIDE);
    w[i] = pred ? v : 0u;
  }
}

// ---------------------------------------------------------------- format traits
// CT_QK / CT_PV: operand types of the two mma; KB / VB: bytes of a K row a thread owns in
// the Q·K layout (D/4 dims) and of a V row in the P·V layout (D/8 dims).
template <int FMT, int D, typename T> struct Traits;

template <int D, typename T> struct Traits<AUTO, D, T> {
  using CT_QK = T; using CT_PV = T;
  static constexpr int KB = D / 2, VB = D / 4, ALIGN = 16;
  static constexpr int ROW = 2 * D;  // bytes per (token, head) row
};
template <int D, typename T> struct Traits<INT8, D, T> {
  using CT_QK = __half; using CT_PV = __nv_bfloat16;
  static constexpr int KB = D / 4, VB = D / 8, ALIGN = 4, ROW = D + 4;
};
template <int D, typename T> struct Traits<FP8, D, T> {
  using CT_QK = __half; using CT_PV = __nv_bfloat16;
  static constexpr int KB = D / 4, VB = D / 8, ALIGN = 4, ROW = D + 4;
};
template <int D, typename T> struct Traits<INT4, D, T> {
  using CT_QK = __half; using CT_PV = __nv_bfloat16;
  static constexpr int KB = D / 8, VB = D / 16, ALIGN = 4, ROW = D / 2 + 4;
};
template <int D, typename T> struct Traits<NVFP4, D, T> {
  using CT_QK = __half; using CT_PV = __half;
  static constexpr int KB = D / 8, VB = D / 16, ALIGN = 16, ROW = D / 2 + D / 16;
};

// Dim owned by thread c (lane % 4) for chunk kk (16 dims of the Q·K reduction), pair p
// (0: k = 2c..2c+1, 1: k = 2c+8..2c+9) and half h (low/high 16 bits of the register).
// int4/int8/fp8 (word-aligned rows, INTERLEAVED): thread c owns the row's words c, c+4, c+8, …
// (word w of the thread = row word c + 4w), so that the 4 threads of a quad read 16
// consecutive bytes per load and, in the decode kernels' shared-memory stages, the rows of a
// warp's 8 K tokens spread over all 32 banks (see head_offsets in paged_attention.cu).
// nvfp4, auto: thread c owns D/4 consecutive dims.
// fp8 history: session 4 measured the interleave 4–5 % slower in the paged kernel of the time
// (which then read rows from global memory) and 4 % faster in the per-head one, so fp8 read
// consecutive bytes. Since the paged kernel stages tiles in shared memory, those consecutive
// bytes are an 8-way bank conflict on every K word and 4-way on every V word at 8 KV heads
// (token stride 8·132 bytes ≡ 8 banks): Nsight Compute, session 20, B = 32 × 8k: 21.2 M
// conflicts per launch (161 extra wavefronts per tile; int8 0.2 M), LDS the top stall (mio
// throttle 18.9 % of samples). So fp8 is interleaved as int8 (docs/perf-notes.md "Session 20");
// -DKVLAB_DECODE_FP8_CONTIGUOUS builds the consecutive layout for A/B.
#if defined(KVLAB_DECODE_FP8_CONTIGUOUS)
constexpr bool FP8_INTERLEAVED = false;
#else
constexpr bool FP8_INTERLEAVED = true;
#endif
template <int FMT> struct RowWords {
  static constexpr bool INTERLEAVED = (FMT == INT4 || FMT == INT8 || (FMT == FP8 && FP8_INTERLEAVED));
};
template <int FMT, int D>
__device__ __forceinline__ int qk_dim(int c, int kk, int p, int h) {
  constexpr int KW = D / 32 * ((FMT == INT4 || FMT == NVFP4) ? 1 : 2);   // words of a thread
  if constexpr (FMT == INT4 || FMT == NVFP4) {
    // nibbles (i, i+4) of the thread's word kk >> 1
    const int word = (FMT == INT4) ? c + 4 * (kk >> 1) : c * KW + (kk >> 1);
    return 8 * word + 2 * (kk & 1) + p + 4 * h;
  } else if constexpr (FMT == INT8) {
    return 4 * (c + 4 * kk) + p + 2 * h;  // bytes (p, p+2) of the thread's word kk
  } else if constexpr (FMT == FP8 && RowWords<FMT>::INTERLEAVED) {
    return 4 * (c + 4 * kk) + 2 * p + h;  // bytes (2p, 2p+1) of the thread's word kk (row word c + 4kk)
  } else {
    return c * (D / 4) + 4 * kk + 2 * p + h;  // fp8 (consecutive): bytes (2p, 2p+1) of word kk; auto: pair 2kk+p
  }
}

// Output dim of the P·V layout: local dim l (0 .. D/8-1) of thread g (lane / 4), the layout of
// v_operand: int4/nvfp4 nibble l & 7 of the thread's V word l >> 3, int8/fp8 byte l & 3 of word
// l >> 2, auto element l; int4/int8/fp8 V words are interleaved as the K words (thread g owns
// row words g, g+8, …), nvfp4/auto own D/8 consecutive dims.
template <int FMT, int D>
__device__ __forceinline__ int pv_dim(int g, int l) {
  if constexpr (FMT == INT4) return 8 * (g + 8 * (l >> 3)) + (l & 7);
  else if constexpr (FMT == INT8 || (FMT == FP8 && RowWords<FMT>::INTERLEAVED))
    return 4 * (g + 8 * (l >> 2)) + (l & 3);
  else return g * (D / 8) + l;
}

// Q·K operand: registers of chunk kk, pair p, from the thread's K row words kw
// (KB bytes starting at byte c·KB of the row's code part); nvfp4 also needs the scale
// pair `sf2` (fp16x2 of sf·2^7, both halves equal) of the word's group.
template <int FMT, int D>
__device__ __forceinline__ uint32_t k_operand(const uint32_t* kw, int kk, int p, uint32_t sf2) {
  if constexpr (FMT == INT4) {
    const uint32_t w = kw[kk >> 1];
    const int i = 2 * (kk & 1) + p;
    return ((w >> (4 * i)) & 0x000F000Fu) | 0x64006400u;
  } else if constexpr (FMT == NVFP4) {
    const uint32_t w = kw[kk >> 1];
    const int i = 2 * (kk & 1) + p;
    uint32_t v;
#if defined(KVLAB_DECODE_PACKED_E2M1)
    uint32_t h[4];
    e2m1x8_to_h2x4_scaled(w, h);  // the four calls of one word share the byte-parallel part
    v = h[i];
#else
    if (i == 0) v = e2m1x2_to_h2_scaled<0>(w);
    else if (i == 1) v = e2m1x2_to_h2_scaled<4>(w);
    else if (i == 2) v = e2m1x2_to_h2_scaled<8>(w);
    else v = e2m1x2_to_h2_scaled<12>(w);
#endif
    return hmul2_bits(v, sf2);
  } else if constexpr (FMT == INT8) {
    const uint32_t w = kw[kk];
#if defined(KVLAB_DECODE_INT8_V_PRMT)
    return prmt(w ^ 0x80808080u, 0x64646464u, p ? 0x4341u : 0x4240u);  // one flip per word (CSE)
#else
    return prmt(w, 0x64646464u, p ? 0x4341u : 0x4240u) ^ 0x00800080u;
#endif
  } else if constexpr (FMT == FP8) {
    const uint32_t w = kw[kk];
    return e4m3x2_to_h2(p ? (w >> 16) : w);
  } else {
    return kw[2 * kk + p];
  }
}

// Q·K operand of the decode kernel (paged_attention_decode): as k_operand, except int4,
// which skips half of the shifts. Nibble class i = 2(kk&1)+p of word w = kw[kk>>1] (bits 4i
// and 16+4i, the dims of qk_dim): i = 0: w & 0x000F000F | 0x6400 -> fp16 1024 + n;
// i = 1: w & 0x00F000F0 | 0x5400 -> fp16 64 + n (the nibble sits at mantissa bits 4..7 of an
// fp16 with exponent 2^6, ulp 1/16: exact); i = 2, 3: the same on w >> 8. So the offset of a
// dim is qk_offset(d) = 1024 (d even) or 64 (d odd), folded as Σ_d q_d·off_d per column.
// mlo / mhi: the masks 0x000F000F / 0x00F000F0 (parameters so that a caller can hold them in
// registers: a LOP3 takes one immediate, the other constant needs a register).
template <int FMT, int D>
__device__ __forceinline__ uint32_t k_operand_fast(const uint32_t* kw, int kk, int p, uint32_t sf2,
                                                   uint32_t mlo, uint32_t mhi) {
  if constexpr (FMT == INT4) {
    const uint32_t w = kw[kk >> 1];
    const uint32_t x = (kk & 1) ? (w >> 8) : w;
    return p ? ((x & mhi) | 0x54005400u) : ((x & mlo) | 0x64006400u);
  } else {
    return k_operand<FMT, D>(kw, kk, p, sf2);
  }
}

// Offset of dim d in the operands of k_operand_fast: q·K_operand = q·(off_d + code_d).
template <int FMT>
__device__ __forceinline__ float qk_offset(int d) {
  if constexpr (FMT == INT4) return (d & 1) ? 64.f : 1024.f;
  else if constexpr (FMT == INT8) return 1152.f;
  else return 0.f;
}

// Two floats -> the packed 16-bit pair of the mma operand type (lo in bits 0..15), one cvt,
// round to nearest. Used by the decode and the prefill kernels.
template <typename CT> __device__ __forceinline__ uint32_t pack_f2(float lo, float hi);
template <> __device__ __forceinline__ uint32_t pack_f2<__half>(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}
template <> __device__ __forceinline__ uint32_t pack_f2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

// 2^x on the SFU (MUFU.EX2 of ex2.approx, ~2 ulp; flushes subnormal results to 0;
// ex2(-inf) = 0). Used by the decode and the prefill kernels.
__device__ __forceinline__ float ex2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// ---------------------------------------------------------------- nvfp4 V-scale swizzle
// Where the V scale of (token t, group grp) sits in a tile's scale part: token ts, byte gs
// (S = D/16 scales per row). SPEC 2.3 swizzle (vLLM SM100 order) when `swizzle`: tokens
// within groups of 4, so tiles and chunks that start at a multiple of 16 (4) swizzle locally
// (t relative to the tile). Decode (both kernels) and prefill.
template <int S>
__device__ __forceinline__ void v_scale_pos(int t, int grp, bool swizzle, int& ts, int& gs) {
  ts = t; gs = grp;
  if (swizzle) {
    constexpr int QQ = S / 4;
    ts = (t / 4) * 4 + grp / QQ;
    gs = (grp % QQ) * 4 + t % 4;
  }
}

// ---------------------------------------------------------------- query prologue
// One query vector (query token row qtok = query_start_loc + token, head qhead), read by one
// warp into x (E = D/32 consecutive elements per lane; zeros where !valid, a padding column
// or row), rotated for int4 (RHT, hadamard.cuh: K and V live in the rotated domain). Returns
// the prescale `pre`: the caller rounds x[j]·pre to the Q·K operand type and divides the
// softmax scale by it. Shared by the decode (stage_query_column) and prefill prologues.
// query_vector_prescale is the part after the loads (a caller that batches the loads of
// several rows calls it directly: pf_stage_queries).
template <int FMT, int D>
__device__ __forceinline__ float query_vector_prescale(float (&x)[D / 32], int lane) {
  constexpr int E = D / 32;
  if constexpr (FMT == INT4) rht_group<E, 32>(x, lane);
  float amax = 0.f;
#pragma unroll
  for (int j = 0; j < E; ++j) amax = fmaxf(amax, fabsf(x[j]));
  amax = warp_max(amax);
  float pre = 1.f;
  if constexpr (FMT != AUTO) {
    // fp16 operands (every quantized format's CT_QK): scale by 2^-e so that |q| < 2^15
    // (fp16 max 65504); exact.
    const int ex = static_cast<int>((__float_as_uint(amax) >> 23) & 0xFF) - 127;
    pre = ex > 14 ? __uint_as_float(static_cast<uint32_t>(127 - (ex - 14)) << 23) : 1.f;
  }
  return pre;
}

template <int FMT, int D, typename T>
__device__ __forceinline__ float load_query_vector(const T* __restrict__ q, bool valid, int qtok,
                                                   int num_q_heads, int qhead, int lane,
                                                   float (&x)[D / 32]) {
  constexpr int E = D / 32;
  if (valid) {
    const T* qr = q + (static_cast<size_t>(qtok) * num_q_heads + qhead) * D + lane * E;
#pragma unroll
    for (int j = 0; j < E; ++j) x[j] = to_float(qr[j]);
  } else {
#pragma unroll
    for (int j = 0; j < E; ++j) x[j] = 0.f;
  }
  return query_vector_prescale<FMT, D>(x, lane);
}

// P·V operand for m-tile j (output dims g·D/8 + 2j + r, r = 0 for rows g, 1 for rows g+8)
// from the words of two tokens (ta in the low half, tb in the high half).
// The thread's V row bytes: VB bytes from byte g·VB of the row's code part.
template <int FMT, int D>
__device__ __forceinline__ uint32_t v_operand(const uint32_t* wa, const uint32_t* wb, int l,
                                              uint32_t sf2) {
  // l = local dim index 0 .. D/8-1
  if constexpr (FMT == INT4 || FMT == NVFP4) {
    const int m = l >> 3, i = l & 7;
    const uint32_t z = prmt(wa[m], wb[m], i < 4 ? 0x5410u : 0x7632u);
    const int s = 4 * (i & 3);
    if constexpr (FMT == INT4) {
      return ((z >> s) & 0x000F000Fu) | 0x43004300u;  // bf16 128 + c
    } else {
      uint32_t v;
#if defined(KVLAB_DECODE_PACKED_E2M1)
      uint32_t h[4];
      e2m1x8_to_h2x4_scaled(z, h);
      v = h[s >> 2];
#else
      if (s == 0) v = e2m1x2_to_h2_scaled<0>(z);
      else if (s == 4) v = e2m1x2_to_h2_scaled<4>(z);
      else if (s == 8) v = e2m1x2_to_h2_scaled<8>(z);
      else v = e2m1x2_to_h2_scaled<12>(z);
#endif
      return hmul2_bits(v, sf2);
    }
  } else if constexpr (FMT == INT8) {
    const int m = l >> 2, i = l & 3;
#if defined(KVLAB_DECODE_INT8_V_PRMT)
    // byte i of wa -> byte 0, of wb -> byte 2; bf16 0x43 above (b & 0x7F) = 128 + (b & 0x7F) minus
    // bf16 0x43 above (b & 0x80) = 128 or 256 is the signed byte, exact (PRMT, 2 LOP3, HSUB2
    // instead of two I2F, a quarter-rate conversion, and an F2FP)
    const uint32_t z = prmt(wa[m], wb[m], static_cast<uint32_t>(i | ((4 + i) << 8)));
    return bsub2_bits((z & 0x007F007Fu) | 0x43004300u, (z & 0x00800080u) | 0x43004300u);
#else
    // sign-extend byte i of each word, exact float, pack to bf16x2
    const int ca = static_cast<int>(static_cast<signed char>((wa[m] >> (8 * i)) & 0xFFu));
    const int cb = static_cast<int>(static_cast<signed char>((wb[m] >> (8 * i)) & 0xFFu));
    __nv_bfloat162 r = __floats2bfloat162_rn(static_cast<float>(ca), static_cast<float>(cb));
    return *reinterpret_cast<uint32_t*>(&r);
#endif
  } else if constexpr (FMT == FP8) {
    const int m = l >> 2, i = l & 3;
    // E4M3 byte b -> bf16 bits (b & 0x7F) << 4 | sign << 15 = value·2^-120, exact for normal
    // and subnormal codes (the exponent field moves as is; P' carries 2^64, the output 2^56).
    // Bytes (wa.i, wb.i) go to bytes 1 and 3 so that the signs already sit in bits 15 / 31.
    const uint32_t x = prmt(wa[m], wb[m], static_cast<uint32_t>((i << 4) | ((4 + i) << 12)));
    return ((x >> 4) & 0x07F007F0u) | (x & 0x80008000u);
  } else {
    const int m = l >> 1;
    return prmt(wa[m], wb[m], (l & 1) ? 0x7632u : 0x5410u);
  }
}

// v_operand with the int4 mask as a run-time value (see k_operand_fast); other formats as
// v_operand.
template <int FMT, int D>
__device__ __forceinline__ uint32_t v_operand_fast(const uint32_t* wa, const uint32_t* wb, int l,
                                                   uint32_t sf2, uint32_t mlo) {
  if constexpr (FMT == INT4) {
    const int m = l >> 3, i = l & 7;
    const uint32_t z = prmt(wa[m], wb[m], i < 4 ? 0x5410u : 0x7632u);
    const int s = 4 * (i & 3);
    return ((z >> s) & mlo) | 0x43004300u;  // bf16 128 + c
  } else {
    return v_operand<FMT, D>(wa, wb, l, sf2);
  }
}

}  // namespace attn
}  // namespace kvlab

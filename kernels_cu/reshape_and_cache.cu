// kvlab — fused quantize-and-write of K and V into a paged cache, every format, one pass.
// Python op: kvlab/cuda/cache.py. Reference: kvlab/reference/cache.py + kvlab/formats/*.py.
// Measurements and the reasoning behind the instruction-level choices: docs/perf-notes.md.
//
// One lane group owns one (token, head) and writes both its K and its V row: all loads are
// issued before any math and each cache byte is written once. Per (token, head) at d = 128,
// bf16 in: reads 2·256 bytes, writes 2·row bytes (auto 256, int8/fp8 132, int4 68, nvfp4 72).
// Consecutive groups are consecutive heads of one token, so K/V reads and cache-row writes are
// contiguous across a warp.
//   auto, int8, fp8: WriteGeometry — four 16-byte chunks per lane, interleaved over the group
//         (bf16 d=128: 4 lanes × 32 elements), so the per-thread index work, the per-vector
//         scale work and the absmax shuffles are spread over 64 elements per thread (K and V).
//   nvfp4: WriteGeometry — two contiguous 16-element scale groups per lane (bf16 d=128:
//         4 lanes), group amax without shuffles.
//   int4: Int4Geometry — up to 32 elements per lane as 16-byte chunks (bf16 d=128: 4 lanes ×
//         4 chunks), so the RHT runs mostly in registers (wht_chunked: 2 shuffle stages).
//         16-bit input at d = 128 (the default, "MMA8"): the same geometry, 8 rows per warp, the
//         RHT's H_16 stage on tensor cores with two groups of a row per mma (rht_mma8_row,
//         int4_write_mma.cuh), then H_8 in registers; 80 registers. Measured on the H200: 0.74
//         of copy against 0.60 for the all-CUDA-core path (docs/perf-notes.md, session 5), which
//         -DKVLAB_INT4_WRITE_CUDA_CORES keeps for A/B. -DKVLAB_INT4_WRITE_MMA (experiment,
//         16-bit input, d = 64 and 128, measured slower: 0.56): a warp per 16 rows
//         (reshape_and_cache_int4_mma). docs/notes-int4-write-mma.md. MMA8's tail is the lean
//         one since session 7 (quantize_store_int4_lean, H200 65,536 tok x 8 heads x 128 bf16:
//         0.1060 vs 0.1122 ms); -DKVLAB_INT4_WRITE_PLAIN_TAIL builds the previous one for A/B.
//         The lean write's index math is LEAN2 since session 8: float-reciprocal divisions for
//         the token/head and block/slot indices and a cheaper zero point, the same bytes (H200,
//         same call: 0.1036 / 0.1038 ms = 0.81 of copy vs 0.1057 / 0.1054 ms = 0.79, predicted
//         0.101 ms); -DKVLAB_INT4_WRITE_DIV64 builds session 7's (C++ 64-bit divisions,
//         copysign zero point) for A/B.
// At these sizes the kernels are limited by instruction issue, not by DRAM (134 M elements at
// ~0.1 ms leave ~20 issue slots per element), hence: no float->int conversions (exact magic
// adds instead), no per-element IEEE division (nvfp4: a 2-instruction exact division by an
// E4M3 divisor at global scale 1, Markstein's correction otherwise), hardware E4M3 conversion
// on sm_89+, absmax on packed bf16x2/f16x2 raw words, signs XORed into the raw loads (int4) or
// gathered from the raw sign bits (int8, nvfp4), codes packed with shift-adds of biased values.
//
// Skipped tokens (slot < 0) load and encode their input like the others (the loads do not wait
// for the slot: load_kv_chunks) but store nothing; the grid tail runs on zeros (the shuffles
// need every lane) and loads nothing. Cache rows of skipped tokens are untouched.
//
// Bit-exactness vs the reference: every rounding step of the formats is done with the same
// float32 operation or an exactly equivalent one (quant_formats.cuh, fp_codecs.cuh, and the
// proofs next to int8_code_pair, e2m1_code_biased, nvfp4_div_e4m3). The one difference is the
// int4 RHT: the reference sums in float64 and rounds to the input dtype, the kernel sums in
// float32 and rounds to the input dtype; the two agree unless the float32 sum is off by an ulp
// right at a rounding tie of the (8- or 11-bit) input dtype — rare, and counted by
// tests/gpu/test_reshape_and_cache_gpu.py. For float32 inputs the rotated vector itself is
// float32, so there last-bit differences are common and the test bounds codes to ±1 and scales
// to float32 rounding.
//
// NaN/Inf inputs follow the rule of kvlab/formats/base.py, as the reference does: a vector
// with any non-finite element is written as the format's invalid row (codes 0, NaN scale);
// auto copies the input bytes as given. int8/fp8/nvfp4 detect it from a NaN-propagating absmax.
// int4: a rotated value beyond the input dtype's finite range saturates at ± its max, as in the
// reference (finite input, e.g. fp16 whose rotation exceeds 65504, or bf16 near its max whose
// float32 rotation overflows); only a non-finite *input* gives the invalid row. The common path
// flags lanes with a non-finite rounded value; their groups take a rare path that re-reads the
// inputs and either writes the invalid row or redoes the rotation on x·2^-10 and saturates
// (encode_store_int4).
#include "common.cuh"
#include "fp_codecs.cuh"
#include "hadamard.cuh"
// int4 write variant: MMA8 unless the CUDA-core path or the 16-row experiment is asked for
// (-DKVLAB_INT4_WRITE_MMA8, the session-5 A/B name of the default, is accepted as well)
#if (defined(KVLAB_INT4_WRITE_MMA) + defined(KVLAB_INT4_WRITE_CUDA_CORES) + defined(KVLAB_INT4_WRITE_MMA8)) > 1
#error "KVLAB_INT4_WRITE_MMA, KVLAB_INT4_WRITE_CUDA_CORES, KVLAB_INT4_WRITE_MMA8: one int4 write variant at a time"
#endif
#if !defined(KVLAB_INT4_WRITE_MMA) && !defined(KVLAB_INT4_WRITE_CUDA_CORES) && !defined(KVLAB_INT4_WRITE_MMA8)
#define KVLAB_INT4_WRITE_MMA8
#endif
// MMA8's tail: the lean one (quantize_store_int4_lean, session 7) unless
// -DKVLAB_INT4_WRITE_PLAIN_TAIL asks for the previous one (quantize_store_int4, for A/B);
// -DKVLAB_INT4_WRITE_LEAN, its session-7 A/B name, is accepted as well.
#if (defined(KVLAB_INT4_WRITE_LEAN) || defined(KVLAB_INT4_WRITE_PLAIN_TAIL)) && !defined(KVLAB_INT4_WRITE_MMA8)
#error "KVLAB_INT4_WRITE_LEAN / _PLAIN_TAIL choose the MMA8 write's tail: not with KVLAB_INT4_WRITE_MMA / _CUDA_CORES"
#endif
#if defined(KVLAB_INT4_WRITE_LEAN) && defined(KVLAB_INT4_WRITE_PLAIN_TAIL)
#error "KVLAB_INT4_WRITE_LEAN, KVLAB_INT4_WRITE_PLAIN_TAIL: one MMA8 tail at a time"
#endif
#if defined(KVLAB_INT4_WRITE_MMA8) && !defined(KVLAB_INT4_WRITE_PLAIN_TAIL) && !defined(KVLAB_INT4_WRITE_LEAN)
#define KVLAB_INT4_WRITE_LEAN
#endif
// The lean MMA8 write's index math: LEAN2 (the default since session 8; H200, 65,536 tokens x 8
// heads x 128 bf16, same call: 0.1036 / 0.1038 ms against 0.1057 / 0.1054 ms, 0.81 vs 0.79 of
// copy) — fewer per-thread and per-row instructions (exact float-reciprocal divisions for the
// token/head and block/slot indices, a 32-bit row index, one instruction less in the zero point),
// the same bytes — unless -DKVLAB_INT4_WRITE_DIV64 asks for session 7's (C++ 64-bit divisions,
// the copysign zero point; for A/B). -DKVLAB_INT4_WRITE_LEAN2, its session-8 A/B name, is
// accepted as well. Both choose between two versions of the lean MMA8 write only: with _MMA,
// _CUDA_CORES or _PLAIN_TAIL (whose index math is session 7's already) they are an error, so an
// A/B build cannot be mislabelled.
#if (defined(KVLAB_INT4_WRITE_LEAN2) || defined(KVLAB_INT4_WRITE_DIV64)) && \
    !(defined(KVLAB_INT4_WRITE_MMA8) && defined(KVLAB_INT4_WRITE_LEAN))
#error "KVLAB_INT4_WRITE_LEAN2 / _DIV64 choose the lean MMA8 write's index math: not with _MMA, _CUDA_CORES or _PLAIN_TAIL"
#endif
#if defined(KVLAB_INT4_WRITE_LEAN2) && defined(KVLAB_INT4_WRITE_DIV64)
#error "KVLAB_INT4_WRITE_LEAN2, KVLAB_INT4_WRITE_DIV64: one index math at a time"
#endif
#if defined(KVLAB_INT4_WRITE_MMA8) && defined(KVLAB_INT4_WRITE_LEAN) && !defined(KVLAB_INT4_WRITE_DIV64)
#define KVLAB_INT4_WRITE_LEAN2
#endif
#if defined(KVLAB_INT4_WRITE_MMA) || defined(KVLAB_INT4_WRITE_MMA8)
#include "int4_write_mma.cuh"
#endif
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

// Staged row stores (fp8). A lane group holds its row's code words in an interleaved order
// (lane l: words l·LW + c·CW + k), so a warp store instruction writes 4-byte pieces of 8 rows —
// every 32-byte sector of a row is written by several partial-sector stores. When the warp's
// rows are one contiguous run (all its (token, head) groups active and consecutive heads of
// one token: the usual prefill write with H a multiple of 32/LANES), the words go through
// shared memory instead and each store instruction writes 128 contiguous bytes. Returns false
// (nothing stored) when the rows are not one run: the caller stores directly. Warp-uniform;
// every lane of the warp must call it. ROWW: words per row (codes + scale word); w[j], j =
// c·KPC + k, is word lig·LW + c·CW + k of the row; `tail` is the row's last word (the scale),
// stored by lane 0 of the group. 256 threads per block (cache.py).
// Measured on the H200 (docs/perf-notes.md, write round 3): fp8 0.1315 -> 0.1090 ms (0.76 ->
// 0.92 of copy); int8 and int4 were slower with it (int8 0.1129 -> 0.1320: NVRTC 13.0 gives
// the staged int8 kernel 96 registers, 2 blocks/SM instead of 3), so they store directly.
template <int LANES, int ROWW, int NW, int KPC, int CW>
__device__ __forceinline__ bool staged_row_store(uint8_t* row, bool active, int lig, int LW,
                                                 const uint32_t (&w)[NW], uint32_t tail) {
  constexpr int GPW = 32 / LANES;       // groups (rows) per warp
  constexpr int WW = GPW * ROWW;        // words per warp
  __shared__ uint32_t stage[8][WW];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, gi = lane / LANES;
  const uintptr_t r0 = __shfl_sync(0xffffffffu, reinterpret_cast<uintptr_t>(row), 0);
  const bool run = active && reinterpret_cast<uintptr_t>(row) == r0 + static_cast<uintptr_t>(gi) * (ROWW * 4);
  if (!__all_sync(0xffffffffu, run)) return false;
  uint32_t* st = stage[warp];
  __syncwarp();  // the previous call's reads of this warp's stage are done
#pragma unroll
  for (int j = 0; j < NW; ++j) st[gi * ROWW + lig * LW + (j / KPC) * CW + j % KPC] = w[j];
  if (lig == 0) st[gi * ROWW + ROWW - 1] = tail;
  __syncwarp();
  uint32_t* dst = reinterpret_cast<uint32_t*>(r0);
#pragma unroll
  for (int i = 0; i < (WW + 31) / 32; ++i) {
    const int k = i * 32 + lane;
    if (WW % 32 == 0 || k < WW) dst[k] = st[k];
  }
  return true;
}

// Lane geometry of the row formats (auto, int8, fp8, nvfp4): NC 16-byte chunks of VEC elements per
// lane. auto/int8/fp8: 4 chunks per lane (fewer lanes than 1 impossible, more chunks at d = 512
// fp32 so that LANES <= 32) spread over the group — chunk c of lane l covers elements
// [c·VEC·LANES + l·VEC, … + VEC), so every load and store instruction of the group is
// contiguous; nvfp4: two 16-element scale groups per lane, contiguous (one at d = 16), so the
// group amax needs no shuffle. bf16 d=128: 4 lanes × 32 elements. 64 elements per thread (K and
// V) spread the per-thread index arithmetic and the per-vector scale work thin.
// (kvlab/cuda/cache.py `_write_lanes` mirrors LANES.)
template <int FMT, int D, typename T> struct WriteGeometry {
  static constexpr int VEC = 16 / static_cast<int>(sizeof(T));
  static constexpr int TC = D / VEC;  // 16-byte chunks per row
  static constexpr bool CONTIG = FMT == FMT_NVFP4;
  static constexpr int LANES = CONTIG ? D / (D < 32 ? D : 32) : (TC / 4 > 32 ? 32 : (TC / 4 < 1 ? 1 : TC / 4));
  static constexpr int EPT = D / LANES;
  static constexpr int NC = EPT / VEC;
  static constexpr int CSTRIDE = CONTIG ? VEC : VEC * LANES;  // elements between a lane's chunks
  static constexpr int LSTRIDE = CONTIG ? EPT : VEC;          // elements between lanes
  static_assert(D >= 16 && D <= 512 && (D & (D - 1)) == 0, "head size: power of two in 16..512");
  static_assert(NC >= 1 && NC * VEC == EPT && EPT * LANES == D && LANES <= 32, "lanes tile the row");
};

// PTX prmt.b32 (default mode: a selector nibble with bit 3 set replicates the sign of its byte).
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
}

// int8 codes of the two 16-bit elements of one raw input word (x0, x1 their float values),
// returned in bytes 0 and 2. Reference: clamp(round_half_away(v), -128, 127), v = RN(x·inv);
// the clamp never acts (|v| < 127.5, see int8_code_bits). Exact, with no float->int conversion
// and the signs taken from the raw bits for both elements at once:
//   T = RZ(|v| + 6291712.5): the 0.5-spaced grid of [2^22, 2^23) holds 6291712.5 + |v| rounded
//       down, so bits(T) = 0x4AC00200 + f with f = floor(2|v| + 1) in [1, 255], and
//       m = floor(|v| + 0.5) = f >> 1 (round half away of |v|).
//   Low 16 bits of T: h = 0x200 + f. Positive: (h >> 1) = 0x100 + m, low byte m.
//   Negative: (~h + 2) mod 2^16 = 0xFE01 - f (no carry out of the half: h >= 0x201), and
//       (0xFE01 - f) >> 1 = 0x7F00 - m (f = 2m or 2m + 1), low byte -m mod 256.
//   With both halves packed (P = [h0 | h1 << 16]) and Q = 0xFFFF in the halves of negative
//   elements (prmt sign replication of the raw bf16/fp16 sign bits; v has x's sign since
//   inv > 0, -0 and flushed subnormals included): codes = ((P ^ Q) + (Q & 0x00020002)) >> 1.
// tests/gpu compare every code with the reference; tests/test_write_kernel_emulation.py emulates
// it on every tie k + 0.5, its neighbours and ~1.3 M other values (and ran 28.6 M once).
__device__ __forceinline__ uint32_t int8_code_pair(float x0, float x1, uint32_t raw, float inv) {
  // |v| = RN(|x|·inv) (inv > 0; RN is symmetric)
  const uint32_t t0 = __float_as_uint(__fadd_rz(__fmul_rn(fabsf(x0), inv), 6291712.5f));
  const uint32_t t1 = __float_as_uint(__fadd_rz(__fmul_rn(fabsf(x1), inv), 6291712.5f));
  const uint32_t p = prmt(t0, t1, 0x5410u);
  const uint32_t q = prmt(raw, 0u, 0xBB99u);
  return ((p ^ q) + (q & 0x00020002u)) >> 1;
}

template <typename T> struct IsBf16 { static constexpr bool value = false; };
template <> struct IsBf16<__nv_bfloat16> { static constexpr bool value = true; };

// 16 raw bytes -> VEC floats at x[off …]. bf16 -> float32 is a 16-bit shift (exact), done on the
// raw words: one instruction per element (shift or mask).
template <typename T, int EPT>
__device__ __forceinline__ void raw16_to_float(uint4 raw, float (&x)[EPT], int off) {
  if constexpr (IsBf16<T>::value) {
    const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      x[off + 2 * k] = __uint_as_float(w[k] << 16);
      x[off + 2 * k + 1] = __uint_as_float(w[k] & 0xFFFF0000u);
    }
  } else {
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int j = 0; j < 16 / static_cast<int>(sizeof(T)); ++j) x[off + j] = to_float(e[j]);
  }
}

// E2M1 codes of 8 quotients q[j] = |x_j| / denom (>= 0; +inf saturates), packed (element j at
// bits 4j), with the signs of x_j (sign in bit 3: negative values rounding to zero keep it,
// -0 too). As e2m1_encode_abs (fp_codecs.cuh): within the binade 2^e of max(a, 1), a = min(q,
// 6), e in {0, 1, 2}, the grid step is 2^(e-1), so S = RN(a + 2^(22+e)) (one FMA: 2^e · 2^22
// + a) rounds a to the E2M1 grid with RNE, and bits(S) = ((149 + e) << 23) + k with the
// magnitude code k + 2e. Since bits(S) >> 22 = 298 + 2e,
//   y_j = (bits(S) & 7) + (bits(S) >> 22) = code_j + 298,
// and for j >= 3 the mask is not needed: (149 + e) << (23 + 4j) vanishes modulo 2^32 once
// shifted into place. The 8 biases 298 · 16^j are removed once per word; packing is then one
// shift-add per element. Signs: `sgn` has bit 4j + 3 set for negative x_j (other bits ignored).
// tests/test_write_kernel_emulation.py checks it against the reference codec (every decision
// point and its neighbours, both signs, with and without the saturating min).
constexpr uint32_t E2M1_PACK_BIAS = 298u + (298u << 4) + (298u << 8) + (298u << 12) + (298u << 16) +
                                    (298u << 20) + (298u << 24) + (298u << 28);
// SAT: saturate q at 6 first (needed only for q >= 7: q in [6, 7) rounds to 6 on the grid of
// the binade [4, 8) anyway).
template <bool SAT>
__device__ __forceinline__ uint32_t e2m1_pack8(const float* q, uint32_t sgn) {
  uint32_t acc = 0u - E2M1_PACK_BIAS;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const float a = SAT ? fminf(q[j], 6.0f) : q[j];
    const uint32_t eb = __float_as_uint(fmaxf(a, 1.0f)) & 0x7F800000u;  // 2^e
    const uint32_t S = __float_as_uint(fmaf(__uint_as_float(eb), 4194304.0f, a));
    acc += ((j < 3 ? (S & 7u) : S) + (S >> 22)) << (4 * j);
  }
  return acc | (sgn & 0x88888888u);
}

// Sign bits of 8 16-bit elements held in raw words w0..w3 (element 2k in the low half of w_k),
// at bits 4j + 3 (element j): sign-replicating byte permutes gather the sign bytes, one
// select merges the halves — 6 instructions per 8 elements.
__device__ __forceinline__ uint32_t nibble_signs16(uint32_t w0, uint32_t w1, uint32_t w2, uint32_t w3) {
  const uint32_t p01 = prmt(w0, w1, 0xD9FBu);  // [s1, s3, s0, s2] as 0x00/0xFF bytes
  const uint32_t p23 = prmt(w2, w3, 0xD9FBu);  // [s5, s7, s4, s6]
  const uint32_t odd = prmt(p01, p23, 0x5410u);   // [s1, s3, s5, s7] -> bit 8k + 7
  const uint32_t even = prmt(p01, p23, 0x7632u);  // [s0, s2, s4, s6] -> bit 8k + 3
  return (odd & 0xF0F0F0F0u) | (even & 0x0F0F0F0Fu);
}

// max |x| over the 16-bit elements of raw words w[0 .. N), NaN-propagating (NaN if any element is
// NaN, +inf if any is ±inf), as float32: packed bf16x2/f16x2 max on the raw words (exact: a max
// of representable values), half an instruction per element on sm_86+ (max.NaN.xorsign.abs:
// the magnitudes' max, sign bits garbage and dropped at the end). Subnormal inputs are kept
// (the float32 path flushes them; either way the scale floors make them irrelevant).
template <typename T, int N>
__device__ __forceinline__ float absmax_raw16(const uint32_t (&w)[N]) {
  static_assert(sizeof(T) == 2, "16-bit inputs");
  constexpr bool BF = IsBf16<T>::value;
  uint32_t acc = w[0] & 0x7FFF7FFFu;
#pragma unroll
  for (int i = 1; i < N; ++i) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 860
    if constexpr (BF) asm("max.NaN.xorsign.abs.bf16x2 %0, %1, %2;" : "=r"(acc) : "r"(acc), "r"(w[i]));
    else asm("max.NaN.xorsign.abs.f16x2 %0, %1, %2;" : "=r"(acc) : "r"(acc), "r"(w[i]));
#else
    const uint32_t a = w[i] & 0x7FFF7FFFu;
    if constexpr (BF) asm("max.NaN.bf16x2 %0, %1, %2;" : "=r"(acc) : "r"(acc), "r"(a));
    else asm("max.NaN.f16x2 %0, %1, %2;" : "=r"(acc) : "r"(acc), "r"(a));
#endif
  }
  acc &= 0x7FFF7FFFu;
  float lo, hi;
  if constexpr (BF) {
    lo = __uint_as_float(acc << 16);
    hi = __uint_as_float(acc & 0xFFFF0000u);
  } else {
    lo = __half2float(__ushort_as_half(static_cast<unsigned short>(acc & 0xFFFFu)));
    hi = __half2float(__ushort_as_half(static_cast<unsigned short>(acc >> 16)));
  }
  return fmax_nan(lo, hi);
}

// Quantize one head vector (held by the lane group as G::NC raw 16-byte chunks per lane) and
// store its row. `row` points at the start of the (token, head) row for the row-contiguous
// formats; for nvfp4 `slab` is the (block, side) slab and (t, h) locate the data and scale bytes.
template <int FMT, int D, typename T, bool SWIZZLE>
__device__ __forceinline__ void encode_store(const uint4 (&raw)[WriteGeometry<FMT, D, T>::NC], bool active,
                                             int lig, uint8_t* row, uint8_t* slab, int t, int h, int H,
                                             int block_size, float global_scale) {
  using G = WriteGeometry<FMT, D, T>;
  constexpr int EPT = G::EPT, LANES = G::LANES, VEC = G::VEC, NC = G::NC;
  if constexpr (FMT == FMT_AUTO) {
    // values as given: the raw bytes
    if (active) {
#pragma unroll
      for (int c = 0; c < NC; ++c)
        *reinterpret_cast<uint4*>(row + (c * G::CSTRIDE + lig * G::LSTRIDE) * sizeof(T)) = raw[c];
    }
  } else if constexpr (FMT == FMT_INT8 || FMT == FMT_FP8) {
    // row: d code bytes | float32 scale
    float x[EPT];
#pragma unroll
    for (int c = 0; c < NC; ++c) raw16_to_float<T, EPT>(raw[c], x, c * VEC);
    float amax = 0.0f;
    if constexpr (sizeof(T) == 2) {
      uint32_t wr[4 * NC];
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        wr[4 * c] = raw[c].x; wr[4 * c + 1] = raw[c].y; wr[4 * c + 2] = raw[c].z; wr[4 * c + 3] = raw[c].w;
      }
      amax = absmax_raw16<T>(wr);
    } else {
#pragma unroll
      for (int j = 0; j < EPT; ++j) amax = fmax_nan(amax, fabsf(x[j]));
    }
#pragma unroll
    for (int o = LANES / 2; o > 0; o >>= 1) amax = fmax_nan(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const bool bad = !(amax <= 3.402823466e38f);  // NaN or Inf in the vector
    float scale = per_token_head_scale<FMT>(amax);
    const float inv = __frcp_rn(scale);
    constexpr int KPC = VEC / 4;  // code words per 16-byte input chunk
    uint32_t w[NC * KPC];
#pragma unroll
    for (int c = 0; c < NC; ++c) {
#pragma unroll
      for (int k = 0; k < KPC; ++k) {
        const int e = c * VEC + 4 * k;
        uint32_t code;
        if constexpr (FMT == FMT_INT8 && sizeof(T) == 2) {
          const uint32_t* r = reinterpret_cast<const uint32_t*>(&raw[c]);
          code = prmt(int8_code_pair(x[e], x[e + 1], r[2 * k], inv),
                      int8_code_pair(x[e + 2], x[e + 3], r[2 * k + 1], inv), 0x6420u);
        } else {
          code = per_token_head_encode4<FMT>(x[e], x[e + 1], x[e + 2], x[e + 3], inv);
        }
        w[c * KPC + k] = bad ? 0u : code;
      }
    }
    if (bad) scale = __uint_as_float(INVALID_SCALE_BITS);
    // fp8: the warp's rows through shared memory when they are one run (staged_row_store);
    // int8 stores directly (measured: docs/perf-notes.md, write round 3)
    if constexpr (FMT == FMT_FP8) {
      if (staged_row_store<LANES, (D + 4) / 4, NC * KPC, KPC, G::CSTRIDE / 4>(row, active, lig, G::LSTRIDE / 4, w,
                                                                              __float_as_uint(scale)))
        return;
    }
    if (active) {
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        uint32_t* dst = reinterpret_cast<uint32_t*>(row + c * G::CSTRIDE + lig * G::LSTRIDE);
#pragma unroll
        for (int k = 0; k < KPC; ++k) dst[k] = w[c * KPC + k];
      }
      if (lig == 0) *reinterpret_cast<float*>(row + D) = scale;
    }
  } else {
    static_assert(FMT == FMT_NVFP4, "unknown format");
    constexpr int GPL = EPT / NVFP4_GROUP;  // scale groups per lane (contiguous)
    static_assert(GPL * NVFP4_GROUP == EPT, "whole scale groups per lane");
    float x[EPT];
#pragma unroll
    for (int c = 0; c < NC; ++c) raw16_to_float<T, EPT>(raw[c], x, c * VEC);
    float amax[GPL];
#pragma unroll
    for (int g = 0; g < GPL; ++g) {
      if constexpr (sizeof(T) == 2) {
        uint32_t wr[8];  // the group's 16 elements: chunks 2g, 2g + 1
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const uint4 r = raw[2 * g + c];
          wr[4 * c] = r.x; wr[4 * c + 1] = r.y; wr[4 * c + 2] = r.z; wr[4 * c + 3] = r.w;
        }
        amax[g] = absmax_raw16<T>(wr);
      } else {
        amax[g] = 0.0f;
#pragma unroll
        for (int j = 0; j < NVFP4_GROUP; ++j) amax[g] = fmax_nan(amax[g], fabsf(x[g * NVFP4_GROUP + j]));
      }
    }
    // NaN/Inf anywhere in the vector (max.NaN propagates it)
    float amax_all = amax[0];
#pragma unroll
    for (int g = 1; g < GPL; ++g) amax_all = fmax_nan(amax_all, amax[g]);
#pragma unroll
    for (int o = LANES / 2; o > 0; o >>= 1)
      amax_all = fmax_nan(amax_all, __shfl_xor_sync(0xffffffffu, amax_all, o));
    const bool bad = !(amax_all <= 3.402823466e38f);
    const bool gs1 = global_scale == 1.0f;  // uniform over the launch
    const float inv_gs = gs1 ? 1.0f : __frcp_rn(global_scale);
    uint32_t w[EPT / 8];
    uint32_t sf[GPL];
    // q = |x| / denom < 7 when the scale byte is a normal E4M3 value below its max 448: then
    // sf is within 2^-4 (relative) of amax/6/global_scale, so q <= 6/(1 - 2^-4) < 6.41, and the
    // E2M1 encode needs no saturating min (e2m1_pack8<false>). Warp-uniform choice.
    bool all_normal = true;
#pragma unroll
    for (int g = 0; g < GPL; ++g) {
      sf[g] = nvfp4_scale_encode_fast(amax[g], global_scale, inv_gs);
      all_normal &= (sf[g] & 0x78u) != 0u && (sf[g] & 0x7Fu) < 0x7Eu;
    }
    const bool unsaturated = __all_sync(0xffffffffu, all_normal);
#pragma unroll
    for (int g = 0; g < GPL; ++g) {
      const float denom = nvfp4_denom(sf[g], global_scale);
      const bool zero = bad || denom == 0.0f;  // codes 0 when sf == 0 (and for the invalid row)
      const float* xg = x + g * NVFP4_GROUP;
      float q[NVFP4_GROUP];  // |x| / denom: the reference's float32 division, or as good for E2M1
      if (sizeof(T) == 2 && gs1) {
        // bf16/fp16 input, E4M3 divisor: q = RU(|x| · RD(1/denom)), one instruction per element.
        // Not always the correctly rounded quotient, but always its E2M1 code: the code only
        // depends on which side of each decision point t (0.25, 0.75, …, 5) |x|/denom lies, and
        // on RNE at exact ties |x| = t·denom. Off a tie, |x|/denom is far from t relative to the
        // 2-ulp error of q (|x| has <= 11, t·denom <= 7 significant bits); at a tie
        // |x|·RD(1/denom) = t·(1 - δ) with 0 <= δ < 2^-23, which RU brings back to t exactly
        // (the one-sided error is what makes it work: RN(|x|·RN(1/denom)) misses ties below t
        // for denom = 15·2^k). Verified exhaustively — every positive E4M3 denom × every finite
        // bf16 and fp16 |x|, flush-to-zero as here — in tests/test_write_kernel_emulation.py.
        const float r_dn = __frcp_rd(denom);  // once per group
#pragma unroll
        for (int j = 0; j < NVFP4_GROUP; ++j) q[j] = __fmul_ru(fabsf(xg[j]), r_dn);
      } else if (gs1) {
        const float r = __frcp_rn(denom);
        // denom is an E4M3 value (4 significant bits): 2 FMA-pipe instructions per element from
        // the reciprocal split r + r_lo (nvfp4_div_e4m3, quant_formats.cuh)
        const float r_lo = nvfp4_recip_lo(denom, r);
#pragma unroll
        for (int j = 0; j < NVFP4_GROUP; ++j) q[j] = nvfp4_div_e4m3(fabsf(xg[j]), r, r_lo);
      } else {
        const float r = __frcp_rn(denom);
#pragma unroll
        for (int j = 0; j < NVFP4_GROUP; ++j) q[j] = div_rn_by_recip(fabsf(xg[j]), denom, r);
      }
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        uint32_t sgn;
        if constexpr (sizeof(T) == 2) {
          const uint4 r = raw[2 * g + k];  // the word's 8 elements are one 16-byte chunk
          sgn = nibble_signs16(r.x, r.y, r.z, r.w);
        } else {
          sgn = 0u;
#pragma unroll
          for (int j = 0; j < 8; ++j) sgn |= (__float_as_uint(xg[8 * k + j]) >> 31) << (4 * j + 3);
        }
        const uint32_t acc = unsaturated ? e2m1_pack8<false>(q + 8 * k, sgn) : e2m1_pack8<true>(q + 8 * k, sgn);
        w[2 * g + k] = zero ? 0u : acc;
      }
      if (bad) sf[g] = NVFP4_INVALID_SCALE_BYTE;
    }
    if (active) {
      store_nibbles<EPT>(slab + nvfp4_data_offset(t, h, H, D) + lig * (EPT / 2), w);
#pragma unroll
      for (int g = 0; g < GPL; ++g)
        slab[nvfp4_scale_offset(t, h, lig * GPL + g, block_size, H, D, SWIZZLE)] = static_cast<uint8_t>(sf[g]);
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

#if defined(KVLAB_INT4_WRITE_MMA)
// int4 with the tensor-core RHT (-DKVLAB_INT4_WRITE_MMA, int4_write_mma.cuh): the 4 lanes of a
// quad hold a row as chunks of 8 16-bit elements, chunk c of lane l covering [32c + 8l, … + 8) —
// the A-fragment loads and the layout the H_NA stage leaves the outputs in. At d = 128 this is
// Int4Geometry<128, bf16/fp16> exactly; at d = 64 it is 4 lanes × 16 (Int4Geometry: 2 × 32).
template <int D, typename T> struct Int4QuadGeometry {
  static_assert(sizeof(T) == 2, "16-bit input");
  static constexpr int VEC = 8;
  static constexpr int LANES = 4;
  static constexpr int EPT = D / LANES;
  static constexpr int NC = EPT / VEC;
  static_assert(NC >= 1 && NC * VEC * LANES == D, "whole 16-byte chunks per lane");
  // the tensor-core layout must be this chunked layout at both ends: loads (load_kv_chunks, the
  // rare path) and the tail (quantize_store_int4) address elements through VEC and LANES
  static constexpr bool mma_layout_matches() {
    for (int L = 0; L < NC; ++L)
      for (int c = 0; c < LANES; ++c)
        for (int m = 0; m < VEC; ++m)
          if (mma_in_elem(L, c, m) != L * VEC * LANES + c * VEC + m) return false;
    for (int s = 0; s < EPT; ++s)
      for (int c = 0; c < LANES; ++c)
        if (mma_out_elem(s, c) != (s / VEC) * VEC * LANES + c * VEC + s % VEC) return false;
    return true;
  }
  static_assert(mma_layout_matches(), "int4_write_mma.cuh's [layout] functions vs the chunked layout");
};
#endif

template <typename T> struct Pair {  // float32: only MAX is used
  static constexpr float MAX = 3.402823466e38f;
};
template <> struct Pair<__nv_bfloat16> {
  using V = __nv_bfloat162;
  static constexpr float MAX = 3.38953139e38f;  // largest finite bf16
  static __device__ __forceinline__ V pack(float a, float b) { return __floats2bfloat162_rn(a, b); }
  static __device__ __forceinline__ float2 unpack(V v) {  // exact: the bf16 bits in the high half
    const uint32_t u = *reinterpret_cast<const uint32_t*>(&v);
    return make_float2(__uint_as_float(u << 16), __uint_as_float(u & 0xFFFF0000u));
  }
};
template <> struct Pair<__half> {
  using V = __half2;
  static constexpr float MAX = 65504.0f;
  static __device__ __forceinline__ V pack(float a, float b) { return __floats2half2_rn(a, b); }
  static __device__ __forceinline__ float2 unpack(V v) { return __half22float2(v); }
};

__device__ __forceinline__ float fmin_nan(float a, float b) {
  float r;
  asm("min.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

// x (float32, rotated) -> rounded to the input dtype T in place; lane-local min and max of the
// rounded values, NaN-propagating (a NaN anywhere makes both NaN).
template <typename T, int EPT>
__device__ __forceinline__ void round_minmax(float (&x)[EPT], float& mn, float& mx) {
  if constexpr (sizeof(T) == 2) {
    // two at a time; min/max on the packed pairs
    using P = Pair<T>;
    typename P::V vmin, vmax;
#pragma unroll
    for (int j = 0; j < EPT / 2; ++j) {
      const typename P::V v = P::pack(x[2 * j], x[2 * j + 1]);
      if (j == 0) {
        vmin = v;
        vmax = v;
      } else {
        vmin = __hmin2_nan(vmin, v);
        vmax = __hmax2_nan(vmax, v);
      }
      const float2 f = P::unpack(v);
      x[2 * j] = f.x;
      x[2 * j + 1] = f.y;
    }
    const float2 a = P::unpack(vmin), b = P::unpack(vmax);
    mn = fmin_nan(a.x, a.y);
    mx = fmax_nan(b.x, b.y);
  } else {
    mn = x[0];
    mx = x[0];
#pragma unroll
    for (int j = 1; j < EPT; ++j) {
      mn = fmin_nan(mn, x[j]);
      mx = fmax_nan(mx, x[j]);
    }
  }
}

// round_minmax in two halves, the same instructions (16-bit T): round and pack pairs now, min/max
// and the floats back later. The tensor-core path rounds both of a lane's rows right after the
// rotation, so a row waiting for its turn holds EPT/2 registers instead of EPT.
template <typename T, int EPT>
__device__ __forceinline__ void round_pack(const float (&x)[EPT], typename Pair<T>::V (&p)[EPT / 2]) {
#pragma unroll
  for (int j = 0; j < EPT / 2; ++j) p[j] = Pair<T>::pack(x[2 * j], x[2 * j + 1]);
}
template <typename T, int EPT>
__device__ __forceinline__ void minmax_unpack(const typename Pair<T>::V (&p)[EPT / 2], float (&x)[EPT], float& mn,
                                              float& mx) {
  using P = Pair<T>;
  typename P::V vmin = p[0], vmax = p[0];
#pragma unroll
  for (int j = 0; j < EPT / 2; ++j) {
    if (j > 0) {
      vmin = __hmin2_nan(vmin, p[j]);
      vmax = __hmax2_nan(vmax, p[j]);
    }
    const float2 f = P::unpack(p[j]);
    x[2 * j] = f.x;
    x[2 * j + 1] = f.y;
  }
  const float2 a = P::unpack(vmin), b = P::unpack(vmax);
  mn = fmin_nan(a.x, a.y);
  mx = fmax_nan(b.x, b.y);
}

// int4 codes of one 16-byte chunk (VEC elements at x[c·VEC …]) packed in a word, element j at
// bits 4j. Each code is (bits(RZ(v + 2^22 + 0.5)) >> 1) minus a constant (round_half_up_bits):
// the constants of the VEC codes are removed once per word, so packing is one shift-add each.
// CLAMP: clamp v to [0, 15] first (SPEC 2.1); without it the caller has checked that every v of
// the vector lies in [-0.5, 15.5), where the clamp cannot change the code (v in [-0.5, 0)
// rounds to 0 = the clamped code; the reference's round_half_away(-0.5) = -1 clamps to 0).
template <int VEC, bool CLAMP, int EPT>
__device__ __forceinline__ uint32_t int4_chunk_codes(const float (&x)[EPT], int c, const Int4Params& p) {
  constexpr uint32_t B = 0x25400000u;  // bits(2^22) >> 1
  uint32_t bias = 0;
#pragma unroll
  for (int j = 0; j < VEC; ++j) bias += B << (4 * j);
  uint32_t w = 0u - bias;
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    float v = __fadd_rn(__fmul_rn(x[c * VEC + j], p.inv_scale), p.zp);
    if constexpr (CLAMP) v = fminf(fmaxf(v, 0.0f), 15.0f);
    w += round_half_up_bits(v) << (4 * j);
  }
  return VEC == 8 ? w : (w & 0xFFFFu);
}

// int4_chunk_codes for 8 codes per word with less integer work (used by MMA8 at d = 128: the
// plain tail's codes, the lean tail's clamping fallback; the other int4 paths keep
// int4_chunk_codes). The same magic
// add, bits(RZ(v + 2^22 + 0.5)) = 0x4A800000 + m with m = floor(2v + 1) in [0, 31] for v in
// [-0.5, 15.5) (round_half_up_bits; the caller's no-clamp check or the clamp), but m is not
// shifted per code: the even elements' m go to the bytes of one word, the odd elements' to
// another (one LEA each; m < 32 leaves 3 bits of headroom per byte, so no carries), and the word
// is then ((E >> 1) & 0x0F0F0F0F) | ((O << 3) & 0xF0F0F0F0): code = m >> 1 in the low nibble of
// byte i for element 2i, in the high nibble for 2i + 1 (the dropped bit of m, and the bit shifted
// in from the next byte, fall outside the masks). Per code: FMUL, FADD, FADD.RZ and 1 + 3/8
// integer instructions (int4_chunk_codes: ~2.5). tests/test_int4_write_variants.py emulates it
// on every tie of [-0.5, 15.5), its neighbours and random values.
template <bool CLAMP, int EPT>
__device__ __forceinline__ uint32_t int4_chunk_codes_bytes(const float (&x)[EPT], int c, const Int4Params& p) {
  constexpr uint32_t B = 0x4A800000u;  // bits(2^22)
  constexpr uint32_t BIAS = B + (B << 8) + (B << 16) + (B << 24);
  uint32_t e = 0u - BIAS, o = 0u - BIAS;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    float v = __fadd_rn(__fmul_rn(x[c * 8 + j], p.inv_scale), p.zp);
    if constexpr (CLAMP) v = fminf(fmaxf(v, 0.0f), 15.0f);
    const uint32_t t = __float_as_uint(__fadd_rz(v, 4194304.5f));
    if (j & 1) o += t << (8 * (j >> 1));
    else e += t << (8 * (j >> 1));
  }
  return ((e >> 1) & 0x0F0F0F0Fu) | ((o << 3) & 0xF0F0F0F0u);
}

#if defined(KVLAB_INT4_WRITE_MMA8)
// (the plain MMA8 tail, -DKVLAB_INT4_WRITE_PLAIN_TAIL; int4_qparams_lean is this with rcp_rn_scale)
// int4_qparams (quant_formats.cuh) with the zero point's division -mn / scale as Markstein's
// correction from inv_scale = RN(1/scale), which int4_qparams computes anyway (div_rn_by_recip:
// the correctly rounded quotient in the normal range, 3 FMA-pipe instructions) instead of an IEEE
// division (~10 with its range check, plus its never-taken slow path). |q0| >= 16 (q0 within an
// ulp of the quotient, so |quotient| > 15.5) clamps to 0 or 15 by its sign alone: q0 is used
// there, which also covers a quotient that overflows float32 (q0 = ±inf, where the correction
// would give NaN). A subnormal quotient flushes to zero either way (its zero point is 0).
// tests/test_int4_write_variants.py checks it with exact arithmetic against the float32 division.
__device__ __forceinline__ Int4Params int4_qparams_recip(float mn, float mx) {
  Int4Params p;
  const float rng = fminf(__fsub_rn(mx, mn), 3.402823466e38f);
  p.scale = fmaxf(div_rn_by_recip(rng, 15.0f, 0.06666667014360428f /* RN(1/15) */), 1e-6f);
  p.inv_scale = __frcp_rn(p.scale);
  const float x = -mn;
  const float q0 = __fmul_rn(x, p.inv_scale);
  const float q = fabsf(q0) < 16.0f ? fmaf(fmaf(-p.scale, q0, x), p.inv_scale, q0) : q0;
  const float z = fminf(fmaxf(round_half_away(q), 0.0f), 15.0f);
  p.zp = z;
  p.word = (__float_as_uint(p.scale) & 0xFFFFFFF0u) | static_cast<uint32_t>(z);
  return p;
}
#endif


// int4_per_token_head: x holds s ⊙ (head vector) already (signs applied to the raw loads) in
// the chunked layout; `src` is this lane's first input element (chunk c at src + c·VEC·LANES,
// read again only on the rare path). Rotate, round to T, min/max, codes, one 16-byte chunk ->
// VEC/2 code bytes.
//
// Saturation and the NaN/Inf rule (formats/int4_per_token_head.py, formats/base.py): a rotated
// value beyond T's finite range saturates at ±max(T); a vector with a non-finite input is the
// invalid row. The common path rounds without saturating and flags a lane whose rounded values
// are not all finite (or whose max - min overflows); any flagged lane sends its group (uniformly)
// to the rare path, which re-reads the inputs: non-finite input -> invalid row; otherwise the
// rotation is redone on x·2^-10 (exact power-of-two scaling; no float32 overflow even at
// |x| = max(bf16), d = 512), scaled back by 2^10 in float32 and clamped to ±max(T) before the
// rounding, which is the reference's clip-then-round. (Scaling changes nothing else: the same
// float32 operations on values 2^10 times smaller, except that inputs below 2^-116 flush to
// zero, which cannot move a code of a vector whose rotation overflowed.)
//
// quantize_store_int4 is everything after the rounding: x = the lane's rotated values rounded to
// T, mn/mx their lane-local min and max (NaN-propagating). G: the lane geometry — Int4Geometry
// here, Int4QuadGeometry for the tensor-core path (reshape_and_cache_int4_mma), whose rotation
// differs and whose rare path is this same code.
// BYTE_CODES (MMA8's plain tail, -DKVLAB_INT4_WRITE_PLAIN_TAIL): codes by int4_chunk_codes_bytes.
// ZP_RECIP (the same): qparams by int4_qparams_recip.
template <int D, typename T, typename G, bool BYTE_CODES = false, bool ZP_RECIP = false>
__device__ __forceinline__ void quantize_store_int4(float (&x)[G::EPT], float mn, float mx, bool active, int lig,
                                                    uint8_t* row, const T* src) {
  constexpr int EPT = G::EPT, LANES = G::LANES, VEC = G::VEC, NC = G::NC;
  static_assert(!BYTE_CODES || VEC == 8, "int4_chunk_codes_bytes: 8 codes per word");
  const bool flag = !(__fsub_rn(mx, mn) <= 3.402823466e38f);  // NaN, ±inf or overflow
  const unsigned lane = threadIdx.x & 31u;
  const unsigned gmask = (LANES == 32 ? 0xffffffffu : ((1u << LANES) - 1u)) << (lane & ~(LANES - 1u));
  bool bad = false;
  if (__ballot_sync(0xffffffffu, flag) & gmask) {
    // rare path, taken by whole groups (a skipped token's group may take it too: it computes
    // on zeros here and stores nothing); x is reloaded in place (its common-path values are
    // not needed any more)
    bool nonfinite = false;
#pragma unroll
    for (int c = 0; c < NC; ++c) {
      uint4 r = make_uint4(0, 0, 0, 0);
      if (active) r = __ldg(reinterpret_cast<const uint4*>(src + c * VEC * LANES));
      raw16_to_float<T, EPT>(rht_signs_raw16<T>(r, c * VEC * LANES + lig * VEC), x, c * VEC);
    }
#pragma unroll
    for (int j = 0; j < EPT; ++j) nonfinite |= !(fabsf(x[j]) <= 3.402823466e38f);
    bad = (__ballot_sync(gmask, nonfinite) & gmask) != 0;
    if (!bad) {
#pragma unroll
      for (int j = 0; j < EPT; ++j) x[j] = __fmul_rn(x[j], 0.0009765625f);  // 2^-10
      wht_chunked<EPT, LANES, VEC>(x, lig, gmask);
      constexpr float BIG = Pair<T>::MAX;  // largest finite value of T
#pragma unroll
      for (int j = 0; j < EPT; ++j) x[j] = fminf(fmaxf(__fmul_rn(x[j], 1024.0f), -BIG), BIG);
      round_minmax<T, EPT>(x, mn, mx);
    }
  }
  mn = group_min<LANES>(mn);
  mx = group_max<LANES>(mx);
#if defined(KVLAB_INT4_WRITE_MMA8)
  const Int4Params p = ZP_RECIP ? int4_qparams_recip(mn, mx) : int4_qparams(mn, mx);
#else
  const Int4Params p = int4_qparams(mn, mx);
#endif
  // codes without the [0, 15] clamp when every v of every vector of the warp lies in
  // [-0.5, 15.5) (v is monotonic in y, so checking mn and mx suffices) — the usual case
  const float vlo = __fadd_rn(__fmul_rn(mn, p.inv_scale), p.zp);
  const float vhi = __fadd_rn(__fmul_rn(mx, p.inv_scale), p.zp);
  const bool noclamp = __all_sync(0xffffffffu, bad || (vlo >= -0.5f && vhi < 15.5f));
  uint32_t w[NC];
  if (noclamp) {
#pragma unroll
    for (int c = 0; c < NC; ++c) {
      if constexpr (BYTE_CODES) w[c] = int4_chunk_codes_bytes<false>(x, c, p);
      else w[c] = int4_chunk_codes<VEC, false>(x, c, p);
    }
  } else {
#pragma unroll
    for (int c = 0; c < NC; ++c) {
      if constexpr (BYTE_CODES) w[c] = int4_chunk_codes_bytes<true>(x, c, p);
      else w[c] = int4_chunk_codes<VEC, true>(x, c, p);
    }
  }
  if (bad) {
#pragma unroll
    for (int c = 0; c < NC; ++c) w[c] = 0u;
  }
  const uint32_t tail = bad ? INVALID_SCALE_BITS : p.word;
#pragma unroll
  for (int c = 0; c < NC; ++c) {
    uint8_t* dst = row + (c * VEC * LANES + lig * VEC) / 2;
    if (active) {
      if constexpr (VEC == 8) *reinterpret_cast<uint32_t*>(dst) = w[c];
      else *reinterpret_cast<uint16_t*>(dst) = static_cast<uint16_t>(w[c]);
    }
  }
  if (active && lig == 0) *reinterpret_cast<uint32_t*>(row + D / 2) = tail;
}

template <int D, typename T>
__device__ __forceinline__ void encode_store_int4(float (&x)[Int4Geometry<D, T>::EPT], bool active,
                                                  int lig, uint8_t* row, const T* src) {
  using G = Int4Geometry<D, T>;
  wht_chunked<G::EPT, G::LANES, G::VEC>(x, lig);
  float mn, mx;
  round_minmax<T, G::EPT>(x, mn, mx);
  quantize_store_int4<D, T, G>(x, mn, mx, active, lig, row, src);
}

// The 2·NC 16-byte loads of one (token, head): chunk c of K at k_row[first + c·CSTRIDE] (k_row:
// the head's input row; first: the lane's first element), of V likewise.
// All issued before any math, and independent of the slot: `valid` is token < num_tokens (the
// input row exists), not slot >= 0. Gating the loads on the slot would put the slot_mapping
// load and the K/V loads in series — two DRAM latencies per thread instead of one, which is
// what a write kernel with few threads per row feels first (docs/perf-notes.md, write round 3).
// A skipped token (slot < 0) thus computes on its real input and stores nothing.
template <int NC, int CSTRIDE, typename T>
__device__ __forceinline__ void load_kv_chunks(const T* k_row, const T* v_row, int first, bool valid,
                                               uint4 (&rk)[NC], uint4 (&rv)[NC]) {
#pragma unroll
  for (int c = 0; c < NC; ++c) {
    if (valid) {
      rk[c] = __ldg(reinterpret_cast<const uint4*>(k_row + (first + c * CSTRIDE)));
      rv[c] = __ldg(reinterpret_cast<const uint4*>(v_row + (first + c * CSTRIDE)));
    } else {
      rk[c] = make_uint4(0, 0, 0, 0);
      rv[c] = make_uint4(0, 0, 0, 0);
    }
  }
}

// int4, one side: the RHT signs XORed into the raw words, to float, then encode_store_int4.
template <int D, typename T>
__device__ __forceinline__ void rotate_encode_store_int4(const uint4 (&raw)[Int4Geometry<D, T>::NC], bool active,
                                                         int lig, uint8_t* row, const T* src) {
  using G = Int4Geometry<D, T>;
  float x[G::EPT];
#pragma unroll
  for (int c = 0; c < G::NC; ++c)
    raw16_to_float<T, G::EPT>(rht_signs_raw16<T>(raw[c], c * G::VEC * G::LANES + lig * G::VEC), x, c * G::VEC);
  encode_store_int4<D, T>(x, active, lig, row, src);
}

// MMA8 (the default): int4 with 16-bit input at d = 128 rotates on tensor cores with 8 rows
// per warp (rht_mma8_row, int4_write_mma.cuh) in the base kernel's geometry (Int4Geometry: 4
// lanes per row, the same loads); K then V as there. No host change. Its tail is
// quantize_store_int4_lean (session 7), or with -DKVLAB_INT4_WRITE_PLAIN_TAIL the base kernel's
// quantize_store_int4 with byte codes and the reciprocal zero point.
#if defined(KVLAB_INT4_WRITE_MMA8)
template <int FMT, int D, typename T> constexpr bool int4_write_uses_mma8() {
  return FMT == FMT_INT4 && sizeof(T) == 2 && D == 128;
}
#if defined(KVLAB_INT4_WRITE_LEAN)
// ---------------------------------------------------------------- the lean MMA8 tail (session 7)
// The MMA8 tail (the default since session 7; -DKVLAB_INT4_WRITE_PLAIN_TAIL builds the previous
// one, quantize_store_int4<…, true, true>, for A/B) with fewer instructions per element and per
// row, the same cache bytes (docs/notes-int4-write-mma.md, "Session 7 candidate";
// tests/test_int4_write_variants.py):
//  * quad min / max on packed 16-bit words: the lane's min pair and NEGATED max pair are folded
//    into one word (min in the low half, -max in the high half), so one NaN-propagating packed
//    min per shuffle stage reduces both; no float unpack before the shuffles.
//  * the rare path is entered on the quad's range (!(mx - mn <= MAX), quad-uniform, no ballot);
//    inside, the plain tail's lane-by-lane decision is taken again, so the rows that take it are
//    exactly the plain tail's.
//  * inv_scale = RN(1/scale) by __frcp_rn's fast-path instructions without its range test
//    (scale is in [1e-6, 2.3e37], inside that path's range: rcp_rn_scale).
//  * codes as nibbles straight from the magic words (int4_chunk_codes_nibbles): 7 LEA per 8
//    codes instead of 11 integer instructions.

// RN(1/s) for s in [1e-6, 2.27e37] (every int4 scale): MUFU.RCP and one Newton step with two
// FMAs, the instructions __frcp_rn executes for s whose biased exponent is in [1, 252] (its
// range test, IADD3 0x1800000 / LOP3 0x7f800000 / ISETP.GT 0x1ffffff, sends only the others to
// the slow path); 1e-6 has exponent 107 and 2.27e37 exponent 251. __frcp_rn computes
// e = -(s·r - 1) (FFMA then FADD negation) where this computes e = 1 - s·r with one FFMA: the
// same value up to the sign of a zero e, and r + r·(±0) = r.
__device__ __forceinline__ float rcp_rn_scale(float s) {
  float y;  // one asm block, so that ptxas folds the negation into the FFMA
  asm("{\n\t.reg .f32 r, e, ns;\n\t"
      "rcp.approx.ftz.f32 r, %1;\n\t"
      "neg.f32 ns, %1;\n\t"
      "fma.rn.f32 e, ns, r, 0f3F800000;\n\t"
      "fma.rn.f32 %0, r, e, r;\n\t}"
      : "=f"(y) : "f"(s));
  return y;
}

// int4_qparams_recip with rcp_rn_scale, plus zph = RN(zp + pred(0.5)) for the nibble codes: zp + 0.5
// for zp >= 1 (zp + 0.5 - 2^-25 is not a float there, and zp + 0.5 is the nearest), 0.5 - 2^-25
// for zp = 0 (int4_chunk_codes_nibbles says why).
__device__ __forceinline__ Int4Params int4_qparams_lean(float rng, float mn, float& zph) {
  Int4Params p;
  p.scale = fmaxf(div_rn_by_recip(rng, 15.0f, 0.06666667014360428f /* RN(1/15) */), 1e-6f);
  p.inv_scale = rcp_rn_scale(p.scale);
  const float x = -mn;
  const float q0 = __fmul_rn(x, p.inv_scale);
  const float q = fabsf(q0) < 16.0f ? fmaf(fmaf(-p.scale, q0, x), p.inv_scale, q0) : q0;
#if defined(KVLAB_INT4_WRITE_LEAN2)
  // clamp(round_half_away(q), 0, 15) as min(trunc(RZ(max(q, 0) + 0.5)), 15): for q >= 0 the same
  // operations (roundf = trunc(RZ(q + copysign(0.5, q)))); for q < 0 (and -inf) both give 0
  // (round_half_away(q) <= -0, then max(., 0)); +inf gives 15 either way. q is never NaN where
  // the word is used (a NaN range is the rare path's invalid row). No copysign LOP3.
  // tests/test_int4_write_variants.py (lean2_zero_point) checks it against -DKVLAB_INT4_WRITE_DIV64's.
  const float z = fminf(truncf(__fadd_rz(fmaxf(q, 0.0f), 0.5f)), 15.0f);
#else
  const float z = fminf(fmaxf(round_half_away(q), 0.0f), 15.0f);
#endif
  p.zp = z;
  p.word = (__float_as_uint(p.scale) & 0xFFFFFFF0u) | static_cast<uint32_t>(z);
  zph = __fadd_rn(z, 0.49999997f);  // pred(0.5) = 0.5 - 2^-25
  return p;
}

// The 8 codes of chunk c as one word of nibbles, for a row whose every v = RN(RN(y·inv) + zp)
// lies in (-0.5, 15.5) (the caller's noclamp test, strict at -0.5). Per code: t = RN(y·inv),
// v' = RN(t + zph), k = floor(v') from the magic add RZ(v' + M) = M + k (grid 1 in [2^23, 2^24)),
// whose bits are bits(M) + k; the words are summed as k_j << 4j with 7 LEA. The magic constants'
// bits cancel mod 2^32: element 0 uses M = 2^23 (0x4B000000), element 1 uses M = 2^23 + 5·2^20
// (0x4B500000, << 4 = 0xB5000000; 0x4B000000 + 0xB5000000 = 2^32), elements 2..7 use 2^23, whose
// bits vanish under a shift by >= 8. k_j <= 15, so no carries between nibbles.
// Why floor(RN(t + zph)) is the reference code floor(RN(t + zp) + 0.5) (SPEC 2.1 step 4):
//  * zp >= 1 (zph = zp + 0.5). code >= k  <=>  RN(s) >= k - 0.5 (reference) vs RN(s + 0.5) >= k,
//    s = t + zp exactly. For k >= 2, k - 0.5 and the floats just below it and just below k lie in
//    one binade, so both thresholds are s >= k - 0.5 - ulp/2 with the tie going up (k - 0.5 and
//    k are even). For k = 1 they differ on s in [0.5 - 2^-25, 0.5 - 2^-26), which holds no
//    t + zp: t <= -0.5 there, a multiple of 2^-24. v' >= 0: RN(s) >= -0.5 and s a multiple of
//    2^-24 give s >= -0.5.
//  * zp = 0 (zph = 0.5 - 2^-25): t is a float, the reference code is floor(t + 0.5); t > -0.5
//    (strict noclamp) gives t + zph >= 0; t = 0.5 - 2^-25 gives 1 - 2^-24 (code 0), t = 0.5 the
//    tie 1 - 2^-25 -> 1 (code 1); for k >= 2 the float below k - 0.5 is an ulp >= 2^-23 away,
//    more than the 2^-25 by which zph is short of 0.5.
// tests/test_int4_write_variants.py checks it exactly on every tie of every zero point.
template <int EPT>
__device__ __forceinline__ uint32_t int4_chunk_codes_nibbles(const float (&x)[EPT], int c, float inv_scale,
                                                             float zph) {
  uint32_t w = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const float v = __fadd_rn(__fmul_rn(x[c * 8 + j], inv_scale), zph);
    const uint32_t t = __float_as_uint(__fadd_rz(v, j == 1 ? 13631488.0f : 8388608.0f));
    w += t << (4 * j);
  }
  return w;
}

// Quad min and max of the rounded values, NaN-propagating, from the lane's 16 packed pairs:
// the lane's min pair m and max pair M (as minmax_unpack), then one word (min(m.lo, m.hi),
// -max(M.lo, M.hi)) reduced with packed min over the quad (xor 1, 2). Negation flips the sign
// bit (exact, NaN stays NaN).
template <typename T>
__device__ __forceinline__ void quad_min_max_packed(const typename Pair<T>::V (&p)[16], float& mn, float& mx) {
  using V = typename Pair<T>::V;
  V vmin = p[0], vmax = p[0];
#pragma unroll
  for (int j = 1; j < 16; ++j) {
    vmin = __hmin2_nan(vmin, p[j]);
    vmax = __hmax2_nan(vmax, p[j]);
  }
  const uint32_t a = *reinterpret_cast<const uint32_t*>(&vmin);
  const uint32_t b = *reinterpret_cast<const uint32_t*>(&vmax) ^ 0x80008000u;
  const uint32_t lo = __byte_perm(a, b, 0x5410), hi = __byte_perm(a, b, 0x7632);
  V w = __hmin2_nan(*reinterpret_cast<const V*>(&lo), *reinterpret_cast<const V*>(&hi));
#pragma unroll
  for (int o = 1; o < 4; o <<= 1) {
    uint32_t u = *reinterpret_cast<const uint32_t*>(&w);
    u = __shfl_xor_sync(0xffffffffu, u, o);
    w = __hmin2_nan(w, *reinterpret_cast<const V*>(&u));
  }
  const float2 f = Pair<T>::unpack(w);
  mn = f.x;
  mx = -f.y;
}

// quantize_store_int4<…, BYTE_CODES, ZP_RECIP> (the plain MMA8 tail) from the packed rounded pairs pk,
// with the pieces above; the same decisions and bytes.
template <int D, typename T>
__device__ __forceinline__ void quantize_store_int4_lean(typename Pair<T>::V (&pk)[16], bool active, int lig,
                                                         uint8_t* row, const T* src) {
  using G = Int4Geometry<D, T>;
  constexpr int EPT = G::EPT, LANES = G::LANES, VEC = G::VEC, NC = G::NC;
  static_assert(EPT == 32 && LANES == 4 && VEC == 8 && NC == 4, "d = 128, 16-bit");
  constexpr float FMAX = 3.402823466e38f;
  float mn, mx;
  quad_min_max_packed<T>(pk, mn, mx);
  float rng = __fsub_rn(mx, mn);
  bool bad = false;
  if (!(rng <= FMAX)) {  // quad-uniform: NaN, ±inf or overflow somewhere in the quad
    const unsigned lane = threadIdx.x & 31u;
    const unsigned gmask = 0xFu << (lane & ~3u);
    float x[EPT], lmn, lmx;
    minmax_unpack<T, EPT>(pk, x, lmn, lmx);
    // the plain tail's test, lane by lane (quantize_store_int4): a quad whose range overflows only
    // across lanes stays on the common path there, and here
    const bool flag = !(__fsub_rn(lmx, lmn) <= FMAX);
    if (__ballot_sync(gmask, flag) & gmask) {
      bool nonfinite = false;
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        uint4 r = make_uint4(0, 0, 0, 0);
        if (active) r = __ldg(reinterpret_cast<const uint4*>(src + c * VEC * LANES));
        raw16_to_float<T, EPT>(rht_signs_raw16<T>(r, c * VEC * LANES + lig * VEC), x, c * VEC);
      }
#pragma unroll
      for (int j = 0; j < EPT; ++j) nonfinite |= !(fabsf(x[j]) <= FMAX);
      bad = (__ballot_sync(gmask, nonfinite) & gmask) != 0;
      if (!bad) {
#pragma unroll
        for (int j = 0; j < EPT; ++j) x[j] = __fmul_rn(x[j], 0.0009765625f);  // 2^-10
        wht_chunked<EPT, LANES, VEC>(x, lig, gmask);
        constexpr float BIG = Pair<T>::MAX;
#pragma unroll
        for (int j = 0; j < EPT; ++j) x[j] = fminf(fmaxf(__fmul_rn(x[j], 1024.0f), -BIG), BIG);
        round_minmax<T, EPT>(x, lmn, lmx);
      }
      // quad-masked: only the quads whose range overflowed are in this branch (H200, session 7:
      // full-warp shuffles here hung the warp on tests/gpu/test_degenerate_gpu.py's rows)
      mn = group_min<LANES>(lmn, gmask);
      mx = group_max<LANES>(lmx, gmask);
    }
    round_pack<T, EPT>(x, pk);  // exact: x is rounded to T (pk is not live across the rare path)
    rng = fminf(__fsub_rn(mx, mn), FMAX);
  }
  float zph;
  const Int4Params p = int4_qparams_lean(rng, mn, zph);
  const float vlo = __fadd_rn(__fmul_rn(mn, p.inv_scale), p.zp);
  const float vhi = __fadd_rn(__fmul_rn(mx, p.inv_scale), p.zp);
  // strict at -0.5 (int4_chunk_codes_nibbles needs v > -0.5 where zp = 0)
  const bool noclamp = __all_sync(0xffffffffu, bad || (vlo > -0.5f && vhi < 15.5f));
  float x[EPT];
#pragma unroll
  for (int j = 0; j < EPT / 2; ++j) {
    const float2 f = Pair<T>::unpack(pk[j]);
    x[2 * j] = f.x;
    x[2 * j + 1] = f.y;
  }
  uint32_t w[NC];
  if (noclamp) {
#pragma unroll
    for (int c = 0; c < NC; ++c) w[c] = int4_chunk_codes_nibbles<EPT>(x, c, p.inv_scale, zph);
  } else {
#pragma unroll
    for (int c = 0; c < NC; ++c) w[c] = int4_chunk_codes_bytes<true>(x, c, p);
  }
  if (bad) {
#pragma unroll
    for (int c = 0; c < NC; ++c) w[c] = 0u;
  }
  const uint32_t tail = bad ? INVALID_SCALE_BITS : p.word;
#pragma unroll
  for (int c = 0; c < NC; ++c) {
    if (active) *reinterpret_cast<uint32_t*>(row + (c * VEC * LANES + lig * VEC) / 2) = w[c];
  }
  if (active && lig == 0) *reinterpret_cast<uint32_t*>(row + D / 2) = tail;
}
#endif  // KVLAB_INT4_WRITE_LEAN

template <int D, typename T>
__device__ __forceinline__ void rotate_encode_store_int4_mma8(const uint4 (&raw)[4], bool active, int lig,
                                                              uint8_t* row, const T* src) {
  using G = Int4Geometry<D, T>;
  uint32_t b[2][2];  // H_16 as the mma's B operand
  mma_h16_fragments_table<T>(threadIdx.x & 31, b);
  static_assert(G::LANES == 4 && G::NC == 4 && G::VEC == 8 && G::EPT == 32, "the quad layout of rht_mma8_row");
  // rounded to T and packed per tile as the rotation hands the tile over (16 words for the row)
  typename Pair<T>::V pk[G::EPT / 2];
  rht_mma8_row<T>(raw, b, lig, [&](int tile, const float (&z)[8][2]) {
#pragma unroll
    for (int a = 0; a < 8; ++a) pk[mma_out_slot(a, tile, 0) / 2] = Pair<T>::pack(z[a][0], z[a][1]);
  });
  static_assert(mma_out_slot(0, 0, 1) == mma_out_slot(0, 0, 0) + 1, "a pair of columns = a pair of elements");
#if defined(KVLAB_INT4_WRITE_LEAN)
  quantize_store_int4_lean<D, T>(pk, active, lig, row, src);
#else
  float x[G::EPT], mn, mx;
  minmax_unpack<T, G::EPT>(pk, x, mn, mx);
  quantize_store_int4<D, T, G, true, true>(x, mn, mx, active, lig, row, src);
#endif
}

#if defined(KVLAB_INT4_WRITE_LEAN2)
// floor(n / d) for n < 2^21, 1 <= d < 2^32, exact, without a correction step: trunc(RN((n + 1/2)·rd))
// with rd = rcp.approx(d), 6 instructions (I2F, MUFU.RCP, FMUL, I2F, FFMA, F2I; the first three
// depend on d only) instead of the C++ 64-bit division's inline 32-bit path (~25 with its range
// test; its out-of-line 64-bit subroutine serves the other cases: div_s64_call).
// Proof: float(d), float(n) are exact (< 2^24); rcp.approx.ftz.f32 has at most 1 ulp error (PTX
// ISA), so rd = (1/d)(1 + e1), |e1| <= 2^-23; hrd = rd/2 exactly; p = RN(n·rd + hrd) (one FFMA) =
// ((n + 1/2)/d)(1 + e1)(1 + e2), |e2| <= 2^-24, so |p - (n + 1/2)/d| < ((n + 1/2)/d)·1.5·2^-23·(1 + 2^-23)
// < (1/2)/d because n + 1/2 < 2^21 + 1/2 < 2^23 / 3. With q = floor(n/d), (n + 1/2)/d lies in
// [q + (1/2)/d, q + 1 - (1/2)/d], so p lies strictly inside (q, q + 1) and trunc(p) = q. For
// d >= 2^24 (float(d) rounded: one more 2^-24, |p - (n + 1/2)/d| < 2^-21·(n + 1/2)/d) n < 2^21 <= d/8
// gives (n + 1/2)/d < 1/8 + 2^-25, so p < 1 and trunc(p) = 0 = q.
// tests/test_int4_write_variants.py (lean2_udiv) emulates it with rd moved by -1, 0, +1 ulp.
__device__ __forceinline__ unsigned udiv_small(unsigned n, unsigned d) {
  float rd;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(rd) : "f"(__uint2float_rn(d)));
  return __float2uint_rz(__fmaf_rn(__uint2float_rn(n), rd, 0.5f * rd));
}
// floor(n / d) for every n < 2^32, 1 <= d < 2^32, exact, in 10 instructions (I2F, MUFU.RCP, F2F.F64,
// I2F.F64, 2 DFMA, DMUL, I2F.F64, DFMA, F2I.F64; the first seven depend on d only): udiv_small with
// one Newton step in float64 from the float32 reciprocal, for the cache's slots (caches beyond
// 2^21 slots are common for int4).
// Proof: float(d) = d(1 + e0), |e0| <= 2^-24; rcp.approx.ftz.f32 is within 1 ulp, so r0 = (double)rf =
// (1/d)(1 + f), |f| <= 2^-23 + 2^-24 + 2^-47 < 2^-22.4. d·r0 = 1 + f exactly, so e = RN(1 - d·r0) =
// -f(1 + g1) and r1 = RN(r0 + r0·e) = (1/d)(1 + f)(1 - f - f·g1)(1 + g2) = (1/d)(1 + f1) with
// |f1| <= f^2 + |f|·2^-53 + 2^-53 + (smaller) < 2^-44.7 (|g1|, |g2| <= 2^-53). hr = r1/2 exactly; p =
// RN(n·r1 + hr) = ((n + 1/2)/d)(1 + f1)(1 + g3), so |p - (n + 1/2)/d| < ((n + 1/2)/d)·2^-44.6 < (1/2)/d
// for n < 2^43: trunc(p) = floor(n/d) as in udiv_small. All float64 values are normal, the
// conversions of n and d to float64 exact.
// tests/test_int4_write_variants.py (lean2_udiv_wide) emulates it exactly (fractions) with rf
// moved by -1, 0, +1 ulp.
__device__ __forceinline__ unsigned udiv_wide(unsigned n, unsigned d) {
  float rf;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(rf) : "f"(__uint2float_rn(d)));
  double r0;  // (cvt without .ftz: -ftz=true would add an FMUL by 1 to flush rf, which is normal)
  asm("cvt.f64.f32 %0, %1;" : "=d"(r0) : "f"(rf));
  const double dd = static_cast<double>(d);
  const double r1 = __fma_rn(r0, __fma_rn(-dd, r0, 1.0), r0);
  return __double2uint_rz(__fma_rn(static_cast<double>(n), r1, 0.5 * r1));
}
// a / b (64-bit signed, truncating, as C++'s /) by PTX div.s64: ptxas calls its out-of-line
// subroutine, without the inline 32-bit path NVVM adds to a C++ 64-bit division (udiv_small
// takes the cases that path would serve, up to its range)
__device__ __forceinline__ long long div_s64_call(long long a, long long b) {
  long long q;
  asm("div.s64 %0, %1, %2;" : "=l"(q) : "l"(a), "l"(b));
  return q;
}
#endif

// The whole int4 write with rht_mma8_row: the base kernel's rows and lanes (group = thread / 4,
// lane c of the quad = lig), two changes around the rotation that cut per-thread instructions:
// the loads address one base pointer with immediate offsets, and the grid tail (token >=
// num_tokens, the last warp's missing rows) loads the last token's rows (valid memory) instead of
// zeroing 32 registers — it stores nothing either way (slot -1), and its rare path reads nothing.
// Its token/head and block/slot index math is LEAN2's (udiv_small, udiv_wide, div_s64_call above;
// the default since session 8) in the lean write, C++ 64-bit divisions with
// -DKVLAB_INT4_WRITE_DIV64 or -DKVLAB_INT4_WRITE_PLAIN_TAIL.
template <int D, typename T>
__device__ __forceinline__ void reshape_and_cache_int4_mma8(const T* __restrict__ key, const T* __restrict__ value,
                                                            long long key_stride, long long value_stride,
                                                            uint8_t* __restrict__ cache,
                                                            const long long* __restrict__ slot_mapping,
                                                            long long num_tokens, int H, int block_size) {
  using G = Int4Geometry<D, T>;
  constexpr int LANES = G::LANES, VEC = G::VEC, NC = G::NC;
  const int lig = threadIdx.x & (LANES - 1);
#if defined(KVLAB_INT4_WRITE_LEAN2)
  const unsigned long long gthread = static_cast<unsigned long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  long long token;
  int h;
  // groups below 2^21 (udiv_small's range): every launch up to 2 M rows
  if (gthread < (1ull << 23)) {
    const unsigned g = static_cast<unsigned>(gthread) / LANES, q = udiv_small(g, static_cast<unsigned>(H));
    token = q;
    h = static_cast<int>(g - q * static_cast<unsigned>(H));
  } else {
    const long long group = static_cast<long long>(gthread / LANES);
    token = div_s64_call(group, H);
    h = static_cast<int>(group - token * H);
  }
#else
  const long long group = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) / LANES;
  const long long token = group / H;
  const int h = static_cast<int>(group - token * H);
#endif
  const bool valid = token < num_tokens;
  long long slot = -1;
  if (valid) slot = slot_mapping[token];
  const bool active = slot >= 0;
  const long long tl = valid ? token : num_tokens - 1;  // num_tokens >= 1 (cache.py)
  const T* ksrc = key + tl * key_stride + h * D + lig * VEC;
  const T* vsrc = value + tl * value_stride + h * D + lig * VEC;
  uint4 rk[NC], rv[NC];
#pragma unroll
  for (int c = 0; c < NC; ++c) {  // chunk c at + c·VEC·LANES elements = c·LANES 16-byte words
    rk[c] = __ldg(reinterpret_cast<const uint4*>(ksrc) + c * LANES);
    rv[c] = __ldg(reinterpret_cast<const uint4*>(vsrc) + c * LANES);
  }
#if defined(KVLAB_INT4_WRITE_LEAN2)
  constexpr long long ROW = row_bytes<FMT_INT4>(D);
  const long long side_bytes = static_cast<long long>(block_size) * H * ROW;
  // the K row's index in ROW-byte rows: blk·2·block_size·H + t·H + h = (slot + blk·block_size)·H + h
  // (slot = blk·block_size + t), -DKVLAB_INT4_WRITE_DIV64's byte offset / ROW (the same pointer, mod 2^64)
  // A skipped row (slot < 0) takes the first branch too: its ridx is garbage and unused (it stores
  // nothing; DIV64's row there is h·ROW, also unused).
  unsigned long long ridx;
  if (slot < (1ll << 31)) {  // every cache below 2^31 slots: slot + blk·block_size <= 2·slot < 2^32
    const unsigned sl = static_cast<unsigned>(slot), bs = static_cast<unsigned>(block_size);
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 800 || __CUDA_ARCH__ == 900)
    const unsigned blk = udiv_wide(sl, bs);  // float64 at half the float32 rate (A100, H100/H200)
#else
    const unsigned blk = sl / bs;  // elsewhere float64 is slow: the compiler's 32-bit division
#endif
    ridx = static_cast<unsigned long long>(sl + blk * bs) * static_cast<unsigned>(H) + static_cast<unsigned>(h);
  } else {
    const long long blk = div_s64_call(slot, block_size);
    ridx = static_cast<unsigned long long>((slot + blk * block_size) * H + h);
  }
  uint8_t* row_k = cache + ridx * ROW;
#else
  const long long blk = active ? slot / block_size : 0;
  const int t = active ? static_cast<int>(slot - blk * block_size) : 0;
  constexpr long long ROW = row_bytes<FMT_INT4>(D);
  const long long side_bytes = static_cast<long long>(block_size) * H * ROW;
  uint8_t* row_k = cache + blk * 2 * side_bytes + (static_cast<long long>(t) * H + h) * ROW;
#endif
  rotate_encode_store_int4_mma8<D, T>(rk, active, lig, row_k, ksrc);
  rotate_encode_store_int4_mma8<D, T>(rv, active, lig, row_k + side_bytes, vsrc);
}
#else
template <int FMT, int D, typename T> constexpr bool int4_write_uses_mma8() { return false; }
#endif

#if defined(KVLAB_INT4_WRITE_MMA)
// -DKVLAB_INT4_WRITE_MMA: int4 with 16-bit input at d = 64 and 128 rotates on tensor cores
// (int4_write_mma.cuh); every other case keeps the path above. kvlab/cuda/cache.py
// (`int4_write_mma_enabled`, `_write_lanes`) reads the same switch from the NVRTC options and
// launches 2 threads per row (a warp per 16 rows) instead of Int4Geometry::LANES.
template <int FMT, int D, typename T> constexpr bool int4_write_uses_mma() {
  return FMT == FMT_INT4 && sizeof(T) == 2 && (D == 64 || D == 128);
}

// int4 write, tensor-core RHT: warp w owns the 16 (token, head) rows 16w … 16w + 15 (row = token·H
// + h: consecutive heads of a token, then the next token, as K and V lie in memory), lane (g, c)
// rows g and g + 8 as the quad layout of Int4QuadGeometry. Per side (K, then V, as above: V waits
// as raw words): rht_mma_rows, both rows rounded to T and packed (round_pack: a row waiting for
// its turn holds 16 registers, not 32 — the kernel fits in 128), then per row minmax_unpack +
// quantize_store_int4 (its min/max shuffles and rare path run on the quad). Rows past the end load
// nothing and store nothing, but their lanes run the mma and the shuffles on zeros; skipped
// tokens (slot < 0) compute and store nothing.
// Per lane and side at d = 128: 8 16-byte loads, 16 mma, 192 FADD (H_8), 2 × 4 code words + the
// scale word of each row.
template <int D, typename T>
__device__ __forceinline__ void reshape_and_cache_int4_mma(const T* __restrict__ key, const T* __restrict__ value,
                                                           long long key_stride, long long value_stride,
                                                           uint8_t* __restrict__ cache,
                                                           const long long* __restrict__ slot_mapping,
                                                           long long num_tokens, int H, int block_size) {
  using G = Int4QuadGeometry<D, T>;
  constexpr int NC = G::NC, EPT = G::EPT;
  const int lane = threadIdx.x & 31, c = lane & 3;
  const long long warp = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  // rows g and g + 8: one 64-bit division, then h + 8 wraps into the next token(s)
  long long token[2];
  int h[2];
  token[0] = (warp * 16 + (lane >> 2)) / H;
  h[0] = static_cast<int>(warp * 16 + (lane >> 2) - token[0] * H);
  const int wrap = (h[0] + 8) / H;
  token[1] = token[0] + wrap;
  h[1] = h[0] + 8 - wrap * H;
  long long slot[2];
  uint4 rk[2][NC], rv[2][NC];
  const T* ksrc[2];
  const T* vsrc[2];
  bool valid[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    valid[r] = token[r] < num_tokens;
    slot[r] = valid[r] ? slot_mapping[token[r]] : -1;
    // the lane's first element; chunk L at + L·VEC·LANES (mma_in_elem, Int4QuadGeometry)
    ksrc[r] = key + token[r] * key_stride + h[r] * D + mma_in_elem(0, c, 0);
    vsrc[r] = value + token[r] * value_stride + h[r] * D + mma_in_elem(0, c, 0);
    load_kv_chunks<NC, G::VEC * G::LANES>(ksrc[r], vsrc[r], 0, valid[r], rk[r], rv[r]);
  }
  uint32_t b[2][2];
  mma_h16_fragments<T>(lane, b);
  constexpr long long ROW = row_bytes<FMT_INT4>(D);
  const long long side_bytes = static_cast<long long>(block_size) * H * ROW;
  bool active[2];
  uint8_t* row_k[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    active[r] = slot[r] >= 0;
    const long long blk = active[r] ? slot[r] / block_size : 0;
    const int t = active[r] ? static_cast<int>(slot[r] - blk * block_size) : 0;
    row_k[r] = cache + blk * 2 * side_bytes + (static_cast<long long>(t) * H + h[r]) * ROW;
  }
#pragma unroll
  for (int side = 0; side < 2; ++side) {
    typename Pair<T>::V p[2][EPT / 2];  // both rows rounded to T, packed
    {
      float y[2][EPT];
      rht_mma_rows<D, T>(side == 0 ? rk : rv, b, c, y);
      round_pack<T, EPT>(y[0], p[0]);
      round_pack<T, EPT>(y[1], p[1]);
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float x[EPT], mn, mx;
      minmax_unpack<T, EPT>(p[r], x, mn, mx);
      quantize_store_int4<D, T, G>(x, mn, mx, active[r], c, row_k[r] + side * side_bytes,
                                   side == 0 ? ksrc[r] : vsrc[r]);
    }
  }
}
#endif  // KVLAB_INT4_WRITE_MMA
template <int FMT, int D, typename T> constexpr bool int4_write_uses_mma_any() {
#if defined(KVLAB_INT4_WRITE_MMA)
  return int4_write_uses_mma<FMT, D, T>();
#else
  return false;
#endif
}

}  // namespace

// key/value: (num_tokens, H, D) with token stride key_stride / value_stride (elements; the
// (H, D) part contiguous, rows 16-byte aligned). cache: (num_blocks, 2, block_size, H, row)
// contiguous, uint8 (or T for auto). slot_mapping: int64 (num_tokens,), < 0 = skip.
// k_scale / v_scale: nvfp4 global (dequantization) scales, unused otherwise.
// SWIZZLE: nvfp4 V scales in vLLM's SM100 order.
// int4 (16-bit input, d = 64..256): 3 resident blocks/SM (<= 85 registers) on sm_90; sm_80's
// register allocation spills at that bound (d = 128), so 2 there. -DKVLAB_INT4_WRITE_BLOCKS=n
// overrides both (A/B of the register bound).
#ifndef KVLAB_INT4_WRITE_BLOCKS
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define KVLAB_INT4_WRITE_BLOCKS 3
#else
#define KVLAB_INT4_WRITE_BLOCKS 2
#endif
#endif
// the tensor-core int4 path (two rows per lane): see reshape_and_cache_int4_mma
#define KVLAB_INT4_MMA_WRITE_BLOCKS 2
template <int FMT, int D, typename T, bool SWIZZLE>
__global__ void __launch_bounds__(256, int4_write_uses_mma_any<FMT, D, T>() ? KVLAB_INT4_MMA_WRITE_BLOCKS : (FMT == kvlab::FMT_INT4 && sizeof(T) == 2 && D >= 64 && D <= 256) ? KVLAB_INT4_WRITE_BLOCKS : 2) reshape_and_cache(
    const T* __restrict__ key, const T* __restrict__ value, long long key_stride,
    long long value_stride, uint8_t* __restrict__ cache, const long long* __restrict__ slot_mapping,
    long long num_tokens, int H, int block_size, float k_scale, float v_scale) {
  static_assert(!SWIZZLE || FMT == FMT_NVFP4, "the V-scale swizzle is nvfp4's");
#if defined(KVLAB_INT4_WRITE_MMA8)
  if constexpr (int4_write_uses_mma8<FMT, D, T>()) {
    reshape_and_cache_int4_mma8<D, T>(key, value, key_stride, value_stride, cache, slot_mapping, num_tokens, H,
                                      block_size);
  } else
#endif
#if defined(KVLAB_INT4_WRITE_MMA)
  if constexpr (int4_write_uses_mma<FMT, D, T>()) {
    reshape_and_cache_int4_mma<D, T>(key, value, key_stride, value_stride, cache, slot_mapping, num_tokens, H,
                                     block_size);
  } else
#endif
  if constexpr (FMT == FMT_INT4) {
    using G = Int4Geometry<D, T>;
    constexpr int LANES = G::LANES, VEC = G::VEC, NC = G::NC;
    const int lig = threadIdx.x & (LANES - 1);
    const long long group = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) / LANES;
    const long long token = group / H;
    const int h = static_cast<int>(group - token * H);
    long long slot = -1;
    if (token < num_tokens) slot = slot_mapping[token];
    const bool active = slot >= 0;
    uint4 rk[NC], rv[NC];
    load_kv_chunks<NC, VEC * LANES>(key + token * key_stride + h * D, value + token * value_stride + h * D,
                                    lig * VEC, token < num_tokens, rk, rv);
    const long long blk = active ? slot / block_size : 0;
    const int t = active ? static_cast<int>(slot - blk * block_size) : 0;
    constexpr long long ROW = row_bytes<FMT_INT4>(D);
    const long long side_bytes = static_cast<long long>(block_size) * H * ROW;
    uint8_t* row_k = cache + blk * 2 * side_bytes + (static_cast<long long>(t) * H + h) * ROW;
    // K, then V: only one side's floats are live at a time (V waits as raw words), which keeps
    // the register count low enough for more resident warps to hide the shuffle latencies
    rotate_encode_store_int4<D, T>(rk, active, lig, row_k, key + token * key_stride + h * D + lig * VEC);
    rotate_encode_store_int4<D, T>(rv, active, lig, row_k + side_bytes,
                                   value + token * value_stride + h * D + lig * VEC);
  } else {
  using G = WriteGeometry<FMT, D, T>;
  constexpr int LANES = G::LANES, NC = G::NC;
  static_assert(!SWIZZLE || D >= 64, "the V-scale swizzle needs d/16 % 4 == 0");
  const int lig = threadIdx.x & (LANES - 1);
  const long long group = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) / LANES;
  const long long token = group / H;
  const int h = static_cast<int>(group - token * H);
  long long slot = -1;
  if (token < num_tokens) slot = slot_mapping[token];
  const bool active = slot >= 0;

  uint4 rk[NC], rv[NC];
  load_kv_chunks<NC, G::CSTRIDE>(key + token * key_stride + h * D, value + token * value_stride + h * D,
                                 lig * G::LSTRIDE, token < num_tokens, rk, rv);
  const long long blk = active ? slot / block_size : 0;
  const int t = active ? static_cast<int>(slot - blk * block_size) : 0;

  constexpr long long ROW = FMT == FMT_AUTO ? static_cast<long long>(D) * sizeof(T) : row_bytes<FMT>(D);
  const long long side_bytes = static_cast<long long>(block_size) * H * ROW;  // one (block, side) slab
  uint8_t* slab_k = cache + (blk * 2 + 0) * side_bytes;
  uint8_t* slab_v = slab_k + side_bytes;
  const long long row_off = (static_cast<long long>(t) * H + h) * ROW;
  encode_store<FMT, D, T, false>(rk, active, lig, slab_k + row_off, slab_k, t, h, H, block_size, k_scale);
  encode_store<FMT, D, T, SWIZZLE>(rv, active, lig, slab_v + row_off, slab_v, t, h, H, block_size, v_scale);
  }
}

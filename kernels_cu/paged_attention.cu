// kvlab — paged attention over every cache format (SPEC 2.4). Python op: kvlab/cuda/attention.py.
// Reference: kvlab/reference/attention.py (float64). Building blocks: attention_common.cuh.
//
// paged_attention_decode<FMT, D, T>: one CTA = (work item, KV head, query-head group).
//   A work item is up to 8 query *columns* — (query token, query head) pairs of one sequence
//   that share a KV head — and a range of KV positions (one split of flash-decoding).
//   Decode (query length 1) puts the G query heads of a KV head in the columns, so each KV
//   byte is read once per group. The 4 warps of the CTA take 16-token tiles of the range in
//   turn; per tile a warp computes S = Q·K^T (columns x 16 tokens x k = D, tensor-core mma on
//   operands decoded in registers — int4 on the integer tensor cores — see head_tile_math and
//   attention_common.cuh), the online softmax per column, then O^T += V^T·P^T (m16 dims x n8
//   columns x k16 tokens). Warps are merged in
//   shared memory; the CTA writes the final output (one split) or a float32 partial
//   (m, l, unnormalized o) that paged_attention_reduce<D, T, ROT> merges.
//   INT4: the query is rotated in the prologue (RHT, hadamard.cuh) and the output
//   inverse-rotated in the epilogue / the reduction; K and V stay in the rotated domain.
//
// paged_attention_decode_paged<FMT, D, T> (plan variant "paged", sm_90, at the end of this
//   file): the same work items, one CTA for all KV heads, whole page chunks staged in shared
//   memory by bulk copies (TMA) in a ring of stages; each warp decodes its head's rows from
//   there with the per-head kernel's tile math (head_tile_math, S = Q·K^T).
//
// Bytes: each (token, KV head) row of K and V is read once per CTA that covers it: D/2+4
// bytes per row for int4 (68 at D = 128), D+4 for int8/fp8, D/2+D/16 for nvfp4, 2D for auto.
// Rows of int4/int8/fp8 are only 4-byte aligned (row bytes = D/2+4 or D+4), so their loads
// are 32-bit; nvfp4 data rows and auto rows are 16-byte aligned and use 16-byte loads.
//
// The paged kernel's int4 stages of two full chunks run as one body (stage_pair_int4) since
// session 8 (docs/perf-notes.md, "Session 9 candidate: -DKVLAB_DECODE_STAGE", prepared offline
// and measured on the H200 in session 8: int4 paged B = 32 × 8k 0.1075 vs 0.1119 ms, B = 1 × 128k
// 0.0900 vs 0.0931 ms). -DKVLAB_DECODE_NO_STAGE builds the per-chunk tile math for every stage
// (session 7's kernel) for A/B.
#if !defined(KVLAB_DECODE_NO_STAGE) && !defined(KVLAB_DECODE_STAGE)
#define KVLAB_DECODE_STAGE
#endif
#if defined(KVLAB_DECODE_NO_STAGE) && defined(KVLAB_DECODE_STAGE)
#error "KVLAB_DECODE_STAGE (the default) and KVLAB_DECODE_NO_STAGE exclude each other"
#endif
// The nvfp4 stages run as one body too (stage_body_nvfp4, KVLAB_DECODE_STAGE_NVFP4) since session 9:
// prepared offline in session 8, measured on the H200 in session 9 (docs/perf-notes.md "Session 9",
// call 1): nvfp4 paged B = 32 × 8k 0.1359 / 0.1355 vs 0.1403 / 0.1396 ms (−3 %), B = 1 × 128k
// 0.1034 vs 0.1067 / 0.1048. -DKVLAB_DECODE_NO_STAGE_NVFP4 keeps nvfp4 on the per-chunk body (A/B);
// -DKVLAB_DECODE_NO_STAGE turns both stage bodies off.
#if !defined(KVLAB_DECODE_NO_STAGE) && !defined(KVLAB_DECODE_NO_STAGE_NVFP4) && !defined(KVLAB_DECODE_STAGE_NVFP4)
#define KVLAB_DECODE_STAGE_NVFP4
#endif
#if defined(KVLAB_DECODE_STAGE_NVFP4) && (defined(KVLAB_DECODE_NO_STAGE) || defined(KVLAB_DECODE_NO_STAGE_NVFP4))
#error "KVLAB_DECODE_STAGE_NVFP4 (the default) extends the stage body: not with KVLAB_DECODE_NO_STAGE(_NVFP4)"
#endif
// nvfp4 group scales two E4M3 bytes at a time (KVLAB_DECODE_SCALE_X2, the default since session 35;
// docs/perf-notes.md "Session 34"): tile_scales gathers a thread's two scale bytes of a K row (or
// the two V tokens' bytes of a group) with one PRMT, converts both with one cvt e4m3x2 -> f16x2
// and multiplies by 2^7 in fp16 (exact), instead of one byte at a time through float32 (extract,
// cvt, widen, FMUL, narrow, pack: ~6 instructions per scale, 8 scales per tile and thread at
// d = 128). The scale registers are bit-identical; -DKVLAB_DECODE_NO_SCALE_X2 builds the old path
// for A/B (tests/gpu/test_nvfp4_scale_x2_gpu.py compares the two builds' outputs bit for bit).
// Loop 2,555 -> 2,430 SASS instructions. Measured on H100s only (no H200 was lent in sessions 34-35):
// nvfp4 paged -0.6 % on average over four calls, never slower beyond noise
// (benchmarks/latest/decode/variants_session3{4,5}/).
#if !defined(KVLAB_DECODE_NO_SCALE_X2) && !defined(KVLAB_DECODE_SCALE_X2)
#define KVLAB_DECODE_SCALE_X2
#endif
#if defined(KVLAB_DECODE_NO_SCALE_X2) && defined(KVLAB_DECODE_SCALE_X2)
#error "KVLAB_DECODE_SCALE_X2 (the default) and KVLAB_DECODE_NO_SCALE_X2 exclude each other"
#endif
// The split merge is a programmatic dependent launch of the decode kernel on sm_90 (docs/perf-notes.md
// "Session 12"): each decode CTA allows the merge's launch once its main loop is done
// (griddepcontrol.launch_dependents, before its epilogue), and the merge waits for the whole decode
// grid (griddepcontrol.wait: its completion and its memory) right before it reads the partials;
// what it reads before that (its work item, the query offsets) are inputs, read by strong loads so
// that ptxas keeps them before the wait (session 42; see merge_input_before_wait). The merge's launch
// and its first loads then overlap the last decode CTAs' epilogues: batch 1 × 128k −4 %, B = 32 × 8k
// −1 % (session 12, call 2). The plan launches the merge with the attribute
// (kvlab/cuda/launch.py, launch_dependent) only on sm_90+; elsewhere both instructions are
// compiled out. -DKVLAB_DECODE_NO_PDL compiles them out everywhere and the plan launches the
// merge as an ordinary kernel (A/B; KVLAB_DECODE_PDL=0 does the same on the host side alone).
// Triggering at the decode kernel's *start* instead was measured twice: flat at B = 32, batch 1
// +11 % (session 12: the merge's CTAs sat on the free slots while the decode streamed); with the
// early inputs −0.3 … +0.5 µs at B = 32 × 8k over them and batch 1 × 128k +2.2 … +3.1 µs (session 42,
// H100, the kernels the default picks), so it is not kept.
#if !defined(KVLAB_DECODE_NO_PDL) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define KVLAB_PDL_LAUNCH_DEPENDENTS() asm volatile("griddepcontrol.launch_dependents;" ::: "memory")
#define KVLAB_PDL_WAIT() asm volatile("griddepcontrol.wait;" ::: "memory")
#else
#define KVLAB_PDL_LAUNCH_DEPENDENTS() ((void)0)
#define KVLAB_PDL_WAIT() ((void)0)
#endif
#include "common.cuh"
#include "hadamard.cuh"
#include "attention_common.cuh"

using namespace kvlab;
using namespace kvlab::attn;

namespace {
constexpr int NW = 4;     // warps per CTA
constexpr int NCOL = 8;   // query columns per CTA (the mma N dimension)
// ints per work item (one 64-byte row): seq, tok0, kv_lo, kv_hi | part (-1: final), qs, Lq, L |
// lo16, 0, 0, 0 | b0 … b3 — the query offset, query length and KV length of the sequence, the
// start of the item's first 16-token chunk and the cache blocks of its first four chunks (-1
// past its range), written by the plan (kvlab/cuda/attention.py, _item_meta) from the host
// copies of query_start_loc, seq_lens and block_table. The per-head kernel reads the first five.
constexpr int ITEM = 16;
constexpr int ITEM_PRE = 4;   // chunks whose block the item carries
}  // namespace

// Token order of a decode warp's 16-token tile (lane = 4g + c). The S = Q·K^T mma puts token
// k_token(n) in column n of n-tile 0 (k_token(n) + 8 in n-tile 1), so thread (g, c) ends up
// with the scores of tokens pv_token(c, 0..3) = c, c+4, c+8, c+12 — the tokens of its k-slots
// in the P·V mma. Any order is exact; this one makes the V rows a warp reads at once
// (tokens c + 4i, i fixed) fall on distinct shared-memory banks in the paged kernel's stages
// (H·ROW ≡ 8 words mod 32 at d = 128 with 8 KV heads), where 2c, 2c+1, … put 2 or 4 on each.
__device__ __forceinline__ int k_token(int g) { return (g >> 1) | ((g & 1) << 2); }   // 0,4,1,5,2,6,3,7
__device__ __forceinline__ int pv_token(int c, int i) { return c + 4 * i; }

// Raw bytes of one 16-token tile as a thread of a decode warp holds them (lane = 4g + c):
// K rows of tokens k_token(g) and k_token(g)+8 (KB bytes of the code part: words c, c+4, …
// for int4/int8, RowWords in attention_common.cuh; bytes from c·KB otherwise), V rows of
// tokens pv_token(c, 0..3) (VB bytes: words g, g+8, … or bytes from g·VB) and the nvfp4
// scales. The int4/int8/fp8 parameter words are added by HeadRaw below.
template <int FMT, int D>
struct TileRaw {
  using TR = Traits<FMT, D, __half>;
  static constexpr int KW = TR::KB / 4, VW = TR::VB / 4;
  static constexpr int SW = (FMT == NVFP4) ? D / 64 : 1;
  static constexpr int NGK = (FMT == NVFP4) ? D / 64 : 1;   // nvfp4 K scale groups per thread
  static constexpr int NGV = (FMT == NVFP4) ? (D >= 128 ? D / 128 : 1) : 1;
  uint32_t ka[KW], kb[KW];                  // K: tokens k_token(g), k_token(g) + 8
  uint32_t v0[VW], v1[VW], v2[VW], v3[VW];  // V: tokens pv_token(c, 0..3)
  uint32_t skg[SW], skg8[SW];               // nvfp4: K scale rows of the two K tokens
  uint32_t sv[4][NGV];                      // nvfp4: V scale bytes of the four V tokens
};

// a[idx] for a small register array and a run-time idx, without local memory.
template <int N>
__device__ __forceinline__ uint32_t pick_word(const uint32_t (&a)[N], int idx) {
  uint32_t v = a[0];
#pragma unroll
  for (int j = 1; j < N; ++j) v = (idx == j) ? a[j] : v;
  return v;
}

// nvfp4 group scales of a tile (fp16x2 of sf·2^7, both halves equal): K of the thread's two K
// tokens for the NGK groups of its K bytes (lane c), V of the token pairs (pv_token(c, 0),
// pv_token(c, 1)) and (pv_token(c, 2), pv_token(c, 3)). Zeros for the other formats (the
// operands ignore them). Both tile maths.
template <int FMT, int D>
__device__ __forceinline__ void tile_scales(
    const TileRaw<FMT, D>& r, int c, uint32_t (&sfk_g)[TileRaw<FMT, D>::NGK],
    uint32_t (&sfk_g8)[TileRaw<FMT, D>::NGK], uint32_t (&sfv01)[TileRaw<FMT, D>::NGV],
    uint32_t (&sfv23)[TileRaw<FMT, D>::NGV]) {
  constexpr int NGK = TileRaw<FMT, D>::NGK, NGV = TileRaw<FMT, D>::NGV;
  if constexpr (FMT == NVFP4) {
#if defined(KVLAB_DECODE_SCALE_X2)
    // the thread's NGK scale bytes of a K row are bytes c·NGK … c·NGK + NGK − 1 of its SW words
    // (d = 64: byte c of word 0; d = 128: bytes 2c, 2c + 1 of words 0-1; d = 256: word c)
    if constexpr (NGK == 1) {
      const uint32_t sel = static_cast<uint32_t>(c | (c << 4));   // byte c twice: (sf, sf)
      sfk_g[0] = e4m3x2_to_h2_x128(prmt(r.skg[0], r.skg[0], sel));
      sfk_g8[0] = e4m3x2_to_h2_x128(prmt(r.skg8[0], r.skg8[0], sel));
    } else if constexpr (NGK == 2) {
      static_assert(TileRaw<FMT, D>::SW == 2, "d = 128: 8 scale bytes per row");
      const uint32_t sel = static_cast<uint32_t>((2 * c) | ((2 * c + 1) << 4));
      const uint32_t ha = e4m3x2_to_h2_x128(prmt(r.skg[0], r.skg[1], sel));
      const uint32_t hb = e4m3x2_to_h2_x128(prmt(r.skg8[0], r.skg8[1], sel));
      sfk_g[0] = h2_bcast_lo(ha); sfk_g[1] = h2_bcast_hi(ha);
      sfk_g8[0] = h2_bcast_lo(hb); sfk_g8[1] = h2_bcast_hi(hb);
    } else {
      static_assert(NGK == 4 && TileRaw<FMT, D>::SW == 4, "d = 256: one scale word per thread");
      const uint32_t wa = pick_word(r.skg, c), wb = pick_word(r.skg8, c);
      const uint32_t ha0 = e4m3x2_to_h2_x128(wa), ha1 = e4m3x2_to_h2_x128(wa >> 16);
      const uint32_t hb0 = e4m3x2_to_h2_x128(wb), hb1 = e4m3x2_to_h2_x128(wb >> 16);
      sfk_g[0] = h2_bcast_lo(ha0); sfk_g[1] = h2_bcast_hi(ha0);
      sfk_g[2] = h2_bcast_lo(ha1); sfk_g[3] = h2_bcast_hi(ha1);
      sfk_g8[0] = h2_bcast_lo(hb0); sfk_g8[1] = h2_bcast_hi(hb0);
      sfk_g8[2] = h2_bcast_lo(hb1); sfk_g8[3] = h2_bcast_hi(hb1);
    }
#pragma unroll
    for (int i = 0; i < NGV; ++i) {
      // the V scale bytes sit in the low byte of sv[k][i]: (token 0, token 1) and (2, 3)
      sfv01[i] = e4m3x2_to_h2_x128(prmt(r.sv[0][i], r.sv[1][i], 0x0040u));
      sfv23[i] = e4m3x2_to_h2_x128(prmt(r.sv[2][i], r.sv[3][i], 0x0040u));
    }
#else
#pragma unroll
    for (int i = 0; i < NGK; ++i) {
      const int gi = c * NGK + i;
      // gi depends on the lane: pick the word with compile-time indices (a run-time index
      // would move skg/skg8 to local memory — a 224-byte stack frame at D=128)
      const uint16_t ha = bits16<__half>(e4m3_to_float((pick_word(r.skg, gi >> 2) >> (8 * (gi & 3))) & 0xFFu) * 128.f);
      const uint16_t hb = bits16<__half>(e4m3_to_float((pick_word(r.skg8, gi >> 2) >> (8 * (gi & 3))) & 0xFFu) * 128.f);
      sfk_g[i] = pack2(ha, ha);
      sfk_g8[i] = pack2(hb, hb);
    }
#pragma unroll
    for (int i = 0; i < NGV; ++i) {
      sfv01[i] = pack2(bits16<__half>(e4m3_to_float(r.sv[0][i]) * 128.f), bits16<__half>(e4m3_to_float(r.sv[1][i]) * 128.f));
      sfv23[i] = pack2(bits16<__half>(e4m3_to_float(r.sv[2][i]) * 128.f), bits16<__half>(e4m3_to_float(r.sv[3][i]) * 128.f));
    }
#endif
  } else {
#pragma unroll
    for (int i = 0; i < NGK; ++i) sfk_g[i] = sfk_g8[i] = 0u;
#pragma unroll
    for (int i = 0; i < NGV; ++i) sfv01[i] = sfv23[i] = 0u;
  }
}

// O^T += V^T·P^T for one tile (m16 dims x n8 columns x k16 tokens per m-tile j): the V rows of
// TileRaw as the A operand, P' (pb0, pb1: tokens pv_token(c, 0..1) | pv_token(c, 2..3) of
// column g) as B.
// mlo: the int4 nibble mask (v_operand_fast). Both tile maths.
template <int FMT, int D, typename T>
__device__ __forceinline__ void pv_mma(const TileRaw<FMT, D>& r, float (&acc)[D / 16][4],
                                       const uint32_t (&sfv01)[TileRaw<FMT, D>::NGV],
                                       const uint32_t (&sfv23)[TileRaw<FMT, D>::NGV],
                                       uint32_t pb0, uint32_t pb1, uint32_t mlo) {
  using CTV = typename Traits<FMT, D, T>::CT_PV;
#pragma unroll
  for (int j = 0; j < D / 16; ++j) {
    const int gi = (FMT == NVFP4 && D >= 256) ? ((2 * j) >> 4) : 0;
    const uint32_t a0 = v_operand_fast<FMT, D>(r.v0, r.v1, 2 * j, sfv01[gi], mlo);
    const uint32_t a1 = v_operand_fast<FMT, D>(r.v0, r.v1, 2 * j + 1, sfv01[gi], mlo);
    const uint32_t a2 = v_operand_fast<FMT, D>(r.v2, r.v3, 2 * j, sfv23[gi], mlo);
    const uint32_t a3 = v_operand_fast<FMT, D>(r.v2, r.v3, 2 * j + 1, sfv23[gi], mlo);
    Mma<CTV>::run(acc[j], a0, a1, a2, a3, pb0, pb1);
  }
}

// ---- shared by both decode kernels: the query prologue and the per-column output
// One query column n (one warp, E = D/32 elements per lane): load, rotate (int4, RHT),
// prescale by a power of two so that fp16 cannot overflow, round to the Q·K operand type
// into qrow[0..D) (shared memory). Lane 0 writes Σq (qsum), Σ_d q_d·qk_offset(d) (qoff, the
// operand offsets of k_operand_fast), the log2 softmax scale over the prescale (cscale) and
// the KV position of the query token (qpos, -1 for a padding column).
template <int FMT, int D, typename T>
__device__ __forceinline__ void stage_query_column(
    const T* __restrict__ q, int n, int tok0, int hpc, int tpc, int qs, int Lq, int L,
    int num_q_heads, int qhead0, float scale_log2, int lane, uint16_t* qrow, float* qsum,
    float* qoff, float* cscale, int* qpos) {
  using CTQ = typename Traits<FMT, D, T>::CT_QK;
  constexpr int E = D / 32;
  const int tok = tok0 + n / hpc;
  const bool valid = (n < tpc * hpc) && (tok < Lq);
  const int qhead = qhead0 + n % hpc;
  float x[E];
  const float pre = load_query_vector<FMT, D, T>(q, valid, qs + tok, num_q_heads, qhead, lane, x);
  if constexpr (ImmaQK<FMT>::value) {
    // integer Q·K (attention_common.cuh, ImmaQK): q̂ = RN(q / δ) as limbs hi << 8 | lo; qsum
    // holds Σ q̂ (an int, bit-cast), cscale the softmax scale times δ. A non-finite element makes
    // δ NaN (every score NaN, as the fp16 operands propagate it).
    float amax = 0.f;
    bool bad = false;
#pragma unroll
    for (int j = 0; j < E; ++j) {
      amax = fmaxf(amax, fabsf(x[j]));
      bad |= !(fabsf(x[j]) <= 3.402823466e38f);
    }
    amax = warp_max(amax);
    bad = __any_sync(0xffffffffu, bad);
    // q/δ as (q·(1/max))·Q_FIX: Q_FIX/max would overflow for max below ~1e-34
    const float inv = amax > 0.f ? 1.f / amax : 0.f;
    int si = 0;
#pragma unroll
    for (int j = 0; j < E; ++j) {
      const int qi = bad ? 0 : __float2int_rn(x[j] * inv * Q_FIX);
      const int hi = (qi + 128) >> 8;
      qrow[lane * E + j] = static_cast<uint16_t>((hi << 8) | ((qi - (hi << 8)) & 0xFF));
      si += qi;
    }
    si = __reduce_add_sync(0xffffffffu, si);
    if (lane == 0) {
      *qsum = __int_as_float(si);
      *qoff = 0.f;
      *cscale = bad ? __uint_as_float(0x7fc00000u) : scale_log2 * (amax / Q_FIX);
      *qpos = valid ? (L - Lq + tok) : -1;
    }
    return;
  }
  float s = 0.f, so = 0.f;
#pragma unroll
  for (int j = 0; j < E; ++j) {
    const uint16_t b = bits16<CTQ>(x[j] * pre);
    qrow[lane * E + j] = b;
    const float v = from_bits16<CTQ>(b);
    s += v;
    so += v * qk_offset<FMT>(lane * E + j);
  }
  s = warp_sum(s);
  so = warp_sum(so);
  if (lane == 0) {
    *qsum = s;
    *qoff = so;
    *cscale = scale_log2 / pre;
    *qpos = valid ? (L - Lq + tok) : -1;
  }
}

// All NCOL query columns of one warp together (the paged kernel's prologue; the per-column
// stage_query_column above is the same computation one column at a time, 32 lanes per column):
// QCols::LPC lanes per column (4 for D <= 128; 8 for D = 256, in two passes of four columns),
// each lane holding E = D / LPC consecutive elements. The loads are 16-byte vectors, and the
// rotation, the maximum and the sums reduce over log2(LPC) shuffle levels instead of five, with
// every column of a pass in flight at once, so the prologue is one dependent chain instead of
// NCOL (docs/perf-notes.md, "Session 11"). LPC_: another lane count (the dual-ring CTA's split
// staging, KVLAB_DECODE_DUAL_SPLIT_STAGING: 8 lanes per column, each half one pass of four).
template <int D, typename T, int LPC_ = (D <= 128 ? 4 : 8)>
struct QCols {
  static constexpr int LPC = LPC_;                 // lanes per column
  static constexpr int CPP = 32 / LPC;             // columns per pass
  static constexpr int PASSES = NCOL / CPP;
  static constexpr int E = D / LPC;                // elements per lane: 16 or 32
  static constexpr int NV = E * static_cast<int>(sizeof(T)) / 16;   // 16-byte words per lane
  static_assert(NCOL % CPP == 0 && (E * sizeof(T)) % 16 == 0, "whole passes, whole 16-byte words");
  static_assert(sizeof(T) == 2, "16-bit queries");
};

// The raw query elements of this lane for pass `pass` (QCols::E 16-bit values in NV words;
// zeros for a padding column). 16-byte loads when q is 16-byte aligned (every row then is:
// D·2 bytes is a multiple of 16), element loads otherwise. Issued apart from the math so that
// the paged kernel can put them ahead of its first bulk copies (the q rows then do not queue
// behind the ring's first stages at the DRAM).
template <int D, typename T, int LPC_ = QCols<D, T>::LPC>
__device__ __forceinline__ void load_query_columns(const T* __restrict__ q, int pass, int tok0,
                                                   int hpc, int tpc, int qs, int Lq,
                                                   int num_q_heads, int qhead0, int lane,
                                                   uint4 (&w)[QCols<D, T, LPC_>::NV]) {
  using QC = QCols<D, T, LPC_>;
  const int l = lane % QC::LPC;
  const int n = pass * QC::CPP + lane / QC::LPC;
  const int tok = tok0 + n / hpc;
  const bool valid = (n < tpc * hpc) && (tok < Lq);
  const int qhead = qhead0 + n % hpc;
  if (!valid) {
#pragma unroll
    for (int v = 0; v < QC::NV; ++v) w[v] = make_uint4(0u, 0u, 0u, 0u);
    return;
  }
  const T* qr = q + (static_cast<size_t>(qs + tok) * num_q_heads + qhead) * D + l * QC::E;
  if ((reinterpret_cast<uintptr_t>(q) & 15u) == 0) {
#pragma unroll
    for (int v = 0; v < QC::NV; ++v) w[v] = __ldg(reinterpret_cast<const uint4*>(qr) + v);
  } else {
    const uint16_t* qh = reinterpret_cast<const uint16_t*>(qr);
#pragma unroll
    for (int v = 0; v < QC::NV; ++v) {
      uint32_t u[4];
#pragma unroll
      for (int k = 0; k < 4; ++k)
        u[k] = static_cast<uint32_t>(__ldg(qh + 8 * v + 2 * k)) |
               (static_cast<uint32_t>(__ldg(qh + 8 * v + 2 * k + 1)) << 16);
      w[v] = make_uint4(u[0], u[1], u[2], u[3]);
    }
  }
}

// Stage all NCOL columns from the raw words of pass 0 (w0, load_query_columns; the later passes
// load their own). Writes per column n what stage_query_column writes: row n of q_sm ([NCOL][D]
// 16-bit), qsum[n], qoff[n], cscale[n], qpos[n]. For int4 the values are bit-identical to it
// (the butterflies run in the same order, the sums are integers); for the other formats qsum
// and qoff are float sums in another order (they agree to rounding). LPC_, pass0, npass: the
// dual-ring CTA's split staging stages pass `pass0` only (w0 its raw words) with 8 lanes per
// column, each half of the CTA one pass of four columns.
template <int FMT, int D, typename T, int LPC_ = QCols<D, T>::LPC>
__device__ __forceinline__ void stage_query_columns(
    const T* __restrict__ q, const uint4 (&w0)[QCols<D, T, LPC_>::NV], int tok0, int hpc, int tpc,
    int qs, int Lq, int L, int num_q_heads, int qhead0, float scale_log2, int lane,
    uint16_t* q_sm, float* qsum, float* qoff, float* cscale, int* qpos, int pass0 = 0,
    int npass = QCols<D, T, LPC_>::PASSES) {
  using CTQ = typename Traits<FMT, D, T>::CT_QK;
  using QC = QCols<D, T, LPC_>;
  constexpr int LPC = QC::LPC, E = QC::E, NV = QC::NV;
  const int l = lane % LPC;
#pragma unroll 1
  for (int pass = pass0; pass < pass0 + npass; ++pass) {
    const int n = pass * QC::CPP + lane / LPC;
    const int tok = tok0 + n / hpc;
    const bool valid = (n < tpc * hpc) && (tok < Lq);
    uint4 w[NV];
    if (pass == pass0) {
#pragma unroll
      for (int v = 0; v < NV; ++v) w[v] = w0[v];
    } else {
      load_query_columns<D, T, LPC_>(q, pass, tok0, hpc, tpc, qs, Lq, num_q_heads, qhead0, lane, w);
    }
    float x[E];
#pragma unroll
    for (int v = 0; v < NV; ++v) {
      const T* e = reinterpret_cast<const T*>(&w[v]);
#pragma unroll
      for (int j = 0; j < 8; ++j) x[8 * v + j] = to_float(e[j]);
    }
    if constexpr (FMT == INT4) rht_group<E, LPC>(x, l);
    float amax = 0.f;
#pragma unroll
    for (int j = 0; j < E; ++j) amax = fmaxf(amax, fabsf(x[j]));
    amax = group_max<LPC>(amax);
    uint16_t* qrow = q_sm + n * D + l * E;
    uint32_t packed[E / 2];
    if constexpr (ImmaQK<FMT>::value) {
      // as stage_query_column's integer path (q̂ = RN(q / δ) as limbs), reduced over the group
      int bad = 0;
#pragma unroll
      for (int j = 0; j < E; ++j) bad |= !(fabsf(x[j]) <= 3.402823466e38f);
#pragma unroll
      for (int o = LPC / 2; o > 0; o >>= 1) bad |= __shfl_xor_sync(0xffffffffu, bad, o);
      const float inv = amax > 0.f ? 1.f / amax : 0.f;
      int si = 0;
#pragma unroll
      for (int j = 0; j < E; j += 2) {
        uint32_t h2 = 0;
#pragma unroll
        for (int k = 0; k < 2; ++k) {
          const int qi = bad ? 0 : __float2int_rn(x[j + k] * inv * Q_FIX);
          const int hi = (qi + 128) >> 8;
          h2 |= static_cast<uint32_t>(static_cast<uint16_t>((hi << 8) | ((qi - (hi << 8)) & 0xFF))) << (16 * k);
          si += qi;
        }
        packed[j / 2] = h2;
      }
#pragma unroll
      for (int o = LPC / 2; o > 0; o >>= 1) si += __shfl_xor_sync(0xffffffffu, si, o);
      if (l == 0) {
        qsum[n] = __int_as_float(si);
        qoff[n] = 0.f;
        cscale[n] = bad ? __uint_as_float(0x7fc00000u) : scale_log2 * (amax / Q_FIX);
        qpos[n] = valid ? (L - Lq + tok) : -1;
      }
    } else {
      // the prescale of query_vector_prescale: 2^-e so that |q| < 2^15 (fp16 operands; exact)
      float pre = 1.f;
      if constexpr (FMT != AUTO) {
        const int ex = static_cast<int>((__float_as_uint(amax) >> 23) & 0xFF) - 127;
        pre = ex > 14 ? __uint_as_float(static_cast<uint32_t>(127 - (ex - 14)) << 23) : 1.f;
      }
      float s = 0.f, so = 0.f;
#pragma unroll
      for (int j = 0; j < E; j += 2) {
        const uint16_t b0 = bits16<CTQ>(x[j] * pre), b1 = bits16<CTQ>(x[j + 1] * pre);
        packed[j / 2] = static_cast<uint32_t>(b0) | (static_cast<uint32_t>(b1) << 16);
        const float v0 = from_bits16<CTQ>(b0), v1 = from_bits16<CTQ>(b1);
        s += v0;
        so += v0 * qk_offset<FMT>(l * E + j);
        s += v1;
        so += v1 * qk_offset<FMT>(l * E + j + 1);
      }
      s = group_sum<LPC>(s);
      so = group_sum<LPC>(so);
      if (l == 0) {
        qsum[n] = s;
        qoff[n] = so;
        cscale[n] = scale_log2 / pre;
        qpos[n] = valid ? (L - Lq + tok) : -1;
      }
    }
    // qrow is 16-byte aligned: q_sm is, and n·D, l·E are multiples of 8 elements
#pragma unroll
    for (int v = 0; v < E / 8; ++v)
      reinterpret_cast<uint4*>(qrow)[v] =
          make_uint4(packed[4 * v], packed[4 * v + 1], packed[4 * v + 2], packed[4 * v + 3]);
  }
}

// KV range of a CTA: its split [kv_lo, kv_hi) cut to what the columns can see (query KV
// positions qpos[n], -1 for a padding column): below the last query position + 1 and, with a
// window, from the first query's window start. Returns the number of 16-token tiles from
// lo16 (the start rounded down to a multiple of 16); pmin / pmax: the valid query positions.
__device__ __forceinline__ int kv_tiles(const int (&qpos)[NCOL], int kv_lo, int kv_hi,
                                        int window, int& pmin, int& pmax, int& lo16) {
  pmax = -1; pmin = 0x7fffffff;
#pragma unroll
  for (int n = 0; n < NCOL; ++n) {
    const int p = qpos[n];
    if (p >= 0) { pmax = max(pmax, p); pmin = min(pmin, p); }
  }
  int lo = kv_lo, hi = min(kv_hi, pmax + 1);
  if (window > 0) lo = max(lo, pmin - window + 1);
  lo16 = lo & ~15;
  return hi > lo16 ? (hi - lo16 + 15) >> 4 : 0;
}

// A warp's O^T accumulators (thread (g, c): columns 2c, 2c+1 at dims pv_dim(g, 2j + {0, 1}),
// adjacent) minus the int4 zero-point terms z0, z1 of those columns, into the column rows
// ow[n·D + dim] (shared memory).
template <int FMT, int D>
__device__ __forceinline__ void store_acc_columns(float* ow, const float (&acc)[D / 16][4],
                                                  float z0, float z1, int g, int c) {
#pragma unroll
  for (int j = 0; j < D / 16; ++j) {
    const int dim = pv_dim<FMT, D>(g, 2 * j);
    *reinterpret_cast<float2*>(ow + (2 * c) * D + dim) = make_float2(acc[j][0] - z0, acc[j][2] - z0);
    *reinterpret_cast<float2*>(ow + (2 * c + 1) * D + dim) = make_float2(acc[j][1] - z1, acc[j][3] - z1);
  }
}

// The output columns that hold a query row: column n is query head n % hpc of token tok0 + n / hpc,
// so the columns with a row are a prefix of the NCOL — hpc of them per token, min(tpc, Lq − tok0)
// tokens. A decode item (Lq = 1) at G = 4 has 4 of 8 (9 / 3 heads: 3). Only those are finished:
// no partial is written for the others, and the merge has no warp or CTA for them (the plan's
// red_cols, kvlab/cuda/attention.py). That saves half the epilogue stores at 32 / 8 heads and
// doubles the merge CTAs per SM (128 threads, not 256): on an H100, -0.6 … -1.6 µs at batch 32 ×
// 8k, -2.4 … -3.7 µs at 64 × 4k (docs/perf-notes.md "Session 44"). -DKVLAB_DECODE_ALL_COLUMNS
// builds the previous default, which finishes and merges all NCOL.
__device__ __forceinline__ int query_columns(int tok0, int hpc, int tpc, int Lq) {
#ifdef KVLAB_DECODE_ALL_COLUMNS
  return NCOL;
#else
  const int toks = Lq - tok0 < tpc ? Lq - tok0 : tpc;
  return toks * hpc;
#endif
}

// A lane's E = D / 32 consecutive floats of a split partial's row (workspace ws_o: slot·D + lane·E,
// 4·E-byte aligned — the workspace is our own allocation, 256-byte aligned, and D ≥ 64) as one
// vector access (E = 2: 8 bytes, 4: 16, 8: two of 16) instead of E scalar ones.
// The default since session 47 (docs/perf-notes.md "Session 47"): until then the decode's
// partial stores and the merge's partial loads were E scalar 4-byte accesses per lane (SASS:
// 4 STG.E / LDG.E.CONSTANT at d = 128, each warp instruction touching 16 sectors with 4 of every
// 16 bytes) — 4x the memory instructions and L2 sector requests of the same bytes. The values and
// the arithmetic are unchanged, so outputs are bit-identical. Measured with the merge's addresses
// before its wait (below), H100, three A/B pairs: every quantized paged decode faster, B = 32 × 8k
// −0.1 … −0.9 µs, 64 × 4k −0.3 … −0.7, batch 1 × 128k −0.9 … −1.2. -DKVLAB_DECODE_PARTIAL_SCALAR
// builds the scalar accesses and the merge's late address arithmetic (A/B). Written with the
// intrinsics (stores st.global.cg: the merge reads them from L2 on another SM; loads ld.global.nc
// as before), because a plain float4 store through the cast pointer came out of NVVM as four
// scalar stores.
template <int E>
__device__ __forceinline__ void store_piece(float* __restrict__ p, const float (&x)[E]) {
  static_assert(E == 2 || E == 4 || E == 8, "a partial's row piece: 2, 4 or 8 floats");
  if constexpr (E == 2) {
    __stcg(reinterpret_cast<float2*>(p), make_float2(x[0], x[1]));
  } else {
#pragma unroll
    for (int k = 0; k < E / 4; ++k)
      __stcg(reinterpret_cast<float4*>(p) + k, make_float4(x[4 * k], x[4 * k + 1], x[4 * k + 2], x[4 * k + 3]));
  }
}
template <int E>
__device__ __forceinline__ void load_piece(const float* __restrict__ p, float (&x)[E]) {
  static_assert(E == 2 || E == 4 || E == 8, "a partial's row piece: 2, 4 or 8 floats");
  if constexpr (E == 2) {
    const float2 v = __ldg(reinterpret_cast<const float2*>(p));
    x[0] = v.x;
    x[1] = v.y;
  } else {
#pragma unroll
    for (int k = 0; k < E / 4; ++k) {
      const float4 v = __ldg(reinterpret_cast<const float4*>(p) + k);
      x[4 * k] = v.x;
      x[4 * k + 1] = v.y;
      x[4 * k + 2] = v.z;
      x[4 * k + 3] = v.w;
    }
  }
}

// One output column n (one warp, E elements per lane, unnormalized, V factor applied) with
// softmax max M and sum Ls: the float32 partial of split `part` at `slot`, or the final row
// (÷ Ls, int4 inverse rotation) for a valid column.
template <int FMT, int D, typename T>
__device__ __forceinline__ void finish_column(
    float (&x)[D / 32], float M, float Ls, int part, size_t slot, T* __restrict__ out, int n,
    int tok0, int hpc, int tpc, int qs, int Lq, int num_q_heads, int qhead0,
    float* __restrict__ ws_o, float* __restrict__ ws_ml, int lane) {
  constexpr int E = D / 32;
  if (part >= 0) {
#ifndef KVLAB_DECODE_PARTIAL_SCALAR
    store_piece<E>(ws_o + slot * D + lane * E, x);
    if (lane == 0) __stcg(reinterpret_cast<float2*>(ws_ml + 2 * slot), make_float2(M, Ls));
#else
#pragma unroll
    for (int j = 0; j < E; ++j) ws_o[slot * D + lane * E + j] = x[j];
    if (lane == 0) { ws_ml[2 * slot] = M; ws_ml[2 * slot + 1] = Ls; }
#endif
  } else {
    const float inv = Ls > 0.f ? 1.f / Ls : 0.f;
#pragma unroll
    for (int j = 0; j < E; ++j) x[j] *= inv;
    if constexpr (FMT == INT4) inverse_rht_group<E, 32>(x, lane);
    const int tok = tok0 + n / hpc;
    if (n < tpc * hpc && tok < Lq) {
      const int qhead = qhead0 + n % hpc;
      T* orow = out + (static_cast<size_t>(qs + tok) * num_q_heads + qhead) * D + lane * E;
#pragma unroll
      for (int j = 0; j < E; ++j) orow[j] = from_float<T>(x[j]);
    }
  }
}

// ---- paged_attention_decode: per-warp tile in the S = Q·K^T orientation
// The raw bytes of one 16-token tile as a thread of a decode warp holds them: TileRaw plus the
// int4/int8/fp8 parameter words (scale, zero point) of the thread's tokens pv_token(c, 0..3):
//   * per-head kernel (PAR_LOADED false): one word per lane, `par` = token lane & 15 of side
//     lane >> 4, handed to the lanes that need it by 8 shuffles (token_scores);
//   * paged kernel (PAR_LOADED true): kp[i] / vp[i] = the K / V words of token pv_token(c, i),
//     read straight from the staged page (8 loads, a quad's lanes share each word: no
//     shuffles and no shuffle-lane arithmetic).
// Unused members cost nothing (the compiler drops them).
template <int FMT, int D>
struct HeadRaw : TileRaw<FMT, D> {
  uint32_t par;
  uint32_t kp[4], vp[4];
};

template <bool B> struct MaskTag { static constexpr bool value = B; };
template <int N> struct IntTag { static constexpr int value = N; };

// Per-thread byte offsets of a tile's loads from the tile's base (fixed for the whole range:
// a 16-token tile lies in one block, the rows sit at fixed offsets from the block's slab).
template <int FMT, int D>
struct HeadOffsets {
  static constexpr int NGV = HeadRaw<FMT, D>::NGV;
  uint32_t kg, kg8, v[4], par, skg, skg8, sv[4][NGV];   // unsigned: zero-extended adds
};

// This thread's offsets (lane = 4g + c, KV head kvh of H) from a 16-token tile's row 0 of the
// K side, in a layout of `side` bytes per side and, for nvfp4, the scale part `sbase` bytes
// into a side: K rows of tokens k_token(g), k_token(g) + 8 (first word), V rows of tokens
// pv_token(c, 0..3) (first word), the parameter word of token lane & 15 on side lane >> 4,
// nvfp4 scale bytes. The per-head kernel passes a cache slab, the paged kernel a staged side
// in shared memory (same formulas). int4/int8/fp8 rows are read as interleaved words
// (RowWords: K words c + 4i, V words g + 8i; fp8 since session 20), nvfp4/auto as KB / VB
// consecutive bytes.
template <int FMT, int D>
__device__ __forceinline__ void head_offsets(HeadOffsets<FMT, D>& of, int g, int c, int lane, int kvh, int H,
                                             int side, int sbase, int swizzle_v) {
  using TR = Traits<FMT, D, __half>;
  constexpr int DROW = (FMT == NVFP4) ? D / 2 : TR::ROW;   // code part of a row
  constexpr int S = D / 16;                                // nvfp4 scales per row
  constexpr bool IL = RowWords<FMT>::INTERLEAVED;
  const int t4[4] = {pv_token(c, 0), pv_token(c, 1), pv_token(c, 2), pv_token(c, 3)};
  const int kt = k_token(g);
  const int HR = H * DROW;   // one token of the code part
  of.kg = (kt * H + kvh) * DROW + (IL ? 4 * c : c * TR::KB);
  of.kg8 = of.kg + 8 * HR;
#pragma unroll
  for (int i = 0; i < 4; ++i) of.v[i] = side + (t4[i] * H + kvh) * DROW + (IL ? 4 * g : g * TR::VB);
  {
    constexpr int OFF = (FMT == INT4) ? D / 2 : D;   // parameter word after the codes
    of.par = (lane >> 4) * side + ((lane & 15) * H + kvh) * TR::ROW + OFF;
  }
  if constexpr (FMT == NVFP4) {
    of.skg = sbase + (kt * H + kvh) * S;
    of.skg8 = sbase + ((kt + 8) * H + kvh) * S;
#pragma unroll
    for (int i = 0; i < HeadOffsets<FMT, D>::NGV; ++i) {
      const int grp = (g * (D / 8)) / 16 + i;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        int tt, gg;   // tiles start at a multiple of 16: the swizzle is local
        v_scale_pos<S>(t4[k], grp, swizzle_v, tt, gg);
        of.sv[k][i] = side + sbase + (tt * H + kvh) * S + gg;
      }
    }
  }
}

// The phases of one warp's 16-token tile at KV positions p0 .. p0+15, its 8 query columns.
//   S = Q·K^T as m16 (columns g; rows 8..15 zero) x n8 (tokens) x k = D, two n-tiles: the
//   accumulators hold (column g, tokens pv_token(c, 0..3)), which is exactly the B
//   fragment of O^T += V^T·P^T: P stays in registers, and the softmax of a column is reduced
//   over the 4 lanes of a quad only (2 shuffles). The accumulator rescale is skipped unless
//   some column's running max grew (warp vote; exact: the factor would be 1).
// head_tile_math runs them for one tile; head_tile_pair (paged kernel) for two tiles with one
// softmax update, so that the two tiles' independent mma chains overlap.

// S = Q·K^T of one tile: s[i] = raw dot product of column g with token tt[i] = pv_token(c, i):
// 2c+8, 2c+9. A = the quad {q(kk), q(kk+1)} of two k-chunks: rows g hold chunk kk, rows g+8
// chunk kk+1 (no zero registers). Chunk kk's product lands in rows g of the "even"
// accumulators, chunk kk+1's in rows g+8 of the "odd" ones; the rest is discarded.
// sl*: tokens 0..7 (n = token g of this thread's K row ka), sh*: tokens 8..15 (kb).
template <int FMT, int D, typename T>
__device__ __forceinline__ void qk_scores(const TileRaw<FMT, D>& r, const uint32_t (&qa)[D / 16][2],
                                          const uint32_t (&sfk_g)[TileRaw<FMT, D>::NGK],
                                          const uint32_t (&sfk_g8)[TileRaw<FMT, D>::NGK], uint32_t mlo,
                                          uint32_t mhi, float (&s)[4]) {
  using CTQ = typename Traits<FMT, D, T>::CT_QK;
  constexpr int KC = D / 16;
  float sle[4] = {0.f, 0.f, 0.f, 0.f}, slo[4] = {0.f, 0.f, 0.f, 0.f};
  float she[4] = {0.f, 0.f, 0.f, 0.f}, sho[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int kk = 0; kk < KC; kk += 2) {
    const int gi0 = (FMT == NVFP4) ? (kk >> 2) : 0, gi1 = (FMT == NVFP4) ? ((kk + 1) >> 2) : 0;
    const uint32_t a0 = qa[kk][0], a1 = qa[kk + 1][0], a2 = qa[kk][1], a3 = qa[kk + 1][1];
    Mma<CTQ>::run(sle, a0, a1, a2, a3, k_operand_fast<FMT, D>(r.ka, kk, 0, sfk_g[gi0], mlo, mhi),
                  k_operand_fast<FMT, D>(r.ka, kk, 1, sfk_g[gi0], mlo, mhi));
    Mma<CTQ>::run(she, a0, a1, a2, a3, k_operand_fast<FMT, D>(r.kb, kk, 0, sfk_g8[gi0], mlo, mhi),
                  k_operand_fast<FMT, D>(r.kb, kk, 1, sfk_g8[gi0], mlo, mhi));
    Mma<CTQ>::run(slo, a0, a1, a2, a3, k_operand_fast<FMT, D>(r.ka, kk + 1, 0, sfk_g[gi1], mlo, mhi),
                  k_operand_fast<FMT, D>(r.ka, kk + 1, 1, sfk_g[gi1], mlo, mhi));
    Mma<CTQ>::run(sho, a0, a1, a2, a3, k_operand_fast<FMT, D>(r.kb, kk + 1, 0, sfk_g8[gi1], mlo, mhi),
                  k_operand_fast<FMT, D>(r.kb, kk + 1, 1, sfk_g8[gi1], mlo, mhi));
  }
  s[0] = sle[0] + slo[2]; s[1] = sle[1] + slo[3]; s[2] = she[0] + sho[2]; s[3] = she[1] + sho[3];
}

// S = Q·K^T of one tile on the integer tensor cores (ImmaQK): I[i] = Σ_d q̂_d·code_d of column g
// and token pv_token(c, i) (tokens k_token(n) in n-tile 0 from the thread's K row ka, + 8 from
// kb), the hi and lo limb sums (rows g, g + 8) combined as 256·hi + lo.
template <int FMT, int D>
__device__ __forceinline__ void qk_scores_imma(const TileRaw<FMT, D>& r, const uint32_t (&qa)[D / 16][2],
                                               int (&I)[4]) {
  // four accumulator chains (n-tile × k-step parity): a single chain per n-tile serializes the
  // mma latencies (int8 paged, H200: 0.1762 -> 0.1874 ms with two chains)
  int ca[2][4] = {{0, 0, 0, 0}, {0, 0, 0, 0}}, cb[2][4] = {{0, 0, 0, 0}, {0, 0, 0, 0}};
#pragma unroll
  for (int s = 0; s < D / 32; ++s) {
    const uint32_t a0 = qa[2 * s][0], a1 = qa[2 * s][1], a2 = qa[2 * s + 1][0], a3 = qa[2 * s + 1][1];
    if constexpr (FMT == INT4) {
      imma_s8<true>(ca[s & 1], a0, a1, a2, a3, r.ka[s] & 0x0F0F0F0Fu, (r.ka[s] >> 4) & 0x0F0F0F0Fu);
      imma_s8<true>(cb[s & 1], a0, a1, a2, a3, r.kb[s] & 0x0F0F0F0Fu, (r.kb[s] >> 4) & 0x0F0F0F0Fu);
    } else {
      imma_s8<false>(ca[s & 1], a0, a1, a2, a3, r.ka[2 * s], r.ka[2 * s + 1]);
      imma_s8<false>(cb[s & 1], a0, a1, a2, a3, r.kb[2 * s], r.kb[2 * s + 1]);
    }
  }
  I[0] = (ca[0][0] + ca[1][0]) * 256 + (ca[0][2] + ca[1][2]);
  I[1] = (ca[0][1] + ca[1][1]) * 256 + (ca[0][3] + ca[1][3]);
  I[2] = (cb[0][0] + cb[1][0]) * 256 + (cb[0][2] + cb[1][2]);
  I[3] = (cb[0][1] + cb[1][1]) * 256 + (cb[0][3] + cb[1][3]);
}

// Scores of tokens tt[i] (log2 domain, scaled; -inf where masked) and their V scale / zero
// point, from the per-token parameter words (HeadRaw: shuffled from lanes tt[i] and 16 + tt[i],
// or loaded by this lane when PAR_LOADED).
// MASKED: the tile may hold positions past L, after a query position or outside the window
// (the other tiles skip every bounds and mask test).
// SV: float (the fp16 mma's raw dot products) or int (qk_scores_imma's sums: cs includes δ and
// qsum is Σ q̂ bit-cast).
template <int FMT, int D, bool MASKED, bool PAR_LOADED, typename SV>
__device__ __forceinline__ void token_scores(const SV (&s)[4], const HeadRaw<FMT, D>& r, int p0, float qsum,
                                             float qoff, float cs, float kc, int qpos, int L, int window, int c,
                                             float (&x)[4], float (&vsc)[4], float (&vzp)[4]) {
  const int tt[4] = {pv_token(c, 0), pv_token(c, 1), pv_token(c, 2), pv_token(c, 3)};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float ksc = 1.f, koff = 0.f;
    int kz = 0;   // int4 K zero point (integer Q·K)
    vsc[i] = 1.f; vzp[i] = 0.f;
    if constexpr (FMT == INT4 || FMT == INT8 || FMT == FP8) {
      const uint32_t wk = PAR_LOADED ? r.kp[i] : __shfl_sync(0xffffffffu, r.par, tt[i]);
      const uint32_t wv = PAR_LOADED ? r.vp[i] : __shfl_sync(0xffffffffu, r.par, 16 + tt[i]);
      if constexpr (FMT == INT4) {
        ksc = __uint_as_float(wk & ~0xFu);
        koff = static_cast<float>(wk & 0xFu);
        kz = static_cast<int>(wk & 0xFu);
        vsc[i] = __uint_as_float(wv & ~0xFu);
        vzp[i] = 128.f + static_cast<float>(wv & 0xFu);
      } else {
        ksc = __uint_as_float(wk);
        vsc[i] = __uint_as_float(wv);
        if constexpr (FMT == FP8) vsc[i] *= FP8_V_P;
      }
    }
    float v;
    if constexpr (ImmaQK<FMT>::value && FMT == INT4)
      v = __int2float_rn(s[i] - kz * __float_as_int(qsum)) * (ksc * cs);
    else if constexpr (ImmaQK<FMT>::value) v = __int2float_rn(s[i]) * (ksc * cs);
    else if constexpr (FMT == INT4) v = (s[i] - fmaf(koff, qsum, qoff)) * (ksc * cs);
    else if constexpr (FMT == INT8 || FMT == FP8) v = (s[i] - qoff) * (ksc * cs);
    else v = s[i] * kc;
    if constexpr (MASKED) {
      const int kp = p0 + tt[i];
      const bool ok = kp < L && kp <= qpos && (window <= 0 || kp > qpos - window);
      v = ok ? v : neg_inf();
    }
    x[i] = v;
  }
}

// Online softmax of column g over N scores of this thread (the quad holds the tile's tokens):
// new running max m (rescaling l, z and the accumulators when it grew), e[i] = 2^(x[i] - m),
// l += Σ e.
// The running max of a column moves to mx (log2 units) when any lane's grew: l, z and the
// accumulator columns 2c, 2c+1 are rescaled by exp2(m_old - m_new). Shared by online_softmax and
// the int4 stage body.
template <int D>
__device__ __forceinline__ void softmax_move_max(float mx, float& m, float& l, float& z, float (&acc)[D / 16][4],
                                                 int c) {
  if (__any_sync(0xffffffffu, mx > m)) {
    const float mn = fmaxf(m, mx);
    const float al = ex2_approx(m - mn);
    m = mn;
    l *= al;
    z *= al;
    // acc columns are 2c, 2c+1: the factors of lanes 8c (g = 2c) and 8c + 4 (g = 2c + 1)
    const float a0 = __shfl_sync(0xffffffffu, al, 8 * c);
    const float a1 = __shfl_sync(0xffffffffu, al, 8 * c + 4);
#pragma unroll
    for (int j = 0; j < D / 16; ++j) {
      acc[j][0] *= a0; acc[j][1] *= a1; acc[j][2] *= a0; acc[j][3] *= a1;
    }
  }
}

// The max of a column's N scores of one or two tiles: the thread's N, then across the quad's
// 4 lanes (online_softmax, stage_softmax).
template <int N>
__device__ __forceinline__ float quad_column_max(const float (&x)[N]) {
  static_assert(N == 4 || N == 8, "one or two tiles");
  float mx = fmaxf(fmaxf(x[0], x[1]), fmaxf(x[2], x[3]));
  if constexpr (N == 8) mx = fmaxf(mx, fmaxf(fmaxf(x[4], x[5]), fmaxf(x[6], x[7])));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
  return fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
}

template <int N, int D>
__device__ __forceinline__ void online_softmax(const float (&x)[N], float& m, float& l, float& z,
                                               float (&acc)[D / 16][4], int c, float (&e)[N]) {
  float mx = quad_column_max<N>(x);
  softmax_move_max<D>(mx, m, l, z, acc, c);
#pragma unroll
  for (int i = 0; i < N; ++i) e[i] = ex2_approx(x[i] - m);
#pragma unroll
  for (int i = 0; i < N; i += 4) l += (e[i] + e[i + 1]) + (e[i + 2] + e[i + 3]);
}

// P' = P · (V scale of the token), rounded to the P·V operand type: the B fragment (pb0: tokens
// pv_token(c, 0..1), pb1: pv_token(c, 2..3)); int4: z += Σ_t P'_t·(128 + zp_t), from the
// rounded P' the mma sees.
template <int FMT, int D, typename T>
__device__ __forceinline__ void pack_p(const float (&e)[4], const float (&vsc)[4], const float (&vzp)[4], float& z,
                                       uint32_t& pb0, uint32_t& pb1) {
  using CTV = typename Traits<FMT, D, T>::CT_PV;
  pb0 = pack_f2<CTV>(e[0] * vsc[0], e[1] * vsc[1]);
  pb1 = pack_f2<CTV>(e[2] * vsc[2], e[3] * vsc[3]);
  if constexpr (FMT == INT4) {
    z = fmaf(__uint_as_float(pb0 << 16), vzp[0], z);
    z = fmaf(__uint_as_float(pb0 & 0xFFFF0000u), vzp[1], z);
    z = fmaf(__uint_as_float(pb1 << 16), vzp[2], z);
    z = fmaf(__uint_as_float(pb1 & 0xFFFF0000u), vzp[3], z);
  }
}

// One tile: S, scores, softmax update, O^T += V^T·P^T (paged_attention_decode, and the paged
// kernel's odd last tile).
template <int FMT, int D, typename T, bool MASKED, bool PAR_LOADED = false>
__device__ __forceinline__ void head_tile_math(
    const HeadRaw<FMT, D>& r, int p0, float (&acc)[D / 16][4], float& m, float& l, float& z,
    const uint32_t (&qa)[D / 16][2], float qsum, float qoff, float cs, float kc, int qpos,
    int L, int window, uint32_t mlo, uint32_t mhi, int lane) {
  constexpr int NGK = TileRaw<FMT, D>::NGK;
  constexpr int NGV = TileRaw<FMT, D>::NGV;
  const int c = lane & 3;
  // nvfp4 group scales (fp16x2 of sf·2^7)
  uint32_t sfk_g[NGK], sfk_g8[NGK], sfv01[NGV], sfv23[NGV];
  tile_scales<FMT, D>(r, c, sfk_g, sfk_g8, sfv01, sfv23);
  float x[4], vsc[4], vzp[4], e[4];
  if constexpr (ImmaQK<FMT>::value) {
    int s[4];
    qk_scores_imma<FMT, D>(r, qa, s);
    token_scores<FMT, D, MASKED, PAR_LOADED>(s, r, p0, qsum, qoff, cs, kc, qpos, L, window, c, x, vsc, vzp);
  } else {
    float s[4];
    qk_scores<FMT, D, T>(r, qa, sfk_g, sfk_g8, mlo, mhi, s);
    token_scores<FMT, D, MASKED, PAR_LOADED>(s, r, p0, qsum, qoff, cs, kc, qpos, L, window, c, x, vsc, vzp);
  }
  online_softmax<4, D>(x, m, l, z, acc, c, e);
  uint32_t pb0, pb1;
  pack_p<FMT, D, T>(e, vsc, vzp, z, pb0, pb1);
  pv_mma<FMT, D, T>(r, acc, sfv01, sfv23, pb0, pb1, mlo);
}

// Two tiles at p0 and p0 + 16 (ra, rb) with one softmax update over their 32 tokens: the
// S = Q·K^T chains of both tiles are independent (the scheduler overlaps them), and the max
// reduction, rescale vote and exp2 run once per 32 tokens. Same results as two head_tile_math
// calls up to float32 rounding (the running max is taken over both tiles at once).
template <int FMT, int D, typename T, bool MASKED, bool PAR_LOADED = false>
__device__ __forceinline__ void head_tile_pair(
    const HeadRaw<FMT, D>& ra, const HeadRaw<FMT, D>& rb, int p0, float (&acc)[D / 16][4], float& m,
    float& l, float& z, const uint32_t (&qa)[D / 16][2], float qsum, float qoff, float cs, float kc,
    int qpos, int L, int window, uint32_t mlo, uint32_t mhi, int lane) {
  constexpr int NGK = TileRaw<FMT, D>::NGK;
  constexpr int NGV = TileRaw<FMT, D>::NGV;
  const int c = lane & 3;
  uint32_t sfk_a[NGK], sfk_a8[NGK], sfv01_a[NGV], sfv23_a[NGV];
  uint32_t sfk_b[NGK], sfk_b8[NGK], sfv01_b[NGV], sfv23_b[NGV];
  tile_scales<FMT, D>(ra, c, sfk_a, sfk_a8, sfv01_a, sfv23_a);
  tile_scales<FMT, D>(rb, c, sfk_b, sfk_b8, sfv01_b, sfv23_b);
  float x[8], vsc_a[4], vzp_a[4], vsc_b[4], vzp_b[4], e[8];
  float xa[4], xb[4];
  if constexpr (ImmaQK<FMT>::value) {
    int sa[4], sb[4];
    qk_scores_imma<FMT, D>(ra, qa, sa);
    qk_scores_imma<FMT, D>(rb, qa, sb);
    token_scores<FMT, D, MASKED, PAR_LOADED>(sa, ra, p0, qsum, qoff, cs, kc, qpos, L, window, c, xa, vsc_a, vzp_a);
    token_scores<FMT, D, MASKED, PAR_LOADED>(sb, rb, p0 + 16, qsum, qoff, cs, kc, qpos, L, window, c, xb, vsc_b,
                                             vzp_b);
  } else {
    float sa[4], sb[4];
    qk_scores<FMT, D, T>(ra, qa, sfk_a, sfk_a8, mlo, mhi, sa);
    qk_scores<FMT, D, T>(rb, qa, sfk_b, sfk_b8, mlo, mhi, sb);
    token_scores<FMT, D, MASKED, PAR_LOADED>(sa, ra, p0, qsum, qoff, cs, kc, qpos, L, window, c, xa, vsc_a, vzp_a);
    token_scores<FMT, D, MASKED, PAR_LOADED>(sb, rb, p0 + 16, qsum, qoff, cs, kc, qpos, L, window, c, xb, vsc_b,
                                             vzp_b);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) { x[i] = xa[i]; x[4 + i] = xb[i]; }
  online_softmax<8, D>(x, m, l, z, acc, c, e);
  uint32_t pa0, pa1, pb0, pb1;
  const float ea[4] = {e[0], e[1], e[2], e[3]}, eb[4] = {e[4], e[5], e[6], e[7]};
  pack_p<FMT, D, T>(ea, vsc_a, vzp_a, z, pa0, pa1);
  pack_p<FMT, D, T>(eb, vsc_b, vzp_b, z, pb0, pb1);
  pv_mma<FMT, D, T>(ra, acc, sfv01_a, sfv23_a, pa0, pa1, mlo);
  pv_mma<FMT, D, T>(rb, acc, sfv01_b, sfv23_b, pb0, pb1, mlo);
}

#ifdef KVLAB_DECODE_STAGE
// ---- KVLAB_DECODE_STAGE (the default since session 8; docs/perf-notes.md "Session 9 candidate"): the paged
// kernel's int4 stage of two full 16-token chunks as one unit. Same results as two
// head_tile_math calls up to float32 rounding (one softmax update per 32 tokens, as
// head_tile_pair; the softmax scale applied in the exp2's FFMA).
// S = Q·K^T of one int4 tile on the integer tensor cores with one accumulator chain per n-tile
// (the pair's two tiles give the ILP that qk_scores_imma's parity split gives one tile): I[i] =
// 256·hi + lo of column g and token pv_token(c, i), the same integers as qk_scores_imma.
template <int D>
__device__ __forceinline__ void stage_qk_int4(const TileRaw<INT4, D>& r, const uint32_t (&qa)[D / 16][2],
                                              int (&I)[4]) {
  int ca[4] = {0, 0, 0, 0}, cb[4] = {0, 0, 0, 0};
#pragma unroll
  for (int s = 0; s < D / 32; ++s) {
    const uint32_t a0 = qa[2 * s][0], a1 = qa[2 * s][1], a2 = qa[2 * s + 1][0], a3 = qa[2 * s + 1][1];
    imma_s8<true>(ca, a0, a1, a2, a3, r.ka[s] & 0x0F0F0F0Fu, (r.ka[s] >> 4) & 0x0F0F0F0Fu);
    imma_s8<true>(cb, a0, a1, a2, a3, r.kb[s] & 0x0F0F0F0Fu, (r.kb[s] >> 4) & 0x0F0F0F0Fu);
  }
  I[0] = ca[0] * 256 + ca[2];
  I[1] = ca[1] * 256 + ca[3];
  I[2] = cb[0] * 256 + cb[2];
  I[3] = cb[1] * 256 + cb[3];
}

// Unscaled scores x'[i] = (I − kz·Σq̂)·ksc (nq = −Σq̂; the score is x'·cs) and the V scale /
// 128 + zero point of tokens pv_token(c, i), from the parameter words the paged kernel loaded
// (PAR_LOADED). 128 + zp is built as its float bits: 0x43000000 is 128.0f, whose ulp is 2^-16,
// so zp·2^16 added to the bits adds zp (exact, zp ≤ 15).
template <int D>
__device__ __forceinline__ void stage_scores_int4(const int (&I)[4], const HeadRaw<INT4, D>& r, int nq,
                                                  float (&x)[4], float (&vsc)[4], float (&vzp)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t wk = r.kp[i], wv = r.vp[i];
    const int kz = static_cast<int>(wk & 0xFu);
    x[i] = __int2float_rn(I[i] + kz * nq) * __uint_as_float(wk & ~0xFu);
    vsc[i] = __uint_as_float(wv & ~0xFu);
    vzp[i] = __uint_as_float(0x43000000u + ((wv & 0xFu) << 16));
  }
}

// Online-softmax update of column g over N unscaled scores x' of a stage (the quad holds its
// tokens; stage_pair_int4 and, under KVLAB_DECODE_STAGE_NVFP4, stage_body_nvfp4): m = sc·max x'
// (exact: sc ≥ 0, rounding is monotonic), the lazy rescale, e = 2^(x'·sc − m) in one FFMA,
// l += Σ e (for N = 8 as ((4 terms) + (4 terms))). m, l, z, acc stay in head_tile_math's scaled
// domain (the edge stages run that).
template <int N, int D>
__device__ __forceinline__ void stage_softmax(const float (&x)[N], float sc, float& m, float& l, float& z,
                                              float (&acc)[D / 16][4], int c, float (&e)[N]) {
  float mx = quad_column_max<N>(x);
  mx *= sc;
  softmax_move_max<D>(mx, m, l, z, acc, c);
  const float nm = -m;
#pragma unroll
  for (int i = 0; i < N; ++i) e[i] = ex2_approx(fmaf(x[i], sc, nm));
  if constexpr (N == 4) l += (e[0] + e[1]) + (e[2] + e[3]);
  else l += ((e[0] + e[1]) + (e[2] + e[3])) + ((e[4] + e[5]) + (e[6] + e[7]));
}

// Two full int4 tiles (ra at p0, rb at p0 + 16) with one online-softmax update: the column max
// is taken over the unscaled x' and scaled once (m = cs·max x': exact, since cs ≥ 0 and
// rounding is monotonic), e = 2^(x'·cs − m) in one FFMA; m, l, z, acc stay in the scaled
// domain of head_tile_math (the edge stages run that).
template <int D, typename T>
__device__ __forceinline__ void stage_pair_int4(const HeadRaw<INT4, D>& ra, const HeadRaw<INT4, D>& rb,
                                                float (&acc)[D / 16][4], float& m, float& l, float& z,
                                                const uint32_t (&qa)[D / 16][2], int nq, float cs, uint32_t mlo,
                                                int lane) {
  const int c = lane & 3;
  int Ia[4], Ib[4];
  stage_qk_int4<D>(ra, qa, Ia);
  stage_qk_int4<D>(rb, qa, Ib);
  float xa[4], xb[4], vsc_a[4], vzp_a[4], vsc_b[4], vzp_b[4];
  stage_scores_int4<D>(Ia, ra, nq, xa, vsc_a, vzp_a);
  stage_scores_int4<D>(Ib, rb, nq, xb, vsc_b, vzp_b);
  const float x[8] = {xa[0], xa[1], xa[2], xa[3], xb[0], xb[1], xb[2], xb[3]};
  float e[8];
  stage_softmax<8, D>(x, cs, m, l, z, acc, c, e);
  const float ea[4] = {e[0], e[1], e[2], e[3]}, eb[4] = {e[4], e[5], e[6], e[7]};
  uint32_t pa0, pa1, pb0, pb1;
  pack_p<INT4, D, T>(ea, vsc_a, vzp_a, z, pa0, pa1);
  pack_p<INT4, D, T>(eb, vsc_b, vzp_b, z, pb0, pb1);
  const uint32_t none[1] = {0u};
  pv_mma<INT4, D, T>(ra, acc, none, none, pa0, pa1, mlo);
  pv_mma<INT4, D, T>(rb, acc, none, none, pb0, pb1, mlo);
}

#ifdef KVLAB_DECODE_STAGE_NVFP4
// ---- KVLAB_DECODE_STAGE_NVFP4 (docs/perf-notes.md "Session 9 candidate: -DKVLAB_DECODE_STAGE_NVFP4"):
// the stage-level body for nvfp4 (fp16 Q·K path), session 8's -DKVLAB_DECODE_STAGE_ALL restricted
// to nvfp4: a stage whose chunks (two at d = 64 / 128, one at d = 256) are all full runs one body
// with one online-softmax update per stage and the softmax scale kc in the exp2's FFMA, as
// stage_pair_int4. The unscaled score x' is the raw dot product s of qk_scores (the score is
// s·kc), the V factor of pack_p is 1 (the scales are in the MMA's V operand). Same results as
// head_tile_math per chunk up to float32 rounding.
// NT = 1 or 2 full tiles (ra at p0, rb at p0 + 16; rb unused for NT = 1) as one unit: both
// S = Q·K^T chains, one softmax update, both P·V.
template <int D, typename T, int NT>
__device__ __forceinline__ void stage_body_nvfp4(const HeadRaw<NVFP4, D>& ra, const HeadRaw<NVFP4, D>& rb,
                                                 float (&acc)[D / 16][4], float& m, float& l, float& z,
                                                 const uint32_t (&qa)[D / 16][2], float kc, uint32_t mlo,
                                                 uint32_t mhi, int lane) {
  static_assert(NT == 1 || NT == 2, "one or two tiles");
  constexpr int NGK = TileRaw<NVFP4, D>::NGK;
  constexpr int NGV = TileRaw<NVFP4, D>::NGV;
  const int c = lane & 3;
  uint32_t sfk_a[NGK], sfk_a8[NGK], sfv01_a[NGV], sfv23_a[NGV];
  uint32_t sfk_b[NGK], sfk_b8[NGK], sfv01_b[NGV], sfv23_b[NGV];
  float x[4 * NT], e[4 * NT], sa[4], sb[4];
  const float vsc[4] = {1.f, 1.f, 1.f, 1.f};   // nvfp4: V scales in the MMA operand
  const float vzp[4] = {0.f, 0.f, 0.f, 0.f};   // int4 only (pack_p)
  tile_scales<NVFP4, D>(ra, c, sfk_a, sfk_a8, sfv01_a, sfv23_a);
  qk_scores<NVFP4, D, T>(ra, qa, sfk_a, sfk_a8, mlo, mhi, sa);
  if constexpr (NT == 2) {
    tile_scales<NVFP4, D>(rb, c, sfk_b, sfk_b8, sfv01_b, sfv23_b);
    qk_scores<NVFP4, D, T>(rb, qa, sfk_b, sfk_b8, mlo, mhi, sb);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) x[i] = sa[i];
  if constexpr (NT == 2) {
#pragma unroll
    for (int i = 0; i < 4; ++i) x[4 + i] = sb[i];
  }
  stage_softmax<4 * NT, D>(x, kc, m, l, z, acc, c, e);
  uint32_t pa0, pa1;
  const float ea[4] = {e[0], e[1], e[2], e[3]};
  pack_p<NVFP4, D, T>(ea, vsc, vzp, z, pa0, pa1);
  if constexpr (NT == 2) {
    uint32_t pb0, pb1;
    const float eb[4] = {e[4 * (NT - 1)], e[4 * (NT - 1) + 1], e[4 * (NT - 1) + 2], e[4 * (NT - 1) + 3]};
    pack_p<NVFP4, D, T>(eb, vsc, vzp, z, pb0, pb1);
    pv_mma<NVFP4, D, T>(ra, acc, sfv01_a, sfv23_a, pa0, pa1, mlo);
    pv_mma<NVFP4, D, T>(rb, acc, sfv01_b, sfv23_b, pb0, pb1, mlo);
  } else {
    pv_mma<NVFP4, D, T>(ra, acc, sfv01_a, sfv23_a, pa0, pa1, mlo);
  }
}
#endif  // KVLAB_DECODE_STAGE_NVFP4
#endif  // KVLAB_DECODE_STAGE

template <int FMT, int D, typename T>
// CTAs per SM the register budget is sized for; KVLAB_DECODE_INT4_MIN_CTAS (an NVRTC -D, see
// KVLAB_NVRTC_OPTIONS in kvlab/cuda/loader.py) overrides the int4 value for experiments.
#ifndef KVLAB_DECODE_INT4_MIN_CTAS
#define KVLAB_DECODE_INT4_MIN_CTAS 4
#endif
__global__ void __launch_bounds__(NW * 32, (D > 128 ? 2 : FMT == INT4 ? KVLAB_DECODE_INT4_MIN_CTAS : (FMT == AUTO && D == 128) ? 4 : 3))
paged_attention_decode(const T* __restrict__ q, T* __restrict__ out,
                       const uint8_t* __restrict__ cache, const int* __restrict__ block_table,
                       int bt_stride, const int* __restrict__ seq_lens,
                       const int* __restrict__ query_start_loc, const int* __restrict__ items,
                       int num_kv_heads, int num_q_heads, int hpc, int tpc, int bs_log2,
                       float scale_log2, float k_scale, float v_scale, int window, int swizzle_v,
                       float* __restrict__ ws_o, float* __restrict__ ws_ml) {
  using TR = Traits<FMT, D, T>;
  using Raw = HeadRaw<FMT, D>;
  using Off = HeadOffsets<FMT, D>;
  static_assert(D == 64 || D == 128 || D == 256, "head sizes 64, 128, 256");
  constexpr int E = D / 32;        // elements per lane in the prologue / epilogue
  constexpr int KC = D / 16;       // k-chunks of Q·K, m-tiles of P·V
  constexpr int KW = Raw::KW, VW = Raw::VW;
  constexpr int NGV = Raw::NGV;
  constexpr int S = D / 16;        // nvfp4 scales per row
  constexpr bool PREFETCH = (2 * KW + 4 * VW) <= 32;          // two raw tiles fit in registers
  // bytes per (token, head) of the part holding the codes: the whole row, or nvfp4's data
  constexpr int DROW = (FMT == NVFP4) ? D / 2 : TR::ROW;

  __shared__ __align__(16) uint16_t q_sm[NCOL * D];
  __shared__ float qsum_sm[NCOL], qoff_sm[NCOL], cscale_sm[NCOL];
  __shared__ int qpos_sm[NCOL];
  __shared__ __align__(16) float o_sm[NW][NCOL * D];
  __shared__ float m_sm[NW][NCOL], l_sm[NW][NCOL];

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, c = lane & 3;
  const int* it = items + ITEM * blockIdx.x;
  const int seq = it[0], tok0 = it[1], kv_lo = it[2], kv_hi = it[3], part = it[4];
  const int H = num_kv_heads;
  const int G = num_q_heads / H;
  const int nhg = G / hpc;
  const int kvh = blockIdx.y / nhg, hg = blockIdx.y % nhg;
  const int qhead0 = kvh * G + hg * hpc;
  const int qs = query_start_loc[seq];
  const int Lq = query_start_loc[seq + 1] - qs;
  const int L = seq_lens[seq];
  const int BS = 1 << bs_log2;

  // ---- prologue: query columns -> shared memory (rotated for int4, prescaled, rounded)
  for (int n = warp; n < NCOL; n += NW)
    stage_query_column<FMT, D, T>(q, n, tok0, hpc, tpc, qs, Lq, L, num_q_heads, qhead0,
                                  scale_log2, lane, q_sm + n * D, &qsum_sm[n], &qoff_sm[n],
                                  &cscale_sm[n], &qpos_sm[n]);
  __syncthreads();

  // Q operand (A fragment, row g = column g; rows 8..15 are zero), in the dim order of K.
  // The paged kernel packs the same registers (its B fragment) with the same loop, written
  // out there too: as a shared function it changes that kernel's SASS (register allocation
  // and schedule of all 30 instantiations, NVRTC 13.5, sm_90).
  uint32_t qa[KC][2];
  if constexpr (ImmaQK<FMT>::value) {
    imma_query_regs<FMT, D>(q_sm + g * D, c, qa);
  } else {
#pragma unroll
    for (int kk = 0; kk < KC; ++kk)
#pragma unroll
      for (int p = 0; p < 2; ++p)
        qa[kk][p] = pack2(q_sm[g * D + qk_dim<FMT, D>(c, kk, p, 0)],
                          q_sm[g * D + qk_dim<FMT, D>(c, kk, p, 1)]);
  }
  const float qsum = qsum_sm[g], qoff = qoff_sm[g], cs = cscale_sm[g];
  const float kc = (FMT == NVFP4) ? 128.f * k_scale * cs : cs;
  const int qpos = qpos_sm[g];

  // KV range of this CTA: its split, cut to what the columns can see
  int pmin, pmax, lo16;
  const int ntiles = kv_tiles(qpos_sm, kv_lo, kv_hi, window, pmin, pmax, lo16);
  // Tiles [tf0, tf1) need no bounds or mask test: every position < L, ≤ every query position
  // and inside every column's window. The others (the last one, causal or window edges) do.
  const int tend = (pmin < L ? pmin + 1 : L) - lo16;
  int tf1 = tend > 0 ? min(tend >> 4, ntiles) : 0;
  int tf0 = 0;
  if (window > 0) {
    const int wlo = pmax - window - lo16;   // full iff p0 > pmax - window
    tf0 = wlo >= 0 ? min(wlo / 16 + 1, ntiles) : 0;
  }
  tf1 = max(tf1, tf0);

  float acc[KC][4];
#pragma unroll
  for (int j = 0; j < KC; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
  float m = NEG_BIG, l = 0.f, z = 0.f;

  // ---- this thread's load offsets within a tile (bytes from the tile's row 0 of the K side)
  const int side = BS * H * TR::ROW;                 // one (block, side) slab
  const size_t slab2 = static_cast<size_t>(2) * side;
  const int HR = H * DROW;                            // one token of the code part
  const int sbase = BS * H * (D / 2);                 // nvfp4: scale part of a slab
  const int t4[4] = {pv_token(c, 0), pv_token(c, 1), pv_token(c, 2), pv_token(c, 3)};
  const int kt = k_token(g);   // K rows of tokens kt, kt + 8
  Off of;
  head_offsets<FMT, D>(of, g, c, lane, kvh, H, side, sbase, swizzle_v);
  const int* bt = block_table + static_cast<size_t>(seq) * bt_stride;
  // int4 nibble masks (k_operand_fast / v_operand_fast), pinned in registers (pinned_u32):
  // as plain constants ptxas re-creates them with an IMAD.MOV before most of the ~50 operand
  // LOP3s of a tile (session 4, SASS: loop 2166 -> 2040 instructions at d = 128). An earlier
  // attempt (OR-ing a run-time zero) made ptxas split each operand into two LOP3s instead.
#ifdef KVLAB_UNPINNED_MASKS
  const uint32_t mlo = 0x000F000Fu, mhi = 0x00F000F0u;
#else
  const uint32_t mlo = pinned_u32<0x000F000Fu>(), mhi = pinned_u32<0x00F000F0u>();
#endif

  // block id of tile t (a global load: the full-tile pipeline below issues it a tile early)
  auto block_of = [&](int t) { return bt[(lo16 + 16 * t) >> bs_log2]; };
  auto tile_load_b = [&](Raw& r, int t, int blk, auto masked_tag) {
    constexpr bool MK = decltype(masked_tag)::value;
    const int p0 = lo16 + 16 * t;
    const int o = p0 & (BS - 1);
    const uint8_t* slab = cache + static_cast<size_t>(blk) * slab2;
    const uint8_t* base = slab + static_cast<uint32_t>(o * HR);
    const bool in_g = !MK || p0 + kt < L, in_g8 = !MK || p0 + kt + 8 < L;
    if constexpr (RowWords<FMT>::INTERLEAVED) {   // words c + 4i (K), g + 8i (V)
      load_words_strided<TR::KB / 4, 16>(base + of.kg, r.ka, in_g);
      load_words_strided<TR::KB / 4, 16>(base + of.kg8, r.kb, in_g8);
      load_words_strided<TR::VB / 4, 32>(base + of.v[0], r.v0, !MK || p0 + t4[0] < L);
      load_words_strided<TR::VB / 4, 32>(base + of.v[1], r.v1, !MK || p0 + t4[1] < L);
      load_words_strided<TR::VB / 4, 32>(base + of.v[2], r.v2, !MK || p0 + t4[2] < L);
      load_words_strided<TR::VB / 4, 32>(base + of.v[3], r.v3, !MK || p0 + t4[3] < L);
    } else {
      load_words<TR::KB, TR::ALIGN>(base + of.kg, r.ka, in_g);
      load_words<TR::KB, TR::ALIGN>(base + of.kg8, r.kb, in_g8);
      load_words<TR::VB, TR::ALIGN>(base + of.v[0], r.v0, !MK || p0 + t4[0] < L);
      load_words<TR::VB, TR::ALIGN>(base + of.v[1], r.v1, !MK || p0 + t4[1] < L);
      load_words<TR::VB, TR::ALIGN>(base + of.v[2], r.v2, !MK || p0 + t4[2] < L);
      load_words<TR::VB, TR::ALIGN>(base + of.v[3], r.v3, !MK || p0 + t4[3] < L);
    }
    if constexpr (FMT == INT4 || FMT == INT8 || FMT == FP8) {
      const bool ok = !MK || p0 + (lane & 15) < L;
      r.par = ok ? __ldg(reinterpret_cast<const unsigned*>(base + of.par)) : 0u;
    } else {
      r.par = 0u;
    }
    if constexpr (FMT == NVFP4) {
      const uint8_t* sb = slab + static_cast<uint32_t>(o * (H * S));
      load_words<S, 4>(sb + of.skg, r.skg, in_g);
      load_words<S, 4>(sb + of.skg8, r.skg8, in_g8);
#pragma unroll
      for (int i = 0; i < NGV; ++i)
#pragma unroll
        for (int k = 0; k < 4; ++k)
          r.sv[k][i] = (!MK || p0 + t4[k] < L) ? static_cast<uint32_t>(__ldg(sb + of.sv[k][i])) : 0u;
    }
  };
  auto tile_load = [&](Raw& r, int t, auto masked_tag) { tile_load_b(r, t, block_of(t), masked_tag); };
  using Full = MaskTag<false>;
  using Edge = MaskTag<true>;
  auto tile_math = [&](const Raw& r, int t, auto masked_tag) {
    constexpr bool MK = decltype(masked_tag)::value;
    head_tile_math<FMT, D, T, MK>(r, lo16 + 16 * t, acc, m, l, z, qa, qsum, qoff, cs, kc, qpos,
                                  L, window, mlo, mhi, lane);
  };

  // ---- full tiles [tf0, tf1), warp w takes tf0 + w, tf0 + w + NW, ... Software pipeline:
  // the next tile's loads are in flight while this tile is computed (formats whose raw tile
  // fits in ~40 registers; the others load and compute in turn), and the block id of the tile
  // after that is loaded before this tile's math, so no tile's data loads wait on a block-table
  // load issued just before them (Nsight Compute: that dependent chain was ~11 % of the stall
  // samples of the int4 kernel, benchmarks/latest/ncu/).
  // The early block ids cost a register during the math: int4 and fp8 at d = 128 sit at their
  // register caps (128 / 168) and would spill, so they keep loading the block id with the tile.
  constexpr bool BT_AHEAD = !(FMT == INT4 || FMT == FP8);
  if constexpr (PREFETCH && !BT_AHEAD) {
    Raw cur, nxt;
    int t = tf0 + warp;
    if (t < tf1) tile_load(cur, t, Full{});
    for (; t < tf1; t += 2 * NW) {
      if (t + NW < tf1) tile_load(nxt, t + NW, Full{});
      tile_math(cur, t, Full{});
      if (t + NW >= tf1) break;
      if (t + 2 * NW < tf1) tile_load(cur, t + 2 * NW, Full{});
      tile_math(nxt, t + NW, Full{});
    }
  } else if constexpr (PREFETCH) {
    Raw cur, nxt;
    int t = tf0 + warp;
    int b1 = t + NW < tf1 ? block_of(t + NW) : 0;   // block of the next tile
    if (t < tf1) tile_load(cur, t, Full{});
    for (; t < tf1; t += 2 * NW) {
      const int b2 = t + 2 * NW < tf1 ? block_of(t + 2 * NW) : 0;
      if (t + NW < tf1) tile_load_b(nxt, t + NW, b1, Full{});
      tile_math(cur, t, Full{});
      if (t + NW >= tf1) break;
      b1 = t + 3 * NW < tf1 ? block_of(t + 3 * NW) : 0;
      if (t + 2 * NW < tf1) tile_load_b(cur, t + 2 * NW, b2, Full{});
      tile_math(nxt, t + NW, Full{});
    }
  } else {
    for (int t = tf0 + warp; t < tf1; t += NW) {
      Raw cur;
      tile_load(cur, t, Full{});
      tile_math(cur, t, Full{});
    }
  }
  // ---- edge tiles [0, tf0) and [tf1, ntiles), with bounds and masks
  {
    const int nedge = tf0 + (ntiles - tf1);
    for (int i = warp; i < nedge; i += NW) {
      const int t = i < tf0 ? i : tf1 + (i - tf0);
      Raw cur;
      tile_load(cur, t, Edge{});
      tile_math(cur, t, Edge{});
    }
  }

  KVLAB_PDL_LAUNCH_DEPENDENTS();   // the merge may launch now (it waits for this grid before its reads)
  // ---- merge the quad's partial sums (column g), then the warps
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);
  z += __shfl_xor_sync(0xffffffffu, z, 1);
  z += __shfl_xor_sync(0xffffffffu, z, 2);
  {
    const float z0 = __shfl_sync(0xffffffffu, z, 8 * c), z1 = __shfl_sync(0xffffffffu, z, 8 * c + 4);
    store_acc_columns<FMT, D>(o_sm[warp], acc, z0, z1, g, c);
    if (c == 0) { m_sm[warp][g] = m; l_sm[warp][g] = l; }
  }
  __syncthreads();
  const float vfac = (FMT == NVFP4) ? 128.f * v_scale : (FMT == FP8) ? FP8_V_OUT : 1.f;
  const int ncol = query_columns(tok0, hpc, tpc, Lq);   // the columns with a row (ALL_COLUMNS: NCOL)
  for (int n = warp; n < ncol; n += NW) {
    float M = m_sm[0][n];
#pragma unroll
    for (int w = 1; w < NW; ++w) M = fmaxf(M, m_sm[w][n]);
    float x[E], Ls = 0.f;
#pragma unroll
    for (int j = 0; j < E; ++j) x[j] = 0.f;
#pragma unroll
    for (int w = 0; w < NW; ++w) {
      const float f = ex2_approx(m_sm[w][n] - M);
      Ls += l_sm[w][n] * f;
#pragma unroll
      for (int j = 0; j < E; ++j) x[j] += o_sm[w][n * D + lane * E + j] * f;
    }
#pragma unroll
    for (int j = 0; j < E; ++j) x[j] *= vfac;
    const size_t slot = (static_cast<size_t>(part < 0 ? 0 : part) * gridDim.y + blockIdx.y) * NCOL + n;
    finish_column<FMT, D, T>(x, M, Ls, part, slot, out, n, tok0, hpc, tpc, qs, Lq, num_q_heads,
                             qhead0, ws_o, ws_ml, lane);
  }
}

// The merge's inputs — its work item and the query offsets — are read before griddepcontrol.wait,
// while the decode grid still runs. Plain loads through the kernel's const __restrict__ pointers
// would be ld.global.nc, and ptxas moves those past griddepcontrol.wait: the merge of sessions 30-41
// ran ACQBULK first, then the item's loads and, behind them, the query offsets' (the non-split form,
// B = 32 × 8k's) — a dependent chain of DRAM round trips (the timer flushes L2) between the release
// and the first load of a partial (found in session 41 with scripts/sass_stats.py; docs/perf-notes.md
// "Session 41"). Strong loads (ld.relaxed.gpu) stay in program order before it
// (tests/test_kernels_compile.py checks the PTX and the SASS). Measured in session 42 (H100, six
// A/B pairs, docs/perf-notes.md "Session 42"): the default picks at B = 32 × 8k −0.6 … −1.5 µs,
// batch 1 × 128k and 64 × 4k flat. -DKVLAB_DECODE_MERGE_LATE_INPUTS builds the plain loads (A/B).
__device__ __forceinline__ int merge_input_before_wait(const int* p) {
  int v;
  asm volatile("ld.relaxed.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}
// the item row: 4 ints, 16-byte aligned (the plan's reduction rows follow the work rows of ITEM = 16
// ints in one buffer, kvlab/cuda/attention.py)
__device__ __forceinline__ int4 merge_item_before_wait(const int* p) {
  int4 v;
  asm volatile("ld.relaxed.gpu.global.v4.b32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// Merge the splits of flash-decoding. Item: seq, tok0, part0, nparts (the parts are consecutive).
// Reads nparts·(D + 2) floats per column, writes D elements.
//   SPLIT = false: one CTA = (reduction item, column group y), one warp per column.
//   SPLIT = true (few items, e.g. batch 1: the plan picks it when the CTAs above would not fill
//   the SMs): one CTA = (item, y, column blockIdx.z); its 8 warps take interleaved runs of RU
//   parts each and are summed in shared memory, so a column costs ~nparts/(8·RU) dependent L2
//   round trips instead of ~nparts/RU (batch 1 × 128k: 63 parts, 8 CTAs -> 64; CUPTI measured
//   the unsplit merge at 8.9 µs there, docs/perf-notes.md "Session 9").
template <int D, typename T, bool ROT, bool SPLIT>
__global__ void __launch_bounds__(NCOL * 32)
paged_attention_reduce(T* __restrict__ out, const float* __restrict__ ws_o,
                       const float* __restrict__ ws_ml, const int* __restrict__ red_items,
                       const int* __restrict__ query_start_loc, int num_kv_heads,
                       int num_q_heads, int hpc, int tpc) {
  constexpr int E = D / 32;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int n = SPLIT ? blockIdx.z : warp;   // the column
#ifndef KVLAB_DECODE_MERGE_LATE_INPUTS
  // the work item and the query offsets: inputs, loaded before griddepcontrol.wait (see
  // merge_item_before_wait) so that only the partials' loads follow the decode grid's release
  const int4 itm = merge_item_before_wait(red_items + 4 * blockIdx.x);
  const int seq = itm.x, tok0 = itm.y, part0 = itm.z, nparts = itm.w;
  const int qs = merge_input_before_wait(query_start_loc + seq);
  const int Lq = merge_input_before_wait(query_start_loc + seq + 1) - qs;
#else
  const int* it = red_items + 4 * blockIdx.x;
  const int seq = it[0], tok0 = it[1], part0 = it[2], nparts = it[3];
#endif
  const int G = num_q_heads / num_kv_heads;
  const int nhg = G / hpc;
  const int kvh = blockIdx.y / nhg, hg = blockIdx.y % nhg;
#ifdef KVLAB_DECODE_MERGE_LATE_INPUTS
  const int qs = query_start_loc[seq];
  const int Lq = query_start_loc[seq + 1] - qs;
#endif
  const int tok = tok0 + n / hpc;
  const bool valid = (n < tpc * hpc) && (tok < Lq);
#ifdef KVLAB_DECODE_ALL_COLUMNS
  if (SPLIT && !valid) return;   // the whole CTA (n = blockIdx.z), before its __syncthreads
#else
  // a column without a query row has no partials (query_columns): its warp (SPLIT: its whole CTA,
  // before the __syncthreads) ends here. The plan launches only the first red_cols columns, so
  // this is left for the items of a mixed batch with fewer rows than the longest.
  if (!valid) return;
#endif
#ifndef KVLAB_DECODE_PARTIAL_SCALAR
  // The partials' addresses depend on the item only: part p of this column is slot s0 + p·step.
  // Computed here, before the wait, and pinned there by an empty asm (NVVM sinks address
  // arithmetic to its use, and ptxas keeps it after the wait: ~150 instructions of 64-bit slot
  // arithmetic between ACQBULK and the first partial load in the d = 128 non-split merge).
  const size_t step = static_cast<size_t>(gridDim.y) * NCOL;
  const size_t s0 = (static_cast<size_t>(part0) * gridDim.y + blockIdx.y) * NCOL + n;
  const float* o_base = ws_o + s0 * D + lane * E;        // this lane's piece of part 0's row
  const float* ml_base = ws_ml + 2 * s0;                 // part 0's (m, l)
  const float* ml_lane = ml_base + 2 * step * lane;      // part `lane`'s (m, l)
#ifndef KVLAB_DECODE_MERGE_LATE_INPUTS   // (that A/B build keeps its item loads after the wait)
  asm volatile("" : "+l"(o_base), "+l"(ml_base), "+l"(ml_lane));
#endif
#endif
  KVLAB_PDL_WAIT();   // the decode grid's partials: everything above reads only inputs
#ifdef KVLAB_DECODE_MERGE_PROBE
  // measurement only, wrong outputs (docs/perf-notes.md "Session 28"): the merge launched and
  // released as always, then nothing read or written — what the launch and the wait cost alone
  return;
#endif
  // (m, l) of the parts spread over the lanes (one long serial chain per warp was the batch-1
  // bottleneck: ~2 L2 latencies per part); the o rows 4 parts at a time, loads in flight.
  auto slot_of = [&](int p) {
    return (static_cast<size_t>(part0 + p) * gridDim.y + blockIdx.y) * NCOL + n;
  };
  // the o rows RU parts at a time: all their loads (the part's m and its row piece) are issued
  // before any is used, so a column costs ~nparts/RU dependent L2 round trips (batch 1 at 128k
  // has ~250 parts per column: with 4 in flight the merge took tens of µs)
#ifdef KVLAB_DECODE_MERGE_RU
  constexpr int RU = KVLAB_DECODE_MERGE_RU;   // A/B (docs/perf-notes.md "Session 11", call 8)
  static_assert(RU == 4 || RU == 8 || RU == 16, "KVLAB_DECODE_MERGE_RU: 4, 8 or 16");
#else
  constexpr int RU = 8;
#endif
#ifndef KVLAB_DECODE_PARTIAL_SCALAR
  // one vector load per part (load_piece) from o_base + p·step·D; a padding part (past nparts)
  // reads nothing (predicated off, so its address may lie past the workspace)
  auto load_run = [&](int p0, float (&mp)[RU], float (&o)[RU][E]) {
    const float* src = o_base + static_cast<size_t>(p0) * step * D;
    const float* mls = ml_base + static_cast<size_t>(p0) * step * 2;
#pragma unroll
    for (int u = 0; u < RU; ++u) {
      mp[u] = NEG_BIG;
#pragma unroll
      for (int j = 0; j < E; ++j) o[u][j] = 0.f;
      if (p0 + u < nparts) {
        mp[u] = __ldg(mls + static_cast<size_t>(u) * step * 2);
        load_piece<E>(src + static_cast<size_t>(u) * step * D, o[u]);
      }
    }
  };
#else
  auto load_run = [&](int p0, float (&mp)[RU], float (&o)[RU][E]) {
#pragma unroll
    for (int u = 0; u < RU; ++u) {
      const bool in = p0 + u < nparts;
      const size_t slot = slot_of(in ? p0 + u : p0);
      mp[u] = in ? ws_ml[2 * slot] : NEG_BIG;
      const float* src = ws_o + slot * D + lane * E;
#pragma unroll
      for (int j = 0; j < E; ++j) o[u][j] = in ? src[j] : 0.f;
    }
  };
#endif
#ifndef KVLAB_DECODE_MERGE_TWOPASS
  // the warp's first run of RU parts (m and o rows) is loaded before the (m, l) pass, so both are
  // in flight together — one L2 round trip fewer per column (a column of at most RU parts, B = 32
  // × 8k's 4, then costs one round trip in all): −0.3 … −1.4 µs per call with a merge (H100,
  // session 28); on the H200 (session 30, A B A B) B = 32 × 8k −0.8 … −1.4 µs for every format,
  // batch 1 × 128k −0.3 … −0.6 µs (docs/perf-notes.md). -DKVLAB_DECODE_MERGE_TWOPASS keeps the
  // earlier order, every run loaded after the (m, l) pass (A/B).
  const int first = (SPLIT ? warp : 0) * RU;   // this warp's first run of parts
  float mp1[RU], o1[RU][E];
  load_run(first, mp1, o1);
#endif
  // (m, l) of up to 32·PL parts per pass in registers, loaded at once (one round trip per pass
  // instead of two per 32 parts), merged online across passes
  constexpr int PL = 8;
  float M = NEG_BIG, Ls = 0.f;
  for (int b = 0; b < nparts; b += 32 * PL) {
    float mm[PL], ll[PL];
#pragma unroll
    for (int u = 0; u < PL; ++u) {
      const int p = b + 32 * u + lane;
#ifndef KVLAB_DECODE_PARTIAL_SCALAR
      const float2 v = p < nparts
          ? __ldg(reinterpret_cast<const float2*>(ml_lane + static_cast<size_t>(b + 32 * u) * step * 2))
          : make_float2(NEG_BIG, 0.f);
#else
      const float2 v = p < nparts ? *reinterpret_cast<const float2*>(ws_ml + 2 * slot_of(p))
                                  : make_float2(NEG_BIG, 0.f);
#endif
      mm[u] = v.x;
      ll[u] = v.y;
    }
    float mb = mm[0];
#pragma unroll
    for (int u = 1; u < PL; ++u) mb = fmaxf(mb, mm[u]);
    mb = warp_max(mb);
    const float mn = fmaxf(M, mb);
    float lb = 0.f;
#pragma unroll
    for (int u = 0; u < PL; ++u) lb += ll[u] * exp2f(mm[u] - mn);
    Ls = Ls * exp2f(M - mn) + warp_sum(lb);
    M = mn;
  }
  float x[E];
#pragma unroll
  for (int j = 0; j < E; ++j) x[j] = 0.f;
  constexpr int NSL = SPLIT ? NCOL : 1;   // warps sharing a column
  for (int p0 = (SPLIT ? warp : 0) * RU; p0 < nparts; p0 += NSL * RU) {
#ifndef KVLAB_DECODE_MERGE_TWOPASS
    if (p0 != first) load_run(p0, mp1, o1);   // the first run is in already
    float (&mp)[RU] = mp1;
    float (&o)[RU][E] = o1;
#else
    float mp[RU], o[RU][E];
    load_run(p0, mp, o);
#endif
#pragma unroll
    for (int u = 0; u < RU; ++u) {
      const float f = exp2f(mp[u] - M);   // 0 for the padding parts (NEG_BIG - M)
#pragma unroll
      for (int j = 0; j < E; ++j) x[j] += o[u][j] * f;
    }
  }
  if constexpr (SPLIT) {   // sum the warps' runs; warp 0 finishes the column
    __shared__ float part_sm[NCOL][D];
#pragma unroll
    for (int j = 0; j < E; ++j) part_sm[warp][lane * E + j] = x[j];
    __syncthreads();
    if (warp != 0) return;
#pragma unroll
    for (int j = 0; j < E; ++j) {
      float t = 0.f;
#pragma unroll
      for (int w = 0; w < NCOL; ++w) t += part_sm[w][lane * E + j];
      x[j] = t;
    }
  }
  const float inv = Ls > 0.f ? 1.f / Ls : 0.f;
#pragma unroll
  for (int j = 0; j < E; ++j) x[j] *= inv;
  if constexpr (ROT) inverse_rht_group<E, 32>(x, lane);
  if (valid) {
    const int qhead = kvh * G + hg * hpc + n % hpc;
    T* orow = out + (static_cast<size_t>(qs + tok) * num_q_heads + qhead) * D + lane * E;
#pragma unroll
    for (int j = 0; j < E; ++j) orow[j] = from_float<T>(x[j]);
  }
}

// ====================================================================================
// paged_attention_decode_paged<FMT, D, T>: page-staged decode (plan variant "paged", sm_90).
// One CTA = (work item, *all* column groups): warp w takes column group w — KV head
// w / nhg, query heads (w % nhg)·hpc … — so blockDim = ny·32 with ny = num_kv_heads·nhg ≤ 8.
// The CTA walks its KV range in stages of TT tokens (one or two 16-token chunks). A chunk of
// one side is 16 consecutive slots of one page for every KV head: 16·H·ROW contiguous bytes,
// 16-byte aligned (SPEC 2 NHD layout; nvfp4: a data part 16·H·D/2 and a scale part 16·H·D/16).
// One thread copies each stage with Hopper bulk copies (TMA, bulk_copy.cuh: one instruction
// per chunk — its K and V sides, adjacent in the cache at block size 16 — whole DRAM sectors,
// no per-row gather; a staged chunk is laid out as its block) into a ring of `nbuf` stage
// buffers, `nbuf - 1` stages ahead of the one being decoded; full/empty mbarriers order the
// ring (no __syncthreads in the loop). Each warp reads its KV head's rows of a chunk from
// shared memory into the registers of the per-head kernel (HeadRaw; the 4-byte row alignment
// costs nothing there) and runs the same head_tile_math, full tiles without masks.
// Splits are merged by paged_attention_reduce (partials at slot (part·ny + w)·NCOL + n, as
// the per-head kernel with blockIdx.y = w). Below sm_90 the kernel is empty: the plan never
// picks this variant there.
//
// Dynamic shared memory (bytes, H = num_kv_heads): nbuf stages of 2·TT·H·ROW, aliased by the
// q staging (prologue, ny·NCOL·D·2, at the ring's end so that the stages before it are copied
// during the prologue) and the output rows (epilogue, ny·NCOL·D·4, from the start). The plan
// computes the same size and picks nbuf (kvlab/cuda/attention.py, paged_smem_bytes and
// _paged_buffers: two stages when a stage is ≥ 32 KB).
// ====================================================================================
#include "bulk_copy.cuh"

namespace {
constexpr int PG_MAXW = 8;    // column groups per CTA at most
constexpr int PG_MAXBUF = 4;  // stage buffers at most (per ring)
}

// KVLAB_DECODE_TIMELINE (measurement only; scripts/decode_cta_timeline.py): thread 0 of every
// paged-decode CTA writes %globaltimer (ns, comparable across SMs) and clock64 (cycles, this SM)
// at five points — start, after the prologue's barrier, stage 0's data in, after the last
// stage's math, after the epilogue (behind one extra __syncthreads) — plus its SM and stage
// count, and clock64 at four points inside the prologue (after the early copies, after the
// query staging, after the Q operand, before the barrier) — and, in the serial-columns build
// (-DKVLAB_DECODE_SERIAL_QUERY_COLUMNS), at the start of each query column (words 16 … 23) —
// to kvlab_decode_timeline[blockIdx.x · 24 + …] — and, in the dual-ring CTA (NH = 2), the
// globaltimer at the end of half 1's loop (word 23; half 0's is mark 3). Outputs stay correct; the
// default build has none of it.
// The dual-ring CTA's split query staging (KVLAB_DECODE_DUAL_SPLIT_STAGING, the default since
// session 19: docs/perf-notes.md "Session 19"). It replaces the joint staging's layout and the
// prologue barrier per half, so the A/B switches of those (-DKVLAB_DECODE_SERIAL_QUERY_COLUMNS,
// -DKVLAB_DECODE_NO_EARLY_ISSUE, -DKVLAB_DECODE_DUAL_CTA_BARRIER) build without it, as does
// -DKVLAB_DECODE_DUAL_JOINT_STAGING (session 18's dual ring, each half staging all 8 columns into
// its own ring). kvlab/cuda/attention.py (_DUAL_JOINT_STAGING_MACROS) sizes shared memory by the
// same rule.
#if !defined(KVLAB_DECODE_DUAL_JOINT_STAGING) && !defined(KVLAB_DECODE_SERIAL_QUERY_COLUMNS) && \
    !defined(KVLAB_DECODE_NO_EARLY_ISSUE) && !defined(KVLAB_DECODE_DUAL_CTA_BARRIER)
#define KVLAB_DECODE_DUAL_SPLIT_STAGING
#endif
#if defined(KVLAB_DECODE_DUAL_SPLIT_STAGING) && (defined(KVLAB_DECODE_DUAL_JOINT_STAGING) || defined(KVLAB_DECODE_SERIAL_QUERY_COLUMNS) || defined(KVLAB_DECODE_NO_EARLY_ISSUE) || defined(KVLAB_DECODE_DUAL_CTA_BARRIER))
#error "KVLAB_DECODE_DUAL_SPLIT_STAGING replaces the joint query staging, the early issue's layout and the dual ring's prologue barrier: build it alone"
#endif
#if defined(KVLAB_DECODE_SERIAL_QUERY_COLUMNS) && defined(KVLAB_DECODE_LATE_QUERY_LOADS)
#error "KVLAB_DECODE_LATE_QUERY_LOADS moves the loads of the joint query staging, which KVLAB_DECODE_SERIAL_QUERY_COLUMNS replaces: name one"
#endif
#ifdef KVLAB_DECODE_TIMELINE
constexpr int TL_MAX_CTAS = 8192, TL_WORDS = 24;
__device__ unsigned long long kvlab_decode_timeline[TL_MAX_CTAS * TL_WORDS];
__device__ __forceinline__ void tl_mark(int k) {
  if (threadIdx.x == 0 && blockIdx.x < TL_MAX_CTAS) {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    kvlab_decode_timeline[blockIdx.x * TL_WORDS + k] = t;
    kvlab_decode_timeline[blockIdx.x * TL_WORDS + 5 + k] = static_cast<unsigned long long>(clock64());
  }
}
__device__ __forceinline__ void tl_info(int nst) {
  if (threadIdx.x == 0 && blockIdx.x < TL_MAX_CTAS) {
    unsigned smid;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
    kvlab_decode_timeline[blockIdx.x * TL_WORDS + 10] = smid;
    kvlab_decode_timeline[blockIdx.x * TL_WORDS + 11] = static_cast<unsigned long long>(nst);
  }
}
// clock64 only, word k (12 … 23): the prologue's parts (thread 0)
__device__ __forceinline__ void tl_clock(int k) {
  if (threadIdx.x == 0 && blockIdx.x < TL_MAX_CTAS)
    kvlab_decode_timeline[blockIdx.x * TL_WORDS + k] = static_cast<unsigned long long>(clock64());
}
#define KVLAB_TL_MARK(k) tl_mark(k)
#define KVLAB_TL_INFO(n) tl_info(n)
#define KVLAB_TL_CLOCK(k) tl_clock(k)
#else
#define KVLAB_TL_MARK(k) ((void)0)
#define KVLAB_TL_INFO(n) ((void)0)
#define KVLAB_TL_CLOCK(k) ((void)0)
#endif

template <int FMT, int D>
struct PagedTile {
  static constexpr int ROW = Traits<FMT, D, __half>::ROW;   // bytes per (token, head) row
  static constexpr int TT = ROW <= 80 ? 32 : 16;            // tokens per stage
  static constexpr int CPT = TT / 16;                       // 16-token chunks per stage
};

// NH = 2, the dual-ring CTA (d ≤ 128; chosen by the plan per format and batch, _dual_pays, or
// forced by KVLAB_DECODE_PAGED_DUAL; docs/perf-notes.md "Session 17", "Session 18"): one CTA
// per SM with 2·ny warps in two halves, each half a whole paged decode of its own — its ring
// of nbuf stages, its barriers, its producer thread (lane 0 of its first warp) — over its half
// of the item's chunks (the first ceil(nch / 2) rounded up to whole stages, and the rest); the
// epilogue merges the two halves' softmax states per column group.
// The halves run out of phase as two CTAs of an SM do, but they start together and are placed
// together, so the work list does not guess which of two CTAs the warp schedulers favour.
template <int FMT, int D, typename T, int NH = 1>
__global__ void __launch_bounds__(PG_MAXW * 32 * NH, (D > 128 || NH > 1 ? 1 : 2))
paged_attention_decode_paged(const T* __restrict__ q, T* __restrict__ out,
                             const uint8_t* __restrict__ cache, const int* __restrict__ block_table,
                             int bt_stride, const int* __restrict__ seq_lens,
                             const int* __restrict__ query_start_loc, const int* __restrict__ items,
                             int num_kv_heads, int num_q_heads, int hpc, int tpc, int bs_log2,
                             float scale_log2, float k_scale, float v_scale, int window,
                             int swizzle_v, float* __restrict__ ws_o, float* __restrict__ ws_ml,
                             int nbuf) {
#ifdef KVLAB_HAS_BULK_COPY
  using TR = Traits<FMT, D, T>;
  using PT = PagedTile<FMT, D>;
  using Raw = HeadRaw<FMT, D>;
  using Off = HeadOffsets<FMT, D>;
  static_assert(D == 64 || D == 128 || D == 256, "head sizes 64, 128, 256");
  static_assert(NH == 1 || (NH == 2 && D <= 128), "the dual-ring CTA (NH = 2): head sizes 64, 128");
  constexpr int E = D / 32;
  constexpr int KC = D / 16;
  constexpr int ROW = PT::ROW, TT = PT::TT, CPT = PT::CPT;
  constexpr int S = D / 16;                 // nvfp4 scales per row
  constexpr int NGV = Raw::NGV;
  // bytes per (token, head) in the first part of a side: the whole row, or nvfp4's data
  constexpr int DROW = (FMT == NVFP4) ? D / 2 : ROW;

  extern __shared__ __align__(16) uint8_t dsm[];
  __shared__ float qsum_sm[PG_MAXW * NH][NCOL], qoff_sm[PG_MAXW * NH][NCOL], cscale_sm[PG_MAXW * NH][NCOL];
  __shared__ float mo_sm[PG_MAXW * NH][NCOL], lo_sm[PG_MAXW * NH][NCOL];
  __shared__ int qpos_sm[PG_MAXW * NH][NCOL];
  __shared__ __align__(8) uint64_t full_bars[NH][PG_MAXBUF], empty_bars[NH][PG_MAXBUF];

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int nthr = blockDim.x, ny = (nthr >> 5) / NH;
  const int g = lane >> 2, c = lane & 3;
  // this warp's half (NH = 2) and column group; the half's ring barriers and producer thread
  const int half = NH == 1 ? 0 : warp / ny;
  const int cg = warp - half * ny;
  uint64_t* const full_bar = full_bars[half];
  uint64_t* const empty_bar = empty_bars[half];
  const bool producer = tid == half * ny * 32;
  // KVLAB_DECODE_DUAL_SPLIT_STAGING (the default; docs/perf-notes.md "Session 19"): the dual-ring
  // CTA stages each column group's queries once, half 0 columns 0-3 and half 1 columns 4-7 with 8
  // lanes per column, into one staging after both rings, read by both halves after a CTA barrier
  // (-DKVLAB_DECODE_DUAL_JOINT_STAGING: each half stages all 8 columns into its own ring)
#ifdef KVLAB_DECODE_DUAL_SPLIT_STAGING
  constexpr bool SPLIT_Q = NH == 2;
#else
  constexpr bool SPLIT_Q = false;
#endif
  constexpr int QLPC = SPLIT_Q ? 8 : QCols<D, T>::LPC;   // lanes per staged query column
  const int QPASS0 = SPLIT_Q ? half : 0;                  // the first (split: only) staging pass
  const int* it = items + ITEM * blockIdx.x;
#ifndef KVLAB_DECODE_NO_ITEM_META
  // The item's row carries the sequence's metadata and its first chunks' blocks (ITEM): the
  // query rows and the first copies wait for this one load instead of a chain of three
  // (item → query_start_loc / seq_lens → block_table; docs/perf-notes.md "Session 17").
  // -DKVLAB_DECODE_NO_ITEM_META reads them from the arrays as before (A/B).
  const int4 i0 = __ldg(reinterpret_cast<const int4*>(it));
  const int4 i1 = __ldg(reinterpret_cast<const int4*>(it) + 1);
  const int seq = i0.x, tok0 = i0.y, kv_lo = i0.z, kv_hi = i0.w, part = i1.x;
  const int qs = i1.y, Lq = i1.z, L = i1.w;
  // the row's second half (chunk start, first blocks; thread 0, the producer, only), loaded
  // with the first so that both arrive after one round trip: it is another 32-byte sector, and
  // loaded where it is used (after the KV range) it cost a second round trip (session 17, call 2)
  int lo16_plan = -1;
  int4 pre = make_int4(-1, -1, -1, -1);
  if (tid == 0) {
    lo16_plan = __ldg(it + 8);
    pre = __ldg(reinterpret_cast<const int4*>(it) + 3);
  }
#else
  const int seq = it[0], tok0 = it[1], kv_lo = it[2], kv_hi = it[3], part = it[4];
  const int qs = query_start_loc[seq];
  const int Lq = query_start_loc[seq + 1] - qs;
  const int L = seq_lens[seq];
#endif
  const int H = num_kv_heads;
  const int G = num_q_heads / H;
  const int nhg = G / hpc;
  const int kvh = cg / nhg, hg = cg % nhg;
  const int BS = 1 << bs_log2;

#ifndef KVLAB_DECODE_SERIAL_QUERY_COLUMNS
  // this warp's query rows of the first pass, loaded before anything else (see
  // load_query_columns); -DKVLAB_DECODE_LATE_QUERY_LOADS loads them after the first copies
  uint4 qw0[QCols<D, T, QLPC>::NV];
#ifndef KVLAB_DECODE_LATE_QUERY_LOADS
  load_query_columns<D, T, QLPC>(q, QPASS0, tok0, hpc, tpc, qs, Lq, num_q_heads, kvh * G + hg * hpc,
                                 lane, qw0);
#endif
#endif
  // each ring's barriers initialized by its own producer, the thread that arms them next (in the
  // prologue, before the CTA's first barrier: another thread's initialization would race with it)
  if (producer) {
    for (int b = 0; b < nbuf; ++b) {
      mbar_init(&full_bar[b], 1);
      mbar_init(&empty_bar[b], nthr / NH);   // every thread of the ring's half
    }
    mbar_init_fence();
  }
  KVLAB_TL_MARK(0);

  // KV range: the same for every warp (all column groups hold the same query tokens), so
  // every thread walks the same stages (the mbarrier counts rely on it). The columns'
  // positions are those stage_query_column writes to qpos_sm (computed here, before it runs,
  // so that the first copies can be issued ahead of the prologue).
  int qp[NCOL];
#pragma unroll
  for (int n = 0; n < NCOL; ++n) {
    const int tok = tok0 + n / hpc;
    qp[n] = (n < tpc * hpc && tok < Lq) ? L - Lq + tok : -1;
  }
  int pmin, pmax, lo16;
  int nch = kv_tiles(qp, kv_lo, kv_hi, window, pmin, pmax, lo16);   // 16-token chunks
  if constexpr (NH == 2) {   // this half's chunks: the first ceil(nch / 2) in whole stages, the rest
    const int c0 = min(nch, (nch + 2 * CPT - 1) / (2 * CPT) * CPT);
    if (half == 0) {
      nch = c0;
    } else {
      lo16 += 16 * c0;
      nch -= c0;
    }
  }
  const int nst = (nch + CPT - 1) / CPT;                    // stages

  const size_t side_stride = static_cast<size_t>(BS) * H * ROW;          // one (block, side) slab
  const size_t sbase = static_cast<size_t>(BS) * H * (D / 2);            // nvfp4 scale part of a slab
  const int side_sm = TT * H * ROW;                                      // one side of a stage
  const int stage_sm = 2 * side_sm;
  // A staged chunk keeps its K and V rows together, as the cache does (one block's slab is its K
  // side, then its V side; an nvfp4 side is its data part, then its scale part), so that at block
  // size 16 each chunk is one bulk copy of 2·16·H·ROW bytes instead of two (nvfp4: four, two of
  // them 16·H·S = 1 KB). Stages of one chunk (TT = 16: int8, fp8, auto at d = 128) had this
  // layout already. Measured (H200, session 21; docs/perf-notes.md "Session 21"): nvfp4 −3 … −4 %,
  // int4 −0.5 … −1 %, int8 / fp8 flat. -DKVLAB_DECODE_KV_SPLIT builds the layout of sessions
  // 7-20 (a stage = its K side, then its V side; nvfp4: data then scales per side) for A/B.
#ifndef KVLAB_DECODE_KV_SPLIT
  constexpr bool KVJ = true;
#else
  constexpr bool KVJ = false;
#endif
  const int vside = KVJ ? 16 * H * ROW : side_sm;                  // a staged K row -> its V row
  const int cstr = KVJ ? 32 * H * ROW : 16 * H * DROW;             // staged chunk j -> j + 1 (codes)
  const int cstr_s = KVJ ? 32 * H * ROW : 16 * H * S;              // … (nvfp4 scales)
  const int sc0 = KVJ ? 16 * H * (D / 2) : TT * H * (D / 2);       // nvfp4: scale part of a staged side
  uint8_t* const ring = dsm + (NH == 1 ? 0 : half * nbuf * stage_sm);   // this half's stage buffers
  const int* bt = block_table + static_cast<size_t>(seq) * bt_stride;
#ifndef KVLAB_DECODE_NO_ITEM_META
  // the blocks of the item's first ITEM_PRE chunks, valid if the plan's chunk start is this one
  // (it always is for the plan's lists; the check keeps a list from elsewhere correct). Used by
  // the stages issued before the main loop only, so that they are dead in it.
  if (lo16_plan != lo16) pre = make_int4(-1, -1, -1, -1);
#endif
  // Producer (thread 0): arm full[b] with the bytes of stage st and copy its chunks into buffer b;
  // PRE: a stage before the main loop (its first chunks' blocks may come from the item).
  auto issue = [&](int st, int b, auto pre_tag) {   // b = st % nbuf
    constexpr bool PRE = decltype(pre_tag)::value;
    uint8_t* sbuf = ring + b * stage_sm;
    const int nc = min(CPT, nch - st * CPT);
    constexpr uint32_t CH_BYTES = 16u * ((FMT == NVFP4) ? (D / 2 + S) : ROW);   // per head, side
    mbar_arrive_expect_tx(&full_bar[b], 2u * nc * CH_BYTES * H);
    for (int j = 0; j < nc; ++j) {
      const int ci = st * CPT + j;
      const int p0 = lo16 + 16 * ci;
      int blk = -1;
#ifndef KVLAB_DECODE_NO_ITEM_META
      if constexpr (PRE)
        blk = ci == 0 ? pre.x : ci == 1 ? pre.y : ci == 2 ? pre.z : ci == 3 ? pre.w : -1;
#endif
      if (blk < 0) blk = bt[p0 >> bs_log2];
      const int o = p0 & (BS - 1);
      const uint8_t* slab = cache + static_cast<size_t>(blk) * 2 * side_stride;
      if (KVJ && BS == 16) {   // the block's K and V sides are adjacent: one copy
        bulk_copy_g2s(sbuf + j * cstr, slab, 32u * H * ROW, &full_bar[b]);
        continue;
      }
#pragma unroll
      for (int side = 0; side < 2; ++side) {
        const uint8_t* src = slab + side * side_stride;
        uint8_t* dst = sbuf + side * vside;
        bulk_copy_g2s(dst + j * cstr, src + static_cast<size_t>(o) * H * DROW, 16u * H * DROW,
                      &full_bar[b]);
        if constexpr (FMT == NVFP4)
          bulk_copy_g2s(dst + sc0 + j * cstr_s, src + sbase + static_cast<size_t>(o) * H * S,
                        16u * H * S, &full_bar[b]);
      }
    }
  };

  // ---- prologue: this warp's 8 query columns (as paged_attention_decode), staged at the end of
  // the ring (q_off, 128-byte aligned) so that the stages in the buffers before it (b < q_buf)
  // are copied while the queries are loaded and staged; the others are issued after the
  // barrier below. -DKVLAB_DECODE_NO_EARLY_ISSUE: the q staging at the start and every first
  // copy after the prologue (the session-9 kernel; docs/perf-notes.md "Session 10").
#ifdef KVLAB_DECODE_NO_EARLY_ISSUE
  constexpr int q_off = 0;
  const int q_buf = 0;
#else
  // split staging: one staging per CTA after both rings (paged_smem_bytes), every stage issued now
  const int q_off = SPLIT_Q ? NH * nbuf * stage_sm : max(0, nbuf * stage_sm - ny * NCOL * D * 2) & ~127;
  const int q_buf = SPLIT_Q ? nbuf : q_off / stage_sm;   // the first buffer the q staging overlaps
  if (producer)
    for (int st = 0; st < min(q_buf, nst); ++st) issue(st, st, MaskTag<true>{});
#endif
  KVLAB_TL_CLOCK(12);
  uint16_t* q_sm = reinterpret_cast<uint16_t*>((SPLIT_Q ? dsm : ring) + q_off) +
                   static_cast<size_t>(cg) * NCOL * D;
  const int qrow_w = SPLIT_Q ? cg : warp;   // the row of qsum_sm … qpos_sm this warp's columns use
#ifdef KVLAB_DECODE_SERIAL_QUERY_COLUMNS
  // the session-10 prologue: one column after the other, 32 lanes each (the timeline build
  // marks the start of each column: words 16 … 23)
  for (int n = 0; n < NCOL; ++n) {
    KVLAB_TL_CLOCK(16 + n);
    stage_query_column<FMT, D, T>(q, n, tok0, hpc, tpc, qs, Lq, L, num_q_heads, kvh * G + hg * hpc,
                                  scale_log2, lane, q_sm + n * D, &qsum_sm[warp][n],
                                  &qoff_sm[warp][n], &cscale_sm[warp][n], &qpos_sm[warp][n]);
  }
#else
#ifdef KVLAB_DECODE_LATE_QUERY_LOADS
  load_query_columns<D, T, QLPC>(q, QPASS0, tok0, hpc, tpc, qs, Lq, num_q_heads, kvh * G + hg * hpc,
                                 lane, qw0);
#endif
  stage_query_columns<FMT, D, T, QLPC>(q, qw0, tok0, hpc, tpc, qs, Lq, L, num_q_heads,
                                       kvh * G + hg * hpc, scale_log2, lane, q_sm, qsum_sm[qrow_w],
                                       qoff_sm[qrow_w], cscale_sm[qrow_w], qpos_sm[qrow_w], QPASS0,
                                       SPLIT_Q ? 1 : QCols<D, T, QLPC>::PASSES);
#endif
  KVLAB_TL_CLOCK(13);
  if constexpr (SPLIT_Q)
    __syncthreads();   // column group cg's columns come from warps cg (0-3) and cg + ny (4-7)
  else
    __syncwarp();
  // Q operand (A fragment of head_tile_math, row g = column g), as the per-head kernel
  // packs it (written out in both kernels: see the note there)
  uint32_t qa[KC][2];
  if constexpr (ImmaQK<FMT>::value) {
    imma_query_regs<FMT, D>(q_sm + g * D, c, qa);
  } else {
#pragma unroll
    for (int kk = 0; kk < KC; ++kk)
#pragma unroll
      for (int p = 0; p < 2; ++p)
        qa[kk][p] = pack2(q_sm[g * D + qk_dim<FMT, D>(c, kk, p, 0)],
                          q_sm[g * D + qk_dim<FMT, D>(c, kk, p, 1)]);
  }
  const float qsum = qsum_sm[qrow_w][g], qoff = qoff_sm[qrow_w][g], cs = cscale_sm[qrow_w][g];
  const float kc = (FMT == NVFP4) ? 128.f * k_scale * cs : cs;
  const int qpos = qpos_sm[qrow_w][g];
  KVLAB_TL_CLOCK(14);

  // Chunks [tf0, tf1) need no bounds or mask test (as in the per-head kernel)
  const int tend = (pmin < L ? pmin + 1 : L) - lo16;
  int tf1 = tend > 0 ? min(tend >> 4, nch) : 0;
  int tf0 = 0;
  if (window > 0) {
    const int wlo = pmax - window - lo16;
    tf0 = wlo >= 0 ? min(wlo / 16 + 1, nch) : 0;
  }
  tf1 = max(tf1, tf0);

  float acc[KC][4];
#pragma unroll
  for (int j = 0; j < KC; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
  float m = NEG_BIG, l = 0.f, z = 0.f;

  // The q staging was read (qa) by every warp and the barriers are initialized; the stages
  // from buffer q_buf on overwrite the q staging through the async proxy.
  fence_proxy_async_smem();
  KVLAB_TL_CLOCK(15);
#ifndef KVLAB_DECODE_DUAL_CTA_BARRIER
  // the dual-ring CTA: each half waits for its own warps only (named barrier 1 + half), so a half
  // whose queries are staged starts its loop without waiting for the other's (the q staging, the
  // barriers and the ring of a half are its own). -DKVLAB_DECODE_DUAL_CTA_BARRIER: the CTA-wide
  // barrier of session 17's form, for A/B. The split staging synchronized the CTA above already.
  if constexpr (SPLIT_Q) {
  } else if constexpr (NH == 2)
    named_bar_sync(1 + half, ny * 32);
  else
#endif
    __syncthreads();
  KVLAB_TL_MARK(1);
  KVLAB_TL_INFO(nst);

  // This thread's byte offsets within chunk 0 of a staged buffer (chunk j adds j·16·H·DROW,
  // nvfp4's scales j·16·H·S).
  const int t4[4] = {pv_token(c, 0), pv_token(c, 1), pv_token(c, 2), pv_token(c, 3)};
  const int kt = k_token(g);   // K rows of tokens kt, kt + 8
  const int HR = H * DROW;
  Off of;
  head_offsets<FMT, D>(of, g, c, lane, kvh, H, vside, sc0, swizzle_v);
  // Bank-conflict-free row reads (interleaved words, RowWords; int8, fp8): the lanes g and g ^ 1
  // read K rows 4 tokens apart (k_token), which share banks when H·ROW ≡ 8 words (mod 32) —
  // 8 KV heads at d = 128 — so the second of two lanes whose first K words share a bank reads
  // its words in the order 1, 2, …, 0 (smem_words_rot1). The V rows need nothing (pv_token).
  // Any rotation is correct; other head counts may keep some conflicts. Measured (H200,
  // B = 32 × 8k, docs/perf-notes.md session 4): shared-load conflicts of the int4 kernel
  // 5.2 M -> 0.97 M, but time within ±1.5 % for every format: int8 takes it (-1.7 %), int4
  // does not (its 8 selects per tile cost +1.3 %). fp8 has int8's rows and takes it too since
  // session 20 (its rows were consecutive bytes until then, RowWords). KVLAB_PAGED_NOROT turns
  // it off.
  constexpr int KW = TR::KB / 4;
  constexpr bool IL = RowWords<FMT>::INTERLEAVED;
#ifdef KVLAB_PAGED_NOROT
  constexpr bool ROT = false;
#else
  constexpr bool ROT = IL && (FMT == INT8 || FMT == FP8);
#endif
  int krot = 0;
  if constexpr (ROT) {
    const uint32_t same = __match_any_sync(0xffffffffu, (of.kg >> 2) & 31u);
    krot = __popc(same & ((1u << lane) - 1u)) & 1;
  }
  uint32_t kof[KW];   // per-lane offsets of the K words in the read order
#pragma unroll
  for (int i = 0; i < KW; ++i) kof[i] = of.kg + 16u * ((i + krot) % KW);
  // the K parameter word of token t4[0] (the V one is a side further, token t4[i] 4i·HR further)
  const uint32_t pk0 = (t4[0] * H + kvh) * TR::ROW + ((FMT == INT4) ? D / 2 : D);
  // This thread's raw words of chunk j of a staged buffer; MK: zeros past L.
  auto fill = [&](Raw& r, const uint8_t* sbuf, int j, int p0, auto masked_tag) {
    constexpr bool MK = decltype(masked_tag)::value;
    const uint8_t* base = sbuf + j * cstr;
    const bool in_g = !MK || p0 + kt < L, in_g8 = !MK || p0 + kt + 8 < L;
    if constexpr (IL) {
      // the K row kt + 8 sits 8·HR bytes after row kt: the same per-lane offsets
      smem_words_rot1<KW>(base, kof, in_g, krot, r.ka);
      smem_words_rot1<KW>(base + 8 * HR, kof, in_g8, krot, r.kb);
      smem_words_strided<TR::VB / 4, 32>(base + of.v[0], r.v0, !MK || p0 + t4[0] < L);
      smem_words_strided<TR::VB / 4, 32>(base + of.v[1], r.v1, !MK || p0 + t4[1] < L);
      smem_words_strided<TR::VB / 4, 32>(base + of.v[2], r.v2, !MK || p0 + t4[2] < L);
      smem_words_strided<TR::VB / 4, 32>(base + of.v[3], r.v3, !MK || p0 + t4[3] < L);
    } else {
      smem_words<TR::KB, TR::ALIGN>(base + of.kg, r.ka, in_g);
      smem_words<TR::KB, TR::ALIGN>(base + of.kg8, r.kb, in_g8);
      smem_words<TR::VB, TR::ALIGN>(base + of.v[0], r.v0, !MK || p0 + t4[0] < L);
      smem_words<TR::VB, TR::ALIGN>(base + of.v[1], r.v1, !MK || p0 + t4[1] < L);
      smem_words<TR::VB, TR::ALIGN>(base + of.v[2], r.v2, !MK || p0 + t4[2] < L);
      smem_words<TR::VB, TR::ALIGN>(base + of.v[3], r.v3, !MK || p0 + t4[3] < L);
    }
    if constexpr (FMT == INT4 || FMT == INT8 || FMT == FP8) {
      // the K / V parameter words of tokens t4[i] = t4[0] + 4i (PAR_LOADED); zeros past L (a
      // row there may hold anything, e.g. an invalid row's NaN scale: 0·NaN would poison P')
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const bool ok = !MK || p0 + t4[i] < L;
        const uint32_t wk = *reinterpret_cast<const uint32_t*>(base + pk0 + 4 * i * HR);
        const uint32_t wv = *reinterpret_cast<const uint32_t*>(base + pk0 + vside + 4 * i * HR);
        r.kp[i] = ok ? wk : 0u;
        r.vp[i] = ok ? wv : 0u;
      }
    }
    if constexpr (FMT == NVFP4) {
      const uint8_t* sb = sbuf + j * cstr_s;
      smem_words<S, 4>(sb + of.skg, r.skg, in_g);
      smem_words<S, 4>(sb + of.skg8, r.skg8, in_g8);
#pragma unroll
      for (int i = 0; i < NGV; ++i)
#pragma unroll
        for (int k = 0; k < 4; ++k)
          r.sv[k][i] = (!MK || p0 + t4[k] < L) ? static_cast<uint32_t>(sb[of.sv[k][i]]) : 0u;
    }
  };
  // int4 nibble masks, pinned in registers (see paged_attention_decode)
#ifdef KVLAB_UNPINNED_MASKS
  const uint32_t mlo = 0x000F000Fu, mhi = 0x00F000F0u;
#else
  const uint32_t mlo = pinned_u32<0x000F000Fu>(), mhi = pinned_u32<0x00F000F0u>();
#endif

#ifdef KVLAB_DECODE_STAGE
  // int4 stages of two full chunks as one unit (stage_pair_int4): this lane's words of a staged
  // buffer at three per-lane pointers into buffer 0 plus loop-invariant steps (multiples of
  // H·ROW bytes, warp-uniform); a stage adds its buffer offset once.
  constexpr bool STAGE_INT4 = (FMT == INT4) && ImmaQK<FMT>::value && (CPT == 2) && IL && !ROT;
#ifdef KVLAB_DECODE_STAGE_NVFP4
  // nvfp4 (fp16 Q·K path, consecutive-byte rows): stage_body_nvfp4, one or two chunks per stage
  constexpr bool STAGE_NVFP4 = (FMT == NVFP4) && !ImmaQK<FMT>::value && !IL;
#else
  constexpr bool STAGE_NVFP4 = false;
#endif
  constexpr bool STAGE_BODY = STAGE_INT4 || STAGE_NVFP4;
  const uint8_t* lk = ring + of.kg;    // K words of token kt (+ 16·i: word c + 4i)
  const uint8_t* lv = ring + of.v[0];  // V words of token t4[0] (+ 32·k: word g + 8k)
  const uint8_t* lp = ring + pk0;      // K parameter word of token t4[0]
  const int nq = -__float_as_int(qsum);   // −Σ q̂ (ImmaQK: qsum holds the int bits)
#ifdef KVLAB_DECODE_STAGE_NVFP4
  // nvfp4: this lane's K scale row of token kt (+ 8·H·S: token kt + 8) in buffer 0
  const uint8_t* ls = ring + ((FMT == NVFP4) ? of.skg : 0u);
#endif
  // HC: the head count as a compile-time constant (8, the target shape: every step an LDS
  // immediate) or 0 (run time: ptxas re-derives the steps from the kernel parameter)
  auto fill_full = [&](Raw& r, uint32_t o, auto hc_tag) {   // o = buffer offset + chunk·16·H·ROW
    constexpr int HC = decltype(hc_tag)::value;
    const uint32_t hr = HC ? static_cast<uint32_t>(HC * DROW) : static_cast<uint32_t>(HR);
    const uint32_t hr4 = 4u * hr, hr8 = 8u * hr, sside = (KVJ ? 16 : TT) * hr;   // vside
#ifdef KVLAB_DECODE_STAGE_NVFP4
    if constexpr (FMT == NVFP4) {   // KB / VB consecutive bytes (16-byte loads at d = 128)
      smem_words<TR::KB, TR::ALIGN>(lk + o, r.ka, true);
      smem_words<TR::KB, TR::ALIGN>(lk + o + hr8, r.kb, true);
      smem_words<TR::VB, TR::ALIGN>(lv + o, r.v0, true);
      smem_words<TR::VB, TR::ALIGN>(lv + o + hr4, r.v1, true);
      smem_words<TR::VB, TR::ALIGN>(lv + o + hr8, r.v2, true);
      smem_words<TR::VB, TR::ALIGN>(lv + o + (hr8 + hr4), r.v3, true);
      (void)sside;
    } else   // (no parameter words: the scales are fill_scales')
#endif
    {
#pragma unroll
      for (int i = 0; i < KW; ++i) {
        r.ka[i] = *reinterpret_cast<const uint32_t*>(lk + o + 16 * i);
        r.kb[i] = *reinterpret_cast<const uint32_t*>(lk + o + hr8 + 16 * i);
      }
      constexpr int VW = TR::VB / 4;
#pragma unroll
      for (int k = 0; k < VW; ++k) {
        r.v0[k] = *reinterpret_cast<const uint32_t*>(lv + o + 32 * k);
        r.v1[k] = *reinterpret_cast<const uint32_t*>(lv + o + hr4 + 32 * k);
        r.v2[k] = *reinterpret_cast<const uint32_t*>(lv + o + hr8 + 32 * k);
        r.v3[k] = *reinterpret_cast<const uint32_t*>(lv + o + (hr8 + hr4) + 32 * k);
      }
      const uint32_t ro[4] = {0u, hr4, hr8, hr8 + hr4};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        r.kp[i] = *reinterpret_cast<const uint32_t*>(lp + o + ro[i]);
        r.vp[i] = *reinterpret_cast<const uint32_t*>(lp + o + sside + ro[i]);
      }
    }
  };
#ifdef KVLAB_DECODE_STAGE_NVFP4
  // nvfp4: the K scale rows and V scale bytes of a full chunk; os = buffer offset + chunk·16·H·S
  auto fill_scales = [&](Raw& r, uint32_t os, auto hc_tag) {
    constexpr int HC = decltype(hc_tag)::value;
    const uint32_t hs8 = 8u * (HC ? static_cast<uint32_t>(HC * S) : static_cast<uint32_t>(H * S));
    smem_words<S, 4>(ls + os, r.skg, true);
    smem_words<S, 4>(ls + os + hs8, r.skg8, true);
#pragma unroll
    for (int i = 0; i < NGV; ++i)
#pragma unroll
      for (int k = 0; k < 4; ++k) r.sv[k][i] = static_cast<uint32_t>(ring[os + of.sv[k][i]]);
  };
#endif
  uint32_t boff = 0u;   // b · stage_sm
#endif

  // ---- main loop: stages st + 1 … st + nbuf - 1 in flight while stage st is decoded
  if (producer)
    for (int st = q_buf; st < min(nbuf, nst); ++st) issue(st, st, MaskTag<true>{});
  int b = 0;          // st % nbuf
  uint32_t ph = 0u;   // (st / nbuf) & 1: the phase parity of buffer b's barriers
  // KVLAB_DECODE_PROBE (measurement only, wrong outputs; docs/perf-notes.md "Session 10: where the
  // paged decode's time goes"): =1 moves the data and skips the tile math (the ring's own
  // ceiling); =2 copies only the first nbuf stages and runs the math on them again and again,
  // without waiting (the math's own ceiling). Never a default; the GPU tests do not run it.
#if defined(KVLAB_DECODE_PROBE) && KVLAB_DECODE_PROBE != 1 && KVLAB_DECODE_PROBE != 2
#error "KVLAB_DECODE_PROBE: 1 (data only) or 2 (math only)"
#endif
#if defined(KVLAB_DECODE_PROBE)
  constexpr bool PROBE_MATH = KVLAB_DECODE_PROBE == 2, PROBE_DATA = KVLAB_DECODE_PROBE == 1;
#else
  constexpr bool PROBE_MATH = true, PROBE_DATA = true;
#endif
  for (int st = 0; st < nst; ++st) {
    if (PROBE_DATA || st < nbuf) mbar_wait(&full_bar[b], ph);
#ifdef KVLAB_DECODE_TIMELINE
    if (st == 0) KVLAB_TL_MARK(2);
#endif
    const uint8_t* sbuf = ring + b * stage_sm;
    if (PROBE_MATH) {
#ifdef KVLAB_DECODE_STAGE
    if constexpr (STAGE_BODY) {
      const int ch = st * CPT, p0 = lo16 + 16 * ch;
      if (ch >= tf0 && ch + CPT <= tf1) {   // both chunks full: one body, no masks
        auto body = [&](auto hc_tag) {
          constexpr int HC = decltype(hc_tag)::value;
          const uint32_t hr16 = 16u * (HC ? static_cast<uint32_t>(HC * DROW) : static_cast<uint32_t>(HR));
          // KVJ: staged chunk 0 -> 1 (cstr, as a compile-time step where the head count is)
          const uint32_t cs16 = 32u * (HC ? static_cast<uint32_t>(HC * ROW) : static_cast<uint32_t>(H * ROW));
          if constexpr (FMT == INT4) {
            Raw ra, rb;
            fill_full(ra, boff, hc_tag);
            fill_full(rb, boff + (KVJ ? cs16 : hr16), hc_tag);
            stage_pair_int4<D, T>(ra, rb, acc, m, l, z, qa, nq, cs, mlo, lane);
          }
#ifdef KVLAB_DECODE_STAGE_NVFP4
          else {   // nvfp4: stage_body_nvfp4 over the stage's CPT chunks
            Raw ra;
            fill_full(ra, boff, hc_tag);
            fill_scales(ra, boff, hc_tag);
            if constexpr (CPT == 2) {
              const uint32_t hs16 = 16u * (HC ? static_cast<uint32_t>(HC * S) : static_cast<uint32_t>(H * S));
              Raw rb;
              fill_full(rb, boff + (KVJ ? cs16 : hr16), hc_tag);
              fill_scales(rb, boff + (KVJ ? cs16 : hs16), hc_tag);
              stage_body_nvfp4<D, T, 2>(ra, rb, acc, m, l, z, qa, kc, mlo, mhi, lane);
            } else {
              (void)hr16;
              (void)cs16;
              stage_body_nvfp4<D, T, 1>(ra, ra, acc, m, l, z, qa, kc, mlo, mhi, lane);
            }
          }
#endif
        };
        if (H == 8) body(IntTag<8>{});
        else body(IntTag<0>{});
      } else {   // an edge stage (rare): the masked tile math for each chunk it has
#pragma unroll 1
        for (int j = 0; j < CPT; ++j) {
          if (ch + j < nch) {
            Raw r;
            fill(r, sbuf, j, p0 + 16 * j, MaskTag<true>{});
            head_tile_math<FMT, D, T, true, true>(r, p0 + 16 * j, acc, m, l, z, qa, qsum, qoff, cs, kc, qpos, L,
                                                  window, mlo, mhi, lane);
          }
        }
      }
    } else
#endif
#ifdef KVLAB_PAGED_PAIR
    // two chunks of one stage with one softmax update (head_tile_pair)
    if (CPT == 2 && st * CPT + 1 < nch) {
      const int ch = st * CPT, p0 = lo16 + 16 * ch;
      Raw ra, rb;
      if (ch >= tf0 && ch + 1 < tf1) {
        fill(ra, sbuf, 0, p0, MaskTag<false>{});
        fill(rb, sbuf, 1, p0 + 16, MaskTag<false>{});
        head_tile_pair<FMT, D, T, false, true>(ra, rb, p0, acc, m, l, z, qa, qsum, qoff, cs, kc, qpos, L, window,
                                         mlo, mhi, lane);
      } else {
        fill(ra, sbuf, 0, p0, MaskTag<true>{});
        fill(rb, sbuf, 1, p0 + 16, MaskTag<true>{});
        head_tile_pair<FMT, D, T, true, true>(ra, rb, p0, acc, m, l, z, qa, qsum, qoff, cs, kc, qpos, L, window,
                                        mlo, mhi, lane);
      }
    } else
#endif
#pragma unroll
    for (int j = 0; j < CPT; ++j) {
      const int ch = st * CPT + j;
      if (ch < nch) {
        const int p0 = lo16 + 16 * ch;
        Raw r;
        if (ch >= tf0 && ch < tf1) {
          fill(r, sbuf, j, p0, MaskTag<false>{});
          head_tile_math<FMT, D, T, false, true>(r, p0, acc, m, l, z, qa, qsum, qoff, cs, kc, qpos, L, window,
                                           mlo, mhi, lane);
        } else {
          fill(r, sbuf, j, p0, MaskTag<true>{});
          head_tile_math<FMT, D, T, true, true>(r, p0, acc, m, l, z, qa, qsum, qoff, cs, kc, qpos, L, window,
                                          mlo, mhi, lane);
        }
      }
    }
    }   // PROBE_MATH
    mbar_arrive(&empty_bar[b]);   // this thread is done reading buffer b
    if (PROBE_DATA && producer && st + nbuf < nst) {
      mbar_wait(&empty_bar[b], ph);
      issue(st + nbuf, b, MaskTag<false>{});
    }
#ifdef KVLAB_DECODE_STAGE
    boff += static_cast<uint32_t>(stage_sm);
    if (b + 1 == nbuf) boff = 0u;
#endif
    if (++b == nbuf) { b = 0; ph ^= 1u; }
  }

  KVLAB_TL_MARK(3);
#ifdef KVLAB_DECODE_TIMELINE
  if (NH == 2 && half == 1 && producer && blockIdx.x < TL_MAX_CTAS) {   // half 1's loop end (word 23)
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    kvlab_decode_timeline[blockIdx.x * TL_WORDS + 23] = t;
  }
#endif
  KVLAB_PDL_LAUNCH_DEPENDENTS();   // the merge may launch now (it waits for this grid before its reads)
  // ---- epilogue: one warp per column group, no merge across warps
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);
  z += __shfl_xor_sync(0xffffffffu, z, 1);
  z += __shfl_xor_sync(0xffffffffu, z, 2);
  __syncthreads();  // every warp is done with the stages (and, for nst == 0, its q staging)
  float* ow = reinterpret_cast<float*>(dsm) + static_cast<size_t>(warp) * NCOL * D;
  {
    const float z0 = __shfl_sync(0xffffffffu, z, 8 * c), z1 = __shfl_sync(0xffffffffu, z, 8 * c + 4);
    store_acc_columns<FMT, D>(ow, acc, z0, z1, g, c);
    if (c == 0) { mo_sm[warp][g] = m; lo_sm[warp][g] = l; }
  }
  __syncwarp();
  const float vfac = (FMT == NVFP4) ? 128.f * v_scale : (FMT == FP8) ? FP8_V_OUT : 1.f;
  const int ncol = query_columns(tok0, hpc, tpc, Lq);   // the columns with a row (ALL_COLUMNS: NCOL)
  if constexpr (NH == 1) {
    for (int n = 0; n < ncol; ++n) {
      const float M = mo_sm[warp][n], Ls = lo_sm[warp][n];
      float x[E];
#pragma unroll
      for (int j = 0; j < E; ++j) x[j] = ow[n * D + lane * E + j] * vfac;
      const size_t slot = (static_cast<size_t>(part < 0 ? 0 : part) * ny + cg) * NCOL + n;
      finish_column<FMT, D, T>(x, M, Ls, part, slot, out, n, tok0, hpc, tpc, qs, Lq, num_q_heads,
                               kvh * G + hg * hpc, ws_o, ws_ml, lane);
    }
  } else {
    // the two halves of column group cg (warps cg, cg + ny) hold the softmax states of disjoint
    // chunks: merged here as the split merge does (log2 domain; an empty half has m = NEG_BIG,
    // l = 0), half 0 first; the columns shared over the two warps
    __syncthreads();
    const float* oa = reinterpret_cast<const float*>(dsm) + static_cast<size_t>(cg) * NCOL * D;
    const float* ob = oa + static_cast<size_t>(ny) * NCOL * D;
    for (int n = half; n < ncol; n += NH) {
      const float ma = mo_sm[cg][n], mb = mo_sm[cg + ny][n];
      const float M = fmaxf(ma, mb);
      const float fa = exp2f(ma - M), fb = exp2f(mb - M);
      const float Ls = lo_sm[cg][n] * fa + lo_sm[cg + ny][n] * fb;
      float x[E];
#pragma unroll
      for (int j = 0; j < E; ++j)
        x[j] = fmaf(oa[n * D + lane * E + j], fa, ob[n * D + lane * E + j] * fb) * vfac;
      const size_t slot = (static_cast<size_t>(part < 0 ? 0 : part) * ny + cg) * NCOL + n;
      finish_column<FMT, D, T>(x, M, Ls, part, slot, out, n, tok0, hpc, tpc, qs, Lq, num_q_heads,
                               kvh * G + hg * hpc, ws_o, ws_ml, lane);
    }
  }
#ifdef KVLAB_DECODE_TIMELINE
  __syncthreads();
  KVLAB_TL_MARK(4);
#endif
#endif
}

// kvlab — paged attention, prefill kernel on Hopper warpgroup MMA (wgmma, sm_90a only; SPEC 2.4).
// Python op: kvlab/cuda/attention.py (family "paged_prefill_wgmma", prefill_variant="wgmma").
// Reference: kvlab/reference/attention.py (float64). Design, budgets, predictions and
// measurements: docs/notes-prefill-wgmma.md. Same algorithm, numerics, work list and arguments as
// the mma.sync kernel paged_attention_prefill (paged_prefill.cu), whose tile decode, query
// prologue, online softmax and epilogue it shares (prefill_common.cuh); PTX wrappers in wgmma.cuh.
//
// Warp-specialised (since session 7; the session-6 kernel, two warpgroups that decoded and
// multiplied in lock-step, measured 19 % slower and is in git history). CTA = 3 warpgroups (384
// threads), one work item = 128 query rows of one sequence and one KV head:
//   * warpgroup 0 = producer (setmaxnreg.dec): int8/fp8/nvfp4: 2 threads per token (half rows,
//     PfTileLoader with PARTS = 2); int4/auto: row groups (PfRowGroupLoader: a lane owns 2 tokens,
//     a quarter of each row; ws_rowgroup) load the raw cache bytes of tile i (2 tiles ahead:
//     ws_raw_sets) and decode them into stage i % NS of a ring of
//     WS_NS shared-memory stages (K tile, V tile, per-token scales); auto: cp.async copies. Then
//     fence.proxy.async (the st.shared / cp.async writes are generic-proxy writes that wgmma reads
//     through the async proxy) and an arrive on full[s] (count 128, release).
//   * warpgroups 1, 2 = consumers (setmaxnreg.inc), 64 query rows each (consumer warp cw = warp - 4
//     holds rows 16cw .. 16cw + 15): wait full[s]; S = Q·K^T and O += P'·V wgmma; softmax in
//     registers; lane 0 of each consumer warp arrives on empty[s] (count 8) once the P'·V group
//     that read stage s has completed (wgmma.wait_group 0).
//   * ping-pong (unless -DKVLAB_WGMMA_WS_NO_PINGPONG): the consumers' wgmma issue blocks alternate
//     through two named barriers (ids 2, 3; 256 threads = the waiting warpgroup's bar.sync + the
//     other's bar.arrive), so one consumer's softmax runs while the other's GEMMs do. A block k
//     (k = 0 .. ntiles) issues P'·V of tile k-1 and S of tile k back to back; every consumer runs
//     all ntiles + 1 blocks (skipped tiles issue nothing but keep the handshake), so both named
//     barriers see the same number of bar.sync and bar.arrive.
// Compile switches (KVLAB_NVRTC_OPTIONS; attention.py's prefill_geometry reads the first for the
// launch): -DKVLAB_WGMMA_WS_STAGES=2..4 (ring stages, default 4), -DKVLAB_WGMMA_WS_NO_PINGPONG,
// -DKVLAB_WGMMA_NO_PRODUCER_AHEAD (below); session 13 (docs/perf-notes.md "Session 13"):
// -DKVLAB_WGMMA_ROWGROUP / -DKVLAB_WGMMA_NO_ROWGROUP (row-group loads for every format / none),
// -DKVLAB_WGMMA_RAW_SETS=2|3 (raw register sets of every raw-loading format),
// -DKVLAB_WGMMA_NO_SCALES_CF (the per-token scale order before session 13; prefill_common.cuh);
// session 14 (docs/perf-notes.md "Session 14"): -DKVLAB_WGMMA_NO_KSC_EARLY (the K scales loaded after
// the wgmma wait, as before), -DKVLAB_WGMMA_S_FIRST, -DKVLAB_WGMMA_VSC_EARLY, -DKVLAB_WGMMA_TREE_REDUCE
// (measured, not adopted), and in prefill_common.cuh -DKVLAB_PF_NO_PACKED_DECODE (the producers'
// nvfp4 / int8 decode before session 14).
// Producer ahead (KVLAB_WGMMA_PRODUCER_AHEAD, the default since session 9): for int4/int8/fp8/nvfp4
// each producer thread keeps two tiles of raw loads in flight (a second raw register set, the loop
// unrolled by two; producer 80 / 104 registers, consumers 208 / 200; no shared-memory change;
// docs/notes-prefill-wgmma.md, "Session 9 candidate"). Measured on the H200 in session 9 (4k causal
// 32/8 d = 128, same call as the old default, two runs each): int4 0.4782 / 0.4809 ms vs 0.4830 /
// 0.4820, nvfp4 0.4757 / 0.4779 vs 0.4924 / 0.4922 (-3 %), int8 -1.5 %, fp8 -0.8 %, auto unchanged
// (its code is the same); the wgmma prefill and degenerate GPU tests passed on it.
// -DKVLAB_WGMMA_NO_PRODUCER_AHEAD builds the old producer (one tile of raw loads in flight,
// 56 / 72 registers) for A/B.
// The consumers' path is the lean one since session 8 (docs/notes-prefill-wgmma.md, "Session 8
// candidate" and what the H200 measured: uniform-register descriptors, lazy softmax max, 4-lane-per-row
// query prologue and epilogue with 16-byte global accesses, permuted per-token scales; int4 −9 %,
// nvfp4 −7 %, auto −9 %, int8/fp8 ±0.5 % at 4k causal 32/8 d = 128). The session-7 consumer path
// (eager max, 32-lane prologue/epilogue, descriptors through R2UR) is in git history (9a1af8e).
#if !defined(KVLAB_WGMMA_NO_PRODUCER_AHEAD) && !defined(KVLAB_WGMMA_PRODUCER_AHEAD)
#define KVLAB_WGMMA_PRODUCER_AHEAD
#endif
#if defined(KVLAB_WGMMA_NO_PRODUCER_AHEAD) && defined(KVLAB_WGMMA_PRODUCER_AHEAD)
#error "KVLAB_WGMMA_PRODUCER_AHEAD (default) and KVLAB_WGMMA_NO_PRODUCER_AHEAD exclude each other"
#endif
// KVLAB_WGMMA_KSC_EARLY (default since session 14; -DKVLAB_WGMMA_NO_KSC_EARLY for A/B): a tile's K
// scales are loaded as soon as its stage is full, before the wgmma issue. Measured on the H200 (4k
// causal 32/8 d = 128, same call, two runs each): int4 0.4160 / 0.4156 → 0.4002 / 0.3999 ms (−3.8 %),
// int8 / fp8 −0.3 %; nvfp4 and auto have no per-token scales (unchanged code).
#if !defined(KVLAB_WGMMA_NO_KSC_EARLY) && !defined(KVLAB_WGMMA_KSC_EARLY)
#define KVLAB_WGMMA_KSC_EARLY
#endif
#if defined(KVLAB_WGMMA_NO_KSC_EARLY) && defined(KVLAB_WGMMA_KSC_EARLY)
#error "KVLAB_WGMMA_KSC_EARLY (default) and KVLAB_WGMMA_NO_KSC_EARLY exclude each other"
#endif
#if defined(KVLAB_WGMMA_VSC_EARLY) && !defined(KVLAB_WGMMA_KSC_EARLY)
#error "KVLAB_WGMMA_VSC_EARLY needs KVLAB_WGMMA_KSC_EARLY"
#endif
#if defined(KVLAB_WGMMA_ROWGROUP) && defined(KVLAB_WGMMA_NO_ROWGROUP)
#error "KVLAB_WGMMA_ROWGROUP and KVLAB_WGMMA_NO_ROWGROUP exclude each other"
#endif
#include "common.cuh"
#include "hadamard.cuh"
#include "attention_common.cuh"
#include "prefill_common.cuh"
#include "wgmma.cuh"
#include "bulk_copy.cuh"

using namespace kvlab;
using namespace kvlab::attn;
using namespace kvlab::pf;

namespace {
constexpr int WG_ROWS = 128;    // query rows per CTA, 64 per consumer warpgroup (attention.py: PF_ROWS)
constexpr int WG_KT = 64;       // KV tokens per tile
}  // namespace

// The 16-bit tiles as wgmma canonical no-swizzle core matrices (wgmma.cuh: core_off):
// [row][dim] with 8-row groups of D·16 bytes, 8-dim core matrices 128 bytes apart. The same
// bytes serve Q (A, K-major: LBO 128, SBO 16·D), K (B of S = Q·K^T, K-major over dims: LBO 128,
// SBO 16·D) and V (B of O = P·V, MN-major: K = tokens, N = dims: LBO 16·D, SBO 128).
template <int D>
struct PfCore {
  static constexpr int UNIT = 64;  // halves between consecutive 8-dim units of a row (128 bytes)
  static __device__ __forceinline__ int idx(int row, int dim) { return wg::core_off<D>(row, dim) / 2; }
};

// Descriptor fields (bytes) of the three operands; tests/test_prefill_wgmma_layout.py checks
// them against the PTX ISA's canonical layout.
template <int D>
struct WgDesc {
  static constexpr uint32_t QK_LBO = 128, QK_SBO = 16 * D;   // Q and K: K-major, K = dims
#ifndef KVLAB_WGMMA_V_SWAP_LBO_SBO
  static constexpr uint32_t V_LBO = 16 * D, V_SBO = 128;     // V: MN-major, K = tokens, N = dims
#else
  static constexpr uint32_t V_LBO = 128, V_SBO = 16 * D;     // debugging switch: the other reading
#endif
  static constexpr uint32_t QK_KSTEP = 256;                  // bytes per k16 step of Q and K
  static constexpr uint32_t V_KSTEP = 2 * 16 * D;            // bytes per k16 step of V (16 tokens)
};

#ifndef KVLAB_WGMMA_WS_STAGES
#define KVLAB_WGMMA_WS_STAGES 4
#endif

namespace {
constexpr int WS_NS = KVLAB_WGMMA_WS_STAGES;   // ring stages (attention.py: prefill_geometry)
constexpr int WS_THREADS = 384;                 // 1 producer + 2 consumer warpgroups
constexpr int WS_CW = 8;                        // consumer warps
static_assert(WS_NS >= 2 && WS_NS <= 4, "KVLAB_WGMMA_WS_STAGES: 2 .. 4 stages");

// Which producer loader a format uses (prefill_common.cuh). PfRowGroupLoader reads 16-32
// consecutive bytes of 8 rows per load instruction instead of 4 bytes of 32 rows (Nsight Compute,
// session 8: the producer's loads were 730 of the 2,980 L1 data-pipe wavefronts per int4 tile).
// Measured on the H200 in session 13 (4k causal 32/8 d = 128, same call, docs/perf-notes.md
// "Session 13"): int4 -6.5 %, auto -9.7 %, fp8 -2.9 % (none on top of the scale order below),
// int8 +4 %, nvfp4 +9 %. So it is the default for int4 and auto only; -DKVLAB_WGMMA_ROWGROUP
// takes it for every format, -DKVLAB_WGMMA_NO_ROWGROUP for none (A/B).
template <int FMT>
constexpr bool ws_rowgroup() {
#if defined(KVLAB_WGMMA_ROWGROUP)
  return true;
#elif defined(KVLAB_WGMMA_NO_ROWGROUP)
  return false;
#else
  return FMT == kvlab::attn::INT4 || FMT == kvlab::attn::AUTO;
#endif
}
template <bool B, class A, class C> struct PickType { using type = A; };
template <class A, class C> struct PickType<false, A, C> { using type = C; };
// Registers per thread after setmaxnreg (multiples of 8 in 24 .. 256). setmaxnreg moves registers
// inside the CTA's pool, which is what the launch allotted: 384 threads x WS_LAUNCH_REGS
// (__launch_bounds__(384, 1) caps ptxas at 65,536 / 384 -> 168; tests/test_kernels_compile.py
// checks that every instantiation reports exactly 168). A consumer asking for more than the
// producer released would block in setmaxnreg.inc forever: 128·P + 256·C <= 384·168.
// Producer ahead (the default): two raw register sets (18 more words than one set for int4/nvfp4
// at d = 128, 34 for int8/fp8): producer 80 / 104, consumers 208 / 200 (their code needs <= 197 /
// 163: SASS R indices, docs/notes-prefill-wgmma.md "Session 9 candidate"); auto's copies are
// unchanged (56 / 224). -DKVLAB_WGMMA_NO_PRODUCER_AHEAD: the producer holds one tile's raw half
// rows (int8/fp8 at d = 128: 32 words, otherwise <= 16) and ptxas fits its code into 56 / 72
// (SASS: R0 .. R63 for int8 at d = 128, R0 .. R52 for nvfp4), consumers 224 / 216.
constexpr int WS_LAUNCH_REGS = 168;
// Raw register sets of the producer (tiles of raw loads in flight per thread, the loop unrolled
// by that many): 2 ("producer ahead", session 9). -DKVLAB_WGMMA_RAW_SETS=3 (every raw-loading
// format; measured, not adopted): the raw loads of tile it+3 right after tile it is stored. Tried
// in session 13 because the consumers of nvfp4 and int8 waited on the producer (Nsight Compute:
// their full-barrier wait held 16 % of all stall samples, 1.4 % for int4; the producer's first use
// of its raw loads another 16 %); measured in the same call against two sets: nvfp4 +1 %, int8
// +1.5 %, fp8 +0.7 % (docs/perf-notes.md "Session 13", call 3).
template <int FMT>
constexpr int ws_raw_sets() {
#if defined(KVLAB_WGMMA_RAW_SETS)
  return FMT == kvlab::attn::AUTO ? 2 : KVLAB_WGMMA_RAW_SETS;
#else
  return 2;
#endif
}
#if defined(KVLAB_WGMMA_PRODUCER_AHEAD)
// Producer registers: the raw sets (int4 / nvfp4 at d = 128: 18 words per set, 20 with row-group
// loads; int8 / fp8: 34) plus ~40 for addresses and loop state. The device's NVRTC 13.0 spilled a
// few producer registers of the row-group int4 build at 80 (session 13 profile: STL/LDL in the
// producer loop), so row-group builds get 88, which costs the consumers nothing:
// ((3·168 − 88) / 2) & ~7 = 208 as at 80 (measured in session 13, call 3: int4 0.4227 → 0.4145 ms).
// Three sets (-DKVLAB_WGMMA_RAW_SETS=3): int4 / nvfp4 104 (consumers 200; their code needs up to
// R0 .. R192), int8 / fp8 136 at d = 128 (consumers 184; need R0 .. R162).
template <int FMT, int D>
constexpr int ws_producer_regs() {
  using namespace kvlab::attn;
  if (FMT == AUTO) return 56;
  const bool wide = D == 128 && (FMT == INT8 || FMT == FP8);
  if (ws_raw_sets<FMT>() == 3) return wide ? 136 : 104;
  if (ws_rowgroup<FMT>()) return wide ? 112 : 88;
  return wide ? 104 : 80;
}
#else
template <int FMT, int D>
constexpr int ws_producer_regs() {
  return (D == 128 && (FMT == kvlab::attn::INT8 || FMT == kvlab::attn::FP8)) ? 72 : 56;
}
#endif
template <int FMT, int D>
constexpr int ws_consumer_regs() {
  return ((3 * WS_LAUNCH_REGS - ws_producer_regs<FMT, D>()) / 2) & ~7;
}

template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}
constexpr int WS_BAR_Q = 1;      // consumers: query rows staged (256 threads)
constexpr int WS_BAR_TURN = 2;   // + consumer warpgroup (0, 1): its turn to issue wgmma (256)
constexpr int WS_BAR_EPI = 4;    // consumers: the epilogue's two barriers (256; not __syncthreads,
                                 // which the producer, gone by then, would have to reach too)
}  // namespace

// Dynamic shared memory: WS_NS stages of (K tile, V tile, 2·64 floats of per-token scales), then
// the 128 query rows. attention.py: prefill_smem_bytes = NS·(256·d + 512) + 256·d.
template <int D>
struct WsSmem {
  static constexpr int TILE = WG_KT * D * 2;
  static constexpr int STAGE = 2 * TILE + 2 * WG_KT * 4;
  static constexpr int Q_OFF = WS_NS * STAGE;
  static constexpr int BYTES = Q_OFF + WG_ROWS * D * 2;
  static constexpr int ORS = D + 4;
  static_assert(BYTES == WS_NS * (256 * D + 512) + 256 * D, "attention.py: prefill_smem_bytes");
  static_assert(WG_ROWS * ORS * 4 <= BYTES, "output rows fit the dynamic shared memory");
  static_assert(BYTES <= 227 * 1024, "fits an sm_90 CTA");
  static_assert(TILE % 1024 == 0 && STAGE % 16 == 0, "descriptor bases 16-byte aligned");
};

template <int FMT, int D, typename T>
__global__ void __launch_bounds__(WS_THREADS, 1)
paged_attention_prefill_wgmma(const T* __restrict__ q, T* __restrict__ out,
                              const uint8_t* __restrict__ cache, const int* __restrict__ block_table,
                              int bt_stride, const int* __restrict__ seq_lens,
                              const int* __restrict__ query_start_loc, const int* __restrict__ items,
                              int num_kv_heads, int num_q_heads, int bs_log2, float scale_log2,
                              float k_scale, float v_scale, int window, int swizzle_v) {
  using TR = Traits<FMT, D, T>;
  using CTQ = typename TR::CT_QK;
  using CTV = typename TR::CT_PV;
  using SM = WsSmem<D>;
  using DS = WgDesc<D>;
  static_assert(D == 64 || D == 128, "prefill kernel: head sizes 64, 128 (256 uses the decode kernel)");
  constexpr int KC = D / 16;         // k16 steps of Q·K^T
  constexpr int NT = WG_KT / 8;      // 8-token n-tiles of S
  constexpr int ON = D / 8;          // 8-dim n-tiles of O
  constexpr int PC = WG_KT / 16;     // k16 steps of P·V
  // per-token scales applied by the consumers (none for int4 under -DKVLAB_WGMMA_KV_PRESCALE)
  constexpr bool TOKSC = (FMT == INT4 || FMT == INT8 || FMT == FP8) && !pf_kv_prescaled<FMT>();
  static_assert(WG_KT * 2 == 128, "producer roles: token tid % 64, half row tid / 64");
  static_assert(128 * ws_producer_regs<FMT, D>() + 256 * ws_consumer_regs<FMT, D>() <= WS_THREADS * WS_LAUNCH_REGS,
                "setmaxnreg: the consumers get no more than the producer released");
  static_assert(ws_producer_regs<FMT, D>() % 8 == 0 && ws_consumer_regs<FMT, D>() % 8 == 0 &&
                ws_producer_regs<FMT, D>() >= 24 && ws_consumer_regs<FMT, D>() <= 256, "setmaxnreg operands");
  static_assert(!pf_v_prescaled<FMT>() || ws_rowgroup<FMT>(), "-DKVLAB_WGMMA_V_PRESCALE: row-group loads");
  static_assert(!pf_kv_prescaled<FMT>() || ws_rowgroup<FMT>(), "-DKVLAB_WGMMA_KV_PRESCALE: row-group loads");
  using Loader = typename PickType<ws_rowgroup<FMT>(), PfRowGroupLoader<FMT, D, T, PfCore<D>>,
                                   PfTileLoader<FMT, D, T, WG_KT, PfCore<D>, 2>>::type;

  extern __shared__ __align__(128) uint8_t pf_smem[];
  __shared__ float cs_sm[WG_ROWS];
  __shared__ __align__(8) uint64_t full_bar[WS_NS];
  __shared__ __align__(8) uint64_t empty_bar[WS_NS];

  // the warp index broadcast from lane 0: ptxas then knows it (and the role branch, the warpgroup
  // index and the consumers' loop state) is warp-uniform and keeps the wgmma descriptors in
  // uniform registers instead of building them in R registers and moving them (R2UR) per HGMMA
  const int tid = threadIdx.x, lane = tid & 31, warp = __shfl_sync(0xffffffffu, tid >> 5, 0);
  const int seq = items[2 * blockIdx.x], tok0 = items[2 * blockIdx.x + 1];
  const int kvh = blockIdx.y;
  const int G = num_q_heads / num_kv_heads;
  const int tpc = WG_ROWS / G;
  const int qs = query_start_loc[seq];
  const int Lq = query_start_loc[seq + 1] - qs;
  const int L = seq_lens[seq];
  const int nrow = min(tpc, Lq - tok0) * G;   // rows r < nrow are valid
  const int pbase = L - Lq + tok0;            // KV position of row 0's token
  const int hi = pbase + (nrow - 1) / G + 1;
  int lo = 0;
  if (window > 0) lo = max(0, pbase - window + 1);
  lo &= ~(WG_KT - 1);
  const int ntiles = hi > lo ? (hi - lo + WG_KT - 1) / WG_KT : 0;

  // a launch with another block size would hang in the barriers: fail loudly instead
  if (blockDim.x != WS_THREADS) __trap();
  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < WS_NS; ++s) {
      mbar_init(&full_bar[s], 128);       // every producer thread, after its stores + proxy fence
      mbar_init(&empty_bar[s], WS_CW);    // lane 0 of every consumer warp, after its P·V completed
    }
    mbar_init_fence();
  }
  __syncthreads();

  auto stage_k = [&](int s) { return pf_smem + s * SM::STAGE; };
  auto stage_v = [&](int s) { return pf_smem + s * SM::STAGE + SM::TILE; };
  auto stage_par = [&](int s) { return reinterpret_cast<float*>(pf_smem + s * SM::STAGE + 2 * SM::TILE); };

  if (warp < 4) {
    // ------------------------------------------------------------------ producer warpgroup
    setmaxnreg_dec<ws_producer_regs<FMT, D>()>();
    const int BS = 1 << bs_log2;
    Loader ld;
    ld.cache = cache;
    ld.bt = block_table + static_cast<size_t>(seq) * bt_stride;
    ld.side_stride = static_cast<unsigned>(BS * num_kv_heads * TR::ROW);
    ld.slab2 = 2u * ld.side_stride;
    ld.data_part = static_cast<unsigned>(BS * num_kv_heads * (D / 2));  // nvfp4: scales follow
    ld.L = L; ld.bs_log2 = bs_log2; ld.num_kv_heads = num_kv_heads; ld.kvh = kvh; ld.swizzle_v = swizzle_v;
    if constexpr (ws_rowgroup<FMT>()) {
      ld.init(tid);
    } else {
      ld.BS = BS; ld.lt = tid & (WG_KT - 1); ld.part = tid >> 6;
    }
    if constexpr (FMT == AUTO) {
      // 3+ stages: the copies of tile it are issued before tile it-1 is released (two tiles in
      // flight). With 2 stages that would deadlock: a consumer releases tile it-2 only after it
      // got tile it-1 (its P·V of tile k-1 waits for the full barrier of tile k), so the copies
      // are waited for at once.
#pragma unroll 1
      for (int it = 0; it < ntiles; ++it) {
        const int s = it % WS_NS;
        mbar_wait(&empty_bar[s], ((it / WS_NS) & 1) ^ 1);
        ld.copy(lo + it * WG_KT, smem_addr(stage_k(s)), smem_addr(stage_v(s)));
        if constexpr (WS_NS >= 3) {
          if (it > 0) {
            cp_async_wait<1>();
            wg::fence_proxy_async();
            mbar_arrive(&full_bar[(it - 1) % WS_NS]);
          }
        } else {
          cp_async_wait<0>();
          wg::fence_proxy_async();
          mbar_arrive(&full_bar[s]);
        }
      }
      if (WS_NS >= 3 && ntiles > 0) {
        cp_async_wait<0>();
        wg::fence_proxy_async();
        mbar_arrive(&full_bar[(ntiles - 1) % WS_NS]);
      }
    } else {
#if defined(KVLAB_WGMMA_PRODUCER_AHEAD)
      // two tiles of raw loads in flight per thread: ld holds the even tiles, lb the odd ones (a
      // copy of ld: the same pointers and strides, its own raw registers; the loop is unrolled by
      // two so that no register moves between the sets). The raw bytes of tile it+2 are loaded
      // right after tile it is stored, while tile it+1's are still in flight; block ids are loaded
      // a tile ahead of their raw loads, as in the NO_ build. Tiles 0 and 1 leave together.
      if constexpr (ws_raw_sets<FMT>() == 3) {
        // three raw sets (-DKVLAB_WGMMA_RAW_SETS=3): set j holds the tiles it ≡ j (mod 3); the raw bytes of tile
        // it+3 are loaded right after tile it is stored, so they have two tile periods to land
        Loader l1 = ld, l2 = ld;
        int blk = 0;
        if (ntiles > 0) {
          const int b0 = ld.block_of(lo);
          const int b1 = ntiles > 1 ? ld.block_of(lo + WG_KT) : 0;
          const int b2 = ntiles > 2 ? ld.block_of(lo + 2 * WG_KT) : 0;
          ld.load_raw(lo, b0);
          if (ntiles > 1) l1.load_raw(lo + WG_KT, b1);
          if (ntiles > 2) l2.load_raw(lo + 2 * WG_KT, b2);
          if (ntiles > 3) blk = ld.block_of(lo + 3 * WG_KT);
        }
        auto step = [&](Loader& lx, int t) {
          const int s = t % WS_NS;
          mbar_wait(&empty_bar[s], ((t / WS_NS) & 1) ^ 1);
          lx.template store_tile<true>(stage_k(s), stage_v(s), stage_par(s));
          wg::fence_proxy_async();
          mbar_arrive(&full_bar[s]);
          if (t + 3 < ntiles) {
            lx.load_raw(lo + (t + 3) * WG_KT, blk);
            blk = t + 4 < ntiles ? ld.block_of(lo + (t + 4) * WG_KT) : 0;
          }
        };
#pragma unroll 1
        for (int it = 0; it < ntiles; it += 3) {
          step(ld, it);
          if (it + 1 < ntiles) step(l1, it + 1);
          if (it + 2 < ntiles) step(l2, it + 2);
        }
      } else {
      Loader lb = ld;
      int blk = 0;
      if (ntiles > 0) {
        const int b0 = ld.block_of(lo);
        const int b1 = ntiles > 1 ? ld.block_of(lo + WG_KT) : 0;
        ld.load_raw(lo, b0);
        if (ntiles > 1) lb.load_raw(lo + WG_KT, b1);
        if (ntiles > 2) blk = ld.block_of(lo + 2 * WG_KT);
      }
#pragma unroll 1
      for (int it = 0; it < ntiles; it += 2) {
        const int p0 = lo + it * WG_KT;
        {
          const int s = it % WS_NS;
          mbar_wait(&empty_bar[s], ((it / WS_NS) & 1) ^ 1);
          ld.template store_tile<true>(stage_k(s), stage_v(s), stage_par(s));
          wg::fence_proxy_async();
          mbar_arrive(&full_bar[s]);
          if (it + 2 < ntiles) {
            ld.load_raw(p0 + 2 * WG_KT, blk);
            blk = it + 3 < ntiles ? ld.block_of(p0 + 3 * WG_KT) : 0;
          }
        }
        if (it + 1 < ntiles) {
          const int s = (it + 1) % WS_NS;
          mbar_wait(&empty_bar[s], (((it + 1) / WS_NS) & 1) ^ 1);
          lb.template store_tile<true>(stage_k(s), stage_v(s), stage_par(s));
          wg::fence_proxy_async();
          mbar_arrive(&full_bar[s]);
          if (it + 3 < ntiles) {
            lb.load_raw(p0 + 3 * WG_KT, blk);
            blk = it + 4 < ntiles ? ld.block_of(p0 + 4 * WG_KT) : 0;
          }
        }
      }
      }
#else
      // -DKVLAB_WGMMA_NO_PRODUCER_AHEAD (the default until session 9): one tile of raw loads in
      // flight; raw bytes of tile it+1 are loaded right after tile it is released (their block
      // ids a tile earlier), so they land while the producer waits for the next free stage
      int blk = 0;
      if (ntiles > 0) {
        ld.load_raw(lo);
        if (ntiles > 1) blk = ld.block_of(lo + WG_KT);
      }
#pragma unroll 1
      for (int it = 0; it < ntiles; ++it) {
        const int s = it % WS_NS;
        const int p0 = lo + it * WG_KT;
        mbar_wait(&empty_bar[s], ((it / WS_NS) & 1) ^ 1);
        ld.template store_tile<true>(stage_k(s), stage_v(s), stage_par(s));  // scales in PERM order
        wg::fence_proxy_async();
        mbar_arrive(&full_bar[s]);
        if (it + 1 < ntiles) {
          ld.load_raw(p0 + WG_KT, blk);
          if (it + 2 < ntiles) blk = ld.block_of(p0 + 2 * WG_KT);
        }
      }
#endif
    }
    // done: the consumers' epilogue reuses the ring for output rows on a named barrier of their
    // own (every stage was written and waited for: no producer store is outstanding)
  } else {
    // ------------------------------------------------------------------ consumer warpgroups
    setmaxnreg_inc<ws_consumer_regs<FMT, D>()>();
    const int cw = warp - 4, cwg = cw >> 2;
    const int g = lane >> 2, c = lane & 3;
    pf_stage_queries_quad<FMT, D, T, WG_ROWS, WS_CW, PfCore<D>>(reinterpret_cast<uint16_t*>(pf_smem + SM::Q_OFF),
                                                               cs_sm, q, cw, lane, nrow, tok0, G, qs, num_q_heads,
                                                               kvh, scale_log2, k_scale);
    wg::fence_proxy_async();  // Q rows: generic-proxy stores read by wgmma
    named_bar_sync(WS_BAR_Q, 256);
    const int r0 = cw * 16 + g, r1 = r0 + 8;
    const float cs0 = cs_sm[r0], cs1 = cs_sm[r1];
    const int qp0 = r0 < nrow ? pbase + r0 / G : -1;
    const int qp1 = r1 < nrow ? pbase + r1 / G : -1;
    const int gr = cwg * 64;
    const bool ghas = gr < nrow;
    const int gmin = pbase + gr / G;
    const int gmax = pbase + min(gr + 63, nrow - 1) / G;

    const uint32_t smem0 = smem_addr(pf_smem);
    const uint64_t qdesc = wg::desc_noswizzle(smem0 + SM::Q_OFF + cwg * 8 * (16 * D), DS::QK_LBO, DS::QK_SBO);
    const uint64_t kdesc0 = wg::desc_noswizzle(smem0, DS::QK_LBO, DS::QK_SBO);
    const uint64_t vdesc0 = wg::desc_noswizzle(smem0 + SM::TILE, DS::V_LBO, DS::V_SBO);

    float acc[ON][4];
#pragma unroll
    for (int j = 0; j < ON; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
    float m0 = NEG_BIG, m1 = NEG_BIG, l0 = 0.f, l1 = 0.f;
    float s[NT][4];
    uint32_t pa[PC][4];
#pragma unroll
    for (int kc = 0; kc < PC; ++kc) pa[kc][0] = pa[kc][1] = pa[kc][2] = pa[kc][3] = 0u;

#if !defined(KVLAB_WGMMA_WS_NO_PINGPONG)
    const int my_turn = WS_BAR_TURN + cwg, other_turn = WS_BAR_TURN + (cwg ^ 1);
    if (cwg == 1) named_bar_arrive(WS_BAR_TURN, 256);  // consumer 0 issues first
#endif
    // The consumer loop (docs/notes-prefill-wgmma.md, "Session 8 candidate"; the default since
    // session 8, the session-7 loop is in git history, 9a1af8e): the descriptors come
    // from warp-uniform values only (the broadcast warp index above, the loop counter, a stage offset
    // carried from tile to tile), so ptxas builds them in uniform registers (UIADD3 / UIADD3.64) and
    // no R2UR sits in front of an HGMMA; a start address < 2^18 never carries out of the 14-bit
    // start field. The softmax moves its reference max lazily (pf_softmax_update_lazy: the O
    // rescale only when an exponent would exceed PF_LAZY_TAU), and the per-token scales come in the
    // producer's PERM order (16-byte loads).
    auto issue_s = [&](uint32_t so) {
#pragma unroll
      for (int k = 0; k < KC; ++k)
        wg::MmaSS<WG_KT, CTQ>::run(s, qdesc + k * (DS::QK_KSTEP >> 4), kdesc0 + so + k * (DS::QK_KSTEP >> 4),
                                   k > 0 ? 1 : 0);
    };
    auto issue_pv = [&](uint32_t so) {
#pragma unroll
      for (int kc = 0; kc < PC; ++kc)
        wg::MmaRS<D, CTV>::run(acc, pa[kc], vdesc0 + so + kc * (DS::V_KSTEP >> 4), 1);
    };
    bool pact = false;
    uint32_t pso = 0, so = 0;       // descriptor offsets (bytes >> 4) of tile k-1's and tile k's stage
    float nm0 = 0.f, nm1 = 0.f;     // exponent offsets, kept across tiles (lazy max)
#pragma unroll 1
    for (int k = 0; k <= ntiles; ++k) {
      const int p0 = lo + k * WG_KT;
      const int st = k % WS_NS;
      const bool sact = k < ntiles && ghas && gmax >= p0 && !(window > 0 && p0 + WG_KT - 1 <= gmin - window);
      if (k < ntiles) mbar_wait(&full_bar[st], (k / WS_NS) & 1);
#if defined(KVLAB_WGMMA_KSC_EARLY)
      // KVLAB_WGMMA_KSC_EARLY (the default): tile k's K scales loaded as soon as its stage is full,
      // before the wgmma issue, so that their shared-memory latency hides under the products
      // instead of sitting between the wait and the first multiply (SASS of the session-13 build:
      // the four LDS.128 right after the wait; Nsight Compute: FMUL short-scoreboard 4.8 % of all
      // stall samples)
      float4 ks_early[4];
      if (sact) pf_load_k_scales<TOKSC>(ks_early, stage_par(st), c);
#if defined(KVLAB_WGMMA_VSC_EARLY)
      // -DKVLAB_WGMMA_VSC_EARLY (with KSC_EARLY): the V scales too (16 more live registers)
      float4 vs_early[PC];
#pragma unroll
      for (int kc = 0; kc < PC; ++kc)
        if (sact) vs_early[kc] = pf_v_scales_perm<TOKSC && !pf_v_prescaled<FMT>(), WG_KT>(stage_par(st), c, kc);
#endif
#endif
#if !defined(KVLAB_WGMMA_WS_NO_PINGPONG)
      named_bar_sync(my_turn, 256);
      const bool pass = !(cwg == 1 && k == ntiles);  // the last turn goes nowhere: counts match
#endif
      // block k: P'·V of tile k-1 (if this warpgroup computed its softmax) and S of tile k (if its
      // rows reach it), one commit group, one wait; issue and wait in the same branch (ptxas
      // serialises wgmma otherwise, C7518); the stage of tile k-1 is released after it. The turn
      // hand-over (bar.arrive right after the commit) is written out in each branch: as a lambda
      // ptxas schedules this loop differently from the build measured on the H200 (session 8).
      bool sdone = false;  // -DKVLAB_WGMMA_S_FIRST: tile k's softmax already done in the branch
      if (pact && sact) {
#if defined(KVLAB_WGMMA_S_FIRST)
        // S of tile k first, P'·V of tile k-1 second, two commit groups: the softmax of tile k
        // up to its exponentials runs once S has landed (wait<1>) while the tensor cores still
        // work on P'·V; the accumulator and the P' registers (read by that P'·V) are touched
        // only after wait<0>. Same arithmetic in the same order as the default path. Measured
        // on the H200 in session 14 (4k causal 32/8 d = 128, same call, two runs each), not
        // adopted: int4 0.4161 / 0.4148 → 0.4384 / 0.4400 ms (+5.6 %), nvfp4 +1 %, auto +1 %.
        wg::reg_fence(acc);
        wg::fence();
        issue_s(so);
        wg::commit();
        issue_pv(pso);
        wg::commit();
#if !defined(KVLAB_WGMMA_WS_NO_PINGPONG)
        if (pass) named_bar_arrive(other_turn, 256);
#endif
        wg::wait<1>();
        wg::reg_fence(s);
        {
          const bool full = (p0 + WG_KT - 1 <= gmin) && (window <= 0 || p0 > gmax - window);
          const float* par = stage_par(st);
          float4 ks[4];
          pf_load_k_scales<TOKSC>(ks, par, c);
          float al0, al1;
          const bool moved = pf_softmax_max_lazy<TOKSC>(s, ks, full, p0, qp0, qp1, window, c, cs0, cs1, m0, m1,
                                                        l0, l1, nm0, nm1, al0, al1);
          float e[PC][2][4];
#pragma unroll
          for (int kc = 0; kc < PC; ++kc) pf_exp_chunk(e[kc], s, kc, cs0, cs1, nm0, nm1, l0, l1);
#pragma unroll
          for (int kc = 0; kc < PC; ++kc) wg::reg_fence(e[kc]);  // the exponentials before the wait
          // the wait in both arms of a branch: in one basic block with the exponentials, ptxas
          // scheduled the wait first and the MUFUs after it (SASS, NVRTC 13.5)
          if (moved) {
            wg::wait<0>();
            wg::reg_fence(acc);
            pf_rescale_acc(acc, al0, al1);
          } else {
            wg::wait<0>();
            wg::reg_fence(acc);
          }
#pragma unroll
          for (int kc = 0; kc < PC; ++kc)
            pf_pack_chunk<TOKSC && !pf_v_prescaled<FMT>(), CTV>(
                pa[kc], e[kc], pf_v_scales_perm<TOKSC && !pf_v_prescaled<FMT>(), WG_KT>(par, c, kc));
        }
        sdone = true;
#else
        wg::reg_fence(acc);
        wg::fence();
        issue_pv(pso);
        issue_s(so);
        wg::commit();
#if !defined(KVLAB_WGMMA_WS_NO_PINGPONG)
        if (pass) named_bar_arrive(other_turn, 256);
#endif
        wg::wait<0>();
        wg::reg_fence(acc);
        wg::reg_fence(s);
#endif
      } else if (pact) {
        wg::reg_fence(acc);
        wg::fence();
        issue_pv(pso);
        wg::commit();
#if !defined(KVLAB_WGMMA_WS_NO_PINGPONG)
        if (pass) named_bar_arrive(other_turn, 256);
#endif
        wg::wait<0>();
        wg::reg_fence(acc);
      } else if (sact) {
        wg::fence();
        issue_s(so);
        wg::commit();
#if !defined(KVLAB_WGMMA_WS_NO_PINGPONG)
        if (pass) named_bar_arrive(other_turn, 256);
#endif
        wg::wait<0>();
        wg::reg_fence(s);
      } else {
#if !defined(KVLAB_WGMMA_WS_NO_PINGPONG)
        if (pass) named_bar_arrive(other_turn, 256);
#endif
      }
      if (k > 0) {
        __syncwarp();
        if (lane == 0) mbar_arrive(&empty_bar[(k - 1) % WS_NS]);  // this warp is done with tile k-1
      }
      if (sact && !sdone) {
        const bool full = (p0 + WG_KT - 1 <= gmin) && (window <= 0 || p0 > gmax - window);
        const float* par = stage_par(st);
#if defined(KVLAB_WGMMA_KSC_EARLY)
        {
          float al0, al1;
          if (pf_softmax_max_lazy<TOKSC>(s, ks_early, full, p0, qp0, qp1, window, c, cs0, cs1, m0, m1, l0, l1, nm0,
                                         nm1, al0, al1))
            pf_rescale_acc(acc, al0, al1);
        }
#else
        pf_softmax_update_lazy<TOKSC>(s, acc, par, full, p0, qp0, qp1, window, c, cs0, cs1, m0, m1, l0, l1, nm0, nm1);
#endif
#if defined(KVLAB_WGMMA_VSC_EARLY)
#pragma unroll
        for (int kc = 0; kc < PC; ++kc) {
          float e[2][4];
          pf_exp_chunk(e, s, kc, cs0, cs1, nm0, nm1, l0, l1);
          pf_pack_chunk<TOKSC && !pf_v_prescaled<FMT>(), CTV>(pa[kc], e, vs_early[kc]);
        }
#elif defined(KVLAB_WGMMA_TREE_REDUCE)
        {
          // -DKVLAB_WGMMA_TREE_REDUCE (with the row max as a tree in pf_softmax_max_lazy): the row
          // sums as a tree: each k-chunk's four exponentials per row summed on their own
          // (pf_exp_chunk into zeroed partials), the four partials pairwise, then into l (a chain
          // of 3 adds per tile on l instead of 8). Measured in session 14 (4k causal 32/8 d = 128,
          // same call, three runs each), not adopted: int4 0.4023 / 0.3992 / 0.3999 → 0.4094 /
          // 0.4116 / 0.4098 ms (+2.4 %), nvfp4 +0.8 %.
          float q0[PC], q1[PC];
#pragma unroll
          for (int kc = 0; kc < PC; ++kc) {
            float e[2][4];
            q0[kc] = 0.f; q1[kc] = 0.f;
            pf_exp_chunk(e, s, kc, cs0, cs1, nm0, nm1, q0[kc], q1[kc]);
            pf_pack_chunk<TOKSC && !pf_v_prescaled<FMT>(), CTV>(
                pa[kc], e, pf_v_scales_perm<TOKSC && !pf_v_prescaled<FMT>(), WG_KT>(par, c, kc));
          }
          static_assert(PC == 4, "four k-chunks per 64-token tile");
          l0 += (q0[0] + q0[1]) + (q0[2] + q0[3]);
          l1 += (q1[0] + q1[1]) + (q1[2] + q1[3]);
        }
#else
#pragma unroll
        for (int kc = 0; kc < PC; ++kc)
          pf_p_operand_perm<TOKSC && !pf_v_prescaled<FMT>(), CTV, NT, WG_KT>(pa[kc], s, kc, par, c, cs0, cs1, nm0,
                                                                           nm1, l0, l1);
#endif
      }
      pact = sact;
      pso = so;
      so = (st == WS_NS - 1) ? 0u : so + static_cast<uint32_t>(SM::STAGE >> 4);
    }

    pf_epilogue_quad<FMT, D, T, WG_ROWS, WS_CW, SM::ORS, WS_BAR_EPI>(acc, l0, l1, reinterpret_cast<float*>(pf_smem), out,
                                                                     r0, r1, c, cw, lane, nrow, tok0, G, qs,
                                                                     num_q_heads, kvh, v_scale);
  }
}

// kvlab — paged attention, prefill kernel on Hopper warpgroup MMA (wgmma, sm_90a only; SPEC 2.4).
// Python op: kvlab/cuda/attention.py (family "paged_prefill_wgmma", prefill_variant="wgmma").
// Reference: kvlab/reference/attention.py (float64). Design and prediction:
// docs/notes-prefill-wgmma.md. Same algorithm, numerics, work list and arguments as the
// mma.sync kernel paged_attention_prefill (paged_prefill.cu), whose tile decode, query
// prologue, online softmax and epilogue it shares (prefill_common.cuh); PTX wrappers in
// wgmma.cuh.
#include "common.cuh"
#include "hadamard.cuh"
#include "attention_common.cuh"
#include "prefill_common.cuh"
#include "wgmma.cuh"

using namespace kvlab;
using namespace kvlab::attn;
using namespace kvlab::pf;

namespace {
constexpr int WG_NW = 8;        // warps per CTA: 2 warpgroups (attention.py: PF_WARPS)
constexpr int WG_ROWS = 128;    // query rows per CTA, 64 per warpgroup (attention.py: PF_ROWS)
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

template <int D>
struct WgSmem {
  static constexpr int TILE = WG_KT * D * 2;              // bytes per K or V tile
  static constexpr int PAR = 2 * WG_KT;                   // floats: ksc[64], vsc[64]
  static constexpr int BUF_BYTES = 2 * TILE + PAR * 4;    // K tile, V tile, parameters
  static constexpr int Q_OFF = 2 * BUF_BYTES;             // query rows (A operand of Q·K^T)
  static constexpr int BYTES = Q_OFF + WG_ROWS * D * 2;   // dynamic shared memory of a launch
  static constexpr int ORS = D + 4;                       // floats per output row (epilogue)
  static_assert(BYTES == 768 * D + 1024, "kvlab/cuda/attention.py launches with 768*d + 1024 bytes");
  static_assert(WG_ROWS * ORS * 4 <= BYTES, "output rows fit the dynamic shared memory");
  static_assert(TILE % 1024 == 0 && BUF_BYTES % 16 == 0, "descriptor bases 16-byte aligned");
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

#if defined(KVLAB_WGMMA_WS)
// warp-specialised body (producer warpgroup + 2 consumer warpgroups, mbarrier ring, ping-pong)
#include "paged_prefill_wgmma_ws.cuh"
#else
// ====================================================================================
// paged_attention_prefill_wgmma<FMT, D, T>: one CTA = (128 query rows of one sequence, KV
// head), two warpgroups of 64 rows (warp w: rows 16w .. 16w + 15, as in the mma.sync
// kernel). Rows are (query token, query head) pairs, token-major.
//
// Per 64-token tile (double-buffered in shared memory, one __syncthreads per tile):
//   1. each warpgroup whose rows reach the tile: S = Q·K^T with D/16 wgmma m64n64k16 (A = Q,
//      B = K, both from shared memory), commit, wait;
//   2. per-token K scale, mask (diagonal / window-edge tiles only), online softmax in
//      registers (prefill_common.cuh, the mma.sync kernel's code);
//   3. O += P'·V with 4 wgmma m64nDk16 (A = P' from registers, B = V tile MN-major), commit;
//   4. while they run, every thread decodes its share of the next tile into the other
//      buffer (quantized formats; auto: cp.async of tile i+1 was issued before step 1);
//   5. fence.proxy.async (the decode's st.shared / cp.async writes -> the async proxy that
//      wgmma reads through), wait for the P·V group, barrier; then load the raw bytes of tile
//      i+2 (their block ids were loaded a tile earlier).
// Skip (no rows reach the tile) and mask-free decisions are per warpgroup (a wgmma is issued
// by all 128 threads of a warpgroup). Output rows go through shared memory (epilogue shared
// with the mma.sync kernel).
// ====================================================================================
template <int FMT, int D, typename T>
__global__ void __launch_bounds__(WG_NW * 32, 1)
paged_attention_prefill_wgmma(const T* __restrict__ q, T* __restrict__ out,
                              const uint8_t* __restrict__ cache, const int* __restrict__ block_table,
                              int bt_stride, const int* __restrict__ seq_lens,
                              const int* __restrict__ query_start_loc, const int* __restrict__ items,
                              int num_kv_heads, int num_q_heads, int bs_log2, float scale_log2,
                              float k_scale, float v_scale, int window, int swizzle_v) {
  using TR = Traits<FMT, D, T>;
  using CTQ = typename TR::CT_QK;
  using CTV = typename TR::CT_PV;
  using SM = WgSmem<D>;
  using DS = WgDesc<D>;
  static_assert(D == 64 || D == 128, "prefill kernel: head sizes 64, 128 (256 uses the decode kernel)");
  constexpr int KC = D / 16;         // k16 steps of Q·K^T
  constexpr int NT = WG_KT / 8;      // 8-token n-tiles of S
  constexpr int ON = D / 8;          // 8-dim n-tiles of O
  constexpr int PC = WG_KT / 16;     // k16 steps of P·V
  constexpr bool TOKSC = (FMT == INT4 || FMT == INT8 || FMT == FP8);  // per-token scales
  static_assert(WG_KT * 4 == WG_NW * 32, "decode roles: token tid % 64, row quarter tid / 64");
  using Loader = PfTileLoader<FMT, D, T, WG_KT, PfCore<D>>;

  extern __shared__ __align__(128) uint8_t pf_smem[];
  __shared__ float cs_sm[WG_ROWS];

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wgi = warp >> 2;
  const int g = lane >> 2, c = lane & 3;
  const int seq = items[2 * blockIdx.x], tok0 = items[2 * blockIdx.x + 1];
  const int kvh = blockIdx.y;
  const int G = num_q_heads / num_kv_heads;
  const int tpc = WG_ROWS / G;
  const int qs = query_start_loc[seq];
  const int Lq = query_start_loc[seq + 1] - qs;
  const int L = seq_lens[seq];
  const int BS = 1 << bs_log2;
  const int nrow = min(tpc, Lq - tok0) * G;   // rows r < nrow are valid
  const int pbase = L - Lq + tok0;            // KV position of row 0's token

  pf_stage_queries<FMT, D, T, WG_ROWS, WG_NW, PfCore<D>>(reinterpret_cast<uint16_t*>(pf_smem + SM::Q_OFF), cs_sm, q, warp, lane, nrow, tok0,
                                                        G, qs, num_q_heads, kvh, scale_log2, k_scale);
  wg::fence_proxy_async();  // Q rows: generic-proxy stores read by wgmma
  __syncthreads();
  const int r0 = warp * 16 + g, r1 = r0 + 8;
  const float cs0 = cs_sm[r0], cs1 = cs_sm[r1];
  const int qp0 = r0 < nrow ? pbase + r0 / G : -1;
  const int qp1 = r1 < nrow ? pbase + r1 / G : -1;
  // the warpgroup's rows (skip / mask-free decisions)
  const int gr = wgi * 64;
  const bool ghas = gr < nrow;
  const int gmin = pbase + gr / G;
  const int gmax = pbase + min(gr + 63, nrow - 1) / G;

  const int hi = pbase + (nrow - 1) / G + 1;
  int lo = 0;
  if (window > 0) lo = max(0, pbase - window + 1);
  lo &= ~(WG_KT - 1);
  const int ntiles = hi > lo ? (hi - lo + WG_KT - 1) / WG_KT : 0;

  Loader ld;
  ld.cache = cache;
  ld.bt = block_table + static_cast<size_t>(seq) * bt_stride;
  // a block = 2 slabs (K, V) of BS * H_kv rows: < 2^31 bytes for every supported shape
  ld.side_stride = static_cast<unsigned>(BS * num_kv_heads * TR::ROW);
  ld.slab2 = 2u * ld.side_stride;
  ld.data_part = static_cast<unsigned>(BS * num_kv_heads * (D / 2));  // nvfp4: scales follow
  ld.L = L; ld.bs_log2 = bs_log2; ld.BS = BS; ld.num_kv_heads = num_kv_heads; ld.kvh = kvh;
  ld.lt = tid & (WG_KT - 1); ld.part = tid >> 6; ld.swizzle_v = swizzle_v;

  auto tile_k = [&](int b) { return pf_smem + b * SM::BUF_BYTES; };
  auto tile_v = [&](int b) { return pf_smem + b * SM::BUF_BYTES + SM::TILE; };
  auto tile_par = [&](int b) { return reinterpret_cast<float*>(pf_smem + b * SM::BUF_BYTES + 2 * SM::TILE); };

  // descriptors of buffer 0 / the warpgroup's Q rows (buffer b adds b·BUF_BYTES to the start
  // address field: (b·BUF_BYTES) >> 4, no carry out of the 14-bit field below 256 KB)
  const uint32_t smem0 = smem_addr(pf_smem);
  const uint64_t qdesc = wg::desc_noswizzle(smem0 + SM::Q_OFF + wgi * 8 * (16 * D), DS::QK_LBO, DS::QK_SBO);
  const uint64_t kdesc0 = wg::desc_noswizzle(smem0, DS::QK_LBO, DS::QK_SBO);
  const uint64_t vdesc0 = wg::desc_noswizzle(smem0 + SM::TILE, DS::V_LBO, DS::V_SBO);

  float acc[ON][4];
#pragma unroll
  for (int j = 0; j < ON; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
  float m0 = NEG_BIG, m1 = NEG_BIG, l0 = 0.f, l1 = 0.f;

  // Tile p0 from buffer b; quantized formats also decode the raw registers into buffer nb
  // while the P·V wgmma group runs.
  auto compute = [&](int b, int p0, int nb) {
    const bool act = ghas && gmax >= p0 && !(window > 0 && p0 + WG_KT - 1 <= gmin - window);
    if (act) {
      const bool full = (p0 + WG_KT - 1 <= gmin) && (window <= 0 || p0 > gmax - window);
      const uint64_t bofs = static_cast<uint64_t>((b * SM::BUF_BYTES) >> 4);
      const float* par = tile_par(b);
      float s[NT][4];
      wg::fence();
#pragma unroll
      for (int k = 0; k < KC; ++k)
        wg::MmaSS<WG_KT, CTQ>::run(s, qdesc + k * (DS::QK_KSTEP >> 4), kdesc0 + bofs + k * (DS::QK_KSTEP >> 4),
                                   k > 0 ? 1 : 0);
      wg::commit();
      wg::wait<0>();
      wg::reg_fence(s);
      float nm0, nm1;
      pf_softmax_update<TOKSC>(s, acc, par, full, p0, qp0, qp1, window, c, cs0, cs1, m0, m1, l0, l1, nm0, nm1);
      uint32_t pa[PC][4];
#pragma unroll
      for (int kc = 0; kc < PC; ++kc)
        pf_p_operand<TOKSC, CTV, NT, WG_KT>(pa[kc], s, kc, par, c, cs0, cs1, nm0, nm1, l0, l1);
      wg::reg_fence(acc);
      wg::fence();
#pragma unroll
      for (int kc = 0; kc < PC; ++kc)
        wg::MmaRS<D, CTV>::run(acc, pa[kc], vdesc0 + bofs + kc * (DS::V_KSTEP >> 4), 1);
      wg::commit();
      // the next tile's decode runs while the P·V group is in flight (issue and wait in one
      // branch: ptxas serializes wgmma across a wait in a different divergent region, C7518)
      if constexpr (FMT != AUTO) {
        ld.store_tile(tile_k(nb), tile_v(nb), tile_par(nb));
        wg::fence_proxy_async();
      }
      wg::wait<0>();
      wg::reg_fence(acc);
    } else {
      if constexpr (FMT != AUTO) {
        ld.store_tile(tile_k(nb), tile_v(nb), tile_par(nb));
        wg::fence_proxy_async();
      }
    }
  };

  // Quantized formats: block ids are loaded one tile before the row loads that need them (blk:
  // the next tile to load); fence.proxy.async (MEMBAR.ALL.CTA + FENCE.VIEW.ASYNC.S: it waits for
  // the thread's outstanding memory operations) sits right after the thread's shared-memory
  // writes of a tile, and the next raw loads are issued after the barrier. (auto: the block id
  // a tile ahead measured 8 % slower on the H200, run 2 of docs/notes-prefill-wgmma.md, so its
  // copies look the block id up themselves, as in run 1.)
  if constexpr (FMT == AUTO) {
    if (ntiles > 0) ld.copy(lo, smem_addr(tile_k(0)), smem_addr(tile_v(0)));
    for (int it = 0; it < ntiles; ++it) {
      const int p0 = lo + it * WG_KT;
      cp_async_wait<0>();
      wg::fence_proxy_async();
      __syncthreads();  // tile `it` landed for every thread; buffer (it+1)&1 is no longer read
      if (it + 1 < ntiles) {
        const int nb = (it + 1) & 1;
        ld.copy(p0 + WG_KT, smem_addr(tile_k(nb)), smem_addr(tile_v(nb)));
      }
      compute(it & 1, p0, 0);
    }
  } else {
    int blk = 0;
    if (ntiles > 0) {
      ld.load_raw(lo);
      if (ntiles > 1) blk = ld.block_of(lo + WG_KT);
      ld.store_tile(tile_k(0), tile_v(0), tile_par(0));
      if (ntiles > 1) ld.load_raw(lo + WG_KT, blk);
      if (ntiles > 2) blk = ld.block_of(lo + 2 * WG_KT);
    }
    wg::fence_proxy_async();
    __syncthreads();
    for (int it = 0; it < ntiles; ++it) {
      const int p0 = lo + it * WG_KT;
      // decodes tile it+1 (on the last tile: the raw registers again, into the unused buffer)
      compute(it & 1, p0, (it + 1) & 1);
      __syncthreads();
      // raw bytes of tile it+2 (consumed by the decode in the next compute, after its S and
      // softmax: a tile's time to land), issued after the barrier so that no fence or barrier
      // of this tile waits for them
      if (it + 2 < ntiles) {
        ld.load_raw(p0 + 2 * WG_KT, blk);
        if (it + 3 < ntiles) blk = ld.block_of(p0 + 3 * WG_KT);
      }
    }
  }

  pf_epilogue<FMT, D, T, WG_ROWS, WG_NW, SM::ORS>(acc, l0, l1, reinterpret_cast<float*>(pf_smem), out, r0, r1, c,
                                                  warp, lane, nrow, tok0, G, qs, num_q_heads, kvh, v_scale);
}
#endif  // KVLAB_WGMMA_WS

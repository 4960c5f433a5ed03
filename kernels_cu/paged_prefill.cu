// kvlab — paged attention, prefill kernel (SPEC 2.4). Python op: kvlab/cuda/attention.py
// (family "paged_prefill"; the decode and reduction kernels are in paged_attention.cu).
// Reference: kvlab/reference/attention.py (float64). Building blocks: attention_common.cuh,
// prefill_common.cuh (tile decode, ldmatrix, dim order, epilogue). The Hopper wgmma variant of
// this kernel: paged_prefill_wgmma.cu.
#include "common.cuh"
#include "hadamard.cuh"
#include "attention_common.cuh"
#include "prefill_common.cuh"

using namespace kvlab;
using namespace kvlab::attn;
using namespace kvlab::pf;

namespace {
constexpr int NW = 8;         // warps per CTA (attention.py: PF_WARPS)
constexpr int PF_ROWS = 128;  // query rows per CTA, 16 per warp (attention.py: PF_ROWS)
constexpr int PF_KT = 64;     // KV tokens per tile
}  // namespace
// ====================================================================================
// paged_attention_prefill<FMT, D, T>: one CTA = (128 query rows of one sequence, KV head),
// 8 warps of 16 rows. Rows are (query token, query head) pairs, token-major: row r -> token
// tok0 + r / G, head r % G, so the G heads of a KV head share every K/V tile (GQA). The CTA
// walks the KV positions in tiles of 64 tokens up to its last row's position (tiles above
// the causal diagonal are never loaded) and from its first row's window start.
//
// Pipeline (one __syncthreads per tile, two tile buffers in dynamic shared memory):
//   quantized formats: the raw bytes of tile i+1 sit in registers (loaded during tile i-1);
//     after computing tile i every thread decodes its share of tile i+1 (token tid % 64,
//     a quarter of the row: D/4 dims of K and of V) into the other buffer as exact 16-bit
//     values [token][dim] (prefill_common.cuh), then loads tile i+2's bytes;
//   auto: tile i+1 is copied with 16-byte cp.async into the other buffer while tile i is
//     computed.
// Per tile each warp computes S = Q·K^T (m16 x n64 x D; K via ldmatrix), scales by the
// per-token K scale (int4/int8/fp8) — one multiply per element, zero points were subtracted
// in the decode — masks only on tiles that cross its rows' causal diagonal or window edge,
// runs the online softmax in log2 units (exp2 of one FFMA), and O += P'·V (P' = P·per-token
// V scale in registers, V via ldmatrix.trans). Warps whose rows all lie before the tile (or
// entirely past its window) skip the math. Output rows go through shared memory for the
// int4 inverse rotation and the dim order.
// ====================================================================================
template <int D>
struct PfSmem {
  static constexpr int RS = D + 8;                          // halves per token row (16-byte pad: ldmatrix conflict-free)
  static constexpr int TILE = PF_KT * RS;                   // halves per K or V tile
  static constexpr int PAR = 2 * PF_KT;                     // floats: ksc[64], vsc[64]
  static constexpr int BUF_BYTES = 2 * TILE * 2 + PAR * 4;
  static constexpr int Q_OFF = 2 * BUF_BYTES;               // query rows (16-bit, ldmatrix A operands)
  static constexpr int BYTES = Q_OFF + PF_ROWS * RS * 2;    // dynamic shared memory of a launch
  static constexpr int ORS = D + 4;                         // floats per output row (epilogue)
  static_assert(BYTES == 768 * D + 7168, "kvlab/cuda/attention.py launches with 768*d + 7168 bytes");
  static_assert(PF_ROWS * ORS * 4 <= 2 * BUF_BYTES, "output rows fit the tile buffers");
};

template <int FMT, int D, typename T>
__global__ void __launch_bounds__(NW * 32, 1)
paged_attention_prefill(const T* __restrict__ q, T* __restrict__ out,
                        const uint8_t* __restrict__ cache, const int* __restrict__ block_table,
                        int bt_stride, const int* __restrict__ seq_lens,
                        const int* __restrict__ query_start_loc, const int* __restrict__ items,
                        int num_kv_heads, int num_q_heads, int bs_log2, float scale_log2,
                        float k_scale, float v_scale, int window, int swizzle_v) {
  using TR = Traits<FMT, D, T>;
  using CTQ = typename TR::CT_QK;
  using CTV = typename TR::CT_PV;
  using SM = PfSmem<D>;
  static_assert(D == 64 || D == 128, "prefill kernel: head sizes 64, 128 (256 uses the decode kernel)");
  constexpr int E = D / 32;          // dims per lane in the prologue / epilogue
  constexpr int KC = D / 16;         // k-chunks of Q·K
  constexpr int NT = PF_KT / 8;      // n-tiles of S
  constexpr int ON = D / 8;          // n-tiles of O
  constexpr int UPT = D / 32;        // 8-dim units per thread and side in the decode
  constexpr int KW = TR::KB / 4;     // raw words per thread and side (D/4 dims)
  constexpr int NGK = (FMT == NVFP4) ? D / 64 : 1;  // nvfp4 scale groups per thread and side
  constexpr bool TOKSC = (FMT == INT4 || FMT == INT8 || FMT == FP8);  // per-token scales
  static_assert(PF_KT * 4 == NW * 32, "decode roles: token tid % 64, row quarter tid / 64");

  extern __shared__ __align__(16) uint8_t pf_smem[];
  __shared__ float cs_sm[PF_ROWS];

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, c = lane & 3;
  const int seq = items[2 * blockIdx.x], tok0 = items[2 * blockIdx.x + 1];
  const int kvh = blockIdx.y;
  const int G = num_q_heads / num_kv_heads;
  const int tpc = PF_ROWS / G;
  const int qs = query_start_loc[seq];
  const int Lq = query_start_loc[seq + 1] - qs;
  const int L = seq_lens[seq];
  const int BS = 1 << bs_log2;
  const int nrow = min(tpc, Lq - tok0) * G;   // rows r < nrow are valid
  const int pbase = L - Lq + tok0;            // KV position of row 0's token

  // ---- prologue: 128 query rows (load_query_vector: rotated for int4, prescaled) -> shared
  // memory, dims in the tiles' order
  {
    uint16_t* q_sm = reinterpret_cast<uint16_t*>(pf_smem + SM::Q_OFF);
    const float kfold = (FMT == NVFP4) ? 128.f * k_scale : 1.f;  // nvfp4: global K scale
    for (int r = warp; r < PF_ROWS; r += NW) {
      const bool valid = r < nrow;
      const int tok = tok0 + r / G;
      const int qhead = kvh * G + r % G;
      float x[E];
      const float pre = load_query_vector<FMT, D, T>(q, valid, qs + tok, num_q_heads, qhead, lane, x);
#pragma unroll
      for (int j = 0; j < E; ++j) {
        const int dim = lane * E + j;
        q_sm[r * SM::RS + (dim & ~7) + unit_pos<FMT>(dim & 7)] = bits16<CTQ>(x[j] * pre);
      }
      if (lane == 0) cs_sm[r] = scale_log2 * kfold / pre;
    }
  }
  __syncthreads();
  const int r0 = warp * 16 + g, r1 = r0 + 8;
  // Q·K A operands come from shared memory (ldmatrix.x4 per 16-dim chunk, each tile): keeps
  // 32 registers free at d = 128. Lane l: row warp*16 + l % 8 + 8·(l / 8 % 2), dims + 8·(l / 16).
  unsigned qbase = smem_addr(pf_smem + SM::Q_OFF) +
                         2 * (((warp * 16) + (lane & 7) + 8 * ((lane >> 3) & 1)) * SM::RS + 8 * (lane >> 4));
  const float cs0 = cs_sm[r0], cs1 = cs_sm[r1];
  const int qp0 = r0 < nrow ? pbase + r0 / G : -1;
  const int qp1 = r1 < nrow ? pbase + r1 / G : -1;
  const int wr = warp * 16;
  const bool whas = wr < nrow;
  const int wmin = pbase + wr / G;
  const int wmax = pbase + min(wr + 15, nrow - 1) / G;

  const int hi = pbase + (nrow - 1) / G + 1;
  int lo = 0;
  if (window > 0) lo = max(0, pbase - window + 1);
  lo &= ~(PF_KT - 1);
  const int ntiles = hi > lo ? (hi - lo + PF_KT - 1) / PF_KT : 0;
  // a block = 2 slabs (K, V) of BS * H_kv rows: < 2^31 bytes for every supported shape
  const unsigned side_stride = static_cast<unsigned>(BS * num_kv_heads * TR::ROW);
  const unsigned slab2 = 2u * side_stride;
  const unsigned data_part = static_cast<unsigned>(BS * num_kv_heads * (D / 2));  // nvfp4: scales follow
  const int* bt = block_table + static_cast<size_t>(seq) * bt_stride;
  constexpr int RB = (FMT == NVFP4) ? D / 2 : TR::ROW;  // bytes between rows of the data part

  // decode roles: token lt of the tile, quarter `part` of its K and V rows (D/4 dims)
  const int lt = tid & (PF_KT - 1), part = tid >> 6;
  auto tile_k = [&](int b) { return reinterpret_cast<uint16_t*>(pf_smem + b * SM::BUF_BYTES); };
  auto tile_v = [&](int b) { return reinterpret_cast<uint16_t*>(pf_smem + b * SM::BUF_BYTES) + SM::TILE; };
  auto tile_par = [&](int b) {
    return reinterpret_cast<float*>(pf_smem + b * SM::BUF_BYTES + 4 * SM::TILE);
  };

  uint32_t rk[KW], rv[KW];
  uint32_t rkp = 0u, rvp = 0u;   // int4/int8/fp8: the rows' parameter words; nvfp4: scale bytes
  auto load_raw = [&](int p0) {
    const int p = p0 + lt;
    const bool in = p < L;
    const int blk = in ? bt[p >> bs_log2] : 0;
    const int tt = p & (BS - 1);
    const unsigned rowi = static_cast<unsigned>(tt * num_kv_heads + kvh);
    const uint8_t* kslab = cache + static_cast<size_t>(static_cast<unsigned>(blk)) * slab2;
    const uint8_t* kr = kslab + rowi * RB;
    const uint8_t* vr = kr + side_stride;
    load_words<TR::KB, TR::ALIGN>(kr + part * TR::KB, rk, in);
    load_words<TR::KB, TR::ALIGN>(vr + part * TR::KB, rv, in);
    if constexpr (FMT == INT4 || FMT == INT8 || FMT == FP8) {
      constexpr int OFF = (FMT == INT4) ? D / 2 : D;
      rkp = in ? __ldg(reinterpret_cast<const unsigned*>(kr + OFF)) : 0u;
      rvp = in ? __ldg(reinterpret_cast<const unsigned*>(vr + OFF)) : 0u;
    } else if constexpr (FMT == NVFP4) {
      constexpr int S = D / 16;
      uint32_t kb = 0u, vb = 0u;
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
      rkp = kb; rvp = vb;
    }
  };
  // raw registers -> decoded tile buffer b: unit u (8 dims) of the thread's K and V quarter rows
  auto store_unit = [&](int b, int u) {
    if constexpr (FMT != AUTO) {
      uint16_t* kt = tile_k(b) + lt * SM::RS + part * (D / 4) + 8 * u;
      uint16_t* vt = tile_v(b) + lt * SM::RS + part * (D / 4) + 8 * u;
      uint4 ko, vo;
      if constexpr (FMT == NVFP4) {
        const int i = u >> 1;  // 16-dim group of the unit
        const uint16_t hk = bits16<__half>(e4m3_to_float((rkp >> (8 * i)) & 0xFFu) * 128.f);
        const uint16_t hv = bits16<__half>(e4m3_to_float((rvp >> (8 * i)) & 0xFFu) * 128.f);
        ko = dec_unit<FMT, false>(rk[u], 0u, pack2(hk, hk));
        vo = dec_unit<FMT, true>(rv[u], 0u, pack2(hv, hv));
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
  };
  auto store_params = [&](int b) {
    if constexpr (TOKSC) {
      float ksc, vsc;
      if constexpr (FMT == INT4) {
        ksc = __uint_as_float(rkp & ~0xFu);
        vsc = __uint_as_float(rvp & ~0xFu);
      } else if constexpr (FMT == INT8) {
        ksc = __uint_as_float(rkp); vsc = __uint_as_float(rvp);
      } else {
        ksc = __uint_as_float(rkp); vsc = __uint_as_float(rvp) * FP8_V_P;
      }
      if (part == 0) {
        float* par = tile_par(b);
        par[lt] = ksc;
        par[PF_KT + lt] = vsc;
      }
    }
  };
  auto store_tile = [&](int b) {
#pragma unroll
    for (int u = 0; u < UPT; ++u) store_unit(b, u);
    store_params(b);
  };
  // auto: 16-byte copies of tile p0 into buffer b
  auto copy_tile = [&](int p0, int b) {
    const int p = p0 + lt;
    const bool in = p < L;
    const int blk = in ? bt[p >> bs_log2] : 0;
    const unsigned rowi = static_cast<unsigned>((p & (BS - 1)) * num_kv_heads + kvh);
    const uint8_t* kr = cache + static_cast<size_t>(static_cast<unsigned>(blk)) * slab2 + rowi * RB + part * TR::KB;
    const uint8_t* vr = kr + side_stride;
    const unsigned kd = smem_addr(tile_k(b) + lt * SM::RS + part * (D / 4));
    const unsigned vd = smem_addr(tile_v(b) + lt * SM::RS + part * (D / 4));
#pragma unroll
    for (int i = 0; i < TR::KB / 16; ++i) {
      cp_async16_zfill(kd + 16 * i, kr + 16 * i, in);
      cp_async16_zfill(vd + 16 * i, vr + 16 * i, in);
    }
    cp_async_commit();
  };

  float acc[ON][4];
#pragma unroll
  for (int j = 0; j < ON; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
  float m0 = NEG_BIG, m1 = NEG_BIG, l0 = 0.f, l1 = 0.f;

  // per-lane ldmatrix offsets (halves): K rows = tokens (lane % 8), 8-dim column block lane / 8;
  // V^T: token rows lane % 8 + 8·(lane / 8 % 2), 8-dim column block lane / 16
  // (shared-window byte addresses of buffer 0, computed once: buffer b adds b·BUF_BYTES)
  unsigned kaddr0 = smem_addr(pf_smem) + 2 * ((lane & 7) * SM::RS + 8 * (lane >> 3));
  // V tile of buffer 0 starts TILE halves = 2·TILE bytes after its K tile (tile_v)
  unsigned vaddr0 = smem_addr(pf_smem) + 2 * SM::TILE +
                          2 * (((lane & 7) + 8 * ((lane >> 3) & 1)) * SM::RS + 8 * (lane >> 4));
  pin_reg(kaddr0, vaddr0, qbase);  // computed once, not re-derived from the thread index per tile

  // Tile p0 from buffer b; quantized formats also decode the raw registers into buffer nb
  // (interleaved with the P·V mma so that the integer work fills the tensor-pipe gaps).
  auto compute = [&](int b, int p0, int nb) {
    if (!whas || wmax < p0 || (window > 0 && p0 + PF_KT - 1 <= wmin - window)) {
      if constexpr (FMT != AUTO) store_tile(nb);
      return;
    }
    const bool full = (p0 + PF_KT - 1 <= wmin) && (window <= 0 || p0 > wmax - window);
    const unsigned kbase = kaddr0 + b * SM::BUF_BYTES;
    const unsigned vbase = vaddr0 + b * SM::BUF_BYTES;
    const float* par = tile_par(b);
    float s[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
    for (int k2 = 0; k2 < KC / 2; ++k2) {
      uint32_t qa0[4], qa1[4];
      ldsm_x4(qa0, qbase + 2 * (32 * k2));
      ldsm_x4(qa1, qbase + 2 * (32 * k2 + 16));
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        uint32_t bk[4];
        ldsm_x4(bk, kbase + 2 * (nt * 8 * SM::RS + 32 * k2));
        Mma<CTQ>::run(s[nt], qa0[0], qa0[1], qa0[2], qa0[3], bk[0], bk[1]);
        Mma<CTQ>::run(s[nt], qa1[0], qa1[1], qa1[2], qa1[3], bk[2], bk[3]);
      }
    }
    // s[nt][0..1] = (row r0, tokens nt*8+2c, +1), s[nt][2..3] = row r1. Per-token K scale.
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
    const float nm0 = mn0 == NEG_BIG ? 0.f : -mn0 * cs0;  // row fully masked so far: exponents -inf
    const float nm1 = mn1 == NEG_BIG ? 0.f : -mn1 * cs1;
    l0 *= al0; l1 *= al1;
    if (__any_sync(0xffffffffu, al0 != 1.f || al1 != 1.f)) {
#pragma unroll
      for (int j = 0; j < ON; ++j) {
        acc[j][0] *= al0; acc[j][1] *= al0; acc[j][2] *= al1; acc[j][3] *= al1;
      }
    }
    // P' (A operand of P·V): k-chunk kc covers S n-tiles 2kc, 2kc+1
#pragma unroll
    for (int kc = 0; kc < PF_KT / 16; ++kc) {
      uint32_t pa[4];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int nt = 2 * kc + h;
        float e00 = ex2_approx(fmaf(s[nt][0], cs0, nm0)), e01 = ex2_approx(fmaf(s[nt][1], cs0, nm0));
        float e10 = ex2_approx(fmaf(s[nt][2], cs1, nm1)), e11 = ex2_approx(fmaf(s[nt][3], cs1, nm1));
        l0 += e00 + e01;
        l1 += e10 + e11;
        if constexpr (TOKSC) {
          const float2 vs = *reinterpret_cast<const float2*>(par + PF_KT + nt * 8 + 2 * c);
          e00 *= vs.x; e01 *= vs.y; e10 *= vs.x; e11 *= vs.y;
        }
        pa[2 * h] = pack_f2<CTV>(e00, e01);
        pa[2 * h + 1] = pack_f2<CTV>(e10, e11);
      }
#pragma unroll
      for (int j2 = 0; j2 < ON / 2; ++j2) {
        uint32_t bv[4];
        ldsm_x4_t(bv, vbase + 2 * (16 * kc * SM::RS + 16 * j2));
        Mma<CTV>::run(acc[2 * j2], pa[0], pa[1], pa[2], pa[3], bv[0], bv[1]);
        Mma<CTV>::run(acc[2 * j2 + 1], pa[0], pa[1], pa[2], pa[3], bv[2], bv[3]);
      }
      if constexpr (FMT != AUTO) {
        if (kc < UPT) store_unit(nb, kc);
      }
    }
    if constexpr (FMT != AUTO) {
#pragma unroll
      for (int u = PF_KT / 16; u < UPT; ++u) store_unit(nb, u);
      store_params(nb);
    }
  };

  if constexpr (FMT == AUTO) {
    if (ntiles > 0) copy_tile(lo, 0);
    for (int it = 0; it < ntiles; ++it) {
      const int p0 = lo + it * PF_KT;
      cp_async_wait<0>();
      __syncthreads();  // tile `it` landed for every thread; buffer (it+1)&1 is no longer read
      if (it + 1 < ntiles) copy_tile(p0 + PF_KT, (it + 1) & 1);
      compute(it & 1, p0, 0);
    }
  } else {
    if (ntiles > 0) {
      load_raw(lo);
      store_tile(0);
      if (ntiles > 1) load_raw(lo + PF_KT);
    }
    __syncthreads();
    for (int it = 0; it < ntiles; ++it) {
      const int p0 = lo + it * PF_KT;
      // decodes tile it+1 (on the last tile: the raw registers again, into the unused buffer)
      compute(it & 1, p0, (it + 1) & 1);
      if (it + 2 < ntiles) load_raw(p0 + 2 * PF_KT);
      __syncthreads();
    }
  }

  // ---- epilogue: row sums across the 4 lanes of a row, output rows through shared memory
  // (prefill_common.cuh, shared with the wgmma kernel)
  pf_epilogue<FMT, D, T, PF_ROWS, NW, SM::ORS>(acc, l0, l1, reinterpret_cast<float*>(pf_smem), out, r0, r1, c, warp,
                                               lane, nrow, tok0, G, qs, num_q_heads, kvh, v_scale);
}

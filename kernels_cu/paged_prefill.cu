// kvlab — paged attention, prefill kernel (SPEC 2.4). Python op: kvlab/cuda/attention.py
// (family "paged_prefill"; the decode and reduction kernels are in paged_attention.cu).
// Reference: kvlab/reference/attention.py (float64). Building blocks: attention_common.cuh.
#include "common.cuh"
#include "hadamard.cuh"
#include "attention_common.cuh"

using namespace kvlab;
using namespace kvlab::attn;

namespace {
constexpr int NW = 4;     // warps per CTA
}  // namespace
// ====================================================================================
// paged_attention_prefill<FMT, D, T>: one CTA = (64 query rows of one sequence, KV head).
// Rows are (query token, query head) pairs, token-major: row r -> token tok0 + r / G,
// head r % G, so the G heads of a KV head share every K/V tile (GQA). The CTA walks the
// KV positions in tiles of 32 tokens up to its last row's position (tiles above the causal
// diagonal are never loaded) and from its first row's window start. Per tile:
//   1. all 128 threads decode the tile's raw bytes (loaded during the previous tile) into
//      shared memory as mma operands: K in fragment order (the decode kernel's k_operand
//      registers), V transposed as token pairs (v_operand registers) — each byte decoded once;
//   2. each warp (16 rows) computes S = Q·K^T (m16 x n32 x D), the online softmax per row,
//      and O += P'·V (m16 x nD x k32), FA2-style with P kept in registers; warps whose rows
//      all lie before the tile skip the math.
// Shared memory is double-buffered, so one barrier per tile. Output rows go through shared
// memory for the int4 inverse rotation (and 16-byte stores for every format).
// ====================================================================================
namespace {
constexpr int PF_ROWS = 64;   // query rows per CTA (4 warps x 16)
constexpr int PF_KT = 32;     // KV tokens per tile
}

template <int FMT, int D>
struct PrefillSmem {
  static constexpr int KUNITS = D / 8 + 4;            // 16-byte units per token (padded: conflict-free)
  static constexpr int KWORDS = PF_KT * KUNITS * 4;   // K operand words per buffer
  static constexpr int VRS = PF_KT / 2 + 4;           // words per dim row of V^T (padded)
  static constexpr int VWORDS = D * VRS;
  static constexpr int PWORDS = 4 * PF_KT;            // ksc, koff, vsc, vzp
  static constexpr int BUF = KWORDS + VWORDS + PWORDS;
  static constexpr int QWORDS = PF_ROWS * D / 2;      // q operands (prologue) as 16-bit pairs
  static constexpr int OWORDS = PF_ROWS * D;          // float output rows (epilogue)
  static constexpr int TOTAL = (2 * BUF > QWORDS ? (2 * BUF > OWORDS ? 2 * BUF : OWORDS)
                                                 : (QWORDS > OWORDS ? QWORDS : OWORDS));
};

template <int FMT, int D, typename T>
__global__ void __launch_bounds__(NW * 32)
paged_attention_prefill(const T* __restrict__ q, T* __restrict__ out,
                        const uint8_t* __restrict__ cache, const int* __restrict__ block_table,
                        int bt_stride, const int* __restrict__ seq_lens,
                        const int* __restrict__ query_start_loc, const int* __restrict__ items,
                        int num_kv_heads, int num_q_heads, int bs_log2, float scale_log2,
                        float k_scale, float v_scale, int window, int swizzle_v) {
  using TR = Traits<FMT, D, T>;
  using CTQ = typename TR::CT_QK;
  using CTV = typename TR::CT_PV;
  using SM = PrefillSmem<FMT, D>;
  static_assert(D == 64 || D == 128, "prefill kernel: head sizes 64, 128 (256 uses the decode kernel)");
  static_assert(SM::TOTAL * 4 <= 48 * 1024, "static shared memory budget");
  constexpr int E = D / 32;
  constexpr int KC = D / 16;      // k-chunks of Q·K
  constexpr int NT = PF_KT / 8;   // n-tiles of S
  constexpr int ON = D / 8;       // n-tiles of O
  constexpr int KW = TR::KB / 4, VW = TR::VB / 4;
  constexpr int NGK = (FMT == NVFP4) ? D / 64 : 1;
  constexpr int NGV = (FMT == NVFP4) ? (D >= 128 ? D / 128 : 1) : 1;
  constexpr int SW = (FMT == NVFP4) ? D / 64 : 1;

  __shared__ __align__(16) uint32_t smem[SM::TOTAL];
  __shared__ float qsum_sm[PF_ROWS], cs_sm[PF_ROWS];
  __shared__ int qpos_sm[PF_ROWS];

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

  // ---- prologue: 64 query rows -> shared memory (as in the decode kernel)
  uint16_t* q_sm = reinterpret_cast<uint16_t*>(smem);
  for (int r = warp; r < PF_ROWS; r += NW) {
    const int tok = tok0 + r / G;
    const bool valid = (r < tpc * G) && (tok < Lq);
    const int qhead = kvh * G + r % G;
    float x[E];
    if (valid) {
      const T* qr = q + (static_cast<size_t>(qs + tok) * num_q_heads + qhead) * D + lane * E;
#pragma unroll
      for (int j = 0; j < E; ++j) x[j] = to_float(qr[j]);
    } else {
#pragma unroll
      for (int j = 0; j < E; ++j) x[j] = 0.f;
    }
    if constexpr (FMT == INT4) rht_group<E, 32>(x, lane);
    float amax = 0.f;
#pragma unroll
    for (int j = 0; j < E; ++j) amax = fmaxf(amax, fabsf(x[j]));
    amax = warp_max(amax);
    float pre = 1.f;
    if constexpr (FMT != AUTO) {
      const int ex = static_cast<int>((__float_as_uint(amax) >> 23) & 0xFF) - 127;
      pre = ex > 14 ? __uint_as_float(static_cast<uint32_t>(127 - (ex - 14)) << 23) : 1.f;
    }
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < E; ++j) {
      const uint16_t b = bits16<CTQ>(x[j] * pre);
      q_sm[r * D + lane * E + j] = b;
      s += from_bits16<CTQ>(b);
    }
    s = warp_sum(s);
    if (lane == 0) {
      qsum_sm[r] = s;
      cs_sm[r] = scale_log2 / pre;
      qpos_sm[r] = valid ? (L - Lq + tok) : -1;
    }
  }
  __syncthreads();
  const int r0 = warp * 16 + g, r1 = r0 + 8;
  uint32_t qa[KC][4];
#pragma unroll
  for (int kk = 0; kk < KC; ++kk) {
#pragma unroll
    for (int p = 0; p < 2; ++p) {
      const int d0 = qk_dim<FMT, D>(c, kk, p, 0), d1 = qk_dim<FMT, D>(c, kk, p, 1);
      qa[kk][2 * p] = pack2(q_sm[r0 * D + d0], q_sm[r0 * D + d1]);
      qa[kk][2 * p + 1] = pack2(q_sm[r1 * D + d0], q_sm[r1 * D + d1]);
    }
  }
  const float qsum0 = qsum_sm[r0], qsum1 = qsum_sm[r1];
  const float cs0 = cs_sm[r0], cs1 = cs_sm[r1];
  const int qp0 = qpos_sm[r0], qp1 = qpos_sm[r1];
  int pmax = -1, pmin = 0x7fffffff, wmax = -1;
  for (int r = 0; r < PF_ROWS; ++r) {
    const int p = qpos_sm[r];
    if (p >= 0) { pmax = max(pmax, p); pmin = min(pmin, p); }
    if (p >= 0 && (r >> 4) == warp) wmax = max(wmax, p);
  }
  int wmin = 0x7fffffff;
  for (int r = warp * 16; r < warp * 16 + 16; ++r) if (qpos_sm[r] >= 0) wmin = min(wmin, qpos_sm[r]);
  __syncthreads();  // q_sm is reused by the tile buffers below

  const int hi = pmax + 1;
  int lo = 0;
  if (window > 0) lo = max(0, pmin - window + 1);
  lo &= ~(PF_KT - 1);
  const int ntiles = hi > lo ? (hi - lo + PF_KT - 1) / PF_KT : 0;
  const size_t side_stride = static_cast<size_t>(BS) * num_kv_heads * TR::ROW;
  const int* bt = block_table + static_cast<size_t>(seq) * bt_stride;

  // producer roles: K (token kt, part kc4), V (token pair vp, dim group vg)
  const int kt = tid >> 2, kc4 = tid & 3;
  const int vg = tid >> 4, vp = tid & 15;
  uint32_t rk[KW], rva[VW], rvb[VW];
  uint32_t rkp = 0u, rvpa = 0u, rvpb = 0u;     // int4/int8/fp8 parameter words
  uint32_t rks[SW];                            // nvfp4 K scale row
  float rsfa[NGV], rsfb[NGV];                  // nvfp4 V scales (decoded)
  auto row_of = [&](int side, int p) -> size_t {  // (slab base offset, row index) -> byte offset of the row's data
    const int blk = bt[p >> bs_log2];
    const size_t slab = (static_cast<size_t>(blk) * 2 + side) * side_stride;
    const size_t row = static_cast<size_t>(p & (BS - 1)) * num_kv_heads + kvh;
    if constexpr (FMT == NVFP4) return slab + row * (D / 2);
    else return slab + row * TR::ROW;
  };
  auto load_tile = [&](int p0) {
    {  // K
      const int p = p0 + kt;
      const bool in = p < L;
      const size_t off = in ? row_of(0, p) : 0;
      load_words<TR::KB, TR::ALIGN>(cache + off + kc4 * TR::KB, rk, in);
      if constexpr (FMT == INT4 || FMT == INT8 || FMT == FP8) {
        constexpr int OFF = (FMT == INT4) ? D / 2 : D;
        rkp = in ? __ldg(reinterpret_cast<const unsigned*>(cache + off + OFF)) : 0u;
      } else if constexpr (FMT == NVFP4) {
        const int blk = in ? bt[p >> bs_log2] : 0;
        const size_t sb = (static_cast<size_t>(blk) * 2) * side_stride + static_cast<size_t>(BS) * num_kv_heads * (D / 2) +
                          (static_cast<size_t>(p & (BS - 1)) * num_kv_heads + kvh) * (D / 16);
        load_words<D / 16, 4>(cache + sb, rks, in);
      }
    }
    {  // V: tokens 2vp, 2vp+1
      const int pa = p0 + 2 * vp, pb = pa + 1;
      const bool ina = pa < L, inb = pb < L;
      const size_t offa = ina ? row_of(1, pa) : 0, offb = inb ? row_of(1, pb) : 0;
      load_words<TR::VB, TR::ALIGN>(cache + offa + vg * TR::VB, rva, ina);
      load_words<TR::VB, TR::ALIGN>(cache + offb + vg * TR::VB, rvb, inb);
      if constexpr (FMT == INT4 || FMT == INT8 || FMT == FP8) {
        constexpr int OFF = (FMT == INT4) ? D / 2 : D;
        rvpa = ina ? __ldg(reinterpret_cast<const unsigned*>(cache + offa + OFF)) : 0u;
        rvpb = inb ? __ldg(reinterpret_cast<const unsigned*>(cache + offb + OFF)) : 0u;
      } else if constexpr (FMT == NVFP4) {
        constexpr int S = D / 16;
#pragma unroll
        for (int i = 0; i < NGV; ++i) {
          const int grp = (vg * (D / 8)) / 16 + i;
#pragma unroll
          for (int w = 0; w < 2; ++w) {
            const int pp = w ? pb : pa;
            const bool in = w ? inb : ina;
            float f = 0.f;
            if (in) {
              const int blk = bt[pp >> bs_log2];
              int tt = pp & (BS - 1), gg = grp;
              if (swizzle_v) {
                const int qq = S / 4;
                const int t2_ = (tt / 4) * 4 + grp / qq;
                gg = (grp % qq) * 4 + tt % 4;
                tt = t2_;
              }
              const size_t sb = (static_cast<size_t>(blk) * 2 + 1) * side_stride +
                                static_cast<size_t>(BS) * num_kv_heads * (D / 2) +
                                (static_cast<size_t>(tt) * num_kv_heads + kvh) * S + gg;
              f = e4m3_to_float(__ldg(cache + sb)) * 128.f;
            }
            if (w) rsfb[i] = f; else rsfa[i] = f;
          }
        }
      }
    }
  };
  // raw registers -> operand buffer `buf`
  auto store_tile = [&](uint32_t* buf) {
    uint32_t* kb = buf;
    uint32_t* vb = buf + SM::KWORDS;
    float* par = reinterpret_cast<float*>(buf + SM::KWORDS + SM::VWORDS);
    {  // K operands of token kt, part kc4: KC x 2 words, 16-byte units interleaved over kc4
      uint32_t sf[NGK];
      if constexpr (FMT == NVFP4) {
#pragma unroll
        for (int i = 0; i < NGK; ++i) {
          const int gi = kc4 * NGK + i;
          const uint16_t h = bits16<__half>(e4m3_to_float((rks[gi >> 2] >> (8 * (gi & 3))) & 0xFFu) * 128.f);
          sf[i] = pack2(h, h);
        }
      } else {
#pragma unroll
        for (int i = 0; i < NGK; ++i) sf[i] = 0u;
      }
#pragma unroll
      for (int u = 0; u < KC / 2; ++u) {  // unit u holds chunks 2u, 2u+1 (pairs 0, 1)
        uint4 v;
        const int k0 = 2 * u, k1 = 2 * u + 1;
        const int gi0 = (FMT == NVFP4) ? (k0 >> 2) : 0, gi1 = (FMT == NVFP4) ? (k1 >> 2) : 0;
        v.x = k_operand<FMT, D>(rk, k0, 0, sf[gi0]);
        v.y = k_operand<FMT, D>(rk, k0, 1, sf[gi0]);
        v.z = k_operand<FMT, D>(rk, k1, 0, sf[gi1]);
        v.w = k_operand<FMT, D>(rk, k1, 1, sf[gi1]);
        *reinterpret_cast<uint4*>(kb + 4 * (kt * SM::KUNITS + u * 4 + kc4)) = v;
      }
      if (kc4 == 0) {
        float ksc = 1.f, koff = 0.f;
        if constexpr (FMT == INT4) {
          ksc = __uint_as_float(rkp & ~0xFu); koff = 1024.f + static_cast<float>(rkp & 0xFu);
        } else if constexpr (FMT == INT8) {
          ksc = __uint_as_float(rkp); koff = 1152.f;
        } else if constexpr (FMT == FP8) {
          ksc = __uint_as_float(rkp);
        } else if constexpr (FMT == NVFP4) {
          ksc = 128.f * k_scale;
        }
        par[kt] = ksc;
        par[PF_KT + kt] = koff;
      }
    }
    {  // V^T operands: dims vg*D/8 + l, token pair vp
#pragma unroll
      for (int l = 0; l < D / 8; ++l) {
        uint32_t sf2 = 0u;
        if constexpr (FMT == NVFP4) {
          const int i = (D >= 256) ? (l >> 4) : 0;
          sf2 = pack2(bits16<__half>(rsfa[i]), bits16<__half>(rsfb[i]));
        }
        vb[(vg * (D / 8) + l) * SM::VRS + vp] = v_operand<FMT, D>(rva, rvb, l, sf2);
      }
      if (vg == 0) {
        float sa = 1.f, sb = 1.f, za = 0.f, zb = 0.f;
        if constexpr (FMT == INT4) {
          sa = __uint_as_float(rvpa & ~0xFu); za = 128.f + static_cast<float>(rvpa & 0xFu);
          sb = __uint_as_float(rvpb & ~0xFu); zb = 128.f + static_cast<float>(rvpb & 0xFu);
        } else if constexpr (FMT == INT8 || FMT == FP8) {
          sa = __uint_as_float(rvpa); sb = __uint_as_float(rvpb);
          if constexpr (FMT == FP8) { sa *= FP8_V_P; sb *= FP8_V_P; }
        }
        par[2 * PF_KT + 2 * vp] = sa; par[2 * PF_KT + 2 * vp + 1] = sb;
        par[3 * PF_KT + 2 * vp] = za; par[3 * PF_KT + 2 * vp + 1] = zb;
      }
    }
  };

  float acc[ON][4];
#pragma unroll
  for (int j = 0; j < ON; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
  float m0 = NEG_BIG, m1 = NEG_BIG, l0 = 0.f, l1 = 0.f, z0 = 0.f, z1 = 0.f;

  if (ntiles > 0) load_tile(lo);
  for (int it = 0; it < ntiles; ++it) {
    uint32_t* buf = smem + (it & 1) * SM::BUF;
    store_tile(buf);
    __syncthreads();
    const int p0 = lo + it * PF_KT;
    if (it + 1 < ntiles) load_tile(p0 + PF_KT);
    // warps whose rows all precede the tile (causal) or that have no rows skip the math
    if (wmax < p0 || (window > 0 && p0 + PF_KT - 1 <= wmin - window)) continue;
    const uint32_t* kb = buf;
    const uint32_t* vb = buf + SM::KWORDS;
    const float* par = reinterpret_cast<const float*>(buf + SM::KWORDS + SM::VWORDS);
    float s[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
      const int tok = nt * 8 + g;
#pragma unroll
      for (int u = 0; u < KC / 2; ++u) {
        const uint4 v = *reinterpret_cast<const uint4*>(kb + 4 * (tok * SM::KUNITS + u * 4 + c));
        Mma<CTQ>::run(s[nt], qa[2 * u][0], qa[2 * u][1], qa[2 * u][2], qa[2 * u][3], v.x, v.y);
        Mma<CTQ>::run(s[nt], qa[2 * u + 1][0], qa[2 * u + 1][1], qa[2 * u + 1][2], qa[2 * u + 1][3], v.z, v.w);
      }
    }
    // scores (log2 units); s[nt][0..1] = (row r0, tokens nt*8+2c, +1), s[nt][2..3] = row r1
    float mx0 = neg_inf(), mx1 = neg_inf();
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int t = nt * 8 + 2 * c + e;
        const int kp = p0 + t;
        const float ksc = par[t], koff = par[PF_KT + t];
        const bool ok0 = kp < L && kp <= qp0 && (window <= 0 || kp > qp0 - window);
        const bool ok1 = kp < L && kp <= qp1 && (window <= 0 || kp > qp1 - window);
        s[nt][e] = ok0 ? ksc * (s[nt][e] - koff * qsum0) * cs0 : neg_inf();
        s[nt][2 + e] = ok1 ? ksc * (s[nt][2 + e] - koff * qsum1) * cs1 : neg_inf();
        mx0 = fmaxf(mx0, s[nt][e]);
        mx1 = fmaxf(mx1, s[nt][2 + e]);
      }
    }
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
    const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
    const float al0 = exp2f(m0 - mn0), al1 = exp2f(m1 - mn1);
    m0 = mn0; m1 = mn1;
    l0 *= al0; l1 *= al1; z0 *= al0; z1 *= al1;
#pragma unroll
    for (int j = 0; j < ON; ++j) {
      acc[j][0] *= al0; acc[j][1] *= al0; acc[j][2] *= al1; acc[j][3] *= al1;
    }
    // P' (A operand of P·V): k-chunk kc covers S n-tiles 2kc, 2kc+1
#pragma unroll
    for (int kc = 0; kc < PF_KT / 16; ++kc) {
      uint32_t pa[4];
#pragma unroll
      for (int h = 0; h < 2; ++h) {  // h: n-tile 2kc+h -> registers (row r0: pa[2h], row r1: pa[2h+1])
        const int nt = 2 * kc + h;
        uint16_t b[4];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int t = nt * 8 + 2 * c + e;
          const float vsc = par[2 * PF_KT + t];
          const float e0 = exp2f(s[nt][e] - mn0), e1 = exp2f(s[nt][2 + e] - mn1);
          l0 += e0; l1 += e1;
          b[e] = bits16<CTV>(e0 * vsc);
          b[2 + e] = bits16<CTV>(e1 * vsc);
          if constexpr (FMT == INT4) {
            const float vzp = par[3 * PF_KT + t];
            z0 += from_bits16<CTV>(b[e]) * vzp;
            z1 += from_bits16<CTV>(b[2 + e]) * vzp;
          }
        }
        pa[2 * h] = pack2(b[0], b[1]);
        pa[2 * h + 1] = pack2(b[2], b[3]);
      }
#pragma unroll
      for (int j = 0; j < ON; ++j) {
        const uint32_t* vrow = vb + (8 * j + g) * SM::VRS + kc * 8;
        Mma<CTV>::run(acc[j], pa[0], pa[1], pa[2], pa[3], vrow[c], vrow[4 + c]);
      }
    }
  }

  // ---- epilogue: row sums across the 4 lanes of a row, output rows through shared memory
  l0 += __shfl_xor_sync(0xffffffffu, l0, 1); l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 1); l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
  z0 += __shfl_xor_sync(0xffffffffu, z0, 1); z0 += __shfl_xor_sync(0xffffffffu, z0, 2);
  z1 += __shfl_xor_sync(0xffffffffu, z1, 1); z1 += __shfl_xor_sync(0xffffffffu, z1, 2);
  const float vfac = (FMT == NVFP4) ? 128.f * v_scale : (FMT == FP8) ? FP8_V_OUT : 1.f;
  const float inv0 = l0 > 0.f ? vfac / l0 : 0.f, inv1 = l1 > 0.f ? vfac / l1 : 0.f;
  __syncthreads();  // tile buffers -> output rows
  float* o_sm = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int j = 0; j < ON; ++j) {
    const int dim = 8 * j + 2 * c;
    *reinterpret_cast<float2*>(o_sm + r0 * D + dim) = make_float2((acc[j][0] - z0) * inv0, (acc[j][1] - z0) * inv0);
    *reinterpret_cast<float2*>(o_sm + r1 * D + dim) = make_float2((acc[j][2] - z1) * inv1, (acc[j][3] - z1) * inv1);
  }
  __syncthreads();
  for (int r = warp; r < PF_ROWS; r += NW) {
    float x[E];
#pragma unroll
    for (int j = 0; j < E; ++j) x[j] = o_sm[r * D + lane * E + j];
    if constexpr (FMT == INT4) inverse_rht_group<E, 32>(x, lane);
    const int tok = tok0 + r / G;
    if (r < tpc * G && tok < Lq) {
      T* orow = out + (static_cast<size_t>(qs + tok) * num_q_heads + kvh * G + r % G) * D + lane * E;
#pragma unroll
      for (int j = 0; j < E; ++j) orow[j] = from_float<T>(x[j]);
    }
  }
}

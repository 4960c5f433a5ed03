// kvlab — the int4_per_token_head write's RHT on tensor cores, used by kernels_cu/reshape_and_cache.cu
// for 16-bit input at d = 128: "MMA8" (8 rows per warp, section at the end of this file) is the
// default; the 16-rows-per-warp version described first is the -DKVLAB_INT4_WRITE_MMA experiment
// (d = 64 and 128, measured slower). Design, index algebra and measurements:
// docs/notes-int4-write-mma.md. Reference: the RHT of
// kvlab/reference/hadamard.py (y = H · (s ⊙ x), H the unnormalized Sylvester matrix).
//
// The Sylvester matrix is the tensor power of H_2 over the index bits, so H_D = H_NA ⊗ H_16 over
// ANY split of the log2(D) index bits into log2(NA) "group" bits and 4 "k" bits. A warp owns 16
// consecutive (token, head) rows; for each of the NA = D/16 values a of the group bits one
// mma.m16n8k16 (A = the 16 rows' 16 elements of group a, signs applied; B = H_16, entries ±1,
// exact in bf16/fp16; float32 accumulation; two n8 tiles) gives Z_a = X_a · H_16. Lane (g, c)
// (g = lane >> 2, c = lane & 3) then holds, for rows g and g + 8, all NA values of a for its 4
// output columns, so the H_NA stage is log2(NA) in-register add/sub stages — 3 FADD per element
// at d = 128 instead of 5 FADD + 2 shuffle stages (SHFL + FFMA) of wht_chunked.
//
// Which element bit is a group bit and which a k bit is chosen so that loads and stores stay
// wide and need no data movement:
//   load:  lane c loads, per 16-byte chunk L of a row, elements e = 32·L + 8·c + m (m < 8): the
//          4 lanes of a quad read 64 contiguous bytes, and the chunk's 4 raw 32-bit words ARE
//          mma A registers (two bf16/fp16 per word, the lower k in the low half, as the A
//          fragment packs them). Word wd feeds group a = 2L + (wd >> 1) at k = 2c + (e & 1) +
//          8·(wd & 1): k bits = element bits (0, 3, 4, 1), group bits = element bits (2, 5, 6, …).
//   store: output element f = 32·(a' >> 1) + 8·c + 4·(a' & 1) + 2·tile + col for H_NA row a',
//          n8 tile `tile` and accumulator column 2c + col — n bits (0, 1, 2, 3) = f bits (0, 3, 4,
//          1), so B is the plain H_16 (B[k][n] = (-1)^popcount(k & n)). Each lane then holds
//          8 consecutive outputs per (a' >> 1): one 32-bit word of packed nibbles, and the
//          lane's outputs are exactly the chunked layout of Int4QuadGeometry (lane c, chunk ch,
//          element j = output 32·ch + 8·c + j) — the layout encode_store_int4 and the rare-path
//          wht_chunked<D/4, 4, 8> use, so the tail after the rotation is the existing code.
//
// The functions marked [layout] are the whole index algebra. tests/test_int4_write_mma_layout.py
// reads their `return` expressions from this file, evaluates them as Python (so keep each one a
// single `return <expr>;` of +, *, >>, &, ^ on non-negative ints) and checks, with the m16n8k16
// fragment layout modelled as PTX defines it, that the whole tile reproduces the reference RHT and
// the reference cache bytes.
#pragma once
#include "common.cuh"
#include "hadamard.cuh"

namespace kvlab {

// [layout] element of the row in element m (0..7) of lane c's 16-byte chunk L
__host__ __device__ constexpr int mma_in_elem(int L, int c, int m) { return 32 * L + 8 * c + m; }
// [layout] group a (H_NA index) fed by raw word wd (0..3) of chunk L
__host__ __device__ constexpr int mma_group(int L, int wd) { return 2 * L + (wd >> 1); }
// [layout] A register (a0..a3) that word wd of row half r (0: row g, 1: row g + 8) is: even words
// hold k = 2c, 2c+1 (a0 / a1), odd words k = 2c+8, 2c+9 (a2 / a3)
__host__ __device__ constexpr int mma_a_reg(int wd, int r) { return 2 * (wd & 1) + r; }
// [layout] B[k][n] is negative (H_16 Sylvester: parity of k & n)
__host__ __device__ constexpr int mma_b_neg(int k, int n) {
  return ((k & n) ^ ((k & n) >> 1) ^ ((k & n) >> 2) ^ ((k & n) >> 3)) & 1;
}
// [layout] slot of the lane's chunked output array for H_NA output a', n8 tile, accumulator
// column parity col (the accumulator's row half, g or g + 8, selects the row's array)
__host__ __device__ constexpr int mma_out_slot(int aout, int tile, int col) {
  return 8 * (aout >> 1) + 4 * (aout & 1) + 2 * tile + col;
}
// [layout] output element of slot s of lane c (the chunked layout: chunk s >> 3, element s & 7)
__host__ __device__ constexpr int mma_out_elem(int s, int c) { return 32 * (s >> 3) + 8 * c + (s & 7); }

// The raw 16-bit pattern of ±1 in T (bf16 0x3F80, fp16 0x3C00); sign bit 0x8000.
template <typename T> struct MmaOne;
template <> struct MmaOne<__nv_bfloat16> { static constexpr uint32_t BITS = 0x3F80u; };
template <> struct MmaOne<__half> { static constexpr uint32_t BITS = 0x3C00u; };

// This lane's B fragments of H_16, b[tile][khalf]: the two k of the register (2c + 8·khalf and
// + 1, low half first) at column n = g + 8·tile. Once per thread.
template <typename T>
__device__ __forceinline__ void mma_h16_fragments(int lane, uint32_t (&b)[2][2]) {
  const int g = lane >> 2, c = lane & 3;
#pragma unroll
  for (int tile = 0; tile < 2; ++tile) {
#pragma unroll
    for (int kh = 0; kh < 2; ++kh) {
      const int n = g + 8 * tile, k = 2 * c + 8 * kh;
      b[tile][kh] = (MmaOne<T>::BITS | (MmaOne<T>::BITS << 16)) |
                    (static_cast<uint32_t>(mma_b_neg(k, n)) << 15) |
                    (static_cast<uint32_t>(mma_b_neg(k + 1, n)) << 31);
    }
  }
}

// The same fragments for every lane as a table (lane l: b[0][0], b[0][1], b[1][0], b[1][1]): one
// 16-byte load instead of ~40 integer instructions (rht_mma8_row, once per side).
struct __align__(16) MmaH16Table { uint32_t w[32][4]; };
template <typename T> __host__ __device__ constexpr MmaH16Table make_mma_h16_table() {
  MmaH16Table t{};
  for (int lane = 0; lane < 32; ++lane)
    for (int tile = 0; tile < 2; ++tile)
      for (int kh = 0; kh < 2; ++kh) {
        const int n = (lane >> 2) + 8 * tile, k = 2 * (lane & 3) + 8 * kh;
        t.w[lane][2 * tile + kh] = (MmaOne<T>::BITS | (MmaOne<T>::BITS << 16)) |
                                   (static_cast<uint32_t>(mma_b_neg(k, n)) << 15) |
                                   (static_cast<uint32_t>(mma_b_neg(k + 1, n)) << 31);
      }
  return t;
}
__device__ const MmaH16Table kMmaH16Bf16 = make_mma_h16_table<__nv_bfloat16>();
__device__ const MmaH16Table kMmaH16F16 = make_mma_h16_table<__half>();
template <typename T>
__device__ __forceinline__ void mma_h16_fragments_table(int lane, uint32_t (&b)[2][2]) {
  const MmaH16Table& t = MmaOne<T>::BITS == 0x3F80u ? kMmaH16Bf16 : kMmaH16F16;
  // volatile (an L1 hit per call): a plain __ldg is hoisted and keeps 4 registers live all along
  asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(b[0][0]), "=r"(b[0][1]), "=r"(b[1][0]), "=r"(b[1][1])
               : "l"(t.w[lane]));
}

// d = A · B (+ 0), m16n8k16, A row-major 16-bit, B column-major 16-bit, float32 accumulators.
// Products of a 16-bit value and ±1 are exact; the float32 accumulation of 16 of them is within
// ~1 float32 ulp of the IEEE sum — the same class of difference as the butterflies' float32
// rounding (both are then rounded to T; reshape_and_cache.cu's header, SPEC 2.1).
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                          uint32_t b0, uint32_t b1) {
  const float z = 0.0f;
  if constexpr (MmaOne<T>::BITS == 0x3F80u) {  // bf16
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%10, %10, %10, %10};"
                 : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "f"(z));
  } else {  // fp16
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%10, %10, %10, %10};"
                 : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "f"(z));
  }
}

// RHT of the warp's 16 rows, float32, unnormalized: y = H_D · (s ⊙ x).
// raw[r][L]: lane c's 16-byte chunk L of row g + 8·r (elements mma_in_elem(L, c, ·)), signs not
// yet applied (zeros for rows that do not exist). b: mma_h16_fragments. Out: y[r][s] = output
// element mma_out_elem(s, c) of row g + 8·r (the chunked layout of Int4QuadGeometry).
// Every lane of the warp must call it (mma.sync.aligned).
template <int D, typename T>
__device__ __forceinline__ void rht_mma_rows(const uint4 (&raw)[2][D / 32], const uint32_t (&b)[2][2], int c,
                                             float (&y)[2][D / 4]) {
  static_assert(sizeof(T) == 2 && (D == 32 || D == 64 || D == 128 || D == 256), "16-bit input, d = 32..256");
  constexpr int NC = D / 32;  // 16-byte chunks per lane and row
  constexpr int NA = D / 16;  // groups: H_NA ⊗ H_16
  uint32_t A[NA][4];          // A[a][i]: the fragment registers a0..a3 of group a
#pragma unroll
  for (int L = 0; L < NC; ++L) {
    // s ⊙ x: the sign bits XORed into the raw words (exact; kRhtSignMask16, hadamard.cuh). The
    // mask is loaded per call (an L1 hit): as a plain __ldg the compiler keeps the K side's
    // masks alive through the whole kernel for the V side, 4·NC registers it does not have.
    const uint32_t* mp = kRhtSignMask16.w + mma_in_elem(L, c, 0) / 2;
    uint32_t m[4];
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(m[0]), "=r"(m[1]), "=r"(m[2]), "=r"(m[3])
                 : "l"(mp));
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const uint32_t w[4] = {raw[r][L].x ^ m[0], raw[r][L].y ^ m[1], raw[r][L].z ^ m[2], raw[r][L].w ^ m[3]};
#pragma unroll
      for (int wd = 0; wd < 4; ++wd) A[mma_group(L, wd)][mma_a_reg(wd, r)] = w[wd];
    }
  }
  float z[NA][2][4];  // z[a][tile][i]: accumulator d_i of tile `tile` for group a
#pragma unroll
  for (int a = 0; a < NA; ++a) {
#pragma unroll
    for (int tile = 0; tile < 2; ++tile)
      mma_16816<T>(z[a][tile], A[a][0], A[a][1], A[a][2], A[a][3], b[tile][0], b[tile][1]);
  }
  // H_NA over the group index, in registers: butterflies of stride 1, 2, 4 … over a
#pragma unroll
  for (int h = 1; h < NA; h <<= 1) {
#pragma unroll
    for (int a = 0; a < NA; ++a) {
      if ((a & h) == 0) {
#pragma unroll
        for (int tile = 0; tile < 2; ++tile) {
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const float u = z[a][tile][i], v = z[a + h][tile][i];
            z[a][tile][i] = u + v;
            z[a + h][tile][i] = u - v;
          }
        }
      }
    }
  }
  // accumulator d_i: row g + 8·(i >> 1), column 2c + (i & 1) of its tile
#pragma unroll
  for (int a = 0; a < NA; ++a) {
#pragma unroll
    for (int tile = 0; tile < 2; ++tile) {
#pragma unroll
      for (int i = 0; i < 4; ++i) y[i >> 1][mma_out_slot(a, tile, i & 1)] = z[a][tile][i];
    }
  }
}

// ---------------------------------------------------------------- 8 rows per warp (d = 128)
// MMA8 (the default): the same H_8 ⊗ H_16 split, the same lane loads and the same output
// layout as above, but a warp owns 8 rows (lane (g, c): row g only — the base kernel's geometry,
// Int4Geometry<128, T>: 4 lanes per row, lane c holds chunks L of 8 elements at 32·L + 8·c). The
// 16 fragment rows of the mma hold two groups of the SAME row: fragment row g is group a, row
// g + 8 is group a + 4. So 4 mma per n8 tile cover the lane's 8 groups, every accumulator is an
// output (d0/d1: group a, d2/d3: group a + 4), and one side needs 8 mma, 32 accumulators and the
// 16 raw words of one row — K and V one after the other fit the base kernel's 80 registers.
// [layout] mma (0..3) whose A fragment carries group a (d = 128: a = 0..7)
__host__ __device__ constexpr int mma8_pair(int a) { return a & 3; }
// [layout] fragment row half of group a (0: rows 0-7 = row g of the warp, 1: rows 8-15 = row g too)
__host__ __device__ constexpr int mma8_half(int a) { return a >> 2; }
// [layout] group held by accumulator d_i of mma p (d_i's fragment row half is i >> 1)
__host__ __device__ constexpr int mma8_out_group(int p, int i) { return p + 4 * (i >> 1); }

// RHT of one row per lane quad (d = 128, 16-bit T), float32, unnormalized: y = H_128 · (s ⊙ x).
// raw[L]: lane c's 16-byte chunk L of its row (elements mma_in_elem(L, c, ·)), signs not yet
// applied. b: mma_h16_fragments. The outputs are handed over one n8 tile at a time (the H_8
// stage works within a tile): sink(tile, z) with z[a][col] = output element
// mma_out_elem(mma_out_slot(a, tile, col), c) — the chunked layout of Int4Geometry<128, T> (chunk
// s >> 3, element s & 7). So a caller that rounds and packs in the sink holds 16 floats of a tile
// instead of the row's 32. All 32 lanes must call it (mma.sync).
// Per lane: 4 mask loads (L1 hits), 16 XOR, 8 mma, 96 FADD (H_8).
template <typename T, typename Sink>
__device__ __forceinline__ void rht_mma8_row(const uint4 (&raw)[4], const uint32_t (&b)[2][2], int c, Sink&& sink) {
  static_assert(sizeof(T) == 2, "16-bit input");
  uint32_t A[4][4];  // A[p][i]: fragment register a_i of mma p
#pragma unroll
  for (int L = 0; L < 4; ++L) {
    // s ⊙ x on the raw words (exact); the mask per side, as rht_mma_rows does
    const uint32_t* mp = kRhtSignMask16.w + mma_in_elem(L, c, 0) / 2;
    uint32_t m[4];
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(m[0]), "=r"(m[1]), "=r"(m[2]), "=r"(m[3])
                 : "l"(mp));
    const uint32_t w[4] = {raw[L].x ^ m[0], raw[L].y ^ m[1], raw[L].z ^ m[2], raw[L].w ^ m[3]};
#pragma unroll
    for (int wd = 0; wd < 4; ++wd) {
      const int a = mma_group(L, wd);
      A[mma8_pair(a)][mma_a_reg(wd, mma8_half(a))] = w[wd];
    }
  }
#pragma unroll
  for (int tile = 0; tile < 2; ++tile) {
    float z[8][2];  // z[a][col]: group a, accumulator column parity
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      float d[4];
      mma_16816<T>(d, A[p][0], A[p][1], A[p][2], A[p][3], b[tile][0], b[tile][1]);
#pragma unroll
      for (int i = 0; i < 4; ++i) z[mma8_out_group(p, i)][i & 1] = d[i];
    }
    // H_8 over the group index, in registers. (Its stride-1 stage through the mma accumulator —
    // X_{a+1}·H16 + Z_a and (−X_{a+1})·H16 + Z_a — was tried: 0.3 instructions/element less, but
    // a spill at 80 registers; docs/notes-int4-write-mma.md.)
#pragma unroll
    for (int h = 1; h < 8; h <<= 1) {
#pragma unroll
      for (int a = 0; a < 8; ++a) {
        if ((a & h) == 0) {
#pragma unroll
          for (int col = 0; col < 2; ++col) {
            const float u = z[a][col], v = z[a + h][col];
            z[a][col] = u + v;
            z[a + h][col] = u - v;
          }
        }
      }
    }
    sink(tile, z);
  }
}

}  // namespace kvlab

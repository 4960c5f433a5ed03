// kvlab — Hopper warpgroup MMA (wgmma, sm_90a) as PTX wrappers: shared-memory matrix
// descriptors for the no-swizzle canonical layout, fences, commit/wait, and the three
// instruction shapes the wgmma prefill kernel (kernels_cu/paged_prefill_wgmma.cu) issues.
//
// Canonical no-swizzle layout (PTX ISA, "Shared Memory Matrix Layout", swizzle mode 0): a
// matrix is made of 8 x 16-byte core matrices (8 rows of 8 16-bit elements, the 16 bytes of a
// row contiguous, rows 16 bytes apart: 128 contiguous bytes). Element (mn, k) of an operand:
//   K-major  (imm-trans = 0; 16 bytes = 8 consecutive k):
//       start + (mn / 8)·SBO + (k / 8)·LBO + (mn % 8)·16 + (k % 8)·2
//   MN-major (imm-trans = 1; 16 bytes = 8 consecutive mn):
//       start + (mn / 8)·SBO + (k / 8)·LBO + (k % 8)·16 + (mn % 8)·2
// i.e. LBO (leading-dimension byte offset) always steps between core matrices adjacent in K,
// SBO (stride-dimension byte offset) between core matrices adjacent in M or N.
// tests/test_prefill_wgmma_layout.py models these formulas in NumPy against the kernel's
// shared-memory addressing (wg_core_off below) and the descriptors the kernel builds.
//
// Register fragments (m64nNk16, per warp w of the warpgroup, g = lane / 4, c = lane % 4) are
// those of mma.sync m16n8k16 stacked over the 4 warps: accumulator d[j][0..1] = (row 16w + g,
// cols 8j + 2c, +1), d[j][2..3] = row 16w + g + 8; A in registers a[0] = (row g, k 2c..2c+1),
// a[1] = (row g + 8, k 2c..), a[2] = (row g, k 2c+8..), a[3] = (row g + 8, k 2c+8..). So an
// S = Q·K^T accumulator converts to the P operand of O = P·V exactly as in the mma.sync kernel.
#pragma once
#include "common.cuh"

namespace kvlab {
namespace wg {

// Byte offset of element (row, col) of a [rows][cols] 16-bit tile stored as core matrices:
// rows in groups of 8 (one group = cols·16 bytes), 8-column core matrices 128 bytes apart
// inside a group. As a K-major operand (cols = K): LBO = 128, SBO = 16·cols; as an MN-major
// operand (rows = K, cols = N): LBO = 16·cols, SBO = 128.
template <int COLS>
__host__ __device__ constexpr int core_off(int row, int col) {
  return (row >> 3) * (16 * COLS) + (col >> 3) * 128 + (row & 7) * 16 + (col & 7) * 2;
}

// Shared-memory matrix descriptor, no swizzle: bits 0-13 start address >> 4, 16-29 LBO >> 4,
// 32-45 SBO >> 4, base offset (49-51) 0, swizzle mode (62-63) 0.
__host__ __device__ constexpr uint64_t desc_noswizzle(uint32_t smem_addr, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((smem_addr & 0x3FFFFu) >> 4) |
         (static_cast<uint64_t>((lbo >> 4) & 0x3FFFu) << 16) |
         (static_cast<uint64_t>((sbo >> 4) & 0x3FFFu) << 32);
}

// Before the first wgmma of a group, and whenever registers it reads or accumulates into were
// written by other instructions since the last one.
__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
// Generic-proxy shared-memory writes (st.shared, cp.async) become visible to the async proxy
// (wgmma operand reads) once each writer has executed this and a barrier orders the readers.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Keep the compiler from moving accesses of accumulator registers across wgmma issue / wait.
template <int N>
__device__ __forceinline__ void reg_fence(float (&d)[N][4]) {
#pragma unroll
  for (int j = 0; j < N; ++j) asm volatile("" : "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])::"memory");
}

// D[64 x N] (+)= A·B, f32 accumulate. MmaSS: A and B from shared memory (descriptors, both
// K-major). MmaRS: A from registers (see the fragment layout above), B from shared memory
// MN-major (imm-trans-b = 1: the V tile stored [token][dim]). scale_d = 0: D = A·B.
template <int N, typename CT> struct MmaSS;
template <int N, typename CT> struct MmaRS;

// The asm text differs between f16 and bf16 only in the type: one macro per shape, the type
// spliced in as a string literal (the PTX is the same text as writing each out).
#define KVLAB_WG_ACC8(d) \
  "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), \
  "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), \
  "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), \
  "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
#define KVLAB_WG_ACC16(d) KVLAB_WG_ACC8(d), \
  "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), \
  "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), \
  "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), \
  "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
#define KVLAB_WG_REGS32 \
  "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15," \
  "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31"
#define KVLAB_WG_REGS64 KVLAB_WG_REGS32 "," \
  "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47," \
  "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63"
// m64n64k16, A and B from shared memory (both K-major)
#define KVLAB_WG_SS64(TY)                                                                     \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                   \
               "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " "                   \
               "{" KVLAB_WG_REGS32 "}, %32, %33, p, 1, 1, 0, 0;\n}\n"                        \
               : KVLAB_WG_ACC8(d) : "l"(da), "l"(db), "r"(scale_d))
// m64n{64,128}k16, A from registers, B from shared memory MN-major (imm-trans-b = 1)
#define KVLAB_WG_RS64(TY)                                                                     \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                   \
               "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " "                   \
               "{" KVLAB_WG_REGS32 "}, {%32,%33,%34,%35}, %36, p, 1, 1, 1;\n}\n"              \
               : KVLAB_WG_ACC8(d) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d))
#define KVLAB_WG_RS128(TY)                                                                    \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                                   \
               "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " "                  \
               "{" KVLAB_WG_REGS64 "}, {%64,%65,%66,%67}, %68, p, 1, 1, 1;\n}\n"             \
               : KVLAB_WG_ACC16(d) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d))

template <> struct MmaSS<64, __half> {
  static __device__ __forceinline__ void run(float (&d)[8][4], uint64_t da, uint64_t db, int scale_d) {
    KVLAB_WG_SS64("f16");
  }
};
template <> struct MmaSS<64, __nv_bfloat16> {
  static __device__ __forceinline__ void run(float (&d)[8][4], uint64_t da, uint64_t db, int scale_d) {
    KVLAB_WG_SS64("bf16");
  }
};
template <> struct MmaRS<64, __half> {
  static __device__ __forceinline__ void run(float (&d)[8][4], const uint32_t (&a)[4], uint64_t db, int scale_d) {
    KVLAB_WG_RS64("f16");
  }
};
template <> struct MmaRS<64, __nv_bfloat16> {
  static __device__ __forceinline__ void run(float (&d)[8][4], const uint32_t (&a)[4], uint64_t db, int scale_d) {
    KVLAB_WG_RS64("bf16");
  }
};
template <> struct MmaRS<128, __half> {
  static __device__ __forceinline__ void run(float (&d)[16][4], const uint32_t (&a)[4], uint64_t db, int scale_d) {
    KVLAB_WG_RS128("f16");
  }
};
template <> struct MmaRS<128, __nv_bfloat16> {
  static __device__ __forceinline__ void run(float (&d)[16][4], const uint32_t (&a)[4], uint64_t db, int scale_d) {
    KVLAB_WG_RS128("bf16");
  }
};

}  // namespace wg
}  // namespace kvlab

// kvlab — ring probe: how fast can a CTA stream bytes from global memory, and by which means?
// A measurement tool, not a kernel of the data path (Python: kvlab/cuda/ring_probe.py, sweep:
// scripts/ring_probe.py, notes: docs/perf-notes.md "Session 10").
//
// The paged decode (paged_attention.cu, paged_attention_decode_paged) streams its cache through
// a ring of shared-memory stages filled by Hopper bulk copies; its data-only build
// (-DKVLAB_DECODE_PROBE=1) moves only ~0.75 of the copy bandwidth. This kernel repeats that ring
// with nothing else in it, so that the ring's parameters can be varied one at a time:
//
//   every CTA reads `chunks_per_cta` chunks of `chunk_bytes` bytes at the byte offsets
//   chunk_off[blockIdx.x * chunks_per_cta + i] (the host picks contiguous or shuffled offsets);
//   a stage holds `per_stage` chunks; the ring has `nbuf` stages.
//
//   MODE 0  bulk copies (cp.async.bulk, mbarrier complete_tx) issued by thread 0, each chunk in
//           `split` pieces — the decode kernel's producer;
//   MODE 1  the same copies issued by the lanes of warp 0 (piece k by lane k % 32);
//   MODE 2  no shared memory: every thread reads 16-byte vectors of a stage's chunks with
//           ordinary loads, 8 in flight per thread (the per-head decode kernels read this way);
//   ring_stream_tensor (mode "tensor" in Python): the ring of MODE 0 with one 2-D tensor copy
//           (cp.async.bulk.tensor, a CUtensorMap) per chunk — a box of rows strided in global
//           memory, e.g. 2 of the 8 KV heads of 16 tokens (docs/perf-notes.md "Session 22").
//
// Every thread waits for each stage and, with `touch`, reads one 16-byte word of it, so a stage
// is consumed as the decode kernel consumes it (minus the math). `evict_first` adds an L2
// eviction-priority hint to the bulk copies. Each thread XORs the 32-bit words it loaded and
// stores the result in sink[blockIdx.x · blockDim.x + threadIdx.x] (grid · 256 words, ~0.1 % of
// the bytes read): no load can be dropped, and tests/gpu/test_ring_probe_gpu.py checks the
// words against NumPy, so the probe reads the bytes it claims to read.
#include "common.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#include "bulk_copy.cuh"

namespace {
constexpr int RP_MAXBUF = 8;

__device__ __forceinline__ void bulk_copy_g2s_hint(void* dst, const void* src, uint32_t bytes,
                                                   uint64_t* bar, uint64_t policy) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint "
      "[%0], [%1], %2, [%3], %4;" ::"r"(kvlab::smem_u32(dst)),
      "l"(src), "r"(bytes), "r"(kvlab::smem_u32(bar)), "l"(policy)
      : "memory");
}

__device__ __forceinline__ uint64_t evict_first_policy() {
  uint64_t p;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
  return p;
}
}  // namespace
#endif

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
namespace {
// The ring of the copying modes: stages of `per_stage` chunks, `nbuf` of them; the producer (thread
// 0, or the lanes of warp 0 with WARP_ISSUES) arms full[b] with the stage's bytes and calls
// copy(chunk, piece, dst, bar) for each of its chunks' `split` pieces (dst: the piece's place in
// the stage; chunk: index into the CTA's chunk list); every thread waits for each stage, reads one
// 16-byte word of it with `touch`, and releases it. Returns the XOR of the words read.
template <bool WARP_ISSUES, class Copy>
__device__ __forceinline__ uint32_t ring_loop(uint8_t* dsm, uint64_t* full_bar, uint64_t* empty_bar,
                                              int chunks_per_cta, int chunk_bytes, int per_stage, int nbuf,
                                              int split, int touch, Copy copy) {
  constexpr bool warp_issues = WARP_ISSUES;
  using namespace kvlab;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int nst = (chunks_per_cta + per_stage - 1) / per_stage;
  const int stage_bytes = per_stage * chunk_bytes;
  const int piece = chunk_bytes / split;
  uint32_t acc = 0u;
  if (tid == 0) {
    for (int b = 0; b < nbuf; ++b) {
      mbar_init(&full_bar[b], 1);
      mbar_init(&empty_bar[b], blockDim.x);
    }
    mbar_init_fence();
  }
  __syncthreads();
  auto issue = [&](int st, int b) {
    const int nc = min(per_stage, chunks_per_cta - st * per_stage);
    const int npieces = nc * split;
    uint8_t* dst = dsm + static_cast<size_t>(b) * stage_bytes;
    if (!warp_issues || lane == 0) mbar_arrive_expect_tx(&full_bar[b], static_cast<uint32_t>(nc * chunk_bytes));
    if (warp_issues) __syncwarp();
    for (int k = (warp_issues ? lane : 0); k < npieces; k += (warp_issues ? 32 : 1)) {
      const int ch = k / split, pc = k % split;
      copy(st * per_stage + ch, pc, dst + ch * chunk_bytes + pc * piece, &full_bar[b]);
    }
  };
  const bool producer = warp_issues ? warp == 0 : tid == 0;
  if (producer)
    for (int st = 0; st < min(nbuf, nst); ++st) issue(st, st);
  int b = 0;
  uint32_t ph = 0u;
  for (int st = 0; st < nst; ++st) {
    mbar_wait(&full_bar[b], ph);
    if (touch) {
      const int nc = min(per_stage, chunks_per_cta - st * per_stage);
      const int off = tid * 16;
      if (off < nc * chunk_bytes) {
        const uint4 w = *reinterpret_cast<const uint4*>(dsm + static_cast<size_t>(b) * stage_bytes + off);
        acc ^= w.x ^ w.y ^ w.z ^ w.w;
      }
    }
    mbar_arrive(&empty_bar[b]);
    if (producer && st + nbuf < nst) {
      mbar_wait(&empty_bar[b], ph);
      issue(st + nbuf, b);
    }
    if (++b == nbuf) { b = 0; ph ^= 1u; }
  }
  return acc;
}

// One box of a 2-D tensor map (coordinates c0: elements along the row, c1: rows) to shared
// memory (128-byte aligned), completing its bytes on `bar`.
__device__ __forceinline__ void tensor_copy_2d(void* dst, const void* tmap, int c0, int c1, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
      "[%0], [%1, {%2, %3}], [%4];" ::"r"(kvlab::smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(tmap)), "r"(c0), "r"(c1), "r"(kvlab::smem_u32(bar))
      : "memory");
}
}  // namespace
#endif

template <int MODE>
__global__ void __launch_bounds__(256)
ring_stream(const uint8_t* __restrict__ src, const long long* __restrict__ chunk_off,
            int chunks_per_cta, int chunk_bytes, int per_stage, int nbuf, int split, int touch,
            int evict_first, unsigned* __restrict__ sink) {
  const int tid = threadIdx.x;
  const long long* offs = chunk_off + static_cast<long long>(blockIdx.x) * chunks_per_cta;
  uint32_t acc = 0u;
  if constexpr (MODE == 2) {
    // ordinary 16-byte loads over the stage's chunks, UNROLL in flight per thread
    constexpr int UNROLL = 8;
    const int vec = chunk_bytes >> 4;
    for (int i0 = 0; i0 < chunks_per_cta; i0 += per_stage) {
      const int nv = min(per_stage, chunks_per_cta - i0) * vec;
      for (int v0 = tid; v0 < nv; v0 += UNROLL * blockDim.x) {
        uint4 w[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
          const int v = v0 + u * blockDim.x;
          w[u] = v < nv ? __ldg(reinterpret_cast<const uint4*>(src + offs[i0 + v / vec]) + v % vec)
                        : make_uint4(0u, 0u, 0u, 0u);
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) acc ^= w[u].x ^ w[u].y ^ w[u].z ^ w[u].w;
      }
    }
  } else {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    extern __shared__ __align__(128) uint8_t dsm[];
    __shared__ __align__(8) uint64_t full_bar[RP_MAXBUF], empty_bar[RP_MAXBUF];
    const uint32_t piece = static_cast<uint32_t>(chunk_bytes / split);
    const uint64_t policy = evict_first ? evict_first_policy() : 0ull;
    acc = ring_loop<MODE == 1>(dsm, full_bar, empty_bar, chunks_per_cta, chunk_bytes, per_stage, nbuf, split,
                               touch, [&](int ch, int pc, uint8_t* d, uint64_t* bar) {
                      const uint8_t* s = src + offs[ch] + static_cast<size_t>(pc) * piece;
                      if (evict_first)
                        bulk_copy_g2s_hint(d, s, piece, bar, policy);
                      else
                        kvlab::bulk_copy_g2s(d, s, piece, bar);
                    });
#endif
  }
  sink[static_cast<size_t>(blockIdx.x) * blockDim.x + tid] = acc;   // checked by the GPU test
}

// A CUtensorMap as a kernel parameter (cuda.h's CUtensorMap: 128 bytes, 64-byte aligned), passed
// by value into the grid-constant parameter space, whose generic address the tensor copies take.
struct __align__(64) TensorMapParam {
  unsigned long long opaque[16];
};

// MODE 3 of the probe: the same ring, each chunk one box of the 2-D tensor map `tmap` (Hopper
// tensor copies, cp.async.bulk.tensor): chunk_off[i] holds the box's row (bits 20 and up) and
// its first element along the row (bits 0 … 19); chunk_bytes is the box's size. A box of rows
// strided in global memory arrives as one dense run in shared memory — the way a CTA could stage
// a subset of each token's KV heads (docs/perf-notes.md "Session 22").
__global__ void __launch_bounds__(256)
ring_stream_tensor(const long long* __restrict__ chunk_off, int chunks_per_cta, int chunk_bytes,
                   int per_stage, int nbuf, int touch, unsigned* __restrict__ sink,
                   const __grid_constant__ TensorMapParam tmap_arg) {
  uint32_t acc = 0u;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(1024) uint8_t dsm[];
  __shared__ __align__(8) uint64_t full_bar[RP_MAXBUF], empty_bar[RP_MAXBUF];
  const long long* offs = chunk_off + static_cast<long long>(blockIdx.x) * chunks_per_cta;
  const void* tmap = &tmap_arg;
  if (threadIdx.x == 0) asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(tmap)) : "memory");
  acc = ring_loop<false>(dsm, full_bar, empty_bar, chunks_per_cta, chunk_bytes, per_stage, nbuf, 1, touch,
                         [&](int ch, int, uint8_t* d, uint64_t* bar) {
                    const long long c = offs[ch];
                    tensor_copy_2d(d, tmap, static_cast<int>(c & 0xFFFFF), static_cast<int>(c >> 20), bar);
                  });
#endif
  sink[static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x] = acc;
}

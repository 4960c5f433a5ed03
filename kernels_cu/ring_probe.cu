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
//           ordinary loads, 8 in flight per thread (the per-head decode kernels read this way).
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
    using namespace kvlab;
    extern __shared__ __align__(16) uint8_t dsm[];
    __shared__ __align__(8) uint64_t full_bar[RP_MAXBUF], empty_bar[RP_MAXBUF];
    const int lane = tid & 31, warp = tid >> 5;
    const int nst = (chunks_per_cta + per_stage - 1) / per_stage;
    const int stage_bytes = per_stage * chunk_bytes;
    const uint32_t piece = static_cast<uint32_t>(chunk_bytes / split);
    const uint64_t policy = evict_first ? evict_first_policy() : 0ull;
    if (tid == 0) {
      for (int b = 0; b < nbuf; ++b) {
        mbar_init(&full_bar[b], 1);
        mbar_init(&empty_bar[b], blockDim.x);
      }
      mbar_init_fence();
    }
    __syncthreads();
    // producer: arm full[b] with the stage's bytes, then copy its chunks' pieces
    auto issue = [&](int st, int b) {
      const int nc = min(per_stage, chunks_per_cta - st * per_stage);
      const int npieces = nc * split;
      uint8_t* dst = dsm + static_cast<size_t>(b) * stage_bytes;
      if (MODE == 0 || lane == 0) mbar_arrive_expect_tx(&full_bar[b], static_cast<uint32_t>(nc * chunk_bytes));
      if (MODE == 1) __syncwarp();
      for (int k = (MODE == 1 ? lane : 0); k < npieces; k += (MODE == 1 ? 32 : 1)) {
        const int ch = k / split, pc = k % split;
        const uint8_t* s = src + offs[st * per_stage + ch] + static_cast<size_t>(pc) * piece;
        uint8_t* d = dst + ch * chunk_bytes + pc * piece;
        if (evict_first)
          bulk_copy_g2s_hint(d, s, piece, &full_bar[b], policy);
        else
          bulk_copy_g2s(d, s, piece, &full_bar[b]);
      }
    };
    const bool producer = MODE == 0 ? tid == 0 : warp == 0;
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
#endif
  }
  sink[static_cast<size_t>(blockIdx.x) * blockDim.x + tid] = acc;   // checked by the GPU test
}

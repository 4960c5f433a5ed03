// kvlab — Hopper bulk copies (TMA, cp.async.bulk) global -> shared memory, completed on an
// mbarrier, and the mbarrier operations of a producer/consumer ring. sm_90+ only: callers
// guard their use with KVLAB_HAS_BULK_COPY (the functions are not defined below sm_90).
//
// Protocol used by paged_attention_decode_paged (PTX ISA "mbarrier", "cp.async.bulk"):
//   full[b]  (count 1): the producer thread arms it with the stage's byte count
//                       (arrive.expect_tx) and issues the copies; the copies complete the
//                       transaction; consumers wait on its phase parity.
//   empty[b] (count = consumer threads): each consumer arrives when it has read stage b; the
//                       producer waits on it before refilling buffer b.
// Bulk copies need 16-byte aligned source and destination and a size that is a multiple of 16.
#pragma once
#include "common.cuh"  // fixed-width integer types as the other kernels have them

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define KVLAB_HAS_BULK_COPY 1

namespace kvlab {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}

// Makes initialized mbarriers visible to the async proxy (the bulk copies); then __syncthreads.
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// Orders this thread's earlier generic-proxy accesses of shared memory before later
// async-proxy (bulk copy) writes to it: shared memory reused as a copy destination.
__device__ __forceinline__ void fence_proxy_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}

// Block until the phase of `bar` with this parity has completed (acquire).
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  const uint32_t a = smem_u32(bar);
  uint32_t done;
  do {
    asm volatile(
        "{\n\t.reg .pred p;\n\t"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
        "selp.u32 %0, 1, 0, p;\n\t}"
        : "=r"(done)
        : "r"(a), "r"(parity)
        : "memory");
  } while (!done);
}

// `bytes` (multiple of 16) from global `src` to shared `dst` (both 16-byte aligned), completing
// `bytes` of the transaction count of `bar`.
__device__ __forceinline__ void bulk_copy_g2s(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          smem_u32(dst)),
      "l"(src), "r"(bytes), "r"(smem_u32(bar))
      : "memory");
}

// Named barrier id (1 … 15; 0 is __syncthreads) over n threads, a multiple of 32: bar.sync waits
// for all n, bar.arrive counts this warp without waiting.
__device__ __forceinline__ void named_bar_sync(int id, int n) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ void named_bar_arrive(int id, int n) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}

}  // namespace kvlab
#endif

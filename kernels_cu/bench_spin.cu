// kvlab — a GPU-side wait for the benchmark timer (Python op: kvlab/cuda/bench_spin.py, used by
// kvlab/bench/timing.py). One thread spins on the global nanosecond timer for `ns` nanoseconds and
// touches no memory. Queued ahead of a timed call's start event, it keeps the GPU busy while the
// host enqueues the call, so the events time the kernels and not the host's launch work (the same
// idea as nvbench's blocking kernel). Not a kernel of the library's data path.
#include "common.cuh"

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

extern "C" __global__ void gpu_spin(long long ns) {
  if (threadIdx.x != 0 || blockIdx.x != 0 || ns <= 0) return;
  const unsigned long long t0 = global_ns();
  while (global_ns() - t0 < static_cast<unsigned long long>(ns)) __nanosleep(1000);
}

// kvlab — standalone nibble pack/unpack kernels (the first kernel family).
// Python op: kvlab/cuda/nibble.py. Reference: kvlab/reference/nibble.py.
// Memory-bound: pack reads 2n bytes and writes n; unpack the reverse. Each
// thread handles 8 codes <-> 4 packed bytes (one 8-byte load, one 4-byte store).
#include "common.cuh"
#include "nibble.cuh"

// The thread's first packed byte i (it handles packed bytes [i, i + VEC), codes [2i, 2i + 2·VEC)).
template <int VEC>
__device__ __forceinline__ long long first_packed_byte() {
  return (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) * VEC;
}

// Whether the thread's VEC packed bytes lie in range and both buffers allow the vector path
// (one 8-byte access of codes, one 4-byte access of packed); otherwise byte by byte.
template <int VEC>
__device__ __forceinline__ bool vector_path(long long i, long long n_packed, const uint8_t* codes,
                                            const uint8_t* packed) {
  return i + VEC <= n_packed && (reinterpret_cast<uintptr_t>(codes) % 8 == 0) &&
         (reinterpret_cast<uintptr_t>(packed) % 4 == 0);
}

template <int VEC>  // VEC: packed bytes per thread (4)
__global__ void pack_nibbles(const uint8_t* __restrict__ codes, uint8_t* __restrict__ packed,
                             long long n_packed) {
  static_assert(VEC == 4, "pack_nibbles handles 4 packed bytes per thread");
  const long long i = first_packed_byte<VEC>();
  if (vector_path<VEC>(i, n_packed, codes, packed)) {
    uint2 c = *reinterpret_cast<const uint2*>(codes + 2 * i);
    *reinterpret_cast<uint32_t*>(packed + i) = kvlab::pack8(c.x, c.y);
  } else {
    for (long long j = i; j < n_packed && j < i + VEC; ++j)
      packed[j] = kvlab::pack2(codes[2 * j], codes[2 * j + 1]);
  }
}

template <int VEC>
__global__ void unpack_nibbles(const uint8_t* __restrict__ packed, uint8_t* __restrict__ codes,
                               long long n_packed) {
  static_assert(VEC == 4, "unpack_nibbles handles 4 packed bytes per thread");
  const long long i = first_packed_byte<VEC>();
  if (vector_path<VEC>(i, n_packed, codes, packed)) {
    uint32_t w = *reinterpret_cast<const uint32_t*>(packed + i);
    uint2 c;
    kvlab::unpack8(w, c.x, c.y);
    *reinterpret_cast<uint2*>(codes + 2 * i) = c;
  } else {
    for (long long j = i; j < n_packed && j < i + VEC; ++j) {
      codes[2 * j] = kvlab::nibble_lo(packed[j]);
      codes[2 * j + 1] = kvlab::nibble_hi(packed[j]);
    }
  }
}

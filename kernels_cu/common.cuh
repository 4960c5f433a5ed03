// kvlab — shared device helpers: element types, conversions, warp reductions.
//
// Kernels take raw pointers, sizes and element strides; no Python framework
// type crosses into CUDA (CONVENTIONS: "kernels framework-free").
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

// NVRTC has no <cstdint>; define the fixed-width types the kernels use.
#if defined(__CUDACC_RTC__)
typedef unsigned char uint8_t;
typedef signed char int8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef int int32_t;
typedef unsigned long long uint64_t;
typedef long long int64_t;
typedef unsigned long long uintptr_t;
#else
#include <cstdint>
#endif

namespace kvlab {

// Load one element of the model dtype as float32 (exact for bf16/fp16).
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

// Round a float32 to the model dtype (round-to-nearest-even).
template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// Round a float32 to T and back: what storing in T and reloading does.
template <typename T> __device__ __forceinline__ float round_through(float x) {
  return to_float(from_float<T>(x));
}

__device__ __forceinline__ float warp_max(float v, unsigned mask = 0xffffffffu) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(mask, v, o));
  return v;
}
__device__ __forceinline__ float warp_min(float v, unsigned mask = 0xffffffffu) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fminf(v, __shfl_xor_sync(mask, v, o));
  return v;
}
__device__ __forceinline__ float warp_sum(float v, unsigned mask = 0xffffffffu) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(mask, v, o);
  return v;
}

// Reductions over groups of WIDTH consecutive lanes (WIDTH a power of two <= 32). ``mask``: the
// lanes that execute the call (all of the warp unless a caller is inside a branch that only some
// groups take; a shuffle whose mask names a lane that never arrives hangs the warp).
template <int WIDTH> __device__ __forceinline__ float group_max(float v, unsigned mask = 0xffffffffu) {
#pragma unroll
  for (int o = WIDTH / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(mask, v, o));
  return v;
}
template <int WIDTH> __device__ __forceinline__ float group_min(float v, unsigned mask = 0xffffffffu) {
#pragma unroll
  for (int o = WIDTH / 2; o > 0; o >>= 1) v = fminf(v, __shfl_xor_sync(mask, v, o));
  return v;
}
template <int WIDTH> __device__ __forceinline__ float group_sum(float v) {
#pragma unroll
  for (int o = WIDTH / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

}  // namespace kvlab

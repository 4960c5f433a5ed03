// kvlab — nibble packing (SPEC 2.1 step 5): element 2i in the low nibble of byte i.
// Reference: kvlab/reference/nibble.py.
#pragma once
#include "common.cuh"

namespace kvlab {

__device__ __forceinline__ uint8_t pack2(uint32_t lo, uint32_t hi) {
  return static_cast<uint8_t>((lo & 0xFu) | ((hi & 0xFu) << 4));
}
__device__ __forceinline__ uint32_t nibble_lo(uint8_t b) { return b & 0xFu; }
__device__ __forceinline__ uint32_t nibble_hi(uint8_t b) { return b >> 4; }

// 8 codes (one per byte of two uint32 words, low to high) -> one uint32 of 8 nibbles.
__device__ __forceinline__ uint32_t pack8(uint32_t c0123, uint32_t c4567) {
  uint32_t out = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) out |= ((c0123 >> (8 * i)) & 0xFu) << (4 * i);
#pragma unroll
  for (int i = 0; i < 4; ++i) out |= ((c4567 >> (8 * i)) & 0xFu) << (16 + 4 * i);
  return out;
}

// One uint32 of 8 nibbles -> two uint32 words of 8-bit codes (low nibble first).
__device__ __forceinline__ void unpack8(uint32_t w, uint32_t& c0123, uint32_t& c4567) {
  c0123 = 0; c4567 = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) c0123 |= ((w >> (4 * i)) & 0xFu) << (8 * i);
#pragma unroll
  for (int i = 0; i < 4; ++i) c4567 |= ((w >> (16 + 4 * i)) & 0xFu) << (8 * i);
}

}  // namespace kvlab

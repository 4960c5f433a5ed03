// kvlab — standalone Walsh–Hadamard / RHT kernels along the last axis of a row-major array.
// Python op: kvlab/cuda/hadamard.py. Reference: kvlab/reference/hadamard.py.
// Device functions: kernels_cu/hadamard.cuh (shared with the write and attention kernels).
//
// Memory-bound: per row of D elements of T it reads D·sizeof(T) bytes and writes as many
// (bf16, D=128: 256 + 256 bytes); the D·log2(D) float32 additions and log2(D/EPT) shuffle
// rounds per element are far below the bandwidth time. A group of LANES lanes holds one row
// (16 bytes per lane); each group handles ROWS rows, grid-strided so that every step of a
// warp touches consecutive rows (coalesced), and issues all ROWS loads before any math so
// that 16·ROWS bytes per lane are in flight.
#include "common.cuh"
#include "hadamard.cuh"
#include "quant_formats.cuh"

namespace kvlab {
constexpr int HADAMARD_WHT = 0;          // y = H · x
constexpr int HADAMARD_RHT = 1;          // y = H · (s ⊙ x)
constexpr int HADAMARD_RHT_INVERSE = 2;  // x = s ⊙ (H · y) / D
}  // namespace kvlab

template <int D, typename T, int MODE, int ROWS>
__global__ void __launch_bounds__(256) hadamard_rows(const T* __restrict__ x, T* __restrict__ y,
                                                     long long n_rows) {
  using G = kvlab::RowGeometry<D, T>;
  constexpr int EPT = G::EPT, LANES = G::LANES;
  static_assert(MODE >= 0 && MODE <= 2, "MODE: 0 WHT, 1 RHT, 2 inverse RHT");
  static_assert(256 % LANES == 0, "groups tile the block");
  const int lig = threadIdx.x & (LANES - 1);
  const long long groups = static_cast<long long>(gridDim.x) * (blockDim.x / LANES);
  const long long group = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) / LANES;

  float v[ROWS][EPT];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    const long long row = group + r * groups;
    if (row < n_rows) {
      kvlab::load_elems<T, EPT>(x + row * D + lig * EPT, v[r]);
    } else {
#pragma unroll
      for (int j = 0; j < EPT; ++j) v[r][j] = 0.0f;  // keep the lane in the shuffles
    }
  }
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    if constexpr (MODE == kvlab::HADAMARD_WHT) kvlab::wht_group<EPT, LANES>(v[r], lig);
    else if constexpr (MODE == kvlab::HADAMARD_RHT) kvlab::rht_group<EPT, LANES>(v[r], lig);
    else kvlab::inverse_rht_group<EPT, LANES>(v[r], lig);
  }
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    const long long row = group + r * groups;
    if (row < n_rows) kvlab::store_elems<T, EPT>(y + row * D + lig * EPT, v[r]);
  }
}

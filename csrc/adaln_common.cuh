// Device helpers shared by the AdaLN kernels: aligned vector access and block reductions.
#pragma once

#include <cstdint>

namespace adaptiveload {

constexpr int kWarpSize = 32;
constexpr int kMaxThreads = 512;  // per block; 128 registers/thread fit at full block size
// Cap for the fused backward: 96 registers keep two 320-thread blocks (D = 5120 bf16) resident
// per SM, which hides more latency than the extra registers ptxas would otherwise take.
constexpr int kBwdMaxRegisters = 96;

// N elements loaded/stored as one aligned access (16 bytes for 8 bf16 or 4 fp32).
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

template <typename T, int N>
__device__ __forceinline__ Vec<T, N> load_vec(const T* ptr) {
  return *reinterpret_cast<const Vec<T, N>*>(ptr);
}

template <typename T, int N>
__device__ __forceinline__ void store_vec(T* ptr, const Vec<T, N>& value) {
  *reinterpret_cast<Vec<T, N>*>(ptr) = value;
}

__device__ __forceinline__ float warp_sum(float v) {
  // Butterfly: every lane ends with the same, order-fixed sum (deterministic).
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Sums K values over the block; every thread gets the totals. smem: K * 32 floats.
// The leading barrier lets consecutive calls reuse smem.
template <int K>
__device__ __forceinline__ void block_sum(float (&v)[K], float* smem) {
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int num_warps = (blockDim.x + kWarpSize - 1) / kWarpSize;
#pragma unroll
  for (int k = 0; k < K; ++k) v[k] = warp_sum(v[k]);
  __syncthreads();
  if (lane == 0) {
#pragma unroll
    for (int k = 0; k < K; ++k) smem[k * kWarpSize + warp] = v[k];
  }
  __syncthreads();
  // Each warp finishes the reduction itself: no broadcast barrier needed.
#pragma unroll
  for (int k = 0; k < K; ++k) v[k] = warp_sum(lane < num_warps ? smem[k * kWarpSize + lane] : 0.f);
}

}  // namespace adaptiveload

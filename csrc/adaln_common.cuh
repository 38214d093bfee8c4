// Device helpers shared by the AdaLN kernels: aligned vector access, deterministic reductions,
// and how a row is split over the threads that own it.
#pragma once

#include <cstdint>
#include <cstring>

namespace adaptiveload {

constexpr int kWarpSize = 32;
constexpr int kMaxThreads = 512;  // per block; 128 registers/thread fit at full block size
constexpr int kMaxVpt = 4;        // 16-byte vectors per thread per row in the block kernels

// Rows (one per warp) per block of the warp-per-row forward kernel: small blocks keep the
// occupancy granularity fine.
constexpr int kRowWarps = 4;

// Register cap of the warp forward kernel by 16-byte vectors per lane (4 registers each).
// Uncapped, ptxas takes 118 registers for bf16 D = 1536 (VPL = 6), i.e. 16 resident rows per SM;
// capped at 64, 32 rows, without spills (nvcc 13.0, sm_90). At VPL = 20 (D = 5120) the cap is 120:
// 16 rows per SM.
constexpr int warp_fwd_max_registers(int vpl) { return 40 + 4 * vpl; }

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

// An empty asm that claims to rewrite the registers of v: values the compiler derived from v
// before this point can no longer stand in for the same expressions after it. Placed between the
// passes over a row held in registers, it makes each pass convert the packed 16-bit inputs to
// fp32 again (one instruction per element) instead of keeping every converted value live, which
// doubles the registers a bf16 row takes.
template <typename T, int N, int K>
__device__ __forceinline__ void forget_values(Vec<T, N> (&v)[K]) {
  static_assert(sizeof(Vec<T, N>) == sizeof(uint4), "16-byte vectors");
#pragma unroll
  for (int k = 0; k < K; ++k) {
    uint4 u;
    memcpy(&u, &v[k], sizeof(u));
    asm volatile("" : "+r"(u.x), "+r"(u.y), "+r"(u.z), "+r"(u.w));
    memcpy(&v[k], &u, sizeof(u));
  }
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

// How a row is split over threads; the forward's row math (adaln_kernels.cuh) is written once
// against this interface. A thread owns the row's 16-byte vectors first(), first() + step(), ...,
// so consecutive threads touch consecutive vectors (coalesced), and sum() totals K per-thread
// values over the row's owners, each owner getting the totals. kRegisterCapped: the kernel runs
// under a tight register cap, so the row math re-converts its inputs per pass (forget_values).

// The whole block owns the row (wide rows). smem: 32 * K floats for block_sum.
struct BlockRow {
  static constexpr bool kRegisterCapped = false;
  int nvec;  // 16-byte vectors per row
  float* smem;
  __device__ __forceinline__ int first() const { return threadIdx.x; }
  __device__ __forceinline__ int step() const { return blockDim.x; }
  __device__ __forceinline__ bool leader() const { return threadIdx.x == 0; }
  template <int K>
  __device__ __forceinline__ void sum(float (&v)[K]) const {
    block_sum<K>(v, smem);
  }
};

// The lane index, read by an asm the compiler may not move or merge (measured: with it the warp
// forward kernel fits its register cap without spills).
__device__ __forceinline__ int lane_id() {
  int lane;
  asm volatile("mov.u32 %0, %%laneid;" : "=r"(lane));
  return lane;
}

// One warp owns the row: shuffles only, no shared memory and no barrier, so the warps of a
// block progress independently and each row's reductions cost only their own latency.
struct WarpRow {
  static constexpr bool kRegisterCapped = true;
  int nvec;
  int lane;  // lane_id()
  __device__ __forceinline__ int first() const { return lane; }
  __device__ __forceinline__ int step() const { return kWarpSize; }
  __device__ __forceinline__ bool leader() const { return lane == 0; }
  template <int K>
  __device__ __forceinline__ void sum(float (&v)[K]) const {
#pragma unroll
    for (int k = 0; k < K; ++k) v[k] = warp_sum(v[k]);
  }
};

}  // namespace adaptiveload

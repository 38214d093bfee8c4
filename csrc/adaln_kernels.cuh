// AdaLN device code. y = (xhat * w + b) * (1 + scale) + shift, xhat = (x - mean) * rstd, fp32 math.
//
// Layout: x, y, dy, dx are (B, N, D) contiguous; row = b * N + n. shift/scale rows start at
// b * sb + n * sn elements (sn = 0 for per-sample modulation), unit inner stride.
//
// Fast path (vectorized, D % VEC == 0, 16-byte aligned): a row is held in registers by the
// threads that own it, thread t of the owners holding the 16-byte vectors t, t + owners, ... (so
// a warp touches contiguous memory). Forward: rows of at most 32 * 8 vectors are owned by one
// warp (several independent rows per block, shuffle reductions only), wider rows by a block
// (block reductions); the row math is written once (fwd_row) against the WarpRow / BlockRow
// split of adaln_common.cuh. Backward: one block per tile of rows of one sample, two rows per step.
// Generic path (any D/alignment): same math with scalar strided loops that re-read the row.
//
// Backward reductions over the sequence (dshift, dscale per sample; dweight, dbias) use the
// D-tile coalesced scheme: each thread accumulates its features down a tile of rows, writes
// fp32 partials (B, tiles, 2, D), and adaln_bwd_finish_kernel sums them in a fixed order.
// Two sums are enough for everything (per sample b):
//   S1 = sum_n dy,  S2 = sum_n dy * xhat
//   dshift = S1, dscale = w * S2 + bias * S1, dweight = sum_b g_b S2_b, dbias = sum_b g_b S1_b
// with g_b = 1 + scale_b. Per-token modulation needs no reduction for dshift/dscale; there the
// partials hold sum dy * g and sum dy * g * xhat for dweight/dbias (affine only).
#pragma once

#include "adaln_common.cuh"

namespace adaptiveload {

template <typename T, typename M>
struct FwdArgs {
  const T* x;
  const M* shift;
  const M* scale;
  const float* weight;  // (D,) or nullptr
  const float* bias;    // (D,) or nullptr
  T* y;
  float* mean;   // (B * N,)
  float* rstd;   // (B * N,)
  int64_t rows;  // B * N
  int64_t seq;
  int dim;
  int64_t shift_sb, shift_sn, scale_sb, scale_sn;  // element strides
  float eps;
};

template <typename T, typename M>
struct BwdArgs {
  const T* dy;
  const T* x;
  const M* scale;
  const float* weight;
  const float* bias;
  const float* mean;
  const float* rstd;
  T* dx;
  M* dshift_tok;  // (B, N, D) when per token, else nullptr
  M* dscale_tok;
  float* partial;  // (B, tiles, 2, D) when a sequence reduction is needed, else nullptr
  int64_t seq;
  int dim;
  int64_t scale_sb, scale_sn;
  int64_t rows_per_tile;
  int tiles;
  bool per_token;
};

// ---------------------------------------------------------------- forward

// Loads this thread's vectors of one row (vectors part.first() + i * part.step(), i < VPT).
template <typename T, int VEC, int VPT, typename Row>
__device__ __forceinline__ void load_row(Vec<T, VEC> (&v)[VPT], const T* row_ptr, const Row& part) {
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int c = part.first() + i * part.step();
    if (c < part.nvec) v[i] = load_vec<T, VEC>(row_ptr + c * VEC);
  }
}

// Normalizes one row held in registers (this thread's vectors xv) and writes y, mean and rstd.
template <typename T, typename M, int VEC, int VPT, typename Row>
__device__ __forceinline__ void fwd_row(const FwdArgs<T, M>& a, int64_t row, Vec<T, VEC> (&xv)[VPT],
                                        const Row& part) {
  const int64_t b = row / a.seq, n = row % a.seq;
  float sum[1] = {0.f};
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    if (part.first() + i * part.step() < part.nvec) {
#pragma unroll
      for (int k = 0; k < VEC; ++k) sum[0] += static_cast<float>(xv[i].v[k]);
    }
  }
  if constexpr (Row::kRegisterCapped) forget_values(xv);
  part.sum(sum);
  const float mu = sum[0] / a.dim;
  float sq[1] = {0.f};  // two-pass variance from registers: no cancellation
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    if (part.first() + i * part.step() < part.nvec) {
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const float d = static_cast<float>(xv[i].v[k]) - mu;
        sq[0] += d * d;
      }
    }
  }
  if constexpr (Row::kRegisterCapped) forget_values(xv);
  part.sum(sq);
  const float rs = rsqrtf(sq[0] / a.dim + a.eps);

  const M* shift_row = a.shift + b * a.shift_sb + n * a.shift_sn;
  const M* scale_row = a.scale + b * a.scale_sb + n * a.scale_sn;
  T* y_row = a.y + row * a.dim;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int c = part.first() + i * part.step();
    if (c >= part.nvec) continue;
    const Vec<M, VEC> sh = load_vec<M, VEC>(shift_row + c * VEC);
    const Vec<M, VEC> sc = load_vec<M, VEC>(scale_row + c * VEC);
    Vec<float, VEC> w, bi;
    if (a.weight) w = load_vec<float, VEC>(a.weight + c * VEC);
    if (a.bias) bi = load_vec<float, VEC>(a.bias + c * VEC);
    Vec<T, VEC> out;
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      float z = (static_cast<float>(xv[i].v[k]) - mu) * rs;
      if (a.weight) z *= w.v[k];
      if (a.bias) z += bi.v[k];
      out.v[k] = static_cast<T>(z * (1.f + static_cast<float>(sc.v[k])) + static_cast<float>(sh.v[k]));
    }
    store_vec<T, VEC>(y_row + c * VEC, out);
  }
  if (part.leader()) {
    a.mean[row] = mu;
    a.rstd[row] = rs;
  }
}

// Block per row (rows wider than a warp's register budget). Grid-stride over rows: about one
// resident wave of blocks, each normalizing rows in turn. The next row's loads are issued before
// this row's reductions so they overlap the two block-wide barriers (software pipelining).
template <typename T, typename M, int VPT>
__global__ void __launch_bounds__(kMaxThreads) adaln_fwd_block_kernel(FwdArgs<T, M> a) {
  constexpr int VEC = 16 / sizeof(T);
  __shared__ float smem[kWarpSize];
  const BlockRow part{a.dim / VEC, smem};
  Vec<T, VEC> xv[VPT];
  if (blockIdx.x < a.rows) load_row(xv, a.x + blockIdx.x * static_cast<int64_t>(a.dim), part);
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    Vec<T, VEC> x_next[VPT];
    if (row + gridDim.x < a.rows) load_row(x_next, a.x + (row + gridDim.x) * a.dim, part);
    fwd_row(a, row, xv, part);
#pragma unroll
    for (int i = 0; i < VPT; ++i) xv[i] = x_next[i];
  }
}

// Warp per row (at most 32 * VPL vectors): kRowWarps independent rows per block, reductions by
// shuffles only, one row per warp and a grid of ceil(rows / kRowWarps) blocks. Not grid-stride:
// in a loop over rows the compiler hoists the per-lane shift/scale/weight/bias addresses of all
// VPL vectors out of the loop, and under the register cap those spill. No prefetch: the rows in
// flight per SM come from the many resident warps, each waiting on its own row.
template <typename T, typename M, int VPL>
__global__ void __maxnreg__(warp_fwd_max_registers(VPL)) adaln_fwd_warp_kernel(FwdArgs<T, M> a) {
  constexpr int VEC = 16 / sizeof(T);
  const WarpRow part{a.dim / VEC, lane_id()};
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowWarps + threadIdx.x / kWarpSize;
  if (row >= a.rows) return;
  Vec<T, VEC> xv[VPL];
  load_row(xv, a.x + row * a.dim, part);
  fwd_row(a, row, xv, part);
}

template <typename T, typename M>
__global__ void __launch_bounds__(kMaxThreads) adaln_fwd_generic_kernel(FwdArgs<T, M> a) {
  __shared__ float smem[kWarpSize];
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    const int64_t b = row / a.seq, n = row % a.seq;
    const T* x_row = a.x + row * a.dim;
    float sum[1] = {0.f};
    for (int d = threadIdx.x; d < a.dim; d += blockDim.x) sum[0] += static_cast<float>(x_row[d]);
    block_sum<1>(sum, smem);
    const float mu = sum[0] / a.dim;
    float sq[1] = {0.f};
    for (int d = threadIdx.x; d < a.dim; d += blockDim.x) {
      const float c = static_cast<float>(x_row[d]) - mu;
      sq[0] += c * c;
    }
    block_sum<1>(sq, smem);
    const float rs = rsqrtf(sq[0] / a.dim + a.eps);
    const M* shift_row = a.shift + b * a.shift_sb + n * a.shift_sn;
    const M* scale_row = a.scale + b * a.scale_sb + n * a.scale_sn;
    T* y_row = a.y + row * a.dim;
    for (int d = threadIdx.x; d < a.dim; d += blockDim.x) {
      float z = (static_cast<float>(x_row[d]) - mu) * rs;
      if (a.weight) z *= a.weight[d];
      if (a.bias) z += a.bias[d];
      y_row[d] = static_cast<T>(z * (1.f + static_cast<float>(scale_row[d])) + static_cast<float>(shift_row[d]));
    }
    if (threadIdx.x == 0) {
      a.mean[row] = mu;
      a.rstd[row] = rs;
    }
  }
}

// ---------------------------------------------------------------- backward

// dx for every row of tile blockIdx.x of sample blockIdx.y, fused with the D-tile partial sums.
// Rows go in pairs (n, n + 1; an odd tile ends with one row alone): both are loaded at once and
// reduced together, one block_sum of four values per pair instead of two of two, and each
// thread's column sums are read and written once per pair. No prefetch of the next pair (x and dy
// of four rows would not fit the register caps below): on an H200 this ran 6-9% faster than one
// row at a time with the next row prefetched at D = 3072 and 5120, and the same at D = 1536
// (benchmarks/results/kernel_variants/). Within the caps without spills (nvcc 13.0, sm_90) only
// because dxhat is recomputed after the reduction from inputs re-converted there (forget_values).
// kGeneral = false compiles the hot case (per-sample modulation, no affine) without the
// registers that per-token outputs and weight/bias need.
template <typename T, typename M, int VPT, bool kGeneral>
__global__ void __maxnreg__(VPT < kMaxVpt ? 96 : 128) adaln_bwd_fused_kernel(BwdArgs<T, M> a) {
  constexpr int VEC = 16 / sizeof(T);
  constexpr int K = 2;  // rows per step
  __shared__ float smem[2 * K * kWarpSize];
  const float* weight = kGeneral ? a.weight : nullptr;
  const float* bias = kGeneral ? a.bias : nullptr;
  const bool per_token = kGeneral && a.per_token;
  const int64_t b = blockIdx.y;
  const int64_t n0 = blockIdx.x * a.rows_per_tile;
  const int64_t n1 = min(a.seq, n0 + a.rows_per_tile);
  const int nvec = a.dim / VEC;
  const BlockRow row_split{nvec, smem};
  const bool per_sample_sums = a.partial != nullptr && !per_token;
  const bool param_sums = a.partial != nullptr && per_token;
  const float inv_dim = 1.f / a.dim;

  // Column sums live in shared memory (2 * D floats, dynamic), not registers: registers go to
  // the pair of rows instead. Each thread only touches its own features: no barriers needed.
  extern __shared__ __align__(32) float dynamic_smem[];
  float* acc1 = dynamic_smem;
  float* acc2 = acc1 + a.dim;
  if (a.partial != nullptr) {
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int c = threadIdx.x + i * blockDim.x;
      if (c >= nvec) continue;
#pragma unroll
      for (int k0 = 0; k0 < VEC; k0 += 4) {
        store_vec<float, 4>(acc1 + c * VEC + k0, {0.f, 0.f, 0.f, 0.f});
        store_vec<float, 4>(acc2 + c * VEC + k0, {0.f, 0.f, 0.f, 0.f});
      }
    }
  }

  for (int64_t n = n0; n < n1; n += K) {
    const int64_t row0 = b * a.seq + n;
    const int count = static_cast<int>(n1 - n < K ? n1 - n : K);  // rows in this step, the same for the whole block
    Vec<T, VEC> xv[K][VPT], dyv[K][VPT];
    float mu[K] = {}, rs[K] = {};
#pragma unroll
    for (int r = 0; r < K; ++r) {
      if (r >= count) continue;
      load_row(xv[r], a.x + (row0 + r) * a.dim, row_split);
      load_row(dyv[r], a.dy + (row0 + r) * a.dim, row_split);
      mu[r] = a.mean[row0 + r];
      rs[r] = a.rstd[row0 + r];
    }
    // Row r's scale is at scale_row + r * scale_sn; per-sample modulation (all that kGeneral =
    // false sees) has scale_sn = 0, so the second row's scale loads hit L1.
    const M* scale_row = a.scale + b * a.scale_sb + n * a.scale_sn;
    float sums[2 * K] = {};  // row r: sum dxhat, sum dxhat * xhat
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int c = threadIdx.x + i * blockDim.x;
      if (c >= nvec) continue;
      Vec<float, VEC> w, bi;
      if (weight) w = load_vec<float, VEC>(weight + c * VEC);
      if (bias) bi = load_vec<float, VEC>(bias + c * VEC);
      Vec<float, VEC> s1, s2;
      if (a.partial != nullptr) {
        s1 = load_vec<float, VEC>(acc1 + c * VEC);
        s2 = load_vec<float, VEC>(acc2 + c * VEC);
      }
      // Rows in order (n, then n + 1), so the column sums add up as in a one-row loop.
#pragma unroll
      for (int r = 0; r < K; ++r) {
        if (r >= count) continue;
        const Vec<M, VEC> sc = load_vec<M, VEC>(scale_row + r * a.scale_sn + c * VEC);
        Vec<M, VEC> dshift_out, dscale_out;
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          const float xh = (static_cast<float>(xv[r][i].v[k]) - mu[r]) * rs[r];
          const float dyf = static_cast<float>(dyv[r][i].v[k]);
          const float dz = dyf * (1.f + static_cast<float>(sc.v[k]));
          const float dxh = weight ? dz * w.v[k] : dz;
          sums[2 * r] += dxh;
          sums[2 * r + 1] += dxh * xh;
          if (per_sample_sums) {
            s1.v[k] += dyf;
            s2.v[k] += dyf * xh;
          } else if (param_sums) {
            s1.v[k] += dz;
            s2.v[k] += dz * xh;
          }
          if (per_token) {
            float z = weight ? xh * w.v[k] : xh;
            if (bias) z += bi.v[k];
            dshift_out.v[k] = static_cast<M>(dyf);
            dscale_out.v[k] = static_cast<M>(dyf * z);
          }
        }
        if (per_token) {
          store_vec<M, VEC>(a.dshift_tok + (row0 + r) * a.dim + c * VEC, dshift_out);
          store_vec<M, VEC>(a.dscale_tok + (row0 + r) * a.dim + c * VEC, dscale_out);
        }
      }
      if (a.partial != nullptr) {
        store_vec<float, VEC>(acc1 + c * VEC, s1);
        store_vec<float, VEC>(acc2 + c * VEC, s2);
      }
    }
#pragma unroll
    for (int r = 0; r < K; ++r) {
      forget_values(xv[r]);
      forget_values(dyv[r]);
    }
    block_sum<2 * K>(sums, smem);
#pragma unroll
    for (int r = 0; r < K; ++r) {
      if (r >= count) continue;
      const float mean_dxhat = sums[2 * r] * inv_dim, mean_dxhat_xhat = sums[2 * r + 1] * inv_dim;
#pragma unroll
      for (int i = 0; i < VPT; ++i) {
        const int c = threadIdx.x + i * blockDim.x;
        if (c >= nvec) continue;
        const Vec<M, VEC> sc = load_vec<M, VEC>(scale_row + r * a.scale_sn + c * VEC);  // L1 hits
        Vec<float, VEC> w;
        if (weight) w = load_vec<float, VEC>(weight + c * VEC);
        Vec<T, VEC> out;
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          const float xh = (static_cast<float>(xv[r][i].v[k]) - mu[r]) * rs[r];
          const float dz = static_cast<float>(dyv[r][i].v[k]) * (1.f + static_cast<float>(sc.v[k]));
          const float dxh = weight ? dz * w.v[k] : dz;
          out.v[k] = static_cast<T>(rs[r] * (dxh - mean_dxhat - xh * mean_dxhat_xhat));
        }
        store_vec<T, VEC>(a.dx + (row0 + r) * a.dim + c * VEC, out);
      }
    }
  }
  if (a.partial == nullptr) return;
  float* part = a.partial + (b * a.tiles + blockIdx.x) * 2 * static_cast<int64_t>(a.dim);
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int c = threadIdx.x + i * blockDim.x;
    if (c >= nvec) continue;
#pragma unroll
    for (int k0 = 0; k0 < VEC; k0 += 4) {
      store_vec<float, 4>(part + c * VEC + k0, load_vec<float, 4>(acc1 + c * VEC + k0));
      store_vec<float, 4>(part + a.dim + c * VEC + k0, load_vec<float, 4>(acc2 + c * VEC + k0));
    }
  }
}

// Generic path, step 1: dx (and per-token dshift/dscale) for row blockIdx.x.
template <typename T, typename M>
__global__ void __launch_bounds__(kMaxThreads) adaln_bwd_dx_generic_kernel(BwdArgs<T, M> a) {
  __shared__ float smem[2 * kWarpSize];
  const int64_t row = blockIdx.x;
  const int64_t b = row / a.seq, n = row % a.seq;
  const float mu = a.mean[row], rs = a.rstd[row];
  const T* x_row = a.x + row * a.dim;
  const T* dy_row = a.dy + row * a.dim;
  const M* scale_row = a.scale + b * a.scale_sb + n * a.scale_sn;
  float sums[2] = {0.f, 0.f};
  for (int d = threadIdx.x; d < a.dim; d += blockDim.x) {
    const float xh = (static_cast<float>(x_row[d]) - mu) * rs;
    const float dyf = static_cast<float>(dy_row[d]);
    const float dz = dyf * (1.f + static_cast<float>(scale_row[d]));
    const float dxh = a.weight ? dz * a.weight[d] : dz;
    sums[0] += dxh;
    sums[1] += dxh * xh;
    if (a.per_token) {
      float z = a.weight ? xh * a.weight[d] : xh;
      if (a.bias) z += a.bias[d];
      a.dshift_tok[row * a.dim + d] = static_cast<M>(dyf);
      a.dscale_tok[row * a.dim + d] = static_cast<M>(dyf * z);
    }
  }
  block_sum<2>(sums, smem);
  const float mean_dxhat = sums[0] / a.dim, mean_dxhat_xhat = sums[1] / a.dim;
  for (int d = threadIdx.x; d < a.dim; d += blockDim.x) {
    const float xh = (static_cast<float>(x_row[d]) - mu) * rs;
    const float dz = static_cast<float>(dy_row[d]) * (1.f + static_cast<float>(scale_row[d]));
    const float dxh = a.weight ? dz * a.weight[d] : dz;
    a.dx[row * a.dim + d] = static_cast<T>(rs * (dxh - mean_dxhat - xh * mean_dxhat_xhat));
  }
}

// Generic path, step 2: the D-tile coalesced partial sums. Grid (d_tiles, tiles, B); thread
// owns feature d and walks down rows n0..n1 of sample b, so a warp reads contiguous memory.
template <typename T, typename M>
__global__ void __launch_bounds__(kMaxThreads) adaln_bwd_partial_generic_kernel(BwdArgs<T, M> a) {
  const int d = blockIdx.x * blockDim.x + threadIdx.x;
  if (d >= a.dim) return;
  const int64_t b = blockIdx.z;
  const int64_t n0 = blockIdx.y * a.rows_per_tile;
  const int64_t n1 = min(a.seq, n0 + a.rows_per_tile);
  float acc1 = 0.f, acc2 = 0.f;
  for (int64_t n = n0; n < n1; ++n) {
    const int64_t row = b * a.seq + n;
    const float xh = (static_cast<float>(a.x[row * a.dim + d]) - a.mean[row]) * a.rstd[row];
    float g = static_cast<float>(a.dy[row * a.dim + d]);
    if (a.per_token) g *= 1.f + static_cast<float>(a.scale[b * a.scale_sb + n * a.scale_sn + d]);
    acc1 += g;
    acc2 += g * xh;
  }
  float* part = a.partial + (b * a.tiles + blockIdx.y) * 2 * static_cast<int64_t>(a.dim);
  part[d] = acc1;
  part[a.dim + d] = acc2;
}

// blockDim.y of the finishing kernel. The partials (tiles * 2 * D floats: 11 MB at D = 1536 on an
// H200) are read by only D / 32 blocks, so each thread keeps 8 tiles' loads in flight: at 16 rows
// and 4 loads this kernel was latency-bound (8-12 us at D = 1536, 5-6 us after).
constexpr int kFinishRows = 32;

// Second, deterministic stage: sums partials (B, tiles, 2, D) over tiles in a fixed order.
// Block (32, kFinishRows): a warp reads 32 consecutive features of one tile.
template <typename M>
__global__ void adaln_bwd_finish_kernel(const float* __restrict__ partial, const M* __restrict__ scale,
                                        const float* weight, const float* bias, M* dshift, M* dscale, float* dweight,
                                        float* dbias, int batch, int tiles, int dim, int64_t scale_sb, bool per_token) {
  __shared__ float red[2][kFinishRows][kWarpSize + 1];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int d = blockIdx.x * kWarpSize + tx;
  float wsum = 0.f, bsum = 0.f;
  for (int b = 0; b < batch; ++b) {
    float s1 = 0.f, s2 = 0.f;
    if (d < dim) {
#pragma unroll 8
      for (int t = ty; t < tiles; t += kFinishRows) {
        const float* p = partial + (static_cast<int64_t>(b) * tiles + t) * 2 * dim + d;
        s1 += p[0];
        s2 += p[dim];
      }
    }
    red[0][ty][tx] = s1;
    red[1][ty][tx] = s2;
    __syncthreads();
    if (ty == 0 && d < dim) {
      s1 = s2 = 0.f;
#pragma unroll
      for (int r = 0; r < kFinishRows; ++r) {
        s1 += red[0][r][tx];
        s2 += red[1][r][tx];
      }
      if (per_token) {  // partials already carry g = 1 + scale
        wsum += s2;
        bsum += s1;
      } else {
        const float w = weight ? weight[d] : 1.f, bi = bias ? bias[d] : 0.f;
        dshift[static_cast<int64_t>(b) * dim + d] = static_cast<M>(s1);
        dscale[static_cast<int64_t>(b) * dim + d] = static_cast<M>(w * s2 + bi * s1);
        const float g = 1.f + static_cast<float>(scale[b * scale_sb + d]);
        wsum += g * s2;
        bsum += g * s1;
      }
    }
    __syncthreads();
  }
  if (ty == 0 && d < dim) {
    if (dweight) dweight[d] = wsum;
    if (dbias) dbias[d] = bsum;
  }
}

}  // namespace adaptiveload

// Host side of the AdaLN kernels: launch configuration, dtype dispatch, checked launches.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>
#include <type_traits>
#include <utility>

#include "adaln.h"
#include "adaln_kernels.cuh"

namespace adaptiveload {
namespace {

// 16-byte vectors per lane (warp forward kernel) or per thread (block kernels) that get a kernel
// instantiation; a row takes the smallest that fits. Warp rows: up to 8 vectors per lane (D = 2048
// for 16-bit x, 1024 for fp32), then 20 for rows too wide for a block of kRowThreads (D = 4104 to
// 5120 for 16-bit x, 2052 to 2560 for fp32), see choose_config.
using WarpVpls = std::integer_sequence<int, 1, 2, 4, 6, 8, 20>;
constexpr int kWarpVplNarrow = 8;
using BlockVpts = std::integer_sequence<int, 1, 2, kMaxVpt>;
constexpr int kRowThreads = 128;  // preferred block size of the block kernels

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The one place that maps runtime dtypes to kernel template types: x in fp32/bf16/fp16,
// modulation in x's dtype or fp32 (the Python layer upcasts anything else).
template <typename F>
void dispatch_dtypes(at::ScalarType x_type, at::ScalarType mod_type, F&& f) {
  const bool mod_fp32 = mod_type == at::kFloat;
  TORCH_CHECK(mod_fp32 || mod_type == x_type, "adaln: shift/scale dtype ", mod_type, " must be fp32 or x's dtype ",
              x_type);
  switch (x_type) {
    case at::kFloat:
      return f(float{}, float{});
    case at::kBFloat16:
      return mod_fp32 ? f(at::BFloat16{}, float{}) : f(at::BFloat16{}, at::BFloat16{});
    case at::kHalf:
      return mod_fp32 ? f(at::Half{}, float{}) : f(at::Half{}, at::Half{});
    default:
      TORCH_CHECK(false, "adaln: x dtype ", x_type, " is not supported (fp32, bf16, fp16)");
  }
}

// Calls f(std::integral_constant<int, V>) for the V of the list equal to `value`.
template <int... Vs, typename F>
void dispatch_vpt(std::integer_sequence<int, Vs...>, int value, F&& f) {
  const bool found = ((value == Vs && (f(std::integral_constant<int, Vs>{}), true)) || ...);
  TORCH_CHECK(found, "adaln: internal error, vectors per thread ", value);
}

// Smallest V of the list with nvec <= V * owners, or 0 if none.
template <int... Vs>
int smallest_fit(std::integer_sequence<int, Vs...>, int64_t nvec, int64_t owners) {
  for (const int v : {Vs...})
    if (nvec <= v * owners) return v;
  return 0;
}

bool ptr_aligned(const void* ptr, int64_t bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; }

// Can every row of `t` (strides in elements) be read as aligned Vec<elem, vec>?
bool rows_vectorizable(const at::Tensor& t, int vec) {
  const int64_t bytes = vec * t.element_size();
  if (!ptr_aligned(t.data_ptr(), bytes)) return false;
  for (int64_t i = 0; i + 1 < t.dim(); ++i)
    if (t.size(i) > 1 && t.stride(i) % vec != 0) return false;
  return true;
}

enum class RowPath { kWarp, kBlock, kGeneric };

struct LaunchConfig {
  RowPath path;
  int vpt;      // vectors per lane (warp path) or per thread (block path)
  int threads;  // per block, a multiple of 32
};

// The one place that picks the kernels. Rows that load as 16-byte vectors: with warp_rows (the
// forward) a row fitting 8 vectors per lane goes to one warp, kRowWarps rows per block with no
// barrier. Otherwise a block owns the row, with the fewest vectors per thread that keep it at
// <= kRowThreads threads: small blocks put more rows in flight per SM, and that hides the latency
// of each row's block reductions (H200, D = 1536: 192-thread blocks ran at 1.7x the copy floor,
// 96-thread blocks at 1.4x). Rows wider than kRowThreads * kMaxVpt vectors take the fewest vectors
// per thread that fit kMaxThreads (D = 5120 bf16: 320 x 2, whose backward ran 3% faster than
// 160 x 4), except in the forward up to 20 vectors per lane, which go to one warp again: at
// D = 5120 the block forward (320 x 2, 3 blocks per SM) ran at 1.3x the copy floor, the warp
// kernel (16 rows per SM) at 1.1x; at D = 3072 the warp (12 per lane) lost to 96 x 4 blocks.
// Anything else runs the generic scalar kernels.
template <typename T>
LaunchConfig choose_config(int64_t dim, bool vectorizable, bool warp_rows) {
  constexpr int VEC = 16 / sizeof(T);
  if (vectorizable && dim % VEC == 0) {
    const int64_t nvec = dim / VEC;
    if (warp_rows) {
      const int vpl = smallest_fit(WarpVpls{}, nvec, kWarpSize);
      if (vpl && (vpl <= kWarpVplNarrow || nvec > kRowThreads * kMaxVpt))
        return {RowPath::kWarp, vpl, kRowWarps * kWarpSize};
    }
    int vpt = smallest_fit(BlockVpts{}, nvec, kRowThreads);
    if (!vpt) vpt = smallest_fit(BlockVpts{}, nvec, kMaxThreads);
    if (vpt) return {RowPath::kBlock, vpt, static_cast<int>(ceil_div(ceil_div(nvec, vpt), 32) * 32)};
  }
  return {RowPath::kGeneric, 0, static_cast<int>(std::min<int64_t>(kMaxThreads, ceil_div(dim, 32) * 32))};
}

template <typename T, typename M>
bool all_vectorizable(std::initializer_list<const at::Tensor*> row_tensors,
                      std::initializer_list<const at::Tensor*> params) {
  constexpr int VEC = 16 / sizeof(T);
  for (const at::Tensor* t : row_tensors)
    if (t->defined() && !rows_vectorizable(*t, VEC)) return false;
  for (const at::Tensor* t : params)  // fp32 (D,) vectors of VEC floats
    if (t->defined() && !ptr_aligned(t->data_ptr(), VEC * sizeof(float))) return false;
  return true;
}

// Blocks of `kernel` that fit on the whole GPU at once (one wave). Cached per kernel, block size,
// dynamic shared memory and device: the occupancy query is a driver call, and every backward
// (and block-path forward) asked it again, on the host's critical path.
template <typename Kernel>
int64_t resident_blocks(Kernel kernel, int threads, size_t dynamic_smem = 0) {
  using Key = std::tuple<const void*, int, size_t, c10::DeviceIndex>;
  static std::mutex mutex;  // the autograd engine's device threads launch backward kernels too
  static std::map<Key, int64_t> cache;
  const Key key{reinterpret_cast<const void*>(kernel), threads, dynamic_smem, c10::cuda::current_device()};
  const std::lock_guard<std::mutex> lock(mutex);
  const auto found = cache.find(key);
  if (found != cache.end()) return found->second;
  int per_sm = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, dynamic_smem));
  const int64_t blocks =
      std::max(1, per_sm) * static_cast<int64_t>(at::cuda::getCurrentDeviceProperties()->multiProcessorCount);
  cache.emplace(key, blocks);
  return blocks;
}

const float* opt_ptr(const at::Tensor& t) { return t.defined() ? t.data_ptr<float>() : nullptr; }

// (mod stride over b, over n) in elements; the n stride is 0 for per-sample modulation.
std::pair<int64_t, int64_t> mod_strides(const at::Tensor& t) { return {t.stride(0), t.size(1) == 1 ? 0 : t.stride(1)}; }

}  // namespace

std::vector<at::Tensor> adaln_fwd_cuda(const at::Tensor& x, const at::Tensor& shift, const at::Tensor& scale,
                                       const std::optional<at::Tensor>& weight_opt,
                                       const std::optional<at::Tensor>& bias_opt, double eps) {
  TORCH_CHECK(x.is_cuda(), "adaln: x must be a CUDA tensor, got device ", x.device());
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t batch = x.size(0), seq = x.size(1), dim = x.size(2), rows = batch * seq;
  const at::Tensor weight = weight_opt.value_or(at::Tensor());
  const at::Tensor bias = bias_opt.value_or(at::Tensor());
  at::Tensor y = at::empty_like(x);
  at::Tensor mean = at::empty({batch, seq}, x.options().dtype(at::kFloat));
  at::Tensor rstd = at::empty({batch, seq}, x.options().dtype(at::kFloat));
  if (rows == 0) return {y, mean, rstd};
  TORCH_CHECK(rows <= INT32_MAX, "adaln: B * N = ", rows, " rows exceeds the grid limit");
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();

  dispatch_dtypes(x.scalar_type(), shift.scalar_type(), [&](auto t_tag, auto m_tag) {
    using T = decltype(t_tag);
    using M = decltype(m_tag);
    // Named fields, not positional init: a reordered struct must not silently shift arguments.
    FwdArgs<T, M> a{};
    a.x = x.data_ptr<T>();
    a.shift = shift.data_ptr<M>();
    a.scale = scale.data_ptr<M>();
    a.weight = opt_ptr(weight);
    a.bias = opt_ptr(bias);
    a.y = y.data_ptr<T>();
    a.mean = mean.data_ptr<float>();
    a.rstd = rstd.data_ptr<float>();
    a.rows = rows;
    a.seq = seq;
    a.dim = static_cast<int>(dim);
    a.eps = static_cast<float>(eps);
    std::tie(a.shift_sb, a.shift_sn) = mod_strides(shift);
    std::tie(a.scale_sb, a.scale_sn) = mod_strides(scale);
    const LaunchConfig cfg =
        choose_config<T>(dim, all_vectorizable<T, M>({&x, &y, &shift, &scale}, {&weight, &bias}), true);
    if (cfg.path == RowPath::kWarp) {  // one row per warp (see the kernel)
      dispatch_vpt(WarpVpls{}, cfg.vpt, [&](auto vpl) {
        adaln_fwd_warp_kernel<T, M, decltype(vpl)::value><<<ceil_div(rows, kRowWarps), cfg.threads, 0, stream>>>(a);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    } else if (cfg.path == RowPath::kBlock) {  // grid-stride, one resident wave of blocks
      dispatch_vpt(BlockVpts{}, cfg.vpt, [&](auto vpt) {
        const auto kernel = adaln_fwd_block_kernel<T, M, decltype(vpt)::value>;
        kernel<<<std::min(rows, resident_blocks(kernel, cfg.threads)), cfg.threads, 0, stream>>>(a);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    } else {
      const auto kernel = adaln_fwd_generic_kernel<T, M>;
      kernel<<<std::min(rows, resident_blocks(kernel, cfg.threads)), cfg.threads, 0, stream>>>(a);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
  return {y, mean, rstd};
}

std::vector<at::Tensor> adaln_bwd_cuda(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& scale,
                                       const std::optional<at::Tensor>& weight_opt,
                                       const std::optional<at::Tensor>& bias_opt, const at::Tensor& mean,
                                       const at::Tensor& rstd) {
  TORCH_CHECK(x.is_cuda(), "adaln: x must be a CUDA tensor, got device ", x.device());
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t batch = x.size(0), seq = x.size(1), dim = x.size(2), rows = batch * seq;
  const at::Tensor weight = weight_opt.value_or(at::Tensor());
  const at::Tensor bias = bias_opt.value_or(at::Tensor());
  const bool per_token = scale.size(1) > 1;
  const bool affine = weight.defined() || bias.defined();
  const auto f32 = x.options().dtype(at::kFloat);

  at::Tensor dx = at::empty_like(x);
  at::Tensor dshift =
      at::empty({batch, per_token ? seq : 1, dim}, scale.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor dscale = at::empty_like(dshift);
  at::Tensor dweight = at::empty({weight.defined() ? dim : 0}, f32);
  at::Tensor dbias = at::empty({bias.defined() ? dim : 0}, f32);
  if (rows == 0) {  // sums over an empty sequence
    dshift.zero_();
    dscale.zero_();
    dweight.zero_();
    dbias.zero_();
    return {dx, dshift, dscale, dweight, dbias};
  }
  TORCH_CHECK(rows <= INT32_MAX, "adaln: B * N = ", rows, " rows exceeds the grid limit");
  TORCH_CHECK(batch <= 65535, "adaln: batch ", batch, " exceeds the grid limit 65535");
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const bool need_partial = !per_token || affine;

  dispatch_dtypes(x.scalar_type(), scale.scalar_type(), [&](auto t_tag, auto m_tag) {
    using T = decltype(t_tag);
    using M = decltype(m_tag);
    const LaunchConfig cfg =
        choose_config<T>(dim, all_vectorizable<T, M>({&x, &dy, &dx, &scale, &dshift, &dscale}, {&weight, &bias}), false);
    BwdArgs<T, M> a{};
    a.dy = dy.data_ptr<T>();
    a.x = x.data_ptr<T>();
    a.scale = scale.data_ptr<M>();
    a.weight = opt_ptr(weight);
    a.bias = opt_ptr(bias);
    a.mean = mean.data_ptr<float>();
    a.rstd = rstd.data_ptr<float>();
    a.dx = dx.data_ptr<T>();
    a.dshift_tok = per_token ? dshift.data_ptr<M>() : nullptr;
    a.dscale_tok = per_token ? dscale.data_ptr<M>() : nullptr;
    a.partial = nullptr;  // set by make_tiles
    a.seq = seq;
    a.dim = static_cast<int>(dim);
    a.per_token = per_token;
    std::tie(a.scale_sb, a.scale_sn) = mod_strides(scale);
    // Split each sample's rows into tiles so that all blocks together form about one resident
    // wave: enough to hide latency, and the fp32 partials (B, tiles, 2, D) stay small next to
    // the rows themselves.
    at::Tensor partial;
    const auto make_tiles = [&](int64_t blocks) {
      a.rows_per_tile = ceil_div(seq, std::clamp<int64_t>(blocks / batch, 1, seq));
      a.tiles = static_cast<int>(ceil_div(seq, a.rows_per_tile));  // no empty tiles
      if (need_partial) {
        partial = at::empty({batch, a.tiles, 2, dim}, f32);
        a.partial = partial.data_ptr<float>();
      }
    };

    if (cfg.path == RowPath::kBlock) {
      dispatch_vpt(BlockVpts{}, cfg.vpt, [&](auto vpt) {
        constexpr int VPT = decltype(vpt)::value;
        const auto kernel =
            (per_token || affine) ? adaln_bwd_fused_kernel<T, M, VPT, true> : adaln_bwd_fused_kernel<T, M, VPT, false>;
        // Column sums in shared memory: 2 * D fp32 (128 KB at D = 16384: above the 48 KB default).
        const size_t smem_bytes = need_partial ? 2 * dim * sizeof(float) : 0;
        if (smem_bytes > 48 * 1024) {
          C10_CUDA_CHECK(
              cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem_bytes)));
        }
        make_tiles(resident_blocks(kernel, cfg.threads, smem_bytes));
        kernel<<<dim3(a.tiles, batch), cfg.threads, smem_bytes, stream>>>(a);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    } else {
      adaln_bwd_dx_generic_kernel<T, M><<<rows, cfg.threads, 0, stream>>>(a);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      const int64_t d_tiles = ceil_div(dim, 256);
      make_tiles(std::max<int64_t>(1, 4 * sms / d_tiles));
      if (need_partial) {
        adaln_bwd_partial_generic_kernel<T, M><<<dim3(d_tiles, a.tiles, batch), 256, 0, stream>>>(a);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
    }
    if (need_partial) {
      adaln_bwd_finish_kernel<M><<<ceil_div(dim, kWarpSize), dim3(kWarpSize, kFinishRows), 0, stream>>>(
          partial.data_ptr<float>(), scale.data_ptr<M>(), opt_ptr(weight), opt_ptr(bias),
          per_token ? nullptr : dshift.data_ptr<M>(), per_token ? nullptr : dscale.data_ptr<M>(),
          weight.defined() ? dweight.data_ptr<float>() : nullptr, bias.defined() ? dbias.data_ptr<float>() : nullptr,
          static_cast<int>(batch), a.tiles, static_cast<int>(dim), a.scale_sb, per_token);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
  return {dx, dshift, dscale, dweight, dbias};
}

}  // namespace adaptiveload

// Host entry points of the fused AdaLN kernels (canonical layout; shapes, layouts, dtypes and
// devices validated by the caller, see adaln_bindings.cpp; these check that x is on CUDA). Shapes: x, dy (B, N, D) contiguous; shift/scale (B, M, D), M in
// {1, N}, unit inner stride; weight/bias (D,) fp32 contiguous or empty optionals.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <vector>

namespace adaptiveload {

// Returns {y (B, N, D) x.dtype, mean (B, N) fp32, rstd (B, N) fp32}.
std::vector<at::Tensor> adaln_fwd_cuda(const at::Tensor& x, const at::Tensor& shift, const at::Tensor& scale,
                                       const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                                       double eps);

// Returns {dx, dshift (B, M, D), dscale (B, M, D), dweight (D,) or (0,), dbias (D,) or (0,)}.
std::vector<at::Tensor> adaln_bwd_cuda(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& scale,
                                       const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                                       const at::Tensor& mean, const at::Tensor& rstd);

}  // namespace adaptiveload

// Python bindings of lightning_adaptiveload._C: argument checks, then the CUDA launchers.
// The torch.library custom ops (lightning_adaptiveload/ops/adaln.py) call these; the checks
// repeat the Python validation so a direct caller also gets a clear error before any launch.
#include <torch/extension.h>

#include "adaln.h"

namespace adaptiveload {
namespace {

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.is_cuda(), "adaln: ", name, " must be a CUDA tensor, got device ", x.device());
  TORCH_CHECK(x.dim() == 3, "adaln: ", name, " must be (B, N, D), got shape ", x.sizes());
  TORCH_CHECK(x.is_contiguous(), "adaln: ", name, " must be contiguous, got strides ", x.strides());
}

void check_modulation(const at::Tensor& mod, const at::Tensor& x, const char* name) {
  TORCH_CHECK(mod.device() == x.device(), "adaln: ", name, " is on ", mod.device(), " but x is on ", x.device());
  TORCH_CHECK(mod.dim() == 3 && mod.size(0) == x.size(0) && mod.size(2) == x.size(2) &&
                  (mod.size(1) == 1 || mod.size(1) == x.size(1)),
              "adaln: ", name, " must be (B, 1, D) or (B, N, D) for x ", x.sizes(), ", got ", mod.sizes());
  TORCH_CHECK(mod.size(2) <= 1 || mod.stride(2) == 1, "adaln: ", name, " must have unit inner stride, got strides ",
              mod.strides());
  TORCH_CHECK(mod.scalar_type() == at::kFloat || mod.scalar_type() == x.scalar_type(), "adaln: ", name, " dtype ",
              mod.scalar_type(), " must be fp32 or x's dtype ", x.scalar_type());
}

std::optional<at::Tensor> check_param(const std::optional<at::Tensor>& p, const at::Tensor& x, const char* name) {
  if (!p.has_value()) return p;
  TORCH_CHECK(p->device() == x.device(), "adaln: ", name, " is on ", p->device(), " but x is on ", x.device());
  TORCH_CHECK(p->dim() == 1 && p->size(0) == x.size(2), "adaln: ", name, " must be (D,) = (", x.size(2), ",), got ",
              p->sizes());
  TORCH_CHECK(p->scalar_type() == at::kFloat, "adaln: ", name, " must be fp32, got ", p->scalar_type());
  return p->contiguous();
}

std::vector<at::Tensor> fwd(const at::Tensor& x_in, const at::Tensor& shift, const at::Tensor& scale,
                            const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                            double eps) {
  TORCH_CHECK(x_in.dim() == 3, "adaln: x must be (B, N, D), got shape ", x_in.sizes());
  const at::Tensor x = x_in.contiguous();  // copies only for a row-strided x
  check_rows(x, "x");
  check_modulation(shift, x, "shift");
  check_modulation(scale, x, "scale");
  TORCH_CHECK(shift.sizes() == scale.sizes() && shift.scalar_type() == scale.scalar_type(), "adaln: shift ",
              shift.sizes(), " ", shift.scalar_type(), " and scale ", scale.sizes(), " ", scale.scalar_type(),
              " must match in shape and dtype");
  TORCH_CHECK(eps > 0, "adaln: eps must be > 0, got ", eps);
  return adaln_fwd_cuda(x, shift, scale, check_param(weight, x, "weight"), check_param(bias, x, "bias"), eps);
}

std::vector<at::Tensor> bwd(const at::Tensor& dy_in, const at::Tensor& x_in, const at::Tensor& scale,
                            const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                            const at::Tensor& mean, const at::Tensor& rstd) {
  const at::Tensor x = x_in.contiguous();
  const at::Tensor dy = dy_in.contiguous();
  check_rows(x, "x");
  check_rows(dy, "dy");
  TORCH_CHECK(dy.sizes() == x.sizes() && dy.scalar_type() == x.scalar_type(), "adaln: dy ", dy.sizes(), " ",
              dy.scalar_type(), " must match x ", x.sizes(), " ", x.scalar_type());
  check_modulation(scale, x, "scale");
  for (const auto& [stat, name] : {std::pair<const at::Tensor&, const char*>{mean, "mean"}, {rstd, "rstd"}}) {
    TORCH_CHECK(stat.device() == x.device() && stat.scalar_type() == at::kFloat && stat.is_contiguous() &&
                    stat.dim() == 2 && stat.size(0) == x.size(0) && stat.size(1) == x.size(1),
                "adaln: ", name, " must be contiguous fp32 (B, N) on x's device, got ", stat.sizes(), " ",
                stat.scalar_type());
  }
  return adaln_bwd_cuda(dy, x, scale, check_param(weight, x, "weight"), check_param(bias, x, "bias"), mean, rstd);
}

}  // namespace
}  // namespace adaptiveload

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Fused AdaLN (LayerNorm + modulate) CUDA kernels of lightning-adaptiveload";
  m.def("adaln_fwd", &adaptiveload::fwd, "AdaLN forward -> [y, mean, rstd]", py::arg("x"), py::arg("shift"),
        py::arg("scale"), py::arg("weight"), py::arg("bias"), py::arg("eps"));
  m.def("adaln_bwd", &adaptiveload::bwd, "AdaLN backward -> [dx, dshift, dscale, dweight, dbias]", py::arg("dy"),
        py::arg("x"), py::arg("scale"), py::arg("weight"), py::arg("bias"), py::arg("mean"), py::arg("rstd"));
}

// Python bindings of the fused normalization/dropout CUDA kernels (implemented in norm_cuda.cu). The functions have the
// same names, signatures and semantics as the CPU functions in norm_cpu.cpp.
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <vector>

namespace dmfx {

std::vector<at::Tensor> norm_fwd_cuda(const at::Tensor& x, const c10::optional<at::Tensor>& bias,
                                      const c10::optional<at::Tensor>& residual,
                                      const c10::optional<at::Tensor>& weight,
                                      const c10::optional<at::Tensor>& norm_bias, int64_t seed,
                                      int64_t offset, double p, double eps, bool rms,
                                      bool return_sum);

std::vector<at::Tensor> norm_bwd_cuda(const at::Tensor& grad_out,
                                      const c10::optional<at::Tensor>& grad_sum, const at::Tensor& x,
                                      const c10::optional<at::Tensor>& bias,
                                      const c10::optional<at::Tensor>& residual,
                                      const c10::optional<at::Tensor>& weight,
                                      const c10::optional<at::Tensor>& mean, const at::Tensor& rstd,
                                      int64_t seed, int64_t offset, double p, bool rms,
                                      std::vector<bool> output_mask,
                                      const c10::optional<at::Tensor>& grad_out2);

at::Tensor dropout_cuda(const at::Tensor& x, int64_t seed, int64_t offset, double p);

void bind_norm(pybind11::module_& m) {
  m.def("norm_fwd", &norm_fwd_cuda, "fused bias+dropout+residual+LayerNorm/RMSNorm forward (CUDA)");
  m.def("norm_bwd", &norm_bwd_cuda, "fused bias+dropout+residual+LayerNorm/RMSNorm backward (CUDA)");
  m.def("dropout", &dropout_cuda, "Philox inverted dropout (CUDA); also its own backward");
}

}  // namespace dmfx

#ifndef DMFX_KERNELS_ONLY
// The ops' CUDA kernels (their autograd formulas are the CPU module's: build.py loads it first).
#include "norm_ops.h"

namespace dmfx {
namespace norm_ops {
namespace {
struct CudaNorm {
  template <class... A>
  static std::vector<at::Tensor> norm_fwd(A&&... a) { return norm_fwd_cuda(std::forward<A>(a)...); }
  template <class... A>
  static std::vector<at::Tensor> norm_bwd(A&&... a) { return norm_bwd_cuda(std::forward<A>(a)...); }
  template <class... A>
  static at::Tensor dropout(A&&... a) { return dropout_cuda(std::forward<A>(a)...); }
};
}  // namespace
}  // namespace norm_ops
}  // namespace dmfx

TORCH_LIBRARY_IMPL(dmfx, CUDA, m) { dmfx::norm_ops::register_kernels<dmfx::norm_ops::CudaNorm>(m); }
#endif  // DMFX_KERNELS_ONLY

// Python bindings of dmfx's CUDA kernels (implemented in cuda_kernels.cu). The functions have the
// same names, signatures and semantics as the CPU module in cpu_kernels.cpp.
#include <torch/extension.h>

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
                                      std::vector<bool> output_mask);

at::Tensor dropout_cuda(const at::Tensor& x, int64_t seed, int64_t offset, double p);

}  // namespace dmfx

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("norm_fwd", &dmfx::norm_fwd_cuda, "fused bias+dropout+residual+LayerNorm/RMSNorm forward (CUDA)");
  m.def("norm_bwd", &dmfx::norm_bwd_cuda, "fused bias+dropout+residual+LayerNorm/RMSNorm backward (CUDA)");
  m.def("dropout", &dmfx::dropout_cuda, "Philox inverted dropout (CUDA); also its own backward");
}

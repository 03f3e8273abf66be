// Python bindings of the fused attention softmax CUDA kernels (implemented in softmax_cuda.cu). The
// functions have the same names, signatures and semantics as the CPU functions in softmax_cpu.cpp.
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <vector>

namespace dmfx {

std::vector<at::Tensor> softmax_fwd_cuda(const at::Tensor& scores, const c10::optional<at::Tensor>& mask,
                                         double scale, bool causal, int64_t seed, int64_t offset, double p);

at::Tensor softmax_bwd_cuda(const at::Tensor& grad_out, const at::Tensor& probs, int64_t seed,
                            int64_t offset, double p, double scale, const c10::optional<at::Tensor>& mask,
                            double mask_scale);

void bind_softmax(pybind11::module_& m) {
  m.def("softmax_fwd", &softmax_fwd_cuda,
        "fused scale + mask + causal + softmax + dropout forward (CUDA); returns [out, probs]",
        pybind11::arg("scores"), pybind11::arg("mask"), pybind11::arg("scale"),
        pybind11::arg("causal"), pybind11::arg("seed"), pybind11::arg("offset"), pybind11::arg("p"));
  m.def("softmax_bwd", &softmax_bwd_cuda,
        "fused dropout + softmax backward, times scale (CUDA); a stored bool mask (native_dropout's) "
        "replaces the Philox one",
        pybind11::arg("grad_out"), pybind11::arg("probs"), pybind11::arg("seed"),
        pybind11::arg("offset"), pybind11::arg("p"), pybind11::arg("scale"),
        pybind11::arg("mask") = pybind11::none(), pybind11::arg("mask_scale") = 1.0);
}

}  // namespace dmfx

#ifndef DMFX_KERNELS_ONLY
// The ops' CUDA kernels (their autograd formula is the CPU module's: build.py loads it first).
#include "softmax_ops.h"

namespace dmfx {
namespace softmax_ops {
namespace {
struct CudaSoftmax {
  template <class... A>
  static std::vector<at::Tensor> softmax_fwd(A&&... a) { return softmax_fwd_cuda(std::forward<A>(a)...); }
  template <class... A>
  static at::Tensor softmax_bwd(A&&... a) { return softmax_bwd_cuda(std::forward<A>(a)...); }
};
}  // namespace
}  // namespace softmax_ops
}  // namespace dmfx

TORCH_LIBRARY_IMPL(dmfx, CUDA, m) { dmfx::softmax_ops::register_kernels<dmfx::softmax_ops::CudaSoftmax>(m); }
#endif  // DMFX_KERNELS_ONLY

// Python bindings of the fused cross-entropy CUDA kernels (implemented in cross_entropy_cuda.cu). The
// functions have the same names, signatures and semantics as the CPU functions in cross_entropy_cpu.cpp
// (except a target out of range: NaN here, IndexError there).
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <vector>

namespace dmfx {

std::vector<at::Tensor> cross_entropy_fwd_cuda(const at::Tensor& logits, const at::Tensor& target,
                                               int64_t ignore_index, double label_smoothing, int64_t reduction);

at::Tensor cross_entropy_bwd_cuda(const at::Tensor& grad_loss, const at::Tensor& logits, const at::Tensor& target,
                                  const at::Tensor& lse, int64_t ignore_index, double label_smoothing,
                                  int64_t reduction, const c10::optional<at::Tensor>& grad_logits, double softcap);

void bind_cross_entropy(pybind11::module_& m) {
  m.def("cross_entropy_fwd", &cross_entropy_fwd_cuda,
        "fused log_softmax + nll_loss forward (CUDA); returns [loss, lse]", pybind11::arg("logits"),
        pybind11::arg("target"), pybind11::arg("ignore_index"), pybind11::arg("label_smoothing"),
        pybind11::arg("reduction"));
  m.def("cross_entropy_bwd", &cross_entropy_bwd_cuda,
        "fused cross-entropy backward (CUDA): dlogits, plus grad_logits when given (times the soft cap's derivative "
        "when softcap > 0: the raw logits' gradient)", pybind11::arg("grad_loss"),
        pybind11::arg("logits"), pybind11::arg("target"), pybind11::arg("lse"), pybind11::arg("ignore_index"),
        pybind11::arg("label_smoothing"), pybind11::arg("reduction"), pybind11::arg("grad_logits") = pybind11::none(),
        pybind11::arg("softcap") = 0.0);
}

}  // namespace dmfx

#ifndef DMFX_KERNELS_ONLY
// The ops' CUDA kernels (their autograd formula is the CPU module's: build.py loads it first).
#include "cross_entropy_ops.h"

namespace dmfx {
namespace cross_entropy_ops {
namespace {
struct CudaCe {
  template <class... A>
  static std::vector<at::Tensor> cross_entropy_fwd(A&&... a) { return cross_entropy_fwd_cuda(std::forward<A>(a)...); }
  template <class... A>
  static at::Tensor cross_entropy_bwd(A&&... a) { return cross_entropy_bwd_cuda(std::forward<A>(a)...); }
};
}  // namespace
}  // namespace cross_entropy_ops
}  // namespace dmfx

TORCH_LIBRARY_IMPL(dmfx, CUDA, m) {
  dmfx::cross_entropy_ops::register_kernels<dmfx::cross_entropy_ops::CudaCe>(m);
}
#endif  // DMFX_KERNELS_ONLY

// Python bindings of the pointwise-family CUDA kernels (implemented in pointwise_cuda.cu), and the
// registration of the family's ops' CUDA kernels. The functions have the same names, signatures and
// semantics as the CPU functions in pointwise_cpu.cpp.
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <vector>

namespace dmfx {

at::Tensor bias_act_fwd_cuda(const at::Tensor& x, const c10::optional<at::Tensor>& bias, int64_t act,
                             int64_t seed, int64_t offset, double p);

std::vector<at::Tensor> bias_act_bwd_cuda(const at::Tensor& grad_out, const at::Tensor& x,
                                          const c10::optional<at::Tensor>& bias, int64_t act,
                                          int64_t seed, int64_t offset, double p,
                                          std::vector<bool> output_mask,
                                          const c10::optional<at::Tensor>& mask, double mask_scale);

at::Tensor glu_fwd_cuda(const at::Tensor& gate, const at::Tensor& up, int64_t act);

std::vector<at::Tensor> glu_bwd_cuda(const at::Tensor& grad_out, const at::Tensor& gate,
                                     const at::Tensor& up, int64_t act, std::vector<bool> output_mask);

std::vector<at::Tensor> rope_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                  const at::Tensor& sin, bool inverse, bool interleaved, bool deinterleave);

at::Tensor softcap_fwd_cuda(const at::Tensor& x, double cap);

at::Tensor softcap_bwd_cuda(const at::Tensor& grad_out, const at::Tensor& out, double cap);

void bind_pointwise(pybind11::module_& m) {
  m.def("bias_act_fwd", &bias_act_fwd_cuda, "fused bias + activation + dropout forward (CUDA)");
  m.def("bias_act_bwd", &bias_act_bwd_cuda,
        "fused bias + activation + dropout backward with the bias gradient (CUDA); a stored bool mask "
        "(native_dropout's) replaces the Philox one",
        pybind11::arg("grad_out"), pybind11::arg("x"), pybind11::arg("bias"), pybind11::arg("act"),
        pybind11::arg("seed"), pybind11::arg("offset"), pybind11::arg("p"), pybind11::arg("output_mask"),
        pybind11::arg("mask") = pybind11::none(), pybind11::arg("mask_scale") = 1.0);
  m.def("glu_fwd", &glu_fwd_cuda, "gated activation act(gate) * up (CUDA)");
  m.def("glu_bwd", &glu_bwd_cuda, "gated activation backward [dgate, dup] (CUDA)");
  m.def("rope", &rope_cuda, "rotary position embedding of q and k (pairs (j, j + D/2), (2j, 2j + 1) interleaved, or "
        "(2j, 2j + 1) in and (j, j + D/2) out with deinterleave); inverse=True is its backward (CUDA)",
        pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("cos"), pybind11::arg("sin"), pybind11::arg("inverse"),
        pybind11::arg("interleaved") = false, pybind11::arg("deinterleave") = false);
  m.def("softcap_fwd", &softcap_fwd_cuda, "soft cap cap * tanh(x / cap) (CUDA)", pybind11::arg("x"), pybind11::arg("cap"));
  m.def("softcap_bwd", &softcap_bwd_cuda, "soft cap backward grad_out * (1 - (out / cap)^2), from the output (CUDA)",
        pybind11::arg("grad_out"), pybind11::arg("out"), pybind11::arg("cap"));
}

}  // namespace dmfx

#ifndef DMFX_KERNELS_ONLY
// The ops' CUDA kernels (their autograd formulas are the CPU module's: build.py loads it first).
#include "pointwise_ops.h"

namespace dmfx {
namespace pointwise_ops {
namespace {
struct CudaPointwise {
  template <class... A>
  static at::Tensor bias_act_fwd(A&&... a) { return bias_act_fwd_cuda(std::forward<A>(a)...); }
  template <class... A>
  static std::vector<at::Tensor> bias_act_bwd(A&&... a) { return bias_act_bwd_cuda(std::forward<A>(a)...); }
  template <class... A>
  static at::Tensor glu_fwd(A&&... a) { return glu_fwd_cuda(std::forward<A>(a)...); }
  template <class... A>
  static std::vector<at::Tensor> glu_bwd(A&&... a) { return glu_bwd_cuda(std::forward<A>(a)...); }
  template <class... A>
  static std::vector<at::Tensor> rope(A&&... a) { return rope_cuda(std::forward<A>(a)...); }
  template <class... A>
  static at::Tensor softcap_fwd(A&&... a) { return softcap_fwd_cuda(std::forward<A>(a)...); }
  template <class... A>
  static at::Tensor softcap_bwd(A&&... a) { return softcap_bwd_cuda(std::forward<A>(a)...); }
};
}  // namespace
}  // namespace pointwise_ops
}  // namespace dmfx

TORCH_LIBRARY_IMPL(dmfx, CUDA, m) { dmfx::pointwise_ops::register_kernels<dmfx::pointwise_ops::CudaPointwise>(m); }
#endif  // DMFX_KERNELS_ONLY

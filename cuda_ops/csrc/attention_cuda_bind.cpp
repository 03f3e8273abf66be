// Python bindings of the fused ("flash") and varlen attention CUDA kernels (implemented in attention_cuda.cu). The
// functions have the same names, arguments and semantics as the CPU functions in attention_cpu.cpp
// (flash_use_blas, a switch of the CPU kernels' GEMMs, has no CUDA twin); stats are float32.
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

namespace dmfx {

at::Tensor flash_fwd_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const c10::optional<at::Tensor>& mask, double scale, bool causal, int64_t seed,
                          int64_t offset, double p, at::Tensor out, double softcap);

void flash_bwd_cuda(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& stats, const c10::optional<at::Tensor>& mask, double scale, bool causal,
                    int64_t seed, int64_t offset, double p, at::Tensor dq, at::Tensor dk, at::Tensor dv,
                    const c10::optional<at::Tensor>& bias_part, double softcap);

bool flash_supported_cuda(const at::Tensor& q, const at::Tensor& v);

at::Tensor varlen_fwd_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens,
                           double scale, bool causal, int64_t seed, int64_t offset, double p, at::Tensor out);

void varlen_bwd_cuda(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const at::Tensor& out, const at::Tensor& stats, const at::Tensor& cu_seqlens, double scale,
                     bool causal, int64_t seed, int64_t offset, double p, at::Tensor dq, at::Tensor dk, at::Tensor dv);

void bind_attention(pybind11::module_& m) {
  m.def("flash_fwd", &flash_fwd_cuda,
        "fused attention forward, scores kept on chip (CUDA); writes out, returns the row statistics",
        pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("mask"), pybind11::arg("scale"),
        pybind11::arg("causal"), pybind11::arg("seed"), pybind11::arg("offset"), pybind11::arg("p"),
        pybind11::arg("out"), pybind11::arg("softcap") = 0.0);
  m.def("flash_bwd", &flash_bwd_cuda, "fused attention backward (CUDA); writes dq, dk and dv in place",
        pybind11::arg("grad_out"), pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("stats"),
        pybind11::arg("mask"), pybind11::arg("scale"), pybind11::arg("causal"), pybind11::arg("seed"),
        pybind11::arg("offset"), pybind11::arg("p"), pybind11::arg("dq"), pybind11::arg("dk"), pybind11::arg("dv"),
        pybind11::arg("bias_part") = pybind11::none(), pybind11::arg("softcap") = 0.0);
  m.def("varlen_fwd", &varlen_fwd_cuda,
        "fused attention over packed variable-length sequences (CUDA); writes out [T, Hq, Dv], returns the row "
        "statistics [2, Hq, T]",
        pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("cu_seqlens"), pybind11::arg("scale"),
        pybind11::arg("causal"), pybind11::arg("seed"), pybind11::arg("offset"), pybind11::arg("p"),
        pybind11::arg("out"));
  m.def("varlen_bwd", &varlen_bwd_cuda,
        "fused attention backward over packed variable-length sequences (CUDA); writes dq, dk and dv in place",
        pybind11::arg("grad_out"), pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("out"),
        pybind11::arg("stats"), pybind11::arg("cu_seqlens"), pybind11::arg("scale"), pybind11::arg("causal"),
        pybind11::arg("seed"), pybind11::arg("offset"), pybind11::arg("p"), pybind11::arg("dq"), pybind11::arg("dk"),
        pybind11::arg("dv"));
}

}  // namespace dmfx

#ifndef DMFX_KERNELS_ONLY
// The ops' CUDA kernels (their autograd formulas are the CPU module's: build.py loads it first).
#include "attention_ops.h"

namespace dmfx {
namespace attention_ops {
namespace {
struct CudaAttention {
  static bool flash_ok(const at::Tensor& q, const at::Tensor& v) { return flash_supported_cuda(q, v); }
  template <class... A>
  static at::Tensor flash_fwd(A&&... a) { return flash_fwd_cuda(std::forward<A>(a)...); }
  template <class... A>
  static void flash_bwd(A&&... a) { flash_bwd_cuda(std::forward<A>(a)...); }
  // The varlen kernels: as the flash kernels (float32, float16, bfloat16, head dims up to 128), in q's dtype.
  static bool varlen_ok(const at::Tensor& q, const at::Tensor& v) { return flash_supported_cuda(q, v); }
  static at::ScalarType varlen_dtype(at::ScalarType st) { return st; }
  template <class... A>
  static at::Tensor varlen_fwd(A&&... a) { return varlen_fwd_cuda(std::forward<A>(a)...); }
  template <class... A>
  static void varlen_bwd(A&&... a) { varlen_bwd_cuda(std::forward<A>(a)...); }
};
}  // namespace
}  // namespace attention_ops
}  // namespace dmfx

TORCH_LIBRARY_IMPL(dmfx, CUDA, m) { dmfx::attention_ops::register_kernels<dmfx::attention_ops::CudaAttention>(m); }
#endif  // DMFX_KERNELS_ONLY

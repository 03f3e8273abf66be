// The Python module of dmfx's CUDA kernels, and the one translation unit of every family's glue
// (cuda_ops/build.py). The module is six units, compiled in parallel (torch.utils.cpp_extension.load,
// ninja): each family's kernels, <family>_cuda.cu (nvcc; self-contained: device code families share
// lives in headers, softmax_device.cuh), and this file, which includes each family's binding,
// <family>_cuda_bind.cpp: dmfx::bind_<family>(m), which adds the family's kernel functions to the module,
// and its TORCH_LIBRARY_IMPL(dmfx, CUDA, m) registrations. Family internals live in named namespaces
// (dmfx::<family>_impl, dmfx::<family>_ops) so the files never collide.
//
// Why one glue unit, as in the CPU module (cpu_bindings.cpp): each binding parses torch's heaviest
// headers (pybind11 and torch's Python glue, torch/library.h: 23-27 s a unit on these machines), so
// five binding units cost four parses more than one. Why -O1: this is host code that calls into
// libtorch, where -O1 costs a call nothing measurable (bench/host_overhead) and compiles faster.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("O1")
#pragma GCC diagnostic ignored "-Wstringop-overflow"  // (gcc 12 at -O1 on a copied std::vector<bool>: cpu_bindings.cpp)
#endif

#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include "norm_cuda_bind.cpp"
#include "softmax_cuda_bind.cpp"
#include "pointwise_cuda_bind.cpp"
#include "attention_cuda_bind.cpp"
#include "cross_entropy_cuda_bind.cpp"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  dmfx::bind_norm(m);
  dmfx::bind_softmax(m);
  dmfx::bind_pointwise(m);
  dmfx::bind_attention(m);
  dmfx::bind_cross_entropy(m);
}

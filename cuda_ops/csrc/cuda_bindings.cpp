// The Python module of dmfx's CUDA kernels. build.py compiles every source of the CUDA module on its
// own (torch.utils.cpp_extension.load, ninja, in parallel): each family's kernels (<family>_cuda.cu,
// nvcc; self-contained: device code they share lives in headers, softmax_device.cuh), each family's
// binding (<family>_cuda_bind.cpp: its TORCH_LIBRARY_IMPL(dmfx, CUDA, m) registrations and
// dmfx::bind_<family>(m), which adds its functions to the module) and this file, the module's entry
// point. Family internals live in named namespaces (dmfx::<family>_impl) so the files never collide.
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

namespace dmfx {
void bind_norm(pybind11::module_& m);
void bind_softmax(pybind11::module_& m);
void bind_pointwise(pybind11::module_& m);
void bind_attention(pybind11::module_& m);
void bind_cross_entropy(pybind11::module_& m);
}  // namespace dmfx

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  dmfx::bind_norm(m);
  dmfx::bind_softmax(m);
  dmfx::bind_pointwise(m);
  dmfx::bind_attention(m);
  dmfx::bind_cross_entropy(m);
}

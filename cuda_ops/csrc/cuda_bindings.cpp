// The Python module of dmfx's CUDA kernels. load_inline concatenates the binding sources listed in
// build.py (norm_cuda_bind.cpp, softmax_cuda_bind.cpp, pointwise_cuda_bind.cpp, attention_cuda_bind.cpp,
// cross_entropy_cuda_bind.cpp, then this file) into one C++ translation unit, and the *_cuda.cu kernel
// files into one CUDA unit (each .cu is self-contained: device code they share lives in headers,
// softmax_device.cuh); each family file defines dmfx::bind_<family>(m), which adds its functions to the module.
// Family internals live in named namespaces (dmfx::<family>_impl) so the files never collide.
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

// The Python module of dmfx's CPU kernels. load_inline concatenates the family sources listed in
// build.py (norm_cpu.cpp, softmax_cpu.cpp, pointwise_cpu.cpp, then this file) into one translation
// unit; each family file defines dmfx::bind_<family>(m), which adds its functions to the module.
// Family internals live in named namespaces (dmfx::<family>_impl) so the files never collide.
#include <torch/extension.h>

namespace dmfx {
void bind_norm(pybind11::module_& m);
void bind_softmax(pybind11::module_& m);
void bind_pointwise(pybind11::module_& m);
void bind_attention(pybind11::module_& m);
}  // namespace dmfx

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  dmfx::bind_norm(m);
  dmfx::bind_softmax(m);
  dmfx::bind_pointwise(m);
  dmfx::bind_attention(m);
}

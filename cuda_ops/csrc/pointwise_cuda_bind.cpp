// Python bindings of the dmfx CUDA kernels of the pointwise family (placeholder: filled in by the pointwise work).
#include <torch/extension.h>

namespace dmfx {
void bind_pointwise(pybind11::module_& m) { (void)m; }
}  // namespace dmfx

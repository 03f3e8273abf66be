// dmfx CPU kernels of the softmax family (placeholder: filled in by the softmax work).
#include <torch/extension.h>

namespace dmfx {
void bind_softmax(pybind11::module_& m) { (void)m; }
}  // namespace dmfx

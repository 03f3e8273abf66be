// dmfx CUDA kernels of the pointwise family (placeholder: filled in by the pointwise work).
#include <torch/extension.h>

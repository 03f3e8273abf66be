// dmfx CUDA kernels of the softmax family (placeholder: filled in by the softmax work).
#include <torch/extension.h>

// The cross_entropy family's ops (schemas in cuda_ops/cross_entropy.py) on top of its kernels, for any
// device: K is the device's kernel set (static cross_entropy_fwd, cross_entropy_bwd with the signatures
// of cross_entropy_cpu.cpp's functions). cross_entropy_cpu.cpp registers these with the CPU kernels (and
// the family's autograd formula), cross_entropy_cuda_bind.cpp with the CUDA ones. Every argument check
// is the kernels' (cross_entropy_api.h).
#pragma once
#include <ATen/ATen.h>
#include <torch/library.h>

#include <tuple>

#include "op_api.h"

namespace dmfx {
namespace cross_entropy_ops {

using at::Tensor;
using Opt = c10::optional<at::Tensor>;

template <class K>
std::tuple<Tensor, Tensor> cross_entropy(const Tensor& logits, const Tensor& target, int64_t ignore_index,
                                         double label_smoothing, int64_t reduction) {
  auto r = K::cross_entropy_fwd(logits, target, ignore_index, label_smoothing, reduction);
  return {std::move(r[0]), std::move(r[1])};
}

using CrossEntropyBackwardSig = Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, int64_t, double,
                                       int64_t, const Opt&, double);

template <class K>
Tensor cross_entropy_backward(const Tensor& grad_loss, const Tensor& logits, const Tensor& target, const Tensor& lse,
                              int64_t ignore_index, double label_smoothing, int64_t reduction, const Opt& grad_logits,
                              double softcap) {
  return K::cross_entropy_bwd(grad_loss, logits, target, lse, ignore_index, label_smoothing, reduction, grad_logits,
                              softcap);
}

template <class K>
void register_kernels(torch::Library& m) {
  m.impl("cross_entropy", &cross_entropy<K>);
  m.impl("cross_entropy_backward", &cross_entropy_backward<K>);
}

}  // namespace cross_entropy_ops
}  // namespace dmfx

// The softmax family's ops (schemas in cuda_ops/softmax.py) on top of its kernels, for any device: K is
// the device's kernel set (static softmax_fwd, softmax_bwd with the signatures of softmax_cpu.cpp's
// functions). softmax_cpu.cpp registers these with the CPU kernels (and the family's autograd
// formula), softmax_cuda_bind.cpp with the CUDA ones. The op-level argument checks are op_api.h's
// (ValueError / TypeError, as the Python kernels raised them); the kernels check again (softmax_api.h).
#pragma once
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <tuple>

#include "op_api.h"

namespace dmfx {
namespace softmax_ops {

using at::Tensor;
using Opt = c10::optional<at::Tensor>;

using SoftmaxBackwardSig = Tensor(const Tensor&, const Tensor&, const Opt&, double, double, const Opt&, double);

template <class K>
std::tuple<Tensor, Tensor> attention_softmax(const Tensor& scores, const Opt& mask, double scale, bool causal,
                                             const Opt& seed, double p) {
  const char* op = "attention_softmax";
  TORCH_CHECK_TYPE(is_score_dtype(scores.scalar_type()), "dmfx::", op,
                   ": scores must be float32, float16, bfloat16 or float64, got ", scores.scalar_type());
  check_score_args(op, scores.sizes(), scores.device(), mask, causal, seed, p);
  const auto [s, o] = seed_values(op, seed);
  auto r = K::softmax_fwd(scores, kernel_mask(mask, scores.scalar_type()), scale, causal, s, o, p);
  return {std::move(r[0]), std::move(r[1])};
}

template <class K>
Tensor attention_softmax_backward(const Tensor& grad_out, const Tensor& probs, const Opt& seed, double p, double scale,
                                  const Opt& mask, double mask_scale) {
  const char* op = "attention_softmax_backward";
  check_dropout(op, p, seed);
  check_stored_mask_arg(op, mask, "probs", probs, p);
  const auto [s, o] = seed_values(op, seed);
  return K::softmax_bwd(grad_out, probs, s, o, p, scale, mask, mask_scale);
}

template <class K>
void register_kernels(torch::Library& m) {
  m.impl("attention_softmax", &attention_softmax<K>);
  m.impl("attention_softmax_backward", &attention_softmax_backward<K>);
}

}  // namespace softmax_ops
}  // namespace dmfx

// The norm family's ops (schemas in cuda_ops/norm.py) on top of its kernels, for any device: K is the
// device's kernel set (static norm_fwd, norm_bwd, dropout with the signatures of norm_cpu.cpp's
// functions). norm_cpu.cpp registers these with the CPU kernels (and the family's autograd formulas),
// norm_cuda_bind.cpp with the CUDA ones. Every argument check is the kernels' (kernel_api.h) or below.
#pragma once
#include <ATen/ATen.h>
#include <torch/library.h>

#include <array>
#include <tuple>

#include "op_api.h"

namespace dmfx {
namespace norm_ops {

using at::Tensor;
using Opt = c10::optional<at::Tensor>;

template <class K>
std::tuple<Tensor, Tensor, Tensor> layer_norm(const Tensor& x, const Opt& weight, const Opt& bias, double eps) {
  auto r = K::norm_fwd(x, c10::nullopt, c10::nullopt, weight, bias, 0, 0, 0.0, eps, false, false);
  return {std::move(r[0]), std::move(r[2]), std::move(r[3])};
}

template <class K>
std::tuple<Tensor, Tensor> rms_norm(const Tensor& x, const Opt& weight, double eps) {
  auto r = K::norm_fwd(x, c10::nullopt, c10::nullopt, weight, c10::nullopt, 0, 0, 0.0, eps, true, false);
  return {std::move(r[0]), std::move(r[3])};
}

template <class K>
std::tuple<Tensor, Tensor, Tensor, Tensor> bias_dropout_residual_norm(const Tensor& x, const Opt& bias,
                                                                      const Opt& residual, const Opt& weight,
                                                                      const Opt& norm_bias, const Opt& seed, double p,
                                                                      double eps, bool rms, bool return_sum) {
  const char* op = "bias_dropout_residual_norm";
  check_dropout(op, p, seed);
  const auto [s, o] = seed_values(op, seed);
  auto r = K::norm_fwd(x, bias, residual, weight, norm_bias, s, o, p, eps, rms, return_sum);
  return {std::move(r[0]), std::move(r[1]), std::move(r[2]), std::move(r[3])};
}

using NormBackwardSig = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>(
    const Tensor&, const Opt&, const Tensor&, const Opt&, const Opt&, const Opt&, const Opt&, const Tensor&, const Opt&,
    double, bool, c10::List<bool>, const Opt&);

template <class K>
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> norm_backward(
    const Tensor& grad_out, const Opt& grad_sum, const Tensor& x, const Opt& bias, const Opt& residual,
    const Opt& weight, const Opt& mean, const Tensor& rstd, const Opt& seed, double p, bool rms,
    c10::List<bool> output_mask, const Opt& grad_out2) {
  const char* op = "norm_backward";
  check_dropout(op, p, seed);
  const auto [s, o] = seed_values(op, seed);
  auto r = K::norm_bwd(grad_out, grad_sum, x, bias, residual, weight, mean, rstd, s, o, p, rms,
                       bool_vector(output_mask), grad_out2);
  return {std::move(r[0]), std::move(r[1]), std::move(r[2]), std::move(r[3]), std::move(r[4])};
}

template <class K>
Tensor dropout(const Tensor& x, const Tensor& seed, double p) {
  const auto [s, o] = seed_values("dropout", seed);
  return K::dropout(x, s, o, p);
}

template <class K>
void register_kernels(torch::Library& m) {
  m.impl("layer_norm", &layer_norm<K>);
  m.impl("rms_norm", &rms_norm<K>);
  m.impl("bias_dropout_residual_norm", &bias_dropout_residual_norm<K>);
  m.impl("norm_backward", &norm_backward<K>);
  m.impl("dropout", &dropout<K>);
}

}  // namespace norm_ops
}  // namespace dmfx

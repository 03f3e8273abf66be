// The pointwise family's ops (schemas in cuda_ops/pointwise.py) on top of its kernels, for any device:
// K is the device's kernel set (static bias_act_fwd, bias_act_bwd, glu_fwd, glu_bwd, rope, softcap_fwd,
// softcap_bwd with the signatures of pointwise_cpu.cpp's functions). pointwise_cpu.cpp registers these
// with the CPU kernels (and the family's autograd formulas), pointwise_cuda_bind.cpp with the CUDA ones.
// The ops check what the kernels cannot (the activation's name, the dropout seed, a stored mask:
// ValueError); every other argument check is the kernels' (pointwise_api.h, kernel_api.h).
#pragma once
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <numeric>
#include <tuple>
#include <vector>

#include "op_api.h"
#include "pointwise_api.h"

namespace dmfx {
namespace pointwise_ops {

using at::Tensor;
using Opt = c10::optional<at::Tensor>;
using pointwise_impl::act_code;

template <class K>
Tensor bias_act_dropout(const Tensor& x, const Opt& bias, c10::string_view act, const Opt& seed, double p) {
  const char* op = "bias_act_dropout";
  const int64_t code = act_code(op, act);
  check_dropout(op, p, seed);
  const auto [s, o] = seed_values(op, seed);
  return K::bias_act_fwd(x, bias, code, s, o, p);
}

template <class K>
std::tuple<Tensor, Tensor> bias_act_dropout_backward(const Tensor& grad_out, const Tensor& x, const Opt& bias,
                                                     c10::string_view act, const Opt& seed, double p,
                                                     c10::List<bool> output_mask, const Opt& mask,
                                                     double mask_scale) {
  const char* op = "bias_act_dropout_backward";
  const int64_t code = act_code(op, act);
  check_dropout(op, p, seed);
  const std::vector<bool> outputs = bool_vector(output_mask);
  pointwise_impl::check_mask(op, outputs, "[dx, dbias]");
  check_stored_mask_arg(op, mask, "x", x, p);
  const auto [s, o] = seed_values(op, seed);
  auto r = K::bias_act_bwd(grad_out, x, bias, code, s, o, p, outputs, mask, mask_scale);
  return {std::move(r[0]), std::move(r[1])};
}

template <class K>
Tensor glu(const Tensor& gate, const Tensor& up, c10::string_view act) {
  return K::glu_fwd(gate, up, act_code("glu", act));
}

template <class K>
std::tuple<Tensor, Tensor> glu_backward(const Tensor& grad_out, const Tensor& gate, const Tensor& up,
                                        c10::string_view act, c10::List<bool> output_mask) {
  const char* op = "glu_backward";
  const int64_t code = act_code(op, act);
  const std::vector<bool> outputs = bool_vector(output_mask);
  pointwise_impl::check_mask(op, outputs, "[dgate, dup]");
  auto r = K::glu_bwd(grad_out, gate, up, code, outputs);
  return {std::move(r[0]), std::move(r[1])};
}

// cap * tanh(x / cap); the kernels check x and cap (errors naming dmfx::softcap).
template <class K>
Tensor softcap(const Tensor& x, double cap) {
  return K::softcap_fwd(x, cap);
}

// grad_out * (1 - (out / cap)^2), out softcap's output; the kernels check the arguments (naming
// dmfx::softcap_backward).
template <class K>
Tensor softcap_backward(const Tensor& grad_out, const Tensor& out, double cap) {
  return K::softcap_bwd(grad_out, out, cap);
}

// The permutation that makes `t` contiguous when `t` is a permuted dense tensor with the last dim
// innermost (HF's q/k after view + transpose(1, 2)); empty when it is contiguous or not dense.
// (cuda_ops/pointwise.py's rope fake computes the same layout for the outputs it describes.)
inline std::vector<int64_t> memory_order(const Tensor& t) {
  if (t.dim() < 2 || t.is_contiguous()) return {};
  std::vector<int64_t> order(t.dim() - 1);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return t.stride(a) > t.stride(b); });
  order.push_back(t.dim() - 1);
  return t.permute(order).is_contiguous() ? order : std::vector<int64_t>{};
}

// Outputs keep q's and k's memory order (as eager's element-wise ops do) when both share one,
// grouped-query k with fewer heads included (cos and sin are permuted alike and broadcast to each).
// Otherwise the backward of a [B, L, H, D]-laid-out attention would copy dq and dk back.
inline std::vector<int64_t> rope_layout(const Tensor& q, const Tensor& k) {
  if (q.dim() != k.dim()) return {};
  auto order = memory_order(q);
  return !order.empty() && memory_order(k) == order ? order : std::vector<int64_t>{};
}

// `t` (cos / sin, of rank <= rank) with leading 1-dims up to `rank`, permuted by `order`.
inline Tensor permuted(const Tensor& t, const std::vector<int64_t>& order, int64_t rank) {
  if (t.dim() > rank) return t;
  std::vector<int64_t> shape(rank - t.dim(), 1);
  shape.insert(shape.end(), t.sizes().begin(), t.sizes().end());
  return t.reshape(shape).permute(order);
}

template <class K>
std::tuple<Tensor, Tensor> rope(const Tensor& q, const Tensor& k, const Tensor& cos, const Tensor& sin, bool inverse,
                                bool interleaved, bool deinterleave) {
  const auto order = rope_layout(q, k);
  if (order.empty()) {
    auto r = K::rope(q, k, cos, sin, inverse, interleaved, deinterleave);
    return {std::move(r[0]), std::move(r[1])};
  }
  // run on the memory-order views (contiguous outputs there), hand back the logical views
  std::vector<int64_t> back(order.size());
  for (size_t i = 0; i < order.size(); ++i) back[order[i]] = static_cast<int64_t>(i);
  const int64_t rank = q.dim();
  auto r = K::rope(q.permute(order), k.permute(order), permuted(cos, order, rank), permuted(sin, order, rank), inverse,
                   interleaved, deinterleave);
  return {r[0].permute(back), r[1].permute(back)};
}

template <class K>
void register_kernels(torch::Library& m) {
  m.impl("bias_act_dropout", &bias_act_dropout<K>);
  m.impl("bias_act_dropout_backward", &bias_act_dropout_backward<K>);
  m.impl("glu", &glu<K>);
  m.impl("glu_backward", &glu_backward<K>);
  m.impl("rope", &rope<K>);
  m.impl("softcap", &softcap<K>);
  m.impl("softcap_backward", &softcap_backward<K>);
}

}  // namespace pointwise_ops
}  // namespace dmfx

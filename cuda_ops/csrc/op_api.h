// What the ops' registered kernels share (every family's binding includes it): the dropout seed and
// probability checks, calls of other dmfx ops through the dispatcher, and the pieces of the Autograd
// kernels (the fast path when nothing requires grad, the backward ops' "no double backward").
//
// An op's schema is defined in Python (cuda_ops/<family>.py); its CPU and CUDA kernels and its
// autograd formula are registered here, in C++ (TORCH_LIBRARY_IMPL in <family>_cpu.cpp and
// <family>_cuda_bind.cpp), so no Python runs between the dispatcher and a kernel. Modules built with
// DMFX_KERNELS_ONLY (the AVX2 test build, the CUDA emulation) register nothing.
#pragma once
#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "kernel_api.h"

namespace dmfx {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// A dropout seed tensor [seed, offset] (int64, CPU; cuda_ops.new_seed draws one) as two integers;
// (0, 0) when absent (then p must be 0: check_dropout).
inline std::pair<int64_t, int64_t> seed_values(const char* op, const c10::optional<at::Tensor>& seed) {
  if (!present(seed)) return {0, 0};
  const at::Tensor& s = *seed;
  TORCH_CHECK_VALUE(s.device().is_cpu() && s.scalar_type() == at::kLong && s.numel() == 2, "dmfx::", op,
                    ": seed must be an int64 CPU tensor of 2 elements [seed, offset] (see dmfx.cuda_ops.new_seed), got ",
                    s.scalar_type(), " ", s.sizes(), " on ", s.device());
  const at::Tensor flat = s.dim() == 1 ? s : s.reshape({-1});
  const auto a = flat.accessor<int64_t, 1>();
  return {a[0], a[1]};
}

// p in [0, 1], and a seed when p > 0.
inline void check_dropout(const char* op, double p, const c10::optional<at::Tensor>& seed) {
  check_p(op, p);
  TORCH_CHECK_VALUE(p == 0.0 || present(seed), "dmfx::", op, ": p = ", p,
                    " > 0 needs a seed tensor [seed, offset] (see dmfx.cuda_ops.new_seed)");
}

// A bool[] schema argument (output_mask) as the kernels take it (they check its length).
inline std::vector<bool> bool_vector(const c10::List<bool>& list) {
  std::vector<bool> v;
  for (bool b : list) v.push_back(b);
  return v;
}

inline c10::List<bool> bools(std::initializer_list<bool> values) {
  c10::List<bool> list;
  for (bool v : values) list.push_back(v);
  return list;
}

// The dmfx op `name` (its schema defined in Python), called through the dispatcher with signature Sig.
template <class Sig>
c10::TypedOperatorHandle<Sig> dmfx_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

inline bool requires_grad(const at::Tensor& t) { return t.defined() && t.requires_grad(); }
inline bool requires_grad(const c10::optional<at::Tensor>& t) { return t.has_value() && requires_grad(*t); }
template <class T>
inline bool requires_grad(const T&) { return false; }

template <class... Args>
inline bool any_requires_grad(const Args&... args) {
  return (requires_grad(args) || ...);
}

template <class Ret>
struct Outputs;  // an op's return value <-> the Function's variable_list

template <>
struct Outputs<at::Tensor> {
  static variable_list list(at::Tensor t) { return {std::move(t)}; }
  static at::Tensor from(variable_list v) { return std::move(v[0]); }
};

template <class... Ts>
struct Outputs<std::tuple<Ts...>> {
  static variable_list list(std::tuple<Ts...> t) {
    return std::apply([](auto&&... ts) { return variable_list{std::move(ts)...}; }, std::move(t));
  }
  static std::tuple<Ts...> from(variable_list v) { return from(std::move(v), std::index_sequence_for<Ts...>{}); }
  template <size_t... I>
  static std::tuple<Ts...> from(variable_list v, std::index_sequence<I...>) { return {std::move(v[I])...}; }
};

// The dispatcher's handle of the op an autograd::Function Fn differentiates: Fn::name ("dmfx::..."),
// Fn::Sig (its C++ signature).
template <class Fn>
const c10::TypedOperatorHandle<typename Fn::Sig>& op_of() {
  static const auto op = dmfx_op<typename Fn::Sig>(Fn::name);
  return op;
}

// The Autograd kernel of Fn's op (registered with TORCH_LIBRARY_IMPL(dmfx, Autograd, m)): Fn records
// the backward only when grad mode is on and an input requires grad; otherwise the op runs below
// autograd at once (what torch.library.register_autograd does, without a Python call).
template <class Fn, class Sig = typename Fn::Sig>
struct AutogradKernel;

template <class Fn, class Ret, class... Args>
struct AutogradKernel<Fn, Ret(Args...)> {
  static Ret call(c10::DispatchKeySet keys, Args... args) {
    if (!(at::GradMode::is_enabled() && any_requires_grad(args...))) {
      at::AutoDispatchBelowADInplaceOrView below;
      return op_of<Fn>().redispatch(keys & c10::after_ADInplaceOrView_keyset, args...);
    }
    return Outputs<Ret>::from(Fn::apply(args...));
  }
  // The forward of Fn: the op below autograd, its outputs as a variable_list.
  static variable_list below(Args... args) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return Outputs<Ret>::list(op_of<Fn>().call(args...));
  }
};

// The autograd::Function of a backward op: its outputs get a node whose backward raises
// NotImplementedError (double backward through dmfx's fused ops is not supported). Op: `name`
// ("dmfx::..."), `hint` (what the user ran into), `Sig`.
template <class Op>
struct NoDoubleBackward : public torch::autograd::Function<NoDoubleBackward<Op>> {
  using Sig = typename Op::Sig;
  static constexpr const char* name = Op::name;
  template <class... Args>
  static variable_list forward(AutogradContext*, Args&&... args) {
    return AutogradKernel<NoDoubleBackward>::below(std::forward<Args>(args)...);
  }
  static variable_list backward(AutogradContext*, variable_list) {
    TORCH_CHECK_NOT_IMPLEMENTED(false, Op::name, ": double backward (create_graph=True through ", Op::hint,
                                ") is not supported; compile without dmfx (or skip the pass that introduces this "
                                "op) for higher-order gradients");
  }
};

// Bits of a Function's context: which inputs required grad when the forward ran (Python's
// ctx.needs_input_grad, by argument position), saved as one integer.
template <class... Args>
int64_t needs_bits(const Args&... args) {
  int64_t bits = 0, i = 0;
  ((bits |= (requires_grad(args) ? int64_t(1) << i : 0), ++i), ...);
  return bits;
}
inline bool needs(AutogradContext* ctx, int i) { return (ctx->saved_data["needs"].toInt() >> i) & 1; }

inline c10::optional<at::Tensor> opt(const at::Tensor& t) {
  return t.defined() ? c10::optional<at::Tensor>(t) : c10::nullopt;
}

// ------------------------------------------------------------------------------------------------
// The attention scores' argument checks (the softmax and attention families' ops; before, Python's
// check_scores / check_stored_mask / kernel_mask in cuda_ops/_library.py, which the fakes still run
// at trace time). ValueError / TypeError as Python raised them; the kernels below check again, with
// RuntimeError, for their direct callers (the self-check, the tests).
// ------------------------------------------------------------------------------------------------

// The dtypes of attention scores and of q, k, v.
inline bool is_score_dtype(at::ScalarType st) {
  return st == at::kFloat || st == at::kHalf || st == at::kBFloat16 || st == at::kDouble;
}

// What an op computing softmax over scores of shape `scores` on `device` checks of its other
// arguments: the scores' rank (for causal), the dropout probability and seed, and the mask (bool or
// floating point, on the scores' device, broadcastable to them).
inline void check_score_args(const char* op, c10::IntArrayRef scores, c10::Device device,
                             const c10::optional<at::Tensor>& mask, bool causal,
                             const c10::optional<at::Tensor>& seed, double p) {
  TORCH_CHECK_VALUE(!scores.empty(), "dmfx::", op,
                    ": scores needs at least one dimension (softmax runs over the last)");
  TORCH_CHECK_VALUE(!causal || scores.size() >= 2, "dmfx::", op,
                    ": causal=True needs scores with at least 2 dimensions [..., q_len, k_len], got shape ", scores);
  check_dropout(op, p, seed);
  if (!present(mask)) return;
  const at::Tensor& m = *mask;
  TORCH_CHECK_TYPE(m.scalar_type() == at::kBool || at::isFloatingType(m.scalar_type()), "dmfx::", op,
                   ": mask must be bool or a floating-point tensor, got ", m.scalar_type());
  TORCH_CHECK_VALUE(m.device() == device, "dmfx::", op, ": mask is on ", m.device(), " but scores is on ", device);
  bool fits = m.dim() <= static_cast<int64_t>(scores.size());
  for (int64_t d = 1; fits && d <= m.dim(); ++d) {
    const int64_t ms = m.size(-d), ss = scores[scores.size() - d];
    fits = ms == 1 || ms == ss;
  }
  TORCH_CHECK_VALUE(fits, "dmfx::", op, ": mask of shape ", m.sizes(), " is not broadcastable to scores' shape ",
                    scores);
}

// The mask as the kernels read it: bool, float32 or the scores' dtype; other float masks become float32.
inline c10::optional<at::Tensor> kernel_mask(const c10::optional<at::Tensor>& mask, at::ScalarType scores) {
  if (!present(mask)) return c10::nullopt;
  const auto mt = mask->scalar_type();
  if (mt == at::kBool || mt == at::kFloat || mt == scores) return mask;
  return mask->to(at::kFloat);
}

// A backward op's stored dropout mask (the bool mask native_dropout returned, `ref`'s shape), with
// p = 0: the op-level check (ValueError) of what kernel_api.h's check_stored_mask checks again.
inline void check_stored_mask_arg(const char* op, const c10::optional<at::Tensor>& mask, const char* ref_name,
                                  const at::Tensor& ref, double p) {
  if (!present(mask)) return;
  TORCH_CHECK_VALUE(mask->scalar_type() == at::kBool, "dmfx::", op,
                    ": mask must be a bool tensor (the mask native_dropout returns), got ", mask->scalar_type());
  TORCH_CHECK_VALUE(mask->sizes() == ref.sizes(), "dmfx::", op, ": mask must have the shape of ", ref_name, " ",
                    ref.sizes(), ", got ", mask->sizes());
  TORCH_CHECK_VALUE(p == 0.0, "dmfx::", op, ": a stored mask and p = ", p,
                    " > 0 would be two dropout masks; pass p = 0 with a mask");
}

}  // namespace dmfx

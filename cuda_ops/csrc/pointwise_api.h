// Per-element math of dmfx's pointwise family (bias + activation + dropout, gated activations, the
// soft cap), shared by the CPU (C++) and CUDA kernels: the activation functions and their derivatives,
// softcap_fwd / softcap_grad.
//
// Activation codes (enum Act below is the one table: cuda_ops/pointwise.py reads its names from it,
// kGeluTanh -> "gelu_tanh"; kActNames beside it spells the same names for the ops' `str act`):
//   0 identity, 1 relu, 2 gelu (erf form, torch gelu approximate='none'),
//   3 gelu_tanh (torch gelu approximate='tanh'), 4 silu (x * sigmoid(x)), 5 tanh (BERT's pooler),
//   6 quick_gelu (x * sigmoid(1.702 x): CLIP's and its kin's, HF's "quick_gelu"),
//   7 relu_squared (relu(x)^2: Nemotron's and Primer's, HF's "relu2").
//
// The formulas are templates over a value type T and a math policy PwMath<T> (erf/exp/tanh, a
// "where x > 0" select, literal constants). This header specializes PwMath for float and double
// (host and device); pointwise_cpu.cpp adds a specialization for at::vec::Vectorized<float>, so the
// CPU's vectorized loops evaluate exactly the same formulas. Half/bfloat16 inputs are computed in
// float (at::opmath_type) and rounded once.
//
// The second half of this file is host-only: argument checks and input preparation shared by the CPU
// and CUDA entry points, so both accept and reject exactly the same inputs with the same messages.
#pragma once
#include <ATen/core/Tensor.h>

#include <cmath>
#include <string>
#include <type_traits>
#include <vector>

#include "dmfx_common.h"
#include "kernel_api.h"

namespace dmfx {
namespace pointwise_impl {

enum Act : int {
  kIdentity = 0, kRelu = 1, kGelu = 2, kGeluTanh = 3, kSilu = 4, kTanh = 5, kQuickGelu = 6, kReluSquared = 7
};
constexpr int kNumActs = 8;
// The names the ops take (`str act`), indexed by code: enum Act's names in snake case, as
// cuda_ops/pointwise.py derives them (the op tests run every name against its reference, so an order
// that disagreed with the enum would fail them).
constexpr const char* kActNames[] = {"identity", "relu",       "gelu",       "gelu_tanh",
                                     "silu",     "tanh",       "quick_gelu", "relu_squared"};
static_assert(sizeof(kActNames) / sizeof(kActNames[0]) == kNumActs, "one name per activation code");

template <typename T>
struct PwMath;

template <>
struct PwMath<float> {
  static DMFX_HD float c(double v) { return static_cast<float>(v); }
  static DMFX_HD float erf(float v) { return ::erff(v); }
  static DMFX_HD float exp(float v) { return ::expf(v); }
  static DMFX_HD float tanh(float v) { return ::tanhf(v); }
  static DMFX_HD float neg(float v) { return -v; }
  static DMFX_HD float relu(float v) { return v < 0.0f ? 0.0f : v; }  // NaN stays NaN
  // x > 0 ? a : 0 (relu and its derivative; x == 0 and NaN give 0, like torch's relu backward).
  static DMFX_HD float where_pos(float x, float a) { return x > 0.0f ? a : 0.0f; }
};

template <>
struct PwMath<double> {
  static DMFX_HD double c(double v) { return v; }
  static DMFX_HD double erf(double v) { return ::erf(v); }
  static DMFX_HD double exp(double v) { return ::exp(v); }
  static DMFX_HD double tanh(double v) { return ::tanh(v); }
  static DMFX_HD double neg(double v) { return -v; }
  static DMFX_HD double relu(double v) { return v < 0.0 ? 0.0 : v; }
  static DMFX_HD double where_pos(double x, double a) { return x > 0.0 ? a : 0.0; }
};

// Constants (double literals, converted once to T by PwMath<T>::c).
constexpr double kSqrt1_2 = 0.70710678118654752440;          // 1 / sqrt(2)
constexpr double kInvSqrt2Pi = 0.39894228040143267794;       // 1 / sqrt(2 pi)
constexpr double kSqrt2OverPi = 0.79788456080286535588;      // sqrt(2 / pi)
constexpr double kGeluTanhCoef = 0.044715;
constexpr double kQuickGeluCoef = 1.702;                    // HF's QuickGELUActivation

// act(x)
template <int ACT, typename T>
DMFX_HD T act_fwd(T x) {
  using M = PwMath<T>;
  if constexpr (ACT == kIdentity) {
    return x;
  } else if constexpr (ACT == kRelu) {
    return M::relu(x);
  } else if constexpr (ACT == kGelu) {
    return M::c(0.5) * x * (M::c(1.0) + M::erf(x * M::c(kSqrt1_2)));
  } else if constexpr (ACT == kGeluTanh) {
    const T inner = M::c(kSqrt2OverPi) * (x + M::c(kGeluTanhCoef) * x * x * x);
    return M::c(0.5) * x * (M::c(1.0) + M::tanh(inner));
  } else if constexpr (ACT == kSilu) {
    return x / (M::c(1.0) + M::exp(M::neg(x)));
  } else if constexpr (ACT == kTanh) {
    return M::tanh(x);
  } else if constexpr (ACT == kQuickGelu) {
    return x / (M::c(1.0) + M::exp(M::neg(M::c(kQuickGeluCoef) * x)));
  } else {  // kReluSquared
    const T r = M::relu(x);
    return r * r;
  }
}

// d act(x) / dx
template <int ACT, typename T>
DMFX_HD T act_grad(T x) {
  using M = PwMath<T>;
  if constexpr (ACT == kIdentity) {
    return M::c(1.0);
  } else if constexpr (ACT == kRelu) {
    return M::where_pos(x, M::c(1.0));
  } else if constexpr (ACT == kGelu) {
    const T cdf = M::c(0.5) * (M::c(1.0) + M::erf(x * M::c(kSqrt1_2)));
    const T pdf = M::c(kInvSqrt2Pi) * M::exp(M::c(-0.5) * x * x);
    return cdf + x * pdf;
  } else if constexpr (ACT == kGeluTanh) {
    const T x2 = x * x;
    const T t = M::tanh(M::c(kSqrt2OverPi) * (x + M::c(kGeluTanhCoef) * x2 * x));
    const T dinner = M::c(kSqrt2OverPi) * (M::c(1.0) + M::c(3.0 * kGeluTanhCoef) * x2);
    return M::c(0.5) * (M::c(1.0) + t) + M::c(0.5) * x * (M::c(1.0) - t * t) * dinner;
  } else if constexpr (ACT == kSilu) {  // s * (1 + x * (1 - s)), s = sigmoid(x)
    const T s = M::c(1.0) / (M::c(1.0) + M::exp(M::neg(x)));
    return s * (M::c(1.0) + x * (M::c(1.0) - s));
  } else if constexpr (ACT == kTanh) {  // 1 - tanh(x)^2
    const T t = M::tanh(x);
    return M::c(1.0) - t * t;
  } else if constexpr (ACT == kQuickGelu) {  // s * (1 + a x (1 - s)), s = sigmoid(a x), a = 1.702
    const T ax = M::c(kQuickGeluCoef) * x;
    const T s = M::c(1.0) / (M::c(1.0) + M::exp(M::neg(ax)));
    return s * (M::c(1.0) + ax * (M::c(1.0) - s));
  } else {  // kReluSquared: 2 relu(x) (NaN stays NaN, as torch's relu + square backward gives)
    return M::c(2.0) * M::relu(x);
  }
}

// Both at once (glu backward needs act(x) and act'(x)); the compiler shares common subexpressions.
template <int ACT, typename T>
DMFX_HD void act_fwd_grad(T x, T* y, T* dy) {
  *y = act_fwd<ACT, T>(x);
  *dy = act_grad<ACT, T>(x);
}

// Gemma 2's soft cap, cap * tanh(x / cap) (the division as written, not x times 1 / cap).
template <typename T>
DMFX_HD T softcap_fwd(T x, T cap) {
  return cap * PwMath<T>::tanh(x / cap);
}

// Its gradient from the OUTPUT out = cap * tanh(x / cap): g * (1 - (out / cap)^2).
template <typename T>
DMFX_HD T softcap_grad(T g, T out, T cap) {
  const T t = out / cap;
  return g * (PwMath<T>::c(1.0) - t * t);
}

// Calls f(std::integral_constant<int, ACT>) for a runtime activation code (checked by the caller).
template <typename F>
inline void dispatch_act(int act, F&& f) {
  switch (act) {
    case kIdentity: f(std::integral_constant<int, kIdentity>{}); break;
    case kRelu: f(std::integral_constant<int, kRelu>{}); break;
    case kGelu: f(std::integral_constant<int, kGelu>{}); break;
    case kGeluTanh: f(std::integral_constant<int, kGeluTanh>{}); break;
    case kSilu: f(std::integral_constant<int, kSilu>{}); break;
    case kTanh: f(std::integral_constant<int, kTanh>{}); break;
    case kQuickGelu: f(std::integral_constant<int, kQuickGelu>{}); break;
    default: f(std::integral_constant<int, kReluSquared>{}); break;
  }
}

// ------------------------------------------------------------------------------------------------
// Host side: checks and preparation (errors name the op, the tensor and what was expected)
// ------------------------------------------------------------------------------------------------

inline void check_float_tensor(const char* op, const char* name, const at::Tensor& t,
                               c10::DeviceType device) {
  TORCH_CHECK(t.device().type() == device, "dmfx::", op, ": this is the ",
              c10::DeviceTypeName(device), " kernel but ", name, " is on ", t.device());
  const auto st = t.scalar_type();
  TORCH_CHECK(st == at::kFloat || st == at::kHalf || st == at::kBFloat16 || st == at::kDouble,
              "dmfx::", op, ": ", name, " must be float32, float16, bfloat16 or float64, got ", st);
}

// `t` on the device and of the dtype of `ref` (named `ref_name`).
inline void check_matches(const char* op, const char* name, const at::Tensor& t,
                          const char* ref_name, const at::Tensor& ref) {
  TORCH_CHECK(t.device() == ref.device(), "dmfx::", op, ": ", name, " is on ", t.device(), " but ",
              ref_name, " is on ", ref.device());
  TORCH_CHECK(t.scalar_type() == ref.scalar_type(), "dmfx::", op, ": ", name, " has dtype ",
              t.scalar_type(), " but ", ref_name, " has dtype ", ref.scalar_type(),
              " (they must match)");
}

inline void check_same_shape(const char* op, const char* name, const at::Tensor& t,
                             const char* ref_name, const at::Tensor& ref) {
  check_matches(op, name, t, ref_name, ref);
  TORCH_CHECK(t.sizes() == ref.sizes(), "dmfx::", op, ": ", name, " must have the shape of ",
              ref_name, " ", ref.sizes(), ", got ", t.sizes());
}

inline void check_act(const char* op, int64_t act) {
  if (act >= 0 && act < kNumActs) return;
  std::string valid;
  for (int i = 0; i < kNumActs; ++i) valid += (i ? ", " : "") + std::to_string(i) + " " + kActNames[i];
  TORCH_CHECK(false, "dmfx::", op, ": unknown activation code ", act, " (", valid, ")");
}

// The code of the activation named `act` (an op's `str act`); ValueError naming the valid ones.
inline int64_t act_code(const char* op, c10::string_view act) {
  std::string valid;
  for (int i = 0; i < kNumActs; ++i) {
    if (act == kActNames[i]) return i;
    valid += (i ? ", " : "") + std::string(kActNames[i]);
  }
  TORCH_CHECK_VALUE(false, "dmfx::", op, ": unknown activation '", std::string(act), "'; valid activations are ", valid);
}

inline void check_mask(const char* op, const std::vector<bool>& mask, const char* what) {
  TORCH_CHECK_VALUE(mask.size() == 2, "dmfx::", op, ": output_mask needs 2 entries ", what, ", got ",
                    mask.size());
}

inline int64_t num_rows(const at::Tensor& t) {
  const int64_t n = t.dim() == 0 ? 1 : t.size(-1);
  return n == 0 ? 0 : t.numel() / n;
}

// bias_act_fwd / bias_act_bwd: x [..., N], bias [N] or None. Returns the dropout parameters.
inline DropoutParams check_bias_act(const char* op, const at::Tensor& x,
                                    const c10::optional<at::Tensor>& bias, int64_t act, int64_t seed,
                                    int64_t offset, double p, c10::DeviceType device) {
  check_float_tensor(op, "x", x, device);
  TORCH_CHECK(x.dim() >= 1, "dmfx::", op, ": x must have at least one dimension, got a scalar");
  if (present(bias)) {
    check_matches(op, "bias", *bias, "x", x);
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == x.size(-1), "dmfx::", op,
                ": bias must have shape [", x.size(-1), "] (the size of x's last dimension), got ",
                bias->sizes());
  }
  check_act(op, act);
  check_p(op, p);
  return make_dropout_params(p, seed, offset);
}

inline void check_glu(const char* op, const at::Tensor& gate, const at::Tensor& up, int64_t act,
                      c10::DeviceType device) {
  check_float_tensor(op, "gate", gate, device);
  TORCH_CHECK(gate.dim() >= 1, "dmfx::", op, ": gate must have at least one dimension, got a scalar");
  check_same_shape(op, "up", up, "gate", gate);
  check_act(op, act);
}

// softcap's cap: positive and finite (ValueError naming the op and the value).
inline void check_cap(const char* op, double cap) {
  TORCH_CHECK_VALUE(std::isfinite(cap) && cap > 0.0, "dmfx::", op, ": cap must be positive and finite, got ", cap);
}

// softcap (forward): x of any shape and strides. The checks name the ops (softcap, softcap_backward),
// not the kernel functions, on the CPU and on CUDA alike.
inline void check_softcap(const at::Tensor& x, double cap, c10::DeviceType device) {
  check_float_tensor("softcap", "x", x, device);
  check_cap("softcap", cap);
}

// softcap_backward: out (softcap's output) on grad_out's device, of its dtype and shape.
inline void check_softcap_backward(const at::Tensor& grad_out, const at::Tensor& out, double cap,
                                   c10::DeviceType device) {
  const char* op = "softcap_backward";
  check_float_tensor(op, "grad_out", grad_out, device);
  check_same_shape(op, "out", out, "grad_out", grad_out);
  check_cap(op, cap);
}

// rope: q and k (equal rank >= 2, same last two dims [S, D], D even) and cos/sin broadcast to each.
struct RopeSide {
  at::Tensor x, cos, sin;  // x rowable; cos/sin expanded to x's shape (stride 0 on broadcast dims)
  int64_t rows = 0;
};

inline at::Tensor rope_table(const char* op, const char* name, const at::Tensor& t,
                             const char* xname, const at::Tensor& x) {
  bool ok = t.dim() >= 1 && t.dim() <= x.dim();
  for (int64_t i = 1; ok && i <= t.dim(); ++i) {
    const int64_t ts = t.size(-i), xs = x.size(-i);
    ok = ts == xs || ts == 1;
  }
  TORCH_CHECK(ok && t.size(-1) == x.size(-1), "dmfx::", op, ": ", name, " of shape ", t.sizes(),
              " must broadcast to ", xname, "'s shape ", x.sizes(), " with the same last dimension ",
              x.size(-1));
  // Unit stride on D (copies only a table that is strided along D, never a broadcast one).
  const at::Tensor base = (t.size(-1) > 1 && t.stride(-1) != 1) ? t.contiguous() : t;
  at::Tensor e = base.expand(x.sizes());
  RowIndexer r;
  if (!RowIndexer::build(e, &r)) e = e.contiguous();  // more than 6 distinct leading dims
  return e;
}

inline RopeSide prepare_rope_side(const char* op, const char* xname, const at::Tensor& x,
                                  const at::Tensor& cos, const at::Tensor& sin) {
  RopeSide s;
  s.x = rowable(x);
  s.cos = rope_table(op, "cos", cos, xname, x);
  s.sin = rope_table(op, "sin", sin, xname, x);
  s.rows = num_rows(x);
  return s;
}

inline std::vector<RopeSide> check_rope(const char* op, const at::Tensor& q, const at::Tensor& k,
                                        const at::Tensor& cos, const at::Tensor& sin, bool interleaved,
                                        bool deinterleave, c10::DeviceType device) {
  check_float_tensor(op, "q", q, device);
  check_matches(op, "k", k, "q", q);
  check_matches(op, "cos", cos, "q", q);
  check_matches(op, "sin", sin, "q", q);
  TORCH_CHECK(q.dim() >= 2 && k.dim() == q.dim(), "dmfx::", op,
              ": q and k must have the same rank >= 2 ([..., S, D]), got q ", q.sizes(), " and k ",
              k.sizes());
  // Each side is indexed on its own (cos and sin broadcast to each, checked below), so q and k may
  // differ in any dim but D: grouped-query k has fewer heads, and the Python side may hand both in
  // their memory order ([B, S, H, D]), where the heads are the second-to-last dim.
  TORCH_CHECK(q.size(-1) == k.size(-1), "dmfx::", op, ": q and k must have the same head dim D (last dim), got q ",
              q.sizes(), " and k ", k.sizes());
  TORCH_CHECK(q.size(-1) % 2 == 0, "dmfx::", op, ": the head dim D (last dim of q and k) must be even, got ",
              q.size(-1));
  TORCH_CHECK(!(interleaved && deinterleave), "dmfx::", op, ": interleaved and deinterleave exclude each other (GPT-J's "
              "pairs in and out, or DeepSeek's pairs in and halves out)");
  return {prepare_rope_side(op, "q", q, cos, sin), prepare_rope_side(op, "k", k, cos, sin)};
}

}  // namespace pointwise_impl
}  // namespace dmfx

// dmfx CPU kernels of the fused cross-entropy (cross_entropy_api.h states the math):
//
//   cross_entropy_fwd: [loss, lse ([N, 2]: max, log-sum)] from logits [N, V] and target [N], reading each
//                      row once: the row
//                      goes through an L1-resident fp32 chunk buffer (kChunk elements), each chunk's max
//                      and sum of exp (softmax_cpu.h's vectorized load_logits / exp_sum) merged into the
//                      row's running log-sum-exp. Ignored rows are not read.
//   cross_entropy_bwd: dlogits [N, V] (logits' dtype, contiguous) in one pass over each row, plus
//                      grad_logits when given; with softcap > 0, times the cap's derivative
//                      1 - (z / cap)^2 of each logit z as it is in the chunk buffer (the raw logits' gradient).
//
// One thread computes a row whole (OpenMP over rows), so per-row results (lse, reduction none, dlogits)
// do not depend on the thread count; a reduced loss sums the rows' losses in row order, in double, after
// the parallel loop: bit-reproducible whatever the thread count. A target that is neither a class nor
// ignore_index raises IndexError before anything is computed.
//
// The file has two parts (cuda_ops/build.py): the kernels, this file's own translation unit (-O3), and,
// under DMFX_CPU_GLUE, the glue (the kernel functions' Python bindings, the ops' registration and
// autograd formulas), which cpu_bindings.cpp includes into the one translation unit of every family's glue.
#ifndef DMFX_CPU_GLUE
#include <ATen/ops/scalar_tensor.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu_kernels.h"
#include "cross_entropy_api.h"
#include "softmax_cpu.h"

namespace dmfx {
namespace cross_entropy_impl {
namespace {

using softmax_impl::exp_nonpos;
using softmax_impl::kLanes;

constexpr int64_t kChunk = 2048;  // elements of a row per step (8 KB of fp32: stays in L1)

template <typename acc_t>
acc_t lane_sum(const acc_t* z, int64_t n) {
  acc_t part[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int l = 0; l < kLanes; ++l) part[l] += z[j + l];
  for (; j < n; ++j) part[0] += z[j];
  acc_t total = 0;
  for (int l = 0; l < kLanes; ++l) total += part[l];
  return total;
}

// z[j] = logits x[j] in acc_t for j < n.
template <typename acc_t, typename scalar_t>
void load_chunk(const scalar_t* x, int64_t n, acc_t* z) {
  softmax_impl::load_row<acc_t>(x, static_cast<const softmax_impl::NoMask*>(nullptr), n, acc_t(1), acc_t(0), z);
}

// The max m and ls = log sum exp(x - m) of row x (V logits) and, when want_sum, the sum of its logits.
template <typename acc_t, typename scalar_t>
void row_lse(const scalar_t* x, int64_t V, bool want_sum, acc_t* buf, acc_t& max, acc_t& ls, acc_t& zsum) {
  constexpr acc_t kNegInf = -std::numeric_limits<acc_t>::infinity();
  acc_t m = kNegInf, s = 0, zs = 0;
  for (int64_t c0 = 0; c0 < V; c0 += kChunk) {
    const int64_t n = std::min(kChunk, V - c0);
    load_chunk<acc_t>(x + c0, n, buf);
    const acc_t cmax = softmax_impl::row_max(buf, n);
    if (want_sum) zs += lane_sum(buf, n);
    if (cmax == kNegInf) continue;  // (exp_sum would take -inf - -inf)
    ce_merge(m, s, cmax, softmax_impl::exp_sum(buf, n, cmax));
  }
  max = m;
  ls = ce_log(s);  // a row of -inf: -inf (its loss is NaN, as eager's)
  zsum = zs;
}

void check_targets(const CeArgs& a, const int64_t* t) {
  for (int64_t i = 0; i < a.N; ++i) {
    TORCH_CHECK_INDEX(ce_target_ok(t[i], a.V, a.ignore_index), "dmfx::cross_entropy: target[", i, "] = ", t[i],
                      " is neither a class of the logits' ", a.V, " ([0, ", a.V, ")) nor ignore_index (",
                      a.ignore_index, ")");
  }
}

int64_t count_targets(const CeArgs& a, const int64_t* t) {
  int64_t count = 0;
  for (int64_t i = 0; i < a.N; ++i) count += t[i] != a.ignore_index;
  return count;
}

int64_t grain_of(int64_t V) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(V, 1)); }

// rows[i] = row i's loss (0 when ignored), lse[2i], lse[2i + 1] its max and log-sum (0 when ignored).
template <typename scalar_t, typename acc_t>
void fwd_rows(const CeArgs& a, const scalar_t* x, const int64_t* t, acc_t* rows, acc_t* lse) {
  const acc_t eps = static_cast<acc_t>(a.smoothing);
  at::parallel_for(0, a.N, grain_of(a.V), [&](int64_t begin, int64_t end) {
    std::vector<acc_t> buf(std::min(kChunk, a.V));
    for (int64_t r = begin; r < end; ++r) {
      const int64_t tr = t[r];
      if (tr == a.ignore_index) {
        rows[r] = lse[2 * r] = lse[2 * r + 1] = acc_t(0);
        continue;
      }
      const scalar_t* xr = x + r * a.row_stride;
      acc_t m, ls, zsum;
      row_lse(xr, a.V, eps > acc_t(0), buf.data(), m, ls, zsum);
      lse[2 * r] = m;
      lse[2 * r + 1] = ls;
      rows[r] = ce_row_loss(m, ls, static_cast<acc_t>(xr[tr]), zsum, eps, a.V);
    }
  });
}

// dz of one chunk of a row (n elements from column c0): g * p - g * eps / V (+ grad_logits), the
// target's element (if in the chunk) - g * (1 - eps); with kCap (soft-capped logits z) times the cap's
// derivative 1 - (z / cap)^2, in acc_t, before the one rounding.
template <bool kGradLogits, bool kCap, typename scalar_t, typename acc_t>
void bwd_chunk(const acc_t* z, int64_t n, int64_t c0, int64_t tr, acc_t m, acc_t ls, acc_t g, acc_t g_eps,
               acc_t g_target, acc_t cap, const scalar_t* gl, scalar_t* out) {
  for (int64_t j = 0; j < n; ++j) {
    acc_t d = g * exp_nonpos(z[j] - m - ls) - g_eps;
    if constexpr (kGradLogits) d += static_cast<acc_t>(gl[j]);
    if constexpr (kCap) d *= ce_softcap_factor(z[j], cap);
    out[j] = static_cast<scalar_t>(d);
  }
  const int64_t jt = tr - c0;
  if (jt >= 0 && jt < n) {
    acc_t d = g * exp_nonpos(z[jt] - m - ls) - g_eps - g_target;
    if constexpr (kGradLogits) d += static_cast<acc_t>(gl[jt]);
    if constexpr (kCap) d *= ce_softcap_factor(z[jt], cap);
    out[jt] = static_cast<scalar_t>(d);
  }
}

// An ignored row's chunk with soft-capped logits z and grad_logits: gl * (1 - (z / cap)^2).
template <typename scalar_t, typename acc_t>
void ignored_capped_chunk(const acc_t* z, int64_t n, acc_t cap, const scalar_t* gl, scalar_t* out) {
  for (int64_t j = 0; j < n; ++j) {
    out[j] = static_cast<scalar_t>(static_cast<acc_t>(gl[j]) * ce_softcap_factor(z[j], cap));
  }
}

struct BwdPtrs {
  const void* grad;  // acc_t: the loss gradient, one value (stride 0) or one per row
  int64_t grad_stride;
  const int64_t* count;  // rows not ignored (mean), else nullptr
  const void* gl;        // scalar_t grad_logits, or nullptr
  int64_t gl_stride;
};

template <bool kCap, typename scalar_t, typename acc_t>
void bwd_rows(const CeArgs& a, const scalar_t* x, const int64_t* t, const acc_t* lse, const BwdPtrs& P,
              scalar_t* out) {
  const acc_t eps = static_cast<acc_t>(a.smoothing), cap = static_cast<acc_t>(a.softcap);
  const auto* grad = static_cast<const acc_t*>(P.grad);
  const auto* gl = static_cast<const scalar_t*>(P.gl);
  at::parallel_for(0, a.N, grain_of(a.V), [&](int64_t begin, int64_t end) {
    std::vector<acc_t> buf(std::min(kChunk, a.V));
    for (int64_t r = begin; r < end; ++r) {
      scalar_t* orow = out + r * a.V;
      const scalar_t* glr = gl ? gl + r * P.gl_stride : nullptr;
      const scalar_t* xr = x + r * a.row_stride;
      const int64_t tr = t[r];
      if (tr == a.ignore_index) {  // no loss gradient: grad_logits (times the cap's derivative), or zeros
        if (kCap && glr) {
          for (int64_t c0 = 0; c0 < a.V; c0 += kChunk) {
            const int64_t n = std::min(kChunk, a.V - c0);
            load_chunk<acc_t>(xr + c0, n, buf.data());
            ignored_capped_chunk(buf.data(), n, cap, glr + c0, orow + c0);
          }
          continue;
        }
        for (int64_t j = 0; j < a.V; ++j) orow[j] = glr ? glr[j] : scalar_t(0);
        continue;
      }
      const acc_t g = ce_row_scale(grad, P.grad_stride, P.count, r);
      const acc_t g_eps = g * (eps / static_cast<acc_t>(a.V)), g_target = g * (acc_t(1) - eps);
      for (int64_t c0 = 0; c0 < a.V; c0 += kChunk) {
        const int64_t n = std::min(kChunk, a.V - c0);
        load_chunk<acc_t>(xr + c0, n, buf.data());  // (no max: the forward's is in lse)
        if (glr) {
          bwd_chunk<true, kCap>(buf.data(), n, c0, tr, lse[2 * r], lse[2 * r + 1], g, g_eps, g_target, cap, glr + c0,
                                orow + c0);
        } else {
          bwd_chunk<false, kCap>(buf.data(), n, c0, tr, lse[2 * r], lse[2 * r + 1], g, g_eps, g_target, cap, glr,
                                 orow + c0);
        }
      }
    }
  });
}

}  // namespace
}  // namespace cross_entropy_impl

std::vector<at::Tensor> cross_entropy_fwd_cpu(const at::Tensor& logits_in, const at::Tensor& target_in,
                                              int64_t ignore_index, double label_smoothing, int64_t reduction) {
  using namespace cross_entropy_impl;
  CeArgs a = check_ce_args("cross_entropy", logits_in, target_in, ignore_index, label_smoothing, reduction, at::kCPU);
  const at::Tensor logits = ce_rows(logits_in), target = target_in.contiguous();
  a.row_stride = ce_row_stride(logits);
  const auto stat = logits.options().dtype(ce_stat_dtype(logits));
  const int64_t* t = target.data_ptr<int64_t>();
  check_targets(a, t);
  at::Tensor rows = at::empty({a.N}, stat), lse = at::empty({a.N, 2}, stat);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "dmfx_cross_entropy_fwd", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    acc_t* rp = rows.data_ptr<acc_t>();
    if (a.N > 0) fwd_rows<scalar_t, acc_t>(a, logits.data_ptr<scalar_t>(), t, rp, lse.data_ptr<acc_t>());
    if (a.reduction == kReduceNone) return;
    double total = 0;  // in row order: the same sum whatever the thread count
    for (int64_t i = 0; i < a.N; ++i) total += static_cast<double>(rp[i]);
    if (a.reduction == kReduceMean) total /= static_cast<double>(count_targets(a, t));  // 0 / 0: NaN, as eager
    rows = at::scalar_tensor(total, stat);
  });
  return {rows, lse};
}

at::Tensor cross_entropy_bwd_cpu(const at::Tensor& grad_loss_in, const at::Tensor& logits_in,
                                 const at::Tensor& target_in, const at::Tensor& lse_in, int64_t ignore_index,
                                 double label_smoothing, int64_t reduction,
                                 const c10::optional<at::Tensor>& grad_logits_in, double softcap) {
  using namespace cross_entropy_impl;
  CeArgs a = check_ce_bwd_args("cross_entropy_backward", grad_loss_in, logits_in, target_in, lse_in, ignore_index,
                               label_smoothing, reduction, grad_logits_in, softcap, at::kCPU);
  const at::Tensor logits = ce_rows(logits_in), target = target_in.contiguous(), lse = lse_in.contiguous();
  const at::Tensor grad_loss = grad_loss_in.contiguous();
  a.row_stride = ce_row_stride(logits);
  const int64_t* t = target.data_ptr<int64_t>();
  check_targets(a, t);
  const int64_t count = reduction == kReduceMean ? count_targets(a, t) : 0;
  at::Tensor gl;
  if (present(grad_logits_in)) gl = ce_rows(*grad_logits_in);
  at::Tensor out = at::empty(logits.sizes(), logits.options());
  if (a.N == 0) return out;
  BwdPtrs P{grad_loss.data_ptr(), reduction == kReduceNone ? 1 : 0, reduction == kReduceMean ? &count : nullptr,
            gl.defined() ? gl.data_ptr() : nullptr, gl.defined() ? ce_row_stride(gl) : 0};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "dmfx_cross_entropy_bwd", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    if (a.softcap > 0.0) {
      bwd_rows<true, scalar_t, acc_t>(a, logits.data_ptr<scalar_t>(), t, lse.data_ptr<acc_t>(), P,
                                      out.data_ptr<scalar_t>());
    } else {
      bwd_rows<false, scalar_t, acc_t>(a, logits.data_ptr<scalar_t>(), t, lse.data_ptr<acc_t>(), P,
                                       out.data_ptr<scalar_t>());
    }
  });
  return out;
}

}  // namespace dmfx

#else  // DMFX_CPU_GLUE: the glue (in cpu_bindings.cpp's translation unit)
#include <torch/csrc/utils/pybind.h>

#include "cpu_kernels.h"

namespace dmfx {
void bind_cross_entropy(pybind11::module_& m) {
  m.def("cross_entropy_fwd", &cross_entropy_fwd_cpu,
        "fused log_softmax + nll_loss forward (CPU); returns [loss, lse]", pybind11::arg("logits"),
        pybind11::arg("target"), pybind11::arg("ignore_index"), pybind11::arg("label_smoothing"),
        pybind11::arg("reduction"));
  m.def("cross_entropy_bwd", &cross_entropy_bwd_cpu,
        "fused cross-entropy backward (CPU): dlogits, plus grad_logits when given (times the soft cap's derivative "
        "when softcap > 0: the raw logits' gradient)", pybind11::arg("grad_loss"),
        pybind11::arg("logits"), pybind11::arg("target"), pybind11::arg("lse"), pybind11::arg("ignore_index"),
        pybind11::arg("label_smoothing"), pybind11::arg("reduction"), pybind11::arg("grad_logits") = pybind11::none(),
        pybind11::arg("softcap") = 0.0);
}

}  // namespace dmfx

#ifndef DMFX_KERNELS_ONLY
// ------------------------------------------------------------------------------------------------
// The ops: CPU kernels (through the kernel table: cpu_kernels.h) and the family's autograd formula
// ------------------------------------------------------------------------------------------------
#include "cross_entropy_ops.h"

namespace dmfx {
namespace cross_entropy_ops {
namespace {

struct CpuCe {
  template <class... A>
  static Tensors cross_entropy_fwd(A&&... a) { return cpu_kernels().cross_entropy_fwd(std::forward<A>(a)...); }
  template <class... A>
  static Tensor cross_entropy_bwd(A&&... a) { return cpu_kernels().cross_entropy_bwd(std::forward<A>(a)...); }
};

// Saves logits, target and the row lse (no [N, V] tensor); the backward is dmfx::cross_entropy_backward.
struct CrossEntropyFn : public torch::autograd::Function<CrossEntropyFn> {
  static constexpr const char* name = "dmfx::cross_entropy";
  using Sig = decltype(cross_entropy<CpuCe>);
  static variable_list forward(AutogradContext* ctx, const Tensor& logits, const Tensor& target, int64_t ignore_index,
                               double label_smoothing, int64_t reduction) {
    auto out = AutogradKernel<CrossEntropyFn>::below(logits, target, ignore_index, label_smoothing, reduction);
    ctx->save_for_backward({logits, target, out[1]});
    ctx->saved_data["ignore_index"] = ignore_index;
    ctx->saved_data["label_smoothing"] = label_smoothing;
    ctx->saved_data["reduction"] = reduction;
    ctx->mark_non_differentiable({out[1]});
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    const Tensor none;
    if (!g[0].defined()) return {none, none, none, none, none};
    static const auto op = dmfx_op<CrossEntropyBackwardSig>("dmfx::cross_entropy_backward");
    auto v = ctx->get_saved_variables();
    const Tensor dlogits = op.call(g[0], v[0], v[1], v[2], ctx->saved_data["ignore_index"].toInt(),
                                   ctx->saved_data["label_smoothing"].toDouble(),
                                   ctx->saved_data["reduction"].toInt(), c10::nullopt, 0.0);
    return {dlogits, none, none, none, none};
  }
};

struct CrossEntropyBackwardOp {
  static constexpr const char* name = "dmfx::cross_entropy_backward";
  static constexpr const char* hint = "a dmfx cross-entropy";
  using Sig = CrossEntropyBackwardSig;
};

}  // namespace
}  // namespace cross_entropy_ops
}  // namespace dmfx

TORCH_LIBRARY_IMPL(dmfx, CPU, m) {
  dmfx::cross_entropy_ops::register_kernels<dmfx::cross_entropy_ops::CpuCe>(m);
}

TORCH_LIBRARY_IMPL(dmfx, Autograd, m) {
  using namespace dmfx;
  using namespace dmfx::cross_entropy_ops;
  m.impl("cross_entropy", &AutogradKernel<CrossEntropyFn>::call);
  m.impl("cross_entropy_backward", &AutogradKernel<NoDoubleBackward<CrossEntropyBackwardOp>>::call);
}
#endif  // DMFX_KERNELS_ONLY
#endif  // DMFX_CPU_GLUE

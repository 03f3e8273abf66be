// The math and the host-side checks shared by the CPU (cross_entropy_cpu.cpp) and CUDA
// (cross_entropy_cuda.cu) kernels of the fused cross-entropy (log_softmax + nll_loss):
//
//   forward : per row i of logits z [N, V]: its max m_i and ls_i = log sum_j exp(z_ij - m_i)
//             (accumulated in fp32 for fp16/bf16/fp32 logits, fp64 for fp64: HF's upcast); its
//             log-sum-exp is m_i + ls_i, and
//             loss_i = ls_i + (1 - eps) (m_i - z_i,t) + eps (m_i - sum_j z_ij / V)   (t = target_i,
//             eps = label smoothing: PyTorch's (1 - eps) nll + eps / V * sum_j -log p_ij), 0 for an
//             ignored row (target_i == ignore_index), reduced as at::Reduction: none ([N]), mean
//             (sum over the rows / the number of rows not ignored: 0 / 0 = NaN when every row is, like
//             PyTorch), sum. The pairs (m_i, ls_i), [N, 2] ("lse"), are all that is saved for the
//             backward ((0, 0) for an ignored row: never read). Kept apart, not summed: z - m is exact
//             where it matters, so large logits (1e4) lose no precision, as eager's log_softmax does not.
//             (With smoothing, sum_j z_ij is a plain sum of the logits in the accumulation type: for
//             logits far from 0 its term is as precise as that sum, eps times its rounding.)
//   backward: dz_ij = g_i (p_ij - eps / V - (1 - eps) [j == t]) + grad_logits_ij, p = exp(z - m - ls),
//             g_i the loss gradient of row i (divided by the count for mean), 0 for an ignored row
//             (+ grad_logits: the gradient that reaches the logits themselves when they are also a
//             graph output, added in the same pass). With softcap > 0 the logits are soft-capped,
//             z_ij = cap tanh(x_ij / cap) (Gemma 2), and the backward returns the raw logits' gradient:
//             dx_ij = dz_ij (1 - (z_ij / cap)^2) (ignored rows too: their grad_logits times the factor),
//             the factor computed in the accumulation type from z_ij as read, the product rounded once
//             to the logits' dtype (softcap 0: no cap; < 0, inf or nan: ValueError).
//
// Logits are read through a row stride (unit stride along V), target as contiguous int64.
#pragma once
#include <ATen/core/Tensor.h>

#include <cmath>
#include <limits>

#include "dmfx_common.h"
#include "kernel_api.h"

namespace dmfx {
namespace cross_entropy_impl {

// at::Reduction's codes (the schema's `reduction` is nll_loss's int).
enum CeReduction : int64_t { kReduceNone = 0, kReduceMean = 1, kReduceSum = 2 };

struct CeArgs {
  int64_t N = 0, V = 0;
  int64_t row_stride = 0;  // of the logits (and grad_logits: its own, CeBwdPtrs)
  int64_t ignore_index = -100;
  double smoothing = 0.0;
  int64_t reduction = kReduceMean;
  double softcap = 0.0;  // (the backward's) the logits are cap * tanh(raw / cap) when > 0: raw's gradient
};

// exp and log on host and device (fp32 / fp64).
DMFX_HD float ce_exp(float x) { return ::expf(x); }
DMFX_HD double ce_exp(double x) { return ::exp(x); }
DMFX_HD float ce_log(float x) { return ::logf(x); }
DMFX_HD double ce_log(double x) { return ::log(x); }

// max that propagates NaN from either side (eager's log_softmax gives NaN rows for NaN logits).
template <typename T>
DMFX_HD T ce_nan_max(T a, T b) {
  return (a != a || a > b) ? a : b;
}

// Merges the log-sum-exp state (m2, s2) into (m, s): s is sum_j exp(z_j - m) over the elements seen.
// An empty state is (-inf, 0); a +inf logit makes s NaN (exp(inf - inf)), as eager's log_softmax does.
template <typename T>
DMFX_HD void ce_merge(T& m, T& s, T m2, T s2) {
  const T M = ce_nan_max(m, m2);
  if (M == -std::numeric_limits<T>::infinity()) return;  // both empty
  s = s * ce_exp(m - M) + s2 * ce_exp(m2 - M);
  m = M;
}

// The loss of a row that is not ignored, from its max m, ls (log sum exp(z - m)), its target's logit
// zt and the sum of its logits zsum (read only when eps > 0).
template <typename T>
DMFX_HD T ce_row_loss(T m, T ls, T zt, T zsum, T eps, int64_t V) {
  T loss = ls + (T(1) - eps) * (m - zt);
  if (eps > T(0)) loss += eps * (m - zsum / static_cast<T>(V));
  return loss;
}

// The soft cap's derivative from its output z = cap * tanh(x / cap): 1 - (z / cap)^2 (the division as
// written, as pointwise_api.h's softcap_grad).
template <typename T>
DMFX_HD T ce_softcap_factor(T z, T cap) {
  const T t = z / cap;
  return T(1) - t * t;
}

// Whether target value t is a class of V (or ignore_index).
DMFX_HD bool ce_target_ok(int64_t t, int64_t V, int64_t ignore_index) {
  return t == ignore_index || (t >= 0 && t < V);
}

// The loss gradient's scale of row `row`: grad[row * stride] (stride 0: a reduced loss's one value),
// divided by the count of rows not ignored for mean (count: nullptr otherwise).
template <typename T>
DMFX_HD T ce_row_scale(const T* grad, int64_t stride, const int64_t* count, int64_t row) {
  const T g = grad[row * stride];
  return count ? g / static_cast<T>(*count) : g;
}

inline at::ScalarType ce_stat_dtype(const at::Tensor& logits) {
  return logits.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

inline void check_logits(const char* op, const at::Tensor& logits, c10::DeviceType device) {
  TORCH_CHECK(logits.device().type() == device, "dmfx::", op, ": this is the ", c10::DeviceTypeName(device),
              " kernel but logits is on ", logits.device());
  const auto st = logits.scalar_type();
  TORCH_CHECK(st == at::kFloat || st == at::kHalf || st == at::kBFloat16 || st == at::kDouble, "dmfx::", op,
              ": logits must be float32, float16, bfloat16 or float64, got ", st);
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) >= 1, "dmfx::", op,
              ": logits must have shape [N, V] with V >= 1 classes, got ", logits.sizes());
}

inline CeArgs check_ce_args(const char* op, const at::Tensor& logits, const at::Tensor& target, int64_t ignore_index,
                            double smoothing, int64_t reduction, c10::DeviceType device) {
  check_logits(op, logits, device);
  TORCH_CHECK(target.device() == logits.device(), "dmfx::", op, ": target is on ", target.device(),
              " but logits is on ", logits.device());
  TORCH_CHECK(target.scalar_type() == at::kLong, "dmfx::", op, ": target must be int64 class indices, got ",
              target.scalar_type());
  TORCH_CHECK(target.dim() == 1 && target.size(0) == logits.size(0), "dmfx::", op,
              ": target must have shape [N] = [", logits.size(0), "] (one class per row of logits), got ",
              target.sizes());
  TORCH_CHECK_VALUE(smoothing >= 0.0 && smoothing <= 1.0, "dmfx::", op, ": label_smoothing must be in [0, 1], got ",
                    smoothing);
  TORCH_CHECK_VALUE(reduction == kReduceNone || reduction == kReduceMean || reduction == kReduceSum, "dmfx::", op,
                    ": reduction must be 0 (none), 1 (mean) or 2 (sum), got ", reduction);
  CeArgs a;
  a.N = logits.size(0);
  a.V = logits.size(1);
  a.ignore_index = ignore_index;
  a.smoothing = smoothing;
  a.reduction = reduction;
  return a;
}

// The backward's checks on top of the forward's: the saved lse, the loss gradient, grad_logits, softcap.
inline CeArgs check_ce_bwd_args(const char* op, const at::Tensor& grad_loss, const at::Tensor& logits,
                                const at::Tensor& target, const at::Tensor& lse, int64_t ignore_index, double smoothing,
                                int64_t reduction, const c10::optional<at::Tensor>& grad_logits, double softcap,
                                c10::DeviceType device) {
  CeArgs a = check_ce_args(op, logits, target, ignore_index, smoothing, reduction, device);
  TORCH_CHECK_VALUE(std::isfinite(softcap) && softcap >= 0.0, "dmfx::", op,
                    ": softcap must be finite and >= 0 (0: the logits are not soft-capped), got ", softcap);
  a.softcap = softcap;
  const auto stat = ce_stat_dtype(logits);
  TORCH_CHECK(lse.device() == logits.device() && lse.scalar_type() == stat && lse.dim() == 2 && lse.size(0) == a.N &&
                  lse.size(1) == 2,
              "dmfx::", op, ": lse must be the forward's [", a.N, ", 2] ", stat, " tensor on ", logits.device(),
              " (each row's max and log-sum), got ", lse.sizes(), " ", lse.scalar_type(), " on ", lse.device());
  const bool per_row = reduction == kReduceNone;
  TORCH_CHECK(grad_loss.device() == logits.device() && grad_loss.scalar_type() == stat &&
                  (per_row ? grad_loss.dim() == 1 && grad_loss.size(0) == a.N : grad_loss.numel() == 1),
              "dmfx::", op, ": grad_loss must be a ", stat, " tensor on ", logits.device(), " of shape ",
              per_row ? "[N] (reduction none)" : "[] (a reduced loss)", ", got ", grad_loss.sizes(), " ",
              grad_loss.scalar_type(), " on ", grad_loss.device());
  if (present(grad_logits)) {
    const at::Tensor& gl = *grad_logits;
    TORCH_CHECK(gl.device() == logits.device() && gl.scalar_type() == logits.scalar_type() &&
                    gl.sizes() == logits.sizes(),
                "dmfx::", op, ": grad_logits must have the shape, dtype and device of logits (", logits.sizes(), " ",
                logits.scalar_type(), " on ", logits.device(), "), got ", gl.sizes(), " ", gl.scalar_type(), " on ",
                gl.device());
  }
  return a;
}

// Logits (or grad_logits) as the kernels read them: unit stride along V (else a contiguous copy).
inline at::Tensor ce_rows(const at::Tensor& t) { return t.size(1) <= 1 || t.stride(1) == 1 ? t : t.contiguous(); }

// The row stride of a tensor ce_rows returned (any value for a single row).
inline int64_t ce_row_stride(const at::Tensor& t) { return t.size(0) <= 1 ? t.size(1) : t.stride(0); }

}  // namespace cross_entropy_impl
}  // namespace dmfx

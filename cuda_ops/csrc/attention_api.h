// Host-side argument checking shared by the CPU (attention_cpu.cpp) and CUDA (attention_cuda.cu)
// fused ("flash") attention kernels: q [B, Hq, Lq, D], k [B, Hk, Lk, D], v [B, Hk, Lk, Dv] (Hq a
// multiple of Hk), each with a unit stride in the head dim; the softmax arguments and the mask as the
// softmax kernels read them (softmax_api.h). What differs per device (the device itself, the dtypes,
// the head dims) each file checks on top.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cmath>
#include <limits>
#include <vector>

#include "dmfx_common.h"
#include "softmax_api.h"

namespace dmfx {
namespace attention_impl {

struct Shapes {
  int64_t B, Hq, Hk, Lq, Lk, D, Dv, groups;
  int64_t block = 1;  // the CPU kernel's query rows per block
};

// The checks and shapes both kernels need; `device` ("CPU" / "CUDA") names the kernel in the error
// about an input on another device, `on_device` tests it.
template <typename OnDevice>
inline Shapes check_qkv(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const char* device, OnDevice&& on_device) {
  for (const auto* t : {&q, &k, &v}) {
    TORCH_CHECK(on_device(*t), "dmfx::", op, ": this is the ", device, " kernel but an input is on ", t->device());
    TORCH_CHECK(t->device() == q.device(), "dmfx::", op, ": q, k and v must be on one device, got ", q.device(),
                " and ", t->device());
    TORCH_CHECK(t->dim() == 4, "dmfx::", op, ": q, k and v must be 4-D [B, H, L, D], got shape ", t->sizes());
    TORCH_CHECK(t->scalar_type() == q.scalar_type(), "dmfx::", op, ": q, k and v must have one dtype");
    TORCH_CHECK(t->size(3) <= 1 || t->stride(3) == 1, "dmfx::", op,
                ": q, k and v need a unit stride in the head dim, got strides ", t->strides());
  }
  Shapes s{q.size(0), q.size(1), k.size(1), q.size(2), k.size(2), q.size(3), v.size(3), 1};
  TORCH_CHECK(k.size(0) == s.B && v.size(0) == s.B && v.size(1) == s.Hk && v.size(2) == s.Lk &&
                  k.size(3) == s.D && s.Hk > 0 && s.Hq % s.Hk == 0,
              "dmfx::", op, ": q ", q.sizes(), ", k ", k.sizes(), " and v ", v.sizes(),
              " do not fit [B, Hq, Lq, D], [B, Hk, Lk, D], [B, Hk, Lk, Dv] with Hq a multiple of Hk");
  s.groups = s.Hq / s.Hk;
  return s;
}

inline void check_out(const char* op, const char* name, const at::Tensor& t, at::IntArrayRef shape,
                      const at::Tensor& like) {
  TORCH_CHECK(t.sizes() == shape && t.scalar_type() == like.scalar_type() && t.device() == like.device(),
              "dmfx::", op, ": ", name, " must be a ", like.scalar_type(), " tensor of shape ", shape, " on ",
              like.device(), ", got ", t.scalar_type(), " ", t.sizes(), " on ", t.device());
  TORCH_CHECK(t.size(3) <= 1 || t.stride(3) == 1, "dmfx::", op, ": ", name, " needs a unit last-dim stride");
}

// The backward's gradient buffers, the forward's row statistics (of dtype `stats_dtype`) and the
// optional bias_part ([3, B, H, D] per-(batch, head) column sums of dq, dk, dv).
inline void check_backward(const Shapes& s, const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                           const at::Tensor& v, const at::Tensor& stats, at::ScalarType stats_dtype,
                           const at::Tensor& dq, const at::Tensor& dk, const at::Tensor& dv,
                           const c10::optional<at::Tensor>& bias_part) {
  check_out("flash_bwd", "grad_out", grad_out, {s.B, s.Hq, s.Lq, s.Dv}, q);
  check_out("flash_bwd", "dq", dq, q.sizes(), q);
  check_out("flash_bwd", "dk", dk, k.sizes(), q);
  check_out("flash_bwd", "dv", dv, v.sizes(), q);
  TORCH_CHECK(stats.sizes() == at::IntArrayRef({2, s.B, s.Hq, s.Lq}) && stats.is_contiguous() &&
                  stats.scalar_type() == stats_dtype && stats.device() == q.device(),
              "dmfx::flash_bwd: stats must be the forward's contiguous ", stats_dtype,
              " [2, B, Hq, Lq] row statistics on ", q.device(), ", got ", stats.scalar_type(), " ", stats.sizes(),
              " on ", stats.device());
  if (bias_part) {
    TORCH_CHECK(s.groups == 1, "dmfx::flash_bwd: bias gradients need as many key/value heads as query heads");
    const auto& bp = *bias_part;
    TORCH_CHECK(bp.sizes() == at::IntArrayRef({3, s.B, s.Hq, s.D}) && bp.is_contiguous() &&
                    bp.scalar_type() == q.scalar_type() && bp.device() == q.device() && s.D == s.Dv,
                "dmfx::flash_bwd: bias_part must be a contiguous [3, B, H, D] tensor of q's dtype, got ", bp.sizes());
  }
}

inline softmax_impl::SoftmaxArgs row_args(const Shapes& s, double scale, bool causal, int64_t seed, int64_t offset,
                                          double p, double softcap = 0.0) {
  TORCH_CHECK(std::isfinite(scale), "dmfx::attention: scale must be finite, got ", scale);
  TORCH_CHECK(std::isfinite(softcap) && softcap >= 0, "dmfx::flash_attention: softcap must be finite and >= 0 "
              "(0: no soft-capping), got ", softcap);
  check_p("attention", p);
  softmax_impl::SoftmaxArgs a;
  a.Sk = s.Lk;
  a.Sq = s.Lq;
  a.rows = s.B * s.Hq * s.Lq;
  a.scale = scale;
  a.causal = causal;
  a.dropout = make_dropout_params(p, seed, offset);
  a.keep_scale = a.dropout.scale;
  a.softcap = softcap;
  return a;
}

// Inputs with nothing to compute, shared by the CPU and CUDA entry points. Forward: no query rows
// (true, stats left empty) or no keys (out = 0, stats = (-inf, 0): every row fully masked). Backward:
// no rows or no keys (every gradient 0). Returns whether the caller is done.
inline bool flash_fwd_trivial(const Shapes& s, at::Tensor& out, at::Tensor& stats) {
  if (s.B * s.Hq * s.Lq == 0) return true;
  if (s.Lk != 0) return false;
  out.zero_();
  stats[0].fill_(-std::numeric_limits<double>::infinity());
  stats[1].zero_();
  return true;
}

inline bool flash_bwd_trivial(const Shapes& s, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv,
                              const c10::optional<at::Tensor>& bias_part) {
  if (s.B * s.Hk == 0) return true;
  if (s.Lq != 0 && s.Lk != 0) return false;
  dq.zero_();
  dk.zero_();
  dv.zero_();
  if (bias_part) bias_part->zero_();
  return true;
}

// ------------------------------------------------------------------------------------------------
// The variable-length ("varlen") form: q [T, Hq, D], k [T, Hk, D], v [T, Hk, Dv] hold B sequences
// packed back to back, sequence b in rows cu_seqlens[b] .. cu_seqlens[b + 1]; each query row attends
// the keys of its own sequence only (causal: those up to its own position in it). Score row i of
// query head h in sequence b (start s) is row h * T + s + i of a block-diagonal [Hq, T, T] score
// matrix and its key j column s + j: the row indexes the statistics [2, Hq, T], the row-major index
// (h * T + s + i) * T + s + j the Philox dropout mask.
// ------------------------------------------------------------------------------------------------

struct VarlenShapes {
  int64_t T, B, Hq, Hk, D, Dv, groups;
};

// The checks and shapes both varlen kernels need (as check_qkv for the dense form); `device`
// names the kernel in the error about an input on another device, `on_device` tests it.
template <typename OnDevice>
inline VarlenShapes check_varlen_qkv(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                     const at::Tensor& cu_seqlens, const char* device, OnDevice&& on_device) {
  for (const auto* t : {&q, &k, &v}) {
    TORCH_CHECK(on_device(*t), "dmfx::", op, ": this is the ", device, " kernel but an input is on ", t->device());
    TORCH_CHECK(t->device() == q.device(), "dmfx::", op, ": q, k and v must be on one device, got ", q.device(),
                " and ", t->device());
    TORCH_CHECK(t->dim() == 3, "dmfx::", op, ": q, k and v must be 3-D [T, H, D], got shape ", t->sizes());
    TORCH_CHECK(t->scalar_type() == q.scalar_type(), "dmfx::", op, ": q, k and v must have one dtype");
    TORCH_CHECK(t->size(2) <= 1 || t->stride(2) == 1, "dmfx::", op,
                ": q, k and v need a unit stride in the head dim, got strides ", t->strides());
  }
  VarlenShapes s{q.size(0), cu_seqlens.numel() - 1, q.size(1), k.size(1), q.size(2), v.size(2), 1};
  TORCH_CHECK(k.size(0) == s.T && v.size(0) == s.T && v.size(1) == s.Hk && k.size(2) == s.D && s.Hk > 0 &&
                  s.Hq % s.Hk == 0,
              "dmfx::", op, ": q ", q.sizes(), ", k ", k.sizes(), " and v ", v.sizes(),
              " do not fit [T, Hq, D], [T, Hk, D], [T, Hk, Dv] with Hq a multiple of Hk");
  TORCH_CHECK(cu_seqlens.dim() == 1 && cu_seqlens.numel() >= 2 &&
                  (cu_seqlens.scalar_type() == at::kInt || cu_seqlens.scalar_type() == at::kLong) &&
                  cu_seqlens.device() == q.device(),
              "dmfx::", op, ": cu_seqlens must be a 1-D int32 or int64 tensor [B + 1] (B >= 1) on ", q.device(),
              ", got ", cu_seqlens.scalar_type(), " ", cu_seqlens.sizes(), " on ", cu_seqlens.device());
  s.groups = s.Hq / s.Hk;
  return s;
}

// The sequence starts cu_seqlens[0 .. B] of a CPU cu_seqlens, checked: cu[0] = 0, non-decreasing,
// cu[B] = T (ValueError naming `op`). (The CUDA kernels never read them on the host: they clamp each
// sequence into [0, T] instead, see attention_cuda.cu.)
inline std::vector<int64_t> cu_seqlens_values(const char* op, const at::Tensor& cu_seqlens, int64_t T) {
  TORCH_CHECK_VALUE(cu_seqlens.device().is_cpu(), "dmfx::", op, ": internal error: cu_seqlens read on the host");
  const at::Tensor c = cu_seqlens.contiguous();
  const int64_t n = c.numel();
  std::vector<int64_t> cu(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    cu[i] = c.scalar_type() == at::kInt ? c.data_ptr<int32_t>()[i] : c.data_ptr<int64_t>()[i];
  TORCH_CHECK_VALUE(n >= 1 && cu[0] == 0, "dmfx::", op, ": cu_seqlens must start at 0, got cu_seqlens[0] = ",
                    n ? cu[0] : 0);
  for (int64_t i = 1; i < n; ++i)
    TORCH_CHECK_VALUE(cu[i] >= cu[i - 1], "dmfx::", op, ": cu_seqlens must be non-decreasing (sequence lengths >= 0), got cu_seqlens[",
                      i, "] = ", cu[i], " < cu_seqlens[", i - 1, "] = ", cu[i - 1]);
  TORCH_CHECK_VALUE(cu[n - 1] == T, "dmfx::", op, ": cu_seqlens must end at T = ", T,
                    " (the packed rows of q, k and v), got cu_seqlens[", n - 1, "] = ", cu[n - 1]);
  return cu;
}

inline void check_varlen_out(const char* op, const char* name, const at::Tensor& t, at::IntArrayRef shape,
                             const at::Tensor& like) {
  TORCH_CHECK(t.sizes() == shape && t.scalar_type() == like.scalar_type() && t.device() == like.device(),
              "dmfx::", op, ": ", name, " must be a ", like.scalar_type(), " tensor of shape ", shape, " on ",
              like.device(), ", got ", t.scalar_type(), " ", t.sizes(), " on ", t.device());
  TORCH_CHECK(t.size(-1) <= 1 || t.stride(-1) == 1, "dmfx::", op, ": ", name, " needs a unit last-dim stride");
}

// The backward's tensors: grad_out and out [T, Hq, Dv], the gradient buffers like q, k, v, and the
// forward's row statistics [2, Hq, T] (contiguous, of dtype `stats_dtype`).
inline void check_varlen_backward(const VarlenShapes& s, const at::Tensor& grad_out, const at::Tensor& q,
                                  const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                                  const at::Tensor& stats, at::ScalarType stats_dtype, const at::Tensor& dq,
                                  const at::Tensor& dk, const at::Tensor& dv) {
  check_varlen_out("varlen_bwd", "grad_out", grad_out, {s.T, s.Hq, s.Dv}, q);
  check_varlen_out("varlen_bwd", "out", out, {s.T, s.Hq, s.Dv}, q);
  check_varlen_out("varlen_bwd", "dq", dq, q.sizes(), q);
  check_varlen_out("varlen_bwd", "dk", dk, k.sizes(), q);
  check_varlen_out("varlen_bwd", "dv", dv, v.sizes(), q);
  TORCH_CHECK(stats.sizes() == at::IntArrayRef({2, s.Hq, s.T}) && stats.is_contiguous() &&
                  stats.scalar_type() == stats_dtype && stats.device() == q.device(),
              "dmfx::varlen_bwd: stats must be the forward's contiguous ", stats_dtype,
              " [2, Hq, T] row statistics on ", q.device(), ", got ", stats.scalar_type(), " ", stats.sizes(), " on ",
              stats.device());
}

// The row math's arguments (scale, causal, dropout); the causal limit is per sequence (the kernels').
inline softmax_impl::SoftmaxArgs varlen_args(double scale, bool causal, int64_t seed, int64_t offset, double p) {
  TORCH_CHECK(std::isfinite(scale), "dmfx::varlen_attention: scale must be finite, got ", scale);
  check_p("varlen_attention", p);
  softmax_impl::SoftmaxArgs a;
  a.scale = scale;
  a.causal = causal;
  a.dropout = make_dropout_params(p, seed, offset);
  a.keep_scale = a.dropout.scale;
  return a;
}

// The mask as the softmax kernels read it, broadcast to the [B, Hq, Lq, Lk] scores.
inline softmax_impl::MaskView mask_view(const char* op, const c10::optional<at::Tensor>& mask, const Shapes& s,
                                        const at::Tensor& q) {
  return softmax_impl::prepare_mask(op, mask, at::empty({1}, q.options()).expand({s.B, s.Hq, s.Lq, s.Lk}));
}

}  // namespace attention_impl
}  // namespace dmfx

// The attention family's ops (schemas in cuda_ops/attention.py) for any device: the GEMM form (ATen's
// batched GEMMs, MKL / cuBLAS, around dmfx::attention_softmax, called through the dispatcher: the
// families share no internals) and the fused (flash) form on top of K, the device's kernel set (static
// flash_ok(q, v): whether its fused kernels take these operands; flash_fwd, flash_bwd with the
// signatures of attention_cpu.cpp's functions). attention_cpu.cpp registers them with the CPU kernels
// (and the family's autograd formulas), attention_cuda_bind.cpp with the CUDA ones.
//
// Every GEMM reads its operands where they are (views of the projections' [B, L, H, D] outputs) and
// writes its result in the layout its consumer wants; where the fused kernels do not take the operands
// (a dtype or head dim they lack), the flash ops run the GEMM form, with the same dropout mask.
// The op-level argument checks raise ValueError / TypeError, as the Python kernels did (op_api.h).
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/ops/baddbmm.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <array>
#include <cmath>
#include <tuple>
#include <utility>
#include <vector>

#include "attention_api.h"
#include "op_api.h"

namespace dmfx {
namespace attention_ops {

using at::Tensor;
using Opt = c10::optional<at::Tensor>;
using Tensor3 = std::tuple<Tensor, Tensor, Tensor>;

// ----------------------------------------------------------------------------------------- checks

// q, k and v: tensors of one score dtype on one device, each `dim`-D (`layout` names the dims).
inline void check_qkv_tensors(const char* op, const Tensor& q, const Tensor& k, const Tensor& v, int64_t dim,
                              const char* layout) {
  const std::pair<const char*, const Tensor*> named[] = {{"q", &q}, {"k", &k}, {"v", &v}};
  for (const auto& [name, t] : named) {
    TORCH_CHECK_VALUE(t->dim() == dim, "dmfx::", op, ": ", name, " must be ", dim, "-D ", layout, ", got shape ",
                      t->sizes());
    TORCH_CHECK_TYPE(is_score_dtype(t->scalar_type()), "dmfx::", op, ": ", name,
                     " must be float32, float16, bfloat16 or float64, got ", t->scalar_type());
  }
  TORCH_CHECK_TYPE(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(), "dmfx::", op,
                   ": q, k and v must have one dtype, got ", q.scalar_type(), ", ", k.scalar_type(), ", ",
                   v.scalar_type());
  TORCH_CHECK_VALUE(q.device() == k.device() && k.device() == v.device(), "dmfx::", op,
                    ": q, k and v must be on one device, got ", q.device(), ", ", k.device(), ", ", v.device());
}

inline void check_qkv(const char* op, const Tensor& q, const Tensor& k, const Tensor& v) {
  check_qkv_tensors(op, q, k, v, 4, "[batch, heads, seq, head_dim]");
  const int64_t Hq = q.size(1), Hk = k.size(1);
  TORCH_CHECK_VALUE(q.size(0) == k.size(0) && k.size(0) == v.size(0) && Hk == v.size(1) && k.size(2) == v.size(2) &&
                        q.size(3) == k.size(3),
                    "dmfx::", op, ": q ", q.sizes(), ", k ", k.sizes(), " and v ", v.sizes(),
                    " do not fit [B, Hq, Lq, D], [B, Hk, Lk, D], [B, Hk, Lk, Dv]");
  TORCH_CHECK_VALUE(Hk != 0 && Hq % Hk == 0, "dmfx::", op, ": q's ", Hq, " heads must be a multiple of k's and v's ",
                    Hk, " heads");
}

// Every check of a forward: q, k, v and the softmax's (mask, causal, dropout) on the [B, Hq, Lq, Lk] scores.
inline void check_forward(const char* op, const Tensor& q, const Tensor& k, const Tensor& v, const Opt& mask,
                          bool causal, const Opt& seed, double p) {
  check_qkv(op, q, k, v);
  check_score_args(op, {q.size(0), q.size(1), q.size(2), k.size(2)}, q.device(), mask, causal, seed, p);
}

// q, k, v ([B, H, L, D] views) of the stacked projection qkv [B, L, 3 * heads * D].
inline std::array<Tensor, 3> split_qkv(const char* op, const Tensor& qkv, int64_t heads) {
  TORCH_CHECK_VALUE(qkv.dim() == 3, "dmfx::", op, ": qkv must be 3-D [batch, seq, 3 * heads * head_dim], got shape ",
                    qkv.sizes());
  TORCH_CHECK_VALUE(heads > 0 && qkv.size(2) % (3 * heads) == 0, "dmfx::", op, ": qkv's last dim ", qkv.size(2),
                    " is not 3 * heads * head_dim with heads=", heads);
  const Tensor per = qkv.unflatten(2, {3, heads, qkv.size(2) / (3 * heads)});  // [B, L, 3, H, D]
  return {per.select(2, 0).transpose(1, 2), per.select(2, 1).transpose(1, 2), per.select(2, 2).transpose(1, 2)};
}

// ----------------------------------------------------------------------------------------- layouts

// An empty [B, H, L, D] tensor laid out as [B, L, H, D]. (Sizes may be symbolic: the autograd formulas
// run on traced tensors too.)
inline Tensor blhd(const c10::SymInt& B, const c10::SymInt& H, const c10::SymInt& L, const c10::SymInt& D,
                   const Tensor& like) {
  return at::empty_symint({B, L, H, D}, like.options()).transpose(1, 2);
}

// The attention output [B, Hq, Lq, Dv], laid out as [B, Lq, Hq, Dv].
inline Tensor context(const Tensor& q, const Tensor& v) {
  return blhd(q.sym_size(0), q.sym_size(1), q.sym_size(2), v.sym_size(3), q);
}

// An empty gradient of the [B, H, L, D] tensor t, laid out as [B, L, H, D].
inline Tensor grad_like(const Tensor& t) { return blhd(t.sym_size(0), t.sym_size(1), t.sym_size(2), t.sym_size(3), t); }

inline at::ScalarType stats_dtype(const Tensor& q) {
  return q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// The fused kernels read q, k, v (and the output gradient) with a unit stride in the head dim: a copy
// of a tensor that lacks it (the ops accept any strides; the passes never hand such views).
inline Tensor rows(const Tensor& t) { return t.size(-1) <= 1 || t.stride(-1) == 1 ? t : t.contiguous(); }

// ----------------------------------------------------------------------------------------- GEMMs

// Whether t's first two dims fold into one batch dim as a view.
inline bool mergeable(const Tensor& t) {
  return t.size(0) == 1 || t.size(1) == 1 || t.stride(0) == t.size(1) * t.stride(1);
}

// out[i, j] (+)= alpha * a[i, j] @ b[i, j] for 4-D strided operands, written into `out` in place.
// ATen's bmm reads any operand whose matrices have a unit stride in one dim and any batch stride, and
// writes a strided `out` directly, so a view of a projection output is a GEMM operand as it is. When
// the first two dims fold into one batch dim for all three tensors this is one bmm, else one per batch.
inline void bmm4(const Tensor& a, const Tensor& b, const Tensor& out, double alpha = 1.0, bool accumulate = false) {
  auto gemm = [&](const Tensor& x, const Tensor& y, Tensor o) {
    if (accumulate) {
      o.baddbmm_(x, y, 1, alpha);
    } else if (alpha != 1.0) {
      at::baddbmm_out(o, o, x, y, 0, alpha);
    } else {
      at::bmm_out(o, x, y);
    }
  };
  if (mergeable(a) && mergeable(b) && mergeable(out)) {
    gemm(a.flatten(0, 1), b.flatten(0, 1), out.flatten(0, 1));
    return;
  }
  for (int64_t i = 0; i < a.size(0); ++i) gemm(a.select(0, i), b.select(0, i), out.select(0, i));
}

// The `groups` [B, Hk, ...] slices of a [B, Hk * groups, ...] tensor that share one k/v head.
inline std::vector<Tensor> head_groups(const Tensor& t, int64_t groups) {
  if (groups == 1) return {t};
  const Tensor per = t.unflatten(1, {t.size(1) / groups, groups});
  std::vector<Tensor> out;
  for (int64_t g = 0; g < groups; ++g) out.push_back(per.select(2, g));
  return out;
}

using SoftmaxSig = std::tuple<Tensor, Tensor>(const Tensor&, const Opt&, double, bool, const Opt&, double);
using SoftmaxBackwardSig = Tensor(const Tensor&, const Tensor&, const Opt&, double, double, const Opt&, double);

inline Tensor softmax_backward(const Tensor& grad, const Tensor& probs, const Opt& seed, double p, double scale) {
  static const auto op = dmfx_op<SoftmaxBackwardSig>("dmfx::attention_softmax_backward");
  return op.call(grad, probs, seed, p, scale, c10::nullopt, 1.0);
}

// The GEMM form's forward into `out`: (out, probs, dropped); dropped is empty ([0]) when p == 0.
inline Tensor3 gemm_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Opt& mask, double scale,
                            bool causal, const Opt& seed, double p, const Tensor& out) {
  const int64_t g = q.size(1) / k.size(1);
  Tensor scores = at::empty({q.size(0), q.size(1), q.size(2), k.size(2)}, q.options());
  const Tensor kt = k.transpose(2, 3);
  const auto qs = head_groups(q, g), ss = head_groups(scores, g);
  for (int64_t i = 0; i < g; ++i) bmm4(qs[i], kt, ss[i]);
  static const auto softmax = dmfx_op<SoftmaxSig>("dmfx::attention_softmax");
  auto [first, second] = softmax.call(scores, mask, scale, causal, seed, p);
  scores.reset();
  // the softmax returns (dropped, probs) with dropout and (probs, empty) without
  const auto fs = head_groups(first, g), os = head_groups(out, g);
  for (int64_t i = 0; i < g; ++i) bmm4(fs[i], v, os[i]);
  if (p > 0.0) return {out, std::move(second), std::move(first)};
  return {out, std::move(first), std::move(second)};
}

// The GEMM form's backward: dq, dk, dv written in place; returns dz (the gradient of the masked scores
// before scaling) when mask_grad, else an empty tensor.
inline Tensor gemm_backward(const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v,
                            const Tensor& probs, const Tensor& dropped, const Opt& seed, double p, double scale,
                            bool mask_grad, const Opt& grad_probs, const Opt& grad_dropped, const Tensor& dq,
                            const Tensor& dk, const Tensor& dv) {
  const int64_t g = q.size(1) / k.size(1);
  const Tensor& used = p > 0.0 ? dropped : probs;  // what multiplied v
  const auto us = head_groups(used, g), gs = head_groups(grad_out, g);
  // dv = usedᵀ · dO (summed over the query heads sharing a kv head)
  for (int64_t i = 0; i < g; ++i) bmm4(us[i].transpose(2, 3), gs[i], dv, 1.0, i > 0);
  // d(used) = dO · vᵀ, then the fused dropout + softmax backward
  Tensor d_used = at::empty(used.sizes(), q.options());
  const Tensor vt = v.transpose(2, 3);
  const auto ds = head_groups(d_used, g);
  for (int64_t i = 0; i < g; ++i) bmm4(gs[i], vt, ds[i]);
  if (present(grad_dropped) && p > 0.0) d_used.add_(*grad_dropped);  // a gradient reaching the returned outputs too
  if (present(grad_probs) && p == 0.0) d_used.add_(*grad_probs);
  const double kscale = mask_grad ? 1.0 : scale;
  Tensor dz = softmax_backward(d_used, probs, seed, p, kscale);
  d_used.reset();
  if (present(grad_probs) && p > 0.0) dz.add_(softmax_backward(*grad_probs, probs, c10::nullopt, 0.0, kscale));
  const double alpha = mask_grad ? scale : 1.0;  // dS = scale * dz: applied by the softmax kernel or the GEMMs
  const auto zs = head_groups(dz, g), qs = head_groups(q, g), dqs = head_groups(dq, g);
  for (int64_t i = 0; i < g; ++i) {
    bmm4(zs[i], k, dqs[i], alpha);
    bmm4(zs[i].transpose(2, 3), qs[i], dk, alpha, i > 0);
  }
  return mask_grad ? dz : at::empty({0}, dz.options());
}

// ----------------------------------------------------------------------------------------- fused form

// Soft-capped scores (softcap > 0) only the fused kernels compute: elsewhere a clear error.
inline void check_softcap_runs(const char* op, bool fused, double softcap, const Tensor& q, const Tensor& v) {
  TORCH_CHECK(softcap == 0 || fused, "dmfx::", op, ": softcap (soft-capped scores) needs dmfx's fused kernel, which "
              "takes float32/float64 on the CPU and float32/float16/bfloat16 with head dims up to 128 on CUDA; got ",
              q.scalar_type(), " on ", q.device(), " with head dims ", q.size(-1), " and ", v.size(-1),
              " (dmfx's attention pass leaves such soft-capped attention to PyTorch)");
}

// The fused forward into `out` where K's kernels take the operands, else the GEMM form (whose
// probabilities are dropped: the fused backward recomputes them). Returns (out, stats).
template <class K>
std::tuple<Tensor, Tensor> flash_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Opt& mask,
                                         double scale, bool causal, const Opt& seed, double p, const Tensor& out,
                                         double softcap = 0.0) {
  check_softcap_runs("flash_attention", K::flash_ok(q, v), softcap, q, v);
  if (K::flash_ok(q, v)) {
    const auto [s, o] = seed_values("flash_attention", seed);
    Tensor stats = K::flash_fwd(rows(q), rows(k), rows(v), kernel_mask(mask, q.scalar_type()), scale, causal, s, o, p,
                                out, softcap);
    return {out, std::move(stats)};
  }
  gemm_forward(q, k, v, mask, scale, causal, seed, p, out);
  // (unused by the unfused backward)
  return {out, at::empty({2, q.size(0), q.size(1), q.size(2)}, q.options().dtype(stats_dtype(q)))};
}

// dq, dk, dv written in place; with `bias_part` ([3, B, H, D]) the fused kernel also writes each
// (batch, head)'s column sums of dq, dk, dv there (the unfused path leaves them to the caller).
// `stats` may come in any layout: a compiler may relay out a saved tensor between the forward and the
// backward (Inductor's layout optimization made a SegFormer block's stats channels-last), so the
// kernels get a contiguous copy where it is not (the varlen backwards below likewise).
template <class K>
void flash_backward(const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& stats,
                    const Opt& mask, double scale, bool causal, const Opt& seed, double p, const Tensor& dq,
                    const Tensor& dk, const Tensor& dv, const Opt& bias_part, double softcap = 0.0) {
  check_softcap_runs("flash_attention_backward", K::flash_ok(q, v), softcap, q, v);
  if (K::flash_ok(q, v)) {
    const auto [s, o] = seed_values("flash_attention_backward", seed);
    K::flash_bwd(rows(grad_out), rows(q), rows(k), rows(v), stats.contiguous(), kernel_mask(mask, q.scalar_type()),
                 scale, causal, s, o, p, dq, dk, dv, bias_part, softcap);
    return;
  }
  // unfused: recompute the probabilities (and the dropped ones) once, then the GEMM backward
  auto [out, probs, dropped] = gemm_forward(q, k, v, mask, scale, causal, seed, p, context(q, v));
  gemm_backward(grad_out, q, k, v, probs, dropped, seed, p, scale, false, c10::nullopt, c10::nullopt, dq, dk, dv);
}

// The [3, B, H, D] buffer the fused backward writes each (batch, head)'s dq, dk, dv column sums into, or
// none: not asked for, no fused kernel here, or grouped-query k/v.
template <class K>
Opt bias_part(bool bias_grad, const Tensor& q, const Tensor& k, const Tensor& v) {
  if (bias_grad && K::flash_ok(q, v) && q.size(1) == k.size(1) && q.size(3) == v.size(3)) {
    return at::empty({3, q.size(0), q.size(1), q.size(3)}, q.options());
  }
  return c10::nullopt;
}

// ----------------------------------------------------------------------------------------- the ops

inline Tensor3 attention(const Tensor& q, const Tensor& k, const Tensor& v, const Opt& mask, double scale, bool causal,
                         const Opt& seed, double p) {
  check_forward("attention", q, k, v, mask, causal, seed, p);
  return gemm_forward(q, k, v, mask, scale, causal, seed, p, context(q, v));
}

inline std::tuple<Tensor, Tensor, Tensor, Tensor> attention_backward(
    const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& probs,
    const Tensor& dropped, const Opt& seed, double p, double scale, bool mask_grad, const Opt& grad_probs,
    const Opt& grad_dropped) {
  const char* op = "attention_backward";
  check_qkv(op, q, k, v);
  check_dropout(op, p, seed);
  Tensor dq = grad_like(q), dk = grad_like(k), dv = grad_like(v);
  Tensor dz = gemm_backward(grad_out, q, k, v, probs, dropped, seed, p, scale, mask_grad, grad_probs, grad_dropped,
                            dq, dk, dv);
  return {dq, dk, dv, dz};
}

inline Tensor3 qkv_attention(const Tensor& qkv, int64_t heads, const Opt& mask, double scale, bool causal,
                             const Opt& seed, double p) {
  const char* op = "qkv_attention";
  const auto [q, k, v] = split_qkv(op, qkv, heads);
  check_forward(op, q, k, v, mask, causal, seed, p);
  return gemm_forward(q, k, v, mask, scale, causal, seed, p, context(q, v));
}

inline std::tuple<Tensor, Tensor> qkv_attention_backward(const Tensor& grad_out, const Tensor& qkv, int64_t heads,
                                                         const Tensor& probs, const Tensor& dropped, const Opt& seed,
                                                         double p, double scale, bool mask_grad,
                                                         const Opt& grad_probs, const Opt& grad_dropped) {
  const char* op = "qkv_attention_backward";
  const auto [q, k, v] = split_qkv(op, qkv, heads);
  check_dropout(op, p, seed);
  Tensor dqkv = at::empty(qkv.sizes(), qkv.options());
  const auto [dq, dk, dv] = split_qkv(op, dqkv, heads);
  Tensor dz = gemm_backward(grad_out, q, k, v, probs, dropped, seed, p, scale, mask_grad, grad_probs, grad_dropped,
                            dq, dk, dv);
  return {dqkv, dz};
}

template <class K>
std::tuple<Tensor, Tensor> flash_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Opt& mask,
                                           double scale, bool causal, const Opt& seed, double p, double softcap) {
  check_forward("flash_attention", q, k, v, mask, causal, seed, p);
  return flash_forward<K>(q, k, v, mask, scale, causal, seed, p, context(q, v), softcap);
}

// The bias gradients ([H * D] each) of the projections that produced q, k, v ([B, H, L, D] views of
// [B, L, H * D]): the kernel's per-(batch, head) sums `part` summed over the batch, or, where the kernel
// did not sum (unfused path, grouped-query k/v), the gradients summed here.
inline Tensor3 head_bias_grads(const Opt& part, const Tensor& dq, const Tensor& dk, const Tensor& dv) {
  if (part) {  // (three tensors: outputs must not alias)
    auto sum = [&](int64_t i) { return part->select(0, i).sum(at::IntArrayRef{0}).reshape({-1}); };
    return {sum(0), sum(1), sum(2)};
  }
  auto sum = [](const Tensor& g) { return g.sum(at::IntArrayRef{0, 2}).reshape({-1}); };
  return {sum(dq), sum(dk), sum(dv)};
}

template <class K>
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> flash_attention_backward(
    const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& stats, const Opt& mask,
    double scale, bool causal, const Opt& seed, double p, bool bias_grad, double softcap) {
  const char* op = "flash_attention_backward";
  check_qkv(op, q, k, v);
  check_dropout(op, p, seed);
  Tensor dq = grad_like(q), dk = grad_like(k), dv = grad_like(v);
  const Opt part = bias_part<K>(bias_grad, q, k, v);
  flash_backward<K>(grad_out, q, k, v, stats, mask, scale, causal, seed, p, dq, dk, dv, part, softcap);
  if (!bias_grad) {
    Tensor none = at::empty({0}, dq.options());
    return {dq, dk, dv, none, none.clone(), none.clone()};
  }
  auto [dbq, dbk, dbv] = head_bias_grads(part, dq, dk, dv);
  return {dq, dk, dv, dbq, dbk, dbv};
}

template <class K>
std::tuple<Tensor, Tensor> qkv_flash_attention(const Tensor& qkv, int64_t heads, const Opt& mask, double scale,
                                               bool causal, const Opt& seed, double p) {
  const char* op = "qkv_flash_attention";
  const auto [q, k, v] = split_qkv(op, qkv, heads);
  check_forward(op, q, k, v, mask, causal, seed, p);
  return flash_forward<K>(q, k, v, mask, scale, causal, seed, p, context(q, v));
}

template <class K>
std::tuple<Tensor, Tensor> qkv_flash_attention_backward(const Tensor& grad_out, const Tensor& qkv, int64_t heads,
                                                        const Tensor& stats, const Opt& mask, double scale,
                                                        bool causal, const Opt& seed, double p, bool bias_grad) {
  const char* op = "qkv_flash_attention_backward";
  const auto [q, k, v] = split_qkv(op, qkv, heads);
  check_dropout(op, p, seed);
  Tensor dqkv = at::empty(qkv.sizes(), qkv.options());
  const auto [dq, dk, dv] = split_qkv(op, dqkv, heads);
  const Opt part = bias_part<K>(bias_grad, q, k, v);
  flash_backward<K>(grad_out, q, k, v, stats, mask, scale, causal, seed, p, dq, dk, dv, part);
  if (!bias_grad) return {dqkv, at::empty({0}, dqkv.options())};
  // the stacked projections' bias gradient: the per-(batch, head) column sums summed over the batch
  Tensor dbias = part ? part->sum(at::IntArrayRef{1}).reshape({-1}) : dqkv.sum(at::IntArrayRef{0, 1});
  return {dqkv, dbias};
}

// ----------------------------------------------------------------------------------------- varlen form
//
// Packed sequences (q [T, Hq, D], k [T, Hk, D], v [T, Hk, Dv], sequence b in rows cu_seqlens[b] ..
// cu_seqlens[b + 1]): K's fused kernels only (K::varlen_ok(q, v): whether they take the dtype and head
// dims; K::varlen_dtype: the dtype they compute a dtype in, the CPU's float32 for float16 / bfloat16:
// inputs upcast, outputs cast back; K::varlen_fwd, K::varlen_bwd with the signatures of
// attention_cpu.cpp's varlen_fwd_cpu / varlen_bwd_cpu). There is no unfused form to fall back to:
// elsewhere the ops raise NotImplementedError (the pass asks varlen_supported first).

// q, k, v ([T, H, D] views, any strides) and cu_seqlens (1-D int32 / int64 [B + 1], B >= 1, on q's device).
inline void check_varlen(const char* op, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu) {
  check_qkv_tensors(op, q, k, v, 3, "[tokens, heads, head_dim]");
  const int64_t Hq = q.size(1), Hk = k.size(1);
  TORCH_CHECK_VALUE(q.size(0) == k.size(0) && k.size(0) == v.size(0) && Hk == v.size(1) && q.size(2) == k.size(2),
                    "dmfx::", op, ": q ", q.sizes(), ", k ", k.sizes(), " and v ", v.sizes(),
                    " do not fit [T, Hq, D], [T, Hk, D], [T, Hk, Dv] (the same T packed tokens)");
  TORCH_CHECK_VALUE(Hk != 0 && Hq % Hk == 0, "dmfx::", op, ": q's ", Hq, " heads must be a multiple of k's and v's ",
                    Hk, " heads");
  TORCH_CHECK_VALUE(cu.dim() == 1, "dmfx::", op, ": cu_seqlens must be 1-D [batch + 1], got shape ", cu.sizes());
  TORCH_CHECK_TYPE(cu.scalar_type() == at::kInt || cu.scalar_type() == at::kLong, "dmfx::", op,
                   ": cu_seqlens must be int32 or int64, got ", cu.scalar_type());
  TORCH_CHECK_VALUE(cu.device() == q.device(), "dmfx::", op, ": cu_seqlens is on ", cu.device(), " but q is on ",
                    q.device(), " (it must be on q's device)");
  TORCH_CHECK_VALUE(cu.size(0) >= 2, "dmfx::", op,
                    ": cu_seqlens must hold at least one sequence [0, ..., T] (batch + 1 >= 2 entries), got shape ",
                    cu.sizes());
}

// q, k, v ([T, heads, D] views) of the stacked projection qkv [T, 3 * heads * D].
inline std::array<Tensor, 3> split_packed_qkv(const char* op, const Tensor& qkv, int64_t heads) {
  TORCH_CHECK_VALUE(qkv.dim() == 2, "dmfx::", op, ": qkv must be 2-D [tokens, 3 * heads * head_dim], got shape ",
                    qkv.sizes());
  TORCH_CHECK_VALUE(heads > 0 && qkv.size(1) % (3 * heads) == 0, "dmfx::", op, ": qkv's last dim ", qkv.size(1),
                    " is not 3 * heads * head_dim with heads=", heads);
  const Tensor per = qkv.unflatten(1, {3, heads, qkv.size(1) / (3 * heads)});  // [T, 3, H, D]
  return {per.select(1, 0), per.select(1, 1), per.select(1, 2)};
}

// Everything a varlen op checks before its kernels run: the arguments, the kernels' support for the dtype
// and head dims (NotImplementedError), and, on the CPU, cu_seqlens' values (cheap there; a CUDA op never
// reads them on the host: no synchronization, its kernels clamp every sequence into [0, T] instead).
template <class K>
void check_varlen_call(const char* op, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu, double scale,
                       const Opt& seed, double p) {
  check_varlen(op, q, k, v, cu);
  check_dropout(op, p, seed);
  TORCH_CHECK_VALUE(std::isfinite(scale), "dmfx::", op, ": scale must be finite, got ", scale);
  TORCH_CHECK_NOT_IMPLEMENTED(K::varlen_ok(q, v), "dmfx::", op, ": no fused kernel for ", q.scalar_type(),
                              " with head dims D = ", q.size(2), ", Dv = ", v.size(2), " on ", q.device(),
                              ". Supported: CPU float32 and float64 (float16 and bfloat16 computed in float32), "
                              "CUDA float32, float16 and bfloat16 with head dims up to 128 (on a GPU with enough "
                              "shared memory per block); dmfx.cuda_ops.attention.varlen_supported says which");
  if (cu.device().is_cpu()) attention_impl::cu_seqlens_values(op, cu, q.size(0));
}

// x in the dtype K's varlen kernels compute in, with a unit last-dim stride.
template <class K>
Tensor varlen_in(const Tensor& x, at::ScalarType st) {
  const auto ct = K::varlen_dtype(st);
  return rows(ct == x.scalar_type() ? x : x.to(ct));
}

// (out [T, Hq, Dv] contiguous, in dtype `out_dtype`; stats [2, Hq, T]) for q, k, v already in K's compute dtype.
template <class K>
std::tuple<Tensor, Tensor> varlen_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu,
                                          double scale, bool causal, const Opt& seed, double p,
                                          at::ScalarType out_dtype) {
  const auto [s, o] = seed_values("varlen_attention", seed);
  Tensor out = at::empty({q.size(0), q.size(1), v.size(2)}, q.options());
  Tensor stats = K::varlen_fwd(q, k, v, cu, scale, causal, s, o, p, out);
  if (out.scalar_type() != out_dtype) out = out.to(out_dtype);
  return {std::move(out), std::move(stats)};
}

template <class K>
std::tuple<Tensor, Tensor> varlen_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu_seqlens,
                                            double scale, bool causal, const Opt& seed, double p) {
  const char* op = "varlen_attention";
  check_varlen_call<K>(op, q, k, v, cu_seqlens, scale, seed, p);
  const auto st = q.scalar_type();
  return varlen_forward<K>(varlen_in<K>(q, st), varlen_in<K>(k, st), varlen_in<K>(v, st), cu_seqlens, scale, causal,
                           seed, p, st);
}

template <class K>
Tensor3 varlen_attention_backward(const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v,
                                  const Tensor& out, const Tensor& stats, const Tensor& cu_seqlens, double scale,
                                  bool causal, const Opt& seed, double p) {
  const char* op = "varlen_attention_backward";
  check_varlen_call<K>(op, q, k, v, cu_seqlens, scale, seed, p);
  const auto st = q.scalar_type();
  const auto ct = K::varlen_dtype(st);
  const auto [s, o] = seed_values(op, seed);
  Tensor dq = at::empty(q.sizes(), q.options().dtype(ct)), dk = at::empty(k.sizes(), q.options().dtype(ct)),
         dv = at::empty(v.sizes(), q.options().dtype(ct));
  K::varlen_bwd(varlen_in<K>(grad_out, st), varlen_in<K>(q, st), varlen_in<K>(k, st), varlen_in<K>(v, st),
                varlen_in<K>(out, st), stats.contiguous(), cu_seqlens, scale, causal, s, o, p, dq, dk, dv);
  if (ct != st) return {dq.to(st), dk.to(st), dv.to(st)};
  return {dq, dk, dv};
}

template <class K>
std::tuple<Tensor, Tensor> qkv_varlen_attention(const Tensor& qkv, int64_t heads, const Tensor& cu_seqlens,
                                                double scale, bool causal, const Opt& seed, double p) {
  const char* op = "qkv_varlen_attention";
  const auto [q, k, v] = split_packed_qkv(op, qkv, heads);
  check_varlen_call<K>(op, q, k, v, cu_seqlens, scale, seed, p);
  const auto st = qkv.scalar_type();
  const Tensor x = K::varlen_dtype(st) == st ? qkv : qkv.to(K::varlen_dtype(st));  // (upcast once)
  const auto [xq, xk, xv] = split_packed_qkv(op, x, heads);
  return varlen_forward<K>(rows(xq), rows(xk), rows(xv), cu_seqlens, scale, causal, seed, p, st);
}

// dq, dk, dv written straight into the column blocks of one contiguous dqkv [T, 3 * heads * D].
template <class K>
Tensor qkv_varlen_attention_backward(const Tensor& grad_out, const Tensor& qkv, int64_t heads, const Tensor& out,
                                     const Tensor& stats, const Tensor& cu_seqlens, double scale, bool causal,
                                     const Opt& seed, double p) {
  const char* op = "qkv_varlen_attention_backward";
  const auto [q, k, v] = split_packed_qkv(op, qkv, heads);
  check_varlen_call<K>(op, q, k, v, cu_seqlens, scale, seed, p);
  const auto st = qkv.scalar_type();
  const auto ct = K::varlen_dtype(st);
  const Tensor x = ct == st ? qkv : qkv.to(ct);
  const auto [xq, xk, xv] = split_packed_qkv(op, x, heads);
  const auto [s, o] = seed_values(op, seed);
  Tensor dqkv = at::empty(qkv.sizes(), qkv.options().dtype(ct));
  const auto [dq, dk, dv] = split_packed_qkv(op, dqkv, heads);
  K::varlen_bwd(varlen_in<K>(grad_out, st), rows(xq), rows(xk), rows(xv), varlen_in<K>(out, st), stats.contiguous(),
                cu_seqlens, scale, causal, s, o, p, dq, dk, dv);
  return ct == st ? dqkv : dqkv.to(st);
}

template <class K>
void register_kernels(torch::Library& m) {
  m.impl("attention", &attention);
  m.impl("attention_backward", &attention_backward);
  m.impl("qkv_attention", &qkv_attention);
  m.impl("qkv_attention_backward", &qkv_attention_backward);
  m.impl("flash_attention", &flash_attention<K>);
  m.impl("flash_attention_backward", &flash_attention_backward<K>);
  m.impl("qkv_flash_attention", &qkv_flash_attention<K>);
  m.impl("qkv_flash_attention_backward", &qkv_flash_attention_backward<K>);
  m.impl("varlen_attention", &varlen_attention<K>);
  m.impl("varlen_attention_backward", &varlen_attention_backward<K>);
  m.impl("qkv_varlen_attention", &qkv_varlen_attention<K>);
  m.impl("qkv_varlen_attention_backward", &qkv_varlen_attention_backward<K>);
}

}  // namespace attention_ops
}  // namespace dmfx

// Host-side argument checking and mask preparation shared by the CPU (softmax_cpu.cpp) and CUDA
// (softmax_cuda.cu) kernels of the fused attention softmax:
//
//   forward : z = scores * scale + mask (+ causal -inf), probs = softmax(z) over the last dim,
//             out = dropout(probs) (Philox, element index = row-major index in scores' shape)
//   backward: g = grad_out * dropout_multiplier; grad = scale * probs * (g - sum_j g * probs)
//
// The mask is broadcast to scores' shape as a VIEW (0 strides), never materialized; the kernels read
// it through a RowIndexer plus a column stride of 0 (one value per row) or 1.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <vector>

#include "dmfx_common.h"
#include "kernel_api.h"

namespace dmfx {
namespace softmax_impl {

// How the kernel reads the mask. kSame: the scores' dtype; kFloat: float32 (scores are not float32);
// kBool: True = attend (+0), False = masked out (-inf), like SDPA.
enum MaskKind : int { kNoMask = 0, kMaskSame = 1, kMaskFloat = 2, kMaskBool = 3 };

struct MaskView {
  at::Tensor t;          // the mask broadcast to scores' shape (a view), undefined when kNoMask
  int kind = kNoMask;
  int64_t col_stride = 0;  // 0 (one value per row) or 1
  RowIndexer idx;        // leading dims (rows) of the broadcast view
};

struct SoftmaxArgs {
  int64_t rows = 0, Sk = 0, Sq = 1;
  double scale = 1.0;
  double keep_scale = 1.0;  // dropout multiplier of kept elements, 1 / (1 - p), in double (fp64 kernels)
  bool causal = false;
  DropoutParams dropout;
  // flash attention only: the scores soft-capped before the mask, z = softcap * tanh(s * scale / softcap)
  // (Gemma 2's attn_logit_softcapping); 0: none. The softmax kernels leave it 0.
  double softcap = 0.0;
};

inline void check_scores(const char* op, const char* name, const at::Tensor& t,
                         c10::DeviceType device) {
  TORCH_CHECK(t.device().type() == device, "dmfx::", op, ": this is the ",
              c10::DeviceTypeName(device), " kernel but ", name, " is on ", t.device());
  const auto st = t.scalar_type();
  TORCH_CHECK(st == at::kFloat || st == at::kHalf || st == at::kBFloat16 || st == at::kDouble,
              "dmfx::", op, ": ", name, " must be float32, float16, bfloat16 or float64, got ", st);
  TORCH_CHECK(t.dim() >= 1, "dmfx::", op, ": ", name,
              " needs at least one dimension (softmax runs over the last), got a 0-dim tensor");
}

// The mask as a broadcast view of scores' shape, after checking device, dtype and shape.
inline MaskView prepare_mask(const char* op, const c10::optional<at::Tensor>& mask_in,
                             const at::Tensor& scores) {
  MaskView v;
  if (!mask_in.has_value() || !mask_in->defined()) return v;
  at::Tensor mask = *mask_in;
  TORCH_CHECK(mask.device() == scores.device(), "dmfx::", op, ": mask is on ", mask.device(),
              " but scores is on ", scores.device());
  const auto mt = mask.scalar_type();
  if (mt == at::kBool) {
    v.kind = kMaskBool;
  } else if (mt == scores.scalar_type()) {
    v.kind = kMaskSame;
  } else if (mt == at::kFloat) {
    v.kind = kMaskFloat;
  } else {
    TORCH_CHECK(false, "dmfx::", op, ": mask must be bool, float32 or scores' dtype (",
                scores.scalar_type(), "), got ", mt,
                " (dmfx.cuda_ops.softmax casts other float masks to float32 before the kernel)");
  }
  TORCH_CHECK(mask.dim() <= scores.dim(), "dmfx::", op, ": mask of shape ", mask.sizes(),
              " is not broadcastable to scores' shape ", scores.sizes(), " (more dimensions)");
  for (int64_t d = 1; d <= mask.dim(); ++d) {
    const int64_t ms = mask.size(-d), ss = scores.size(-d);
    TORCH_CHECK(ms == ss || ms == 1, "dmfx::", op, ": mask of shape ", mask.sizes(),
                " is not broadcastable to scores' shape ", scores.sizes(), " (dimension -", d,
                " has size ", ms, ", expected ", ss, " or 1)");
  }
  // A strided last dim would defeat the row loads: copy the (small, unexpanded) mask instead.
  if (mask.dim() >= 1 && mask.size(-1) > 1 && mask.stride(-1) != 1) mask = mask.contiguous();
  at::Tensor view = mask.expand(scores.sizes());
  if (!RowIndexer::build(view, &v.idx)) {  // more than 6 leading dims that cannot merge: rare
    view = view.contiguous();
    v.idx = RowIndexer::of(view);
  }
  v.col_stride = (view.size(-1) > 1 && view.stride(-1) != 0) ? 1 : 0;
  TORCH_CHECK(view.size(-1) <= 1 || view.stride(-1) == 0 || view.stride(-1) == 1,
              "dmfx::", op, ": internal error: mask view has last-dim stride ", view.stride(-1));
  v.t = view;
  return v;
}

inline SoftmaxArgs make_fwd_args(const char* op, const at::Tensor& scores, bool causal,
                                 double scale, int64_t seed, int64_t offset, double p) {
  SoftmaxArgs a;
  a.Sk = scores.size(-1);
  a.rows = a.Sk == 0 ? 0 : scores.numel() / a.Sk;
  TORCH_CHECK(!causal || scores.dim() >= 2, "dmfx::", op,
              ": causal=True needs scores with at least 2 dimensions [..., q_len, k_len], got shape ",
              scores.sizes());
  a.Sq = scores.dim() >= 2 ? scores.size(-2) : 1;
  a.causal = causal;
  a.scale = scale;
  TORCH_CHECK(std::isfinite(scale), "dmfx::", op, ": scale must be finite, got ", scale);
  check_p(op, p);
  a.dropout = make_dropout_params(p, seed, offset);
  a.keep_scale = a.dropout.scale;
  return a;
}

// Checks of softmax_bwd: grad_out and probs have the same shape, dtype and device.
inline SoftmaxArgs check_bwd_args(const char* op, const at::Tensor& grad_out, const at::Tensor& probs,
                                  int64_t seed, int64_t offset, double p, double scale,
                                  c10::DeviceType device) {
  check_scores(op, "probs", probs, device);
  TORCH_CHECK(grad_out.device() == probs.device(), "dmfx::", op, ": grad_out is on ",
              grad_out.device(), " but probs is on ", probs.device());
  TORCH_CHECK(grad_out.scalar_type() == probs.scalar_type(), "dmfx::", op, ": grad_out has dtype ",
              grad_out.scalar_type(), " but probs has dtype ", probs.scalar_type(),
              " (they must match)");
  TORCH_CHECK(grad_out.sizes() == probs.sizes(), "dmfx::", op, ": grad_out must have the shape of probs ",
              probs.sizes(), ", got ", grad_out.sizes());
  TORCH_CHECK(std::isfinite(scale), "dmfx::", op, ": scale must be finite, got ", scale);
  check_p(op, p);
  SoftmaxArgs a;
  a.Sk = probs.size(-1);
  a.rows = a.Sk == 0 ? 0 : probs.numel() / a.Sk;
  a.scale = scale;
  a.dropout = make_dropout_params(p, seed, offset);
  a.keep_scale = a.dropout.scale;
  return a;
}

// [out, probs]: probs is empty ([0]) without dropout, where out == probs.
inline std::vector<at::Tensor> alloc_fwd_outputs(const at::Tensor& scores, const SoftmaxArgs& a) {
  const auto opts = scores.options();
  at::Tensor out = at::empty(scores.sizes(), opts);
  at::Tensor probs = a.dropout.active ? at::empty(scores.sizes(), opts) : at::empty({0}, opts);
  return {out, probs};
}

// Number of unmasked leading elements of row `row` under causal masking: element (i, j) of the
// last two dims is masked when j > i + (Sk - Sq) (bottom-right aligned). Sk when not causal.
DMFX_HD int64_t causal_limit(const SoftmaxArgs& a, int64_t row) {
  if (!a.causal) return a.Sk;
  const int64_t i = row % a.Sq;
  const int64_t lim = i + (a.Sk - a.Sq) + 1;
  return lim < 0 ? 0 : (lim > a.Sk ? a.Sk : lim);
}

}  // namespace softmax_impl
}  // namespace dmfx

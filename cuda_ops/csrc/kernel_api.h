// Host-side argument checking, strided row indexing and output allocation shared by the CPU and
// CUDA bindings of the fused normalization kernels. Error messages name the op, the tensor and what
// was expected, so bad input never reaches a kernel.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "dmfx_common.h"

namespace dmfx {

// Maps a row index of a tensor viewed as [rows, H] (unit stride along H) to its element offset.
// Leading dimensions keep their own strides, so permuted or sliced activations need no copy.
struct RowIndexer {
  static constexpr int kMaxDims = 6;
  int nd = 0;
  int64_t sizes[kMaxDims] = {0};
  int64_t strides[kMaxDims] = {0};

  DMFX_HD int64_t offset(int64_t row) const {
    int64_t off = 0;
    for (int d = nd - 1; d >= 0; --d) {
      const int64_t sz = sizes[d];
      off += (row % sz) * strides[d];
      row /= sz;
    }
    return off;
  }

  // Leading dims of `t` with neighbours merged where the memory allows it. Returns false when more
  // than kMaxDims remain (the caller then makes the tensor contiguous).
  static bool build(const at::Tensor& t, RowIndexer* out) {
    RowIndexer r;
    for (int64_t d = 0; d + 1 < t.dim(); ++d) {
      const int64_t sz = t.size(d), st = t.stride(d);
      if (sz == 1) continue;
      if (r.nd > 0 && r.strides[r.nd - 1] == st * sz) {
        r.sizes[r.nd - 1] *= sz;
        r.strides[r.nd - 1] = st;
        continue;
      }
      if (r.nd == kMaxDims) return false;
      r.sizes[r.nd] = sz;
      r.strides[r.nd] = st;
      ++r.nd;
    }
    if (r.nd == 0) {  // a single row (or all leading sizes 1)
      r.nd = 1;
      r.sizes[0] = 1;
      r.strides[0] = 0;
    }
    *out = r;
    return true;
  }

  static RowIndexer of(const at::Tensor& t) {
    RowIndexer r;
    TORCH_CHECK(build(t, &r), "dmfx: internal error: tensor is not row-addressable");
    return r;
  }
};

// A tensor the kernels can address as [rows, H]: unit stride on the last dim and few leading dims.
inline at::Tensor rowable(const at::Tensor& t) {
  RowIndexer r;
  const bool unit_last = t.dim() == 0 || t.size(-1) <= 1 || t.stride(-1) == 1;
  if (unit_last && RowIndexer::build(t, &r)) return t;
  return t.contiguous();
}

inline c10::optional<at::Tensor> rowable(const c10::optional<at::Tensor>& t) {
  if (!t.has_value() || !t->defined()) return c10::nullopt;
  return rowable(*t);
}

inline c10::optional<at::Tensor> contiguous(const c10::optional<at::Tensor>& t) {
  if (!t.has_value() || !t->defined()) return c10::nullopt;
  return t->contiguous();
}

struct NormArgs {
  int64_t rows = 0, H = 0;
  double eps = 0.0, scale = 1.0;
  bool rms = false;
  DropoutParams dropout;
};

inline bool present(const c10::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

inline void check_same(const char* op, const char* name, const at::Tensor& t, const at::Tensor& x) {
  TORCH_CHECK(t.device() == x.device(), "dmfx::", op, ": ", name, " is on ", t.device(),
              " but x is on ", x.device());
  TORCH_CHECK(t.scalar_type() == x.scalar_type(), "dmfx::", op, ": ", name, " has dtype ",
              t.scalar_type(), " but x has dtype ", x.scalar_type(), " (they must match)");
}

inline void check_vector(const char* op, const char* name, const c10::optional<at::Tensor>& t,
                         const at::Tensor& x) {
  if (!present(t)) return;
  check_same(op, name, *t, x);
  TORCH_CHECK(t->dim() == 1 && t->size(0) == x.size(-1), "dmfx::", op, ": ", name,
              " must have shape [", x.size(-1), "] (the size of x's last dimension), got ",
              t->sizes());
}

inline void check_like_x(const char* op, const char* name, const c10::optional<at::Tensor>& t,
                         const at::Tensor& x) {
  if (!present(t)) return;
  check_same(op, name, *t, x);
  TORCH_CHECK(t->sizes() == x.sizes(), "dmfx::", op, ": ", name, " must have the shape of x ",
              x.sizes(), ", got ", t->sizes());
}

inline void check_x(const char* op, const at::Tensor& x, c10::DeviceType device) {
  TORCH_CHECK(x.device().type() == device, "dmfx::", op, ": this is the ",
              c10::DeviceTypeName(device), " kernel but x is on ", x.device());
  const auto st = x.scalar_type();
  TORCH_CHECK(st == at::kFloat || st == at::kHalf || st == at::kBFloat16 || st == at::kDouble,
              "dmfx::", op, ": x must be float32, float16, bfloat16 or float64, got ", st);
}

inline NormArgs make_norm_args(const at::Tensor& x, double p, double eps, bool rms, int64_t seed,
                               int64_t offset) {
  NormArgs a;
  a.H = x.size(-1);
  a.rows = a.H == 0 ? 0 : x.numel() / a.H;
  a.eps = eps;
  a.rms = rms;
  a.dropout = make_dropout_params(p, seed, offset);
  a.scale = a.dropout.scale;
  return a;
}

// The dropout probability, the one check of it (every family's kernels and ops call it).
inline void check_p(const char* op, double p) {
  TORCH_CHECK_VALUE(p >= 0.0 && p <= 1.0, "dmfx::", op, ": dropout probability p must be in [0, 1], got ", p);
}

inline NormArgs check_norm_args(const char* op, const at::Tensor& x,
                                const c10::optional<at::Tensor>& bias,
                                const c10::optional<at::Tensor>& residual,
                                const c10::optional<at::Tensor>& weight,
                                const c10::optional<at::Tensor>& norm_bias, double p, double eps,
                                bool rms, int64_t seed, int64_t offset, c10::DeviceType device) {
  check_x(op, x, device);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) >= 1, "dmfx::", op,
              ": x needs a non-empty last (normalized) dimension, got shape ", x.sizes());
  check_vector(op, "bias", bias, x);
  check_like_x(op, "residual", residual, x);
  check_vector(op, "weight", weight, x);
  check_vector(op, "norm_bias", norm_bias, x);
  check_p(op, p);
  TORCH_CHECK(eps >= 0.0, "dmfx::", op, ": eps must be >= 0, got ", eps);
  return make_norm_args(x, p, eps, rms, seed, offset);
}

inline at::TensorOptions stat_options(const at::Tensor& x) {
  return x.options().dtype(x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat);
}

inline std::vector<int64_t> lead_sizes(const at::Tensor& x) {
  return std::vector<int64_t>(x.sizes().begin(), x.sizes().end() - 1);
}

// [out, sum (or empty), mean (or empty for RMSNorm), rstd]
inline std::vector<at::Tensor> alloc_norm_outputs(const at::Tensor& x, const NormArgs& a,
                                                  bool return_sum) {
  const auto lead = lead_sizes(x);
  at::Tensor out = at::empty(x.sizes(), x.options());
  at::Tensor sum = return_sum ? at::empty(x.sizes(), x.options()) : at::empty({0}, x.options());
  at::Tensor mean = a.rms ? at::empty({0}, stat_options(x)) : at::empty(lead, stat_options(x));
  at::Tensor rstd = at::empty(lead, stat_options(x));
  return {out, sum, mean, rstd};
}

inline NormArgs check_norm_bwd_args(const char* op, const at::Tensor& grad_out,
                                    const c10::optional<at::Tensor>& grad_out2,
                                    const c10::optional<at::Tensor>& grad_sum, const at::Tensor& x,
                                    const c10::optional<at::Tensor>& bias,
                                    const c10::optional<at::Tensor>& residual,
                                    const c10::optional<at::Tensor>& weight,
                                    const c10::optional<at::Tensor>& mean, const at::Tensor& rstd,
                                    double p, bool rms, int64_t seed, int64_t offset,
                                    const std::vector<bool>& output_mask, c10::DeviceType device) {
  NormArgs a = check_norm_args(op, x, bias, residual, weight, c10::nullopt, p, 0.0, rms, seed,
                               offset, device);
  check_like_x(op, "grad_out", grad_out, x);
  check_like_x(op, "grad_out2", grad_out2, x);
  check_like_x(op, "grad_sum", grad_sum, x);
  TORCH_CHECK(output_mask.size() == 5, "dmfx::", op,
              ": output_mask needs 5 entries [dx, dresidual, dweight, dnorm_bias, dbias]");
  const auto lead = lead_sizes(x);
  TORCH_CHECK(rstd.sizes() == c10::IntArrayRef(lead) && rstd.scalar_type() == stat_options(x).dtype(),
              "dmfx::", op, ": rstd must have shape ", c10::IntArrayRef(lead), " and dtype ",
              stat_options(x).dtype(), ", got ", rstd.sizes(), " ", rstd.scalar_type());
  if (!rms) {
    TORCH_CHECK(present(mean) && mean->sizes() == rstd.sizes() && mean->scalar_type() == rstd.scalar_type(),
                "dmfx::", op, ": LayerNorm backward needs mean with the shape and dtype of rstd");
  }
  return a;
}

struct NormGrads {
  at::Tensor dx, dresidual, dweight, dnorm_bias, dbias;
  at::Tensor empty;
  std::vector<at::Tensor> as_list() const {
    auto or_empty = [&](const at::Tensor& t) { return t.defined() ? t : empty; };
    return {or_empty(dx), or_empty(dresidual), or_empty(dweight), or_empty(dnorm_bias), or_empty(dbias)};
  }
};

inline NormGrads alloc_norm_grads(const at::Tensor& x, const c10::optional<at::Tensor>& bias,
                                  const c10::optional<at::Tensor>& weight, const NormArgs& a,
                                  const std::vector<bool>& m) {
  NormGrads g;
  g.empty = at::empty({0}, x.options());
  if (m[0]) g.dx = at::empty(x.sizes(), x.options());
  if (m[1]) g.dresidual = at::empty(x.sizes(), x.options());
  if (m[2] && present(weight)) g.dweight = at::empty({a.H}, x.options());
  if (m[3]) g.dnorm_bias = at::empty({a.H}, x.options());
  if (m[4]) g.dbias = at::empty({a.H}, x.options());  // with or without a bias: the column sums of dx
  return g;
}

inline void zero_param_grads(NormGrads& g) {
  for (at::Tensor* t : {&g.dweight, &g.dnorm_bias, &g.dbias})
    if (t->defined()) t->zero_();
}

inline void check_dropout_args(const char* op, const at::Tensor& x, double p, c10::DeviceType device) {
  check_x(op, x, device);
  check_p(op, p);
}

// A backward kernel's stored dropout mask (the bool mask PyTorch's native_dropout saved, when the
// forward was not a dmfx kernel: bias_act_bwd, softmax_bwd): x's shape and device, any strides with a
// unit one along the last dim. The multiplier of element i is then mask[i] ? mask_scale : 0, and p must
// be 0 (one source of dropout masks per call).
inline void check_stored_mask(const char* op, const c10::optional<at::Tensor>& mask, const char* xname,
                              const at::Tensor& x, double p, double mask_scale) {
  if (!present(mask)) return;
  TORCH_CHECK(mask->scalar_type() == at::kBool, "dmfx::", op,
              ": mask must be a bool tensor (the mask native_dropout returns), got ", mask->scalar_type());
  TORCH_CHECK(mask->device() == x.device(), "dmfx::", op, ": mask is on ", mask->device(), " but ", xname,
              " is on ", x.device(), " (they must match)");
  TORCH_CHECK(mask->sizes() == x.sizes(), "dmfx::", op, ": mask must have the shape of ", xname, " ",
              x.sizes(), ", got ", mask->sizes());
  TORCH_CHECK(p == 0.0, "dmfx::", op, ": a stored mask and p = ", p,
              " > 0 would be two dropout masks; pass p = 0 with a mask");
  TORCH_CHECK(std::isfinite(mask_scale), "dmfx::", op, ": mask_scale must be finite, got ", mask_scale);
}

}  // namespace dmfx

// dmfx CPU kernels: one fused "bias + dropout + residual + normalization" kernel pair (LayerNorm and
// RMSNorm are its special cases) and a standalone dropout kernel.
//
// Every tensor is seen as [rows, H] with unit stride along H; the leading dimensions may have any
// strides (RowIndexer), so permuted/sliced activations are read in place. Outputs are contiguous.
// Accumulation is in at::opmath_type (float for fp16/bf16/fp32, double for fp64).
//
// The file has two parts (cuda_ops/build.py): the kernels, this file's own translation unit (-O3), and,
// under DMFX_CPU_GLUE, the glue (the kernel functions' Python bindings, the ops' registration and
// autograd formulas), which cpu_bindings.cpp includes into the one translation unit of every family's glue.
#ifndef DMFX_CPU_GLUE
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <ATen/OpMathType.h>
#include <ATen/Dispatch.h>

#include <vector>

#include "dmfx_common.h"
#include "cpu_kernels.h"
#include "kernel_api.h"
#include "philox_cpu.h"

namespace dmfx {
namespace {

// Dropout multipliers of the H elements starting at logical index `first`: scale where kept, 0 where
// dropped (Philox words for all their groups at once: philox_cpu.h). Floats rather than byte flags:
// byte stores may alias anything, which kept the compiler from vectorizing the loops that read them.
template <typename acc_t>
void fill_mult(const DropoutParams& d, acc_t scale, uint64_t first, int64_t H, acc_t* __restrict m) {
  if (d.drop_all) {
    for (int64_t j = 0; j < H; ++j) m[j] = acc_t(0);
    return;
  }
  const uint32_t* __restrict w = philox_cpu::words_for(first, H, d.offset, d.seed);
  const uint32_t t = d.threshold;
  for (int64_t j = 0; j < H; ++j) m[j] = w[j] >= t ? scale : acc_t(0);
}

template <typename scalar_t>
struct RowView {
  const scalar_t* data = nullptr;
  RowIndexer idx;
  const scalar_t* row(int64_t r) const { return data + idx.offset(r); }
  explicit operator bool() const { return data != nullptr; }
};

template <typename scalar_t>
RowView<scalar_t> rows_of(const c10::optional<at::Tensor>& t) {
  RowView<scalar_t> v;
  if (t.has_value() && t->defined()) {
    v.data = t->data_ptr<scalar_t>();
    v.idx = RowIndexer::of(*t);
  }
  return v;
}

template <typename scalar_t>
const scalar_t* ptr_or_null(const c10::optional<at::Tensor>& t) {
  return (t.has_value() && t->defined()) ? t->data_ptr<scalar_t>() : nullptr;
}

// Row reductions keep kNormLanes independent partial sums: a single running sum is a serial chain of
// dependent adds that the compiler may not vectorize (no -ffast-math), which made these kernels several
// times slower than ATen's on cache-resident rows. The forward builds a row's sum and its total in one
// fused pass (RowIn, load_row_sum), then the deviation, then the output; the backward keeps one simple
// loop per step (load_row), which measured faster there than fused loops.
constexpr int kNormLanes = 16;

// sum_j (v[j] - c)^2
template <typename acc_t>
inline acc_t norm_lane_sqdev(const acc_t* __restrict v, int64_t n, acc_t c) {
  acc_t part[kNormLanes] = {};
  int64_t j = 0;
  for (; j + kNormLanes <= n; j += kNormLanes)
    for (int l = 0; l < kNormLanes; ++l) {
      const acc_t d = v[j + l] - c;
      part[l] += d * d;
    }
  acc_t t = 0;
  for (; j < n; ++j) t += (v[j] - c) * (v[j] - c);
  for (int l = 0; l < kNormLanes; ++l) t += part[l];
  return t;
}

// One row's inputs: x, bias, dropout multipliers and residual (null where absent).
template <typename scalar_t, typename acc_t>
struct RowIn {
  const scalar_t* __restrict x;
  const scalar_t* __restrict bias;
  const acc_t* __restrict mult;
  const scalar_t* __restrict res;

  // s[j] = dropout(x + bias) + residual (a dropped element is 0, as on CUDA, even for x = inf)
  inline acc_t operator()(int64_t j) const {
    acc_t v = static_cast<acc_t>(x[j]);
    if (bias) v += static_cast<acc_t>(bias[j]);
    if (mult) v = mult[j] != acc_t(0) ? v * mult[j] : acc_t(0);
    if (res) v += static_cast<acc_t>(res[j]);
    return v;
  }
};

template <typename acc_t>
inline acc_t norm_lane_sum(const acc_t* v, int64_t n) {
  acc_t part[kNormLanes] = {};
  int64_t j = 0;
  for (; j + kNormLanes <= n; j += kNormLanes)
    for (int l = 0; l < kNormLanes; ++l) part[l] += v[j + l];
  acc_t t = 0;
  for (; j < n; ++j) t += v[j];
  for (int l = 0; l < kNormLanes; ++l) t += part[l];
  return t;
}

template <typename acc_t>
inline acc_t norm_lane_dot(const acc_t* a, const acc_t* b, int64_t n) {
  acc_t part[kNormLanes] = {};
  int64_t j = 0;
  for (; j + kNormLanes <= n; j += kNormLanes)
    for (int l = 0; l < kNormLanes; ++l) part[l] += a[j + l] * b[j + l];
  acc_t t = 0;
  for (; j < n; ++j) t += a[j] * b[j];
  for (int l = 0; l < kNormLanes; ++l) t += part[l];
  return t;
}

// The same sum as RowIn, one step per loop (each a simple loop the compiler vectorizes; the backward's
// other row loops are of this kind too, and fusing them into RowIn-style loops measured slower there).
template <typename scalar_t, typename acc_t>
inline void load_row(const RowIn<scalar_t, acc_t>& in, int64_t H, acc_t* __restrict s) {
  if (in.bias) {
    for (int64_t j = 0; j < H; ++j) s[j] = static_cast<acc_t>(in.x[j]) + static_cast<acc_t>(in.bias[j]);
  } else {
    for (int64_t j = 0; j < H; ++j) s[j] = static_cast<acc_t>(in.x[j]);
  }
  if (in.mult)
    for (int64_t j = 0; j < H; ++j) s[j] = in.mult[j] != acc_t(0) ? s[j] * in.mult[j] : acc_t(0);
  if (in.res)
    for (int64_t j = 0; j < H; ++j) s[j] += static_cast<acc_t>(in.res[j]);
}

// s = the row's sum (RowIn) for one row, into `s`; returns sum_j s[j]. One pass.
template <typename scalar_t, typename acc_t>
inline acc_t load_row_sum(const RowIn<scalar_t, acc_t>& in, int64_t H, acc_t* __restrict s) {
  acc_t part[kNormLanes] = {};
  int64_t j = 0;
  for (; j + kNormLanes <= H; j += kNormLanes)
    for (int l = 0; l < kNormLanes; ++l) {
      const acc_t v = in(j + l);
      s[j + l] = v;
      part[l] += v;
    }
  acc_t t = 0;
  for (; j < H; ++j) {
    const acc_t v = in(j);
    s[j] = v;
    t += v;
  }
  for (int l = 0; l < kNormLanes; ++l) t += part[l];
  return t;
}

template <typename scalar_t>
void norm_fwd_impl(const NormArgs& a, const at::Tensor& x, const c10::optional<at::Tensor>& bias,
                   const c10::optional<at::Tensor>& residual, const c10::optional<at::Tensor>& weight,
                   const c10::optional<at::Tensor>& norm_bias, at::Tensor& out, at::Tensor& sum_out,
                   at::Tensor& mean, at::Tensor& rstd) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t H = a.H;
  const auto xv = rows_of<scalar_t>(x);
  const auto rv = rows_of<scalar_t>(residual);
  const scalar_t* b = ptr_or_null<scalar_t>(bias);
  const scalar_t* w = ptr_or_null<scalar_t>(weight);
  const scalar_t* nb = ptr_or_null<scalar_t>(norm_bias);
  scalar_t* o = out.data_ptr<scalar_t>();
  scalar_t* so = sum_out.defined() ? sum_out.data_ptr<scalar_t>() : nullptr;
  acc_t* mp = a.rms ? nullptr : mean.data_ptr<acc_t>();
  acc_t* rp = rstd.data_ptr<acc_t>();
  const acc_t scale = static_cast<acc_t>(a.scale);
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(H, 1));
  at::parallel_for(0, a.rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> s(H), mult(a.dropout.active ? H : 0);
    for (int64_t r = begin; r < end; ++r) {
      if (a.dropout.active) fill_mult(a.dropout, scale, static_cast<uint64_t>(r) * H, H, mult.data());
      const RowIn<scalar_t, acc_t> in{xv.row(r), b, a.dropout.active ? mult.data() : nullptr, rv ? rv.row(r) : nullptr};
      acc_t* __restrict sr = s.data();
      const acc_t total = load_row_sum(in, H, sr);
      const acc_t mu = a.rms ? acc_t(0) : total / H;
      const acc_t var = norm_lane_sqdev(sr, H, mu) / H;
      const acc_t rs = acc_t(1) / std::sqrt(var + static_cast<acc_t>(a.eps));
      if (mp) mp[r] = mu;
      rp[r] = rs;
      scalar_t* __restrict orow = o + r * H;
      scalar_t* __restrict srow = so ? so + r * H : nullptr;
      for (int64_t j = 0; j < H; ++j) {
        acc_t v = (sr[j] - mu) * rs;
        if (w) v *= static_cast<acc_t>(w[j]);
        if (nb) v += static_cast<acc_t>(nb[j]);
        orow[j] = static_cast<scalar_t>(v);
        if (srow) srow[j] = static_cast<scalar_t>(sr[j]);
      }
    }
  });
}

template <typename scalar_t>
void norm_bwd_impl(const NormArgs& a, const at::Tensor& grad_out,
                   const c10::optional<at::Tensor>& grad_out2, const c10::optional<at::Tensor>& grad_sum, const at::Tensor& x,
                   const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& residual,
                   const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& mean,
                   const at::Tensor& rstd, NormGrads& g) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t H = a.H;
  const auto gv = rows_of<scalar_t>(grad_out);
  const auto g2v = rows_of<scalar_t>(grad_out2);  // a second incoming gradient, added to grad_out
  const auto gsv = rows_of<scalar_t>(grad_sum);
  const auto xv = rows_of<scalar_t>(x);
  const auto rv = rows_of<scalar_t>(residual);
  const scalar_t* b = ptr_or_null<scalar_t>(bias);
  const scalar_t* w = ptr_or_null<scalar_t>(weight);
  const acc_t* mp = a.rms ? nullptr : mean->data_ptr<acc_t>();
  const acc_t* rp = rstd.data_ptr<acc_t>();
  scalar_t* dx = g.dx.defined() ? g.dx.data_ptr<scalar_t>() : nullptr;
  scalar_t* dres = g.dresidual.defined() ? g.dresidual.data_ptr<scalar_t>() : nullptr;
  const bool need_dw = g.dweight.defined(), need_dnb = g.dnorm_bias.defined(),
             need_db = g.dbias.defined();
  const acc_t scale = static_cast<acc_t>(a.scale);
  // Column sums (dweight, dnorm_bias, dbias) accumulate per thread, then reduce.
  const int64_t nthreads = at::get_num_threads();
  const int ncols = 3;
  std::vector<acc_t> partial(static_cast<size_t>(nthreads) * ncols * H, acc_t(0));
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(H, 1));
  at::parallel_for(0, a.rows, grain, [&](int64_t begin, int64_t end) {
    const int64_t tid = at::get_thread_num();
    acc_t* pw = partial.data() + (tid * ncols + 0) * H;
    acc_t* pnb = partial.data() + (tid * ncols + 1) * H;
    acc_t* pb = partial.data() + (tid * ncols + 2) * H;
    std::vector<acc_t> s(H), gw(H), dyb(H), mult(a.dropout.active ? H : 0);
    for (int64_t r = begin; r < end; ++r) {
      if (a.dropout.active) fill_mult(a.dropout, scale, static_cast<uint64_t>(r) * H, H, mult.data());
      const acc_t* __restrict m = a.dropout.active ? mult.data() : nullptr;
      load_row<scalar_t, acc_t>(RowIn<scalar_t, acc_t>{xv.row(r), b, m, rv ? rv.row(r) : nullptr}, H, s.data());
      const acc_t mu = mp ? mp[r] : acc_t(0), rs = rp[r];
      // dy = grad_out (+ grad_out2), in the accumulation type: the add of two gradients that
      // eager runs as its own kernel happens here, in cache.
      acc_t* dy = dyb.data();
      const scalar_t* dy1 = gv.row(r);
      if (g2v) {
        const scalar_t* dy2 = g2v.row(r);
        for (int64_t j = 0; j < H; ++j) dy[j] = static_cast<acc_t>(dy1[j]) + static_cast<acc_t>(dy2[j]);
      } else {
        for (int64_t j = 0; j < H; ++j) dy[j] = static_cast<acc_t>(dy1[j]);
      }
      acc_t* xh = s.data();  // becomes xhat in place
      acc_t* gr = gw.data();  // dy * weight, then d(sum)
      for (int64_t j = 0; j < H; ++j) xh[j] = (xh[j] - mu) * rs;
      if (w) {
        for (int64_t j = 0; j < H; ++j) gr[j] = dy[j] * static_cast<acc_t>(w[j]);
      } else {
        for (int64_t j = 0; j < H; ++j) gr[j] = dy[j];
      }
      const acc_t c1 = norm_lane_dot(gr, xh, H) / H;
      const acc_t c2 = a.rms ? acc_t(0) : norm_lane_sum(gr, H) / H;
      if (need_dw)
        for (int64_t j = 0; j < H; ++j) pw[j] += dy[j] * xh[j];
      if (need_dnb)
        for (int64_t j = 0; j < H; ++j) pnb[j] += dy[j];
      const scalar_t* gsr = gsv ? gsv.row(r) : nullptr;
      for (int64_t j = 0; j < H; ++j) gr[j] = rs * (gr[j] - c2 - xh[j] * c1);
      if (gsr)
        for (int64_t j = 0; j < H; ++j) gr[j] += static_cast<acc_t>(gsr[j]);
      if (dres) {
        scalar_t* drr = dres + r * H;
        for (int64_t j = 0; j < H; ++j) drr[j] = static_cast<scalar_t>(gr[j]);
      }
      if (m)
        for (int64_t j = 0; j < H; ++j) gr[j] = m[j] != acc_t(0) ? gr[j] * m[j] : acc_t(0);
      if (dx) {
        scalar_t* dxr = dx + r * H;
        for (int64_t j = 0; j < H; ++j) dxr[j] = static_cast<scalar_t>(gr[j]);
      }
      if (need_db)
        for (int64_t j = 0; j < H; ++j) pb[j] += gr[j];
    }
  });
  auto reduce_col = [&](int col, at::Tensor& dst) {
    if (!dst.defined()) return;
    scalar_t* d = dst.data_ptr<scalar_t>();
    for (int64_t j = 0; j < H; ++j) {
      acc_t acc = 0;
      for (int64_t t = 0; t < nthreads; ++t) acc += partial[(t * ncols + col) * H + j];
      d[j] = static_cast<scalar_t>(acc);
    }
  };
  reduce_col(0, g.dweight);
  reduce_col(1, g.dnorm_bias);
  reduce_col(2, g.dbias);
}

template <typename scalar_t>
void dropout_impl(const at::Tensor& x, at::Tensor& out, const DropoutParams& d, double p) {
  using acc_t = at::opmath_type<scalar_t>;
  const scalar_t* xp = x.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  const int64_t n = x.numel();
  const int64_t ngroups = (n + 3) / 4;
  const acc_t scale = static_cast<acc_t>(d.scale);
  constexpr int64_t kChunk = 4096;  // elements per Philox batch (a multiple of 4)
  at::parallel_for(0, ngroups, 2048, [&](int64_t begin, int64_t end) {
    for (int64_t i0 = begin * 4; i0 < std::min(end * 4, n); i0 += kChunk) {
      const int64_t len = std::min({kChunk, end * 4 - i0, n - i0});
      if (d.drop_all) {
        for (int64_t j = 0; j < len; ++j) op[i0 + j] = scalar_t(0);
        continue;
      }
      const uint32_t* w = philox_cpu::words_for(static_cast<uint64_t>(i0), len, d.offset, d.seed);
      const uint32_t t = d.threshold;
      for (int64_t j = 0; j < len; ++j)
        op[i0 + j] = w[j] >= t ? static_cast<scalar_t>(static_cast<acc_t>(xp[i0 + j]) * scale) : scalar_t(0);
    }
  });
}

}  // namespace

std::vector<at::Tensor> norm_fwd_cpu(const at::Tensor& x_in, const c10::optional<at::Tensor>& bias_in,
                                     const c10::optional<at::Tensor>& residual_in,
                                     const c10::optional<at::Tensor>& weight_in,
                                     const c10::optional<at::Tensor>& norm_bias_in, int64_t seed,
                                     int64_t offset, double p, double eps, bool rms,
                                     bool return_sum) {
  const NormArgs a = check_norm_args("norm_fwd", x_in, bias_in, residual_in, weight_in,
                                     norm_bias_in, p, eps, rms, seed, offset, at::kCPU);
  const at::Tensor x = rowable(x_in);
  const auto residual = rowable(residual_in);
  const auto bias = contiguous(bias_in), weight = contiguous(weight_in),
             norm_bias = contiguous(norm_bias_in);
  auto outs = alloc_norm_outputs(x, a, return_sum);
  if (a.rows > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "dmfx_norm_fwd", [&] {
      norm_fwd_impl<scalar_t>(a, x, bias, residual, weight, norm_bias, outs[0], outs[1], outs[2],
                              outs[3]);
    });
  }
  return outs;
}

std::vector<at::Tensor> norm_bwd_cpu(const at::Tensor& grad_out_in,
                                     const c10::optional<at::Tensor>& grad_sum_in,
                                     const at::Tensor& x_in,
                                     const c10::optional<at::Tensor>& bias_in,
                                     const c10::optional<at::Tensor>& residual_in,
                                     const c10::optional<at::Tensor>& weight_in,
                                     const c10::optional<at::Tensor>& mean_in,
                                     const at::Tensor& rstd_in, int64_t seed, int64_t offset,
                                     double p, bool rms, std::vector<bool> output_mask,
                                     const c10::optional<at::Tensor>& grad_out2_in) {
  const NormArgs a = check_norm_bwd_args("norm_bwd", grad_out_in, grad_out2_in, grad_sum_in, x_in, bias_in, residual_in,
                                         weight_in, mean_in, rstd_in, p, rms, seed, offset,
                                         output_mask, at::kCPU);
  const at::Tensor x = rowable(x_in), grad_out = rowable(grad_out_in), rstd = rstd_in.contiguous();
  const auto residual = rowable(residual_in), grad_sum = rowable(grad_sum_in),
             grad_out2 = rowable(grad_out2_in);
  const auto bias = contiguous(bias_in), weight = contiguous(weight_in), mean = contiguous(mean_in);
  NormGrads g = alloc_norm_grads(x, bias, weight, a, output_mask);
  if (a.rows > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "dmfx_norm_bwd", [&] {
      norm_bwd_impl<scalar_t>(a, grad_out, grad_out2, grad_sum, x, bias, residual, weight, mean, rstd, g);
    });
  } else {
    zero_param_grads(g);
  }
  return g.as_list();
}

at::Tensor dropout_cpu(const at::Tensor& x_in, int64_t seed, int64_t offset, double p) {
  check_dropout_args("dropout", x_in, p, at::kCPU);
  const at::Tensor x = x_in.contiguous();
  at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  const DropoutParams d = make_dropout_params(p, seed, offset);
  if (x.numel() > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "dmfx_dropout", [&] {
      dropout_impl<scalar_t>(x, out, d, p);
    });
  }
  return out;
}

}  // namespace dmfx

#else  // DMFX_CPU_GLUE: the glue (in cpu_bindings.cpp's translation unit)
#include <torch/csrc/utils/pybind.h>

#include "cpu_kernels.h"

namespace dmfx {
void bind_norm(pybind11::module_& m) {
  m.def("norm_fwd", &norm_fwd_cpu, "fused bias+dropout+residual+LayerNorm/RMSNorm forward (CPU)");
  m.def("norm_bwd", &norm_bwd_cpu, "fused bias+dropout+residual+LayerNorm/RMSNorm backward (CPU)");
  m.def("dropout", &dropout_cpu, "Philox inverted dropout (CPU); also its own backward");
}
}  // namespace dmfx

#ifndef DMFX_KERNELS_ONLY
// ------------------------------------------------------------------------------------------------
// The ops: CPU kernels (through the kernel table: cpu_kernels.h) and the family's autograd formulas
// ------------------------------------------------------------------------------------------------
#include "norm_ops.h"

namespace dmfx {
namespace norm_ops {
namespace {

struct CpuNorm {
  template <class... A>
  static Tensors norm_fwd(A&&... a) { return cpu_kernels().norm_fwd(std::forward<A>(a)...); }
  template <class... A>
  static Tensors norm_bwd(A&&... a) { return cpu_kernels().norm_bwd(std::forward<A>(a)...); }
  template <class... A>
  static Tensor dropout(A&&... a) { return cpu_kernels().dropout(std::forward<A>(a)...); }
};

// What a norm forward saved for dmfx::norm_backward.
struct Saved {
  Tensor x, bias, residual, weight, mean, rstd, seed;
  double p = 0.0;
  bool rms = false;
};

void save(AutogradContext* ctx, const Saved& s) {
  ctx->save_for_backward({s.x, s.bias, s.residual, s.weight, s.mean, s.rstd, s.seed});
  ctx->saved_data["p"] = s.p;
  ctx->saved_data["rms"] = s.rms;
}

Saved saved(AutogradContext* ctx) {
  auto v = ctx->get_saved_variables();
  return {v[0], v[1], v[2], v[3], v[4], v[5], v[6], ctx->saved_data["p"].toDouble(), ctx->saved_data["rms"].toBool()};
}

// dmfx::norm_backward for the saved forward; `need` = [x, residual, weight, norm_bias, bias], the
// gradients returned in that order (undefined where not needed).
std::array<Tensor, 5> norm_grads(AutogradContext* ctx, const Tensor& grad_out, const Opt& grad_sum,
                                 std::array<bool, 5> need) {
  const Saved s = saved(ctx);
  const bool dropout = s.p > 0.0;
  // Without dropout dresidual == dx, so compute it once and hand it out twice.
  const bool want_dres = need[1] && dropout;
  const bool want_dx = need[0] || need[4] || (need[1] && !dropout);
  static const auto backward = dmfx_op<NormBackwardSig>("dmfx::norm_backward");
  auto [dx, dres, dw, dnb, db] = backward.call(
      grad_out.defined() ? grad_out : at::zeros_like(s.x), grad_sum, s.x, opt(s.bias), opt(s.residual), opt(s.weight),
      s.rms ? c10::nullopt : opt(s.mean), s.rstd, opt(s.seed), s.p, s.rms,
      bools({want_dx, want_dres, need[2], need[3], need[4]}), c10::nullopt);
  const Tensor none;
  return {need[0] ? dx : none, need[1] ? (dropout ? dres : dx) : none, need[2] ? dw : none, need[3] ? dnb : none,
          need[4] ? db : none};
}

struct LayerNormFn : public torch::autograd::Function<LayerNormFn> {
  static constexpr const char* name = "dmfx::layer_norm";
  using Sig = decltype(layer_norm<CpuNorm>);
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Opt& weight, const Opt& bias, double eps) {
    auto out = AutogradKernel<LayerNormFn>::below(x, weight, bias, eps);
    ctx->saved_data["needs"] = needs_bits(x, weight, bias);
    save(ctx, {x, {}, {}, weight.value_or(Tensor()), out[1], out[2], {}, 0.0, false});
    ctx->mark_non_differentiable({out[1], out[2]});
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    auto d = norm_grads(ctx, g[0], c10::nullopt, {needs(ctx, 0), false, needs(ctx, 1), needs(ctx, 2), false});
    return {d[0], d[2], d[3], Tensor()};
  }
};

struct RmsNormFn : public torch::autograd::Function<RmsNormFn> {
  static constexpr const char* name = "dmfx::rms_norm";
  using Sig = decltype(rms_norm<CpuNorm>);
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Opt& weight, double eps) {
    auto out = AutogradKernel<RmsNormFn>::below(x, weight, eps);
    ctx->saved_data["needs"] = needs_bits(x, weight);
    save(ctx, {x, {}, {}, weight.value_or(Tensor()), {}, out[1], {}, 0.0, true});
    ctx->mark_non_differentiable({out[1]});
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    auto d = norm_grads(ctx, g[0], c10::nullopt, {needs(ctx, 0), false, needs(ctx, 1), false, false});
    return {d[0], d[2], Tensor()};
  }
};

struct BiasDropoutResidualNormFn : public torch::autograd::Function<BiasDropoutResidualNormFn> {
  static constexpr const char* name = "dmfx::bias_dropout_residual_norm";
  using Sig = decltype(bias_dropout_residual_norm<CpuNorm>);
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Opt& bias, const Opt& residual,
                               const Opt& weight, const Opt& norm_bias, const Opt& seed, double p, double eps,
                               bool rms, bool return_sum) {
    auto out = AutogradKernel<BiasDropoutResidualNormFn>::below(x, bias, residual, weight, norm_bias, seed, p, eps,
                                                                 rms, return_sum);
    ctx->saved_data["needs"] = needs_bits(x, bias, residual, weight, norm_bias);
    const Tensor w = weight.value_or(Tensor());
    if (p == 0.0 && return_sum) {
      // Without dropout the pre-norm sum the op returns is all the backward needs (dx = dresidual =
      // d(sum), dbias its column sum): saving it instead of x and the residual keeps the GEMM output
      // x alive no longer than eager keeps it (pre-norm blocks: ViT, LLaMA).
      save(ctx, {out[1], {}, {}, w, out[2], out[3], {}, p, rms});
    } else {
      save(ctx, {x, bias.value_or(Tensor()), residual.value_or(Tensor()), w, out[2], out[3], seed.value_or(Tensor()),
                 p, rms});
    }
    ctx->mark_non_differentiable({out[2], out[3]});
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    // (an empty one: no sum returned. Read without a guard: under unpad the sum has a data-dependent
    // token count, and a symbolic numel is a sum that was returned)
    const auto numel = g[1].defined() ? g[1].sym_numel().maybe_as_int() : std::optional<int64_t>(0);
    const Opt grad_sum = numel.has_value() && *numel == 0 ? c10::nullopt : Opt(g[1]);
    // needs: x 0, bias 1, residual 2, weight 3, norm_bias 4
    auto d = norm_grads(ctx, g[0], grad_sum, {needs(ctx, 0), needs(ctx, 2), needs(ctx, 3), needs(ctx, 4), needs(ctx, 1)});
    return {d[0], d[4], d[1], d[2], d[3], Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

struct DropoutFn : public torch::autograd::Function<DropoutFn> {
  static constexpr const char* name = "dmfx::dropout";
  using Sig = decltype(dropout<CpuNorm>);
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& seed, double p) {
    ctx->save_for_backward({seed});
    ctx->saved_data["p"] = p;
    return AutogradKernel<DropoutFn>::below(x, seed, p);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    // the same mask on the gradient (regenerated from the seed), through the op: differentiable again
    return {op_of<DropoutFn>().call(g[0], ctx->get_saved_variables()[0], ctx->saved_data["p"].toDouble()), Tensor(),
            Tensor()};
  }
};

struct NormBackwardOp {
  static constexpr const char* name = "dmfx::norm_backward";
  static constexpr const char* hint = "a dmfx normalization";
  using Sig = NormBackwardSig;
};

}  // namespace
}  // namespace norm_ops
}  // namespace dmfx

TORCH_LIBRARY_IMPL(dmfx, CPU, m) { dmfx::norm_ops::register_kernels<dmfx::norm_ops::CpuNorm>(m); }

TORCH_LIBRARY_IMPL(dmfx, Autograd, m) {
  using namespace dmfx;
  using namespace dmfx::norm_ops;
  m.impl("layer_norm", &AutogradKernel<LayerNormFn>::call);
  m.impl("rms_norm", &AutogradKernel<RmsNormFn>::call);
  m.impl("bias_dropout_residual_norm", &AutogradKernel<BiasDropoutResidualNormFn>::call);
  m.impl("dropout", &AutogradKernel<DropoutFn>::call);
  m.impl("norm_backward", &AutogradKernel<NoDoubleBackward<NormBackwardOp>>::call);
}
#endif  // DMFX_KERNELS_ONLY
#endif  // DMFX_CPU_GLUE

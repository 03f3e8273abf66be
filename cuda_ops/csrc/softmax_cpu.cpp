// dmfx CPU kernels of the fused attention softmax (the paper's SM forward and BS backward kernels):
//
//   softmax_fwd: z = scores * scale + mask (causal: -inf where j > i + Sk - Sq); probs = softmax(z)
//                over the last dim; out = dropout(probs). Returns [out, probs]; probs is empty
//                ([0]) when p == 0 (then out is the probabilities).
//   softmax_bwd: g = grad_out * dropout_multiplier; grad = scale * probs * (g - sum_j g * probs).
//
// One pass per row over memory: the row (Sk <= a few thousand) is read once into a per-thread fp32
// buffer (L1/L2 resident), max / exp / sum / normalize / dropout run on that buffer, and out and
// probs are written in the same final loop. The inner loops are written over fixed-width lane arrays
// (kLanes) so that gcc -O3 -march=native vectorizes them without -ffast-math: exp is a
// Cephes-style polynomial (about 1 ulp) and max and sum keep kLanes partial results. Philox (the
// exact mapping of dmfx_common.h) runs on 32 counter groups at once: AVX-512 intrinsics where the
// compiler targets AVX-512, else a structure-of-arrays loop the compiler vectorizes.
// Accumulation is fp32 for fp16/bf16/fp32 inputs, fp64 for fp64 inputs (with std::exp).
//
// The file has two parts (cuda_ops/build.py): the kernels, this file's own translation unit (-O3), and,
// under DMFX_CPU_GLUE, the glue (the kernel functions' Python bindings, the ops' registration and
// autograd formulas), which cpu_bindings.cpp includes into the one translation unit of every family's glue.
#ifndef DMFX_CPU_GLUE
#include "softmax_cpu.h"
#include "cpu_kernels.h"

namespace dmfx {
namespace softmax_impl {

template <typename scalar_t>
struct FwdPtrs {
  const scalar_t* scores;
  RowIndexer si;
  const void* mask;  // element type per MaskView::kind
  RowIndexer mi;
  int64_t mask_col_stride;
  scalar_t* out;
  scalar_t* probs;  // nullptr without dropout
};

template <typename scalar_t, typename mask_t>
void softmax_fwd_rows(const SoftmaxArgs& a, const FwdPtrs<scalar_t>& P) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr bool kHasMask = !std::is_same<mask_t, NoMask>::value;
  const int64_t Sk = a.Sk;
  const acc_t scale = static_cast<acc_t>(a.scale);
  const DropoutParams d = a.dropout;
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(Sk, 1));
  at::parallel_for(0, a.rows, grain, [&](int64_t begin, int64_t end) {
    RowScratch<acc_t> s(Sk, d.active);
    acc_t* z = s.z.data();
    for (int64_t r = begin; r < end; ++r) {
      const int64_t n = causal_limit(a, r);  // elements n.. are causally masked (probability 0)
      const scalar_t* srow = P.scores + P.si.offset(r);
      acc_t rowadd = 0;
      const mask_t* mrow = nullptr;
      if constexpr (kHasMask) {
        const mask_t* m = static_cast<const mask_t*>(P.mask) + P.mi.offset(r);
        if (P.mask_col_stride == 0) {
          rowadd = mask_value<acc_t>(m, 0);  // one mask value for the whole row
        } else {
          mrow = m;
        }
      }
      acc_t mx;
      if (kHasMask && mrow != nullptr) {
        mx = load_logits<acc_t>(srow, mrow, n, scale, rowadd, z);
      } else {
        mx = load_logits<acc_t>(srow, static_cast<const NoMask*>(nullptr), n, scale, rowadd, z);
      }
      scalar_t* orow = P.out + r * Sk;
      scalar_t* prow = P.probs ? P.probs + r * Sk : nullptr;
      int64_t done = 0;
      acc_t tail = 0;  // value of the causally masked elements n..: 0, or NaN in a NaN row (as eager)
      if (n > 0 && mx != -std::numeric_limits<acc_t>::infinity()) {  // else: fully masked -> zeros
        const acc_t sum = exp_sum(z, n, mx);
        const acc_t inv = acc_t(1) / sum;
        tail = acc_t(0) * inv;
        if (d.active) {
          fill_mult(d, a.keep_scale, static_cast<uint64_t>(r) * static_cast<uint64_t>(Sk), n, s);
          const acc_t* mult = s.mult.data();
          for (int64_t j = 0; j < n; ++j) {
            const acc_t pj = z[j] * inv;
            prow[j] = static_cast<scalar_t>(pj);
            orow[j] = static_cast<scalar_t>(pj * mult[j]);
          }
        } else {
          for (int64_t j = 0; j < n; ++j) orow[j] = static_cast<scalar_t>(z[j] * inv);
        }
        done = n;
      }
      for (int64_t j = done; j < Sk; ++j) orow[j] = static_cast<scalar_t>(tail);
      if (prow) {
        for (int64_t j = done; j < Sk; ++j) prow[j] = static_cast<scalar_t>(tail);
      }
    }
  });
}

// ------------------------------------------------------------------------------------------------
// Backward
// ------------------------------------------------------------------------------------------------

template <typename scalar_t>
void softmax_bwd_rows(const SoftmaxArgs& a, const scalar_t* go, const RowIndexer& gi,
                      const scalar_t* pr, const RowIndexer& pi, const bool* keep, const RowIndexer& ki,
                      double mask_scale, scalar_t* gz) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t Sk = a.Sk;
  const acc_t scale = static_cast<acc_t>(a.scale);
  const DropoutParams d = a.dropout;
  const bool masked = d.active || keep != nullptr;  // Philox multipliers, or a stored mask's
  const acc_t mscale = static_cast<acc_t>(mask_scale);
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(Sk, 1));
  at::parallel_for(0, a.rows, grain, [&](int64_t begin, int64_t end) {
    RowScratch<acc_t> s(Sk, masked);
    acc_t* g = s.z.data();
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* grow = go + gi.offset(r);
      const scalar_t* prow = pr + pi.offset(r);
      scalar_t* orow = gz + r * Sk;
      acc_t ps[kLanes];
      for (int l = 0; l < kLanes; ++l) ps[l] = acc_t(0);
      if (d.active) {
        fill_mult(d, a.keep_scale, static_cast<uint64_t>(r) * static_cast<uint64_t>(Sk), Sk, s);
      } else if (keep) {
        const bool* krow = keep + ki.offset(r);
        for (int64_t j = 0; j < Sk; ++j) s.mult[j] = krow[j] ? mscale : acc_t(0);
      }
      const acc_t* mult = s.mult.data();
      int64_t j = 0;
      for (; j + kLanes <= Sk; j += kLanes) {
        for (int l = 0; l < kLanes; ++l) {
          acc_t gj = to_acc<acc_t>(grow[j + l]);
          if (masked) gj *= mult[j + l];
          g[j + l] = gj;
          ps[l] += gj * to_acc<acc_t>(prow[j + l]);
        }
      }
      for (; j < Sk; ++j) {
        acc_t gj = to_acc<acc_t>(grow[j]);
        if (masked) gj *= mult[j];
        g[j] = gj;
        ps[0] += gj * to_acc<acc_t>(prow[j]);
      }
      acc_t dot = 0;
      for (int l = 0; l < kLanes; ++l) dot += ps[l];
      for (int64_t k = 0; k < Sk; ++k) {
        const acc_t pk = to_acc<acc_t>(prow[k]);
        orow[k] = static_cast<scalar_t>(scale * pk * (g[k] - dot));
      }
    }
  });
}

template <typename scalar_t>
void dispatch_fwd(const SoftmaxArgs& a, const MaskView& mv, const FwdPtrs<scalar_t>& P) {
  switch (mv.kind) {
    case kNoMask: softmax_fwd_rows<scalar_t, NoMask>(a, P); break;
    case kMaskSame: softmax_fwd_rows<scalar_t, scalar_t>(a, P); break;
    case kMaskFloat: softmax_fwd_rows<scalar_t, float>(a, P); break;
    case kMaskBool: softmax_fwd_rows<scalar_t, bool>(a, P); break;
    default: TORCH_CHECK(false, "dmfx::softmax_fwd: internal error: mask kind ", mv.kind);
  }
}

}  // namespace softmax_impl

std::vector<at::Tensor> softmax_fwd_cpu(const at::Tensor& scores_in,
                                        const c10::optional<at::Tensor>& mask_in, double scale,
                                        bool causal, int64_t seed, int64_t offset, double p) {
  using namespace softmax_impl;
  const char* op = "softmax_fwd";
  check_scores(op, "scores", scores_in, at::kCPU);
  const SoftmaxArgs a = make_fwd_args(op, scores_in, causal, scale, seed, offset, p);
  const MaskView mv = prepare_mask(op, mask_in, scores_in);
  auto outs = alloc_fwd_outputs(scores_in, a);
  if (a.rows == 0) return outs;
  const at::Tensor scores = rowable(scores_in);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, scores.scalar_type(), "dmfx_softmax_fwd", [&] {
    FwdPtrs<scalar_t> P;
    P.scores = scores.data_ptr<scalar_t>();
    P.si = RowIndexer::of(scores);
    P.mask = mv.t.defined() ? mv.t.data_ptr() : nullptr;
    P.mi = mv.idx;
    P.mask_col_stride = mv.col_stride;
    P.out = outs[0].data_ptr<scalar_t>();
    P.probs = a.dropout.active ? outs[1].data_ptr<scalar_t>() : nullptr;
    dispatch_fwd<scalar_t>(a, mv, P);
  });
  return outs;
}

at::Tensor softmax_bwd_cpu(const at::Tensor& grad_out_in, const at::Tensor& probs_in, int64_t seed,
                           int64_t offset, double p, double scale, const c10::optional<at::Tensor>& mask_in,
                           double mask_scale) {
  using namespace softmax_impl;
  const SoftmaxArgs a =
      check_bwd_args("softmax_bwd", grad_out_in, probs_in, seed, offset, p, scale, at::kCPU);
  check_stored_mask("softmax_bwd", mask_in, "probs", probs_in, p, mask_scale);
  at::Tensor grad = at::empty(probs_in.sizes(), probs_in.options());
  if (a.rows == 0) return grad;
  const at::Tensor grad_out = rowable(grad_out_in), probs = rowable(probs_in);
  const auto mask = rowable(mask_in);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, probs.scalar_type(), "dmfx_softmax_bwd", [&] {
    softmax_bwd_rows<scalar_t>(a, grad_out.data_ptr<scalar_t>(), RowIndexer::of(grad_out),
                               probs.data_ptr<scalar_t>(), RowIndexer::of(probs),
                               mask ? mask->data_ptr<bool>() : nullptr,
                               mask ? RowIndexer::of(*mask) : RowIndexer{}, mask_scale,
                               grad.data_ptr<scalar_t>());
  });
  return grad;
}

}  // namespace dmfx

#else  // DMFX_CPU_GLUE: the glue (in cpu_bindings.cpp's translation unit)
#include <torch/csrc/utils/pybind.h>

#include "cpu_kernels.h"

namespace dmfx {
void bind_softmax(pybind11::module_& m) {
  m.def("softmax_fwd", &softmax_fwd_cpu,
        "fused scale + mask + causal + softmax + dropout forward (CPU); returns [out, probs]",
        pybind11::arg("scores"), pybind11::arg("mask"), pybind11::arg("scale"),
        pybind11::arg("causal"), pybind11::arg("seed"), pybind11::arg("offset"), pybind11::arg("p"));
  m.def("softmax_bwd", &softmax_bwd_cpu,
        "fused dropout + softmax backward, times scale (CPU); a stored bool mask (native_dropout's) "
        "replaces the Philox one",
        pybind11::arg("grad_out"), pybind11::arg("probs"), pybind11::arg("seed"),
        pybind11::arg("offset"), pybind11::arg("p"), pybind11::arg("scale"),
        pybind11::arg("mask") = pybind11::none(), pybind11::arg("mask_scale") = 1.0);
}

}  // namespace dmfx

#ifndef DMFX_KERNELS_ONLY
// ------------------------------------------------------------------------------------------------
// The ops: CPU kernels (through the kernel table: cpu_kernels.h) and the family's autograd formula
// ------------------------------------------------------------------------------------------------
#include "softmax_ops.h"

namespace dmfx {
namespace softmax_ops {
namespace {

struct CpuSoftmax {
  template <class... A>
  static Tensors softmax_fwd(A&&... a) { return cpu_kernels().softmax_fwd(std::forward<A>(a)...); }
  template <class... A>
  static Tensor softmax_bwd(A&&... a) { return cpu_kernels().softmax_bwd(std::forward<A>(a)...); }
};

// dmfx::attention_softmax's gradient: dmfx::attention_softmax_backward for the scores and, when a float
// mask requires grad (T5's learned position bias), for the mask (scale 1, summed to the mask's shape).
// A gradient reaching probs (the second output, p > 0) is a p == 0 softmax backward of its own.
struct AttentionSoftmaxFn : public torch::autograd::Function<AttentionSoftmaxFn> {
  static constexpr const char* name = "dmfx::attention_softmax";
  using Sig = decltype(attention_softmax<CpuSoftmax>);
  static variable_list forward(AutogradContext* ctx, const Tensor& scores, const Opt& mask, double scale, bool causal,
                               const Opt& seed, double p) {
    auto out = AutogradKernel<AttentionSoftmaxFn>::below(scores, mask, scale, causal, seed, p);
    ctx->saved_data["needs"] = needs_bits(scores, mask);
    ctx->saved_data["p"] = p;
    ctx->saved_data["scale"] = scale;
    if (present(mask)) {
      ctx->saved_data["mask_shape"] = mask->sym_sizes();  // (symbolic when traced)
      ctx->saved_data["mask_dtype"] = static_cast<int64_t>(mask->scalar_type());
    }
    ctx->set_materialize_grads(false);  // an unused output (usually probs) gives no gradient to run a kernel on
    ctx->save_for_backward({p > 0.0 ? out[1] : out[0], seed.value_or(Tensor())});
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    const bool need_scores = needs(ctx, 0), need_mask = needs(ctx, 1);
    const variable_list none(6);
    if (!(need_scores || need_mask)) return none;
    const auto saved = ctx->get_saved_variables();
    const Tensor& probs = saved[0];
    const double p = ctx->saved_data["p"].toDouble(), scale = ctx->saved_data["scale"].toDouble();
    // With a mask gradient the unscaled dz is needed too: compute it once, scale for the scores.
    const double kscale = need_mask ? 1.0 : scale;
    static const auto backward_op = dmfx_op<SoftmaxBackwardSig>("dmfx::attention_softmax_backward");
    Tensor dz;
    if (g[0].defined()) dz = backward_op.call(g[0], probs, opt(saved[1]), p, kscale, c10::nullopt, 1.0);
    if (g[1].defined() && p > 0.0) {  // probs is softmax(z) itself (no dropout)
      Tensor extra = backward_op.call(g[1], probs, c10::nullopt, 0.0, kscale, c10::nullopt, 1.0);
      dz = dz.defined() ? dz.add(extra) : extra;
    }
    if (!dz.defined()) return none;
    Tensor d_scores, d_mask;
    if (need_scores) d_scores = need_mask && scale != 1.0 ? dz.mul(scale) : dz;
    if (need_mask) {
      d_mask = dz.sum_to_size_symint(ctx->saved_data["mask_shape"].toSymIntVector())
                   .to(static_cast<at::ScalarType>(ctx->saved_data["mask_dtype"].toInt()));
    }
    return {d_scores, d_mask, Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

struct SoftmaxBackwardOp {
  static constexpr const char* name = "dmfx::attention_softmax_backward";
  static constexpr const char* hint = "dmfx.attention_softmax";
  using Sig = SoftmaxBackwardSig;
};

}  // namespace
}  // namespace softmax_ops
}  // namespace dmfx

TORCH_LIBRARY_IMPL(dmfx, CPU, m) { dmfx::softmax_ops::register_kernels<dmfx::softmax_ops::CpuSoftmax>(m); }

TORCH_LIBRARY_IMPL(dmfx, Autograd, m) {
  using namespace dmfx;
  using namespace dmfx::softmax_ops;
  m.impl("attention_softmax", &AutogradKernel<AttentionSoftmaxFn>::call);
  m.impl("attention_softmax_backward", &AutogradKernel<NoDoubleBackward<SoftmaxBackwardOp>>::call);
}
#endif  // DMFX_KERNELS_ONLY
#endif  // DMFX_CPU_GLUE

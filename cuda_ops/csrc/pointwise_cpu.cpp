// dmfx CPU kernels of the pointwise family:
//   bias_act_fwd / bias_act_bwd  out = dropout(act(x + bias)); backward recomputes from x and fuses
//                                the bias gradient (per-thread column partials, one final reduction)
//   glu_fwd / glu_bwd            out = act(gate) * up (SwiGLU, GeGLU)
//   rope                         rotary position embedding of q and k (and its transpose map)
//   softcap_fwd / softcap_bwd    out = cap * tanh(x / cap) (Gemma 2's soft-capped logits); the backward
//                                reads the output only: grad * (1 - (out / cap)^2)
//
// Every tensor is seen as [rows, N] with unit stride along N; the leading dimensions may have any
// strides (RowIndexer), so permuted or sliced activations are read in place. Outputs are contiguous.
// The per-element math (activations and their derivatives) is in pointwise_api.h, shared with CUDA.
// float rows run through at::vec::Vectorized<float> (erf/exp/tanh vectorized as in ATen's own gelu);
// half/bfloat16 rows are converted to float buffers, computed in float and rounded once; double is
// computed in double (scalar loops; used for gradcheck).
//
// Vectorized<float> only uses AVX2/AVX-512 when CPU_CAPABILITY_* is defined (as in ATen's own kernel
// builds and Inductor's C++ kernels); build.py compiles with -march=native, so select the matching
// capability here. Without it, Vectorized falls back to its portable (slower) implementation.
//
// The file has two parts (cuda_ops/build.py): the kernels, this file's own translation unit (-O3), and,
// under DMFX_CPU_GLUE, the glue (the kernel functions' Python bindings, the ops' registration and
// autograd formulas), which cpu_bindings.cpp includes into the one translation unit of every family's glue.
#ifndef DMFX_CPU_GLUE
#if !defined(CPU_CAPABILITY)
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__) && \
    defined(__FMA__)
#define CPU_CAPABILITY AVX512
#define CPU_CAPABILITY_AVX512
#elif defined(__AVX2__) && defined(__FMA__)
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#endif
#endif

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "dmfx_common.h"
#include "cpu_kernels.h"
#include "kernel_api.h"
#include "pointwise_api.h"
#include "philox_cpu.h"

namespace dmfx {
namespace pointwise_impl {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kVec = Vec::size();

// 1 / d without a division: the approximate reciprocal and one Newton step (relative error about
// 2^-28 from AVX-512's 14-bit estimate, 2^-23 from AVX2's 12-bit one). A vector division takes about
// 10 cycles per 16 floats, the largest single cost of GELU's erf.
inline Vec recip(const Vec& d) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 dv = d, r = _mm512_rcp14_ps(dv);
  return Vec(_mm512_mul_ps(r, _mm512_fnmadd_ps(dv, r, _mm512_set1_ps(2.0f))));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256 dv = d, r = _mm256_rcp_ps(dv);
  return Vec(_mm256_mul_ps(r, _mm256_fnmadd_ps(dv, r, _mm256_set1_ps(2.0f))));
#else
  return Vec(1.0f) / d;
#endif
}

// erf(|z|) by Abramowitz-Stegun 7.1.26 (|error| < 1.5e-7, the formula of ATen's vectorized erf), given
// e = exp(-z^2): 1 - t (a1 + t (a2 + ...)) e with t = 1 / (1 + 0.3275911 |z|).
inline Vec erf_abs(const Vec& a, const Vec& e) {
  const Vec one(1.0f);
  const Vec t = recip(at::vec::fmadd(Vec(0.3275911f), a, one));
  Vec r = at::vec::fmadd(Vec(1.061405429f), t, Vec(-1.453152027f));
  r = at::vec::fmadd(r, t, Vec(1.421413741f));
  r = at::vec::fmadd(r, t, Vec(-0.284496736f));
  r = at::vec::fmadd(r, t, Vec(0.254829592f));
  return one - r * t * e;
}

// The activation formulas of pointwise_api.h evaluated on whole vectors. exp is ATen's inline
// exp_u20 (a polynomial, about 20 ulp) rather than Vectorized::exp/erf/tanh, which call SLEEF through
// libtorch's PLT: an out-of-line call per vector that also spills every vector register. erf is a
// rational function (below), tanh is sign(x) (1 - 2 / (exp(2|x|) + 1)) (absolute error ~1e-7).
template <>
struct PwMath<Vec> {
  static Vec c(double v) { return Vec(static_cast<float>(v)); }
  static Vec exp(const Vec& v) { return v.exp_u20(); }
  // erf(z) = z P(z^2) / Q(z^2), the rational approximation Eigen and XLA use for float erf: about half
  // the instructions of the exp-based formula (erf_abs, which the GELU derivative keeps because it needs
  // that exp anyway). Designed for |z| <= 4, where erf rounds to 1 in float; but it stops short of 1 by
  // about 1e-8 near 4, which 1 + erf(z) in GELU's tail would multiply by a large negative x. Beyond 4
  // it rises above 1, so z is clamped to 4.5 and the result to [-1, 1]: exactly +-1 from |z| ~ 3.95 on.
  static Vec erf(const Vec& v) {
    const Vec z = at::vec::clamp(v, Vec(-4.5f), Vec(4.5f));
    const Vec z2 = z * z;
    Vec p = at::vec::fmadd(z2, Vec(-2.72614225801306e-10f), Vec(2.77068142495902e-08f));
    p = at::vec::fmadd(z2, p, Vec(-2.10102402082508e-06f));
    p = at::vec::fmadd(z2, p, Vec(-5.69250639462346e-05f));
    p = at::vec::fmadd(z2, p, Vec(-7.34990630326855e-04f));
    p = at::vec::fmadd(z2, p, Vec(-2.95459980854025e-03f));
    p = at::vec::fmadd(z2, p, Vec(-1.60960333262415e-02f));
    Vec q = at::vec::fmadd(z2, Vec(-1.45660718464996e-05f), Vec(-2.13374055278905e-04f));
    q = at::vec::fmadd(z2, q, Vec(-1.68282697438203e-03f));
    q = at::vec::fmadd(z2, q, Vec(-7.37332916720468e-03f));
    q = at::vec::fmadd(z2, q, Vec(-1.42647390514189e-02f));
    return at::vec::clamp(z * p * recip(q), Vec(-1.0f), Vec(1.0f));
  }
  static Vec tanh(const Vec& v) {
    const Vec one(1.0f);
    const Vec y = one - Vec(2.0f) / ((v.abs() * Vec(2.0f)).exp_u20() + one);
    return Vec::blendv(y, y.neg(), v < Vec(0.0f));
  }
  static Vec neg(const Vec& v) { return v.neg(); }
  static Vec relu(const Vec& v) { return at::vec::clamp_min(v, Vec(0.0f)); }
  static Vec where_pos(const Vec& x, const Vec& a) {
    return Vec::blendv(Vec(0.0f), a, x > Vec(0.0f));
  }
};

// GELU's derivative Phi(x) + x phi(x) with one exp: erf(x / sqrt 2) needs exp(-x^2 / 2), which is
// also the density's (the generic formula of pointwise_api.h computes it twice).
template <>
inline Vec act_grad<kGelu, Vec>(Vec x) {
  const Vec e = (x * x * Vec(-0.5f)).exp_u20();
  const Vec y = erf_abs((x * Vec(static_cast<float>(kSqrt1_2))).abs(), e);
  const Vec erf = Vec::blendv(y, y.neg(), x < Vec(0.0f));
  const Vec cdf = Vec(0.5f) * (Vec(1.0f) + erf);
  return at::vec::fmadd(x, Vec(static_cast<float>(kInvSqrt2Pi)) * e, cdf);
}

// The soft cap with ATen's Vectorized tanh (SLEEF's, within 1 ulp), as attention_cpu.cpp's soft_cap
// has it: not PwMath<Vec>::tanh, whose 1 - 2 / (exp(2|v|) + 1) is off by about 1e-7 absolute, so by far
// more than float's rounding relative to tanh(v) where |v| = |x / cap| is small (most logits); not a
// scalar tanh per element either (measured 4% slower on a whole Gemma 2 model in the attention's cap).
template <>
inline Vec softcap_fwd<Vec>(Vec x, Vec cap) {
  return cap * (x / cap).tanh();
}

// Full vector or the first `c` lanes (the rest zero).
inline Vec ld(const float* p, int64_t c) { return c == kVec ? Vec::loadu(p) : Vec::loadu(p, c); }
inline void st(const Vec& v, float* p, int64_t c) {
  if (c == kVec) v.store(p); else v.store(p, c);
}

// Dropout multipliers (0 or `scale`) of the n elements with logical indices first, first + 1, ...
// Philox words for the whole run at once (philox_cpu.h: AVX-512 where available). Only called when
// dropout is active.
template <typename acc_t>
void fill_mult(const DropoutParams& d, uint64_t first, int64_t n, acc_t scale, acc_t* m) {
  if (d.drop_all) {
    std::fill(m, m + n, acc_t(0));
    return;
  }
  const uint32_t t = d.threshold;
  const uint32_t* w = philox_cpu::words_for(first, n, d.offset, d.seed);
  for (int64_t k = 0; k < n; ++k) m[k] = w[k] >= t ? scale : acc_t(0);
}

// The same multipliers from a stored mask row (PyTorch's native_dropout mask): keep ? scale : 0.
template <typename acc_t>
void fill_mult(const bool* keep, int64_t n, acc_t scale, acc_t* m) {
  for (int64_t k = 0; k < n; ++k) m[k] = keep[k] ? scale : acc_t(0);
}

// ------------------------------------------------------------------------------------------------
// Row cores: float (vectorized) and double (scalar). Null pointers mean "absent".
// ------------------------------------------------------------------------------------------------

// Calls f(j, c) for the vectors of a row of n elements (c = lanes in use, kVec but for the tail),
// two vectors per iteration so that the two (independent) erf/exp/tanh chains overlap.
template <typename F>
inline void for_vectors(int64_t n, F&& f) {
  int64_t j = 0;
  for (; j + 2 * kVec <= n; j += 2 * kVec) {
    f(j, kVec);
    f(j + kVec, kVec);
  }
  for (; j < n; j += kVec) f(j, std::min(kVec, n - j));
}

// o = act(x + b) * m
template <int ACT>
inline void bias_act_fwd_row(const float* x, const float* b, const float* m, float* o, int64_t n) {
  for_vectors(n, [&](int64_t j, int64_t c) {
    Vec v = ld(x + j, c);
    if (b) v = v + ld(b + j, c);
    v = act_fwd<ACT, Vec>(v);
    if (m) v = v * ld(m + j, c);
    st(v, o + j, c);
  });
}

template <int ACT>
inline void bias_act_fwd_row(const double* x, const double* b, const double* m, double* o, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    double v = act_fwd<ACT, double>(b ? x[j] + b[j] : x[j]);
    o[j] = m ? v * m[j] : v;
  }
}

// For a block of nr <= kRowBlock rows: dx[i] = g[i] * m[i] * act'(x[i] + b); acc += sum_i dx[i].
// The bias-gradient partial stays in a register across the block's rows (one load/store of acc per
// kRowBlock rows).
constexpr int kRowBlock = 4;

template <int ACT>
inline void bias_act_bwd_rows(const float* const* g, const float* const* x, const float* b,
                              const float* const* m, float* const* dx, float* acc, int nr, int64_t n) {
  for_vectors(n, [&](int64_t j, int64_t c) {
    const Vec bv = b ? ld(b + j, c) : Vec(0.0f);
    Vec s = acc ? ld(acc + j, c) : Vec(0.0f);
    for (int i = 0; i < nr; ++i) {
      Vec gv = ld(g[i] + j, c);
      if (m) gv = gv * ld(m[i] + j, c);
      const Vec r = gv * act_grad<ACT, Vec>(ld(x[i] + j, c) + bv);
      if (dx[i]) st(r, dx[i] + j, c);
      s = s + r;
    }
    if (acc) st(s, acc + j, c);
  });
}

template <int ACT>
inline void bias_act_bwd_rows(const double* const* g, const double* const* x, const double* b,
                              const double* const* m, double* const* dx, double* acc, int nr,
                              int64_t n) {
  for (int i = 0; i < nr; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      const double gv = m ? g[i][j] * m[i][j] : g[i][j];
      const double r = gv * act_grad<ACT, double>(b ? x[i][j] + b[j] : x[i][j]);
      if (dx[i]) dx[i][j] = r;
      if (acc) acc[j] += r;
    }
  }
}

// o = act(gate) * up
template <int ACT>
inline void glu_fwd_row(const float* gate, const float* up, float* o, int64_t n) {
  for_vectors(n, [&](int64_t j, int64_t c) {
    st(act_fwd<ACT, Vec>(ld(gate + j, c)) * ld(up + j, c), o + j, c);
  });
}

template <int ACT>
inline void glu_fwd_row(const double* gate, const double* up, double* o, int64_t n) {
  for (int64_t j = 0; j < n; ++j) o[j] = act_fwd<ACT, double>(gate[j]) * up[j];
}

// dgate = g * up * act'(gate); dup = g * act(gate)
template <int ACT>
inline void glu_bwd_row(const float* g, const float* gate, const float* up, float* dgate, float* dup,
                        int64_t n) {
  for_vectors(n, [&](int64_t j, int64_t c) {
    const Vec gv = ld(g + j, c), a = ld(gate + j, c);
    if (dgate) st(gv * ld(up + j, c) * act_grad<ACT, Vec>(a), dgate + j, c);
    if (dup) st(gv * act_fwd<ACT, Vec>(a), dup + j, c);
  });
}

template <int ACT>
inline void glu_bwd_row(const double* g, const double* gate, const double* up, double* dgate,
                        double* dup, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    if (dgate) dgate[j] = g[j] * up[j] * act_grad<ACT, double>(gate[j]);
    if (dup) dup[j] = g[j] * act_fwd<ACT, double>(gate[j]);
  }
}

// o = cap * tanh(x / cap)
inline void softcap_fwd_row(const float* x, float cap, float* o, int64_t n) {
  const Vec c(cap);
  for_vectors(n, [&](int64_t j, int64_t l) { st(softcap_fwd<Vec>(ld(x + j, l), c), o + j, l); });
}

inline void softcap_fwd_row(const double* x, double cap, double* o, int64_t n) {
  for (int64_t j = 0; j < n; ++j) o[j] = softcap_fwd<double>(x[j], cap);
}

// dx = g * (1 - (out / cap)^2)
inline void softcap_bwd_row(const float* g, const float* out, float cap, float* dx, int64_t n) {
  const Vec c(cap);
  for_vectors(n, [&](int64_t j, int64_t l) { st(softcap_grad<Vec>(ld(g + j, l), ld(out + j, l), c), dx + j, l); });
}

inline void softcap_bwd_row(const double* g, const double* out, double cap, double* dx, int64_t n) {
  for (int64_t j = 0; j < n; ++j) dx[j] = softcap_grad<double>(g[j], out[j], cap);
}

// ------------------------------------------------------------------------------------------------
// Row sources: a row of a tensor as acc_t values, converted into a per-thread buffer only when the
// tensor's dtype is not acc_t (half/bfloat16).
// ------------------------------------------------------------------------------------------------

template <typename scalar_t>
struct Rows {
  using acc_t = at::opmath_type<scalar_t>;
  static constexpr bool kDirect = std::is_same<scalar_t, acc_t>::value;
  const scalar_t* data = nullptr;
  RowIndexer idx;

  Rows() = default;
  explicit Rows(const at::Tensor& t) : data(t.data_ptr<scalar_t>()), idx(RowIndexer::of(t)) {}

  // Row r as acc_t: a pointer into the tensor, or into `buf` (n elements) after conversion.
  const acc_t* get(int64_t r, int64_t n, acc_t* buf) const {
    const scalar_t* p = data + idx.offset(r);
    if constexpr (kDirect) {
      (void)n; (void)buf;
      return p;
    } else {
      for (int64_t j = 0; j < n; ++j) buf[j] = static_cast<acc_t>(p[j]);
      return buf;
    }
  }
};

// Where a row result goes: straight into the output, or into `buf` and then store() rounds it once.
template <typename scalar_t>
struct OutRow {
  using acc_t = at::opmath_type<scalar_t>;
  scalar_t* dst = nullptr;
  acc_t* buf = nullptr;
  acc_t* ptr() const {
    if constexpr (std::is_same<scalar_t, acc_t>::value) return dst;
    else return dst ? buf : nullptr;
  }
  void store(int64_t n) const {
    if constexpr (!std::is_same<scalar_t, acc_t>::value) {
      if (dst) for (int64_t j = 0; j < n; ++j) dst[j] = static_cast<scalar_t>(buf[j]);
    }
  }
};

template <typename acc_t, typename scalar_t>
std::vector<acc_t> to_acc_vector(const c10::optional<at::Tensor>& t) {
  std::vector<acc_t> v;
  if (!present(t)) return v;
  const scalar_t* p = t->data_ptr<scalar_t>();  // contiguous
  v.resize(t->numel());
  for (int64_t j = 0; j < t->numel(); ++j) v[j] = static_cast<acc_t>(p[j]);
  return v;
}

inline int64_t grain_for(int64_t n) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(n, 1)); }

// ------------------------------------------------------------------------------------------------
// bias + activation + dropout
// ------------------------------------------------------------------------------------------------

template <typename scalar_t, int ACT>
void bias_act_fwd_impl(const at::Tensor& x, const c10::optional<at::Tensor>& bias,
                       const DropoutParams& d, double p, at::Tensor& out) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t N = x.size(-1), rows = num_rows(x);
  const Rows<scalar_t> xr(x);
  const std::vector<acc_t> bvec = to_acc_vector<acc_t, scalar_t>(bias);
  const acc_t* b = bvec.empty() ? nullptr : bvec.data();
  const acc_t scale = static_cast<acc_t>(d.scale);
  scalar_t* o = out.data_ptr<scalar_t>();
  at::parallel_for(0, rows, grain_for(N), [&](int64_t begin, int64_t end) {
    std::vector<acc_t> mult(d.active ? N : 0), xbuf(N), obuf(N);
    for (int64_t r = begin; r < end; ++r) {
      if (d.active) fill_mult(d, static_cast<uint64_t>(r) * N, N, scale, mult.data());
      const OutRow<scalar_t> orow{o + r * N, obuf.data()};
      bias_act_fwd_row<ACT>(xr.get(r, N, xbuf.data()), b, d.active ? mult.data() : nullptr,
                            orow.ptr(), N);
      orow.store(N);
    }
  });
}

template <typename scalar_t, int ACT>
void bias_act_bwd_impl(const at::Tensor& grad_out, const at::Tensor& x,
                       const c10::optional<at::Tensor>& bias, const DropoutParams& d, double p,
                       const c10::optional<at::Tensor>& mask, double mask_scale, at::Tensor& dx,
                       at::Tensor& dbias) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t N = x.size(-1), rows = num_rows(x);
  const Rows<scalar_t> gr(grad_out), xr(x);
  const std::vector<acc_t> bvec = to_acc_vector<acc_t, scalar_t>(bias);
  const acc_t* b = bvec.empty() ? nullptr : bvec.data();
  const acc_t scale = static_cast<acc_t>(d.scale);
  const Rows<bool> mr = present(mask) ? Rows<bool>(*mask) : Rows<bool>();  // a stored mask, or none
  const bool masked = d.active || mr.data != nullptr;  // a multiplier per element (Philox or stored)
  const acc_t mscale = static_cast<acc_t>(mask_scale);
  scalar_t* dxp = dx.defined() ? dx.data_ptr<scalar_t>() : nullptr;
  const bool need_db = dbias.defined();
  // The bias gradient: every thread sums its rows into its own partial row, then one reduction.
  const int64_t nthreads = at::get_num_threads();
  std::vector<acc_t> partial(need_db ? static_cast<size_t>(nthreads) * N : 0, acc_t(0));
  at::parallel_for(0, rows, grain_for(N), [&](int64_t begin, int64_t end) {
    acc_t* acc = need_db ? partial.data() + at::get_thread_num() * N : nullptr;
    const int64_t B = kRowBlock;
    std::vector<acc_t> mult(masked ? B * N : 0), gbuf(B * N), xbuf(B * N), dbuf(B * N);
    for (int64_t r0 = begin; r0 < end; r0 += B) {
      const int nr = static_cast<int>(std::min(B, end - r0));
      const acc_t* gp[kRowBlock];
      const acc_t* xp[kRowBlock];
      const acc_t* mp[kRowBlock];
      acc_t* dp[kRowBlock];
      OutRow<scalar_t> drow[kRowBlock];
      for (int i = 0; i < nr; ++i) {
        const int64_t r = r0 + i;
        if (d.active) fill_mult(d, static_cast<uint64_t>(r) * N, N, scale, mult.data() + i * N);
        else if (mr.data) fill_mult(mr.get(r, N, nullptr), N, mscale, mult.data() + i * N);
        mp[i] = mult.data() + i * N;
        gp[i] = gr.get(r, N, gbuf.data() + i * N);
        xp[i] = xr.get(r, N, xbuf.data() + i * N);
        drow[i] = OutRow<scalar_t>{dxp ? dxp + r * N : nullptr, dbuf.data() + i * N};
        dp[i] = drow[i].ptr();
      }
      bias_act_bwd_rows<ACT>(gp, xp, b, masked ? mp : nullptr, dp, acc, nr, N);
      for (int i = 0; i < nr; ++i) drow[i].store(N);
    }
  });
  if (need_db) {
    scalar_t* db = dbias.data_ptr<scalar_t>();
    for (int64_t j = 0; j < N; ++j) {
      acc_t s = 0;
      for (int64_t t = 0; t < nthreads; ++t) s += partial[t * N + j];
      db[j] = static_cast<scalar_t>(s);
    }
  }
}

// ------------------------------------------------------------------------------------------------
// gated activations
// ------------------------------------------------------------------------------------------------

template <typename scalar_t, int ACT>
void glu_fwd_impl(const at::Tensor& gate, const at::Tensor& up, at::Tensor& out) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t N = gate.size(-1), rows = num_rows(gate);
  const Rows<scalar_t> ar(gate), ur(up);
  scalar_t* o = out.data_ptr<scalar_t>();
  at::parallel_for(0, rows, grain_for(N), [&](int64_t begin, int64_t end) {
    std::vector<acc_t> abuf(N), ubuf(N), obuf(N);
    for (int64_t r = begin; r < end; ++r) {
      const OutRow<scalar_t> orow{o + r * N, obuf.data()};
      glu_fwd_row<ACT>(ar.get(r, N, abuf.data()), ur.get(r, N, ubuf.data()), orow.ptr(), N);
      orow.store(N);
    }
  });
}

template <typename scalar_t, int ACT>
void glu_bwd_impl(const at::Tensor& grad_out, const at::Tensor& gate, const at::Tensor& up,
                  at::Tensor& dgate, at::Tensor& dup) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t N = gate.size(-1), rows = num_rows(gate);
  const Rows<scalar_t> gr(grad_out), ar(gate), ur(up);
  scalar_t* dgp = dgate.defined() ? dgate.data_ptr<scalar_t>() : nullptr;
  scalar_t* dup_p = dup.defined() ? dup.data_ptr<scalar_t>() : nullptr;
  at::parallel_for(0, rows, grain_for(N), [&](int64_t begin, int64_t end) {
    std::vector<acc_t> gbuf(N), abuf(N), ubuf(N), b1(N), b2(N);
    for (int64_t r = begin; r < end; ++r) {
      const OutRow<scalar_t> o1{dgp ? dgp + r * N : nullptr, b1.data()};
      const OutRow<scalar_t> o2{dup_p ? dup_p + r * N : nullptr, b2.data()};
      // up is only read for dgate.
      const acc_t* u = dgp ? ur.get(r, N, ubuf.data()) : nullptr;
      glu_bwd_row<ACT>(gr.get(r, N, gbuf.data()), ar.get(r, N, abuf.data()), u, o1.ptr(), o2.ptr(), N);
      o1.store(N);
      o2.store(N);
    }
  });
}

// ------------------------------------------------------------------------------------------------
// soft cap
// ------------------------------------------------------------------------------------------------

// out = cap * tanh(x / cap), row by row (x rowable, out contiguous).
template <typename scalar_t>
void softcap_fwd_impl(const at::Tensor& x, double cap, at::Tensor& out) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t N = x.size(-1), rows = num_rows(x);
  const Rows<scalar_t> xr(x);
  const acc_t c = static_cast<acc_t>(cap);
  scalar_t* o = out.data_ptr<scalar_t>();
  at::parallel_for(0, rows, grain_for(N), [&](int64_t begin, int64_t end) {
    std::vector<acc_t> xbuf(Rows<scalar_t>::kDirect ? 0 : N), obuf(N);
    for (int64_t r = begin; r < end; ++r) {
      const OutRow<scalar_t> orow{o + r * N, obuf.data()};
      softcap_fwd_row(xr.get(r, N, xbuf.data()), c, orow.ptr(), N);
      orow.store(N);
    }
  });
}

// dx = grad_out * (1 - (out / cap)^2), row by row (grad_out and out rowable, dx contiguous).
template <typename scalar_t>
void softcap_bwd_impl(const at::Tensor& grad_out, const at::Tensor& out, double cap, at::Tensor& dx) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t N = out.size(-1), rows = num_rows(out);
  const Rows<scalar_t> gr(grad_out), orr(out);
  const acc_t c = static_cast<acc_t>(cap);
  scalar_t* d = dx.data_ptr<scalar_t>();
  at::parallel_for(0, rows, grain_for(N), [&](int64_t begin, int64_t end) {
    const int64_t n = Rows<scalar_t>::kDirect ? 0 : N;
    std::vector<acc_t> gbuf(n), obuf(n), dbuf(N);
    for (int64_t r = begin; r < end; ++r) {
      const OutRow<scalar_t> drow{d + r * N, dbuf.data()};
      softcap_bwd_row(gr.get(r, N, gbuf.data()), orr.get(r, N, obuf.data()), c, drow.ptr(), N);
      drow.store(N);
    }
  });
}

// ------------------------------------------------------------------------------------------------
// rotary embedding
// ------------------------------------------------------------------------------------------------

// One row of D = 2h elements, h rotated pairs (a, b): (j, j + h) for rotate_half (LLaMA's),
// (2j, 2j + 1) interleaved (GPT-J's and Cohere's rotate_every_two). Forward: o = x * c + rot(x) * s with
// rot(x)[a] = -x[b], rot(x)[b] = x[a]. Inverse (the transpose map, i.e. the backward):
// o[a] = x[a] c[a] + x[b] s[b], o[b] = x[b] c[b] - x[a] s[a].
// deinterleave (DeepSeek's rope_interleave): rotate_half's map on the de-interleaved row, x's pairs
// (2j, 2j + 1) read as (j, j + h), the tables and o indexed by halves; its inverse reads by halves and
// writes the pairs back interleaved.
template <typename scalar_t>
inline void rope_row(const scalar_t* x, const scalar_t* c, const scalar_t* s, scalar_t* o, int64_t h,
                     bool inverse, bool interleaved, bool deinterleave) {
  using acc_t = at::opmath_type<scalar_t>;
  auto f = [](scalar_t v) { return static_cast<acc_t>(v); };
  if (deinterleave && !inverse) {
    for (int64_t j = 0; j < h; ++j) {
      const acc_t x1 = f(x[2 * j]), x2 = f(x[2 * j + 1]);
      o[j] = static_cast<scalar_t>(x1 * f(c[j]) - x2 * f(s[j]));
      o[j + h] = static_cast<scalar_t>(x2 * f(c[j + h]) + x1 * f(s[j + h]));
    }
  } else if (deinterleave) {
    for (int64_t j = 0; j < h; ++j) {
      const acc_t x1 = f(x[j]), x2 = f(x[j + h]);
      o[2 * j] = static_cast<scalar_t>(x1 * f(c[j]) + x2 * f(s[j + h]));
      o[2 * j + 1] = static_cast<scalar_t>(x2 * f(c[j + h]) - x1 * f(s[j]));
    }
  } else if (interleaved && !inverse) {
    for (int64_t a = 0; a < 2 * h; a += 2) {
      const acc_t x1 = f(x[a]), x2 = f(x[a + 1]);
      o[a] = static_cast<scalar_t>(x1 * f(c[a]) - x2 * f(s[a]));
      o[a + 1] = static_cast<scalar_t>(x2 * f(c[a + 1]) + x1 * f(s[a + 1]));
    }
  } else if (interleaved) {
    for (int64_t a = 0; a < 2 * h; a += 2) {
      const acc_t x1 = f(x[a]), x2 = f(x[a + 1]);
      o[a] = static_cast<scalar_t>(x1 * f(c[a]) + x2 * f(s[a + 1]));
      o[a + 1] = static_cast<scalar_t>(x2 * f(c[a + 1]) - x1 * f(s[a]));
    }
  } else if (!inverse) {
    for (int64_t j = 0; j < h; ++j) o[j] = static_cast<scalar_t>(f(x[j]) * f(c[j]) - f(x[j + h]) * f(s[j]));
    for (int64_t j = 0; j < h; ++j)
      o[j + h] = static_cast<scalar_t>(f(x[j + h]) * f(c[j + h]) + f(x[j]) * f(s[j + h]));
  } else {
    for (int64_t j = 0; j < h; ++j)
      o[j] = static_cast<scalar_t>(f(x[j]) * f(c[j]) + f(x[j + h]) * f(s[j + h]));
    for (int64_t j = 0; j < h; ++j)
      o[j + h] = static_cast<scalar_t>(f(x[j + h]) * f(c[j + h]) - f(x[j]) * f(s[j]));
  }
}

template <typename scalar_t>
void rope_impl(const std::vector<RopeSide>& sides, std::vector<at::Tensor>& outs, bool inverse, bool interleaved,
               bool deinterleave) {
  struct Side {
    Rows<scalar_t> x, c, s;
    scalar_t* o;
    int64_t rows;
  };
  std::vector<Side> v;
  for (size_t i = 0; i < sides.size(); ++i) {
    if (sides[i].rows == 0) continue;
    v.push_back(Side{Rows<scalar_t>(sides[i].x), Rows<scalar_t>(sides[i].cos),
                     Rows<scalar_t>(sides[i].sin), outs[i].data_ptr<scalar_t>(), sides[i].rows});
  }
  if (v.empty()) return;
  const int64_t D = sides[0].x.size(-1), h = D / 2;
  const int64_t total = v.size() == 2 ? v[0].rows + v[1].rows : v[0].rows;
  // q's rows then k's rows, in one parallel loop.
  at::parallel_for(0, total, grain_for(D), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const bool first = i < v[0].rows;
      const Side& sd = first ? v[0] : v[1];
      const int64_t r = first ? i : i - v[0].rows;
      rope_row<scalar_t>(sd.x.data + sd.x.idx.offset(r), sd.c.data + sd.c.idx.offset(r),
                         sd.s.data + sd.s.idx.offset(r), sd.o + r * D, h, inverse, interleaved,
                         deinterleave);
    }
  });
}

}  // namespace pointwise_impl

// ------------------------------------------------------------------------------------------------
// Entry points
// ------------------------------------------------------------------------------------------------

at::Tensor bias_act_fwd_cpu(const at::Tensor& x_in, const c10::optional<at::Tensor>& bias_in,
                            int64_t act, int64_t seed, int64_t offset, double p) {
  using namespace pointwise_impl;
  const DropoutParams d = check_bias_act("bias_act_fwd", x_in, bias_in, act, seed, offset, p, at::kCPU);
  const at::Tensor x = rowable(x_in);
  const auto bias = contiguous(bias_in);
  at::Tensor out = at::empty(x.sizes(), x.options());
  if (x.numel() > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "dmfx_bias_act_fwd", [&] {
      dispatch_act(static_cast<int>(act), [&](auto a) {
        bias_act_fwd_impl<scalar_t, decltype(a)::value>(x, bias, d, p, out);
      });
    });
  }
  return out;
}

std::vector<at::Tensor> bias_act_bwd_cpu(const at::Tensor& grad_out_in, const at::Tensor& x_in,
                                         const c10::optional<at::Tensor>& bias_in, int64_t act,
                                         int64_t seed, int64_t offset, double p,
                                         std::vector<bool> output_mask,
                                         const c10::optional<at::Tensor>& mask_in, double mask_scale) {
  using namespace pointwise_impl;
  const char* op = "bias_act_bwd";
  const DropoutParams d = check_bias_act(op, x_in, bias_in, act, seed, offset, p, at::kCPU);
  check_same_shape(op, "grad_out", grad_out_in, "x", x_in);
  check_mask(op, output_mask, "[dx, dbias]");
  check_stored_mask(op, mask_in, "x", x_in, p, mask_scale);
  const at::Tensor x = rowable(x_in), grad_out = rowable(grad_out_in);
  const auto mask = rowable(mask_in);
  const auto bias = contiguous(bias_in);
  const at::Tensor empty = at::empty({0}, x.options());
  at::Tensor dx = output_mask[0] ? at::empty(x.sizes(), x.options()) : at::Tensor();
  at::Tensor dbias = output_mask[1] ? at::empty({x.size(-1)}, x.options()) : at::Tensor();  // (also without a bias)
  if (num_rows(x) > 0 && (dx.defined() || dbias.defined())) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "dmfx_bias_act_bwd", [&] {
      dispatch_act(static_cast<int>(act), [&](auto a) {
        bias_act_bwd_impl<scalar_t, decltype(a)::value>(grad_out, x, bias, d, p, mask, mask_scale, dx, dbias);
      });
    });
  } else if (dbias.defined()) {
    dbias.zero_();
  }
  return {dx.defined() ? dx : empty, dbias.defined() ? dbias : empty};
}

at::Tensor glu_fwd_cpu(const at::Tensor& gate_in, const at::Tensor& up_in, int64_t act) {
  using namespace pointwise_impl;
  check_glu("glu_fwd", gate_in, up_in, act, at::kCPU);
  const at::Tensor gate = rowable(gate_in), up = rowable(up_in);
  at::Tensor out = at::empty(gate.sizes(), gate.options());
  if (gate.numel() > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, gate.scalar_type(), "dmfx_glu_fwd", [&] {
      dispatch_act(static_cast<int>(act), [&](auto a) {
        glu_fwd_impl<scalar_t, decltype(a)::value>(gate, up, out);
      });
    });
  }
  return out;
}

std::vector<at::Tensor> glu_bwd_cpu(const at::Tensor& grad_out_in, const at::Tensor& gate_in,
                                    const at::Tensor& up_in, int64_t act,
                                    std::vector<bool> output_mask) {
  using namespace pointwise_impl;
  const char* op = "glu_bwd";
  check_glu(op, gate_in, up_in, act, at::kCPU);
  check_same_shape(op, "grad_out", grad_out_in, "gate", gate_in);
  check_mask(op, output_mask, "[dgate, dup]");
  const at::Tensor gate = rowable(gate_in), up = rowable(up_in), grad_out = rowable(grad_out_in);
  const at::Tensor empty = at::empty({0}, gate.options());
  at::Tensor dgate = output_mask[0] ? at::empty(gate.sizes(), gate.options()) : at::Tensor();
  at::Tensor dup = output_mask[1] ? at::empty(gate.sizes(), gate.options()) : at::Tensor();
  if (gate.numel() > 0 && (dgate.defined() || dup.defined())) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, gate.scalar_type(), "dmfx_glu_bwd", [&] {
      dispatch_act(static_cast<int>(act), [&](auto a) {
        glu_bwd_impl<scalar_t, decltype(a)::value>(grad_out, gate, up, dgate, dup);
      });
    });
  }
  return {dgate.defined() ? dgate : empty, dup.defined() ? dup : empty};
}

// A 0-dim x is computed as [1]; the output is contiguous whatever x's strides.
at::Tensor softcap_fwd_cpu(const at::Tensor& x_in, double cap) {
  using namespace pointwise_impl;
  check_softcap(x_in, cap, at::kCPU);
  at::Tensor out = at::empty(x_in.sizes(), x_in.options());
  if (x_in.numel() == 0) return out;
  const at::Tensor x = rowable(x_in.dim() == 0 ? x_in.reshape({1}) : x_in);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "dmfx_softcap_fwd", [&] {
    softcap_fwd_impl<scalar_t>(x, cap, out);
  });
  return out;
}

at::Tensor softcap_bwd_cpu(const at::Tensor& grad_out_in, const at::Tensor& out_in, double cap) {
  using namespace pointwise_impl;
  check_softcap_backward(grad_out_in, out_in, cap, at::kCPU);
  at::Tensor dx = at::empty(grad_out_in.sizes(), grad_out_in.options());
  if (grad_out_in.numel() == 0) return dx;
  const bool scalar = grad_out_in.dim() == 0;
  const at::Tensor grad_out = rowable(scalar ? grad_out_in.reshape({1}) : grad_out_in);
  const at::Tensor out = rowable(scalar ? out_in.reshape({1}) : out_in);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad_out.scalar_type(), "dmfx_softcap_bwd", [&] {
    softcap_bwd_impl<scalar_t>(grad_out, out, cap, dx);
  });
  return dx;
}

std::vector<at::Tensor> rope_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                 const at::Tensor& sin, bool inverse, bool interleaved, bool deinterleave) {
  using namespace pointwise_impl;
  const std::vector<RopeSide> sides = check_rope("rope", q, k, cos, sin, interleaved, deinterleave, at::kCPU);
  std::vector<at::Tensor> outs = {at::empty(q.sizes(), q.options()), at::empty(k.sizes(), k.options())};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "dmfx_rope", [&] {
    rope_impl<scalar_t>(sides, outs, inverse, interleaved, deinterleave);
  });
  return outs;
}

}  // namespace dmfx

#else  // DMFX_CPU_GLUE: the glue (in cpu_bindings.cpp's translation unit)
#include <torch/csrc/utils/pybind.h>

#include "cpu_kernels.h"

namespace dmfx {
void bind_pointwise(pybind11::module_& m) {
  m.def("bias_act_fwd", &bias_act_fwd_cpu, "fused bias + activation + dropout forward (CPU)");
  m.def("bias_act_bwd", &bias_act_bwd_cpu,
        "fused bias + activation + dropout backward with the bias gradient (CPU); a stored bool mask "
        "(native_dropout's) replaces the Philox one",
        pybind11::arg("grad_out"), pybind11::arg("x"), pybind11::arg("bias"), pybind11::arg("act"),
        pybind11::arg("seed"), pybind11::arg("offset"), pybind11::arg("p"), pybind11::arg("output_mask"),
        pybind11::arg("mask") = pybind11::none(), pybind11::arg("mask_scale") = 1.0);
  m.def("glu_fwd", &glu_fwd_cpu, "gated activation act(gate) * up (CPU)");
  m.def("glu_bwd", &glu_bwd_cpu, "gated activation backward [dgate, dup] (CPU)");
  m.def("rope", &rope_cpu, "rotary position embedding of q and k (pairs (j, j + D/2), (2j, 2j + 1) interleaved, or "
        "(2j, 2j + 1) in and (j, j + D/2) out with deinterleave); inverse=True is its backward (CPU)",
        pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("cos"), pybind11::arg("sin"), pybind11::arg("inverse"),
        pybind11::arg("interleaved") = false, pybind11::arg("deinterleave") = false);
  m.def("softcap_fwd", &softcap_fwd_cpu, "soft cap cap * tanh(x / cap) (CPU)", pybind11::arg("x"), pybind11::arg("cap"));
  m.def("softcap_bwd", &softcap_bwd_cpu, "soft cap backward grad_out * (1 - (out / cap)^2), from the output (CPU)",
        pybind11::arg("grad_out"), pybind11::arg("out"), pybind11::arg("cap"));
}
}  // namespace dmfx

#ifndef DMFX_KERNELS_ONLY
// ------------------------------------------------------------------------------------------------
// The ops: CPU kernels (through the kernel table: cpu_kernels.h) and the family's autograd formulas
// ------------------------------------------------------------------------------------------------
#include <ATen/ops/cat.h>
#include <ATen/ops/stack.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include "pointwise_ops.h"

namespace dmfx {
namespace pointwise_ops {
namespace {

struct CpuPointwise {
  template <class... A>
  static Tensor bias_act_fwd(A&&... a) { return cpu_kernels().bias_act_fwd(std::forward<A>(a)...); }
  template <class... A>
  static Tensors bias_act_bwd(A&&... a) { return cpu_kernels().bias_act_bwd(std::forward<A>(a)...); }
  template <class... A>
  static Tensor glu_fwd(A&&... a) { return cpu_kernels().glu_fwd(std::forward<A>(a)...); }
  template <class... A>
  static Tensors glu_bwd(A&&... a) { return cpu_kernels().glu_bwd(std::forward<A>(a)...); }
  template <class... A>
  static Tensors rope(A&&... a) { return cpu_kernels().rope(std::forward<A>(a)...); }
  template <class... A>
  static Tensor softcap_fwd(A&&... a) { return cpu_kernels().softcap_fwd(std::forward<A>(a)...); }
  template <class... A>
  static Tensor softcap_bwd(A&&... a) { return cpu_kernels().softcap_bwd(std::forward<A>(a)...); }
};

using BiasActDropoutBackwardSig = decltype(bias_act_dropout_backward<CpuPointwise>);
using GluBackwardSig = decltype(glu_backward<CpuPointwise>);
using SoftcapBackwardSig = decltype(softcap_backward<CpuPointwise>);

// out = dropout(act(x + bias)); the backward is dmfx::bias_act_dropout_backward, which recomputes
// act'(x + bias) and the mask from x and the seed (nothing else is saved).
struct BiasActDropoutFn : public torch::autograd::Function<BiasActDropoutFn> {
  static constexpr const char* name = "dmfx::bias_act_dropout";
  using Sig = decltype(bias_act_dropout<CpuPointwise>);
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Opt& bias, c10::string_view act,
                               const Opt& seed, double p) {
    ctx->saved_data["needs"] = needs_bits(x, bias);
    ctx->saved_data["act"] = std::string(act);
    ctx->saved_data["p"] = p;
    ctx->save_for_backward({x, bias.value_or(Tensor()), seed.value_or(Tensor())});
    return AutogradKernel<BiasActDropoutFn>::below(x, bias, act, seed, p);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    const auto v = ctx->get_saved_variables();
    const bool nx = needs(ctx, 0), nb = needs(ctx, 1);  // (nb: a bias that requires grad)
    variable_list grads(5);
    if (!(nx || nb)) return grads;
    static const auto backward = dmfx_op<BiasActDropoutBackwardSig>("dmfx::bias_act_dropout_backward");
    auto [dx, db] = backward.call(g[0], v[0], opt(v[1]), ctx->saved_data["act"].toStringRef(), opt(v[2]),
                                  ctx->saved_data["p"].toDouble(), bools({nx, nb}), c10::nullopt, 1.0);
    grads[0] = nx ? dx : Tensor();
    grads[1] = nb ? db : Tensor();
    return grads;
  }
};

// out = act(gate) * up; the backward is dmfx::glu_backward.
struct GluFn : public torch::autograd::Function<GluFn> {
  static constexpr const char* name = "dmfx::glu";
  using Sig = decltype(glu<CpuPointwise>);
  static variable_list forward(AutogradContext* ctx, const Tensor& gate, const Tensor& up, c10::string_view act) {
    ctx->saved_data["needs"] = needs_bits(gate, up);
    ctx->saved_data["act"] = std::string(act);
    ctx->save_for_backward({gate, up});
    return AutogradKernel<GluFn>::below(gate, up, act);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    const auto v = ctx->get_saved_variables();
    const bool ng = needs(ctx, 0), nu = needs(ctx, 1);
    variable_list grads(3);
    if (!(ng || nu)) return grads;
    static const auto backward = dmfx_op<GluBackwardSig>("dmfx::glu_backward");
    auto [dgate, dup] = backward.call(g[0], v[0], v[1], ctx->saved_data["act"].toStringRef(), bools({ng, nu}));
    grads[0] = ng ? dgate : Tensor();
    grads[1] = nu ? dup : Tensor();
    return grads;
  }
};

// out = cap * tanh(x / cap); the backward is dmfx::softcap_backward, which reads the OUTPUT: out is the one
// tensor saved (not x: a loss over the capped logits keeps them anyway, so the graph keeps one [tokens,
// vocab] tensor where eager's tanh and mul keep two).
struct SoftcapFn : public torch::autograd::Function<SoftcapFn> {
  static constexpr const char* name = "dmfx::softcap";
  using Sig = decltype(softcap<CpuPointwise>);
  static variable_list forward(AutogradContext* ctx, const Tensor& x, double cap) {
    ctx->saved_data["cap"] = cap;
    variable_list out = AutogradKernel<SoftcapFn>::below(x, cap);
    ctx->save_for_backward({out[0]});  // (an output: autograd keeps it without a reference cycle)
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    const auto v = ctx->get_saved_variables();
    static const auto backward = dmfx_op<SoftcapBackwardSig>("dmfx::softcap_backward");
    return {backward.call(g[0], v[0], ctx->saved_data["cap"].toDouble()), Tensor()};
  }
};

// dx = softcap_backward(grad_out, out, cap) = grad_out * (1 - (out / cap)^2), differentiable again: it is
// linear in grad_out (whose gradient is softcap_backward itself) and its gradient for out is
// -2 grad_out * gg * out / cap^2 (plain ATen), which reaches x through softcap's saved output. grad_out
// is kept only where out requires grad.
struct SoftcapBackwardFn : public torch::autograd::Function<SoftcapBackwardFn> {
  static constexpr const char* name = "dmfx::softcap_backward";
  using Sig = SoftcapBackwardSig;
  static variable_list forward(AutogradContext* ctx, const Tensor& grad_out, const Tensor& out, double cap) {
    ctx->saved_data["needs"] = needs_bits(grad_out, out);
    ctx->saved_data["cap"] = cap;
    ctx->save_for_backward({requires_grad(out) ? grad_out : Tensor(), out});
    return AutogradKernel<SoftcapBackwardFn>::below(grad_out, out, cap);
  }
  static variable_list backward(AutogradContext* ctx, variable_list gg) {
    const auto v = ctx->get_saved_variables();
    const double cap = ctx->saved_data["cap"].toDouble();
    variable_list grads(3);
    if (needs(ctx, 0)) grads[0] = op_of<SoftcapBackwardFn>().call(gg[0], v[1], cap);
    if (needs(ctx, 1)) grads[1] = gg[0].mul(v[0]).mul(v[1]).mul(-2.0 / (cap * cap));
    return grads;
  }
};

// HF's rotate_half, cat(-t[..., D/2:], t[..., :D/2]), or interleaved, GPT-J's rotate_every_two:
// stack(-t[..., 1::2], t[..., ::2], -1).flatten(-2).
Tensor rotate(const Tensor& t, bool interleaved) {
  if (interleaved)
    return at::stack({t.slice_symint(-1, 1, c10::nullopt, 2).neg(), t.slice_symint(-1, 0, c10::nullopt, 2)}, -1)
        .flatten(-2);
  const c10::SymInt h = t.sym_size(-1) / 2;
  return at::cat({t.slice_symint(-1, h).neg(), t.slice_symint(-1, 0, h)}, -1);
}

// DeepSeek's de-interleaved order of the last dim, cat(t[..., 0::2], t[..., 1::2]): the order in which
// dmfx::rope with deinterleave=True rotates its input's pairs (by halves).
Tensor deinterleaved(const Tensor& t) {
  return at::cat({t.slice_symint(-1, 0, c10::nullopt, 2), t.slice_symint(-1, 1, c10::nullopt, 2)}, -1);
}

// (q_out, k_out) = rope(q, k, cos, sin). The map is linear in (q, k): its backward is the transpose
// map, dmfx::rope in the other direction (differentiable again). cos/sin rarely need gradients; only
// then are q and k kept, for the plain-ATen formulas of theirs.
struct RopeFn : public torch::autograd::Function<RopeFn> {
  static constexpr const char* name = "dmfx::rope";
  using Sig = decltype(rope<CpuPointwise>);
  static variable_list forward(AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& cos,
                               const Tensor& sin, bool inverse, bool interleaved, bool deinterleave) {
    ctx->saved_data["needs"] = needs_bits(q, k, cos, sin);
    ctx->saved_data["inverse"] = inverse;
    ctx->saved_data["interleaved"] = interleaved;
    ctx->saved_data["deinterleave"] = deinterleave;
    const bool tables = requires_grad(cos) || requires_grad(sin);
    ctx->save_for_backward({cos, sin, tables ? q : Tensor(), tables ? k : Tensor()});
    return AutogradKernel<RopeFn>::below(q, k, cos, sin, inverse, interleaved, deinterleave);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    // (an output whose gradient autograd did not compute arrives as zeros: materialized grads)
    const auto v = ctx->get_saved_variables();
    const Tensor &cos = v[0], &sin = v[1], &q = v[2], &k = v[3], &gq = g[0], &gk = g[1];
    const bool inverse = ctx->saved_data["inverse"].toBool();
    const bool interleaved = ctx->saved_data["interleaved"].toBool();
    const bool deinterleave = ctx->saved_data["deinterleave"].toBool();
    variable_list grads(7);
    if (needs(ctx, 0) || needs(ctx, 1)) {
      auto [dq, dk] = op_of<RopeFn>().call(gq, gk, cos, sin, !inverse, interleaved, deinterleave);
      grads[0] = needs(ctx, 0) ? dq : Tensor();
      grads[1] = needs(ctx, 1) ? dk : Tensor();
    }
    if (q.defined()) {
      // forward: out = x c + rot(x) s       -> dc = g x, ds = g rot(x)
      // inverse: out = x c - rot(x s)       -> dc = g x, ds = x rot(g)   (rot^T = -rot)
      // deinterleave: the same in the halves' order, x de-interleaved in the forward, g in the inverse
      auto halves = [&](const Tensor& t) { return deinterleave ? deinterleaved(t) : t; };
      auto dc = [&](const Tensor& gx, const Tensor& x) { return inverse ? halves(gx).mul(x) : gx.mul(halves(x)); };
      auto ds = [&](const Tensor& gx, const Tensor& x) {
        return inverse ? x.mul(rotate(halves(gx), interleaved)) : gx.mul(rotate(halves(x), interleaved));
      };
      if (needs(ctx, 2))
        grads[2] = dc(gq, q).sum_to_size_symint(cos.sym_sizes()).add(dc(gk, k).sum_to_size_symint(cos.sym_sizes()));
      if (needs(ctx, 3))
        grads[3] = ds(gq, q).sum_to_size_symint(sin.sym_sizes()).add(ds(gk, k).sum_to_size_symint(sin.sym_sizes()));
    }
    return grads;
  }
};

struct BiasActDropoutBackwardOp {
  static constexpr const char* name = "dmfx::bias_act_dropout_backward";
  static constexpr const char* hint = "dmfx.bias_act_dropout";
  using Sig = BiasActDropoutBackwardSig;
};

struct GluBackwardOp {
  static constexpr const char* name = "dmfx::glu_backward";
  static constexpr const char* hint = "dmfx.glu";
  using Sig = GluBackwardSig;
};

}  // namespace
}  // namespace pointwise_ops
}  // namespace dmfx

TORCH_LIBRARY_IMPL(dmfx, CPU, m) { dmfx::pointwise_ops::register_kernels<dmfx::pointwise_ops::CpuPointwise>(m); }

TORCH_LIBRARY_IMPL(dmfx, Autograd, m) {
  using namespace dmfx;
  using namespace dmfx::pointwise_ops;
  m.impl("bias_act_dropout", &AutogradKernel<BiasActDropoutFn>::call);
  m.impl("glu", &AutogradKernel<GluFn>::call);
  m.impl("rope", &AutogradKernel<RopeFn>::call);
  m.impl("softcap", &AutogradKernel<SoftcapFn>::call);
  m.impl("softcap_backward", &AutogradKernel<SoftcapBackwardFn>::call);
  m.impl("bias_act_dropout_backward", &AutogradKernel<NoDoubleBackward<BiasActDropoutBackwardOp>>::call);
  m.impl("glu_backward", &AutogradKernel<NoDoubleBackward<GluBackwardOp>>::call);
}
#endif  // DMFX_KERNELS_ONLY
#endif  // DMFX_CPU_GLUE

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
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/OpMathType.h>
#include <ATen/Dispatch.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "dmfx_common.h"
#include "kernel_api.h"
#include "softmax_api.h"

namespace dmfx {
namespace softmax_impl {

constexpr int kLanes = 16;  // one AVX-512 register of floats (two AVX2 registers)

struct NoMask {};

// ------------------------------------------------------------------------------------------------
// Element math
// ------------------------------------------------------------------------------------------------

inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

inline float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// exp(x) for x <= 0 (a max-subtracted logit), -inf (-> 0) or NaN (-> NaN). Cephes expf: x = n ln2 + r
// with |r| <= ln2 / 2, exp(r) by a degree-6 polynomial, 2^n by building the exponent bits.
// Branch-free, so a loop over it vectorizes. Values below -87 (exp < 1.7e-38) flush to 0.
inline float exp_nonpos(float x) {
  const float xc = x < -87.0f ? -87.0f : x;  // NaN stays NaN (the comparison is false)
  const float magic = 12582912.0f;           // 1.5 * 2^23: adding it rounds to an integer
  const float t = xc * 1.44269504088896341f + magic;
  const float n = t - magic;                            // round(x / ln2), in [-126, 0]
  float r = xc - n * 0.693359375f;                      // ln2 split in two for precision
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  // n is in the low mantissa bits of t (two's complement within the 22-bit field).
  // Unsigned arithmetic: wraps for negative n, and garbage (never UB) for NaN, where p is NaN anyway.
  const uint32_t biased = bits_of(t) - bits_of(magic) + 127u;
  const float pow2n = float_of(biased << 23);
  const float y = p * pow2n;
  return x < -87.0f ? 0.0f : y;
}

inline double exp_nonpos(double x) { return std::exp(x); }

// max that propagates NaN from either side (fmax would drop it; eager's softmax keeps it).
template <typename T>
inline T nan_max(T a, T b) {
  return (a != a || a > b) ? a : b;
}

template <typename acc_t, typename scalar_t>
inline acc_t to_acc(scalar_t v) {
  return static_cast<acc_t>(v);
}

// Mask contribution of one element (0 or -inf for a bool mask).
template <typename acc_t, typename mask_t>
inline acc_t mask_value(const mask_t* m, int64_t j) {
  if constexpr (std::is_same<mask_t, bool>::value) {
    return m[j] ? acc_t(0) : -std::numeric_limits<acc_t>::infinity();
  } else {
    return static_cast<acc_t>(m[j]);
  }
}

// ------------------------------------------------------------------------------------------------
// Philox on kLanes groups at once (structure of arrays; same mapping as dmfx_common.h)
// ------------------------------------------------------------------------------------------------

constexpr int kPhiloxBlock = 32;  // groups per iteration of philox_words (both versions)

#if defined(__AVX512F__)
// lo, hi = a * m (32 x 32 -> 64 bits) in each of 16 32-bit lanes.
inline void mulhilo16(__m512i a, __m512i m, __m512i* lo, __m512i* hi) {
  const __m512i pe = _mm512_mul_epu32(a, m);                         // even lanes' products
  const __m512i po = _mm512_mul_epu32(_mm512_srli_epi64(a, 32), m);  // odd lanes' products
  *lo = _mm512_mask_blend_epi32(0xAAAA, pe, _mm512_slli_epi64(po, 32));
  *hi = _mm512_mask_blend_epi32(0xAAAA, _mm512_srli_epi64(pe, 32), po);
}

// words[4 * i + k] = word k of philox4x32_10(g0 + i, offset, seed) for i < ngroups. `words` must hold
// 4 * round_up(ngroups, kPhiloxBlock) entries. AVX-512: two independent 16-lane blocks per iteration
// (hides the multiply latency); the result is interleaved back to [group][word] with two permutes.
inline void philox_words(uint64_t g0, int64_t ngroups, uint64_t offset, uint64_t seed,
                         uint32_t* words) {
  constexpr int B = kPhiloxBlock / 16;
  const __m512i M0 = _mm512_set1_epi32(static_cast<int>(0xD2511F53u));
  const __m512i M1 = _mm512_set1_epi32(static_cast<int>(0xCD9E8D57u));
  const __m512i O0 = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(offset)));
  const __m512i O1 = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(offset >> 32)));
  // u = (c0[i], c1[i]) pairs of lanes 0..7 (iu0) or 8..15 (iu1); out = (u[2i], u[2i+1], v[2i], v[2i+1]).
  const __m512i iu0 = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i iu1 = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  const __m512i io0 = _mm512_setr_epi32(0, 1, 16, 17, 2, 3, 18, 19, 4, 5, 20, 21, 6, 7, 22, 23);
  const __m512i io1 = _mm512_setr_epi32(8, 9, 24, 25, 10, 11, 26, 27, 12, 13, 28, 29, 14, 15, 30, 31);
  for (int64_t base = 0; base < ngroups; base += kPhiloxBlock) {
    alignas(64) uint32_t lo[kPhiloxBlock], hi[kPhiloxBlock];
    for (int l = 0; l < kPhiloxBlock; ++l) {
      const uint64_t g = g0 + static_cast<uint64_t>(base + l);
      lo[l] = static_cast<uint32_t>(g);
      hi[l] = static_cast<uint32_t>(g >> 32);
    }
    __m512i c0[B], c1[B], c2[B], c3[B];
    for (int b = 0; b < B; ++b) {
      c0[b] = _mm512_load_si512(lo + 16 * b);
      c1[b] = _mm512_load_si512(hi + 16 * b);
      c2[b] = O0;
      c3[b] = O1;
    }
    uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
    for (int round = 0; round < 10; ++round) {
      const __m512i K0 = _mm512_set1_epi32(static_cast<int>(k0));
      const __m512i K1 = _mm512_set1_epi32(static_cast<int>(k1));
      for (int b = 0; b < B; ++b) {
        __m512i lo0, hi0, lo1, hi1;
        mulhilo16(c0[b], M0, &lo0, &hi0);
        mulhilo16(c2[b], M1, &lo1, &hi1);
        c0[b] = _mm512_xor_si512(_mm512_xor_si512(hi1, c1[b]), K0);
        c2[b] = _mm512_xor_si512(_mm512_xor_si512(hi0, c3[b]), K1);
        c1[b] = lo1;
        c3[b] = lo0;
      }
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    for (int b = 0; b < B; ++b) {
      const __m512i u0 = _mm512_permutex2var_epi32(c0[b], iu0, c1[b]);
      const __m512i u1 = _mm512_permutex2var_epi32(c0[b], iu1, c1[b]);
      const __m512i v0 = _mm512_permutex2var_epi32(c2[b], iu0, c3[b]);
      const __m512i v1 = _mm512_permutex2var_epi32(c2[b], iu1, c3[b]);
      uint32_t* w = words + 4 * (base + 16 * b);
      _mm512_storeu_si512(w + 0, _mm512_permutex2var_epi32(u0, io0, v0));
      _mm512_storeu_si512(w + 16, _mm512_permutex2var_epi32(u0, io1, v0));
      _mm512_storeu_si512(w + 32, _mm512_permutex2var_epi32(u1, io0, v1));
      _mm512_storeu_si512(w + 48, _mm512_permutex2var_epi32(u1, io1, v1));
    }
  }
}
#else
// Portable version (structure of arrays over kLanes groups, vectorized by the compiler); same output.
inline void philox_words(uint64_t g0, int64_t ngroups, uint64_t offset, uint64_t seed,
                         uint32_t* words) {
  const uint32_t o0 = static_cast<uint32_t>(offset), o1 = static_cast<uint32_t>(offset >> 32);
  for (int64_t base = 0; base < ngroups; base += kLanes) {
    uint32_t c0[kLanes], c1[kLanes], c2[kLanes], c3[kLanes];
    for (int l = 0; l < kLanes; ++l) {
      const uint64_t g = g0 + static_cast<uint64_t>(base + l);
      c0[l] = static_cast<uint32_t>(g);
      c1[l] = static_cast<uint32_t>(g >> 32);
      c2[l] = o0;
      c3[l] = o1;
    }
    uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
    for (int round = 0; round < 10; ++round) {
      for (int l = 0; l < kLanes; ++l) {
        const uint64_t p0 = static_cast<uint64_t>(0xD2511F53u) * c0[l];
        const uint64_t p1 = static_cast<uint64_t>(0xCD9E8D57u) * c2[l];
        const uint32_t n0 = static_cast<uint32_t>(p1 >> 32) ^ c1[l] ^ k0;
        const uint32_t n2 = static_cast<uint32_t>(p0 >> 32) ^ c3[l] ^ k1;
        c1[l] = static_cast<uint32_t>(p1);
        c3[l] = static_cast<uint32_t>(p0);
        c0[l] = n0;
        c2[l] = n2;
      }
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    uint32_t* w = words + 4 * base;
    for (int l = 0; l < kLanes; ++l) {
      w[4 * l + 0] = c0[l];
      w[4 * l + 1] = c1[l];
      w[4 * l + 2] = c2[l];
      w[4 * l + 3] = c3[l];
    }
  }
}
#endif

// Per-thread scratch of one row.
template <typename acc_t>
struct RowScratch {
  std::vector<acc_t> z;          // logits, then exp(z - max); backward: dropped-out grad
  std::vector<uint32_t> words;   // Philox words of the row's groups
  std::vector<acc_t> mult;       // dropout multipliers (0 or 1 / (1 - p))
  explicit RowScratch(int64_t Sk, bool dropout) : z(Sk) {
    if (dropout) {
      const int64_t groups = (Sk + 3) / 4 + 1;  // the row may start mid-group
      words.resize(4 * ((groups + kPhiloxBlock - 1) / kPhiloxBlock) * kPhiloxBlock);
      mult.resize(Sk);
    }
  }
};

// mult[j] = dropout multiplier of the element with logical index first + j, j < n.
template <typename acc_t>
inline void fill_mult(const DropoutParams& d, double keep_scale_d, uint64_t first, int64_t n,
                      RowScratch<acc_t>& s) {
  acc_t* mult = s.mult.data();
  if (d.drop_all) {
    for (int64_t j = 0; j < n; ++j) mult[j] = acc_t(0);
    return;
  }
  const uint64_t g0 = first >> 2;
  const int64_t ngroups = static_cast<int64_t>(((first + n + 3) >> 2) - g0);
  philox_words(g0, ngroups, d.offset, d.seed, s.words.data());
  const uint32_t* w = s.words.data() + (first & 3);
  const uint32_t thr = d.threshold;
  const acc_t keep_scale = static_cast<acc_t>(keep_scale_d);
  for (int64_t j = 0; j < n; ++j) mult[j] = w[j] >= thr ? keep_scale : acc_t(0);
}

// ------------------------------------------------------------------------------------------------
// Forward
// ------------------------------------------------------------------------------------------------

// z[j] = s[j] * scale + rowadd + mask[j] for j < n; returns the (NaN-propagating) max.
template <typename acc_t, typename scalar_t, typename mask_t>
inline acc_t load_logits(const scalar_t* s, const mask_t* m, int64_t n, acc_t scale, acc_t rowadd,
                         acc_t* z) {
  constexpr bool kHasMask = !std::is_same<mask_t, NoMask>::value;
  acc_t pm[kLanes];
  for (int l = 0; l < kLanes; ++l) pm[l] = -std::numeric_limits<acc_t>::infinity();
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      acc_t v = to_acc<acc_t>(s[j + l]) * scale + rowadd;
      if constexpr (kHasMask) v += mask_value<acc_t>(m, j + l);
      z[j + l] = v;
      pm[l] = nan_max(pm[l], v);
    }
  }
  for (; j < n; ++j) {
    acc_t v = to_acc<acc_t>(s[j]) * scale + rowadd;
    if constexpr (kHasMask) v += mask_value<acc_t>(m, j);
    z[j] = v;
    pm[0] = nan_max(pm[0], v);
  }
  acc_t mx = pm[0];
  for (int l = 1; l < kLanes; ++l) mx = nan_max(mx, pm[l]);
  return mx;
}

// z[j] = exp(z[j] - mx) for j < n; returns the sum.
template <typename acc_t>
inline acc_t exp_sum(acc_t* z, int64_t n, acc_t mx) {
  acc_t ps[kLanes];
  for (int l = 0; l < kLanes; ++l) ps[l] = acc_t(0);
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      const acc_t e = exp_nonpos(z[j + l] - mx);
      z[j + l] = e;
      ps[l] += e;
    }
  }
  for (; j < n; ++j) {
    const acc_t e = exp_nonpos(z[j] - mx);
    z[j] = e;
    ps[0] += e;
  }
  acc_t sum = 0;
  for (int l = 0; l < kLanes; ++l) sum += ps[l];
  return sum;
}

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
                      const scalar_t* pr, const RowIndexer& pi, scalar_t* gz) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t Sk = a.Sk;
  const acc_t scale = static_cast<acc_t>(a.scale);
  const DropoutParams d = a.dropout;
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(Sk, 1));
  at::parallel_for(0, a.rows, grain, [&](int64_t begin, int64_t end) {
    RowScratch<acc_t> s(Sk, d.active);
    acc_t* g = s.z.data();
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* grow = go + gi.offset(r);
      const scalar_t* prow = pr + pi.offset(r);
      scalar_t* orow = gz + r * Sk;
      acc_t ps[kLanes];
      for (int l = 0; l < kLanes; ++l) ps[l] = acc_t(0);
      if (d.active) fill_mult(d, a.keep_scale, static_cast<uint64_t>(r) * static_cast<uint64_t>(Sk), Sk, s);
      const acc_t* mult = s.mult.data();
      int64_t j = 0;
      for (; j + kLanes <= Sk; j += kLanes) {
        for (int l = 0; l < kLanes; ++l) {
          acc_t gj = to_acc<acc_t>(grow[j + l]);
          if (d.active) gj *= mult[j + l];
          g[j + l] = gj;
          ps[l] += gj * to_acc<acc_t>(prow[j + l]);
        }
      }
      for (; j < Sk; ++j) {
        acc_t gj = to_acc<acc_t>(grow[j]);
        if (d.active) gj *= mult[j];
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
                           int64_t offset, double p, double scale) {
  using namespace softmax_impl;
  const SoftmaxArgs a =
      check_bwd_args("softmax_bwd", grad_out_in, probs_in, seed, offset, p, scale, at::kCPU);
  at::Tensor grad = at::empty(probs_in.sizes(), probs_in.options());
  if (a.rows == 0) return grad;
  const at::Tensor grad_out = rowable(grad_out_in), probs = rowable(probs_in);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, probs.scalar_type(), "dmfx_softmax_bwd", [&] {
    softmax_bwd_rows<scalar_t>(a, grad_out.data_ptr<scalar_t>(), RowIndexer::of(grad_out),
                               probs.data_ptr<scalar_t>(), RowIndexer::of(probs),
                               grad.data_ptr<scalar_t>());
  });
  return grad;
}

void bind_softmax(pybind11::module_& m) {
  m.def("softmax_fwd", &softmax_fwd_cpu,
        "fused scale + mask + causal + softmax + dropout forward (CPU); returns [out, probs]",
        pybind11::arg("scores"), pybind11::arg("mask"), pybind11::arg("scale"),
        pybind11::arg("causal"), pybind11::arg("seed"), pybind11::arg("offset"), pybind11::arg("p"));
  m.def("softmax_bwd", &softmax_bwd_cpu, "fused dropout + softmax backward, times scale (CPU)",
        pybind11::arg("grad_out"), pybind11::arg("probs"), pybind11::arg("seed"),
        pybind11::arg("offset"), pybind11::arg("p"), pybind11::arg("scale"));
}

}  // namespace dmfx

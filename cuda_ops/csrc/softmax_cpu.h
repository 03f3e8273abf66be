// The row math of dmfx's CPU attention softmax (the paper's SM/BS), shared by the softmax kernels
// (softmax_cpu.cpp) and the fused attention kernels (attention_cpu.cpp), which run the same logits,
// exp and Philox mask on their blocks of scores so both give bit for bit the same probabilities.
// The inner loops are written over fixed-width lane arrays (kLanes) so that gcc -O3 -march=native
// vectorizes them without -ffast-math (see softmax_cpu.cpp).
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/OpMathType.h>
#include <ATen/Dispatch.h>
#include <ATen/cpu/vec/vec.h>

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
#include "philox_cpu.h"

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
// a * b + c rounded once where the target has FMA (every x86-64-v3 CPU), else twice. Written out:
// the build turns off the compiler's own contraction (build.py, -ffp-contract=off), which fused
// some copies of a loop and not others.
inline float madd(float a, float b, float c) {
#if defined(__FMA__)
  return __builtin_fmaf(a, b, c);
#else
  return a * b + c;
#endif
}

inline float exp_nonpos(float x) {
  const float xc = x < -87.0f ? -87.0f : x;  // NaN stays NaN (the comparison is false)
  const float magic = 12582912.0f;           // 1.5 * 2^23: adding it rounds to an integer
  const float t = madd(xc, 1.44269504088896341f, magic);
  const float n = t - magic;                            // round(x / ln2), in [-126, 0]
  float r = madd(-n, 0.693359375f, xc);                 // ln2 split in two for precision
  r = madd(-n, -2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = madd(p, r, 1.3981999507e-3f);
  p = madd(p, r, 8.3334519073e-3f);
  p = madd(p, r, 4.1665795894e-2f);
  p = madd(p, r, 1.6666665459e-1f);
  p = madd(p, r, 5.0000001201e-1f);
  p = madd(p * r, r, r) + 1.0f;
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

// Philox on many groups at once: csrc/philox_cpu.h (shared with the norm and pointwise kernels).
using philox_cpu::kPhiloxBlock;
using philox_cpu::philox_words;

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

// z[j] = s[j] * scale + rowadd + mask[j] for j < n.
template <typename acc_t, typename scalar_t, typename mask_t>
inline void load_row(const scalar_t* s, const mask_t* m, int64_t n, acc_t scale, acc_t rowadd, acc_t* z) {
  constexpr bool kHasMask = !std::is_same<mask_t, NoMask>::value;
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      acc_t v = to_acc<acc_t>(s[j + l]) * scale + rowadd;
      if constexpr (kHasMask) v += mask_value<acc_t>(m, j + l);
      z[j + l] = v;
    }
  }
  for (; j < n; ++j) {
    acc_t v = to_acc<acc_t>(s[j]) * scale + rowadd;
    if constexpr (kHasMask) v += mask_value<acc_t>(m, j);
    z[j] = v;
  }
}

// The (NaN-propagating) max of z[0..n), -inf for n = 0. A pass of its own over the row just loaded
// (L1/L2-resident), in ATen's vector type: gcc does not vectorize nan_max's select inside
// load_row's loop (it ran scalar, with a branch per element: 3x the time of the load itself on a
// [1024, 32000] cross-entropy). at::vec::maximum propagates NaN as nan_max does; a max is exact,
// so the order of the comparisons changes nothing but which NaN (or which zero's sign) comes out.
template <typename acc_t>
inline acc_t row_max(const acc_t* z, int64_t n) {
  acc_t mx = -std::numeric_limits<acc_t>::infinity();
  int64_t j = 0;
  if constexpr (std::is_same<acc_t, float>::value) {
    using Vec = at::vec::Vectorized<float>;
    constexpr int64_t kW = Vec::size();
    if (n >= kW) {
      Vec vm = Vec::loadu(z);
      for (j = kW; j + kW <= n; j += kW) vm = at::vec::maximum(vm, Vec::loadu(z + j));
      float lanes[kW];
      vm.store(lanes);
      for (int64_t l = 0; l < kW; ++l) mx = nan_max(mx, lanes[l]);
    }
  }
  for (; j < n; ++j) mx = nan_max(mx, z[j]);
  return mx;
}

// load_row, then its max.
template <typename acc_t, typename scalar_t, typename mask_t>
inline acc_t load_logits(const scalar_t* s, const mask_t* m, int64_t n, acc_t scale, acc_t rowadd, acc_t* z) {
  load_row<acc_t>(s, m, n, scale, rowadd, z);
  return row_max(z, n);
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

}  // namespace softmax_impl
}  // namespace dmfx

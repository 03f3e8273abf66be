// Philox4x32-10 words for many counter groups at once on the CPU (the mapping of dmfx_common.h:
// word k of philox(counter = {group, offset}, key = seed)). AVX-512 where the compiler targets it
// (two 16-lane blocks per iteration to hide the multiply latency), else a structure-of-arrays loop the
// compiler vectorizes; both give the same words as the scalar philox4x32_10. Shared by the CPU
// kernels of every family (norm, softmax, pointwise): one scalar Philox call per 4 elements made
// dropout the most expensive part of the fused norm kernels.
#pragma once
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace dmfx {
namespace philox_cpu {

constexpr int kLanes = 16;  // groups per portable block
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

// words[4 * i + k] for the groups covering elements [first, first + n): element first + j reads
// words[(first & 3) + j]. The buffer is per thread and grows as needed.
inline const uint32_t* words_for(uint64_t first, int64_t n, uint64_t offset, uint64_t seed) {
  thread_local std::vector<uint32_t> buf;
  const uint64_t g0 = first >> 2;
  const int64_t ngroups = static_cast<int64_t>(((first + static_cast<uint64_t>(n) + 3) >> 2) - g0);
  const int64_t cap = 4 * ((ngroups + kPhiloxBlock - 1) / kPhiloxBlock * kPhiloxBlock);
  if (static_cast<int64_t>(buf.size()) < cap) buf.resize(static_cast<size_t>(cap));
  philox_words(g0, ngroups, offset, seed, buf.data());
  return buf.data() + (first & 3);
}

}  // namespace philox_cpu
}  // namespace dmfx

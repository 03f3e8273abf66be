// Per-element math shared by the CPU (C++) and CUDA kernels of dmfx.
//
// Dropout uses Philox4x32-10 (Salmon et al., SC'11), a counter-based generator: the random word
// for element `i` of a tensor depends only on (seed, offset, i), so the forward kernel and the
// backward kernel regenerate the same keep-mask without storing it, and the CPU and CUDA kernels
// produce identical masks. Element i uses word (i % 4) of philox(counter = {i/4, offset}, key = seed).
// An element is kept when its 32-bit word is >= threshold(p) = floor(p * 2^32); kept elements are
// scaled by 1/(1-p) (inverted dropout). p = 0 keeps everything with scale 1 (exact identity).
#pragma once
#include <cstdint>
#include <cmath>

#if defined(__CUDACC__)
#define DMFX_HD __host__ __device__ __forceinline__
#else
#define DMFX_HD inline
#endif

namespace dmfx {

struct Philox4 {
  uint32_t x, y, z, w;
};

DMFX_HD uint32_t mulhilo32(uint32_t a, uint32_t b, uint32_t* hi) {
  const uint64_t prod = static_cast<uint64_t>(a) * static_cast<uint64_t>(b);
  *hi = static_cast<uint32_t>(prod >> 32);
  return static_cast<uint32_t>(prod);
}

// Philox4x32 with 10 rounds. `group` is the 64-bit counter of a group of 4 elements.
DMFX_HD Philox4 philox4x32_10(uint64_t group, uint64_t offset, uint64_t seed) {
  uint32_t c0 = static_cast<uint32_t>(group), c1 = static_cast<uint32_t>(group >> 32);
  uint32_t c2 = static_cast<uint32_t>(offset), c3 = static_cast<uint32_t>(offset >> 32);
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, hi1;
    const uint32_t lo0 = mulhilo32(0xD2511F53u, c0, &hi0);
    const uint32_t lo1 = mulhilo32(0xCD9E8D57u, c2, &hi1);
    const uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
    c0 = n0; c1 = lo1; c2 = n2; c3 = lo0;
    k0 += 0x9E3779B9u; k1 += 0xBB67AE85u;
  }
  return Philox4{c0, c1, c2, c3};
}

DMFX_HD uint32_t philox_word(const Philox4& r, int lane) {
  return lane == 0 ? r.x : lane == 1 ? r.y : lane == 2 ? r.z : r.w;
}

// Dropout parameters resolved once per launch.
struct DropoutParams {
  uint64_t seed = 0, offset = 0;
  uint32_t threshold = 0;  // keep iff word >= threshold
  bool drop_all = false;   // p >= 1
  bool active = false;     // p > 0
  double scale = 1.0;      // the kept elements' factor: 1 / (1 - p); 1 when p = 0; 0 when p >= 1
};

inline DropoutParams make_dropout_params(double p, int64_t seed, int64_t offset) {
  DropoutParams d;
  d.seed = static_cast<uint64_t>(seed);
  d.offset = static_cast<uint64_t>(offset);
  d.active = p > 0.0;
  d.drop_all = p >= 1.0;
  if (d.active && !d.drop_all) {
    const double t = std::floor(p * 4294967296.0);
    d.threshold = t >= 4294967295.0 ? 0xFFFFFFFFu : static_cast<uint32_t>(t);
    d.scale = 1.0 / (1.0 - p);
  } else if (d.drop_all) {
    d.scale = 0.0;
  }
  return d;
}

}  // namespace dmfx

// A CPU emulation of the CUDA execution model, enough to run dmfx's CUDA flash attention kernels
// (cuda_ops/csrc/attention_cuda.cu) verbatim in CI, where there is no GPU: one block at a time, its
// threads as cooperative fibers (ucontext). __syncthreads and each half of a warp shuffle are yield
// points; a round runs every fiber to its next yield point, and every fiber of a round must have
// stopped at the same kind of barrier (else the kernel's barriers diverge: an error). What it cannot
// show: timing-dependent races within a phase, real launch limits, speed. See tests/cuda_emu/__init__.py.
#pragma once
#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__

struct EmuDim3 {
  unsigned x = 0, y = 0, z = 0;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
inline float4 make_float4(float a, float b, float c, float d) { return float4{a, b, c, d}; }

namespace emu {
constexpr int kMaxThreads = 1024;
struct Fiber {
  ucontext_t ctx;
  std::vector<char> stack;
  bool done = false;
  int kind = 0;  // barrier kind of the last yield: 1 syncthreads, 2/3 shuffle write/read
};
inline Fiber fibers[kMaxThreads];
inline ucontext_t sched;
inline int current = -1, nthreads = 0;
inline double shfl_buf[kMaxThreads];
inline std::function<void()> body;
inline int order_mode = 0;  // 0 forward, 1 reverse, 2 shuffled per round
inline std::mt19937 rng(123);
inline long rounds = 0;

inline void yield(int kind) {
  fibers[current].kind = kind;
  swapcontext(&fibers[current].ctx, &sched);
}

inline void entry(int t) {
  current = t;
  body();
  fibers[t].done = true;
}

inline void run_block(int n, std::function<void()> f) {
  body = std::move(f);
  nthreads = n;
  for (int t = 0; t < n; ++t) {
    Fiber& fb = fibers[t];
    fb.done = false;
    fb.kind = 0;
    fb.stack.resize(256 * 1024);
    getcontext(&fb.ctx);
    fb.ctx.uc_stack.ss_sp = fb.stack.data();
    fb.ctx.uc_stack.ss_size = fb.stack.size();
    fb.ctx.uc_link = &sched;
    makecontext(&fb.ctx, reinterpret_cast<void (*)()>(&entry), 1, t);
  }
  std::vector<int> order(n);
  for (int t = 0; t < n; ++t) order[t] = t;
  while (true) {
    if (order_mode == 1) std::reverse(order.begin(), order.end());
    if (order_mode == 2) std::shuffle(order.begin(), order.end(), rng);
    for (int t : order) {
      if (fibers[t].done) continue;
      current = t;
      swapcontext(&sched, &fibers[t].ctx);
    }
    ++rounds;
    int ndone = 0;
    for (int t = 0; t < n; ++t) ndone += fibers[t].done;
    if (ndone == n) return;
    if (ndone != 0) throw std::runtime_error("emu: some threads exited while others wait at a barrier");
    for (int t = 1; t < n; ++t)
      if (fibers[t].kind != fibers[0].kind)
        throw std::runtime_error("emu: threads wait at different barriers (divergent __syncthreads / shuffle)");
  }
}
}  // namespace emu

inline EmuDim3 blockIdx, gridDim, blockDim;
inline EmuDim3 emu_thread_idx() {
  EmuDim3 d;
  d.x = static_cast<unsigned>(emu::current);
  return d;
}
#define threadIdx (emu_thread_idx())

inline void __syncthreads() { emu::yield(1); }

template <typename T>
inline T __shfl_xor_sync(unsigned, T v, int m) {
  const int t = emu::current;
  emu::shfl_buf[t] = static_cast<double>(v);
  emu::yield(2);
  const int src = (t & ~31) | ((t & 31) ^ m);
  const T r = static_cast<T>(emu::shfl_buf[src]);
  emu::yield(3);
  return r;
}

// Shared memory: dmfx_attn_smem is redeclared `extern` inside the kernels (namespace
// dmfx::attention_impl). Before each block it is filled with NaN (reads of unwritten shared memory
// propagate), and the floats past the kernel's allotment hold a canary that must survive.
namespace dmfx {
namespace attention_impl {
alignas(16) float4 dmfx_attn_smem[1 << 16];
}
}  // namespace dmfx

namespace emu {
inline int grid_cap = 3;  // fewer blocks than items: the kernels' grid-stride loops run too
constexpr uint32_t kCanary = 0x7fc0dead;

template <typename Kernel, typename Arg>
void launch(Kernel kernel, int64_t items, size_t floats, const Arg& P) {
  float* smem = reinterpret_cast<float*>(dmfx::attention_impl::dmfx_attn_smem);
  const size_t total = sizeof(dmfx::attention_impl::dmfx_attn_smem) / sizeof(float);
  if (floats + 4096 > total) throw std::runtime_error("emu: shared memory too large");
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(items, grid_cap));
  gridDim.x = grid;
  blockDim.x = 256;
  for (unsigned b = 0; b < grid; ++b) {
    blockIdx.x = b;
    std::fill(smem, smem + floats, std::nanf(""));
    for (size_t i = floats; i < floats + 4096; ++i) std::memcpy(smem + i, &kCanary, 4);
    run_block(256, [&] { kernel(P); });
    for (size_t i = floats; i < floats + 4096; ++i) {
      uint32_t w;
      std::memcpy(&w, smem + i, 4);
      if (w != kCanary) throw std::runtime_error("emu: shared memory written past the kernel's allotment at float " + std::to_string(i) + " (allotted " + std::to_string(floats) + ")");
    }
  }
}
}  // namespace emu

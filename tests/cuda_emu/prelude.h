// A CPU emulation of the CUDA execution model, enough to run dmfx's CUDA kernels (cuda_ops/csrc/
// *_cuda.cu: norm, softmax, pointwise, attention) verbatim in CI, where there is no GPU: one block at
// a time, its threads as cooperative fibers (ucontext). __syncthreads and each half of a warp shuffle
// are yield points. A round runs every runnable fiber to its next yield point; then a warp whose 32
// lanes all wait at the same shuffle phase is released, and the block's threads are released from
// __syncthreads once every thread of the block waits there. Anything else that cannot progress is an
// error: a shuffle some lanes of a warp do not reach (divergent full-mask shuffle), a __syncthreads
// some threads never reach (exited or waiting elsewhere). The order threads run in within a round is
// a setting (emu::order_mode): forward, reversed, shuffled, or warp-serial (each warp runs through its
// shuffles to its next __syncthreads before the next warp starts). What it cannot show: timing-dependent races
// within a phase, real launch limits beyond those checked below, speed. See tests/cuda_emu/__init__.py.
#pragma once
#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <optional>
#include <map>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
// `__launch_bounds__(max_threads[, min_blocks])` on a kernel becomes a check at the start of its body
// (by __init__.py): a launch with more threads per block would fail on a GPU.
#define __launch_bounds__(...)
// Block-scope `__shared__ T name[N];` declarations are rewritten by __init__.py into function-static
// storage registered with emu::static_shared (NaN fill per block, canary after it). What is left are
// the `extern __shared__` declarations of dynamic shared memory, defined below.
#define __shared__
#define __align__(n) __attribute__((aligned(n)))

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
using EmuDim3 = dim3;
struct alignas(16) float4 {
  float x, y, z, w;
};
inline float4 make_float4(float a, float b, float c, float d) { return float4{a, b, c, d}; }

// Device math the host lacks.
inline float rsqrtf(float v) { return 1.0f / std::sqrt(v); }
inline double rsqrt(double v) { return 1.0 / std::sqrt(v); }
inline float __expf(float v) { return std::exp(v); }
inline float __logf(float v) { return std::log(v); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __frcp_rn(float v) { return 1.0f / v; }
inline float __saturatef(float v) { return v < 0.f ? 0.f : (v > 1.f ? 1.f : v); }

namespace emu {
constexpr int kMaxThreads = 1024;
// Fiber states: kRun runnable, kSync at __syncthreads, kShflW / kShflR at the write / read phase
// of a warp shuffle, kDone exited.
enum : int { kRun = 0, kSync = 1, kShflW = 2, kShflR = 3, kDone = 4 };
struct Fiber {
  ucontext_t ctx;
  std::vector<char> stack;
  bool done = false;
  int kind = 0;
};
inline Fiber fibers[kMaxThreads];
inline ucontext_t sched;
inline int current = -1, nthreads = 0;
inline double shfl_buf[kMaxThreads];
inline std::function<void()> body;
// 0 forward, 1 reverse, 2 shuffled per round; warp-serial (see run_block): 3 last warp first, 4 first
// warp first, 5 warps shuffled
inline int order_mode = 0;
inline std::mt19937 rng(123);
inline long rounds = 0;
inline long blocks_run = 0;

inline void yield(int kind) {
  fibers[current].kind = kind;
  swapcontext(&fibers[current].ctx, &sched);
}

inline void entry(int t) {
  current = t;
  body();
  fibers[t].done = true;
  fibers[t].kind = kDone;
}

inline void run_block(int n, std::function<void()> f) {
  body = std::move(f);
  nthreads = n;
  for (int t = 0; t < n; ++t) {
    Fiber& fb = fibers[t];
    fb.done = false;
    fb.kind = kRun;
    fb.stack.resize(256 * 1024);
    getcontext(&fb.ctx);
    fb.ctx.uc_stack.ss_sp = fb.stack.data();
    fb.ctx.uc_stack.ss_size = fb.stack.size();
    fb.ctx.uc_link = &sched;
    makecontext(&fb.ctx, reinterpret_cast<void (*)()>(&entry), 1, t);
  }
  std::vector<int> order(n);
  for (int t = 0; t < n; ++t) order[t] = t;
  // Releases warp [w0, w0 + 32) when all its lanes wait at the same shuffle phase; false when none
  // waits at a shuffle; an error when only some do.
  auto release_warp = [&](int w0) {
    const int w1 = std::min(n, w0 + 32);
    const int k = fibers[w0].kind;
    bool any_shfl = false, same = true;
    for (int t = w0; t < w1; ++t) {
      any_shfl |= fibers[t].kind == kShflW || fibers[t].kind == kShflR;
      same &= fibers[t].kind == k;
    }
    if (!any_shfl) return false;
    if (!same || w1 - w0 != 32)
      throw std::runtime_error("emu: a full-mask warp shuffle not reached by all 32 lanes of warp " +
                               std::to_string(w0 / 32) + " (divergent shuffle, or a partial warp)");
    for (int t = w0; t < w1; ++t) fibers[t].kind = kRun;
    return true;
  };
  auto run_lanes = [&](int a, int b) {
    for (int t = a; t < b; ++t) {
      if (fibers[t].kind != kRun) continue;
      current = t;
      swapcontext(&sched, &fibers[t].ctx);
    }
  };
  std::vector<int> warps;
  for (int w0 = 0; w0 < n; w0 += 32) warps.push_back(w0);
  while (true) {
    bool progress = false;
    if (order_mode >= 3) {
      // Warp-serial: each warp in turn runs (through its shuffles) to its next __syncthreads or its
      // end before the next warp starts: warps drift apart as far as the block barriers allow, which
      // exposes shared memory reused across phases without a __syncthreads in between.
      if (order_mode == 3) std::reverse(warps.begin(), warps.end());
      if (order_mode == 5) std::shuffle(warps.begin(), warps.end(), rng);
      for (int w0 : warps) {
        do run_lanes(w0, std::min(n, w0 + 32));
        while (release_warp(w0));
      }
    } else {
      if (order_mode == 1) std::reverse(order.begin(), order.end());
      if (order_mode == 2) std::shuffle(order.begin(), order.end(), rng);
      for (int t : order) {
        if (fibers[t].kind != kRun) continue;
        current = t;
        swapcontext(&sched, &fibers[t].ctx);
      }
    }
    ++rounds;
    int ndone = 0, nsync = 0;
    for (int t = 0; t < n; ++t) {
      ndone += fibers[t].kind == kDone;
      nsync += fibers[t].kind == kSync;
    }
    if (ndone == n) return;
    // Warps whose lanes all wait at the same shuffle phase go on.
    for (int w0 : warps) progress |= release_warp(w0);
    if (progress) continue;
    if (nsync == n) {
      for (int t = 0; t < n; ++t) fibers[t].kind = kRun;
      continue;
    }
    if (ndone != 0) throw std::runtime_error("emu: some threads exited while others wait at a barrier");
    throw std::runtime_error("emu: threads wait at different barriers (divergent __syncthreads / shuffle)");
  }
}
}  // namespace emu

inline dim3 blockIdx, gridDim, blockDim;
inline dim3 emu_thread_idx() {
  const unsigned t = static_cast<unsigned>(emu::current);
  return dim3(t % blockDim.x, (t / blockDim.x) % blockDim.y, t / (blockDim.x * blockDim.y));
}
#define threadIdx (emu_thread_idx())
constexpr int warpSize = 32;

inline void __syncthreads() { emu::yield(emu::kSync); }

namespace emu {
inline void launch_bounds(long max_threads, long = 0) {
  if (static_cast<long>(blockDim.x) * blockDim.y * blockDim.z > max_threads)
    throw std::runtime_error("emu: a block of " + std::to_string(blockDim.x * blockDim.y * blockDim.z) +
                             " threads for a kernel with __launch_bounds__(" + std::to_string(max_threads) +
                             "): the launch would fail on a GPU");
}
}  // namespace emu

namespace emu {
// One warp shuffle: every lane publishes `v` and waits for its warp, then reads the value of lane
// src(its own lane) of the same warp.
template <typename T, typename Src>
inline T shuffle(unsigned mask, T v, Src src) {
  if (mask != 0xffffffffu) throw std::runtime_error("emu: only full-mask shuffles are emulated");
  const int t = current;
  shfl_buf[t] = static_cast<double>(v);
  yield(kShflW);
  const T r = static_cast<T>(shfl_buf[(t & ~31) | (src(t & 31) & 31)]);
  yield(kShflR);
  return r;
}
}  // namespace emu

template <typename T>
inline T __shfl_xor_sync(unsigned mask, T v, int m) {
  return emu::shuffle(mask, v, [m](int lane) { return lane ^ m; });
}

template <typename T>
inline T __shfl_sync(unsigned mask, T v, int lane) {
  return emu::shuffle(mask, v, [lane](int) { return lane; });
}

// __syncwarp: a warp-level barrier (all 32 lanes), emulated as a shuffle of nothing.
inline void __syncwarp(unsigned mask = 0xffffffffu) { (void)__shfl_xor_sync(mask, 0, 0); }

// ------------------------------------------------------------------------------------------------
// Shared memory
// ------------------------------------------------------------------------------------------------
// Dynamic: dmfx_smem (norm kernels, `extern __shared__ unsigned char dmfx_smem[]` at file scope) and
// dmfx_attn_smem (attention kernels, redeclared `extern` inside the kernels). Before each block the
// launch's bytes are filled with 0xFF (NaN as float and double: reads of unwritten shared memory
// propagate) and the bytes past the allotment hold a canary that must survive the block.
// Static: function-static storage, shared by all threads of the block (one block runs at a time),
// filled with 0xFF by the first thread of each block that reaches the declaration (before any thread
// of the block can have written it), with a canary after it, checked at the end of the block.
constexpr size_t kEmuSmemBytes = 256 * 1024;
constexpr size_t kEmuCanaryBytes = 16 * 1024;
alignas(16) unsigned char dmfx_smem[kEmuSmemBytes + kEmuCanaryBytes];
namespace dmfx {
namespace attention_impl {
alignas(16) float4 dmfx_attn_smem[1 << 16];
}
}  // namespace dmfx

namespace emu {
constexpr uint32_t kCanary = 0x7fc0dead;
inline int grid_cap = 3;  // attention launches: fewer blocks than items (the grid-stride loops run)
// The emulated device (cudaDeviceGetAttribute / occupancy): few SMs, so that the kernels' grid-stride
// loops over rows run several times; the opt-in shared memory limit of an H100/H200.
inline int sm_count = 2;
inline int smem_optin = 232448;
inline int blocks_per_sm = 2;  // occupancy answer (capped by threads and shared memory)
inline std::map<const void*, int> func_max_dyn_smem;  // cudaFuncSetAttribute(MaxDynamicSharedMemorySize)
inline long launches = 0;

struct StaticRegion {
  unsigned char* p;
  size_t n;
  uint32_t* canary;
  size_t ncanary;
};
inline std::vector<StaticRegion> static_regions;

inline void static_shared(void* p, size_t n, uint32_t* canary, size_t ncanary) {
  for (const auto& r : static_regions)
    if (r.p == p) return;
  std::memset(p, 0xFF, n);
  for (size_t i = 0; i < ncanary; ++i) canary[i] = kCanary;
  static_regions.push_back({static_cast<unsigned char*>(p), n, canary, ncanary});
}

inline void fill_canary(unsigned char* base, size_t bytes, size_t total) {
  if (bytes + kEmuCanaryBytes > total) throw std::runtime_error("emu: dynamic shared memory too large for the emulation");
  std::memset(base, 0xFF, bytes);
  for (size_t i = bytes; i + 4 <= bytes + kEmuCanaryBytes; i += 4) std::memcpy(base + i, &kCanary, 4);
}

inline void check_canary(const unsigned char* base, size_t bytes, const char* what) {
  for (size_t i = bytes; i + 4 <= bytes + kEmuCanaryBytes; i += 4) {
    uint32_t w;
    std::memcpy(&w, base + i, 4);
    if (w != kCanary)
      throw std::runtime_error(std::string("emu: ") + what + " written past the kernel's allotment at byte " +
                               std::to_string(i) + " (allotted " + std::to_string(bytes) + ")");
  }
}

// Runs the grid block by block (x fastest, then y, then z); `smem` bytes of dynamic shared memory.
// `limit`: the most shared memory (static + dynamic) one block of this kernel may use.
inline void run_grid(dim3 grid, dim3 block, size_t smem, const std::function<void()>& f,
                     size_t limit = static_cast<size_t>(-1)) {
  const long nthr = static_cast<long>(block.x) * block.y * block.z;
  if (nthr <= 0 || nthr > kMaxThreads) throw std::runtime_error("emu: invalid block size " + std::to_string(nthr));
  if (block.z > 64) throw std::runtime_error("emu: blockDim.z > 64");
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) throw std::runtime_error("emu: empty grid (invalid configuration)");
  if (grid.y > 65535 || grid.z > 65535) throw std::runtime_error("emu: gridDim.y/z > 65535");
  ++launches;
  gridDim = grid;
  blockDim = block;
  unsigned char* attn = reinterpret_cast<unsigned char*>(dmfx::attention_impl::dmfx_attn_smem);
  const size_t attn_total = sizeof(dmfx::attention_impl::dmfx_attn_smem);
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        blockIdx = dim3(bx, by, bz);
        fill_canary(dmfx_smem, smem, sizeof(dmfx_smem));
        fill_canary(attn, smem, attn_total);
        static_regions.clear();
        run_block(static_cast<int>(nthr), f);
        ++blocks_run;
        check_canary(dmfx_smem, smem, "dynamic shared memory");
        check_canary(attn, smem, "dynamic shared memory");
        size_t static_bytes = 0;
        for (const auto& r : static_regions) {
          static_bytes += r.n;
          for (size_t i = 0; i < r.ncanary; ++i)
            if (r.canary[i] != kCanary) throw std::runtime_error("emu: a static __shared__ array was written past its end");
        }
        if (static_bytes + smem > limit)
          throw std::runtime_error("emu: " + std::to_string(static_bytes) + " bytes of static and " + std::to_string(smem) +
                                   " of dynamic shared memory, more than the " + std::to_string(limit) +
                                   " a block of this kernel may use: the launch would fail on a GPU");
      }
}

// `kernel<<<grid, block, smem, stream>>>(args...)` is rewritten as
// `emu::Cfg(grid, block, smem, stream)(kernel)(args...)`: the arguments are copied once (as CUDA
// copies kernel parameters) and every thread calls the kernel with them.
struct Cfg {
  dim3 grid, block;
  size_t smem;
  Cfg(dim3 g, dim3 b, size_t s = 0, void* = nullptr) : grid(g), block(b), smem(s) {}
  template <typename K>
  auto operator()(K kernel) const {
    const Cfg cfg = *this;
    return [cfg, kernel](auto... args) {
      int allowed = 48 * 1024;
      size_t limit = 48 * 1024;
      auto it = func_max_dyn_smem.find(reinterpret_cast<const void*>(kernel));
      if (it != func_max_dyn_smem.end()) {
        allowed = it->second;
        limit = static_cast<size_t>(smem_optin);
      }
      if (cfg.smem > static_cast<size_t>(allowed))
        throw std::runtime_error("emu: launch with " + std::to_string(cfg.smem) + " bytes of dynamic shared memory, "
                                 "more than the kernel's limit " + std::to_string(allowed) +
                                 " (cudaFuncSetAttribute missing?): the launch would fail on a GPU");
      run_grid(cfg.grid, cfg.block, cfg.smem, [&] { kernel(args...); }, limit);
    };
  }
};

// The attention family's launch(kernel, items, floats, P), with the grid capped at grid_cap.
template <typename Kernel, typename Arg>
void launch(Kernel kernel, int64_t items, size_t floats, const Arg& P) {
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(items, grid_cap));
  run_grid(dim3(grid), dim3(256), floats * sizeof(float), [&] { kernel(P); }, static_cast<size_t>(smem_optin));
}
}  // namespace emu

// Allocations of the host code (outputs, workspaces): NaN-filled (255 for bytes), so elements a kernel
// does not write show as NaN (the CUDA caching allocator gives no such guarantee either).
namespace emu {
inline at::Tensor poisoned(at::Tensor t) {
  if (t.numel() > 0) {
    if (t.is_floating_point()) t.fill_(std::numeric_limits<double>::quiet_NaN());
    else if (t.scalar_type() == at::kByte) t.fill_(255);
  }
  return t;
}
inline at::Tensor empty_poisoned(at::IntArrayRef size, at::TensorOptions o = {},
                                 std::optional<at::MemoryFormat> mf = std::nullopt) {
  return poisoned(at::empty(size, o, mf));
}
inline at::Tensor empty_like_poisoned(const at::Tensor& x, at::TensorOptions o = {},
                                      std::optional<at::MemoryFormat> mf = std::nullopt) {
  return poisoned(at::empty_like(x, o, mf));
}
}  // namespace emu

// ------------------------------------------------------------------------------------------------
// The CUDA runtime and c10::cuda, as far as the host code uses them
// ------------------------------------------------------------------------------------------------
using cudaStream_t = void*;
enum cudaError_t { cudaSuccess = 0, cudaErrorInvalidValue = 1 };
inline cudaError_t cudaGetLastError() { return cudaSuccess; }
inline cudaError_t cudaPeekAtLastError() { return cudaSuccess; }
inline const char* cudaGetErrorString(cudaError_t e) { return e == cudaSuccess ? "no error" : "emulated CUDA error"; }
enum cudaDeviceAttr { cudaDevAttrMultiProcessorCount = 16, cudaDevAttrMaxSharedMemoryPerBlockOptin = 97,
                      cudaDevAttrMaxSharedMemoryPerBlock = 8 };
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };

inline cudaError_t cudaDeviceGetAttribute(int* v, cudaDeviceAttr attr, int device) {
  if (device != 0) return cudaErrorInvalidValue;
  switch (attr) {
    case cudaDevAttrMultiProcessorCount: *v = emu::sm_count; return cudaSuccess;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *v = emu::smem_optin; return cudaSuccess;
    case cudaDevAttrMaxSharedMemoryPerBlock: *v = 48 * 1024; return cudaSuccess;
  }
  return cudaErrorInvalidValue;
}

template <typename K>
cudaError_t cudaFuncSetAttribute(K kernel, cudaFuncAttribute attr, int value) {
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize) return cudaErrorInvalidValue;
  if (value > emu::smem_optin) return cudaErrorInvalidValue;  // as on a GPU: above the opt-in limit
  emu::func_max_dyn_smem[reinterpret_cast<const void*>(kernel)] = value;
  return cudaSuccess;
}

template <typename K>
cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* n, K, int threads, size_t smem) {
  int v = std::min(emu::blocks_per_sm, 2048 / std::max(threads, 1));
  if (smem > 0) v = std::min<int>(v, static_cast<int>(emu::smem_optin / smem));
  *n = v;
  return cudaSuccess;
}

#define C10_CUDA_CHECK(expr)                                                                     \
  do {                                                                                           \
    const cudaError_t emu_err = (expr);                                                          \
    if (emu_err != cudaSuccess) throw std::runtime_error(std::string("emu: CUDA error in ") + #expr); \
  } while (0)
// A launch that would fail throws from the launch itself.
#define C10_CUDA_KERNEL_LAUNCH_CHECK() ((void)0)

namespace c10 {
namespace cuda {
struct EmuStream {
  cudaStream_t stream() const { return nullptr; }
};
inline EmuStream getCurrentCUDAStream(int = -1) { return {}; }
inline int current_device() { return 0; }
inline int device_count() { return 1; }
// The emulated "CUDA" device is the CPU: a guard for anything else is a bug in the host code.
struct CUDAGuard {
  explicit CUDAGuard(c10::Device d) {
    if (!d.is_cpu()) throw std::runtime_error("emu: CUDAGuard for a tensor that is not on the emulated device (CPU)");
  }
};
using OptionalCUDAGuard = CUDAGuard;
}  // namespace cuda
}  // namespace c10

// dmfx CUDA kernels of the pointwise family. pointwise_cpu.cpp is the specification: same arguments,
// checks (shared in pointwise_api.h), outputs and math (activations and the soft cap from pointwise_api.h,
// evaluated in at::opmath_type); dropout masks are bit-identical (Philox of the logical row-major index,
// dmfx_common.h).
//
// Layout of every kernel
// ----------------------
// A tensor is seen as [rows, N] with unit stride along N (RowIndexer for the leading dims, as on the
// CPU). A row is cut into chunks of VEC consecutive elements: VEC = 16 bytes of scalar_t when every
// pointer is 16-byte aligned, N % VEC == 0 and every row stride is a multiple of VEC (so all loads
// and stores are 128-bit), else VEC = 1. Thread (x, y) of the 2-D grid owns chunk
// blockIdx.x * blockDim.x + threadIdx.x of rows y, y + Y, y + 2Y, ... (Y = gridDim.y * blockDim.y,
// a grid-stride loop over rows): neighbouring threads touch neighbouring chunks (coalesced), and a
// thread keeps the bias of its chunk in registers.
//
// Bias gradient: each thread sums dx of its chunk over its rows in registers and writes one partial
// row [Y, N] (acc_t); col_sum_kernel then adds the Y partials per column in a fixed order (col_sum.cuh)
// (deterministic, no atomics). dx and dbias come out of one pass over grad_out and x.
#include <ATen/ATen.h>
#include <torch/library.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "dmfx_common.h"
#include "kernel_api.h"
#include "col_sum.cuh"
#include "pointwise_api.h"

namespace dmfx {
namespace pointwise_impl {

constexpr int kBlockThreads = 256;

// 16 bytes of scalar_t (2 doubles, 4 floats, 8 halves) for the 128-bit path.
template <typename scalar_t>
constexpr int kVecOf = static_cast<int>(16 / sizeof(scalar_t));

// ------------------------------------------------------------------------------------------------
// Device helpers
// ------------------------------------------------------------------------------------------------

template <typename T, int N>
struct alignas(sizeof(T) * N) PwPack {
  T v[N];
};

template <int VEC, typename T>
__device__ __forceinline__ void load_vec(const T* p, T* out) {
  if constexpr (VEC == 1) {
    out[0] = p[0];
  } else {
    const PwPack<T, VEC> pk = *reinterpret_cast<const PwPack<T, VEC>*>(p);
#pragma unroll
    for (int k = 0; k < VEC; ++k) out[k] = pk.v[k];
  }
}

template <int VEC, typename T>
__device__ __forceinline__ void store_vec(T* p, const T* in) {
  if constexpr (VEC == 1) {
    p[0] = in[0];
  } else {
    PwPack<T, VEC> pk;
#pragma unroll
    for (int k = 0; k < VEC; ++k) pk.v[k] = in[k];
    *reinterpret_cast<PwPack<T, VEC>*>(p) = pk;
  }
}

// Dropout multipliers (0 or `scale`) of the VEC elements with logical indices first .. first+VEC-1.
// When VEC is a multiple of 4 the host guarantees first % 4 == 0: one Philox call per 4 elements.
template <int VEC, typename acc_t>
__device__ __forceinline__ void dropout_mults(const DropoutParams& d, acc_t scale, uint64_t first,
                                              acc_t* m) {
  if (!d.active) {
#pragma unroll
    for (int k = 0; k < VEC; ++k) m[k] = acc_t(1);
    return;
  }
  if (d.drop_all) {
#pragma unroll
    for (int k = 0; k < VEC; ++k) m[k] = acc_t(0);
    return;
  }
  if constexpr (VEC % 4 == 0) {
#pragma unroll
    for (int g = 0; g < VEC / 4; ++g) {
      const Philox4 r = philox4x32_10((first >> 2) + g, d.offset, d.seed);
#pragma unroll
      for (int lane = 0; lane < 4; ++lane)
        m[g * 4 + lane] = philox_word(r, lane) >= d.threshold ? scale : acc_t(0);
    }
  } else {
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      const uint64_t i = first + k;
      const Philox4 r = philox4x32_10(i >> 2, d.offset, d.seed);
      m[k] = philox_word(r, static_cast<int>(i & 3)) >= d.threshold ? scale : acc_t(0);
    }
  }
}

__device__ __forceinline__ int64_t first_row() {
  return static_cast<int64_t>(blockIdx.y) * blockDim.y + threadIdx.y;
}
__device__ __forceinline__ int64_t row_stride() {
  return static_cast<int64_t>(gridDim.y) * blockDim.y;
}
__device__ __forceinline__ int64_t my_chunk() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}

// ------------------------------------------------------------------------------------------------
// Kernels
// ------------------------------------------------------------------------------------------------

template <typename scalar_t>
struct BiasActArgs {
  using acc_t = at::opmath_type<scalar_t>;
  const scalar_t* x;
  RowIndexer xi;
  const scalar_t* grad;  // backward only
  RowIndexer gi;
  const scalar_t* bias;  // [N] contiguous or null
  scalar_t* out;         // forward: out; backward: dx (or null)
  acc_t* partial;        // backward: [Y, N] bias-gradient partials (or null)
  const bool* mask;      // backward: a stored dropout mask (native_dropout's), or null
  RowIndexer mi;
  acc_t mask_scale;
  int64_t rows, N, nchunks;
  DropoutParams d;
  acc_t scale;
};

template <typename scalar_t, int VEC, int ACT>
__global__ void bias_act_fwd_kernel(const BiasActArgs<scalar_t> a) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t chunk = my_chunk();
  if (chunk >= a.nchunks) return;
  const int64_t j0 = chunk * VEC;
  acc_t b[VEC];
#pragma unroll
  for (int k = 0; k < VEC; ++k) b[k] = a.bias ? static_cast<acc_t>(a.bias[j0 + k]) : acc_t(0);
  for (int64_t r = first_row(); r < a.rows; r += row_stride()) {
    scalar_t xv[VEC], ov[VEC];
    acc_t m[VEC];
    load_vec<VEC>(a.x + a.xi.offset(r) + j0, xv);
    dropout_mults<VEC, acc_t>(a.d, a.scale, static_cast<uint64_t>(r * a.N + j0), m);
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      const acc_t v = act_fwd<ACT, acc_t>(static_cast<acc_t>(xv[k]) + b[k]);
      ov[k] = static_cast<scalar_t>(a.d.active ? v * m[k] : v);
    }
    store_vec<VEC>(a.out + r * a.N + j0, ov);
  }
}

template <typename scalar_t, int VEC, int ACT>
__global__ void bias_act_bwd_kernel(const BiasActArgs<scalar_t> a) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t chunk = my_chunk();
  if (chunk >= a.nchunks) return;
  const int64_t j0 = chunk * VEC;
  acc_t b[VEC], sum[VEC];
#pragma unroll
  for (int k = 0; k < VEC; ++k) {
    b[k] = a.bias ? static_cast<acc_t>(a.bias[j0 + k]) : acc_t(0);
    sum[k] = acc_t(0);
  }
  for (int64_t r = first_row(); r < a.rows; r += row_stride()) {
    scalar_t xv[VEC], gv[VEC], dv[VEC];
    acc_t m[VEC];
    load_vec<VEC>(a.x + a.xi.offset(r) + j0, xv);
    load_vec<VEC>(a.grad + a.gi.offset(r) + j0, gv);
    if (a.mask) {
      const bool* keep = a.mask + a.mi.offset(r) + j0;
#pragma unroll
      for (int k = 0; k < VEC; ++k) m[k] = keep[k] ? a.mask_scale : acc_t(0);
    } else {
      dropout_mults<VEC, acc_t>(a.d, a.scale, static_cast<uint64_t>(r * a.N + j0), m);
    }
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      acc_t g = static_cast<acc_t>(gv[k]);
      if (a.d.active || a.mask) g *= m[k];
      const acc_t dx = g * act_grad<ACT, acc_t>(static_cast<acc_t>(xv[k]) + b[k]);
      sum[k] += dx;
      dv[k] = static_cast<scalar_t>(dx);
    }
    if (a.out) store_vec<VEC>(a.out + r * a.N + j0, dv);
  }
  if (a.partial) {
    acc_t* prow = a.partial + first_row() * a.N + j0;
#pragma unroll
    for (int k = 0; k < VEC; ++k) prow[k] = sum[k];
  }
}

// out[j] = sum over p < P of partial[p, j], added in a fixed order (deterministic; block_column_sum,
// col_sum.cuh): a (kColSumCols, kColSumRows) block owns kColSumCols columns at a time, in a
// grid-stride loop over the columns.
template <typename scalar_t>
__global__ void __launch_bounds__(kColSumCols * kColSumRows)
    col_sum_kernel(const at::opmath_type<scalar_t>* partial, int64_t P, int64_t N, scalar_t* out) {
  using acc_t = at::opmath_type<scalar_t>;
  for (int64_t j0 = static_cast<int64_t>(blockIdx.x) * kColSumCols; j0 < N;
       j0 += static_cast<int64_t>(gridDim.x) * kColSumCols) {
    const int64_t j = j0 + threadIdx.x;
    const acc_t t = block_column_sum<acc_t>(j < N ? partial + j : nullptr, P, N);
    if (threadIdx.y == 0 && j < N) out[j] = static_cast<scalar_t>(t);
  }
}

template <typename scalar_t>
struct GluArgs {
  const scalar_t* gate;
  RowIndexer ai;
  const scalar_t* up;
  RowIndexer ui;
  const scalar_t* grad;  // backward only
  RowIndexer gi;
  scalar_t* out;   // forward: out; backward: dgate (or null)
  scalar_t* out2;  // backward: dup (or null)
  int64_t rows, N, nchunks;
};

template <typename scalar_t, int VEC, int ACT>
__global__ void glu_fwd_kernel(const GluArgs<scalar_t> a) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t chunk = my_chunk();
  if (chunk >= a.nchunks) return;
  const int64_t j0 = chunk * VEC;
  for (int64_t r = first_row(); r < a.rows; r += row_stride()) {
    scalar_t av[VEC], uv[VEC], ov[VEC];
    load_vec<VEC>(a.gate + a.ai.offset(r) + j0, av);
    load_vec<VEC>(a.up + a.ui.offset(r) + j0, uv);
#pragma unroll
    for (int k = 0; k < VEC; ++k)
      ov[k] = static_cast<scalar_t>(act_fwd<ACT, acc_t>(static_cast<acc_t>(av[k])) * static_cast<acc_t>(uv[k]));
    store_vec<VEC>(a.out + r * a.N + j0, ov);
  }
}

template <typename scalar_t, int VEC, int ACT>
__global__ void glu_bwd_kernel(const GluArgs<scalar_t> a) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t chunk = my_chunk();
  if (chunk >= a.nchunks) return;
  const int64_t j0 = chunk * VEC;
  for (int64_t r = first_row(); r < a.rows; r += row_stride()) {
    scalar_t gv[VEC], av[VEC], uv[VEC], o1[VEC], o2[VEC];
    load_vec<VEC>(a.grad + a.gi.offset(r) + j0, gv);
    load_vec<VEC>(a.gate + a.ai.offset(r) + j0, av);
    if (a.out) load_vec<VEC>(a.up + a.ui.offset(r) + j0, uv);
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      const acc_t g = static_cast<acc_t>(gv[k]), x = static_cast<acc_t>(av[k]);
      if (a.out) o1[k] = static_cast<scalar_t>(g * static_cast<acc_t>(uv[k]) * act_grad<ACT, acc_t>(x));
      if (a.out2) o2[k] = static_cast<scalar_t>(g * act_fwd<ACT, acc_t>(x));
    }
    if (a.out) store_vec<VEC>(a.out + r * a.N + j0, o1);
    if (a.out2) store_vec<VEC>(a.out2 + r * a.N + j0, o2);
  }
}

template <typename scalar_t>
struct SoftcapArgs {
  using acc_t = at::opmath_type<scalar_t>;
  const scalar_t* x;     // forward: x; backward: out (softcap's output)
  RowIndexer xi;
  const scalar_t* grad;  // backward only
  RowIndexer gi;
  scalar_t* out;         // forward: out; backward: dx
  acc_t cap;
  int64_t rows, N, nchunks;
};

// out = cap * tanh(x / cap)
template <typename scalar_t, int VEC>
__global__ void softcap_fwd_kernel(const SoftcapArgs<scalar_t> a) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t chunk = my_chunk();
  if (chunk >= a.nchunks) return;
  const int64_t j0 = chunk * VEC;
  for (int64_t r = first_row(); r < a.rows; r += row_stride()) {
    scalar_t xv[VEC], ov[VEC];
    load_vec<VEC>(a.x + a.xi.offset(r) + j0, xv);
#pragma unroll
    for (int k = 0; k < VEC; ++k) ov[k] = static_cast<scalar_t>(softcap_fwd<acc_t>(static_cast<acc_t>(xv[k]), a.cap));
    store_vec<VEC>(a.out + r * a.N + j0, ov);
  }
}

// dx = grad * (1 - (out / cap)^2)
template <typename scalar_t, int VEC>
__global__ void softcap_bwd_kernel(const SoftcapArgs<scalar_t> a) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t chunk = my_chunk();
  if (chunk >= a.nchunks) return;
  const int64_t j0 = chunk * VEC;
  for (int64_t r = first_row(); r < a.rows; r += row_stride()) {
    scalar_t gv[VEC], ov[VEC], dv[VEC];
    load_vec<VEC>(a.grad + a.gi.offset(r) + j0, gv);
    load_vec<VEC>(a.x + a.xi.offset(r) + j0, ov);
#pragma unroll
    for (int k = 0; k < VEC; ++k)
      dv[k] = static_cast<scalar_t>(softcap_grad<acc_t>(static_cast<acc_t>(gv[k]), static_cast<acc_t>(ov[k]), a.cap));
    store_vec<VEC>(a.out + r * a.N + j0, dv);
  }
}

template <typename scalar_t>
struct RopeJob {
  const scalar_t* x;
  const scalar_t* c;
  const scalar_t* s;
  scalar_t* o;
  RowIndexer xi, ci, si;
  int64_t rows;
};

template <typename scalar_t>
struct RopeArgs {
  RopeJob<scalar_t> job[2];  // q (blockIdx.z == 0) and k (blockIdx.z == 1)
  int64_t h;                 // D / 2
  bool inverse;
  bool interleaved;          // pairs (2j, 2j + 1) (GPT-J's rotate_every_two), else (j, j + h)
  bool deinterleave;         // x's pairs (2j, 2j + 1) rotate into o's (j, j + h) (DeepSeek's); inverse: back
};

// Thread j < h of a row handles the pair (a, b) = (j, j + h), or (2j, 2j + 1) interleaved. Forward:
// o = x c + rot(x) s, rot(x)[a] = -x[b], rot(x)[b] = x[a]; inverse: o[a] = x[a] c[a] + x[b] s[b],
// o[b] = x[b] c[b] - x[a] s[a]. deinterleave: the same with (j, j + h) for the tables and for o, and
// (2j, 2j + 1) for x (inverse: for o, x read by halves).
template <typename scalar_t>
__global__ void rope_kernel(const RopeArgs<scalar_t> a) {
  using acc_t = at::opmath_type<scalar_t>;
  const RopeJob<scalar_t>& jb = a.job[blockIdx.z];
  const int64_t j = my_chunk();
  if (j >= a.h) return;
  const int64_t h = a.h, D = 2 * h;
  const int64_t ia = a.interleaved ? 2 * j : j, ib = a.interleaved ? 2 * j + 1 : j + h;
  // (deinterleave: x's pair in the forward, o's in the inverse, is (2j, 2j + 1); the rest by halves)
  const bool pairs_in = a.deinterleave && !a.inverse, pairs_out = a.deinterleave && a.inverse;
  const int64_t xa = pairs_in ? 2 * j : ia, xb = pairs_in ? 2 * j + 1 : ib;
  const int64_t oa = pairs_out ? 2 * j : ia, ob = pairs_out ? 2 * j + 1 : ib;
  for (int64_t r = first_row(); r < jb.rows; r += row_stride()) {
    const scalar_t* x = jb.x + jb.xi.offset(r);
    const scalar_t* c = jb.c + jb.ci.offset(r);
    const scalar_t* s = jb.s + jb.si.offset(r);
    const acc_t x1 = static_cast<acc_t>(x[xa]), x2 = static_cast<acc_t>(x[xb]);
    const acc_t c1 = static_cast<acc_t>(c[ia]), c2 = static_cast<acc_t>(c[ib]);
    const acc_t s1 = static_cast<acc_t>(s[ia]), s2 = static_cast<acc_t>(s[ib]);
    scalar_t* o = jb.o + r * D;
    if (!a.inverse) {
      o[oa] = static_cast<scalar_t>(x1 * c1 - x2 * s1);
      o[ob] = static_cast<scalar_t>(x2 * c2 + x1 * s2);
    } else {
      o[oa] = static_cast<scalar_t>(x1 * c1 + x2 * s2);
      o[ob] = static_cast<scalar_t>(x2 * c2 - x1 * s1);
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Host helpers
// ------------------------------------------------------------------------------------------------

int pw_sm_count() {
  int value = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&value, cudaDevAttrMultiProcessorCount, c10::cuda::current_device()));
  return std::max(value, 1);
}

cudaStream_t pw_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

struct Plan {
  dim3 grid, block;
  int64_t Y;  // threads along rows in the whole grid (gridDim.y * blockDim.y)
};

// Block: X threads (a power of two in [32, 256]) along the chunks, 256 / X along rows. Grid: enough
// blocks along x for every chunk, along y enough to fill the GPU about twice (each thread then loops).
Plan plan_launch(int64_t nchunks, int64_t rows, unsigned z = 1) {
  int bx = 32;
  while (bx < kBlockThreads && bx < nchunks) bx *= 2;
  const int by = kBlockThreads / bx;
  const int64_t gx = std::max<int64_t>(1, (nchunks + bx - 1) / bx);
  TORCH_CHECK(gx <= 2147483647LL, "dmfx: rows too long for the pointwise kernels");
  const int64_t target = static_cast<int64_t>(pw_sm_count()) * (2048 / kBlockThreads) * 2;
  int64_t gy = (rows + by - 1) / by;
  gy = std::min<int64_t>(gy, std::max<int64_t>(1, target / (gx * z)));
  gy = std::max<int64_t>(1, std::min<int64_t>(gy, 65535));
  Plan p;
  p.block = dim3(static_cast<unsigned>(bx), static_cast<unsigned>(by));
  p.grid = dim3(static_cast<unsigned>(gx), static_cast<unsigned>(gy), z);
  p.Y = gy * by;
  return p;
}

bool aligned16(const void* p) { return p == nullptr || reinterpret_cast<uintptr_t>(p) % 16 == 0; }

bool strides_ok(const RowIndexer& r, int vec) {
  for (int d = 0; d < r.nd; ++d)
    if (r.strides[d] % vec != 0) return false;
  return true;
}

template <typename scalar_t>
const scalar_t* ptr_of(const c10::optional<at::Tensor>& t) {
  return present(t) ? t->data_ptr<scalar_t>() : nullptr;
}

// ------------------------------------------------------------------------------------------------
// Launchers
// ------------------------------------------------------------------------------------------------

template <typename scalar_t>
void launch_bias_act(bool backward, int act, BiasActArgs<scalar_t> a, const at::Tensor& x,
                     at::Tensor* dbias) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr int V = kVecOf<scalar_t>;
  const bool vec = a.N % V == 0 && aligned16(a.x) && aligned16(a.grad) && aligned16(a.bias) &&
                   aligned16(a.out) && strides_ok(a.xi, V) && (a.grad == nullptr || strides_ok(a.gi, V));
  a.nchunks = vec ? a.N / V : a.N;
  const Plan p = plan_launch(a.nchunks, a.rows);
  const cudaStream_t stream = pw_stream();
  at::Tensor partial;
  a.partial = nullptr;
  if (backward && dbias != nullptr) {
    partial = at::empty({p.Y, a.N}, x.options().dtype(std::is_same<acc_t, double>::value ? at::kDouble : at::kFloat));
    a.partial = partial.data_ptr<acc_t>();
  }
  dispatch_act(act, [&](auto ac) {
    constexpr int ACT = decltype(ac)::value;
    if (backward) {
      if (vec) bias_act_bwd_kernel<scalar_t, V, ACT><<<p.grid, p.block, 0, stream>>>(a);
      else bias_act_bwd_kernel<scalar_t, 1, ACT><<<p.grid, p.block, 0, stream>>>(a);
    } else {
      if (vec) bias_act_fwd_kernel<scalar_t, V, ACT><<<p.grid, p.block, 0, stream>>>(a);
      else bias_act_fwd_kernel<scalar_t, 1, ACT><<<p.grid, p.block, 0, stream>>>(a);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  if (a.partial) {
    const int64_t blocks = std::min<int64_t>((a.N + kColSumCols - 1) / kColSumCols, 65535);
    col_sum_kernel<scalar_t><<<static_cast<unsigned>(blocks), dim3(kColSumCols, kColSumRows), 0, stream>>>(
        a.partial, p.Y, a.N, dbias->data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

template <typename scalar_t>
void launch_glu(bool backward, int act, GluArgs<scalar_t> a) {
  constexpr int V = kVecOf<scalar_t>;
  const bool vec = a.N % V == 0 && aligned16(a.gate) && aligned16(a.up) && aligned16(a.grad) &&
                   aligned16(a.out) && aligned16(a.out2) && strides_ok(a.ai, V) && strides_ok(a.ui, V) &&
                   (a.grad == nullptr || strides_ok(a.gi, V));
  a.nchunks = vec ? a.N / V : a.N;
  const Plan p = plan_launch(a.nchunks, a.rows);
  const cudaStream_t stream = pw_stream();
  dispatch_act(act, [&](auto ac) {
    constexpr int ACT = decltype(ac)::value;
    if (backward) {
      if (vec) glu_bwd_kernel<scalar_t, V, ACT><<<p.grid, p.block, 0, stream>>>(a);
      else glu_bwd_kernel<scalar_t, 1, ACT><<<p.grid, p.block, 0, stream>>>(a);
    } else {
      if (vec) glu_fwd_kernel<scalar_t, V, ACT><<<p.grid, p.block, 0, stream>>>(a);
      else glu_fwd_kernel<scalar_t, 1, ACT><<<p.grid, p.block, 0, stream>>>(a);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

template <typename scalar_t>
void launch_softcap(bool backward, SoftcapArgs<scalar_t> a) {
  constexpr int V = kVecOf<scalar_t>;
  const bool vec = a.N % V == 0 && aligned16(a.x) && aligned16(a.grad) && aligned16(a.out) && strides_ok(a.xi, V) &&
                   (a.grad == nullptr || strides_ok(a.gi, V));
  a.nchunks = vec ? a.N / V : a.N;
  const Plan p = plan_launch(a.nchunks, a.rows);
  const cudaStream_t stream = pw_stream();
  if (backward) {
    if (vec) softcap_bwd_kernel<scalar_t, V><<<p.grid, p.block, 0, stream>>>(a);
    else softcap_bwd_kernel<scalar_t, 1><<<p.grid, p.block, 0, stream>>>(a);
  } else {
    if (vec) softcap_fwd_kernel<scalar_t, V><<<p.grid, p.block, 0, stream>>>(a);
    else softcap_fwd_kernel<scalar_t, 1><<<p.grid, p.block, 0, stream>>>(a);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace pointwise_impl

// ------------------------------------------------------------------------------------------------
// Entry points (same signatures, checks and outputs as pointwise_cpu.cpp)
// ------------------------------------------------------------------------------------------------

at::Tensor bias_act_fwd_cuda(const at::Tensor& x_in, const c10::optional<at::Tensor>& bias_in,
                             int64_t act, int64_t seed, int64_t offset, double p) {
  using namespace pointwise_impl;
  const DropoutParams d = check_bias_act("bias_act_fwd", x_in, bias_in, act, seed, offset, p, at::kCUDA);
  const c10::cuda::CUDAGuard device_guard(x_in.device());
  const at::Tensor x = rowable(x_in);
  const auto bias = contiguous(bias_in);
  at::Tensor out = at::empty(x.sizes(), x.options());
  if (x.numel() == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "dmfx_bias_act_fwd_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    BiasActArgs<scalar_t> a{};
    a.x = x.data_ptr<scalar_t>();
    a.xi = RowIndexer::of(x);
    a.grad = nullptr;
    a.bias = ptr_of<scalar_t>(bias);
    a.out = out.data_ptr<scalar_t>();
    a.rows = num_rows(x);
    a.N = x.size(-1);
    a.d = d;
    a.scale = static_cast<acc_t>(d.scale);
    launch_bias_act<scalar_t>(false, static_cast<int>(act), a, x, nullptr);
  });
  return out;
}

std::vector<at::Tensor> bias_act_bwd_cuda(const at::Tensor& grad_out_in, const at::Tensor& x_in,
                                          const c10::optional<at::Tensor>& bias_in, int64_t act,
                                          int64_t seed, int64_t offset, double p,
                                          std::vector<bool> output_mask,
                                          const c10::optional<at::Tensor>& mask_in, double mask_scale) {
  using namespace pointwise_impl;
  const char* op = "bias_act_bwd";
  const DropoutParams d = check_bias_act(op, x_in, bias_in, act, seed, offset, p, at::kCUDA);
  check_same_shape(op, "grad_out", grad_out_in, "x", x_in);
  check_mask(op, output_mask, "[dx, dbias]");
  check_stored_mask(op, mask_in, "x", x_in, p, mask_scale);
  const c10::cuda::CUDAGuard device_guard(x_in.device());
  const at::Tensor x = rowable(x_in), grad_out = rowable(grad_out_in);
  const auto mask = rowable(mask_in);
  const auto bias = contiguous(bias_in);
  const at::Tensor empty = at::empty({0}, x.options());
  at::Tensor dx = output_mask[0] ? at::empty(x.sizes(), x.options()) : at::Tensor();
  at::Tensor dbias = output_mask[1] ? at::empty({x.size(-1)}, x.options()) : at::Tensor();  // (also without a bias)
  if (num_rows(x) > 0 && (dx.defined() || dbias.defined())) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "dmfx_bias_act_bwd_cuda", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      BiasActArgs<scalar_t> a{};
      a.x = x.data_ptr<scalar_t>();
      a.xi = RowIndexer::of(x);
      a.grad = grad_out.data_ptr<scalar_t>();
      a.gi = RowIndexer::of(grad_out);
      a.bias = ptr_of<scalar_t>(bias);
      a.out = dx.defined() ? dx.data_ptr<scalar_t>() : nullptr;
      if (mask) {
        a.mask = mask->data_ptr<bool>();
        a.mi = RowIndexer::of(*mask);
        a.mask_scale = static_cast<acc_t>(mask_scale);
      }
      a.rows = num_rows(x);
      a.N = x.size(-1);
      a.d = d;
      a.scale = static_cast<acc_t>(d.scale);
      launch_bias_act<scalar_t>(true, static_cast<int>(act), a, x, dbias.defined() ? &dbias : nullptr);
    });
  } else if (dbias.defined()) {
    dbias.zero_();
  }
  return {dx.defined() ? dx : empty, dbias.defined() ? dbias : empty};
}

at::Tensor glu_fwd_cuda(const at::Tensor& gate_in, const at::Tensor& up_in, int64_t act) {
  using namespace pointwise_impl;
  check_glu("glu_fwd", gate_in, up_in, act, at::kCUDA);
  const c10::cuda::CUDAGuard device_guard(gate_in.device());
  const at::Tensor gate = rowable(gate_in), up = rowable(up_in);
  at::Tensor out = at::empty(gate.sizes(), gate.options());
  if (gate.numel() == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, gate.scalar_type(), "dmfx_glu_fwd_cuda", [&] {
    GluArgs<scalar_t> a{};
    a.gate = gate.data_ptr<scalar_t>();
    a.ai = RowIndexer::of(gate);
    a.up = up.data_ptr<scalar_t>();
    a.ui = RowIndexer::of(up);
    a.grad = nullptr;
    a.out = out.data_ptr<scalar_t>();
    a.out2 = nullptr;
    a.rows = num_rows(gate);
    a.N = gate.size(-1);
    launch_glu<scalar_t>(false, static_cast<int>(act), a);
  });
  return out;
}

std::vector<at::Tensor> glu_bwd_cuda(const at::Tensor& grad_out_in, const at::Tensor& gate_in,
                                     const at::Tensor& up_in, int64_t act,
                                     std::vector<bool> output_mask) {
  using namespace pointwise_impl;
  const char* op = "glu_bwd";
  check_glu(op, gate_in, up_in, act, at::kCUDA);
  check_same_shape(op, "grad_out", grad_out_in, "gate", gate_in);
  check_mask(op, output_mask, "[dgate, dup]");
  const c10::cuda::CUDAGuard device_guard(gate_in.device());
  const at::Tensor gate = rowable(gate_in), up = rowable(up_in), grad_out = rowable(grad_out_in);
  const at::Tensor empty = at::empty({0}, gate.options());
  at::Tensor dgate = output_mask[0] ? at::empty(gate.sizes(), gate.options()) : at::Tensor();
  at::Tensor dup = output_mask[1] ? at::empty(gate.sizes(), gate.options()) : at::Tensor();
  if (gate.numel() > 0 && (dgate.defined() || dup.defined())) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, gate.scalar_type(), "dmfx_glu_bwd_cuda", [&] {
      GluArgs<scalar_t> a{};
      a.gate = gate.data_ptr<scalar_t>();
      a.ai = RowIndexer::of(gate);
      a.up = up.data_ptr<scalar_t>();
      a.ui = RowIndexer::of(up);
      a.grad = grad_out.data_ptr<scalar_t>();
      a.gi = RowIndexer::of(grad_out);
      a.out = dgate.defined() ? dgate.data_ptr<scalar_t>() : nullptr;
      a.out2 = dup.defined() ? dup.data_ptr<scalar_t>() : nullptr;
      a.rows = num_rows(gate);
      a.N = gate.size(-1);
      launch_glu<scalar_t>(true, static_cast<int>(act), a);
    });
  }
  return {dgate.defined() ? dgate : empty, dup.defined() ? dup : empty};
}

// A 0-dim x is computed as [1]; the output is contiguous whatever x's strides.
at::Tensor softcap_fwd_cuda(const at::Tensor& x_in, double cap) {
  using namespace pointwise_impl;
  check_softcap(x_in, cap, at::kCUDA);
  const c10::cuda::CUDAGuard device_guard(x_in.device());
  at::Tensor out = at::empty(x_in.sizes(), x_in.options());
  if (x_in.numel() == 0) return out;
  const at::Tensor x = rowable(x_in.dim() == 0 ? x_in.reshape({1}) : x_in);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "dmfx_softcap_fwd_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    SoftcapArgs<scalar_t> a{};
    a.x = x.data_ptr<scalar_t>();
    a.xi = RowIndexer::of(x);
    a.grad = nullptr;
    a.out = out.data_ptr<scalar_t>();
    a.cap = static_cast<acc_t>(cap);
    a.rows = num_rows(x);
    a.N = x.size(-1);
    launch_softcap<scalar_t>(false, a);
  });
  return out;
}

at::Tensor softcap_bwd_cuda(const at::Tensor& grad_out_in, const at::Tensor& out_in, double cap) {
  using namespace pointwise_impl;
  check_softcap_backward(grad_out_in, out_in, cap, at::kCUDA);
  const c10::cuda::CUDAGuard device_guard(grad_out_in.device());
  at::Tensor dx = at::empty(grad_out_in.sizes(), grad_out_in.options());
  if (grad_out_in.numel() == 0) return dx;
  const bool scalar = grad_out_in.dim() == 0;
  const at::Tensor grad_out = rowable(scalar ? grad_out_in.reshape({1}) : grad_out_in);
  const at::Tensor out = rowable(scalar ? out_in.reshape({1}) : out_in);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad_out.scalar_type(), "dmfx_softcap_bwd_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    SoftcapArgs<scalar_t> a{};
    a.x = out.data_ptr<scalar_t>();
    a.xi = RowIndexer::of(out);
    a.grad = grad_out.data_ptr<scalar_t>();
    a.gi = RowIndexer::of(grad_out);
    a.out = dx.data_ptr<scalar_t>();
    a.cap = static_cast<acc_t>(cap);
    a.rows = num_rows(out);
    a.N = out.size(-1);
    launch_softcap<scalar_t>(true, a);
  });
  return dx;
}

std::vector<at::Tensor> rope_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                  const at::Tensor& sin, bool inverse, bool interleaved, bool deinterleave) {
  using namespace pointwise_impl;
  const std::vector<RopeSide> sides = check_rope("rope", q, k, cos, sin, interleaved, deinterleave, at::kCUDA);
  const c10::cuda::CUDAGuard device_guard(q.device());
  std::vector<at::Tensor> outs = {at::empty(q.sizes(), q.options()), at::empty(k.sizes(), k.options())};
  const int64_t rows = std::max(sides[0].rows, sides[1].rows);
  if (rows == 0) return outs;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "dmfx_rope_cuda", [&] {
    RopeArgs<scalar_t> a{};
    for (int i = 0; i < 2; ++i) {
      RopeJob<scalar_t>& jb = a.job[i];
      jb.rows = sides[i].rows;
      if (jb.rows == 0) continue;  // pointers stay null; the kernel's row loop does not run
      jb.x = sides[i].x.data_ptr<scalar_t>();
      jb.c = sides[i].cos.data_ptr<scalar_t>();
      jb.s = sides[i].sin.data_ptr<scalar_t>();
      jb.o = outs[i].data_ptr<scalar_t>();
      jb.xi = RowIndexer::of(sides[i].x);
      jb.ci = RowIndexer::of(sides[i].cos);
      jb.si = RowIndexer::of(sides[i].sin);
    }
    a.h = q.size(-1) / 2;
    a.inverse = inverse;
    a.interleaved = interleaved;
    a.deinterleave = deinterleave;
    const Plan p = plan_launch(a.h, rows, 2);
    rope_kernel<scalar_t><<<p.grid, p.block, 0, pw_stream()>>>(a);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return outs;
}

}  // namespace dmfx

// dmfx CUDA kernels: the fused "bias + dropout + residual + LayerNorm/RMSNorm" forward and backward
// and the standalone Philox dropout. norm_cpu.cpp is the specification: same arguments, checks,
// outputs and math; the dropout masks are bit-identical (same Philox mapping, dmfx_common.h).
//
// Design
// ------
// * Rows. Every tensor is seen as [rows, H] with unit stride on H (RowIndexer for strided leading
//   dims, exactly as on the CPU). One thread block handles one row at a time and loops over rows
//   with a grid stride; the grid is bounded by what fits on the device at once (occupancy), so the
//   per-block scratch buffers stay small.
// * Chunks. A row is split into H / VEC chunks of VEC contiguous elements (VEC = 16 bytes of scalar_t
//   when every row pointer is 16-byte aligned and H % VEC == 0, else VEC = 1). Thread t owns chunks
//   t, t + blockDim, t + 2 * blockDim, ... and is the only thread that ever touches those elements
//   of any per-block buffer. Hence the buffers need no barriers; the only cross-thread traffic is
//   the block reductions (warp shuffles + a 32-entry shared array).
// * Row buffers. The row values (forward: s; backward: xhat, g = dy * weight and the keep flags) are
//   kept in dynamic shared memory when they fit (up to the device's opt-in limit), else in a global
//   workspace slice per block. Element k of chunk c lives at [k * nchunks + c] ("SoA"), so a warp's
//   accesses are consecutive (no bank conflicts, coalesced in the global fallback).
// * Statistics: two passes over the buffered row (mean, then sum of squared deviations), in
//   at::opmath_type (float for half/bfloat16/float, double for double), like the CPU kernel.
// * Column sums of the backward (dweight, dnorm_bias, dbias): every block accumulates its rows into
//   its own partial row of a [ncols, grid, H] buffer (in shared memory while it runs when it fits,
//   copied out at the end), then col_reduce_kernel adds the grid partials in a fixed order (col_sum.cuh):
//   deterministic, no atomics.
// * Dropout: the element with logical index i = row * H + j (contiguous index for the standalone
//   kernel) is kept iff word (i & 3) of philox4x32_10(i >> 2, offset, seed) >= threshold.
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
#include <vector>

#include "dmfx_common.h"
#include "kernel_api.h"
#include "col_sum.cuh"

// Dynamic shared memory of the norm kernels (one declaration shared by all instantiations).
extern __shared__ __align__(16) unsigned char dmfx_smem[];

namespace dmfx {
namespace {

constexpr int kMaxThreads = 512;        // threads per block of the norm kernels (a multiple of 32)
constexpr int kDropoutThreads = 256;
constexpr size_t kStaticSmemReserve = 1024;  // static __shared__ of the norm kernels (<= 512 bytes)
constexpr size_t kDefaultSmem = 48 * 1024;   // dynamic shared memory usable without opting in

// ------------------------------------------------------------------------------------------------
// Device helpers
// ------------------------------------------------------------------------------------------------

template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

template <int N, typename T>
__device__ __forceinline__ Pack<T, N> load_pack(const T* p) {
  return *reinterpret_cast<const Pack<T, N>*>(p);
}

template <int N, typename T>
__device__ __forceinline__ void store_pack(T* p, const Pack<T, N>& v) {
  *reinterpret_cast<Pack<T, N>*>(p) = v;
}

__device__ __forceinline__ float dev_sqrt(float v) { return sqrtf(v); }
__device__ __forceinline__ double dev_sqrt(double v) { return sqrt(v); }

template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
  return v;  // xor butterfly: every lane holds the bit-identical total
}

// Sums a and b over the block; every thread gets both totals. blockDim.x must be a multiple of 32
// and every thread must call it. `scratch` holds 64 entries; the leading barrier makes it safe to
// call again right after a previous call (the previous readers are done).
template <typename T>
__device__ __forceinline__ void block_sum2(T& a, T& b, T* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  a = warp_sum(a);
  b = warp_sum(b);
  __syncthreads();
  if (lane == 0) {
    scratch[warp] = a;
    scratch[32 + warp] = b;
  }
  __syncthreads();
  a = lane < nwarps ? scratch[lane] : T(0);
  b = lane < nwarps ? scratch[32 + lane] : T(0);
  a = warp_sum(a);
  b = warp_sum(b);
}

template <typename T>
__device__ __forceinline__ T block_sum(T a, T* scratch) {
  T unused = T(0);
  block_sum2(a, unused, scratch);
  return a;
}

// Keep flags of the VEC elements with logical indices first .. first + VEC - 1, where
// first % VEC == 0 (VEC in {1, 2, 4, 8}). Same rule as fill_keep/dropout_impl on the CPU.
template <int VEC>
__device__ __forceinline__ void keep_flags(const DropoutParams& d, uint64_t first, bool (&keep)[VEC]) {
  static_assert(VEC == 1 || VEC == 2 || VEC == 4 || VEC == 8, "VEC must be 1, 2, 4 or 8");
  if (!d.active || d.drop_all) {
#pragma unroll
    for (int k = 0; k < VEC; ++k) keep[k] = !d.drop_all;
    return;
  }
  if constexpr (VEC % 4 == 0) {  // first is a multiple of 4: whole Philox groups
#pragma unroll
    for (int q = 0; q < VEC / 4; ++q) {
      const Philox4 r = philox4x32_10((first >> 2) + q, d.offset, d.seed);
      keep[4 * q + 0] = r.x >= d.threshold;
      keep[4 * q + 1] = r.y >= d.threshold;
      keep[4 * q + 2] = r.z >= d.threshold;
      keep[4 * q + 3] = r.w >= d.threshold;
    }
  } else {  // VEC in {1, 2} and first % VEC == 0: all VEC elements are in one group
    const Philox4 r = philox4x32_10(first >> 2, d.offset, d.seed);
#pragma unroll
    for (int k = 0; k < VEC; ++k)
      keep[k] = philox_word(r, static_cast<int>((first + k) & 3)) >= d.threshold;
  }
}

// s = dropout(x + bias) + residual for the VEC elements starting at column j0 of row `row`
// (same operation order as load_row in norm_cpu.cpp).
template <int VEC, typename scalar_t, typename acc_t>
__device__ __forceinline__ void load_sum(const scalar_t* xr, const scalar_t* bias, const scalar_t* rr,
                                         const DropoutParams& d, acc_t scale, uint64_t first,
                                         int64_t j0, acc_t (&s)[VEC], bool (&keep)[VEC]) {
  const Pack<scalar_t, VEC> xv = load_pack<VEC>(xr + j0);
#pragma unroll
  for (int k = 0; k < VEC; ++k) s[k] = static_cast<acc_t>(xv.v[k]);
  if (bias) {
    const Pack<scalar_t, VEC> bv = load_pack<VEC>(bias + j0);
#pragma unroll
    for (int k = 0; k < VEC; ++k) s[k] += static_cast<acc_t>(bv.v[k]);
  }
  keep_flags<VEC>(d, first, keep);
  if (d.active) {
#pragma unroll
    for (int k = 0; k < VEC; ++k) s[k] = keep[k] ? s[k] * scale : acc_t(0);
  }
  if (rr) {
    const Pack<scalar_t, VEC> rv = load_pack<VEC>(rr + j0);
#pragma unroll
    for (int k = 0; k < VEC; ++k) s[k] += static_cast<acc_t>(rv.v[k]);
  }
}

// ------------------------------------------------------------------------------------------------
// Forward
// ------------------------------------------------------------------------------------------------

template <typename scalar_t>
struct FwdArgs {
  using acc_t = at::opmath_type<scalar_t>;
  const scalar_t* x;
  RowIndexer xi;
  const scalar_t* res;  // nullable
  RowIndexer ri;
  const scalar_t* bias;       // nullable, [H]
  const scalar_t* weight;     // nullable, [H]
  const scalar_t* norm_bias;  // nullable, [H]
  scalar_t* out;              // [rows, H] contiguous
  scalar_t* sum;              // nullable, [rows, H] contiguous
  acc_t* mean;                // nullable (RMSNorm), [rows]
  acc_t* rstd;                // [rows]
  acc_t* ws;                  // [gridDim.x, H] row buffers when not in shared memory, else nullptr
  int64_t rows, H;
  acc_t eps, scale;
  DropoutParams drop;
  bool rms;
};

template <typename scalar_t, int VEC>
__global__ void __launch_bounds__(kMaxThreads) norm_fwd_kernel(const FwdArgs<scalar_t> a) {
  using acc_t = at::opmath_type<scalar_t>;
  __shared__ acc_t scratch[64];
  const int64_t H = a.H, nchunks = H / VEC;
  acc_t* const buf = a.ws ? a.ws + static_cast<int64_t>(blockIdx.x) * H
                          : reinterpret_cast<acc_t*>(dmfx_smem);
  for (int64_t r = blockIdx.x; r < a.rows; r += gridDim.x) {
    const scalar_t* xr = a.x + a.xi.offset(r);
    const scalar_t* rr = a.res ? a.res + a.ri.offset(r) : nullptr;
    const uint64_t row_first = static_cast<uint64_t>(r) * static_cast<uint64_t>(H);
    // Pass 1: s into the buffer; sum (LayerNorm) or sum of squares (RMSNorm).
    acc_t t1 = 0;
    for (int64_t c = threadIdx.x; c < nchunks; c += blockDim.x) {
      acc_t s[VEC];
      bool keep[VEC];
      load_sum<VEC>(xr, a.bias, rr, a.drop, a.scale, row_first + c * VEC, c * VEC, s, keep);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        buf[k * nchunks + c] = s[k];
        t1 += a.rms ? s[k] * s[k] : s[k];
      }
    }
    t1 = block_sum(t1, scratch);
    acc_t mu = 0, var = 0;
    if (a.rms) {
      var = t1 / static_cast<acc_t>(H);
    } else {
      mu = t1 / static_cast<acc_t>(H);
      // Pass 2: sum of squared deviations (each thread re-reads only its own elements).
      acc_t t2 = 0;
      for (int64_t c = threadIdx.x; c < nchunks; c += blockDim.x) {
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          const acc_t dev = buf[k * nchunks + c] - mu;
          t2 += dev * dev;
        }
      }
      t2 = block_sum(t2, scratch);
      var = t2 / static_cast<acc_t>(H);
    }
    const acc_t rs = acc_t(1) / dev_sqrt(var + a.eps);
    if (threadIdx.x == 0) {
      if (a.mean) a.mean[r] = mu;
      a.rstd[r] = rs;
    }
    // Pass 3: normalize, scale, shift; write out (and s).
    scalar_t* orow = a.out + r * H;
    scalar_t* srow = a.sum ? a.sum + r * H : nullptr;
    for (int64_t c = threadIdx.x; c < nchunks; c += blockDim.x) {
      const int64_t j0 = c * VEC;
      acc_t s[VEC];
#pragma unroll
      for (int k = 0; k < VEC; ++k) s[k] = buf[k * nchunks + c];
      Pack<scalar_t, VEC> o;
      Pack<scalar_t, VEC> wv, nbv;
      if (a.weight) wv = load_pack<VEC>(a.weight + j0);
      if (a.norm_bias) nbv = load_pack<VEC>(a.norm_bias + j0);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        acc_t y = (s[k] - mu) * rs;
        if (a.weight) y *= static_cast<acc_t>(wv.v[k]);
        if (a.norm_bias) y += static_cast<acc_t>(nbv.v[k]);
        o.v[k] = static_cast<scalar_t>(y);
      }
      store_pack<VEC>(orow + j0, o);
      if (srow) {
        Pack<scalar_t, VEC> sv;
#pragma unroll
        for (int k = 0; k < VEC; ++k) sv.v[k] = static_cast<scalar_t>(s[k]);
        store_pack<VEC>(srow + j0, sv);
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Backward
// ------------------------------------------------------------------------------------------------

template <typename scalar_t>
struct BwdArgs {
  using acc_t = at::opmath_type<scalar_t>;
  const scalar_t* dy;
  RowIndexer dyi;
  const scalar_t* dy2;  // nullable: a second incoming gradient, added to dy
  RowIndexer dy2i;
  const scalar_t* gsum;  // nullable
  RowIndexer gsi;
  const scalar_t* x;
  RowIndexer xi;
  const scalar_t* res;  // nullable
  RowIndexer ri;
  const scalar_t* bias;    // nullable, [H]
  const scalar_t* weight;  // nullable, [H]
  const acc_t* mean;       // nullable (RMSNorm), [rows]
  const acc_t* rstd;       // [rows]
  scalar_t* dx;            // nullable, [rows, H] contiguous
  scalar_t* dres;          // nullable, [rows, H] contiguous
  acc_t* partial;          // [ncols, gridDim.x, H] column partial sums (SoA within a row), or nullptr
  acc_t* ws_acc;           // [gridDim.x, 2H] xhat and g when not in shared memory, else nullptr
  uint8_t* ws_keep;        // [gridDim.x, H] keep flags when not in shared memory, else nullptr
  int64_t rows, H;
  acc_t scale;
  DropoutParams drop;
  int ncols;
  int col_dw, col_dnb, col_db;  // index into partial, or -1 when not requested
  bool rms, row_in_smem, cols_in_smem;
};

// Dynamic shared memory of the backward, in this order: [cols: ncols * H acc_t] when cols_in_smem,
// then [xhat: H acc_t][g: H acc_t][keep: H bytes] when row_in_smem.
template <typename scalar_t, int VEC>
__global__ void __launch_bounds__(kMaxThreads) norm_bwd_kernel(const BwdArgs<scalar_t> a) {
  using acc_t = at::opmath_type<scalar_t>;
  __shared__ acc_t scratch[64];
  const int64_t H = a.H, nchunks = H / VEC;
  const int64_t b = blockIdx.x;

  acc_t* sm = reinterpret_cast<acc_t*>(dmfx_smem);
  acc_t* cols = nullptr;  // column q of this block at cols + q * col_stride (SoA layout)
  int64_t col_stride = 0;
  if (a.ncols > 0) {
    if (a.cols_in_smem) {
      cols = sm;
      col_stride = H;
      sm += a.ncols * H;
    } else {
      cols = a.partial + b * H;
      col_stride = static_cast<int64_t>(gridDim.x) * H;
    }
  }
  acc_t* xh;
  uint8_t* kb;
  if (a.row_in_smem) {
    xh = sm;
    kb = reinterpret_cast<uint8_t*>(sm + 2 * H);
  } else {
    xh = a.ws_acc + b * 2 * H;
    kb = a.ws_keep + b * H;
  }
  acc_t* const gb = xh + H;

  // Zero this block's column partials (thread-owned elements, like everything below).
  if (cols) {
    for (int64_t c = threadIdx.x; c < nchunks; c += blockDim.x)
      for (int q = 0; q < a.ncols; ++q)
#pragma unroll
        for (int k = 0; k < VEC; ++k) cols[q * col_stride + k * nchunks + c] = acc_t(0);
  }
  acc_t* const cdw = a.col_dw >= 0 ? cols + a.col_dw * col_stride : nullptr;
  acc_t* const cdnb = a.col_dnb >= 0 ? cols + a.col_dnb * col_stride : nullptr;
  acc_t* const cdb = a.col_db >= 0 ? cols + a.col_db * col_stride : nullptr;

  for (int64_t r = b; r < a.rows; r += gridDim.x) {
    const scalar_t* xr = a.x + a.xi.offset(r);
    const scalar_t* rr = a.res ? a.res + a.ri.offset(r) : nullptr;
    const scalar_t* dyr = a.dy + a.dyi.offset(r);
    const scalar_t* dy2r = a.dy2 ? a.dy2 + a.dy2i.offset(r) : nullptr;
    const uint64_t row_first = static_cast<uint64_t>(r) * static_cast<uint64_t>(H);
    const acc_t mu = a.mean ? a.mean[r] : acc_t(0);
    const acc_t rs = a.rstd[r];
    // Pass 1: recompute s and xhat, g = dy * weight; row sums of g * xhat and g; dweight/dnorm_bias.
    acc_t t_gx = 0, t_g = 0;
    for (int64_t c = threadIdx.x; c < nchunks; c += blockDim.x) {
      const int64_t j0 = c * VEC;
      acc_t s[VEC];
      bool keep[VEC];
      load_sum<VEC>(xr, a.bias, rr, a.drop, a.scale, row_first + j0, j0, s, keep);
      const Pack<scalar_t, VEC> dyv = load_pack<VEC>(dyr + j0);
      Pack<scalar_t, VEC> dy2v;
      if (dy2r) dy2v = load_pack<VEC>(dy2r + j0);
      Pack<scalar_t, VEC> wv;
      if (a.weight) wv = load_pack<VEC>(a.weight + j0);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const int64_t idx = k * nchunks + c;
        const acc_t xhat = (s[k] - mu) * rs;
        const acc_t gy = dy2r ? static_cast<acc_t>(dyv.v[k]) + static_cast<acc_t>(dy2v.v[k])
                              : static_cast<acc_t>(dyv.v[k]);
        const acc_t gj = a.weight ? gy * static_cast<acc_t>(wv.v[k]) : gy;
        t_gx += gj * xhat;
        t_g += gj;
        xh[idx] = xhat;
        gb[idx] = gj;
        kb[idx] = keep[k] ? 1 : 0;
        if (cdw) cdw[idx] += gy * xhat;
        if (cdnb) cdnb[idx] += gy;
      }
    }
    block_sum2(t_gx, t_g, scratch);
    const acc_t c1 = t_gx / static_cast<acc_t>(H);
    const acc_t c2 = a.rms ? acc_t(0) : t_g / static_cast<acc_t>(H);
    // Pass 2: ds, dresidual, dx, dbias.
    const scalar_t* gsr = a.gsum ? a.gsum + a.gsi.offset(r) : nullptr;
    scalar_t* dxr = a.dx ? a.dx + r * H : nullptr;
    scalar_t* drr = a.dres ? a.dres + r * H : nullptr;
    for (int64_t c = threadIdx.x; c < nchunks; c += blockDim.x) {
      const int64_t j0 = c * VEC;
      Pack<scalar_t, VEC> gsv, dxv, drv;
      if (gsr) gsv = load_pack<VEC>(gsr + j0);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const int64_t idx = k * nchunks + c;
        acc_t ds = rs * (gb[idx] - c2 - xh[idx] * c1);
        if (gsr) ds += static_cast<acc_t>(gsv.v[k]);
        drv.v[k] = static_cast<scalar_t>(ds);
        const acc_t dxj = a.drop.active ? (kb[idx] ? ds * a.scale : acc_t(0)) : ds;
        dxv.v[k] = static_cast<scalar_t>(dxj);
        if (cdb) cdb[idx] += dxj;
      }
      if (drr) store_pack<VEC>(drr + j0, drv);
      if (dxr) store_pack<VEC>(dxr + j0, dxv);
    }
  }

  // Publish this block's column partials (same thread-owned elements, so no barrier is needed).
  if (cols && a.cols_in_smem) {
    const int64_t gstride = static_cast<int64_t>(gridDim.x) * H;
    for (int64_t c = threadIdx.x; c < nchunks; c += blockDim.x)
      for (int q = 0; q < a.ncols; ++q)
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          const int64_t idx = k * nchunks + c;
          a.partial[q * gstride + b * H + idx] = cols[q * col_stride + idx];
        }
  }
}

template <typename scalar_t>
struct ColReduceArgs {
  using acc_t = at::opmath_type<scalar_t>;
  const acc_t* src[3];  // [nblocks, H] partials in the SoA layout
  scalar_t* dst[3];     // [H]
  int64_t H, nchunks;
  int nblocks, vec;
};

// dst[q][j] = sum over blocks of src[q][block][pos(j)], added in a fixed order (deterministic;
// block_column_sum, col_sum.cuh). Thread x handles SoA position p (coalesced reads), blockIdx.y the
// output q.
template <typename scalar_t>
__global__ void __launch_bounds__(kColSumCols* kColSumRows) col_reduce_kernel(const ColReduceArgs<scalar_t> a) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t p = static_cast<int64_t>(blockIdx.x) * kColSumCols + threadIdx.x;
  const acc_t t = block_column_sum<acc_t>(p < a.H ? a.src[blockIdx.y] + p : nullptr, a.nblocks, a.H);
  if (threadIdx.y == 0 && p < a.H) {
    const int64_t k = p / a.nchunks, c = p % a.nchunks;  // p = k * nchunks + c, column c * vec + k
    a.dst[blockIdx.y][c * a.vec + k] = static_cast<scalar_t>(t);
  }
}

// ------------------------------------------------------------------------------------------------
// Standalone dropout
// ------------------------------------------------------------------------------------------------

// One thread per group of 4 elements (one Philox call), grid-stride. kVec4: x and out are aligned
// for 4-element packs.
template <typename scalar_t, bool kVec4>
__global__ void __launch_bounds__(kDropoutThreads)
    dropout_kernel(const scalar_t* __restrict__ x, scalar_t* __restrict__ out, int64_t n,
                   const DropoutParams d, at::opmath_type<scalar_t> scale) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t ngroups = (n + 3) / 4;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; g < ngroups; g += stride) {
    bool keep[4];
    if (!d.active) {
      keep[0] = keep[1] = keep[2] = keep[3] = true;  // threshold 0: every word passes
    } else if (d.drop_all) {
      keep[0] = keep[1] = keep[2] = keep[3] = false;
    } else {
      const Philox4 r = philox4x32_10(static_cast<uint64_t>(g), d.offset, d.seed);
      keep[0] = r.x >= d.threshold;
      keep[1] = r.y >= d.threshold;
      keep[2] = r.z >= d.threshold;
      keep[3] = r.w >= d.threshold;
    }
    const int64_t i0 = g * 4;
    if (kVec4 && i0 + 4 <= n) {
      const Pack<scalar_t, 4> xv = load_pack<4>(x + i0);
      Pack<scalar_t, 4> ov;
#pragma unroll
      for (int k = 0; k < 4; ++k)
        ov.v[k] = keep[k] ? static_cast<scalar_t>(static_cast<acc_t>(xv.v[k]) * scale) : scalar_t(0);
      store_pack<4>(out + i0, ov);
    } else {
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int64_t i = i0 + k;
        if (i < n)
          out[i] = keep[k] ? static_cast<scalar_t>(static_cast<acc_t>(x[i]) * scale) : scalar_t(0);
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Host helpers
// ------------------------------------------------------------------------------------------------

template <typename T>
T* ptr_or_null(const c10::optional<at::Tensor>& t) {
  return (t.has_value() && t->defined()) ? t->data_ptr<T>() : nullptr;
}

RowIndexer indexer_or_default(const c10::optional<at::Tensor>& t) {
  return (t.has_value() && t->defined()) ? RowIndexer::of(*t) : RowIndexer{};
}

bool aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// Rows of `t` (seen through `ri`) can be read in packs of `vec` elements of `elem` bytes.
bool rows_vec_ok(const void* data, const RowIndexer& ri, int vec, size_t elem) {
  if (data == nullptr) return true;
  if (!aligned(data, vec * elem)) return false;
  for (int d = 0; d < ri.nd; ++d)
    if (ri.strides[d] % vec != 0) return false;
  return true;
}

bool vec_ptr_ok(const void* data, int vec, size_t elem) {
  return data == nullptr || aligned(data, vec * elem);
}

int norm_block_threads(int64_t nchunks) {
  const int64_t t = (nchunks + 31) / 32 * 32;
  return static_cast<int>(std::min<int64_t>(std::max<int64_t>(t, 32), kMaxThreads));
}

// Device attributes of the current device (the CUDAGuard in the entry points selects x's device).
// cudaDeviceGetAttribute is cheap; ATen/cuda/CUDAContext.h (getCurrentDeviceProperties) is avoided
// on purpose: it drags in cuSPARSE/cuBLAS/cuSOLVER headers, which a bare CUDA toolkit lacks.
int device_attribute(cudaDeviceAttr attr) {
  int value = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&value, attr, c10::cuda::current_device()));
  return value;
}

// Dynamic shared memory one block of a norm kernel may use (opt-in maximum less the static part).
size_t smem_limit() {
  const size_t optin = std::max<size_t>(
      static_cast<size_t>(device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin)), kDefaultSmem);
  return optin - kStaticSmemReserve;
}

int sm_count() { return std::max(device_attribute(cudaDevAttrMultiProcessorCount), 1); }

cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

// Allows `smem` bytes of dynamic shared memory for `kernel` and returns the grid: at most `rows`
// blocks, at most as many as are resident at once (and at most `cap_per_sm` per SM when > 0).
template <typename Kernel>
int64_t prepare_grid(Kernel kernel, int threads, size_t smem, int64_t rows, int cap_per_sm) {
  if (smem > kDefaultSmem) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(smem)));
  }
  int per_sm = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem));
  per_sm = std::max(per_sm, 1);
  if (cap_per_sm > 0) per_sm = std::min(per_sm, cap_per_sm);
  return std::max<int64_t>(1, std::min<int64_t>(rows, static_cast<int64_t>(sm_count()) * per_sm));
}

template <typename scalar_t>
at::ScalarType acc_dtype() {
  return std::is_same<at::opmath_type<scalar_t>, double>::value ? at::kDouble : at::kFloat;
}

template <typename scalar_t, int VEC>
void launch_norm_fwd(FwdArgs<scalar_t> args, const at::Tensor& x) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t H = args.H;
  const int threads = norm_block_threads(H / VEC);
  const size_t row_bytes = static_cast<size_t>(H) * sizeof(acc_t);
  const bool in_smem = row_bytes <= smem_limit();
  const size_t smem = in_smem ? row_bytes : 0;
  auto kernel = norm_fwd_kernel<scalar_t, VEC>;
  // Global row buffers: keep the grid (and the workspace) small.
  const int64_t grid = prepare_grid(kernel, threads, smem, args.rows, in_smem ? 0 : 2);
  at::Tensor ws;
  if (!in_smem) {
    ws = at::empty({grid, H}, x.options().dtype(acc_dtype<scalar_t>()));
    args.ws = ws.data_ptr<acc_t>();
  } else {
    args.ws = nullptr;
  }
  kernel<<<static_cast<unsigned>(grid), threads, smem, current_stream()>>>(args);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename scalar_t, int VEC>
void launch_norm_bwd(BwdArgs<scalar_t> args, const at::Tensor& x, NormGrads& g) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t H = args.H;
  const int threads = norm_block_threads(H / VEC);
  const size_t limit = smem_limit();
  const size_t row_bytes = (static_cast<size_t>(H) * (2 * sizeof(acc_t) + 1) + 15) / 16 * 16;
  const size_t col_bytes = static_cast<size_t>(args.ncols) * static_cast<size_t>(H) * sizeof(acc_t);
  const bool row_in = row_bytes <= limit;
  const bool cols_in = row_in && args.ncols > 0 && row_bytes + col_bytes <= limit;
  const size_t smem = (row_in ? row_bytes : 0) + (cols_in ? col_bytes : 0);
  args.row_in_smem = row_in;
  args.cols_in_smem = cols_in;
  auto kernel = norm_bwd_kernel<scalar_t, VEC>;
  const int64_t grid = prepare_grid(kernel, threads, smem, args.rows, row_in ? 0 : 2);
  const auto acc_opts = x.options().dtype(acc_dtype<scalar_t>());
  at::Tensor partial, ws_acc, ws_keep;
  args.partial = nullptr;
  args.ws_acc = nullptr;
  args.ws_keep = nullptr;
  if (args.ncols > 0) {
    partial = at::empty({args.ncols, grid, H}, acc_opts);
    args.partial = partial.data_ptr<acc_t>();
  }
  if (!row_in) {
    ws_acc = at::empty({grid, 2 * H}, acc_opts);
    ws_keep = at::empty({grid, H}, x.options().dtype(at::kByte));
    args.ws_acc = ws_acc.data_ptr<acc_t>();
    args.ws_keep = ws_keep.data_ptr<uint8_t>();
  }
  const cudaStream_t stream = current_stream();
  kernel<<<static_cast<unsigned>(grid), threads, smem, stream>>>(args);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (args.ncols > 0) {
    ColReduceArgs<scalar_t> ra{};
    at::Tensor* dst[3] = {nullptr, nullptr, nullptr};
    if (args.col_dw >= 0) dst[args.col_dw] = &g.dweight;
    if (args.col_dnb >= 0) dst[args.col_dnb] = &g.dnorm_bias;
    if (args.col_db >= 0) dst[args.col_db] = &g.dbias;
    for (int q = 0; q < args.ncols; ++q) {
      ra.src[q] = args.partial + static_cast<int64_t>(q) * grid * H;
      ra.dst[q] = dst[q]->data_ptr<scalar_t>();
    }
    ra.H = H;
    ra.nchunks = H / VEC;
    ra.nblocks = static_cast<int>(grid);
    ra.vec = VEC;
    const dim3 rblock(kColSumCols, kColSumRows);
    const dim3 rgrid(static_cast<unsigned>((H + kColSumCols - 1) / kColSumCols), static_cast<unsigned>(args.ncols));
    col_reduce_kernel<scalar_t><<<rgrid, rblock, 0, stream>>>(ra);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

void check_on_device(const char* op, const char* name, const c10::optional<at::Tensor>& t,
                     const at::Tensor& x) {
  if (!present(t)) return;
  TORCH_CHECK(t->device() == x.device(), "dmfx::", op, ": ", name, " is on ", t->device(),
              " but x is on ", x.device());
}

}  // namespace

// ------------------------------------------------------------------------------------------------
// Entry points (same signatures and checks as the CPU versions in norm_cpu.cpp)
// ------------------------------------------------------------------------------------------------

std::vector<at::Tensor> norm_fwd_cuda(const at::Tensor& x_in, const c10::optional<at::Tensor>& bias_in,
                                      const c10::optional<at::Tensor>& residual_in,
                                      const c10::optional<at::Tensor>& weight_in,
                                      const c10::optional<at::Tensor>& norm_bias_in, int64_t seed,
                                      int64_t offset, double p, double eps, bool rms,
                                      bool return_sum) {
  const NormArgs a = check_norm_args("norm_fwd", x_in, bias_in, residual_in, weight_in,
                                     norm_bias_in, p, eps, rms, seed, offset, at::kCUDA);
  const c10::cuda::CUDAGuard device_guard(x_in.device());
  const at::Tensor x = rowable(x_in);
  const auto residual = rowable(residual_in);
  const auto bias = contiguous(bias_in), weight = contiguous(weight_in),
             norm_bias = contiguous(norm_bias_in);
  auto outs = alloc_norm_outputs(x, a, return_sum);
  if (a.rows == 0) return outs;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "dmfx_norm_fwd_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    FwdArgs<scalar_t> args{};
    args.x = x.data_ptr<scalar_t>();
    args.xi = RowIndexer::of(x);
    args.res = ptr_or_null<scalar_t>(residual);
    args.ri = indexer_or_default(residual);
    args.bias = ptr_or_null<scalar_t>(bias);
    args.weight = ptr_or_null<scalar_t>(weight);
    args.norm_bias = ptr_or_null<scalar_t>(norm_bias);
    args.out = outs[0].data_ptr<scalar_t>();
    args.sum = return_sum ? outs[1].data_ptr<scalar_t>() : nullptr;
    args.mean = a.rms ? nullptr : outs[2].data_ptr<acc_t>();
    args.rstd = outs[3].data_ptr<acc_t>();
    args.ws = nullptr;
    args.rows = a.rows;
    args.H = a.H;
    args.eps = static_cast<acc_t>(a.eps);
    args.scale = static_cast<acc_t>(a.scale);
    args.drop = a.dropout;
    args.rms = a.rms;
    constexpr int kVec = static_cast<int>(16 / sizeof(scalar_t));
    const size_t es = sizeof(scalar_t);
    const bool vec_ok = a.H % kVec == 0 && rows_vec_ok(args.x, args.xi, kVec, es) &&
                        rows_vec_ok(args.res, args.ri, kVec, es) && vec_ptr_ok(args.bias, kVec, es) &&
                        vec_ptr_ok(args.weight, kVec, es) && vec_ptr_ok(args.norm_bias, kVec, es) &&
                        vec_ptr_ok(args.out, kVec, es) && vec_ptr_ok(args.sum, kVec, es);
    if (vec_ok) {
      launch_norm_fwd<scalar_t, kVec>(args, x);
    } else {
      launch_norm_fwd<scalar_t, 1>(args, x);
    }
  });
  return outs;
}

std::vector<at::Tensor> norm_bwd_cuda(const at::Tensor& grad_out_in,
                                      const c10::optional<at::Tensor>& grad_sum_in,
                                      const at::Tensor& x_in,
                                      const c10::optional<at::Tensor>& bias_in,
                                      const c10::optional<at::Tensor>& residual_in,
                                      const c10::optional<at::Tensor>& weight_in,
                                      const c10::optional<at::Tensor>& mean_in,
                                      const at::Tensor& rstd_in, int64_t seed, int64_t offset,
                                      double p, bool rms, std::vector<bool> output_mask,
                                      const c10::optional<at::Tensor>& grad_out2_in) {
  const NormArgs a = check_norm_bwd_args("norm_bwd", grad_out_in, grad_out2_in, grad_sum_in, x_in, bias_in,
                                         residual_in, weight_in, mean_in, rstd_in, p, rms, seed,
                                         offset, output_mask, at::kCUDA);
  // The saved statistics are dereferenced by the kernel: they must live on x's device too.
  TORCH_CHECK(rstd_in.device() == x_in.device(), "dmfx::norm_bwd: rstd is on ", rstd_in.device(),
              " but x is on ", x_in.device());
  if (!rms) check_on_device("norm_bwd", "mean", mean_in, x_in);
  const c10::cuda::CUDAGuard device_guard(x_in.device());
  const at::Tensor x = rowable(x_in), grad_out = rowable(grad_out_in), rstd = rstd_in.contiguous();
  const auto residual = rowable(residual_in), grad_sum = rowable(grad_sum_in),
             grad_out2 = rowable(grad_out2_in);
  const auto bias = contiguous(bias_in), weight = contiguous(weight_in), mean = contiguous(mean_in);
  NormGrads g = alloc_norm_grads(x, bias, weight, a, output_mask);
  if (a.rows == 0) {
    zero_param_grads(g);
    return g.as_list();
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "dmfx_norm_bwd_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    BwdArgs<scalar_t> args{};
    args.dy = grad_out.data_ptr<scalar_t>();
    args.dyi = RowIndexer::of(grad_out);
    args.dy2 = ptr_or_null<scalar_t>(grad_out2);
    args.dy2i = indexer_or_default(grad_out2);
    args.gsum = ptr_or_null<scalar_t>(grad_sum);
    args.gsi = indexer_or_default(grad_sum);
    args.x = x.data_ptr<scalar_t>();
    args.xi = RowIndexer::of(x);
    args.res = ptr_or_null<scalar_t>(residual);
    args.ri = indexer_or_default(residual);
    args.bias = ptr_or_null<scalar_t>(bias);
    args.weight = ptr_or_null<scalar_t>(weight);
    args.mean = a.rms ? nullptr : mean->data_ptr<acc_t>();
    args.rstd = rstd.data_ptr<acc_t>();
    args.dx = g.dx.defined() ? g.dx.data_ptr<scalar_t>() : nullptr;
    args.dres = g.dresidual.defined() ? g.dresidual.data_ptr<scalar_t>() : nullptr;
    args.rows = a.rows;
    args.H = a.H;
    args.scale = static_cast<acc_t>(a.scale);
    args.drop = a.dropout;
    args.rms = a.rms;
    int ncols = 0;
    args.col_dw = g.dweight.defined() ? ncols++ : -1;
    args.col_dnb = g.dnorm_bias.defined() ? ncols++ : -1;
    args.col_db = g.dbias.defined() ? ncols++ : -1;
    args.ncols = ncols;
    constexpr int kVec = static_cast<int>(16 / sizeof(scalar_t));
    const size_t es = sizeof(scalar_t);
    const bool vec_ok = a.H % kVec == 0 && rows_vec_ok(args.dy, args.dyi, kVec, es) &&
                        rows_vec_ok(args.dy2, args.dy2i, kVec, es) &&
                        rows_vec_ok(args.gsum, args.gsi, kVec, es) &&
                        rows_vec_ok(args.x, args.xi, kVec, es) &&
                        rows_vec_ok(args.res, args.ri, kVec, es) && vec_ptr_ok(args.bias, kVec, es) &&
                        vec_ptr_ok(args.weight, kVec, es) && vec_ptr_ok(args.dx, kVec, es) &&
                        vec_ptr_ok(args.dres, kVec, es);
    if (vec_ok) {
      launch_norm_bwd<scalar_t, kVec>(args, x, g);
    } else {
      launch_norm_bwd<scalar_t, 1>(args, x, g);
    }
  });
  return g.as_list();
}

at::Tensor dropout_cuda(const at::Tensor& x_in, int64_t seed, int64_t offset, double p) {
  check_dropout_args("dropout", x_in, p, at::kCUDA);
  const c10::cuda::CUDAGuard device_guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  const DropoutParams d = make_dropout_params(p, seed, offset);
  const int64_t n = x.numel();
  if (n == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "dmfx_dropout_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const acc_t scale = static_cast<acc_t>(d.scale);
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t ngroups = (n + 3) / 4;
    const int64_t max_blocks = static_cast<int64_t>(sm_count()) * (2048 / kDropoutThreads) * 4;
    const int64_t blocks = std::min<int64_t>((ngroups + kDropoutThreads - 1) / kDropoutThreads, max_blocks);
    const cudaStream_t stream = current_stream();
    const size_t pack = 4 * sizeof(scalar_t);
    if (aligned(xp, pack) && aligned(op, pack)) {
      dropout_kernel<scalar_t, true><<<static_cast<unsigned>(blocks), kDropoutThreads, 0, stream>>>(
          xp, op, n, d, scale);
    } else {
      dropout_kernel<scalar_t, false><<<static_cast<unsigned>(blocks), kDropoutThreads, 0, stream>>>(
          xp, op, n, d, scale);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

}  // namespace dmfx

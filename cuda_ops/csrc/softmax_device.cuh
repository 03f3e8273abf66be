// Device helpers of the CUDA attention softmax (softmax_cuda.cu), shared with the fused attention
// kernels (attention_cuda.cu): packed loads, the NaN-propagating max, exp, warp and block reductions,
// the Philox dropout multipliers and mask reads, and the stream kernels launch on. Both .cu files
// include this header, so each compiles on its own (build.py concatenates them into one CUDA
// translation unit; tests/cuda_emu emulates each family's file alone).
#pragma once
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <limits>

#include "dmfx_common.h"
#include "kernel_api.h"
#include "softmax_api.h"

namespace dmfx {
namespace softmax_impl {

// ------------------------------------------------------------------------------------------------
// Device helpers
// ------------------------------------------------------------------------------------------------

template <typename T, int N>
struct alignas(sizeof(T) * N) SmPack {
  T v[N];
};

template <typename T>
__device__ __forceinline__ T sm_neg_inf() {
  return -std::numeric_limits<T>::infinity();
}

// max that propagates NaN from either side (fmaxf would drop it).
template <typename T>
__device__ __forceinline__ T sm_nan_max(T a, T b) {
  return (a != a || a > b) ? a : b;
}

__device__ __forceinline__ float sm_exp(float x) { return expf(x); }
__device__ __forceinline__ double sm_exp(double x) { return exp(x); }

template <typename T>
__device__ __forceinline__ T sm_warp_sum(T v) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
  return v;
}

template <typename T>
__device__ __forceinline__ T sm_warp_max(T v) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) v = sm_nan_max(v, __shfl_xor_sync(0xffffffffu, v, m));
  return v;
}

// Block-wide sum / max; every thread gets the result. All threads of the block must call it;
// blockDim.x is a multiple of 32. The leading barrier makes back-to-back calls safe.
template <typename T>
__device__ __forceinline__ T sm_block_sum(T v, T* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  v = sm_warp_sum(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < nwarps ? scratch[lane] : T(0);
  return sm_warp_sum(v);
}

template <typename T>
__device__ __forceinline__ T sm_block_max(T v, T* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  v = sm_warp_max(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < nwarps ? scratch[lane] : sm_neg_inf<T>();
  return sm_warp_max(v);
}

// Dropout multiplier (0 or keep_scale) of the element with logical index idx.
template <typename acc_t>
__device__ __forceinline__ acc_t sm_mult(const DropoutParams& d, acc_t keep_scale, uint64_t idx) {
  if (!d.active) return acc_t(1);
  if (d.drop_all) return acc_t(0);
  const Philox4 r = philox4x32_10(idx >> 2, d.offset, d.seed);
  return philox_word(r, static_cast<int>(idx & 3)) >= d.threshold ? keep_scale : acc_t(0);
}

// Multipliers of the 4 elements first .. first + 3, first % 4 == 0 (one Philox call).
template <typename acc_t>
__device__ __forceinline__ void sm_mult4(const DropoutParams& d, acc_t keep_scale, uint64_t first,
                                         acc_t (&m)[4]) {
  if (!d.active || d.drop_all) {
#pragma unroll
    for (int k = 0; k < 4; ++k) m[k] = d.drop_all ? acc_t(0) : acc_t(1);
    return;
  }
  const Philox4 r = philox4x32_10(first >> 2, d.offset, d.seed);
  m[0] = r.x >= d.threshold ? keep_scale : acc_t(0);
  m[1] = r.y >= d.threshold ? keep_scale : acc_t(0);
  m[2] = r.z >= d.threshold ? keep_scale : acc_t(0);
  m[3] = r.w >= d.threshold ? keep_scale : acc_t(0);
}

template <int VEC, typename acc_t>
__device__ __forceinline__ void sm_mults(const DropoutParams& d, acc_t keep_scale, uint64_t first,
                                         acc_t (&m)[VEC]) {
  if constexpr (VEC == 4) {
    sm_mult4(d, keep_scale, first, m);
  } else {
#pragma unroll
    for (int k = 0; k < VEC; ++k) m[k] = sm_mult(d, keep_scale, first + k);
  }
}

struct MaskPtr {
  const void* data = nullptr;  // nullptr: no mask
  int kind = kNoMask;
  int64_t col_stride = 0;
  RowIndexer idx;
};

// Mask contribution of element j of the mask row starting at element offset `off`.
template <typename scalar_t, typename acc_t>
__device__ __forceinline__ acc_t sm_mask_at(const MaskPtr& m, int64_t off, int64_t j) {
  const int64_t e = off + j * m.col_stride;
  switch (m.kind) {
    case kMaskSame: return static_cast<acc_t>(static_cast<const scalar_t*>(m.data)[e]);
    case kMaskFloat: return static_cast<acc_t>(static_cast<const float*>(m.data)[e]);
    case kMaskBool: return static_cast<const bool*>(m.data)[e] ? acc_t(0) : sm_neg_inf<acc_t>();
    default: return acc_t(0);
  }
}

// The stream every dmfx softmax / attention kernel launches on: PyTorch's current one.
inline cudaStream_t sm_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

}  // namespace softmax_impl
}  // namespace dmfx

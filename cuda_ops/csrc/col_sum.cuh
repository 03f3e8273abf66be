// Column sums in a fixed order, the device helper of the CUDA kernels that reduce per-block (or
// per-thread-row) partial rows into a gradient over columns: the norm backward's col_reduce_kernel
// (dweight, dnorm_bias, dbias; norm_cuda.cu) and the pointwise backward's col_sum_kernel (the bias
// gradient; pointwise_cuda.cu). Both .cu files include this header, so each compiles on its own
// (tests/cuda_emu emulates each family's file alone, with the .cuh files it includes).
//
// A block of kColSumCols x kColSumRows threads owns kColSumCols neighbouring columns (a warp reads
// 32 neighbouring entries of a partial row: coalesced). Thread row y sums the partial rows
// y, y + kColSumRows, ... in turn; thread row 0 then adds the kColSumRows sums in order. The order is
// the same at every launch, whatever the grid: deterministic, no atomics. Splitting the rows across
// the block's thread rows is what keeps the sum from being latency-bound: with one thread per column
// summing up to 1024 partial rows in turn, the FFN bias of BERT (3072 columns) ran on 12 blocks and
// took 62 us a call on an H200 (bench/RESULTS.md, 2026-12-04 evening).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace dmfx {

constexpr int kColSumCols = 32;  // blockDim.x of a column-sum kernel
constexpr int kColSumRows = 16;  // blockDim.y

// The sum over r < nrows of col[r * stride], added in the fixed order above, for the column `col`
// points at (row 0's entry; null where the thread has no column: it adds nothing). Every thread of a
// (kColSumCols, kColSumRows) block calls it, with the block's columns at threadIdx.x (it synchronizes
// the block, so the calls must be block-uniform). The sum is returned in thread row 0; the other rows
// get 0. The block may call it again (for its next columns) as soon as it returns.
template <typename acc_t>
__device__ __forceinline__ acc_t block_column_sum(const acc_t* col, int64_t nrows, int64_t stride) {
  __shared__ acc_t part[kColSumRows][kColSumCols];
  const int tx = threadIdx.x, ty = threadIdx.y;
  acc_t s = 0;
  if (col != nullptr)
    for (int64_t r = ty; r < nrows; r += kColSumRows) s += col[r * stride];
  part[ty][tx] = s;
  __syncthreads();
  acc_t t = 0;
  if (ty == 0) {
#pragma unroll
    for (int i = 0; i < kColSumRows; ++i) t += part[i][tx];
  }
  __syncthreads();  // (part is rewritten by the block's next call)
  return t;
}

}  // namespace dmfx

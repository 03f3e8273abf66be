// dmfx CUDA kernels of the fused attention softmax. softmax_cpu.cpp is the specification: same
// arguments, checks (softmax_api.h), outputs and math; the dropout masks are bit-identical (same
// Philox mapping: element with logical index row * Sk + j uses word (idx & 3) of
// philox4x32_10(idx >> 2, offset, seed), dmfx_common.h).
//
// Design (kept simple on purpose: this code was compiled, never run, by its author)
// ------
// * Sk <= 1024: one warp per row, the row in registers. Lane `lane` owns chunks c = t * 32 + lane
//   (t < N / VEC) of VEC consecutive elements; VEC = 4 when Sk % 4 == 0 and every row pointer is
//   aligned to 4 elements (one 128-bit load for fp32, one Philox call per chunk), else VEC = 1.
//   N (elements per lane) is 8 for Sk <= 256 and 32 for Sk <= 1024. Max and sum are warp
//   butterflies (every lane gets the same total). Several warps (rows) share a block; nothing is
//   shared between them, so there is no __syncthreads in these kernels.
// * Sk > 1024: one block per row (grid-stride over rows), three passes over global memory
//   (max, sum of exp, write), each element recomputed from scores + mask; block reductions through
//   a 32-entry shared array. Philox is evaluated per element (4x redundant, simple).
// * Math in at::opmath_type (fp32 for half/bfloat16/float, fp64 for double); expf / exp (not the
//   fast __expf, whose error grows with |x|). max propagates NaN like eager; a row whose max is
//   -inf (fully masked) is written as zeros.
#include <ATen/ATen.h>
#include <torch/library.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "dmfx_common.h"
#include "kernel_api.h"
#include "softmax_api.h"
#include "softmax_device.cuh"

namespace dmfx {
namespace softmax_impl {

constexpr int kWarpsPerBlock = 4;    // rows per block of the warp kernels (128 threads)
constexpr int kBlockThreads = 512;   // threads of the block-per-row kernels
constexpr int kMaxWarpSk = 1024;     // longest row of the warp kernels (32 lanes x 32 elements)
constexpr int64_t kMaxGrid = 1 << 20;

template <typename scalar_t>
struct FwdParams {
  const scalar_t* scores;
  RowIndexer si;
  MaskPtr mask;
  scalar_t* out;    // [rows, Sk] contiguous
  scalar_t* probs;  // [rows, Sk] contiguous, nullptr without dropout
  SoftmaxArgs a;
};

template <typename scalar_t>
struct BwdParams {
  const scalar_t* grad_out;
  RowIndexer gi;
  const scalar_t* probs;
  RowIndexer pi;
  scalar_t* grad;  // [rows, Sk] contiguous
  const bool* keep;  // a stored dropout mask (native_dropout's), or null
  RowIndexer ki;
  double mask_scale;
  SoftmaxArgs a;
};

// ------------------------------------------------------------------------------------------------
// Forward, one warp per row (Sk <= 1024)
// ------------------------------------------------------------------------------------------------

template <typename scalar_t, int N, int VEC>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
softmax_fwd_warp_kernel(const FwdParams<scalar_t> P) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr int T = N / VEC;  // chunks per lane
  const int lane = threadIdx.x & 31;
  const int64_t Sk = P.a.Sk;
  const acc_t scale = static_cast<acc_t>(P.a.scale);
  const acc_t keep_scale = static_cast<acc_t>(P.a.keep_scale);
  const bool dropout = P.a.dropout.active;
  const int64_t first_row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  const int64_t row_step = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  for (int64_t row = first_row; row < P.a.rows; row += row_step) {  // uniform per warp
    const int64_t lim = causal_limit(P.a, row);  // elements lim.. are masked out
    const scalar_t* srow = P.scores + P.si.offset(row);
    const int64_t moff = P.mask.data ? P.mask.idx.offset(row) : 0;
    acc_t z[T][VEC];
    acc_t mx = sm_neg_inf<acc_t>();
#pragma unroll
    for (int t = 0; t < T; ++t) {
      const int64_t j0 = (static_cast<int64_t>(t) * 32 + lane) * VEC;
      if (j0 < Sk) {  // with VEC = 4, Sk % 4 == 0: the whole chunk is in the row
        const SmPack<scalar_t, VEC> sv = *reinterpret_cast<const SmPack<scalar_t, VEC>*>(srow + j0);
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          const int64_t j = j0 + k;
          acc_t v = sm_neg_inf<acc_t>();
          if (j < lim) {
            v = static_cast<acc_t>(sv.v[k]) * scale;
            if (P.mask.data) v += sm_mask_at<scalar_t, acc_t>(P.mask, moff, j);
          }
          z[t][k] = v;
          mx = sm_nan_max(mx, v);
        }
      } else {
#pragma unroll
        for (int k = 0; k < VEC; ++k) z[t][k] = sm_neg_inf<acc_t>();
      }
    }
    mx = sm_warp_max(mx);
    const bool empty = !(mx != sm_neg_inf<acc_t>());  // fully masked row (NaN is not "empty")
    acc_t sum = 0;
    if (!empty) {
#pragma unroll
      for (int t = 0; t < T; ++t) {
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          // exp(-inf - mx) = 0 for masked elements and padding; NaN stays NaN.
          const acc_t e = sm_exp(z[t][k] - mx);
          z[t][k] = e;
          sum += e;
        }
      }
      sum = sm_warp_sum(sum);
    }
    const acc_t inv = empty ? acc_t(0) : acc_t(1) / sum;
    scalar_t* orow = P.out + row * Sk;
    scalar_t* prow = P.probs ? P.probs + row * Sk : nullptr;
#pragma unroll
    for (int t = 0; t < T; ++t) {
      const int64_t j0 = (static_cast<int64_t>(t) * 32 + lane) * VEC;
      if (j0 < Sk) {
        acc_t mult[VEC];
        sm_mults<VEC>(P.a.dropout, keep_scale, static_cast<uint64_t>(row * Sk + j0), mult);
        SmPack<scalar_t, VEC> ov, pv;
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          const acc_t pk = empty ? acc_t(0) : z[t][k] * inv;
          pv.v[k] = static_cast<scalar_t>(pk);
          ov.v[k] = static_cast<scalar_t>(dropout ? pk * mult[k] : pk);
        }
        *reinterpret_cast<SmPack<scalar_t, VEC>*>(orow + j0) = ov;
        if (prow) *reinterpret_cast<SmPack<scalar_t, VEC>*>(prow + j0) = pv;
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Forward, one block per row (Sk > 1024)
// ------------------------------------------------------------------------------------------------

template <typename scalar_t, typename acc_t>
__device__ __forceinline__ acc_t sm_logit(const FwdParams<scalar_t>& P, const scalar_t* srow,
                                          int64_t moff, acc_t scale, int64_t j) {
  acc_t v = static_cast<acc_t>(srow[j]) * scale;
  if (P.mask.data) v += sm_mask_at<scalar_t, acc_t>(P.mask, moff, j);
  return v;
}

template <typename scalar_t>
__global__ void __launch_bounds__(kBlockThreads) softmax_fwd_block_kernel(const FwdParams<scalar_t> P) {
  using acc_t = at::opmath_type<scalar_t>;
  __shared__ acc_t scratch[32];
  const int64_t Sk = P.a.Sk;
  const acc_t scale = static_cast<acc_t>(P.a.scale);
  const acc_t keep_scale = static_cast<acc_t>(P.a.keep_scale);
  const bool dropout = P.a.dropout.active;
  for (int64_t row = blockIdx.x; row < P.a.rows; row += gridDim.x) {  // uniform per block
    const int64_t lim = causal_limit(P.a, row);
    const scalar_t* srow = P.scores + P.si.offset(row);
    const int64_t moff = P.mask.data ? P.mask.idx.offset(row) : 0;
    acc_t mx = sm_neg_inf<acc_t>();
    for (int64_t j = threadIdx.x; j < lim; j += blockDim.x) mx = sm_nan_max(mx, sm_logit(P, srow, moff, scale, j));
    mx = sm_block_max(mx, scratch);
    const bool empty = !(mx != sm_neg_inf<acc_t>());
    acc_t sum = 0;
    for (int64_t j = threadIdx.x; j < lim; j += blockDim.x) sum += sm_exp(sm_logit(P, srow, moff, scale, j) - mx);
    sum = sm_block_sum(sum, scratch);
    const acc_t inv = empty ? acc_t(0) : acc_t(1) / sum;
    scalar_t* orow = P.out + row * Sk;
    scalar_t* prow = P.probs ? P.probs + row * Sk : nullptr;
    for (int64_t j = threadIdx.x; j < Sk; j += blockDim.x) {
      // masked-out tail: 0 * inv, i.e. 0, or NaN in a NaN row (as eager and the warp kernel give)
      const acc_t pj = empty ? acc_t(0) : (j >= lim ? acc_t(0) : sm_exp(sm_logit(P, srow, moff, scale, j) - mx)) * inv;
      if (prow) prow[j] = static_cast<scalar_t>(pj);
      const acc_t oj = dropout ? pj * sm_mult(P.a.dropout, keep_scale, static_cast<uint64_t>(row * Sk + j)) : pj;
      orow[j] = static_cast<scalar_t>(oj);
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Backward
// ------------------------------------------------------------------------------------------------

template <typename scalar_t, int N, int VEC>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
softmax_bwd_warp_kernel(const BwdParams<scalar_t> P) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr int T = N / VEC;
  const int lane = threadIdx.x & 31;
  const int64_t Sk = P.a.Sk;
  const acc_t scale = static_cast<acc_t>(P.a.scale);
  const acc_t keep_scale = static_cast<acc_t>(P.a.keep_scale);
  const bool dropout = P.a.dropout.active || P.keep != nullptr;
  const acc_t mscale = static_cast<acc_t>(P.mask_scale);
  const int64_t first_row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  const int64_t row_step = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  for (int64_t row = first_row; row < P.a.rows; row += row_step) {
    const scalar_t* grow = P.grad_out + P.gi.offset(row);
    const scalar_t* prow = P.probs + P.pi.offset(row);
    const bool* krow = P.keep ? P.keep + P.ki.offset(row) : nullptr;
    acc_t g[T][VEC], pr[T][VEC];
    acc_t dot = 0;
#pragma unroll
    for (int t = 0; t < T; ++t) {
      const int64_t j0 = (static_cast<int64_t>(t) * 32 + lane) * VEC;
      if (j0 < Sk) {
        const SmPack<scalar_t, VEC> gv = *reinterpret_cast<const SmPack<scalar_t, VEC>*>(grow + j0);
        const SmPack<scalar_t, VEC> pv = *reinterpret_cast<const SmPack<scalar_t, VEC>*>(prow + j0);
        acc_t mult[VEC];
        if (krow) {
#pragma unroll
          for (int k = 0; k < VEC; ++k) mult[k] = krow[j0 + k] ? mscale : acc_t(0);
        } else {
          sm_mults<VEC>(P.a.dropout, keep_scale, static_cast<uint64_t>(row * Sk + j0), mult);
        }
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          g[t][k] = dropout ? static_cast<acc_t>(gv.v[k]) * mult[k] : static_cast<acc_t>(gv.v[k]);
          pr[t][k] = static_cast<acc_t>(pv.v[k]);
          dot += g[t][k] * pr[t][k];
        }
      } else {
#pragma unroll
        for (int k = 0; k < VEC; ++k) g[t][k] = pr[t][k] = acc_t(0);
      }
    }
    dot = sm_warp_sum(dot);
    scalar_t* orow = P.grad + row * Sk;
#pragma unroll
    for (int t = 0; t < T; ++t) {
      const int64_t j0 = (static_cast<int64_t>(t) * 32 + lane) * VEC;
      if (j0 < Sk) {
        SmPack<scalar_t, VEC> ov;
#pragma unroll
        for (int k = 0; k < VEC; ++k) ov.v[k] = static_cast<scalar_t>(scale * pr[t][k] * (g[t][k] - dot));
        *reinterpret_cast<SmPack<scalar_t, VEC>*>(orow + j0) = ov;
      }
    }
  }
}

template <typename scalar_t>
__global__ void __launch_bounds__(kBlockThreads) softmax_bwd_block_kernel(const BwdParams<scalar_t> P) {
  using acc_t = at::opmath_type<scalar_t>;
  __shared__ acc_t scratch[32];
  const int64_t Sk = P.a.Sk;
  const acc_t scale = static_cast<acc_t>(P.a.scale);
  const acc_t keep_scale = static_cast<acc_t>(P.a.keep_scale);
  const bool dropout = P.a.dropout.active;
  const acc_t mscale = static_cast<acc_t>(P.mask_scale);
  for (int64_t row = blockIdx.x; row < P.a.rows; row += gridDim.x) {
    const scalar_t* grow = P.grad_out + P.gi.offset(row);
    const scalar_t* prow = P.probs + P.pi.offset(row);
    const bool* krow = P.keep ? P.keep + P.ki.offset(row) : nullptr;
    const uint64_t first = static_cast<uint64_t>(row * Sk);
    acc_t dot = 0;
    for (int64_t j = threadIdx.x; j < Sk; j += blockDim.x) {
      acc_t gj = static_cast<acc_t>(grow[j]);
      if (krow) gj *= krow[j] ? mscale : acc_t(0);  // (a multiply, as on the CPU: inf * 0 is NaN)
      else if (dropout) gj *= sm_mult(P.a.dropout, keep_scale, first + j);
      dot += gj * static_cast<acc_t>(prow[j]);
    }
    dot = sm_block_sum(dot, scratch);
    scalar_t* orow = P.grad + row * Sk;
    for (int64_t j = threadIdx.x; j < Sk; j += blockDim.x) {
      acc_t gj = static_cast<acc_t>(grow[j]);
      if (krow) gj *= krow[j] ? mscale : acc_t(0);  // (a multiply, as on the CPU: inf * 0 is NaN)
      else if (dropout) gj *= sm_mult(P.a.dropout, keep_scale, first + j);
      orow[j] = static_cast<scalar_t>(scale * static_cast<acc_t>(prow[j]) * (gj - dot));
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Launch helpers
// ------------------------------------------------------------------------------------------------

// Every row of a tensor addressed by `idx` from `p` starts on a VEC-element boundary.
inline bool sm_rows_aligned(const void* p, const RowIndexer& idx, int vec, size_t elem) {
  if (reinterpret_cast<uintptr_t>(p) % (static_cast<size_t>(vec) * elem) != 0) return false;
  for (int d = 0; d < idx.nd; ++d)
    if (idx.strides[d] % vec != 0) return false;
  return true;
}

inline unsigned warp_grid(int64_t rows) {
  return static_cast<unsigned>(std::min<int64_t>((rows + kWarpsPerBlock - 1) / kWarpsPerBlock, kMaxGrid));
}

inline unsigned block_grid(int64_t rows) { return static_cast<unsigned>(std::min<int64_t>(rows, kMaxGrid)); }

template <typename scalar_t, int VEC>
void launch_fwd_warp(const FwdParams<scalar_t>& P) {
  const dim3 block(kWarpsPerBlock * 32);
  if (P.a.Sk <= 8 * 32) {
    softmax_fwd_warp_kernel<scalar_t, 8, VEC><<<warp_grid(P.a.rows), block, 0, sm_stream()>>>(P);
  } else {
    softmax_fwd_warp_kernel<scalar_t, 32, VEC><<<warp_grid(P.a.rows), block, 0, sm_stream()>>>(P);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename scalar_t, int VEC>
void launch_bwd_warp(const BwdParams<scalar_t>& P) {
  const dim3 block(kWarpsPerBlock * 32);
  if (P.a.Sk <= 8 * 32) {
    softmax_bwd_warp_kernel<scalar_t, 8, VEC><<<warp_grid(P.a.rows), block, 0, sm_stream()>>>(P);
  } else {
    softmax_bwd_warp_kernel<scalar_t, 32, VEC><<<warp_grid(P.a.rows), block, 0, sm_stream()>>>(P);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace softmax_impl

// ------------------------------------------------------------------------------------------------
// Entry points (same signatures, checks and outputs as softmax_cpu.cpp)
// ------------------------------------------------------------------------------------------------

std::vector<at::Tensor> softmax_fwd_cuda(const at::Tensor& scores_in,
                                         const c10::optional<at::Tensor>& mask_in, double scale,
                                         bool causal, int64_t seed, int64_t offset, double p) {
  using namespace softmax_impl;
  const char* op = "softmax_fwd";
  check_scores(op, "scores", scores_in, at::kCUDA);
  const SoftmaxArgs a = make_fwd_args(op, scores_in, causal, scale, seed, offset, p);
  const MaskView mv = prepare_mask(op, mask_in, scores_in);
  const c10::cuda::CUDAGuard device_guard(scores_in.device());
  auto outs = alloc_fwd_outputs(scores_in, a);
  if (a.rows == 0) return outs;
  const at::Tensor scores = rowable(scores_in);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, scores.scalar_type(), "dmfx_softmax_fwd_cuda", [&] {
    FwdParams<scalar_t> P;
    P.scores = scores.data_ptr<scalar_t>();
    P.si = RowIndexer::of(scores);
    P.mask.data = mv.t.defined() ? mv.t.data_ptr() : nullptr;
    P.mask.kind = mv.kind;
    P.mask.col_stride = mv.col_stride;
    P.mask.idx = mv.idx;
    P.out = outs[0].data_ptr<scalar_t>();
    P.probs = a.dropout.active ? outs[1].data_ptr<scalar_t>() : nullptr;
    P.a = a;
    if (a.Sk > kMaxWarpSk) {
      softmax_fwd_block_kernel<scalar_t><<<block_grid(a.rows), kBlockThreads, 0, sm_stream()>>>(P);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    } else {
      const size_t es = sizeof(scalar_t);
      const bool vec = a.Sk % 4 == 0 && sm_rows_aligned(P.scores, P.si, 4, es) &&
                       sm_rows_aligned(P.out, RowIndexer{}, 4, es) &&
                       (P.probs == nullptr || sm_rows_aligned(P.probs, RowIndexer{}, 4, es));
      if (vec) {
        launch_fwd_warp<scalar_t, 4>(P);
      } else {
        launch_fwd_warp<scalar_t, 1>(P);
      }
    }
  });
  return outs;
}

at::Tensor softmax_bwd_cuda(const at::Tensor& grad_out_in, const at::Tensor& probs_in, int64_t seed,
                            int64_t offset, double p, double scale, const c10::optional<at::Tensor>& mask_in,
                            double mask_scale) {
  using namespace softmax_impl;
  const SoftmaxArgs a =
      check_bwd_args("softmax_bwd", grad_out_in, probs_in, seed, offset, p, scale, at::kCUDA);
  check_stored_mask("softmax_bwd", mask_in, "probs", probs_in, p, mask_scale);
  const c10::cuda::CUDAGuard device_guard(probs_in.device());
  at::Tensor grad = at::empty(probs_in.sizes(), probs_in.options());
  if (a.rows == 0) return grad;
  const at::Tensor grad_out = rowable(grad_out_in), probs = rowable(probs_in);
  const auto mask = rowable(mask_in);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, probs.scalar_type(), "dmfx_softmax_bwd_cuda", [&] {
    BwdParams<scalar_t> P;
    P.grad_out = grad_out.data_ptr<scalar_t>();
    P.gi = RowIndexer::of(grad_out);
    P.probs = probs.data_ptr<scalar_t>();
    P.pi = RowIndexer::of(probs);
    P.grad = grad.data_ptr<scalar_t>();
    P.keep = mask ? mask->data_ptr<bool>() : nullptr;
    P.ki = mask ? RowIndexer::of(*mask) : RowIndexer{};
    P.mask_scale = mask_scale;
    P.a = a;
    if (a.Sk > kMaxWarpSk) {
      softmax_bwd_block_kernel<scalar_t><<<block_grid(a.rows), kBlockThreads, 0, sm_stream()>>>(P);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    } else {
      const size_t es = sizeof(scalar_t);
      const bool vec = a.Sk % 4 == 0 && sm_rows_aligned(P.grad_out, P.gi, 4, es) &&
                       sm_rows_aligned(P.probs, P.pi, 4, es) && sm_rows_aligned(P.grad, RowIndexer{}, 4, es);
      if (vec) {
        launch_bwd_warp<scalar_t, 4>(P);
      } else {
        launch_bwd_warp<scalar_t, 1>(P);
      }
    }
  });
  return grad;
}

}  // namespace dmfx

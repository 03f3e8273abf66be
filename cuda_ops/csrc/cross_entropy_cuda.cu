// dmfx CUDA kernels of the fused cross-entropy. cross_entropy_cpu.cpp is the specification: same
// arguments, checks (cross_entropy_api.h), outputs and math, with one difference: a target that is
// neither a class nor ignore_index cannot raise here without a device synchronization (impossible
// inside a CUDA graph capture), so its row's loss and lse are NaN (a reduced loss is then NaN) and its
// gradient row is NaN.
//
// Design (kept simple: this code was compiled and run in the CPU emulation, tests/cuda_emu, by its author)
// ------
// * One block per row (grid-stride over rows), blockDim.x = min(256, V rounded up to a warp).
//   Forward: each thread reads its elements j = threadIdx.x + k * blockDim.x (coalesced), kUnroll at a
//   time: their max, then their sum of exp relative to it, merged into the thread's running
//   (max, sum) (ce_merge): one pass over the row, about one exp per element. The block merges the
//   threads' pairs (warp butterflies, then through shared memory); thread 0 writes the row's loss and
//   its (max, log-sum) pair. Ignored rows are not read. The reduced loss is ATen's sum of the rows' losses (/ the count
//   of rows not ignored for mean), on the current stream.
// * Backward: the same blocks, one pass: dz = g * exp(z - lse) - g * eps / V (- g * (1 - eps) at the
//   target) (+ grad_logits), exp(z - lse) as exp(z - max - log-sum), times the soft cap's derivative
//   1 - (z / cap)^2 when softcap > 0 (ignored rows: grad_logits times it), written in the logits' dtype.
// * Math in at::opmath_type (fp32 for half/bfloat16/float, fp64 for double); expf / logf (not the
//   fast intrinsics). NaN logits give NaN rows, as eager.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "cross_entropy_api.h"
#include "dmfx_common.h"
#include "kernel_api.h"
#include "softmax_device.cuh"

namespace dmfx {
namespace cross_entropy_impl {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;
constexpr int64_t kMaxGrid = 1 << 20;

template <typename scalar_t>
struct CeFwdParams {
  using acc_t = at::opmath_type<scalar_t>;
  const scalar_t* x;
  const int64_t* t;
  acc_t* rows;  // [N] per-row losses
  acc_t* lse;   // [N, 2]: each row's max and log-sum
  CeArgs a;
};

template <typename scalar_t>
struct CeBwdParams {
  using acc_t = at::opmath_type<scalar_t>;
  const scalar_t* x;
  const int64_t* t;
  const acc_t* lse;   // [N, 2]
  const acc_t* grad;  // the loss gradient: one value (grad_stride 0) or one per row (1)
  int64_t grad_stride;
  const int64_t* count;  // rows not ignored (mean), else nullptr
  const scalar_t* gl;    // grad_logits, or nullptr
  int64_t gl_stride;
  scalar_t* out;  // [N, V] contiguous
  CeArgs a;
};

template <typename T>
__device__ __forceinline__ void ce_warp_merge(T& m, T& s) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const T m2 = __shfl_xor_sync(0xffffffffu, m, o);
    const T s2 = __shfl_xor_sync(0xffffffffu, s, o);
    ce_merge(m, s, m2, s2);
  }
}

// The block's (max, sum of exp) merged from every thread's; every thread gets it. All threads of the
// block call it; blockDim.x is a multiple of 32. The leading barrier makes back-to-back calls safe.
template <typename T>
__device__ __forceinline__ void ce_block_merge(T& m, T& s, T* scratch_m, T* scratch_s) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  ce_warp_merge(m, s);
  __syncthreads();
  if (lane == 0) {
    scratch_m[warp] = m;
    scratch_s[warp] = s;
  }
  __syncthreads();
  m = lane < nwarps ? scratch_m[lane] : -std::numeric_limits<T>::infinity();
  s = lane < nwarps ? scratch_s[lane] : T(0);
  ce_warp_merge(m, s);
}

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads) cross_entropy_fwd_kernel(const CeFwdParams<scalar_t> P) {
  using acc_t = at::opmath_type<scalar_t>;
  __shared__ acc_t scratch_m[32];
  __shared__ acc_t scratch_s[32];
  constexpr acc_t kNegInf = -std::numeric_limits<acc_t>::infinity();
  const CeArgs& a = P.a;
  const acc_t eps = static_cast<acc_t>(a.smoothing);
  const int64_t step = static_cast<int64_t>(blockDim.x) * kUnroll;
  for (int64_t row = blockIdx.x; row < a.N; row += gridDim.x) {  // uniform per block
    const int64_t tr = P.t[row];
    if (tr == a.ignore_index || !ce_target_ok(tr, a.V, a.ignore_index)) {
      if (threadIdx.x == 0) {
        const acc_t v = tr == a.ignore_index ? acc_t(0) : std::numeric_limits<acc_t>::quiet_NaN();
        P.rows[row] = v;
        P.lse[2 * row] = P.lse[2 * row + 1] = v;
      }
      continue;
    }
    const scalar_t* xr = P.x + row * a.row_stride;
    acc_t m = kNegInf, s = 0, zs = 0;
    for (int64_t j0 = threadIdx.x; j0 < a.V; j0 += step) {
      acc_t v[kUnroll];
      acc_t tile_max = kNegInf;
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        const int64_t j = j0 + static_cast<int64_t>(k) * blockDim.x;
        v[k] = j < a.V ? static_cast<acc_t>(xr[j]) : kNegInf;
        if (j < a.V) zs += v[k];
        tile_max = ce_nan_max(tile_max, v[k]);
      }
      if (tile_max != kNegInf) {
        acc_t tile_sum = 0;
#pragma unroll
        for (int k = 0; k < kUnroll; ++k) tile_sum += ce_exp(v[k] - tile_max);
        ce_merge(m, s, tile_max, tile_sum);
      }
    }
    ce_block_merge(m, s, scratch_m, scratch_s);
    const acc_t zsum = eps > acc_t(0) ? softmax_impl::sm_block_sum(zs, scratch_m) : acc_t(0);
    if (threadIdx.x == 0) {
      const acc_t ls = ce_log(s);
      P.lse[2 * row] = m;
      P.lse[2 * row + 1] = ls;
      P.rows[row] = ce_row_loss(m, ls, static_cast<acc_t>(xr[tr]), zsum, eps, a.V);
    }
  }
}

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads) cross_entropy_bwd_kernel(const CeBwdParams<scalar_t> P) {
  using acc_t = at::opmath_type<scalar_t>;
  const CeArgs& a = P.a;
  const acc_t eps = static_cast<acc_t>(a.smoothing), cap = static_cast<acc_t>(a.softcap);
  for (int64_t row = blockIdx.x; row < a.N; row += gridDim.x) {  // uniform per block
    scalar_t* orow = P.out + row * a.V;
    const scalar_t* glr = P.gl ? P.gl + row * P.gl_stride : nullptr;
    const int64_t tr = P.t[row];
    const scalar_t* xr = P.x + row * a.row_stride;
    if (tr == a.ignore_index) {  // no loss gradient: grad_logits (times the cap's derivative), or zeros
      for (int64_t j = threadIdx.x; j < a.V; j += blockDim.x) {
        if (glr && cap > acc_t(0)) {
          const acc_t f = ce_softcap_factor(static_cast<acc_t>(xr[j]), cap);
          orow[j] = static_cast<scalar_t>(static_cast<acc_t>(glr[j]) * f);
        } else {
          orow[j] = glr ? glr[j] : scalar_t(0);
        }
      }
      continue;
    }
    const bool bad = !ce_target_ok(tr, a.V, a.ignore_index);
    const acc_t g = bad ? std::numeric_limits<acc_t>::quiet_NaN() : ce_row_scale(P.grad, P.grad_stride, P.count, row);
    const acc_t g_eps = g * (eps / static_cast<acc_t>(a.V)), g_target = g * (acc_t(1) - eps);
    const acc_t m = P.lse[2 * row], ls = P.lse[2 * row + 1];
    for (int64_t j = threadIdx.x; j < a.V; j += blockDim.x) {
      const acc_t z = static_cast<acc_t>(xr[j]);
      acc_t d = g * ce_exp(z - m - ls) - g_eps;
      if (j == tr) d -= g_target;
      if (glr) d += static_cast<acc_t>(glr[j]);
      if (cap > acc_t(0)) d *= ce_softcap_factor(z, cap);
      orow[j] = static_cast<scalar_t>(d);
    }
  }
}

inline unsigned ce_grid(int64_t rows) { return static_cast<unsigned>(std::min<int64_t>(rows, kMaxGrid)); }

inline unsigned ce_block(int64_t V) {
  return static_cast<unsigned>(std::min<int64_t>(kThreads, (V + 31) / 32 * 32));
}

inline cudaStream_t ce_stream() { return softmax_impl::sm_stream(); }

}  // namespace cross_entropy_impl

// ------------------------------------------------------------------------------------------------
// Entry points (same signatures, checks and outputs as cross_entropy_cpu.cpp)
// ------------------------------------------------------------------------------------------------

std::vector<at::Tensor> cross_entropy_fwd_cuda(const at::Tensor& logits_in, const at::Tensor& target_in,
                                               int64_t ignore_index, double label_smoothing, int64_t reduction) {
  using namespace cross_entropy_impl;
  CeArgs a = check_ce_args("cross_entropy", logits_in, target_in, ignore_index, label_smoothing, reduction, at::kCUDA);
  const c10::cuda::CUDAGuard device_guard(logits_in.device());
  const at::Tensor logits = ce_rows(logits_in), target = target_in.contiguous();
  a.row_stride = ce_row_stride(logits);
  const auto stat = logits.options().dtype(ce_stat_dtype(logits));
  at::Tensor rows = at::empty({a.N}, stat), lse = at::empty({a.N, 2}, stat);
  if (a.N > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "dmfx_cross_entropy_fwd_cuda", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      CeFwdParams<scalar_t> P{logits.data_ptr<scalar_t>(), target.data_ptr<int64_t>(), rows.data_ptr<acc_t>(),
                              lse.data_ptr<acc_t>(), a};
      cross_entropy_fwd_kernel<scalar_t><<<ce_grid(a.N), ce_block(a.V), 0, ce_stream()>>>(P);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
  if (reduction == kReduceNone) return {rows, lse};
  at::Tensor loss = rows.sum();
  if (reduction == kReduceMean) loss = loss / target.ne(ignore_index).sum();  // 0 / 0: NaN, as eager
  return {loss, lse};
}

at::Tensor cross_entropy_bwd_cuda(const at::Tensor& grad_loss_in, const at::Tensor& logits_in,
                                  const at::Tensor& target_in, const at::Tensor& lse_in, int64_t ignore_index,
                                  double label_smoothing, int64_t reduction,
                                  const c10::optional<at::Tensor>& grad_logits_in, double softcap) {
  using namespace cross_entropy_impl;
  CeArgs a = check_ce_bwd_args("cross_entropy_backward", grad_loss_in, logits_in, target_in, lse_in, ignore_index,
                               label_smoothing, reduction, grad_logits_in, softcap, at::kCUDA);
  const c10::cuda::CUDAGuard device_guard(logits_in.device());
  const at::Tensor logits = ce_rows(logits_in), target = target_in.contiguous(), lse = lse_in.contiguous();
  const at::Tensor grad_loss = grad_loss_in.contiguous();
  a.row_stride = ce_row_stride(logits);
  const at::Tensor count = reduction == kReduceMean ? target.ne(ignore_index).sum() : at::Tensor();
  at::Tensor gl;
  if (present(grad_logits_in)) gl = ce_rows(*grad_logits_in);
  at::Tensor out = at::empty(logits.sizes(), logits.options());
  if (a.N == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "dmfx_cross_entropy_bwd_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    CeBwdParams<scalar_t> P{logits.data_ptr<scalar_t>(),
                            target.data_ptr<int64_t>(),
                            lse.data_ptr<acc_t>(),
                            grad_loss.data_ptr<acc_t>(),
                            reduction == kReduceNone ? 1 : 0,
                            count.defined() ? count.data_ptr<int64_t>() : nullptr,
                            gl.defined() ? gl.data_ptr<scalar_t>() : nullptr,
                            gl.defined() ? ce_row_stride(gl) : 0,
                            out.data_ptr<scalar_t>(),
                            a};
    cross_entropy_bwd_kernel<scalar_t><<<ce_grid(a.N), ce_block(a.V), 0, ce_stream()>>>(P);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

}  // namespace dmfx

// dmfx CPU fused attention: scores never leave the cache.
//
//   flash_fwd: for each (batch, head, block of query rows): S = Q_blk · Kᵀ into a per-thread buffer
//              (at most ~512 KB, so it stays in L2), the fused scale + mask + causal + softmax +
//              dropout row pass of softmax_cpu.cpp on it, then out_blk = P_dropped · V written
//              straight into `out` (any strides with a unit last dim: the [B, L, H, D] layout).
//              Returns the row statistics [2, B, H, Lq] (the accumulation type) for the backward:
//              the max of the logits and 1 / sum of their exps. (Not one logsumexp: with HF's
//              finfo.min masks a fully padded row's max is -3.4e38, and max + log(sum) rounds to it.)
//   flash_bwd: for each (batch, kv head): for each query head of the group and block of rows, S is
//              recomputed and P = exp(S * scale + mask - max) / sum; then dV += P_droppedᵀ · dO,
//              dP = dO · Vᵀ, dS = scale * P * (dropout(dP) - rowsum(dropout(dP) * P)),
//              dQ_blk = dS · K, dK += dSᵀ · Q_blk. dq, dk, dv are written in place (strided views:
//              the stacked QKV gradient's column blocks, or [B, L, H, D] tensors).
//   softcap > 0 (Gemma 2's soft-capped scores): the logits are softcap * tanh(S * scale / softcap) + mask,
//              the scores capped in place in the row buffer, and dS gains the factor 1 - (capped / softcap)^2.
//   Both skip the keys an HF padding mask hides from a whole batch element (key_lengths below):
//   padded positions cost no GEMM work and no row work.
//   varlen_fwd / varlen_bwd: the same loops (fwd_block, bwd_task) over packed variable-length
//              sequences (q [T, Hq, D], sequence b in rows cu_seqlens[b] .. cu_seqlens[b + 1]; each
//              query attends its own sequence's keys): the forward's work items are (sequence, head,
//              block of query rows), the backward's (sequence, kv head), handed out dynamically,
//              longest sequences first (their costs differ by the square of the lengths); the
//              addressing of a score row (statistics, Philox index (h * T + tq) * T + tk, causal
//              limit) is VarlenRows', the dense form's DenseRows'. stats [2, Hq, T].
//
// The GEMMs are the BLAS libtorch links (MKL's sgemm_/dgemm_ on the strided operands in place, no
// copies; gemm_rm below); this file is the glue and the row math, which is softmax_cpu.cpp's (same
// logits, exp, Philox mask: element index = row-major index in the [B, Hq, Lq, Lk] scores), so the
// dropout mask is bit for bit that of the unfused form.
// The row math is softmax_cpu.h's (shared with the softmax kernels).
// float32 and float64 only: bf16/fp16 flash attention runs the unfused form, bf16/fp16 varlen attention
// is upcast to float32 by its ops (cuda_ops/attention.py, attention_ops.h).
//
// The file has two parts (cuda_ops/build.py): the kernels, this file's own translation unit (-O3), and,
// under DMFX_CPU_GLUE, the glue (the kernel functions' Python bindings, the ops' registration and
// autograd formulas), which cpu_bindings.cpp includes into the one translation unit of every family's glue.

#ifndef DMFX_CPU_GLUE
#include <ATen/core/Tensor.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/Parallel.h>
#include <ATen/OpMathType.h>
#include <ATen/Dispatch.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

#include "attention_api.h"
#include "cpu_kernels.h"
#include "softmax_cpu.h"

extern "C" {
void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k, const float* alpha,
            const float* a, const int* lda, const float* b, const int* ldb, const float* beta, float* c,
            const int* ldc) __attribute__((weak));
void dgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k, const double* alpha,
            const double* a, const int* lda, const double* b, const int* ldb, const double* beta, double* c,
            const int* ldc) __attribute__((weak));
}

namespace dmfx {
namespace attention_impl {

using softmax_impl::causal_limit;
using softmax_impl::exp_sum;
using softmax_impl::fill_mult;
using softmax_impl::load_logits;
using softmax_impl::mask_value;
using softmax_impl::MaskView;
using softmax_impl::NoMask;
using softmax_impl::RowScratch;
using softmax_impl::SoftmaxArgs;

// ---------------------------------------------------------------------------------------- GEMMs
// The kernels run several small GEMMs per block of rows (at L=128, about 700 per BERT-base layer
// step). Through at::mm_out each one cost a dispatch, output checks and the select/narrow/t views
// that name its operands; on raw pointers with the BLAS libtorch itself links (MKL's Fortran
// interface, exported by libtorch_cpu; declared weak at the top of this file) attention alone runs
// 9% faster at L=128 and 3.6% at L=512 (bench/RESULTS.md). Where a libtorch has no BLAS, the same
// GEMMs go through at::addmm_out on from_blob views.
inline void blas_call(const char* ta, const char* tb, const int* m, const int* n, const int* k, const float* alpha,
                      const float* a, const int* lda, const float* b, const int* ldb, const float* beta, float* c,
                      const int* ldc) {
  sgemm_(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
inline void blas_call(const char* ta, const char* tb, const int* m, const int* n, const int* k, const double* alpha,
                      const double* a, const int* lda, const double* b, const int* ldb, const double* beta, double* c,
                      const int* ldc) {
  dgemm_(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
// false: every GEMM takes the at::addmm_out path (flash_use_blas, for the tests of that path)
inline std::atomic<bool>& use_blas() {
  static std::atomic<bool> on{true};
  return on;
}
template <typename T>
inline bool blas_linked() {
  return use_blas().load(std::memory_order_relaxed) && (std::is_same<T, float>::value ? sgemm_ != nullptr : dgemm_ != nullptr);
}

// A leading dimension BLAS accepts for a column-major operand of `rows` rows stored as `cols`
// columns `ld` apart (a row-major matrix of `cols` rows with row stride `ld`): a single column may
// carry any stride (PyTorch leaves size-1 dims' strides free); false when it cannot be expressed.
inline bool fix_ld(int64_t rows, int64_t cols, int64_t& ld) {
  if (cols <= 1) ld = std::max<int64_t>({ld, rows, 1});
  return ld >= std::max<int64_t>(rows, 1) && ld <= std::numeric_limits<int>::max();
}

// Row-major C[M, N] = alpha * op(A) · op(B) + beta * C; every matrix has a unit column stride and the
// given row stride; op(A) = A stored [M, K], or Aᵀ with A stored [K, M] (ta); likewise B ([K, N] or
// stored [N, K] with tb). beta = 0 never reads C.
template <typename T>
void gemm_rm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, T alpha, const T* A, int64_t lda, const T* B,
             int64_t ldb, T beta, T* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
  // BLAS is column-major: Cᵀ[N, M] = op(B)ᵀ · op(A)ᵀ, each stored matrix read as its transpose.
  bool ok = blas_linked<T>() && std::max<int64_t>({M, N, K}) <= std::numeric_limits<int>::max() &&
            fix_ld(tb ? K : N, tb ? N : K, ldb) && fix_ld(ta ? M : K, ta ? K : M, lda) && fix_ld(N, M, ldc);
  if (ok) {
    const int m = static_cast<int>(N), n = static_cast<int>(M), k = static_cast<int>(std::max<int64_t>(K, 0));
    const int la = static_cast<int>(ldb), lb = static_cast<int>(lda), lc = static_cast<int>(ldc);
    const char opa = tb ? 'T' : 'N', opb = ta ? 'T' : 'N';
    blas_call(&opa, &opb, &m, &n, &k, &alpha, B, &la, A, &lb, &beta, C, &lc);
    return;
  }
  const auto opts = at::TensorOptions().dtype(c10::CppTypeToScalarType<T>::value);
  auto view = [&](const T* p, int64_t r, int64_t c, int64_t ld, bool t) {
    at::Tensor x = at::from_blob(const_cast<T*>(p), {t ? c : r, t ? r : c}, {ld, 1}, opts);
    return t ? x.t() : x;
  };
  at::Tensor c = at::from_blob(C, {M, N}, {ldc, 1}, opts);
  at::addmm_out(c, c, view(A, M, K, lda, ta), view(B, K, N, ldb, tb), beta, alpha);
}

// Pointer to row `row` of the [L, D] matrix (b, h) of a [B, H, L, D] tensor with a unit last stride.
template <typename T>
inline T* mat(const at::Tensor& t, int64_t b, int64_t h, int64_t row = 0) {
  return t.data_ptr<T>() + b * t.stride(0) + h * t.stride(1) + row * t.stride(2);
}

// out[j] = sum over `rows` rows (row stride ld) of p[r * ld + j], j < n
template <typename T>
inline void col_sums(const T* p, int64_t rows, int64_t ld, int64_t n, T* out) {
  std::fill(out, out + n, T(0));
  for (int64_t r = 0; r < rows; ++r) {
    const T* row = p + r * ld;
    for (int64_t j = 0; j < n; ++j) out[j] += row[j];
  }
}

inline Shapes check(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  Shapes s = check_qkv(op, q, k, v, "CPU", [](const at::Tensor& t) { return t.device().is_cpu(); });
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kDouble, "dmfx::", op,
              ": the fused CPU attention takes float32 or float64, got ", q.scalar_type());
  // rows per block: the [block, Lk] scores (in the backward two such buffers) stay in L2; 512 KB
  // measured best of 128 KB / 512 KB / 1 MB (bench/RESULTS.md: 1.27x faster than 128 KB at L=512)
  const int64_t budget = 512 * 1024 / static_cast<int64_t>(q.element_size());
  s.block = std::max<int64_t>(16, std::min<int64_t>(std::max<int64_t>(s.Lq, 1), budget / std::max<int64_t>(s.Lk, 1)));
  return s;
}


// s[j] = cap * tanh(s[j] * inner) for j < n, vectorized (ATen's Vectorized tanh: a scalar libm tanh per
// score costs more than the rest of the row pass).
template <typename acc_t>
inline void soft_cap(acc_t* s, int64_t n, acc_t inner, acc_t cap) {
  using Vec = at::vec::Vectorized<acc_t>;
  constexpr int64_t kW = Vec::size();
  const Vec vi(inner), vc(cap);
  int64_t j = 0;
  for (; j + kW <= n; j += kW) (vc * (Vec::loadu(s + j) * vi).tanh()).store(s + j);
  if (j < n) (vc * (Vec::loadu(s + j, n - j) * vi).tanh()).store(s + j, n - j);
}

// Logits of score row `r` (global row index R) into z; returns (max, number of unmasked columns).
template <typename acc_t, typename mask_t>
inline acc_t row_logits(const SoftmaxArgs& a, const MaskView& mv, int64_t R, acc_t* srow, int64_t n, acc_t* z) {
  acc_t scale = static_cast<acc_t>(a.scale);
  if (a.softcap > 0) {  // srow keeps the capped scores: the backward's dS reads them
    soft_cap<acc_t>(srow, n, static_cast<acc_t>(a.scale / a.softcap), static_cast<acc_t>(a.softcap));
    scale = acc_t(1);
  }
  if constexpr (std::is_same<mask_t, NoMask>::value) {
    return load_logits<acc_t>(srow, static_cast<const NoMask*>(nullptr), n, scale, acc_t(0), z);
  } else {
    const mask_t* m = static_cast<const mask_t*>(mv.t.data_ptr()) + mv.idx.offset(R);
    if (mv.col_stride == 0) return load_logits<acc_t>(srow, static_cast<const NoMask*>(nullptr), n, scale,
                                                      mask_value<acc_t>(m, 0), z);
    return load_logits<acc_t>(srow, m, n, scale, acc_t(0), z);
  }
}

// Keys a padding mask hides from every query of batch b: HF's [B, 1, 1, Lk] masks pad at the end of
// each sequence. Returns, per batch, the number of leading keys to compute with (Lk when the mask
// is not per-key, or hides everything). Keys at or past it carry -inf (bool False) or a value at or
// below kPadValue (HF uses finfo.min), so exp(z - max) is exactly 0 for them in any row that has one
// visible key: skipping them in the GEMMs and the row pass changes no result bit.
constexpr double kPadValue = -1e30;

template <typename mask_t>
std::vector<int64_t> key_lengths(const Shapes& s, const MaskView& mv) {
  std::vector<int64_t> len(s.B, s.Lk);
  if constexpr (std::is_same<mask_t, NoMask>::value) {
    return len;
  } else {
    const at::Tensor& t = mv.t;  // [B, Hq, Lq, Lk] broadcast view
    if (mv.col_stride == 0 || (s.Hq > 1 && t.stride(1) != 0) || (s.Lq > 1 && t.stride(2) != 0)) return len;
    const mask_t* base = static_cast<const mask_t*>(t.data_ptr());
    for (int64_t b = 0; b < s.B; ++b) {
      const mask_t* m = base + b * t.stride(0);
      int64_t n = s.Lk;
      while (n > 0) {
        const double v = static_cast<double>(mask_value<double>(m, n - 1));
        if (!(v <= kPadValue)) break;  // NaN and visible keys stop the scan
        --n;
      }
      len[b] = n == 0 ? s.Lk : n;  // all hidden: keep every key (softmax over equal values)
    }
    return len;
  }
}

// ------------------------------------------------------------------------------------------------
// The fused loops, written once for both forms. What differs is the addressing of a score row (its
// index in the statistics, its first Philox element, its causal limit, its mask):
//   DenseRows  (flash_fwd / flash_bwd): batch element b of [B, H, L, D] tensors; row i of query head
//              h is row R = (b * Hq + h) * Lq + i of the [B, Hq, Lq, Lk] scores, its Philox elements
//              R * Lk + j, its mask row R;
//   VarlenRows (varlen_fwd / varlen_bwd): one sequence [start, start + L) of packed [T, H, D]
//              tensors; row i of head h is row h * T + start + i of the block-diagonal [Hq, T, T]
//              scores, its Philox elements (h * T + start + i) * T + start + j, no mask, causal
//              limit i + 1;
// and the operands of one batch element or sequence as Rowed: row i of head h at p + h * sh + i * sl.
// ------------------------------------------------------------------------------------------------

template <typename T>
struct Rowed {
  T* p;
  int64_t sh, sl;
  T* at(int64_t h, int64_t i = 0) const { return p + h * sh + i * sl; }
};

// Batch element b of a [B, H, L, D] tensor.
template <typename T>
inline Rowed<T> dense_rows(const at::Tensor& t, int64_t b) {
  return {t.data_ptr<T>() + b * t.stride(0), t.stride(1), t.stride(2)};
}

// The sequence starting at packed row `start` of a [T, H, D] tensor.
template <typename T>
inline Rowed<T> packed_rows(const at::Tensor& t, int64_t start) {
  return {t.data_ptr<T>() + start * t.stride(0), t.stride(1), t.stride(0)};
}

template <typename mask_t>
struct DenseRows {
  const SoftmaxArgs& a;
  const MaskView& mv;
  int64_t row0, Lq, Lk;  // row0 = b * Hq * Lq
  int64_t row(int64_t h, int64_t i) const { return row0 + h * Lq + i; }
  uint64_t drop(int64_t h, int64_t i) const { return static_cast<uint64_t>(row(h, i)) * static_cast<uint64_t>(Lk); }
  int64_t limit(int64_t h, int64_t i, int64_t nk) const { return std::min(causal_limit(a, row(h, i)), nk); }
  template <typename acc_t>
  acc_t logits(int64_t h, int64_t i, acc_t* srow, int64_t n, acc_t* z) const {
    return row_logits<acc_t, mask_t>(a, mv, row(h, i), srow, n, z);
  }
};

struct VarlenRows {
  double scale;
  bool causal;
  int64_t T, start;
  int64_t row(int64_t h, int64_t i) const { return h * T + start + i; }
  uint64_t drop(int64_t h, int64_t i) const {
    return static_cast<uint64_t>(row(h, i)) * static_cast<uint64_t>(T) + static_cast<uint64_t>(start);
  }
  int64_t limit(int64_t, int64_t i, int64_t nk) const { return causal ? std::min(i + 1, nk) : nk; }
  template <typename acc_t>
  acc_t logits(int64_t, int64_t, acc_t* srow, int64_t n, acc_t* z) const {
    return load_logits<acc_t>(srow, static_cast<const NoMask*>(nullptr), n, static_cast<acc_t>(scale), acc_t(0), z);
  }
};

// The keys the query rows i0 .. i0 + m - 1 of head h read, of the first nk: those below the last row's
// causal limit (all nk without a causal mask: a causal block skips the keys past its diagonal, half of
// the scores' GEMM work over a square), and at least one where there are any (a row that sees none
// still runs its row pass, which writes zeros).
template <typename Rows>
inline int64_t block_keys(const Rows& rows, int64_t h, int64_t i0, int64_t m, int64_t nk) {
  return std::max<int64_t>(rows.limit(h, i0 + m - 1, nk), std::min<int64_t>(nk, 1));
}

// Rows i0 .. i0 + m - 1 of query head h against keys 0 .. nk - 1: S = Q_blk · Kᵀ into sp (row stride
// lds), the row pass (logits, max, exp, sum, dropout; the statistics of each row), out_blk = P_dropped · V.
template <typename acc_t, typename Rows>
void fwd_block(const Rows& rows, const SoftmaxArgs& a, int64_t h, int64_t i0, int64_t m, int64_t nk, int64_t D,
               int64_t Dv, const acc_t* qb, int64_t ldq, const acc_t* kb, int64_t ldk, const acc_t* vb, int64_t ldv,
               acc_t* ob, int64_t ldo, acc_t* sp, int64_t lds, RowScratch<acc_t>& scratch, acc_t* max_p,
               acc_t* inv_p) {
  acc_t* z = scratch.z.data();
  nk = block_keys(rows, h, i0, m, nk);
  gemm_rm<acc_t>(false, true, m, nk, D, 1, qb, ldq, kb, ldk, 0, sp, lds);
  for (int64_t r = 0; r < m; ++r) {
    const int64_t i = i0 + r, R = rows.row(h, i);
    const int64_t n = rows.limit(h, i, nk);
    acc_t* row = sp + r * lds;
    const acc_t mx = n > 0 ? rows.logits(h, i, row, n, z) : -std::numeric_limits<acc_t>::infinity();
    int64_t done = 0;
    acc_t tail = 0;
    if (n > 0 && mx != -std::numeric_limits<acc_t>::infinity()) {
      const acc_t sum = exp_sum(z, n, mx);
      const acc_t inv = acc_t(1) / sum;
      tail = acc_t(0) * inv;  // NaN in a NaN row, as eager
      max_p[R] = mx;
      inv_p[R] = inv;
      if (a.dropout.active) {
        fill_mult(a.dropout, a.keep_scale, rows.drop(h, i), n, scratch);
        const acc_t* mult = scratch.mult.data();
        for (int64_t j = 0; j < n; ++j) row[j] = z[j] * inv * mult[j];
      } else {
        for (int64_t j = 0; j < n; ++j) row[j] = z[j] * inv;
      }
      done = n;
    } else {
      max_p[R] = -std::numeric_limits<acc_t>::infinity();  // fully masked: zeros
      inv_p[R] = acc_t(0);
    }
    for (int64_t j = done; j < nk; ++j) row[j] = tail;
  }
  gemm_rm<acc_t>(false, false, m, Dv, nk, 1, sp, lds, vb, ldv, 0, ob, ldo);
}

template <typename scalar_t, typename mask_t>
void fwd(const Shapes& s, const SoftmaxArgs& a, const MaskView& mv, const at::Tensor& q, const at::Tensor& k,
         const at::Tensor& v, at::Tensor& out, at::Tensor& stats) {
  using acc_t = scalar_t;  // float32 / float64 only
  const int64_t nblocks = (s.Lq + s.block - 1) / s.block;
  const int64_t items = s.B * s.Hq * nblocks;
  acc_t* max_p = stats.data_ptr<acc_t>();
  acc_t* inv_p = max_p + s.B * s.Hq * s.Lq;
  const std::vector<int64_t> keys = key_lengths<mask_t>(s, mv);
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    // Worker threads do not inherit the caller's dispatch state: the GEMMs below run on tensors
    // that may require grad, as plain computation (this kernel sits below autograd).
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    at::Tensor S = at::empty({s.block, s.Lk}, q.options());
    RowScratch<acc_t> scratch(s.Lk, a.dropout.active);
    for (int64_t it = begin; it < end; ++it) {
      const int64_t blk = it % nblocks, bh = it / nblocks, b = bh / s.Hq, h = bh % s.Hq;
      const int64_t i0 = blk * s.block, m = std::min(s.block, s.Lq - i0);
      const DenseRows<mask_t> rows{a, mv, b * s.Hq * s.Lq, s.Lq, s.Lk};
      fwd_block<acc_t>(rows, a, h, i0, m, keys[b], s.D, s.Dv, mat<acc_t>(q, b, h, i0), q.stride(2),
                       mat<acc_t>(k, b, h / s.groups), k.stride(2), mat<acc_t>(v, b, h / s.groups), v.stride(2),
                       mat<acc_t>(out, b, h, i0), out.stride(2), S.data_ptr<acc_t>(), s.Lk, scratch, max_p, inv_p);
    }
  });
}

// One row of the backward, with z the row's logits and drow its dP = dO · Vᵀ (kDrop: mult holds the
// row's dropout multipliers). P = exp(z - max) / sum; g = dropout(dP); writes dS = scale * P *
// (g - rowsum(g * P)) into srow and the dropped P (P * mult) into drow, for the dV GEMM. With cap > 0
// srow holds the capped scores (row_logits) and dS gains the tanh's derivative, 1 - (srow / cap)^2.
template <bool kDrop, typename acc_t>
inline void backward_row(acc_t* z, acc_t* srow, acc_t* drow, const acc_t* mult, int64_t n, acc_t mx, acc_t inv,
                         acc_t scale, acc_t cap) {
  constexpr int kLanes = softmax_impl::kLanes;
  acc_t ps[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      const acc_t p = softmax_impl::exp_nonpos(z[j + l] - mx) * inv;
      const acc_t g = kDrop ? drow[j + l] * mult[j + l] : drow[j + l];
      z[j + l] = p;
      drow[j + l] = g;
      ps[l] += g * p;
    }
  }
  for (; j < n; ++j) {
    const acc_t p = softmax_impl::exp_nonpos(z[j] - mx) * inv;
    const acc_t g = kDrop ? drow[j] * mult[j] : drow[j];
    z[j] = p;
    drow[j] = g;
    ps[0] += g * p;
  }
  acc_t dot = 0;
  for (int l = 0; l < kLanes; ++l) dot += ps[l];
  if (cap > 0) {
    for (int64_t c = 0; c < n; ++c) {
      const acc_t p = z[c], t = srow[c] / cap;
      srow[c] = scale * p * (drow[c] - dot) * (acc_t(1) - t * t);
      drow[c] = kDrop ? p * mult[c] : p;
    }
    return;
  }
  for (int64_t c = 0; c < n; ++c) {
    const acc_t p = z[c];
    srow[c] = scale * p * (drow[c] - dot);
    drow[c] = kDrop ? p * mult[c] : p;
  }
}

// One backward task: kv head hk of one batch element / sequence, its `groups` query heads of Lq rows
// in blocks of `block` against keys 0 .. nk - 1 (k, v, dk, dv at kb, vb, dkb, dvb with their row
// strides; q, grad_out, dq as Q, G, DQ). For each query head and block: S and dP = dO · Vᵀ into sp and
// pp (row stride lds), the row pass (P from the statistics, dS, the dropped P), then dV (+)= P_droppedᵀ ·
// dO, dQ_blk = dS · K, dK (+)= dSᵀ · Q_blk. Returns whether any query row ran (else dk, dv are unwritten).
template <typename acc_t, typename Rows>
bool bwd_task(const Rows& rows, const SoftmaxArgs& a, int64_t hk, int64_t groups, int64_t Lq, int64_t nk,
              int64_t block, int64_t D, int64_t Dv, const Rowed<acc_t>& Q, const Rowed<acc_t>& G,
              const Rowed<acc_t>& DQ, const acc_t* kb, int64_t ldk, const acc_t* vb, int64_t ldv, acc_t* dkb,
              int64_t lddk, acc_t* dvb, int64_t lddv, acc_t* sp, acc_t* pp, int64_t lds, RowScratch<acc_t>& scratch,
              const acc_t* max_p, const acc_t* inv_p) {
  const acc_t scale = static_cast<acc_t>(a.scale), cap = static_cast<acc_t>(a.softcap);
  const int64_t nblocks = (Lq + block - 1) / block;
  bool first = true;
  for (int64_t h = hk * groups; h < (hk + 1) * groups; ++h) {
    // last block first: it reads the most keys (all of them), so the first write of dk and dv covers
    // every row the later, causally shorter blocks add to
    for (int64_t blk = nblocks - 1; blk >= 0; --blk) {
      const int64_t i0 = blk * block, m = std::min(block, Lq - i0), nkb = block_keys(rows, h, i0, m, nk);
      TORCH_INTERNAL_ASSERT_DEBUG_ONLY(!first || nkb == nk);  // (the last row's causal limit is every key)
      const acc_t* qb = Q.at(h, i0);
      const acc_t* gb = G.at(h, i0);
      gemm_rm<acc_t>(false, true, m, nkb, D, 1, qb, Q.sl, kb, ldk, 0, sp, lds);     // the scores again
      gemm_rm<acc_t>(false, true, m, nkb, Dv, 1, gb, G.sl, vb, ldv, 0, pp, lds);    // dP = dO · Vᵀ
      for (int64_t r = 0; r < m; ++r) {
        const int64_t i = i0 + r, R = rows.row(h, i);
        const int64_t n = rows.limit(h, i, nkb);
        acc_t* row = sp + r * lds;
        acc_t* drow = pp + r * lds;
        const acc_t mx = max_p[R], inv = inv_p[R];
        int64_t done = 0;
        if (n > 0 && mx != -std::numeric_limits<acc_t>::infinity()) {
          acc_t* z = scratch.z.data();
          rows.logits(h, i, row, n, z);
          if (a.dropout.active) {  // one Philox pass per row serves dP and the dropped P
            fill_mult(a.dropout, a.keep_scale, rows.drop(h, i), n, scratch);
            backward_row<true>(z, row, drow, scratch.mult.data(), n, mx, inv, scale, cap);
          } else {
            backward_row<false>(z, row, drow, static_cast<const acc_t*>(nullptr), n, mx, inv, scale, cap);
          }
          done = n;
        }
        for (int64_t j = done; j < nkb; ++j) row[j] = drow[j] = acc_t(0);
      }
      const acc_t beta = first ? 0 : 1;
      // dV (+)= P_droppedᵀ · dO (the dropped P is in pp now)
      gemm_rm<acc_t>(true, false, nkb, Dv, m, 1, pp, lds, gb, G.sl, beta, dvb, lddv);
      // dQ_blk = dS · K, dK (+)= dSᵀ · Q_blk
      gemm_rm<acc_t>(false, false, m, D, nkb, 1, sp, lds, kb, ldk, 0, DQ.at(h, i0), DQ.sl);
      gemm_rm<acc_t>(true, false, nkb, D, m, 1, sp, lds, qb, Q.sl, beta, dkb, lddk);
      first = false;
    }
  }
  return !first;
}

// `bias_part` (optional, [3, B, Hq, D]): each (batch, head) task also writes the column sums of its
// dq, dk and dv rows there while they are in cache: summed over the batch, they are the bias
// gradients of the Q, K and V projections (the paper's BAIB folded into the attention backward).
template <typename scalar_t, typename mask_t>
void bwd(const Shapes& s, const SoftmaxArgs& a, const MaskView& mv, const at::Tensor& go, const at::Tensor& q,
         const at::Tensor& k, const at::Tensor& v, const at::Tensor& stats, at::Tensor& dq, at::Tensor& dk,
         at::Tensor& dv, const c10::optional<at::Tensor>& bias_part) {
  using acc_t = scalar_t;
  const acc_t* max_p = stats.data_ptr<acc_t>();
  const acc_t* inv_p = max_p + s.B * s.Hq * s.Lq;
  const std::vector<int64_t> keys = key_lengths<mask_t>(s, mv);
  at::parallel_for(0, s.B * s.Hk, 1, [&](int64_t begin, int64_t end) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;  // see fwd
    at::Tensor S = at::empty({s.block, s.Lk}, q.options());   // the scores, then dS
    at::Tensor Pd = at::empty({s.block, s.Lk}, q.options());  // dP, then the dropped P
    RowScratch<acc_t> scratch(s.Lk, a.dropout.active);
    for (int64_t bk = begin; bk < end; ++bk) {
      const int64_t b = bk / s.Hk, hk = bk % s.Hk, nk = keys[b];
      acc_t* dkb = mat<acc_t>(dk, b, hk);
      acc_t* dvb = mat<acc_t>(dv, b, hk);
      if (nk < s.Lk) {  // hidden keys get no gradient
        dk[b][hk].narrow(0, nk, s.Lk - nk).zero_();
        dv[b][hk].narrow(0, nk, s.Lk - nk).zero_();
      }
      const DenseRows<mask_t> rows{a, mv, b * s.Hq * s.Lq, s.Lq, s.Lk};
      const bool wrote = bwd_task<acc_t>(rows, a, hk, s.groups, s.Lq, nk, s.block, s.D, s.Dv, dense_rows<acc_t>(q, b),
                                         dense_rows<acc_t>(go, b), dense_rows<acc_t>(dq, b), mat<acc_t>(k, b, hk),
                                         k.stride(2), mat<acc_t>(v, b, hk), v.stride(2), dkb, dk.stride(2), dvb,
                                         dv.stride(2), S.data_ptr<acc_t>(), Pd.data_ptr<acc_t>(), s.Lk, scratch, max_p,
                                         inv_p);
      if (!wrote) {  // no query rows: the gradients of k and v are zero
        dk[b][hk].narrow(0, 0, nk).zero_();
        dv[b][hk].narrow(0, 0, nk).zero_();
      }
      if (bias_part) {  // [3, B, H, D], contiguous; groups == 1 (checked)
        acc_t* bp = bias_part->data_ptr<acc_t>();
        const int64_t part = s.B * s.Hq * s.D, at_bh = (b * s.Hq + hk) * s.D;
        col_sums<acc_t>(mat<acc_t>(dq, b, hk), s.Lq, dq.stride(2), s.D, bp + at_bh);
        col_sums<acc_t>(dkb, s.Lk, dk.stride(2), s.D, bp + part + at_bh);
        col_sums<acc_t>(dvb, s.Lk, dv.stride(2), s.Dv, bp + 2 * part + at_bh);
      }
    }
  });
}

// ------------------------------------------------------------------------------------------------
// Variable-length (packed) sequences: the same loops per sequence
// ------------------------------------------------------------------------------------------------

// Query rows per block of a sequence of L tokens: its [block, L] scores (in the backward two such
// buffers) within the 512 KB the dense form measured best, at least 16 rows.
inline int64_t varlen_block(int64_t L, int64_t element_size) {
  const int64_t budget = 512 * 1024 / element_size;
  return std::max<int64_t>(16, std::min<int64_t>(std::max<int64_t>(L, 1), budget / std::max<int64_t>(L, 1)));
}

// The sequences with rows, longest first (ties in order): the work items are handed out in this
// order, so the long sequences, most of the work, start first and the short ones fill in.
inline std::vector<int64_t> longest_first(const std::vector<int64_t>& cu) {
  std::vector<int64_t> order;
  for (int64_t b = 0; b + 1 < static_cast<int64_t>(cu.size()); ++b)
    if (cu[b + 1] > cu[b]) order.push_back(b);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t x, int64_t y) { return cu[x + 1] - cu[x] > cu[y + 1] - cu[y]; });
  return order;
}

// Runs work(i, state) for i in 0 .. n - 1 on up to torch's thread count of threads, the items handed
// out one at a time (dynamic: items of very different cost balance); state = make_state(), one per
// thread (its buffers). An item's results never depend on the thread that runs it.
template <typename MakeState, typename Work>
void for_each_item(int64_t n, MakeState&& make_state, Work&& work) {
  if (n <= 0) return;
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;  // see fwd
    auto state = make_state();
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) work(i, state);
  });
}

// The largest [block, L] score buffer of the sequences.
inline int64_t varlen_buffer(const std::vector<int64_t>& cu, int64_t element_size, int64_t* longest) {
  int64_t size = 0, lmax = 0;
  for (size_t b = 0; b + 1 < cu.size(); ++b) {
    const int64_t L = cu[b + 1] - cu[b];
    lmax = std::max(lmax, L);
    size = std::max(size, varlen_block(L, element_size) * L);
  }
  *longest = lmax;
  return size;
}

// Forward work items: (sequence, query head, block of rows), longest sequences first.
template <typename scalar_t>
void varlen_fwd_impl(const VarlenShapes& s, const SoftmaxArgs& a, const std::vector<int64_t>& cu, const at::Tensor& q,
                     const at::Tensor& k, const at::Tensor& v, at::Tensor& out, at::Tensor& stats) {
  using acc_t = scalar_t;
  struct Item {
    int64_t b, h, i0;
  };
  std::vector<Item> items;
  for (int64_t b : longest_first(cu)) {
    const int64_t L = cu[b + 1] - cu[b], block = varlen_block(L, q.element_size());
    for (int64_t h = 0; h < s.Hq; ++h)
      for (int64_t i0 = 0; i0 < L; i0 += block) items.push_back({b, h, i0});
  }
  int64_t lmax = 0;
  const int64_t buffer = varlen_buffer(cu, q.element_size(), &lmax);
  acc_t* max_p = stats.data_ptr<acc_t>();
  acc_t* inv_p = max_p + s.Hq * s.T;
  struct State {
    at::Tensor S;
    RowScratch<acc_t> scratch;
  };
  for_each_item(
      static_cast<int64_t>(items.size()),
      [&] { return State{at::empty({buffer}, q.options()), RowScratch<acc_t>(lmax, a.dropout.active)}; },
      [&](int64_t it, State& st) {
        const Item& w = items[it];
        const int64_t start = cu[w.b], L = cu[w.b + 1] - start, block = varlen_block(L, q.element_size());
        const int64_t m = std::min(block, L - w.i0), hk = w.h / s.groups;
        const VarlenRows rows{a.scale, a.causal, s.T, start};
        fwd_block<acc_t>(rows, a, w.h, w.i0, m, L, s.D, s.Dv, packed_rows<acc_t>(q, start).at(w.h, w.i0), q.stride(0),
                         packed_rows<acc_t>(k, start).at(hk), k.stride(0), packed_rows<acc_t>(v, start).at(hk),
                         v.stride(0), packed_rows<acc_t>(out, start).at(w.h, w.i0), out.stride(0),
                         st.S.template data_ptr<acc_t>(), L, st.scratch, max_p, inv_p);
      });
}

// Backward tasks: (sequence, kv head), longest sequences first; each writes its rows of dk and dv whole
// (the group's query heads summed in a fixed order) and its query heads' rows of dq.
template <typename scalar_t>
void varlen_bwd_impl(const VarlenShapes& s, const SoftmaxArgs& a, const std::vector<int64_t>& cu,
                     const at::Tensor& go, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const at::Tensor& stats, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv) {
  using acc_t = scalar_t;
  std::vector<std::pair<int64_t, int64_t>> tasks;  // (sequence, kv head)
  for (int64_t b : longest_first(cu))
    for (int64_t hk = 0; hk < s.Hk; ++hk) tasks.emplace_back(b, hk);
  int64_t lmax = 0;
  const int64_t buffer = varlen_buffer(cu, q.element_size(), &lmax);
  const acc_t* max_p = stats.data_ptr<acc_t>();
  const acc_t* inv_p = max_p + s.Hq * s.T;
  struct State {
    at::Tensor S, Pd;  // the scores, then dS; dP, then the dropped P
    RowScratch<acc_t> scratch;
  };
  for_each_item(
      static_cast<int64_t>(tasks.size()),
      [&] {
        return State{at::empty({buffer}, q.options()), at::empty({buffer}, q.options()),
                     RowScratch<acc_t>(lmax, a.dropout.active)};
      },
      [&](int64_t it, State& st) {
        const auto [b, hk] = tasks[it];
        const int64_t start = cu[b], L = cu[b + 1] - start;
        const VarlenRows rows{a.scale, a.causal, s.T, start};
        bwd_task<acc_t>(rows, a, hk, s.groups, L, L, varlen_block(L, q.element_size()), s.D, s.Dv,
                        packed_rows<acc_t>(q, start), packed_rows<acc_t>(go, start), packed_rows<acc_t>(dq, start),
                        packed_rows<acc_t>(k, start).at(hk), k.stride(0), packed_rows<acc_t>(v, start).at(hk),
                        v.stride(0), packed_rows<acc_t>(dk, start).at(hk), dk.stride(0),
                        packed_rows<acc_t>(dv, start).at(hk), dv.stride(0), st.S.template data_ptr<acc_t>(),
                        st.Pd.template data_ptr<acc_t>(), L, st.scratch, max_p, inv_p);
      });
}

template <typename scalar_t, typename F>
void with_mask(const MaskView& mv, F&& f) {
  switch (mv.kind) {
    case softmax_impl::kNoMask: f(NoMask{}); break;
    case softmax_impl::kMaskSame: f(scalar_t{}); break;
    case softmax_impl::kMaskFloat: f(float{}); break;
    case softmax_impl::kMaskBool: f(bool{}); break;
    default: TORCH_CHECK(false, "dmfx::attention: internal error: mask kind ", mv.kind);
  }
}

}  // namespace attention_impl

at::Tensor flash_fwd_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const c10::optional<at::Tensor>& mask, double scale, bool causal, int64_t seed,
                         int64_t offset, double p, at::Tensor out, double softcap) {
  using namespace attention_impl;
  const Shapes s = check("flash_fwd", q, k, v);
  check_out("flash_fwd", "out", out, {s.B, s.Hq, s.Lq, s.Dv}, q);
  const SoftmaxArgs a = row_args(s, scale, causal, seed, offset, p, softcap);
  at::Tensor stats = at::empty({2, s.B, s.Hq, s.Lq}, q.options());
  if (flash_fwd_trivial(s, out, stats)) return stats;
  const MaskView mv = mask_view("flash_fwd", mask, s, q);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "dmfx_flash_fwd", [&] {
    with_mask<scalar_t>(mv, [&](auto tag) { fwd<scalar_t, decltype(tag)>(s, a, mv, q, k, v, out, stats); });
  });
  return stats;
}

void flash_bwd_cpu(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& stats, const c10::optional<at::Tensor>& mask, double scale, bool causal,
                   int64_t seed, int64_t offset, double p, at::Tensor dq, at::Tensor dk, at::Tensor dv,
                   const c10::optional<at::Tensor>& bias_part, double softcap) {
  using namespace attention_impl;
  const Shapes s = check("flash_bwd", q, k, v);
  check_backward(s, grad_out, q, k, v, stats, q.scalar_type(), dq, dk, dv, bias_part);  // (stats in q's dtype)
  const SoftmaxArgs a = row_args(s, scale, causal, seed, offset, p, softcap);
  if (flash_bwd_trivial(s, dq, dk, dv, bias_part)) return;
  const MaskView mv = mask_view("flash_bwd", mask, s, q);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "dmfx_flash_bwd", [&] {
    with_mask<scalar_t>(mv, [&](auto tag) { bwd<scalar_t, decltype(tag)>(s, a, mv, grad_out, q, k, v, stats, dq, dk, dv, bias_part); });
  });
}

at::Tensor varlen_fwd_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens,
                          double scale, bool causal, int64_t seed, int64_t offset, double p, at::Tensor out) {
  using namespace attention_impl;
  const char* op = "varlen_fwd";
  const VarlenShapes s = check_varlen_qkv(op, q, k, v, cu_seqlens, "CPU", [](const at::Tensor& t) { return t.device().is_cpu(); });
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kDouble, "dmfx::", op,
              ": the fused CPU attention takes float32 or float64, got ", q.scalar_type());
  check_varlen_out(op, "out", out, {s.T, s.Hq, s.Dv}, q);
  const SoftmaxArgs a = varlen_args(scale, causal, seed, offset, p);
  const std::vector<int64_t> cu = cu_seqlens_values(op, cu_seqlens, s.T);
  at::Tensor stats = at::empty({2, s.Hq, s.T}, q.options());
  if (s.Hq * s.T == 0) return stats;
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "dmfx_varlen_fwd", [&] { varlen_fwd_impl<scalar_t>(s, a, cu, q, k, v, out, stats); });
  return stats;
}

void varlen_bwd_cpu(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& out, const at::Tensor& stats, const at::Tensor& cu_seqlens, double scale,
                    bool causal, int64_t seed, int64_t offset, double p, at::Tensor dq, at::Tensor dk, at::Tensor dv) {
  using namespace attention_impl;
  const char* op = "varlen_bwd";
  const VarlenShapes s = check_varlen_qkv(op, q, k, v, cu_seqlens, "CPU", [](const at::Tensor& t) { return t.device().is_cpu(); });
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kDouble, "dmfx::", op,
              ": the fused CPU attention takes float32 or float64, got ", q.scalar_type());
  check_varlen_backward(s, grad_out, q, k, v, out, stats, q.scalar_type(), dq, dk, dv);  // (stats in q's dtype)
  const SoftmaxArgs a = varlen_args(scale, causal, seed, offset, p);
  const std::vector<int64_t> cu = cu_seqlens_values(op, cu_seqlens, s.T);
  if (s.Hk * s.T == 0) return;
  // (out is not read: the row pass computes rowsum(dropout(dP) * P) from the scores it recomputes)
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "dmfx_varlen_bwd", [&] {
    varlen_bwd_impl<scalar_t>(s, a, cu, grad_out, q, k, v, stats, dq, dk, dv);
  });
}

// Whether the flash kernels call BLAS directly (the default when libtorch links one); returns the
// previous setting. Off, they run the same GEMMs through at::addmm_out (the fallback path).
bool flash_use_blas(bool on) { return attention_impl::use_blas().exchange(on); }

}  // namespace dmfx

#else  // DMFX_CPU_GLUE: the glue (in cpu_bindings.cpp's translation unit)
#include <torch/csrc/utils/pybind.h>

#include "cpu_kernels.h"

namespace dmfx {
bool flash_use_blas(bool on);

void bind_attention(pybind11::module_& m) {
  m.def("flash_use_blas", &flash_use_blas, "flash kernels: call BLAS directly (true) or through ATen (false)",
        pybind11::arg("on"));
  m.def("flash_fwd", &flash_fwd_cpu,
        "fused attention forward that keeps the scores in cache (CPU); writes out, returns the row statistics",
        pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("mask"), pybind11::arg("scale"),
        pybind11::arg("causal"), pybind11::arg("seed"), pybind11::arg("offset"), pybind11::arg("p"),
        pybind11::arg("out"), pybind11::arg("softcap") = 0.0);
  m.def("flash_bwd", &flash_bwd_cpu, "fused attention backward (CPU); writes dq, dk and dv in place",
        pybind11::arg("grad_out"), pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("stats"),
        pybind11::arg("mask"), pybind11::arg("scale"), pybind11::arg("causal"), pybind11::arg("seed"),
        pybind11::arg("offset"), pybind11::arg("p"), pybind11::arg("dq"), pybind11::arg("dk"), pybind11::arg("dv"),
        pybind11::arg("bias_part") = pybind11::none(), pybind11::arg("softcap") = 0.0);
  m.def("varlen_fwd", &varlen_fwd_cpu,
        "fused attention over packed variable-length sequences (CPU); writes out [T, Hq, Dv], returns the row "
        "statistics [2, Hq, T]",
        pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("cu_seqlens"), pybind11::arg("scale"),
        pybind11::arg("causal"), pybind11::arg("seed"), pybind11::arg("offset"), pybind11::arg("p"),
        pybind11::arg("out"));
  m.def("varlen_bwd", &varlen_bwd_cpu,
        "fused attention backward over packed variable-length sequences (CPU); writes dq, dk and dv in place",
        pybind11::arg("grad_out"), pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("out"),
        pybind11::arg("stats"), pybind11::arg("cu_seqlens"), pybind11::arg("scale"), pybind11::arg("causal"),
        pybind11::arg("seed"), pybind11::arg("offset"), pybind11::arg("p"), pybind11::arg("dq"), pybind11::arg("dk"),
        pybind11::arg("dv"));
}

}  // namespace dmfx

#ifndef DMFX_KERNELS_ONLY
// ------------------------------------------------------------------------------------------------
// The ops: CPU kernels (through the kernel table: cpu_kernels.h) and the family's autograd formulas
// (for every device: the CUDA module registers kernels only)
// ------------------------------------------------------------------------------------------------
#include "attention_ops.h"

namespace dmfx {
namespace attention_ops {
namespace {

struct CpuAttention {
  // The CPU fused kernels: float32 and float64, any head dims.
  static bool flash_ok(const Tensor& q, const Tensor&) {
    return q.scalar_type() == at::kFloat || q.scalar_type() == at::kDouble;
  }
  template <class... A>
  static Tensor flash_fwd(A&&... a) { return cpu_kernels().flash_fwd(std::forward<A>(a)...); }
  template <class... A>
  static void flash_bwd(A&&... a) { cpu_kernels().flash_bwd(std::forward<A>(a)...); }
  // The varlen kernels: float32 and float64; float16 / bfloat16 computed in float32.
  static bool varlen_ok(const Tensor& q, const Tensor&) { return is_score_dtype(q.scalar_type()); }
  static at::ScalarType varlen_dtype(at::ScalarType st) {
    return st == at::kHalf || st == at::kBFloat16 ? at::kFloat : st;
  }
  template <class... A>
  static Tensor varlen_fwd(A&&... a) { return cpu_kernels().varlen_fwd(std::forward<A>(a)...); }
  template <class... A>
  static void varlen_bwd(A&&... a) { cpu_kernels().varlen_bwd(std::forward<A>(a)...); }
};

// What the GEMM form's Functions keep of a forward besides its tensors: scale, p, the mask's shape and
// dtype (its gradient is summed to them); no gradient is materialized for an output that got none.
void save_common(AutogradContext* ctx, const Opt& mask, double scale, double p) {
  ctx->saved_data["scale"] = scale;
  ctx->saved_data["p"] = p;
  if (present(mask)) {
    ctx->saved_data["mask_shape"] = mask->sym_sizes();  // (symbolic when traced)
    ctx->saved_data["mask_dtype"] = static_cast<int64_t>(mask->scalar_type());
  }
  ctx->set_materialize_grads(false);
}

Tensor mask_grad(AutogradContext* ctx, const Tensor& dz) {
  return dz.sum_to_size_symint(ctx->saved_data["mask_shape"].toSymIntVector())
      .to(static_cast<at::ScalarType>(ctx->saved_data["mask_dtype"].toInt()));
}

// The output's gradient, or zeros (in the output's layout) where only the probabilities got one.
Tensor materialize(const Tensor& grad_out, const Tensor& q, const Tensor& v) {
  return grad_out.defined() ? grad_out : context(q, v).zero_();
}

Tensor materialize_qkv(const Tensor& grad_out, const Tensor& qkv, int64_t heads) {
  if (grad_out.defined()) return grad_out;
  return blhd(qkv.sym_size(0), heads, qkv.sym_size(1), qkv.sym_size(2) / (3 * heads), qkv).zero_();
}

double saved_double(AutogradContext* ctx, const char* key) { return ctx->saved_data[key].toDouble(); }

struct AttentionFn : public torch::autograd::Function<AttentionFn> {
  static constexpr const char* name = "dmfx::attention";
  using Sig = decltype(attention);
  static variable_list forward(AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& v, const Opt& mask,
                               double scale, bool causal, const Opt& seed, double p) {
    auto out = AutogradKernel<AttentionFn>::below(q, k, v, mask, scale, causal, seed, p);
    ctx->saved_data["needs"] = needs_bits(q, k, v, mask);
    save_common(ctx, mask, scale, p);
    ctx->save_for_backward({q, k, v, out[1], out[2], seed.value_or(Tensor())});
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    const bool need_mask = needs(ctx, 3);
    if (!(needs(ctx, 0) || needs(ctx, 1) || needs(ctx, 2) || need_mask)) return variable_list(8);
    const auto s = ctx->get_saved_variables();  // q, k, v, probs, dropped, seed
    static const auto backward_op = dmfx_op<decltype(attention_backward)>("dmfx::attention_backward");
    auto [dq, dk, dv, dz] = backward_op.call(materialize(g[0], s[0], s[2]), s[0], s[1], s[2], s[3], s[4], opt(s[5]),
                                             saved_double(ctx, "p"), saved_double(ctx, "scale"), need_mask, opt(g[1]),
                                             opt(g[2]));
    return {dq, dk, dv, need_mask ? mask_grad(ctx, dz) : Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

struct QkvAttentionFn : public torch::autograd::Function<QkvAttentionFn> {
  static constexpr const char* name = "dmfx::qkv_attention";
  using Sig = decltype(qkv_attention);
  static variable_list forward(AutogradContext* ctx, const Tensor& qkv, int64_t heads, const Opt& mask, double scale,
                               bool causal, const Opt& seed, double p) {
    auto out = AutogradKernel<QkvAttentionFn>::below(qkv, heads, mask, scale, causal, seed, p);
    ctx->saved_data["needs"] = needs_bits(qkv, heads, mask);
    ctx->saved_data["heads"] = heads;
    save_common(ctx, mask, scale, p);
    ctx->save_for_backward({qkv, out[1], out[2], seed.value_or(Tensor())});
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    const bool need_mask = needs(ctx, 2);
    if (!(needs(ctx, 0) || need_mask)) return variable_list(7);
    const auto s = ctx->get_saved_variables();  // qkv, probs, dropped, seed
    const int64_t heads = ctx->saved_data["heads"].toInt();
    static const auto backward_op = dmfx_op<decltype(qkv_attention_backward)>("dmfx::qkv_attention_backward");
    auto [dqkv, dz] = backward_op.call(materialize_qkv(g[0], s[0], heads), s[0], heads, s[1], s[2], opt(s[3]),
                                       saved_double(ctx, "p"), saved_double(ctx, "scale"), need_mask, opt(g[1]),
                                       opt(g[2]));
    return {dqkv, Tensor(), need_mask ? mask_grad(ctx, dz) : Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

// The fused form's Functions: the backward recomputes the scores from the row statistics (not
// differentiable); no mask gradient (the attention pass uses dmfx::attention for a mask that needs one).
void save_flash(AutogradContext* ctx, variable_list tensors, const variable_list& out, const Opt& mask, double scale,
                bool causal, const Opt& seed, double p, double softcap = 0.0) {
  ctx->saved_data["scale"] = scale;
  ctx->saved_data["softcap"] = softcap;
  ctx->saved_data["causal"] = causal;
  ctx->saved_data["p"] = p;
  ctx->set_materialize_grads(false);
  ctx->mark_non_differentiable({out[1]});  // the row statistics are for the backward only
  tensors.insert(tensors.end(), {out[1], mask.value_or(Tensor()), seed.value_or(Tensor())});
  ctx->save_for_backward(tensors);
}

// Whether the fused backward has anything to do with these gradients (it raises for what it lacks).
bool flash_grads_needed(AutogradContext* ctx, int mask_index, const variable_list& g) {
  TORCH_CHECK_NOT_IMPLEMENTED(!needs(ctx, mask_index),
                              "dmfx::flash_attention: the mask requires grad (e.g. a learned position bias); the fused "
                              "form does not compute a mask gradient. dmfx's attention pass uses dmfx::attention for "
                              "such masks.");
  TORCH_CHECK_NOT_IMPLEMENTED(!g[1].defined(),
                              "dmfx::flash_attention: a gradient through the row statistics is not supported");
  return g[0].defined();
}

struct FlashAttentionFn : public torch::autograd::Function<FlashAttentionFn> {
  static constexpr const char* name = "dmfx::flash_attention";
  using Sig = decltype(flash_attention<CpuAttention>);
  static variable_list forward(AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& v, const Opt& mask,
                               double scale, bool causal, const Opt& seed, double p, double softcap) {
    auto out = AutogradKernel<FlashAttentionFn>::below(q, k, v, mask, scale, causal, seed, p, softcap);
    ctx->saved_data["needs"] = needs_bits(q, k, v, mask);
    save_flash(ctx, {q, k, v}, out, mask, scale, causal, seed, p, softcap);
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    if (!flash_grads_needed(ctx, 3, g)) return variable_list(9);
    const auto s = ctx->get_saved_variables();  // q, k, v, stats, mask, seed
    static const auto backward_op =
        dmfx_op<decltype(flash_attention_backward<CpuAttention>)>("dmfx::flash_attention_backward");
    auto r = backward_op.call(g[0], s[0], s[1], s[2], s[3], opt(s[4]), saved_double(ctx, "scale"),
                              ctx->saved_data["causal"].toBool(), opt(s[5]), saved_double(ctx, "p"), false,
                              saved_double(ctx, "softcap"));
    return {std::get<0>(r), std::get<1>(r), std::get<2>(r), Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

struct QkvFlashAttentionFn : public torch::autograd::Function<QkvFlashAttentionFn> {
  static constexpr const char* name = "dmfx::qkv_flash_attention";
  using Sig = decltype(qkv_flash_attention<CpuAttention>);
  static variable_list forward(AutogradContext* ctx, const Tensor& qkv, int64_t heads, const Opt& mask, double scale,
                               bool causal, const Opt& seed, double p) {
    auto out = AutogradKernel<QkvFlashAttentionFn>::below(qkv, heads, mask, scale, causal, seed, p);
    ctx->saved_data["needs"] = needs_bits(qkv, heads, mask);
    ctx->saved_data["heads"] = heads;
    save_flash(ctx, {qkv}, out, mask, scale, causal, seed, p);
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    if (!flash_grads_needed(ctx, 2, g)) return variable_list(7);
    const auto s = ctx->get_saved_variables();  // qkv, stats, mask, seed
    static const auto backward_op =
        dmfx_op<decltype(qkv_flash_attention_backward<CpuAttention>)>("dmfx::qkv_flash_attention_backward");
    // (the backward pass, passes/backward/, asks for the bias gradient when a bias is trained)
    auto r = backward_op.call(g[0], s[0], ctx->saved_data["heads"].toInt(), s[1], opt(s[2]), saved_double(ctx, "scale"),
                              ctx->saved_data["causal"].toBool(), opt(s[3]), saved_double(ctx, "p"), false);
    return {std::get<0>(r), Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

// The varlen form's Functions: the backward (through dmfx::varlen_attention_backward /
// qkv_varlen_attention_backward) reads the forward's output (CUDA: delta = rowsum(dO ∘ O)) and row
// statistics (not differentiable); cu_seqlens and the seed get no gradient.
void save_varlen(AutogradContext* ctx, variable_list tensors, const variable_list& out, const Tensor& cu_seqlens,
                 double scale, bool causal, const Opt& seed, double p) {
  ctx->saved_data["scale"] = scale;
  ctx->saved_data["causal"] = causal;
  ctx->saved_data["p"] = p;
  ctx->set_materialize_grads(false);
  ctx->mark_non_differentiable({out[1]});
  tensors.insert(tensors.end(), {out[0], out[1], cu_seqlens, seed.value_or(Tensor())});
  ctx->save_for_backward(tensors);
}

bool varlen_grads_needed(const variable_list& g) {
  TORCH_CHECK_NOT_IMPLEMENTED(!g[1].defined(),
                              "dmfx::varlen_attention: a gradient through the row statistics (stats) is not supported");
  return g[0].defined();
}

struct VarlenAttentionFn : public torch::autograd::Function<VarlenAttentionFn> {
  static constexpr const char* name = "dmfx::varlen_attention";
  using Sig = decltype(varlen_attention<CpuAttention>);
  static variable_list forward(AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& v,
                               const Tensor& cu_seqlens, double scale, bool causal, const Opt& seed, double p) {
    auto out = AutogradKernel<VarlenAttentionFn>::below(q, k, v, cu_seqlens, scale, causal, seed, p);
    save_varlen(ctx, {q, k, v}, out, cu_seqlens, scale, causal, seed, p);
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    if (!varlen_grads_needed(g)) return variable_list(8);
    const auto s = ctx->get_saved_variables();  // q, k, v, out, stats, cu_seqlens, seed
    static const auto backward_op =
        dmfx_op<decltype(varlen_attention_backward<CpuAttention>)>("dmfx::varlen_attention_backward");
    auto [dq, dk, dv] = backward_op.call(g[0], s[0], s[1], s[2], s[3], s[4], s[5], saved_double(ctx, "scale"),
                                         ctx->saved_data["causal"].toBool(), opt(s[6]), saved_double(ctx, "p"));
    return {dq, dk, dv, Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

struct QkvVarlenAttentionFn : public torch::autograd::Function<QkvVarlenAttentionFn> {
  static constexpr const char* name = "dmfx::qkv_varlen_attention";
  using Sig = decltype(qkv_varlen_attention<CpuAttention>);
  static variable_list forward(AutogradContext* ctx, const Tensor& qkv, int64_t heads, const Tensor& cu_seqlens,
                               double scale, bool causal, const Opt& seed, double p) {
    auto out = AutogradKernel<QkvVarlenAttentionFn>::below(qkv, heads, cu_seqlens, scale, causal, seed, p);
    ctx->saved_data["heads"] = heads;
    save_varlen(ctx, {qkv}, out, cu_seqlens, scale, causal, seed, p);
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    if (!varlen_grads_needed(g)) return variable_list(7);
    const auto s = ctx->get_saved_variables();  // qkv, out, stats, cu_seqlens, seed
    static const auto backward_op =
        dmfx_op<decltype(qkv_varlen_attention_backward<CpuAttention>)>("dmfx::qkv_varlen_attention_backward");
    Tensor dqkv = backward_op.call(g[0], s[0], ctx->saved_data["heads"].toInt(), s[1], s[2], s[3],
                                   saved_double(ctx, "scale"), ctx->saved_data["causal"].toBool(), opt(s[4]),
                                   saved_double(ctx, "p"));
    return {dqkv, Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

template <class Fn>
struct BackwardOp {  // a backward op of the family, for NoDoubleBackward
  static constexpr const char* name = Fn::name;
  static constexpr const char* hint = "dmfx.attention";
  using Sig = typename Fn::Sig;
};
struct AttentionBackward {
  static constexpr const char* name = "dmfx::attention_backward";
  using Sig = decltype(attention_backward);
};
struct QkvAttentionBackward {
  static constexpr const char* name = "dmfx::qkv_attention_backward";
  using Sig = decltype(qkv_attention_backward);
};
struct FlashAttentionBackward {
  static constexpr const char* name = "dmfx::flash_attention_backward";
  using Sig = decltype(flash_attention_backward<CpuAttention>);
};
struct QkvFlashAttentionBackward {
  static constexpr const char* name = "dmfx::qkv_flash_attention_backward";
  using Sig = decltype(qkv_flash_attention_backward<CpuAttention>);
};
struct VarlenAttentionBackward {
  static constexpr const char* name = "dmfx::varlen_attention_backward";
  using Sig = decltype(varlen_attention_backward<CpuAttention>);
};
struct QkvVarlenAttentionBackward {
  static constexpr const char* name = "dmfx::qkv_varlen_attention_backward";
  using Sig = decltype(qkv_varlen_attention_backward<CpuAttention>);
};

}  // namespace
}  // namespace attention_ops
}  // namespace dmfx

TORCH_LIBRARY_IMPL(dmfx, CPU, m) { dmfx::attention_ops::register_kernels<dmfx::attention_ops::CpuAttention>(m); }

TORCH_LIBRARY_IMPL(dmfx, Autograd, m) {
  using namespace dmfx;
  using namespace dmfx::attention_ops;
  m.impl("attention", &AutogradKernel<AttentionFn>::call);
  m.impl("qkv_attention", &AutogradKernel<QkvAttentionFn>::call);
  m.impl("flash_attention", &AutogradKernel<FlashAttentionFn>::call);
  m.impl("qkv_flash_attention", &AutogradKernel<QkvFlashAttentionFn>::call);
  m.impl("attention_backward", &AutogradKernel<NoDoubleBackward<BackwardOp<AttentionBackward>>>::call);
  m.impl("qkv_attention_backward", &AutogradKernel<NoDoubleBackward<BackwardOp<QkvAttentionBackward>>>::call);
  m.impl("flash_attention_backward", &AutogradKernel<NoDoubleBackward<BackwardOp<FlashAttentionBackward>>>::call);
  m.impl("qkv_flash_attention_backward",
         &AutogradKernel<NoDoubleBackward<BackwardOp<QkvFlashAttentionBackward>>>::call);
  m.impl("varlen_attention", &AutogradKernel<VarlenAttentionFn>::call);
  m.impl("qkv_varlen_attention", &AutogradKernel<QkvVarlenAttentionFn>::call);
  m.impl("varlen_attention_backward", &AutogradKernel<NoDoubleBackward<BackwardOp<VarlenAttentionBackward>>>::call);
  m.impl("qkv_varlen_attention_backward",
         &AutogradKernel<NoDoubleBackward<BackwardOp<QkvVarlenAttentionBackward>>>::call);
}
#endif  // DMFX_KERNELS_ONLY
#endif  // DMFX_CPU_GLUE

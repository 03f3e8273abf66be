// dmfx CUDA fused ("flash") attention: the scores never reach global memory.
//
// attention_cpu.cpp is the specification: same arguments, checks, outputs and math (logits
// z = q·kᵀ * scale + mask, -inf past the causal limit; P = exp(z - max) / sum; dropout by the Philox
// mask of the [B, Hq, Lq, Lk] probabilities, element (b, h, i, j) = logical index
// ((b * Hq + h) * Lq + i) * Lk + j, so the keep/drop bits equal the CPU kernels' and the softmax
// kernels' bit for bit; stats [2, B, Hq, Lq] = row max of the logits and 1 / sum of their exps, float32).
// The device helpers it shares with the softmax kernels (mask reads, Philox multipliers,
// NaN-propagating max, exp, the launch stream) are in softmax_device.cuh.
//
// Design (FlashAttention-2's decomposition on CUDA cores, fp32 math for every input dtype)
// ------
// * Every kernel runs 256 threads as a 16 x 16 grid (ty = tid / 16, tx = tid % 16). A [rows, cols]
//   tile of scores is spread as rows ty * RM + r, columns tx + 16 * c: a row's values sit in the 16
//   lanes of one half-warp (row max / sum are 4 xor-shuffles), and the shared-memory reads of both
//   tile products below are free of bank conflicts (row strides are padded by 4 floats).
// * Tiles live in dynamic shared memory as float (converted once on load), zero-padded to the
//   head-dim template kHead (32, 64, 96, 128) and past the sequence ends, so padding adds nothing.
// * Forward (flash_fwd_kernel): a block per (batch, head, 64 query rows), looping over key tiles
//   with the online softmax (running max and sum per row in registers, the output rescaled when the
//   max grows); P (dropped out) goes through shared memory into O += P · V.
// * Backward: no atomics, three launches.
//   1. delta = rowsum(dO ∘ O) per query row (the forward kernel again, kDelta: the binding has no
//      `out`, so O is recomputed; it is the forward's O bit for bit). rowsum(dropout(dP) ∘ P) = dO · O.
//   2. flash_bwd_dq_kernel: a block per (batch, head, 64 query rows) looping over key tiles:
//      P = exp(z - max) * inv from stats, dP = dO · Vᵀ, dS = scale * P * (dropout(dP) - delta),
//      dQ += dS · K.
//   3. flash_bwd_dkdv_kernel: a block per (batch, kv head, 64 keys) looping over the group's query
//      heads and their query tiles (transposed products: keys are the tile rows): dV += P_droppedᵀ · dO,
//      dK += dSᵀ · Q, so a GQA group's sum needs no second pass.
//   Causal blocks skip the key (forward, dQ) or query (dK/dV) tiles the limit hides entirely.
// * Fully masked rows (max -inf) give zeros and no gradient, never NaN; a NaN logit propagates.
// * Shared memory: at most 112,384 bytes per block (dQ at kHead 128; two blocks fit on an H100/H200
//   SM), opted in with cudaFuncSetAttribute; dmfx.cuda_ops.attention.flash_supported runs the
//   unfused form on GPUs that offer less per block. 256 threads, at most 128 registers (two blocks).
// * Per-row data of a step (causal limit, mask row offset, the backward's stats) sits in a small
//   shared table (RowTable), not in registers: that is what keeps the kernels near 128 registers.
// * bias_part (per-(batch, head) column sums of dq, dk, dv) is computed after the kernels with ATen
//   reductions: same values as the CPU kernel's, not fused.
// * Varlen (packed sequences, varlen_fwd / varlen_bwd): the same three kernels with kVarlen = true.
//   q [T, Hq, D] holds B sequences back to back (cu_seqlens [B + 1]); a block works on one (head,
//   64-row tile of one sequence): the forward and dQ on query tiles, dK/dV on key tiles, each tile
//   seeing only its own sequence's keys / queries. The grid cannot use the longest sequence (a host
//   read of cu_seqlens, a synchronization): varlen_tiles_kernel (one block) clamps each sequence into
//   [0, T] (so any cu_seqlens is memory-safe), counts its 64-row tiles and scans the counts; a
//   launch covers ceil(T / 64) + B tiles per head (an upper bound: each sequence wastes less than
//   one), each block finds its tile's sequence by binary search in the map and surplus blocks find
//   none and exit. Row index h * T + s + i (statistics [2, Hq, T], delta), Philox element
//   (h * T + s + i) * T + s + j. The backward's delta = rowsum(dO ∘ O) reads the forward's out
//   (varlen_delta_kernel) instead of recomputing O. Shared memory and registers as the dense kernels.
#include <ATen/ATen.h>
#include <torch/library.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "dmfx_common.h"
#include "kernel_api.h"
#include "softmax_api.h"
#include "attention_api.h"
#include "softmax_device.cuh"

namespace dmfx {
namespace attention_impl {

using softmax_impl::causal_limit;
using softmax_impl::MaskPtr;
using softmax_impl::MaskView;
using softmax_impl::SmPack;
using softmax_impl::SoftmaxArgs;

constexpr int kThreads = 256;      // 16 x 16
constexpr int kMaxHead = 128;      // largest head dim (D and Dv) of the kernels
constexpr int64_t kMaxGrid = 1 << 30;

// Tile sizes per padded head dim. Wider heads take narrower key (forward, dQ) and query (dK/dV)
// steps so that two blocks fit on an SM (H100/H200: 228 KB of shared memory per SM).
template <int kHead>
struct Tiles {
  static constexpr int kLd = kHead + 4;                 // row stride of a [rows, head] tile (floats)
  static constexpr int kQ = 64;                         // query rows per forward / dQ block
  static constexpr int kK = kHead <= 64 ? 64 : 32;      // keys per forward / dQ step
  static constexpr int kKeys = 64;                      // keys per dK/dV block
  static constexpr int kQStep = kHead <= 64 ? 64 : 32;  // query rows per dK/dV step
  // dynamic shared memory in floats: the tiles, then the row table (RowTable: 4 floats per row, 7 with
  // the backward's stats)
  static constexpr size_t fwd_floats = kQ * kLd + 2 * kK * kLd + kQ * (kK + 4) + 4 * kQ;
  static constexpr size_t dq_floats = 2 * kQ * kLd + 2 * kK * kLd + kQ * (kK + 4) + 7 * kQ;
  static constexpr size_t dkdv_floats = 2 * kKeys * kLd + 2 * kQStep * kLd + kKeys * (kQStep + 4) + 7 * kQStep;
};

// The most any kernel asks for; cuda_ops/attention.py's _CUDA_FLASH_SMEM_BYTES must say the same.
constexpr size_t kMaxSmemBytes = 112384;
static_assert(std::max({Tiles<32>::fwd_floats, Tiles<32>::dq_floats, Tiles<32>::dkdv_floats, Tiles<64>::fwd_floats,
                        Tiles<64>::dq_floats, Tiles<64>::dkdv_floats, Tiles<96>::fwd_floats, Tiles<96>::dq_floats,
                        Tiles<96>::dkdv_floats, Tiles<128>::fwd_floats, Tiles<128>::dq_floats,
                        Tiles<128>::dkdv_floats}) * sizeof(float) == kMaxSmemBytes,
              "update kMaxSmemBytes and _CUDA_FLASH_SMEM_BYTES in cuda_ops/attention.py");

// A [B, H, L, cols] operand with a unit column stride; vec: every row starts on a 4-element boundary
// and cols % 4 == 0 (4-wide loads).
template <typename T>
struct Mat {
  T* p = nullptr;
  int64_t sb = 0, sh = 0, sl = 0;
  bool vec = false;
  DMFX_HD T* at(int64_t b, int64_t h) const { return p + b * sb + h * sh; }
};

template <typename scalar_t>
struct Params {
  Mat<const scalar_t> q, k, v, go;  // go: grad_out (backward, and the delta pass)
  Mat<scalar_t> out, dq, dk, dv;
  float* stats = nullptr;  // [2, B, Hq, Lq]: max, then 1 / sum
  float* delta = nullptr;  // [B, Hq, Lq]: rowsum(dO ∘ O)
  MaskPtr mask;
  SoftmaxArgs a;  // scale, causal, dropout (Sq, Sk: unused, the lengths below are per sequence)
  int64_t B = 0, Hq = 0, Hk = 0, Lq = 0, Lk = 0, groups = 1;
  int64_t nstat = 0;  // rows of the statistics: B * Hq * Lq (dense), Hq * T (varlen)
  // varlen: the packed tokens and the tile map (varlen_tiles_kernel): the first tile of each sequence
  // [B + 1] (tiles[B]: the total), then the sequences' first rows [B] and lengths [B], clamped
  int64_t T = 0;
  const int64_t* tiles = nullptr;
  int D = 0, Dv = 0;
};

// ------------------------------------------------------------------------------------------------
// Device helpers
// ------------------------------------------------------------------------------------------------

__device__ __forceinline__ float neg_inf() { return softmax_impl::sm_neg_inf<float>(); }

// Max / sum over the 16 lanes of a half-warp (the 16 tx of one ty); every lane gets the result.
// All 32 lanes must call it (the xor partners stay inside each half).
__device__ __forceinline__ float half_warp_max(float v) {
#pragma unroll
  for (int m = 8; m > 0; m >>= 1) v = softmax_impl::sm_nan_max(v, __shfl_xor_sync(0xffffffffu, v, m));
  return v;
}

__device__ __forceinline__ float half_warp_sum(float v) {
#pragma unroll
  for (int m = 8; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
  return v;
}

// One row of a thread's accumulator tile into `row`: the columns tx + 16 n below `cols` (the dQ and
// dK/dV kernels' output stores).
template <int NC, typename scalar_t>
__device__ __forceinline__ void store_row(scalar_t* row, const float (&acc)[NC], int tx, int cols) {
#pragma unroll
  for (int n = 0; n < NC; ++n) {
    const int col = tx + 16 * n;
    if (col < cols) row[col] = static_cast<scalar_t>(acc[n]);
  }
}

// The keys query row i of a sequence of Lq queries and Lk keys sees: keys 0 .. limit - 1 (causal:
// j <= i + (Lk - Lq), aligned to the end as softmax_api.h's causal_limit; else all Lk).
__device__ __forceinline__ int64_t row_limit(bool causal, int64_t i, int64_t Lq, int64_t Lk) {
  if (!causal) return Lk;
  const int64_t lim = i + (Lk - Lq) + 1;
  return lim < 0 ? 0 : (lim > Lk ? Lk : lim);
}

// The keys any row of the query block [i0, i0 + rows) sees: the limit of its last row.
__device__ __forceinline__ int64_t block_key_end(bool causal, int64_t i0, int rows, int64_t Lq, int64_t Lk) {
  return row_limit(causal, (i0 + rows < Lq ? i0 + rows : Lq) - 1, Lq, Lk);
}

// ------------------------------------------------------------------------------------------------
// Addressing: dense [B, H, L, D] batches or packed variable-length sequences (kVarlen)
// ------------------------------------------------------------------------------------------------
// A block works on one batch element or sequence (Seq) and one head. Dense: batch element b, Lq
// queries and Lk keys; row i of query head h is probability row (b * Hq + h) * Lq + i, its Philox
// elements that row * Lk + j. Varlen (q [T, Hq, D] ..., Mats whose "batch" stride is the row stride):
// the sequence of L tokens from packed row s; row i of head h is row h * T + s + i of the
// block-diagonal [Hq, T, T] scores, its Philox elements that row * T + s + j. The row index also
// indexes the statistics and delta. Work items: dense (batch, head, 64-row tile); varlen (head, tile)
// with the tiles numbered across the sequences by varlen_tiles_kernel's map (no host ever reads
// cu_seqlens: the grid is sized from T and B, surplus blocks find no item and exit).

constexpr int kVarlenTile = 64;  // rows per varlen tile: the forward / dQ query tile and the dK/dV key tile
static_assert(Tiles<32>::kQ == kVarlenTile && Tiles<128>::kQ == kVarlenTile && Tiles<32>::kKeys == kVarlenTile &&
                  Tiles<128>::kKeys == kVarlenTile,
              "the varlen tile map assumes 64-row query and key tiles");

struct Seq {
  int64_t b;       // Mat::at's first index: the batch element, or the sequence's first packed row
  int64_t Lq, Lk;  // its queries and keys
  int64_t row0;    // row index of (head h, row i): row0 + h * rh + i
  int64_t rh;
  int64_t col0;    // Philox element of (row R, key j): R * ld + col0 + j
  int64_t ld;
};

template <bool kVarlen, typename scalar_t>
__device__ __forceinline__ Seq seq_of(const Params<scalar_t>& P, int64_t b) {
  if constexpr (kVarlen) {
    const int64_t start = P.tiles[P.B + 1 + b], len = P.tiles[2 * P.B + 1 + b];
    return Seq{start, len, len, start, P.T, start, P.T};
  } else {
    return Seq{b, P.Lq, P.Lk, b * P.Hq * P.Lq, P.Lq, 0, P.Lk};
  }
}

__device__ __forceinline__ uint64_t drop_index(const Seq& s, int64_t R, int64_t j) {
  return static_cast<uint64_t>(R * s.ld + s.col0 + j);
}

// The sequence that tile t (< tiles[B]) lies in: the last b < B with tiles[b] <= t.
__device__ __forceinline__ int64_t tile_sequence(const int64_t* tiles, int64_t B, int64_t t) {
  int64_t lo = 0, hi = B - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (tiles[mid] <= t) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

// Work items of a launch over `heads` heads: dense (batch, head, tile of `per` rows, nb tiles per
// batch element), varlen (head, tile of the map).
template <bool kVarlen, typename scalar_t>
__device__ __forceinline__ int64_t work_items(const Params<scalar_t>& P, int64_t heads, int64_t nb) {
  if constexpr (kVarlen) return heads * P.tiles[P.B];
  return P.B * heads * nb;
}

// Item `item` of such a launch: its Seq, head and first row (query rows for the forward and dQ, keys
// for dK/dV).
template <bool kVarlen, typename scalar_t>
__device__ __forceinline__ Seq work_item(const Params<scalar_t>& P, int64_t heads, int64_t nb, int per, int64_t item,
                                         int64_t& h, int64_t& r0) {
  if constexpr (kVarlen) {
    const int64_t ntiles = P.tiles[P.B], t = item % ntiles, b = tile_sequence(P.tiles, P.B, t);
    h = item / ntiles;
    r0 = (t - P.tiles[b]) * per;
    return seq_of<true>(P, b);
  } else {
    const int64_t bh = item / nb;
    h = bh % heads;
    r0 = (item % nb) * per;
    return seq_of<false>(P, bh / heads);
  }
}

// Dropout multiplier (0 or 1 / (1 - p); 1 without dropout) of probability element `idx`.
__device__ __forceinline__ float drop_mult(const SoftmaxArgs& a, float keep_scale, uint64_t idx) {
  return softmax_impl::sm_mult<float>(a.dropout, keep_scale, idx);
}

// Rows [row0, row0 + ROWS) of one [L, cols] matrix (row stride m.sl, from `base`) into dst[ROWS][kLd]
// as float; zeros past `rows` rows and `cols` columns, up to kHead. Called by all threads.
template <typename scalar_t, int ROWS, int kHead>
__device__ __forceinline__ void load_tile(float* dst, const Mat<const scalar_t>& m, const scalar_t* base,
                                          int64_t row0, int64_t rows, int cols) {
  constexpr int kChunks = kHead / 4, kLd = Tiles<kHead>::kLd;
  for (int e = threadIdx.x; e < ROWS * kChunks; e += kThreads) {
    const int r = e / kChunks, c0 = (e % kChunks) * 4;
    const int64_t row = row0 + r;
    float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
    if (row < rows && c0 < cols) {
      const scalar_t* src = base + row * m.sl + c0;
      if (m.vec) {
        const SmPack<scalar_t, 4> pk = *reinterpret_cast<const SmPack<scalar_t, 4>*>(src);
        x = make_float4(static_cast<float>(pk.v[0]), static_cast<float>(pk.v[1]), static_cast<float>(pk.v[2]),
                        static_cast<float>(pk.v[3]));
      } else {
        x.x = static_cast<float>(src[0]);
        if (c0 + 1 < cols) x.y = static_cast<float>(src[1]);
        if (c0 + 2 < cols) x.z = static_cast<float>(src[2]);
        if (c0 + 3 < cols) x.w = static_cast<float>(src[3]);
      }
    }
    *reinterpret_cast<float4*>(dst + r * kLd + c0) = x;
  }
}

// acc[r][c] += sum_{d < K} A[ty * RM + r][d] * B[tx + 16 c][d]  (both row-major, K % 4 == 0)
template <int RM, int CN, int K>
__device__ __forceinline__ void tile_nt(const float* A, int lda, const float* B, int ldb, float (&acc)[RM][CN]) {
  const float* a0 = A + (threadIdx.x >> 4) * RM * lda;
  const float* b0 = B + (threadIdx.x & 15) * ldb;
#pragma unroll 1
  for (int d = 0; d < K; d += 4) {
    float4 a[RM], b[CN];
#pragma unroll
    for (int r = 0; r < RM; ++r) a[r] = *reinterpret_cast<const float4*>(a0 + r * lda + d);
#pragma unroll
    for (int c = 0; c < CN; ++c) b[c] = *reinterpret_cast<const float4*>(b0 + c * 16 * ldb + d);
#pragma unroll
    for (int r = 0; r < RM; ++r) {
#pragma unroll
      for (int c = 0; c < CN; ++c) {
        float s = acc[r][c];
        s = fmaf(a[r].x, b[c].x, s);
        s = fmaf(a[r].y, b[c].y, s);
        s = fmaf(a[r].z, b[c].z, s);
        s = fmaf(a[r].w, b[c].w, s);
        acc[r][c] = s;
      }
    }
  }
}

// acc[r][c] += sum_{k < K} P[ty * RM + r][k] * X[k][tx + 16 c]  (both row-major, K % 4 == 0)
template <int RM, int CN, int K>
__device__ __forceinline__ void tile_nn(const float* P, int ldp, const float* X, int ldx, float (&acc)[RM][CN]) {
  const float* p0 = P + (threadIdx.x >> 4) * RM * ldp;
  const float* x0 = X + (threadIdx.x & 15);
#pragma unroll 1
  for (int k = 0; k < K; k += 4) {
    float4 p[RM];
#pragma unroll
    for (int r = 0; r < RM; ++r) p[r] = *reinterpret_cast<const float4*>(p0 + r * ldp + k);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      float x[CN];
#pragma unroll
      for (int c = 0; c < CN; ++c) x[c] = x0[(k + kk) * ldx + 16 * c];
#pragma unroll
      for (int r = 0; r < RM; ++r) {
        const float pv = kk == 0 ? p[r].x : kk == 1 ? p[r].y : kk == 2 ? p[r].z : p[r].w;
#pragma unroll
        for (int c = 0; c < CN; ++c) acc[r][c] = fmaf(pv, x[c], acc[r][c]);
      }
    }
  }
}

// Per-row data of a step's query rows, kept in shared memory so that the per-element passes hold
// few registers: the causal limit (keys lim.. are hidden; 0 for rows past Lq and, in the backward,
// for fully masked rows, which have no probabilities), the mask row offset, and in the backward the
// forward's row max, 1 / sum and the row's delta.
struct RowTable {
  int64_t* lim;
  int64_t* moff;
  float* mx;
  float* inv;
  float* dl;

  // The table of `rows` rows at `base` (8-byte aligned): 4 * rows floats, 7 * rows with stats.
  __device__ __forceinline__ static RowTable at(float* base, int rows) {
    RowTable t;
    t.lim = reinterpret_cast<int64_t*>(base);
    t.moff = t.lim + rows;
    t.mx = reinterpret_cast<float*>(t.moff + rows);
    t.inv = t.mx + rows;
    t.dl = t.inv + rows;
    return t;
  }
};

// Fills the table for query rows i0 .. i0 + rows - 1 of sequence sq (its head's row 0 has row index
// Rh). Called by all threads; the caller synchronizes before the table is read.
template <bool kStats, typename scalar_t>
__device__ __forceinline__ void fill_rows(const Params<scalar_t>& P, const RowTable& t, int rows, const Seq& sq,
                                          int64_t Rh, int64_t i0) {
  const int64_t N = P.nstat;
  for (int x = threadIdx.x; x < rows; x += kThreads) {
    const int64_t i = i0 + x, R = Rh + i;
    const bool valid = i < sq.Lq;
    int64_t lim = valid ? row_limit(P.a.causal, i, sq.Lq, sq.Lk) : 0;
    if constexpr (kStats) {
      const float mx = valid ? P.stats[R] : neg_inf();
      if (mx == neg_inf()) lim = 0;  // fully masked (a NaN max still runs: NaN propagates)
      t.mx[x] = mx;
      t.inv[x] = valid ? P.stats[N + R] : 0.f;
      t.dl[x] = valid ? P.delta[R] : 0.f;
    }
    t.lim[x] = lim;
    t.moff[x] = (P.mask.data && valid) ? P.mask.idx.offset(R) : 0;
  }
}

// Score `s` scaled, and soft-capped where there is a cap (Gemma 2): softcap * tanh(s * scale / softcap).
__device__ __forceinline__ float capped(const SoftmaxArgs& a, float s, float scale) {
  const float z = s * scale;
  if (a.softcap <= 0) return z;
  const float cap = static_cast<float>(a.softcap);
  return cap * tanhf(z / cap);
}

// The soft cap's factor in dS, the tanh's derivative 1 - (z / softcap)^2 of the capped score z (1 without a cap).
__device__ __forceinline__ float cap_grad(const SoftmaxArgs& a, float z) {
  if (a.softcap <= 0) return 1.f;
  const float t = z / static_cast<float>(a.softcap);
  return 1.f - t * t;
}

// The capped score z plus the mask at key j of the probability row whose mask row starts at moff.
template <typename scalar_t>
__device__ __forceinline__ float masked(const Params<scalar_t>& P, float z, int64_t moff, int64_t j) {
  return P.mask.data ? z + softmax_impl::sm_mask_at<scalar_t, float>(P.mask, moff, j) : z;
}

// Logit of score `s` at key j of the probability row whose mask row starts at moff (j below the
// row's causal limit).
template <typename scalar_t>
__device__ __forceinline__ float logit(const Params<scalar_t>& P, float s, float scale, int64_t moff, int64_t j) {
  return masked(P, capped(P.a, s, scale), moff, j);
}

// ------------------------------------------------------------------------------------------------
// Forward (and the backward's delta pass)
// ------------------------------------------------------------------------------------------------

// kDelta = false: writes out and stats. kDelta = true: writes delta[R] = sum_d dO[R][d] * O[R][d]
// (O as the forward computes it, before rounding to scalar_t; dense only: the varlen backward reads
// the forward's out, varlen_delta_kernel).
template <typename scalar_t, int kHead, bool kDelta, bool kVarlen>
__global__ void __launch_bounds__(kThreads, 2) flash_fwd_kernel(const Params<scalar_t> P) {
  using T = Tiles<kHead>;
  constexpr int BM = T::kQ, BN = T::kK, RM = BM / 16, CN = BN / 16, NC = kHead / 16, LD = T::kLd, LDP = BN + 4;
  extern __shared__ float4 dmfx_attn_smem[];
  float* Qs = reinterpret_cast<float*>(dmfx_attn_smem);  // [BM][LD]
  float* Ks = Qs + BM * LD;                               // [BN][LD]
  float* Vs = Ks + BN * LD;                               // [BN][LD]
  float* Ps = Vs + BN * LD;                               // [BM][LDP]: the dropped-out P of a step
  const RowTable rows = RowTable::at(Ps + BM * LDP, BM);  // lim, moff
  const int ty = threadIdx.x >> 4, tx = threadIdx.x & 15;
  const float scale = static_cast<float>(P.a.scale), keep_scale = static_cast<float>(P.a.keep_scale);
  const bool dropout = P.a.dropout.active;
  const int64_t nqb = (P.Lq + BM - 1) / BM, items = work_items<kVarlen>(P, P.Hq, nqb), N = P.nstat;
  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {  // uniform per block
    int64_t h, i0;
    const Seq sq = work_item<kVarlen>(P, P.Hq, nqb, BM, item, h, i0);
    const int64_t b = sq.b, hk = h / P.groups, Rh = sq.row0 + h * sq.rh;
    const int64_t R0 = Rh + i0 + ty * RM;  // probability row of this thread's row r: R0 + r
    __syncthreads();  // the previous item's reads of Qs and the row table are done
    load_tile<scalar_t, BM, kHead>(Qs, P.q, P.q.at(b, h), i0, sq.Lq, P.D);
    fill_rows<false>(P, rows, BM, sq, Rh, i0);
    float m[RM], l[RM], o[RM][NC];
#pragma unroll
    for (int r = 0; r < RM; ++r) {
      m[r] = neg_inf();
      l[r] = 0.f;
#pragma unroll
      for (int n = 0; n < NC; ++n) o[r][n] = 0.f;
    }
    const int64_t kend = block_key_end(P.a.causal, i0, BM, sq.Lq, sq.Lk);
    const scalar_t* kb = P.k.at(b, hk);
    const scalar_t* vb = P.v.at(b, hk);
    for (int64_t j0 = 0; j0 < kend; j0 += BN) {
      __syncthreads();  // Ks, Vs, Ps free again (Qs and the row table visible on the first step)
      load_tile<scalar_t, BN, kHead>(Ks, P.k, kb, j0, sq.Lk, P.D);
      load_tile<scalar_t, BN, kHead>(Vs, P.v, vb, j0, sq.Lk, P.Dv);
      __syncthreads();
      float s[RM][CN];
#pragma unroll
      for (int r = 0; r < RM; ++r)
#pragma unroll
        for (int c = 0; c < CN; ++c) s[r][c] = 0.f;
      tile_nt<RM, CN, kHead>(Qs, LD, Ks, LD, s);
#pragma unroll
      for (int r = 0; r < RM; ++r) {
        const int64_t lim = rows.lim[ty * RM + r], moff = rows.moff[ty * RM + r];
        float tmax = neg_inf();
#pragma unroll
        for (int c = 0; c < CN; ++c) {
          const int64_t j = j0 + tx + 16 * c;
          s[r][c] = j < lim ? logit(P, s[r][c], scale, moff, j) : neg_inf();
          tmax = softmax_impl::sm_nan_max(tmax, s[r][c]);
        }
        tmax = half_warp_max(tmax);
        const float mnew = softmax_impl::sm_nan_max(m[r], tmax);
        // while everything so far is masked (mnew = -inf) subtract 0: exp(-inf) = 0, never NaN
        const float msub = mnew == neg_inf() ? 0.f : mnew;
        const float alpha = softmax_impl::sm_exp(m[r] - msub);  // 0 while m[r] = -inf
        float tsum = 0.f;
#pragma unroll
        for (int c = 0; c < CN; ++c) {
          const int64_t j = j0 + tx + 16 * c;
          const float e = softmax_impl::sm_exp(s[r][c] - msub);
          tsum += e;
          const float pd = dropout ? e * drop_mult(P.a, keep_scale, drop_index(sq, R0 + r, j)) : e;
          Ps[(ty * RM + r) * LDP + tx + 16 * c] = pd;
        }
        tsum = half_warp_sum(tsum);
        l[r] = l[r] * alpha + tsum;
        m[r] = mnew;
#pragma unroll
        for (int n = 0; n < NC; ++n) o[r][n] *= alpha;
      }
      __syncthreads();
      tile_nn<RM, NC, BN>(Ps, LDP, Vs, LD, o);
    }
#pragma unroll
    for (int r = 0; r < RM; ++r) {
      const int64_t i = i0 + ty * RM + r;
      const bool empty = !(m[r] != neg_inf());  // fully masked (NaN is not empty: it propagates)
      const float inv = empty ? 0.f : 1.f / l[r];
      if constexpr (kDelta) {
        float dot = 0.f;
        if (i < sq.Lq && !empty) {
          const scalar_t* g = P.go.at(b, h) + i * P.go.sl;
#pragma unroll
          for (int n = 0; n < NC; ++n) {
            const int col = tx + 16 * n;
            if (col < P.Dv) dot += o[r][n] * inv * static_cast<float>(g[col]);
          }
        }
        dot = half_warp_sum(dot);
        if (tx == 0 && i < sq.Lq) P.delta[R0 + r] = dot;
      } else {
        if (i < sq.Lq) {
          scalar_t* orow = P.out.at(b, h) + i * P.out.sl;
#pragma unroll
          for (int n = 0; n < NC; ++n) {
            const int col = tx + 16 * n;
            if (col < P.Dv) orow[col] = static_cast<scalar_t>(empty ? 0.f : o[r][n] * inv);
          }
          if (tx == 0) {
            P.stats[R0 + r] = empty ? neg_inf() : m[r];
            P.stats[N + R0 + r] = inv;
          }
        }
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Backward: dQ
// ------------------------------------------------------------------------------------------------

template <typename scalar_t, int kHead, bool kVarlen>
__global__ void __launch_bounds__(kThreads, 2) flash_bwd_dq_kernel(const Params<scalar_t> P) {
  using T = Tiles<kHead>;
  constexpr int BM = T::kQ, BN = T::kK, RM = BM / 16, CN = BN / 16, NC = kHead / 16, LD = T::kLd, LDS = BN + 4;
  extern __shared__ float4 dmfx_attn_smem[];
  float* Qs = reinterpret_cast<float*>(dmfx_attn_smem);  // [BM][LD]
  float* Gs = Qs + BM * LD;                               // [BM][LD]: dO
  float* Ks = Gs + BM * LD;                               // [BN][LD]
  float* Vs = Ks + BN * LD;                               // [BN][LD]
  float* Ss = Vs + BN * LD;                               // [BM][LDS]: dS of a step
  const RowTable rows = RowTable::at(Ss + BM * LDS, BM);
  const int ty = threadIdx.x >> 4, tx = threadIdx.x & 15;
  const float scale = static_cast<float>(P.a.scale), keep_scale = static_cast<float>(P.a.keep_scale);
  const bool dropout = P.a.dropout.active;
  const int64_t nqb = (P.Lq + BM - 1) / BM, items = work_items<kVarlen>(P, P.Hq, nqb);
  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    int64_t h, i0;
    const Seq sq = work_item<kVarlen>(P, P.Hq, nqb, BM, item, h, i0);
    const int64_t b = sq.b, hk = h / P.groups, Rh = sq.row0 + h * sq.rh;
    const int64_t R0 = Rh + i0 + ty * RM;
    __syncthreads();  // the previous item's reads of Qs, Gs and the row table are done
    load_tile<scalar_t, BM, kHead>(Qs, P.q, P.q.at(b, h), i0, sq.Lq, P.D);
    load_tile<scalar_t, BM, kHead>(Gs, P.go, P.go.at(b, h), i0, sq.Lq, P.Dv);
    fill_rows<true>(P, rows, BM, sq, Rh, i0);
    float acc[RM][NC];
#pragma unroll
    for (int r = 0; r < RM; ++r)
#pragma unroll
      for (int n = 0; n < NC; ++n) acc[r][n] = 0.f;
    const int64_t kend = block_key_end(P.a.causal, i0, BM, sq.Lq, sq.Lk);
    const scalar_t* kb = P.k.at(b, hk);
    const scalar_t* vb = P.v.at(b, hk);
    for (int64_t j0 = 0; j0 < kend; j0 += BN) {
      __syncthreads();  // Ks, Vs, Ss free again (Qs, Gs and the row table visible on the first step)
      load_tile<scalar_t, BN, kHead>(Ks, P.k, kb, j0, sq.Lk, P.D);
      load_tile<scalar_t, BN, kHead>(Vs, P.v, vb, j0, sq.Lk, P.Dv);
      __syncthreads();
      float s[RM][CN], dp[RM][CN];
#pragma unroll
      for (int r = 0; r < RM; ++r)
#pragma unroll
        for (int c = 0; c < CN; ++c) s[r][c] = dp[r][c] = 0.f;
      tile_nt<RM, CN, kHead>(Qs, LD, Ks, LD, s);
      tile_nt<RM, CN, kHead>(Gs, LD, Vs, LD, dp);
#pragma unroll
      for (int r = 0; r < RM; ++r) {
        const int x = ty * RM + r;
        const int64_t lim = rows.lim[x], moff = rows.moff[x];
        const float mx = rows.mx[x], inv = rows.inv[x], dl = rows.dl[x];
#pragma unroll
        for (int c = 0; c < CN; ++c) {
          const int64_t j = j0 + tx + 16 * c;
          float ds = 0.f;
          if (j < lim) {
            const float z = capped(P.a, s[r][c], scale);
            const float p = softmax_impl::sm_exp(masked(P, z, moff, j) - mx) * inv;
            const float g =
                dropout ? dp[r][c] * drop_mult(P.a, keep_scale, drop_index(sq, R0 + r, j)) : dp[r][c];
            ds = scale * p * (g - dl) * cap_grad(P.a, z);
          }
          Ss[x * LDS + tx + 16 * c] = ds;
        }
      }
      __syncthreads();
      tile_nn<RM, NC, BN>(Ss, LDS, Ks, LD, acc);
    }
#pragma unroll
    for (int r = 0; r < RM; ++r) {
      const int64_t i = i0 + ty * RM + r;
      if (i >= sq.Lq) continue;
      store_row(P.dq.at(b, h) + i * P.dq.sl, acc[r], tx, P.D);
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Backward: dK and dV
// ------------------------------------------------------------------------------------------------

template <typename scalar_t, int kHead, bool kVarlen>
__global__ void __launch_bounds__(kThreads, 2) flash_bwd_dkdv_kernel(const Params<scalar_t> P) {
  using T = Tiles<kHead>;
  // tile rows are keys (RM per thread), tile columns queries (CN per thread)
  constexpr int BN = T::kKeys, BM = T::kQStep, RM = BN / 16, CN = BM / 16, NC = kHead / 16, LD = T::kLd,
                LDT = BM + 4;
  extern __shared__ float4 dmfx_attn_smem[];
  float* Ks = reinterpret_cast<float*>(dmfx_attn_smem);  // [BN][LD]
  float* Vs = Ks + BN * LD;                               // [BN][LD]
  float* Qs = Vs + BN * LD;                               // [BM][LD]
  float* Gs = Qs + BM * LD;                               // [BM][LD]: dO
  float* Ts = Gs + BM * LD;                               // [BN][LDT]: P_droppedᵀ, then dSᵀ
  const RowTable rows = RowTable::at(Ts + BN * LDT, BM);  // the step's query rows
  const int ty = threadIdx.x >> 4, tx = threadIdx.x & 15;
  const float scale = static_cast<float>(P.a.scale), keep_scale = static_cast<float>(P.a.keep_scale);
  const bool dropout = P.a.dropout.active;
  const int64_t nkb = (P.Lk + BN - 1) / BN, items = work_items<kVarlen>(P, P.Hk, nkb);
  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    int64_t hk, j0;
    const Seq sq = work_item<kVarlen>(P, P.Hk, nkb, BN, item, hk, j0);
    const int64_t b = sq.b;
    __syncthreads();  // the previous item's reads of Ks and Vs are done
    load_tile<scalar_t, BN, kHead>(Ks, P.k, P.k.at(b, hk), j0, sq.Lk, P.D);
    load_tile<scalar_t, BN, kHead>(Vs, P.v, P.v.at(b, hk), j0, sq.Lk, P.Dv);
    float dk[RM][NC], dv[RM][NC];
#pragma unroll
    for (int r = 0; r < RM; ++r)
#pragma unroll
      for (int n = 0; n < NC; ++n) dk[r][n] = dv[r][n] = 0.f;
    // causal: query i sees key j0 iff j0 < i + (Lk - Lq) + 1 (causal_limit), so rows before
    // j0 - (Lk - Lq) see none of this block's keys
    const int64_t first = (P.a.causal && j0 > sq.Lk - sq.Lq) ? j0 - (sq.Lk - sq.Lq) : 0;
    for (int64_t h = hk * P.groups; h < (hk + 1) * P.groups; ++h) {
      const int64_t Rh = sq.row0 + h * sq.rh;
      const scalar_t* qb = P.q.at(b, h);
      const scalar_t* gb = P.go.at(b, h);
      for (int64_t i0 = first / BM * BM; i0 < sq.Lq; i0 += BM) {
        __syncthreads();  // Qs, Gs, Ts and the row table free again (Ks, Vs visible on the first step)
        load_tile<scalar_t, BM, kHead>(Qs, P.q, qb, i0, sq.Lq, P.D);
        load_tile<scalar_t, BM, kHead>(Gs, P.go, gb, i0, sq.Lq, P.Dv);
        fill_rows<true>(P, rows, BM, sq, Rh, i0);
        __syncthreads();
        float s[RM][CN], dp[RM][CN];
#pragma unroll
        for (int r = 0; r < RM; ++r)
#pragma unroll
          for (int c = 0; c < CN; ++c) s[r][c] = dp[r][c] = 0.f;
        tile_nt<RM, CN, kHead>(Ks, LD, Qs, LD, s);   // Sᵀ
        tile_nt<RM, CN, kHead>(Vs, LD, Gs, LD, dp);  // dPᵀ (before dropout)
#pragma unroll
        for (int c = 0; c < CN; ++c) {
          const int x = tx + 16 * c;  // query row i0 + x
          const int64_t lim = rows.lim[x], moff = rows.moff[x], R = Rh + i0 + x;
          const float mx = rows.mx[x], inv = rows.inv[x], dl = rows.dl[x];
#pragma unroll
          for (int r = 0; r < RM; ++r) {
            const int64_t j = j0 + ty * RM + r;
            float pd = 0.f, ds = 0.f;
            if (j < lim) {  // lim <= Lk: keys past Lk, rows past Lq and fully masked rows skip
              const float z = capped(P.a, s[r][c], scale);
              const float p = softmax_impl::sm_exp(masked(P, z, moff, j) - mx) * inv;
              const float mult = dropout ? drop_mult(P.a, keep_scale, drop_index(sq, R, j)) : 1.f;
              pd = p * mult;
              ds = scale * p * (dp[r][c] * mult - dl) * cap_grad(P.a, z);
            }
            Ts[(ty * RM + r) * LDT + x] = pd;
            s[r][c] = ds;  // kept for the dK product
          }
        }
        __syncthreads();
        tile_nn<RM, NC, BM>(Ts, LDT, Gs, LD, dv);
        __syncthreads();
#pragma unroll
        for (int r = 0; r < RM; ++r)
#pragma unroll
          for (int c = 0; c < CN; ++c) Ts[(ty * RM + r) * LDT + tx + 16 * c] = s[r][c];
        __syncthreads();
        tile_nn<RM, NC, BM>(Ts, LDT, Qs, LD, dk);
      }
    }
#pragma unroll
    for (int r = 0; r < RM; ++r) {
      const int64_t j = j0 + ty * RM + r;
      if (j >= sq.Lk) continue;
      store_row(P.dk.at(b, hk) + j * P.dk.sl, dk[r], tx, P.D);
      store_row(P.dv.at(b, hk) + j * P.dv.sl, dv[r], tx, P.Dv);
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Varlen: the tile map and the backward's delta
// ------------------------------------------------------------------------------------------------

struct TileMapArgs {
  const void* cu = nullptr;  // cu_seqlens [B + 1], int32 or int64
  bool cu64 = false;
  int64_t B = 0, T = 0;
  int64_t* out = nullptr;  // [3 * B + 1]: Params::tiles
};

__device__ __forceinline__ int64_t cu_at(const TileMapArgs& M, int64_t i) {
  return M.cu64 ? static_cast<const int64_t*>(M.cu)[i] : static_cast<const int32_t*>(M.cu)[i];
}

// One block: sequence b's rows clamped into [0, T] (start = clamp(cu[b], 0, T), end = clamp(cu[b + 1],
// start, T): any cu_seqlens gives in-bounds sequences; a valid one gives its own), its kVarlenTile-row
// tiles counted, and the counts scanned into each sequence's first tile (out[0 .. B], out[B] = total).
__global__ void __launch_bounds__(kThreads) varlen_tiles_kernel(const TileMapArgs M) {
  __shared__ int64_t scan[kThreads];
  int64_t carry = 0;  // tiles of the chunks before (the same in every thread)
  for (int64_t b0 = 0; b0 < M.B; b0 += kThreads) {  // uniform
    const int64_t b = b0 + threadIdx.x;
    int64_t n = 0;
    if (b < M.B) {
      const int64_t c0 = cu_at(M, b), c1 = cu_at(M, b + 1);
      const int64_t start = c0 < 0 ? 0 : (c0 > M.T ? M.T : c0);
      const int64_t end = c1 < start ? start : (c1 > M.T ? M.T : c1);
      M.out[M.B + 1 + b] = start;
      M.out[2 * M.B + 1 + b] = end - start;
      n = (end - start + kVarlenTile - 1) / kVarlenTile;
    }
    scan[threadIdx.x] = n;
    __syncthreads();
    for (int off = 1; off < kThreads; off <<= 1) {  // inclusive scan (Hillis-Steele)
      const int64_t add = static_cast<int>(threadIdx.x) >= off ? scan[threadIdx.x - off] : 0;
      __syncthreads();
      scan[threadIdx.x] += add;
      __syncthreads();
    }
    if (b < M.B) M.out[b] = carry + scan[threadIdx.x] - n;
    carry += scan[kThreads - 1];
    __syncthreads();  // scan is rewritten by the next chunk
  }
  if (threadIdx.x == 0) M.out[M.B] = carry;
}

// delta[h * T + i] = sum_d dO[i, h, d] * O[i, h, d] with O the forward's output (as stored): 16 rows
// per block step, a half-warp per row.
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads) varlen_delta_kernel(const Params<scalar_t> P) {
  const int ty = threadIdx.x >> 4, tx = threadIdx.x & 15;
  const int64_t rows = P.Hq * P.T;
  for (int64_t r0 = static_cast<int64_t>(blockIdx.x) * 16; r0 < rows; r0 += static_cast<int64_t>(gridDim.x) * 16) {
    const int64_t r = r0 + ty;
    float dot = 0.f;
    if (r < rows) {
      const int64_t h = r / P.T, i = r % P.T;
      const scalar_t* g = P.go.at(i, h);
      const scalar_t* o = P.out.at(i, h);
      for (int c = tx; c < P.Dv; c += 16) dot += static_cast<float>(g[c]) * static_cast<float>(o[c]);
    }
    dot = half_warp_sum(dot);  // (all 32 lanes: the loop is uniform per block)
    if (tx == 0 && r < rows) P.delta[r] = dot;
  }
}

// ------------------------------------------------------------------------------------------------
// Host side
// ------------------------------------------------------------------------------------------------

inline Shapes check(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  Shapes s = check_qkv(op, q, k, v, "CUDA", [](const at::Tensor& t) { return t.device().is_cuda(); });
  const auto st = q.scalar_type();
  TORCH_CHECK(st == at::kFloat || st == at::kHalf || st == at::kBFloat16, "dmfx::", op,
              ": the fused CUDA attention takes float32, float16 or bfloat16, got ", st);
  TORCH_CHECK(s.D <= kMaxHead && s.Dv <= kMaxHead, "dmfx::", op,
              ": the fused CUDA attention takes head dims up to ", kMaxHead, ", got D = ", s.D, " and Dv = ", s.Dv,
              " (dmfx.cuda_ops.attention runs the unfused form for larger heads)");
  return s;
}

// 4-wide loads of `cols` columns: every row of t starts on a 4-element boundary.
inline bool vec_rows(const at::Tensor& t, int64_t cols) {
  if (cols % 4 != 0 || reinterpret_cast<uintptr_t>(t.data_ptr()) % (4 * t.element_size()) != 0) return false;
  for (int d = 0; d < 3; ++d)
    if (t.size(d) > 1 && t.stride(d) % 4 != 0) return false;
  return true;
}

template <typename T>
Mat<T> mat(const at::Tensor& t, int64_t cols) {
  Mat<T> m;
  m.p = static_cast<T*>(t.data_ptr());
  m.sb = t.stride(0);
  m.sh = t.stride(1);
  m.sl = t.stride(2);
  m.vec = vec_rows(t, cols);
  return m;
}

template <typename scalar_t>
Params<scalar_t> make_params(const Shapes& s, const SoftmaxArgs& a, const MaskView& mv, const at::Tensor& q,
                             const at::Tensor& k, const at::Tensor& v) {
  Params<scalar_t> P;
  P.q = mat<const scalar_t>(q, s.D);
  P.k = mat<const scalar_t>(k, s.D);
  P.v = mat<const scalar_t>(v, s.Dv);
  P.mask.data = mv.t.defined() ? mv.t.data_ptr() : nullptr;
  P.mask.kind = mv.kind;
  P.mask.col_stride = mv.col_stride;
  P.mask.idx = mv.idx;
  P.a = a;
  P.B = s.B;
  P.Hq = s.Hq;
  P.Hk = s.Hk;
  P.Lq = s.Lq;
  P.Lk = s.Lk;
  P.groups = s.groups;
  P.nstat = s.B * s.Hq * s.Lq;
  P.D = static_cast<int>(s.D);
  P.Dv = static_cast<int>(s.Dv);
  return P;
}

// A packed [T, H, cols] operand: Mat's "batch" index is the packed row (Seq::b, a sequence's start).
template <typename T>
Mat<T> packed_mat(const at::Tensor& t, int64_t cols) {
  Mat<T> m;
  m.p = static_cast<T*>(t.data_ptr());
  m.sb = t.stride(0);
  m.sh = t.stride(1);
  m.sl = t.stride(0);
  m.vec = cols % 4 == 0 && reinterpret_cast<uintptr_t>(t.data_ptr()) % (4 * t.element_size()) == 0 &&
          (t.size(0) <= 1 || t.stride(0) % 4 == 0) && (t.size(1) <= 1 || t.stride(1) % 4 == 0);
  return m;
}

inline VarlenShapes check_varlen(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const at::Tensor& cu_seqlens) {
  const VarlenShapes s =
      check_varlen_qkv(op, q, k, v, cu_seqlens, "CUDA", [](const at::Tensor& t) { return t.device().is_cuda(); });
  const auto st = q.scalar_type();
  TORCH_CHECK(st == at::kFloat || st == at::kHalf || st == at::kBFloat16, "dmfx::", op,
              ": the fused CUDA attention takes float32, float16 or bfloat16, got ", st);
  TORCH_CHECK(s.D <= kMaxHead && s.Dv <= kMaxHead, "dmfx::", op, ": the fused CUDA attention takes head dims up to ",
              kMaxHead, ", got D = ", s.D, " and Dv = ", s.Dv);
  return s;
}

template <typename scalar_t>
Params<scalar_t> make_varlen_params(const VarlenShapes& s, const SoftmaxArgs& a, const at::Tensor& q,
                                    const at::Tensor& k, const at::Tensor& v, const at::Tensor& tiles) {
  Params<scalar_t> P;
  P.q = packed_mat<const scalar_t>(q, s.D);
  P.k = packed_mat<const scalar_t>(k, s.D);
  P.v = packed_mat<const scalar_t>(v, s.Dv);
  P.a = a;
  P.B = s.B;
  P.Hq = s.Hq;
  P.Hk = s.Hk;
  P.Lq = P.Lk = s.T;  // (unused: the lengths are per sequence)
  P.groups = s.groups;
  P.nstat = s.Hq * s.T;
  P.T = s.T;
  P.tiles = tiles.data_ptr<int64_t>();
  P.D = static_cast<int>(s.D);
  P.Dv = static_cast<int>(s.Dv);
  return P;
}

// Calls f(scalar_t{}) for the dtypes of the kernels (check() rejects the others).
template <typename F>
void with_dtype(at::ScalarType st, F&& f) {
  switch (st) {
    case at::kFloat: f(float{}); break;
    case at::kHalf: f(at::Half{}); break;
    case at::kBFloat16: f(at::BFloat16{}); break;
    default: TORCH_CHECK(false, "dmfx::flash attention: internal error: dtype ", st);
  }
}

// Calls f(std::integral_constant<int, kHead>) with kHead the padded head dim of max(D, Dv).
template <typename F>
void with_head(int64_t head, F&& f) {
  if (head <= 32) {
    f(std::integral_constant<int, 32>{});
  } else if (head <= 64) {
    f(std::integral_constant<int, 64>{});
  } else if (head <= 96) {
    f(std::integral_constant<int, 96>{});
  } else {
    f(std::integral_constant<int, 128>{});
  }
}

// Launches `kernel` over `items` blocks (grid-stride beyond kMaxGrid) with `floats` of dynamic shared
// memory, opting in above the 48 KB default.
template <typename Kernel, typename Arg>
void launch(Kernel kernel, int64_t items, size_t floats, const Arg& P) {
  if (items == 0) return;
  const size_t smem = floats * sizeof(float);
  int optin = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, c10::cuda::current_device()));
  TORCH_CHECK(smem <= static_cast<size_t>(optin), "dmfx::flash attention: the CUDA kernel needs ", smem,
              " bytes of shared memory per block, this GPU offers ", optin,
              " (dmfx.cuda_ops.attention.flash_supported should have chosen the unfused form)");
  if (smem > 48 * 1024) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  }
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(items, kMaxGrid));
  kernel<<<grid, kThreads, smem, softmax_impl::sm_stream()>>>(P);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename scalar_t, int kHead, bool kDelta>
void launch_fwd(const Params<scalar_t>& P) {
  const int64_t items = P.B * P.Hq * ((P.Lq + Tiles<kHead>::kQ - 1) / Tiles<kHead>::kQ);
  launch(flash_fwd_kernel<scalar_t, kHead, kDelta, false>, items, Tiles<kHead>::fwd_floats, P);
}

// The tile map of cu_seqlens (Params::tiles), computed on the device: no host reads cu_seqlens.
inline at::Tensor varlen_tile_map(const at::Tensor& cu_seqlens, int64_t B, int64_t T) {
  at::Tensor tiles = at::empty({3 * B + 1}, cu_seqlens.options().dtype(at::kLong));
  const at::Tensor cu = cu_seqlens.contiguous();  // (alive until the launch: the stream orders any reuse)
  TileMapArgs M;
  M.cu = cu.data_ptr();
  M.cu64 = cu.scalar_type() == at::kLong;
  M.B = B;
  M.T = T;
  M.out = tiles.data_ptr<int64_t>();
  launch(varlen_tiles_kernel, 1, 0, M);
  return tiles;
}

// Blocks for the varlen work items over `heads` heads: at most ceil(T / 64) + B tiles (each sequence
// wastes less than one), the real count read by the blocks from the tile map (surplus blocks exit).
inline int64_t varlen_items(int64_t heads, int64_t T, int64_t B) {
  return heads * ((T + kVarlenTile - 1) / kVarlenTile + B);
}

}  // namespace attention_impl

// ------------------------------------------------------------------------------------------------
// Entry points (same signatures, checks and outputs as attention_cpu.cpp; stats are float32)
// ------------------------------------------------------------------------------------------------

// Whether the fused kernels take q [B, Hq, Lq, D] and v [B, Hk, Lk, Dv] (or the varlen form's q [T, Hq, D],
// v [T, Hk, Dv]) on q's GPU: float32, float16 or
// bfloat16, D and Dv up to kMaxHead, and kMaxSmemBytes of shared memory per block (the attention ops
// run the unfused form otherwise; cuda_ops/attention.py's flash_supported answers the same for the passes).
bool flash_supported_cuda(const at::Tensor& q, const at::Tensor& v) {
  using namespace attention_impl;
  const auto st = q.scalar_type();
  if (!(st == at::kFloat || st == at::kHalf || st == at::kBFloat16)) return false;
  if (q.size(-1) > kMaxHead || v.size(-1) > kMaxHead) return false;
  int optin = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, q.device().index()));
  return static_cast<size_t>(optin) >= kMaxSmemBytes;
}

at::Tensor flash_fwd_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const c10::optional<at::Tensor>& mask, double scale, bool causal, int64_t seed,
                          int64_t offset, double p, at::Tensor out, double softcap) {
  using namespace attention_impl;
  const Shapes s = check("flash_fwd", q, k, v);
  check_out("flash_fwd", "out", out, {s.B, s.Hq, s.Lq, s.Dv}, q);
  const SoftmaxArgs a = row_args(s, scale, causal, seed, offset, p, softcap);
  const c10::cuda::CUDAGuard device_guard(q.device());
  at::Tensor stats = at::empty({2, s.B, s.Hq, s.Lq}, q.options().dtype(at::kFloat));
  if (flash_fwd_trivial(s, out, stats)) return stats;
  const MaskView mv = mask_view("flash_fwd", mask, s, q);
  with_dtype(q.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    Params<scalar_t> P = make_params<scalar_t>(s, a, mv, q, k, v);
    P.out = mat<scalar_t>(out, s.Dv);
    P.stats = stats.data_ptr<float>();
    with_head(std::max(s.D, s.Dv), [&](auto head) { launch_fwd<scalar_t, decltype(head)::value, false>(P); });
  });
  return stats;
}

void flash_bwd_cuda(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& stats, const c10::optional<at::Tensor>& mask, double scale, bool causal,
                    int64_t seed, int64_t offset, double p, at::Tensor dq, at::Tensor dk, at::Tensor dv,
                    const c10::optional<at::Tensor>& bias_part, double softcap) {
  using namespace attention_impl;
  const Shapes s = check("flash_bwd", q, k, v);
  check_backward(s, grad_out, q, k, v, stats, at::kFloat, dq, dk, dv, bias_part);  // (stats float32)
  const SoftmaxArgs a = row_args(s, scale, causal, seed, offset, p, softcap);
  const c10::cuda::CUDAGuard device_guard(q.device());
  if (flash_bwd_trivial(s, dq, dk, dv, bias_part)) return;
  const MaskView mv = mask_view("flash_bwd", mask, s, q);
  at::Tensor delta = at::empty({s.B, s.Hq, s.Lq}, q.options().dtype(at::kFloat));
  with_dtype(q.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    Params<scalar_t> P = make_params<scalar_t>(s, a, mv, q, k, v);
    P.go = mat<const scalar_t>(grad_out, s.Dv);
    P.dq = mat<scalar_t>(dq, s.D);
    P.dk = mat<scalar_t>(dk, s.D);
    P.dv = mat<scalar_t>(dv, s.Dv);
    P.stats = const_cast<float*>(stats.data_ptr<float>());  // read only
    P.delta = delta.data_ptr<float>();
    with_head(std::max(s.D, s.Dv), [&](auto head) {
      constexpr int kHead = decltype(head)::value;
      using T = Tiles<kHead>;
      launch_fwd<scalar_t, kHead, true>(P);  // delta
      launch(flash_bwd_dq_kernel<scalar_t, kHead, false>, s.B * s.Hq * ((s.Lq + T::kQ - 1) / T::kQ), T::dq_floats, P);
      launch(flash_bwd_dkdv_kernel<scalar_t, kHead, false>, s.B * s.Hk * ((s.Lk + T::kKeys - 1) / T::kKeys),
             T::dkdv_floats, P);
    });
  });
  if (bias_part) {  // [3, B, H, D]: each (batch, head)'s column sums of dq, dk, dv (groups == 1)
    for (int64_t t = 0; t < 3; ++t) {
      at::Tensor part = bias_part->select(0, t);
      at::sum_out(part, t == 0 ? dq : t == 1 ? dk : dv, {2});
    }
  }
}

// The varlen form (attention_api.h): one block per (head, 64-row tile of a sequence). Never reads
// cu_seqlens on the host (no synchronization): varlen_tiles_kernel clamps each sequence into [0, T]
// and numbers the tiles; the grid covers ceil(T / 64) + B tiles per head.
at::Tensor varlen_fwd_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens,
                           double scale, bool causal, int64_t seed, int64_t offset, double p, at::Tensor out) {
  using namespace attention_impl;
  const VarlenShapes s = check_varlen("varlen_fwd", q, k, v, cu_seqlens);
  check_varlen_out("varlen_fwd", "out", out, {s.T, s.Hq, s.Dv}, q);
  const SoftmaxArgs a = varlen_args(scale, causal, seed, offset, p);
  const c10::cuda::CUDAGuard device_guard(q.device());
  at::Tensor stats = at::empty({2, s.Hq, s.T}, q.options().dtype(at::kFloat));
  if (s.Hq * s.T == 0) return stats;
  const at::Tensor tiles = varlen_tile_map(cu_seqlens, s.B, s.T);
  with_dtype(q.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    Params<scalar_t> P = make_varlen_params<scalar_t>(s, a, q, k, v, tiles);
    P.out = packed_mat<scalar_t>(out, s.Dv);
    P.stats = stats.data_ptr<float>();
    with_head(std::max(s.D, s.Dv), [&](auto head) {
      constexpr int kHead = decltype(head)::value;
      launch(flash_fwd_kernel<scalar_t, kHead, false, true>, varlen_items(s.Hq, s.T, s.B), Tiles<kHead>::fwd_floats, P);
    });
  });
  return stats;
}

void varlen_bwd_cuda(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const at::Tensor& out, const at::Tensor& stats, const at::Tensor& cu_seqlens, double scale,
                     bool causal, int64_t seed, int64_t offset, double p, at::Tensor dq, at::Tensor dk, at::Tensor dv) {
  using namespace attention_impl;
  const VarlenShapes s = check_varlen("varlen_bwd", q, k, v, cu_seqlens);
  check_varlen_backward(s, grad_out, q, k, v, out, stats, at::kFloat, dq, dk, dv);  // (stats float32)
  const SoftmaxArgs a = varlen_args(scale, causal, seed, offset, p);
  const c10::cuda::CUDAGuard device_guard(q.device());
  if (s.Hk * s.T == 0) return;
  const at::Tensor tiles = varlen_tile_map(cu_seqlens, s.B, s.T);
  at::Tensor delta = at::empty({s.Hq, s.T}, q.options().dtype(at::kFloat));
  with_dtype(q.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    Params<scalar_t> P = make_varlen_params<scalar_t>(s, a, q, k, v, tiles);
    P.go = packed_mat<const scalar_t>(grad_out, s.Dv);
    P.out = packed_mat<scalar_t>(out, s.Dv);  // (read only: delta)
    P.dq = packed_mat<scalar_t>(dq, s.D);
    P.dk = packed_mat<scalar_t>(dk, s.D);
    P.dv = packed_mat<scalar_t>(dv, s.Dv);
    P.stats = const_cast<float*>(stats.data_ptr<float>());  // read only
    P.delta = delta.data_ptr<float>();
    launch(varlen_delta_kernel<scalar_t>, (s.Hq * s.T + 15) / 16, 0, P);
    with_head(std::max(s.D, s.Dv), [&](auto head) {
      constexpr int kHead = decltype(head)::value;
      using T = Tiles<kHead>;
      launch(flash_bwd_dq_kernel<scalar_t, kHead, true>, varlen_items(s.Hq, s.T, s.B), T::dq_floats, P);
      launch(flash_bwd_dkdv_kernel<scalar_t, kHead, true>, varlen_items(s.Hk, s.T, s.B), T::dkdv_floats, P);
    });
  });
}

}  // namespace dmfx

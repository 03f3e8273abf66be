"""dmfx's attention: two batched GEMMs around the fused softmax, with no copy of any operand.

This is the paper's form of multi-head attention (its Fig. 2 / Sec. 5): ``Q·Kᵀ`` (a batched GEMM), the
fused scale + mask + softmax + dropout kernel (``dmfx::attention_softmax``, paper SM), ``·V`` (a batched GEMM),
and in the backward the same GEMMs around the fused softmax backward (paper BS). What the op adds over
the ATen graph HF models produce is the layout: every GEMM reads its operands *where they are*, in
the per-token layout the projections write (``[batch, seq, heads, head_dim]``, i.e. a permuted view),
and writes its result in the layout its consumer wants. Eager PyTorch runs ``clone`` (a transpose
copy) on Q, K and V before the first GEMMs and on the context after the last one, and the same four
copies again in the backward; dmfx runs none. The 1/sqrt(d) scale is applied inside the softmax
kernel, which reads the scores anyway.

The ops' schemas and fake implementations (for tracing) are here; their kernels and autograd formulas
are registered in C++: csrc/attention_ops.h (the ops for any device, with the argument checks: the
GEMMs are ATen's, MKL / cuBLAS, the softmax is dmfx::attention_softmax, the fused kernels the device's),
csrc/attention_cpu.cpp (the CPU kernels, the registration of them and of the autograd formulas),
csrc/attention_cuda.cu + attention_cuda_bind.cpp (CUDA).

Ops (``torch.library`` fragment of the ``dmfx::`` namespace)
------------------------------------------------------------
``dmfx::attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale, bool causal, Tensor? seed,
    float p) -> (Tensor out, Tensor probs, Tensor dropped)``
    q ``[B, Hq, Lq, D]``, k ``[B, Hk, Lk, D]``, v ``[B, Hk, Lk, Dv]`` with any strides (Hq a multiple
    of Hk: grouped-query attention without ``repeat_kv``); mask as for ``dmfx::attention_softmax`` (broadcastable
    to ``[B, Hq, Lq, Lk]``; bool: True = attend). ``out = dropout(softmax(q·kᵀ·scale + mask), p)·v`` of
    shape ``[B, Hq, Lq, Dv]``, laid out as ``[B, Lq, Hq, Dv]`` (so ``out.transpose(1, 2)`` is
    contiguous); ``probs`` the softmax (read by the backward and by returned attention weights);
    ``dropped`` the dropped-out probabilities (empty ``[0]`` when p == 0).
``dmfx::attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor probs, Tensor dropped,
    Tensor? seed, float p, float scale, bool mask_grad, Tensor? grad_probs=None, Tensor? grad_dropped=None)
    -> (Tensor dq, Tensor dk, Tensor dv, Tensor dz)``
    dq/dk/dv in the ``[B, L, H, D]`` layout; dz (the gradient of the masked scores, before scaling,
    for a mask that requires grad) is empty unless ``mask_grad``. ``grad_probs`` / ``grad_dropped``
    are gradients reaching the forward's second and third outputs (returned attention weights).
``dmfx::qkv_attention(Tensor qkv, int heads, Tensor? mask, float scale, bool causal, Tensor? seed,
    float p) -> (Tensor out, Tensor probs, Tensor dropped)``
    Self-attention over the stacked projection ``qkv [B, L, 3 * heads * D]`` (the paper's QKV fusion:
    one GEMM for Q, K and V): q, k and v are its three column blocks. Same outputs as
    ``dmfx::attention``.
``dmfx::qkv_attention_backward(Tensor grad_out, Tensor qkv, int heads, Tensor probs, Tensor dropped,
    Tensor? seed, float p, float scale, bool mask_grad, Tensor? grad_probs=None, Tensor? grad_dropped=None)
    -> (Tensor dqkv, Tensor dz)``
    The gradient of the stacked projection in one contiguous ``[B, L, 3 * heads * D]`` tensor: the
    three GEMMs write dq, dk and dv straight into its column blocks, so the stacked weight's backward
    is one GEMM for dX, one for dW and one bias reduction, with no concatenation.
``dmfx::flash_attention(q, k, v, mask, scale, causal, seed, p, softcap=0.0) -> (Tensor out, Tensor stats)`` and
``dmfx::qkv_flash_attention(qkv, heads, mask, scale, causal, seed, p) -> (Tensor out, Tensor stats)``
    The same attention in the fused form (csrc/attention_cpu.cpp): per block of query rows the
    scores stay in cache and never reach memory; ``stats`` ``[2, B, H, Lq]`` holds each row's max and
    1 / sum of exps for the backward (``flash_attention_backward`` -> (dq, dk, dv, dbq, dbk, dbv),
    ``qkv_flash_attention_backward`` -> (dqkv, dbias)), which recomputes the scores. With
    ``bias_grad=True`` the backwards also return the projections' bias gradients (for [B, H, L, D]
    views of [B, L, H * D] projections), summed per (batch, head) while dq, dk, dv are in cache (else
    the bias outputs are empty); the backward pass (passes/backward.py) asks for them. Same dropout
    mask as the unfused form. No mask gradient (it raises). Fused kernels: CPU float32/float64
    (csrc/attention_cpu.cpp), CUDA float32/float16/bfloat16 with head dims up to 128
    (csrc/attention_cuda.cu, stats float32); elsewhere the same ops run the unfused form
    (``flash_supported``). ``softcap > 0`` (``flash_attention`` and its backward only): the scores
    are soft-capped before the mask, ``softcap * tanh(q·kᵀ * scale / softcap) + mask`` (Gemma 2's
    ``attn_logit_softcapping``), and the backward multiplies dS by the tanh's derivative; only the
    fused kernels compute it (elsewhere the ops raise).

``dmfx::varlen_attention(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens, float scale, bool causal, Tensor? seed,
    float p) -> (Tensor out, Tensor stats)``
    Attention over packed variable-length sequences (padding-free batches: the ``unpad`` fusion gathers
    a padded batch's real tokens into ``[T, hidden]``). q ``[T, Hq, D]``, k ``[T, Hk, D]``, v
    ``[T, Hk, Dv]`` hold B sequences back to back, sequence b in rows ``cu_seqlens[b] : cu_seqlens[b + 1]``
    (``cu_seqlens`` int32 or int64 ``[B + 1]`` on q's device, ``cu[0] = 0``, non-decreasing, ``cu[B] = T``;
    sequences of length 0 and T = 0 allowed); any strides with a unit stride in the head dim (views of a
    packed projection are read in place); Hq a multiple of Hk (grouped-query, no repeat). Each query
    row attends the keys of its own sequence only (``causal``: those at or before its position in it);
    no mask argument. ``out = dropout(softmax(q·kᵀ·scale), p)·v`` per sequence and head,
    ``[T, Hq, Dv]`` contiguous (``out.view(T, Hq * Dv)`` feeds the output projection). ``stats``
    ``[2, Hq, T]`` contiguous: each row's max logit and 1 / sum of its exps (not differentiable).
    Dropout: the Philox mask of element ``(h * T + tq) * T + tk`` for query head h, packed query row
    tq and packed key row tk (the row-major index into a block-diagonal ``[Hq, T, T]`` score matrix).
``dmfx::varlen_attention_backward(grad_out, q, k, v, out, stats, cu_seqlens, scale, causal, seed, p)
    -> (Tensor dq, Tensor dk, Tensor dv)``
    Contiguous gradients of q, k, v; ``out`` is the forward's output (the CUDA kernels read
    delta = rowsum(dO ∘ O) from it), the dropout mask is regenerated.
``dmfx::qkv_varlen_attention(Tensor qkv, int heads, Tensor cu_seqlens, float scale, bool causal, Tensor? seed,
    float p) -> (Tensor out, Tensor stats)`` and ``dmfx::qkv_varlen_attention_backward(grad_out, qkv,
    heads, out, stats, cu_seqlens, scale, causal, seed, p) -> Tensor dqkv``
    Self-attention over the stacked projection ``qkv [T, 3 * heads * D]`` (any row stride, unit last
    stride): q, k, v are its three column blocks; the backward writes dq, dk, dv straight into the
    column blocks of one contiguous ``dqkv`` (the stacked weight's backward is one GEMM).
    Kernels: CPU float32 / float64 (csrc/attention_cpu.cpp: the flash kernels' loops per sequence;
    float16 / bfloat16 inputs are upcast to float32 and the outputs cast back, stats float32); CUDA
    float32 / float16 / bfloat16 with head dims up to 128 (csrc/attention_cuda.cu: the flash kernels'
    varlen addressing mode, stats float32). No unfused form: elsewhere (CUDA float64, larger heads)
    the ops raise NotImplementedError; ``varlen_supported`` answers first. cu_seqlens' values are
    checked on the CPU (ValueError) and by the Python API ``varlen_attention``; the CUDA ops never read
    them on the host (no synchronization): their kernels clamp each sequence into [0, T], so any
    cu_seqlens is memory-safe there, and a wrong one gives wrong values, not a crash.

Determinism (CPU; tests/test_determinism.py): the fused (flash) ops are bit-reproducible run to run
and for any thread count (one thread computes each (batch, kv head) task whole, its GEMMs
single-threaded inside it); so are the varlen ops (one thread computes each (sequence, head, block of
query rows) item of the forward and each (sequence, kv head) task of the backward whole, whichever
thread the dynamic schedule hands it to). The GEMM form is bit-reproducible run to run with the thread
count fixed (ATen's batched GEMMs, and the softmax kernels, which are thread-count independent).
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from . import reference as R
from ._library import (
    LIB as _lib,
    check_dropout_p as _check_p,
    check_scores as _check_softmax,
    check_tensor as _check_tensor,
    kernels_in_cxx,
    new_seed,
)

_lib.define(
    "attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale, bool causal, Tensor? seed, float p) "
    "-> (Tensor out, Tensor probs, Tensor dropped)"
)
_lib.define(
    "attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor probs, Tensor dropped, "
    "Tensor? seed, float p, float scale, bool mask_grad, Tensor? grad_probs=None, Tensor? grad_dropped=None) "
    "-> (Tensor dq, Tensor dk, Tensor dv, Tensor dz)"
)
_lib.define(
    "qkv_attention(Tensor qkv, int heads, Tensor? mask, float scale, bool causal, Tensor? seed, float p) "
    "-> (Tensor out, Tensor probs, Tensor dropped)"
)
_lib.define(
    "qkv_attention_backward(Tensor grad_out, Tensor qkv, int heads, Tensor probs, Tensor dropped, Tensor? seed, "
    "float p, float scale, bool mask_grad, Tensor? grad_probs=None, Tensor? grad_dropped=None) "
    "-> (Tensor dqkv, Tensor dz)"
)

_lib.define(
    "flash_attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale, bool causal, Tensor? seed, float p, "
    "float softcap=0.0) -> (Tensor out, Tensor stats)"
)
_lib.define(
    "flash_attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor stats, Tensor? mask, float scale, "
    "bool causal, Tensor? seed, float p, bool bias_grad=False, float softcap=0.0) "
    "-> (Tensor dq, Tensor dk, Tensor dv, Tensor dbq, Tensor dbk, Tensor dbv)"
)
_lib.define(
    "qkv_flash_attention(Tensor qkv, int heads, Tensor? mask, float scale, bool causal, Tensor? seed, float p) "
    "-> (Tensor out, Tensor stats)"
)
_lib.define(
    "qkv_flash_attention_backward(Tensor grad_out, Tensor qkv, int heads, Tensor stats, Tensor? mask, float scale, "
    "bool causal, Tensor? seed, float p, bool bias_grad=False) -> (Tensor dqkv, Tensor dbias)"
)

_lib.define(
    "varlen_attention(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens, float scale, bool causal, Tensor? seed, "
    "float p) -> (Tensor out, Tensor stats)"
)
_lib.define(
    "varlen_attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor stats, "
    "Tensor cu_seqlens, float scale, bool causal, Tensor? seed, float p) -> (Tensor dq, Tensor dk, Tensor dv)"
)
_lib.define(
    "qkv_varlen_attention(Tensor qkv, int heads, Tensor cu_seqlens, float scale, bool causal, Tensor? seed, "
    "float p) -> (Tensor out, Tensor stats)"
)
_lib.define(
    "qkv_varlen_attention_backward(Tensor grad_out, Tensor qkv, int heads, Tensor out, Tensor stats, "
    "Tensor cu_seqlens, float scale, bool causal, Tensor? seed, float p) -> Tensor dqkv"
)

OPS = (
    "attention", "attention_backward", "qkv_attention", "qkv_attention_backward",
    "flash_attention", "flash_attention_backward", "qkv_flash_attention", "qkv_flash_attention_backward",
)
# The varlen (packed) form: [T, H, D] operands, not the [B, H, L, D] of OPS (whose users, the
# attention passes and dmfx.explain's cost model, read those shapes).
VARLEN_OPS = (
    "varlen_attention", "varlen_attention_backward", "qkv_varlen_attention", "qkv_varlen_attention_backward",
)
kernels_in_cxx(OPS + VARLEN_OPS)

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


# ----------------------------------------------------------------------------------------- checks
# (The fakes run them at trace time, and for Meta tensors, where no C++ kernel runs; the kernels run the
# same checks in C++: csrc/attention_ops.h.)


def _check_qkv_tensors(op: str, q: Tensor, k: Tensor, v: Tensor, layout: str) -> None:
    """q, k and v: tensors of one score dtype on one device, each of `layout`'s rank ("[batch, heads, seq,
    head_dim]" or "[tokens, heads, head_dim]")."""
    dim = layout.count(",") + 1
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(op, name, t)
        if t.dim() != dim:
            raise ValueError(f"dmfx::{op}: {name} must be {dim}-D {layout}, got shape {list(t.shape)}")
        if t.dtype not in _DTYPES:
            raise TypeError(f"dmfx::{op}: {name} must be float32, float16, bfloat16 or float64, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"dmfx::{op}: q, k and v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"dmfx::{op}: q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")


def _check_qkv(op: str, q: Tensor, k: Tensor, v: Tensor) -> None:
    _check_qkv_tensors(op, q, k, v, "[batch, heads, seq, head_dim]")
    (B, Hq, _, D), (Bk, Hk, Lk, Dk), (Bv, Hv, Lv, _) = q.shape, k.shape, v.shape
    if not (B == Bk == Bv) or Hk != Hv or Lk != Lv or D != Dk:
        raise ValueError(
            f"dmfx::{op}: q {list(q.shape)}, k {list(k.shape)} and v {list(v.shape)} do not fit "
            "[B, Hq, Lq, D], [B, Hk, Lk, D], [B, Hk, Lk, Dv]"
        )
    if Hk == 0 or Hq % Hk:
        raise ValueError(f"dmfx::{op}: q's {Hq} heads must be a multiple of k's and v's {Hk} heads")


def _split_qkv(op: str, qkv: Tensor, heads: int) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v ([B, H, L, D] views) of the stacked projection qkv [B, L, 3 * heads * D]."""
    _check_tensor(op, "qkv", qkv)
    if qkv.dim() != 3:
        raise ValueError(f"dmfx::{op}: qkv must be 3-D [batch, seq, 3 * heads * head_dim], got shape {list(qkv.shape)}")
    if heads <= 0 or qkv.shape[2] % (3 * heads):
        raise ValueError(f"dmfx::{op}: qkv's last dim {qkv.shape[2]} is not 3 * heads * head_dim with heads={heads}")
    B, L, _ = qkv.shape
    per = qkv.unflatten(2, (3, heads, qkv.shape[2] // (3 * heads)))  # [B, L, 3, H, D]
    return tuple(per.select(2, i).transpose(1, 2) for i in range(3))  # type: ignore[return-value]


def _blhd(B: int, H: int, L: int, D: int, like: Tensor) -> Tensor:
    """An empty [B, H, L, D] tensor laid out as [B, L, H, D]."""
    return torch.empty((B, L, H, D), dtype=like.dtype, device=like.device).transpose(1, 2)


def _context(q: Tensor, v: Tensor) -> Tensor:
    """The attention output [B, Hq, Lq, Dv], laid out as [B, Lq, Hq, Dv]."""
    B, Hq, Lq, _ = q.shape
    return _blhd(B, Hq, Lq, v.shape[3], q)


def _grads_like(*ts: Tensor) -> tuple[Tensor, ...]:
    """Empty gradients of [B, H, L, D] tensors, laid out as [B, L, H, D]."""
    return tuple(_blhd(*t.shape, t) for t in ts)


def _check_forward(op: str, q: Tensor, k: Tensor, v: Tensor, mask, causal: bool, seed, p: float) -> None:
    """Every check of a forward (kernels and fakes): q, k, v and the softmax's (mask, causal, dropout)."""
    _check_qkv(op, q, k, v)
    B, Hq, Lq, _ = q.shape
    _check_softmax(q.new_empty((1,)).expand(B, Hq, Lq, k.shape[2]), mask, causal, seed, p)


# ------------------------------------------------------------------------------- fused (flash) form
#
# CPU: csrc/attention_cpu.cpp, per block of query rows with the scores in cache; the backward
# recomputes them from the row statistics (max and 1 / sum of the exps: stats [2, B, H, Lq]),
# float32/float64. CUDA: csrc/attention_cuda.cu (FlashAttention-2's decomposition: scores on chip,
# online softmax; the backward as delta, dQ and dK/dV kernels), float32/float16/bfloat16 with head
# dims up to 128, stats float32. Elsewhere (float64 or larger heads on CUDA, bf16/fp16 on the CPU)
# the same op runs the unfused form: the forward discards the probabilities and the backward
# recomputes them with the softmax kernel (same Philox mask), so results never depend on the path taken.

_CUDA_FLASH_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_CUDA_FLASH_MAX_HEAD_DIM = 128  # csrc/attention_cuda.cu pads head dims to 32, 64, 96 or 128
# Shared memory per block the largest CUDA flash kernel needs (kMaxSmemBytes in csrc/attention_cuda.cu,
# static_assert-ed there: dQ at head dim 128); GPUs that offer less per block run the unfused form.
_CUDA_FLASH_SMEM_BYTES = 112384


def flash_supported(device: torch.device, dtype: torch.dtype, head_dim=None, value_dim=None) -> bool:
    """Whether dmfx::flash_attention has its fused kernel for this device, dtype and head dims
    (q's and k's `head_dim` D, v's `value_dim` Dv). CPU: float32 and float64, any head dims (they may
    be omitted). CUDA: float32, float16 and bfloat16 with D and Dv up to 128 (head dims not given,
    or symbolic, are not known to fit: False), on a GPU with enough shared memory per block."""
    if device.type == "cpu":
        return dtype in (torch.float32, torch.float64)
    if device.type != "cuda" or dtype not in _CUDA_FLASH_DTYPES:
        return False
    if not all(isinstance(d, int) and d <= _CUDA_FLASH_MAX_HEAD_DIM for d in (head_dim, value_dim)):
        return False
    if not torch.cuda.is_available():
        return False
    return _cuda_flash_fits(torch.cuda.current_device() if device.index is None else device.index)


@functools.lru_cache(maxsize=None)
def _cuda_flash_fits(index: int) -> bool:
    """Whether CUDA device `index` offers the flash kernels' shared memory per block."""
    props = torch.cuda.get_device_properties(index)
    return getattr(props, "shared_memory_per_block_optin", 0) >= _CUDA_FLASH_SMEM_BYTES


def varlen_supported(device: torch.device, dtype: torch.dtype, head_dim=None, value_dim=None) -> bool:
    """Whether dmfx::varlen_attention (and its qkv and backward ops) has a kernel for this device,
    dtype and head dims (q's and k's `head_dim` D, v's `value_dim` Dv): the ops have no unfused form
    and raise NotImplementedError elsewhere, so a pass asks this before emitting them. CPU: float32 and
    float64, float16 and bfloat16 (computed in float32), any head dims (they may be omitted). CUDA: as
    ``flash_supported`` (float32, float16, bfloat16 with D and Dv up to 128, on a GPU with enough
    shared memory per block)."""
    device = torch.device(device)
    if device.type == "cpu":
        return dtype in _DTYPES
    return flash_supported(device, dtype, head_dim, value_dim)


def _check_softcap(op: str, softcap: float, q: Tensor, v: Tensor) -> None:
    """Soft-capped scores only the fused kernels compute (csrc/attention_ops.h check_softcap_runs)."""
    if not (math.isfinite(softcap) and softcap >= 0):
        raise RuntimeError(f"dmfx::{op}: softcap must be finite and >= 0 (0: no soft-capping), got {softcap}")
    if softcap and not flash_supported(q.device, q.dtype, q.shape[-1], v.shape[-1]):
        raise RuntimeError(
            f"dmfx::{op}: softcap (soft-capped scores) needs dmfx's fused kernel, which takes float32/float64 on the "
            f"CPU and float32/float16/bfloat16 with head dims up to 128 on CUDA; got {q.dtype} on {q.device} "
            f"with head dims {q.shape[-1]} and {v.shape[-1]} (dmfx's attention pass leaves such soft-capped "
            "attention to PyTorch)")


def _stats_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# ----------------------------------------------------------------------------------------- fakes


def _fake_outputs(op, q, k, v, mask, causal, seed, p):
    """(out, probs, dropped) of the GEMM form."""
    _check_forward(op, q, k, v, mask, causal, seed, p)
    scores = (*q.shape[:3], k.shape[2])
    dropped = q.new_empty(scores) if p > 0 else q.new_empty((0,))
    return _context(q, v), q.new_empty(scores), dropped


def _fake_flash_outputs(op, q, k, v, mask, causal, seed, p):
    """(out, stats) of the fused form."""
    _check_forward(op, q, k, v, mask, causal, seed, p)
    return _context(q, v), q.new_empty((2, *q.shape[:3]), dtype=_stats_dtype(q.dtype))


@torch.library.register_fake("dmfx::attention")
def _attention_fake(q, k, v, mask, scale, causal, seed, p):
    return _fake_outputs("attention", q, k, v, mask, causal, seed, p)


@torch.library.register_fake("dmfx::attention_backward")
def _attention_backward_fake(grad_out, q, k, v, probs, dropped, seed, p, scale, mask_grad, grad_probs=None, grad_dropped=None):
    _check_qkv("attention_backward", q, k, v)
    _check_p("attention_backward", p, seed)
    dz = q.new_empty(probs.shape) if mask_grad else q.new_empty((0,))
    return (*_grads_like(q, k, v), dz)


@torch.library.register_fake("dmfx::qkv_attention")
def _qkv_attention_fake(qkv, heads, mask, scale, causal, seed, p):
    return _fake_outputs("qkv_attention", *_split_qkv("qkv_attention", qkv, heads), mask, causal, seed, p)


@torch.library.register_fake("dmfx::qkv_attention_backward")
def _qkv_attention_backward_fake(grad_out, qkv, heads, probs, dropped, seed, p, scale, mask_grad, grad_probs=None, grad_dropped=None):
    _split_qkv("qkv_attention_backward", qkv, heads)
    _check_p("qkv_attention_backward", p, seed)
    dz = qkv.new_empty(probs.shape) if mask_grad else qkv.new_empty((0,))
    return qkv.new_empty(qkv.shape), dz


@torch.library.register_fake("dmfx::flash_attention")
def _flash_attention_fake(q, k, v, mask, scale, causal, seed, p, softcap=0.0):
    _check_softcap("flash_attention", softcap, q, v)
    return _fake_flash_outputs("flash_attention", q, k, v, mask, causal, seed, p)


@torch.library.register_fake("dmfx::flash_attention_backward")
def _flash_attention_backward_fake(grad_out, q, k, v, stats, mask, scale, causal, seed, p, bias_grad=False, softcap=0.0):
    _check_softcap("flash_attention_backward", softcap, q, v)
    _check_qkv("flash_attention_backward", q, k, v)
    _check_p("flash_attention_backward", p, seed)
    vec = lambda t: q.new_empty((t.shape[1] * t.shape[3] if bias_grad else 0,))  # noqa: E731
    return (*_grads_like(q, k, v), vec(q), vec(k), vec(v))


@torch.library.register_fake("dmfx::qkv_flash_attention")
def _qkv_flash_attention_fake(qkv, heads, mask, scale, causal, seed, p):
    return _fake_flash_outputs("qkv_flash_attention", *_split_qkv("qkv_flash_attention", qkv, heads), mask, causal, seed, p)


@torch.library.register_fake("dmfx::qkv_flash_attention_backward")
def _qkv_flash_attention_backward_fake(grad_out, qkv, heads, stats, mask, scale, causal, seed, p, bias_grad=False):
    _split_qkv("qkv_flash_attention_backward", qkv, heads)
    _check_p("qkv_flash_attention_backward", p, seed)
    return qkv.new_empty(qkv.shape), qkv.new_empty((qkv.shape[-1] if bias_grad else 0,))


# ----------------------------------------------------------------------------------------- Python API


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    scale: float | None = None,
    causal: bool = False,
    p: float = 0.0,
    training: bool = True,
) -> Tensor:
    """``dropout(softmax(q @ k.transpose(-2, -1) * scale + mask), p) @ v`` for q [B, Hq, Lq, D],
    k [B, Hk, Lk, D], v [B, Hk, Lk, Dv] (any strides; Hq a multiple of Hk), like
    ``F.scaled_dot_product_attention`` (scale defaults to 1/sqrt(D)). The result is [B, Hq, Lq, Dv]
    laid out as [B, Lq, Hq, Dv]."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_tensor("attention", name, x)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    p = float(p) if training else 0.0
    seed = new_seed() if p > 0 else None
    return torch.ops.dmfx.attention(q, k, v, mask, scale, bool(causal), seed, p)[0]


def reference_attention(q, k, v, mask=None, scale=1.0, causal=False, seed=None, p=0.0, softcap=0.0):
    """(out, probs, dropped) of dmfx::attention in pure PyTorch (float32 math; float64 stays float64);
    with `softcap`, dmfx::flash_attention's soft-capped scores (Gemma 2's): the logits are
    ``softcap * tanh(q·kᵀ * scale / softcap) + mask``."""
    g = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(g, dim=1) for t in (k, v))
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    scores = q.to(acc) @ k.to(acc).transpose(-2, -1)
    if softcap:
        scores, scale = softcap * torch.tanh(scores * (scale / softcap)), 1.0
    first, probs = R.reference_softmax(scores.to(q.dtype), mask, scale, causal, seed, p)
    if p == 0:
        probs, dropped = first, first.new_empty((0,))
    else:
        dropped = first
    used = dropped if p > 0 else probs
    out = (used.to(acc) @ v.to(acc)).to(q.dtype)
    return out, probs, dropped


# ------------------------------------------------------------------------------------- varlen form
# (Checks the fakes run, as csrc/attention_ops.h's check_varlen does for the kernels. T, the packed
# tokens, is a data-dependent size in traced graphs (an unbacked u0): the checks compare it through
# torch._check_value, which a symbolic size turns into a runtime assertion, and never branch on it.)

_INT_DTYPES = (torch.int32, torch.int64)


def _check_varlen(op: str, q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor) -> None:
    _check_qkv_tensors(op, q, k, v, "[tokens, heads, head_dim]")
    (T, Hq, D), (Tk, Hk, Dk), (Tv, Hv, _) = q.shape, k.shape, v.shape
    fits = lambda: (  # noqa: E731
        f"dmfx::{op}: q {list(q.shape)}, k {list(k.shape)} and v {list(v.shape)} do not fit [T, Hq, D], "
        "[T, Hk, D], [T, Hk, Dv] (the same T packed tokens)"
    )
    if Hk != Hv or D != Dk:
        raise ValueError(fits())
    torch._check_value(T == Tk, fits)
    torch._check_value(Tk == Tv, fits)
    if Hk == 0 or Hq % Hk:
        raise ValueError(f"dmfx::{op}: q's {Hq} heads must be a multiple of k's and v's {Hk} heads")
    _check_tensor(op, "cu_seqlens", cu_seqlens)
    if cu_seqlens.dim() != 1:
        raise ValueError(f"dmfx::{op}: cu_seqlens must be 1-D [batch + 1], got shape {list(cu_seqlens.shape)}")
    if cu_seqlens.dtype not in _INT_DTYPES:
        raise TypeError(f"dmfx::{op}: cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}")
    if cu_seqlens.device != q.device:
        raise ValueError(f"dmfx::{op}: cu_seqlens is on {cu_seqlens.device} but q is on {q.device} (it must be on q's device)")
    torch._check_value(
        cu_seqlens.shape[0] >= 2,
        lambda: f"dmfx::{op}: cu_seqlens must hold at least one sequence [0, ..., T] (batch + 1 >= 2 entries), "
        f"got shape {list(cu_seqlens.shape)}",
    )


def _check_varlen_supported(op: str, q: Tensor, v: Tensor) -> None:
    """The kernels' NotImplementedError for a CUDA dtype or head dims they lack (what the fakes can tell:
    not the GPU's shared memory)."""
    if q.device.type != "cuda":
        return
    dims = (q.shape[2], v.shape[2])
    if q.dtype not in _CUDA_FLASH_DTYPES or any(isinstance(d, int) and d > _CUDA_FLASH_MAX_HEAD_DIM for d in dims):
        raise NotImplementedError(
            f"dmfx::{op}: no fused kernel for {q.dtype} with head dims D = {dims[0]}, Dv = {dims[1]} on {q.device}. "
            "Supported: CPU float32 and float64 (float16 and bfloat16 computed in float32), CUDA float32, float16 "
            "and bfloat16 with head dims up to 128; dmfx.cuda_ops.attention.varlen_supported says which"
        )


def _split_packed_qkv(op: str, qkv: Tensor, heads: int) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v ([T, H, D] views) of the stacked projection qkv [T, 3 * heads * D]."""
    _check_tensor(op, "qkv", qkv)
    if qkv.dim() != 2:
        raise ValueError(f"dmfx::{op}: qkv must be 2-D [tokens, 3 * heads * head_dim], got shape {list(qkv.shape)}")
    if heads <= 0 or qkv.shape[1] % (3 * heads):
        raise ValueError(f"dmfx::{op}: qkv's last dim {qkv.shape[1]} is not 3 * heads * head_dim with heads={heads}")
    per = qkv.unflatten(1, (3, heads, qkv.shape[1] // (3 * heads)))  # [T, 3, H, D]
    return tuple(per.select(1, i) for i in range(3))  # type: ignore[return-value]


def _varlen_checks(op, q, k, v, cu_seqlens, seed, p) -> None:
    _check_varlen(op, q, k, v, cu_seqlens)
    _check_p(op, p, seed)
    _check_varlen_supported(op, q, v)


def _fake_varlen_outputs(q: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    T, Hq, _ = q.shape
    return q.new_empty((T, Hq, v.shape[2])), q.new_empty((2, Hq, T), dtype=_stats_dtype(q.dtype))


@torch.library.register_fake("dmfx::varlen_attention")
def _varlen_attention_fake(q, k, v, cu_seqlens, scale, causal, seed, p):
    _varlen_checks("varlen_attention", q, k, v, cu_seqlens, seed, p)
    return _fake_varlen_outputs(q, v)


@torch.library.register_fake("dmfx::varlen_attention_backward")
def _varlen_attention_backward_fake(grad_out, q, k, v, out, stats, cu_seqlens, scale, causal, seed, p):
    _varlen_checks("varlen_attention_backward", q, k, v, cu_seqlens, seed, p)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


@torch.library.register_fake("dmfx::qkv_varlen_attention")
def _qkv_varlen_attention_fake(qkv, heads, cu_seqlens, scale, causal, seed, p):
    q, k, v = _split_packed_qkv("qkv_varlen_attention", qkv, heads)
    _varlen_checks("qkv_varlen_attention", q, k, v, cu_seqlens, seed, p)
    return _fake_varlen_outputs(q, v)


@torch.library.register_fake("dmfx::qkv_varlen_attention_backward")
def _qkv_varlen_attention_backward_fake(grad_out, qkv, heads, out, stats, cu_seqlens, scale, causal, seed, p):
    q, k, v = _split_packed_qkv("qkv_varlen_attention_backward", qkv, heads)
    _varlen_checks("qkv_varlen_attention_backward", q, k, v, cu_seqlens, seed, p)
    return qkv.new_empty(qkv.shape)


def check_cu_seqlens(op: str, cu_seqlens: Tensor, T: int) -> None:
    """cu_seqlens' values: cu[0] = 0, non-decreasing, cu[B] = T (ValueError naming `op`). Reads them on the
    host (a synchronization on CUDA, which the ops themselves never do: csrc/attention_ops.h). Tensors of
    another shape or dtype are left to the op's own checks."""
    if not (isinstance(cu_seqlens, Tensor) and cu_seqlens.dim() == 1 and cu_seqlens.dtype in _INT_DTYPES
            and cu_seqlens.numel() >= 1):
        return
    cu = cu_seqlens.tolist()
    if cu[0] != 0:
        raise ValueError(f"dmfx::{op}: cu_seqlens must start at 0, got cu_seqlens[0] = {cu[0]}")
    for i in range(1, len(cu)):
        if cu[i] < cu[i - 1]:
            raise ValueError(f"dmfx::{op}: cu_seqlens must be non-decreasing (sequence lengths >= 0), got "
                             f"cu_seqlens[{i}] = {cu[i]} < cu_seqlens[{i - 1}] = {cu[i - 1]}")
    if cu[-1] != T:
        raise ValueError(f"dmfx::{op}: cu_seqlens must end at T = {T} (the packed rows of q, k and v), got "
                         f"cu_seqlens[{len(cu) - 1}] = {cu[-1]}")


def varlen_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor,
    scale: float | None = None,
    causal: bool = False,
    p: float = 0.0,
    training: bool = True,
) -> Tensor:
    """Attention over packed variable-length sequences: q [T, Hq, D], k [T, Hk, D], v [T, Hk, Dv] (any
    strides with a unit last stride; Hq a multiple of Hk) hold B sequences back to back, sequence b in
    rows ``cu_seqlens[b] : cu_seqlens[b + 1]`` (int32 / int64 [B + 1] on q's device). Each sequence gets
    ``dropout(softmax(q @ k.transpose * scale), p) @ v`` of its own rows, like
    ``F.scaled_dot_product_attention`` on it alone (scale defaults to 1/sqrt(D); causal within each
    sequence). Returns out [T, Hq, Dv], contiguous. cu_seqlens' values are checked here (ValueError; on
    CUDA that reads them back to the host, which the op itself never does). CPU float16 / bfloat16 are
    computed in float32."""
    for name, x in (("q", q), ("k", k), ("v", v), ("cu_seqlens", cu_seqlens)):
        _check_tensor("varlen_attention", name, x)
    check_cu_seqlens("varlen_attention", cu_seqlens, q.shape[0])
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    p = float(p) if training else 0.0
    seed = new_seed() if p > 0 else None
    return torch.ops.dmfx.varlen_attention(q, k, v, cu_seqlens, scale, bool(causal), seed, p)[0]


def reference_varlen_attention(q, k, v, cu_seqlens, scale=1.0, causal=False, seed=None, p=0.0):
    """(out, stats) of dmfx::varlen_attention in pure PyTorch (differentiable): per sequence the dense math
    (float32; float64 stays float64), causal within the sequence, the dropout mask of element
    (h * T + tq) * T + tk (reference.philox_keep_at). out [T, Hq, Dv] in q's dtype; stats [2, Hq, T] in the
    math's dtype: each row's max logit and 1 / sum of its exps."""
    T, Hq, _ = q.shape
    Hk, Dv = k.shape[1], v.shape[2]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    cu = [int(c) for c in cu_seqlens.tolist()]
    outs, maxes, invs = [], [], []
    for b in range(len(cu) - 1):
        s, e = cu[b], cu[b + 1]
        L = e - s
        if L == 0:
            continue
        qs, ks, vs = (t[s:e].to(acc).transpose(0, 1) for t in (q, k, v))  # [H, L, D]
        ks, vs = (t.repeat_interleave(Hq // Hk, dim=0) for t in (ks, vs))
        z = (qs @ ks.transpose(1, 2)) * scale
        if causal:
            z = z.masked_fill(torch.ones(L, L, dtype=torch.bool, device=z.device).triu(1), float("-inf"))
        mx = z.amax(-1, keepdim=True)
        ex = torch.exp(z - mx)
        total = ex.sum(-1, keepdim=True)
        probs = ex / total
        if p > 0:
            h = torch.arange(Hq)[:, None, None]
            i = torch.arange(L)[None, :, None]
            j = torch.arange(L)[None, None, :]
            idx = ((h * T + s + i) * T + s + j).numpy()
            keep = R.philox_keep_at(idx, p, seed).to(z.device)
            probs = torch.where(keep, probs * (0.0 if p >= 1 else 1.0 / (1.0 - p)), torch.zeros_like(probs))
        outs.append((probs @ vs).transpose(0, 1))
        maxes.append(mx[..., 0].detach())
        invs.append((1.0 / total[..., 0]).detach())
    if not outs:
        out = q.new_zeros((T, Hq, Dv), dtype=acc)
        stats = q.new_empty((2, Hq, 0), dtype=acc)
    else:
        out = torch.cat(outs, dim=0)
        stats = torch.stack([torch.cat(maxes, dim=1), torch.cat(invs, dim=1)])
    return out.to(q.dtype), stats

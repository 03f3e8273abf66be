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
``dmfx::flash_attention(q, k, v, mask, scale, causal, seed, p) -> (Tensor out, Tensor stats)`` and
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
    (``flash_supported``).

Determinism (CPU; tests/test_determinism.py): the fused (flash) ops are bit-reproducible run to run
and for any thread count (one thread computes each (batch, kv head) task whole, its GEMMs
single-threaded inside it). The GEMM form is bit-reproducible run to run with the thread count fixed
(ATen's batched GEMMs, and the softmax kernels, which are thread-count independent).
"""

from __future__ import annotations

import functools

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
    "flash_attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale, bool causal, Tensor? seed, float p) "
    "-> (Tensor out, Tensor stats)"
)
_lib.define(
    "flash_attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor stats, Tensor? mask, float scale, "
    "bool causal, Tensor? seed, float p, bool bias_grad=False) "
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

OPS = (
    "attention", "attention_backward", "qkv_attention", "qkv_attention_backward",
    "flash_attention", "flash_attention_backward", "qkv_flash_attention", "qkv_flash_attention_backward",
)
kernels_in_cxx(OPS)

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


# ----------------------------------------------------------------------------------------- checks
# (The fakes run them at trace time, and for Meta tensors, where no C++ kernel runs; the kernels run the
# same checks in C++: csrc/attention_ops.h.)


def _check_qkv(op: str, q: Tensor, k: Tensor, v: Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(op, name, t)
        if t.dim() != 4:
            raise ValueError(f"dmfx::{op}: {name} must be 4-D [batch, heads, seq, head_dim], got shape {list(t.shape)}")
        if t.dtype not in _DTYPES:
            raise TypeError(f"dmfx::{op}: {name} must be float32, float16, bfloat16 or float64, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"dmfx::{op}: q, k and v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"dmfx::{op}: q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
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
def _flash_attention_fake(q, k, v, mask, scale, causal, seed, p):
    return _fake_flash_outputs("flash_attention", q, k, v, mask, causal, seed, p)


@torch.library.register_fake("dmfx::flash_attention_backward")
def _flash_attention_backward_fake(grad_out, q, k, v, stats, mask, scale, causal, seed, p, bias_grad=False):
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


def reference_attention(q, k, v, mask=None, scale=1.0, causal=False, seed=None, p=0.0):
    """(out, probs, dropped) of dmfx::attention in pure PyTorch (float32 math; float64 stays float64)."""
    g = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(g, dim=1) for t in (k, v))
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    scores = (q.to(acc) @ k.to(acc).transpose(-2, -1)).to(q.dtype)
    first, probs = R.reference_softmax(scores, mask, scale, causal, seed, p)
    if p == 0:
        probs, dropped = first, first.new_empty((0,))
    else:
        dropped = first
    used = dropped if p > 0 else probs
    out = (used.to(acc) @ v.to(acc)).to(q.dtype)
    return out, probs, dropped

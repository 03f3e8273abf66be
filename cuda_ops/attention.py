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

Ops (``torch.library`` fragment of the ``dmfx::`` namespace; CPU and CUDA share this implementation:
the GEMMs are ATen's (MKL / cuBLAS), the softmax kernels are dmfx's own)
-----------------------------------------------------------------------------------------------------
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
    kernel_mask as _kernel_mask,
    new_seed,
    no_double_backward,
    seed_values as _seed_values,
)
from .build import kernels_for

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

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


# ----------------------------------------------------------------------------------------- checks


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


# ----------------------------------------------------------------------------------------- GEMMs


def _mergeable(t: Tensor) -> bool:
    """Whether t's first two dims fold into one batch dim as a view."""
    return t.shape[0] == 1 or t.shape[1] == 1 or t.stride(0) == t.shape[1] * t.stride(1)


def _bmm4(a: Tensor, b: Tensor, out: Tensor, alpha: float = 1.0, accumulate: bool = False) -> None:
    """out[i, j] (+)= alpha * a[i, j] @ b[i, j] for 4-D strided operands, writing into `out` in place.

    ATen's bmm reads any operand whose matrices have a unit stride in one dim (row- or column-major
    with any leading dimension) and any batch stride, and writes a strided `out` directly, so a view
    of the projection output is a GEMM operand as it is. When the first two dims fold into one batch
    dim for all three tensors this is one bmm, otherwise one bmm per batch element."""
    if all(_mergeable(t) for t in (a, b, out)):
        a, b, out = (t.flatten(0, 1) for t in (a, b, out))
        pairs = [(a, b, out)]
    else:
        pairs = [(a[i], b[i], out[i]) for i in range(a.shape[0])]
    for x, y, o in pairs:
        if accumulate:
            o.baddbmm_(x, y, alpha=alpha)
        elif alpha != 1.0:
            torch.baddbmm(o, x, y, beta=0, alpha=alpha, out=o)
        else:
            torch.bmm(x, y, out=o)


def _groups(t: Tensor, groups: int) -> list[Tensor]:
    """The `groups` [B, Hk, ...] slices of a [B, Hk * groups, ...] tensor that share one k/v head."""
    if groups == 1:
        return [t]
    per = t.unflatten(1, (t.shape[1] // groups, groups))
    return [per.select(2, g) for g in range(groups)]


# ----------------------------------------------------------------------------------------- kernels


def _forward(q, k, v, mask, scale, causal, seed, p, out):
    B, Hq, Lq, _ = q.shape
    Lk, Hk = k.shape[2], k.shape[1]
    g = Hq // Hk
    scores = torch.empty((B, Hq, Lq, Lk), dtype=q.dtype, device=q.device)
    kt = k.transpose(2, 3)
    for qg, sg in zip(_groups(q, g), _groups(scores, g)):
        _bmm4(qg, kt, sg)
    first, second = torch.ops.dmfx.attention_softmax(scores, mask, scale, causal, seed, p)
    del scores
    # the kernel returns (dropped, probs) with dropout and (probs, empty) without
    probs, dropped = (second, first) if p > 0 else (first, second)
    for pg, og in zip(_groups(first, g), _groups(out, g)):
        _bmm4(pg, v, og)
    return out, probs, dropped


def _backward(grad_out, q, k, v, probs, dropped, seed, p, scale, mask_grad, grad_probs, grad_dropped, dq, dk, dv):
    Hq, Hk = q.shape[1], k.shape[1]
    g = Hq // Hk
    used = dropped if p > 0 else probs  # what multiplied v
    # dv = usedᵀ · dO (summed over the query heads sharing a kv head)
    for i, (pg, gg) in enumerate(zip(_groups(used, g), _groups(grad_out, g))):
        _bmm4(pg.transpose(2, 3), gg, dv, accumulate=i > 0)
    # d(used) = dO · vᵀ, then the fused dropout + softmax backward
    d_used = torch.empty(used.shape, dtype=q.dtype, device=q.device)
    vt = v.transpose(2, 3)
    for gg, dg in zip(_groups(grad_out, g), _groups(d_used, g)):
        _bmm4(gg, vt, dg)
    if grad_dropped is not None and p > 0:  # a gradient reaching the returned outputs too
        d_used += grad_dropped
    if grad_probs is not None and p == 0:
        d_used += grad_probs
    kscale = 1.0 if mask_grad else scale
    dz = torch.ops.dmfx.attention_softmax_backward(d_used, probs, seed, p, kscale)
    del d_used
    if grad_probs is not None and p > 0:
        dz += torch.ops.dmfx.attention_softmax_backward(grad_probs, probs, None, 0.0, kscale)
    alpha = scale if mask_grad else 1.0  # dS = scale * dz: applied by the softmax kernel or the GEMMs
    for i, (zg, qg, dqg) in enumerate(zip(_groups(dz, g), _groups(q, g), _groups(dq, g))):
        _bmm4(zg, k, dqg, alpha=alpha)
        _bmm4(zg.transpose(2, 3), qg, dk, alpha=alpha, accumulate=i > 0)
    return dq, dk, dv, (dz if mask_grad else dz.new_empty((0,)))


def _attention_kernel(q, k, v, mask, scale, causal, seed, p):
    _check_forward("attention", q, k, v, mask, causal, seed, p)
    return _forward(q, k, v, mask, scale, causal, seed, p, _context(q, v))


def _attention_backward_kernel(grad_out, q, k, v, probs, dropped, seed, p, scale, mask_grad, grad_probs=None, grad_dropped=None):
    _check_qkv("attention_backward", q, k, v)
    _check_p("attention_backward", p, seed)
    return _backward(grad_out, q, k, v, probs, dropped, seed, p, scale, mask_grad, grad_probs, grad_dropped, *_grads_like(q, k, v))


def _qkv_attention_kernel(qkv, heads, mask, scale, causal, seed, p):
    q, k, v = _split_qkv("qkv_attention", qkv, heads)
    _check_forward("qkv_attention", q, k, v, mask, causal, seed, p)
    return _forward(q, k, v, mask, scale, causal, seed, p, _context(q, v))


def _qkv_attention_backward_kernel(grad_out, qkv, heads, probs, dropped, seed, p, scale, mask_grad, grad_probs=None, grad_dropped=None):
    q, k, v = _split_qkv("qkv_attention_backward", qkv, heads)
    _check_p("qkv_attention_backward", p, seed)
    dqkv = torch.empty(qkv.shape, dtype=qkv.dtype, device=qkv.device)
    dq, dk, dv = _split_qkv("qkv_attention_backward", dqkv, heads)
    _, _, _, dz = _backward(grad_out, q, k, v, probs, dropped, seed, p, scale, mask_grad, grad_probs, grad_dropped, dq, dk, dv)
    return dqkv, dz


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


def _flash_ok(q: Tensor, v: Tensor) -> bool:
    """flash_supported for these operands (q [B, Hq, Lq, D], v [B, Hk, Lk, Dv])."""
    return flash_supported(q.device, q.dtype, q.shape[3], v.shape[3])


def _rows(*ts: Tensor) -> tuple[Tensor, ...]:
    """The fused kernels read q, k, v (and the output gradient) with a unit stride in the head dim:
    copies of any that lack it (the ops accept any strides; the passes never hand such views)."""
    return tuple(t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous() for t in ts)


def _flash_forward(q, k, v, mask, scale, causal, seed, p, out):
    if _flash_ok(q, v):
        q, k, v = _rows(q, k, v)
        s, o = _seed_values(seed, "flash_attention")
        stats = kernels_for(q.device).flash_fwd(q, k, v, _kernel_mask(mask, q), scale, causal, s, o, p, out)
        return out, stats
    _forward(q, k, v, mask, scale, causal, seed, p, out)
    return out, q.new_empty((2, *q.shape[:3]), dtype=_stats_dtype(q.dtype))  # unused by the unfused backward


def _flash_backward(grad_out, q, k, v, stats, mask, scale, causal, seed, p, dq, dk, dv, bias_part=None):
    """dq, dk, dv written in place; with `bias_part` ([3, B, H, D]) the fused kernel also writes each
    (batch, head)'s column sums of dq, dk, dv there (the unfused path leaves it to the caller)."""
    if _flash_ok(q, v):
        s, o = _seed_values(seed, "flash_attention_backward")
        go, q, k, v = _rows(grad_out, q, k, v)
        kernels_for(q.device).flash_bwd(go, q, k, v, stats, _kernel_mask(mask, q), scale, causal, s, o, p, dq, dk, dv,
                                        bias_part)
        return dq, dk, dv
    # unfused: recompute the probabilities (and the dropped ones) once, then the GEMM backward
    _, probs, dropped = _forward(q, k, v, mask, scale, causal, seed, p, _context(q, v))
    _backward(grad_out, q, k, v, probs, dropped, seed, p, scale, False, None, None, dq, dk, dv)
    return dq, dk, dv


def _stats_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _flash_attention_kernel(q, k, v, mask, scale, causal, seed, p):
    _check_forward("flash_attention", q, k, v, mask, causal, seed, p)
    return _flash_forward(q, k, v, mask, scale, causal, seed, p, _context(q, v))


def _bias_part(bias_grad: bool, q: Tensor, k: Tensor, v: Tensor) -> Tensor | None:
    """The [3, B, H, D] buffer the fused backward writes each (batch, head)'s dq, dk, dv column sums
    into, or None: not asked for, no fused kernel here, or grouped-query k/v."""
    if bias_grad and _flash_ok(q, v) and q.shape[1] == k.shape[1] and q.shape[3] == v.shape[3]:
        return q.new_empty((3, q.shape[0], q.shape[1], q.shape[3]))
    return None


def _head_bias_grads(part: Tensor | None, *grads: Tensor) -> tuple[Tensor, ...]:
    """The bias gradients ([H * D] each) of the projections that produced q, k, v ([B, H, L, D]
    views of [B, L, H * D]): the kernel's per-(batch, head) sums `part` summed over the batch, or,
    where the kernel did not sum (unfused path, grouped-query k/v), the gradients summed here."""
    if part is not None:
        return tuple(part[i].sum(0).reshape(-1) for i in range(3))  # (three tensors: outputs must not alias)
    return tuple(g.sum(dim=(0, 2)).reshape(-1) for g in grads)


def _flash_attention_backward_kernel(grad_out, q, k, v, stats, mask, scale, causal, seed, p, bias_grad=False):
    _check_qkv("flash_attention_backward", q, k, v)
    _check_p("flash_attention_backward", p, seed)
    dq, dk, dv = _grads_like(q, k, v)
    part = _bias_part(bias_grad, q, k, v)
    _flash_backward(grad_out, q, k, v, stats, mask, scale, causal, seed, p, dq, dk, dv, part)
    if not bias_grad:
        none = dq.new_empty((0,))
        return dq, dk, dv, none, none.clone(), none.clone()
    return (dq, dk, dv, *_head_bias_grads(part, dq, dk, dv))


def _qkv_flash_attention_kernel(qkv, heads, mask, scale, causal, seed, p):
    q, k, v = _split_qkv("qkv_flash_attention", qkv, heads)
    _check_forward("qkv_flash_attention", q, k, v, mask, causal, seed, p)
    return _flash_forward(q, k, v, mask, scale, causal, seed, p, _context(q, v))


def _qkv_flash_attention_backward_kernel(grad_out, qkv, heads, stats, mask, scale, causal, seed, p, bias_grad=False):
    q, k, v = _split_qkv("qkv_flash_attention_backward", qkv, heads)
    _check_p("qkv_flash_attention_backward", p, seed)
    dqkv = torch.empty(qkv.shape, dtype=qkv.dtype, device=qkv.device)
    dq, dk, dv = _split_qkv("qkv_flash_attention_backward", dqkv, heads)
    part = _bias_part(bias_grad, q, k, v)
    _flash_backward(grad_out, q, k, v, stats, mask, scale, causal, seed, p, dq, dk, dv, part)
    if not bias_grad:
        return dqkv, dqkv.new_empty((0,))
    # the stacked projections' bias gradient: the per-(batch, head) column sums summed over the batch
    dbias = part.sum(1).reshape(-1) if part is not None else dqkv.sum(dim=(0, 1))
    return dqkv, dbias


for _dev in ("CPU", "CUDA"):
    _lib.impl("flash_attention", _flash_attention_kernel, _dev)
    _lib.impl("flash_attention_backward", _flash_attention_backward_kernel, _dev)
    _lib.impl("qkv_flash_attention", _qkv_flash_attention_kernel, _dev)
    _lib.impl("qkv_flash_attention_backward", _qkv_flash_attention_backward_kernel, _dev)
    _lib.impl("attention", _attention_kernel, _dev)
    _lib.impl("attention_backward", _attention_backward_kernel, _dev)
    _lib.impl("qkv_attention", _qkv_attention_kernel, _dev)
    _lib.impl("qkv_attention_backward", _qkv_attention_backward_kernel, _dev)


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


# ----------------------------------------------------------------------------------------- autograd


def _save_common(ctx, mask, scale, p, output):
    _, probs, dropped = output
    ctx.scale, ctx.p = scale, p
    ctx.mask_shape = tuple(mask.shape) if mask is not None else None
    ctx.mask_dtype = mask.dtype if mask is not None else None
    ctx.set_materialize_grads(False)
    return probs, dropped


def _mask_grad(ctx, dz):
    return dz.sum_to_size(ctx.mask_shape).to(ctx.mask_dtype)


def _setup_attention(ctx, inputs, output):
    q, k, v, mask, scale, causal, seed, p = inputs
    probs, dropped = _save_common(ctx, mask, scale, p, output)
    ctx.save_for_backward(q, k, v, probs, dropped, seed)


def _backward_attention(ctx, grad_out, grad_probs, grad_dropped):
    q, k, v, probs, dropped, seed = ctx.saved_tensors
    need_mask = ctx.needs_input_grad[3]
    if not any(ctx.needs_input_grad[:4]):
        return (None,) * 8
    grad_out = _materialize(grad_out, q, v)
    dq, dk, dv, dz = torch.ops.dmfx.attention_backward(
        grad_out, q, k, v, probs, dropped, seed, ctx.p, ctx.scale, need_mask, grad_probs, grad_dropped
    )
    return dq, dk, dv, (_mask_grad(ctx, dz) if need_mask else None), None, None, None, None


def _setup_qkv_attention(ctx, inputs, output):
    qkv, heads, mask, scale, causal, seed, p = inputs
    probs, dropped = _save_common(ctx, mask, scale, p, output)
    ctx.heads = heads
    ctx.save_for_backward(qkv, probs, dropped, seed)


def _backward_qkv_attention(ctx, grad_out, grad_probs, grad_dropped):
    qkv, probs, dropped, seed = ctx.saved_tensors
    need_mask = ctx.needs_input_grad[2]
    if not (ctx.needs_input_grad[0] or need_mask):
        return (None,) * 7
    q, _, v = _split_qkv("qkv_attention", qkv, ctx.heads)
    grad_out = _materialize(grad_out, q, v)
    dqkv, dz = torch.ops.dmfx.qkv_attention_backward(
        grad_out, qkv, ctx.heads, probs, dropped, seed, ctx.p, ctx.scale, need_mask, grad_probs, grad_dropped
    )
    return dqkv, None, (_mask_grad(ctx, dz) if need_mask else None), None, None, None, None


def _materialize(grad_out, q, v):
    """Only the probabilities got a gradient: the output's is zero."""
    if grad_out is not None:
        return grad_out
    return _context(q, v).zero_()


def _setup_flash(ctx, inputs, output):
    *tensors, mask, scale, causal, seed, p = inputs
    ctx.scale, ctx.causal, ctx.p = scale, causal, p
    ctx.heads = tensors[1] if len(tensors) == 2 else None  # qkv_flash_attention: (qkv, heads)
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(output[1])  # the row statistics are for the backward only
    saved = [t for t in tensors if isinstance(t, Tensor)]
    ctx.save_for_backward(*saved, output[1], mask, seed)


def _backward_flash(ctx, grad_out, grad_lse):
    *tensors, stats, mask, seed = ctx.saved_tensors
    packed = ctx.heads is not None
    n_in = 7 if packed else 8
    mask_index = 2 if packed else 3
    if ctx.needs_input_grad[mask_index]:
        raise NotImplementedError(
            "dmfx::flash_attention: the mask requires grad (e.g. a learned position bias); the fused form "
            "does not compute a mask gradient. dmfx's attention pass uses dmfx::attention for such masks."
        )
    if grad_lse is not None:
        raise NotImplementedError("dmfx::flash_attention: a gradient through the row statistics is not supported")
    if grad_out is None:
        return (None,) * n_in
    if packed:
        (qkv,) = tensors
        dqkv, _ = torch.ops.dmfx.qkv_flash_attention_backward(
            grad_out, qkv, ctx.heads, stats, mask, ctx.scale, ctx.causal, seed, ctx.p
        )  # (the backward pass, passes/backward.py, asks for the bias gradient when a bias is trained)
        return (dqkv,) + (None,) * 6
    q, k, v = tensors
    dq, dk, dv, *_ = torch.ops.dmfx.flash_attention_backward(grad_out, q, k, v, stats, mask, ctx.scale, ctx.causal, seed, ctx.p)
    return (dq, dk, dv) + (None,) * 5


torch.library.register_autograd("dmfx::attention", _backward_attention, setup_context=_setup_attention)
torch.library.register_autograd("dmfx::flash_attention", _backward_flash, setup_context=_setup_flash)
torch.library.register_autograd("dmfx::qkv_flash_attention", _backward_flash, setup_context=_setup_flash)
torch.library.register_autograd("dmfx::qkv_attention", _backward_qkv_attention, setup_context=_setup_qkv_attention)


for _op in ("attention_backward", "qkv_attention_backward", "flash_attention_backward", "qkv_flash_attention_backward"):
    no_double_backward(_op, "dmfx.attention")


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
    _check_qkv("attention", q, k, v)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    p = float(p) if training else 0.0
    _check_p("attention", p, None if p == 0 else torch.zeros(2, dtype=torch.int64))
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

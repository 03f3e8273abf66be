"""dmfx's fused attention softmax: scale + mask + causal mask + softmax + dropout, and its backward.

This is the paper's SM (forward) and BS (backward) kernel pair over attention scores
``[batch, heads, q_len, k_len]`` (any number of leading dims; softmax over the last dim).

Ops
---
``dmfx::attention_softmax(Tensor scores, Tensor? mask, float scale, bool causal, Tensor? seed, float p)
    -> (Tensor out, Tensor probs)``
    ``z = scores * scale + mask`` (mask broadcastable to scores; bool masks: True = attend, False =
    -inf; float masks of another dtype than scores' and float32 are cast to float32 first), plus
    ``-inf`` where ``j > i + (Sk - Sq)`` when ``causal``; ``probs = softmax(z)`` over the last dim
    (fully masked rows give zeros, never NaN); ``out = dropout(probs, p)`` with the Philox mask of
    ``seed`` (element index = row-major index in scores' shape). When ``p == 0`` (``seed`` may then be
    None) ``out`` holds the probabilities and ``probs`` is empty (shape ``[0]``).
``dmfx::attention_softmax_backward(Tensor grad_out, Tensor probs, Tensor? seed, float p, float scale,
    Tensor? mask=None, float mask_scale=1.0) -> Tensor``
    ``g = dropout(grad_out)`` (same mask), ``scale * probs * (g - sum(g * probs, -1))``; ``probs`` is
    the forward's ``probs``, or its ``out`` when ``p == 0``. ``mask``: a dropout mask PyTorch's
    ``native_dropout`` stored (bool, probs' shape; p must be 0), applied as ``g = grad_out * mask *
    mask_scale`` (``native_dropout_backward``) instead of a regenerated one.

The autograd formula of ``dmfx::attention_softmax`` calls ``dmfx::attention_softmax_backward`` for the scores and, when a
float mask requires grad (e.g. T5's learned position bias), for the mask (``scale=1``, reduced to the
mask's shape). A gradient reaching ``probs`` (the second output) is handled too (as a ``p == 0``
term). Double backward raises NotImplementedError.

Determinism (CPU; tests/test_determinism.py): forward and backward are bit-reproducible run to run
and for any thread count (each row is computed whole by one thread; the dropout mask is Philox of
the element index).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._library import (
    LIB as _lib,
    check_dropout_p as _check_p,
    check_scores as _check_forward,
    check_stored_mask as _check_stored_mask,
    kernel_mask as _kernel_mask,
    new_seed,
    no_double_backward,
    seed_values as _seed_values,
)
from .build import kernels_for
from .reference import reference_softmax  # noqa: F401  (the family's reference; the attention family's uses it too)

_lib.define(
    "attention_softmax(Tensor scores, Tensor? mask, float scale, bool causal, Tensor? seed, float p) "
    "-> (Tensor out, Tensor probs)"
)
_lib.define(
    "attention_softmax_backward(Tensor grad_out, Tensor probs, Tensor? seed, float p, float scale, Tensor? mask=None, "
    "float mask_scale=1.0) -> Tensor"
)

OPS = ("attention_softmax", "attention_softmax_backward")

# ----------------------------------------------------------------------------------------- kernels


def _softmax_kernel(scores, mask, scale, causal, seed, p):
    _check_forward(scores, mask, causal, seed, p)
    s, o = _seed_values(seed, "attention_softmax")
    out, probs = kernels_for(scores.device).softmax_fwd(scores, _kernel_mask(mask, scores), scale, causal, s, o, p)
    return out, probs


def _softmax_backward_kernel(grad_out, probs, seed, p, scale, mask=None, mask_scale=1.0):
    _check_p("attention_softmax_backward", p, seed)
    _check_stored_mask("attention_softmax_backward", mask, "probs", probs, p)
    s, o = _seed_values(seed, "attention_softmax_backward")
    return kernels_for(probs.device).softmax_bwd(grad_out, probs, s, o, p, scale, mask, mask_scale)


for _dev in ("CPU", "CUDA"):
    _lib.impl("attention_softmax", _softmax_kernel, _dev)
    _lib.impl("attention_softmax_backward", _softmax_backward_kernel, _dev)


# ----------------------------------------------------------------------------------------- fakes


@torch.library.register_fake("dmfx::attention_softmax")
def _softmax_fake(scores, mask, scale, causal, seed, p):
    _check_forward(scores, mask, causal, seed, p)
    out = torch.empty(scores.shape, dtype=scores.dtype, device=scores.device)
    probs = torch.empty(scores.shape, dtype=scores.dtype, device=scores.device) if p > 0 else scores.new_empty((0,))
    return out, probs


@torch.library.register_fake("dmfx::attention_softmax_backward")
def _softmax_backward_fake(grad_out, probs, seed, p, scale, mask=None, mask_scale=1.0):
    _check_p("attention_softmax_backward", p, seed)
    _check_stored_mask("attention_softmax_backward", mask, "probs", probs, p)
    if grad_out.shape != probs.shape:
        raise ValueError(
            f"dmfx::attention_softmax_backward: grad_out must have the shape of probs {list(probs.shape)}, got {list(grad_out.shape)}"
        )
    return torch.empty(probs.shape, dtype=probs.dtype, device=probs.device)


# ----------------------------------------------------------------------------------------- autograd


def _setup_softmax(ctx, inputs, output):
    scores, mask, scale, causal, seed, p = inputs
    out, probs = output
    ctx.p, ctx.scale = p, scale
    ctx.mask_shape = tuple(mask.shape) if mask is not None else None
    ctx.mask_dtype = mask.dtype if mask is not None else None
    # An unused output (usually probs) must give None, not a zero tensor we would run a kernel on.
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(probs if p > 0 else out, seed)


def _backward_softmax(ctx, grad_out, grad_probs):
    probs, seed = ctx.saved_tensors
    need_scores, need_mask = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    none = (None,) * 6
    if not (need_scores or need_mask):
        return none
    # With a mask gradient the unscaled dz is needed too: compute it once, scale for the scores.
    kscale = 1.0 if need_mask else ctx.scale
    dz = None
    if grad_out is not None:
        dz = torch.ops.dmfx.attention_softmax_backward(grad_out, probs, seed, ctx.p, kscale)
    if grad_probs is not None and ctx.p > 0:
        # probs is softmax(z) itself (no dropout): its gradient is a p == 0 softmax backward.
        extra = torch.ops.dmfx.attention_softmax_backward(grad_probs, probs, None, 0.0, kscale)
        dz = extra if dz is None else dz + extra
    if dz is None:
        return none
    d_scores = d_mask = None
    if need_scores:
        d_scores = dz * ctx.scale if need_mask and ctx.scale != 1.0 else dz
    if need_mask:
        d_mask = dz.sum_to_size(ctx.mask_shape).to(ctx.mask_dtype)
    return d_scores, d_mask, None, None, None, None


torch.library.register_autograd("dmfx::attention_softmax", _backward_softmax, setup_context=_setup_softmax)


no_double_backward("attention_softmax_backward", "dmfx.attention_softmax")


# ----------------------------------------------------------------------------------------- Python API


def attention_softmax(
    scores: Tensor,
    mask: Tensor | None = None,
    scale: float = 1.0,
    causal: bool = False,
    p: float = 0.0,
    training: bool = True,
) -> Tensor:
    """``dropout(softmax(scores * scale + mask [+ causal mask], -1), p)`` in one pass over the scores."""
    if not isinstance(scores, Tensor):
        raise TypeError(f"dmfx::attention_softmax: scores must be a Tensor, got {type(scores).__name__}")
    if mask is not None and not isinstance(mask, Tensor):
        raise TypeError(f"dmfx::attention_softmax: mask must be a Tensor or None, got {type(mask).__name__}")
    p = float(p) if training else 0.0
    seed = new_seed() if p > 0 else None
    _check_p("attention_softmax", p, seed)
    return torch.ops.dmfx.attention_softmax(scores, mask, float(scale), bool(causal), seed, p)[0]

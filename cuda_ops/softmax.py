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

The ops' schemas and fake implementations (for tracing) are here; their CPU and CUDA kernels and the
autograd formula are registered in C++: csrc/softmax_ops.h (the ops on top of the kernels, any device,
with the argument checks), csrc/softmax_cpu.cpp (the CPU kernels, the registration of them and of the
autograd formula), csrc/softmax_cuda.cu + softmax_cuda_bind.cpp (CUDA).

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
    check_tensor,
    kernels_in_cxx,
    new_seed,
)
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
kernels_in_cxx(OPS)


# ----------------------------------------------------------------------------------------- fakes
# (They run the ops' argument checks at trace time, and for Meta tensors, where no C++ kernel runs; the
# kernels run the same checks in C++: csrc/op_api.h.)


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
    check_tensor("attention_softmax", "scores", scores)
    if mask is not None and not isinstance(mask, Tensor):
        raise TypeError(f"dmfx::attention_softmax: mask must be a Tensor or None, got {type(mask).__name__}")
    p = float(p) if training else 0.0
    seed = new_seed() if p > 0 else None
    return torch.ops.dmfx.attention_softmax(scores, mask, float(scale), bool(causal), seed, p)[0]

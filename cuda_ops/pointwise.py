"""dmfx's fused pointwise ops: bias + activation + dropout, gated activations, rotary embedding, soft cap.

The ops' schemas and fake implementations (for tracing) are here; their CPU and CUDA kernels, their
argument checks and their autograd formulas (each backward is itself a fused op) are registered in
C++: csrc/pointwise_ops.h (the ops on top of the kernels, any device), csrc/pointwise_cpu.cpp (the CPU
kernels, the registration of them and of the autograd formulas), csrc/pointwise_cuda.cu +
pointwise_cuda_bind.cpp (CUDA); the per-element math is shared in csrc/pointwise_api.h.

Ops
---
``dmfx::bias_act_dropout(x, bias?, act, seed?, p) -> out``: the paper's BRD,
    ``out = dropout(act(x + bias), p)`` over x [..., N] with bias [N]; ``seed`` None requires p == 0.
``dmfx::bias_act_dropout_backward(grad_out, x, bias?, act, seed?, p, output_mask, mask?=None,
    mask_scale=1.0) -> (dx, dbias)``: the paper's BDRB: recomputes ``act'(x + bias)`` and the dropout
    mask from x and the seed, and sums the bias gradient in the same pass. Outputs not requested are
    empty [0]. Without a bias, dbias is still the column sum of dx when asked for (the bias may sit in
    the GEMM before: passes/aten_backward.py). ``mask`` is a dropout mask a forward that was not
    dmfx's stored (``native_dropout``'s bool mask, x's shape): the gradient is then multiplied by
    ``mask * mask_scale`` (``native_dropout_backward``) instead of a regenerated mask, and p must be 0.
``dmfx::glu(gate, up, act) -> out``: ``act(gate) * up`` (SwiGLU with "silu", GeGLU with "gelu").
``dmfx::glu_backward(grad_out, gate, up, act, output_mask) -> (dgate, dup)``.
``dmfx::rope(q, k, cos, sin, inverse, interleaved=False, deinterleave=False) -> (q_out, k_out)``: HF LLaMA's
    apply_rotary_pos_emb on q and k in one kernel, ``x * cos + rotate_half(x) * sin``, which rotates the
    pairs (j, j + D/2); ``interleaved=True`` rotates the pairs (2j, 2j + 1) instead (GPT-J's and Cohere's
    ``rotate_every_two``: ``stack(-x[..., 1::2], x[..., ::2], -1).flatten(-2)``); ``deinterleave=True``
    rotates the pairs (2j, 2j + 1) of x into (j, j + D/2) of the output (DeepSeek's ``rope_interleave``:
    rotate_half's map on ``cat(x[..., 0::2], x[..., 1::2], -1)``, cos/sin by halves as in rotate_half's
    form; the two flags exclude each other). ``inverse=True`` applies the transpose map (the backward).
    cos/sin broadcast to q and k through strides (never materialized).
``dmfx::softcap(x, cap) -> out``: Gemma 2's soft-capped logits, ``cap * tanh(x / cap)``, one pass. x of
    any shape and strides (read in place where its last dim has unit stride); out is contiguous, x's
    shape and dtype, computed in float32 (float64 for float64 x) and rounded once. cap must be positive
    and finite: else ValueError ("dmfx::softcap: cap must be positive and finite, got ..."), from the
    kernels and from the fake (tracing) alike. Its autograd saves the OUTPUT only (not x): a loss over the
    capped logits keeps them anyway, where eager's chain also keeps the tanh's output, a second tensor
    of the logits' size.
``dmfx::softcap_backward(grad_out, out, cap) -> dx``: ``grad_out * (1 - (out / cap)^2)``, out softcap's
    output; grad_out and out of one shape, dtype and device (else an error naming the tensor and what
    was expected); dx contiguous, in their dtype, float32 (float64) math.

Activations (``act``): "identity", "relu", "gelu" (erf form), "gelu_tanh" (tanh approximation),
"silu", "tanh" (BERT's pooler), "quick_gelu" (``x * sigmoid(1.702 x)``, CLIP's), "relu_squared"
(``relu(x)^2``, Nemotron's and Primer's). Dropout seeds are int64 CPU tensors ``[seed, offset]`` (``new_seed()``,
_library.py); the mask of element i (row-major logical index in x's shape) is the Philox mask of
dmfx_common.h. Autograd: double backward through ``bias_act_dropout_backward`` or ``glu_backward``
raises NotImplementedError; ``rope``'s backward is ``rope`` again (differentiable); ``softcap_backward`` is
differentiable (for grad_out it is itself, for out ``-2 grad_out * out / cap^2`` in plain ATen).

Determinism (CPU; tests/test_determinism.py, softcap's in tests/test_pointwise_ops.py): every op is
bit-reproducible run to run with the thread count fixed; all outputs but ``bias_act_dropout_backward``'s
dbias are also independent of the thread count (element-wise math, Philox of the element index). That dbias is summed per thread
over the thread's fixed share of the rows, then across threads in order: reproducible for a given
count, not across counts.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from . import reference as R
from ._library import LIB as _lib, check_tensor as _check_tensor, kernels_in_cxx, new_seed

_lib.define("bias_act_dropout(Tensor x, Tensor? bias, str act, Tensor? seed, float p) -> Tensor")
_lib.define(
    "bias_act_dropout_backward(Tensor grad_out, Tensor x, Tensor? bias, str act, Tensor? seed, float p, "
    "bool[] output_mask, Tensor? mask=None, float mask_scale=1.0) -> (Tensor dx, Tensor dbias)"
)
_lib.define("glu(Tensor gate, Tensor up, str act) -> Tensor")
_lib.define(
    "glu_backward(Tensor grad_out, Tensor gate, Tensor up, str act, bool[] output_mask) -> (Tensor dgate, Tensor dup)"
)
_lib.define("rope(Tensor q, Tensor k, Tensor cos, Tensor sin, bool inverse, bool interleaved=False, "
            "bool deinterleave=False) -> (Tensor, Tensor)")
_lib.define("softcap(Tensor x, float cap) -> Tensor")
_lib.define("softcap_backward(Tensor grad_out, Tensor out, float cap) -> Tensor")

OPS = ("bias_act_dropout", "bias_act_dropout_backward", "glu", "glu_backward", "rope", "softcap", "softcap_backward")
kernels_in_cxx(OPS)


def _activations_of_the_kernels() -> tuple[str, ...]:
    """The activation names in the order of the kernels' codes: read from csrc/pointwise_api.h's
    ``enum Act`` (kGeluTanh = 3 -> "gelu_tanh"), the one table the kernels and this module share."""
    text = (Path(__file__).resolve().parent / "csrc" / "pointwise_api.h").read_text()
    body = re.search(r"enum Act : int \{([^}]*)\}", text)
    if body is None:
        raise RuntimeError("dmfx: csrc/pointwise_api.h has no `enum Act : int { ... }`")
    codes = {int(code): re.sub(r"(?<!^)([A-Z])", r"_\1", name).lower() for name, code in re.findall(r"k(\w+)\s*=\s*(\d+)", body[1])}
    return tuple(codes[i] for i in range(len(codes)))


# Activation names, indexed by the codes the kernels take.
ACTS = _activations_of_the_kernels()


# rope's output layout, which the fake has to describe as the kernel makes it (csrc/pointwise_ops.h:
# memory_order, rope_layout).


def _memory_order(t: Tensor) -> list[int] | None:
    """The permutation that makes `t` contiguous when `t` is a permuted dense tensor with the last
    dim innermost (HF's q/k after view + transpose(1, 2)); None when it is contiguous or not dense."""
    from torch._prims_common import is_contiguous_or_false
    from torch.fx.experimental.symbolic_shapes import guard_or_false

    # (guard-free: unpad's packed q and k have a data-dependent token count; its size-1 case, which the
    # kernel reads as contiguous, lays the same elements out alike)
    if t.dim() < 2 or is_contiguous_or_false(t):
        return None
    order = list(range(t.dim() - 1))
    for i in range(1, len(order)):  # (an insertion sort by decreasing stride, stable as the kernel's)
        j = i
        while j > 0 and guard_or_false(t.stride(order[j - 1]) < t.stride(order[j])):
            order[j - 1], order[j] = order[j], order[j - 1]
            j -= 1
    order.append(t.dim() - 1)
    return order if is_contiguous_or_false(t.permute(order)) else None


def _rope_layout(q: Tensor, k: Tensor) -> list[int] | None:
    """Outputs keep q's and k's memory order (as eager's element-wise ops do) when both share one,
    grouped-query k with fewer heads included (cos and sin are permuted alike and broadcast to each).
    Otherwise the backward of a [B, L, H, D]-laid-out attention would copy dq and dk back."""
    if q.dim() != k.dim():
        return None
    order = _memory_order(q)
    return order if order is not None and _memory_order(k) == order else None


# ----------------------------------------------------------------------------------------- fakes


def _like(t: Tensor) -> Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device=t.device)


def _nothing(t: Tensor) -> Tensor:
    return t.new_empty((0,))


@torch.library.register_fake("dmfx::bias_act_dropout")
def _bias_act_dropout_fake(x, bias, act, seed, p):
    return _like(x)


@torch.library.register_fake("dmfx::bias_act_dropout_backward")
def _bias_act_dropout_backward_fake(grad_out, x, bias, act, seed, p, output_mask, mask=None, mask_scale=1.0):
    m = list(output_mask)
    dx = _like(x) if m[0] else _nothing(x)
    dbias = x.new_empty((x.shape[-1],)) if m[1] else _nothing(x)
    return dx, dbias


@torch.library.register_fake("dmfx::glu")
def _glu_fake(gate, up, act):
    return _like(gate)


@torch.library.register_fake("dmfx::glu_backward")
def _glu_backward_fake(grad_out, gate, up, act, output_mask):
    m = list(output_mask)
    return (_like(gate) if m[0] else _nothing(gate)), (_like(gate) if m[1] else _nothing(gate))


def _check_cap(op: str, cap: float) -> None:
    """The kernels' check of softcap's cap (csrc/pointwise_api.h check_cap), with the same message, so
    that tracing fails as a call does."""
    if not (math.isfinite(cap) and cap > 0):
        raise ValueError(f"dmfx::{op}: cap must be positive and finite, got {cap:g}")


@torch.library.register_fake("dmfx::softcap")
def _softcap_fake(x, cap):
    _check_cap("softcap", cap)
    return _like(x)  # (contiguous, as the kernels make it)


@torch.library.register_fake("dmfx::softcap_backward")
def _softcap_backward_fake(grad_out, out, cap):
    _check_cap("softcap_backward", cap)
    return _like(grad_out)


@torch.library.register_fake("dmfx::rope")
def _rope_fake(q, k, cos, sin, inverse, interleaved=False, deinterleave=False):
    if interleaved and deinterleave:
        raise RuntimeError("dmfx::rope: interleaved and deinterleave exclude each other (GPT-J's pairs in and out, or "
                           "DeepSeek's pairs in and halves out)")
    order = _rope_layout(q, k)
    if order is None:
        return _like(q), _like(k)
    back = sorted(range(len(order)), key=order.__getitem__)
    return (
        q.new_empty([q.shape[d] for d in order]).permute(back),
        k.new_empty([k.shape[d] for d in order]).permute(back),
    )


# ----------------------------------------------------------------------------------------- Python API


def bias_act_dropout(
    x: Tensor, bias: Tensor | None = None, act: str = "gelu", p: float = 0.0, training: bool = True
) -> Tensor:
    """``dropout(act(x + bias), p)`` in one pass; the backward recomputes from x (nothing else stored)."""
    _check_tensor("bias_act_dropout", "x", x)
    p = float(p) if training else 0.0
    seed = new_seed() if p > 0 else None
    return torch.ops.dmfx.bias_act_dropout(x, bias, act, seed, p)


def glu(gate: Tensor, up: Tensor, act: str = "silu") -> Tensor:
    """``act(gate) * up`` (SwiGLU for "silu", GeGLU for "gelu"); gate/up may be strided views."""
    _check_tensor("glu", "gate", gate)
    _check_tensor("glu", "up", up)
    return torch.ops.dmfx.glu(gate, up, act)


def rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False,
         deinterleave: bool = False) -> tuple[Tensor, Tensor]:
    """HF's ``apply_rotary_pos_emb(q, k, cos, sin)`` (cos/sin already unsqueezed to broadcast);
    ``interleaved``: GPT-J's and Cohere's, which rotate the pairs (2j, 2j + 1); ``deinterleave``:
    DeepSeek's ``apply_rotary_pos_emb_interleave``, which rotates the pairs (2j, 2j + 1) into the halves
    (j, j + D/2), with cos/sin of D (HF's halves of D/2 each repeated: ``cat([c, c], -1)``)."""
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        _check_tensor("rope", name, t)
    return torch.ops.dmfx.rope(q, k, cos, sin, False, bool(interleaved), bool(deinterleave))


def softcap(x: Tensor, cap: float) -> Tensor:
    """``cap * tanh(x / cap)`` (Gemma 2's soft-capped logits); its backward reads the output only."""
    _check_tensor("softcap", "x", x)
    return torch.ops.dmfx.softcap(x, float(cap))


# ----------------------------------------------------------------------------------------- references


def _acc_dtype(t: Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def reference_act(v: Tensor, act: str) -> Tensor:
    """The activation by name, in plain PyTorch."""
    if act not in ACTS:
        raise ValueError(f"dmfx::reference_act: unknown activation {act!r}; valid activations are {', '.join(ACTS)}")
    if act == "identity":
        return v
    if act == "relu":
        return torch.relu(v)
    if act == "gelu":
        return F.gelu(v)
    if act == "gelu_tanh":
        return F.gelu(v, approximate="tanh")
    if act == "tanh":
        return torch.tanh(v)
    if act == "quick_gelu":  # as HF's QuickGELUActivation writes it
        return v * torch.sigmoid(1.702 * v)
    if act == "relu_squared":  # HF's ReLUSquaredActivation
        return torch.square(torch.relu(v))
    return F.silu(v)


def reference_bias_act_dropout(x: Tensor, bias: Tensor | None, act: str, seed: Tensor | None, p: float) -> Tensor:
    """``dropout(act(x + bias))`` in float32 (float64 for float64 x) with the kernels' Philox mask."""
    acc = _acc_dtype(x)
    s = x.to(acc)
    if bias is not None:
        s = s + bias.to(acc)
    s = reference_act(s, act)
    if p > 0:
        s = R.dropout(s, seed, p)
    return s.to(x.dtype)


def reference_glu(gate: Tensor, up: Tensor, act: str) -> Tensor:
    acc = _acc_dtype(gate)
    return (reference_act(gate.to(acc), act) * up.to(acc)).to(gate.dtype)


def _rotate(t: Tensor, interleaved: bool) -> Tensor:
    if interleaved:  # GPT-J's rotate_every_two
        return torch.stack((-t[..., 1::2], t[..., ::2]), dim=-1).flatten(-2)
    h = t.shape[-1] // 2  # LLaMA's rotate_half
    return torch.cat((-t[..., h:], t[..., :h]), dim=-1)


def reference_rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False,
                   deinterleave: bool = False) -> tuple[Tensor, Tensor]:
    """HF LLaMA's apply_rotary_pos_emb: ``x * cos + rotate_half(x) * sin`` for x in (q, k);
    ``interleaved``: ``rotate_every_two`` (GPT-J, Cohere) in place of ``rotate_half``; ``deinterleave``:
    rotate_half's form on x's pairs (2j, 2j + 1) taken as halves, ``cat(x[..., 0::2], x[..., 1::2])``
    (DeepSeek's rope_interleave)."""
    acc = _acc_dtype(q)
    c, s = cos.to(acc), sin.to(acc)

    def emb(x):
        xa = x.to(acc)
        if deinterleave:
            xa = torch.cat((xa[..., 0::2], xa[..., 1::2]), dim=-1)
        return (xa * c + _rotate(xa, interleaved) * s).to(x.dtype)

    return emb(q), emb(k)


__all__ = [
    "ACTS",
    "OPS",
    "bias_act_dropout",
    "glu",
    "rope",
    "softcap",
    "reference_act",
    "reference_bias_act_dropout",
    "reference_glu",
    "reference_rope",
]

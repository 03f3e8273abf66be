"""Soft-capped logits: ``tanh(z / cap) * cap`` (Gemma 2's ``final_logit_softcapping``) -> ``dmfx::softcap``,
whose autograd saves its output only.

PyTorch's formulas for the chain save the tanh's output for its backward, and the loss saves the capped
logits it reads: two ``[tokens, vocab]`` tensors kept from the forward to the backward, the largest of
an LM step (Gemma 2's vocabulary has 256000 entries). ``dmfx::softcap``'s backward reads the capped
logits themselves (``grad * (1 - (out / cap)^2)``), which the loss keeps anyway: one tensor of that
size less. The forward is one pass over the logits, as Inductor's fused chain is.

Matched where the capped values reach a loss (``_log_softmax`` through views and casts) in training:
that is where the saved tensor is, and where passes/backward could take the cap's gradient into the
loss's. Gemma 2's attention scores are soft-capped too, but there the cap belongs to the attention
(passes/attention.py: the flash kernel applies it; else the fused softmax takes the ``* cap``);
left to Inductor, a separate kernel for it would split Inductor's fused softmax.

Near-misses, left alone with the reason: a scale inside the tanh that is not ``1 / cap`` (that is
``b * tanh(a * z)``, a scaled tanh, not a cap), a cap that is not a positive constant (a run-time
float), the tanh's output read elsewhere, logits the kernels do not take (dtype or device)."""

from __future__ import annotations

import math

import torch
from torch.fx import Graph, Node

from .fusion import Fusion, Match, Miss, Replacement
from .graph_utils import PassContext, aten, commuted, insert_call, is_op, kernel_friendly, scaled_tanh, tensor_meta

#: What the capped logits may pass through on their way to the loss (HF's ``view(-1, V)`` and upcast).
_TO_LOSS = (aten.view, aten._unsafe_view, aten.reshape, aten._to_copy, torch.ops.prims.convert_element_type)


def _constant(x: object) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _reaches_a_loss(n: Node, depth: int = 4) -> bool:
    """Some reader of `n`, through views and casts, is a log_softmax (the loss's) or dmfx's fused loss."""
    for u in n.users:
        if is_op(u, aten._log_softmax, torch.ops.dmfx.cross_entropy) or (
                depth > 0 and is_op(u, *_TO_LOSS) and _reaches_a_loss(u, depth - 1)):
            return True
    return False


def _chain(t: Node) -> tuple[Node, float, float, Node, list[Node]] | None:
    """`t` = tanh(z * f) (graph_utils.scaled_tanh: constant factors f) read only by ``* cap``, a constant:
    (z, f, cap, the mul, the nodes from the tanh down to z)."""
    found = scaled_tanh(t)
    if found is None:
        return None
    z, factor, inner = found
    (mul,) = (u for u in t.users if u not in inner)
    cap = next((_constant(c) for a, c in commuted(mul, aten.mul) if a is t and _constant(c) is not None), None)
    return None if cap is None else (z, factor, cap, mul, inner)


def _is_cap(factor: float, cap: float) -> bool:
    """tanh(z * factor) * cap is a soft cap: cap a positive finite constant and factor its inverse."""
    return cap > 0 and math.isfinite(cap) and math.isclose(factor * cap, 1.0, rel_tol=1e-6)


def capped_logits(n: object) -> Node | None:
    """z where `n` is ``tanh(z / cap) * cap`` (a soft cap; the tanh and its factors read by nothing
    else), else None. dmfx/inductor.py's loss_pays looks through it to the LM head."""
    t = next((a for a in getattr(n, "args", ()) if is_op(a, aten.tanh)), None) if is_op(n, aten.mul) else None
    found = _chain(t) if t is not None else None
    return found[0] if found is not None and found[3] is n and _is_cap(found[1], found[2]) else None


def match_softcap(t: Node, ctx: PassContext) -> Match | Miss | None:
    """`t` = tanh(z / cap), read only by ``* cap``, whose result reaches a loss."""
    found = _chain(t)
    if found is None or not _reaches_a_loss(found[3]):
        return None
    z, factor, cap, mul, inner = found
    if not ctx.needs_grad(z):
        return Miss("not in training: the fused op's gain is the tensor its backward does not keep", at=mul)
    if not (cap > 0 and math.isfinite(cap)):
        return Miss(f"a cap of {cap}, not a positive finite constant", at=mul)
    if not _is_cap(factor, cap):
        if is_op(z, aten.mul, aten.div) and _constant(z.args[1]) is not None and len(z.users) > 1:
            return Miss("the scaled logits inside the tanh are read elsewhere", at=mul)  # (scaled_tanh stopped there)
        return Miss(f"tanh(z * {factor:g}) * {cap:g}: the scale inside the tanh is not 1 / cap", at=mul)
    zm, om = tensor_meta(z), tensor_meta(mul)
    if not (kernel_friendly(zm) and om is not None and om.dtype == zm.dtype):
        return Miss("logits of a dtype or device dmfx's kernels do not take", at=mul)
    return Match({"z": z, "cap": float(cap), "mul": mul}, [*inner, mul], returned=(mul,))


def rewrite_softcap(graph: Graph, m: Match, ctx: PassContext) -> Replacement:
    with graph.inserting_before(m["mul"]):
        fused = insert_call(graph, ctx, torch.ops.dmfx.softcap.default, (m["z"], m["cap"]))
    return Replacement(fused, {m["mul"]: fused})


#: tanh(z / cap) * cap over a loss's logits -> dmfx::softcap.
SOFTCAP = Fusion("softcap", (aten.tanh,), match_softcap, rewrite_softcap)

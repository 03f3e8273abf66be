"""The normalizations: ``aten.native_layer_norm`` (fusion ``layer_norm``) and the decomposed LayerNorm /
RMSNorm idioms that HuggingFace models write by hand (fusion ``norm_idioms``, recorded as
``layer_norm`` / ``rms_norm``) become ``dmfx::layer_norm`` / ``dmfx::rms_norm``.

Recognised idioms (ATen level, operands of add/mul in either order, float casts anywhere):

* RMSNorm  ``w * (x * rsqrt(mean(x^2, -1, keepdim) + eps))``  (LLaMA, T5, Mistral; ``x*x`` for ``x^2``;
  ``x / sqrt(...)`` for ``x * rsqrt(...)``; the weight is optional, and may be computed, e.g. Gemma's ``1 + w``)
* LayerNorm ``w * ((x - mean(x)) * rsqrt(var + eps)) + b`` with ``var`` as ``mean((x - mean(x))^2)`` or
  ``var(x, correction=0)``, and ``/ sqrt(var + eps)`` for ``* rsqrt(var + eps)``.

Near-misses are left alone: a different normalized dim, eps outside the square root, a biased
intermediate read elsewhere (the fused op cannot provide it), a weight that is not a vector of H.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import Graph, Node

from .fusion import Fusion, Match, Miss, Replacement
from .graph_utils import (
    PassContext,
    aten,
    commuted,
    getitem_users,
    insert_call,
    insert_getitems,
    is_last_dim,
    is_op,
    is_scalar,
    kernel_friendly,
    same_shape,
    strip_casts,
    tensor_meta,
)

# ----------------------------------------------------------------------------------- native_layer_norm


def match_native_layer_norm(n: Node, ctx: PassContext) -> Match | Miss:
    """aten.native_layer_norm over the last dim, whose mean and rstd nothing reads."""
    x, shape, weight, bias, eps = n.args
    xm = tensor_meta(x)
    if xm is None or not kernel_friendly(xm):
        return Miss("unsupported dtype or device")
    # under dynamic shapes the size is a SymInt node: compare its value
    size = shape[0].meta.get("val") if len(shape) == 1 and isinstance(shape[0], torch.fx.Node) else (shape[0] if len(shape) == 1 else None)
    if len(shape) != 1 or xm.dim() == 0 or size is None or size != xm.shape[-1]:
        return Miss(f"normalizes {len(shape)} dims (sizes {list(shape)}); dmfx normalizes the last one only")
    if any(p is not None and tensor_meta(p) is not None and tensor_meta(p).dtype != xm.dtype for p in (weight, bias)):
        return Miss("weight/bias dtype differs from the input's")
    items = getitem_users(n)
    if set(items) - {0}:
        return Miss("mean/rstd are read in the graph")
    outs = tuple(items.get(0, []))
    return Match({"x": x, "weight": weight, "bias": bias, "eps": float(eps)}, [n, *outs], returned=outs)


def rewrite_native_layer_norm(graph: Graph, m: Match, ctx: PassContext) -> Replacement:
    with graph.inserting_before(m.absorbed[0]):
        fused = insert_call(graph, ctx, torch.ops.dmfx.layer_norm.default, (m["x"], m["weight"], m["bias"], m["eps"]))
        out = insert_getitems(graph, fused, 1)[0]
    return Replacement(fused, {g: out for g in m.returned})


#: aten.native_layer_norm over the last dim -> dmfx::layer_norm.
LAYER_NORM = Fusion("layer_norm", (aten.native_layer_norm,), match_native_layer_norm, rewrite_native_layer_norm)


# ----------------------------------------------------------------------------------- decomposed idioms


@dataclass
class NormMatch:
    x: Node  # the normalized input (as the graph gives it, before any float cast)
    eps: float
    rms: bool
    normalized: Node  # the node computing (x - mean) * rstd  (or x * rstd)
    internal: list[Node]  # every node the fused op replaces, up to `normalized`


def _mean_last(n, ndim_of) -> Node | None:
    """`n` is mean(y, [-1], keepdim=True): return y."""
    if not is_op(n, aten.mean) or len(n.args) < 2:
        return None
    y = n.args[0]
    keep = n.args[2] if len(n.args) > 2 else n.kwargs.get("keepdim", False)
    m = tensor_meta(y)
    if m is None or not keep or not is_last_dim(n.args[1], m.dim()):
        return None
    return y


def _square_of(n) -> Node | None:
    if is_op(n, aten.pow) and len(n.args) == 2 and n.args[1] == 2:
        return n.args[0]
    if is_op(n, aten.mul) and len(n.args) == 2 and n.args[0] is n.args[1]:
        return n.args[0]
    return None


def _eps_add(n) -> tuple[Node, float] | None:
    """`n` is var + eps (eps a python scalar): return (var, eps)."""
    for a, b in commuted(n, aten.add):
        if isinstance(a, Node) and is_scalar(b):
            return a, float(b)
    return None


def _rstd_of(n: Node) -> tuple[Node, float, list[Node]] | None:
    """`n` is rsqrt(var + eps): return (var, eps, nodes)."""
    if not is_op(n, aten.rsqrt):
        return None
    hit = _eps_add(n.args[0])
    if hit is None:
        return None
    return hit[0], hit[1], [n, n.args[0]]


def _match_variance(var: Node) -> tuple[Node, bool, list[Node]] | None:
    """`var` is the per-row second moment: return (x, rms, nodes).

    RMS:  mean(x^2).  LN: mean((x - mean(x))^2) or var(x, correction=0)."""
    ndim = None
    sq = _mean_last(var, ndim)
    if sq is not None:
        base = _square_of(sq)
        if base is None:
            return None
        if is_op(base, aten.sub) and len(base.args) == 2 and _mean_last(base.args[1], ndim) is base.args[0]:
            return base.args[0], False, [var, sq, base, base.args[1]]
        return base, True, [var, sq]
    if is_op(var, aten.var) and len(var.args) >= 1:
        m = tensor_meta(var.args[0])
        dims = var.args[1] if len(var.args) > 1 else var.kwargs.get("dim")
        corr = var.kwargs.get("correction", 1)
        keep = var.kwargs.get("keepdim", False)
        if m is not None and is_last_dim(dims, m.dim()) and corr == 0 and keep:
            return var.args[0], False, [var]
    return None


def match_norm(n: Node) -> NormMatch | None:
    """`n` computes (x - mean) * rstd or x * rstd (or the division forms): the normalized value."""
    # multiplication by rsqrt(var + eps)
    for a, b in commuted(n, aten.mul):
        hit = _rstd_of(b)
        if hit is not None:
            return _finish_match(n, a, *hit)
    # division by sqrt(var + eps)
    if is_op(n, aten.div) and len(n.args) == 2 and is_op(n.args[1], aten.sqrt):
        hit = _eps_add(n.args[1].args[0])
        if hit is not None:
            return _finish_match(n, n.args[0], hit[0], hit[1], [n.args[1], n.args[1].args[0]])
    return None


def _finish_match(normalized: Node, numer, var: Node, eps: float, rstd_nodes: list[Node]) -> NormMatch | None:
    hit = _match_variance(var)
    if hit is None:
        return None
    x, rms, var_nodes = hit
    if rms:
        # numerator must be the same x (up to float casts) that was squared
        if strip_casts(numer) is not strip_casts(x):
            return None
        src = strip_casts(x)
        internal = [normalized, *rstd_nodes, *var_nodes] + _casts_between(x, src) + _casts_between(numer, src)
        return NormMatch(src, eps, True, normalized, internal)
    # LayerNorm: numerator is x - mean(x) for the same x (may be the very node inside the variance)
    if not (is_op(numer, aten.sub) and len(numer.args) == 2):
        return None
    xs, mean = numer.args
    if _mean_last(mean, None) is not xs or strip_casts(xs) is not strip_casts(x):
        return None
    src = strip_casts(x)
    internal = [normalized, *rstd_nodes, *var_nodes, numer, mean] + _casts_between(x, src) + _casts_between(xs, src)
    return NormMatch(src, eps, False, normalized, list(dict.fromkeys(internal)))


def _casts_between(n, src) -> list[Node]:
    out = []
    while n is not src and isinstance(n, Node):
        out.append(n)
        n = n.args[0]
    return out


def _vector_of(n, H: int, dtype) -> bool:
    m = tensor_meta(n)
    return m is not None and m.dim() == 1 and m.shape[0] == H and m.dtype == dtype


def _affine(normalized: Node, H: int, dtype) -> tuple[Node, Node | None, Node | None, list[Node]]:
    """Follow `normalized` through an optional cast, `* weight` and `+ bias`. Returns
    (last node, weight, bias, nodes)."""
    end, nodes = normalized, []
    if len(end.users) == 1:
        u = next(iter(end.users))
        if is_op(u, aten._to_copy, torch.ops.prims.convert_element_type) and tensor_meta(u) is not None and tensor_meta(u).dtype == dtype:
            end, nodes = u, [u]
    weight = bias = None
    if len(end.users) == 1:
        u = next(iter(end.users))
        for a, b in commuted(u, aten.mul):
            if a is end and _vector_of(b, H, dtype):
                weight, end, nodes = b, u, nodes + [u]
                break
    if weight is not None and len(end.users) == 1:
        u = next(iter(end.users))
        for a, b in commuted(u, aten.add):
            if a is end and _vector_of(b, H, dtype):
                bias, end, nodes = b, u, nodes + [u]
                break
    return end, weight, bias, nodes


def match_norm_idiom(n: Node, ctx: PassContext) -> Match | Miss | None:
    """A decomposed LayerNorm / RMSNorm whose normalized value `n` computes (match_norm), with its
    affine tail; recorded as "layer_norm" or "rms_norm"."""
    if not n.users:
        return None
    m = match_norm(n)
    if m is None:
        return None
    pattern = "rms_norm" if m.rms else "layer_norm"
    xm = tensor_meta(m.x)
    if xm is None or not kernel_friendly(xm) or xm.dim() == 0:
        return Miss("unsupported input dtype or device", pattern=pattern)
    H, dtype = xm.shape[-1], xm.dtype
    end, weight, bias, tail = _affine(m.normalized, H, dtype)
    em = tensor_meta(end)
    if em is None or em.dtype != dtype or not same_shape(em.shape, xm.shape):
        return Miss("the result's dtype or shape differs from the input's", pattern=pattern)
    nodes = {"x": m.x, "eps": m.eps, "rms": m.rms, "weight": weight, "bias": bias, "end": end}
    return Match(nodes, m.internal + tail, returned=(end,), pattern=pattern)


def rewrite_norm_idiom(graph: Graph, m: Match, ctx: PassContext) -> Replacement:
    with graph.inserting_before(m["end"]):
        if m["rms"]:
            fused = insert_call(graph, ctx, torch.ops.dmfx.rms_norm.default, (m["x"], m["weight"], m["eps"]))
        else:
            fused = insert_call(graph, ctx, torch.ops.dmfx.layer_norm.default, (m["x"], m["weight"], m["bias"], m["eps"]))
        out = insert_getitems(graph, fused, 1)[0]
        if m["rms"] and m["bias"] is not None:
            out = insert_call(graph, ctx, aten.add.Tensor, (out, m["bias"]))
    return Replacement(fused, {m["end"]: out})


#: Decomposed LayerNorm / RMSNorm -> dmfx::layer_norm / dmfx::rms_norm (from the value it normalizes:
#: ``(x - mean) * rstd``, ``x * rstd`` or their division forms).
NORM_IDIOMS = Fusion("norm_idioms", (aten.mul, aten.div), match_norm_idiom, rewrite_norm_idiom)

"""The paper's BDRLN: bias + dropout + residual add + LayerNorm (or RMSNorm) in one kernel.

Runs after the normalization passes, so it starts from a ``dmfx::layer_norm`` / ``dmfx::rms_norm``
and walks up its input::

    h   = view(addmm(bias, a, w_t), shape)  |  add(view(mm(a, w_t)), bias)  |  any tensor (no bias)
    d   = native_dropout(h, p, train)[0]    |  h                            (eval / p = 0 / none)
    s   = add(d, residual)                  (either operand order)
    out = layer_norm(s)                     -> bias_dropout_residual_norm(mm_out, bias, residual, ...)

The bias is taken out of ``addmm`` (the GEMM then writes its result once instead of first copying the
bias into it) and added inside the fused kernel. If ``s`` has other users the fused op also returns
it (``return_sum``); any other intermediate read elsewhere leaves the chain alone.
"""

from __future__ import annotations

import operator

import torch
from torch.fx import Graph, Node

from .fusion import Fusion, Match, Miss, Replacement
from .graph_utils import (
    PassContext,
    aten,
    broadcasts_to,
    commuted,
    getitem_users,
    insert_bias_free_linear,
    insert_call,
    insert_getitems,
    insert_seed,
    is_getitem,
    is_op,
    linear_bias,
    same_shape,
    size_args,
    tensor_meta,
)

NORMS = (torch.ops.dmfx.layer_norm.default, torch.ops.dmfx.rms_norm.default)


def _dropout_of(d: Node) -> tuple[Node, float, Node] | None:
    """`d` is native_dropout(h, p, True)[0] with the mask unread: (h, p, dropout node). (torch 2.11's
    p=0 training dropout, ``clone(h)``, is gone before this pass: identity_clones.)"""
    if not (isinstance(d, Node) and d.op == "call_function" and d.target is operator.getitem and d.args[1] == 0):
        return None
    drop = d.args[0]
    if not is_op(drop, aten.native_dropout):
        return None
    h, p, train = drop.args[0], float(drop.args[1]), drop.args[2]
    if set(getitem_users(drop)) - {0}:
        return None
    if train is False:
        p = 0.0
    return h, p, drop


def _bias_of(h: Node, H: int) -> tuple[Node, Node, list[Node], tuple[Node, Node | None] | None] | None:
    """`h` is a linear layer's output with its bias: (input without the bias, bias, absorbed nodes,
    (addmm, view) when the bias is inside a GEMM that must be rebuilt without it)."""
    lin = linear_bias(h, H)  # view(addmm(bias, a, b), shape) or addmm itself (2-D activations)
    if lin is not None:
        addmm, bias, view = lin
        return addmm, bias, [addmm] + ([view] if view is not None else []), (addmm, view)
    # add(mm_out, bias) with bias a vector of H
    for a, b in commuted(h, aten.add):
        bm = tensor_meta(b)
        if bm is not None and bm.dim() == 1 and bm.shape[0] == H and isinstance(a, Node):
            return a, b, [h], None
    return None


def _broadcasts_to(small: torch.Size, full: torch.Size) -> bool:
    """`small` broadcasts to `full` over leading dims only (same last dim). With symbolic sizes: each
    leading dim of `small` is 1 or the same size as `full`'s."""
    if not small or len(small) > len(full) or small[-1] != full[-1]:
        return False
    if all(isinstance(v, int) for v in (*small, *full)):
        return broadcasts_to(small, full)
    lead = len(full) - len(small)
    return all((isinstance(a, int) and a == 1) or a is b or str(a) == str(b) for a, b in zip(small, full[lead:]))


def _fused_anchor(norm: Node, s: Node, params: tuple) -> Node | None:
    """Where the fused op goes: at the norm, or before the first other reader of the sum `s` when that
    one comes earlier in the graph (the fused op defines the sum it returns for every reader),
    provided the norm's weight and bias are defined by then; None when they are not."""
    order = {n: i for i, n in enumerate(norm.graph.nodes)}
    first = min((u for u in s.users if u is not norm), key=order.__getitem__, default=norm)
    if order[first] > order[norm]:
        return norm
    if any(isinstance(p, Node) and order[p] >= order[first] for p in params):
        return None
    return first


def match_bias_dropout_residual_norm(norm: Node, ctx: PassContext) -> Match | Miss | None:
    """The chain of the module docstring ending at the norm `norm`; each operand order of the add is
    tried, the one whose left side is a dropout or a linear layer's output first."""
    rms = norm.target is torch.ops.dmfx.rms_norm.default
    s = norm.args[0]
    sm = tensor_meta(s)
    if sm is None or not commuted(s, aten.add):
        return None
    H = sm.shape[-1]
    # the operand order whose left side is a dropout or a linear layer's output first; a plain
    # residual add (LLaMA's h + attn(h) before RMSNorm) is fused too
    orders = sorted(commuted(s, aten.add), key=lambda o: not (_dropout_of(o[0]) or _bias_of(o[0], H)))
    notes: list[str] = []
    for d, residual in orders:
        rm, dm = tensor_meta(residual), tensor_meta(d)
        if rm is None or dm is None or not same_shape(dm.shape, sm.shape) or rm.dtype != sm.dtype:
            continue
        # a residual broadcast over leading dims (BERT's position embeddings [1, S, H]) is read
        # through an expanded view (0 strides; its gradient is summed by the expand's backward)
        expand_residual = not same_shape(rm.shape, sm.shape)
        if expand_residual and not _broadcasts_to(rm.shape, sm.shape):
            continue
        # (under dynamic shapes the expand's sizes are the graph inputs that hold them)
        expand_to = size_args(norm.graph, sm.shape) if expand_residual else None
        if expand_residual and expand_to is None:
            notes.append(f"residual {residual.name} broadcasts over a symbolic size no graph input holds")
            continue
        # Under autocast the GEMM output (and its dropout) is bf16/fp16 while the residual stream
        # stays fp32, and the add promotes: cast the GEMM output (and bias) up and fuse the rest.
        upcast = dm.dtype != sm.dtype
        if upcast and not (dm.dtype in (torch.bfloat16, torch.float16) and sm.dtype == torch.float32):
            continue
        drop = _dropout_of(d)
        h, p, chain = (drop[0], drop[1], list(dict.fromkeys([d, drop[2]]))) if drop else (d, 0.0, [])
        if drop and len(d.users) != 1:
            notes.append(f"dropout output {d.name} has other users")
            continue
        bias_hit = _bias_of(h, H) if (len(h.users) == 1 or not drop) else None
        x, bias, gemm = h, None, None
        if bias_hit is not None:
            x, bias, bias_nodes, gemm = bias_hit
            chain += bias_nodes
        weight, norm_bias = norm.args[1], (None if rms else norm.args[2])
        anchor = _fused_anchor(norm, s, (weight, norm_bias))
        if anchor is None:
            return Miss(*notes, "the sum is read before the norm, whose weight or bias is computed after that read")
        # (the bias-free GEMM rebuilt from the linear has the linear's output shape: its view's, or its own)
        xm = tensor_meta(x if gemm is None else gemm[0] if gemm[1] is None else gemm[1])
        if xm is None or not same_shape(xm.shape, sm.shape):
            return Miss(*notes, "bias-free input shape differs")
        outs = tuple(u for u in norm.users if is_getitem(u, norm, 0))
        return_sum = any(u is not norm for u in s.users)
        nodes = {"x": x, "bias": bias, "gemm": gemm, "residual": residual, "expand_residual": expand_residual,
                 "expand_to": expand_to, "upcast": upcast, "p": p, "rms": rms, "weight": weight, "norm_bias": norm_bias,
                 "eps": norm.args[2] if rms else norm.args[3], "anchor": anchor, "sum": s, "outs": outs,
                 "return_sum": return_sum, "dtype": sm.dtype}
        return Match(nodes, [*chain, s, norm, *outs], returned=outs + ((s,) if return_sum else ()), notes=tuple(notes))
    return Miss(*notes) if notes else None


def rewrite_bias_dropout_residual_norm(graph: Graph, m: Match, ctx: PassContext) -> Replacement:
    x, bias, residual = m["x"], m["bias"], m["residual"]
    with graph.inserting_before(m["anchor"]):
        if m["gemm"] is not None:  # take the bias out of the GEMM
            x = insert_bias_free_linear(graph, ctx, *m["gemm"])
        if m["upcast"]:
            x = insert_call(graph, ctx, aten._to_copy.default, (x,), {"dtype": m["dtype"]})
            if bias is not None:
                bias = insert_call(graph, ctx, aten._to_copy.default, (bias,), {"dtype": m["dtype"]})
        if m["expand_residual"]:
            residual = insert_call(graph, ctx, aten.expand.default, (residual, m["expand_to"]))
        seed = insert_seed(graph, ctx) if m["p"] > 0 else None
        fused = insert_call(
            graph,
            ctx,
            torch.ops.dmfx.bias_dropout_residual_norm.default,
            (x, bias, residual, m["weight"], m["norm_bias"], seed, m["p"], m["eps"], m["rms"], m["return_sum"]),
        )
        out, total = insert_getitems(graph, fused, 2)
    return Replacement(fused, {**{g: out for g in m["outs"]}, **({m["sum"]: total} if m["return_sum"] else {})})


#: The paper's BDRLN (module docstring) -> dmfx::bias_dropout_residual_norm.
BIAS_DROPOUT_RESIDUAL_NORM = Fusion("bias_dropout_residual_norm", NORMS, match_bias_dropout_residual_norm,
                                    rewrite_bias_dropout_residual_norm)

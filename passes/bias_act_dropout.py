"""The paper's BRD: ``dropout(act(x + bias))`` after a linear layer -> ``dmfx::bias_act_dropout``.

The bias is taken out of ``addmm`` (``mm`` + the fused kernel, which reads the bias anyway; its
backward sums the bias gradient in the same pass, the paper's BDRB). act is GELU (erf or tanh), ReLU,
SiLU, tanh (BERT's pooler), QuickGELU or the squared ReLU (activation_idioms made them a bias- and
dropout-free ``dmfx::bias_act_dropout``, which this fusion rebuilds with both) or the identity
(bias + dropout). Fires when it absorbs at least two ops (an
activation alone is already one kernel; a lone dropout is the dropout fusion's); an activation the
activation_idioms fusion made counts as the ops it absorbed.
"""

from __future__ import annotations

import torch
from torch.fx import Graph, Node

from .fusion import Fusion, Match, Miss, Replacement
from .graph_utils import (
    PassContext,
    activation_name,
    aten,
    commuted,
    getitem_users,
    insert_bias_free_linear,
    insert_call,
    insert_seed,
    is_op,
    kernel_friendly,
    linear_bias,
    only_user,
    same_shape,
    tensor_meta,
)


def _vector_bias(h: Node, N: int) -> tuple[Node, Node] | None:
    """h = x + bias with bias a vector of N (either order): (x, bias)."""
    hm = tensor_meta(h)
    for x, b in commuted(h, aten.add):
        bm, xm = tensor_meta(b), tensor_meta(x)
        if bm is not None and xm is not None and bm.dim() == 1 and bm.shape[0] == N and same_shape(xm.shape, hm.shape) \
                and bm.dtype == xm.dtype:
            return x, b
    return None


def _dropout_after(n: Node) -> tuple[Node, list[Node], float] | None:
    """n's only reader is native_dropout(n, p, True) whose mask is unread: (dropout, its [0] readers, p)."""
    d = only_user(n)
    if not is_op(d, aten.native_dropout) or d.args[0] is not n:
        return None
    items = getitem_users(d)
    if set(items) - {0} or d.args[2] is False or float(d.args[1]) <= 0:
        return None
    return d, items.get(0, []), float(d.args[1])


def match_bias_act_dropout(n: Node, ctx: PassContext) -> Match | Miss | None:
    """From an activation `n` (then its dropout, if any, follows it) or a dropout `n` (the identity):
    the bias before it, in a linear layer's addmm or as a vector add."""
    act = activation_name(n)
    if act is not None:
        h, end, chain = n.args[0], n, [n]
    elif is_op(n, aten.native_dropout):
        act, h, end, chain = "identity", n.args[0], None, []
    else:
        return None
    hm = tensor_meta(h)
    if not kernel_friendly(hm) or hm.dim() < 1 or not isinstance(h, Node):
        return None
    N = hm.shape[-1]
    drop = _dropout_after(end) if end is not None else None
    if end is None:  # anchored on the dropout itself
        items = getitem_users(n)
        if set(items) - {0} or n.args[2] is False or float(n.args[1]) <= 0:
            return None
        drop = (n, items.get(0, []), float(n.args[1]))
    x, bias, gemm = h, None, None
    lin = linear_bias(h, N) if len(h.users) == 1 else None
    if lin is not None:
        addmm, bias, view = lin
        gemm = (addmm, view)
        chain += [addmm] + ([view] if view is not None else [])
    else:
        vb = _vector_bias(h, N) if len(h.users) == 1 else None
        if vb is not None:
            x, bias = vb
            chain.append(h)
    if drop:
        chain += [drop[0], *drop[1]]
    if bias is None and (act == "identity" or not drop):
        return None  # a lone activation is one kernel already; a lone dropout is the dropout pass's
    # (the bias-free GEMM rebuilt from the linear has the linear's output shape and dtype)
    xm = tensor_meta(x if gemm is None else gemm[0] if gemm[1] is None else gemm[1])
    if xm is None or not same_shape(xm.shape, hm.shape) or xm.dtype != hm.dtype:
        return Miss("the bias-free input has another shape or dtype")
    returned = tuple(drop[1]) if drop else (end,)
    nodes = {"x": x, "bias": bias, "gemm": gemm, "act": act, "p": drop[2] if drop else 0.0,
             "anchor": drop[0] if drop else end}
    return Match(nodes, chain, returned=returned)


def rewrite_bias_act_dropout(graph: Graph, m: Match, ctx: PassContext) -> Replacement:
    x = m["x"]
    with graph.inserting_before(m["anchor"]):
        if m["gemm"] is not None:
            x = insert_bias_free_linear(graph, ctx, *m["gemm"])
        seed = insert_seed(graph, ctx) if m["p"] > 0 else None
        fused = insert_call(graph, ctx, torch.ops.dmfx.bias_act_dropout.default, (x, m["bias"], m["act"], seed, m["p"]))
    return Replacement(fused, {g: fused for g in m.returned})


#: dropout(act(x + bias)) -> dmfx::bias_act_dropout.
BIAS_ACT_DROPOUT = Fusion("bias_act_dropout", (aten.gelu, aten.relu, aten.silu, aten.tanh, torch.ops.dmfx.bias_act_dropout.default,
                                               aten.native_dropout),
                          match_bias_act_dropout, rewrite_bias_act_dropout)

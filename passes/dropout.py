"""Dropout on its own: any ``aten.native_dropout`` the chain fusions (bias_dropout_residual_norm,
attention_softmax, bias_act_dropout) left becomes ``dmfx::dropout``: a Philox mask regenerated in the
backward, so the bool mask eager saves for the backward is never written."""

from __future__ import annotations

import torch
from torch.fx import Graph, Node

from .fusion import Fusion, Match, Miss, Replacement
from .graph_utils import PassContext, aten, getitem_users, insert_call, insert_seed, tensor_meta


def match_dropout(n: Node, ctx: PassContext) -> Match | Miss | None:
    """A training native_dropout with p > 0 of a float tensor, whose mask nothing reads."""
    x, p, train = n.args[0], float(n.args[1]), n.args[2]
    xm = tensor_meta(x)
    if xm is None or xm.dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        return Miss("unsupported dtype")
    items = getitem_users(n)
    if set(items) - {0}:
        return Miss("its mask is read in the graph")
    if train is False or p <= 0.0:
        return None
    outs = tuple(items.get(0, []))
    return Match({"x": x, "p": p}, [n, *outs], returned=outs)


def rewrite_dropout(graph: Graph, m: Match, ctx: PassContext) -> Replacement:
    with graph.inserting_before(m.absorbed[0]):
        seed = insert_seed(graph, ctx)
        out = insert_call(graph, ctx, torch.ops.dmfx.dropout.default, (m["x"], seed, m["p"]))
    return Replacement(out, {g: out for g in m.returned})


#: Any remaining aten.native_dropout -> dmfx::dropout.
DROPOUT = Fusion("dropout", (aten.native_dropout,), match_dropout, rewrite_dropout)

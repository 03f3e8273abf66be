"""Dropout on its own: any ``aten.native_dropout`` the chain fusions (bias_dropout_residual_norm,
attention_softmax, bias_act_dropout) left becomes ``dmfx::dropout``: a Philox mask regenerated in the
backward, so the bool mask eager saves for the backward is never written. And the dropout that is no
dropout: ``identity_clones`` removes the copy torch 2.11 traces for a training dropout of p = 0 before
the fusions run."""

from __future__ import annotations

import logging

import torch
from torch.fx import Graph, GraphModule, Node

from .fusion import Fusion, Match, Miss, Replacement
from .graph_utils import PassContext, alias_of, aten, getitem_users, insert_call, insert_seed, is_op, storage_root, tensor_meta

log = logging.getLogger("dmfx")


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


def _mutates(n: Node) -> bool:
    schema = getattr(n.target, "_schema", None)
    return n.op == "call_function" and schema is not None and schema.is_mutable


def _reaches_output_through_views(n: Node) -> bool:
    stack, seen = [n], set()
    while stack:
        for u in stack.pop().users:
            if u.op == "output":
                return True
            if u not in seen and alias_of(u) is not None:
                seen.add(u)
                stack.append(u)
    return False


def identity_clones(gm: GraphModule, ctx: PassContext) -> None:
    """Drop ``clone(x)`` (no memory format, or ``preserve_format``) of a contiguous ``x``: a copy of a
    value nobody mutates, so the clone's readers may read ``x`` itself. torch 2.11 traces a training
    dropout of p = 0 as such a clone (``softmax -> clone -> cast``, ``linear -> clone -> + residual``),
    and as an extra node between two ops it would hide the chain from every fusion after this pass;
    this runs first, so the fusions meet the graph torch 2.14 traces.

    Kept where the copy is what makes the result right: a clone of a graph input or of a view of one
    (the input may be updated in place after the graph: dmfx's epilogue, or the user), a clone that
    is a graph output or is viewed by one (the output must not alias ``x``, nor an input through it),
    a clone where ``x`` or the clone is read by a mutating op, and a clone whose layout differs from
    ``x``'s (the copy makes a dense tensor).

    Not recorded as a fusion (like remove_metadata_asserts): it normalizes one torch version's trace,
    and a model's list of fused patterns should not change with the torch version."""
    graph, dropped = gm.graph, 0
    for c in list(graph.nodes):
        if not is_op(c, aten.clone.default) or set(c.kwargs) - {"memory_format"}:
            continue
        if c.kwargs.get("memory_format") not in (None, torch.preserve_format):
            continue
        x = c.args[0]
        if not isinstance(x, Node) or storage_root(x).op == "placeholder":
            continue
        xm, cm = tensor_meta(x), tensor_meta(c)
        if xm is None or cm is None or not xm.is_contiguous() or not cm.is_contiguous():
            continue
        if _reaches_output_through_views(c) or any(_mutates(u) for u in (*c.users, *x.users)):
            continue
        c.replace_all_uses_with(x)
        graph.erase_node(c)
        dropped += 1
    if dropped:
        log.debug("dmfx: identity_clones dropped %d copies of values nobody mutates", dropped)

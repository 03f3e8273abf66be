"""``unstack_dx``: the dX GEMM of stacked Q/K/V projections (passes/qkv_attention.py) reads the three
weights where they are (three accumulating GEMMs over the gradient's column blocks) instead of a
stacked copy."""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import GraphModule, Node

from ..fusion import record
from ..graph_utils import PassContext, aten, dead_code_elimination, insert_call, is_op, val


def _stacked_row_blocks(b: Node) -> list[Any] | None:
    """When `b` is the stacked Q/K/V weight as QKV stacking builds it (``cat(ws, 0)`` of [out, in]
    parameters, or ``cat(ws, 1)`` of [in, out] ones, through any number of ``t``), the operands whose
    row blocks make up `b`, as (weight, transposed) pairs; else None. Only when this GEMM is the
    concatenation's one reader (through the transposes), so that splitting the GEMM removes it."""
    flips = 0
    while is_op(b, aten.t.default):
        if len(b.users) != 1:
            return None
        b, flips = b.args[0], flips + 1
    if len(b.users) != 1:
        return None
    if not is_op(b, aten.cat.default) or len(b.args[0]) < 2:
        return None
    dim = b.args[1] if len(b.args) > 1 else 0
    vals = [val(w) for w in b.args[0]]
    if any(not isinstance(v, torch.Tensor) or v.dim() != 2 for v in vals):
        return None
    if dim % 2 == 0 and flips % 2 == 0:
        return [(w, False) for w in b.args[0]]  # rows of cat(ws, 0) are the ws' rows
    if dim % 2 == 1 and flips % 2 == 1:
        return [(w, True) for w in b.args[0]]  # cat(ws, 1)ᵀ: rows are the wsᵀ' rows
    return None


def unstack_dx(gm: GraphModule, ctx: PassContext) -> None:
    """The dX GEMM of stacked Q/K/V projections, ``G · cat(Wq, Wk, Wv)`` (or its accumulating
    ``addmm_``), becomes three accumulating GEMMs over G's column blocks and the parameters
    themselves, ``Σ G[:, i] · W_i``: the same flops, but the backward needs no stacked copy of the
    weights, neither kept from the forward (7 MB a layer at BERT-base sizes, for the whole step) nor
    concatenated again (the forward's QKV stacking tags its concatenation for recomputation)."""
    g = gm.graph
    for n in list(g.nodes):
        if is_op(n, aten.mm.default):
            acc, a, b = None, *n.args[:2]
        elif is_op(n, aten.addmm_.default) and not n.kwargs:
            acc, a, b = n.args[:3]
        else:
            continue
        blocks = _stacked_row_blocks(b)
        av = val(a)
        if blocks is None or not isinstance(av, torch.Tensor) or av.dim() != 2:
            continue
        sizes = [val(w).shape[1 if t else 0] for w, t in blocks]
        if not all(isinstance(k, int) for k in sizes) or sum(sizes) != av.shape[1]:
            continue
        with g.inserting_before(n):
            out, start = acc, 0
            for (w, transposed), k in zip(blocks, sizes):
                part = insert_call(g, ctx, aten.slice.Tensor, (a, 1, start, start + k))
                wi = insert_call(g, ctx, aten.t.default, (w,)) if transposed else w
                out = (insert_call(g, ctx, aten.mm.default, (part, wi)) if out is None
                       else insert_call(g, ctx, aten.addmm_.default, (out, part, wi)))
                start += k
        n.replace_all_uses_with(out)
        # a restructuring, nothing is absorbed: the GEMM's flops stay, and the last of its three GEMMs
        # computes what it computed (an accumulated gradient add, accumulate_into_gemm's, included)
        out.meta.update({k: n.meta[k] for k in ("dmfx_absorbed", "dmfx_fusion") if k in n.meta})
        record(ctx, "unstack_dx", ())
        g.erase_node(n)
    dead_code_elimination(gm)

"""``fold_bias_grads``: bias gradients computed by the fused backward kernel that has the gradient in
cache, instead of a reduction reading it again.

``sum(dqkv over rows)`` after ``qkv_flash_attention_backward`` (and each of dq, dk, dv's row sums after
``flash_attention_backward``, for three separate projections) -> the op's own bias-gradient outputs
(``bias_grad=True``): the projections' bias gradients summed per (batch, head) while the attention
backward has dq, dk, dv in cache (the paper's BAIB). Likewise ``sum(dx over rows)`` after
``norm_backward`` -> its dbias output.
"""

from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node

from ..fusion import record
from ..graph_utils import PassContext, aten, insert_call, is_op, refresh_val, val
from .aten_backward import row_sum_of, sum_over_rows


def fold_bias_grads(gm: GraphModule, ctx: PassContext) -> None:
    fold_stacked_bias_grads(gm, ctx)
    fold_head_bias_grads(gm, ctx)
    fold_norm_bias_grads(gm, ctx)


def _row_sum_of_first_output(n: Node) -> Node | None:
    """The bias-gradient ``sum`` (row_sum_of) of `n`'s output 0, when one getitem reads that output
    and the sum's shape is static (a symbolic feature count would need its SymInt from the graph)."""
    first = [u for u in n.users if u.target is operator.getitem and u.args[1] == 0]
    if len(first) != 1:
        return None
    found = row_sum_of(first[0])
    if found is None or not all(isinstance(d, int) for d in val(found).shape):
        return None
    return found


def fold_norm_bias_grads(gm: GraphModule, ctx: PassContext) -> None:
    """``sum(dx over rows)`` after ``norm_backward`` (the bias gradient of the linear before the norm,
    where the bias stayed in the GEMM: the forward's BDRLN did not fire) -> the op's own dbias output
    (output_mask[4]), summed while the kernel has each row of dx in registers (the paper's BSB)."""
    op = torch.ops.dmfx.norm_backward.default
    g = gm.graph
    for n in list(g.nodes):
        if not is_op(n, op) or len(n.args) < 12 or list(n.args[11])[4]:
            continue
        found = _row_sum_of_first_output(n)
        if found is None:
            continue
        mask = list(n.args[11])
        mask[4] = True
        n.update_arg(11, mask)
        refresh_val(n, ctx)
        _take_bias_output(g, ctx, n, 4, found)


def fold_stacked_bias_grads(gm: GraphModule, ctx: PassContext) -> None:
    """The bias gradient of stacked Q/K/V projections, ``sum(dqkv, rows)``, comes out of the attention
    backward (``qkv_flash_attention_backward(..., bias_grad=True)``), which sums each (batch, head)'s
    dq, dk, dv while they are in cache, instead of a reduction reading the whole stacked gradient
    again (the paper's BAIB)."""
    op = torch.ops.dmfx.qkv_flash_attention_backward.default
    g = gm.graph
    for n in list(g.nodes):
        if not is_op(n, op) or n.kwargs.get("bias_grad") or len(n.args) > 9:
            continue
        found = _row_sum_of_first_output(n)
        if found is None:
            continue
        n.update_kwarg("bias_grad", True)
        refresh_val(n, ctx)
        _take_bias_output(g, ctx, n, 1, found)


def _take_bias_output(g, ctx: PassContext, n: Node, index: int, found: Node) -> None:
    """The reduction `found` becomes output `index` of the backward op `n` (which was asked for it:
    bias_grad=True, or output_mask[4]), viewed to `found`'s shape."""
    with g.inserting_after(n):
        db = insert_call(g, ctx, operator.getitem, (n, index))
    with g.inserting_before(found):
        out = insert_call(g, ctx, aten.view.default, (db, list(val(found).shape)))
    found.replace_all_uses_with(out)
    record(ctx, "fold_bias_grads", [found], into=n)
    g.erase_node(found)


def _head_bias_sum(g: Node) -> Node | None:
    """The ``sum`` that turns `g` (a [B, H, L, D] gradient of a projection's view) into that
    projection's bias gradient: ``transpose(1, 2)`` (or ``permute(0, 2, 1, 3)``), views to
    ``[..., H * D]``, then a sum over every dim but the last."""
    v = val(g)
    if not isinstance(v, torch.Tensor) or v.dim() != 4 or len(g.users) < 1:
        return None
    B, H, L, D = v.shape
    for t in g.users:
        if not (is_op(t, aten.transpose.int) and sorted(x % 4 for x in t.args[1:3]) == [1, 2]
                or is_op(t, aten.permute.default) and list(t.args[1]) == [0, 2, 1, 3]):
            continue
        stack = [t]
        while stack:
            x = stack.pop()
            for u in x.users:
                if is_op(u, aten.view.default, aten.reshape.default, aten._unsafe_view.default):
                    s = val(u).shape
                    if len(s) >= 2 and s[-1] == H * D:
                        stack.append(u)
                elif x is not t and sum_over_rows(u, tuple(val(x).shape)):
                    return u
    return None


def fold_head_bias_grads(gm: GraphModule, ctx: PassContext) -> None:
    """The same for three separate projections (``flash_attention_backward``): each of dq, dk, dv is
    transposed back to ``[B, L, H * D]`` and summed over the rows for its projection's bias."""
    op = torch.ops.dmfx.flash_attention_backward.default
    g = gm.graph
    for n in list(g.nodes):
        if not is_op(n, op) or n.kwargs.get("bias_grad") or len(n.args) > 10:
            continue
        grads = {u.args[1]: u for u in n.users if u.target is operator.getitem and u.args[1] in (0, 1, 2)}
        sums = {i: _head_bias_sum(grads[i]) for i in grads}
        sums = {i: s for i, s in sums.items() if s is not None and all(isinstance(d, int) for d in val(s).shape)}
        if not sums:
            continue
        n.update_kwarg("bias_grad", True)
        refresh_val(n, ctx)
        for i, found in sums.items():
            _take_bias_output(g, ctx, n, 3 + i, found)

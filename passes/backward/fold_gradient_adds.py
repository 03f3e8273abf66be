"""``fold_gradient_adds``: the add of a norm output's two gradients (the next residual's and the next
GEMM's dX) folded into ``dmfx::norm_backward`` as its ``grad_out2``: the kernel adds the two
gradients as it reads them, in the accumulation type, in cache (the paper's EBSB)."""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from ..fusion import record
from ..graph_utils import PassContext, aten, is_op, plain_add, same_shape_dtype


def fold_gradient_adds(gm: GraphModule, ctx: PassContext) -> None:
    """``norm_backward(add(g1, g2), ...)`` -> ``norm_backward(g1, ..., grad_out2=g2)``: the add is
    absorbed into the norm's backward kernel, which adds the two gradients as it reads them."""
    nb = torch.ops.dmfx.norm_backward.default
    for n in list(gm.graph.nodes):
        if not is_op(n, nb) or n.kwargs.get("grad_out2") is not None or len(n.args) > 12:
            continue
        g = n.args[0]
        if not isinstance(g, Node) or not is_op(g, aten.add.Tensor):
            continue
        pair = plain_add(g)
        if pair is None:
            ctx.miss("fold_gradient_adds", g, "the add broadcasts, scales or mixes dtypes")
            continue
        if len(g.users) != 1 or g in n.args[1:] or g in n.kwargs.values():
            # (the norm itself may read it again as grad_sum: ``y = norm(s); out = y + s`` gives s the
            # gradient dout through the norm and dout as it is; folding arg 0 alone leaves that read)
            ctx.miss("fold_gradient_adds", g, "the summed gradient is read elsewhere too")
            continue
        if not same_shape_dtype(g, n.args[2]):
            ctx.miss("fold_gradient_adds", g, "the gradient's shape or dtype differs from the norm's input")
            continue
        a, b = pair
        n.update_arg(0, a)
        n.update_kwarg("grad_out2", b)
        record(ctx, "fold_gradient_adds", [g], into=n)
        gm.graph.erase_node(g)

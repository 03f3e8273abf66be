"""``fold_logits_grad``: the add of the logits' own gradient to the loss's, folded into
``dmfx::cross_entropy_backward`` as its ``grad_logits``.

HF models return the logits next to the loss, so AOTAutograd hands the backward a tangent for them
(zeros, materialized, when the user only differentiates the loss) and adds it to the loss's gradient:
``add(tangent, view(cross_entropy_backward(...)))``, one more pass over ``[tokens, vocab]`` reading two
tensors and writing a third. The kernel adds it as it writes dlogits instead (the README's
"materialized zero gradient" pitfall, paid once instead of twice)."""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from ..fusion import record
from ..graph_utils import RESHAPES, PassContext, aten, insert_call, is_op, only_user, plain_add, size_args, tensor_meta


def _add_of(grad: Node) -> tuple[Node, Node | None, list[Node]] | None:
    """The add that is the only reader of `grad` (directly or through a chain of views, each the only
    reader of the one before: unpad's packed logits reach it through two), the view it reads, and
    the chain."""
    chain: list[Node] = []
    reader = only_user(grad)
    while is_op(reader, *RESHAPES):
        chain.append(reader)
        reader = only_user(reader)
    view = chain[-1] if chain else None
    return (reader, view, chain) if is_op(reader, aten.add.Tensor) else None


def fold_logits_grad(gm: GraphModule, ctx: PassContext) -> None:
    """``add(g, view(cross_entropy_backward(...)))`` -> ``view(cross_entropy_backward(..., grad_logits=g
    viewed as the logits))``: the kernel adds the logits' own gradient as it writes theirs."""
    ceb = torch.ops.dmfx.cross_entropy_backward.default
    graph = gm.graph
    for n in list(graph.nodes):
        if not is_op(n, ceb) or n.kwargs.get("grad_logits") is not None or len(n.args) > 7:
            continue
        found = _add_of(n)
        if found is None:
            continue
        add, view, chain = found
        pair = plain_add(add)
        if pair is None:
            ctx.miss("fold_logits_grad", add, "the add broadcasts, scales or mixes dtypes")
            continue
        mine = view if view is not None else n
        other = pair[1] if pair[0] is mine else pair[0]
        V = size_args(graph, tensor_meta(n).shape[1:])
        if other is mine or V is None:
            ctx.miss("fold_logits_grad", add, "the gradient is added to itself, or the vocabulary size is not an input")
            continue
        with graph.inserting_before(add):
            grad_logits = insert_call(graph, ctx, aten.reshape.default, (other, [-1, *V])) if view is not None else other
            fused = insert_call(graph, ctx, ceb, n.args, {"grad_logits": grad_logits})
            fused.meta.update({k: v for k, v in n.meta.items() if k != "val"})
            out = insert_call(graph, ctx, view.target, (fused, view.args[1])) if view is not None else fused
        add.replace_all_uses_with(out)
        record(ctx, "fold_logits_grad", [add], into=fused)
        for dead in (add, *reversed(chain), n):
            graph.erase_node(dead)

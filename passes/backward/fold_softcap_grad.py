"""``fold_softcap_grad``: the soft cap's backward folded into the loss's, ``softcap_backward(view(
cross_entropy_backward(..., logits=c)), out=c, cap)`` -> ``view(cross_entropy_backward(..., softcap=cap))``.

Gemma 2's loss reads soft-capped logits (passes/softcap.py: ``c = dmfx::softcap(z, cap)``), so the
backward derived from the two ops writes the capped logits' gradient (``cross_entropy_backward``, the
returned logits' own gradient folded in by fold_logits_grad), then ``softcap_backward`` reads it and c
and writes z's: three passes over ``[tokens, vocab]`` and a fresh buffer of that size (whose first
touch, page faults, cost as much as a pass on the CPU: bench/RESULTS.md). The loss kernel multiplies
by the cap's derivative, ``1 - (c / cap)^2``, as it writes instead, from the c it reads anyway.

Only where the loss's logits are the soft cap's output: the same node seen through views, or two saved
tensors (the backward's inputs) whose values share one storage at one offset, both contiguous. Nothing
else reads the loss gradient on its way to the cap's backward."""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.multiprocessing.reductions import StorageWeakRef

from ..fusion import record
from ..graph_utils import RESHAPES, PassContext, aten, insert_call, is_op, only_user, size_args, tensor_meta


def _base(n: object) -> object:
    while is_op(n, *RESHAPES):
        n = n.args[0]
    return n


def _same_tensor(a: Node, b: Node) -> bool:
    """a and b hold the same elements in the same (row-major) order: one node seen through views, or
    saved tensors whose fake values are one contiguous storage at one offset."""
    if _base(a) is _base(b):
        return True
    va, vb = tensor_meta(a), tensor_meta(b)
    if va is None or vb is None or va.dtype != vb.dtype:
        return False
    try:
        same_storage = StorageWeakRef(va.untyped_storage()) == StorageWeakRef(vb.untyped_storage())
    except (NotImplementedError, RuntimeError):  # (a value without a storage)
        return False
    return (same_storage and statically_known_true(va.storage_offset() == vb.storage_offset())
            and va.is_contiguous() and vb.is_contiguous() and statically_known_true(va.numel() == vb.numel()))


def fold_softcap_grad(gm: GraphModule, ctx: PassContext) -> None:
    """``softcap_backward(view(cross_entropy_backward(...)), out, cap)``, the loss's logits being `out`
    -> ``view(cross_entropy_backward(..., softcap=cap))``."""
    ceb = torch.ops.dmfx.cross_entropy_backward.default
    graph = gm.graph
    for sb in list(graph.find_nodes(op="call_function", target=torch.ops.dmfx.softcap_backward.default)):
        grad, out, cap = sb.args
        chain, n = [], grad
        while is_op(n, *RESHAPES) and only_user(n) is not None:
            chain.append(n)
            n = n.args[0]
        if not is_op(n, ceb) or only_user(n) is None or n.kwargs.get("softcap", 0.0) or len(n.args) > 8:
            continue
        if not _same_tensor(n.args[1], out):
            ctx.miss("fold_softcap_grad", sb, "the loss's logits are not the soft cap's output")
            continue
        shape = size_args(graph, tensor_meta(sb).shape)
        if shape is None:
            ctx.miss("fold_softcap_grad", sb, "the gradient's size is not an input of the graph")
            continue
        with graph.inserting_before(sb):
            fused = insert_call(graph, ctx, ceb, n.args, {**n.kwargs, "softcap": float(cap)})
            fused.meta.update({k: v for k, v in n.meta.items() if k != "val"})
            new = insert_call(graph, ctx, aten.reshape.default, (fused, shape))
        sb.replace_all_uses_with(new)
        record(ctx, "fold_softcap_grad", [sb], into=fused)
        for dead in (sb, *chain, n):
            graph.erase_node(dead)

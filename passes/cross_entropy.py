"""The loss of a classifier or a language model: ``nll_loss_forward(_log_softmax(z, 1), target)``, which
is ``F.cross_entropy`` as ATen writes it, becomes ``dmfx::cross_entropy``: the logits are read once
(each row's log-sum-exp accumulated online) and only the rows' ``(max, log-sum)`` pairs are saved for
the backward, instead of the ``[tokens, vocab]`` log-probabilities that eager writes, saves and reads
again (cuda_ops/cross_entropy.py).

Matched as HF's loss functions build it: ``ForCausalLMLoss`` (``logits.float()``, labels shifted by a
pad, ``view(-1, V)``, ``ignore_index=-100``, mean, or sum divided by ``num_items_in_batch``: the
division stays), ``ForMaskedLMLoss``, sequence classification. The upcast of fp16 / bf16 logits to
float32 in front (``_to_copy``, or ``_log_softmax``'s ``half_to_float``) is absorbed: the kernel reads
the low-precision logits and accumulates in float32, and its loss is float32, as the upcast's is. A
loss of low-precision logits without the upcast gets its dtype back by a cast of the (float32) loss.

Near-misses, left alone with the reason: a class weight (``weight=``), log_softmax over a dim that is
not the class dim, logits that are not ``[N, V]`` (one sample: 1-D), log-probabilities read elsewhere
(the fused op never writes them), nll_loss's total weight read elsewhere, targets that are not int64.
Label smoothing, which ATen spells as a second chain over the log-probabilities, is not matched (the
op has it: ``dmfx.cross_entropy(..., label_smoothing=)``). In training the add of the logits' own
gradient to the loss's is folded into the backward kernel by passes/backward/fold_logits_grad.py.
"""

from __future__ import annotations

import torch
from torch.fx import Graph, Node

from .fusion import Fusion, Match, Miss, Replacement
from .graph_utils import RESHAPES, PassContext, aten, getitem_users, insert_call, insert_getitems, is_op, kernel_friendly, tensor_meta

_LOW = (torch.float16, torch.bfloat16)


def _upcast_of(n: Node) -> Node | None:
    """The fp16 / bf16 tensor `n` upcasts to float32 (``_to_copy`` / ``convert_element_type`` changing the
    dtype only), read by nothing else; None otherwise."""
    if not is_op(n, aten._to_copy, torch.ops.prims.convert_element_type) or len(n.users) != 1:
        return None
    if is_op(n, aten._to_copy) and set(n.kwargs) - {"dtype"}:
        return None
    src, out = tensor_meta(n.args[0]), tensor_meta(n)
    if src is None or out is None or src.dtype not in _LOW or out.dtype != torch.float32:
        return None
    return n.args[0]


def _logits(z: Node) -> tuple[Node, list | None]:
    """What the fused op reads for log_softmax's input `z`: (the tensor, and the shape to view it as, or
    None to read it as it is). HF's ``view(logits.float(), [-1, V])`` (or ``logits.float()`` of 2-D
    logits) reads the low-precision logits themselves, viewed the same way."""
    if is_op(z, *RESHAPES) and len(z.users) == 1:
        low = _upcast_of(z.args[0])
        if low is not None:
            return low, list(z.args[1])
    low = _upcast_of(z)
    return (low, None) if low is not None else (z, None)


def match_cross_entropy(nll: Node, ctx: PassContext) -> Match | Miss | None:
    """`nll` is nll_loss_forward of a log_softmax over the classes of [N, V] logits, unweighted."""
    lsm, target, weight, reduction, ignore_index = nll.args[:5]
    if not is_op(lsm, aten._log_softmax):
        return None
    z, dim, half_to_float = lsm.args[:3]
    zm, tm = tensor_meta(z), tensor_meta(target)
    if weight is not None:
        return Miss("a class weight (weight=): the fused op has none")
    if zm is None or zm.dim() != 2:
        return Miss(f"logits of {zm.dim() if zm is not None else 'unknown'} dims, not [N, V]")
    if dim not in (1, -1):
        return Miss(f"log_softmax over dim {dim}, not the class dim")
    if not kernel_friendly(zm) or tm is None or tm.dtype != torch.int64:
        return Miss("unsupported logits dtype or device, or targets that are not int64")
    if len(lsm.users) != 1:
        return Miss("the log-probabilities are read elsewhere (the fused op never writes them)")
    items = getitem_users(nll)
    if set(items) - {0}:
        return Miss("nll_loss's total weight is read elsewhere")
    outs = tuple(items.get(0, []))
    logits, shape = (z, None) if half_to_float else _logits(z)
    nodes = {"logits": logits, "shape": shape, "target": target, "ignore_index": int(ignore_index),
             "reduction": int(reduction), "loss_dtype": tensor_meta(lsm).dtype, "nll": nll}
    return Match(nodes, [nll, *outs, lsm], returned=outs)


def rewrite_cross_entropy(graph: Graph, m: Match, ctx: PassContext) -> Replacement:
    with graph.inserting_before(m["nll"]):
        logits = m["logits"]
        if m["shape"] is not None:
            logits = insert_call(graph, ctx, aten.reshape.default, (logits, m["shape"]))
        fused = insert_call(graph, ctx, torch.ops.dmfx.cross_entropy.default,
                            (logits, m["target"], m["ignore_index"], 0.0, m["reduction"]))
        loss = insert_getitems(graph, fused, 1)[0]
        if tensor_meta(loss).dtype != m["loss_dtype"]:  # low-precision logits without the upcast
            loss = insert_call(graph, ctx, aten._to_copy.default, (loss,), {"dtype": m["loss_dtype"]})
    return Replacement(fused, {g: loss for g in m.returned})


#: nll_loss_forward(_log_softmax(logits, 1), target) (with HF's upcast) -> dmfx::cross_entropy.
CROSS_ENTROPY = Fusion("cross_entropy", (aten.nll_loss_forward,), match_cross_entropy, rewrite_cross_entropy)

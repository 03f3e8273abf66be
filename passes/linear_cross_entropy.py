"""The LM head (or classifier) GEMM and the loss it feeds, ``cross_entropy(mm(hidden, weight.t()))``,
become ``dmfx::linear_cross_entropy``: the logits are computed ``chunk`` rows at a time into one
reused ``[chunk, V]`` buffer, each chunk read by the cross_entropy family's kernels while it is there,
so that the ``[tokens, vocab]`` logits never exist, forward or backward (cuda_ops/cross_entropy.py; as
Liger-Kernel's fused linear cross-entropy).

Anchor: a ``dmfx::cross_entropy`` the cross_entropy pass made (so HF's loss functions, their upcast of
fp16 / bf16 logits included, are matched as that pass matches them). Its logits, through views
(``view``, ``_unsafe_view``, ``reshape``) and an upcast to float32 read by nothing else, must be
``mm(x, t(W))`` or ``addmm(b, x, t(W))`` (``F.linear``, the hidden states of any shape viewed as
``[N, H]``), with the same rows: then the op reads x, W and b instead, and the GEMM, the views and the
loss are absorbed.

**Only where nothing else reads the logits**: not a graph output, no other reader, so that ``[N, V]``
need never exist. HF's ``*ForCausalLM`` models return their logits next to the loss, so there it is a
near-miss with that reason; it fires on code that computes the loss from the hidden states (a module
returning ``F.cross_entropy(self.lm_head(h).view(-1, V), labels.view(-1))``), on classifiers whose
logits are not returned, and on any graph where the logits are dead outside the loss.

Near-misses, left alone with the reason: the logits (or a view or upcast of them) read elsewhere, or a
graph output; logits of a batched GEMM (``bmm``) or read through a slice or a copy; a weight that is not
a ``[V, H]`` matrix read transposed (F.linear's convention) or without a unit stride along H; hidden
states without a unit stride along H; a bias that is not a ``[V]`` vector, or an addmm that scales.
(A class weight, and label smoothing, are near-misses of the cross_entropy pass: it makes no anchor.)

Training: with a reduced loss (mean, sum) the op computes the gradients of the inputs that need one
in the forward, chunk by chunk (``grads``: 3 GEMMs over the logits in all instead of 4, measured in
bench/RESULTS.md), and its backward scales them; with reduction none (a gradient per row, known only
in the backward) the backward recomputes the logits chunk by chunk. The rows per chunk are
``default_chunk(N, V)``, fixed when the graph is compiled (by V alone where N is dynamic).
"""

from __future__ import annotations

import torch
from torch.fx import Graph, Node

from ..cuda_ops.cross_entropy import REDUCTIONS, default_chunk
from .fusion import Fusion, Match, Miss, Replacement
from .graph_utils import (
    RESHAPES,
    PassContext,
    aten,
    concrete_int,
    getitem_users,
    insert_call,
    insert_getitems,
    is_op,
    kernel_friendly,
    same_size,
    tensor_meta,
)

_LOW = (torch.float16, torch.bfloat16)
_TRANSPOSES = (aten.t, aten.transpose, aten.permute)


def _upcast(n: Node) -> bool:
    """`n` is a float16 / bfloat16 -> float32 conversion that changes nothing else."""
    if not is_op(n, aten._to_copy, torch.ops.prims.convert_element_type):
        return False
    if is_op(n, aten._to_copy) and set(n.kwargs) - {"dtype"}:
        return False
    src, out = tensor_meta(n.args[0]), tensor_meta(n)
    return src is not None and out is not None and src.dtype in _LOW and out.dtype == torch.float32


def _reader_elsewhere(n: Node, inside: Node) -> str | None:
    """Who reads `n` besides `inside` (a graph output, or the first other reader), or None."""
    others = [u for u in n.users if u is not inside]
    if not others:
        return None
    if any(u.op == "output" for u in others):
        return "a graph output (the model returns its logits)"
    return f"{others[0].name} ({getattr(others[0].target, '__name__', others[0].target)})"


def _weight_of(wt: Node) -> Node | None:
    """W when `wt` is W transposed (``t``, ``transpose(0, 1)``, ``permute([1, 0])``) of a 2-D W."""
    if not is_op(wt, *_TRANSPOSES):
        return None
    w = wt.args[0]
    wm = tensor_meta(w)
    if wm is None or wm.dim() != 2:
        return None
    if is_op(wt, aten.transpose) and sorted(d % 2 for d in wt.args[1:3]) != [0, 1]:
        return None
    if is_op(wt, aten.permute) and [d % 2 for d in wt.args[1]] != [1, 0]:
        return None
    return w


def _unit_h_stride(t: torch.Tensor) -> bool:
    return t.shape[1] <= 1 or t.stride(1) == 1


def _gemm_above(n: Node, depth: int = 8) -> Node | None:
    """A GEMM reached from `n` through views, slices, selects and copies (a near-miss's reason)."""
    for _ in range(depth):
        if is_op(n, aten.mm, aten.addmm, aten.bmm, aten.baddbmm):
            return n
        if not is_op(n, *RESHAPES, aten.slice, aten.select, aten.clone, aten._to_copy, aten.expand):
            return None
        n = n.args[0]
    return None


def match_linear_cross_entropy(ce: Node, ctx: PassContext) -> Match | Miss | None:
    """`ce` is dmfx::cross_entropy whose logits are, through views and an upcast, an LM head GEMM that
    nothing else reads."""
    logits, target, ignore_index, label_smoothing, reduction = ce.args[:5]
    items = getitem_users(ce)
    if set(items) - {0}:
        return Miss("the loss's log-sum-exp is read elsewhere")
    chain, z = [], logits
    while is_op(z, *RESHAPES) or _upcast(z):
        chain.append(z)
        z = z.args[0]
    if not is_op(z, aten.mm, aten.addmm):
        gemm = _gemm_above(z)
        if gemm is None:
            return None
        what = "a batched GEMM (bmm)" if is_op(gemm, aten.bmm, aten.baddbmm) else "a slice or a copy of the logits"
        return Miss(f"the loss reads {what}, not the [N, V] output of mm / addmm")
    gemm = z
    below = ce  # every node from the loss up to the GEMM is read by the one below it only
    for n in [*chain, gemm]:
        who = _reader_elsewhere(n, below)
        if who is not None:
            return Miss(f"the logits are read elsewhere, by {who}: [N, V] must exist, so the loss is fused alone")
        below = n
    if is_op(gemm, aten.addmm):
        if len(gemm.args) != 3 or gemm.kwargs:
            return Miss("the addmm scales (beta / alpha): not a linear layer")
        bias, x, wt = gemm.args
    else:
        bias, (x, wt) = None, gemm.args
    w = _weight_of(wt)
    if w is None:
        return Miss("the weight is not a [V, H] matrix read transposed (F.linear's convention)")
    xm, wm, zm = tensor_meta(x), tensor_meta(w), tensor_meta(logits)
    if xm is None or zm is None or not kernel_friendly(xm) or not kernel_friendly(wm):
        return Miss("unsupported dtype or device of the hidden states or the weight")
    N, V = zm.shape
    if not same_size(xm.shape[0], N) or not same_size(wm.shape[0], V):
        return Miss(f"the loss's logits {list(zm.shape)} are not the GEMM's rows [{xm.shape[0]}, {wm.shape[0]}]")
    if not _unit_h_stride(wm):
        return Miss("the weight has no unit stride along H")
    if not _unit_h_stride(xm):
        return Miss("the hidden states have no unit stride along H")
    if bias is not None:
        bm = tensor_meta(bias)
        if bm is None or bm.dim() != 1 or bm.shape[0] != V:
            return Miss("the bias is not a [V] vector (a broadcast or full addmm input)")
    outs = tuple(items.get(0, []))
    nodes = {"hidden": x, "weight": w, "bias": bias, "target": target, "ignore_index": int(ignore_index),
             "label_smoothing": float(label_smoothing), "reduction": int(reduction), "ce": ce}
    return Match(nodes, [ce, *outs, *chain, gemm], returned=outs)


def rewrite_linear_cross_entropy(graph: Graph, m: Match, ctx: PassContext) -> Replacement:
    x, w, bias = m["hidden"], m["weight"], m["bias"]
    N, V = tensor_meta(x).shape[0], concrete_int(tensor_meta(w).shape[0])
    # a dynamic N (another batch may be larger than the example's): the chunk by V alone
    chunk = default_chunk(N if isinstance(N, int) else None, V)
    # the gradients the backward will ask for, computed in the forward where the loss is reduced
    reduced = m["reduction"] != REDUCTIONS["none"]
    grads = [reduced and ctx.needs_grad(x), reduced and ctx.needs_grad(w),
             reduced and bias is not None and ctx.needs_grad(bias)]
    with graph.inserting_before(m["ce"]):
        fused = insert_call(graph, ctx, torch.ops.dmfx.linear_cross_entropy.default,
                            (x, w, bias, m["target"], m["ignore_index"], m["label_smoothing"], m["reduction"],
                             chunk, grads))
        loss = insert_getitems(graph, fused, 1)[0]
    return Replacement(fused, {g: loss for g in m.returned})


#: dmfx::cross_entropy(view(mm(x, t(W)))) (or addmm with a bias), the logits read by nothing else ->
#: dmfx::linear_cross_entropy.
LINEAR_CROSS_ENTROPY = Fusion("linear_cross_entropy", (torch.ops.dmfx.cross_entropy.default,),
                              match_linear_cross_entropy, rewrite_linear_cross_entropy, gemm="inside")

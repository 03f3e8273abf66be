"""The paper's QKV stacking: the ``qkv_attention`` pass, after the attention fusions (passes/attention.py).

It looks at each dmfx attention whose q, k and v are the head views
(``view(linear(x), [B, L, H, D]).transpose(1, 2)``) of three linear layers reading the same input x
with equal shapes: the paper's algebraic fusion. The three weights (and biases) are concatenated
and multiplied once, ``qkv = x @ cat(Wq, Wk, Wv)ᵀ + cat(bq, bk, bv)``, and ``dmfx::qkv_attention`` /
``dmfx::qkv_flash_attention`` read q, k and v as column blocks of qkv (GPT-2's single Conv1D split
into q, k, v feeds them directly). In training the concatenation runs every step (it is part of the
graph, so the stacked weight can never be stale after an optimizer step, and tagged for
recomputation, so it is never kept for the backward); its backward is one GEMM for the stacked dW
(whose row blocks are the three weight gradients, as views), the bias gradient from the attention
backward, and dX as three accumulating GEMMs reading the weights themselves (``unstack_dx``,
passes/backward/unstack_dx.py); the attention backward writes dq, dk and dv straight into the stacked
gradient. ``stack_qkv="auto"`` stacks only where that pays (training with tokens >= input features).
"""

from __future__ import annotations

import logging
import operator

import torch
from torch.fx import GraphModule, Node
from torch.utils.checkpoint import CheckpointPolicy

from .attention import ATTENTION_OPS
from .fusion import absorbed_ops, dying, erase, record
from .graph_utils import RESHAPES, PassContext, aten, concrete_int, insert_call, is_op, is_transpose, same_shape, same_value, tensor_meta

log = logging.getLogger("dmfx")
_PACKED = {torch.ops.dmfx.attention.default: torch.ops.dmfx.qkv_attention.default,
           torch.ops.dmfx.flash_attention.default: torch.ops.dmfx.qkv_flash_attention.default}


def _head_view_of(t: Node):
    """t = view(h, [B, L, H, D]).transpose(1, 2) (or permute(0, 2, 1, 3)) with h the [B, L, H*D] (or
    [B*L, H*D]) output of a linear layer (addmm / mm, read only there): (the linear, the view's
    [B, L, H, D] shape argument)."""
    if not (is_transpose(t, (1, 2)) or (is_op(t, aten.permute) and list(t.args[1]) == [0, 2, 1, 3])):
        return None
    v = t.args[0]
    if not is_op(v, *RESHAPES) or len(v.users) != 1 or len(v.args[1]) != 4:
        return None
    h = v.args[0]
    while is_op(h, *RESHAPES) and len(h.users) == 1:
        h = h.args[0]
    if not is_op(h, aten.addmm, aten.mm) or len(h.users) != 1:
        return None
    return h, v.args[1]


def _split_source(q4: Node, k4: Node, v4: Node) -> Node | None:
    """q4, k4, v4 = the head views (view(., [B, L, H, D]).transpose(1, 2)) of the three equal chunks of
    ``split(x, E, -1)`` with x [B, L, 3E], in order: x."""
    srcs = []
    for i, t in enumerate((q4, k4, v4)):
        if not is_transpose(t, (1, 2)):
            return None
        v = t.args[0]
        if not is_op(v, *RESHAPES) or len(v.users) != 1:
            return None
        g = v.args[0]
        if not (isinstance(g, Node) and g.target is operator.getitem and g.args[1] == i and len(g.users) == 1):
            return None
        srcs.append(g.args[0])
    split = srcs[0]
    if not all(s is split for s in srcs) or not is_op(split, aten.split, aten.split_with_sizes):
        return None
    x = split.args[0]
    xm, qm = tensor_meta(x), tensor_meta(q4)
    if xm is None or xm.dim() != 3 or split.args[2] not in (2, -1) or len(x.users) != 1:
        return None
    B, H, L, D = qm.shape
    if not isinstance(H * D, int) or xm.shape[2] != 3 * H * D or not same_shape(xm.shape[:2], (B, L)):
        return None
    sizes = split.args[1]
    if (isinstance(sizes, int) and sizes != H * D) or (not isinstance(sizes, int) and list(sizes) != [H * D] * 3):
        return None
    if any(not same_shape(tensor_meta(t).shape, (B, H, L, D)) for t in (k4, v4)):
        return None
    return x


def _linear_parts(lin: Node):
    """(input, weight operand [in, out], bias or None) of addmm(bias, x, w) / mm(x, w)."""
    if is_op(lin, aten.addmm):
        if lin.kwargs or len(lin.args) != 3:
            return None
        bias, x, w = lin.args
        bm = tensor_meta(bias)
        if bm is None or bm.dim() != 1:
            return None
        return x, w, bias
    if lin.kwargs or len(lin.args) != 2:
        return None
    x, w = lin.args
    return x, w, None


def stack_qkv(gm: GraphModule, ctx: PassContext) -> None:
    """The ``qkv_attention`` pass (module docstring). Not a Fusion: it turns a fused attention op into
    its packed variant, which stays that attention (its record stays the attention fusion's), and
    records the projections it stacks as its own."""
    if ctx.stack_qkv is False:
        return
    graph = gm.graph
    for att in list(graph.nodes):
        if not is_op(att, *ATTENTION_OPS):
            continue
        if len(att.args) > 8 and att.args[8]:  # (the packed ops have no soft cap)
            ctx.miss("qkv_attention", att, "soft-capped scores: the stacked-projection attention has no soft cap")
            continue
        q4, k4, v4, mask, scale, causal, seed, p = att.args
        packed = _split_source(q4, k4, v4)
        if packed is not None:  # GPT-2: one GEMM already, split into q, k and v
            _use_packed(graph, ctx, att, packed, tensor_meta(q4).shape[1])
            continue
        heads = [_head_view_of(t) for t in (q4, k4, v4)]
        if any(x is None for x in heads):
            if sum(x is not None for x in heads) >= 2:  # a near miss (e.g. k and v of a cache)
                ctx.miss("qkv_attention", att, "q, k and v are not all head views of linear layers read only here")
            continue
        lins = [lin for lin, _ in heads]
        parts = [_linear_parts(lin) for lin in lins]
        if any(x is None for x in parts) or not all(same_value(parts[0][0], x) for x, _, _ in parts[1:]):
            ctx.miss("qkv_attention", att, "q, k and v are not projections of the same input")
            continue
        ws = [w for _, w, _ in parts]
        biases = [b for _, _, b in parts]
        wm = [tensor_meta(w) for w in ws]
        same_shapes = all(same_shape(m.shape, wm[0].shape) and m.dtype == wm[0].dtype for m in wm)
        if not same_shapes or (None in biases and any(b is not None for b in biases)):
            ctx.miss("qkv_attention", att, "the three projections differ in shape, dtype or bias")
            continue
        qm = tensor_meta(q4)
        B, H, L, D = qm.shape
        if not isinstance(H * D, int):
            ctx.miss("qkv_attention", att, "the hidden size is dynamic")
            continue
        if not same_shape(tensor_meta(k4).shape, (B, H, L, D)) or not same_shape(tensor_meta(v4).shape, (B, H, L, D)):
            ctx.miss("qkv_attention", att, "q, k and v differ in shape (cross-attention or grouped-query)")
            continue
        x = parts[0][0]
        if ctx.stack_qkv == "auto":
            # Training: the concatenation moves 2 * 3 * in * out elements every step; one GEMM
            # instead of three runs the forward and the dW of the backward (dX reads the three
            # weights: unstack_dx), measured 1.6 ms faster at 1024 tokens before unstack_dx and a tie
            # in a whole BertLayer step since (bench/RESULTS.md). Inference: the GEMM runs no faster
            # stacked and the concatenation is pure cost.
            tokens, features = (concrete_int(s) for s in tensor_meta(x).shape[-2:]) if tensor_meta(x).dim() == 2 else (0, 1)
            if not ctx.training or tokens < features:
                why = "inference" if not ctx.training else f"{tokens} tokens < {features} input features"
                ctx.miss("qkv_attention", att, f"not worth it ({why}): the per-step weight concatenation costs more than it saves")
                continue
        w_bytes = 2 * 3 * concrete_int(wm[0].numel()) * wm[0].element_size()  # read + written
        why = ("QKV stacking: the three weights are concatenated every step (bytes: read + written); "
               "it saves two GEMM launches and the backward's two dX adds")
        log.debug("dmfx: %s at %s", why, att.name)
        size_b, size_l = heads[0][1][:2]  # [B, L, H, D] of the head view: ints or SymInt nodes
        with graph.inserting_before(att):
            if all(is_op(w, aten.t, aten.permute) and tensor_meta(w.args[0]).dim() == 2 for w in ws):
                # weights are t(W) of [out, in] parameters: stack rows (a contiguous copy) and transpose
                W = insert_call(graph, ctx, aten.cat.default, ([w.args[0] for w in ws], 0))
                w_all = insert_call(graph, ctx, aten.t.default, (W,))
            else:
                W = w_all = insert_call(graph, ctx, aten.cat.default, (ws, 1))
            ctx.copies.append({"node": W.name, "bytes": w_bytes, "why": why})
            # The backward's dX GEMM reads the stacked weight: recompute it there from the parameters
            # (alive anyway) instead of keeping a copy of all three weights for the whole step. The
            # tag survives AOTAutograd's trace of this graph and binds its min-cut partitioner.
            for n in {W, w_all}:
                n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            if biases[0] is not None:
                b_all = insert_call(graph, ctx, aten.cat.default, (biases, 0))
                lin = insert_call(graph, ctx, aten.addmm.default, (b_all, x, w_all))
            else:
                lin = insert_call(graph, ctx, aten.mm.default, (x, w_all))
            qkv = insert_call(graph, ctx, aten.view.default, (lin, [size_b, size_l, 3 * H * D]))
        _use_packed(graph, ctx, att, qkv, H)



def _use_packed(graph, ctx: PassContext, att: Node, qkv: Node, heads: int) -> None:
    """Replace the attention node `att` by its packed (qkv_) op on the stacked projection `qkv`: the
    same attention (what `att` absorbed, and its fusion's record, carry over), and the projections
    that only `att` read (the linears, or GPT-2's split, and their head views) absorbed by
    qkv_attention."""
    _, _, _, mask, scale, causal, seed, p = att.args
    with graph.inserting_before(att):
        fused = insert_call(graph, ctx, _PACKED[att.target], (qkv, heads, mask, scale, causal, seed, p))
    ctx.forms[fused.name] = ctx.forms.pop(att.name)
    att.replace_all_uses_with(fused)
    gone = dying([att])
    record(ctx, "qkv_attention", [n for n in gone if n is not att], into=fused, gemm="stacked")
    # (in graph order: the projections, then what the attention absorbed)
    fused.meta["dmfx_absorbed"] = [*absorbed_ops(fused), *absorbed_ops(att)]
    fused.meta["dmfx_fusion"] = att.meta.get("dmfx_fusion")
    erase(gone)

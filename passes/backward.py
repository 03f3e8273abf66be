"""Passes over the backward graph, after AOTAutograd has derived it from the fused ops' formulas.

The forward pipeline (passes/__init__.py) decides what the backward looks like: each dmfx op brings
its own fused backward op. What is left between those ops are the adds of the two gradients a tensor
receives when it is read twice (a layer input read by the residual and by a GEMM; a norm's output read
by the next residual and by the next GEMM): the paper's EBSB/BEI. Eager runs each add as its own
kernel, reading two [tokens, hidden] tensors and writing a third. Two folds remove them:

``fold_gradient_adds``: ``norm_backward(add(g1, g2), ...)`` -> ``norm_backward(g1, ..., grad_out2=g2)``:
    the kernel adds the two gradients as it reads them (in the accumulation type), in cache.

``accumulate_into_gemm``: ``add(g, mm(a, b))`` (through views) -> ``addmm_(g, a, b)``: the GEMM
    accumulates into the other gradient's buffer (beta=1 in BLAS) instead of writing a new one that an
    add then reads. Only when that buffer is a fresh, contiguous result of this graph (not an input)
    that nothing reads after the add, through any view (so writing into it cannot change any other
    value), of the GEMM's dtype and shape. Chains of adds (three unstacked projections) accumulate
    into one buffer.

``fold_bias_grads``: ``sum(dqkv over rows)`` after ``qkv_flash_attention_backward`` (and each of
    dq, dk, dv's row sums after ``flash_attention_backward``, for three separate projections) -> the
    op's own bias-gradient outputs (``bias_grad=True``): the projections' bias gradients summed per
    (batch, head) while the attention backward has dq, dk, dv in cache (the paper's BAIB). Likewise
    ``sum(dx over rows)`` after ``norm_backward`` -> its dbias output.

``unstack_dx``: the dX GEMM of stacked Q/K/V projections reads the three weights where they are
    (three accumulating GEMMs over the gradient's column blocks) instead of a stacked copy.

``backward_layout``: the layout search of passes/layout.py on the backward graph.

``aten_backward`` (first; passes/aten_backward.py): PyTorch's own backward ops of chains the forward
    pipeline did not rewrite (layer norm, GELU/SiLU/ReLU with their bias-gradient sum, softmax)
    become dmfx's backward kernels, which the folds above then apply to.

Each pass is ``fn(gm, ctx) -> None`` like the forward passes, and records what fired in the
PassContext. ``options={"skip": [...]}`` skips them by name.
"""

from __future__ import annotations

import operator
from typing import Any, Callable

import torch
from torch.fx import GraphModule, Node

from .aten_backward import fuse_aten_backward, row_sum_of, sum_over_rows
from .graph_utils import PassContext, dead_code_elimination, insert_call, is_op, refresh_val, reshape_fused_views, run_passes, val
from .layout import choose_backward_layouts

aten = torch.ops.aten


def _shape_dtype(n: Any) -> tuple[tuple[int, ...], torch.dtype] | None:
    v = val(n)
    if not isinstance(v, torch.Tensor):
        return None
    return tuple(v.shape), v.dtype


def _plain_add(n: Node) -> tuple[Node, Node] | None:
    """(a, b) when `n` is ``add.Tensor(a, b)`` of two graph tensors of one shape and dtype, alpha 1."""
    if not is_op(n, aten.add.Tensor) or n.kwargs.get("alpha", 1) != 1 or len(n.args) != 2:
        return None
    a, b = n.args
    if not (isinstance(a, Node) and isinstance(b, Node)):
        return None
    sa, sb, so = _shape_dtype(a), _shape_dtype(b), _shape_dtype(n)
    if sa is None or sa != sb or sa != so:
        return None
    return a, b


# ------------------------------------------------------------------------------------------------


def fold_gradient_adds(gm: GraphModule, ctx: PassContext) -> None:
    nb = torch.ops.dmfx.norm_backward.default
    for n in list(gm.graph.nodes):
        if not is_op(n, nb) or n.kwargs.get("grad_out2") is not None or len(n.args) > 12:
            continue
        g = n.args[0]
        if not isinstance(g, Node) or not is_op(g, aten.add.Tensor):
            continue
        pair = _plain_add(g)
        if pair is None:
            ctx.miss("fold_gradient_adds", g, "the add broadcasts, scales or mixes dtypes")
            continue
        if len(g.users) != 1:
            ctx.miss("fold_gradient_adds", g, "the summed gradient is read elsewhere too")
            continue
        if _shape_dtype(g) != _shape_dtype(n.args[2]):
            ctx.miss("fold_gradient_adds", g, "the gradient's shape or dtype differs from the norm's input")
            continue
        a, b = pair
        n.update_arg(0, a)
        n.update_kwarg("grad_out2", b)
        gm.graph.erase_node(g)
        ctx.record("fold_gradient_adds", 1)


# ------------------------------------------------------------------------------------------------


def _fresh_buffer(n: Node) -> bool:
    """`n`'s value owns its storage: the result of an op that returns new tensors (no alias
    annotation in its schema), or a getitem of one. Graph inputs (saved activations, tangents) and
    views are not."""
    if n.op != "call_function":
        return False
    src = n
    if n.target is operator.getitem:
        src = n.args[0]
        if not isinstance(src, Node) or src.op != "call_function":
            return False
    schema = getattr(src.target, "_schema", None)
    if schema is None or schema.is_mutable:
        return False
    return all(r.alias_info is None for r in schema.returns)


def _alias_of(n: Node) -> Node | None:
    """The tensor `n` shares storage with when `n` is a view (an op whose schema says its result
    aliases its first argument, or ``_unsafe_view``, which aliases without saying so) or an in-place
    accumulation; None otherwise."""
    if n.op != "call_function" or not n.args or not isinstance(n.args[0], Node):
        return None
    if n.target is operator.getitem:  # an element of a view op's list (split, unbind, chunk): a view
        src = n.args[0]
        return src if src.op == "call_function" and _alias_of(src) is not None else None
    if n.target in (aten._unsafe_view.default, aten.addmm_.default):
        return n.args[0]
    schema = getattr(n.target, "_schema", None)
    if schema is None or schema.is_mutable or not schema.returns:
        return None
    return n.args[0] if all(r.alias_info is not None for r in schema.returns) else None


def _root(n: Node) -> Node:
    while (src := _alias_of(n)) is not None:
        n = src
    return n


def _writable_at(acc: Node, at: Node, order: dict[Node, int]) -> bool:
    """Writing into `acc` in place at node `at` changes no value anyone reads: its storage is a fresh
    buffer of this graph (not a graph input, not an op's view of one), and every other reader of that
    storage (through any of its views) runs before `at`, and no view of it is a graph output."""
    root = _root(acc)
    if not _fresh_buffer(root):
        return False
    stack, seen = [root], {root}
    while stack:
        a = stack.pop()
        for u in a.users:
            if u is at:
                continue
            if u.op == "output":
                return False
            if _alias_of(u) is a:
                if u not in seen:
                    seen.add(u)
                    stack.append(u)
            elif order[u] > order[at]:
                return False
    return True


def _through_views(n: Node) -> Node:
    """The node before a chain of single-user view/reshape ops ending at `n` (`n` if none)."""
    while is_op(n, aten.view.default, aten.reshape.default, aten._unsafe_view.default) and len(n.users) == 1:
        src = n.args[0]
        if not isinstance(src, Node) or len(src.users) != 1:
            break
        n = src
    return n


def accumulate_into_gemm(gm: GraphModule, ctx: PassContext) -> None:
    g = gm.graph
    order = {n: i for i, n in enumerate(g.nodes)}
    for n in list(g.nodes):
        pair = _plain_add(n) if is_op(n, aten.add.Tensor) else None
        if pair is None:
            continue
        for acc, other in (pair, pair[::-1]):
            mm = _through_views(other)
            if not is_op(mm, aten.mm.default) or mm is acc or len(mm.users) != 1:
                continue
            if not _writable_at(acc, n, order):
                ctx.miss("accumulate_into_gemm", n, "the other gradient's buffer is read later, or is not this graph's own")
                continue
            if _root(acc) in {_root(x) for x in mm.args[:2] if isinstance(x, Node)}:
                # addmm_(g, g, w): BLAS with its output aliasing an operand is undefined (a residual
                # around one linear, LN(Linear(x) + x), gives the norm's dresidual as the GEMM's dY)
                ctx.miss("accumulate_into_gemm", n, "the GEMM reads the buffer it would accumulate into")
                continue
            v_acc, v_mm = val(acc), val(mm)
            if not (isinstance(v_acc, torch.Tensor) and isinstance(v_mm, torch.Tensor)):
                continue
            if v_acc.dtype != v_mm.dtype or v_acc.numel() != v_mm.numel() or not v_acc.is_contiguous():
                ctx.miss("accumulate_into_gemm", n, "the other gradient is not contiguous or differs in dtype")
                continue
            # shapes from the graph, not from the fake values (their SymInts are no graph values)
            N = v_mm.shape[1]
            if other is not mm and not (is_op(other, aten.view.default, aten.reshape.default, aten._unsafe_view.default)
                                        and other.args[0] is mm and isinstance(N, int)):
                continue
            with g.inserting_before(n):
                acc2d = acc
                if other is not mm:
                    acc2d = g.call_function(aten.view.default, (acc, [-1, N]))
                    acc2d.meta["val"] = v_acc.view(v_mm.shape)
                summed = g.call_function(aten.addmm_.default, (acc2d, *mm.args[:2]))
                summed.meta["val"] = val(acc2d)
                out = summed
                if other is not mm:
                    out = g.call_function(aten.view.default, (summed, other.args[1]))
                    out.meta["val"] = val(n)
            for k, new in enumerate((acc2d, summed, out)):
                order.setdefault(new, order[n] - 0.5 + k * 0.1)  # between n's predecessor and n
            n.replace_all_uses_with(out)
            g.erase_node(n)
            ctx.record("accumulate_into_gemm", 1)
            break
    dead_code_elimination(gm)


# ------------------------------------------------------------------------------------------------


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
    g.erase_node(found)
    ctx.record("fold_bias_grads", 1)


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
        g.erase_node(n)
        ctx.record("unstack_dx", 1)
    dead_code_elimination(gm)


BackwardPass = Callable[[GraphModule, PassContext], None]

BACKWARD_PIPELINE: dict[str, BackwardPass] = {
    "aten_backward": fuse_aten_backward,
    "fold_gradient_adds": fold_gradient_adds,
    "fold_bias_grads": fold_bias_grads,
    "accumulate_into_gemm": accumulate_into_gemm,
    "unstack_dx": unstack_dx,
    "backward_layout": choose_backward_layouts,
}


def run_backward_pipeline(gm: GraphModule, ctx: PassContext, skip: tuple[str, ...] = (),
                          verify: bool | str | None = None) -> GraphModule:
    """Run the backward passes not in `skip`, then `reshape_fused_views` (run_passes; `verify`: the
    graph verifier after each)."""
    run_passes(gm, ctx, {**BACKWARD_PIPELINE, "reshape_fused_views": reshape_fused_views}, skip, verify=verify)
    gm.graph.lint()
    gm.recompile()
    return gm

"""Backward ATen patterns, for chains whose forward dmfx did not rewrite.

Where the forward pipeline rewrote a chain, AOTAutograd derives its backward from the dmfx op's own
formula (one fused backward kernel). Where it did not (a pass skipped with ``options={"skip": ...}``,
a near-miss the forward passes left alone, a norm or activation outside the patterns), the backward
graph holds PyTorch's own backward ops. This pass (``aten_backward``, first in the backward pipeline)
replaces those with dmfx's backward kernels, so the later folds (``fold_gradient_adds``,
``fold_bias_grads``) and the layout search apply to them too:

``native_layer_norm_backward(g, x, [H], mean, rstd, w, b, mask)`` over the last dim
    -> ``dmfx::norm_backward`` (dx, dgamma, dbeta in one pass over the rows).
``gelu_backward`` (erf and tanh), ``silu_backward``, ``threshold_backward(g, relu_out, 0)``
    -> ``dmfx::bias_act_dropout_backward`` with no bias and p = 0; a ``sum`` of the result over every
    dim but the last (the gradient of the linear bias before the activation, the paper's BDRB / BAOB)
    becomes the kernel's second output, summed while the rows are in cache.
``_softmax_backward_data(g, y, -1, dtype)`` -> ``dmfx::attention_softmax_backward`` (p = 0), with a following
    multiplication or division by a constant (the attention's 1/sqrt(d)) folded into its scale.
``native_dropout_backward(g, mask, scale)`` (the mask an unrewritten forward's ``native_dropout``
    stored) -> folded into the activation or softmax backward that reads it (the kernel multiplies by
    the stored mask instead of regenerating one: the paper's BDRB and BS with a saved mask); one that
    no such backward reads becomes ``dmfx::bias_act_dropout_backward`` with the identity and the stored
    mask, with the bias-gradient ``sum`` after it folded in the same way.

Left alone, with the reason in the log at DEBUG and in the record's ``missed``: a layer norm over more
than the last dim or with statistics in another dtype than dmfx's (bf16 on the CPU: ATen keeps them in
bf16), a threshold other than 0, a softmax over another dim or with a cast (``input_dtype`` differs),
and operands of other dtypes or devices than the kernels take. ``tanh_backward`` is not matched: it
reads tanh's output, and dmfx's kernel recomputes the activation from its input.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from ...cuda_ops import stat_dtype
from ..fusion import record
from ..graph_utils import PassContext, insert_call, insert_getitems, is_op, kernel_friendly, same_shape, tensor_meta, val, views_to_reshapes

aten = torch.ops.aten
_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


def sum_over_rows(n: Node, full: tuple[int, ...]) -> bool:
    """`n` sums a tensor of shape `full` ([..., F]) over every dim but the last, in its own dtype."""
    if not is_op(n, aten.sum.dim_IntList) or n.kwargs.get("dtype") is not None:
        return False
    dims = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
    nd = len(full)
    if not isinstance(dims, (list, tuple)):
        return False
    return sorted(d % nd for d in dims) == list(range(nd - 1))


def row_sum_of(t: Node) -> Node | None:
    """A ``sum`` over every dim but the last of the contiguous tensor `t`, or of a view of it with the
    same last dim (which then holds the same columns): the bias gradient of what produced `t`."""
    F = val(t).shape[-1]
    stack = [t]
    while stack:
        x = stack.pop()
        for u in x.users:
            if is_op(u, *_VIEWS):
                stack.append(u)
            elif sum_over_rows(u, tuple(val(x).shape)) and val(x).shape[-1] == F:
                return u
    return None


# ------------------------------------------------------------------------------------------------


def _layer_norm_backward(g, ctx: PassContext, n: Node) -> None:
    grad, x, shape, mean, rstd, w, b, mask = n.args
    xv, mv, rv = tensor_meta(x), tensor_meta(mean), tensor_meta(rstd)
    if xv is None or mv is None or rv is None or not kernel_friendly(xv):
        return
    if len(shape) != 1 or xv.dim() < 1 or shape[0] != xv.shape[-1]:
        ctx.miss("aten_backward", n, "layer norm over more than the last dim")
        return
    if mv.dtype != stat_dtype(xv) or rv.dtype != stat_dtype(xv):
        ctx.miss("aten_backward", n, f"layer norm statistics in {rv.dtype}, dmfx's kernel keeps them in {stat_dtype(xv)}")
        return
    gv = tensor_meta(grad)
    if gv is None or gv.dtype != xv.dtype or not same_shape(gv.shape, xv.shape):
        ctx.miss("aten_backward", n, "the gradient's dtype or shape differs from the input's")
        return
    out_mask = [bool(mask[0]), False, bool(mask[1]) and w is not None, bool(mask[2]) and b is not None, False]
    with g.inserting_before(n):
        m1 = insert_call(g, ctx, aten.squeeze.dim, (mean, -1))
        r1 = insert_call(g, ctx, aten.squeeze.dim, (rstd, -1))
        new = insert_call(g, ctx, torch.ops.dmfx.norm_backward.default,
                          (grad, None, x, None, None, w, m1, r1, None, 0.0, False, out_mask))
        outs = insert_getitems(g, new, 5)
    record(ctx, "aten_backward", [n], into=new)
    for u in list(n.users):  # ATen's (dx, dweight, dbias) are dmfx's outputs 0, 2, 3
        u.replace_all_uses_with(outs[{0: 0, 1: 2, 2: 3}[u.args[1]]])
        g.erase_node(u)
    g.erase_node(n)


def _activation(n: Node) -> tuple[str, Node, Node] | None:
    """(dmfx activation name, grad, the tensor the activation's derivative is taken at)."""
    if is_op(n, aten.gelu_backward.default):
        approx = n.args[2] if len(n.args) > 2 else n.kwargs.get("approximate", "none")
        return ("gelu_tanh" if approx == "tanh" else "gelu"), n.args[0], n.args[1]
    if is_op(n, aten.silu_backward.default):
        return "silu", n.args[0], n.args[1]
    if is_op(n, aten.threshold_backward.default):
        # relu's backward: grad where relu's output > 0, which is where its input is > 0
        return ("relu", n.args[0], n.args[1]) if n.args[2] == 0 else None
    return None


def _dropout_parts(d: Node) -> tuple[Node, Node, float] | str:
    """(incoming gradient, mask, scale) of the ``native_dropout_backward`` `d` when dmfx's kernels can
    read its mask (bool, the gradient's shape and device; a constant scale), else why not."""
    src, mask, scale = d.args[:3]
    sv, mv = tensor_meta(src), tensor_meta(mask)
    if sv is None or mv is None or not kernel_friendly(sv) or sv.dim() < 1:
        return "a gradient the kernels do not take"
    if mv.dtype != torch.bool or not same_shape(mv.shape, sv.shape) or mv.device != sv.device:
        return "a dropout mask that is not a bool tensor of the gradient's shape and device"
    if not isinstance(scale, (int, float)):
        return "a symbolic dropout scale"
    return src, mask, float(scale)


def _stored_dropout(grad: Node, reader: Node) -> tuple[Node, Node, float] | None:
    """`grad`'s (incoming gradient, mask, scale) when it is a ``native_dropout_backward`` that only
    `reader` reads and whose mask the kernels can read; else None."""
    if not is_op(grad, aten.native_dropout_backward.default) or set(grad.users) != {reader}:
        return None
    parts = _dropout_parts(grad)
    return None if isinstance(parts, str) else parts


def _activation_backward(g, ctx: PassContext, n: Node, act: str, grad: Node, x: Node) -> None:
    gv, xv = tensor_meta(grad), tensor_meta(x)
    if gv is None or xv is None or not kernel_friendly(xv) or xv.dim() < 1:
        return
    if gv.dtype != xv.dtype or not same_shape(gv.shape, xv.shape) or gv.device != xv.device:
        ctx.miss("aten_backward", n, "the gradient's dtype, shape or device differs from the activation's input")
        return
    dropout = _stored_dropout(grad, n)
    if dropout is None:
        _bias_act_backward(g, ctx, n, act, grad, x, None, absorbed=[n])
        return
    _bias_act_backward(g, ctx, n, act, dropout[0], x, dropout[1:], absorbed=[grad, n])
    g.erase_node(grad)


def _dropout_backward(g, ctx: PassContext, n: Node) -> None:
    """A ``native_dropout_backward`` that no activation or softmax backward absorbed: the identity
    kernel with the stored mask (and the bias-gradient sum after it, when there is one)."""
    parts = _dropout_parts(n)
    if isinstance(parts, str):
        ctx.miss("aten_backward", n, parts)
        return
    src, mask, scale = parts
    # (the identity reads no x: the gradient stands in for it, for the shape)
    _bias_act_backward(g, ctx, n, "identity", src, src, (mask, scale), absorbed=[n])


def _bias_act_backward(g, ctx: PassContext, n: Node, act: str, grad: Node, x: Node,
                       stored: tuple[Node, float] | None, absorbed: list[Node]) -> None:
    """Replace `n` (an activation backward, or a dropout backward with act "identity"; `absorbed`: it
    and the stored dropout's backward it reads, if any) by ``dmfx::bias_act_dropout_backward`` reading
    the `stored` (mask, scale), with the bias-gradient ``sum`` after `n` as its second output."""
    bias_sum = row_sum_of(n)
    if bias_sum is not None and not all(isinstance(d, int) for d in val(bias_sum).shape):
        bias_sum = None  # (a symbolic feature count would need its SymInt from the graph)
    with g.inserting_before(n):
        new = insert_call(g, ctx, torch.ops.dmfx.bias_act_dropout_backward.default,
                          (grad, x, None, act, None, 0.0, [True, bias_sum is not None], *(stored or ())))
        dx, db = insert_getitems(g, new, 2)
    record(ctx, "aten_backward", [*absorbed, *([bias_sum] if bias_sum is not None else [])], into=new)
    n.replace_all_uses_with(dx)
    g.erase_node(n)
    if bias_sum is not None:
        with g.inserting_before(bias_sum):
            out = insert_call(g, ctx, aten.view.default, (db, list(val(bias_sum).shape)))
        bias_sum.replace_all_uses_with(out)
        g.erase_node(bias_sum)


def _constant_scale(n: Node) -> float | None:
    """The constant `n` multiplies its input by (``mul`` / ``div`` by a Python number), or None."""
    if len(n.args) != 2 or n.kwargs or not isinstance(n.args[1], (int, float)) or isinstance(n.args[1], bool):
        return None
    if is_op(n, aten.mul.Tensor, aten.mul.Scalar):
        return float(n.args[1])
    if is_op(n, aten.div.Tensor, aten.div.Scalar) and n.args[1] != 0:
        return 1.0 / float(n.args[1])
    return None


def _softmax_backward(g, ctx: PassContext, n: Node) -> None:
    grad, y, dim, input_dtype = n.args
    gv, yv = tensor_meta(grad), tensor_meta(y)
    if gv is None or yv is None or not kernel_friendly(yv) or yv.dim() < 1:
        return
    if dim % yv.dim() != yv.dim() - 1:
        ctx.miss("aten_backward", n, "softmax over another dim than the last")
        return
    if input_dtype != yv.dtype or gv.dtype != yv.dtype or not same_shape(gv.shape, yv.shape):
        ctx.miss("aten_backward", n, "a cast around the softmax, or a gradient of another dtype or shape")
        return
    dropout = _stored_dropout(grad, n)  # attention-probability dropout: the kernel reads its mask
    scale, target = 1.0, n
    if len(n.users) == 1:  # the attention's 1/sqrt(d): folded into the kernel's scale
        user = next(iter(n.users))
        c = _constant_scale(user) if user.args[0] is n else None
        uv = tensor_meta(user)
        if c is not None and uv is not None and uv.dtype == yv.dtype:
            scale, target = c, user
    src, stored = (dropout[0], dropout[1:]) if dropout else (grad, ())
    with g.inserting_before(n):
        new = insert_call(g, ctx, torch.ops.dmfx.attention_softmax_backward.default, (src, y, None, 0.0, scale, *stored))
    record(ctx, "aten_backward", [*([grad] if dropout else []), n, *([target] if target is not n else [])], into=new)
    target.replace_all_uses_with(new)
    if target is not n:
        g.erase_node(target)
    g.erase_node(n)
    if dropout:
        g.erase_node(grad)


def fuse_aten_backward(gm: GraphModule, ctx: PassContext) -> None:
    g = gm.graph
    before = set(g.nodes)
    for n in list(g.nodes):
        if n.op != "call_function":
            continue
        if is_op(n, aten.native_layer_norm_backward.default):
            _layer_norm_backward(g, ctx, n)
        elif is_op(n, aten._softmax_backward_data.default):
            _softmax_backward(g, ctx, n)
        elif (found := _activation(n)) is not None:
            _activation_backward(g, ctx, n, *found)
    # dropout backwards that no activation or softmax backward absorbed above
    for n in list(g.nodes):
        if n.op == "call_function" and is_op(n, aten.native_dropout_backward.default):
            _dropout_backward(g, ctx, n)
    # dmfx's gradients are contiguous where ATen's kept their input's strides (silu_backward of a
    # transposed activation): views of them become reshapes
    views_to_reshapes(n for n in g.nodes if n not in before and getattr(n.target, "namespace", None) == "dmfx")

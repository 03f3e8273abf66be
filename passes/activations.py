"""Activations: idioms to their ATen op, gated activations, and the paper's BRD (bias + activation +
dropout) after a linear layer.

* ``activation_idioms``: the tanh-GELU as GPT-2 writes it (``0.5*x*(1+tanh(sqrt(2/pi)*(x+0.044715*x^3)))``,
  8 ATen ops), the erf-GELU (``0.5*x*(1+erf(x/sqrt(2)))``) and SiLU (``x*sigmoid(x)``) become
  ``aten.gelu`` / ``aten.silu``, so the passes below see one op.
* ``glu``: ``act(gate) * up`` (SwiGLU, GeGLU) -> ``dmfx::glu`` (backward: one kernel for
  both gradients instead of act backward + two muls).
* ``bias_act_dropout``: ``dropout(act(x + bias))`` with the bias inside ``addmm`` (taken out:
  ``mm`` + the fused kernel, which reads the bias anyway; its backward sums the bias gradient in the
  same pass, the paper's BDRB) -> ``dmfx::bias_act_dropout``. Fires when it absorbs at least two
  ops (an activation alone is already one kernel); act may be the identity (bias + dropout).
"""

from __future__ import annotations

import math

import torch
from torch.fx import GraphModule, Node

from .graph_utils import (
    PassContext,
    insert_bias_free_linear,
    linear_bias,
    aten,
    commuted,
    getitem_users,
    insert_call,
    insert_getitems,
    insert_seed,
    is_op,
    is_scalar,
    kernel_friendly,
    tensor_meta,
)

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _near(x: object, value: float, rel: float = 1e-4) -> bool:
    return is_scalar(x) and abs(float(x) - value) <= rel * abs(value)


def _mul_by(n: object, value: float) -> Node | None:
    """n = a * value (either order): a."""
    for a, b in commuted(n, aten.mul):
        if isinstance(a, Node) and _near(b, value):
            return a
    return None


def _only_user(n: Node) -> Node | None:
    return next(iter(n.users)) if len(n.users) == 1 else None


def _gelu_tail(inner: Node, x: Node) -> tuple[Node, list[Node]] | None:
    """From f (tanh(...) or erf(...)) of x: 0.5 * x * (1 + f) -> (output node, its nodes)."""
    add1 = _only_user(inner)
    if add1 is None or not any(_near(b, 1.0) and a is inner for a, b in commuted(add1, aten.add)):
        return None
    out = _only_user(add1)
    if out is None:
        return None
    for a, b in commuted(out, aten.mul):
        if b is not add1:
            continue
        # (x * 0.5) * (1 + f)
        if _mul_by(a, 0.5) is x and len(a.users) == 1:
            return out, [add1, out, a]
    return None


def _tanh_gelu_of(t: Node) -> tuple[Node, Node, list[Node]] | None:
    if not is_op(t, aten.tanh):
        return None
    v = _mul_by(t.args[0], _SQRT_2_OVER_PI)
    if v is None or len(t.args[0].users) != 1 or len(v.users) != 1:
        return None
    for x, w in commuted(v, aten.add):
        cube = _mul_by(w, 0.044715)
        if cube is None or len(w.users) != 1 or len(cube.users) != 1:
            continue
        if is_op(cube, aten.pow) and cube.args[0] is x and _near(cube.args[1], 3.0):
            tail = _gelu_tail(t, x)
            if tail is not None:
                out, nodes = tail
                return x, out, [t, t.args[0], v, w, cube, *nodes]
    return None


def _erf_gelu_of(e: Node) -> tuple[Node, Node, list[Node]] | None:
    if not is_op(e, aten.erf):
        return None
    arg = e.args[0]
    x = _mul_by(arg, 1 / math.sqrt(2.0))
    if x is None and is_op(arg, aten.div) and _near(arg.args[1], math.sqrt(2.0)):
        x = arg.args[0]
    if x is None or len(arg.users) != 1:
        return None
    tail = _gelu_tail(e, x)
    if tail is None:
        return None
    out, nodes = tail
    return x, out, [e, arg, *nodes]


def fuse_activation_idioms(gm: GraphModule, ctx: PassContext) -> None:
    graph = gm.graph
    for n in list(graph.nodes):
        if n.graph is None or not n.users:
            continue
        hit, target, kwargs, name = None, None, {}, None
        if is_op(n, aten.tanh):
            hit, target, kwargs, name = _tanh_gelu_of(n), aten.gelu.default, {"approximate": "tanh"}, "gelu_tanh_idiom"
        elif is_op(n, aten.erf):
            hit, target, name = _erf_gelu_of(n), aten.gelu.default, "gelu_idiom"
        elif is_op(n, aten.sigmoid):
            m = _only_user(n)
            if m is not None and any(b is n and a is n.args[0] for a, b in commuted(m, aten.mul)):
                hit, target, name = (n.args[0], m, [n, m]), aten.silu.default, "silu_idiom"
        if not hit:
            continue
        x, out, nodes = hit
        xm = tensor_meta(x)
        if not kernel_friendly(xm):
            continue
        with graph.inserting_before(out):
            act = insert_call(graph, ctx, target, (x,), kwargs)
        out.replace_all_uses_with(act)
        ctx.record(name, len(set(nodes)), act)  # take_over() hands this count to a fusing pass


# ------------------------------------------------------------------------------------ activations


def _act_of(n: Node) -> str | None:
    """The dmfx activation name of an ATen activation node."""
    if is_op(n, aten.gelu):
        approx = n.kwargs.get("approximate", n.args[1] if len(n.args) > 1 else "none")
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(approx)
    if is_op(n, aten.relu):
        return "relu"
    if is_op(n, aten.silu):
        return "silu"
    if is_op(n, aten.tanh):
        return "tanh"
    return None


def fuse_gated_activation(gm: GraphModule, ctx: PassContext) -> None:
    graph = gm.graph
    for act in list(graph.nodes):
        name = _act_of(act) if act.graph is not None else None
        if name is None or name == "relu" or len(act.users) != 1:
            continue
        mul = _only_user(act)
        for a, up in commuted(mul, aten.mul):
            if a is not act or not isinstance(up, Node) or up is act:
                continue
            gm_, um, om = tensor_meta(act.args[0]), tensor_meta(up), tensor_meta(mul)
            if not (kernel_friendly(gm_) and um is not None and om is not None):
                continue
            if not (gm_.shape == um.shape == om.shape and gm_.dtype == um.dtype == om.dtype and gm_.device == um.device):
                ctx.miss("glu", mul, "gate and up differ in shape, dtype or device (broadcast)")
                continue
            with graph.inserting_before(mul):
                fused = insert_call(graph, ctx, torch.ops.dmfx.glu.default, (act.args[0], up, name))
            mul.replace_all_uses_with(fused)
            ctx.record("glu", 1 + ctx.take_over(act), fused)
            break


# ------------------------------------------------------------------------------------ BRD


def _vector_bias(h: Node, N: int) -> tuple[Node, Node] | None:
    """h = x + bias with bias a vector of N (either order): (x, bias)."""
    hm = tensor_meta(h)
    for x, b in commuted(h, aten.add):
        bm, xm = tensor_meta(b), tensor_meta(x)
        if bm is not None and xm is not None and bm.dim() == 1 and bm.shape[0] == N and xm.shape == hm.shape and bm.dtype == xm.dtype:
            return x, b
    return None


def _dropout_after(n: Node) -> tuple[Node, list[Node], float] | None:
    """n's only reader is native_dropout(n, p, True) whose mask is unread: (dropout, its [0] readers, p)."""
    d = _only_user(n)
    if not is_op(d, aten.native_dropout) or d.args[0] is not n:
        return None
    items = getitem_users(d)
    if set(items) - {0} or d.args[2] is False or float(d.args[1]) <= 0:
        return None
    return d, items.get(0, []), float(d.args[1])


def fuse_bias_activation_dropout(gm: GraphModule, ctx: PassContext) -> None:
    graph = gm.graph
    for n in list(graph.nodes):
        if n.graph is None:
            continue
        act = _act_of(n)
        if act is not None:
            h, end, absorbed = n.args[0], n, [n]
        elif is_op(n, aten.native_dropout):
            act, h, end, absorbed = "identity", n.args[0], None, []
        else:
            continue
        hm = tensor_meta(h)
        if not kernel_friendly(hm) or hm.dim() < 1 or not isinstance(h, Node):
            continue
        N = hm.shape[-1]
        drop = _dropout_after(end) if end is not None else None
        if end is None:  # anchored on the dropout itself
            items = getitem_users(n)
            if set(items) - {0} or n.args[2] is False or float(n.args[1]) <= 0:
                continue
            drop = (n, items.get(0, []), float(n.args[1]))
        p = drop[2] if drop else 0.0

        x, bias = h, None
        lin = linear_bias(h, N) if len(h.users) == 1 else None
        if lin is not None:
            addmm, bias, view = lin
            absorbed += [addmm] + ([view] if view is not None else [])
        else:
            vb = _vector_bias(h, N) if len(h.users) == 1 else None
            if vb is not None:
                x, bias = vb
                absorbed.append(h)
        if drop:
            absorbed += [drop[0], *drop[1]]
        if bias is None and (act == "identity" or not drop):
            continue  # a lone activation is one kernel already; a lone dropout is the dropout pass's
        anchor = drop[0] if drop else end
        with graph.inserting_before(anchor):
            if lin is not None:
                x = insert_bias_free_linear(graph, ctx, addmm, view)
            xm = tensor_meta(x)
            if xm is None or xm.shape != hm.shape or xm.dtype != hm.dtype:
                ctx.miss("bias_act_dropout", n, "the bias-free input has another shape or dtype")
                continue
            seed = insert_seed(graph, ctx) if p > 0 else None
            fused = insert_call(graph, ctx, torch.ops.dmfx.bias_act_dropout.default, (x, bias, act, seed, p))
        if drop:
            for g in drop[1]:
                g.replace_all_uses_with(fused)
        else:
            end.replace_all_uses_with(fused)
        taken = ctx.take_over(end) - 1 if end is not None else 0  # an idiom's ops count as absorbed
        ctx.record("bias_act_dropout", len(absorbed) + taken, fused)

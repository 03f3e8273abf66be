"""Activation idioms: the tanh-GELU as GPT-2 writes it (``0.5*x*(1+tanh(sqrt(2/pi)*(x+0.044715*x^3)))``,
8 ATen ops), the erf-GELU (``0.5*x*(1+erf(x/sqrt(2)))``) and SiLU (``x*sigmoid(x)``) become
``aten.gelu`` / ``aten.silu`` (recorded as ``gelu_tanh_idiom``, ``gelu_idiom``, ``silu_idiom``), so that
the activation fusions after it (glu, bias_act_dropout) see one op, and take over what it absorbed.

Two activations ATen has no op for become the activation alone as dmfx's pointwise op,
``dmfx::bias_act_dropout(x, None, act, None, 0.0)`` (one kernel forward, one backward, instead of 3 and
5 ATen ops): QuickGELU, ``x * sigmoid(1.702 * x)`` (CLIP and its kin; ``quick_gelu_idiom``), and the
squared ReLU, ``relu(x)^2`` (Nemotron, Primer; ``relu_squared_idiom``). bias_act_dropout then takes a
bias and dropout around them as it does around ``aten.gelu`` (graph_utils.activation_name).
"""

from __future__ import annotations

import math

import torch
from torch.fx import Graph, Node

from .fusion import Fusion, Match, Miss, Replacement
from .graph_utils import (
    PassContext,
    aten,
    commuted,
    insert_call,
    is_op,
    is_scalar,
    kernel_friendly,
    number_near,
    only_user,
    same_shape,
    tensor_meta,
)

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_QUICK_GELU = 1.702  # HF's QuickGELUActivation; csrc/pointwise_api.h kQuickGeluCoef


def _near(x: object, value: float, rel: float = 1e-4) -> bool:
    """A constant near `value`, or a float input whose value it is (guarded: graph_utils.number_near)."""
    return number_near(x, value, rel)


def _mul_by(n: object, value: float) -> Node | None:
    """n = a * value (either order): a."""
    for a, b in commuted(n, aten.mul):
        if isinstance(a, Node) and _near(b, value):
            return a
    return None


def _gelu_tail(inner: Node, x: Node) -> tuple[Node, list[Node]] | None:
    """From f (tanh(...) or erf(...)) of x: 0.5 * x * (1 + f) -> (output node, its nodes)."""
    add1 = only_user(inner)
    if add1 is None or not any(_near(b, 1.0) and a is inner for a, b in commuted(add1, aten.add)):
        return None
    out = only_user(add1)
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


def _quick_gelu_of(s: Node) -> tuple[Node, Node, list[Node]] | Miss | None:
    """s = sigmoid(x * 1.702), read only by x * s: (x, that product, the nodes). x * sigmoid(c * x)
    with another constant c is a near-miss."""
    inner, m = s.args[0], only_user(s)
    if m is None or not isinstance(inner, Node) or len(inner.users) != 1:
        return None
    for x, c in commuted(inner, aten.mul):
        if not isinstance(x, Node) or not any(b is s and a is x for a, b in commuted(m, aten.mul)):
            continue
        if _near(c, _QUICK_GELU):
            return x, m, [s, inner, m]
        if is_scalar(c):
            return Miss(f"x * sigmoid({c} * x): only QuickGELU's {_QUICK_GELU} has a kernel", pattern="quick_gelu_idiom")
    return None


def _relu_squared_of(r: Node) -> tuple[Node, Node, list[Node]] | None:
    """r = relu(x), read only by r ** 2 (torch.square) or r * r: (x, that node, the nodes)."""
    sq = only_user(r)
    if sq is None or not sq.args or sq.args[0] is not r:
        return None
    if is_op(sq, aten.pow) and is_scalar(sq.args[1]) and sq.args[1] == 2 or is_op(sq, aten.mul) and sq.args[1] is r:
        return r.args[0], sq, [r, sq]
    return None


_DMFX_ACT = torch.ops.dmfx.bias_act_dropout.default  # an activation ATen has no op for, alone


def match_activation_idiom(n: Node, ctx: PassContext) -> Match | Miss | None:
    """The idiom whose tanh, erf, sigmoid or relu `n` is."""
    if not n.users:
        return None
    hit, target, kwargs, name = None, None, {}, None
    if is_op(n, aten.tanh):
        hit, target, kwargs, name = _tanh_gelu_of(n), aten.gelu.default, {"approximate": "tanh"}, "gelu_tanh_idiom"
    elif is_op(n, aten.erf):
        hit, target, name = _erf_gelu_of(n), aten.gelu.default, "gelu_idiom"
    elif is_op(n, aten.sigmoid):
        m = only_user(n)
        if m is not None and any(b is n and a is n.args[0] for a, b in commuted(m, aten.mul)):
            hit, target, name = (n.args[0], m, [n, m]), aten.silu.default, "silu_idiom"
        else:
            hit, target, kwargs, name = _quick_gelu_of(n), _DMFX_ACT, "quick_gelu", "quick_gelu_idiom"
    elif is_op(n, aten.relu):
        hit, target, kwargs, name = _relu_squared_of(n), _DMFX_ACT, "relu_squared", "relu_squared_idiom"
    if isinstance(hit, Miss):
        return hit
    if not hit:
        return None
    x, out, nodes = hit
    if not kernel_friendly(tensor_meta(x)):
        return None
    args = (x,)
    if target is _DMFX_ACT:  # (kwargs: the activation's name)
        xm, om = tensor_meta(x), tensor_meta(out)
        if om is None or not same_shape(om.shape, xm.shape) or om.dtype != xm.dtype:
            return Miss("the activation's output has another shape or dtype than its input (broadcast or promotion)",
                        pattern=name, at=out)
        args, kwargs = (x, None, kwargs, None, 0.0), {}
    return Match({"out": out, "target": target, "args": args, "kwargs": kwargs}, nodes, returned=(out,), pattern=name)


def rewrite_activation_idiom(graph: Graph, m: Match, ctx: PassContext) -> Replacement:
    with graph.inserting_before(m["out"]):
        act = insert_call(graph, ctx, m["target"], m["args"], m["kwargs"])
    return Replacement(act, {m["out"]: act})


#: GELU (tanh and erf forms) and SiLU written out -> aten.gelu / aten.silu; QuickGELU and the squared
#: ReLU -> dmfx::bias_act_dropout without bias or dropout.
ACTIVATION_IDIOMS = Fusion("activation_idioms", (aten.tanh, aten.erf, aten.sigmoid, aten.relu), match_activation_idiom,
                           rewrite_activation_idiom)

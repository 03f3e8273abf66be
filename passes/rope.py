"""Rotary position embedding of q and k in one kernel (HF LLaMA's ``apply_rotary_pos_emb``)::

    rotate_half(x) = cat([-x[..., D/2:], x[..., :D/2]], -1)
    q' = q * cos + rotate_half(q) * sin
    k' = k * cos + rotate_half(k) * sin        -> dmfx::rope(q, k, cos, sin, False) -> (q', k')

or interleaved, GPT-J's and Cohere's ``rotate_every_two`` (the pairs (2i, 2i + 1) rotate, not
(i, i + D/2))::

    rotate_every_two(x) = stack([-x[..., 1::2], x[..., ::2]], -1).flatten(-2)
                                                -> dmfx::rope(q, k, cos, sin, False, interleaved=True)

or DeepSeek's ``apply_rotary_pos_emb_interleave`` (``rope_interleave``: DeepSeek V3, Mistral 4, GLM-4
MoE lite, LongCat, ...), whose pairs (2i, 2i + 1) come out as the halves (i, i + D/2), with tables of
D/2::

    x1, x2 = x[..., 0::2], x[..., 1::2]
    x' = cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)
                    -> dmfx::rope(q, k, cat([c, c], -1), cat([s, s], -1), False, False, deinterleave=True)

Eager runs 2 slices, a neg, a cat (or a stack and a view), 2 muls and an add per tensor (5 kernels,
3 of them writing a full copy of q or k); the fused kernel reads q, k, cos, sin once and writes q',
k'. Its backward is the same kernel with the transposed rotation. q and k are paired by the cos/sin
they share, in graph order (the first site with the second, the third with the fourth, ...); an
unpaired one is left alone (logged). Tables computed twice by the same pure ops count as shared (GPT-J
gathers and repeats its sin/cos once for q and once for k).
"""

from __future__ import annotations

import torch
from torch.fx import Graph, Node

from .fusion import Fusion, Match, Miss, Replacement
from .graph_utils import (
    PassContext,
    aten,
    commuted,
    insert_call,
    insert_getitems,
    is_op,
    kernel_friendly,
    same_shape,
    same_value,
    tensor_meta,
)

_END = (2**63 - 1,)


def _slice_args(n: Node) -> tuple[object, object, object, object]:
    """(dim, start, end, step) of ``aten.slice(x, dim=0, start=None, end=None, step=1)``, defaults filled."""
    dim, start, end, step = list(n.args[1:]) + [0, None, None, 1][len(n.args) - 1:]
    return dim, start or 0, end, step


def _whole(n: object) -> object:
    """`n` without the slices that keep all of a dim (``x[:, :, :, ::2]`` traced with dynamic shapes
    slices dims 0 and 1 whole first)."""
    while is_op(n, aten.slice):
        _, start, end, step = _slice_args(n)
        if start != 0 or end not in (None, *_END) or step != 1:
            break
        n = n.args[0]
    return n


def _last_dim_slice(n: object) -> tuple[Node, int, int | None, int] | None:
    """n = x[..., start:end:step] along x's last dim: (x, start, end, step), end None where the slice runs
    to the end (None, the traced maximum, or any int from D on)."""
    if not is_op(n, aten.slice):
        return None
    x = _whole(n.args[0])
    xm = tensor_meta(x)
    if xm is None or xm.dim() == 0:
        return None
    dim, start, end, step = _slice_args(n)
    D = xm.shape[-1]
    if dim not in (-1, xm.dim() - 1):
        return None
    if end in _END or (isinstance(end, int) and isinstance(D, int) and end >= D):
        end = None
    return x, start, end, step


def _slice_of(n: object, x: Node, start: int, end: int | None, step: int = 1) -> bool:
    """n = x[..., start:end:step] along the last dim (end None: to the end), read once."""
    found = _last_dim_slice(n)
    return found is not None and found[0] is x and found[1:] == (start, end, step) and len(n.users) == 1


def _rotation_of(rot: object) -> tuple[Node, bool, list[Node]] | None:
    """rot = rotate_half(x) (a cat) or rotate_every_two(x) (a stack flattened by a view): (x,
    interleaved, the nodes the rotation is made of)."""
    if is_op(rot, aten.cat):
        if len(rot.users) != 1:
            return None
        parts, dim = rot.args[0], rot.args[1] if len(rot.args) > 1 else rot.kwargs.get("dim", 0)
        interleaved = False
    elif is_op(rot, aten.view, aten.reshape, aten._unsafe_view):
        stack = rot.args[0]
        if len(rot.users) != 1 or not is_op(stack, aten.stack) or len(stack.users) != 1:
            return None
        parts, dim = stack.args[0], stack.args[1] if len(stack.args) > 1 else stack.kwargs.get("dim", 0)
        interleaved = True
    else:
        return None
    if len(parts) != 2 or not is_op(parts[0], aten.neg) or len(parts[0].users) != 1:
        return None
    hi, lo = parts[0].args[0], parts[1]
    if not isinstance(hi, Node) or not is_op(hi, aten.slice):
        return None
    x = _whole(hi.args[0])
    xm, rm = tensor_meta(x), tensor_meta(rot)
    if xm is None or rm is None or not same_shape(rm.shape, xm.shape):
        return None
    D = xm.shape[-1]
    if not isinstance(D, int) or D % 2:
        return None
    if interleaved:
        # the stacked dim is new and last (dim -1 or rank of the slices), then flattened into D
        ok = dim in (-1, xm.dim()) and _slice_of(hi, x, 1, None, 2) and _slice_of(lo, x, 0, None, 2)
        return (x, True, [rot, rot.args[0], parts[0], hi, lo]) if ok else None
    if dim in (-1, xm.dim() - 1) and _slice_of(hi, x, D // 2, None) and _slice_of(lo, x, 0, D // 2):
        return x, False, [rot, parts[0], hi, lo]
    return None


def _rope_site(add: Node) -> tuple[Node, Node, Node, list[Node], str] | None:
    """add = x * cos + rotate(x) * sin: (x, cos, sin, absorbed nodes, pairing: "halves" or "interleaved")."""
    for m1, m2 in commuted(add, aten.add):
        for x, cos in commuted(m1, aten.mul):
            for rot, sin in commuted(m2, aten.mul):
                rotation = _rotation_of(rot)
                if rotation is None or rotation[0] is not x:
                    continue
                if len(m1.users) != 1 or len(m2.users) != 1 or not isinstance(cos, Node) or not isinstance(sin, Node):
                    continue
                xm, cm, sm, om = (tensor_meta(v) for v in (x, cos, sin, add))
                if not (kernel_friendly(xm) and cm is not None and sm is not None and om is not None):
                    continue
                if not (xm.dtype == cm.dtype == sm.dtype == om.dtype and same_shape(om.shape, xm.shape)):
                    continue
                return x, cos, sin, [add, m1, m2, *rotation[2]], "interleaved" if rotation[1] else "halves"
    return None


def _pair_slice(n: object, start: int) -> Node | None:
    """n = x[..., start::2] along x's last dim (start 0 or 1): x."""
    found = _last_dim_slice(n)
    return found[0] if found is not None and found[1:] == (start, None, 2) else None


def _products(n: object, a: object, b: object) -> bool:
    """n = a * b (either order), read once."""
    return len(getattr(n, "users", ())) == 1 and any(u is a and v is b for u, v in commuted(n, aten.mul))


def _deinterleaved_site(cat: Node) -> tuple[Node, Node, Node, list[Node], str] | None:
    """cat = cat([x1 * c - x2 * s, x2 * c + x1 * s], -1) with x1, x2 = x[..., 0::2], x[..., 1::2]
    (DeepSeek's apply_rotary_pos_emb_interleave; c and s of D/2 in the last dim): (x, c, s, absorbed
    nodes, "deinterleave")."""
    parts = cat.args[0]
    dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    if not isinstance(parts, (list, tuple)) or len(parts) != 2:
        return None
    sub, add = parts
    if not is_op(sub, aten.sub) or len(sub.args) != 2 or sub.kwargs.get("alpha", 1) != 1 or len(sub.users) != 1:
        return None
    if not is_op(add, aten.add) or len(add.users) != 1:
        return None
    m1, m2 = sub.args
    for x1, c in commuted(m1, aten.mul):
        for x2, s in commuted(m2, aten.mul):
            x = _pair_slice(x1, 0)
            if x is None or _pair_slice(x2, 1) is not x or not isinstance(c, Node) or not isinstance(s, Node):
                continue
            for m3, m4 in commuted(add, aten.add):
                if not (_products(m1, x1, c) and _products(m2, x2, s) and _products(m3, x2, c) and _products(m4, x1, s)):
                    continue
                muls = {m1, m2, m3, m4}
                if not (set(x1.users) <= muls and set(x2.users) <= muls):
                    continue
                xm, cm, sm, om, hm, am, x1m = (tensor_meta(v) for v in (x, c, s, cat, sub, add, x1))
                if not kernel_friendly(xm) or any(t is None for t in (cm, sm, om, hm, am, x1m)):
                    continue
                if dim not in (-1, xm.dim() - 1) or not (xm.dtype == cm.dtype == sm.dtype == om.dtype):
                    continue
                h = xm.shape[-1] // 2
                if not (same_shape(om.shape, xm.shape) and same_shape(am.shape, x1m.shape) and same_shape(hm.shape, x1m.shape)):
                    continue
                if cm.shape[-1:] != (h,) or sm.shape[-1:] != (h,) or cm.dim() > xm.dim() or sm.dim() > xm.dim():
                    continue  # (tables of D/2, broadcast to x1: the kernel takes them repeated to D)
                return x, c, s, [cat, sub, add, m1, m2, m3, m4, x1, x2], "deinterleave"
    return None


def _site(anchor: Node) -> tuple[Node, Node, Node, list[Node], str] | None:
    """A rotation ending at `anchor` (an add, or DeepSeek's cat): (x, cos, sin, absorbed nodes, pairing)."""
    if is_op(anchor, aten.add):
        return _rope_site(anchor)
    return _deinterleaved_site(anchor) if is_op(anchor, aten.cat) else None


def _anchors_after(mul: Node) -> list[Node]:
    """The nodes a rotation that multiplies by a table in `mul` may end at: the add after it, or (DeepSeek's
    form) the cat after its sub or add."""
    found = []
    for u in mul.users:
        if is_op(u, aten.add):
            found.append(u)
        if is_op(u, aten.add, aten.sub):
            found.extend(c for c in u.users if is_op(c, aten.cat))
    return found


def _sites_sharing(
    graph: Graph, order: dict[Node, int], cos: Node, sin: Node, pairing: str, equal_tables: bool
) -> list[tuple[Node, Node, list[Node]]]:
    """The rope sites (anchor, x, absorbed nodes) that rotate a tensor the same way (`pairing`) with `cos`
    and `sin` (`equal_tables`: or with tables of the same values), in graph order (`order`: each node's place)."""
    tables = [cos]
    if equal_tables and cos.op == "call_function":
        tables = [n for n in graph.nodes if n.target == cos.target and same_value(n, cos)]
    found = {}
    for c in tables:
        for m1 in c.users:
            for add in _anchors_after(m1):
                site = _site(add) if add not in found else None
                if site is None or site[4] != pairing:
                    continue
                shared = site[1] is cos and site[2] is sin
                if shared or (equal_tables and same_value(site[1], cos) and same_value(site[2], sin)):
                    found[add] = (add, site[0], site[3])
    return sorted(found.values(), key=lambda site: order[site[0]])


def match_rope(qa: Node, ctx: PassContext) -> Match | Miss | None:
    """`qa` rotates q; k is the next site rotated with the same cos and sin (sites pair up in graph
    order: an odd one is the second of its pair, matched from the first). Sites sharing the table
    nodes pair first; a site left without a partner then looks among the sites with equal tables."""
    site = _site(qa)
    if site is None:
        return None
    q, cos, sin, q_chain, pairing = site
    order = {n: j for j, n in enumerate(qa.graph.nodes)}
    for equal_tables in (False, True):
        sites = _sites_sharing(qa.graph, order, cos, sin, pairing, equal_tables)
        i = next(j for j, (add, _, _) in enumerate(sites) if add is qa)
        if i % 2:
            return None
        if i + 1 < len(sites):
            break
    else:
        return Miss("no second tensor (q or k) rotated with the same cos/sin to pair it with")
    ka, k, k_chain = sites[i + 1]
    # the fused op goes right after its last input; every reader of q' and k' must follow it
    last = max((q, k, cos, sin), key=order.__getitem__)
    if any(order[u] <= order[last] for u in (*qa.users, *ka.users)):
        return Miss("a reader of q' or k' comes before k or q is computed")
    nodes = {"q": q, "k": k, "cos": cos, "sin": sin, "last": last, "pairing": pairing}
    return Match(nodes, q_chain + k_chain, returned=(qa, ka))


def _doubled(graph: Graph, ctx: PassContext, t: Node, last: Node) -> Node:
    """cat([t, t], -1) for a site whose fused op goes after `last` (at the insertion point): one an
    earlier site made of the same values, where there is one up to `last` (a model's layers share their
    tables, each sliced from them again), else a new one."""
    for n in graph.nodes:
        parts = n.args[0] if is_op(n, aten.cat) else ()
        if len(parts) == 2 and parts[0] is parts[1] and n.args[1:] == (-1,) and same_value(parts[0], t):
            return n
        if n is last:
            break
    return insert_call(graph, ctx, aten.cat.default, ([t, t], -1))


def rewrite_rope(graph: Graph, m: Match, ctx: PassContext) -> Replacement:
    qa, ka = m.returned
    with graph.inserting_before(m["last"].next):
        cos, sin, pairing = m["cos"], m["sin"], m["pairing"]
        flags: tuple = ()
        if pairing == "interleaved":
            flags = (True,)
        elif pairing == "deinterleave":  # (the kernel takes tables of D: each half-table twice)
            cos, sin = (_doubled(graph, ctx, t, m["last"]) for t in (cos, sin))
            flags = (False, True)
        args = (m["q"], m["k"], cos, sin, False) + flags
        fused = insert_call(graph, ctx, torch.ops.dmfx.rope.default, args)
        q_out, k_out = insert_getitems(graph, fused, 2)
    return Replacement(fused, {qa: q_out, ka: k_out})


#: q * cos + rotate(q) * sin and the same for k (rotate_half or rotate_every_two), or DeepSeek's
#: de-interleaving rotation -> dmfx::rope.
ROPE = Fusion("rope", (aten.add, aten.cat), match_rope, rewrite_rope)

"""Rotary position embedding of q and k in one kernel (HF LLaMA's ``apply_rotary_pos_emb``)::

    rotate_half(x) = cat([-x[..., D/2:], x[..., :D/2]], -1)
    q' = q * cos + rotate_half(q) * sin
    k' = k * cos + rotate_half(k) * sin        -> dmfx::rope(q, k, cos, sin, False) -> (q', k')

Eager runs 2 slices, a neg, a cat, 2 muls and an add per tensor (5 kernels, 3 of them writing a
full copy of q or k); the fused kernel reads q, k, cos, sin once and writes q', k'. Its backward is
the same kernel with the transposed rotation. q and k are paired by the cos/sin they share; an
unpaired one is left alone (logged).
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.fx import GraphModule, Node

from .graph_utils import PassContext, aten, commuted, insert_call, insert_getitems, is_op, kernel_friendly, tensor_meta

_END = (2**63 - 1,)


def _slice_of(n: object, x: Node, start: int, end: int | None, D: int) -> bool:
    """n = x[..., start:end] along the last dim (end None: to the end)."""
    if not is_op(n, aten.slice) or n.args[0] is not x or len(n.users) != 1:
        return False
    args = list(n.args[1:]) + [None] * (4 - len(n.args))
    dim, s, e = args[0], args[1] or 0, args[2]
    step = n.args[4] if len(n.args) > 4 else 1
    xm = tensor_meta(x)
    if dim not in (-1, xm.dim() - 1) or step != 1 or s != start:
        return False
    return e == end or (end is None and (e is None or e in _END or e >= D))


def _rotate_half_of(cat: object) -> Node | None:
    """cat = rotate_half(x): x."""
    if not is_op(cat, aten.cat) or len(cat.users) != 1:
        return None
    parts = cat.args[0]
    dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    if len(parts) != 2 or not is_op(parts[0], aten.neg) or len(parts[0].users) != 1:
        return None
    hi, lo = parts[0].args[0], parts[1]
    if not isinstance(hi, Node) or not is_op(hi, aten.slice):
        return None
    x = hi.args[0]
    xm = tensor_meta(x)
    if xm is None or dim not in (-1, xm.dim() - 1):
        return None
    D = xm.shape[-1]
    if not isinstance(D, int) or D % 2:
        return None
    if _slice_of(hi, x, D // 2, None, D) and _slice_of(lo, x, 0, D // 2, D):
        return x
    return None


def _rope_site(add: Node) -> tuple[Node, Node, Node, list[Node]] | None:
    """add = x * cos + rotate_half(x) * sin: (x, cos, sin, absorbed nodes)."""
    for m1, m2 in commuted(add, aten.add):
        for x, cos in commuted(m1, aten.mul):
            for rot, sin in commuted(m2, aten.mul):
                if not isinstance(rot, Node) or _rotate_half_of(rot) is not x:
                    continue
                if len(m1.users) != 1 or len(m2.users) != 1 or not isinstance(cos, Node) or not isinstance(sin, Node):
                    continue
                xm, cm, sm, om = (tensor_meta(v) for v in (x, cos, sin, add))
                if not (kernel_friendly(xm) and cm is not None and sm is not None and om is not None):
                    continue
                if not (xm.dtype == cm.dtype == sm.dtype == om.dtype and om.shape == xm.shape):
                    continue
                neg = rot.args[0][0]
                return x, cos, sin, [add, m1, m2, rot, neg, neg.args[0], rot.args[0][1]]
    return None


def fuse_rope(gm: GraphModule, ctx: PassContext) -> None:
    graph = gm.graph
    groups: dict[tuple[Node, Node], list[tuple[Node, Node, list[Node]]]] = defaultdict(list)
    for n in graph.nodes:
        if is_op(n, aten.add):
            site = _rope_site(n)
            if site is not None:
                x, cos, sin, absorbed = site
                groups[(cos, sin)].append((n, x, absorbed))
    for (cos, sin), sites in groups.items():
        while len(sites) >= 2:
            (qa, q, qabs), (ka, k, kabs) = sites.pop(0), sites.pop(0)
            # the fused op goes right after its last input; every reader of q' and k' must follow it
            order = {n: i for i, n in enumerate(graph.nodes)}
            last = max((q, k, cos, sin), key=order.__getitem__)
            if any(order[u] <= order[last] for u in (*qa.users, *ka.users)):
                ctx.miss("rope", qa, "a reader of q' or k' comes before k or q is computed")
                continue
            with graph.inserting_before(last.next):
                fused = insert_call(graph, ctx, torch.ops.dmfx.rope.default, (q, k, cos, sin, False))
                q_out, k_out = insert_getitems(graph, fused, 2)
            qa.replace_all_uses_with(q_out)
            ka.replace_all_uses_with(k_out)
            ctx.record("rope", len(qabs) + len(kabs), fused)
        for add, _, _ in sites:
            ctx.miss("rope", add, "no second tensor (q or k) rotated with the same cos/sin to pair it with")

"""Rotary position embedding of q and k in one kernel (HF LLaMA's ``apply_rotary_pos_emb``)::

    rotate_half(x) = cat([-x[..., D/2:], x[..., :D/2]], -1)
    q' = q * cos + rotate_half(q) * sin
    k' = k * cos + rotate_half(k) * sin        -> dmfx::rope(q, k, cos, sin, False) -> (q', k')

Eager runs 2 slices, a neg, a cat, 2 muls and an add per tensor (5 kernels, 3 of them writing a
full copy of q or k); the fused kernel reads q, k, cos, sin once and writes q', k'. Its backward is
the same kernel with the transposed rotation. q and k are paired by the cos/sin they share, in graph
order (the first site with the second, the third with the fourth, ...); an unpaired one is left alone
(logged).
"""

from __future__ import annotations

import torch
from torch.fx import Graph, Node

from .fusion import Fusion, Match, Miss, Replacement
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


def _sites_sharing(graph: Graph, cos: Node, sin: Node) -> list[tuple[Node, Node, list[Node]]]:
    """The rope sites (add, x, absorbed nodes) that rotate a tensor with `cos` and `sin`, in graph order."""
    found = {}
    for m1 in cos.users:
        for add in m1.users:
            site = _rope_site(add) if is_op(add, aten.add) and add not in found else None
            if site is not None and site[1] is cos and site[2] is sin:
                found[add] = (add, site[0], site[3])
    order = {n: i for i, n in enumerate(graph.nodes)}
    return sorted(found.values(), key=lambda site: order[site[0]])


def match_rope(qa: Node, ctx: PassContext) -> Match | Miss | None:
    """`qa` rotates q; k is the next site rotated with the same cos and sin (sites pair up in graph
    order: an odd one is the second of its pair, matched from the first)."""
    site = _rope_site(qa)
    if site is None:
        return None
    q, cos, sin, q_chain = site
    sites = _sites_sharing(qa.graph, cos, sin)
    i = next(j for j, (add, _, _) in enumerate(sites) if add is qa)
    if i % 2:
        return None
    if i + 1 == len(sites):
        return Miss("no second tensor (q or k) rotated with the same cos/sin to pair it with")
    ka, k, k_chain = sites[i + 1]
    # the fused op goes right after its last input; every reader of q' and k' must follow it
    order = {n: j for j, n in enumerate(qa.graph.nodes)}
    last = max((q, k, cos, sin), key=order.__getitem__)
    if any(order[u] <= order[last] for u in (*qa.users, *ka.users)):
        return Miss("a reader of q' or k' comes before k or q is computed")
    return Match({"q": q, "k": k, "cos": cos, "sin": sin, "last": last}, q_chain + k_chain, returned=(qa, ka))


def rewrite_rope(graph: Graph, m: Match, ctx: PassContext) -> Replacement:
    qa, ka = m.returned
    with graph.inserting_before(m["last"].next):
        fused = insert_call(graph, ctx, torch.ops.dmfx.rope.default, (m["q"], m["k"], m["cos"], m["sin"], False))
        q_out, k_out = insert_getitems(graph, fused, 2)
    return Replacement(fused, {qa: q_out, ka: k_out})


#: q * cos + rotate_half(q) * sin and the same for k -> dmfx::rope.
ROPE = Fusion("rope", (aten.add,), match_rope, rewrite_rope)

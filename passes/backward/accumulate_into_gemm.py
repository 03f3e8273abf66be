"""``accumulate_into_gemm``: ``add(g, mm(a, b))`` (through views) -> ``addmm_(g, a, b)``: the GEMM
accumulates into the other gradient's buffer (beta=1 in BLAS) instead of writing a new one that an add
then reads (a layer input read by the residual and by Q/K/V gets its two gradients summed this way).
Only when that buffer is a fresh, contiguous result of this graph (not an input) that nothing reads
after the add, through any view (so writing into it cannot change any other value), of the GEMM's
dtype and shape, and that the GEMM does not read itself (BLAS with an aliased output is undefined).
Chains of adds (three unstacked projections) accumulate into one buffer.
"""

from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node

from ..fusion import record
from ..graph_utils import PassContext, alias_of, aten, dead_code_elimination, is_op, plain_add, storage_root, val


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


def _writable_at(acc: Node, at: Node, order: dict[Node, int]) -> bool:
    """Writing into `acc` in place at node `at` changes no value anyone reads: its storage is a fresh
    buffer of this graph (not a graph input, not an op's view of one), and every other reader of that
    storage (through any of its views) runs before `at`, and no view of it is a graph output."""
    root = storage_root(acc)
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
            if alias_of(u) is a:
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
    """``add(g, mm(a, b))`` (through views) -> ``addmm_(g, a, b)`` (module docstring): the add is
    absorbed into the GEMM, which accumulates into g's buffer."""
    g = gm.graph
    order = {n: i for i, n in enumerate(g.nodes)}
    for n in list(g.nodes):
        pair = plain_add(n) if is_op(n, aten.add.Tensor) else None
        if pair is None:
            continue
        for acc, other in (pair, pair[::-1]):
            mm = _through_views(other)
            if not is_op(mm, aten.mm.default) or mm is acc or len(mm.users) != 1:
                continue
            if not _writable_at(acc, n, order):
                ctx.miss("accumulate_into_gemm", n, "the other gradient's buffer is read later, or is not this graph's own")
                continue
            if storage_root(acc) in {storage_root(x) for x in mm.args[:2] if isinstance(x, Node)}:
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
            record(ctx, "accumulate_into_gemm", [n], into=summed)
            g.erase_node(n)
            break
    dead_code_elimination(gm)

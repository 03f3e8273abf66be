"""Declared fusions and the one driver that runs them.

A fusion is one module-level ``Fusion`` in its pass module (``passes/<name>.py``), named by its one
name: the ops it starts from (``anchors``); a pure ``match(anchor, ctx)`` that returns a ``Match``
(the nodes it captured, by role; the nodes the fused op absorbs; which of those it returns to readers
outside the chain), a ``Miss`` (a chain that looks like the pattern but is left alone, with the
reason: a near-miss, kept in the record) or None (not this pattern); and a ``rewrite(graph, match,
ctx)`` that only builds the new nodes and says which readers they serve (a ``Replacement``).

``run_fusion`` does the rest, the same way for every fusion: it walks the anchors in graph order,
calls match, checks that no absorbed node is read outside the chain unless the fused op returns it,
calls rewrite, hands the returned nodes' outside readers the new nodes, erases the chain (and the
producers only the chain read, which die with it), and records what fired, what was missed and what
was absorbed (``record``).

What a fusion absorbed is written on the node that now computes it, ``meta["dmfx_absorbed"]``: one
``AbsorbedOp`` per ATen op, in graph order, holding the op and its fake values (dmfx.explain's cost
model computes its class, flop and bytes from them). A node an earlier fusion made contributes its own
list, and that fusion's record is taken over (its kernel no longer exists). Passes that are not "a
chain becomes one op" (layout search, backward folds, QKV stacking) record through ``record`` too. The
backend carries the annotations to the graphs it compiles and keeps in its records
(``carry_absorbed``, ``carry_to_backward``), where dmfx.explain reads them.
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass
from typing import Any, Callable, Iterable, NamedTuple

import torch
from torch.fx import Graph, GraphModule, Node

from .graph_utils import PassContext, is_impure, is_op, same_layout, topologically_ordered, views_to_reshapes


@dataclass
class Match:
    """What a fusion's match found at its anchor."""

    nodes: dict[str, Any]  # the captured nodes (and values) by role: what rewrite reads
    absorbed: list[Node]  # the chain the fused op replaces (the producers only it reads die with it)
    returned: tuple[Node, ...] = ()  # absorbed nodes the fused op returns: readers outside the chain may read them
    pattern: str | None = None  # the name recorded, where a fusion emits more than one op (default: the fusion's)
    notes: tuple[str, ...] = ()  # near-misses met on the way (a part of the chain left out): recorded when it fires

    def __getitem__(self, role: str) -> Any:
        return self.nodes[role]


class Miss:
    """A near-miss: the chain at the anchor is left alone, for each of `reasons` (recorded as
    ``"<pattern> at <node>: <reason>"``; `at`: the node named, default the anchor)."""

    def __init__(self, *reasons: str, pattern: str | None = None, at: Node | None = None):
        self.reasons, self.pattern, self.at = reasons, pattern, at


class Replacement(NamedTuple):
    """What a rewrite built: `node`, the one that computes what the chain computed (its
    ``meta["dmfx_absorbed"]`` lists the chain), and per returned node of the match the new node its
    readers outside the chain read instead. `strides_unknown`: new nodes whose output strides PyTorch
    picks at run time (an SDPA kernel): the views after them become reshapes."""

    node: Node | None
    uses: dict[Node, Any]
    strides_unknown: tuple[Node, ...] = ()


@dataclass(frozen=True)
class Fusion:
    """One fusion: see the module docstring. A Fusion is a pass (``fusion(gm, ctx)`` runs it)."""

    name: str
    anchors: tuple[Any, ...]  # the ops (OpOverloads or packets) match starts from
    match: Callable[[Node, PassContext], "Match | Miss | None"]
    rewrite: Callable[[Graph, Match, PassContext], Replacement]
    gemm: str = "bias"  # what a GEMM among the absorbed ops becomes (AbsorbedOp.gemm)

    def __call__(self, gm: GraphModule, ctx: PassContext) -> None:
        run_fusion(self, gm, ctx)


@dataclass(frozen=True, eq=False)
class AbsorbedOp:
    """One ATen op a fused node absorbed: the op, its name in the graph it came from, and its fake
    argument and output values (``dmfx.explain``'s ``op_cost(target, args, kwargs, out)``)."""

    node: str
    target: Any
    args: tuple
    kwargs: dict
    out: Any
    # what became of it when it is a GEMM: "bias" (re-emitted without its bias, which the fused op
    # adds: only the bias is absorbed), "inside" (it runs inside the fused op), "stacked" (one GEMM
    # over the stacked weights computes it with others)
    gemm: str = "bias"
    grad: bool = False  # a forward op whose gradient a backward kernel computes (listed on that kernel)

    @classmethod
    def of(cls, n: Node, gemm: str = "bias") -> "AbsorbedOp":
        def value(a: Node) -> Any:
            return a.meta.get("val")

        return cls(n.name, n.target, torch.fx.node.map_arg(n.args, value), torch.fx.node.map_arg(dict(n.kwargs), value),
                   n.meta.get("val"), gemm)


def absorbed_ops(n: Node) -> list[AbsorbedOp]:
    """The ATen ops `n` absorbed (``meta["dmfx_absorbed"]``; empty for a node no fusion made)."""
    return list(n.meta.get("dmfx_absorbed", ()))


# ----------------------------------------------------------------------------------------- recording


def record(ctx: PassContext, name: str, absorbed: Iterable[Node], into: Node | None = None, gemm: str = "bias") -> None:
    """Record in `ctx` that `name` fired once and absorbed the call nodes `absorbed` (getitems are not
    ops; call it before they are erased), and list them on `into` (the node that now computes them)
    after what it lists already. A node an earlier fusion made counts as the ops it lists, and that
    fusion's record is taken over (its kernel is gone)."""
    ops: list[AbsorbedOp] = []
    for n in absorbed:
        if n.op != "call_function" or n.target is operator.getitem:
            continue
        if "dmfx_absorbed" not in n.meta:
            ops.append(AbsorbedOp.of(n, gemm))
            continue
        ops += absorbed_ops(n)
        made_by, count = n.meta.get("dmfx_fusion", (None, 0))
        if made_by in ctx.fired:  # (this context recorded it)
            _count(ctx, made_by, -1, -count)
    if into is not None:
        into.meta["dmfx_absorbed"] = [*absorbed_ops(into), *ops]
        into.meta.setdefault("dmfx_fusion", (name, len(ops)))
    _count(ctx, name, 1, len(ops))


def _count(ctx: PassContext, name: str, fired: int, replaced: int) -> None:
    ctx.fired[name] = ctx.fired.get(name, 0) + fired
    ctx.replaced[name] = ctx.replaced.get(name, 0) + replaced
    if not ctx.fired[name]:
        del ctx.fired[name], ctx.replaced[name]


# ----------------------------------------------------------------------------------------- the driver


def run_fusion(fusion: Fusion, gm: GraphModule, ctx: PassContext) -> None:
    """Run `fusion` over `gm` (see the module docstring)."""
    gone: set[Node] = set()  # erased by an earlier match
    for anchor in list(gm.graph.nodes):
        if anchor in gone or not is_op(anchor, *fusion.anchors):
            continue
        found = fusion.match(anchor, ctx)
        if found is None:
            continue
        if isinstance(found, Miss):
            for why in found.reasons:
                ctx.miss(found.pattern or fusion.name, found.at or anchor, why)
            continue
        pattern = found.pattern or fusion.name
        for note in found.notes:
            ctx.miss(pattern, anchor, note)
        outside = read_outside(found)
        if outside is not None:
            ctx.miss(pattern, anchor, f"intermediate {outside.name} has a user outside the pattern")
            continue
        done = fusion.rewrite(gm.graph, found, ctx)
        if set(done.uses) != set(found.returned):
            raise RuntimeError(f"dmfx: fusion {fusion.name!r} rewrote {sorted(u.name for u in done.uses)} "
                               f"but its match returns {sorted(r.name for r in found.returned)}")
        inside = set(found.absorbed)
        for old, new in done.uses.items():
            old.replace_all_uses_with(new, delete_user_cb=lambda u: u not in inside)
        # (a fused op laying out its output otherwise than the chain did: dmfx's norms write contiguously
        # where element-wise ops kept a transposed input's strides, Gemma 3's q/k norms; the views after it
        # become reshapes now, not only at the pipeline's end, so that each pass leaves a graph that runs)
        moved = [new for old, new in done.uses.items() if isinstance(new, Node) and not same_layout(old, new)]
        views_to_reshapes([*done.strides_unknown, *moved])
        dead = dying(found.absorbed)
        record(ctx, pattern, dead, into=done.node, gemm=fusion.gemm)
        erase(dead)
        gone.update(dead)
    topologically_ordered(gm.graph)  # (a fused op inserted before an input made later: after it)


def read_outside(m: Match) -> Node | None:
    """The first absorbed node that a node outside the chain reads, other than those the fused op
    returns; None when there is none."""
    inside = set(m.absorbed)
    for k in m.absorbed:
        if k not in m.returned and any(u not in inside for u in k.users):
            return k
    return None


def dying(chain: Iterable[Node]) -> list[Node]:
    """`chain`, which nothing outside it may read any more, and every producer that only those nodes
    read (a pure call: no placeholder, nothing with side effects): what erasing `chain` removes, in
    graph order."""
    dead = set(chain)
    if not dead:
        return []
    for n in dead:
        reader = next((u for u in n.users if u not in dead), None)
        if reader is not None:
            raise RuntimeError(f"dmfx: {n.name} is absorbed but {reader.name} still reads it")
    stack = list(dead)
    while stack:
        for a in stack.pop().all_input_nodes:
            if a not in dead and a.op == "call_function" and not is_impure(a) and all(u in dead for u in a.users):
                dead.add(a)
                stack.append(a)
    order = {n: i for i, n in enumerate(next(iter(dead)).graph.nodes)}
    return sorted(dead, key=order.__getitem__)


def erase(nodes: list[Node]) -> None:
    """Erase `nodes` (in graph order, read by nothing but each other: dying), the last first."""
    for n in reversed(nodes):
        n.graph.erase_node(n)


# ------------------------------------------------------------------------- carried into compiled graphs


def provenance(n: Node) -> list[str]:
    """Names of the nodes `n` was traced from (``meta["from_node"]``), nearest first."""
    names, stack = [], list(n.meta.get("from_node") or [])
    while stack:
        s = stack.pop(0)
        if getattr(s, "name", None):
            names.append(s.name)
        stack.extend(getattr(s, "from_node", None) or [])
    return names


def carry_absorbed(source: GraphModule, target: GraphModule) -> None:
    """What each node of `source` (the graph the passes rewrote) absorbed, onto the node of `target`
    (a graph AOTAutograd traced from it: the forward or the inference graph) that computes it: the
    node `target`'s node was traced from (``meta["from_node"]``), else the next one of the same op."""
    made = {n.name: n for n in source.graph.nodes if "dmfx_absorbed" in n.meta}
    by_target: dict[Any, list[Node]] = {}
    for n in made.values():
        by_target.setdefault(n.target, []).append(n)
    for n in target.graph.nodes:
        if n.op != "call_function":
            continue
        src = next((made[s] for s in provenance(n) if s in made), None)
        if src is None:  # no provenance: by order among the nodes of the same op
            src = next((s for s in by_target.get(n.target, []) if s.name in made), None)
        if src is not None and src.target is n.target:
            del made[src.name]
            n.meta["dmfx_absorbed"] = absorbed_ops(src)
            n.meta["dmfx_fusion"] = src.meta.get("dmfx_fusion")


def carry_to_backward(forward: GraphModule, backward: GraphModule) -> None:
    """The dmfx kernels of `backward` that compute the gradient of a fused dmfx node of `forward` (the
    same autograd sequence number, ``meta["seq_nr"]``) list the gradients of what that node absorbed."""
    by_seq: dict[int, Node] = {}
    for n in forward.graph.nodes:
        if "seq_nr" in n.meta and "dmfx_absorbed" in n.meta and getattr(n.target, "namespace", None) == "dmfx":
            by_seq.setdefault(n.meta["seq_nr"], n)
    for n in backward.graph.nodes:
        fwd = by_seq.get(n.meta.get("seq_nr")) if n.op == "call_function" else None
        if fwd is not None and getattr(n.target, "namespace", None) == "dmfx" and "dmfx_absorbed" not in n.meta:
            n.meta["dmfx_absorbed"] = [dataclasses.replace(op, grad=True) for op in absorbed_ops(fwd)]
            n.meta["dmfx_note"] = f"backward of {fwd.name}"


__all__ = ["AbsorbedOp", "Fusion", "Match", "Miss", "Replacement", "absorbed_ops", "carry_absorbed", "carry_to_backward",
           "dying", "erase", "provenance", "read_outside", "record", "run_fusion"]

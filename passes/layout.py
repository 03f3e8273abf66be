"""Layout selection: which memory order each choosable tensor is written in, by an exact search.

The fusion passes fix most layouts by construction (the attention ops read Q, K and V where the
projections wrote them and write the context where the output projection reads it). What is left
are the choices this pass makes jointly over the graph, with the search of layout_search.py:

* **copies**: a ``clone(memory_format=contiguous_format)`` (HF's ``.contiguous()``, ATen's copy inside
  ``reshape``) is either kept, or dropped so that its readers see its input's layout;
* **GEMM outputs**: an ``mm`` writes ``C`` row-major, or column-major by computing ``(Bᵀ·Aᵀ)ᵀ``
  (free in BLAS: only the transposition flags change).

Each choice is a layout variable. For every assignment the pass replays the view ops (``view``,
``permute``, ``transpose``, ``_unsafe_view``, ...) between a variable and its readers on meta tensors
with the candidate strides, and prices each reader (bytes, from the tensor sizes):

* a kept copy costs its read + write; a dropped one nothing;
* a GEMM operand is free if BLAS can read it (a unit stride in one of its two matrix dims), else
  ATen copies it (read + write);
* a dmfx op reads rows: free with a unit last-dim stride, else the kernel's own copy;
* a view that the candidate strides cannot express is forbidden (the traced graph's ``view`` would
  fail), as is any layout change seen by a graph output or by an op whose output layout follows its
  inputs (element-wise ops, reductions): those keep the strides they were traced with.

The traced layouts are always a feasible assignment, so the search never does worse than the graph
it was given. Copies the search keeps are listed in ``ctx.copies`` (and ``dmfx.explain``) with their
bytes and the cheapest alternative's cost.

In training, forward and backward are searched as one problem: the backend runs the search on
AOTAutograd's joint graph (``choose_joint_layouts``), in its partition function, before the
partitioner splits it. There a tensor the forward saves is priced for its backward readers too (a
dmfx backward kernel reads the GEMM output its forward kernel read, so a layout that costs that
kernel a copy costs it twice), and the backward's own GEMM outputs and copies are variables of the
same problem. The forward pipeline's ``layout`` pass then changes nothing (``ctx.joint_layouts``);
without a backward (inference) it is the search. After the backward passes have rewritten the
partitioned backward graph (passes/backward.py), the search runs once more there, on what they made:
the tensors the forward saved are its inputs then, with their layouts fixed.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import GraphModule, Node

from .graph_utils import PassContext, grad_dependent_nodes, is_op, refresh_val, val, views_to_reshapes
from .layout_search import INF, LayoutProblem, SearchTooWide, solve

aten = torch.ops.aten

KEEP, DROP = "keep", "drop"  # copy variables
ROW, COL = "row-major", "column-major"  # GEMM output variables

# View ops replayed on meta tensors (their result aliases their first argument).
_VIEWS = {
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.permute.default,
    aten.transpose.int, aten.t.default, aten.expand.default, aten.unsqueeze.default, aten.squeeze.dim,
    aten.squeeze.dims, aten.slice.Tensor, aten.select.int, aten.alias.default, aten.unflatten.int,
}
_GEMMS = {aten.mm.default, aten.bmm.default, aten.addmm.default, aten.baddbmm.default}


class _Bad(Exception):
    """A view the candidate strides cannot express."""


def _nbytes(t: torch.Tensor) -> float:
    return float(t.numel() * t.element_size())


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device="meta")


def _is_contig_clone(n: Node) -> bool:
    return is_op(n, aten.clone.default) and n.kwargs.get("memory_format") == torch.contiguous_format


class _Model:
    """The layout variables of one graph and the meta tensors each assignment gives its nodes."""

    def __init__(self, gm: GraphModule):
        self.vars: dict[Node, list[str]] = {}
        for n in gm.graph.nodes:
            v = val(n)
            if not isinstance(v, torch.Tensor) or not all(isinstance(x, int) for x in (*v.shape, *v.stride())):
                continue  # not a tensor, or symbolic sizes: dynamic graphs keep their layouts
            if _is_contig_clone(n) and isinstance(n.args[0], Node):
                self.vars[n] = [KEEP, DROP]
            elif is_op(n, aten.mm.default) and v.dim() == 2:
                self.vars[n] = [ROW, COL]
        self._scope: dict[Node, frozenset] = {}

    def scope(self, n: Any) -> frozenset:
        """The variables whose values decide `n`'s strides."""
        if not isinstance(n, Node):
            return frozenset()
        if n in self._scope:
            return self._scope[n]
        s: frozenset = frozenset()
        if n in self.vars:
            s = frozenset([n])
            if self.vars[n][0] == KEEP:  # a dropped copy shows its input's strides
                s = s | self.scope(n.args[0])
        elif n.op == "call_function" and n.target in _VIEWS:
            s = self.scope(n.args[0])
        self._scope[n] = s
        return s

    def tensor(self, n: Node, assign: dict[Node, str], cache: dict) -> torch.Tensor:
        """`n`'s value as a meta tensor with the strides `assign` gives it."""
        if n in cache:
            return cache[n]
        v = val(n)
        if n in self.vars:
            choice = assign[n]
            if choice == KEEP:
                out = torch.empty(tuple(v.shape), dtype=v.dtype, device="meta")
            elif choice == DROP:
                out = self.tensor(n.args[0], assign, cache)
            elif choice == ROW:
                out = torch.empty(tuple(v.shape), dtype=v.dtype, device="meta")
            else:
                out = torch.empty(tuple(v.shape[::-1]), dtype=v.dtype, device="meta").t()
        elif n.op == "call_function" and n.target in _VIEWS and self.scope(n):
            src = self.tensor(n.args[0], assign, cache)
            rest = [val(a) if isinstance(a, Node) else a for a in n.args[1:]]
            try:
                out = n.target(src, *rest, **n.kwargs)
            except RuntimeError as e:  # view size is not compatible with input tensor's size and stride
                raise _Bad(str(e)) from e
            if n.target is aten.reshape.default and not torch._C._is_alias_of(out, src):
                raise _Bad("reshape would copy")
        else:
            out = _meta_like(v)
        cache[n] = out
        return out


def _reader_cost(u: Node, t: torch.Tensor, traced: torch.Tensor) -> float:
    """What `u` pays to read a tensor with the strides of `t` (traced with those of `traced`)."""
    if u.op == "call_function" and u.target in _GEMMS:
        if t.dim() < 2 or t.stride(-1) == 1 or t.stride(-2) == 1:
            return 0.0
        return 2.0 * _nbytes(t)  # ATen copies the operand
    if u.op == "call_function" and getattr(u.target, "namespace", None) == "dmfx":
        return 0.0 if (t.dim() == 0 or t.stride(-1) == 1 or t.size(-1) == 1) else 2.0 * _nbytes(t)
    if _is_contig_clone(u):
        return 0.0  # a copy reads any layout at the same cost (its own cost is its variable's)
    # graph outputs, element-wise ops and the rest (their output layout follows the input's): as traced
    return 0.0 if tuple(t.stride()) == tuple(traced.stride()) or t.numel() <= 1 else INF


def _readers(model: _Model, n: Node) -> list[tuple[Node, Node]]:
    """(reader, the node it reads) for the non-view readers of `n`, through view ops."""
    out, stack, seen = [], [n], {n}
    while stack:
        x = stack.pop()
        for u in x.users:
            if u.op == "call_function" and u.target in _VIEWS and u.args and u.args[0] is x:
                if u not in seen:
                    seen.add(u)
                    stack.append(u)
            elif u in model.vars and _is_contig_clone(u):
                continue  # a copy variable: its readers are priced through its own scope
            else:
                out.append((u, x))
    return out


def build_problem(gm: GraphModule) -> tuple[LayoutProblem, _Model]:
    model = _Model(gm)
    p = LayoutProblem()
    for n, dom in model.vars.items():
        p.var(n, dom)
        if dom[0] == KEEP:
            nbytes = 2.0 * _nbytes(val(n))
            p.add([n], lambda c, nbytes=nbytes: nbytes if c == KEEP else 0.0, f"copy {n.name}")
    # every variable's readers (through views), and a dropped copy's readers in turn
    priced: set[tuple[Node, Node]] = set()
    for n in model.vars:
        for u, x in _readers(model, n):
            if (u, x) in priced:
                continue
            priced.add((u, x))
            scope = sorted(model.scope(x), key=lambda m: m.name)
            if not scope:
                continue
            traced = val(x)

            def cost(*choice, u=u, x=x, scope=scope, traced=traced):
                try:
                    t = model.tensor(x, dict(zip(scope, choice)), {})
                except _Bad:
                    return INF
                return _reader_cost(u, t, traced)

            p.add(scope, cost, f"{u.name} reads {x.name}")
    return p, model


def _traced_choice(model: _Model, n: Node) -> str:
    return KEEP if model.vars[n][0] == KEEP else ROW


def choose_forward_layouts(gm: GraphModule, ctx: PassContext) -> None:
    """The forward pipeline's ``layout`` pass: the search on the forward graph, unless the backend
    will search the joint forward+backward graph (training; see the module docstring)."""
    if ctx.training and ctx.joint_layouts:
        return
    choose_layouts(gm, ctx)


def choose_joint_layouts(joint: GraphModule, ctx: PassContext) -> None:
    """The search on AOTAutograd's joint graph (primals and tangents in, forward outputs and gradients
    out). Copies it keeps are tagged with the graph the partitioner will put them in: a node that
    depends on a tangent runs in the backward."""
    first = len(ctx.copies)
    choose_layouts(joint, ctx, "layout")
    kept = ctx.copies[first:]
    if kept:
        is_tangent = [("tangents" in str(n.target)) for n in joint.graph.nodes if n.op == "placeholder"]
        names = {n.name for n in grad_dependent_nodes(joint.graph, is_tangent)}
        for c in kept:
            c["graph"] = "backward" if c["node"] in names else "forward"


def choose_layouts(gm: GraphModule, ctx: PassContext, name: str = "layout") -> None:
    """Build the layout problem of `gm`, solve it, and apply the cheapest assignment (see the module
    docstring). A problem the search cannot take leaves the graph as it is and says why."""
    _refresh_traced_views(gm, ctx)
    try:
        p, model = build_problem(gm)
        if not model.vars:
            return
        sol = solve(p)
    except (SearchTooWide, _Bad, RuntimeError, TypeError, ValueError) as e:
        first = next(iter(n for n in gm.graph.nodes if n.op == "call_function"), None)
        if first is not None:
            ctx.miss(name, first, f"layout search not run ({type(e).__name__}: {e}); the traced layouts stay")
        return
    traced = {n: _traced_choice(model, n) for n in model.vars}
    if p.cost_of(traced) <= sol.cost:  # nothing cheaper than the graph as traced: change nothing
        sol.assignment = traced
    graph = gm.graph
    changed = 0
    moved: list[Node] = []  # nodes whose readers now see other strides
    for n in list(model.vars):
        choice = sol.assignment[n]
        if choice == DROP:
            moved.extend(n.users)
            n.replace_all_uses_with(n.args[0])
            graph.erase_node(n)
            changed += 1
        elif choice == COL:
            a, b = n.args[:2]
            with graph.inserting_before(n):
                tb = graph.call_function(aten.t.default, (b,))
                ta = graph.call_function(aten.t.default, (a,))
                mm = graph.call_function(aten.mm.default, (tb, ta))
                out = graph.call_function(aten.t.default, (mm,))
            tb.meta["val"], ta.meta["val"] = val(b).t(), val(a).t()  # (fake tensors run in their own mode)
            mm.meta["val"] = torch.mm(tb.meta["val"], ta.meta["val"])
            out.meta["val"] = mm.meta["val"].t()
            n.replace_all_uses_with(out)
            graph.erase_node(n)
            moved.extend(out.users)
            changed += 1
        elif choice == KEEP:
            c = p.cost_of({**sol.assignment, n: DROP})
            v = val(n)
            ctx.copies.append({
                "node": n.name, "bytes": int(2 * _nbytes(v)),
                "why": "layout search kept this copy: " + (
                    "dropping it is not possible (a reader needs the copied layout)" if c == INF
                    else "dropping it would only move the copy into a reader (same bytes)" if c == sol.cost
                    else f"dropping it would cost {c - sol.cost:.0f} more bytes"),
            })
    if moved:  # (their readers' views now see the search's strides)
        _refresh_traced_views(gm, ctx)
    # The search checked each view against the traced strides; reshape is that same view then, and
    # stays correct if an op upstream (SDPA picks its kernel at run time) hands out other strides.
    views_to_reshapes(moved)
    for _ in range(changed):  # one per layout changed: a dropped copy, a GEMM written transposed
        ctx.record(name, 1)


def _refresh_traced_views(gm: GraphModule, ctx: PassContext) -> None:
    """Fresh fake values for the graph's view ops, in graph order, before the search reads strides.
    The fusion passes replace producers (an SDPA call where eager's GEMMs were) whose outputs come in
    other layouts than the nodes they replaced; the views after them still carry the strides they
    were traced with. Best effort: a view that cannot be recomputed keeps its value."""
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target in _VIEWS and isinstance(n.args[0], Node):
            old = n.meta.get("val")
            try:
                refresh_val(n, ctx)
            except Exception:
                n.meta["val"] = old


def choose_backward_layouts(gm: GraphModule, ctx: PassContext) -> None:
    choose_layouts(gm, ctx, "backward_layout")

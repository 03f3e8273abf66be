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

With ``options={"tune": True}`` the same terms are priced in seconds measured on this machine instead
(``MeasuredPrices``; passes/tuning.py caches them per machine).

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
partitioned backward graph (passes/backward/), the search runs once more there, on what they made:
the tensors the forward saved are its inputs then, with their layouts fixed.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.fx import GraphModule, Node

from .fusion import record
from .graph_utils import PassContext, grad_dependent_nodes, is_op, refresh_val, val, views_to_reshapes
from .layout_search import INF, Infeasible, LayoutProblem, SearchTooWide, solve

aten = torch.ops.aten
log = logging.getLogger("dmfx")

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
            except (RuntimeError, ValueError) as e:  # a view the strides cannot express (meta kernels raise either)
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


class BytesPrices:
    """The default cost model: bytes moved (see the module docstring)."""

    min_gain = 0.0  # a cheaper assignment wins by any margin

    def copy(self, src: torch.Tensor) -> float:
        """A ``clone(contiguous)`` of a tensor with `src`'s strides."""
        return 2.0 * _nbytes(src)

    def gemm_output(self, n: Node) -> float:
        """What writing the ``mm`` `n` column-major adds (free in BLAS: only the flags change)."""
        return 0.0

    def reader(self, u: Node, x: Node, t: torch.Tensor, traced: torch.Tensor) -> float:
        """What `u` pays to read `x` with `t`'s strides (traced with `traced`'s)."""
        return _reader_cost(u, t, traced)

    def more(self, delta: float) -> str:
        return f"{delta:.0f} more bytes"


class MeasuredPrices(BytesPrices):
    """``options={"tune": True}``: seconds measured on this machine (passes/tuning.py, cached per
    machine), for the same terms the bytes model prices: a copy from the candidate strides, a
    GEMM reading an operand with the candidate strides (against the GEMM as traced: what BLAS's
    transposition flags or ATen's own copy of the operand really cost), and an ``mm`` written
    column-major, i.e. ``(Bᵀ·Aᵀ)ᵀ`` (timed with its operands as traced). Forbidden combinations stay
    forbidden. A change must gain at least ``min_gain`` over the layouts as traced: differences of
    timings below it are noise."""

    min_gain = 2e-6

    def __init__(self, device: torch.device):
        self.device = device

    def _seconds(self, case: dict, op: Any, args: list) -> float:
        from .tuning import measured_seconds

        return measured_seconds(case, op, args, self.device)

    def _call(self, u: Node, args: list) -> float:
        from .tuning import tensor_case

        case = {"op": str(u.target), "args": [tensor_case(a) if isinstance(a, torch.Tensor) else a for a in args],
                "kwargs": {k: v for k, v in u.kwargs.items() if not isinstance(v, (Node, torch.Tensor))}}
        return self._seconds(case, lambda *a: u.target(*a, **case["kwargs"]), args)

    def copy(self, src: torch.Tensor) -> float:
        from .tuning import tensor_case

        return self._seconds({"op": "copy", "src": tensor_case(src)},
                             lambda a: a.clone(memory_format=torch.contiguous_format), [src])

    def gemm_output(self, n: Node) -> float:
        a, b = val(n.args[0]), val(n.args[1])
        return self._call(n, [_meta_like(b).t(), _meta_like(a).t()]) - self._call(n, [_meta_like(a), _meta_like(b)])

    def reader(self, u: Node, x: Node, t: torch.Tensor, traced: torch.Tensor) -> float:
        base = _reader_cost(u, t, traced)
        if base == INF or tuple(t.stride()) == tuple(traced.stride()):
            return base  # forbidden, or as traced (0: the reference every other candidate is timed against)
        if u.op == "call_function" and u.target in _GEMMS and not u.kwargs:
            args = [val(a) for a in u.args]
            if all(isinstance(v, torch.Tensor) or not isinstance(a, Node) for a, v in zip(u.args, args)):
                now = [t if a is x else _meta_like(v) if isinstance(v, torch.Tensor) else v for a, v in zip(u.args, args)]
                was = [_meta_like(v) if isinstance(v, torch.Tensor) else v for v in args]
                return self._call(u, now) - self._call(u, was)
        if base == 0.0:
            return 0.0
        return self.copy(t)  # a dmfx kernel's own copy of a strided input

    def more(self, delta: float) -> str:
        return f"{1e6 * delta:.1f} us more (measured)"


def _prices(gm: GraphModule, ctx: PassContext) -> BytesPrices:
    if not ctx.tune:
        return BytesPrices()
    devices = {v.device for n in gm.graph.nodes if isinstance(v := val(n), torch.Tensor)}
    devices.discard(torch.device("meta"))
    return MeasuredPrices(devices.pop()) if len(devices) == 1 else BytesPrices()


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


def build_problem(gm: GraphModule, prices: BytesPrices | None = None) -> tuple[LayoutProblem, _Model]:
    prices = prices or BytesPrices()
    model = _Model(gm)
    p = LayoutProblem()
    for n in model.vars:
        p.var(n, model.vars[n])
    for n, dom in model.vars.items():
        if dom[0] == KEEP:  # a kept copy costs a copy from whatever strides its input has
            scope = sorted(model.scope(n), key=lambda m: m.name)

            def copy_cost(*choice, n=n, scope=scope):
                assign = dict(zip(scope, choice))
                if assign[n] != KEEP:
                    return 0.0
                try:
                    src = model.tensor(n.args[0], assign, {})
                except _Bad:
                    return INF
                return prices.copy(src)

            p.add(scope, copy_cost, f"copy {n.name}")
        elif col := prices.gemm_output(n):
            p.add([n], lambda c, col=col: col if c == COL else 0.0, f"{n.name} written column-major")
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
                return prices.reader(u, x, t, traced)

            p.add(scope, cost, f"{u.name} reads {x.name}")
    return p, model


def _why_kept(p: LayoutProblem, n: Node, assignment: dict, prices: BytesPrices) -> str:
    """Why the copy `n` stays: what the best assignment without it costs (the search re-run with the
    copy dropped), against the chosen one. Only the part of the problem connected to `n` is re-run
    (the rest cannot change): a model keeps many small independent copies (LLaMA's repeat_kv)."""
    component, frontier = {n}, [n]
    while frontier:
        v = frontier.pop()
        for f in p.factors:
            if v in f.vars:
                new = set(f.vars) - component
                component |= new
                frontier.extend(new)
    factors = [f for f in p.factors if component & set(f.vars)]
    part = LayoutProblem(domains={v: p.domains[v] for v in component}, factors=factors)
    cost = part.cost_of({v: assignment[v] for v in component})
    try:
        c = solve(LayoutProblem(domains={**part.domains, n: [DROP]}, factors=factors)).cost
    except (Infeasible, SearchTooWide):
        c = INF
    return "layout search kept this copy: " + (
        "dropping it is not possible (a reader needs the copied layout)" if c == INF
        else "dropping it would only move the copy into a reader (same cost)" if c <= cost + prices.min_gain
        else f"the best layouts without it would cost {prices.more(c - cost)}")


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
        prices = _prices(gm, ctx)
        try:
            p, model = build_problem(gm, prices)
            if not model.vars:
                return
            sol = solve(p)
        except (SearchTooWide, _Bad):
            raise
        except Exception as e:  # a measurement failed (out of memory, an op that cannot run alone): bytes
            if not isinstance(prices, MeasuredPrices):
                raise
            log.info("dmfx: layout tuning failed (%s: %s); pricing in bytes", type(e).__name__, e)
            prices = BytesPrices()
            p, model = build_problem(gm, prices)
            sol = solve(p)
    except (SearchTooWide, _Bad, RuntimeError, TypeError, ValueError) as e:
        first = next(iter(n for n in gm.graph.nodes if n.op == "call_function"), None)
        if first is not None:
            ctx.miss(name, first, f"layout search not run ({type(e).__name__}: {e}); the traced layouts stay")
        return
    traced = {n: _traced_choice(model, n) for n in model.vars}
    if p.cost_of(traced) <= sol.cost + prices.min_gain:  # nothing cheaper than the graph as traced: change nothing
        sol.assignment, sol.cost = traced, p.cost_of(traced)
    kept = {n: _why_kept(p, n, sol.assignment, prices) for n in model.vars if sol.assignment[n] == KEEP}  # (before any edit)
    graph = gm.graph
    moved: list[Node] = []  # nodes whose readers now see other strides
    for n in list(model.vars):  # (each layout changed, a dropped copy or a GEMM written transposed, is recorded)
        choice = sol.assignment[n]
        if choice == DROP:
            moved.extend(n.users)
            n.replace_all_uses_with(n.args[0])
            record(ctx, name, [n])
            graph.erase_node(n)
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
            record(ctx, name, [n])
            graph.erase_node(n)
            moved.extend(out.users)
        elif choice == KEEP:
            ctx.copies.append({"node": n.name, "bytes": int(2 * _nbytes(val(n))), "why": kept[n]})
    if moved:  # (their readers' views now see the search's strides)
        _refresh_traced_views(gm, ctx)
    # The search checked each view against the traced strides; reshape is that same view then, and
    # stays correct if an op upstream (SDPA picks its kernel at run time) hands out other strides.
    views_to_reshapes(moved)


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

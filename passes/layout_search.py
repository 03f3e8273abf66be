"""Exact minimum-cost assignment of layouts: the search behind the layout pass (passes/layout.py).

A layout problem has variables (tensors), each with a finite list of candidate layouts, and cost
terms ("factors"), each over a few variables: the cost of an op given the layouts of the tensors it
writes and reads (bytes moved, including the copies a mismatch forces). The search finds the
assignment with the least total cost, exactly, by dynamic programming: variable elimination
(min-sum bucket elimination). Eliminating a variable replaces the factors that mention it by one
table over their other variables holding, for every combination of those, the best cost over the
eliminated variable (and which layout achieved it). Eliminating in order along a chain of ops is the
shortest path through the (op, layout) graph the paper describes; residual edges and tensors read by
several ops (the forward and its backward reading a saved tensor) make the graph a DAG, which
elimination handles exactly as long as the tables stay small (their size grows with the graph's
induced width, which is small for transformer layers: a handful of tensors are live at once).

The elimination order is greedy min-fill-in (ties by smaller table). A problem whose tables would
exceed ``max_table`` entries raises ``SearchTooWide``; the caller keeps the layouts it has.
Infinite costs mark forbidden combinations; a problem with no finite assignment raises
``Infeasible``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Sequence

import numpy as np

INF = float("inf")


class SearchTooWide(RuntimeError):
    """The elimination would build a table larger than allowed."""


class Infeasible(RuntimeError):
    """Every assignment has infinite cost."""


@dataclass
class Factor:
    """A cost over ``vars``: ``cost(*layouts)`` (in the order of ``vars``), or a table ``{layouts: cost}``
    where missing combinations are forbidden. ``name`` says which op it prices (for explanations)."""

    vars: tuple[Hashable, ...]
    cost: Callable[..., float] | dict[tuple, float]
    name: str = ""


@dataclass
class LayoutProblem:
    domains: dict[Hashable, list[Any]] = field(default_factory=dict)
    factors: list[Factor] = field(default_factory=list)

    def var(self, name: Hashable, candidates: Sequence[Any]) -> Hashable:
        cands = list(dict.fromkeys(candidates))  # unique, in order (the first is the default)
        if not cands:
            raise ValueError(f"layout variable {name!r} has no candidate layouts")
        self.domains[name] = cands
        return name

    def add(self, vars: Sequence[Hashable], cost: Callable[..., float] | dict[tuple, float], name: str = "") -> None:
        vars = tuple(vars)
        unknown = [v for v in vars if v not in self.domains]
        if unknown:
            raise KeyError(f"factor {name!r} names unknown layout variable(s) {unknown}")
        if len(set(vars)) != len(vars):
            raise ValueError(f"factor {name!r} names a variable twice: {vars}")
        self.factors.append(Factor(vars, cost, name))

    def cost_of(self, assignment: dict[Hashable, Any]) -> float:
        """Total cost of a full assignment (the brute-force check the tests compare against)."""
        total = 0.0
        for f in self.factors:
            key = tuple(assignment[v] for v in f.vars)
            total += f.cost.get(key, INF) if isinstance(f.cost, dict) else f.cost(*key)
        return total


@dataclass
class Solution:
    assignment: dict[Hashable, Any]
    cost: float
    order: list[Hashable]  # elimination order
    max_table: int  # largest table built


def _table(f: Factor, domains: dict[Hashable, list[Any]]) -> np.ndarray:
    shape = tuple(len(domains[v]) for v in f.vars)
    t = np.empty(shape, dtype=np.float64)
    for idx in itertools.product(*(range(n) for n in shape)):
        key = tuple(domains[v][i] for v, i in zip(f.vars, idx))
        t[idx] = f.cost.get(key, INF) if isinstance(f.cost, dict) else f.cost(*key)
    return t


def _align(table: np.ndarray, scope: tuple, target: tuple, sizes: dict) -> np.ndarray:
    """`table` over `scope` as an array over `target` (a superset), broadcastable."""
    perm = sorted(range(len(scope)), key=lambda i: target.index(scope[i]))
    t = np.transpose(table, perm) if scope else table
    ordered = [scope[i] for i in perm]
    shape = [sizes[v] if v in ordered else 1 for v in target]
    return t.reshape(shape)


def _elimination_order(scopes: list[set], variables: list, sizes: dict) -> list:
    """Greedy min-fill-in over the interaction graph; ties broken by the table size, then by name order."""
    nbrs: dict[Any, set] = {v: set() for v in variables}
    for s in scopes:
        for v in s:
            nbrs[v] |= s - {v}
    order, left = [], set(variables)
    rank = {v: i for i, v in enumerate(variables)}
    while left:
        def score(v):
            ns = nbrs[v] & left
            fill = sum(1 for a, b in itertools.combinations(ns, 2) if b not in nbrs[a])
            size = int(np.prod([sizes[u] for u in ns | {v}]))
            return fill, size, rank[v]

        v = min(left, key=score)
        ns = nbrs[v] & left
        for a in ns:
            nbrs[a] |= ns - {a}
        order.append(v)
        left.discard(v)
    return order


def solve(problem: LayoutProblem, max_table: int = 1 << 20) -> Solution:
    """The least-cost assignment of ``problem`` (exact)."""
    domains = problem.domains
    variables = list(domains)
    sizes = {v: len(domains[v]) for v in variables}
    tables: list[tuple[tuple, np.ndarray]] = [(f.vars, _table(f, domains)) for f in problem.factors]
    order = _elimination_order([set(s) for s, _ in tables], variables, sizes)
    argmins: list[tuple[Any, tuple, np.ndarray]] = []  # (var, scope of the rest, best index table)
    largest = 0
    constant = 0.0
    for v in order:
        mine = [(s, t) for s, t in tables if v in s]
        tables = [(s, t) for s, t in tables if v not in s]
        rest = tuple(dict.fromkeys(u for s, _ in mine for u in s if u != v))
        scope = rest + (v,)
        size = int(np.prod([sizes[u] for u in scope]))
        if size > max_table:
            raise SearchTooWide(f"layout search: eliminating {v!r} needs a table of {size} entries (limit {max_table})")
        largest = max(largest, size)
        total = np.zeros([sizes[u] for u in scope], dtype=np.float64)
        for s, t in mine:
            total = total + _align(t, s, scope, sizes)
        best = total.min(axis=-1)
        argmins.append((v, rest, total.argmin(axis=-1)))
        if rest:
            tables.append((rest, best))
        else:
            constant += float(best)
    constant += sum(float(t) for s, t in tables if not s)  # factors with no variables
    if not np.isfinite(constant):
        raise Infeasible("layout search: every assignment has a forbidden combination")
    chosen: dict[Any, int] = {}
    for v, rest, arg in reversed(argmins):
        idx = tuple(chosen[u] for u in rest)
        chosen[v] = int(arg[idx]) if rest else int(arg)
    assignment = {v: domains[v][chosen[v]] for v in variables}
    return Solution(assignment, problem.cost_of(assignment), order, largest)


def brute_force(problem: LayoutProblem) -> tuple[dict[Hashable, Any], float]:
    """Every assignment tried (small problems only): the reference the tests check ``solve`` against."""
    variables = list(problem.domains)
    best, best_cost = None, INF
    for combo in itertools.product(*(problem.domains[v] for v in variables)):
        a = dict(zip(variables, combo))
        c = problem.cost_of(a)
        if c < best_cost:
            best, best_cost = a, c
    if best is None:
        raise Infeasible("layout search: every assignment has a forbidden combination")
    return best, best_cost

"""Coverage: the share of memory-bound ATen ops (normalization and element-wise, dropout included)
that ended up inside a dmfx kernel, and why each other one did not (the near-misses the passes
recorded)."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Iterable

from torch.fx import GraphModule, Node

from ..passes.fusion import provenance
from .cost import MEMORY_BOUND, absorbed_rows, call_nodes, is_dmfx_node, node_cost, op_name


@dataclass
class Coverage:
    """Memory-bound ATen ops (normalization and element-wise, dropout included) that ended up inside a
    dmfx kernel: ``fused`` of ``total``; ``misses`` lists those that did not (op, node, graph, reason)."""

    fused: int
    total: int
    ratio: float
    misses: list[dict] = field(default_factory=list)
    per_graph: dict[str, dict] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _parse_missed(missed: Iterable[str]) -> list[tuple[str, str, str]]:
    out = []
    for m in missed:
        mt = re.match(r"^(\S+) at (\S+): (.*)$", m)
        out.append((mt.group(1), mt.group(2), mt.group(3)) if mt else ("?", "", m))
    return out


def _graphs_of(x: Any) -> dict[str, GraphModule]:
    if isinstance(x, GraphModule):
        return {"graph": x}
    if isinstance(x, dict):
        return {k: v for k, v in x.items() if v is not None}
    if isinstance(x, (list, tuple)):
        return {f"graph{i}": g for i, g in enumerate(x) if g is not None}
    kinds = ("forward", "backward", "inference")
    return {k: getattr(x, f"{k}_graph") for k in kinds if getattr(x, f"{k}_graph", None) is not None}


def _absorbed_memory_bound(n: Node) -> int:
    """How many memory-bound ATen ops the dmfx node `n` absorbed (``meta["dmfx_absorbed"]``)."""
    if "dmfx_absorbed" in n.meta:
        return sum(r["class"] in MEMORY_BOUND for r in absorbed_rows(n))
    return 1  # a dmfx kernel of unknown origin replaced at least one op


def coverage(record_or_graphs: Any, before: Any = None, missed: Iterable[str] | None = None) -> Coverage:
    """Share of memory-bound ATen ops that ended up in a dmfx kernel.

    ``record_or_graphs``: a GraphRecord (its forward/backward/inference graphs, and its ``missed``
    reasons), a GraphModule, or a list/dict of them. ``before``: the same graphs compiled without
    fusion (then total = memory-bound ops there); otherwise total = ops absorbed by the dmfx kernels
    (what their ``meta["dmfx_absorbed"]`` lists, passes/fusion.py) + those left over."""
    x = record_or_graphs
    if isinstance(x, (list, tuple)) and x and hasattr(x[0], "forward_graph"):  # GraphRecords: sum them
        records = list(x)
        befores = before if isinstance(before, (list, tuple)) else [before] * len(records)
        parts = [coverage(r, b, missed) for r, b in zip(records, befores)]
        fused, total = sum(p.fused for p in parts), sum(p.total for p in parts)
        per_graph: dict[str, dict] = {}
        for i, p in enumerate(parts):
            for k, v in p.per_graph.items():
                per_graph[f"{i}:{k}"] = v
        return Coverage(fused, total, fused / total if total else 1.0, [m for p in parts for m in p.misses], per_graph)
    graphs = _graphs_of(record_or_graphs)
    before_graphs = _graphs_of(before) if before is not None else {}
    reasons = _parse_missed(missed if missed is not None else getattr(record_or_graphs, "missed", []) or [])
    fused = total = 0
    misses, per_graph = [], {}
    for kind, gm in graphs.items():
        left = [n for n in call_nodes(gm) if node_cost(n).cls in MEMORY_BOUND]
        if kind in before_graphs:
            g_total = sum(node_cost(n).cls in MEMORY_BOUND for n in call_nodes(before_graphs[kind]))
            g_fused = max(g_total - len(left), 0)
            g_total = max(g_total, len(left))
        else:
            g_fused = sum(_absorbed_memory_bound(n) for n in call_nodes(gm) if is_dmfx_node(n))
            g_total = g_fused + len(left)
        fused += g_fused
        total += g_total
        per_graph[kind] = {"fused": g_fused, "total": g_total, "ratio": g_fused / g_total if g_total else 1.0}
        for n in left:
            names = {n.name, *provenance(n)}
            why = [f"{p}: {r}" for p, at, r in reasons if at in names]
            misses.append({"graph": kind, "node": n.name, "op": op_name(n.target),
                           "reason": "; ".join(why) if why else "no dmfx pattern covers it"})
    return Coverage(fused, total, fused / total if total else 1.0, misses, per_graph)

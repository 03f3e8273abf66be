"""``dmfx.explain``: the paper's data-movement analysis of a model, before and after dmfx.

    report = dmfx.explain(model, input_ids, training=True)
    print(report)                                    # tables: bytes per class, fused kernels, misses
    report.to_json()                                 # everything, per operator

``dmfx.explain`` is the function (dmfx/__init__.py binds it); this package holds it and its parts,
imported from here (``from dmfx.explain import runtime_bytes, coverage``):

* cost.py: the paper's operator classes and the cost of an op call (flop, bytes read and written);
* counters.py: bytes counted at run time by a dispatch mode (``runtime_bytes``), peak live memory
  (``peak_memory``);
* coverage.py: the share of memory-bound ATen ops inside dmfx kernels, and why the others are not;
* timing.py: kernel times and MUE (``measure=True``), copy bandwidth;
* report.py: the per-operator rows, totals per class, ``Report`` (tables, JSON);
* compare.py: ``explain`` itself (compile with and without fusion, run a step, analyze the graphs the
  backend kept in dmfx.records(), with what each fused node absorbed as the passes wrote it on it).

The command line is ``python -m dmfx explain`` (dmfx/__main__.py).
"""

from __future__ import annotations

from .compare import explain
from .cost import (
    CLASSES,
    CONTRACTION,
    ELEMENTWISE,
    FUSED,
    LAYOUT,
    MEMORY_BOUND,
    NORMALIZATION,
    OTHER,
    VIEW,
    OpCost,
    absorbed_rows,
    classify,
    op_cost,
    tensor_bytes,
)
from .counters import PeakMemory, RuntimeBytes, peak_memory, runtime_bytes
from .coverage import Coverage, coverage
from .report import PAPER_REDUCTION_PCT, Report, graph_rows, totals
from .timing import copy_bandwidth

__all__ = [
    "CLASSES", "CONTRACTION", "ELEMENTWISE", "FUSED", "LAYOUT", "MEMORY_BOUND", "NORMALIZATION", "OTHER",
    "PAPER_REDUCTION_PCT", "VIEW", "Coverage", "OpCost", "PeakMemory", "Report", "RuntimeBytes", "absorbed_rows",
    "classify", "copy_bandwidth", "coverage", "explain", "graph_rows", "op_cost", "peak_memory", "runtime_bytes",
    "tensor_bytes", "totals",
]

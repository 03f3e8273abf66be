"""``explain``: compile a model with dmfx and without fusion, run one step of each, and report.

1. Compiles a copy of ``model`` with dmfx and another copy with the same pipeline but every fusion
   skipped (the lowering passes run in both, as they do for any graph): the "before" and "after"
   graphs at the same ATen level. One step runs on each (training: forward + backward of a scalar made
   from the outputs, ``.loss`` when there is one, else the sum of the means of the float outputs,
   dmfx.models.loss_of, with the padding positions of ``attention_mask`` left out under the option
   ``unpad``; inference: eval mode under ``no_grad``).
2. Costs every operator of the forward and backward (or inference) graphs the backend kept in its
   records (dmfx.records()) from their fake values (cost.py), and lists for each dmfx kernel the ATen
   ops it absorbed, which the passes wrote on it (passes/fusion.py).
3. Counts the same bytes again at run time (counters.runtime_bytes) as an independent check, and
   tracks the peak of live tensor memory (counters.peak_memory).
4. ``measure=True`` times each kernel (timing.py), giving MUE per memory-bound kernel.
"""

from __future__ import annotations

import copy
import itertools
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
from torch.fx import GraphModule

from ..backend import GraphRecord, dmfx_backend, records
from ..models import loss_of
from .cost import VIEW, VIEW_NOTE, tensors
from .counters import device_of, peak_memory, runtime_bytes
from .coverage import coverage
from .report import PAPER_REDUCTION_PCT, Report, graph_rows, totals
from .timing import measure as measure_kernels


@dataclass
class _Compiled:
    """One Dynamo graph dmfx compiled: its record (graphs included), the real inputs of its first call."""

    record: GraphRecord
    inputs: list | None = field(default=None, repr=False)


def _recording_backend(options: dict, compiled: list[_Compiled]) -> Callable:
    """dmfx_backend under `options` (recording on), keeping each graph's record and the real inputs of
    its first call (for measure=True) in `compiled`. The graphs run as FX GraphModules (compiler
    "fx"): explain counts the bytes each dispatched op moves, and Inductor's generated kernels are not
    dispatched ops; dmfx's rewrites are the same under either compiler."""

    def compile_fn(gm, example_inputs):
        fn = dmfx_backend(gm, example_inputs, options={**options, "record": True, "compiler": "fx"})
        entry = _Compiled(records()[-1])  # (dmfx_backend keeps each graph's record as it starts: this one)
        compiled.append(entry)

        def run(*args):
            if entry.inputs is None:
                flat = list(args[0]) if len(args) == 1 and isinstance(args[0], list) else list(args)
                entry.inputs = [a.detach() if isinstance(a, torch.Tensor) else a for a in flat]
            return fn(*args)

        if getattr(fn, "_boxed_call", False):
            run._boxed_call = True  # type: ignore[attr-defined]
        return run

    return compile_fn


def _step_fn(compiled_model: Callable, training: bool) -> Callable:
    if training:
        def step(*args, **kwargs):
            loss = compiled_model(*args, **kwargs)
            loss.backward()
            return loss
    else:
        def step(*args, **kwargs):
            with torch.no_grad():
                return compiled_model(*args, **kwargs)
    return step


_step_ids = itertools.count()


def _compile_and_run(model, args, kwargs, training: bool, options: dict, mask_loss: bool = False):
    """Compile a copy of `model` with dmfx under `options`, run one step (compiling), one counted step
    and one memory-tracked step. Returns (what was compiled, runtime bytes, peak memory). `mask_loss`:
    the training loss leaves out the padding positions of the ``attention_mask`` argument (loss_of)."""
    m = copy.deepcopy(model)
    m.train(training)
    graphs: list[_Compiled] = []
    backend = _recording_backend(options, graphs)

    if training:
        def forward(*a, **k):
            return loss_of(m(*a, **k), k.get("attention_mask") if mask_loss else None)
    else:
        def forward(*a, **k):
            return m(*a, **k)

    # a fresh code object per call: Dynamo caches per code object, so repeated explain() calls never
    # pile up recompilations of one frame (and never reach its recompile limit)
    code = forward.__code__.replace(co_name=f"dmfx_explain_step_{next(_step_ids)}")
    forward = types.FunctionType(code, forward.__globals__, code.co_name, forward.__defaults__, forward.__closure__)
    step = _step_fn(torch.compile(forward, backend=backend, dynamic=False), training)
    zero = (lambda: m.zero_grad(set_to_none=True)) if training else (lambda: None)
    arg_grads = [t for t in tensors((args, kwargs)) if t.requires_grad]

    def reset():
        zero()
        for t in arg_grads:
            t.grad = None

    step(*args, **kwargs)
    reset()
    counted = runtime_bytes(step, *args, **kwargs)
    reset()
    peak = peak_memory(step, *args, **kwargs)
    reset()
    return graphs, counted, peak



def _analyze(compiled: list[_Compiled], stage: str) -> tuple[list[dict], dict[str, GraphModule]]:
    """The operator rows and the graphs (named "forward", "backward", "inference"; "<i>:..." when
    several Dynamo graphs were compiled) of the records in `compiled`."""
    rows: list[dict] = []
    graphs: dict[str, GraphModule] = {}
    for i, entry in enumerate(compiled):
        prefix = f"{i}:" if len(compiled) > 1 else ""
        for kind in ("forward", "inference", "backward"):
            gm = getattr(entry.record, f"{kind}_graph")
            if gm is not None:
                graphs[prefix + kind] = gm
                rows += graph_rows(gm, prefix + kind, stage)
    return rows, graphs


def explain(model: torch.nn.Module, *args: Any, training: bool = True, measure: bool = False, name: str | None = None,
            measure_rounds: int = 3, dmfx_options: dict | None = None, **kwargs: Any) -> Report:
    """Compile `model` with dmfx and without fusion, run one step of each on ``model(*args, **kwargs)``
    and report, per operator and per class, flop and bytes moved before and after (see the module
    docstring of dmfx.explain.compare). The model itself is not modified (copies are compiled); ``training`` selects train()
    mode and a forward + backward step, else eval() and ``no_grad``. ``dmfx_options`` are the
    backend's options for the "after" compile (e.g. ``{"skip": ["qkv_attention"]}`` to see what a pass
    is worth; named so that a model's own ``options`` keyword still reaches the model)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"dmfx.explain: model must be a torch.nn.Module, got {type(model).__name__}")
    from ..options import Options
    from ..passes import ALL_PASSES, LOWERING

    after_options = dict(dmfx_options or {})
    Options.from_user(after_options)  # a bad option is an error here, naming it, not in the backend
    device = device_of((args, kwargs, list(model.parameters())[:1]))
    # (under unpad a training loss over every position must leave the padding out, or it reads what unpad
    # does not compute and the pass leaves the graph padded; every compile below takes the same loss)
    mask = kwargs.get("attention_mask")
    mask_loss = bool(after_options.get("unpad")) and isinstance(mask, torch.Tensor) and mask.dim() == 2
    after, after_rt, after_peak = _compile_and_run(model, args, kwargs, training, after_options, mask_loss)
    unfused = {"skip": [p for p in ALL_PASSES if p not in LOWERING]}  # (what every lowered graph gets stays)
    before, before_rt, before_peak = _compile_and_run(model, args, kwargs, training, unfused, mask_loss)
    if not after:
        raise RuntimeError("dmfx.explain: dmfx compiled no graph for this model (nothing to explain)")
    rows_of_tokens = [_real_token_hint(c) for c in after]
    unpad = None
    if after_options.get("unpad") and any(r is not None for r in rows_of_tokens):
        padded, padded_rt, _ = _compile_and_run(model, args, kwargs, training, {**after_options, "unpad": False},
                                                mask_loss)
        unpad = _unpad_section(rows_of_tokens, after_rt, padded_rt, padded)
    fallbacks = [c.record.fallback for c in after if c.record.fallback]

    after_rows, after_graphs = _analyze(after, "after")
    before_rows, before_graphs = _analyze(before, "before")
    tot = {"before": totals(before_rows), "after": totals(after_rows)}
    by_graph = {s: {g: totals(r for r in rows if r["graph"] == g) for g in {r["graph"] for r in rows}}
                for s, rows in (("before", before_rows), ("after", after_rows))}
    b_bytes, a_bytes = (sum(t["bytes"] for t in tot[s].values()) for s in ("before", "after"))
    kernels = {s: sum(t["kernels"] for c, t in tot[s].items() if c != VIEW) for s in tot}

    records = [c.record for c in after]
    missed = [m for r in records for m in r.missed]
    cov = coverage(after_graphs, before=before_graphs if set(before_graphs) == set(after_graphs) else None, missed=missed)

    runtime = {}
    for stage, rt, static in (("before", before_rt, b_bytes), ("after", after_rt, a_bytes)):
        runtime[stage] = {**rt.to_dict(), "static_bytes": static,
                          "diff_pct": 100.0 * (rt.total - static) / static if static else 0.0}

    data = {
        "model": name or type(model).__name__,
        "training": training,
        "device": device.type,
        "torch": torch.__version__,
        "ops": {"before": before_rows, "after": after_rows},
        "totals": tot,
        "totals_by_graph": by_graph,
        "data_movement": {"before_bytes": b_bytes, "after_bytes": a_bytes,
                          "reduction_pct": 100.0 * (b_bytes - a_bytes) / b_bytes if b_bytes else 0.0,
                          "paper_reduction_pct": PAPER_REDUCTION_PCT},
        "kernels": kernels,
        "coverage": cov.to_dict(),
        "fired": _merge_counts(r.fired for r in records),
        "replaced": _merge_counts(r.replaced for r in records),
        "missed": missed,
        "attention_forms": [{"graph": r.graph_id, "node": node, "form": form, "why": why}
                            for r in records for node, (form, why) in r.attention_forms.items()],
        "copies_added": [{"graph_id": r.graph_id, **c} for r in records for c in r.copies],
        "fallbacks": fallbacks,
        "runtime": runtime,
        "unpad": unpad,
        "peak_memory": {"before": before_peak.to_dict(), "after": after_peak.to_dict()},
        "measure": None,
        "notes": [VIEW_NOTE, "bytes of a tensor = element size * min(numel, extent addressed by its strides)",
                  "flop of memory-bound ops is an estimate (a few per output element)"],
    }
    if measure:
        stages = {"before": before, "after": after}
        data["measure"] = measure_kernels(data, {s: [(c.record, c.inputs) for c in cs] for s, cs in stages.items()},
                                          device, measure_rounds)
    return Report(data)


def _real_token_hint(entry: _Compiled) -> tuple[int, int] | None:
    """For a graph the unpad pass rewrote: (padded rows B * S, real tokens T) of its first call, and T
    made the hint of the graph's data-dependent size, so that the static cost of its ops counts the
    rows that ran. None for other graphs."""
    info = entry.record.unpad
    if not info.get("option") or entry.inputs is None:
        return None
    mask = entry.inputs[info["input_index"]]
    real = int((mask != 0).sum())
    for kind in ("forward", "inference"):
        gm = getattr(entry.record, f"{kind}_graph")
        for n in gm.graph.nodes if gm is not None else ():
            if n.target is torch.ops.dmfx.unpad_index.default:
                size = n.meta["val"][0].shape[0]
                if isinstance(size, torch.SymInt):
                    env, sym = size.node.shape_env, size.node.expr
                    if isinstance(getattr(env, "var_to_hint_override", None), dict):  # (the optimization hints)
                        env.var_to_hint_override[sym] = real
    return mask.numel(), real


def _unpad_section(tokens: list, unpadded_rt, padded_rt, padded: list[_Compiled]) -> dict:
    """What option unpad did: rows computed and bytes moved (counted at run time) with and without it."""
    rows_padded = sum(t[0] for t in tokens if t)
    rows_real = sum(t[1] for t in tokens if t)
    return {"rows_padded": rows_padded, "rows_computed": rows_real,
            "padding_pct": 100.0 * (rows_padded - rows_real) / rows_padded if rows_padded else 0.0,
            "bytes_without_unpad": padded_rt.total, "bytes_with_unpad": unpadded_rt.total,
            "reduction_pct": 100.0 * (padded_rt.total - unpadded_rt.total) / padded_rt.total if padded_rt.total else 0.0}


def _merge_counts(dicts: Iterable[dict]) -> dict:
    out: dict = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return out

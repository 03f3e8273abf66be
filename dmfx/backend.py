"""The dmfx torch.compile backend.

Flow of one Dynamo graph::

    Dynamo FX graph
      -> ATen forward graph (AOTAutograd's functionalization, as aot_export_joint_simple does it:
         functional, no decompositions beyond what ATen itself does, same inputs and SymInts as the
         Dynamo graph; writes into inputs and outputs aliasing inputs go to an epilogue appended
         after the passes, dmfx/functionalize.py)
      -> pass pipeline (dmfx.passes.PIPELINE): chains of memory-bound ops -> dmfx:: fused ops
      -> AOTAutograd (aot_module_simplified): derives the backward from each op's autograd formula,
         so a fused forward op gets its fused backward op; in training the layout search runs on
         its joint forward+backward graph (rewrite_joint), then the min-cut partitioner splits it
      -> backward passes (dmfx.passes.BACKWARD_PIPELINE) on the backward graph
      -> boxed callables for the forward, backward and inference graphs

Never wrong: if lowering fails, the graph runs as Dynamo gave it; if a pass raises or a kernel cannot
be built, one warning names it and the graph runs unrewritten.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
import weakref
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

import torch
from torch.fx import GraphModule

from .observability import emit
from .options import Options

log = logging.getLogger("dmfx")

_graph_ids = itertools.count()
_records: list["GraphRecord"] = []

#: How many GraphRecords dmfx.records() keeps: the most recent ones (a process that compiles for days
#: must not grow without end). Env DMFX_MAX_RECORDS when dmfx is imported, or set this at run time.
MAX_RECORDS = int(os.environ.get("DMFX_MAX_RECORDS", "") or 256)
#: How many of the most recent records hold their GraphModules (forward, backward, inference graph)
#: themselves; older records keep their counts and text but only weak references to their graphs,
#: which then live as long as the compiled code that runs them (torch._dynamo.reset(), or the model
#: going away, frees them). Env DMFX_RECORD_GRAPHS when dmfx is imported, or set this at run time.
GRAPHS_KEPT = int(os.environ.get("DMFX_RECORD_GRAPHS", "") or 8)
_warned: set[str] = set()


@dataclass
class GraphRecord:
    """What dmfx did to one Dynamo graph."""

    graph_id: int
    devices: tuple[str, ...] = ()
    training: bool = False  # compiled with grad enabled and some input requiring grad
    attention_forms: dict[str, tuple[str, str]] = field(default_factory=dict)  # node -> (form, why)
    # copies dmfx added or the layout search kept: node, bytes, why, and graph ("forward", "backward",
    # "inference": the compiled graph it runs in)
    copies: list[dict] = field(default_factory=list)
    fired: dict[str, int] = field(default_factory=dict)
    replaced: dict[str, int] = field(default_factory=dict)
    missed: list[str] = field(default_factory=list)
    aten_ops_before: int = 0
    aten_ops_after: int = 0
    compiled: dict[str, int] = field(default_factory=dict)  # "forward"/"backward"/"inference" -> node count
    fallback: str | None = None
    # what the graph's epilogue does after the rewritten body: inputs written in place, outputs that
    # are inputs or views of them (dmfx/functionalize.py)
    epilogue: list[str] = field(default_factory=list)
    # option unpad (passes/unpad.py): the padding mask input the graph was unpadded by, or (option off)
    # the one it could be, with how many attentions read it
    unpad: dict = field(default_factory=dict)
    seconds: float = 0.0  # dmfx's compile of the graph (lowering, passes, AOTAutograd's forward), Inductor's included
    compiler: str = "fx"  # what runs the rewritten graphs: "inductor" or "fx" (option compiler; "fx" after a failure)
    inductor_seconds: float = 0.0  # Inductor's compile time of them (the backward's, compiled at its first run, too)
    # option cache (dmfx/graph_cache.py): "" (not cached: compiler "fx", cache off, or the graph left to
    # Inductor whole, which caches it itself), "miss" (compiled, and stored for later processes) or
    # "hit" (the compiled graphs came from AOTAutograd's cache: no dmfx compiler ran, the counts of
    # what the joint and backward passes did were read back from disk, and forward_graph,
    # backward_graph and inference_graph are None; rewritten_graph is the forward passes' graph)
    cache: str = ""
    lowered_from_cache: bool = False  # the lowered, rewritten forward graph came from the compile cache
    # the graph's inputs that are Python floats Dynamo made dynamic (graph_cache.python_float_inputs):
    # where there are any, the graph compiles with dmfx's cache off and PyTorch's write-only
    # (graph_cache.caches_off) until a compile of it was seen not to read their values
    float_inputs: tuple[str, ...] = ()
    # where there are float inputs: "value-free" (an earlier compile of the graph did not read their
    # values, so it is cached as any other: graph_cache.FloatInputs), "specializes" (one did: never
    # cached) or "" (not known yet: compiled uncached, and this compile decides)
    float_verdict: str = ""
    bytes_saved: int | None = None  # saved_bytes of the rewritten graph, kept for a cache hit's log line
    # fuse="auto"'s partial rewrite (dmfx/inductor.py Scope): the passes the graph skips, forward and
    # backward; the joint and backward graphs, compiled after the forward pipeline, skip them too
    scope_skip: tuple[str, ...] = ()
    # option cudagraphs (mode="reduce-overhead"): "" (not asked for), "captured" (Inductor's CUDA-graph
    # trees record the compiled graphs at their second call and replay them), "not applied: <why>", or
    # Inductor's own where the graph was left to it whole
    cudagraphs: str = ""
    # "forward"/"backward"/"inference" -> its GraphModule, or a weak reference to it once the record
    # is no longer among the GRAPHS_KEPT most recent (read them as forward_graph, ...)
    _graphs: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    _holds_graphs: bool = field(default=True, repr=False, compare=False)
    _floats: Any = field(default=None, repr=False, compare=False)  # graph_cache.FloatInputs, where float_inputs

    @property
    def floats_uncached(self) -> bool:
        """The graph has Python float inputs and compiles with its caches off (graph_cache.FloatInputs)."""
        return bool(self.float_inputs) and self.float_verdict != "value-free"

    def caches_off(self) -> Any:
        """The context a compile of the graph runs in: graph_cache.caches_off where floats_uncached."""
        from . import graph_cache

        return graph_cache.caches_off(self._floats if self.floats_uncached else None)

    def floats_compiled(self, last: bool) -> None:
        """After each compiled graph (`last`: the backward or the inference graph): whether the compile
        read a float input's value (graph_cache.FloatInputs.compiled)."""
        if self._floats is not None:
            self._floats.compiled(last)

    def _graph(self, kind: str) -> GraphModule | None:
        gm = self._graphs.get(kind)
        return gm() if isinstance(gm, weakref.ref) else gm

    def _set_graph(self, kind: str, gm: GraphModule | None) -> None:
        self._graphs[kind] = weakref.ref(gm) if gm is not None and not self._holds_graphs else gm

    def release_graphs(self) -> None:
        """Hold the graphs only weakly from now on (see GRAPHS_KEPT)."""
        self._holds_graphs = False
        for kind in list(self._graphs):
            self._set_graph(kind, self._graph(kind))

    forward_graph = property(lambda self: self._graph("forward"), lambda self, gm: self._set_graph("forward", gm))
    backward_graph = property(lambda self: self._graph("backward"), lambda self, gm: self._set_graph("backward", gm))
    inference_graph = property(lambda self: self._graph("inference"), lambda self, gm: self._set_graph("inference", gm))
    rewritten_graph = property(lambda self: self._graph("rewritten"), lambda self, gm: self._set_graph("rewritten", gm))

    def summary(self) -> str:
        if self.fallback:
            return f"graph {self.graph_id}: left to PyTorch ({self.fallback})"
        fused = ", ".join(f"{k} x{v}" for k, v in self.fired.items()) or "nothing"
        absorbed = sum(self.replaced.values())
        text = (
            f"graph {self.graph_id} [{'/'.join(self.devices) or 'no tensors'}]: fused {fused} "
            f"(absorbed {absorbed} ATen ops; {self.aten_ops_before} -> {self.aten_ops_after} ops) in {self.seconds:.2f}s"
            f", run by {'Inductor' if self.compiler == 'inductor' else 'FX'}"
        )
        if self.cache == "hit":
            text += " (from the compile cache)"
        if self.cudagraphs:
            text += f"; CUDA graphs: {self.cudagraphs}"
        if self.unpad.get("option"):
            text += (f"; unpadded by {self.unpad['mask']} ({self.unpad['attentions']} attention(s) and "
                     f"{self.unpad['row_ops']} row-wise ops on the real tokens)")
        sdpa = sorted({why for form, why in self.attention_forms.values() if form == "sdpa"})
        if sdpa:
            n = sum(form == "sdpa" for form, _ in self.attention_forms.values())
            text += f"; {n} attention(s) left to PyTorch's SDPA ({'; '.join(sdpa)})"
        return text


def records() -> list[GraphRecord]:
    """Records of the graphs dmfx compiled in this process, oldest first: the MAX_RECORDS most recent,
    the GRAPHS_KEPT most recent of them with their GraphModules (older ones: while still alive)."""
    return list(_records)


def _keep(record: GraphRecord) -> None:
    """Append `record` to the records, dropping the oldest beyond MAX_RECORDS and releasing the graphs
    of those beyond GRAPHS_KEPT."""
    _records.append(record)
    del _records[:max(0, len(_records) - MAX_RECORDS)]
    for old in _records[:max(0, len(_records) - GRAPHS_KEPT)]:
        if old._holds_graphs:
            old.release_graphs()


def reset() -> None:
    """Forget the records (torch._dynamo.reset() forgets the compiled code)."""
    _records.clear()


def _dynamo_signal(e: BaseException) -> bool:
    """Whether `e` is Dynamo's request to trace the frame again (RestartAnalysis: Inductor's
    tensorify pass raises it to specialize a float input), which must reach Dynamo, not count as a
    failure of the compile it interrupted."""
    from torch._dynamo.exc import RestartAnalysis

    return isinstance(e, RestartAnalysis)


def _norm_eps_floats(gm: GraphModule, aten_gm: GraphModule) -> list[str]:
    """Dynamo's symbols (``zf0``, ...) of the Python float inputs of `gm` that are a norm's epsilon in
    its lowered graph `aten_gm` (same inputs, in order): read with ``_local_scalar_dense`` and added
    to the variance before an ``rsqrt`` or ``sqrt``, or a ``layer_norm``'s eps. A module attribute
    (HF's RMSNorm ``variance_epsilon``, T5's) is such an input under ``dynamic=True``."""
    from .graph_cache import _float_placeholders
    from .passes.graph_utils import is_op

    aten = torch.ops.aten
    floats = {n.name: n for n in _float_placeholders(gm)}
    if not floats:
        return []
    dynamo_inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    lowered_inputs = [n for n in aten_gm.graph.nodes if n.op == "placeholder"]
    symbols = []
    for k, ph in enumerate(lowered_inputs):
        if k >= len(dynamo_inputs) or dynamo_inputs[k].name not in floats:
            continue
        for read in ph.users:
            if not is_op(read, aten._local_scalar_dense):
                continue
            eps = any((is_op(u, aten.add) and any(is_op(v, aten.rsqrt, aten.sqrt) for v in u.users))
                      or (is_op(u, aten.native_layer_norm, aten.layer_norm) and read in u.args[4:5])
                      for u in read.users)
            memo = getattr(dynamo_inputs[k].meta.get("example_value"), "item_memo", None)
            name = getattr(getattr(getattr(memo, "node", None), "expr", None), "name", None)
            if eps and name:
                symbols.append(str(name))
    return list(dict.fromkeys(symbols))


def _specialize_norm_eps(gm: GraphModule, aten_gm: GraphModule, record: GraphRecord, skip: Sequence[str] = ()) -> None:
    """Ask Dynamo to trace `gm` again with its norms' epsilons as constants (_norm_eps_floats): dmfx's
    norm kernels take eps as a number, so a symbolic one left every norm of the graph unfused (T5 or
    LLaMA under ``dynamic=True``: no ``rms_norm``, no ``bias_dropout_residual_norm``). This is how
    Inductor's tensorify pass specializes a float it cannot keep symbolic: it names the symbol in
    Dynamo's TensorifyState and raises TensorifyScalarRestartAnalysis; the retraced graph guards on
    the value (a model whose eps changes compiles again). A symbol already named (a retrace that
    still has it) is left symbolic, and its norms unfused, with a line in the record. Nothing is done
    where the norm pass is in `skip` (the options', or the kernel self-check's)."""
    if "layer_norm" in skip:
        return
    symbols = _norm_eps_floats(gm, aten_gm)
    if not symbols:
        return
    try:
        from torch._dynamo.exc import TensorifyScalarRestartAnalysis
        from torch._dynamo.symbolic_convert import TensorifyState
    except ImportError:  # (a torch without it: the norms stay unfused)
        TensorifyState = None
    new = [s for s in symbols if TensorifyState is not None and not TensorifyState.should_specialize(s)]
    if not new:
        record.missed.append(f"norms: epsilon(s) {', '.join(symbols)} are symbolic Python float inputs "
                             f"(dynamic=True): those norms are left unfused")
        return
    for s in new:
        TensorifyState.specialize(s)
    log.info("dmfx: graph %d: Dynamo traces it again with the norms' epsilon(s) specialized (%s)",
             record.graph_id, ", ".join(new))
    raise TensorifyScalarRestartAnalysis


def _warn_once(key: str, msg: str, *args: Any) -> None:
    if key not in _warned:
        _warned.add(key)
        from .cuda_ops.build import warn

        warn(msg, *args)  # visible even when the user has not configured logging
    else:
        log.info(msg, *args)


def _log_once(key: str, msg: str, *args: Any) -> None:
    if key not in _warned:
        _warned.add(key)
        log.info(msg, *args)


def with_options(**options: Any) -> Callable:
    """The dmfx backend with `options` checked now: ``torch.compile(model,
    backend=dmfx.with_options(skip=["dropout"]))``. torch.compile hands ``options={...}`` to a backend
    only when it compiles the first graph, so a bad option would surface there, wrapped in Dynamo's
    BackendCompilerFailed; this raises the plain ValueError at the call instead."""
    Options.from_user(options)  # raises ValueError naming the bad option and the valid ones

    def dmfx(gm: GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Callable:
        return dmfx_backend(gm, example_inputs, options=options, **kwargs)

    return dmfx


def _count_ops(gm: GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function")


def _devices(example_inputs: Sequence[Any]) -> tuple[str, ...]:
    return tuple(sorted({t.device.type for t in example_inputs if isinstance(t, torch.Tensor)}))


def input_requires_grad(example_inputs: Sequence[Any]) -> tuple[bool, ...]:
    """Per graph input: whether it is a tensor that requires grad."""
    return tuple(isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs)


def pass_context(example_inputs: Sequence[Any], opts: Options, training: bool):
    """The PassContext the passes run with."""
    from torch._guards import detect_fake_mode

    from .passes import PassContext

    return PassContext(
        fake_mode=detect_fake_mode(list(example_inputs)),
        training=training,
        stack_qkv=opts.stack_qkv,
        attention=opts.attention,
        attention_scope=opts.attention_scope,
        tune=opts.tune,
        input_requires_grad=input_requires_grad(example_inputs),
        input_is_parameter=tuple(isinstance(t, torch.nn.Parameter) for t in example_inputs),
        joint_layouts=training and "layout" not in opts.skip,
        unpad=opts.unpad,
    )


def _copy(gm: GraphModule) -> GraphModule:
    """A copy of `gm` whose graph the passes may rewrite (nodes, their meta, the output's meta and the
    calling convention carried over: AOTAutograd's joint graph takes ``(primals, tangents)`` and
    describes its outputs in the output node's meta)."""
    graph = torch.fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    new_out = graph.output(out)
    for old_out in gm.graph.nodes:
        if old_out.op == "output":
            new_out.meta.update(old_out.meta)
    graph._codegen = gm.graph._codegen
    return GraphModule(gm, graph)


def lower_to_aten(gm: GraphModule, example_inputs: Sequence[Any], opts: Options | None = None,
                 record: GraphRecord | None = None) -> GraphModule:
    """The Dynamo graph as a functional ATen forward graph with the same inputs, and the LOWERING
    passes run on it (passes/__init__.py: restore_sdpa, in training), under `opts` (default: the
    default options). What they did is added to `record`.

    A graph that writes its inputs or returns views of them is lowered to its functional body
    (dmfx/functionalize.py): the graph returned then also returns the new value of each mutated input
    first, and ``meta["dmfx_epilogue"]`` holds what `with_epilogue` appends after the passes."""
    from .functionalize import attach_epilogue, functional_body
    from .passes import run_lowering

    opts = opts or Options()
    training = torch.is_grad_enabled() and any(input_requires_grad(example_inputs))
    aten_gm, epilogue = functional_body(gm, list(example_inputs), training)
    ctx = pass_context(example_inputs, opts, training)
    run_lowering(aten_gm, ctx, opts.skip, verify=opts.verify)
    if not epilogue.empty:
        attach_epilogue(aten_gm, epilogue)  # raises now (the graph falls back) if the lowering broke a view
        aten_gm.meta["dmfx_epilogue"] = epilogue
    if record is not None:
        _add_to_record(record, ctx, "lowering")
        record.epilogue = epilogue.describe()
    return aten_gm


def with_epilogue(rewritten: GraphModule, aten_gm: GraphModule, record: GraphRecord) -> GraphModule:
    """`rewritten` (the passes' result on `aten_gm`, the functional body lower_to_aten returned) with
    the body's epilogue appended: the writes into mutated inputs and the outputs that alias inputs.
    Where the passes removed a node the epilogue needs, the unrewritten body is used (and recorded)."""
    from .functionalize import UnsupportedGraph, attach_epilogue

    epilogue = aten_gm.meta.get("dmfx_epilogue")
    if epilogue is None:
        return rewritten
    try:
        return attach_epilogue(rewritten, epilogue)
    except UnsupportedGraph as e:
        _warn_once(f"epilogue:{e}", "dmfx: graph %d runs unrewritten: %s", record.graph_id, e)
        record.fallback = f"the rewritten graph lost what its input writes need: {e}"
        return attach_epilogue(aten_gm, epilogue)


def rewrite(aten_gm: GraphModule, example_inputs: Sequence[Any], opts: Options, record: GraphRecord) -> GraphModule:
    """Run the pass pipeline on a copy of `aten_gm`; on failure (with opts.fallback) return it unchanged."""
    from .cuda_ops.build import KernelBuildError, load
    from .passes import run_pipeline

    unsupported = [d for d in record.devices if d not in ("cpu", "cuda")]
    if unsupported:
        _warn_once(f"device:{unsupported}", "dmfx: no kernels for device %s; graph %d runs unrewritten", unsupported, record.graph_id)
        record.fallback = f"no dmfx kernels for {unsupported}"
        return aten_gm
    try:
        for dev in record.devices:
            load(dev)
    except KernelBuildError as e:
        if not opts.fallback:
            raise
        _warn_once(f"build:{e}", "dmfx: %s; graph %d runs unrewritten", e, record.graph_id)
        record.fallback = f"kernel build failed: {e}"
        return aten_gm

    work = _run_on_copy(aten_gm, example_inputs, opts, record, record.training, run_pipeline, "")
    return aten_gm if work is None else work


def rewrite_backward(gm: GraphModule, example_inputs: Sequence[Any], opts: Options, record: GraphRecord) -> GraphModule:
    """Run the backward passes (passes/backward/) on a copy of the backward graph AOTAutograd
    derived; on failure (with opts.fallback) return it unchanged."""
    from .passes.backward import BACKWARD_PIPELINE, run_backward_pipeline

    if record.fallback or all(name in opts.skip for name in BACKWARD_PIPELINE):
        return gm
    work = _run_on_copy(gm, example_inputs, opts, record, True, run_backward_pipeline, "backward")
    return gm if work is None else work


def rewrite_joint(joint: GraphModule, joint_inputs: Sequence[Any], opts: Options, record: GraphRecord) -> GraphModule:
    """The layout search on a copy of AOTAutograd's joint forward+backward graph (passes/layout.py,
    choose_joint_layouts); on failure (with opts.fallback) the joint graph unchanged."""
    from .passes import run_joint_layout

    if record.fallback or "layout" in opts.skip:
        return joint
    work = _run_on_copy(joint, joint_inputs, opts, record, True, run_joint_layout, "joint")
    return joint if work is None else work


def _run_on_copy(gm: GraphModule, example_inputs: Sequence[Any], opts: Options, record: GraphRecord, training: bool,
                 run: Callable, graph: str) -> GraphModule | None:
    """``run(copy, ctx, opts.skip, verify=opts.verify)`` on a copy of `gm`, and what it did added to
    `record` (`graph`: "" for the forward pipeline, "backward" for the backward one, "joint" for the
    joint graph's layout search). On failure with opts.fallback: one warning and None (the caller
    keeps `gm`; a failed forward pipeline marks the record). A graph verifier's violation under
    ``verify="strict"`` (or DMFX_VERIFY=strict, the test suite's setting) raises even then."""
    ctx = pass_context(example_inputs, opts, training)
    work = _copy(gm)
    try:
        run(work, ctx, opts.skip, verify=opts.verify)
    except Exception as e:
        if not _may_fall_back(e, opts):
            raise
        name, kind = ctx.current, type(e).__name__
        then = {"": "the graph runs unrewritten", "backward": "the backward runs as AOTAutograd derived it",
                "joint": "the layouts stay as traced"}[graph]
        _warn_once(f"{graph}pass:{name}:{kind}", f"dmfx: {graph + ' ' if graph else ''}pass %r failed on graph %d (%s: %s); {then}",
                   name, record.graph_id, kind, e)
        if not graph:
            record.fallback = f"pass {name} failed: {kind}: {e}"
        return None
    _add_to_record(record, ctx, graph or ("forward" if training else "inference"))
    return work


def _add_to_record(record: GraphRecord, ctx: Any, kind: str) -> None:
    """What the passes recorded in `ctx` (a PassContext), added to `record`; `kind`: the graph they
    ran on ("lowering", "forward", "inference", "joint", "backward")."""
    for k, v in ctx.fired.items():
        record.fired[k] = record.fired.get(k, 0) + v
    for k, v in ctx.replaced.items():
        record.replaced[k] = record.replaced.get(k, 0) + v
    record.missed.extend(ctx.missed)
    record.attention_forms.update(ctx.forms)
    if ctx.unpadded:
        record.unpad = {"option": True, **ctx.unpadded}
    listed = {(c["graph"], c["node"]) for c in record.copies}
    for c in ctx.copies:
        c = {"graph": kind, **c}  # (the joint search names each copy's graph)
        if (c["graph"], c["node"]) not in listed:  # (the backward search sees the joint search's copies again)
            record.copies.append(c)
    for m in ctx.missed:
        log.debug("dmfx: graph %d %s: left alone: %s", record.graph_id, kind, m)


def _compiler(kind: str, record: GraphRecord, opts: Options, rewritten: GraphModule,
              cache: tuple[str, str] | None = None, cudagraphs: Any = None, dmfx_tag: str | None = None) -> Callable:
    """AOTAutograd's compiler for the `kind` graph ("forward", "backward", "inference"): what the
    fused nodes of `rewritten` (the graph the forward pipeline made) absorbed is carried onto the
    nodes of this graph that compute them (passes/fusion.py); the backward passes run on the backward
    graph; the graph is kept in `record`, then compiled by Inductor (compiler="inductor") or run as a
    GraphModule, whose inference graph's writes into inputs are made in place again
    (functionalize.reinplace_input_writes; Inductor reinplaces them itself).

    `cache`: (dmfx's cache tag, the record's key) where the compiled graphs go to AOTAutograd's cache
    (dmfx/graph_cache.py): once the last graph of the compile (the backward, or the inference graph)
    is compiled the record is saved for a later hit. `dmfx_tag`: the tag Inductor compiles under
    (graph_cache.tagged), also where AOTAutograd's cache is off.
    `cudagraphs`: the graph's CUDA-graph state (dmfx/inductor.py CudaGraphs) where it is captured."""
    from . import graph_cache
    from .functionalize import reinplace_input_writes
    from .passes.fusion import carry_absorbed, carry_to_backward

    def compile_fn(gm: GraphModule, example_inputs: Sequence[Any]) -> Callable:
        with record.caches_off():  # (here, as the backward compiles at its first run)
            try:
                compiled = _compile(gm, example_inputs)
            except Exception as e:
                if kind != "backward" or not _may_fall_back(e, opts):
                    raise  # (a forward or inference failure: the AOTAutograd step leaves the graph to PyTorch)
                compiled = _backward_as_derived(gm, example_inputs, e)
        record.floats_compiled(last=kind != "forward")
        return compiled

    def _compile(gm: GraphModule, example_inputs: Sequence[Any]) -> Callable:
        if kind == "backward":
            if record.forward_graph is not None:
                carry_to_backward(record.forward_graph, gm)
            gm = rewrite_backward(gm, example_inputs, opts, record)
        else:
            carry_absorbed(rewritten, gm)
        record.compiled[kind] = _count_ops(gm)
        setattr(record, f"{kind}_graph", gm)
        log.debug("dmfx: graph %d %s graph:\n%s", record.graph_id, kind, gm.code)
        compiled = None
        if opts.compiler == "inductor":
            with graph_cache.tagged(dmfx_tag):
                compiled = _inductor(gm, example_inputs, kind, record, opts, rewritten, cudagraphs)  # (Inductor reinplaces itself)
        if compiled is None:
            if kind == "inference":
                reinplace_input_writes(gm)
            compiled = _boxed(gm)
        if cache and kind in ("backward", "inference"):
            graph_cache.save_record(cache[1], record)
        return compiled

    def _backward_as_derived(gm: GraphModule, example_inputs: Sequence[Any], e: Exception) -> Callable:
        """The backward graph as AOTAutograd derived it, where dmfx's compile of it failed (`e`): compiled
        by Inductor under compiler="inductor" (as FX where Inductor fails too), else run as an FX
        GraphModule. It compiles at the first ``backward()``, after the forward already ran dmfx's
        forward graph, so the graph cannot go back to PyTorch whole; this graph is the one that
        forward's saved values and dmfx's ops' own derivatives call for, without the backward passes.
        One warning; the record says so."""
        name = type(e).__name__
        record.compiled["backward"] = _count_ops(gm)
        record.backward_graph = gm
        compiled = None
        if opts.compiler == "inductor":
            with graph_cache.tagged(dmfx_tag):
                compiled = _inductor(gm, example_inputs, "backward", record, opts, rewritten, cudagraphs)
        how = "by Inductor" if compiled is not None else "as an FX GraphModule"
        _warn_once(f"backward:{name}", "dmfx: the backward of graph %d failed to compile (%s: %s); it runs as "
                   "AOTAutograd derived it, %s", record.graph_id, name, _first_line(e), how)
        record.missed.append(f"compiler: the backward graph failed to compile ({name}); compiled it as AOTAutograd "
                             f"derived it, {how}")
        return compiled if compiled is not None else _boxed(gm)

    return compile_fn


def _may_fall_back(e: BaseException, opts: Options) -> bool:
    """Whether a failure `e` in dmfx's compile is caught by the fallback: option fallback is on, and it is
    neither Dynamo's signal nor a strict graph verifier's violation (those are raised)."""
    from .passes.verify import GraphVerificationError

    return opts.fallback and not _dynamo_signal(e) and not (isinstance(e, GraphVerificationError) and e.strict)


def _first_line(e: BaseException, n: int = 300) -> str:
    """The first line of `e`'s message, at most `n` characters ("" for an exception without one, such
    as a bare ``assert``'s)."""
    lines = str(e).splitlines()
    return lines[0][:n] if lines else ""


def _inductor(gm: GraphModule, example_inputs: Sequence[Any], kind: str, record: GraphRecord, opts: Options,
              rewritten: GraphModule, cudagraphs: Any = None) -> Callable | None:
    """`gm` compiled by Inductor (dmfx/inductor.py); on failure (with opts.fallback) one warning and
    None: the caller runs it as a GraphModule, with dmfx's rewrites."""
    from .inductor import compile_graph, uses_inductor_joint

    start = time.perf_counter()
    try:
        compiled = compile_graph(gm, example_inputs, kind, record.graph_id, _output_count(rewritten),
                                 max_autotune=opts.max_autotune, cudagraphs=cudagraphs,
                                 joint_passes=kind == "inference" and uses_inductor_joint(opts))
    except Exception as e:
        if not _may_fall_back(e, opts):
            raise
        _warn_once(f"inductor:{type(e).__name__}", "dmfx: Inductor could not compile graph %d's %s graph (%s: %s); "
                   "it runs as an FX GraphModule (compiler='fx')", record.graph_id, kind, type(e).__name__,
                   _first_line(e))
        record.missed.append(f"compiler: Inductor failed on the {kind} graph ({type(e).__name__}); ran it as FX")
        record.compiler = "fx"
        if cudagraphs is not None:
            record.cudagraphs = f"not applied: Inductor failed on the {kind} graph, which runs as FX"
        return None
    record.inductor_seconds += time.perf_counter() - start
    if cudagraphs is not None and not record.cudagraphs.startswith("not applied"):
        record.cudagraphs = "captured" if cudagraphs.enabled else (
            "not applied: Inductor declined the graph (TORCH_LOGS=perf_hints says why)")
    return compiled


def _whole_graph_to_inductor(gm: GraphModule, example_inputs: Sequence[Any], why: str, record: GraphRecord,
                             opts: Options, start: float, cudagraphs: bool = False) -> Callable | None:
    """The Dynamo graph compiled by Inductor alone (its compile_fx: its decompositions, partitioner
    and passes), where dmfx's fusions would not pay under it (`why`: dmfx/inductor.py
    auto_decision); None when Inductor fails (then dmfx compiles the graph as usual)."""
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    from .inductor import pin_contiguous_outputs

    pin_contiguous_outputs(gm)  # (eager's layout for the outputs, which Inductor's decompositions may change)

    from .functionalize import pin_reads_pass

    # (Inductor's partitioner would recompute reads of an input the graph writes after the write)
    patches: dict[str, Any] = {"joint_custom_post_pass": pin_reads_pass(),
                               **({"triton.cudagraphs": True} if cudagraphs else {})}

    def inner_compile(*args: Any, **kwargs: Any) -> Any:  # (whether each graph read a float input's value)
        with record.caches_off():  # (here, as the backward compiles at its first run)
            compiled = compile_fx_inner(*args, **kwargs)
        record.floats_compiled(last=bool(kwargs.get("is_backward") or kwargs.get("is_inference")))
        return compiled

    try:
        with record.caches_off():
            compiled = compile_fx(gm, example_inputs, inner_compile=inner_compile if record.float_inputs else
                                  compile_fx_inner, config_patches=patches)
    except Exception as e:
        if not _may_fall_back(e, opts):
            raise
        _warn_once(f"inductor-whole:{type(e).__name__}", "dmfx: Inductor could not compile graph %d (%s: %s); dmfx "
                   "compiles it", record.graph_id, type(e).__name__, _first_line(e))
        return None
    record.fallback = f"left to Inductor: {why}"
    record.compiler = "inductor"
    if cudagraphs:
        record.cudagraphs = "Inductor's own (the graph is left to Inductor whole)"
    record.seconds = time.perf_counter() - start
    _finish(record, opts)
    return compiled


def _output_count(gm: GraphModule) -> int:
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    return len(out.args[0]) if isinstance(out.args[0], (list, tuple)) else 1


def _boxed(gm: GraphModule) -> Callable:
    """The graph as a boxed callable that frees each input after its last use.

    AOTAutograd hands a graph its inputs (for the backward: every tensor saved by the forward) in one
    list. With ``make_boxed_func(gm.forward)`` that list keeps every saved activation alive until the
    whole backward has run, where eager autograd frees each as soon as its node is done: peak memory
    grew by up to 50% (ViT). The boxed code generator unpacks the list, clears it, and drops each
    value after its last use, as eager does."""
    from torch.fx.graph import _BoxedCodeGen

    try:
        gm.graph.set_codegen(_BoxedCodeGen())
        gm.recompile()
    except Exception:  # an FX without boxed codegen: correct, only the memory saving is lost
        from functorch.compile import make_boxed_func

        return make_boxed_func(gm.forward)

    def run(args: list) -> Any:
        return gm(args)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def _partitioner(opts: Options, record: GraphRecord, writes: bool = False) -> Callable:
    """AOTAutograd's partitioner (min-cut or default), after the layout search on the joint graph:
    the one place forward and backward are one graph, so layouts are chosen for both at once.
    `writes`: the graph writes one of its inputs, whose reads the min-cut partitioner then must not
    recompute in the backward, after the write (functionalize.pin_reads_of_written_inputs; the
    default partitioner recomputes nothing but views)."""
    from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition

    from .functionalize import pin_reads_of_written_inputs
    from .inductor import joint_graph_passes, uses_inductor_joint

    min_cut = opts.partitioner == "min_cut"
    split = min_cut_rematerialization_partition if min_cut else default_partition
    inductor_joint = uses_inductor_joint(opts)

    def partition(joint: GraphModule, joint_inputs: Sequence[Any], **kwargs: Any) -> Any:
        joint = rewrite_joint(joint, joint_inputs, opts, record)
        if inductor_joint:
            joint = joint_graph_passes(joint, joint_inputs)
        if min_cut and writes:
            pin_reads_of_written_inputs(joint)
        return split(joint, joint_inputs, **kwargs)

    return partition


# torch.compile's modes (HF's CompileConfig passes mode="reduce-overhead" for generation). dmfx's meaning
# of each: "max-autotune" and "max-autotune-no-cudagraphs" time dmfx's choices (option tune) and let
# Inductor autotune its kernels (max_autotune); "reduce-overhead" captures CUDA graphs (option
# cudagraphs: dmfx/inductor.py).
MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def _apply_mode(opts: Options, mode: str | None) -> Options:
    if mode in ("max-autotune", "max-autotune-no-cudagraphs"):
        return replace(opts, tune=True, max_autotune=True)
    if mode == "reduce-overhead":
        return replace(opts, cudagraphs=True)
    return opts


def _cudagraphs_why_not(opts: Options, devices: tuple[str, ...]) -> str | None:
    """Why option cudagraphs does not apply to a graph on `devices` (None: it does)."""
    if "cuda" not in devices:
        return "no CUDA tensors in this graph (CUDA graphs capture CUDA work only)"
    if opts.compiler != "inductor":
        return "compiler='fx' (CUDA graphs are captured by Inductor's CUDA-graph trees)"
    return None


def _lower_and_rewrite(gm: GraphModule, example_inputs: Sequence[Any], opts: Options, off: set[str],
                       record: GraphRecord, start: float, key: str | None, capture: bool = False,
                       whole_key: str | None = None, self_check_pending: bool = False) -> Any:
    """The Dynamo graph lowered and rewritten: ``(rewritten, padding hint, kept)``, kept under `key` (the
    compile cache's lowered graph, dmfx/graph_cache.py; `kept` is the graph as the cache holds it, or
    None) when it has one; or, for a graph dmfx leaves to PyTorch or to Inductor whole, the compiled
    callable itself (the decision to leave it to Inductor kept under `key`, or under `whole_key`
    where only that decision may be kept: graph_cache.whole_graph_key). `self_check_pending`: the
    kernels' self-check was deferred and its verdict is not known (_compile_graph): it runs before
    the graph is rewritten (_run_deferred_self_check)."""
    from . import graph_cache

    try:
        aten_gm = lower_to_aten(gm, example_inputs, opts, record)
    except Exception as e:  # metadata mutations, grad-mode regions in training, list inputs, ...
        if not _may_fall_back(e, opts):
            raise
        why = f"could not lower to a functional ATen graph: {type(e).__name__}: {_first_line(e, 200)}"
        return _left_to_pytorch(gm, example_inputs, why, record, opts, start, capture, key or whole_key)
    record.aten_ops_before = _count_ops(aten_gm)
    hint = None if opts.unpad else _padding_hint(aten_gm, record, gm)
    if opts.compiler == "inductor" and opts.fuse == "auto" and not opts.unpad:
        from .functionalize import attach_epilogue, inductor_write_hazard
        from .inductor import auto_decision

        why, scope = auto_decision(aten_gm, record.devices, record.training)
        epilogue = aten_gm.meta.get("dmfx_epilogue")
        grads = input_requires_grad(example_inputs) if record.training else None
        if why and epilogue is not None and inductor_write_hazard(attach_epilogue(aten_gm, epilogue), grads):
            why = None  # (Inductor alone would miscompile its writes: dmfx compiles it, as FX: _compile_graph)
        if scope is not None and self_check_pending:  # (the kernels' verdict unknown: not built here)
            why, scope = scope.why_unbuilt(), None
        try:
            compiled = _whole_graph_to_inductor(gm, example_inputs, why, record, opts, start, capture) if why else None
        except Exception as e:
            if (key or whole_key) and _dynamo_signal(e):  # (Dynamo traces again; the next process meets this
                graph_cache.save_lowered(key or whole_key, record, None, hint, whole_graph=why)  # graph again)
            raise
        if compiled is not None:
            if key or whole_key:
                graph_cache.save_lowered(key or whole_key, record, None, hint, whole_graph=why)
            return _with_padding_hint(compiled, hint, record)
        if scope is not None:
            opts = scope.options(opts)
            record.scope_skip = scope.skipped()
            record.missed.append(scope.why())
    if self_check_pending:
        _run_deferred_self_check(example_inputs, opts)
    if off:
        record.missed.append(
            f"kernel self-check: a kernel family failed on this device, so its passes are skipped: {', '.join(sorted(off))}"
        )
    _specialize_norm_eps(gm, aten_gm, record, opts.skip)
    rewritten = rewrite(aten_gm, example_inputs, opts, record)
    record.aten_ops_after = _count_ops(rewritten)
    rewritten = with_epilogue(rewritten, aten_gm, record)
    kept = None
    if key and not record.fallback:
        from .observability import saved_bytes

        record.bytes_saved = saved_bytes(rewritten)
        kept = graph_cache.save_lowered(key, record, rewritten, hint)
    return rewritten, hint, kept


def dmfx_backend(gm: GraphModule, example_inputs: Sequence[Any], options: dict | None = None, mode: str | None = None,
                 **kwargs: Any) -> Callable:
    """``torch.compile(model, backend="dmfx", options={...})`` lands here once per Dynamo graph."""
    if kwargs:
        raise ValueError(f"dmfx: unexpected arguments {sorted(kwargs)}; pass settings as options={{...}}")
    if mode not in MODES:
        raise ValueError(f"dmfx: unknown mode {mode!r}; torch.compile's modes are {', '.join(map(repr, MODES[1:]))}")
    opts = _apply_mode(Options.from_user(options), mode)
    record = GraphRecord(graph_id=next(_graph_ids), devices=_devices(example_inputs))
    record.training = torch.is_grad_enabled() and any(input_requires_grad(example_inputs))
    if opts.disable:
        record.fallback = "rewriting disabled (option 'disable' or DMFX_DISABLE)"
        _finish(record, opts)
        return gm.forward

    start = time.perf_counter()
    # A CPU or CUDA graph dmfx may leave to Inductor whole needs none of dmfx's kernels: their self-check (and
    # so their build, on a new machine) waits until the graph turns out to be rewritten after all.
    defer = opts.compiler == "inductor" and opts.fuse == "auto" and not opts.unpad and record.devices in (("cpu",), ("cuda",))
    try:
        return _compile_graph(gm, example_inputs, opts, record, start, defer_self_check=defer)
    except _KernelsNeeded:
        record = GraphRecord(graph_id=record.graph_id, devices=record.devices, training=record.training)
        return _compile_graph(gm, example_inputs, opts, record, start, defer_self_check=False)


class _KernelsNeeded(Exception):
    """A graph compiled with its kernels' self-check deferred (_compile_graph) is rewritten by dmfx
    after all, and the check switched off a family whose passes its options do not skip: it is
    compiled again, under those options (its keys and tag name them)."""


def _run_deferred_self_check(example_inputs: Sequence[Any], opts: Options) -> None:
    """The kernels' self-check a graph's compile deferred (building the kernels where needed), now
    that the graph is to be rewritten; _KernelsNeeded where it switched off a family `opts` does not
    skip (where none, the usual case, the compile goes on: its keys are those of a known verdict)."""
    from .cuda_ops.selfcheck import passes_to_skip

    if passes_to_skip(t.device for t in example_inputs if isinstance(t, torch.Tensor)) - set(opts.skip):
        raise _KernelsNeeded


def _left_to_pytorch(gm: GraphModule, example_inputs: Sequence[Any], why: str, record: GraphRecord, opts: Options,
                     start: float, capture: bool, keep: str | None = None, hint: Any = None) -> Callable:
    """A graph dmfx cannot compile (`why`), under option fallback: under compiler="inductor" it is
    still Inductor's to compile whole (the user chose a compiler: the graph must not run slower than
    under Inductor because dmfx met it); else, or where Inductor fails too, it runs as Dynamo gave it.
    The log says so. Where Inductor took it and `keep` (a compile-cache key) is given, that decision is
    kept under it, with the padding `hint`: a later process goes to Inductor at once instead of meeting
    the same failure first (a stale entry costs speed, never an answer)."""
    from . import graph_cache
    from .cuda_ops.build import warn

    compiled = _whole_graph_to_inductor(gm, example_inputs, why, record, opts, start, capture) \
        if opts.compiler == "inductor" else None
    if compiled is not None:
        if keep:
            graph_cache.save_lowered(keep, record, None, hint, whole_graph=why)
        warn("dmfx: %s", record.summary())
        return compiled
    record.fallback = why
    if capture:
        record.cudagraphs = "not applied: the graph runs as Dynamo gave it"
    warn("dmfx: %s", record.summary())
    _finish(record, opts)
    return gm.forward


def _compile_graph(gm: GraphModule, example_inputs: Sequence[Any], opts: Options, record: GraphRecord, start: float,
                   defer_self_check: bool) -> Callable:
    """dmfx_backend's compile of one graph. With `defer_self_check`, the kernel families the
    self-check switched off are those known without building dmfx's kernels (selfcheck.
    known_passes_to_skip); where not known, the compile goes on as if none were, and the check runs
    only where the graph is rewritten after all (_run_deferred_self_check)."""
    from . import graph_cache
    from .cuda_ops.selfcheck import known_passes_to_skip, passes_to_skip  # families that failed their self-check

    devices = [t.device for t in example_inputs if isinstance(t, torch.Tensor)]
    off = known_passes_to_skip(devices) if defer_self_check else None
    self_check_pending = defer_self_check and off is None
    if off is None:
        off = set() if self_check_pending else passes_to_skip(devices)
    off -= set(opts.skip)
    if off:
        opts = replace(opts, skip=(*opts.skip, *sorted(off)))
    decision_opts = opts  # (the options the decision to leave the graph to Inductor whole is kept under)
    floats = graph_cache.FloatInputs(gm, example_inputs, opts)
    write_only = False  # (AOTAutograd's cache written, not read: below)
    record.float_inputs = tuple(floats.names)
    if record.float_inputs:
        record._floats = floats
        record.float_verdict = floats.verdict
        if not floats.cached:
            # dmfx's own cache is off (the lowered graph may hold a value); AOTAutograd's and Inductor's
            # are written, not read, while the verdict is not known yet (graph_cache.caches_off)
            opts = replace(opts, cache=False)
            write_only = (bool(floats.key) and not floats.verdict and graph_cache.enabled(decision_opts)
                          and graph_cache.caches_write_only())
            why = ("a compile of it read their values" if floats.verdict == "specializes" else
                   "no earlier compile of it was seen not to read their values" if floats.key else
                   "their values cannot be told apart from the graph")
            kept = ("what its compile makes before reading a value is kept for the next process" if write_only else
                    "nothing of it is kept")
            record.missed.append(f"cache: not cached: the graph takes the Python float(s) {', '.join(record.float_inputs)} "
                                 f"as inputs, and {why}; {kept} (graph_cache.FloatInputs, caches_off)")
    capture = False  # option cudagraphs, on a CUDA graph Inductor runs: not cached (see below)
    if opts.cudagraphs:
        why_not = _cudagraphs_why_not(opts, record.devices)
        capture = why_not is None
        if why_not:
            record.cudagraphs = f"not applied: {why_not}"
            _log_once(f"cudagraphs:{why_not}", "dmfx: CUDA graphs (mode='reduce-overhead') not applied: %s", why_not)
    # The lowered graph is kept under `key`; where it may not be (symbolic shapes, or Python float
    # inputs that keep the caches off) only the decision to leave the graph to Inductor whole is, under
    # `whole_key`: that decision holds nothing the lowering computed, so a stale one costs speed, never
    # an answer (graph_cache.whole_graph_key).
    key = whole_key = None
    if graph_cache.enabled(decision_opts) and not capture:
        key = graph_cache.lowered_key(gm, example_inputs, opts) if graph_cache.enabled(opts) else None
        if key is None:  # (where the caches are on, opts is decision_opts: lowered_key said None already)
            whole_key = graph_cache.whole_graph_key(gm, example_inputs, decision_opts)
            if whole_key is None and not graph_cache.enabled(opts):
                whole_key = graph_cache.lowered_key(gm, example_inputs, decision_opts)
    entry = graph_cache.load_lowered(key or whole_key) if key or whole_key else None
    if entry is not None and whole_key and entry["whole_graph"] is None:
        entry = None  # (under whole_key only the decision to leave the graph to Inductor is kept)
    if entry is not None and not self_check_pending:
        from .inductor import left_for_unbuilt_kernels

        if left_for_unbuilt_kernels(entry["whole_graph"]):
            entry = None  # (left whole only because dmfx's kernels were not built then: they are now)
    own = [m for m in record.missed if m.startswith("cache:")]  # (this compile's, not the entry's)
    if entry is not None:
        for f, value in entry["record"].items():
            setattr(record, f, value)
        record.missed = [*own, *record.missed]
        record.lowered_from_cache = True
    if entry is not None and entry["whole_graph"] is not None:  # left to Inductor whole before: its cache has it
        compiled = _whole_graph_to_inductor(gm, example_inputs, entry["whole_graph"], record, opts, start, capture)
        if compiled is not None:
            return _with_padding_hint(compiled, entry["hint"], record)
        entry, record = None, replace(record, fired={}, replaced={}, missed=own, copies=[], attention_forms={}, unpad={},
                                      epilogue=[], lowered_from_cache=False, scope_skip=())  # (lowered afresh below)
    if entry is not None:
        if self_check_pending:
            _run_deferred_self_check(example_inputs, opts)
        rewritten = kept = entry["graph"]
        hint = entry["hint"]
    else:
        lowered = _lower_and_rewrite(gm, example_inputs, opts, off, record, start, key, capture, whole_key,
                                     self_check_pending)
        if not isinstance(lowered, tuple):  # (compiled already: left to PyTorch or to Inductor whole)
            return lowered
        rewritten, hint, kept = lowered
    if record.scope_skip:  # (fresh or read back from the compile cache: the joint and backward passes skip them too)
        from .inductor import skipping

        opts = skipping(opts, record.scope_skip)
    # AOTAutograd traces the graph as the cache keeps it, so that its own cache key is the same on a
    # later hit of the lowered graph; `rewritten`, with the passes' node metadata, names what each
    # fused node absorbed (carry_absorbed)
    traced = kept if kept is not None else rewritten

    from torch._dynamo.backends.common import aot_autograd

    from .functionalize import inductor_write_hazard, written_inputs

    grads = input_requires_grad(example_inputs) if record.training else None
    writes = bool(written_inputs(traced))
    hazard = inductor_write_hazard(traced, grads) if opts.compiler == "inductor" and writes else None
    if hazard:  # (Inductor would miscompile the graph's writes into its inputs: compiled as FX)
        if capture:
            record.cudagraphs = "not applied: the graph is compiled as FX (Inductor miscompiles its input writes)"
        opts, write_only, capture = replace(opts, compiler="fx", cudagraphs=False), False, False
        record.missed.append(f"compiled as FX, not by Inductor: {hazard}, which Inductor miscompiles "
                             "(functionalize.inductor_write_hazard)")
        _log_once(f"write-hazard:{record.graph_id}", "dmfx: graph %d is compiled as FX, not by Inductor: %s",
                  record.graph_id, hazard)
    from .inductor import decompositions, uses_inductor_joint

    record.compiler = opts.compiler
    cudagraphs = None
    if capture and not record.fallback:
        from .inductor import CudaGraphs, capture_blocker

        blocker = capture_blocker(traced)
        if blocker:
            capture = False
            record.cudagraphs = f"not applied: {blocker}"
            _log_once(f"cudagraphs-blocked:{record.graph_id}", "dmfx: graph %d: CUDA graphs not applied: %s",
                      record.graph_id, blocker)
        else:
            cudagraphs = CudaGraphs.new(gm, traced)
    cache = None
    wrap: Callable[[Callable], Callable] = lambda fn: fn  # noqa: E731
    # Inductor's FX graph cache keys what it compiles by dmfx's fingerprint and options even where
    # AOTAutograd's cache is off (option cache=False, Python float inputs: graph_cache.caches_off),
    # under the options the caches-on compile has, so that the entries one keeps are the other's.
    dmfx_tag = graph_cache.tag(decision_opts, traced) if opts.compiler == "inductor" else None
    # (a captured graph is not cached: AOTAutograd's cache would load it with PyTorch's CUDA-graph
    # settings, not with the state dmfx hands Inductor)
    if (graph_cache.enabled(opts) or write_only) and not record.fallback and not capture:
        assert dmfx_tag is not None
        cache = (dmfx_tag, graph_cache.record_key(dmfx_tag, traced, example_inputs))
        wrap = graph_cache.serializable
    compiler = aot_autograd(
        fw_compiler=wrap(_compiler("forward", record, opts, rewritten, cache, cudagraphs, dmfx_tag)),
        bw_compiler=wrap(_compiler("backward", record, opts, rewritten, cache, cudagraphs, dmfx_tag)),
        inference_compiler=wrap(_compiler("inference", record, opts, rewritten, cache, cudagraphs, dmfx_tag)),
        partition_fn=_partitioner(opts, record, writes),
        decompositions=decompositions() if uses_inductor_joint(opts) else {},
        keep_inference_input_mutations=True,
    )
    try:
        with graph_cache.tagged(dmfx_tag), record.caches_off():
            compiled = compiler(traced, example_inputs)
    except Exception as e:  # (AOTAutograd's trace of the joint, the joint passes, or the forward's compile failed)
        if not _may_fall_back(e, opts):
            raise
        why = f"AOTAutograd could not compile the rewritten graph: {type(e).__name__}: {_first_line(e, 200)}"
        # (nothing of the rewrite runs: the record keeps only what the graph is and what was missed)
        record.fired, record.replaced, record.compiled, record.copies, record.attention_forms = {}, {}, {}, [], {}
        # a graph that writes its inputs runs as Dynamo gave it: whether Inductor would miscompile its
        # writes was judged on the rewritten graph only (inductor_write_hazard)
        left = replace(opts, cache=False, compiler="fx" if writes else opts.compiler)
        record.unpad, record.scope_skip, record.compiler, record.bytes_saved = {}, (), left.compiler, None
        record.aten_ops_after = record.aten_ops_before
        return _left_to_pytorch(gm, example_inputs, why, record, left, start, capture, key or whole_key, hint)
    if cache is not None:
        if "forward" in record.compiled or "inference" in record.compiled:
            record.cache = "miss"
        else:  # AOTAutograd's cache held the compiled graphs: none of dmfx's compilers ran
            record.cache = "hit"
            record.rewritten_graph = rewritten
            if not graph_cache.load_record(cache[1], record):
                record.missed.append("cache: the compiled graphs came from the cache, without the record of "
                                     "what the joint and backward passes did")
    record.seconds = time.perf_counter() - start
    _finish(record, opts)
    if record.unpad.get("option"):  # (unpadded: the first batch's padding share is recorded)
        from .passes.unpad import PaddingHint

        record.unpad["mask"] = input_name(gm, record.unpad["input_index"])
        hint = PaddingHint(record.unpad["input_index"], record.unpad["mask"], record.unpad["attentions"])
    return _with_padding_hint(compiled, hint, record)


def input_name(gm: GraphModule, index: int) -> str:
    """The name of the Dynamo graph `gm`'s input number `index` (Dynamo's: ``L_attention_mask_`` for
    the argument attention_mask)."""
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return inputs[index].name if index < len(inputs) else f"input {index}"


#: The share of padding in a batch from which the log suggests options={"unpad": True}.
PADDING_HINT_SHARE = 0.2


def _padding_hint(aten_gm: GraphModule, record: GraphRecord, gm: GraphModule) -> Any:
    """passes/unpad.py's padding_hint for a graph compiled without the option, the mask named as the
    Dynamo graph names it (None on any error: observability never breaks a compile)."""
    try:
        from .passes.unpad import padding_hint

        hint = padding_hint(aten_gm)
        if hint is not None:
            hint = replace(hint, input_name=input_name(gm, hint.input_index))
    except Exception as e:  # noqa: BLE001
        log.debug("dmfx: graph %d: no padding hint (%s: %s)", record.graph_id, type(e).__name__, e)
        return None
    if hint is not None:
        record.unpad = {"option": False, "mask": hint.input_name, "attentions": hint.attentions}
    return hint


def _with_padding_hint(compiled: Callable, hint: Any, record: GraphRecord) -> Callable:
    """`compiled`, which at its first call looks at the padding mask input named by `hint` and, where
    the batch is at least PADDING_HINT_SHARE padding, says once at INFO what options={"unpad": True}
    would skip. Without a hint: `compiled` itself."""
    if hint is None:
        return compiled
    state = {"looked": False}

    def run(*args: Any) -> Any:
        if not state["looked"]:
            state["looked"] = True
            boxed = len(args) == 1 and isinstance(args[0], list)  # (called with the inputs in one list)
            _say_padding(args[0] if boxed else args, hint, record)
        return compiled(*args)

    if getattr(compiled, "_boxed_call", False):
        run._boxed_call = True  # type: ignore[attr-defined]
    return run


def _say_padding(args: Sequence[Any], hint: Any, record: GraphRecord) -> None:
    try:
        mask = args[hint.input_index]
        share = 1.0 - float((mask != 0).sum()) / max(mask.numel(), 1)
    except Exception:  # noqa: BLE001
        return
    record.unpad["padding"] = round(share, 4)
    if share >= PADDING_HINT_SHARE and not record.unpad.get("option"):
        _log_once(f"unpad-hint:{record.graph_id}", "dmfx: graph %d: this batch is %.0f%% padding (input %s, read by %d "
                  "attention(s)); options={'unpad': True} would run its row-wise ops and attention on the real tokens "
                  "alone (padding positions then read zeros in the outputs: README, Padded batches)", record.graph_id,
                  100 * share, hint.input_name, hint.attentions)


def _finish(record: GraphRecord, opts: Options) -> None:
    """Keep `record` (dmfx.records()) and log it: the INFO line and DEBUG JSON through the dmfx logger,
    and a TORCH_TRACE artifact. Only for a graph dmfx handed back to Dynamo: when Dynamo abandons a
    compile (it restarts its analysis after the backend ran, e.g. to specialize a float under
    dynamic=True) the record is dropped with it, so each compiled graph has one record."""
    if opts.record:
        _keep(record)
    emit(record)

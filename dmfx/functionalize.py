"""Lowering graphs that write their inputs or return views of them: a functional body and an epilogue.

A Dynamo graph may update a tensor it is given (a static KV cache's ``index_copy_``, BatchNorm's
running statistics, ``copy_`` into an input) or return a view of one (``x.t()``, ``cache[:, :n]``).
AOTAutograd's functionalization (the tracer behind ``aot_export_joint_simple``, which refuses both)
traces such a graph into a functional one whose outputs are the new value of each mutated input,
then the user outputs, and describes the mutations and aliases in its ``ViewAndMutationMeta``.

`functional_body` keeps that graph as the **body** the passes rewrite: it writes nothing, so the
passes and the graph verifier see an ordinary functional graph (a fused op that wrote an input in
place would break the verifier's rule, as anywhere). `attach_epilogue` then appends, after the
rewritten body, what the body left out:

* ``aten.copy_(input, new_value)`` for each mutated input (AOTAutograd's second trace, in the backend,
  turns these back into its own input-mutation handling: kept in the inference graph, applied after
  the forward in training). In training, body nodes that may require grad read a clone of a mutated
  input instead of the input: autograd saves what they read (BatchNorm's backward saves the running
  statistics), and the write would invalidate it ("modified by an inplace operation") where eager's
  op wrote its input before autograd saved it;
* each output that is an input, or a view of one, rebuilt from that input by replaying the view ops
  the functional graph applied (AOTAutograd's ``replay_views``), so the caller gets a real alias, as
  in eager.

What cannot be lowered this way raises `UnsupportedGraph` naming the input or output and the kind of
mutation; the backend then leaves the graph to PyTorch with that reason in its record.
"""

from __future__ import annotations

import copy
import operator
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch.fx import Graph, GraphModule, Node

aten = torch.ops.aten


class UnsupportedGraph(RuntimeError):
    """The graph cannot be lowered to a functional body and an epilogue (the message says why)."""


@dataclass(frozen=True)
class AliasedOutput:
    """A user output that is input `base` (`chain` empty) or a view of it: the view ops the functional
    graph applied, first to last, as ``(target, args after the viewed tensor, kwargs)`` with the body's
    nodes named by name (the body the epilogue is attached to is a rewritten copy)."""

    base: int
    chain: tuple[tuple[Any, tuple, dict], ...]


@dataclass(frozen=True)
class Epilogue:
    """What the functional body leaves to the end of the graph.

    The body returns ``(*new values of `mutated`, *user outputs)``; `outputs` says, per user output,
    whether the body's value is returned (None) or the output is rebuilt from an input (an
    `AliasedOutput`)."""

    mutated: tuple[int, ...]  # input index of each leading body output
    outputs: tuple[AliasedOutput | None, ...]
    input_names: tuple[str, ...]  # the Dynamo graph's placeholder names (for messages and records)
    # per input, whether it requires grad; None: no backward will be derived (inference)
    input_requires_grad: tuple[bool, ...] | None = None

    @property
    def empty(self) -> bool:
        return not self.mutated and all(o is None for o in self.outputs)

    def describe(self) -> list[str]:
        """One line per mutation and per aliased output, for the graph's record."""
        lines = [f"writes input {self.input_names[i]} in place (copy_ after the graph)" for i in self.mutated]
        for k, out in enumerate(self.outputs):
            if out is not None:
                what = "is" if not out.chain else "is a view of"
                lines.append(f"output {k} {what} input {self.input_names[out.base]}")
        return lines


def functional_body(gm: Callable, example_inputs: Sequence[Any], training: bool) -> tuple[GraphModule, Epilogue]:
    """The Dynamo graph `gm` (or any function of tensors) traced by AOTAutograd's functionalization (no decompositions, under
    no_grad: an inference graph with the same inputs), and the epilogue that makes it `gm` again.
    `training`: a backward will be derived from the result (then a grad-mode region inside the graph,
    or a mutated input that requires grad, cannot be kept and raises)."""
    from torch._functorch.aot_autograd import _aot_export_function

    lists = [i for i, a in enumerate(example_inputs) if isinstance(a, (list, tuple))]
    if lists:  # (the trace would say so too, after tracing the whole graph: _check_flat)
        raise UnsupportedGraph(f"the graph takes lists as inputs ({len(lists)} of {len(example_inputs)}), as compiled "
                               "autograd's backward graph does; dmfx lowers graphs of flat inputs (its backward "
                               "fusions run on the backward AOTAutograd derives)")
    if isinstance(gm, GraphModule):
        names = tuple(n.name for n in gm.graph.nodes if n.op == "placeholder")
        written = written_attributes(gm)
        if written:
            more = f" and {len(written) - 1} more" if len(written) > 1 else ""
            raise UnsupportedGraph(
                "the graph writes tensors it holds as attributes, not inputs (as a compiled optimizer.step() writes "
                f"its state); dmfx lowers writes into inputs only: {written[0]}{more}")
        if training:
            gm = _without_no_grad_regions(gm)
    else:  # a function (the pass tests lower plain functions)
        names = tuple(f"input {i}" for i in range(len(example_inputs)))
    try:
        with torch.no_grad():
            body, meta, in_spec, out_spec = _aot_export_function(gm, tuple(example_inputs), trace_joint=False)
    except RuntimeError as e:
        shared = _sharing_storage(example_inputs, names)
        if "aliased inputs that are mutated" in str(e) and shared:
            raise UnsupportedGraph(f"inputs {shared[0]} and {shared[1]} share storage and the graph writes one of "
                                   "them in place (AOTAutograd's functionalization refuses such inputs)") from e
        raise
    _check_flat(in_spec.children()[0], out_spec)
    if getattr(meta, "tokens", None):
        raise UnsupportedGraph("the graph calls ops with side effects (effect tokens)")
    mutated = _mutated_inputs(meta, names)
    n_user = len(meta.output_info)
    _keep_outputs(body, len(mutated) + n_user)  # (drops AOTAutograd's intermediate bases: autograd only)
    outputs = _output_nodes(body)
    new_values = dict(zip(mutated, outputs[:len(mutated)]))
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    aliased = tuple(
        _aliased_output(k, info, outputs[len(mutated) + k], placeholders, new_values, names)
        for k, info in enumerate(meta.output_info)
    )
    requires_grad = tuple(isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs) if training else None
    if training:
        differentiable_copies(body, requires_grad)
    epilogue = Epilogue(tuple(mutated), aliased, names, requires_grad)
    attach_epilogue(body, epilogue)  # raises here, not after the passes, if a view cannot be replayed
    return body, epilogue


#: Python's item write and augmented assignments (operator's functions, and the methods): in place on a tensor.
_WRITING_OPERATORS = ("setitem", "iadd", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow", "imatmul", "iand",
                      "ior", "ixor", "ilshift", "irshift")
_WRITING_DUNDERS = frozenset((*_WRITING_OPERATORS, *(f"__{op}__" for op in _WRITING_OPERATORS)))


def written_attributes(gm: GraphModule) -> list[str]:
    """The tensors `gm` holds as attributes (``get_attr`` nodes, not inputs) that an in-place op of the
    graph writes (a method or function whose name ends in one ``_``, ``x[i] = v``, ``x += y``), as Dynamo gives
    the graph of a compiled ``optimizer.step()``: the parameters and the optimizer's state are the
    graph's attributes, written by ``_foreach_*_`` ops. An ATen ``OpOverload`` (an ATen-level graph)
    is read by its schema instead: the arguments it marks as written (``out=`` among them). AOTAutograd's
    functionalization (the lowering) sees the attributes as constants and cannot write them."""
    from .passes.graph_utils import held_attribute

    attrs = {n for n in gm.graph.nodes if n.op == "get_attr" and isinstance(held_attribute(gm, n.target), torch.Tensor)}
    written: list[str] = []

    def write_to(value: Any) -> None:  # (a tensor or a list of them: the attributes among them are written)
        for t in value if isinstance(value, (list, tuple)) else (value,):
            if t in attrs and t.target not in written:
                written.append(t.target)

    for n in gm.graph.nodes if attrs else ():
        if n.op not in ("call_function", "call_method"):
            continue
        if isinstance(n.target, torch._ops.OpOverload):  # (an ATen-level graph: the schema says what it writes)
            for i, arg in enumerate(n.target._schema.arguments):
                if arg.alias_info is not None and arg.alias_info.is_write:
                    write_to(n.args[i] if i < len(n.args) else n.kwargs.get(arg.name))
            continue
        if not n.args:
            continue
        if n.op == "call_method":
            name = n.target
        else:
            name = getattr(n.target, "__name__", "")
            if name in _WRITING_OPERATORS and getattr(operator, name, None) is not n.target:
                continue  # (a function of another module that happens to share the name)
        if not isinstance(name, str) or not (name in _WRITING_DUNDERS or (name.endswith("_") and not name.endswith("__"))):
            continue
        write_to(n.args[0])
    return written


def differentiable_copies(gm: GraphModule, input_requires_grad: Sequence[bool]) -> int:
    """Writes into a buffer the graph made (``k = x.new_empty(...); k[..., :d] = a; k[..., d:] = b``:
    DeepSeek V3's keys) are functionalized into ``aten.copy(slice of k, a)`` and ``slice_scatter``.
    ``aten.copy`` has no derivative formula (autograd differentiates ``copy_``), so tracing the
    backward of a training graph from such a body fails ("derivative for aten::copy is not
    implemented") where the copied value or the destination may require grad. Each such copy
    becomes what it computes: the value expanded to the destination's shape, cast to its dtype and
    device (``_to_copy``: a new tensor, as ``copy`` returns one; the destination's gradient is zero,
    as it is through ``copy_``). Its strides may differ from the destination's: views after it become
    reshapes. This covers the functional form of ``x.copy_(v)`` into an input too; the write analysis
    below follows ``_to_copy`` to v as it followed ``copy(x, v)``, and only reinplace_input_writes
    (inference graphs, which this never touches) reads the ``copy`` form. Returns how many were
    replaced."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    from .passes.graph_utils import PassContext, grad_dependent_nodes, refresh_val, views_to_reshapes

    needs_grad = grad_dependent_nodes(gm.graph, input_requires_grad)
    ctx, done = PassContext(), []
    for n in list(gm.graph.nodes):
        if n.target is not aten.copy.default or (n.args[0] not in needs_grad and n.args[1] not in needs_grad):
            continue
        dst, src = n.args[0].meta.get("val"), n.args[1].meta.get("val")
        if not isinstance(dst, torch.Tensor) or not isinstance(src, torch.Tensor):
            continue
        with gm.graph.inserting_before(n):
            value = n.args[1]
            if src.dim() != dst.dim() or not all(statically_known_true(a == b) for a, b in zip(src.shape, dst.shape)):
                value = gm.graph.call_function(aten.expand.default, (value, list(dst.shape)))
                refresh_val(value, ctx)
            value = gm.graph.call_function(aten._to_copy.default, (value,), {"dtype": dst.dtype, "device": dst.device})
            refresh_val(value, ctx)
        n.replace_all_uses_with(value)
        gm.graph.erase_node(n)
        done.append(value)
    if done:
        views_to_reshapes(done)
        gm.recompile()
    return len(done)


def _sharing_storage(example_inputs: Sequence[Any], names: Sequence[str]) -> tuple[str, str] | None:
    """The names of the first two tensor inputs that share storage, or None."""
    seen: dict[Any, str] = {}
    for t, name in zip(example_inputs, names):
        if isinstance(t, torch.Tensor):
            try:
                key = t.untyped_storage()._cdata
            except Exception:  # noqa: BLE001 (a tensor without storage: nothing shared)
                continue
            if key in seen:
                return seen[key], name
            seen[key] = name
    return None


def _refuse_grad_mode_changes(gm: GraphModule, why: str = "") -> None:
    """The functional body is traced under no_grad and loses ``torch.no_grad()`` / ``enable_grad()``
    regions; in training that would give gradients where eager gives none."""
    for n in gm.graph.nodes:
        if _sets_grad_mode(n):
            raise UnsupportedGraph(f"the graph changes grad mode inside it ({n.name}: a torch.no_grad() or "
                                   f"enable_grad() region{why}) and trains; dmfx's lowering would lose the region")


def _sets_grad_mode(n: Node) -> bool:
    """Whether `n` is a Dynamo graph's ``torch.no_grad()`` / ``enable_grad()`` boundary."""
    return n.op == "call_function" and n.target is torch._C._set_grad_enabled


def _is_grad_mode(n: Node, enabled: bool) -> bool:
    return _sets_grad_mode(n) and n.args == (enabled,)


def _requires_grad(n: Any) -> bool | None:
    """Whether the Dynamo graph's value `n` requires grad (its example value says); None: unknown."""
    if not isinstance(n, Node):
        return False
    v = n.meta.get("example_value")
    if isinstance(v, torch.Tensor):
        return v.requires_grad
    if isinstance(v, (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool, torch.Size)):
        return False
    return None


_INPLACE_OPERATORS = {"iadd", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow", "iand", "ior", "ixor", "ilshift",
                      "irshift", "imatmul", "setitem"}


def _without_no_grad_regions(gm: GraphModule) -> GraphModule:
    """`gm` with each ``torch.no_grad()`` region of a training graph made explicit: the values from
    outside the region that require grad are ``detach``ed where the region reads them, and the
    ``_set_grad_enabled`` calls are dropped. Nothing inside then records a gradient, as under no_grad
    (HF's rotary embeddings of transformers 4.x and early 5.x compute cos/sin under ``@torch.no_grad()``:
    without this, a LLaMA training graph could not be rewritten at all). A copy; `gm` itself unchanged.
    Raises UnsupportedGraph (the graph is left to PyTorch) for regions whose meaning this would not
    keep: an ``enable_grad()`` region, a module call or an in-place op inside the region, a region not
    closed in the graph, or a value whose grad requirement is unknown."""
    nodes = list(gm.graph.nodes)
    if not any(_sets_grad_mode(n) for n in nodes):
        return gm
    inside, regions, start = False, [], None
    for i, n in enumerate(nodes):
        if _is_grad_mode(n, False) and not inside:
            inside, start = True, i
        elif _is_grad_mode(n, True) and inside:
            inside = False
            regions.append((start, i))
        elif _sets_grad_mode(n):
            _refuse_grad_mode_changes(gm, ": not a no_grad() region this graph closes")
    if inside:
        _refuse_grad_mode_changes(gm, ": not closed in the graph")
    gm = copy.deepcopy(gm)
    nodes = list(gm.graph.nodes)
    for start, end in regions:
        body = nodes[start + 1:end]
        members = set(body)
        detached: dict[Node, Node] = {}  # (one detach per value the region reads, however many readers)
        for n in body:
            name = str(getattr(n.target, "__name__", n.target))
            in_place = (name.endswith("_") and not name.startswith("_") or name in _INPLACE_OPERATORS or "out" in n.kwargs
                        or isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable)
            if n.op == "call_module" or n.op in ("call_method", "call_function") and in_place:
                _refuse_grad_mode_changes(gm, f": it calls {n.name}, a module or an in-place op")
            for a in n.all_input_nodes:
                if a in members:
                    continue
                rg = _requires_grad(a)
                if rg is None:
                    _refuse_grad_mode_changes(gm, f": whether {a.name} requires grad is unknown")
                if rg:
                    if a not in detached:
                        with gm.graph.inserting_before(nodes[start]):
                            detached[a] = gm.graph.call_method("detach", (a,))
                        detached[a].meta = {**a.meta, "example_value": a.meta["example_value"].detach()}
                    n.replace_input_with(a, detached[a])
        gm.graph.erase_node(nodes[end])
        gm.graph.erase_node(nodes[start])
    gm.graph.lint()
    gm.recompile()
    return gm


def _check_flat(in_spec: Any, out_spec: Any) -> None:
    """Dynamo graphs take and return flat tuples of tensors and scalars (as aot_export_joint_simple asks)."""
    if in_spec.is_leaf() or not all(c.is_leaf() for c in in_spec.children()):
        raise UnsupportedGraph(f"the graph's inputs are not a flat list ({in_spec})")
    if out_spec is None or out_spec.is_leaf() or not all(c.is_leaf() for c in out_spec.children()):
        raise UnsupportedGraph(f"the graph's outputs are not a flat tuple ({out_spec})")


def _mutated_inputs(meta: Any, names: Sequence[str]) -> list[int]:
    """The inputs whose data the graph writes, in the order of the functional graph's leading outputs;
    raises on a mutation the epilogue cannot apply."""
    mutated = []
    for i, info in enumerate(meta.input_info):
        if not (info.mutates_data or info.mutates_metadata):
            continue
        if info.mutates_metadata or info.mutates_storage_metadata or info.mutation_inductor_storage_resize:
            raise UnsupportedGraph(f"input {names[i]} has its metadata or storage changed in place "
                                   "(t_, transpose_, resize_, as_strided_, set_ or a storage resize)")
        mutated.append(i)
    if list(getattr(meta, "mutated_inp_runtime_indices", mutated)) != mutated:
        raise UnsupportedGraph(f"AOTAutograd reports mutated inputs {meta.mutated_inp_runtime_indices}, "
                               f"dmfx expected {mutated}")
    return mutated


def _output_nodes(gm: GraphModule) -> list[Any]:
    return list(_output(gm).args[0])


def _output(gm: GraphModule) -> Node:
    return next(n for n in reversed(gm.graph.nodes) if n.op == "output")


def _keep_outputs(gm: GraphModule, count: int) -> None:
    """Return only the first `count` outputs of `gm`."""
    out = _output(gm)
    if len(out.args[0]) != count:
        out.args = (tuple(out.args[0][:count]),)
        gm.graph.eliminate_dead_code()
        gm.recompile()


def _aliased_output(k: int, info: Any, node: Any, placeholders: list[Node], new_values: dict[int, Any],
                    names: Sequence[str]) -> AliasedOutput | None:
    """How user output `k` (AOTAutograd's OutputAliasInfo `info`, the functional graph's `node`) is
    rebuilt after the graph: None when the body's value is returned as it is."""
    from torch._functorch._aot_autograd.schemas import OutputType

    kind = info.output_type
    if kind == OutputType.is_input:
        return AliasedOutput(info.base_idx, ())
    if kind == OutputType.alias_of_input:
        base = info.base_idx
        root, chain = _view_chain(node)
        if root is placeholders[base] or root is new_values.get(base):
            return AliasedOutput(base, tuple((n.target, tuple(n.args[1:]), dict(n.kwargs)) for n in chain))
        raise UnsupportedGraph(f"output {k} is a view of input {names[base]} that dmfx cannot replay "
                               f"(its view ops lead to {getattr(root, 'name', root)})")
    if kind == OutputType.custom_function_view:
        raise UnsupportedGraph(f"output {k} is a view made by a custom autograd.Function")
    return None  # a fresh tensor, or a view of an intermediate (the body returns that view itself)


def _view_chain(node: Any) -> tuple[Any, list[Node]]:
    """The tensor `node` is a view of through view ops (and getitems of multi-output views such as
    split), and those ops, first to last."""
    chain = []
    while isinstance(node, Node) and node.op == "call_function" and (_is_view(node) or _is_view_item(node)):
        chain.append(node)
        node = node.args[0]
    return node, chain[::-1]


def _is_view(n: Node) -> bool:
    return isinstance(n.target, torch._ops.OpOverload) and n.target.is_view


def _is_view_item(n: Node) -> bool:
    return n.target is operator.getitem and isinstance(n.args[0], Node) and _is_view(n.args[0])


def attach_epilogue(body: GraphModule, epilogue: Epilogue) -> GraphModule:
    """A new GraphModule: `body` (the functional body, maybe rewritten by the passes), then the
    epilogue's input writes, then the user outputs (aliased ones rebuilt from their inputs). `body`
    is left as it is. Raises `UnsupportedGraph` when a node a view replay needs is gone from `body`."""
    graph = Graph()
    env: dict[Node, Node] = {}
    body_outputs = graph.graph_copy(body.graph, env)
    body_outputs = list(body_outputs) if isinstance(body_outputs, (tuple, list)) else [body_outputs]
    graph._codegen = body.graph._codegen
    inputs = [env[n] for n in body.graph.nodes if n.op == "placeholder"]
    by_name = {old.name: new for old, new in env.items()}
    if epilogue.input_requires_grad is not None:
        _clone_read_for_autograd(graph, [inputs[i] for i in epilogue.mutated], epilogue.input_requires_grad)
    n_mut = len(epilogue.mutated)
    written = {inputs[i] for i in epilogue.mutated}
    values = [_unaliased(graph, v, written) for v in body_outputs[:n_mut]]
    results = [_unaliased(graph, v, set(inputs)) if out is None else None
               for v, out in zip(body_outputs[n_mut:], epilogue.outputs)]
    for i, value in zip(epilogue.mutated, values):
        if value is not inputs[i]:
            graph.call_function(aten.copy_.default, (inputs[i], value)).meta.update(_meta_of(inputs[i]))
    for k, out in enumerate(epilogue.outputs):
        if out is not None:
            results[k] = _replay(graph, inputs[out.base], out.chain, by_name, k)
    graph.output(tuple(results))
    graph.eliminate_dead_code()
    return GraphModule(body, graph)


def _clone_read_for_autograd(graph: Graph, mutated: list[Node], input_requires_grad: tuple[bool, ...]) -> None:
    """Make the body of `graph` (no epilogue yet) read a clone, made before any of it runs, of each
    `mutated` input that a node which may require grad reads, directly or through views of it
    (``h * state[:, None]``): autograd saves what such a node reads (BatchNorm's backward saves the
    running statistics), and the epilogue's write would change it under the backward, where eager's
    op wrote its input before autograd saved it. Every reader of the input is moved to the clone, so
    that a view chain leading to a grad-requiring node reads it too."""
    from .passes.graph_utils import grad_dependent_nodes

    needs_grad = grad_dependent_nodes(graph, input_requires_grad)
    last_input = [n for n in graph.nodes if n.op == "placeholder"][-1]
    for x in mutated:
        if not any(u in needs_grad for u in _readers_through_views(x)):
            continue
        with graph.inserting_after(last_input):
            clone = graph.call_function(aten.clone.default, (x,))
        clone.meta.update(_meta_of(x))
        for u in list(x.users):
            if u is not clone:
                u.replace_input_with(x, clone)


def _readers_through_views(x: Node, skip: set | frozenset = frozenset()) -> list[Node]:
    """The nodes that read `x` or a view of it and are not views themselves (their results are
    data of their own, computed when they run); `skip`'s nodes are neither listed nor followed."""
    found, frontier, seen = [], [x], {x}
    while frontier:
        for u in frontier.pop().users:
            if u in seen or u in skip:
                continue
            seen.add(u)
            if u.op == "call_function" and (_is_view(u) or _is_view_item(u) or u.target is aten._unsafe_view.default):
                frontier.append(u)
            else:
                found.append(u)
    return found


def written_inputs(gm: GraphModule) -> tuple[int, ...]:
    """The indices of `gm`'s inputs that a node of it writes (an argument its schema marks written:
    the epilogue's ``copy_``, or an in-place op left in the graph)."""
    return _written(gm.graph)


def _written(graph: Graph) -> tuple[int, ...]:
    from .passes.verify import op_writes

    placeholders = {n: i for i, n in enumerate(n for n in graph.nodes if n.op == "placeholder")}
    found = {placeholders[n.args[i]] for n in graph.nodes if n.op == "call_function"
             for i in op_writes(n.target) if i < len(n.args) and n.args[i] in placeholders}
    return tuple(sorted(found))


def pin_reads_of_written_inputs(joint: GraphModule | Graph, writes: bool = True) -> int:
    """Mark every forward node of AOTAutograd's joint graph that reads a written input (a primal the
    joint graph writes: AOTAutograd keeps the write of an input that does not require grad in the
    graph, at its end) or a view of one as MUST_SAVE, so that the min-cut partitioner saves its
    result (or something computed from it) instead of recomputing it in the backward, after the
    write. With ``h = h * (1 + 0.1 * state)`` then ``state.mul_(3)``, the backward recomputed
    ``1 + 0.1 * state`` from the new state and every gradient before it was wrong (PyTorch 2.11 and
    2.14, its own backends too; pytorch/pytorch PR 197039 proposes the same fix in the partitioner).
    Pinning bans recomputation; it does not save: a node the backward does not need stays unsaved.
    `writes`: the graph AOTAutograd traced writes an input; where the joint graph shows no written
    primal then (a PyTorch that returns the new values instead), the reads of every primal that does
    not require grad are pinned (a mutated input never requires grad here). Returns how many nodes
    were pinned."""
    from torch.utils.checkpoint import CheckpointPolicy

    from .passes.graph_utils import computed_from

    graph = joint.graph if isinstance(joint, GraphModule) else joint
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    primals = [n for n in placeholders if str(n.target).startswith("primals")]
    written = [p for p in (placeholders[i] for i in _written(graph)) if p in primals]
    if not written and writes:
        written = [p for p in primals if not getattr(p.meta.get("val"), "requires_grad", True)]
    backward = computed_from(graph, [n for n in placeholders if n not in primals])  # (what the tangents feed)
    writes_of = {n.args[0]: n for n in graph.nodes if n.op == "call_function" and n.target is aten.copy_.default}
    pinned = 0
    for p in written:
        # (the ops that make p's new value are pinned only where the backward reads one itself
        # (h * state.add_(1)): saving the written value for the backward made Inductor write the
        # input wrong; their other readers are pinned, so the backward needs none of them)
        chain = _write_chain(writes_of[p])[0] if p in writes_of else []
        read_by_backward = {c for c in chain if any(u in backward for u in _readers_through_views(c))}
        for u in {u for v in (p, *chain) for u in _readers_through_views(v)} | read_by_backward:
            if u.op == "call_function" and u not in backward and u is not writes_of.get(p) and \
                    (u not in chain or u in read_by_backward):
                u.meta["recompute"] = CheckpointPolicy.MUST_SAVE
                pinned += 1
    return pinned


def _write_chain(w: Node) -> tuple[list[Node], bool]:
    """The ops that made the value ``copy_(x, value)`` (`w`) writes into x, from the last to the first,
    following each op's first argument (a ``copy(x, v)``'s v) back towards x, and whether the chain
    reaches x (else the new value is not computed from x's old one: one write). A clone of x holds
    its old values: not a write, skipped."""
    x, node, chain = w.args[0], w.args[1], []
    while isinstance(node, Node) and node is not x and node.op == "call_function" and node.args:
        nxt = node.args[1] if node.target is aten.copy.default and node.args[0] is x else node.args[0]
        if not isinstance(nxt, Node):
            break
        if node.target is not aten.clone.default:
            chain.append(node)
        node = nxt
    return chain, node is x


def _unaliased(graph: Graph, value: Any, inputs: set[Node]) -> Any:
    """`value`, or a clone of it where it is (a view of) one of `inputs`: a value the epilogue writes
    over, or an output AOTAutograd traced as fresh. (The functional body never makes such a value; a
    pass could, by dropping a copy.) A symbolic size passed through (a cache's length under dynamic
    shapes, returned as it came in) is a number, not storage: it is returned as it is."""
    if _view_chain(value)[0] not in inputs or not isinstance(_meta_of(value).get("val"), torch.Tensor):
        return value
    node = graph.call_function(aten.clone.default, (value,))
    node.meta.update(_meta_of(value))
    return node


def _meta_of(n: Any) -> dict:
    return {"val": n.meta["val"]} if isinstance(n, Node) and "val" in n.meta else {}


def _replay(graph: Graph, base: Node, chain: tuple, by_name: dict[str, Node], k: int) -> Node:
    """`chain`'s view ops applied to `base` again, their node arguments (SymInts) found in `graph` by name."""

    def mapped(x: Any) -> Any:
        if not isinstance(x, Node):
            return x
        found = by_name.get(x.name)
        if found is None or found.op != x.op or found.target != x.target:
            raise UnsupportedGraph(f"output {k}: the view replay needs {x.name}, which the passes removed")
        return found

    node = base
    for target, args, kwargs in chain:
        args = torch.fx.node.map_aggregate(args, mapped)
        kwargs = torch.fx.node.map_aggregate(kwargs, mapped)
        node = graph.call_function(target, (node, *args), kwargs)
    return node


def reinplace_input_writes(gm: GraphModule) -> int:
    """Turn ``w = op(x, ...)`` followed by the write-back ``copy_(x, w)`` (or ``copy_(x, copy(x, w))``)
    into ``op_(x, ...)`` where `x` is a graph input, as eager ran it: a static cache's
    ``index_copy(cache, ...)`` then writes one row instead of copying the whole cache twice.

    AOTAutograd's trace of a graph that writes its inputs (kept in the inference graph) is functional
    with the writes at the end; Inductor reinplaces such graphs itself, dmfx's GraphModules run them
    as they are, hence this. Safe only where nothing reads `x`, or a view of it, after `op` (it would
    see the new values), `op`'s other arguments do not alias `x`, and `w` has `x`'s size and strides;
    otherwise the graph is left as it is. Returns how many writes were reinplaced."""
    done = 0
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for write in [n for n in gm.graph.nodes if n.target is aten.copy_.default]:
        x, value = write.args
        if x.op != "placeholder" or write.users:
            continue
        copy = value if isinstance(value, Node) and value.target is aten.copy.default and value.args[0] is x else None
        w = copy.args[1] if copy is not None else value
        inplace = _inplace_variant(w)
        if inplace is None or w.args[0] is not x or (copy is not None and len(copy.users) > 1):
            continue
        if not _same_layout(w, x) or _reads_after(x, w, {w, copy, write}, order) or \
                any(_view_chain(a)[0] is x for a in w.all_input_nodes[1:]):
            continue
        with gm.graph.inserting_before(w):
            new = gm.graph.call_function(inplace, w.args, w.kwargs)
        new.meta.update(w.meta)
        gm.graph.erase_node(write)
        if copy is not None:
            gm.graph.erase_node(copy)
        w.replace_all_uses_with(new)
        gm.graph.erase_node(w)
        order[new] = order[w]
        done += 1
    if done:
        gm.recompile()
    return done


def _inplace_variant(n: Any) -> Any:
    """The in-place overload of `n`'s ATen op (``index_copy`` -> ``index_copy_``), or None."""
    if not isinstance(n, Node) or not isinstance(n.target, torch._ops.OpOverload) or n.target.is_view:
        return None
    packet = getattr(aten, n.target.overloadpacket.__name__ + "_", None)
    op = getattr(packet, n.target._overloadname, None) if packet is not None else None
    if op is None or not op._schema.arguments or op._schema.arguments[0].alias_info is None:
        return None
    return op


def _same_layout(w: Node, x: Node) -> bool:
    from torch._prims_common import is_non_overlapping_and_dense_or_false

    a, b = w.meta.get("val"), x.meta.get("val")
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
            and a.shape == b.shape and a.stride() == b.stride() and is_non_overlapping_and_dense_or_false(b))


def _reads_after(x: Node, w: Node, allowed: set, order: dict[Node, int]) -> bool:
    """Whether a node after `w` (other than `allowed`) reads `x` or a view of it."""
    return any(order.get(u, -1) > order[w] or u.op == "output" for u in _readers_through_views(x, allowed))


def pin_reads_pass() -> Any:
    """pin_reads_of_written_inputs as an Inductor joint-graph pass (its ``joint_custom_post_pass``,
    run before Inductor's min-cut partitioner), for the graphs dmfx leaves to Inductor whole: a
    training graph that writes an input (a buffer updated in place) would otherwise recompute the
    reads of that input in the backward, after the write. A joint graph that writes no input is
    left as it is. A pass the user set there already runs after it."""
    from torch._inductor import config
    from torch._inductor.custom_graph_pass import CustomGraphPass

    theirs = config.joint_custom_post_pass  # (None, a pass, or a list of them)
    theirs = list(theirs) if isinstance(theirs, (list, tuple)) else [theirs] if theirs is not None else []

    class PinReadsOfWrittenInputs(CustomGraphPass):
        def __call__(self, graph: Graph) -> None:
            pin_reads_of_written_inputs(graph, writes=False)
            for p in theirs:
                p(graph)

        def uuid(self) -> Any:
            return ("dmfx.functionalize.pin_reads_of_written_inputs/1",
                    *(p.uuid() if isinstance(p, CustomGraphPass) else p for p in theirs))

    return PinReadsOfWrittenInputs()


def inductor_write_hazard(gm: GraphModule, input_requires_grad: Sequence[bool] | None = None) -> str | None:
    """Why Inductor would miscompile `gm`'s writes into its inputs, or None. `gm` is a functional body
    with its epilogue attached (``copy_(input, new value)``). The hazard: the new value is made by a
    chain of ops on the input (index_copy of an index_copy, a mul_ after an index_copy_), and a value
    between two of those writes is read by something else (a clone, attention saving a view of a
    cache written again later in the graph). Inductor makes such a chain write into the input's
    buffer in place and runs the read after the next write: ``cache.index_copy_(1, pos, k1); w =
    cache.clone(); cache.index_copy_(1, pos, k2)`` returns w with k2's rows (PyTorch 2.11 and 2.14,
    plain torch.compile too; tests/test_mutation.py). One write per input per graph (a static KV
    cache's update, running statistics written by one op or a chain nothing else reads) is safe.
    In training (`input_requires_grad` given), so is a value written by an index write (not only
    element-wise updates) that nothing which may require grad is computed from: where something is
    (``state[0] = v`` then ``h * (1 + 0.1 * state)``), Inductor's backward overwrote the input
    (PyTorch 2.11 and 2.14, plain torch.compile too: the state 3.4 from eager's after the backward,
    right after the forward alone; running statistics updated by mul_ and add_ and read by a norm
    were right)."""
    from .passes.graph_utils import computed_from, grad_dependent_nodes

    needs_grad = grad_dependent_nodes(gm.graph, input_requires_grad) if input_requires_grad is not None else set()
    placeholders = {n for n in gm.graph.nodes if n.op == "placeholder"}
    for w in gm.graph.nodes:
        if w.op != "call_function" or w.target is not aten.copy_.default or w.args[0] not in placeholders:
            continue
        x = w.args[0]
        chain, from_x = _write_chain(w)
        if needs_grad and any(torch.Tag.pointwise not in getattr(c.target, "tags", ()) for c in chain):
            # (an index write in the chain: a chain of element-wise updates, running statistics read by a
            # norm, compiled right)
            reached = computed_from(gm.graph, chain)  # (what is computed from the written values)
            saved = [u for u in gm.graph.nodes if u in reached and u in needs_grad and u not in chain and u is not w]
            if saved:
                return (f"the training graph writes input {x.name}, and {saved[0].name}, which may require grad, "
                        "is computed from the written value")
        if not from_x:
            continue  # (the new value is not computed from the input's old one: one write)
        for later, mid in zip(chain, chain[1:]):  # (a value between two writes, and the write after it)
            readers = [u for u in _readers_through_views(mid) if u is not later and u is not w]
            if readers:
                return (f"the graph writes input {x.name} more than once, and {readers[0].name} reads it between "
                        f"two writes ({mid.name}, then {later.name})")
    return None

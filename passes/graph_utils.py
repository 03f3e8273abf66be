"""Small helpers the passes share: recognising ATen nodes, reading their metadata, and inserting
new nodes with their fake values (so later passes can read shapes and dtypes)."""

from __future__ import annotations

import operator
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
from torch.fx import Graph, GraphModule, Node

aten = torch.ops.aten


@dataclass
class PassContext:
    """What a pass may read (options, fake mode) and where it records what it did."""

    fake_mode: Any = None
    # what fired and how many ATen ops it absorbed, per pattern (passes/fusion.py, record); a pattern
    # whose node a later one absorbed hands its counts over
    fired: dict[str, int] = field(default_factory=dict)  # pattern -> matches rewritten
    replaced: dict[str, int] = field(default_factory=dict)  # pattern -> ATen ops absorbed
    missed: list[str] = field(default_factory=list)  # near-misses, with the reason
    current: str | None = None  # the pass running now (named in errors)
    training: bool = True  # a backward will be derived from this graph (some input requires grad)
    stack_qkv: bool | str = "auto"  # Options.stack_qkv
    input_requires_grad: tuple[bool, ...] | None = None  # per placeholder; None: unknown (assume all)
    input_is_parameter: tuple[bool, ...] | None = None  # per placeholder: an nn.Parameter; None: unknown
    attention: str = "auto"  # Options.attention
    attention_scope: str = "all"  # Options.attention_scope
    tune: bool = False  # Options.tune: time the candidate forms (passes/tuning.py)
    forms: dict[str, tuple[str, str]] = field(default_factory=dict)  # attention node -> (form, why)
    copies: list[dict] = field(default_factory=list)  # copies a pass added knowingly: node, bytes, why
    # In training the backend searches layouts on AOTAutograd's joint graph (passes/layout.py,
    # choose_joint_layouts); the forward pipeline's layout pass then leaves them to it.
    joint_layouts: bool = False
    unpad: bool = False  # Options.unpad: skip the padding of the batch (passes/unpad.py)
    unpadded: dict = field(default_factory=dict)  # what the unpad pass did: the mask input, its attentions

    def needs_grad(self, n: Any) -> bool:
        """Whether `n` may require grad: it is computed from a graph input that requires grad (an
        over-estimate; unknown inputs count as requiring grad in training)."""
        if not self.training or not isinstance(n, Node):
            return False
        return n in grad_dependent_nodes(n.graph, self.input_requires_grad)

    def miss(self, pattern: str, node: Node, why: str) -> None:
        """A near-miss of `pattern` at `node`: the chain is left alone because of `why`."""
        self.missed.append(f"{pattern} at {node.name}: {why}")


def is_op(n: Any, *targets: Any) -> bool:
    """True when `n` is a call of one of `targets` (OpOverloads or OpOverloadPackets)."""
    if not isinstance(n, Node) or n.op != "call_function":
        return False
    t = n.target
    for target in targets:
        if t is target or getattr(t, "overloadpacket", None) is target:
            return True
    return False


def held_attribute(gm: Any, target: str) -> Any:
    """What a ``get_attr`` node of `gm` with this dotted `target` reads (None where a part is missing)."""
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return obj


def val(n: Any) -> Any:
    return n.meta.get("val") if isinstance(n, Node) else n


def tensor_meta(n: Any) -> torch.Tensor | None:
    v = val(n)
    return v if isinstance(v, torch.Tensor) else None


def is_getitem(n: Any, source: Node, index: int) -> bool:
    return isinstance(n, Node) and n.op == "call_function" and n.target is operator.getitem and n.args[0] is source and n.args[1] == index


def alias_of(n: Node) -> Node | None:
    """The tensor `n` shares storage with when `n` is a view (an op whose schema says its result
    aliases its first argument, or ``_unsafe_view``, which aliases without saying so) or an in-place
    accumulation; None otherwise."""
    if n.op != "call_function" or not n.args or not isinstance(n.args[0], Node):
        return None
    if n.target is operator.getitem:  # an element of a view op's list (split, unbind, chunk): a view
        src = n.args[0]
        return src if src.op == "call_function" and alias_of(src) is not None else None
    if n.target in (aten._unsafe_view.default, aten.addmm_.default):
        return n.args[0]
    schema = getattr(n.target, "_schema", None)
    if schema is None or schema.is_mutable or not schema.returns:
        return None
    return n.args[0] if all(r.alias_info is not None for r in schema.returns) else None


def storage_root(n: Node) -> Node:
    """The node whose storage `n` shares (through views and in-place accumulations): `n` if none."""
    while (src := alias_of(n)) is not None:
        n = src
    return n


def getitem_users(n: Node) -> dict[int, list[Node]]:
    """Users of a tuple-returning node grouped by the index they read."""
    out: dict[int, list[Node]] = {}
    for u in n.users:
        if u.op == "call_function" and u.target is operator.getitem:
            out.setdefault(u.args[1], []).append(u)
        else:
            out.setdefault(-1, []).append(u)
    return out


def only_user(n: Node) -> Node | None:
    """The one node that reads `n`, or None."""
    return next(iter(n.users)) if len(n.users) == 1 else None


def activation_name(n: Any) -> str | None:
    """The dmfx activation name (``gelu``, ``gelu_tanh``, ``relu``, ``silu``, ``tanh``) of an ATen
    activation node, or the activation of a ``dmfx::bias_act_dropout`` that is the activation alone (no
    bias, no dropout: what activation_idioms makes of QuickGELU and the squared ReLU, which ATen has no
    op for); None for any other node."""
    if is_op(n, aten.gelu):
        approx = n.kwargs.get("approximate", n.args[1] if len(n.args) > 1 else "none")
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(approx)
    if is_op(n, aten.relu):
        return "relu"
    if is_op(n, aten.silu):
        return "silu"
    if is_op(n, aten.tanh):
        return "tanh"
    if is_op(n, torch.ops.dmfx.bias_act_dropout) and len(n.args) == 5 and n.args[1] is None and n.args[3] is None \
            and n.args[4] == 0:
        return n.args[2]
    return None


RESHAPES = (aten.view, aten._unsafe_view, aten.reshape)


def shown(condition: Callable[[], Any]) -> bool:
    """Whether the size condition holds, made a guard where it reads backed symbols (their example
    values decide, as a plain ``==`` or ``<=`` would); False where the ShapeEnv cannot decide it
    without a data-dependent value (an unbacked size: option unpad's token count T) or cannot reason
    about it at all."""
    from torch.fx.experimental.symbolic_shapes import guard_or_false

    try:
        return bool(guard_or_false(condition()))
    except Exception:  # noqa: BLE001 (a size the ShapeEnv cannot reason about: not shown)
        return False


def same_size(x: Any, y: Any) -> bool:
    """Two sizes (ints or SymInts) are equal. Backed SymInts decide by their hints, with a guard, as
    ``x == y`` does; a data-dependent one (unbacked: option unpad's token count T) is equal only where
    that is known without its value (``T == T``; ``T == 128`` is not, and a guard on it would fail the
    compile)."""
    if isinstance(x, int) and isinstance(y, int):
        return x == y
    return shown(lambda: x == y)


def same_layout(a: Any, b: Any) -> bool:
    """Nodes `a` and `b` hold tensors laid out alike: equal strides in every dim of more than one
    element, known without a guard (undecided, or not tensors: False)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    x, y = tensor_meta(a), tensor_meta(b)
    if x is None or y is None or x.dim() != y.dim():
        return False
    try:
        return all(statically_known_true(n <= 1) or statically_known_true(p == q)
                   for n, p, q in zip(x.shape, x.stride(), y.stride()))
    except Exception:  # noqa: BLE001 (strides the ShapeEnv cannot compare: not shown alike)
        return False


def same_shape(a: Any, b: Any) -> bool:
    """Two shapes (sizes, lists or tuples; ints or SymInts) are equal (same_size)."""
    return len(a) == len(b) and all(same_size(x, y) for x, y in zip(a, b))


def is_transpose(n: Any, dims: tuple[int, int]) -> bool:
    """`n` is x.transpose(a, b) of a 4-D x with {a, b} == dims (negative dims allowed)."""
    return is_op(n, aten.transpose) and sorted(d % 4 for d in n.args[1:3]) == sorted(dims)


def shape_dtype(n: Any) -> tuple[tuple[int, ...], torch.dtype] | None:
    """(shape, dtype) of a node's tensor value, or None."""
    v = val(n)
    if not isinstance(v, torch.Tensor):
        return None
    return tuple(v.shape), v.dtype


def same_shape_dtype(*nodes: Any) -> bool:
    """The nodes' tensor values have one shape (same_shape) and one dtype."""
    found = [shape_dtype(n) for n in nodes]
    if any(f is None for f in found):
        return False
    return all(f[1] == found[0][1] and same_shape(f[0], found[0][0]) for f in found[1:])


def plain_add(n: Node) -> tuple[Node, Node] | None:
    """(a, b) when `n` is ``add.Tensor(a, b)`` of two graph tensors of one shape and dtype, alpha 1."""
    if not is_op(n, aten.add.Tensor) or n.kwargs.get("alpha", 1) != 1 or len(n.args) != 2:
        return None
    a, b = n.args
    if not (isinstance(a, Node) and isinstance(b, Node)):
        return None
    if not same_shape_dtype(a, b, n):
        return None
    return a, b


def is_scalar(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def float_input(x: Any) -> torch.SymFloat | None:
    """The value of `x` when it is a graph node holding a float that Dynamo made a graph input instead
    of a constant (``torch.compile(dynamic=True)``: ``math.pi``, a module's ``self.scaling``): a SymFloat
    whose free symbols are all float inputs (no size: specializing it never specializes a shape)."""
    v = x.meta.get("val") if isinstance(x, Node) else None
    if not isinstance(v, torch.SymFloat):
        return None
    from torch.utils._sympy.symbol import SymT, symbol_is_type

    symbols = v.node.expr.free_symbols
    return v if symbols and all(symbol_is_type(s, SymT.FLOAT) for s in symbols) else None


def number_near(x: Any, value: float, rel: float = 1e-4) -> bool:
    """`x` is the number `value` (to `rel`): a constant, or a float input (float_input) whose value is
    that now. The latter is then specialized with a guard (``guard_float``): Dynamo recompiles if it
    ever changes, as it would have without ``dynamic=True``, so a pattern that reads it as a constant
    stays right. (Its tensorify pass then restarts the capture with that float made a constant.)"""
    if is_scalar(x):
        return abs(float(x) - value) <= rel * abs(value)
    v = float_input(x)
    if v is None or abs(v.node.hint - value) > rel * abs(value):
        return False
    from torch.fx.experimental.symbolic_shapes import guard_float

    return abs(guard_float(v) - value) <= rel * abs(value)


def is_last_dim(dims: Any, ndim: int) -> bool:
    if isinstance(dims, int):
        dims = [dims]
    if not isinstance(dims, (list, tuple)) or len(dims) != 1 or not isinstance(dims[0], int):
        return False
    return dims[0] in (-1, ndim - 1)


def commuted(n: Node, *targets: Any) -> list[tuple[Any, Any]]:
    """For a binary call of `targets`, both orderings of its two operands (for commutative ops)."""
    if not is_op(n, *targets) or len(n.args) < 2:
        return []
    if is_op(n, aten.add) and n.kwargs.get("alpha", 1) != 1:
        return []
    a, b = n.args[0], n.args[1]
    return [(a, b), (b, a)]


#: The float dtypes the passes' fused ops take.
FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def is_dtype_cast(n: Any) -> bool:
    """`n` converts a float tensor to another float dtype and changes nothing else: ``convert_element_type``,
    or ``_to_copy`` whose other keywords (AOTAutograd writes ``layout`` and ``device``) keep a strided tensor on
    its device, with no memory format."""
    if not is_op(n, aten._to_copy, torch.ops.prims.convert_element_type):
        return False
    m, im = tensor_meta(n), tensor_meta(n.args[0])
    if m is None or im is None or m.dtype not in FLOATS:
        return False
    if is_op(n, aten._to_copy):
        kw = dict(n.kwargs)
        if set(kw) - {"dtype", "layout", "device"} or kw.get("layout", torch.strided) != torch.strided:
            return False
        if "device" in kw and torch.device(kw["device"]) != im.device:
            return False
    return True


def strip_casts(n: Any) -> Any:
    """The node under float conversions (`_to_copy` / `convert_element_type` changing only dtype)."""
    while is_op(n, aten._to_copy, torch.ops.prims.convert_element_type):
        if is_op(n, aten._to_copy) and set(n.kwargs) - {"dtype"}:
            break
        n = n.args[0]
    return n


def concrete_int(x: Any) -> int:
    """An int from an int or a SymInt (its hint: the example's concrete value)."""
    if isinstance(x, int):
        return x
    if isinstance(x, torch.SymInt):
        node = x.node
        hint = getattr(node, "hint", None)
        if hint is not None:
            return int(hint)
        shape_env = getattr(node, "shape_env", None)
        if shape_env is not None:
            if hasattr(shape_env, "optimization_hint"):  # (torch >= 2.13; a data-dependent size gets its fallback)
                return int(shape_env.optimization_hint(node.expr))
            return _hint_without_guard(shape_env, node.expr)
    return int(x)


def _hint_without_guard(shape_env: Any, expr: Any) -> int:
    """An expression's value with every symbol at its hint (torch 2.11): backed ones at the example's
    value, data-dependent ones at their hint override (var_to_hint_override: dmfx.explain sets the
    real count there), else their range's upper bound (else 8192, Inductor's fallback)."""
    hints = {}
    for s in expr.free_symbols:
        backed = getattr(shape_env, "backed_var_to_val", None)
        backed = shape_env.var_to_val if backed is None else backed
        value = backed.get(s, getattr(shape_env, "var_to_hint_override", {}).get(s))
        if value is None:
            value = 8192
            try:
                value = min(int(shape_env.var_to_range[s].upper), sys.maxsize)
            except Exception:  # (no range, or an unbounded one)
                pass
        hints[s] = value
    return int(expr.xreplace(hints))


def grad_dependent_nodes(graph: Graph, input_requires_grad: Iterable[bool] | None) -> set[Node]:
    """The placeholders whose flag in `input_requires_grad` is set (all of them when it is None), and
    every node computed from one of them: what may require grad (an over-estimate)."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if input_requires_grad is None:
        return computed_from(graph, placeholders)
    return computed_from(graph, [n for n, rg in zip(placeholders, input_requires_grad) if rg])


def computed_from(graph: Graph, sources: Iterable[Node]) -> set[Node]:
    """`sources` and every call node of `graph` computed from one of them (in a graph in order)."""
    found = set(sources)
    for n in graph.nodes:
        if n.op == "call_function" and any(a in found for a in n.all_input_nodes):
            found.add(n)
    return found


def insert_call(graph: Graph, ctx: PassContext, target: Callable, args: tuple, kwargs: dict | None = None) -> Node:
    """Insert `target(*args)` at the current insertion point and fill meta['val'] by fake execution
    (refresh_val: in the context's fake mode, or the input values' own)."""
    node = graph.call_function(target, args, kwargs or {})
    refresh_val(node, ctx)
    return node


def insert_getitems(graph: Graph, node: Node, count: int) -> list[Node]:
    items = []
    for i in range(count):
        g = graph.call_function(operator.getitem, (node, i))
        v = node.meta.get("val")
        if v is not None:
            g.meta["val"] = v[i]
        items.append(g)
    return items


def insert_seed(graph: Graph, ctx: PassContext) -> Node:
    """A fresh dropout seed [seed, offset] drawn from torch's default generator at run time."""
    return insert_call(
        graph,
        ctx,
        aten.randint.low,
        (0, 2**62, [2]),
        {"dtype": torch.int64, "device": torch.device("cpu")},
    )


def is_impure(n: Node) -> bool:
    """Whether `n` has side effects, so that it stays even when nothing reads it. Random ops whose
    results nobody reads (a dropout a fusion replaced) are dead, not side effects."""
    try:
        return n.is_impure(impure_random=False)
    except TypeError:  # older torch: no impure_random parameter
        return n.is_impure()


def scaled_tanh(t: Any) -> tuple[Node, float, list[Node]] | None:
    """`t` = tanh(s * c1 / c2 ...) with constant factors, read by one node (detaches of it that nothing
    reads aside): a soft cap's inside, Gemma 2's ``tanh(logits / cap)`` and ``tanh(s * scaling / cap)``.
    Returns (s, the product of the factors, the nodes from the tanh down to s: the tanh, its dead
    detaches, the factors each read only by the next). None where `t` is not such a tanh."""
    if not is_op(t, aten.tanh) or not isinstance(t.args[0], Node):
        return None
    dead = [u for u in t.users if is_op(u, aten.detach) and not u.users]
    if len(t.users) - len(dead) != 1:
        return None
    n, factor, chain = t.args[0], 1.0, [t, *dead]
    while (is_op(n, aten.mul, aten.div) and len(n.users) == 1 and isinstance(n.args[0], Node)
           and isinstance(n.args[1], (int, float)) and not isinstance(n.args[1], bool) and n.args[1] != 0):
        factor = factor * n.args[1] if is_op(n, aten.mul) else factor / n.args[1]
        chain.append(n)
        n = n.args[0]
    return n, float(factor), chain


def same_value(a: Any, b: Any, depth: int = 16) -> bool:
    """a and b (nodes, constants, or lists of them) are the same value: the same node, or the same pure op
    applied to the same values, looked up to `depth` ops deep (functionalization records a separate
    ``view(x, shape)`` for each reader of x; GPT-J computes its rotary tables once per tensor). Random
    and impure ops are never the same value twice. SymInts compare by their expressions, which records
    no guard (``==`` on them would)."""
    if a is b:
        return True
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_value(x, y, depth) for x, y in zip(a, b))
    sym = (torch.SymInt, torch.SymFloat, torch.SymBool)
    if isinstance(a, sym) or isinstance(b, sym):
        return type(a) is type(b) and a.node.expr == b.node.expr
    if not isinstance(a, Node) or not isinstance(b, Node):
        return not isinstance(a, Node) and not isinstance(b, Node) and type(a) is type(b) and a == b
    if depth == 0 or a.op != "call_function" or b.op != "call_function" or a.target != b.target:
        return False
    seeded = isinstance(a.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in a.target.tags
    if is_impure(a) or seeded:
        return False
    return (
        same_value(a.args, b.args, depth - 1)
        and a.kwargs.keys() == b.kwargs.keys()
        and all(same_value(a.kwargs[key], b.kwargs[key], depth - 1) for key in a.kwargs)
    )


#: The ops constant_value evaluates: what builds a mask from positions (HF's create_causal_mask traced
#: with static sizes: aranges, offsets, comparisons, broadcasts, and its packed-sequence check, which
#: indexes a cumsum of the position ids' steps), nothing that reads memory it is not given.
_CONSTANT_OPS = frozenset({
    aten.arange.default, aten.arange.start, aten.arange.start_step, aten.full.default, aten.scalar_tensor.default,
    aten.zeros.default, aten.ones.default, aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar,
    aten.mul.Tensor, aten.mul.Scalar, aten.le.Tensor, aten.le.Scalar, aten.lt.Tensor, aten.lt.Scalar,
    aten.ge.Tensor, aten.ge.Scalar, aten.gt.Tensor, aten.gt.Scalar, aten.eq.Tensor, aten.eq.Scalar,
    aten.logical_and.default, aten.bitwise_and.Tensor, aten.logical_not.default, aten.bitwise_not.default,
    aten.where.self, aten.unsqueeze.default, aten.expand.default, aten.view.default, aten.reshape.default,
    aten._unsafe_view.default, aten.squeeze.dim, aten.slice.Tensor, aten.select.int, aten.tril.default,
    aten.triu.default, aten._to_copy.default, aten.alias.default, aten.clone.default, aten.new_ones.default,
    aten.new_zeros.default, aten.ne.Tensor, aten.ne.Scalar, aten.cumsum.default, aten.cat.default, aten.index.Tensor,
})
_CONSTANT_VIEWS = frozenset({
    aten.unsqueeze.default, aten.expand.default, aten.view.default, aten._unsafe_view.default, aten.squeeze.dim,
    aten.slice.Tensor, aten.select.int, aten.alias.default,
})


def constant_value(n: Any, max_elements: int = 1 << 24, max_nodes: int = 64) -> torch.Tensor | None:
    """The value of `n` where the graph computes it from constants alone (no input, no parameter): ops of
    _CONSTANT_OPS over Python numbers and static sizes, at most `max_nodes` of them, none of whose results
    writes more than `max_elements` elements (views write none). Evaluated eagerly (outside any fake
    mode) on the CPU, whatever device the graph names: a CUDA graph's mask costs no kernel launches at
    compile time, and the ops here give the same values on either (integer and boolean arithmetic,
    comparisons, selections of float constants). None where `n` is anything else. A causal mask HF
    builds from aranges is such a value (passes/attention_softmax.py)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    order: list[Node] = []
    seen: set[Node] = set()

    def visit(x: Any) -> bool:
        if isinstance(x, (list, tuple)):
            return all(visit(y) for y in x)
        if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool, torch.Tensor)):
            return False
        if not isinstance(x, Node):
            return True
        if x in seen:
            return True
        if x.op != "call_function" or x.target not in _CONSTANT_OPS or len(seen) >= max_nodes:
            return False
        seen.add(x)
        if not (visit(x.args) and visit(list(x.kwargs.values()))):
            return False
        meta = tensor_meta(x)
        if meta is None or any(not isinstance(d, int) for d in meta.shape):
            return False
        if x.target not in _CONSTANT_VIEWS and meta.numel() > max_elements:
            return False  # (an expand is a view: what it broadcasts costs nothing until an op writes it)
        order.append(x)
        return True

    if not isinstance(n, Node) or not visit(n):
        return None
    values: dict[Node, torch.Tensor] = {}
    real = lambda a: torch.fx.node.map_arg(a, values.__getitem__)  # noqa: E731
    cpu = torch.device("cpu")
    on_cpu = lambda kwargs: {k: cpu if k == "device" and v is not None else v for k, v in kwargs.items()}  # noqa: E731
    with unset_fake_temporarily():
        for x in order:
            values[x] = x.target(*real(x.args), **on_cpu(real(x.kwargs)))
    return values[n]


def topologically_ordered(graph: Graph) -> bool:
    """Move the nodes of `graph` that come before one of their inputs to after it, keeping every other
    node where it is (Inductor's stable topological sort); returns whether any node had to move. A
    fused op is inserted where its pattern began (an attention before its softmax), and its inputs are
    usually made before that; in a graph that writes its inputs, functionalization re-derives the views
    of a written input where each is read (a static cache's values, viewed into heads after the
    softmax), and the op would read them before they exist. Only for functional graphs (the passes'
    graphs): the order of writes is not kept."""
    if _in_order(graph):
        return False
    from torch._inductor.pattern_matcher import stable_topological_sort

    stable_topological_sort(graph)  # (raises on a cycle)
    return True


def _in_order(graph: Graph) -> bool:
    seen: set[Node] = set()
    for n in graph.nodes:
        if any(a not in seen for a in n.all_input_nodes):
            return False
        seen.add(n)
    return True


def dead_code_elimination(gm: GraphModule) -> None:
    gm.graph.eliminate_dead_code(is_impure_node=is_impure)


def finish(gm: GraphModule) -> GraphModule:
    dead_code_elimination(gm)
    gm.graph.lint()
    gm.recompile()
    return gm


def linear_bias(h: Any, N: int) -> tuple[Node, Node, Node | None] | None:
    """`h` is a linear layer's output with its bias inside the GEMM: ``view(addmm(bias, a, w), shape)``
    or ``addmm(...)`` (2-D), the addmm read only there and `bias` a vector of N. Returns
    (addmm, bias, the view or None)."""
    core, view = (h.args[0], h) if is_op(h, aten.view, aten.reshape, aten._unsafe_view) else (h, None)
    if not isinstance(core, Node) or len(core.users) != 1:
        return None
    if not (is_op(core, aten.addmm) and len(core.args) == 3 and not core.kwargs):
        return None
    bm = tensor_meta(core.args[0])
    if bm is None or bm.dim() != 1 or bm.shape[0] != N:
        return None
    return core, core.args[0], view


def insert_bias_free_linear(graph: Graph, ctx: PassContext, addmm: Node, view: Node | None) -> Node:
    """``mm(a, w)`` in place of ``addmm(bias, a, w)`` (the bias moves into the fused kernel), viewed
    like the original output. The view reuses the original shape argument: under dynamic shapes it
    holds SymInt nodes."""
    mm = insert_call(graph, ctx, aten.mm.default, (addmm.args[1], addmm.args[2]))
    return insert_call(graph, ctx, aten.view.default, (mm, view.args[1])) if view is not None else mm


def size_args(graph: Graph, shape: Any) -> list | None:
    """`shape` as an op's size argument in `graph`: ints stay ints, a SymInt becomes the graph input
    that holds it (under dynamic shapes AOTAutograd passes each free symbol as an input). None when a
    SymInt is not an input's value (an expression such as ``s0 * s1``): an int there would freeze it."""
    inputs = {}
    for ph in graph.find_nodes(op="placeholder"):
        v = ph.meta.get("val")
        if isinstance(v, torch.SymInt):
            inputs.setdefault(str(v.node.expr), ph)
    args = []
    for d in shape:
        if isinstance(d, torch.SymInt):
            node = inputs.get(str(d.node.expr))
            if node is None:
                return None
            args.append(node)
        else:
            args.append(int(d))
    return args


def broadcasts_to(small: torch.Size, full: torch.Size) -> bool:
    """Whether a tensor of shape `small` broadcasts to `full` (without changing `full`)."""
    try:
        return tuple(torch.broadcast_shapes(small, full)) == tuple(full)
    except RuntimeError:
        return False


def run_passes(gm: GraphModule, ctx: PassContext, passes: dict[str, Callable], skip: tuple[str, ...] = (), *,
               dce: bool = True, verify: bool | str | None = None) -> None:
    """Run each pass of `passes` not in `skip`, in order, removing dead code after each unless `dce`
    is False (a later pass must not see what an earlier one replaced), then refreshing the fake
    values of the nodes it rewired (refresh_rewired). Exceptions propagate; ctx.current names the
    pass. With `verify` (Options.verify; None: not given) or DMFX_VERIFY, the graph verifier
    (passes/verify.py) checks the graph after each pass and raises GraphVerificationError naming the
    pass, the node and the broken invariant."""
    from .verify import verifier_for

    verifier = verifier_for(gm, ctx, verify)
    for name, fn in passes.items():
        if name in skip:
            continue
        ctx.current = name
        before = _inputs_and_values(gm.graph)
        fn(gm, ctx)
        if dce:
            dead_code_elimination(gm)
        refresh_rewired(gm, ctx, before)
        if verifier is not None:
            verifier.check(gm, name)
    ctx.current = None


def _inputs_and_values(graph: Graph) -> dict[Node, tuple]:
    """Per call node: its target, args, kwargs and fake value (objects, compared by identity: FX
    makes new args tuples whenever a node's inputs are replaced)."""
    return {n: (n.target, n.args, n.kwargs, n.meta.get("val")) for n in graph.nodes if n.op == "call_function"}


def refresh_rewired(gm: GraphModule, ctx: PassContext, before: dict[Node, tuple]) -> None:
    """Fresh fake values, in graph order, for the nodes a pass rewired (target or inputs changed:
    ``replace_all_uses_with`` hands a node's readers a fused op whose output may have other strides)
    and for those whose inputs' values changed, so that later passes and the layout search reason on
    the tensors that will exist. `before`: _inputs_and_values of the graph before the pass.

    A pass sets the values of the nodes it makes or re-values itself (insert_call, refresh_val):
    those are left as they are (the graph verifier checks them); nodes it made are refreshed only
    where an input's value changed here. Best effort: a node whose value cannot be recomputed keeps
    its own (the graph verifier, passes/verify.py, reports it)."""
    from .verify import same_fake_value

    changed: set[Node] = set()  # nodes whose value is not what it was before the pass
    refreshed: set[Node] = set()  # ... changed here
    for n in gm.graph.nodes:
        if n.op != "call_function" or "val" not in n.meta:
            continue
        old = before.get(n)
        value = n.meta["val"]
        if old is not None and old[3] is not value:  # re-valued by the pass
            if not same_fake_value(old[3], value):
                changed.add(n)
            continue
        if old is None:
            stale = any(a in refreshed for a in n.all_input_nodes)
        else:
            stale = (old[0] is not n.target or old[1] is not n.args or old[2] is not n.kwargs
                     or any(a in changed for a in n.all_input_nodes))
        if not stale:
            continue
        try:
            refresh_val(n, ctx)
        except Exception:
            n.meta["val"] = value
            continue
        if same_fake_value(value, n.meta["val"]):
            n.meta["val"] = value  # (the same object: its readers need no refresh)
        else:
            changed.add(n)
            refreshed.add(n)


def refresh_val(n: Node, ctx: PassContext) -> None:
    """Recompute n's fake value from its inputs' (their layout may have changed)."""
    if n.target is operator.getitem:
        src = n.args[0].meta.get("val")
        if isinstance(src, (tuple, list)):
            n.meta["val"] = src[n.args[1]]
        return
    if n.op != "call_function":
        return
    args = torch.fx.node.map_arg(n.args, lambda a: a.meta.get("val"))
    kwargs = torch.fx.node.map_arg(n.kwargs, lambda a: a.meta.get("val"))
    from torch._guards import detect_fake_mode

    mode = ctx.fake_mode or detect_fake_mode([args, kwargs])  # (a bare PassContext: the values' own mode)
    if mode is None:
        return
    with mode:
        n.meta["val"] = n.target(*args, **kwargs)


def views_to_reshapes(starts: Iterable[Node]) -> int:
    """``aten.view`` (and ``_unsafe_view``) nodes downstream of `starts` become ``aten.reshape``.

    A replacement op may lay out its output differently from the ops it replaced (a fused op writing
    contiguously where an element-wise op kept a permuted input's strides, an SDPA kernel chosen
    again), and ops further down pass such a layout on. A view the traced graph recorded under the old
    strides could then fail; reshape is the same view whenever the strides allow one, and copies
    otherwise."""
    stack = list(starts)
    seen, changed = set(stack), 0
    while stack:
        for u in stack.pop().users:
            if u in seen:
                continue
            seen.add(u)
            stack.append(u)
            if u.op == "call_function" and u.target in (aten.view.default, aten._unsafe_view.default):
                u.target = aten.reshape.default
                changed += 1
    return changed


def reshape_fused_views(gm: GraphModule, ctx: PassContext) -> None:
    """The last step of the forward and backward pipelines: views downstream of fused ops become
    reshapes (a fused op may lay out its output differently from the ops it replaced: dmfx's dx is
    contiguous where ``silu_backward`` kept a transposed input's strides; views_to_reshapes)."""
    views_to_reshapes(n for n in gm.graph.nodes if n.op == "call_function" and getattr(n.target, "namespace", None) == "dmfx")


SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
SUPPORTED_DEVICES = ("cpu", "cuda")


def kernel_friendly(t: torch.Tensor | None) -> bool:
    return t is not None and t.dtype in SUPPORTED_DTYPES and t.device.type in SUPPORTED_DEVICES


def remove_metadata_asserts(gm: GraphModule, ctx: PassContext) -> None:
    """Drop ``aten._assert_tensor_metadata`` (emitted for ``.to()`` calls): they only re-check dtypes
    the trace already fixed, and as extra users they would hide every pattern behind a cast."""
    for n in list(gm.graph.nodes):
        if is_op(n, getattr(aten, "_assert_tensor_metadata", None)) and not n.users:
            gm.graph.erase_node(n)

"""The graph verifier: what every pass must leave true, checked after each pass.

A pass rewrites a graph that later passes, the layout search and the kernels trust. Two kinds of
mistake give wrong answers without any error:

* an in-place write (``addmm_``, an ``out=`` argument: any argument an op's schema marks
  ``Tensor(a!)``) into storage that is still needed: by another input of the same op (BLAS with an
  output aliasing an operand is undefined: ``addmm_(view(g), view(g), W)`` gave wrong gradients on
  AVX-512), by a later node that reads the storage through any alias other than the write's own
  result (it would see the written values instead of the ones it was traced with), or by the caller
  (a graph input the graph given to the pipeline did not write; a graph output holding the storage's
  value from before the write);
* a stale fake value: a node whose ``meta["val"]`` (shape, dtype, device, strides, storage offset)
  is not what its op gives on its inputs' values, so that later passes and the layout search reason
  on a tensor that will not exist; or a node whose fake value a pass dropped.

`GraphVerifier` checks these and the graph's lint. Its alias analysis is its own, read from the op
schemas (written arguments; returns that alias an argument, views; a getitem of a list of views such
as ``split``'s; ``_unsafe_view``, which aliases without saying so), not the passes' helpers, so that
it catches their mistakes rather than repeating them. Storage is tracked per buffer with a version
that each write bumps: a node's value carries the version of the buffer it was made at, and reading
it once the buffer has moved on is the violation. (Two views of one buffer count as the same
storage even where they do not overlap: conservative.) What a node reads through a view op is not a
read of data (views only describe it); the view's result carries the version on to its readers.

Fake values are re-derived (in the graph's fake mode, guards suppressed: the verifier never adds a
guard to the compiled program) for every node that is new since the last check, was rewired (other
target or arguments), holds another value than the last check verified, or reads a node whose value
changed; any other node would give the value it was verified with again, so checking only these is
exact and keeps the cost at a few percent of a compile. The graph given to the pipeline is the
reference: its values are taken as AOTAutograd made them. (run_passes refreshes the values of the
nodes a pass rewired before the check, graph_utils.refresh_rewired; what is left to find is what
the pass set itself, or what could not be refreshed.) Strides of size-1 dimensions and of empty
tensors are not compared (they address nothing). Under dynamic shapes sizes and strides are
SymInts, compared symbolically; a comparison the shape environment cannot decide without a guard is
listed in ``undecided`` (and logged at DEBUG), not failed; nodes whose value has unbacked symbols
(data-dependent sizes: re-running would make new ones), or whose op the fake mode cannot run
(higher-order ops, data-dependent outputs), are counted in ``unchecked`` (logged at DEBUG).

Switched on by the option ``verify`` (``True`` or ``"strict"``) or ``DMFX_VERIFY=1`` / ``strict``;
run_passes (passes/graph_utils.py) checks after each pass. A violation raises
`GraphVerificationError`, which the backend turns into one warning and a fallback like any failing
pass (or re-raises with ``fallback=False``, or always under ``"strict"``: the test suite's setting).
"""

from __future__ import annotations

import contextlib
import logging
import math
import operator
import os
from typing import Any, Iterable

import torch
from torch.fx import Graph, GraphModule, Node

log = logging.getLogger("dmfx")
aten = torch.ops.aten

_MISSING = object()  # a node without meta["val"]
_METADATA_ONLY = {aten.sym_size.int, aten.sym_stride.int, aten.sym_numel.default, aten.sym_storage_offset.default}


def strongest_verify(option: bool | str | None) -> bool | str:
    """The graph verifier's level from the option `verify` (None: not given) and env DMFX_VERIFY
    (off for "", "0", "false", "no", "off", as DMFX_DISABLE), the stronger of the two: False (off),
    True (on) or "strict"."""
    env = os.environ.get("DMFX_VERIFY", "").strip().lower()
    levels = [option or False, "strict" if env == "strict" else env not in ("", "0", "false", "no", "off")]
    return "strict" if "strict" in levels else any(levels)


class GraphVerificationError(RuntimeError):
    """A pass broke an invariant of the graph: names the pass, the node and the invariant."""

    def __init__(self, after: str | None, node: str, invariant: str, strict: bool = False):
        self.after, self.node, self.invariant, self.strict = after, node, invariant, strict
        where = f"after pass {after!r}" if after else "in the graph given to the passes"
        super().__init__(f"dmfx graph verifier: {where}: {invariant}")


def verifier_for(gm: GraphModule, ctx: Any, verify: bool | str | None) -> "GraphVerifier | None":
    """A verifier of `gm` when `verify` (an Options.verify value; None: not set) or DMFX_VERIFY asks
    for one, else None."""
    level = strongest_verify(verify)
    return GraphVerifier(gm, getattr(ctx, "fake_mode", None), strict=level == "strict") if level else None


# ------------------------------------------------------------------------------------------ schemas


class _Effect:
    """What an op does to the storage of its arguments, from its schema: the arguments it writes,
    and for each return the argument it aliases (None: a fresh buffer)."""

    __slots__ = ("writes", "returns")

    def __init__(self, writes: tuple[int, ...], returns: tuple[int | None, ...]):
        self.writes, self.returns = writes, returns


_effects: dict[Any, _Effect | None] = {}


def op_writes(target: Any) -> tuple[int, ...]:
    """The indices of the arguments an OpOverload writes (its schema's ``Tensor(a!)``); () for others."""
    effect = _effect(target)
    return effect.writes if effect is not None else ()


def _effect(target: Any) -> _Effect | None:
    """The `_Effect` of an OpOverload (cached), None for targets without a schema."""
    if target in _effects:
        return _effects[target]
    schema = getattr(target, "_schema", None) if isinstance(target, torch._ops.OpOverload) else None
    effect = None
    if schema is not None:
        args = schema.arguments
        writes = tuple(i for i, a in enumerate(args) if a.alias_info is not None and a.alias_info.is_write)

        def aliased(ret: Any) -> int | None:
            if ret.alias_info is None:
                return None
            sets = set(ret.alias_info.before_set)
            if not sets:  # a list of views (``Tensor(a)[]``: the set is on the elements, which Python
                # does not see): of the argument that may alias anything afterwards (``Tensor(a -> *)``)
                return next((i for i, a in enumerate(args) if a.alias_info is not None and "*" in a.alias_info.after_set), 0)
            return next((i for i, a in enumerate(args) if a.alias_info is not None and sets & set(a.alias_info.before_set)), None)

        returns = tuple(aliased(r) for r in schema.returns)
        if target is aten._unsafe_view.default:  # a view of its input, though its schema says otherwise
            returns = (0,)
        effect = _Effect(writes, returns)
    _effects[target] = effect
    return effect


def _schema_args(n: Node) -> list[Any]:
    """`n`'s value for each argument of its schema (positional or keyword; None where absent)."""
    out = []
    for i, a in enumerate(n.target._schema.arguments):
        out.append(n.args[i] if i < len(n.args) and not a.kwarg_only else n.kwargs.get(a.name))
    return out


def _nodes_in(x: Any) -> list[Node]:
    if isinstance(x, Node):
        return [x]
    if isinstance(x, (list, tuple)):
        return [y for y in x if isinstance(y, Node)]
    return []


# -------------------------------------------------------------------------------------- storage


class _Ref:
    """A tensor value: the buffer it lives in (key) and the buffer's version it was made at."""

    __slots__ = ("key", "version")

    def __init__(self, key: Any, version: int):
        self.key, self.version = key, version


class _Fresh:
    """The value of a node returning a list of fresh tensors: element i is buffer (node, i)."""

    __slots__ = ("node",)

    def __init__(self, node: Node):
        self.node = node


class _Storage:
    """One walk over a graph in order, tracking each buffer's writes; raises on the first violation."""

    def __init__(self, after: str | None, strict: bool, allowed_input_writes: Any):
        self.after, self.strict, self.allowed = after, strict, allowed_input_writes
        self.refs: dict[Node, Any] = {}  # node -> _Ref, list of _Ref | None, _Fresh, or None (no tensor)
        self.version: dict[Any, int] = {}
        self.writers: dict[Any, list[Node]] = {}  # key -> the nodes that wrote it, in order
        self.names: dict[Any, str] = {}
        self.input_writes: set[Node] = set()

    def fail(self, node: Node, invariant: str) -> None:
        raise GraphVerificationError(self.after, node.name, invariant, self.strict)

    def buffer(self, key: Any) -> _Ref:
        self.version.setdefault(key, 0)
        return _Ref(key, 0)

    def describe(self, x: Node, ref: _Ref) -> str:
        """`x`, and the node whose buffer it is a view of (output k of a node: the getitem reading it)."""
        key = ref.key
        root = self.names.get(key) or (key.name if isinstance(key, Node) else f"{key[0].name}[{key[1]}]")
        return x.name if root == x.name else f"{x.name} (the storage of {root})"

    def check_current(self, reader: Node, x: Node, what: str) -> None:
        ref = self.refs.get(x)
        if isinstance(ref, _Ref) and ref.version != self.version[ref.key]:
            writer = self.writers[ref.key][ref.version]
            self.fail(reader, what.format(reader=reader.name, x=self.describe(x, ref), writer=writer.name))

    def walk(self, graph: Graph) -> None:
        for n in graph.nodes:
            if n.op in ("placeholder", "get_attr"):
                self.refs[n] = self.buffer(n)
            elif n.op == "call_function":
                self.call(n)
            elif n.op == "output":
                for x in _flat_nodes(n.args):
                    self.check_current(n, x, "graph output {x} holds the value from before node {writer} wrote its "
                                             "storage: the caller would see the written values")

    def call(self, n: Node) -> None:
        if n.target is operator.getitem:
            src, i = n.args[0], n.args[1]
            ref = self.refs.get(src)
            if isinstance(ref, list):
                ref = ref[i] if isinstance(i, int) and -len(ref) <= i < len(ref) else None
            elif isinstance(ref, _Fresh):
                ref = self.buffer((ref.node, i))
            if isinstance(ref, _Ref) and isinstance(ref.key, tuple):
                self.names.setdefault(ref.key, n.name)
            self.refs[n] = ref  # (a _Ref: an element of a list of views, the list's buffer)
            return
        effect = _effect(n.target)
        if effect is None:  # no schema (Python arithmetic on SymInts, higher-order ops): reads all, returns fresh
            for x in n.all_input_nodes:
                self.check_current(n, x, "node {reader} reads {x} after node {writer} wrote its storage")
            self.refs[n] = self.fresh(n, n.meta.get("val"))
            return
        args = _schema_args(n)
        aliased = {i for i in effect.returns if i is not None}
        if n.target not in _METADATA_ONLY:
            for i, a in enumerate(args):
                if i not in aliased or i in effect.writes:
                    for x in _nodes_in(a):
                        self.check_current(n, x, "node {reader} reads {x} after node {writer} wrote its storage")
        written = {i: self.write(n, args, i) for i in effect.writes}
        self.refs[n] = self.result(n, effect, args, written)

    def write(self, n: Node, args: list[Any], i: int) -> list[_Ref]:
        """Argument `i` of `n` is written: check who else sees its storage, bump its version."""
        news = []
        for w in _nodes_in(args[i]):
            ref = self.refs.get(w)
            if not isinstance(ref, _Ref):
                continue
            for j, other in enumerate(args):
                for x in _nodes_in(other):
                    xr = self.refs.get(x)
                    if (j != i or x is not w) and isinstance(xr, _Ref) and xr.key == ref.key:
                        self.fail(n, f"node {n.name} writes the storage of its input {self.describe(x, xr)}, "
                                     f"which it also reads (through {w.name})")
            root = ref.key if isinstance(ref.key, Node) else None
            if root is not None and root.op in ("placeholder", "get_attr"):
                self.input_writes.add(root)
                if root not in self.allowed:
                    self.fail(n, f"node {n.name} writes graph input {root.name}"
                                 f"{'' if w is root else f' (through {w.name})'}, which the caller sees")
            self.version[ref.key] += 1
            self.writers.setdefault(ref.key, []).append(n)
            news.append(_Ref(ref.key, self.version[ref.key]))
        return news

    def result(self, n: Node, effect: _Effect, args: list[Any], written: dict[int, list[_Ref]]) -> Any:
        """The storage of `n`'s value: per return, the buffer of the argument it aliases (at the
        version its write made, for a written one), or a fresh buffer."""

        def one(k: int, i: int | None, v: Any) -> Any:
            if i is None:
                if k < 0:
                    return self.fresh(n, v)
                return self.buffer((n, k)) if v is None or isinstance(v, torch.Tensor) else None
            if written.get(i):
                return written[i][0]
            nodes = _nodes_in(args[i])
            return self.refs.get(nodes[0]) if nodes else None

        if len(effect.returns) == 1:
            return one(-1, effect.returns[0], n.meta.get("val"))
        vals = n.meta.get("val")
        vals = vals if isinstance(vals, (list, tuple)) else [None] * len(effect.returns)
        return [one(k, i, v) for k, (i, v) in enumerate(zip(effect.returns, vals))]

    def fresh(self, n: Node, v: Any) -> Any:
        if isinstance(v, torch.Tensor) or v is None and n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload):
            return self.buffer(n)
        if isinstance(v, (list, tuple)):
            return _Fresh(n)
        return None


def _flat_nodes(x: Any) -> list[Node]:
    out: list[Node] = []
    torch.fx.node.map_arg(x, lambda a: out.append(a))
    return out


# --------------------------------------------------------------------------------- fake values


def _same_inputs(prev: tuple, n: Node) -> bool:
    """Whether `n` has the target and arguments (the same input nodes, equal constants) of `prev`."""
    if prev[0] is not n.target:
        return False
    try:
        return bool(prev[1] == n.args and prev[2] == n.kwargs)
    except Exception:  # (a constant whose == is not a bool)
        return False


class _Unchecked(Exception):
    """The node's value cannot be re-derived here (no fake mode, an input without a value, an op the
    fake mode cannot run); counted, not failed."""


_FAKE_LIMITS: tuple[type, ...] = ()


def _fake_limits() -> tuple[type, ...]:
    """The exceptions with which a fake mode says an op's result depends on data it does not have."""
    global _FAKE_LIMITS
    if not _FAKE_LIMITS:
        from torch._subclasses import fake_tensor as ft
        from torch.fx.experimental import symbolic_shapes as ss

        names = [(ft, "DataDependentOutputException"), (ft, "DynamicOutputShapeException"),
                 (ft, "UnsupportedOperatorException"), (ft, "UnsupportedFakeTensorException"),
                 (ss, "GuardOnDataDependentSymNode")]
        _FAKE_LIMITS = tuple(getattr(m, name) for m, name in names if hasattr(m, name))
    return _FAKE_LIMITS


def _sym_equal(a: Any, b: Any) -> bool | None:
    """a == b for ints, floats and SymInts: True, False, or None where the shape environment cannot
    decide it without adding a guard."""
    if type(a) in (int, bool) and type(b) in (int, bool):
        return a == b
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    try:
        if statically_known_true(a == b):
            return True
        if statically_known_true(a != b):
            return False
    except Exception:
        return None
    return None


def _has_unbacked(v: Any) -> bool:
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    try:
        return bool(free_unbacked_symbols(v))
    except Exception:
        return False


class _Comparison:
    """Compares a stored fake value with a re-derived one: shape, dtype, device, strides (not of
    size-1 dimensions, nor of empty tensors: they address nothing) and storage offset (not for
    in-place ops, re-derived on stand-ins at offset 0); ints and SymInts; tuples and lists element by
    element. Symbolic comparisons the shape environment cannot decide without a guard are listed in
    `undecided`, not counted as differences."""

    def __init__(self, in_place: bool = False):
        self.in_place = in_place
        self.undecided: list[str] = []

    def difference(self, stored: Any, fresh: Any, where: str = "") -> str | None:
        """How `stored` differs from `fresh` (None where they agree), naming the element `where`."""
        if isinstance(fresh, torch.Tensor) or isinstance(stored, torch.Tensor):
            if not (isinstance(fresh, torch.Tensor) and isinstance(stored, torch.Tensor)):
                return f"{where}{_kind(stored)} where running it gives {_kind(fresh)}"
            return self.tensor_difference(stored, fresh, where)
        if isinstance(fresh, (list, tuple)) and isinstance(stored, (list, tuple)):
            if len(fresh) != len(stored):
                return f"{where}{len(stored)} values where running it gives {len(fresh)}"
            for i, (a, b) in enumerate(zip(stored, fresh)):
                d = self.difference(a, b, f"{where}[{i}] ")
                if d:
                    return d
            return None
        numbers = (int, float, torch.SymInt, torch.SymFloat)
        if isinstance(fresh, numbers) and not isinstance(fresh, bool):
            if not isinstance(stored, numbers) or isinstance(stored, bool):
                return f"{where}{_kind(stored)} where running it gives {_kind(fresh)}"
            return f"{where}value {stored} where running it gives {fresh}" if self.equal(stored, fresh, "value") is False else None
        if fresh is None or stored is None or isinstance(fresh, bool):
            return None if stored is fresh or stored == fresh else f"{where}{_kind(stored)} where running it gives {_kind(fresh)}"
        return None  # (other Python values: not compared)

    def tensor_difference(self, s: torch.Tensor, f: torch.Tensor, where: str) -> str | None:
        if s.dtype != f.dtype:
            return f"{where}dtype {s.dtype} where running it gives {f.dtype}"
        if s.device != f.device:
            return f"{where}device {s.device} where running it gives {f.device}"
        if s.dim() != f.dim() or any(self.equal(a, b, "size") is False for a, b in zip(s.shape, f.shape)):
            return f"{where}shape {tuple(s.shape)} where running it gives {tuple(f.shape)}"
        if s.layout != torch.strided or f.layout != torch.strided or self.equal(s.numel(), 0, "numel") is True:
            return None
        for size, a, b in zip(s.shape, s.stride(), f.stride()):
            if self.equal(size, 1, "size") is not True and self.equal(a, b, "stride") is False:
                return f"{where}strides {tuple(s.stride())} where running it gives {tuple(f.stride())}"
        if not self.in_place and self.equal(s.storage_offset(), f.storage_offset(), "storage offset") is False:
            return f"{where}storage offset {s.storage_offset()} where running it gives {f.storage_offset()}"
        return None

    def equal(self, a: Any, b: Any, what: str) -> bool | None:
        eq = _sym_equal(a, b)
        if eq is None:
            self.undecided.append(f"{what} {a} == {b}")
        return eq


def same_fake_value(a: Any, b: Any) -> bool:
    """Whether two fake values are provably the same (see _Comparison; undecided counts as not)."""
    compare = _Comparison()
    return compare.difference(a, b) is None and not compare.undecided


class GraphVerifier:
    """Checks a graph after each pass against the invariants of the module docstring.

    Made from the graph given to the pipeline (its input writes are the allowed ones, its fake values
    the reference); ``check(gm, after)`` after each pass raises GraphVerificationError naming the pass
    `after`, the node and the invariant."""

    def __init__(self, gm: GraphModule, fake_mode: Any = None, strict: bool = False):
        self.fake_mode, self.strict = fake_mode, strict
        self.undecided: list[str] = []  # symbolic comparisons the shape environment could not decide
        self.unchecked = 0  # values that could not be re-derived (see the module docstring)
        self._attr_vals: dict[Node, Any] = {}
        storage = _Storage(None, strict, _AllowAll())
        storage.walk(gm.graph)
        self._allowed_input_writes = storage.input_writes
        calls = [n for n in gm.graph.nodes if n.op == "call_function"]
        # Fake values are required of every node where the given graph had them on every node;
        # else only nodes that had one must keep it.
        self._vals_required = bool(calls) and all("val" in n.meta for n in calls)
        self._verified = {n: (n.target, n.args, n.kwargs, n.meta.get("val", _MISSING)) for n in gm.graph.nodes}

    def check(self, gm: GraphModule, after: str) -> None:
        """Raise GraphVerificationError if `gm` breaks an invariant after pass `after`."""
        try:
            gm.graph.lint()
        except Exception as e:
            raise GraphVerificationError(after, "-", f"the graph does not lint: {e}", self.strict) from e
        if any((e := _effect(n.target)) is not None and e.writes for n in gm.graph.nodes if n.op == "call_function"):
            _Storage(after, self.strict, self._allowed_input_writes).walk(gm.graph)  # (no write, no violation)
        self._check_values(gm, after)

    # ----------------------------------------------------------------------------- fake values

    def _check_values(self, gm: GraphModule, after: str) -> None:
        """Re-derive the value of every node that is new, rewired (other target or arguments), holds
        another value than the last check verified, or reads a node whose value changed; the others
        would give the same value again."""
        mode = self.fake_mode or self._detect_mode(gm.graph)
        verified: dict[Node, tuple] = {}
        moved: set[Node] = set()  # nodes whose value is not (the same as) the one the last check verified
        for n in gm.graph.nodes:
            value = n.meta.get("val", _MISSING)
            prev = self._verified.get(n)
            kept = prev is not None and (prev[3] is value or same_fake_value(prev[3], value))
            if n.op == "call_function" and not (kept and _same_inputs(prev, n) and not any(a in moved for a in n.all_input_nodes)):
                self._check_value(gm, n, mode, after, had_val=prev is not None and prev[3] is not _MISSING)
            if not kept:
                moved.add(n)
            verified[n] = (n.target, n.args, n.kwargs, value)
        self._verified = verified

    def _check_value(self, gm: GraphModule, n: Node, mode: Any, after: str, had_val: bool) -> None:
        """`n`'s stored fake value against its value re-derived from its inputs'."""
        stored = n.meta.get("val", _MISSING)
        if stored is _MISSING:
            if self._vals_required or had_val:
                self._fail(after, n, f"node {n.name} ({_op_name(n.target)}) has no fake value (meta['val'])")
            return
        try:
            fresh = self._rederive(gm, n, mode)
        except _Unchecked as e:
            self.unchecked += 1
            log.debug("dmfx: graph verifier: %s (%s): value not re-derived (%s)", n.name, _op_name(n.target),
                      e.__cause__ or "no fake mode, an input without a value, or no fake implementation")
            return
        except Exception as e:
            first = str(e).splitlines()[0] if str(e) else ""
            self._fail(after, n, f"node {n.name} ({_op_name(n.target)}) cannot run on its inputs' fake values "
                                 f"({type(e).__name__}: {first})")
        effect = _effect(n.target)
        compare = _Comparison(in_place=effect is not None and bool(effect.writes))
        diff = compare.difference(stored, fresh)
        for u in compare.undecided:
            self.undecided.append(f"{n.name}: {u}")
            log.debug("dmfx: graph verifier: %s: cannot decide %s without a guard", n.name, u)
        if diff:
            self._fail(after, n, f"node {n.name}'s fake value is stale: meta['val'] has {diff} "
                                 f"({_op_name(n.target)} on its inputs' values gives that)")

    def _fail(self, after: str, n: Node, invariant: str) -> None:
        raise GraphVerificationError(after, n.name, invariant, self.strict)

    def _detect_mode(self, graph: Graph) -> Any:
        from torch._subclasses.fake_tensor import FakeTensor

        for n in graph.nodes:
            v = n.meta.get("val")
            if isinstance(v, FakeTensor):
                return v.fake_mode
        return None

    def _input_val(self, gm: GraphModule, a: Node, mode: Any) -> Any:
        v = a.meta.get("val", _MISSING)
        if v is not _MISSING:
            return v
        if a.op == "get_attr" and mode is not None:
            if a not in self._attr_vals:
                attr = getattr(gm, a.target, None)
                if not isinstance(attr, torch.Tensor):
                    raise _Unchecked
                self._attr_vals[a] = mode.from_tensor(attr, static_shapes=True)
            return self._attr_vals[a]
        raise _Unchecked

    def _rederive(self, gm: GraphModule, n: Node, mode: Any) -> Any:
        """`n`'s value computed again from its inputs' fake values (in-place ops run on stand-ins of
        the buffers they write, so that no stored value changes)."""
        if n.target is operator.getitem:
            src = self._input_val(gm, n.args[0], mode)
            return src[n.args[1]]
        if _has_unbacked(n.meta.get("val")):
            raise _Unchecked
        args = torch.fx.node.map_arg(n.args, lambda a: self._input_val(gm, a, mode))
        kwargs = torch.fx.node.map_arg(n.kwargs, lambda a: self._input_val(gm, a, mode))
        if not isinstance(n.target, torch._ops.OpOverload):
            if any(isinstance(v, torch.Tensor) for v in _flat_values((args, kwargs))) or not callable(n.target):
                raise _Unchecked  # (a higher-order op, a Python function of tensors)
            with _no_guards(mode):
                return n.target(*args, **kwargs)  # Python arithmetic on SymInts
        if mode is None:
            raise _Unchecked
        with mode, _no_guards(mode):
            effect = _effect(n.target)
            if effect is not None and effect.writes:
                args, kwargs = _stand_ins(n, args, kwargs, effect)
            try:
                return n.target(*args, **kwargs)
            except _fake_limits() as e:
                raise _Unchecked from e

class _AllowAll:
    """The graph given to the passes may write its inputs (an input mutation it was traced with)."""

    def __contains__(self, item: object) -> bool:
        return True


def _stand_ins(n: Node, args: Any, kwargs: Any, effect: _Effect) -> tuple[Any, Any]:
    """`args`/`kwargs` with each written tensor replaced by an empty one of its size and strides."""
    args, kwargs = list(args), dict(kwargs)
    for i in effect.writes:
        name = n.target._schema.arguments[i].name
        if i < len(args):
            args[i] = _blank(args[i])
        elif name in kwargs:
            kwargs[name] = _blank(kwargs[name])
    return tuple(args), kwargs


def _blank(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)
    if isinstance(v, (list, tuple)):
        return type(v)(_blank(x) for x in v)
    return v


@contextlib.contextmanager
def _no_guards(mode: Any):
    shape_env = getattr(mode, "shape_env", None)
    with shape_env.suppress_guards() if shape_env is not None else contextlib.nullcontext():
        yield


def _flat_values(x: Any) -> Iterable[Any]:
    if isinstance(x, (list, tuple)):
        for y in x:
            yield from _flat_values(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _flat_values(y)
    else:
        yield x


def _kind(v: Any) -> str:
    if v is _MISSING:
        return "nothing"
    if isinstance(v, torch.Tensor):
        return f"a tensor of shape {tuple(v.shape)}"
    return f"{type(v).__name__} {v!r}" if not isinstance(v, (list, tuple)) else f"{len(v)} values"


def _op_name(target: Any) -> str:
    return str(getattr(target, "__name__", target))


__all__ = ["GraphVerificationError", "GraphVerifier", "same_fake_value", "verifier_for"]

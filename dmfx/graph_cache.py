"""Reusing dmfx's compiled graphs across processes (option ``cache``, on by default).

Inductor's own first call is fast with a warm cache: AOTAutograd's cache (``AOTAutogradCache``) maps
a graph and its inputs to the compiled forward and backward, whose code Inductor's FX graph cache
holds, so a second process skips tracing, partitioning and code generation. dmfx composes with that
machinery instead of keeping a cache of its own. With ``compiler="inductor"`` dmfx hands AOTAutograd
its compilers as ``SerializableAOTDispatchCompiler`` (what Inductor's ``compile_fx`` hands it), so
AOTAutograd caches what they return (Inductor's ``CompiledFxGraph``), keyed by the graph dmfx's
forward passes made and its inputs.

What that key cannot see is what dmfx does inside AOTAutograd: the layout search on the joint graph,
the backward passes, the decompositions before Inductor. So while dmfx compiles, PyTorch's
documented cache tag (``torch.compiler.config.cache_key_tag``, the user's own tag kept in front) also
names dmfx's fingerprint: a hash of every source file of the installed package (its passes, its
ops' fake implementations, its kernels) and of the options. A changed pass, kernel or option is a
different key: never a stale graph.

A second level, below, keeps the graph the forward passes made too (pickled node by node:
dump_graph), keyed by the Dynamo graph, so a warm process does not lower the graph or run those
passes either: with both, a warm first call of BERT costs what Inductor's own does
(bench/RESULTS.md).

On a hit no dmfx compiler runs, so the record of what the backward passes did (dmfx.records()) is
read back from a small JSON file written when the graph was first compiled, in the kernel cache
directory (``DMFX_CACHE_DIR``), under ``graph_records/``; the record then says ``cache="hit"``, and
its compiled forward and backward GraphModules are not at hand (``record.rewritten_graph`` is: the
graph the forward passes made). A lost JSON file only loses that record's backward statistics. The
tag names that directory too, so two dmfx cache directories sharing one Inductor cache never read
each other's entries (a hit whose record sits in the other directory).

Off with ``options={"cache": False}``, with PyTorch's ``torch.compiler.config.force_disable_caches``
(env ``TORCHINDUCTOR_FORCE_DISABLE_CACHES=1``), and where AOTAutograd's cache is off
(``torch._functorch.config.enable_autograd_cache``). Under ``compiler="fx"`` nothing is cached: the
GraphModules dmfx returns there are not serializable.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import json
import logging
import os
import weakref
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

log = logging.getLogger("dmfx")

#: The source files the fingerprint hashes (everything that decides what dmfx compiles).
SOURCE_SUFFIXES = (".py", ".cpp", ".cu", ".cuh", ".h")

#: The GraphRecord fields a cache hit restores from the JSON written by the compile that stored it.
RECORD_FIELDS = ("fired", "replaced", "missed", "copies", "compiled", "attention_forms", "compiler", "bytes_saved")


def _package_dirs() -> list[Path]:
    from . import cuda_ops, passes

    dirs = [Path(__file__).resolve().parent, Path(passes.__file__).resolve().parent,
            Path(cuda_ops.__file__).resolve().parent]
    return sorted(set(dirs))


@functools.lru_cache(maxsize=1)
def fingerprint() -> str:
    """A hash of dmfx's installed sources (Python, C++ and CUDA, under its package directories) and of
    torch's version: any change to a pass, an op's fake implementation or a kernel changes it."""
    h = hashlib.sha256(torch.__version__.encode())
    for root in _package_dirs():
        for path in sorted(root.rglob("*")):
            if path.suffix in SOURCE_SUFFIXES and "__pycache__" not in path.parts and path.is_file():
                h.update(str(path.relative_to(root)).encode())
                h.update(path.read_bytes())
    return h.hexdigest()


def enabled(opts: Any) -> bool:
    """Whether graphs compiled under `opts` go through AOTAutograd's cache (module docstring)."""
    if not getattr(opts, "cache", True) or opts.compiler != "inductor":
        return False
    if torch.compiler.config.force_disable_caches:
        return False
    try:
        from torch._functorch import config as functorch_config
        from torch._functorch._aot_autograd.autograd_cache import should_bundle_autograd_cache
        from torch._functorch._aot_autograd.schemas import SerializableAOTDispatchCompiler  # noqa: F401
    except ImportError:  # a torch without AOTAutograd's cache: compile every time
        return False
    # A bundled cache entry would store whatever the compilers return, even the GraphModule dmfx runs
    # when Inductor fails on a graph; the default (unbundled) one stores only Inductor's output.
    return bool(functorch_config.enable_autograd_cache) and not should_bundle_autograd_cache()


def constants_digest(gm: torch.fx.GraphModule) -> str:
    """A hash of the values of the tensor constants `gm` reads (get_attr of a tensor that is not a
    parameter: a literal such as ``torch.tensor([...])`` lowered into the graph). AOTAutograd's key
    hashes a tensor attribute by its metadata only (PyTorch then reads constants from the graph at
    hand); dmfx keys their values too rather than rely on that. A value it cannot read gives a key
    of its own (a miss, never a wrong hit)."""
    from .passes.graph_utils import held_attribute

    h = hashlib.sha256()
    for n in gm.graph.nodes:
        if n.op != "get_attr":
            continue
        try:
            obj = held_attribute(gm, str(n.target))
            if isinstance(obj, torch.Tensor) and not isinstance(obj, torch.nn.Parameter):
                t = obj.detach().to("cpu").contiguous().reshape(-1)
                h.update(f"{n.target}:{t.dtype}:{tuple(obj.shape)}".encode())
                h.update(t.view(torch.uint8).numpy().tobytes())
        except Exception:  # noqa: BLE001 (a fake or opaque value: no reuse for this graph)
            h.update(os.urandom(16))
    return h.hexdigest()


def tag(opts: Any, gm: torch.fx.GraphModule | None = None) -> str:
    """dmfx's part of the cache tag for compiling `gm` (the forward passes' graph) under `opts`: its
    fingerprint, the options, the values of the graph's tensor constants, and the directory of the
    graph records. (Two dmfx cache directories may share one Inductor cache, e.g. two virtual
    environments or a changed ``DMFX_CACHE_DIR``: each then keys its own entries, so a hit always
    finds the record its compile wrote beside it.)"""
    constants = constants_digest(gm) if gm is not None else ""
    text = f"{fingerprint()}\n{opts!r}\n{constants}\n{_records_dir()}"
    return "dmfx-" + hashlib.sha256(text.encode()).hexdigest()[:32]


@contextlib.contextmanager
def tagged(dmfx_tag: str | None) -> Iterator[None]:
    """PyTorch's cache tag with `dmfx_tag` after the user's own tag, for the duration (nothing with None)."""
    if dmfx_tag is None:
        yield
        return
    user = torch.compiler.config.cache_key_tag
    if user == dmfx_tag or user.endswith("|" + dmfx_tag):  # (already inside a dmfx compile's tag)
        yield
        return
    with torch.compiler.config.patch(cache_key_tag=f"{user}|{dmfx_tag}" if user else dmfx_tag):
        yield


def serializable(compile_fn: Callable) -> Callable:
    """`compile_fn` declared to AOTAutograd as returning Inductor's OutputCode, which makes AOTAutograd
    cache its result (it stores an entry only when every compiled graph has an FX-graph-cache key, so
    a graph dmfx had to run as a GraphModule is simply not cached)."""
    from torch._functorch._aot_autograd.schemas import SerializableAOTDispatchCompiler
    from torch._inductor.output_code import OutputCode

    return SerializableAOTDispatchCompiler(OutputCode, compile_fn)


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"T({tuple(x.shape)},{x.stride()},{x.dtype},{x.device.type},{x.requires_grad})"
    return f"{type(x).__name__}({x})" if isinstance(x, (int, float, bool, torch.SymInt)) else type(x).__name__


def record_key(dmfx_tag: str, rewritten: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> str:
    """The key of a graph's record file: dmfx's tag, the rewritten graph's code and its inputs."""
    h = hashlib.sha256(dmfx_tag.encode())
    h.update(rewritten.code.encode())
    h.update(repr([_describe(x) for x in example_inputs]).encode())
    h.update(str(torch.is_grad_enabled()).encode())
    return h.hexdigest()[:32]


def _records_dir() -> Path:
    from .cuda_ops.build import cache_root

    return cache_root() / "graph_records"


def save_record(key: str, record: Any) -> None:
    """Write `record`'s RECORD_FIELDS for `key` (atomically; never raises: the record is observability)."""
    from .cuda_ops.build import write_atomic

    try:
        data = json.dumps({f: getattr(record, f) for f in RECORD_FIELDS}, default=list).encode()
        write_atomic(_records_dir() / f"{key}.json", data)
    except (OSError, TypeError, ValueError) as e:
        log.debug("dmfx: could not save the record of graph %d for the cache: %s", record.graph_id, e)


def load_record(key: str, record: Any) -> bool:
    """Fill `record`'s RECORD_FIELDS from the file saved for `key`; False where there is none."""
    try:
        data = json.loads((_records_dir() / f"{key}.json").read_text())
    except (OSError, ValueError):
        return False
    for f in RECORD_FIELDS:
        if f in data:
            value = data[f]
            if f == "attention_forms":
                value = {k: tuple(v) for k, v in value.items()}
            setattr(record, f, value)
    return True


# ---------------------------------------------------------------- the lowered graph, keyed by Dynamo's
#
# AOTAutograd's cache is looked up with the graph dmfx's forward passes made, so a warm process still
# lowers the Dynamo graph and runs those passes first (about 40% of a warm compile of BERT). The
# second level below keeps that graph too (pickled node by node, as PyTorch's caches pickle graphs:
# dump_graph), keyed by the Dynamo graph's code and everything else the lowering reads: its inputs'
# metadata and aliasing, its tensor constants' values, grad mode, autocast, dmfx's tag (sources,
# options). It stays off where that key could miss something: symbolic shapes (a pass may have added
# a guard, which a hit would not add again), tensors held as graph attributes (a parameter, or a
# buffer the graph writes, would be pickled as a copy; Dynamo makes them graph inputs), submodules
# that are not graphs. Where it is off, the decision to leave a graph to Inductor whole may still be
# kept (whole_graph_key): nothing of the lowering is used on such a hit.

#: The GraphRecord fields the lowered graph's entry restores (what the lowering and forward passes did).
LOWERED_FIELDS = ("fired", "replaced", "missed", "copies", "attention_forms", "unpad", "epilogue",
                  "aten_ops_before", "aten_ops_after", "bytes_saved", "scope_skip")


def _symbolic(x: Any) -> bool:
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return True
    return isinstance(x, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in (*x.shape, *x.stride(),
                                                                                       x.storage_offset()))


def python_float_inputs(gm: torch.fx.GraphModule) -> list[str]:
    """The inputs of the Dynamo graph `gm` that are Python floats: Dynamo passes a float it made dynamic
    (``dynamic=True``, or automatic dynamic shapes once the value changed) as a 0-d tensor and reads it
    with ``.item()``.

    A compile cache may hold such a graph only where its compile never read the float's value. Lowering
    may specialize on it (an op that needs a Python number, ``math.floor(s)``, a norm's ``eps``: a
    guard and a constant), while the graph every cache keys on is the same for every value. PyTorch's
    own caches then serve one value's compiled graph for another: ``torch.compile`` with Inductor gives
    wrong answers on torch 2.11-2.14 (pytorch/pytorch#194976, #197889; ``layer_norm(x * s) +
    math.floor(s)`` is one), and so would dmfx's lowered graphs. Keying the caches by the floats'
    values is not enough (tried): a hit does not bring back the guard the lowering added
    (``math.floor(s) == 1``), so a later value would run the hit's graph. See FloatInputs for when
    such a graph is cached."""
    names = []
    for n in _float_placeholders(gm):
        source = getattr(n.meta.get("grapharg"), "source", None)
        name = getattr(source, "name", None)
        names.append(str((name() if callable(name) else name) or n.name))
    return names


def _float_placeholders(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes
            if n.op == "placeholder" and getattr(n.meta.get("grapharg"), "pass_arg_as_tensor", False)]


#: Verdicts on graphs with Python float inputs (FloatInputs), by key: "value-free" or "specializes".
_float_verdicts: dict[str, str] = {}


class FloatInputs:
    """Whether the compile caches may hold a graph with Python float inputs (python_float_inputs).

    Such a graph compiles with the caches keyed by a graph off (caches_off) until a compile of it has been seen not to
    read the floats' values: no guard on a float's symbol in the ShapeEnv, neither from Dynamo's trace
    nor after dmfx's lowering and passes, AOTAutograd and Inductor (backward included) have run. That verdict, "value-free", is kept
    on disk under a key of everything the compile's path depends on but the floats: the Dynamo
    graph's code, its inputs' metadata with their sizes' values (hints), grad mode and autocast, dmfx's
    tag (sources, options), Inductor's and AOTAutograd's configs. A compile is deterministic given
    those, except where it branches on a float's value, and a branch on a symbolic value adds a guard:
    so a compile under the same key is value-free too, and from then on the graph compiles with the
    caches on, and what they keep holds for every value. A compile that reads a float (a guard on its
    symbol) makes the verdict "specializes", which sticks: the graph then always compiles uncached.
    By the same argument, what a compile made before any value was read holds for every value: the
    first compile keeps what it made so far in AOTAutograd's and Inductor's caches (may_save,
    caches_off).

    So HF LLaMA under ``dynamic=True`` (RMSNorm's ``eps`` added to a tensor, the rotary
    ``attention_scaling`` multiplied in) compiles uncached in the first process, which keeps what
    it compiled, and from the caches in the second."""

    def __init__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], opts: Any) -> None:
        self.names = python_float_inputs(gm)
        self.symbols: set[Any] = set()
        self.shape_env: Any = None
        self.key: str | None = None
        self.verdict = ""  # "", "value-free" or "specializes"
        if not self.names or not enabled(opts):
            return
        for n in _float_placeholders(gm):
            values = [u.meta.get("example_value") for u in n.users]
            floats = [v for v in values if isinstance(v, torch.SymFloat)]
            if not floats or any(not v.node.expr.free_symbols for v in floats):
                return  # (a float read otherwise, or already a constant: never cached)
            for v in floats:
                self.symbols |= v.node.expr.free_symbols
                self.shape_env = v.node.shape_env
        if self.shape_env is None:
            return
        self.key = _verdict_key(gm, example_inputs, opts)
        if self.key is not None:
            self.verdict = _float_verdicts.get(self.key) or _load_verdict(self.key)
            self.compiled(last=False)  # (Dynamo's own trace may have read a value: a guard, and a constant)

    @property
    def cached(self) -> bool:
        """The caches may hold the graph (an earlier compile of it was value-free)."""
        return self.verdict == "value-free"

    def read(self) -> list[str]:
        """The guards on the floats' symbols so far: Dynamo's (its trace read a value: ``eps=s * 0.1``
        is a guard ``0.1*s == 0.15`` and a constant in the graph it hands over, whose code is the same
        for every value) and the compile's."""
        if self.shape_env is None:
            return []
        found = [str(g.expr) for g in self.shape_env.guards if g.expr.free_symbols & self.symbols]
        found += [f"{k} == {v}" for k, v in self.shape_env.replacements.items() if k in self.symbols]
        return found

    def may_save(self) -> bool:
        """Whether what the compile made so far may be kept in PyTorch's caches (caches_off): no
        float's value has been read so far."""
        return self.key is not None and self.verdict != "specializes" and not self.read()

    def compiled(self, last: bool) -> None:
        """After each graph of the compile (`last`: the backward, or the inference graph): the verdict."""
        if self.key is None or self.verdict == "specializes":
            return
        read = self.read()
        if read:
            if self.cached:  # (cannot happen if the compile is deterministic, see the class docstring)
                log.warning("dmfx: a graph with Python float inputs %s read their values (%s) in a compile "
                            "an earlier one said was value-free; it is compiled uncached from now on",
                            ", ".join(self.names), "; ".join(read))
            self._save("specializes", read)
        elif last and not self.verdict:
            self._save("value-free", [])

    def _save(self, verdict: str, guards: list[str]) -> None:
        from .cuda_ops.build import write_atomic

        assert self.key is not None
        self.verdict = _float_verdicts[self.key] = verdict
        try:
            write_atomic(_verdicts_dir() / f"{self.key}.json",
                         json.dumps({"verdict": verdict, "floats": self.names, "guards": guards}))
        except OSError as e:
            log.debug("dmfx: could not save a float-input verdict: %s", e)


def _verdicts_dir() -> Path:
    from .cuda_ops.build import cache_root

    return cache_root() / "float_verdicts"


def _load_verdict(key: str) -> str:
    try:
        verdict = json.loads((_verdicts_dir() / f"{key}.json").read_text()).get("verdict", "")
    except (OSError, ValueError, AttributeError):
        return ""
    if verdict in ("value-free", "specializes"):
        _float_verdicts[key] = verdict
        return verdict
    return ""


def _hint(x: Any) -> Any:
    if isinstance(x, torch.SymInt):
        hint = x.node.hint
        if hint is None:
            raise LookupError("an unbacked size")
        return int(hint)
    return x


def _canonical_symbols(code: str) -> str:
    """`code` with ShapeEnv symbol names (``s77``, ``zf72``, ``u0``) numbered by first appearance:
    Dynamo names a size's symbol by a hash of its source, made unique within the process, so the same
    graph traced again can read ``s48`` where it read ``s77``."""
    import re

    names: dict[str, str] = {}
    return re.sub(r"\b(s|zf|u|zuf)\d+\b", lambda m: names.setdefault(m.group(0), f"{m.group(1)}#{len(names)}"), code)


def _key(prefix: str, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], opts: Any, inputs: Callable[[Any], str],
         canonical: bool = False, extra: str = "") -> str | None:
    """The keys below, from what they share: dmfx's tag for `gm` under `opts`, the code of `gm` and of
    its submodules, each input as `inputs` describes it, which inputs share a storage, the global
    modes, and `extra`; with `canonical`, the ShapeEnv's symbol names renumbered (_canonical_symbols).
    None where a submodule is not a GraphModule or a tensor input has no storage."""
    parts = [tag(opts, gm)]
    for name, mod in gm.named_modules():
        if not isinstance(mod, torch.fx.GraphModule):
            return None
        parts.append(f"{name}\n{mod.code}")
    parts += [inputs(x) for x in example_inputs]
    aliasing = _input_aliasing(example_inputs)
    if aliasing is None:
        return None
    text = "\n".join(parts)
    text = "\n".join([_canonical_symbols(text) if canonical else text, aliasing, _modes(), extra])
    return prefix + hashlib.sha256(text.encode()).hexdigest()[:32]


def _verdict_key(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], opts: Any) -> str | None:
    """FloatInputs' key: the graph and everything its compile reads but the floats' values (None where
    some of it cannot be read: then the graph is never cached): the inputs with their sizes' values
    (hints), Inductor's and AOTAutograd's configs, the user's cache tag."""

    def hinted(x: Any) -> str:
        if isinstance(x, torch.Tensor):
            return (f"T({[_hint(s) for s in x.shape]},{[_hint(s) for s in x.stride()]},{_hint(x.storage_offset())},"
                    f"{x.dtype},{x.device},{x.requires_grad})")
        return f"{type(x).__name__}({_hint(x)})"

    try:
        from torch._functorch import config as functorch_config
        from torch._inductor import config as inductor_config

        configs = [repr(sorted(c.save_config_portable().items(), key=lambda kv: kv[0]))
                   for c in (inductor_config, functorch_config)]
        return _key("F", gm, example_inputs, opts, hinted, canonical=True,
                    extra="\n".join([*configs, torch.compiler.config.cache_key_tag]))
    except Exception:  # noqa: BLE001 (an unbacked size, a config that cannot be read: no key)
        return None


class _NothingSaved:
    """caches_off's verdict for a graph whose floats cannot be told apart (no FloatInputs key)."""

    def may_save(self) -> bool:
        return False


_NOTHING_SAVED = _NothingSaved()

#: The graph compiling in this thread whose Python float inputs restrict PyTorch's caches
#: (caches_off): its FloatInputs, or _NOTHING_SAVED; None outside such a compile.
_restricted: contextvars.ContextVar[Any] = contextvars.ContextVar("dmfx_float_inputs", default=None)

#: AOTAutograd cache keys looked up inside caches_off, with a weak reference to what decides whether
#: their entry may be saved: a training graph's entry is saved after its backward compiled, at its
#: first run, outside the block. A compile that never saves leaves only its key and a dead reference
#: behind; a key whose FloatInputs is gone is never saved.
_pending_aot: dict[str, weakref.ref] = {}


@contextlib.contextmanager
def caches_off(floats: FloatInputs | None) -> Iterator[None]:
    """PyTorch's compile caches keyed by a graph, for a compile of a graph with Python float inputs
    whose verdict does not let the caches hold it (`floats`; None: nothing changes). Inside the block
    AOTAutograd's cache and Inductor's FX graph cache find nothing, and keep what is compiled only
    while no float's value has been read so far (FloatInputs.may_save): what a compile made without
    reading a value holds for every value, by FloatInputs' argument, so the next process (whose
    verdict then is "value-free") finds it instead of compiling it again. A training graph's
    AOTAutograd entry, saved after its backward compiled, is judged with the backward's reads.

    The caches keyed by a kernel's source (Inductor's C++ and Triton code caches) stay on: a kernel's
    source is its key, whatever value it was made for. Where the hooks cannot be installed (a
    PyTorch whose internals differ), every cache is off (``force_disable_caches``, which also
    compiles each kernel again, in a fresh directory)."""
    if floats is None:
        yield
        return
    if not _hook_caches():
        with torch.compiler.config.patch(force_disable_caches=True):
            yield
        return
    token = _restricted.set(floats if floats.key is not None else _NOTHING_SAVED)
    try:
        yield
    finally:
        _restricted.reset(token)


def caches_write_only() -> bool:
    """Whether caches_off can keep PyTorch's caches write-only (its hooks fit the installed PyTorch)."""
    return _hook_caches()


@functools.cache
def _hook_caches() -> bool:
    """Wraps the lookups and saves of Inductor's FX graph cache (FxGraphCache._lookup_graph,
    _save_graph) and of AOTAutograd's cache (AOTAutogradCache._lookup, save), the same in torch
    2.11-2.14, for caches_off; outside it they are PyTorch's own. False where they are not there as
    expected (then nothing is wrapped)."""
    try:
        from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCache
        from torch._inductor.codecache import FxGraphCache
    except ImportError:
        return False
    names = {FxGraphCache: ("_lookup_graph", "_save_graph"), AOTAutogradCache: ("_lookup", "save")}
    found = {(cls, n): cls.__dict__.get(n) for cls, pair in names.items() for n in pair}
    if not all(isinstance(f, staticmethod) for f in found.values()):
        return False
    fx_lookup, fx_save, aot_lookup, aot_save = (f.__func__ for f in found.values())  # type: ignore[union-attr]

    @functools.wraps(fx_lookup)
    def _lookup_graph(*args: Any, **kwargs: Any) -> Any:
        if _restricted.get() is not None:
            return None, {}  # (a miss)
        return fx_lookup(*args, **kwargs)

    @functools.wraps(fx_save)
    def _save_graph(*args: Any, **kwargs: Any) -> Any:
        floats = _restricted.get()
        return fx_save(*args, **kwargs) if floats is None or floats.may_save() else None

    @functools.wraps(aot_lookup)
    def _lookup(key: str, *args: Any, **kwargs: Any) -> Any:
        floats = _restricted.get()
        if floats is not None:
            _pending_aot[key] = weakref.ref(floats)
            return None  # (a miss)
        return aot_lookup(key, *args, **kwargs)

    @functools.wraps(aot_save)
    def save(key: str, *args: Any, **kwargs: Any) -> Any:
        ref = _pending_aot.pop(key, None)
        floats = _restricted.get()
        if floats is None and ref is not None:  # (looked up restricted: its FloatInputs, or gone: not saved)
            floats = ref() or _NOTHING_SAVED
        if floats is None or floats.may_save():
            return aot_save(key, *args, **kwargs)
        return None

    FxGraphCache._lookup_graph = staticmethod(_lookup_graph)
    FxGraphCache._save_graph = staticmethod(_save_graph)
    AOTAutogradCache._lookup = staticmethod(_lookup)
    AOTAutogradCache.save = staticmethod(save)
    return True


def lowered_key(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], opts: Any) -> str | None:
    """The key of the Dynamo graph `gm`'s lowered, rewritten graph under `opts`, or None where that
    graph is not cached (see above)."""
    from .passes.graph_utils import held_attribute

    if any(_symbolic(x) for x in example_inputs) or any(isinstance(x, (list, tuple, dict)) for x in example_inputs):
        return None
    for mod in gm.modules():
        if isinstance(mod, torch.fx.GraphModule) and any(
                n.op == "get_attr" and isinstance(held_attribute(mod, str(n.target)), torch.Tensor) for n in mod.graph.nodes):
            return None  # (a parameter, a buffer the graph may write, a constant: Dynamo makes them inputs)
    return _key("L", gm, example_inputs, opts, _described)


def whole_graph_key(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], opts: Any) -> str | None:
    """For a graph with symbolic shapes (which lowered_key leaves uncached): the key under which only
    the decision to leave it to Inductor whole is kept (save_lowered's `whole_graph`), so that a later
    compile does not lower the graph again (a few seconds for a decoder) only to find that out. Only
    that decision: on a hit nothing of dmfx's lowering is used (Inductor compiles the Dynamo graph
    itself, adding its own guards, with its caches off where Python float inputs say so), so an
    entry made under other sizes or float values can cost speed, never an answer. The key: dmfx's
    tag, the graph's code and its inputs' metadata with the ShapeEnv's symbol names renumbered
    (_canonical_symbols), their aliasing, the global modes. None where the graph has no symbolic
    input (lowered_key's case) or cannot be read."""
    if not any(_symbolic(x) for x in example_inputs) or any(isinstance(x, (list, tuple, dict)) for x in example_inputs):
        return None
    return _key("W", gm, example_inputs, opts, _described, canonical=True)


def _described(x: Any) -> str:
    return _describe(x) + (f"@{x.storage_offset()}" if isinstance(x, torch.Tensor) else "")


def _input_aliasing(example_inputs: Sequence[Any]) -> str | None:
    """Which of `example_inputs` share a storage (each tensor: its type and the first input with its
    storage), or None where a tensor has no storage."""
    from torch.multiprocessing.reductions import StorageWeakRef

    storages: dict[Any, int] = {}
    out = []
    for i, x in enumerate(example_inputs):
        if isinstance(x, torch.Tensor):
            try:
                ref = StorageWeakRef(x.untyped_storage())
            except Exception:  # noqa: BLE001 (a tensor without a storage: no key)
                return None
            out.append(f"{type(x).__name__}:{storages.setdefault(ref, i)}")
    return ",".join(out)


def _modes() -> str:
    """The global modes a compile reads: grad mode, deterministic algorithms, default dtype, autocast."""
    out = [f"{torch.is_grad_enabled()}:{torch.are_deterministic_algorithms_enabled()}:{torch.get_default_dtype()}"]
    for device in ("cpu", "cuda"):
        try:
            out.append(f"{device}:{torch.is_autocast_enabled(device)}:{torch.get_autocast_dtype(device)}")
        except (RuntimeError, TypeError, AttributeError):  # (an older torch's autocast API)
            out.append(f"{device}:{torch.is_autocast_enabled()}:{torch.is_autocast_cpu_enabled()}")
    return ";".join(out)


def _lowered_dir() -> Path:
    from .cuda_ops.build import cache_root

    return cache_root() / "lowered_graphs"


#: The node metadata a cached graph keeps: what AOTAutograd reads from the graph it traces. "recompute"
#: is the min-cut partitioner's tag (QKV stacking's concatenated weight: recomputed in the backward,
#: where unstack_dx then reads the three weights, instead of a stacked copy saved for the whole step).
#: Everything else (fake values, stacks, what a fusion absorbed) is left out.
KEPT_NODE_METADATA = ("recompute",)


def dump_graph(gm: torch.fx.GraphModule) -> bytes:
    """`gm` pickled node by node (PyTorch's GraphPickler, which its own caches use), with only the
    node metadata AOTAutograd reads (KEPT_NODE_METADATA). A GraphModule's own pickling keeps its
    generated code and traces that again when it is read back, which runs every call with no tensor
    arguments (a dropout seed's ``randint``, a ``zeros``) once and keeps its result as a constant: the
    same dropout mask on every step."""
    from torch.fx._graph_pickler import GraphPickler, Options

    return GraphPickler.dumps(gm, Options(ops_filter=None, node_metadata_key_filter=lambda key: key in KEPT_NODE_METADATA))


def load_graph(data: bytes) -> torch.fx.GraphModule:
    """The GraphModule `dump_graph` pickled."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx._graph_pickler import GraphPickler

    gm = GraphPickler.loads(data, FakeTensorMode())  # (no fake tensors in it: the metadata was left out)
    if not isinstance(gm, torch.fx.GraphModule):
        raise TypeError(f"not a GraphModule: {type(gm).__name__}")
    gm.recompile()
    return gm


def same_graph(a: torch.fx.GraphModule, b: torch.fx.GraphModule) -> str | None:
    """Why `b` is not the graph `a` is (None: the same nodes, calls, arguments, tensor attributes and
    the node metadata a cached graph keeps)."""
    from .passes.graph_utils import held_attribute

    if a.graph.python_code("self").src != b.graph.python_code("self").src:
        return "its code differs"
    for x, y in zip(a.graph.nodes, b.graph.nodes):
        for k in KEPT_NODE_METADATA:
            if x.meta.get(k) != y.meta.get(k):
                return f"node {x.name}'s {k!r} metadata differs"
    for n in a.graph.nodes:
        if n.op == "get_attr":
            x, y = held_attribute(a, str(n.target)), held_attribute(b, str(n.target))
            if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor) or isinstance(x, torch.Tensor) and not (
                    x.dtype == y.dtype and x.shape == y.shape and x.device == y.device and torch.equal(x, y)):
                return f"attribute {n.target} differs"
    return None


def save_lowered(key: str, record: Any, rewritten: torch.fx.GraphModule | None, hint: Any,
                 whole_graph: str | None = None) -> torch.fx.GraphModule | None:
    """Keep the rewritten graph (or `whole_graph`: why the graph was left to Inductor whole) and the
    record of the lowering and forward passes for `key`. Returns the graph as a later process will
    read it back (pickled and unpickled: AOTAutograd's key of it is then the same in this process as
    in that one, which the live graph's, with its node metadata, is not); None where it could not be
    kept (never raises: the graph is then simply not cached), or where what would be read back is
    not the same graph (same_graph)."""
    import pickle

    from .cuda_ops.build import write_atomic

    try:
        graph = back = None
        if rewritten is not None:
            graph = dump_graph(rewritten)
            back = load_graph(graph)
            why = same_graph(rewritten, back)
            if why:
                log.info("dmfx: graph %d's lowered graph not cached: read back, %s", record.graph_id, why)
                return None
        kept = {f: getattr(record, f) for f in LOWERED_FIELDS}
        kept["missed"] = [m for m in kept["missed"] if not m.startswith("cache:")]  # (each compile's own)
        entry = {"record": kept, "hint": hint, "whole_graph": whole_graph,
                 "graph": graph}
        write_atomic(_lowered_dir() / f"{key}.pkl", pickle.dumps(entry))
        return back
    except Exception as e:  # noqa: BLE001
        log.debug("dmfx: graph %d's lowered graph not cached (%s: %s)", record.graph_id, type(e).__name__, e)
        return None


def load_lowered(key: str) -> dict | None:
    """The entry save_lowered kept for `key`, or None (none, or unreadable: then the graph is lowered)."""
    import pickle

    path = _lowered_dir() / f"{key}.pkl"
    try:
        data = path.read_bytes()
    except OSError:
        return None
    try:
        entry = pickle.loads(data)
        if isinstance(entry, dict) and entry.get("graph") is not None:
            entry["graph"] = load_graph(entry["graph"])
    except Exception as e:  # noqa: BLE001 (a torch or dmfx that can no longer read it: lower again)
        log.debug("dmfx: cached lowered graph %s unreadable (%s: %s)", key, type(e).__name__, e)
        return None
    return entry if isinstance(entry, dict) and "record" in entry else None

"""``unpad``: skip the padding of a batch (option ``unpad=True``).

An encoder's (or a decoder's: below) batch is padded to its longest sequence; every engine then
computes every position, the padding too. Where a graph's attentions all read one HF padding mask
(``attention_mask`` ``[B, S]``, 1 for a real token, 0 for padding, as HF's mask utilities turn it
into an additive or bool mask), this pass gathers the real tokens into packed ``[T, ...]`` tensors
where they enter the encoder, runs every row-wise op on them (GEMMs, norms, activations, dropout,
embeddings, element-wise glue), runs each attention as variable-length attention over the packed
sequences (``dmfx::varlen_attention`` / ``qkv_varlen_attention``, offsets from
``dmfx::unpad_index``), and scatters the rows back to ``[B, S, ...]`` where a value leaves the
packed region (a graph output, a pooler reading token 0). Positions where the mask is 0 then hold
zeros in those outputs (as ModernBERT's own unpadding gives), instead of the values eager computes
there from the real tokens: no real token ever reads them, so every real position's output and every
parameter gradient are eager's as long as nothing downstream reads the padding positions' outputs (a
loss over every position: give padding the label -100). Such a loss (``dmfx::cross_entropy``,
``dmfx::linear_cross_entropy``) runs on the packed rows and is read as it is (``WHOLE``): the loss
over the real positions, with no ``[B * S, V]`` logits scattered for it. Its targets are packed by
``dmfx::unpad_targets``, which raises a ValueError where a padding position has a label that is not
ignored: eager counts that term, from logits unpad does not compute. A reader in the graph that
reads a scattered value along the batch or the sequence (padding_reader: an unmasked mean over the
tokens or over a view merging them with the features, a cumsum, a softmax over the positions, a GEMM
contracting them, an attention over them under a mask that keeps padding keys, an op the pass does
not know, a value read back into the region at other positions than its own) would see those zeros
where eager has values: the graph is left alone, unless the value is masked there (a product with the
padding mask, a fill or a where of a number at the padding: E5's and sentence-transformers' poolings)
by a mask whose batch and sequence dims meet the value's (eager has the same values there; the pass
tracks where each value's token dims went, so a transposed mask or one along the features is not
taken for one).
Values the region computes from the inputs without a GEMM, an embedding or an attention are read
outside it as the graph computes them on the padded batch, not scattered (recomputed_values).

T, the number of real tokens, is a data-dependent size (an unbacked SymInt, cuda_ops/unpad.py): a
batch with another number of real tokens runs the same graph, with no recompile and no kernel build.

How the region is found. A *token tensor* is one whose dims 0 and ``seq`` are the batch and sequence
positions of the mask's ``[B, S]`` grid (``Tok(seq)``), or whose dim 0 is both, flattened
(``Tok(0)``: ``[B * S, ...]``); its packed form drops the batch dim and puts T at the sequence dim.
An op joins the region only when it is *row-wise* over the tokens: each output row depends on the
same row of its token operands alone (an allowlist, ``_RULES``: element-wise ops, reshapes that keep
the tokens leading, permutations that keep the batch first, GEMMs over the feature dim, embeddings,
norms and reductions over feature dims, dmfx's row-wise fused ops). Starting from the attentions'
q, k and v, producers join while they are row-wise (the embeddings, back to ``input_ids``), then
readers join while they are row-wise. Operands from outside are gathered once (a position table
``[1, S, H]`` by each token's position, a ``[B, 1, ...]`` tensor by its sequence), and region values
read outside are scattered once.

A decoder's padded batch works the same way: HF's causal mask built with an attention mask hides
exactly the padding keys and each query's later keys (padding_mask_input tells the two kinds apart
with its probes), and since the packed sequences keep their real tokens in order, each attention
runs causal over them (``causal=True`` in the varlen op). Rotary tables are gathered by position
(or, per sequence, as token tensors), HF's ``repeat_kv`` (unsqueeze, expand, a reshape merging the
heads) and DynamicCache's concatenation onto empty tensors are row-wise. A causal LM's loss over the
real rows differs from eager's where a padding position has a label: HF shifts the labels, so with
left padding the first real token's label falls on the padding before it. ``dmfx::unpad_targets``
(which packs the loss's targets) raises a ValueError saying so when that happens, since the labels
are data. Under a symbolic sequence length the probes run at a second length past the mask's
constants (_probe_shapes), where a sliding window wider than the example's length shows; where that
length is too long to probe, a window shows there, or the mask scales positions (_scaled_positions:
its threshold may lie past every constant), at the largest constant (the window's width), and the
pass guards the graph to lengths up to it (a longer batch recompiles).

Near-misses (recorded, the graph left as it is): a reduction over the padding (above), a mask that is
not a padding mask, causal or not
(a sliding window narrower than the sequence, a learned bias such as T5's, a mask computed from more
than one input), attention probabilities read elsewhere, cross-attention, more than one padding
mask, dtypes or head sizes the varlen kernels do not take.
"""

from __future__ import annotations

import logging
import math
import operator
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import torch
from torch.fx import Graph, GraphModule, Node

from .attention import sdpa_call
from .fusion import record
from .graph_utils import PassContext, aten, constant_value, insert_call, insert_getitems, is_op, shown, tensor_meta, val

log = logging.getLogger("dmfx")
dmfx = torch.ops.dmfx

# An HF padding mask hides a key with finfo.min (or -inf, or False); kept keys read 0 (or True).
_HIDDEN = -1e30


# ----------------------------------------------------------------------------------------- sizes


def _eq(a: Any, b: Any) -> bool:
    """a == b for ints and SymInts, decided without adding a guard (undecided: False)."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    try:
        return bool(statically_known_true(a == b))
    except Exception:
        return False


def _alike(a: Any, b: Any) -> bool:
    """a == b known, or two SymInts of equal hints: Dynamo gives a recompiled frame's inputs' dims
    symbols of their own (automatic dynamic shapes: the attention mask's batch s92 beside input_ids'
    s52), equal in every call HF makes. _unify makes that a guard where the pass relies on it."""
    return _eq(a, b) or (isinstance(a, torch.SymInt) and isinstance(b, torch.SymInt) and _hint(a) == _hint(b))


def _unify(a: Any, b: Any) -> bool:
    """Whether a == b, made known to the ShapeEnv where the two are distinct symbols of equal hints: a
    guard (Dynamo checks it before each call, so the compiled graph runs only where it holds), after
    which _eq sees the two as one. False where it cannot be shown (an unbacked size)."""
    return _eq(a, b) or (shown(lambda: a == b) and _eq(a, b))


def _unify_token_inputs(placeholders: list[Node], params: frozenset, grid: Any) -> None:
    """Make the other [B, S, ...] inputs' batch and length the grid's (a guard, _unify) where Dynamo gave
    them symbols of their own (automatic dynamic shapes: a recompiled frame's labels [s18, s96] beside
    the mask's [s52, s16], equal in every call HF makes). Else their ops (the loss over the labels) do
    not join the region: they would read the scattered values, zeros at the padding."""
    for p in placeholders:
        v = val(p)
        if p in params or p is grid.mask or not isinstance(v, torch.Tensor) or v.dim() < 2:
            continue
        if _alike(v.shape[0], grid.B) and _alike(v.shape[1], grid.S):
            _unify(v.shape[0], grid.B) and _unify(v.shape[1], grid.S)


def _bound(S: Any, longest: int) -> bool:
    """Whether S <= longest, made a guard where S is symbolic (Dynamo checks it before each call; a
    longer batch recompiles): the graph's padding mask was checked up to that length only."""
    return shown(lambda: S <= longest)


def _hint(x: Any) -> int:
    from .graph_utils import concrete_int

    return concrete_int(x)


@dataclass(frozen=True)
class Tok:
    """Where a tensor's tokens are: ``seq`` > 0: dim 0 is the batch and dim ``seq`` the sequence;
    ``seq`` == 0: dim 0 holds both, flattened batch-major (``[B * S, ...]``)."""

    seq: int

    @property
    def flat(self) -> bool:
        return self.seq == 0

    def packed_dim(self, d: int) -> int:
        """The packed tensor's dim of dim `d` (not the batch dim) of the padded one."""
        return d if self.flat else d - 1

    def packed_shape(self, shape: Any, tokens: Any) -> list:
        shape = list(shape)
        if self.flat:
            return [tokens, *shape[1:]]
        return [*shape[1:self.seq], tokens, *shape[self.seq + 1:]]


@dataclass
class Grid:
    """The padded batch's token grid: the mask input and its sizes, and the graph inputs that are
    parameters (never token tensors, whatever their shapes)."""

    mask: Node
    B: Any
    S: Any
    params: frozenset = frozenset()

    def tok_of(self, shape: Any, seq: int | None = None) -> Tok | None:
        """The token annotation a tensor of `shape` can have: Tok(seq) when given and it fits; else
        Tok(1) for [B, S, ...], Tok(0) for [B * S, ...]."""
        shape = list(shape)
        if seq is not None:
            if seq == 0:
                return Tok(0) if shape and _eq(shape[0], self.B * self.S) else None
            ok = len(shape) > seq and _eq(shape[0], self.B) and _eq(shape[seq], self.S)
            return Tok(seq) if ok else None
        if len(shape) >= 2 and _eq(shape[0], self.B) and _eq(shape[1], self.S):
            return Tok(1)
        if shape and _eq(shape[0], self.B * self.S):
            return Tok(0)
        return None

    def fits(self, shape: Any, tok: Tok) -> bool:
        return self.tok_of(shape, tok.seq) == tok


# ----------------------------------------------------------------------------------------- the mask


def _ancestors(n: Node) -> list[Node]:
    """`n` and every node it is computed from, in graph order."""
    seen, stack = {n}, [n]
    while stack:
        for a in stack.pop().all_input_nodes:
            if a not in seen:
                seen.add(a)
                stack.append(a)
    order = {x: i for i, x in enumerate(n.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


@dataclass
class _MaskProgram:
    """An attention mask's computation, as a function of the one tensor input it reads and the values
    of the SymInt inputs it reads (dynamic shapes)."""

    source: Node
    sizes: list[Any]  # the SymInt inputs' example values, in the order run takes them
    run: Callable[..., torch.Tensor]  # run(mask, *sizes)
    largest_constant: float  # the largest |constant| the computation reads (a window's width, say)
    constant_sum: float  # the sum of every |constant| it reads (a threshold made of several: _probe_shapes)
    scaled: str | None  # an op that scales positions before they are compared (_scaled_positions), by name


# Constants at least this large are sentinels (a slice to the end: 2**63 - 1; a hidden score: finfo.min), not a
# length or a window's width.
_SENTINEL = 2**31
# The longest probe (batch * length**2 scores): under a symbolic length a mask whose constants would need
# a longer one is not checked.
_PROBE_SCORES = 2**26


def _constants(nodes: list[Node], gm: GraphModule) -> list[float]:
    """The finite numbers the nodes read: scalar arguments and small tensor constants."""
    found: list[float] = []

    def visit(a: Any) -> Any:
        if isinstance(a, (int, float)) and not isinstance(a, bool) and math.isfinite(a):
            found.append(abs(float(a)))
        return a

    for n in nodes:
        if n.op == "call_function":
            torch.fx.node.map_aggregate((n.args, n.kwargs), visit)
        elif n.op == "get_attr":
            t = getattr(gm, str(n.target), None)
            if isinstance(t, torch.Tensor) and t.numel() <= 4096 and not t.is_complex():
                v = t.detach().double().abs()
                found += v[torch.isfinite(v)].flatten().tolist()
    return [c for c in found if c < _SENTINEL]


# Ops a padded value passes through unchanged in what it reads (a view, a copy, a cast).
_PASS_THROUGH = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.permute.default,
                 aten.transpose.int, aten.t.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.default,
                 aten.expand.default, aten.clone.default, aten._to_copy.default, aten.alias.default,
                 aten.contiguous.default, torch.ops.prims.convert_element_type.default}
# Ops that keep a position (an index from arange, or a size) a position shifted by constants or by other
# positions. A mask that compares only such values (HF's causal masks and windows) hides a key where two
# positions differ by more than a sum of its constants, the same keys at every length. Any other op on a
# position (a product, a floor division: a chunked attention, a scaled window) may compare it with a
# threshold far past every constant (_probe_shapes).
_SHIFTS = {aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar, aten.rsub.Scalar, aten.rsub.Tensor,
           aten.neg.default, aten.abs.default, aten.clamp.default, aten.clamp_min.default, aten.clamp_max.default,
           aten.maximum.default, aten.minimum.default, aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther,
           aten.lift_fresh_copy.default, aten.slice.Tensor, aten.select.int,
           operator.add, operator.sub, operator.neg, operator.getitem} | _PASS_THROUGH
# Ops that read a tensor at positions: the padding mask's value at a key is data, not a position.
_READS = {aten.index.Tensor, aten.gather.default, aten.index_select.default}
# Ops whose values are constants, whatever sizes they take (a mask's zeros of the scores' shape).
_FILLS = {aten.zeros.default, aten.ones.default, aten.empty.memory_format, aten.full.default, aten.new_zeros.default,
          aten.new_ones.default, aten.new_empty.default, aten.new_full.default, aten.scalar_tensor.default,
          aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default, aten.full_like.default}
# Ops whose size arguments are shapes or offsets, not values: only their tensor input carries positions.
_SIZED = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.expand.default,
          aten.slice.Tensor, aten.select.int, aten.narrow.default}


def _position_source(n: Node) -> bool | None:
    """True where `n` makes positions (arange with step 1, a size), False where it makes them scaled
    (arange or iota with another step), None where it makes none."""
    if n.target in (aten.arange.default, aten.arange.start, aten.sym_size.int):
        return True
    if n.target is aten.arange.start_step:
        return n.args[2] == 1
    if n.target is torch.ops.prims.iota.default:
        return n.kwargs.get("step") == 1
    return None


def _scaled_positions(nodes: list[Node]) -> str | None:
    """The first op in `nodes` (a mask's computation, in graph order) that scales positions rather than
    shift them (_SHIFTS), by name; None if none does. A position: a value computed from an arange of
    step 1 or a size, by shifts, and not a bool (a comparison's result is not a position); a size an
    op takes as a shape (_SIZED, _FILLS) makes no value a position."""
    positional: set[Node] = set()
    for n in nodes:
        if n.op == "placeholder" and isinstance(val(n), torch.SymInt):  # (a size: dynamic shapes)
            positional.add(n)
        if n.op != "call_function":
            continue
        made = _position_source(n)
        if made is not None:
            if not made:
                return str(n.target)
            positional.add(n)
            continue
        if n.target in _FILLS:
            continue
        sized = n.target in _SIZED
        if not any(a in positional and (not sized or isinstance(val(a), torch.Tensor)) for a in n.all_input_nodes):
            continue
        if n.target in _READS and n.args[0] not in positional:
            continue  # (a value of the padding mask)
        v = val(n)
        if isinstance(v, torch.Tensor) and v.dtype == torch.bool:
            continue  # (a comparison, or a logical op)
        if n.target not in _SHIFTS:
            return str(n.target)
        positional.add(n)
    return None


def _mask_program(gm: GraphModule, mask: Node) -> _MaskProgram | str:
    """The one tensor input `mask` is computed from and the computation as a function of it (and of the
    SymInt inputs it reads); else why not (the mask reads parameters or several inputs: not a padding
    mask alone)."""
    nodes = _ancestors(mask)
    inputs = [n for n in nodes if n.op == "placeholder" and isinstance(val(n), torch.Tensor)]
    if not inputs:
        return "the attention mask is a constant (causal, or a window), not computed from a padding mask"
    if len(inputs) != 1:
        names = ", ".join(n.name for n in inputs)
        return f"the attention mask is computed from {names}, not from one padding mask alone (a learned bias?)"
    (source,) = inputs
    g = Graph()
    env: dict[Node, Any] = {source: g.placeholder("mask")}
    sizes = []
    for n in nodes:
        if n.op == "placeholder" and n is not source:  # a SymInt input (dynamic shapes)
            env[n] = g.placeholder(f"size{len(sizes)}")
            sizes.append(val(n))
    for n in nodes:
        if n.op != "placeholder":
            env[n] = g.node_copy(n, lambda a: env[a])
    g.output(env[mask])
    sub = GraphModule(gm, g)
    constants = _constants(nodes, gm)
    return _MaskProgram(source, sizes, sub, max(constants, default=0.0), sum(constants), _scaled_positions(nodes))


def _probes(B: int, S: int, dtype: torch.dtype, device: torch.device, window: bool = False) -> list[torch.Tensor]:
    """0/1 masks that tell a padding mask from any other: none padded, all padded, right and left
    padding, and random holes. `window`: only the one that shows a window at a second length (none
    padded: a window hides keys there), the kind of mask already known from the example's."""
    probes = [torch.ones(B, S, dtype=torch.bool)]
    if not window:
        gen = torch.Generator().manual_seed(17)
        right = torch.arange(S)[None, :] < torch.randint(0, S + 1, (B,), generator=gen)[:, None]
        probes += [right, torch.zeros(B, S, dtype=torch.bool), right.flip(1)]
        probes += [torch.rand(B, S, generator=gen) < 0.5 for _ in range(3)]
    return [p.to(dtype=dtype, device=device) for p in probes]


_Shape = tuple[int, int, list[int]]  # (batch, length, the SymInt inputs' values) to probe a mask at


def _probe_shapes(program: _MaskProgram, Bs: tuple, Ss: tuple) -> tuple[_Shape, list[tuple[_Shape, int | None]]] | str:
    """The shape to probe the mask at (the example's), and under a symbolic length the second ones to
    try in turn, each with the longest length the graph may then run at (None: any; else the pass
    guards the graph on it). One length cannot tell a padding mask from a window wider than it
    (ModernBERT's local attention, a sliding-window causal LM), and a window's width is a constant the
    mask's computation compares positions with. So the first second length is past twice the sum of
    its constants, where a window made of shifted positions (_scaled_positions: none scaled) hides
    keys a padding mask keeps; where positions are scaled (a threshold may lie past every constant),
    or that length is too long to probe, or a window shows there, the next is the largest constant
    itself (or the longest that can be probed, if shorter), with the graph run only up to it. A mask
    that hides a key at one length hides it at every longer one (it compares positions), so one that
    hides nothing there hides nothing at any length the guard lets through. `Bs` and `Ss`: the sizes
    that are the batch and the length (the attention's and the mask's own: equal, _alike). Else why
    not."""
    b, s = _hint(Bs[0]), _hint(Ss[0])
    example = (b, s, [_hint(v) for v in program.sizes])
    if all(isinstance(x, int) for x in Ss):
        return example, []
    from torch.fx.experimental.symbolic_shapes import free_symbols

    b2 = b if all(isinstance(x, int) for x in Bs) else 1  # (one sequence shows a window)
    symbols = set(free_symbols((*Bs, *Ss)))
    values = []
    for v in program.sizes:
        if any(_eq(v, x) for x in Ss):
            values.append(None)
        elif any(_eq(v, x) for x in Bs if not isinstance(x, int)):
            values.append(b2)
        elif set(free_symbols(v)) & symbols:
            return (f"the attention mask reads a size {v} computed from the batch's or the sequence's: it cannot be "
                    "checked at another length")
        else:
            values.append(_hint(v))
    longest = math.isqrt(_PROBE_SCORES // b2)
    past = 2 * math.ceil(program.constant_sum) + 2
    lengths = [(max(past, s + 1), None)] if past <= longest and not program.scaled else []
    bound = min(math.floor(program.largest_constant), longest)
    if bound > s:
        lengths.append((bound, bound))
    if not lengths and program.scaled:
        return (f"under a symbolic sequence length ({Ss[0]}) the attention mask scales positions ({program.scaled}), "
                f"so it is checked only up to its largest constant ({program.largest_constant:g}), which is no longer "
                f"than its example ({s})")
    if not lengths:
        return (f"under a symbolic sequence length ({Ss[0]}) the attention mask must be checked at a length past "
                f"its example's ({s}) and its constants ({program.largest_constant:g}), which is too long to probe: "
                "a window that wide would look like padding")
    return example, [((b2, n, [n if v is None else v for v in values]), bound) for n, bound in lengths]


def _probe_plan(gm: GraphModule, mask: Node, Bs: tuple, Ss: tuple,
                bounded: bool) -> tuple[_MaskProgram, _Shape, list[tuple[_Shape, int | None]]] | str:
    """How to probe `mask` (an attention's mask): its program (_mask_program), the example's shape and
    the second ones (_probe_shapes), where it comes from a [batch, seq] input of sizes `Bs` and `Ss`
    (those the attention reads; the input's own are added). `bounded`: keep the second lengths that
    hold only up to the window's width (the pass then guards the graph); else only unbounded ones.
    Else why not."""
    program = _mask_program(gm, mask)
    if isinstance(program, str):
        return program
    sv = val(program.source)
    if sv.dim() != 2 or not (all(_alike(sv.shape[0], b) for b in Bs) and all(_alike(sv.shape[1], s) for s in Ss)):
        return f"the attention mask comes from {program.source.name} {list(sv.shape)}, not a [batch, seq] padding mask"
    found = _probe_shapes(program, (*Bs, sv.shape[0]), (*Ss, sv.shape[1]))
    if isinstance(found, str):
        return found
    example, seconds = found
    if not bounded:
        unbounded = [x for x in seconds if x[1] is None]
        if seconds and not unbounded:
            return "the attention mask would be checked at its window's width only (not bounded)"
        seconds = unbounded
    return program, example, seconds


class MaskCheck(NamedTuple):
    """What padding_mask_input found: the padding mask's graph input (None: not a padding mask), whether
    the mask is causal too, why not (None: it is), and the longest sequence the finding holds for
    (None: any; else the pass guards the graph on it, _probe_shapes)."""

    source: Node | None
    causal: bool
    why: str | None
    longest: int | None = None


def padding_mask_input(gm: GraphModule, mask: Any, heads: Any, B: Any, S: Any, cache: dict,
                       bounded: bool = True) -> MaskCheck:
    """MaskCheck(the graph input, causal, None, longest) when `mask` (an attention's mask over
    [B, heads, S, S] scores) is an HF padding mask of it: key j of batch b is hidden (-inf, <= -1e30
    or False) exactly where ``input[b, j] == 0``, in every head and query row, and a kept key reads 0
    (or True), so dropping the mask from attention over the packed sequences changes no result.
    `causal`: the mask hides the keys after each query too (a decoder's padded batch: HF's causal mask
    with an attention mask), so the attention over the packed sequences is causal within each sequence
    (the real tokens keep their order). Decided by running the mask's computation on probe masks
    (_probes), at the example's length and, under a symbolic length, at a second one past the mask's
    constants (_probe_shapes; `bounded`: also at the window's width, with `longest` set, where that
    fails). Else MaskCheck(None, False, why not)."""
    if mask is None:
        return MaskCheck(None, False, "the attention has no mask: nothing marks padding")
    if not isinstance(mask, Node):
        return MaskCheck(None, False, "the attention mask is not a tensor of the graph")
    if mask in cache:
        return cache[mask]
    plan = _probe_plan(gm, mask, (B,), (S,), bounded)
    if isinstance(plan, str):
        cache[mask] = MaskCheck(None, False, plan)
        return cache[mask]
    program, example, seconds = plan
    source = program.source
    sv = val(source)
    h = _hint(heads)

    def kinds_at(shape: _Shape, kinds: list[bool], window: bool) -> list[bool]:
        """Which of `kinds` (False: a padding mask; True: a causal one) the mask is at `shape`."""
        b, s, sizes = shape
        causal = torch.ones(s, s, dtype=torch.bool, device=sv.device).tril()
        for probe in _probes(b, s, sv.dtype, sv.device, window):
            out = program.run(probe, *sizes)
            torch.broadcast_to(out, (b, h, s, s))  # (else not a mask over these scores: raises)
            padding = (probe != 0)[:, None, None, :]
            kinds = [c for c in kinds if _hides_exactly(out, padding & causal if c else padding)]
            if not kinds:
                break
        return kinds

    try:
        kinds = kinds_at(example, [False, True], False)  # (the first probe that tells the two apart decides)
        if not kinds:
            why = ("the attention mask is not a padding mask of its input, causal or not (a window, or values other "
                   "than 0 and a large negative)")
        else:
            why, longest = None, None
            for shape, bound in seconds:
                there = kinds_at(shape, kinds, True)
                if there:
                    why, kinds, longest = None, there, bound
                    break
                why = (f"the attention mask hides more than padding{' and later keys' if kinds == [True] else ''} "
                       f"at {shape[1]} tokens (a window wider than this batch)")
    except _PROBE_ERRORS as e:  # (shapes the probes cannot take, ops that need other inputs)
        why = f"the attention mask's computation could not be checked ({type(e).__name__})"
    cache[mask] = MaskCheck(None, False, why) if why else MaskCheck(source, kinds[0], None, longest)
    return cache[mask]


#: What running a mask's computation on a probe may raise where the probe is not a shape or value it
#: takes (ATen's errors: a size mismatch, an index out of range, an argument of another type; Python's
#: arithmetic on the size inputs: a division by zero, an overflow): the mask is then not taken for a
#: padding mask. Anything else is a bug of the pass and propagates (the graph is left to PyTorch with
#: a warning, or, with fallback off, the compile fails).
_PROBE_ERRORS = (RuntimeError, ValueError, IndexError, TypeError, ArithmeticError)


def hides_padding_keys(gm: GraphModule, mask: Any, source: Node, cache: dict) -> bool:
    """Whether `mask`, an attention's mask over keys on `source`'s [B, S] grid (a cross-attention's
    queries may be other tokens), hides key j of batch b in every head and query row wherever
    ``source[b, j] == 0``, other keys too or not (a window over the padding mask: ModernBERT's local
    layers), decided as padding_mask_input decides its kind: on its probes, and under a symbolic
    length also at a second length past the mask's constants (no bound). Such an attention may read
    keys and values scattered back from packed rows (zeros at the padding): it never reads those."""
    if not isinstance(mask, Node):
        return False
    if ("keys", mask) in cache:
        return cache["keys", mask]
    plan = _probe_plan(gm, mask, (), (), bounded=False)
    ok = False
    if not isinstance(plan, str) and plan[0].source is source:
        program, example, seconds = plan
        try:
            ok = all(_hides(program.run(p, *sizes), (p == 0)[:, None, None, :])
                     for b, s, sizes in [example, *(shape for shape, _ in seconds)]
                     for p in _probes(b, s, val(source).dtype, val(source).device))
        except _PROBE_ERRORS:  # (shapes the probes cannot take)
            ok = False
    cache["keys", mask] = ok
    return ok


def _hides(mask: torch.Tensor, hidden: torch.Tensor) -> bool:
    """Whether `mask` (bool: True keeps; float: added to the scores) hides every score `hidden` marks
    (False, or at most _HIDDEN), whatever it does with the others. The two broadcast (_hides_exactly)."""
    shape = torch.broadcast_shapes(mask.shape, hidden.shape)
    mask, hidden = mask.expand(shape), hidden.expand(shape)
    return not bool(mask[hidden].any()) if mask.dtype == torch.bool else bool((mask[hidden] <= _HIDDEN).all())


def _hides_exactly(mask: torch.Tensor, kept: torch.Tensor) -> bool:
    """Whether `mask` (bool: True keeps; float: added to the scores) keeps exactly the `kept` scores:
    a kept one reads True or 0, a hidden one False or at most _HIDDEN. The two broadcast against each
    other (a mask's head dim stays as it is): the hidden ones are _hides', and the kept ones read so."""
    shape = torch.broadcast_shapes(mask.shape, kept.shape)
    mask, kept = mask.expand(shape), kept.expand(shape)
    return _hides(mask, ~kept) and bool((mask[kept] if mask.dtype == torch.bool else mask[kept] == 0).all())


# ----------------------------------------------------------------------------------------- attention


NEW_SEED = object()  # an attention whose dropout needs a seed drawn for the varlen op


@dataclass
class AttentionCall:
    """One attention the pass can run over packed sequences."""

    node: Node
    out: Node  # the node holding the attention output [B, Hq, S, Dv] (a getitem, or the node)
    operands: dict[str, Node]  # "q", "k", "v" ([B, H, S, D]) or "qkv" ([B, S, 3 * H * D])
    heads: int | None  # with qkv
    mask: Any
    scale: float
    causal: bool
    seed: Any  # a seed node, None, or NEW_SEED (dropout inside an SDPA call: one is drawn)
    p: float


_DMFX_ATTENTION = {dmfx.flash_attention.default: 1, dmfx.attention.default: 1,
                   dmfx.qkv_flash_attention.default: 1, dmfx.qkv_attention.default: 1}


def _only_output_read(n: Node) -> Node | None:
    """The getitem reading output 0 of a tuple-returning `n`, when nothing reads another output."""
    reads = list(n.users)
    if len(reads) != 1 or reads[0].target is not operator.getitem or reads[0].args[1] != 0:
        return None
    return reads[0]


def attention_call(n: Node) -> AttentionCall | str | None:
    """The attention `n` computes (a dmfx attention op or a scaled_dot_product_attention call), or why
    it cannot run over packed sequences, or None (not an attention)."""
    if n.op != "call_function":
        return None
    if n.target in _DMFX_ATTENTION:
        out = _only_output_read(n)
        if out is None:
            return "the attention probabilities or row statistics are read elsewhere"
        if n.target in (dmfx.qkv_flash_attention.default, dmfx.qkv_attention.default):
            qkv, heads, mask, scale, causal, seed, p = n.args[:7]
            return AttentionCall(n, out, {"qkv": qkv}, heads, mask, scale, causal, seed, p)
        q, k, v, mask, scale, causal, seed, p = n.args[:8]
        if len(n.args) > 8 and n.args[8]:
            return "soft-capped scores (the varlen kernels have no soft cap)"
        return AttentionCall(n, out, {"q": q, "k": k, "v": v}, None, mask, scale, causal, seed, p)
    call = sdpa_call(n)
    if call is None:
        return None
    p = call["dropout"]
    if not isinstance(p, (int, float)):
        return "scaled_dot_product_attention with a run-time dropout probability"
    out = n
    if call["extra_outputs"]:
        out = _only_output_read(n)
        if out is None:
            return "scaled_dot_product_attention's logsumexp is read"
    qm = tensor_meta(call["q"])
    if qm is None or qm.dim() != 4:
        return "scaled_dot_product_attention on tensors that are not 4-D"
    scale = call["scale"]
    if scale is None:
        if not isinstance(qm.shape[-1], int):
            return "a symbolic head size: the scale is not known"
        scale = qm.shape[-1] ** -0.5
    # (dropout inside the call: the varlen op drops out with dmfx's Philox stream and a fresh seed)
    return AttentionCall(n, out, {"q": call["q"], "k": call["k"], "v": call["v"]}, None, call["mask"], float(scale),
                         bool(call["causal"]), NEW_SEED if p else None, float(p))


def _attention_shapes(a: AttentionCall) -> tuple[Any, Any, Any, Any, torch.Tensor] | str:
    """(B, heads, S, head dim, q's value) of a self-attention over one token grid, or why not."""
    if "qkv" in a.operands:
        m = tensor_meta(a.operands["qkv"])
        if m is None or m.dim() != 3:
            return "the stacked q/k/v projection is not 3-D"
        B, S, w = m.shape
        return B, a.heads, S, w // (3 * a.heads), m
    qm, km, vm = (tensor_meta(a.operands[x]) for x in "qkv")
    if any(t is None or t.dim() != 4 for t in (qm, km, vm)):
        return "q, k or v is not 4-D [B, H, S, D]"
    if not (_eq(qm.shape[2], km.shape[2]) and _eq(qm.shape[0], km.shape[0])):
        return "queries and keys of different lengths (cross-attention, or a decode step against a cache)"
    return qm.shape[0], qm.shape[1], qm.shape[2], qm.shape[3], qm


def _varlen_ok(q: torch.Tensor, head_dim: Any, value_dim: Any) -> str | None:
    from .. import cuda_ops

    supported = getattr(cuda_ops, "varlen_supported", None)
    if supported is None or supported(q.device, q.dtype, head_dim, value_dim):
        return None
    return f"no varlen attention kernel for {q.dtype} on {q.device.type} with head dim {head_dim}"


# ----------------------------------------------------------------------------------------- row-wise rules
#
# A rule says, for a node and the token annotation of its output, which of its arguments are token
# operands (and their annotation) and how the packed node is built; `forward` gives the output's
# annotation from one token operand's. Operand roles: "token" (packed: its packed value), "bcast"
# (broadcast over the tokens: as is, or without its size-1 batch dim), "pos" ([1, S, ...], or size 1 in
# every dim before the sequence's: gathered by each token's position), "batch" ([B, 1, ...]: gathered
# by each token's sequence).


@dataclass
class Role:
    kind: str  # "token", "bcast", "pos", "batch"
    tok: Tok | None = None


def _tensor_args(n: Node) -> list[tuple[tuple, Node]]:
    """(path, node) of each tensor argument of `n`: path ("a", i) / ("a", i, j) / ("k", name)."""
    found = []
    for i, a in enumerate(n.args):
        if isinstance(a, Node) and isinstance(val(a), torch.Tensor):
            found.append((("a", i), a))
        elif isinstance(a, (list, tuple)):
            found += [(("a", i, j), x) for j, x in enumerate(a) if isinstance(x, Node) and isinstance(val(x), torch.Tensor)]
    for k, a in n.kwargs.items():
        if isinstance(a, Node) and isinstance(val(a), torch.Tensor):
            found.append((("k", k), a))
    return found


def _operand_role(shape: list, nd: int, tok: Tok, grid: Grid) -> Role | None:
    """The role of an operand of `shape` broadcast against an output of rank `nd` with tokens at
    `tok`; None where it is none of them (the op is not row-wise in it)."""
    off = nd - len(shape)
    if tok.flat:
        if off == 0 and _eq(shape[0], grid.B * grid.S):
            return Role("token", Tok(0))
        return Role("bcast") if off > 0 or _eq(shape[0], 1) else None
    b = shape[0 - off] if off <= 0 else None
    s = shape[tok.seq - off] if tok.seq - off >= 0 else None
    one = lambda x: x is None or _eq(x, 1)  # noqa: E731
    if off == 0 and _eq(b, grid.B) and _eq(s, grid.S):
        return Role("token", tok)
    if one(b) and one(s):
        return Role("bcast")
    if s is not None and _eq(s, grid.S) and all(_eq(d, 1) for d in shape[:max(tok.seq - off, 0)]):
        return Role("pos")  # ([1, S, ...]; or [1, 1, S, D], rotary tables beside [B, H, S, D])
    if off == 0 and _eq(b, grid.B) and one(s) and tok.seq == 1:
        return Role("batch")
    return None


def _elementwise_roles(n: Node, tok: Tok, grid: Grid) -> dict[tuple, Role] | None:
    out = tensor_meta(n)
    if out is None:
        return None
    roles = {}
    for path, a in _tensor_args(n):
        role = _operand_role(list(val(a).shape), out.dim(), tok, grid)
        if role is None:
            return None
        roles[path] = role
    return roles


class Rule:
    """Row-wise ops whose every output is one tensor with the output annotation (element-wise)."""

    def roles(self, n: Node, tok: Tok, grid: Grid) -> dict[tuple, Role] | None:
        return _elementwise_roles(n, tok, grid)

    def out_tok(self, n: Node, path: tuple, tok: Tok, grid: Grid) -> Tok | None:
        """The output annotation when the operand at `path` has annotation `tok`."""
        out = tensor_meta(n)
        return tok if out is not None and out.dim() == val(_arg(n, path)).dim() else None

    def outputs(self, n: Node, tok: Tok) -> Any:
        """The annotation of each output (a tuple for tuple-returning ops)."""
        return tok

    def args(self, n: Node, tok: Tok, T: Any) -> tuple[tuple, dict]:
        """The packed node's non-tensor arguments (tensor operands are replaced by the caller)."""
        return n.args, dict(n.kwargs)


def _arg(n: Node, path: tuple) -> Any:
    if path[0] == "k":
        return n.kwargs[path[1]]
    a = n.args[path[1]]
    return a[path[2]] if len(path) == 3 else a


class Reduce(Rule):
    """Reductions and softmaxes over feature dims (not a token dim)."""

    def __init__(self, dims_at: int, keepdim_at: int | None):
        self.dims_at, self.keepdim_at = dims_at, keepdim_at

    def _dims(self, n: Node) -> list[int] | None:
        x = tensor_meta(n.args[0])
        dims = n.args[self.dims_at] if len(n.args) > self.dims_at else n.kwargs.get("dim")
        if dims is None:
            return None
        dims = [dims] if isinstance(dims, int) else list(dims)
        return [d % x.dim() for d in dims]

    def _keepdim(self, n: Node) -> bool:
        if self.keepdim_at is None:
            return True
        return bool(n.args[self.keepdim_at] if len(n.args) > self.keepdim_at else n.kwargs.get("keepdim", False))

    def roles(self, n, tok, grid):
        dims = self._dims(n)
        if dims is None or any(d <= tok.seq for d in dims) or not self._keepdim(n) and tok.seq > min(dims):
            return None
        x = n.args[0]
        return {("a", 0): Role("token", tok)} if grid.fits(val(x).shape, tok) else None

    def out_tok(self, n, path, tok, grid):
        return tok if path == ("a", 0) else None

    def args(self, n, tok, T):
        args = list(n.args)
        dims = self._dims(n)
        new = [tok.packed_dim(d) for d in dims]
        orig = n.args[self.dims_at] if len(n.args) > self.dims_at else n.kwargs.get("dim")
        value = new[0] if isinstance(orig, int) else new
        kwargs = dict(n.kwargs)
        if len(args) > self.dims_at:
            args[self.dims_at] = value
        else:
            kwargs["dim"] = value
        return tuple(args), kwargs


def _head_merge_seq(x_shape: Any, out_shape: Any, seq: int, grid: Grid) -> int | None:
    """The sequence dim of `x_shape` when a reshape to `out_shape` (tokens at dim `seq` > 1) keeps the
    batch and sequence dims and only regroups the static dims between them and those after the
    sequence (HF's repeat_kv: ``[B, kv_heads, n_rep, S, D]`` -> ``[B, heads, S, D]``); else None."""
    if seq <= 1 or not (_eq(x_shape[0], out_shape[0]) and _eq(x_shape[0], grid.B)):
        return None
    fixed = lambda dims: all(isinstance(d, int) for d in dims)  # noqa: E731
    if not (fixed(out_shape[1:seq]) and fixed(out_shape[seq + 1:])):
        return None
    for sx in range(1, len(x_shape)):
        if not _eq(x_shape[sx], grid.S) or not (fixed(x_shape[1:sx]) and fixed(x_shape[sx + 1:])):
            continue
        if math.prod(x_shape[1:sx]) == math.prod(out_shape[1:seq]) and \
                math.prod(x_shape[sx + 1:]) == math.prod(out_shape[seq + 1:]):
            return sx
    return None


class Reshape(Rule):
    """view / reshape keeping the tokens leading: [B, S, ...] or [B * S, ...] on both sides; or with
    the batch and sequence dims kept, the dims between them and those after regrouped
    (_head_merge_seq)."""

    def roles(self, n, tok, grid):
        out, x = tensor_meta(n), tensor_meta(n.args[0])
        if not grid.fits(out.shape, tok):
            return None
        if _same_shape(out.shape, x.shape):  # (a view that changes nothing: HF's attention output [B, heads, S, d])
            return {("a", 0): Role("token", tok)}
        if tok.seq > 1:
            sx = _head_merge_seq(list(x.shape), list(out.shape), tok.seq, grid)
            return None if sx is None else {("a", 0): Role("token", Tok(sx))}
        xtok = grid.tok_of(x.shape)
        if xtok is None or xtok.seq > 1:
            return None
        rest = tok.packed_shape(out.shape, 1)[1:]
        if not all(isinstance(d, int) for d in rest):
            return None  # (a symbolic feature size: the packed shape would freeze it)
        return {("a", 0): Role("token", xtok)}

    def out_tok(self, n, path, tok, grid):
        out, x = list(tensor_meta(n).shape), list(tensor_meta(n.args[0]).shape)
        if _same_shape(out, x):
            return tok
        if tok.seq > 1:  # (a head merge: the output's sequence dim is the one that maps back to x's)
            found = [s for s in range(2, len(out)) if _head_merge_seq(x, out, s, grid) == tok.seq]
            return Tok(found[0]) if len(found) == 1 else None
        return grid.tok_of(tensor_meta(n).shape)

    def args(self, n, tok, T):
        return (n.args[0], tok.packed_shape(tensor_meta(n).shape, T)), {}


def _same_shape(a: Any, b: Any) -> bool:
    return len(a) == len(b) and all(_eq(x, y) for x, y in zip(a, b))


def _perm(n: Node) -> list[int] | None:
    x = tensor_meta(n.args[0])
    if is_op(n, aten.permute):
        return [d % x.dim() for d in n.args[1]]
    a, b = (d % x.dim() for d in n.args[1:3])
    perm = list(range(x.dim()))
    perm[a], perm[b] = perm[b], perm[a]
    return perm


class Permute(Rule):
    """transpose / permute that keep the batch (or flattened token) dim first."""

    def roles(self, n, tok, grid):
        perm = _perm(n)
        if perm[0] != 0:
            return None
        xtok = Tok(0) if tok.flat else Tok(perm[tok.seq])
        return {("a", 0): Role("token", xtok)} if grid.fits(val(n.args[0]).shape, xtok) else None

    def out_tok(self, n, path, tok, grid):
        perm = _perm(n)
        if perm[0] != 0:
            return None
        return tok if tok.flat else Tok(perm.index(tok.seq))

    def args(self, n, tok, T):
        if is_op(n, aten.transpose):
            x = tensor_meta(n.args[0])
            xtok = tok if tok.flat else Tok(_perm(n)[tok.seq])
            return (n.args[0], *(xtok.packed_dim(d % x.dim()) for d in n.args[1:3])), {}
        perm = _perm(n)
        xtok = tok if tok.flat else Tok(perm[tok.seq])
        packed = [xtok.packed_dim(p) for p in (perm if tok.flat else perm[1:])]
        return (n.args[0], packed), {}


class Expand(Rule):
    """expand that leaves the token dims as they are (an expand over them is a gather: _gather)."""

    def roles(self, n, tok, grid):
        x, out = tensor_meta(n.args[0]), tensor_meta(n)
        if x.dim() != out.dim() or not grid.fits(x.shape, tok):
            return None
        return {("a", 0): Role("token", tok)}

    def out_tok(self, n, path, tok, grid):
        return tok if tensor_meta(n.args[0]).dim() == tensor_meta(n).dim() else None

    def args(self, n, tok, T):
        return (n.args[0], tok.packed_shape(list(n.args[1]), -1)), {}


class Unsqueeze(Rule):
    """unsqueeze at a dim other than the batch's (HF's repeat_kv: ``k[:, :, None]``)."""

    def roles(self, n, tok, grid):
        d = n.args[1] % tensor_meta(n).dim()
        if tok.flat or d == 0 or d == tok.seq:
            return None
        xtok = Tok(tok.seq - 1 if d < tok.seq else tok.seq)
        return {("a", 0): Role("token", xtok)} if grid.fits(val(n.args[0]).shape, xtok) else None

    def out_tok(self, n, path, tok, grid):
        d = n.args[1] % tensor_meta(n).dim()
        if tok.flat or d == 0:
            return None
        return Tok(tok.seq + 1 if d <= tok.seq else tok.seq)

    def args(self, n, tok, T):
        return (n.args[0], tok.packed_dim(n.args[1] % tensor_meta(n).dim())), {}


class Linear(Rule):
    """addmm(bias, x, w) / mm(x, w) with x [B * S, K]: a GEMM over the feature dim."""

    def __init__(self, x_at: int):
        self.x_at = x_at

    def roles(self, n, tok, grid):
        if not tok.flat:
            return None
        roles = {("a", self.x_at): Role("token", Tok(0))}
        for path, a in _tensor_args(n):
            if path != ("a", self.x_at):
                if (grid.tok_of(val(a).shape) is not None and val(a).dim() > 1 and _eq(val(a).shape[0], grid.B * grid.S)
                        and not _from_parameters(a, grid.params)):
                    return None  # (a token tensor as the weight: not a linear layer)
                roles[path] = Role("bcast")
        return roles

    def out_tok(self, n, path, tok, grid):
        return Tok(0) if path == ("a", self.x_at) and tok.flat else None


# ops a weight goes through on its way to a GEMM (transposed, stacked as QKV, cast, copied)
_WEIGHT_OPS = (aten.t, aten.transpose, aten.permute, aten.view, aten.reshape, aten._unsafe_view, aten._to_copy,
               aten.clone, aten.alias, aten.cat, aten.detach, aten.contiguous)


def _from_parameters(a: Any, params: frozenset, depth: int = 8) -> bool:
    """Whether `a` is made from parameters alone, through _WEIGHT_OPS: a linear layer's weight even
    where its shape is also a token tensor's (a dim equal to B * S, as BERT-base's 768 hidden is
    for B = 6, S = 128)."""
    if not isinstance(a, Node) or depth < 0:
        return False
    if a.op == "placeholder":
        return a in params
    if not is_op(a, *_WEIGHT_OPS):
        return False
    inputs = a.all_input_nodes
    return bool(inputs) and all(_from_parameters(x, params, depth - 1) for x in inputs)


class Embedding(Rule):
    """embedding(weight, ids): each token's row of the table."""

    def roles(self, n, tok, grid):
        ids = val(n.args[1])
        if not tok.flat and tok.seq >= ids.dim() or not grid.fits(ids.shape, tok):
            return None
        return {("a", 0): Role("bcast"), ("a", 1): Role("token", tok)}

    def out_tok(self, n, path, tok, grid):
        return tok if path == ("a", 1) else None


class LayerNorm(Rule):
    """aten.native_layer_norm over trailing feature dims: (out, mean, rstd), all row-wise."""

    def roles(self, n, tok, grid):
        x = val(n.args[0])
        k = len(n.args[1])
        if tok.seq >= x.dim() - k or not grid.fits(x.shape, tok):
            return None
        roles = {("a", 0): Role("token", tok)}
        roles.update({path: Role("bcast") for path, _ in _tensor_args(n) if path != ("a", 0)})
        return roles

    def out_tok(self, n, path, tok, grid):
        return tok if path == ("a", 0) else None

    def outputs(self, n, tok):
        return (tok, tok, tok)


class RowOp(Rule):
    """dmfx's row-wise fused ops (the last dim is the row): `x_args` hold token operands of x's shape
    (residual, up), the others broadcast (weights, biases, seeds); outputs of x's shape or of
    x.shape[:-1] (statistics) are token tensors, empty ones (an output not asked for) are not."""

    def __init__(self, x_args: tuple[int, ...]):
        self.x_args = x_args

    def roles(self, n, tok, grid):
        x = val(n.args[0])
        if tok.seq >= x.dim() - 1 or not grid.fits(x.shape, tok):
            return None
        roles = {}
        for path, a in _tensor_args(n):
            if path[0] == "a" and path[1] in self.x_args:
                if list(val(a).shape) != list(x.shape):
                    return None
                roles[path] = Role("token", tok)
            else:
                roles[path] = Role("bcast")
        return roles

    def out_tok(self, n, path, tok, grid):
        return tok if path[0] == "a" and path[1] in self.x_args else None

    def outputs(self, n, tok):
        v = val(n)
        if not isinstance(v, (tuple, list)):
            return tok
        x = val(n.args[0])
        return tuple(tok if isinstance(o, torch.Tensor) and o.dim() >= x.dim() - 1 and o.numel() != 0 else None for o in v)


class Cat(Rule):
    """cat of token tensors along a feature dim, or of one token tensor and legacy empty ``[0]``
    tensors (which cat skips) along any dim but the batch's: HF's DynamicCache, whose first update
    concatenates the keys and values to empty ones. The empty ones stay as they are ("bcast")."""

    @staticmethod
    def _dim(n: Node) -> int:
        x = next(val(a) for a in n.args[0] if not _legacy_empty(val(a)))
        d = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0)
        return d % x.dim()

    def roles(self, n, tok, grid):
        tensors = list(n.args[0])
        full = [a for a in tensors if not _legacy_empty(val(a))]
        if tok.flat or not full or not grid.fits(tensor_meta(n).shape, tok):
            return None
        d = self._dim(n)
        if d == 0 or (d == tok.seq and len(full) > 1):
            return None
        roles = {}
        for j, a in enumerate(tensors):
            if _legacy_empty(val(a)):
                roles[("a", 0, j)] = Role("bcast")
            elif grid.fits(val(a).shape, tok):
                roles[("a", 0, j)] = Role("token", tok)
            else:
                return None
        return roles

    def out_tok(self, n, path, tok, grid):
        return tok if not tok.flat and path[:2] == ("a", 0) and self._dim(n) != 0 else None

    def args(self, n, tok, T):
        return (n.args[0], tok.packed_dim(self._dim(n))), {}


def _rank(v: Any) -> int | None:
    """The rank a node's operands broadcast against: its output's, or a tuple-valued op's largest
    output's (every row-wise tuple op here returns outputs of its rows' rank and statistics of less)."""
    if isinstance(v, torch.Tensor):
        return v.dim()
    ranks = [o.dim() for o in v if isinstance(o, torch.Tensor)] if isinstance(v, (tuple, list)) else []
    return max(ranks) if ranks else None


def _legacy_empty(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() == 1 and _eq(t.shape[0], 0)


class Rope(Rule):
    """``dmfx::rope(q [B, H, S, D], k [B, Hk, S, D], cos, sin, inverse, interleaved, deinterleave)``: each token's
    q and k rotated by the angles of its position. cos and sin broadcast to q as an element-wise op's
    operands do (_operand_role): HF's ``[1, 1, S, D]`` from shared position ids is a position table
    ("pos": gathered by each token's position), ``[B, 1, S, D]`` (position ids per sequence) a token
    tensor; the op broadcasts either over the packed ``[H, T, D]``."""

    def roles(self, n, tok, grid):
        q, k = (val(n.args[i]) for i in (0, 1))
        if tok.flat or q.dim() != 4 or tok.seq != 2 or not (grid.fits(q.shape, tok) and grid.fits(k.shape, tok)):
            return None
        roles = {("a", 0): Role("token", tok), ("a", 1): Role("token", tok)}
        for i in (2, 3):
            role = _operand_role(list(val(n.args[i]).shape), q.dim(), tok, grid)
            if role is None:
                return None
            roles[("a", i)] = role
        return roles

    def out_tok(self, n, path, tok, grid):
        return tok if path in (("a", 0), ("a", 1)) and tok.seq == 2 else None

    def outputs(self, n, tok):
        return (tok, tok)


#: The annotation of a region node's output that is not a token tensor but a whole-batch value its
#: packed node computes exactly (a loss reduced over the real rows): readers outside read the packed
#: value itself, with no scatter.
WHOLE = "whole"


def _first_tok(t: Any) -> Tok:
    """The token annotation a region node packs by: its own, or its first token output's."""
    return t if isinstance(t, Tok) else next(o for o in t if isinstance(o, Tok))


class Loss(Rule):
    """A cross-entropy over every row on the real rows alone: ``dmfx::cross_entropy(logits [B * S, V],
    target [B * S], ...)`` and ``dmfx::linear_cross_entropy(hidden [B * S, H], weight, bias, target
    [B * S], ...)``. A loss over every position is eager's when padding positions hold ignore_index as
    their target (the module docstring's contract: padding positions' logits are not eager's anyway),
    so with reduction mean or sum the packed op's loss is the loss (WHOLE) and no ``[B * S, V]`` logits
    are read for it; so are the weight and bias gradients linear_cross_entropy sums over the rows. The
    per-row lse, the per-row loss of reduction none and dhidden are token tensors; outputs not asked
    for (empty ``[0]`` tensors) are neither."""

    def __init__(self, x_at: int, target_at: int, reduction_at: int):
        self.x_at, self.target_at, self.reduction_at = x_at, target_at, reduction_at

    def roles(self, n, tok, grid):
        if not tok.flat or len(n.args) <= self.reduction_at or n.kwargs:
            return None
        x, target = val(n.args[self.x_at]), val(n.args[self.target_at])
        if x.dim() != 2 or target.dim() != 1 or not (_eq(x.shape[0], grid.B * grid.S)
                                                     and _eq(target.shape[0], grid.B * grid.S)):
            return None
        roles = {("a", self.x_at): Role("token", Tok(0)), ("a", self.target_at): Role("token", Tok(0))}
        roles.update({path: Role("bcast") for path, _ in _tensor_args(n) if path not in roles})
        return roles

    def out_tok(self, n, path, tok, grid):
        return Tok(0) if path in (("a", self.x_at), ("a", self.target_at)) and tok.flat else None

    def outputs(self, n, tok):
        loss = tok if n.args[self.reduction_at] == 0 else WHOLE
        if len(val(n)) == 2:  # (cross_entropy: loss, lse)
            return (loss, tok)
        _, _, dhidden, dweight, dbias = val(n)
        given = lambda t, ann: None if _eq(t.numel(), 0) else ann  # noqa: E731
        return (loss, tok, given(dhidden, tok), given(dweight, WHOLE), given(dbias, WHOLE))


class Split(Rule):
    """split / split_with_sizes / unbind / select / slice / narrow along a feature dim."""

    def __init__(self, dim_at: int, default_dim: int = 0):
        self.dim_at, self.default_dim = dim_at, default_dim

    def _dim(self, n: Node) -> int:
        x = tensor_meta(n.args[0])
        d = n.args[self.dim_at] if len(n.args) > self.dim_at else n.kwargs.get("dim", self.default_dim)
        return d % x.dim()

    def roles(self, n, tok, grid):
        if self._dim(n) <= tok.seq or not grid.fits(val(n.args[0]).shape, tok):
            return None
        return {("a", 0): Role("token", tok)}

    def out_tok(self, n, path, tok, grid):
        return tok if self._dim(n) > tok.seq else None

    def outputs(self, n, tok):
        v = val(n)
        if isinstance(v, (tuple, list)):
            return tuple(tok for _ in v)
        return tok

    def args(self, n, tok, T):
        args, kwargs = list(n.args), dict(n.kwargs)
        d = tok.packed_dim(self._dim(n))
        if len(args) > self.dim_at:
            args[self.dim_at] = d
        else:
            kwargs["dim"] = d
        return tuple(args), kwargs


class Slice(Split):
    """slice along a feature dim, or a whole slice along any dim (from 0 to the end, step 1): the
    identity, which dynamic shapes leave in the graph (HF's repeat_kv, ``k[:, :, None, :, :]``)."""

    def __init__(self):
        super().__init__(1)

    def _whole(self, n: Node) -> bool:
        x, dim, start, end, step = (*n.args, *[None] * (5 - len(n.args)))[:5]
        start, end, step = (n.kwargs.get(k, v) for k, v in (("start", start), ("end", end), ("step", step)))
        to_end = end is None or (isinstance(end, int) and end >= _SENTINEL) or _eq(end, val(x).shape[self._dim(n)])
        return start in (None, 0) and step in (None, 1) and to_end

    def roles(self, n, tok, grid):
        if not self._whole(n):
            return super().roles(n, tok, grid)
        return {("a", 0): Role("token", tok)} if grid.fits(val(n.args[0]).shape, tok) else None

    def out_tok(self, n, path, tok, grid):
        return tok if self._whole(n) else super().out_tok(n, path, tok, grid)

    def args(self, n, tok, T):
        if not self._whole(n):
            return super().args(n, tok, T)
        d = self._dim(n)
        return (n.args[0], tok.packed_dim(tok.seq if d == 0 else d)), {}

_ELEMENTWISE = (
    aten.add, aten.sub, aten.mul, aten.div, aten.neg, aten.pow, aten.rsqrt, aten.sqrt, aten.exp, aten.log,
    aten.gelu, aten.relu, aten.silu, aten.tanh, aten.sigmoid, aten.erf, aten.where, aten.clone, aten.alias,
    aten.native_dropout, aten._to_copy, aten.masked_fill, aten.eq, aten.ne, aten.lt, aten.le, aten.gt, aten.ge,
    aten.abs, aten.reciprocal, aten.clamp, aten.minimum, aten.maximum, aten.bitwise_and, aten.bitwise_or,
    aten.logical_not, aten.type_as,
)
_RULES: dict[Any, Rule] = {op: Rule() for op in _ELEMENTWISE}
_RULES.update({
    aten.mean: Reduce(1, 2), aten.sum: Reduce(1, 2), aten.amax: Reduce(1, 2), aten.var: Reduce(1, 3),
    aten._softmax: Reduce(1, None), aten._log_softmax: Reduce(1, None),
    aten.view: Reshape(), aten._unsafe_view: Reshape(), aten.reshape: Reshape(),
    aten.transpose: Permute(), aten.permute: Permute(), aten.expand: Expand(), aten.unsqueeze: Unsqueeze(),
    aten.addmm: Linear(1), aten.mm: Linear(0), aten.embedding: Embedding(), aten.native_layer_norm: LayerNorm(),
    aten.split: Split(2), aten.split_with_sizes: Split(2), aten.unbind: Split(1), aten.select: Split(1),
    aten.slice: Slice(), aten.narrow: Split(1),
    dmfx.layer_norm: RowOp((0,)), dmfx.rms_norm: RowOp((0,)), dmfx.bias_dropout_residual_norm: RowOp((0, 2)),
    dmfx.dropout: RowOp((0,)), dmfx.bias_act_dropout: RowOp((0,)), dmfx.glu: RowOp((0, 1)), dmfx.rope: Rope(),
    aten.cat: Cat(),
    dmfx.cross_entropy: Loss(0, 1, 4), dmfx.linear_cross_entropy: Loss(0, 3, 6),
})


def _rule(n: Node) -> Rule | None:
    if n.op != "call_function":
        return None
    return _RULES.get(getattr(n.target, "overloadpacket", None))


def _output_toks(n: Node, tok: Any) -> Any:
    """Per output of `n` (a tuple for tuple values) its annotation, `tok` being the node's entry."""
    return tok


# ----------------------------------------------------------------------------------------- the region


class Region:
    """The nodes that run on packed tokens: node -> its output's annotation (a tuple per output for
    tuple-returning nodes), and the attentions it converts."""

    def __init__(self, grid: Grid, attentions: list[AttentionCall]):
        self.grid = grid
        self.tok: dict[Node, Any] = {}
        self.attentions = {a.node: a for a in attentions}
        self.entries: dict[tuple[Node, Tok], None] = {}  # operands gathered from outside

    def value_tok(self, n: Node) -> Tok | None:
        """The annotation of value `n` (a tensor node) when it is in the region."""
        t = self.tok.get(n)
        return t if isinstance(t, Tok) else None

    # --- growth
    def demand(self, x: Any, tok: Tok) -> bool:
        """The region needs `x` packed with annotation `tok`: pull its producer in where it is
        row-wise, else gather it. False on a conflict (x already packed otherwise)."""
        if not isinstance(x, Node):
            return False
        if x in self.tok:
            return self.tok[x] == tok
        if x.target is operator.getitem and isinstance(x.args[0], Node):
            src = x.args[0]
            if src in self.tok:  # (another output of src is in already: this one joins with it)
                outs = self.tok[src]
                if not (isinstance(outs, tuple) and outs[x.args[1]] == tok):
                    return False
                self.tok[x] = tok
                return True
        if x.target is operator.getitem and isinstance(x.args[0], Node):
            return self._demand_output(x, tok)
        rule = _rule(x)
        roles = rule.roles(x, tok, self.grid) if rule is not None and isinstance(val(x), torch.Tensor) else None
        if roles is None:
            self.entries[(x, tok)] = None
            return True
        self.tok[x] = rule.outputs(x, tok)
        for path, role in roles.items():
            if role.kind == "token" and not self.demand(_arg(x, path), role.tok):
                return False
        return True

    def _demand_output(self, x: Node, tok: Tok) -> bool:
        """`x` = getitem(src, i): pull `src` in where its i-th output can be `tok`, else gather `x`."""
        src, i = x.args
        rule = _rule(src)
        roles = rule.roles(src, tok, self.grid) if rule is not None else None
        outs = rule.outputs(src, tok) if roles is not None else None
        if not (isinstance(outs, tuple) and outs[i] == tok):
            self.entries[(x, tok)] = None
            return True
        self.tok[src] = outs
        self.tok[x] = tok
        return all(r.kind != "token" or self.demand(_arg(src, p), r.tok) for p, r in roles.items())

    def grow_forward(self) -> None:
        """Readers of packed values join while they are row-wise in them."""
        changed = True
        while changed:
            changed = False
            for n in list(self.tok):
                for path_user in list(n.users):
                    if path_user in self.tok or path_user.op != "call_function":
                        continue
                    if self._try_join(path_user):
                        changed = True

    def _try_join(self, u: Node) -> bool:
        if u.target is operator.getitem:
            src, i = u.args
            outs = self.tok.get(src)
            if isinstance(outs, tuple) and outs[i] is not None:
                self.tok[u] = outs[i]
                return True
            return False
        rule = _rule(u)
        if rule is None or not isinstance(val(u), torch.Tensor) and not isinstance(val(u), (tuple, list)):
            return False
        if _fills_padding(u, self.grid):
            return False  # (run on the scattered value: scattered back, the region's would read 0 there)
        if any(x is u for x, _ in self.entries):
            return False  # (gathered already, as a layout of its own: it stays outside, padded)
        for path, a in _tensor_args(u):
            t = self.value_tok(a) if a in self.tok else self._getitem_tok(a)
            if not isinstance(t, Tok):  # (outside the region, or a whole-batch value)
                continue
            out = rule.out_tok(u, path, t, self.grid)
            if out is None:
                continue
            roles = rule.roles(u, out, self.grid)
            if roles is None or roles.get(path) is None or roles[path].kind != "token" or roles[path].tok != t:
                continue
            snapshot = (dict(self.tok), dict(self.entries))
            self.tok[u] = rule.outputs(u, out)
            if all(r.kind != "token" or self.demand(_arg(u, p), r.tok) for p, r in roles.items()):
                return True
            self.tok, self.entries = snapshot
        return False

    def roles_of(self, n: Node) -> dict[tuple, Role]:
        """The roles of region node `n`'s operands as it is packed (`n`: neither an attention nor a
        getitem)."""
        return _rule(n).roles(n, _first_tok(self.tok[n]), self.grid) or {}

    def packed_broadcast(self) -> tuple[Node, Node] | None:
        """A region node that reads a packed value as a broadcast operand rather than position for
        position, with that value (``h[:, :, None] * h[:, None]``: an outer product over the tokens,
        which the packed form cannot mix); None if none does."""
        for n in self.tok:
            if n in self.attentions or n.target is operator.getitem:
                continue
            for path, role in self.roles_of(n).items():
                if role.kind != "token" and _arg(n, path) in self.tok:
                    return n, _arg(n, path)
        return None

    def _getitem_tok(self, a: Node) -> Tok | None:
        if a.target is operator.getitem and a.args[0] in self.tok:
            outs = self.tok[a.args[0]]
            if isinstance(outs, tuple):
                return outs[a.args[1]]
        return None


def _token_sources(region: Region, x: Node) -> set[Node]:
    """The region nodes and gathered inputs that `x`'s tokens come from (through token operands)."""
    found: set[Node] = set()
    stack = [x]
    while stack:
        n = stack.pop()
        if n in found:
            continue
        found.add(n)
        if n in region.attentions:
            stack += list(region.attentions[n].operands.values())
            continue
        t = region.tok.get(n)
        if t is None:
            continue  # (gathered from outside)
        if n.target is operator.getitem:
            stack.append(n.args[0])
            continue
        stack += [_arg(n, p) for p, r in region.roles_of(n).items() if r.kind == "token"]
    return found


def _self_attention(region: Region, a: AttentionCall) -> bool:
    """Whether q, k and v are computed from one token tensor (so each query is a token of the keys'
    grid, and a padding key is a padding query): not cross-attention that only looks alike."""
    operands = list(a.operands.values())
    if len(operands) == 1:
        return True
    common = set.intersection(*(_token_sources(region, x) for x in operands))
    return bool(common)


def _seed_attention(region: Region, a: AttentionCall) -> bool:
    """The attention joins the region: its output [B, H, S, Dv] is Tok(2); q, k, v are demanded as
    Tok(2) ([B, H, S, D]) or the stacked projection as Tok(1)."""
    region.tok[a.node] = (Tok(2), None) if a.out is not a.node else Tok(2)
    if a.out is not a.node:
        region.tok[a.out] = Tok(2)
    for name, x in a.operands.items():
        if not region.demand(x, Tok(1) if name == "qkv" else Tok(2)):
            return False
    return True


# ----------------------------------------------------------------------------------------- rewriting


class Packer:
    """Builds the packed graph: the index op, gathers, packed nodes, scatters."""

    def __init__(self, gm: GraphModule, ctx: PassContext, region: Region):
        self.gm, self.graph, self.ctx, self.region, self.grid = gm, gm.graph, ctx, region, region.grid
        self.packed: dict[Node, Node] = {}
        self.gathered: dict[tuple[Node, Tok], Node] = {}
        self._scattered: dict[Node, Node] = {}  # region value -> its padded form
        self._pos: Node | None = None
        self._batch: Node | None = None
        self._sizes: dict[Any, Node] = {}
        self.padded_readers: set[Node] = set()  # nodes outside the region that read its padded values
        last_input = [n for n in self.graph.nodes if n.op == "placeholder"][-1]
        with _at(self.graph, last_input):
            self.index = insert_call(self.graph, ctx, dmfx.unpad_index.default, (self.grid.mask,))
            _bind_unbacked(self.index)
            self.indices, self.cu_seqlens = insert_getitems(self.graph, self.index, 2)
            self.T = insert_call(self.graph, ctx, aten.sym_size.int, (self.indices, 0))
        self.cursor = self.T

    def _call(self, target: Any, args: tuple, kwargs: dict | None = None) -> Node:
        return insert_call(self.graph, self.ctx, target, args, kwargs)

    def _size(self, x: Any) -> Any:
        """A size for an op's argument: an int, or a node computing the SymInt (B, S or B * S)."""
        if isinstance(x, int):
            return x
        for i, d in enumerate((self.grid.B, self.grid.S)):
            if _eq(x, d):
                return self._mask_size(i)
        if _eq(x, self.grid.B * self.grid.S):
            if "BS" not in self._sizes:
                with self._prologue():
                    self._sizes["BS"] = self._call(operator.mul, (self._mask_size(0), self._mask_size(1)))
            return self._sizes["BS"]
        raise _Unsupported(f"a symbolic size {x} that is not the batch's or the sequence's")

    def _mask_size(self, i: int) -> Any:
        d = (self.grid.B, self.grid.S)[i]
        if isinstance(d, int):
            return d
        if i not in self._sizes:
            with self._prologue():
                self._sizes[i] = self._call(aten.sym_size.int, (self.grid.mask, i))
        return self._sizes[i]

    def _prologue(self):
        """Insert after the prologue (the index op, sizes, positions, early gathers), extending it."""
        packer = self

        class _Insert:
            def __enter__(self):
                self.ctx = _at(packer.graph, packer.cursor)
                self.ctx.__enter__()
                self.before = packer.cursor.next

            def __exit__(self, *exc):
                self.ctx.__exit__(*exc)
                packer.cursor = self.before.prev  # the last node inserted

        return _Insert()

    def _near(self, x: Node):
        """Insert right after `x` when it comes after the prologue, else at the prologue's end."""
        return _at(self.graph, x) if _later(x, self.cursor) else self._prologue()

    def positions(self) -> Node:
        """Each packed token's position in its sequence."""
        if self._pos is None:
            S = self._mask_size(1)
            with self._prologue():
                self._pos = self._call(aten.remainder.Scalar, (self.indices, S))
        return self._pos

    def batches(self) -> Node:
        """Each packed token's sequence."""
        if self._batch is None:
            S = self._mask_size(1)
            with self._prologue():
                self._batch = self._call(aten.div.Tensor_mode, (self.indices, S), {"rounding_mode": "floor"})
        return self._batch

    # --- operands
    def gather(self, x: Node, tok: Tok) -> Node:
        """`x` (a padded token tensor from outside the region) packed."""
        key = (x, tok)
        if key not in self.gathered:
            self.positions() if is_op(x, aten.expand) else None  # (made first: the gather may read it)
            self.batches() if is_op(x, aten.expand) else None
            with self._near(x):
                self.gathered[key] = self._gather(x, tok)
        return self.gathered[key]

    def _gather(self, x: Node, tok: Tok) -> Node:
        shape = list(val(x).shape)
        if tok.flat:
            return self._call(aten.index_select.default, (x, 0, self.indices))
        if tok.seq != 1:  # tokens leading first, gathered, then back in place
            moved = self._call(aten.movedim.int, (x, tok.seq, 1))
            packed = self._gather(moved, Tok(1))
            return self._call(aten.movedim.int, (packed, 0, tok.seq - 1))
        rest = shape[2:]
        if not all(isinstance(d, int) for d in rest):
            raise _Unsupported(f"{x.name} has symbolic feature sizes")
        if is_op(x, aten.expand) and tensor_meta(x.args[0]).dim() == len(shape):
            src = tensor_meta(x.args[0]).shape
            if _eq(src[0], 1) and _eq(src[1], self.grid.S) and list(src[2:]) == rest:
                return self._rows(x.args[0], rest, self._pos)  # a position table: no [B, S, ...] copy
            if _eq(src[0], self.grid.B) and _eq(src[1], 1) and list(src[2:]) == rest:
                return self._rows(x.args[0], rest, self._batch)
        return self._rows(x, rest, self.indices)

    def _rows(self, x: Node, rest: list, index: Node) -> Node:
        """index_select(x.reshape(-1, *rest), 0, index)."""
        flat = self._call(aten.reshape.default, (x, [-1, *rest]))
        return self._call(aten.index_select.default, (flat, 0, index))

    def operand(self, x: Node, role: Role, out_tok: Tok, out_nd: int | None) -> Node:
        """The packed node's operand for `x` in `role`."""
        if role.kind == "token":
            return self.packed[x] if x in self.packed else self.gather(x, role.tok)
        if role.kind == "bcast":
            return x  # (a size-1 batch dim is squeezed by the caller, who knows the output's rank)
        shape = list(val(x).shape)
        seq_at = out_tok.seq - (out_nd - len(shape))  # (broadcast against the output, as _operand_role)
        rest = shape[seq_at + 1:]
        if not all(isinstance(d, int) for d in rest):
            raise _Unsupported(f"{x.name} has symbolic feature sizes")
        index = self.positions() if role.kind == "pos" else self.batches()
        with self._near(x):
            return self._rows(x, rest, index)

    # --- nodes
    def pack(self, n: Node) -> None:
        """The packed version of region node `n`, inserted after it."""
        tok = self.region.tok[n]
        if n in self.region.attentions:
            self._pack_attention(self.region.attentions[n])
            return
        if n.target is operator.getitem:
            src = self.packed.get(n.args[0])
            if src is None:  # (an attention's output: packed with it)
                return
            with _at(self.graph, src if _later(src, n) else n):
                g = self.graph.call_function(operator.getitem, (src, n.args[1]))
                sv = val(src)
                if isinstance(sv, (tuple, list)):
                    g.meta["val"] = sv[n.args[1]]
            self.packed[n] = g
            return
        rule = _rule(n)
        out_tok = _first_tok(tok)
        roles = rule.roles(n, out_tok, self.grid)
        checked = self._checked_targets(n, rule) if isinstance(rule, Loss) else None
        args, kwargs = rule.args(n, out_tok, self.T)
        args, kwargs = list(args), dict(kwargs)
        out_nd = _rank(val(n))
        with _at(self.graph, self._latest(n, roles)):
            for path, role in roles.items():
                x = _arg(n, path)
                new = checked if checked is not None and path == ("a", rule.target_at) else \
                    self.operand(x, role, out_tok, out_nd)
                if role.kind == "bcast" and out_nd is not None and val(x).dim() == out_nd and not out_tok.flat:
                    new = self._call(aten.squeeze.dim, (x, 0))  # (its batch dim is 1: the packed output has none)
                _set_arg(args, kwargs, path, new)
            self.packed[n] = self._call(n.target, tuple(args), kwargs)

    def _checked_targets(self, n: Node, rule: Loss) -> Node:
        """The packed targets of a loss, read from the padded ones by ``dmfx::unpad_targets``, which
        raises where a padding position has a target: the loss over the real rows is eager's only where
        none has (its logits are not computed here). A collator's labels ignore padding, but
        ``labels=input_ids`` does not, and in a causal LM HF's shift of the labels puts the first real
        token's label on the padding position before it (left padding, holes). The labels are data, so
        this is checked when the graph runs."""
        target, ignore = n.args[rule.target_at], n.args[rule.target_at + 1]
        if not isinstance(ignore, int):
            raise _Unsupported(f"{n.name}'s ignore_index is not a constant")
        with _at(self.graph, target if _later(target, self.indices) else self.indices):
            packed = self._call(dmfx.unpad_targets.default, (target, self.grid.mask, self.indices, ignore))
        self.padded_readers.add(packed)  # (the targets as eager has them, not scattered back from the rows)
        return packed

    def _latest(self, n: Node, roles: dict) -> Node:
        """Where the packed node of `n` goes: after `n` and after every packed operand it reads."""
        at = n
        for path in roles:
            x = _arg(n, path)
            p = self.packed.get(x)
            if p is not None and _later(p, at):
                at = p
        return at

    def _pack_attention(self, a: AttentionCall) -> None:
        g = self.graph
        at = a.node
        for x in a.operands.values():
            p = self.packed.get(x)
            if p is not None and _later(p, at):
                at = p
        with _at(g, at):
            if a.seed is NEW_SEED:  # (an SDPA call that drops out: its own RNG state is PyTorch's)
                from .graph_utils import insert_seed

                a.seed = insert_seed(g, self.ctx)
            ops = {}
            for name, x in a.operands.items():
                tok = Tok(1) if name == "qkv" else Tok(2)
                ops[name] = self.packed[x] if x in self.packed else self.gather(x, tok)
            if "qkv" in a.operands:
                node = self._call(dmfx.qkv_varlen_attention.default,
                                  (ops["qkv"], a.heads, self.cu_seqlens, a.scale, a.causal, a.seed, a.p))
            else:
                thd = [self._thd(ops[x]) for x in "qkv"]
                node = self._call(dmfx.varlen_attention.default,
                                  (*thd, self.cu_seqlens, a.scale, a.causal, a.seed, a.p))
            out, _ = insert_getitems(g, node, 2)
            # the original output [B, H, S, Dv] packed is [H, T, Dv]
            self.packed[a.out] = self._call(aten.transpose.int, (out, 0, 1))
        record(self.ctx, "unpad", [a.node], into=node)

    def _thd(self, x: Node) -> Node:
        """Packed q, k or v ``[H, T, D]`` as the varlen op's ``[T, H, D]``: a transposed view where that
        is dense (a fused op's or a GEMM's output laid out ``[T, H, D]``), else a contiguous copy. A
        view of an ``[H, T, D]`` tensor an element-wise chain computed (rotary embeddings left
        unfused, as under autocast) had its layout chosen by Inductor, which with the data-dependent
        T need not be the one the backward's saved-tensor checks expect."""
        from torch._prims_common import is_contiguous_or_false

        t = self._call(aten.transpose.int, (x, 0, 1))
        if is_contiguous_or_false(val(t)):
            return t
        return self._call(aten.clone.default, (t,), {"memory_format": torch.contiguous_format})

    def scatter(self, n: Node, tok: Tok) -> Node:
        """Region value `n` back in its padded shape, zeros at the padding. A reshape of another region
        value (the logits viewed [B, S, V] for the output and [B * S, V] for the loss) is that value's
        scatter reshaped: one scatter of the data, not one per view."""
        if n in self._scattered:
            return self._scattered[n]
        src = n.args[0] if is_op(n, aten.view, aten.reshape, aten._unsafe_view) else None
        if isinstance(src, Node) and src in self.packed and isinstance(self.region.tok.get(src), Tok):
            full = self.scatter(src, self.region.tok[src])
            with _at(self.graph, full):
                out = self._call(aten.reshape.default, (full, [self._size(d) for d in val(n).shape]))
        else:
            out = self._scatter(n, tok)
        self._scattered[n] = out
        return out

    def _scatter(self, n: Node, tok: Tok) -> Node:
        p = self.packed[n]
        shape = list(val(n).shape)
        with _at(self.graph, p):
            if not tok.flat and tok.seq != 1:
                moved = self._call(aten.movedim.int, (p, tok.seq - 1, 0))
                full = self._scatter_rows(moved, shape[:1] + [shape[tok.seq]] + [d for i, d in enumerate(shape) if i not in (0, tok.seq)])
                return self._call(aten.movedim.int, (full, 1, tok.seq))
            return self._scatter_rows(p, shape)

    def _scatter_rows(self, p: Node, shape: list) -> Node:
        """[T, ...] -> zeros [B * S, ...] with the rows at indices -> `shape` ([B, S, ...] or [B * S, ...])."""
        rows = [self._size(self.grid.B * self.grid.S), *val(p).shape[1:]]
        zeros = self._call(aten.new_zeros.default, (p, rows))
        full = self._call(aten.index_copy.default, (zeros, 0, self.indices, p))
        return self._call(aten.reshape.default, (full, [self._size(d) for d in shape]))


def _bind_unbacked(n: Node) -> None:
    """Record on `n` the data-dependent sizes its fake value made (``meta["unbacked_bindings"]``, as
    a traced graph has them), taking them off the shape environment's pending list: tracing the graph
    again (AOTAutograd) must not find symbols no node owns."""
    from torch._guards import detect_fake_mode
    from torch.fx.experimental.symbolic_shapes import compute_unbacked_bindings

    mode = detect_fake_mode([n.meta.get("val")])
    shape_env = getattr(mode, "shape_env", None)
    if shape_env is not None:
        bindings = compute_unbacked_bindings(shape_env, n.meta["val"])
        if bindings:
            n.meta["unbacked_bindings"] = bindings


class _Unsupported(Exception):
    pass


def _at(graph: Graph, n: Node):
    """Insert right after `n`, each new node after the previous one (FX's inserting_after would put
    each right after `n`, in reverse order)."""
    return graph.inserting_before(n.next)


def _set_arg(args: list, kwargs: dict, path: tuple, new: Any) -> None:
    if path[0] == "k":
        kwargs[path[1]] = new
    elif len(path) == 3:
        seq = list(args[path[1]])
        seq[path[2]] = new
        args[path[1]] = type(args[path[1]])(seq) if isinstance(args[path[1]], tuple) else seq
    else:
        args[path[1]] = new


def _later(a: Node, b: Node) -> bool:
    """Whether node `a` comes after node `b` in their graph."""
    n = b.next
    while n.op != "root":
        if n is a:
            return True
        n = n.next
    return False


# ----------------------------------------------------------------------------------------- the pass


class _Unpaddable(NamedTuple):
    """An attention the pass may run over packed sequences: the call, the padding mask it reads, its
    batch and sequence sizes, and the longest length its mask was checked at (None: any; MaskCheck)."""

    call: AttentionCall
    source: Node
    B: Any
    S: Any
    longest: int | None


def unpad(gm: GraphModule, ctx: PassContext) -> None:
    """The pass (module docstring); runs only with the option ``unpad=True``."""
    if not getattr(ctx, "unpad", False):
        return
    graph = gm.graph
    calls: list[_Unpaddable] = []
    cache: dict = {}
    for n in list(graph.nodes):
        found = attention_call(n)
        if found is None:
            continue
        if isinstance(found, str):
            ctx.miss("unpad", n, found)
            continue
        shapes = _attention_shapes(found)
        if isinstance(shapes, str):
            ctx.miss("unpad", n, shapes)
            continue
        B, H, S, D, qm = shapes
        why = _varlen_ok(qm, D, D if "qkv" in found.operands else tensor_meta(found.operands["v"]).shape[-1])
        source = longest = None
        if why is None:
            source, causal, why, longest = padding_mask_input(gm, found.mask, H, B, S, cache)
        if why is not None:
            ctx.miss("unpad", n, why)
            continue
        found.causal = found.causal or causal
        calls.append(_Unpaddable(found, source, B, S, longest))
    if not calls:
        return
    sources = {}
    for c in calls:
        sources.setdefault(c.source, []).append(c)
    source, chosen = max(sources.items(), key=lambda kv: len(kv[1]))
    for other, cs in sources.items():
        if other is not source:
            for c in cs:
                ctx.miss("unpad", c.call.node, f"another padding mask ({other.name}) than {source.name}: one per graph is unpadded")
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    is_param = ctx.input_is_parameter or ()
    params = frozenset(p for p, yes in zip(placeholders, is_param) if yes) if len(is_param) == len(placeholders) \
        else frozenset()
    grid = Grid(source, chosen[0].B, chosen[0].S, params)
    mask_shape = val(source).shape
    if not (_unify(mask_shape[0], grid.B) and _unify(mask_shape[1], grid.S)):
        for c in chosen:
            ctx.miss("unpad", c.call.node, f"the padding mask {source.name} {list(mask_shape)} cannot be shown to have "
                                         f"the batch's and sequence's sizes ({grid.B}, {grid.S})")
        return
    _unify_token_inputs(placeholders, params, grid)
    region = Region(grid, [c.call for c in chosen])
    for c in chosen:
        alone = Region(grid, [c.call])
        if not (_seed_attention(alone, c.call) and _self_attention(alone, c.call)):
            region.attentions.pop(c.call.node)
            ctx.miss("unpad", c.call.node, "q, k and v are not computed from one token tensor (cross-attention) or in "
                                         "one layout")
            continue
        snapshot = (dict(region.tok), dict(region.entries))
        if not _seed_attention(region, c.call):
            region.tok, region.entries = snapshot
            region.attentions.pop(c.call.node)
            ctx.miss("unpad", c.call.node, "q, k or v is packed in two different layouts")
    if not region.attentions:
        return
    bounds = [c.longest for c in chosen if c.longest is not None and c.call.node in region.attentions]
    if bounds and not _bound(grid.S, min(bounds)):
        for c in chosen:
            ctx.miss("unpad", c.call.node, f"the sequence length {grid.S} cannot be bounded by {min(bounds)}, the longest "
                                         "its attention mask was checked at")
        return
    region.grow_forward()
    recomputed = recomputed_values(region)
    mixed = region.packed_broadcast()
    reader = (*mixed, f"reads {mixed[1].name}, a value of the real tokens, as a broadcast over other positions (an "
                      "outer product over the tokens)") if mixed is not None else \
        padding_reader(region, recomputed, lambda m: hides_padding_keys(gm, m, grid.mask, cache))
    if reader is not None:
        for a in region.attentions:
            ctx.miss("unpad", a, f"{reader[0].name} ({reader[0].target}) {reader[2]}: eager has values at the "
                                 "padding positions, unpad would have zeros (mask them: multiply by the padding mask)")
        return
    try:
        _rewrite(gm, ctx, region, recomputed)
    except _Unsupported as e:
        raise RuntimeError(f"dmfx: unpad: {e}") from e


# ----------------------------------------------------------------------------------------- the hint


@dataclass(frozen=True)
class PaddingHint:
    """A graph that ``unpad=True`` would run on its real tokens: which input is its padding mask (its
    position among the graph's inputs) and how many attentions read it."""

    input_index: int
    input_name: str
    attentions: int


def _eager_attention_masks(n: Node) -> list[Node]:
    """What an unfused attention's softmax over 4-D scores adds to them, ``_softmax(add(a, b))``: both
    operands (the scores' own fail padding_mask_input at once: they read the weights too)."""
    if not is_op(n, aten._softmax) or not is_op(n.args[0], aten.add):
        return []
    x = n.args[0]
    if tensor_meta(x) is None or tensor_meta(x).dim() != 4:
        return []
    return [a for a in x.args[:2] if isinstance(a, Node) and isinstance(val(a), torch.Tensor)]


def padding_hint(gm: GraphModule) -> PaddingHint | None:
    """Whether `gm` (a lowered graph, fused or not) has attentions that read one HF padding mask, so
    that ``unpad=True`` would skip its padding: the hint the backend logs once, at the first call,
    when the batch is mostly padding (the option is off). None when it has none. A mask unpad would
    only take with a guard on the length (a window checked at its width) is not hinted: that check
    probes thousands of positions, not worth a log line's compile time."""
    cache: dict = {}
    found: dict[Node, int] = {}
    for n in gm.graph.nodes:
        masks = []
        a = attention_call(n)
        if isinstance(a, AttentionCall):
            shapes = _attention_shapes(a)
            if isinstance(shapes, str):
                continue
            B, H, S = shapes[:3]
            masks = [(a.mask, H, B, S)]
        else:
            for m in _eager_attention_masks(n):
                B, H, S = tensor_meta(n).shape[:3]
                masks.append((m, H, B, S))
        for mask, H, B, S in masks:
            source = padding_mask_input(gm, mask, H, B, S, cache, bounded=False).source
            if source is not None:
                found[source] = found.get(source, 0) + 1
    if not found:
        return None
    source, count = max(found.items(), key=lambda kv: kv[1])
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return PaddingHint(inputs.index(source), source.name, count)


# ----------------------------------------------------------------------------------------- readers of the padding

# Reductions (and scans) that read every position along their dims: the position of each one's dim
# argument (None: every dim) and its default when absent (None: every dim).
_REDUCTIONS = {
    aten.sum.default: (None, None), aten.sum.dim_IntList: (1, None), aten.mean.default: (None, None),
    aten.mean.dim: (1, None), aten.amax.default: (1, None), aten.amin.default: (1, None),
    aten.max.default: (None, None), aten.min.default: (None, None), aten.max.dim: (1, None), aten.min.dim: (1, None),
    aten.prod.default: (None, None), aten.prod.dim_int: (1, None), aten.var.correction: (1, None),
    aten.std.correction: (1, None), aten.var_mean.correction: (1, None), aten.logsumexp.default: (1, None),
    aten.cumsum.default: (1, None), aten.cumprod.default: (1, None), aten.argmax.default: (1, None),
    aten.argmin.default: (1, None), aten.any.dim: (1, None), aten.all.dim: (1, None), aten.any.default: (None, None),
    aten.all.default: (None, None), aten.linalg_vector_norm.default: (2, None), aten.sort.default: (1, -1),
    aten.topk.default: (2, -1),
}
def _reduced_dims(n: Node, nd: int) -> list[int] | None:
    """The dims reduction `n` (in _REDUCTIONS) reads along, over a tensor of `nd` dims; None: every one."""
    at, default = _REDUCTIONS[n.target]
    dim = n.kwargs.get("dim", n.args[at] if at is not None and len(n.args) > at else default)
    if dim is None or (isinstance(dim, (list, tuple)) and not dim):
        return None
    return [d % max(nd, 1) for d in (dim if isinstance(dim, (list, tuple)) else [dim])]


# A tensor's axes: which axis of the mask's [B, S] grid each of its dims runs along: "B" (the batch),
# "S" (the sequence), "T" (both, flattened batch-major) or None (a feature dim, or one of size 1).
# None for the whole tensor: not known (a view that splits a token dim unevenly, an index along
# features). (Not a Role: an operand's part in a region op.)
Axes = tuple


def _tok_axes(tok: Tok, nd: int) -> Axes:
    """The axes of a token tensor of `nd` dims annotated `tok`."""
    axes: list = [None] * nd
    if tok.flat:
        axes[0] = "T"
    else:
        axes[0], axes[tok.seq] = "B", "S"
    return tuple(axes)


def _view_axes(before: Any, after: Any, axes: Axes, B: Any, S: Any) -> Axes | None:
    """The axes after a view of shape `before` to `after`: a token dim kept alone keeps its axis, B and
    S merged in order read "T", a "T" split into B and S reads them; any other regrouping of a token
    dim is not known (None). Dims of size 1 carry none (_reshape_groups leaves them out)."""
    groups = _reshape_groups(before, after)
    if groups is None:
        return None
    out: list = [None] * len(after)
    for gi, gj in groups:
        have = tuple(axes[d] for d in gi)
        if not any(have):
            continue
        if len(gj) == 1 and (len(gi) == 1 or have == ("B", "S")):
            out[gj[0]] = have[0] if len(gi) == 1 else "T"
        elif have == ("T",) and len(gj) == 2 and _hint(after[gj[0]]) == _hint(B) and _hint(after[gj[1]]) == _hint(S):
            out[gj[0]], out[gj[1]] = "B", "S"
        else:
            return None
    return tuple(out)


def _axes_after(u: Node, via: Node, axes: Axes | None, grid: Grid) -> Axes | None:
    """The axes of `u`'s result, where `u` passes the positions of `via` (of `axes`) on
    (_reads_padding gave None): permutations and views move them, a broadcast adds leading dims, a
    reduction or a pick of features drops its dims, a GEMM keeps its operand's free dims; None where
    not known. Only a product with the padding mask reads them (_masked_by: the mask's axes must be
    the product's)."""
    if axes is None:
        return None
    t, nd, out = u.target, len(axes), _rank(val(u))
    if out is None:
        return None
    if t in (aten.view.default, aten._unsafe_view.default, aten.reshape.default):
        before, after = tensor_meta(via), tensor_meta(u)
        return None if before is None or after is None else _view_axes(before.shape, after.shape, axes, grid.B, grid.S)
    if t is aten.permute.default:
        return tuple(axes[d % nd] for d in u.args[1])
    if t is aten.transpose.int or t is aten.t.default:
        a, b = (u.args[1] % nd, u.args[2] % nd) if t is aten.transpose.int else (0, nd - 1)
        swapped = list(axes)
        swapped[a], swapped[b] = axes[b], axes[a]
        return tuple(swapped)
    if t is aten.unsqueeze.default:
        d = u.args[1] % (nd + 1)
        return (*axes[:d], None, *axes[d:])
    if t in (aten.squeeze.dim, aten.squeeze.default):
        meta = tensor_meta(via)
        if meta is None:
            return None
        dims = [u.args[1] % nd] if t is aten.squeeze.dim else range(nd)
        gone = {d for d in dims if _eq(meta.shape[d], 1)}
        return tuple(r for d, r in enumerate(axes) if d not in gone)
    if t is aten.select.int:  # (along features or the batch: _pick)
        return (*axes[:u.args[1] % nd], *axes[u.args[1] % nd + 1:])
    if t is aten.index.Tensor and _index_dim(u) is None:
        return None  # (several indices along features: where the others go depends on them)
    if t in _REDUCTIONS:  # (keepdim: the reduced dims stay, of size 1; else they go)
        dims = _reduced_dims(u, nd) or []
        if out >= nd:
            return tuple(None if d in dims else r for d, r in enumerate(axes))
        return tuple(r for d, r in enumerate(axes) if d not in dims) if out == nd - len(dims) else None
    if t in _GEMMS and any(u.args[at] is via for at, _ in _GEMMS[t]):
        # (the first operand's free dims, then the second's last; bmm's batch dim is both's)
        (a_at, a_dim), (b_at, b_dim) = _GEMMS[t]
        a = [r for d, r in enumerate(axes) if d != a_dim] if u.args[a_at] is via else [None] * (out - 1)
        b = [r for d, r in enumerate(axes) if d != b_dim] if u.args[b_at] is via else [None] * (out - 1)
        if len(a) != out - 1 or len(b) != out - 1 or out == 3 and None not in (a[0], b[0]) and a[0] != b[0]:
            return None
        return (a[0], b[0]) if out == 2 else (a[0] or b[0], a[1], b[1])
    if t in _LOSSES:
        return axes[:1] if out == 1 else None
    a = attention_call(u)
    if isinstance(a, AttentionCall):
        return (*axes[:-1], None) if a.operands.get("q") is via and out == nd else None
    if t is operator.getitem or getattr(t, "overloadpacket", None) in _ROW_OPS or t in _ALONG or t in _SLICES \
            or t in (aten.gather.default, aten.index.Tensor) or t in _PASS_THROUGH and t is not aten.expand.default:
        return (*axes, *[None] * (out - nd)) if out >= nd else None  # (row-wise: leading dims kept)
    if out >= nd:  # (an element-wise op, an expand: broadcast to the right)
        return (*[None] * (out - nd), *axes)
    return None


# Comparisons with a number, and ``1 - mask``: what each gives for the value at the padding positions.
_MASK_OPS = {aten.eq.Scalar: operator.eq, aten.ne.Scalar: operator.ne, aten.gt.Scalar: operator.gt,
             aten.ge.Scalar: operator.ge, aten.lt.Scalar: operator.lt, aten.le.Scalar: operator.le,
             aten.rsub.Scalar: lambda v, c: c - v}


def _mask_axes(x: Any, source: Node, grid: Grid) -> tuple[Axes, Any] | None:
    """Where `x` is computed from the padding mask `source` ([B, S], 0 at the padding positions) alone,
    through views, permutations, casts and expands (_PASS_THROUGH), comparisons with a number, a not
    or ``1 - mask``: its axes, and its value at every padding position (``~mask.bool()``: True,
    ``mask[..., None].float()``: 0.0); None where it is not."""
    chain = []
    while isinstance(x, Node) and x is not source and x.op == "call_function" and x.args:
        chain.append(x)
        x = x.args[0]
    if x is not source:
        return None
    axes: Axes | None = ("B", "S")
    value: Any = 0
    for u in reversed(chain):
        t, meta = u.target, tensor_meta(u)
        if meta is None:
            return None
        if t in _MASK_OPS and len(u.args) == 2 and not u.kwargs and isinstance(u.args[1], (int, float)):
            value = _MASK_OPS[t](value, u.args[1])
        elif t is aten.logical_not.default:
            value = not value
        elif t is aten.bitwise_not.default and isinstance(value, (bool, int)):
            value = not value if isinstance(value, bool) else ~value
        elif t not in _PASS_THROUGH:
            return None
        value = bool(value) if meta.dtype == torch.bool else float(value) if meta.dtype.is_floating_point else int(value)
        axes = _axes_after(u, u.args[0], axes, grid)
        if axes is None:
            return None
    return axes, value


def _number(a: Any) -> Any:
    """The number `a` holds: a Python number, or a one-element constant (``scalar_tensor``, ``full([], v)``,
    a lifted constant); None where it is not one."""
    if isinstance(a, (int, float, bool)):
        return a
    if not isinstance(a, Node):
        return None
    if a.target in (aten.lift_fresh_copy.default, aten.clone.default, aten._to_copy.default, aten.detach.default):
        return _number(a.args[0])
    if a.op == "get_attr":
        t = getattr(a.graph.owning_module, str(a.target), None)
    else:
        t = constant_value(a, max_elements=1)
    return t.item() if isinstance(t, torch.Tensor) and t.numel() == 1 else None


def _fills_padding(n: Node, grid: Grid) -> bool:
    """Whether `n` puts a number other than 0 at the padding positions of a value not computed from the
    mask (a max pooling's ``hidden.masked_fill(~mask[..., None].bool(), -1e9)``): it stays outside the
    region, where it reads the scattered value, and its readers are then eager's (_masked_by)."""
    meta = tensor_meta(n)
    if n.target not in (aten.masked_fill.Scalar, aten.masked_fill.Tensor, aten.where.self) or meta is None:
        return False
    tok = grid.tok_of(meta.shape)
    if tok is None or not any(isinstance(a, Node) and _mask_axes(a, grid.mask, grid) is None and
                              (m := tensor_meta(a)) is not None and m.numel() > 1 for a in n.args):
        return False
    axes = _tok_axes(tok, meta.dim())
    return _masked_by(n, axes, grid) and not _masked_by(n, axes, grid, zeros=True)


def _masked_by(n: Node, axes: Axes | None, grid: Grid, zeros: bool = False) -> bool:
    """Whether `n` masks the padding positions out, to the same value as in eager (a masked mean
    pooling's ``hidden * mask[..., None]``, E5's ``hidden.masked_fill(~mask[..., None].bool(), 0)``,
    ``torch.where(mask[..., None].bool(), hidden, 0)``, sentence-transformers' max pooling's
    ``hidden[mask_expanded == 0] = -1e9``): a product with the padding mask (_mask_axes), a fill or
    an index_put of a number where it is 0, a where taking a number there; and its axes, broadcast to
    `n`'s dims (on the right; an index_put's on the left), are `axes` (`n`'s) at every dim over size
    1. `zeros`: `n` is a region value, scattered back with zeros at the padding positions, so it must
    put 0 there too (a fill of -1e9 would read 0). A mask transposed or along the features
    (``h * mask[:, None, :]`` with S == H), or a value whose positions were moved or swapped (`axes`
    None; ``h.transpose(0, 1)`` with B == S), is not one."""
    meta = tensor_meta(n)
    if n.op != "call_function" or axes is None or meta is None or len(axes) != meta.dim():
        return False
    number = lambda a: not isinstance(a, Node) or (m := tensor_meta(a)) is not None and m.numel() == 1  # noqa: E731
    t, left, fill = n.target, False, 0
    if t is aten.mul.Tensor:
        masks = [(a, True) for a in n.args[:2]]
    elif t in (aten.masked_fill.Scalar, aten.masked_fill.Tensor):
        masks, fill = [(n.args[1], False)], n.args[2]
    elif t is aten.where.self:
        at = 2 if number(n.args[2]) else 1 if number(n.args[1]) else None
        masks, fill = ([(n.args[0], at == 2)], n.args[at]) if at else ([], 0)
    elif t is aten.index_put.default and not (n.args[3] if len(n.args) > 3 else n.kwargs.get("accumulate", False)):
        given = [i for i in n.args[1] if i is not None]
        ok = len(given) == 1 and n.args[1][0] is given[0] and number(n.args[2]) and \
            getattr(tensor_meta(given[0]), "dtype", None) == torch.bool  # (a bool mask: an integer one picks positions)
        masks, left, fill = [(given[0], False)] if ok else [], True, n.args[2]
    else:
        return False
    if zeros and _number(fill) != 0:
        return False
    for a, zero in masks:  # (whether the mask must be 0 at the padding positions, or nonzero there)
        found = _mask_axes(a, grid.mask, grid)
        if found is None or bool(found[1]) == zero or len(found[0]) > len(axes):
            continue
        pad = [None] * (len(axes) - len(found[0]))
        mask = (*found[0], *pad) if left else (*pad, *found[0])
        if all(m == r or _eq(size, 1) for m, r, size in zip(mask, axes, meta.shape)) and any(mask):
            return True
    return False


_HEAVY = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten.embedding.default,
          aten.convolution.default}


def recomputed_values(region: Region) -> set[Node]:
    """The region values readers outside the region read as the graph computes them on the padded batch
    rather than scattered back: those the region computes from the inputs with no GEMM, embedding,
    attention or dmfx op (RoBERTa's ``input_ids != pad`` before the cumsum of its positions, a padding
    mask cast to float for a pooling), cheap to compute twice, and eager's values at the padding
    positions too (scattered back, they would read zeros there)."""
    light: set[Node] = set()
    for n in region.grid.mask.graph.nodes:  # (graph order: a node's inputs are decided before it)
        if n not in region.tok or n in region.attentions or n.target in _HEAVY:
            continue
        if isinstance(n.target, torch._ops.OpOverload) and n.target.namespace == "dmfx":
            continue
        if all(a in light for a in n.all_input_nodes if a in region.tok):
            light.add(n)
    return light


# Ops that pick positions (the pooler's token 0, a classifier's last real token): what they read is
# the module docstring's contract (a graph output's padding positions), not a reduction over them.
# Each is a pick only along a dim of a token size; along feature dims alone it passes the positions on
# (_pick).
_PICKS = {aten.select.int, aten.index.Tensor, aten.gather.default}
# Slices: a run of positions (or features) passed on, the position of their dim argument and its
# default; along the tokens, its length reads as a token size after it (_token_sizes_after).
_SLICES = {aten.slice.Tensor: (1, 0), aten.narrow.default: (1, None), aten.index_select.default: (1, None)}
# Row-wise ops along a dim (the position of their dim argument, None: the last dim): a softmax over the
# tokens reads every position along them.
_ALONG = {aten._softmax.default: 1, aten._log_softmax.default: 1, aten.softmax.int: 1, aten.log_softmax.int: 1,
          dmfx.attention_softmax.default: None}
# GEMMs: (the position of the first operand, the dim it contracts) and the same for the second.
_GEMMS = {aten.mm.default: ((0, 1), (1, 0)), aten.addmm.default: ((1, 1), (2, 0)), aten.bmm.default: ((0, 2), (1, 1)),
          aten.baddbmm.default: ((1, 2), (2, 1))}
# Losses over rows: the position of their reduction argument (0: none, a per-row loss).
_LOSSES = {dmfx.cross_entropy.default: 4, dmfx.linear_cross_entropy.default: 6, aten.nll_loss_forward.default: 3,
           aten.nll_loss2d_forward.default: 3}


# Ops row-wise over their last dim whatever their arguments (element-wise ops, dmfx's fused row ops).
_ROW_OPS = {*_ELEMENTWISE, dmfx.layer_norm, dmfx.rms_norm, dmfx.bias_dropout_residual_norm, dmfx.dropout,
            dmfx.bias_act_dropout, dmfx.glu, dmfx.rope, aten.embedding}


def _shapes_only(n: Node) -> bool:
    """Whether `n` reads only its operands' shapes (a fill, SymInt arithmetic), not their values."""
    return n.target in _FILLS or isinstance(n.target, torch._ops.OpOverload) and n.target.name().startswith("aten::sym_")


def _pointwise(n: Node) -> bool:
    return isinstance(n.target, torch._ops.OpOverload) and torch.Tag.pointwise in n.target.tags


def _reads_padding(u: Node, via: Node, sizes: tuple, axes: Axes | None, masked: bool, grid: Grid,
                   hides_padding: Callable[[Any], bool]) -> bool | str | None:
    """What op `u`, reading the padding positions of `via` (a scattered value, or one computed from it,
    of `axes`: _axes_after), does with them: reads along them (True: its real rows would read eager's
    values there), passes them on position for position (None: its readers are looked at), picks one
    per row ("pick": _pick), masks them (`masked`, "masked": a product with the padding mask,
    _masked_by of `u`'s axes), or none of these (False: an output, a shape read, an attention that
    hides them). Dims are the tokens' by their axes where known, else by their sizes (`sizes`).
    `hides_padding(mask)`: whether an attention mask hides the padding keys."""
    t = u.target
    token = _tokens(sizes)
    meta = tensor_meta(via)
    if t is operator.getitem or t in _PASS_THROUGH or t in _SLICES or _pointwise(u) and not masked \
            or _index_dim(u) is not None:
        return None
    if t in _PICKS and u.op == "call_function":
        return _pick(u, via, axes, token, grid)
    if u.op == "call_function" and masked:
        return "masked"
    if u.op != "call_function" or not isinstance(t, torch._ops.OpOverload) or _shapes_only(u):
        return False  # (an output, a shape read, SymInt arithmetic)
    if meta is None:
        return True
    last = axes[-1] is not None if axes else token(meta.shape[-1]) if meta.dim() else False
    if t in _REDUCTIONS:
        dims = _reduced_dims(u, meta.dim()) if u.args[0] is via else None
        return True if dims is None or any(token(meta.shape[d]) for d in dims) else None
    if t in _ALONG:
        return True if token(meta.shape[(-1 if _ALONG[t] is None else u.args[_ALONG[t]]) % meta.dim()]) else None
    if t in _GEMMS:
        for at, dim in _GEMMS[t]:
            if u.args[at] is via and token(meta.shape[dim]):
                return True
        return None
    if t in _LOSSES:  # (per row unless reduced, or its classes are positions: a span's start logits)
        classes = [axes[d] is not None if axes else token(meta.shape[d]) for d in range(1, meta.dim())]
        return True if u.args[_LOSSES[t]] != 0 or u.args[0] is via and any(classes) else None
    a = attention_call(u)
    if isinstance(a, AttentionCall):
        keys = [x for name, x in a.operands.items() if name != "q"]
        if via not in keys:
            return None  # (the queries: each output row reads its own)
        return False if hides_padding(a.mask) else True  # (keys hidden: the output reads none of them)
    if getattr(t, "overloadpacket", None) in _ROW_OPS:  # (row-wise over the last dim: a norm over it)
        return True if last and t.namespace == "dmfx" else None
    return True  # (an op unpad does not know: it may read along the tokens)


def _index_dim(u: Node) -> int | None:
    """The dim `u` indexes when it is ``x[..., idx]`` with one 1-D integer index (``h[:, [0, 6]]``: an
    index_select), else None (several indices pick one position per row: GPT-2's classifier taking
    each sequence's last token, a pick)."""
    if u.target is not aten.index.Tensor or len(u.args) < 2:
        return None
    given = [(d, i) for d, i in enumerate(u.args[1]) if i is not None]
    if len(given) != 1 or not isinstance(given[0][1], Node):
        return None
    d, i = given[0]
    meta = tensor_meta(i)
    return d if meta is not None and meta.dim() == 1 and not meta.dtype.is_floating_point and \
        meta.dtype != torch.bool else None


def _tokens(sizes: tuple) -> Callable[[Any], bool]:
    """Whether a dim's size is one of `sizes` (the token sizes the reader walk knows)."""
    return lambda d: any(_alike(d, x) for x in sizes)


def _pick(u: Node, via: Node, axes: Axes | None, token: Callable[[Any], bool], grid: Grid) -> bool | str | None:
    """What `u` (in _PICKS) does with the positions of `via` (of `axes`; None: not known, judged by
    sizes, `token`): "pick" where it picks one position per row (a select or a one-wide gather along the
    sequence, the pooler's token 0; an index of one position per row, GPT-2's classifier's last token:
    the graph outputs' contract); None where it passes them on (features picked, a batch row
    selected, a gather of several positions: a slice of them); True where it reads them otherwise
    (several positions per row by an advanced index, a bool index over the tokens: ``h[mask.bool()]``
    under Dynamo's capture of data-dependent shapes)."""
    meta, out = tensor_meta(via), tensor_meta(u)
    if meta is None or out is None:
        return True
    nd = max(meta.dim(), 1)
    along = lambda d: axes[d] in ("S", "T") if axes is not None else token(meta.shape[d])  # noqa: E731
    if u.target is aten.select.int:
        d = u.args[1] % nd
        if axes is None:  # (a batch row, or a position: not known)
            return True if token(meta.shape[d]) else None
        return "pick" if along(d) else None
    if u.target is aten.gather.default:
        d = u.args[1] % nd
        if axes is None and token(meta.shape[d]):
            return True if _eq(out.shape[d], 1) else None
        return "pick" if along(d) and _eq(out.shape[d], 1) else None
    given = [(d, i) for d, i in enumerate(u.args[1]) if i is not None]
    metas = [tensor_meta(i) for _, i in given]
    if any(m is None for m in metas):
        return True
    tokens = lambda dims: any(axes[d] if axes is not None else token(meta.shape[d]) for d in dims)  # noqa: E731
    if any(m.dtype in (torch.bool, torch.uint8) for m in metas):  # (a mask's selection: rows of any position)
        d = given[0][0]
        return True if tokens(range(d, d + metas[0].dim())) else None
    dims = [d for d, _ in given]
    if not tokens(dims):
        return None
    if axes is None or not any(axes[d] in ("S", "T") for d in dims):
        return True
    per_row = math.prod(_hint(x) for x in torch.broadcast_shapes(*[m.shape for m in metas]))
    rows = _hint(grid.B) if any(axes[d] == "B" for d in dims) else 1
    return "pick" if per_row == rows else True


def _reshape_groups(a: Any, b: Any) -> list[tuple[list[int], list[int]]] | None:
    """The dims of shape `a` and of shape `b` (a view's input and output) in groups of equal products, in
    order, size-1 dims left out (``[B, S, H] -> [B, S * H]``: ([0], [0]), ([1, 2], [1])); None where
    they do not pair up (a zero size). Judged on the sizes' hints: a symbolic graph regroups as its
    example does."""
    ha, hb = [_hint(x) for x in a], [_hint(x) for x in b]
    if 0 in ha or 0 in hb or math.prod(ha) != math.prod(hb):
        return None
    ia, ib = [d for d, x in enumerate(ha) if x != 1], [d for d, x in enumerate(hb) if x != 1]
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(ia):  # (equal products of sizes over 1: neither side runs out first)
        gi, gj, pa, pb = [ia[i]], [ib[j]], ha[ia[i]], hb[ib[j]]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb:
                gi.append(ia[i])
                pa, i = pa * ha[ia[i]], i + 1
            else:
                gj.append(ib[j])
                pb, j = pb * hb[ib[j]], j + 1
        groups.append((gi, gj))
    return groups


def _position_dim(u: Node) -> int | None:
    """The dim along which `u` reads a run or a choice of positions (as given: maybe negative): a
    slice's, an index_select's, a gather's, an index by one 1-D index's (_index_dim); else None."""
    if u.target in _SLICES:
        at, default = _SLICES[u.target]
        dim = u.args[at] if len(u.args) > at else u.kwargs.get("dim", default)
    elif u.target is aten.gather.default:
        dim = u.args[1]
    else:
        dim = _index_dim(u)
    return dim


def _token_sizes_after(u: Node, via: Node, sizes: tuple) -> tuple:
    """The sizes that read as tokens after `u` (reading `via`), where it moves the tokens into a dim of
    another size: a slice (or an index_select, an index by one 1-D index, a gather) of two positions or
    more along a dim of a token size (``h[:, -4:]``: a mean over those four reads the padding as much
    as one over all of them; one position is a pick), or a view merging or splitting one
    (``h.reshape(B, -1).amax(1)`` reads every position)."""
    before, after = tensor_meta(via), tensor_meta(u)
    if before is None or after is None:
        return sizes
    token = _tokens(sizes)
    new: list[Any] = []
    if u.target in (aten.view.default, aten._unsafe_view.default, aten.reshape.default):
        groups = _reshape_groups(before.shape, after.shape)
        if groups is None:  # (unpaired: every output size may hold tokens)
            new = list(after.shape) if any(token(d) for d in before.shape) else []
        for gi, gj in groups or ():
            if any(token(before.shape[d]) for d in gi):
                new += [after.shape[d] for d in gj]
    elif (dim := _position_dim(u)) is not None and token(before.shape[dim % before.dim()]):
        new = [after.shape[dim % before.dim()]]
    new = [m for m in new if not (_eq(m, 1) or token(m))]
    return (*sizes, *new) if new else sizes


def _moves(u: Node, via: Node, sizes: tuple) -> bool:
    """Whether `u`, passing the positions of `via` on, puts some at other positions: a slice shorter
    than a dim of a token size (``h[:, -1:]``), an index_select, index or gather along one (a
    permutation too)."""
    dim = _position_dim(u)
    if dim is None:
        return False
    before, after = tensor_meta(via), tensor_meta(u)
    if before is None or after is None:
        return True
    d = dim % before.dim()
    if not any(_alike(before.shape[d], x) for x in sizes):
        return False
    return u.target not in (aten.slice.Tensor, aten.narrow.default) or not _eq(after.shape[d], before.shape[d])


def padding_reader(region: Region, recomputed: set[Node],
                   hides_padding: Callable[[Any], bool]) -> tuple[Node, Node, str] | None:
    """A reader outside the region of a value it scatters back to [B, S, ...] that reads the padding
    positions, with the value it reads and how (a phrase); None if there is none. There eager has
    values and the unpadded graph zeros, so the result of real rows would differ: the pass leaves the
    graph alone.

    The walk follows each scattered value through the ops that pass each position on (views,
    element-wise ops, slices, reductions over feature dims, GEMMs over them, attention reading it as
    queries, features picked, a batch row selected), carrying its *axes* (where its batch and
    sequence dims went: _axes_after; None once not known). A reader is (_reads_padding): a reduction
    or a scan over a token dim (by its axis, else by its size: B's, S's, B * S's, a slice's of them or a
    view's merging them, _token_sizes_after: an unmasked mean over the tokens or the last four, a
    cumsum, a max over ``h.reshape(B, -1)``), a softmax along one, a GEMM contracting one
    (``h.transpose(1, 2) @ h``), a loss over the rows or whose classes are positions, a dmfx norm over
    one, an attention reading it as keys or values whose mask does not hide the padding keys
    (`hides_padding`; one that hides them reads none of it), several positions per row picked, or an
    op the pass does not know. Not readers: picking one position per row (the pooler's token 0, the
    last real token: its contract is the graph outputs', module docstring; _pick), a value in
    `recomputed` (recomputed_values), and a mask of the padding whose axes meet the value's, with
    nothing on the way that moved positions (_masked_by: ``h * mask[..., None]``, E5's fill, a
    where; a transposed mask with B == S is not one).

    A value back in the region is a reader too unless the region gathers it position for position (an
    entry, region.entries) with the axes it gathers along (_axes_meet: not a transposed value with S ==
    H) and nothing on the way moved positions (_moves, _regroups: ``h + h[:, -1:]`` adds a padding
    position's value to every real token's where the last one is padding, ``h.reshape(B, H, S)`` mixes
    positions) or picked them (a packed value the region reads as a broadcast: Region.packed_broadcast,
    asked first). A masked value (zero at the padding, as in eager) may come back at other positions,
    or as a per-sequence broadcast (a masked mean added back: _read_per_row), in a layout the region
    gathers it in. Where axes are not known, sizes decide: a feature dim of a token size reads as one
    (the graph stays padded: slower, never wrong)."""
    grid = region.grid
    sizes = (grid.B, grid.S, grid.B * grid.S)
    gathered: dict[Node, list[Tok]] = {}
    for x, t in region.entries:
        gathered.setdefault(x, []).append(t)
    seen: set[tuple] = set()
    for n, tok in region.tok.items():
        if not isinstance(tok, Tok) or n in recomputed:
            continue
        start = _tok_axes(tok, _rank(val(n)) or 0)
        # (mode "": positions passed on, with their axes (None: not known); "moved": some at other
        # positions; "picked": a pick's result; "masked": zero at the padding, as in eager, so only
        # the layout it is read back into the region in matters)
        mode = "masked" if _masked_by(n, start, grid, zeros=True) else ""
        stack = [(u, n, sizes, mode, start) for u in n.users if u not in region.tok]
        while stack:
            u, via, along, mode, axes = stack.pop()
            if (u, via, mode, axes) in seen:
                continue
            seen.add((u, via, mode, axes))
            if u in region.tok:
                if mode in ("", "masked") and via in gathered and all(_axes_meet(axes, t, via) for t in gathered[via]) \
                        or mode == "masked" and via not in gathered and _read_per_row(region, u, via, axes):
                    continue
                how = "picked" if mode == "picked" else "at other positions" if mode == "moved" else \
                    "in another layout" if via in gathered else "as a broadcast"
                return u, n, f"reads {via.name}, computed from {n.name} {how}, back in the unpadded region"
            if mode in ("picked", "masked"):
                if u.op == "call_function" and not _shapes_only(u):
                    after = _axes_after(u, via, axes, grid) if mode == "masked" else None
                    stack += [(w, u, along, mode, after) for w in u.users]
                continue
            after = _axes_after(u, via, axes, grid)
            reads = _reads_padding(u, via, along, axes, _masked_by(u, after, grid), grid, hides_padding)
            if reads is True:
                return u, n, f"reads {n.name} along the batch or the sequence, padding positions included"
            if reads is None:
                moved = mode or _moves(u, via, along) or _regroups(u, via, axes, _tokens(along), grid)
                stack += [(w, u, _token_sizes_after(u, via, along), "moved" if moved else "", None if moved else after)
                          for w in u.users]
            elif reads == "masked":
                stack += [(w, u, along, "masked", after) for w in u.users]
            elif reads == "pick":
                stack += [(w, u, along, "picked", None) for w in u.users]
    return None


def _read_per_row(region: Region, u: Node, via: Node, axes: Axes | None) -> bool:
    """Whether region node `u` reads `via` (of `axes`) as a broadcast its rows read as they are: by each
    token's sequence (a [B, 1, ...] tensor, "batch", its batch dim first) or whole ("bcast"), with no
    other token axis (a masked mean added back to each token)."""
    if axes is None or u in region.attentions or u.target is operator.getitem:
        return False
    kinds = {r.kind for p, r in region.roles_of(u).items() if _arg(u, p) is via}
    allowed = {"batch": ("B",), "bcast": ()}
    if not kinds or any(k not in allowed for k in kinds):
        return False
    for k in kinds:
        at = [d for d, a in enumerate(axes) if a is not None]
        if any(axes[d] not in allowed[k] for d in at) or len(at) > 1 or k == "batch" and at not in ([], [0]):
            return False
    return True


def _axes_meet(axes: Axes | None, tok: Tok, x: Node) -> bool:
    """Whether value `x`, of `axes`, has its tokens where the region gathers them from (`tok`), at
    every dim over size 1."""
    meta = tensor_meta(x)
    if axes is None or meta is None or len(axes) != meta.dim():
        return False
    return all(a == e or _eq(size, 1) for a, e, size in zip(axes, _tok_axes(tok, meta.dim()), meta.shape))


def _regroups(u: Node, via: Node, axes: Axes | None, token: Callable[[Any], bool], grid: Grid) -> bool:
    """Whether `u` is a view that regroups the positions of `via` (of `axes`, else judged by sizes,
    `token`) with other dims into dims of other sizes (``h.reshape(B, H, S)``: each output position
    holds parts of several), other than merging dims (order kept) or splitting B * S into B and S."""
    if u.target not in (aten.view.default, aten._unsafe_view.default, aten.reshape.default):
        return False
    before, after = tensor_meta(via), tensor_meta(u)
    if before is None or after is None:
        return True
    groups = _reshape_groups(before.shape, after.shape)
    if groups is None:
        return any(token(d) for d in before.shape)
    for gi, gj in groups:
        has = [axes[d] if axes is not None else token(before.shape[d]) for d in gi]
        if len(gj) == 1 or not any(has):
            continue
        if len(gi) == 1 and [_hint(after.shape[j]) for j in gj] == [_hint(grid.B), _hint(grid.S)] and has[0] in ("T", True):
            continue
        return True
    return False


def _rewrite(gm: GraphModule, ctx: PassContext, region: Region, recomputed: set[Node]) -> None:
    graph = gm.graph
    packer = Packer(gm, ctx, region)
    order = [n for n in graph.nodes if n in region.tok]
    for n in order:
        packer.pack(n)
    # readers outside the region (and graph outputs) read the padded values back
    for n in order:
        if n not in packer.packed:
            continue
        outside = [u for u in n.users if u not in region.tok and u not in packer.padded_readers]
        tok = region.tok[n]
        if outside and tok == WHOLE:  # (computed exactly on the real rows: read as it is)
            for u in outside:
                u.replace_input_with(n, packer.packed[n])
            continue
        if not outside or not isinstance(tok, Tok) or n in recomputed:
            continue  # (outside readers of a recomputed value read it as the graph computes it)
        full = packer.scatter(n, tok)
        for u in outside:
            u.replace_input_with(n, full)
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    ctx.unpadded = {"mask": region.grid.mask.name, "input_index": inputs.index(region.grid.mask),
                    "attentions": len(region.attentions),
                    "row_ops": sum(1 for n in order if n not in region.attentions and n.target is not operator.getitem)}
    rows = " x ".join(str(d) for d in (region.grid.B, region.grid.S))
    log.debug("dmfx: unpad: %d nodes run on the real tokens of %s's [%s] grid", len(order), region.grid.mask.name, rows)

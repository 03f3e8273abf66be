"""The paper's SM kernel: scale + mask + softmax + dropout over attention scores, in one pass.

Starts from every softmax over the last dim (``aten._softmax`` or ``aten._safe_softmax``, with the
casts HF writes around it under autocast) and walks up and down its chain::

    s  = view(bmm(q, k_t))                      (the scores; any tensor works)
    s' = s * c  |  s / c                        (optional; c a Python number)
    z  = s' + mask                              (optional, either operand order; mask broadcastable)
    p  = softmax(z, -1)                         (_softmax / _safe_softmax / cast -> softmax -> cast)
    o  = native_dropout(p, p_drop, True)[0]     (optional)
                     -> dmfx::attention_softmax(s, mask, c, causal, seed, p_drop) -> (o, p)

Masks are used as they are: a bool mask turned additive by ``where(m, 0, -inf)`` becomes the bool
mask itself (read as 1 byte per element instead of 4), a causal mask the graph computes from
constants (``tril(ones(S, S))``, HF's create_causal_mask of an eager-attention model in training:
``_is_causal_constant``) becomes ``causal=True`` (nothing read at all, and the attention kernels skip
the masked half), any other additive mask (HF's 0 / finfo.min padding masks, T5's position bias, which
may require grad) is passed through. Scales that SDPA's math path splits onto
q and k (``q * sqrt(c)``, ``k_t * sqrt(c)`` before the batched GEMM) are moved into the fused op
(GEMMs are linear), removing two element-wise passes; not for float16, where the unscaled product
could overflow. A softmax whose output is read elsewhere (e.g. returned attention weights) hands
those readers the fused op's probabilities. A chain is left alone, with the reason logged, when an
intermediate (the scaled or masked scores) is needed elsewhere, or the mask is scaled with the
scores (mask added before the scale).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch.fx import Graph, Node

from .fusion import Fusion, Match, Miss, Replacement
from .graph_utils import (
    FLOATS,
    PassContext,
    aten,
    broadcasts_to,
    constant_value,
    getitem_users,
    insert_call,
    insert_getitems,
    insert_seed,
    is_dtype_cast,
    is_op,
    is_scalar,
    kernel_friendly,
    same_shape,
    tensor_meta,
)

_VIEWS = (aten.view, aten.reshape, aten._unsafe_view, aten.expand, aten.clone)


def _softmax_core(n: Node) -> tuple[Node, Node, list[Node]] | None:
    """`n` is a last-dim softmax, possibly wrapped in casts: (input, the node whose value is the
    probabilities in the input's dtype, absorbed nodes)."""
    if not is_op(n, aten._softmax, aten._safe_softmax):
        return None
    x = n.args[0]
    xm, om = tensor_meta(x), tensor_meta(n)
    if xm is None or om is None or n.args[1] not in (-1, xm.dim() - 1):
        return None
    absorbed = [n]
    # autocast / HF: softmax(x.float()).to(x.dtype)  ->  one softmax in x's dtype (fp32 inside)
    if is_dtype_cast(x) and len(x.users) == 1:
        inner = x.args[0]
        im = tensor_meta(inner)
        if im is not None and im.dtype in FLOATS and len(n.users) == 1:
            (down,) = n.users
            dm = tensor_meta(down)
            if is_dtype_cast(down) and dm is not None and dm.dtype == im.dtype:
                return inner, down, [x, n, down]
    if om.dtype != xm.dtype:  # _softmax(half_to_float=True) / dtype=: keep it, the kernel writes x's dtype
        return None
    return x, n, absorbed


class _CastBack(NamedTuple):
    """Where autocast's float32 probabilities go back to the scores' dtype (_cast_back_down)."""

    cast: Node  # the cast down: its readers read the fused op's output
    between: list[Node]  # the nodes from the softmax to the cast (the dropout and its getitem)
    dropout: Node | None  # the float32 dropout among them


def _cast_back_down(sm: Node, probs_node: Node, mask: Node | None, m2: Node | None, low: torch.dtype,
                    high: torch.dtype) -> _CastBack | str:
    """Autocast with a float32 mask (HF builds its masks in the embeddings' dtype, float32 under
    CPU autocast): bf16/fp16 scores + the mask promote to float32, the softmax runs in float32, and the
    probabilities are cast back to the scores' dtype before the second GEMM, either right after the
    softmax (GPT-2: ``softmax(...).type(v.dtype)``, dropout then in bf16) or after a float32 dropout
    (BERT, LLaMA: autocast casts the dropped probabilities for the GEMM). That is one softmax in the
    scores' dtype with float32 math inside, which dmfx::attention_softmax is; the fused op also takes
    the scaled scores in float32 instead of rounding them to bf16 first (exact for power-of-two scales,
    such as 1/sqrt(64); else within half a bf16 ulp of the scores). Returns where the cast is, or why
    the chain is left alone."""
    why = "the scores have another dtype than the softmax input"
    if not (low in (torch.bfloat16, torch.float16) and high == torch.float32 and mask is not None and m2 is None
            and probs_node is sm):
        return why
    mm = tensor_meta(mask)
    if mm is None or mm.dtype != torch.float32:
        return why

    def cast_to_low(n: Node) -> bool:
        dm = tensor_meta(n)
        return is_dtype_cast(n) and dm is not None and dm.dtype == low

    if len(sm.users) != 1:
        return why + " (the float32 probabilities are read elsewhere)"
    (u,) = sm.users
    if cast_to_low(u):
        return _CastBack(u, [], None)
    if is_op(u, aten.native_dropout) and u.args[2] is not False and float(u.args[1]) > 0:
        items = getitem_users(u)
        zero = items.get(0, [])
        if set(items) == {0} and len(zero) == 1 and len(zero[0].users) == 1:
            (cast,) = zero[0].users
            if cast_to_low(cast):
                return _CastBack(cast, [u, zero[0]], u)
    return why + " (the float32 probabilities are not cast back to the scores' dtype)"


def _scalar(x: object) -> float | None:
    return float(x) if is_scalar(x) else None


def _split_scale(z: Node) -> tuple[Node, float, Node | None]:
    """z = s * c or s / c (c a number): (s, c, the scale node); else (z, 1.0, None)."""
    if is_op(z, aten.mul) and len(z.args) == 2:
        for a, b in ((z.args[0], z.args[1]), (z.args[1], z.args[0])):
            c = _scalar(b)
            if c is not None and isinstance(a, Node):
                return a, c, z
    if is_op(z, aten.div) and len(z.args) == 2 and not z.kwargs:
        c = _scalar(z.args[1])
        if c is not None and c != 0 and isinstance(z.args[0], Node):
            return z.args[0], 1.0 / c, z
    return z, 1.0, None


def _is_scores_side(n: Node) -> bool:
    """Whether `n` (after a scale and views) comes from a batched GEMM: the scores operand of an add."""
    s, _, _ = _split_scale(n)
    while is_op(s, *_VIEWS):
        s = s.args[0]
    return is_op(s, aten.bmm, aten.baddbmm, aten.matmul, aten.mm)


def _second_mask(scores: Node, shape: torch.Size) -> tuple[Node, Node] | None:
    """scores = s' + m (either order; s' from a batched GEMM, m a float mask broadcastable to
    `shape`), read only by the outer add: (s', m)."""
    if not is_op(scores, aten.add) or len(scores.args) != 2 or scores.kwargs.get("alpha", 1) != 1 or len(scores.users) != 1:
        return None
    for a, b in (scores.args, scores.args[::-1]):
        am, bm = tensor_meta(a), tensor_meta(b)
        if am is None or bm is None or not same_shape(am.shape, shape) or not _is_scores_side(a) or _is_scores_side(b):
            continue
        if bm.dtype in FLOATS and broadcasts_to(bm.shape, shape) and bm.device == am.device:
            return a, b
    return None


def _const_value(n: object) -> float | None:
    """A Python number, or a scalar_tensor / full([]) node holding one."""
    if is_scalar(n):
        return float(n)
    if is_op(n, aten.scalar_tensor) and is_scalar(n.args[0]):
        return float(n.args[0])
    if is_op(n, aten.full) and list(n.args[0]) == [] and is_scalar(n.args[1]):
        return float(n.args[1])
    if is_op(n, aten.zeros_like, aten.zeros):
        return 0.0
    return None


def _zero_where(mask: Node) -> tuple[Node, float] | None:
    """mask = where(m, 0, f) with m bool and f a constant: (m, f)."""
    if not is_op(mask, aten.where) or len(mask.args) != 3:
        return None
    m, a, b = mask.args
    mm, fill = tensor_meta(m), _const_value(b)
    if mm is None or mm.dtype != torch.bool or _const_value(a) != 0.0 or fill is None:
        return None
    return m, fill


def _bool_mask_of(mask: Node) -> Node | None:
    """mask = where(m, 0, -inf) with m bool: m (True = attend)."""
    found = _zero_where(mask)
    return found[0] if found is not None and found[1] == -math.inf else None


#: An additive mask's "masked" value: at most this (HF's finfo(dtype).min, -inf). exp() of it minus any
#: score is exactly 0, so where every row keeps a key, such a mask and causal=True give the same result.
MASKED = -1e30


def _is_causal_constant(mask: Node, scores_shape: torch.Size) -> bool:
    """`mask` is a causal mask over the last two dims of the scores (query row i reads keys
    j <= i + Lk - Lq, bottom-right as dmfx's causal=True), computed from constants: ``tril(ones(S, S))``,
    or HF's create_causal_mask traced with static sizes (``where(le(kv_arange, q_arange), 0, finfo.min)``
    expanded over the batch, an eager-attention model's mask in training). Decided by evaluating the
    mask's graph (constant_value) and comparing it with the pattern, so any formulation
    counts and anything else (a padding mask, a sliding window, a cache's positions, which are inputs)
    does not. A float mask counts where it is ``where(c, 0, m)`` with m <= MASKED and c such a bool
    mask. Not for Lq > Lk, where causal rows would read no key."""
    Lq, Lk = scores_shape[-2], scores_shape[-1]
    if not (isinstance(Lq, int) and isinstance(Lk, int)) or Lq > Lk:
        return False
    # one evaluation per mask and size in a compile: every layer's softmax reads the same mask, and
    # fuse="auto" asks before the passes do (about 50 ms at 2048 keys). The mask's nodes are constants
    # no pass rewrites, so the answer kept in its meta stays true.
    known = mask.meta.setdefault("dmfx_causal", {})
    if (Lq, Lk) not in known:
        known[(Lq, Lk)] = _evaluated_causal(mask, Lq, Lk)
    return known[(Lq, Lk)]


def _evaluated_causal(mask: Node, Lq: int, Lk: int) -> bool:
    """_is_causal_constant, evaluated."""
    mm = tensor_meta(mask)
    if mm is None:
        return False
    if mm.dtype != torch.bool:
        found = _zero_where(mask)
        if found is None or found[1] > MASKED:
            return False
        mask = found[0]
    v = constant_value(mask)
    if v is None or v.dtype != torch.bool or v.dim() < 2:
        return False
    for d in range(v.dim() - 2):  # a batch dim the mask is expanded over: one copy of it suffices
        if v.stride(d) == 0:
            v = v.narrow(d, 0, 1)
    pattern = torch.ones(Lq, Lk, dtype=torch.bool, device=v.device).tril(Lk - Lq)
    return torch.broadcast_shapes(v.shape[-2:], pattern.shape) == pattern.shape and bool((v == pattern).all())


def causal_softmax_keys(n: Node) -> tuple[int, torch.dtype] | None:
    """The key length of `n` and the dtype of its scores where it is a float32 last-dim softmax over
    [B, H, L, L] scores (bf16/fp16 ones promoted by the mask under autocast) plus a causal mask of
    constants (_is_causal_constant): an eager attention's, which the attention passes make one causal
    attention (dmfx/inductor.py long_causal_attention reads it before they run); else None."""
    if not is_op(n, aten._softmax, aten._safe_softmax):
        return None
    z = n.args[0]
    zm = tensor_meta(z)
    if zm is None or zm.dim() != 4 or zm.dtype != torch.float32 or not is_op(z, aten.add) or len(z.args) != 2:
        return None
    Lq, Lk = zm.shape[2:]
    if not (isinstance(Lq, int) and Lq == Lk):
        return None
    # either operand may be the mask: the scores, a GEMM's output, are never a constant. Their dtype is
    # the unscaled scores', as match_attention_softmax reads it (_split_scale) for the same threshold
    for mask, scores in (z.args, z.args[::-1]):
        sm = tensor_meta(_split_scale(scores)[0]) if isinstance(scores, Node) else None
        if isinstance(mask, Node) and sm is not None and _is_causal_constant(mask, zm.shape):
            return Lk, sm.dtype
    return None


def _fold_qk_scales(scores: Node, dtype: torch.dtype) -> tuple[float, list[Node]]:
    """SDPA's math path scales q and k_t by sqrt(c) before the GEMM. Move those multiplications
    into the softmax (bmm is linear): returns the folded factor and the mul nodes to bypass."""
    if dtype == torch.float16:
        return 1.0, []
    s = scores
    while is_op(s, aten.view, aten._unsafe_view, aten.reshape) and len(s.users) == 1:
        s = s.args[0]
    if not is_op(s, aten.bmm) or len(s.users) != 1:
        return 1.0, []
    factor, muls = 1.0, []
    for operand in s.args[:2]:
        n = operand
        while is_op(n, *_VIEWS) and len(n.users) == 1:
            n = n.args[0]
        if is_op(n, aten.mul) and len(n.users) == 1 and len(n.args) == 2 and _scalar(n.args[1]) is not None:
            if isinstance(n.args[0], Node):
                factor *= float(n.args[1])
                muls.append(n)
    return factor, muls


def _summed(m2: Node, mask: Node, ctx: PassContext) -> torch.Tensor | None:
    """The fake value of ``m2 + mask`` (T5's two masks, which the rewrite sums into one)."""
    from torch._guards import detect_fake_mode

    a, b = tensor_meta(m2), tensor_meta(mask)
    mode = ctx.fake_mode or detect_fake_mode([a, b])
    if mode is None:
        return None
    with mode:
        return a + b


def match_attention_softmax(sm: Node, ctx: PassContext) -> Match | Miss | None:
    """The chain of the module docstring around the softmax `sm`."""
    core = _softmax_core(sm)
    if core is None:
        return None
    z, probs_node, chain = core
    zm = tensor_meta(z)
    if not kernel_friendly(zm) or zm.dim() < 1:
        return None
    shape = zm.shape
    if len(z.users) != 1:
        return Miss(f"its input {z.name} is read elsewhere")

    # z = s' + mask (either order)
    scores, mask, m2 = z, None, None
    if is_op(z, aten.add) and len(z.args) == 2 and z.kwargs.get("alpha", 1) == 1:
        a, b = z.args
        am, bm = tensor_meta(a), tensor_meta(b)
        if am is not None and bm is not None:
            if same_shape(am.shape, shape) and (not same_shape(bm.shape, shape) or not _is_scores_side(b) or _is_scores_side(a)):
                scores, mask = a, b
            elif same_shape(bm.shape, shape):
                scores, mask = b, a
        if mask is None:
            return Miss("an add before the softmax whose operands do not look like scores + mask")
        chain.append(z)
        # Two masks, ((s + m2) + m1) as T5 writes (position bias, then the padding mask): one mask
        # m2 + m1 (broadcast sum; a tensor of at most the scores' size, as the add it replaces).
        inner = _second_mask(scores, shape)
        if inner is not None:
            chain.append(scores)  # the inner add (read only by the outer one: _second_mask)
            scores, m2 = inner
    notes: list[str] = []
    s, scale, scale_node = _split_scale(scores)
    if scale_node is not None:
        if len(scale_node.users) != 1:
            notes.append(f"the scaled scores {scale_node.name} are read elsewhere")
            scale, s = 1.0, scores
        else:
            chain.append(scale_node)
    sm_meta = tensor_meta(s)
    if sm_meta is None or not same_shape(sm_meta.shape, shape):
        return Miss(*notes, "the scores have another shape than the softmax input")
    down = None  # autocast: bf16/fp16 scores promoted to float32 by the mask, the probabilities cast back
    if sm_meta.dtype != zm.dtype:
        down = _cast_back_down(sm, probs_node, mask, m2, sm_meta.dtype, zm.dtype)
        if isinstance(down, str):
            return Miss(*notes, down)

    causal = False
    if mask is not None:
        bool_mask = _bool_mask_of(mask) if m2 is None else None  # (a summed mask is no where())
        if bool_mask is not None:
            if len(mask.users) == 1:
                chain.append(mask)
            mask = bool_mask
        if m2 is None and _is_causal_constant(mask, shape):
            mask, causal = None, True
    if ctx.attention_scope == "long-causal":  # (fuse="auto": only what becomes a long causal attention)
        from .attention import causal_scope_min_keys

        least = causal_scope_min_keys(ctx.training, sm_meta.dtype)
        if not (causal and isinstance(shape[-1], int) and shape[-1] >= least and zm.dim() == 4):
            return Miss(*notes, f"fuse='auto' rewrites only causal attention over at least {least} keys "
                        "here; the rest of this graph is Inductor's")
        if mask is not None:
            mm = tensor_meta(mask) if m2 is None else _summed(m2, mask, ctx)
            if mm is None or not broadcasts_to(mm.shape, shape) or (mm.dtype not in FLOATS and mm.dtype != torch.bool):
                return Miss(*notes, "the mask is not broadcastable to the scores or has an unsupported dtype")
            if mm.device != zm.device:
                return Miss(*notes, "the mask is on another device")

    # dropout after the softmax
    p, drop, drop_out = 0.0, None, []
    if down is not None and down.dropout is not None:  # dropout in float32, then the cast: both absorbed
        drop, p, drop_out = down.dropout, float(down.dropout.args[1]), [down.cast]
        chain += [*down.between, down.cast]
        probs_node = None  # the float32 probabilities are read only by the dropout
    else:
        if down is not None:  # the cast right after the softmax: the probabilities are the cast's
            probs_node = down.cast
            chain += [*down.between, probs_node]
        for u in list(probs_node.users):
            if not is_op(u, aten.native_dropout):
                continue
            items = getitem_users(u)
            if set(items) - {0}:
                notes.append("the dropout mask is read in the graph; dropout left unfused")
            elif u.args[2] is not False and float(u.args[1]) > 0:
                p, drop, drop_out = float(u.args[1]), u, items.get(0, [])
            break
        if drop is not None:
            chain += [drop, *drop_out]

    folded, muls = _fold_qk_scales(s, sm_meta.dtype)
    nodes = {"scores": s, "mask": mask, "second_mask": m2, "scale": scale * folded, "causal": causal, "p": p,
             "softmax": sm, "dropout": drop, "dropout_out": drop_out, "probs": probs_node, "muls": muls}
    probs_returned = () if probs_node is None else (probs_node,)
    return Match(nodes, chain + muls, returned=(*drop_out, *probs_returned, *muls), notes=tuple(notes))


def rewrite_attention_softmax(graph: Graph, m: Match, ctx: PassContext) -> Replacement:
    mask = m["mask"]
    if m["second_mask"] is not None:
        with graph.inserting_before(m["softmax"]):
            mask = insert_call(graph, ctx, aten.add.Tensor, (m["second_mask"], mask))
    with graph.inserting_before(m["softmax"] if m["dropout"] is None else m["dropout"]):
        seed = insert_seed(graph, ctx) if m["p"] > 0 else None
        fused = insert_call(graph, ctx, torch.ops.dmfx.attention_softmax.default,
                            (m["scores"], mask, m["scale"], m["causal"], seed, m["p"]))
        out, probs = insert_getitems(graph, fused, 2)
    uses = {mul: mul.args[0] for mul in m["muls"]}  # q * sqrt(c) and k_t * sqrt(c): the factor is in the scale
    if m["dropout"] is not None:
        # other readers of the probabilities (returned attention weights) get the fused op's copy
        uses.update({g: out for g in m["dropout_out"]})
        if m["probs"] is not None:  # (None: float32 probabilities only the absorbed dropout read)
            uses[m["probs"]] = probs
    else:
        uses[m["probs"]] = out
    return Replacement(fused, uses)


#: scale + mask + softmax + dropout over attention scores -> dmfx::attention_softmax.
ATTENTION_SOFTMAX = Fusion("attention_softmax", (aten._softmax, aten._safe_softmax), match_attention_softmax,
                           rewrite_attention_softmax)

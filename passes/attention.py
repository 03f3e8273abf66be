"""Attention without layout copies, and the paper's QKV stacking.

``attention`` starts from each fused softmax (``dmfx::attention_softmax``, made by the attention_softmax pass)
over 4-D scores and walks out to the two batched GEMMs around it, as ATen records ``q @ k.transpose``
and ``probs @ v`` on ``[B, H, L, D]`` tensors::

    a  = _unsafe_view(clone(expand(q4)), [B*H, Lq, D])       q4 [B, H, Lq, D], usually a permuted view
    b  = _unsafe_view(clone(expand(kt4)), [B*H, D, Lk])      kt4 = k4.transpose(2, 3)
    s  = view(bmm(a, b), [B, H, Lq, Lk])
    o, p = dmfx::attention_softmax(s, mask, scale, causal, seed, p)
    c  = view(expand(o), [B*H, Lq, Lk]);  d = _unsafe_view(clone(expand(v4)), [B*H, Lk, Dv])
    ctx = view(bmm(c, d), [B, H, Lq, Dv])

and replaces the chain with one attention in the form ``choose_form`` picks (the cost model, or
measurements with ``options={"tune": True}``): ``dmfx::flash_attention`` (CPU kernel, scores kept
in cache), ``dmfx::attention`` (the paper's GEMMs around the fused softmax) or PyTorch's
``scaled_dot_product_attention``. The ``clone``s are the transpose copies eager runs because ``bmm``
takes 3-D operands; dmfx's ops read q4, k4 and v4 through their strides and write the context as
``[B, Lq, H, Dv]``, so HF's ``transpose(1, 2).contiguous()`` after it is no copy either
(``noop_clones`` removes it), and their backwards write dq, dk and dv in the projections' layout.
Grouped-query k and v are read before ``repeat_kv``'s copies. Readers of the probabilities (returned
attention weights) get the fused op's, which only the GEMM form has.

``qkv_attention`` then looks at each dmfx attention whose q, k and v are the head views
(``view(linear(x), [B, L, H, D]).transpose(1, 2)``) of three linear layers reading the same input x
with equal shapes: the paper's algebraic fusion. The three weights (and biases) are concatenated
and multiplied once, ``qkv = x @ cat(Wq, Wk, Wv)ᵀ + cat(bq, bk, bv)``, and ``dmfx::qkv_attention`` /
``dmfx::qkv_flash_attention`` read q, k and v as column blocks of qkv (GPT-2's single Conv1D split
into q, k, v feeds them directly). In training the concatenation runs every step (it is part of the
graph, so the stacked weight can never be stale after an optimizer step, and tagged for
recomputation, so it is never kept for the backward); its backward is one GEMM for the stacked dW
(whose row blocks are the three weight gradients, as views), the bias gradient from the attention
backward, and dX as three accumulating GEMMs reading the weights themselves (passes/backward.py,
``unstack_dx``); the attention backward writes dq, dk and dv straight into the stacked gradient.
``stack_qkv="auto"`` stacks only where that pays (training with tokens >= input features).
"""

from __future__ import annotations

import logging
import operator

import torch
from torch.fx import GraphModule, Node
from torch.utils.checkpoint import CheckpointPolicy

from .graph_utils import (
    PassContext,
    aten,
    concrete_int,
    getitem_users,
    insert_call,
    insert_getitems,
    is_op,
    refresh_val,
    tensor_meta,
    views_to_reshapes,
)

_RESHAPES = (aten.view, aten._unsafe_view, aten.reshape)
log = logging.getLogger("dmfx")
_ATTENTION_OPS = (torch.ops.dmfx.attention, torch.ops.dmfx.flash_attention)
_PACKED = {torch.ops.dmfx.attention.default: torch.ops.dmfx.qkv_attention.default,
           torch.ops.dmfx.flash_attention.default: torch.ops.dmfx.qkv_flash_attention.default}


def _same(a, b) -> bool:
    return len(a) == len(b) and all(x == y for x, y in zip(a, b))


def _unflatten_of(operand: object, shape4) -> Node | None:
    """`operand` is a bmm operand [B*H, M, K] reshaped from a 4-D [B, H, M, K] tensor, perhaps through
    a no-op expand and a copy (clone): that 4-D tensor."""
    if not is_op(operand, *_RESHAPES):
        return None
    n = operand.args[0]
    while True:
        if is_op(n, aten.clone):
            n = n.args[0]
        elif is_op(n, aten.expand) and _same(tensor_meta(n.args[0]).shape, tensor_meta(n).shape):
            n = n.args[0]
        else:
            break
    m = tensor_meta(n)
    if m is None or m.dim() != 4 or not _same(m.shape, shape4):
        return None
    return n


def _repeat_kv_source(t: Node) -> Node | None:
    """t = repeat_kv(x) as HF LLaMA/Mistral write it, ``x[:, :, None].expand(B, Hk, g, L, D)
    .reshape(B, Hk * g, L, D)`` (at ATen: unsqueeze, expand, clone, _unsafe_view): x [B, Hk, L, D]."""
    if not is_op(t, *_RESHAPES):
        return None
    n = t.args[0]
    if is_op(n, aten.clone):
        n = n.args[0]
    if not is_op(n, aten.expand) or tensor_meta(n).dim() != 5:
        return None
    x5 = n.args[0]
    if not is_op(x5, aten.unsqueeze) or x5.args[1] not in (2, -3):
        return None
    x = x5.args[0]
    xm, tm = tensor_meta(x), tensor_meta(t)
    if xm is None or xm.dim() != 4 or tm is None or not _same(xm.shape[2:], tm.shape[2:]) or xm.shape[0] != tm.shape[0]:
        return None
    return x


def _is_transpose(n: object, dims: tuple[int, int]) -> bool:
    """n = x.transpose(a, b) of a 4-D x with {a, b} == dims (negative dims allowed)."""
    return is_op(n, aten.transpose) and sorted(d % 4 for d in n.args[1:3]) == sorted(dims)


def _second_gemm(outs: list[Node]) -> tuple[Node, Node, Node] | None:
    """The softmax output `o` (one of `outs`) feeds ``bmm(view(expand(o)), v)``, perhaps through a
    ``clone`` (a dropout with p=0 in training, as some torch versions trace it): (o, o's user on that
    chain, the bmm)."""
    for o in outs:
        for u in o.users:
            n = u
            while is_op(n, aten.clone) and len(n.users) == 1:
                (n,) = n.users
            if is_op(n, aten.expand) and len(n.users) == 1:
                (r,) = n.users
                if is_op(r, *_RESHAPES) and len(r.users) == 1:
                    (bmm2,) = r.users
                    if is_op(bmm2, aten.bmm) and bmm2.args[0] is r and len(bmm2.users) == 1:
                        return o, u, bmm2
    return None


def _grouped_kv(kt4: Node, v4: Node) -> tuple[Node | None, Node]:
    """Grouped-query attention: k and v as they were before repeat_kv's copies (the ops index kv
    heads themselves): (k, v), or (None, v4) when they are not repeat_kv outputs."""
    k_src = _repeat_kv_source(kt4.args[0]) if _is_transpose(kt4, (2, 3)) else None
    v_src = _repeat_kv_source(v4)
    if k_src is not None and v_src is not None and tensor_meta(k_src).shape[1] == tensor_meta(v_src).shape[1]:
        return k_src, v_src
    return None, v4


def _runtime_scale(scores: Node) -> bool:
    """scores = s * c with c a run-time scalar (a graph node holding a number, not a tensor), read
    only by the softmax."""
    if not (is_op(scores, aten.mul) and len(scores.args) == 2 and len(scores.users) == 1):
        return False
    c = scores.args[1]
    return isinstance(c, Node) and isinstance(c.meta.get("val"), (torch.SymFloat, torch.SymInt, float, int))


def _bmm_of(s: Node) -> Node | None:
    """s = view(bmm(a, b), 4-D): the bmm."""
    if not is_op(s, *_RESHAPES) or len(s.users) != 1:
        return None
    b = s.args[0]
    if not is_op(b, aten.bmm) or len(b.users) != 1:
        return None
    return b


def choose_form(ctx: PassContext, q4: Node, k4: Node, v4: Node, mask: Node | None, causal: bool, p: float,
                scale: float, probs_read: bool) -> tuple[str, str]:
    """The cost model, checked against bench/attention.py (numbers in bench/RESULTS.md). Returns
    (form, why) with form one of

    * "gemm": dmfx::attention, the paper's two batched GEMMs around the fused softmax. The only form
      that hands out the probabilities (returned attention weights) and a mask gradient (T5's
      learned position bias), so it runs wherever those are needed, and where nothing fused exists
      (dropout in bf16/fp16 on the CPU).
    * "flash": dmfx::flash_attention, the scores kept in cache per block of query rows and recomputed
      in the backward. With dropout on the CPU it is 1.7x (L=128) to 2.7x (L=512) faster than SDPA,
      which falls back to its unfused math path for dropout on the CPU, and 1.2-1.6x faster than
      the "gemm" form; it also saves no [B, H, L, L] tensor for the backward.
      Also without dropout (fp32, not causal): in training it ties SDPA's flash kernel (forward +
      backward, with and without a padding mask), and unlike SDPA it reads the stacked Q/K/V
      projection and folds the bias gradients (passes/backward.py), which SDPA's backward cannot; in
      inference it is 0.99-1.11x SDPA's (its GEMMs call BLAS directly).

    * "sdpa": PyTorch's own scaled_dot_product_attention, for causal attention without dropout (a tie
      at best for dmfx's kernel, which gains nothing there: no bias to fold in the models that use
      it), for other dtypes without dropout, and on CUDA (its flash / efficient / cuDNN kernels run on
      tensor cores; dmfx's CUDA flash kernel, csrc/attention_cuda.cu, on CUDA cores, and it has not run
      on a GPU yet: only attention="flash" picks it). Not with a causal mask over different query and
      key lengths (SDPA aligns it top-left, dmfx and HF bottom-right).

    With ``options={"tune": True}`` the feasible forms are timed instead (passes/tuning.py).
    """
    from ..cuda_ops import flash_supported

    qm = tensor_meta(q4)
    flash_ok = flash_supported(qm.device, qm.dtype, qm.shape[3], tensor_meta(v4).shape[3])
    # dmfx's CUDA flash kernel has run on a CPU emulation of CUDA (tests/test_emulated_cuda_flash.py)
    # but not yet on a GPU: until bench/gpu_check.sh has passed on one, only attention="flash" runs it
    # (neither the rules below nor tuning, which would time it but not check its results).
    flash_auto = flash_ok and qm.device.type != "cuda"
    if probs_read:
        return "gemm", "the attention probabilities are read elsewhere (returned attention weights)"
    if mask is not None and ctx.needs_grad(mask):
        return "gemm", "the mask requires grad (a learned position bias): only the unfused form computes its gradient"
    sdpa_ok = not causal or qm.shape[2] == tensor_meta(k4).shape[2]
    if ctx.tune and ctx.attention == "auto":
        from .tuning import attention_case, tuned_attention_form

        forms = ["gemm"] + (["flash"] if flash_auto else []) + (["sdpa"] if sdpa_ok else [])
        case = attention_case(qm, tensor_meta(k4), tensor_meta(v4), tensor_meta(mask), causal, p, ctx.training)
        tuned = tuned_attention_form(case, forms, scale, p)
        if tuned is not None:
            best, ms = tuned
            return best, "tuned: " + ", ".join(f"{f} {t:.2f} ms" for f, t in sorted(ms.items(), key=lambda kv: kv[1]))
    forced = ctx.attention
    if forced == "gemm":
        return "gemm", "option attention='gemm'"
    if forced == "flash" and flash_ok:
        return "flash", "option attention='flash'"
    if forced == "sdpa" and sdpa_ok:
        return "sdpa", "option attention='sdpa'"
    if qm.device.type == "cpu" and p > 0:
        if flash_auto:
            return "flash", "dropout on the CPU: no fused PyTorch kernel"
        return "gemm", f"dropout on the CPU in {qm.dtype}: no fused kernel"
    if qm.device.type == "cpu" and qm.dtype == torch.float32 and not causal and flash_auto:
        if ctx.needs_grad(q4):
            return "flash", ("training without dropout on the CPU: dmfx's fused kernel ties SDPA's forward+backward "
                             "(bench/attention.py --mask none) and lets the projections stack and the bias "
                             "gradients fold into its backward")
        return "flash", ("inference on the CPU: dmfx's fused kernel is 0.99-1.11x SDPA's "
                         "(bench/attention.py --mode infer) and writes the context in the layout the next GEMM reads")
    if sdpa_ok:
        return "sdpa", "PyTorch's fused kernel is the fastest here"
    if flash_auto:
        return "flash", "causal attention over different query and key lengths"
    return "gemm", "no fused kernel for this case"


def _insert_sdpa(graph, ctx, q4, k4, v4, mask, scale, causal, p) -> Node:
    qm = tensor_meta(q4)
    if mask is not None and tensor_meta(mask).dtype not in (torch.bool, qm.dtype):
        mask = insert_call(graph, ctx, aten._to_copy.default, (mask,), {"dtype": qm.dtype})
    kwargs = {"scale": scale}
    if qm.shape[1] != tensor_meta(k4).shape[1]:
        kwargs["enable_gqa"] = True
    return insert_call(graph, ctx, aten.scaled_dot_product_attention.default, (q4, k4, v4, mask, p, causal), kwargs)


def fuse_attention(gm: GraphModule, ctx: PassContext) -> None:
    graph = gm.graph
    for sm in list(graph.nodes):
        if not is_op(sm, torch.ops.dmfx.attention_softmax):
            continue
        scores, mask, scale, causal, seed, p = sm.args
        sm_val = tensor_meta(scores)
        if sm_val is None or sm_val.dim() != 4:
            continue
        B, H, Lq, Lk = sm_val.shape
        bmm1, q_scale = _bmm_of(scores), None
        if bmm1 is None and _runtime_scale(scores):
            # the scale is a run-time scalar (torch.compile(dynamic=True) makes HF's 1/sqrt(d) one):
            # it cannot be the ops' float argument, so it moves onto q (one pass over q, not the scores)
            bmm1, q_scale = _bmm_of(scores.args[0]), scores.args[1]
        if bmm1 is None:
            ctx.miss("attention", sm, "the scores do not come from a batched GEMM read only by the softmax")
            continue
        a, b = bmm1.args[:2]
        D = tensor_meta(a).shape[-1]
        q4 = _unflatten_of(a, (B, H, Lq, D))
        kt4 = _unflatten_of(b, (B, H, D, Lk))
        if q4 is None or kt4 is None:
            ctx.miss("attention", sm, "q or k is not a 4-D [B, H, L, D] tensor (grouped-query repeat_kv, 3-D q)")
            continue

        items = getitem_users(sm)
        outs = items.get(0, [])
        found = _second_gemm(outs)
        if found is None:
            ctx.miss("attention", sm, "the probabilities do not feed a batched GEMM with v")
            continue
        o, chain, bmm2 = found
        (ctx4,) = bmm2.users
        vm = tensor_meta(bmm2.args[1])
        Dv = vm.shape[-1]
        v4 = _unflatten_of(bmm2.args[1], (B, H, Lk, Dv))
        c4m = tensor_meta(ctx4)
        if v4 is None or not is_op(ctx4, *_RESHAPES) or c4m is None or not _same(c4m.shape, (B, H, Lq, Dv)):
            ctx.miss("attention", sm, "v is not a 4-D [B, H, L, D] tensor or the context is not viewed back to 4-D")
            continue
        k_src, v4 = _grouped_kv(kt4, v4)
        dtypes = {tensor_meta(t).dtype for t in (q4, k_src if k_src is not None else kt4, v4)} | {sm_val.dtype}
        if len(dtypes) != 1:
            ctx.miss("attention", sm, f"q, k, v and the scores have different dtypes {sorted(map(str, dtypes))}")
            continue

        probs_read = any(g is not o or len(g.users) > 1 for g in outs) or bool(items.get(1))
        with graph.inserting_before(sm):
            if k_src is not None:
                k4 = k_src
            elif _is_transpose(kt4, (2, 3)):
                k4 = kt4.args[0]  # HF writes k.transpose(-1, -2)
            else:
                k4 = insert_call(graph, ctx, aten.transpose.int, (kt4, 2, 3))
            if q_scale is not None:
                q4 = insert_call(graph, ctx, aten.mul.Tensor, (q4, q_scale))
            form, why = choose_form(ctx, q4, k4, v4, mask, causal, p, scale, probs_read)
            if form == "sdpa":
                fused = out = _insert_sdpa(graph, ctx, q4, k4, v4, mask, scale, causal, p)
            else:
                op = torch.ops.dmfx.flash_attention if form == "flash" else torch.ops.dmfx.attention
                fused = insert_call(graph, ctx, op.default, (q4, k4, v4, mask, scale, causal, seed, p))
                out, *rest = insert_getitems(graph, fused, 2 if form == "flash" else 3)
        ctx4.replace_all_uses_with(out)
        if form == "sdpa":  # its output layout depends on the kernel PyTorch picks at run time
            views_to_reshapes([out])
        if form == "gemm":  # readers of the softmax's outputs elsewhere (returned attention weights)
            probs, dropped = rest
            for g in outs:
                if g is not o or len(g.users) > 1:
                    g.replace_all_uses_with(dropped if p > 0 else probs, delete_user_cb=lambda u: u is not chain)
            for g in items.get(1, []):
                g.replace_all_uses_with(probs)
        absorbed = ctx.take_over(sm) + 2 + 4  # the softmax chain, two GEMMs, four views
        ctx.record("attention", absorbed, fused)
        ctx.forms[fused.name] = (form, why)
        log.debug("dmfx: attention at %s runs in the %s form: %s", sm.name, form, why)
    lower_sdpa_calls(gm, ctx)
    noop_clones(gm, ctx)


# scaled_dot_product_attention as a traced graph records it: the composite op, or the fused kernel
# PyTorch picked while tracing (by op name, any overload) -> (position, keyword) of the mask, dropout_p
# and is_causal, and whether the op returns more than the attention output (logsumexp, rng state).
_SDPA_CALLS = {
    "scaled_dot_product_attention": dict(mask=(3, "attn_mask"), dropout=(4, "dropout_p"), causal=(5, "is_causal"),
                                         extra_outputs=False),
    "_scaled_dot_product_flash_attention_for_cpu": dict(mask=(None, "attn_mask"), dropout=(3, "dropout_p"),
                                                        causal=(4, "is_causal"), extra_outputs=True),
    "_scaled_dot_product_efficient_attention": dict(mask=(3, "attn_bias"), dropout=(5, "dropout_p"),
                                                    causal=(6, "is_causal"), extra_outputs=True),
    "_scaled_dot_product_cudnn_attention": dict(mask=(3, "attn_bias"), dropout=(5, "dropout_p"),
                                                causal=(6, "is_causal"), extra_outputs=True),
}


def sdpa_call(n: Node) -> dict | None:
    """When `n` calls scaled_dot_product_attention (or a fused kernel of it): its q, k, v, mask,
    dropout, causal, scale (None: SDPA's default) and extra_outputs; else None."""
    if n.op != "call_function":
        return None
    spec = _SDPA_CALLS.get(getattr(getattr(n.target, "overloadpacket", None), "__name__", ""))
    if spec is None:
        return None
    args = list(n.args)

    def arg(where, default):
        i, name = where
        return args[i] if i is not None and i < len(args) else n.kwargs.get(name, default)

    q, k, v = args[:3]
    return dict(q=q, k=k, v=v, mask=arg(spec["mask"], None), dropout=arg(spec["dropout"], 0.0),
                causal=arg(spec["causal"], False), scale=n.kwargs.get("scale"), extra_outputs=spec["extra_outputs"])


def lower_sdpa_calls(gm: GraphModule, ctx: PassContext) -> None:
    """A model's own ``scaled_dot_product_attention`` call (HF's "sdpa" implementation) goes through
    the same cost model as the eager pattern: where it picks dmfx's fused kernel (training without
    dropout on the CPU, so that the projections stack and the bias gradients fold), the call becomes
    ``dmfx::flash_attention`` with the same q, k, v, mask (bool: True = attend, as in SDPA) and scale
    (SDPA's default 1/sqrt(D) made explicit); elsewhere it stays PyTorch's. With dropout on the CPU
    the call never reaches the graph as one op: SDPA runs its math path, whose ops the softmax and
    attention passes above take. A causal call stays PyTorch's (its mask is top-left aligned when the
    lengths differ, dmfx's bottom-right)."""
    graph = gm.graph
    for n in list(graph.nodes):
        call = sdpa_call(n)
        if call is None:
            continue
        q4, k4, v4, mask, p, causal = (call[x] for x in ("q", "k", "v", "mask", "dropout", "causal"))
        qm, km, vm = (tensor_meta(t) for t in (q4, k4, v4))
        if any(m is None or m.dim() != 4 for m in (qm, km, vm)):
            ctx.miss("attention", n, "scaled_dot_product_attention on tensors that are not 4-D [B, H, L, D]")
            continue
        if p != 0.0 or causal:
            log.debug("dmfx: %s stays PyTorch's (%s)", n.name, "dropout inside the call" if p else "causal")
            continue
        if call["extra_outputs"] and any(not (u.target is operator.getitem and u.args[1] == 0) for u in n.users):
            continue  # its logsumexp is read: PyTorch's kernel must run
        heads, kv_heads = qm.shape[1], km.shape[1]
        if not isinstance(heads, int) or not isinstance(kv_heads, int) or heads % kv_heads:
            continue
        scale = call["scale"]
        if scale is None:
            d = qm.shape[-1]
            if not isinstance(d, int):
                continue  # a symbolic head size: the scale is not a float at compile time
            scale = d**-0.5
        form, why = choose_form(ctx, q4, k4, v4, mask, False, 0.0, float(scale), probs_read=False)
        if form != "flash":
            log.debug("dmfx: %s stays PyTorch's scaled_dot_product_attention: %s", n.name, why)
            continue
        with graph.inserting_before(n):
            fused = insert_call(graph, ctx, torch.ops.dmfx.flash_attention.default,
                                (q4, k4, v4, mask, float(scale), False, None, 0.0))
            out, _ = insert_getitems(graph, fused, 2)
        if call["extra_outputs"]:
            for u in list(n.users):
                u.replace_all_uses_with(out)
                graph.erase_node(u)
        else:
            n.replace_all_uses_with(out)
        graph.erase_node(n)
        views_to_reshapes([out])  # later views may have relied on PyTorch's output strides
        ctx.record("attention", 1, fused)
        ctx.forms[fused.name] = (form, why)
        log.debug("dmfx: scaled_dot_product_attention %s runs in the flash form: %s", n.name, why)


# ----------------------------------------------------------------------------------------- QKV stacking


def _head_view_of(t: Node):
    """t = view(h, [B, L, H, D]).transpose(1, 2) (or permute(0, 2, 1, 3)) with h the [B, L, H*D] (or
    [B*L, H*D]) output of a linear layer (addmm / mm, read only there): (the linear, the view's
    [B, L, H, D] shape argument)."""
    if not (_is_transpose(t, (1, 2)) or (is_op(t, aten.permute) and list(t.args[1]) == [0, 2, 1, 3])):
        return None
    v = t.args[0]
    if not is_op(v, *_RESHAPES) or len(v.users) != 1 or len(v.args[1]) != 4:
        return None
    h = v.args[0]
    while is_op(h, *_RESHAPES) and len(h.users) == 1:
        h = h.args[0]
    if not is_op(h, aten.addmm, aten.mm) or len(h.users) != 1:
        return None
    return h, v.args[1]


def _same_value(a: object, b: object) -> bool:
    """a and b are the same node, or the same view of the same value (functionalization records a
    separate ``view(x, shape)`` for each reader of x)."""
    if a is b:
        return True
    return (
        is_op(a, *_RESHAPES)
        and is_op(b, *_RESHAPES)
        and a.target is b.target
        and list(a.args[1]) == list(b.args[1])
        and _same_value(a.args[0], b.args[0])
    )


def _split_source(q4: Node, k4: Node, v4: Node) -> Node | None:
    """q4, k4, v4 = the head views (view(., [B, L, H, D]).transpose(1, 2)) of the three equal chunks of
    ``split(x, E, -1)`` with x [B, L, 3E], in order: x."""
    srcs = []
    for i, t in enumerate((q4, k4, v4)):
        if not _is_transpose(t, (1, 2)):
            return None
        v = t.args[0]
        if not is_op(v, *_RESHAPES) or len(v.users) != 1:
            return None
        g = v.args[0]
        if not (isinstance(g, Node) and g.target is operator.getitem and g.args[1] == i and len(g.users) == 1):
            return None
        srcs.append(g.args[0])
    split = srcs[0]
    if not all(s is split for s in srcs) or not is_op(split, aten.split, aten.split_with_sizes):
        return None
    x = split.args[0]
    xm, qm = tensor_meta(x), tensor_meta(q4)
    if xm is None or xm.dim() != 3 or split.args[2] not in (2, -1) or len(x.users) != 1:
        return None
    B, H, L, D = qm.shape
    if not isinstance(H * D, int) or xm.shape[2] != 3 * H * D or not _same(xm.shape[:2], (B, L)):
        return None
    sizes = split.args[1]
    if (isinstance(sizes, int) and sizes != H * D) or (not isinstance(sizes, int) and list(sizes) != [H * D] * 3):
        return None
    if any(not _same(tensor_meta(t).shape, (B, H, L, D)) for t in (k4, v4)):
        return None
    return x


def _linear_parts(lin: Node):
    """(input, weight operand [in, out], bias or None) of addmm(bias, x, w) / mm(x, w)."""
    if is_op(lin, aten.addmm):
        if lin.kwargs or len(lin.args) != 3:
            return None
        bias, x, w = lin.args
        bm = tensor_meta(bias)
        if bm is None or bm.dim() != 1:
            return None
        return x, w, bias
    if lin.kwargs or len(lin.args) != 2:
        return None
    x, w = lin.args
    return x, w, None


def stack_qkv(gm: GraphModule, ctx: PassContext) -> None:
    if ctx.stack_qkv is False:
        return
    graph = gm.graph
    for att in list(graph.nodes):
        if not is_op(att, *_ATTENTION_OPS):
            continue
        q4, k4, v4, mask, scale, causal, seed, p = att.args
        packed = _split_source(q4, k4, v4)
        if packed is not None:  # GPT-2: one GEMM already, split into q, k and v
            _use_packed(graph, ctx, att, packed, tensor_meta(q4).shape[1], absorbed=1)  # the split (and its backward's cat)
            continue
        heads = [_head_view_of(t) for t in (q4, k4, v4)]
        if any(x is None for x in heads):
            if sum(x is not None for x in heads) >= 2:  # a near miss (e.g. k and v of a cache)
                ctx.miss("qkv_attention", att, "q, k and v are not all head views of linear layers read only here")
            continue
        lins = [lin for lin, _ in heads]
        parts = [_linear_parts(lin) for lin in lins]
        if any(x is None for x in parts) or not all(_same_value(parts[0][0], x) for x, _, _ in parts[1:]):
            ctx.miss("qkv_attention", att, "q, k and v are not projections of the same input")
            continue
        ws = [w for _, w, _ in parts]
        biases = [b for _, _, b in parts]
        wm = [tensor_meta(w) for w in ws]
        same_shapes = all(_same(m.shape, wm[0].shape) and m.dtype == wm[0].dtype for m in wm)
        if not same_shapes or (None in biases and any(b is not None for b in biases)):
            ctx.miss("qkv_attention", att, "the three projections differ in shape, dtype or bias")
            continue
        qm = tensor_meta(q4)
        B, H, L, D = qm.shape
        if not isinstance(H * D, int):
            ctx.miss("qkv_attention", att, "the hidden size is dynamic")
            continue
        if not _same(tensor_meta(k4).shape, (B, H, L, D)) or not _same(tensor_meta(v4).shape, (B, H, L, D)):
            ctx.miss("qkv_attention", att, "q, k and v differ in shape (cross-attention or grouped-query)")
            continue
        x = parts[0][0]
        if ctx.stack_qkv == "auto":
            # Training: the concatenation moves 2 * 3 * in * out elements every step; one GEMM
            # instead of three runs the forward and the dW of the backward (dX reads the three
            # weights: unstack_dx), measured 1.6 ms faster at 1024 tokens before unstack_dx and a tie
            # in a whole BertLayer step since (bench/RESULTS.md). Inference: the GEMM runs no faster
            # stacked and the concatenation is pure cost.
            tokens, features = (concrete_int(s) for s in tensor_meta(x).shape[-2:]) if tensor_meta(x).dim() == 2 else (0, 1)
            if not ctx.training or tokens < features:
                why = "inference" if not ctx.training else f"{tokens} tokens < {features} input features"
                ctx.miss("qkv_attention", att, f"not worth it ({why}): the per-step weight concatenation costs more than it saves")
                continue
        w_bytes = 2 * 3 * concrete_int(wm[0].numel()) * wm[0].element_size()  # read + written
        why = ("QKV stacking: the three weights are concatenated every step (bytes: read + written); "
               "it saves two GEMM launches and the backward's two dX adds")
        log.debug("dmfx: %s at %s", why, att.name)
        size_b, size_l = heads[0][1][:2]  # [B, L, H, D] of the head view: ints or SymInt nodes
        with graph.inserting_before(att):
            if all(is_op(w, aten.t, aten.permute) and tensor_meta(w.args[0]).dim() == 2 for w in ws):
                # weights are t(W) of [out, in] parameters: stack rows (a contiguous copy) and transpose
                W = insert_call(graph, ctx, aten.cat.default, ([w.args[0] for w in ws], 0))
                w_all = insert_call(graph, ctx, aten.t.default, (W,))
            else:
                W = w_all = insert_call(graph, ctx, aten.cat.default, (ws, 1))
            ctx.copies.append({"node": W.name, "bytes": w_bytes, "why": why})
            # The backward's dX GEMM reads the stacked weight: recompute it there from the parameters
            # (alive anyway) instead of keeping a copy of all three weights for the whole step. The
            # tag survives AOTAutograd's trace of this graph and binds its min-cut partitioner.
            for n in {W, w_all}:
                n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            if biases[0] is not None:
                b_all = insert_call(graph, ctx, aten.cat.default, (biases, 0))
                lin = insert_call(graph, ctx, aten.addmm.default, (b_all, x, w_all))
            else:
                lin = insert_call(graph, ctx, aten.mm.default, (x, w_all))
            qkv = insert_call(graph, ctx, aten.view.default, (lin, [size_b, size_l, 3 * H * D]))
        _use_packed(graph, ctx, att, qkv, H, absorbed=2)  # two GEMMs (and their bias adds)


def _use_packed(graph, ctx: PassContext, att: Node, qkv: Node, heads: int, absorbed: int) -> None:
    """Replace the attention node `att` by its packed (qkv_) op on the stacked projection `qkv`."""
    _, _, _, mask, scale, causal, seed, p = att.args
    with graph.inserting_before(att):
        fused = insert_call(graph, ctx, _PACKED[att.target], (qkv, heads, mask, scale, causal, seed, p))
    fused.meta["dmfx_fused"] = att.meta.get("dmfx_fused")
    ctx.forms[fused.name] = ctx.forms.pop(att.name)
    att.replace_all_uses_with(fused)
    graph.erase_node(att)
    ctx.record("qkv_attention", absorbed, None)


# ----------------------------------------------------------------------------------------- layouts


def noop_clones(gm: GraphModule, ctx: PassContext) -> None:
    """Drop ``clone`` (contiguous or preserved format) of a tensor that is already contiguous
    downstream of dmfx's attention ops, whose outputs come in the layout their consumers want.

    Views between the op and the clone get fresh fake values first: they were traced on the old
    layout. The graph is functional, so a clone of a tensor nobody mutates is only a copy."""
    graph = gm.graph
    starts = [n for n in graph.nodes if is_op(n, *_ATTENTION_OPS)]  # (it runs before qkv_attention)
    for start in starts:
        frontier = [g for g in start.users if g.target is operator.getitem and g.args[1] == 0]
        for g in frontier:
            refresh_val(g, ctx)
        while frontier:
            n = frontier.pop()
            for u in list(n.users):
                if is_op(u, aten.clone):
                    src = tensor_meta(u.args[0])
                    fmt = u.kwargs.get("memory_format", torch.preserve_format)
                    if src is not None and src.is_contiguous() and fmt in (torch.contiguous_format, torch.preserve_format):
                        u.replace_all_uses_with(u.args[0])
                        graph.erase_node(u)
                        # the context's transpose copy: absorbed by the attention (not a fusion of its own)
                        ctx.replaced["attention"] = ctx.replaced.get("attention", 0) + 1
                        continue
                if is_op(u, aten.transpose, aten.permute, *_RESHAPES, aten.expand):
                    refresh_val(u, ctx)
                    frontier.append(u)

"""Attention without layout copies: the fusions ``attention`` (the eager chain) and ``lower_sdpa_calls``
(a model's own scaled_dot_product_attention calls), the clean-up after them (``noop_clones``), and
``restore_sdpa``, which runs on the lowered graph before the pipeline (passes.LOWERING).

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
(the ``noop_clones`` pass removes it), and their backwards write dq, dk and dv in the projections'
layout.
Grouped-query k and v are read before ``repeat_kv``'s copies. Readers of the probabilities (returned
attention weights) get the fused op's, which only the GEMM form has.
Soft-capped scores (Gemma 2's ``tanh(s * scaling / cap) * cap`` before the mask, whose ``* cap``
the softmax took as its scale) become ``dmfx::flash_attention(..., softcap=cap)``, the one form that
applies a cap; where it cannot run (a dtype or device without the fused kernel, a decode step, the
probabilities read) the chain is left to the GEMMs around the fused softmax, as before.

QKV stacking, which reads these ops afterwards, is passes/qkv_attention.py.
"""

from __future__ import annotations

import logging
import operator

import torch
from torch.fx import Graph, GraphModule, Node

from .fusion import Fusion, Match, Miss, Replacement, record
from .graph_utils import (
    RESHAPES,
    PassContext,
    aten,
    broadcasts_to,
    float_input,
    getitem_users,
    insert_call,
    insert_getitems,
    is_op,
    is_transpose,
    number_near,
    refresh_val,
    same_shape,
    scaled_tanh,
    size_args,
    tensor_meta,
    views_to_reshapes,
)

log = logging.getLogger("dmfx")
# the ops the attention fusions emit: what noop_clones and qkv_attention start from
ATTENTION_OPS = (torch.ops.dmfx.attention, torch.ops.dmfx.flash_attention)


def _unflatten_of(operand: object, shape4) -> Node | None:
    """`operand` is a bmm operand [B*H, M, K] reshaped from a 4-D [B, H, M, K] tensor, perhaps through
    a no-op expand and a copy (clone): that 4-D tensor."""
    if not is_op(operand, *RESHAPES):
        return None
    n = operand.args[0]
    while True:
        if is_op(n, aten.clone):
            n = n.args[0]
        elif is_op(n, aten.expand) and same_shape(tensor_meta(n.args[0]).shape, tensor_meta(n).shape):
            n = n.args[0]
        else:
            break
    m = tensor_meta(n)
    if m is None or m.dim() != 4 or not same_shape(m.shape, shape4):
        return None
    return n


def _repeat_kv_source(t: Node) -> Node | None:
    """t = repeat_kv(x) as HF LLaMA/Mistral write it, ``x[:, :, None].expand(B, Hk, g, L, D)
    .reshape(B, Hk * g, L, D)`` (at ATen: unsqueeze, expand, clone, _unsafe_view): x [B, Hk, L, D]."""
    if not is_op(t, *RESHAPES):
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
    if xm is None or xm.dim() != 4 or tm is None or not same_shape(xm.shape[2:], tm.shape[2:]) or xm.shape[0] != tm.shape[0]:
        return None
    return x




def _second_gemm(outs: list[Node]) -> tuple[Node, list[Node], Node] | None:
    """The softmax output `o` (one of `outs`) feeds ``bmm(view(expand(o)), v)`` or ``bmm(view(o), v)``:
    (o, the nodes from o to that bmm: the expand, if any, and the view; the bmm). (torch 2.11's p=0 training dropout, a clone
    between the softmax and the expand, is gone before this pass: identity_clones.)"""
    for o in outs:
        for u in o.users:
            # matmul's expand before the view, or none (BLOOM's bmm(probs.view(B*H, Lq, Lk), v))
            path = [u] if is_op(u, *RESHAPES) else [u, *u.users] if is_op(u, aten.expand) and len(u.users) == 1 else []
            r = path[-1] if path else None
            if is_op(r, *RESHAPES) and len(r.users) == 1:
                (bmm2,) = r.users
                if is_op(bmm2, aten.bmm) and bmm2.args[0] is r and len(bmm2.users) == 1:
                    return o, path, bmm2
    return None


def _grouped_kv(kt4: Node, v4: Node) -> tuple[Node | None, Node]:
    """Grouped-query attention: k and v as they were before repeat_kv's copies (the ops index kv
    heads themselves): (k, v), or (None, v4) when they are not repeat_kv outputs."""
    k_src = _repeat_kv_source(kt4.args[0]) if is_transpose(kt4, (2, 3)) else None
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


def _head_dim_scale(c: Node, D: object) -> float | None:
    """The value of `c` when it is a float input whose value is 1/sqrt(D) now (HF's attention scaling;
    a static head dim `D`): it is then specialized with a guard (number_near), so a model that
    changes it recompiles. None for any other run-time scale (a temperature that changes every step
    stays a run-time scale)."""
    v = float_input(c)  # (read before the guard: it specializes the symbol away)
    if v is None or not (isinstance(D, int) and D > 0) or not number_near(c, D ** -0.5, rel=1e-6):
        return None
    return float(v.node.hint)


def _baddbmm_of(s: Node) -> Node | None:
    """s = view(baddbmm(bias, a, b, beta=, alpha=), 4-D): the baddbmm (BLOOM's ALiBi scores,
    ``alibi.baddbmm(q, k_t, beta=1, alpha=1/sqrt(d))``)."""
    if not is_op(s, *RESHAPES) or len(s.users) != 1:
        return None
    b = s.args[0]
    if not is_op(b, aten.baddbmm) or len(b.users) != 1 or len(b.args) != 3:
        return None
    return b


def _position_bias(ctx: PassContext, baddbmm: Node, mask: Node | None, shape4) -> tuple[Node, list, float, float] | Miss:
    """The bias of ALiBi scores ``beta * bias + alpha * (q @ k_t)`` (BLOOM): (bias, the size arguments of its
    [B, H or 1, ...] view, beta, alpha), where the
    attention can take ``scale * beta * bias`` as (part of) its mask: a bias of [B*H or 1, Lq or 1, Lk]
    that needs no gradient, in the scores' dtype, whose sum with the softmax's mask is no larger than
    the bias itself (no mask, or a causal one the softmax took as causal=True: ALiBi's [B, H, 1, Lk] per
    key; a [B, 1, Lq, Lk] padding mask would make it as large as the scores, which the unfused form
    writes anyway)."""
    bias = baddbmm.args[0]
    beta, alpha = baddbmm.kwargs.get("beta", 1), baddbmm.kwargs.get("alpha", 1)
    bm, sm = tensor_meta(bias), tensor_meta(baddbmm)
    if not all(isinstance(c, (int, float)) and not isinstance(c, bool) for c in (beta, alpha)):
        return Miss("a position bias (baddbmm) whose beta or alpha is not a constant")
    if bm is None or bm.dim() != 3 or bm.dtype != sm.dtype:
        return Miss("a position bias (baddbmm) that is not a 3-D tensor in the scores' dtype")
    B, H, Lq, Lk = shape4
    per_head = same_shape(bm.shape[:1], (B * H,))  # (else one bias for every head: [1, ...]; no guard on a SymInt)
    if not (per_head or (isinstance(bm.shape[0], int) and bm.shape[0] == 1)) or not broadcasts_to(bm.shape[1:], (Lq, Lk)):
        return Miss(f"a position bias (baddbmm) of shape {list(bm.shape)}, not [B*H or 1, Lq or 1, Lk]")
    if ctx.needs_grad(bias):
        return Miss("a position bias (baddbmm) that requires grad: dmfx's fused forms take no bias gradient")
    bias4 = (B, H) if per_head else (1, 1)
    sizes = size_args(bias.graph, [*bias4, *bm.shape[1:]])  # (its 4-D view's, _bias_mask)
    if sizes is None:
        return Miss("a position bias (baddbmm) whose 4-D view would need a size that is no graph input's")
    if mask is not None:
        mm = tensor_meta(mask)
        whole = (*bias4, *bm.shape[1:])
        if mm.dtype != bm.dtype or not broadcasts_to(mm.shape, whole):
            return Miss(f"a position bias (baddbmm) with a {list(mm.shape)} {mm.dtype} mask: their sum, which the fused "
                        "forms would read as their mask, would be larger than the bias")
    return bias, sizes, float(beta), float(alpha)


def _bmm_of(s: Node) -> Node | None:
    """s = view(bmm(a, b), 4-D): the bmm."""
    if not is_op(s, *RESHAPES) or len(s.users) != 1:
        return None
    b = s.args[0]
    if not is_op(b, aten.bmm) or len(b.users) != 1:
        return None
    return b



#: bf16/fp16 attention in training on the CPU takes dmfx's GEMM form up to this many keys, PyTorch's SDPA
#: beyond (bench/attention.py --dtype bfloat16, B=8 H=12 D=64, 1 thread, forward + backward: the GEMM form
#: 2.8x SDPA at L=128, 1.6x at 256, 0.88x at 384, 0.79x at 512, where its [B, H, L, L] scores leave the cache).
GEMM_FORM_MAX_KEYS = 256

#: causal float32 attention on the CPU takes dmfx's fused kernel from this many keys, PyTorch's SDPA below
#: (bench/attention.py --mask causal, B=4 H=8 D=64, 1 thread: 0.97x / 1.03x SDPA at L=256 in training /
#: inference, 1.35x / 1.34x at L=512, 1.27x training at L=1024, B=2: each block of query rows reads only
#: the keys up to its diagonal; below it a tie, where SDPA stays).
CAUSAL_FLASH_MIN_KEYS = 512

#: fuse="auto" keeps a CPU inference graph without dropout for dmfx where an eager causal attention (a
#: causal mask of constants) runs over this many keys or more (dmfx/inductor.py long_causal_attention):
#: as one causal attention (dmfx's kernel from CAUSAL_FLASH_MIN_KEYS keys, PyTorch's SDPA with is_causal
#: below) it reads no [L, L] mask and writes no scores, where Inductor materializes both. Whole LLaMA
#: inference forwards with eager attention, 4 layers, 1 thread (bench/RESULTS.md, stop 46): 1.30x
#: Inductor at 2048 keys, 1.06x at 512, 1.03-1.05x at 256; at 128 a tie (LLaMA-lm, B=8) to 1.07x
#: (LLaMA-small), so 128 is left to Inductor. Training keeps them from CAUSAL_FLASH_MIN_KEYS.
CAUSAL_INFER_MIN_KEYS = 256

#: The same for bf16/fp16 scores (an autocast forward), where the attention becomes PyTorch's bf16 SDPA
#: against Inductor's fused bf16 chain: LLaMA's inference forward ran 0.92x Inductor at 256 keys, 0.93x
#: at 512 and 1.06x at 1024 (bench/RESULTS.md, stop 46). In training they keep the float32 threshold (the
#: bf16 step at 512 keys 1.00x Inductor, at 1024 1.03-1.05x; 0.97x and 0.92-1.00x with the loss alone).
CAUSAL_INFER_LOW_PRECISION_MIN_KEYS = 1024


def causal_scope_min_keys(training: bool, dtype: torch.dtype) -> int:
    """The fewest keys of an eager causal attention whose scores (the QK^T GEMM's output) are of `dtype`
    that fuse="auto" keeps for dmfx in a graph it otherwise leaves to Inductor: CAUSAL_FLASH_MIN_KEYS in
    training; in inference CAUSAL_INFER_MIN_KEYS for float32 scores, CAUSAL_INFER_LOW_PRECISION_MIN_KEYS
    for bf16/fp16 ones."""
    if training:
        return CAUSAL_FLASH_MIN_KEYS
    return CAUSAL_INFER_MIN_KEYS if dtype == torch.float32 else CAUSAL_INFER_LOW_PRECISION_MIN_KEYS


def _flash_kernels(q4: Node, v4: Node) -> tuple[bool, bool]:
    """(dmfx's fused kernel takes these q / v here, the cost model may pick it on its own). dmfx's CUDA
    flash kernel has run on a CPU emulation of CUDA (tests/test_emulated_cuda_flash.py) but not yet on
    a GPU: until bench/gpu_check.sh has passed on one, only attention="flash" runs it (neither the rules
    nor tuning, which would time it but not check its results)."""
    from ..cuda_ops import flash_supported

    qm = tensor_meta(q4)
    ok = flash_supported(qm.device, qm.dtype, qm.shape[3], tensor_meta(v4).shape[3])
    return ok, ok and qm.device.type != "cuda"


def _decode_step(ctx: PassContext, q4: Node) -> bool:
    """One query row in inference: a decode step against a cache."""
    rows = tensor_meta(q4).shape[2]
    return isinstance(rows, int) and rows == 1 and not ctx.needs_grad(q4)


def _required_form(ctx: PassContext, mask: Node | None, probs_read: bool, flash_ok: bool,
                   sdpa_ok: bool) -> tuple[str, str] | None:
    """The form what the graph reads or the user's option demands, before any cost: the GEMM form for the
    probabilities read elsewhere or a mask that requires grad (only it hands them out), else the form
    option ``attention`` names where it can run; None where the cost decides."""
    if probs_read:
        return "gemm", "the attention probabilities are read elsewhere (returned attention weights)"
    if mask is not None and ctx.needs_grad(mask):
        return "gemm", "the mask requires grad (a learned position bias): only the unfused form computes its gradient"
    forced = ctx.attention
    if forced == "gemm" or (forced == "flash" and flash_ok) or (forced == "sdpa" and sdpa_ok):
        return forced, f"option attention={forced!r}"
    return None


def softcap_form(ctx: PassContext, q4: Node, v4: Node, mask: Node | None, probs_read: bool) -> tuple[str | None, str]:
    """choose_form for soft-capped scores (Gemma 2). dmfx::flash_attention is the one form that applies the
    cap inside the attention, so the choice is ("flash", why) or (None, why not), and None leaves the
    attention to the GEMMs around the fused softmax: where the fused kernel does not run, where the graph
    or option ``attention`` demands another form (the same _required_form as choose_form's), on CUDA
    unless asked for, and in a decode step (where choose_form would take SDPA's single-row kernel)."""
    flash_ok, flash_auto = _flash_kernels(q4, v4)
    qm = tensor_meta(q4)
    if not flash_ok:
        return None, f"soft-capped scores need dmfx's fused kernel, which does not take {qm.dtype} on {qm.device.type} here"
    required = _required_form(ctx, mask, probs_read, flash_ok, sdpa_ok=False)
    if required is not None:
        if required[0] == "flash":
            return required
        return None, f"soft-capped scores run only in the flash form, and {required[1]}"
    if not flash_auto:
        return None, ("soft-capped scores on CUDA: dmfx's CUDA flash kernel has not run on a GPU yet "
                      "(attention='flash' asks for it)")
    if _decode_step(ctx, q4):
        return None, ("soft-capped scores over one query row (a decode step): dmfx's kernel, built for blocks of "
                      "query rows, is about 3x slower than a single-row kernel there (bench/generate.py)")
    return "flash", "soft-capped scores: only dmfx's fused kernel applies the cap inside the attention"


def choose_form(ctx: PassContext, q4: Node, k4: Node, v4: Node, mask: Node | None, causal: bool, p: float,
                scale: float, probs_read: bool) -> tuple[str, str]:
    """The cost model, checked against bench/attention.py (numbers in bench/RESULTS.md). Returns
    (form, why) with form one of

    * "gemm": dmfx::attention, the paper's two batched GEMMs around the fused softmax. The only form
      that hands out the probabilities (returned attention weights) and a mask gradient (T5's
      learned position bias), so it runs wherever those are needed, where nothing fused exists
      (dropout in bf16/fp16 on the CPU), and in bf16/fp16 training on the CPU without dropout over at
      most GEMM_FORM_MAX_KEYS keys, where its forward + backward beats SDPA's.
    * "flash": dmfx::flash_attention, the scores kept in cache per block of query rows and recomputed
      in the backward. With dropout on the CPU it is 1.7x (L=128) to 2.7x (L=512) faster than SDPA,
      which falls back to its unfused math path for dropout on the CPU, and 1.2-1.6x faster than
      the "gemm" form; it also saves no [B, H, L, L] tensor for the backward.
      Also without dropout (fp32): in training, causal or not, it ties SDPA's flash kernel (forward +
      backward, with and without a padding mask; causal 0.97-0.99x at 128-256 keys, 1.35x from 512),
      and unlike SDPA it reads the stacked Q/K/V
      projection and folds the bias gradients (passes/backward/fold_bias_grads.py), which SDPA's
      backward cannot; in inference it is 0.99-1.11x SDPA's (its GEMMs call BLAS directly).

    * "sdpa": PyTorch's own scaled_dot_product_attention, for one query row in inference (a decode
      step: dmfx's kernel, built for blocks of query rows, is about 3x slower there), for causal
      attention in inference over fewer than CAUSAL_FLASH_MIN_KEYS keys (a tie there; from that
      many keys dmfx's kernel, which skips the keys past each block's diagonal, is 1.3x faster),
      for bf16/fp16 on the CPU in inference (about 2x faster than the "gemm" form) or over longer
      keys, and on CUDA (its flash / efficient / cuDNN kernels run on tensor cores; dmfx's CUDA flash
      kernel, csrc/attention_cuda.cu, on CUDA cores, and it has not run on a GPU yet: only
      attention="flash" picks it). Not with a causal mask over different query and
      key lengths (SDPA aligns it top-left, dmfx and HF bottom-right).

    With ``options={"tune": True}`` the feasible forms are timed instead (passes/tuning.py).
    """
    qm = tensor_meta(q4)
    flash_ok, flash_auto = _flash_kernels(q4, v4)
    # (SDPA takes a mask or is_causal, not both: an ALiBi bias under a causal mask is dmfx's)
    sdpa_ok = not causal or (qm.shape[2] == tensor_meta(k4).shape[2] and mask is None)
    required = _required_form(ctx, mask, probs_read, flash_ok, sdpa_ok)
    if required is not None:
        return required
    if ctx.tune and ctx.attention == "auto":
        from .tuning import attention_case, tuned_attention_form

        forms = ["gemm"] + (["flash"] if flash_auto else []) + (["sdpa"] if sdpa_ok else [])
        case = attention_case(qm, tensor_meta(k4), tensor_meta(v4), tensor_meta(mask), causal, p, ctx.training)
        tuned = tuned_attention_form(case, forms, scale, p)
        if tuned is not None:
            best, ms = tuned
            return best, "tuned: " + ", ".join(f"{f} {t:.2f} ms" for f, t in sorted(ms.items(), key=lambda kv: kv[1]))
    if qm.device.type == "cpu" and p > 0:
        if flash_auto:
            return "flash", "dropout on the CPU: no fused PyTorch kernel"
        return "gemm", f"dropout on the CPU in {qm.dtype}: no fused kernel"
    if qm.device.type == "cpu" and _decode_step(ctx, q4) and sdpa_ok:
        return "sdpa", ("one query row (a decode step): PyTorch's SDPA kernel is about 3x faster than dmfx's "
                        "here (0.10 vs 0.28 ms per call, LLaMA hidden 512 with a 64-row static cache: bench/generate.py)")
    keys = tensor_meta(k4).shape[2]
    if (qm.device.type == "cpu" and qm.dtype in (torch.bfloat16, torch.float16) and ctx.needs_grad(q4)
            and isinstance(keys, int) and keys <= GEMM_FORM_MAX_KEYS):
        return "gemm", (f"training in {qm.dtype} on the CPU over at most {GEMM_FORM_MAX_KEYS} keys: dmfx's GEMM form "
                        "(the fused softmax between two batched GEMMs) runs forward + backward faster than PyTorch's "
                        "SDPA (bf16, 1 thread, B=8 H=12: 2.8x at L=128, 1.6x at L=256; causal L=256 1.1x; "
                        "bench/attention.py --dtype bfloat16, bench/RESULTS.md)")
    if qm.device.type == "cpu" and qm.dtype == torch.float32 and flash_auto and ctx.needs_grad(q4):
        return "flash", ("training without dropout on the CPU: dmfx's fused kernel ties SDPA's forward+backward "
                         "(bench/attention.py --mask none; causal: 0.97-0.99x at 128-256 keys, 1.35x from 512) and "
                         "lets the projections stack and the bias gradients fold into its backward")
    if qm.device.type == "cpu" and qm.dtype == torch.float32 and not causal and flash_auto:
        return "flash", ("inference on the CPU: dmfx's fused kernel is 0.99-1.11x SDPA's "
                         "(bench/attention.py --mode infer) and writes the context in the layout the next GEMM reads")
    if (qm.device.type == "cpu" and qm.dtype == torch.float32 and causal and flash_auto and isinstance(keys, int)
            and keys >= CAUSAL_FLASH_MIN_KEYS):
        return "flash", (f"causal attention over at least {CAUSAL_FLASH_MIN_KEYS} keys on the CPU: dmfx's fused kernel "
                         "skips the keys past each block's diagonal and is about 1.3x PyTorch's SDPA there "
                         "(bench/attention.py --mask causal: 1.35x training, 1.34x inference at L=512)")
    if sdpa_ok:
        return "sdpa", _why_sdpa(qm, causal)
    if flash_auto:
        if mask is not None:
            return "flash", ("a mask under causal=True (an ALiBi bias in a causal LM): PyTorch's SDPA takes a mask or "
                             "is_causal, not both, and dmfx's kernel skips the keys past each block's diagonal")
        return "flash", "causal attention over different query and key lengths"
    return "gemm", "no fused kernel for this case"


def _why_sdpa(qm: torch.Tensor, causal: bool) -> str:
    """Why the cost model leaves an attention without dropout to PyTorch's SDPA, in words."""
    if qm.device.type != "cpu":
        return f"on {qm.device.type}, PyTorch's SDPA (its tensor-core kernels) is the fastest"
    if qm.dtype != torch.float32:
        return (f"{qm.dtype} on the CPU, inference or over more than {GEMM_FORM_MAX_KEYS} keys: PyTorch's SDPA "
                "kernel is faster than dmfx's GEMM form (bf16, 1 thread, B=8 H=12: inference 2.1 vs 4.0 ms at "
                "L=128; training 145 vs 184 ms at L=512; dmfx's fused kernel runs float32 only)")
    if causal:
        return (f"causal attention without dropout over fewer than {CAUSAL_FLASH_MIN_KEYS} keys: PyTorch's SDPA ties "
                "dmfx's kernel there (both skip the masked half)")
    return "PyTorch's SDPA kernel is the fastest here"


def _insert_sdpa(graph, ctx, q4, k4, v4, mask, scale, causal, p) -> Node:
    qm = tensor_meta(q4)
    if mask is not None and tensor_meta(mask).dtype not in (torch.bool, qm.dtype):
        mask = insert_call(graph, ctx, aten._to_copy.default, (mask,), {"dtype": qm.dtype})
    kwargs = {"scale": scale}
    if qm.shape[1] != tensor_meta(k4).shape[1]:
        kwargs["enable_gqa"] = True
    return insert_call(graph, ctx, aten.scaled_dot_product_attention.default, (q4, k4, v4, mask, p, causal), kwargs)



def match_attention(sm: Node, ctx: PassContext) -> Match | Miss | None:
    """The two batched GEMMs of the module docstring around the fused softmax `sm` (4-D scores)."""
    scores, mask, scale, causal, seed, p = sm.args
    sm_val = tensor_meta(scores)
    if sm_val is None or sm_val.dim() != 4:
        return None
    B, H, Lq, Lk = sm_val.shape
    bmm1, q_scale, score_views, softcap, bias = _bmm_of(scores), None, [scores], 0.0, None
    capped = scaled_tanh(scores) if bmm1 is None else None  # Gemma 2's soft cap, whose * cap the softmax took
    baddbmm = _baddbmm_of(scores) if bmm1 is None else None
    if baddbmm is not None:
        # BLOOM's ALiBi: softmax((beta * bias + alpha * q·kᵀ) * scale + mask) is the attention of
        # q·kᵀ * (alpha * scale) with the mask (beta * scale) * bias + mask
        if not isinstance(scale, float):
            return Miss("a position bias (baddbmm) under a scale that is not a constant")
        bias = _position_bias(ctx, baddbmm, mask, (B, H, Lq, Lk))
        if isinstance(bias, Miss):
            return bias
        bmm1 = baddbmm
    elif capped is not None and _bmm_of(capped[0]) is not None:
        # softmax(tanh(s * f) * cap + mask): flash_attention's softcap * tanh(s * scale / softcap)
        if not (isinstance(scale, float) and scale > 0):
            return Miss("soft-capped scores with a cap that is not a positive constant")
        s, factor, chain = capped
        bmm1, score_views, softcap, scale = _bmm_of(s), [*chain, s], scale, factor * scale
    elif bmm1 is None and _runtime_scale(scores):
        # the scale is a run-time scalar (torch.compile(dynamic=True) makes HF's 1/sqrt(d) one):
        # it cannot be the ops' float argument, so it moves onto q (one pass over q, not the scores)
        bmm1, q_scale, score_views = _bmm_of(scores.args[0]), scores.args[1], [scores, scores.args[0]]
    if bmm1 is None:
        return Miss("the scores do not come from a batched GEMM read only by the softmax")
    a, b = bmm1.args[1:3] if bias is not None else bmm1.args[:2]
    D = tensor_meta(a).shape[-1]
    head_dim_scale = _head_dim_scale(q_scale, D) if q_scale is not None else None
    if head_dim_scale is not None:
        # HF's 1/sqrt(head_dim), a float input under dynamic=True: specialized with a guard
        # (graph_utils.number_near), it is a constant like any other and joins the softmax's scale
        scale, q_scale = scale * head_dim_scale, None
    q4 = _unflatten_of(a, (B, H, Lq, D))
    kt4, k_flat = _unflatten_of(b, (B, H, D, Lk)), None
    if kt4 is None and is_op(b, aten.transpose) and sorted(d % 3 for d in b.args[1:3]) == [1, 2]:
        k_flat = _unflatten_of(b.args[0], (B, H, Lk, D))  # BLOOM: k.reshape(B*H, Lk, D).transpose(1, 2)
    if q4 is None or (kt4 is None and k_flat is None):
        return Miss("q or k is not a 4-D [B, H, L, D] tensor (grouped-query repeat_kv, 3-D q)")

    items = getitem_users(sm)
    outs, probs_outs = items.get(0, []), items.get(1, [])
    found = _second_gemm(outs)
    if found is None:
        return Miss("the probabilities do not feed a batched GEMM with v")
    o, path, bmm2 = found
    (ctx4,) = bmm2.users
    vm = tensor_meta(bmm2.args[1])
    Dv = vm.shape[-1]
    v4 = _unflatten_of(bmm2.args[1], (B, H, Lk, Dv))
    c4m = tensor_meta(ctx4)
    if v4 is None or not is_op(ctx4, *RESHAPES) or c4m is None or not same_shape(c4m.shape, (B, H, Lq, Dv)):
        return Miss("v is not a 4-D [B, H, L, D] tensor or the context is not viewed back to 4-D")
    k_src, v4 = _grouped_kv(kt4, v4) if kt4 is not None else (k_flat, v4)
    dtypes = {tensor_meta(t).dtype for t in (q4, k_src if k_src is not None else kt4, v4)} | {sm_val.dtype}
    if len(dtypes) != 1:
        return Miss(f"q, k, v and the scores have different dtypes {sorted(map(str, dtypes))}")

    # the softmax's outputs read elsewhere (returned attention weights): only the GEMM form has them
    read_elsewhere = [g for g in outs if g is not o or len(g.users) > 1]
    softcap_why = None
    if softcap:
        form, softcap_why = softcap_form(ctx, q4, v4, mask, bool(read_elsewhere or probs_outs))
        if form is None:
            return Miss(softcap_why)
    nodes = {"softmax": sm, "q4": q4, "kt4": kt4, "k_src": k_src, "v4": v4, "mask": mask, "scale": scale,
             "causal": causal, "seed": seed, "p": p, "q_scale": q_scale, "context": ctx4,
             "outs_read": read_elsewhere, "probs_read": probs_outs, "softcap": softcap,
             "softcap_why": softcap_why, "bias": bias}
    chain = [sm, *outs, *probs_outs, *path, bmm2, ctx4, *score_views, bmm1]
    return Match(nodes, chain, returned=(ctx4, *read_elsewhere, *probs_outs))


def rewrite_attention(graph: Graph, m: Match, ctx: PassContext) -> Replacement:
    q4, kt4, v4, mask, scale, causal, p = (m[k] for k in ("q4", "kt4", "v4", "mask", "scale", "causal", "p"))
    with graph.inserting_before(m["softmax"]):
        if m["k_src"] is not None:
            k4 = m["k_src"]
        elif is_transpose(kt4, (2, 3)):
            k4 = kt4.args[0]  # HF writes k.transpose(-1, -2)
        else:
            k4 = insert_call(graph, ctx, aten.transpose.int, (kt4, 2, 3))
        if m["q_scale"] is not None:
            q4 = insert_call(graph, ctx, aten.mul.Tensor, (q4, m["q_scale"]))
        if m["bias"] is not None:
            mask, scale = _bias_mask(graph, ctx, *m["bias"], mask, scale)
        probs_read = bool(m["outs_read"] or m["probs_read"])
        if m["softcap"]:  # (match_attention chose the flash form: softcap_form)
            form, why = "flash", m["softcap_why"]
        else:
            form, why = choose_form(ctx, q4, k4, v4, mask, causal, p, scale, probs_read)
        if form == "sdpa":
            fused = out = _insert_sdpa(graph, ctx, q4, k4, v4, mask, scale, causal, p)
        else:
            op = torch.ops.dmfx.flash_attention if form == "flash" else torch.ops.dmfx.attention
            args = (q4, k4, v4, mask, scale, causal, m["seed"], p) + ((m["softcap"],) if m["softcap"] else ())
            fused = insert_call(graph, ctx, op.default, args)
            out, *rest = insert_getitems(graph, fused, 2 if form == "flash" else 3)
    uses = {m["context"]: out}
    if form == "gemm":  # readers of the softmax's outputs elsewhere (returned attention weights)
        probs, dropped = rest
        uses.update({g: dropped if p > 0 else probs for g in m["outs_read"]})
        uses.update({g: probs for g in m["probs_read"]})
    ctx.forms[fused.name] = (form, why)
    log.debug("dmfx: attention at %s runs in the %s form: %s", m["softmax"].name, form, why)
    # the SDPA form's output layout depends on the kernel PyTorch picks at run time
    return Replacement(fused, uses, strides_unknown=(out,) if form == "sdpa" else ())


def _bias_mask(graph: Graph, ctx: PassContext, bias: Node, sizes: list, beta: float, alpha: float, mask: Node | None,
               scale: float) -> tuple[Node, float]:
    """ALiBi scores' attention (_position_bias): the mask ``bias * (beta * scale) (+ mask)``, the bias
    viewed as [B, H, Lq or 1, Lk] (or [1, 1, ...]: `sizes`), and the scale ``alpha * scale``."""
    bias4 = insert_call(graph, ctx, aten.view.default, (bias, sizes))
    if beta * scale != 1.0:
        bias4 = insert_call(graph, ctx, aten.mul.Tensor, (bias4, beta * scale))
    if mask is not None:
        bias4 = insert_call(graph, ctx, aten.add.Tensor, (bias4, mask))
    return bias4, alpha * scale


#: q·kᵀ -> dmfx::attention_softmax -> ·v (the module docstring) -> one attention in the form
#: choose_form picks.
ATTENTION = Fusion("attention", (torch.ops.dmfx.attention_softmax,), match_attention, rewrite_attention, gemm="inside")


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




def match_sdpa_call(n: Node, ctx: PassContext) -> Match | Miss | None:
    """A model's own ``scaled_dot_product_attention`` call (HF's "sdpa" implementation) goes through
    the same cost model as the eager pattern: where it picks dmfx's fused kernel (training without
    dropout on the CPU, so that the projections stack and the bias gradients fold), the call becomes
    ``dmfx::flash_attention`` with the same q, k, v, mask (bool: True = attend, as in SDPA) and scale
    (SDPA's default 1/sqrt(D) made explicit); where it picks the GEMM form for its speed (bf16/fp16
    training on the CPU over short keys, where PyTorch's CPU kernel is slow backward), ``dmfx::attention``
    with the same arguments; elsewhere it stays PyTorch's. With dropout on the CPU
    the call never reaches the graph as one op: SDPA runs its math path, whose ops the softmax and
    attention fusions take. A causal call (a decoder's prefill) over equal query and key lengths goes
    to the cost model as causal attention (which leaves it to SDPA unless ``attention="flash"`` or
    tuning picks dmfx's causal kernel); over different lengths it stays PyTorch's (SDPA aligns its
    mask top-left, dmfx's kernel bottom-right). A call left to PyTorch is a near-miss with the cost
    model's reason, so the record says why each attention was not fused."""
    call = sdpa_call(n)
    if call is None:
        return None
    q4, k4, v4, mask, p, causal = (call[x] for x in ("q", "k", "v", "mask", "dropout", "causal"))
    qm, km, vm = (tensor_meta(t) for t in (q4, k4, v4))
    if any(m is None or m.dim() != 4 for m in (qm, km, vm)):
        return Miss("scaled_dot_product_attention on tensors that are not 4-D [B, H, L, D]")
    if p != 0.0:
        log.debug("dmfx: %s stays PyTorch's (dropout inside the call)", n.name)
        return None
    if causal and not _equal_sizes(qm.shape[2], km.shape[2]):
        return Miss("causal scaled_dot_product_attention over different query and key lengths: SDPA aligns "
                    "its mask top-left, dmfx's kernel bottom-right")
    if call["extra_outputs"] and any(not (u.target is operator.getitem and u.args[1] == 0) for u in n.users):
        return None  # its logsumexp is read: PyTorch's kernel must run
    heads, kv_heads = qm.shape[1], km.shape[1]
    if not isinstance(heads, int) or not isinstance(kv_heads, int) or heads % kv_heads:
        return None
    scale = call["scale"]
    if scale is None:
        d = qm.shape[-1]
        if not isinstance(d, int):
            return None  # a symbolic head size: the scale is not a float at compile time
        scale = d**-0.5
    form, why = choose_form(ctx, q4, k4, v4, mask, bool(causal), 0.0, float(scale), probs_read=False)
    # The GEMM form where the cost model picks it for speed (bf16/fp16 training on the CPU, or the option);
    # not where it picks it for a mask that requires grad: SDPA's call differentiates that mask already.
    if not (form == "flash" or (form == "gemm" and not ctx.needs_grad(mask))):
        return Miss(f"left to PyTorch's scaled_dot_product_attention: {why}")
    outs = tuple(n.users) if call["extra_outputs"] else (n,)  # (its getitems of the output, or itself)
    nodes = {"call": n, "q4": q4, "k4": k4, "v4": v4, "mask": mask, "scale": float(scale), "causal": bool(causal),
             "form": form, "why": why}
    return Match(nodes, list(dict.fromkeys([n, *outs])), returned=outs)


def _equal_sizes(a: object, b: object) -> bool:
    """Whether two sizes are equal for every value their symbols take (no guard added)."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return isinstance(a, torch.SymInt) and isinstance(b, torch.SymInt) and a.node.expr == b.node.expr


def rewrite_sdpa_call(graph: Graph, m: Match, ctx: PassContext) -> Replacement:
    n, form = m["call"], m["form"]
    op = torch.ops.dmfx.flash_attention.default if form == "flash" else torch.ops.dmfx.attention.default
    with graph.inserting_before(n):
        fused = insert_call(graph, ctx, op, (m["q4"], m["k4"], m["v4"], m["mask"], m["scale"], m["causal"], None, 0.0))
        out = insert_getitems(graph, fused, 2 if form == "flash" else 3)[0]
    ctx.forms[fused.name] = (form, m["why"])
    log.debug("dmfx: scaled_dot_product_attention %s runs in the %s form: %s", n.name, form, m["why"])
    # later views may have relied on PyTorch's output strides
    return Replacement(fused, {u: out for u in m.returned}, strides_unknown=(out,))


_SDPA_OPS = tuple(op for op in (getattr(aten, name, None) for name in _SDPA_CALLS) if op is not None)

#: scaled_dot_product_attention calls -> dmfx::flash_attention or dmfx::attention, where the cost model picks it.
LOWER_SDPA_CALLS = Fusion("lower_sdpa_calls", _SDPA_OPS, match_sdpa_call, rewrite_sdpa_call, gemm="inside")


def restore_sdpa(gm: GraphModule, ctx: PassContext) -> None:
    """Turn fused SDPA kernels chosen under no_grad back into ``aten.scaled_dot_product_attention``
    where their mask requires grad (passes.LOWERING: the lowered graph, in training, before the
    pipeline, and whether or not the pipeline runs).

    The forward graph is traced under no_grad, where SDPA may pick a kernel that cannot differentiate
    its mask (e.g. the CPU flash kernel with T5's learned position bias as the mask). Calling the
    composite op again lets AOTAutograd choose under the real grad mode. Views of the output that
    relied on the fused kernel's output strides become reshapes. Only nodes whose extra outputs
    (logsumexp, rng state) nobody reads are restored.
    """
    graph = gm.graph
    for n in list(graph.nodes):
        call = sdpa_call(n)
        if call is None or not call["extra_outputs"]:  # (the composite op itself needs nothing)
            continue
        mask = call["mask"]
        if not ctx.needs_grad(mask):
            continue
        if any(not (u.target is operator.getitem and u.args[1] == 0) for u in n.users):
            continue
        q, k, v = call["q"], call["k"], call["v"]
        qm, km = q.meta.get("val"), k.meta.get("val")
        gqa = qm is not None and km is not None and qm.dim() >= 3 and qm.shape[-3] != km.shape[-3]
        with graph.inserting_before(n):
            new = graph.call_function(
                aten.scaled_dot_product_attention.default,
                (q, k, v, mask, call["dropout"], call["causal"]),
                {"scale": call["scale"], **({"enable_gqa": True} if gqa else {})},
            )
        new.meta["val"] = n.meta["val"][0] if isinstance(n.meta.get("val"), (tuple, list)) else None
        for u in list(n.users):
            u.replace_all_uses_with(new)
            graph.erase_node(u)
        graph.erase_node(n)
        views_to_reshapes([new])  # later views may have relied on the fused kernel's output strides
        record(ctx, "restore_sdpa", ())


# ----------------------------------------------------------------------------------------- layouts


def noop_clones(gm: GraphModule, ctx: PassContext) -> None:
    """Drop ``clone`` (contiguous or preserved format) of a tensor that is already contiguous
    downstream of dmfx's attention ops, whose outputs come in the layout their consumers want.

    Views between the op and the clone get fresh fake values first: they were traced on the old
    layout. The graph is functional, so a clone of a tensor nobody mutates is only a copy."""
    graph = gm.graph
    starts = [n for n in graph.nodes if is_op(n, *ATTENTION_OPS)]  # (it runs before qkv_attention)
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
                        record(ctx, "noop_clones", [u], into=start)  # the context's transpose copy: the attention op's
                        graph.erase_node(u)
                        continue
                if is_op(u, aten.transpose, aten.permute, *RESHAPES, aten.expand):
                    refresh_val(u, ctx)
                    frontier.append(u)

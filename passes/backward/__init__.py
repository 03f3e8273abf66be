"""The passes over the backward graph, after AOTAutograd has derived it from the fused ops' formulas.

The forward pipeline (passes/__init__.py) decides what the backward looks like: each dmfx op brings
its own fused backward op. What is left between those ops are the adds of the two gradients a tensor
receives when it is read twice (a layer input read by the residual and by a GEMM; a norm's output read
by the next residual and by the next GEMM): the paper's EBSB/BEI. Eager runs each add as its own
kernel, reading two [tokens, hidden] tensors and writing a third. Two folds remove them:

``fold_gradient_adds`` (fold_gradient_adds.py): ``norm_backward(add(g1, g2), ...)`` ->
    ``norm_backward(g1, ..., grad_out2=g2)``: the kernel adds the two gradients as it reads them (in
    the accumulation type), in cache.

``accumulate_into_gemm`` (accumulate_into_gemm.py): ``add(g, mm(a, b))`` (through views) ->
    ``addmm_(g, a, b)``: the GEMM accumulates into the other gradient's buffer (beta=1 in BLAS) instead
    of writing a new one that an add then reads. Only when that buffer is a fresh, contiguous result
    of this graph (not an input) that nothing reads after the add, through any view (so writing into
    it cannot change any other value), of the GEMM's dtype and shape. Chains of adds (three unstacked
    projections) accumulate into one buffer.

``fold_logits_grad`` (fold_logits_grad.py): ``add(g, view(cross_entropy_backward(...)))`` ->
    ``cross_entropy_backward(..., grad_logits=g)``: the gradient that reaches returned logits
    themselves (AOTAutograd's tangent for them, zeros when unused) is added as the kernel writes
    dlogits, instead of in one more pass over ``[tokens, vocab]``.

``fold_softcap_grad`` (fold_softcap_grad.py): ``softcap_backward(view(cross_entropy_backward(...)), c,
    cap)`` where the loss's logits are the soft cap's output c -> ``cross_entropy_backward(...,
    softcap=cap)``: the loss kernel multiplies by the cap's derivative as it writes the gradient (Gemma
    2's soft-capped logits), instead of two more passes and a fresh buffer over ``[tokens, vocab]``.
``fold_bias_grads`` (fold_bias_grads.py): ``sum(dqkv over rows)`` after
    ``qkv_flash_attention_backward`` (and each of dq, dk, dv's row sums after
    ``flash_attention_backward``, for three separate projections) -> the op's own bias-gradient
    outputs (``bias_grad=True``): the projections' bias gradients summed per (batch, head) while the
    attention backward has dq, dk, dv in cache (the paper's BAIB). Likewise ``sum(dx over rows)``
    after ``norm_backward`` -> its dbias output.

``accumulate_embedding_grad`` (accumulate_embedding_grad.py): a tied embedding's gradient,
    ``add(mm, embedding_dense_backward(...))`` -> ``index_put_(mm, [indices], rows, accumulate=True)``:
    the token rows are added into the LM head GEMM's weight gradient where it is, instead of through a
    dense ``[vocab, hidden]`` zero tensor and one more pass over both (same conditions on the GEMM's
    buffer as ``accumulate_into_gemm``).

``unstack_dx`` (unstack_dx.py): the dX GEMM of stacked Q/K/V projections reads the three weights
    where they are (three accumulating GEMMs over the gradient's column blocks) instead of a stacked
    copy.

``backward_layout`` (passes/layout.py): the layout search on the backward graph.

``aten_backward`` (first; aten_backward.py): PyTorch's own backward ops of chains the forward
    pipeline did not rewrite (layer norm, GELU/SiLU/ReLU with their bias-gradient sum, softmax)
    become dmfx's backward kernels, which the folds above then apply to.

Each pass is ``fn(gm, ctx) -> None`` like the forward passes, and records what fired and what it
absorbed (passes/fusion.py, ``record``). ``options={"skip": [...]}`` skips them by name.
"""

from __future__ import annotations

from typing import Callable

from torch.fx import GraphModule

from ..graph_utils import PassContext, reshape_fused_views, run_passes
from ..layout import choose_backward_layouts
from .accumulate_embedding_grad import accumulate_embedding_grad
from .accumulate_into_gemm import accumulate_into_gemm
from .aten_backward import fuse_aten_backward
from .fold_bias_grads import fold_bias_grads
from .fold_gradient_adds import fold_gradient_adds
from .fold_logits_grad import fold_logits_grad
from .fold_softcap_grad import fold_softcap_grad
from .unstack_dx import unstack_dx

BackwardPass = Callable[[GraphModule, PassContext], None]

BACKWARD_PIPELINE: dict[str, BackwardPass] = {
    "aten_backward": fuse_aten_backward,
    "fold_logits_grad": fold_logits_grad,
    "fold_softcap_grad": fold_softcap_grad,
    "fold_gradient_adds": fold_gradient_adds,
    "fold_bias_grads": fold_bias_grads,
    "accumulate_into_gemm": accumulate_into_gemm,
    "accumulate_embedding_grad": accumulate_embedding_grad,
    "unstack_dx": unstack_dx,
    "backward_layout": choose_backward_layouts,
}


def run_backward_pipeline(gm: GraphModule, ctx: PassContext, skip: tuple[str, ...] = (),
                          verify: bool | str | None = None) -> GraphModule:
    """Run the backward passes not in `skip`, then `reshape_fused_views` (run_passes; `verify`: the
    graph verifier after each)."""
    run_passes(gm, ctx, {**BACKWARD_PIPELINE, "reshape_fused_views": reshape_fused_views}, skip, verify=verify)
    gm.graph.lint()
    gm.recompile()
    return gm


__all__ = ["BACKWARD_PIPELINE", "accumulate_embedding_grad", "accumulate_into_gemm", "fold_bias_grads", "fold_gradient_adds",
           "fold_logits_grad",
           "fuse_aten_backward", "run_backward_pipeline", "unstack_dx"]

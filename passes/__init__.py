"""dmfx's graph passes, in the order they run. Each is ``fn(gm, ctx) -> None``: it rewrites the ATen
graph in place and records in the PassContext what fired, what it absorbed and the near-misses.

* ``LOWERING``: on the lowered graph itself, before the pipeline, whether or not the pipeline runs
  (a graph dmfx leaves to PyTorch needs them too).
* ``PIPELINE``: the forward graph (most are the declared fusions of passes/fusion.py: one module per
  fusion, named by it, e.g. passes/bias_act_dropout.py), then the layout search.
* ``BACKWARD_PIPELINE`` (passes/backward/): the backward graph AOTAutograd derives.

Options name passes to skip: ``torch.compile(m, backend="dmfx", options={"skip": ["dropout"]})``.
"""

from __future__ import annotations

from typing import Callable

from torch.fx import GraphModule

from .. import cuda_ops as _cuda_ops  # noqa: F401  (defines the dmfx:: ops the passes emit)
from .activation_idioms import ACTIVATION_IDIOMS
from .attention import ATTENTION, LOWER_SDPA_CALLS, noop_clones, restore_sdpa
from .attention_softmax import ATTENTION_SOFTMAX
from .backward import BACKWARD_PIPELINE
from .bias_act_dropout import BIAS_ACT_DROPOUT
from .bias_dropout_residual_norm import BIAS_DROPOUT_RESIDUAL_NORM
from .cross_entropy import CROSS_ENTROPY
from .dropout import DROPOUT, identity_clones
from .glu import GLU
from .graph_utils import PassContext, finish, remove_metadata_asserts, reshape_fused_views, run_passes
from .layer_norm import LAYER_NORM, NORM_IDIOMS
from .layout import choose_forward_layouts, choose_joint_layouts
from .linear_cross_entropy import LINEAR_CROSS_ENTROPY
from .qkv_attention import stack_qkv
from .rope import ROPE
from .softcap import SOFTCAP
from .unpad import unpad

Pass = Callable[[GraphModule, PassContext], None]

# name -> pass, run by the backend on the lowered graph in training (backend.lower_to_aten)
LOWERING: dict[str, Pass] = {
    "restore_sdpa": restore_sdpa,
}

# name -> pass, in pipeline order. Idioms become single ops first (normalizations give bdrln its
# anchor, activation idioms give the activation fusions theirs); each chain fusion then takes the
# dropout that belongs to it; whatever dropout is left runs on its own; the soft cap of a loss's logits
# becomes one op whose backward reads its output; the loss (log_softmax +
# nll_loss, independent of the others) becomes one op, and then one with the LM head GEMM that feeds
# it where nothing else reads the logits (so they never exist); the layout search runs on
# the fused graph last (in training: on the joint forward+backward graph, see run_joint_layout).
PIPELINE: dict[str, Pass] = {
    "remove_metadata_asserts": remove_metadata_asserts,
    "identity_clones": identity_clones,
    "norm_idioms": NORM_IDIOMS,
    "layer_norm": LAYER_NORM,
    "bias_dropout_residual_norm": BIAS_DROPOUT_RESIDUAL_NORM,
    "activation_idioms": ACTIVATION_IDIOMS,
    "attention_softmax": ATTENTION_SOFTMAX,
    "attention": ATTENTION,
    "lower_sdpa_calls": LOWER_SDPA_CALLS,
    "noop_clones": noop_clones,
    "qkv_attention": stack_qkv,
    "rope": ROPE,
    "glu": GLU,
    "bias_act_dropout": BIAS_ACT_DROPOUT,
    "dropout": DROPOUT,
    "softcap": SOFTCAP,
    "cross_entropy": CROSS_ENTROPY,
    "linear_cross_entropy": LINEAR_CROSS_ENTROPY,
    "unpad": unpad,
    "layout": choose_forward_layouts,
}

# Every pass name `options={"skip": [...]}` accepts: the lowering passes, the forward pipeline, then
# the passes over the backward graph AOTAutograd derives (passes/backward/).
ALL_PASSES: tuple[str, ...] = (*LOWERING, *PIPELINE, *BACKWARD_PIPELINE)


def run_lowering(gm: GraphModule, ctx: PassContext, skip: tuple[str, ...] = (),
                 verify: bool | str | None = None) -> GraphModule:
    """Run the LOWERING passes not in `skip` on `gm` itself (run_passes; `verify`: the graph verifier
    after each)."""
    run_passes(gm, ctx, LOWERING, skip, verify=verify)
    return finish(gm)


def run_pipeline(gm: GraphModule, ctx: PassContext, skip: tuple[str, ...] = (), verify: bool | str | None = None) -> GraphModule:
    """Run every pass not in `skip`, removing dead code after each (a later pass must not see what an
    earlier one replaced), then `reshape_fused_views`. Exceptions propagate with the failing pass's
    name in ctx.current. `verify`: the graph verifier after each pass (run_passes)."""
    run_passes(gm, ctx, {**PIPELINE, "reshape_fused_views": reshape_fused_views}, skip, verify=verify)
    return finish(gm)


def run_joint_layout(joint: GraphModule, ctx: PassContext, skip: tuple[str, ...] = (),
                     verify: bool | str | None = None) -> GraphModule:
    """The ``layout`` pass on AOTAutograd's joint graph (the backend's partition function runs it in
    training, before the partitioner splits forward from backward). No dead-code elimination: the
    search erases what it replaces, and the partitioner owns the joint graph's liveness. `verify`:
    the graph verifier after it (run_passes)."""
    run_passes(joint, ctx, {"layout": choose_joint_layouts}, skip, dce=False, verify=verify)
    joint.graph.lint()
    joint.recompile()
    return joint


__all__ = ["ALL_PASSES", "BACKWARD_PIPELINE", "LOWERING", "PIPELINE", "PassContext", "Pass", "finish", "run_joint_layout",
           "run_lowering", "run_pipeline"]

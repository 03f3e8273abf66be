"""dmfx's graph passes, in the order they run (the backward graph's own, which run after AOTAutograd,
are in backward.py). Each pass is ``fn(gm, ctx) -> None``: it rewrites the
ATen forward graph in place and records what fired (and near-misses) in the PassContext.

Options name passes to skip: ``torch.compile(m, backend="dmfx", options={"skip": ["dropout"]})``.
"""

from __future__ import annotations

from typing import Callable

from torch.fx import GraphModule

from .. import cuda_ops as _cuda_ops  # noqa: F401  (defines the dmfx:: ops the passes emit)
from .activations import fuse_activation_idioms, fuse_bias_activation_dropout, fuse_gated_activation
from .bdrln import fuse_bias_dropout_residual_norm, fuse_dropout
from .graph_utils import PassContext, finish, remove_metadata_asserts, reshape_fused_views, run_passes
from .norms import fuse_native_layer_norm, fuse_norm_idioms
from .rope import fuse_rope
from .attention import fuse_attention, stack_qkv
from .layout import choose_forward_layouts, choose_joint_layouts
from .softmax import fuse_attention_softmax
from .backward import BACKWARD_PIPELINE

Pass = Callable[[GraphModule, PassContext], None]

# name -> pass, in pipeline order. Idioms become single ops first (normalizations give bdrln its
# anchor, activation idioms give the activation passes theirs); each chain pass then takes the
# dropout that belongs to it; whatever dropout is left runs on its own; the layout search runs on
# the fused graph last (in training: on the joint forward+backward graph, see run_joint_layout).
PIPELINE: dict[str, Pass] = {
    "remove_metadata_asserts": remove_metadata_asserts,
    "norm_idioms": fuse_norm_idioms,
    "layer_norm": fuse_native_layer_norm,
    "bias_dropout_residual_norm": fuse_bias_dropout_residual_norm,
    "activation_idioms": fuse_activation_idioms,
    "attention_softmax": fuse_attention_softmax,
    "attention": fuse_attention,
    "qkv_attention": stack_qkv,
    "rope": fuse_rope,
    "glu": fuse_gated_activation,
    "bias_act_dropout": fuse_bias_activation_dropout,
    "dropout": fuse_dropout,
    "layout": choose_forward_layouts,
}

# Every pass name `options={"skip": [...]}` accepts: the forward pipeline above, then the passes over
# the backward graph AOTAutograd derives (passes/backward.py).
ALL_PASSES: tuple[str, ...] = (*PIPELINE, *BACKWARD_PIPELINE)


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


__all__ = ["ALL_PASSES", "BACKWARD_PIPELINE", "PIPELINE", "PassContext", "Pass", "finish", "run_joint_layout", "run_pipeline"]

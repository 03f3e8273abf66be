"""dmfx's graph passes, in the order they run. Each pass is ``fn(gm, ctx) -> None``: it rewrites the
ATen forward graph in place and records what fired (and near-misses) in the PassContext.

Options name passes to skip: ``torch.compile(m, backend="dmfx", options={"skip": ["dropout"]})``.
"""

from __future__ import annotations

from typing import Callable

from torch.fx import GraphModule

from ..cuda_ops import ops as _ops  # noqa: F401  (defines the dmfx:: ops the passes emit)
from .activations import fuse_activation_idioms, fuse_bias_activation_dropout, fuse_gated_activation
from .bdrln import fuse_bias_dropout_residual_norm, fuse_dropout
from .graph_utils import PassContext, dead_code_elimination, finish, remove_metadata_asserts
from .norms import fuse_native_layer_norm, fuse_norm_idioms
from .rope import fuse_rope
from .softmax import fuse_attention_softmax

Pass = Callable[[GraphModule, PassContext], None]

# name -> pass, in pipeline order. Idioms become single ops first (normalizations give bdrln its
# anchor, activation idioms give the activation passes theirs); each chain pass then takes the
# dropout that belongs to it; whatever dropout is left runs on its own last.
PIPELINE: dict[str, Pass] = {
    "remove_metadata_asserts": remove_metadata_asserts,
    "norm_idioms": fuse_norm_idioms,
    "layer_norm": fuse_native_layer_norm,
    "bias_dropout_residual_norm": fuse_bias_dropout_residual_norm,
    "activation_idioms": fuse_activation_idioms,
    "attention_softmax": fuse_attention_softmax,
    "rope": fuse_rope,
    "gated_activation": fuse_gated_activation,
    "bias_activation_dropout": fuse_bias_activation_dropout,
    "dropout": fuse_dropout,
}


def views_after_fused_ops_to_reshapes(gm: GraphModule) -> int:
    """``aten.view`` nodes downstream of a dmfx op become ``aten.reshape``.

    A fused op may lay out its output differently from the ops it replaced (e.g. contiguous where an
    element-wise op would have kept a permuted input's strides), and ops further down (SDPA kernels,
    element-wise ops) pass such a layout on. A view the traced graph recorded under the old strides
    could then fail. reshape is the same view whenever the strides allow one, and copies otherwise.
    """
    import torch

    start = [n for n in gm.graph.nodes if n.op == "call_function" and getattr(n.target, "namespace", None) == "dmfx"]
    seen, stack, changed = set(start), list(start), 0
    while stack:
        for u in stack.pop().users:
            if u in seen:
                continue
            seen.add(u)
            stack.append(u)
            if u.op == "call_function" and u.target is torch.ops.aten.view.default:
                u.target = torch.ops.aten.reshape.default
                changed += 1
    return changed


def run_pipeline(gm: GraphModule, ctx: PassContext, skip: tuple[str, ...] = ()) -> GraphModule:
    """Run every pass not in `skip`, removing dead code after each (a later pass must not see what an
    earlier one replaced). Exceptions propagate with the failing pass's name in ctx.current."""
    for name, fn in PIPELINE.items():
        if name in skip:
            continue
        ctx.current = name
        fn(gm, ctx)
        dead_code_elimination(gm)
    ctx.current = None
    views_after_fused_ops_to_reshapes(gm)
    return finish(gm)


__all__ = ["PIPELINE", "PassContext", "Pass", "finish", "run_pipeline"]

"""dmfx's graph passes, in the order they run. Each pass is ``fn(gm, ctx) -> None``: it rewrites the
ATen forward graph in place and records what fired (and near-misses) in the PassContext.

Options name passes to skip: ``torch.compile(m, backend="dmfx", options={"skip": ["dropout"]})``.
"""

from __future__ import annotations

from typing import Callable

from torch.fx import GraphModule

from ..cuda_ops import ops as _ops  # noqa: F401  (defines the dmfx:: ops the passes emit)
from .bdrln import fuse_bias_dropout_residual_norm, fuse_dropout
from .graph_utils import PassContext, dead_code_elimination, finish, remove_metadata_asserts
from .norms import fuse_native_layer_norm, fuse_norm_idioms

Pass = Callable[[GraphModule, PassContext], None]

# name -> pass, in pipeline order. Normalizations first (they give bdrln its anchor), then the chain
# that ends in them, then whatever dropout is left on its own.
PIPELINE: dict[str, Pass] = {
    "remove_metadata_asserts": remove_metadata_asserts,
    "norm_idioms": fuse_norm_idioms,
    "layer_norm": fuse_native_layer_norm,
    "bias_dropout_residual_norm": fuse_bias_dropout_residual_norm,
    "dropout": fuse_dropout,
}



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
    return finish(gm)


__all__ = ["PIPELINE", "PassContext", "Pass", "finish", "run_pipeline"]

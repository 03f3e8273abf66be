"""dmfx: a torch.compile backend that moves less data (Ivanov et al., "Data Movement Is All You Need",
MLSys 2021). ``torch.compile(model, backend="dmfx")`` works without importing this package once it
is installed; import it for the records of what was fused and for the fused ops as Python functions.
"""

from __future__ import annotations

import logging

from .backend import GraphRecord, dmfx_backend, records, reset, with_options
from .cuda_ops.attention import attention, varlen_attention
from .cuda_ops.build import KernelBuildError
from .cuda_ops.cross_entropy import cross_entropy, linear_cross_entropy
from .cuda_ops.norm import bias_dropout_residual_layer_norm, dropout, layer_norm, rms_norm
from .cuda_ops.pointwise import bias_act_dropout, glu, rope, softcap
from .cuda_ops.softmax import attention_softmax
from .explain import explain  # (the function; its package's parts: from dmfx.explain import ...)
from .options import Options

__version__ = "0.1.0"

logging.getLogger("dmfx").addHandler(logging.NullHandler())


def _register_without_entry_point() -> None:
    """From a source checkout (no installed entry point) register the backend by hand. With the
    entry point installed torch registers it itself, and registering twice is an error there."""
    from importlib.metadata import entry_points

    if any(ep.name == "dmfx" for ep in entry_points(group="torch_dynamo_backends")):
        return
    from torch._dynamo.backends import registry

    if "dmfx" not in registry._COMPILER_FNS:
        registry.register_backend(compiler_fn=dmfx_backend, name="dmfx")


_register_without_entry_point()

__all__ = [
    "GraphRecord",
    "attention",
    "bias_act_dropout",
    "KernelBuildError",
    "Options",
    "bias_dropout_residual_layer_norm",
    "cross_entropy",
    "dmfx_backend",
    "with_options",
    "dropout",
    "explain",
    "glu",
    "layer_norm",
    "linear_cross_entropy",
    "records",
    "reset",
    "rms_norm",
    "rope",
    "softcap",
    "attention_softmax",
    "varlen_attention",
]

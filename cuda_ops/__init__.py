"""dmfx's fused operators (torch.library, namespace ``dmfx::``) and the build of their CPU/CUDA kernels.

Importing the package defines every op. What the passes and the rest of dmfx use from here is
re-exported below, so they never reach into a family module's internals.
"""

from . import ops as _ops  # noqa: F401  (norm family, dropout, seeds; registers softmax, pointwise, attention)
from .attention import OPS as ATTENTION_OPS, flash_supported
from .ops import new_seed, stat_dtype

__all__ = ["ATTENTION_OPS", "flash_supported", "new_seed", "stat_dtype"]

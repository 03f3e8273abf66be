"""dmfx's fused operators (torch.library, namespace ``dmfx::``) and the build of their CPU/CUDA kernels.

Importing the package defines every op, family by family (each family module imports only
_library.py, build.py and reference.py): norm (LayerNorm, RMSNorm, bias + dropout + residual + norm,
dropout), softmax (the attention softmax), pointwise (bias + activation + dropout, gated activations,
rotary embedding), attention (the GEMM form, the fused flash form and the varlen form over packed
sequences), cross_entropy (log_softmax + nll_loss), unpad (where the real tokens of a padded batch
are). What the passes and the rest of dmfx use from here is re-exported below, so they never reach
into a family module's internals.
"""

from . import attention, cross_entropy, norm, pointwise, softmax, unpad  # noqa: F401  (each defines its family's ops; any order)
from ._library import COMPOSITES, new_seed, stat_dtype
from .attention import OPS as ATTENTION_OPS, flash_supported, varlen_attention, varlen_supported
from .cross_entropy import REDUCTIONS as CROSS_ENTROPY_REDUCTIONS

__all__ = [
    "ATTENTION_OPS", "COMPOSITES", "CROSS_ENTROPY_REDUCTIONS", "flash_supported", "new_seed", "stat_dtype", "varlen_attention",
    "varlen_supported",
]

"""dmfx's norm family: fused bias + dropout + residual + LayerNorm / RMSNorm, and dropout.

The ops' schemas and fake implementations (for tracing) are here; their CPU and CUDA kernels and
their autograd formulas (each backward is itself a fused op) are registered in C++:
csrc/norm_ops.h (the ops on top of the kernels, any device), csrc/norm_cpu.cpp (the CPU kernels, the
registration of them and of the autograd formulas), csrc/norm_cuda.cu + norm_cuda_bind.cpp (CUDA).
Sizes and strides are runtime arguments: nothing is rebuilt per shape. Pure-PyTorch references are in
reference.py.

Ops
---
``dmfx::layer_norm(x, weight?, bias?, eps) -> (out, mean, rstd)``
``dmfx::rms_norm(x, weight?, eps) -> (out, rstd)``
``dmfx::bias_dropout_residual_norm(x, bias?, residual?, weight?, norm_bias?, seed?, p, eps, rms, return_sum)
    -> (out, sum, mean, rstd)``: the paper's BDRLN, ``out = norm(dropout(x + bias) + residual)``;
    ``sum`` is the pre-norm value when ``return_sum`` (else empty), ``mean`` is empty for RMSNorm.
``dmfx::norm_backward(...) -> (dx, dresidual, dweight, dnorm_bias, dbias)``: the backward of all
    three (the paper's BLNRD + BSB work in one pass over the rows). ``grad_out2``, when given, is a
    second gradient of the output, added to ``grad_out`` inside the kernel: the backward pass
    (passes/backward.py) folds the add of a layer output's two gradients into it (the paper's EBSB).
    ``dbias`` (asked for in ``output_mask[4]``) is the column sum of ``dx``, with or without a
    ``bias`` input: the gradient of a bias that stayed in the GEMM before the norm.
``dmfx::dropout(x, seed, p) -> out``: inverted Philox dropout; its backward is the same op on the
    gradient (the mask is regenerated from the seed, never stored).

Dropout seeds are int64 CPU tensors ``[seed, offset]`` drawn from torch's default generator by
``new_seed()`` (_library.py), so ``torch.manual_seed`` reproduces a run. Autograd: mean and rstd
are not differentiable; double backward through ``norm_backward`` raises NotImplementedError.

Determinism (CPU; tests/test_determinism.py checks exactly this): every op here is bit-reproducible
run to run with the thread count fixed. The forwards, ``dropout`` and the backward's per-row outputs
(dx, dresidual) do not depend on the thread count either (each row is computed whole by one thread,
its reductions in a fixed lane order; the dropout mask is Philox of the element index). The
backward's column sums (dweight, dnorm_bias, dbias) are summed per thread over that thread's fixed
share of the rows, then across threads in thread order: reproducible for a given count, not across
counts (they then agree to rounding).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._library import LIB, check_tensor, kernels_in_cxx, new_seed, stat_dtype

LIB.define("layer_norm(Tensor x, Tensor? weight, Tensor? bias, float eps) -> (Tensor, Tensor, Tensor)")
LIB.define("rms_norm(Tensor x, Tensor? weight, float eps) -> (Tensor, Tensor)")
LIB.define(
    "bias_dropout_residual_norm(Tensor x, Tensor? bias, Tensor? residual, Tensor? weight, "
    "Tensor? norm_bias, Tensor? seed, float p, float eps, bool rms, bool return_sum) "
    "-> (Tensor, Tensor, Tensor, Tensor)"
)
LIB.define(
    "norm_backward(Tensor grad_out, Tensor? grad_sum, Tensor x, Tensor? bias, Tensor? residual, "
    "Tensor? weight, Tensor? mean, Tensor rstd, Tensor? seed, float p, bool rms, bool[] output_mask, "
    "Tensor? grad_out2=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor)"
)
LIB.define("dropout(Tensor x, Tensor seed, float p) -> Tensor")

OPS = ("layer_norm", "rms_norm", "bias_dropout_residual_norm", "norm_backward", "dropout")
kernels_in_cxx(OPS)


# ----------------------------------------------------------------------------------------- fakes


def _stats(x: Tensor) -> Tensor:
    return x.new_empty(x.shape[:-1], dtype=stat_dtype(x))


def _nothing(x: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    return x.new_empty((0,), dtype=dtype or x.dtype)


@torch.library.register_fake("dmfx::layer_norm")
def _layer_norm_fake(x, weight, bias, eps):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device), _stats(x), _stats(x)


@torch.library.register_fake("dmfx::rms_norm")
def _rms_norm_fake(x, weight, eps):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device), _stats(x)


@torch.library.register_fake("dmfx::bias_dropout_residual_norm")
def _bdrn_fake(x, bias, residual, weight, norm_bias, seed, p, eps, rms, return_sum):
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    s = torch.empty(x.shape, dtype=x.dtype, device=x.device) if return_sum else _nothing(x)
    mean = _nothing(x, stat_dtype(x)) if rms else _stats(x)
    return out, s, mean, _stats(x)


@torch.library.register_fake("dmfx::norm_backward")
def _norm_backward_fake(grad_out, grad_sum, x, bias, residual, weight, mean, rstd, seed, p, rms, output_mask,
                        grad_out2=None):
    H = x.shape[-1]
    full = lambda on: torch.empty(x.shape, dtype=x.dtype, device=x.device) if on else _nothing(x)  # noqa: E731
    vec = lambda on: x.new_empty((H,)) if on else _nothing(x)  # noqa: E731
    m = list(output_mask)
    return full(m[0]), full(m[1]), vec(m[2] and weight is not None), vec(m[3]), vec(m[4])


@torch.library.register_fake("dmfx::dropout")
def _dropout_fake(x, seed, p):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


# ----------------------------------------------------------------------------------------- Python API


def layer_norm(x: Tensor, weight: Tensor | None = None, bias: Tensor | None = None, eps: float = 1e-5) -> Tensor:
    """LayerNorm over the last dimension (``torch.nn.functional.layer_norm`` with one normalized dim)."""
    check_tensor("layer_norm", "x", x)
    return torch.ops.dmfx.layer_norm(x, weight, bias, eps)[0]


def rms_norm(x: Tensor, weight: Tensor | None = None, eps: float = 1e-6) -> Tensor:
    """RMSNorm over the last dimension: ``x / sqrt(mean(x^2) + eps) * weight``."""
    check_tensor("rms_norm", "x", x)
    return torch.ops.dmfx.rms_norm(x, weight, eps)[0]


def bias_dropout_residual_layer_norm(
    x: Tensor,
    bias: Tensor | None,
    residual: Tensor | None,
    weight: Tensor | None,
    norm_bias: Tensor | None,
    p: float = 0.0,
    eps: float = 1e-5,
    training: bool = True,
    rms: bool = False,
) -> Tensor:
    """The paper's BDRLN: ``layer_norm(dropout(x + bias, p) + residual)`` in one kernel."""
    check_tensor("bias_dropout_residual_norm", "x", x)
    p = p if training else 0.0
    seed = new_seed() if p > 0 else None
    return torch.ops.dmfx.bias_dropout_residual_norm(x, bias, residual, weight, norm_bias, seed, p, eps, rms, False)[0]


def dropout(x: Tensor, p: float = 0.5, training: bool = True) -> Tensor:
    """Inverted dropout with a Philox mask that is regenerated in backward, never stored."""
    check_tensor("dropout", "x", x)
    if not training or p == 0.0:
        return x
    return torch.ops.dmfx.dropout(x, new_seed(), p)

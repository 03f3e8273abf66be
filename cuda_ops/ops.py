"""dmfx's fused operators, defined once with torch.library under the ``dmfx::`` namespace.

Each op has a schema, CPU and CUDA kernels (from the extensions in build.py; sizes and strides are
runtime arguments, nothing is rebuilt per shape), a fake implementation for tracing, and an autograd
formula whose backward is itself a fused op. Pure-PyTorch references live in reference.py.

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
``new_seed()``, so ``torch.manual_seed`` reproduces a run.

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

from .build import kernels_for

_lib = torch.library.Library("dmfx", "DEF")  # noqa: TOR901 (kept alive for the process)

_lib.define("layer_norm(Tensor x, Tensor? weight, Tensor? bias, float eps) -> (Tensor, Tensor, Tensor)")
_lib.define("rms_norm(Tensor x, Tensor? weight, float eps) -> (Tensor, Tensor)")
_lib.define(
    "bias_dropout_residual_norm(Tensor x, Tensor? bias, Tensor? residual, Tensor? weight, "
    "Tensor? norm_bias, Tensor? seed, float p, float eps, bool rms, bool return_sum) "
    "-> (Tensor, Tensor, Tensor, Tensor)"
)
_lib.define(
    "norm_backward(Tensor grad_out, Tensor? grad_sum, Tensor x, Tensor? bias, Tensor? residual, "
    "Tensor? weight, Tensor? mean, Tensor rstd, Tensor? seed, float p, bool rms, bool[] output_mask, "
    "Tensor? grad_out2=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor)"
)
_lib.define("dropout(Tensor x, Tensor seed, float p) -> Tensor")

OPS = ("layer_norm", "rms_norm", "bias_dropout_residual_norm", "norm_backward", "dropout")


# ----------------------------------------------------------------------------------------- seeds


def new_seed() -> Tensor:
    """A fresh dropout seed ``[seed, offset]`` (int64, CPU) from torch's default generator."""
    return torch.randint(0, 2**62, (2,), dtype=torch.int64)


def _seed_values(seed: Tensor | None, op: str) -> tuple[int, int]:
    if seed is None:
        return 0, 0
    if seed.device.type != "cpu" or seed.dtype != torch.int64 or seed.numel() != 2:
        raise ValueError(
            f"dmfx::{op}: seed must be an int64 CPU tensor of 2 elements [seed, offset] "
            f"(see dmfx.cuda_ops.ops.new_seed), got {seed.dtype} {tuple(seed.shape)} on {seed.device}"
        )
    s, o = seed.tolist()
    return int(s), int(o)


def _check_stored_mask(op: str, mask: Tensor | None, ref_name: str, ref: Tensor, p: float) -> None:
    """A backward kernel's stored dropout mask (``native_dropout``'s, when the forward was PyTorch's):
    bool, `ref`'s shape, and no Philox mask with it (p == 0). Checked in Python so that the fake (meta)
    implementations raise the same errors as the kernels."""
    if mask is None:
        return
    if mask.dtype != torch.bool:
        raise ValueError(f"dmfx::{op}: mask must be a bool tensor (the mask native_dropout returns), got {mask.dtype}")
    if tuple(mask.shape) != tuple(ref.shape):
        raise ValueError(f"dmfx::{op}: mask must have the shape of {ref_name} {list(ref.shape)}, got {list(mask.shape)}")
    if p != 0.0:
        raise ValueError(f"dmfx::{op}: a stored mask and p = {p} > 0 would be two dropout masks; pass p = 0 with a mask")


def _check_tensor(op: str, name: str, t: object) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"dmfx::{op}: {name} must be a Tensor, got {type(t).__name__}")


# ----------------------------------------------------------------------------------------- kernels


def _bdrn_kernel(x, bias, residual, weight, norm_bias, seed, p, eps, rms, return_sum):
    s, o = _seed_values(seed, "bias_dropout_residual_norm")
    return tuple(kernels_for(x.device).norm_fwd(x, bias, residual, weight, norm_bias, s, o, p, eps, rms, return_sum))


def _layer_norm_kernel(x, weight, bias, eps):
    out, _, mean, rstd = kernels_for(x.device).norm_fwd(x, None, None, weight, bias, 0, 0, 0.0, eps, False, False)
    return out, mean, rstd


def _rms_norm_kernel(x, weight, eps):
    out, _, _, rstd = kernels_for(x.device).norm_fwd(x, None, None, weight, None, 0, 0, 0.0, eps, True, False)
    return out, rstd


def _norm_backward_kernel(grad_out, grad_sum, x, bias, residual, weight, mean, rstd, seed, p, rms, output_mask,
                          grad_out2=None):
    s, o = _seed_values(seed, "norm_backward")
    return tuple(
        kernels_for(x.device).norm_bwd(
            grad_out, grad_sum, x, bias, residual, weight, mean, rstd, s, o, p, rms, list(output_mask), grad_out2
        )
    )


def _dropout_kernel(x, seed, p):
    s, o = _seed_values(seed, "dropout")
    return kernels_for(x.device).dropout(x, s, o, p)


for _dev in ("CPU", "CUDA"):
    _lib.impl("layer_norm", _layer_norm_kernel, _dev)
    _lib.impl("rms_norm", _rms_norm_kernel, _dev)
    _lib.impl("bias_dropout_residual_norm", _bdrn_kernel, _dev)
    _lib.impl("norm_backward", _norm_backward_kernel, _dev)
    _lib.impl("dropout", _dropout_kernel, _dev)


# ----------------------------------------------------------------------------------------- fakes


def stat_dtype(x: Tensor) -> torch.dtype:
    """The dtype of the norm kernels' mean / rstd statistics for input `x`."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


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


# ----------------------------------------------------------------------------------------- autograd


def _norm_grads(ctx, grad_out, grad_sum, needs):
    """Run dmfx::norm_backward for the saved forward; `needs` = [x, residual, weight, norm_bias, bias]."""
    x, bias, residual, weight, mean, rstd, seed = ctx.saved_tensors
    dropout = ctx.p > 0.0
    # Without dropout dresidual == dx, so compute it once and hand it out twice.
    want_dres = needs[1] and dropout
    want_dx = needs[0] or needs[4] or (needs[1] and not dropout)
    mask = [want_dx, want_dres, needs[2], needs[3], needs[4]]
    if grad_out is None:
        grad_out = torch.zeros_like(x)
    dx, dres, dw, dnb, db = torch.ops.dmfx.norm_backward(
        grad_out, grad_sum, x, bias, residual, weight, mean if not ctx.rms else None, rstd, seed, ctx.p, ctx.rms, mask
    )
    dres_out = (dres if dropout else dx) if needs[1] else None
    return (
        dx if needs[0] else None,
        dres_out,
        dw if needs[2] else None,
        dnb if needs[3] else None,
        db if needs[4] else None,
    )


def _setup_layer_norm(ctx, inputs, output):
    x, weight, bias, eps = inputs
    _, mean, rstd = output
    ctx.p, ctx.rms = 0.0, False
    ctx.save_for_backward(x, None, None, weight, mean, rstd, None)
    ctx.has = (weight is not None, bias is not None)


def _backward_layer_norm(ctx, grad_out, _gmean, _grstd):
    nx, nw, nb = ctx.needs_input_grad[:3]
    dx, _, dw, dnb, _ = _norm_grads(ctx, grad_out, None, [nx, False, nw and ctx.has[0], nb and ctx.has[1], False])
    return dx, dw, dnb, None


torch.library.register_autograd("dmfx::layer_norm", _backward_layer_norm, setup_context=_setup_layer_norm)


def _setup_rms_norm(ctx, inputs, output):
    x, weight, eps = inputs
    _, rstd = output
    ctx.p, ctx.rms = 0.0, True
    ctx.save_for_backward(x, None, None, weight, None, rstd, None)
    ctx.has = (weight is not None,)


def _backward_rms_norm(ctx, grad_out, _grstd):
    nx, nw = ctx.needs_input_grad[:2]
    dx, _, dw, _, _ = _norm_grads(ctx, grad_out, None, [nx, False, nw and ctx.has[0], False, False])
    return dx, dw, None


torch.library.register_autograd("dmfx::rms_norm", _backward_rms_norm, setup_context=_setup_rms_norm)


def _setup_bdrn(ctx, inputs, output):
    x, bias, residual, weight, norm_bias, seed, p, eps, rms, return_sum = inputs
    _, total, mean, rstd = output
    ctx.p, ctx.rms = p, rms
    if p == 0.0 and return_sum:
        # Without dropout the pre-norm sum the op returns is all the backward needs (dx = dresidual =
        # d(sum), dbias its column sum): saving it instead of x and the residual keeps the GEMM output
        # x alive no longer than eager keeps it (pre-norm blocks: ViT, LLaMA).
        ctx.save_for_backward(total, None, None, weight, mean, rstd, None)
    else:
        ctx.save_for_backward(x, bias, residual, weight, mean, rstd, seed)
    ctx.has = (bias is not None, residual is not None, weight is not None, norm_bias is not None)


def _backward_bdrn(ctx, grad_out, grad_sum, _gmean, _grstd):
    nx, nbias, nres, nw, nnb = ctx.needs_input_grad[:5]
    hb, hr, hw, hnb = ctx.has
    if grad_sum is not None and grad_sum.numel() == 0:
        grad_sum = None
    dx, dres, dw, dnb, db = _norm_grads(ctx, grad_out, grad_sum, [nx, nres and hr, nw and hw, nnb and hnb, nbias and hb])
    return dx, db, dres, dw, dnb, None, None, None, None, None


torch.library.register_autograd(
    "dmfx::bias_dropout_residual_norm", _backward_bdrn, setup_context=_setup_bdrn
)


def _setup_dropout(ctx, inputs, output):
    _, seed, p = inputs
    ctx.p = p
    ctx.save_for_backward(seed)


def _backward_dropout(ctx, grad):
    (seed,) = ctx.saved_tensors
    return torch.ops.dmfx.dropout(grad, seed, ctx.p), None, None


torch.library.register_autograd("dmfx::dropout", _backward_dropout, setup_context=_setup_dropout)


# ----------------------------------------------------------------------------------------- Python API


def layer_norm(x: Tensor, weight: Tensor | None = None, bias: Tensor | None = None, eps: float = 1e-5) -> Tensor:
    """LayerNorm over the last dimension (``torch.nn.functional.layer_norm`` with one normalized dim)."""
    _check_tensor("layer_norm", "x", x)
    return torch.ops.dmfx.layer_norm(x, weight, bias, eps)[0]


def rms_norm(x: Tensor, weight: Tensor | None = None, eps: float = 1e-6) -> Tensor:
    """RMSNorm over the last dimension: ``x / sqrt(mean(x^2) + eps) * weight``."""
    _check_tensor("rms_norm", "x", x)
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
    _check_tensor("bias_dropout_residual_norm", "x", x)
    p = p if training else 0.0
    seed = new_seed() if p > 0 else None
    return torch.ops.dmfx.bias_dropout_residual_norm(x, bias, residual, weight, norm_bias, seed, p, eps, rms, False)[0]


def dropout(x: Tensor, p: float = 0.5, training: bool = True) -> Tensor:
    """Inverted dropout with a Philox mask that is regenerated in backward, never stored."""
    _check_tensor("dropout", "x", x)
    if not training or p == 0.0:
        return x
    return torch.ops.dmfx.dropout(x, new_seed(), p)


def _no_double_backward(ctx, *grads):
    raise NotImplementedError(
        "dmfx::norm_backward: double backward (create_graph=True through a dmfx normalization) is not "
        "supported; compile with options={'skip': ['norm_idioms', 'layer_norm', 'bias_dropout_residual_norm']} "
        "or without dmfx for higher-order gradients"
    )


torch.library.register_autograd("dmfx::norm_backward", _no_double_backward, setup_context=lambda ctx, inputs, output: None)


# The other op families register themselves on import (each in its own module and kernel files).
from . import pointwise as _pointwise  # noqa: E402,F401
from . import softmax as _softmax  # noqa: E402,F401
from . import attention as _attention  # noqa: E402,F401

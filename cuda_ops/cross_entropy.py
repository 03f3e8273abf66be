"""dmfx's cross_entropy family: the fused ``log_softmax`` + ``nll_loss`` of a classifier's or a
language model's loss, forward and backward.

The ops' schemas and fake implementations (for tracing) are here; their CPU and CUDA kernels and
their autograd formula are registered in C++: csrc/cross_entropy_ops.h (the ops on top of the
kernels, any device), csrc/cross_entropy_api.h (the math and checks the CPU and CUDA kernels share),
csrc/cross_entropy_cpu.cpp (the CPU kernels, their registration and the autograd formula),
csrc/cross_entropy_cuda.cu + cross_entropy_cuda_bind.cpp (CUDA). The pure-PyTorch reference is
reference.cross_entropy.

Ops
---
``dmfx::cross_entropy(logits, target, ignore_index, label_smoothing, reduction) -> (loss, lse)``:
    ``F.cross_entropy(logits.float(), target, ignore_index=, label_smoothing=, reduction=)`` for
    logits ``[N, V]`` (float32, float16, bfloat16 or float64; unit stride along V) and int64 targets
    ``[N]``; ``reduction`` is nll_loss's code (0 none, 1 mean, 2 sum: ``REDUCTIONS``). Each row is
    read once (its log-sum-exp accumulated online in float32, float64 for float64 logits: the upcast
    HF's loss functions make is absorbed, so ``loss`` and ``lse`` are float32 for float16 / bfloat16 /
    float32 logits). ``lse`` ``[N, 2]`` is each row's log-sum-exp as its max and the log of the sum of
    exp(z - max) (their sum is the log-sum-exp; kept apart so that large logits lose no precision),
    (0, 0) for an ignored row (not read); it is all the backward saves besides the inputs: no
    ``[N, V]`` tensor is written. Mean over no rows
    (every target ignored) is NaN, as in PyTorch. A target that is neither a class nor
    ``ignore_index`` raises IndexError on the CPU; on CUDA (no device synchronization) its row's loss
    is NaN instead.
``dmfx::cross_entropy_backward(grad_loss, logits, target, lse, ignore_index, label_smoothing, reduction,
    grad_logits=None) -> dlogits``: ``g * (softmax(row) - smoothed one-hot(target))`` in one pass, in
    the logits' dtype, zero for ignored rows, plus ``grad_logits`` when given: the gradient that
    reaches the logits themselves when they are also a graph output (HF returns them; AOTAutograd
    hands the backward a tangent for them, zeros when the user does not use them), added in the same
    pass instead of a second one over ``[N, V]`` (passes/backward/fold_logits_grad.py folds the add).

Autograd: ``lse`` is not differentiable; double backward through ``cross_entropy_backward`` raises
NotImplementedError.

Determinism (CPU; tests/test_determinism.py's rule): bit-reproducible run to run, and independent of
the thread count: each row is computed whole by one thread, and a reduced loss sums the rows' losses
in row order (in float64). On CUDA the reduced loss is ATen's sum of the rows' losses.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._library import LIB, check_tensor, kernels_in_cxx, stat_dtype

LIB.define(
    "cross_entropy(Tensor logits, Tensor target, int ignore_index, float label_smoothing, int reduction) "
    "-> (Tensor, Tensor)"
)
LIB.define(
    "cross_entropy_backward(Tensor grad_loss, Tensor logits, Tensor target, Tensor lse, int ignore_index, "
    "float label_smoothing, int reduction, Tensor? grad_logits=None) -> Tensor"
)

OPS = ("cross_entropy", "cross_entropy_backward")
kernels_in_cxx(OPS)

#: ``reduction`` names -> the ops' codes (nll_loss's: at::Reduction).
REDUCTIONS = {"none": 0, "mean": 1, "sum": 2}


# ----------------------------------------------------------------------------------------- fakes


@torch.library.register_fake("dmfx::cross_entropy")
def _cross_entropy_fake(logits, target, ignore_index, label_smoothing, reduction):
    N = logits.shape[0]
    dtype = stat_dtype(logits)
    loss = logits.new_empty((N,) if reduction == REDUCTIONS["none"] else (), dtype=dtype)
    return loss, logits.new_empty((N, 2), dtype=dtype)


@torch.library.register_fake("dmfx::cross_entropy_backward")
def _cross_entropy_backward_fake(grad_loss, logits, target, lse, ignore_index, label_smoothing, reduction,
                                 grad_logits=None):
    return torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)


# ----------------------------------------------------------------------------------------- Python API


def cross_entropy(logits: Tensor, target: Tensor, ignore_index: int = -100, label_smoothing: float = 0.0,
                  reduction: str = "mean") -> Tensor:
    """``F.cross_entropy(logits.float(), target, ...)`` for logits ``[N, V]`` in one fused kernel pair
    (the loss in float32; float64 for float64 logits)."""
    check_tensor("cross_entropy", "logits", logits)
    check_tensor("cross_entropy", "target", target)
    if reduction not in REDUCTIONS:
        raise ValueError(f"dmfx::cross_entropy: reduction must be one of {sorted(REDUCTIONS)}, got {reduction!r}")
    return torch.ops.dmfx.cross_entropy(logits, target, ignore_index, label_smoothing, REDUCTIONS[reduction])[0]

"""dmfx's cross_entropy family: the fused ``log_softmax`` + ``nll_loss`` of a classifier's or a
language model's loss, forward and backward.

The ops' schemas and fake implementations (for tracing) are here; the kernels and autograd formula
of ``cross_entropy`` and ``cross_entropy_backward`` are registered in C++: csrc/cross_entropy_ops.h
(the ops on top of the kernels, any device), csrc/cross_entropy_api.h (the math and checks the CPU
and CUDA kernels share), csrc/cross_entropy_cpu.cpp (the CPU kernels, their registration and the
autograd formula), csrc/cross_entropy_cuda.cu + cross_entropy_cuda_bind.cpp (CUDA). ``linear_cross_entropy`` and its
backward are Python composites of ATen's GEMMs and those two ops (below). The pure-PyTorch references
are reference.cross_entropy and reference.linear_cross_entropy.

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
    grad_logits=None, softcap=0.0) -> dlogits``: ``g * (softmax(row) - smoothed one-hot(target))`` in one
    pass, in the logits' dtype, zero for ignored rows, plus ``grad_logits`` when given: the gradient that
    reaches the logits themselves when they are also a graph output (HF returns them; AOTAutograd
    hands the backward a tangent for them, zeros when the user does not use them), added in the same
    pass instead of a second one over ``[N, V]`` (passes/backward/fold_logits_grad.py folds the add).
    ``softcap`` > 0: the logits are soft-capped, ``c = softcap * tanh(z / softcap)`` (Gemma 2), and the
    op returns the raw logits' gradient instead, all of the above times ``1 - (c / softcap)^2`` (ignored
    rows too: their ``grad_logits`` times it), the factor computed from the logit as read in the
    accumulation type and the product rounded once to the logits' dtype, in the same pass
    (passes/backward/fold_softcap_grad.py folds softcap_backward). 0: no cap; < 0, inf or nan: ValueError.
``dmfx::linear_cross_entropy(hidden, weight, bias, target, ignore_index, label_smoothing, reduction, chunk,
    grads=[False, False, False]) -> (loss, lse, dhidden, dweight, dbias)``: the loss above of the logits
    ``F.linear(hidden, weight, bias)`` (an LM head or a classifier and its loss) without the ``[N, V]``
    logits: hidden ``[N, H]`` (float32, float16, bfloat16 or float64; unit stride along H), weight ``[V, H]``
    (F.linear's convention; hidden's dtype and device, unit stride along H), an optional bias ``[V]``, int64
    targets ``[N]``. The logits are computed ``chunk`` rows at a time, ``hidden[i:j] @ weight.T (+ bias)`` in
    the inputs' dtype (as F.linear computes them), into one ``[chunk, V]`` buffer reused for every chunk,
    and ``dmfx::cross_entropy`` reads each chunk while it is there; ``loss`` and ``lse`` are
    ``cross_entropy``'s (a reduced loss sums the rows' losses in row order, in float64). ``grads`` (a
    reduced loss only): the gradients of hidden, weight, bias (those flagged) at a unit loss gradient,
    computed in the same pass over the chunks: each chunk's dlogits by ``cross_entropy_backward``, then
    ``dhidden[i:j] = dlogits @ weight``, ``dweight += dlogitsᵀ @ hidden[i:j]``, ``dbias += dlogits.sum(0)``
    (dhidden in hidden's dtype; dweight and dbias accumulated in float32, float64 for float64: on the CPU
    each chunk's fp16 / bf16 share is rounded once, then summed in float32); the others are empty ``[0]``
    tensors (a schema cannot return None). Peak memory besides the outputs: one chunk's logits and
    dlogits, ``2 * chunk * V`` elements, never ``[N, V]``. ``default_chunk(N, V)`` is the chunk the pass
    and the Python API choose (about 16M logits per chunk, at least 256 rows: 512 rows for V = 32000).
    ``chunk`` <= 0 raises ValueError; a target that is neither a class nor ``ignore_index`` raises
    IndexError on the CPU (naming its row in the batch), and gives NaN on CUDA as ``cross_entropy`` does.
``dmfx::linear_cross_entropy_backward(grad_loss, hidden, weight, bias, target, lse, ignore_index,
    label_smoothing, reduction, chunk, output_mask, dhidden=None, dweight=None, dbias=None)
    -> (dhidden, dweight, dbias)``: the gradients ``output_mask`` asks for (the others: empty ``[0]``), in
    the inputs' dtypes. One the forward computed (``dhidden=`` ...: a reduced loss) is scaled by
    ``grad_loss`` (and rounded once to its input's dtype); the others are recomputed chunk by chunk: the
    logits GEMM again, ``cross_entropy_backward`` from the forward's ``lse`` with ``grad_loss`` (a value
    per row for reduction none), and the same GEMMs as above.

Autograd: ``lse`` is not differentiable; double backward through ``cross_entropy_backward`` raises
NotImplementedError. ``linear_cross_entropy``'s formula is Python (``register_autograd``: the op is a
composite of GEMMs and this family's kernels, no kernel of its own): its backward calls
``linear_cross_entropy_backward`` with the gradients the forward computed, if any; double backward
through it raises NotImplementedError. Which to use was measured (bench/RESULTS.md, 2026-12-02 (later)):
gradients in the forward take 3 GEMMs over the logits in all where recomputing takes 4, 1.25-1.35x
faster on the CPU, at the cost of one more ``[V, H]`` tensor at the start of the backward for float32
weights (the scaled copy next to the forward's; for fp16 / bf16 weights both ways hold a float32
accumulator and the result). So the pass and the Python API ask for them whenever the loss is reduced
and a gradient is needed; with reduction none each row's gradient is known only in the backward, which
recomputes.

Determinism (CPU; tests/test_determinism.py's rule): bit-reproducible run to run, and independent of
the thread count: each row is computed whole by one thread, and a reduced loss sums the rows' losses
in row order (in float64). On CUDA the reduced loss is ATen's sum of the rows' losses.
``linear_cross_entropy``: bit-reproducible run to run on the CPU at a given thread count and chunk
(its GEMMs are ATen's, whose blocking may depend on both); its gradients accumulate chunk after chunk,
in order.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._library import LIB, check_tensor, composite, kernels_in_cxx, no_double_backward, stat_dtype

LIB.define(
    "cross_entropy(Tensor logits, Tensor target, int ignore_index, float label_smoothing, int reduction) "
    "-> (Tensor, Tensor)"
)
LIB.define(
    "cross_entropy_backward(Tensor grad_loss, Tensor logits, Tensor target, Tensor lse, int ignore_index, "
    "float label_smoothing, int reduction, Tensor? grad_logits=None, float softcap=0.0) -> Tensor"
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
                                 grad_logits=None, softcap=0.0):
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


# ------------------------------------------------------------------------ linear_cross_entropy
# A composite (no kernel of its own): chunks of rows of the logits GEMM, each read by the family's
# kernels above while it is in a [chunk, V] buffer. Registered in Python (CompositeExplicitAutograd:
# one implementation for every device) with a Python autograd formula.

LIB.define(
    "linear_cross_entropy(Tensor hidden, Tensor weight, Tensor? bias, Tensor target, int ignore_index, "
    "float label_smoothing, int reduction, int chunk, bool[3] grads=[False, False, False]) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor)"
)
LIB.define(
    "linear_cross_entropy_backward(Tensor grad_loss, Tensor hidden, Tensor weight, Tensor? bias, Tensor target, "
    "Tensor lse, int ignore_index, float label_smoothing, int reduction, int chunk, bool[3] output_mask, "
    "Tensor? dhidden=None, Tensor? dweight=None, Tensor? dbias=None) -> (Tensor, Tensor, Tensor)"
)

_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_NAMES = ("hidden", "weight", "bias")

#: The default chunk's budget: one chunk's logits hold at most about this many elements (64 MB in
#: float32), unless that is fewer than ``MIN_CHUNK`` rows (``default_chunk``).
CHUNK_ELEMENTS = 1 << 24
#: The fewest rows of a default chunk: dweight's GEMM (``dlogitsᵀ @ hidden``, K = the chunk's rows)
#: reads and writes all of dweight once per chunk, so fewer rows make it memory-bound (bench/RESULTS.md).
MIN_CHUNK = 256


def default_chunk(N: int | None, V: int) -> int:
    """The rows per chunk dmfx::linear_cross_entropy uses by default (the pass and the Python API): the
    largest power of two whose ``[chunk, V]`` logits hold at most ``CHUNK_ELEMENTS`` elements, at least
    ``MIN_CHUNK``, and no more than N rounded up to a power of two (one chunk for a small batch; N None:
    not known when the graph is compiled, no cap). V = 32000: 512 rows; GPT-2's 50257: 256; LLaMA 3's
    128256: 256 (a 32.8M-element chunk)."""
    rows = max(MIN_CHUNK, CHUNK_ELEMENTS // max(V, 1))
    rows = 1 << (rows.bit_length() - 1)
    return rows if N is None else max(1, min(rows, 1 << max(N - 1, 0).bit_length()))


def _check_lce(op: str, hidden, weight, bias, target, label_smoothing, reduction, chunk) -> None:
    """The argument checks both ops run (the fakes too: they need no tensor data)."""
    if hidden.dim() != 2:
        raise ValueError(f"dmfx::{op}: hidden must be 2-D [N, H], got shape {list(hidden.shape)}")
    if hidden.dtype not in _FLOATS:
        raise TypeError(f"dmfx::{op}: hidden must be float32, float16, bfloat16 or float64, got {hidden.dtype}")
    N, H = hidden.shape
    if weight.dim() != 2 or weight.shape[1] != H:
        raise ValueError(f"dmfx::{op}: weight must be [V, H] = [V, {H}] (F.linear's convention), got shape "
                         f"{list(weight.shape)}")
    V = weight.shape[0]
    for name, t, shape in (("weight", weight, None), ("bias", bias, [V])):
        if t is None:
            continue
        if shape is not None and list(t.shape) != shape:
            raise ValueError(f"dmfx::{op}: {name} must be [V] = {shape}, got shape {list(t.shape)}")
        if t.dtype != hidden.dtype:
            raise TypeError(f"dmfx::{op}: {name} must have hidden's dtype {hidden.dtype}, got {t.dtype}")
        if t.device != hidden.device:
            raise ValueError(f"dmfx::{op}: {name} is on {t.device} but hidden is on {hidden.device}")
    for name, t in (("hidden", hidden), ("weight", weight)):
        if t.shape[1] > 1 and t.stride(1) != 1:
            raise ValueError(f"dmfx::{op}: {name} must have a unit stride along H (its last dim), got strides "
                             f"{list(t.stride())}")
    if target.dtype != torch.int64 or list(target.shape) != [N]:
        raise ValueError(f"dmfx::{op}: target must be int64 class indices of shape [N] = [{N}], got {target.dtype} "
                         f"of shape {list(target.shape)}")
    if target.device != hidden.device:
        raise ValueError(f"dmfx::{op}: target is on {target.device} but hidden is on {hidden.device}")
    if not isinstance(chunk, int) or chunk <= 0:
        raise ValueError(f"dmfx::{op}: chunk (rows per chunk) must be a positive integer, got {chunk!r}")
    if reduction not in (0, 1, 2):
        raise ValueError(f"dmfx::{op}: reduction must be 0 (none), 1 (mean) or 2 (sum), got {reduction}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"dmfx::{op}: label_smoothing must be in [0, 1], got {label_smoothing}")


def _check_grads(op: str, what: str, flags, bias, reduction) -> tuple[bool, bool, bool]:
    flags = tuple(bool(f) for f in flags)
    if flags[2] and bias is None:
        raise ValueError(f"dmfx::{op}: {what}[2] asks for the bias's gradient but bias is None")
    if any(flags) and reduction == REDUCTIONS["none"] and what == "grads":
        raise ValueError(f"dmfx::{op}: grads (gradients computed in the forward) need a reduced loss (mean or sum); "
                         "with reduction none the per-row loss gradient is known only in the backward")
    return flags


def _check_targets(op: str, target: Tensor, V: int, ignore_index: int) -> None:
    """On the CPU: a target that is neither a class nor ignore_index raises (with its row in the whole
    batch, not in its chunk). On CUDA the family's kernel makes that row's loss NaN instead (no sync)."""
    if target.device.type != "cpu" or target.numel() == 0:
        return
    bad = ((target < 0) | (target >= V)) & (target != ignore_index)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise IndexError(f"dmfx::{op}: target[{i}] = {int(target[i])} is neither a class of the weight's {V} ([0, "
                         f"{V})) nor ignore_index ({ignore_index})")


def _none(t: Tensor) -> Tensor:
    """The empty tensor that stands for a gradient not computed (a schema cannot return None)."""
    return t.new_empty((0,))


def _grad_buffers(hidden: Tensor, weight: Tensor, bias: Tensor | None, want: tuple[bool, bool, bool]):
    """(dhidden in hidden's dtype, dweight and dbias zeros in the accumulation dtype) for the wanted ones,
    None for the others."""
    acc = stat_dtype(hidden)
    return (torch.empty_like(hidden, memory_format=torch.contiguous_format) if want[0] else None,
            weight.new_zeros(weight.shape, dtype=acc) if want[1] else None,
            bias.new_zeros(bias.shape, dtype=acc) if want[2] else None)


def _logits_chunk(out: Tensor, h: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``out = h @ weight.T (+ bias)``: one chunk's logits, written into the reused buffer `out`."""
    if bias is None:
        return torch.mm(h, weight.t(), out=out)
    return torch.addmm(bias, h, weight.t(), out=out)


def _accumulate(dz: Tensor, h: Tensor, weight: Tensor, dh: Tensor | None, dw: Tensor | None, db: Tensor | None) -> None:
    """One chunk's share of the gradients, from its dlogits `dz` [n, V]: its rows of dhidden (`dh`, the
    chunk's slice), and dweight, dbias accumulated in the accumulation dtype (float32 for fp16 / bf16)."""
    if dh is not None:
        torch.mm(dz, weight, out=dh)
    if dw is not None:
        if dw.dtype == dz.dtype:
            dw.addmm_(dz.t(), h)
        elif dz.is_cuda and _ADDMM_OUT_DTYPE:
            torch.addmm(dw, dz.t(), h, out_dtype=dw.dtype, out=dw)
        else:  # (the CPU has no low-precision GEMM into float32: one rounding per chunk, summed in float32)
            dw.add_(torch.mm(dz.t(), h))
    if db is not None:
        db.add_(dz.sum(0, dtype=db.dtype))


_ADDMM_OUT_DTYPE = "dtype_out" in torch.ops.aten.addmm.overloads()  # (torch >= 2.8: a low-precision GEMM into float32)


def _chunks(N: int, chunk: int):
    return ((i, min(i + chunk, N)) for i in range(0, N, chunk))


def _linear_cross_entropy(hidden: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor, ignore_index: int,
                          label_smoothing: float, reduction: int, chunk: int, grads=(False, False, False)):
    op = "linear_cross_entropy"
    _check_lce(op, hidden, weight, bias, target, label_smoothing, reduction, chunk)
    want = _check_grads(op, "grads", grads, bias, reduction)
    N, V = hidden.shape[0], weight.shape[0]
    _check_targets(op, target, V, ignore_index)
    stat = stat_dtype(hidden)
    rows = hidden.new_empty((N,), dtype=stat)
    lse = hidden.new_empty((N, 2), dtype=stat)
    dh, dw, db = _grad_buffers(hidden, weight, bias, want)
    count = (target != ignore_index).sum()
    if any(want):  # d(loss)/d(logits) at a unit loss gradient: 1 (sum) or 1 / rows counted (mean)
        unit = torch.ones((), dtype=stat, device=hidden.device)
        scale = unit / count if reduction == REDUCTIONS["mean"] else unit
    buf = hidden.new_empty((min(chunk, N), V))
    for i, j in _chunks(N, chunk):
        z = _logits_chunk(buf[: j - i], hidden[i:j], weight, bias)
        loss_c, lse_c = torch.ops.dmfx.cross_entropy(z, target[i:j], ignore_index, label_smoothing, 0)
        rows[i:j] = loss_c
        lse[i:j] = lse_c
        if any(want):
            dz = torch.ops.dmfx.cross_entropy_backward(scale, z, target[i:j], lse_c, ignore_index, label_smoothing,
                                                       REDUCTIONS["sum"], None)
            _accumulate(dz, hidden[i:j], weight, dh[i:j] if dh is not None else None, dw, db)
            del dz
    if reduction == REDUCTIONS["none"]:
        loss = rows
    else:  # in row order, in float64 (as the family's CPU kernel sums its rows)
        total = rows.sum(dtype=torch.float64)
        loss = (total / count if reduction == REDUCTIONS["mean"] else total).to(stat)
    return (loss, lse, *(g if g is not None else _none(hidden) for g in (dh, dw, db)))


def _linear_cross_entropy_backward(grad_loss: Tensor, hidden: Tensor, weight: Tensor, bias: Tensor | None,
                                   target: Tensor, lse: Tensor, ignore_index: int, label_smoothing: float,
                                   reduction: int, chunk: int, output_mask, dhidden: Tensor | None = None,
                                   dweight: Tensor | None = None, dbias: Tensor | None = None):
    op = "linear_cross_entropy_backward"
    _check_lce(op, hidden, weight, bias, target, label_smoothing, reduction, chunk)
    _check_backward(op, grad_loss, hidden, weight, bias, lse, reduction, output_mask, (dhidden, dweight, dbias))
    mask = _check_grads(op, "output_mask", output_mask, bias, reduction)
    inputs, given = (hidden, weight, bias), (dhidden, dweight, dbias)
    redo = tuple(m and g is None for m, g in zip(mask, given))
    out: list[Tensor | None] = [None, None, None]
    if any(redo):  # recomputed: the logits GEMM again, chunk by chunk, from the forward's lse
        N, V = hidden.shape[0], weight.shape[0]
        _check_targets(op, target, V, ignore_index)
        dh, dw, db = _grad_buffers(hidden, weight, bias, redo)
        if reduction == REDUCTIONS["mean"]:
            grad_loss = grad_loss / (target != ignore_index).sum()
        per_row = reduction == REDUCTIONS["none"]
        buf = hidden.new_empty((min(chunk, N), V))
        for i, j in _chunks(N, chunk):
            z = _logits_chunk(buf[: j - i], hidden[i:j], weight, bias)
            dz = torch.ops.dmfx.cross_entropy_backward(grad_loss[i:j] if per_row else grad_loss, z, target[i:j],
                                                       lse[i:j], ignore_index, label_smoothing,
                                                       REDUCTIONS["none"] if per_row else REDUCTIONS["sum"], None)
            _accumulate(dz, hidden[i:j], weight, dh[i:j] if dh is not None else None, dw, db)
            del dz
        out = [dh, dw, db]
    for k in range(3):
        if given[k] is not None and mask[k]:  # computed in the forward at a unit loss gradient: scaled (and
            # rounded once to the input's dtype, from the forward's float32 accumulation)
            out[k] = torch.mul(given[k], grad_loss, out=torch.empty_like(given[k], dtype=inputs[k].dtype))
        elif out[k] is not None:
            out[k] = out[k].to(inputs[k].dtype)
    return tuple(g if g is not None else _none(hidden) for g in out)


def _check_backward(op: str, grad_loss, hidden, weight, bias, lse, reduction, output_mask, given) -> None:
    N = hidden.shape[0]
    stat = stat_dtype(hidden)
    want = [N] if reduction == REDUCTIONS["none"] else []
    if grad_loss.dtype != stat or list(grad_loss.shape) != want or grad_loss.device != hidden.device:
        raise ValueError(f"dmfx::{op}: grad_loss must be a {stat} tensor of shape {want} on {hidden.device} (the "
                         f"loss's), got {grad_loss.dtype} of shape {list(grad_loss.shape)} on {grad_loss.device}")
    if lse.dtype != stat or list(lse.shape) != [N, 2]:
        raise ValueError(f"dmfx::{op}: lse must be the forward's [{N}, 2] {stat} tensor, got {lse.dtype} of shape "
                         f"{list(lse.shape)}")
    if len(output_mask) != 3:
        raise ValueError(f"dmfx::{op}: output_mask must have 3 flags (hidden, weight, bias), got {list(output_mask)}")
    for name, g, t in zip(_NAMES, given, (hidden, weight, bias)):
        if g is None:
            continue
        if reduction == REDUCTIONS["none"]:
            raise ValueError(f"dmfx::{op}: d{name} (a gradient from the forward) needs a reduced loss, got reduction "
                             "none")
        if t is None or list(g.shape) != list(t.shape) or g.device != t.device:
            raise ValueError(f"dmfx::{op}: d{name} must be the forward's gradient of {name} (its shape and device), "
                             f"got shape {list(g.shape)}")


composite("linear_cross_entropy", _linear_cross_entropy)
composite("linear_cross_entropy_backward", _linear_cross_entropy_backward)


@torch.library.register_fake("dmfx::linear_cross_entropy")
def _linear_cross_entropy_fake(hidden, weight, bias, target, ignore_index, label_smoothing, reduction, chunk,
                               grads=(False, False, False)):
    _check_lce("linear_cross_entropy", hidden, weight, bias, target, label_smoothing, reduction, chunk)
    want = _check_grads("linear_cross_entropy", "grads", grads, bias, reduction)
    N, stat = hidden.shape[0], stat_dtype(hidden)
    loss = hidden.new_empty((N,) if reduction == REDUCTIONS["none"] else (), dtype=stat)
    dh, dw, db = _grad_buffers(hidden, weight, bias, want)
    return (loss, hidden.new_empty((N, 2), dtype=stat), *(g if g is not None else _none(hidden) for g in (dh, dw, db)))


@torch.library.register_fake("dmfx::linear_cross_entropy_backward")
def _linear_cross_entropy_backward_fake(grad_loss, hidden, weight, bias, target, lse, ignore_index, label_smoothing,
                                        reduction, chunk, output_mask, dhidden=None, dweight=None, dbias=None):
    op = "linear_cross_entropy_backward"
    _check_lce(op, hidden, weight, bias, target, label_smoothing, reduction, chunk)
    _check_backward(op, grad_loss, hidden, weight, bias, lse, reduction, output_mask, (dhidden, dweight, dbias))
    mask = _check_grads(op, "output_mask", output_mask, bias, reduction)
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) if m else _none(hidden)
                 for m, t in zip(mask, (hidden, weight, bias)))


def _lce_setup_context(ctx, inputs, output):
    hidden, weight, bias, target, ignore_index, label_smoothing, reduction, chunk, *grads = inputs
    grads = tuple(grads[0]) if grads else (False, False, False)
    _, lse, dh, dw, db = output
    ctx.args = (ignore_index, label_smoothing, reduction, chunk)
    ctx.has_bias, ctx.given = bias is not None, grads
    ctx.save_for_backward(hidden, weight, bias, target, lse, *(g if f else None for g, f in zip((dh, dw, db), grads)))
    # only the loss has a gradient: autograd makes no zeros for the others
    ctx.mark_non_differentiable(lse, dh, dw, db)
    ctx.set_materialize_grads(False)


def _lce_backward(ctx, grad_loss, grad_lse, *grad_unit):
    hidden, weight, bias, target, lse, dh, dw, db = ctx.saved_tensors
    mask = [bool(ctx.needs_input_grad[0]), bool(ctx.needs_input_grad[1]), ctx.has_bias and bool(ctx.needs_input_grad[2])]
    if not any(mask) or grad_loss is None:  # (None: no gradient reached the loss)
        return (None,) * 9
    grads = torch.ops.dmfx.linear_cross_entropy_backward(grad_loss, hidden, weight, bias, target, lse, *ctx.args, mask,
                                                         dh, dw, db)
    return (*(g if m else None for g, m in zip(grads, mask)), None, None, None, None, None, None)


torch.library.register_autograd("dmfx::linear_cross_entropy", _lce_backward, setup_context=_lce_setup_context)
no_double_backward("linear_cross_entropy_backward", "dmfx::linear_cross_entropy")


def linear_cross_entropy(hidden: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None = None,
                         ignore_index: int = -100, label_smoothing: float = 0.0, reduction: str = "mean",
                         chunk: int | None = None, grads_in_forward: bool | None = None) -> Tensor:
    """``F.cross_entropy(F.linear(hidden, weight, bias).float(), target, ...)`` for hidden ``[N, H]``, the
    logits computed ``chunk`` rows at a time (default: ``default_chunk``), so that no ``[N, V]`` tensor
    exists. `grads_in_forward`: compute the gradients in the forward (default: where a gradient is
    needed and the loss is reduced; see the module docstring)."""
    for name, t in (("hidden", hidden), ("weight", weight), ("target", target)):
        check_tensor("linear_cross_entropy", name, t)
    if reduction not in REDUCTIONS:
        raise ValueError(f"dmfx::linear_cross_entropy: reduction must be one of {sorted(REDUCTIONS)}, got {reduction!r}")
    if chunk is None:
        chunk = default_chunk(hidden.shape[0], weight.shape[0]) if hidden.dim() == 2 and weight.dim() == 2 else 1
    need = [torch.is_grad_enabled() and t is not None and t.requires_grad for t in (hidden, weight, bias)]
    if grads_in_forward is None:
        grads_in_forward = reduction != "none"
    grads = need if grads_in_forward else [False, False, False]
    return torch.ops.dmfx.linear_cross_entropy(hidden, weight, bias, target, ignore_index, label_smoothing,
                                               REDUCTIONS[reduction], chunk, grads)[0]

"""Pure-PyTorch (and NumPy) references for dmfx's fused ops, used by the tests.

The references used by more than one family live here (Philox and dropout: every family's dropout;
the attention softmax: the softmax family and the GEMM-form attention); a family's own references
live next to its ops. ``philox_keep`` reimplements the kernels' Philox4x32-10 mask in NumPy, so the tests can check the
CPU and CUDA kernels bit for bit without trusting either.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_W0, _W1 = np.uint32(0x9E3779B9), np.uint32(0xBB67AE85)
_LO = np.uint64(0xFFFFFFFF)


def philox4x32_10(group: np.ndarray, offset: int, seed: int) -> np.ndarray:
    """Philox4x32-10 of counters (group, offset) under key seed: array [n, 4] of uint32 words."""
    g = group.astype(np.uint64)
    c0 = (g & _LO).astype(np.uint32)
    c1 = (g >> np.uint64(32)).astype(np.uint32)
    c2 = np.full_like(c0, offset & 0xFFFFFFFF)
    c3 = np.full_like(c0, (offset >> 32) & 0xFFFFFFFF)
    k0, k1 = np.uint32(seed & 0xFFFFFFFF), np.uint32((seed >> 32) & 0xFFFFFFFF)
    with np.errstate(over="ignore"):
        for _ in range(10):
            p0 = _M0 * c0.astype(np.uint64)
            p1 = _M1 * c2.astype(np.uint64)
            hi0, lo0 = (p0 >> np.uint64(32)).astype(np.uint32), (p0 & _LO).astype(np.uint32)
            hi1, lo1 = (p1 >> np.uint64(32)).astype(np.uint32), (p1 & _LO).astype(np.uint32)
            c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
            k0, k1 = k0 + _W0, k1 + _W1
    return np.stack([c0, c1, c2, c3], axis=1)


def philox_keep(numel: int, p: float, seed: Tensor) -> Tensor:
    """The kernels' keep-mask (bool, flat) for `numel` elements in logical order."""
    return philox_keep_at(np.arange(numel, dtype=np.uint64), p, seed)


def philox_keep_at(index, p: float, seed: Tensor) -> Tensor:
    """The kernels' keep bits of the elements with logical indices `index` (any shape; a NumPy array or an
    integer tensor, read as uint64): a bool tensor of that shape. (The varlen attention's elements sit at
    (h * T + tq) * T + tk, far apart in a [Hq, T, T] index space it never materializes.)"""
    idx = np.asarray(index.cpu().numpy() if isinstance(index, Tensor) else index).astype(np.uint64)
    if p <= 0:
        return torch.ones(idx.shape, dtype=torch.bool)
    if p >= 1:
        return torch.zeros(idx.shape, dtype=torch.bool)
    s, o = (int(v) for v in seed.tolist())
    flat = idx.reshape(-1)
    words = philox4x32_10(flat >> np.uint64(2), o, s)[np.arange(flat.size), (flat & np.uint64(3)).astype(np.int64)]
    threshold = min(int(np.floor(p * 2.0**32)), 0xFFFFFFFF)
    return torch.from_numpy(words >= np.uint32(threshold)).reshape(idx.shape)


def dropout(x: Tensor, seed: Tensor, p: float) -> Tensor:
    keep = philox_keep(x.numel(), p, seed).reshape(x.shape).to(x.device)
    scale = 0.0 if p >= 1 else 1.0 / (1.0 - p)
    return torch.where(keep, x * scale, torch.zeros_like(x))


def bias_dropout_residual_norm(x, bias, residual, weight, norm_bias, seed, p, eps, rms):
    """(out, sum) computed in float32 (float64 for float64 input), out cast back to x's dtype."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    s = x.to(acc)
    if bias is not None:
        s = s + bias.to(acc)
    if p > 0:
        s = dropout(s, seed, p)
    if residual is not None:
        s = s + residual.to(acc)
    if rms:
        y = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps)
    else:
        y = torch.nn.functional.layer_norm(s, s.shape[-1:], eps=eps)
    if weight is not None:
        y = y * weight.to(acc)
    if norm_bias is not None:
        y = y + norm_bias.to(acc)
    return y.to(x.dtype), s.to(x.dtype)


def layer_norm(x, weight, bias, eps):
    return bias_dropout_residual_norm(x, None, None, weight, bias, None, 0.0, eps, False)[0]


def rms_norm(x, weight, eps):
    return bias_dropout_residual_norm(x, None, None, weight, None, None, 0.0, eps, True)[0]

def cross_entropy(logits: Tensor, target: Tensor, ignore_index: int, label_smoothing: float,
                  reduction: int) -> tuple[Tensor, Tensor]:
    """(loss, lse) of dmfx::cross_entropy in pure PyTorch: ``F.cross_entropy`` on the logits upcast to
    float32 (float64 for float64 logits), and each row's max and log-sum-exp minus it ([N, 2]; (0, 0) for
    an ignored row). `reduction`: the op's code (0 none, 1 mean, 2 sum)."""
    acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
    z = logits.to(acc)
    name = ("none", "mean", "sum")[reduction]
    loss = torch.nn.functional.cross_entropy(z, target, ignore_index=ignore_index, label_smoothing=label_smoothing,
                                             reduction=name)
    m = z.amax(dim=-1) if z.shape[0] else z.new_empty((0,))
    lse = torch.stack([m, torch.logsumexp(z - m[:, None], dim=-1)], dim=-1)
    return loss, lse.masked_fill((target == ignore_index)[:, None], 0.0)


def linear_cross_entropy(hidden: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor, ignore_index: int,
                         label_smoothing: float, reduction: int) -> tuple[Tensor, Tensor]:
    """(loss, lse) of dmfx::linear_cross_entropy in pure PyTorch: the whole ``[N, V]`` logits
    ``F.linear(hidden, weight, bias)`` (in the inputs' dtype), then cross_entropy above."""
    return cross_entropy(torch.nn.functional.linear(hidden, weight, bias), target, ignore_index, label_smoothing,
                         reduction)


def reference_softmax(
    scores: Tensor,
    mask: Tensor | None = None,
    scale: float = 1.0,
    causal: bool = False,
    seed: Tensor | None = None,
    p: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """(out, probs) of dmfx::attention_softmax in pure PyTorch, computed in float32 (float64 for float64 scores).

    Fully masked rows give zeros; the dropout mask is reference.philox_keep's (bit for bit the kernels').
    """
    acc = torch.float64 if scores.dtype == torch.float64 else torch.float32
    z = scores.to(acc) * scale
    if mask is not None:
        if mask.dtype == torch.bool:
            z = z.masked_fill(~mask, float("-inf"))
        else:
            z = z + mask.to(acc)
    if causal:
        sq, sk = z.shape[-2], z.shape[-1]
        i = torch.arange(sq, device=z.device)[:, None]
        j = torch.arange(sk, device=z.device)[None, :]
        z = z.masked_fill(j > i + (sk - sq), float("-inf"))
    if z.numel() == 0:
        probs = z.clone()
    else:
        probs = torch.softmax(z, dim=-1)
        fully_masked = (z == float("-inf")).all(dim=-1, keepdim=True)
        probs = probs.masked_fill(fully_masked, 0.0)
    if p > 0:
        out = dropout(probs, seed, p)
        return out.to(scores.dtype), probs.to(scores.dtype)
    return probs.to(scores.dtype), scores.new_empty((0,))


def softcap(x: Tensor, cap: float) -> Tensor:
    """dmfx::softcap in pure PyTorch: ``cap * tanh(x / cap)`` computed in float32 (float64 for float64 x),
    rounded once to x's dtype."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    return (cap * torch.tanh(x.to(acc) / cap)).to(x.dtype)


def softcap_backward(grad_out: Tensor, out: Tensor, cap: float) -> Tensor:
    """dmfx::softcap_backward in pure PyTorch: ``grad_out * (1 - (out / cap)^2)`` from softcap's output,
    in float32 (float64 for float64), rounded once to grad_out's dtype."""
    acc = torch.float64 if grad_out.dtype == torch.float64 else torch.float32
    t = out.to(acc) / cap
    return (grad_out.to(acc) * (1 - t * t)).to(grad_out.dtype)

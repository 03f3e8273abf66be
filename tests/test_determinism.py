"""What each op family promises about reproducibility on the CPU, tested exactly as stated.

The promises are written in each family's module docstring (section "Determinism"):

* every family: forward and backward are bit-reproducible run to run with the thread count fixed
  (``torch.set_num_threads``): each thread's share of the rows is fixed by the count, and every
  reduction runs in a fixed order;
* per-row results do not depend on the thread count at all: the norm forward and its dx/dresidual,
  the softmax forward and backward, the pointwise forwards and their dx, dropout masks (Philox of the
  element index), the fused attention (one thread per (batch, head) task; the varlen form: per
  (sequence, head, query block) item and (sequence, kv head) task), and the cross-entropy
  (its reduced loss too: the rows' losses summed in row order; linear_cross_entropy, ATen's GEMMs
  around it, only run to run at a fixed count);
* the column sums (a norm's dweight/dnorm_bias/dbias, bias_act_dropout's dbias) are summed per
  thread, then across threads: reproducible for a fixed count, not across counts (they agree to
  rounding, which the op tests check).

Sizes are large enough that every kernel splits its rows over 2 threads.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import dmfx  # noqa: F401  (registers the ops)
from dmfx.cuda_ops import new_seed

ops = torch.ops.dmfx


@contextlib.contextmanager
def threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _flat(out) -> list[torch.Tensor]:
    return [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)]


def _runs(fn, n_threads: int, times: int = 3) -> list[list[torch.Tensor]]:
    with threads(n_threads):
        return [[t.clone() for t in _flat(fn())] for _ in range(times)]


def assert_bitwise(runs: list[list[torch.Tensor]], what: str, only: list[int] | None = None) -> None:
    first = runs[0]
    for k, other in enumerate(runs[1:], 1):
        for i, (a, b) in enumerate(zip(first, other)):
            if only is not None and i not in only:
                continue
            assert a.shape == b.shape and torch.equal(a, b), (
                f"{what}: output {i} differs between run 0 and run {k} "
                f"(max |diff| {(a.double() - b.double()).abs().max().item():.3e})")


def _norm_case(dtype, rms, dropout):
    g = torch.Generator().manual_seed(1)
    R, H = 3000, 96  # the norm kernels split rows in chunks of 32768 / H
    x, res, dy = (torch.randn(R, H, generator=g).to(dtype) for _ in range(3))
    bias, w, nb = (torch.randn(H, generator=g).to(dtype) for _ in range(3))
    seed = new_seed() if dropout else None
    p = 0.2 if dropout else 0.0

    def fwd():
        return ops.bias_dropout_residual_norm(x, bias, res, w, None if rms else nb, seed, p, 1e-5, rms, True)

    out, s, mean, rstd = fwd()
    mask = [True, True, True, not rms, True]

    def bwd():
        return ops.norm_backward(dy, None, x, bias, res, w, None if rms else mean, rstd, seed, p, rms, mask)

    return fwd, bwd


DTYPES = [torch.float32, torch.bfloat16, torch.float64]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("dropout", [False, True])
def test_norm_family(dtype, rms, dropout):
    fwd, bwd = _norm_case(dtype, rms, dropout)
    assert_bitwise(_runs(fwd, 2), "bias_dropout_residual_norm, 2 threads")
    assert_bitwise(_runs(bwd, 2), "norm_backward, 2 threads")
    # per-row outputs: the same with 1 and 2 threads; column sums (dweight, dnorm_bias, dbias) are not
    # promised across thread counts
    assert_bitwise([_runs(fwd, 1, 1)[0], _runs(fwd, 2, 1)[0]], "bias_dropout_residual_norm, 1 vs 2 threads")
    assert_bitwise([_runs(bwd, 1, 1)[0], _runs(bwd, 2, 1)[0]], "norm_backward dx/dresidual, 1 vs 2 threads", only=[0, 1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_dropout_and_layer_norm(dtype):
    x = torch.randn(4000, 80).to(dtype)
    seed = new_seed()
    w, b = torch.randn(80).to(dtype), torch.randn(80).to(dtype)
    for name, fn in (("dropout", lambda: ops.dropout(x, seed, 0.3)),
                     ("layer_norm", lambda: ops.layer_norm(x, w, b, 1e-5)),
                     ("rms_norm", lambda: ops.rms_norm(x, w, 1e-6))):
        assert_bitwise(_runs(fn, 2) + _runs(fn, 1, 1), f"{name}, 1 and 2 threads")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("p", [0.0, 0.2])
def test_softmax_family(dtype, p):
    scores = torch.randn(4, 6, 70, 70).to(dtype)
    mask = torch.where(torch.rand(4, 1, 1, 70) < 0.8, 0.0, torch.finfo(torch.float32).min)
    seed = new_seed() if p else None
    out, probs = ops.attention_softmax(scores, mask, 0.3, True, seed, p)
    g = torch.randn_like(out)
    used = probs if p else out

    def fwd():
        return ops.attention_softmax(scores, mask, 0.3, True, seed, p)

    def bwd():
        return ops.attention_softmax_backward(g, used, seed, p, 0.3)

    for what, fn in (("softmax", fwd), ("softmax_backward", bwd)):
        assert_bitwise(_runs(fn, 2) + _runs(fn, 1, 1), f"{what}, 1 and 2 threads")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ["gelu", "gelu_tanh", "silu", "relu", "identity"])
def test_pointwise_family(dtype, act):
    R, N = 1500, 72  # rows split in chunks of 32768 / N
    x, dy = torch.randn(R, N).to(dtype), torch.randn(R, N).to(dtype)
    bias = torch.randn(N).to(dtype)
    seed = new_seed()

    def fwd():
        return ops.bias_act_dropout(x, bias, act, seed, 0.1)

    def bwd():
        return ops.bias_act_dropout_backward(dy, x, bias, act, seed, 0.1, [True, True])

    assert_bitwise(_runs(fwd, 2) + _runs(fwd, 1, 1), f"bias_act_dropout({act}), 1 and 2 threads")
    assert_bitwise(_runs(bwd, 2), f"bias_act_dropout_backward({act}), 2 threads")
    assert_bitwise([_runs(bwd, 1, 1)[0], _runs(bwd, 2, 1)[0]], f"bias_act_dropout_backward({act}) dx, 1 vs 2 threads", only=[0])
    if act in ("gelu", "silu"):
        up = torch.randn(R, N).to(dtype)
        assert_bitwise(_runs(lambda: ops.glu(x, up, act), 2) + _runs(lambda: ops.glu(x, up, act), 1, 1), f"glu({act})")
        gb = lambda: ops.glu_backward(dy, x, up, act, [True, True])  # noqa: E731
        assert_bitwise(_runs(gb, 2) + _runs(gb, 1, 1), f"glu_backward({act})")


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope(dtype):
    B, H, L, D = 2, 4, 96, 32
    q, k = torch.randn(B, H, L, D).to(dtype), torch.randn(B, 2, L, D).to(dtype)
    cos, sin = torch.randn(1, 1, L, D).to(dtype), torch.randn(1, 1, L, D).to(dtype)
    for inverse in (False, True):
        for pairing in ((False, False), (True, False), (False, True)):  # (interleaved, deinterleave)
            fn = lambda: ops.rope(q, k, cos, sin, inverse, *pairing)  # noqa: E731
            assert_bitwise(_runs(fn, 2) + _runs(fn, 1, 1), f"rope(inverse={inverse}, pairing={pairing}), 1 and 2 threads")


def _heads(B, L, H, D, dtype):
    return torch.randn(B, L, H, D).to(dtype).transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("Hk", [4, 2])
@pytest.mark.parametrize("p", [0.0, 0.2])
def test_flash_attention(dtype, Hk, p):
    B, H, L, D = 2, 4, 80, 16
    q, k, v = _heads(B, L, H, D, dtype), _heads(B, L, Hk, D, dtype), _heads(B, L, Hk, D, dtype)
    mask = torch.where(torch.rand(B, 1, 1, L) < 0.8, 0.0, torch.finfo(torch.float32).min).to(dtype)
    seed = new_seed() if p else None
    out, stats = ops.flash_attention(q, k, v, mask, 0.25, False, seed, p)
    g = torch.randn_like(out)

    def fwd():
        return ops.flash_attention(q, k, v, mask, 0.25, False, seed, p)

    def bwd():
        return ops.flash_attention_backward(g, q, k, v, stats, mask, 0.25, False, seed, p, Hk == H)

    for what, fn in (("flash_attention", fwd), ("flash_attention_backward", bwd)):
        assert_bitwise(_runs(fn, 2) + _runs(fn, 1, 1), f"{what}, 1 and 2 threads")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("Hk", [4, 2])
@pytest.mark.parametrize("p", [0.0, 0.2])
def test_gemm_attention(dtype, Hk, p):
    """The GEMM form (ATen's batched GEMMs around the fused softmax): reproducible with the thread
    count fixed, also for a float mask that requires grad and gradients reaching every output."""
    B, H, L, D = 2, 4, 48, 16
    q, k, v = _heads(B, L, H, D, dtype), _heads(B, L, Hk, D, dtype), _heads(B, L, Hk, D, dtype)
    mask = torch.randn(B, 1, L, L, dtype=dtype)
    seed = new_seed() if p else None
    out, probs, dropped = ops.attention(q, k, v, mask, 0.25, True, seed, p)
    g, gp = torch.randn_like(out), torch.randn_like(probs)
    gd = torch.randn_like(dropped) if p else None

    def fwd():
        return ops.attention(q, k, v, mask, 0.25, True, seed, p)

    def bwd():
        return ops.attention_backward(g, q, k, v, probs, dropped, seed, p, 0.25, True, gp, gd)

    for what, fn in (("attention", fwd), ("attention_backward", bwd)):
        assert_bitwise(_runs(fn, 2), f"{what}, 2 threads")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", [0, 1])
def test_cross_entropy_family(dtype, reduction):
    """Per-row results and the reduced loss (rows summed in row order after the parallel loop) are the
    same bits with 1 and 2 threads."""
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(64, 3000, generator=g) * 3).to(dtype)
    target = torch.randint(0, 3000, (64,), generator=g)
    target[::7] = -100
    loss, lse = ops.cross_entropy(logits, target, -100, 0.1, reduction)
    grad = torch.randn(loss.shape, generator=g, dtype=loss.dtype)
    grad_logits = torch.randn(64, 3000, generator=g).to(dtype)

    def fwd():
        return ops.cross_entropy(logits, target, -100, 0.1, reduction)

    def bwd():
        return ops.cross_entropy_backward(grad, logits, target, lse, -100, 0.1, reduction, grad_logits)

    for what, fn in (("cross_entropy", fwd), ("cross_entropy_backward", bwd)):
        assert_bitwise(_runs(fn, 2) + _runs(fn, 1, 1), f"{what}, 1 and 2 threads")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", [0, 1])
def test_linear_cross_entropy(dtype, reduction):
    """The chunked LM head + loss (ATen's GEMMs around the family's kernels): every output, forward (with
    the gradients computed there for a reduced loss) and backward, the same bits run to run with 2
    threads (its docstring promises no more: the GEMMs' blocking may depend on the thread count)."""
    g = torch.Generator().manual_seed(5)
    h, w = torch.randn(300, 64, generator=g).to(dtype), (torch.randn(2000, 64, generator=g) / 8).to(dtype)
    b, target = torch.randn(2000, generator=g).to(dtype), torch.randint(0, 2000, (300,), generator=g)
    target[::7] = -100
    grads = [reduction != 0] * 3
    loss, lse = ops.linear_cross_entropy(h, w, b, target, -100, 0.1, reduction, 64, grads)[:2]
    grad = torch.randn(loss.shape, generator=g, dtype=loss.dtype)

    def fwd():
        return ops.linear_cross_entropy(h, w, b, target, -100, 0.1, reduction, 64, grads)

    def bwd():
        return ops.linear_cross_entropy_backward(grad, h, w, b, target, lse, -100, 0.1, reduction, 64, [True] * 3)

    for what, fn in (("linear_cross_entropy", fwd), ("linear_cross_entropy_backward", bwd)):
        assert_bitwise(_runs(fn, 2), f"{what}, 2 threads")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("Hk", [4, 2])
@pytest.mark.parametrize("p", [0.0, 0.2])
def test_varlen_attention(dtype, Hk, p):
    """Every output of the varlen ops (out, stats, dq, dk, dv, the stacked dqkv), the same bits run to
    run and with 1 and 2 threads: one thread computes each forward item and each backward task whole,
    whichever thread the dynamic schedule hands it to."""
    lengths = [0, 130, 7, 1, 0, 64, 300, 12]  # (300 rows: the forward splits them into blocks in fp64)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    T, H, D = int(cu[-1]), 4, 16
    q, k, v = torch.randn(T, H, D).to(dtype), torch.randn(T, Hk, D).to(dtype), torch.randn(T, Hk, D).to(dtype)
    qkv = torch.randn(T, 3 * H * D).to(dtype)
    seed = new_seed() if p else None
    out, stats = ops.varlen_attention(q, k, v, cu, 0.25, True, seed, p)
    qout, qstats = ops.qkv_varlen_attention(qkv, H, cu, 0.25, False, seed, p)
    g = torch.randn_like(out)

    def fwd():
        return (*ops.varlen_attention(q, k, v, cu, 0.25, True, seed, p), *ops.qkv_varlen_attention(qkv, H, cu, 0.25, False, seed, p))

    def bwd():
        return (*ops.varlen_attention_backward(g, q, k, v, out, stats, cu, 0.25, True, seed, p),
                ops.qkv_varlen_attention_backward(g, qkv, H, qout, qstats, cu, 0.25, False, seed, p))

    for what, fn in (("varlen_attention", fwd), ("varlen_attention_backward", bwd)):
        assert_bitwise(_runs(fn, 2) + _runs(fn, 1, 1), f"{what}, 1 and 2 threads")

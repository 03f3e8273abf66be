"""The fold_bias_grads pass (passes/backward/fold_bias_grads.py) and the op outputs it uses: the
bias gradients of the stacked or separate Q/K/V projections come out of the attention backward
(bias_grad=True), and a linear's bias gradient before a norm out of norm_backward's dbias."""

from __future__ import annotations

import pytest
import torch
from conftest import max_rel_err, run_pass, targets, trace_fake
from test_pass_fold_gradient_adds import _norm_case, nb, on_both_cpu_builds

from dmfx.cuda_ops import new_seed

aten = torch.ops.aten


@on_both_cpu_builds
@pytest.mark.parametrize("dropout", [False, True])
def test_dbias_without_bias_is_the_column_sum_of_dx(dropout):
    """The bias gradient is asked for although the bias stayed in the GEMM before the norm."""
    x, _, res, w, mean, rstd, seed, p = _norm_case(False, dropout, True)
    g = torch.randn_like(x)
    dx, _, _, _, db = nb(g, None, x, None, res, w, mean, rstd, seed, p, False, [True, False, False, False, True])
    assert db.shape == (24,) and max_rel_err(db, dx.sum((0, 1))) < 1e-12


def _qkv_case(B=2, L=5, H=2, D=4):
    qkv = torch.randn(B, L, 3 * H * D)
    seed = new_seed()
    out, stats = torch.ops.dmfx.qkv_flash_attention(qkv, H, None, 0.3, False, seed, 0.1)
    return torch.randn_like(out), qkv, stats, seed, H


def test_fold_bias_grads_fires_and_leaves_partial_sums():
    from dmfx.passes.backward import fold_bias_grads

    g, qkv, stats, seed, H = _qkv_case()
    B, L, F = qkv.shape
    op = torch.ops.dmfx.qkv_flash_attention_backward

    def rows(g, qkv, stats, seed):  # HF's bias gradient: the 2-D view summed over dim 0, keepdim
        d = op(g, qkv, H, stats, None, 0.3, False, seed, 0.1)[0]
        d2 = d.view(B * L, F)
        return d2.t().mm(torch.ones(B * L, 1)), d2.sum([0], keepdim=True).view(F)

    def batch_only(g, qkv, stats, seed):  # a sum over the batch alone is not a bias gradient
        d = op(g, qkv, H, stats, None, 0.3, False, seed, 0.1)[0]
        return d.sum([0])

    args = (g, qkv, stats, seed)
    gm = trace_fake(rows, *args)
    ref, got, ctx = run_pass(gm, fold_bias_grads, *args)
    assert ctx.fired == {"fold_bias_grads": 1} and aten.sum.dim_IntList not in targets(gm)
    for a, b in zip(got, ref):
        assert max_rel_err(a, b) < 1e-5
    gm = trace_fake(batch_only, *args)
    ref, got, ctx = run_pass(gm, fold_bias_grads, *args)
    assert ctx.fired == {} and aten.sum.dim_IntList in targets(gm)


@on_both_cpu_builds
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gqa", [False, True])
def test_flash_backward_head_bias_gradients(dtype, gqa):
    """flash_attention_backward(bias_grad=True) returns the bias gradients of the three projections
    ([B, H, L, D] views of [B, L, H*D]): the fused kernel's per-(batch, head) sums, or (bf16, grouped
    k/v) the same sums taken afterwards; dq, dk, dv are unchanged."""
    B, L, H, D = 2, 7, 4, 8
    Hk = 2 if gqa else H  # (grouped k/v: the sums are taken after the kernel)
    q = torch.randn(B, L, H, D, dtype=dtype).transpose(1, 2)
    k, v = (torch.randn(B, L, Hk, D, dtype=dtype).transpose(1, 2) for _ in range(2))
    seed = new_seed()
    out, stats = torch.ops.dmfx.flash_attention(q, k, v, None, 0.3, True, seed, 0.2)
    g = torch.randn_like(out)
    op = torch.ops.dmfx.flash_attention_backward
    got = op(g, q, k, v, stats, None, 0.3, True, seed, 0.2, bias_grad=True)
    ref = op(g, q, k, v, stats, None, 0.3, True, seed, 0.2)
    tol = 1e-12 if dtype == torch.float64 else 1e-5 if dtype == torch.float32 else 2e-2
    for i in range(3):
        assert torch.equal(got[i], ref[i]) and ref[3 + i].numel() == 0
        want = ref[i].double().sum(dim=(0, 2)).reshape(-1)
        scale = ref[i].double().abs().sum(dim=(0, 2)).max()  # (dk's sum is zero up to rounding)
        assert got[3 + i].shape == want.shape and got[3 + i].dtype == dtype
        assert ((got[3 + i].double() - want).abs().max() / scale).item() < tol
    torch.library.opcheck(op, (g, q, k, v, stats, None, 0.3, True, seed, 0.2), {"bias_grad": True})

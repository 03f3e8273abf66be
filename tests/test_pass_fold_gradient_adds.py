"""The fold_gradient_adds pass (passes/backward/fold_gradient_adds.py) and the op change it relies on.

* ``dmfx::norm_backward(..., grad_out2=g2)`` equals ``norm_backward(grad_out + g2, ...)`` for every
  variant (LayerNorm/RMSNorm, dropout, residual, bias, weight), passes opcheck, and names a bad
  ``grad_out2``.
* ``fold_gradient_adds`` fires on hand-built backward graphs, leaves the near-misses alone (a gradient
  read twice, a broadcasting add, mixed dtypes), and the rewritten graphs compute the same values.
"""

from __future__ import annotations

import pytest
import torch
from conftest import layer_norm_saved, max_rel_err, run_pass, targets, trace_fake

from dmfx.cuda_ops import new_seed
from dmfx.passes.backward import fold_gradient_adds

aten = torch.ops.aten
nb = torch.ops.dmfx.norm_backward
on_both_cpu_builds = pytest.mark.usefixtures("cpu_build")  # the op-level tests: conftest.cpu_build


def _norm_case(rms, dropout, residual, dtype=torch.float64):
    torch.manual_seed(0)
    x = torch.randn(3, 5, 24, dtype=dtype)
    bias, w, nbias = (torch.randn(24, dtype=dtype) for _ in range(3))
    res = torch.randn(3, 5, 24, dtype=dtype) if residual else None
    seed = new_seed() if dropout else None
    p = 0.25 if dropout else 0.0
    out, _, mean, rstd = torch.ops.dmfx.bias_dropout_residual_norm(
        x, bias, res, w, None if rms else nbias, seed, p, 1e-5, rms, False)
    return x, bias, res, w, (None if rms else mean), rstd, seed, p


@on_both_cpu_builds
@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("dropout", [False, True])
@pytest.mark.parametrize("residual", [False, True])
def test_grad_out2_equals_the_sum(rms, dropout, residual):
    x, bias, res, w, mean, rstd, seed, p = _norm_case(rms, dropout, residual)
    g1, g2, gs = torch.randn_like(x), torch.randn_like(x), torch.randn_like(x)
    mask = [True, residual, True, not rms, True]
    want = nb(g1 + g2, gs, x, bias, res, w, mean, rstd, seed, p, rms, mask)
    got = nb(g1, gs, x, bias, res, w, mean, rstd, seed, p, rms, mask, grad_out2=g2)
    for name, a, b in zip(["dx", "dresidual", "dweight", "dnorm_bias", "dbias"], got, want):
        assert a.shape == b.shape, name
        if b.numel():
            assert max_rel_err(a, b) < 1e-12, name


@on_both_cpu_builds
def test_grad_out2_strided():
    """A non-contiguous second gradient (a transposed view) is read through its strides."""
    x, bias, res, w, mean, rstd, seed, p = _norm_case(False, False, True)
    g1 = torch.randn_like(x)
    g2 = torch.randn(3, 24, 5, dtype=x.dtype).transpose(1, 2)
    mask = [True, False, True, True, True]
    want = nb(g1 + g2, None, x, bias, res, w, mean, rstd, None, 0.0, False, mask)
    got = nb(g1, None, x, bias, res, w, mean, rstd, None, 0.0, False, mask, grad_out2=g2)
    for a, b in zip(got, want):
        if b.numel():
            assert max_rel_err(a, b) < 1e-12


@on_both_cpu_builds
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_grad_out2_low_precision(dtype):
    """In bf16/fp16 the kernel adds the two gradients in float32 (eager rounds their sum to the low
    precision first): close to eager's answer."""
    x, bias, res, w, mean, rstd, seed, p = _norm_case(False, True, True, dtype)
    g1, g2 = torch.randn_like(x), torch.randn_like(x)
    mask = [True, True, True, True, True]
    want = nb(g1 + g2, None, x, bias, res, w, mean, rstd, seed, p, False, mask)
    got = nb(g1, None, x, bias, res, w, mean, rstd, seed, p, False, mask, grad_out2=g2)
    for a, b in zip(got, want):
        assert a.dtype == dtype
        if b.numel():
            assert max_rel_err(a.float(), b.float()) < 3e-2


@on_both_cpu_builds
def test_grad_out2_opcheck():
    x, bias, res, w, mean, rstd, seed, p = _norm_case(False, True, True, torch.float32)
    g1, g2 = torch.randn_like(x), torch.randn_like(x)
    torch.library.opcheck(nb, (g1, None, x, bias, res, w, mean, rstd, seed, p, False, [True] * 5),
                          {"grad_out2": g2})


@on_both_cpu_builds
def test_grad_out2_bad_shape_is_named():
    x, bias, res, w, mean, rstd, seed, p = _norm_case(False, False, False)
    with pytest.raises(RuntimeError, match=r"norm_bwd: grad_out2 must have the shape of x"):
        nb(torch.randn_like(x), None, x, bias, None, w, mean, rstd, None, 0.0, False, [True] * 5,
           grad_out2=torch.randn(3, 5, 12, dtype=x.dtype))


def test_fold_gradient_adds_fires():
    x, w, mean, rstd = layer_norm_saved()

    def f(g1, g2, x, w, mean, rstd):
        d = nb(g1 + g2, None, x, None, None, w, mean, rstd, None, 0.0, False, [True, False, True, True, False])
        return d[0], d[2], d[3]

    args = (torch.randn_like(x), torch.randn_like(x), x, w, mean, rstd)
    gm = trace_fake(f, *args)
    ref, got, ctx = run_pass(gm, fold_gradient_adds, *args)
    assert ctx.fired == {"fold_gradient_adds": 1}
    assert aten.add.Tensor not in targets(gm)
    (n,) = [n for n in gm.graph.nodes if n.target is nb.default]
    assert n.kwargs.get("grad_out2") is not None
    for a, b in zip(got, ref):
        assert max_rel_err(a, b) < 1e-5


def test_fold_gradient_adds_leaves_near_misses():
    x, w, mean, rstd = layer_norm_saved()

    def read_twice(g1, g2, x, w, mean, rstd):  # the summed gradient is also an output
        s = g1 + g2
        return nb(s, None, x, None, None, w, mean, rstd, None, 0.0, False, [True, False, True, True, False])[0], s

    def broadcasting(g1, g2, x, w, mean, rstd):  # g2 is a row: the add broadcasts
        return nb(g1 + g2[0, :1], None, x, None, None, w, mean, rstd, None, 0.0, False, [True, False, True, True, False])[0]

    def scaled(g1, g2, x, w, mean, rstd):  # add with alpha
        return nb(torch.add(g1, g2, alpha=2.0), None, x, None, None, w, mean, rstd, None, 0.0, False,
                  [True, False, True, True, False])[0]

    args = (torch.randn_like(x), torch.randn_like(x), x, w, mean, rstd)
    for fn in (read_twice, broadcasting, scaled):
        gm = trace_fake(fn, *args)
        ref, got, ctx = run_pass(gm, fold_gradient_adds, *args)
        assert ctx.fired == {}, fn.__name__
        assert aten.add.Tensor in targets(gm), fn.__name__
        assert len(ctx.missed) == 1, (fn.__name__, ctx.missed)

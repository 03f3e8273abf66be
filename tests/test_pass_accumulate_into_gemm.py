"""The accumulate_into_gemm pass (passes/backward/accumulate_into_gemm.py) on hand-built backward
graphs: add(g, mm(a, b)) becomes addmm_(g, a, b), chains of adds accumulate into one buffer, and the
near-misses (a buffer read later or not the graph's own, mixed dtypes, a GEMM reading the buffer it
would write) are left alone; the rewritten graphs compute the same values."""

from __future__ import annotations

import torch
from conftest import assert_pass_declines, layer_norm_saved, max_rel_err, run_pass, targets, trace_fake

from dmfx.passes.backward import accumulate_into_gemm

aten = torch.ops.aten
nb = torch.ops.dmfx.norm_backward


def test_accumulate_into_gemm_fires_and_chains():
    """Three GEMMs' dX added to a fresh gradient (unstacked Q, K, V): all three accumulate into it."""
    x, w, mean, rstd = layer_norm_saved()

    def f(g, x, w, mean, rstd, a1, a2, a3, w1, w2, w3):
        dres = nb(g, None, x, None, None, w, mean, rstd, None, 0.0, False, [True, False, False, False, False])[0]
        out = dres + (a1 @ w1.t()).view(2, 6, 16)
        out = out + (a2 @ w2.t()).view(2, 6, 16)
        return (a3 @ w3.t()).view(2, 6, 16) + out

    a = [torch.randn(12, 8) for _ in range(3)]
    ws = [torch.randn(16, 8) for _ in range(3)]
    args = (torch.randn_like(x), x, w, mean, rstd, *a, *ws)
    gm = trace_fake(f, *args)
    ref, got, ctx = run_pass(gm, accumulate_into_gemm, *args)
    assert ctx.fired == {"accumulate_into_gemm": 3}
    t = targets(gm)
    assert aten.add.Tensor not in t and aten.mm.default not in t and t.count(aten.addmm_.default) == 3
    assert max_rel_err(got, ref) < 1e-5


def _assert_declined(fn, args):
    """The pass leaves fn's graph alone (no addmm_), and the graph still computes fn."""
    assert_pass_declines(accumulate_into_gemm, fn, args, aten.addmm_.default, 1e-5)


def test_accumulate_into_gemm_leaves_near_misses():
    def graph_input(g, a, w):  # g is a graph input (a tangent or saved tensor): not ours to write
        return g + a @ w.t()

    def read_twice(g, a, w):  # the fresh buffer is also returned
        h = g * 2
        return h + a @ w.t(), h

    def mixed_dtype(g, a, w):  # the GEMM runs in another dtype than the gradient
        h = g * 2
        return h + (a.double() @ w.double().t()).float()

    def transposed(g, a, w):  # the fresh buffer is not contiguous
        h = (g * 2).t().contiguous().t()
        return h + a @ w.t()

    args = (torch.randn(6, 16), torch.randn(6, 8), torch.randn(16, 8))
    for fn in (graph_input, read_twice, mixed_dtype, transposed):
        _assert_declined(fn, args)


def test_accumulate_into_gemm_never_writes_a_gemm_operand():
    """Regression (issue 15): a residual around one linear, LN(Linear(x) + x), gives the norm's
    dresidual as the linear's upstream gradient too: ``dres + dres @ W`` became ``addmm_(dres, dres,
    W)``, a BLAS call whose output aliases its operand (wrong input gradients on an AVX-512 CPU).
    Also through views, and through a view op returning a list (split) whose part is read later."""

    def own_operand(g, w):  # add(h, mm(h, w)): h is both the accumulator and the GEMM's left operand
        h = g * 2
        return h + h @ w

    def own_operand_viewed(g, w):  # the same through views, as AOTAutograd writes it
        h = (g * 2).view(2, 3, 16)
        return h + (h.view(6, 16) @ w).view(2, 3, 16)

    def right_operand(g, a):  # the accumulator is the GEMM's right operand
        h = g[:, :6].contiguous() * 2  # [6, 6]
        return h + a @ h

    def split_read_later(g, a, w):  # a part of the buffer (split: a list of views) is read after the add
        h = g * 2
        first, _ = h.split(3, 0)
        s = h + a @ w.t()
        return s, first * 3

    cases = [(own_operand, (torch.randn(6, 16), torch.randn(16, 16))),
             (own_operand_viewed, (torch.randn(6, 16), torch.randn(16, 16))),
             (right_operand, (torch.randn(6, 16), torch.randn(6, 6))),
             (split_read_later, (torch.randn(6, 16), torch.randn(6, 8), torch.randn(16, 8)))]
    for fn, args in cases:
        _assert_declined(fn, args)

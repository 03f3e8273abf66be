"""The fold_logits_grad pass (passes/backward/fold_logits_grad.py): ``add(g, view(cross_entropy_backward(
...)))`` becomes ``view(cross_entropy_backward(..., grad_logits=g))`` on hand-built backward graphs (with
and without the view, either operand order), the rewritten graphs compute the same values, and the
near-misses (a scaled add, a gradient or a view of it read twice, a broadcasting add) are left alone. The end-to-end
case (HF models returning their logits) is in test_pass_cross_entropy.py."""

from __future__ import annotations

import torch
from conftest import max_rel_err, run_pass, targets, trace_fake

from dmfx.passes.backward import fold_logits_grad

aten = torch.ops.aten
ce, ceb = torch.ops.dmfx.cross_entropy, torch.ops.dmfx.cross_entropy_backward


def _saved(N=6, V=11):
    z = torch.randn(N, V)
    t = torch.randint(0, V, (N,))
    t[0] = -100
    return z, t, ce(z, t, -100, 0.0, 1)[1]


def _fold(fn, *args):
    gm = trace_fake(fn, *args)
    ref, got, ctx = run_pass(gm, fold_logits_grad, *args)
    return gm, ctx, ref, got


def test_fires_through_a_view_in_either_order():
    z, t, lse = _saved()

    def logits_then_loss(g, gl, z, t, lse):  # HF: the tangent of the [B, L, V] logits + the loss's
        return gl + ceb(g, z, t, lse, -100, 0.0, 1).view(2, 3, 11)

    def loss_then_logits(g, gl, z, t, lse):
        return ceb(g, z, t, lse, -100, 0.0, 1).view(2, 3, 11) + gl

    for fn in (logits_then_loss, loss_then_logits):
        args = (torch.randn(()), torch.randn(2, 3, 11), z, t, lse)
        gm, ctx, ref, got = _fold(fn, *args)
        assert ctx.fired == {"fold_logits_grad": 1}, fn.__name__
        assert aten.add.Tensor not in targets(gm)
        (n,) = [n for n in gm.graph.nodes if n.target is ceb.default]
        assert n.kwargs["grad_logits"] is not None
        assert max_rel_err(got[0], ref[0]) < 1e-6


def test_fires_through_a_chain_of_views():
    """unpad's packed logits: the loss backward reaches the add through two views, and the other operand
    is the gathered tangent (here an expand to its own shape)."""
    z, t, lse = _saved()

    def fn(g, gl, z, t, lse):
        return ceb(g, z, t, lse, -100, 0.0, 1).view(6, 11).reshape(6, 11) + gl.expand(6, 11)

    gm, ctx, ref, got = _fold(fn, torch.randn(()), torch.randn(6, 11), z, t, lse)
    assert ctx.fired == {"fold_logits_grad": 1}
    assert aten.add.Tensor not in targets(gm)
    assert max_rel_err(got[0], ref[0]) < 1e-6


def test_fires_without_a_view():
    z, t, lse = _saved()

    def fn(g, gl, z, t, lse):  # sequence classification: [B, num_labels] logits, no view
        return ceb(g, z, t, lse, -100, 0.0, 0) + gl

    args = (torch.randn(6), torch.randn(6, 11), z, t, lse)
    gm, ctx, ref, got = _fold(fn, *args)
    assert ctx.fired == {"fold_logits_grad": 1}
    assert max_rel_err(got[0], ref[0]) < 1e-6


def test_near_misses_are_left_alone():
    z, t, lse = _saved()

    def scaled(g, gl, z, t, lse):
        return torch.add(gl, ceb(g, z, t, lse, -100, 0.0, 1), alpha=2.0)

    def read_twice(g, gl, z, t, lse):
        d = ceb(g, z, t, lse, -100, 0.0, 1)
        return gl + d, d

    def broadcasting(g, gl, z, t, lse):
        return gl[:1] + ceb(g, z, t, lse, -100, 0.0, 1)

    def view_read_twice(g, gl, z, t, lse):  # a view in the chain has another reader
        v = ceb(g, z, t, lse, -100, 0.0, 1).view(2, 3, 11)
        return gl.view(2, 3, 11) + v.view(2, 3, 11), v

    for fn, missed in ((scaled, 1), (read_twice, 0), (broadcasting, 1), (view_read_twice, 0)):
        gm, ctx, ref, got = _fold(fn, torch.randn(()), torch.randn(6, 11), z, t, lse)
        assert ctx.fired == {}, fn.__name__
        assert aten.add.Tensor in targets(gm), fn.__name__
        assert len(ctx.missed) == missed, (fn.__name__, ctx.missed)

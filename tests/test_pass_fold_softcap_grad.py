"""The fold_softcap_grad pass (passes/backward/fold_softcap_grad.py): ``softcap_backward(view(
cross_entropy_backward(..., c)), c, cap)`` becomes ``view(cross_entropy_backward(..., softcap=cap))`` on
hand-built backward graphs, where the loss's logits are the cap's output through views or as two saved
tensors sharing one storage, with the same values; it is left alone where the logits are another tensor
(equal values in another storage included: nothing proves them equal) or the loss gradient has another
reader. The end-to-end case (Gemma 2) is in test_pass_softcap.py."""

from __future__ import annotations

import torch
from conftest import max_rel_err, run_pass, targets, trace_fake

from dmfx.passes.backward.fold_softcap_grad import fold_softcap_grad

ce, ceb = torch.ops.dmfx.cross_entropy, torch.ops.dmfx.cross_entropy_backward
softcap_backward = torch.ops.dmfx.softcap_backward
CAP = 2.0


def _saved(B=2, L=3, V=11):
    c = torch.ops.dmfx.softcap(3 * torch.randn(B, L, V), CAP)  # the cap's output: the loss's logits
    t = torch.randint(0, V, (B * L,))
    t[0] = -100
    return c, t, ce(c.view(-1, V), t, -100, 0.0, 1)[1]


def _fold(fn, *args):
    gm = trace_fake(fn, *args)
    ref, got, ctx = run_pass(gm, fold_softcap_grad, *args)
    return gm, ctx, ref, got


def _folded(gm):
    return [n for n in gm.graph.nodes if n.target is ceb.default and n.kwargs.get("softcap")]


def test_fires_where_the_losss_logits_are_the_caps_output_through_a_view():
    c, t, lse = _saved()

    def fn(g, gl, c, t, lse):  # HF: the returned logits' tangent folded in by fold_logits_grad
        d = ceb(g, c.view(6, 11), t, lse, -100, 0.0, 1, grad_logits=gl.view(6, 11))
        return (softcap_backward(d.view(2, 3, 11), c, CAP),)

    gm, ctx, ref, got = _fold(fn, torch.randn(()), torch.randn(2, 3, 11), c, t, lse)
    assert ctx.fired == {"fold_softcap_grad": 1}, ctx.missed
    assert softcap_backward.default not in targets(gm)
    (n,) = _folded(gm)
    grad_logits = n.kwargs["grad_logits"] if "grad_logits" in n.kwargs else n.args[7]
    assert n.kwargs["softcap"] == CAP and grad_logits is not None
    assert max_rel_err(got[0], ref[0]) < 1e-6


def test_fires_for_two_saved_tensors_of_one_storage():
    """After the partition the cap's output and the loss's [N, V] view of it are two saved tensors: their
    fake values share one storage, which the fold reads."""
    c, t, lse = _saved()

    def fn(g, c, c2d, t, lse):
        return (softcap_backward(ceb(g, c2d, t, lse, -100, 0.0, 1).view(2, 3, 11), c, CAP),)

    gm, ctx, ref, got = _fold(fn, torch.randn(()), c, c.view(6, 11), t, lse)
    assert ctx.fired == {"fold_softcap_grad": 1}, ctx.missed
    assert max_rel_err(got[0], ref[0]) < 1e-6


def test_left_alone_where_the_logits_are_another_tensor_or_the_gradient_is_read_twice():
    c, t, lse = _saved()

    def other_storage(g, c, c2d, t, lse):  # equal values, another storage: not provably the same
        return (softcap_backward(ceb(g, c2d, t, lse, -100, 0.0, 1).view(2, 3, 11), c, CAP),)

    gm, ctx, ref, got = _fold(other_storage, torch.randn(()), c, c.view(6, 11).clone(), t, lse)
    assert not ctx.fired and _folded(gm) == []
    assert any("not the soft cap's output" in m for m in ctx.missed), ctx.missed
    assert max_rel_err(got[0], ref[0]) < 1e-6

    def read_twice(g, c, t, lse):  # the capped logits' gradient is also an output
        d = ceb(g, c.view(6, 11), t, lse, -100, 0.0, 1)
        return softcap_backward(d.view(2, 3, 11), c, CAP), d

    gm, ctx, ref, got = _fold(read_twice, torch.randn(()), c, t, lse)
    assert not ctx.fired and softcap_backward.default in targets(gm)
    assert all(max_rel_err(a, b) < 1e-6 for a, b in zip(got, ref))

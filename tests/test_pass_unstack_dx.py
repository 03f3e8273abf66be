"""The unstack_dx pass (passes/backward/unstack_dx.py): the dX GEMM of stacked Q/K/V projections
becomes three accumulating GEMMs reading the weights themselves, with the same values; near-misses
are left alone."""

from __future__ import annotations

import pytest
import torch
from conftest import max_rel_err, run_pass, targets, trace_fake

from dmfx.passes import PassContext

aten = torch.ops.aten


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("layout", ["rows", "cols"])
def test_unstack_dx_fires_and_keeps_values(accumulate, layout):
    """G · cat(Wq, Wk, Wv) (rows: cat of [out, in] weights along 0; cols: the transpose of a cat of
    [in, out] ones along 1) -> one GEMM per weight block, accumulating."""
    from dmfx.passes.backward import unstack_dx

    torch.manual_seed(0)
    ws = [torch.randn(8, 6) for _ in range(3)]
    G, acc = torch.randn(5, 24), torch.randn(5, 6)

    def f(G, acc, w0, w1, w2):
        W = torch.cat([w0, w1, w2], 0) if layout == "rows" else torch.cat([w0.t(), w1.t(), w2.t()], 1).t()
        return torch.addmm(acc, G, W) if accumulate else G @ W

    gm = trace_fake(f, G, acc, *ws)
    if accumulate:  # as accumulate_into_gemm leaves it: an in-place accumulation into a fresh buffer
        for n in gm.graph.nodes:
            if n.target is aten.addmm.default:
                n.target = aten.addmm_.default
    gm.recompile()
    ref = f(G, acc, *ws)
    ctx = PassContext()
    unstack_dx(gm, ctx)
    gm.graph.lint()
    gm.recompile()
    got = gm(G, acc.clone(), *ws)
    assert ctx.fired == {"unstack_dx": 1}
    ts = targets(gm)
    assert aten.cat.default not in ts
    assert ts.count(aten.addmm_.default) == (3 if accumulate else 2)
    assert max_rel_err(got, ref) < 1e-6


def test_unstack_dx_leaves_near_misses():
    """cat(ws, 1) read without a transpose: its blocks are column blocks, not what G's columns
    multiply; and a concatenation that another op reads too."""
    from dmfx.passes.backward import unstack_dx

    ws = [torch.randn(24, 4) for _ in range(3)]
    gm = trace_fake(lambda G, a, b, c: G @ torch.cat([a, b, c], 1), torch.randn(5, 24), *ws)
    _, _, ctx = run_pass(gm, unstack_dx, torch.randn(5, 24), *ws)
    assert not ctx.fired and aten.cat.default in targets(gm)

    # a concatenation read elsewhere too stays: splitting the GEMM would not remove it
    ws = [torch.randn(8, 6) for _ in range(3)]

    def shared(G, a, b, c):
        W = torch.cat([a, b, c], 0)
        return G @ W, W.sum()

    gm = trace_fake(shared, torch.randn(5, 24), *ws)
    _, _, ctx = run_pass(gm, unstack_dx, torch.randn(5, 24), *ws)
    assert not ctx.fired and aten.mm.default in targets(gm)

"""The pass pipelines as a whole (passes/__init__.py, passes/backward/): the backward pipeline on a
traced backward and on a BertLayer's (no gradient add left, gradients equal eager's, skipping the
passes brings the adds back), and the pass names options={"skip": ...} accepts."""

from __future__ import annotations

import pytest
import torch
from conftest import compiled_step_matches_eager, layer_norm_saved, max_rel_err, targets, tiny_bert_layer, trace_fake

import dmfx
from dmfx.passes import PassContext
from dmfx.passes.backward import run_backward_pipeline

aten = torch.ops.aten
nb = torch.ops.dmfx.norm_backward


def test_backward_pipeline_keeps_values_on_a_traced_backward():
    """run_backward_pipeline on a whole traced graph: same values, graph lints."""
    x, w, mean, rstd = layer_norm_saved()

    def f(g1, g2, x, w, mean, rstd, a, wt):
        d = nb(g1 + g2, None, x, None, None, w, mean, rstd, None, 0.0, False, [True, False, True, True, False])
        return d[0] + (a @ wt.t()).view(2, 6, 16), d[2], d[3]

    args = (torch.randn_like(x), torch.randn_like(x), x, w, mean, rstd, torch.randn(12, 8), torch.randn(16, 8))
    gm = trace_fake(f, *args)
    ref = gm(*args)
    ctx = PassContext()
    run_backward_pipeline(gm, ctx)
    assert ctx.fired == {"fold_gradient_adds": 1, "accumulate_into_gemm": 1}
    for a, b in zip(gm(*args), ref):
        assert max_rel_err(a, b) < 1e-5


@pytest.mark.parametrize("stack", [True, False])
def test_bert_layer_backward_has_no_gradient_adds(stack):
    layer, ref = tiny_bert_layer()
    # (flash: the packed attention ops that QKV stacking needs; SDPA would leave three projections)
    compiled_step_matches_eager(layer, ref, {"fallback": False, "stack_qkv": stack, "attention": "flash"})
    (rec,) = dmfx.records()
    bw = targets(rec.backward_graph)
    assert aten.add.Tensor not in bw, rec.backward_graph.code
    assert rec.fired.get("fold_gradient_adds") == 1
    assert rec.fired.get("qkv_attention", 0) == int(stack)
    assert rec.fired.get("accumulate_into_gemm") == (1 if stack else 3)
    # the Q/K/V bias gradients come out of the attention backward (one stacked, or three): no
    # reduction is left
    assert rec.fired.get("fold_bias_grads", 0) == (1 if stack else 3)
    sums = bw.count(aten.sum.dim_IntList)
    assert sums == 0, rec.backward_graph.code
    # the stacked weight is neither kept for the backward nor concatenated again there: dX reads the
    # three weights (unstack_dx)
    assert rec.fired.get("unstack_dx", 0) == int(stack)
    assert aten.cat.default not in bw
    saved = [n.meta["val"].shape for n in rec.backward_graph.graph.nodes if n.op == "placeholder"]
    assert not any(tuple(s) in {(96, 32), (32, 96)} for s in saved), saved


def test_skipping_the_backward_passes_keeps_the_adds():
    layer, _ = tiny_bert_layer()
    f = torch.compile(layer, backend="dmfx", options={"fallback": False, "stack_qkv": False,
                                                      "skip": ["fold_gradient_adds", "accumulate_into_gemm",
                                                               "fold_bias_grads"]})
    x = torch.randn(2, 9, 32, requires_grad=True)
    f(x)[0].sum().backward()
    (rec,) = dmfx.records()
    assert targets(rec.backward_graph).count(aten.add.Tensor) == 4
    assert "fold_gradient_adds" not in rec.fired


def test_unknown_pass_name_lists_the_backward_passes():
    from dmfx.options import Options

    with pytest.raises(ValueError, match="fold_gradient_adds, fold_bias_grads, accumulate_into_gemm"):
        Options.from_user({"skip": ["nope"]})
    assert Options.from_user({"skip": "accumulate_into_gemm"}).skip == ("accumulate_into_gemm",)

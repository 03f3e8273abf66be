"""The qkv_attention pass (passes/qkv_attention.py, the paper's QKV stacking): the Q, K and V
projections of one input feeding a dmfx attention become one GEMM over the stacked weight and the
packed attention op; projections read elsewhere or of different inputs are left alone; in training
the gradients equal eager's and the stacked weight follows every optimizer step."""

import pytest
import torch
import torch.nn.functional as F
from conftest import check_same, count, rel_err, rewrite, targets, tiny_bert_layer
from test_pass_attention import B, E, L, _heads, _params, _SelfAttention, bert_self_attention

import dmfx

dmfx_ops = torch.ops.dmfx
aten = torch.ops.aten


FORMS = {"gemm": dmfx_ops.qkv_attention, "flash": dmfx_ops.qkv_flash_attention}


@pytest.mark.parametrize("form", ["gemm", "flash"])
def test_self_attention_becomes_one_stacked_gemm_and_one_attention_op(form):
    args = _params()
    gm, ctx = rewrite(bert_self_attention, *args, attention=form)
    assert ctx.fired.get("attention") == 1 and ctx.fired.get("qkv_attention") == 1, (ctx.fired, ctx.missed)
    assert count(gm, FORMS[form]) == 1 and count(gm, dmfx_ops.attention) == 0
    assert aten.bmm.default not in targets(gm) and aten.clone.default not in targets(gm)
    assert count(gm, aten.addmm) == 1  # Q, K and V in one GEMM
    (cat,) = [n for n in gm.graph.nodes if n.target is aten.cat.default and n.meta["val"].dim() == 2]
    assert tuple(cat.meta["val"].shape) == (3 * E, E)
    check_same(bert_self_attention, gm, *args)


def test_projection_read_elsewhere_is_not_stacked():
    """A KV cache returns k: the three GEMMs stay, attention still fuses, the miss is logged."""
    args = _params()

    def fn(x, wq, bq, wk, bk, wv, bv, mask):
        k = F.linear(x, wk, bk)
        q, kh, v = _heads(F.linear(x, wq, bq)), _heads(k), _heads(F.linear(x, wv, bv))
        p = torch.softmax(q @ kh.transpose(-1, -2) + mask, -1)
        return (p @ v).transpose(1, 2).reshape(B, L, E), k

    gm, ctx = rewrite(fn, *args, attention="flash")
    assert ctx.fired.get("attention") == 1 and "qkv_attention" not in ctx.fired
    assert any("qkv_attention" in m for m in ctx.missed)
    check_same(fn, gm, *args)


def test_different_inputs_are_not_stacked():
    x, wq, bq, wk, bk, wv, bv, mask = _params()
    y = torch.randn(B, L, E)

    def fn(x, y, wq, wk, wv):  # cross-attention: k and v read y
        q, k, v = _heads(F.linear(x, wq)), _heads(F.linear(y, wk)), _heads(F.linear(y, wv))
        return torch.softmax(q @ k.transpose(-1, -2), -1) @ v

    gm, ctx = rewrite(fn, x, y, wq, wk, wv, attention="gemm")
    assert ctx.fired.get("attention") == 1 and "qkv_attention" not in ctx.fired
    assert any("same input" in m for m in ctx.missed)
    check_same(fn, gm, x, y, wq, wk, wv)


@pytest.mark.parametrize("form", ["gemm", "flash"])
@pytest.mark.parametrize("bias", [True, False])
def test_training_matches_eager_and_backward_has_no_copies(bias, form):
    torch.manual_seed(0)
    model = _SelfAttention(bias=bias)
    ref = _SelfAttention(bias=bias)
    ref.load_state_dict(model.state_dict())
    x = torch.randn(B, L, E, requires_grad=True)
    mask = _params()[-1]
    out = torch.compile(model, backend="dmfx", options={"attention": form})(x, mask)
    out.square().sum().backward()
    gx, x.grad = x.grad, None
    ref(x, mask).square().sum().backward()
    assert rel_err(gx, x.grad) < 1e-5
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        # (k's bias gets a zero gradient, softmax being shift-invariant: compare absolutely)
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=name)
    (rec,) = dmfx.records()
    assert rec.fired.get("qkv_attention") == 1
    assert [f for f, _ in rec.attention_forms.values()] == [form]
    for graph in (rec.forward_graph, rec.backward_graph):
        ops = targets(graph)
        assert aten.clone.default not in ops and aten.bmm.default not in ops
    # the stacked bias gradient is one reduction (gemm form) or comes out of the fused attention
    # backward (flash form, passes/backward/fold_bias_grads.py); dX is one GEMM
    sums = sum(1 for t in targets(rec.backward_graph) if t is aten.sum.dim_IntList)
    assert sums == (2 if bias and form == "gemm" else 1)
    assert rec.fired.get("fold_bias_grads", 0) == int(bias and form == "flash")


def test_optimizer_steps_are_seen_by_the_stacked_weight():
    """The stacked weight is built from the parameters inside the graph: after an optimizer step the
    next forward uses the new values (no stale copy)."""
    torch.manual_seed(0)
    model = _SelfAttention()
    ref = _SelfAttention()
    ref.load_state_dict(model.state_dict())
    opt, opt_ref = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    compiled = torch.compile(model, backend="dmfx", options={"attention": "flash"})
    x, mask = torch.randn(B, L, E), _params()[-1]
    for _ in range(3):
        for m, o in ((compiled, opt), (ref, opt_ref)):
            o.zero_grad()
            m(x, mask).square().mean().backward()
            o.step()
    with torch.no_grad():
        assert rel_err(compiled(x, mask), ref(x, mask)) < 1e-5
        model.q.weight.mul_(2.0)  # an in-place change outside any optimizer
        ref.q.weight.mul_(2.0)
        assert rel_err(compiled(x, mask), ref(x, mask)) < 1e-5


@pytest.mark.parametrize("form", ["flash", "gemm"])
def test_dynamic_shapes_stacked_attention(form):
    """A dynamic sequence length (mark_dynamic): the stacked projection's view takes the SymInt batch
    and length from the graph; new lengths run without recompiling and match eager."""
    layer, ref = tiny_bert_layer()
    f = torch.compile(layer, backend="dmfx", options={"attention": form, "stack_qkv": True, "fallback": False})
    for length in (9, 13, 30):
        x = torch.randn(2, length, 32, requires_grad=True)
        torch._dynamo.mark_dynamic(x, 1)
        R = torch.randn(2, length, 32)  # (a LayerNorm output's squared sum is constant: no gradient to compare)
        out = f(x)[0]
        (out * R).sum().backward()
        gx, x.grad = x.grad, None
        exp = ref(x)[0]
        (exp * R).sum().backward()
        assert rel_err(out, exp) < 1e-5 and rel_err(gx, x.grad) < 1e-5
    recs = dmfx.records()
    assert len(recs) == 1 and recs[0].fired.get("qkv_attention") == 1, [r.summary() for r in recs]

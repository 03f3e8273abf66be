"""The bias_act_dropout fusion (passes/bias_act_dropout.py, the paper's BRD): linear bias + activation
+ dropout become dmfx::bias_act_dropout, the bias taken out of addmm; a lone activation and a linear
read elsewhere are left alone."""

import pytest
import torch
import torch.nn.functional as F
from conftest import check_same, count, rel_err, rewrite, targets
from test_pass_activation_idioms import gpt2_gelu, quick_gelu, relu_squared

dmfx_ops = torch.ops.dmfx
aten = torch.ops.aten


@pytest.mark.parametrize("act", ["gelu", "gelu_tanh", "relu", "silu", "tanh", "gpt2", "quick_gelu", "relu_squared"])
def test_bias_activation_after_linear_splits_the_bias(act):
    fns = {
        "quick_gelu": quick_gelu,  # CLIP's (activation_idioms makes it one op first)
        "relu_squared": relu_squared,
        "gelu": F.gelu,
        "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
        "relu": F.relu,
        "silu": F.silu,
        "tanh": torch.tanh,  # BERT's pooler
        "gpt2": gpt2_gelu,
    }
    fn = lambda x, w, b: fns[act](F.linear(x, w, b))  # noqa: E731
    x, w, b = torch.randn(2, 5, 16), torch.randn(24, 16), torch.randn(24)
    gm, ctx = rewrite(fn, x, w, b)
    assert ctx.fired.get("bias_act_dropout") == 1, ctx.fired
    assert aten.addmm.default not in targets(gm) and count(gm, aten.mm) == 1
    (f,) = [n for n in gm.graph.nodes if n.target is dmfx_ops.bias_act_dropout.default]
    assert f.args[2] == {"gpt2": "gelu_tanh"}.get(act, act)
    check_same(fn, gm, x, w, b)


@pytest.mark.parametrize("act", ["quick_gelu", "relu_squared"])
@pytest.mark.parametrize("bias", [True, False])
def test_an_idiom_activation_takes_its_dropout(act, bias):
    """The activation idioms made into one dmfx op take the bias (if any) and the dropout after them,
    as aten.gelu does: one bias_act_dropout, the idiom's record taken over."""
    f_act = {"quick_gelu": quick_gelu, "relu_squared": relu_squared}[act]
    fn = lambda x, w, b: F.dropout(f_act(F.linear(x, w, b if bias else None)), 0.25, training=True)  # noqa: E731
    x, w, b = torch.randn(3, 7, 16, requires_grad=True), torch.randn(24, 16), torch.randn(24)
    gm, ctx = rewrite(fn, x, w, b)
    assert ctx.fired.get("bias_act_dropout") == 1 and f"{act}_idiom" not in ctx.fired, ctx.fired
    (f,) = [n for n in gm.graph.nodes if n.target is dmfx_ops.bias_act_dropout.default]
    assert f.args[2] == act and f.args[4] == pytest.approx(0.25) and (f.args[1] is not None) == bias
    assert aten.native_dropout.default not in targets(gm) and aten.sigmoid.default not in targets(gm)
    out = gm(x, w, b)[0]
    ref = f_act(F.linear(x, w, b if bias else None))
    kept = out != 0  # the kernel's mask: kept elements are the activation scaled by 1 / (1 - p)
    assert 0.6 < kept[ref != 0].float().mean() < 0.9
    assert rel_err(out, torch.where(kept, ref / 0.75, 0.0)) < 1e-5


def test_bias_dropout_without_activation():
    fn = lambda x, w, b: F.dropout(F.linear(x, w, b), 0.2, training=True) * 3  # noqa: E731
    x, w, b = torch.randn(2, 5, 16), torch.randn(24, 16), torch.randn(24)
    gm, ctx = rewrite(fn, x, w, b)
    (f,) = [n for n in gm.graph.nodes if n.target is dmfx_ops.bias_act_dropout.default]
    assert f.args[2] == "identity" and f.args[4] == pytest.approx(0.2)
    assert aten.native_dropout.default not in targets(gm)


def test_lone_activation_is_left_to_pytorch():
    x = torch.randn(4, 16)
    gm, ctx = rewrite(F.gelu, x)
    assert "bias_act_dropout" not in ctx.fired and aten.gelu.default in targets(gm)


def test_linear_output_read_elsewhere_keeps_its_bias():
    def fn(x, w, b):
        h = F.linear(x, w, b)
        return F.gelu(h), h

    x, w, b = torch.randn(5, 16), torch.randn(24, 16), torch.randn(24)
    gm, ctx = rewrite(fn, x, w, b)
    assert aten.addmm.default in targets(gm)
    check_same(fn, gm, x, w, b)

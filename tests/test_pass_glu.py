"""The glu fusion (passes/glu.py): act(gate) * up (SwiGLU, GeGLU) becomes dmfx::glu; a broadcast
product is left alone."""

import pytest
import torch
import torch.nn.functional as F
from conftest import check_same, rewrite

dmfx_ops = torch.ops.dmfx


@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh"])
def test_swiglu_geglu(act):
    a = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}[act]

    def mlp(x, wg, wu, wd):  # LLaMA: down(act(gate(x)) * up(x))
        return F.linear(a(F.linear(x, wg)) * F.linear(x, wu), wd)

    x, wg, wu, wd = torch.randn(2, 5, 16), torch.randn(24, 16), torch.randn(24, 16), torch.randn(16, 24)
    gm, ctx = rewrite(mlp, x, wg, wu, wd)
    assert ctx.fired.get("glu") == 1
    (g,) = [n for n in gm.graph.nodes if n.target is dmfx_ops.glu.default]
    assert g.args[2] == act
    check_same(mlp, gm, x, wg, wu, wd)


def test_stacked_gate_up_halves():
    def fn(x):
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    x = torch.randn(3, 5, 32)
    gm, ctx = rewrite(fn, x)
    assert ctx.fired.get("glu") == 1
    check_same(fn, gm, x)


def test_glu_with_broadcast_is_left_alone():
    fn = lambda g, u: F.silu(g) * u  # noqa: E731
    g, u = torch.randn(3, 16), torch.randn(16)
    gm, ctx = rewrite(fn, g, u)
    assert "glu" not in ctx.fired
    check_same(fn, gm, g, u)

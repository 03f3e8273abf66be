"""The activation_idioms fusion (passes/activation_idioms.py): GPT-2's tanh-GELU written out becomes
one aten.gelu; QuickGELU and the squared ReLU become dmfx's activation alone; near-misses are left."""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import check_same, rel_err, rewrite, targets

aten = torch.ops.aten


def gpt2_gelu(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def test_gelu_tanh_idiom_becomes_one_op():
    x = torch.randn(4, 33)
    gm, ctx = rewrite(gpt2_gelu, x)
    assert ctx.fired.get("gelu_tanh_idiom") == 1
    assert aten.tanh.default not in targets(gm) and aten.pow.Tensor_Scalar not in targets(gm)
    check_same(gpt2_gelu, gm, x)


def quick_gelu(x):  # HF's QuickGELUActivation (CLIP)
    return x * torch.sigmoid(1.702 * x)


def relu_squared(x):  # HF's ReLUSquaredActivation (Nemotron)
    return torch.square(torch.relu(x))


def _relu_times_itself(x):
    r = F.relu(x)
    return r * r


@pytest.mark.parametrize("act", ["quick_gelu", "relu_squared", "relu_times_itself", "relu_pow"])
def test_activations_aten_lacks_become_dmfxs_activation_alone(act):
    fn = {"quick_gelu": quick_gelu, "relu_squared": relu_squared, "relu_times_itself": _relu_times_itself,
          "relu_pow": lambda x: torch.pow(F.relu(x), 2.0)}[act]
    name = "quick_gelu" if act == "quick_gelu" else "relu_squared"
    x = torch.randn(4, 33, requires_grad=True)
    gm, ctx = rewrite(fn, x)
    assert ctx.fired.get(f"{name}_idiom") == 1, ctx.fired
    (f,) = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert f.target is torch.ops.dmfx.bias_act_dropout.default and f.args[1:] == (None, name, None, 0.0)
    check_same(fn, gm, x)
    # its gradient (the op's autograd formula: one backward kernel)
    R = torch.randn(4, 33)
    (want,) = torch.autograd.grad((fn(x) * R).sum(), x)
    (got,) = torch.autograd.grad((gm(x)[0] * R).sum(), x)
    assert rel_err(got, want) < 1e-5


def _sigmoid_read_twice(x, y):
    s = torch.sigmoid(1.702 * x)
    return x * s, s + y


def _relu_read_twice(x, y):
    r = F.relu(x)
    return torch.square(r), r + y


NEAR_MISSES = {
    "other_scale": lambda x, y: x * torch.sigmoid(1.5 * x),  # recorded as a near-miss
    "sigmoid_read_twice": _sigmoid_read_twice,
    "other_tensor": lambda x, y: y * torch.sigmoid(1.702 * x),
    "relu_cubed": lambda x, y: torch.pow(F.relu(x), 3.0),
    "relu_read_twice": _relu_read_twice,
    "relu_times_other": lambda x, y: F.relu(x) * y,
}


@pytest.mark.parametrize("case", list(NEAR_MISSES))
def test_near_misses_of_quick_gelu_and_relu_squared_are_left(case):
    fn = NEAR_MISSES[case]
    x, y = torch.randn(4, 33), torch.randn(4, 33)
    gm, ctx = rewrite(fn, x, y)
    assert torch.ops.dmfx.bias_act_dropout.default not in targets(gm), case
    assert not {"quick_gelu_idiom", "relu_squared_idiom"} & set(ctx.fired)
    if case == "other_scale":
        assert any("1.5" in m and "quick_gelu_idiom" in m for m in ctx.missed), ctx.missed
    check_same(fn, gm, x, y)

"""The activation_idioms fusion (passes/activation_idioms.py): GPT-2's tanh-GELU written out becomes
one aten.gelu."""

import math

import torch
from conftest import check_same, rewrite, targets

aten = torch.ops.aten


def gpt2_gelu(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def test_gelu_tanh_idiom_becomes_one_op():
    x = torch.randn(4, 33)
    gm, ctx = rewrite(gpt2_gelu, x)
    assert ctx.fired.get("gelu_tanh_idiom") == 1
    assert aten.tanh.default not in targets(gm) and aten.pow.Tensor_Scalar not in targets(gm)
    check_same(gpt2_gelu, gm, x)

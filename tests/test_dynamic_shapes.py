"""``torch.compile(dynamic=True)`` keeps dmfx's fusions.

Under dynamic=True Dynamo passes floats it would otherwise bake in (``math.pi`` in GPT-2's
tanh-GELU, a module's ``self.scaling``) as graph inputs. dmfx reads such a float as the constant a
pattern needs only with a guard (graph_utils.number_near), so a changed value recompiles instead of
giving a wrong answer; a residual broadcast over symbolic sizes still fuses; and each compiled
graph has one record although Dynamo restarts its analysis once."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import rel_err

import dmfx

transformers = pytest.importorskip("transformers")
from dmfx.models import small_model  # noqa: E402


class TanhGeluMLP(torch.nn.Module):
    """GPT-2's MLP with transformers' NewGELUActivation: ``0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715
    x^3)))``, ``math.pi`` read from transformers' module (Dynamo lifts it to a graph input there)."""

    def __init__(self, h=32):
        super().__init__()
        from transformers.activations import NewGELUActivation

        self.up, self.act, self.down = torch.nn.Linear(h, 4 * h), NewGELUActivation(), torch.nn.Linear(4 * h, h)

    def forward(self, x):
        return self.down(self.act(self.up(x)))


class AttributeGelu(torch.nn.Module):
    """The tanh-GELU with its coefficient a module attribute (a float input under dynamic=True)."""

    def __init__(self, h=32):
        super().__init__()
        self.up = torch.nn.Linear(h, 4 * h)
        self.c = math.sqrt(2.0 / math.pi)

    def forward(self, x):
        y = self.up(x)
        return 0.5 * y * (1.0 + torch.tanh(self.c * (y + 0.044715 * torch.pow(y, 3.0))))


class ScaledAttention(torch.nn.Module):
    """Attention scaled by a module attribute, as HF writes ``attn_weights * self.scaling``."""

    def __init__(self, h=32, heads=4, scaling=None):
        super().__init__()
        self.heads, self.d = heads, h // heads
        self.q, self.k, self.v = (torch.nn.Linear(h, h) for _ in range(3))
        self.scaling = self.d ** -0.5 if scaling is None else scaling

    def forward(self, x):
        B, L, H = x.shape
        q, k, v = (f(x).view(B, L, self.heads, self.d).transpose(1, 2) for f in (self.q, self.k, self.v))
        w = torch.softmax(torch.matmul(q, k.transpose(-1, -2)) * self.scaling, dim=-1)
        return torch.matmul(w, v).transpose(1, 2).reshape(B, L, H)


def _tensor(out):
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out


def _compile_and_run(model, inputs, dynamic, train):
    torch._dynamo.reset()
    dmfx.reset()
    f = torch.compile(model, backend="dmfx", dynamic=dynamic)
    call = (lambda: f(**inputs)) if isinstance(inputs, dict) else (lambda: f(inputs))
    if train:
        out = _tensor(call())
        (out * torch.randn_like(out)).sum().backward()
    else:
        with torch.no_grad():
            out = _tensor(call())
    return f, out, dmfx.records()


def test_math_pi_under_dynamic_true_is_read_as_a_constant():
    torch.manual_seed(0)
    m = TanhGeluMLP()
    x = torch.randn(2, 7, 32)
    _, _, static = _compile_and_run(m, x, dynamic=False, train=False)
    _, out, dynamic = _compile_and_run(m, x, dynamic=True, train=False)
    assert [r.fired for r in dynamic] == [r.fired for r in static]
    assert dynamic[0].fired.get("bias_act_dropout") == 1
    with torch.no_grad():
        assert rel_err(out, m(x)) < 1e-5


def test_a_float_input_read_as_a_constant_is_guarded():
    """The coefficient is a module attribute: read as the tanh-GELU's constant, it must be guarded,
    so changing it gives the new answer (a recompile), never the fused GELU's."""
    torch.manual_seed(0)
    m = AttributeGelu()
    x = torch.randn(2, 7, 32)
    f, out, records = _compile_and_run(m, x, dynamic=True, train=False)
    assert records[-1].fired.get("bias_act_dropout") == 1
    with torch.no_grad():
        assert rel_err(out, m(x)) < 1e-5
        m.c = 0.3  # no longer GELU's constant
        assert rel_err(f(x), m(x)) < 1e-5
        assert "bias_act_dropout" not in dmfx.records()[-1].fired  # recompiled, and not fused


def test_attention_scale_input_is_guarded_and_folded():
    torch.manual_seed(0)
    m = ScaledAttention()
    x = torch.randn(2, 9, 32)
    f, out, records = _compile_and_run(m, x, dynamic=True, train=False)
    assert records[-1].fired.get("attention") == 1
    with torch.no_grad():
        assert rel_err(out, m(x)) < 1e-5
        m.scaling = 0.7
        assert rel_err(f(x), m(x)) < 1e-5  # the guard recompiled


def test_other_run_time_scales_stay_run_time():
    """A scale that is not 1/sqrt(head_dim) (a temperature) is not guarded: it stays an input, and a
    new value needs no recompile."""
    torch.manual_seed(0)
    m = ScaledAttention(scaling=0.123)
    x = torch.randn(2, 9, 32)
    f, out, records = _compile_and_run(m, x, dynamic=True, train=False)
    with torch.no_grad():
        assert rel_err(out, m(x)) < 1e-5
        n = len(dmfx.records())
        m.scaling = 0.456
        assert rel_err(f(x), m(x)) < 1e-5
        assert len(dmfx.records()) == n  # no recompile


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
def test_gpt2_fuses_the_same_under_dynamic_true(train):
    torch.manual_seed(0)
    model = small_model("gpt2", attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    model.train(train)
    inputs = {"input_ids": torch.randint(0, 100, (2, 16)), "use_cache": False}
    ref = model(**inputs).last_hidden_state
    _, _, static = _compile_and_run(model, inputs, dynamic=False, train=train)
    model.zero_grad(set_to_none=True)
    _, out, dynamic = _compile_and_run(model, inputs, dynamic=True, train=train)
    # one record per compiled graph (Dynamo's restart to specialize a float leaves no second one)
    assert len(dynamic) == len(static) == 1, [r.summary() for r in dynamic]
    assert static[0].fired.get("bias_act_dropout") and static[0].fired.get("bias_dropout_residual_norm")
    # (the attention's form may differ: with static sizes GPT-2's causal mask is a constant the passes
    # evaluate, causal=True; under dynamic=True its sizes are symbols and it stays a mask tensor)
    form_dependent = {"attention", "attention_softmax", "qkv_attention", "noop_clones", "fold_bias_grads", "layout"}
    assert ({k: v for k, v in dynamic[0].fired.items() if k not in form_dependent}
            == {k: v for k, v in static[0].fired.items() if k not in form_dependent})
    assert dynamic[0].attention_forms and static[0].attention_forms
    assert rel_err(out.detach(), ref.detach()) < 1e-4


@pytest.mark.parametrize("family", ["t5", "llama"])
def test_norm_epsilons_are_specialized_under_dynamic_true(family):
    """HF's RMSNorm keeps eps as a module attribute, a float input under dynamic=True; dmfx's norm
    kernels take eps as a number, so every norm of the graph went unfused (and with it
    bias_dropout_residual_norm). dmfx now has Dynamo trace the graph again with the epsilons
    specialized (backend._specialize_norm_eps): the fusions are those of a static compile, sizes
    stay symbolic (another length compiles nothing), and a changed eps recompiles."""
    torch.manual_seed(0)
    model = small_model(family).train()
    ids = torch.randint(3, 100, (2, 16))
    inputs = {"input_ids": ids} if family == "t5" else {"input_ids": ids, "use_cache": False}
    options = {"fuse": "all", "fallback": False}
    fired = []
    for dynamic in (False, True):
        torch._dynamo.reset()
        dmfx.reset()
        f = torch.compile(model, backend="dmfx", dynamic=dynamic, options=options)
        got = f(**inputs).last_hidden_state
        (got * torch.randn_like(got)).sum().backward()
        (record,) = dmfx.records()
        fired.append(record.fired)
    norms = [{k: f.get(k) for k in ("rms_norm", "bias_dropout_residual_norm")} for f in fired]
    # (the norms only: on torch 2.11, T5's attention under dynamic=True fuses its softmax alone, with or
    # without this change: its scores reach the softmax through more than a batched GEMM there)
    assert norms[1] == norms[0] and all(norms[1].values()), fired
    assert not [m for m in record.missed if m.startswith("norms:")], record.missed
    # (the calls below run with grad on, as the compiled one did: no_grad would be another graph)
    assert rel_err(got, model(**inputs).last_hidden_state) < 1e-5
    other = {**inputs, "input_ids": torch.randint(3, 100, (2, 11))}
    assert rel_err(f(**other).last_hidden_state, model(**other).last_hidden_state) < 1e-5
    assert len(dmfx.records()) == 1  # (the new length ran the same symbolic graph)
    for m in model.modules():
        if hasattr(m, "variance_epsilon"):
            m.variance_epsilon = 0.25  # far from 1e-6: a graph that kept the old one is wrong
    assert rel_err(f(**other).last_hidden_state, model(**other).last_hidden_state) < 1e-5
    assert len(dmfx.records()) == 2  # the guard on eps recompiled


def test_shapes_compare_without_guarding_on_a_data_dependent_size():
    """Under option unpad a backward graph's token dim is T, the real tokens' count, an unbacked SymInt:
    ``(T, 64) != (128, 64)`` asks for T's value and fails the compile (GuardOnDataDependentSymNode;
    tests/test_unpad_graph_fuzz.py found it in plain_add). graph_utils.same_size and same_shape decide
    what is known (T == T) and call the rest different; backed sizes decide by their hints, as before."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from dmfx.passes.graph_utils import same_shape, same_size

    env = ShapeEnv()
    T = env.create_unbacked_symint()
    s = env.create_symintnode(env.create_symbol(8, source=ConstantSource("s")), hint=8)
    assert same_shape((T, 64), (T, 64)) and not same_shape((T, 64), (128, 64)) and not same_size(T, 128)
    assert not same_shape((T, 64), (T, 64, 1)) and same_shape((2, 3), [2, 3]) and not same_size(2, 3)
    assert same_size(s, 8) and not same_size(s, 9) and same_shape((s, T), (s, T))

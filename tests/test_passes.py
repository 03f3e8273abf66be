"""Each pass on small hand-built ATen graphs: it fires where it should and leaves near-misses alone."""

import pytest
import torch
import torch.nn.functional as F
from torch._guards import detect_fake_mode

from dmfx.backend import lower_to_aten

from dmfx.passes import PIPELINE, PassContext, run_pipeline

from conftest import rel_err

dmfx_ops = torch.ops.dmfx


def _as_tuple(fn):
    def g(*a):
        out = fn(*a)
        return out if isinstance(out, tuple) else (out,)

    return g


def rewrite(fn, *inputs, passes=None, **settings):
    """Lower `fn` (all tensors passed as inputs) to ATen like the backend does, run the dmfx passes,
    return (graph module, context). `settings` are PassContext fields (training, attention, ...)."""
    gm = lower_to_aten(_as_tuple(fn), inputs)  # exactly what the backend runs the passes on
    settings.setdefault("input_requires_grad", tuple(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs))
    ctx = PassContext(fake_mode=detect_fake_mode([n.meta.get("val") for n in gm.graph.nodes if "val" in n.meta]), **settings)
    skip = () if passes is None else tuple(n for n in PIPELINE if n not in passes)
    return run_pipeline(gm, ctx, skip), ctx


def targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def count(gm, op):
    return sum(1 for t in targets(gm) if t is op.default)


def check_same(fn, gm, *inputs, tol=1e-5):
    for a, b in zip(gm(*inputs), _as_tuple(fn)(*inputs)):
        assert rel_err(a, b) < tol


# --------------------------------------------------------------------------------- LayerNorm


def test_native_layer_norm_fires():
    fn = lambda x, w, b: F.layer_norm(x, (16,), w, b, 1e-6) * 2  # noqa: E731
    x, w, b = torch.randn(3, 5, 16), torch.randn(16), torch.randn(16)
    gm, ctx = rewrite(fn, x, w, b)
    assert count(gm, dmfx_ops.layer_norm) == 1 and torch.ops.aten.native_layer_norm.default not in targets(gm)
    assert ctx.fired == {"layer_norm": 1}
    check_same(fn, gm, x, w, b)


def test_layer_norm_over_two_dims_is_left_alone():
    fn = lambda x: F.layer_norm(x, (5, 16))  # noqa: E731
    gm, ctx = rewrite(fn, torch.randn(3, 5, 16))
    assert count(gm, dmfx_ops.layer_norm) == 0
    assert any("normalizes 2 dims" in m for m in ctx.missed)


def _hf_layer_norm(x, w, b, eps=1e-12):  # the TF-style LayerNorm some HF models write by hand
    u = x.mean(-1, keepdim=True)
    s = (x - u).pow(2).mean(-1, keepdim=True)
    x = (x - u) / torch.sqrt(s + eps)
    return w * x + b


def test_decomposed_layer_norm_fires():
    w, b, x = torch.randn(32), torch.randn(32), torch.randn(4, 32)
    gm, ctx = rewrite(_hf_layer_norm, x, w, b)
    assert ctx.fired == {"layer_norm": 1}
    assert count(gm, dmfx_ops.layer_norm) == 1 and torch.ops.aten.sqrt.default not in targets(gm)
    check_same(_hf_layer_norm, gm, x, w, b)


def test_var_based_layer_norm_fires_and_unbiased_var_does_not():
    x, w = torch.randn(4, 32), torch.randn(32)

    def biased(x, w):
        m = x.mean(-1, keepdim=True)
        return (x - m) * torch.rsqrt(x.var(-1, keepdim=True, unbiased=False) + 1e-5) * w

    def unbiased(x, w):
        m = x.mean(-1, keepdim=True)
        return (x - m) * torch.rsqrt(x.var(-1, keepdim=True) + 1e-5) * w

    gm, ctx = rewrite(biased, x, w)
    assert ctx.fired == {"layer_norm": 1}
    check_same(biased, gm, x, w)
    gm, ctx = rewrite(unbiased, x, w)
    assert ctx.fired == {}


def test_eps_outside_the_square_root_is_left_alone():
    def fn(x, w, b):
        u = x.mean(-1, keepdim=True)
        s = (x - u).pow(2).mean(-1, keepdim=True)
        return w * ((x - u) / (torch.sqrt(s) + 1e-6)) + b

    gm, ctx = rewrite(fn, torch.randn(4, 32), torch.randn(32), torch.randn(32))
    assert ctx.fired == {}


# --------------------------------------------------------------------------------- RMSNorm


def _llama_rms_norm(x, w, eps=1e-6):  # transformers' LlamaRMSNorm.forward
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return w * h.to(input_dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_llama_rms_norm_fires(dtype):
    w, x = torch.randn(64).to(dtype), torch.randn(2, 7, 64).to(dtype)
    gm, ctx = rewrite(_llama_rms_norm, x, w)
    assert ctx.fired == {"rms_norm": 1}
    assert count(gm, dmfx_ops.rms_norm) == 1 and torch.ops.aten.rsqrt.default not in targets(gm)
    check_same(_llama_rms_norm, gm, x, w, tol=1e-5 if dtype == torch.float32 else 1e-2)


def test_gemma_style_weight_and_commuted_operands_fire():
    w, x = torch.randn(64), torch.randn(5, 64)

    def fn(x, w):
        h = torch.rsqrt(1e-6 + (x * x).mean(-1, keepdim=True)) * x
        return h * (1.0 + w)

    gm, ctx = rewrite(fn, x, w)
    assert ctx.fired == {"rms_norm": 1}
    check_same(fn, gm, x, w)


def test_rms_norm_with_intermediate_used_elsewhere_is_left_alone():
    def fn(x, w):
        var = x.pow(2).mean(-1, keepdim=True)
        return w * (x * torch.rsqrt(var + 1e-6)), var

    gm, ctx = rewrite(fn, torch.randn(5, 64), torch.randn(64))
    assert ctx.fired == {}
    assert any("has a user outside the pattern" in m for m in ctx.missed)


def test_rms_over_a_non_last_dim_is_left_alone():
    x = torch.randn(5, 64)
    fn = lambda x: x * torch.rsqrt(x.pow(2).mean(0, keepdim=True) + 1e-6)  # noqa: E731
    gm, ctx = rewrite(fn, x)
    assert ctx.fired == {}


# --------------------------------------------------------------------------------- BDRLN chain


def _bert_output(h, res, W, b, gamma, beta, p):
    """BertSelfOutput/BertOutput: LayerNorm(dropout(dense(h)) + residual)."""
    return F.layer_norm(F.dropout(F.linear(h, W, b), p, training=True) + res, (W.shape[0],), gamma, beta, 1e-12)


def _bert_args(H=32, L=6):
    return torch.randn(2, L, H), torch.randn(2, L, H), torch.randn(H, H), torch.randn(H), torch.randn(H), torch.randn(H)


def test_bias_dropout_residual_layer_norm_fires_after_linear():
    fn = lambda *a: _bert_output(*a, 0.1)  # noqa: E731
    gm, ctx = rewrite(fn, *_bert_args())
    assert ctx.fired.get("bias_dropout_residual_norm") == 1
    t = targets(gm)
    assert torch.ops.aten.addmm.default not in t and torch.ops.aten.mm.default in t  # bias moved into the kernel
    assert torch.ops.aten.native_dropout.default not in t
    assert count(gm, dmfx_ops.bias_dropout_residual_norm) == 1


def test_bdrln_without_dropout_matches_eager_and_commuted_add():
    fn = lambda h, res, W, b, g, be: F.layer_norm(res + F.linear(h, W, b), (32,), g, be, 1e-12)  # noqa: E731
    args = _bert_args()
    gm, ctx = rewrite(fn, *args)
    assert ctx.fired.get("bias_dropout_residual_norm") == 1
    check_same(fn, gm, *args)


def test_bdrln_takes_a_clone_as_a_p0_dropout():
    """torch 2.11 traces a p=0 training dropout as clone(h): the chain still fuses, bias included,
    and the copy is gone (a clone is the identity on values)."""
    fn = lambda h, res, W, b, g, be: F.layer_norm(F.linear(h, W, b).clone() + res, (32,), g, be, 1e-12)  # noqa: E731
    args = _bert_args()
    gm, ctx = rewrite(fn, *args)
    assert ctx.fired.get("bias_dropout_residual_norm") == 1
    t = targets(gm)
    assert torch.ops.aten.clone.default not in t and torch.ops.aten.addmm.default not in t
    check_same(fn, gm, *args)


def test_bdrln_returns_the_sum_when_it_is_used_elsewhere():
    def fn(h, res, W, b, g, be):  # pre-LN style: the residual stream continues past the norm
        s = F.linear(h, W, b) + res
        return F.layer_norm(s, (32,), g, be), s * 2

    args = _bert_args()
    gm, ctx = rewrite(fn, *args)
    assert ctx.fired.get("bias_dropout_residual_norm") == 1
    node = next(n for n in gm.graph.nodes if n.target is dmfx_ops.bias_dropout_residual_norm.default)
    assert node.args[-1] is True  # return_sum
    check_same(fn, gm, *args)


def test_dropout_output_with_another_user_is_not_fused_into_the_norm():
    def fn(h, res, W, b, g, be):
        d = F.dropout(F.linear(h, W, b), 0.1, training=True)
        return F.layer_norm(d + res, (32,), g, be), d

    gm, ctx = rewrite(fn, *_bert_args())
    # the dropout stays outside the norm kernel (its output is needed): bias + dropout fuse on their
    # own, and the plain residual add still fuses into the norm
    assert any("other users" in m for m in ctx.missed)
    (f,) = [n for n in gm.graph.nodes if n.target is dmfx_ops.bias_dropout_residual_norm.default]
    assert f.args[5] is None and f.args[6] == 0.0  # no seed, p = 0: no dropout inside
    assert ctx.fired.get("bias_act_dropout") == 1
    assert torch.ops.aten.native_dropout.default not in targets(gm)


def test_standalone_dropout_becomes_philox_dropout():
    fn = lambda x: F.dropout(x, 0.2, training=True) * 3  # noqa: E731
    gm, ctx = rewrite(fn, torch.randn(8, 8))
    assert ctx.fired == {"dropout": 1}
    assert count(gm, dmfx_ops.dropout) == 1 and torch.ops.aten.native_dropout.default not in targets(gm)

"""The layer_norm and norm_idioms fusions (passes/layer_norm.py) on small hand-built ATen graphs:
aten.native_layer_norm and the LayerNorm / RMSNorm idioms HF models write become dmfx::layer_norm /
dmfx::rms_norm (the rewritten graph computes the same values); near-misses are left alone."""

import pytest
import torch
import torch.nn.functional as F
from conftest import check_same, count, rewrite, targets

dmfx_ops = torch.ops.dmfx


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


def test_rms_norm_of_transposed_heads_keeps_every_pass_graph_runnable():
    """Gemma 3's (and EXAONE 4's) q/k norms: an RMSNorm of ``q_proj(h).view(B, L, H, D).transpose(1, 2)``,
    then attention, then ``.transpose(1, 2).contiguous().view(B, L, H * D)``. Eager's element-wise
    norm keeps the transposed strides, so SDPA's output is [B, L, H, D]-contiguous and the trace
    records a plain view; dmfx's norm writes contiguously, SDPA's output follows, and the view must
    become a reshape as the norm is fused, not only at the pipeline's end: the graph verifier
    (strict in the suite) runs every pass's graph, and failed after norm_idioms."""
    B, L, H, D = 2, 6, 4, 16

    def fn(x, w):
        q = x.view(B, L, H, D).transpose(1, 2)
        q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + w)
        o = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        return o.transpose(1, 2).contiguous().view(B, L, H * D)

    x, w = torch.randn(B, L, H * D), torch.randn(D)
    gm, ctx = rewrite(fn, x, w)
    assert ctx.fired.get("rms_norm") == 1, ctx.fired
    check_same(fn, gm, x, w)

"""The attention-softmax, activation, gated-activation, rope and residual-norm passes on small
hand-built graphs: each fires where it should (and the rewritten graph computes the same values) and
leaves near-misses alone."""

import math

import pytest
import torch
import torch.nn.functional as F

from dmfx.passes import PIPELINE
from test_passes import check_same, count, rewrite, targets

dmfx_ops = torch.ops.dmfx
aten = torch.ops.aten


# The softmax tests look at the attention_softmax pass alone: the attention pass would take each of
# these chains over (tests/test_passes_attention.py).
SOFTMAX_PASSES = [n for n in PIPELINE if n not in ("attention", "qkv_attention")]


def _qk(B=2, H=3, S=5, D=8, Sk=None):
    Sk = Sk or S
    return torch.randn(B, H, S, D), torch.randn(B, H, Sk, D), torch.randn(B, H, Sk, D)


# ------------------------------------------------------------------------------ attention softmax


def bert_eager(q, k, v, mask):  # HF BERT/ViT eager: matmul, / sqrt(d), + mask, softmax, dropout(eval)
    s = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    p = torch.softmax(s + mask, dim=-1)
    return torch.matmul(p, v)


def test_softmax_fires_on_scale_mask_softmax():
    q, k, v = _qk()
    mask = torch.zeros(2, 1, 1, 5)
    mask[1, ..., 3:] = torch.finfo(torch.float32).min
    gm, ctx = rewrite(bert_eager, q, k, v, mask, passes=SOFTMAX_PASSES)
    assert ctx.fired.get("attention_softmax") == 1
    assert count(gm, dmfx_ops.attention_softmax) == 1 and aten._softmax.default not in targets(gm)
    (sm,) = [n for n in gm.graph.nodes if n.target is dmfx_ops.attention_softmax.default]
    assert sm.args[2] == pytest.approx(1 / math.sqrt(8)) and sm.args[1] is not None
    check_same(bert_eager, gm, q, k, v, mask)


@pytest.mark.parametrize("form", ["mul_then_mask", "mask_first", "mask_left", "no_scale", "no_mask"])
def test_softmax_semantic_variants(form):
    q, k, v = _qk()
    mask = torch.randn(2, 1, 5, 5)

    def fn(q, k, v, mask):
        s = q @ k.transpose(-1, -2)
        if form == "mul_then_mask":
            z = s * 0.125 + mask
        elif form == "mask_first":  # softmax((s + m) / c): the mask is scaled too, still exact
            z = (s + mask) / 8.0
        elif form == "mask_left":
            z = mask + s * 0.125
        elif form == "no_scale":
            z = s + mask
        else:
            z = s * 0.125
        return F.softmax(z, dim=-1) @ v

    gm, ctx = rewrite(fn, q, k, v, mask, passes=SOFTMAX_PASSES)
    assert ctx.fired.get("attention_softmax") == 1, ctx.missed
    check_same(fn, gm, q, k, v, mask)


def test_sdpa_math_path_bool_mask_and_split_scale_are_folded():
    """SDPA's math decomposition (what aot_export gives for a bool mask) scales q and k by sqrt(c)
    and turns the bool mask into where(m, 0, -inf): both fold into the fused op."""
    q, k, v = _qk()
    mask = torch.rand(2, 1, 5, 5) > 0.3
    mask[..., 0] = True
    fn = lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m)  # noqa: E731
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        gm, ctx = rewrite(fn, q, k, v, mask, passes=SOFTMAX_PASSES)
        expected = fn(q, k, v, mask)
    if aten._softmax.default not in targets(gm) and ctx.fired.get("attention_softmax") is None:
        pytest.skip("this torch lowers SDPA to a fused kernel here, not to the math path")
    assert ctx.fired.get("attention_softmax") == 1, ctx.missed
    (sm,) = [n for n in gm.graph.nodes if n.target is dmfx_ops.attention_softmax.default]
    assert sm.args[1].meta["val"].dtype == torch.bool  # the bool mask itself, not a float copy
    assert aten.where.self not in targets(gm)
    assert sm.args[2] == pytest.approx(1 / math.sqrt(8))
    assert (gm(q, k, v, mask)[0] - expected).norm() / expected.norm() < 1e-5


def test_causal_tril_mask_becomes_causal_flag():
    q, k, v = _qk()

    def fn(q, k, v):
        S = q.shape[-2]
        keep = torch.ones(S, S, dtype=torch.bool).tril()
        s = (q @ k.transpose(-1, -2)) * 0.3 + torch.where(keep, 0.0, float("-inf"))
        return torch.softmax(s, -1) @ v

    gm, ctx = rewrite(fn, q, k, v, passes=SOFTMAX_PASSES)
    (sm,) = [n for n in gm.graph.nodes if n.target is dmfx_ops.attention_softmax.default]
    assert sm.args[1] is None and sm.args[3] is True
    check_same(fn, gm, q, k, v)


def test_softmax_dropout_is_absorbed_and_probs_readers_get_probs():
    q, k, v = _qk()

    def fn(q, k, v):
        p = torch.softmax(q @ k.transpose(-1, -2) * 0.5, -1)
        return F.dropout(p, 0.1, training=True) @ v, p  # p is also returned (output_attentions)

    gm, ctx = rewrite(fn, q, k, v, passes=SOFTMAX_PASSES)
    assert ctx.fired.get("attention_softmax") == 1
    assert aten.native_dropout.default not in targets(gm) and dmfx_ops.dropout.default not in targets(gm)
    (sm,) = [n for n in gm.graph.nodes if n.target is dmfx_ops.attention_softmax.default]
    assert sm.args[5] == pytest.approx(0.1) and sm.args[4] is not None
    out, probs = gm(q, k, v)
    torch.testing.assert_close(probs, torch.softmax(q @ k.transpose(-1, -2) * 0.5, -1), rtol=1e-5, atol=1e-6)


def test_softmax_autocast_style_casts_are_absorbed():
    q, k, v = (t.to(torch.bfloat16) for t in _qk())

    def fn(q, k, v):
        s = q @ k.transpose(-1, -2) * 0.25
        return torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype) @ v

    gm, ctx = rewrite(fn, q, k, v, passes=SOFTMAX_PASSES)
    assert ctx.fired.get("attention_softmax") == 1
    assert aten._to_copy.default not in targets(gm)
    check_same(fn, gm, q, k, v, tol=2e-2)


def test_softmax_near_misses():
    q, k, v = _qk()
    # softmax over a non-last dim
    fn1 = lambda q, k: torch.softmax(q @ k.transpose(-1, -2), dim=-2)  # noqa: E731
    gm, ctx = rewrite(fn1, q, k, passes=SOFTMAX_PASSES)
    assert "attention_softmax" not in ctx.fired
    # the scaled scores are read elsewhere: the scale stays outside, the rest still fuses
    def fn2(q, k):
        s = (q @ k.transpose(-1, -2)) * 0.5
        return torch.softmax(s + 1.0 * s.detach().sign(), -1), s

    gm, ctx = rewrite(fn2, q, k, passes=SOFTMAX_PASSES)
    check_same(fn2, gm, q, k)
    # a mask that depends on the scores: still correct whatever fires
    def fn3(q, k):
        s = q @ k.transpose(-1, -2)
        return torch.softmax(s + (s > 0).float() * -1e4, -1)

    gm, ctx = rewrite(fn3, q, k, passes=SOFTMAX_PASSES)
    check_same(fn3, gm, q, k)


# ------------------------------------------------------------------------------ activations


def gpt2_gelu(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def test_gelu_tanh_idiom_becomes_one_op():
    x = torch.randn(4, 33)
    gm, ctx = rewrite(gpt2_gelu, x)
    assert ctx.fired.get("gelu_tanh_idiom") == 1
    assert aten.tanh.default not in targets(gm) and aten.pow.Tensor_Scalar not in targets(gm)
    check_same(gpt2_gelu, gm, x)


@pytest.mark.parametrize("act", ["gelu", "gelu_tanh", "relu", "silu", "tanh", "gpt2"])
def test_bias_activation_after_linear_splits_the_bias(act):
    fns = {
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


# ------------------------------------------------------------------------------ gated activation


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


# ------------------------------------------------------------------------------ rope


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(q, k, cos, sin):  # HF LLaMA's apply_rotary_pos_emb
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def test_rope_pairs_q_and_k():
    B, S, D = 2, 6, 8
    q = torch.randn(B, S, 4, D).transpose(1, 2)  # [B, H, S, D] with permuted strides, as HF makes it
    k = torch.randn(B, S, 2, D).transpose(1, 2)  # grouped-query: fewer k heads
    ang = torch.randn(B, S, D // 2)
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    gm, ctx = rewrite(apply_rope, q, k, cos, sin)
    assert ctx.fired.get("rope") == 1 and aten.cat.default not in targets(gm) and aten.neg.default not in targets(gm)
    check_same(apply_rope, gm, q, k, cos, sin)


def test_rope_alone_or_wrong_halves_is_left_alone():
    q, cos, sin = torch.randn(2, 3, 6, 8), torch.randn(2, 6, 8), torch.randn(2, 6, 8)
    one = lambda q, cos, sin: q * cos.unsqueeze(1) + rotate_half(q) * sin.unsqueeze(1)  # noqa: E731
    gm, ctx = rewrite(one, q, cos, sin)
    assert "rope" not in ctx.fired and any("rope" in m for m in ctx.missed)
    check_same(one, gm, q, cos, sin)

    def swapped(q, k, cos, sin):  # not a rotation by halves: cat((x1, -x2))
        r = lambda x: torch.cat((x[..., :4], -x[..., 4:]), -1)  # noqa: E731
        return q * cos + r(q) * sin, k * cos + r(k) * sin

    gm, ctx = rewrite(swapped, q, q.clone(), cos.unsqueeze(1), sin.unsqueeze(1))
    assert "rope" not in ctx.fired


# ------------------------------------------------------------------------------ residual + norm


def test_residual_add_rmsnorm_llama_style():
    def block(h, a, w):  # h = h + attn_out; x = rmsnorm(h); both are used
        h = h + a
        var = h.pow(2).mean(-1, keepdim=True)
        return w * (h * torch.rsqrt(var + 1e-6)), h

    h, a, w = torch.randn(2, 5, 16), torch.randn(2, 5, 16), torch.randn(16)
    gm, ctx = rewrite(block, h, a, w)
    assert ctx.fired.get("bias_dropout_residual_norm") == 1
    (f,) = [n for n in gm.graph.nodes if n.target is dmfx_ops.bias_dropout_residual_norm.default]
    assert f.args[8] is True and f.args[9] is True  # rms, and the sum is returned for the next residual
    assert aten.add.Tensor not in targets(gm)
    check_same(block, gm, h, a, w)


def test_broadcast_residual_is_expanded_into_the_norm():
    """BERT's embeddings: (word + type) + position[1, S, H] -> LayerNorm: the broadcast add fuses too."""
    def emb(a, pos, w, b):
        return F.layer_norm(a + pos, (16,), w, b, 1e-12)

    a, pos, w, b = torch.randn(3, 5, 16), torch.randn(1, 5, 16), torch.randn(16), torch.randn(16)
    gm, ctx = rewrite(emb, a, pos, w, b)
    assert ctx.fired.get("bias_dropout_residual_norm") == 1 and aten.add.Tensor not in targets(gm)
    check_same(emb, gm, a, pos, w, b)
    # gradients through the expanded residual are summed back to [1, S, H]
    ap, pp = a.clone().requires_grad_(), pos.clone().requires_grad_()
    out = torch.compile(emb, backend="dmfx")(ap, pp, w, b)
    R = torch.randn_like(out)
    (out * R).sum().backward()
    ae, pe = a.clone().requires_grad_(), pos.clone().requires_grad_()
    (emb(ae, pe, w, b) * R).sum().backward()
    assert pp.grad.shape == pos.shape
    torch.testing.assert_close(pp.grad, pe.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ap.grad, ae.grad, rtol=1e-5, atol=1e-5)

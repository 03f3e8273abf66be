"""The attention_softmax fusion (passes/attention_softmax.py, the paper's SM) on small hand-built ATen
graphs: scale + mask + softmax + dropout over attention scores become dmfx::attention_softmax (the
rewritten graph computes the same values); near-misses are left alone."""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import check_same, count, rewrite, targets

from dmfx.passes import PIPELINE

dmfx_ops = torch.ops.dmfx
aten = torch.ops.aten


# The softmax tests look at the attention_softmax pass alone: the attention pass would take each of
# these chains over (tests/test_pass_attention.py).
SOFTMAX_PASSES = [n for n in PIPELINE if n not in ("attention", "qkv_attention")]


def _qk(B=2, H=3, S=5, D=8, Sk=None):
    Sk = Sk or S
    return torch.randn(B, H, S, D), torch.randn(B, H, Sk, D), torch.randn(B, H, Sk, D)


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


@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_two_masks_as_t5_adds_them_fuse(scale):
    """T5 (transformers 5): ``softmax((s * scaling + position_bias) + mask)``, scaling 1.0; the inner
    add is part of the chain (a regression: it was left out, so the scaled scores looked read outside
    the pattern and T5's attention stopped fusing)."""
    q, k, v = _qk()
    bias, mask = torch.randn(1, 3, 5, 5), torch.zeros(2, 1, 1, 5)
    mask[1, ..., 3:] = -1e9

    def fn(q, k, v, bias, mask):
        return F.softmax((q @ k.transpose(-1, -2) * scale + bias) + mask, dim=-1) @ v

    gm, ctx = rewrite(fn, q, k, v, bias, mask, passes=SOFTMAX_PASSES)
    assert ctx.fired.get("attention_softmax") == 1, ctx.missed
    assert aten._softmax.default not in targets(gm)
    check_same(fn, gm, q, k, v, bias, mask)


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


def _hf_causal_mask(B, Lq, Lk, q_offset, window=None, masked=None):
    """HF's create_causal_mask of an eager-attention model as it traces in training: key and query
    positions from aranges, compared, expanded over the batch, made additive with finfo.min."""
    kv = torch.arange(Lk)[None, None, None, :]
    q = (torch.arange(Lq) + q_offset)[None, None, :, None]
    keep = kv <= q
    if window is not None:
        keep = keep & (kv > q - window)
    masked = torch.finfo(torch.float32).min if masked is None else masked
    return torch.where(keep.expand(B, -1, -1, -1), torch.zeros(()), torch.full((), masked))


@pytest.mark.parametrize("case,causal", [
    ("square", True), ("bottom_right", True), ("top_left", False), ("sliding_window", False),
    ("masked_by_-1e4", False), ("more_rows_than_keys", False)])
def test_hf_causal_masks_computed_from_constants_become_the_causal_flag(case, causal):
    """A causal mask the graph computes from aranges (HF's eager attention in training) is evaluated at
    compile time and becomes causal=True where it is dmfx's bottom-right causal mask exactly; other
    constant masks (top-left over a longer key length, a sliding window, a masked value whose exp is not
    surely 0, rows with no key) stay masks. The values are eager's either way."""
    Lq, Lk, offset, window, masked = {
        "square": (5, 5, 0, None, None), "bottom_right": (3, 5, 2, None, None), "top_left": (3, 5, 0, None, None),
        "sliding_window": (5, 5, 0, 2, None), "masked_by_-1e4": (5, 5, 0, None, -1e4),
        "more_rows_than_keys": (5, 3, -2, None, None)}[case]
    q, k, v = _qk(S=Lq, Sk=Lk)

    def fn(q, k, v):
        s = (q @ k.transpose(-1, -2)) * 0.3 + _hf_causal_mask(q.shape[0], Lq, Lk, offset, window, masked)
        return torch.softmax(s, -1) @ v

    gm, ctx = rewrite(fn, q, k, v, passes=SOFTMAX_PASSES)
    (sm,) = [n for n in gm.graph.nodes if n.target is dmfx_ops.attention_softmax.default]
    assert sm.args[3] is causal and (sm.args[1] is None) is causal
    if causal:
        assert aten.where.self not in targets(gm)  # the mask is gone from the graph
    check_same(fn, gm, q, k, v)


def test_a_cuda_graphs_causal_mask_is_evaluated_on_the_cpu():
    """constant_value evaluates a mask the graph builds on CUDA on the CPU: no kernel launches at compile
    time, and no GPU needed to decide (a fake CUDA graph, traced here without one)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    from dmfx.passes.attention_softmax import _is_causal_constant
    from dmfx.passes.graph_utils import constant_value

    def fn(s):
        L = s.shape[-1]
        keep = torch.arange(L, device=s.device)[None, :] <= torch.arange(L, device=s.device)[:, None]
        return s + torch.where(keep, torch.zeros((), device=s.device), torch.full((), -3.4e38, device=s.device))

    with FakeTensorMode(allow_non_fake_inputs=True):
        gm = make_fx(fn, tracing_mode="fake")(torch.empty(2, 3, 6, 6, device="cuda"))
    (where,) = [n for n in gm.graph.nodes if n.target is aten.where.self]
    assert where.meta["val"].device.type == "cuda"
    v = constant_value(where)
    assert v.device.type == "cpu" and torch.equal(v == 0, torch.ones(6, 6, dtype=torch.bool).tril())
    assert _is_causal_constant(where, torch.Size([2, 3, 6, 6]))


def test_a_causal_mask_given_as_an_input_stays_a_mask():
    """The same causal values passed in (a tensor the graph cannot prove constant) are read as a mask."""
    q, k, v = _qk()
    mask = _hf_causal_mask(2, 5, 5, 0)

    def fn(q, k, v, mask):
        return torch.softmax(q @ k.transpose(-1, -2) * 0.3 + mask, -1) @ v

    gm, ctx = rewrite(fn, q, k, v, mask, passes=SOFTMAX_PASSES)
    (sm,) = [n for n in gm.graph.nodes if n.target is dmfx_ops.attention_softmax.default]
    assert sm.args[1] is not None and sm.args[3] is False
    check_same(fn, gm, q, k, v, mask)


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


def _promoted(where):
    """HF's eager attention under CPU autocast: bf16 scores, a float32 mask (built in the embeddings'
    dtype), so the add promotes and the softmax runs in float32; the probabilities go back to bf16
    right after the softmax (GPT-2, dropout then in bf16) or after a float32 dropout (BERT, LLaMA:
    autocast casts them for the second GEMM)."""
    def fn(q, k, v, mask):
        s = (q @ k.transpose(-1, -2)) * 0.25 + mask
        p = torch.softmax(s, dim=-1)
        if where == "after_softmax":
            return F.dropout(p.to(q.dtype), 0.1, training=True) @ v
        if where == "after_dropout":
            return F.dropout(p, 0.1, training=True).to(q.dtype) @ v
        if where == "after_clone":  # torch 2.11 traces a training dropout of p = 0 as a clone
            return p.clone().to(q.dtype) @ v
        return p.to(q.dtype) @ v  # no dropout
    return fn


def _bf16_masked(S=6):
    q, k, v = (t.to(torch.bfloat16) for t in _qk(S=S))
    mask = torch.zeros(2, 1, 1, S)
    mask[1, ..., S - 2:] = torch.finfo(torch.float32).min
    return q, k, v, mask


@pytest.mark.parametrize("where", ["after_softmax", "after_dropout", "no_dropout", "after_clone"])
def test_bf16_scores_promoted_by_a_float32_mask_fuse(where):
    args = _bf16_masked()
    fn = _promoted(where)
    gm, ctx = rewrite(fn, *args, passes=SOFTMAX_PASSES)
    assert ctx.fired.get("attention_softmax") == 1, ctx.missed
    t = targets(gm)
    assert aten._softmax.default not in t and aten.native_dropout.default not in t and aten._to_copy.default not in t
    (sm,) = [n for n in gm.graph.nodes if n.target is dmfx_ops.attention_softmax.default]
    assert sm.meta["val"][0].dtype == torch.bfloat16  # probabilities in the scores' dtype, read by the bf16 GEMM
    no_dropout = where in ("no_dropout", "after_clone")
    assert sm.args[5] == pytest.approx(0.0 if no_dropout else 0.1)
    if no_dropout:
        check_same(fn, gm, *args, tol=1e-2)  # (the scale is a power of two: the same math; bf16 GEMM rounding)
    else:  # dropout: another mask than eager's; the kept entries carry the probabilities scaled by 1/(1-p)
        q, k, v, mask = args
        out = gm(q, k, torch.eye(6, 8).to(torch.bfloat16).expand(2, 3, 6, 8), mask)
        out = (out[0] if isinstance(out, tuple) else out)[..., :6]  # P_dropped @ [I | 0]: P_dropped
        probs = torch.softmax((q @ k.transpose(-1, -2)).float() * 0.25 + mask, -1)
        kept = out.float() != 0
        assert 0 < kept.float().mean() < 1
        torch.testing.assert_close(out.float()[kept], (probs / 0.9)[kept], rtol=2e-2, atol=1e-3)


def test_bf16_promoted_near_misses_are_left_alone():
    args = _bf16_masked()

    def probs_read_in_float32(q, k, v, mask):  # the float32 probabilities are returned too
        p = torch.softmax((q @ k.transpose(-1, -2)) * 0.25 + mask, dim=-1)
        return p.to(q.dtype) @ v, p

    def never_cast_back(q, k, v, mask):  # the second GEMM reads float32 probabilities (v upcast)
        p = torch.softmax((q @ k.transpose(-1, -2)) * 0.25 + mask, dim=-1)
        return p @ v.float()

    def dropout_mask_read(q, k, v, mask):  # the float32 dropout's mask is read: not absorbed
        p = torch.softmax((q @ k.transpose(-1, -2)) * 0.25 + mask, dim=-1)
        out, keep = aten.native_dropout(p, 0.1, True)
        return out.to(q.dtype) @ v, keep

    for fn in (probs_read_in_float32, never_cast_back, dropout_mask_read):
        gm, ctx = rewrite(fn, *args, passes=SOFTMAX_PASSES)
        assert "attention_softmax" not in ctx.fired, fn.__name__
        assert any("another dtype than the softmax input" in m for m in ctx.missed), (fn.__name__, ctx.missed)
        if fn is not dropout_mask_read:
            check_same(fn, gm, *args)


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

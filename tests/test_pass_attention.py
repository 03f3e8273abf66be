"""The attention fusion (passes/attention.py) on small hand-built graphs and compiled modules:
attention in the forms models write it becomes dmfx::flash_attention / dmfx::attention, with no
transpose copy left in the forward or the backward graph (noop_clones), or PyTorch's SDPA where the
cost model (choose_form; tuned with options={"tune": True}) says so; near misses are left to the
softmax fusion. The shapes, modules and helpers here are shared by test_pass_qkv_attention.py and
test_pass_lower_sdpa_calls.py."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import check_same, rel_err, rewrite, targets, tiny_bert_layer

import dmfx

dmfx_ops = torch.ops.dmfx
aten = torch.ops.aten


B, L, H, D = 2, 6, 3, 4


E = H * D


def _heads(t, Lx=L):
    return t.view(B, Lx, H, D).transpose(1, 2)


def bert_self_attention(x, wq, bq, wk, bk, wv, bv, mask):
    """HF BERT's eager self-attention: three linears, head views, matmul / sqrt(d) + mask, softmax,
    matmul, transpose back and .contiguous().view()."""
    q, k, v = (_heads(F.linear(x, w, b)) for w, b in ((wq, bq), (wk, bk), (wv, bv)))
    s = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(D) + mask
    p = torch.softmax(s, dim=-1)
    ctx = torch.matmul(p, v)
    return ctx.permute(0, 2, 1, 3).contiguous().view(B, L, E)


def _params():
    x = torch.randn(B, L, E)
    ws = [torch.randn(E, E) * 0.3 for _ in range(3)]
    bs = [torch.randn(E) for _ in range(3)]
    mask = torch.zeros(B, 1, 1, L)
    mask[1, ..., 4:] = torch.finfo(torch.float32).min
    return x, ws[0], bs[0], ws[1], bs[1], ws[2], bs[2], mask


class _SelfAttention(torch.nn.Module):
    def __init__(self, p=0.0, bias=True):
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(E, E, bias=bias) for _ in range(3))
        self.o = torch.nn.Linear(E, E)
        self.drop = torch.nn.Dropout(p)

    def forward(self, x, mask):
        q, k, v = (_heads(m(x)) for m in (self.q, self.k, self.v))
        s = q @ k.transpose(-1, -2) / math.sqrt(D) + mask
        ctx = self.drop(torch.softmax(s, -1)) @ v
        return self.o(ctx.transpose(1, 2).contiguous().view(B, L, E))


def _forms(model, *inputs, **options):
    torch._dynamo.reset()
    dmfx.reset()
    torch.compile(model, backend="dmfx", options=options)(*inputs)
    return sorted(f for r in dmfx.records() for f, _ in r.attention_forms.values())


@pytest.mark.parametrize("form", ["gemm", "flash"])
def test_attention_on_plain_inputs_has_no_copies(form):
    q, k, v = (torch.randn(B, L, H, D).transpose(1, 2) for _ in range(3))

    def fn(q, k, v):
        return (torch.softmax(q @ k.transpose(-1, -2) * 0.5, -1) @ v).transpose(1, 2).contiguous()

    gm, ctx = rewrite(fn, q, k, v, attention=form)
    assert ctx.fired.get("attention") == 1 and "qkv_attention" not in ctx.fired and not ctx.missed
    assert aten.clone.default not in targets(gm) and aten.bmm.default not in targets(gm)
    check_same(fn, gm, q, k, v)


@pytest.mark.parametrize("form", ["gemm", "flash", "sdpa"])
def test_cross_attention_other_key_length(form):
    q = torch.randn(B, H, L, D)
    k, v = torch.randn(B, H, 9, D), torch.randn(B, H, 9, 5)
    mask = torch.randn(B, 1, L, 9)

    def fn(q, k, v, mask):
        return torch.softmax(q @ k.transpose(-1, -2) + mask, -1) @ v

    gm, ctx = rewrite(fn, q, k, v, mask, attention=form)
    assert ctx.fired.get("attention") == 1
    assert [f for f, _ in ctx.forms.values()] == [form]
    check_same(fn, gm, q, k, v, mask)


def test_returned_attention_weights_read_the_fused_ops_probs():
    q, k, v = (torch.randn(B, H, L, D) for _ in range(3))

    def fn(q, k, v):
        p = torch.softmax(q @ k.transpose(-1, -2) * 0.5, -1)
        return p @ v, p

    gm, ctx = rewrite(fn, q, k, v, attention="flash")
    assert ctx.fired.get("attention") == 1
    assert [f for f, _ in ctx.forms.values()] == ["gemm"]  # only the unfused form has the probabilities
    check_same(fn, gm, q, k, v)


def test_near_misses_are_left_to_the_softmax_fusion():
    q, k, v = (torch.randn(B, H, L, D) for _ in range(3))

    def scores_returned(q, k, v):
        s = q @ k.transpose(-1, -2)
        return torch.softmax(s * 0.5, -1) @ v, s

    gm, ctx = rewrite(scores_returned, q, k, v)
    assert "attention" not in ctx.fired and ctx.fired.get("attention_softmax") == 1
    assert any(m.startswith("attention at") for m in ctx.missed)
    check_same(scores_returned, gm, q, k, v)

    def no_second_gemm(q, k):
        return torch.softmax(q @ k.transpose(-1, -2), -1).sum(-1)

    gm, ctx = rewrite(no_second_gemm, q, k)
    assert "attention" not in ctx.fired
    check_same(no_second_gemm, gm, q, k)

    def softmax_over_queries(q, k, v):
        return torch.softmax(q @ k.transpose(-1, -2), -2) @ v

    gm, ctx = rewrite(softmax_over_queries, q, k, v)
    assert not ctx.fired.get("attention")
    check_same(softmax_over_queries, gm, q, k, v)

    def mask_from_scores(q, k, v):  # the scores are read twice: no attention op (softmax still fuses)
        s = q @ k.transpose(-1, -2)
        return torch.softmax(s + (s > 0).float() * -1e4, -1) @ v

    gm, ctx = rewrite(mask_from_scores, q, k, v)
    assert "attention" not in ctx.fired and any(m.startswith("attention at") for m in ctx.missed)
    check_same(mask_from_scores, gm, q, k, v)


def test_grouped_query_attention_reads_k_and_v_before_repeat_kv():
    """LLaMA's repeat_kv (unsqueeze, expand, reshape: a copy) is bypassed: the ops index kv heads."""
    q = torch.randn(B, H, L, D)
    k, v = torch.randn(B, 1, L, D), torch.randn(B, 1, L, D)

    def gqa_repeat_kv(q, k, v):
        k2 = k[:, :, None].expand(B, 1, H, L, D).reshape(B, H, L, D)
        v2 = v[:, :, None].expand(B, 1, H, L, D).reshape(B, H, L, D)
        return torch.softmax(q @ k2.transpose(-1, -2) * 0.5, -1) @ v2

    for form in ("flash", "gemm", "sdpa"):
        gm, ctx = rewrite(gqa_repeat_kv, q, k, v, attention=form)
        assert ctx.fired.get("attention") == 1, ctx.missed
        assert aten.clone.default not in targets(gm) and aten.expand.default not in targets(gm)
        (att,) = [n for n in gm.graph.nodes if n.op == "call_function" and "attention" in str(n.target)]
        assert att.args[1].meta["val"].shape[1] == 1  # k with its one kv head
        check_same(gqa_repeat_kv, gm, q, k, v)


def test_dropout_in_training_uses_the_fused_ops_mask():
    torch.manual_seed(0)
    model = _SelfAttention(p=0.5).train()
    x, mask = torch.randn(B, L, E), _params()[-1]
    out = torch.compile(model, backend="dmfx")(x, mask)
    (rec,) = dmfx.records()
    (node,) = [n for n in rec.forward_graph.graph.nodes if n.target is dmfx_ops.qkv_flash_attention.default]
    assert node.args[-1] == 0.5 and torch.isfinite(out).all()
    with torch.no_grad():
        model.eval()
        ref = _SelfAttention()
        ref.load_state_dict(model.state_dict())
        assert rel_err(torch.compile(model, backend="dmfx")(x, mask), ref(x, mask)) < 1e-5


def test_cost_model_bf16_training_over_long_keys_is_sdpas(monkeypatch):
    """Past GEMM_FORM_MAX_KEYS keys the GEMM form's [B, H, L, L] scores leave the cache and SDPA's
    bf16 backward is faster (bench/RESULTS.md): there bf16 training without dropout is SDPA's."""
    from dmfx.passes import attention as attention_pass

    x, mask = _params()[0].bfloat16().requires_grad_(), _params()[-1].bfloat16()
    assert _forms(_SelfAttention(p=0.0).train().to(torch.bfloat16), x, mask) == ["gemm"]
    monkeypatch.setattr(attention_pass, "GEMM_FORM_MAX_KEYS", L - 1)
    assert _forms(_SelfAttention(p=0.0).train().to(torch.bfloat16), x, mask) == ["sdpa"]
    assert _forms(_SelfAttention(p=0.1).train().to(torch.bfloat16), x, mask) == ["gemm"]  # dropout: no fused kernel


def test_cost_model_picks_per_case():
    """auto: dropout on the CPU -> dmfx's fused kernel; training without dropout -> the same (a tie
    with SDPA, and the bias gradients fold); fp32 inference -> the same (0.99-1.11x SDPA,
    bench/RESULTS.md); bf16 inference -> PyTorch's SDPA; bf16 training, with or without dropout -> the
    GEMM form (SDPA's bf16 backward is slower on the CPU); a mask that requires grad -> the GEMM form."""
    torch.manual_seed(0)
    x, mask = torch.randn(B, L, E), _params()[-1]
    assert _forms(_SelfAttention(p=0.1).train(), x, mask) == ["flash"]
    assert _forms(_SelfAttention(p=0.0).train(), x.requires_grad_(), mask) == ["flash"]  # ties SDPA, folds the bias grads
    x.requires_grad_(False)
    with torch.no_grad():
        assert _forms(_SelfAttention(p=0.1).eval(), x, mask) == ["flash"]
        assert _forms(_SelfAttention(p=0.1).eval().to(torch.bfloat16), x.bfloat16(), mask.bfloat16()) == ["sdpa"]
    assert _forms(_SelfAttention(p=0.1).train().to(torch.bfloat16), x.bfloat16(), mask.bfloat16()) == ["gemm"]
    xb = x.bfloat16().requires_grad_()
    assert _forms(_SelfAttention(p=0.0).train().to(torch.bfloat16), xb, mask.bfloat16()) == ["gemm"]
    assert _forms(_SelfAttention(p=0.0).train().to(torch.float16), xb.detach().half().requires_grad_(), mask.half()) == ["gemm"]
    bias = torch.nn.Parameter(torch.randn(1, H, L, L))
    assert _forms(_SelfAttention(p=0.1).train(), x, bias) == ["gemm"]
    assert _forms(_SelfAttention(p=0.1).train(), x, mask, attention="sdpa") == ["sdpa"]


def test_sdpa_form_matches_eager_in_training():
    torch.manual_seed(0)
    model, ref = _SelfAttention(), _SelfAttention()
    ref.load_state_dict(model.state_dict())
    x = torch.randn(B, L, E, requires_grad=True)
    mask = _params()[-1]
    torch.compile(model, backend="dmfx", options={"attention": "sdpa"})(x, mask).square().sum().backward()
    gx, x.grad = x.grad, None
    ref(x, mask).square().sum().backward()
    assert rel_err(gx, x.grad) < 1e-5
    (rec,) = dmfx.records()
    assert [f for f, _ in rec.attention_forms.values()] == ["sdpa"]


def test_bad_attention_option_is_a_clear_error():
    with pytest.raises(ValueError, match="'attention' must be"):
        dmfx.Options.from_user({"attention": "fast"})
    with pytest.raises(ValueError, match="'stack_qkv' must be"):
        dmfx.Options.from_user({"stack_qkv": "yes"})


def test_tune_times_each_case_once_and_caches_it(tmp_path, monkeypatch):
    """options={"tune": True}: the feasible forms are timed on this machine, the fastest runs, and
    the result is cached on disk, so a second compile of the same case times nothing."""
    from dmfx.passes import tuning

    path = tmp_path / tuning.FILE
    monkeypatch.setattr(tuning, "_path", lambda: path)
    torch.manual_seed(0)
    x, mask = torch.randn(B, L, E), _params()[-1]
    model = _SelfAttention(p=0.1).train()
    (first,) = _forms(model, x, mask, tune=True)
    (rec,) = dmfx.records()
    (why,) = [w for _, w in rec.attention_forms.values()]
    assert why.startswith("tuned: ") and all(f in why for f in ("flash", "gemm", "sdpa")), why
    cached = [v for v in json.loads(path.read_text()).values() if "best" in v]  # (the rest: the layout search's)
    assert len(cached) == 1 and cached[0]["best"] == first

    def no_timing(*args, **kwargs):
        raise AssertionError("a cached case was timed again")

    monkeypatch.setattr(tuning, "_time", no_timing)
    assert _forms(model, x, mask, tune=True) == [first]
    # a corrupt cache file is ignored: the case is timed again (here: timing fails -> the cost model)
    path.write_text("{not json")
    assert _forms(model, x, mask, tune=True) == ["flash"]


def test_dynamic_true_head_dim_scale_is_read_under_a_guard():
    """torch.compile(dynamic=True) passes HF's 1/sqrt(d) as a run-time float: dmfx reads it as the
    attention's constant scale under a guard (passes/attention.py, _head_dim_scale), and the attention
    fuses, matching eager over several lengths. (Other run-time scales multiply q instead:
    tests/test_dynamic_shapes.py.)"""
    layer, ref = tiny_bert_layer()
    f = torch.compile(layer, backend="dmfx", dynamic=True, options={"attention": "flash", "fallback": False})
    for L in (9, 13):
        x = torch.randn(2, L, 32, requires_grad=True)
        R = torch.randn(2, L, 32)
        (f(x)[0] * R).sum().backward()
        gx, x.grad = x.grad, None
        (ref(x)[0] * R).sum().backward()
        assert rel_err(gx, x.grad) < 1e-5
    assert any(r.fired.get("attention") for r in dmfx.records()), [r.missed for r in dmfx.records()]


def gemma2_attention(q, k, v, mask, cap=2.0):
    """HF Gemma 2's eager attention with attn_logit_softcapping: scale, soft cap, mask, fp32 softmax."""
    s = torch.matmul(q, k.transpose(2, 3)) * D ** -0.5
    s = torch.tanh(s / cap) * cap
    s = s + mask
    return torch.matmul(torch.softmax(s, -1, dtype=torch.float32).to(q.dtype), v)


def _gemma2_inputs(Lq=L, dtype=torch.float32):
    q = (3 * torch.randn(B, L, H, D)).transpose(1, 2)[:, :, :Lq]  # scores of about 3: the cap bends them
    k, v = ((3 * torch.randn(B, L, H, D)).transpose(1, 2) for _ in range(2))
    mask = torch.zeros(B, 1, Lq, L)
    mask[0, ..., -2:] = torch.finfo(torch.float32).min
    return tuple(t.to(dtype) for t in (q, k, v, mask))


def test_soft_capped_attention_is_one_flash_attention_with_its_cap():
    """Gemma 2's soft cap (tanh(s * scale / cap) * cap before the mask) is dmfx::flash_attention's
    softcap: one op, no [B, H, L, L] score tensor, the same values and gradients as eager."""
    inputs = _gemma2_inputs()
    for training in (False, True):
        args = [t.detach().requires_grad_(training and i < 3) for i, t in enumerate(inputs)]
        gm, ctx = rewrite(gemma2_attention, *args)
        assert ctx.fired.get("attention") == 1, ctx.missed
        (att,) = [n for n in gm.graph.nodes if n.target is dmfx_ops.flash_attention.default]
        assert att.args[8] == 2.0 and math.isclose(att.args[4], D ** -0.5, rel_tol=1e-12)
        assert not {aten.tanh.default, aten.bmm.default, aten.mm.default} & set(targets(gm))
        check_same(gemma2_attention, gm, *args)
    out, want = gm(*args)[0], gemma2_attention(*args)
    R = torch.randn_like(want)
    got = torch.autograd.grad((out * R).sum(), args[:3])
    exp = torch.autograd.grad((want * R).sum(), args[:3])
    scale = max(g.abs().max() for g in exp)
    assert all(((a - b).abs().max() / scale) < 1e-5 for a, b in zip(got, exp))


def test_soft_capped_attention_near_misses_keep_the_fused_softmax():
    """Where the flash form cannot take the cap, the attention is left to the GEMMs around the fused
    softmax (as before the soft cap was fused), with the reason recorded."""
    def missed(fn, *args, why, **settings):
        gm, ctx = rewrite(fn, *args, **settings)
        assert "attention" not in ctx.fired and ctx.fired.get("attention_softmax") == 1, ctx.fired
        assert any(m.startswith("attention at") and why in m for m in ctx.missed), ctx.missed
        check_same(fn, gm, *args, tol=1e-2 if args[0].dtype == torch.bfloat16 else 1e-5)

    missed(gemma2_attention, *_gemma2_inputs(Lq=1), why="one query row (a decode step)")
    missed(gemma2_attention, *_gemma2_inputs(dtype=torch.bfloat16), why="need dmfx's fused kernel")
    missed(gemma2_attention, *_gemma2_inputs(), why="option attention='gemm'", attention="gemm")
    # option attention="flash" overrides the decode-step rule, as it does for attention without a cap
    gm, ctx = rewrite(gemma2_attention, *_gemma2_inputs(Lq=1), attention="flash")
    assert ctx.fired.get("attention") == 1 and [f for f, _ in ctx.forms.values()] == ["flash"], ctx.missed
    check_same(gemma2_attention, gm, *_gemma2_inputs(Lq=1))

    def weights_returned(q, k, v, mask):
        s = torch.tanh(torch.matmul(q, k.transpose(2, 3)) * D ** -0.5 / 2.0) * 2.0
        p = torch.softmax(s + mask, -1)
        return torch.matmul(p, v), p

    missed(weights_returned, *_gemma2_inputs(), why="probabilities are read elsewhere")

    def tanh_read_twice(q, k, v, mask):  # the capped scores are an output too: nothing to fuse them into
        t = torch.tanh(torch.matmul(q, k.transpose(2, 3)) * 0.25)
        return torch.matmul(torch.softmax(t * 2.0 + mask, -1), v), t

    gm, ctx = rewrite(tanh_read_twice, *_gemma2_inputs())
    assert "attention" not in ctx.fired
    check_same(tanh_read_twice, gm, *_gemma2_inputs())


def test_cost_model_long_causal_attention_takes_dmfxs_kernel():
    """Causal float32 attention without dropout on the CPU: in inference PyTorch's SDPA below
    CAUSAL_FLASH_MIN_KEYS keys (a tie), dmfx's fused kernel from there (it skips the keys past each
    block's diagonal: 1.3x SDPA at L=512, bench/RESULTS.md); in training dmfx's kernel at any length
    (a tie below, and the projections stack and the bias gradients fold into it). The results equal
    eager's either way."""
    from dmfx.passes.attention import CAUSAL_FLASH_MIN_KEYS

    def causal(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    q, k, v = (torch.randn(1, 2, 64, 8) for _ in range(3))
    gm, ctx = rewrite(causal, q, k, v)  # the call is left to PyTorch, with the reason
    assert not ctx.forms and any("ties dmfx's kernel" in m for m in ctx.missed), ctx.missed
    check_same(causal, gm, q, k, v)
    for L, grad in ((CAUSAL_FLASH_MIN_KEYS, False), (64, True)):
        q, k, v = (torch.randn(1, 2, L, 8, requires_grad=grad) for _ in range(3))
        gm, ctx = rewrite(causal, q, k, v)
        assert [f for f, _ in ctx.forms.values()] == ["flash"], ctx.forms
        check_same(causal, gm, q, k, v)


def bloom_attention(q, k, v, alibi, mask, beta=1.0, scale=D ** -0.5):
    """HF BLOOM's eager attention: ALiBi through baddbmm on [B*H, L, D] views, the mask, an fp32 softmax,
    bmm with v (q, k, v given as [B, H, L, D])."""
    Bq, Hq, Lq, Dq = q.shape
    s = alibi.baddbmm(q.reshape(Bq * Hq, Lq, Dq), k.reshape(Bq * Hq, -1, Dq).transpose(-1, -2), beta=beta, alpha=scale)
    w = s.view(Bq, Hq, Lq, -1)
    if mask is not None:
        w = w + mask
    p = torch.softmax(w, -1, dtype=torch.float32).to(q.dtype)
    return torch.bmm(p.view(Bq * Hq, Lq, -1), v.reshape(Bq * Hq, -1, Dq)).view(Bq, Hq, Lq, Dq)


def _alibi(Lk=L, batch=B):
    """BLOOM's ALiBi: slope_h * key position, [B*H, 1, Lk] (its translation invariance leaves out the query's)."""
    slopes = 2.0 ** (-8.0 * torch.arange(1, H + 1) / H)
    return (slopes[:, None, None] * torch.arange(Lk)).repeat(batch, 1, 1)


def _causal_bloom(q, k, v, alibi):  # the causal mask built in the graph, as HF's create_causal_mask traces
    Lq, Lk = q.shape[2], k.shape[2]
    keep = torch.arange(Lk)[None, None, None, :] <= (torch.arange(Lq) + Lk - Lq)[None, None, :, None]
    mask = torch.where(keep.expand(q.shape[0], -1, -1, -1), torch.zeros(()), torch.full((), torch.finfo(q.dtype).min))
    return bloom_attention(q, k, v, alibi, mask)


def _grads_match(fn, gm, args, n):
    out, want = gm(*args)[0], fn(*args)
    R = torch.randn_like(want)
    got = torch.autograd.grad((out * R).sum(), args[:n])
    exp = torch.autograd.grad((want * R).sum(), args[:n])
    scale = max(g.abs().max() for g in exp)
    assert all(((a - b).abs().max() / scale) < 1e-5 for a, b in zip(got, exp))


def test_alibi_scores_are_one_flash_attention_with_the_bias_as_its_mask():
    """BLOOM's ``alibi.baddbmm(q, k_t, beta, alpha)`` under its causal mask: one dmfx::flash_attention with
    causal=True, the scale alpha * scale and the [B, H, 1, Lk] bias (times beta * scale) as its mask, so no
    [B, H, L, L] scores or mask exist; values and gradients (random cotangent) are eager's."""
    q, k, v = ((torch.randn(B, L, H, D)).transpose(1, 2) for _ in range(3))
    alibi = _alibi()
    for training in (False, True):
        args = [t.detach().requires_grad_(training) for t in (q, k, v)] + [alibi]
        gm, ctx = rewrite(_causal_bloom, *args)
        assert ctx.fired.get("attention") == 1, ctx.missed
        (att,) = [n for n in gm.graph.nodes if n.target is dmfx_ops.flash_attention.default]
        assert att.args[5] is True and math.isclose(att.args[4], D ** -0.5, rel_tol=1e-12)
        assert list(att.args[3].meta["val"].shape) == [B, H, 1, L]
        assert not {aten.baddbmm.default, aten.bmm.default, aten.where.self} & set(targets(gm))
        check_same(_causal_bloom, gm, *args)
    _grads_match(_causal_bloom, gm, args, 3)


@pytest.mark.parametrize("beta,scale", [(1.0, 0.5), (0.5, 0.25)])
def test_alibi_with_a_padding_mask_sums_the_two_into_one_per_key_mask(beta, scale):
    """A [B, 1, 1, Lk] padding mask and the bias sum to a [B, H, 1, Lk] mask (no larger than the bias);
    beta and alpha land in the mask and the scale. Values and gradients are eager's."""
    mask = torch.zeros(B, 1, 1, L)
    mask[1, ..., :2] = torch.finfo(torch.float32).min  # left padding
    args = [torch.randn(B, L, H, D).transpose(1, 2).requires_grad_() for _ in range(3)] + [_alibi(), mask]

    def fn(q, k, v, alibi, mask):
        return bloom_attention(q, k, v, alibi, mask, beta=beta, scale=scale)

    gm, ctx = rewrite(fn, *args)
    assert ctx.fired.get("attention") == 1, ctx.missed
    assert aten.baddbmm.default not in targets(gm)
    check_same(fn, gm, *args)
    _grads_match(fn, gm, args, 3)


def test_alibi_decode_step_takes_sdpa_with_the_summed_mask():
    """One query row against a cache in inference: PyTorch's SDPA with the bias and the padding mask as
    one [B, H, 1, Lk] float mask."""
    mask = torch.zeros(B, 1, 1, L)
    mask[0, ..., :3] = torch.finfo(torch.float32).min
    q = torch.randn(B, H, 1, D)
    k, v = (torch.randn(B, L, H, D).transpose(1, 2) for _ in range(2))
    gm, ctx = rewrite(bloom_attention, q, k, v, _alibi(), mask)
    assert [f for f, _ in ctx.forms.values()] == ["sdpa"], (ctx.forms, ctx.missed)
    check_same(bloom_attention, gm, q, k, v, _alibi(), mask)


def test_alibi_near_misses_keep_the_fused_softmax():
    """Where the bias cannot become the fused forms' mask, the GEMMs stay around the fused softmax, with
    the reason: a [B, 1, Lq, Lk] mask (BLOOM's padded prefill: their sum would be as large as the scores)
    and a bias that requires grad."""
    q, k, v = (torch.randn(B, L, H, D).transpose(1, 2) for _ in range(3))
    full_mask = torch.zeros(B, 1, L, L)
    full_mask[1, ..., :2] = torch.finfo(torch.float32).min
    cases = [((q, k, v, _alibi(), full_mask), "would be larger than the bias"),
             ((q, k, v, _alibi().requires_grad_(), full_mask[:, :, :1]), "requires grad")]
    for args, why in cases:
        gm, ctx = rewrite(bloom_attention, *args)
        assert "attention" not in ctx.fired and ctx.fired.get("attention_softmax") == 1, ctx.fired
        assert any(m.startswith("attention at") and why in m for m in ctx.missed), ctx.missed
        check_same(bloom_attention, gm, *args)

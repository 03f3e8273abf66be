"""The lower_sdpa_calls fusion (passes/attention.py): a model's own scaled_dot_product_attention calls
go through the attention cost model and become dmfx::flash_attention where it picks dmfx's fused
kernel (gradients equal eager's, the bias gradients fold), or dmfx::attention where it picks the GEMM
form (bf16 training on the CPU); causal calls over different lengths, bf16 inference and a learned mask
stay PyTorch's, and one query row in inference (a decode step) too."""

import pytest
import torch
import torch.nn.functional as F
from conftest import rel_err
from test_pass_attention import B, E, L, _forms, _heads, _params

import dmfx

aten = torch.ops.aten


class _SdpaAttention(torch.nn.Module):
    """HF's "sdpa" implementation: the model calls scaled_dot_product_attention itself."""

    def __init__(self, causal=False):
        super().__init__()
        self.q, self.k, self.v, self.o = (torch.nn.Linear(E, E) for _ in range(4))
        self.causal = causal

    def forward(self, x, mask):
        q, k, v = (_heads(m(x)) for m in (self.q, self.k, self.v))
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.causal)
        return self.o(ctx.transpose(1, 2).reshape(B, L, E))


def _bool_mask():
    keep = torch.ones(B, 1, 1, L, dtype=torch.bool)
    keep[1, ..., 4:] = False
    return keep


@pytest.mark.parametrize("mask_kind", ["float", "bool", "none"])
def test_sdpa_call_becomes_dmfx_attention_in_training(mask_kind):
    """A model's own SDPA call in training without dropout: the cost model picks dmfx's fused kernel
    (SDPA's default scale made explicit, a bool mask read as True = attend), the bias gradients fold
    into its backward, and outputs and gradients equal eager's."""
    torch.manual_seed(0)
    model, ref = _SdpaAttention(), _SdpaAttention()
    ref.load_state_dict(model.state_dict())
    x = torch.randn(B, L, E, requires_grad=True)
    mask = {"float": _params()[-1], "bool": _bool_mask(), "none": None}[mask_kind]
    torch._dynamo.reset()
    dmfx.reset()
    out = torch.compile(model, backend="dmfx", options={"fallback": False, "stack_qkv": False})(x, mask)
    exp = ref(x, mask)
    assert rel_err(out, exp) < 1e-5
    R = torch.randn_like(exp)
    (out * R).sum().backward()
    gx, x.grad = x.grad, None
    (exp * R).sum().backward()
    assert rel_err(gx, x.grad) < 1e-5
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=name)
    (rec,) = dmfx.records()
    assert [f for f, _ in rec.attention_forms.values()] == ["flash"]
    assert rec.fired.get("fold_bias_grads") == 3, rec.fired  # the q, k and v bias sums
    assert not any("scaled_dot_product" in str(n.target) for n in rec.forward_graph.graph.nodes)


class _SdpaCross(torch.nn.Module):
    """SDPA calls with grouped-query k/v (enable_gqa, and an explicit scale) or repeated k/v, over keys
    of another length than the queries (cross-attention)."""

    def __init__(self, gqa, Hq=4, Hk=2, D=8, E=32):
        super().__init__()
        self.gqa, self.Hq, self.Hk, self.D = gqa, Hq, Hk, D
        self.q, self.k, self.v = torch.nn.Linear(E, Hq * D), torch.nn.Linear(E, Hk * D), torch.nn.Linear(E, Hk * D)

    def forward(self, x, y, mask):
        (b, lq, _), lk = x.shape, y.shape[1]
        q = self.q(x).view(b, lq, self.Hq, self.D).transpose(1, 2)
        k, v = (m(y).view(b, lk, self.Hk, self.D).transpose(1, 2) for m in (self.k, self.v))
        if self.gqa:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, scale=0.3)
        g = self.Hq // self.Hk
        return F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), attn_mask=mask)


@pytest.mark.parametrize("gqa", [True, False])
@pytest.mark.parametrize("mask_kind", ["bool2d", "float2d", "none"])
def test_sdpa_call_grouped_query_cross_attention_and_2d_masks(gqa, mask_kind):
    torch.manual_seed(0)
    Lq, Lk = 6, 9
    mask = {"bool2d": torch.rand(Lq, Lk) > 0.3, "float2d": torch.randn(Lq, Lk), "none": None}[mask_kind]
    model = _SdpaCross(gqa)
    x, y = torch.randn(2, Lq, 32, requires_grad=True), torch.randn(2, Lk, 32, requires_grad=True)
    torch._dynamo.reset()
    dmfx.reset()
    out = torch.compile(model, backend="dmfx", options={"fallback": False})(x, y, mask)
    ref = model(x, y, mask)
    assert rel_err(out, ref) < 1e-5
    g = torch.randn_like(ref)
    got, want = (torch.autograd.grad((o * g).sum(), (x, y)) for o in (out, ref))
    for a, b in zip(got, want):
        assert rel_err(a, b) < 1e-5
    assert [f for r in dmfx.records() for f, _ in r.attention_forms.values()] == ["flash"]


@pytest.mark.parametrize("case", ["self-float-mask", "self-bool-mask", "gqa-cross", "repeated-kv-cross"])
def test_bf16_training_sdpa_call_becomes_the_gemm_form(case):
    """bf16 training on the CPU over short keys: PyTorch's CPU SDPA kernel is slow backward there
    (bench/RESULTS.md), so the cost model picks dmfx's GEMM form and the call becomes dmfx::attention
    (grouped-query k/v and cross-attention included); outputs and gradients match eager's."""
    torch.manual_seed(0)
    if case.startswith("self"):
        model = _SdpaAttention().to(torch.bfloat16)
        mask = _params()[-1].bfloat16() if case == "self-float-mask" else _bool_mask()
        inputs = (torch.randn(B, L, E, dtype=torch.bfloat16, requires_grad=True), mask)
    else:
        model = _SdpaCross(gqa=case == "gqa-cross").to(torch.bfloat16)
        inputs = (torch.randn(2, 6, 32, dtype=torch.bfloat16, requires_grad=True),
                  torch.randn(2, 9, 32, dtype=torch.bfloat16, requires_grad=True), torch.rand(6, 9) > 0.3)
    torch._dynamo.reset()
    dmfx.reset()
    out = torch.compile(model, backend="dmfx", options={"fallback": False, "stack_qkv": False})(*inputs)
    ref = model(*inputs)
    assert rel_err(out.float(), ref.float()) < 2e-2
    g = torch.randn(ref.shape)
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    got, want = (torch.autograd.grad((o.float() * g).sum(), leaves) for o in (out, ref))
    for a, b in zip(got, want):
        assert rel_err(a.float(), b.float()) < 2e-2
    assert [f for r in dmfx.records() for f, _ in r.attention_forms.values()] == ["gemm"]
    for rec in dmfx.records():
        assert not any("scaled_dot_product" in str(n.target) for n in rec.forward_graph.graph.nodes)


def test_bf16_training_sdpa_call_with_a_learned_mask_differentiates_it():
    """A mask that requires grad (T5's position bias): the call is not lowered here (SDPA's own op
    differentiates that mask; restore_sdpa hands it back to AOTAutograd, whose math path the eager
    fusions take in the GEMM form, the one that computes a mask gradient). The bias's gradient is eager's."""
    torch.manual_seed(0)
    model = _SdpaAttention().to(torch.bfloat16)
    bias = torch.randn(1, 3, L, L, dtype=torch.bfloat16, requires_grad=True)
    x = torch.randn(B, L, E, dtype=torch.bfloat16, requires_grad=True)
    torch._dynamo.reset()
    dmfx.reset()
    out = torch.compile(model, backend="dmfx", options={"fallback": False})(x, bias)
    ref = model(x, bias)
    g = torch.randn(ref.shape)
    got, want = (torch.autograd.grad((o.float() * g).sum(), (x, bias)) for o in (out, ref))
    for a, b in zip(got, want):
        assert rel_err(a.float(), b.float()) < 2e-2
    assert [f for r in dmfx.records() for f, _ in r.attention_forms.values()] == ["gemm"]


def test_sdpa_call_near_misses_stay_pytorchs():
    """bf16 SDPA calls (no fused CPU kernel) keep PyTorch's op; an fp32 call in inference becomes dmfx's
    (0.99-1.11x SDPA there), and so does a causal one in training (a tie, and the projections stack)."""
    torch.manual_seed(0)
    x, mask = torch.randn(B, L, E, requires_grad=True), _params()[-1]
    assert _forms(_SdpaAttention(causal=True), x, None) == ["flash"]
    with torch.no_grad():
        assert _forms(_SdpaAttention().to(torch.bfloat16), x.bfloat16(), mask.bfloat16()) == []
        for rec in dmfx.records():
            assert any("scaled_dot_product" in str(n.target) for n in rec.inference_graph.graph.nodes)
        assert _forms(_SdpaAttention(), x, mask) == ["flash"]


def _causal(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


@pytest.mark.parametrize("attention", ["auto", "flash"])
def test_causal_sdpa_call_over_equal_lengths(attention):
    """A decoder's prefill: causal attention over equal query and key lengths (SDPA's top-left and
    dmfx's bottom-right alignments agree). The cost model leaves it to SDPA and says why;
    ``attention="flash"`` runs it in dmfx's causal kernel, with SDPA's result."""
    q, k, v = torch.randn(2, 4, 24, 16), torch.randn(2, 2, 24, 16), torch.randn(2, 2, 24, 16)
    k, v = (t.repeat_interleave(2, dim=1) for t in (k, v))
    with torch.no_grad():
        want = _causal(q, k, v)
        got = torch.compile(_causal, backend="dmfx", options={"fallback": False, "attention": attention})(q, k, v)
    assert rel_err(got, want) < 1e-5
    (rec,) = dmfx.records()
    if attention == "flash":
        (fused,) = [n for n in rec.inference_graph.graph.nodes if n.target is torch.ops.dmfx.flash_attention.default]
        assert fused.args[5] is True  # causal
    else:
        assert "lower_sdpa_calls" not in rec.fired
        assert any("left to PyTorch's scaled_dot_product_attention: causal" in m for m in rec.missed), rec.missed


def test_causal_sdpa_call_over_different_lengths_stays_pytorchs():
    q, k, v = torch.randn(2, 4, 3, 16), torch.randn(2, 4, 24, 16), torch.randn(2, 4, 24, 16)
    with torch.no_grad():
        want = _causal(q, k, v)
        got = torch.compile(_causal, backend="dmfx", options={"fallback": False, "attention": "flash"})(q, k, v)
    assert torch.equal(got, want)
    (rec,) = dmfx.records()
    assert any("different query and key lengths" in m for m in rec.missed), rec.missed

"""The cross_entropy fusion (passes/cross_entropy.py): ``nll_loss_forward(_log_softmax(z, 1), target)``
becomes dmfx::cross_entropy, with HF's float32 upcast of low-precision logits absorbed; the near-misses
(a class weight, another dim, log-probabilities read elsewhere, 1-D logits, nll_loss's total weight read)
are left alone with their reason. End to end: HF's causal-LM, masked-LM and sequence-classification
losses fire it, and a compiled training step's loss and gradients equal eager's, with a random cotangent
on the logits the model also returns (the gradient fold_logits_grad adds in the kernel) and without one."""

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import check_same, rel_err, rewrite

import dmfx

aten, dmfx_ops = torch.ops.aten, torch.ops.dmfx


def _fused(gm):
    return [n for n in gm.graph.nodes if n.target is dmfx_ops.cross_entropy.default]


def _aten(gm, *ops):
    return [n for n in gm.graph.nodes if getattr(n.target, "overloadpacket", None) in ops]


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_fires_on_f_cross_entropy(reduction):
    def fn(z, t):
        return F.cross_entropy(z, t, reduction=reduction)

    z, t = torch.randn(12, 37), torch.randint(0, 37, (12,))
    t[::4] = -100
    gm, ctx = rewrite(fn, z, t)
    assert ctx.fired.get("cross_entropy") == 1
    (n,) = _fused(gm)
    assert n.args[2:] == (-100, 0.0, {"none": 0, "mean": 1, "sum": 2}[reduction])
    assert not _aten(gm, aten._log_softmax, aten.nll_loss_forward)
    check_same(fn, gm, z, t, tol=1e-6)


def _causal_lm_loss(logits, labels, num_items=None):
    """transformers' ForCausalLMLoss: upcast, labels shifted by a pad, flattened, sum / num_items or mean."""
    logits = logits.float()
    labels = F.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
    V = logits.shape[-1]
    reduction = "sum" if num_items is not None else "mean"
    loss = F.cross_entropy(logits.view(-1, V), labels.view(-1), ignore_index=-100, reduction=reduction)
    return loss / num_items if num_items is not None else loss


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("num_items", [None, 23])
def test_hf_causal_lm_loss_absorbs_the_upcast(dtype, num_items):
    logits, labels = torch.randn(2, 9, 50).to(dtype), torch.randint(0, 50, (2, 9))
    fn = lambda z, y: _causal_lm_loss(z, y, num_items)  # noqa: E731
    gm, ctx = rewrite(fn, logits, labels)
    assert ctx.fired.get("cross_entropy") == 1
    (n,) = _fused(gm)
    assert n.args[0].meta["val"].dtype == dtype and n.meta["val"][0].dtype == torch.float32
    assert not _aten(gm, aten._to_copy)  # the upcast is read by nothing else: absorbed
    check_same(fn, gm, logits, labels, tol=1e-6)


def test_low_precision_logits_without_the_upcast_keep_the_loss_dtype():
    fn = lambda z, t: F.cross_entropy(z, t)  # noqa: E731
    z, t = torch.randn(10, 40).bfloat16(), torch.randint(0, 40, (10,))
    gm, ctx = rewrite(fn, z, t)
    assert ctx.fired.get("cross_entropy") == 1
    out = gm(z, t)[0]
    # eager rounds the log-probabilities to bf16; the kernel accumulates in fp32 and rounds the loss once
    assert out.dtype == torch.bfloat16 and rel_err(out, F.cross_entropy(z.float(), t)) < 4e-3


def test_an_upcast_read_elsewhere_stays_and_its_float32_copy_is_read():
    def fn(z, t):
        zf = z.float()
        return F.cross_entropy(zf, t), zf.sum()

    z, t = torch.randn(6, 30).bfloat16(), torch.randint(0, 30, (6,))
    gm, ctx = rewrite(fn, z, t)
    (n,) = _fused(gm)
    assert ctx.fired.get("cross_entropy") == 1 and n.args[0].meta["val"].dtype == torch.float32
    check_same(fn, gm, z, t, tol=1e-6)


def _log_probs_read_elsewhere(z, t):
    log_probs = F.log_softmax(z, -1)
    return F.nll_loss(log_probs, t), log_probs.exp()


def test_near_misses_are_left_alone_with_their_reason():
    z, t, w = torch.randn(8, 12), torch.randint(0, 12, (8,)), torch.rand(12)
    cases = {
        "a class weight": (lambda z, t, w: F.cross_entropy(z, t, weight=w), (z, t, w)),
        "not the class dim": (lambda z, t: F.nll_loss(F.log_softmax(z, dim=0), t), (z, t)),
        "read elsewhere": (_log_probs_read_elsewhere, (z, t)),
        "not [N, V]": (lambda z, t: F.cross_entropy(z, t), (z[0], t[0])),
        "total weight": (lambda z, t: aten.nll_loss_forward(F.log_softmax(z, -1), t, None, 1, -100), (z, t)),
    }
    for why, (fn, args) in cases.items():
        gm, ctx = rewrite(fn, *args)
        assert "cross_entropy" not in ctx.fired, why
        assert any(m.startswith("cross_entropy at") and why in m for m in ctx.missed), (why, ctx.missed)
        check_same(fn, gm, *args)


def test_a_spatial_loss_is_not_this_pattern():
    fn = lambda z, t: F.cross_entropy(z, t)  # noqa: E731  ([N, C, L]: nll_loss2d, another op)
    z, t = torch.randn(2, 5, 7), torch.randint(0, 5, (2, 7))
    gm, ctx = rewrite(fn, z, t)
    assert "cross_entropy" not in ctx.fired and not any(m.startswith("cross_entropy") for m in ctx.missed)
    check_same(fn, gm, z, t)


# ------------------------------------------------------------------------------------- HF models


def _hf(kind: str, dtype=torch.float32):
    """A tiny HF model with a loss head, and its keyword inputs with labels."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    ids = torch.randint(3, 60, (2, 9))
    if kind == "causal_lm":
        cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                                       num_hidden_layers=1, vocab_size=60, max_position_embeddings=64, use_cache=False)
        model, labels = transformers.LlamaForCausalLM(cfg), ids.clone()
        labels[1, 6:] = -100
    else:
        cfg = transformers.BertConfig(vocab_size=60, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                      intermediate_size=64, max_position_embeddings=64, num_labels=3,
                                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        if kind == "masked_lm":
            model, labels = transformers.BertForMaskedLM(cfg), torch.where(torch.rand(2, 9) < 0.4, ids, -100)
        else:
            model, labels = transformers.BertForSequenceClassification(cfg), torch.tensor([0, 2])
    model.config._attn_implementation = "eager"
    return model.to(dtype).train(), {"input_ids": ids, "labels": labels}


def _step(model, inputs, R):
    out = model(**inputs)
    loss = out.loss * 1.7 + ((out.logits * R).sum() if R is not None else 0.0)
    loss.backward()
    return out.loss.detach()


@pytest.mark.parametrize("logits_grad", [True, False])
@pytest.mark.parametrize("kind", ["causal_lm", "masked_lm", "sequence_classification"])
def test_hf_losses_fire_and_a_training_step_matches_eager(kind, logits_grad):
    model, inputs = _hf(kind)
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend="dmfx", options={"fallback": False})
    logits_shape = ref(**inputs).logits.shape
    ref.zero_grad()
    R = torch.randn(logits_shape) if logits_grad else None
    loss = _step(compiled, inputs, R)
    want = _step(ref, inputs, R)
    record = dmfx.records()[-1]
    assert record.fired.get("cross_entropy") == 1 and record.fired.get("fold_logits_grad") == 1, record.fired
    ops = [n.target for n in record.backward_graph.graph.nodes if n.op == "call_function"]
    assert dmfx_ops.cross_entropy_backward.default in ops and aten._log_softmax_backward_data.default not in ops
    assert rel_err(loss, want) < 1e-6
    grads = [(n, p.grad, q.grad) for (n, p), q in zip(model.named_parameters(), ref.parameters()) if q.grad is not None]
    largest = max(g.norm() for _, _, g in grads)
    for name, got, exp in grads:
        assert rel_err(got, exp, scale=largest) < 1e-5, name


def test_bf16_causal_lm_reads_the_bf16_logits():
    model, inputs = _hf("causal_lm", torch.bfloat16)
    ref = copy.deepcopy(model)
    out = torch.compile(model, backend="dmfx", options={"fallback": False})(**inputs)
    record = dmfx.records()[-1]
    (n,) = [n for n in record.forward_graph.graph.nodes if n.target is dmfx_ops.cross_entropy.default]
    assert n.args[0].meta["val"].dtype == torch.bfloat16
    want = ref(**inputs).loss
    assert out.loss.dtype == want.dtype == torch.float32
    assert rel_err(out.loss, want) < 1e-2  # (bf16 layers before it: not bit for bit)

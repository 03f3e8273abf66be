"""The accumulate_embedding_grad pass (passes/backward/accumulate_embedding_grad.py): a tied
embedding's gradient, ``add(mm, embedding_dense_backward(...))``, becomes ``index_put_`` into the GEMM's
own result. On hand-built backward graphs (padding_idx honoured, near-misses left alone) and on HF
models whose LM head shares the input embedding (BERT MLM, GPT-2), both compilers, against eager."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import assert_pass_declines, max_rel_err, run_pass, targets, trace_fake

import dmfx
from dmfx.passes.backward import accumulate_embedding_grad

aten = torch.ops.aten
V, H = 40, 16


def _tied(pad):
    def f(dlogits, hidden, g, idx):
        head = (dlogits.t() @ hidden).t().t()  # AOTAutograd's t(t(mm)) for F.linear's weight gradient
        return head + aten.embedding_dense_backward(g, idx, V, pad, False)
    return f


def _args(n=12):
    idx = torch.randint(0, V, (2, n // 2))
    idx[0, :3] = 0  # padding tokens (index 0) and repeated tokens
    idx[1, :2] = 7
    return torch.randn(n, V), torch.randn(n, H), torch.randn(2, n // 2, H), idx


@pytest.mark.parametrize("pad", [0, -1], ids=["padding_idx", "no_padding_idx"])
def test_fires_and_adds_the_token_rows_into_the_gemm_result(pad):
    args = _args()
    gm = trace_fake(_tied(pad), *args)
    ref, got, ctx = run_pass(gm, accumulate_embedding_grad, *args)
    assert ctx.fired == {"accumulate_embedding_grad": 1}
    t = targets(gm)
    assert aten.embedding_dense_backward.default not in t and aten.add.Tensor not in t
    assert t.count(aten.index_put_.default) == 1
    assert max_rel_err(got, ref) < 1e-6
    if pad == 0:  # row 0 gets only the head's gradient
        dlogits, hidden, _, _ = args
        assert torch.equal(got[0], (dlogits.t() @ hidden)[0])


def _upcast_head(dlogits, hidden, g, idx):
    """Under autocast: the head's GEMM in bf16, its weight gradient upcast to the embedding's float32."""
    head = (dlogits.t() @ hidden).t().t()
    return aten._to_copy(head, dtype=torch.float32) + aten.embedding_dense_backward(g, idx, V, 0, False)


def _bf16_args():
    dlogits, hidden, g, idx = _args()
    return dlogits.bfloat16(), hidden.bfloat16(), g, idx


def test_fires_through_the_upcast_of_a_bf16_head_gradient():
    args = _bf16_args()
    gm = trace_fake(_upcast_head, *args)
    ref, got, ctx = run_pass(gm, accumulate_embedding_grad, *args)
    assert ctx.fired == {"accumulate_embedding_grad": 1}
    t = targets(gm)
    assert aten.embedding_dense_backward.default not in t and aten.add.Tensor not in t
    assert t.count(aten.index_put_.default) == 1 and t.count(aten._to_copy.default) == 1
    assert got.dtype == torch.float32
    assert max_rel_err(got, ref) < 1e-6  # the same float32 sums, in another order
    dlogits, hidden, _, _ = args
    assert torch.equal(got[0], (dlogits.t() @ hidden)[0].float())  # the padding row: the head's alone


def _declined(fn, args, why):
    assert_pass_declines(accumulate_embedding_grad, fn, args, aten.index_put_.default, 1e-6, why)


def test_near_misses_are_left_alone():
    def scaled_by_frequency(dlogits, hidden, g, idx):
        return dlogits.t() @ hidden + aten.embedding_dense_backward(g, idx, V, -1, True)

    def gemm_read_later(dlogits, hidden, g, idx):  # the head's gradient is returned on its own too
        head = dlogits.t() @ hidden
        return head + aten.embedding_dense_backward(g, idx, V, -1, False), head

    def not_a_gemm(dlogits, hidden, g, idx):  # an elementwise result, not a GEMM's: not this pattern
        w = (dlogits.t() @ hidden) * 2
        return w + aten.embedding_dense_backward(g, idx, V, -1, False)

    args = _args()
    _declined(scaled_by_frequency, args, "scales its gradient by token frequency")
    _declined(gemm_read_later, args, "read later")
    _declined(not_a_gemm, args, None)

    def upcast_read_later(dlogits, hidden, g, idx):  # the upcast copy is returned on its own too
        head = aten._to_copy(dlogits.t() @ hidden, dtype=torch.float32)
        return head + aten.embedding_dense_backward(g, idx, V, -1, False), head

    def upcast_to_another_dtype(dlogits, hidden, g, idx):  # float64 head + float32 embedding: promotion
        head = aten._to_copy(dlogits.t() @ hidden, dtype=torch.float64)
        return head + aten.embedding_dense_backward(g, idx, V, -1, False)

    def upcast_with_a_memory_format(dlogits, hidden, g, idx):  # not a plain dtype conversion: not this pattern
        head = aten._to_copy(dlogits.t() @ hidden, dtype=torch.float32, memory_format=torch.contiguous_format)
        return head + aten.embedding_dense_backward(g, idx, V, -1, False)

    bf16 = _bf16_args()
    _declined(upcast_read_later, bf16, "read later")
    _declined(upcast_to_another_dtype, bf16, None)  # (a promoting add is not a plain add)
    _declined(upcast_with_a_memory_format, bf16, None)


def _bert_mlm():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(vocab_size=300, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0, pad_token_id=0)
    cfg._attn_implementation = "eager"
    return transformers.BertForMaskedLM(cfg)


def _gpt2_lm():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=300, n_positions=64, n_embd=32, n_layer=1, n_head=2, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    cfg._attn_implementation = "eager"
    return transformers.GPT2LMHeadModel(cfg)


@pytest.mark.parametrize("autocast", [None, torch.bfloat16], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("compiler", ["fx", "inductor"])
@pytest.mark.parametrize("build", [_bert_mlm, _gpt2_lm], ids=["bert-mlm", "gpt2-lm"])
def test_tied_lm_heads_fire_and_match_eager(build, compiler, autocast):
    """A training step with the model's own loss and a random cotangent on the returned logits: every
    parameter's gradient (the tied embedding's above all) is eager's, each judged against the largest.
    Under bf16 autocast the head's GEMM runs in bf16 and its weight gradient is upcast before the
    embedding's rows are added: the rows go into the upcast copy (bf16 tolerance: both sides round
    the GEMMs to bf16, in differently fused graphs)."""
    torch.manual_seed(0)
    model = build().train()
    ref = copy.deepcopy(model)
    ids = torch.randint(1, 300, (2, 12))
    ids[0, :3] = 0  # BERT's padding token: its embedding row gets no gradient from the input side
    labels = ids.clone()
    labels[1, 8:] = -100
    opts = {"fallback": False, "compiler": compiler, "fuse": "all"}
    amp = torch.autocast("cpu", dtype=autocast, enabled=autocast is not None)
    with amp:
        out = torch.compile(model, backend="dmfx", options=opts)(input_ids=ids, labels=labels)
    with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
        want = ref(input_ids=ids, labels=labels)
    R = torch.randn(want.logits.shape)
    (out.loss + (out.logits.float() * R).sum()).backward()
    (want.loss + (want.logits.float() * R).sum()).backward()
    assert any(r.fired.get("accumulate_embedding_grad") for r in dmfx.records()), [r.fired for r in dmfx.records()]
    scale = max(q.grad.abs().max() for q in ref.parameters() if q.grad is not None)
    tol = 1e-5 if autocast is None else 2e-2
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        if q.grad is not None:
            assert ((p.grad - q.grad).abs().max() / scale).item() < tol, name

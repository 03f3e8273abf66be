"""The unpad pass (passes/unpad.py, option ``unpad=True``): a padded encoder batch runs on its real
tokens alone. Outputs at real positions and every parameter gradient equal eager's, padding positions
hold zeros, a batch with another number of real tokens runs the same graph, and whatever is not an
HF padding mask is left alone with the reason recorded."""

import sys

import pytest
import torch

import dmfx

transformers = pytest.importorskip("transformers")

UNPAD = {"unpad": True, "fuse": "all"}
# tests that read the compiled graphs: never from the compile cache (on a hit there are none to read;
# the suite runs compiler="fx", which caches nothing, but DMFX_COMPILER=inductor runs it too)
UNPAD_GRAPHS = {**UNPAD, "cache": False}
SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
             hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def encoder(family: str, impl: str = "eager"):
    """A small HF encoder of `family` (dropout off) and its padding token id."""
    if family == "bert":
        return transformers.BertModel(transformers.BertConfig(vocab_size=100, attn_implementation=impl, **SMALL)), 0
    if family == "roberta":
        cfg = transformers.RobertaConfig(vocab_size=100, pad_token_id=1, attn_implementation=impl, **SMALL)
        return transformers.RobertaModel(cfg), 1
    if family == "distilbert":
        cfg = transformers.DistilBertConfig(vocab_size=100, dim=32, n_layers=2, n_heads=4, hidden_dim=64, dropout=0.0,
                                            attention_dropout=0.0, attn_implementation=impl)
        return transformers.DistilBertModel(cfg), 0
    if family == "bart":
        cfg = transformers.BartConfig(vocab_size=100, d_model=32, encoder_layers=2, decoder_layers=1,
                                      encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                      decoder_ffn_dim=64, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                                      attn_implementation=impl)
        return transformers.BartModel(cfg).get_encoder(), 1
    if family == "t5":
        cfg = transformers.T5Config(vocab_size=100, d_model=32, d_kv=8, num_layers=2, num_heads=4, d_ff=64,
                                    dropout_rate=0.0, attn_implementation=impl)
        return transformers.T5EncoderModel(cfg), 0
    raise ValueError(family)


def padded_batch(B=3, S=9, pad_id=0, lengths=(5, 9, 7), left=False, holes=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 100, (B, S), generator=g)
    pos = torch.arange(S)
    mask = (pos[None, :] < torch.tensor(lengths)[:, None]).long()
    if left:
        mask = mask.flip(1)
    if holes:
        mask[0, 1] = 0
        mask[2, 3] = 0
    ids = torch.where(mask.bool(), ids, torch.full_like(ids, pad_id))
    return ids, mask


def unpad_misses(record):
    return [m for m in record.missed if m.startswith("unpad")]


def forward_and_grads(model, run, ids, mask, R, params):
    for p in params:
        p.grad = None
    out = run(input_ids=ids, attention_mask=mask).last_hidden_state
    (out * R).sum().backward()
    return out.detach(), [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in params]


def unpadded_matches_eager(model, ids, mask):
    """The model's last hidden state compiled with unpad, checked equal to eager's at the real positions;
    returns it and the real positions' mask."""
    compiled = torch.compile(model, backend="dmfx", options=UNPAD_GRAPHS)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).last_hidden_state
        out = compiled(input_ids=ids, attention_mask=mask).last_hidden_state
    real = mask.bool()
    assert torch.allclose(out[real], ref[real], atol=1e-5)
    return out, real


def assert_grads_equal(grads, ref, tol=1e-5):
    """Each gradient judged relative to the largest one (some, such as a key bias's, are zero
    analytically: rounding alone)."""
    top = max(g.abs().max().item() for g in ref)
    for g, r in zip(grads, ref):
        assert (g - r).abs().max().item() <= tol * top


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_bert_inference_runs_on_real_tokens(impl):
    model, pad = encoder("bert", impl)
    model.eval()
    ids, mask = padded_batch(pad_id=pad)
    out, real = unpadded_matches_eager(model, ids, mask)
    assert torch.equal(out[~real], torch.zeros_like(out[~real]))  # padding positions: zeros
    (record,) = dmfx.records()
    assert record.fired.get("unpad") == 2, record.summary()  # both layers' attention
    assert not unpad_misses(record)
    graph = record.inference_graph
    assert sum(n.target is torch.ops.dmfx.unpad_index.default for n in graph.graph.nodes) == 1
    assert sum(n.target is torch.ops.dmfx.varlen_attention.default for n in graph.graph.nodes) == 2


@pytest.mark.parametrize("family,impl", [("bert", "eager"), ("bert", "sdpa"), ("roberta", "sdpa"),
                                         ("distilbert", "eager"), ("bart", "eager"), ("bart", "sdpa")])
def test_training_gradients_equal_eager(family, impl):
    model, pad = encoder(family, impl)
    model.train()
    ids, mask = padded_batch(pad_id=pad)
    real = mask.bool()
    R = torch.randn(*ids.shape, 32) * real[..., None]  # the padding positions' outputs reach no loss
    params = list(model.parameters())
    ref, ref_grads = forward_and_grads(model, model, ids, mask, R, params)
    out, grads = forward_and_grads(model, torch.compile(model, backend="dmfx", options=UNPAD), ids, mask, R, params)
    assert torch.allclose(out[real], ref[real], atol=1e-5)
    assert_grads_equal(grads, ref_grads)
    record = dmfx.records()[-1]
    assert record.fired.get("unpad") == 2, record.summary()


@pytest.mark.parametrize("layout", ["left", "holes"])
def test_left_padding_and_holes(layout):
    """Left padding, and padding in the middle of a sequence: the packed sequences are each row's real
    tokens in order; positions come from the padded layout (computed before the gather), as in eager."""
    model, pad = encoder("bert")
    model.eval()
    ids, mask = padded_batch(pad_id=pad, left=layout == "left", holes=layout == "holes")
    out, real = unpadded_matches_eager(model, ids, mask)
    assert dmfx.records()[-1].fired.get("unpad") == 2


def test_another_batch_runs_the_same_graph():
    """The number of real tokens is a data-dependent size: new batches (any padding, none, one real
    token per row) neither recompile nor rebuild."""
    model, pad = encoder("bert")
    model.eval()
    compiled = torch.compile(model, backend="dmfx", options=UNPAD)
    cases = [(5, 9, 7), (9, 9, 9), (1, 1, 1), (2, 8, 3)]
    with torch.no_grad():
        for lengths in cases:
            ids, mask = padded_batch(pad_id=pad, lengths=lengths)
            ref = model(input_ids=ids, attention_mask=mask).last_hidden_state
            out = compiled(input_ids=ids, attention_mask=mask).last_hidden_state
            real = mask.bool()
            assert torch.allclose(out[real], ref[real], atol=1e-5), lengths
    assert len(dmfx.records()) == 1


def test_a_row_of_padding_only_gives_zeros():
    model, pad = encoder("bert")
    model.eval()
    ids, mask = padded_batch(pad_id=pad, lengths=(4, 0, 9))
    out, real = unpadded_matches_eager(model, ids, mask)
    assert torch.equal(out[1], torch.zeros_like(out[1]))


def test_a_mask_that_is_not_0_1_raises():
    model, pad = encoder("bert")
    model.eval()
    ids, mask = padded_batch(pad_id=pad)
    compiled = torch.compile(model, backend="dmfx", options=UNPAD)
    with torch.no_grad():
        compiled(input_ids=ids, attention_mask=mask)
        with pytest.raises(ValueError, match="must hold only 0 .padding. and 1"):
            compiled(input_ids=ids, attention_mask=mask * 2)


def _heads():
    cfg = transformers.BertConfig(vocab_size=100, num_labels=3, **SMALL)
    return {
        "sequence classification": (transformers.BertForSequenceClassification(cfg), "sequence"),
        "token classification": (transformers.BertForTokenClassification(cfg), "token"),
        "masked LM": (transformers.BertForMaskedLM(cfg), "token"),
    }


def loss_and_grads(model, run=None, **kw):
    """The loss of `run` (default: `model`) on kw, and every parameter's gradient of it."""
    params = list(model.parameters())
    for p in params:
        p.grad = None
    loss = (model if run is None else run)(**kw).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params]


@pytest.mark.parametrize("head", ["sequence classification", "token classification", "masked LM"])
def test_fine_tuning_heads_gradients_equal_eager(head):
    """The issue's fine-tuning steps: the loss reads only real positions (the first token; labels
    -100 at the padding), so every parameter gradient is eager's."""
    model, kind = _heads()[head]
    model.train()
    ids, mask = padded_batch()
    if kind == "sequence":
        labels = torch.tensor([0, 2, 1])
    else:
        vocab = model.config.vocab_size if head == "masked LM" else 3
        labels = torch.randint(0, vocab, ids.shape).masked_fill(~mask.bool(), -100)
    ref_loss, ref_grads = loss_and_grads(model, input_ids=ids, attention_mask=mask, labels=labels)
    loss, grads = loss_and_grads(model, torch.compile(model, backend="dmfx", options=UNPAD_GRAPHS), input_ids=ids,
                                 attention_mask=mask, labels=labels)
    assert torch.allclose(loss, ref_loss, rtol=1e-5)
    assert_grads_equal(grads, ref_grads)
    rec = dmfx.records()[-1]
    assert rec.fired.get("unpad") == 2
    if head == "masked LM":  # the logits, returned and read by the loss, are scattered back once
        V = model.config.vocab_size
        scatters = [n for n in rec.forward_graph.graph.nodes
                    if n.target is torch.ops.aten.index_copy.default and n.meta["val"].shape[-1] == V]
        assert len(scatters) == 1, scatters
        # the logits' own (zero) gradient, gathered back to the packed rows through two views, is
        # added by the loss backward's kernel, not by a pass of its own over [tokens, vocab]
        assert rec.fired.get("fold_logits_grad") == 1, rec.fired
    if kind == "token":  # the loss over every position reads the real rows' logits alone
        (ce,) = [n for n in rec.forward_graph.graph.nodes if n.target is torch.ops.dmfx.cross_entropy.default]
        assert isinstance(ce.args[0].meta["val"].shape[0], torch.SymInt), ce.args[0].meta["val"].shape


def test_question_answering_loss_over_the_positions_is_left_alone():
    """BertForQuestionAnswering's loss is a cross-entropy over the positions of each sequence, the
    padding's logits included (eager computes values there; unpadded they would be zeros): the pass
    leaves the graph alone and names the loss, and the loss and every gradient are eager's. (Unpadded,
    the loss was 2.193 against eager's 2.190, silently.)"""
    cfg = transformers.BertConfig(vocab_size=100, attn_implementation="eager", **SMALL)
    model = transformers.BertForQuestionAnswering(cfg).train()
    ids, mask = padded_batch()
    kw = dict(input_ids=ids, attention_mask=mask, start_positions=torch.tensor([1, 2, 0]),
              end_positions=torch.tensor([3, 5, 4]))
    ref_loss, ref_grads = loss_and_grads(model, **kw)
    loss, grads = loss_and_grads(model, torch.compile(model, backend="dmfx", options=UNPAD_GRAPHS), **kw)
    assert torch.allclose(loss, ref_loss, rtol=1e-5)
    assert_grads_equal(grads, ref_grads)
    record = dmfx.records()[-1]
    assert "unpad" not in record.fired
    assert any("cross_entropy" in m and "padding positions included" in m for m in unpad_misses(record)), record.missed


@pytest.mark.parametrize("B,S", [(2, 16), (4, 16)], ids=["B*S=hidden", "B*S=ffn"])
def test_weights_shaped_like_token_tensors_are_still_weights(B, S):
    """A weight with a dim equal to B * S (BERT-base's 768 hidden at B=6, S=128; its 3072 FFN at B=24)
    has a token tensor's shape; it is a linear layer's weight all the same (made from parameters), so
    every GEMM runs on the real tokens, with eager's gradients. (Before, such a batch ran every GEMM
    on the padded rows.)"""
    model = transformers.BertModel(transformers.BertConfig(vocab_size=100, attn_implementation="eager", **SMALL))
    model.train()
    lengths = [S] + [S // 2 + i for i in range(B - 1)]
    ids, mask = padded_batch(B=B, S=S, lengths=lengths)
    assert B * S in (SMALL["hidden_size"], SMALL["intermediate_size"])
    params = list(model.parameters())
    R = torch.randn(B, S, SMALL["hidden_size"], generator=torch.Generator().manual_seed(3)) * mask[..., None]
    ref, ref_grads = forward_and_grads(model, model, ids, mask, R, params)
    out, grads = forward_and_grads(model, torch.compile(model, backend="dmfx", options=UNPAD_GRAPHS), ids, mask, R,
                                   params)
    real = mask.bool()
    assert torch.allclose(out[real], ref[real], atol=1e-5)
    assert_grads_equal(grads, ref_grads)
    rec = dmfx.records()[-1]
    gemms = [n for n in rec.forward_graph.graph.nodes if n.op == "call_function"
             and n.target in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)]
    rows = [n.meta["val"].shape[0] for n in gemms]
    packed = [r for r in rows if isinstance(r, torch.SymInt)]
    padded = [r for r in rows if isinstance(r, int) and r == B * S]  # (the pooler's GEMM has B rows)
    assert len(packed) >= 8 and not padded, rows  # (Q, K, V (or QKV), O, FFN up and down, per layer)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_a_loss_over_every_position_is_the_loss_over_the_real_ones(reduction):
    """The contract for a loss over every position (the module docstring): it is eager's loss over the
    real positions, which is eager's whole loss when padding holds the label -100. A padding label
    that is not ignored is a term eager counts from logits unpad does not compute: that raises, naming
    the position, when the graph runs (the labels are data)."""
    model = transformers.BertForTokenClassification(transformers.BertConfig(vocab_size=100, num_labels=5, **SMALL))
    model.train()
    ids, mask = padded_batch()
    labels = torch.randint(0, 5, ids.shape, generator=torch.Generator().manual_seed(4))
    real_labels = labels.masked_fill(~mask.bool(), -100)

    def loss_of(run, y):
        logits = run(input_ids=ids, attention_mask=mask).logits
        loss = torch.nn.functional.cross_entropy(logits.view(-1, 5), y.view(-1), reduction=reduction)
        return loss if reduction != "none" else loss[mask.view(-1).bool()]

    params = list(model.parameters())
    want = loss_of(model, real_labels)
    want.sum().backward()
    ref_grads = [p.grad.clone() for p in params]
    model.zero_grad(set_to_none=True)
    compiled = torch.compile(lambda y: loss_of(model, y), backend="dmfx", options=UNPAD_GRAPHS)
    with pytest.raises(ValueError, match=r"target \d+ at padding position \[0, 5\] \(not ignore_index -100\)"):
        compiled(labels)  # (padding labelled: the first padding position is [0, 5])
    got = compiled(real_labels)
    got.sum().backward()
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    assert_grads_equal([p.grad for p in params], ref_grads)
    rec = dmfx.records()[-1]
    assert rec.fired.get("unpad") == 2 and rec.fired.get("linear_cross_entropy") == 1, rec.fired
    # the head and its loss read the packed rows: nothing is scattered back to [B * S, ...]
    (lce,) = [n for n in rec.forward_graph.graph.nodes if n.target is torch.ops.dmfx.linear_cross_entropy.default]
    assert isinstance(lce.args[0].meta["val"].shape[0], torch.SymInt), lce.args[0].meta["val"].shape
    scatters = [n.meta["val"].shape for n in rec.forward_graph.graph.nodes if n.target is torch.ops.aten.index_copy.default]
    assert scatters == [] or reduction == "none", scatters


@pytest.mark.parametrize("compiler", ["fx", "inductor"])
def test_tied_weights_a_layer_applied_twice_and_logits_read_twice(compiler):
    """Graph shapes, not only op chains: the MLM decoder tied to the word embeddings (one parameter
    read by the gather at the input and the head's GEMM), one encoder layer applied twice (its
    weights, and so their gradients, shared by two packed layers), and the returned logits read twice:
    by the loss on the packed rows and by a random cotangent at the real positions (the scattered
    copy). Loss, logits and every gradient equal eager's, under both compilers (inductor: the
    default users get)."""
    model = transformers.BertForMaskedLM(transformers.BertConfig(vocab_size=100, **SMALL))
    first, second = model.bert.encoder.layer
    model.bert.encoder.layer = torch.nn.ModuleList([first, second, first])
    assert model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight
    model.train()
    ids, mask = padded_batch()
    real = mask.bool()
    g = torch.Generator().manual_seed(5)
    labels = torch.randint(0, 100, ids.shape, generator=g).masked_fill(~real, -100)
    R = torch.randn(*ids.shape, 100, generator=g) * real[..., None]
    params = list(model.parameters())

    def step(run):
        for p in params:
            p.grad = None
        out = run(input_ids=ids, attention_mask=mask, labels=labels)
        (out.loss + (out.logits * R).sum()).backward()
        return out.loss.detach(), out.logits.detach(), [p.grad.clone() for p in params]

    ref_loss, ref_logits, ref_grads = step(model)
    compiled = torch.compile(model, backend="dmfx", options={**UNPAD_GRAPHS, "compiler": compiler})
    loss, logits, grads = step(compiled)
    assert torch.allclose(loss, ref_loss, rtol=1e-5)
    assert torch.allclose(logits[real], ref_logits[real], atol=1e-5)
    assert_grads_equal(grads, ref_grads)
    rec = dmfx.records()[-1]
    assert rec.fired.get("unpad") == 3, rec.fired  # three attentions, two of them one module's


def test_dropout_training_runs_and_is_reproducible():
    cfg = transformers.BertConfig(vocab_size=100, **{**SMALL, "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1})
    model = transformers.BertModel(cfg).train()
    ids, mask = padded_batch()
    compiled = torch.compile(model, backend="dmfx", options=UNPAD)

    def step(seed):
        torch.manual_seed(seed)
        model.zero_grad(set_to_none=True)
        out = compiled(input_ids=ids, attention_mask=mask).last_hidden_state
        out.square().sum().backward()
        return out.detach(), model.embeddings.word_embeddings.weight.grad.clone()

    a, ga = step(3)
    b, gb = step(3)
    assert torch.equal(a, b) and torch.equal(ga, gb)
    assert torch.isfinite(ga).all()
    assert dmfx.records()[-1].fired.get("unpad") == 2


# ----------------------------------------------------------------------------------------- near-misses


def _compile_and_compare(model, ids, mask, **kw):
    compiled = torch.compile(model, backend="dmfx", options=UNPAD)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, **kw)
        out = compiled(input_ids=ids, attention_mask=mask, **kw)
    assert torch.allclose(out.last_hidden_state, ref.last_hidden_state, atol=1e-5)
    return dmfx.records()[-1], out


def test_t5_learned_position_bias_is_left_alone():
    model, pad = encoder("t5")
    model.eval()
    ids, mask = padded_batch(pad_id=pad)
    record, _ = _compile_and_compare(model, ids, mask)
    assert "unpad" not in record.fired
    assert any("not from one padding mask alone" in m for m in unpad_misses(record)), record.missed


def test_causal_mask_without_padding_is_left_alone():
    """A causal mask with no attention mask is built from constants (or is SDPA's is_causal): nothing
    marks padding."""
    cfg = transformers.GPT2Config(vocab_size=100, n_embd=32, n_layer=1, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
                                  attn_pdrop=0.0, attn_implementation="eager")
    model = transformers.GPT2Model(cfg).eval()
    ids, _ = padded_batch()
    compiled = torch.compile(model, backend="dmfx", options=UNPAD)
    with torch.no_grad():
        assert torch.allclose(compiled(input_ids=ids).last_hidden_state, model(input_ids=ids).last_hidden_state, atol=1e-5)
    record = dmfx.records()[-1]
    assert "unpad" not in record.fired
    # (as is_causal, no mask at all; or a mask of constants)
    assert any("nothing marks padding" in m or "is a constant" in m for m in unpad_misses(record)), record.missed


# ----------------------------------------------------------------------------------------- decoders


def decoder(family: str, impl: str = "eager", **kw):
    """A small HF causal LM of `family` (dropout off)."""
    if family == "llama":  # (grouped-query attention, rotary positions, RMSNorm, SwiGLU)
        cfg = transformers.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, attn_implementation=impl, **kw)
        return transformers.LlamaForCausalLM(cfg)
    if family == "gpt2":  # (learned positions, LayerNorm, GELU)
        cfg = transformers.GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0, attn_implementation=impl, **kw)
        return transformers.GPT2LMHeadModel(cfg)
    if family == "mistral":
        cfg = transformers.MistralConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, attn_implementation=impl, **kw)
        return transformers.MistralForCausalLM(cfg)
    raise ValueError(family)


def causal_lm_step(run, ids, mask, labels, R, params, **kw):
    """The loss and the logits, and every parameter's gradient of loss + (logits * R).sum()."""
    for p in params:
        p.grad = None
    out = run(input_ids=ids, attention_mask=mask, labels=labels, **kw)
    (out.loss + (out.logits * R).sum()).backward()
    return out.loss.detach(), out.logits.detach(), [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in params]


@pytest.mark.parametrize("family,impl,layout", [("llama", "eager", "right"), ("llama", "sdpa", "right"),
                                                ("llama", "eager", "left"), ("llama", "sdpa", "holes"),
                                                ("gpt2", "eager", "right"), ("gpt2", "sdpa", "left")])
def test_causal_lm_training_on_real_tokens_equals_eager(family, impl, layout):
    """A decoder's padded batch (HF's causal mask with an attention mask): each attention runs causal
    over the packed sequences (the real tokens keep their order, so a query's earlier real keys are
    the ones it sees), the loss over the real rows (padding labelled -100, as HF's collators do). The
    loss, the real positions' logits and every gradient (a random cotangent on the real logits) are
    eager's; padding positions' logits are zeros."""
    torch.manual_seed(0)
    model = decoder(family, impl).train()
    ids, mask = padded_batch(left=layout == "left", holes=layout == "holes")
    labels = ids.masked_fill(mask == 0, -100)
    # (HF's shift puts a sequence's label on the position before it: where that is padding, the label
    # must be ignored, test_a_causal_lm_label_shifted_onto_padding_raises)
    after_padding = torch.cat([torch.zeros_like(mask[:, :1]), 1 - mask[:, :-1]], 1).bool()
    labels = labels.masked_fill(after_padding, -100)
    real = mask.bool()
    R = torch.randn(*ids.shape, 100) * real[..., None]
    params = list(model.parameters())
    ref_loss, ref_logits, ref_grads = causal_lm_step(model, ids, mask, labels, R, params)
    compiled = torch.compile(model, backend="dmfx", options=UNPAD_GRAPHS)
    loss, logits, grads = causal_lm_step(compiled, ids, mask, labels, R, params)
    assert torch.allclose(loss, ref_loss, atol=1e-5)
    assert torch.allclose(logits[real], ref_logits[real], atol=1e-5)
    assert not logits[~real].any()
    assert_grads_equal(grads, ref_grads)
    # (GPT-2's loss is a graph of its own: an HF warning breaks the graph before it)
    (record,) = [r for r in dmfx.records() if "attention_mask" in r.unpad.get("mask", "")] or dmfx.records()[-1:]
    assert record.fired.get("unpad") == 2, (record.summary(), record.missed)
    varlen = [n for n in record.forward_graph.graph.nodes if n.target is torch.ops.dmfx.varlen_attention.default]
    assert len(varlen) == 2 and all(n.args[5] is True for n in varlen)  # (causal)


@pytest.mark.parametrize("impl,position_ids", [("eager", False), ("sdpa", True)])
def test_causal_lm_training_under_bf16_autocast(impl, position_ids):
    """Under bf16 autocast the rotary embedding stays ATen's element-wise chain (in the packed region:
    its tables gathered by position, or as token tensors with position ids per sequence). Its
    [H, T, D] result reaches the varlen op as a contiguous [T, H, D] copy: a transposed view of a
    layout Inductor chose, with T data-dependent, failed the backward's saved-tensor stride check."""
    torch.manual_seed(0)
    model = decoder("llama", impl).train()
    ids, mask = padded_batch()
    labels = ids.masked_fill(mask == 0, -100)
    real = mask.bool()
    R = torch.randn(*ids.shape, 100) * real[..., None]
    params = list(model.parameters())
    kw = {"position_ids": torch.arange(ids.shape[1]).expand(ids.shape[0], -1).clone()} if position_ids else {}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_loss, ref_logits, ref_grads = causal_lm_step(model, ids, mask, labels, R, params, **kw)
        compiled = torch.compile(model, backend="dmfx", options=UNPAD_GRAPHS)
        loss, logits, grads = causal_lm_step(compiled, ids, mask, labels, R, params, **kw)
    assert torch.allclose(loss, ref_loss, atol=2e-3)
    assert torch.allclose(logits[real].float(), ref_logits[real].float(), atol=1e-2)
    assert_grads_equal(grads, ref_grads, tol=2e-2)
    record = dmfx.records()[-1]
    assert record.fired.get("unpad") == 2, (record.summary(), record.missed)


@pytest.mark.parametrize("compiler", ["fx", "inductor"])
def test_a_causal_lm_label_shifted_onto_padding_raises(compiler):
    """Left padding with every real token labelled: HF's shift puts the first real token's label on the
    padding position before it, a loss term eager counts from logits unpad does not compute. The
    compiled step says so when it runs (the labels are data), instead of a different loss."""
    model = decoder("llama").train()
    ids, mask = padded_batch(left=True)
    labels = ids.masked_fill(mask == 0, -100)
    compiled = torch.compile(model, backend="dmfx", options={**UNPAD_GRAPHS, "compiler": compiler})
    with pytest.raises(ValueError, match=r"target \d+ at padding position \[0, 3\] \(not ignore_index -100\)"):
        compiled(input_ids=ids, attention_mask=mask, labels=labels)
    # right padding, the same graph: no padding position has a target
    ids, mask = padded_batch()
    out = compiled(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    ref = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    assert torch.allclose(out.loss, ref.loss, atol=1e-5)


def test_gpt2_with_its_loss_type_set_checks_its_labels_in_the_graph():
    """GPT-2's HF class names no loss type, so HF warns on every call and Dynamo breaks the graph there:
    the loss reads the returned logits, zeros at padding, and a left-padded label goes unchecked (the
    README says so). With ``model.loss_type = "ForCausalLM"`` the loss is in the graph and the label
    raises, as LLaMA's does."""
    model = decoder("gpt2").train()
    model.loss_type = "ForCausalLM"
    ids, mask = padded_batch(left=True)
    labels = ids.masked_fill(mask == 0, -100)
    compiled = torch.compile(model, backend="dmfx", options=UNPAD_GRAPHS)
    with pytest.raises(ValueError, match=r"target \d+ at padding position \[0, 3\]"):
        compiled(input_ids=ids, attention_mask=mask, labels=labels)
    assert len(dmfx.records()) == 1  # (one graph: the loss in it)


def test_causal_lm_tied_head_a_layer_applied_twice_and_hidden_states_read_twice():
    """Graph shapes beyond a plain stack: the LM head tied to the embeddings (a weight read by the
    first and last GEMM, its gradient summed), one decoder layer applied twice (its weights read by
    both applications), every layer's hidden state returned besides feeding the next (several
    consumers, scattered where they leave the region; no cache: the shared layer would append its keys
    twice). Real positions and gradients are eager's."""
    torch.manual_seed(0)
    model = decoder("llama", tie_word_embeddings=True).train()
    model.model.layers[1] = model.model.layers[0]
    ids, mask = padded_batch(holes=True)
    labels = ids.masked_fill(mask == 0, -100)
    labels = labels.masked_fill(torch.cat([torch.zeros_like(mask[:, :1]), 1 - mask[:, :-1]], 1).bool(), -100)
    real = mask.bool()
    R = torch.randn(*ids.shape, 100) * real[..., None]
    Rh = torch.randn(3, *ids.shape, 32) * real[..., None]
    params = list(model.parameters())

    def step(run):
        for p in params:
            p.grad = None
        out = run(input_ids=ids, attention_mask=mask, labels=labels, output_hidden_states=True, use_cache=False)
        hidden = torch.stack(out.hidden_states)
        (out.loss + (out.logits * R).sum() + (hidden * Rh).sum()).backward()
        return out.loss.detach(), hidden.detach(), [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in params]

    ref_loss, ref_hidden, ref_grads = step(model)
    loss, hidden, grads = step(torch.compile(model, backend="dmfx", options=UNPAD_GRAPHS))
    assert torch.allclose(loss, ref_loss, atol=1e-5)
    assert torch.allclose(hidden[:, real], ref_hidden[:, real], atol=1e-5)
    assert_grads_equal(grads, ref_grads)
    record = dmfx.records()[-1]
    assert record.fired.get("unpad") == 2, (record.summary(), record.missed)


def test_labels_equal_to_input_ids_on_a_padded_batch_raise():
    """labels=input_ids labels the padding with the pad token, terms eager counts: a clear error, not
    the loss over the real tokens under eager's name."""
    model = decoder("llama").train()
    ids, mask = padded_batch()
    compiled = torch.compile(model, backend="dmfx", options=UNPAD_GRAPHS)
    with pytest.raises(ValueError, match="Give padding positions the label -100 .* labels=input_ids does not"):
        compiled(input_ids=ids, attention_mask=mask, labels=ids)


def test_causal_lm_inference_with_position_ids_per_sequence():
    """Left padding with position ids counted from each sequence's first real token (as generate()
    makes them): the rotary tables are [B, 1, S, D], token tensors gathered like the activations."""
    model = decoder("llama").eval()
    ids, mask = padded_batch(left=True)
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    compiled = torch.compile(model, backend="dmfx", options=UNPAD_GRAPHS)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=False).logits
        out = compiled(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=False).logits
    real = mask.bool()
    assert torch.allclose(out[real], ref[real], atol=1e-5)
    assert dmfx.records()[-1].fired.get("unpad") == 2


def test_generate_with_left_padding_gives_eagers_tokens():
    """generate() on a left-padded prompt batch (the dynamic cache, the forward compiled): the prefill
    runs on the real tokens (the cache it returns holds zeros at padding positions, which every later
    step's mask hides), the decode steps (one query against the cache) stay as they are."""
    torch.manual_seed(0)
    model = decoder("llama").eval()
    ids, mask = padded_batch(left=True)
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    ref = model.generate(ids, **kw)
    model.forward = torch.compile(model.forward, backend="dmfx", options=UNPAD_GRAPHS)
    assert torch.equal(model.generate(ids, **kw), ref)
    prefill = dmfx.records()[0]
    assert prefill.fired.get("unpad") == 2, (prefill.summary(), prefill.missed)
    decode = dmfx.records()[-1]
    assert any("a decode step" in m for m in unpad_misses(decode)), decode.missed


def test_a_sliding_window_narrower_than_the_batch_is_left_alone():
    """Mistral's sliding window (4 keys) over 9 positions hides more than padding and the future: not
    a causal padding mask, so the attentions stay padded (eager's answer either way)."""
    model = decoder("mistral", sliding_window=4).eval()
    ids, mask = padded_batch()
    compiled = torch.compile(model, backend="dmfx", options=UNPAD_GRAPHS)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        out = compiled(input_ids=ids, attention_mask=mask, use_cache=False).logits
    assert torch.allclose(out, ref, atol=1e-5)
    record = dmfx.records()[-1]
    assert "unpad" not in record.fired
    assert any("not a padding mask of its input, causal or not" in m for m in unpad_misses(record)), record.missed


def windowed(kind: str):
    """A small model whose attention is a sliding window over 9 keys at most: Mistral's (causal) or
    ModernBERT's local layers (bidirectional, every other layer)."""
    if kind == "mistral":
        return decoder("mistral", sliding_window=8).eval()
    cfg = transformers.ModernBertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                        intermediate_size=64, local_attention=8, global_attn_every_n_layers=2,
                                        embedding_dropout=0.0, mlp_dropout=0.0, attention_dropout=0.0, pad_token_id=0,
                                        bos_token_id=None, eos_token_id=None, cls_token_id=None, sep_token_id=None)
    return transformers.ModernBertModel(cfg).eval()


def windowed_outputs_match_eager(model, compiled, shapes):
    """Inference on padded batches of `shapes` ((B, S, lengths) each), equal to eager at the real
    positions. A decoder runs without its cache: HF's sliding-window cache guards on the length
    itself (a slice of the last window - 1 keys), which would recompile at the window's width."""
    kw = {} if isinstance(model, transformers.ModernBertModel) else {"use_cache": False}
    with torch.no_grad():
        for B, S, lengths in shapes:
            ids, mask = padded_batch(B, S, 0, lengths)
            ref = model(input_ids=ids, attention_mask=mask, **kw)
            out = compiled(input_ids=ids, attention_mask=mask, **kw)
            ref, out = (o.logits if hasattr(o, "logits") else o.last_hidden_state for o in (ref, out))
            real = mask.bool()
            assert torch.allclose(out[real], ref[real], atol=1e-5), (B, S)


def test_a_window_wider_than_the_first_batch_bounds_the_length_under_a_symbolic_length():
    """Under dynamic=True a sliding window wider than the first batch hides nothing there but padding
    and the future: probes at that length alone take it for a padding mask, and the graph, run again
    for longer batches, would drop the window. Mistral's window of 8 shows at a second length past
    its constants; at its width (8) it still hides nothing, so the graph is unpadded with a guard
    that the length is at most 8. A longer batch recompiles, and there the window shows in the
    example itself: that graph stays padded. Every output is eager's."""
    model = windowed("mistral")
    compiled = torch.compile(model, backend="dmfx", options=UNPAD_GRAPHS, dynamic=True)
    windowed_outputs_match_eager(model, compiled, [(2, 4, (4, 3)), (3, 7, (7, 2, 5)), (3, 16, (16, 9, 12))])
    first, second = dmfx.records()  # (the 7-token batch ran the first graph: the guard let it through)
    assert first.fired.get("unpad") == 2, unpad_misses(first)
    assert "unpad" not in second.fired
    assert any("not a padding mask of its input" in m for m in unpad_misses(second)), second.missed


def test_a_bidirectional_window_wider_than_the_first_batch_is_left_alone_under_a_symbolic_length():
    """ModernBERT's local layers (a window of 4 keys either side) over a first batch of 4 tokens: the
    window shows at a second length past its constants, and at its width there is nothing longer than
    the batch to bound it by, so those layers stay padded; the global layer is unpadded. Every output
    is eager's, the longer batch's too."""
    model = windowed("modernbert")
    compiled = torch.compile(model, backend="dmfx", options=UNPAD_GRAPHS, dynamic=True)
    windowed_outputs_match_eager(model, compiled, [(2, 4, (4, 3)), (3, 16, (16, 9, 12))])
    records = dmfx.records()
    assert len(records) == 1 and records[0].fired.get("unpad") == 1, [unpad_misses(r) for r in records]
    # (at twice the sum of the mask's constants: its dims' too, some 48 tokens)
    assert any("hides more than padding at" in m for m in unpad_misses(records[0])), records[0].missed


def test_mistrals_window_of_4096_is_unpadded_under_a_symbolic_length():
    """Mistral's own window (4096 keys, its config's default): under dynamic=True a second length past
    twice its width is too long to probe, so the mask is probed at 4096 and the graph guarded to at
    most 4096 tokens. It is unpadded, and equal to eager at two shapes."""
    model = decoder("mistral").eval()
    assert model.config.sliding_window == 4096
    compiled = torch.compile(model, backend="dmfx", options=UNPAD_GRAPHS, dynamic=True)
    windowed_outputs_match_eager(model, compiled, [(3, 9, (5, 9, 7)), (2, 12, (12, 3))])
    records = dmfx.records()
    assert len(records) == 1 and records[0].fired.get("unpad") == 2, [unpad_misses(r) for r in records]


def test_a_window_too_wide_to_probe_bounds_the_length_or_is_left_alone(monkeypatch):
    """With probes of at most 20 x 20 scores, a window of 30: the mask is probed at 20 tokens (the
    longest allowed) and the graph guarded to at most 20. A batch of 24 recompiles, and there no
    second length between 24 and 30 can be probed: that graph stays padded, with the reason."""
    monkeypatch.setattr(sys.modules["dmfx.passes.unpad"], "_PROBE_SCORES", 20 * 20)
    model = decoder("mistral", sliding_window=30).eval()
    compiled = torch.compile(model, backend="dmfx", options=UNPAD_GRAPHS, dynamic=True)
    windowed_outputs_match_eager(model, compiled, [(3, 9, (5, 9, 7)), (2, 20, (20, 3)), (2, 24, (24, 13)),
                                                   (2, 12, (12, 5))])
    first, second = dmfx.records()
    assert first.fired.get("unpad") == 2, unpad_misses(first)
    assert "unpad" not in second.fired
    assert any("too long to probe" in m for m in unpad_misses(second)), second.missed


class ScaledWindow(torch.nn.Module):
    """One attention under a window of scaled positions, ``|q - k| // 16 <= 4`` (keys up to 79 away):
    at twice the sum of its constants it still hides nothing but padding."""

    def __init__(self, d=32, heads=4):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (torch.nn.Linear(d, d) for _ in range(4))

    def forward(self, x, attention_mask):
        B, S, D = x.shape
        pos = torch.arange(S, device=x.device)
        band = (pos[:, None] - pos[None, :]).abs() // 16 <= 4
        keep = band[None, None] & attention_mask[:, None, None, :].bool()
        q, k, v = (f(x).view(B, S, self.heads, D // self.heads).transpose(1, 2) for f in (self.q, self.k, self.v))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return self.o(out.transpose(1, 2).reshape(B, S, D))


def test_a_window_of_scaled_positions_bounds_the_length_under_a_symbolic_length():
    """A threshold the mask reaches by scaling positions (a floor division) lies past every constant,
    so no length past them proves it is no window: the graph is unpadded only up to its largest
    constant (16), guarded. A batch of 120 tokens, where the window shows, recompiles and stays padded.
    (Probed past its constants with no guard, the graph gave a wrong answer at 120, 8e-2 from eager.)"""
    torch.manual_seed(0)
    model = ScaledWindow().eval()
    compiled = torch.compile(model, backend="dmfx", options=UNPAD_GRAPHS, dynamic=True)
    with torch.no_grad():
        for B, S in [(2, 9), (3, 16), (2, 120)]:
            x, mask = torch.randn(B, S, 32), torch.ones(B, S, dtype=torch.long)
            mask[1, S // 2:] = 0
            real = mask.bool()
            assert torch.allclose(compiled(x, mask)[real], model(x, mask)[real], atol=1e-5), S
    first, second = dmfx.records()  # (the 16-token batch ran the first graph)
    assert first.fired.get("unpad") == 1, unpad_misses(first)
    assert "unpad" not in second.fired
    assert any("scales positions (aten.floor_divide" in m for m in unpad_misses(second)), second.missed


class Pooled(torch.nn.Module):
    """An encoder and a pooling of its tokens in the same graph, as sentence-transformers compiles it."""

    def __init__(self, encoder, how):
        super().__init__()
        self.encoder, self.how = encoder, how

    def forward(self, input_ids, attention_mask):
        h = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        if self.how == "mean":  # (over every position: the padding's too)
            return h.mean(1)
        if self.how == "cumsum":
            return h.cumsum(1)[:, -1]
        if self.how == "max over the batch":
            return h.amax(0)
        if self.how == "mean of an element-wise op":  # (sin: not among the region's ops, so outside it)
            return h.sin().mean(1)
        if self.how == "softmax over the tokens":  # (an attention pooling with no mask)
            return (torch.softmax(h.sum(-1), dim=1)[..., None] * h).sum(1)
        if self.how == "gram":  # (a GEMM contracting the tokens)
            return h.transpose(1, 2) @ h
        if self.how == "flip":  # (an op unpad does not know)
            return h.flip(1)[:, 0]
        if self.how in ("attention pooling", "masked attention pooling"):  # (a learned query over the tokens)
            q = h.new_ones(h.shape[0], 1, 1, h.shape[-1])
            keep = attention_mask.bool()[:, None, None, :] if self.how.startswith("masked") else None
            return torch.nn.functional.scaled_dot_product_attention(q, h[:, None], h[:, None], attn_mask=keep)
        m = attention_mask[..., None].to(h.dtype)
        if self.how == "masked mean":
            return (h * m).sum(1) / m.sum(1).clamp(min=1e-9)
        return h[:, 0]  # "cls"


@pytest.mark.parametrize("how,unpadded", [
    ("mean", False), ("cumsum", False), ("max over the batch", False), ("mean of an element-wise op", False),
    ("softmax over the tokens", False), ("gram", False), ("flip", False), ("attention pooling", False),
    ("masked attention pooling", True), ("masked mean", True), ("cls", True)])
def test_a_reduction_over_the_padding_in_the_graph_is_left_alone(how, unpadded):
    """An op that reads along the tokens at the padding positions (an unmasked mean, a cumsum, a max
    over the batch, a mean behind element-wise ops outside the region, a softmax over the tokens, a GEMM
    contracting them, an attention over them with no mask, an op the pass does not know) would see
    eager's values there and the unpadded graph's zeros: the pass leaves the graph alone and says which
    op. A mean over the tokens multiplied by the padding mask (zero there in eager too), an attention
    whose mask hides the padding, and the first token are unpadded. Every result is eager's (right
    padding: token 0 is real)."""
    model, pad = encoder("bert")
    model = Pooled(model.eval(), how)
    ids, mask = padded_batch(pad_id=pad)
    compiled = torch.compile(model, backend="dmfx", options=UNPAD_GRAPHS)
    with torch.no_grad():
        assert torch.allclose(compiled(ids, mask), model(ids, mask), atol=1e-5)
    record = dmfx.records()[-1]
    assert bool(record.fired.get("unpad")) == unpadded, unpad_misses(record)
    if not unpadded:
        assert any("along the batch or the sequence, padding positions included" in m
                   for m in unpad_misses(record)), record.missed


def test_returned_attention_probabilities_are_left_alone():
    model, pad = encoder("bert")
    model.eval()
    ids, mask = padded_batch(pad_id=pad)
    record, out = _compile_and_compare(model, ids, mask, output_attentions=True)
    assert "unpad" not in record.fired
    # (where the attention fusion fired, unpad names the reason; under torch 2.11 that fusion itself misses)
    assert all("probabilities" in m for m in unpad_misses(record)), record.missed


def test_no_mask_is_left_alone():
    model, pad = encoder("bert")
    model.eval()
    ids = torch.randint(2, 100, (2, 7))
    compiled = torch.compile(model, backend="dmfx", options=UNPAD)
    with torch.no_grad():
        assert torch.allclose(compiled(input_ids=ids).last_hidden_state, model(input_ids=ids).last_hidden_state, atol=1e-5)
    record = dmfx.records()[-1]
    assert "unpad" not in record.fired


def test_off_by_default():
    model, pad = encoder("bert")
    model.eval()
    ids, mask = padded_batch(pad_id=pad)
    with torch.no_grad():
        torch.compile(model, backend="dmfx", options={"fuse": "all"})(input_ids=ids, attention_mask=mask)
    assert "unpad" not in dmfx.records()[-1].fired


def test_option_is_checked():
    with pytest.raises(ValueError, match="unpad"):
        dmfx.with_options(unpad="yes")


# ----------------------------------------------------------------------------------------- the hint


@pytest.mark.parametrize("options", [{"compiler": "fx"}, {"compiler": "inductor"}])
def test_a_mostly_padded_batch_suggests_the_option(options, caplog):
    """Without unpad, a graph whose attentions read a padding mask says once, at its first call, how
    much of the batch was padding and what unpad=True would skip (also for a graph left to Inductor
    whole)."""
    import logging

    model, pad = encoder("bert")
    model.eval()
    ids, mask = padded_batch(pad_id=pad, lengths=(2, 9, 3))  # 14 of 27 positions real: 48% padding
    compiled = torch.compile(model, backend="dmfx", options=options)
    with caplog.at_level(logging.INFO, logger="dmfx"), torch.no_grad():
        compiled(input_ids=ids, attention_mask=mask)
        compiled(input_ids=ids, attention_mask=mask)
    said = [r.getMessage() for r in caplog.records if "would run its row-wise ops" in r.getMessage()]
    assert len(said) == 1 and "48% padding" in said[0] and "options={'unpad': True}" in said[0]
    assert "attention_mask" in said[0]  # (the input as the model names it)
    record = dmfx.records()[-1]
    assert record.unpad == {"option": False, "mask": record.unpad["mask"], "attentions": 2, "padding": 0.4815}


def test_the_hint_never_probes_a_windows_width(monkeypatch):
    """Without unpad, the padding hint of a graph under a symbolic length probes the mask at the example's
    length and past its constants where that is short, never at a window's width (Mistral's 4096
    would cost seconds of compile time for a log line): such a graph is not hinted. With unpad it is
    probed there and unpadded."""
    unpad_module = sys.modules["dmfx.passes.unpad"]
    lengths = []
    probes = unpad_module._probes
    monkeypatch.setattr(unpad_module, "_probes", lambda B, S, *a: lengths.append(S) or probes(B, S, *a))
    model = decoder("mistral").eval()
    ids, mask = padded_batch()
    with torch.no_grad():
        torch.compile(model, backend="dmfx", dynamic=True)(input_ids=ids, attention_mask=mask, use_cache=False)
        assert max(lengths, default=0) <= 9 and not dmfx.records()[-1].unpad
        torch._dynamo.reset()
        torch.compile(model, backend="dmfx", options=UNPAD_GRAPHS, dynamic=True)(input_ids=ids, attention_mask=mask,
                                                                                  use_cache=False)
    assert max(lengths) == 4096 and dmfx.records()[-1].fired.get("unpad") == 2


def test_unpadded_graph_records_its_mask_and_padding():
    model, pad = encoder("bert")
    model.eval()
    ids, mask = padded_batch(pad_id=pad, lengths=(2, 9, 3))
    with torch.no_grad():
        torch.compile(model, backend="dmfx", options=UNPAD)(input_ids=ids, attention_mask=mask)
    record = dmfx.records()[-1]
    assert record.unpad["option"] and record.unpad["attentions"] == 2 and record.unpad["padding"] == 0.4815
    assert "attention_mask" in record.unpad["mask"]
    assert record.unpad["row_ops"] > 10
    assert "unpadded by" in record.summary()


def test_explain_reports_rows_and_bytes_with_and_without_unpad():
    model, pad = encoder("bert")
    ids, mask = padded_batch(pad_id=pad, lengths=(2, 9, 3))
    report = dmfx.explain(model, input_ids=ids, attention_mask=mask, training=True, dmfx_options={"unpad": True})
    up = report["unpad"]
    assert up["rows_padded"] == 27 and up["rows_computed"] == 14
    assert up["bytes_with_unpad"] < up["bytes_without_unpad"]
    rt = report["runtime"]["after"]
    assert abs(rt["diff_pct"]) < 1.0  # the static cost counts the rows that ran (the real tokens' count)
    assert "14 of 27 token rows computed" in str(report)


def test_cross_attention_of_equal_lengths_is_left_alone():
    """BART's decoder reads the encoder's states with the encoder's padding mask over keys of the
    decoder's length here: cross-attention, not a padded self-attention (its queries are other tokens).
    The encoder's self-attentions are unpadded; the cross-attention is not."""
    cfg = transformers.BartConfig(vocab_size=100, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                                  decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, dropout=0.0,
                                  attention_dropout=0.0, activation_dropout=0.0, attn_implementation="eager")
    model = transformers.BartModel(cfg).eval()
    ids, mask = padded_batch(pad_id=1)
    dec = torch.randint(2, 100, ids.shape)  # as long as the encoder's input
    compiled = torch.compile(model, backend="dmfx", options=UNPAD)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, decoder_input_ids=dec)
        out = compiled(input_ids=ids, attention_mask=mask, decoder_input_ids=dec)
    assert torch.allclose(out.last_hidden_state, ref.last_hidden_state, atol=1e-5)  # the decoder: every position
    real = mask.bool()
    assert torch.allclose(out.encoder_last_hidden_state[real], ref.encoder_last_hidden_state[real], atol=1e-5)
    record = dmfx.records()[-1]
    assert record.fired.get("unpad", 0) <= 1, record.summary()  # at most the encoder's self-attention
    assert any("cross-attention" in m for m in unpad_misses(record)), record.missed


def test_dynamic_shapes_one_graph_for_every_batch_shape():
    model, pad = encoder("bert")
    model.eval()
    compiled = torch.compile(model, backend="dmfx", options=UNPAD, dynamic=True)
    with torch.no_grad():
        for B, S, lengths in [(3, 9, (5, 9, 7)), (2, 12, (12, 3)), (4, 7, (1, 7, 2, 5))]:
            ids, mask = padded_batch(B, S, pad, lengths)
            ref = model(input_ids=ids, attention_mask=mask).last_hidden_state
            out = compiled(input_ids=ids, attention_mask=mask).last_hidden_state
            real = mask.bool()
            assert torch.allclose(out[real], ref[real], atol=1e-5), (B, S)
            assert not out[~real].any()
    (record,) = dmfx.records()
    assert record.fired.get("unpad") == 2


def steps_match_eager(model, compiled, shapes):
    """A training step of `compiled` on a right-padded batch of each (B, S, lengths) in `shapes`, every
    real token labelled: loss, real logits and every gradient (a random cotangent) equal eager's, and
    the padding positions' logits are zeros."""
    params = list(model.parameters())
    for B, S, lengths in shapes:
        ids, mask = padded_batch(B, S, 0, lengths)
        labels = ids.masked_fill(mask == 0, -100)
        real = mask.bool()
        R = torch.randn(*ids.shape, 100) * real[..., None]
        ref_loss, ref_logits, ref_grads = causal_lm_step(model, ids, mask, labels, R, params)
        loss, logits, grads = causal_lm_step(compiled, ids, mask, labels, R, params)
        assert torch.allclose(loss, ref_loss, atol=1e-5), (B, S)
        assert torch.allclose(logits[real], ref_logits[real], atol=1e-5), (B, S)
        assert not logits[~real].any()
        assert_grads_equal(grads, ref_grads)


@pytest.mark.parametrize("family,impl", [("llama", "eager"), ("llama", "sdpa"), ("gpt2", "eager")])
def test_causal_lm_training_under_a_symbolic_length(family, impl):
    """Under dynamic=True the mask is probed at a second length past its constants (where a sliding
    window would show), so a causal padding mask over a symbolic length is unpadded: one graph runs
    batches of other shapes, each equal to eager (HF's full slices, which dynamic shapes leave in
    repeat_kv, are row-wise)."""
    torch.manual_seed(0)
    model = decoder(family, impl).train()
    compiled = torch.compile(model, backend="dmfx", options=UNPAD_GRAPHS, dynamic=True)
    steps_match_eager(model, compiled, [(3, 9, (5, 9, 7)), (2, 12, (12, 3))])
    unpadded = [r for r in dmfx.records() if r.fired.get("unpad")]
    assert len(unpadded) == 1 and unpadded[0].fired["unpad"] == 2, [r.summary() for r in dmfx.records()]


def test_automatic_dynamic_shapes_keep_unpadding():
    """torch.compile's default (dynamic=None): the first batch compiles static, a new length recompiles
    with a symbolic length, a new batch size with a symbolic batch. Dynamo then gives the attention
    mask's batch a symbol of its own beside input_ids' (s92 and s52), equal in every call: the pass
    guards on their equality (Dynamo checks it per call) instead of leaving the graph padded. Every
    graph unpads, each step equal to eager."""
    torch.manual_seed(0)
    model = decoder("llama").train()
    compiled = torch.compile(model, backend="dmfx", options=UNPAD_GRAPHS)
    steps_match_eager(model, compiled, [(3, 9, (5, 9, 7)), (3, 12, (12, 3, 8)), (2, 10, (10, 4))])
    records = dmfx.records()
    assert len(records) == 3 and all(r.fired.get("unpad") == 2 for r in records), \
        [(r.fired.get("unpad"), unpad_misses(r)) for r in records]


def test_a_labelled_padding_position_raises_under_automatic_dynamic_shapes():
    """Under automatic dynamic shapes a frame recompiled for a new batch size gives the labels symbols
    of their own beside the mask's ([s18, s96] beside [s52, s16]). The pass makes them the grid's (a
    guard Dynamo checks per call), so the loss runs on the packed rows and a label at a padding
    position raises in every graph, as in the first. (The loss read the scattered logits outside the
    packed region instead: zeros at that position, a loss 1.5e-2 from eager's, silently.)"""
    model = decoder("llama").train()
    compiled = torch.compile(model, backend="dmfx", options=UNPAD_GRAPHS)
    for B, S, lengths in [(3, 9, (5, 4, 7)), (3, 12, (12, 3, 8)), (2, 10, (10, 4))]:
        ids, mask = padded_batch(B, S, 0, lengths)
        labels = ids.masked_fill(mask == 0, -100)
        labels[1, -1] = 5  # (row 1 is padded in every batch)
        with pytest.raises(ValueError, match="the loss has target 5 at padding position"):
            compiled(input_ids=ids, attention_mask=mask, labels=labels)
    assert len(dmfx.records()) == 3 and all(r.fired.get("unpad") == 2 for r in dmfx.records())

"""End to end: HuggingFace models built from small configs give eager's outputs and gradients, and a
short training run follows eager's loss curve."""

import copy

import pytest
import torch
from conftest import rel_err

import dmfx
from dmfx.models import small_model

transformers = pytest.importorskip("transformers")


def bert(dropout=0.0):
    """dmfx.models' small BERT (vocabulary 500, 64 positions, no pooler)."""
    return small_model("bert", vocab_size=500, max_position_embeddings=64, hidden_dropout_prob=dropout,
                       attention_probs_dropout_prob=dropout, model_kwargs={"add_pooling_layer": False})


def gpt2(dropout=0.0):
    """dmfx.models' small GPT-2 (vocabulary 500, 64 positions)."""
    return small_model("gpt2", vocab_size=500, n_positions=64, resid_pdrop=dropout, embd_pdrop=dropout,
                       attn_pdrop=dropout)


MODELS = {"bert": bert, "gpt2": gpt2}


def _grads_close(m, ref, tol):
    # relative to the norm of all gradients: some (e.g. BERT's key bias) are zero in exact arithmetic
    scale = torch.cat([q.grad.flatten() for q in ref.parameters() if q.grad is not None])
    for (name, p), (_, q) in zip(m.named_parameters(), ref.named_parameters()):
        if q.grad is None:
            continue
        assert rel_err(p.grad, q.grad, scale) < tol, name


@pytest.mark.parametrize("name", list(MODELS))
def test_outputs_and_gradients_match_eager(name):
    m = MODELS[name]().train()
    ref = copy.deepcopy(m)
    ids = torch.randint(0, 500, (2, 24))
    out = torch.compile(m, backend="dmfx", options={"fallback": False})(input_ids=ids).last_hidden_state
    exp = ref(input_ids=ids).last_hidden_state
    assert rel_err(out, exp) < 1e-5
    R = torch.randn_like(exp)
    (out * R).sum().backward()
    (exp * R).sum().backward()
    _grads_close(m, ref, 1e-5)
    rec = dmfx.records()
    fired = {k: sum(r.fired.get(k, 0) for r in rec) for k in ("layer_norm", "bias_dropout_residual_norm")}
    # BERT: embeddings LN (with the position-embedding add) + 2 BDRLN per layer; GPT-2: ln_1 of layer 0
    # (with the embeddings add), then ln_2/ln_1/ln_f after a residual add: 5 norms each, all fused
    assert fired["bias_dropout_residual_norm"] >= 3 and fired["bias_dropout_residual_norm"] + fired["layer_norm"] >= 5, fired


@pytest.mark.parametrize("name", list(MODELS))
def test_inference_matches_eager(name):
    m = MODELS[name]().eval()
    ids = torch.randint(0, 500, (3, 17))
    with torch.no_grad():
        out = torch.compile(m, backend="dmfx")(input_ids=ids).last_hidden_state
        assert rel_err(out, m(input_ids=ids).last_hidden_state) < 1e-5


def _train(model, steps, ids, labels, compile_dmfx):
    torch.manual_seed(1)
    head = torch.nn.Linear(64, 500)
    params = list(model.parameters()) + list(head.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3)
    fwd = torch.compile(model, backend="dmfx") if compile_dmfx else model
    losses = []
    for _ in range(steps):
        logits = head(fwd(input_ids=ids).last_hidden_state)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("name", list(MODELS))
def test_twenty_training_steps_follow_eager(name):
    m = MODELS[name]().train()
    ref = copy.deepcopy(m)
    ids, labels = torch.randint(0, 500, (4, 16)), torch.randint(0, 500, (4, 16))
    eager = _train(ref, 20, ids, labels, False)
    fused = _train(m, 20, ids, labels, True)
    assert eager[-1] < eager[0] * 0.9  # the run actually learns
    for a, b in zip(fused, eager):
        assert abs(a - b) <= 1e-3 * abs(b), (fused, eager)


def test_training_with_dropout_learns_like_eager():
    """Dropout on: different random masks than eager, so compare the trend, not the values."""
    m = bert(dropout=0.1).train()
    ref = copy.deepcopy(m)
    ids, labels = torch.randint(0, 500, (4, 16)), torch.randint(0, 500, (4, 16))
    eager = _train(ref, 20, ids, labels, False)
    fused = _train(m, 20, ids, labels, True)
    assert fused[-1] < fused[0] * 0.9
    assert abs(fused[-1] - eager[-1]) < 0.25 * eager[-1]

"""Whole HuggingFace models with their heads and losses, compiled with dmfx's defaults, on the GPU.

The kernel tests (test_cuda_*.py) check each CUDA op against its CPU twin; these check that what dmfx
builds of a real model on CUDA -- its fusions, its layouts, the graphs it gives Inductor -- trains and
infers as eager does: BERT masked LM (with a padded batch), GPT-2 and LLaMA causal LM, in float32 and
under a bf16 autocast (how a GPU user trains). Dropout is 0 so eager is the exact reference.

Tolerance: float32 against eager float32; under autocast, dmfx's error against a float32 eager run must
stay within 4x eager-under-autocast's own error against it (plus a floor): mixed precision rounds
differently in each, so neither is "the" answer, but dmfx must be no worse than eager.

Without a GPU every test is skipped.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from conftest import rel_err  # noqa: E402

import dmfx  # noqa: E402

DEVICE = "cuda"


def _model(name: str):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    B, L = 2, 64
    if name == "bert-mlm":
        cfg = transformers.BertConfig(vocab_size=1000, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=256, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        cls = transformers.BertForMaskedLM
    elif name == "gpt2-lm":
        cfg = transformers.GPT2Config(vocab_size=1000, n_embd=128, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0)
        cls = transformers.GPT2LMHeadModel
    else:
        cfg = transformers.LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=344, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, use_cache=False)
        cls = transformers.LlamaForCausalLM
    cfg._attn_implementation = "eager"
    model = cls(cfg).to(DEVICE)
    ids = torch.randint(0, cfg.vocab_size, (B, L), device=DEVICE)
    kwargs = {"input_ids": ids, "labels": ids.clone()}
    if name == "bert-mlm":  # a padded batch: the second sequence's last 24 tokens are padding, not scored
        mask = torch.ones(B, L, dtype=torch.long, device=DEVICE)
        mask[1, 40:] = 0
        kwargs["labels"] = torch.where(mask.bool(), ids, -100)
        kwargs["attention_mask"] = mask
    return model, kwargs


def _train_step(model, kwargs, autocast):
    model.zero_grad(set_to_none=True)
    with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
        out = model(**kwargs)
    out.loss.backward()
    # (a compiled module's parameters are its original's, named under "_orig_mod.")
    grads = {n.removeprefix("_orig_mod."): p.grad.detach().float().clone() for n, p in model.named_parameters()
             if p.grad is not None}
    return out.loss.detach().float(), out.logits.detach().float(), grads


def _worst_grad_err(grads, ref):
    """Each parameter's gradient error relative to the largest gradient of the model (some are tiny)."""
    scale = max(g.abs().max().item() for g in ref.values())
    assert grads.keys() == ref.keys()
    return max((grads[n] - ref[n]).abs().max().item() / scale for n in ref)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("name", ["bert-mlm", "gpt2-lm", "llama-lm"])
def test_a_whole_model_trains_as_eager_does_on_the_gpu(name, autocast):
    base, kwargs = _model(name)
    dmfx.reset()
    torch._dynamo.reset()
    ref32 = _train_step(copy.deepcopy(base), kwargs, False)
    eager = _train_step(copy.deepcopy(base), kwargs, autocast)
    compiled = torch.compile(copy.deepcopy(base), backend="dmfx")
    first = _train_step(compiled, kwargs, autocast)
    again = _train_step(compiled, kwargs, autocast)  # the compiled graphs' second run (Inductor's, cudagraph-free)
    recs = [r for r in dmfx.records() if r.training]
    assert recs and all(r.fallback is None for r in recs), [r.fallback for r in recs]
    assert sum(sum(r.fired.values()) for r in recs) > 0, "no fusion fired on the GPU"
    for got in (first, again):
        if autocast:
            for i, what in ((0, "loss"), (1, "logits")):
                e_err, d_err = rel_err(eager[i], ref32[i]), rel_err(got[i], ref32[i])
                assert d_err <= 4 * e_err + 2e-3, (what, d_err, e_err)
            e_err, d_err = _worst_grad_err(eager[2], ref32[2]), _worst_grad_err(got[2], ref32[2])
            assert d_err <= 4 * e_err + 1e-2, ("grads", d_err, e_err)
        else:
            assert rel_err(got[0], ref32[0]) < 1e-5
            assert rel_err(got[1], ref32[1]) < 1e-4
            assert _worst_grad_err(got[2], ref32[2]) < 1e-4


@pytest.mark.parametrize("name", ["bert-mlm", "llama-lm"])
def test_a_whole_model_infers_as_eager_does_on_the_gpu(name):
    base, kwargs = _model(name)
    kwargs.pop("labels")
    model = base.eval()
    dmfx.reset()
    torch._dynamo.reset()
    with torch.no_grad():
        ref = model(**kwargs).logits
        got = torch.compile(copy.deepcopy(model), backend="dmfx", options={"fuse": "all"})(**kwargs).logits
    assert rel_err(got, ref) < 1e-4
    recs = dmfx.records()
    assert recs and all(r.fallback is None for r in recs), [r.fallback for r in recs]
    assert sum(sum(r.fired.values()) for r in recs) > 0

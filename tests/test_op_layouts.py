"""Every dmfx op call a compiled training step makes gives the same result when any one of its tensor
arguments comes in another memory layout.

A compiler is free to lay out the tensors it hands an op: Inductor's layout optimization turns
4-D tensors channels-last in a graph with convolutions, saved activations for the backward included,
and tells the backward so (SegFormer's attention statistics reached the flash backward channels-last,
which raised). So the ops must read any strides. This test records each dmfx op call of real models'
training steps (``compiler="fx"``: the rewritten graphs run through an FX interpreter that keeps each
call's arguments), then calls the op again with one tensor argument relaid out (channels-last for a
4-D tensor, the last dim outermost otherwise, both the same values) and compares with the call as
recorded. The models between them call every kernel family (not the linear cross-entropy composite nor the
stacked varlen op): norms with dropout and residuals, GELU with
dropout, rotary embeddings, SwiGLU, both attention forms (a T5 position bias with its gradient,
grouped-query keys, SegFormer's shorter keys, Gemma 2's soft-capped scores), the stacked-QKV forms, the
varlen ops of option unpad, the softmax fused alone (Gemma 2 with attention="gemm", which the soft cap
leaves to the GEMMs around the fused softmax) and the fused loss.
"""

from __future__ import annotations

import pytest
import torch
from conftest import relaid
from torch.fx import Interpreter

import dmfx
import dmfx.backend
from dmfx.models import _ids_and_mask, small_model

transformers = pytest.importorskip("transformers")


def _text() -> dict:
    """Token ids with a padded second sequence (dmfx.models), and labels that skip the padding."""
    inputs = _ids_and_mask(2, 16)
    return {**inputs, "labels": inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)}


def _bert():
    m = small_model("bert", lm_head=True, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    return m, _text()


def _llama():
    m = small_model("llama", lm_head=True)
    return m, {**_text(), "use_cache": False}


def _t5():
    cfg = transformers.T5Config(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, vocab_size=100,
                                dropout_rate=0.1, decoder_start_token_id=0, pad_token_id=0)
    cfg._attn_implementation = "eager"
    return transformers.T5ForConditionalGeneration(cfg), _text()


def _segformer():
    cfg = transformers.SegformerConfig(num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32],
                                       num_attention_heads=[1, 2], decoder_hidden_size=32, num_labels=3,
                                       strides=[4, 2], patch_sizes=[7, 3])
    cfg._attn_implementation = "eager"
    return (transformers.SegformerForSemanticSegmentation(cfg),
            {"pixel_values": torch.randn(2, 3, 32, 32), "labels": torch.randint(0, 3, (2, 32, 32))})


def _swin():
    cfg = transformers.SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2],
                                  window_size=4, num_labels=3, hidden_dropout_prob=0.1)
    cfg._attn_implementation = "eager"
    return transformers.SwinForImageClassification(cfg), {"pixel_values": torch.randn(2, 3, 32, 32),
                                                          "labels": torch.tensor([0, 2])}


def _gemma2():  # soft-capped scores: flash_attention's softcap, or the softmax fused alone (attention="gemm")
    cfg = transformers.Gemma2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                    intermediate_size=128, num_hidden_layers=2, vocab_size=100,
                                    max_position_embeddings=64, sliding_window=8)
    cfg._attn_implementation = "eager"
    return transformers.Gemma2ForCausalLM(cfg), {**_text(), "use_cache": False}


# name -> (model and inputs, options)
CASES = {
    "bert-dropout": (_bert, {}),
    "bert-unpad": (_bert, {"unpad": True}),
    "llama": (_llama, {}),
    "t5": (_t5, {}),
    "segformer": (_segformer, {}),
    "swin": (_swin, {}),
    "gemma2": (_gemma2, {}),
    "gemma2-gemm": (_gemma2, {"attention": "gemm"}),
}
# the ops a case is there for
MUST_CALL = {"gemma2": "dmfx::flash_attention", "gemma2-gemm": "dmfx::attention_softmax"}


class _Recorder(Interpreter):
    """Runs a graph node by node, keeping a copy of each dmfx op call's arguments (before a later op
    could write into them)."""

    def __init__(self, gm, calls):
        super().__init__(gm)
        self.calls = calls

    def call_function(self, target, args, kwargs):
        if getattr(target, "namespace", None) == "dmfx":
            copy = lambda a: a.clone() if isinstance(a, torch.Tensor) else a  # noqa: E731
            self.calls.append((target, tuple(map(copy, args)), {k: copy(v) for k, v in kwargs.items()}))
        return super().call_function(target, args, kwargs)


def _tensors(out):
    return [x for x in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(x, torch.Tensor)]


@pytest.mark.parametrize("name", list(CASES))
def test_every_op_call_reads_any_layout(name, monkeypatch):
    make, options = CASES[name]
    torch.manual_seed(0)
    model, inputs = make()
    model.train()
    calls = []

    def boxed(gm):
        def run(args):
            args, given = list(args), args
            given.clear()
            return _Recorder(gm, calls).run(*args)

        run._boxed_call = True
        return run

    monkeypatch.setattr(dmfx.backend, "_boxed", boxed)
    compiled = torch.compile(model, backend="dmfx", options={"fuse": "all", "fallback": False, "compiler": "fx",
                                                             **options})
    compiled(**inputs).loss.backward()
    ops = {c[0].name() for c in calls}
    assert len(ops) >= 5, ops
    assert name not in MUST_CALL or MUST_CALL[name] in {o.split(".")[0] for o in ops}, ops
    relaid_args = 0
    for target, args, kwargs in calls:
        want = _tensors(target(*args, **kwargs))
        for i, a in enumerate(args):
            other = relaid(a)
            if other is None:
                continue
            relaid_args += 1
            got = _tensors(target(*(other if j == i else x for j, x in enumerate(args)), **kwargs))
            for g, w in zip(got, want, strict=True):
                assert g.shape == w.shape and g.dtype == w.dtype, (target.name(), i)
                assert torch.allclose(g, w, rtol=1e-5, atol=1e-6, equal_nan=True), (
                    f"{target.name()}: argument {i} {tuple(a.shape)} relaid out {other.stride()} changed the "
                    f"result by {(g.double() - w.double()).abs().max().item():.3g}")
    assert relaid_args >= len(calls)

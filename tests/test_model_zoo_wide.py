"""More HuggingFace families than tests/test_model_zoo.py covers, each with its loss head, in training
under ``fuse="all"`` (every fusion dmfx has, where the default would hand these dropout-free graphs
to Inductor whole): the loss, the logits and every parameter's gradient match eager's (random
cotangent, a padded batch), no graph falls back, and the fusions that make the family's layer fire.

Each family brings a shape of graph the original zoo lacks: normalized queries and keys (Qwen3,
StableLM's per-head LayerNorms; Gemma 3's, after the heads' transpose), soft-capped attention and logits
and sandwich norms (Gemma 2), partial rotary embeddings and parallel attention/MLP blocks (Phi,
GPT-NeoX, Cohere, GPT-J), rotary embeddings that rotate interleaved pairs (Cohere, GPT-J: its tables
repeated once per tensor), LayerNorm without parameters (OLMo) or with ``1 + weight`` and a squared-ReLU
MLP (Nemotron), scaled residuals and logits (Granite), a routed mixture of experts (Mixtral; DeepSeek
V3's, after a dense layer, with latent attention whose keys are written into a new buffer slice by
slice: a functional ``aten.copy`` autograd cannot differentiate, and a rotary embedding whose interleaved
pairs come out as halves), ALiBi (BLOOM), one layer's weights
used by every layer (ALBERT), disentangled relative attention (DeBERTa-v2), an embedding projection
(ELECTRA), bottlenecks and NoNorm (MobileBERT), learned positions with an offset and ReLU (OPT), and
multi-query attention (Falcon)."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import assert_param_grads_close, fired_without_fallback, rel_err, seeded_gradient_error

import dmfx

transformers = pytest.importorskip("transformers")

VOCAB = 128
_H = dict(hidden_size=64, num_attention_heads=4, intermediate_size=128, num_hidden_layers=2, vocab_size=VOCAB)
_DEC = dict(_H, num_key_value_heads=2, max_position_embeddings=64)
_ENC_DROPOUT_OFF = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)

# family -> (config class, model class, config, fusions that must fire)
FAMILIES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(_DEC, head_dim=16),
              {"rms_norm", "bias_dropout_residual_norm", "attention", "rope", "glu", "cross_entropy"}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(_DEC, head_dim=16, sliding_window=8),
               {"rms_norm", "bias_dropout_residual_norm", "attention", "rope", "glu", "softcap", "cross_entropy"}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(_DEC, head_dim=16, sliding_window=8),
               {"rms_norm", "bias_dropout_residual_norm", "attention", "rope", "glu", "cross_entropy"}),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(_DEC, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                         q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                         first_k_dense_replace=1, n_group=1, topk_group=1),
                    {"rms_norm", "bias_dropout_residual_norm", "rope", "glu", "cross_entropy"}),
    "phi": ("PhiConfig", "PhiForCausalLM", dict(_DEC, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0),
            {"layer_norm", "bias_dropout_residual_norm", "attention", "rope", "bias_act_dropout", "cross_entropy"}),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(_H, hidden_dropout=0.0, attention_dropout=0.0,
                                                             rotary_pct=0.5),
                 {"layer_norm", "bias_dropout_residual_norm", "attention", "rope", "bias_act_dropout"}),
    "cohere": ("CohereConfig", "CohereForCausalLM", _DEC,
               {"layer_norm", "bias_dropout_residual_norm", "attention", "rope", "glu", "cross_entropy"}),
    "gptj": ("GPTJConfig", "GPTJForCausalLM", dict(n_embd=64, n_head=4, n_layer=2, vocab_size=VOCAB, rotary_dim=8,
                                                   n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
             {"layer_norm", "bias_dropout_residual_norm", "attention", "rope", "bias_act_dropout", "cross_entropy"}),
    "olmo": ("OlmoConfig", "OlmoForCausalLM", _DEC,
             {"layer_norm", "bias_dropout_residual_norm", "attention", "rope", "glu", "cross_entropy"}),
    "nemotron": ("NemotronConfig", "NemotronForCausalLM", dict(_DEC, head_dim=16),
                 {"layer_norm", "bias_dropout_residual_norm", "attention", "rope", "relu_squared_idiom", "cross_entropy"}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(_DEC, embedding_multiplier=3.0, residual_multiplier=0.5,
                                                            attention_multiplier=0.1, logits_scaling=2.0),
                {"rms_norm", "bias_dropout_residual_norm", "attention", "rope", "glu", "cross_entropy"}),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", dict(_DEC, hidden_dropout=0.0, attention_dropout=0.0,
                                                               qk_layernorm=True),
                 {"layer_norm", "bias_dropout_residual_norm", "attention", "rope", "glu", "cross_entropy"}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(_DEC, num_local_experts=4, num_experts_per_tok=2),
                {"rms_norm", "bias_dropout_residual_norm", "attention", "rope", "glu", "cross_entropy"}),
    "bloom": ("BloomConfig", "BloomForCausalLM", dict(hidden_size=64, n_head=4, n_layer=2, vocab_size=VOCAB,
                                                      hidden_dropout=0.0, attention_dropout=0.0),
              {"layer_norm", "bias_dropout_residual_norm", "attention_softmax", "cross_entropy"}),
    "opt": ("OPTConfig", "OPTForCausalLM", dict(hidden_size=64, num_attention_heads=4, ffn_dim=128, num_hidden_layers=2,
                                                vocab_size=VOCAB, word_embed_proj_dim=64, dropout=0.0,
                                                attention_dropout=0.0, max_position_embeddings=64),
            {"layer_norm", "bias_dropout_residual_norm", "attention", "bias_act_dropout", "cross_entropy"}),
    "falcon": ("FalconConfig", "FalconForCausalLM", dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
                                                         vocab_size=VOCAB, hidden_dropout=0.0, attention_dropout=0.0),
               {"layer_norm", "bias_dropout_residual_norm", "attention", "rope", "cross_entropy"}),
    "albert": ("AlbertConfig", "AlbertForMaskedLM", dict(_H, **_ENC_DROPOUT_OFF, embedding_size=32, num_hidden_layers=3,
                                                         classifier_dropout_prob=0.0),
               {"layer_norm", "bias_dropout_residual_norm", "attention", "bias_act_dropout", "cross_entropy"}),
    "deberta-v2": ("DebertaV2Config", "DebertaV2ForMaskedLM", dict(_H, **_ENC_DROPOUT_OFF, relative_attention=True,
                                                                   pos_att_type=["p2c", "c2p"],
                                                                   max_relative_positions=32),
                   {"layer_norm", "bias_dropout_residual_norm", "attention_softmax", "bias_act_dropout",
                    "cross_entropy"}),
    "electra": ("ElectraConfig", "ElectraForMaskedLM", dict(_H, **_ENC_DROPOUT_OFF, embedding_size=32),
                {"layer_norm", "bias_dropout_residual_norm", "attention", "bias_act_dropout", "cross_entropy"}),
    "mobilebert": ("MobileBertConfig", "MobileBertForMaskedLM",
                   dict(_H, **_ENC_DROPOUT_OFF, embedding_size=32, intra_bottleneck_size=32, true_hidden_size=32,
                        num_feedforward_networks=2),
                   {"layer_norm", "attention", "bias_act_dropout", "cross_entropy"}),
}
# Half the families run HF's SDPA attention (dmfx's lower_sdpa_calls takes the calls), half its eager
# attention (the attention pass takes the matmul/softmax chain); Gemma 2, BLOOM and DeBERTa-v2 have
# no SDPA implementation in HF.
SDPA = {"gemma3", "deepseek_v3", "qwen3", "phi", "olmo", "mixtral", "opt", "electra", "albert", "granite", "falcon"}


def _case(name: str, impl: str):
    cfg_name, model_name, config, _ = FAMILIES[name]
    torch.manual_seed(0)
    cfg = getattr(transformers, cfg_name)(**config)
    cfg._attn_implementation = impl
    model = getattr(transformers, model_name)(cfg).train()
    ids = torch.randint(3, VOCAB, (2, 16))
    mask = torch.ones_like(ids)
    mask[1, -5:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    inputs = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    if "CausalLM" in model_name:
        inputs["use_cache"] = False
    return model, inputs


def _first_output(out):
    for key in ("logits", "logits_per_image"):
        if out.get(key) is not None:
            return out[key]
    raise AssertionError(f"no logits in {list(out.keys())}")


def _trains_as_eager(model, inputs: dict, options: dict) -> dict[str, int]:
    """`model` compiled by dmfx with `options` against an eager copy: the logits and the loss match, and
    so does every parameter's gradient through the loss plus a random cotangent on the logits. Returns
    the passes fired (no graph may have fallen back)."""
    ref = copy.deepcopy(model)
    dmfx.reset()
    got = torch.compile(model, backend="dmfx", options=options)(**inputs)
    want = ref(**inputs)
    assert rel_err(_first_output(got), _first_output(want)) < 1e-5
    assert rel_err(got.loss, want.loss) < 1e-5
    R = torch.randn_like(_first_output(want))
    ((_first_output(got) * R).sum() + got.loss).backward()
    ((_first_output(want) * R).sum() + want.loss).backward()
    assert_param_grads_close(model, ref)
    return fired_without_fallback()


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_trains_as_eager_under_every_fusion(name):
    impl = "sdpa" if name in SDPA else "eager"
    model, inputs = _case(name, impl)
    fired = _trains_as_eager(model, inputs, {"fuse": "all", "fallback": False})
    expected = set(FAMILIES[name][3])
    if impl == "sdpa":  # the model's SDPA calls: dmfx's attention op through lower_sdpa_calls, or SDPA kept
        expected -= {"attention"}
    missing = expected - set(fired)
    assert not missing, f"{name} ({impl} attention): did not fire: {missing}; fired {fired}"


EAGER_CAUSAL_LMS = [n for n, (_, model, _, _) in FAMILIES.items() if "CausalLM" in model and n not in SDPA]


@pytest.mark.parametrize("name", EAGER_CAUSAL_LMS)
def test_unpadded_eager_attention_lms_read_no_causal_mask(name, monkeypatch):
    """A causal LM with eager attention trained without padding (packed sequences): HF builds its causal
    mask from aranges in the graph, which dmfx evaluates at compile time and turns into causal=True, so
    no attention reads an [L, L] mask (BLOOM's ALiBi bias is a [B, H, 1, L] one); it trains as eager.
    (Gemma 2's sliding window is widened to the sequence, where its mask is the causal one: a narrower
    window stays a mask, tests/test_pass_attention_softmax.py.)"""
    if name == "gemma2":
        cfg_name, model_name, config, fused = FAMILIES[name]
        monkeypatch.setitem(FAMILIES, name, (cfg_name, model_name, dict(config, sliding_window=16), fused))
    model, inputs = _case(name, "eager")
    inputs = {k: v for k, v in inputs.items() if k != "attention_mask"} | {"labels": inputs["input_ids"]}
    _trains_as_eager(model, inputs, {"fuse": "all", "fallback": False, "cache": False})
    from dmfx.passes.attention import sdpa_call

    mask_arg = {torch.ops.dmfx.attention.default: 3, torch.ops.dmfx.flash_attention.default: 3,
                torch.ops.dmfx.attention_softmax.default: 1}
    masks = [(n, n.args[mask_arg[n.target]]) if n.target in mask_arg else (n, sdpa_call(n)["mask"])
             for r in dmfx.records() for n in r.forward_graph.graph.nodes if n.target in mask_arg or sdpa_call(n)]
    assert masks, [r.summary() for r in dmfx.records()]
    for n, mask in masks:
        assert mask is None or mask.meta["val"].shape[-2] == 1, (name, n.format_node())


@pytest.mark.parametrize("name", ["gemma2", "bloom"])
def test_eager_causal_lm_inference_over_256_tokens_keeps_its_causal_attention(name, monkeypatch):
    """fuse="auto" under Inductor (the default outside the suite) in inference, 256 tokens, no attention mask: Gemma 2's
    soft-capped attention and BLOOM's ALiBi attention (each with HF's causal mask of constants) are
    dmfx's, the rest of the graph Inductor's; the logits are eager's."""
    from dmfx.cuda_ops import selfcheck

    selfcheck.passes_to_skip(["cpu"])  # (the kernels built and checked: else the graph waits for them whole)
    cfg_name, model_name, config, fused = FAMILIES[name]
    if "max_position_embeddings" in config:  # (Gemma 2's window as wide as the sequence: its mask is causal)
        monkeypatch.setitem(FAMILIES, name, (cfg_name, model_name, dict(config, max_position_embeddings=256,
                                                                          sliding_window=256), fused))
    model, _ = _case(name, "eager")
    model.eval()
    ids = torch.randint(3, VOCAB, (2, 256))
    dmfx.reset()
    with torch.no_grad():
        got = torch.compile(model, backend="dmfx", options={"compiler": "inductor", "fallback": False, "cache": False})(
            input_ids=ids, use_cache=False)
        want = model(input_ids=ids, use_cache=False)
    assert rel_err(got.logits, want.logits) < 1e-5
    (rec,) = dmfx.records()
    assert rec.compiler == "inductor" and rec.fallback is None, rec.summary()
    assert rec.fired.get("attention") == 2 and not set(rec.fired) & {"rms_norm", "layer_norm", "rope", "glu"}, rec.fired
    assert any("rewritten for its causal attention only" in m for m in rec.missed), rec.missed


# Families whose inputs are not token ids, or whose graphs mix convolutions into a transformer:
# name -> (config class, model class, config, inputs(batch), fusions that must fire). Inductor
# relays out a graph with convolutions in channels-last (its layout optimization), saved tensors for
# the backward included: SegFormer's attention statistics reached dmfx's flash backward that way
# (a crash before the backwards read saved stats in any layout). SegFormer's efficient attention also
# has keys (spatially reduced) shorter than its queries; Swin attends in shifted windows with a
# relative position bias; wav2vec 2.0 has a convolutional feature encoder, grouped positional
# convolutions and a CTC loss; Whisper a convolutional encoder stem and a decoder; CLIP two towers, QuickGELU
# MLPs and a contrastive loss.
_VISION = dict(image_size=32, num_labels=3)
_S2S = dict(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
            encoder_ffn_dim=128, decoder_ffn_dim=128, vocab_size=VOCAB, dropout=0.0, attention_dropout=0.0,
            activation_dropout=0.0)


def _pixels(batch):
    return {"pixel_values": torch.randn(batch, 3, 32, 32), "labels": torch.tensor([0, 2])}


def _speech(batch):
    mask = torch.ones(batch, 4000, dtype=torch.long)
    mask[1, 3000:] = 0
    labels = torch.randint(1, 30, (batch, 6))
    labels[1, 4:] = -100
    return {"input_values": torch.randn(batch, 4000), "attention_mask": mask, "labels": labels}


def _image_text(batch):
    ids = torch.randint(3, VOCAB, (batch, 16))
    mask = torch.ones_like(ids)
    mask[1, -5:] = 0
    return {"input_ids": ids, "attention_mask": mask, "pixel_values": torch.randn(batch, 3, 32, 32), "return_loss": True}


NOT_TEXT = {
    "segformer": ("SegformerConfig", "SegformerForSemanticSegmentation",
                  dict(num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32],
                       num_attention_heads=[1, 2], decoder_hidden_size=32, num_labels=3, hidden_dropout_prob=0.0,
                       attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.0, drop_path_rate=0.0,
                       strides=[4, 2], patch_sizes=[7, 3]),
                  lambda b: {"pixel_values": torch.randn(b, 3, 32, 32), "labels": torch.randint(0, 3, (b, 32, 32))},
                  {"layer_norm", "bias_dropout_residual_norm", "attention", "qkv_attention"}),
    "swin": ("SwinConfig", "SwinForImageClassification",
             dict(_VISION, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4,
                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, drop_path_rate=0.0),
             _pixels, {"layer_norm", "bias_dropout_residual_norm", "attention", "bias_act_dropout", "cross_entropy"}),
    "wav2vec2": ("Wav2Vec2Config", "Wav2Vec2ForCTC",
                 dict(_H, vocab_size=32, conv_dim=(32, 32), conv_stride=(5, 4), conv_kernel=(10, 8),
                      num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, hidden_dropout=0.0,
                      attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0, final_dropout=0.0,
                      layerdrop=0.0, mask_time_prob=0.0, pad_token_id=0),
                 _speech, {"layer_norm", "bias_dropout_residual_norm", "attention", "bias_act_dropout"}),
    "whisper": ("WhisperConfig", "WhisperForConditionalGeneration",
                dict(_S2S, num_mel_bins=16, max_source_positions=32, max_target_positions=32, pad_token_id=0,
                     decoder_start_token_id=1),
                lambda b: {"input_features": torch.randn(b, 16, 64), "labels": torch.randint(3, VOCAB, (b, 8))},
                {"bias_dropout_residual_norm", "attention", "bias_act_dropout", "cross_entropy"}),
    "clip": ("CLIPConfig", "CLIPModel",
             dict(text_config=dict(_H, max_position_embeddings=64, attention_dropout=0.0),
                  vision_config=dict(hidden_size=64, num_attention_heads=4, intermediate_size=128,
                                     num_hidden_layers=2, image_size=32, patch_size=8, attention_dropout=0.0),
                  projection_dim=32),
             _image_text, {"layer_norm", "bias_dropout_residual_norm", "attention", "bias_act_dropout", "cross_entropy"}),
}


@pytest.mark.parametrize("name", list(NOT_TEXT))
def test_vision_speech_and_multimodal_families_train_as_eager(name):
    cfg_name, model_name, config, make_inputs, expected = NOT_TEXT[name]
    torch.manual_seed(0)
    cfg = getattr(transformers, cfg_name)(**config)
    cfg._attn_implementation = "eager"
    model = getattr(transformers, model_name)(cfg).train()
    # under Inductor (the users' default compiler; the suite's is "fx"): its layout choices are the point
    options = {"fuse": "all", "fallback": False, "compiler": "inductor"}
    fired = _trains_as_eager(model, make_inputs(2), options)
    missing = set(expected) - set(fired)
    assert not missing, f"{name}: did not fire: {missing}; fired {fired}"


def _with_dropout(config: dict, p: float = 0.1) -> dict:
    """`config` with every dropout probability (and stochastic depth) set to `p`."""
    out = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out[key] = _with_dropout(value, p)
        elif isinstance(value, float) and key.endswith(("dropout", "dropout_prob", "drop_path_rate")):
            out[key] = p
        else:
            out[key] = value
    return out


@pytest.mark.parametrize("name", ["segformer", "swin", "wav2vec2", "whisper", "clip"])
def test_vision_and_speech_families_with_dropout_give_their_forwards_gradient(name):
    """With dropout (the default options' trigger), dmfx draws its own masks, so eager is no oracle:
    the gradient must be the derivative of the seeded forward (float64, a central difference). Covers
    dropout inside attention, after GEMMs and on residuals, stochastic depth, and the convolutional
    stems' graphs around them."""
    cfg_name, model_name, config, make_inputs, _ = NOT_TEXT[name]
    torch.manual_seed(0)
    cfg = getattr(transformers, cfg_name)(**_with_dropout(config))
    cfg._attn_implementation = "eager"
    model = getattr(transformers, model_name)(cfg).double().train()
    inputs = {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in make_inputs(2).items()}
    dmfx.reset()
    compiled = torch.compile(model, backend="dmfx", options={"fallback": False})
    R = torch.randn_like(_first_output(model(**inputs)))
    model.zero_grad(set_to_none=True)

    def f():
        torch.manual_seed(5)
        return (_first_output(compiled(**inputs)) * R).sum()

    assert seeded_gradient_error(model, f) < 1e-6
    fired = fired_without_fallback()
    assert fired.get("attention", 0) >= 1 and fired.get("bias_dropout_residual_norm", 0) >= 1, fired

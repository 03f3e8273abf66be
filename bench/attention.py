"""Attention alone: dmfx's attention op against PyTorch's SDPA and the eager (math) form.

Method
------
q, k and v are views of one stacked projection output ``[B, L, 3, H, D]`` (what a transformer's
QKV GEMM writes), the mask is HF BERT's additive padding mask ``[B, 1, 1, L]`` (last quarter of half
the batch padded; ``--mask none`` for none, as in ViT). Candidates, each timed forward only (``--mode infer``, under no_grad) or forward +
backward (``--mode train``; the gradient of q, k and v, backward of ``out.sum()``):

* ``eager``: ``softmax(q @ kᵀ * scale + mask) `` → dropout → ``@ v`` written out as HF BERT does;
* ``sdpa``: ``F.scaled_dot_product_attention`` (PyTorch picks its kernel: on CPU the flash kernel
  when dropout is 0, the math path otherwise);
* ``dmfx_gemm``: ``dmfx::attention`` (the paper's form: two strided batched GEMMs around the fused
  scale + mask + softmax + dropout kernel, no operand copies);
* ``dmfx_flash``: ``dmfx::flash_attention`` (the fused form: per block of query rows, the scores stay
  in cache; the backward recomputes them from the logsumexp), what dmfx's cost model picks on the
  CPU with dropout and in training without it (float32/64, probabilities not read elsewhere, mask
  without gradient).

Candidates run interleaved in one process (round r: all candidates, round r+1: ...), medians over
``--rounds``; outputs are compared with eager's in eval mode first.

Usage: ``python -m bench.attention [--seq 128,512] [--dropout 0.0,0.1] [--mode train|infer|both]
[--mask padding,none,causal] [--dtype float32|bfloat16|float16]
[--batch 8 --heads 12 --head-dim 64 --rounds 10 --threads 2] [--json PATH]``
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tabulate import tabulate

from dmfx.cuda_ops import new_seed  # noqa: F401  (dmfx registers its ops on import)

REPO_ROOT = Path(__file__).resolve().parents[1]


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", default="128,512")
    p.add_argument("--dropout", default="0.0,0.1")
    p.add_argument("--mode", choices=["train", "infer", "both"], default="both")
    p.add_argument("--mask", default="padding",
                   help="comma list of: padding (last quarter of half the batch), none, causal")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="q, k, v (the padding mask stays float32, as HF builds it under autocast)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def _inputs(B, L, H, D, device, train, mask_kind="padding", dtype=torch.float32):
    qkv = torch.randn(B, L, 3 * H * D, device=device, dtype=dtype, requires_grad=train)
    if mask_kind in ("none", "causal"):
        return qkv, None
    mask = torch.zeros(B, 1, 1, L, device=device)
    mask[: B // 2, ..., L - L // 4 :] = torch.finfo(torch.float32).min
    return qkv, mask


def _split(qkv, H, D):
    B, L, _ = qkv.shape
    return [t.transpose(1, 2) for t in qkv.view(B, L, 3, H, D).unbind(2)]


def candidates(H, D, p, causal=False):
    scale = D**-0.5

    def eager(qkv, mask):  # (a float32 mask promotes bf16 scores, as under autocast: cast back for the GEMM)
        q, k, v = _split(qkv, H, D)
        s = q @ k.transpose(-1, -2) * scale
        if causal:
            L = s.shape[-1]
            s = s.masked_fill(torch.ones(L, L, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
        probs = torch.softmax(s if mask is None else s + mask, -1)
        return F.dropout(probs, p, training=p > 0).to(v.dtype) @ v

    def sdpa(qkv, mask):
        q, k, v = _split(qkv, H, D)
        mask = None if mask is None else mask.to(q.dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, scale=scale, is_causal=causal)

    def dmfx_gemm(qkv, mask):
        q, k, v = _split(qkv, H, D)
        return torch.ops.dmfx.attention(q, k, v, mask, scale, causal, new_seed() if p else None, p)[0]

    def dmfx_flash(qkv, mask):
        q, k, v = _split(qkv, H, D)
        return torch.ops.dmfx.flash_attention(q, k, v, mask, scale, causal, new_seed() if p else None, p)[0]

    return {"eager": eager, "sdpa": sdpa, "dmfx_gemm": dmfx_gemm, "dmfx_flash": dmfx_flash}


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def run_case(args, L, p, train, mask_kind="padding"):
    B, H, D = args.batch, args.heads, args.head_dim
    qkv, mask = _inputs(B, L, H, D, args.device, train, mask_kind, getattr(torch, args.dtype))
    causal = mask_kind == "causal"
    cands = candidates(H, D, p, causal)
    with torch.no_grad():  # same values first (no dropout)
        ref = candidates(H, D, 0.0, causal)["eager"](qkv, mask).float()
        errs = {n: ((f(qkv, mask).float() - ref).norm() / ref.norm()).item()
                for n, f in candidates(H, D, 0.0, causal).items()}

    def step(f):
        if train:
            qkv.grad = None
            f(qkv, mask).sum().backward()
        else:
            with torch.no_grad():
                f(qkv, mask)

    times = {n: [] for n in cands}
    for r in range(args.warmup + args.rounds):
        for n, f in cands.items():
            _sync(args.device)
            t0 = time.perf_counter()
            step(f)
            _sync(args.device)
            if r >= args.warmup:
                times[n].append((time.perf_counter() - t0) * 1e3)
    return times, errs


def run(args) -> list[dict]:
    """Every (mode, seq, dropout) case of `args`: raw times and errors per candidate."""
    modes = ["train", "infer"] if args.mode == "both" else [args.mode]
    raw = []
    for mode in modes:
        for L in (int(s) for s in str(args.seq).split(",")):
            for p in (float(s) for s in str(args.dropout).split(",")):
                for mask_kind in str(args.mask).split(","):
                    if mode == "infer" and p > 0:
                        continue
                    log(f"[attention {mode}] L={L} p={p} mask={mask_kind} ...")
                    times, errs = run_case(args, L, p, mode == "train", mask_kind)
                    raw.append({"mode": mode, "seq": L, "dropout": p, "mask": mask_kind, "times_ms": times,
                                "rel_err": errs})
    return raw


def table(raw: list[dict]) -> str:
    rows = []
    for case in raw:
        times = case["times_ms"]
        med = {n: statistics.median(t) for n, t in times.items()}
        best_torch = min(med["eager"], med["sdpa"])
        for n, m in med.items():
            rows.append([case["mode"], case["seq"], case["dropout"], case.get("mask", "padding"), n, f"{m:.2f}", f"{min(times[n]):.2f}",
                         f"{med['sdpa'] / m:.2f}", f"{best_torch / m:.2f}", f"{case['rel_err'][n]:.1e}"])
    return tabulate(rows, headers=["mode", "seq", "dropout", "mask", "candidate", "median ms", "min ms", "speedup vs sdpa",
                                   "vs best of eager/sdpa", "rel err (p=0)"], tablefmt="github")


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    raw = run(args)
    head = (f"attention alone | torch {torch.__version__} | {args.device} | threads {args.threads} | {args.dtype} | "
            f"B={args.batch} heads={args.heads} head_dim={args.head_dim} | mask {args.mask} | "
            f"{datetime.datetime.now():%Y-%m-%d %H:%M}")
    print(head)
    print(table(raw))
    stamp = f"{datetime.datetime.now():%Y%m%d-%H%M%S}"
    out = Path(args.json) if args.json else REPO_ROOT / "bench" / "results" / f"attention_{args.device}_{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": vars(args), "header": head, "cases": raw}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

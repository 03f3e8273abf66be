"""Attention over packed variable-length sequences against attention over the padded batch.

What issue 17 (padding-free encoders) buys in attention: a padded batch of B sequences of lengths L_b
(at most Lmax) packed into T = sum L_b tokens, attention per sequence. Candidates, each on the same
real tokens (q, k, v column blocks of one stacked projection output, as a fused QKV GEMM writes it):

* ``varlen``: ``dmfx::qkv_varlen_attention`` on the packed ``[T, 3 * H * D]`` projection (what the
  ``unpad`` fusion emits);
* ``flash_padded``: ``dmfx::qkv_flash_attention`` on the padded ``[B, Lmax, 3 * H * D]`` projection
  with HF's additive padding mask ``[B, 1, 1, Lmax]`` (the flash kernel already skips the keys a
  padding mask hides from a whole sequence, but computes the padded query rows);
* ``sdpa_padded``: ``F.scaled_dot_product_attention`` on the padded views with the same mask (what HF
  runs);
* ``flash_nomask`` (a timing reference, not the same result): the flash op on the padded batch without
  a mask, so every padded score is computed: the cost of attention that ignores padding, against
  which the real-token fraction squared is the ideal.

Work ratios printed next to the times: ``sum L_b^2 / (Lmax * T)`` (varlen's score elements over
flash_padded's, which skips padded keys), and ``f^2`` with f = T / (B * Lmax), the real-token
fraction (over attention that computes every padded score). Forward only (``infer``, no_grad) or
forward + backward (``train``: the gradient of the projection for a random cotangent). One process,
candidates interleaved, medians over ``--rounds``, outputs compared first (no dropout).

Shapes (``--shapes``): ``minilm`` (all-MiniLM-L6-v2 inference: 12 heads, head dim 32, B = 32,
lengths 4-130), ``bert128`` (BERT-base training: 12 heads, head dim 64, B = 32, lengths 20-128,
dropout 0.1), ``bert512`` (the same, B = 8, lengths 20-512).

Usage: ``python -m bench.varlen_attention [--shapes minilm,bert128,bert512] [--rounds 10] [--threads 2]
[--device cpu|cuda] [--dtype float32|bfloat16|float16] [--json PATH]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from tabulate import tabulate

from dmfx.cuda_ops import new_seed

from .common import RESULTS, environment, interleaved, log, sync

SHAPES = {
    "minilm": {"heads": 12, "head_dim": 32, "batch": 32, "lengths": (4, 130), "mode": "infer", "p": 0.0},
    "bert128": {"heads": 12, "head_dim": 64, "batch": 32, "lengths": (20, 128), "mode": "train", "p": 0.1},
    "bert512": {"heads": 12, "head_dim": 64, "batch": 8, "lengths": (20, 512), "mode": "train", "p": 0.1},
}
CANDIDATES = ("varlen", "flash_padded", "sdpa_padded", "flash_nomask")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def sequence_lengths(batch: int, lo: int, hi: int, seed: int = 0) -> list[int]:
    """`batch` lengths drawn uniformly from [lo, hi] (seeded), the longest set to hi."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (batch,), generator=g).tolist()
    lengths[0] = hi
    return lengths


def inputs(lengths: list[int], H: int, D: int, train: bool, device: str = "cpu", dtype=torch.float32):
    """(packed [T, 3HD], cu_seqlens, padded [B, Lmax, 3HD], padding mask [B, 1, 1, Lmax]): the same
    token values, each sequence at the start of its padded row (right padding, as HF tokenizers)."""
    B, Lmax, T = len(lengths), max(lengths), sum(lengths)
    packed = torch.randn(T, 3 * H * D)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    padded = torch.zeros(B, Lmax, 3 * H * D)
    mask = torch.full((B, 1, 1, Lmax), torch.finfo(torch.float32).min)
    for b, L in enumerate(lengths):
        padded[b, :L] = packed[cu[b]: cu[b + 1]]
        mask[b, ..., :L] = 0.0
    packed, padded = (t.to(device, dtype).requires_grad_(train) for t in (packed, padded))
    return packed, cu.to(device), padded, mask.to(device, dtype)


def candidates(H: int, D: int, p: float, cu):
    scale = D**-0.5

    def varlen(packed, padded, mask):
        return torch.ops.dmfx.qkv_varlen_attention(packed, H, cu, scale, False, new_seed() if p else None, p)[0]

    def flash_padded(packed, padded, mask):
        return torch.ops.dmfx.qkv_flash_attention(padded, H, mask, scale, False, new_seed() if p else None, p)[0]

    def sdpa_padded(packed, padded, mask):
        B, L, _ = padded.shape
        q, k, v = (t.transpose(1, 2) for t in padded.view(B, L, 3, H, D).unbind(2))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, scale=scale)

    def flash_nomask(packed, padded, mask):
        return torch.ops.dmfx.qkv_flash_attention(padded, H, None, scale, False, new_seed() if p else None, p)[0]

    return {"varlen": varlen, "flash_padded": flash_padded, "sdpa_padded": sdpa_padded, "flash_nomask": flash_nomask}


def _real_rows(out: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """The real tokens' rows [T, H * D] of a padded [B, H, L, D] attention output."""
    rows = out.transpose(1, 2).flatten(2)
    return torch.cat([rows[b, :L] for b, L in enumerate(lengths)])


def run_shape(name: str, rounds: int, warmup: int, lengths: list[int] | None = None, device: str = "cpu",
              dtype=torch.float32, **overrides) -> dict:
    cfg = {**SHAPES[name], **overrides}
    H, D, p, train = cfg["heads"], cfg["head_dim"], cfg["p"], cfg["mode"] == "train"
    lengths = lengths or sequence_lengths(cfg["batch"], *cfg["lengths"])
    packed, cu, padded, mask = inputs(lengths, H, D, train, device, dtype)
    B, Lmax, T = len(lengths), max(lengths), sum(lengths)
    with torch.no_grad():  # the same values first (no dropout)
        plain = candidates(H, D, 0.0, cu)
        ref = plain["varlen"](packed, padded, mask).flatten(1)
        errs = {"varlen": 0.0}
        for n in ("flash_padded", "sdpa_padded"):
            errs[n] = ((_real_rows(plain[n](packed, padded, mask), lengths) - ref).norm() / ref.norm()).item()
        errs["flash_nomask"] = float("nan")  # (attends the padding: not the same result)
    cands = candidates(H, D, p, cu)
    cot = {n: t.to(device, dtype) for n, t in (("varlen", torch.randn(T, H, D)),
                                              ("flash_padded", torch.randn(B, Lmax, H, D).transpose(1, 2)),
                                              ("sdpa_padded", torch.randn(B, H, Lmax, D)),
                                              ("flash_nomask", torch.randn(B, Lmax, H, D).transpose(1, 2)))}

    def step(n):
        def go():
            sync(device)
            t0 = time.perf_counter()
            if train:
                out = cands[n](packed, padded, mask)
                torch.autograd.grad(out, packed if n == "varlen" else padded, cot[n])
            else:
                with torch.no_grad():
                    cands[n](packed, padded, mask)
            sync(device)
            return {"fwd+bwd" if train else "fwd": time.perf_counter() - t0}

        return go

    times = interleaved({n: step(n) for n in cands}, rounds, warmup,
                        on_fail=lambda n, e: log(f"[varlen_attention] {n} failed: {type(e).__name__}: {e}"))
    sq = sum(L * L for L in lengths)
    return {"shape": name, **cfg, "device": device, "dtype": str(dtype).replace("torch.", ""), "lengths": lengths,
            "T": T, "Lmax": Lmax, "real_fraction": T / (B * Lmax),
            "work_vs_flash": sq / (Lmax * T), "work_vs_dense": sq / (B * Lmax * Lmax),
            "times_ms": {n: next(iter(ph.values())) for n, ph in times.items()}, "rel_err": errs}


def table(results: list[dict]) -> str:
    rows = []
    for r in results:
        med = {n: statistics.median(t) for n, t in r["times_ms"].items()}
        for n, m in med.items():
            rows.append([r["shape"], r["mode"], f"B={len(r['lengths'])} T={r['T']} Lmax={r['Lmax']}", n, f"{m:.2f}",
                         f"{min(r['times_ms'][n]):.2f}", f"{m / med['flash_padded']:.2f}", f"{m / med['sdpa_padded']:.2f}",
                         f"{m / med['flash_nomask']:.2f}", f"{r['rel_err'][n]:.1e}"])
        rows.append([r["shape"], "", f"f={r['real_fraction']:.2f} f^2={r['real_fraction'] ** 2:.2f}",
                     "(score work ratios)", "", "", f"{r['work_vs_flash']:.2f}", f"{r['work_vs_dense']:.2f}",
                     f"{r['work_vs_dense']:.2f}", ""])
    return tabulate(rows, headers=["shape", "mode", "batch", "candidate", "median ms", "min ms", "/ flash_padded",
                                   "/ sdpa_padded", "/ flash_nomask", "rel err (p=0)"], tablefmt="github")


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    results = []
    for name in args.shapes.split(","):
        log(f"[varlen_attention] {name} ...")
        results.append(run_shape(name, args.rounds, args.warmup, device=args.device, dtype=getattr(torch, args.dtype)))
    env = environment(args.device)
    print(f"varlen attention vs padding | torch {env['torch']} | {args.device} | threads {args.threads} | {args.dtype} | "
          f"{env['date']}")
    print(table(results))
    out = RESULTS / f"varlen_attention_{env['date'].replace(':', '')}.json" if not args.json else args.json
    RESULTS.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        json.dump({"environment": env, "results": results}, f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

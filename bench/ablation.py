"""What each part of dmfx's attention (and backward-graph) work is worth in a BERT-base layer training step.

Variants, each its own compiled copy of one HF ``BertLayer`` (eager attention, dropout 0.1), timed
interleaved in one process (forward + backward, input requiring grad, grads reset outside the timed
region), medians:

* ``eager``: PyTorch;
* ``no_attention``: dmfx with the attention and QKV-stacking passes skipped (the softmax chain fused
  alone, transpose copies and batched GEMMs as ATen records them);
* ``gemm``: attention as dmfx's GEMM form (strided batched GEMMs around the fused softmax);
* ``flash``: attention as dmfx's fused kernel (what the cost model picks with dropout on the CPU);
* ``flash_no_stacking``: the same without QKV stacking;
* ``flash_no_backward_passes``: ``flash`` without the backward-graph passes (the gradient adds, the
  stacked bias gradient's reduction and the layout search left as AOTAutograd derived them);
* ``flash_restack_in_backward``: ``flash`` without ``unstack_dx``: the backward's dX GEMM reads the
  stacked weight, concatenated again in the backward (QKV stacking tags it for recomputation).

``--variants a,b,c`` times a subset (eager always runs).

Usage: ``python -m bench.ablation [--seq 128] [--batch 8] [--rounds 8] [--threads 2] [--variants ...] [--json PATH]``
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import statistics
import time
from pathlib import Path

import torch
from tabulate import tabulate

import dmfx  # noqa: F401  (registers the backend)
from dmfx.passes import BACKWARD_PIPELINE

REPO_ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {
    "eager": None,
    "no_attention": {"skip": ["attention", "qkv_attention"]},
    "gemm": {"attention": "gemm"},
    "flash": {"attention": "flash"},
    "flash_no_stacking": {"attention": "flash", "stack_qkv": False},
    "flash_no_backward_passes": {"attention": "flash", "skip": list(BACKWARD_PIPELINE)},
    "flash_restack_in_backward": {"attention": "flash", "skip": ["unstack_dx"]},
}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--variants", default=None, help="comma list of variant names (default: all)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    from dmfx.models import bert_layer

    torch.set_num_threads(a.threads)
    hidden = 768  # BERT-base
    base = bert_layer(hidden=hidden).train()
    x = torch.randn(a.batch, a.seq, hidden, requires_grad=True)
    runs = {}
    chosen = VARIANTS if not a.variants else {"eager": None, **{n: VARIANTS[n] for n in a.variants.split(",")}}
    for name, options in chosen.items():
        m = copy.deepcopy(base)
        runs[name] = (m, m if options is None else torch.compile(m, backend="dmfx", options=options))

    def step(m, f):
        for q in m.parameters():
            q.grad = None
        x.grad = None
        f(x)[0].sum().backward()

    times = {n: [] for n in runs}
    for r in range(a.warmup + a.rounds):
        for n, (m, f) in runs.items():
            t0 = time.perf_counter()
            step(m, f)
            if r >= a.warmup:
                times[n].append((time.perf_counter() - t0) * 1e3)
    med = {n: statistics.median(t) for n, t in times.items()}
    print(f"BertLayer training step | B={a.batch} L={a.seq} | threads {a.threads} | {datetime.datetime.now():%Y-%m-%d %H:%M}")
    print(tabulate([[n, f"{m:.1f}", f"{med['eager'] / m:.3f}"] for n, m in med.items()],
                   headers=["variant", "median ms", "speedup vs eager"], tablefmt="github"))
    out = Path(a.json) if a.json else REPO_ROOT / "bench" / "results" / f"ablation_{datetime.datetime.now():%Y%m%d-%H%M%S}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": vars(a), "times_ms": times}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

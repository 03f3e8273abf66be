"""The fused cross-entropy against eager's ``log_softmax`` + ``nll_loss``, forward + backward, on one
``[tokens, vocab]`` problem (default ``[4*256, 32000]`` float32: a causal LM's loss at B=4, L=256).

Candidates (interleaved A B A B ..., medians, ratio in one run: docs/ARCHITECTURE.md's method):

* ``eager``: ``F.cross_entropy(logits, target)`` then ``backward()`` (ATen's ``_log_softmax`` and
  ``nll_loss_forward``; the backward reads the saved ``[N, V]`` log-probabilities);
* ``dmfx``: ``dmfx.cross_entropy`` then ``backward()`` (``dmfx::cross_entropy`` /
  ``cross_entropy_backward``: the logits read once forward, once backward, only ``[N, 2]`` saved);
* ``+ logits grad``: both again with the logits also receiving a gradient of their own (what a model
  returning its logits gets from AOTAutograd): eager adds it in a separate op, dmfx passes it as
  ``grad_logits`` to the backward kernel.

Peak memory: the peak of live tensor bytes above the inputs during one step (dmfx.explain's
peak_memory: a dispatch-mode count on the CPU, torch.cuda.max_memory_allocated on CUDA).

Usage (from the repository root)::

    python -m bench.cross_entropy [--tokens 1024] [--vocab 32000] [--dtype float32] [--rounds 15] [--device cpu]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import dmfx
from dmfx.explain import peak_memory

from .common import environment, interleaved, log, median, step_cases


def _steps(logits: torch.Tensor, target: torch.Tensor, grad_logits: torch.Tensor):
    """name -> one forward + backward (the logits' gradient reset first)."""
    ops = torch.ops.dmfx

    def eager():
        logits.grad = None
        F.cross_entropy(logits, target).backward()

    def fused():
        logits.grad = None
        dmfx.cross_entropy(logits, target).backward()

    def eager_plus():
        logits.grad = None
        loss = F.cross_entropy(logits, target)
        torch.autograd.backward([loss, logits], [torch.ones(()), grad_logits])

    def fused_plus():
        # what the compiled backward runs once fold_logits_grad has fired: the tangent inside the kernel
        loss, lse = ops.cross_entropy(logits.detach(), target, -100, 0.0, 1)
        ops.cross_entropy_backward(torch.ones(()), logits.detach(), target, lse, -100, 0.0, 1, grad_logits)

    return {"eager": eager, "dmfx": fused, "eager + logits grad": eager_plus, "dmfx + logits grad": fused_plus}


def run(tokens: int, vocab: int, dtype: torch.dtype, rounds: int, warmup: int, device: str) -> dict:
    torch.manual_seed(0)
    logits = (torch.randn(tokens, vocab, device=device) * 2).to(dtype).requires_grad_()
    target = torch.randint(0, vocab, (tokens,), device=device)
    target[::17] = -100
    grad_logits = torch.randn(tokens, vocab, device=device).to(dtype)
    steps = _steps(logits, target, grad_logits)
    times = interleaved(step_cases(steps, device), rounds, warmup)
    peak = {name: peak_memory(fn, device=device).peak_bytes for name, fn in steps.items()}
    return {"env": environment(device), "shape": [tokens, vocab], "dtype": str(dtype),
            "median_ms": {name: median(t["step"]) for name, t in times.items()}, "peak_bytes": peak}


def table(result: dict) -> str:
    med, peak = result["median_ms"], result["peak_bytes"]
    lines = [f"cross-entropy forward + backward, logits {result['shape']} {result['dtype']} "
             f"({result['env']['device']}, {result['env']['threads']} threads, torch {result['env']['torch']})",
             f"{'candidate':<22} {'median ms':>10} {'vs eager':>9} {'peak MB':>9}"]
    for name in med:
        base = "eager + logits grad" if "logits grad" in name else "eager"
        lines.append(f"{name:<22} {med[name]:>10.2f} {med[base] / med[name]:>8.2f}x {peak[name] / 2**20:>9.1f}")
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.cross_entropy", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4 * 256)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", default="cpu")
    a = p.parse_args(argv)
    log(f"bench.cross_entropy: [{a.tokens}, {a.vocab}] {a.dtype} on {a.device}, {a.rounds} rounds")
    result = run(a.tokens, a.vocab, getattr(torch, a.dtype), a.rounds, a.warmup, a.device)
    print(table(result))
    return result


if __name__ == "__main__":
    main()

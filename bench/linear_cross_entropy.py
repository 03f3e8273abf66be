"""The chunked LM head + loss (``dmfx::linear_cross_entropy``: the ``[tokens, vocab]`` logits never
exist) against the head and loss computed whole, forward + backward, at LM sizes (default 2048 tokens,
hidden 512, vocabulary 32000, float32).

Candidates (interleaved A B C ..., medians, ratios in one run: docs/ARCHITECTURE.md's method):

* ``eager``: ``F.cross_entropy(F.linear(h, W).float(), y)`` then ``backward()`` (HF's spelling: the
  logits upcast; a no-op for float32): the ``[N, V]`` logits, their log-probabilities and gradient;
* ``inductor``: the same function under ``torch.compile`` (default backend);
* ``dmfx``: ``dmfx.linear_cross_entropy`` (the gradients computed in the forward, chunk by chunk: what
  the pass emits for a reduced loss);
* ``dmfx recompute``: the same op with ``grads_in_forward=False``: the backward computes the logits
  again, chunk by chunk (what the pass emits for reduction none);
* ``dmfx compiled``: eager's function under ``torch.compile(backend="dmfx", options={"fuse": "all",
  "compiler": "fx"})`` (the pass fires: checked);
* ``gemm floor``: the step's three GEMMs alone (logits, dhidden, dweight: ``N * V * H`` each) into
  preallocated buffers, the time if everything else were free.

Peak memory: the peak of live tensor bytes above the inputs during one step (dmfx.explain's
peak_memory: a dispatch-mode count on the CPU, which sees inside the composite op; Inductor's CPU
buffers are invisible to it, so n/a there; torch.cuda.max_memory_allocated on CUDA).

Usage (from the repository root)::

    python -m bench.linear_cross_entropy [--tokens 2048] [--hidden 512] [--vocab 32000] [--dtype float32]
        [--chunk N] [--rounds 5] [--warmup 1] [--threads 2] [--device cpu] [--candidates eager,dmfx,...]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import dmfx
from dmfx.cuda_ops.cross_entropy import default_chunk
from dmfx.explain import peak_memory

from .common import environment, interleaved, log, median, step_cases


def _loss(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(h, w).float(), y)


def _steps(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor, chunk: int, device: str) -> dict:
    """name -> one forward + backward (the gradients reset first)."""

    def reset():
        h.grad = w.grad = None

    def eager():
        reset()
        _loss(h, w, y).backward()

    inductor_fn = torch.compile(_loss)

    def inductor():
        reset()
        inductor_fn(h, w, y).backward()

    def fused(in_forward: bool):
        def step():
            reset()
            dmfx.linear_cross_entropy(h, w, y, chunk=chunk, grads_in_forward=in_forward).backward()

        return step

    dmfx_fn = torch.compile(_loss, backend="dmfx", options={"fuse": "all", "compiler": "fx", "fallback": False})

    def compiled():
        reset()
        dmfx_fn(h, w, y).backward()

    N, H, V = h.shape[0], h.shape[1], w.shape[0]
    z, dz = torch.empty(N, V, dtype=h.dtype, device=device), torch.randn(N, V, device=device).to(h.dtype)
    dh, dw = torch.empty(N, H, dtype=h.dtype, device=device), torch.empty(V, H, dtype=h.dtype, device=device)

    def floor():
        with torch.no_grad():
            torch.mm(h, w.t(), out=z)
            torch.mm(dz, w, out=dh)
            torch.mm(dz.t(), h, out=dw)

    return {"eager": eager, "inductor": inductor, "dmfx": fused(True), "dmfx recompute": fused(False),
            "dmfx compiled": compiled, "gemm floor": floor}


CANDIDATES = ("eager", "inductor", "dmfx", "dmfx recompute", "dmfx compiled", "gemm floor")


def run(tokens: int, hidden: int, vocab: int, dtype: torch.dtype, chunk: int | None, rounds: int, warmup: int,
        device: str, candidates: tuple[str, ...] = CANDIDATES) -> dict:
    torch.manual_seed(0)
    h = torch.randn(tokens, hidden, device=device).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, device=device) / hidden**0.5).to(dtype).requires_grad_()
    y = torch.randint(0, vocab, (tokens,), device=device)
    y[::17] = -100
    chunk = chunk or default_chunk(tokens, vocab)
    steps = {name: fn for name, fn in _steps(h, w, y, chunk, device).items() if name in candidates}
    times = interleaved(step_cases(steps, device), rounds, warmup,
                        on_fail=lambda name, e: log(f"bench.linear_cross_entropy: {name} failed: {type(e).__name__}: {e}"))
    fired = [r.fired.get("linear_cross_entropy", 0) for r in dmfx.records()]
    peak = {}
    for name, fn in steps.items():
        if name in times and not (name == "inductor" and device == "cpu"):
            peak[name] = peak_memory(fn, device=device).peak_bytes
    return {"env": environment(device), "shape": {"tokens": tokens, "hidden": hidden, "vocab": vocab}, "chunk": chunk,
            "dtype": str(dtype), "pass_fired": any(fired), "times_ms": {n: t["step"] for n, t in times.items()},
            "median_ms": {name: median(t["step"]) for name, t in times.items()}, "peak_bytes": peak}


def table(result: dict) -> str:
    med, peak, s = result["median_ms"], result["peak_bytes"], result["shape"]
    lines = [f"linear + cross-entropy forward + backward, N={s['tokens']} H={s['hidden']} V={s['vocab']} "
             f"{result['dtype']}, chunk {result['chunk']} ({result['env']['device']}, {result['env']['threads']} threads, "
             f"torch {result['env']['torch']}; the pass fired under torch.compile: {result['pass_fired']})",
             f"{'candidate':<16} {'median ms':>10} {'range ms':>17} {'vs eager':>9} {'vs floor':>9} {'peak MB':>9}"]
    for name in med:
        t = result["times_ms"][name]
        mb = f"{peak[name] / 2**20:>9.1f}" if name in peak else f"{'n/a':>9}"
        lines.append(f"{name:<16} {med[name]:>10.1f} {min(t):>8.1f}-{max(t):<8.1f} {med['eager'] / med[name]:>8.2f}x "
                     f"{med[name] / med['gemm floor']:>8.2f}x {mb}")
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.linear_cross_entropy", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--chunk", type=int, default=None, help="rows per chunk (default: default_chunk)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--candidates", default=",".join(CANDIDATES), help="comma-separated subset (eager and gemm floor "
                   "are always run: the ratios need them)")
    a = p.parse_args(argv)
    chosen = {c.strip() for c in a.candidates.split(",")} | {"eager", "gemm floor"}
    torch.set_num_threads(a.threads)
    log(f"bench.linear_cross_entropy: N={a.tokens} H={a.hidden} V={a.vocab} {a.dtype} on {a.device}, {a.rounds} rounds")
    result = run(a.tokens, a.hidden, a.vocab, getattr(torch, a.dtype), a.chunk, a.rounds, a.warmup, a.device,
                 tuple(c for c in CANDIDATES if c in chosen))
    print(table(result))
    return result


if __name__ == "__main__":
    main()

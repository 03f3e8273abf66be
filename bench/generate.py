"""Compiled generation: HF ``generate()`` tokens per second, eager / Inductor / dmfx, interleaved.

The workload of issue 16: ``LlamaForCausalLM`` (hidden 512, 4 layers, 8 heads / 4 KV heads, vocab
8000, random weights), batch 2, a 16-token prompt, 48 new tokens, greedy. ``--cache static`` (the
default) is the way HF documents compiled decoding: ``cache_implementation="static"`` with a
``CompileConfig(backend=...)`` (its default mode, "reduce-overhead"; on the CPU generate() compiles only
with the private ``CompileConfig._compile_all_devices`` set), which compiles the decode step and runs
the prefill eagerly. ``--cache dynamic``: ``model.forward = torch.compile(model.forward, backend=...,
dynamic=True)`` with the default dynamic cache (prefill and decode compiled).

Method (docs/ARCHITECTURE.md): one model per candidate (same weights), one untimed generate each
first (it compiles: its time is reported as the first call), then rounds A B C A B C, medians.
Reported: tokens per second (batch x new tokens / generate time), ratios, the graphs each backend
compiled (Dynamo's unique graphs; for dmfx also its records, and any graph left to PyTorch), and
whether every candidate's tokens are eager's.

Usage (from the repository root)::

    python -m bench.generate [--rounds 5] [--cache static|dynamic] [--threads 2] [--new-tokens 48]
                             [--device cpu|cuda] [--backends inductor,dmfx]

On CUDA, CompileConfig's default mode ("reduce-overhead") captures CUDA graphs: Inductor's own for
"inductor", dmfx's option ``cudagraphs`` for "dmfx" (each graph's record says whether it was captured).
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import torch

import dmfx

from .common import RESULTS, environment, interleaved, log, median

CANDIDATES = ("eager", "inductor", "dmfx")


def build(seed: int = 0):
    """The issue's LLaMA (random weights, eval mode)."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=8000, hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
                                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512)
    return transformers.LlamaForCausalLM(cfg).eval()


def generator(model, backend: str | None, cache: str, prompt: torch.Tensor, new_tokens: int, device: str = "cpu"):
    """A function running one greedy generate() of `model` compiled with `backend` (None: eager)."""
    import transformers

    kwargs = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                  do_sample=False)
    if cache == "static":
        kwargs["cache_implementation"] = "static"
        if backend is not None:
            config = transformers.CompileConfig(backend=backend)  # (mode "reduce-overhead", HF's default)
            if device == "cpu":
                config._compile_all_devices = True  # (generate() compiles on the CPU only with it)
            kwargs["compile_config"] = config
    elif backend is not None:
        model.forward = torch.compile(model.forward, backend=backend, dynamic=True)

    def run() -> torch.Tensor:
        with torch.no_grad():
            out = model.generate(prompt, **kwargs)
        if device == "cuda":
            torch.cuda.synchronize()
        return out

    return run


def _unique_graphs() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--cache", choices=("static", "dynamic"), default="static")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--json", default=None)
    p.add_argument("--backends", default=",".join(CANDIDATES[1:]),
                   help="compiled candidates beside eager, comma-separated (default: inductor,dmfx); one alone "
                        "gives its first-call time with no other backend's compile in the process")
    args = p.parse_args(argv)
    candidates = ("eager", *[b for b in args.backends.split(",") if b and b != "eager"])
    unknown = sorted(set(candidates) - set(CANDIDATES))
    if unknown:
        p.error(f"--backends: unknown {unknown}; expected some of {list(CANDIDATES[1:])}")
    torch.set_num_threads(args.threads)
    torch._dynamo.reset()
    dmfx.reset()
    base = build().to(args.device)
    prompt = torch.randint(0, base.config.vocab_size, (args.batch, args.prompt), device=args.device)
    runs, first, graphs, tokens = {}, {}, {}, {}
    for name in candidates:  # compile each (first call), counting the graphs it compiled
        before = _unique_graphs()
        runs[name] = generator(copy.deepcopy(base), None if name == "eager" else name, args.cache, prompt,
                               args.new_tokens, args.device)
        start = time.perf_counter()
        tokens[name] = runs[name]()
        first[name] = time.perf_counter() - start
        graphs[name] = _unique_graphs() - before
        log(f"{name}: first generate {first[name]:.1f} s, {graphs[name]} graph(s)")

    def timed(run):
        def step() -> dict[str, float]:
            start = time.perf_counter()
            run()
            return {"generate": time.perf_counter() - start}

        return step

    times = interleaved({n: timed(r) for n, r in runs.items()}, rounds=args.rounds, warmup=0)
    per_run = args.batch * args.new_tokens
    ms = {n: median(t["generate"]) for n, t in times.items()}
    tps = {n: per_run / (v / 1e3) for n, v in ms.items()}
    records = dmfx.records()
    result = {
        "env": environment(args.device),
        "workload": dict(cache=args.cache, batch=args.batch, prompt=args.prompt, new_tokens=args.new_tokens,
                         model="LlamaForCausalLM hidden 512, 4 layers, 8/4 heads, vocab 8000"),
        "ms_per_generate": ms, "tokens_per_s": tps, "first_generate_s": first, "graphs": graphs,
        "same_tokens_as_eager": {n: bool(torch.equal(t, tokens["eager"])) for n, t in tokens.items()},
        "dmfx_records": [r.summary() for r in records],
        "dmfx_fallbacks": [r.fallback for r in records if r.fallback],
        "rounds_ms": {n: t["generate"] for n, t in times.items()},
    }
    print(f"generate() on {args.device}, {args.cache} cache, batch {args.batch}, {args.new_tokens} new tokens, "
          f"{args.threads} threads, medians of {args.rounds} interleaved rounds")
    print(f"{'':10}{'tokens/s':>10}{'vs eager':>10}{'vs inductor':>13}{'graphs':>8}{'first s':>9}  same tokens")
    for n in candidates:
        if n in tps:
            print(f"{n:10}{tps[n]:10.1f}{tps[n] / tps['eager']:10.2f}{tps[n] / tps.get('inductor', float('nan')):13.2f}"
                  f"{graphs[n]:8d}{first[n]:9.1f}  {result['same_tokens_as_eager'][n]}")
    for line in result["dmfx_records"]:
        print("dmfx:", line)
    out = args.json or RESULTS / f"generate-{args.cache}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    RESULTS.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1, default=str)
    log(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()

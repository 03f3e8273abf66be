"""Compile cost: time to the first result of a training step (or, with ``--infer``, of an inference
forward: eval mode, no grad), for Inductor and for dmfx, with a cold
cache (fresh DMFX_CACHE_DIR / TORCHINDUCTOR_CACHE_DIR temp dirs: dmfx builds its kernels, Inductor
generates and compiles its code) and a warm one (a later process reusing those dirs: Inductor's
AOTAutograd and FX graph caches, which dmfx's compiled graphs go through too, dmfx/graph_cache.py).
Each measurement is its own subprocess, so nothing in memory is reused. ``compile_s`` is the first
step's time less the second step's.

    python -m bench.compile_cost --models bert-mlm --layers 12 --repeat 3 --kernels shared
    python -m bench.compile_cost --models llama-lm --layers 4 --batch 1 --seq 2048 --infer --kernels shared
    python -m bench.compile_cost --child --backend dmfx --model bert-base --layers 2   (one measurement, JSON on stdout)

Models: those of dmfx.models (backbones, ``loss_of`` their outputs) and those of bench/lm_step.py
(``bert-mlm``, ``gpt2-lm``, ``llama-lm``, ``llama-small``, ``vit-cls``: heads and losses, their own
batch sizes unless ``--batch/--seq`` are given). ``--kernels shared`` keeps dmfx's kernels in the
usual kernel cache (built once per machine) so that "cold" is a cold compile, not a kernel build;
``--kernels fresh`` (the default of ``python -m bench compile``) builds them too.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from .common import REPO_ROOT, log


def _child(argv) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--child", action="store_true")
    p.add_argument("--backend", choices=["inductor", "dmfx", "eager"], required=True)
    p.add_argument("--model", default="bert-base")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=0)  # 0: the model's own (dmfx.models: 2, L=64)
    p.add_argument("--seq", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--infer", action="store_true")
    a = p.parse_args(argv)
    t_import = time.perf_counter()
    import torch

    import dmfx  # noqa: F401
    from dmfx.models import build_model, loss_of

    from . import lm_step

    if a.threads:
        torch.set_num_threads(a.threads)
    if a.model in lm_step.MODELS:
        model, kwargs = lm_step.build(a.model, a.layers, batch=a.batch or None, seq=a.seq or None)
        model = model.to(a.device)
        kwargs = {k: v.to(a.device) for k, v in kwargs.items()}
    else:
        model, kwargs = build_model(a.model, a.batch or 2, a.seq or 64, a.layers, a.device)
    model.train(not a.infer)
    compiled = model if a.backend == "eager" else torch.compile(model, backend=a.backend)

    def step():
        if a.infer:
            with torch.no_grad():
                compiled(**kwargs)
        else:
            model.zero_grad(set_to_none=True)
            loss_of(compiled(**kwargs)).backward()

    t0 = time.perf_counter()
    step()
    if a.device == "cuda":
        torch.cuda.synchronize()
    first = time.perf_counter() - t0
    t1 = time.perf_counter()
    step()
    if a.device == "cuda":
        torch.cuda.synchronize()
    second = time.perf_counter() - t1
    graphs = [r.cache or ("Inductor's" if (r.fallback or "").startswith("left to Inductor") else
                          "fallback" if r.fallback else "not cached") for r in dmfx.records()]
    print(json.dumps({"backend": a.backend, "first_step_s": first, "second_step_s": second,
                      "compile_s": max(first - second, 0.0), "import_s": t0 - t_import,
                      "dmfx_graphs": graphs if a.backend == "dmfx" else []}))


def measure(backend: str, cache: dict[str, str], model: str, layers: int, batch: int, seq: int, device: str,
            timeout: int = 900, threads: int = 0, infer: bool = False) -> dict:
    env = {**os.environ, **cache, "PYTHONPATH": str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "bench.compile_cost", "--child", "--backend", backend, "--model", model,
           "--layers", str(layers), "--batch", str(batch), "--seq", str(seq), "--device", device, "--threads", str(threads)]
    cmd += ["--infer"] if infer else []
    t = time.perf_counter()
    p = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t
    if p.returncode != 0:
        return {"backend": backend, "error": p.stderr.strip()[-1500:], "process_s": wall}
    out = json.loads(p.stdout.strip().splitlines()[-1])
    out["process_s"] = wall
    return out


def run(device: str, model: str = "bert-base", layers: int = 2, batch: int = 2, seq: int = 64,
        backends: tuple[str, ...] = ("inductor", "dmfx"), repeat: int = 1, kernels: str = "fresh",
        threads: int = 0, infer: bool = False) -> list[dict]:
    """Each backend with a cold cache, then `repeat` warm processes; with ``kernels="shared"`` dmfx's
    kernels come from the usual kernel cache (its graph records, dmfx/graph_cache.py, then live there
    too, and are only read on a hit of the fresh Inductor cache's entries)."""
    results = []
    for backend in backends:  # (each backend its own caches: its cold run is cold)
        with tempfile.TemporaryDirectory(prefix="dmfx_bench_cache_") as tmp:
            cache = {"TORCHINDUCTOR_CACHE_DIR": os.path.join(tmp, "inductor"), "TORCHINDUCTOR_FX_GRAPH_CACHE": "1"}
            if kernels == "fresh":
                cache["DMFX_CACHE_DIR"] = os.path.join(tmp, "dmfx")
            for state in ("cold",) + ("warm",) * repeat:
                log(f"[compile] {backend} {state} cache: {model} ({layers} layers, B={batch or 'default'}, "
                    f"L={seq or 'default'}) in a fresh process ...")
                r = measure(backend, cache, model, layers, batch, seq, device, threads=threads, infer=infer)
                r.update({"cache": state, "model": model, "layers": layers, "batch": batch, "seq": seq, "device": device,
                          "mode": "infer" if infer else "train"})
                results.append(r)
                log("[compile]   " + (f"first step {r['first_step_s']:.1f} s, compile {r['compile_s']:.1f} s"
                                      if "first_step_s" in r else f"failed: {r['error'][-300:]}"))
    return results


def table(results: list[dict]) -> str:
    from tabulate import tabulate

    rows = [[r["model"], r["backend"], r["cache"], f"{r['first_step_s']:.2f}" if "first_step_s" in r else "failed",
             f"{r['compile_s']:.2f}" if "compile_s" in r else "",
             f"{r['second_step_s'] * 1e3:.1f}" if "second_step_s" in r else "", f"{r['process_s']:.1f}",
             ", ".join(r.get("dmfx_graphs", []))] for r in results]
    return tabulate(rows, headers=["model", "backend", "cache", "time to first result s", "compile s", "next step ms",
                                   "process s", "dmfx graphs (record.cache)"], tablefmt="github", disable_numparse=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="bert-base")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=0)
    p.add_argument("--seq", type=int, default=0)
    p.add_argument("--backends", default="inductor,dmfx")
    p.add_argument("--repeat", type=int, default=1, help="warm processes per backend")
    p.add_argument("--kernels", choices=["fresh", "shared"], default="fresh")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--infer", action="store_true", help="an inference forward (eval, no grad) instead of a training step")
    a = p.parse_args(argv)
    results = []
    for model in a.models.split(","):
        results += run(a.device, model, a.layers, a.batch, a.seq, tuple(a.backends.split(",")), a.repeat, a.kernels,
                       a.threads, a.infer)
    print(table(results))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    if "--child" in sys.argv:
        _child(sys.argv[1:])
    else:
        main()

"""Compile cost: time to the first result of a training step, for Inductor and for dmfx, with a cold
cache (fresh DMFX_CACHE_DIR / TORCHINDUCTOR_CACHE_DIR temp dirs: dmfx builds its kernels, Inductor
generates and compiles its code) and a warm one (a second process reusing those dirs). Each
measurement is its own subprocess, so nothing in memory is reused.

    python -m bench.compile_cost --child --backend dmfx --model bert-base --layers 2   (one measurement, JSON on stdout)
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
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--device", default="cpu")
    a = p.parse_args(argv)
    t_import = time.perf_counter()
    import torch

    import dmfx  # noqa: F401
    from dmfx.models import build_model, loss_of

    model, kwargs = build_model(a.model, a.batch, a.seq, a.layers, a.device)
    model.train()
    compiled = model if a.backend == "eager" else torch.compile(model, backend=a.backend)
    t0 = time.perf_counter()
    loss_of(compiled(**kwargs)).backward()
    if a.device == "cuda":
        torch.cuda.synchronize()
    first = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    t1 = time.perf_counter()
    loss_of(compiled(**kwargs)).backward()
    if a.device == "cuda":
        torch.cuda.synchronize()
    second = time.perf_counter() - t1
    print(json.dumps({"backend": a.backend, "first_step_s": first, "second_step_s": second,
                      "compile_s": max(first - second, 0.0), "import_s": t0 - t_import}))


def measure(backend: str, cache: dict[str, str], model: str, layers: int, batch: int, seq: int, device: str,
            timeout: int = 900) -> dict:
    env = {**os.environ, **cache, "PYTHONPATH": str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "bench.compile_cost", "--child", "--backend", backend, "--model", model,
           "--layers", str(layers), "--batch", str(batch), "--seq", str(seq), "--device", device]
    t = time.perf_counter()
    p = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t
    if p.returncode != 0:
        return {"backend": backend, "error": p.stderr.strip()[-1500:], "process_s": wall}
    out = json.loads(p.stdout.strip().splitlines()[-1])
    out["process_s"] = wall
    return out


def run(device: str, model: str = "bert-base", layers: int = 2, batch: int = 2, seq: int = 64,
        backends: tuple[str, ...] = ("inductor", "dmfx")) -> list[dict]:
    results = []
    with tempfile.TemporaryDirectory(prefix="dmfx_bench_cache_") as tmp:
        cache = {"DMFX_CACHE_DIR": os.path.join(tmp, "dmfx"), "TORCHINDUCTOR_CACHE_DIR": os.path.join(tmp, "inductor"),
                 "TORCHINDUCTOR_FX_GRAPH_CACHE": "1"}
        for backend in backends:
            for state in ("cold", "warm"):
                log(f"[compile] {backend} {state} cache: {model} ({layers} layers, B={batch}, L={seq}) in a fresh process ...")
                r = measure(backend, cache, model, layers, batch, seq, device)
                r.update({"cache": state, "model": model, "layers": layers, "batch": batch, "seq": seq, "device": device})
                results.append(r)
                log("[compile]   " + (f"first step {r['first_step_s']:.1f} s" if "first_step_s" in r else f"failed: {r['error'][-300:]}"))
    return results


def table(results: list[dict]) -> str:
    from tabulate import tabulate

    rows = [[r["backend"], r["cache"], f"{r['first_step_s']:.2f}" if "first_step_s" in r else "failed",
             f"{r['second_step_s'] * 1e3:.1f}" if "second_step_s" in r else "", f"{r['process_s']:.1f}"] for r in results]
    return tabulate(rows, headers=["backend", "cache", "time to first result s", "next step ms", "process s"],
                    tablefmt="github", disable_numparse=True)


if __name__ == "__main__":
    if "--child" in sys.argv:
        _child(sys.argv[1:])
    else:
        print(table(run("cpu")))

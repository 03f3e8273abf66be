"""Whole models, inference and training: eager vs Inductor vs dmfx. Time (interleaved medians), peak
memory of one step (dmfx.explain's peak_memory) and bytes moved (dmfx.explain's runtime_bytes).

Bytes moved are counted per dispatched op, so they are exact for eager and dmfx (whose kernels are ops)
but not for Inductor: its generated kernels are not dispatcher ops, so the table says "n/a". Peak
memory on CPU comes from the same dispatch mode (Inductor's CPU buffers bypass it: "n/a" too); on
CUDA from torch.cuda.max_memory_allocated, for every candidate.
"""

from __future__ import annotations

import copy

import torch

from dmfx.explain import peak_memory, runtime_bytes
from dmfx.models import build_model, loss_of

from .common import interleaved, log, median, timer

# name, default (CPU, fits the ~8 minute budget), full (real sizes)
DEFAULT = {"bert-base": dict(layers=1, batch=2, seq=64), "gpt2": dict(layers=1, batch=2, seq=64),
           "llama": dict(layers=1, batch=2, seq=64), "vit": dict(layers=1, batch=2, seq=None),
           "minilm": dict(layers=None, batch=2, seq=64)}
FULL = {"bert-base": dict(layers=None, batch=8, seq=128), "gpt2": dict(layers=None, batch=8, seq=128),
        "llama": dict(layers=None, batch=8, seq=128), "vit": dict(layers=None, batch=8, seq=None),
        "minilm": dict(layers=None, batch=8, seq=128)}
SMOKE = {"bert-tiny": dict(layers=1, batch=2, seq=16)}


def _fresh_compile_state() -> None:
    """Forget earlier cases' compiled code: HF models share frames (e.g. transformers' forward wrappers),
    and compiling model after model into one code object's cache would reach Dynamo's recompile limit,
    after which Dynamo silently runs eager."""
    torch._dynamo.reset()
    try:
        import dmfx

        dmfx.reset()
    except Exception:  # noqa: BLE001
        pass


def _step(module, kwargs, train: bool):
    if train:
        def step():
            module.zero_grad(set_to_none=True)
            loss = loss_of(module(**kwargs))
            loss.backward()
            return loss
    else:
        def step():
            with torch.no_grad():
                return module(**kwargs)
    return step


def run(device: str, sizes: dict[str, dict], candidates: list[str], rounds: int, warmup: int, dtype=torch.float32) -> list[dict]:
    results = []
    for model_name, size in sizes.items():
        try:
            base, kwargs = build_model(model_name, size["batch"], size["seq"] or 0, size["layers"], device, dtype)
        except Exception as e:  # noqa: BLE001
            log(f"[models] {model_name}: cannot build ({type(e).__name__}: {e}); skipped")
            results.append({"model": model_name, "size": size, "skipped": f"{type(e).__name__}: {e}"})
            continue
        for mode in ("infer", "train"):
            train = mode == "train"
            _fresh_compile_state()
            steps, skipped = {}, {}
            for name in candidates:
                m = copy.deepcopy(base).train(train)
                if name == "inductor":
                    m = torch.compile(m)
                elif name == "dmfx":
                    m = torch.compile(m, backend="dmfx")
                steps[name] = _step(m, kwargs, train)
            now = timer(device)

            def timed(step):
                def run_once():
                    t0 = now()
                    step()
                    return {"total": now() - t0}
                return run_once

            def failed(name, e):
                skipped[name] = f"{type(e).__name__}: {e}"
                log(f"[models]   {model_name} {mode} {name} failed: {skipped[name][:300]}")

            log(f"[models] {model_name} {mode} {size}: {', '.join(steps)} ({warmup} warm-up + {rounds} rounds)")
            times = interleaved({n: timed(s) for n, s in steps.items()}, rounds, warmup, failed)
            med = {n: median(t["total"]) for n, t in times.items()}
            peak, moved = {}, {}
            for n in times:
                try:
                    # Inductor's kernels and CPU buffers are invisible to a dispatch mode: n/a there
                    invisible = n == "inductor"
                    peak[n] = None if invisible and device == "cpu" else peak_memory(steps[n], device=device).peak_bytes
                    moved[n] = None if invisible else runtime_bytes(steps[n]).total
                except Exception as e:  # noqa: BLE001
                    skipped[n] = f"counting failed: {type(e).__name__}: {e}"
            res = {"model": model_name, "mode": mode, "size": size, "device": device, "times_ms": {n: t["total"] for n, t in times.items()},
                   "median_ms": med, "peak_bytes": peak, "bytes_moved": moved, "skipped": skipped,
                   "speedup_vs_eager": {n: med["eager"] / t for n, t in med.items() if "eager" in med and t},
                   "speedup_vs_inductor": {n: med["inductor"] / t for n, t in med.items() if "inductor" in med and t}}
            results.append(res)
            log(f"[models] {model_name} {mode}: " + ", ".join(f"{n} {t:.1f} ms" for n, t in med.items()))
    return results


def _mb(x) -> str:
    return "n/a" if x is None else f"{x / 1e6:.1f}"


def _ratio(x) -> str:
    return "" if x is None else f"{x:.2f}"


def table(results: list[dict]) -> str:
    from tabulate import tabulate

    rows = []
    for r in results:
        if "median_ms" not in r:
            rows.append([r["model"], "", "", "skipped: " + r.get("skipped", "")[:60], "", "", "", ""])
            continue
        for n, t in r["median_ms"].items():
            moved = r["bytes_moved"].get(n)
            rows.append([r["model"], r["mode"], n, f"{t:.1f}", _ratio(r["speedup_vs_eager"].get(n)),
                         _ratio(r["speedup_vs_inductor"].get(n)),
                         _mb(r["peak_bytes"].get(n)), _mb(moved)])
    return tabulate(rows, headers=["model", "mode", "candidate", "median ms", "speedup vs eager", "vs inductor", "peak MB", "MB moved"],
                    tablefmt="github", disable_numparse=True)

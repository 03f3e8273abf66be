"""Where a whole-model step spends its GPU time, kernel by kernel, per candidate (for a GPU session).

bench/lm_step.py says *whether* dmfx is ahead of Inductor on a model; this says *why*: each candidate
(eager, inductor, dmfx, dmfx-all, ...) is compiled as lm_step compiles it, warmed up, and then
``--steps`` steps run under ``torch.profiler``. Per candidate it prints

* the step's wall time (device synchronized) and its summed kernel time: a wall time well above the
  kernel time means the GPU waits for the host (launch overhead, Python between kernels);
* kernels launched per step;
* kernel time by family: GEMMs (cuBLAS/CUTLASS names), dmfx's own kernels, Triton (Inductor's
  generated kernels), and the rest (ATen's own kernels);
* the ``--top`` kernels by their time per step;
* the ``--top`` ATen and dmfx ops by their self CPU time on the host, with µs per call: where a
  host-bound step's time goes.

On a CPU (``--device cpu``, to try the script) there are no kernels; it prints the ATen ops by their
self CPU time instead.

Usage (repository root)::

    python3 -m bench.gpu_profile --device cuda --autocast bf16 --models bert-mlm --layers 4 \\
        --candidates inductor,dmfx-all [--steps 5] [--top 15] [--infer]
"""

from __future__ import annotations

import argparse
import collections
import re
import time

import torch
from tabulate import tabulate

from .common import log, sync
from .lm_step import build, candidates

FAMILIES = (  # (family, pattern on the kernel's name), first match wins
    ("gemm", re.compile(r"gemm|cutlass|sm\d+_xmma|ampere_|hopper|cublas|nvjet", re.I)),
    ("dmfx", re.compile(r"dmfx", re.I)),
    ("triton", re.compile(r"^triton_", re.I)),
)


def family(name: str) -> str:
    return next((f for f, pat in FAMILIES if pat.search(name)), "aten/other")


def _device_time_us(evt) -> float:
    # (the attribute was renamed, self_cuda_time_total -> self_device_time_total, in torch 2.x)
    return float(getattr(evt, "self_device_time_total", None) or getattr(evt, "self_cuda_time_total", 0.0))


def profile(step, steps: int, device: str) -> dict:
    """`steps` steps of `step` under the profiler: wall ms per step, kernel (or op) ms per step by name."""
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device == "cuda" else [])
    for _ in range(2):
        step()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync(device)
    wall = (time.perf_counter() - t0) * 1e3 / steps  # outside the profiler: its own cost is not the step's
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(steps):
            step()
        sync(device)
    kernels = collections.defaultdict(lambda: [0.0, 0])  # kernel name -> [us per step, launches per step]
    host = collections.defaultdict(lambda: [0.0, 0])  # the same for the host's ATen and dmfx ops (self CPU time)
    for evt in prof.key_averages():
        if str(getattr(evt, "device_type", "")).endswith("CUDA"):
            into, us = kernels, _device_time_us(evt)
        elif evt.key.startswith(("aten::", "dmfx::")):
            into, us = host, float(evt.self_cpu_time_total)
        else:
            continue
        if us > 0:
            into[evt.key][0] += us / steps
            into[evt.key][1] += evt.count / steps
    # (on a CPU there are no kernels: the ops' self time stands in for them)
    return {"wall_ms": wall, "kernels": dict(kernels if device == "cuda" else host), "host": dict(host)}


def report(name: str, res: dict, top: int, device: str) -> None:
    k = res["kernels"]
    total = sum(v[0] for v in k.values()) / 1e3
    fam = collections.defaultdict(lambda: [0.0, 0.0])
    for kname, (us, n) in k.items():
        f = fam[family(kname) if device == "cuda" else ("dmfx" if kname.startswith("dmfx::") else "aten")]
        f[0] += us / 1e3
        f[1] += n
    what = "kernel" if device == "cuda" else "op (self CPU)"
    print(f"\n## {name}: wall {res['wall_ms']:.2f} ms/step, {what} time {total:.2f} ms/step, "
          f"{sum(v[1] for v in k.values()):.0f} {what.split()[0]}s/step")
    print(tabulate([[f, f"{ms:.3f}", f"{100 * ms / max(total, 1e-9):.0f}%", f"{n:.0f}"] for f, (ms, n) in
                    sorted(fam.items(), key=lambda kv: -kv[1][0])], headers=["family", "ms/step", "share", "launches"]))
    rows = sorted(k.items(), key=lambda kv: -kv[1][0])[:top]
    print(tabulate([[kname[:110], f"{us / 1e3:.3f}", f"{n:.0f}"] for kname, (us, n) in rows],
                   headers=[what, "ms/step", "calls/step"]))
    if device == "cuda":  # where the host's time goes when the step is host-bound (wall >> kernel time)
        h = res["host"]
        print(f"host: {sum(v[0] for v in h.values()) / 1e3:.2f} ms/step of self CPU time in ATen and dmfx ops, "
              f"{sum(v[1] for v in h.values()):.0f} calls/step")
        rows = sorted(h.items(), key=lambda kv: -kv[1][0])[:top]
        print(tabulate([[op[:80], f"{us / 1e3:.3f}", f"{n:.0f}", f"{us / max(n, 1):.1f}"] for op, (us, n) in rows],
                       headers=["host op", "ms/step", "calls/step", "us/call"]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="bert-mlm")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--infer", action="store_true")
    p.add_argument("--candidates", default="inductor,dmfx-all")
    p.add_argument("--autocast", choices=("bf16", "fp16"), default=None)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--attn", choices=("eager", "sdpa"), default="eager")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--threads", type=int, default=None)
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    amp = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(a.autocast)
    for model in a.models.split(","):
        torch._dynamo.reset()
        base, kwargs = build(model, a.layers, attn=a.attn)
        base, kwargs = base.to(a.device), {k: v.to(a.device) for k, v in kwargs.items()}
        names = a.candidates.split(",")
        print(f"# {model}, {a.layers} layers, {'inference' if a.infer else 'training step'}, {a.device}, "
              f"autocast {a.autocast}, attention {a.attn}, torch {torch.__version__}")
        for name, step in candidates(names, base, kwargs, not a.infer, amp, a.device).items():
            t0 = time.time()
            step()  # compiles
            log(f"  {name}: first call {time.time() - t0:.1f} s")
            report(name, profile(step, a.steps, a.device), a.top, a.device)


if __name__ == "__main__":
    main()

"""The paper's table: one BERT encoder layer, forward / backward / total, for eager, Inductor, dmfx
and the GEMM floor (every memory-bound op free), interleaved, medians, ratios, multiples of the floor.

Builds on bench/bert_layer.py (same layer, inputs, GEMM recorder and floor replay); this module adds
the forward/backward split: a training step times the forward up to its output, then the backward
of ``out.sum()``; the floor replays the forward's GEMMs and the backward's GEMMs separately.
"""

from __future__ import annotations

import copy
import types

import torch

from .bert_layer import GemmRecorder, build_layer, dmfx_unavailable_reason, forward, gemm_flops, make_floor_step, make_inputs
from .common import interleaved, log, median, timer
from .models import _fresh_compile_state

CPU_CONFIGS = [
    dict(name="BERT-base B=8 L=128 fp32", batch=8, seq=128, hidden=768, heads=12, ffn=3072, dtype="fp32"),
    dict(name="BERT-base B=8 L=512 fp32", batch=8, seq=512, hidden=768, heads=12, ffn=3072, dtype="fp32"),
]
GPU_CONFIGS = [
    dict(name="BERT-large B=8 L=512 bf16", batch=8, seq=512, hidden=1024, heads=16, ffn=4096, dtype="bf16"),
    dict(name="BERT-large B=96 L=128 bf16", batch=96, seq=128, hidden=1024, heads=16, ffn=4096, dtype="bf16"),
]
SMOKE_CONFIGS = [dict(name="tiny B=2 L=16 fp32", batch=2, seq=16, hidden=64, heads=2, ffn=128, dtype="fp32")]


def _args(cfg: dict, device: str) -> types.SimpleNamespace:
    return types.SimpleNamespace(batch=cfg["batch"], seq=cfg["seq"], hidden=cfg["hidden"], heads=cfg["heads"], ffn=cfg["ffn"],
                                 dtype=cfg["dtype"], device=device, dropout=0.1, attn="eager", mask=False)


def _module_case(module, x, train: bool, device: str):
    now = timer(device)

    if train:
        def step():
            module.zero_grad(set_to_none=True)
            x.grad = None
            t0 = now()
            out = forward(module, x, None)
            t1 = now()
            out.sum().backward()
            t2 = now()
            return {"forward": t1 - t0, "backward": t2 - t1, "total": t2 - t0}
    else:
        def step():
            t0 = now()
            with torch.no_grad():
                forward(module, x, None)
            t1 = now()
            return {"forward": t1 - t0, "total": t1 - t0}
    return step


def _floor_case(module, x, train: bool, device: str):
    """GEMMs of one eager step, split at the end of the forward, replayed on random operands."""
    module.zero_grad(set_to_none=True)
    x.grad = None
    with GemmRecorder() as rec:
        if train:
            out = forward(module, x, None)
            n_fwd = len(rec.records)
            out.sum().backward()
        else:
            with torch.no_grad():
                forward(module, x, None)
            n_fwd = len(rec.records)
    module.zero_grad(set_to_none=True)
    fwd, _ = make_floor_step(rec.records[:n_fwd])
    bwd, _ = make_floor_step(rec.records[n_fwd:])
    now = timer(device)
    gflop = sum(gemm_flops(a) for _, a, _ in rec.records) / 1e9

    def step():
        t0 = now()
        fwd()
        t1 = now()
        if not train:
            return {"forward": t1 - t0, "total": t1 - t0}
        bwd()
        t2 = now()
        return {"forward": t1 - t0, "backward": t2 - t1, "total": t2 - t0}

    return step, {"gemms": len(rec.records), "forward_gemms": n_fwd, "gflop": gflop}


def run(device: str, configs: list[dict], candidates: list[str], rounds: int, warmup: int) -> list[dict]:
    results = []
    for cfg in configs:
        args = _args(cfg, device)
        base = build_layer(args)
        for mode in ("train", "infer"):
            train = mode == "train"
            _fresh_compile_state()
            x, _ = make_inputs(args, train)
            cases, skipped, info = {}, {}, {}
            for name in candidates:
                module = copy.deepcopy(base).train(train)
                try:
                    if name == "floor":
                        cases[name], info["floor"] = _floor_case(module, x, train, device)
                        continue
                    if name == "inductor":
                        module = torch.compile(module)
                    elif name == "dmfx":
                        reason = dmfx_unavailable_reason()
                        if reason:
                            raise RuntimeError(reason)
                        module = torch.compile(module, backend="dmfx")
                    elif name != "eager":
                        raise ValueError(f"unknown candidate {name!r}")
                    cases[name] = _module_case(module, x, train, device)
                except Exception as e:  # noqa: BLE001
                    skipped[name] = f"{type(e).__name__}: {e}"
            log(f"[layer] {cfg['name']} {mode}: {', '.join(cases)} ({warmup} warm-up + {rounds} rounds, interleaved)")

            def failed(name, e):
                skipped[name] = f"{type(e).__name__}: {e}"
                log(f"[layer]   {name} failed: {skipped[name][:300]}")

            times = interleaved(cases, rounds, warmup, failed)
            med = {name: {phase: median(ts) for phase, ts in ph.items()} for name, ph in times.items()}
            results.append({"config": cfg, "mode": mode, "device": device, "times_ms": times, "median_ms": med,
                            "ratios": _ratios(med), "skipped": skipped, **info})
            log(f"[layer] {cfg['name']} {mode}: " + ", ".join(f"{n} {m['total']:.2f} ms" for n, m in med.items()))
    return results


def _ratios(med: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """Per candidate and phase: speedup over eager and over Inductor, and its multiple of the floor."""
    out = {}
    for name, phases in med.items():
        r = {}
        for phase, t in phases.items():
            for ref, key in (("eager", "vs_eager"), ("inductor", "vs_inductor")):
                if ref in med and phase in med[ref] and t:
                    r[f"{phase}_{key}"] = med[ref][phase] / t
            if "floor" in med and phase in med["floor"] and med["floor"][phase]:
                r[f"{phase}_x_floor"] = t / med["floor"][phase]
        out[name] = r
    return out


def table(results: list[dict]) -> str:
    from tabulate import tabulate

    rows = []
    for res in results:
        for name, phases in res["median_ms"].items():
            r = res["ratios"][name]
            row = [res["config"]["name"], res["mode"], name]
            for phase in ("forward", "backward", "total"):
                t = phases.get(phase)
                x_floor = r.get(f"{phase}_x_floor")
                row.append("" if t is None else f"{t:.2f}" + ("" if x_floor is None else f" ({x_floor:.2f}x)"))
            row += [f"{r['total_vs_eager']:.2f}" if "total_vs_eager" in r else "",
                    f"{r['total_vs_inductor']:.2f}" if "total_vs_inductor" in r else ""]
            rows.append(row)
    return tabulate(rows, headers=["layer", "mode", "candidate", "fwd ms (x floor)", "bwd ms (x floor)", "total ms (x floor)",
                                   "speedup vs eager", "vs inductor"], tablefmt="github", disable_numparse=True)

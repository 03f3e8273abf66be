"""Shared pieces of the benchmark suite: interleaved timing, medians, progress lines, environment."""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS = REPO_ROOT / "bench" / "results"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def environment(device: str) -> dict:
    env = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "device": device,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
    }
    if device == "cuda" and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
    return env


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def interleaved(cases: dict[str, Callable[[], dict[str, float]]], rounds: int, warmup: int,
                on_fail: Callable[[str, BaseException], None] | None = None) -> dict[str, dict[str, list[float]]]:
    """Run each case's step A B C A B C ...: `warmup` untimed rounds, then `rounds` timed ones. A step
    returns {phase: seconds}. Returns {case: {phase: [ms per round]}}. A case that raises is dropped
    (reported through on_fail)."""
    live = dict(cases)
    times: dict[str, dict[str, list[float]]] = {name: {} for name in cases}
    for r in range(warmup + rounds):
        for name in list(live):
            try:
                phases = live[name]()
            except Exception as e:  # noqa: BLE001
                del live[name]
                times.pop(name, None)
                if on_fail:
                    on_fail(name, e)
                continue
            if r >= warmup:
                for phase, sec in phases.items():
                    times[name].setdefault(phase, []).append(sec * 1e3)
    return times


def timer(device: str) -> Callable[[], float]:
    def now() -> float:
        sync(device)
        return time.perf_counter()

    return now


def step_cases(steps: dict[str, Callable[[], object]], device: str) -> dict[str, Callable[[], dict[str, float]]]:
    """Each step as an `interleaved` case timing one call of it on `device` (phase "step")."""
    now = timer(device)

    def timed(fn):
        def case():
            t0 = now()
            fn()
            return {"step": now() - t0}

        return case

    return {name: timed(fn) for name, fn in steps.items()}

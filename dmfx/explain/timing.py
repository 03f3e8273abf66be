"""Measured times of dmfx.explain (``measure=True``): each kernel of the compiled graphs run one by one
on the step's real inputs, and the machine's copy bandwidth, for MUE (bytes a kernel must move over
its time at copy bandwidth)."""

from __future__ import annotations

import operator
import statistics
import time
from typing import Any, Callable

import torch
from torch.fx import GraphModule, Node

from ..passes.graph_utils import concrete_int
from .cost import FUSED, LAYOUT, MEMORY_BOUND, VIEW
from .counters import device_of


def copy_bandwidth(device: str | torch.device = "cpu", nbytes: int | None = None, rounds: int = 7) -> float:
    """Bytes per second of a large tensor copy (read + write counted) on `device`."""
    dev = torch.device(device)
    nbytes = nbytes or (512 << 20 if dev.type == "cuda" else 128 << 20)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=dev).normal_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(rounds + 1):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t = time.perf_counter()
        dst.copy_(src)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - t)
    return 2 * src.numel() * 4 / statistics.median(times[1:])


class _TimingInterpreter(torch.fx.Interpreter):
    def __init__(self, gm: GraphModule, sync: Callable[[], None]):
        super().__init__(gm, garbage_collect_values=False)  # the backward reads saved values by name
        self.sync = sync
        self.times: dict[str, float] = {}

    def run_node(self, n: Node) -> Any:
        if n.op != "call_function" or n.target is operator.getitem:
            return super().run_node(n)
        self.sync()
        t = time.perf_counter()
        out = super().run_node(n)
        self.sync()
        self.times[n.name] = time.perf_counter() - t
        return out


def time_graphs(rec: Any, inputs: list | None, rounds: int) -> dict[str, dict[str, float]]:
    """Median seconds per node of the graphs of the GraphRecord `rec`, run on the step's real inputs
    (`inputs`, those of the Dynamo graph's first call): the forward (or inference) graph on them, the
    backward graph on the forward's saved values (found by name) and random tangents. A graph whose
    inputs cannot be matched is left out."""
    out: dict[str, dict[str, float]] = {}
    if rec is None or inputs is None:
        return out
    device = device_of(inputs)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    first = rec.forward_graph if rec.forward_graph is not None else rec.inference_graph
    kind = "forward" if rec.forward_graph is not None else "inference"
    if first is None:
        return out
    placeholders = [n for n in first.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(inputs):
        return out

    def run(gm, inputs):
        runs = []
        env = None
        for _ in range(rounds):
            it = _TimingInterpreter(gm, sync)
            with torch.no_grad():
                it.run(*inputs)
            runs.append(it.times)
            env = it.env
        return {k: statistics.median(r[k] for r in runs) for k in runs[0]}, env

    out[kind], env = run(first, inputs)
    bw = rec.backward_graph
    if kind == "forward" and bw is not None and env is not None:
        values = {n.name: v for n, v in env.items()}
        bw_inputs = []
        for p in (n for n in bw.graph.nodes if n.op == "placeholder"):
            if p.name in values:
                bw_inputs.append(values[p.name])
            elif p.name.startswith("tangents") and isinstance(p.meta.get("val"), torch.Tensor):
                v = p.meta["val"]
                bw_inputs.append(torch.randn([concrete_int(s) for s in v.shape], dtype=v.dtype, device=device))
            else:
                return out
        out["backward"], _ = run(bw, bw_inputs)
    return out


def measure(data: dict, compiled: dict[str, list], device: torch.device, rounds: int) -> dict:
    """Times of the kernels of the report `data`'s operator rows, per stage ("before", "after"), set in
    the rows (``time_us``, and ``mue`` for memory-bound, fused and layout kernels); `compiled`: per
    stage, the (GraphRecord, inputs of its first call) of each graph compiled. Returns the summary."""
    bw = copy_bandwidth(device)
    total = {}
    for stage, graphs in compiled.items():
        times: dict[str, float] = {}
        for i, (rec, inputs) in enumerate(graphs):
            prefix = f"{i}:" if len(graphs) > 1 else ""
            for kind, per_node in time_graphs(rec, inputs, rounds).items():
                for node, sec in per_node.items():
                    times[f"{prefix}{kind}/{node}"] = sec
        t_sum = 0.0
        for r in data["ops"][stage]:
            sec = times.get(f"{r['graph']}/{r['node']}")
            if sec is None or r["class"] == VIEW:
                continue
            t_sum += sec
            r["time_us"] = sec * 1e6
            nbytes = r["bytes_read"] + r["bytes_written"]
            if r["class"] in (*MEMORY_BOUND, FUSED, LAYOUT) and sec > 0:
                r["mue"] = 100.0 * nbytes / (sec * bw)
        total[stage] = t_sum * 1e3
    return {"copy_bandwidth_gbs": bw / 1e9, "time_ms": total, "rounds": rounds,
            "note": "MUE = bytes the kernel must move / (its time * copy bandwidth), in percent; kernels run one by one "
                    "through an fx Interpreter on the step's real inputs"}

"""Where a compiled BertLayer step spends its time, op by op: the ms and minor page faults per step of
every ATen and dmfx op that runs inside the compiled code.

Method
------
The layer of bench/bert_layer.py (same arguments and seed) is compiled with ``--backend`` and warmed
up; then ``--steps`` steps run under a TorchDispatchMode that times every dispatched op (wall time
around the call) and counts the minor page faults it causes (``getrusage``). The mode declares
``ignore_compile_internals``, so compiled code runs compiled under it (without that, Dynamo would run
the layer eagerly). The per-op times include the dispatch mode's own cost (a few µs per op), so their
sum exceeds the step's time by roughly that times the op count; the printed "wall" is the step time
under the mode. Use bench/bert_layer.py for the step's speed, this for its anatomy.

Usage (from the repository root)::

    python -m bench.step_ops [--backend dmfx|eager|inductor] [--mode train|infer] [--seq 128]
        [--steps 10] [--threads 2] [--top 25]
"""
from __future__ import annotations

import argparse
import collections
import sys
import time

import torch
from tabulate import tabulate
from torch.utils._python_dispatch import TorchDispatchMode

try:
    import resource
except ImportError:  # Windows: no page-fault counts
    resource = None

from bench import bert_layer


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt if resource else 0


class OpTimer(TorchDispatchMode):
    """Per op name: total seconds, page faults and calls of the ops dispatched while active."""

    def __init__(self):
        super().__init__()
        self.seconds: collections.Counter = collections.Counter()
        self.faults: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        f0, t0 = minor_faults(), time.perf_counter()
        out = func(*args, **(kwargs or {}))
        name = str(func)
        self.seconds[name] += time.perf_counter() - t0
        self.faults[name] += minor_faults() - f0
        self.calls[name] += 1
        return out

    def clear(self) -> None:
        self.seconds.clear()
        self.faults.clear()
        self.calls.clear()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", choices=["dmfx", "eager", "inductor"], default="dmfx")
    p.add_argument("--mode", choices=["train", "infer"], default="train")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--top", type=int, default=25, help="rows to print, slowest first")
    known, rest = p.parse_known_args(argv)
    layer_args = bert_layer.parse_args(rest)  # --seq, --batch, --dropout, --threads, ... as in bert_layer
    return known, layer_args


def profile(args, layer_args) -> tuple[OpTimer, float]:
    torch.set_num_threads(layer_args.threads)
    train = args.mode == "train"
    module = bert_layer.build_layer(layer_args).train(train)
    x, mask = bert_layer.make_inputs(layer_args, train)
    if args.backend != "eager":
        import dmfx  # noqa: F401  (registers the backend)

        module = torch.compile(module, backend=args.backend)
    step, reset = bert_layer.make_step(module, x, mask, train)
    for _ in range(3):  # compile and warm up, outside the mode
        reset()
        step()
    timer = OpTimer()
    with timer:
        for _ in range(2):  # the mode's own first calls
            reset()
            step()
        timer.clear()
        wall = 0.0
        for _ in range(args.steps):
            reset()
            t0 = time.perf_counter()
            step()
            wall += time.perf_counter() - t0
    return timer, wall / args.steps


def table(timer: OpTimer, steps: int, top: int) -> str:
    rows = []
    for name, sec in sorted(timer.seconds.items(), key=lambda kv: -kv[1])[:top]:
        rows.append([name, f"{sec / steps * 1e3:.2f}", f"{timer.calls[name] / steps:.0f}",
                     f"{timer.faults[name] / steps:.0f}"])
    return tabulate(rows, headers=["op", "ms / step", "calls / step", "page faults / step"], tablefmt="github",
                    disable_numparse=True)


def main(argv=None) -> int:
    args, layer_args = parse_args(argv)
    timer, wall = profile(args, layer_args)
    print(f"BertLayer {args.mode} | {args.backend} | torch {torch.__version__} | threads {torch.get_num_threads()} | "
          f"B={layer_args.batch} L={layer_args.seq} | dropout {layer_args.dropout} | {args.steps} steps")
    print(table(timer, args.steps, args.top))
    total = sum(timer.seconds.values()) / args.steps * 1e3
    print(f"ops: {total:.1f} ms / step in {sum(timer.calls.values()) / args.steps:.0f} calls; "
          f"wall under the mode: {wall * 1e3:.1f} ms / step; page faults: "
          f"{sum(timer.faults.values()) / args.steps:.0f} / step")
    return 0


if __name__ == "__main__":
    sys.exit(main())

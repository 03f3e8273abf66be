"""The command line: ``python -m dmfx demo [...]`` (dmfx/demo.py), ``python -m dmfx explain [...]``
(dmfx.explain on a HuggingFace model built by dmfx.models) and ``python -m dmfx build`` (dmfx's CPU
kernels built and self-checked now, rather than by the first graph that needs them)."""

from __future__ import annotations

import argparse
import sys
from typing import Any, Sequence

USAGE = """usage:
  python -m dmfx demo [--layers N --hidden H --batch B --seq L --steps S]
  python -m dmfx explain [--model bert-base|gpt2|llama|vit|minilm|bert-tiny] [--batch 8] [--seq 128] [--train]
                         [--layers N] [--json out.json] [--measure] [--plot out.png] [--skip PASS,...]
                         [--attention FORM]
  python -m dmfx build   (build and self-check the CPU kernels now: once per machine and version)"""


def explain_main(argv: Sequence[str] | None = None) -> Any:
    """``python -m dmfx explain ...``: dmfx.explain on a model of dmfx.models.MODELS; prints the
    report and returns it."""
    import torch

    from .explain import explain
    from .models import MODELS, build_model

    p = argparse.ArgumentParser(prog="python -m dmfx explain",
                                description="What dmfx fuses in a HuggingFace model and how many bytes it saves (the paper's analysis).")
    p.add_argument("--model", choices=MODELS, default="bert-base")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--layers", type=int, default=None, help="keep only N layers (faster)")
    p.add_argument("--train", action="store_true", help="a training step (forward + backward); default: inference")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    p.add_argument("--json", default=None, help="write the whole report here")
    p.add_argument("--plot", default=None, help="write a PNG of bytes per class (needs matplotlib)")
    p.add_argument("--measure", action="store_true", help="time each kernel and compute MUE")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--skip", default="", help="comma list of dmfx passes to skip in the 'after' compile")
    p.add_argument("--attention", default=None, help="dmfx's attention form for the 'after' compile")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[a.dtype]
    model, kwargs = build_model(a.model, a.batch, a.seq, a.layers, a.device, dtype)
    label = f"{a.model} (B={a.batch}, L={a.seq}{f', {a.layers} layers' if a.layers else ''}, {a.dtype})"
    opts = {"skip": [x for x in a.skip.split(",") if x]} if a.skip else {}
    if a.attention:
        opts["attention"] = a.attention
    report = explain(model, training=a.train, measure=a.measure, name=label, dmfx_options=opts, **kwargs)
    print(report)
    if a.json:
        report.to_json(a.json)
        print(f"wrote {a.json}", file=sys.stderr)
    if a.plot:
        print(f"wrote {a.plot}" if report.plot(a.plot) else "no plot: matplotlib is not installed", file=sys.stderr)
    return report


# ``dmfx.explain`` is both this module and the function: ``dmfx.explain(model, ...)`` and


def main() -> None:
    argv = sys.argv[1:]
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return
    if argv[0] == "demo":
        from .demo import main as demo

        demo(argv[1:])
    elif argv[0] == "explain":
        explain_main(argv[1:])
    elif argv[0] == "build":
        build_main()
    else:
        sys.exit(f"python -m dmfx: unknown command {argv[0]!r} (commands: demo, explain, build)")


def build_main() -> None:
    """``python -m dmfx build``: the CPU kernel module built (or found in the cache) and self-checked,
    its verdict stored next to it, so that no later compile waits for either. (On a new machine the
    backend leaves a graph it would rewrite only for its loss to Inductor whole until they exist:
    dmfx/inductor.py WHY_LEFT_UNBUILT.)"""
    from .cuda_ops import build, selfcheck

    module = build.load("cpu")
    off = sorted(selfcheck.disabled_families("cpu"))
    print(f"dmfx: CPU kernels {module.__name__} ready in {build.cache_root()}; "
          + (f"switched off by the self-check: {', '.join(off)}" if off else "every family passed the self-check"))


if __name__ == "__main__":
    main()

"""Host cost per call of dmfx's ops against the ATen op that does the same work, on tiny tensors.

On tiny tensors a call's time is all host work: Python binding, dispatcher, autograd kernel, argument
checks, output allocation. This is what bounds a GPU step of short kernels (an H200 normalizes a
BERT-large activation in a few microseconds), and what the issue-18 target is about:
``torch.ops.dmfx.layer_norm`` on a [4, 64] float tensor at most 1.3x ``torch.ops.aten.layer_norm``.

Method: one thread (``torch.set_num_threads(1)``), plain mode (not ``inference_mode``), the kernels
loaded first. Each case is a pair (dmfx op, ATen op) called ``--calls`` times in a loop per sample;
the two alternate sample by sample (A B A B ...), ``--samples`` samples each after a warm-up, and the
median µs per call is reported, with the ratio. ``grad`` cases pass inputs with requires_grad=True
under grad mode (the autograd kernel then records a node; no backward runs).

Usage (from the repository root)::

    python -m bench.host_overhead [--samples 41] [--calls 2000] [--only layer_norm,dropout]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

import dmfx  # noqa: F401  (defines the dmfx ops)
from dmfx.cuda_ops import build, new_seed


def _cases() -> dict[str, tuple[Callable[[], object], Callable[[], object]]]:
    """name -> (dmfx call, ATen call) on the same tiny inputs."""
    x, w, b = torch.randn(4, 64), torch.randn(64), torch.randn(64)
    xg, wg, bg = (t.clone().requires_grad_() for t in (x, w, b))
    s = torch.randn(2, 2, 8, 8)
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    # rope: cos/sin [1, 1, S, D] broadcast to q, k [B, H, S, D]; HF's q/k are transposed views of [B, S, H, D]
    cos, sin = torch.randn(1, 1, 8, 16), torch.randn(1, 1, 8, 16)
    qt, kt = (torch.randn(1, 8, 2, 16).transpose(1, 2) for _ in range(2))
    qg, kg = q.clone().requires_grad_(), k.clone().requires_grad_()
    seed, eps = new_seed(), 1e-5
    dm, at = torch.ops.dmfx, torch.ops.aten
    return {
        "layer_norm": (lambda: dm.layer_norm(x, w, b, eps), lambda: at.layer_norm(x, [64], w, b, eps)),
        "layer_norm grad": (lambda: dm.layer_norm(xg, wg, bg, eps), lambda: at.layer_norm(xg, [64], wg, bg, eps)),
        "rms_norm": (lambda: dm.rms_norm(x, w, eps), lambda: at.rms_norm(x, [64], w, eps)),
        "dropout": (lambda: dm.dropout(x, seed, 0.1), lambda: at.native_dropout(x, 0.1, True)),
        "bias_act_dropout gelu": (lambda: dm.bias_act_dropout(x, b, "gelu", None, 0.0), lambda: at.gelu(x)),
        "bias_act_dropout gelu grad": (lambda: dm.bias_act_dropout(xg, bg, "gelu", None, 0.0), lambda: at.gelu(xg)),
        "glu silu": (lambda: dm.glu(x, x, "silu"), lambda: at.silu(x)),
        "glu silu grad": (lambda: dm.glu(xg, xg, "silu"), lambda: at.silu(xg)),
        "rope": (lambda: dm.rope(q, k, cos, sin, False), lambda: at.mul(q, cos)),
        "rope transposed": (lambda: dm.rope(qt, kt, cos, sin, False), lambda: at.mul(qt, cos)),
        "rope grad": (lambda: dm.rope(qg, kg, cos, sin, False), lambda: at.mul(qg, cos)),
        "attention_softmax": (lambda: dm.attention_softmax(s, None, 1.0, False, None, 0.0), lambda: at._softmax(s, -1, False)),
        "flash_attention": (lambda: dm.flash_attention(q, k, v, None, 0.25, False, None, 0.0),
                            lambda: at._scaled_dot_product_flash_attention_for_cpu(q, k, v, scale=0.25)),
    }


def _softmax_attention_cases() -> dict[str, tuple[Callable[[], object], Callable[[], object]]]:
    """The softmax and attention families' ops beyond the two above: with inputs that require grad, the
    backward ops, and the GEMM forms (against ATen's math SDPA, the same GEMMs around a softmax)."""
    s, g = torch.randn(2, 2, 8, 8), torch.randn(2, 2, 8, 8)
    sg = s.clone().requires_grad_()
    probs = torch.softmax(s, -1)
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    qkv = torch.cat([t.transpose(1, 2).reshape(1, 8, 32) for t in (q, k, v)], -1)
    dm, at = torch.ops.dmfx, torch.ops.aten
    return {
        "attention_softmax grad": (lambda: dm.attention_softmax(sg, None, 1.0, False, None, 0.0),
                                   lambda: at._softmax(sg, -1, False)),
        "attention_softmax_backward": (lambda: dm.attention_softmax_backward(g, probs, None, 0.0, 1.0),
                                       lambda: at._softmax_backward_data(g, probs, -1, torch.float32)),
        "flash_attention grad": (lambda: dm.flash_attention(qg, kg, vg, None, 0.25, False, None, 0.0),
                                 lambda: at._scaled_dot_product_flash_attention_for_cpu(qg, kg, vg, scale=0.25)),
        "attention": (lambda: dm.attention(q, k, v, None, 0.25, False, None, 0.0),
                      lambda: at._scaled_dot_product_attention_math(q, k, v, scale=0.25)),
        "qkv_attention": (lambda: dm.qkv_attention(qkv, 2, None, 0.25, False, None, 0.0),
                          lambda: at._scaled_dot_product_attention_math(q, k, v, scale=0.25)),
    }


def _per_call_us(fn: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def measure(name: str, pair, samples: int, calls: int) -> tuple[float, float]:
    """Median µs per call of (dmfx, ATen), sampled alternately."""
    times: tuple[list[float], list[float]] = ([], [])
    for i in range(samples + 3):  # (the first 3 samples warm up)
        for side, fn in enumerate(pair):
            us = _per_call_us(fn, calls)
            if i >= 3:
                times[side].append(us)
    return statistics.median(times[0]), statistics.median(times[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=41)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--only", default="", help="comma-separated case names (default: all)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    build.load("cpu")
    cases = {**_cases(), **_softmax_attention_cases()}
    wanted = [c for c in args.only.split(",") if c] or list(cases)
    print(f"torch {torch.__version__}, 1 thread, median of {args.samples} samples of {args.calls} calls\n")
    print("| case | dmfx µs | ATen µs | dmfx / ATen |\n|---|---|---|---|")
    with torch.enable_grad():
        for name in wanted:
            d, a = measure(name, cases[name], args.samples, args.calls)
            print(f"| {name} | {d:.2f} | {a:.2f} | {d / a:.2f} |", flush=True)


if __name__ == "__main__":
    main()

"""Should a linear layer's bias stay inside the GEMM (``addmm``) or move into the fused kernel after it?

The passes take the bias out of ``addmm`` (``mm`` + the fused epilogue, which reads the bias anyway
and sums its gradient in the backward pass it already makes). This measures both forms per device
for BERT-base's two epilogues, forward + backward, interleaved:

* FFN up-projection + GELU:         addmm -> gelu            vs  mm -> dmfx::bias_act_dropout
* attention output + dropout + residual + LayerNorm:
                                    addmm -> dmfx BDRLN(no bias)  vs  mm -> dmfx BDRLN(bias)

Usage: python -m bench.bias_split [--device cpu|cuda] [--tokens 1024] [--rounds 30]
"""

from __future__ import annotations

import argparse
import json

import torch
from tabulate import tabulate

import dmfx  # noqa: F401  (registers the dmfx ops)
from bench.common import RESULTS, environment, interleaved, log, median, timer
from dmfx.cuda_ops import new_seed


def cases(device: str, dtype: torch.dtype, N: int, H: int, F: int, p: float):
    now = timer(device)
    mk = lambda *s: torch.randn(*s, device=device, dtype=dtype, requires_grad=True)  # noqa: E731
    x, w1, b1 = mk(N, H), mk(F, H), mk(F)
    h, w2, b2 = mk(N, F), mk(H, F), mk(H)
    res, g, be = mk(N, H), mk(H), mk(H)
    gy, gz = torch.randn(N, F, device=device, dtype=dtype), torch.randn(N, H, device=device, dtype=dtype)

    def step(fwd, grad):
        def run():
            for t in (x, w1, b1, h, w2, b2, res, g, be):
                t.grad = None
            t0 = now()
            y = fwd()
            t1 = now()
            y.backward(grad)
            t2 = now()
            return {"forward": t1 - t0, "backward": t2 - t1, "total": t2 - t0}

        return run

    ffn_in = step(lambda: torch.nn.functional.gelu(torch.addmm(b1, x, w1.t())), gy)
    ffn_split = step(lambda: torch.ops.dmfx.bias_act_dropout(x @ w1.t(), b1, "gelu", None, 0.0), gy)

    def bdrln(with_bias_in_gemm: bool):
        seed = new_seed()
        if with_bias_in_gemm:
            y = torch.addmm(b2, h, w2.t())
            return torch.ops.dmfx.bias_dropout_residual_norm(y, None, res, g, be, seed, p, 1e-12, False, False)[0]
        y = h @ w2.t()
        return torch.ops.dmfx.bias_dropout_residual_norm(y, b2, res, g, be, seed, p, 1e-12, False, False)[0]

    out_in = step(lambda: bdrln(True), gz)
    out_split = step(lambda: bdrln(False), gz)
    return {
        "ffn+gelu: bias in addmm": ffn_in,
        "ffn+gelu: bias split out": ffn_split,
        "out+BDRLN: bias in addmm": out_in,
        "out+BDRLN: bias split out": out_split,
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    ap.add_argument("--tokens", type=int, default=1024, help="batch x sequence")
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--ffn", type=int, default=3072)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=str(RESULTS / "bias_split.json"))
    args = ap.parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    log(f"bias_split: {args.device} {args.dtype} tokens={args.tokens} H={args.hidden} F={args.ffn}")
    times = interleaved(cases(args.device, dtype, args.tokens, args.hidden, args.ffn, args.dropout), args.rounds, args.warmup)
    rows, out = [], {}
    for name, phases in times.items():
        med = {ph: median(v) for ph, v in phases.items()}
        out[name] = med
        rows.append([name, f"{med['forward']:.2f}", f"{med['backward']:.2f}", f"{med['total']:.2f}"])
    print(tabulate(rows, headers=["case", "forward ms", "backward ms", "total ms"], tablefmt="github"))
    for a, b in (("ffn+gelu", "ffn+gelu"), ("out+BDRLN", "out+BDRLN")):
        t_in, t_split = out[f"{a}: bias in addmm"]["total"], out[f"{b}: bias split out"]["total"]
        print(f"{a}: split/in = {t_split / t_in:.3f} ({'split' if t_split < t_in else 'keep in GEMM'} is faster)")
    RESULTS.mkdir(parents=True, exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"env": environment(args.device), "args": vars(args), "median_ms": out}, f, indent=1)


if __name__ == "__main__":
    main()

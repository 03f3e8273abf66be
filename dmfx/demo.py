"""The dmfx demo: compile a HuggingFace BERT (built from a config, random weights) with dmfx, run a few
training steps and an inference pass, and show what was fused and how long it took against eager.

    python -m dmfx demo [--layers 4] [--hidden 256] [--batch 8] [--seq 128] [--steps 5]
"""

from __future__ import annotations

import argparse
import copy
import logging
import statistics
import time

import torch


def _train_step(model, opt, batch):
    loss = model(**batch).loss
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss.item()


def _time_interleaved(fns, rounds):
    """Median ms of each fn, run A B A B ... so machine noise hits both alike."""
    times = [[] for _ in fns]
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            t = time.perf_counter()
            fn()
            times[i].append(time.perf_counter() - t)
    return [statistics.median(t) * 1e3 for t in times]


def main(argv=None):
    from tabulate import tabulate

    import dmfx
    from dmfx.explain import coverage
    from dmfx.models import demo_model

    p = argparse.ArgumentParser(prog="python -m dmfx demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: leave torch's default)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("dmfx").setLevel(logging.INFO)

    torch.manual_seed(0)
    eager = demo_model(args.layers, args.hidden).train()
    fused_model = copy.deepcopy(eager)
    # Compile the encoder; the MLM head and the loss run eagerly on both sides. (Compiling the whole
    # BertForMaskedLM also works, but it returns the logits next to the loss, and AOTAutograd then
    # materializes a zero gradient for the unused logits, a [batch*seq, vocab] fill and add per step
    # that costs more than the encoder's memory-bound ops here.)
    fused_model.bert.compile(backend="dmfx")
    compiled = fused_model
    ids = torch.randint(0, eager.config.vocab_size, (args.batch, args.seq))
    batch = {"input_ids": ids, "labels": ids}
    print(f"BERT ({args.layers} layers, hidden {args.hidden}), batch {args.batch} x seq {args.seq}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("dmfx compiles the encoder (model.bert.compile(backend='dmfx')); the MLM head and loss run eagerly in both columns")

    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-4)
    opt_f = torch.optim.AdamW(fused_model.parameters(), lr=1e-4)
    t = time.perf_counter()
    first = _train_step(compiled, opt_f, batch)
    print(f"first dmfx step (compile + kernel build/load): {time.perf_counter() - t:.1f}s, loss {first:.3f}")
    _train_step(eager, opt_e, batch)
    losses_e, losses_f = [], []
    train_e, train_f = _time_interleaved(
        [lambda: losses_e.append(_train_step(eager, opt_e, batch)), lambda: losses_f.append(_train_step(compiled, opt_f, batch))],
        args.steps,
    )
    print(f"training losses eager {[round(x, 3) for x in losses_e]}")
    print(f"                dmfx  {[round(x, 3) for x in losses_f]}  (dropout masks differ from eager's)")

    fused_model.load_state_dict(eager.state_dict())  # same weights for the inference comparison
    eager.eval(), fused_model.eval()
    with torch.no_grad():
        compiled(**batch)  # compiles the inference graph (eval mode: dropout off)
        infer_e, infer_f = _time_interleaved([lambda: eager(**batch), lambda: compiled(**batch)], args.steps)
        ref = eager(**batch).logits
        err = (compiled(**batch).logits - ref).norm() / ref.norm()

    print("\nWhat dmfx did:")
    for r in dmfx.records():
        print("  " + r.summary())
    compiled_graphs = [r for r in dmfx.records() if r.fallback is None]
    if compiled_graphs:
        cov = coverage(compiled_graphs)
        print(f"  memory-bound ATen ops inside dmfx kernels: {cov.fused} of {cov.total} ({cov.ratio:.0%}); "
              "bytes moved before/after: python -m dmfx explain --model bert-base --train")
    print()
    print(tabulate(
        [["training step", f"{train_e:.1f}", f"{train_f:.1f}", f"{train_e / train_f:.2f}x"],
         ["inference", f"{infer_e:.1f}", f"{infer_f:.1f}", f"{infer_e / infer_f:.2f}x"]],
        headers=["median ms", "eager", "dmfx", "speedup"], tablefmt="github",
    ))
    print(f"\ninference output vs eager: relative error {err.item():.1e}")


if __name__ == "__main__":
    main()

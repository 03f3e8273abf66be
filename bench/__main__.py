"""dmfx benchmark suite: ``python -m bench`` (from the repository root).

    python -m bench                      # default: fits ~8 minutes on a 2-core CPU machine
    python -m bench --full               # the real sizes (all layers, batch 8); long on a CPU
    python -m bench --only layer,models  # a subset of: layer, models, compile
    python -m bench --device cuda        # GPU: BERT-large bf16 layer tables (B=8 L=512, B=96 L=128), models in bf16
    python -m bench --smoke              # tiny sizes, eager + dmfx (+ floor), a few seconds: checks the plumbing

Sections
  layer    the paper's table: one encoder layer, forward / backward / total, eager, Inductor, dmfx and the
           GEMM floor, interleaved, medians, ratios and multiples of the floor (bench/layer_table.py)
  attention  attention alone, forward + backward and inference, L = 128 and 512, with and without dropout:
           eager, PyTorch's SDPA, dmfx's GEMM form and its fused (flash) form (bench/attention.py)
  models   BERT-base, GPT-2, a small LLaMA, ViT-base, all-MiniLM-L6-v2 (real weights): inference and training,
           time, peak memory, bytes moved, ratios against eager and Inductor (bench/models.py)
  compile  time to first result for Inductor and dmfx, cold and warm caches, in fresh processes (bench/compile_cost.py)

Method (docs/ARCHITECTURE.md, "Benchmark method"): candidates interleaved A B C A B C, warm-up rounds first, medians; ratios are what
to compare on a shared machine. Tables go to stdout, progress to stderr, everything to a JSON file under
bench/results/ (``--json`` to choose).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

from . import attention, compile_cost, layer_table, models
from .common import RESULTS, environment, log

SECTIONS = ("layer", "attention", "models", "compile")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    p.add_argument("--full", action="store_true", help="real model sizes and more rounds")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, few rounds, no Inductor, no compile section")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--candidates", default=None, help="layer/models candidates (default eager,inductor,dmfx[,floor])")
    p.add_argument("--models", default=None, help=f"comma-separated subset of {','.join(models.DEFAULT)}")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: leave torch's default)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    a.sections = [s.strip() for s in a.only.split(",") if s.strip()]
    bad = [s for s in a.sections if s not in SECTIONS]
    if bad:
        p.error(f"--only: unknown section(s) {bad}; sections are {', '.join(SECTIONS)}")
    if a.smoke and a.full:
        p.error("--smoke and --full exclude each other")
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here")
    if a.smoke and a.only == ",".join(SECTIONS):
        a.sections = ["layer", "attention", "models"]
    return a


def main(argv=None) -> dict:
    a = parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    gpu = a.device == "cuda"
    rounds = a.rounds or (3 if a.smoke else 10 if a.full else 5)
    warmup = a.warmup or (1 if a.smoke else 2)
    out = {"environment": environment(a.device), "settings": {"rounds": rounds, "warmup": warmup, "smoke": a.smoke, "full": a.full,
                                                              "sections": a.sections}}
    tables = []

    if "layer" in a.sections:
        cands = (a.candidates or ("eager,dmfx,floor" if a.smoke else "eager,inductor,dmfx,floor")).split(",")
        configs = layer_table.SMOKE_CONFIGS if a.smoke else layer_table.GPU_CONFIGS if gpu else layer_table.CPU_CONFIGS
        out["layer"] = layer_table.run(a.device, configs, cands, rounds, warmup)
        tables.append(("One encoder layer (ms; in brackets: multiple of the GEMM floor)", layer_table.table(out["layer"])))

    if "attention" in a.sections:
        att_args = attention.parse_args([
            "--device", a.device, "--rounds", str(rounds), "--warmup", str(warmup),
            "--threads", str(torch.get_num_threads()),
            *(["--seq", "16", "--batch", "2", "--heads", "2", "--head-dim", "8"] if a.smoke else []),
        ])
        out["attention"] = attention.run(att_args)
        tables.append(("Attention alone (ms)", attention.table(out["attention"])))

    if "models" in a.sections:
        cands = [c for c in (a.candidates or ("eager,dmfx" if a.smoke else "eager,inductor,dmfx")).split(",") if c != "floor"]
        sizes = models.SMOKE if a.smoke else models.FULL if a.full else models.DEFAULT
        if a.models:
            wanted = [m.strip() for m in a.models.split(",")]
            sizes = {m: (models.FULL if a.full else models.DEFAULT)[m] for m in wanted}
        dtype = torch.bfloat16 if gpu else torch.float32
        # the default keeps whole models short (each Inductor compile costs tens of seconds on 2 cores)
        m_rounds = a.rounds or (rounds if a.smoke or a.full or gpu else 3)
        m_warmup = a.warmup or (warmup if a.smoke or a.full or gpu else 1)
        out["models"] = models.run(a.device, sizes, cands, m_rounds, m_warmup, dtype)
        tables.append(("Whole models", models.table(out["models"])))

    if "compile" in a.sections:
        layers = 12 if a.full else 1
        out["compile"] = compile_cost.run(a.device, "bert-base", layers=layers, batch=1 if a.smoke else 2, seq=8 if a.smoke else 64)
        tables.append(("Compile cost (training step of BERT-base, fresh process each)", compile_cost.table(out["compile"])))

    env = out["environment"]
    print(f"dmfx benchmark suite | torch {env['torch']} | {a.device}{' ' + env.get('gpu', '') if gpu else ''} | "
          f"threads {torch.get_num_threads()} | {env['date']} | rounds {rounds}, warm-up {warmup}, interleaved, medians")
    for title, text in tables:
        print(f"\n## {title}\n{text}")
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    kind = "smoke" if a.smoke else "full" if a.full else "default"
    path = Path(a.json) if a.json else RESULTS / f"suite_{a.device}_{kind}_{stamp}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1, default=str))
    log(f"wrote {path}")
    return out


if __name__ == "__main__":
    main(sys.argv[1:])

"""Time one HuggingFace BERT-base encoder layer: eager vs Inductor vs dmfx vs the GEMM floor.

Method
------
* One ``BertLayer`` (``BertConfig()`` defaults unless overridden: hidden 768, 12 heads, FFN 3072) is
  built once with a fixed seed; every candidate gets its own ``copy.deepcopy`` of it, so all run
  identical weights. Training copies are in ``train()`` mode (dropout on) and a step is forward +
  ``out.sum().backward()``; the input requires grad, as it does for a layer inside a stack, so the
  backward also computes the input gradient. Grads are reset with ``set_to_none=True`` before every
  step, outside the timed region. Inference copies are in ``eval()`` mode and run under
  ``torch.no_grad()``.
* Candidates run in one process, interleaved (round r: A B C D, round r+1: A B C D, ...), so slow drifts
  of a shared machine hit all of them alike. Warm-up rounds come first and are not timed (compilation
  happens there); then ``--rounds`` timed rounds. The table reports the median (and min) per candidate
  and ratios, which are far more stable than absolute times on a noisy machine.
* ``floor`` is the time if every memory-bound op were free: one step of the plain eager module (same
  mode) runs under a ``TorchDispatchMode`` that records every GEMM (aten mm / addmm / bmm / baddbmm /
  addbmm / linear) with the sizes, strides and dtypes of its tensor arguments and its other arguments
  (alpha, beta). The floor step replays those GEMMs alone, in order, on pre-allocated random tensors of
  the same size and stride, each writing a fresh output as the op does. A fused attention kernel
  (``--attn sdpa`` when PyTorch picks one) is not a GEMM at this level and is left out of the floor;
  the GEMM count printed while recording shows which path ran.
* After warm-up each compiled candidate's inference output is compared to eager's (eval mode, so no
  dropout) by ||out - ref|| / ||ref||, shown as "rel err".
* "page faults" is the median number of minor page faults per timed step (``getrusage``): each is a
  first touch of a fresh 4 KiB page, which the OS zeroes. On these CPUs it is a visible part of a step
  (about 1-2 us each), and it depends on the allocator's state, which all candidates share.

Usage (from the repository root)::

    python bench/bert_layer.py [--mode train|infer|both] [--candidates eager,inductor,dmfx,floor]
        [--batch 8 --seq 128 --hidden 768 --heads 12 --ffn 3072 --dropout 0.1] [--attn eager|sdpa]
        [--mask] [--dtype fp32|bf16|fp16] [--device cpu|cuda] [--rounds 15 --warmup 3 --threads 2]
        [--json PATH]
    python -m bench.bert_layer ...

Raw per-round times and the configuration go to ``--json`` (default
``bench/results/bert_layer_<device>_<mode>_<timestamp>.json``).
"""
import argparse
import copy
import datetime
import json

try:
    import resource
except ImportError:  # Windows
    resource = None
import statistics
import sys
import time
from pathlib import Path

import torch
from tabulate import tabulate
from torch.utils._python_dispatch import TorchDispatchMode

REPO_ROOT = Path(__file__).resolve().parents[1]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
REL_ERR_LIMIT = {"fp32": 1e-3, "bf16": 3e-2, "fp16": 5e-3}
GEMM_OPS = ("mm", "addmm", "bmm", "baddbmm", "addbmm", "linear")


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--ffn", type=int, default=3072)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--attn", choices=["eager", "sdpa"], default="eager")
    p.add_argument("--mask", action="store_true", help="additive mask hiding the last quarter of half the batch")
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--mode", choices=["train", "infer", "both"], default="both")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--candidates", default="eager,inductor,dmfx,floor")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


# ---------------------------------------------------------------- model and inputs

def build_layer(args):
    from dmfx.models import bert_layer

    layer = bert_layer(args.hidden, args.heads, args.ffn, args.dropout, args.attn)
    return layer.to(device=args.device, dtype=DTYPES[args.dtype])


def make_inputs(args, train):
    dtype = DTYPES[args.dtype]
    x = torch.randn(args.batch, args.seq, args.hidden, device=args.device, dtype=dtype, requires_grad=train)
    mask = None
    if args.mask:
        mask = torch.zeros(args.batch, 1, 1, args.seq, device=args.device, dtype=dtype)
        mask[: args.batch // 2, ..., args.seq - args.seq // 4:] = torch.finfo(dtype).min
    return x, mask


def forward(module, x, mask):
    out = module(x, attention_mask=mask)
    return out[0] if isinstance(out, tuple) else out


def make_step(module, x, mask, train):
    """The timed callable, plus the untimed reset to run before it."""
    if train:
        def reset():
            module.zero_grad(set_to_none=True)
            x.grad = None

        def step():
            forward(module, x, mask).sum().backward()
    else:
        def reset():
            pass

        def step():
            with torch.no_grad():
                forward(module, x, mask)
    return step, reset


# ---------------------------------------------------------------- GEMM floor

class GemmRecorder(TorchDispatchMode):
    """Records every GEMM dispatched while active: (op, args, kwargs) with tensors as metadata."""

    def __init__(self):
        super().__init__()
        self.records = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket.__name__ in GEMM_OPS:
            describe = lambda a: TensorSpec.of(a) if isinstance(a, torch.Tensor) else a
            self.records.append((func, [describe(a) for a in args], {k: describe(v) for k, v in kwargs.items()}))
        return func(*args, **kwargs)


class TensorSpec:
    def __init__(self, size, stride, dtype, device):
        self.size, self.stride, self.dtype, self.device = size, stride, dtype, device

    @classmethod
    def of(cls, t):
        return cls(tuple(t.shape), tuple(t.stride()), t.dtype, t.device)

    def materialize(self):
        t = torch.empty_strided(self.size, self.stride, dtype=self.dtype, device=self.device)
        # fill the whole storage (works for overlapping strides too, e.g. expanded bias)
        t.as_strided((t.untyped_storage().nbytes() // t.element_size(),), (1,)).normal_()
        return t

    def __repr__(self):
        return f"{str(self.dtype).removeprefix('torch.')}{list(self.size)}@{list(self.stride)}"


def record_gemms(module, x, mask, train):
    step, reset = make_step(module, x, mask, train)
    reset()
    with GemmRecorder() as recorder:
        step()
    reset()
    return recorder.records


def gemm_flops(args):
    a, b = [t for t in args if isinstance(t, TensorSpec)][-2:]
    numel_a = 1
    for s in a.size:
        numel_a *= s
    return 2 * numel_a * b.size[-1]


def make_floor_step(records):
    """Replays the recorded GEMMs alone, in order, on pre-allocated random operands."""
    real = lambda a: a.materialize() if isinstance(a, TensorSpec) else a
    calls = [(func, [real(a) for a in args], {k: real(v) for k, v in kwargs.items()}) for func, args, kwargs in records]

    def step():
        for func, args, kwargs in calls:
            func(*args, **kwargs)
    return step, lambda: None


# ---------------------------------------------------------------- candidates

def dmfx_unavailable_reason():
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    try:
        import dmfx  # noqa: F401  (registers the "dmfx" backend)
    except Exception as e:  # noqa: BLE001
        return f"import dmfx failed: {type(e).__name__}: {e}"
    return None


def build_candidates(names, base, args, train):
    """name -> (step, reset, module or None). A name that cannot be built is reported and left out."""
    x, mask = make_inputs(args, train)
    candidates, skipped = {}, {}
    for name in names:
        module = copy.deepcopy(base).train(train)
        try:
            if name == "floor":
                records = record_gemms(module, x, mask, train)
                gflop = sum(gemm_flops(a) for _, a, _ in records) / 1e9
                log(f"  floor: recorded {len(records)} GEMMs ({gflop:.2f} GFLOP) from one eager step")
                candidates[name] = (*make_floor_step(records), None, records)
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
            candidates[name] = (*make_step(module, x, mask, train), module, None)
        except Exception as e:  # noqa: BLE001
            skipped[name] = f"{type(e).__name__}: {e}"
            log(f"  SKIPPED {name}: {skipped[name]}")
    return candidates, skipped, (x, mask)


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def minor_faults():
    """Minor page faults of this process so far (first touches of fresh memory pages), or 0 where
    ``resource`` does not exist (Windows)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt if resource else 0


def timed(step, reset, device, faults=None):
    """Seconds of one step; the step's minor page faults are appended to `faults` when given."""
    reset()
    sync(device)
    f0 = minor_faults()
    t0 = time.perf_counter()
    step()
    sync(device)
    seconds = time.perf_counter() - t0
    if faults is not None:
        faults.append(minor_faults() - f0)
    return seconds


def warm_up(candidates, skipped, args, mode):
    for r in range(args.warmup):
        for name in list(candidates):
            step, reset = candidates[name][:2]
            if r == 0:
                log(f"  [{mode}] warming up {name}" + (" (compiling)" if name in ("inductor", "dmfx") else "") + " ...")
            try:
                seconds = timed(step, reset, args.device)
            except Exception as e:  # noqa: BLE001
                skipped[name] = f"{type(e).__name__}: {e}"
                log(f"  SKIPPED {name}: failed in warm-up: {skipped[name]}")
                del candidates[name]
                continue
            if r == 0:
                log(f"  [{mode}] {name}: first step {seconds:.2f} s")


def measure(candidates, args):
    """Per candidate: the step times (ms) and minor page faults of each round."""
    times = {name: [] for name in candidates}
    faults = {name: [] for name in candidates}
    for _ in range(args.rounds):
        for name, (step, reset, *_) in candidates.items():
            times[name].append(timed(step, reset, args.device, faults[name]) * 1e3)
    return times, faults


def rel_errors(candidates, inputs):
    """||out - eager|| / ||eager|| on the inference copies (eval mode, so no dropout)."""
    if "eager" not in candidates:
        return {}
    x, mask = inputs
    with torch.no_grad():
        ref = forward(candidates["eager"][2], x, mask).double()
        return {
            name: ((forward(module, x, mask).double() - ref).norm() / ref.norm()).item()
            for name, (_, _, module, _) in candidates.items()
            if module is not None and name != "eager"
        }


# ---------------------------------------------------------------- report

def header(args, mode):
    return (f"BertLayer {mode} | torch {torch.__version__} | device {args.device} | threads {torch.get_num_threads()}"
            f" | {args.dtype} | B={args.batch} L={args.seq} H={args.hidden} heads={args.heads} FFN={args.ffn}"
            f" | dropout {args.dropout} | attn {args.attn} | mask {args.mask}"
            f" | {datetime.datetime.now():%Y-%m-%d %H:%M}")


def table(times, errors, args, faults=None):
    med = {name: statistics.median(t) for name, t in times.items()}
    ratio = lambda num, den: f"{num / den:.2f}" if num is not None and den is not None else ""
    rows = []
    for name, t in times.items():
        err = errors.get(name)
        pf = (faults or {}).get(name)
        rows.append([name, f"{med[name]:.2f}", f"{min(t):.2f}", ratio(med[name], med.get("floor")),
                     ratio(med.get("eager"), med[name]), ratio(med.get("inductor"), med[name]),
                     f"{err:.1e}" if err is not None else "", f"{statistics.median(pf):.0f}" if pf else ""])
    cols = ["candidate", "median ms", "min ms", "x floor", "speedup vs eager", "speedup vs inductor", "rel err",
            "page faults"]
    return tabulate(rows, headers=cols, tablefmt="github", disable_numparse=True)


def run_mode(base, args, names, mode):
    train = mode == "train"
    log(f"[{mode}] building candidates: {', '.join(names)}")
    candidates, skipped, inputs = build_candidates(names, base, args, train)
    warm_up(candidates, skipped, args, mode)
    errors = {} if train else rel_errors(candidates, inputs)
    for name, err in errors.items():
        if err > REL_ERR_LIMIT[args.dtype]:
            print(f"WARNING: {name} {mode} output differs from eager: rel err {err:.2e} > {REL_ERR_LIMIT[args.dtype]:.0e}")
    log(f"[{mode}] timing {args.rounds} interleaved rounds ...")
    times, faults = measure(candidates, args)
    print(header(args, mode))
    for name, reason in skipped.items():
        print(f"(skipped {name}: {reason})")
    print(table(times, errors, args, faults), flush=True)
    print("(page faults: median minor page faults per step, each a first touch of a fresh 4 KiB page that the "
          "kernel zeroes; they depend on what the allocator kept from earlier steps of every candidate)")
    print()
    floor = candidates.get("floor")
    return {
        "times_ms": times,
        "median_ms": {name: statistics.median(t) for name, t in times.items()},
        "page_faults": faults,
        "rel_err": errors,
        "skipped": skipped,
        "floor_gemms": [f"{func}({', '.join(map(repr, a))}{''.join(f', {k}={v!r}' for k, v in kw.items())})"
                        for func, a, kw in floor[3]] if floor else [],
    }


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    names = [n.strip() for n in args.candidates.split(",") if n.strip()]
    modes = ["train", "infer"] if args.mode == "both" else [args.mode]
    base = build_layer(args)
    results = {mode: run_mode(base, args, names, mode) for mode in modes}

    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = Path(args.json or REPO_ROOT / "bench" / "results" / f"bert_layer_{args.device}_{args.mode}_{stamp}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    config = {**vars(args), "threads_effective": torch.get_num_threads(), "torch": torch.__version__,
              "date": datetime.datetime.now().isoformat(timespec="seconds"), "command": " ".join(sys.argv)}
    path.write_text(json.dumps({"config": config, "results": results}, indent=1))
    log(f"wrote {path}")


if __name__ == "__main__":
    main()

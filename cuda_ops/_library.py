"""What every dmfx op family shares: the ``dmfx::`` library, dropout seeds, the statistics dtype, the
Python API's argument check, and the stand-ins that load the kernels on an op's first call.

Each family module (norm, softmax, pointwise, attention) defines its ops' schemas on ``LIB``, their
fake implementations (for tracing) and their Python API, and imports only this module, build.py and
reference.py. The ops' CPU, CUDA and Autograd kernels are registered in C++ when the kernel extension
is imported (csrc/op_api.h; build.py), except those of the few ops that are composites of other ops
(``composite``: written in Python for every device, no kernel of their own, e.g. cross_entropy.py's
``linear_cross_entropy``: GEMMs around the family's kernels).

Stand-ins: the extension is built on first use (a minute or two cold), so until it is loaded a Python
function holds each op's CPU and Autograd keys (and another its CUDA key). It loads the extension
(``build.load``, which removes the stand-ins right before the import, so the C++ registrations take
their place without overriding anything) and calls the op again, now on its C++ kernels. Loading
through ``build.load`` first works the same. (The dispatcher's tables are updated while no other
thread may call a dmfx op for the first time: a multi-threaded program that calls dmfx ops from
several threads at once should load the kernels first, ``dmfx.cuda_ops.build.load("cpu")``.)
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from . import build

LIB = torch.library.Library("dmfx", "DEF")  # noqa: TOR901 (kept alive for the process)

# The dispatch keys each kernel module registers (build.py: the CPU module also holds the autograd
# formulas of every op).
_KEYS = {"cpu": ("CPU", "Autograd"), "cuda": ("CUDA",)}
_ops_in_cxx: list[str] = []
_stand_ins: dict[str, torch.library.Library] = {}

#: dmfx ops implemented in Python as a composite of other ops (``composite``): op name -> the
#: implementation. dmfx.explain's run-time counters run it under themselves, so that they see the ops
#: inside it and the buffers it allocates (a TorchDispatchMode otherwise sees one op and its outputs).
COMPOSITES: dict[str, Callable] = {}


def new_seed() -> Tensor:
    """A fresh dropout seed ``[seed, offset]`` (int64, CPU) from torch's default generator, so
    ``torch.manual_seed`` reproduces a run."""
    return torch.randint(0, 2**62, (2,), dtype=torch.int64)


def stat_dtype(x: Tensor) -> torch.dtype:
    """The dtype of the norm kernels' mean / rstd statistics (and of the flash kernels' row
    statistics on the CPU) for input `x`: float64 for float64, else float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def check_tensor(op: str, name: str, t: object) -> None:
    """The Python API's check that an argument is a tensor (the op's schema would reject it with a
    less clear message)."""
    if not isinstance(t, Tensor):
        raise TypeError(f"dmfx::{op}: {name} must be a Tensor, got {type(t).__name__}")


def seed_values(seed: Tensor | None, op: str) -> tuple[int, int]:
    if seed is None:
        return 0, 0
    if seed.device.type != "cpu" or seed.dtype != torch.int64 or seed.numel() != 2:
        raise ValueError(
            f"dmfx::{op}: seed must be an int64 CPU tensor of 2 elements [seed, offset] "
            f"(see dmfx.cuda_ops.new_seed), got {seed.dtype} {tuple(seed.shape)} on {seed.device}"
        )
    s, o = seed.tolist()
    return int(s), int(o)


def check_stored_mask(op: str, mask: Tensor | None, ref_name: str, ref: Tensor, p: float) -> None:
    if mask is None:
        return
    if mask.dtype != torch.bool:
        raise ValueError(f"dmfx::{op}: mask must be a bool tensor (the mask native_dropout returns), got {mask.dtype}")
    if tuple(mask.shape) != tuple(ref.shape):
        raise ValueError(f"dmfx::{op}: mask must have the shape of {ref_name} {list(ref.shape)}, got {list(mask.shape)}")
    if p != 0.0:
        raise ValueError(f"dmfx::{op}: a stored mask and p = {p} > 0 would be two dropout masks; pass p = 0 with a mask")


# ------------------------------------------- checks the fakes run
# (softmax, attention: at trace time and for Meta tensors, where no C++ kernel runs; the ops' C++
# kernels check the same: csrc/op_api.h)

_SCORE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)




def check_dropout_p(op: str, p: float, seed: Tensor | None) -> None:
    """The dropout probability check every family's Python kernels run (the C++ kernels check the same
    again: kernel_api.h)."""
    if not (isinstance(p, (int, float)) and 0.0 <= p <= 1.0):
        raise ValueError(f"dmfx::{op}: dropout probability p must be in [0, 1], got {p}")
    if p > 0.0 and seed is None:
        raise ValueError(f"dmfx::{op}: p={p} > 0 needs a seed tensor (dmfx.cuda_ops.new_seed()); seed is None")


def check_scores(scores: Tensor, mask: Tensor | None, causal: bool, seed: Tensor | None, p: float) -> None:
    """Argument checks that need no tensor data (they run in the fake implementation too)."""
    if scores.dtype not in _SCORE_DTYPES:
        raise TypeError(f"dmfx::attention_softmax: scores must be float32, float16, bfloat16 or float64, got {scores.dtype}")
    if scores.dim() < 1:
        raise ValueError("dmfx::attention_softmax: scores needs at least one dimension (softmax runs over the last)")
    if causal and scores.dim() < 2:
        raise ValueError(
            f"dmfx::attention_softmax: causal=True needs scores with at least 2 dimensions [..., q_len, k_len], "
            f"got shape {tuple(scores.shape)}"
        )
    check_dropout_p("attention_softmax", p, seed)
    if mask is None:
        return
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(f"dmfx::attention_softmax: mask must be bool or a floating-point tensor, got {mask.dtype}")
    if mask.device != scores.device:
        raise ValueError(f"dmfx::attention_softmax: mask is on {mask.device} but scores is on {scores.device}")
    ms, ss = tuple(mask.shape), tuple(scores.shape)
    if len(ms) > len(ss) or any(m != 1 and m != s for m, s in zip(reversed(ms), reversed(ss))):
        raise ValueError(f"dmfx::attention_softmax: mask of shape {list(ms)} is not broadcastable to scores' shape {list(ss)}")


def no_double_backward(op: str, through: str) -> None:
    """Register the autograd formula of the backward op `op`: double backward through it (create_graph=True
    through `through`) raises NotImplementedError, naming the op, instead of a wrong or missing gradient."""

    def backward(ctx, *grads):
        raise NotImplementedError(
            f"dmfx::{op}: double backward (create_graph=True through {through}) is not supported; compile "
            "without dmfx (or skip the pass that introduces this op) for higher-order gradients"
        )

    backward.__name__ = f"{op}_double_backward"
    torch.library.register_autograd(f"dmfx::{op}", backward, setup_context=lambda ctx, inputs, output: None)


def composite(op: str, fn: Callable) -> None:
    """Register `fn` as the implementation of dmfx::`op` on every device (CompositeExplicitAutograd: a
    composite of other ops, written in Python; its autograd formula, if any, is registered apart) and
    list it in ``COMPOSITES``."""
    LIB.impl(op, fn, "CompositeExplicitAutograd")
    COMPOSITES[op] = fn


# ----------------------------------------------------------------------------------------- stand-ins


def kernels_in_cxx(ops: tuple[str, ...]) -> None:
    """Declare that the kernel extension registers `ops`' kernels: they get stand-ins until it loads."""
    _ops_in_cxx.extend(ops)
    for kind in _KEYS:
        if kind not in build._loaded:
            _install(kind, ops)


def _install(kind: str, ops) -> None:
    lib = _stand_ins.get(kind)
    if lib is None:
        lib = _stand_ins[kind] = torch.library.Library("dmfx", "IMPL")  # noqa: TOR901
    for op in ops:
        for key in _KEYS[kind]:
            lib.impl(op, _stand_in(op, kind), key)


def _stand_in(op: str, kind: str):
    def load_kernels_and_call(*args, **kwargs):
        build.load(kind)
        if kind in _stand_ins:
            raise build.KernelBuildError(f"dmfx: the {kind.upper()} kernel module did not register dmfx::{op}")
        return getattr(torch.ops.dmfx, op).default(*args, **kwargs)

    load_kernels_and_call.__name__ = f"load_{kind}_kernels_then_{op}"
    return load_kernels_and_call


def _remove(kind: str) -> None:
    lib = _stand_ins.pop(kind, None)
    if lib is not None:
        lib._destroy()


def _restore(kind: str) -> None:
    if kind in _KEYS and kind not in _stand_ins:
        _install(kind, _ops_in_cxx)


build.stand_ins.update(remove=_remove, restore=_restore)

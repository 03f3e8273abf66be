"""Kernels check themselves on the user's device before first use.

No dmfx CUDA kernel had run on a GPU when it was written, and a user's CPU can differ from the ones CI
used (AVX-512 or not, another compiler). So the first time a kernel module is used for a device (per
build, i.e. per module name, and per device: the CPU's model and flags, a GPU's name and compute
capability), each kernel family (build.FAMILIES) runs on a few small, odd shapes against its
pure-PyTorch reference on that device: forward and backward, float32 and a low-precision dtype, with
and without dropout, calling the extension's functions as the op wrappers do. A family that disagrees
(or raises) is switched off for that device: ``passes_to_skip`` names the passes that emit its ops,
and the backend skips them, so its patterns are left to PyTorch. One warning per family and device
says which function, shape and dtype disagreed and by how much.

The verdict is cached as JSON next to the build marker (``dmfx_selfcheck.json`` in the module's build
directory), keyed by device and by the version of these checks; a corrupt file is redone. The check
takes well under a second (tests/test_selfcheck.py measures it). ``DMFX_SELFCHECK=0`` turns it off.

The self-check guards what the passes emit. The fused ops called directly (``dmfx.layer_norm``, ...)
run their kernels whatever the verdict.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import time
from contextlib import ExitStack
from pathlib import Path
from types import ModuleType
from typing import Callable, Iterable

import torch
from torch import Tensor

from . import reference as R
from .build import FAMILIES, MARKER, KernelBuildError, _machine_tag, kernels_for, log, warn, write_atomic

VERDICT_FILE = "dmfx_selfcheck.json"

# The passes that emit (or add a code path to) each family's ops, by name (passes.ALL_PASSES); a
# family switched off skips all of them. restore_sdpa, activation_idioms (they emit aten ops),
# noop_clones, the layout searches, qkv stacking's GEMMs, accumulate_into_gemm and unstack_dx emit no
# dmfx kernel.
FAMILY_PASSES: dict[str, tuple[str, ...]] = {
    # layer_norm / rms_norm, bias_dropout_residual_norm, dropout, norm_backward (+ grad_out2, dbias)
    "norm": ("norm_idioms", "layer_norm", "bias_dropout_residual_norm", "dropout", "aten_backward",
             "fold_gradient_adds", "fold_bias_grads"),
    # softmax / softmax_backward; the attention pass's GEMM form and the flash ops' unfused path run them
    "softmax": ("attention_softmax", "attention", "lower_sdpa_calls", "qkv_attention", "aten_backward"),
    # rope, glu, bias_act_dropout, softcap and their backwards (activation_idioms emits bias_act_dropout
    # for QuickGELU and the squared ReLU; its GELU and SiLU rewrites only feed glu and bias_act_dropout)
    "pointwise": ("activation_idioms", "rope", "glu", "bias_act_dropout", "softcap", "aten_backward"),
    # flash_attention, qkv_flash_attention and their backwards (with the bias gradients); the varlen ops
    # (unpad emits them)
    "attention": ("attention", "lower_sdpa_calls", "qkv_attention", "fold_bias_grads", "unpad"),
    # cross_entropy, cross_entropy_backward (+ grad_logits, softcap); linear_cross_entropy runs them on its chunks
    "cross_entropy": ("cross_entropy", "fold_logits_grad", "fold_softcap_grad", "linear_cross_entropy"),
}

# The extension functions each family's check calls (the same in the CPU, CUDA and emulated modules).
FAMILY_FUNCTIONS: dict[str, tuple[str, ...]] = {
    "norm": ("norm_fwd", "norm_bwd", "dropout"),
    "softmax": ("softmax_fwd", "softmax_bwd"),
    "pointwise": ("bias_act_fwd", "bias_act_bwd", "glu_fwd", "glu_bwd", "rope", "softcap_fwd", "softcap_bwd"),
    "attention": ("flash_fwd", "flash_bwd", "varlen_fwd", "varlen_bwd"),
    "cross_entropy": ("cross_entropy_fwd", "cross_entropy_bwd"),
}

# Relative-norm tolerances against a float64 reference. Looser than the op tests' (1e-5 for fp32,
# 1e-2 for bf16) so that no correct kernel is ever switched off; a wrong one is off by far more.
TOL = {torch.float32: 1e-4, torch.float64: 1e-10, torch.bfloat16: 3e-2, torch.float16: 5e-3}
SEED, OFFSET = 20240611, 7  # the Philox key of the checks' dropout masks

_verdicts: dict[tuple[str, str], dict[str, str | None]] = {}  # (module, device key) -> family -> why off


class Disagreement(Exception):
    """A kernel's result differs from its reference (the message says where and by how much)."""


def enabled() -> bool:
    """False when DMFX_SELFCHECK is 0 / false / no / off."""
    return os.environ.get("DMFX_SELFCHECK", "1").strip().lower() not in ("0", "false", "no", "off")


# ----------------------------------------------------------------------------------------- results


def passes_to_skip(devices: Iterable[torch.device | str]) -> set[str]:
    """The pass names (passes.ALL_PASSES) to skip for a graph with tensors on `devices`: those of every
    kernel family the self-check switched off on any of them. Devices without dmfx kernels, and
    kernels that cannot be built (the backend reports that itself), add nothing."""
    off: set[str] = set()
    for dev in {torch.device(d) for d in devices}:
        if dev.type in ("cpu", "cuda"):
            off |= disabled_families(dev)
    return _passes_of(off)


def _passes_of(families: set[str]) -> set[str]:
    return {name for family in families for name in FAMILY_PASSES[family]}


def known_passes_to_skip(devices: Iterable[torch.device | str]) -> set[str] | None:
    """passes_to_skip where it is known without building or loading a kernel module: each device's
    module is loaded in this process already (or failed to build), or built on disk with a verdict
    stored for the device; None otherwise. The backend asks this first, so that a graph it leaves
    to Inductor whole does not build dmfx's kernels (about 45 s on a 2-core machine, once per machine
    and version) only to check them."""
    from . import build

    off: set[str] = set()
    for dev in {torch.device(d) for d in devices}:
        if dev.type not in ("cpu", "cuda") or not enabled():
            continue
        flavor = build._cpu_build if dev.type == "cpu" else dev.type
        if flavor in build._loaded or flavor in build._failed:
            off |= disabled_families(dev)
            continue
        if dev.type != "cpu":
            return None
        path = build.cache_root() / build.module_name(flavor) / VERDICT_FILE
        families = _stored_families(path, device_key(dev)) if (path.parent / MARKER).is_file() else None
        if families is None:
            return None
        off |= {family for family, why in families.items() if why}
    return _passes_of(off)


def disabled_families(device: torch.device | str) -> set[str]:
    """The kernel families switched off on `device` (checked on first use of its kernel module there,
    then cached in the process and on disk); empty when DMFX_SELFCHECK=0."""
    if not enabled():
        return set()
    dev = _concrete(torch.device(device))
    try:
        module = kernels_for(dev)
    except KernelBuildError:
        return set()
    key = (module.__name__, str(dev))
    if key not in _verdicts:
        try:
            _verdicts[key] = _verdict(module, dev, device_key(dev))
        except Exception as e:  # the check itself could not run: nothing is known to be right
            why = f"the self-check could not run ({type(e).__name__}: {e})"
            warn("dmfx: %s on %s; dmfx leaves every kernel family's patterns to PyTorch there", why, dev)
            _verdicts[key] = dict.fromkeys(FAMILIES, why)
    return {family for family, why in _verdicts[key].items() if why}


def forget() -> None:
    """Drop the verdicts this process holds (the next use reads the disk cache or checks again)."""
    _verdicts.clear()


def _concrete(dev: torch.device) -> torch.device:
    if dev.type == "cuda" and dev.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return dev


def device_key(dev: torch.device) -> str:
    """What a kernel's behaviour depends on besides its build: for the CPU the machine tag (model and
    feature flags, hashed), for a GPU its name and compute capability."""
    if dev.type == "cuda":
        major, minor = torch.cuda.get_device_capability(dev)
        return f"cuda|{torch.cuda.get_device_name(dev)}|sm_{major}{minor}"
    return "cpu|" + hashlib.sha256(_machine_tag().encode()).hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def _check_version() -> str:
    """The checks' identity: a verdict from other checks (or references) is redone."""
    h = hashlib.sha256()
    for path in (Path(__file__), Path(R.__file__)):
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def _verdict(module: ModuleType, dev: torch.device, key: str) -> dict[str, str | None]:
    """The cached verdict of `module` on `dev`, or a fresh check (stored); one warning per family off."""
    path = _verdict_path(module)
    families = _stored_families(path, key) if path else None
    if families is not None:
        source = f"cached in {path}"
    else:
        start = time.perf_counter()
        families = check_module(module, dev.type, dev)
        seconds = round(time.perf_counter() - start, 3)
        source = f"checked in {seconds:.2f}s"
        if path:
            _store_verdict(path, key, {"check": _check_version(), "families": families, "seconds": seconds})
    log.info("dmfx: self-check of %s on %s (%s): %s", module.__name__, _describe(dev), source,
             ", ".join(f"{f} {'off' if why else 'ok'}" for f, why in families.items()))
    for family, why in families.items():
        if why:
            warn("dmfx: the %s kernels of %s disagree with their reference on %s: %s; dmfx leaves the %s "
                 "patterns to PyTorch on this device (passes skipped: %s)", family, module.__name__, _describe(dev),
                 why, family, ", ".join(FAMILY_PASSES[family]))
    return families


def _describe(dev: torch.device) -> str:
    """The device as the warning names it."""
    if dev.type == "cuda":
        major, minor = torch.cuda.get_device_capability(dev)
        return f"{dev} ({torch.cuda.get_device_name(dev)}, compute capability {major}.{minor})"
    return f"the CPU ({torch.backends.cpu.get_cpu_capability()})"


def _verdict_path(module: ModuleType) -> Path | None:
    """dmfx_selfcheck.json next to the module's build marker (None for a module not built by build.py)."""
    lib = getattr(module, "__file__", None)
    if not lib or not (Path(lib).parent / MARKER).is_file():
        return None
    return Path(lib).parent / VERDICT_FILE


def _read_verdicts(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):  # missing or corrupt: checked again and rewritten
        return {}
    return data if isinstance(data, dict) else {}


def _stored_families(path: Path, key: str) -> dict[str, str | None] | None:
    """The verdict stored for `key` by these checks, or None (none, another version's, or malformed)."""
    entry = _read_verdicts(path).get(key)
    if not isinstance(entry, dict) or entry.get("check") != _check_version():
        return None
    families = entry.get("families")
    if not isinstance(families, dict) or set(families) != set(FAMILIES):
        return None
    if not all(why is None or isinstance(why, str) for why in families.values()):
        return None
    return families


def _store_verdict(path: Path, key: str, entry: dict) -> None:
    """Add `entry` under `key`, atomically (a reader never sees a half-written file)."""
    data = {**_read_verdicts(path), key: entry}
    try:
        write_atomic(path, json.dumps(data, indent=1))
    except OSError as e:  # a read-only cache: the verdict holds for this process only
        log.info("dmfx: could not store the self-check verdict in %s (%s)", path, e)


# ----------------------------------------------------------------------------------------- the check


def check_module(module, kernels: str, device: torch.device | str) -> dict[str, str | None]:
    """Run each family's check whose functions `module` has (the emulated modules have one family's):
    family -> None (agrees with its reference) or what disagreed. `kernels` is which kernel sources
    the module holds ("cpu" or "cuda": the fused attention's dtypes differ), `device` where its
    tensors live."""
    dev = torch.device(device)
    result = {}
    for family in FAMILIES:
        if all(hasattr(module, f) for f in FAMILY_FUNCTIONS[family]):
            result[family] = check_family(module, family, kernels, dev)
    return result


def check_family(module, family: str, kernels: str, device: torch.device) -> str | None:
    """None when `family`'s kernels in `module` agree with their references on `device`, else what
    disagreed (or what the kernel raised)."""
    with ExitStack() as stack:
        for ctx in _quiet_contexts(device):
            stack.enter_context(ctx)
        try:
            _CHECKS[family](_Runner(module, kernels, device))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        except Disagreement as e:
            return str(e)
        except Exception as e:  # a kernel that raises on valid input (or a launch error) is wrong too
            return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    return None


def _quiet_contexts(device: torch.device) -> list:
    """Run the check as plain eager code whatever the caller's state: no dispatch or fake-tensor mode
    (the backend runs inside torch.compile), no autocast, autograd available for the references."""
    ctxs = [torch.inference_mode(False), torch.enable_grad(), torch.autocast("cpu", enabled=False)]
    if device.type == "cuda":
        ctxs += [torch.autocast("cuda", enabled=False), torch.cuda.device(device)]
    try:
        from torch.utils._python_dispatch import _disable_current_modes

        ctxs.insert(0, _disable_current_modes())
    except ImportError:  # (a torch without it: the backend runs the check outside any mode anyway)
        pass
    return ctxs


class _Runner:
    """The module under check, where its tensors live, and the comparisons."""

    def __init__(self, module, kernels: str, device: torch.device):
        self.m, self.kernels, self.device = module, kernels, device
        self.gen = torch.Generator().manual_seed(0)  # never the user's generator

    def randn(self, *shape: int, dtype=torch.float32, scale: float = 1.0, shift: float = 0.0) -> Tensor:
        return (torch.randn(shape, generator=self.gen, dtype=torch.float64) * scale + shift).to(self.device, dtype)

    def mask_bool(self, *shape: int) -> Tensor:
        keep = torch.rand(shape, generator=self.gen) < 0.75
        keep[..., 0] = True  # no fully masked row (its reference gradient is NaN)
        return keep.to(self.device)

    def blhd(self, B: int, H: int, L: int, D: int, dtype) -> Tensor:
        """A [B, H, L, D] tensor laid out as the projections write it ([B, L, H, D])."""
        return self.randn(B, L, H, D, dtype=dtype).transpose(1, 2)

    def expect(self, what: str, got: Tensor, want: Tensor, dtype, floor: float = 0.0) -> None:
        """`got` (a kernel's output) within TOL[dtype] of `want` (the float64 reference) in relative
        norm; the denominator is at least `floor` (a gradient is judged against the scale of the
        largest one of its call, so a near-zero one is not judged on rounding noise)."""
        got64, want64 = got.detach().double().cpu(), want.detach().double().cpu()
        if got64.shape != want64.shape:
            raise Disagreement(f"{what}: shape {list(got64.shape)}, expected {list(want64.shape)}")
        if got64.numel() == 0:
            return
        bad = ~torch.isfinite(got64) & torch.isfinite(want64)
        if bad.any():
            raise Disagreement(f"{what} ({_name(dtype)}): {int(bad.sum())} non-finite values where the reference is finite")
        diff = (got64 - want64).nan_to_num()
        err = diff.norm().item() / max(want64.nan_to_num().norm().item(), floor, 1e-30)
        if not err <= TOL[dtype]:
            raise Disagreement(f"{what} ({_name(dtype)}): max abs error {diff.abs().max().item():.3g}, relative "
                               f"error {err:.3g} (tolerance {TOL[dtype]:g})")

    def expect_grads(self, what: str, got: dict[str, Tensor], want: dict[str, Tensor], dtype) -> None:
        floor = 0.01 * max(w.double().norm().item() for w in want.values())
        for name, w in want.items():
            self.expect(f"{what} {name}", got[name], w, dtype, floor)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _shape(t: Tensor) -> str:
    return "x".join(map(str, t.shape))


def _seed_tensor() -> Tensor:
    return torch.tensor([SEED, OFFSET], dtype=torch.int64)


def _reference(fn: Callable, inputs: dict[str, Tensor | None], cotangents: list[Tensor | None], *, grads=()):
    """`fn(**inputs)` in float64 on the CPU, and the gradients of `grads` (input names) for the given
    cotangents of its outputs (None: that output gets none)."""
    leaves = {k: (None if v is None else v.detach().cpu().double() if v.is_floating_point() else v.detach().cpu())
              for k, v in inputs.items()}
    for k in grads:
        leaves[k].requires_grad_()
    outs = fn(**leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    if not grads:
        return outs, {}
    pairs = [(o, c.detach().cpu().double()) for o, c in zip(outs, cotangents) if c is not None]
    got = torch.autograd.grad([o for o, _ in pairs], [leaves[k] for k in grads], [c for _, c in pairs])
    return outs, dict(zip(grads, got))


# ----------------------------------------------------------------------------------------- norm


def _check_norm(r: _Runner) -> None:
    # (rows, H, dtype, rms, p): LayerNorm with everything, RMSNorm with dropout, in fp32 and bf16
    for lead, H, dtype, rms, p in (((3, 5), 37, torch.float32, False, 0.0), ((4,), 67, torch.bfloat16, True, 0.2),
                                   ((2, 3), 130, torch.float32, True, 0.3), ((5,), 33, torch.bfloat16, False, 0.0)):
        _check_norm_case(r, lead, H, dtype, rms, p)
    x = r.randn(7, 45)
    got = r.m.dropout(x, SEED, OFFSET, 0.3)
    r.expect(f"dropout {_shape(x)} p=0.3", got, R.dropout(x.double().cpu(), _seed_tensor(), 0.3), torch.float32)


def _check_norm_case(r: _Runner, lead, H: int, dtype, rms: bool, p: float) -> None:
    eps = 1e-5
    ins = {"x": r.randn(*lead, H, dtype=dtype, scale=2.0, shift=0.5), "bias": r.randn(H, dtype=dtype),
           "residual": r.randn(*lead, H, dtype=dtype), "weight": r.randn(H, dtype=dtype, shift=1.0),
           "norm_bias": None if rms else r.randn(H, dtype=dtype)}
    seed = _seed_tensor() if p > 0 else None
    what = f"norm_fwd {'rms' if rms else 'layer'} {_shape(ins['x'])} p={p}"
    out, total, mean, rstd = r.m.norm_fwd(*ins.values(), SEED, OFFSET, p, eps, rms, True)
    go, go2, gsum = (r.randn(*lead, H, dtype=dtype) for _ in range(3))

    def ref(x, bias, residual, weight, norm_bias):
        return R.bias_dropout_residual_norm(x, bias, residual, weight, norm_bias, seed, p, eps, rms)

    names = [k for k, v in ins.items() if v is not None]
    (y, s), g = _reference(ref, ins, [go.double() + go2.double(), gsum], grads=names)
    r.expect(f"{what} out", out, y, dtype)
    r.expect(f"{what} sum", total, s, dtype)
    s32 = s.float()
    want_rstd = torch.rsqrt((s32.pow(2) if rms else (s32 - s32.mean(-1, keepdim=True)).pow(2)).mean(-1) + eps)
    r.expect(f"{what} rstd", rstd, want_rstd, torch.float32)
    if not rms:
        r.expect(f"{what} mean", mean, s32.mean(-1), torch.float32)
    # the backward from the reference statistics (checked on its own, whatever the forward's)
    stats = {"mean": None if rms else s32.mean(-1).to(r.device), "rstd": want_rstd.to(r.device)}
    dx, dres, dw, dnb, db = r.m.norm_bwd(go, gsum, ins["x"], ins["bias"], ins["residual"], ins["weight"], stats["mean"],
                                         stats["rstd"], SEED, OFFSET, p, rms, [True] * 5, go2)
    got = {"x": dx, "residual": dres, "weight": dw, "bias": db, **({} if rms else {"norm_bias": dnb})}
    r.expect_grads(what.replace("norm_fwd", "norm_bwd"), got, g, dtype)


# ----------------------------------------------------------------------------------------- softmax


def _check_softmax(r: _Runner) -> None:
    from .reference import reference_softmax

    # (scores shape, dtype, mask kind, causal, p, stored dropout mask in the backward)
    cases = (((2, 3, 5, 37), torch.float32, "padding", False, 0.0, True), ((3, 7, 130), torch.bfloat16, "bool", True, 0.25, False),
             ((2, 6, 9), torch.float32, "same", True, 0.2, False), ((2, 1030), torch.float32, "none", False, 0.0, False))
    for shape, dtype, kind, causal, p, stored in cases:
        scores = r.randn(*shape, dtype=dtype, scale=2.0)
        mask = _softmax_mask(r, kind, shape, dtype)
        scale, seed = 0.35, _seed_tensor() if p > 0 else None
        what = f"softmax_fwd {_shape(scores)} mask={kind} causal={causal} p={p}"
        out, probs = r.m.softmax_fwd(scores, mask, scale, causal, SEED, OFFSET, p)
        go = r.randn(*shape, dtype=dtype)
        outs, g = _reference(lambda scores: reference_softmax(scores, mask.cpu() if mask is not None else None, scale,
                                                              causal, seed, p), {"scores": scores}, [go], grads=["scores"])
        r.expect(f"{what} out", out, outs[0], dtype)
        if p > 0:
            r.expect(f"{what} probs", probs, outs[1], dtype)
        ref_probs = (outs[1] if p > 0 else outs[0]).to(r.device, dtype)
        dz = r.m.softmax_bwd(go, ref_probs, SEED, OFFSET, p, scale)
        r.expect_grads(what.replace("softmax_fwd", "softmax_bwd"), {"scores": dz}, g, dtype)
        if stored:  # the backward with the mask an eager native_dropout stored
            keep, keep_scale = r.mask_bool(*shape), 1.25
            dz = r.m.softmax_bwd(go, ref_probs, 0, 0, 0.0, scale, keep, keep_scale)
            _, g = _reference(lambda scores: reference_softmax(scores, mask.cpu() if mask is not None else None, scale,
                                                               causal)[0] * keep.cpu() * keep_scale,
                              {"scores": scores}, [go], grads=["scores"])
            r.expect_grads(f"{what.replace('softmax_fwd', 'softmax_bwd')} stored mask", {"scores": dz}, g, dtype)


def _softmax_mask(r: _Runner, kind: str, shape, dtype) -> Tensor | None:
    *lead, Sq, Sk = shape
    if kind == "padding":  # HF's [B, 1, 1, Sk] float32 0 / finfo.min
        keep = r.mask_bool(lead[0], 1, 1, Sk)
        return torch.where(keep, 0.0, torch.finfo(torch.float32).min)
    if kind == "bool":
        return r.mask_bool(Sq, Sk)
    if kind == "same":
        return r.randn(*shape, dtype=dtype)
    return None


# ----------------------------------------------------------------------------------------- pointwise


def _check_pointwise(r: _Runner) -> None:
    from .pointwise import ACTS, reference_bias_act_dropout, reference_glu, reference_rope

    # every activation in fp32 without dropout, then GELU with dropout in bf16 and SiLU with it in fp32
    cases = [((5, 37), torch.float32, act, 0.0) for act in ACTS] + [((3, 4, 67), torch.bfloat16, "gelu", 0.2),
                                                                    ((2, 129), torch.float32, "silu", 0.3)]
    for shape, dtype, act, p in cases:
        x, bias, go = r.randn(*shape, dtype=dtype, scale=2.0), r.randn(shape[-1], dtype=dtype), r.randn(*shape, dtype=dtype)
        seed, code = _seed_tensor() if p > 0 else None, ACTS.index(act)
        what = f"bias_act_fwd {act} {_shape(x)} p={p}"
        out = r.m.bias_act_fwd(x, bias, code, SEED, OFFSET, p)
        outs, g = _reference(lambda x, bias: reference_bias_act_dropout(x, bias, act, seed, p), {"x": x, "bias": bias},
                             [go], grads=["x", "bias"])
        r.expect(what, out, outs[0], dtype)
        dx, db = r.m.bias_act_bwd(go, x, bias, code, SEED, OFFSET, p, [True, True])
        r.expect_grads(what.replace("fwd", "bwd"), {"x": dx, "bias": db}, g, dtype)
    # the backward with the mask an eager native_dropout stored (identity: the dropout alone)
    x, go, keep = r.randn(6, 41), r.randn(6, 41), r.mask_bool(6, 41)
    dx, db = r.m.bias_act_bwd(go, x, None, 0, 0, 0, 0.0, [True, True], keep, 1.25)
    want = go.double().cpu() * keep.cpu() * 1.25
    r.expect_grads("bias_act_bwd identity stored mask 6x41", {"x": dx, "bias": db}, {"x": want, "bias": want.sum(0)},
                   torch.float32)
    for shape, dtype, act in (((5, 37), torch.float32, "silu"), ((3, 67), torch.bfloat16, "gelu_tanh")):
        ins = {"gate": r.randn(*shape, dtype=dtype, scale=2.0), "up": r.randn(*shape, dtype=dtype)}
        go, code, what = r.randn(*shape, dtype=dtype), ACTS.index(act), f"glu_fwd {act} {'x'.join(map(str, shape))}"
        outs, g = _reference(lambda gate, up: reference_glu(gate, up, act), ins, [go], grads=["gate", "up"])
        r.expect(what, r.m.glu_fwd(ins["gate"], ins["up"], code), outs[0], dtype)
        dgate, dup = r.m.glu_bwd(go, ins["gate"], ins["up"], code, [True, True])
        r.expect_grads(what.replace("fwd", "bwd"), {"gate": dgate, "up": dup}, g, dtype)
    for dtype in (torch.float32, torch.bfloat16):
        for pairing in ("halves", "interleaved", "deinterleave"):
            _check_rope(r, reference_rope, dtype, pairing)
    # the soft cap (logits of about 4 against a cap of 3: the tanh bends them), a strided x in fp32
    for shape, dtype, cap in (((5, 37), torch.float32, 3.0), ((3, 4, 67), torch.bfloat16, 2.0)):
        x, go = r.randn(*shape, dtype=dtype, scale=4.0), r.randn(*shape, dtype=dtype)
        if dtype == torch.float32:
            x = r.randn(shape[1], shape[0], dtype=dtype, scale=4.0).t()
        what = f"softcap_fwd {_shape(x)} cap={cap}"
        outs, g = _reference(lambda x: R.softcap(x, cap), {"x": x}, [go], grads=["x"])
        r.expect(what, r.m.softcap_fwd(x, cap), outs[0], dtype)
        # the backward from the reference output (checked on its own, whatever the forward's)
        dx = r.m.softcap_bwd(go, outs[0].to(r.device, dtype), cap)
        r.expect_grads(what.replace("fwd", "bwd"), {"x": dx}, g, dtype)


def _check_rope(r: _Runner, reference_rope, dtype, pairing: str) -> None:
    flags = {"interleaved": pairing == "interleaved", "deinterleave": pairing == "deinterleave"}
    B, H, Hk, L, D = 2, 3, 1, 5, 8  # (grouped-query k: fewer heads)
    ins = {"q": r.blhd(B, H, L, D, dtype), "k": r.blhd(B, Hk, L, D, dtype),
           "cos": r.randn(1, 1, L, D, dtype=dtype), "sin": r.randn(1, 1, L, D, dtype=dtype)}
    gq, gk = r.randn(B, H, L, D, dtype=dtype), r.randn(B, Hk, L, D, dtype=dtype)
    outs, g = _reference(lambda **a: reference_rope(**a, **flags), ins, [gq, gk], grads=["q", "k"])
    what = f"rope {pairing}"
    qo, ko = r.m.rope(*ins.values(), False, *flags.values())
    r.expect(f"{what} q {_shape(ins['q'])}", qo, outs[0], dtype)
    r.expect(f"{what} k {_shape(ins['k'])}", ko, outs[1], dtype)
    dq, dk = r.m.rope(gq, gk, ins["cos"], ins["sin"], True, *flags.values())  # the backward: the transposed rotation
    r.expect_grads(f"{what} inverse {_shape(gq)}", {"q": dq, "k": dk}, g, dtype)


# ----------------------------------------------------------------------------------------- attention


def _check_attention(r: _Runner) -> None:
    # the dtypes the fused kernels take (the CPU's: float32/float64; CUDA's: float32/float16/bfloat16)
    low = torch.bfloat16 if r.kernels == "cuda" else torch.float32
    # (B, Hq, Hk, Lq, Lk, D, dtype, mask kind, causal, p[, softcap])
    for case in ((2, 2, 1, 5, 7, 8, torch.float32, "padding", False, 0.0), (1, 2, 2, 6, 9, 24, torch.float32, "bool", True, 0.2),
                 (2, 2, 2, 7, 7, 16, low, "none", True, 0.0), (1, 4, 2, 5, 11, 8, low, "padding", False, 0.25),
                 (2, 2, 1, 6, 9, 16, torch.float32, "padding", True, 0.2, 0.5), (1, 2, 2, 5, 7, 8, low, "none", False, 0.0, 0.7)):
        _check_flash_case(r, *case)
    # the varlen form: (sequence lengths, Hq, Hk, D, dtype, causal, p); empty sequences, length 1, a
    # sequence over several 64-row tiles (the CUDA tile map)
    for case in (([0, 5, 1, 0, 9], 2, 1, 8, torch.float32, True, 0.2), ([70, 0, 3], 2, 2, 24, low, False, 0.0),
                 ([4, 11, 1], 4, 2, 16, low, True, 0.25)):
        _check_varlen_case(r, *case)


def _check_varlen_case(r: _Runner, lengths, Hq, Hk, D, dtype, causal, p) -> None:
    from .attention import reference_varlen_attention

    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    T = int(cu[-1])
    ins = {"q": r.randn(T, Hq, D, dtype=dtype), "k": r.randn(T, Hk, D, dtype=dtype), "v": r.randn(T, Hk, D, dtype=dtype)}
    scale, seed = D ** -0.5, _seed_tensor() if p > 0 else None
    what = f"varlen_fwd lengths {lengths} q {_shape(ins['q'])} k {_shape(ins['k'])} causal={causal} p={p}"
    out = r.randn(T, Hq, D, dtype=dtype)
    stats = r.m.varlen_fwd(*ins.values(), cu.to(r.device), scale, causal, SEED, OFFSET, p, out)
    go = r.randn(T, Hq, D, dtype=dtype)
    outs, g = _reference(lambda q, k, v: reference_varlen_attention(q, k, v, cu, scale, causal, seed, p), ins, [go, None],
                         grads=["q", "k", "v"])
    r.expect(f"{what} out", out, outs[0], dtype)
    r.expect(f"{what} stats", stats, outs[1], torch.float32)
    dq, dk, dv = (torch.empty_like(t) for t in ins.values())
    r.m.varlen_bwd(go, *ins.values(), out, stats, cu.to(r.device), scale, causal, SEED, OFFSET, p, dq, dk, dv)
    r.expect_grads(what.replace("varlen_fwd", "varlen_bwd"), {"q": dq, "k": dk, "v": dv}, g, dtype)


def _check_flash_case(r: _Runner, B, Hq, Hk, Lq, Lk, D, dtype, kind, causal, p, softcap=0.0) -> None:
    from .attention import _context, _grads_like, reference_attention

    ins = {"q": r.blhd(B, Hq, Lq, D, dtype), "k": r.blhd(B, Hk, Lk, D, dtype), "v": r.blhd(B, Hk, Lk, D, dtype)}
    mask = _softmax_mask(r, kind, (B, Hq, Lq, Lk), dtype)
    scale, seed = D ** -0.5, _seed_tensor() if p > 0 else None
    what = f"flash_fwd q {_shape(ins['q'])} k {_shape(ins['k'])} mask={kind} causal={causal} p={p} softcap={softcap}"
    out = _context(ins["q"], ins["v"])
    stats = r.m.flash_fwd(*ins.values(), mask, scale, causal, SEED, OFFSET, p, out, softcap)
    go = r.randn(*out.shape, dtype=dtype)
    m_cpu = None if mask is None else mask.cpu()
    outs, g = _reference(lambda q, k, v: reference_attention(q, k, v, m_cpu, scale, causal, seed, p, softcap), ins,
                         [go], grads=["q", "k", "v"])
    r.expect(f"{what} out", out, outs[0], dtype)
    dq, dk, dv = _grads_like(*ins.values())
    part = out.new_empty((3, B, Hq, D)) if Hq == Hk else None  # per-(batch, head) bias gradients
    r.m.flash_bwd(go, *ins.values(), stats, mask, scale, causal, SEED, OFFSET, p, dq, dk, dv, part, softcap)
    bwd = what.replace("flash_fwd", "flash_bwd")
    r.expect_grads(bwd, {"q": dq, "k": dk, "v": dv}, g, dtype)
    for i, name in enumerate(("q", "k", "v") if part is not None else ()):
        # each (batch, head)'s column sums, judged by the sums of magnitudes (dk's sum is zero up to
        # rounding: softmax ignores a per-row constant)
        want = g[name].sum(2)
        r.expect(f"{bwd} bias_part {name}", part[i], want, dtype, floor=g[name].abs().sum(2).norm().item())


# ----------------------------------------------------------------------------------------- cross_entropy


def _check_cross_entropy(r: _Runner) -> None:
    # (N, V, dtype, label smoothing, reduction): the CPU chunk (2048) and the CUDA block (256 x 4) straddled
    for N, V, dtype, eps, reduction in ((7, 37, torch.float32, 0.0, 1), (5, 2100, torch.bfloat16, 0.1, 2),
                                        (6, 1030, torch.float32, 0.0, 0), (4, 9, torch.float16, 0.2, 1)):
        logits = r.randn(N, V, dtype=dtype, scale=3.0)
        target = torch.randint(0, V, (N,), generator=r.gen)
        target[::3] = -100
        target = target.to(r.device)
        what = f"cross_entropy_fwd {_shape(logits)} eps={eps} reduction={reduction}"
        loss, lse = r.m.cross_entropy_fwd(logits, target, -100, eps, reduction)
        go, gl = r.randn(*loss.shape), r.randn(N, V, dtype=dtype)
        outs, g = _reference(lambda logits: R.cross_entropy(logits, target.cpu(), -100, eps, reduction), {"logits": logits},
                             [go, None], grads=["logits"])
        r.expect(f"{what} loss", loss, outs[0], torch.float32)
        r.expect(f"{what} lse", lse, outs[1], torch.float32)
        want_lse = outs[1].to(r.device, lse.dtype)  # the backward from the reference statistics
        dz = r.m.cross_entropy_bwd(go, logits, target, want_lse, -100, eps, reduction, gl)
        r.expect_grads(what.replace("fwd", "bwd"), {"logits": dz}, {"logits": g["logits"] + gl.double().cpu()}, dtype)
    # the backward of soft-capped logits c = cap * tanh(z / cap) (Gemma 2): z's gradient, the loss's and
    # grad_logits times 1 - (c / cap)^2 (an ignored row: grad_logits times it)
    N, V, cap = 5, 300, 30.0
    logits = (cap * torch.tanh(r.randn(N, V, scale=40.0, dtype=torch.float64) / cap)).float()
    target = torch.randint(0, V, (N,), generator=r.gen)
    target[1] = -100
    target = target.to(r.device)
    go, gl = r.randn(), r.randn(N, V)
    outs, g = _reference(lambda logits: R.cross_entropy(logits, target.cpu(), -100, 0.1, 1), {"logits": logits},
                         [go, None], grads=["logits"])
    dz = r.m.cross_entropy_bwd(go, logits, target, outs[1].to(r.device, torch.float32), -100, 0.1, 1, gl, cap)
    c = logits.double().cpu()
    want = (g["logits"] + gl.double().cpu()) * (1 - (c / cap) ** 2)
    r.expect_grads(f"cross_entropy_bwd {_shape(logits)} softcap={cap}", {"logits": dz}, {"logits": want}, torch.float32)


_CHECKS: dict[str, Callable[[_Runner], None]] = {
    "norm": _check_norm, "softmax": _check_softmax, "pointwise": _check_pointwise, "attention": _check_attention,
    "cross_entropy": _check_cross_entropy,
}

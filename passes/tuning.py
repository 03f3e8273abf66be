"""Measured choices, cached on disk per machine: ``options={"tune": True}``.

With tuning on, the attention pass does not trust its cost model's rules: for each attention shape
it times every form that can run it (dmfx's fused kernel, dmfx's GEMM form, PyTorch's SDPA) on
random inputs of the same shapes, dtype, layout and mask, forward + backward in training and
forward alone in inference, and takes the fastest. The layout search (passes/layout.py) prices its
choices in measured time instead of bytes: a copy from the strides a candidate layout gives, a GEMM
with an operand in those strides or writing its output transposed (``measured_seconds``).
Results are kept in ``dmfx_tuning.json`` in the
kernel cache directory (``DMFX_CACHE_DIR`` / the torch extensions directory), keyed by the machine
(CPU model and flags or GPU name), torch version, thread count and the case, so each case is timed
once per machine. A corrupt or unreadable file is ignored (and rewritten); timing failures fall back
to the cost model.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

log = logging.getLogger("dmfx")

FILE = "dmfx_tuning.json"
REPEATS = 3


def _path() -> Path:
    from ..cuda_ops.build import cache_root

    return cache_root() / FILE


def _machine(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    from ..cuda_ops.build import _machine_tag

    return _machine_tag()


_parsed: dict[str, tuple[tuple[int, int], dict]] = {}  # path -> ((mtime_ns, size), contents)


def _load(path: Path) -> dict:
    """The cache file's contents ({} when missing or corrupt), parsed once per version of the file
    (a model asks once per attention layer)."""
    try:
        st = path.stat()
        version = (st.st_mtime_ns, st.st_size)
        hit = _parsed.get(str(path))
        if hit is not None and hit[0] == version:
            return hit[1]
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    data = data if isinstance(data, dict) else {}
    _parsed[str(path)] = (version, data)
    return data


def _store(path: Path, key: str, value: dict) -> None:
    from filelock import FileLock

    from ..cuda_ops.build import write_atomic

    try:
        with FileLock(str(path) + ".lock", timeout=30):
            data = dict(_load(path))
            data[key] = value
            write_atomic(path, json.dumps(data, indent=1, sort_keys=True))
    except Exception as e:  # a read-only or full disk: the measurement is still used this time
        log.info("dmfx: could not save tuning results to %s: %s", path, e)


def _time(fn: Callable[[], None], device: torch.device) -> float:
    fn()  # warm-up (first-call allocations, kernel selection)
    times = []
    for _ in range(REPEATS):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def attention_case(q, k, v, mask, causal: bool, p: float, training: bool) -> dict:
    """The case a timing stands for (fake or real tensors; sizes as ints)."""
    from .graph_utils import concrete_int

    def shape(t):
        return [concrete_int(s) for s in t.shape]

    return {
        "op": "attention", "device": q.device.type, "dtype": str(q.dtype), "q": shape(q), "k": shape(k), "v": shape(v),
        "mask": None if mask is None else [shape(mask), str(mask.dtype)], "causal": causal, "dropout": p > 0,
        "training": training,
    }


def _attention_runner(form: str, case: dict, device: torch.device, scale: float, p: float) -> Callable[[], None]:
    dtype = getattr(torch, case["dtype"].split(".")[-1])
    B, Hq, Lq, D = case["q"]
    Hk, Lk, Dv = case["k"][1], case["k"][2], case["v"][3]
    training = case["training"]

    def heads(H, L, E):  # the projections' [B, L, H, D] layout
        return torch.randn(B, L, H, E, device=device, dtype=dtype).transpose(1, 2).requires_grad_(training)

    q, k, v = heads(Hq, Lq, D), heads(Hk, Lk, D), heads(Hk, Lk, Dv)
    mask = None
    if case["mask"] is not None:
        mshape, mdtype = case["mask"]
        mdtype = getattr(torch, mdtype.split(".")[-1])
        fill = torch.ones if mdtype == torch.bool else torch.zeros
        mask = fill(mshape, device=device, dtype=mdtype)
    from ..cuda_ops import new_seed

    def forward():
        seed = new_seed() if p > 0 else None
        if form == "flash":
            return torch.ops.dmfx.flash_attention(q, k, v, mask, scale, case["causal"], seed, p)[0]
        if form == "gemm":
            return torch.ops.dmfx.attention(q, k, v, mask, scale, case["causal"], seed, p)[0]
        m = mask if mask is None or mask.dtype in (torch.bool, dtype) else mask.to(dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m, dropout_p=p, is_causal=case["causal"], scale=scale,
                                              enable_gqa=Hq != Hk)

    def step():
        if training:
            with torch.enable_grad():
                forward().sum().backward()
        else:
            with torch.no_grad():
                forward()

    return step


def _key(case: dict, device: torch.device) -> str:
    """The cache key of `case`: the case with what its timing depends on besides (machine, torch, threads)."""
    return json.dumps({**case, "machine": _machine(device), "torch": torch.__version__,
                       "threads": torch.get_num_threads()}, sort_keys=True)


def tuned_attention_form(case: dict, forms: list[str], scale: float, p: float) -> tuple[str, dict] | None:
    """The fastest of `forms` for `case` (from the cache, or measured now and cached), with the times
    in ms; None when nothing could be timed."""
    device = torch.device(case["device"])
    key = _key({**case, "forms": sorted(forms)}, device)
    path = _path()
    hit = _load(path).get(key)
    if isinstance(hit, dict) and hit.get("best") in forms:
        return hit["best"], hit.get("ms", {})
    times = {}
    for form in forms:
        try:
            times[form] = 1e3 * _time(_attention_runner(form, case, device, scale, p), device)
        except Exception as e:  # a form that cannot run this case (e.g. an SDPA restriction)
            log.info("dmfx: tuning: attention form %s failed on %s: %s", form, case, e)
    if not times:
        return None
    best = min(times, key=times.get)
    _store(path, key, {"best": best, "ms": {f: round(t, 3) for f, t in times.items()}})
    log.info("dmfx: tuned attention %s: %s", case, times)
    return best, times


def _real(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A real tensor on `device` with `t`'s sizes, strides and dtype (random values; the storage is
    filled, so strides that overlap, e.g. an expanded dim's 0, are fine)."""
    extent = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride())) if t.numel() else 0
    base = torch.empty(extent, dtype=t.dtype, device=device)
    base.normal_() if base.is_floating_point() or base.is_complex() else base.zero_()
    return base.as_strided(tuple(t.shape), tuple(t.stride()))


def tensor_case(t: torch.Tensor) -> list:
    return [list(t.shape), list(t.stride()), str(t.dtype)]


_measured: dict[str, float] = {}  # key -> seconds (this process; the file keeps them across runs)


def measured_seconds(case: dict, op: Callable[..., object], args: list, device: torch.device) -> float:
    """Seconds one call ``op(*args)`` takes, where each tensor of `args` (fake, meta or real) is
    replaced by a real one of the same sizes, strides and dtype: from the cache, or measured now (the
    median of a few calls after a warm-up) and cached. `case` names the call in the cache key."""
    key = _key(case, device)
    if key in _measured:
        return _measured[key]
    path = _path()
    hit = _load(path).get(key)
    if isinstance(hit, dict) and isinstance(hit.get("s"), (int, float)):
        _measured[key] = float(hit["s"])
        return _measured[key]
    real = [_real(a, device) if isinstance(a, torch.Tensor) else a for a in args]
    with torch.no_grad():
        seconds = _time(lambda: op(*real), device)
    _measured[key] = seconds
    _store(path, key, {"s": seconds})
    log.info("dmfx: tuned %s: %.1f us", case, 1e6 * seconds)
    return seconds

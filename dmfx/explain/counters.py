"""Run-time counters of dmfx.explain: bytes moved by a real run, counted per dispatched op with the
cost model's ``op_cost`` (``runtime_bytes``: an independent check of the static count), and the peak
of live tensor memory (``peak_memory``)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..cuda_ops import COMPOSITES
from .cost import VIEW, op_cost, tensors


class _DispatchCounter(TorchDispatchMode):
    """Counts bytes (``op_cost``) of every dispatched op and tracks the live bytes of the tensors that
    ops allocate (storages freed through weakref finalizers). A dmfx op that is a Python composite of
    other ops (cuda_ops' ``COMPOSITES``: linear_cross_entropy) counts as the ops inside it, so its
    buffers count too. ``ignore_compile_internals`` lets torch.compile'd code run compiled under the
    mode (else Dynamo would fall back to eager)."""

    def __init__(self, track_memory: bool = False):
        super().__init__()
        self.track_memory = track_memory
        self.bytes_read = 0
        self.bytes_written = 0
        self.by_class: dict[str, int] = {}
        self.by_op: dict[str, int] = {}
        self.kernels = 0
        self.live = 0
        self.peak = 0
        self._storages: dict[int, int] = {}

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        impl = _composite(func)
        if impl is not None:  # a dmfx op made of other ops (in Python): count those, its buffers included
            with self:
                return impl(*args, **kwargs)
        out = func(*args, **kwargs)
        cost = op_cost(func, args, kwargs, out)
        if cost.cls != VIEW:
            self.kernels += 1
            self.bytes_read += cost.bytes_read
            self.bytes_written += cost.bytes_written
            self.by_class[cost.cls] = self.by_class.get(cost.cls, 0) + cost.bytes
            self.by_op[cost.op] = self.by_op.get(cost.op, 0) + cost.bytes
        if self.track_memory:
            self._track(args, kwargs, out)
        return out

    def _track(self, args, kwargs, out) -> None:
        inputs = set()
        for t in tensors((args, kwargs)):
            try:
                inputs.add(t.untyped_storage().data_ptr())
            except Exception:
                pass
        for t in tensors(out):
            try:
                st = t.untyped_storage()
            except Exception:
                continue
            key, nbytes = st.data_ptr(), st.nbytes()
            if nbytes == 0 or key in inputs or key in self._storages:
                continue
            self._storages[key] = nbytes
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(st, self._free, key)

    def _free(self, key: int) -> None:
        self.live -= self._storages.pop(key, 0)


def _composite(func: Any) -> Callable | None:
    """The Python implementation of `func` when it is a dmfx op made of other ops (cuda_ops' COMPOSITES)."""
    if getattr(func, "namespace", None) != "dmfx" or getattr(func, "_overloadname", None) != "default":
        return None
    return COMPOSITES.get(func._schema.name.split("::")[-1])


@dataclass
class RuntimeBytes:
    """Bytes moved by one real run of a function, counted per dispatched op (views excluded)."""

    bytes_read: int
    bytes_written: int
    kernels: int
    by_class: dict[str, int]
    by_op: dict[str, int]
    result: Any = field(default=None, repr=False, compare=False)

    @property
    def total(self) -> int:
        return self.bytes_read + self.bytes_written

    def to_dict(self) -> dict:
        return {"bytes_read": self.bytes_read, "bytes_written": self.bytes_written, "total": self.total,
                "kernels": self.kernels, "by_class": dict(self.by_class), "by_op": dict(self.by_op)}


def runtime_bytes(fn: Callable, *args: Any, **kwargs: Any) -> RuntimeBytes:
    """Run ``fn(*args, **kwargs)`` once and count, for every dispatched ATen/dmfx op, the bytes of its
    tensor arguments and outputs (views count 0, as in the static analysis). torch.compile'd code
    inside ``fn`` runs compiled; run it once before so that compilation is not inside the count."""
    with _DispatchCounter() as c:
        result = fn(*args, **kwargs)
    return RuntimeBytes(c.bytes_read, c.bytes_written, c.kernels, c.by_class, c.by_op, result)


@dataclass
class PeakMemory:
    peak_bytes: int  # peak of live bytes allocated during the run (above what was live before it)
    device: str
    method: str
    result: Any = field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict:
        return {"peak_bytes": self.peak_bytes, "device": self.device, "method": self.method}


def device_of(args: Any) -> torch.device:
    for t in tensors(args):
        return t.device
    return torch.device("cpu")


def peak_memory(fn: Callable, *args: Any, device: str | torch.device | None = None, **kwargs: Any) -> PeakMemory:
    """Peak of live tensor bytes while ``fn(*args, **kwargs)`` runs, above what was live before.
    CUDA: ``torch.cuda.max_memory_allocated``. CPU (no allocator statistics): a TorchDispatchMode adds
    the storage of every tensor an op allocates and subtracts it when the storage is freed."""
    dev = torch.device(device) if device is not None else device_of((args, kwargs))
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        result = fn(*args, **kwargs)
        torch.cuda.synchronize(dev)
        return PeakMemory(torch.cuda.max_memory_allocated(dev) - base, "cuda", "torch.cuda.max_memory_allocated", result)
    with _DispatchCounter(track_memory=True) as c:
        result = fn(*args, **kwargs)
    return PeakMemory(c.peak, dev.type, "dispatch-mode storage tracking", result)

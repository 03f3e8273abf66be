"""Structured logging of what dmfx did to each graph.

``emit(record)`` is called once per compiled graph (at the end of ``dmfx_backend``). It

* logs a one-line summary of the graph and the whole summary as JSON at DEBUG through the ``dmfx``
  logger (``logging.getLogger("dmfx").setLevel(logging.DEBUG)`` or ``TORCH_LOGS=+dmfx`` where torch
  knows the name);
* keeps the record for the compile's story: when Dynamo's compile of a frame ends (a model's first
  call, without graph breaks: the whole model), one INFO line tells what dmfx did to all the graphs
  it compiled (``compile_summary``): what was fused, the bytes it saves per forward pass, what was
  left to PyTorch and why, and where to see more; and
* where the installed torch has ``torch._logging.trace_structured``, writes it to the structured trace
  as an artifact named ``dmfx_graph_record`` (JSON), so ``TORCH_TRACE=/tmp/trace python train.py``
  followed by ``tlparse`` shows it next to Dynamo's and AOTAutograd's own artifacts.

It never raises: observability must not break a compile.
"""

from __future__ import annotations

import json
import logging
from typing import Any

log = logging.getLogger("dmfx")

ARTIFACT_NAME = "dmfx_graph_record"


def _kernels() -> dict[str, str]:
    """Kernel extensions loaded in this process: kind -> module name (the name hashes its sources)."""
    try:
        from .cuda_ops import build

        return {kind: getattr(mod, "__name__", str(mod)) for kind, mod in build._loaded.items()}
    except Exception:
        return {}


def _kernel_failures() -> dict[str, str]:
    try:
        from .cuda_ops import build

        return {kind: str(err)[:500] for kind, err in build._failed.items()}
    except Exception:
        return {}


def summarize(record: Any) -> dict:
    """A JSON-able summary of one GraphRecord."""
    return {
        "graph_id": getattr(record, "graph_id", None),
        "devices": list(getattr(record, "devices", ()) or ()),
        "fired": dict(getattr(record, "fired", {}) or {}),
        "replaced": dict(getattr(record, "replaced", {}) or {}),
        "missed": list(getattr(record, "missed", []) or []),
        "aten_ops_before": getattr(record, "aten_ops_before", None),
        "aten_ops_after": getattr(record, "aten_ops_after", None),
        "compiled": dict(getattr(record, "compiled", {}) or {}),
        "fallback": getattr(record, "fallback", None),
        "epilogue": list(getattr(record, "epilogue", []) or []),
        "seconds": round(float(getattr(record, "seconds", 0.0) or 0.0), 4),
        "cache": getattr(record, "cache", ""),
        "kernels_loaded": _kernels(),
        "kernel_build_failures": _kernel_failures(),
    }


def emit(record: Any) -> dict | None:
    """Log `record` (a dmfx GraphRecord) and write it to the structured trace. Returns the summary."""
    try:
        summary = summarize(record)
    except Exception as e:  # noqa: BLE001
        log.debug("dmfx: could not summarize a graph record: %s", e)
        return None
    try:
        text = record.summary() if hasattr(record, "summary") else json.dumps(summary)
        if summary["missed"]:
            n = len(summary["missed"])
            text += (f"; {n} near-miss{'es' if n > 1 else ''} (chains left to PyTorch, with why: "
                     f"dmfx.records()[-1].missed, or the DEBUG log)")
        loaded = ", ".join(f"{k}={v}" for k, v in summary["kernels_loaded"].items())
        if loaded:
            text += f"; kernels {loaded}"
        if _in_dynamo_compile() and _hook_compile_end():
            log.debug("dmfx: %s", text)
            _session.append(record)  # told in the compile's INFO line (compile_summary)
        else:  # called outside a compile (or no Dynamo callbacks in this torch): the graph's own line
            log.info("dmfx: %s", text)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("dmfx: graph record %s", json.dumps(summary, sort_keys=True))
    except Exception as e:  # noqa: BLE001
        log.debug("dmfx: logging a graph record failed: %s", e)
    _trace(summary)
    return summary


# ----------------------------------------------------------------------------------------- the story

_session: list[Any] = []  # records of the compile in progress


def _in_dynamo_compile() -> bool:
    try:
        from torch._guards import CompileContext

        return CompileContext.try_get() is not None
    except Exception:  # noqa: BLE001
        return False


def _on_compile_end(args: Any) -> None:
    from torch._dynamo.callback import CallbackTrigger

    if getattr(args, "callback_trigger", None) == CallbackTrigger.DYNAMO:
        _end_session()


def _hook_compile_end() -> bool:
    """Have Dynamo call _end_session when this compile ends (torch._dynamo.reset() forgets the
    callbacks, so this checks every time); False where this torch has no such callbacks."""
    try:
        from torch._dynamo.callback import callback_handler
    except ImportError:
        return False
    if _on_compile_end not in callback_handler.end_callbacks:
        callback_handler.register_end_callback(_on_compile_end)
    return True


def _end_session() -> None:
    records, _session[:] = list(_session), []
    if records:
        try:
            log.info("dmfx: %s", compile_summary(records))
        except Exception as e:  # noqa: BLE001
            log.debug("dmfx: the compile summary failed: %s", e)


def saved_bytes(gm: Any) -> int:
    """About how many bytes of memory traffic the fused nodes of `gm` save: what the memory-bound ATen
    ops each absorbed read and write (meta["dmfx_absorbed"]; GEMMs still run, so they are left out)
    minus what the fused op reads and writes, by dmfx.explain's cost model. dmfx.explain gives the
    exact account, per operator."""
    import torch.fx

    from .explain.cost import CONTRACTION, op_cost

    def values(a: Any) -> Any:
        return torch.fx.node.map_arg(a, lambda x: x.meta.get("val"))

    saved = 0
    for n in getattr(getattr(gm, "graph", None), "nodes", ()):
        absorbed = n.meta.get("dmfx_absorbed")
        if not absorbed:
            continue
        costs = [op_cost(a.target, a.args, a.kwargs, a.out) for a in absorbed]
        before = sum(c.bytes for c in costs if c.cls != CONTRACTION)
        after = op_cost(n.target, values(n.args), values(dict(n.kwargs)), n.meta.get("val")).bytes
        saved += max(0, before - after)
    return saved


def compile_summary(records: list[Any]) -> str:
    """One line, in words, for the graphs one compile gave dmfx: what was fused (ATen ops absorbed),
    the bytes saved per forward pass, what was left to PyTorch and why, the near-misses and where
    they are listed."""
    fused: dict[str, int] = {}
    absorbed, saved, left, misses = 0, 0, [], 0
    for r in records:
        if r.fallback:
            left.append(f"graph {r.graph_id}: {r.fallback}")
            continue
        for name, count in r.fired.items():
            fused[name] = fused.get(name, 0) + count
        absorbed += sum(r.replaced.values())
        misses += len(r.missed)
        if getattr(r, "cache", "") == "hit":  # (no compiled graphs at hand: the count kept with the cache)
            saved += getattr(r, "bytes_saved", None) or 0
            continue
        for gm in (getattr(r, "forward_graph", None), getattr(r, "inference_graph", None)):
            if gm is not None:
                saved += saved_bytes(gm)
    n = len(records)
    parts = [f"compiled {n} graph{'s' if n > 1 else ''}"]
    if fused:
        parts.append("fused " + ", ".join(f"{k} x{v}" for k, v in fused.items())
                     + f" ({absorbed} ATen ops absorbed; about {saved / 2**20:.1f} MiB less memory traffic per forward pass)")
    else:
        parts.append("nothing fused")
    if left:
        parts.append("left to PyTorch: " + "; ".join(left))
    if misses:
        parts.append(f"{misses} chain{'s' if misses > 1 else ''} left unfused with a reason "
                     "(dmfx.records()[i].missed; each at DEBUG)")
    return "; ".join(parts)


def _trace(summary: dict) -> None:
    try:
        from torch._logging import trace_structured
    except ImportError:  # an older torch without structured tracing
        return
    payload = json.dumps(summary, sort_keys=True)
    try:
        trace_structured(
            "artifact",
            metadata_fn=lambda: {"name": ARTIFACT_NAME, "encoding": "json"},
            payload_fn=lambda: payload,
            expect_trace_id=False,
        )
    except TypeError:  # a signature without expect_trace_id
        try:
            trace_structured("artifact", metadata_fn=lambda: {"name": ARTIFACT_NAME, "encoding": "json"}, payload_fn=lambda: payload)
        except Exception as e:  # noqa: BLE001
            log.debug("dmfx: trace_structured failed: %s", e)
    except Exception as e:  # noqa: BLE001
        log.debug("dmfx: trace_structured failed: %s", e)

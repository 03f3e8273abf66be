"""Structured logging of what dmfx did to each graph.

``emit(record)`` is called once per compiled graph (at the end of ``dmfx_backend``). It

* logs a one-line summary at INFO and the whole summary as JSON at DEBUG through the ``dmfx`` logger
  (``logging.getLogger("dmfx").setLevel(logging.DEBUG)`` or ``TORCH_LOGS=+dmfx`` where torch knows
  the name), and
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
        "seconds": round(float(getattr(record, "seconds", 0.0) or 0.0), 4),
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
        log.info("dmfx: %s", text)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("dmfx: graph record %s", json.dumps(summary, sort_keys=True))
    except Exception as e:  # noqa: BLE001
        log.debug("dmfx: logging a graph record failed: %s", e)
    _trace(summary)
    return summary


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

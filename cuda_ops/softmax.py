"""dmfx's fused softmax ops (placeholder: filled in by the softmax work)."""

from __future__ import annotations

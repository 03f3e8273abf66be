"""dmfx's fused pointwise ops (placeholder: filled in by the pointwise work)."""

from __future__ import annotations

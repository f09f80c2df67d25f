"""Strict JSON for what tailpilot stores: NaN and ±Infinity become null.

Python's ``json`` writes non-finite floats as the bare tokens ``NaN`` and ``Infinity``, which are
not JSON: PostgreSQL refuses them (``Token "Infinity" is invalid``) and SQLite stores text that its
own JSON functions call invalid. A replica's documents may hold them, so every JSON column is
written through :func:`dumps` (the engine's ``json_serializer``). Imports nothing beyond the
standard library.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any


def finite(doc: Any) -> Any:
    """``doc`` with every non-finite float, at any depth, replaced by None (tuples become lists,
    numpy scalars Python numbers: what JSON can hold)."""
    if type(doc).__module__ == "numpy" and hasattr(
        doc, "item"
    ):  # a numpy scalar, without importing numpy
        doc = doc.item()
    if isinstance(doc, float):
        return doc if math.isfinite(doc) else None
    if isinstance(doc, dict):  # keys as JSON writes them (an int key is a string there)
        return {k if isinstance(k, str) else str(k): finite(v) for k, v in doc.items()}
    if isinstance(doc, (list, tuple)):
        return [finite(v) for v in doc]
    return doc


def dumps(doc: Any, default: Callable[[Any], Any] | None = None) -> str:
    """``doc`` as strict JSON text, non-finite floats as null (``default`` as in ``json.dumps``)."""
    try:
        return json.dumps(
            doc, allow_nan=False, default=default
        )  # the common case: one pass, no copy
    except ValueError:  # a NaN or ±Infinity somewhere
        return json.dumps(finite(doc), allow_nan=False, default=default)

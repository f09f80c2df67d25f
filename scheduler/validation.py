"""One way to say which field of a document is wrong (settings, cluster files, control-API answers).

Imports only pydantic: the plugin uses it inside vLLM's process.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from pydantic import ValidationError


def field_path(loc: tuple[int | str, ...], root: str = "document") -> str:
    """('clusters', 0, 'replicas', 1, 'api_url') -> 'clusters[0].replicas[1].api_url' (``root``
    if empty)."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or root


def describe_validation(
    err: ValidationError, root: str = "document", first_only: bool = False
) -> str:
    """``path: message`` for each invalid field (or only the first), joined by "; "."""
    errors = err.errors()[:1] if first_only else err.errors()
    return "; ".join(
        f"{field_path(e['loc'], root)}: {e['msg'].replace('Value error, ', '')}" for e in errors
    )


def finite_or_none(value: Any) -> float | None:
    """``value`` as a float when it is a finite real number, else None (None, NaN, ±inf, booleans,
    strings and other non-numbers) — the one conversion every layer uses before a figure is shown,
    stored or sent as JSON."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    as_float = float(value)
    return as_float if math.isfinite(as_float) else None

"""One way to say which field of a document is wrong (settings, cluster files, control-API answers).

Imports only pydantic: the plugin uses it inside vLLM's process.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from pydantic import ValidationError

MAX_ERRORS_SHOWN = 10  # a document with thousands of bad keys gets a readable answer
MAX_KEY_SHOWN = 40  # characters of a key (a tenant name, an unknown field) shown in a path


def is_control(ch: str) -> bool:
    """A C0 or C1 control character: garbles terminals and logs, and PostgreSQL refuses NUL."""
    return ch < " " or "\x7f" <= ch <= "\x9f"


def spell_unencodable(text: str) -> str:
    """``text`` with what UTF-8 cannot carry (lone surrogates) spelled as its escape, whole."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def readable(text: str, limit: int = MAX_KEY_SHOWN) -> str:
    """``text`` cut to ``limit`` characters (an ellipsis marking the cut), control characters and
    lone surrogates spelled as their escapes: safe to echo in an error, a log or a JSON answer."""
    shown = text if len(text) <= limit else text[: limit - 1] + "…"
    shown = "".join(  # control characters spelled out: they garble terminals and logs
        f"\\x{ord(ch):02x}" if is_control(ch) else ch for ch in shown
    )
    return spell_unencodable(shown)


def field_path(loc: tuple[int | str, ...], root: str = "document") -> str:
    """('clusters', 0, 'replicas', 1, 'api_url') -> 'clusters[0].replicas[1].api_url' (``root``
    if empty). Keys are cut and made printable; pydantic's ``[key]`` marker (the key itself was
    wrong, not its value) is left out: the message says so."""
    out = ""
    for part in loc:
        if part == "[key]":
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{readable(part)}" if out else readable(part)
    return out or root


def join_errors(messages: list[str]) -> str:
    """Messages joined by "; ", at most ``MAX_ERRORS_SHOWN`` of them and a count of the rest."""
    shown = "; ".join(messages[:MAX_ERRORS_SHOWN])
    more = len(messages) - MAX_ERRORS_SHOWN
    return f"{shown}; and {more} more" if more > 0 else shown


def describe_validation(
    err: ValidationError, root: str = "document", first_only: bool = False
) -> str:
    """``path: message`` for each invalid field (or only the first), joined by "; "."""
    errors = err.errors()[:1] if first_only else err.errors()
    return join_errors(
        [f"{field_path(e['loc'], root)}: {e['msg'].replace('Value error, ', '')}" for e in errors]
    )


def finite_or_none(value: Any) -> float | None:
    """``value`` as a float when it is a finite real number, else None (None, NaN, ±inf, booleans,
    strings and other non-numbers) — the one conversion every layer uses before a figure is shown,
    stored or sent as JSON."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    as_float = float(value)
    return as_float if math.isfinite(as_float) else None

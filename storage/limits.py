"""What the store can hold, and the bounds on names: rows are fitted here before they are queued.

A replica's answer is untrusted input. A value no column can hold (an integer past the column's
range, text that is not valid Unicode or holds a NUL, text longer than its column) would fail the
write of a whole batch — every replica's rows with it — and fail again after every restart, since
the cursor stored with those rows never moved. So the collector fits each entry with the functions
below *before* its cursor moves past it: a field that cannot be stored is nulled, an entry whose
key or a required figure cannot be stored is skipped, and each is counted by reason
(:data:`REASONS`). The store itself writes what it is given.

The ranges are the columns' own: ``Integer`` holds what PostgreSQL's INTEGER holds (SQLite holds
more; the store keeps what every backend can hold and read back), ``BigInteger`` what BIGINT holds,
``String(n)`` n characters; :mod:`storage.models` takes its widths from here, and a test checks
every column against :func:`int_range` / :func:`text_length`. PostgreSQL refuses a NUL in text and a
lone surrogate anywhere, so both are refused on every backend. This module imports no SQLAlchemy:
the collector (``tailpilot status``) fits rows without loading the database layer.

Tenant and request-type names come from clients: a name past the bound (``NAME_MAX_CHARS``) or
not valid text is stored under ``OTHER_GROUP`` (:func:`group_name`); their cap per window and its
fold are the names' own (:mod:`scheduler.names`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from scheduler.names import NAME_MAX_CHARS, OTHER_GROUP
from storage.rows import CompletionRow, SampleRow

# --- why a value was not stored as sent (the label of the counts per replica) ---------------------

MALFORMED = "malformed"  # not the documented shape (a missing id, a string for a count, ...)
OUT_OF_RANGE = "out_of_range"  # an integer beyond its column's range
INVALID_TEXT = "invalid_text"  # not valid Unicode (a lone surrogate) or holding a NUL
TOO_LONG = "too_long"  # text longer than its column
NON_FINITE = "non_finite"  # NaN or ±Infinity, read as null
LONG_NAME = "long_name"  # a tenant or type name past NAME_MAX_CHARS, counted under OTHER_GROUP
DUPLICATE_ID = "duplicate_id"  # a completion repeating a request id already read
REASONS: tuple[str, ...] = (
    MALFORMED,
    OUT_OF_RANGE,
    INVALID_TEXT,
    TOO_LONG,
    NON_FINITE,
    LONG_NAME,
    DUPLICATE_ID,
)

INT32_RANGE = (-(2**31), 2**31 - 1)  # Integer columns (PostgreSQL INTEGER)
INT64_RANGE = (-(2**63), 2**63 - 1)  # BigInteger columns (PostgreSQL BIGINT, SQLite INTEGER)
COUNT_RANGE = (0, 2**63 - 1)  # counts, versions, blocks: a negative one is a broken replica's
TOKEN_COUNT_RANGE = (0, INT32_RANGE[1])  # a completion's token counts (Integer columns)
#: A settings document larger than a replica takes in a PUT (its control API's body limit) was
#: never put: stored once per version, it would let a broken replica fill the disk.
SETTINGS_DOC_BYTES = 64 * 1024

# --- the widths of the text columns a replica's values go to (storage.models uses these) ----------

REQUEST_ID_CHARS = 200  # completions.request_id: vLLM's ids are ~40 characters
TENANT_CHARS = 200  # completions.tenant
TYPE_CHARS = 100  # completions.type
REASON_CHARS = 50  # completions.reason: "finished", "aborted", "length", ...
POLICY_CHARS = 100  # samples.policy
INSTANCE_CHARS = 64  # collector_cursors.instance, settings_seen.instance: a uuid4 hex is 32

# The integer columns a replica's values go to, by range (test_storage checks them against the
# models).
INT32_COLUMNS: dict[str, tuple[str, ...]] = {
    "completions": (
        "prompt_tokens",
        "output_tokens",
        "preemptions",
        "recomputed_tokens",
        "max_tokens",
    ),
    "samples": (
        "settings_version",
        "waiting",
        "running",
        "kv_used_blocks",
        "kv_total_blocks",
        "breaker_trips",
    ),
    "settings_seen": ("version",),
    "settings_changes": ("version",),
}
INT64_COLUMNS: dict[str, tuple[str, ...]] = {"collector_cursors": ("cursor",)}


def int_problem(value: Any, bounds: tuple[int, int]) -> str | None:
    """Why ``value`` (an int, or None) cannot go into a column of that range, else None."""
    if value is None or (isinstance(value, int) and bounds[0] <= value <= bounds[1]):
        return None
    return OUT_OF_RANGE


def fraction_problem(value: Any) -> str | None:
    """Why ``value`` (a float, or None) cannot be a fraction such as KV usage, else None."""
    if value is None or (isinstance(value, int | float) and 0.0 <= value <= 1.0):
        return None  # NaN fails both comparisons
    return NON_FINITE if isinstance(value, float) and not math.isfinite(value) else OUT_OF_RANGE


def text_problem(value: str, max_chars: int | None = None) -> str | None:
    """Why ``value`` cannot go into a text column of ``max_chars``, else None."""
    if max_chars is not None and len(value) > max_chars:
        return TOO_LONG
    if "\x00" in value:
        return INVALID_TEXT
    if not value.isascii():  # the common case is ASCII: no encoding pass for it
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return INVALID_TEXT
    return None


def clean_text(value: str) -> str:
    """Text of our own making (an error message quoting a replica's answer) made storable: a lone
    surrogate becomes U+FFFD and a NUL is dropped. For the collector's messages, not for data."""
    if text_problem(value) is None:
        return value
    return value.encode("utf-8", "replace").decode("utf-8").replace("\x00", "")


def settings_problem(doc: Any) -> str | None:
    """Why a replica's settings document cannot be stored, else None: ``json_problem``'s, or
    larger than ``SETTINGS_DOC_BYTES`` as JSON."""
    if (problem := json_problem(doc)) is not None:
        return problem
    try:
        size = len(json.dumps(doc, ensure_ascii=False).encode("utf-8"))
    except (TypeError, ValueError):  # not JSON-shaped (a reader parsed it: should not happen)
        return MALFORMED
    return TOO_LONG if size > SETTINGS_DOC_BYTES else None


def json_problem(doc: Any) -> str | None:
    """Why a JSON document (from ``json.loads``) cannot be stored, else None: a string or key that
    is not valid text (PostgreSQL's JSONB refuses ``\\u0000`` and lone surrogates). Iterative: a
    document as deep as the JSON reader allows must not overflow the stack here."""
    for s in _strings(doc):
        if text_problem(s) is not None:
            return INVALID_TEXT
    return None


def _strings(doc: Any) -> Iterator[str]:
    stack = [doc]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, dict):
            for key, value in item.items():
                if isinstance(key, str):
                    yield key
                stack.append(value)
        elif isinstance(item, list):
            stack.extend(item)


# --- fitting rows ---------------------------------------------------------------------------------

_COMPLETION_REQUIRED_INTS = ("prompt_tokens", "output_tokens", "preemptions", "recomputed_tokens")
#: The settings version of a settings_seen row and of an audit row (both Integer columns).
VERSION_RANGE = INT32_RANGE
#: The control-API cursor, stored with the rows it covers (never negative: a CHECK constraint).
CURSOR_RANGE = (0, INT64_RANGE[1])


def group_name(name: str) -> tuple[str, str | None]:
    """(the name a tenant or type is stored and grouped under, why it is not its own or None)."""
    if len(name) > NAME_MAX_CHARS:
        return OTHER_GROUP, LONG_NAME
    problem = text_problem(name)
    return (name, None) if problem is None else (OTHER_GROUP, problem)


def fit_completion(row: CompletionRow) -> tuple[CompletionRow | None, list[str]]:
    """(``row`` as the store can hold it, or None to skip it; why, per field changed).

    Skipped: a request id, reason or token count the columns cannot hold, a negative count, a
    finish before the arrival (the id is the entry's key, and a count or a latency the store would
    have to invent is worse than no entry). Kept with a change: a tenant or type name that is too
    long or not valid text is stored and grouped under :data:`OTHER_GROUP` (the request still
    counts); a cap out of range, a non-finite optional time and a first token outside the
    request's life are nulled."""
    reasons: list[str] = []
    problem = text_problem(row.request_id, REQUEST_ID_CHARS) or text_problem(
        row.reason, REASON_CHARS
    )
    if problem is None:
        for name in _COMPLETION_REQUIRED_INTS:
            problem = int_problem(getattr(row, name), TOKEN_COUNT_RANGE)
            if problem is not None:
                break
    if problem is None and not (math.isfinite(row.arrival_s) and math.isfinite(row.finished_s)):
        problem = NON_FINITE
    if problem is None and row.finished_s < row.arrival_s:  # a latency below zero: no time is true
        problem = OUT_OF_RANGE
    if problem is not None:
        return None, [problem]
    changes: dict[str, Any] = {}
    for name in ("tenant", "type"):
        value, why = group_name(getattr(row, name))
        if why is not None:
            changes[name] = value
            reasons.append(why)
    if int_problem(row.max_tokens, TOKEN_COUNT_RANGE) is not None:
        changes["max_tokens"] = None
        reasons.append(OUT_OF_RANGE)
    for name in ("first_token_s", "received_s"):
        value = getattr(row, name)
        if value is not None and not math.isfinite(value):
            changes[name] = None
            reasons.append(NON_FINITE)
    first_token = changes.get("first_token_s", row.first_token_s)
    if first_token is not None and not row.arrival_s <= first_token <= row.finished_s:
        changes["first_token_s"] = None  # a first token outside the request's life: TTFT unknown
        reasons.append(OUT_OF_RANGE)
    return (replace(row, **changes) if changes else row), reasons


def fit_sample(row: SampleRow) -> list[str]:
    """Null, in place, the fields of ``row`` the samples table cannot hold; why, per field. The
    reason text (the collector's own words, quoting a replica's answer) is cleaned, not counted."""
    reasons: list[str] = []
    for name in INT32_COLUMNS["samples"]:
        problem = int_problem(getattr(row, name), INT32_RANGE)
        if problem is not None:
            setattr(row, name, None)
            reasons.append(problem)
    if row.policy is not None:
        problem = text_problem(row.policy, POLICY_CHARS)
        if problem is not None:
            row.policy = None
            reasons.append(problem)
    if row.reason is not None:
        row.reason = clean_text(row.reason)
    return reasons


__all__ = [
    "COUNT_RANGE",
    "CURSOR_RANGE",
    "DUPLICATE_ID",
    "INSTANCE_CHARS",
    "INT32_COLUMNS",
    "INT32_RANGE",
    "INT64_COLUMNS",
    "INT64_RANGE",
    "INVALID_TEXT",
    "LONG_NAME",
    "MALFORMED",
    "NON_FINITE",
    "OUT_OF_RANGE",
    "POLICY_CHARS",
    "REASONS",
    "REASON_CHARS",
    "REQUEST_ID_CHARS",
    "TENANT_CHARS",
    "TOKEN_COUNT_RANGE",
    "TOO_LONG",
    "TYPE_CHARS",
    "VERSION_RANGE",
    "clean_text",
    "fit_completion",
    "fit_sample",
    "fraction_problem",
    "group_name",
    "int_problem",
    "json_problem",
    "text_problem",
]

"""Strict JSON on the control API's wire, both ways (the handler's bodies and the admission
server's refusals). Standard library and pydantic's core only: this runs in vLLM's process."""

from __future__ import annotations

import codecs
import json
import math
import os
import stat
from typing import Any

import pydantic_core  # pydantic's own core (Rust): strict JSON without a hand-written encoder

from scheduler.validation import readable, spell_unencodable

MAX_FILE_BYTES = 16 * 1024 * 1024  # a settings file: 10,000 tenants' SLOs are ~2 MiB
MAX_INT_DIGITS = 400  # far beyond any count, version or token number; int() is quadratic in digits


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name} (JSON has no NaN or Infinity)")


def _reject_big_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # a literal too large for a float: inf, which JSON cannot carry
        raise ValueError(f"number {text[:40]} is out of range")
    return value


def _reject_big_int(text: str) -> int:
    if len(text) > MAX_INT_DIGITS:  # int() of a long digit string costs quadratic time
        raise ValueError(f"an integer of {len(text)} digits (at most {MAX_INT_DIGITS})")
    return int(text)


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    doc: dict[str, Any] = {}
    for key, value in pairs:
        if key in doc:  # which one counts is ambiguous: another reader may take the other
            raise ValueError(f"key {readable(key)!r} given more than once in one object")
        doc[key] = value
    return doc


def parse_json_body(body: bytes) -> Any:
    """Strict JSON: UTF-8, finite numbers, bounded nesting, each key once per object; ValueError
    naming the problem."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"body: not UTF-8 (byte {err.start})") from None
    try:
        return json.loads(
            text,
            parse_constant=_reject_constant,
            parse_float=_reject_big_float,
            parse_int=_reject_big_int,
            object_pairs_hook=_reject_duplicate_keys,
        )
    except RecursionError:
        raise ValueError("body: JSON nested too deeply") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"body: not JSON ({err})") from None
    except ValueError as err:
        raise ValueError(f"body: {err}") from None


def read_capped(path: str | os.PathLike[str], max_bytes: int, what: str) -> bytes:
    """The bytes of a regular file of at most ``max_bytes``: a FIFO, a device or a directory is
    refused before it is opened (a FIFO would block the reader until a writer comes; /dev/zero
    never ends), a larger file after reading one byte past the cap. ValueError naming the
    problem; OSError when it cannot be read."""
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file (a FIFO, a device, ...)"
        raise ValueError(f"{kind}: give the {what} as a file")
    with open(path, "rb") as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ValueError(f"over {max_bytes // 1024 // 1024} MiB: not a {what}")
    return data


def parse_json_file(
    path: str | os.PathLike[str], max_bytes: int = MAX_FILE_BYTES, what: str = "settings document"
) -> Any:
    """A JSON file (a settings document by default) read as strictly as a PUT body (a UTF-8 BOM
    allowed; a key twice, NaN, a huge number refused); ValueError naming the problem (OSError
    when it cannot be read)."""
    data = read_capped(path, max_bytes, what)
    return parse_json_body(data.removeprefix(codecs.BOM_UTF8))


def encode_json(doc: Any) -> bytes:
    """Strict JSON out (NaN/Infinity as null): readers such as PostgreSQL's jsonb refuse them.

    Text that UTF-8 cannot carry (a lone surrogate, from a client's label or an echoed key) goes
    out as its escape spelled in plain characters (``\\ud800``) rather than failing the answer."""
    try:
        return pydantic_core.to_json(doc, inf_nan_mode="null", fallback=float)  # float: numpy
    except pydantic_core.PydanticSerializationError:
        return pydantic_core.to_json(_readable(doc), inf_nan_mode="null", fallback=float)


def _readable(doc: Any) -> Any:
    if isinstance(doc, str):  # spelled out, not cut (JSON escapes control characters itself)
        return spell_unencodable(doc)
    if isinstance(doc, dict):
        return {_readable(k): _readable(v) for k, v in doc.items()}
    if isinstance(doc, (list, tuple)):
        return [_readable(v) for v in doc]
    return doc

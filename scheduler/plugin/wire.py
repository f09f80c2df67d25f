"""Strict JSON on the control API's wire, both ways (the handler's bodies and the admission
server's refusals). Standard library and pydantic's core only: this runs in vLLM's process."""

from __future__ import annotations

import json
import math
from typing import Any

import pydantic_core  # pydantic's own core (Rust): strict JSON without a hand-written encoder


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name} (JSON has no NaN or Infinity)")


def _reject_big_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # a literal too large for a float: inf, which JSON cannot carry
        raise ValueError(f"number {text[:40]} is out of range")
    return value


def parse_json_body(body: bytes) -> Any:
    """Strict JSON: UTF-8, finite numbers, bounded nesting; ValueError naming the problem."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"body: not UTF-8 (byte {err.start})") from None
    try:
        return json.loads(text, parse_constant=_reject_constant, parse_float=_reject_big_float)
    except RecursionError:
        raise ValueError("body: JSON nested too deeply") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"body: not JSON ({err})") from None
    except ValueError as err:
        raise ValueError(f"body: {err}") from None


def encode_json(doc: Any) -> bytes:
    """Strict JSON out (NaN/Infinity as null): readers such as PostgreSQL's jsonb refuse them."""
    return pydantic_core.to_json(
        doc, inf_nan_mode="null", fallback=float
    )  # fallback: numpy scalars

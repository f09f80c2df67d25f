"""Rows to column values and back: how ``storage.rows`` dataclasses meet the tables' columns.

The write side (``storage.recordings``) turns the collector's rows into insert parameters; the read
side (``storage.readings``) turns result rows back into the same dataclasses. Both directions live
here, beside the field lists they share.

The store keeps only what every backend can hold and read back: a NaN or ±inf in a nullable float
column is stored as NULL (:func:`finite_or_none`), and in a JSON document as null
(``storage.strict_json``).
"""

from __future__ import annotations

import math
from operator import attrgetter
from typing import Any

from sqlalchemy import Row

from storage.rows import (
    PERCENTILE_FIELDS,
    CompletionRow,
    GroupSampleRow,
    LatencyPercentiles,
    SampleRow,
)

# Plain (non-latency) SampleRow fields, in column order; the latency fields are PERCENTILE_FIELDS.
SAMPLE_FIELDS: tuple[str, ...] = (
    "t_ms", "healthy", "reason", "policy", "settings_version", "waiting", "running", "kv_usage",
    "kv_used_blocks", "kv_total_blocks", "gamma_live", "beta_live", "throughput_tok_s",
    "throughput_req_s", "preemptions_per_s", "breaker_trips", "rejected",
)  # fmt: skip
# The float ones among them: like the percentiles, NaN or ±inf there is stored as NULL.
SAMPLE_FLOAT_FIELDS: tuple[str, ...] = (
    "kv_usage", "gamma_live", "beta_live", "throughput_tok_s", "throughput_req_s",
    "preemptions_per_s",
)  # fmt: skip
COMPLETION_FIELDS: tuple[str, ...] = (
    "request_id", "tenant", "type", "arrival_s", "first_token_s", "finished_s", "prompt_tokens",
    "output_tokens", "preemptions", "recomputed_tokens", "reason", "max_tokens", "received_s",
)  # fmt: skip
# The float columns of samples and group_samples: all nullable.
SAMPLE_FLOAT_COLUMNS: tuple[str, ...] = SAMPLE_FLOAT_FIELDS + PERCENTILE_FIELDS
GROUP_FLOAT_COLUMNS: tuple[str, ...] = ("throughput_tok_s", *PERCENTILE_FIELDS)

# Row -> values in C (operator.attrgetter): cheaper than a getattr per field on the ingest path.
_sample_values = attrgetter(*SAMPLE_FIELDS)
_sample_floats = attrgetter(*SAMPLE_FLOAT_FIELDS)
_latency_values = attrgetter(*PERCENTILE_FIELDS)


def finite_or_none(value: float | None) -> float | None:
    """NaN and ±inf as None: a nullable float column stores them as NULL, which every reader
    understands.

    Storage's own copy of ``scheduler.validation.finite_or_none``: storage imports nothing of the
    project (``tests/test_layers.py``). It also differs on purpose: it runs per row on the ingest
    path, so it only tests finiteness and returns the value it was given (no number conversion).
    """
    return value if value is None or math.isfinite(value) else None


def _all_finite(values: tuple[Any, ...], also: float | None = None) -> bool:
    """No NaN or ±inf among ``values`` and ``also`` (None allowed). False may also mean an
    overflow."""
    # One pass in C: a sum is finite only if every term is; an overflow merely takes the slow path.
    return math.isfinite(sum(filter(None, values), also or 0.0))


def _null_non_finite(params: dict[str, Any], floats: tuple[str, ...]) -> None:
    """Replace NaN and ±inf in the ``floats`` columns of ``params`` by None."""
    for f in floats:
        params[f] = finite_or_none(params[f])


def sample_params(r: SampleRow, replica_id: int) -> dict[str, Any]:
    """Insert parameters for one sample of the replica ``replica_id``."""
    latency = _latency_values(r.latency)
    params = dict(zip(SAMPLE_FIELDS, _sample_values(r)), replica_id=replica_id)
    params.update(zip(PERCENTILE_FIELDS, latency))
    if not _all_finite(_sample_floats(r) + latency):
        _null_non_finite(params, SAMPLE_FLOAT_COLUMNS)
    return params


def group_sample_params(r: GroupSampleRow, replica_id: int) -> dict[str, Any]:
    """Insert parameters for one per-tenant / per-type sample of the replica ``replica_id``."""
    latency = _latency_values(r.latency)
    params = {"replica_id": replica_id, "t_ms": r.t_ms, "kind": r.kind, "group_name": r.group,
              "completed": r.completed, "throughput_tok_s": r.throughput_tok_s}  # fmt: skip
    params.update(zip(PERCENTILE_FIELDS, latency))
    if not _all_finite(latency, r.throughput_tok_s):
        _null_non_finite(params, GROUP_FLOAT_COLUMNS)
    return params


def completion_params(c: CompletionRow, replica_id: int, stored_ms: int) -> dict[str, Any]:
    """Insert parameters for one completion of the replica ``replica_id``, received at
    ``stored_ms``."""
    return {
        "replica_id": replica_id,
        "request_id": c.request_id,
        "tenant": c.tenant,
        "type": c.type,
        "arrival_s": c.arrival_s,
        "first_token_s": finite_or_none(c.first_token_s),
        "finished_s": c.finished_s,
        "prompt_tokens": c.prompt_tokens,
        "output_tokens": c.output_tokens,
        "preemptions": c.preemptions,
        "recomputed_tokens": c.recomputed_tokens,
        "reason": c.reason,
        "max_tokens": c.max_tokens,
        "received_s": finite_or_none(c.received_s),
        "stored_ms": stored_ms,
    }


def _latency_of(row: Row[Any]) -> LatencyPercentiles:
    return LatencyPercentiles(**{f: getattr(row, f) for f in PERCENTILE_FIELDS})


def sample_row(replica: str, row: Row[Any]) -> SampleRow:
    """The :class:`SampleRow` a ``samples`` result row holds."""
    fields = {f: getattr(row, f) for f in SAMPLE_FIELDS}
    fields["healthy"] = bool(fields["healthy"])
    return SampleRow(replica=replica, latency=_latency_of(row), **fields)


def group_sample_row(replica: str, row: Row[Any]) -> GroupSampleRow:
    """The :class:`GroupSampleRow` a ``group_samples`` result row holds."""
    return GroupSampleRow(replica=replica, t_ms=row.t_ms, kind=row.kind, group=row.group_name,
                          completed=row.completed, throughput_tok_s=row.throughput_tok_s,
                          latency=_latency_of(row))  # fmt: skip


def completion_row(replica: str, row: Row[Any]) -> CompletionRow:
    """The :class:`CompletionRow` a ``completions`` result row holds."""
    return CompletionRow(replica=replica, **{f: getattr(row, f) for f in COMPLETION_FIELDS})

"""Retention and downsampling: raw samples for hours, 1-minute rollups after that, completions for
days.

A poll every second per replica is 86,400 sample rows a day per replica, plus one per tenant and
type; nobody looks at last month's data at that resolution. So samples older than
``RetentionSettings.raw_sample_hours`` are folded into one row per replica and minute
(``sample_rollups``; group samples likewise into ``group_sample_rollups``) and the raw rows are
deleted, in one transaction, so a crash in between neither loses a minute nor counts it twice.

What a rollup keeps, and why it cannot keep more:

* gauges (queue lengths, KV usage, live γ/β, throughput, preemption rate): the mean and the max over
  the minute's samples;
* windowed percentiles (``ttft_p99`` ...): also the mean and the max of the samples' values. These
  are *not* the minute's percentiles, and nothing stored could give those: a percentile of a union
  is not a function of the parts' percentiles (windows {1, 2, 3} and {4, 5, 100} have medians 2 and
  5; so do {1, 2, 3} and {2, 5, 9}; the unions' medians are 3.5 and 2.5), and the sliding windows
  overlap, so one request counts in many of them. Exact minute percentiles would need the raw
  latencies (the completions, kept for ``completion_days``) or a mergeable sketch per window. The
  max is the honest upper bound an operator wants ("was the tail ever this bad in that minute"); the
  mean is the typical level.

The cut-off is rounded down to a whole minute so every minute is folded at once. Should a sample
older than an already-folded minute still arrive (a collector that sat on a batch for hours), its
rollup merges into the existing row: means weighted by sample counts, maxima by max.

Completions are deleted after ``completion_days`` by ``stored_ms`` — the store's clock, since a
request's own times are on its replica's clock, which may not be the wall clock.

Recordings pin their data: with ``keep_recordings`` (the default), rows of a cluster inside one of
its recordings' spans (an open recording runs until now) are neither folded nor deleted, so a
recording can still be replayed or turned into a trace in full months later.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import (
    ColumnElement,
    Connection,
    Table,
    and_,
    case,
    delete,
    exists,
    func,
    literal,
    select,
)
from sqlalchemy.sql.base import ReadOnlyColumnCollection

from storage.database import Database
from storage.models import (
    ROLLUP_GROUP_COLUMNS,
    ROLLUP_SAMPLE_COLUMNS,
    Completion,
    GroupSample,
    Recording,
    Replica,
    Sample,
    group_sample_rollups,
    sample_rollups,
    table,
)
from storage.sql import upsert

MINUTE_MS = 60_000
HOUR_MS = 3_600_000
DAY_MS = 86_400_000


class RetentionSettings(BaseModel):
    """How long the store keeps what. Applied by ``Retention.apply`` (the collector calls it)."""

    model_config = ConfigDict(extra="forbid")

    raw_sample_hours: float = Field(
        24.0, gt=0, description="raw samples older than this become 1-minute rollups"
    )
    completion_days: float = Field(
        7.0, gt=0, description="completions older than this (store clock) are deleted"
    )
    keep_recordings: bool = Field(
        True, description="never fold or delete rows inside a recording's span"
    )


@dataclass(frozen=True, slots=True)
class RetentionReport:
    """What one ``Retention.apply`` did, for the collector's log."""

    samples_folded: int
    group_samples_folded: int
    completions_deleted: int


class Retention:
    """Applies :class:`RetentionSettings` to the store's database (``store.retention``)."""

    def __init__(self, database: Database) -> None:
        self.database = database

    def apply(self, now_ms: int, settings: RetentionSettings) -> RetentionReport:
        """Fold old samples into 1-minute rollups and delete old completions (see the module
        docstring).

        Each step is its own transaction, so the collector's writes can slip in between.
        """
        keep = settings.keep_recordings
        cut = sample_cutoff_ms(now_ms, settings)
        samples = self.database.write(lambda c: fold_samples(c, cut, now_ms, keep), snapshot=True)
        groups = self.database.write(
            lambda c: fold_group_samples(c, cut, now_ms, keep), snapshot=True
        )
        cut_c = completion_cutoff_ms(now_ms, settings)
        completions = self.database.write(lambda c: delete_completions(c, cut_c, now_ms, keep))
        return RetentionReport(samples, groups, completions)


def sample_cutoff_ms(now_ms: int, settings: RetentionSettings) -> int:
    """Samples strictly before this are folded; a whole minute, so no minute is split."""
    cutoff = now_ms - int(settings.raw_sample_hours * HOUR_MS)
    return cutoff - cutoff % MINUTE_MS


def completion_cutoff_ms(now_ms: int, settings: RetentionSettings) -> int:
    return now_ms - int(settings.completion_days * DAY_MS)


def fold_samples(conn: Connection, cutoff_ms: int, now_ms: int, keep_recordings: bool) -> int:
    """Fold samples before ``cutoff_ms`` into ``sample_rollups`` and delete them; returns rows
    folded."""
    src = table(Sample)
    old = _expired(src.c.replica_id, src.c.t_ms, cutoff_ms, now_ms, keep_recordings)
    aggregates = {
        "n": func.count(),
        "n_healthy": func.sum(case((src.c.healthy, 1), else_=0)),
        "settings_version_max": func.max(src.c.settings_version),
        "kv_total_blocks_max": func.max(src.c.kv_total_blocks),
        **_mean_max(src, ROLLUP_SAMPLE_COLUMNS),
    }
    return _fold(conn, src, sample_rollups, (), aggregates, old)


def fold_group_samples(conn: Connection, cutoff_ms: int, now_ms: int, keep_recordings: bool) -> int:
    """Fold group samples before ``cutoff_ms`` into ``group_sample_rollups`` and delete them."""
    src = table(GroupSample)
    old = _expired(src.c.replica_id, src.c.t_ms, cutoff_ms, now_ms, keep_recordings)
    aggregates = {"n": func.count(), **_mean_max(src, ROLLUP_GROUP_COLUMNS)}
    return _fold(conn, src, group_sample_rollups, ("kind", "group_name"), aggregates, old)


def delete_completions(conn: Connection, cutoff_ms: int, now_ms: int, keep_recordings: bool) -> int:
    src = table(Completion)
    old = _expired(src.c.replica_id, src.c.stored_ms, cutoff_ms, now_ms, keep_recordings)
    return conn.execute(delete(src).where(old)).rowcount


def _mean_max(src: Table, names: tuple[str, ...]) -> dict[str, ColumnElement[Any]]:
    out: dict[str, ColumnElement[Any]] = {}
    for name in names:
        out[f"{name}_mean"] = func.avg(src.c[name])
        out[f"{name}_max"] = func.max(src.c[name])
    return out


def _expired(
    replica_col: ColumnElement[int],
    time_col: ColumnElement[int],
    cutoff_ms: int,
    now_ms: int,
    keep_recordings: bool,
) -> ColumnElement[bool]:
    """Rows older than the cut-off and, with ``keep_recordings``, outside every recording of their
    cluster."""
    older = time_col < cutoff_ms
    if not keep_recordings:
        return older
    rec, rep = Recording.__table__, Replica.__table__
    in_recording = exists(
        select(literal(1))
        .select_from(rec.join(rep, rep.c.cluster == rec.c.cluster))
        .where(
            rep.c.id == replica_col,
            time_col >= rec.c.started_ms,
            time_col <= func.coalesce(rec.c.ended_ms, now_ms),
        )
    )
    return and_(older, ~in_recording)


def _fold(
    conn: Connection,
    src: Table,
    rollup: Table,
    extra_keys: tuple[str, ...],
    aggregates: dict[str, ColumnElement[Any]],
    where: ColumnElement[bool],
) -> int:
    """INSERT ... SELECT one row per (replica, minute, *extra_keys), merging into existing rollups;
    then delete."""
    minute = (src.c.t_ms // MINUTE_MS) * MINUTE_MS
    keys = [src.c.replica_id.label("replica_id"), minute.label("minute_ms")]
    keys += [src.c[k].label(k) for k in extra_keys]
    grouped = select(*keys, *(agg.label(name) for name, agg in aggregates.items())).where(where)
    grouped = grouped.group_by(*(k.element for k in keys))
    names = ["replica_id", "minute_ms", *extra_keys, *aggregates]
    stmt = upsert(conn, rollup).from_select(names, grouped)
    stmt = stmt.on_conflict_do_update(
        index_elements=[c.name for c in rollup.primary_key.columns],
        set_=_merge_rules(rollup, stmt.excluded, list(aggregates)),
    )
    conn.execute(stmt)
    return conn.execute(delete(src).where(where)).rowcount


def _merge_rules(
    rollup: Table, new: ReadOnlyColumnCollection[str, Any], names: list[str]
) -> dict[str, ColumnElement[Any]]:
    """How a late fold merges into an existing rollup row (see the module docstring)."""
    old_n, new_n = rollup.c.n, new.n
    rules: dict[str, ColumnElement[Any]] = {}
    for name in names:
        old, incoming = rollup.c[name], new[name]
        if name in ("n", "n_healthy"):
            rules[name] = old + incoming
        elif name.endswith("_mean"):
            # Arithmetic with a NULL is NULL, so coalesce falls back to whichever side has a value.
            weighted = (old * old_n + incoming * new_n) / (old_n + new_n)
            rules[name] = func.coalesce(weighted, old, incoming)
        else:  # a max; SQLite's two-argument max() is NULL if either is
            rules[name] = func.coalesce(case((old > incoming, old), else_=incoming), old, incoming)
    return rules

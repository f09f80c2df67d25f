"""``Store``: the one facade the rest of tailpilot uses for its database.

Write side (the collector): ``ensure_replicas``, then ``write(cluster, batch)`` per flush. A batch is
written in ONE transaction with Core ``executemany`` inserts — no ORM unit of work on the hot path —
and carries the replicas' control-API cursors, upserted in the same transaction. Completions are
unique per (replica, request_id) and inserted with ``ON CONFLICT DO NOTHING``. Together these make a
``kill -9`` at any moment harmless: either the batch and its cursors are stored, or neither is and
the collector re-reads the same completions from the old cursor; re-reading ones already stored is
a no-op.

SQLite allows one writer at a time. A write that finds the lock taken waits inside SQLite
(``busy_timeout``), and past that the store retries with backoff until ``write_deadline_s``; only then
does it raise :class:`StoreBusy`, and the caller keeps the batch and tries again later. Rows are
never dropped.

The store keeps only what every backend can hold and read back: a NaN or ±inf in a nullable float
column is stored as NULL, and in a JSON document as null (``storage.strict_json``).

A damaged SQLite file, or one that is no database, raises :class:`StoreOpenError` when opening finds
it, else :class:`StoreCorrupt` from the first read or write that touches the damage; both name the
file. Any other write the database refuses raises :class:`StoreWriteError` (:class:`StoreFull` when
the database or its disk is full): one line naming the database and what failed, never the SQL or
the row values (they may hold tenants' data); the transaction is rolled back whole, so what was
committed before stays as it was. Rows must fit the columns (``storage.limits``: the collector fits
every entry a replica sends before queuing it).

Read side (TUI, replay, ``tailpilot status``, tuner): methods return plain dataclasses
(``SampleRow``, ``CompletionRow``, ... from :mod:`storage.rows`, or the small records below) and
dicts — never ORM objects tied to a session.

Replicas are addressed by (cluster, name) everywhere in this API; a name the store has not seen is
created on first use, so a batch is never refused for naming a replica ``ensure_replicas`` missed.
"""

from __future__ import annotations

import math
import sqlite3
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, TypeVar

from sqlalchemy import (
    Connection,
    Engine,
    Row,
    case,
    func,
    insert,
    select,
    update,
)
from sqlalchemy.engine import URL
from sqlalchemy.exc import DBAPIError

from storage import engine as engines
from storage.backoff import backoff_delays
from storage import migrate
from storage import retention as ret
from storage.models import (
    AlertEvent,
    CollectorCursor,
    Completion,
    FidelityReport,
    GovernanceWindow,
    AutopilotControl,
    GovernorControl,
    Prediction,
    GroupSample,
    Recommendation,
    Recording,
    Replica,
    Sample,
    SettingsChange,
    SettingsSeen,
    sample_rollups,
    table,
)
from storage.retention import RetentionReport, RetentionSettings
from storage.rows import (
    BREAKER_RESULT,
    BREAKER_WHO,
    PERCENTILE_FIELDS,
    Batch,
    CompletionRow,
    GroupSampleRow,
    LatencyPercentiles,
    SampleRow,
    SettingsChangeRow,
    SettingsSeenRow,
)
from storage.sql import SUPPORTED_BACKENDS, insert_ignoring, insert_or_update

T = TypeVar("T")

DEFAULT_WRITE_DEADLINE_S = 30.0
# Plain (non-latency) SampleRow fields, in column order; the latency fields are PERCENTILE_FIELDS.
SAMPLE_FIELDS: tuple[str, ...] = (
    "t_ms", "healthy", "reason", "policy", "settings_version", "waiting", "running", "kv_usage",
    "kv_used_blocks", "kv_total_blocks", "gamma_live", "beta_live", "throughput_tok_s",
    "throughput_req_s", "preemptions_per_s", "breaker_trips", "rejected",
)  # fmt: skip
# The float ones among them: like the percentiles, NaN or ±inf there is stored as NULL.
SAMPLE_FLOAT_FIELDS: tuple[str, ...] = (
    "kv_usage", "gamma_live", "beta_live", "throughput_tok_s", "throughput_req_s", "preemptions_per_s",
)  # fmt: skip
COMPLETION_FIELDS: tuple[str, ...] = (
    "request_id", "tenant", "type", "arrival_s", "first_token_s", "finished_s", "prompt_tokens",
    "output_tokens", "preemptions", "recomputed_tokens", "reason", "max_tokens", "received_s",
)  # fmt: skip


class StoreError(RuntimeError):
    """Base of the store's own errors."""


class StoreOpenError(StoreError):
    """The database could not be opened or migrated; the message names the database (a SQLite file's
    path, else the URL without its password)."""


class StoreBusy(StoreError):
    """A write found the database locked until its deadline. Nothing was written: keep the batch, retry."""


class StoreCorrupt(StoreError):
    """The database file is damaged or is not a database at all; the message names the file."""


class StoreWriteError(StoreError):
    """The database refused a write (nothing of it was stored); the message names the database and
    what failed, without SQL or row values."""


class StoreFull(StoreWriteError):
    """The database or the disk it lives on is full: nothing of this write was stored."""


@dataclass(frozen=True, slots=True)
class ReplicaInfo:
    cluster: str
    name: str
    api_url: str | None
    control_url: str | None
    first_seen_ms: int
    last_seen_ms: int | None  # newest healthy sample; None before the first


@dataclass(frozen=True, slots=True)
class RecordingInfo:
    id: int
    name: str
    cluster: str
    started_ms: int
    ended_ms: int | None  # None while recording
    note: str | None


@dataclass(frozen=True, slots=True)
class RecommendationInfo:
    id: int
    study: str
    created_ms: int
    settings: dict[str, Any]
    summary: dict[str, Any]


class Store:
    """tailpilot's database. Thread-safe: the engine pools connections; one store per process suffices."""

    def __init__(
        self,
        engine: Engine,
        *,
        write_deadline_s: float = DEFAULT_WRITE_DEADLINE_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """Wrap an engine whose database is already migrated; use :meth:`open` instead."""
        self.engine = engine
        self.write_deadline_s = write_deadline_s
        self.busy_retries = 0  # how often a write waited for the lock (for logs and tests)
        self._clock = clock
        # (cluster, name) -> replicas.id. Filled only after a commit, so it never holds an id that a
        # rolled-back transaction created. Plain dict operations are atomic under the GIL.
        self._replica_ids: dict[tuple[str, str], int] = {}

    # ------------------------------------------------------------------ opening

    @classmethod
    def open(
        cls,
        url: str | None = None,
        *,
        write_deadline_s: float = DEFAULT_WRITE_DEADLINE_S,
        busy_timeout_ms: int | None = None,
        clock: Callable[[], float] = time.time,
    ) -> Store:
        """Open (and migrate to the newest schema) the store at ``url``.

        ``url``: ``None`` for ``./tailpilot.db``; a filesystem path for a SQLite file; or a SQLAlchemy
        URL (``sqlite:///...``, ``postgresql+psycopg://user:pw@host/db``; plain ``postgresql://`` is
        taken to mean psycopg 3). ``busy_timeout_ms`` is how long one SQLite statement waits for the
        write lock (default: 5 s, or the write deadline if shorter). Raises :class:`StoreOpenError`.
        """
        parsed = _parse_url(url)
        shown = _where(parsed)
        if parsed.get_backend_name() not in SUPPORTED_BACKENDS:
            raise StoreOpenError(
                f"cannot open store at {shown}: only {' and '.join(SUPPORTED_BACKENDS)} are supported"
            )
        if busy_timeout_ms is None:
            busy_timeout_ms = int(min(engines.DEFAULT_BUSY_TIMEOUT_MS, write_deadline_s * 1000))
        engine = None
        try:
            engine = engines.make_engine(parsed, busy_timeout_ms=busy_timeout_ms)
            migrate.upgrade(engine)
        except Exception as exc:
            if engine is not None:
                engine.dispose()
            raise StoreOpenError(f"cannot open store at {shown}: {_reason(exc, parsed)}") from None
        return cls(engine, write_deadline_s=write_deadline_s, clock=clock)

    def close(self) -> None:
        """Close every pooled connection. The store must not be used afterwards."""
        self.engine.dispose()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Store({engines.redact(self.engine.url)})"

    # ------------------------------------------------------------------ write side

    def ensure_replicas(self, cluster: str, replicas: Iterable[tuple[str, str, str]]) -> None:
        """Register (name, api_url, control_url) replicas of ``cluster``; updates the URLs of known ones."""
        now = self._now_ms()
        params = [
            {"cluster": cluster, "name": name, "api_url": api, "control_url": ctl, "first_seen_ms": now}
            for name, api, ctl in replicas
        ]
        if not params:
            return

        def txn(conn: Connection) -> dict[str, int]:
            conn.execute(
                insert_or_update(conn, table(Replica), ["cluster", "name"], ["api_url", "control_url"]), params
            )
            return self._lookup_replica_ids(conn, cluster, {str(p["name"]) for p in params})

        self._remember(cluster, self._write(txn))

    def write(self, cluster: str, batch: Batch) -> None:
        """Store one collector flush atomically (see the module docstring). Raises :class:`StoreBusy`."""
        names = _replica_names(batch)
        if not names and not batch.governance and not batch.alerts:
            return
        now = self._now_ms()

        def txn(conn: Connection) -> dict[str, int]:
            if batch.governance:
                conn.execute(insert(GovernanceWindow), [{"cluster": cluster, "t_ms": g.t_ms, "summary": g.summary}
                                                        for g in batch.governance])
            if batch.alerts:
                conn.execute(insert(AlertEvent), [{"cluster": cluster, "t_ms": a.t_ms, "name": a.name,
                                                   "severity": a.severity, "state": a.state, "summary": a.summary}
                                                  for a in batch.alerts])
            if not names:
                return {}
            ids = self._replica_ids_for(conn, cluster, names, now)
            self._insert_samples(conn, batch.samples, ids)
            self._insert_group_samples(conn, batch.group_samples, ids)
            self._insert_completions(conn, batch.completions, ids, now)
            self._upsert_cursors(conn, batch.cursors, batch.instances, ids, now)
            self._insert_settings_seen(conn, batch.settings_seen, ids)
            self._insert_settings_changes(conn, batch.settings_changes, ids)
            self._touch_last_seen(conn, batch.samples, ids)
            return ids

        self._remember(cluster, self._write(txn))

    def cursors(self, cluster: str) -> dict[str, int]:
        """Replica name -> the control-API cursor stored with that replica's newest completions."""
        return {name: cursor for name, (cursor, _) in self.cursor_positions(cluster).items()}

    def cursor_positions(self, cluster: str) -> dict[str, tuple[int, str | None]]:
        """Replica name -> (stored cursor, the replica instance it counts in or None if unreported)."""
        stmt = (
            select(Replica.name, CollectorCursor.cursor, CollectorCursor.instance)
            .join(CollectorCursor, CollectorCursor.replica_id == Replica.id)
            .where(Replica.cluster == cluster)
        )
        with self._read() as conn:
            return {name: (cursor, instance) for name, cursor, instance in conn.execute(stmt)}

    def breaker_positions(self, cluster: str) -> dict[str, tuple[str | None, int]]:
        """Replica name -> (instance, trips) of the newest circuit-breaker trip stored for it: the
        collector writes one audit row per trip it sees, and starts from these so a restart writes
        none twice."""
        stmt = (select(Replica.name, SettingsChange.new)
                .join(Replica, Replica.id == SettingsChange.replica_id)
                .where(Replica.cluster == cluster, SettingsChange.who == BREAKER_WHO,
                       SettingsChange.result == BREAKER_RESULT)
                .order_by(SettingsChange.t_ms.desc(), SettingsChange.id.desc()))
        newest: dict[str, tuple[str | None, int]] = {}
        with self._read() as conn:
            for name, new in conn.execute(stmt):
                if name not in newest and isinstance(new, dict) and isinstance(new.get("trips_total"), int):
                    instance = new.get("instance")
                    newest[name] = (instance if isinstance(instance, str) else None, new["trips_total"])
        return newest

    def record_settings_change(
        self,
        cluster: str,
        replica: str,
        *,
        who: str,
        old: dict[str, Any] | None,
        new: dict[str, Any] | None,
        result: str,
        message: str | None = None,
        version: int | None = None,
        t_ms: int | None = None,
    ) -> None:
        """Append to the settings audit log (``result``: "applied", "rejected", "error", ...)."""
        now = self._now_ms()
        row = {"t_ms": now if t_ms is None else t_ms, "who": who, "old": old, "new": new, "result": result,
               "message": message, "version": version}  # fmt: skip

        def txn(conn: Connection) -> dict[str, int]:
            ids = self._replica_ids_for(conn, cluster, {replica}, now)
            conn.execute(insert(SettingsChange), [{**row, "replica_id": ids[replica]}])
            return ids

        self._remember(cluster, self._write(txn))

    def begin_recording(self, cluster: str, name: str, note: str | None = None, *, t_ms: int | None = None) -> int:
        """Start a named recording of ``cluster`` now (or at ``t_ms``); returns its id."""
        row = {"cluster": cluster, "name": name, "note": note, "started_ms": self._now_ms() if t_ms is None else t_ms}
        return self._write(lambda conn: conn.execute(insert(Recording).returning(Recording.id), [row]).scalar_one())

    def end_recording(self, recording_id: int, *, t_ms: int | None = None) -> None:
        """End a recording now (or at ``t_ms``). KeyError if there is no such recording."""
        end = self._now_ms() if t_ms is None else t_ms
        stmt = update(Recording).where(Recording.id == recording_id).values(ended_ms=end)
        if self._write(lambda conn: conn.execute(stmt).rowcount) == 0:
            raise KeyError(f"no recording with id {recording_id}")

    def store_recommendation(
        self, study: str, settings: dict[str, Any], summary: dict[str, Any], *, t_ms: int | None = None
    ) -> int:
        """Keep a tuner study's recommended settings and its summary; returns the row id."""
        row = {"study": study, "settings": settings, "summary": summary,
               "created_ms": self._now_ms() if t_ms is None else t_ms}  # fmt: skip
        stmt = insert(Recommendation).returning(Recommendation.id)
        return self._write(lambda conn: conn.execute(stmt, [row]).scalar_one())

    def store_fidelity(self, cluster: str, replica: str, span: str, summary: dict[str, Any], *,
                       t_ms: int | None = None) -> int:
        """Keep a fidelity report of ``replica`` (its span as a db: URL); returns the row id."""
        now = self._now_ms() if t_ms is None else t_ms
        return self._insert_for_replica(FidelityReport, cluster, replica, now,
                                        {"created_ms": now, "span": span, "summary": summary})

    def latest_fidelity(self, cluster: str, replica: str | None = None, *,
                        at_ms: int | None = None) -> list[dict[str, Any]]:
        """The newest fidelity report (made at or before ``at_ms``) of each replica of ``cluster``
        (or of ``replica``): dicts with replica, created_ms, span, summary."""
        stmt = (select(Replica.name.label("replica"), FidelityReport.created_ms, FidelityReport.span,
                       FidelityReport.summary)
                .join(Replica, Replica.id == FidelityReport.replica_id).where(Replica.cluster == cluster))
        if replica is not None:
            stmt = stmt.where(Replica.name == replica)
        if at_ms is not None:
            stmt = stmt.where(FidelityReport.created_ms <= at_ms)
        stmt = stmt.order_by(FidelityReport.created_ms.desc(), FidelityReport.id.desc())
        newest: dict[str, dict[str, Any]] = {}
        with self._read() as conn:
            for row in conn.execute(stmt):
                newest.setdefault(row.replica, {k: row._mapping[k] for k in ("replica", "created_ms", "span", "summary")})
        return list(newest.values())

    def store_prediction(self, cluster: str, replica: str, summary: dict[str, Any], *, t_ms: int,
                         version: int | None = None) -> int:
        """Keep the prediction made for a change applied to ``replica`` at ``t_ms``; returns its id."""
        return self._insert_for_replica(Prediction, cluster, replica, t_ms,
                                        {"t_ms": t_ms, "version": version, "summary": summary})

    def _insert_for_replica(self, model: Any, cluster: str, replica: str, now_ms: int, row: dict[str, Any]) -> int:
        """Insert ``row`` into ``model``'s table for ``replica`` (registered if new); its id."""
        def txn(conn: Connection) -> int:
            rid = self._replica_ids_for(conn, cluster, {replica}, now_ms)[replica]
            return conn.execute(insert(model).returning(model.id), [{"replica_id": rid, **row}]).scalar_one()

        return self._write(txn)

    def governance(self, cluster: str, *, since_ms: int | None = None, until_ms: int | None = None,
                   limit: int | None = None) -> list[dict[str, Any]]:
        """Stored governance windows of ``cluster`` (``since_ms <= t_ms < until_ms``), newest
        first: dicts with t_ms and summary."""
        stmt = select(GovernanceWindow.t_ms, GovernanceWindow.summary).where(GovernanceWindow.cluster == cluster)
        return self._newest_first(stmt, GovernanceWindow, since_ms, until_ms, limit)

    def alert_events(self, cluster: str, *, since_ms: int | None = None, until_ms: int | None = None,
                     limit: int | None = None, name: str | None = None) -> list[dict[str, Any]]:
        """Alert transitions of ``cluster`` (of alert ``name``; ``since_ms <= t_ms < until_ms``),
        newest first: dicts with t_ms, name, severity, state and summary."""
        stmt = (select(AlertEvent.t_ms, AlertEvent.name, AlertEvent.severity, AlertEvent.state, AlertEvent.summary)
                .where(AlertEvent.cluster == cluster))
        if name is not None:
            stmt = stmt.where(AlertEvent.name == name)
        return self._newest_first(stmt, AlertEvent, since_ms, until_ms, limit)

    def _newest_first(self, stmt: Any, model: Any, since_ms: int | None, until_ms: int | None,
                      limit: int | None) -> list[dict[str, Any]]:
        """The rows of ``stmt`` on a cluster-level table (t_ms, id) in ``[since_ms, until_ms)``,
        newest first, at most ``limit``, as dicts."""
        stmt = _in_range(stmt, model.t_ms, since_ms, until_ms).order_by(model.t_ms.desc(), model.id.desc())
        if limit is not None:
            stmt = stmt.limit(limit)
        with self._read() as conn:
            return [dict(row._mapping) for row in conn.execute(stmt)]

    def firing_alerts(self, cluster: str, *, at_ms: int | None = None) -> list[dict[str, Any]]:
        """The alerts firing at ``at_ms`` (default: now): each alert's newest transition at or
        before it, where that is "firing"."""
        until = None if at_ms is None else at_ms + 1
        with self._read() as conn:
            names = conn.execute(select(AlertEvent.name).where(AlertEvent.cluster == cluster).distinct()).scalars().all()
        newest = [self.alert_events(cluster, until_ms=until, limit=1, name=n) for n in sorted(names)]
        return [e[0] for e in newest if e and e[0]["state"] == "firing"]

    GOVERNOR_DEFAULT = {"state": "dry-run", "paused": False, "who": None, "updated_ms": None, "status": None}
    CONTROL_STATES = ("armed", "dry-run", "disarmed")

    def governor_control(self, cluster: str) -> dict[str, Any]:
        """The cluster's governor control row (state, paused, who, updated_ms, status); the
        default (dry-run, not paused) when none was written."""
        return self._control_row(GovernorControl, cluster)

    def set_governor_control(self, cluster: str, *, state: str | None = None, paused: bool | None = None,
                             status: dict[str, Any] | None = None, who: str | None = None,
                             t_ms: int | None = None) -> dict[str, Any]:
        """Change the governor's state (``armed`` | ``dry-run`` | ``disarmed``), pause flag or
        status (what is not given is kept); returns the row."""
        return self._set_control_row(GovernorControl, "governor", cluster, state=state, paused=paused,
                                     status=status, who=who, t_ms=t_ms)

    def autopilot_control(self, cluster: str) -> dict[str, Any]:
        """The cluster's autopilot control row, shaped as the governor's (state, paused, who,
        updated_ms, status: the autopilot's own report per replica); dry-run by default."""
        return self._control_row(AutopilotControl, cluster)

    def set_autopilot_control(self, cluster: str, *, state: str | None = None, paused: bool | None = None,
                              status: dict[str, Any] | None = None, who: str | None = None,
                              t_ms: int | None = None) -> dict[str, Any]:
        """Change the autopilot's state (``armed`` | ``dry-run`` | ``disarmed``), pause flag or
        status (what is not given is kept); returns the row."""
        return self._set_control_row(AutopilotControl, "autopilot", cluster, state=state, paused=paused,
                                     status=status, who=who, t_ms=t_ms)

    def _control_row(self, model: type[GovernorControl] | type[AutopilotControl], cluster: str) -> dict[str, Any]:
        stmt = select(model.__table__).where(model.cluster == cluster)
        with self._read() as conn:
            row = conn.execute(stmt).first()
        if row is None:
            return {"cluster": cluster, **self.GOVERNOR_DEFAULT}
        return dict(row._mapping)

    def _set_control_row(self, model: type[GovernorControl] | type[AutopilotControl], what: str, cluster: str, *, state: str | None,
                         paused: bool | None, status: dict[str, Any] | None, who: str | None,
                         t_ms: int | None) -> dict[str, Any]:
        if state is not None and state not in self.CONTROL_STATES:
            raise ValueError(f"{what} state must be armed, dry-run or disarmed, got {state!r}")
        now = self._now_ms() if t_ms is None else t_ms

        given: dict[str, Any] = {"updated_ms": now}
        if state is not None:
            given["state"] = state
        if paused is not None:
            given["paused"] = paused
        if status is not None:
            given["status"] = status
        if who is not None and (state is not None or paused is not None):
            given["who"] = who

        def txn(conn: Connection) -> None:
            # Only the columns given are written: a controller's status every second never puts
            # back a state an operator has just changed.
            doc = {**self.GOVERNOR_DEFAULT, **given, "cluster": cluster}
            conn.execute(insert_or_update(conn, table(model), ["cluster"], list(given)), [doc])

        self._write(txn)
        return self._control_row(model, cluster)

    def predictions(self, cluster: str, replica: str | None = None) -> list[dict[str, Any]]:
        """Kept predictions, newest first: dicts with id, cluster, replica, t_ms, version, summary."""
        stmt = (select(Prediction.id, Replica.cluster, Replica.name.label("replica"), Prediction.t_ms,
                       Prediction.version, Prediction.summary)
                .join(Replica, Replica.id == Prediction.replica_id).where(Replica.cluster == cluster))
        if replica is not None:
            stmt = stmt.where(Replica.name == replica)
        stmt = stmt.order_by(Prediction.t_ms.desc(), Prediction.id.desc())
        with self._read() as conn:
            return [dict(row._mapping) for row in conn.execute(stmt)]

    def apply_retention(self, now_ms: int, settings: RetentionSettings) -> RetentionReport:
        """Fold old samples into 1-minute rollups and delete old completions (see storage.retention).

        Each step is its own transaction, so the collector's writes can slip in between.
        """
        keep = settings.keep_recordings
        cut = ret.sample_cutoff_ms(now_ms, settings)
        samples = self._write(lambda c: ret.fold_samples(c, cut, now_ms, keep), snapshot=True)
        groups = self._write(lambda c: ret.fold_group_samples(c, cut, now_ms, keep), snapshot=True)
        cut_c = ret.completion_cutoff_ms(now_ms, settings)
        completions = self._write(lambda c: ret.delete_completions(c, cut_c, now_ms, keep))
        return RetentionReport(samples, groups, completions)

    # ------------------------------------------------------------------ read side

    def clusters(self) -> list[str]:
        with self._read() as conn:
            return list(conn.scalars(select(Replica.cluster).distinct().order_by(Replica.cluster)))

    def replicas(self, cluster: str) -> list[ReplicaInfo]:
        stmt = select(Replica.__table__).where(Replica.cluster == cluster).order_by(Replica.name)
        with self._read() as conn:
            return [
                ReplicaInfo(r.cluster, r.name, r.api_url, r.control_url, r.first_seen_ms, r.last_seen_ms)
                for r in conn.execute(stmt)
            ]

    def latest_samples(self, cluster: str, at_ms: int | None = None) -> dict[str, SampleRow]:
        """Replica name -> its newest sample at or before ``at_ms`` (default: newest of all).

        Replay seeks with this. One indexed ``ORDER BY t_ms DESC LIMIT 1`` lookup per replica (as a
        correlated subquery), so seeking costs the same at any point of a long history.
        """
        s = Sample.__table__.alias("newest")
        newest = select(s.c.id).where(s.c.replica_id == Replica.id)
        if at_ms is not None:
            newest = newest.where(s.c.t_ms <= at_ms)
        newest = newest.order_by(s.c.t_ms.desc(), s.c.id.desc()).limit(1).correlate(Replica)
        stmt = (
            select(Replica.name, Sample.__table__)
            .select_from(Replica.__table__)
            .join(Sample.__table__, Sample.id == newest.scalar_subquery())
            .where(Replica.cluster == cluster)
        )
        with self._read() as conn:
            return {row.name: _sample_row(row.name, row) for row in conn.execute(stmt)}

    def samples(
        self, cluster: str, replica: str, since_ms: int | None = None, until_ms: int | None = None
    ) -> list[SampleRow]:
        """A replica's raw samples with ``since_ms <= t_ms < until_ms``, oldest first."""
        stmt = self._of_replica(select(Sample.__table__), Sample, cluster, replica)
        stmt = _in_range(stmt, Sample.t_ms, since_ms, until_ms).order_by(Sample.t_ms, Sample.id)
        with self._read() as conn:
            return [_sample_row(replica, row) for row in conn.execute(stmt)]

    def group_samples(
        self,
        cluster: str,
        replica: str,
        since_ms: int | None = None,
        until_ms: int | None = None,
        kind: str | None = None,
    ) -> list[GroupSampleRow]:
        """A replica's per-tenant / per-type samples in ``[since_ms, until_ms)``, oldest first."""
        stmt = self._of_replica(select(GroupSample.__table__), GroupSample, cluster, replica)
        stmt = _in_range(stmt, GroupSample.t_ms, since_ms, until_ms)
        if kind is not None:
            stmt = stmt.where(GroupSample.kind == kind)
        stmt = stmt.order_by(GroupSample.t_ms, GroupSample.kind, GroupSample.group_name)
        with self._read() as conn:
            return [_group_sample_row(replica, row) for row in conn.execute(stmt)]

    def sample_rollups(
        self, cluster: str, replica: str, since_ms: int | None = None, until_ms: int | None = None
    ) -> list[dict[str, Any]]:
        """A replica's 1-minute rollups (see storage.retention) with ``minute_ms`` in the range, as dicts."""
        r = sample_rollups
        stmt = (
            select(r)
            .join(Replica.__table__, Replica.id == r.c.replica_id)
            .where(Replica.cluster == cluster, Replica.name == replica)
        )
        stmt = _in_range(stmt, r.c.minute_ms, since_ms, until_ms).order_by(r.c.minute_ms)
        with self._read() as conn:
            return [{k: v for k, v in row._mapping.items() if k != "replica_id"} for row in conn.execute(stmt)]

    def completions(
        self,
        cluster: str,
        replica: str | None = None,
        since_s: float | None = None,
        until_s: float | None = None,
        *,
        stored_since_ms: int | None = None,
        stored_until_ms: int | None = None,
    ) -> list[CompletionRow]:
        """Completions with ``since_s <= finished_s < until_s`` (replica clocks) and
        ``stored_since_ms <= stored_ms < stored_until_ms`` (the store's clock: what a recording
        spans), by finish time."""
        stmt = select(Replica.name, Completion.__table__).join(Replica, Replica.id == Completion.replica_id)
        stmt = stmt.where(Replica.cluster == cluster)
        if replica is not None:
            stmt = stmt.where(Replica.name == replica)
        stmt = _in_range(stmt, Completion.finished_s, since_s, until_s)
        stmt = _in_range(stmt, Completion.stored_ms, stored_since_ms, stored_until_ms)
        stmt = stmt.order_by(Completion.finished_s, Completion.id)
        with self._read() as conn:
            return [
                CompletionRow(replica=row.name, **{f: getattr(row, f) for f in COMPLETION_FIELDS})
                for row in conn.execute(stmt)
            ]

    def completion_stored_s(self, cluster: str, replica: str, request_ids: Sequence[str]) -> list[float]:
        """When the store received each of these completions of ``replica`` (its own clock, s)."""
        wanted = set(request_ids)
        stmt = (select(Completion.request_id, Completion.stored_ms).join(Replica, Replica.id == Completion.replica_id)
                .where(Replica.cluster == cluster, Replica.name == replica))
        with self._read() as conn:
            return [row.stored_ms / 1000.0 for row in conn.execute(stmt) if row.request_id in wanted]

    def time_range(self, cluster: str) -> tuple[int, int] | None:
        """(first, last) sample time of ``cluster`` in ms, rollups included; None if it has none."""
        sources = ((Sample.t_ms, Sample.replica_id), (sample_rollups.c.minute_ms, sample_rollups.c.replica_id))
        bounds = [
            select(func.min(t), func.max(t)).join(Replica, Replica.id == rid).where(Replica.cluster == cluster)
            for t, rid in sources
        ]
        with self._read() as conn:
            found = [tuple(conn.execute(stmt).one()) for stmt in bounds]
        found = [(lo, hi) for lo, hi in found if lo is not None]
        if not found:
            return None
        return min(lo for lo, _ in found), max(hi for _, hi in found)

    def settings_changes(self, cluster: str, replica: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
        """The settings audit log, newest first: dicts with t_ms, cluster, replica, who, old, new, result,
        message, version."""
        stmt = select(Replica.cluster, Replica.name.label("replica"), SettingsChange.__table__)
        stmt = stmt.join(Replica, Replica.id == SettingsChange.replica_id).where(Replica.cluster == cluster)
        if replica is not None:
            stmt = stmt.where(Replica.name == replica)
        stmt = stmt.order_by(SettingsChange.t_ms.desc(), SettingsChange.id.desc()).limit(limit)
        keys = ("t_ms", "cluster", "replica", "who", "old", "new", "result", "message", "version")
        with self._read() as conn:
            return [{k: row._mapping[k] for k in keys} for row in conn.execute(stmt)]

    def settings_seen(self, cluster: str, replica: str | None = None) -> list[dict[str, Any]]:
        """The settings documents replicas ran, oldest first: dicts with t_ms, replica, instance,
        version, settings (one per new version or instance the collector saw)."""
        stmt = select(Replica.name.label("replica"), SettingsSeen.t_ms, SettingsSeen.instance, SettingsSeen.version,
                      SettingsSeen.settings)
        stmt = stmt.join(Replica, Replica.id == SettingsSeen.replica_id).where(Replica.cluster == cluster)
        if replica is not None:
            stmt = stmt.where(Replica.name == replica)
        stmt = stmt.order_by(SettingsSeen.t_ms, SettingsSeen.id)
        with self._read() as conn:
            return [dict(row._mapping) for row in conn.execute(stmt)]

    def recordings(self, cluster: str | None = None) -> list[RecordingInfo]:
        """All recordings (of ``cluster``), oldest first."""
        stmt = select(Recording.__table__).order_by(Recording.started_ms, Recording.id)
        if cluster is not None:
            stmt = stmt.where(Recording.cluster == cluster)
        with self._read() as conn:
            return [RecordingInfo(**row._mapping) for row in conn.execute(stmt)]

    def latest_recommendation(self, study: str | None = None) -> RecommendationInfo | None:
        """The newest stored recommendation (of ``study``), or None."""
        stmt = select(Recommendation.__table__).order_by(Recommendation.created_ms.desc(), Recommendation.id.desc())
        if study is not None:
            stmt = stmt.where(Recommendation.study == study)
        with self._read() as conn:
            row = conn.execute(stmt.limit(1)).first()
        return None if row is None else RecommendationInfo(**row._mapping)

    # ------------------------------------------------------------------ plumbing

    def _now_ms(self) -> int:
        return int(self._clock() * 1000)

    @contextmanager
    def _read(self) -> Iterator[Connection]:
        """A connection in a (deferred, read) transaction, so a read sees one consistent snapshot.

        Raises :class:`StoreCorrupt` for a damaged file: opening reads only the schema and the
        migration version, so damage elsewhere shows up at the first read that touches it.
        """
        try:
            with self.engine.connect() as conn, conn.begin():
                yield conn
        except DBAPIError as exc:
            self._raise_if_damaged(exc)
            raise

    def _write(self, txn: Callable[[Connection], T], *, snapshot: bool = False) -> T:
        """Run ``txn`` in one write transaction, retrying it whole while the database is busy.

        SQLite: ``BEGIN IMMEDIATE`` takes the write lock first, so the transaction either gets it
        (waiting up to ``busy_timeout`` inside SQLite) or fails before doing anything. PostgreSQL
        never reports SQLite's "locked", but a serialization failure or deadlock is retried the
        same way. ``snapshot``: on PostgreSQL, run at REPEATABLE READ so a statement pair (fold,
        then delete) sees the same rows.
        """
        deadline = time.monotonic() + self.write_deadline_s
        delays = backoff_delays(0.02, 1.0)
        while True:
            try:
                with self._write_connection(snapshot) as conn, conn.begin():
                    return txn(conn)
            except DBAPIError as exc:
                if not _is_retryable(exc):
                    self._raise_if_damaged(exc)
                    failure = _write_failure(exc)
                    error = StoreFull if failure == _FULL else StoreWriteError
                    raise error(f"cannot write to {_where(self.engine.url)}: {failure}; nothing of this "
                                "write was stored (what was stored before is intact)") from None
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StoreBusy(
                        f"{engines.redact(self.engine.url)} stayed locked for {self.write_deadline_s:g} s; "
                        f"nothing was written ({exc.orig})"
                    ) from exc
                self.busy_retries += 1
                time.sleep(min(left, next(delays)))
            except (OverflowError, UnicodeEncodeError) as exc:  # the driver could not bind a value
                raise StoreWriteError(f"cannot write to {_where(self.engine.url)}: a value no column can hold "
                                      f"({type(exc).__name__}); nothing of this write was stored") from None

    def _raise_if_damaged(self, exc: DBAPIError) -> None:
        """Raise :class:`StoreCorrupt`, naming the file, if ``exc`` says the database file is damaged."""
        damage = _damage(exc)
        if damage is not None:
            raise StoreCorrupt(f"{_where(self.engine.url)}: {damage}") from exc

    def _write_connection(self, snapshot: bool) -> Connection:
        conn = self.engine.connect().execution_options(sqlite_immediate=True)
        if snapshot and conn.dialect.name == "postgresql":
            conn = conn.execution_options(isolation_level="REPEATABLE READ")
        return conn

    def _remember(self, cluster: str, ids: dict[str, int]) -> None:
        for name, rid in ids.items():
            self._replica_ids[(cluster, name)] = rid

    def _replica_ids_for(self, conn: Connection, cluster: str, names: set[str], now_ms: int) -> dict[str, int]:
        """Replica ids for ``names``: from the cache, else looked up, else created (URLs unknown)."""
        ids = {n: self._replica_ids[(cluster, n)] for n in names if (cluster, n) in self._replica_ids}
        missing = names - ids.keys()
        if missing:
            rows = [{"cluster": cluster, "name": n, "first_seen_ms": now_ms} for n in sorted(missing)]
            conn.execute(insert_ignoring(conn, table(Replica), ["cluster", "name"]), rows)
            ids.update(self._lookup_replica_ids(conn, cluster, missing))
        return ids

    @staticmethod
    def _lookup_replica_ids(conn: Connection, cluster: str, names: set[str]) -> dict[str, int]:
        stmt = select(Replica.name, Replica.id).where(Replica.cluster == cluster, Replica.name.in_(names))
        return {name: rid for name, rid in conn.execute(stmt)}

    @staticmethod
    def _of_replica(stmt: Any, model: Any, cluster: str, replica: str) -> Any:
        return stmt.join(Replica, Replica.id == model.replica_id).where(
            Replica.cluster == cluster, Replica.name == replica
        )

    @staticmethod
    def _insert_samples(conn: Connection, rows: Sequence[SampleRow], ids: dict[str, int]) -> None:
        if rows:
            conn.execute(insert(Sample), [_sample_params(r, ids[r.replica]) for r in rows])

    @staticmethod
    def _insert_group_samples(conn: Connection, rows: Sequence[GroupSampleRow], ids: dict[str, int]) -> None:
        if rows:
            conn.execute(insert(GroupSample), [_group_sample_params(r, ids[r.replica]) for r in rows])

    @staticmethod
    def _insert_completions(conn: Connection, rows: Sequence[CompletionRow], ids: dict[str, int], now_ms: int) -> None:
        """Insert completions; one already stored (same replica and request id) is silently skipped."""
        if not rows:
            return
        params = [
            {
                "replica_id": ids[c.replica],
                "request_id": c.request_id,
                "tenant": c.tenant,
                "type": c.type,
                "arrival_s": c.arrival_s,
                "first_token_s": _finite_or_none(c.first_token_s),
                "finished_s": c.finished_s,
                "prompt_tokens": c.prompt_tokens,
                "output_tokens": c.output_tokens,
                "preemptions": c.preemptions,
                "recomputed_tokens": c.recomputed_tokens,
                "reason": c.reason,
                "max_tokens": c.max_tokens,
                "received_s": _finite_or_none(c.received_s),
                "stored_ms": now_ms,
            }
            for c in rows
        ]
        conn.execute(insert_ignoring(conn, table(Completion), ["replica_id", "request_id"]), params)

    @staticmethod
    def _upsert_cursors(conn: Connection, cursors: dict[str, int], instances: dict[str, str], ids: dict[str, int],
                        now_ms: int) -> None:
        if cursors:
            params = [{"replica_id": ids[n], "cursor": c, "updated_ms": now_ms, "instance": instances.get(n)}
                      for n, c in cursors.items()]
            stmt = insert_or_update(conn, table(CollectorCursor), ["replica_id"],
                                    ["cursor", "updated_ms", "instance"])
            conn.execute(stmt, params)

    @staticmethod
    def _insert_settings_seen(conn: Connection, rows: Sequence[SettingsSeenRow], ids: dict[str, int]) -> None:
        if rows:
            conn.execute(insert(table(SettingsSeen)), [
                {"replica_id": ids[r.replica], "t_ms": r.t_ms, "instance": r.instance, "version": r.version,
                 "settings": r.settings} for r in rows])

    @staticmethod
    def _insert_settings_changes(conn: Connection, rows: Sequence[SettingsChangeRow], ids: dict[str, int]) -> None:
        if rows:
            conn.execute(insert(SettingsChange), [
                {"replica_id": ids[r.replica], "t_ms": r.t_ms, "who": r.who, "old": r.old, "new": r.new,
                 "result": r.result, "message": r.message, "version": r.version} for r in rows])

    @staticmethod
    def _touch_last_seen(conn: Connection, rows: Sequence[SampleRow], ids: dict[str, int]) -> None:
        """Advance ``replicas.last_seen_ms`` to the newest healthy sample (never backwards)."""
        newest: dict[str, int] = {}
        for r in rows:
            if r.healthy and r.t_ms > newest.get(r.replica, -1):
                newest[r.replica] = r.t_ms
        for name, t_ms in newest.items():
            later = case(
                (Replica.last_seen_ms.is_(None) | (Replica.last_seen_ms < t_ms), t_ms), else_=Replica.last_seen_ms
            )
            conn.execute(update(Replica).where(Replica.id == ids[name]).values(last_seen_ms=later))


# ---------------------------------------------------------------------- helpers


def _parse_url(url: str | None) -> URL:
    try:
        return engines.normalize_url(url)
    except Exception as exc:  # a malformed URL: the exception text may hold the password
        raise StoreOpenError(f"cannot open store at {engines.redact(url)}: not a valid database URL "
                             f"({type(exc).__name__})") from None  # fmt: skip


def _where(url: URL) -> str:
    """The database as messages name it: a SQLite file's path, else the URL without its password."""
    if engines.is_sqlite(url) and url.database not in (None, "", ":memory:"):
        return url.database
    return engines.redact(url)


# SQLite's primary result codes for a damaged file and for a file that is no database at all.
_SQLITE_CORRUPT, _SQLITE_NOTADB = 11, 26


def _damage(exc: DBAPIError) -> str | None:
    """What is wrong with the file if ``exc`` reports a damaged or foreign database file, else None."""
    code = getattr(exc.orig, "sqlite_errorcode", None)
    if code is None:
        return None
    if code & 0xFF == _SQLITE_NOTADB:
        return f"not a SQLite database ({exc.orig})"
    if code & 0xFF == _SQLITE_CORRUPT:
        return f"the database file is damaged ({exc.orig})"
    return None


def _reason(exc: Exception, url: URL) -> str:
    """The driver's own words for why opening failed, without the password."""
    if isinstance(exc, DBAPIError) and (damage := _damage(exc)) is not None:
        return damage
    text = str(exc.orig) if isinstance(exc, DBAPIError) else str(exc)
    text = " ".join(text.split())
    if url.password:
        text = text.replace(str(url.password), "***")
    return text or type(exc).__name__


_SQLITE_FULL = 13  # SQLite's primary result code for "database or disk is full"
_PG_DISK_FULL = "53100"  # PostgreSQL's SQLSTATE disk_full
_FULL = "the database or its disk is full"


def _write_failure(exc: DBAPIError) -> str:
    """What failed, in words that hold no SQL and no row values (one line)."""
    orig = exc.orig
    code = getattr(orig, "sqlite_errorcode", None)
    if code is not None:
        if code & 0xFF == _SQLITE_FULL:
            return _FULL
        # SQLite's own words name a constraint or a condition, never a value.
        return (str(orig).splitlines() or [type(orig).__name__])[0]
    sqlstate = getattr(orig, "sqlstate", None)
    if sqlstate == _PG_DISK_FULL:
        return _FULL
    # PostgreSQL's messages may quote the value refused: its error class and code only.
    return f"{type(orig).__name__} (SQLSTATE {sqlstate})" if sqlstate else type(orig).__name__


def _is_retryable(exc: DBAPIError) -> bool:
    """SQLite's "database is locked" / "busy"; PostgreSQL's serialization failure and deadlock."""
    orig = exc.orig
    if isinstance(orig, sqlite3.OperationalError):
        text = str(orig).lower()
        return "locked" in text or "busy" in text
    return getattr(orig, "sqlstate", None) in ("40001", "40P01")


def _replica_names(batch: Batch) -> set[str]:
    names = {r.replica for r in batch.samples}
    names.update(r.replica for r in batch.group_samples)
    names.update(r.replica for r in batch.completions)
    names.update(batch.cursors)
    names.update(r.replica for r in batch.settings_seen)
    names.update(r.replica for r in batch.settings_changes)
    return names


def _in_range(stmt: Any, col: Any, lo: float | None, hi: float | None) -> Any:
    """``lo <= col < hi``, either bound optional: half-open, so consecutive ranges never overlap."""
    if lo is not None:
        stmt = stmt.where(col >= lo)
    if hi is not None:
        stmt = stmt.where(col < hi)
    return stmt


def _latency_of(row: Row[Any]) -> LatencyPercentiles:
    return LatencyPercentiles(**{f: getattr(row, f) for f in PERCENTILE_FIELDS})


# Row -> values in C (operator.attrgetter): cheaper than a getattr per field on the ingest path.
_sample_values = attrgetter(*SAMPLE_FIELDS)
_sample_floats = attrgetter(*SAMPLE_FLOAT_FIELDS)
_latency_values = attrgetter(*PERCENTILE_FIELDS)
# The float columns of samples and group_samples: all nullable.
_SAMPLE_FLOAT_COLUMNS: tuple[str, ...] = SAMPLE_FLOAT_FIELDS + PERCENTILE_FIELDS
_GROUP_FLOAT_COLUMNS: tuple[str, ...] = ("throughput_tok_s", *PERCENTILE_FIELDS)


def _finite_or_none(value: float | None) -> float | None:
    """NaN and ±inf as None: a nullable float column stores them as NULL, which every reader understands."""
    return value if value is None or math.isfinite(value) else None


def _all_finite(values: tuple[Any, ...], also: float | None = None) -> bool:
    """No NaN or ±inf among ``values`` and ``also`` (None allowed). False may also mean an overflow."""
    # One pass in C: a sum is finite only if every term is; an overflow merely takes the slow path.
    return math.isfinite(sum(filter(None, values), also or 0.0))


def _null_non_finite(params: dict[str, Any], floats: tuple[str, ...]) -> None:
    """Replace NaN and ±inf in the ``floats`` columns of ``params`` by None."""
    for f in floats:
        params[f] = _finite_or_none(params[f])


def _sample_params(r: SampleRow, replica_id: int) -> dict[str, Any]:
    latency = _latency_values(r.latency)
    params = dict(zip(SAMPLE_FIELDS, _sample_values(r)), replica_id=replica_id)
    params.update(zip(PERCENTILE_FIELDS, latency))
    if not _all_finite(_sample_floats(r) + latency):
        _null_non_finite(params, _SAMPLE_FLOAT_COLUMNS)
    return params


def _sample_row(replica: str, row: Row[Any]) -> SampleRow:
    fields = {f: getattr(row, f) for f in SAMPLE_FIELDS}
    fields["healthy"] = bool(fields["healthy"])
    return SampleRow(replica=replica, latency=_latency_of(row), **fields)


def _group_sample_params(r: GroupSampleRow, replica_id: int) -> dict[str, Any]:
    latency = _latency_values(r.latency)
    params = {"replica_id": replica_id, "t_ms": r.t_ms, "kind": r.kind, "group_name": r.group,
              "completed": r.completed, "throughput_tok_s": r.throughput_tok_s}  # fmt: skip
    params.update(zip(PERCENTILE_FIELDS, latency))
    if not _all_finite(latency, r.throughput_tok_s):
        _null_non_finite(params, _GROUP_FLOAT_COLUMNS)
    return params


def _group_sample_row(replica: str, row: Row[Any]) -> GroupSampleRow:
    return GroupSampleRow(replica=replica, t_ms=row.t_ms, kind=row.kind, group=row.group_name,
                          completed=row.completed, throughput_tok_s=row.throughput_tok_s,
                          latency=_latency_of(row))  # fmt: skip


__all__ = [
    "RecommendationInfo",
    "RecordingInfo",
    "ReplicaInfo",
    "RetentionReport",
    "RetentionSettings",
    "Store",
    "StoreBusy",
    "StoreCorrupt",
    "StoreError",
    "StoreFull",
    "StoreOpenError",
    "StoreWriteError",
]

"""``RecordingRepository``: what the collector records of a cluster, where it resumes, and what is
recorded.

Write side (the collector): ``ensure_replicas``, then ``write(cluster, batch)`` per flush. A batch
is written in ONE transaction with Core ``executemany`` inserts — no ORM unit of work on the hot
path — and carries the replicas' control-API cursors, upserted in the same transaction. Completions
are unique per (replica, request_id) and inserted with ``ON CONFLICT DO NOTHING``. Together these
make a ``kill -9`` at any moment harmless: either the batch and its cursors are stored, or neither
is and the collector re-reads the same completions from the old cursor; re-reading ones already
stored is a no-op. Rows must fit the columns (``storage.limits``: the collector fits every entry a
replica sends before queuing it).

A restarted collector resumes from ``cursor_positions`` and ``breaker_positions``. Named recordings
(``begin_recording`` / ``end_recording``) mark spans that retention keeps; ``clusters``,
``replicas`` and ``time_range`` say what there is to replay.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from sqlalchemy import Connection, case, func, insert, select, update

from storage.columns import completion_params, group_sample_params, sample_params
from storage.database import Database
from storage.models import (
    AlertEvent,
    CollectorCursor,
    Completion,
    GovernanceWindow,
    GroupSample,
    Recording,
    Replica,
    Sample,
    SettingsChange,
    SettingsSeen,
    sample_rollups,
    table,
)
from storage.replica_registry import ReplicaRegistry
from storage.rows import (
    BREAKER_RESULT,
    BREAKER_WHO,
    Batch,
    CompletionRow,
    GroupSampleRow,
    SampleRow,
    SettingsChangeRow,
    SettingsSeenRow,
)
from storage.sql import insert_ignoring, insert_or_update


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


class RecordingRepository:
    """The collector's batches and cursors, named recordings, and the catalog of clusters and
    replicas."""

    def __init__(self, database: Database, replica_ids: ReplicaRegistry) -> None:
        self.database = database
        self.replica_ids = replica_ids

    # ------------------------------------------------------------------ the collector's writes

    def ensure_replicas(self, cluster: str, replicas: Iterable[tuple[str, str, str]]) -> None:
        """Register (name, api_url, control_url) replicas of ``cluster``; updates the URLs of known
        ones."""
        now = self.database.now_ms()
        params = [
            {
                "cluster": cluster,
                "name": name,
                "api_url": api,
                "control_url": ctl,
                "first_seen_ms": now,
            }
            for name, api, ctl in replicas
        ]
        if not params:
            return

        def txn(conn: Connection) -> dict[str, int]:
            conn.execute(
                insert_or_update(
                    conn, table(Replica), ["cluster", "name"], ["api_url", "control_url"]
                ),
                params,
            )
            return self.replica_ids.lookup(conn, cluster, {str(p["name"]) for p in params})

        self.replica_ids.write(cluster, txn)

    def write(self, cluster: str, batch: Batch) -> None:
        """Store one collector flush atomically (see the module docstring).

        Raises:
            StoreBusy: the database stayed locked; nothing was written, keep the batch and retry.
        """
        names = _replica_names(batch)
        if not names and not batch.governance and not batch.alerts:
            return
        now = self.database.now_ms()

        def txn(conn: Connection) -> dict[str, int]:
            if batch.governance:
                conn.execute(
                    insert(GovernanceWindow),
                    [
                        {"cluster": cluster, "t_ms": g.t_ms, "summary": g.summary}
                        for g in batch.governance
                    ],
                )
            if batch.alerts:
                conn.execute(
                    insert(AlertEvent),
                    [
                        {
                            "cluster": cluster,
                            "t_ms": a.t_ms,
                            "name": a.name,
                            "severity": a.severity,
                            "state": a.state,
                            "summary": a.summary,
                        }
                        for a in batch.alerts
                    ],
                )
            if not names:
                return {}
            ids = self.replica_ids.ids_for(conn, cluster, names, now)
            _insert_samples(conn, batch.samples, ids)
            _insert_group_samples(conn, batch.group_samples, ids)
            _insert_completions(conn, batch.completions, ids, now)
            _upsert_cursors(conn, batch.cursors, batch.instances, ids, now)
            _insert_settings_seen(conn, batch.settings_seen, ids)
            _insert_settings_changes(conn, batch.settings_changes, ids)
            _touch_last_seen(conn, batch.samples, ids)
            return ids

        self.replica_ids.write(cluster, txn)

    # ------------------------------------------------------------------ where the collector resumes

    def cursors(self, cluster: str) -> dict[str, int]:
        """Replica name -> the control-API cursor stored with that replica's newest completions."""
        return {name: cursor for name, (cursor, _) in self.cursor_positions(cluster).items()}

    def cursor_positions(self, cluster: str) -> dict[str, tuple[int, str | None]]:
        """Replica name -> (stored cursor, the replica instance it counts in or None if
        unreported)."""
        stmt = (
            select(Replica.name, CollectorCursor.cursor, CollectorCursor.instance)
            .join(CollectorCursor, CollectorCursor.replica_id == Replica.id)
            .where(Replica.cluster == cluster)
        )
        with self.database.read() as conn:
            return {name: (cursor, instance) for name, cursor, instance in conn.execute(stmt)}

    def breaker_positions(self, cluster: str) -> dict[str, tuple[str | None, int]]:
        """Replica name -> (instance, trips) of the newest circuit-breaker trip stored for it: the
        collector writes one audit row per trip it sees, and starts from these so a restart writes
        none twice."""
        stmt = (
            select(Replica.name, SettingsChange.new)
            .join(Replica, Replica.id == SettingsChange.replica_id)
            .where(
                Replica.cluster == cluster,
                SettingsChange.who == BREAKER_WHO,
                SettingsChange.result == BREAKER_RESULT,
            )
            .order_by(SettingsChange.t_ms.desc(), SettingsChange.id.desc())
        )
        newest: dict[str, tuple[str | None, int]] = {}
        with self.database.read() as conn:
            for name, new in conn.execute(stmt):
                if (
                    name not in newest
                    and isinstance(new, dict)
                    and isinstance(new.get("trips_total"), int)
                ):
                    instance = new.get("instance")
                    newest[name] = (
                        instance if isinstance(instance, str) else None,
                        new["trips_total"],
                    )
        return newest

    # ------------------------------------------------------------------ named recordings

    def begin_recording(
        self, cluster: str, name: str, note: str | None = None, *, t_ms: int | None = None
    ) -> int:
        """Start a named recording of ``cluster`` now (or at ``t_ms``); returns its id."""
        row = {"cluster": cluster, "name": name, "note": note,
               "started_ms": self.database.now_ms() if t_ms is None else t_ms}  # fmt: skip
        return self.database.write(
            lambda conn: conn.execute(insert(Recording).returning(Recording.id), [row]).scalar_one()
        )

    def end_recording(self, recording_id: int, *, t_ms: int | None = None) -> None:
        """End a recording now (or at ``t_ms``).

        Raises:
            KeyError: there is no such recording.
        """
        end = self.database.now_ms() if t_ms is None else t_ms
        stmt = update(Recording).where(Recording.id == recording_id).values(ended_ms=end)
        if self.database.write(lambda conn: conn.execute(stmt).rowcount) == 0:
            raise KeyError(f"no recording with id {recording_id}")

    def all(self, cluster: str | None = None) -> list[RecordingInfo]:
        """All recordings (of ``cluster``), oldest first."""
        stmt = select(Recording.__table__).order_by(Recording.started_ms, Recording.id)
        if cluster is not None:
            stmt = stmt.where(Recording.cluster == cluster)
        with self.database.read() as conn:
            return [RecordingInfo(**row._mapping) for row in conn.execute(stmt)]

    # ------------------------------------------------------------------ what there is

    def clusters(self) -> list[str]:
        """The names of the clusters with a replica stored, sorted."""
        with self.database.read() as conn:
            return list(conn.scalars(select(Replica.cluster).distinct().order_by(Replica.cluster)))

    def replicas(self, cluster: str) -> list[ReplicaInfo]:
        """The replicas of ``cluster``, by name."""
        stmt = select(Replica.__table__).where(Replica.cluster == cluster).order_by(Replica.name)
        with self.database.read() as conn:
            return [
                ReplicaInfo(
                    r.cluster, r.name, r.api_url, r.control_url, r.first_seen_ms, r.last_seen_ms
                )
                for r in conn.execute(stmt)
            ]

    def time_range(self, cluster: str) -> tuple[int, int] | None:
        """(first, last) sample time of ``cluster`` in ms, rollups included; None if it has none."""
        sources = (
            (Sample.t_ms, Sample.replica_id),
            (sample_rollups.c.minute_ms, sample_rollups.c.replica_id),
        )
        bounds = [
            select(func.min(t), func.max(t))
            .join(Replica, Replica.id == rid)
            .where(Replica.cluster == cluster)
            for t, rid in sources
        ]
        with self.database.read() as conn:
            found = [tuple(conn.execute(stmt).one()) for stmt in bounds]
        found = [(lo, hi) for lo, hi in found if lo is not None]
        if not found:
            return None
        return min(lo for lo, _ in found), max(hi for _, hi in found)


# ---------------------------------------------------------------------- one batch's statements


def _replica_names(batch: Batch) -> set[str]:
    names = {r.replica for r in batch.samples}
    names.update(r.replica for r in batch.group_samples)
    names.update(r.replica for r in batch.completions)
    names.update(batch.cursors)
    names.update(r.replica for r in batch.settings_seen)
    names.update(r.replica for r in batch.settings_changes)
    return names


def _insert_samples(conn: Connection, rows: Sequence[SampleRow], ids: dict[str, int]) -> None:
    if rows:
        conn.execute(insert(Sample), [sample_params(r, ids[r.replica]) for r in rows])


def _insert_group_samples(
    conn: Connection, rows: Sequence[GroupSampleRow], ids: dict[str, int]
) -> None:
    if rows:
        conn.execute(insert(GroupSample), [group_sample_params(r, ids[r.replica]) for r in rows])


def _insert_completions(
    conn: Connection, rows: Sequence[CompletionRow], ids: dict[str, int], now_ms: int
) -> None:
    """Insert completions; one already stored (same replica and request id) is silently skipped."""
    if rows:
        params = [completion_params(c, ids[c.replica], now_ms) for c in rows]
        conn.execute(insert_ignoring(conn, table(Completion), ["replica_id", "request_id"]), params)


def _upsert_cursors(
    conn: Connection,
    cursors: dict[str, int],
    instances: dict[str, str],
    ids: dict[str, int],
    now_ms: int,
) -> None:
    if cursors:
        params = [
            {"replica_id": ids[n], "cursor": c, "updated_ms": now_ms, "instance": instances.get(n)}
            for n, c in cursors.items()
        ]
        stmt = insert_or_update(
            conn, table(CollectorCursor), ["replica_id"], ["cursor", "updated_ms", "instance"]
        )
        conn.execute(stmt, params)


def _insert_settings_seen(
    conn: Connection, rows: Sequence[SettingsSeenRow], ids: dict[str, int]
) -> None:
    if rows:
        conn.execute(
            insert(table(SettingsSeen)),
            [
                {
                    "replica_id": ids[r.replica],
                    "t_ms": r.t_ms,
                    "instance": r.instance,
                    "version": r.version,
                    "settings": r.settings,
                }
                for r in rows
            ],
        )


def _insert_settings_changes(
    conn: Connection, rows: Sequence[SettingsChangeRow], ids: dict[str, int]
) -> None:
    if rows:
        conn.execute(
            insert(SettingsChange),
            [
                {
                    "replica_id": ids[r.replica],
                    "t_ms": r.t_ms,
                    "who": r.who,
                    "old": r.old,
                    "new": r.new,
                    "result": r.result,
                    "message": r.message,
                    "version": r.version,
                }
                for r in rows
            ],
        )


def _touch_last_seen(conn: Connection, rows: Sequence[SampleRow], ids: dict[str, int]) -> None:
    """Advance ``replicas.last_seen_ms`` to the newest healthy sample (never backwards)."""
    newest: dict[str, int] = {}
    for r in rows:
        if r.healthy and r.t_ms > newest.get(r.replica, -1):
            newest[r.replica] = r.t_ms
    for name, t_ms in newest.items():
        later = case(
            (Replica.last_seen_ms.is_(None) | (Replica.last_seen_ms < t_ms), t_ms),
            else_=Replica.last_seen_ms,
        )
        conn.execute(update(Replica).where(Replica.id == ids[name]).values(last_seen_ms=later))

"""``ReadingRepository``: what the collector stored of each replica, read back.

Samples (raw and 1-minute rollups), per-tenant / per-type group samples and completions, for the
TUI, replay, ``tailpilot status`` and the tuner. Methods return plain dataclasses (``SampleRow``,
``CompletionRow``, ... from :mod:`storage.rows`) and dicts — never ORM objects tied to a session.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import select

from storage.columns import completion_row, group_sample_row, sample_row
from storage.database import Database
from storage.models import Completion, GroupSample, Replica, Sample, sample_rollups
from storage.rows import CompletionRow, GroupSampleRow, SampleRow
from storage.sql import in_range


class ReadingRepository:
    """Samples, rollups and completions of a cluster's replicas."""

    def __init__(self, database: Database) -> None:
        self.database = database

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
        with self.database.read() as conn:
            return {row.name: sample_row(row.name, row) for row in conn.execute(stmt)}

    def samples(
        self, cluster: str, replica: str, since_ms: int | None = None, until_ms: int | None = None
    ) -> list[SampleRow]:
        """A replica's raw samples with ``since_ms <= t_ms < until_ms``, oldest first."""
        stmt = _of_replica(select(Sample.__table__), Sample, cluster, replica)
        stmt = in_range(stmt, Sample.t_ms, since_ms, until_ms).order_by(Sample.t_ms, Sample.id)
        with self.database.read() as conn:
            return [sample_row(replica, row) for row in conn.execute(stmt)]

    def group_samples(
        self,
        cluster: str,
        replica: str,
        since_ms: int | None = None,
        until_ms: int | None = None,
        kind: str | None = None,
    ) -> list[GroupSampleRow]:
        """A replica's per-tenant / per-type samples in ``[since_ms, until_ms)``, oldest first."""
        stmt = _of_replica(select(GroupSample.__table__), GroupSample, cluster, replica)
        stmt = in_range(stmt, GroupSample.t_ms, since_ms, until_ms)
        if kind is not None:
            stmt = stmt.where(GroupSample.kind == kind)
        stmt = stmt.order_by(GroupSample.t_ms, GroupSample.kind, GroupSample.group_name)
        with self.database.read() as conn:
            return [group_sample_row(replica, row) for row in conn.execute(stmt)]

    def sample_rollups(
        self, cluster: str, replica: str, since_ms: int | None = None, until_ms: int | None = None
    ) -> list[dict[str, Any]]:
        """A replica's 1-minute rollups (see storage.retention) with ``minute_ms`` in the range, as
        dicts."""
        r = sample_rollups
        stmt = (
            select(r)
            .join(Replica.__table__, Replica.id == r.c.replica_id)
            .where(Replica.cluster == cluster, Replica.name == replica)
        )
        stmt = in_range(stmt, r.c.minute_ms, since_ms, until_ms).order_by(r.c.minute_ms)
        with self.database.read() as conn:
            return [
                {k: v for k, v in row._mapping.items() if k != "replica_id"}
                for row in conn.execute(stmt)
            ]

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
        stmt = select(Replica.name, Completion.__table__).join(
            Replica, Replica.id == Completion.replica_id
        )
        stmt = stmt.where(Replica.cluster == cluster)
        if replica is not None:
            stmt = stmt.where(Replica.name == replica)
        stmt = in_range(stmt, Completion.finished_s, since_s, until_s)
        stmt = in_range(stmt, Completion.stored_ms, stored_since_ms, stored_until_ms)
        stmt = stmt.order_by(Completion.finished_s, Completion.id)
        with self.database.read() as conn:
            return [completion_row(row.name, row) for row in conn.execute(stmt)]

    def completion_stored_s(
        self, cluster: str, replica: str, request_ids: Sequence[str]
    ) -> list[float]:
        """When the store received each of these completions of ``replica`` (its own clock, s)."""
        wanted = set(request_ids)
        stmt = (
            select(Completion.request_id, Completion.stored_ms)
            .join(Replica, Replica.id == Completion.replica_id)
            .where(Replica.cluster == cluster, Replica.name == replica)
        )
        with self.database.read() as conn:
            return [
                row.stored_ms / 1000.0 for row in conn.execute(stmt) if row.request_id in wanted
            ]


def _of_replica(stmt: Any, model: Any, cluster: str, replica: str) -> Any:
    """``stmt`` on ``model``'s table restricted to the rows of ``replica`` of ``cluster``."""
    return stmt.join(Replica, Replica.id == model.replica_id).where(
        Replica.cluster == cluster, Replica.name == replica
    )

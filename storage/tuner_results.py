"""``TunerResults``: what the tuner concluded — recommendations, fidelity reports and predictions.

A study's recommended settings (with the summary that justifies them), how closely the simulator
replayed a replica's recorded span (``tailpilot fidelity``), and the what-if prediction kept with
each settings change it was made for, so it can later be set against what happened
(``tuner.closed_loop.whatif``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, insert, select

from storage.database import Database
from storage.models import FidelityReport, Prediction, Recommendation, Replica
from storage.replica_registry import ReplicaRegistry


@dataclass(frozen=True, slots=True)
class RecommendationInfo:
    id: int
    study: str
    created_ms: int
    settings: dict[str, Any]
    summary: dict[str, Any]


class TunerResults:
    """Recommendations per study; fidelity reports and predictions per replica."""

    def __init__(self, database: Database, replica_ids: ReplicaRegistry) -> None:
        self.database = database
        self.replica_ids = replica_ids

    def store_recommendation(
        self,
        study: str,
        settings: dict[str, Any],
        summary: dict[str, Any],
        *,
        t_ms: int | None = None,
    ) -> int:
        """Keep a tuner study's recommended settings and its summary; returns the row id."""
        row = {"study": study, "settings": settings, "summary": summary,
               "created_ms": self.database.now_ms() if t_ms is None else t_ms}  # fmt: skip
        stmt = insert(Recommendation).returning(Recommendation.id)
        return self.database.write(lambda conn: conn.execute(stmt, [row]).scalar_one())

    def latest_recommendation(self, study: str | None = None) -> RecommendationInfo | None:
        """The newest stored recommendation (of ``study``), or None."""
        stmt = select(Recommendation.__table__).order_by(
            Recommendation.created_ms.desc(), Recommendation.id.desc()
        )
        if study is not None:
            stmt = stmt.where(Recommendation.study == study)
        with self.database.read() as conn:
            row = conn.execute(stmt.limit(1)).first()
        return None if row is None else RecommendationInfo(**row._mapping)

    def store_fidelity(
        self,
        cluster: str,
        replica: str,
        span: str,
        summary: dict[str, Any],
        *,
        t_ms: int | None = None,
    ) -> int:
        """Keep a fidelity report of ``replica`` (its span as a db: URL); returns the row id."""
        now = self.database.now_ms() if t_ms is None else t_ms
        return self._insert_for_replica(
            FidelityReport,
            cluster,
            replica,
            now,
            {"created_ms": now, "span": span, "summary": summary},
        )

    def latest_fidelity(
        self, cluster: str, replica: str | None = None, *, at_ms: int | None = None
    ) -> list[dict[str, Any]]:
        """The newest fidelity report (made at or before ``at_ms``) of each replica of ``cluster``
        (or of ``replica``): dicts with replica, created_ms, span, summary."""
        stmt = (
            select(
                Replica.name.label("replica"),
                FidelityReport.created_ms,
                FidelityReport.span,
                FidelityReport.summary,
            )
            .join(Replica, Replica.id == FidelityReport.replica_id)
            .where(Replica.cluster == cluster)
        )
        if replica is not None:
            stmt = stmt.where(Replica.name == replica)
        if at_ms is not None:
            stmt = stmt.where(FidelityReport.created_ms <= at_ms)
        stmt = stmt.order_by(FidelityReport.created_ms.desc(), FidelityReport.id.desc())
        newest: dict[str, dict[str, Any]] = {}
        with self.database.read() as conn:
            for row in conn.execute(stmt):
                newest.setdefault(
                    row.replica,
                    {k: row._mapping[k] for k in ("replica", "created_ms", "span", "summary")},
                )
        return list(newest.values())

    def store_prediction(
        self,
        cluster: str,
        replica: str,
        summary: dict[str, Any],
        *,
        t_ms: int,
        version: int | None = None,
    ) -> int:
        """Keep the prediction made for a change applied to ``replica`` at ``t_ms``; returns its
        id."""
        return self._insert_for_replica(
            Prediction,
            cluster,
            replica,
            t_ms,
            {"t_ms": t_ms, "version": version, "summary": summary},
        )

    def predictions(self, cluster: str, replica: str | None = None) -> list[dict[str, Any]]:
        """Kept predictions, newest first: dicts with id, cluster, replica, t_ms, version,
        summary."""
        stmt = (
            select(
                Prediction.id,
                Replica.cluster,
                Replica.name.label("replica"),
                Prediction.t_ms,
                Prediction.version,
                Prediction.summary,
            )
            .join(Replica, Replica.id == Prediction.replica_id)
            .where(Replica.cluster == cluster)
        )
        if replica is not None:
            stmt = stmt.where(Replica.name == replica)
        stmt = stmt.order_by(Prediction.t_ms.desc(), Prediction.id.desc())
        with self.database.read() as conn:
            return [dict(row._mapping) for row in conn.execute(stmt)]

    def _insert_for_replica(
        self, model: Any, cluster: str, replica: str, now_ms: int, row: dict[str, Any]
    ) -> int:
        """Insert ``row`` into ``model``'s table for ``replica`` (registered if new); its id."""

        def txn(conn: Connection) -> int:
            rid = self.replica_ids.ids_for(conn, cluster, {replica}, now_ms)[replica]
            row_id: int = conn.execute(
                insert(model).returning(model.id), [{"replica_id": rid, **row}]
            ).scalar_one()
            return row_id

        return self.database.write(txn)

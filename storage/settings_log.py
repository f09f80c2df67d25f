"""``SettingsLog``: the settings audit log, and the settings documents replicas ran.

Every change anyone made to a replica's settings (an operator in the TUI, the governor, the
autopilot, a circuit-breaker trip the collector saw) is appended with who made it and what came of
it; the collector also keeps each new settings document a replica reports running.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, insert, select

from storage.database import Database
from storage.models import Replica, SettingsChange, SettingsSeen
from storage.replica_registry import ReplicaRegistry


class SettingsLog:
    """The ``settings_changes`` audit log and the ``settings_seen`` documents, per replica."""

    def __init__(self, database: Database, replica_ids: ReplicaRegistry) -> None:
        self.database = database
        self.replica_ids = replica_ids

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
        now = self.database.now_ms()
        row = {"t_ms": now if t_ms is None else t_ms, "who": who, "old": old, "new": new,
               "result": result, "message": message, "version": version}  # fmt: skip

        def txn(conn: Connection) -> dict[str, int]:
            ids = self.replica_ids.ids_for(conn, cluster, {replica}, now)
            conn.execute(insert(SettingsChange), [{**row, "replica_id": ids[replica]}])
            return ids

        self.replica_ids.write(cluster, txn)

    def settings_changes(
        self, cluster: str, replica: str | None = None, limit: int = 100
    ) -> list[dict[str, Any]]:
        """The settings audit log, newest first: dicts with t_ms, cluster, replica, who, old, new,
        result, message, version."""
        stmt = select(Replica.cluster, Replica.name.label("replica"), SettingsChange.__table__)
        stmt = stmt.join(Replica, Replica.id == SettingsChange.replica_id).where(
            Replica.cluster == cluster
        )
        if replica is not None:
            stmt = stmt.where(Replica.name == replica)
        stmt = stmt.order_by(SettingsChange.t_ms.desc(), SettingsChange.id.desc()).limit(limit)
        keys = ("t_ms", "cluster", "replica", "who", "old", "new", "result", "message", "version")
        with self.database.read() as conn:
            return [{k: row._mapping[k] for k in keys} for row in conn.execute(stmt)]

    def settings_seen(self, cluster: str, replica: str | None = None) -> list[dict[str, Any]]:
        """The settings documents replicas ran, oldest first: dicts with t_ms, replica, instance,
        version, settings (one per new version or instance the collector saw)."""
        stmt = select(
            Replica.name.label("replica"),
            SettingsSeen.t_ms,
            SettingsSeen.instance,
            SettingsSeen.version,
            SettingsSeen.settings,
        )
        stmt = stmt.join(Replica, Replica.id == SettingsSeen.replica_id).where(
            Replica.cluster == cluster
        )
        if replica is not None:
            stmt = stmt.where(Replica.name == replica)
        stmt = stmt.order_by(SettingsSeen.t_ms, SettingsSeen.id)
        with self.database.read() as conn:
            return [dict(row._mapping) for row in conn.execute(stmt)]

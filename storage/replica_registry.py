"""``ReplicaRegistry``: the ``replicas.id`` of each (cluster, name), registering names not seen
before.

Replicas are addressed by (cluster, name) everywhere in the store's API, while the tables point at
``replicas.id``. Every repository that writes rows of a replica (the collector's batches, the
settings audit log, the tuner's reports) resolves names through the one registry the store owns,
so they share its cache. A name the store has not seen is created on first use, so a batch is never
refused for naming a replica ``ensure_replicas`` missed.
"""

from __future__ import annotations

from collections.abc import Callable

from sqlalchemy import Connection, select

from storage.database import Database
from storage.models import Replica, table
from storage.sql import insert_ignoring


class ReplicaRegistry:
    """(cluster, name) -> ``replicas.id``, cached once committed. Thread-safe."""

    def __init__(self, database: Database) -> None:
        self.database = database
        # (cluster, name) -> replicas.id. Filled only after a commit, so it never holds an id that a
        # rolled-back transaction created. Plain dict operations are atomic under the GIL.
        self._ids: dict[tuple[str, str], int] = {}

    def write(self, cluster: str, txn: Callable[[Connection], dict[str, int]]) -> None:
        """Run ``txn`` in one write transaction (``Database.write``); once it has committed,
        remember the replica ids of ``cluster`` it returns (name -> id)."""
        for name, rid in self.database.write(txn).items():
            self._ids[(cluster, name)] = rid

    def ids_for(
        self, conn: Connection, cluster: str, names: set[str], now_ms: int
    ) -> dict[str, int]:
        """Replica ids for ``names``: from the cache, else looked up, else created (URLs unknown,
        first seen at ``now_ms``)."""
        ids = {n: self._ids[(cluster, n)] for n in names if (cluster, n) in self._ids}
        missing = names - ids.keys()
        if missing:
            rows = [
                {"cluster": cluster, "name": n, "first_seen_ms": now_ms} for n in sorted(missing)
            ]
            conn.execute(insert_ignoring(conn, table(Replica), ["cluster", "name"]), rows)
            ids.update(self.lookup(conn, cluster, missing))
        return ids

    @staticmethod
    def lookup(conn: Connection, cluster: str, names: set[str]) -> dict[str, int]:
        """The ids of those of ``names`` already stored in ``cluster`` (no cache, no creation)."""
        stmt = select(Replica.name, Replica.id).where(
            Replica.cluster == cluster, Replica.name.in_(names)
        )
        return {name: rid for name, rid in conn.execute(stmt)}

"""``Store``: the one object the rest of tailpilot opens for its database.

    store = Store.open(url)             # a Database, migrated, and a repository per kind of data
    store.recordings.write(cluster, batch)
    store.readings.samples(cluster, replica, since_ms)
    store.close()                       # or: with Store.open(url) as store: ...

A store is a composition: it owns the shared :class:`~storage.database.Database` (engine,
transactions, errors, retries) and exposes one repository per area over it:

* ``store.recordings`` (:class:`~storage.recordings.RecordingRepository`): the collector's batches,
  its cursors, named recordings, and the clusters and replicas there are;
* ``store.readings`` (:class:`~storage.readings.ReadingRepository`): samples, rollups and
  completions read back;
* ``store.settings_log`` (:class:`~storage.settings_log.SettingsLog`): the settings audit log and
  the documents replicas ran;
* ``store.tuner`` (:class:`~storage.tuner_results.TunerResults`): recommendations, fidelity reports,
  predictions;
* ``store.governance`` (:class:`~storage.governance.GovernanceRepository`): governance windows,
  alert events, the governor's and the autopilot's control rows;
* ``store.retention`` (:class:`~storage.retention.Retention`): folding and deleting old rows.

The repositories that write rows of a replica share one
:class:`~storage.replica_registry.ReplicaRegistry`, so each replica's id is looked up once per
store. Reads return plain dataclasses and dicts — never ORM objects tied to a session. Errors are
:class:`~storage.database.StoreError` and its subclasses.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from storage import engine as engines
from storage.database import DEFAULT_WRITE_DEADLINE_S, Database
from storage.governance import GovernanceRepository
from storage.readings import ReadingRepository
from storage.recordings import RecordingRepository
from storage.replica_registry import ReplicaRegistry
from storage.retention import Retention
from storage.settings_log import SettingsLog
from storage.tuner_results import TunerResults


class Store:
    """tailpilot's database: one :class:`Database` and a repository per area over it.

    Thread-safe: the engine pools connections; one store per process suffices.

    Attributes:
        database: the shared :class:`Database` (engine, transactions, the store's clock).
        recordings: the collector's writes and cursors, named recordings, clusters and replicas.
        readings: samples, rollups and completions.
        settings_log: the settings audit log and the settings documents replicas ran.
        tuner: recommendations, fidelity reports and predictions.
        governance: governance windows, alert events and the controllers' control rows.
        retention: folds old samples into rollups and deletes old completions.
    """

    def __init__(self, database: Database) -> None:
        """Compose a store over an open, migrated database; use :meth:`open` instead."""
        self.database = database
        replica_ids = ReplicaRegistry(database)
        self.recordings = RecordingRepository(database, replica_ids)
        self.readings = ReadingRepository(database)
        self.settings_log = SettingsLog(database, replica_ids)
        self.tuner = TunerResults(database, replica_ids)
        self.governance = GovernanceRepository(database)
        self.retention = Retention(database)

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

        Args:
            url: ``None`` for ``./tailpilot.db``; a filesystem path for a SQLite file; or a
                SQLAlchemy URL (``sqlite:///...``, ``postgresql+psycopg://user:pw@host/db``; plain
                ``postgresql://`` is taken to mean psycopg 3).
            write_deadline_s: how long a write retries a busy database before ``StoreBusy``.
            busy_timeout_ms: how long one SQLite statement waits for the write lock (default: 5 s,
                or the write deadline if shorter).
            clock: the store's clock (seconds since the epoch), for the times it stamps itself.

        Raises:
            StoreOpenError: the database could not be opened or migrated.
        """
        database = Database.open(
            url, write_deadline_s=write_deadline_s, busy_timeout_ms=busy_timeout_ms, clock=clock
        )
        return cls(database)

    def close(self) -> None:
        """Close every pooled connection. The store must not be used afterwards."""
        self.database.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Store({engines.redact(self.database.engine.url)})"


__all__ = ["Store"]

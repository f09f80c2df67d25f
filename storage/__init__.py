"""tailpilot's database: SQLite (WAL) by default, PostgreSQL by URL, behind one object, ``Store``.

    from storage import Store
    store = Store.open()                      # ./tailpilot.db, migrated to the newest schema
    store = Store.open("postgresql+psycopg://tailpilot@db/tailpilot")

A store owns one ``Database`` and a repository per area over it (``store.recordings``,
``store.readings``, ``store.settings_log``, ``store.tuner``, ``store.governance``,
``store.retention``; see ``storage.store``). The collector hands ``store.recordings`` its
``storage.rows`` batches; everything else reads through the repositories. The names below
are loaded on first use, so ``import storage.rows`` alone does not pull in SQLAlchemy.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Store": "storage.store",
    "Database": "storage.database",
    "StoreBusy": "storage.database",
    "StoreCorrupt": "storage.database",
    "StoreFull": "storage.database",
    "StoreWriteError": "storage.database",
    "StoreError": "storage.database",
    "StoreOpenError": "storage.database",
    "RecordingRepository": "storage.recordings",
    "ReplicaInfo": "storage.recordings",
    "RecordingInfo": "storage.recordings",
    "ReadingRepository": "storage.readings",
    "SettingsLog": "storage.settings_log",
    "TunerResults": "storage.tuner_results",
    "RecommendationInfo": "storage.tuner_results",
    "GovernanceRepository": "storage.governance",
    "Retention": "storage.retention",
    "RetentionSettings": "storage.retention",
    "RetentionReport": "storage.retention",
    "Batch": "storage.rows",
    "SampleRow": "storage.rows",
    "GroupSampleRow": "storage.rows",
    "CompletionRow": "storage.rows",
    "SettingsSeenRow": "storage.rows",
    "LatencyPercentiles": "storage.rows",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'storage' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)

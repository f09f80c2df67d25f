"""tailpilot's database: SQLite (WAL) by default, PostgreSQL by URL, behind one facade, ``Store``.

    from storage import Store
    store = Store.open()                      # ./tailpilot.db, migrated to the newest schema
    store = Store.open("postgresql+psycopg://tailpilot@db/tailpilot")

The collector hands it ``storage.rows`` batches; everything else reads through it. The names below
are loaded on first use, so ``import storage.rows`` alone does not pull in SQLAlchemy.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Store": "storage.store",
    "StoreBusy": "storage.store",
    "StoreCorrupt": "storage.store",
    "StoreFull": "storage.store",
    "StoreWriteError": "storage.store",
    "StoreError": "storage.store",
    "StoreOpenError": "storage.store",
    "ReplicaInfo": "storage.store",
    "RecordingInfo": "storage.store",
    "RecommendationInfo": "storage.store",
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

"""SQL the store's repositories share: the two dialect-specific statements (insert-or-ignore and
upsert) and the half-open time range every ranged read uses.

SQLite and PostgreSQL both speak ``INSERT ... ON CONFLICT``, and SQLAlchemy has a dialect
``insert()`` for each with ``on_conflict_do_nothing`` / ``on_conflict_do_update``. Other backends
would need different SQL (and different guarantees), so the store accepts only these two.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, Table
from sqlalchemy.dialects import postgresql, sqlite

SUPPORTED_BACKENDS = ("sqlite", "postgresql")


def upsert(conn: Connection, table: Table) -> Any:
    """The connection's dialect ``insert(table)``, which has the ``on_conflict_*`` methods."""
    name = conn.dialect.name
    if name == "sqlite":
        return sqlite.insert(table)
    if name == "postgresql":
        return postgresql.insert(table)
    raise NotImplementedError(
        f"tailpilot's store supports {' and '.join(SUPPORTED_BACKENDS)}, not {name}"
    )


def insert_ignoring(conn: Connection, table: Table, keys: list[str]) -> Any:
    """``INSERT ... ON CONFLICT (keys) DO NOTHING``: a re-delivered row is a no-op, not an error."""
    return upsert(conn, table).on_conflict_do_nothing(index_elements=keys)


def insert_or_update(conn: Connection, table: Table, keys: list[str], columns: list[str]) -> Any:
    """``INSERT ... ON CONFLICT (keys) DO UPDATE SET column = excluded.column`` for ``columns``."""
    stmt = upsert(conn, table)
    return stmt.on_conflict_do_update(
        index_elements=keys, set_={c: stmt.excluded[c] for c in columns}
    )


def in_range(stmt: Any, col: Any, lo: float | None, hi: float | None) -> Any:
    """``stmt`` restricted to ``lo <= col < hi``, either bound optional: half-open, so consecutive
    ranges never overlap."""
    if lo is not None:
        stmt = stmt.where(col >= lo)
    if hi is not None:
        stmt = stmt.where(col < hi)
    return stmt

"""Engine factory: a SQLite file by default, any SQLAlchemy URL (PostgreSQL via psycopg 3) when
shared.

SQLite is tuned for one writer (the collector) beside readers (TUI, ``tailpilot status``), set on
every new DBAPI connection by a ``connect`` event because these settings are per connection:

* ``journal_mode=WAL``: readers never block the writer, nor the writer the readers;
* ``synchronous=NORMAL``: in WAL mode a crash cannot corrupt the file, it can only lose the last
  transactions at a power cut, and commits need no fsync each;
* ``busy_timeout``: a writer that finds the write lock taken waits inside SQLite instead of failing
  at once (the store retries on top of this until its own deadline, see ``Database.write``);
* ``foreign_keys=ON``: SQLite does not enforce foreign keys otherwise.

The Python ``sqlite3`` driver's own transaction handling is switched off (``isolation_level=None``)
and SQLAlchemy's ``begin`` event emits ``BEGIN`` itself: plain ``BEGIN`` for reads, ``BEGIN
IMMEDIATE`` for connections marked ``execution_options(sqlite_immediate=True)`` (the store's
writes), which take the write lock up front, so a write transaction that has read something never
hits the "cannot upgrade a read snapshot" busy error that no waiting can cure.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.pool import StaticPool

from scheduler.errors import TailpilotError
from storage import strict_json

DEFAULT_SQLITE_FILE = "tailpilot.db"
DEFAULT_BUSY_TIMEOUT_MS = 5_000
# Drivers people type that SQLAlchemy would map to a driver we do not ship (psycopg2).
_POSTGRES_ALIASES = {"postgres", "postgresql"}
_PASSWORD_IN_URL = re.compile(r"(://[^:/@\s]*:)[^@\s]*@")


def normalize_url(url: str | None) -> URL:
    """Turn what an operator typed into a SQLAlchemy URL.

    ``None`` is ``tailpilot.db`` in the current directory; anything without ``://`` is a filesystem
    path to a SQLite file; ``postgres://`` and ``postgresql://`` mean psycopg 3, the driver
    tailpilot depends on (SQLAlchemy's default for them, psycopg2, is not installed).
    """
    if url is None:
        return URL.create("sqlite", database=str(Path.cwd() / DEFAULT_SQLITE_FILE))
    if "://" not in url:
        return URL.create("sqlite", database=str(Path(url).expanduser().resolve()))
    parsed = make_url(url)
    if parsed.drivername in _POSTGRES_ALIASES:
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed


class DatabaseMissing(TailpilotError, LookupError):
    """A command that only reads named a SQLite file that does not exist; the message names the
    path."""


def require_existing(url: str | None) -> None:
    """Raise :class:`DatabaseMissing` when ``url`` names a SQLite file that does not exist.

    Opening a SQLite file creates it, empty; a command that only reads (``governor status``, a
    replay, a recorded trace) calls this first, so a mistyped path is an error naming the path
    instead of a new empty database. In-memory databases, URI filenames (``?uri=true``, whose path
    SQLite resolves) and server backends (which report a missing database themselves) pass, and so
    does a malformed URL: opening it reports that.
    """
    try:
        parsed = normalize_url(url)
    except Exception:  # malformed: Store.open names it (without the password)
        return
    if not is_sqlite(parsed) or parsed.database in (None, "", ":memory:") or "uri" in parsed.query:
        return
    if not Path(parsed.database).exists():
        raise DatabaseMissing(f"no tailpilot store at {parsed.database} (the file does not exist)")


def redact(url: str | URL | None) -> str:
    """The URL as it may appear in messages and logs: the password replaced by ``***``."""
    if url is None:
        return DEFAULT_SQLITE_FILE
    if isinstance(url, URL):
        return url.render_as_string(hide_password=True)
    return _PASSWORD_IN_URL.sub(r"\1***@", url)


def is_sqlite(url: URL) -> bool:
    return url.get_backend_name() == "sqlite"


def make_engine(url: URL, *, busy_timeout_ms: int = DEFAULT_BUSY_TIMEOUT_MS) -> Engine:
    """An engine for ``url`` (already normalized); SQLite gets the pragmas described above.

    JSON columns are written as strict JSON (``storage.strict_json``) on both backends.
    """
    if not is_sqlite(url):
        # pre_ping: a shared server restarts now and then; a stale pooled connection should not
        # turn into a failed collector flush.
        return create_engine(url, pool_pre_ping=True, json_serializer=strict_json.dumps)
    kwargs: dict[str, Any] = {
        "connect_args": {"check_same_thread": False},
        "json_serializer": strict_json.dumps,
    }
    if url.database in (None, "", ":memory:"):
        kwargs["poolclass"] = StaticPool  # one shared in-memory database, not one per connection
    engine = create_engine(url, **kwargs)
    _install_sqlite_events(engine, busy_timeout_ms)
    return engine


def sqlite_pragmas(
    dbapi_conn: Any, *, busy_timeout_ms: int | None = None, foreign_keys: bool = False
) -> None:
    """WAL with synchronous=NORMAL (a commit without an fsync: readers never block the writer),
    and optionally a busy timeout and foreign keys, on a new DB-API SQLite connection. tailpilot's
    store and the tuner's Optuna storage both open their connections through this."""
    cur = dbapi_conn.cursor()
    try:
        # The timeout first: switching a fresh file to WAL needs a lock that a racing opener may
        # hold.
        if busy_timeout_ms is not None:
            cur.execute(f"PRAGMA busy_timeout={int(busy_timeout_ms)}")
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=NORMAL")
        if foreign_keys:
            cur.execute("PRAGMA foreign_keys=ON")
    finally:
        cur.close()


def _install_sqlite_events(engine: Engine, busy_timeout_ms: int) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None  # we emit BEGIN ourselves, below
        sqlite_pragmas(dbapi_conn, busy_timeout_ms=busy_timeout_ms, foreign_keys=True)

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        immediate = conn.get_execution_options().get("sqlite_immediate", False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")

"""``Database``: the one connection to tailpilot's database that every repository of the store
shares.

It owns the SQLAlchemy engine and knows everything about the backend that the repositories should
not: how a URL is read (``storage.engine``), opening and migrating, transactions, what a driver's
error means, and retrying a write that found the database busy. Repositories
(``storage.recordings``, ``storage.readings``, ...) hand it functions of a connection:
:meth:`Database.read` for reads, :meth:`Database.write` for writes.

SQLite allows one writer at a time. A write that finds the lock taken waits inside SQLite
(``busy_timeout``), and past that :meth:`Database.write` retries with backoff until
``write_deadline_s``; only then does it raise :class:`StoreBusy`, and the caller keeps what it
meant to write and tries again later. Rows are never dropped.

A damaged SQLite file, or one that is no database, raises :class:`StoreOpenError` when opening finds
it, else :class:`StoreCorrupt` from the first read or write that touches the damage; both name the
file. Any other write the database refuses raises :class:`StoreWriteError` (:class:`StoreFull` when
the database or its disk is full): one line naming the database and what failed, never the SQL or
the row values (they may hold tenants' data); the transaction is rolled back whole, so what was
committed before stays as it was.
"""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from sqlalchemy import Connection, Engine
from sqlalchemy.engine import URL
from sqlalchemy.exc import DBAPIError

from scheduler.errors import FAILED, TailpilotError
from storage import engine as engines
from storage import migrate
from storage.backoff import backoff_delays
from storage.sql import SUPPORTED_BACKENDS

T = TypeVar("T")

DEFAULT_WRITE_DEADLINE_S = 30.0


class StoreError(TailpilotError, RuntimeError):
    """Base of the store's own errors."""

    exit_code = FAILED


class StoreOpenError(StoreError):
    """The database could not be opened or migrated; the message names the database (a SQLite file's
    path, else the URL without its password)."""


class StoreBusy(StoreError):
    """A write found the database locked until its deadline. Nothing was written: keep the batch,
    retry."""


class StoreCorrupt(StoreError):
    """The database file is damaged or is not a database at all; the message names the file."""


class StoreWriteError(StoreError):
    """The database refused a write (nothing of it was stored); the message names the database and
    what failed, without SQL or row values."""


class StoreFull(StoreWriteError):
    """The database or the disk it lives on is full: nothing of this write was stored."""


class Database:
    """An open, migrated database: its engine, its transactions and the store's clock.

    Thread-safe: the engine pools connections; one per process suffices.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        write_deadline_s: float = DEFAULT_WRITE_DEADLINE_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """Wrap an engine whose database is already migrated; use :meth:`open` instead."""
        self.engine = engine
        self.write_deadline_s = write_deadline_s
        self.busy_retries = 0  # how often a write waited for the lock (for logs and tests)
        self._clock = clock

    @classmethod
    def open(
        cls,
        url: str | None = None,
        *,
        write_deadline_s: float = DEFAULT_WRITE_DEADLINE_S,
        busy_timeout_ms: int | None = None,
        clock: Callable[[], float] = time.time,
    ) -> Database:
        """Open (and migrate to the newest schema) the database at ``url``.

        Args:
            url: ``None`` for ``./tailpilot.db``; a filesystem path for a SQLite file; or a
                SQLAlchemy URL (``sqlite:///...``, ``postgresql+psycopg://user:pw@host/db``; plain
                ``postgresql://`` is taken to mean psycopg 3).
            write_deadline_s: how long :meth:`write` retries a busy database before
                :class:`StoreBusy`.
            busy_timeout_ms: how long one SQLite statement waits for the write lock (default: 5 s,
                or the write deadline if shorter).
            clock: the store's clock (seconds since the epoch), for the times it stamps itself.

        Raises:
            StoreOpenError: the database could not be opened or migrated.
        """
        parsed = _parse_url(url)
        shown = _where(parsed)
        if parsed.get_backend_name() not in SUPPORTED_BACKENDS:
            raise StoreOpenError(
                f"cannot open store at {shown}: "
                f"only {' and '.join(SUPPORTED_BACKENDS)} are supported"
            )
        if busy_timeout_ms is None:
            busy_timeout_ms = int(min(engines.DEFAULT_BUSY_TIMEOUT_MS, write_deadline_s * 1000))
        engine = None
        try:
            engine = engines.make_engine(parsed, busy_timeout_ms=busy_timeout_ms)
            migrate.upgrade(engine)
        except Exception as exc:
            if engine is not None:
                engine.dispose()
            raise StoreOpenError(f"cannot open store at {shown}: {_reason(exc, parsed)}") from None
        return cls(engine, write_deadline_s=write_deadline_s, clock=clock)

    def close(self) -> None:
        """Close every pooled connection. The database must not be used afterwards."""
        self.engine.dispose()

    def __repr__(self) -> str:
        return f"Database({engines.redact(self.engine.url)})"

    def now_ms(self) -> int:
        """The store's clock, in integer milliseconds since the epoch."""
        return int(self._clock() * 1000)

    @contextmanager
    def read(self) -> Iterator[Connection]:
        """A connection in a (deferred, read) transaction, so a read sees one consistent snapshot.

        Raises:
            StoreCorrupt: the file is damaged. Opening reads only the schema and the migration
                version, so damage elsewhere shows up at the first read that touches it.
        """
        try:
            with self.engine.connect() as conn, conn.begin():
                yield conn
        except DBAPIError as exc:
            self._raise_if_damaged(exc)
            raise

    def write(self, txn: Callable[[Connection], T], *, snapshot: bool = False) -> T:
        """Run ``txn`` in one write transaction, retrying it whole while the database is busy.

        SQLite: ``BEGIN IMMEDIATE`` takes the write lock first, so the transaction either gets it
        (waiting up to ``busy_timeout`` inside SQLite) or fails before doing anything. PostgreSQL
        never reports SQLite's "locked", but a serialization failure or deadlock is retried the
        same way.

        Args:
            txn: the transaction's work; its result is returned. It may run more than once.
            snapshot: on PostgreSQL, run at REPEATABLE READ so a statement pair (fold, then
                delete) sees the same rows.

        Raises:
            StoreBusy: still busy at ``write_deadline_s``; nothing was written.
            StoreWriteError: the database refused the write (:class:`StoreFull`: it is full).
            StoreCorrupt: the file is damaged.
        """
        deadline = time.monotonic() + self.write_deadline_s
        delays = backoff_delays(0.02, 1.0)
        while True:
            try:
                with self._write_connection(snapshot) as conn, conn.begin():
                    return txn(conn)
            except DBAPIError as exc:
                if not _is_retryable(exc):
                    self._raise_if_damaged(exc)
                    failure = _write_failure(exc)
                    error = StoreFull if failure == _FULL else StoreWriteError
                    raise error(
                        f"cannot write to {_where(self.engine.url)}: {failure}; nothing of this "
                        "write was stored (what was stored before is intact)"
                    ) from None
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StoreBusy(
                        f"{engines.redact(self.engine.url)} stayed locked for "
                        f"{self.write_deadline_s:g} s; nothing was written ({exc.orig})"
                    ) from exc
                self.busy_retries += 1
                time.sleep(min(left, next(delays)))
            except (OverflowError, UnicodeEncodeError) as exc:  # the driver could not bind a value
                raise StoreWriteError(
                    f"cannot write to {_where(self.engine.url)}: a value no column can hold "
                    f"({type(exc).__name__}); nothing of this write was stored"
                ) from None

    def _raise_if_damaged(self, exc: DBAPIError) -> None:
        """Raise :class:`StoreCorrupt`, naming the file, if ``exc`` says the database file is
        damaged."""
        damage = _damage(exc)
        if damage is not None:
            raise StoreCorrupt(f"{_where(self.engine.url)}: {damage}") from exc

    def _write_connection(self, snapshot: bool) -> Connection:
        conn = self.engine.connect().execution_options(sqlite_immediate=True)
        if snapshot and conn.dialect.name == "postgresql":
            conn = conn.execution_options(isolation_level="REPEATABLE READ")
        return conn


# -------------------------------------------------------------------- what the driver's errors mean


def _parse_url(url: str | None) -> URL:
    try:
        return engines.normalize_url(url)
    except Exception as exc:  # a malformed URL: the exception text may hold the password
        raise StoreOpenError(
            f"cannot open store at {engines.redact(url)}: not a valid database URL "
            f"({type(exc).__name__})"
        ) from None


def _where(url: URL) -> str:
    """The database as messages name it: a SQLite file's path, else the URL without its password."""
    if engines.is_sqlite(url) and url.database not in (None, "", ":memory:"):
        return url.database
    return engines.redact(url)


# SQLite's primary result codes for a damaged file and for a file that is no database at all.
_SQLITE_CORRUPT, _SQLITE_NOTADB = 11, 26


def _damage(exc: DBAPIError) -> str | None:
    """What is wrong with the file if ``exc`` reports a damaged or foreign database file, else
    None."""
    code = getattr(exc.orig, "sqlite_errorcode", None)
    if code is None:
        return None
    if code & 0xFF == _SQLITE_NOTADB:
        return f"not a SQLite database ({exc.orig})"
    if code & 0xFF == _SQLITE_CORRUPT:
        return f"the database file is damaged ({exc.orig})"
    return None


def _reason(exc: Exception, url: URL) -> str:
    """The driver's own words for why opening failed, without the password."""
    if isinstance(exc, DBAPIError) and (damage := _damage(exc)) is not None:
        return damage
    on_file = engines.is_sqlite(url) and url.database not in (None, "", ":memory:")
    if on_file and isinstance(exc, DBAPIError) and "unable to open" in str(exc.orig):
        folder = Path(url.database or ".").resolve().parent
        if not folder.is_dir():
            return f"folder {folder} does not exist"
        if not os.access(folder, os.W_OK | os.X_OK):
            return f"folder {folder} is read-only (SQLite writes its journal beside the file)"
    text = str(exc.orig) if isinstance(exc, DBAPIError) else str(exc)
    text = " ".join(text.split())
    if url.password:
        text = text.replace(str(url.password), "***")
    return text or type(exc).__name__


_SQLITE_FULL = 13  # SQLite's primary result code for "database or disk is full"
_PG_DISK_FULL = "53100"  # PostgreSQL's SQLSTATE disk_full
_FULL = "the database or its disk is full"


def _write_failure(exc: DBAPIError) -> str:
    """What failed, in words that hold no SQL and no row values (one line)."""
    orig = exc.orig
    code = getattr(orig, "sqlite_errorcode", None)
    if code is not None:
        if code & 0xFF == _SQLITE_FULL:
            return _FULL
        # SQLite's own words name a constraint or a condition, never a value.
        return (str(orig).splitlines() or [type(orig).__name__])[0]
    sqlstate = getattr(orig, "sqlstate", None)
    if sqlstate == _PG_DISK_FULL:
        return _FULL
    # PostgreSQL's messages may quote the value refused: its error class and code only.
    return f"{type(orig).__name__} (SQLSTATE {sqlstate})" if sqlstate else type(orig).__name__


def _is_retryable(exc: DBAPIError) -> bool:
    """SQLite's "database is locked" / "busy"; PostgreSQL's serialization failure and deadlock."""
    orig = exc.orig
    if isinstance(orig, sqlite3.OperationalError):
        text = str(orig).lower()
        return "locked" in text or "busy" in text
    return getattr(orig, "sqlstate", None) in ("40001", "40P01")


__all__ = [
    "DEFAULT_WRITE_DEADLINE_S",
    "Database",
    "StoreBusy",
    "StoreCorrupt",
    "StoreError",
    "StoreFull",
    "StoreOpenError",
    "StoreWriteError",
]

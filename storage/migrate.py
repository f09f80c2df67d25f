"""Run the store's Alembic migrations programmatically.

The migration scripts ship inside the package (``storage/migrations``), so an installed tailpilot
can bring any database to the current schema with no ``alembic.ini`` anywhere: the Alembic
``Config`` is built here, pointing at the package directory.

Several processes may open the same database at once (collector, TUI, ``tailpilot status``). The
migration runs in one transaction that first takes a lock — ``BEGIN IMMEDIATE`` on SQLite, a
transaction-level advisory lock on PostgreSQL — so the second opener waits, then finds the schema
already at head and does nothing, instead of racing to create the same tables.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, text
from sqlalchemy.exc import OperationalError

from scheduler.errors import FAILED, TailpilotError
from storage.backoff import backoff_delays

MIGRATIONS_DIR = Path(__file__).resolve().with_name("migrations")
_PG_LOCK_KEY = 0x7461696C  # "tail": any constant shared by every tailpilot process


def alembic_config(connection: Connection | None = None) -> Config:
    """An Alembic config for the packaged scripts; ``connection`` is used instead of a URL."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.attributes["connection"] = connection
    return cfg


def head_revision() -> str:
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None, "storage/migrations/versions holds no revision"
    return head


class NewerSchema(TailpilotError):
    """The database's schema revision is not one of ours (a newer tailpilot wrote it)."""

    exit_code = FAILED


def known_revisions() -> set[str]:
    return {s.revision for s in ScriptDirectory.from_config(alembic_config()).walk_revisions()}


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


MIGRATE_DEADLINE_S = 60.0  # how long an opener keeps waiting for another one's migration


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Migrate up to ``revision`` (a no-op when already there). A database locked by another
    opener's migration past the busy timeout (a loaded machine) is retried until it is done."""
    give_up = time.monotonic() + MIGRATE_DEADLINE_S
    for delay in backoff_delays(0.05, 1.0):
        try:
            found = current_revision(engine)
            if revision == "head" and found == head_revision():
                return  # the common case: skip the lock and the script loading
            if found is not None and found not in known_revisions():
                raise NewerSchema(
                    f"its schema (revision {found}) is not one this tailpilot knows — a newer "
                    "tailpilot wrote it: upgrade tailpilot, or give another database"
                )
            with _locked_transaction(engine) as conn:
                command.upgrade(alembic_config(conn), revision)
            return
        except OperationalError as err:
            if "locked" not in str(err) or time.monotonic() + delay > give_up:
                raise
        time.sleep(delay)


def downgrade(engine: Engine, revision: str = "base") -> None:
    """Migrate down to ``revision``; ``base`` drops every table of the store."""
    with _locked_transaction(engine) as conn:
        command.downgrade(alembic_config(conn), revision)


@contextmanager
def _locked_transaction(engine: Engine) -> Iterator[Connection]:
    """A connection inside a transaction that holds the migration lock; commits on success."""
    with engine.connect().execution_options(sqlite_immediate=True) as conn, conn.begin():
        if conn.dialect.name == "postgresql":
            conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _PG_LOCK_KEY})
        yield conn

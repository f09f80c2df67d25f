"""A throw-away PostgreSQL server for tests.

:class:`PostgresServer` runs ``initdb`` into a private temporary directory and starts ``postgres``
listening only on 127.0.0.1 at a free port (and on a socket in that directory), trusting local
connections, with durability switched off (``fsync=off`` ...) because the data dies with the test
session anyway. The binaries are found on ``PATH`` or under ``/usr/lib/postgresql/*/bin`` (where
Debian's ``postgresql`` package puts them; ``scripts/test.sh`` installs it when neither has them).
PostgreSQL refuses to run as root, so as root the server runs as the ``postgres`` OS user
(``runuser``), which owns the temporary directory.

Fixtures (session-scoped; a test module imports them to use them)::

    from postgres_support import postgres_server, postgres_url  # noqa: F401

* ``postgres_server`` -> the running :class:`PostgresServer`.
  ``postgres_server.create_database(name)`` creates another database on it and returns its
  SQLAlchemy URL — e.g. a test's own empty database, or the tuner's Optuna storage beside
  tailpilot's store (``optuna.storages.RDBStorage(postgres_server.create_database("optuna"))``).
* ``postgres_url`` -> the URL of one database, ``tailpilot``, created for the session.

If the server cannot be started the fixtures FAIL the tests that use them, with the server's log,
rather than skip them: a skipped PostgreSQL test would hide that the shared-deployment path is
untested.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from net_support import free_port

PG_USER = "postgres"  # the database superuser initdb creates (and the OS user when we are root)
_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


class PostgresError(RuntimeError):
    pass


def find_pg_bin() -> Path:
    """The directory holding ``initdb``, ``pg_ctl`` and ``postgres``: newest of
    /usr/lib/postgresql/*, else PATH."""
    candidates = sorted(
        glob.glob("/usr/lib/postgresql/*/bin"),
        key=lambda p: int(re.sub(r"\D", "", Path(p).parent.name) or 0),
        reverse=True,
    )
    on_path = shutil.which("pg_ctl")
    if on_path:
        candidates.append(str(Path(on_path).resolve().parent))
    for d in candidates:
        if all((Path(d) / exe).exists() for exe in ("initdb", "pg_ctl", "postgres")):
            return Path(d)
    raise PostgresError(
        "PostgreSQL binaries (initdb, pg_ctl, postgres) not found on PATH or under "
        "/usr/lib/postgresql/*/bin; install Debian's `postgresql` package (scripts/test.sh does so)"
    )


class PostgresServer:
    """One private PostgreSQL server; ``start()`` / ``stop()``, or use it as a context manager."""

    def __init__(self, bin_dir: Path | None = None) -> None:
        self.bin_dir = bin_dir or find_pg_bin()
        self.root = Path(tempfile.mkdtemp(prefix="tailpilot-pg-"))
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        self.port = 0
        self._as_root = os.geteuid() == 0

    # -- lifecycle

    def start(self, attempts: int = 3) -> PostgresServer:
        if self._as_root:
            shutil.chown(self.root, PG_USER, PG_USER)
        self._run("initdb", "-D", str(self.data), "-U", PG_USER, "--auth=trust", "-E", "UTF8",
                  "--locale=C", "--no-sync")  # fmt: skip
        for attempt in range(attempts):  # another process may grab the free port before we bind it
            self.port = free_port()
            options = (
                f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.root} -c fsync=off "
                "-c synchronous_commit=off -c full_page_writes=off -c max_connections=50"
            )
            try:
                self._run(
                    "pg_ctl",
                    "-D",
                    str(self.data),
                    "-l",
                    str(self.log),
                    "-o",
                    options,
                    "-w",
                    "-t",
                    "60",
                    "start",
                )
                return self
            except PostgresError:
                if attempt == attempts - 1:
                    raise
        return self

    def stop(self) -> None:
        try:
            if (self.data / "postmaster.pid").exists():
                self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> PostgresServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- databases

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://{PG_USER}@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str) -> str:
        """Create database ``name`` (lower-case identifier) on this server; returns its SQLAlchemy
        URL."""
        if not _NAME.match(name):
            raise ValueError(f"database name {name!r}: use lower-case letters, digits and _")
        import psycopg  # a dependency of tailpilot; imported late so the module loads without it

        with psycopg.connect(
            host="127.0.0.1", port=self.port, user=PG_USER, dbname="postgres", autocommit=True
        ) as c:
            c.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    # -- plumbing

    def _run(self, exe: str, *args: str) -> None:
        cmd = [str(self.bin_dir / exe), *args]
        if self._as_root:
            cmd = ["runuser", "-u", PG_USER, "--", *cmd]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=self.root)
        if proc.returncode != 0:
            output = f"{proc.stdout}{proc.stderr}{self._log_tail()}"
            raise PostgresError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{output}")

    def _log_tail(self, chars: int = 4000) -> str:
        try:
            return "\n--- server log ---\n" + self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


def _start_or_fail() -> PostgresServer:
    try:
        server = PostgresServer()
    except PostgresError as exc:
        pytest.fail(str(exc), pytrace=False)
    try:
        return server.start()
    except (PostgresError, OSError, LookupError, subprocess.SubprocessError) as exc:
        server.stop()
        pytest.fail(f"could not start PostgreSQL for the tests: {exc}", pytrace=False)


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """A PostgreSQL server for the whole session (one per xdist worker); fails, never skips."""
    server = _start_or_fail()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def postgres_url(postgres_server: PostgresServer) -> str:
    """SQLAlchemy URL of the session's ``tailpilot`` database (empty at first; tests share it)."""
    return postgres_server.create_database("tailpilot")

"""Where a study lives: Optuna's RDB storage (a SQLite file by default, any SQLAlchemy URL for
workers on several machines) or Optuna's JournalStorage in a file (``journal:PATH``, or a path
ending ``.journal``/``.log``: no database needed), kept apart from tailpilot's own database.

Forms of ``--storage`` (``storage_url`` turns each into the URL the other functions take):

* nothing → ``sqlite:///<cwd>/tailpilot-optuna.db``; ``PATH`` → ``sqlite:///<abs PATH>``;
* ``journal:PATH``, ``PATH.journal``, ``PATH.log`` → ``journal:<abs PATH>`` (a JournalFileBackend);
* ``postgresql://``/``postgres://`` → ``postgresql+psycopg://``; any other URL whose SQLAlchemy
  dialect exists (``sqlite:///``, ``mysql+DRIVER://``) as given.

Anything else (``redis://``, a typo) is a :class:`TuneError` naming the scheme and these forms.
"""

from __future__ import annotations

import json
import os
import re
import sys
import warnings
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

from controlplane.retry import RetryPolicy
from scheduler.errors import FAILED, TailpilotError
from tuner.studies.spec import DEFAULT_STORAGE_FILE, TuneError

# Optuna and SQLAlchemy are imported inside the functions that use them: the TUI imports this
# module at start (through tuner.studies.study), and they would add ~40 ms and ~0.2 s to it (python
# -X importtime); storage.engine loads SQLAlchemy.
if TYPE_CHECKING:
    from optuna.storages import BaseStorage, JournalStorage, RDBStorage
    from sqlalchemy import Engine
    from sqlalchemy.pool import ConnectionPoolEntry

#: Opening an RDB storage while other workers create Optuna's schema: the losers of that race
#: find the tables on a later try (``open_storage``). 6 tries, waiting 0.2 s doubling to 3.2 s.
SCHEMA_RACE = RetryPolicy(attempts=6, first_wait_s=0.2, max_wait_s=3.2)

HEARTBEAT_S = 10  # workers' heartbeats; a trial of a worker silent for GRACE_S is failed
GRACE_S = 40


TAILPILOT_TABLES = frozenset(
    {"replicas", "samples", "completions", "recommendations", "settings_changes"}
)


JOURNAL_PREFIX = "journal:"
JOURNAL_SUFFIXES = (".journal", ".log")  # optuna-dashboard reads a .log file as a journal too
SUPPORTED = (
    "a SQLite file (PATH or sqlite:///PATH), a journal file (journal:PATH, or a PATH ending "
    ".journal or .log) or a database URL (postgresql://USER@HOST/DB)"
)
# A scheme of two or more letters before ':' (one letter is a Windows drive, not a scheme).
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]+):")


def storage_url(raw: str | None) -> str:
    """The storage URL for ``--storage raw`` (module docstring: the accepted forms); raises
    :class:`TuneError` naming the scheme for a URL the tuner cannot use."""
    if raw is None or raw == "":
        return f"sqlite:///{Path.cwd() / DEFAULT_STORAGE_FILE}"
    if raw.startswith(JOURNAL_PREFIX):
        path = raw[len(JOURNAL_PREFIX) :]
        if not path:
            raise TuneError(
                f"--storage {raw}: give the journal file's path, e.g. journal:study.journal"
            )
        return JOURNAL_PREFIX + str(Path(path).resolve())
    scheme = _SCHEME.match(raw)
    if scheme is None or (
        "://" not in raw and Path(raw).exists()
    ):  # a file path (even one with a ':')
        if Path(raw).suffix in JOURNAL_SUFFIXES:
            return JOURNAL_PREFIX + str(Path(raw).resolve())
        return f"sqlite:///{Path(raw).resolve()}"
    for prefix in ("postgresql://", "postgres://"):
        if raw.startswith(prefix):
            return "postgresql+psycopg://" + raw[len(prefix) :]
    _check_dialect(raw, scheme.group(1))
    return raw


def _check_dialect(url: str, scheme: str) -> None:
    """Refuse a URL no SQLAlchemy dialect reads (``redis://``, ``file:``, a typo), in one line."""
    from sqlalchemy.engine import make_url  # start-up cost: see the note at the imports

    try:
        make_url(url).get_dialect()
    except Exception:
        raise TuneError(
            f"--storage {redact(url)}: the tuner cannot use '{scheme}' storage; use {SUPPORTED}"
        ) from None


def is_journal(url: str) -> bool:
    """Whether ``url`` (from :func:`storage_url`) names a journal file."""
    return url.startswith(JOURNAL_PREFIX)


def storage_file(url: str) -> str | None:
    """The file a SQLite or journal storage lives in (None: a server, or SQLite in memory)."""
    if is_journal(url):
        return url[len(JOURNAL_PREFIX) :]
    if url.startswith("sqlite:///"):
        path = url.removeprefix("sqlite:///")
        return None if path in ("", ":memory:") else path
    return None


def storage_exists(url: str) -> bool:
    """Whether the storage at ``url`` (from :func:`storage_url`) is there to hold studies: its
    SQLite or journal file exists (a server database, or SQLite in memory, is taken to be).
    Opening a file storage creates the file, so ``tune`` asks this first and checks a new study's
    definition before it opens one."""
    path = storage_file(url)
    return path is None or Path(path).exists()


def _same_database(a: str, b: str) -> bool:
    from sqlalchemy.engine import make_url  # start-up cost: see the note at the imports

    try:
        ua, ub = make_url(a), make_url(b)
    except Exception:
        return False
    if ua.get_backend_name() != ub.get_backend_name():
        return False
    if ua.get_backend_name() == "sqlite":
        da, db = ua.database or "", ub.database or ""
        return bool(da) and da != ":memory:" and Path(da).resolve() == Path(db).resolve()
    return (ua.host, ua.port, ua.database) == (ub.host, ub.port, ub.database)


def check_storage_separate(url: str, db_url: str | None) -> None:
    """Refuse to put Optuna's tables into tailpilot's database (both use alembic_version).
    ``db_url``: tailpilot's database (None: its default, ./tailpilot.db)."""
    from storage.engine import DEFAULT_SQLITE_FILE  # start-up cost: see the note at the imports

    db_url = db_url or DEFAULT_SQLITE_FILE
    if db_url is not None:
        db = db_url if "://" in db_url else f"sqlite:///{Path(db_url).resolve()}"
        journal = storage_file(url) if is_journal(url) else None
        db_file = storage_file(db)
        if (
            _same_database(url, db)
            if journal is None
            else db_file is not None and Path(journal).resolve() == Path(db_file).resolve()
        ):
            raise TuneError(
                f"--storage is tailpilot's database ({db_url}); keep Optuna's tables apart: "
                f"use another database (default: the SQLite file {DEFAULT_STORAGE_FILE})"
            )
    if is_journal(url):
        _check_journal_file(url)
        return
    from sqlalchemy import create_engine, inspect  # start-up cost: see the note at the imports

    if url.startswith("sqlite:///") and not Path(url.removeprefix("sqlite:///")).exists():
        return
    try:
        engine = create_engine(url)
    except Exception as err:
        raise TuneError(f"--storage {redact(url)}: cannot open: {_one_line(err)}") from None
    try:
        tables = set(inspect(engine).get_table_names())
    except Exception as err:
        raise TuneError(f"--storage {redact(url)}: cannot connect: {_one_line(err)}") from None
    finally:
        engine.dispose()
    clash = tables & TAILPILOT_TABLES
    if clash:
        raise TuneError(
            f"--storage {redact(url)} holds tailpilot's tables ({', '.join(sorted(clash))}); "
            "keep Optuna's tables in a separate database"
        )


def _check_journal_file(url: str) -> None:
    """A journal path must be a journal: refuse a directory, a missing folder and a SQLite file."""
    path = Path(storage_file(url) or "")
    if path.is_dir():
        raise TuneError(f"--storage {url}: is a directory; give a file for the journal")
    if not path.parent.is_dir():
        raise TuneError(f"--storage {url}: folder {path.parent} does not exist")
    if path.is_file():
        with path.open("rb") as fh:
            head = fh.read(16)
        if head.startswith(b"SQLite format 3"):
            raise TuneError(
                f"--storage {url}: is a SQLite database, not an Optuna journal; "
                f"give it as --storage {path} (no journal: prefix)"
            )


def repair_journal(path: Path, url: str) -> None:
    """Mend a journal a writer left torn (a full disk, a kill mid-write) before it is read or
    appended to, under Optuna's own lock: a last line without its newline is cut off, and a line
    that is a torn record with a whole one appended after it (a resume that wrote after the tear)
    keeps the whole record. What is cut is kept beside the journal (``PATH.torn-N``) and named on
    stderr; every committed trial survives. A line that cannot be mended is a TuneError naming it.
    """
    from optuna.storages.journal import JournalFileSymlinkLock  # start-up cost: see the imports

    if not path.is_file() or path.stat().st_size == 0:
        return
    lock = JournalFileSymlinkLock(str(path))
    lock.acquire()
    try:
        data = path.read_bytes()
        lines = data.split(b"\n")
        tail = lines.pop()  # after the last newline: b"" when the file ends whole
        kept: list[bytes] = []
        cut: list[bytes] = []
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                json.loads(line)
                kept.append(line)
                continue
            except ValueError:
                pass
            whole = _whole_suffix(line)
            if whole is None:
                raise TuneError(
                    f"--storage {url}: line {number} of the journal is not a record and "
                    "cannot be mended"
                )
            kept.append(line[len(line) - len(whole) :])
            cut.append(line[: len(line) - len(whole)])
        if tail.strip():
            cut.append(tail)
        if not cut:
            return
        k = 1
        while path.with_name(f"{path.name}.torn-{k}").exists():
            k += 1
        aside = path.with_name(f"{path.name}.torn-{k}")
        aside.write_bytes(b"\n".join(cut) + b"\n")
        tmp = path.with_name(path.name + ".mending")
        tmp.write_bytes(b"".join(line + b"\n" for line in kept))
        os.replace(tmp, path)
        print(
            f"--storage {url}: the journal was torn ({sum(len(c) for c in cut)} bytes of "
            f"unfinished records, a writer stopped mid-write: a full disk?); cut off and kept in "
            f"{aside}; the {len(kept)} whole records are intact",
            file=sys.stderr,
        )
    finally:
        lock.release()


def _whole_suffix(line: bytes) -> bytes | None:
    """The longest tail of ``line`` that is one whole JSON record, or None."""
    start = line.find(b"{", 1)
    while start != -1:
        try:
            json.loads(line[start:])
            return line[start:]
        except ValueError:
            start = line.find(b"{", start + 1)
    return None


def _one_line(err: BaseException) -> str:
    """An exception's message on one line (drivers add SQL and background links below it)."""
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def redact(url: str) -> str:
    """``url`` with its password hidden (``***``), for messages; unparsable: as given."""
    from sqlalchemy.engine import make_url  # start-up cost: see the note at the imports

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return url


class _SchemaRace(TailpilotError):
    """Opening an RDB storage failed as a loser of the race to create Optuna's schema does."""

    exit_code = FAILED


def open_storage(url: str) -> BaseStorage:
    """Optuna's storage for ``url`` (from :func:`storage_url`): a JournalStorage on a
    JournalFileBackend for ``journal:PATH``, else an RDBStorage with heartbeats. Raises
    :class:`TuneError` (one line, naming the storage) when it cannot be opened."""
    quiet_optuna()
    if is_journal(url):
        return _open_journal(url)
    scheme = _SCHEME.match(url)
    if scheme is None:
        raise TuneError(f"--storage {url}: not a storage URL; use {SUPPORTED}")
    _check_dialect(url, scheme.group(1))
    kw: dict[str, Any] = {}
    if url.startswith("sqlite"):
        kw["engine_kwargs"] = {"connect_args": {"timeout": 60}}
    else:
        kw["engine_kwargs"] = {"pool_pre_ping": True}
    # Workers starting together on an empty database race to create Optuna's schema (PostgreSQL:
    # "duplicate key ... pg_type"); the loser finds the tables on a second try.
    try:
        storage = SCHEMA_RACE.call(lambda: _open_rdb(url, kw), on=(_SchemaRace,))
    except _SchemaRace as race:
        raise TuneError(f"--storage {redact(url)}: cannot open: {race}") from None
    if url.startswith("sqlite"):
        _sqlite_wal(storage.engine)
    return storage


def _open_rdb(url: str, kw: dict[str, Any]) -> RDBStorage:
    """One try at an RDBStorage with heartbeats: :class:`_SchemaRace` (the error's first line)
    when the error is one a second try cures, :class:`TuneError` when it is not."""
    import optuna  # start-up cost: see the note at the imports

    try:
        return optuna.storages.RDBStorage(
            url, heartbeat_interval=HEARTBEAT_S, grace_period=GRACE_S, **kw
        )
    except Exception as err:
        if _transient_open_error(err):
            raise _SchemaRace(_one_line(err)) from None
        raise TuneError(f"--storage {redact(url)}: cannot open: {_one_line(err)}") from None


# The URL each journal storage was opened from (JournalStorage does not keep it; RDBStorage does).
_JOURNAL_URLS: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


def url_of(storage: BaseStorage) -> str:
    """The URL ``storage`` was opened from ("" when unknown: a storage opened elsewhere)."""
    return _JOURNAL_URLS.get(storage) or str(getattr(storage, "url", ""))


def _open_journal(url: str) -> JournalStorage:
    """JournalStorage in a file. Its writers take Optuna's symlink lock (works on NFS too); it has
    no heartbeats: ``tuner.studies.optimize`` fails the trials of dead local workers itself."""
    from optuna.storages import JournalStorage  # start-up cost: see the note at the imports
    from optuna.storages.journal import JournalFileBackend  # start-up cost, likewise

    _check_journal_file(url)
    repair_journal(Path(storage_file(url) or ""), url)
    try:
        storage = JournalStorage(JournalFileBackend(storage_file(url) or ""))
    except Exception as err:
        raise TuneError(f"--storage {url}: cannot read the journal: {_one_line(err)}") from None
    _JOURNAL_URLS[storage] = url
    return storage


def _transient_open_error(err: Exception) -> bool:
    text = str(err).lower()
    return any(
        k in text
        for k in (
            "duplicate key",
            "already exists",
            "database is locked",
            "deadlock",
            "could not serialize",
            "unique constraint",
        )
    )


def _sqlite_wal(engine: Engine) -> None:
    """WAL with synchronous=NORMAL: a commit without an fsync (Optuna commits every suggested
    parameter and report; at ~10 ms per fsync that would cost more than the simulation)."""
    from sqlalchemy import event  # start-up cost: see the note at the imports

    from storage.engine import sqlite_pragmas  # start-up cost, likewise

    @event.listens_for(engine, "connect")
    def _pragmas(dbapi_conn: Any, _record: ConnectionPoolEntry) -> None:  # pragma: no cover
        sqlite_pragmas(dbapi_conn)

    engine.dispose()  # connections opened before the listener reconnect with the pragmas


def quiet_optuna() -> None:
    import optuna  # start-up cost: see the note at the imports

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    warnings.filterwarnings("ignore", message="Argument ``heartbeat_interval`` is an experimental")
    warnings.filterwarnings("ignore", message="Fixed parameter .* is out of range")
    warnings.filterwarnings("ignore", message=".*WilcoxonPruner.*")

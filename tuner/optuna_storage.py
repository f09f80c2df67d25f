"""Where a study lives: Optuna's RDB storage (a SQLite file by default, any SQLAlchemy URL for
workers on several machines), kept apart from tailpilot's own database.
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import Any

from storage.backoff import backoff_delays
from tuner.spec import DEFAULT_STORAGE_FILE, TuneError

HEARTBEAT_S = 10  # workers' heartbeats; a trial of a worker silent for GRACE_S is failed
GRACE_S = 40


TAILPILOT_TABLES = frozenset({"replicas", "samples", "completions", "recommendations", "settings_changes"})


def storage_url(raw: str | None) -> str:
    """``None`` → ``sqlite:///<cwd>/tailpilot-optuna.db``; a path → SQLite; ``postgresql://`` →
    psycopg 3."""
    if raw is None or raw == "":
        return f"sqlite:///{Path.cwd() / DEFAULT_STORAGE_FILE}"
    if "://" not in raw:
        return f"sqlite:///{Path(raw).resolve()}"
    for prefix in ("postgresql://", "postgres://"):
        if raw.startswith(prefix):
            return "postgresql+psycopg://" + raw[len(prefix):]
    return raw


def _same_database(a: str, b: str) -> bool:
    from sqlalchemy.engine import make_url

    try:
        ua, ub = make_url(a), make_url(b)
    except Exception:  # noqa: BLE001 - unparsable: let the open fail later
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
    from storage.engine import DEFAULT_SQLITE_FILE

    db_url = db_url or DEFAULT_SQLITE_FILE
    if db_url is not None:
        db = db_url if "://" in db_url else f"sqlite:///{Path(db_url).resolve()}"
        if _same_database(url, db):
            raise TuneError(f"--storage is tailpilot's database ({db_url}); keep Optuna's tables apart: "
                            f"use another database (default: the SQLite file {DEFAULT_STORAGE_FILE})")
    from sqlalchemy import create_engine, inspect

    if url.startswith("sqlite:///") and not Path(url.removeprefix("sqlite:///")).exists():
        return
    engine = create_engine(url)
    try:
        tables = set(inspect(engine).get_table_names())
    except Exception as err:  # noqa: BLE001
        raise TuneError(f"--storage {_redact(url)}: cannot connect: {err}") from None
    finally:
        engine.dispose()
    clash = tables & TAILPILOT_TABLES
    if clash:
        raise TuneError(f"--storage {_redact(url)} holds tailpilot's tables ({', '.join(sorted(clash))}); "
                        "keep Optuna's tables in a separate database")


def _redact(url: str) -> str:
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001
        return url


def open_storage(url: str):
    import optuna

    quiet_optuna()
    kw: dict[str, Any] = {}
    if url.startswith("sqlite"):
        kw["engine_kwargs"] = {"connect_args": {"timeout": 60}}
    else:
        kw["engine_kwargs"] = {"pool_pre_ping": True}
    # Workers starting together on an empty database race to create Optuna's schema (PostgreSQL:
    # "duplicate key ... pg_type"); the loser finds the tables on a second try.
    delays = backoff_delays(0.2, 3.2)
    for attempt in range(6):
        try:
            storage = optuna.storages.RDBStorage(url, heartbeat_interval=HEARTBEAT_S, grace_period=GRACE_S, **kw)
            break
        except Exception as err:  # noqa: BLE001 - any driver error: say which storage
            if attempt == 5 or not _transient_open_error(err):
                raise TuneError(f"--storage {_redact(url)}: cannot open: {err}") from None
            time.sleep(next(delays))
    if url.startswith("sqlite"):
        _sqlite_wal(storage.engine)
    return storage


def _transient_open_error(err: Exception) -> bool:
    text = str(err).lower()
    return any(k in text for k in ("duplicate key", "already exists", "database is locked", "deadlock",
                                   "could not serialize", "unique constraint"))


def _sqlite_wal(engine) -> None:
    """WAL with synchronous=NORMAL: a commit without an fsync (Optuna commits every suggested
    parameter and report; at ~10 ms per fsync that would cost more than the simulation)."""
    from sqlalchemy import event

    from storage.engine import sqlite_pragmas

    @event.listens_for(engine, "connect")
    def _pragmas(dbapi_conn, _record) -> None:  # pragma: no cover - exercised via the engine
        sqlite_pragmas(dbapi_conn)

    engine.dispose()  # connections opened before the listener reconnect with the pragmas


def quiet_optuna() -> None:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    warnings.filterwarnings("ignore", message="Argument ``heartbeat_interval`` is an experimental")
    warnings.filterwarnings("ignore", message="Fixed parameter .* is out of range")
    warnings.filterwarnings("ignore", message=".*WilcoxonPruner.*")

"""Entry points: what ``tailpilot tui`` and ``tailpilot demo`` call.

run_tui(cluster_spec, db_url="sqlite:///t.db")      # live, recording into a store
run_tui(cluster_spec, readonly=True)                # live, read-only
run_tui(None, replay="recording.db")                # replay (read-only by construction)
run_tui(cluster_spec, store=store, duration_s=60)   # an open store, for a minute
run_tui(cluster_spec, db_url=db, controllers=[...])  # the demo: its governor and autopilot too
run_tui(cluster_spec, optuna_storage="postgresql://...")
    # the tuner panel (5) on that Optuna storage (default: ./tailpilot-optuna.db if it exists)
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from controlplane.cluster import ClusterSpec
from scheduler.errors import TailpilotError
from tui.app import TailpilotApp
from tui.replay import ReplaySource
from tui.sources import DEFAULT_HISTORY_S, LiveSource

if TYPE_CHECKING:  # annotations only: build_app opens one when asked (below)
    from collections.abc import Sequence

    from storage.store import Store
    from tui.sources import Controller


def build_app(
    cluster: ClusterSpec | None = None,
    *,
    db_url: str | None = None,
    readonly: bool = False,
    replay: str | None = None,
    cluster_name: str | None = None,
    store: Store | None = None,
    history_s: float = DEFAULT_HISTORY_S,
    start_ms: int | None = None,
    refresh_s: float = 1.0,
    optuna_storage: str | None = None,
    controllers: Sequence[Controller] = (),
) -> TailpilotApp:
    """The app on a live cluster (``cluster``; a store from ``store`` or ``db_url``, optional) or on
    a recording (``replay``: a SQLite file or a database URL; ``cluster``, if given, only supplies
    the SLOs and the window). A replay only reads: a SQLite file that does not exist raises
    ``storage.engine.DatabaseMissing`` instead of becoming an empty database. ``controllers``
    (live, with a store): run beside the collector (``LiveSource``)."""
    # Measured start-up cost: the store loads sqlalchemy and alembic (~0.4 s on top of the TUI's
    # ~1 s); only a replay or --db needs one.
    from storage.engine import require_existing  # sqlalchemy (measured: see above)
    from storage.store import Store  # sqlalchemy and alembic (measured: see above)

    if replay is not None:
        if controllers:
            raise ValueError("controllers steer a live cluster, never a replay")
        if store is None:
            require_existing(replay)
            store = Store.open(replay)
        name = cluster_name or (
            cluster.name
            if cluster is not None and cluster.name in store.recordings.clusters()
            else None
        )
        source = ReplaySource(store, name, history_s=history_s, start_ms=start_ms)
        return TailpilotApp(
            source,
            cluster,
            readonly=readonly,
            store=store,  # replay is read-only anyway
            optuna_storage=optuna_storage,
        )
    if cluster is None:
        raise ValueError("a live TUI needs a cluster (or replay= a recording)")
    if store is None and db_url is not None:
        store = Store.open(db_url)
    live = LiveSource(
        cluster, store, history_s=history_s, refresh_s=refresh_s, controllers=controllers
    )
    app = TailpilotApp(live, cluster, readonly=readonly, store=store, optuna_storage=optuna_storage)
    live.who = app.who
    return app


class NoTerminal(TailpilotError):
    """``run_tui`` off a terminal (stdin or stdout not a TTY)."""


def on_a_terminal() -> bool:
    """Whether the TUI can draw and read keys: stdin and stdout are a terminal. Off one Textual
    writes its escape codes into the pipe or the file (``tailpilot demo`` then prints its table
    instead; ``tailpilot tui`` refuses)."""
    return sys.stdin.isatty() and sys.stdout.isatty()


def run_tui(
    cluster: ClusterSpec | None = None,
    *,
    db_url: str | None = None,
    readonly: bool = False,
    replay: str | None = None,
    cluster_name: str | None = None,
    store: Store | None = None,
    history_s: float = DEFAULT_HISTORY_S,
    duration_s: float | None = None,
    optuna_storage: str | None = None,
    controllers: Sequence[Controller] = (),
) -> None:
    """Run the TUI until the operator quits (``tailpilot tui``), or for ``duration_s`` seconds.

    Live: ``cluster`` and optionally a store (``store``, or opened from ``db_url``) that the
    collector records into and the audit log is read from. Replay: ``replay`` = a recording
    (SQLite file or URL), ``cluster_name`` when it holds several clusters. A store passed in
    stays open. ``controllers``: run beside a live collector (the demo's governor and
    autopilot)."""
    own_store = store is None
    app = build_app(
        cluster,
        db_url=db_url,
        readonly=readonly,
        replay=replay,
        cluster_name=cluster_name,
        store=store,
        history_s=history_s,
        optuna_storage=optuna_storage,
        controllers=controllers,
    )
    app.exit_after_s = duration_s
    try:
        if not on_a_terminal():
            # Checked after the sources opened: a wrong database or cluster is named first.
            raise NoTerminal(
                "the TUI needs a terminal (stdin and stdout): off one, read the same figures "
                "with tailpilot status --cluster FILE [--json], or run tailpilot demo --no-tui"
            )
        app.run()
    finally:
        if own_store and app.store is not None:
            app.store.close()

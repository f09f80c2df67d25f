"""The headless recorder: the collector writing to a store until stopped. ``tailpilot record`` is
its command line (tailpilot/cli_record.py); :func:`run_recorder` is what it calls.

    stats = run_recorder(cluster, "sqlite:///t.db", recording_name="incident-42")

On SIGTERM or SIGINT it stops polling, flushes every pending row (retrying a busy database) and
returns its :class:`RecorderStats`; the persisted cursors make a later run continue exactly where
this one stopped, and a ``kill -9`` at any moment loses and duplicates no completion (the cursor
is stored in the same transaction as the completions it covers). A database that refuses a write
(a full disk) raises ``storage.database.StoreWriteError``, which names the database and what
failed (no SQL, no row values); everything committed before is intact, and what was not is still
on the replicas, read again from the stored cursors by the next run. With ``recording_name`` the
run is also a named recording (``RecordingRepository.begin_recording`` / ``end_recording``),
which retention keeps; with ``retention`` the store's retention runs every
``retention_interval_s``; with ``metrics`` it serves the ``tailpilot_*`` Prometheus page
(controlplane.exporter) on its own event loop.

Health changes are logged (``replica twin-3 unhealthy: state: timeout after 2 s``; ``... healthy
again``), so a headless run's log says when each replica was out and why.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from controlplane.cluster import ClusterSpec
from controlplane.collector import Collector
from controlplane.exporter import MetricsServer
from controlplane.governor_live import run_governor
from controlplane.poller import PollResult
from storage.store import Store

log = logging.getLogger("tailpilot.recorder")

DEFAULT_RETENTION_INTERVAL_S = 600.0
# A controller run beside the collector: called with (collector, store, stop) until stop is set.
Task = Callable[[Collector, Any, asyncio.Event], Coroutine[Any, Any, None]]


@dataclass
class RecorderStats:
    cluster: str
    db: str
    started_ms: int
    ended_ms: int | None = None
    recording_id: int | None = None
    polls: int = 0
    failed_polls: int = 0
    batches: int = 0
    rows_written: int = 0
    samples_written: int = 0
    group_samples_written: int = 0
    completions_written: int = 0  # completion rows handed to the store (re-deliveries included)
    busy_retries: int = 0  # flushes refused by a locked database (kept and retried)
    retention_runs: int = 0
    health_changes: int = 0
    breaker_trips: int = 0  # replicas' circuit-breaker trips written to the audit log
    # Per replica, what could not be stored as it was sent, per reason (storage.limits.REASONS).
    rejected: dict[str, dict[str, int]] = field(default_factory=dict)
    unhealthy_at_end: list[str] = field(default_factory=list)
    metrics_url: str | None = None  # where /metrics was served (--metrics-port)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _health_logger(stats: RecorderStats) -> Callable[[str, PollResult], None]:
    previous: dict[str, bool] = {}

    def on_poll(replica: str, result: PollResult) -> None:
        row = result.sample
        before = previous.get(replica)
        previous[replica] = row.healthy
        if before is None and row.healthy:
            log.info("replica %s healthy%s", replica, f" ({row.reason})" if row.reason else "")
        elif before != row.healthy:
            stats.health_changes += 1
            if row.healthy:
                log.info("replica %s healthy again", replica)
            else:
                log.warning("replica %s unhealthy: %s", replica, row.reason)

    return on_poll


async def record(
    cluster: ClusterSpec,
    store: Any,
    stop: asyncio.Event,
    *,
    db_label: str = "",
    recording_name: str | None = None,
    retention: Any | None = None,
    retention_interval_s: float = DEFAULT_RETENTION_INTERVAL_S,
    flush_interval_s: float = 1.0,
    metrics_every: int = 1,
    collector: Collector | None = None,
    govern: str | None = None,
    metrics: tuple[str, int] | None = None,
    tasks: Sequence[Task] = (),
) -> RecorderStats:
    """Run a collector on ``store`` until ``stop`` is set; flush, end the recording, return stats.
    ``govern``: also run the governor (controlplane.governor), its state set to this first
    ("armed" | "dry-run"; "" keeps the stored state). ``metrics``: (host, port) to serve the
    ``tailpilot_*`` Prometheus page on (controlplane.exporter; port 0 picks one). ``tasks``: more
    controllers run beside the collector until ``stop`` (each called with the collector, the
    store and ``stop``; the autopilot: ``tuner.autopilot.live.run_autopilot``)."""
    stats = RecorderStats(cluster=cluster.name, db=db_label, started_ms=int(time.time() * 1000))
    collector = collector or Collector(
        cluster, store, flush_interval_s=flush_interval_s, metrics_every=metrics_every
    )
    collector.on_poll(_health_logger(stats))
    exporter = None
    if metrics is not None:  # first: a taken port fails the start before anything is begun
        exporter = MetricsServer(collector, host=metrics[0], port=metrics[1])
        port = await exporter.start()
        stats.metrics_url = f"http://{metrics[0]}:{port}/metrics"
        log.info("serving Prometheus metrics at %s", stats.metrics_url)
    extra: list[asyncio.Task[None]] = []
    try:
        if recording_name:
            stats.recording_id = await asyncio.to_thread(
                store.recordings.begin_recording, cluster.name, recording_name
            )

        async def retention_loop() -> None:
            while not stop.is_set():
                try:
                    report = await asyncio.to_thread(
                        store.retention.apply, int(time.time() * 1000), retention
                    )
                    stats.retention_runs += 1
                    log.info("retention: %s", report)
                except Exception as err:  # a busy database or a failed fold: try again next time
                    log.warning("retention failed (will retry): %s", err)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), retention_interval_s)

        if retention is not None:
            extra.append(asyncio.create_task(retention_loop()))
        if govern is not None:
            if cluster.governance is None:
                raise ValueError(
                    f"cluster {cluster.name!r} has no governance block: nothing to govern"
                )
            if govern:
                await asyncio.to_thread(
                    store.governance.set_control,
                    "governor",
                    cluster.name,
                    state=govern,
                    who="governor start",
                )
            extra.append(
                asyncio.create_task(
                    run_governor(collector, store, stop, interval_s=flush_interval_s)
                )
            )
        for controller in tasks:
            extra.append(asyncio.create_task(controller(collector, store, stop)))
        s = await collector.run(stop)
    finally:
        if exporter is not None:
            await exporter.stop()
        for task in extra:
            task.cancel()
        await asyncio.gather(*extra, return_exceptions=True)
        if stats.recording_id is not None:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(store.recordings.end_recording, stats.recording_id)
    for name in (
        "polls",
        "failed_polls",
        "batches",
        "rows_written",
        "samples_written",
        "group_samples_written",
        "completions_written",
        "busy_retries",
        "breaker_trips",
    ):
        setattr(stats, name, getattr(s, name))
    stats.rejected = {n: dict(v.rejected) for n, v in collector.views.items() if v.rejected}
    stats.unhealthy_at_end = [n for n, v in collector.views.items() if not v.health.healthy]
    stats.ended_ms = int(time.time() * 1000)
    return stats


def _runner() -> asyncio.Runner:
    try:
        import uvloop  # optional dependency: the faster event loop when installed
    except ImportError:
        return asyncio.Runner()
    return asyncio.Runner(loop_factory=uvloop.new_event_loop)


def run_recorder(
    cluster: ClusterSpec,
    db_url: str | None,
    *,
    stop: asyncio.Event | threading.Event | None = None,
    recording_name: str | None = None,
    retention: Any | None = None,
    retention_interval_s: float = DEFAULT_RETENTION_INTERVAL_S,
    flush_interval_s: float = 1.0,
    metrics_every: int = 1,
    install_signals: bool = True,
    govern: str | None = None,
    metrics: tuple[str, int] | None = None,
    tasks: Sequence[Task] = (),
) -> RecorderStats:
    """Record ``cluster`` into the store at ``db_url`` (None: ./tailpilot.db) until stopped.

    Blocking. Stops on SIGTERM/SIGINT (``install_signals``, main thread only) or when ``stop`` is
    set — an ``asyncio.Event`` set from the loop, or a ``threading.Event`` set from any thread.
    ``retention`` is a ``storage.retention.RetentionSettings`` (None: no retention). Raises
    ``storage.database.StoreOpenError`` if the database cannot be opened.
    """
    store = Store.open(db_url)

    async def main() -> RecorderStats:
        loop = asyncio.get_running_loop()
        event = stop if isinstance(stop, asyncio.Event) else asyncio.Event()
        watcher = None
        if isinstance(stop, threading.Event):

            async def watch() -> None:
                while not stop.is_set():
                    await asyncio.sleep(0.1)
                event.set()

            watcher = asyncio.create_task(watch())
        installed: list[signal.Signals] = []
        if install_signals and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                with contextlib.suppress(NotImplementedError, RuntimeError):
                    loop.add_signal_handler(sig, event.set)
                    installed.append(sig)
        try:
            log.info(
                "recording cluster %s (%d replicas) into %r",
                cluster.name,
                len(cluster.replicas),
                str(store),
            )
            return await record(
                cluster,
                store,
                event,
                db_label=str(store),
                recording_name=recording_name,
                retention=retention,
                retention_interval_s=retention_interval_s,
                flush_interval_s=flush_interval_s,
                metrics_every=metrics_every,
                govern=govern,
                metrics=metrics,
                tasks=tasks,
            )
        finally:
            for sig in installed:
                loop.remove_signal_handler(sig)
            if watcher is not None:
                watcher.cancel()

    try:
        with _runner() as runner:
            return runner.run(main())
    finally:
        store.close()

"""The headless recorder: the collector writing to a store until SIGTERM/SIGINT (``tailpilot record``).

    python -m controlplane.recorder --cluster clusters.yaml [--cluster-name prod] --db sqlite:///t.db

On SIGTERM or SIGINT it stops polling, flushes every pending row (retrying a busy database) and
exits 0; the persisted cursors make a later run continue exactly where this one stopped, and a
``kill -9`` at any moment loses and duplicates no completion (the cursor is stored in the same
transaction as the completions it covers). A database that refuses a write (a full disk) ends it
with one line naming the database and what failed (``storage.database.StoreWriteError``: no SQL, no
row values) and exit status 1; everything committed before is intact, and what was not is still
on the replicas, read again from the stored cursors by the next run. With ``recording_name`` the run is also a named
recording (``RecordingRepository.begin_recording`` / ``end_recording``), which retention keeps; with
``retention`` the store's retention runs every ``retention_interval_s``; with ``metrics`` it serves
the ``tailpilot_*`` Prometheus page (controlplane.exporter) on its own event loop.

Health changes are logged (``replica twin-3 unhealthy: state: timeout after 2 s``; ``... healthy
again``), so a headless run's log says when each replica was out and why.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from controlplane.cluster import ClusterFileError, ClusterSpec, load_cluster_file
from controlplane.collector import Collector
from controlplane.poller import PollResult

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


def _health_logger(stats: RecorderStats):
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
    store and ``stop``; the autopilot: ``tuner.autopilot_live.run_autopilot``)."""
    stats = RecorderStats(cluster=cluster.name, db=db_label, started_ms=int(time.time() * 1000))
    collector = collector or Collector(
        cluster, store, flush_interval_s=flush_interval_s, metrics_every=metrics_every
    )
    collector.on_poll(_health_logger(stats))
    exporter = None
    if metrics is not None:  # first: a taken port fails the start before anything is begun
        from controlplane.exporter import MetricsServer

        exporter = MetricsServer(collector, host=metrics[0], port=metrics[1])
        port = await exporter.start()
        stats.metrics_url = f"http://{metrics[0]}:{port}/metrics"
        log.info("serving Prometheus metrics at %s", stats.metrics_url)
    extra: list[asyncio.Task] = []
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
            from controlplane.governor import run_governor

            if cluster.governance is None:
                raise ValueError(
                    f"cluster {cluster.name!r} has no governance block: nothing to govern"
                )
            if govern:
                await asyncio.to_thread(
                    store.governance.set_governor_control,
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
        import uvloop
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
    from storage.store import Store

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m controlplane.recorder",
        description="Record a cluster's replicas into a store until SIGTERM.",
    )
    parser.add_argument("--cluster", required=True, metavar="FILE", help="cluster file (YAML)")
    parser.add_argument(
        "--cluster-name", metavar="NAME", help="which cluster of the file (if several)"
    )
    parser.add_argument(
        "--db", metavar="URL", help="store URL or SQLite path (default ./tailpilot.db)"
    )
    parser.add_argument("--recording", metavar="NAME", help="also make this run a named recording")
    parser.add_argument("--flush-interval", type=float, default=1.0, metavar="S")
    parser.add_argument(
        "--metrics-every",
        type=int,
        default=1,
        metavar="N",
        help="read /metrics of plugin replicas every N polls (default 1)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help="serve the tailpilot_* Prometheus page at :PORT/metrics (0: any free port)",
    )
    parser.add_argument("--metrics-host", default="127.0.0.1", metavar="HOST")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING if args.quiet else logging.INFO,
        format="%(asctime)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    try:
        cluster = load_cluster_file(args.cluster).cluster(args.cluster_name)
    except (ClusterFileError, KeyError) as err:
        print(f"error: {err.args[0] if isinstance(err, KeyError) else err}", file=sys.stderr)
        return 2
    from storage.database import StoreError

    try:
        stats = run_recorder(
            cluster,
            args.db,
            recording_name=args.recording,
            flush_interval_s=args.flush_interval,
            metrics_every=args.metrics_every,
            metrics=(args.metrics_host, args.metrics_port)
            if args.metrics_port is not None
            else None,
        )
    except StoreError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(json.dumps(stats.as_dict()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

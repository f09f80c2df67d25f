"""The live collector: polls every replica of a cluster and turns what it sees into rows.

For each replica, every ``poll_interval_s``:

* ``GET {control_url}/tailpilot/v1/state?cursor=N`` — queue, KV, live γ/β, counters, the settings
  document and the completions finished since cursor ``N`` (docs/control-api.md);
* ``GET {api_url}/metrics`` — vLLM's Prometheus page, parsed with ``prometheus_client``'s parser
  through ``controlplane.prom.VLLM_METRICS``, a table of the metric names different vLLM versions
  use.

From the per-request completions it keeps a rolling window (``window_s`` of the cluster, on the
replica's own clock) and computes **exact** P50/P90/P95/P99 of TTFT, TTLT and TBT per replica, per
tenant and per request type with :func:`scheduler.metrics.distribution_stats` — no histogram
interpolation. The results are :class:`storage.rows.SampleRow` / ``GroupSampleRow`` /
``CompletionRow``, written by one writer task as one :class:`storage.rows.Batch` per flush.

Rooms: the Prometheus page is parsed in ``controlplane/prom.py``; the HTTP clients, the bounded
reader and the error text are ``controlplane/http.py``, and when a request is asked again
``controlplane/retry.py``; strict JSON and the reading of /state and /metrics (bounded in bytes,
every entry fitted to what the store holds: ``storage/limits.py``) are
``controlplane/replica_http.py``; the per-replica views and one poll of a replica
``controlplane/poller.py``, the snapshots the TUI reads ``controlplane/snapshot.py``, the writer
``controlplane/writer.py``; settings changes (``tailpilot set``) are ``controlplane/steering.py``;
the rolling window and its exact percentiles ``controlplane/window.py``. This module runs them:
the poll loop, the governance figures, the snapshots' subscribers and the writer's task.

Concurrency: one client for all replicas (:class:`~controlplane.replica_http.PollingClient`, one
aiohttp session for polls and settings writes); one task per replica that polls and then
sleeps to its next tick, so a poll never overlaps the previous one of the same replica and a slow
replica (bounded by the cluster's ``timeout_s``) only delays itself.

Isolation: what one replica sends costs only its own values. Every entry is fitted before the cursor
moves past it (a value no column holds is nulled or its entry skipped, counted per reason in
``ReplicaView.rejected``; repeated request ids are counted too), a page whose cursor the store
cannot hold marks only that replica unhealthy, and its /state and /metrics answers are read with
caps. When a replica's circuit breaker trips (its /state ``breaker``), one settings-audit row is
written per increase (``who="engine"``, ``result="breaker"``), with the batch, never twice across
restarts.

Exactly-once: a replica's cursor is persisted in the same transaction as the completions it covers
(``Batch.cursors``); a batch the store refuses (``StoreBusy``) is kept and retried with the next,
never dropped. On start the cursors come from the store, each with the replica instance it counts
in. A replica that restarted (its /state ``instance`` changed, its counters went backwards, or it
has fewer completions than our cursor) is read again from cursor 0; the store's unique key on
(replica, request id) absorbs any re-delivery. The instance is what catches a restart while no
collector ran that has since completed more requests than the stored cursor.

A replica without the tailpilot plugin (the control API answers 404) still gives a sample from
``/metrics`` alone: it stays healthy, with ``reason`` saying "metrics only: no tailpilot control
API", and its latency percentiles are empty (vLLM's histograms cannot give exact tails).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from controlplane.cluster import ClusterSpec
from controlplane.governance import AlertEvaluator, GovernanceReport
from controlplane.poller import PollResult, ReplicaView, poll_view, poll_views, reserved_groups
from controlplane.replica_http import PollingClient, make_client
from controlplane.snapshot import ClusterSnapshot
from controlplane.window import governance_columns
from controlplane.writer import BatchWriter, CollectorStats
from scheduler.metrics.fairness import report as governance_report
from storage.rows import AlertRow, GovernanceRow, SampleRow

log = logging.getLogger(__name__)

# The group the tenants a governance block does not declare are folded into (no declared name can
# be it: names start with a letter or digit).
UNDECLARED = "(undeclared)"


def fold_undeclared(
    waiting: dict[str, dict[str, float]], declared: Mapping[str, object]
) -> dict[str, dict[str, float]]:
    """``waiting`` with every undeclared tenant's queue summed into ``UNDECLARED`` (its longest
    wait kept): a replica reporting thousands of made-up tenants adds one group, not thousands."""
    out = {t: w for t, w in waiting.items() if t in declared}
    rest = [w for t, w in waiting.items() if t not in declared]
    if rest:
        out[UNDECLARED] = {
            "requests": sum(w.get("requests", 0.0) for w in rest),
            "waited_s": max(w.get("waited_s", 0.0) for w in rest),
        }
    return out


class Collector:
    """Polls every replica of ``cluster`` until ``stop`` is set; writes rows to ``store``.

    ``store`` may be None (the TUI without a database): rows are then only kept as the latest
    snapshot. ``client`` (one :class:`PollingClient` for all replicas) is created if not given and
    closed at the end if created here. ``clock`` stamps samples (seconds since the epoch).
    ``metrics_every``: read /metrics of a replica with the plugin every that many polls (default:
    every poll; a replica without the plugin, or whose last /metrics read failed, every poll).
    """

    def __init__(
        self,
        cluster: ClusterSpec,
        store: Any | None = None,
        *,
        client: PollingClient | None = None,
        clock: Callable[[], float] = time.time,
        flush_interval_s: float = 1.0,
        metrics_every: int = 1,
    ) -> None:
        self.cluster = cluster
        self.metrics_every = max(1, int(metrics_every))
        self.store = store
        self.clock = clock
        self.flush_interval_s = float(flush_interval_s)
        self._client = client
        self._own_client = client is None
        self.views: dict[str, ReplicaView] = {
            r.name: ReplicaView(r, cluster.window_s, reserved=reserved_groups(cluster))
            for r in cluster.replicas
        }
        self.stats = CollectorStats()
        self._writer = BatchWriter(store, cluster.name, self.stats)
        self._subscribers: list[asyncio.Queue[ClusterSnapshot]] = []
        self._poll_listeners: list[Callable[[str, PollResult], None]] = []
        gov = cluster.governance
        self._alerts = AlertEvaluator(gov.alerts) if gov is not None else None
        self._gov_params = gov.params() if gov is not None else None
        self._gov_stored: float | None = None
        self._waiting_since: dict[str, tuple[float, int]] = {}  # tenant -> (since, waiting then)
        self.governance: GovernanceReport | None = None
        # The governor's last status (state, paused, active modes), when one runs on this
        # collector (controlplane.governor_live.governor_step sets it; the /metrics page reads it).
        self.governor_status: dict[str, Any] | None = None

    # --- public reading side (TUI, tests) ----------------------------------------------------
    def snapshot(self) -> ClusterSnapshot:
        return ClusterSnapshot(
            cluster=self.cluster.name,
            t_ms=int(self.clock() * 1000),
            replicas={name: v.snapshot() for name, v in self.views.items()},
            governance=self.governance,
        )

    def govern(self, *, immediate: bool = False) -> GovernanceReport | None:
        """The cluster's governance figures over the replicas' windows now; alert transitions and
        (once per ``window_s``) the figures are queued for the store. ``immediate``: judge the
        alerts on these figures alone, without their for/keep-firing holds (a one-shot poll)."""
        if self._alerts is None or self._gov_params is None:
            return None
        t = self.clock()
        t_ms = int(t * 1000)
        columns = governance_columns([v.window for v in self.views.values()])
        declared = self.cluster.governance.tenants if self.cluster.governance else {}
        waiting = self._waiting_tenants(t)
        if declared:  # tenants nobody declared: one group, shown, never judged on
            tenant = columns[0].copy()
            tenant[~np.isin(tenant, list(declared))] = UNDECLARED
            columns = (tenant, *columns[1:])
            waiting = fold_undeclared(waiting, declared)
        asked: dict[
            str, float
        ] = {}  # requests per type: the window's completions and those waiting
        for kind in columns[1].tolist():
            asked[kind] = asked.get(kind, 0.0) + 1.0
        for v in self.views.values():
            waiting_by_type = None if v.state is None else v.state.waiting_by_type
            for kind, n in (waiting_by_type or {}).items():
                asked[kind] = asked.get(kind, 0.0) + float(n)
        report = governance_report(
            *columns,
            self._gov_params,
            duration_s=self.cluster.window_s,
            arrived=asked,
            waiting=waiting,
            governed=set(declared) if declared else None,
        )
        events = self._alerts.evaluate(report, None if immediate else t)
        figures: GovernanceReport = {
            **report,
            "alerts": dict(self._alerts.active),
            "alerts_pending": self._alerts.pending(),
            "alert_values": dict(self._alerts.value),
            "t_ms": t_ms,
        }
        self.governance = figures
        if self.store is not None:
            self._writer.pending.alerts += [AlertRow(t_ms=t_ms, **e) for e in events]
            if self._gov_stored is None or t - self._gov_stored >= self.cluster.window_s:
                self._writer.pending.governance.append(GovernanceRow(t_ms=t_ms, summary=figures))
                self._gov_stored = t
        return figures

    def _waiting_tenants(self, now: float) -> dict[str, dict[str, float]]:
        """Per tenant its requests waiting on the healthy replicas (``/state``'s
        ``waiting_by_tenant``) and how long it has had some waiting without its queue shrinking
        (a lower bound of its oldest request's wait: its requests were neither admitted nor
        dropped meanwhile), on this collector's clock."""
        counts: dict[str, int] = {}
        for v in self.views.values():
            if v.health.healthy:
                by_tenant = None if v.state is None else v.state.waiting_by_tenant
                for tenant, n in (by_tenant or {}).items():
                    counts[tenant] = counts.get(tenant, 0) + int(n)
        out: dict[str, dict[str, float]] = {}
        for tenant in list(self._waiting_since):
            if counts.get(tenant, 0) <= 0:
                del self._waiting_since[tenant]
        for tenant, n in counts.items():
            if n <= 0:
                continue
            since, last = self._waiting_since.get(tenant, (now, n))
            if n < last:  # some were admitted (or dropped): the oldest may be newer than ``since``
                since = now
            self._waiting_since[tenant] = (since, n)
            out[tenant] = {"requests": n, "waited_s": now - since}
        return out

    def subscribe(self, maxsize: int = 8) -> asyncio.Queue[ClusterSnapshot]:
        """A queue that receives a :class:`ClusterSnapshot` after every flush tick (oldest dropped
        when the reader falls behind)."""
        q: asyncio.Queue[ClusterSnapshot] = asyncio.Queue(maxsize=maxsize)
        self._subscribers.append(q)
        return q

    def unsubscribe(self, q: asyncio.Queue[ClusterSnapshot]) -> None:
        with contextlib.suppress(ValueError):
            self._subscribers.remove(q)

    def on_poll(self, fn: Callable[[str, PollResult], None]) -> None:
        """Call ``fn(replica, result)`` after every poll (synchronously, on the event loop)."""
        self._poll_listeners.append(fn)

    def _publish(self) -> None:
        if not self._subscribers:
            return
        snap = self.snapshot()
        for q in self._subscribers:
            if q.full():
                with contextlib.suppress(asyncio.QueueEmpty):
                    q.get_nowait()
            q.put_nowait(snap)

    @property
    def pending_rows(self) -> int:
        """Rows polled and not yet stored (a batch the store is writing or refused included)."""
        return self._writer.pending_rows

    # --- running ----------------------------------------------------------------------------
    async def start(self) -> None:
        """Register the replicas and load the persisted cursors (called by :meth:`run`)."""
        if self.store is None:
            return
        if self._alerts is not None:  # alerts firing when the last collector stopped still are
            for event in await asyncio.to_thread(
                self.store.governance.firing_alerts, self.cluster.name
            ):
                self._alerts.active[event["name"]] = event["severity"]
                value = (event.get("summary") or {}).get("value")
                if isinstance(value, (int, float)):
                    self._alerts.value.setdefault(event["name"], float(value))
        await asyncio.to_thread(
            self.store.recordings.ensure_replicas,
            self.cluster.name,
            [(r.name, r.api_url, r.control_url) for r in self.cluster.replicas],
        )
        positions = await asyncio.to_thread(
            self.store.recordings.cursor_positions, self.cluster.name
        )
        for name, (cursor, instance) in positions.items():
            view = self.views.get(name)
            if view is not None and cursor:
                self.views[name] = ReplicaView(
                    view.spec,
                    self.cluster.window_s,
                    cursor,
                    instance,
                    reserved=reserved_groups(self.cluster),
                )
        # The newest breaker trip recorded per replica: a restart writes no trip twice.
        for name, recorded in (
            await asyncio.to_thread(self.store.recordings.breaker_positions, self.cluster.name)
        ).items():
            if name in self.views:
                self.views[name].breaker_recorded = recorded

    async def run(self, stop: asyncio.Event) -> CollectorStats:
        """Poll until ``stop`` is set, then flush everything pending and return the stats."""
        if self._client is None:
            self._client = make_client(self.cluster)
        try:
            await self.start()
            await self._client.ready()  # made before the first tick: the first polls are on time
            tasks = [
                asyncio.create_task(self._replica_loop(v.name, stop), name=f"poll-{v.name}")
                for v in self.views.values()
            ]
            writer = asyncio.create_task(self._writer_loop(stop), name="collector-writer")
            stopping = asyncio.create_task(stop.wait())
            try:
                # The writer only ends early by failing (a store error other than busy): surface it.
                await asyncio.wait([stopping, writer], return_when=asyncio.FIRST_COMPLETED)
            finally:
                stopping.cancel()
                for (
                    task
                ) in tasks:  # an in-flight poll has applied nothing yet: cancelling it is safe
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                if not writer.done():
                    stop.set()
                await asyncio.gather(writer, return_exceptions=True)
            writer_error = writer.exception()
            if writer_error is not None:
                raise writer_error
            await self.flush(final=True)
            self._publish()
        finally:
            if self._own_client and self._client is not None:
                await self._client.aclose()
                self._client = None
        return self.stats

    async def poll(self, name: str) -> PollResult:
        """Poll one replica now and queue its rows for the writer."""
        assert self._client is not None, "poll() needs a client: run() or pass client="
        view = self.views[name]
        result = await poll_view(
            self._client, view, self.cluster.timeout_s, self.clock, metrics_every=self.metrics_every
        )
        self.stats.polls += 1
        if not result.sample.healthy:
            self.stats.failed_polls += 1
        if self.store is not None:
            self._writer.add(name, result)
        if result.breaker_trip is not None:
            self.stats.breaker_trips += int((result.breaker_trip.new or {}).get("new_trips") or 1)
            log.warning(
                "replica %s: circuit breaker tripped: %s", name, result.breaker_trip.message
            )
        for fn in self._poll_listeners:
            try:
                fn(name, result)
            except Exception:  # a listener's bug is not the replica's
                log.exception("poll listener %r failed", fn)
        return result

    async def _replica_loop(self, name: str, stop: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        interval = self.cluster.poll_interval_s
        # Spread the replicas over the first interval so that 64 polls do not land at once.
        index = list(self.views).index(name)
        next_at = loop.time() + interval * index / max(len(self.views), 1)
        while not stop.is_set():
            delay = next_at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)  # run() cancels this task when stop is set
                if stop.is_set():
                    return
            started = loop.time()
            try:
                await self.poll(name)
            except Exception as err:  # a collector bug must not silence this replica for good
                log.exception("polling %s failed", name)
                view = self.views[name]
                row = SampleRow(
                    replica=name,
                    t_ms=int(self.clock() * 1000),
                    healthy=False,
                    reason=f"collector error: {type(err).__name__}: {err}",
                )
                view.set_health(self.clock(), False, row.reason, view.health.mode)
                view.sample = row
                self.stats.polls += 1
                self.stats.failed_polls += 1
                if self.store is not None:
                    self._writer.pending.samples.append(row)
            # The next tick after this poll ended: missed ticks are skipped, never stacked.
            next_at += interval
            if next_at <= loop.time():
                next_at = started + interval * (1 + math.floor((loop.time() - started) / interval))

    async def _writer_loop(self, stop: asyncio.Event) -> None:
        """Every ``flush_interval_s``: a snapshot to the subscribers, and a flush unless the last
        one is still waiting for the store (a locked database never stalls the snapshots)."""
        flushing: asyncio.Task[int] | None = None
        try:
            while not stop.is_set():
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.flush_interval_s)
                if stop.is_set():
                    break
                self.govern()
                self._publish()
                if self.store is not None and (flushing is None or flushing.done()):
                    if flushing is not None:
                        flushing.result()  # a store error other than busy ends the collector
                    flushing = asyncio.create_task(self.flush())
        finally:
            if flushing is not None:
                await flushing

    async def flush(self, *, final: bool = False, deadline_s: float = 60.0) -> int:
        """Write what is pending as one batch; returns the rows written (0 if the store was busy:
        the rows stay pending for the next flush). ``final`` retries a busy store until
        ``deadline_s`` and then raises (:class:`~controlplane.writer.BatchWriter`)."""
        if self.store is None:
            return 0
        return await self._writer.flush(final=final, deadline_s=deadline_s)


async def poll_cluster_once(
    cluster: ClusterSpec,
    *,
    client: PollingClient | None = None,
    clock: Callable[[], float] = time.time,
) -> ClusterSnapshot:
    """``controlplane.poller.poll_once`` with completions, as a ClusterSnapshot with the governance
    figures of the replicas' windows and the alerts they raise now (``tailpilot status``)."""
    views = await poll_views(cluster, client, True, clock)
    collector = Collector(cluster, client=client, clock=clock)
    collector.views = {v.name: v for v in views}
    collector.govern(immediate=True)
    return collector.snapshot()

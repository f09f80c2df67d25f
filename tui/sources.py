"""Where the TUI's data comes from: a live cluster or a recording.

Both sources hand the app the same :class:`~controlplane.snapshot.ClusterSnapshot`, per-replica
histories of :class:`~storage.rows.SampleRow` for the plots and the settings audit log, so the
screens never know which one they have (:class:`DataSource`). The app awaits
:meth:`DataSource.next_snapshot` in one loop and applies each snapshot before reading the next:
refreshes never overlap.

* :class:`LiveSource` runs a :class:`~controlplane.collector.Collector` as a task of the app's
  own event loop (the polling is asyncio + aiohttp, ``controlplane/http.py``: the UI never blocks on
  the network); it keeps an in-memory ring of samples per replica (and, with a store, preloads the
  recent past from it); cluster changes go through :func:`controlplane.steering.apply_settings`.
  With ``controllers`` (``tailpilot demo``: the governor and the autopilot) it runs them beside
  its collector, as ``tailpilot record`` runs its ``tasks``.
* :class:`tui.replay.ReplaySource` reads a recording through :class:`storage.store.Store`:
  ``seek(t_ms)`` gives the snapshot as of ``t`` (``ReadingRepository.latest_samples(at_ms)``),
  ``step(±1)`` moves one sample of the reference replica, ``play``/``pause`` at a speed. It is
  read-only by construction: it has no way to reach a replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Coroutine, Mapping, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from controlplane.cluster import ClusterSpec
from controlplane.collector import Collector
from controlplane.poller import PollResult
from controlplane.snapshot import ClusterSnapshot
from controlplane.steering import ApplyResult, Change, apply_settings
from scheduler.errors import TailpilotError
from scheduler.settings import Settings
from storage.control import CONTROL_ACTIONS, ControllerName
from storage.rows import SampleRow
from storage.strict_json import finite
from tuner.closed_loop.whatif import WhatIfError, predict, verify

if TYPE_CHECKING:  # annotations only: the app passes the store it opened
    from storage.store import Store

log = logging.getLogger(__name__)

DEFAULT_HISTORY_S = 600.0  # how far back the replica plots reach
# A controller run beside the live collector until the source stops (controlplane.recorder's Task:
# called with the collector, the store and the stop event).
Controller = Callable[[Collector, Any, asyncio.Event], Coroutine[Any, Any, None]]
CONTROLLERS_STOP_S = 35.0  # a governor undoes its changes at the stop (30 s at most)


@runtime_checkable
class DataSource(Protocol):
    """What the app needs from a source of cluster data."""

    mode: str  # "live" | "replay"
    readonly: bool  # True: the source cannot change the cluster (replay)
    cluster_name: str
    history_s: float

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def next_snapshot(self) -> ClusterSnapshot:
        """Wait for the next snapshot to show."""
        ...

    def current(self) -> ClusterSnapshot | None: ...

    def history(self, replica: str, until_ms: int | None = None) -> list[SampleRow]:
        """The replica's samples of the last ``history_s`` up to ``until_ms``, oldest first."""
        ...

    def kv_trail(self, replica: str, n: int) -> list[float]:
        """The replica's last ``n`` KV usages (for the sparkline)."""
        ...

    async def audit(self, limit: int = 200) -> list[dict[str, Any]]:
        """The settings audit log, newest first (SettingsLog.settings_changes' dicts)."""
        ...

    async def fidelity(self) -> dict[str, dict[str, Any]]:
        """Replica name -> its newest fidelity report (TunerResults.latest_fidelity's dicts)."""
        ...

    async def verifications(self) -> dict[tuple[str, int | None], dict[str, Any]]:
        """(replica, settings version) -> realized vs predicted of each change kept with a
        prediction (tuner.closed_loop.whatif.verify), as of now (replay: the position)."""
        ...

    async def alert_events(self, limit: int = 200) -> list[dict[str, Any]]:
        """Governance alert transitions, newest first (replay: up to the position)."""
        ...

    async def control(self, controller: ControllerName) -> dict[str, Any] | None:
        """``controller``'s control row (live with a store — the governor's also needs a governed
        cluster), else None."""
        ...

    def status(self) -> str:
        """One line for the top bar."""
        ...


def fmt_time(t_ms: int | None) -> str:
    """UTC wall time of a sample, ``2023-11-14 22:13:20``."""
    if t_ms is None:
        return "—"
    return datetime.fromtimestamp(t_ms / 1000, tz=UTC).strftime("%Y-%m-%d %H:%M:%S")


def fmt_clock(t_ms: int | None) -> str:
    if t_ms is None:
        return "—"
    return datetime.fromtimestamp(t_ms / 1000, tz=UTC).strftime("%H:%M:%S")


def fmt_offset(ms: int) -> str:
    s = max(ms, 0) // 1000
    h, rest = divmod(s, 3600)
    m, sec = divmod(rest, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m:02d}:{sec:02d}"


# ------------------------------------------------------------------------------------------ live


class LiveSource:
    """A running collector in the app's event loop, with in-memory histories."""

    mode = "live"
    readonly = False

    def __init__(
        self,
        cluster: ClusterSpec,
        store: Store | None = None,
        *,
        history_s: float = DEFAULT_HISTORY_S,
        collector: Collector | None = None,
        who: str = "tui",
        refresh_s: float = 1.0,
        clock: Callable[[], float] = time.time,
        controllers: Sequence[Controller] = (),
    ) -> None:
        if controllers and store is None:
            raise ValueError("controllers run on a store (their control rows live there)")
        self.cluster = cluster
        self.clock = clock  # seconds since the epoch: sample stamps, the preload window, audit rows
        self.cluster_name = cluster.name
        self.store = store
        self.history_s = float(history_s)
        self.who = who
        self.collector = collector or Collector(
            cluster, store, flush_interval_s=refresh_s, clock=clock
        )
        n = max(8, math.ceil(self.history_s / cluster.poll_interval_s) + 2)
        self.histories: dict[str, deque[SampleRow]] = {
            r.name: deque(maxlen=n) for r in cluster.replicas
        }
        # The changes made from this TUI (the audit log without a store)
        self.session_audit: list[dict[str, Any]] = []
        self._queue: asyncio.Queue[ClusterSnapshot] | None = None
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._latest: ClusterSnapshot | None = None
        self.error: str | None = None  # why the collector stopped, if it did
        self.controllers = tuple(controllers)
        self._controller_tasks: list[asyncio.Task[None]] = []
        self.collector.on_poll(self._on_poll)

    # --- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        self._queue = self.collector.subscribe(maxsize=1)
        if self.store is not None:
            await self._preload()
        self._task = asyncio.create_task(self._run(), name="tailpilot-collector")
        self._controller_tasks = [
            asyncio.create_task(self._control(c), name=f"tailpilot-controller-{i}")
            for i, c in enumerate(self.controllers)
        ]

    async def _control(self, controller: Controller) -> None:
        try:
            await controller(self.collector, self.store, self._stop)
        except asyncio.CancelledError:
            raise
        except Exception as err:  # a controller's failure never stops the view
            log.exception("controller stopped")
            self.error = f"a controller stopped: {type(err).__name__}: {err}"

    async def _preload(self) -> None:
        assert self.store is not None  # start() preloads only with a store
        since = int((self.clock() - self.history_s) * 1000)
        for name, ring in self.histories.items():
            try:
                rows = await asyncio.to_thread(
                    self.store.readings.samples, self.cluster_name, name, since
                )
            except Exception as err:
                log.warning("could not preload history of %s: %s", name, err)
                return
            ring.extend(rows)

    async def _run(self) -> None:
        try:
            await self.collector.run(self._stop)
        except asyncio.CancelledError:
            raise
        except Exception as err:
            log.exception("collector stopped")
            self.error = f"collector stopped: {type(err).__name__}: {err}"

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._task), 10.0)
            except (TimeoutError, Exception):
                self._task.cancel()
                with contextlib.suppress(BaseException):
                    await self._task
        if self._controller_tasks:  # they see the same stop event; a governor undoes its changes
            _, late = await asyncio.wait(self._controller_tasks, timeout=CONTROLLERS_STOP_S)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        if self._queue is not None:
            self.collector.unsubscribe(self._queue)

    # --- data ----------------------------------------------------------------------------------
    def _on_poll(self, replica: str, result: PollResult) -> None:
        ring = self.histories.get(replica)
        if ring is not None:
            ring.append(result.sample)

    async def next_snapshot(self) -> ClusterSnapshot:
        assert self._queue is not None, "start() first"
        snap = await self._queue.get()
        self._latest = snap
        return snap

    def current(self) -> ClusterSnapshot | None:
        return self._latest

    def history(self, replica: str, until_ms: int | None = None) -> list[SampleRow]:
        ring = self.histories.get(replica)
        if not ring:
            return []
        rows = list(ring)
        if until_ms is not None:
            rows = [r for r in rows if r.t_ms <= until_ms]
        if rows:
            lo = rows[-1].t_ms - int(self.history_s * 1000)
            rows = [r for r in rows if r.t_ms >= lo]
        return rows

    def kv_trail(self, replica: str, n: int) -> list[float]:
        ring = self.histories.get(replica)
        if not ring:
            return []
        out: list[float] = []
        for row in reversed(ring):
            if row.kv_usage is not None:
                out.append(row.kv_usage)
                if len(out) >= n:
                    break
        out.reverse()
        return out

    async def audit(self, limit: int = 200) -> list[dict[str, Any]]:
        if self.store is None:
            return list(reversed(self.session_audit))[:limit]
        return await asyncio.to_thread(
            self.store.settings_log.settings_changes, self.cluster_name, None, limit
        )

    async def fidelity(self) -> dict[str, dict[str, Any]]:
        if self.store is None:
            return {}
        return await asyncio.to_thread(latest_fidelity, self.store, self.cluster_name, None)

    async def alert_events(self, limit: int = 200) -> list[dict[str, Any]]:
        if self.store is None:
            return []
        return await asyncio.to_thread(
            self.store.governance.alert_events, self.cluster_name, limit=limit
        )

    async def control(self, controller: ControllerName) -> dict[str, Any] | None:
        if self.store is None or (controller == "governor" and self.cluster.governance is None):
            return None
        return await asyncio.to_thread(self.store.governance.control, controller, self.cluster_name)

    async def steer(
        self, controller: ControllerName, choice: str, who: str | None = None
    ) -> dict[str, Any]:
        """pause | resume | arm | dry-run | disarm ``controller`` (its control row, read by the
        controller in ``tailpilot record`` at its next tick)."""
        store = self.store
        assert store is not None, f"the {controller} is steered through the store (live with --db)"
        return await asyncio.to_thread(
            store.governance.set_control,
            controller,
            self.cluster_name,
            who=who or self.who,
            **CONTROL_ACTIONS[choice],
        )

    async def verifications(self) -> dict[tuple[str, int | None], dict[str, Any]]:
        if self.store is None:
            return {}
        return await asyncio.to_thread(
            kept_verifications, self.store, self.cluster_name, int(self.clock() * 1000)
        )

    def status(self) -> str:
        if self.error:
            return self.error
        return (
            f"LIVE · polling every {self.cluster.poll_interval_s:g} s"
            f" · window {self.cluster.window_s:g} s"
        )

    # --- changing the cluster ------------------------------------------------------------------
    async def apply(
        self, changes: Mapping[str, Change], who: str | None = None
    ) -> list[ApplyResult]:
        """Apply ``{replica: change}`` (each applied to that replica's current Settings) with
        :func:`controlplane.steering.apply_settings`: GET, PUT If-Match, read back, audit row."""
        who = who or self.who
        groups = await asyncio.gather(
            *(
                apply_settings(self.cluster, [name], change, self.store, who)
                for name, change in changes.items()
            )
        )
        results = [r for g in groups for r in g]
        now = int(self.clock() * 1000)
        for r in results:
            self.session_audit.append(
                {
                    "t_ms": now,
                    "cluster": self.cluster_name,
                    "replica": r.replica,
                    "who": who,
                    "old": r.old,
                    "new": r.new,
                    "result": r.result,
                    "message": r.message,
                    "version": r.version,
                }
            )
        return results

    async def predict(self, plans: list[dict[str, Any]], minutes: float) -> dict[str, Any]:
        """Per sendable plan, the what-if prediction of its new settings over its old ones on the
        replica's last ``minutes`` of recorded traffic (tuner.closed_loop.whatif), or why there is
        none."""
        if self.store is None:
            return {
                p["replica"]: "no --db: no recorded traffic to predict on"
                for p in plans
                if p.get("new")
            }
        store = self.store
        now_ms = int(self.clock() * 1000)

        def one(plan: dict[str, Any]) -> Any:
            try:
                return finite(
                    predict(
                        store,
                        self.cluster_name,
                        plan["replica"],
                        Settings.model_validate(plan["old"]),
                        Settings.model_validate(plan["new"]),
                        now_ms=now_ms,
                        minutes=minutes,
                    )
                )
            except WhatIfError as err:
                return str(err)

        sendable = [p for p in plans if p.get("new") and p.get("old")]
        done = await asyncio.gather(*(asyncio.to_thread(one, p) for p in sendable))
        return {p["replica"]: d for p, d in zip(sendable, done)}

    async def keep_predictions(
        self, results: list[ApplyResult], predictions: dict[str, Any], applied_ms: int
    ) -> None:
        """Keep each applied change's prediction with its new version (for tailpilot verify)."""
        if self.store is None:
            return
        for r in results:
            p = predictions.get(r.replica)
            if r.ok and isinstance(p, dict):
                await asyncio.to_thread(
                    self.store.tuner.store_prediction,
                    self.cluster_name,
                    r.replica,
                    p,
                    t_ms=applied_ms,
                    version=r.version,
                )


# ----------------------------------------------------------------------------------- store reads
# (both sources')


def latest_fidelity(store: Store, cluster: str, at_ms: int | None) -> dict[str, dict[str, Any]]:
    """The newest fidelity report per replica (made at or before ``at_ms``)."""
    return {r["replica"]: r for r in store.tuner.latest_fidelity(cluster, at_ms=at_ms)}


def kept_verifications(
    store: Store, cluster: str, now_ms: int
) -> dict[tuple[str, int | None], dict[str, Any]]:
    """Realized vs predicted of the changes kept with a prediction before ``now_ms`` (replays:
    call off the UI thread)."""
    kept = [p for p in store.tuner.predictions(cluster) if p["t_ms"] <= now_ms]
    return {(p["replica"], p["version"]): verify(store, p, now_ms=now_ms) for p in kept}


class ReplayError(TailpilotError, ValueError):
    """A recording that cannot be replayed (no cluster, several clusters, no samples)."""

"""Simulated "twin" replicas: the engine simulator run in (optionally accelerated) real time
behind the same control API as a real replica, plus vLLM's ``/metrics``, ``/health`` and
``/v1/models`` on the same port, so the collector, ``tailpilot set``, the TUI and the tuner cannot
tell a twin from a vLLM replica running the tailpilot plugin except by its name.

    with start_twins(4, speed=10, rate_scale=4, token="t") as cluster:  # tuner.twins.cluster
        cluster.write_cluster_yaml("twins.yaml")
        ...  # point the collector at cluster.replicas[i].url

Time. A twin's replica clock is ``epoch + wall seconds since the clock started × speed``
(``TwinClock``; every twin of a cluster shares one clock, as a load balancer's replicas share
wall time). Simulated time ``s`` is replica time ``epoch + s``: the trace's first arrival is at
``s = 0``, and every timestamp the API serves (arrival, first token, finish, ``time``) is on the
replica clock, so the latencies read off a twin are the simulated ones.

Advancing. One background thread per process (``_Ticker``) calls ``TwinReplica.advance`` on
every running twin every ``tick_s`` of wall time (50 ms by default): it feeds the arrivals due by
the replica clock (``Simulator.extend_arrivals``), hands staged settings to the simulator
(``Simulator.apply_settings``) and runs it to the clock (``Simulator.advance_to``, which skips
over stretches of identical decode steps), a tick's simulated time per slice for at most
``TICK_BUDGET_TICKS`` ticks of wall time (a twin slower than its clock lags, its API answering).
One thread for all twins never overlaps itself and costs one wake-up per tick however many run.

Settings, versions, ``If-Match``/409, validation (400 naming the field), ``restart_required``,
the completions log with its cursor and the step log are ``ReplicaCore``'s, exactly as in the
plugin: a staged document becomes active at the twin's next simulator step
(``ReplicaCore.take_pending``), or at the next tick when the engine is idle (as the plugin applies
a change to an idle vLLM engine at once, which would otherwise not step until new work arrives).
Engine fields vLLM cannot change live (``RESTART_REQUIRED_ENGINE_FIELDS``) show in the settings
document but, as on vLLM, the running engine keeps its start-up values. The ``oracle`` predictor is
refused, as on a live replica.

Workload. ``start_twins`` (``tuner/twins/cluster.py``) splits the trace across the replicas
round-robin by arrival order, each share replayed lap after lap with ``loop=True``
(``tuner/twins/feed.py``).

Step log. Every single step is recorded (``/tailpilot/v1/steps``); a stretch of k identical
decode steps that event skipping advances as one is recorded by its first and last steps only
(their context and duration differ by the KV growth across the stretch, which is what fits ``e``).

Metrics. A ``prometheus_client`` registry per twin with vLLM 0.32's metrics, read at scrape time
under the twin's lock, so ``/metrics`` and ``/state`` agree (``tuner/twins/metrics.py``).

Rooms: this module holds the clock, the ticker and the replica (its engine loop and the API it
serves); ``tuner/twins/cluster.py`` starts a fleet of them (``start_twins``, ``TwinCluster``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from scheduler.plugin.admission import Limits
from scheduler.plugin.api import ControlServer, token_from_env
from scheduler.plugin.core import ReplicaCore
from scheduler.settings import RESTART_REQUIRED_ENGINE_FIELDS, Settings
from scheduler.settings_change import SettingsChange
from sim.engine import EngineConfig, Simulator
from sim.traces import TraceRequest
from tuner.twins.feed import Feed, trace_period
from tuner.twins.metrics import TwinCollector, TwinStats

log = logging.getLogger(__name__)

DEFAULT_TICK_S = 0.05  # 64 busy twins: ~10% of one core at 0.05 s, ~15% at 0.025 s
TICK_BUDGET_TICKS = 4  # one tick advances a twin for at most this many ticks' wall time
DEFAULT_MAX_MODEL_LEN = 8192  # Llama-3-8B, the default step-time model's model


# ------------------------------------------------------------------------------------- clocks
class TwinClock:
    """Replica time: ``epoch + (wall seconds since creation) × speed``."""

    def __init__(self, speed: float = 1.0, epoch: float | None = None) -> None:
        if not (isinstance(speed, (int, float)) and speed > 0 and speed < float("inf")):
            raise ValueError(f"speed must be a finite number > 0, got {speed!r}")
        self.speed = float(speed)
        self.epoch = time.time() if epoch is None else float(epoch)
        self._wall0 = time.monotonic()

    def sim_time(self) -> float:
        """Simulated seconds since the epoch."""
        return (time.monotonic() - self._wall0) * self.speed

    def now(self) -> float:
        return self.epoch + self.sim_time()


class ManualClock(TwinClock):
    """A clock that moves only when told (tests): ``set(s)`` / ``advance(ds)`` in simulated s."""

    def __init__(self, epoch: float | None = None) -> None:
        super().__init__(1.0, epoch)
        self.t = 0.0

    def sim_time(self) -> float:
        return self.t

    def set(self, t: float) -> None:
        self.t = float(t)

    def advance(self, dt: float) -> None:
        self.t += float(dt)


async def drive_on_manual_clock(
    clock: ManualClock,
    twins: Sequence[TwinReplica],
    collector: Any,
    controller: Any,
    client: Any,
    *,
    t_end: float,
    until: Callable[[Any], bool] | None = None,
) -> None:
    """Move the twins 2 s at a time on a manual clock (replica seconds: the caller moves the
    clock, not the machine — tests and CPU benchmarks), poll each with ``collector``, and step
    ``controller`` (``step(client)``: the live autopilot) every 6 s, until ``t_end`` or
    ``until(controller)``."""
    t = clock.t
    while t < t_end:
        t += 2.0
        clock.set(t)
        for twin in twins:
            twin.advance(t)
            await collector.poll(twin.name)
        await collector.flush()
        if round(t) % 6 == 0:
            await controller.step(client)
            if until is not None and until(controller):
                return


# ------------------------------------------------------------------------------------- ticker
class _Ticker:
    """One thread advancing every registered twin every ``interval`` s of wall time."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._replicas: list[TwinReplica] = []
        self.lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def add(self, replica: TwinReplica) -> None:
        with self.lock:
            if replica not in self._replicas:
                self._replicas.append(replica)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name=f"tailpilot-twins-{self.interval:g}s", daemon=True
                )
                self._thread.start()

    def remove(self, replica: TwinReplica) -> None:
        with self.lock:
            if replica in self._replicas:
                self._replicas.remove(replica)

    def _run(self) -> None:
        next_t = time.monotonic()
        while True:
            with self.lock:
                replicas = list(self._replicas)
                if not replicas:
                    self._thread = None
                    return
            for replica in replicas:
                replica._tick()
            next_t += self.interval
            delay = next_t - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            else:  # behind (more work than a tick holds): carry on, do not try to catch up ticks
                next_t = time.monotonic()


_tickers: dict[float, _Ticker] = {}
_tickers_lock = threading.Lock()


def _ticker(interval: float) -> _Ticker:
    with _tickers_lock:
        if interval not in _tickers:
            _tickers[interval] = _Ticker(interval)
        return _tickers[interval]


# ------------------------------------------------------------------------------------- replica
class TwinReplica:
    """One simulated replica: a simulator on a replica clock behind the control API and vLLM's
    metrics, on ``host:port`` (``port=0``: an ephemeral port, kept across ``stop``/``start``)."""

    def __init__(
        self,
        name: str,
        requests: Sequence[TraceRequest] = (),
        *,
        period: float | None = None,
        loop: bool = True,
        settings: Settings | None = None,
        config: EngineConfig | None = None,
        clock: TwinClock | None = None,
        speed: float = 1.0,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        tick_s: float = DEFAULT_TICK_S,
        model_name: str | None = None,
        max_model_len: int = DEFAULT_MAX_MODEL_LEN,
    ) -> None:
        self.name = name
        self.model_name = model_name or name
        self.max_model_len = max_model_len
        self.clock = clock or TwinClock(speed)
        self.config = config or EngineConfig()
        self.startup_settings = settings or Settings.model_validate({"policy": "sarathi"})
        self.token = token if token is not None else token_from_env()
        self.host, self.port = host, port
        self.tick_s = tick_s
        self._requests = list(requests)
        self._period = period if period is not None else trace_period(self._requests)
        self._loop = loop
        # The simulator and the stats: the ticker vs the API's and the scraper's reads.
        self.lock = threading.RLock()
        self._running = False
        self._server: ControlServer | None = None
        self.error: str | None = None
        self.started_at: float | None = None
        self._reset()

    # --- lifecycle ------------------------------------------------------------------------
    def _reset(self, at: float = 0.0) -> None:
        """A fresh process: new core (settings version 1, cursor 0), simulator and counters;
        the workload resumes at simulated time ``at``."""
        self.core = ReplicaCore(self.startup_settings, replica=self.name, clock=self._time)
        self.core.tenant_source = "gateway"  # its own feeder labels its requests, from the trace
        self._feed = Feed(self._requests, self._period, self._loop)
        self._feed.skip_to(at)
        sim = Simulator([], self.startup_settings, self.config)
        sim.step_listener = self._on_step
        if at > 0:
            sim.advance_to(at)  # idle: just moves its clock
        self.sim = sim
        self.stats = TwinStats(self.max_model_len)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(TwinCollector(self))
        self.error = None

    def start(self) -> TwinReplica:
        """Serve and advance (again, after ``stop``: on the same port, state kept; the simulator
        catches up with the replica clock, as a replica that was unreachable but running)."""
        with self.lock:
            if self._running:
                return self
            # One port serves what a vLLM replica splits over two (its API server's /metrics and the
            # plugin's control API), so a poller's connection may make twice the plugin's requests.
            stock = Limits()
            limits = Limits(
                rate_per_connection=2 * stock.rate_per_connection,
                rate_per_address=2 * stock.rate_per_address,
            )
            self._server = ControlServer(
                self, host=self.host, port=self.port, token=self.token, limits=limits
            ).start()
            self.port = self._server.port
            self._running = True
            if self.started_at is None:
                self.started_at = time.time()
        _ticker(self.tick_s).add(self)
        return self

    def stop(self) -> None:
        """Stop serving (connections refused) and advancing; the port is kept for ``start``."""
        _ticker(self.tick_s).remove(self)
        with self.lock:
            self._running = False
            server, self._server = self._server, None
        if server is not None:
            server.stop()

    def restart(self, fresh: bool = False) -> TwinReplica:
        """``stop`` then ``start`` on the same port. ``fresh=True`` is a process restart: requests
        in flight are lost, the settings are the start-up ones at version 1, the completions
        cursor and vLLM's counters restart from 0, and new arrivals come from the replica clock
        on."""
        self.stop()
        if fresh:
            with self.lock:
                self._reset(at=max(self.clock.sim_time(), self.sim.now))
        return self.start()

    @property
    def running(self) -> bool:
        return self._running

    @property
    def url(self) -> str:
        """Base URL: the vLLM-like API (``/metrics``, ``/v1/models``, ``/health``) and the control
        API (``/tailpilot/v1/...``) both live here."""
        return f"http://{self.host}:{self.port}"

    @property
    def control_url(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"TwinReplica({self.name!r}, {self.url}, running={self._running})"

    # --- advancing ------------------------------------------------------------------------
    def _time(self) -> float:
        """The replica clock as the API reports it (never behind the simulator's last step end)."""
        return max(self.clock.now(), self.clock.epoch + self.sim.now)

    def _tick(self) -> None:
        if not self._running:
            return
        try:
            self.advance(max_wall_s=TICK_BUDGET_TICKS * self.tick_s)
        except Exception as err:  # a broken twin reports unhealthy; the others carry on
            log.exception("twin %s stopped advancing", self.name)
            self.error = f"{type(err).__name__}: {err}"
            _ticker(self.tick_s).remove(self)

    def advance(self, t: float | None = None, *, max_wall_s: float | None = None) -> int:
        """Run the simulator to simulated time ``t`` (default: the replica clock now); returns the
        simulator's loop iterations. ``max_wall_s`` (the ticker's): stop at the end of the slice
        (a tick's simulated time) that spends it, the lock released between slices."""
        if t is None:
            t = self.clock.sim_time()
        started, n = time.monotonic(), 0
        slice_s = float("inf") if max_wall_s is None else self.tick_s * self.clock.speed
        while True:
            with self.lock:  # released between slices: the API's readers get their turn
                if self.error is not None:
                    return n
                before = self.sim.now
                n += self._advance_to(min(t, before + slice_s))
                if self.sim.now >= t or self.sim.now <= before:  # there, or tripped and recovering
                    return n
            if max_wall_s is None or time.monotonic() - started >= max_wall_s:
                return n

    def _advance_to(self, t: float) -> int:
        sim = self.sim
        new = self._feed.until(t)
        if new:
            sim.extend_arrivals(new)
        settings = self.core.take_pending()  # busy: before the next step; idle: now
        if settings is not None:
            sim.apply_settings(self._effective(settings))
        try:
            n = sim.advance_to(t)
        except Exception as err:  # the circuit breaker, as in the plugin: fall back, carry on
            self._trip(sim, err)
            n = 0
        else:
            self.core.step_succeeded()
        self._collect(sim)
        return n

    def _trip(self, sim: Simulator, err: Exception) -> None:
        """A policy raised inside the simulator's step: run the fallback document the core names
        (``ReplicaCore.note_trip``) from here on. If the simulator's own books are broken the
        twin stops advancing (``_tick`` reports it unhealthy)."""
        fallback = self.core.note_trip(err, self._time())
        try:
            sim.recover(self._effective(fallback))
        except AssertionError:
            raise
        except Exception as again:  # the restored document fails too: the stock order cannot
            sim.recover(self._effective(self.core.note_trip(again, self._time(), stock=True)))

    def _effective(self, settings: Settings) -> Settings:
        """What the running engine actually runs: engine fields vLLM cannot change live keep
        their start-up values (the settings document shows the staged ones, as on vLLM)."""
        engine = settings.engine.model_dump()
        fixed = {
            f: getattr(self.startup_settings.engine, f) for f in RESTART_REQUIRED_ENGINE_FIELDS
        }
        if all(engine[f] == v for f, v in fixed.items()):
            return settings
        return SettingsChange(engine=fixed).apply(settings)

    def _on_step(
        self, now: float, prefill: int, prefill_sq: int, decodes: int, context: int, k: int
    ) -> None:
        model = self.config.step_model
        started = self.clock.epoch + now
        d0 = model.step_time(prefill, prefill_sq, decodes, context)
        core = self.core
        core.record_step(started, d0, prefill, prefill_sq, decodes, context)
        self.stats.observe_step(prefill, decodes, k)
        if k > 1:  # a stretch of k identical decode steps: record its last step too
            j = k - 1
            ctx = context + decodes * j
            dj = model.step_time(0, 0, decodes, ctx)
            core.record_step(started + j * d0 + (dj - d0) * (j - 1) / 2.0, dj, 0, 0, decodes, ctx)

    def _collect(self, sim: Simulator) -> None:
        """Move the simulator's new completions into the completions log and the metrics."""
        core, stats, epoch = self.core, self.stats, self.clock.epoch
        done, rejected = sim.drain()  # the log owns them now (a twin may run for days)
        if done:
            records = []
            for c in done:
                arrival, n = c.arrival, c.output_tokens
                max_tokens = self._feed.max_tokens_of(c.id)
                records.append(
                    {
                        "id": c.id,
                        "tenant": c.tenant,
                        "type": c.type,
                        "arrival": epoch + arrival,
                        "received_at": epoch + arrival,
                        "scheduled_at": epoch + c.scheduled_at,
                        "first_token_at": epoch + c.first_token_at,
                        "finished_at": epoch + c.finished_at,
                        "prompt_tokens": c.prompt_tokens,
                        "output_tokens": n,
                        "max_tokens": max_tokens,
                        "preemptions": c.preemptions,
                        "recomputed_tokens": c.recomputed_tokens,
                        "reason": "finished",
                    }
                )
                stats.observe_completion(c, max_tokens)
            core.log_completions(records)
        stats.rejected += len(rejected)
        core.preemptions_total = sim.preemptions
        core.recomputed_tokens_total = sim.recomputed_tokens
        core.steps_total = sim.steps
        core.refused_total = sim.refused

    # --- what the API reads -----------------------------------------------------------------
    def kv(self) -> dict[str, Any]:
        """The KV cache's blocks in use, of how many, and their share."""
        total = self.config.num_gpu_blocks
        used = total - self.sim.free_blocks
        return {
            "used_blocks": used,
            "total_blocks": total,
            "usage": used / total if total else 0.0,
            "block_size": self.config.block_size,
            "prefix_caching": self.config.prefix_caching,
        }

    def api_state(self, cursor: int | None) -> dict[str, Any]:
        with self.lock:
            sim = self.sim
            state = self.core.state(
                cursor,
                self.kv(),
                waiting=list(sim.waiting),
                running=len(sim.running),
                live=dict(sim.policy.live_state()),
            )
        state["speed"] = self.clock.speed
        return state

    def api_inflight(self, limit: int) -> dict[str, Any]:
        with self.lock:
            held = [*self.sim.waiting, *self.sim.running]
            doc = self.core.inflight(limit, held)
        # The simulator's requests count from the twin's epoch; the document's times are the
        # replica clock's (``time``), as its completions' are.
        epoch = self.clock.epoch
        for r in doc["requests"]:
            for key in ("arrival", "received_at"):
                if r.get(key) is not None:
                    r[key] += epoch
        return doc

    def api_settings(self) -> dict[str, Any]:
        return self.core.settings_doc()

    def api_put_settings(
        self, doc: dict[str, Any], if_match: int | None, lease: tuple[str, str] | None = None
    ) -> dict[str, Any]:
        return self.core.put_settings(doc, if_match, lease)

    def api_lease(self, doc: dict[str, Any]) -> dict[str, Any]:
        return self.core.leases.take(doc)

    def api_steps(self, cursor: int) -> dict[str, Any]:
        steps, next_cursor = self.core.steps_since(cursor)
        return {"replica": self.core.replica, "steps": steps, "next_cursor": next_cursor}

    def api_metrics(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def api_models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.model_name,
                    "object": "model",
                    "created": int(self.started_at or time.time()),
                    "owned_by": "vllm",
                    "root": self.model_name,
                    "parent": None,
                    "max_model_len": self.max_model_len,
                    "permission": [],
                }
            ],
        }

    def api_health(self) -> bool:
        return self.error is None

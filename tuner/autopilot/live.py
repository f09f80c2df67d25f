"""The autopilot on a live cluster (``tailpilot record --autopilot [--arm]``; README, "The
autopilot").

One controller (``tuner.autopilot.controller.Autopilot``) per replica, fed only what the replica
reports: its completions (the recorder's polls), its requests in flight (``GET /inflight``: arrival,
prompt length, the client's cap, tokens generated so far — never an output length) and its clock.
Every ``tick_s`` each replica's controller is shown what came since the last tick; when it decides
to switch, the live driver carries the decision out.

States (the store's autopilot control row, steered by ``tailpilot autopilot`` and the TUI's O):

* ``dry-run`` (the default): decisions are only written to the audit log (result ``dry-run``);
* ``armed``: a decision goes through the same path as an operator's change, carried out by the
  host (``controlplane.controller_host.carry_out``: the lease, then
  ``controlplane.steering.apply_settings``: If-Match, read back, audit row, who = ``autopilot``)
  with its predicted change in the note, and is kept as a prediction for ``tailpilot verify``;
* ``disarmed``: nothing runs (the controllers are dropped; arming again starts them afresh).

**One arbiter of settings**, in this order:

1. the operator's pins: a pinned parameter is never moved, and a replica with any pin never has its
   policy changed (that would drop the pins);
2. the governor: while any of its emergency modes is applied on the cluster, the autopilot applies
   nothing (its shadows keep running, the status says why); the operator's ``pause`` holds it too
   — both read by the controller host (``controlplane.controller_host``: ``PRECEDENCE`` and
   ``ControlRow.held``), which also reads and writes the control row;
3. the autopilot, on replicas running ``uniboost`` or ``sarathi`` only (a multi-tenant policy is
   the governor's to steer).

An armed autopilot owns γ: an operator's unpinned change is undone at its next decision. To hold a
setting, pin it or disarm the autopilot.

**Verify and step back.** ``verify_minutes`` after an applied switch, the traffic that came after
it is replayed under the previous settings (``tuner.closed_loop.whatif.verify``: the
counterfactual); the realized P95 TTFT change is compared with the predicted one. When it is worse
than predicted by more than the band (the replica's fidelity band, else ``band``)
``step_back_after`` times in a row, the autopilot steps back to the defaults and holds them for
``hold_s`` (the controller machine's ledger, ``controlplane.verification``, keeps the count).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from controlplane.controller_host import ControlRow, Outcome, carry_out, run_controller, tick
from controlplane.replica_http import (
    HttpFailure,
    PollingClient,
    StateFormatError,
    fetch_inflight,
    make_client,
)
from controlplane.steering import LeaseKeeper
from controlplane.verification import Miss, Verifier
from scheduler import contract
from scheduler.settings import Settings
from sim.engine import EngineConfig
from tuner.autopilot.candidates import TargetChange, blocked, running_candidate, runs_choice
from tuner.autopilot.controller import Autopilot, AutopilotConfig
from tuner.autopilot.records import WHO, decision_note, decision_row, decision_summary
from tuner.autopilot.replica_pilot import FUTURE_SLACK_S, ReplicaPilot
from tuner.autopilot.types import Decision
from tuner.closed_loop.replica_facts import ReplicaUnreachable, fetch_engine_facts, replica_engine
from tuner.closed_loop.whatif import verify

if TYPE_CHECKING:  # the caller's collector and store (the collector runs this in its loop)
    from controlplane.cluster import ClusterSpec, ReplicaSpec
    from controlplane.collector import Collector
    from controlplane.poller import PollResult
    from storage.store import Store

log = logging.getLogger("tailpilot.autopilot")

STEERED_POLICIES = ("uniboost", "sarathi")


class LiveConfig(BaseModel):
    """The live driver's knobs (the controller's own are ``AutopilotConfig``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tick_s: float = Field(5.0, gt=0.0, le=600.0)  # wall seconds between observations
    # After a switch, before verifying it.
    verify_minutes: float = Field(10.0, gt=0.0, le=7 * 24 * 60.0)
    # The predicted band where the replica has no fidelity band.
    band: float = Field(0.10, ge=0.0, le=10.0)
    # Realized worse than predicted this many times in a row: step back.
    step_back_after: int = Field(2, ge=1, le=100)
    # On the defaults after a step back (replica seconds).
    hold_s: float = Field(3_600.0, ge=0.0, le=7 * 86_400.0)
    decisions_kept: int = Field(10, ge=1, le=1_000)  # per replica, in the status
    # Armed on these replicas only, the others in dry-run (None: every replica the row arms).
    armed_replicas: tuple[str, ...] | None = Field(None, max_length=10_000)


def _whatif_verify(store: Store, prediction: dict[str, Any], now_ms: int) -> dict[str, Any]:
    return verify(store, prediction, now_ms=now_ms)


def promise_of_cluster(config: AutopilotConfig, cluster: ClusterSpec) -> AutopilotConfig:
    """The configuration the cluster file completes: where its governance block declares tenants
    and their SLOs and the configuration's promise declares none, the promise is theirs (SCR,
    then JFI, then the objective)."""
    governance = cluster.governance
    if governance is None or config.promise.slo is not None:
        return config
    promise = config.promise.model_copy(update={"slo": governance.params()})
    return config.model_copy(update={"promise": promise})


class LiveAutopilot:
    """The live driver: ``on_poll`` is the collector's hook (completions), ``step`` one tick."""

    def __init__(
        self,
        collector: Collector,
        store: Store,
        config: AutopilotConfig | None = None,
        live: LiveConfig | None = None,
        *,
        clock: Callable[[], float] = time.time,
        verifier: Verifier | None = None,
        engine_for: Callable[[str], EngineConfig] | None = None,
    ) -> None:
        self.collector = collector
        self.cluster = collector.cluster
        self.store = store
        self.config = promise_of_cluster(config or AutopilotConfig(), self.cluster)
        self.live = live or LiveConfig()
        self.clock = clock
        self.verifier = verifier or _whatif_verify
        self.engine_for = engine_for or self._replica_engine
        self.pilots: dict[str, ReplicaPilot] = {}
        self.notes: dict[str, str] = {}  # replicas without a controller: why
        self.state = "dry-run"
        self.held: str | None = None
        # One owner per knob: this process's lease on each replica it steers (a second autopilot
        # on the same replica sees it and dry-runs there, saying who holds it).
        self.leases = LeaseKeeper("autopilot")

    # --- inputs ----------------------------------------------------------------------------
    def on_poll(self, replica: str, result: PollResult) -> None:
        rp = self.pilots.get(replica)
        if rp is not None and result.completions:
            rp.completions.extend(result.completions)

    def _replica_engine(self, replica: str) -> EngineConfig:
        """The replica's engine as the what-if sees it (calibrated step model, KV blocks)."""
        spec = self.cluster.replica(replica)
        try:
            facts = fetch_engine_facts(spec.control_url, timeout=self.cluster.timeout_s)
        except ReplicaUnreachable:
            facts = None
        return replica_engine(self.store, self.cluster.name, replica, facts)[0]

    # --- one tick ---------------------------------------------------------------------------
    async def step(self, client: PollingClient) -> dict[str, Any]:
        """One tick through the controller host (``controlplane.controller_host.tick``: the
        control row read, the status stored): observe every replica, carry decisions out."""
        return await tick(_HostedAutopilot(self, client))

    async def observe_and_act(self, client: PollingClient, row: ControlRow) -> dict[str, Any]:
        """Under ``row`` (armed, dry-run, disarmed; held by a pause or the governor), observe
        every replica and carry the decisions out; returns the status to store."""
        self.state = row.state
        for name in list(self.leases.until):
            if not self.armed_on(name) or row.paused:
                await self.leases.release(self.cluster, name)
        self.held = row.held
        if row.state == "disarmed":
            self.pilots.clear()
        else:
            for spec in self.cluster.replicas:
                try:
                    await self._replica_tick(client, spec)
                except Exception as err:  # one replica's trouble never stops the others
                    log.exception("autopilot: replica %s", spec.name)
                    self.notes[spec.name] = f"error: {type(err).__name__}: {str(err)[:200]}"
        return self.status()

    async def _replica_tick(self, client: PollingClient, spec: ReplicaSpec) -> None:
        name = spec.name
        view = self.collector.views.get(name)
        doc = view.state if view is not None else None
        if (
            view is None
            or doc is None
            or not view.health.healthy
            or not isinstance(doc.settings, dict)
        ):
            self.notes[name] = "no state from the replica"
            return
        running = Settings.model_validate(doc.settings)
        leader = self._pool_leader(spec)
        if leader is not None:
            await self._follow(spec, leader, doc, running)
            return
        rp = self.pilots.get(name)
        if rp is not None and rp.instance != doc.instance:
            log.info("autopilot: replica %s restarted: its controller starts afresh", name)
            self.pilots.pop(name, None)  # its request ids and completions log restart with it
            rp = None
        if rp is None:
            steered = STEERED_POLICIES + (("slofq",) if self.config.promise.slo else ())
            if running.policy not in steered:
                self.notes[name] = (
                    f"runs {running.policy}: the autopilot steers {', '.join(steered)} replicas "
                    "only"
                )
                return
            rp = await self._start(name, doc, running)
        try:
            inflight = await fetch_inflight(client, spec, self.cluster.timeout_s)
        except (HttpFailure, StateFormatError) as err:
            rp.note = f"no in-flight listing ({err}): observation deferred"
            return
        now = (inflight.time if inflight.time is not None else doc.time or 0.0) - rp.origin
        if rp.clock is not None and now < rp.clock - FUTURE_SLACK_S:
            # The replica's clock stepped back: every later arrival would look older than what the
            # shadows have passed, and no decision would come. A fresh controller starts on it.
            stepped = rp.clock - now
            log.warning(
                "autopilot: replica %s's clock stepped back %.0f s: restarted", name, stepped
            )
            self.pilots.pop(name, None)
            rp = await self._start(name, doc, running)
            rp.note = f"the replica's clock stepped back {stepped:.0f} s: its controller restarted"
            now = (inflight.time if inflight.time is not None else doc.time or 0.0) - rp.origin
        rp.clock = now if rp.clock is None else max(rp.clock, now)
        decision = await asyncio.to_thread(
            rp.pilot.observe, rp.observation(inflight, now, self.config)
        )
        await self._verify(rp, now, running)
        if decision is not None:
            rp.last.append(decision_row(decision, now))
            while len(rp.last) > self.live.decisions_kept:
                rp.last.popleft()
            await self._carry_out(rp, decision, running)

    def _pool_leader(self, spec: ReplicaSpec) -> str | None:
        """The replica whose controller ``spec`` follows: its pool's first in the cluster file
        (None when it leads, or is in no pool)."""
        if spec.pool is None:
            return None
        first = next(r.name for r in self.cluster.replicas if r.pool == spec.pool)
        return None if first == spec.name else first

    async def _follow(
        self, spec: ReplicaSpec, leader: str, doc: contract.State, running: Settings
    ) -> None:
        """A pool member: no shadows of its own — the leader's controller decides for the pool,
        and each of its decisions is carried out here too (pins, the governor and arming are
        still this replica's)."""
        lead = self.pilots.get(leader)
        if lead is None or lead.follows is not None:
            self.notes[spec.name] = f"pool {spec.pool}: waits for {leader}'s controller"
            return
        rp = self.pilots.get(spec.name)
        if rp is None or rp.pilot is not lead.pilot:
            rp = ReplicaPilot(spec.name, doc.instance, lead.origin, lead.pilot)
            rp.follows = leader
            self.pilots[spec.name] = rp
            self.notes.pop(spec.name, None)
        if lead.clock is not None:  # its own switches verified on the leader's clock
            await self._verify(rp, lead.clock, running)
        decision = next((d for d in reversed(lead.pilot.decisions) if d.figures), None)
        if decision is None or decision is rp.followed:
            rp.note = rp.note or f"pool {spec.pool}: follows {leader}'s controller"
            return
        rp.followed = decision
        rp.last.append(decision_row(decision, decision.at))
        while len(rp.last) > self.live.decisions_kept:
            rp.last.popleft()
        await self._carry_out(rp, decision, running)

    async def _start(self, name: str, doc: contract.State, running: Settings) -> ReplicaPilot:
        base = (
            running
            if running.policy == "uniboost"
            else Settings.model_validate(
                {"policy": "uniboost", "engine": running.engine.model_dump()}
            )
        )
        try:
            engine = await asyncio.to_thread(self.engine_for, name)
        except Exception as err:  # the defaults' engine: a model, not a reason to steer nothing
            log.warning(
                "autopilot: replica %s: its engine is unknown (%s): A100 defaults", name, err
            )
            engine = EngineConfig()
        pilot = Autopilot(base, self.config, engine)
        pilot.follow(running_candidate(pilot.options, running) or pilot.current)
        # Time 0 a window before now: the requests in flight at the start arrived after it.
        origin = float(doc.time or 0.0) - self.config.window_s
        rp = ReplicaPilot(name, doc.instance, origin, pilot)
        self.pilots[name] = rp
        self.notes.pop(name, None)
        return rp

    # --- acting -----------------------------------------------------------------------------
    async def _carry_out(self, rp: ReplicaPilot, decision: Decision, running: Settings) -> None:
        """Make the replica run the decision's choice: in the audit log only (dry-run), or through
        the control API with a prediction kept for verification (armed)."""
        if not decision.figures:  # waiting for data: nothing compared yet
            rp.note = decision.reason
            return
        target = rp.pilot.options[decision.choice]
        why_not = blocked(running, target)
        if why_not is not None:
            rp.note = f"not applied: {why_not}"
            return
        other = None
        if self.armed_on(rp.name) and self.held is None:
            # Taken (or renewed) at every decision while armed, a switch or not: the knobs stay
            # this controller's as long as it runs.
            other = await self.leases.hold(self.cluster, rp.name, self.clock())
        if runs_choice(running, target):
            rp.note = f"runs {decision.choice}: {decision.reason}"
            return
        # The replica runs something else: a switch, or the choice again after a dry run or an
        # operator's unpinned change. Judged against what it runs, where that is a candidate.
        runs = running_candidate(rp.pilot.options, running) or "its own settings"
        switch = dataclasses.replace(decision, changed=True, previous=runs)
        note = decision_note(switch)
        if self.held is not None:
            rp.note = f"held: {self.held}"
            return
        acting = self.armed_on(rp.name)
        applied_ms = int(self.clock() * 1000)
        if (not acting or other is not None) and not decision.changed:
            done = Outcome("dry-run", None, other)  # logged once per decision, not once a minute
        else:
            done = await self._send(rp, target, note, act=acting, steered_by=other, running=running)
        res = done.sent
        if res is None:
            rp.note = f"dry-run: would run {decision.choice}" + (
                "" if done.steered_by is None else f" — not ours to steer: {done.steered_by}"
            )
            return
        rp.note = f"{res.result}: {decision.choice}" + ("" if res.ok else f" ({res.message})")
        # A prediction only where both sides were compared (an overload decision compares none).
        if (
            res.ok
            and res.new is not None
            and runs in decision.figures
            and decision.choice in decision.figures
        ):
            band = await asyncio.to_thread(self._band, rp.name)
            summary = decision_summary(
                switch,
                rp.name,
                self.cluster.name,
                running,
                res.new,
                applied_ms,
                self.live.verify_minutes,
                band,
            )
            pid = await asyncio.to_thread(
                self.store.tuner.store_prediction,
                self.cluster.name,
                rp.name,
                summary,
                t_ms=applied_ms,
                version=res.version,
            )
            rp.ledger.expect(
                {
                    "id": pid,
                    "cluster": self.cluster.name,
                    "replica": rp.name,
                    "t_ms": applied_ms,
                    "summary": summary,
                }
            )

    async def _send(
        self,
        rp: ReplicaPilot,
        target: Settings,
        note: str,
        *,
        running: Settings,
        act: bool = True,
        steered_by: str | None = None,
    ) -> Outcome:
        """Make ``rp``'s replica run ``target``'s choice (``target_document`` of what it runs when
        the change is sent), audited with ``note``, through the host (``carry_out``: under this
        controller's lease; with ``act`` false, or the lease another's, a dry-run row of the
        change to ``running``, what the replica last reported)."""
        return await carry_out(
            self.cluster,
            rp.name,
            TargetChange(target),
            self.store,
            who=WHO,
            note=note,
            leases=self.leases,
            now=self.clock(),
            act=act,
            current=running.to_dict(),
            steered_by=steered_by,
        )

    def _band(self, replica: str) -> float | None:
        reports = self.store.tuner.latest_fidelity(self.cluster.name, replica)
        return reports[0]["summary"].get("band") if reports else None

    async def _verify(self, rp: ReplicaPilot, now: float, running: Settings) -> None:
        """Verify the applied switches whose window has passed; step back after repeated misses
        (``controlplane.verification``)."""
        miss = await rp.ledger.check(
            self.verifier,
            self.store,
            int(self.clock() * 1000),
            verify_ms=int(self.live.verify_minutes * 60_000),
            band=self.live.band,
            step_back_after=self.live.step_back_after,
        )
        if miss is not None:
            await self._step_back(rp, now, miss, running)

    async def _step_back(self, rp: ReplicaPilot, now: float, miss: Miss, running: Settings) -> None:
        to = "defaults" if "defaults" in rp.pilot.options else rp.pilot.reference
        rp.pilot.step_back(now, to, self.live.hold_s)
        target = rp.pilot.options[to]
        note = (
            f"autopilot steps back to {to}: the realized P95 TTFT change was worse than predicted "
            f"by more than the band {self.live.step_back_after} times in a row (last: "
            f"{miss.realized:+.0%} realized, {miss.predicted:+.0%} predicted, band "
            f"±{miss.band:.0%}); held {self.live.hold_s:.0f} s"
        )
        log.warning("replica %s: %s", rp.name, note)
        rp.note = note
        if self.armed_on(rp.name) and self.held is None:
            await self._send(rp, target, note, running=running)

    def armed_on(self, replica: str) -> bool:
        """Whether decisions are carried out on ``replica``: the row is armed and the replica is
        among ``LiveConfig.armed_replicas`` (every replica when that is None)."""
        only = self.live.armed_replicas
        return self.state == "armed" and (only is None or replica in only)

    # --- what the CLI and the TUI show -------------------------------------------------------
    def status(self) -> dict[str, Any]:
        replicas: dict[str, Any] = {name: {"note": note} for name, note in self.notes.items()}
        for name, rp in self.pilots.items():
            judged = next((d for d in reversed(rp.pilot.decisions) if d.figures), None)
            replicas[name] = {
                "choice": rp.pilot.current,
                # whether the running choice kept the promise on the last window judged (None:
                # nothing judged yet), and whether the replica was overloaded then
                "keeps": None if judged is None else not judged.figures[judged.choice].broken,
                "overload": None if judged is None else judged.overload,
                "note": rp.note,
                "late": rp.pilot.feed.late,
                "future": rp.future,
                "follows": rp.follows,
                # another autopilot's lease on this replica: it only dry-runs here (why)
                "lease": self.leases.others.get(name),
                "worse_in_row": rp.ledger.worse_in_row,
                "pending_verifications": len(rp.ledger.pending),
                "last": list(rp.last),
                "verifications": list(rp.ledger.verdicts),
            }
        return {
            "t_ms": int(self.clock() * 1000),
            "held": self.held,
            "promise": self.config.promise.describe(),
            "cadence": (
                f"a decision every {self.config.interval_s:g} s (replica clock), "
                f"{self.config.delay_s:g} s behind it, once {self.config.min_requests} requests "
                "are in the window"
            ),
            "armed_replicas": (
                None if self.live.armed_replicas is None else list(self.live.armed_replicas)
            ),
            "replicas": replicas,
        }


@dataclass(slots=True)
class _HostedAutopilot:
    """The live autopilot as the controller host runs it: a tick each ``tick_s`` through one
    HTTP client, closed at the stop."""

    driver: LiveAutopilot
    client: PollingClient
    name: Literal["autopilot"] = "autopilot"

    @property
    def cluster_name(self) -> str:
        return self.driver.cluster.name

    @property
    def store(self) -> Store:
        return self.driver.store

    async def step(self, row: ControlRow) -> dict[str, Any]:
        return await self.driver.observe_and_act(self.client, row)

    async def close(self, row: ControlRow) -> dict[str, Any] | None:
        await self.client.aclose()
        return None


async def run_autopilot(
    collector: Collector,
    store: Store,
    stop: asyncio.Event,
    *,
    config: AutopilotConfig | None = None,
    live: LiveConfig | None = None,
    clock: Callable[[], float] = time.time,
) -> None:
    """Tick every ``live.tick_s`` until ``stop`` is set (``tailpilot record --autopilot``), in the
    one controller loop (``controlplane.controller_host``)."""
    driver = LiveAutopilot(collector, store, config, live, clock=clock)
    collector.on_poll(driver.on_poll)
    hosted = _HostedAutopilot(driver, make_client(driver.cluster))
    await run_controller(hosted, stop, interval_s=driver.live.tick_s)

"""The autopilot: choose the scheduler's settings online, for the traffic being served, from the
past only.

How it decides (README, "The autopilot"). The candidate settings (``tuner.autopilot.candidates``:
uniboost at a fixed γ on a log grid, the defaults (γ-Ada), TIE at a fixed β, MemGuard's other
quantization bases, sarathi — vLLM's own order, the guard's reference — and slofq with declared
SLOs; the operator's pins bound them) are searched: at most ``max_shadows`` have a *shadow* at a
time, a simulator that replays the replica's own traffic under that setting, continuously, since
the autopilot started or since it was forked from a running neighbour. A shadow never starts from
an empty engine and never judges a setting over a few minutes: it answers "how would this setting
have served everything so far", which is what a fixed setting chosen with hindsight is scored on.
Every ``interval_s`` the autopilot compares the shadows on the same requests — those that
arrived in the last ``window_s`` before the shadows' clock — among the candidates that keep the
operator's promise (``tuner.autopilot.promise``: by default no quantile of TTFT or TTLT, nor
throughput, worse than sarathi's by more than 2%; with tenants' SLOs declared, SCR and JFI
first). A request a shadow has not finished counts with its *projected* latency: the shadow
forked and drained with no further arrival (``tuner.autopilot.shadows``), so a held-back request
is charged its wait so far and the backlog ahead of it before the drain shows it.

The candidates lie on one axis, from size-first (a small γ) to age-first (a large γ, γ-Ada,
sarathi), and a move along it is not symmetric; the rule that moves along it is
``tuner.autopilot.switching`` (each part measured in the README, "The autopilot"). This module
hosts it: nothing is judged before the window holds ``min_requests``; after a change of the
traffic's shape (``tuner.autopilot.shape``) the window starts at the change; in sustained
overload (``tuner.autopilot.overload``) a choice below the defaults moves up to them and holds,
nothing compared; otherwise the candidates the rule may reach are projected and judged
(``tuner.autopilot.promise``) and the rule chooses.

What it sees (``Observation``) is what a live replica knows: arrivals (prompt length, the client's
cap, tenant, type — never the output length), completions (with their output lengths), and how
many tokens each request in flight has generated so far. The shadows run ``delay_s`` behind
"now", so most requests they replay have completed and their lengths are known; a request still
in flight gets an imputed length — one of the completed lengths longer than what it has generated
so far, drawn from a cohort of arrivals that have all completed (``tuner.autopilot.feed``) — never
its true one. A move down is also judged on the replica itself: its *mirror* (the traffic under
what the replica ran when) switched to the target now, against keeping the running choice
(``switch_test``), and so is a move up made to leave a broken promise: taken only if switching
now breaks fewer quantiles than keeping (``mend_test``).

One implementation serves the simulator (``tuner.autopilot.replay``: ``tailpilot sim
--autopilot`` and ``compare``) and a live cluster (the recorder feeds it observations). Its knobs,
``AutopilotConfig``, are in ``tuner.autopilot.config`` and imported from here.
"""

from __future__ import annotations

import time

from scheduler.settings import Settings
from sim.engine import EngineConfig
from tuner.autopilot.candidates import ShadowSearch, running_candidate
from tuner.autopilot.config import AutopilotConfig as AutopilotConfig
from tuner.autopilot.config import log_grid as log_grid
from tuner.autopilot.feed import Feed
from tuner.autopilot.overload import OverloadWatch
from tuner.autopilot.promise import Figures, breaks, judge
from tuner.autopilot.shadows import Mirror, Projection, Shadow, Window
from tuner.autopilot.stress import StressTest
from tuner.autopilot.switching import Situation, SwitchingRule
from tuner.autopilot.types import Decision, Observation

SLO_REFERENCES = ("sarathi", "defaults", "slofq")  # what the tenants' SCR and JFI are held to


def candidates(base: Settings, config: AutopilotConfig) -> dict[str, Settings]:
    """The settings the autopilot chooses among (and compares against), by name."""
    return {name: c.settings for name, c in config.candidates(base).items()}


class Autopilot:
    """The controller: feed it ``Observation``s (``observe``); every ``interval_s`` it returns a
    ``Decision``. Deterministic: the same observations give the same decisions."""

    def __init__(
        self,
        base: Settings,
        config: AutopilotConfig | None = None,
        engine: EngineConfig | None = None,
    ) -> None:
        self.config = config or AutopilotConfig()
        self.engine = engine or EngineConfig()
        self.base = base
        self.space = self.config.candidates(base)
        self.options = {name: c.settings for name, c in self.space.items()}
        self.reference = "sarathi" if "sarathi" in self.options else next(iter(self.options))
        self.current = running_candidate(self.options, base) or (
            "defaults" if "defaults" in self.options else next(iter(self.options))
        )
        always = [self.reference, "defaults"] + [n for n in SLO_REFERENCES if n in self.options]
        self.search = ShadowSearch(self.space, always, self.config.search())
        self.shadows = {
            name: Shadow(self.options[name], self.engine)
            for name in self.search.initial(self.current)
        }
        self.mirror = Mirror()  # the replica itself: a move down is tested on it switched now
        self.decisions: list[Decision] = []
        self.feed = Feed(self.config)  # observations -> the shadows' replay and the window
        self._next_decision: float | None = None
        self._cpu = 0.0
        self._overload = OverloadWatch(self.config)
        self.rule = SwitchingRule(
            self.config, self.space, self.reference, self.search, self._overload, self.current
        )

    # --- which candidates run ------------------------------------------------------------------
    def follow(self, name: str) -> None:
        """The replica runs ``name`` (at the start, or after a change the controller did not
        make): it is the running choice, and its shadow runs."""
        if name not in self.options:
            raise KeyError(f"no candidate named {name!r}")
        self._replica_runs(name)
        self.current = name
        self._start(name)

    def _replica(self) -> Shadow:
        """The replica's replay (``Mirror``)."""
        return self.mirror.of(self.shadows[self.current])

    def _replica_runs(self, name: str) -> None:
        """The replica runs ``name`` from now (before any replay, a shadow's start is its own)."""
        switched = name != self.current and self.feed.clock is not None
        self.mirror.runs(self.options[name], self.shadows[self.current], switched)

    def _start(self, name: str) -> None:
        if name in self.shadows:
            return
        if self.feed.clock is None:  # nothing replayed yet: it starts with the others
            self.shadows[name] = Shadow(self.options[name], self.engine)
            return
        parent = self.search.nearest(name, self.shadows)
        self.shadows[name] = self.shadows[parent].spawn(self.options[name])
        self.search.started_fork(name, self.feed.clock)

    def _search(self, figures: dict[str, Figures], clock: float) -> None:
        """After a judged decision: retire the explorers that lag, start the nearest candidates
        to the target in their places (``tuner.autopilot.candidates.ShadowSearch``)."""
        anchors = {n: self.search.place(n, self.shadows) for n in (self.current, self.rule.target)}
        keep = self.search.bracket(anchors, self.shadows)
        lagging = self.search.lagging(figures, self.config.promise)
        for name in self.search.retire(lagging, keep, clock):
            del self.shadows[name]
        for name in self.search.next_up(anchors, self.shadows, clock):
            self._start(name)

    # --- feeding ---------------------------------------------------------------------------
    def observe(self, obs: Observation) -> Decision | None:
        started = time.process_time()
        self.feed.arrive(obs.arrivals)
        self.feed.complete(obs.completions)
        # True lengths of requests the shadows hold with imputed ones, before any new arrival.
        revised = self.feed.revisions()
        fed = self.feed.take(obs.now, obs.generated)
        t, batch, gone = fed if fed is not None else (None, [], [])
        for shadow in (*self.shadows.values(), *self.mirror.owned()):
            if revised:
                shadow.revise(revised)
            if t is not None:
                shadow.advance(batch, t)
            if gone:
                shadow.forget(gone)
        self._cpu += time.process_time() - started
        if self._next_decision is None:
            self._next_decision = obs.now + self.config.interval_s
        if obs.now < self._next_decision:
            return None
        self._next_decision = obs.now + self.config.interval_s
        started = time.process_time()
        decision = self._decide(obs.now)
        self._cpu += time.process_time() - started
        decision.cpu_s, self._cpu = self._cpu, 0.0
        self.decisions.append(decision)
        return decision

    # --- deciding ----------------------------------------------------------------------------
    def _figures(
        self, shadow: Shadow, window: Window, horizon: float | None = None
    ) -> tuple[Figures, Projection]:
        """``Shadow.figures`` over ``window`` (projected ``project_s`` ahead unless ``horizon``
        says otherwise)."""
        return shadow.figures(window, self.config.project_s if horizon is None else horizon)

    def _decide(self, now: float) -> Decision:
        cfg = self.config
        clock = self.feed.clock if self.feed.clock is not None else now
        settled = self.feed.settled(clock)
        if len(settled) < cfg.min_requests:
            return self._decision(
                now,
                f"waiting for data: {len(settled)} of {cfg.min_requests} requests in the window",
                {},
                len(settled),
            )
        window, since = self.feed.window(now, clock, settled, cfg.promise.slo)
        ids = window.ids
        shape_note = (
            ""
            if since is None
            else f" [judged on the {len(ids)} requests since the change of shape at t={since:.0f}]"
        )
        stress = StressTest(cfg, window, self.feed.recent, self.shadows, self.reference)
        reference = self.shadows[self.reference]
        if self._overload.hold_this_decision():
            return self._hold_in_overload(now, None, len(ids))
        # The reference first, projected no further than the overload test needs: if its queue
        # is not empty by then the replica is overloaded and no comparison is needed.
        horizon = self._overload.horizon(cfg.project_s)
        ref, projection = self._figures(reference, window, horizon=horizon)
        standing = self._overload.standing(window.arrivals, reference.waits(window), clock)
        overload = self._overload.judge(reference.busy(), projection.drained_at, clock, standing)
        if overload == "sustained":
            return self._hold_in_overload(now, ref, len(ids))
        rule = self.rule
        bars_down = rule.bars_down(overload, self.current)
        raw: dict[str, Figures] = {self.reference: ref}
        here = rule.rank(self.current)
        for name, shadow in self.shadows.items():
            # The candidates a move may not reach are not even projected (in overload their deep
            # queues are the costliest to drain).
            if name in raw or (bars_down and rule.rank(name) < here):
                continue
            if name != self.current and cfg.promise.slo is None:
                # Projection only lengthens latencies: a candidate whose wait so far already
                # breaks the promise cannot keep it, and its projection is saved.
                bound, _ = self._figures(shadow, window, horizon=0.0)
                if breaks(cfg.promise, bound, ref):
                    raw[name] = bound
                    continue
            raw[name], _ = self._figures(shadow, window)
        figures = judge(cfg.promise, raw, self.reference, SLO_REFERENCES)
        situation = Situation(
            now=now,
            clock=clock,
            current=self.current,
            overload=overload,
            requests=len(ids),
            judge_requests=(
                cfg.judge_requests
                if since is None
                else min(cfg.judge_requests, cfg.shape_min_requests)
            ),
            new_shape=rule.fresh_shape(since, len(ids), clock),
            stress=stress,
            replica=self._replica,
        )
        choice = rule.choose(figures, situation)
        decision = self._decision(
            now,
            choice.reason + shape_note,
            figures,
            len(ids),
            choice.name if choice.switch else None,
            overload,
        )
        self._search(figures, clock)
        return decision

    def _decision(
        self,
        now: float,
        reason: str,
        figures: dict[str, Figures],
        requests: int,
        switch_to: str | None = None,
        overload: str = "",
    ) -> Decision:
        """This decision, switching to ``switch_to`` first when given."""
        previous = self.current
        if switch_to is not None:
            self._replica_runs(switch_to)
            self.current = switch_to
            self.rule.switched(now)
            self._start(switch_to)
        return Decision(
            now,
            self.current,
            self.options[self.current].to_dict(),
            switch_to is not None,
            reason,
            figures,
            requests,
            0.0,
            previous if switch_to is not None else "",
            overload,
        )

    def _hold_in_overload(self, now: float, ref: Figures | None, requests: int) -> Decision:
        """Sustained overload: no gamble — a choice below the defaults on the axis moves up to
        them (holding back more only grows a backlog someone is served after); any other is
        kept. Nothing else is compared (the deep queues are the costliest to project)."""
        cfg = self.config
        previous = self.current
        drain = f"the reference needs over {cfg.overload_drain_s:.0f} s to empty its queue"
        if self.rule.below_defaults(previous):
            reason = (
                f"overload: {drain}; {previous} would hold back more — moved up to the defaults"
            )
            switch_to: str | None = "defaults"
        else:
            reason = f"overload: {drain}; {previous} kept (no move down the axis meanwhile)"
            switch_to = None
        figures = {} if ref is None else {self.reference: ref}
        decision = self._decision(now, reason, figures, requests, switch_to, "sustained")
        # Nothing is compared while it lasts: the explorers stop (deep queues are the costliest
        # to replay) and come back, forked from the running shadows, once it ends.
        for name in [n for n in self.shadows if n not in (*self.search.always, self.current)]:
            del self.shadows[name]
        return decision

    def step_back(self, now: float, to: str = "defaults", hold_s: float = 3_600.0) -> None:
        """The live driver stepped the replica back to ``to`` (its realized changes were worse than
        predicted): run on it, and switch away only to keep the promise until ``now + hold_s``."""
        self.follow(to)
        self.rule.step_back(now, hold_s)

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
sarathi), and a move along it is not symmetric: a move down promotes short requests, a move up
flushes the long requests a small γ held back onto everyone — a cost the shadows, each running
one setting all along, do not see. The rules (``_choose``; each measured in the README, "The
autopilot"): nothing is judged before the window holds ``min_requests``; after a change of the
traffic's shape (``tuner.autopilot.shape``) the window starts at the change, and a tie is broken
under the stress test for a while (``_break_tie_under_stress``); among the candidates keeping
the promise and within ``tie`` of the best the running one stays, else the most age-first is the
target; a move down takes ``down_margin`` and the *stress test* (``tuner.autopilot.stress``: the
last minutes' arrivals going on), also when it leaves a break; a move up takes ``hysteresis``
(``leave_defaults`` from the defaults) after ``min_dwell_s``, or the running choice breaking the
promise beyond its sampling noise ``guard_patience`` decisions in a row; in overload
(``tuner.autopilot.overload``) no move goes down (in a standing queue, none from the defaults or
above), and sustained overload moves a choice below the defaults up to them and holds.

What it sees (``Observation``) is what a live replica knows: arrivals (prompt length, the client's
cap, tenant, type — never the output length), completions (with their output lengths), and how
many tokens each request in flight has generated so far. The shadows run ``delay_s`` behind
"now", so most requests they replay have completed and their lengths are known; a request still
in flight gets an imputed length — one of the completed lengths longer than what it has generated
so far, drawn from a cohort of arrivals that have all completed (``tuner.autopilot.feed``) — never
its true one. A move down is also judged on the replica itself: its *mirror* (the traffic under
what the replica ran when) switched to the target now, against keeping the running choice
(``switch_test``).

One implementation serves the simulator (``tuner.autopilot.replay``: ``tailpilot sim
--autopilot`` and ``compare``) and a live cluster (the recorder feeds it observations). Its knobs,
``AutopilotConfig``, are in ``tuner.autopilot.config`` and imported from here.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping

from scheduler.settings import Settings
from sim.engine import EngineConfig
from tuner.autopilot.candidates import ShadowSearch, running_candidate
from tuner.autopilot.config import GUARD_SLACK
from tuner.autopilot.config import AutopilotConfig as AutopilotConfig
from tuner.autopilot.config import log_grid as log_grid
from tuner.autopilot.feed import Feed
from tuner.autopilot.overload import OverloadWatch
from tuner.autopilot.promise import (
    Figures,
    breaks,
    judge,
    most_margin,
    rank_key,
    sampling_slack,
)
from tuner.autopilot.shadows import Mirror, Projection, Shadow, Window
from tuner.autopilot.stress import StressTest
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
        self._target = self.current  # the best candidate at the last judged decision
        self.decisions: list[Decision] = []
        self.feed = Feed(self.config)  # observations -> the shadows' replay and the window
        self._stress: StressTest | None = None  # this decision's (its arrivals built on first use)
        self._next_decision: float | None = None
        self._last_switch = -math.inf
        self._breaks = 0  # consecutive decisions on which the running choice broke the guard
        self._hold_until = -math.inf  # step_back: no switch before this but to keep the guard
        self._cpu = 0.0
        self._requests = 0  # in the last decision's window
        self._judge_requests = self.config.judge_requests  # … before the running choice is judged
        self._new_shape = False  # judged on the first requests after a change of shape
        self._overload = OverloadWatch(self.config)

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
        anchors = {n: self.search.place(n, self.shadows) for n in (self.current, self._target)}
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
        fed = self.feed.take(obs.now, obs.generated)
        if fed is not None:
            t, batch, gone = fed
            for shadow in (*self.shadows.values(), *self.mirror.owned()):
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
        self._judge_requests = (
            cfg.judge_requests if since is None else min(cfg.judge_requests, cfg.shape_min_requests)
        )
        self._requests = len(ids)
        self._new_shape = self._fresh_shape(since, len(ids), clock)
        self._stress = StressTest(cfg, window, self.feed.recent, self.shadows, self.reference)
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
        bars_down = self._bars_down(overload)
        raw: dict[str, Figures] = {self.reference: ref}
        here = self._rank(self.current)
        for name, shadow in self.shadows.items():
            # The candidates a move may not reach are not even projected (in overload their deep
            # queues are the costliest to drain).
            if name in raw or (bars_down and self._rank(name) < here):
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
        best, changed, reason = self._choose(figures, now, overload, clock)
        reason += shape_note
        decision = self._decision(
            now, reason, figures, len(ids), best if changed else None, overload
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
            self.current, self._last_switch = switch_to, now
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
        if self._below_defaults():
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

    def _stress_breaks(self, name: str) -> tuple[str, ...]:
        """What ``name`` breaks of the promise under this decision's stress test
        (``tuner.autopilot.stress``); empty when it holds or nothing is judged yet."""
        return () if self._stress is None else self._stress.breaks(name)

    def _switch_breaks(self, name: str) -> tuple[str, ...]:
        """What the replica breaks of the promise under this decision's stress test if switched
        to ``name`` now (its mirror spawned with ``name``'s settings); empty when it holds, with
        ``switch_test`` off, or nothing judged yet."""
        if self._stress is None or not self.config.switch_test:
            return ()
        replica = self._replica()
        return self._stress.switch_breaks(replica.spawn(self.options[name]), replica)

    def _down_breaks(self, name: str) -> tuple[str, ...]:
        """A move down to ``name``: what it breaks under the stress test, its own shadow's and
        then the replica switched to it now (``_switch_breaks``)."""
        return self._stress_breaks(name) or self._switch_breaks(name)

    def _stress_figures(self, name: str) -> Figures:
        """``name``'s figures under this decision's stress test."""
        assert self._stress is not None, "a stress figure outside a judged decision"
        return self._stress.figures(name)

    def _current_breaks(self, figures: dict[str, Figures]) -> tuple[str, ...]:
        """What the running choice breaks, with ``GUARD_SLACK`` more slack than a newcomer gets
        (a window's tail moves by a percent or two from one minute to the next, and a switch has
        a cost); with SLOs, the promise's own verdict."""
        promise, current = self.config.promise, figures[self.current]
        if self._requests < self._judge_requests:
            return ()
        if promise.slo is not None:
            return current.broken
        return breaks(
            promise,
            current,
            figures[self.reference],
            loosen=GUARD_SLACK,
            per_quantile=sampling_slack(self._requests, self.config.noise),
        )

    def step_back(self, now: float, to: str = "defaults", hold_s: float = 3_600.0) -> None:
        """The live driver stepped the replica back to ``to`` (its realized changes were worse than
        predicted): run on it, and switch away only to keep the promise until ``now + hold_s``."""
        self.follow(to)
        self._last_switch, self._hold_until = now, now + hold_s

    def _rank(self, name: str) -> float:
        """A candidate's place on the size-to-age axis (``tuner.autopilot.candidates.axis_rank``:
        its aging rate; the defaults above the grid, sarathi and slofq last). Moving down the axis
        promotes short requests — cheap; moving up flushes what a small γ held back onto everyone —
        costly."""
        return self.space[name].rank

    def _better(self, new: Figures, old: Figures, margin: float) -> bool:
        """``new`` beats ``old`` by ``margin`` on the promise's order: with SLOs a higher SCR or
        JFI tier wins outright; else (and on a tie of both) the objective by the margin."""
        promise = self.config.promise
        head_new, head_old = rank_key(promise, new)[:-1], rank_key(promise, old)[:-1]
        if head_new != head_old:
            return head_new < head_old
        return new.value(promise.objective) < (1.0 - margin) * old.value(promise.objective)

    def _up_margin(self) -> float:
        """What a move up the axis (or off a tied running choice) must win by:
        ``leave_defaults`` from the defaults, else ``hysteresis``."""
        cfg = self.config
        return cfg.leave_defaults if self.current == "defaults" else cfg.hysteresis

    def _dwelt(self, now: float) -> bool:
        """Whether ``min_dwell_s`` has passed since the last switch."""
        return now - self._last_switch >= self.config.min_dwell_s

    def _tied(self, feasible: list[str], figures: Mapping[str, Figures]) -> list[str]:
        """The candidates of ``feasible`` within ``tie`` of the best by the promise's order."""
        promise = self.config.promise
        best = min(rank_key(promise, figures[n]) for n in feasible)
        return [
            n
            for n in feasible
            if rank_key(promise, figures[n])[:-1] == best[:-1]
            and figures[n].value(promise.objective) <= (1 + self.config.tie) * best[-1]
        ]

    def _fresh_shape(self, since: float | None, requests: int, clock: float) -> bool:
        """Whether the window is a new shape's first ``requests`` — fewer than
        ``judge_requests``, and less than ``stress_s`` since the change at ``since``: its tails
        are not yet shown, and a tie on them is broken by the stress test
        (``_break_tie_under_stress``). After ``stress_s`` what the stress test would foresee has
        had time to show in the window itself (a shape arriving slowly would otherwise keep the
        rule for an hour: on every tie it was measured and not kept, README).
        Without a stress test, or with tenants' SLOs declared (whose ties have their own rule,
        ``margin_ties``), never."""
        cfg = self.config
        return (
            since is not None
            and cfg.stress_s > 0
            and cfg.promise.slo is None
            and requests < cfg.judge_requests
            and clock - since < cfg.stress_s
        )

    def _break_tie_under_stress(
        self, feasible: list[str], figures: Mapping[str, Figures], now: float, blocked: bool
    ) -> tuple[str, str] | None:
        """On a new shape's first requests the candidates tied with the running choice, judged
        again under the stress test; the one to switch to and why, or None.

        The first requests of a new shape arrive on a queue the old shape left: every setting
        serves them alike, and what sets them apart — the backlog each builds as the new shape's
        load goes on — shows only later (on ``shift``'s reasoning phase γ 0.001 and γ 0.215 tie
        within 0.2% for six minutes, then γ 0.215's P95 is 18% worse and the reasoning phase's
        best fixed setting out of reach: a switch 10 minutes after the change keeps it within
        1.09×, 11 minutes 1.52×). The stress test — the last ``stress_recent_s`` of arrivals
        repeated for ``stress_s`` — is that later, seen now. A move down takes ``down_margin``
        on it, a move up ``hysteresis`` (``leave_defaults`` from the defaults) after
        ``min_dwell_s``, as on the window; a running choice that breaks the promise under the
        test is left for the best that keeps it (on equal figures the most age-first). Not
        while the running choice breaks the promise on the window or in overload (``blocked``),
        after a step back, or when the last ``stress_recent_s`` saw no arrival (nothing to
        repeat: the window's own tie stands)."""
        cfg, promise = self.config, self.config.promise
        if not self._new_shape or blocked or now < self._hold_until:
            return None
        tied = [n for n in self._tied(feasible, figures) if n != self.reference]
        if self.current not in tied or len(tied) < 2:
            return None
        if self._stress is None or not self._stress.arrivals():
            return None
        stressed = {n: self._stress_figures(n) for n in tied if not self._stress_breaks(n)}
        if not stressed:
            return None
        pick = min(stressed, key=lambda n: (rank_key(promise, stressed[n]), -self._rank(n), n))
        if pick == self.current:
            return None
        down = self._rank(pick) < self._rank(self.current)
        if not down and not self._dwelt(now):
            return None
        margin = cfg.down_margin if down else self._up_margin()
        current = stressed.get(self.current)
        if current is not None and not self._better(stressed[pick], current, margin):
            return None
        objective = promise.objective
        against = (
            "breaks the promise there" if current is None else f"{current.value(objective):.3g} s"
        )
        return pick, (
            f"{pick} ties {self.current} on the new shape's first {self._requests} requests; if "
            f"the last {cfg.stress_recent_s:.0f} s of arrivals went on for {cfg.stress_s:.0f} s: "
            f"{stressed[pick].value(objective):.3g} s {objective} vs {against}"
        )

    def target_among(self, feasible: list[str], figures: Mapping[str, Figures]) -> str:
        """The target among candidates that keep the promise: within ``tie`` of the best by the
        promise's order, the running choice if it is among them, else the one that holds back
        least (the most age-first) — or, with ``prefer_small``, the one that promotes short
        requests most; with ``margin_ties``, among those with the most margin on the promise."""
        cfg, promise = self.config, self.config.promise
        tied = self._tied(feasible, figures)
        if self.current in tied:
            return self.current
        by_margin = cfg.margin_ties == "always" or (
            cfg.margin_ties == "slo" and promise.slo is not None
        )
        if by_margin and self.reference in figures:
            tied = most_margin(tied, figures, figures[self.reference], cfg.margin_step)
        if cfg.prefer_small:
            return min(tied, key=lambda n: (self._rank(n), n))
        return max(tied, key=lambda n: (self._rank(n), n))

    def _breaks_as_load_rises(self, overload: str) -> tuple[str, ...]:
        """What a running choice below the defaults breaks under the stress test while the load
        rises (the reference's queue takes longer to empty than at the last decision) or its
        queue stands: what it holds back is tested ahead of time
        (``OverloadWatch.running_verdict``: in overload once every ``overload_recheck``
        decisions)."""
        if not self._below_defaults() or not (self._overload.rising or overload == "standing"):
            return ()
        return self._overload.running_verdict(
            overload, self.current, lambda: self._stress_breaks(self.current)
        )

    def _below_defaults(self) -> bool:
        """Whether the running choice is below the defaults on the size-to-age axis (holds back
        more than they do)."""
        return "defaults" in self.options and self._rank(self.current) < self._rank("defaults")

    def _bars_down(self, overload: str) -> bool:
        """Whether this decision's ``overload`` verdict bars a move down the axis: any does, but
        a standing queue bars only the way into the choices below the defaults — holding back
        there starts a backlog served once the queue empties — and a running choice already
        below them may still move down (sweep seed 31337's variant 27: held at γ 0.01, P99 TTFT
        1.06× sarathi's; γ 0.001 taken, 0.93×)."""
        return bool(overload) and not (overload == "standing" and self._below_defaults())

    def _choose(
        self, figures: dict[str, Figures], now: float, overload: str, clock: float
    ) -> tuple[str, bool, str]:
        """The candidate to run next, whether that is a switch, and why.

        Among the candidates that keep the promise, the best by its order (``rank_key``) is the
        target. A move down the size-to-age axis is cheap and is taken whenever the target is tied
        or better; a move up — or a move off a tied current choice — takes the ``hysteresis``
        margin and ``min_dwell_s``; the running choice is left for breaking the promise only
        after ``guard_patience`` decisions in a row. In overload (``tuner.autopilot.overload``)
        no move goes down the axis (``_bars_down``: in a standing queue, none from the defaults
        or above); sustained, a choice below the defaults moves up to them at once: holding back
        more would only grow a backlog that someone must be served after."""
        cfg, promise = self.config, self.config.promise
        objective = promise.objective
        here = self._rank(self.current)
        bars_down = self._bars_down(overload)
        broken = self._current_breaks(figures)
        if not broken:
            broken = self._breaks_as_load_rises(overload)
        self._overload.count_rising(overload)
        self._breaks = 0 if not broken else self._breaks + 1
        # In overload only those at or above the running choice were judged; a pin or a
        # probation may bar others.
        allowed = [n for n in figures if self.search.eligible(n, self.current, clock)]
        feasible = [n for n in allowed if figures[n].feasible]
        if feasible:
            target = self.target_among(feasible, figures)
            self._target = target
        elif broken and self._breaks >= cfg.guard_patience:
            # Nobody keeps the promise on this window: the one that breaks it least.
            target = min(
                allowed, key=lambda n: (len(figures[n].broken), rank_key(promise, figures[n]), n)
            )
        else:
            return self.current, False, "no candidate keeps the promise on this window: kept"
        current, best = figures[self.current], figures[target]
        under_stress = self._break_tie_under_stress(
            feasible, figures, now, bool(broken or bars_down)
        )
        if under_stress is not None:
            return under_stress[0], True, under_stress[1]
        if target == self.current:
            return (
                target,
                False,
                f"{target} is still the choice ({current.value(objective):.3g} s {objective})",
            )
        against = ", ".join(broken)
        if broken and self._breaks >= cfg.guard_patience:
            if self._rank(target) < here and self._down_breaks(target):
                # Leaving a break by a move down still takes the stress test: in a burst a smaller
                # γ keeps the promise on the window only until what it holds back shows. Then the
                # best that keeps it at or above the running choice on the axis, if any.
                upward = [n for n in feasible if self._rank(n) >= here and n != self.current]
                if not upward:
                    return (
                        self.current,
                        False,
                        f"{self.current} breaks the promise ({against}); {target} would hold "
                        "back too much under the stress test and nothing above keeps it: kept",
                    )
                target = self.target_among(upward, figures)
            return target, True, f"{self.current} breaks the promise ({against}); {target} keeps it"
        if now < self._hold_until:
            return (
                self.current,
                False,
                f"{self.current} held after a step back until t={self._hold_until:.0f}",
            )
        if broken:
            return (
                self.current,
                False,
                (
                    f"{self.current} breaks the promise ({against}): kept until it does so "
                    f"{cfg.guard_patience} decisions in a row"
                ),
            )
        down = self._rank(target) < here
        margin = self._up_margin()
        by_down_margin = down and self._better(best, current, cfg.down_margin) and not bars_down
        if not by_down_margin and not self._dwelt(now):
            return (
                self.current,
                False,
                f"{self.current} kept: switched {now - self._last_switch:.0f} s ago",
            )
        if not by_down_margin and not self._better(best, current, margin):
            return (
                self.current,
                False,
                (
                    f"no candidate beats {self.current} by the {margin:.0%} margin "
                    f"(target {target}: {best.value(objective):.3g} s vs "
                    f"{current.value(objective):.3g} s)"
                ),
            )
        # A move down is taken only past the stress test, run only now that the move would be
        # taken: run first, it cost two ten-minute projections at decisions that kept the running
        # choice anyway (a third of the stress tests on conv1.1).
        stressed = self._down_breaks(target) if down else ()
        if stressed:
            return (
                self.current,
                False,
                f"{target} would hold back too much if the last {cfg.stress_recent_s:.0f} s of "
                f"arrivals went on for {cfg.stress_s:.0f} s ({', '.join(stressed)}): "
                f"{self.current} kept",
            )
        if by_down_margin:
            return (
                target,
                True,
                (
                    f"{target} ({best.value(objective):.3g} s {objective}) beats "
                    f"{self.current} ({current.value(objective):.3g} s) by {cfg.down_margin:.0%} "
                    "and promotes short requests more"
                ),
            )
        return (
            target,
            True,
            (
                f"{target} beats {self.current}: {best.value(objective):.3g} s vs "
                f"{current.value(objective):.3g} s {objective} over the window's requests"
            ),
        )

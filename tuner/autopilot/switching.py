"""The switching rule: given one judged decision's figures, which candidate the autopilot runs
next, whether that is a switch, and why.

The candidates lie on one axis, from size-first (a small γ) to age-first (a large γ, γ-Ada,
sarathi), and a move along it is not symmetric: a move down promotes short requests, a move up
flushes the long requests a small γ held back onto everyone — a cost the shadows, each running
one setting all along, do not see. The rules (``SwitchingRule.choose``; each measured in the
README, "The autopilot"): after a change of the traffic's shape a tie is broken under the stress
test for a while (``_break_tie_under_stress``); among the candidates keeping the promise and
within ``tie`` of the best the running one stays, else the most age-first is the target; a move
down takes ``down_margin`` and the *stress test* (``tuner.autopilot.stress``: the last minutes'
arrivals going on) — its own shadow's, then the replica switched to it now — also when it leaves
a break; a move up takes ``hysteresis`` (``leave_defaults`` from the defaults) after
``min_dwell_s``, or the running choice breaking the promise beyond its sampling noise
``guard_patience`` decisions in a row, or — to the reference, without the margin — the reference
beating it on every quantile that many decisions in a row (``leave_dominated``); in overload
(``tuner.autopilot.overload``) no move goes down (in a standing queue, none from the defaults or
above). Sustained overload never reaches the rule: the controller holds
(``Autopilot._hold_in_overload``).

The rule keeps its own state (consecutive breaks, the last switch, a hold after a step back, the
last target); what a decision knows besides the figures comes in a ``Situation``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from tuner.autopilot.candidates import Candidate, ShadowSearch
from tuner.autopilot.config import AutopilotConfig
from tuner.autopilot.overload import OverloadWatch
from tuner.autopilot.promise import (
    QUANTILE_NAMES,
    Figures,
    breaks,
    most_margin,
    rank_key,
    sampling_slack,
)
from tuner.autopilot.shadows import Shadow


class StressVerdicts(Protocol):
    """What the rule asks of a decision's stress test (``tuner.autopilot.stress.StressTest``)."""

    def arrivals(self) -> int: ...

    def figures(self, name: str) -> Figures: ...

    def breaks(self, name: str) -> tuple[str, ...]: ...

    def switch_breaks(self, switched: Shadow, kept: Shadow) -> tuple[str, ...]: ...

    def mend_breaks(
        self, switched: Shadow, kept: Shadow
    ) -> tuple[tuple[str, ...], tuple[str, ...]]: ...


@dataclass
class Situation:
    """What one judged decision knows, besides the candidates' figures."""

    now: float  # the decision's time
    clock: float  # the shadows' clock (``delay_s`` behind ``now``)
    current: str  # the running choice
    overload: str = ""  # the reference's verdict: "", "rising" or "standing"
    requests: int = 0  # in the window
    judge_requests: int = 0  # the running choice is judged on no fewer
    new_shape: bool = False  # the window is a new shape's first requests (``fresh_shape``)
    stress: StressVerdicts | None = None  # this decision's stress test (None: none judged)
    replica: Callable[[], Shadow] | None = None  # the replica's replay, for the switch test


@dataclass(frozen=True)
class Choice:
    """The rule's answer: the candidate to run next, whether that is a switch, and why."""

    name: str
    switch: bool
    reason: str


class SwitchingRule:
    """The rule over ``space`` (the candidates by name), holding ``reference`` as the promise's
    reference; ``search`` says which candidates may be chosen now, ``overload`` keeps the
    overload verdicts' cadence, ``current`` is the running choice it starts from."""

    def __init__(
        self,
        config: AutopilotConfig,
        space: Mapping[str, Candidate],
        reference: str,
        search: ShadowSearch,
        overload: OverloadWatch,
        current: str,
    ) -> None:
        self.config = config
        self.space = space
        self.reference = reference
        self.search = search
        self.overload = overload
        self.target = current  # the best candidate at the last judged decision
        self.breaks = 0  # consecutive decisions on which the running choice broke the guard
        self.dominated = 0  # consecutive decisions on which the reference beat it everywhere
        self.last_switch = -math.inf
        self.hold_until = -math.inf  # after a step back: no switch before this but to keep it

    # --- the rule's state ---------------------------------------------------------------------
    def switched(self, now: float) -> None:
        """The replica switched at ``now``."""
        self.last_switch = now

    def step_back(self, now: float, hold_s: float) -> None:
        """The replica was stepped back at ``now``: switch away only to keep the promise until
        ``now + hold_s``."""
        self.last_switch, self.hold_until = now, now + hold_s

    # --- the axis -----------------------------------------------------------------------------
    def rank(self, name: str) -> float:
        """A candidate's place on the size-to-age axis (``tuner.autopilot.candidates.axis_rank``:
        its aging rate; the defaults above the grid, sarathi and slofq last). Moving down the axis
        promotes short requests — cheap; moving up flushes what a small γ held back onto everyone —
        costly."""
        return self.space[name].rank

    def below_defaults(self, current: str) -> bool:
        """Whether ``current`` is below the defaults on the size-to-age axis (holds back more
        than they do)."""
        return "defaults" in self.space and self.rank(current) < self.rank("defaults")

    def bars_down(self, overload: str, current: str) -> bool:
        """Whether this decision's ``overload`` verdict bars a move down the axis: any does, but
        a standing queue bars only the way into the choices below the defaults — holding back
        there starts a backlog served once the queue empties — and a running choice already
        below them may still move down (sweep seed 31337's variant 27: held at γ 0.01, P99 TTFT
        1.06× sarathi's; γ 0.001 taken, 0.93×)."""
        return bool(overload) and not (overload == "standing" and self.below_defaults(current))

    def fresh_shape(self, since: float | None, requests: int, clock: float) -> bool:
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

    # --- the rule -----------------------------------------------------------------------------
    def choose(self, figures: dict[str, Figures], at: Situation) -> Choice:
        """The candidate to run next, whether that is a switch, and why.

        Among the candidates that keep the promise, the best by its order (``rank_key``) is the
        target. A move down the size-to-age axis is cheap and is taken whenever the target is tied
        or better; a move up — or a move off a tied current choice — takes the ``hysteresis``
        margin and ``min_dwell_s``; the running choice is left for breaking the promise only
        after ``guard_patience`` decisions in a row (by a move up, only if the replica switched now
        breaks fewer quantiles under the stress test than kept: ``mend_test``), and for the
        reference without the margin when it beats the running choice on every quantile that many
        decisions in a row (``leave_dominated``). In overload (``tuner.autopilot.overload``) no
        move goes down the axis (``bars_down``: in a standing queue, none from the defaults or
        above)."""
        cfg, promise = self.config, self.config.promise
        objective = promise.objective
        now, running = at.now, at.current
        here = self.rank(running)
        bars_down = self.bars_down(at.overload, running)
        broken = self._current_breaks(figures, at)
        if not broken:
            broken = self._breaks_as_load_rises(at)
        self.overload.count_rechecked(at.overload)
        self.breaks = 0 if not broken else self.breaks + 1
        self.dominated = self.dominated + 1 if self._dominated(figures, at) else 0
        # In overload only those at or above the running choice were judged; a pin or a
        # probation may bar others.
        allowed = [n for n in figures if self.search.eligible(n, running, at.clock)]
        feasible = [n for n in allowed if figures[n].feasible]
        if feasible:
            target = self.target_among(feasible, figures, running)
            self.target = target
        elif broken and self.breaks >= cfg.guard_patience:
            # Nobody keeps the promise on this window: the one that breaks it least.
            target = min(
                allowed, key=lambda n: (len(figures[n].broken), rank_key(promise, figures[n]), n)
            )
        else:
            return Choice(running, False, "no candidate keeps the promise on this window: kept")
        current, best = figures[running], figures[target]
        # Dominated by the reference, or a new shape's tie broken under the stress test.
        early = self._leave_dominated(running, allowed, now) or self._break_tie_under_stress(
            feasible, figures, at, bool(broken or bars_down)
        )
        if early is not None:
            return early
        if target == running:
            return Choice(
                target,
                False,
                f"{target} is still the choice ({current.value(objective):.3g} s {objective})",
            )
        against = ", ".join(broken)
        if broken and self.breaks >= cfg.guard_patience:
            return self._leave_break(running, target, feasible, figures, at, against)
        if now < self.hold_until:
            return Choice(
                running, False, f"{running} held after a step back until t={self.hold_until:.0f}"
            )
        if broken:
            return Choice(
                running,
                False,
                (
                    f"{running} breaks the promise ({against}): kept until it does so "
                    f"{cfg.guard_patience} decisions in a row"
                ),
            )
        down = self.rank(target) < here
        margin = self._up_margin(running)
        by_down_margin = down and self._better(best, current, cfg.down_margin) and not bars_down
        if not by_down_margin and not self._dwelt(now):
            return Choice(
                running, False, f"{running} kept: switched {now - self.last_switch:.0f} s ago"
            )
        if not by_down_margin and not self._better(best, current, margin):
            return Choice(
                running,
                False,
                (
                    f"no candidate beats {running} by the {margin:.0%} margin "
                    f"(target {target}: {best.value(objective):.3g} s vs "
                    f"{current.value(objective):.3g} s)"
                ),
            )
        # A move down is taken only past the stress test, run only now that the move would be
        # taken: run first, it cost two ten-minute projections at decisions that kept the running
        # choice anyway (a third of the stress tests on conv1.1).
        stressed = self._down_breaks(target, at) if down else ()
        if stressed:
            return Choice(
                running,
                False,
                f"{target} would hold back too much if the last {cfg.stress_recent_s:.0f} s of "
                f"arrivals went on for {cfg.stress_s:.0f} s ({', '.join(stressed)}): "
                f"{running} kept",
            )
        if by_down_margin:
            return Choice(
                target,
                True,
                (
                    f"{target} ({best.value(objective):.3g} s {objective}) beats "
                    f"{running} ({current.value(objective):.3g} s) by {cfg.down_margin:.0%} "
                    "and promotes short requests more"
                ),
            )
        return Choice(
            target,
            True,
            (
                f"{target} beats {running}: {best.value(objective):.3g} s vs "
                f"{current.value(objective):.3g} s {objective} over the window's requests"
            ),
        )

    def _leave_break(
        self,
        running: str,
        target: str,
        feasible: list[str],
        figures: dict[str, Figures],
        at: Situation,
        against: str,
    ) -> Choice:
        """The running choice has broken the promise ``guard_patience`` decisions in a row: to
        ``target`` — past the stress test if that is a move down, past the mend test
        (``_unmended``) if a move up — or kept."""
        here = self.rank(running)
        if self.rank(target) < here and self._down_breaks(target, at):
            # Leaving a break by a move down still takes the stress test: in a burst a smaller
            # γ keeps the promise on the window only until what it holds back shows. Then the
            # best that keeps it at or above the running choice on the axis, if any.
            upward = [n for n in feasible if self.rank(n) >= here and n != running]
            if not upward:
                return Choice(
                    running,
                    False,
                    f"{running} breaks the promise ({against}); {target} would hold "
                    "back too much under the stress test and nothing above keeps it: kept",
                )
            target = self.target_among(upward, figures, running)
        unmended = self._unmended(target, at) if self.rank(target) > here else None
        if unmended is not None:
            switched, kept = unmended
            return Choice(
                running,
                False,
                f"{running} breaks the promise ({against}); switched to {target} now the "
                f"replica would break as much under the stress test ({', '.join(switched)} "
                f"against {', '.join(kept) or 'nothing'} kept): kept",
            )
        return Choice(target, True, f"{running} breaks the promise ({against}); {target} keeps it")

    def target_among(
        self, feasible: list[str], figures: Mapping[str, Figures], current: str
    ) -> str:
        """The target among candidates that keep the promise: within ``tie`` of the best by the
        promise's order, the running choice ``current`` if it is among them, else the one that
        holds back least (the most age-first) — or, with ``prefer_small``, the one that promotes
        short requests most; with ``margin_ties``, among those with the most margin on the
        promise."""
        cfg, promise = self.config, self.config.promise
        tied = self._tied(feasible, figures)
        if current in tied:
            return current
        by_margin = cfg.margin_ties == "always" or (
            cfg.margin_ties == "slo" and promise.slo is not None
        )
        if by_margin and self.reference in figures:
            tied = most_margin(tied, figures, figures[self.reference], cfg.margin_step)
        if cfg.prefer_small:
            return min(tied, key=lambda n: (self.rank(n), n))
        return max(tied, key=lambda n: (self.rank(n), n))

    # --- the rule's parts ---------------------------------------------------------------------
    def _current_breaks(self, figures: dict[str, Figures], at: Situation) -> tuple[str, ...]:
        """What the running choice breaks, with ``guard_slack`` more slack than a newcomer gets
        (a window's tail moves by a percent or two from one minute to the next, and a switch has
        a cost); with SLOs, the promise's own verdict."""
        promise, current = self.config.promise, figures[at.current]
        if at.requests < at.judge_requests:
            return ()
        if promise.slo is not None:
            return current.broken
        return breaks(
            promise,
            current,
            figures[self.reference],
            loosen=self.config.guard_slack,
            per_quantile=sampling_slack(at.requests, self.config.noise),
        )

    def _dominated(self, figures: Mapping[str, Figures], at: Situation) -> bool:
        """Whether the reference beats the running choice on every quantile of the promise over
        a window judged like the guard's (``judge_requests``); never with tenants' SLOs (their
        promise is not the reference's quantiles) or with ``leave_dominated`` off."""
        if (
            not self.config.leave_dominated
            or self.config.promise.slo is not None
            or at.current == self.reference
            or self.reference not in figures
            or at.requests < at.judge_requests
        ):
            return False
        current, ref = figures[at.current], figures[self.reference]
        return all(ref.value(name) < current.value(name) for name in QUANTILE_NAMES)

    def _leave_dominated(self, running: str, allowed: list[str], now: float) -> Choice | None:
        """The switch to the reference when it has beaten ``running`` on every quantile
        ``guard_patience`` decisions in a row (``_dominated``), it may be chosen, and neither a
        step back's hold nor ``min_dwell_s`` keeps ``running``; else None."""
        if (
            self.dominated < self.config.guard_patience
            or self.reference not in allowed
            or now < self.hold_until
            or not self._dwelt(now)
        ):
            return None
        return Choice(
            self.reference,
            True,
            f"{self.reference} beats {running} on every quantile of the window "
            f"({self.dominated} decisions in a row): {running} wins nothing the promise counts",
        )

    def _breaks_as_load_rises(self, at: Situation) -> tuple[str, ...]:
        """What a running choice below the defaults breaks under the stress test while the load
        rises (the reference's queue takes longer to empty than at the last decision) or its
        queue stands: what it holds back is tested ahead of time
        (``OverloadWatch.running_verdict``: in overload once every ``overload_recheck``
        decisions)."""
        if not self.below_defaults(at.current) or not (
            self.overload.rising or at.overload == "standing"
        ):
            return ()
        return self.overload.running_verdict(
            at.overload, at.current, lambda: self._stress_breaks(at.current, at)
        )

    def _stress_breaks(self, name: str, at: Situation) -> tuple[str, ...]:
        """What ``name`` breaks of the promise under this decision's stress test
        (``tuner.autopilot.stress``); empty when it holds or nothing is judged yet."""
        return () if at.stress is None else at.stress.breaks(name)

    def _switch_breaks(self, name: str, at: Situation) -> tuple[str, ...]:
        """What the replica breaks of the promise under this decision's stress test if switched
        to ``name`` now (its mirror spawned with ``name``'s settings); empty when it holds, with
        ``switch_test`` off, or nothing judged yet."""
        if at.stress is None or at.replica is None or not self.config.switch_test:
            return ()
        replica = at.replica()
        return at.stress.switch_breaks(replica.spawn(self.space[name].settings), replica)

    def _unmended(self, name: str, at: Situation) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
        """A move up to ``name`` to leave a broken promise that switching now would not mend:
        the replica switched breaks at least as many quantiles under the stress test as the
        replica kept (both returned), or None — the move is taken. None too with ``mend_test``
        or ``switch_test`` off, with tenants' SLOs (their judge is not the quantiles'), or
        nothing judged yet."""
        cfg = self.config
        if (
            not (cfg.mend_test and cfg.switch_test)
            or cfg.promise.slo is not None
            or at.stress is None
            or at.replica is None
        ):
            return None
        replica = at.replica()
        switched, kept = at.stress.mend_breaks(replica.spawn(self.space[name].settings), replica)
        return (switched, kept) if switched and len(switched) >= len(kept) else None

    def _down_breaks(self, name: str, at: Situation) -> tuple[str, ...]:
        """A move down to ``name``: what it breaks under the stress test, its own shadow's and
        then the replica switched to it now (``_switch_breaks``)."""
        return self._stress_breaks(name, at) or self._switch_breaks(name, at)

    def _better(self, new: Figures, old: Figures, margin: float) -> bool:
        """``new`` beats ``old`` by ``margin`` on the promise's order: with SLOs a higher SCR or
        JFI tier wins outright; else (and on a tie of both) the objective by the margin."""
        promise = self.config.promise
        head_new, head_old = rank_key(promise, new)[:-1], rank_key(promise, old)[:-1]
        if head_new != head_old:
            return head_new < head_old
        return new.value(promise.objective) < (1.0 - margin) * old.value(promise.objective)

    def _up_margin(self, current: str) -> float:
        """What a move up the axis (or off a tied running choice) must win by:
        ``leave_defaults`` from the defaults, else ``hysteresis``."""
        cfg = self.config
        return cfg.leave_defaults if current == "defaults" else cfg.hysteresis

    def _dwelt(self, now: float) -> bool:
        """Whether ``min_dwell_s`` has passed since the last switch."""
        return now - self.last_switch >= self.config.min_dwell_s

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

    def _break_tie_under_stress(
        self, feasible: list[str], figures: Mapping[str, Figures], at: Situation, blocked: bool
    ) -> Choice | None:
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
        running = at.current
        if not at.new_shape or blocked or at.now < self.hold_until:
            return None
        tied = [n for n in self._tied(feasible, figures) if n != self.reference]
        if running not in tied or len(tied) < 2:
            return None
        if at.stress is None or not at.stress.arrivals():
            return None
        stress = at.stress
        stressed = {n: stress.figures(n) for n in tied if not stress.breaks(n)}
        if not stressed:
            return None
        pick = min(stressed, key=lambda n: (rank_key(promise, stressed[n]), -self.rank(n), n))
        if pick == running:
            return None
        down = self.rank(pick) < self.rank(running)
        if not down and not self._dwelt(at.now):
            return None
        margin = cfg.down_margin if down else self._up_margin(running)
        current = stressed.get(running)
        if current is not None and not self._better(stressed[pick], current, margin):
            return None
        objective = promise.objective
        against = (
            "breaks the promise there" if current is None else f"{current.value(objective):.3g} s"
        )
        return Choice(
            pick,
            True,
            f"{pick} ties {running} on the new shape's first {at.requests} requests; if "
            f"the last {cfg.stress_recent_s:.0f} s of arrivals went on for {cfg.stress_s:.0f} s: "
            f"{stressed[pick].value(objective):.3g} s {objective} vs {against}",
        )

"""The stress test: what a candidate would break of the promise if the last minutes' arrivals
went on.

A small γ that looks as good as any at the start of a burst holds the long requests back through
it: the window shows that only once the backlog is served. The stress test shows it first — the
arrivals of the last ``stress_recent_s`` repeated for ``stress_s`` after the shadows' clock (the
traffic going on at its recent rate and mix), each tested candidate's shadow forked and run on
through them beside the reference's, and the promise judged on the window and those arrivals
together (README, "The autopilot"). The arrivals are built once a decision and shared by every
candidate tested; a candidate's figures are computed once a decision.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping

from sim.traces import TraceRequest
from tuner.autopilot.config import AutopilotConfig
from tuner.autopilot.promise import Figures, breaks, judge
from tuner.autopilot.shadows import Shadow, Window


def _repeat_recent(
    recent: Iterable[TraceRequest], clock: float, recent_s: float, span_s: float
) -> list[TraceRequest]:
    """A stress test's arrivals: those of the last ``recent_s`` before ``clock`` repeated after it
    until ``span_s`` is filled (the traffic goes on at its recent rate and mix)."""
    last = [r for r in recent if r.arrival > clock - recent_s]
    out: list[TraceRequest] = []
    for k in range(1, math.ceil(span_s / recent_s) + 1):
        shift = k * recent_s
        out += [
            dataclasses.replace(r, id=f"{r.id}~{k}", arrival=r.arrival + shift)
            for r in last
            if clock < r.arrival + shift <= clock + span_s
        ]
    return out


class StressTest:
    """One decision's stress test over ``window``: ``recent`` are the arrivals the shadows were
    handed lately, ``shadows`` the running candidates, ``reference`` the promise's reference."""

    def __init__(
        self,
        config: AutopilotConfig,
        window: Window,
        recent: Iterable[TraceRequest],
        shadows: Mapping[str, Shadow],
        reference: str,
    ) -> None:
        self._config, self._base, self._recent = config, window, recent
        self._shadows, self._reference = shadows, reference
        self._stressed: Window | None = None  # the window with the repeated arrivals
        self._figures: dict[str, Figures] = {}  # by candidate, once tested

    def _window(self) -> Window:
        """The decision's window and the repeated arrivals after it (built on first use)."""
        if self._stressed is None:
            cfg = self._config
            forecast = _repeat_recent(
                self._recent, self._base.clock, cfg.stress_recent_s, cfg.stress_s
            )
            self._stressed = self._base.with_forecast(forecast)
        return self._stressed

    def arrivals(self) -> int:
        """How many arrivals the test adds after the clock (0: none came in the last
        ``stress_recent_s``, nothing to repeat)."""
        return len(self._window().forecast)

    def figures(self, name: str) -> Figures:
        """``name``'s figures on the window and the repeated arrivals (its shadow forked and run
        through them, then drained for ``project_s``)."""
        if name not in self._figures:
            self._figures[name], _ = self._shadows[name].figures(
                self._window(), self._config.project_s
            )
        return self._figures[name]

    def switch_breaks(self, switched: Shadow, kept: Shadow) -> tuple[str, ...]:
        """What a switch now would cost under the test: ``switched`` is the replica's mirror
        spawned with the target's settings (``Shadow.spawn``), ``kept`` the mirror as it runs.
        The queue the running choice left — requests that have already waited — is then served
        in the target's order, which a candidate's own shadow, running it all along, never held.
        The switch breaks the promise (each as ``switch:<quantile>``), or does not beat keeping
        the running choice on the objective (``switch:<objective>``): the decision a replica
        faces is "switch now or not", not "which setting had been better all along"."""
        if self._config.stress_s <= 0:
            return ()
        breaks, figures = self._replica_verdict(switched)
        verdict = [b.replace("stress:", "switch:", 1) for b in breaks]
        if not verdict:
            objective = self._config.promise.objective
            stay, _ = kept.figures(self._window(), self._config.project_s)
            if figures.value(objective) > stay.value(objective):
                verdict.append(f"switch:{objective}")
        return tuple(verdict)

    def mend_breaks(
        self, switched: Shadow, kept: Shadow
    ) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """A move made to leave a broken promise, under the test: what the replica breaks
        switched now (``switched``, its mirror spawned with the target's settings) and what it
        breaks kept as it runs (``kept``), each against the reference (``stress:<quantile>``)."""
        if self._config.stress_s <= 0:
            return (), ()
        return self._replica_verdict(switched)[0], self._replica_verdict(kept)[0]

    def _replica_verdict(self, replica: Shadow) -> tuple[tuple[str, ...], Figures]:
        """What ``replica`` (a mirror of the replica, switched or kept) breaks of the promise
        against the reference under the test (``stress:<quantile>``), and its figures there."""
        figures, _ = replica.figures(self._window(), self._config.project_s)
        pair = {self._reference: self.figures(self._reference), "replica": figures}
        return stress_verdict(self._config, pair, self._reference, "replica"), figures

    def breaks(self, name: str) -> tuple[str, ...]:
        """What ``name`` breaks of the promise against the reference under the test (each as
        ``stress:<quantile>``); empty when it holds, for the reference itself, or with no test
        configured (``stress_s`` 0)."""
        if self._config.stress_s <= 0 or name == self._reference:
            return ()
        pair = {n: self.figures(n) for n in (self._reference, name)}
        return stress_verdict(self._config, pair, self._reference, name)


def stress_verdict(
    config: AutopilotConfig, figures: Mapping[str, Figures], reference: str, name: str
) -> tuple[str, ...]:
    """What ``name`` breaks of the promise under a stress test, against ``reference``'s figures
    under the same test (each as ``stress:<quantile>``). Without SLOs a quantile breaks beyond
    the promise's slack plus ``stress_slack`` (the throughput floor is lowered by as much): the
    test is a forecast (the last minutes going on), and holding it to a newcomer's line on the
    window would be stricter than the running choice's own guard on what did happen
    (``GUARD_SLACK`` more than a newcomer's). With SLOs, the promise's own verdict (SCR, JFI)."""
    promise = config.promise
    if promise.slo is None:
        broken = breaks(promise, figures[name], figures[reference], config.stress_slack)
    else:
        broken = judge(promise, figures, reference, (reference,))[name].broken
    return tuple(f"stress:{b}" for b in broken)

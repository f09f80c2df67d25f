"""A candidate's shadow: a simulator replaying the observed traffic under one setting, all along.

The comparison reads from it what every request of the window cost under that setting: the
latencies of those it finished, and — for those it has not, typically the long requests a small γ
holds back — a *projection*: the shadow is forked (its queue, batch and KV copied; the past
arrivals and completions shared, not copied) and run on with no further arrivals until they finish
or ``horizon_s`` passes. A request held back is thus charged its wait so far *and* the backlog
ahead of it in that setting's order, before the drain shows it (issue 32: counted only with its
wait so far, a held-back request flatters exactly the setting that starves it). With no arrivals
the projection is a lower bound of what continuing traffic would cost a starving setting; it is
exact for the reference, whose order is by age.
"""

from __future__ import annotations

import dataclasses
import math
import pickle
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from scheduler.settings import Settings, SloFqParams
from sim.engine import EngineConfig, Simulator
from sim.traces import TraceRequest
from tuner.autopilot.promise import Figures, figures_of

FIRST_CHUNK_S = 30.0  # the projection advances in doubling chunks, stopping once all are done


@dataclass(frozen=True, slots=True)
class Served:
    """What a shadow did with one request (times absolute, in s)."""

    ttft: float
    ttlt: float
    finished_at: float
    output_tokens: int


@dataclass(frozen=True, slots=True)
class Projection:
    """The projected first-token and finish times of a shadow's unfinished requests (None: not
    reached within the horizon), and when its queue would be empty with no further arrival."""

    first_token_at: dict[str, float | None]
    finished_at: dict[str, float | None]
    drained_at: float | None  # None: still busy at the horizon


@dataclass(frozen=True, slots=True)
class Window:
    """The requests a comparison is over (ids and arrivals, in arrival order), its clock and span,
    and per request what SLO figures need (tenant, type, tokens) when ``slo`` is declared."""

    clock: float
    ids: list[str]
    arrivals: np.ndarray
    span_s: float
    meta: Mapping[str, tuple[str, str, int]]
    slo: SloFqParams | None = None


def repeat_recent(
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


class Shadow:
    """One candidate's continuous replay of the observed traffic."""

    def __init__(self, settings: Settings, engine: EngineConfig) -> None:
        self.sim = Simulator([], settings, engine)
        self.done: dict[str, Served] = {}

    def advance(self, requests: Sequence[TraceRequest], t: float) -> None:
        if requests:
            self.sim.extend_arrivals(requests)
        self.sim.advance_to(t)
        done, _ = self.sim.drain()
        for c in done:
            self.done[c.id] = Served(
                c.first_token_at - c.arrival,
                c.finished_at - c.arrival,
                c.finished_at,
                c.output_tokens,
            )

    def forget(self, ids: Iterable[str]) -> None:
        for rid in ids:
            self.done.pop(rid, None)

    def busy(self) -> bool:
        return bool(self.sim.running) or bool(len(self.sim.waiting))

    def fork(self) -> Simulator:
        """A copy of the shadow's engine that can run on without touching the shadow: its queue,
        batch, KV and policy state are copied; the lists a simulator only appends to (arrivals
        already handed over, completions, the γ timeline) start empty in the copy."""
        fork = _copied(self.sim, ("arrivals", "completions", "rejected", "gamma_timeline"))
        fork.next_arrival = 0
        return fork

    def spawn(self, settings: Settings) -> Shadow:
        """A new shadow that takes over this one's engine (queue, batch, KV, clock) and what it
        served so far, and runs ``settings`` from its next step — as a replica switched now would
        (``tuner.autopilot.candidates``: the search starts a candidate this way, never from an empty
        engine)."""
        child = Shadow.__new__(Shadow)
        child.sim = _copied(self.sim, ("gamma_timeline",))
        child.sim.apply_settings(settings)
        child.done = dict(self.done)
        return child

    def project(
        self, pending: set[str], horizon_s: float, forecast: Sequence[TraceRequest] = ()
    ) -> Projection:
        """Run a fork with no further arrivals (or only ``forecast``'s, all after the clock)
        until every request of ``pending`` (unfinished here) has finished, the queue is empty or
        ``horizon_s`` has passed."""
        if not pending or not self.busy():
            return Projection({}, {}, self.sim.now)
        if horizon_s <= 0:  # no projection: only what has happened (first tokens of the batch)
            known = {r.id: r.first_token_at for r in self.sim.running if r.id in pending}
            return Projection(known, {}, None)
        fork = self.fork()
        if forecast:
            fork.extend_arrivals(forecast)
        start, chunk = fork.now, FIRST_CHUNK_S
        finished: dict[str, float | None] = {}
        first: dict[str, float | None] = {}
        t = last = start
        while t < start + horizon_s and len(finished) < len(pending):
            t = min(start + horizon_s, t + chunk)
            chunk *= 2
            fork.advance_to(t)
            done, _ = fork.drain()
            for c in done:
                last = max(last, c.finished_at)
                if c.id in pending:
                    finished[c.id], first[c.id] = c.finished_at, c.first_token_at
            if (
                not fork.running
                and not len(fork.waiting)
                and fork.next_arrival >= len(fork.arrivals)
            ):
                break
        idle = not fork.running and not len(fork.waiting) and not fork.arrivals
        for r in fork.running:  # started within the horizon: its first token is known
            if r.id in pending and r.first_token_at is not None:
                first.setdefault(r.id, r.first_token_at)
        for rid in pending:
            finished.setdefault(rid, None)
            first.setdefault(rid, None)
        return Projection(first, finished, last if idle else None)

    def figures(
        self, window: Window, horizon_s: float, forecast: Sequence[TraceRequest] = ()
    ) -> tuple[Figures, Projection]:
        """The promise's figures over ``window``'s requests (and ``forecast``'s, a stress test's
        arrivals after the clock): a request finished counts with its latencies, one not with its
        projection ``horizon_s`` ahead (censored there when not reached by then)."""
        ids, arrivals = window.ids, window.arrivals
        pending = {rid for rid in ids if rid not in self.done}
        pending.update(r.id for r in forecast)
        projection = self.project(pending, horizon_s, forecast)
        if forecast:
            ids = ids + [r.id for r in forecast]
            arrivals = np.concatenate([arrivals, [r.arrival for r in forecast]])
        censor = window.clock + horizon_s
        ttft, ttlt = np.empty(len(ids)), np.empty(len(ids))
        tokens = 0
        lo = window.clock - window.span_s
        for i, rid in enumerate(ids):
            done = self.done.get(rid)
            if done is not None:
                ttft[i], ttlt[i] = done.ttft, done.ttlt
                if done.finished_at >= lo:
                    tokens += done.output_tokens
                continue
            first = projection.first_token_at.get(rid)
            end = projection.finished_at.get(rid)
            ttft[i] = (first if first is not None else censor) - arrivals[i]
            ttlt[i] = (end if end is not None else censor) - arrivals[i]
        rate = tokens / window.span_s
        if window.slo is None:
            return figures_of(ttft, ttlt, rate, len(pending)), projection
        meta = [window.meta.get(rid, ("default", "chat", 0)) for rid in window.ids]
        meta += [(r.tenant, r.type, r.prompt_tokens + r.output_tokens) for r in forecast]
        figures = figures_of(
            ttft,
            ttlt,
            rate,
            len(pending),
            slo=window.slo,
            tenants=np.array([m[0] for m in meta], dtype=object),
            types=np.array([m[1] for m in meta], dtype=object),
            tokens=np.array([m[2] for m in meta], dtype=float),
            window_s=window.span_s,
        )
        return figures, projection


def _copied(sim: Simulator, fresh: tuple[str, ...]) -> Simulator:
    """A deep copy of ``sim`` whose ``fresh`` list attributes start empty. A pickle round trip:
    the same copy as ``copy.deepcopy`` (every object the engine holds pickles), which was 18% of
    an autopilot replay's profile while the round trip does not show among its top 30 (the
    autopilot forks a shadow for every projection)."""
    kept = {name: getattr(sim, name) for name in fresh}
    try:
        for name in fresh:
            setattr(sim, name, [])
        blob = pickle.dumps(sim, protocol=pickle.HIGHEST_PROTOCOL)
    finally:
        for name, value in kept.items():
            setattr(sim, name, value)
    copied: Simulator = pickle.loads(blob)
    return copied

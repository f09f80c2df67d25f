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

from scheduler.names import DEFAULT_TENANT, DEFAULT_TYPE
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
    """The requests a comparison is over: the observed ones (consecutive in the order they were
    handed to the shadows, which is arrival order), then a stress test's ``forecast`` (arrivals
    after the clock), with their arrivals; its clock and span; and per request what SLO figures
    need (tenant, type, tokens) when ``slo`` is declared. Built once per decision (``over``,
    ``with_forecast``): every candidate's figures read the same arrays."""

    clock: float
    ids: list[str]
    arrivals: np.ndarray
    span_s: float
    slo: SloFqParams | None = None
    tenants: np.ndarray | None = None  # per request, with ``slo`` only (as ``types``, ``tokens``)
    types: np.ndarray | None = None
    tokens: np.ndarray | None = None
    forecast: tuple[TraceRequest, ...] = ()  # the last ``len(forecast)`` of ``ids``

    @classmethod
    def over(
        cls,
        clock: float,
        ids: list[str],
        arrivals: np.ndarray,
        span_s: float,
        meta: Mapping[str, tuple[str, str, int]],
        slo: SloFqParams | None = None,
    ) -> Window:
        """The window of ``ids``, their SLO figures' inputs read from ``meta`` (tenant, type and
        tokens per request) when ``slo`` is declared."""
        if slo is None:
            return cls(clock, ids, arrivals, span_s)
        rows = [meta.get(rid, (DEFAULT_TENANT, DEFAULT_TYPE, 0)) for rid in ids]
        return cls(clock, ids, arrivals, span_s, slo, *_slo_columns(rows))

    def with_forecast(self, forecast: Sequence[TraceRequest]) -> Window:
        """This window and ``forecast``'s requests after it (a stress test's arrivals)."""
        if not forecast:
            return self
        ids = self.ids + [r.id for r in forecast]
        arrivals = np.concatenate([self.arrivals, [r.arrival for r in forecast]])
        if self.slo is None:
            return dataclasses.replace(self, ids=ids, arrivals=arrivals, forecast=tuple(forecast))
        assert self.tenants is not None and self.types is not None and self.tokens is not None
        added = _slo_columns(
            [(r.tenant, r.type, r.prompt_tokens + r.output_tokens) for r in forecast]
        )
        tenants, types, tokens = (
            np.concatenate([mine, more])
            for mine, more in zip((self.tenants, self.types, self.tokens), added, strict=True)
        )
        return Window(
            self.clock,
            ids,
            arrivals,
            self.span_s,
            self.slo,
            tenants,
            types,
            tokens,
            tuple(forecast),
        )

    @property
    def observed(self) -> int:
        """How many of ``ids`` were observed (the rest are the forecast's)."""
        return len(self.ids) - len(self.forecast)


def _slo_columns(rows: Sequence[tuple[str, str, int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Tenants, types and tokens as the fairness report takes them, from per-request rows."""
    return (
        np.array([m[0] for m in rows], dtype=object),
        np.array([m[1] for m in rows], dtype=object),
        np.array([m[2] for m in rows], dtype=float),
    )


@dataclass(frozen=True, slots=True)
class WindowServed:
    """What a shadow served of a window's observed requests, row by row: ``done`` marks those it
    finished (the other rows' latencies are NaN)."""

    done: np.ndarray
    ttft: np.ndarray
    ttlt: np.ndarray
    finished_at: np.ndarray
    tokens: np.ndarray


class ServedLog:
    """What a shadow served, one row per request in the order they were handed to it (arrival
    order): a window — a run of consecutive requests — reads its latencies as array slices. Looked
    up request by request, the figures of every candidate at every decision over windows of
    ten thousand requests and more were a tenth of the autopilot's CPU."""

    INITIAL_ROWS = 1_024

    def __init__(self) -> None:
        self.place: dict[str, int] = {}  # request id -> its sequence number (row + ``base``)
        self.ids: list[str] = []  # per row, the request handed over
        self.base = 0  # the sequence number of row 0 (rows before it were forgotten)
        self.front = 0  # rows before this one were forgotten too (freed once half the log)
        self.done = np.zeros(self.INITIAL_ROWS, dtype=bool)
        self.ttft = np.full(self.INITIAL_ROWS, math.nan)
        self.ttlt = np.full(self.INITIAL_ROWS, math.nan)
        self.finished_at = np.full(self.INITIAL_ROWS, math.nan)
        self.tokens = np.zeros(self.INITIAL_ROWS, dtype=np.int64)

    def copy(self) -> ServedLog:
        out = ServedLog.__new__(ServedLog)
        out.place, out.ids = dict(self.place), list(self.ids)
        out.base, out.front = self.base, self.front
        for name in ("done", "ttft", "ttlt", "finished_at", "tokens"):
            setattr(out, name, getattr(self, name).copy())
        return out

    def handed(self, ids: Iterable[str]) -> None:
        """Rows for requests handed to the shadow (not served yet)."""
        for rid in ids:
            self.place[rid] = self.base + len(self.ids)
            self.ids.append(rid)
        if len(self.ids) > len(self.done):
            self._keep(0, 2 * len(self.ids))

    def served(self, rid: str, s: Served) -> None:
        seq = self.place.get(rid)
        if seq is None:  # forgotten already (left every window before it finished)
            return
        row = seq - self.base
        self.done[row] = True
        self.ttft[row], self.ttlt[row] = s.ttft, s.ttlt
        self.finished_at[row], self.tokens[row] = s.finished_at, s.output_tokens

    def forget(self, ids: Iterable[str]) -> None:
        """Drop requests (the oldest, leaving the window); the leading rows no request refers to
        any more are freed once they are half the log."""
        for rid in ids:
            seq = self.place.pop(rid, None)
            if seq is not None:
                self.done[seq - self.base] = False
        while self.front < len(self.ids) and self.ids[self.front] not in self.place:
            self.front += 1
        if self.front and 2 * self.front >= len(self.ids):
            self._keep(self.front, max(self.INITIAL_ROWS, 2 * (len(self.ids) - self.front)))

    def _keep(self, start: int, capacity: int) -> None:
        """Keep the rows from ``start`` on, in arrays of ``capacity`` rows."""
        used = len(self.ids) - start
        for name, fill in (
            ("done", False),
            ("ttft", math.nan),
            ("ttlt", math.nan),
            ("finished_at", math.nan),
            ("tokens", 0),
        ):
            old = getattr(self, name)
            new = np.full(capacity, fill, dtype=old.dtype)
            kept = old[start : start + used]  # rows past the old capacity are new: unserved
            new[: len(kept)] = kept
            setattr(self, name, new)
        del self.ids[:start]
        self.base += start
        self.front -= start

    def read(self, ids: list[str]) -> WindowServed:
        """What was served of ``ids`` (a request never handed over reads as not served)."""
        rows = self._rows(ids)
        if rows is None:  # not a run of consecutive requests: gathered one by one
            seqs = [self.place.get(rid) for rid in ids]
            known = np.array([s is not None for s in seqs], dtype=bool)
            index = np.array([s - self.base if s is not None else 0 for s in seqs], dtype=np.intp)
            served = WindowServed(
                self.done[index] & known,
                self.ttft[index],
                self.ttlt[index],
                self.finished_at[index],
                self.tokens[index],
            )
            for column in (served.ttft, served.ttlt, served.finished_at):
                column[~known] = math.nan
            return served
        return WindowServed(
            self.done[rows],
            self.ttft[rows].copy(),
            self.ttlt[rows].copy(),
            self.finished_at[rows],
            self.tokens[rows],
        )

    def _rows(self, ids: list[str]) -> slice | None:
        """The rows of ``ids`` when they are consecutive requests in the order handed over."""
        if not ids:
            return slice(0, 0)
        seq = self.place.get(ids[0])
        if seq is None:
            return None
        start = seq - self.base
        if self.ids[start : start + len(ids)] != ids:  # a C-level comparison, by identity first
            return None
        return slice(start, start + len(ids))


class Shadow:
    """One candidate's continuous replay of the observed traffic."""

    def __init__(self, settings: Settings, engine: EngineConfig) -> None:
        self.sim = Simulator([], settings, engine)
        self.done: dict[str, Served] = {}
        self.log = ServedLog()  # ``done`` again, by row, for a window's figures

    def advance(self, requests: Sequence[TraceRequest], t: float) -> None:
        if requests:
            self.sim.extend_arrivals(requests)
            self.log.handed(r.id for r in requests)
        self.sim.advance_to(t)
        done, _ = self.sim.drain()
        for c in done:
            served = Served(
                c.first_token_at - c.arrival,
                c.finished_at - c.arrival,
                c.finished_at,
                c.output_tokens,
            )
            self.done[c.id] = served
            self.log.served(c.id, served)

    def revise(self, lengths: Mapping[str, int]) -> None:
        """True output lengths of requests handed over with imputed ones: those not finished here
        run to them (``Simulator.revise_lengths``); those finished keep what they cost."""
        self.sim.revise_lengths(lengths)

    def forget(self, ids: Iterable[str]) -> None:
        ids = list(ids)
        for rid in ids:
            self.done.pop(rid, None)
        self.log.forget(ids)

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
        child.log = self.log.copy()
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

    def waits(self, window: Window) -> np.ndarray:
        """The first-token waits of ``window``'s observed requests here: of one finished, its
        TTFT; of one not, its wait so far (to the window's clock) — a lower bound, no
        projection."""
        served = self.log.read(window.ids[: window.observed])
        return np.where(served.done, served.ttft, window.clock - window.arrivals[: window.observed])

    def figures(self, window: Window, horizon_s: float) -> tuple[Figures, Projection]:
        """The promise's figures over ``window``'s requests (its forecast's too, a stress test's
        arrivals after the clock): a request finished counts with its latencies, one not with its
        projection ``horizon_s`` ahead (censored there when not reached by then)."""
        observed = window.observed
        ids = window.ids if not window.forecast else window.ids[:observed]
        served = self.log.read(ids)
        waiting = np.flatnonzero(~served.done).tolist()  # rows not finished here
        pending = {ids[i] for i in waiting}
        pending.update(r.id for r in window.forecast)
        projection = self.project(pending, horizon_s, window.forecast)
        ttft, ttlt = served.ttft, served.ttlt
        if window.forecast:
            extra = np.empty(len(window.forecast))
            ttft, ttlt = np.concatenate([ttft, extra]), np.concatenate([ttlt, extra])
        censor, arrivals, every = window.clock + horizon_s, window.arrivals, window.ids
        for i in [*waiting, *range(observed, len(every))]:
            rid = every[i]
            first = projection.first_token_at.get(rid)
            end = projection.finished_at.get(rid)
            ttft[i] = (first if first is not None else censor) - arrivals[i]
            ttlt[i] = (end if end is not None else censor) - arrivals[i]
        lo = window.clock - window.span_s
        counted = served.done & (served.finished_at >= lo)
        rate = int(served.tokens[counted].sum()) / window.span_s
        if window.slo is None:
            return figures_of(ttft, ttlt, rate, len(pending)), projection
        figures = figures_of(
            ttft,
            ttlt,
            rate,
            len(pending),
            slo=window.slo,
            tenants=window.tenants,
            types=window.types,
            tokens=window.tokens,
            window_s=window.span_s,
        )
        return figures, projection


class Mirror:
    """The replica itself: the traffic replayed under what the replica ran when (every switch
    applied as it was made), where a candidate's shadow ran one setting all along — a switch now
    is judged on it (the autopilot's ``switch_test``). Until the replica first runs another
    setting it *is* the running choice's shadow (a replay of its own would be the same one run
    twice: 1.78 → 1.47 CPU s per candidate-hour on conv1.1); it is then spawned from it."""

    __slots__ = ("_own",)

    def __init__(self) -> None:
        self._own: Shadow | None = None

    def of(self, running: Shadow) -> Shadow:
        """The replica's replay, ``running`` being the running choice's shadow."""
        return running if self._own is None else self._own

    def owned(self) -> tuple[Shadow, ...]:
        """The replay it runs of its own, if any (fed beside the candidates' shadows)."""
        return () if self._own is None else (self._own,)

    def runs(self, settings: Settings, running: Shadow, switched: bool) -> None:
        """The replica runs ``settings`` from now (``switched``: other than ``running``'s)."""
        if self._own is not None:
            self._own.sim.apply_settings(settings)
        elif switched:
            self._own = running.spawn(settings)


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

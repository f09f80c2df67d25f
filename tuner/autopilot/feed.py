"""What the autopilot's shadows are fed: a live replica's observations turned into the replay of its
traffic, and the window of requests a decision compares them on.

A replica reports a request when it first sees it (in flight or finished, not always in arrival
order) and its output length only once it completes. ``Feed`` holds the arrivals until the
shadows' clock (``delay_s`` behind "now") passes them, hands each over with its true length if it
completed by then and an *imputed* one if not — never its true one — and keeps what a decision
reads: the window's requests in the order the shadows were handed them, per request what SLO
figures need, the last minutes of arrivals a stress test repeats, and the change of the traffic's
shape (``tuner.autopilot.shape``), after which a window starts at the change.

**Imputation from a whole cohort.** A length is *drawn* (by a hash of the request's id) from the
completed lengths above what the request has generated so far — completed lengths of requests
that *arrived* before nearly every request still in flight (all but ``STRAGGLERS`` of them), never
the latest completions. It used to be the median of the latest completions, biased short twice
whenever the queue grows: the requests a size-first order serves first, and the short ones of any
order, complete first; and the median of a long-tailed length is a fraction of its mean. On a
burst of long reasoning outputs above capacity the shadows were handed 53–64% of the true output
tokens (90–99% now) and saw no overload; a small γ judged safe on them broke P99 TTFT by 1.38×
(``benchmarks/autopilot_sweep.py``, variant 86). A cohort whose requests have all completed is a
fair sample of its arrivals' lengths. Once more than one request type has completed, the cohort is
the request's type's (a reasoning output is several times a chat one's: on sweep variant 15, arXiv
chat then reasoning above capacity, a reasoning request in flight was handed a mean of 666 tokens
from a cohort mostly of the chat phase, its true mean 1,431; 888 per type) — its latest
completions while its own fair cohort is under ``COHORT_MIN``; one type of traffic is fed as
before. Likewise after a change of the traffic's shape (``tuner.autopilot.shape``), once
``COHORT_MIN`` of the new shape's arrivals have completed: a backlog of the new shape in flight
pins the fair cohort to the old one (sweep seed 7, variant 30, arXiv then BWB at 1.35× capacity:
a mean of 324 tokens handed for a true 843; 503 from the new shape).

**Revision after a change of shape.** No cohort knows a new shape's first requests: they are
handed over a minute after arrival, before any of them completes and minutes before the change is
found, imputed from the old shape's lengths (sweep seed 5150, variant 9, arXiv then BWB: the five
minutes after the change at 31% of their true output tokens, and γ 0.001, judged on shadows that
saw a fraction of the work, broke P99 TTFT by 1.55×). So once a change of shape is found, a request
of the new shape handed with a length imputed from an older cohort and completed *longer* than
that is revised to its true length in every shadow that has not finished it
(``revisions``, ``Simulator.revise_lengths``; those completed before the change was found, when
it is) — the work the new shape's queue holds, corrected as the truth arrives (variant 9: no
switch, every figure kept, P99 TTFT 0.976×). No other revision: when the truth arrives a request
imputed long is still in a shadow while one imputed short has mostly left it, so revisions bias
the work the shadows hold by which requests they still hold. Revised both ways, they are mostly
cuts (seed 2718's variant 4, reasoning at 1.12× capacity: sarathi's shadow finished its requests
with 82% of their true tokens and saw a median first-token wait of 0.7 s where the truth was 75
s); lengthened only, everywhere, the shadows gain work (``shift_heldout``: sarathi's shadow put the
P95 TTFT of minutes 0–39 at 81 s, the truth 49 s, unrevised 57 s, and a standing queue held every
move down through the BWB phase). Within a change of shape the imputation's own error is
systematic, and it dominates.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import itertools
import math
import zlib
from collections import deque
from collections.abc import Iterable, Mapping

import numpy as np

from scheduler.metrics import Completion
from scheduler.names import request_type
from scheduler.settings import SloFqParams
from sim.traces import TraceRequest
from tuner.autopilot.config import AutopilotConfig
from tuner.autopilot.shadows import Window
from tuner.autopilot.shape import ShapeWatch
from tuner.autopilot.types import Arrival, arrival_order

# Requests still in flight older than the imputation cohort's end: the few a small γ starves must
# not pin the cohort hours back (each is at most one of ``history`` lengths missing from it).
STRAGGLERS = 20
COHORT_KEPT = 50_000  # completed (arrival, length) pairs kept, the newest arrivals
TYPE_KEPT = 10_000  # … and of each request type (``REQUEST_TYPES``: five)
# Lengths are imputed per request type once several are seen (a reasoning request's output is
# several times a chat one's) and from the arrivals since a change of the traffic's shape; such a
# cohort smaller than this draws from its latest completions (``Feed._cohort``).
COHORT_MIN = 100


class Feed:
    """The shadows' input: ``arrive`` and ``complete`` as observations come, ``take`` what the
    shadows' clock has passed, ``window`` at a decision."""

    def __init__(self, config: AutopilotConfig) -> None:
        self.config = config
        self.clock: float | None = None  # the shadows' clock: replayed up to here
        self.late = 0  # requests first seen after the shadows had passed their arrival
        # Arrived, not yet handed to the shadows, in (arrival, id) order.
        self._pending: list[Arrival] = []
        # Output lengths of completed requests not yet replayed: only those that arrived after the
        # shadows' clock (the others were replayed already, or never will be), dropped once the
        # clock passes them.
        self._lengths: dict[str, tuple[float, int]] = {}  # id -> (arrival, output length)
        # Completed requests' (arrival, output length), in arrival order, of all types and per
        # type, and the requests seen but not completed (id -> (arrival, type)): the imputation's
        # cohorts (``_cohort``).
        self._completed: list[tuple[float, int]] = []
        self._completed_by_type: dict[str, list[tuple[float, int]]] = {}
        self._in_flight: dict[str, tuple[float, str]] = {}
        # The revision after a change of shape (the module's docstring). Handed to the shadows
        # with an imputed length, until the true one is known or the request leaves the window:
        # id -> (that length, the change of shape its cohort was of; -inf: none).
        self._imputed_handed: dict[str, tuple[int, float]] = {}
        # Completed longer than imputed, in the window, not revised (yet): id -> (arrival, true
        # length, imputed length, its cohort's change of shape); and the change of shape they
        # were last checked against.
        self._short: dict[str, tuple[float, int, int, float]] = {}
        self._short_checked = -math.inf
        # Revised, not yet handed on to the shadows (``revisions``): id -> true length; and the
        # latest arrival among them.
        self._revised: dict[str, int] = {}
        self._revised_latest = -math.inf
        self._window: deque[tuple[float, str]] = deque()  # (arrival, id) replayed, in the window
        # per request of the window: tenant, type, tokens (prompt + output, imputed if unknown)
        self._meta: dict[str, tuple[str, str, int]] = {}
        self.recent: deque[TraceRequest] = deque()  # replayed in the last ``stress_recent_s``
        self.shape = (
            ShapeWatch(config.shape_change, config.shape_recent_s, config.window_s + config.delay_s)
            if config.shape_change is not None
            else None
        )

    def arrive(self, arrivals: Iterable[Arrival]) -> None:
        for a in arrivals:
            kind = request_type(a.type)
            if kind != a.type:
                # A type the engine does not know (a replica reports what its clients named):
                # the plugin's own rule, so the shadows can replay it and a cohort per type
                # stays one of five.
                a = dataclasses.replace(a, type=kind)
            if a.id not in self._lengths:
                self._in_flight[a.id] = (a.arrival, a.type)
            if self.shape is not None:
                self.shape.add(a.arrival, a.prompt_tokens)
            if self.clock is not None and a.arrival <= self.clock:
                self.late += 1  # the shadows are past it: replaying it would rewrite their past
                continue
            bisect.insort(self._pending, a, key=arrival_order)

    def complete(self, completions: Iterable[Completion]) -> None:
        for c in completions:
            if self.clock is None or c.arrival > self.clock:
                self._lengths[c.id] = (c.arrival, c.output_tokens)
            self._in_flight.pop(c.id, None)
            handed = self._imputed_handed.pop(c.id, None)
            if handed is not None and self.config.revise_lengths and c.output_tokens > handed[0]:
                self._short[c.id] = (c.arrival, c.output_tokens, *handed)
                self._revise_stale([c.id])
            kept = [
                (self._completed, COHORT_KEPT),
                (self._completed_by_type.setdefault(request_type(c.type), []), TYPE_KEPT),
            ]
            for rows, bound in kept:
                bisect.insort(rows, (c.arrival, c.output_tokens))
                if len(rows) > bound:
                    del rows[: len(rows) - bound]

    def _revise_stale(self, ids: Iterable[str]) -> None:
        """Of ``ids`` (requests of ``_short``), those of the traffic's current shape whose length
        was imputed from a cohort of an older one are revised to their true length (the module's
        docstring says why no other)."""
        since = self.shape.since if self.shape is not None else -math.inf
        for rid in ids:
            arrival, length, imputed, of_shape = self._short[rid]
            if not arrival >= since > of_shape:
                continue  # of an earlier shape, or imputed from its own: kept as handed
            del self._short[rid]
            self._revised[rid] = length
            self._revised_latest = max(self._revised_latest, arrival)
            meta = self._meta.get(rid)
            if meta is not None:  # its tokens for the SLO figures: prompt + output
                self._meta[rid] = (meta[0], meta[1], meta[2] - imputed + length)

    def _cohort(self, kind: str) -> tuple[list[int], float]:
        """The imputation's sample for a request of type ``kind``, sorted, and the change of shape
        it is of (-inf: none, or not only the arrivals since the last one): the last ``history``
        completed lengths among requests that arrived before all but ``STRAGGLERS`` of those
        still in flight (the module's docstring says why; all completed lengths while none is
        that old). Of its type once more than one type has completed, and of the arrivals since
        the last change of the traffic's shape once ``COHORT_MIN`` of them have completed (the
        old shape's lengths are no evidence about the new one's); such a cohort still smaller
        than ``COHORT_MIN`` gives way to its latest completions, and a type with too few of
        those to the whole traffic's cohort."""
        since = self.shape.since if self.shape is not None else -math.inf
        strata: list[tuple[list[tuple[float, int]], str | None]] = [(self._completed, None)]
        if len(self._completed_by_type) > 1 and kind in self._completed_by_type:
            strata.insert(0, (self._completed_by_type[kind], kind))
        for rows, of_kind in strata:
            in_flight = [at for at, k in self._in_flight.values() if of_kind in (None, k)]
            narrowed = of_kind is not None
            first = bisect.bisect_left(rows, (since, -1)) if since > -math.inf else 0
            shaped = first > 0 and len(rows) - first >= COHORT_MIN
            if shaped:
                rows, narrowed = rows[first:], True
                in_flight = [at for at in in_flight if at >= since]
            of_shape = since if shaped else -math.inf
            fair = self._fair(rows, in_flight)
            if not narrowed or len(fair) >= COHORT_MIN:
                return fair, of_shape
            if len(rows) >= COHORT_MIN:
                return sorted(n for _, n in rows[-self.config.history :]), of_shape
        return self._fair(self._completed, [at for at, _ in self._in_flight.values()]), -math.inf

    def _fair(self, rows: list[tuple[float, int]], in_flight: list[float]) -> list[int]:
        """The last ``history`` lengths of ``rows`` that arrived before all but ``STRAGGLERS``
        of ``in_flight`` (arrival times), sorted."""
        oldest = heapq.nsmallest(STRAGGLERS + 1, in_flight)
        end = len(rows)
        if len(oldest) > STRAGGLERS:
            cut = bisect.bisect_left(rows, (oldest[-1], -1))
            if cut > 0:
                end = cut
        return sorted(n for _, n in rows[max(0, end - self.config.history) : end])

    @staticmethod
    def _imputed(a: Arrival, generated: int, cohort: list[int]) -> int:
        """A length for a request still in flight: one of the cohort's lengths above what it has
        generated, drawn by a hash of its id (deterministic), within its cap — never its true
        length (it is unknown). A draw, not the median: the imputed requests then carry the
        cohort's mean and tail, the work a queue of them really holds (the median of a
        long-tailed length is a fraction of its mean)."""
        i = bisect.bisect_right(cohort, generated)
        if i < len(cohort):
            guess = cohort[i + zlib.crc32(a.id.encode()) % (len(cohort) - i)]
        else:
            guess = generated + 1
        return max(1, min(a.max_tokens, max(guess, generated + 1)))

    def take(
        self, now: float, generated: Mapping[str, int]
    ) -> tuple[float, list[TraceRequest], list[str]] | None:
        """At ``now``, the shadows' new clock ``t`` (``delay_s`` behind it), the requests that
        arrived up to ``t`` not yet handed over (their lengths known or imputed from
        ``generated``, the tokens so far per request in flight) and the ids that left the window;
        None when the clock is already at or past ``t``."""
        if self.shape is not None:  # bounded even while no decision is judged (few requests)
            self.shape.trim(now)
        t = now - self.config.delay_s
        if self.clock is not None and t <= self.clock:
            return None
        batch: list[TraceRequest] = []
        due = bisect.bisect_right(self._pending, t, key=lambda a: a.arrival)
        taken, self._pending = self._pending[:due], self._pending[due:]
        cohorts: dict[str, tuple[list[int], float]] = {}
        for a in taken:
            known = self._lengths.pop(a.id, None)
            if known is not None:
                out = known[1]
            else:
                if a.type not in cohorts:
                    cohorts[a.type] = self._cohort(a.type)
                cohort, of_shape = cohorts[a.type]
                out = self._imputed(a, generated.get(a.id, 0), cohort)
                self._imputed_handed[a.id] = (out, of_shape)
            batch.append(
                TraceRequest(
                    id=a.id,
                    arrival=a.arrival,
                    prompt_tokens=a.prompt_tokens,
                    output_tokens=out,
                    max_tokens=max(a.max_tokens, 1),
                    tenant=a.tenant,
                    type=a.type,
                )
            )
            self._window.append((a.arrival, a.id))
            self._meta[a.id] = (a.tenant, a.type, a.prompt_tokens + out)
        self.recent.extend(batch)
        while self.recent and self.recent[0].arrival < t - self.config.stress_recent_s:
            self.recent.popleft()
        self.clock = t
        # Completed, never reported as arrived, and now behind the clock: never to be replayed.
        for rid in [rid for rid, (at, _) in self._lengths.items() if at <= t]:
            del self._lengths[rid]
        horizon = t - self.config.window_s - self.config.settle_s
        gone = []
        while self._window and self._window[0][0] < horizon:
            gone.append(self._window.popleft()[1])
        for rid in gone:
            self._meta.pop(rid, None)
            self._imputed_handed.pop(rid, None)
            self._short.pop(rid, None)
        # Never completed by the time they left the window (rejected, or starving): no longer
        # in flight for the cohort.
        for rid in [rid for rid, (at, _) in self._in_flight.items() if at < horizon]:
            del self._in_flight[rid]
        return t, batch, gone

    def revisions(self) -> dict[str, int]:
        """The true output lengths to revise since the last call (id -> length; the module's
        docstring says which; ``Shadow.revise`` gives them to each shadow): the new shape's,
        imputed from an older cohort, longer than imputed. The stress test's recent arrivals take
        them here, the window's SLO figures as they are found (``_revise_stale``)."""
        since = self.shape.since if self.shape is not None else -math.inf
        if since != self._short_checked:  # a change of shape found since: its requests too
            self._short_checked = since
            self._revise_stale(list(self._short))
        revised, self._revised = self._revised, {}
        latest, self._revised_latest = self._revised_latest, -math.inf
        if not self.recent or latest < self.recent[0].arrival:
            return revised  # none is among the recent arrivals (under load, the usual case)
        self.recent = deque(
            dataclasses.replace(r, output_tokens=revised[r.id]) if r.id in revised else r
            for r in self.recent
        )
        return revised

    def settled(self, clock: float) -> list[tuple[float, str]]:
        """The window's requests (arrival, id) that arrived ``settle_s`` or more before
        ``clock``."""
        # The window is in arrival order (``take`` hands requests over in it, and one reported
        # behind the clock is never replayed): the settled ones are a prefix, found from the
        # right end — a scan of the whole window was 3.5% of an autopilot replay (``heldout``).
        cutoff = clock - self.config.settle_s
        kept = len(self._window)
        while kept and self._window[kept - 1][0] > cutoff:
            kept -= 1
        return list(itertools.islice(self._window, kept))

    def window(
        self, now: float, clock: float, settled: list[tuple[float, str]], slo: SloFqParams | None
    ) -> tuple[Window, float | None]:
        """The decision's window over ``settled`` at ``now`` (the shadows at ``clock``), and
        where it starts after a change of the traffic's shape (None: it is the whole window)."""
        cfg = self.config
        arrivals = np.fromiter((a for a, _ in settled), float, len(settled))
        ids = [rid for _, rid in settled]
        since = None
        if self.shape is not None:
            self.shape.check(now)
            since = self.shape.start(arrivals, cfg.shape_min_requests)
        span_s = cfg.window_s
        if since is not None:
            # The traffic changed shape: the old shape's tails are no evidence about the new.
            first = int(np.searchsorted(arrivals, since, side="left"))
            ids, arrivals = ids[first:], arrivals[first:]
            span_s = min(span_s, max(clock - since, cfg.interval_s))
        return Window.over(clock, ids, arrivals, span_s, self._meta, slo), since

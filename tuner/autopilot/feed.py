"""What the autopilot's shadows are fed: a live replica's observations turned into the replay of its
traffic, and the window of requests a decision compares them on.

A replica reports a request when it first sees it (in flight or finished, not always in arrival
order) and its output length only once it completes. ``Feed`` holds the arrivals until the
shadows' clock (``delay_s`` behind "now") passes them, hands each over with its true length if it
completed by then and an *imputed* one if not — the median of recently completed lengths longer
than what it has generated so far, never its true one — and keeps what a decision reads: the
window's requests in the order the shadows were handed them, per request what SLO figures need,
the last minutes of arrivals a stress test repeats, and the change of the traffic's shape
(``tuner.autopilot.shape``), after which a window starts at the change.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable, Mapping

import numpy as np

from scheduler.metrics import Completion
from scheduler.settings import SloFqParams
from sim.traces import TraceRequest
from tuner.autopilot.config import AutopilotConfig
from tuner.autopilot.shadows import Window
from tuner.autopilot.shape import ShapeWatch
from tuner.autopilot.types import Arrival, arrival_order


class Feed:
    """The shadows' input: ``arrive`` and ``complete`` as observations come, ``take`` what the
    shadows' clock has passed, ``window`` at a decision."""

    def __init__(self, config: AutopilotConfig) -> None:
        self.config = config
        self.clock: float | None = None  # the shadows' clock: replayed up to here
        self.late = 0  # requests first seen after the shadows had passed their arrival
        # Arrived, not yet handed to the shadows, in (arrival, id) order.
        self._pending: list[Arrival] = []
        self._lengths: dict[str, int] = {}  # output lengths of completed requests not yet replayed
        self._completed: deque[int] = deque(maxlen=config.history)  # completed lengths
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
            if self.shape is not None:
                self.shape.add(a.arrival, a.prompt_tokens)
            if self.clock is not None and a.arrival <= self.clock:
                self.late += 1  # the shadows are past it: replaying it would rewrite their past
                continue
            bisect.insort(self._pending, a, key=arrival_order)

    def complete(self, completions: Iterable[Completion]) -> None:
        for c in completions:
            self._lengths[c.id] = c.output_tokens
            self._completed.append(c.output_tokens)

    def _imputed(self, a: Arrival, generated: int) -> int:
        """A length for a request still in flight: the median of recently completed lengths
        above what it has generated, within its cap (never its true length: it is unknown)."""
        recent = sorted(self._completed)
        i = bisect.bisect_right(recent, generated)
        guess = recent[(i + len(recent)) // 2] if i < len(recent) else generated + 1
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
        for a in taken:
            out = self._lengths.pop(a.id, None)
            if out is None:
                out = self._imputed(a, generated.get(a.id, 0))
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
        horizon = t - self.config.window_s - self.config.settle_s
        gone = []
        while self._window and self._window[0][0] < horizon:
            gone.append(self._window.popleft()[1])
        for rid in gone:
            self._meta.pop(rid, None)
        return t, batch, gone

    def settled(self, clock: float) -> list[tuple[float, str]]:
        """The window's requests (arrival, id) that arrived ``settle_s`` or more before
        ``clock``."""
        return [(a, rid) for a, rid in self._window if a <= clock - self.config.settle_s]

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

"""A change of the traffic's shape, seen from the arrivals alone.

The autopilot judges its candidates on the requests of the last hour (``window_s``). When the
traffic changes shape — chat gives way to long prompts, long prompts to reasoning — that hour is
mostly the old traffic: each shadow's figures over it are what its setting did to requests that
no longer come, and the candidate that wins on the new shape can stay barred for most of an hour
by the tails it made on the old one (README, "The autopilot": on ``shift`` every small γ's P99
TTFT over the window was 1.6–1.8× sarathi's in the reasoning phase, from the chat and long-prompt
phases still in it; an oracle's switch to γ 0.01 up to 10 minutes after the change serves that
phase at 1.08–1.09× the best fixed setting's P95 (but 1.29× at 5 minutes, 3.34× at 13:
``benchmarks/shift_late_switch.py``), where γ 1 throughout served it at 7.6×).

``ShapeWatch`` compares the distribution of the prompt lengths (known at arrival; the output
lengths are known only after a request completes) of the last ``recent_s`` of arrivals with the
ones before them, back to the last change, by the two-sample Kolmogorov–Smirnov statistic. Over
``threshold`` the traffic changed shape; the change point is the split of the recent arrivals
that separates the two distributions best. The natural drift of the traces here stays far below
the default threshold: the largest statistic over five minutes against the hour before, on every
workload of ``benchmarks/autopilot.py`` but ``shift``, is 0.23 (Azure conv's diurnal peak); on
``shift`` 0.69. Only arrivals already seen are read: the watch sees the past only.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np
from scipy.stats import ks_2samp

MIN_RECENT = 100  # arrivals in the recent span before a change is judged
MIN_BEFORE = 300  # … and before it, since the last change
MIN_SIDE = 50  # arrivals on the new side of a candidate change point
SPLIT_STEP_S = 15.0  # the change point is searched on this grid within the recent span


class ShapeWatch:
    """Watches the prompt lengths of the arrivals for a change of shape.

    ``add`` each arrival, ``trim`` at each observation (what is older than ``keep_s`` goes, so
    the watch stays bounded while no decision is judged), ``check`` at each decision: it returns
    the change point when a new change is found; ``changes`` holds those within ``keep_s`` (and
    always the last) in time order, ``since`` the last (-inf: none yet)."""

    def __init__(self, threshold: float, recent_s: float, keep_s: float) -> None:
        self.threshold = threshold
        self.recent_s = recent_s
        self.keep_s = keep_s  # arrivals older than this before ``now`` are forgotten
        self.changes: list[float] = []
        self.statistic = 0.0  # at the last check
        # per arrival seen: its time and the log of its prompt length (two deques: an array of
        # an hour's arrivals is built from them at each check in about a millisecond)
        self._times: deque[float] = deque()
        self._prompts: deque[float] = deque()

    def __len__(self) -> int:
        """The arrivals kept: those seen since ``keep_s`` before the last ``trim`` (an arrival
        reported later than others after it goes when those before it have gone)."""
        return len(self._times)

    def add(self, arrival: float, prompt_tokens: int) -> None:
        if not math.isfinite(arrival):
            return  # never trimmed by age: it would stay for good
        self._times.append(arrival)
        self._prompts.append(math.log(max(prompt_tokens, 1)))

    def trim(self, now: float) -> None:
        """Forget the arrivals and the change points older than ``keep_s`` before ``now`` (the
        last change point stays: it is ``since``)."""
        cutoff = now - self.keep_s
        while self._times and self._times[0] < cutoff:
            self._times.popleft()
            self._prompts.popleft()
        if len(self.changes) > 1 and self.changes[0] < cutoff:
            self.changes = [c for c in self.changes[:-1] if c >= cutoff] + self.changes[-1:]

    def check(self, now: float) -> float | None:
        """The new change point if the last ``recent_s`` before ``now`` differ in shape from the
        arrivals before them (back to the last change point), else None."""
        self.trim(now)
        times = np.fromiter(self._times, float, len(self._times))
        prompts = np.fromiter(self._prompts, float, len(self._prompts))
        # A live replica reports a request when it first sees it, not always in arrival order.
        kept = (times >= max(self.since, now - self.keep_s)) & (times <= now)
        order = np.argsort(times[kept], kind="stable")
        arrivals, prompts = times[kept][order], prompts[kept][order]
        start = now - self.recent_s
        first_recent = int(np.searchsorted(arrivals, start, side="right"))
        if len(arrivals) - first_recent < MIN_RECENT or first_recent < MIN_BEFORE:
            self.statistic = 0.0
            return None
        self.statistic = float(ks_2samp(prompts[:first_recent], prompts[first_recent:]).statistic)
        if self.statistic <= self.threshold:
            return None
        # Where in the recent span it changed: the split that separates the two sides best, by
        # the statistic scaled to the sides' sizes (unscaled, a split leaving a few dozen
        # arrivals on the new side wins on noise: on ``shift`` 3.7 minutes after the change).
        best, change = -1.0, start
        for k in range(int(self.recent_s // SPLIT_STEP_S)):
            split = start + k * SPLIT_STEP_S
            at = int(np.searchsorted(arrivals, split, side="right"))
            after = len(arrivals) - at
            if after < MIN_SIDE:
                break
            scale = math.sqrt(at * after / (at + after))
            separation = scale * float(ks_2samp(prompts[:at], prompts[at:]).statistic)
            if separation > best:
                best, change = separation, split
        self.changes.append(change)
        return change

    @property
    def since(self) -> float:
        return self.changes[-1] if self.changes else -math.inf

    def start(self, arrivals: np.ndarray, min_requests: int) -> float | None:
        """Where a window of ``arrivals`` (in order) should start: at the latest change point with
        at least ``min_requests`` of them after it (a change just found is judged on the shape
        before it until the new shape has that many); None when no change qualifies."""
        for change in reversed(self.changes):
            if len(arrivals) == 0 or change <= arrivals[0]:
                return None  # this and every earlier one start at or before the window
            after = len(arrivals) - int(np.searchsorted(arrivals, change, side="left"))
            if after >= min_requests:
                return change
        return None

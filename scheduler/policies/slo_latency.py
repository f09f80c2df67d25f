"""slofq's latency reads (scheduler/policies/slo.py): a tenant's TTFT window and the quantiles
of that window together with the ages of its waiting requests, at every control tick.

The quantiles are numpy's default ("linear") percentiles, bit for bit, without building and
sorting the whole union when many requests wait: the window is kept sorted, and each waiting
group is in arrival order, so its ages are one descending run. Whether a quantile is above a
target is then a matter of counting (a binary search per run), and a high quantile's value needs
only the top of each run (tests/test_slofq_work_conserving.py checks both against the sort).
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right, insort
from collections import deque
from collections.abc import Sequence

from mypy_extensions import mypyc_attr

from scheduler.policies.base import RequestState

SAMPLES_KEPT = 4096  # TTFT samples per tenant in the sliding window (bounded memory in the engine)
# Up to this many waiting requests the union is simply sorted: counting pays off above it.
SORT_UP_TO = 64


def linear_percentile(ordered: Sequence[float], fraction: float) -> float:
    """numpy's default ("linear") percentile of a sorted non-empty sequence, bit for bit (the
    same virtual index, and numpy's ``_lerp``: interpolation from the nearer end, which keeps the
    result within [a, b])."""
    n = len(ordered)
    virtual = (n - 1) * fraction
    below = math.floor(virtual)
    lo = min(below, n - 1)
    a, b = ordered[lo], ordered[min(lo + 1, n - 1)]
    t = virtual - below
    diff = b - a
    return b - diff * (1 - t) if t >= 0.5 else a + diff * t


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
class TtftWindow:
    """A tenant's TTFTs over the sliding window: in finish order (to expire them) and sorted (to
    read quantiles without sorting at every control tick)."""

    __slots__ = ("by_finish", "ordered")

    def __init__(self) -> None:
        self.by_finish: deque[tuple[float, float]] = deque()
        self.ordered: list[float] = []

    def __len__(self) -> int:
        return len(self.by_finish)

    def add(self, finished_at: float, ttft: float) -> None:
        if len(self.by_finish) >= SAMPLES_KEPT:
            self._drop_oldest()
        self.by_finish.append((finished_at, ttft))
        insort(self.ordered, ttft)

    def _drop_oldest(self) -> None:
        _, ttft = self.by_finish.popleft()
        del self.ordered[bisect_left(self.ordered, ttft)]  # an equal value: any copy will do

    def since(self, horizon: float) -> list[float]:
        """The sorted TTFTs of requests finished after ``horizon`` (older ones are dropped)."""
        by_finish = self.by_finish
        while by_finish and by_finish[0][0] <= horizon:
            self._drop_oldest()
        return self.ordered


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
class Latencies:
    """The multiset of a sorted TTFT list and the ages ``now - arrival`` of waiting requests
    (``runs``: lists in arrival order), read as if sorted: ``value(f)`` and ``above(f, s)``."""

    __slots__ = ("_neg_age", "_sorted", "n", "now", "runs", "ttfts")

    def __init__(
        self, ttfts: list[float], runs: Sequence[Sequence[RequestState]], now: float
    ) -> None:
        self.ttfts, self.now = ttfts, now
        self.runs = [run for run in runs if run]
        waiting = sum(map(len, self.runs))
        self.n = len(ttfts) + waiting
        self._sorted: list[float] | None = None
        if not waiting:
            self._sorted = ttfts  # already sorted (read only)
        elif waiting <= SORT_UP_TO:
            merged = list(ttfts)
            for run in self.runs:
                merged += [now - r.arrival for r in run]
            merged.sort()
            self._sorted = merged
        # arrival - now is exactly -(now - arrival) (IEEE subtraction is antisymmetric) and
        # ascends along a run: the key that lets bisect count the ages above a value.
        self._neg_age = lambda r: r.arrival - now

    def value(self, fraction: float) -> float:
        """The ``fraction`` percentile (the union must not be empty)."""
        if self._sorted is not None:
            return linear_percentile(self._sorted, fraction)
        n = self.n
        virtual = (n - 1) * fraction
        below = math.floor(virtual)
        lo = min(below, n - 1)
        top = n - lo  # x[lo] and everything above it: among the top ``top`` of each part
        now = self.now
        part = self.ttfts[-top:]  # a copy
        for run in self.runs:
            part += [now - r.arrival for r in run[:top]]  # a run's oldest requests come first
        part.sort()
        tail = part[len(part) - top :]  # x[lo], x[lo + 1], ...
        a, b = tail[0], tail[min(1, len(tail) - 1)]
        t = virtual - below
        diff = b - a
        return b - diff * (1 - t) if t >= 0.5 else a + diff * t

    def above(self, fraction: float, target: float) -> bool:
        """Whether the ``fraction`` percentile is above ``target`` (the union must not be empty)."""
        if self._sorted is not None:
            return linear_percentile(self._sorted, fraction) > target
        n = self.n
        virtual = (n - 1) * fraction
        below = math.floor(virtual)
        lo = min(below, n - 1)
        hi = min(lo + 1, n - 1)
        ttfts, neg_age, now = self.ttfts, self._neg_age, self.now
        # How many values are above the target: x[first_above:] in sorted order.
        cut = bisect_right(ttfts, target)
        cuts = [bisect_left(run, -target, key=neg_age) for run in self.runs]  # ages > target first
        first_above = n - (len(ttfts) - cut) - sum(cuts)
        if lo >= first_above:
            return True  # x[lo] > target, and the interpolation never goes below x[lo]
        if hi < first_above:
            return False  # x[hi] <= target, and it never goes above x[hi]
        # x[lo] is the largest value <= target, x[hi] the smallest above it: interpolate exactly.
        a = ttfts[cut - 1] if cut else -math.inf
        b = ttfts[cut] if cut < len(ttfts) else math.inf
        for run, j in zip(self.runs, cuts):
            if j < len(run):
                a = max(a, now - run[j].arrival)
            if j:
                b = min(b, now - run[j - 1].arrival)
        t = virtual - below
        diff = b - a
        return (b - diff * (1 - t) if t >= 0.5 else a + diff * t) > target

"""A window of recent values (`RecentValues`: γ-Ada's signal, a length predictor's pool per key)
and the percentiles γ-Ada reads of its window (`linear_percentiles`).

Why not a ``deque(maxlen=...)`` and ``np.percentile``: γ-Ada reads P95 and P99 of its window
(2,000 values by default) every ``ada_interval_s``, and on a uniboost replay converting the deque
to an array and numpy's general percentile were together ~4.6% of the replay (perf, the heldout
workload): the window here is an array already, and the two percentiles are one partition and
numpy's own interpolation written out — the same floats, bit for bit (a test compares them with
``np.percentile`` on random windows). A history predictor's refit read its pools the same way
(``np.fromiter`` over each deque: 5% of a TIE replay); it reads them in order (`ordered`), so
its fits are the same floats too.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import numpy as np
from mypy_extensions import mypyc_attr


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
class RecentValues:
    """The last ``capacity`` values appended, oldest first when iterated. The storage grows by
    doubling up to ``capacity`` (a large window costs memory only once it fills), then is
    overwritten as a ring."""

    def __init__(self, capacity: int, values: Iterable[float] = ()) -> None:
        self.capacity = capacity
        self._ring = np.empty(min(capacity, 64))
        self._count = 0  # values held (<= capacity)
        self._next = 0  # where the next value goes once the ring is full
        self.extend(values)

    def append(self, value: float) -> None:
        if self.capacity <= 0:
            return
        if self._count < self.capacity:
            if self._count == len(self._ring):
                grown = np.empty(min(self.capacity, 2 * len(self._ring)))
                grown[: self._count] = self._ring
                self._ring = grown
            self._ring[self._count] = value
            self._count += 1
            return
        self._ring[self._next] = value  # full: the oldest value is overwritten
        self._next = (self._next + 1) % self.capacity

    def extend(self, values: Iterable[float]) -> None:
        for value in values:
            self.append(value)

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[float]:
        return iter(self.ordered().tolist())

    def __getitem__(self, index: int) -> float:
        if not -self._count <= index < self._count:
            raise IndexError("RecentValues index out of range")
        if index < 0:
            index += self._count
        return float(self._ring[(self._next + index) % self._count])

    def values(self) -> np.ndarray:
        """The values held, in no particular order (for order-free statistics); a view."""
        return self._ring[: self._count]

    def ordered(self) -> np.ndarray:
        """The values held, oldest first; a copy (a sum over them rounds as it would over the
        values appended in turn)."""
        if self._count < self.capacity or self._next == 0:
            return self._ring[: self._count].copy()
        return np.concatenate((self._ring[self._next :], self._ring[: self._next]))


def linear_percentiles(values: np.ndarray, percents: tuple[float, ...]) -> list[float]:
    """``np.percentile(values, percents)`` (its default, linear interpolation) for a non-empty
    1-D array, with the same arithmetic in the same order: q = p / 100, the virtual index
    (n − 1)·q, and numpy's two-sided lerp between the order statistics around it."""
    n = len(values)
    indexes: list[tuple[int, int, float]] = []
    for percent in percents:
        virtual = (n - 1) * (percent / 100.0)
        below = min(max(math.floor(virtual), 0), n - 1)
        above = min(below + 1, n - 1)
        indexes.append((below, above, virtual - below))
    ordered = np.partition(values, sorted({i for lo, hi, _ in indexes for i in (lo, hi)}))
    out: list[float] = []
    for below, above, gamma in indexes:
        a, b = float(ordered[below]), float(ordered[above])
        diff = b - a
        # numpy's _lerp: a + diff·γ, or b − diff·(1 − γ) where γ >= 0.5 (exact at γ = 1).
        out.append(b - diff * (1.0 - gamma) if gamma >= 0.5 else a + diff * gamma)
    return out

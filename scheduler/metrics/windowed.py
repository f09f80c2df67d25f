"""Exact percentiles over a sliding window of the last N values (:class:`WindowedPercentiles`):
the live collector's and γ-Ada's (P95/P99 over the last ``ada_window`` finished requests).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Sequence

import numpy as np


def _percentile_key(q: float) -> str:
    """50 → 'p50', 99.9 → 'p999' (the same spelling as summary keys)."""
    return "p" + f"{q:g}".replace(".", "")


class WindowedPercentiles:
    """The last ``capacity`` values in a numpy ring buffer, with exact percentiles.

    Used by the live collector and by γ-Ada (P95/P99 over the last ``ada_window`` finished
    requests). Non-finite values are dropped on insert. Thread-safe: the engine thread adds
    while an HTTP or TUI thread reads.
    """

    DEFAULT_QUANTILES: tuple[float, ...] = (50.0, 90.0, 95.0, 99.0)

    def __init__(self, capacity: int) -> None:
        if int(capacity) != capacity or capacity < 1:
            raise ValueError(f"capacity must be a positive integer, got {capacity!r}")
        self._buf = np.empty(int(capacity), dtype=np.float64)
        self._next = 0  # slot the next value goes to
        self._count = 0  # valid values held (≤ capacity); until full they are _buf[:_count]
        self._seen = 0  # values ever accepted (for "after ada_min_samples" rules)
        self._lock = threading.Lock()

    @property
    def capacity(self) -> int:
        return int(self._buf.shape[0])

    @property
    def total_seen(self) -> int:
        return self._seen

    def __len__(self) -> int:
        return self._count

    def add(self, value: float) -> None:
        if not math.isfinite(value):
            return
        with self._lock:
            self._buf[self._next] = value
            self._next = (self._next + 1) % self.capacity
            self._count = min(self._count + 1, self.capacity)
            self._seen += 1

    def extend(self, values: Iterable[float] | np.ndarray) -> None:
        v = np.asarray(
            values if isinstance(values, np.ndarray) else list(values), dtype=np.float64
        ).ravel()
        v = v[np.isfinite(v)]
        k, cap = v.size, self.capacity
        if k == 0:
            return
        with self._lock:
            self._seen += k
            if k >= cap:  # only the newest `cap` values survive
                self._buf[:] = v[-cap:]
                self._next, self._count = 0, cap
                return
            first = min(k, cap - self._next)  # up to the end of the buffer ...
            self._buf[self._next : self._next + first] = v[:first]
            self._buf[: k - first] = v[first:]  # ... and the rest wraps to the front
            self._next = (self._next + k) % cap
            self._count = min(self._count + k, cap)

    def clear(self) -> None:
        with self._lock:
            self._next = self._count = self._seen = 0

    def values(self) -> np.ndarray:
        """A copy of the held values, oldest first."""
        with self._lock:
            if self._count < self.capacity:
                return self._buf[: self._count].copy()
            return np.concatenate((self._buf[self._next :], self._buf[: self._next]))

    def percentiles(self, qs: Sequence[float] = DEFAULT_QUANTILES) -> dict[str, float]:
        """Exact percentiles of the held values, keyed ``p50``, ``p90`` ... (NaN when empty)."""
        keys = [_percentile_key(q) for q in qs]
        with self._lock:
            if self._count == 0:
                return {k: math.nan for k in keys}
            # Order does not matter for percentiles, so no need to unroll the ring.
            result = np.percentile(self._buf[: self._count], list(qs))
        return {k: float(v) for k, v in zip(keys, np.atleast_1d(result))}

    def percentile(self, q: float) -> float:
        return self.percentiles((q,))[_percentile_key(q)]

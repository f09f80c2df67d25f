"""Size-based baselines: sjf (LTR), srpt (TRAIL) and las (MLFQ)."""

from __future__ import annotations

import heapq
import itertools
import math

from controlplane.policies.base import INF, Policy, RequestState

# A starving sjf request jumps every queue; ties then fall back to (arrival, id).
TOP_PRIORITY = -1e18


def predicted_total(policy: Policy, req: RequestState) -> float:
    """Point prediction of the total output length, cached on the request per predictor fit."""
    version = getattr(policy.predictor, "version", 0)
    if req.cache_key != ("total", version):
        pred = policy.predictor.predict_total(req)
        req.cache_key, req.cache_value = ("total", version), (float(req.max_tokens) if pred is None else
                                                              min(float(pred), float(req.max_tokens)))
    return req.cache_value


class Sjf(Policy):
    """Predicted total output length, non-preemptive, with LTR's starvation guard: a request left
    unscheduled for ``starve_steps`` steps gets top priority for ``quantum_steps`` steps."""

    name = "sjf"
    counts_steps = True

    def score(self, req: RequestState, now: float) -> float:
        if req.quantum_left > 0 or req.unscheduled_steps >= self.params.starve_steps:
            return TOP_PRIORITY
        return predicted_total(self, req)

    def on_admit(self, req: RequestState, now: float, prefill_tokens: int) -> None:
        if req.unscheduled_steps >= self.params.starve_steps:
            req.quantum_left = self.params.quantum_steps

    def on_steps(self, scheduled, unscheduled, steps: int) -> None:
        for r in scheduled:
            r.unscheduled_steps = 0
            if r.quantum_left:
                r.quantum_left = max(0, r.quantum_left - steps)
        limit = self.params.starve_steps
        for r in unscheduled:
            before = r.unscheduled_steps
            r.unscheduled_steps += steps
            if before < limit <= r.unscheduled_steps and r.status == "waiting":
                self.moved.append(r)  # a starving request jumps the waiting queue

    def steady_steps(self, running, waiting, now, kv_blocked) -> float:
        if not (waiting and kv_blocked):
            return INF
        # A waiting request reaching its starvation limit can change the head of the queue.
        return max(1, min(self.params.starve_steps - r.unscheduled_steps for r in waiting))


class Srpt(Policy):
    """Predicted remaining output tokens, preemptive; TRAIL's limit: a running request is no longer
    preemptible once ``generated > c * predicted_total``."""

    name = "srpt"
    preemptive = True

    def score(self, req: RequestState, now: float) -> float:
        return max(predicted_total(self, req) - req.generated, 0.0)

    def policy_preemptible(self, req: RequestState) -> bool:
        return req.generated <= self.params.c * predicted_total(self, req)

    def preempt_margin(self) -> float:
        return float(self.params.margin_tokens)

    # Running scores only fall and the TRAIL limit only removes candidates, so a decode stretch
    # never creates a preemption that the step starting it did not make: the default INF holds.


class Las(Policy):
    """Least attained service as a multi-level feedback queue: level k holds requests whose
    attained service (seconds, via ``alpha_s_per_token``) lies in [q0(2^k − 1), q0(2^{k+1} − 1));
    a request waiting longer than ``starve_s`` is promoted back to level 0."""

    name = "las"
    preemptive = True
    incremental_running_order = True  # levels change only at thresholds: most keys hold

    def __init__(self, settings, predictor=None) -> None:
        super().__init__(settings, predictor)
        self._starve_at: list = []  # heap of (time the request starves, seq, request)
        self._seq = itertools.count()

    def _watch(self, req: RequestState) -> None:
        heapq.heappush(self._starve_at, (req.enqueued_at + self.params.starve_s, next(self._seq), req))

    def on_arrival(self, req, now) -> None:
        self._watch(req)

    def on_preempt(self, req, now, by_policy) -> None:
        self._watch(req)

    def attach(self, waiting, running, now) -> None:
        for r in waiting:
            self._watch(r)

    def before_step(self, waiting, now) -> None:
        super().before_step(waiting, now)
        heap = self._starve_at
        while heap and heap[0][0] <= now:
            t, _, req = heapq.heappop(heap)
            # Entries of admitted requests go stale; only a request still waiting since then counts.
            if req.status == "waiting" and req.enqueued_at + self.params.starve_s == t and req.attained > req.las_base:
                req.las_base = req.attained  # promotion back to level 0
                req.score_epoch = -1  # drop the cached level
                self.moved.append(req)

    def level(self, req: RequestState) -> int:
        service_s = (req.attained - req.las_base) * self.params.alpha_s_per_token
        return int(math.floor(math.log2(service_s / self.params.q0_s + 1.0)))

    def key(self, req: RequestState, now: float) -> tuple:
        key = self.cached_key(req)
        if key is None:
            level = self.level(req)
            # The level holds until attained service reaches the next level's threshold.
            next_s = self.params.q0_s * (2.0 ** (level + 1) - 1.0)
            key = self.cache_key(req, float(level), req.las_base + math.floor(next_s / self.params.alpha_s_per_token))
        return key

    def score(self, req: RequestState, now: float) -> float:
        return self.key(req, now)[0]

    def _tokens_to_next_level(self, req: RequestState) -> int:
        k = self.level(req)
        next_s = self.params.q0_s * (2.0 ** (k + 1) - 1.0)
        tokens = next_s / self.params.alpha_s_per_token + req.las_base
        return max(1, math.ceil(tokens) - req.attained)

    def next_time_event(self, waiting, now) -> float:
        return self._starve_at[0][0] if self._starve_at else INF

    def steady_steps(self, running, waiting, now, kv_blocked) -> float:
        if not waiting:
            return INF
        # Levels change only at thresholds; stop one step short of the nearest crossing.
        return max(1, min(self._tokens_to_next_level(r) for r in running) - 1)

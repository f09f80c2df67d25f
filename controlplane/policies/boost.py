"""γ-Boost policies (UNIBOOST, seed 000): distboost (stage 1) and uniboost (stages 2–4).

score = arrival − b_γ(w̃): a request is served as if it had arrived earlier by its boost, and short
work gets the larger boost. γ → ∞ gives FCFS; γ → 0 gives size order.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np

from controlplane.policies.base import (INF, Policy, RequestState, boost, new_epoch, next_threshold,
                                       quantize)


class DistBoost(Policy):
    """Stage 1: decodes go first (in arrival order); prefills, running or waiting, are ordered by
    γ-Boost on their prompt work. Non-preemptive."""

    name = "distboost"

    def score(self, req: RequestState, now: float) -> float:
        work = self.params.alpha_s_per_token * req.prompt_tokens
        return req.arrival - boost(work, self.params.gamma)

    def order_running(self, running, now):
        return sorted(running, key=lambda r: (0, r.arrival, r.id) if r.generated > 0
                      else (1, *self.key(r, now)))


class UniBoost(Policy):
    """One priority space for prefill and decode, score = arrival − b_γ(w̃) with
    w̃ = alpha · max(attained, prompt) (stage 2); MemGuard quantizes attained work and guards
    admitted requests until their next threshold (stage 3); γ-Ada steers γ from the observed
    P99/P95 ratio of end-to-end latency (stage 4)."""

    name = "uniboost"
    preemptive = True

    def __init__(self, settings, predictor=None) -> None:
        super().__init__(settings, predictor)
        p = self.params
        self.gamma = p.gamma
        self.epoch = new_epoch()  # scores cached on requests are valid for this γ only
        self.ada_enabled = p.gamma_ada and not settings.is_pinned("gamma")
        self.recent_ttlt: deque[float] = deque(maxlen=p.ada_window)
        self._next_tick = p.ada_interval_s if self.ada_enabled else INF
        self.gamma_updates = 0

    # --- score ---------------------------------------------------------------------------
    def work_tokens(self, req: RequestState) -> float:
        p = self.params
        attained = quantize(req.attained, p.quant_base_tokens, p.quant_ratio) if p.memguard else req.attained
        return max(attained, req.prompt_tokens)

    def key(self, req: RequestState, now: float) -> tuple:
        key = self.cached_key(req)
        if key is None:
            p = self.params
            value = req.arrival - boost(p.alpha_s_per_token * self.work_tokens(req), self.gamma)
            # Under MemGuard the score holds until attained work crosses the next threshold.
            until = (next_threshold(req.attained, p.quant_base_tokens, p.quant_ratio) if p.memguard
                     else req.attained + 1)
            key = self.cache_key(req, value, until)
        return key

    def score(self, req: RequestState, now: float) -> float:
        return self.key(req, now)[0]

    # --- MemGuard ------------------------------------------------------------------------
    def on_admit(self, req: RequestState, now: float, prefill_tokens: int) -> None:
        p = self.params
        req.guard_tokens = next_threshold(req.attained, p.quant_base_tokens, p.quant_ratio) if p.memguard else 0

    def policy_preemptible(self, req: RequestState) -> bool:
        return req.attained >= req.guard_tokens

    def order_running(self, running, now):
        # The memory-pressure victim is the last running request (vLLM pops running[-1]), and
        # MemGuard wants it to be the worst request outside its guard, falling back to the worst
        # guarded one: so guarded requests come first, each group in key order.
        if not self.params.memguard:
            return super().order_running(running, now)
        return sorted(running, key=lambda r: (r.attained >= r.guard_tokens, self.key(r, now)))

    # --- γ-Ada ---------------------------------------------------------------------------
    def on_finish(self, req: RequestState, now: float) -> None:
        if self.ada_enabled:
            self.recent_ttlt.append(now - req.arrival)

    def next_tick(self) -> float:
        return self._next_tick

    def tick(self, now: float) -> None:
        p = self.params
        self._next_tick = now + p.ada_interval_s
        if not self.ada_enabled or len(self.recent_ttlt) < p.ada_min_samples:
            return
        t95, t99 = np.percentile(np.fromiter(self.recent_ttlt, float), [95.0, 99.0])
        tail_ratio = t99 / t95 if t95 > 0 else 1.0
        target = p.gamma_max / (1.0 + p.ada_kappa * max(tail_ratio - 1.0, 0.0))
        gamma = (1.0 - p.ada_ema) * self.gamma + p.ada_ema * target
        self.gamma = min(p.gamma_max, max(p.gamma_min, gamma))
        self.epoch = new_epoch()
        self.gamma_updates += 1

    # --- event skipping ------------------------------------------------------------------
    def steady_steps(self, running, waiting, now, kv_blocked) -> float:
        if not waiting:
            return INF
        p = self.params
        if p.memguard:
            # Scores and guards change only when attained work crosses a threshold.
            return max(1, min(next_threshold(r.attained, p.quant_base_tokens, p.quant_ratio) - r.attained
                              for r in running))
        # Without MemGuard a running score rises continuously; find when the worst one would pass
        # the best waiting score. b_γ is its own inverse, so the crossing is closed-form.
        best = self.score(waiting[0], now) + self.preempt_margin()  # waiting is in key order
        steps = INF
        for r in running:
            gap = r.arrival - best  # preempt once b_γ(w̃_r) < gap
            if gap <= 0:
                continue
            need_tokens = boost(gap, self.gamma) / p.alpha_s_per_token
            steps = min(steps, max(1, math.floor(need_tokens) - r.attained - 1))
        return steps

    # --- live state ----------------------------------------------------------------------
    def live_state(self) -> dict:
        return {"gamma": self.gamma, "gamma_pinned": self.settings.is_pinned("gamma")}

    def adopt_live_state(self, previous: Policy) -> None:
        # Keep the adapted γ across a switch unless the new document pins or sets it explicitly.
        if isinstance(previous, UniBoost) and self.ada_enabled and previous.params.gamma == self.params.gamma:
            self.gamma = previous.gamma
            self.epoch = new_epoch()
            self.recent_ttlt = deque(previous.recent_ttlt, maxlen=self.params.ada_window)

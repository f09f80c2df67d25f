"""TIE (seed 001/002): rank by a tail-inflated expectation of the output length.

score = (E[X̃] + β·CVaR_α[X̃]) · decay^{t_wait/τ} with X̃ the log-t length distribution truncated at
max_tokens (quadrature in ``tie_math``); β adapts to the queue unless pinned. Non-preemptive.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from mypy_extensions import mypyc_attr

from scheduler.policies.base import Key, OrderedWaiting, Policy, RequestState, new_epoch
from scheduler.policies.predictors import LengthPredictor
from scheduler.policies.tie_math import adaptive_beta, tie_moments
from scheduler.settings import Settings, TieParams

# Requests that share a predictor key share (μ, σ) and mostly max_tokens: one quadrature each.
_moments = lru_cache(maxsize=4096)(tie_moments)


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
class Tie(Policy):
    name = "tie"
    params: TieParams
    keys_by_prediction = True
    incremental_running_order = True  # keys hold for an epoch (β, the predictor's fit)

    def __init__(self, settings: Settings, predictor: LengthPredictor | None = None) -> None:
        super().__init__(settings, predictor)
        self.beta_pinned = settings.is_pinned("beta")
        self.beta = self.params.beta
        self._t_ref: float | None = None  # arrivals are taken relative to the first one seen

    def moments(self, req: RequestState) -> tuple[float, float] | None:
        """(E, CVaR) of the request's truncated length, cached until the predictor refits."""
        version = getattr(self.predictor, "version", 0)
        key = ("tie", version, self.params.alpha, self.params.nu)
        if req.cache_key != key:
            dist = self.predictor.predict_dist(req) if self.predictor is not None else None
            value = None
            if dist is not None:
                mu, sigma = dist
                value = _moments(
                    mu, sigma, float(req.max_tokens), self.params.alpha, self.params.nu
                )
            req.cache_key, req.cache_value = key, value
        moments: tuple[float, float] | None = req.cache_value  # set under this key
        return moments

    def base_score(self, req: RequestState) -> float:
        m = self.moments(req)
        if m is None:
            return float(req.max_tokens)  # no prediction yet (docs/policies.md#tie)
        return m[0] + self.beta * m[1]

    def score(self, req: RequestState, now: float) -> float:
        t_wait = max(0.0, now - req.arrival)
        decayed: float = self.params.decay ** (t_wait / self.params.tau_s)  # decay > 0: a float
        return self.base_score(req) * decayed

    def key(self, req: RequestState, now: float) -> Key:
        # ln(score') = ln(E + β·CVaR) + (now − arrival)·ln(decay)/τ. The term in ``now`` is the same
        # for every request at a given instant, so dropping it keeps the order at every instant and
        # leaves a key that is constant within an epoch (β, the predictor's fit): cached, not
        # recomputed for every running request every step.
        key = self.cached_key(req)
        if key is None:
            if self._t_ref is None:
                self._t_ref = req.arrival
            p = self.params
            value = (
                math.log(max(self.base_score(req), 1e-300))
                - math.log(p.decay) * (req.arrival - self._t_ref) / p.tau_s
            )
            key = self.cache_key(req, value, 1 << 62)
        return key

    def before_step(self, waiting: Sequence[RequestState] | OrderedWaiting, now: float) -> None:
        super().before_step(waiting, now)
        if not self.beta_pinned:
            p = self.params
            beta = adaptive_beta(len(waiting), self.view.max_num_seqs, p.beta_min, p.beta_max)
            if beta != self.beta:
                self.beta = beta
                self.epoch = new_epoch()

    # The wait decay multiplies every score by the same factor per unit time, so the waiting order
    # never changes by itself during a decode stretch: the default steady_steps (INF) holds.

    def live_state(self) -> dict[str, Any]:
        return {"beta": self.beta, "beta_pinned": self.beta_pinned}

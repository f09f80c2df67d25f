"""The policy library (docs/policies.md): one implementation of each policy, used by the simulator
and the vLLM plugin alike. No vLLM import anywhere in this package."""

from __future__ import annotations

from scheduler.policies.base import (
    EngineView,
    Policy,
    PreemptivePolicy,
    RequestState,
    boost,
    quantize,
)
from scheduler.policies.basic import Fcfs, Sarathi, Vtc
from scheduler.policies.boost import DistBoost, UniBoost
from scheduler.policies.predictors import LengthPredictor, make_predictor
from scheduler.policies.size import Las, Sjf, Srpt
from scheduler.policies.slo import SloFq
from scheduler.policies.tie import Tie
from scheduler.settings import Settings

POLICY_CLASSES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (Fcfs, Sarathi, Sjf, Srpt, Las, DistBoost, UniBoost, Tie, Vtc, SloFq)
}


def make_policy(settings: Settings, predictor: LengthPredictor | None = None) -> Policy:
    """Instantiate the policy a settings document names.

    Policies that rank by predicted length (sjf, srpt, tie) need a predictor; when none is given
    one is built from the document's ``predictor`` parameter.
    """
    cls = POLICY_CLASSES[settings.policy]
    if predictor is None and hasattr(settings.params, "predictor"):
        p = settings.params
        kwargs: dict[str, float] = {}
        if p.predictor == "oracle":  # drawn with TIE's ν, so its distributions are TIE's own
            kwargs = {
                "sigma_noise": p.sigma_noise,
                "sigma_spread": p.sigma_spread,
                "nu": getattr(p, "nu", 3.5),
            }
        predictor = make_predictor(settings.params.predictor, **kwargs)
    return cls(settings, predictor)


__all__ = [
    "POLICY_CLASSES",
    "EngineView",
    "Policy",
    "PreemptivePolicy",
    "RequestState",
    "Settings",
    "boost",
    "make_policy",
    "quantize",
]

"""``ada_scale`` multiplies γ-Ada's target γ (docs/policies.md#γ-ada), within the clamps, and the
settings model refuses a scale outside its safe bounds."""

from __future__ import annotations

import math

import numpy as np
import pytest
from pydantic import ValidationError

from scheduler.policies import RequestState, make_policy
from scheduler.settings import GAMMA_USEFUL_MIN, Settings


def _uniboost(**params):
    # Fed finished requests' latencies (ada_signal "ttlt"): the same samples reach every policy.
    # ada_ema 1 makes γ the clamped target itself, and the floor at the useful minimum (below the
    # default GAMMA_ADA_FLOOR) keeps the small scales' targets unclamped: the scale shows undiluted.
    doc = {
        "gamma_min": GAMMA_USEFUL_MIN,
        "ada_signal": "ttlt",
        "ada_min_samples": 10,
        "ada_window": 5_000,
        "ada_ema": 1.0,
        **params,
    }
    return make_policy(Settings.model_validate({"policy": "uniboost", "params": doc}))


def _feed(policy, ttlts) -> None:
    for i, t in enumerate(ttlts):
        policy.on_finish(
            RequestState(id=f"x{i}", arrival=0.0, prompt_tokens=10, max_tokens=10), float(t)
        )


TAIL = np.random.default_rng(7).exponential(1 / 0.2, 5_000)  # decay rate 0.2 /s


@pytest.mark.parametrize("scale", [0.3, 0.1, 0.03, 2.5])
def test_scaled_gamma_is_scale_times_the_unscaled_one(scale):
    plain, scaled = _uniboost(gamma=1.0), _uniboost(gamma=1.0, ada_scale=scale)
    for p in (plain, scaled):
        _feed(p, TAIL)
        p.tick(10.0)
    t95, t99 = np.percentile(TAIL, [95.0, 99.0])
    assert plain.gamma == pytest.approx(math.log(5) / (t99 - t95))
    assert scaled.gamma == pytest.approx(scale * plain.gamma, rel=1e-12)
    assert plain.gamma != pytest.approx(scaled.gamma)


def test_scaled_gamma_is_smoothed_like_the_unscaled_target():
    # With EMA 0.5 the scaled policy moves half-way from its γ to scale × the fitted slope.
    p = _uniboost(gamma=1.0, ada_ema=0.5, ada_scale=0.1)
    _feed(p, TAIL)
    p.tick(10.0)
    t95, t99 = np.percentile(TAIL, [95.0, 99.0])
    assert p.gamma == pytest.approx(0.5 * 1.0 + 0.5 * 0.1 * math.log(5) / (t99 - t95))


def test_scaled_gamma_stays_within_the_clamps():
    slope = _uniboost(gamma=1.0)
    _feed(slope, TAIL)
    slope.tick(10.0)
    low = _uniboost(gamma=1.0, ada_scale=1e-6, gamma_min=0.004)  # scale × slope far below gamma_min
    high = _uniboost(gamma=1.0, ada_scale=1e6, gamma_max=3.0)  # far above gamma_max
    flat = _uniboost(
        gamma=1.0, ada_scale=0.01, gamma_max=7.0
    )  # no spread: the fastest decay allowed
    for p, tail in ((low, TAIL), (high, TAIL), (flat, [2.0] * 100)):
        _feed(p, tail)
        p.tick(10.0)
    assert 1e-6 * slope.gamma < 0.004 and 1e6 * slope.gamma > 3.0  # the clamps do bind
    assert (low.gamma, high.gamma, flat.gamma) == (0.004, 3.0, 7.0)


def test_default_scale_changes_nothing():
    default, explicit = _uniboost(gamma=1.0), _uniboost(gamma=1.0, ada_scale=1.0)
    for p in (default, explicit):
        _feed(p, TAIL)
        p.tick(10.0)
    assert Settings.model_validate({"policy": "uniboost"}).params.ada_scale == 1.0
    assert default.gamma == explicit.gamma


@pytest.mark.parametrize("bad", [0.0, -1.0, 5e-7, 2e6, math.inf, math.nan, "0.3", True])
def test_settings_refuse_an_out_of_range_scale_naming_the_field(bad):
    with pytest.raises(ValidationError) as err:
        Settings.model_validate({"policy": "uniboost", "params": {"ada_scale": bad}})
    assert "params.ada_scale" in str(err.value)


@pytest.mark.parametrize("edge", [1e-6, 1e6])
def test_settings_accept_the_bounds(edge):
    assert (
        Settings.model_validate(
            {"policy": "uniboost", "params": {"ada_scale": edge}}
        ).params.ada_scale
        == edge
    )

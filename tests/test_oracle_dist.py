"""The simulator's distributional oracle: calibrated per-request log-t predictions
(docs/policies.md#tie).

Each request gets ``sigma_i = sigma_noise * exp(sigma_spread * z_i - sigma_spread**2 / 2)`` and
``mu_i = ln(true_i) - sigma_i * t_i`` (``z_i`` normal, ``t_i`` Student-t(nu), both functions of
``(seed, id)``), so the true length is a draw from the predicted distribution and TIE's CVaR term
has per-request uncertainty to rank on.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from scipy import optimize, stats

from scheduler.policies import RequestState, make_policy
from scheduler.policies.predictors import SIGMA_FLOOR, OraclePredictor
from scheduler.policies.tie_math import tie_moments
from scheduler.settings import Settings
from sim.engine import EngineConfig, simulate
from sim.stepmodel import StepTimeModel
from sim.traces import TraceRequest


def req(i, output_tokens, max_tokens=10**6):
    return SimpleNamespace(
        id=f"r{i}",
        tenant="default",
        type="chat",
        prompt_tokens=100,
        max_tokens=max_tokens,
        output_tokens=output_tokens,
        generated=0,
    )


def true_lengths(n, seed=0):
    """Integer true lengths spread log-uniformly over 5 .. 5000 tokens."""
    return np.round(
        np.exp(np.random.default_rng(seed).uniform(math.log(5), math.log(5000), n))
    ).astype(int)


def predictions(p, rs):
    mu, sigma = np.array([p.predict_dist(r) for r in rs]).T
    return mu, sigma


# ----------------------------------------------------------------------------- 1. calibration


def test_oracle_is_calibrated_pit_uniform_and_90pct_coverage():
    p = OraclePredictor(sigma_noise=0.6, sigma_spread=0.5, seed=5)
    n = 4000
    lengths = true_lengths(n, seed=1)
    rs = [req(i, int(x)) for i, x in enumerate(lengths)]
    mu, sigma = predictions(p, rs)
    resid = (np.log(lengths) - mu) / sigma  # should be Student-t(nu) draws

    pit = stats.t.cdf(resid, p.nu)
    assert stats.kstest(pit, "uniform").pvalue > 0.01
    q = stats.t.ppf(0.95, p.nu)  # the predicted central 90% interval exp(mu ± q sigma)
    coverage = np.mean(np.abs(resid) <= q)
    assert coverage == pytest.approx(0.90, abs=0.015)
    # The test has power: a predictor reporting 20% too small a sigma is caught by both checks.
    narrow = resid / 0.8
    assert stats.kstest(stats.t.cdf(narrow, p.nu), "uniform").pvalue < 1e-3
    assert np.mean(np.abs(narrow) <= q) < 0.86
    # sigma_i and t_i are independent draws (not one uniform used twice).
    assert abs(np.corrcoef(np.log(sigma), resid)[0, 1]) < 0.05
    assert abs(stats.spearmanr(np.log(sigma), np.abs(resid)).statistic) < 0.05


# ----------------------------------------------------------------------------- 2. spread


def test_sigma_spread_zero_gives_one_sigma_for_all():
    p = OraclePredictor(sigma_noise=0.7, sigma_spread=0.0, seed=2)
    _, sigma = predictions(p, [req(i, 100 + i) for i in range(500)])
    assert set(sigma.tolist()) == {0.7}


@pytest.mark.parametrize("sigma_noise, spread", [(0.6, 0.5), (1.0, 0.25)])
def test_sigma_spread_sets_the_log_std_and_keeps_the_mean(sigma_noise, spread):
    p = OraclePredictor(sigma_noise=sigma_noise, sigma_spread=spread, seed=3)
    rs = [req(i, 300) for i in range(4000)]
    _, sigma = predictions(p, rs)
    assert np.all(sigma > SIGMA_FLOOR)  # (the floor is not what spreads them here)
    assert np.log(sigma).std() == pytest.approx(spread, rel=0.05)
    assert sigma.mean() == pytest.approx(sigma_noise, rel=0.03)  # the mean sigma is sigma_noise
    assert stats.normaltest(np.log(sigma)).pvalue > 1e-3  # log-normal across requests
    assert [p.sigma_for(r.id) for r in rs[:50]] == sigma[:50].tolist()


# ----------------------------------------------------------------------------- 3. determinism


def test_predictions_depend_on_seed_and_id_only_not_call_order():
    rs = [req(i, 50 + 7 * i) for i in range(300)]
    a = OraclePredictor(sigma_noise=0.8, sigma_spread=0.6, seed=9)
    forward = [a.predict_dist(r) for r in rs]
    b = OraclePredictor(sigma_noise=0.8, sigma_spread=0.6, seed=9)
    order = np.random.default_rng(0).permutation(len(rs))
    shuffled = {}
    for k in order:  # another instance, other order, other calls in between
        b.predict_total(rs[(k * 7) % len(rs)])
        shuffled[k] = b.predict_dist(rs[k])
    assert [shuffled[k] for k in range(len(rs))] == forward
    assert [a.predict_dist(r) for r in reversed(rs)] == forward[::-1]  # asked again
    # the draw belongs to the id: another true length moves mu by exactly the log ratio
    mu0, s0 = a.predict_dist(rs[0])
    mu1, s1 = a.predict_dist(req(0, rs[0].output_tokens * 4))
    assert s1 == s0 and mu1 - mu0 == pytest.approx(math.log(4), abs=1e-12)
    # another seed: other draws for every request
    other = [
        OraclePredictor(sigma_noise=0.8, sigma_spread=0.6, seed=10).predict_dist(r) for r in rs
    ]
    assert all(x[0] != y[0] and x[1] != y[1] for x, y in zip(forward, other))
    assert len({s for _, s in forward}) == len(rs)  # different ids, different sigma


def test_predictions_are_the_same_in_another_process():
    code = (
        "import json; from types import SimpleNamespace as N\n"
        "from scheduler.policies.predictors import OraclePredictor\n"
        "p = OraclePredictor(sigma_noise=0.8, sigma_spread=0.6, seed=4)\n"
        "print(json.dumps([p.predict_dist(N(id=f'x{i}', output_tokens=100 + i, max_tokens=10**6))"
        " for i in range(20)]))\n"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    p = OraclePredictor(sigma_noise=0.8, sigma_spread=0.6, seed=4)
    here = [
        list(p.predict_dist(SimpleNamespace(id=f"x{i}", output_tokens=100 + i, max_tokens=10**6)))
        for i in range(20)
    ]
    assert json.loads(out.stdout) == here


# ----------------------------------------------------------------------------- 4. TIE's CVaR acts


def tie_settings(beta, **params):
    return Settings.model_validate(
        {
            "policy": "tie",
            "pinned": ["beta"],
            "params": {"predictor": "oracle", "beta": beta, "decay": 1.0, **params},
        }
    )


def test_tie_cvar_reorders_two_requests_with_the_same_mean():
    params = {"sigma_noise": 0.8, "sigma_spread": 0.6}
    greedy, cautious = (
        make_policy(tie_settings(0.0, **params)),
        make_policy(tie_settings(0.5, **params)),
    )
    oracle = greedy.predictor
    assert isinstance(oracle, OraclePredictor) and oracle.sigma_spread == 0.6
    max_tokens, alpha, nu = 4096, greedy.params.alpha, greedy.params.nu
    sig = {f"r{i}": oracle.sigma_for(f"r{i}") for i in range(500)}
    wide_id = min(sig, key=lambda k: abs(sig[k] - 1.6))  # a wide and a narrow prediction
    narrow_id = min(sig, key=lambda k: abs(sig[k] - 0.4))
    assert sig[wide_id] > 3 * sig[narrow_id]

    def state(rid, out):
        # What the oracle reads of a request (``PredictedRequest``), with a real-valued true
        # length: brentq searches it continuously, and a RequestState holds whole tokens.
        return SimpleNamespace(
            id=rid, arrival=0.0, prompt_tokens=10, max_tokens=max_tokens, output_tokens=out
        )

    def moments(rid, out):
        mu, sigma = oracle.predict_dist(state(rid, out))
        return tie_moments(mu, sigma, float(max_tokens), alpha, nu)

    wide_out = 30
    e_wide, cvar_wide = moments(wide_id, wide_out)
    # The narrow request's true length such that its E[X~] equals the wide one's (then rounded up
    # to whole tokens: E a hair above, so β = 0 puts the wide one first).
    x = math.exp(
        optimize.brentq(
            lambda lx: moments(narrow_id, math.exp(lx))[0] - e_wide, 0.0, math.log(max_tokens)
        )
    )
    narrow_out = math.ceil(x)
    e_narrow, cvar_narrow = moments(narrow_id, narrow_out)
    assert e_wide < e_narrow and e_wide == pytest.approx(e_narrow, rel=5e-3)
    assert cvar_wide > 1.5 * cvar_narrow  # same mean, much heavier tail

    def request(rid, out):
        return RequestState(
            id=rid, arrival=0.0, prompt_tokens=10, max_tokens=max_tokens, output_tokens=out
        )

    def first(policy):
        waiting = [request(narrow_id, narrow_out), request(wide_id, wide_out)]
        return sorted(waiting, key=policy.sort_key(0.0))[0].id

    assert first(greedy) == wide_id  # β = 0: by the mean alone
    assert first(cautious) == narrow_id  # β = 0.5: the tail penalty flips them


# One second per step whatever the batch; a small batch so a queue forms and its order matters.
UNIT = EngineConfig(
    num_gpu_blocks=10_000,
    block_size=16,
    step_model=StepTimeModel(a=1.0, b=0.0, c=0.0, d=0.0, e=0.0, name="unit", source="test"),
)


def synthetic_trace(n=200):
    rng = np.random.default_rng(17)
    out = np.clip(np.round(np.exp(rng.normal(3.5, 1.0, n))), 1, 1000).astype(int)
    return [
        TraceRequest(
            id=f"q{i:03d}",
            arrival=0.2 * i,
            prompt_tokens=int(rng.integers(10, 200)),
            output_tokens=int(o),
            max_tokens=1024,
        )
        for i, o in enumerate(out)
    ]


def completion_order(beta, **params):
    s = tie_settings(beta, **params)
    s = Settings.model_validate({**s.model_dump(), "engine": {"max_num_seqs": 2}})
    res = simulate(synthetic_trace(), s, UNIT)
    return [c.id for c in sorted(res.completions, key=lambda c: (c.finished_at, c.id))]


def test_tie_beta_changes_the_simulated_schedule_only_with_sigma_spread():
    # A common sigma: E[X~] and CVaR both grow with mu alone, so every β gives one order (as the
    # constant-sigma oracle always did). Per-request sigma: the tail term reorders the queue.
    same = {"sigma_noise": 0.8, "sigma_spread": 0.0}
    assert completion_order(0.0, **same) == completion_order(0.5, **same)
    spread = {"sigma_noise": 0.8, "sigma_spread": 0.6}
    a, b = completion_order(0.0, **spread), completion_order(0.5, **spread)
    assert sorted(a) == sorted(b) and len(a) == 200
    assert a != b
    assert sum(x != y for x, y in zip(a, b)) >= 10


# ----------------------------------------------------------------------------- 5. perfect oracle


@pytest.mark.parametrize("spread", [0.0, 0.7])
def test_sigma_noise_zero_is_the_perfect_oracle(spread):
    p = OraclePredictor(sigma_noise=0.0, sigma_spread=spread, seed=8)
    for i, n in enumerate([0, 1, 7, 128, 4000, 9999]):
        r = req(i, n, max_tokens=5000)
        capped = min(n, 5000)
        assert p.predict_total(r) == capped
        assert p.predict_dist(r) == (math.log(max(capped, 1)), SIGMA_FLOOR)
    assert p.sigma_for("r0") == 0.0

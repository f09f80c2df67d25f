"""TIE quadrature (docs/policies.md#tie): accuracy against scipy.integrate.quad and the score
helpers."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import integrate, special

from scheduler.policies.tie_math import (
    adaptive_beta,
    tie_moments,
    tie_moments_many,
    tie_score,
    wait_decay,
)

NU = 3.5
# Breakpoints handed to quad (it cannot know where the quantile function turns steep).
_QUAD_POINTS = sorted(
    [10.0**-k for k in range(1, 11)] + [0.5] + [1.0 - 10.0**-k for k in range(1, 13)]
)


def _quad(f, lo: float, hi: float) -> float:
    pts = [p for p in _QUAD_POINTS if lo < p < hi]
    return integrate.quad(f, lo, hi, points=pts or None, limit=500, epsabs=0.0, epsrel=1e-11)[0]


def reference(
    mu: float, sigma: float, x_max: float, alpha: float, nu: float = NU
) -> tuple[float, float]:
    """docs/policies.md#tie formulas, integrated over u with scipy.integrate.quad."""
    z_c = (math.log(x_max) - mu) / sigma
    sf_c = float(special.stdtr(nu, -z_c))
    u_c = 1.0 - sf_c

    def q(u: float) -> float:
        return math.exp(mu + sigma * special.stdtrit(nu, u))

    e = _quad(q, 0.0, u_c) + x_max * sf_c
    cvar = (_quad(q, alpha, u_c) + x_max * sf_c) / (1.0 - alpha) if u_c > alpha else x_max
    return e, cvar


MUS = np.linspace(0.0, 9.0, 7)
SIGMAS = [0.05, 0.2, 0.5, 1.0, 2.0, 3.0]


@pytest.mark.parametrize("x_max", [16, 256, 4096, 32768])
@pytest.mark.parametrize("alpha", [0.5, 0.9, 0.99])
def test_matches_scipy_quad_over_grid(x_max, alpha):
    worst = (0.0, None)
    for mu in MUS:
        for sigma in SIGMAS:
            e, cvar = tie_moments(mu, sigma, x_max, alpha)
            e_ref, c_ref = reference(mu, sigma, x_max, alpha)
            err = max(abs(e / e_ref - 1.0), abs(cvar / c_ref - 1.0))
            if err > worst[0]:
                worst = (err, (mu, sigma, e, e_ref, cvar, c_ref))
    assert worst[0] <= 1e-3, worst


def test_accuracy_other_nu_and_extremes():
    # tiny sigma (open segment beyond u = 1 - 1e-16), x_max = 1, heavier / lighter tails
    for nu, mu, sigma, x_max, alpha in [
        (1.0, 2.0, 0.5, 4096, 0.9),
        (2.0, 4.0, 1.5, 1024, 0.99),
        (10.0, 6.0, 0.3, 32768, 0.5),
        (3.5, 3.0, 1e-4, 1e6, 0.9),
        (3.5, 0.0, 1.0, 1.0, 0.9),
        (3.5, 9.0, 0.05, 16, 0.9),
    ]:
        e, cvar = tie_moments(mu, sigma, x_max, alpha, nu)
        e_ref, c_ref = reference(mu, sigma, x_max, alpha, nu)
        assert e == pytest.approx(e_ref, rel=1e-3), (nu, mu, sigma, x_max, alpha)
        assert cvar == pytest.approx(c_ref, rel=1e-3), (nu, mu, sigma, x_max, alpha)


def test_point_mass_limit():
    # sigma -> 0: X~ is (almost) the constant min(e^mu, x_max)
    e, cvar = tie_moments(3.0, 1e-4, 4096, 0.9)
    assert e == pytest.approx(math.exp(3.0), rel=1e-3)
    assert cvar == pytest.approx(math.exp(3.0), rel=1e-2)
    e, cvar = tie_moments(9.0, 1e-4, 256, 0.9)
    assert e == pytest.approx(256.0, rel=1e-9) and cvar == 256.0


@settings(max_examples=300, deadline=None)
@given(
    mu=st.floats(-2.0, 12.0),
    sigma=st.floats(0.01, 4.0),
    x_max=st.floats(1.0, 1e6),
    alpha=st.floats(0.01, 0.999),
    nu=st.sampled_from([1.5, 3.5, 8.0]),
)
def test_e_le_cvar_le_xmax(mu, sigma, x_max, alpha, nu):
    e, cvar = tie_moments(mu, sigma, x_max, alpha, nu)
    assert e > 0.0
    assert e <= cvar * (1 + 1e-9)
    assert cvar <= x_max * (1 + 1e-9)
    assert e <= x_max * (1 + 1e-9)


@pytest.mark.parametrize("sigma", [0.05, 0.5, 2.0])
@pytest.mark.parametrize("x_max", [256, 32768])
def test_monotone_in_mu(sigma, x_max):
    mus = np.linspace(-1.0, 12.0, 200)
    es, cs = tie_moments_many(mus, sigma, x_max, 0.9)
    assert np.all(np.diff(es) >= -1e-9 * es[1:])
    assert np.all(np.diff(cs) >= -1e-9 * cs[1:])
    assert es[-1] > es[0]  # and it actually moves


def test_cvar_is_xmax_iff_uc_le_alpha():
    sigma, x_max = 0.8, 256.0
    for alpha in (0.5, 0.9, 0.99):
        t_a = float(special.stdtrit(NU, alpha))
        # u_c == alpha exactly when mu = ln x_max - sigma * t_alpha; step either side
        mu_edge = math.log(x_max) - sigma * t_a
        _, c_le = tie_moments(mu_edge + 0.01, sigma, x_max, alpha)  # u_c < alpha
        _, c_gt = tie_moments(mu_edge - 0.05, sigma, x_max, alpha)  # u_c > alpha
        assert c_le == x_max
        assert c_gt < x_max


def test_adaptive_beta_rule_and_clamps():
    assert adaptive_beta(0, 256, 0.1, 0.5) == 0.1  # clamp low
    assert adaptive_beta(10_000, 256, 0.1, 0.5) == 0.5  # clamp high
    assert adaptive_beta(768, 256, 0.1, 0.5) == pytest.approx(0.3)  # 0.1 * 768 / 256
    assert adaptive_beta(300, 100, 0.0, 1.0) == pytest.approx(0.3)
    assert adaptive_beta(100, 100, 0.2, 0.5) == pytest.approx(0.2)  # 0.1 clamped up to beta_min
    assert adaptive_beta(0, 8, 0.6, 0.4) == 0.4  # literal rule: the beta_max bound is applied last
    with pytest.raises(ValueError, match="max_num_seqs"):
        adaptive_beta(3, 0, 0.1, 0.5)


def test_tie_score():
    assert tie_score(100.0, 400.0, 0.25) == 200.0
    assert tie_score(100.0, 400.0, 0.0) == 100.0


def test_wait_decay_lets_long_waiter_overtake_fresh_short():
    beta, decay, tau = 0.3, 0.9, 30.0
    long_s = tie_score(*tie_moments(math.log(2000), 1.0, 4096, 0.9), beta)
    short_s = tie_score(*tie_moments(math.log(100), 1.0, 4096, 0.9), beta)
    assert long_s > short_s  # fresh, the long request loses
    assert wait_decay(long_s, 0.0, decay, tau) == long_s
    assert wait_decay(long_s, tau, decay, tau) == pytest.approx(long_s * decay)
    # after waiting long enough (decay^(t/tau) < short/long) it is served before a fresh short one
    t_needed = tau * math.log(short_s / long_s) / math.log(decay)
    assert wait_decay(long_s, 1.1 * t_needed, decay, tau) < wait_decay(short_s, 0.0, decay, tau)
    assert wait_decay(long_s, 0.9 * t_needed, decay, tau) > wait_decay(short_s, 0.0, decay, tau)
    with pytest.raises(ValueError, match="tau_s"):
        wait_decay(1.0, 1.0, 0.9, 0.0)


def test_vectorized_equals_scalar():
    rng = np.random.default_rng(7)
    n = 400
    mu = rng.uniform(-1, 10, n)
    sigma = rng.uniform(1e-3, 3.5, n)
    x_max = rng.choice([1, 16, 256, 4096, 32768, 1e6], n)
    alpha = rng.choice([0.5, 0.9, 0.99, 0.3], n)
    nu = rng.choice([2.0, 3.5, 10.0], n)
    e, c = tie_moments_many(mu, sigma, x_max, alpha, nu)
    ref = np.array([tie_moments(*args) for args in zip(mu, sigma, x_max, alpha, nu)])
    np.testing.assert_allclose(e, ref[:, 0], rtol=1e-12)
    np.testing.assert_allclose(c, ref[:, 1], rtol=1e-12)
    # broadcasting keeps the shape; deterministic (no sampling)
    e2, c2 = tie_moments_many(mu.reshape(20, 20), 0.7, 4096)
    assert e2.shape == c2.shape == (20, 20)
    e3, c3 = tie_moments_many(mu.reshape(20, 20), 0.7, 4096)
    assert np.array_equal(e2, e3) and np.array_equal(c2, c3)
    assert e2[3, 4] == tie_moments(mu[64], 0.7, 4096)[0]


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(sigma=0.0), "sigma"),
        (dict(sigma=-1.0), "sigma"),
        (dict(sigma=float("nan")), "sigma"),
        (dict(x_max=0.5), "x_max"),
        (dict(x_max=float("inf")), "x_max"),
        (dict(alpha=1.0), "alpha"),
        (dict(alpha=0.0), "alpha"),
        (dict(nu=0.0), "nu"),
        (dict(mu=float("nan")), "mu"),
    ],
)
def test_bad_args_raise_naming_argument(kwargs, name):
    base = dict(mu=3.0, sigma=1.0, x_max=256.0, alpha=0.9, nu=3.5)
    with pytest.raises(ValueError, match=rf"^{name} "):
        tie_moments(**(base | kwargs))
    # vectorized: one bad element among good ones
    many = {k: np.array([v, v]) for k, v in base.items()}
    many[name] = np.array([base[name], kwargs[name]])
    with pytest.raises(ValueError, match=rf"^{name} "):
        tie_moments_many(**many)

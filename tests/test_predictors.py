"""Output-length predictors: oracle (simulator only) and history (docs/policies.md#predictors)."""

from __future__ import annotations

import math
import time
from types import SimpleNamespace

import numpy as np
import pytest
from scipy import stats

from scheduler.policies.predictors import (
    SIGMA_FLOOR,
    HistoryPredictor,
    LengthPredictor,
    OraclePredictor,
    fit_logt_mle,
    fit_logt_mle_many,
    make_predictor,
    prompt_bucket,
)


def req(
    i=0,
    *,
    tenant="default",
    type="chat",
    prompt_tokens=100,
    max_tokens=1_000_000,
    output_tokens=None,
):
    return SimpleNamespace(
        id=f"r{i}",
        tenant=tenant,
        type=type,
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        output_tokens=output_tokens,
        generated=0,
    )


# ----------------------------------------------------------------------------- oracle


def test_oracle_exact_without_noise():
    p = OraclePredictor()
    for i, n in enumerate([1, 7, 128, 4000]):
        r = req(i, output_tokens=n, max_tokens=4096)
        assert p.predict_total(r) == n
        assert p.predict_dist(r) == (math.log(n), SIGMA_FLOOR)


def test_oracle_noise_is_deterministic_per_request():
    a, b = OraclePredictor(sigma_noise=0.4, seed=3), OraclePredictor(sigma_noise=0.4, seed=3)
    rs = [req(i, output_tokens=500) for i in range(50)]
    pa = [a.predict_total(r) for r in rs]
    assert pa == [b.predict_total(r) for r in rs]  # another instance, same seed
    assert pa == [a.predict_total(r) for r in rs]  # asked again
    assert len(set(pa)) == len(pa)  # different ids, different noise
    other = [OraclePredictor(sigma_noise=0.4, seed=4).predict_total(r) for r in rs]
    assert sum(x != y for x, y in zip(pa, other)) == len(pa)  # another seed, other draws
    assert any(x != 500 for x in pa)


def test_oracle_noise_spread_matches_sigma():
    # sigma_spread = 0: every request has log-scale sigma_noise, and the point estimate's log error
    # is sigma_noise times a Student-t(nu) draw (the oracle is calibrated to the log-t model TIE
    # uses; tests/test_oracle_dist.py checks the calibration and the per-request spread).
    sigma = 0.5
    p = OraclePredictor(sigma_noise=sigma, seed=11)
    rs = [req(i, output_tokens=1000) for i in range(4000)]
    logs = np.array([math.log(p.predict_total(r) / 1000) for r in rs])
    assert abs(np.median(logs)) < 0.03
    assert stats.kstest(logs / sigma, stats.t(p.nu).cdf).pvalue > 0.01  # log-t noise of scale sigma
    assert stats.kstest(logs / sigma, "norm").pvalue < 1e-3  # not log-normal: heavier tails
    mu, s = p.predict_dist(rs[0])
    assert s == sigma and mu == pytest.approx(math.log(p.predict_total(rs[0])))


def test_oracle_caps_at_max_tokens():
    p = OraclePredictor(sigma_noise=2.0, seed=0)
    preds = [p.predict_total(req(i, output_tokens=900, max_tokens=1000)) for i in range(200)]
    assert max(preds) == 1000.0 and min(preds) < 900


def test_oracle_needs_true_length():
    with pytest.raises(ValueError, match="only the simulator has them"):
        OraclePredictor().predict_total(req(output_tokens=None))
    with pytest.raises(ValueError, match="sigma_noise"):
        OraclePredictor(sigma_noise=-0.1)
    with pytest.raises(ValueError, match="sigma_spread"):
        OraclePredictor(sigma_noise=0.5, sigma_spread=-0.1)
    with pytest.raises(ValueError, match="sigma_spread"):
        OraclePredictor(sigma_noise=0.5, sigma_spread=math.inf)


# ----------------------------------------------------------------------------- MLE


def test_mle_matches_scipy_t_fit():
    rng = np.random.default_rng(5)
    x = 4.0 + 0.8 * rng.standard_t(3.5, 800)
    mu, sigma = fit_logt_mle(x, 3.5)
    _, loc, scale = stats.t.fit(x, fix_df=3.5)
    assert mu == pytest.approx(loc, abs=2e-3) and sigma == pytest.approx(scale, rel=2e-3)
    ll_ours = stats.t.logpdf(x, 3.5, mu, sigma).sum()
    ll_scipy = stats.t.logpdf(x, 3.5, loc, scale).sum()
    assert ll_ours >= ll_scipy - 1e-7  # at least as good an optimum
    # the ML score equations hold at our answer
    w = 4.5 / (3.5 + ((x - mu) / sigma) ** 2)
    assert abs(np.sum(w * (x - mu))) < 1e-6 * len(x)
    assert np.sum(w * (x - mu) ** 2) / sigma**2 == pytest.approx(len(x), rel=1e-6)


def test_mle_many_equals_one_by_one():
    rng = np.random.default_rng(6)
    samples = [rng.normal(m, 1.0, n) for m, n in [(1, 30), (5, 400), (-2, 25)]]
    mus, sigmas = fit_logt_mle_many(samples, 3.5)
    for s, m, sg in zip(samples, mus, sigmas):
        m1, s1 = fit_logt_mle(s, 3.5)
        assert m == pytest.approx(m1, abs=1e-7) and sg == pytest.approx(s1, rel=1e-7)
    # all-equal sample: no crash, tiny sigma (the predictor floors it)
    m, s = fit_logt_mle(np.full(50, 3.0))
    assert m == 3.0 and s < 1e-3


# ----------------------------------------------------------------------------- history


def test_prompt_bucket():
    assert [prompt_bucket(p) for p in (0, 1, 2, 3, 4, 1023, 1024, 5000)] == [
        0,
        0,
        1,
        1,
        2,
        9,
        10,
        12,
    ]


@pytest.mark.parametrize("mu, sigma", [(5.0, 0.7), (3.5, 0.3), (7.0, 1.2)])
def test_history_recovers_known_logt(mu, sigma):
    rng = np.random.default_rng(int(mu * 10))
    h = HistoryPredictor(nu=3.5)
    lengths = np.exp(mu + sigma * rng.standard_t(3.5, 4000))
    r = req(prompt_tokens=300)
    for n in lengths:
        h.observe(r, max(round(n), 1))
    h.refit()
    got_mu, got_sigma = h.predict_dist(r)
    assert got_mu == pytest.approx(mu, abs=0.04)
    assert got_sigma == pytest.approx(sigma, rel=0.06)
    assert h.predict_total(r) == pytest.approx(math.exp(got_mu))  # median of the log-t


def test_history_predict_total_capped_at_max_tokens():
    h = HistoryPredictor(min_samples=20)
    for i in range(30):
        h.observe(req(i), 3000)
    h.refit()
    assert h.predict_total(req(max_tokens=10**6)) == pytest.approx(3000, rel=1e-6)
    assert h.predict_total(req(max_tokens=512)) == 512


def test_history_falls_back_to_coarser_keys():
    h = HistoryPredictor(min_samples=20)
    for i in range(30):  # (acme, chat, bucket 6): 30 samples of ~50 tokens
        h.observe(req(i, tenant="acme", type="chat", prompt_tokens=100), 50 + i % 3)
    for i in range(5):  # (acme, chat, bucket 9): only 5 samples of 400
        h.observe(req(i, tenant="acme", type="chat", prompt_tokens=1000), 400)
    for i in range(5):  # (acme, batch, *): 5 samples
        h.observe(req(i, tenant="acme", type="batch", prompt_tokens=100), 900)
    for i in range(15):  # (other, chat, bucket 6): 15 samples, other tenant
        h.observe(req(i, tenant="other", type="chat", prompt_tokens=100), 2000)
    h.refit()

    def used(**kw):
        return h.fit_for(req(**kw))[0]

    assert used(tenant="acme", type="chat", prompt_tokens=100) == ("acme", "chat", 6)
    assert used(tenant="acme", type="chat", prompt_tokens=1000) == ("acme", "chat")
    assert used(tenant="acme", type="batch", prompt_tokens=100) == ("acme",)
    assert used(tenant="other", type="chat", prompt_tokens=100) == ()  # 15 < 20: global
    assert used(tenant="nobody", type="embed", prompt_tokens=7) == ()
    # the fine key is fitted on its own data, the coarser keys on their (wider) pools
    fine = h.predict_total(req(tenant="acme", prompt_tokens=100))
    assert 49 <= fine <= 53
    assert h.fits[("acme", "chat")][2] == 35
    assert h.fits[()][2] == 55


def test_history_sigma_comes_from_each_keys_observed_spread():
    # Two fine keys with the same median but different observed spreads get their own ML sigma;
    # the fallback levels are fitted on their own pooled observations.
    rng = np.random.default_rng(21)
    h = HistoryPredictor(
        nu=3.5, window=10_000, min_samples=20
    )  # the window keeps every observation
    narrow = req(tenant="acme", type="chat", prompt_tokens=100)  # key (acme, chat, 6)
    wide = req(tenant="acme", type="chat", prompt_tokens=1000)  # key (acme, chat, 9)
    logs_by_key = {}
    for r, sigma in ((narrow, 0.3), (wide, 1.2)):
        n = np.maximum(np.round(np.exp(6.0 + sigma * rng.standard_t(3.5, 3000))), 1)
        for x in n:
            h.observe(r, int(x))
        logs_by_key[sigma] = np.log(n)
    few = req(tenant="acme", type="chat", prompt_tokens=10)  # bucket 3: 5 samples, falls back
    for _ in range(5):
        h.observe(few, 400)
    other = np.maximum(np.round(np.exp(4.0 + 0.6 * rng.standard_t(3.5, 30))), 1)
    for x in other:
        h.observe(req(tenant="beta", type="chat", prompt_tokens=100), int(x))
    h.refit()

    (mu_n, s_n), (mu_w, s_w) = h.predict_dist(narrow), h.predict_dist(wide)
    assert mu_n == pytest.approx(6.0, abs=0.03) and mu_w == pytest.approx(6.0, abs=0.08)
    assert s_n == pytest.approx(0.3, rel=0.06) and s_w == pytest.approx(1.2, rel=0.06)
    # (acme, chat) pools both keys and the 5 stragglers: its sigma is that sample's ML fit,
    # strictly between the two fine ones.
    key, mu_f, s_f = h.fit_for(few)
    assert key == ("acme", "chat")
    acme = np.concatenate([logs_by_key[0.3], logs_by_key[1.2], np.full(5, math.log(400))])
    assert (mu_f, s_f) == pytest.approx(fit_logt_mle(acme, 3.5), rel=1e-9)
    assert s_n < s_f < s_w
    # tenant-level and global fallbacks: each the fit of exactly its own observations
    key, mu_b, s_b = h.fit_for(req(tenant="beta", type="code", prompt_tokens=5))
    assert key == ("beta",) and (mu_b, s_b) == pytest.approx(
        fit_logt_mle(np.log(other), 3.5), rel=1e-9
    )
    key, mu_g, s_g = h.fit_for(req(tenant="nobody"))
    assert key == () and (mu_g, s_g) == pytest.approx(
        fit_logt_mle(np.concatenate([acme, np.log(other)]), 3.5), rel=1e-9
    )
    assert len({s_n, s_w, s_f, s_b, s_g}) == 5


def test_history_nothing_without_min_samples():
    h = HistoryPredictor(min_samples=20)
    for i in range(19):
        h.observe(req(i), 100)
    assert h.refit() == 0
    assert h.predict_dist(req()) is None and h.predict_total(req()) is None
    h.observe(req(19), 100)
    assert h.refit() > 0 and h.predict_total(req()) == pytest.approx(100)


def test_history_window_is_bounded():
    h = HistoryPredictor(window=50, min_samples=20)
    r = req(prompt_tokens=64)
    for _ in range(150):
        h.observe(r, 10)
    for _ in range(50):
        h.observe(r, 1000)
    for key in h.keys_for(r):
        assert h.n_observations(key) == 50
    h.refit()
    assert h.predict_total(r) == pytest.approx(1000, rel=1e-6)  # only the last 50 remain


def test_history_predicts_none_before_refit():
    h = HistoryPredictor()
    for i in range(100):
        h.observe(req(i), 100 + i)
    assert h.predict_dist(req()) is None
    assert h.predict_total(req()) is None
    v0 = h.version
    h.refit()
    assert h.version == v0 + 1
    assert h.predict_dist(req()) is not None


def test_observe_never_refits():
    calls = []

    class Counting(HistoryPredictor):  # (a compiled predictor's methods cannot be patched)
        counting = False

        def refit(self) -> int:
            if self.counting:
                calls.append(1)
            return super().refit()

    h = Counting(min_samples=20)
    for i in range(40):
        h.observe(req(i), 100)
    h.refit()
    before, version = h.predict_dist(req()), h.version
    h.counting = True
    for i in range(500):
        h.observe(req(i), 5000)  # would move the fit a lot
    assert calls == []
    assert h.version == version
    assert h.predict_dist(req()) == before  # predictions only change on refit


def test_history_refit_fits_every_key_level():
    # (Its wall time, < 1 s for this size, is measured by benchmarks/predictor_refit.py, not here.)
    rng = np.random.default_rng(9)
    h = HistoryPredictor(window=5000)
    for k in range(100):
        # 100 distinct fine keys: 10 tenants x 2 types x 5 prompt buckets
        r = req(
            k,
            tenant=f"t{k // 10}",
            type=("chat", "batch")[k % 2],
            prompt_tokens=2 ** (3 + (k % 10) // 2),
        )
        logs = rng.uniform(2, 7) + rng.uniform(0.2, 1.5) * rng.standard_t(3.5, 2000)
        for n in np.exp(logs):
            h.observe(r, max(int(n), 1))
    assert sum(1 for k in h.fits) == 0
    t0 = time.perf_counter()
    n_keys = h.refit()
    dt = time.perf_counter() - t0
    assert n_keys == 100 + 20 + 10 + 1  # fine keys, (tenant, type), (tenant,), global
    assert 0 < h.last_refit_s <= dt  # the refit records its own duration


def test_history_refits_only_what_changed_and_warm_starts_to_the_same_fit():
    rng = np.random.default_rng(4)
    h = HistoryPredictor(window=5000, min_samples=20)
    a, b = req(1, tenant="a", prompt_tokens=64), req(2, tenant="b", prompt_tokens=64)
    for n in np.exp(4 + 0.8 * rng.standard_t(3.5, 500)):
        h.observe(a, max(int(n), 1))
        h.observe(b, max(int(2 * n), 1))
    h.refit()
    fits, version = h.fits, h.version
    assert (
        h.refit() == len(fits) and h.version == version and h.fits == fits
    )  # nothing new: no new epoch
    extra = np.exp(5 + 0.5 * rng.standard_t(3.5, 300))
    for n in extra:
        h.observe(a, max(int(n), 1))
    h.refit()
    assert h.version == version + 1
    new = h.fits
    for key in h.keys_for(b)[:3]:  # b's own keys saw nothing new: kept as they were
        assert new[key] == fits[key]
    for key in h.keys_for(a):  # a's keys (and the global one) moved, to the cold fit's optimum
        assert new[key] != fits[key]
        cold_mu, cold_sigma = fit_logt_mle(
            np.fromiter(h._pools[key], float), h.nu
        )  # the pools hold ln(tokens)
        assert new[key][0] == pytest.approx(cold_mu, abs=1e-6)
        assert new[key][1] == pytest.approx(max(cold_sigma, SIGMA_FLOOR), abs=1e-6)
    # Fewer new lengths than refit_fraction (2%) of a key's pool wait for more: 5 of 800 does not
    # refit.
    for _ in range(5):
        h.observe(a, 7)
    assert h.refit() == len(new) and h.version == version + 1 and h.fits == new
    for _ in range(20):  # 25 of 825: a's keys are due; the global key (25 of 1,325) is not yet
        h.observe(a, 7)
    h.refit()
    assert h.version == version + 2 and h.fits[h.keys_for(a)[0]] != new[h.keys_for(a)[0]]
    assert h.fits[()] == new[()]


def test_history_validates_params():
    with pytest.raises(ValueError, match="window"):
        HistoryPredictor(window=0)
    with pytest.raises(ValueError, match="min_samples"):
        HistoryPredictor(min_samples=1)


# ----------------------------------------------------------------------------- factory


def test_make_predictor():
    p = make_predictor("oracle", sigma_noise=0.2, seed=1, sigma_spread=0.3)
    assert isinstance(p, OraclePredictor) and p.sigma_noise == 0.2 and p.name == "oracle"
    assert p.sigma_spread == 0.3 and make_predictor("oracle").sigma_spread == 0.0
    h = make_predictor("history", window=10, min_samples=5)
    assert isinstance(h, HistoryPredictor) and h.window == 10 and h.name == "history"
    assert isinstance(h, LengthPredictor) and isinstance(p, LengthPredictor)
    with pytest.raises(ValueError, match="history, oracle"):
        make_predictor("magic")
    with pytest.raises(ValueError, match="sigma_noise"):
        make_predictor("history", sigma_noise=0.3)


def test_a_single_key_fit_is_the_group_iteration_bit_for_bit():
    """``fit_logt_mle_many`` fits one sample on scalars (``_fit_one``, a refit's common case, half
    the time): every result equals the group iteration's (``_fit_groups``) to the last bit, cold
    and warm-started, so a replay's predictions and hashes cannot tell them apart."""
    from scheduler.policies.predictors import _fit_groups, _fit_one

    rng = np.random.default_rng(3)
    for trial in range(200):
        n = int(rng.integers(2, 3000))
        x = np.log(rng.lognormal(rng.uniform(2, 7), rng.uniform(0.05, 2), size=n).clip(1))
        if trial % 10 == 0:
            x[:] = x[0]  # every length equal: sigma floored
        warm = None if trial % 2 else (float(np.mean(x)) + 0.01, float(np.std(x)) + 1e-3)
        start = None if warm is None else (np.array([warm[0]]), np.array([warm[1]]))
        mu, sigma = _fit_groups([x], np.array([n]), 3.5, 1e-9, 1000, start)
        assert _fit_one(x, 3.5, 1e-9, 1000, warm) == (mu[0], sigma[0]), trial
    many = fit_logt_mle_many([x])
    assert (many[0][0], many[1][0]) == _fit_one(x, 3.5, 1e-9, 1000, None)
    # Warm starts whose square differs in the last bit between the C library's ``pow`` and a
    # product (a review found ``** 2`` here: 1 in ~1,000 doubles), each fitted both ways.
    sigmas = [v for v in rng.uniform(0.05, 2.5, 200_000) if float(v) ** 2 != v * v][:60]
    assert sigmas, "no double here squares differently by pow: the check is void"
    for s0 in sigmas:
        n = int(rng.integers(2, 400))
        x = np.log(rng.lognormal(rng.uniform(2, 7), s0, size=n).clip(1))
        mu0 = float(np.mean(x)) + float(rng.normal(0, 0.01))
        # One iteration shows a start's last bit (a third of these differ under ``** 2``);
        # a converged fit mostly washes it out.
        for iterations in (1, 1000):
            warm = (np.array([mu0]), np.array([s0]))
            mu, sigma = _fit_groups([x], np.array([n]), 3.5, 1e-9, iterations, warm)
            got = _fit_one(x, 3.5, 1e-9, iterations, (mu0, float(s0)))
            assert got == (mu[0], sigma[0]), (s0.hex(), iterations)
    # Past a double's range the public fit gives numpy's answer, not an exception.
    with np.errstate(all="ignore"):
        huge = fit_logt_mle_many([np.array([0.0, 1e200, -1e200])])
    assert huge[0].shape == huge[1].shape == (1,)

"""The ranking statistics of benchmarks/vllm_ranking.py: Kendall's τ-b from pair signs (equal to
scipy's τ-b where ties are equal values), ties within the run-to-run noise, the pairwise agreement
(Harrell's C over the pairs the real runs separate), the best-candidate check and the autopilot's
guarded choice."""

from __future__ import annotations

import itertools
import random

import pytest
from scipy import stats

from benchmarks.vllm_ranking import (
    average_ranks,
    guarded_choice,
    kendall_tau,
    pairwise_agreement,
    ranking_agreement,
    repeat_signs,
    value_signs,
)


def test_tau_matches_scipy_tau_b_with_and_without_ties():
    rng = random.Random(7)
    for _ in range(200):
        n = rng.randint(2, 8)
        x = [rng.choice([1.0, 2.0, 3.0, rng.random()]) for _ in range(n)]
        y = [rng.choice([1.0, 2.0, rng.random()]) for _ in range(n)]
        names = [f"c{i}" for i in range(n)]
        ours = kendall_tau(value_signs(dict(zip(names, x))), value_signs(dict(zip(names, y))))
        ref = stats.kendalltau(x, y).statistic  # tau-b by default
        if ours is None:
            assert len(set(x)) == 1 or len(set(y)) == 1
        else:
            assert ours == pytest.approx(ref, abs=1e-12)


def test_tau_extremes_and_a_hand_computed_noise_tie():
    real = {"a": [1.0, 1.2], "b": [2.0, 2.1], "c": [3.0, 3.3]}
    assert kendall_tau(repeat_signs(real), value_signs({"a": 1, "b": 2, "c": 3})) == 1.0
    assert kendall_tau(repeat_signs(real), value_signs({"a": 3, "b": 2, "c": 1})) == -1.0
    # b and c overlap (b's runs reach c's): the real order is a < b, a < c, b ~ c.
    real = {"a": [1.0, 1.2], "b": [2.0, 3.1], "c": [3.0, 3.3]}
    sx = repeat_signs(real)
    assert sx == {("a", "b"): -1, ("a", "c"): -1, ("b", "c"): 0}
    sy = value_signs({"a": 2.5, "b": 1.0, "c": 3.0})  # sim: b < a < c
    # concordant (a,c), discordant (a,b), (b,c) ignored on the real side: (1 − 1) / √(2·3) = 0
    assert kendall_tau(sx, sy) == 0.0
    sy = value_signs({"a": 1.0, "b": 3.0, "c": 2.0})  # sim swaps the tied pair only: no penalty
    assert kendall_tau(sx, sy) == pytest.approx(2 / (2 * 3) ** 0.5)


def test_value_signs_tolerance_and_everything_tied():
    assert value_signs({"a": 1.0, "b": 1.04}, rel_tol=0.05) == {("a", "b"): 0}
    assert value_signs({"a": 1.0, "b": 1.06}, rel_tol=0.05) == {("a", "b"): -1}
    assert kendall_tau(value_signs({"a": 1.0, "b": 1.0}), value_signs({"a": 1.0, "b": 2.0})) is None
    with pytest.raises(ValueError):
        kendall_tau({("a", "b"): 1}, {("a", "c"): 1})


def test_pairwise_agreement_counts_sim_ties_as_half_and_skips_real_ties():
    real = {("a", "b"): -1, ("a", "c"): -1, ("b", "c"): 0, ("a", "d"): 1}
    sim = {("a", "b"): -1, ("a", "c"): 0, ("b", "c"): 1, ("a", "d"): -1}
    p = pairwise_agreement(real, sim)
    assert (p["separated"], p["real_ties"], p["alike"], p["opposite"], p["sim_tied"]) == (
        3,
        1,
        1,
        1,
        1,
    )
    assert p["fraction"] == pytest.approx((1 + 0.5) / 3)
    assert p["disagreeing"] == [["a", "d"]]
    assert pairwise_agreement({("a", "b"): 0}, {("a", "b"): 1})["fraction"] is None


def test_ranking_agreement_best_within_noise_and_regret():
    real = {"sarathi": [4.0, 4.4], "defaults": [2.0, 2.6], "g1": [2.4, 2.5], "g2": [1.6, 3.2]}
    sim = {"sarathi": 3.9, "defaults": 2.1, "g1": 2.2, "g2": 2.3}
    a = ranking_agreement(real, sim)
    assert (
        a["real_best"] == "defaults" and a["sim_best"] == "defaults" and a["sim_best_is_real_best"]
    )
    # The sim picks g1, whose range overlaps the defaults'.
    sim = {"sarathi": 3.9, "defaults": 2.3, "g1": 2.2, "g2": 2.5}
    a = ranking_agreement(real, sim)
    assert a["sim_best"] == "g1" and not a["sim_best_is_real_best"] and a["sim_best_within_noise"]
    assert a["regret"] == pytest.approx(2.45 / 2.3 - 1)
    # The sim picks sarathi: clearly worse.
    sim = {"sarathi": 1.0, "defaults": 2.3, "g1": 2.2, "g2": 2.5}
    a = ranking_agreement(real, sim)
    assert a["sim_best"] == "sarathi" and not a["sim_best_within_noise"]
    assert a["pairwise"]["opposite"] == 3 and a["kendall_tau_b"] < 0
    with pytest.raises(ValueError):
        ranking_agreement({"a": [1.0]}, {"b": 1.0})


def test_average_ranks_share_ties():
    assert average_ranks({"a": 3.0, "b": 1.0, "c": 3.0, "d": 2.0}) == {
        "b": 1,
        "d": 2,
        "a": 3.5,
        "c": 3.5,
    }


def test_repeat_signs_is_antisymmetric_in_names():
    rng = random.Random(3)
    for _ in range(50):
        reps = {k: [rng.random() for _ in range(2)] for k in "abcd"}
        fwd, back = repeat_signs(reps), repeat_signs(dict(reversed(list(reps.items()))))
        for a, b in itertools.combinations("abcd", 2):
            assert fwd[(a, b)] == -back[(b, a)]


def test_guarded_choice_respects_the_guards():
    figs = {
        "sarathi": {"ttft_p95": 3.0, "ttlt_p99": 10.0, "throughput_tok_s": 100.0},
        "g_fast_but_slow_tail": {"ttft_p95": 0.5, "ttlt_p99": 10.3, "throughput_tok_s": 100.0},
        "g_fast_but_loses_tokens": {"ttft_p95": 0.6, "ttlt_p99": 9.0, "throughput_tok_s": 98.0},
        "g_ok": {"ttft_p95": 1.0, "ttlt_p99": 10.2, "throughput_tok_s": 99.0},
    }
    assert guarded_choice(figs) == "g_ok"
    del figs["g_ok"]
    assert guarded_choice(figs) == "sarathi"

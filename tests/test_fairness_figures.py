"""One definition of each of seed 003's figures (scheduler/metrics/fairness.py): SCR, the
suppression-aware JFI beside the seed's literal one, type fairness and ω = min(C/U, α); the worked
example of docs/governance.md computed exactly; starved tenants counted; the tuner's
``fairness_summary`` agreeing with the governance report on the same completions."""

from __future__ import annotations

import pytest

from scheduler.metrics import Completion, fairness_summary
from scheduler.metrics.fairness import window_report
from scheduler.settings import SloFqParams


def done(rid, tenant, arrival, ttft, ttlt, tokens=500, rtype="chat"):
    return Completion(
        id=rid,
        tenant=tenant,
        type=rtype,
        arrival=arrival,
        scheduled_at=arrival,
        first_token_at=arrival + ttft,
        finished_at=arrival + ttlt,
        prompt_tokens=tokens // 2,
        output_tokens=tokens - tokens // 2,
    )


# --- the worked example of docs/governance.md ------------------------------------------------

EXAMPLE = SloFqParams.model_validate(
    {
        "tenants": {
            "acme": {"commit_tok_s": 300, "ttft": {"p50": 0.5, "p99": 2.0}},
            "beta": {"commit_tok_s": 100, "ttft": {"p99": 2.0}},
            "gamma": {"commit_tok_s": 100, "ttft": {"p99": 2.0}},
            "delta": {"commit_tok_s": 100, "ttft": {"p99": 2.0}},
        },
        "type_shares": {"batch": 0.2},
    }
)


def example_rows() -> list[Completion]:
    rows = [done(f"acme{i}", "acme", i, 0.3, 4.0) for i in range(6)]  # 3,000 tokens
    rows += [done("beta0", "beta", 0, 0.4, 4.0)]  # 500 tokens: it asked for no more
    rows += [
        done(f"gamma{i}", "gamma", i, 1.0, 5.0, rtype="batch" if i == 0 else "chat")
        for i in range(5)
    ]
    return rows  # 6,000 tokens in 12 requests over 10 s; delta: 3 requests waiting, the oldest 12 s


def example_report() -> dict:
    return window_report(
        example_rows(),
        EXAMPLE,
        duration_s=10.0,
        arrived={"chat": 11, "batch": 4},
        waiting={"delta": {"requests": 3, "waited_s": 12.0}},
    )


def test_the_worked_example_of_the_docs():
    rep = example_report()
    t = rep["tenants"]
    # SCR: delta has waited 12 s > its 2 s P99 target with nothing served: it counts, and misses
    assert (
        t["delta"]["starved"]
        and t["delta"]["missed"] == ["ttft_p99"]
        and not t["delta"]["compliant"]
    )
    assert rep["scr"] == pytest.approx(3 / 4)
    # demand: served + waiting (delta: 3 requests at the window's 500 tokens per request)
    assert [t[n]["demand_tokens"] for n in ("acme", "beta", "gamma", "delta")] == [
        3000,
        500,
        2500,
        1500,
    ]
    # entitlement: the 6,000 tokens served, shared 3:1:1:1 by commitment, capped by demand
    assert [t[n]["entitled_tokens"] for n in ("acme", "beta", "gamma", "delta")] == pytest.approx(
        [3000, 500, 1250, 1250]
    )
    assert [t[n]["service_ratio"] for n in ("acme", "beta", "gamma", "delta")] == pytest.approx(
        [1, 1, 1, 0]
    )
    assert rep["jfi"] == pytest.approx(9 / 12)  # (1+1+1+0)² / (4·3)
    # the seed's literal JFI over Û = served rate / commitment: 1, 0.5, 2.5, 0
    assert [t[n]["normalised"] for n in ("acme", "beta", "gamma", "delta")] == pytest.approx(
        [1, 0.5, 2.5, 0]
    )
    assert rep["jfi_seed"] == pytest.approx(16 / 30)  # 4² / (4·7.5)
    # ω = min(C/U, α=4): gamma uses 2.5× its commitment: the one over-consumer
    assert [t[n]["omega"] for n in ("acme", "beta", "gamma", "delta")] == pytest.approx(
        [1.0, 2.0, 0.4, 4.0]
    )
    assert rep["over_consumers"] == ["gamma"]
    # type fairness: batch got 1 of 12 served, guaranteed min(0.2, 4/15 asked) = 0.2
    assert rep["type_fairness"]["batch"] == pytest.approx((1 / 12) / 0.2)


def test_the_docs_carry_the_same_numbers():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "governance.md").read_text()
    for figure in (
        "SCR = 3/4 = 0.750",
        "JFI = 9/12 = 0.750",
        "JFI (seed) = 16/30 = 0.533",
        "ω: acme 1.0, beta 2.0, gamma 0.4, delta 4.0",
        "TFR(batch) = (1/12) / 0.2 = 0.417",
    ):
        assert figure in text, figure


# --- JFI: suppression, not inequality ------------------------------------------------------------

UNEQUAL = SloFqParams.model_validate(
    {
        "tenants": {
            "big": {"commit_tok_s": 400, "ttft": {"p99": 2.0}},
            "s1": {"commit_tok_s": 100, "ttft": {"p99": 2.0}},
            "s2": {"commit_tok_s": 100, "ttft": {"p99": 2.0}},
        }
    }
)


def test_unequal_commitments_equal_demand_all_served_is_fair():
    """Every tenant got all it asked for and met its SLO: nothing is suppressed (the seed's literal
    figure, reported beside it, reads 0.8 here and would have fired the alert)."""
    rows = [done(f"{t}{i}", t, i, 0.2, 1.0) for t in ("big", "s1", "s2") for i in range(4)]
    rep = window_report(rows, UNEQUAL, duration_s=10.0)
    assert rep["scr"] == 1.0 and rep["jfi"] == pytest.approx(1.0)
    assert rep["jfi_seed"] < 0.9


def test_a_tenant_asking_less_than_its_commitment_does_not_lower_jfi():
    rows = [done(f"big{i}", "big", i, 0.2, 1.0) for i in range(8)] + [
        done("s10", "s1", 0, 0.2, 1.0)
    ]
    rows += [done(f"s2{i}", "s2", i, 0.2, 1.0) for i in range(2)]
    rep = window_report(rows, UNEQUAL, duration_s=10.0)
    assert rep["jfi"] == pytest.approx(1.0)


def test_a_backlogged_tenant_below_its_share_lowers_jfi():
    """s1 asked for 10 requests, got 1 while big took 8 beyond its share: suppressed."""
    rows = [done(f"big{i}", "big", i, 0.2, 1.0) for i in range(12)] + [
        done("s10", "s1", 0, 0.2, 1.0)
    ]
    rep = window_report(
        rows, UNEQUAL, duration_s=10.0, waiting={"s1": {"requests": 9, "waited_s": 1.0}}
    )
    assert (
        rep["tenants"]["s1"]["service_ratio"] < 0.5 and rep["jfi"] < 0.9
    )  # below the alert threshold
    assert rep["over_consumers"] == ["big"]


def test_weights_and_commitments_are_on_one_scale():
    """A weight-1 tenant is worth the mean commitment (slofq's scale): equal service is fair."""
    mixed = SloFqParams.model_validate(
        {"tenants": {"c": {"commit_tok_s": 100}, "w": {"weight": 1.0}}}
    )
    rows = [done(f"{t}{i}", t, i, 0.2, 1.0, tokens=100) for t in ("c", "w") for i in range(10)]
    rep = window_report(rows, mixed, duration_s=10.0)
    assert rep["jfi"] == pytest.approx(1.0) and rep["jfi_seed"] == pytest.approx(1.0)


# --- a starved tenant is visible ---------------------------------------------------------------


def test_a_starved_tenant_counts_in_scr_and_jfi():
    params = SloFqParams.model_validate(
        {"tenants": {t: {"weight": 1.0, "ttft": {"p99": 2.0}} for t in "abc"}}
    )
    rows = [done(f"{t}{i}", t, i, 0.2, 1.0) for t in "ab" for i in range(5)]
    assert window_report(rows, params, duration_s=10.0)["scr"] == 1.0  # c sent nothing: not counted
    rep = window_report(
        rows, params, duration_s=10.0, waiting={"c": {"requests": 4, "waited_s": 30.0}}
    )
    assert rep["scr"] == pytest.approx(2 / 3) and rep["jfi"] == pytest.approx(2 / 3)
    assert rep["tenants"]["c"]["waiting"] == 4 and rep["tenants"]["c"]["ttft_p99"] is None
    # waiting, but not yet past its target: counted, meeting its targets so far
    fresh = window_report(
        rows, params, duration_s=10.0, waiting={"c": {"requests": 1, "waited_s": 0.5}}
    )
    assert fresh["scr"] == 1.0 and fresh["tenants"]["c"]["compliant"]


# --- one implementation
# ----------------------------------------------------------------------------


def test_fairness_summary_and_the_governance_report_agree():
    """The tuner's ``fairness_summary`` and the collector's report on the same completions (the
    issue measured JFI 0.857 vs 0.896, type fairness 0.943 vs 1.0 before)."""
    params = SloFqParams.model_validate(
        {
            "tenants": {
                "a": {"weight": 1.0, "ttft": {"p99": 1.0}},
                "b": {"weight": 2.0, "ttft": {"p99": 1.0}},
            },
            "type_shares": {"batch": 0.3},
        }
    )
    rows = [
        done(f"a{i}", "a", i, 0.2, 1.0, tokens=300, rtype="batch" if i < 2 else "chat")
        for i in range(8)
    ]
    rows += [done(f"b{i}", "b", i, 1.5 if i == 0 else 0.3, 2.0, tokens=200) for i in range(5)]
    rep = window_report(
        rows, params, duration_s=10.0, waiting={"b": {"requests": 6, "waited_s": 0.5}}
    )
    fs = fairness_summary(
        rows,
        slos={"ttft_p99": 1.0},
        weights={"a": 1.0, "b": 2.0},
        guaranteed_shares={"batch": 0.3},
        duration_s=10.0,
        waiting={"b": {"requests": 6, "waited_s": 0.5}},
    )
    assert fs["jain_index"] == pytest.approx(rep["jfi"]) and rep["jfi"] < 1.0
    assert fs["jain_index_seed"] == pytest.approx(rep["jfi_seed"])
    assert fs["slo_compliance_ratio"] == pytest.approx(rep["scr"])
    assert fs["type_share_ratio_min"] == pytest.approx(rep["type_fairness_min"])


def test_the_tuners_window_metrics_use_the_same_jfi():
    """A replayed window: requests not finished when its arrivals end were still waiting then."""
    from tuner.studies.windows import completion_metrics

    rows = [done(f"a{i}", "a", i, 0.2, 1.0) for i in range(10)]
    rows += [
        done(f"b{i}", "b", i, 30.0 if i > 1 else 0.2, 31.0 if i > 1 else 1.0) for i in range(10)
    ]
    got = completion_metrics(rows, ["jain_index"], until=10.0)["jain_index"]
    ref = fairness_summary(rows, until=10.0)["jain_index"]
    assert got == pytest.approx(ref) and got < 0.8  # b: 2 of its 10 served by the window's end

"""Tests for scheduler.metrics (docs/engine.md#metrics).

Expected values are computed by hand or with numpy directly from the raw fields, never with
the module's own derived columns.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.metrics import (
    LATENCY_BASES,
    METRIC_ALIASES,
    METRICS,
    STAT_SUFFIXES,
    Completion,
    CompletionArrays,
    UnknownMetricError,
    WindowedPercentiles,
    distribution_stats,
    fairness_summary,
    jain_index,
    metric_direction,
    metric_value,
    normalised_throughput,
    percent_change,
    shares,
    slo_attainment,
    slo_compliance,
    slo_compliance_ratio,
    summarize,
    summarize_by,
    tenant_jain_index,
    tightest_slo_scale,
    to_arrays,
    type_share_ratio,
    validate_metric,
)

QS = [50, 90, 95, 99, 99.9]
SUFFIX_Q = dict(zip(["p50", "p90", "p95", "p99", "p999"], QS))


def make(
    i,
    arrival,
    scheduled,
    first,
    finished,
    out,
    *,
    prompt=10,
    tenant="a",
    kind="chat",
    preemptions=0,
    recomputed=0,
):
    return Completion(
        f"r{i}",
        tenant,
        kind,
        arrival,
        scheduled,
        first,
        finished,
        prompt,
        out,
        preemptions,
        recomputed,
    )


# Three hand-built requests (times in seconds).
#   r0: arrival 0, admitted 1, first token 2, finished 6, 5 tokens
#       TTFT 2, TTLT 6, TBT (6-2)/4 = 1, PTL 6/5 = 1.2, queue 1
#   r1: arrival 1, admitted 1.5, first token 3, finished 3, 1 token
#       TTFT 2, TTLT 2, TBT undefined, PTL 2, queue 0.5
#   r2: arrival 2, admitted 2, first token 2.5, finished 12.5, 11 tokens
#       TTFT 0.5, TTLT 10.5, TBT 10/10 = 1, PTL 10.5/11, queue 0
HAND = [
    make(0, 0.0, 1.0, 2.0, 6.0, 5, tenant="a", preemptions=1, recomputed=7),
    make(1, 1.0, 1.5, 3.0, 3.0, 1, tenant="b", kind="batch"),
    make(2, 2.0, 2.0, 2.5, 12.5, 11, tenant="a", preemptions=2, recomputed=3),
]
HAND_EXPECTED = {
    "ttft": [2.0, 2.0, 0.5],
    "ttlt": [6.0, 2.0, 10.5],
    "tbt": [1.0, math.nan, 1.0],
    "ptl": [1.2, 2.0, 10.5 / 11],
    "queue": [1.0, 0.5, 0.0],
}


def random_completions(n, seed=0, tenants=("a", "b", "c"), kinds=("chat", "batch")):
    rng = np.random.default_rng(seed)
    arrival = np.sort(rng.uniform(0, 100, n))
    scheduled = arrival + rng.exponential(0.5, n)
    first = scheduled + rng.exponential(0.2, n)
    out = rng.integers(1, 200, n)
    finished = first + (out - 1) * rng.uniform(0.01, 0.05, n)
    return [
        Completion(
            f"r{i}",
            tenants[i % len(tenants)],
            kinds[i % len(kinds)],
            float(arrival[i]),
            float(scheduled[i]),
            float(first[i]),
            float(finished[i]),
            int(rng.integers(1, 500)),
            int(out[i]),
            int(i % 4 == 0),
            int(i % 4 == 0) * 5,
        )
        for i in range(n)
    ]


# ---------------------------------------------------------------- per-request values


@pytest.mark.parametrize("base", LATENCY_BASES)
def test_per_request_values_hand_computed(base):
    arrays = to_arrays(HAND)
    np.testing.assert_allclose(getattr(arrays, base), HAND_EXPECTED[base], rtol=0, atol=1e-12)
    scalar = [getattr(c, base) for c in HAND]
    np.testing.assert_allclose(scalar, HAND_EXPECTED[base], rtol=0, atol=1e-12)


def test_summary_of_hand_example():
    s = summarize(HAND)
    assert s["requests"] == 3
    assert s["output_tokens"] == 17
    assert s["prompt_tokens"] == 30
    assert s["preemptions"] == 3
    assert s["recomputed_tokens"] == 10
    # Window: first arrival 0 -> last finish 12.5.
    assert s["duration_s"] == pytest.approx(12.5)
    assert s["throughput_tok_s"] == pytest.approx(17 / 12.5)
    assert s["throughput_req_s"] == pytest.approx(3 / 12.5)
    # TTLT {2, 6, 10.5}: median 6; mean 18.5/3.
    assert s["ttlt_p50"] == pytest.approx(6.0)
    assert s["ttlt_mean"] == pytest.approx(18.5 / 3)
    # P90 by linear interpolation: rank 0.9*2 = 1.8 -> 6 + 0.8*(10.5-6) = 9.6.
    assert s["ttlt_p90"] == pytest.approx(9.6)
    assert s["ttlt_p99_p50"] == pytest.approx((6 + 0.98 * 4.5) / 6.0)
    assert s["queue_p50"] == pytest.approx(0.5)


def test_explicit_duration_sets_throughput():
    s = summarize(HAND, duration_s=34.0)
    assert s["throughput_tok_s"] == pytest.approx(0.5)
    assert s["throughput_req_s"] == pytest.approx(3 / 34)
    assert s["duration_s"] == 34.0
    with pytest.raises(ValueError):
        summarize(HAND, duration_s=0.0)


def test_tbt_excludes_single_token_requests():
    s = summarize(HAND)
    # Only r0 and r2 have a TBT, both exactly 1.0; r1's (undefined) must not pull it to NaN
    # or to 0.
    for suffix in STAT_SUFFIXES:
        assert s[f"tbt_{suffix}"] == pytest.approx(1.0), suffix
    # Even with a gap between first token and finish, one token has no inter-token gap.
    late_finish = make(9, 0.0, 0.0, 1.0, 1.5, 1)
    assert math.isnan(late_finish.tbt) and math.isnan(to_arrays([late_finish]).tbt[0])
    only_single = summarize([HAND[1]])
    assert math.isnan(only_single["tbt_p50"]) and math.isnan(only_single["tbt_mean"])
    assert only_single["ttft_p50"] == pytest.approx(2.0)


def test_summarize_matches_numpy_on_raw_fields():
    cs = random_completions(500, seed=3)
    arrival = np.array([c.arrival for c in cs])
    first = np.array([c.first_token_at for c in cs])
    finished = np.array([c.finished_at for c in cs])
    scheduled = np.array([c.scheduled_at for c in cs])
    out = np.array([c.output_tokens for c in cs], dtype=float)
    multi = out > 1
    raw = {
        "ttft": first - arrival,
        "ttlt": finished - arrival,
        "tbt": (finished[multi] - first[multi]) / (out[multi] - 1),
        "ptl": (finished - arrival) / out,
        "queue": scheduled - arrival,
    }
    s = summarize(cs)
    for base, values in raw.items():
        expected = np.percentile(values, QS)
        got = [s[f"{base}_{suffix}"] for suffix in SUFFIX_Q]
        np.testing.assert_allclose(got, expected, rtol=1e-12, err_msg=base)
        assert s[f"{base}_mean"] == pytest.approx(values.mean(), rel=1e-12)
    assert s["ttlt_p99_p50"] == pytest.approx(
        np.percentile(raw["ttlt"], 99) / np.percentile(raw["ttlt"], 50), rel=1e-12
    )


def test_summarize_accepts_arrays_and_lists_alike():
    cs = random_completions(50, seed=4)
    by_list = summarize(cs)
    by_arrays = summarize(to_arrays(cs))
    assert by_list.keys() == by_arrays.keys()
    for key in by_list:
        assert by_list[key] == pytest.approx(by_arrays[key], nan_ok=True), key


def test_percentiles_equal_numpy_bit_for_bit():
    # summarize uses its own partition + interpolation; it must equal np.percentile exactly.
    rng = np.random.default_rng(11)
    for n in (1, 2, 3, 7, 100, 1001):
        x = rng.lognormal(size=n)
        arrays = to_arrays([make(i, 0.0, 0.0, 0.0, float(v), 1) for i, v in enumerate(x)])
        s = summarize(arrays)
        got = np.array([s[f"ttlt_{suffix}"] for suffix in SUFFIX_Q])
        np.testing.assert_array_equal(got, np.percentile(x, QS), err_msg=f"n={n}")
        # The helper partitions a private copy: the caller's array is left as it was.
        before = x.copy()
        stats = distribution_stats(x)
        np.testing.assert_array_equal(x, before)
        assert stats["p99"] == np.percentile(x, 99)


def test_empty_input_gives_nan_not_crash():
    s = summarize([])
    for base in LATENCY_BASES:
        for suffix in STAT_SUFFIXES:
            assert math.isnan(s[f"{base}_{suffix}"])
    for key in ("throughput_tok_s", "throughput_req_s", "ttlt_p99_p50", "duration_s"):
        assert math.isnan(s[key])
    assert s["requests"] == 0 and s["output_tokens"] == 0 and s["preemptions"] == 0
    assert summarize_by([]) == {}
    assert math.isnan(jain_index([]))
    assert np.isnan(slo_attainment([], 1.0, [0.5, 1.0])).all()
    assert math.isnan(tightest_slo_scale([], 1.0))
    assert math.isnan(WindowedPercentiles(4).percentiles()["p99"])
    assert math.isnan(summarize([], slo={"ttft": 1.0})["ttft_slo_scale_99"])


def test_completion_arrays_validates_columns():
    a = to_arrays(HAND)
    assert to_arrays(a) is a
    assert len(a) == 3 and a.output_tokens.dtype == np.int64 and a.tenant.dtype.kind == "U"
    cols = {name: getattr(a, name) for name in a.__dataclass_fields__}
    cols["arrival"] = cols["arrival"][:2]
    with pytest.raises(ValueError):
        CompletionArrays(**cols)
    assert len(CompletionArrays.empty()) == 0


# ---------------------------------------------------------------- metric table


def test_every_summary_key_is_a_known_metric():
    keys = summarize(HAND, slo={base: 1.0 for base in LATENCY_BASES}).keys()
    unknown = [k for k in keys if k not in METRICS]
    assert unknown == []
    for key in (
        "ttft_p999",
        "ttlt_p99",
        "tbt_mean",
        "ptl_p50",
        "queue_p95",
        "throughput_tok_s",
        "throughput_req_s",
        "ttlt_p99_p50",
        "recomputed_tokens",
    ):
        assert key in keys


def test_metric_directions_and_units():
    assert metric_direction("ttlt_p99") == "minimize"
    assert metric_direction("throughput_tok_s") == "maximize"
    assert metric_direction("throughput") == "maximize"  # docs/engine.md#tuner alias
    assert metric_direction("slo_scale_99") == "minimize"
    assert metric_direction("jain_index") == "maximize"
    assert metric_direction("preemptions") == "minimize"
    assert METRICS["ttft_p95"].unit == "s"
    assert METRICS["ptl_mean"].unit == "s/token"
    description, unit, better_high = METRICS["throughput_req_s"]  # plain tuple unpacking
    assert unit == "req/s" and better_high is True and description


def test_unknown_metric_lists_valid_names():
    with pytest.raises(ValueError) as err:
        validate_metric("ttlt_p98")
    assert "ttlt_p99" in str(err.value) and "throughput" in str(err.value)
    with pytest.raises(KeyError):
        metric_direction("nope")
    assert isinstance(UnknownMetricError("x"), KeyError)
    for alias, target in METRIC_ALIASES.items():
        assert validate_metric(alias) == target and target in METRICS


def test_metric_value_resolves_aliases_and_explains_missing_slo_keys():
    s = summarize(HAND)
    assert metric_value(s, "throughput") == s["throughput_tok_s"]
    with pytest.raises(KeyError, match="slo="):
        metric_value(s, "ttft_slo_scale_99")


def test_percent_change_lower_is_better():
    assert percent_change(80.0, 100.0, "ttlt_p99") == pytest.approx(20.0)
    assert percent_change(120.0, 100.0, "ttlt_p99") == pytest.approx(-20.0)
    assert percent_change(3.0, 2.0, "preemptions") == pytest.approx(-50.0)


def test_percent_change_higher_is_better():
    assert percent_change(110.0, 100.0, "throughput_tok_s") == pytest.approx(10.0)
    assert percent_change(90.0, 100.0, "throughput") == pytest.approx(-10.0)
    assert percent_change(0.5, 1.0, "jain_index") == pytest.approx(-50.0)


def test_percent_change_edge_cases():
    assert percent_change(5.0, 5.0, "ttft_p50") == 0.0
    assert percent_change(0.0, 0.0, "ttft_p50") == 0.0
    assert math.isnan(percent_change(1.0, 0.0, "ttft_p50"))
    assert math.isnan(percent_change(math.nan, 1.0, "ttft_p50"))
    with pytest.raises(ValueError):
        percent_change(1.0, 2.0, "latency")


# ---------------------------------------------------------------- grouping


def test_summarize_by_tenant_uses_the_common_window():
    cs = random_completions(300, seed=5)
    groups = summarize_by(cs, "tenant")
    assert list(groups) == ["a", "b", "c"]
    total = summarize(cs)
    # Same window for every group, so group throughputs add up to the total.
    assert sum(g["throughput_tok_s"] for g in groups.values()) == pytest.approx(
        total["throughput_tok_s"]
    )
    assert sum(g["requests"] for g in groups.values()) == total["requests"]
    subset = [c for c in cs if c.tenant == "b"]
    alone = summarize(subset, duration_s=total["duration_s"])
    for key, value in alone.items():
        assert groups["b"][key] == pytest.approx(value, nan_ok=True), key


def test_summarize_by_type():
    groups = summarize_by(HAND, key="type")
    assert set(groups) == {"chat", "batch"}
    assert groups["batch"]["requests"] == 1
    assert groups["chat"]["ttft_p50"] == pytest.approx((2.0 + 0.5) / 2)
    with pytest.raises(ValueError):
        summarize_by(HAND, key="model")


# ---------------------------------------------------------------- fairness


def test_jain_equal_one_hot_and_known():
    assert jain_index([3.0, 3.0, 3.0, 3.0]) == pytest.approx(1.0)
    assert jain_index([0.0, 0.0, 5.0, 0.0]) == pytest.approx(0.25)
    # (1+2+3)^2 / (3 * (1+4+9)) = 36 / 42
    assert jain_index([1.0, 2.0, 3.0]) == pytest.approx(36 / 42)
    assert jain_index([2.0, 4.0, 6.0]) == pytest.approx(36 / 42)  # scale invariant
    assert math.isnan(jain_index([0.0, 0.0]))
    with pytest.raises(ValueError):
        jain_index([1.0, -1.0])


def test_normalised_throughput_and_weights():
    # Tenant a has twice b's weight and twice its throughput: perfectly fair.
    per_tenant = {"a": {"throughput_tok_s": 200.0}, "b": {"throughput_tok_s": 100.0}}
    assert tenant_jain_index(per_tenant, {"a": 2.0, "b": 1.0}) == pytest.approx(1.0)
    # Unweighted it is not: (300)^2 / (2 * 50000) = 0.9.
    assert tenant_jain_index(per_tenant) == pytest.approx(0.9)
    # A weighted tenant with no completions at all counts as starved (0), not as absent.
    norm = normalised_throughput({"a": 100.0}, {"a": 1.0, "c": 1.0})
    assert norm == {"a": 100.0, "c": 0.0}
    assert tenant_jain_index({"a": {"throughput_tok_s": 100.0}}, {"c": 1.0}) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        normalised_throughput({"a": 1.0}, {"a": 0.0})


def test_slo_compliance_ratio_two_tenants_one_violating():
    per_tenant = {
        "acme": {"ttft_p50": 0.2, "ttft_p99": 0.9},
        "beta": {"ttft_p50": 0.3, "ttft_p99": 1.4},  # violates P99
    }
    slos = {"ttft_p50": 0.5, "ttft_p99": 1.0}
    assert slo_compliance(per_tenant, slos) == {"acme": True, "beta": False}
    assert slo_compliance_ratio(per_tenant, slos) == pytest.approx(0.5)
    # One quantile failing is enough (product, not mean): beta meets P50 but not P99.
    assert slo_compliance_ratio(per_tenant, {"ttft_p99": 2.0}) == pytest.approx(1.0)
    # Per-tenant SLO override (seed 003's per-tenant vectors).
    assert slo_compliance_ratio(
        per_tenant, slos, tenant_slos={"beta": {"ttft_p99": 1.5}}
    ) == pytest.approx(1.0)
    # Higher-is-better metrics must be >= their limit.
    assert slo_compliance({"x": {"throughput_tok_s": 10.0}}, {"throughput": 20.0}) == {"x": False}
    # No data for a quantile is not compliance.
    assert slo_compliance({"x": {"ttft_p99": math.nan}}, {"ttft_p99": 1.0}) == {"x": False}
    assert math.isnan(slo_compliance_ratio({}, slos))
    with pytest.raises(ValueError):
        slo_compliance_ratio(per_tenant, {"ttft_p98": 1.0})


def test_shares_and_type_share_ratio():
    got = shares(HAND, key="type")  # output tokens: chat 5+11, batch 1
    assert got == pytest.approx({"chat": 16 / 17, "batch": 1 / 17})
    assert shares(HAND, key="type", weight="requests") == pytest.approx(
        {"chat": 2 / 3, "batch": 1 / 3}
    )
    ratios = type_share_ratio(
        {"chat": 0.3, "batch": 0.7}, {"chat": 0.6, "batch": 0.2, "reasoning": 0.2}
    )
    assert ratios == pytest.approx({"chat": 0.5, "batch": 3.5, "reasoning": 0.0})
    assert math.isnan(type_share_ratio({"chat": 1.0}, {"chat": 0.0})["chat"])


def test_fairness_summary_end_to_end():
    f = fairness_summary(
        HAND, slos={"ttft_p99": 1.99}, guaranteed_shares={"chat": 0.5, "batch": 0.5}
    )
    # Each tenant got all it asked for (nobody waits): nobody is suppressed, the acted-on JFI is 1
    # (docs/governance.md). The seed's literal index over served / committed (equal weights: each
    # tenant's committed rate is half the served rate) is the one implementation's, reported beside.
    assert f["jain_index"] == pytest.approx(1.0)
    assert f["jain_index_seed"] == pytest.approx(0.7794636556)
    # a: TTFT {2, 0.5} -> P99 = 1.985 <= 1.99; b: TTFT 2 > 1.99.
    assert f["slo_compliance_ratio"] == pytest.approx(0.5)
    # batch's guarantee is capped by its demand (1 token of 17 asked for): its share meets it.
    assert f["type_share_ratio_min"] == pytest.approx(1.0)


# ---------------------------------------------------------------- SLO attainment


@pytest.mark.parametrize("extra", [0, 40])  # a short grid and a long one (two code paths)
def test_attainment_curve_counts_and_monotone(extra):
    values = [0.1, 0.2, 0.2, 0.4, 1.0]
    scales = [0.25, 0.5, 1.0, 2.0, 5.0, *np.linspace(6.0, 9.0, extra)]
    curve = slo_attainment(values, 0.2, scales)
    # <= k*slo, inclusive: at k=1 the two values equal to the SLO count as met.
    np.testing.assert_allclose(curve[:5], [0.0, 0.2, 0.6, 0.8, 1.0])
    assert np.all(curve[5:] == 1.0)
    rng = np.random.default_rng(2)
    x = rng.lognormal(size=400)
    scales = np.linspace(0.01, 20, 300)
    c = slo_attainment(x, 1.3, scales)
    assert np.all(np.diff(c) >= 0) and c[0] >= 0 and c[-1] <= 1
    # Large and small grids take different code paths; they must agree.
    np.testing.assert_array_equal(c[:10], slo_attainment(x, 1.3, scales[:10]))


def test_attainment_excludes_undefined_values_and_takes_per_request_slos():
    assert slo_attainment([1.0, math.nan, 3.0], 2.0, 1.0) == pytest.approx(0.5)
    # Per-request SLO: each value over its own SLO: 1/2, 3/1 -> only the first meets 1x.
    assert slo_attainment([1.0, 3.0], np.array([2.0, 1.0]), 1.0) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        slo_attainment([1.0], 0.0, 1.0)


def test_tightest_slo_scale_exact_and_on_a_grid():
    values = np.arange(1, 101) / 100.0  # 0.01 .. 1.00
    slo = 0.5  # normalised values 0.02 .. 2.00
    k = tightest_slo_scale(values, slo, 0.99)
    assert k == pytest.approx(1.98)  # the 99th smallest of 100
    assert slo_attainment(values, slo, k) >= 0.99
    assert slo_attainment(values, slo, np.nextafter(k, 0)) < 0.99
    assert tightest_slo_scale(values, slo, 0.5) == pytest.approx(1.0)
    assert tightest_slo_scale(values, slo, 1.0) == pytest.approx(2.0)
    assert tightest_slo_scale(values, slo, 0.99, scales=[2.0, 1.0, 1.98, 1.5]) == 1.98
    assert tightest_slo_scale(values, slo, 0.99, scales=[1.0, 1.5]) == math.inf
    with pytest.raises(ValueError):
        tightest_slo_scale(values, slo, 0.0)


def test_summary_slo_keys():
    s = summarize(HAND, slo={"ttlt": 6.0})
    # TTLT {6, 2, 10.5} against 6 s: two of three meet it; 99% needs 10.5/6 = 1.75x.
    assert s["ttlt_slo_attainment"] == pytest.approx(2 / 3)
    assert s["ttlt_slo_scale_99"] == pytest.approx(1.75)
    assert metric_value(s, "slo_scale_99") == pytest.approx(1.75)
    with pytest.raises(ValueError):
        summarize(HAND, slo={"latency": 1.0})


@given(
    st.lists(st.floats(0.01, 100.0), min_size=1, max_size=200),
    st.floats(0.05, 1.0),
    st.floats(0.1, 10.0),
)
@settings(max_examples=150, deadline=None)
def test_tightest_scale_is_the_least_scale_reaching_target(values, target, slo):
    k = tightest_slo_scale(values, slo, target)
    assert slo_attainment(values, slo, k) >= target
    assert slo_attainment(values, slo, np.nextafter(k, 0)) < target


# ---------------------------------------------------------------- properties


latencies = st.lists(
    st.tuples(
        st.floats(0.0, 50.0), st.floats(0.0, 50.0), st.floats(0.0, 1e4), st.integers(1, 2000)
    ),
    min_size=1,
    max_size=120,
)


@given(latencies)
@settings(max_examples=200, deadline=None)
def test_summary_percentiles_are_monotone_and_within_range(rows):
    cs = [make(i, 0.0, q, q + f, q + f + d, n) for i, (q, f, d, n) in enumerate(rows)]
    s = summarize(cs)
    for base in LATENCY_BASES:
        values = np.array([getattr(c, base) for c in cs], dtype=float)
        values = values[np.isfinite(values)]
        ps = [s[f"{base}_{suffix}"] for suffix in ("p50", "p90", "p95", "p99", "p999")]
        if values.size == 0:
            assert all(math.isnan(p) for p in ps)
            continue
        assert ps == sorted(ps), (base, ps)
        assert values.min() <= ps[0] and ps[-1] <= values.max(), (base, ps)


# ---------------------------------------------------------------- windowed percentiles


def test_windowed_percentiles_after_wraparound():
    w = WindowedPercentiles(100)
    rng = np.random.default_rng(7)
    stream = rng.exponential(size=357)
    for v in stream:
        w.add(float(v))
    last = stream[-100:]
    assert len(w) == 100 and w.total_seen == 357
    np.testing.assert_array_equal(w.values(), last)
    got = w.percentiles()
    assert list(got) == ["p50", "p90", "p95", "p99"]
    np.testing.assert_allclose(
        list(got.values()), np.percentile(last, [50, 90, 95, 99]), rtol=1e-12
    )
    assert w.percentile(99.9) == pytest.approx(np.percentile(last, 99.9))


def test_windowed_before_full_and_invalid_values():
    w = WindowedPercentiles(10)
    w.extend([3.0, math.nan, 1.0, math.inf, 2.0])  # non-finite values are dropped
    w.add(math.nan)
    assert len(w) == 3
    np.testing.assert_array_equal(w.values(), [3.0, 1.0, 2.0])
    assert w.percentile(50) == 2.0
    w.clear()
    assert len(w) == 0 and math.isnan(w.percentile(50))
    with pytest.raises(ValueError):
        WindowedPercentiles(0)


@given(st.integers(1, 40), st.lists(st.lists(st.floats(-1e6, 1e6), max_size=60), max_size=12))
@settings(max_examples=200, deadline=None)
def test_windowed_extend_matches_last_n(capacity, chunks):
    w = WindowedPercentiles(capacity)
    everything: list[float] = []
    for chunk in chunks:
        if len(chunk) == 1:
            w.add(chunk[0])  # mix single adds with bulk extends
        else:
            w.extend(chunk)
        everything.extend(chunk)
    last = np.array(everything[-capacity:]) if everything else np.array([])
    np.testing.assert_array_equal(w.values(), last)
    if last.size:
        got = w.percentiles((50, 90, 99))
        np.testing.assert_allclose(
            list(got.values()), np.percentile(last, [50, 90, 99]), rtol=1e-12, atol=1e-9
        )

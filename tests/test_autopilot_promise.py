"""The autopilot's promise (issue 32): every quantile, the tenants' SLOs, held-back requests
charged before the drain shows them, and overload answered without a gamble."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
from autopilot_support import figures
from pydantic import ValidationError

from scheduler.metrics import summarize
from scheduler.settings import Settings, SloFqParams
from sim import traces
from sim.engine import EngineConfig, simulate
from tuner.autopilot.candidates import axis_rank
from tuner.autopilot.controller import AutopilotConfig, candidates
from tuner.autopilot.promise import (
    QUANTILE_NAMES,
    QUANTILES,
    Promise,
    breaks,
    judge,
    margin,
    most_margin,
    sampling_slack,
)
from tuner.autopilot.replay import replay_with_autopilot
from tuner.autopilot.shadows import Shadow, Window

REPO = Path(__file__).resolve().parent.parent
CONFIG = AutopilotConfig(
    gammas=(0.001, 0.01, 0.1, 1.0), interval_s=30.0, delay_s=30.0, window_s=600.0, min_requests=50
)
ALL = (*QUANTILE_NAMES, "throughput_tok_s")


def ratios(completions, reference) -> dict[str, float]:
    mine, ref = summarize(completions), summarize(reference)
    return {k: mine[k] / ref[k] for k in ALL}


def fixed(trace, doc) -> dict[str, float]:
    return summarize(simulate(trace, Settings.model_validate(doc)).completions)


# --- the promise itself -----------------------------------------------------------------------
def test_every_quantile_and_throughput_is_held_to_the_reference():
    promise, ref = Promise(), figures()
    assert breaks(promise, figures(), ref) == ()
    assert breaks(promise, figures(ttft_p95=1.02), ref) == ()  # within the 2% slack
    for name in QUANTILE_NAMES:  # each quantile on its own breaks it
        assert breaks(promise, figures(**{name: 1.03}), ref) == (name,)
    assert breaks(promise, figures(throughput_tok_s=98.0), ref) == ("throughput",)
    assert breaks(promise, figures(ttft_p99=1.03), ref, loosen=0.02) == ()
    assert "every quantile" in promise.describe()


def test_the_stress_test_holds_a_move_to_the_running_choices_line():
    """A stress test is a forecast: a candidate 3.5% behind the reference's P99 TTFT under it
    (``diurnal``'s γ 1 at its peak, README) keeps the promise with the default ``stress_slack``
    (the running choice's ``GUARD_SLACK``) and breaks it at a newcomer's line; 5% behind breaks it
    either way, and with tenants' SLOs the verdict is theirs (SCR), not the quantiles'."""
    from tuner.autopilot.config import GUARD_SLACK
    from tuner.autopilot.stress import stress_verdict

    assert AutopilotConfig().stress_slack == GUARD_SLACK
    pair = {"sarathi": figures(), "gamma=1": figures(ttft_p99=1.035)}
    assert stress_verdict(AutopilotConfig(), pair, "sarathi", "gamma=1") == ()
    strict = AutopilotConfig(stress_slack=0.0)
    assert stress_verdict(strict, pair, "sarathi", "gamma=1") == ("stress:ttft_p99",)
    worse = {**pair, "gamma=1": figures(ttft_p99=1.05)}
    assert stress_verdict(AutopilotConfig(), worse, "sarathi", "gamma=1") == ("stress:ttft_p99",)
    slo = AutopilotConfig(promise=Promise(slo=SloFqParams()))
    tenants = {"sarathi": figures(scr=1.0), "gamma=1": figures(ttft_p99=2.0, scr=1.0)}
    assert stress_verdict(slo, tenants, "sarathi", "gamma=1") == ()
    tenants["gamma=1"] = figures(scr=0.5)
    assert stress_verdict(slo, tenants, "sarathi", "gamma=1") == ("stress:scr",)


def test_a_window_of_few_requests_is_given_its_sampling_noise():
    few, many = sampling_slack(500, 0.1), sampling_slack(50_000, 0.1)
    assert few["ttft_p99"] > few["ttft_p95"] > few["ttft_p50"] > 0
    assert many["ttft_p99"] < few["ttft_p99"] / 5


def test_promise_errors_name_the_field():
    with pytest.raises(ValidationError, match=r"promise\.slack"):
        AutopilotConfig.model_validate({"promise": {"slack": 2.0}})
    with pytest.raises(ValidationError, match=r"promise\.objective"):
        AutopilotConfig.model_validate({"promise": {"objective": "ttft_p42"}})


def test_with_slos_the_promise_is_scr_then_jfi():
    slo = SloFqParams.model_validate({"tenants": {"a": {"ttft": {"p99": 5.0}}}})
    promise = Promise(slo=slo)
    ranked = judge(
        promise,
        {
            "sarathi": figures(scr=0.5, jfi=0.9),
            "slofq": figures(scr=1.0, jfi=0.95),
            "x": figures(scr=1.0, jfi=0.99, ttft_p95=9.0),
            "y": figures(scr=0.5, jfi=0.99),
        },
        "sarathi",
        ("sarathi", "defaults", "slofq"),
    )
    assert ranked["x"].feasible and ranked["slofq"].feasible
    assert not ranked["y"].feasible and ranked["y"].broken == ("scr",)
    assert "SLOs" in promise.describe()


def test_a_p95_tie_goes_to_the_most_margin_on_every_quantile():
    """Candidates tied on the objective can differ on the rest: the tie goes to the one furthest
    inside the promise over all its quantiles (within a step they stay tied, for the axis rule)."""
    ref = figures()
    tied = {
        "gamma=0.464": figures(ttft_p95=0.80, ttft_p99=0.82),
        "gamma=0.001": figures(ttft_p95=0.80, ttft_p99=0.77),
        "gamma=0.002": figures(ttft_p95=0.80, ttft_p99=0.771),
    }
    assert margin(ref, ref) == pytest.approx(1.0)
    assert margin(tied["gamma=0.001"], ref) < margin(tied["gamma=0.464"], ref) < 1.0
    names = list(tied)
    assert most_margin(names, tied, ref, step=0.01) == ["gamma=0.001", "gamma=0.002"]
    assert most_margin(names, tied, ref, step=0.5) == names  # all within one step


def test_with_slos_a_tie_on_the_objective_is_broken_by_margin():
    """The axis rule alone takes the most age-first of P95-tied candidates (γ 1 here); with SLOs
    declared the tie goes to the most margin (γ 0.001, its P99 TTFT 0.77 of sarathi's); the
    ``margin_ties`` knob says when."""
    from tuner.autopilot.controller import Autopilot

    slo = SloFqParams.model_validate({"tenants": {"a": {"ttft": {"p99": 5.0}}}})
    base = Settings.model_validate({"policy": "uniboost"})
    scored = {
        "sarathi": figures(scr=1.0, jfi=1.0),
        "defaults": figures(ttft_p95=0.95, scr=1.0, jfi=1.0),
        "gamma=1": figures(ttft_p95=0.80, ttft_p99=0.82, scr=1.0, jfi=1.0),
        "gamma=0.001": figures(ttft_p95=0.80, ttft_p99=0.77, scr=1.0, jfi=1.0),
    }
    picks = {}
    for ties in ("slo", "never", "always"):
        for slos in (slo, None):
            config = CONFIG.model_copy(update={"promise": Promise(slo=slos), "margin_ties": ties})
            pilot = Autopilot(base, config)
            picks[ties, slos is not None] = pilot.rule.target_among(
                list(scored), scored, pilot.current
            )
    assert picks["slo", True] == "gamma=0.001" and picks["slo", False] == "gamma=1"
    assert picks["never", True] == picks["never", False] == "gamma=1"
    assert picks["always", True] == picks["always", False] == "gamma=0.001"


# --- projection -------------------------------------------------------------------------------
def test_a_projection_charges_held_back_requests_and_leaves_the_shadow_as_it_was():
    """A small γ's shadow holds long prompts back: projected, each unfinished request finishes
    no earlier than the clock (its wait so far and more), and running the shadow on afterwards
    gives exactly what it gives without the projection."""
    trace = traces.scale_rate(traces.load_bundled(), 2.0)
    small = Settings.model_validate(
        {"policy": "uniboost", "params": {"gamma": 0.001, "gamma_ada": False}}
    )
    reqs = sorted(trace, key=lambda r: (r.arrival, r.id))
    half = [r for r in reqs if r.arrival <= 240.0]
    rest = [r for r in reqs if r.arrival > 240.0]
    a, b = Shadow(small, EngineConfig()), Shadow(small, EngineConfig())
    a.advance(half, 240.0)
    b.advance(half, 240.0)
    pending = {r.id for r in half if r.id not in a.done}
    assert len(pending) > 20 and a.busy()
    projection = a.project(pending, 1_800.0)
    ends = [t for t in projection.finished_at.values() if t is not None]
    assert len(ends) == len(pending) and min(ends) >= 240.0
    assert projection.drained_at is not None and projection.drained_at >= max(ends)
    a.advance(rest, 1e6)
    b.advance(rest, 1e6)
    assert a.done == b.done


def test_a_forecast_only_adds_arrivals_after_the_clock():
    trace = traces.scale_rate(traces.load_bundled(), 2.0)
    reqs = sorted(trace, key=lambda r: (r.arrival, r.id))
    shadow = Shadow(Settings.model_validate({"policy": "sarathi"}), EngineConfig())
    shadow.advance([r for r in reqs if r.arrival <= 240.0], 240.0)
    pending = {rid for rid in (r.id for r in reqs if r.arrival <= 240.0) if rid not in shadow.done}
    calm = shadow.project(pending, 1_800.0)
    busy = shadow.project(pending, 1_800.0, [r for r in reqs if 240.0 < r.arrival <= 480.0])
    # More traffic only delays what was pending (later arrivals share the batch's steps) …
    later = [
        busy.finished_at[rid] - calm.finished_at[rid]  # type: ignore[operator]
        for rid in pending
        if calm.finished_at[rid] is not None and busy.finished_at[rid] is not None
    ]
    assert later and min(later) > -1e-6 and max(later) > 0.0
    # … and the queue empties later.
    assert busy.drained_at is None or busy.drained_at > (calm.drained_at or 0.0)


def test_a_windows_figures_read_from_the_log_are_those_of_each_request_looked_up():
    """A shadow's figures read its log's rows as array slices (``ServedLog``); they are what a
    request-by-request lookup of ``done`` gives — the window forgotten at its start (the log
    compacted), a forecast after it, and a window that is not a run of consecutive requests."""
    trace = traces.scale_rate(traces.load_bundled(), 2.0)
    reqs = sorted(trace, key=lambda r: (r.arrival, r.id))
    shadow = Shadow(Settings.model_validate({"policy": "sarathi"}), EngineConfig())
    before = -math.inf
    for t in (120.0, 240.0, 360.0):
        shadow.advance([r for r in reqs if before < r.arrival <= t], t)
        before = t
    gone = [r.id for r in reqs if r.arrival <= 150.0]
    shadow.forget(gone)
    assert shadow.log.base == len(gone)  # half the log or more: its leading rows were freed
    kept = [r for r in reqs if 150.0 < r.arrival <= 360.0]
    ids = [r.id for r in kept]
    for chosen in (ids, ids[::-1], ids[::3]):
        served = shadow.log.read(chosen)
        assert served.done.tolist() == [rid in shadow.done for rid in chosen]
        done = [shadow.done[rid] for rid in chosen if rid in shadow.done]
        assert served.ttft[served.done].tolist() == [d.ttft for d in done]
        assert served.tokens[served.done].tolist() == [d.output_tokens for d in done]
        assert np.isnan(served.ttlt[~served.done]).all()
    arrivals = np.array([r.arrival for r in kept])
    window = Window.over(360.0, ids, arrivals, 210.0, {})
    forecast = [dataclasses.replace(r, id=f"{r.id}~1", arrival=r.arrival + 210.0) for r in kept]
    for w in (window, window.with_forecast(forecast)):
        got, projection = shadow.figures(w, 600.0)
        ttft, ttlt = [], []
        for rid, arrival in zip(w.ids, w.arrivals, strict=True):
            if rid in shadow.done:
                ttft.append(shadow.done[rid].ttft)
                ttlt.append(shadow.done[rid].ttlt)
                continue
            first, end = projection.first_token_at[rid], projection.finished_at[rid]
            ttft.append((first if first is not None else 960.0) - arrival)
            ttlt.append((end if end is not None else 960.0) - arrival)
        tokens = sum(shadow.done[r].output_tokens for r in ids if r in shadow.done)
        assert got.projected == sum(rid not in shadow.done for rid in w.ids) > 0
        assert got.throughput_tok_s == tokens / 210.0
        for name, family, q in QUANTILES:
            assert got.value(name) == float(np.percentile(ttft if family == "ttft" else ttlt, q))


def test_the_stress_test_runs_only_for_a_move_that_would_be_taken():
    """A move down the axis takes the stress test; it is run only when the move would be taken
    without it — a target that neither beats the running choice by ``down_margin`` nor by the
    hysteresis after ``min_dwell_s`` is kept out untested, the same decision either way."""
    from tuner.autopilot.controller import Autopilot
    from tuner.autopilot.switching import Situation

    pilot = Autopilot(Settings.model_validate({"policy": "uniboost"}), CONFIG)
    assert pilot.current == "defaults"
    tested: list[str] = []
    verdict: tuple[str, ...] = ()

    class Recorded:  # the decision's stress test, its verdicts recorded
        def breaks(self, name: str) -> tuple[str, ...]:
            tested.append(name)
            return verdict

    def choose(window):
        at = Situation(now=1_000.0, clock=0.0, current=pilot.current, stress=Recorded())
        choice = pilot.rule.choose(window, at)
        return choice.name, choice.switch, choice.reason

    scored = {"sarathi": figures(), "defaults": figures(ttft_p95=0.5)}
    close = {**scored, "gamma=0.1": figures(ttft_p95=0.48)}  # ahead, not by 5% (nor 15%)
    assert choose(close)[:2] == ("defaults", False)
    assert tested == []
    ahead = {**scored, "gamma=0.1": figures(ttft_p95=0.4)}  # by 20%: the move would be taken
    assert choose(ahead)[:2] == ("gamma=0.1", True)
    verdict = ("stress:ttft_p99",)
    choice, changed, reason = choose(ahead)
    assert (choice, changed) == ("defaults", False) and "stress:ttft_p99" in reason
    assert tested == ["gamma=0.1", "gamma=0.1"]


def test_a_choice_the_reference_beats_on_every_quantile_is_left_without_the_margin():
    """The defaults trailing sarathi by 1.5% on every quantile keep the promise within the
    guard's slack and no move up beats them by its margin; on ``guard_patience`` decisions in a
    row of that, the rule leaves them for sarathi. One quantile where they lead, or the rule off,
    and they are kept."""
    from tuner.autopilot.controller import Autopilot
    from tuner.autopilot.switching import Situation

    trailing = figures(**{q: 1.015 for q in QUANTILE_NAMES})
    window = {"sarathi": figures(), "defaults": trailing}

    def decisions(config: AutopilotConfig, scored) -> list[tuple[str, bool]]:
        pilot = Autopilot(Settings.model_validate({"policy": "uniboost"}), config)
        out = []
        for k in range(3):
            at = Situation(now=1_000.0 + 60.0 * k, clock=0.0, current=pilot.current)
            choice = pilot.rule.choose(scored, at)
            out.append((choice.name, choice.switch))
            if choice.switch:
                assert "every quantile" in choice.reason
                break
        return out

    assert CONFIG.guard_patience == 2
    assert decisions(CONFIG, window) == [("defaults", False), ("sarathi", True)]
    leads_p50 = {**window, "defaults": dataclasses.replace(trailing, ttft_p50=0.99)}
    assert decisions(CONFIG, leads_p50) == [("defaults", False)] * 3
    off = CONFIG.model_copy(update={"leave_dominated": False})
    assert decisions(off, window) == [("defaults", False)] * 3


def _choice_after_patience(config: AutopilotConfig, scored, **situation):
    """The rule's choice on ``guard_patience`` decisions in a row over the same ``scored``
    window, a minute apart, from the defaults (``situation``: more of ``Situation``'s fields),
    the window large enough that its sampling noise is well under any break tested here."""
    from tuner.autopilot.controller import Autopilot
    from tuner.autopilot.switching import Situation

    pilot = Autopilot(Settings.model_validate({"policy": "uniboost"}), config)
    for k in range(config.guard_patience):
        at = Situation(
            now=1_000.0 + 60.0 * k,
            clock=0.0,
            current=pilot.current,
            requests=100_000,
            **situation,
        )
        choice = pilot.rule.choose(scored, at)
    return choice


def test_a_move_up_to_leave_a_break_is_taken_only_if_switching_now_mends_it():
    """The defaults break P99 TTFT on the window and sarathi keeps the promise: on
    ``guard_patience`` decisions in a row the rule leaves for sarathi — unless the replica switched
    to it now breaks as many quantiles under the stress test as the replica kept (the queue a
    size-first choice left, served in age order, costs the medians; README, "Leaving a break").
    Fewer, or the mend test off, and the move is made."""
    raw = {"sarathi": figures(), "defaults": figures(ttft_p99=1.10)}
    scored = judge(CONFIG.promise, raw, "sarathi", ())
    asked: list[tuple[str, str]] = []

    class Mirror:  # the replica's mirror: what it would be switched to is recorded
        def __init__(self, name: str = "kept") -> None:
            self.name = name

        def spawn(self, settings: Settings) -> Mirror:
            return Mirror(settings.policy)

    def decide(verdicts, config=CONFIG) -> tuple[str, bool, str]:
        class Recorded:  # the decision's stress test: the mend verdicts given
            def mend_breaks(self, switched: Mirror, kept: Mirror):
                asked.append((switched.name, kept.name))
                return verdicts

        choice = _choice_after_patience(config, scored, stress=Recorded(), replica=Mirror)
        return choice.name, choice.switch, choice.reason

    as_much = (("stress:ttft_p50",), ("stress:ttft_p99",))
    name, switched, reason = decide(as_much)
    assert (name, switched) == ("defaults", False) and "would break as much" in reason, reason
    assert asked == [("sarathi", "kept")]
    assert decide(((), ("stress:ttft_p99",)))[:2] == ("sarathi", True)
    fewer = (("stress:ttft_p99",), ("stress:ttft_p99", "stress:ttft_p95"))
    assert decide(fewer)[:2] == ("sarathi", True)
    off = CONFIG.model_copy(update={"mend_test": False})
    asked.clear()
    assert decide(as_much, off)[:2] == ("sarathi", True) and asked == []


def test_the_running_choice_is_left_only_beyond_its_guard_slack():
    """The running choice 3% behind sarathi's P50 TTFT on the window (the promise's line is 2%):
    within ``guard_slack``'s 2% more it is kept; with none it is left for sarathi after
    ``guard_patience`` decisions in a row (README, "The guard's slack, tried at zero")."""
    raw = {"sarathi": figures(), "defaults": figures(ttft_p50=1.03)}
    scored = judge(CONFIG.promise, raw, "sarathi", ())

    def decide(config: AutopilotConfig) -> tuple[str, bool]:
        choice = _choice_after_patience(config, scored)
        return choice.name, choice.switch

    assert CONFIG.guard_slack == 0.02
    assert decide(CONFIG) == ("defaults", False)
    assert decide(CONFIG.model_copy(update={"guard_slack": 0.0})) == ("sarathi", True)


# --- the promise kept on replays ---------------------------------------------------------------
@pytest.fixture(scope="module")
def rising() -> traces.Trace:
    """The bundled window, its first half at its own rate and its second at 2.2×: the load rises
    while a small γ looks as good as any."""
    base = traces.load_bundled()
    cut = base.requests[0].arrival + 300.0
    first = [r for r in base if r.arrival < cut]
    second = traces.scale_rate(
        traces.Trace("second", tuple(r for r in base if r.arrival >= cut)), 2.2
    )
    offset = cut - second.requests[0].arrival
    moved = [dataclasses.replace(r, arrival=r.arrival + offset) for r in second]
    return traces.Trace("rising", tuple(first + moved))


@pytest.mark.slow
def test_every_quantile_is_kept_where_a_p95_only_choice_breaks_it(rising):
    """On this replay the candidate with the lowest whole-run P95 TTFT among those keeping P99
    TTLT (last round's rule) breaks P99 TTFT; the autopilot keeps every quantile within the
    promise's 2% of sarathi's, throughput too, and its P95 is no worse than the defaults' + 0.02."""
    sarathi = simulate(rising, Settings.model_validate({"policy": "sarathi"})).completions
    ref = summarize(sarathi)
    grid = {
        g: fixed(rising, {"policy": "uniboost", "params": {"gamma": g, "gamma_ada": False}})
        for g in CONFIG.gammas
    }
    naive = min(
        (g for g, m in grid.items() if m["ttlt_p99"] <= 1.02 * ref["ttlt_p99"]),
        key=lambda g: grid[g]["ttft_p95"],
    )
    assert any(grid[naive][q] > 1.02 * ref[q] for q in QUANTILE_NAMES), "the replay is not sharp"
    result, decisions = replay_with_autopilot(rising, config=CONFIG)
    got = ratios(result.completions, sarathi)
    for q in QUANTILE_NAMES:
        assert got[q] <= 1.02, (q, got)
    assert got["throughput_tok_s"] >= 0.99
    defaults = fixed(rising, {"policy": "uniboost"})
    assert got["ttft_p95"] <= defaults["ttft_p95"] / ref["ttft_p95"] + 0.02
    assert any(d.figures for d in decisions)


@pytest.mark.slow
def test_overload_is_answered_without_a_gamble():
    """Arrivals at three times what the replica serves: the reference's queue cannot empty within
    overload_drain_s, the decisions say so, none moves down the size-to-age axis meanwhile, and
    a choice below the defaults goes up to them."""
    heavy = traces.scale_rate(traces.load_bundled(), 3.0)
    config = CONFIG.model_copy(update={"overload_drain_s": 60.0})
    result, decisions = replay_with_autopilot(heavy, config=config)
    options = candidates(Settings.model_validate({"policy": "uniboost"}), config)

    def axis(name: str) -> float:
        s = options[name]
        if s.policy != "uniboost":
            return math.inf
        return 1e9 if s.params.gamma_ada else s.params.gamma

    flagged = [d for d in decisions if d.overload]
    assert flagged, "overload never recognised"
    for d in flagged:
        assert axis(d.choice) >= axis("defaults")
        if d.changed:
            assert axis(d.choice) >= axis(d.previous), d.reason
    sarathi = simulate(heavy, Settings.model_validate({"policy": "sarathi"})).completions
    defaults = fixed(heavy, {"policy": "uniboost"})
    got = ratios(result.completions, sarathi)
    assert got["ttft_p95"] <= defaults["ttft_p95"] / summarize(sarathi)["ttft_p95"] + 0.02


@pytest.mark.slow
def test_with_tenants_slos_declared_it_ranks_by_scr_and_offers_slofq():
    trace = traces.assign_tenants_zipf(traces.scale_rate(traces.load_bundled(), 1.5), 3, seed=1)
    slo = SloFqParams.model_validate(
        {
            "tenants": {
                "t0": {"weight": 2.0, "ttft": {"p50": 1.0, "p99": 10.0}},
                "t1": {"ttft": {"p50": 0.5, "p99": 5.0}},
                "t2": {"ttlt": {"p99": 120.0}},
            }
        }
    )
    config = CONFIG.model_copy(update={"promise": Promise(slo=slo)})
    assert "slofq" in candidates(Settings.model_validate({"policy": "uniboost"}), config)
    _, decisions = replay_with_autopilot(trace, config=config)
    judged = [d for d in decisions if d.figures]
    assert judged
    for d in judged:
        assert all(f.scr is not None and f.jfi is not None for f in d.figures.values())
        feasible = [f for f in d.figures.values() if f.feasible]
        if feasible and d.changed:
            assert d.figures[d.choice].scr == max(f.scr for f in feasible)
    assert np.isfinite([d.figures["slofq"].scr for d in judged]).all()


def test_overload_is_judged_on_how_long_the_reference_needs_to_empty_its_queue():
    """``OverloadWatch``: "rising" once the reference's queue needs over ``overload_growth_s``
    to empty and longer than at the last decision; "sustained" over ``overload_drain_s`` (a
    projection that never empties it counts as forever), then held without a verdict for
    ``overload_recheck`` - 1 decisions; an idle reference is never overloaded."""
    from tuner.autopilot.overload import OverloadWatch

    config = AutopilotConfig(overload_drain_s=300.0, overload_growth_s=60.0, overload_recheck=3)
    watch = OverloadWatch(config)
    assert watch.horizon(600.0) == 300.0  # no further than sustained overload needs
    clock = 1_000.0
    assert watch.judge(True, clock + 90.0, clock) == ""  # over 60 s, but nothing to compare with
    assert watch.judge(True, clock + 120.0, clock) == "rising" and watch.rising
    assert watch.judge(True, clock + 110.0, clock) == "" and not watch.rising  # draining
    assert watch.judge(True, clock + 50.0, clock) == ""  # under 60 s, shorter still
    assert watch.judge(True, clock + 55.0, clock) == "" and watch.rising  # longer, under 60 s
    assert watch.judge(False, None, clock) == ""  # idle: nothing queued
    assert not watch.hold_this_decision()
    assert watch.judge(True, None, clock) == "sustained"  # not empty within the horizon
    assert [watch.hold_this_decision() for _ in range(3)] == [True, True, False]  # judged every 3rd
    assert watch.judge(True, clock + 30.0, clock) == "" and not watch.hold_this_decision()
    off = OverloadWatch(AutopilotConfig(overload_drain_s=None))
    assert off.judge(True, None, clock) == "" and off.horizon(600.0) == 600.0


def test_a_standing_queue_is_judged_on_the_references_recent_waits():
    """``OverloadWatch.standing``: the reference's median first-token wait over the last
    ``overload_standing_s`` of arrivals above ``overload_growth_s`` — not while that span is
    less than half covered by arrivals, nor with the check off; ``judge`` ranks it under
    sustained overload and over rising, and never for an idle reference."""
    from tuner.autopilot.overload import OverloadWatch

    config = AutopilotConfig(overload_standing_s=300.0, overload_growth_s=60.0)
    watch = OverloadWatch(config)
    clock = 1_000.0
    arrivals = np.linspace(600.0, 1_000.0, 401)  # one a second
    waits = np.where(arrivals >= clock - 300.0, 61.0, 0.0)  # the last 300 s waited 61 s
    assert watch.standing(arrivals, waits, clock)
    assert not watch.standing(arrivals, np.where(waits > 0, 59.0, 0.0), clock)
    # Half of the last 300 s waited: the median is the other half's.
    assert not watch.standing(arrivals, np.where(arrivals > clock - 150.0, 500.0, 0.0), clock)
    assert not watch.standing(arrivals[arrivals > clock - 140.0], waits[-140:], clock)  # too few
    assert not watch.standing(arrivals[:0], waits[:0], clock)
    off = OverloadWatch(AutopilotConfig(overload_standing_s=None))
    assert not off.standing(arrivals, waits, clock)
    assert watch.judge(True, clock + 90.0, clock, standing=True) == "standing"
    assert watch.judge(True, clock + 120.0, clock, standing=True) == "standing"  # not "rising"
    assert not watch.hold_this_decision()  # judged again at the next decision
    assert watch.judge(True, None, clock, standing=True) == "sustained"
    assert watch.judge(False, None, clock, standing=True) == ""  # idle now: nothing held back
    assert watch.judge(True, clock + 30.0, clock, standing=False) == ""


@pytest.mark.slow
def test_in_a_standing_queue_no_small_gamma_is_taken():
    """Variant 82 of the sweep (reasoning at 1.18x capacity, then 1.11x): sarathi's queue never
    empties, yet it drains in 3 minutes with no further arrival, so neither sustained nor rising
    overload is judged when γ 0.001 beats the defaults on the window at minute 21. Taken, it
    holds long prompts back 25 minutes: P99 TTFT 1.12x sarathi's over the run (the rule before
    the standing queue's; the test fails with ``overload_standing_s`` off). Judged standing, no
    move goes down from the defaults: they run throughout and every quantile is kept (in the
    regime it was found in: tests/found_regime.py)."""
    import found_regime as found

    from benchmarks import autopilot_sweep as sweep
    from benchmarks.seed_claims import ratio

    trace = found.sweep_variant(82, 20240)
    sarathi = found.fixed(trace, "sarathi")
    result, decisions = found.replay(trace)
    ap = sweep.score(result.completions, sweep.half_time(trace))["all"]
    assert sweep.broken_of(ap, sarathi) == [], {m: ratio(ap[m], sarathi[m]) for m in sweep.METRICS}
    assert any(d.overload == "standing" for d in decisions)
    assert all(d.choice == "defaults" for d in decisions)


@pytest.mark.slow
def test_in_a_standing_queue_a_choice_below_the_defaults_may_still_move_down():
    """Variant 27 of the sweep's seed 31337 (reasoning at 0.98x capacity, Gamma CV 3.5; a seed
    no design decision saw): γ 0.01 runs from minute 23 and the queue stands by minute 30. A
    standing queue barring every move down held it there: P99 TTFT 1.06x sarathi's. It bars only
    the way in from the defaults: γ 0.001 is taken and every quantile kept (0.93x; in the regime
    it was found in: tests/found_regime.py)."""
    import found_regime as found

    from benchmarks import autopilot_sweep as sweep
    from benchmarks.seed_claims import ratio

    trace = found.sweep_variant(27, 31337)
    sarathi = found.fixed(trace, "sarathi")
    result, decisions = found.replay(trace)
    ap = sweep.score(result.completions, sweep.half_time(trace))["all"]
    assert sweep.broken_of(ap, sarathi) == [], {m: ratio(ap[m], sarathi[m]) for m in sweep.METRICS}
    options = candidates(found.settings("uniboost"), AutopilotConfig())
    rank = {name: axis_rank(s) for name, s in options.items()}
    assert any(
        d.overload == "standing" and d.changed and rank[d.choice] < rank[d.previous]
        for d in decisions
    ), [(d.at, d.overload, d.previous, d.choice) for d in decisions if d.changed]


def test_in_rising_overload_the_running_choice_is_stress_tested_every_recheck_decisions():
    """``OverloadWatch.running_verdict``: in rising overload the running choice's stress test
    runs once every ``overload_recheck`` judged decisions, its verdict standing between; a new
    running choice, or a load that rises without overload, is tested at once."""
    from tuner.autopilot.overload import OverloadWatch

    watch = OverloadWatch(AutopilotConfig(overload_recheck=3))
    runs: list[str] = []

    def test(name: str, verdict: tuple[str, ...] = ()):
        return lambda: runs.append(name) or verdict

    got = []
    for k in range(7):
        got.append(watch.running_verdict("rising", "gamma=0.1", test("a", (f"v{k}",))))
        watch.count_rechecked("rising")
    assert runs == ["a", "a", "a"]  # decisions 0, 3, 6
    assert got == [("v0",)] * 3 + [("v3",)] * 3 + [("v6",)]
    assert watch.running_verdict("rising", "gamma=0.01", test("b")) == ()  # a new choice
    watch.count_rechecked("")
    assert watch.running_verdict("", "gamma=0.01", test("c")) == ()  # rising, not overloaded
    assert runs == ["a", "a", "a", "b", "c"]

"""A change of the traffic's shape (``tuner.autopilot.shape``): found from the prompt lengths of the
arrivals alone, near where it happened, never on a change of rate; after it the autopilot judges
its candidates on the requests of the new shape."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
from autopilot_support import figures

from sim import traces
from tuner.autopilot.controller import AutopilotConfig
from tuner.autopilot.feed import Feed
from tuner.autopilot.replay import replay_with_autopilot
from tuner.autopilot.shape import ShapeWatch
from tuner.autopilot.types import Arrival

CHANGE_AT = 1_200.0


def arrivals(rate_before: float, rate_after: float, median_after: float, seed: int = 3):
    """Poisson arrivals for 40 minutes with log-normal prompt lengths (median 1,000 tokens),
    the rate and the median changing at ``CHANGE_AT``: (arrival, prompt tokens) pairs."""
    rng = np.random.default_rng(seed)
    out, t = [], 0.0
    while t < 2 * CHANGE_AT:
        rate = rate_before if t < CHANGE_AT else rate_after
        t += rng.exponential(1.0 / rate)
        median = 1_000.0 if t < CHANGE_AT else median_after
        out.append((t, max(1, round(median * rng.lognormal(0.0, 0.8)))))
    return out


def watch_over(pairs, step_s: float = 60.0) -> tuple[ShapeWatch, list[float]]:
    """A watch fed ``pairs`` as a replica would report them, checked every ``step_s``: the watch
    and the times at which it found a change."""
    watch = ShapeWatch(threshold=0.4, recent_s=300.0, keep_s=3_600.0)
    found, fed = [], 0
    for now in np.arange(step_s, pairs[-1][0] + step_s, step_s):
        while fed < len(pairs) and pairs[fed][0] <= now:
            watch.add(*pairs[fed])
            fed += 1
        if watch.check(float(now)) is not None:
            found.append(float(now))
    return watch, found


def test_a_change_of_prompt_lengths_is_found_soon_and_placed_where_it_happened():
    watch, found = watch_over(arrivals(3.0, 3.0, median_after=200.0))
    assert len(found) == 1, found
    assert CHANGE_AT < found[0] <= CHANGE_AT + 240.0  # within four decisions
    assert abs(watch.since - CHANGE_AT) <= 30.0  # the split, not the decision's time


def test_a_change_of_rate_alone_is_not_a_change_of_shape():
    watch, found = watch_over(arrivals(2.0, 6.0, median_after=1_000.0))
    assert found == [] and watch.since == -np.inf


def test_reports_out_of_arrival_order_give_the_same_change():
    pairs = arrivals(3.0, 3.0, median_after=200.0)
    in_order, _ = watch_over(pairs)
    watch = ShapeWatch(threshold=0.4, recent_s=300.0, keep_s=3_600.0)
    fed = 0
    for now in np.arange(60.0, pairs[-1][0] + 60.0, 60.0):
        batch = []
        while fed < len(pairs) and pairs[fed][0] <= now:
            batch.append(pairs[fed])
            fed += 1
        for pair in reversed(batch):  # a live replica reports a request when it first sees it
            watch.add(*pair)
        watch.check(float(now))
    assert watch.changes == in_order.changes == [pytest.approx(CHANGE_AT, abs=30.0)]


def test_an_arrival_time_that_is_not_a_number_is_not_kept():
    watch = ShapeWatch(threshold=0.4, recent_s=300.0, keep_s=600.0)
    watch.add(float("nan"), 100)
    watch.add(float("inf"), 100)
    for t in range(0, 2_000, 2):
        watch.add(float(t), 100)
    watch.check(2_000.0)
    assert len(watch) <= 301  # the last 600 s only: nothing stuck at the front


def test_a_window_starts_at_the_latest_change_with_enough_requests_after_it():
    watch = ShapeWatch(threshold=0.4, recent_s=300.0, keep_s=3_600.0)
    watch.changes = [100.0, 500.0]
    window = np.arange(0.0, 560.0, 1.0)  # one arrival a second
    assert watch.start(window, min_requests=50) == 500.0
    assert watch.start(window, min_requests=100) == 100.0  # 60 since the last: the one before
    assert watch.start(window, min_requests=1_000) is None


@pytest.fixture(scope="module")
def shifted() -> traces.Trace:
    """The bundled Azure conv window at 1.5× its rate, then the same again with prompts a sixth
    as long: a change of shape at the second part's first arrival."""
    first = traces.scale_rate(traces.load_bundled(), 1.5)
    span = first.requests[-1].arrival + 1.0
    second = [
        replace(r, id=f"b-{r.id}", arrival=r.arrival + span, prompt_tokens=r.prompt_tokens // 6 + 1)
        for r in first.requests
    ]
    return traces.Trace("shifted", (*first.requests, *second))


CONFIG = AutopilotConfig(
    gammas=(0.001, 0.01, 0.1, 1.0),
    interval_s=30.0,
    delay_s=30.0,
    window_s=1_800.0,
    min_requests=200,
    shape_min_requests=200,
)


@pytest.mark.slow
def test_after_a_change_of_shape_the_candidates_are_judged_on_the_new_shape(shifted):
    change = min(r.arrival for r in shifted if r.id.startswith("b-"))
    _, decisions = replay_with_autopilot(shifted, config=CONFIG)
    judged = [d for d in decisions if d.figures]
    before = [d for d in judged if d.at < change]
    after = [d for d in judged if "since the change of shape" in d.reason]
    assert before and not any("change of shape" in d.reason for d in before)
    assert after, "the change of shape was never found"
    first = after[0]
    assert first.at <= change + 300.0
    # Judged on the new shape's requests only: those that arrived since the change point, up to
    # the shadows' clock — fewer than the window holds.
    clock = first.at - CONFIG.delay_s
    since = float(first.reason.rsplit("t=", 1)[1].rstrip("]"))
    assert abs(since - change) <= 30.0
    assert first.requests == sum(1 for r in shifted if since <= r.arrival <= clock)
    full = sum(1 for r in shifted if clock - CONFIG.window_s <= r.arrival <= clock)
    assert first.requests < full
    # Off, the same replay judges every decision on the whole window.
    off = CONFIG.model_copy(update={"shape_change": None})
    _, plain = replay_with_autopilot(shifted, config=off)
    assert not any("change of shape" in d.reason for d in plain)
    at_first = next(d for d in plain if d.at == first.at)
    assert at_first.requests == full


def test_a_quiet_replica_keeps_the_watch_bounded_while_nothing_is_judged():
    """Below ``min_requests`` in the window no decision reaches the watch's check: the feed trims
    it at every observation all the same (a replica at 0.5 req/s never fills a 3,000-request
    window, and kept every arrival it ever had)."""
    config = AutopilotConfig()
    feed = Feed(config)
    assert feed.shape is not None
    t = 0.0
    for i in range(40_000):
        t = 2.0 * i
        feed.arrive([Arrival(f"r{i}", t, 100 + i % 50, 256)])
        if i % 30 == 0:  # an observation a minute
            feed.take(t, {})
    kept_s = config.window_s + config.delay_s
    assert len(feed.shape) <= kept_s / 2.0 + 60  # an hour and a minute of arrivals, not 22 hours


def test_a_recent_span_as_long_as_what_is_kept_is_refused():
    with pytest.raises(ValueError, match="shape_recent_s"):
        AutopilotConfig(window_s=600.0, delay_s=60.0, shape_recent_s=660.0)
    AutopilotConfig(window_s=600.0, delay_s=60.0, shape_recent_s=600.0)
    # Left at its default under a short window (a test's, a demo's), the watch never fires.
    AutopilotConfig(window_s=60.0, delay_s=2.0)


class _FixedStress:
    """A decision's stress test with given verdicts (``tuner.autopilot.stress.StressTest``'s
    interface): the rule under test sees only what the forked shadows would report."""

    def __init__(self, figures, broken=(), arrivals=100):
        self.figures_by, self.broken, self.n, self.tested = figures, set(broken), arrivals, []

    def arrivals(self) -> int:
        return self.n

    def figures(self, name):
        self.tested.append(name)
        return self.figures_by[name]

    def breaks(self, name):
        if name == "sarathi":
            return ()
        self.tested.append(name)
        return ("stress:ttft_p99",) if name in self.broken else ()


def _pilot():
    from scheduler.settings import Settings
    from tuner.autopilot.controller import Autopilot

    return Autopilot(Settings.model_validate({"policy": "uniboost"}), CONFIG)


def _choose(pilot, stress, now=1_000.0, overload="", new_shape=True):
    """The switching rule's answer on ``WINDOW`` at ``now``, on a new shape's first requests
    (fewer than the running choice is judged on) with ``stress`` as the decision's stress test."""
    from tuner.autopilot.switching import Situation

    at = Situation(
        now=now,
        clock=0.0,
        current=pilot.current,
        overload=overload,
        requests=0,
        judge_requests=CONFIG.judge_requests,
        new_shape=new_shape,
        stress=stress,
    )
    choice = pilot.rule.choose(WINDOW, at)
    return choice.name, choice.switch, choice.reason


# A tie on the window, the reference in it too (1% apart).
WINDOW = {
    "sarathi": figures(ttft_p95=0.5),
    "defaults": figures(ttft_p95=0.5),
    "gamma=0.1": figures(ttft_p95=0.495),
    "gamma=1": figures(ttft_p95=0.497),
}


def test_on_a_new_shape_a_tie_is_broken_by_the_stress_test():
    """On a new shape's first requests every setting serves alike (they arrive on the queue the
    old shape left); the stress test — the last arrivals going on — shows the backlog each would
    build. A candidate tied with the running choice on the window is taken when it beats it by
    ``down_margin`` there; off a new shape, without that lead, breaking the promise under
    stress, in overload, after a step back or with nothing to repeat, the tie keeps the running
    choice (the rule before it)."""
    pilot = _pilot()
    assert pilot.current == "defaults"
    stress = {
        "sarathi": figures(),
        "defaults": figures(ttft_p95=0.9),
        "gamma=0.1": figures(ttft_p95=0.6),  # a third less backlog than the defaults'
        "gamma=1": figures(ttft_p95=0.95),
    }
    choice, changed, reason = _choose(pilot, fixed := _FixedStress(stress))
    assert (choice, changed) == ("gamma=0.1", True)
    assert "ties defaults" in reason and "0.6 s ttft_p95 vs 0.9 s" in reason
    assert "sarathi" not in fixed.tested  # tied on the window, but the reference is no choice

    def kept(new_shape=True, **change) -> bool:
        verdicts = _FixedStress(**{"figures": stress, **change})
        return _choose(pilot, verdicts, new_shape=new_shape)[:2] == ("defaults", False)

    assert kept(new_shape=False)  # an old shape: the window's tie keeps the running choice
    assert kept(figures={**stress, "gamma=0.1": figures(ttft_p95=0.88)})  # ahead, not by 5%
    assert kept(broken={"gamma=0.1"})  # far ahead, but it breaks the promise under stress
    assert kept(arrivals=0)  # nothing arrived lately: nothing to repeat
    fixed = _FixedStress(stress)
    assert _choose(pilot, fixed, overload="rising")[:2] == ("defaults", False)
    assert fixed.tested == []  # in overload no move goes down: the tie is not even re-judged
    pilot.rule.step_back(1_000.0, hold_s=1_000.0)  # stepped back: held
    assert kept()
    pilot.rule.hold_until = -math.inf
    # The running choice breaking the promise under stress is left for one that keeps it,
    # however close their objectives.
    close = {**stress, "gamma=0.1": figures(ttft_p95=0.89)}
    assert _choose(pilot, _FixedStress(close, broken={"defaults"}))[:2] == ("gamma=0.1", True)


def test_a_move_up_on_a_new_shape_takes_the_dwell_and_the_hysteresis():
    pilot = _pilot()
    pilot.current = "gamma=0.1"
    pilot.rule.switched(900.0)
    stress = {
        "sarathi": figures(),
        "defaults": figures(ttft_p95=0.95),
        "gamma=0.1": figures(ttft_p95=0.9),
        "gamma=1": figures(ttft_p95=0.72),  # 20% ahead under stress: above the running choice
    }
    assert _choose(pilot, _FixedStress(stress))[:2] == ("gamma=0.1", False)  # 100 s ago
    later = 900.0 + CONFIG.min_dwell_s
    assert _choose(pilot, _FixedStress(stress), now=later)[:2] == ("gamma=1", True)
    ahead = {**stress, "gamma=1": figures(ttft_p95=0.8)}  # 11%: a move down's margin, not up's
    assert _choose(pilot, _FixedStress(ahead), now=later)[:2] == ("gamma=0.1", False)


def test_only_a_new_shape_s_first_minutes_and_requests_are_judged_so():
    """The rule holds while fewer than ``judge_requests`` of the new shape are in and less than
    ``stress_s`` has passed since the change — never without a change, a stress test, or with
    tenants' SLOs declared."""
    from tuner.autopilot.controller import Autopilot
    from tuner.autopilot.promise import Promise

    pilot = _pilot()
    cfg = pilot.config
    since = 1_000.0
    assert pilot.rule.fresh_shape(since, cfg.judge_requests - 1, since + cfg.stress_s - 1)
    assert not pilot.rule.fresh_shape(None, 10, since + 60)
    assert not pilot.rule.fresh_shape(since, cfg.judge_requests, since + 60)
    assert not pilot.rule.fresh_shape(since, 10, since + cfg.stress_s)
    from scheduler.settings import Settings

    base = Settings.model_validate({"policy": "uniboost"})
    no_stress = Autopilot(base, CONFIG.model_copy(update={"stress_s": 0.0}))
    assert not no_stress.rule.fresh_shape(since, 10, since + 60)
    slo = Settings.model_validate(
        {"policy": "slofq", "params": {"tenants": {"t": {"ttft": {"p99": 5.0}}}}}
    ).params
    tenants = Autopilot(base, CONFIG.model_copy(update={"promise": Promise(slo=slo)}))
    assert not tenants.rule.fresh_shape(since, 10, since + 60)

"""The autopilot's other knobs and its search (issue 32, item 3): TIE's β, MemGuard's
quantization base and the policy are candidates; pins bound them; at most ``max_shadows`` run,
the laggards retired and the target's neighbours forked from a running shadow."""

from __future__ import annotations

import math

import pytest

from scheduler.settings import Settings
from scheduler.settings_change import SettingsChange
from sim import traces
from sim.engine import EngineConfig
from tuner.autopilot.candidates import SearchConfig, ShadowSearch, axis_rank, candidate_space
from tuner.autopilot.controller import Autopilot, AutopilotConfig
from tuner.autopilot.replay import replay_with_autopilot
from tuner.autopilot.shadows import Shadow

UNIBOOST = Settings.model_validate({"policy": "uniboost"})
CONFIG = AutopilotConfig(
    gammas=(0.001, 0.01, 0.1, 1.0),
    interval_s=30.0,
    delay_s=30.0,
    window_s=300.0,
    min_requests=50,
    max_shadows=5,
    prune_margin=0.02,
    prune_patience=2,
    probation_s=60.0,
    retry_s=120.0,
)


@pytest.fixture(scope="module")
def busy() -> traces.Trace:
    return traces.scale_rate(traces.load_bundled(), 2.0)


def test_the_space_holds_every_knob_with_fixed_values():
    space = AutopilotConfig(gammas=(0.001, 0.01, 0.1, 1.0, 10.0)).candidates(UNIBOOST)
    tie = space["tie:beta=0.5"].settings
    assert tie.policy == "tie" and tie.params.beta == tie.params.beta_min == tie.params.beta_max
    # MemGuard's other bases with the defaults and one γ a decade (every third grid point)
    variants = sorted(n for n, c in space.items() if not c.primary)
    assert variants == sorted(
        f"{p},quant={q}" for p in ("defaults", "gamma=0.001", "gamma=1") for q in (64, 1024)
    )
    v = space["gamma=1,quant=64"]
    assert v.variant_of == "gamma=1" and v.settings.params.quant_base_tokens == 64
    assert v.settings.params.gamma == 1.0 and v.rank == space["gamma=1"].rank
    assert all(c.selectable for c in space.values())


def test_tie_sits_on_the_axis_at_its_aging_rate():
    tie = Settings.model_validate({"policy": "tie", "params": {"decay": 0.9, "tau_s": 30.0}})
    assert axis_rank(tie) == pytest.approx(-math.log(0.9) / 30.0)
    assert axis_rank(UNIBOOST) > axis_rank(
        Settings.model_validate(
            {"policy": "uniboost", "params": {"gamma": 10.0, "gamma_ada": False}}
        )
    )
    assert axis_rank(Settings.model_validate({"policy": "sarathi"})) == math.inf


@pytest.mark.parametrize(
    "base,pinned_out",
    [
        # γ pinned: no other γ, no γ-Ada; other policies compared only
        (
            {
                "policy": "uniboost",
                "params": {"gamma": 0.3, "gamma_ada": False},
                "pinned": ["gamma"],
            },
            {"defaults", "gamma=0.001", "gamma=1"},
        ),
        # the quantization base pinned: no MemGuard variant
        ({"policy": "uniboost", "pinned": ["quant_base_tokens"]}, {"defaults,quant=64"}),
        # TIE's β pinned: TIE at its own β only
        ({"policy": "tie", "params": {"beta": 0.2}, "pinned": ["beta"]}, {"tie:beta=0.5"}),
    ],
)
def test_pins_bound_the_space(base, pinned_out):
    settings = Settings.model_validate(base)
    space = candidate_space(
        settings, gammas=(0.001, 0.01, 1.0), betas=(0.1, 0.5), quant_bases=(64,)
    )
    assert not pinned_out & set(space)
    for c in space.values():  # a pin forbids a change of policy: the rest is a reference
        assert c.selectable == (c.settings.policy == settings.policy)
        for name in settings.pinned:
            if c.selectable:
                assert getattr(c.settings.params, name) == settings.param(name)


def test_a_pinned_knob_is_never_chosen_away_on_a_replay(busy):
    base = Settings.model_validate(
        {"policy": "uniboost", "params": {"gamma": 0.1, "gamma_ada": False}, "pinned": ["gamma"]}
    )
    result, decisions = replay_with_autopilot(busy, base=base, config=CONFIG)
    assert decisions and {d.choice for d in decisions} == {"gamma=0.1"}
    assert len(result.completions) == len(busy)


def test_a_spawned_shadow_takes_over_the_engine_and_leaves_its_parent_alone(busy):
    engine = EngineConfig()
    requests = sorted(busy, key=lambda r: (r.arrival, r.id))
    first = [r for r in requests if r.arrival <= 200.0]
    later = [r for r in requests if 200.0 < r.arrival <= 300.0]
    parent = Shadow(Settings.model_validate({"policy": "sarathi"}), engine)
    parent.advance(first, 200.0)
    assert parent.busy()
    twin = parent.spawn(parent.sim.settings)  # same setting: the same future, step for step
    other = parent.spawn(
        SettingsChange(params={"gamma": 0.001, "gamma_ada": False}).apply(UNIBOOST)
    )
    assert twin.done == parent.done and twin.done is not parent.done
    for s in (parent, twin, other):
        s.advance(later, 300.0)
    assert twin.done == parent.done
    assert other.sim.settings.policy == "uniboost" and other.done != parent.done
    assert parent.sim.settings.policy == "sarathi"


class Recording(Autopilot):
    """The autopilot, recording after every observation how many shadows run and whether a
    switch went to a candidate on probation."""

    last: Recording | None = None

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.running: list[int] = []
        self.chosen_on_probation: list[str] = []
        self.in_overload: list[set[str]] = []  # the running shadows after each sustained decision
        Recording.last = self

    def observe(self, obs):
        decision = super().observe(obs)
        self.running.append(len(self.shadows))
        if decision is not None and decision.overload == "sustained":
            self.in_overload.append(set(self.shadows))
        if decision is not None and decision.changed:
            clock = self.feed.clock
            if clock is not None and self.search.on_probation(decision.choice, clock):
                self.chosen_on_probation.append(decision.choice)
        return decision


@pytest.mark.slow
def test_the_search_runs_at_most_max_shadows_and_explores_near_the_target(monkeypatch):
    import tuner.autopilot.replay

    monkeypatch.setattr(tuner.autopilot.replay, "Autopilot", Recording)
    busy = traces.scale_rate(traces.load_bundled(), 1.2)  # queues, no sustained overload
    result, decisions = replay_with_autopilot(busy, config=CONFIG)
    pilot = Recording.last
    assert pilot is not None and len(pilot.space) > CONFIG.max_shadows
    assert max(pilot.running) <= CONFIG.max_shadows
    assert all(len(d.figures) <= CONFIG.max_shadows for d in decisions)
    assert pilot.search.dropped > 0 and pilot.search.started > 0  # it retired and forked
    judged = {n for d in decisions for n in d.figures}
    assert len(judged) > CONFIG.max_shadows  # more candidates judged than ever ran at once
    assert not pilot.chosen_on_probation
    assert {"sarathi", "defaults", pilot.current} <= set(pilot.shadows)
    assert len(result.completions) == len(busy)


def test_with_no_limit_every_candidate_runs():
    pilot = Autopilot(UNIBOOST, CONFIG.model_copy(update={"max_shadows": 0}))
    assert set(pilot.shadows) == set(pilot.space)


def test_the_first_running_set_spreads_along_the_axis():
    space = AutopilotConfig().candidates(UNIBOOST)
    search = ShadowSearch(space, ["sarathi", "defaults"], SearchConfig(6, 0.25, 3, 900.0, 1800.0))
    first = search.initial("defaults")
    assert len(first) == 6 and first[:2] == ["sarathi", "defaults"]
    ranks = [space[n].rank for n in first[2:]]
    assert min(ranks) == min(c.rank for c in space.values())  # both ends of the axis
    assert max(ranks) == max(c.rank for c in space.values() if c.rank < 1e9)


def test_a_pools_shared_shadows_decide_as_a_replicas_own_would(busy):
    """A pool's members follow its first replica's controller (tuner.autopilot.live): on
    identical traffic that is exactly what each replica's own controller would have decided —
    the search's forks and retirements included."""
    from tuner.autopilot.types import Arrival, Observation

    requests = sorted(busy, key=lambda r: (r.arrival, r.id))
    pilots = [Autopilot(UNIBOOST, CONFIG) for _ in range(2)]
    decided: list[list[tuple]] = [[], []]
    t, i = 0.0, 0
    while t < requests[-1].arrival:
        t += 10.0
        new = []
        while i < len(requests) and requests[i].arrival <= t:
            r = requests[i]
            new.append(Arrival(r.id, r.arrival, r.prompt_tokens, r.max_tokens))
            i += 1
        for pilot, out in zip(pilots, decided, strict=True):
            d = pilot.observe(Observation(t, new))
            if d is not None:
                out.append((d.at, d.choice, d.changed, tuple(sorted(d.figures))))
    assert decided[0] == decided[1] and any(d[3] for d in decided[0])
    assert pilots[0].search.started == pilots[1].search.started


def test_sustained_overload_stops_the_explorers_and_they_come_back(busy, monkeypatch):
    """Nothing is compared in sustained overload: only the reference, the defaults and the
    running choice replay (deep queues are the costliest); after it, explorers are forked again.
    The burst is followed by four minutes of light traffic, so decisions go on once its queue has
    drained (ended with the burst, the last decision fell within seconds of the drain: a knife
    edge)."""
    import dataclasses

    import tuner.autopilot.replay

    light = traces.time_window(traces.scale_rate(traces.load_bundled(), 0.3), 0.0, 240.0)
    start = max(r.arrival for r in busy) + 60.0
    busy = traces.Trace(
        "busy-then-light",
        (
            *busy,
            *(dataclasses.replace(r, id=f"light-{r.id}", arrival=start + r.arrival) for r in light),
        ),
    )
    monkeypatch.setattr(tuner.autopilot.replay, "Autopilot", Recording)
    # a short window: sustained once the reference needs over 20 s to empty its queue
    config = CONFIG.model_copy(
        update={"overload_drain_s": 20.0, "overload_growth_s": 5.0, "overload_recheck": 2}
    )
    _, decisions = replay_with_autopilot(busy, config=config)
    pilot = Recording.last
    assert pilot is not None and pilot.in_overload, "the 2x window never overloaded"
    for running in pilot.in_overload:
        assert running <= {"sarathi", "defaults", pilot.current, *running & set(pilot.options)}
        assert len(running) <= 3
    # it ended (the queue may still stand: then candidates are compared, as when it rises) …
    assert decisions[-1].overload != "sustained"
    assert len(pilot.shadows) == CONFIG.max_shadows  # … and the explorers were forked again

"""uniboost's hold-back bound (``hold_bound_s``): a request that has waited the bound since its
arrival goes ahead of every request that has not, overdue requests first come first served,
and it keeps that place until it finishes (docs/policies.md#the-hold-back-bound)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from scheduler.policies import RequestState, make_policy
from scheduler.policies.base import boost
from scheduler.settings import Settings
from sim.engine import EngineConfig, simulate
from sim.stepmodel import StepTimeModel
from sim.traces import TraceRequest
from tuner.autopilot.candidates import candidate_space, target_document

# One second per step whatever the batch: schedules read in whole steps.
UNIT_STEPS = StepTimeModel(a=1.0, b=0.0, c=0.0, d=0.0, e=0.0, name="unit", source="test")
BIG_KV = EngineConfig(num_gpu_blocks=10_000, block_size=16, step_model=UNIT_STEPS)


def small_gamma(hold_bound_s: float | None) -> Settings:
    """γ small, α one second a token: size decides, and a 20-token prompt waits behind every
    2-token one that arrives in the next ~hour."""
    return Settings.model_validate(
        {
            "policy": "uniboost",
            "params": {
                "gamma": 0.01,
                "gamma_ada": False,
                "memguard": False,
                "alpha_s_per_token": 1.0,
                "preempt_max_utilisation": None,
                "hold_bound_s": hold_bound_s,
            },
            "engine": {"max_num_seqs": 1},
        }
    )


def stream_behind(*long_requests: tuple[str, float, int]) -> list[TraceRequest]:
    """``first`` holds the only seat; the long requests arrive, then a 2-token request every
    second for 40 s — enough to keep the seat busy all along."""
    trace = [TraceRequest("first", 0.0, 2, 3, 3)]
    trace += [TraceRequest(rid, at, prompt, 1, 1) for rid, at, prompt in long_requests]
    trace += [TraceRequest(f"s{i:02d}", 0.2 + i, 2, 1, 1) for i in range(40)]
    return trace


def scheduled(result) -> dict[str, float]:
    return {c.id: c.scheduled_at for c in result.completions}


def test_a_long_request_starved_by_a_small_gamma_is_served_once_it_is_overdue():
    trace = stream_behind(("A", 0.1, 20))
    unbounded = scheduled(simulate(trace, small_gamma(None), BIG_KV))
    bounded = scheduled(simulate(trace, small_gamma(5.0), BIG_KV))
    assert unbounded["A"] > 40.0  # behind the whole stream
    # Overdue at 5.1 s, admitted at the next step boundary or the one after (one seat, 1 s steps).
    assert 5.1 <= bounded["A"] <= 7.0, bounded["A"]
    assert bounded["s39"] < unbounded["s39"] + 21.0  # the stream pays A's 20 steps once


def test_overdue_requests_are_served_in_arrival_order_not_by_size():
    trace = stream_behind(("A", 0.1, 20), ("B", 0.15, 10))
    unbounded = scheduled(simulate(trace, small_gamma(None), BIG_KV))
    bounded = scheduled(simulate(trace, small_gamma(5.0), BIG_KV))
    assert unbounded["B"] < unbounded["A"]  # size order: the shorter first
    assert bounded["A"] < bounded["B"] < bounded["s39"]  # both overdue: first come first served


def test_no_bound_is_the_unbounded_policy_exactly():
    trace = stream_behind(("A", 0.1, 20), ("B", 0.15, 10))
    # A document that does not name the bound: the default is none.
    params = small_gamma(None).params.model_dump(exclude={"hold_bound_s"})
    unset = Settings.model_validate(
        {"policy": "uniboost", "params": params, "engine": {"max_num_seqs": 1}}
    )
    assert unset.params.hold_bound_s is None
    a = simulate(trace, unset, BIG_KV)
    b = simulate(trace, small_gamma(10_000.0), BIG_KV)  # never reached: the same schedule
    assert [(c.id, c.scheduled_at, c.finished_at) for c in a.completions] == [
        (c.id, c.scheduled_at, c.finished_at) for c in b.completions
    ]


def _waiting(rid: str, arrival: float, prompt: int) -> RequestState:
    r = RequestState(id=rid, arrival=arrival, prompt_tokens=prompt, max_tokens=8)
    r.status = "waiting"
    return r


def test_a_request_falls_due_at_its_arrival_plus_the_bound_and_stays_ahead_when_preempted():
    policy = make_policy(small_gamma(1.0))
    long = _waiting("long", 0.0, 5_000)
    policy.on_arrival(long, 0.0)
    assert policy.next_time_event([long], 0.0) == 1.0  # the simulator stops there
    policy.before_step([long], 0.99)
    assert not long.overdue
    policy.before_step([long], 1.0)
    assert long.overdue and long in policy.moved  # the waiting queue refiles it
    short = _waiting("short", 0.9, 1)
    policy.on_arrival(short, 0.9)
    assert policy.key(long, 1.0) < policy.key(short, 1.0)
    # Admitted, then preempted: it goes back overdue, ahead of the newer short request.
    long.status = "running"
    policy.on_admit(long, 1.0, 5_000)
    long.status = "waiting"
    policy.on_preempt(long, 2.0, by_policy=False)
    assert long.overdue and policy.key(long, 2.0) < policy.key(short, 2.0)
    # One admitted before it fell due and preempted after: overdue at once.
    early = _waiting("early", 0.5, 5_000)
    policy.on_arrival(early, 0.5)
    early.status = "running"
    policy.on_admit(early, 0.6, 5_000)
    early.status = "waiting"
    policy.on_preempt(early, 3.0, by_policy=True)
    assert early.overdue
    assert policy.key(long, 3.0) < policy.key(early, 3.0) < policy.key(short, 3.0)


def test_a_switch_judges_overdue_by_the_new_document():
    old = _waiting("old", 0.0, 5_000)
    new = _waiting("new", 9.5, 5_000)
    bounded = make_policy(small_gamma(5.0))
    bounded.attach([old, new], [], 10.0)
    assert old.overdue and not new.overdue
    assert bounded.next_time_event([old, new], 10.0) == 14.5
    assert bounded.key(old, 10.0) < bounded.key(new, 10.0)  # the same work: by overdue alone
    unbounded = make_policy(small_gamma(None))
    unbounded.attach([old, new], [], 10.0)  # the flag is dropped, and no key reads it
    assert not old.overdue
    assert unbounded.key(old, 10.0)[0] == old.arrival - boost(5_000.0, 0.01)


@pytest.mark.parametrize("bad", [0, -1, "soon", 1e9])
def test_a_bad_bound_is_refused_naming_the_field(bad):
    with pytest.raises(ValidationError, match="hold_bound_s"):
        Settings.model_validate({"policy": "uniboost", "params": {"hold_bound_s": bad}})


def test_the_autopilot_keeps_the_operators_bound_on_every_candidate_and_switch():
    base = Settings.model_validate(
        {"policy": "uniboost", "params": {"gamma": 0.1, "gamma_ada": False, "hold_bound_s": 30}}
    )
    space = candidate_space(base, gammas=(0.001, 0.1), quant_bases=(64,))
    boosted = [c for c in space.values() if c.settings.policy == "uniboost"]
    assert len(boosted) >= 4
    assert all(c.settings.params.hold_bound_s == 30 for c in boosted)
    switched = target_document(base, space["gamma=0.001"].settings)
    assert switched is not None
    assert switched.params.gamma == 0.001 and switched.params.hold_bound_s == 30

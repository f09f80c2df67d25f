"""uniboost's ``victims_first``: a request preempted for KV goes back ahead of every waiting
request, as vLLM's own scheduler puts it back at the front, so it is readmitted while its prefix
is still in vLLM's prefix cache (docs/policies.md#victims-first)."""

from __future__ import annotations

import dataclasses

import pytest

from benchmarks import preemption_fidelity as fidelity
from scheduler.policies import RequestState, make_policy
from scheduler.policies.queue import WaitingQueue
from scheduler.settings import Settings
from sim.engine import EngineConfig, simulate


def uniboost(**params) -> Settings:
    """γ small and α one second a token: size decides the waiting order."""
    base = {"gamma": 0.01, "gamma_ada": False, "memguard": False, "alpha_s_per_token": 1.0}
    return Settings.model_validate({"policy": "uniboost", "params": {**base, **params}})


def request(rid: str, arrival: float, prompt: int) -> RequestState:
    return RequestState(id=rid, arrival=arrival, prompt_tokens=prompt, max_tokens=10)


def queue_after_a_preemption(settings: Settings, by_policy: bool) -> list[str]:
    """The waiting order after a long running request is preempted, with a short one waiting."""
    policy = make_policy(settings)
    waiting = WaitingQueue(policy)
    short = request("short", 1.0, 2)
    waiting.push(short, 1.0)
    policy.on_arrival(short, 1.0)
    victim = request("victim", 0.0, 500)
    victim.computed_tokens = 0  # the engine dropped its KV
    waiting.push(victim, 2.0, front=True)
    policy.on_preempt(victim, 2.0, by_policy)
    return [r.id for r in waiting.ordered(2.0)]


def test_a_kv_victim_goes_ahead_of_better_scored_waiting_requests():
    assert queue_after_a_preemption(uniboost(victims_first=True), by_policy=False) == [
        "victim",
        "short",
    ]


@pytest.mark.parametrize(
    "settings, by_policy",
    [
        (uniboost(victims_first=False), False),  # the knob off: by score
        (uniboost(victims_first=True), True),  # preempted for a better-scored request: by score
    ],
    ids=["off", "policy-preemption"],
)
def test_otherwise_a_victim_waits_by_its_score(settings, by_policy):
    assert queue_after_a_preemption(settings, by_policy) == ["short", "victim"]


def test_readmitted_it_is_keyed_by_its_work_again():
    settings = uniboost(victims_first=True)
    policy = make_policy(settings)
    victim = request("victim", 0.0, 500)
    waiting = WaitingQueue(policy)
    waiting.push(victim, 2.0, front=True)
    policy.on_preempt(victim, 2.0, False)
    ahead = policy.key(victim, 2.0)
    policy.on_admit(victim, 3.0, 500)
    assert not victim.readmit_first
    assert policy.key(victim, 3.0) > ahead  # behind again: a 500-token request's score


def test_victims_first_keeps_the_prefix_cache_working():
    """On a deep queue of long outputs over a small KV cache, victims readmitted first find more
    of their prefixes cached (vLLM's cache on): fewer tokens recomputed than by score."""
    trace = fidelity.as_trace(fidelity.workload(60, seed=4))
    config = EngineConfig(num_gpu_blocks=199, block_size=16)
    recomputed = {}
    for first in (True, False):
        doc = {"policy": "uniboost", "params": {"victims_first": first}}
        result = simulate(trace, Settings.model_validate(doc), config)
        assert result.preemptions > 20  # the regime the knob is for
        recomputed[first] = result.recomputed_tokens
    assert recomputed[True] < 0.9 * recomputed[False]
    # Without the cache there is nothing to keep: the knob only changes whom the seat goes to.
    no_cache = dataclasses.replace(config, prefix_caching=False)
    doc = {"policy": "uniboost", "params": {"victims_first": True}}
    without = simulate(trace, Settings.model_validate(doc), no_cache)
    assert without.recomputed_tokens > recomputed[True]


@pytest.mark.vllm_in_process
def test_in_vllm_victims_first_keeps_its_prefix_cache_working():
    """The same, with the plugin in vLLM's own scheduler and KV cache manager (in-process, prefix
    caching on as by default): its victims readmitted first recompute less."""
    reqs = fidelity.workload(60, seed=4)
    recomputed = {}
    for first in (True, False):
        doc = {"policy": "uniboost", "params": {"victims_first": first}}
        served = fidelity.served_by_vllm(reqs, blocks=200, prefix_caching=True, settings=doc)
        assert served.preemptions > 20 and served.trips == 0  # the policy ran all along
        recomputed[first] = served.recomputed
    assert recomputed[True] < 0.9 * recomputed[False]

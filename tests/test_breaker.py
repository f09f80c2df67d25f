"""The circuit breaker: a policy that raises inside the engine's step never stops the engine.

The settings model refuses every document known to make a policy raise
(tests/test_settings_safety.py), so a real failure cannot be produced on demand: these tests
inject one — a policy whose methods raise, built where the engine builds its policies — which is
the only fake here. Everything else is
real: vLLM's scheduler in-process through the plugin, a twin behind its real HTTP control API.
"""

from __future__ import annotations

import httpx
import pytest

# The plugin's classes, imported where the first test builds one (plugin_harness.Deferred).
from plugin_harness import PLUGIN as TailpilotScheduler
from plugin_harness import PLUGIN_ASYNC as TailpilotAsyncScheduler
from plugin_harness import Driver, make_request, make_scheduler
from vllm_support import skip_without_vllm

from scheduler import contract
from scheduler.policies import POLICY_CLASSES
from scheduler.policies.basic import Vtc
from scheduler.policies.boost import UniBoost
from scheduler.settings import Settings
from tuner.twins.replica import ManualClock, TwinReplica

skip_without_vllm()

pytestmark = pytest.mark.vllm_in_process

TOKEN = "breaker-token"
UNIBOOST = {
    "policy": "uniboost",
    "params": {
        "gamma": 0.01,
        "gamma_ada": False,
        "memguard": False,
        "preempt_max_utilisation": None,
    },
}


class Boom(RuntimeError):
    pass


def raise_boom(*args, **kwargs):
    raise Boom("injected fault")


def make_raising(monkeypatch, base, *methods):
    """From now on every policy the engines build under ``base``'s name raises in ``methods``: a
    subclass put where ``make_policy`` looks (a compiled policy's methods cannot be patched, and
    a policy built before this call is left as it was)."""
    faulty = type(f"Raising{base.__name__}", (base,), dict.fromkeys(methods, raise_boom))
    monkeypatch.setitem(POLICY_CLASSES, base.name, faulty)


def requests(prefix: str, n: int, base: float = 1_000.0, tenant: str = "t0"):
    return [
        make_request(
            f"{prefix}{i}",
            20 + 37 * i % 200,
            5 + 11 * i % 30,
            arrival=base + i * 0.01,
            tenant=tenant,
        )
        for i in range(n)
    ]


@pytest.fixture(params=[TailpilotScheduler, TailpilotAsyncScheduler], ids=["sync", "async"])
def scheduler(request):
    s = make_scheduler(
        request.param,
        num_blocks=48,
        max_num_seqs=3,
        max_num_batched_tokens=64,
        settings={"policy": "fcfs"},
    )
    s.pipelined = request.param is TailpilotAsyncScheduler
    yield s
    s.shutdown()


def run_all(scheduler, first, later, *, between=None) -> Driver:
    """Serve ``first``, call ``between`` after a few steps, add ``later``, run until empty; every
    request must get exactly its tokens."""
    driver = Driver(scheduler, pipelined=scheduler.pipelined)
    driver.add(*first)
    driver.run(steps=4)
    if between is not None:
        between()
    driver.add(*later)
    driver.run(max_steps=5_000)
    driver.drain()
    expected = {r.request_id: r.max_tokens for r in [*first, *later]}
    assert driver.tokens == expected
    return driver


def test_a_raising_policy_falls_back_to_the_last_settings_that_ran(scheduler, monkeypatch):
    core = scheduler.tp_core
    make_raising(monkeypatch, UniBoost, "key")

    def switch():
        assert core.put_settings(UNIBOOST)["version"] == 2

    run_all(scheduler, requests("a", 6), requests("b", 8, base=1_001.0), between=switch)
    breaker = core.breaker
    assert breaker.trips_total == 1
    assert breaker.failed_version == 2 and breaker.fallback_version == 1
    assert breaker.last_error == "Boom: injected fault"
    assert (
        core.settings.policy == "fcfs" and core.active_version == 3
    )  # the fallback, as a new version
    state = contract.read(contract.State, core.state(None, {}), lenient=False)
    assert state.breaker is not None and state.breaker.trips_total == 1
    assert state.policy == "fcfs" and state.settings_version == 3 and state.pending_version is None


def test_a_fallback_that_raises_too_ends_on_the_stock_order(monkeypatch):
    s = make_scheduler(
        TailpilotScheduler,
        num_blocks=48,
        max_num_seqs=3,
        max_num_batched_tokens=64,
        settings=UNIBOOST,
    )
    s.pipelined = False
    try:
        core = s.tp_core

        def switch():  # every uniboost raises from now on: another document, the restored one too
            make_raising(monkeypatch, UniBoost, "key")
            core.put_settings({**UNIBOOST, "params": {**UNIBOOST["params"], "gamma": 0.02}})

        run_all(s, requests("a", 6), requests("b", 8, base=1_001.0), between=switch)
        assert core.breaker.trips_total == 2
        assert core.settings.policy == "sarathi" and core.breaker.fallback_version is None
    finally:
        s.shutdown()


def test_a_raising_token_hook_inside_vllms_output_path_is_contained(monkeypatch):
    """vtc charges tokens from update_from_output and forgets a tenant in on_finish: both run
    inside vLLM's own loops."""
    make_raising(monkeypatch, Vtc, "on_tokens", "on_finish")
    s = make_scheduler(
        TailpilotScheduler,
        num_blocks=48,
        max_num_seqs=3,
        max_num_batched_tokens=64,
        settings={"policy": "vtc"},
    )
    s.pipelined = False
    try:
        run_all(s, requests("a", 5, tenant="x"), requests("b", 5, tenant="y"))
        assert s.tp_core.breaker.trips_total >= 1
        assert s.tp_core.settings.policy == "sarathi"
    finally:
        s.shutdown()


def test_without_a_fault_the_breaker_stays_closed(scheduler):
    core = scheduler.tp_core
    run_all(
        scheduler,
        requests("a", 6),
        requests("b", 6, base=1_001.0),
        between=lambda: core.put_settings(UNIBOOST),
    )
    assert core.breaker.trips_total == 0 and core.settings.policy == "uniboost"


def test_a_twin_falls_back_and_reports_it_on_state(monkeypatch):
    from sim.traces import TraceRequest

    trace = [
        TraceRequest(
            id=f"r{i}",
            arrival=0.05 * i,
            prompt_tokens=200 + 13 * i % 300,
            output_tokens=20 + 7 * i % 60,
            max_tokens=200,
        )
        for i in range(200)
    ]
    clock = ManualClock()
    twin = TwinReplica(
        "twin-b",
        trace,
        loop=False,
        clock=clock,
        token=TOKEN,
        settings=Settings.model_validate({"policy": "fcfs"}),
    ).start()
    try:
        with httpx.Client(base_url=twin.url, timeout=10) as c:
            clock.set(2.0)
            twin.advance()
            make_raising(monkeypatch, UniBoost, "key")
            r = c.put(
                "/tailpilot/v1/settings",
                json=UNIBOOST,
                headers={"Authorization": f"Bearer {TOKEN}"},
            )
            assert r.status_code == 200
            for t in (4.0, 6.0, 30.0):
                clock.set(t)
                twin.advance()
            assert twin.error is None, twin.error
            state = c.get("/tailpilot/v1/state", params={"cursor": 0}).json()
    finally:
        twin.stop()
    doc = contract.read(contract.State, state, lenient=False)
    assert doc.breaker is not None and doc.breaker.trips_total == 1
    assert doc.breaker.failed_version == 2 and doc.breaker.fallback_version == 1
    assert doc.policy == "fcfs"
    assert {c["id"] for c in state["completions"]} >= {f"r{i}" for i in range(40)}  # served on

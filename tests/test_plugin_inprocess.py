"""tailpilot's vLLM scheduler plugin against vLLM's real scheduler classes, in-process.

No server, no model, no mocks of vLLM: ``tests/plugin_harness.py`` builds the stock
``Scheduler`` / ``AsyncScheduler`` and the plugin's ``TailpilotScheduler`` /
``TailpilotAsyncScheduler`` over a KV cache of an exact number of blocks, and feeds them a
fabricated model output (one token for every request whose prefill is complete). Every scenario
runs until the scheduler is empty and checks that each request got exactly ``max_tokens`` tokens
and appears once in the plugin's completions log.
"""

from __future__ import annotations

import json
import socket
import time

import pytest

# vLLM's scheduler classes and the plugin's, named here and imported where the first test builds
# one (plugin_harness.Deferred): collecting this module imports no vLLM.
from plugin_harness import PLUGIN as TailpilotScheduler
from plugin_harness import PLUGIN_ASYNC as TailpilotAsyncScheduler
from plugin_harness import STATUS as RequestStatus
from plugin_harness import STOCK as Scheduler
from plugin_harness import STOCK_ASYNC as AsyncScheduler
from plugin_harness import Driver, make_request, make_scheduler, minimal_model_dir, pipelined
from vllm_support import skip_without_vllm

from scheduler.names import NAME_MAX_CHARS
from scheduler.plugin.env import PluginEnvError
from scheduler.plugin.wire import encode_json
from scheduler.policies import make_policy

skip_without_vllm()

pytestmark = pytest.mark.vllm_in_process

FCFS = {"policy": "fcfs"}
SLOFQ = {"policy": "slofq"}
# γ small: ordering by size dominates arrival (b_γ of 10 vs 1000 tokens differ by ~4600 s).
# Policy preemption whatever the batch's utilisation (these scripts fill one or two seats).
UNIBOOST = {
    "policy": "uniboost",
    "params": {
        "gamma": 0.001,
        "memguard": False,
        "gamma_ada": False,
        "alpha_s_per_token": 0.001,
        "preempt_max_utilisation": None,
    },
}


@pytest.fixture(scope="module")
def model_dir(request):
    """The session's tiny Llama (tests/conftest.py) when available, else a config.json-only dir."""
    try:
        return request.getfixturevalue("tiny_model_dir")
    except pytest.FixtureLookupError:
        return minimal_model_dir()


@pytest.fixture
def build(model_dir):
    built = []

    def build(cls=TailpilotScheduler, **kwargs):
        kwargs.setdefault("block_size", 16)
        s = make_scheduler(cls, model_dir=model_dir, **kwargs)
        built.append(s)
        return s

    yield build
    for s in built:  # stops the plugin's predictor-refit thread
        s.shutdown()


class Clock:
    """Arrival times: ``T(k)`` is k seconds after a base 1000 s in the past (so latencies that
    policies derive from arrivals, e.g. γ-Ada's, are positive)."""

    def __init__(self) -> None:
        self.base = time.time() - 1000.0

    def __call__(self, offset: float) -> float:
        return self.base + offset


def req(clock: Clock, rid: str, prompt: int, max_tokens: int, offset: float, **kw):
    return make_request(rid, prompt, max_tokens, arrival=clock(offset), **kw)


def assert_all_finished(
    driver: Driver, *, completions_cursor: int = 0, rejected: set[str] = frozenset()
) -> None:
    """Every request added got exactly max_tokens tokens, finished once (reason 'length'), the
    scheduler is empty, and — for the plugin — each appears once in the completions log with the
    right output length and no tracked state is left behind (``rejected``: ids also logged, as
    refused on arrival)."""
    s = driver.scheduler
    assert not driver.busy()
    assert not s.running and len(s.waiting) == 0 and not s.requests
    expected = {rid: r.max_tokens for rid, r in driver.requests.items()}
    assert driver.tokens == expected
    assert driver.finished == {rid: "length" for rid in expected}
    core = getattr(s, "tp_core", None)
    if core is None:
        return
    completions, _ = core.completions_since(completions_cursor)
    refused = [c for c in completions if c["reason"] == "rejected"]
    assert sorted(c["id"] for c in refused) == sorted(rejected)
    assert all(c["first_token_at"] is None and c["output_tokens"] == 0 for c in refused)
    completions = [c for c in completions if c["reason"] != "rejected"]
    ids = [c["id"] for c in completions]
    assert sorted(ids) == sorted(expected), "each request completes exactly once"
    for c in completions:
        assert c["output_tokens"] == expected[c["id"]], c
        assert c["reason"] == "finished", c
        assert c["scheduled_at"] is not None and c["first_token_at"] is not None
    assert core.states == {} and len(core.waiting) == 0
    assert s._tp_requests == {}


# --------------------------------------------------------------------------------------------
# 1. fcfs is vLLM's order
# --------------------------------------------------------------------------------------------


def _fcfs_workload(clock: Clock) -> dict[int, list]:
    """A scripted mix: long and short prompts, chunked prefill, arrivals while busy; on a KV cache
    small enough that decodes run out of blocks (memory preemptions) several times."""
    import random

    rng = random.Random(7)
    arrivals: dict[int, list] = {}
    for i in range(24):
        at_step = rng.randrange(0, 40)
        prompt = rng.choice([8, 20, 40, 70, 130, 260])
        arrivals.setdefault(at_step, []).append((f"q{i:02d}", prompt, rng.randrange(2, 90)))
    ordered: dict[int, list] = {}
    k = 0
    for at_step in sorted(arrivals):
        for rid, prompt, max_tokens in arrivals[at_step]:
            ordered.setdefault(at_step, []).append((rid, prompt, max_tokens, k * 0.01))
            k += 1  # arrival times follow the order of add_request
    return ordered


@pytest.mark.parametrize("lpt", [0, 48])
@pytest.mark.parametrize(
    "stock_cls,plugin_cls",
    [(Scheduler, TailpilotScheduler), (AsyncScheduler, TailpilotAsyncScheduler)],
    ids=["sync", "async"],
)
def test_fcfs_matches_stock_step_by_step(build, stock_cls, plugin_cls, lpt):
    clock = Clock()
    script = _fcfs_workload(clock)
    two_in_flight = pipelined(stock_cls)
    runs = {}
    for name, cls, settings in [("stock", stock_cls, None), ("fcfs", plugin_cls, FCFS)]:
        s = build(
            cls,
            num_blocks=30,
            max_num_seqs=6,
            max_num_batched_tokens=96,
            settings=settings,
            long_prefill_token_threshold=lpt,
        )
        d = Driver(s, pipelined=two_in_flight)
        arrivals = {k: [req(clock, *spec) for spec in specs] for k, specs in script.items()}
        d.run(arrivals=arrivals)
        assert_all_finished(d)
        runs[name] = d
    stock, fcfs = runs["stock"], runs["fcfs"]
    assert sum(len(r.preempted) for r in stock.history) >= 2, (
        "the workload must hit memory pressure"
    )
    assert stock.first_admitted == fcfs.first_admitted
    assert [(r.scheduled, r.admitted, r.preempted) for r in stock.history] == [
        (r.scheduled, r.admitted, r.preempted) for r in fcfs.history
    ]
    assert fcfs.scheduler.tp_core.preemptions_total == sum(len(r.preempted) for r in stock.history)


def test_default_settings_are_sarathi_and_match_stock(build):
    """No settings file: sarathi (vLLM's own order), step for step."""
    clock = Clock()
    script = _fcfs_workload(clock)
    histories = []
    for cls in (Scheduler, TailpilotScheduler):
        s = build(cls, num_blocks=30, max_num_seqs=6, max_num_batched_tokens=96, settings=None)
        d = Driver(s)
        d.run(arrivals={k: [req(clock, *spec) for spec in specs] for k, specs in script.items()})
        assert_all_finished(d)
        histories.append([(r.scheduled, r.admitted, r.preempted) for r in d.history])
        if cls is TailpilotScheduler:
            assert s.tp_core.settings.policy == "sarathi"
    assert histories[0] == histories[1]


# --------------------------------------------------------------------------------------------
# 2. admission order
# --------------------------------------------------------------------------------------------


def _admission_script(clock: Clock) -> dict[int, list]:
    # X holds the only seat; A (long), B, C (short) arrive while it runs, in that order.
    return {
        0: [req(clock, "X", 4, 3, 0.0)],
        1: [req(clock, "A", 256, 2, 1.0), req(clock, "B", 16, 2, 2.0), req(clock, "C", 16, 2, 3.0)],
    }


def test_admission_order_fcfs_is_arrival_order(build):
    clock = Clock()
    d = Driver(build(num_blocks=100, max_num_seqs=1, max_num_batched_tokens=512, settings=FCFS))
    d.run(arrivals=_admission_script(clock))
    assert d.first_admitted == ["X", "A", "B", "C"]
    assert d.scheduler.tp_core.preemptions_total == 0
    assert_all_finished(d)


def test_admission_order_uniboost_short_first(build):
    clock = Clock()
    s = build(num_blocks=100, max_num_seqs=1, max_num_batched_tokens=512, settings=UNIBOOST)
    d = Driver(s)
    seen_waiting = []

    def on_step(record):
        if record.index == 1:  # A, B, C all waiting behind X: the queue is in policy order
            seen_waiting.append([r.request_id for r in s.waiting])

    d.run(arrivals=_admission_script(clock), on_step=on_step)
    assert seen_waiting == [["B", "C", "A"]]
    # X is shorter than everyone, so nobody preempts it; then B and C (equal size, B earlier) go
    # before A although A waited longer.
    assert d.first_admitted == ["X", "B", "C", "A"]
    assert_all_finished(d)


# --------------------------------------------------------------------------------------------
# 3. the victim under memory pressure
# --------------------------------------------------------------------------------------------

# All four fit after prefill with 2 blocks to spare (4+1+2+1 of 10); their first decode needs
# 3 new blocks (R0 at 65, R1 at 17, R2 at 33 tokens), so exactly one of them is preempted.
# The victim waits by its score after (victims_first off): these tests are about which request
# is the victim, and a worst-scored victim readmitted first would be the victim again.
UNIBOOST_SCORE_VICTIM = {
    **UNIBOOST,
    "params": {**UNIBOOST["params"], "kv_victim": "score", "victims_first": False},
}
VICTIM_SCRIPT = [("R0", 64, 6, 0.0), ("R1", 16, 6, 1.0), ("R2", 32, 6, 2.0), ("R3", 8, 6, 3.0)]


@pytest.mark.parametrize(
    "cls,settings,victim",
    [
        (Scheduler, None, "R3"),  # stock: the last admitted
        (TailpilotScheduler, FCFS, "R3"),  # fcfs: the latest arrival
        (
            TailpilotScheduler,
            UNIBOOST,
            "R3",
        ),  # uniboost (kv_victim newest): the latest arrival, as stage 1
        # kv_victim score: the worst score, i.e. the most work (largest prompt) at a small γ
        (TailpilotScheduler, UNIBOOST_SCORE_VICTIM, "R0"),
        (TailpilotAsyncScheduler, UNIBOOST_SCORE_VICTIM, "R0"),
    ],
    ids=["stock", "fcfs", "uniboost", "uniboost-score", "uniboost-score-async"],
)
def test_memory_pressure_victim_is_policy_worst(build, cls, settings, victim):
    clock = Clock()
    s = build(cls, num_blocks=11, max_num_seqs=8, max_num_batched_tokens=256, settings=settings)
    d = Driver(s, pipelined=pipelined(cls))
    d.add(*[req(clock, *spec) for spec in VICTIM_SCRIPT])
    first = d.step()
    assert sorted(first.admitted) == ["R0", "R1", "R2", "R3"] and first.preempted == []
    second = d.step()
    assert second.preempted == [victim]
    assert s.requests[victim].status == RequestStatus.PREEMPTED
    assert s.requests[victim].num_computed_tokens == 0
    assert victim not in dict(second.scheduled)
    if cls is not Scheduler:
        core = s.tp_core
        assert core.preemptions_total == 1
        state = core.states[victim]
        assert (
            state.status == "waiting" and state.preemptions == 1 and state.policy_preemptions == 0
        )
        assert (
            state.recomputed_tokens == VICTIM_SCRIPT[[v[0] for v in VICTIM_SCRIPT].index(victim)][1]
        )
        assert [r.request_id for r in s.waiting] == [victim]
    d.run()
    assert_all_finished(d)
    if cls is not Scheduler:
        (c,) = [c for c in s.tp_core.completions_since(0)[0] if c["id"] == victim]
        assert c["preemptions"] == 1


@pytest.mark.parametrize(
    "settings,victim",
    [(FCFS, "C"), (UNIBOOST_SCORE_VICTIM, "A"), (UNIBOOST, "C")],
    ids=["fcfs", "uniboost-score", "uniboost"],
)
def test_memory_pressure_victim_by_attained_work(build, settings, victim):
    """Equal prompts: under kv_victim "score" uniboost's worst is the request with the most
    attained work (A, which has been decoding longest); fcfs's and, by default, uniboost's is the
    latest arrival (C), the cheapest to recompute."""
    clock = Clock()
    s = build(num_blocks=7, max_num_seqs=8, max_num_batched_tokens=256, settings=settings)
    d = Driver(s)
    d.run(arrivals={0: [req(clock, "A", 16, 40, 0.0)]}, steps=20)  # A: 35 tokens, 3 blocks
    assert s.requests["A"].num_computed_tokens == 35
    d.add(req(clock, "B", 16, 6, 1.0), req(clock, "C", 16, 6, 2.0))
    admitted = d.step()  # B and C: one block each; 1 block left
    assert admitted.admitted == ["B", "C"] and admitted.preempted == []
    attained = {rid: st.attained for rid, st in s.tp_core.states.items()}
    assert attained["A"] > attained["B"] == attained["C"]
    record = d.step()  # B and C each need a second block: one request must go
    assert record.preempted == [victim]
    assert s.requests[victim].status == RequestStatus.PREEMPTED
    assert s.tp_core.preemptions_total == 1 and s.tp_core.states[victim].policy_preemptions == 0
    d.run()
    assert_all_finished(d)


# --------------------------------------------------------------------------------------------
# 4. policy-driven preemption
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cls", [TailpilotScheduler, TailpilotAsyncScheduler], ids=["sync", "async"]
)
def test_waiting_short_preempts_running_long_under_uniboost(build, cls):
    clock = Clock()
    s = build(cls, num_blocks=100, max_num_seqs=1, max_num_batched_tokens=256, settings=UNIBOOST)
    d = Driver(s, pipelined=pipelined(cls))
    d.run(arrivals={0: [req(clock, "L", 128, 12, 0.0)]}, steps=3)
    assert [r.request_id for r in s.running] == ["L"]
    progress = s.requests["L"].num_computed_tokens
    assert progress >= 128
    d.add(req(clock, "S", 8, 2, 1.0))
    record = d.step()
    # The seat is full and S's key beats L's: the plugin preempts L through vLLM and S is admitted
    # in the same step.
    assert record.preempted == ["L"]
    assert record.admitted == ["S"]
    core = s.tp_core
    assert core.preemptions_total == 1
    assert core.states["L"].policy_preemptions == 1
    assert core.states["L"].recomputed_tokens == progress
    assert s.requests["L"].status == RequestStatus.PREEMPTED
    d.run()
    assert_all_finished(d)
    completions = {c["id"]: c for c in core.completions_since(0)[0]}
    assert list(completions) == ["S", "L"]
    assert completions["L"]["preemptions"] == 1


def test_no_policy_preemption_while_the_batch_is_full_by_default(build):
    # The seed 003 rule (preempt_max_utilisation 0.8): the one seat is taken, so the batch is
    # full and S waits for L instead of throwing L's prefill away.
    clock = Clock()
    gated = {**UNIBOOST, "params": {**UNIBOOST["params"], "preempt_max_utilisation": 0.8}}
    s = build(num_blocks=100, max_num_seqs=1, max_num_batched_tokens=256, settings=gated)
    d = Driver(s)
    d.run(arrivals={0: [req(clock, "L", 128, 12, 0.0)]}, steps=3)
    d.add(req(clock, "S", 8, 2, 1.0))
    record = d.step()
    assert record.preempted == [] and record.admitted == []
    d.run()
    assert_all_finished(d)
    assert s.tp_core.preemptions_total == 0
    assert [c["id"] for c in s.tp_core.completions_since(0)[0]] == ["L", "S"]


def test_waiting_short_does_not_preempt_under_fcfs(build):
    clock = Clock()
    s = build(num_blocks=100, max_num_seqs=1, max_num_batched_tokens=256, settings=FCFS)
    d = Driver(s)
    d.run(arrivals={0: [req(clock, "L", 128, 12, 0.0)], 3: [req(clock, "S", 8, 2, 1.0)]})
    assert not any(record.preempted for record in d.history)
    assert s.tp_core.preemptions_total == 0
    assert d.first_admitted == ["L", "S"]
    assert [c["id"] for c in s.tp_core.completions_since(0)[0]] == ["L", "S"]
    assert_all_finished(d)


def test_no_preemption_when_a_seat_is_free(build):
    """Policy preemption only when the waiting request cannot be admitted otherwise."""
    clock = Clock()
    s = build(num_blocks=100, max_num_seqs=2, max_num_batched_tokens=256, settings=UNIBOOST)
    d = Driver(s)
    d.run(arrivals={0: [req(clock, "L", 128, 12, 0.0)], 3: [req(clock, "S", 8, 2, 1.0)]})
    assert s.tp_core.preemptions_total == 0
    assert_all_finished(d)


# --------------------------------------------------------------------------------------------
# 5. settings switch mid-run
# --------------------------------------------------------------------------------------------


def test_settings_switch_mid_run_keeps_progress(build):
    clock = Clock()
    s = build(num_blocks=200, max_num_seqs=2, max_num_batched_tokens=64, settings=FCFS)
    core = s.tp_core
    d = Driver(s)
    # Y: a long prompt mid chunked-prefill at the switch; X decoding; A (long) and B (short)
    # waiting, A first in arrival order.
    d.run(
        arrivals={
            0: [req(clock, "X", 8, 12, 0.0), req(clock, "Y", 300, 4, 0.5)],
            1: [req(clock, "A", 200, 2, 1.0), req(clock, "B", 16, 2, 2.0)],
        },
        steps=3,
    )
    assert sorted(r.request_id for r in s.running) == ["X", "Y"]
    assert [r.request_id for r in s.waiting] == ["A", "B"]
    before = {rid: (r.num_computed_tokens, r.num_output_tokens) for rid, r in s.requests.items()}
    assert 0 < before["Y"][0] < 300, "Y must be mid-prefill at the switch"
    version = core.version
    settings_before = core.settings

    # What a client does: read the settings, change the policy, write them back.
    doc = {
        **core.settings_doc()["settings"],
        "policy": "uniboost",
        "pinned": ["gamma"],
        "params": {
            "gamma": 0.001,
            "memguard": False,
            "alpha_s_per_token": 0.001,
            "preempt_margin": 1e6,
        },
    }  # no policy preemption: only the order changes
    answer = core.put_settings(doc, if_match=version)
    assert answer["version"] == version + 1 == core.version
    assert answer["restart_required"] == []
    # Staged, not applied: nothing moved, the active settings are still fcfs.
    assert core.settings is settings_before and core.policy.name == "fcfs"
    assert core.settings_doc()["settings"]["policy"] == "uniboost"
    assert {
        rid: (r.num_computed_tokens, r.num_output_tokens) for rid, r in s.requests.items()
    } == before

    record = d.step()  # the switch happens at the top of this step
    assert core.policy.name == "uniboost" and core.settings.policy == "uniboost"
    assert core.version == version + 1
    assert record.preempted == [] and core.preemptions_total == 0
    scheduled = dict(record.scheduled)
    for rid, (computed, generated) in before.items():
        r = s.requests.get(rid)
        assert r is not None, rid
        assert r.num_computed_tokens == computed + scheduled.get(rid, 0), rid
        assert r.num_output_tokens >= generated, rid
    # uniboost's order from this step on: B (short) ahead of A in the queue and at admission.
    assert [r.request_id for r in s.waiting] == ["B", "A"]
    d.run()
    assert d.first_admitted == ["X", "Y", "B", "A"]
    assert core.preemptions_total == 0
    assert_all_finished(d)


def test_switch_back_and_forth_many_times(build):
    """Switching every step among all live policies loses no request and no token."""
    clock = Clock()
    s = build(
        num_blocks=40,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        settings=FCFS,
        long_prefill_token_threshold=32,
    )
    core = s.tp_core
    d = Driver(s)
    docs = [
        {"policy": "sarathi"},
        UNIBOOST,
        {"policy": "las", "params": {"alpha_s_per_token": 0.001}},
        {"policy": "vtc"},
        {"policy": "srpt"},
        {"policy": "tie"},
        {"policy": "sjf"},
        {"policy": "distboost"},
        FCFS,
    ]
    arrivals = {
        k: [
            req(
                clock,
                f"r{k}",
                [12, 90, 30][k % 3],
                3 + k % 7,
                k * 0.1,
                tenant=["a", "b"][k % 2],
                type=["chat", "batch"][k % 2],
            )
        ]
        for k in range(30)
    }
    start = core.version

    def on_step(record):
        core.put_settings(docs[record.index % len(docs)])

    d.run(arrivals=arrivals, on_step=on_step)
    assert core.version == start + len(d.history)
    assert_all_finished(d)


# --------------------------------------------------------------------------------------------
# 6. γ-Ada and a pinned γ
# --------------------------------------------------------------------------------------------


ADA = {
    "policy": "uniboost",
    "params": {
        "gamma": 0.5,
        "memguard": False,
        "gamma_ada": True,
        "ada_min_samples": 5,
        "ada_window": 10,
        "ada_interval_s": 0.001,
        "gamma_min": 1.0,
        "gamma_max": 200.0,
    },
}


def _ada_run(build, settings):
    clock = Clock()
    s = build(num_blocks=200, max_num_seqs=4, max_num_batched_tokens=256, settings=settings)
    d = Driver(s)
    # Latency spread (arrivals 0..900 s ago) so the P99/P95 tail ratio is not 1.
    d.run(arrivals={k: [req(clock, f"g{k}", 8 + 8 * k, 2, 100.0 * k)] for k in range(10)})
    assert_all_finished(d)
    policy = s.tp_core.policy
    policy.tick(time.time() + 1.0)  # and at least one more adaptation round, by hand
    return s, policy


def test_gamma_ada_moves_an_unpinned_gamma(build):
    s, policy = _ada_run(build, ADA)
    assert policy.ada_enabled
    assert policy.gamma_updates >= 1
    assert policy.gamma != 0.5
    assert s.tp_core.policy.live_state()["gamma_pinned"] is False


def test_pinned_gamma_is_never_moved_by_gamma_ada(build):
    _s, policy = _ada_run(build, {**ADA, "pinned": ["gamma"]})
    assert not policy.ada_enabled
    assert policy.gamma == 0.5 and policy.gamma_updates == 0
    assert policy.live_state() == {"gamma": 0.5, "gamma_pinned": True}


def test_pinned_gamma_survives_a_switch(build):
    """A switch into a pinned document keeps γ exactly; adaptation never touches it afterwards."""
    s, policy = _ada_run(build, ADA)
    adapted = policy.gamma
    assert adapted != 0.5
    core = s.tp_core
    core.put_settings({**ADA, "params": {**ADA["params"], "gamma": 3.0}, "pinned": ["gamma"]})
    _, cursor = core.completions_since(0)
    d = Driver(s)
    clock = Clock()
    d.run(arrivals={k: [req(clock, f"h{k}", 8 + 8 * k, 2, 100.0 * k)] for k in range(10)})
    assert_all_finished(d, completions_cursor=cursor)
    core.policy.tick(time.time() + 1.0)
    assert core.policy.gamma == 3.0 and core.policy.gamma_updates == 0


def test_a_staged_document_builds_its_policy_once_and_takes_the_live_state_at_the_step(
    build, monkeypatch
):
    """The policy a PUT builds (to refuse a document that cannot build) is the one the step
    swaps in: built once, and the adaptive state it carries over is the one at the step, not at
    the PUT."""
    import scheduler.plugin.core as plugin_core

    s, policy = _ada_run(build, ADA)
    core = s.tp_core
    built = []

    def counting(settings, predictor):
        built.append(settings.policy)
        return make_policy(settings, predictor)

    monkeypatch.setattr(plugin_core, "make_policy", counting)
    core.put_settings({**ADA, "params": {**ADA["params"], "ada_window": 12}})
    assert built == ["uniboost"] and core.policy is policy  # staged, not yet running
    policy.recent_tail.append(1234.5)  # a first-token wait the old policy sees after the PUT
    core.begin_step(time.time())
    assert built == ["uniboost"]  # the step built nothing
    assert core.policy is not policy and core.policy.params.ada_window == 12
    assert list(core.policy.recent_tail)[-1] == 1234.5


# --------------------------------------------------------------------------------------------
# 7. everything finishes, for every policy, sync and async
# --------------------------------------------------------------------------------------------


ALL_POLICIES = [
    FCFS,
    {"policy": "sarathi"},
    UNIBOOST,
    {"policy": "uniboost"},
    {"policy": "las", "params": {"alpha_s_per_token": 0.001}},
    {"policy": "srpt"},
    {"policy": "sjf"},
    {"policy": "tie"},
    {"policy": "vtc", "params": {"weights": {"a": 2.0}}},
    {"policy": "distboost"},
    {"policy": "slofq", "params": {"tenants": {"a": {"weight": 2.0}}, "type_isolation": "hard"}},
]


@pytest.mark.parametrize(
    "settings",
    ALL_POLICIES,
    ids=lambda d: (
        d["policy"]
        + (
            "-"
            + "-".join(
                f"{k}={v}" for k, v in d.get("params", {}).items() if k in ("gamma", "memguard")
            )
            if d.get("params")
            else ""
        )
    ),
)
@pytest.mark.parametrize(
    "cls", [TailpilotScheduler, TailpilotAsyncScheduler], ids=["sync", "async"]
)
def test_every_policy_finishes_everything_under_pressure(build, cls, settings):
    clock = Clock()
    s = build(
        cls,
        num_blocks=30,
        max_num_seqs=5,
        max_num_batched_tokens=64,
        settings=settings,
        long_prefill_token_threshold=32,
    )
    d = Driver(s, pipelined=pipelined(cls))
    arrivals = {}
    for k in range(36):
        arrivals.setdefault(k // 2, []).append(
            req(
                clock,
                f"p{k:02d}",
                [10, 60, 25, 140][k % 4],
                [3, 25, 8, 2][k % 4],
                k * 0.05,
                tenant=["a", "b", "c"][k % 3],
                type=["chat", "batch", "reasoning"][k % 3],
            )
        )
    d.run(arrivals=arrivals)
    assert_all_finished(d)
    core = s.tp_core
    assert core.finished_total == 36
    assert core.preemptions_total == sum(len(r.preempted) for r in d.history)
    steps, _ = core.steps_since(0)
    assert len(steps) == core.steps_total == len(d.history)


# --------------------------------------------------------------------------------------------
# 8. regressions for bugs found with this harness
# --------------------------------------------------------------------------------------------


def test_policy_preemption_is_not_wasted_on_full_sequence_gate(build):
    clock = Clock()
    s = build(num_blocks=31, max_num_seqs=4, max_num_batched_tokens=512, settings={"policy": "las"})
    d = Driver(s)
    # H1..H3 stay in LAS level 0 (< 157 tokens attained) and hold 18 blocks; V (level 1) holds 11.
    d.run(
        arrivals={
            0: [
                req(clock, "H1", 80, 40, 0.0),
                req(clock, "H2", 80, 40, 1.0),
                req(clock, "H3", 80, 40, 2.0),
                req(clock, "V", 160, 40, 3.0),
            ]
        },
        steps=3,
    )
    # W (level 0) needs 20 blocks for its prompt; preempting V frees only 11 (+1 free).
    d.add(req(clock, "W", 320, 2, 10.0))
    record = d.step()
    if record.preempted:  # a policy preemption must admit the request it was made for
        assert "W" in record.admitted, f"{record.preempted} preempted, W not admitted"
    d.run()
    assert_all_finished(d)


def test_long_prefill_threshold_applies_live(build):
    """long_prefill_token_threshold is not restart-required: a PUT changes the chunk size of the
    very next step (vLLM reads it from the scheduler config every step)."""
    clock = Clock()
    s = build(num_blocks=100, max_num_seqs=4, max_num_batched_tokens=256, settings=FCFS)
    d = Driver(s)
    d.add(req(clock, "long-a", 200, 4, 0.0), req(clock, "long-b", 200, 4, 0.01))
    first = d.step()
    assert (
        dict(first.scheduled)["long-a"] == 200
    )  # no threshold: one request takes its whole prompt
    answer = s.tp_core.put_settings(
        {"policy": "fcfs", "engine": {"long_prefill_token_threshold": 32}}
    )
    assert answer["restart_required"] == []
    d.add(req(clock, "long-c", 200, 4, 0.02))
    second = d.step()
    assert s.scheduler_config.long_prefill_token_threshold == 32
    assert dict(second.scheduled)["long-c"] == 32
    d.drain()


def test_put_settings_without_engine_keeps_the_replica_engine(build):
    """A document without an engine block keeps the replica's engine (vLLM's config), not the
    model defaults (128 seqs, 2048 tokens): no spurious restart_required."""
    s = build(num_blocks=100, max_num_seqs=2, max_num_batched_tokens=64, settings=FCFS)
    core = s.tp_core
    engine = core.settings_doc()["settings"]["engine"]
    assert engine["max_num_seqs"] == 2 and engine["max_num_batched_tokens"] == 64
    answer = core.put_settings({"policy": "uniboost"})
    assert answer["restart_required"] == []
    assert answer["settings"]["engine"] == engine


def test_memguard_memory_victim_is_outside_its_guard(build):
    """On KV shortage vLLM preempts running[-1]: under MemGuard that must be the worst request
    outside its guard, not a resumed request still inside it."""
    clock = Clock()
    guard = {
        "policy": "uniboost",
        "pinned": ["gamma"],
        "params": {
            "gamma": 0.001,
            "alpha_s_per_token": 0.001,
            "memguard": True,
            "kv_victim": "score",
            "victims_first": False,  # R0 waits by its score, as the scenario below has it
            "quant_base_tokens": 16,
            "quant_ratio": 2.0,
        },
    }
    s = build(num_blocks=11, max_num_seqs=8, max_num_batched_tokens=256, settings=guard)
    core = s.tp_core
    d = Driver(s)
    d.add(
        *[
            req(clock, rid, p, m, a)
            for rid, p, m, a in [
                ("R0", 64, 40, 0.0),
                ("R1", 16, 4, 1.0),
                ("R2", 32, 4, 2.0),
                ("R3", 8, 4, 3.0),
            ]
        ]
    )
    d.run(steps=2)
    assert d.history[1].preempted == ["R0"]  # the worst and unguarded: policy and vLLM agree
    # Run until R0 is back (resumed with guard = next threshold above its attained 65: 128).
    for _ in range(50):
        if "R0" in [r.request_id for r in s.running]:
            break
        d.step()
    assert core.states["R0"].guard_tokens == 128
    # Two shorter requests join; their decodes run out of blocks while R0 is still guarded.
    d.add(req(clock, "N1", 32, 8, 10.0), req(clock, "N2", 32, 8, 11.0))
    victims = []
    for _ in range(50):
        states = [core.states[r.request_id] for r in s.running]
        expected = core.policy.memory_victim(core.policy.order_running(states, time.time()))
        victims = d.step().preempted
        if victims:
            break
    assert victims == [expected.id] == ["N2"]
    d.run()
    assert_all_finished(d)


def behind_a_stream(s, long: tuple[int, int], shorts: int, first_short_at: float) -> list[str]:
    """One seat: "first" holds it while L (``long``: prompt, max_tokens) and then a stream of
    ``shorts`` 8-token, 2-token requests arrive, one per step (arrival stamps ``first_short_at``
    + k seconds); run to the end, every request checked; the order they were first admitted in."""
    clock = Clock()
    d = Driver(s)
    arrivals = {0: [req(clock, "first", 8, 2, -1.0), req(clock, "L", *long, 0.0)]}
    for k in range(shorts):
        arrivals.setdefault(k, []).append(req(clock, f"s{k:02d}", 8, 2, first_short_at + k))
    d.run(arrivals=arrivals)
    assert_all_finished(d)
    return d.first_admitted


def test_sjf_starvation_guard_promotes_a_starving_request(build):
    """sjf's starvation counters (CountsSteps.on_steps) move on a live replica: a long request
    does not starve behind a stream of short ones."""
    sjf = {"policy": "sjf", "params": {"starve_steps": 5, "quantum_steps": 5}}
    s = build(num_blocks=100, max_num_seqs=1, max_num_batched_tokens=256, settings=sjf)
    # No predictions yet: sjf ranks by max_tokens, and L (50) would wait behind every short one.
    order = behind_a_stream(s, (8, 50), shorts=40, first_short_at=1.0)
    assert order.index("L") < order.index("s39"), order


@pytest.mark.parametrize("hold_bound_s", [None, 500.0], ids=["unbounded", "bounded"])
def test_the_hold_back_bound_promotes_an_overdue_request_on_a_live_replica(build, hold_bound_s):
    """uniboost's hold_bound_s on vLLM's own scheduler: L (a long prompt) arrived ~1,000 s ago,
    the short ones ~10 s ago. Under γ 0.001 alone L waits behind every short one; with a 500 s
    bound it is overdue on arrival (the arrival stamps are the API server's) and goes first."""
    settings = {**UNIBOOST, "params": {**UNIBOOST["params"], "hold_bound_s": hold_bound_s}}
    s = build(num_blocks=200, max_num_seqs=1, max_num_batched_tokens=512, settings=settings)
    order = behind_a_stream(s, (400, 2), shorts=10, first_short_at=990.0)
    if hold_bound_s is None:
        assert order.index("L") > order.index("s09"), order
    else:
        assert order[:2] == ["first", "L"], order
        assert s.tp_core.states == {}  # nothing left behind (the overdue request finished)


@pytest.mark.parametrize("decode_first", [True, False], ids=["decode-first", "unified"])
def test_decode_first_gives_running_decodes_the_budget_before_prefill_chunks(build, decode_first):
    """D (128-token prompt) is decoding when P (100 tokens, so the better uniboost score) arrives.
    With a 32-token budget P's prefill takes 3 steps: under decode_first D still gets its token in
    each of them; in the unified order P, ranked first, takes the whole budget."""
    clock = Clock()
    settings = {**UNIBOOST, "params": {**UNIBOOST["params"], "decode_first": decode_first}}
    s = build(num_blocks=100, max_num_seqs=4, max_num_batched_tokens=32, settings=settings)
    d = Driver(s)
    d.run(
        arrivals={0: [req(clock, "D", 128, 40, 0.0)]}, steps=6
    )  # D: prefilled in 4 steps, decoding
    assert s.requests["D"].num_output_tokens >= 1
    d.add(req(clock, "P", 100, 4, 1.0))
    d.step()  # P admitted after the running D: D 1 token, P the rest
    record = d.step()
    scheduled = dict(record.scheduled)
    assert s.tp_core.policy.key(s.tp_core.states["P"], 0.0) < s.tp_core.policy.key(
        s.tp_core.states["D"], 0.0
    )
    if decode_first:
        assert record.scheduled[0] == ("D", 1) and scheduled["P"] == 31
    else:
        assert record.scheduled == [("P", 32)]
    d.run()
    assert_all_finished(d)


def test_decode_first_keeps_the_policy_worst_as_the_memory_victim(build):
    """Under decode_first vLLM's running list is [decodes..., prefills...], so running[-1] would be
    the prefilling P; when the decoding D (the worse score: more work) needs a block, the victim
    must still be the policy's worst, D itself. (No policy preemption: a huge margin.)"""
    clock = Clock()
    settings = {
        **UNIBOOST,
        "params": {**UNIBOOST["params"], "preempt_margin": 1e9, "kv_victim": "score"},
    }
    s = build(num_blocks=17, max_num_seqs=4, max_num_batched_tokens=32, settings=settings)
    d = Driver(s)
    d.run(arrivals={0: [req(clock, "D", 140, 60, 0.0)]}, steps=6)
    d.add(req(clock, "P", 100, 4, 1.0))
    for _ in range(12):
        record = d.step()
        if record.preempted:
            break
    assert record.preempted == ["D"] and dict(record.scheduled).get("P", 0) > 1  # P was mid-prefill
    assert s.tp_core.states["D"].policy_preemptions == 0
    d.run()
    assert_all_finished(d)


@pytest.mark.parametrize(
    "cls", [TailpilotScheduler, TailpilotAsyncScheduler], ids=["sync", "async"]
)
def test_slofq_holds_a_throttled_tenant_back_without_stalling_the_engine(build, cls):
    """Every waiting request of an empty-bucket tenant is held: vLLM sees an empty queue for
    admission (no peek on a held request), keeps stepping the running ones, and admits the held
    ones once the bucket has tokens again — none lost, every token count exact."""
    from scheduler.policies.slo_backpressure import Bucket

    clock = Clock()
    s = build(
        cls,
        num_blocks=200,
        max_num_seqs=8,
        max_num_batched_tokens=256,
        settings={"policy": "slofq", "params": {"backpressure": False, "bp_lend": False}},
    )
    d = Driver(s, pipelined=pipelined(cls))
    policy = s.tp_core.policy
    d.add(req(clock, "free", 20, 30, 0.0, tenant="free"))
    d.step()
    held = policy.buckets["held"] = Bucket(rate=1e-9, now=time.time())
    held.level = -1e9  # deep in debt: nothing of "held" may be admitted
    d.add(*[req(clock, f"h{i}", 20, 4, 0.1 + i * 0.01, tenant="held") for i in range(3)])
    for _ in range(5):
        record = d.step()
        assert not any(r.startswith("h") for r in record.admitted)
    assert len(s.waiting) == 3 and not s.waiting  # counted, yet nothing admissible
    assert "held" in policy.first_held
    del policy.buckets["held"]  # released
    d.run()
    assert_all_finished(d)


@pytest.mark.parametrize(
    "cls", [TailpilotScheduler, TailpilotAsyncScheduler], ids=["sync", "async"]
)
def test_slofq_queue_cap_refuses_through_vllms_error_path(build, cls):
    """A tenant at its queue cap: the next request is refused on arrival (never queued), vLLM's own
    error path finishes it at the next step's output (finish reason error) even when nothing else
    is running, the completions log says rejected, /state counts it; the others finish exactly."""
    clock = Clock()
    s = build(
        cls,
        num_blocks=200,
        max_num_seqs=1,
        max_num_batched_tokens=256,
        settings={"policy": "slofq", "params": {"tenants": {"capped": {"queue_cap": 2}}}},
    )
    d = Driver(s, pipelined=pipelined(cls))
    d.add(req(clock, "run", 20, 6, 0.0, tenant="capped"))
    d.step()  # "run" holds the only seat
    d.add(*[req(clock, f"q{i}", 20, 3, 0.1 + i * 0.01, tenant="capped") for i in range(2)])
    d.add(
        req(clock, "over", 20, 3, 0.2, tenant="capped"),
        req(clock, "other", 20, 3, 0.21, tenant="free"),
    )
    assert len(s.waiting) == 3 and "over" in s.requests  # refused: not queued, but vLLM knows it
    d.run()
    assert d.finished.pop("over") == "error" and d.tokens.pop("over", 0) == 0
    del d.requests["over"]
    assert_all_finished(d, rejected={"over"})
    live = s.tp_core.policy.live_state()["tenants"]["capped"]
    assert (live["queue_cap"], live["refused"]) == (2, 1)
    # the queue emptied by aborts while a refusal is pending: the engine still takes the step
    # that ends it (else its client would wait for the next arrival)
    d.add(*[req(clock, f"r{i}", 20, 3, 1.0 + i, tenant="capped") for i in range(3)])
    s.finish_requests(["r0", "r1"], RequestStatus.FINISHED_ABORTED)
    assert len(s.waiting) == 0 and not s.running and s.has_requests()
    d.run()
    assert d.finished == {
        **{rid: "length" for rid in d.requests if rid not in ("r0", "r1", "r2")},
        "r2": "error",
    }
    assert not s.requests and not s._tp_refused


@pytest.mark.parametrize(
    "settings", [{"policy": "vtc"}, {"policy": "slofq"}, FCFS], ids=["vtc", "slofq", "fcfs"]
)
def test_aborting_waiting_requests_of_a_grouped_queue(build, settings):
    """Clients that go away while their requests wait (vLLM's finish_requests: out of the queue,
    then freed). vtc and slofq queue per tenant: each request leaves its group exactly once (a
    second removal crashed the engine); the rest finish exactly, the aborted are logged once."""
    clock = Clock()
    s = build(
        TailpilotScheduler,
        num_blocks=200,
        max_num_seqs=1,
        max_num_batched_tokens=256,
        settings=settings,
    )
    d = Driver(s)
    d.add(req(clock, "run", 20, 4, 0.0, tenant="a"))
    d.step()
    d.add(*[req(clock, f"w{i}", 20, 3, 0.1 + i * 0.01, tenant="ab"[i % 2]) for i in range(5)])
    s.finish_requests(["w0", "w2", "w3"], RequestStatus.FINISHED_ABORTED)
    assert len(s.waiting) == 2
    for rid in ("w0", "w2", "w3"):
        del d.requests[rid]
    d.run()
    aborted, _ = s.tp_core.completions_since(0)
    assert sorted(c["id"] for c in aborted if c["reason"] == "finished_aborted") == [
        "w0",
        "w2",
        "w3",
    ]
    assert d.finished == {"run": "length", "w1": "length", "w4": "length"}
    assert not s.requests and s.tp_core.states == {} and len(s.tp_core.waiting) == 0
    # the fair queues know the aborted ones left: no tenant stays "backlogged" (its counter lift)
    assert not any(getattr(s.tp_core.policy, "backlog", {}).values())


def test_a_hostile_tenant_label_is_made_storable_and_never_refuses_its_request(build):
    """A client's tenant label is its own to choose: a lone surrogate (which UTF-8 cannot carry),
    control characters, a megabyte of text, an empty string or a number. Each request is served
    under a cleaned label, and /state — in flight and in the completions log — stays strict JSON
    that names the tenants readably (the collector reads it; a 500 there would stall its
    cursor)."""
    clock = Clock()
    s = build(num_blocks=200, max_num_seqs=4, max_num_batched_tokens=256, settings=SLOFQ)
    d = Driver(s)
    labels = {"sur": "bad\ud800", "ctl": "a\x00b\nc", "big": "x" * 10**6, "empty": "", "num": 5}
    d.add(
        *[req(clock, rid, 20, 3, i * 0.01, tenant=t) for i, (rid, t) in enumerate(labels.items())]
    )
    d.step()
    cleaned = {rid: s.tp_core.states[rid].tenant for rid in labels}
    assert cleaned == {
        "sur": "bad\ufffd",
        "ctl": "a\ufffdb\ufffdc",
        "big": "x" * NAME_MAX_CHARS,
        "empty": "default",
        "num": "5",
    }
    assert json.loads(encode_json(s.api_inflight(100)))["requests"]
    d.run()
    assert_all_finished(d)
    done = json.loads(encode_json(s.api_state(0)))["completions"]
    assert {c["id"]: c["tenant"] for c in done} == cleaned


def test_a_request_type_the_engine_does_not_know_is_served_as_chat(build):
    """A client's ``type`` outside the engine's five is served, logged and reported as chat
    (``scheduler.names.request_type``: the same rule the autopilot's feed applies to what a
    replica reports); a known type keeps its name."""
    clock = Clock()
    s = build(num_blocks=200, max_num_seqs=4, max_num_batched_tokens=256)
    d = Driver(s)
    types = {"made": "made-up", "num": 5, "reason": "reasoning"}
    d.add(*[req(clock, rid, 20, 3, i * 0.01, type=t) for i, (rid, t) in enumerate(types.items())])
    d.step()
    served = {rid: s.tp_core.states[rid].type for rid in types}
    assert served == {"made": "chat", "num": "chat", "reason": "reasoning"}
    d.run()
    assert_all_finished(d)
    done = json.loads(encode_json(s.api_state(0)))["completions"]
    assert {c["id"]: c["type"] for c in done} == served


def test_a_taken_control_port_stops_start_up_with_the_variable_named(build):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        with pytest.raises(PluginEnvError) as raised:
            build(num_blocks=64, max_num_seqs=4, max_num_batched_tokens=256, api_port=busy)
    message = str(raised.value)
    assert f"TAILPILOT_API_PORT={busy}" in message and "cannot listen" in message
    # a free port: the same build starts and its control API answers on it
    scheduler = build(num_blocks=64, max_num_seqs=4, max_num_batched_tokens=256, api_port=0)
    assert scheduler.tp_server is not None and scheduler.tp_server.port > 0

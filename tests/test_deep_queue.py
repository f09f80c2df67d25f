"""The waiting queue's grouped layouts (scheduler.policies.queue) yield exactly the policy's order.

* Driven directly: random arrivals, admissions of the head, preemptions back into the queue (with
  more work attained), aborts, γ / β changes and predictor refits (new epochs), sjf starvation
  promotions and partial reads; after every operation the order read from the queue, as far as it
  is read, is the sort of the waiting requests by their keys (score, arrival, id) computed afresh.
* In the simulator: replays with the grouped layouts, lazy sjf step counting and the inlined sort
  keys are identical, completion by completion, to replays with the plain re-sorted list, eager
  counting and the policies' plain ``key`` (``naive()``), on random small traces and on a deep
  queue.
"""

from __future__ import annotations

import contextlib
import itertools
import random
from unittest import mock

import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from scheduler import compiled
from scheduler.policies import POLICY_CLASSES, RequestState, make_policy
from scheduler.policies import queue as queue_mod
from scheduler.policies.base import Policy, new_epoch
from scheduler.policies.boost import UniBoost
from scheduler.policies.capabilities import CountsSteps
from scheduler.policies.predictors import HistoryPredictor
from scheduler.policies.queue import WaitingQueue
from scheduler.policies.queue_groups import OffsetGroups
from scheduler.policies.size import Sjf, Srpt
from scheduler.settings import Settings
from sim.engine import EngineConfig, Simulator
from sim.stepmodel import StepTimeModel
from sim.traces import TraceRequest

# The tests that compare the fast paths with a plain reference swap the library's internals for it
# (mock.patch). On the compiled core a swap cannot reach compiled code — the "reference" would be
# the fast path itself — so there they run on the pure sources instead:
# tests/test_compiled_core.py runs `-m pure_path` of this module in a copy without the core.
PURE_PATH = [
    pytest.mark.pure_path,
    pytest.mark.skipif(
        compiled.is_compiled(),
        reason="run on the pure sources by test_compiled_core.py (the core is compiled here)",
    ),
]


def on_pure_path(test):
    """Mark a test ``PURE_PATH``."""
    for mark in PURE_PATH:
        test = mark(test)
    return test


STEP_MODEL = StepTimeModel(
    a=0.0101, b=7.3e-5, c=1.1e-9, d=3.7e-4, e=1.3e-6, name="test", source="test"
)

QUEUE_POLICIES = {
    # name: (policy, params, layout expected)
    "uniboost": ("uniboost", {"quant_base_tokens": 16, "alpha_s_per_token": 1e-3}, "offsets"),
    "uniboost-nomg": ("uniboost", {"memguard": False, "alpha_s_per_token": 1e-3}, "offsets"),
    "sjf": ("sjf", {"predictor": "history", "starve_steps": 5}, "groups"),
    "srpt": ("srpt", {"predictor": "history"}, "groups"),
    "tie": ("tie", {"predictor": "history"}, "groups"),
    "vtc": ("vtc", {}, "groups"),
    "las": ("las", {"q0_s": 0.003}, None),
    "fcfs": ("fcfs", {}, None),
}
PROMPTS = [1, 5, 16, 17, 40, 100, 300, 1000]


def make(name: str, **extra) -> Policy:
    policy, params, _ = QUEUE_POLICIES[name]
    return make_policy(Settings.model_validate({"policy": policy, "params": {**params, **extra}}))


def teach(predictor, rng: random.Random, n: int = 60) -> None:
    """Give the history predictor fits that differ by tenant, type and prompt bucket."""
    for _ in range(n):
        r = RequestState(
            id="h",
            arrival=0.0,
            prompt_tokens=rng.choice(PROMPTS),
            max_tokens=500,
            tenant=rng.choice(["t0", "t1", "t2"]),
            type=rng.choice(["chat", "batch"]),
        )
        predictor.observe(r, int(rng.lognormvariate(3.0 + (r.type == "batch"), 1.0)) + 1)
    predictor.refit()


def test_layouts():
    for name, (_, _, layout) in QUEUE_POLICIES.items():
        assert make(name).waiting_layout() == layout, name
    # γ fixed: no epochs to speak of.
    assert make("uniboost", gamma_ada=False).waiting_layout() is None
    assert make("sjf", predictor="oracle").waiting_layout() is None  # a prediction per request


class Driver:
    """Plays the engine's part against one queue, checking the order after every operation."""

    def __init__(self, name: str, seed: int, narrow: bool = False) -> None:
        self.rng = rng = random.Random(seed)
        # Narrow: few distinct tenants, types, prompts and caps, so groups hold many requests.
        self.tenants = ["t0"] if narrow else ["t0", "t1", "t2"]
        self.types = ["chat"] if narrow else ["chat", "batch"]
        self.prompts = [16, 300] if narrow else PROMPTS
        self.caps = [200] if narrow else [10, 50, 200]
        self.policy = make(name)
        if isinstance(self.policy.predictor, HistoryPredictor):
            teach(self.policy.predictor, rng)
        self.queue = WaitingQueue(self.policy)
        self.now = 0.0
        self.ids = itertools.count()
        self.waiting: list[RequestState] = []
        self.running: list[RequestState] = []

    def expected(self) -> list[RequestState]:
        key = self.policy.key
        return sorted(self.waiting, key=lambda r: key(r, self.now))

    def check(self, depth: int) -> None:
        """Read ``depth`` requests of the order (all if negative) and compare."""
        view = self.queue.ordered(self.now)
        self.queue.check_order()
        want = self.expected()
        assert len(view) == len(want) and bool(view) == bool(want)
        if want:
            assert view[0] is want[0]
        got = list(itertools.islice(iter(view), depth)) if depth >= 0 else list(view)
        assert [r.id for r in got] == [r.id for r in want[: len(got)]]
        if depth < 0:
            assert len(got) == len(want)
        if self.policy.name == "vtc":  # tenant heads straight from the queue's groups
            first = list(itertools.islice(self.policy.admission_order(view, self.now), 5))
            naive = list(itertools.islice(self.policy.admission_order(want, self.now), 5))
            assert [r.id for r in first] == [r.id for r in naive]
        self.queue.check_order()

    def arrive(self) -> None:
        rng = self.rng
        if self.waiting and rng.random() < 0.2:
            arrival = rng.choice(self.waiting).arrival  # a tie on arrival: the id decides
        else:
            self.now += rng.choice([0.0, 0.001, 0.3])
            arrival = self.now
        r = RequestState(
            id=f"r{next(self.ids):04d}",
            arrival=arrival,
            prompt_tokens=rng.choice(self.prompts),
            max_tokens=rng.choice(self.caps),
            tenant=rng.choice(self.tenants),
            type=rng.choice(self.types),
            enqueued_at=self.now,
        )
        self.queue.push(r, self.now)
        self.policy.on_arrival(r, self.now)
        self.waiting.append(r)

    def admit(self, k: int) -> None:
        view = self.queue.ordered(self.now)
        taken = list(itertools.islice(iter(view), k))
        self.queue.remove(taken)
        for r in taken:
            self.waiting.remove(r)
            r.status = "running"
            self.policy.on_admit(r, self.now, 1)
            self.running.append(r)

    def preempt(self) -> None:
        """A running request goes back, having attained more work (recompute: KV lost)."""
        if not self.running:
            return
        rng = self.rng
        r = self.running.pop(rng.randrange(len(self.running)))
        served = rng.choice([1, 7, 64, 600])
        r.generated += rng.choice([0, 1, 3, served])
        r.computed_tokens = min(r.prompt_tokens + r.generated, r.computed_tokens + served)
        r.note_progress()
        if self.policy.name == "sjf":
            r.unscheduled_steps = rng.choice([0, 2, 9])
        r.computed_tokens = 0
        self.queue.push(r, self.now, front=True)
        self.policy.on_preempt(r, self.now, True)
        self.waiting.append(r)

    def abort(self) -> None:
        if self.waiting:
            r = self.waiting.pop(self.rng.randrange(len(self.waiting)))
            self.queue.remove([r])
            r.status = "finished"

    def new_epoch(self) -> None:
        p, rng = self.policy, self.rng
        if isinstance(p, UniBoost):
            p.gamma = rng.choice([0.001, 0.05, 1.0, 3.7, 10.0, p.gamma * 1.0001])
            p.epoch = new_epoch()
        elif p.name == "tie" and rng.random() < 0.5:
            p.beta = rng.choice([0.1, 0.27, 0.5])
            p.epoch = new_epoch()
        elif isinstance(p.predictor, HistoryPredictor):
            teach(p.predictor, rng, 20)
            p.before_step(self.queue, self.now)  # sees the refit: a new epoch
        elif p.name == "las":
            p.epoch = new_epoch()

    def promote(self) -> None:
        """sjf: a waiting request reaches its starvation limit; las: a promotion to level 0."""
        p = self.policy
        if not self.waiting or p.name not in ("sjf", "las"):
            return
        r = self.rng.choice(self.waiting)
        if p.name == "sjf":
            r.unscheduled_steps = p.params.starve_steps
        else:
            r.las_base = r.attained
            r.score_epoch = -1
        p.moved.append(r)

    def step(self, op: int, arg: int) -> None:
        [
            self.arrive,
            self.arrive,
            self.arrive,
            lambda: self.admit(arg % 3 + 1),
            self.preempt,
            self.abort,
            self.new_epoch,
            self.promote,
        ][op]()
        if self.rng.random() < 0.5:  # a full read (rare) materializes the whole order
            self.check(-1 if arg == 0 else [0, 1, 1, 2, 5][arg % 5])


@pytest.mark.parametrize("scan", [None, pytest.param(0, marks=PURE_PATH)], ids=["", "vectorized"])
@pytest.mark.parametrize("name", list(QUEUE_POLICIES))
@hsettings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), narrow=st.booleans(), n_ops=st.integers(1, 300))
def test_queue_order_is_the_sort_of_fresh_keys(name, scan, seed, narrow, n_ops):
    if scan is not None and QUEUE_POLICIES[name][2] != "offsets":
        return
    with contextlib.ExitStack() as stack:
        if scan is not None:  # uniboost's vectorized shortlist even for a handful of groups
            stack.enter_context(mock.patch.object(OffsetGroups, "_SCAN", scan))
        d = Driver(name, seed, narrow)
        ops = random.Random(seed ^ 0x5EED)  # long operation sequences: deep queues, many epochs
        for _ in range(n_ops):
            d.step(ops.randrange(8), ops.randrange(100))
        d.check(1)
        while d.waiting:  # drain through the head, as admission does
            d.admit(1)
            d.check(d.rng.choice([0, 1, 3]))


def test_queue_switches_layout_keeping_every_request():
    d = Driver("uniboost", 7)
    for i in range(200):
        d.step(i % 8, i)
    for name in ("tie", "fcfs", "vtc", "uniboost-nomg", "las"):
        policy = make(name)
        d.queue.set_policy(policy)
        d.policy = policy
        d.check(-1)


# --- the simulator: grouped layouts against the plain one ----------------------------------------


@contextlib.contextmanager
def naive():
    """The straightforward implementation: one re-sorted list for every policy, sjf counting every
    waiting request's steps one by one, and the policies' plain key functions."""

    def guarded_first(self, now):
        if not self.params.memguard:
            return Policy.sort_key(self, now)
        return lambda r: (r.attained >= r.guard_tokens, self.key(r, now))

    init = UniBoost.__init__

    def plain_init(self, *a, **kw):
        init(self, *a, **kw)
        self.incremental_running_order = False

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(queue_mod, "make_index", lambda policy: None))
        eager = CountsSteps.on_waiting_steps  # every waiting request's steps, one by one
        stack.enter_context(mock.patch.object(Sjf, "on_waiting_steps", eager))
        for cls in (UniBoost, Sjf, Srpt):
            stack.enter_context(mock.patch.object(cls, "sort_key", Policy.sort_key))
        stack.enter_context(mock.patch.object(UniBoost, "running_sort_key", guarded_first))
        stack.enter_context(mock.patch.object(UniBoost, "__init__", plain_init))
        yield


def replay(reqs, settings, config, event_skipping=True):
    sim = Simulator(reqs, settings, config, event_skipping=event_skipping, check_invariants=True)
    res = sim.run()
    return [
        (c.id, c.scheduled_at, c.first_token_at, c.finished_at, c.preemptions, c.recomputed_tokens)
        for c in res.completions
    ], res.steps


SIM_PARAMS = {
    "sjf": {"predictor": "history", "starve_steps": 7, "quantum_steps": 3},
    "srpt": {"predictor": "history"},
    "tie": {"predictor": "history"},
    "las": {"q0_s": 0.003, "starve_s": 0.4},
    "uniboost": {
        "gamma": 2.0,
        "quant_base_tokens": 16,
        "ada_interval_s": 0.3,
        "ada_min_samples": 3,
        "ada_window": 10,
        "alpha_s_per_token": 1e-3,
    },
    "vtc": {"weights": {"t1": 2.0}},
}


@st.composite
def deep_scenarios(draw):
    """Bursts of many requests on a small engine: queues of tens, refits and γ moves while they
    wait."""
    n = draw(st.integers(5, 60))
    bs = draw(st.sampled_from([4, 16]))
    reqs = []
    for i in range(n):
        out = draw(st.integers(1, 40))
        reqs.append(
            TraceRequest(
                id=f"r{i:03d}",
                arrival=round(draw(st.floats(0.0, 1.5)), 3),
                prompt_tokens=draw(st.sampled_from(PROMPTS[:6])),
                output_tokens=out,
                max_tokens=draw(st.sampled_from([out, out + 7, max(1, out - 3)])),
                tenant=draw(st.sampled_from(["t0", "t1", "t2"])),
                type=draw(st.sampled_from(["chat", "batch"])),
            )
        )
    biggest = max(-(-(r.prompt_tokens + min(r.output_tokens, r.max_tokens)) // bs) for r in reqs)
    blocks = draw(st.integers(biggest, biggest * 3))
    policy = draw(st.sampled_from(["sjf", "srpt", "tie", "vtc", "uniboost", "las", "fcfs"]))
    params = dict(SIM_PARAMS.get(policy, {}))
    if policy == "uniboost":
        params["memguard"] = draw(st.booleans())
        params["hold_bound_s"] = draw(st.sampled_from([None, 0.1, 0.6]))
    engine = {
        "max_num_seqs": draw(st.integers(1, 6)),
        "max_num_batched_tokens": draw(st.integers(8, 200)),
        "long_prefill_token_threshold": draw(st.sampled_from([0, 0, 5, 40])),
    }
    settings = Settings.model_validate({"policy": policy, "params": params, "engine": engine})
    return (
        reqs,
        settings,
        EngineConfig(
            num_gpu_blocks=blocks, block_size=bs, step_model=STEP_MODEL, refit_interval_s=0.2
        ),
    )


@pytest.mark.slow
@on_pure_path
@hsettings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(deep_scenarios(), st.booleans())
def test_simulator_replay_identical_to_the_plain_queue(case, event_skipping):
    reqs, settings, config = case
    fast = replay(reqs, settings, config, event_skipping)
    with naive():
        slow = replay(reqs, settings, config, event_skipping)
    assert fast == slow


def deep_trace(n: int = 400, seed: int = 3) -> list[TraceRequest]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(40.0)
        o = rng.randint(1, 60)
        out.append(
            TraceRequest(
                id=f"d{i:04d}",
                arrival=round(t, 6),
                prompt_tokens=rng.randint(200, 1200),
                output_tokens=o,
                max_tokens=rng.choice([o, 64]),
                tenant=f"t{i % 3}",
            )
        )
    return out


@on_pure_path
@pytest.mark.parametrize("case", [*sorted(POLICY_CLASSES), "uniboost+hold"])
def test_deep_queue_replay_identical_to_the_plain_queue(case):
    """Hundreds waiting at once, every policy (uniboost with γ-Ada moving γ every 0.5 s; and with
    a hold-back bound that makes hundreds overdue while γ moves)."""
    policy = case.split("+")[0]
    params = {
        "uniboost": {"ada_interval_s": 0.5, "ada_min_samples": 20},
        "uniboost+hold": {"ada_interval_s": 0.5, "ada_min_samples": 20, "hold_bound_s": 2.0},
        "sjf": {"predictor": "history", "starve_steps": 40},
        "srpt": {"predictor": "history"},
        "tie": {"predictor": "history"},
    }.get(case, {})
    settings = Settings.model_validate(
        {
            "policy": policy,
            "params": params,
            "engine": {"max_num_seqs": 16, "max_num_batched_tokens": 512},
        }
    )
    config = EngineConfig(
        num_gpu_blocks=900, block_size=16, step_model=STEP_MODEL, refit_interval_s=1.0
    )
    reqs = deep_trace()
    sim = Simulator(reqs, settings, config, check_invariants=True)
    peak = 0
    while sim.next_arrival < len(sim.arrivals) or sim.waiting or sim.running:
        if not sim.waiting and not sim.running:
            sim.now = max(sim.now, sim.arrivals[sim.next_arrival].arrival)
        sim._step()
        peak = max(peak, len(sim.waiting))
    assert peak > 200  # a deep queue
    fast = [
        (c.id, c.scheduled_at, c.first_token_at, c.finished_at, c.preemptions)
        for c in sim.completions
    ]
    with naive():
        res = Simulator(reqs, settings, config).run()
    assert fast == [
        (c.id, c.scheduled_at, c.first_token_at, c.finished_at, c.preemptions)
        for c in res.completions
    ]
    if policy == "uniboost":
        assert len({g for _, g in res.gamma_timeline}) > 5  # γ moved while the queue was deep
    if case == "uniboost+hold":  # the bound made many overdue while they waited
        assert sum(c.scheduled_at - c.arrival > 2.0 for c in res.completions) > 50

"""Property-based checks of the engine simulator over every policy
(docs/engine.md#scheduling-step)."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from scheduler.settings import POLICY_NAMES, Settings
from sim.engine import EngineConfig, Simulator
from sim.stepmodel import StepTimeModel
from sim.traces import TraceRequest

# Deliberately non-round coefficients so step boundaries never coincide with arrival times.
STEP_MODEL = StepTimeModel(
    a=0.0101, b=7.3e-5, c=1.1e-9, d=3.7e-4, e=1.3e-6, name="test", source="test"
)

POLICY_PARAMS = {
    "sjf": {"predictor": "oracle", "starve_steps": 7, "quantum_steps": 3},
    "srpt": {"predictor": "oracle", "sigma_noise": 0.5},
    "las": {"q0_s": 0.003, "starve_s": 0.4},
    "distboost": {"gamma": 3.0},
    "uniboost": {
        "gamma": 2.0,
        "quant_base_tokens": 16,
        "ada_interval_s": 0.3,
        "ada_min_samples": 3,
        "ada_window": 10,
        "alpha_s_per_token": 1e-3,
    },
    "tie": {"predictor": "oracle", "sigma_noise": 0.3},
    "vtc": {"weights": {"t1": 2.0}},
}


@st.composite
def scenarios(draw):
    n = draw(st.integers(1, 18))
    bs = draw(st.sampled_from([4, 16]))
    reqs = []
    for i in range(n):
        prompt = draw(st.integers(1, 200))
        out = draw(st.integers(1, 60))
        reqs.append(
            TraceRequest(
                id=f"r{i:03d}",
                arrival=round(draw(st.floats(0.0, 3.0)), 4),
                prompt_tokens=prompt,
                output_tokens=out,
                max_tokens=draw(st.sampled_from([out, out + 7, max(1, out - 3)])),
                tenant=draw(st.sampled_from(["t0", "t1", "t2"])),
            )
        )
    biggest = max(-(-(r.prompt_tokens + min(r.output_tokens, r.max_tokens)) // bs) for r in reqs)
    blocks = draw(st.integers(max(1, biggest - 3), biggest * 4))  # sometimes too small: rejections
    policy = draw(st.sampled_from(POLICY_NAMES))
    params = dict(POLICY_PARAMS.get(policy, {}))
    if policy == "uniboost":
        params["memguard"] = draw(st.booleans())
        params["gamma_ada"] = draw(st.booleans())
        params["hold_bound_s"] = draw(st.sampled_from([None, None, 0.05, 0.5]))
        params["preempt_max_utilisation"] = draw(st.sampled_from([0.8, 0.8, 0.3, None]))
    engine = {
        "max_num_seqs": draw(st.integers(1, 8)),
        "max_num_batched_tokens": draw(st.integers(8, 300)),
        "long_prefill_token_threshold": draw(st.sampled_from([0, 0, 5, 40])),
    }
    settings = Settings.model_validate({"policy": policy, "params": params, "engine": engine})
    return (
        reqs,
        settings,
        EngineConfig(
            num_gpu_blocks=blocks,
            block_size=bs,
            step_model=STEP_MODEL,
            refit_interval_s=0.5,
            prefix_caching=draw(st.booleans()),
        ),
    )


class ClockedSimulator(Simulator):
    """Records the clock at every iteration so the test can see it never goes backwards."""

    def _step(self):
        self.clock = getattr(self, "clock", [])
        self.clock.append(self.now)
        super()._step()


def run(reqs, settings, config, event_skipping=True):
    sim = ClockedSimulator(
        reqs, settings, config, event_skipping=event_skipping, check_invariants=True
    )
    return sim, sim.run()


PROPS = hsettings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPS
@given(scenarios())
def test_every_request_finishes_once_with_its_tokens(case):
    reqs, settings, config = case
    _sim, res = run(reqs, settings, config)
    ids = [c.id for c in res.completions]
    assert len(ids) == len(set(ids)), "a request finished twice"
    assert set(ids) | set(res.rejected) == {r.id for r in reqs}
    assert not set(ids) & set(res.rejected)
    by_id = {r.id: r for r in reqs}
    for c in res.completions:
        r = by_id[c.id]
        assert c.output_tokens == min(r.output_tokens, r.max_tokens)
        assert c.arrival <= c.scheduled_at <= c.first_token_at <= c.finished_at
    for rid in res.rejected:  # only what could never fit is rejected
        r = by_id[rid]
        assert (
            -(-(r.prompt_tokens + min(r.output_tokens, r.max_tokens)) // config.block_size)
            > config.num_gpu_blocks
        )


@PROPS
@given(scenarios())
def test_kv_blocks_within_capacity_and_all_free_at_end(case):
    reqs, settings, config = case
    sim, _ = run(reqs, settings, config)  # check_invariants asserts capacity after every event
    assert sim.free_blocks == config.num_gpu_blocks
    assert not sim.blocks and not sim.running and not sim.waiting


@PROPS
@given(scenarios())
def test_clock_never_goes_backwards(case):
    reqs, settings, config = case
    sim, res = run(reqs, settings, config)
    assert all(b >= a for a, b in zip(sim.clock, sim.clock[1:]))
    assert all(c.finished_at <= res.sim_time_s for c in res.completions)


@PROPS
@given(scenarios())
def test_same_input_same_result(case):
    reqs, settings, config = case
    _, a = run(reqs, settings, config)
    _, b = run(list(reversed(reqs)), settings, config)  # input order must not matter either
    assert [(c.id, c.first_token_at, c.finished_at, c.preemptions) for c in a.completions] == [
        (c.id, c.first_token_at, c.finished_at, c.preemptions) for c in b.completions
    ]


@hsettings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_event_skipping_matches_step_by_step(case):
    reqs, settings, config = case
    _, fast = run(reqs, settings, config, event_skipping=True)
    _, slow = run(reqs, settings, config, event_skipping=False)
    assert fast.steps == slow.steps
    assert fast.preemptions == slow.preemptions
    assert fast.rejected == slow.rejected
    got = {c.id: c for c in fast.completions}
    for c in slow.completions:
        f = got[c.id]
        assert (f.preemptions, f.output_tokens) == (c.preemptions, c.output_tokens), c.id
        for field in ("scheduled_at", "first_token_at", "finished_at"):
            assert math.isclose(getattr(f, field), getattr(c, field), rel_tol=1e-9, abs_tol=1e-9), (
                c.id,
                field,
            )


@hsettings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.floats(0.01, 0.7))
def test_advance_to_in_slices_matches_one_run(case, slice_s):
    """A live twin advances the simulator to its clock in slices; the slices change nothing,
    and no stretch of steps runs past the slice's end."""
    reqs, settings, config = case
    _, whole = run(reqs, settings, config)
    sim = Simulator(reqs, settings, config, check_invariants=True)
    t = sim.now  # the clock starts at the first arrival
    while sim.next_arrival < len(sim.arrivals) or sim.waiting or sim.running:
        t += slice_s
        sim.advance_to(t)
        assert sim.now < t + 0.05  # past t by at most one step (these steps take < 50 ms)
    assert sim.steps == whole.steps and sim.rejected == whole.rejected
    got = {c.id: c for c in sim.completions}
    assert set(got) == {c.id for c in whole.completions}
    for c in whole.completions:
        assert math.isclose(got[c.id].finished_at, c.finished_at, rel_tol=1e-9, abs_tol=1e-9), c.id


def _kv_blocked_deep_queue() -> list[TraceRequest]:
    """60 long prompts from three tenants, 10 ms apart: on 120 blocks of 16 tokens a few fit at
    once, so admission stops on KV while most wait."""
    return [
        TraceRequest(
            id=f"r{i:03d}",
            arrival=0.01 * i,
            prompt_tokens=300 + 37 * (i % 5),
            output_tokens=40 + 13 * (i % 7),
            max_tokens=200,
            tenant=f"t{i % 3}",
        )
        for i in range(60)
    ]


def _assert_skips_with_the_step_by_step_schedule(settings: Settings) -> None:
    """``settings`` replays the KV-blocked deep queue in under half the loop iterations of the
    step-by-step run, with its steps, preemptions and timestamps."""
    config = EngineConfig(num_gpu_blocks=120, block_size=16, step_model=STEP_MODEL)
    _, fast = run(_kv_blocked_deep_queue(), settings, config, event_skipping=True)
    _, slow = run(_kv_blocked_deep_queue(), settings, config, event_skipping=False)
    assert fast.steps == slow.steps and fast.preemptions == slow.preemptions
    assert fast.iterations < 0.5 * slow.iterations, (fast.iterations, slow.iterations)
    got = {c.id: c for c in fast.completions}
    for c in slow.completions:
        for field in ("scheduled_at", "first_token_at", "finished_at"):
            assert math.isclose(getattr(got[c.id], field), getattr(c, field), abs_tol=1e-9)


def test_vtc_skips_a_kv_blocked_stretch_and_matches_step_by_step():
    """Admission stops on KV at the head of the least-charged tenant, and nothing changes until
    another backlogged tenant's counter passes it — VTC advances those decode steps as one event
    (it used to stop every step) with the schedule of the step-by-step run."""
    _assert_skips_with_the_step_by_step_schedule(
        Settings.model_validate(
            {"policy": "vtc", "params": POLICY_PARAMS["vtc"], "engine": {"max_num_seqs": 16}}
        )
    )


def test_sjf_skips_a_kv_blocked_stretch_past_a_starving_head_and_matches_step_by_step():
    """With a short starvation limit requests soon wait past it at the top of the queue while
    admission stays KV-blocked. Nothing changes until the next one reaches its limit, so the
    decode steps between are one event (sjf used to stop at every step while anyone was
    starving), with the step-by-step run's schedule."""
    _assert_skips_with_the_step_by_step_schedule(
        Settings.model_validate(
            {
                "policy": "sjf",
                "params": {"predictor": "oracle", "starve_steps": 30, "quantum_steps": 3},
                "engine": {"max_num_seqs": 16},
            }
        )
    )


@pytest.mark.parametrize(
    "policy, params",
    [
        ("srpt", {"predictor": "oracle"}),
        ("uniboost", {"gamma_ada": False}),
        ("uniboost", {"gamma_ada": False, "hold_bound_s": 0.5}),
    ],
)
def test_preemptive_policies_skip_a_kv_blocked_stretch_with_a_seat_free(policy, params):
    """Seats free, admission stopped on KV, the head of the queue short of blocks and no victim
    that makes it fit: nothing changes until a completion, so the decode steps between are one
    event (preemptive policies used to stop at every step while a seat was free), with the
    step-by-step run's schedule."""
    _assert_skips_with_the_step_by_step_schedule(
        Settings.model_validate(
            {"policy": policy, "params": params, "engine": {"max_num_seqs": 16}}
        )
    )


def test_uniboost_without_memguard_skips_a_stretch_past_its_preemption_limit():
    """Without MemGuard a running request's score rises every step, and uniboost's own bound ends
    a stretch where one could become a victim. Past ``preempt_max_utilisation`` no policy
    preemption can happen while the steps stay pure decodes (they keep the seats and only take
    blocks), so the decode steps up to a completion are one event (it stopped every step: 4.2×
    fcfs on the Mooncake deep queue), with the step-by-step run's schedule."""
    _assert_skips_with_the_step_by_step_schedule(
        Settings.model_validate(
            {
                "policy": "uniboost",
                "params": {"gamma_ada": False, "memguard": False, "preempt_max_utilisation": 0.5},
                "engine": {"max_num_seqs": 16},
            }
        )
    )

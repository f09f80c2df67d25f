"""slofq is work-conserving (issue 23, point 6; docs/policies.md#slofq): a backpressure bucket or an
operator's throttle decides who goes *first*, never whether a free seat stays empty. Capacity idles
only under ``type_isolation: hard`` (or ``bp_lend: false``), and the live state then says so.

The scenarios: issue 23's (three quiet tenants, one heavy tenant at 10× each one's rate, load 1.0;
``benchmarks/noisy_neighbour.py``'s ``heavy_tenant``) and the README's noisy neighbour (one tenant
bursting to 10×; ``tests/test_slofq.py``)."""

from __future__ import annotations

import pytest

from benchmarks.noisy_neighbour import HEAVY_QUIET, heavy_tenant
from scheduler.metrics.fairness import window_report
from scheduler.policies import RequestState, make_policy
from scheduler.policies.slo_backpressure import Bucket
from scheduler.settings import Settings, SloFqParams
from sim.engine import EngineConfig, Simulator
from sim.noisy import capacity


def slofq(**params) -> Settings:
    engine = params.pop("engine", {})
    return Settings.model_validate({"policy": "slofq", "params": params, "engine": engine})


def state(
    rid: str, tenant: str, arrival: float, prompt: int = 10, type: str = "chat"
) -> RequestState:
    return RequestState(
        id=rid, arrival=arrival, prompt_tokens=prompt, max_tokens=10, tenant=tenant, type=type
    )


def admit_all(p, waiting, now, seats: int) -> list[str]:
    """Admission as an engine runs it, with ``seats`` free: each request the policy yields is
    admitted (on_admit) until the seats are gone."""
    out = []
    for r in p.admission_order(waiting, now):
        if len(out) == seats:
            break
        p.on_admit(r, now, r.prompt_tokens)
        out.append(r.id)
    return out


def empty_bucket(p, tenant: str) -> None:
    p.buckets[tenant] = Bucket(rate=1.0, now=0.0)
    p.buckets[tenant].level = -1e6  # deep in debt


# --- the admission rule -------------------------------------------------------------------


def test_a_throttled_tenant_goes_last_but_takes_every_seat_nobody_else_wants():
    p = make_policy(slofq(engine={"max_num_seqs": 16}))
    noisy = [state(f"n{i}", "noisy", 0.1 * i) for i in range(12)]
    quiet = [state("q0", "quiet", 0.5)]
    for r in noisy + quiet:
        p.on_arrival(r, 0.0)
    empty_bucket(p, "noisy")
    # Scarce (one seat): the quiet tenant first although it arrived last.
    order = list(p.admission_order(noisy + quiet, 0.6))
    assert order[0].id == "q0"
    # Not scarce (16 seats): everyone is admitted, the throttled tenant after the quiet one.
    assert admit_all(p, noisy + quiet, 0.6, seats=16) == ["q0"] + [r.id for r in noisy]
    assert p.first_held["noisy"] == 0.6  # it was passed over once: the backpressure's reaction
    assert p.live_state()["held_back"] is None


def test_a_throttle_orders_and_never_idles():
    """The governor's or an operator's throttle: the tenant yields to others' waiting requests,
    but seats nobody waits for are its own, whatever its weight's share of them."""
    p = make_policy(
        slofq(
            throttle={"low": 0.5},
            backpressure=False,
            tenants={"big": {"weight": 3.0}},
            engine={"max_num_seqs": 16},
        )
    )
    big = [state(f"b{i}", "big", 0.0) for i in range(4)]
    low = [state(f"l{i}", "low", 0.0) for i in range(8)]
    for r in big + low:
        p.on_arrival(r, 0.0)
    p.used.pending["low"] += 3000.0
    p.before_step(big + low, 1.0)
    assert p.buckets["low"].level <= 0.0
    assert admit_all(p, big + low, 1.0, seats=16) == [
        r.id for r in big + low
    ]  # 12 seats free after big's


def test_hard_isolation_may_idle_and_its_live_state_says_so():
    p = make_policy(
        slofq(
            type_shares={"chat": 0.5, "batch": 0.3},
            type_isolation="hard",
            backpressure=False,
            engine={"max_num_batched_tokens": 100},
        )
    )
    chat = state("c", "x", 0.0, type="chat")
    p.on_arrival(chat, 0.0)
    p.steps.pending[""] += 10
    p.typed.pending["chat"] += 700.0  # at its cap: 1 − 0.3 of the window budget
    assert list(p.admission_order([chat], 1.0)) == []
    held = p.live_state()["held_back"]
    assert (
        held["reason"] == "type_isolation: hard"
        and held["types"] == ["chat"]
        and held["since_s"] == 1.0
    )
    p.typed.pending["chat"] -= 700.0  # under the cap again: admitted, and the live state clears
    assert [r.id for r in p.admission_order([chat], 2.0)] == ["c"]
    assert p.live_state()["held_back"] is None


def test_no_lending_is_an_explicit_hold_and_says_so():
    p = make_policy(slofq(bp_lend=False))
    reqs = [state(f"n{i}", "noisy", 0.0) for i in range(3)]
    for r in reqs:
        p.on_arrival(r, 0.0)
    empty_bucket(p, "noisy")
    assert list(p.admission_order(reqs, 1.0)) == []
    held = p.live_state()["held_back"]
    assert held["reason"] == "bp_lend: false" and held["tenants"] == ["noisy"]


def test_the_step_budget_serves_throttled_tenants_last():
    """Work-conserving admission lets a throttled tenant's backlog fill the seats; the running
    order (the token budget's order, the memory-pressure victim last) then puts its requests
    after everyone else's, each part by P99 deadline — from the control tick that throttles it."""
    p = make_policy(
        slofq(
            tenants={"noisy": {"commit_tok_s": 10.0, "ttft": {"p99": 1.0}}},
            slo_window_s=10.0,
            quantiles="p99",
        )
    )
    old_noisy, quiet, new_noisy = (
        state("n0", "noisy", 0.0),
        state("q0", "quiet", 1.5),
        state("n1", "noisy", 2.0),
    )
    running = [old_noisy, quiet, new_noisy]
    assert [r.id for r in p.order_running(running, 2.0)] == [
        "n0",
        "n1",
        "q0",
    ]  # P99 deadlines 1, 3, 5.5
    waiting = [state(f"w{i}", "noisy", 0.0, prompt=100) for i in range(4)]
    for r in waiting:
        p.on_arrival(r, 0.0)
    p.used.pending["noisy"] += 3000.0  # 100 tok/s: 10x its commitment, and its queue 2 s old
    p.before_step(waiting, 2.0)
    assert "noisy" in p.buckets
    assert [r.id for r in p.order_running(running, 2.1)] == ["q0", "n0", "n1"]
    assert [
        r.id for r in p.reorder_running([quiet, old_noisy, state("q1", "quiet", 2.1)], 2, 2.2)
    ] == ["q0", "q1", "n0"]  # a new admission goes in by its key


# --- the simulator ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def heavy():
    """Issue 23's scenario at load 1.0 (seed 1: fcfs meets the quiet tenants' 2 s P99)."""
    cap = capacity(EngineConfig(), Settings())
    trace, params = heavy_tenant(capacity_req_s=cap, load=1.0, seed=1)
    runs = {}
    for policy in ("fcfs", "slofq"):
        doc = {"policy": policy, "params": params if policy == "slofq" else {}}
        sim = Simulator(trace, Settings.model_validate(doc), EngineConfig())
        withheld = []
        eng = sim.settings.engine

        def listen(now, prefill, _sq, decodes, _ctx, _n, sim=sim, withheld=withheld, eng=eng):
            # After the step's admissions: work still waits while a seat, budget and the KV for
            # the largest waiting request are free — so anything the policy had offered would fit.
            waiting = list(sim.waiting.ordered(now))
            if (
                waiting
                and len(sim.running) < eng.max_num_seqs
                and prefill + decodes < eng.max_num_batched_tokens
            ):
                largest = max(
                    -(-(r.prompt_tokens + r.generated) // sim.config.block_size) for r in waiting
                )
                if largest <= sim.free_blocks:
                    withheld.append(now)

        sim.step_listener = listen
        res = sim.run()
        runs[policy] = (trace, params, res, withheld)
    return runs


def output_rate(res) -> float:
    return sum(c.output_tokens for c in res.completions) / max(
        c.finished_at for c in res.completions
    )


def test_no_step_leaves_a_seat_free_while_work_waits(heavy):
    _, _, _, withheld = heavy["slofq"]
    assert withheld == [], (
        f"{len(withheld)} steps withheld admissible work, first at {withheld[:3]}"
    )


def test_heavy_tenant_scenario_throughput_and_the_quiet_tail(heavy):
    trace, params, fcfs, _ = heavy["fcfs"]
    _, _, res, _ = heavy["slofq"]
    assert len(res.completions) == len(trace)
    sent = {r.id: min(r.output_tokens, r.max_tokens) for r in trace}
    assert all(c.output_tokens == sent[c.id] for c in res.completions)
    ratio = output_rate(res) / output_rate(fcfs)
    assert ratio >= 0.99, ratio
    report = window_report(
        res.completions,
        SloFqParams.model_validate(params),
        duration_s=max(c.finished_at for c in res.completions),
    )
    for q in HEAVY_QUIET:
        assert report["tenants"][q]["ttft_p99"] <= 2.0, (q, report["tenants"][q])
    # the heavy tenant pays for the quiet tenants' tail, not for idle seats
    fcfs_report = window_report(
        fcfs.completions,
        SloFqParams.model_validate(params),
        duration_s=max(c.finished_at for c in fcfs.completions),
    )
    assert report["tenants"]["heavy"]["tok_s"] >= 0.97 * fcfs_report["tenants"]["heavy"]["tok_s"]


# --- the controller's latency reads (scheduler/policies/slo_latency.py) ----------------------


def test_quantiles_of_window_and_waiting_ages_are_numpys_bit_for_bit():
    """The control tick reads the TTFT quantiles of the window and the waiting requests' ages
    without sorting a deep queue (counting per run, the top of each run for a value): every
    answer equals np.percentile over the sorted union, ties and all."""
    import random

    import numpy as np

    from scheduler.policies.slo_latency import Latencies, linear_percentile

    rng = random.Random(23)
    for case in range(400):
        now = 1000.0 + rng.random()
        grid = rng.choice([None, 0.25])  # a coarse grid makes ties between the parts

        def draw(scale: float, grid: float | None = grid) -> float:
            x = rng.expovariate(1.0) * scale
            return round(x / grid) * grid if grid else x

        ttfts = sorted(draw(1.0) for _ in range(rng.randint(0, 40)))
        runs = []
        for _ in range(rng.randint(1, 3)):
            ages = sorted(
                (draw(rng.choice([0.5, 5.0])) for _ in range(rng.randint(0, 150))), reverse=True
            )
            runs.append(
                [state(f"w{case}-{i}", "t", now - a) for i, a in enumerate(ages)]
            )  # arrival order
        union = np.array(ttfts + [now - r.arrival for run in runs for r in run])
        if union.size == 0:
            continue
        lat = Latencies(ttfts, runs, now)
        for pct in (50, 90, 99, 100):
            want = float(np.percentile(union, pct))
            assert (
                lat.value(pct / 100.0)
                == want
                == linear_percentile(sorted(union.tolist()), pct / 100.0)
            )
            for target in (
                want,
                np.nextafter(want, 0),
                np.nextafter(want, np.inf),
                0.0,
                0.5,
                1.0,
                2.0,
            ):
                assert lat.above(pct / 100.0, float(target)) == (want > target), (case, pct, target)

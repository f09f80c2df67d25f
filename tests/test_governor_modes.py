"""The governor acts on the tenants seed 003 names and undoes what it did (issue 23, points 1 and
5): the JFI mode throttles the over-consumers (ω = min(C/U, α) < 1), never a tenant within its
commitment, and its audit note carries the victims' P99 TTFT before and since; ``disarm``,
``pause`` and a recorder stop undo every change (``disarm --keep`` keeps them and says so)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from click.testing import CliRunner
from twin_support import poll_all

from controlplane.governance import GovernanceSpec
from controlplane.governor import Governor, modes
from controlplane.governor_live import governor_step, run_governor
from scheduler.metrics import Completion
from scheduler.metrics.fairness import window_report
from scheduler.settings import Settings, SloFqParams

TENANTS = {
    "big": {"commit_tok_s": 400, "ttft": {"p99": 2.0}},
    "s1": {"commit_tok_s": 100, "ttft": {"p99": 2.0}},
    "s2": {"commit_tok_s": 100, "ttft": {"p99": 2.0}},
}


def done(rid, tenant, arrival, ttft, tokens=500):
    return Completion(
        id=rid,
        tenant=tenant,
        type="chat",
        arrival=arrival,
        scheduled_at=arrival,
        first_token_at=arrival + ttft,
        finished_at=arrival + ttft + 1.0,
        prompt_tokens=tokens // 2,
        output_tokens=tokens - tokens // 2,
    )


def suppressed(big_commit: float = 400) -> dict:
    """big (commitment 400 tok/s) served 600 tok/s while s1 waits for 9 requests and s2 for 5."""
    params = SloFqParams.model_validate(
        {"tenants": {**TENANTS, "big": {**TENANTS["big"], "commit_tok_s": big_commit}}}
    )
    rows = [done(f"big{i}", "big", i, 0.1) for i in range(12)] + [done("s10", "s1", 0, 0.2)]
    return window_report(
        rows,
        params,
        duration_s=10.0,
        waiting={"s1": {"requests": 9, "waited_s": 3.0}, "s2": {"requests": 5, "waited_s": 12.0}},
    )


def slofq_doc() -> Settings:
    return Settings.model_validate({"policy": "slofq", "params": {"tenants": TENANTS}})


def gov() -> Governor:
    return Governor.for_cluster(GovernanceSpec.model_validate({"governor": {"dwell_s": 60.0}}))


def test_the_jfi_mode_throttles_the_over_consumer_and_notes_the_victims():
    figures = suppressed()
    assert figures["jfi"] < 0.8 and figures["over_consumers"] == ["big"]
    g = gov()
    [d] = [d for d in g.decide(figures, 0.0) if d.mode == "jfi"]
    # the old rule throttled the tenants weighing less than the mean: s1 and s2, the victims
    assert g.change(d, "r0").apply(slofq_doc()).params.throttle == {"big": 0.5}
    note = d.note()
    assert "throttles big" in note and "victims' P99 TTFT before: s1 0.2 s, s2 n/a" in note
    g.record(d, 0.0)
    recovered = {
        **figures,
        "jfi": 0.95,
        "tenants": {
            **figures["tenants"],
            "s1": {**figures["tenants"]["s1"], "ttft_p99": 0.3},
            "s2": {**figures["tenants"]["s2"], "ttft_p99": 0.4},
        },
    }
    [e] = [e for e in g.decide(recovered, 61.0) if e.mode == "jfi"]
    assert "victims' P99 TTFT before -> since: s1 0.2 s -> 0.3 s, s2 n/a -> 0.4 s" in e.note()
    ch = g.change(d, "r0")
    entered = ch.apply(slofq_doc())
    undo = g.change(e, "r0")  # made before the commit: nothing of ours to undo there yet
    g.commit(ch, "applied", slofq_doc().to_dict())
    assert g.change(e, "r0").apply(entered).params.throttle == {}  # undone
    # A change carries what it needs, not the governor: steering calls into nothing else of it.
    assert undo.apply(entered) is None
    assert not any(isinstance(getattr(ch, f.name), Governor) for f in dataclasses.fields(ch))


def test_never_a_tenant_within_its_commitment():
    """JFI is low but big is within its (larger) commitment: nobody to throttle, nothing entered."""
    figures = suppressed(big_commit=1000)
    assert figures["jfi"] < 0.8 and figures["over_consumers"] == []
    g = gov()
    assert [d.mode for d in g.decide(figures, 0.0)] == ["scr"]
    assert "nobody to throttle" in (g.held or "")


# --- against twins ------------------------------------------------------------------------------


@pytest.fixture
def twins(tmp_path, monkeypatch):
    from controlplane.cluster import ClusterSpec, ReplicaSpec
    from controlplane.collector import Collector
    from sim.noisy import noisy_neighbour
    from storage.store import Store
    from tuner.twins.cluster import start_twins
    from tuner.twins.replica import ManualClock

    monkeypatch.setenv("TAILPILOT_TOKEN", "gov-token")
    trace, _ = noisy_neighbour(capacity_req_s=10.0, duration_s=5.0)
    with start_twins(
        2,
        trace,
        clock=ManualClock(),
        loop=False,
        token="gov-token",
        settings=[slofq_doc(), slofq_doc()],
    ) as found:
        spec = ClusterSpec(
            name="gov",
            timeout_s=5.0,
            governance=GovernanceSpec.model_validate(
                {"tenants": TENANTS, "governor": {"dwell_s": 60.0}}
            ),
            replicas=[
                ReplicaSpec(
                    name=t.name,
                    api_url=t.url,
                    control_url=t.control_url,
                    token_env="TAILPILOT_TOKEN",
                )
                for t in found
            ],
        )
        store = Store.open(str(tmp_path / "gov.db"))
        collector = Collector(spec, store)
        poll_all(collector)
        yield found, collector, store, str(tmp_path / "gov.db")
        store.close()


def params_of(twin) -> dict:
    import httpx

    return httpx.get(
        f"{twin.control_url}/tailpilot/v1/settings", timeout=5, trust_env=False
    ).json()["settings"]["params"]


def enter_both(g, collector, store) -> None:
    collector.governance = {**suppressed(), "scr": 0.5}
    store.governance.set_control("governor", "gov", state="armed", who="test")
    outs = asyncio.run(governor_step(g, collector, store, 0.0))
    assert [(o["mode"], o["action"]) for o in outs] == [("scr", "enter"), ("jfi", "enter")]
    for t in collector_twins(collector):
        p = params_of(t)
        assert p["quantiles"] == "p99" and p["throttle"] == {"big": 0.5}


def collector_twins(collector):
    return collector.test_twins


def test_disarm_undoes_every_change_and_status_tells_the_truth(twins):
    found, collector, store, _db = twins
    collector.test_twins = found
    g = gov()
    enter_both(g, collector, store)
    assert modes(store.governance.control("governor", "gov")["status"]) == (["scr", "jfi"], [])
    store.governance.set_control("governor", "gov", state="disarmed", who="test")
    outs = asyncio.run(governor_step(g, collector, store, 5.0))  # figures still low: undone anyway
    assert [(o["mode"], o["action"]) for o in outs] == [("jfi", "exit"), ("scr", "exit")]
    assert all("disarmed" in o["note"] for o in outs)
    for t in found:
        p = params_of(t)
        assert p["quantiles"] == "multi" and p["throttle"] == {}
    status = store.governance.control("governor", "gov")["status"]
    assert modes(status) == ([], []) and status["replaced"] == []


def test_disarm_keep_keeps_them_and_says_so(twins):
    from tailpilot.cli import main

    found, collector, store, db = twins
    collector.test_twins = found
    g = gov()
    enter_both(g, collector, store)
    out = (
        CliRunner()
        .invoke(main, ["governor", "disarm", "--keep", "--cluster-name", "gov", "--db", db])
        .output
    )
    assert "keeping scr, jfi applied" in out
    assert asyncio.run(governor_step(g, collector, store, 5.0)) == []
    assert all(params_of(t)["throttle"] == {"big": 0.5} for t in found)
    out = (
        CliRunner().invoke(main, ["governor", "status", "--cluster-name", "gov", "--db", db]).output
    )
    assert "active modes: scr, jfi (kept after disarm" in out
    # disarmed without --keep: undone at the next evaluation
    out = (
        CliRunner().invoke(main, ["governor", "disarm", "--cluster-name", "gov", "--db", db]).output
    )
    assert "undoing scr, jfi at the governor's next evaluation" in out
    asyncio.run(governor_step(g, collector, store, 6.0))
    assert all(
        params_of(t)["throttle"] == {} and params_of(t)["quantiles"] == "multi" for t in found
    )


def test_a_recorder_stop_undoes_every_change(twins):
    found, collector, store, _db = twins
    collector.test_twins = found
    enter_both(gov(), collector, store)  # as a governor that ran before: its state is in the store

    async def stopped() -> None:
        stop = asyncio.Event()
        stop.set()
        await run_governor(collector, store, stop, interval_s=0.01, clock=lambda: 10.0)

    asyncio.run(stopped())
    for t in found:
        p = params_of(t)
        assert p["quantiles"] == "multi" and p["throttle"] == {}
    assert modes(store.governance.control("governor", "gov")["status"]) == ([], [])
    notes = [
        r["message"]
        for r in store.settings_log.settings_changes("gov", None, 100)
        if r["who"] == "governor"
    ]
    assert any("the recorder stopped" in (m or "") for m in notes)


def test_a_recorder_cancelling_the_governor_mid_stop_still_undoes(twins):
    """The recorder sets ``stop`` and then cancels its controllers' tasks: the undo finishes."""
    found, collector, store, _db = twins
    collector.test_twins = found
    enter_both(gov(), collector, store)

    async def cancelled() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(
            run_governor(collector, store, stop, interval_s=0.01, clock=lambda: 10.0)
        )
        await asyncio.sleep(0.05)
        stop.set()
        await asyncio.sleep(0)  # it wakes and starts undoing ...
        task.cancel()  # ... and is cancelled, as the recorder does
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(cancelled())
    assert all(
        params_of(t)["quantiles"] == "multi" and params_of(t)["throttle"] == {} for t in found
    )


def test_a_governor_cancelled_before_its_first_step_still_undoes(twins):
    """Cancelled as soon as it started (a recorder stopped at once): the modes a previous run
    left applied are still undone — nothing is awaited before the host's loop takes over."""
    found, collector, store, _db = twins
    collector.test_twins = found
    enter_both(gov(), collector, store)

    async def cancelled_at_once() -> None:
        task = asyncio.create_task(
            run_governor(collector, store, asyncio.Event(), interval_s=60.0, clock=lambda: 10.0)
        )
        await asyncio.sleep(0)  # it starts and waits for its first step ...
        task.cancel()  # ... and is cancelled there
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(cancelled_at_once())
    assert all(
        params_of(t)["quantiles"] == "multi" and params_of(t)["throttle"] == {} for t in found
    )


def test_a_mode_no_replica_took_is_shown_as_such():
    from controlplane.governor import modes_text

    status = {"active": {"scr": 1.0, "jfi": 2.0}, "dry": [], "replaced": [["scr", "r0", "multi"]]}
    assert modes_text(status) == "active modes: scr, jfi (on no replica)"
    assert modes(status) == (["scr", "jfi"], [])  # the autopilot's view is unchanged


def test_a_throttle_never_rests_on_labels_a_client_can_set(twins):
    """One replica's tenant labels are its clients' own (TAILPILOT_TENANT_SOURCE=client): the
    armed governor's JFI throttle is logged as dry-run with the reason and sent nowhere, while
    the SCR mode (which names no tenant) is applied; with governance.governor.trust_client_labels
    the throttle is applied as before."""
    found, collector, store, _ = twins
    collector.test_twins = found
    found[1].core.tenant_source = "client"
    poll_all(collector)
    g = gov()
    collector.governance = {**suppressed(), "scr": 0.5}
    store.governance.set_control("governor", "gov", state="armed", who="test")
    outs = asyncio.run(governor_step(g, collector, store, 0.0))
    jfi = next(o for o in outs if o["mode"] == "jfi")
    assert (
        jfi["state"] == "armed" and "clients' own" in jfi["note"] and found[1].name in jfi["note"]
    )
    assert set(jfi["replicas"].values()) <= {"dry-run"}
    for t in found:
        p = params_of(t)
        assert p["quantiles"] == "p99" and not p.get("throttle")  # scr applied, no throttle
    trusting = Governor.for_cluster(
        GovernanceSpec.model_validate(
            {"tenants": TENANTS, "governor": {"dwell_s": 60.0, "trust_client_labels": True}}
        )
    )
    # a restart with the changed cluster file: it takes over the stored state, the lease's
    # holder included (another recorder's governor would only dry-run here)
    trusting.restore(store.governance.control("governor", "gov")["status"])
    outs = asyncio.run(governor_step(trusting, collector, store, 0.0))
    assert any(o["mode"] == "jfi" and "clients' own" not in o["note"] for o in outs)
    assert all(params_of(t)["throttle"] == {"big": 0.5} for t in found)


def test_a_second_governor_on_the_same_replicas_only_dry_runs(twins):
    """One owner per knob (issue 33): another recorder's governor (its own lease holder) decides
    too, but the replicas refuse it the lease: what it would send is logged, nothing is sent, and
    the first governor's changes stay."""
    found, collector, store, _db = twins
    collector.test_twins = found
    first = gov()
    enter_both(first, collector, store)
    second = gov()  # not restored from the first's status: another recorder
    assert second.leases.holder != first.leases.holder
    collector.governance = {**suppressed(), "scr": 0.5}
    outs = asyncio.run(governor_step(second, collector, store, 1.0))
    assert outs, "the second governor decided nothing"
    for o in outs:
        for result in o["replicas"].values():
            assert "not ours to steer" in result and first.leases.holder in result
    for t in found:
        p = params_of(t)
        assert p["quantiles"] == "p99" and p["throttle"] == {"big": 0.5}  # the first's, kept

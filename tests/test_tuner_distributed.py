"""Distributed tuning adds trials and never duplicates them (issue 23, point 8): workers released
at the same instant draw distinct sampler streams, Optuna's JournalStorage (a file) works as a
second backend for tune and recommend, Ctrl-C stops every worker with one message, and a storage
URL the tuner cannot use is one usage error."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import click
import optuna
import pytest
from click.testing import CliRunner
from optuna.trial import TrialState

from tailpilot.cli_tune import COMMANDS
from tuner.studies import study as st
from tuner.studies.optimize import fail_dead_local_trials, run_worker, tune
from tuner.studies.optuna_storage import open_storage, storage_file, storage_url
from tuner.studies.samplers import make_sampler, stream_sampler, trial_seed
from tuner.studies.spec import StudySpec

REPO = Path(__file__).resolve().parents[1]
SEED = 3
TRIALS = 12
# The Azure conv window cut into four 60-s windows (one held out), as in tests/test_tuner.py.
DEFINITION = [
    "--policy",
    "uniboost",
    "--objective",
    "ttlt_p99",
    "--from",
    "0",
    "--to",
    "240",
    "--window-s",
    "60",
    "--seed",
    str(SEED),
]


def small_spec() -> StudySpec:
    return StudySpec(
        policies=["uniboost"], objectives=["ttlt_p99"], trim=(0.0, 240.0), window_s=60.0, seed=SEED
    )


@pytest.fixture
def cli() -> click.Group:
    group = click.Group("tailpilot")
    for command in COMMANDS:
        group.add_command(command)
    return group


# ------------------------------------------------------------------ processes released together
# Spawned children (module-level targets: spawn pickles them by name). Each waits on one barrier,
# so both leave it at the same instant: the race that made two workers seed alike.


def _worker_after_setup(url: str, name: str, n_trials: int, barrier) -> None:
    """A worker whose study is set up, released together with the other: the moment two workers
    pick their sampler streams."""
    storage = open_storage(url)
    _, ctx = st.load_context(storage, name, enqueue=True)
    barrier.wait()
    run_worker(storage, name, ctx, n_trials)


def _tune_command(args: list[str], barrier) -> None:
    """``tailpilot tune ARGS`` in this process, started when the other one starts."""
    from tailpilot.cli_tune import tune

    barrier.wait()
    tune.main(args=args, prog_name="tailpilot tune", standalone_mode=False)


def _release_together(target, args_per_process: list[tuple]) -> None:
    mp = multiprocessing.get_context("spawn")
    barrier = mp.Barrier(len(args_per_process))
    procs = [mp.Process(target=target, args=(*args, barrier)) for args in args_per_process]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=600)
    assert [p.exitcode for p in procs] == [0] * len(procs)


def _sampled(study) -> list:
    """The parameter sets of every trial that drew one (excess trials stop before sampling)."""
    return [tuple(sorted(t.params.items())) for t in study.trials if t.params]


def _assert_distinct_and_shared(study, n_trials: int) -> dict[str, int]:
    complete = study.get_trials(states=(TrialState.COMPLETE,))
    assert len(complete) == n_trials
    sets = _sampled(study)
    dupes = [s for s, k in Counter(sets).items() if k > 1]
    assert not dupes, f"{len(set(sets))} distinct parameter sets in {len(sets)} trials"
    by_process = Counter(t.user_attrs[st.OWNER_ATTR] for t in complete)
    assert len(by_process) == 2 and sum(by_process.values()) == n_trials  # both added trials
    return dict(by_process)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["optuna.db", "optuna.journal"])
def test_workers_released_together_draw_distinct_parameters(tmp_path, backend):
    url = storage_url(str(tmp_path / backend))
    storage = open_storage(url)
    st.prepare(storage, "together", small_spec())
    _release_together(_worker_after_setup, [(url, "together", TRIALS)] * 2)
    study = optuna.load_study(study_name="together", storage=open_storage(url))
    _assert_distinct_and_shared(study, TRIALS)


@pytest.mark.slow
def test_two_tune_commands_started_at_the_same_instant_on_a_journal(tmp_path, cli):
    journal = tmp_path / "study.journal"
    args = [
        "--study",
        "j",
        "--storage",
        str(journal),
        "--trials",
        str(TRIALS),
        "--no-progress",
        "--json",
        "--db",
        str(tmp_path / "tailpilot.db"),
        *DEFINITION,
    ]
    _release_together(_tune_command, [(args,)] * 2)  # both create-or-join the study
    study = optuna.load_study(study_name="j", storage=open_storage(storage_url(str(journal))))
    _assert_distinct_and_shared(study, TRIALS)
    production = [
        t
        for t in study.get_trials(states=(TrialState.COMPLETE,))
        if t.user_attrs.get(st.ROLE_ATTR) == st.PRODUCTION
    ]
    assert len(production) == 1
    # recommend reads the journal like a database (journal:PATH is the same storage).
    res = CliRunner().invoke(
        cli,
        [
            "recommend",
            "--study",
            "j",
            "--storage",
            f"journal:{journal}",
            "--db",
            str(tmp_path / "tailpilot.db"),
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    summary = json.loads(res.output)
    assert summary["trials_complete"] == TRIALS and summary["holdout"]["windows"]
    assert "stored_id" in summary


def test_one_worker_stays_reproducible_on_a_journal(tmp_path):
    """One process with a seed gives the same trials on either backend (the streams depend on the
    seed and the trial numbers only)."""
    runs = []
    for file in ("a.journal", "b.db"):
        url = storage_url(str(tmp_path / file))
        tune(url, "r", 6, spec=small_spec())
        runs.append(optuna.load_study(study_name="r", storage=open_storage(url)))
    assert [t.params for t in runs[0].trials] == [t.params for t in runs[1].trials]
    assert [t.values for t in runs[0].trials] == [t.values for t in runs[1].trials]


def test_a_worker_keeps_its_stream_only_while_alone(tmp_path):
    """Consecutive trial numbers from where the study stood: the worker's own (reproducible)
    stream; from the first number another process took: a stream per trial number."""
    url = storage_url(str(tmp_path / "o.db"))
    ctx = st.prepare(open_storage(url), "s", small_spec())

    def draws(expected: int | None, turns: str) -> list[dict]:
        """``turns``: who asks next, "m" (this worker) or "o" (another process); this worker's
        suggestions, in order."""
        storage = optuna.storages.InMemoryStorage()
        mine = optuna.create_study(
            storage=storage, study_name="s", sampler=stream_sampler(ctx, SEED, 99, expected)
        )
        other = optuna.load_study(
            study_name="s", storage=storage, sampler=optuna.samplers.RandomSampler(seed=0)
        )
        out = []
        for who in turns:
            study = mine if who == "m" else other
            trial = study.ask()
            settings = ctx.space.suggest(trial).to_dict()
            if who == "m":
                out.append(settings)
            study.tell(trial, state=TrialState.FAIL)
        return out

    reference = optuna.create_study(sampler=make_sampler(ctx, 99))
    own = [ctx.space.suggest(reference.ask()).to_dict() for _ in range(3)]
    assert draws(0, "mmm") == own  # alone: exactly the worker's own stream (as before the fix)
    per_trial = draws(None, "oom")  # trial 2, whoever runs it, draws from trial_seed(SEED, 2)
    assert per_trial[0] not in own
    assert draws(0, "oom") == per_trial  # two numbers taken by another process: per trial
    mixed = draws(0, "mom")  # alone for trial 0; trial 1 was another's, so trial 2 per trial
    assert mixed == [own[0], per_trial[0]]


def test_trial_seeds_are_distinct_per_trial_and_study():
    seeds = {trial_seed(seed, n) for seed in range(4) for n in range(200)}
    assert len(seeds) == 800  # neighbouring seeds do not share streams shifted by one trial
    assert trial_seed(3, 5) == trial_seed(3, 5)


# ------------------------------------------------------------------ journal: dead workers' trials


def test_a_dead_local_workers_running_trial_is_failed_on_a_journal(tmp_path):
    """A journal has no heartbeats: a trial left RUNNING by a killed worker would hold its slot
    forever; the next worker on the host fails it and the study completes."""
    url = storage_url(str(tmp_path / "o.journal"))
    storage = open_storage(url)
    st.prepare(storage, "d", small_spec())
    study = optuna.load_study(study_name="d", storage=storage)
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    orphan = study.ask()  # pops the production trial: it is what the dead worker was running
    orphan.set_user_attr(st.OWNER_ATTR, f"{socket.gethostname()}:{int(dead.stdout)}")
    alive = study.ask()  # a trial of a live worker (this process) is never touched
    alive.set_user_attr(st.OWNER_ATTR, f"{socket.gethostname()}:{os.getpid()}")
    remote = study.ask()
    remote.set_user_attr(st.OWNER_ATTR, "another-host:1")
    assert fail_dead_local_trials(study) == [orphan.number]
    states = {t.number: t.state for t in study.trials}
    assert states[orphan.number] == TrialState.FAIL
    assert states[alive.number] == states[remote.number] == TrialState.RUNNING
    study.tell(alive, state=TrialState.FAIL)
    study.tell(remote, state=TrialState.FAIL)
    out = tune(url, "d", 4)
    assert out.complete == 4


# ------------------------------------------------------------------ Ctrl-C


def _wait_for_trials_of_two_workers(
    db: Path, proc: subprocess.Popen, timeout_s: float = 300.0
) -> None:
    """Return once trials of two worker processes are in the storage: the study has started.
    Reads Optuna's SQLite tables directly, read-only (opening an Optuna storage would race the
    command creating its schema)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"tune exited early ({proc.returncode}): {proc.communicate()[1][-3000:]}")
        try:
            with contextlib.closing(
                sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1)
            ) as conn:
                owners = conn.execute(
                    "SELECT COUNT(DISTINCT value_json) FROM trial_user_attributes WHERE key = ?",
                    (st.OWNER_ATTR,),
                ).fetchone()[0]
        except sqlite3.Error:  # not created yet, or locked for a moment
            owners = 0
        if owners >= 2:
            return
        time.sleep(0.2)
    pytest.fail("the workers started no trial")


# A terminal's Ctrl-C finds SIGINT at Python's handler. A suite started as a background job of a
# non-interactive shell (`pytest ... &`) hands its children SIGINT ignored — Python then installs
# no handler and the interrupt is lost — so each child here sets it first, whatever it inherited.
AS_A_TERMINALS_JOB = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n"

INTERRUPT_IN_A_CALLBACK = (
    AS_A_TERMINALS_JOB
    + """
import os, signal, sys, weakref
from tuner.studies.optimize import exit_quietly_on_interrupt

exit_quietly_on_interrupt() if sys.argv[1] == "worker" else None

class Node:
    pass

def on_collected(ref):
    os.kill(os.getpid(), signal.SIGINT)  # Python runs the handler at the next bytecode: here
    for _ in range(1000):
        pass

node = Node()
ref = weakref.ref(node, on_collected)
del node  # the callback runs now, and the interrupt is raised inside it
print("carried on", flush=True)
"""
)


@pytest.mark.parametrize(("mode", "code"), [("worker", 130), ("plain", 0)])
def test_an_interrupt_landing_in_a_gc_callback_still_ends_a_worker_quietly(mode, code):
    """What a fresh-clone CI run saw: a worker's Ctrl-C raised inside SQLAlchemy's weakref
    callback was printed as "Exception ignored ... Traceback" and lost. Plain Python shows why
    (it carries on); a worker ends with 130 and prints nothing."""
    ran = subprocess.run(
        [sys.executable, "-c", INTERRUPT_IN_A_CALLBACK, mode],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert ran.returncode == code, ran.stderr
    if mode == "worker":
        assert ran.stdout == "" and ran.stderr == ""
    else:  # the interrupt is lost: printed, and the program goes on
        assert "carried on" in ran.stdout and "Exception ignored" in ran.stderr


def test_ctrl_c_with_workers_prints_the_clean_message_only(tmp_path):
    """A terminal's Ctrl-C reaches every process of ``tailpilot tune --jobs 2``: each worker
    fails its running trial and exits quietly; the command says how to continue, once, with no
    traceback (Optuna logged one per worker for the interrupted trial)."""
    db = tmp_path / "optuna.db"
    cmd = [
        sys.executable,
        "-c",
        AS_A_TERMINALS_JOB + "from tailpilot.cli_tune import tune; tune()",
        "--study",
        "c",
        "--storage",
        str(db),
        "--db",
        str(tmp_path / "tailpilot.db"),
        *DEFINITION,
        "--trials",
        "500",
        "--jobs",
        "2",
        "--no-progress",
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )  # its own process group, as a terminal's job
    try:
        _wait_for_trials_of_two_workers(db, proc)
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C does: the whole group, workers included
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "failed" not in err, err[-3000:]
    assert "(interrupted)" in out and "run the same command to continue" in out


# ------------------------------------------------------------------ URLs it cannot use


@pytest.mark.parametrize(
    "storage, says",
    [
        ("redis://localhost:6379", "cannot use 'redis' storage; use a SQLite file"),
        ("redis:localhost", "cannot use 'redis' storage"),
        ("file:study", "cannot use 'file' storage"),
        ("journal:", "give the journal file's path"),
        ("journal:{tmp}/no-such-folder/s.journal", "does not exist"),
        ("journal:{tmp}", "is a directory"),
        (
            "mysql://u@localhost/db",
            "--storage mysql://u@localhost/db: cannot",
        ),  # no MySQL driver here
    ],
)
def test_storage_the_tuner_cannot_use_is_one_usage_error(tmp_path, cli, storage, says):
    storage = storage.format(tmp=tmp_path)
    for command in (["tune", *DEFINITION], ["recommend"]):
        res = CliRunner().invoke(
            cli,
            [
                command[0],
                "--study",
                "x",
                "--storage",
                storage,
                "--db",
                str(tmp_path / "tailpilot.db"),
                *command[1:],
            ],
        )
        assert res.exit_code == 2, res.output
        assert says in res.output and "Traceback" not in res.output and res.exception is not None
        error = [line for line in res.output.splitlines() if line.startswith("Error:")]
        assert len(error) == 1 and says in error[0]  # one line, naming the storage
        if "cannot use" in says:  # and what the tuner does support
            assert "journal:PATH" in error[0] and "postgresql://" in error[0]


def test_a_sqlite_file_given_as_a_journal_is_refused(tmp_path, cli):
    db = tmp_path / "optuna.db"
    open_storage(storage_url(str(db)))  # Optuna's schema: a SQLite file
    res = CliRunner().invoke(
        cli,
        [
            "recommend",
            "--study",
            "x",
            "--storage",
            f"journal:{db}",
            "--db",
            str(tmp_path / "tailpilot.db"),
        ],
    )
    assert res.exit_code == 2 and "is a SQLite database, not an Optuna journal" in res.output
    res = CliRunner().invoke(
        cli,
        [
            "tune",
            "--study",
            "x",
            "--storage",
            f"journal:{tmp_path / 'tailpilot.db'}",
            "--db",
            str(tmp_path / "tailpilot.db"),
            *DEFINITION,
        ],
    )
    assert res.exit_code == 2 and "keep Optuna's tables apart" in res.output


def test_journal_forms_of_storage():
    assert storage_url("s.journal") == f"journal:{Path('s.journal').resolve()}"
    assert storage_url("s.log") == f"journal:{Path('s.log').resolve()}"
    assert storage_url("journal:s") == f"journal:{Path('s').resolve()}"
    assert storage_url("s.db") == f"sqlite:///{Path('s.db').resolve()}"
    assert storage_file(storage_url("journal:s")) == str(Path("s").resolve())


def test_a_joining_worker_with_another_seed_is_told_why(tmp_path, cli):
    url = storage_url(str(tmp_path / "o.journal"))
    st.prepare(open_storage(url), "s", small_spec())
    res = CliRunner().invoke(
        cli,
        [
            "tune",
            "--study",
            "s",
            "--storage",
            url,
            "--seed",
            str(SEED + 1),
            "--db",
            str(tmp_path / "tailpilot.db"),
        ],
    )
    assert res.exit_code == 2
    assert "--seed" in res.output and "own sampler stream" in res.output


# ------------------------------------------------------------------ journal: a torn tail
def _journal_with_trials(path, n: int):
    import optuna

    from tuner.studies.optuna_storage import open_storage, storage_url

    storage = open_storage(storage_url(str(path)))
    study = optuna.create_study(study_name="torn", storage=storage)
    for k in range(n):
        study.add_trial(
            optuna.trial.create_trial(
                params={"x": float(k)},
                distributions={"x": optuna.distributions.FloatDistribution(0, 10)},
                value=float(k),
            )
        )
    return study


@pytest.mark.parametrize("resumed_before_the_mend", [False, True])
def test_a_journal_torn_by_a_full_disk_survives_a_resume(tmp_path, capsys, resumed_before_the_mend):
    """A writer stopped mid-record (a full disk) leaves a last line without its newline; a
    resume appended after it and the journal became unreadable. Opened now, the torn record is
    cut off (kept beside the journal, named on stderr), every committed trial survives, and a
    resume adds trials a fresh reader sees; where a resume already wrote after the tear (plain
    Optuna, before this mend), its whole record is kept too."""
    import json

    import optuna

    from tuner.studies.optuna_storage import open_storage, storage_url

    def add(study, x: float) -> None:
        study.add_trial(
            optuna.trial.create_trial(
                params={"x": x},
                distributions={"x": optuna.distributions.FloatDistribution(0, 10)},
                value=x,
            )
        )

    path = tmp_path / "study.journal"
    study = _journal_with_trials(path, 3)
    whole = path.read_bytes()
    torn = b'{"op_code": 5, "worker_id": "dead", "trial_id": 3, "va'
    expected = [0.0, 1.0, 2.0]
    if resumed_before_the_mend:
        # What a resume wrote after the tear: the records of one more trial, glued to the torn
        # bytes (the trial's records as Optuna writes them, cut from a journal that has it).
        add(study, 7.0)
        resumed = path.read_bytes()[len(whole) :]
        path.write_bytes(whole + torn + resumed)
        expected.append(7.0)
        with pytest.raises(ValueError):  # unreadable as it stands: a record glued to the tear
            for line in path.read_bytes().splitlines():
                json.loads(line)
    else:
        path.write_bytes(whole + torn)
    storage = open_storage(storage_url(str(path)))
    assert "the journal was torn" in capsys.readouterr().err
    study = optuna.load_study(study_name="torn", storage=storage)
    assert [t.value for t in study.trials] == expected
    assert path.read_bytes().startswith(whole)
    assert (tmp_path / "study.journal.torn-1").read_bytes().startswith(b'{"op_code": 5')
    add(study, 4.0)
    again = optuna.load_study(study_name="torn", storage=open_storage(storage_url(str(path))))
    assert [t.value for t in again.trials] == [*expected, 4.0]
    assert "torn" not in capsys.readouterr().err  # whole now: nothing to mend


def test_a_journal_line_that_cannot_be_mended_is_named(tmp_path):
    from tuner.studies.optuna_storage import open_storage, storage_url
    from tuner.studies.spec import TuneError

    path = tmp_path / "study.journal"
    _journal_with_trials(path, 1)
    with path.open("ab") as fh:
        fh.write(b"garbage without a record\n")
    with pytest.raises(TuneError, match="line 3 of the journal"):
        open_storage(storage_url(str(path)))

"""Clear errors, round two (issue 21, point 7): what an operator mistypes is refused with ONE line
naming the file, option or cluster (and what is allowed), never a traceback; a read-only command
creates no file; a command that did not do what was asked exits non-zero; ``--json`` is strict JSON.

Each case below ran into a traceback, a silently wrong run, a new empty database, an exit 0 or a
bare ``NaN`` on the code before this round. Commands run in-process through click's CliRunner (an
uncaught exception there is ``result.exception``, which is what a traceback would have been).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner, Result

from storage import Batch, CompletionRow, Store
from tailpilot.cli import main

UNREACHABLE = (
    "http://127.0.0.1:9"  # the discard port: nothing listens, connections are refused at once
)
CLUSTER = f"""\
clusters:
  - name: c
    timeout_s: 0.5
    replicas:
      - {{name: r1, api_url: "{UNREACHABLE}", control_url: "{UNREACHABLE}"}}
"""
TOKEN = "round-two-token"


def invoke(*args: object) -> Result:
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=True)


def assert_one_line_error(res: Result, code: int, *words: str, max_lines: int | None = 4) -> str:
    """Exit ``code``; no exception escaped (no traceback); exactly one ``Error:`` line, holding
    every word; at most ``max_lines`` lines in all (click's usage lines and the error, nothing
    more)."""
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    out = res.output
    assert "Traceback" not in out, out
    assert res.exit_code == code, out
    errors = [line for line in out.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, out
    assert all(w in errors[0] for w in words), out
    if max_lines is not None:
        assert len(out.splitlines()) <= max_lines, out
    return errors[0]


@pytest.fixture
def workdir(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)  # whatever a command writes by default lands here
    return tmp_path


# ---------------------------------------------------------------------------- deeply nested YAML


def nested(shape: str, depth: int) -> str:
    if shape == "flow lists":
        return "[" * depth + "]" * depth
    if shape == "flow maps":
        return "{a: " * depth + "1" + "}" * depth
    return "- " * depth + "x"  # block sequences, compact: one line, `depth` levels


@pytest.mark.parametrize("shape", ["flow lists", "flow maps", "block lists"])
def test_a_deeply_nested_cluster_file_is_one_line_naming_the_file_and_the_limit(workdir, shape):
    """5,000 levels once gave a RecursionError about 3,000 lines long."""
    path = workdir / "deep.yaml"
    body = nested(shape, 5000)
    path.write_text(f"clusters:\n{body}\n" if shape == "block lists" else f"clusters: {body}\n")
    line = assert_one_line_error(invoke("status", "--cluster", path), 2, str(path))
    assert re.search(r"nested deeper than \d+ levels", line), line


def test_the_depth_limit_is_exact():
    from controlplane.strict_yaml import MAX_DEPTH, StrictLoader

    assert yaml.load(nested("flow lists", MAX_DEPTH), Loader=StrictLoader) is not None
    with pytest.raises(yaml.YAMLError, match=f"nested deeper than {MAX_DEPTH} levels"):
        yaml.load(nested("flow lists", MAX_DEPTH + 1), Loader=StrictLoader)


# ---------------------------------------------------------------------------- numeric options

SHORT = ("--to", "30")  # should a value be accepted, the run stays short
REFUSED = [
    # (argv, the option, what the error says of the allowed values)
    (["sim", *SHORT, "--rate-scale", "0"], "--rate-scale", "x>0"),
    (["sim", *SHORT, "--rate-scale", "-2"], "--rate-scale", "x>0"),
    (["sim", *SHORT, "--rate-scale", "nan"], "--rate-scale", "finite"),
    (["sim", *SHORT, "--target-rate", "-5"], "--target-rate", "x>0"),
    (["sim", *SHORT, "--target-rate", "inf"], "--target-rate", "finite"),
    (["sim", "--from", "10", "--to", "10"], "--to", "not after --from 10"),
    (["sim", "--from", "-1"], "--from", "x>=0"),
    (["sim", *SHORT, "--max-tokens-cap", "0"], "--max-tokens-cap", "1<=x"),
    (["compare", "--policy", "fcfs", *SHORT, "--rate-scale", "-1"], "--rate-scale", "x>0"),
    (["compare", "--policy", "fcfs", *SHORT, "--jobs", "0"], "--jobs", "x>=1"),
    (["compare", "--policy", "fcfs", *SHORT, "--tenants", "0"], "--tenants", "1<=x"),
    (["twin", *SHORT, "--rate-scale", "0"], "--rate-scale", "x>0"),
    (["demo", "--no-tui", "--duration", "1", "--speed", "nan"], "--speed", "finite"),
    (["demo", "--no-tui", "--duration", "1", "--rate-scale", "inf"], "--rate-scale", "finite"),
    (["tune", "--study", "s", "--rate-scale", "0"], "--rate-scale", "x>0"),
    (["tune", "--study", "s", "--from", "5", "--to", "1"], "--to", "not after --from 5"),
    (["tune", "--study", "s", "--population", "1"], "--population", "x>=2"),
    # engine limits: refused naming the option, not the settings field (or accepted and every
    # request rejected, as --num-gpu-blocks -5 was; 0 silently meant the default)
    (["sim", *SHORT, "--num-gpu-blocks", "-5"], "--num-gpu-blocks", "1<=x"),
    (["sim", *SHORT, "--num-gpu-blocks", "0"], "--num-gpu-blocks", "1<=x"),
    (["sim", *SHORT, "--max-num-seqs", "0"], "--max-num-seqs", "1<=x"),
    (["sim", *SHORT, "--max-num-batched-tokens", "-1"], "--max-num-batched-tokens", "1<=x"),
    (
        ["sim", *SHORT, "--long-prefill-token-threshold", "-1"],
        "--long-prefill-token-threshold",
        "0<=x",
    ),
    (
        ["compare", "--policy", "fcfs", *SHORT, "--num-gpu-blocks", "0"],
        "--num-gpu-blocks",
        "1<=x",
    ),
    (["tune", "--study", "s", "--num-gpu-blocks", "-1"], "--num-gpu-blocks", "1<=x"),
]


@pytest.mark.parametrize(
    "argv,option,allowed", REFUSED, ids=[" ".join(a[:1] + a[-2:]) for a, _, _ in REFUSED]
)
def test_a_number_that_makes_no_sense_is_refused_naming_the_option_and_the_range(
    workdir, argv, option, allowed
):
    assert_one_line_error(invoke(*argv), 2, option, allowed)
    assert list(workdir.iterdir()) == []  # refused before anything ran or was written


@pytest.mark.parametrize("command", [["sim"], ["compare", "--policy", "fcfs"], ["twin"]])
def test_an_unknown_step_model_is_refused_listing_the_known_ones(workdir, command):
    from sim.stepmodel import DEFAULT_MODEL_NAME

    assert_one_line_error(
        invoke(*command, *SHORT, "--step-model", "a100/typo"),
        2,
        "'--step-model'",
        "'a100/typo'",
        DEFAULT_MODEL_NAME,
    )


# ---------------------------------------------------------------------------- read-only commands

READ_ONLY = {
    "governor status": ["governor", "status", "--cluster-name", "c", "--db", "{db}"],
    "governor arm": ["governor", "arm", "--cluster-name", "c", "--db", "{db}"],
    "tui --replay": ["tui", "--replay", "--db", "{db}"],
    "verify": ["verify", "--cluster", "{cluster}", "--db", "{db}"],
    "sim on a recording": ["sim", "--trace", "db:{db}#recording=peak"],
}


@pytest.mark.parametrize("command", READ_ONLY)
def test_a_mistyped_database_path_creates_nothing(workdir, command):
    cluster = workdir / "cluster.yaml"
    cluster.write_text(CLUSTER)
    db = workdir / "tailpilot-typo.db"
    argv = [a.format(db=db, cluster=cluster) for a in READ_ONLY[command]]
    assert_one_line_error(invoke(*argv), 2, str(db), "does not exist")
    assert sorted(p.name for p in workdir.iterdir()) == [
        "cluster.yaml"
    ]  # no database, no -wal/-shm


# ------------------------------------------------------------------ governor on an unknown cluster


def test_the_governor_refuses_a_cluster_the_database_never_recorded(workdir):
    db = workdir / "g.db"
    with Store.open(str(db)) as store:
        for name in ("prod", "staging"):
            store.recordings.ensure_replicas(name, [("r1", UNREACHABLE, UNREACHABLE)])
    for action in ("arm", "disarm", "pause", "status"):
        assert_one_line_error(
            invoke("governor", action, "--cluster-name", "prdo", "--db", db),
            2,
            "--cluster-name",
            "'prdo'",
            "known: prod, staging",
        )
    with Store.open(str(db)) as store:
        assert (
            store.governance.control("governor", "prdo")["who"] is None
        )  # no control row was written
    # a cluster with no governance figures recorded has nothing to govern: arm says so
    assert_one_line_error(
        invoke("governor", "arm", "--cluster-name", "prod", "--db", db),
        2,
        "'prod'",
        "no governance figures recorded",
    )
    from storage.rows import Batch, GovernanceRow

    with Store.open(str(db)) as store:
        store.recordings.write("prod", Batch(governance=[GovernanceRow(t_ms=1, summary={})]))
    res = invoke("governor", "arm", "--cluster-name", "prod", "--db", db, "--who", "ops")
    assert res.exit_code == 0 and "governor of prod: armed" in res.output, res.output


def test_the_governor_on_a_database_with_no_cluster_says_so(workdir):
    db = workdir / "empty.db"
    Store.open(str(db)).close()
    assert_one_line_error(
        invoke("governor", "arm", "--cluster-name", "prod", "--db", db),
        2,
        "'prod'",
        "no cluster recorded",
    )


# ---------------------------------------------------------------------------- strict JSON out


def strict_json(text: str):
    def refuse(token: str):
        raise AssertionError(f"not JSON: bare {token}")

    return json.loads(text, parse_constant=refuse)


def one_token_trace(path: Path) -> Path:
    """Five requests of one output token each: no gap between tokens, so every TBT figure (and
    its change against a baseline) is undefined."""
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        + "".join(f"2023-11-16 18:15:{i:02d}.000000,100,1\n" for i in range(5))
    )
    return path


def test_sim_and_compare_json_write_null_for_an_undefined_figure(workdir):
    trace = one_token_trace(workdir / "one.csv")
    res = invoke("sim", "--policy", "fcfs", "--trace", trace, "--json")
    assert res.exit_code == 0, res.output
    assert strict_json(res.stdout)["metrics"]["tbt_p99"] is None
    res = invoke(
        "compare", "--policy", "fcfs,sjf", "--baseline", "fcfs", "--trace", trace, "--json"
    )
    assert res.exit_code == 0, res.output
    doc = strict_json(res.stdout)
    assert doc["metrics"]["sjf"]["tbt_p99"] is None and doc["change_pct"]["sjf"]["tbt_p99"] is None


def test_the_one_json_encoder_turns_every_non_finite_number_into_null():
    from tailpilot.cli_common import json_text

    class Figure:  # what a command hands ``default`` (a numpy scalar, a dataclass field)
        pass

    doc = {
        "nan": float("nan"),
        "deep": [{"inf": float("inf")}, (float("-inf"), 1.5)],
        "obj": Figure(),
    }
    assert strict_json(json_text(doc, default=lambda _obj: float("nan"))) == {
        "nan": None,
        "deep": [{"inf": None}, [None, 1.5]],
        "obj": None,
    }


# ---------------------------------------------------------------------- did not do what was asked


def cluster_file(workdir: Path, twins) -> Path:
    path = workdir / "twins.yaml"
    twins.write_cluster_yaml(path)
    return path


def recent_traffic(db: Path, cluster: str, replica: str, n: int = 300) -> None:
    """``n`` completions stored now, arrivals 0.4 s apart on the replica's clock: the last minute
    of them is traffic `set --preview` can predict on."""
    rows = [
        CompletionRow(
            replica=replica,
            request_id=f"q{i}",
            tenant="a",
            type="chat",
            arrival_s=1000.0 + 0.4 * i,
            first_token_s=1000.3 + 0.4 * i,
            finished_s=1003.0 + 0.4 * i,
            prompt_tokens=300,
            output_tokens=60,
            preemptions=0,
        )
        for i in range(n)
    ]
    with Store.open(str(db)) as store:
        store.recordings.ensure_replicas(cluster, [(replica, UNREACHABLE, UNREACHABLE)])
        store.recordings.write(cluster, Batch(completions=rows, cursors={replica: n}))


def test_set_preview_not_confirmed_applies_nothing_and_exits_1(workdir, monkeypatch):
    """Off a terminal and without --yes the change is shown, not applied: that is not what was
    asked, so the exit status says so (it was 0)."""
    from tuner.twins.cluster import start_twins

    monkeypatch.setenv("TAILPILOT_TOKEN", TOKEN)
    db = workdir / "audit.db"
    with start_twins(1, idle_trace(), speed=1, token=TOKEN, loop=False) as twins:
        path = cluster_file(workdir, twins)
        replica = twins[0]
        recent_traffic(db, "twins", replica.name)
        res = invoke(
            "set",
            "--cluster",
            path,
            "--replica",
            replica.name,
            "--policy",
            "fcfs",
            "--preview",
            "--minutes",
            "1",
            "--db",
            db,
        )
        assert "P95 TTFT" in res.output  # the prediction was made and shown
        assert_one_line_error(res, 1, "not applied", "--yes", max_lines=None)
        assert replica.core.settings.policy == "sarathi"
        with Store.open(str(db)) as store:
            assert (
                store.settings_log.settings_changes("twins") == []
                and store.tuner.predictions("twins") == []
            )


def idle_trace():
    """A twin's own traffic is irrelevant here (the prediction replays what the store holds)."""
    from sim.traces import Trace, TraceRequest

    return Trace(
        "idle",
        (
            TraceRequest(
                id="only",
                arrival=3600.0,
                prompt_tokens=10,
                output_tokens=1,
                max_tokens=1,
                tenant="a",
            ),
        ),
    )


def test_set_preview_with_nothing_to_predict_on_exits_1_saying_so(workdir):
    cluster = workdir / "cluster.yaml"
    cluster.write_text(CLUSTER)
    res = invoke(
        "set",
        "--cluster",
        cluster,
        "--all",
        "--policy",
        "fcfs",
        "--preview",
        "--yes",
        "--db",
        workdir / "audit.db",
    )
    line = assert_one_line_error(res, 1, "not applied", max_lines=None)
    assert line == "Error: not applied: no replica could be previewed"


# --------------------------------------------------------------------- tune: no study left behind


def tune(workdir: Path, *flags: object) -> Result:
    return invoke(
        "tune",
        "--study",
        "s",
        "--storage",
        workdir / "optuna.db",
        "--db",
        workdir / "tp.db",
        "--policy",
        "uniboost",
        "--objective",
        "ttlt_p99",
        "--trials",
        "1",
        "--no-progress",
        *flags,
    )


def study_created(workdir: Path) -> bool:
    from tuner.studies.lookup import study_exists
    from tuner.studies.optuna_storage import open_storage

    return (workdir / "optuna.db").exists() and study_exists(
        open_storage(f"sqlite:///{workdir / 'optuna.db'}"), "s"
    )


def test_tune_refuses_a_non_finite_range_before_creating_the_study(workdir):
    assert_one_line_error(
        tune(workdir, "--range", "gamma=nan:1"), 2, "--range", "'gamma=nan:1'", "finite"
    )
    assert not study_created(workdir)


@pytest.mark.parametrize(
    "flag,value,words",
    [
        ("--range", "gamma=1:0", ("--range uniboost.gamma", "outside the settings model's bounds")),
        ("--fix", "gamma=nan", ("--fix", "params.gamma")),
    ],
    ids=["range out of bounds", "fix refused"],
)
def test_a_definition_the_setup_refuses_leaves_no_study_behind(workdir, flag, value, words):
    """Kept, the refused definition made every later run fail the same way, corrected flags or
    not."""
    res = tune(workdir, "--window-s", "60", "--windows", "2", flag, value)
    line = assert_one_line_error(res, 2, *words, max_lines=None)
    assert "input_value" not in line  # pydantic's echo of the document: one line, no values
    assert not study_created(workdir)


def test_tui_replay_and_db_naming_two_databases_is_refused(workdir):
    res = invoke("tui", "--replay", str(workdir / "a.db"), "--db", str(workdir / "b.db"))
    assert res.exit_code == 2 and "name two databases" in res.output
    assert sorted(p.name for p in workdir.iterdir()) == []


def test_tui_replay_db_the_old_spelling_is_read_and_named(workdir):
    """``tui --replay DB`` (the old spelling) reads DB as ``--replay --db DB`` does: the note
    names the new spelling and a mistyped path creates nothing."""
    db = workdir / "typo.db"
    res = invoke("tui", "--replay", str(db))
    assert res.exit_code == 2
    assert f"--replay {db} is now --replay --db {db}" in res.output
    assert "Invalid value for --db" in res.output and "does not exist" in res.output
    assert sorted(p.name for p in workdir.iterdir()) == []


def test_tui_replay_given_the_same_database_twice_is_one_database(workdir):
    """``--replay ./x.db --db x.db`` names one file: read as one (no "two databases")."""
    res = invoke("tui", "--replay", "./typo.db", "--db", "typo.db")
    assert res.exit_code == 2 and "two databases" not in res.output
    assert "does not exist" in res.output

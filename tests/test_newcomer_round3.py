"""A newcomer's dead ends and messages, round three (issue 33): each case misled or stopped a
newcomer on the code before this round — an input error on stdout with exit 1, ``+nan%``, escape
sequences replayed from the audit log, ``armed`` for a governor with nothing to govern, a twin's
cluster file that ``record --govern`` refuses, a busy port not named, the TUI drawing escape codes
into a pipe."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner, Result

from controlplane.cluster import parse_cluster_file
from scheduler.settings import Settings
from tailpilot.cli import main

TOKEN = "round-three-token"


def invoke(*args: object) -> Result:
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=True)


@pytest.fixture
def twin_cluster(tmp_path, monkeypatch):
    """One twin on loopback and its cluster file (with the token in the environment)."""
    from tuner.twins.cluster import start_twins

    monkeypatch.setenv("TAILPILOT_TOKEN", TOKEN)
    monkeypatch.chdir(tmp_path)
    twins = start_twins(1, settings=Settings.model_validate({"policy": "uniboost"}), token=TOKEN)
    path = twins.write_cluster_yaml(tmp_path / "cluster.yaml")
    try:
        yield path, twins[0]
    finally:
        twins.stop()


def test_a_value_no_policy_takes_is_an_input_error_on_stderr(twin_cluster):
    path, twin = twin_cluster
    res = invoke("set", "--cluster", path, "--all", "--set", "gamma=abc", "--db", "a.db")
    assert res.exit_code == 2, res.output
    assert "gamma" in res.stderr and "rejected" in res.stderr and res.stdout == ""
    assert twin.core.settings.policy == "uniboost" and twin.core.settings_doc()["version"] == 1


def test_who_with_a_terminal_escape_is_refused(twin_cluster):
    path, _ = twin_cluster
    res = invoke(
        "set", "--cluster", path, "--all", "--set", "gamma=2", "--who", "ops\x1b[2J", "--db", "a"
    )
    assert res.exit_code == 2 and "--who" in res.output and "U+001B" in res.output
    assert "\x1b" not in res.output  # shown escaped, never replayed


def test_compare_says_na_where_a_change_is_undefined(tmp_path):
    # the baseline (sarathi) never preempts here: a change in preemptions against it is
    # undefined, not "+nan%"
    res = invoke("compare", "--policy", "las", "--rate-scale", "3")
    assert res.exit_code == 0, res.output
    assert "nan" not in res.output.lower() and "n/a (baseline 0)" in res.output


def test_the_governor_is_not_armed_on_a_cluster_without_governance(tmp_path):
    cluster = tmp_path / "c.yaml"
    cluster.write_text(
        "clusters:\n  - name: c\n    replicas:\n"
        "      - {name: r1, api_url: 'http://127.0.0.1:9', control_url: 'http://127.0.0.1:9'}\n"
    )
    res = invoke("governor", "arm", "--cluster", cluster, "--db", tmp_path / "g.db")
    assert res.exit_code == 2 and "no governance block" in res.output
    assert not (tmp_path / "g.db").exists()  # refused before the database was opened


def test_a_twins_cluster_file_carries_a_governance_block(tmp_path):
    out = tmp_path / "twins.yaml"
    env = {**os.environ, "TAILPILOT_TOKEN": TOKEN, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from tailpilot.cli import main; main()",
            "twin",
            "--cluster-out",
            str(out),
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # the twin says when it wrote the file: no sleep-and-poll
            if line.startswith("cluster file:"):
                break
        else:
            pytest.fail("the twin ended without writing its cluster file")
        cluster = parse_cluster_file(out.read_text()).cluster()
        assert cluster.governance is not None and cluster.governance.tenants
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


def test_a_busy_port_is_named(tmp_path):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        res = invoke("twin", "--port", port)
    assert res.exit_code == 1 and f"port {port}" in res.output and "127.0.0.1" in res.output


def test_the_tui_refuses_to_draw_off_a_terminal(tmp_path):
    cluster = tmp_path / "c.yaml"
    cluster.write_text(
        "clusters:\n  - name: c\n    replicas:\n"
        "      - {name: r1, api_url: 'http://127.0.0.1:9', control_url: 'http://127.0.0.1:9'}\n"
    )
    started = time.monotonic()
    res = invoke("tui", "--cluster", cluster, "--readonly")
    assert res.exit_code == 2 and "needs a terminal" in res.output
    assert "\x1b[" not in res.output
    assert time.monotonic() - started < 60  # refused, not drawn until killed


def test_the_twin_cluster_file_is_valid_yaml_with_the_replicas(tmp_path):
    from sim.traces import load_bundled
    from tailpilot.cli_twin import demo_governance
    from tuner.twins.cluster import start_twins

    governance = demo_governance(load_bundled(), 1.0).model_dump(mode="json", exclude_defaults=True)
    with start_twins(2) as twins:
        path = twins.write_cluster_yaml(tmp_path / "t.yaml", governance=governance)
        doc = yaml.safe_load(Path(path).read_text())
    [cluster] = doc["clusters"]
    assert len(cluster["replicas"]) == 2 and cluster["governance"] == governance


def test_a_database_from_a_newer_tailpilot_says_so(tmp_path):
    import sqlite3

    from storage.store import Store

    path = tmp_path / "newer.db"
    Store.open(str(path)).close()
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE alembic_version SET version_num = '9999'")
    with pytest.raises(Exception, match=r"revision 9999\) is not one this tailpilot knows"):
        Store.open(str(path))


def test_a_database_in_a_missing_folder_names_the_folder(tmp_path):
    from storage.store import Store

    with pytest.raises(Exception, match=r"folder .*missing does not exist"):
        Store.open(str(tmp_path / "missing" / "a.db"))


def test_export_for_a_study_that_does_not_exist_says_so_and_lists_them(tmp_path, monkeypatch):
    from storage.store import Store

    monkeypatch.chdir(tmp_path)
    Store.open(str(tmp_path / "t.db")).close()
    res = invoke("export", "--study", "nosuch", "--db", tmp_path / "t.db")
    assert res.exit_code == 2 and "no such study" in res.output
    assert "tailpilot recommend" not in res.output  # not pointed to a command that fails too
    bad = invoke("export", "--study", "ab\udcff", "--db", tmp_path / "t.db")
    assert bad.exit_code == 2 and "--study" in bad.output and "not UTF-8" in bad.output
    assert bad.exception is None or isinstance(bad.exception, SystemExit)


def test_a_production_document_from_a_fifo_or_a_device_is_refused_before_any_work(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for source in (fifo, Path("/dev/zero")):
        res = invoke(
            "tune", "--study", "s", "--storage", tmp_path / "o.db", "--production", source,
            "--policy", "uniboost", "--trials", "1",
        )  # fmt: skip
        assert res.exit_code == 2 and "--production" in res.output
        assert "not a regular file" in res.output
    assert not (tmp_path / "o.db").exists()


def test_record_on_a_busy_metrics_port_creates_no_database(tmp_path):
    cluster = tmp_path / "c.yaml"
    cluster.write_text(
        "clusters:\n  - name: c\n    replicas:\n"
        "      - {name: r1, api_url: 'http://127.0.0.1:9', control_url: 'http://127.0.0.1:9'}\n"
    )
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        res = invoke(
            "record", "--cluster", cluster, "--db", tmp_path / "r.db",
            "--metrics-port", port, "--metrics-host", "127.0.0.1",
        )  # fmt: skip
    assert res.exit_code == 1 and f"127.0.0.1:{port}" in res.output
    assert not (tmp_path / "r.db").exists()


def test_the_demo_and_the_tui_agree_on_what_a_terminal_is(monkeypatch):
    """``demo`` opened the TUI when stdout was a terminal, and ``run_tui`` then refused a stdin
    that was not one (``demo < /dev/null`` ended in a traceback): one predicate for both."""
    import io

    from tailpilot.cli_twin import _tui_available
    from tui.main import on_a_terminal

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stdout", Tty())
    monkeypatch.setattr(sys, "stdin", io.StringIO())  # redirected: not a terminal
    assert not on_a_terminal() and not _tui_available()
    monkeypatch.setattr(sys, "stdin", Tty())
    assert on_a_terminal() and _tui_available()

"""Bad files on the command line are a one-line error naming the file, never a traceback: a database
that is damaged or is no database at all (given with --db or --replay), and a cluster file that is
not UTF-8 or writes a key twice. Run through the installed entry points, as an operator would."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest
from test_storage import damage_table, filled_store

from storage import Store

BIN = Path(sys.executable).parent
UNREACHABLE = (
    "http://127.0.0.1:9"  # the discard port: nothing listens, connections are refused at once
)
CLUSTER = f"""\
clusters:
  - name: c
    poll_interval_s: 0.2
    replicas:
      - {{name: r1, api_url: "{UNREACHABLE}", control_url: "{UNREACHABLE}"}}
"""


def run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        args, cwd=cwd, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL
    )


# Every entry point that opens a store; {db} and {cluster} are filled in per test.
COMMANDS = {
    "record": "tailpilot record --cluster {cluster} --db {db}",
    "set": "tailpilot set --cluster {cluster} --all --policy fcfs --db {db}",
    "tui --replay": "tailpilot tui --replay {db}",
    "calibrate": "tailpilot calibrate --db {db} --replica r1",
    "export": "tailpilot export --study s --db {db}",
    "python -m tui": "python -m tui --replay {db}",
    "record --quiet": "tailpilot record --cluster {cluster} --db {db} --quiet",
}


def argv(command: str, db: Path, cluster: Path) -> list[str]:
    exe = {"tailpilot": str(BIN / "tailpilot"), "python": sys.executable}
    return [exe.get(a, a.format(db=db, cluster=cluster)) for a in COMMANDS[command].split()]


@pytest.fixture
def cluster_file(tmp_path) -> Path:
    path = tmp_path / "cluster.yaml"
    path.write_text(CLUSTER)
    return path


def assert_one_line_error(
    res: subprocess.CompletedProcess[str], codes: tuple[int, ...], *words: str
) -> None:
    out = res.stdout + res.stderr
    assert "Traceback" not in out, out
    assert res.returncode in codes, out
    assert any(all(w in line for w in words) for line in out.splitlines()), out


@pytest.mark.parametrize("command", COMMANDS)
def test_a_file_that_is_not_a_database(command, tmp_path, cluster_file):
    db = tmp_path / "tailpilot.db"
    db.write_bytes(random.Random(1).randbytes(64 * 1024))
    res = run(argv(command, db, cluster_file), tmp_path)
    assert_one_line_error(res, (1, 2), str(db), "not a SQLite database (file is not a database)")


@pytest.mark.parametrize("command", COMMANDS)
def test_a_database_damaged_where_the_command_reads_or_writes(command, tmp_path, cluster_file):
    """The file opens (its schema and migration version are intact); the damage shows at first
    use."""
    db = tmp_path / "tailpilot.db"
    filled_store(db)
    with Store.open(str(db)) as s:
        s.tuner.store_recommendation("s", {"policy": "fcfs"}, {})
    for table in ("replicas", "samples", "recommendations"):
        damage_table(db, table)
    res = run(argv(command, db, cluster_file), tmp_path)
    assert_one_line_error(
        res, (1, 2), str(db), "the database file is damaged (database disk image is malformed)"
    )


def test_a_cluster_file_that_is_not_utf8(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_bytes(CLUSTER.replace("name: c", "name: c\xe9").encode("latin-1"))
    res = run([str(BIN / "tailpilot"), "status", "--cluster", str(path)], tmp_path)
    offset = CLUSTER.index("name: c") + len("name: c")
    assert_one_line_error(res, (2,), str(path), f"not UTF-8 text (byte 0xe9 at offset {offset})")


def test_a_cluster_file_with_a_key_written_twice(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text(
        CLUSTER.replace("    poll_interval_s: 0.2\n", "    poll_interval_s: 0.2\n    name: d\n")
    )
    res = run([str(BIN / "tailpilot"), "status", "--cluster", str(path)], tmp_path)
    assert_one_line_error(res, (2,), f"{path}:4:", "duplicate key 'name' (first on line 2)")

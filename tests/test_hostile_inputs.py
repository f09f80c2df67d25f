"""What a stranger sent (2026-12-03 review): hostile trace and settings files get one line naming
the file and the line or field, never a traceback or a hang; a broken replica's /state is read
with each broken optional value as null, and nothing it says can grow the store without bound or
store a negative count. Each case failed on the code before (a traceback, a hang, a whole answer
dropped, a 4 MB row per version).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from controlplane.export import ExportError, load_settings_file
from controlplane.poller import kv_usage_of
from controlplane.replica_http import opt_int, read_state
from scheduler.names import NAME_MAX_CHARS
from scheduler.plugin.core import load_startup_settings
from scheduler.plugin.env import PluginEnv
from scheduler.settings import clean_name, name_problem
from storage import limits
from storage.rows import CompletionRow
from tailpilot.cli import main


def invoke(*args: object) -> Result:
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=True)


def one_error_line(res: Result, *words: str) -> str:
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    assert "Traceback" not in res.output and res.exit_code == 2, res.output
    [line] = [line for line in res.output.splitlines() if line.startswith("Error:")]
    assert all(w in line for w in words), line
    return line


# --- trace files ---------------------------------------------------------------------------------

VIDUR = "arrived_at,num_prefill_tokens,num_decode_tokens\n"


@pytest.mark.parametrize(
    "name, text, words",
    [
        # a gap of 1e50 s: the simulator's clock could not move past it (it hung)
        ("gap.csv", VIDUR + "0,10,5\n1e50,10,5\n", ["gap-000001", "arrival must be in"]),
        ("span.csv", VIDUR + "-1e308,10,5\n1e308,10,5\n", ["span-000001", "arrival"]),
        (
            "digits.jsonl",
            '{"timestamp": ' + "9" * 5000 + ', "input_length": 5, "output_length": 5}\n',
            ["digits.jsonl:1", "4,300 digits"],
        ),
        (
            "huge.jsonl",
            '{"timestamp": 0, "input_length": ' + "9" * 400 + ', "output_length": 5}\n',
            ["huge.jsonl:1", "input_length", "not a finite number"],
        ),
    ],
)
def test_a_hostile_trace_is_one_line_naming_the_file_or_request(tmp_path, name, text, words):
    path = tmp_path / name
    path.write_text(text)
    one_error_line(invoke("sim", "--trace", path, "--policy", "fcfs"), *words)


def test_retargeting_a_trace_without_a_rate_is_one_line(tmp_path):
    path = tmp_path / "one.csv"
    path.write_text("num_prefill_tokens,num_decode_tokens\n10,5\n")  # a length-only trace
    one_error_line(invoke("sim", "--trace", path, "--target-rate", 2), "one", "rate")


# --- settings files -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data, words",
    [
        (b'{"policy": "uniboost", "n": "caf\xe9"}', "not UTF-8"),
        (b'{"policy": "uniboost", "params": {"gamma": 1' + b"0" * 5000 + b"}}", "5001 digits"),
        (b'{"policy": "uniboost", "policy": "fcfs"}', "key 'policy' given more than once"),
        (b'{"policy": "slofq", "params": {"tenants": {"a\\u0000b": {}}}}', "a\\x00b"),
    ],
)
def test_a_hostile_settings_file_is_refused_naming_the_problem(tmp_path, data, words):
    path = tmp_path / "s.json"
    path.write_bytes(data)
    with pytest.raises(ExportError) as err:
        load_settings_file(path)
    assert words in str(err.value) and "\x00" not in str(err.value)
    line = one_error_line(invoke("export", "--settings", path), words)
    assert "\x00" not in line
    # The plugin reads its start-up file with the same strict reader (and the same model).
    with pytest.raises(ValueError):
        load_startup_settings(env=PluginEnv(settings_file=str(path)))


def test_a_settings_file_with_a_bom_is_read_as_the_plugin_reads_it(tmp_path):
    path = tmp_path / "bom.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"policy": "las"}).encode())
    assert load_settings_file(path).policy == "las"
    assert load_startup_settings(env=PluginEnv(settings_file=str(path))).policy == "las"


# --- a broken replica -----------------------------------------------------------------------------


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 1e400, 2.0**70, True, "5"])
def test_a_count_off_a_metrics_page_that_is_no_count_is_null(value):
    assert opt_int(value) is None


def test_opt_int_keeps_what_is_a_count():
    assert [opt_int(v) for v in (0, 7, 7.0, -3)] == [0, 7, 7, -3]


@pytest.mark.parametrize(
    "field, value",
    [
        ("more", "yes"),
        ("settings", [1]),
        ("live", 7),
        ("kv", "full"),
        ("breaker", "x"),
        ("waiting_by_tenant", {"a": "x"}),
        ("waiting_by_tenant", ["a"]),
        ("waiting_by_type", {"a": 1.5}),
    ],
)
def test_a_broken_optional_field_is_null_and_the_rest_is_read(field, value):
    doc = {"completions": [], "next_cursor": 3, "waiting": 2, field: value}
    state = read_state(doc)
    assert getattr(state, field) is None and state.waiting == 2 and state.next_cursor == 3


def test_negative_counts_and_an_oversized_settings_document_are_not_stored():
    rejected: dict[str, int] = {}
    big = {"policy": "fcfs", "params": {}, "note": "x" * (limits.SETTINGS_DOC_BYTES + 1)}
    doc = {
        "completions": [],
        "next_cursor": 0,
        "waiting": -12,
        "running": -3,
        "settings_version": -7,
        "kv": {"used_blocks": -5, "total_blocks": 10, "usage": -0.5},
        "settings": big,
    }
    state = read_state(doc, rejected)
    assert (state.waiting, state.running, state.settings_version) == (None, None, None)
    assert state.kv is not None and state.kv.used_blocks is None and state.kv.total_blocks == 10
    assert state.kv.usage is None  # a fraction below zero
    assert state.settings is None
    assert rejected == {limits.OUT_OF_RANGE: 5, limits.TOO_LONG: 1}


@pytest.mark.parametrize(
    ("usage", "kept"), [(0.0, True), (1.0, True), (1.5, False), (-1e-9, False)]
)
def test_kv_usage_is_a_fraction(usage, kept):
    state = read_state({"completions": [], "next_cursor": 0, "kv": {"usage": usage}}, {})
    assert state.kv is not None and state.kv.usage == (usage if kept else None)
    assert kv_usage_of({"kv_usage": usage}) == (usage if kept else None)


def completion_entry(**fields: object) -> CompletionRow:
    base: dict = dict(
        replica="r", request_id="q", tenant="a", type="chat", arrival_s=10.0,
        first_token_s=11.0, finished_s=12.0, prompt_tokens=5, output_tokens=7, preemptions=0,
    )  # fmt: skip
    return CompletionRow(**{**base, **fields})


@pytest.mark.parametrize(
    "fields",
    [
        dict(finished_s=9.0),  # finished before it arrived: no latency of it is true
        dict(prompt_tokens=-1),
        dict(output_tokens=-7),
        dict(preemptions=-1),
        dict(recomputed_tokens=-2),
    ],
)
def test_a_completion_with_a_negative_latency_or_count_is_not_stored(fields):
    fitted, reasons = limits.fit_completion(completion_entry(**fields))
    assert fitted is None and reasons == [limits.OUT_OF_RANGE]


@pytest.mark.parametrize("first_token_s", [9.0, 12.5])
def test_a_first_token_outside_the_requests_life_is_unknown(first_token_s):
    fitted, reasons = limits.fit_completion(completion_entry(first_token_s=first_token_s))
    assert fitted is not None and fitted.first_token_s is None and reasons == [limits.OUT_OF_RANGE]
    fitted, reasons = limits.fit_completion(completion_entry(max_tokens=-4))
    assert fitted is not None and fitted.max_tokens is None and reasons == [limits.OUT_OF_RANGE]
    fitted, reasons = limits.fit_completion(completion_entry(first_token_s=12.0, max_tokens=0))
    assert fitted == completion_entry(first_token_s=12.0, max_tokens=0) and reasons == []


def test_a_settings_document_a_replica_could_have_taken_is_stored(tmp_path: Path):
    doc = {"policy": "fcfs", "params": {}, "note": "x" * 1000}
    state = read_state({"completions": [], "next_cursor": 0, "settings": doc})
    assert state.settings == doc


def test_a_name_the_engine_governs_by_is_recorded_and_shown_by_that_name():
    """One bound for tenant and type names in the engine and in the recorder: a name a settings
    document may govern by is never folded into "other" on the operator side."""
    longest = "t" * NAME_MAX_CHARS
    assert name_problem(longest) is None and limits.group_name(longest) == (longest, None)
    assert name_problem(longest + "t") is not None  # the document is refused, naming it
    label = clean_name(longest + "t")  # a client's longer label is cut, never refused
    assert limits.group_name(label) == (label, None)


# --- files read whole: capped, regular files only --------------------------------------------


def _cluster_file(tmp_path: Path) -> Path:
    cluster = tmp_path / "c.yaml"
    cluster.write_text(
        "clusters:\n- name: c\n  replicas:\n  - name: r0\n"
        "    api_url: http://127.0.0.1:1\n    control_url: http://127.0.0.1:1\n"
    )
    return cluster


@pytest.mark.parametrize(
    "content,words",
    [
        ('{"interval_s": 30, "interval_s": 90}', ["interval_s", "more than once"]),
        ('{"interval_s": "60"}', ["interval_s"]),
        ('{"prefer_small": "yes"}', ["prefer_small"]),
        ('{"interval_s": NaN}', ["NaN"]),
    ],
)
def test_an_autopilot_config_is_read_strictly(tmp_path, content, words):
    """A key given twice is refused (not "the last one wins"), a number or a flag as a string is
    refused: the operator's file means what it says or is not used."""
    config = tmp_path / "ap.json"
    config.write_text(content)
    res = invoke(
        "record", "--cluster", _cluster_file(tmp_path), "--db", tmp_path / "d.db",
        "--autopilot", "--autopilot-config", config,
    )  # fmt: skip
    one_error_line(res, "--autopilot-config", *words)
    assert not (tmp_path / "d.db").exists()


@pytest.mark.parametrize("kind", ["fifo", "zero", "directory"])
def test_files_read_whole_refuse_fifos_devices_and_endless_input(tmp_path, kind):
    """An autopilot configuration, a cluster file and a settings document given as a FIFO (which
    would hang the reader until a writer comes), /dev/zero (which never ends) or a directory:
    each one line naming the file, at once, without reading it."""
    import os

    if kind == "fifo":
        path = tmp_path / "pipe"
        os.mkfifo(path)
    elif kind == "zero":
        path = Path("/dev/zero")
    else:
        path = tmp_path
    what = "not a regular file" if kind != "directory" else "a directory"
    res = invoke(
        "record", "--cluster", _cluster_file(tmp_path), "--db", tmp_path / "d.db",
        "--autopilot", "--autopilot-config", path,
    )  # fmt: skip
    one_error_line(res, "--autopilot-config", what)
    res = invoke("status", "--cluster", path)
    assert res.exit_code == 2 and what in res.output and "Traceback" not in res.output
    with pytest.raises(ExportError, match=what):
        load_settings_file(path)


def test_a_destination_is_checked_before_the_work(tmp_path):
    """`autopilot tune --out` into a missing folder used to fail after the whole tune had run
    (result lost); a device as `--out` was replaced by a regular file. Every --out is checked
    first: a missing folder, a device, a read-only folder — one line each, at once."""
    import os

    res = invoke("autopilot", "tune", "--trials", "1", "--out", tmp_path / "no" / "ap.json")
    one_error_line(res, "--out", "does not exist")
    res = invoke("schema", "--out", "/dev/null")
    one_error_line(res, "--out", "not a regular file")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):  # root writes anywhere: nothing to refuse here
            return
        res = invoke("schema", "--out", locked / "s.json")
        one_error_line(res, "--out", "not writable")
    finally:
        locked.chmod(0o700)

"""The settings model's validation and the `tailpilot sim` / `compare` commands."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner
from pydantic import ValidationError

from scheduler.settings import Settings
from scheduler.settings_change import SettingsChange, settings_from_cli
from tailpilot.cli import main


# --- settings -----------------------------------------------------------------------------
def test_defaults_fill_in_and_round_trip():
    s = Settings.model_validate({"policy": "uniboost", "params": {"gamma": 8}, "pinned": ["gamma"]})
    assert s.param("gamma") == 8.0 and s.param("memguard") is True and s.is_pinned("gamma")
    assert Settings.model_validate(json.loads(json.dumps(s.to_dict()))) == s


@pytest.mark.parametrize(
    "doc, field",
    [
        ({"policy": "nope"}, "policy"),
        ({"policy": "uniboost", "params": {"gamma": 0}}, "params.gamma"),
        ({"policy": "uniboost", "params": {"gamma": -3}}, "params.gamma"),
        ({"policy": "uniboost", "params": {"gammma": 3}}, "params.gammma"),
        ({"policy": "tie", "params": {"beta": 1.5}}, "params.beta"),
        ({"policy": "tie", "params": {"alpha": 1.0}}, "params.alpha"),
        ({"policy": "vtc", "params": {"weights": {"acme": 0}}}, "acme"),
        ({"policy": "uniboost", "pinned": ["beta"]}, "pinned"),
        ({"policy": "fcfs", "engine": {"max_num_seqs": 0}}, "max_num_seqs"),
        ({"policy": "fcfs", "engine": {"max_num_seq": 4}}, "max_num_seq"),
        ({"policy": "fcfs", "extra": 1}, "extra"),
        ({"policy": "uniboost", "params": {"gamma_min": 50, "gamma_max": 10}}, "gamma_min"),
    ],
)
def test_bad_documents_are_rejected_naming_the_field(doc, field):
    with pytest.raises(ValidationError) as err:
        Settings.model_validate(doc)
    assert field in str(err.value)


def test_replace_merges_params_and_resets_them_on_a_policy_switch():
    s = Settings.model_validate({"policy": "uniboost", "params": {"gamma": 8}, "pinned": ["gamma"]})
    t = SettingsChange(params={"memguard": False}).apply(s)
    assert t.param("gamma") == 8.0 and t.param("memguard") is False and t.pinned == ("gamma",)
    u = SettingsChange(policy="tie").apply(s)
    assert u.policy == "tie" and u.pinned == () and u.param("alpha") == 0.9
    with pytest.raises(ValidationError):
        SettingsChange(params={"gamma": -1}).apply(s)
    assert s.param("gamma") == 8.0  # the original is untouched (immutable)


def test_cli_assignments_are_typed_and_engine_fields_routed():
    s = settings_from_cli("uniboost", ["gamma=8", "memguard=off", "max_num_seqs=64"], ["gamma"])
    assert s.param("gamma") == 8.0 and s.param("memguard") is False
    assert s.engine.max_num_seqs == 64 and s.pinned == ("gamma",)


# --- CLI ----------------------------------------------------------------------------------
def run_cli(*args):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_sim_json_on_the_bundled_window():
    res = run_cli(
        "sim",
        "--policy",
        "uniboost",
        "--set",
        "gamma=8",
        "--pin",
        "gamma",
        "--from",
        "0",
        "--to",
        "120",
        "--json",
    )
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert doc["settings"]["params"]["gamma"] == 8.0 and doc["settings"]["pinned"] == ["gamma"]
    m = doc["metrics"]
    assert m["requests"] == doc["run"]["requests"] > 100
    assert 0 < m["ttft_p50"] <= m["ttft_p99"] <= m["ttlt_p99"]


def test_sim_rejects_bad_parameters_naming_them():
    res = run_cli("sim", "--policy", "uniboost", "--set", "gamma=-1", "--to", "10")
    assert res.exit_code == 2 and "params.gamma" in res.output
    res = run_cli("sim", "--policy", "uniboost", "--set", "gamam=2", "--to", "10")
    assert res.exit_code == 2 and "params.gamam" in res.output and "unknown parameter" in res.output


def test_sim_reports_a_malformed_trace_line(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:50.9951690,abc,109\n"
    )
    res = run_cli("sim", "--trace", str(bad), "--policy", "fcfs")
    assert res.exit_code == 2 and "bad.csv:3" in res.output and "ContextTokens" in res.output


def test_compare_changes_are_relative_to_the_baseline():
    res = run_cli(
        "compare",
        "--policy",
        "fcfs,uniboost,srpt",
        "--baseline",
        "fcfs",
        "--from",
        "0",
        "--to",
        "120",
        "--set",
        "uniboost.gamma=0.5",
        "--json",
    )
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert set(doc["metrics"]) == {"fcfs", "uniboost", "srpt"}
    assert all(v == 0 for v in doc["change_pct"]["fcfs"].values())
    base, other = doc["metrics"]["fcfs"]["ttlt_p99"], doc["metrics"]["srpt"]["ttlt_p99"]
    assert doc["change_pct"]["srpt"]["ttlt_p99"] == pytest.approx((base - other) / base * 100)


def test_compare_table_and_console_script():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "tailpilot.cli",
            "compare",
            "--policy",
            "fcfs,uniboost",
            "--baseline",
            "fcfs",
            "--from",
            "0",
            "--to",
            "60",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "% change vs fcfs" in out.stdout and "uniboost" in out.stdout


# --- --max-tokens-default ----------------------------------------------------------------------
def _tiny_azure(tmp_path, outputs):
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    lines += [f"2023-11-16 18:15:{10 + i:02d}.0000000,{50 + i},{o}" for i, o in enumerate(outputs)]
    path = tmp_path / "tiny.csv"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_max_tokens_default_reaches_the_loader_and_truncations_are_reported(tmp_path, monkeypatch):
    from sim import traces

    outputs = [5, 40, 60, 80, 120, 7, 300, 2]
    path = _tiny_azure(tmp_path, outputs)
    seen = []
    real = traces.load_trace

    def spy(*args, **kw):
        trace = real(*args, **kw)
        seen.append(trace)
        return trace

    monkeypatch.setattr(traces, "load_trace", spy)
    res = run_cli(
        "sim", "--trace", str(path), "--policy", "fcfs", "--max-tokens-default", "50", "--json"
    )
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["run"]["requests"] == len(outputs)  # the note goes to stderr only
    [trace] = seen
    assert {r.max_tokens for r in trace} == {50}
    assert [r.output_tokens for r in trace] == [min(o, 50) for o in outputs]
    over = sum(o > 50 for o in outputs)
    assert f"{over} of {len(outputs)} requests" in res.stderr and "truncated" in res.stderr

    seen.clear()  # without the flag: the module default, nothing truncated, no note
    res = run_cli(
        "compare", "--trace", str(path), "--policy", "fcfs,sjf", "--baseline", "fcfs", "--json"
    )
    assert res.exit_code == 0, res.output
    assert {r.max_tokens for r in seen[0]} == {traces.DEFAULT_MAX_TOKENS} and res.stderr == ""

    res = run_cli("sim", "--trace", str(path), "--max-tokens-default", "0")
    assert res.exit_code == 2 and "--max-tokens-default" in res.output


def test_max_tokens_default_is_a_trace_option_of_every_trace_command():
    from sim.traces import DEFAULT_MAX_TOKENS

    for command in ("sim", "compare", "twin"):
        res = run_cli(command, "--help")
        assert res.exit_code == 0 and "--max-tokens-default" in res.output, command
        assert f"[default: {DEFAULT_MAX_TOKENS}]" in " ".join(res.output.split()), command


def test_the_policies_that_read_a_predictor_are_those_whose_parameters_name_one():
    """One definition (scheduler.settings.PREDICTED_POLICIES) of which policies read a length
    predictor: make_policy gives those one and no other; the simulator, the plugin's switch and
    the CLI's --predictor read the same set."""
    from scheduler.policies import make_policy
    from scheduler.settings import POLICY_NAMES, PREDICTED_POLICIES

    for name in POLICY_NAMES:
        policy = make_policy(Settings.model_validate({"policy": name}))
        assert (policy.predictor is not None) == (name in PREDICTED_POLICIES), name
        if policy.keys_by_prediction:  # grouping by prediction needs one
            assert name in PREDICTED_POLICIES, name
    assert {"sjf", "srpt", "tie"} == PREDICTED_POLICIES


def test_a_settings_change_is_one_value_every_path_applies():
    """``SettingsChange``: ``tailpilot set``'s words parsed once (engine names to the engine
    block), applied to what a replica runs — a switch starts from the new policy's defaults and
    drops its pins, parameters and engine fields merge, pins added after the replica's own."""

    change = SettingsChange.parse(
        "uniboost",
        ["gamma=0.5", "engine.max_num_seqs=64", "max_num_batched_tokens=4096"],
        ["gamma"],
    )
    assert change.params == {"gamma": 0.5}
    assert change.engine == {"max_num_seqs": 64, "max_num_batched_tokens": 4096}
    running = Settings.model_validate(
        {
            "policy": "tie",
            "params": {"beta": 0.3},
            "pinned": ["beta"],
            "engine": {"max_num_seqs": 8},
        }
    )
    new = change.apply(running)
    assert new.policy == "uniboost" and new.param("gamma") == 0.5 and new.pinned == ("gamma",)
    assert new.engine.max_num_seqs == 64 and new.engine.max_num_batched_tokens == 4096
    assert new.param("memguard") is True  # the new policy's defaults, not tie's
    same = SettingsChange(params={"alpha_s_per_token": 1e-4}, pin=frozenset({"alpha_s_per_token"}))
    kept = same.apply(new)
    assert kept.param("gamma") == 0.5 and kept.pinned == ("gamma", "alpha_s_per_token")
    assert SettingsChange(unpin=frozenset({"gamma"})).apply(kept).pinned == ("alpha_s_per_token",)
    assert change.describe() == (
        "policy=uniboost, gamma=0.5, engine.max_num_seqs=64, engine.max_num_batched_tokens=4096, "
        "pin gamma"
    )
    assert SettingsChange().empty and not change.empty
    with pytest.raises(ValueError, match="expected name=value"):
        SettingsChange.parse(None, ["gamma"])
    with pytest.raises(ValidationError):  # validated once, where it is applied
        SettingsChange(params={"gamma": -1.0}).apply(new)


def test_engine_fields_a_document_leaves_out_keep_the_replicas_own():
    """``with_engine``, the one place (the plugin's PUT, its start-up file, steering): the given
    fields win, the others are the replica's, a non-object block is left for validation."""
    from scheduler.settings_change import with_engine

    replica = {"max_num_seqs": 8, "max_num_batched_tokens": 1024}
    doc = with_engine({"policy": "fcfs", "engine": {"max_num_seqs": 16}}, replica)
    assert doc["engine"] == {"max_num_seqs": 16, "max_num_batched_tokens": 1024}
    assert with_engine({"policy": "fcfs"}, replica)["engine"] == replica
    assert with_engine({"engine": "big"}, replica) == {"engine": "big"}
    with pytest.raises(ValidationError, match="engine"):
        Settings.model_validate(with_engine({"policy": "fcfs", "engine": "big"}, replica))


def test_a_whole_document_and_a_recommendation_are_settings_changes_too():
    """The plugin's PUT and a script's whole document (``SettingsChange.whole``), and the TUI's
    recommendation (``SettingsChange.recommendation``) are the same value: the engine fields a
    document leaves out are the replica's; a whole document's pins are its own, a
    recommendation's are the replica's, kept at their values, and a policy switch over one is
    refused."""
    running = Settings.model_validate(
        {
            "policy": "uniboost",
            "params": {"gamma": 12.0, "ada_ema": 0.3},
            "pinned": ["gamma"],
            "engine": {"max_num_seqs": 8},
        }
    )
    doc = {"policy": "uniboost", "params": {"gamma": 0.5, "ada_ema": 0.9}}
    whole = SettingsChange.whole(doc).apply(running)
    assert whole.param("gamma") == 0.5 and whole.pinned == () and whole.engine.max_num_seqs == 8
    assert SettingsChange.whole(whole).apply(running) == whole  # a validated document as is
    assert not SettingsChange.whole(doc).empty
    assert SettingsChange.whole(doc).describe() == "whole settings document"
    rec = SettingsChange.recommendation(doc).apply(running)
    assert (rec.param("gamma"), rec.param("ada_ema"), rec.pinned) == (12.0, 0.9, ("gamma",))
    assert rec.engine.max_num_seqs == 8  # not the model's default: no restart asked for
    with pytest.raises(ValueError, match="pinned gamma on uniboost: the recommendation switches"):
        SettingsChange.recommendation({"policy": "fcfs"}).apply(running)
    unpinned = SettingsChange(unpin=frozenset({"gamma"})).apply(running)
    assert SettingsChange.recommendation({"policy": "fcfs"}).apply(unpinned).policy == "fcfs"
    # A change on top of a whole document applies to it, not to the replica's.
    both = SettingsChange(document=doc, params={"ada_ema": 0.1}).apply(running)
    assert (both.param("gamma"), both.param("ada_ema")) == (0.5, 0.1)
    with pytest.raises(ValidationError, match="gamma"):  # validated once, where it is applied
        SettingsChange.whole({"policy": "uniboost", "params": {"gamma": -1}}).apply(running)


def test_pin_and_unpin_of_one_name_is_refused():

    with pytest.raises(ValueError, match="--pin and --unpin both name gamma"):
        SettingsChange.parse("uniboost", (), ["gamma", "beta"], ["gamma"])


def test_the_engine_models_vllms_prefix_cache_unless_told_vllm_runs_without_it():
    """``--no-enable-prefix-caching`` (vLLM's own flag) replays a replica run without the cache:
    on a KV cache small enough to preempt, victims recompute their whole prefixes and the same
    trace takes longer."""

    def replay(*flags: str) -> dict:
        out = run_cli("sim", "--policy", "sarathi", "--num-gpu-blocks", "800", "--json", *flags)
        assert out.exit_code == 0, out.output
        return json.loads(out.output)

    cached, uncached = replay(), replay("--no-enable-prefix-caching")
    assert cached["metrics"]["preemptions"] > 100  # the regime where the cache matters
    assert uncached["run"]["sim_time_s"] > cached["run"]["sim_time_s"]
    assert uncached["metrics"]["ttlt_p99"] > cached["metrics"]["ttlt_p99"]

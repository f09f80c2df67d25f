"""The plugin's environment: read once, validated, every error naming its variable."""

from __future__ import annotations

import pytest

from scheduler.plugin.api import token_from_env
from scheduler.plugin.core import load_startup_settings
from scheduler.plugin.env import DEFAULT_PORT, PluginEnv, PluginEnvError


def test_unset_is_the_defaults():
    env = PluginEnv.read({})
    assert (env.api_host, env.api_port, env.replica, env.token, env.settings_file) == (
        "127.0.0.1",
        DEFAULT_PORT,
        "replica",
        None,
        None,
    )


@pytest.mark.parametrize(
    "var,value",
    [
        ("TAILPILOT_API_PORT", "abc"),
        ("TAILPILOT_API_PORT", "70000"),
        ("TAILPILOT_API_PORT", "80.5"),
        ("TAILPILOT_REPLICA", "x" * 500),
    ],
)
def test_a_bad_value_is_an_error_naming_the_variable(var, value):
    with pytest.raises(PluginEnvError) as err:
        PluginEnv.read({var: value})
    assert str(err.value).startswith(f"{var}={value!r}: expected ")


def test_values_are_read_and_typed():
    env = PluginEnv.read(
        {"TAILPILOT_API_PORT": " -1 ", "TAILPILOT_API_HOST": "::1", "TAILPILOT_REPLICA": "a100-0"}
    )
    assert (env.api_port, env.api_host, env.replica) == (-1, "::1", "a100-0")


def test_a_blank_token_is_no_token_and_the_file_is_the_fallback(tmp_path):
    assert token_from_env(PluginEnv.read({"TAILPILOT_TOKEN": "   "})) is None
    f = tmp_path / "token"
    f.write_text("s3cret\n")
    assert (
        token_from_env(PluginEnv.read({"TAILPILOT_TOKEN": "", "TAILPILOT_TOKEN_FILE": str(f)}))
        == "s3cret"
    )
    assert (
        token_from_env(PluginEnv.read({"TAILPILOT_TOKEN_FILE": str(tmp_path / "missing")})) is None
    )


def test_the_settings_file_comes_from_the_environment(tmp_path):
    f = tmp_path / "s.json"
    f.write_text('{"policy": "fcfs"}')
    assert (
        load_startup_settings(env=PluginEnv.read({"TAILPILOT_SETTINGS_FILE": str(f)})).policy
        == "fcfs"
    )
    assert (
        load_startup_settings({"max_num_seqs": 7}, env=PluginEnv.read({})).engine.max_num_seqs == 7
    )

"""tailpilot export: every format parses back to its input (settings JSON, `vllm serve` line,
ConfigMap, production-stack Helm values); input from a settings file or a stored recommendation;
errors name the field; vLLM's own argument parser accepts the flags (slow)."""

from __future__ import annotations

import json
import shlex

import pytest
import yaml
from click.testing import CliRunner

from controlplane.export import (
    CONFIGMAP_KEY,
    FORMATS,
    SCHEDULER_CLASSES,
    SETTINGS_ANNOTATION,
    ExportError,
    ExportOptions,
    helm_values,
    parse_vllm_args,
    render,
    settings_from_configmap,
    settings_from_helm_values,
    verify,
)
from scheduler.settings import Settings
from scheduler.settings_change import SettingsChange
from tailpilot.cli_export import COMMANDS, calibrate, export

DOCS = {
    "uniboost-lpt": {
        "policy": "uniboost",
        "params": {"gamma": 8.0, "gamma_ada": False},
        "pinned": ["gamma"],
        "engine": {
            "max_num_seqs": 64,
            "max_num_batched_tokens": 4096,
            "long_prefill_token_threshold": 512,
        },
    },
    "sarathi-defaults": {"policy": "sarathi"},
    "vtc-weights": {
        "policy": "vtc",
        "params": {"weights": {"acme": 2.0, "globex: eu": 0.5}},
        "engine": {"max_num_seqs": 256, "max_num_batched_tokens": 8192},
    },
    "tie-history": {
        "policy": "tie",
        "params": {"predictor": "history", "beta": 0.2},
        "pinned": ["beta"],
    },
}

OPTIONS = ExportOptions(
    model="meta-llama/Meta-Llama-3-8B-Instruct",
    settings_path="/etc/tp/settings file.json",
    name="tp-settings",
    namespace="llm",
    source="test",
)


def settings_of(key: str) -> Settings:
    return Settings.model_validate(DOCS[key])


def run(*args, **kw):
    return CliRunner().invoke(export, [str(a) for a in args], catch_exceptions=False, **kw)


# --- round trips per format ---------------------------------------------------------------------
@pytest.mark.parametrize("key", DOCS)
def test_settings_format_is_what_the_plugin_reads_at_startup(key, tmp_path, monkeypatch):
    from scheduler.plugin.core import SETTINGS_FILE_ENV, load_startup_settings

    settings = settings_of(key)
    text = render(settings, "settings", OPTIONS)
    assert json.loads(text) == settings.to_dict()
    path = tmp_path / "settings.json"
    path.write_text(text)
    monkeypatch.setenv(SETTINGS_FILE_ENV, str(path))
    # The plugin merges vLLM's engine values under the document's: the document's win.
    assert load_startup_settings({"max_num_seqs": 1, "max_num_batched_tokens": 1}) == settings


@pytest.mark.parametrize("scheduler", ["async", "sync"])
@pytest.mark.parametrize("key", DOCS)
def test_vllm_args_line_splits_back_into_env_model_and_flags(key, scheduler):
    settings = settings_of(key)
    options = ExportOptions(
        model="org/model with space",
        settings_path="/etc/tp/settings file.json",
        scheduler=scheduler,
    )
    text = render(settings, "vllm-args", options)
    assert text.count("\n") == 1
    argv = shlex.split(text)
    assert argv[0] == "TAILPILOT_SETTINGS_FILE=/etc/tp/settings file.json"
    assert argv[1:4] == ["vllm", "serve", "org/model with space"]
    env, model, flags = parse_vllm_args(text)
    eng = settings.engine
    want = {
        "--scheduler-cls": SCHEDULER_CLASSES[scheduler],
        "--max-num-seqs": str(eng.max_num_seqs),
        "--max-num-batched-tokens": str(eng.max_num_batched_tokens),
    }
    if eng.long_prefill_token_threshold > 0:
        want["--long-prefill-token-threshold"] = str(eng.long_prefill_token_threshold)
    assert flags == want and model == "org/model with space"
    assert env == {"TAILPILOT_SETTINGS_FILE": "/etc/tp/settings file.json"}


def test_long_prefill_flag_only_when_on():
    assert "--long-prefill-token-threshold 512" in render(settings_of("uniboost-lpt"), "vllm-args")
    assert "long-prefill" not in render(settings_of("sarathi-defaults"), "vllm-args")


@pytest.mark.parametrize("key", DOCS)
def test_configmap_parses_back_to_the_same_settings(key):
    settings = settings_of(key)
    text = render(settings, "configmap", OPTIONS)
    doc = yaml.safe_load(text)
    assert doc["apiVersion"] == "v1" and doc["kind"] == "ConfigMap"
    assert doc["metadata"]["name"] == "tp-settings" and doc["metadata"]["namespace"] == "llm"
    assert set(doc["data"]) == {CONFIGMAP_KEY}
    assert json.loads(doc["data"][CONFIGMAP_KEY]) == settings.to_dict()
    assert settings_from_configmap(text) == settings
    assert "|" in text  # the JSON is a literal block, readable in `kubectl get -o yaml`
    no_ns = yaml.safe_load(render(settings, "configmap", ExportOptions()))
    assert (
        "namespace" not in no_ns["metadata"] and no_ns["metadata"]["name"] == "tailpilot-settings"
    )


def test_a_configmap_with_a_key_written_twice_is_refused():
    """Read with the same strict loader as cluster files: PyYAML alone would keep the second
    ``data``."""
    text = render(settings_of("uniboost-lpt"), "configmap", OPTIONS)
    with pytest.raises(yaml.YAMLError, match="duplicate key 'data'"):
        settings_from_configmap(text + "data: {}\n")


# The parts of the chart's values.schema.json (vllm-project/production-stack, helm/) that the
# modelSpec entries we write must satisfy: the required keys and the types of every key we set.
MODEL_SPEC_SCHEMA = {
    "type": "object",
    "required": [
        "name",
        "repository",
        "tag",
        "modelURL",
        "replicaCount",
        "requestCPU",
        "requestMemory",
        "requestGPU",
        "pvcStorage",
    ],
    "properties": {
        "name": {"type": "string"},
        "repository": {"type": "string"},
        "tag": {"type": "string"},
        "modelURL": {"type": "string"},
        "replicaCount": {"type": "integer"},
        "requestCPU": {"type": "integer"},
        "requestMemory": {"type": "string"},
        "requestGPU": {"type": "integer"},
        "pvcStorage": {"type": "string"},
        "podAnnotations": {"type": "object", "additionalProperties": {"type": "string"}},
        "vllmConfig": {
            "type": "object",
            "properties": {
                "enablePrefixCaching": {"type": "boolean"},
                "maxNumSeqs": {"type": "integer"},
                "extraArgs": {"type": "array", "items": {"type": "string"}},
            },
        },
        "env": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name", "value"],
                "properties": {"name": {"type": "string"}, "value": {"type": "string"}},
            },
        },
        "extraVolumes": {"type": "array"},
        "extraVolumeMounts": {"type": "array"},
    },
}


def chart_command_line(spec: dict) -> list[str]:
    """What templates/deployment-vllm-multi.yaml runs for a modelSpec with vllmConfig: `vllm serve
    MODEL --host 0.0.0.0 --port 8000`, the prefix-caching flag, --max-num-seqs from maxNumSeqs,
    then each extraArgs entry as its own argument."""
    vcfg = spec["vllmConfig"]
    argv = ["vllm", "serve", spec["modelURL"], "--host", "0.0.0.0", "--port", "8000"]
    argv.append(
        "--enable-prefix-caching"
        if vcfg.get("enablePrefixCaching")
        else "--no-enable-prefix-caching"
    )
    if "maxNumSeqs" in vcfg:
        argv += ["--max-num-seqs", str(vcfg["maxNumSeqs"])]
    return argv + [str(a) for a in vcfg.get("extraArgs", [])]


@pytest.mark.parametrize("key", DOCS)
def test_helm_values_follow_the_chart_schema_and_carry_settings_and_flags(key):
    settings = settings_of(key)
    options = ExportOptions(
        model="meta-llama/Meta-Llama-3-8B-Instruct",
        name="tp-settings",
        replicas=3,
        image="registry.local:5000/vllm-tailpilot:0.33",
        token_secret="tp-token",
    )
    text = render(settings, "helm", options)
    assert text.startswith("# Helm values for the vLLM production-stack chart")
    assert "values.schema.json" in text and "0.1." in text  # which schema version it follows
    doc = yaml.safe_load(text)
    [spec] = doc["servingEngineSpec"]["modelSpec"]
    import jsonschema

    jsonschema.validate(spec, MODEL_SPEC_SCHEMA)
    assert (spec["repository"], spec["tag"], spec["replicaCount"]) == (
        "registry.local:5000/vllm-tailpilot",
        "0.33",
        3,
    )
    back, _ = settings_from_helm_values(text)
    assert (
        back == settings
        and json.loads(spec["podAnnotations"][SETTINGS_ANNOTATION]) == settings.to_dict()
    )
    # The command line the chart builds carries the plugin class and the engine flags.
    argv = chart_command_line(spec)
    assert argv.count("--scheduler-cls") == 1
    assert argv[argv.index("--scheduler-cls") + 1] == SCHEDULER_CLASSES["async"]
    assert argv[argv.index("--max-num-seqs") + 1] == str(settings.engine.max_num_seqs)
    assert argv[argv.index("--max-num-batched-tokens") + 1] == str(
        settings.engine.max_num_batched_tokens
    )
    assert "--enable-prefix-caching" in argv  # the chart would otherwise turn vLLM's default off
    assert ("--long-prefill-token-threshold" in argv) == (
        settings.engine.long_prefill_token_threshold > 0
    )
    # The settings file named in the env is settings.json of the mounted ConfigMap.
    env = {e["name"]: e["value"] for e in spec["env"]}
    [mount] = spec["extraVolumeMounts"]
    [volume] = spec["extraVolumes"]
    assert env["TAILPILOT_SETTINGS_FILE"] == f"{mount['mountPath']}/{CONFIGMAP_KEY}"
    assert (
        volume == {"name": mount["name"], "configMap": {"name": "tp-settings"}}
        and mount["readOnly"] is True
    )
    assert env["TAILPILOT_API_HOST"] == "0.0.0.0" and spec["envFromSecret"] == {"name": "tp-token"}


def test_helm_and_configmap_together_give_the_plugin_its_settings(tmp_path, monkeypatch):
    """Mount the ConfigMap's data where the helm values say, as the kubelet would, and start-up
    reads the exported settings."""
    from scheduler.plugin.core import load_startup_settings

    settings = settings_of("uniboost-lpt")
    options = ExportOptions(name="tp-settings")
    cm = yaml.safe_load(render(settings, "configmap", options))
    [spec] = yaml.safe_load(render(settings, "helm", options))["servingEngineSpec"]["modelSpec"]
    [volume] = spec["extraVolumes"]
    assert volume["configMap"]["name"] == cm["metadata"]["name"]
    mount_dir = tmp_path / spec["extraVolumeMounts"][0]["mountPath"].lstrip("/")
    mount_dir.mkdir(parents=True)
    for key, value in cm["data"].items():
        (mount_dir / key).write_text(value)
    path = {e["name"]: e["value"] for e in spec["env"]}["TAILPILOT_SETTINGS_FILE"]
    monkeypatch.setenv("TAILPILOT_SETTINGS_FILE", str(tmp_path / path.lstrip("/")))
    assert load_startup_settings() == settings


@pytest.mark.parametrize("fmt", FORMATS)
def test_verify_catches_a_rendering_that_does_not_match(fmt):
    settings = settings_of("uniboost-lpt")
    text = render(settings, fmt, OPTIONS)
    verify(fmt, text, settings, OPTIONS)
    changes = [{"engine": {"max_num_seqs": 65}}, {"engine": {"long_prefill_token_threshold": 0}}]
    if fmt != "vllm-args":  # the command line carries only the engine flags; the file the rest
        changes.append({"params": {"gamma": 9.0}})
    for change in changes:
        with pytest.raises(ExportError, match=fmt):
            verify(fmt, text, SettingsChange(**change).apply(settings), OPTIONS)
    if fmt != "settings":
        with pytest.raises(ExportError):
            verify(
                fmt, text, settings, ExportOptions(model="other", name="other", settings_path="x")
            )


def test_helm_verify_catches_a_broken_mount():
    settings = settings_of("sarathi-defaults")
    text = helm_values(settings)
    broken = text.replace("mountPath: /etc/tailpilot", "mountPath: /etc/elsewhere")
    with pytest.raises(ExportError, match="TAILPILOT_SETTINGS_FILE"):
        verify("helm", broken, settings)


def test_a_simulator_only_predictor_is_refused():
    oracle = Settings.model_validate({"policy": "srpt", "params": {"predictor": "oracle"}})
    for fmt in FORMATS:
        with pytest.raises(ExportError, match="oracle"):
            render(oracle, fmt)


# --- the command ---------------------------------------------------------------------------------
def test_commands_are_exported_for_the_cli():
    assert (export, calibrate) == COMMANDS
    assert export.name == "export" and calibrate.name == "calibrate"


@pytest.mark.parametrize("fmt", FORMATS)
def test_export_from_a_settings_file_to_stdout_and_to_a_file(fmt, tmp_path):
    src = tmp_path / "tuned.json"
    src.write_text(json.dumps(DOCS["uniboost-lpt"]))
    settings = settings_of("uniboost-lpt")
    args = [
        "--settings",
        src,
        "--format",
        fmt,
        "--model",
        "m/x",
        "--name",
        "cm1",
        "--namespace",
        "ns",
    ]
    out = run(*args)
    assert out.exit_code == 0, out.output
    expected = render(
        settings,
        fmt,
        ExportOptions(model="m/x", name="cm1", namespace="ns", source="file tuned.json"),
    )
    assert out.stdout == expected
    dest = tmp_path / "out" / f"{fmt}.txt"
    dest.parent.mkdir()
    written = run(*args, "--out", dest)
    assert written.exit_code == 0 and written.stdout == ""
    assert f"to {dest}" in written.stderr
    assert dest.read_text() == expected
    assert [p.name for p in dest.parent.iterdir()] == [dest.name]  # no temporary file left


def test_export_default_format_is_the_settings_document(tmp_path):
    src = tmp_path / "s.json"
    src.write_text(json.dumps(DOCS["tie-history"]))
    out = run("--settings", src)
    assert out.exit_code == 0 and json.loads(out.stdout) == settings_of("tie-history").to_dict()


@pytest.mark.parametrize(
    "doc, words",
    [
        ({"policy": "uniboost", "params": {"gamma": 0}}, "params.gamma"),
        ({"policy": "uniboost", "params": {"gama": 3}}, "params.gama"),
        ({"policy": "nope"}, "policy"),
        ({"policy": "fcfs", "colour": "red"}, "colour"),
        ({"policy": "fcfs", "engine": {"max_num_seqs": 0}}, "engine.max_num_seqs"),
        ({"policy": "sjf", "params": {"predictor": "oracle"}}, "oracle"),
        ([1, 2], "expected a settings object"),
    ],
)
def test_an_invalid_settings_file_is_refused_naming_the_field(tmp_path, doc, words):
    src = tmp_path / "bad.json"
    src.write_text(json.dumps(doc))
    out = run("--settings", src, "--format", "helm", "--out", tmp_path / "values.yaml")
    assert out.exit_code == 2 and words in out.output and "bad.json" in out.output
    assert not (tmp_path / "values.yaml").exists()


def test_unreadable_or_non_json_settings_and_option_conflicts(tmp_path):
    out = run("--settings", tmp_path / "missing.json")
    assert out.exit_code == 2 and "cannot read" in out.output
    (tmp_path / "x.json").write_text("{not json")
    out = run("--settings", tmp_path / "x.json")
    assert out.exit_code == 2 and "not JSON" in out.output
    assert run().exit_code == 2
    out = run("--settings", tmp_path / "x.json", "--study", "s")
    assert out.exit_code == 2 and "exactly one" in out.output


def test_export_a_studys_newest_recommendation_from_the_store(tmp_path):
    from storage.store import Store

    db = tmp_path / "tp.db"
    with Store.open(str(db)) as store:
        store.tuner.store_recommendation(
            "nightly", settings_of("tie-history").to_dict(), {"ttlt_p99": 1.0}, t_ms=1000
        )
        store.tuner.store_recommendation(
            "nightly", DOCS["uniboost-lpt"], {"ttlt_p99": 0.8}, t_ms=2000
        )
        store.tuner.store_recommendation(
            "other", settings_of("sarathi-defaults").to_dict(), {}, t_ms=3000
        )
    # --storage (the Optuna storage tune/recommend use) is never opened: the store is enough.
    out = run(
        "--study",
        "nightly",
        "--db",
        db,
        "--storage",
        tmp_path / "optuna.db",
        "--format",
        "configmap",
    )
    assert out.exit_code == 0, out.output
    assert settings_from_configmap(out.stdout) == settings_of("uniboost-lpt")
    assert "study nightly, recommendation #2" in out.stdout  # the source annotation
    assert not (tmp_path / "optuna.db").exists()
    out = run("--study", "nightly", "--db", f"sqlite:///{db}", "--format", "vllm-args")
    assert out.exit_code == 0 and "--long-prefill-token-threshold 512" in out.stdout


def test_export_study_errors(tmp_path, monkeypatch):
    from storage.store import Store

    db = tmp_path / "tp.db"
    Store.open(str(db)).close()
    # the study does not exist where tune would have created it: said, with how to create it
    # (pointing to `recommend`, which would fail too, was a dead end — issue 33)
    out = run("--study", "nightly", "--db", db, "--storage", tmp_path / "optuna.db")
    assert out.exit_code == 2 and "no such study" in out.output and "tailpilot tune" in out.output
    assert not (tmp_path / "optuna.db").exists()  # looked at, not created
    # a database server is never contacted by export: the recommendation's hint
    out = run("--study", "nightly", "--db", db, "--storage", "postgresql://h/optuna")
    assert (
        f"tailpilot recommend --study nightly --storage postgresql://h/optuna --db {db}"
        in out.output
    )
    with Store.open(str(db)) as store:
        store.tuner.store_recommendation("bad", {"policy": "uniboost", "params": {"gamma": -1}}, {})
    out = run("--study", "bad", "--db", db)
    assert out.exit_code == 2 and "params.gamma" in out.output and "study 'bad'" in out.output
    missing = tmp_path / "nowhere.db"
    monkeypatch.chdir(tmp_path)
    out = run("--study", "nightly", "--db", missing)
    assert out.exit_code == 2 and "no tailpilot store" in out.output
    assert not missing.exists()  # not created as a side effect
    monkeypatch.setenv("TAILPILOT_DB", str(db))
    assert "no such study" in run("--study", "nightly").output


# --- vLLM's own parser (imports vLLM: ~15 s) -----------------------------------------------------
@pytest.mark.slow
def test_vllms_argument_parser_accepts_the_exported_flags_and_the_plugin_imports():
    import importlib

    import vllm  # noqa: F401 (installed by scripts/test.sh)
    from vllm.engine.arg_utils import EngineArgs

    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:  # older layout
        from vllm.utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    for key in DOCS:
        settings = settings_of(key)
        for scheduler in ("async", "sync"):
            options = ExportOptions(model="org/model", scheduler=scheduler)
            _, model, flags = parse_vllm_args(render(settings, "vllm-args", options))
            argv = ["--model", model] + [x for pair in flags.items() for x in pair]
            args = parser.parse_args(argv)
            assert args.model == "org/model"
            assert args.scheduler_cls == SCHEDULER_CLASSES[scheduler]
            assert args.max_num_seqs == settings.engine.max_num_seqs
            assert args.max_num_batched_tokens == settings.engine.max_num_batched_tokens
            if settings.engine.long_prefill_token_threshold:
                assert (
                    args.long_prefill_token_threshold
                    == settings.engine.long_prefill_token_threshold
                )
            module, cls = args.scheduler_cls.rsplit(".", 1)
            assert isinstance(getattr(importlib.import_module(module), cls), type)
        # The chart's command line (minus `vllm serve MODEL`) parses too.
        [spec] = yaml.safe_load(render(settings, "helm"))["servingEngineSpec"]["modelSpec"]
        helm_argv = chart_command_line(spec)[3:]
        # --host/--port are the frontend's flags, not the engine's: drop them for EngineArgs.
        for flag in ("--host", "--port"):
            i = helm_argv.index(flag)
            del helm_argv[i : i + 2]
        args = parser.parse_args(["--model", spec["modelURL"], *helm_argv])
        assert args.scheduler_cls == SCHEDULER_CLASSES["async"]
        assert args.max_num_seqs == settings.engine.max_num_seqs
        assert args.enable_prefix_caching is True

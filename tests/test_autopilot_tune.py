"""The autopilot as the tuner's subject (tuner/autopilot/tune.py): its own knobs tuned on
continuous replays, and "keep the autopilot" judged beside a recommendation."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from sim import traces as tr
from tuner.autopilot.controller import AutopilotConfig

# Quick: two fixed γ besides the defaults and sarathi, short windows.
START = AutopilotConfig(
    gammas=(0.01, 1.0), interval_s=30.0, delay_s=30.0, window_s=600.0, min_requests=100
)


@pytest.fixture(scope="module")
def trace():
    """The bundled conv window's first 6 minutes at 1.5x its rate: a queue that builds."""
    return tr.transform(tr.load_bundled(), window=(0.0, 360.0), rate_scale=1.5)


@pytest.mark.slow
def test_tuning_is_seeded_and_never_worse_than_where_it_started(trace):
    from tuner.autopilot.tune import tune_autopilot

    first = tune_autopilot([trace], trials=3, seed=5, start=START)
    again = tune_autopilot([trace], trials=3, seed=5, start=START)
    assert first == again and first["trials"] == 3
    config = AutopilotConfig.model_validate(
        first["config"]
    )  # a configuration record --autopilot-config takes
    assert config.gammas == START.gammas
    if first["start"]["feasible"]:
        assert (
            first["figures"]["feasible"]
            and first["figures"]["ttft_p95_ratio"] <= first["start"]["ttft_p95_ratio"]
        )
    assert first["figures"]["ttft_p95_ratio"] > 0


@pytest.mark.slow
def test_the_tuned_configuration_is_what_its_figures_say(trace):
    """The figures reported for the best trial are those of replaying its configuration again."""
    from scheduler.settings import Settings
    from sim.engine import EngineConfig
    from tuner.autopilot.tune import references, score, tune_autopilot

    result = tune_autopilot([trace], trials=2, seed=1, start=START)
    engine = EngineConfig()
    again = score(
        [trace],
        AutopilotConfig.model_validate(result["config"]),
        Settings.model_validate({"policy": "uniboost"}),
        engine,
        references([trace], engine),
    )
    assert again == pytest.approx(result["figures"])


def test_the_cli_writes_a_config_that_record_reads(tmp_path, trace):
    from tailpilot.cli import main

    path = tmp_path / "t.csv"  # the bundled window's first 3 minutes, in Azure's format
    lines = tr.bundled_trace_path().read_text().splitlines()[:400]
    path.write_text("\n".join(lines) + "\n")
    out = tmp_path / "ap.json"
    res = CliRunner().invoke(
        main, ["autopilot", "tune", "--trace", str(path), "--trials", "1", "--out", str(out)]
    )
    assert res.exit_code == 0, res.output
    assert "P95 TTFT" in res.output
    AutopilotConfig.model_validate(json.loads(out.read_text()))


def test_recommend_judges_keeping_the_autopilot(tmp_path):
    from test_tuner import small_spec

    from tuner.studies.optimize import tune
    from tuner.studies.optuna_storage import open_storage, storage_url
    from tuner.studies.recommend import recommend

    url = storage_url(str(tmp_path / "o.db"))
    tune(url, "r", 3, spec=small_spec())
    s = recommend(open_storage(url), "r", with_autopilot=True)
    ap = s["autopilot"]
    assert set(ap) == {"keep", "verdict", "metrics"}
    m = ap["metrics"]["ttlt_p99"]
    if ap["keep"]:
        assert m["value"] < m["recommended"] and m["value"] <= m["production"]
        assert ap["verdict"].startswith("keep the autopilot")
    else:
        assert ap["verdict"].startswith("the recommended settings")

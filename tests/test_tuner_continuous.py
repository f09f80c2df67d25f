"""Warm windows and the continuous held-out replay behind every recommendation."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from scheduler.settings import Settings
from scheduler.settings_change import SettingsChange
from sim import traces as tr
from sim.engine import EngineConfig
from tuner.studies import study as st
from tuner.studies.continuous import continuous_metrics, engine_losses, losses, validate
from tuner.studies.optimize import tune
from tuner.studies.optuna_storage import open_storage, storage_url
from tuner.studies.spec import StudySpec, TuneError
from tuner.studies.windows import build_windows, fingerprint, window_metrics


def small_spec(**kw) -> StudySpec:
    base = dict(
        policies=["uniboost"], objectives=["ttlt_p99"], trim=(0.0, 240.0), window_s=60.0, seed=3
    )
    base.update(kw)
    return StudySpec(**base)


def burst_then_quiet() -> tr.Trace:
    """120 s of arrivals far above what one seat serves, then 120 s of a trickle."""
    reqs = [tr.TraceRequest(f"b{i:04d}", i * 0.25, 200, 100, 4096) for i in range(480)]
    reqs += [tr.TraceRequest(f"q{i:04d}", 120.0 + i * 6.0, 200, 100, 4096) for i in range(20)]
    return tr.Trace("burst", tuple(reqs))


def test_a_window_replays_its_warm_up_and_measures_only_its_own_requests():
    trace = tr.transform(tr.load_bundled(), window=(0.0, 240.0))
    windows = build_windows(small_spec(warmup_s=60.0), [trace])
    assert [w.start_s for w in windows] == [0.0, 60.0, 120.0, 180.0]
    first, second = windows[0], windows[1]
    assert len(first.trace) == len(first.measured)  # the trace starts here: nothing before it
    own = {r.id for r in trace if 60.0 <= r.arrival < 120.0}
    before = {r.id for r in trace if 0.0 <= r.arrival < 60.0}
    assert second.measured == own
    assert {r.id for r in second.trace} == own | before
    cold = build_windows(small_spec(warmup_s=0.0), [trace])
    assert {r.id for r in cold[1].trace} == own
    assert fingerprint(windows) != fingerprint(cold)


def test_a_warm_window_inherits_the_backlog_a_cold_one_hides():
    trace = burst_then_quiet()
    config = EngineConfig()
    settings = Settings.model_validate({"policy": "fcfs", "engine": {"max_num_seqs": 1}})
    warm = build_windows(small_spec(window_s=120.0, warmup_s=120.0, min_requests=5), [trace])[1]
    cold = build_windows(small_spec(window_s=120.0, warmup_s=0.0, min_requests=5), [trace])[1]
    assert warm.measured == cold.measured and len(warm.trace) == 500
    w = window_metrics(settings, warm, config, ["ttft_p50", "requests"])
    c = window_metrics(settings, cold, config, ["ttft_p50", "requests"])
    assert w["requests"] == c["requests"] == 20  # only the window's own requests are measured
    # Cold, the quiet window's requests find an empty engine; warm, they queue behind the burst.
    assert c["ttft_p50"] < 1.0 < 10.0 < w["ttft_p50"]


def test_studies_written_before_warm_windows_still_replay_cold():
    d = small_spec().to_dict()
    del d["warmup_s"]
    assert StudySpec.from_dict(d).warmup_s == 0.0
    with pytest.raises(TuneError, match="warmup_s"):
        small_spec(warmup_s=-1.0).normalize()


@pytest.fixture(scope="module")
def ctx(tmp_path_factory) -> st.TuneContext:
    url = storage_url(str(tmp_path_factory.mktemp("cont") / "optuna.db"))
    tune(url, "c", 2, spec=small_spec())
    return st.load_context(open_storage(url), "c")[1]


def test_continuous_replay_measures_the_held_out_requests_of_one_whole_replay(ctx):
    production = ctx.space.production_settings
    ctx.tracked.append("requests")  # count what each part measured
    try:
        got = continuous_metrics(ctx, production)
    finally:
        ctx.tracked.remove("requests")
    held = sum(len(ctx.windows[i].measured) for i in ctx.holdout)
    whole = sum(len(w.measured) for w in ctx.windows)
    assert got["holdout"]["requests"] == held > 0
    assert got["all"]["requests"] >= whole > held
    assert losses(ctx, got["holdout"], got["holdout"]) == []  # production does not lose to itself


def test_a_candidate_that_loses_the_continuous_replay_is_passed_over(ctx):
    production = ctx.space.production_settings
    starved = Settings.model_validate({"policy": "fcfs", "engine": {"max_num_seqs": 1}})
    check = validate(ctx, [(7, starved), (0, production)], production)
    assert check["chosen"] == 0
    assert check["checked"][0]["trial"] == 7 and "ttlt_p99" in check["checked"][0]["losses"][0]
    alone = validate(ctx, [(7, starved)], production)
    assert alone["chosen"] is None  # every candidate lost: keep production


def test_a_candidate_that_breaks_a_constraint_on_held_out_windows_is_never_recommended(ctx):
    """Issue 22: recommend printed "constraint on held-out windows: VIOLATED" and recommended the
    trial anyway; now the held-out windows' verdict is one more way to lose."""
    production = ctx.space.production_settings
    same_order = Settings.model_validate(
        {"policy": "fcfs", "engine": production.engine.model_dump()}
    )
    asked: list[str] = []

    def held_out(candidate: Settings) -> list[str]:
        asked.append(candidate.policy)
        return (
            ["held-out windows: constraint ttlt_p99<=1.02*baseline fails"]
            if candidate == same_order
            else []
        )

    check = validate(ctx, [(3, same_order), (0, production)], production, held_out)
    assert asked == ["fcfs"] and check["chosen"] == 0
    assert check["checked"][0]["losses"] == [
        "held-out windows: constraint ttlt_p99<=1.02*baseline fails"
    ]


def test_other_engine_limits_are_judged_on_throughput_in_the_continuous_replay():
    production = Settings.model_validate({"policy": "sarathi"})
    bigger = SettingsChange(engine={"max_num_batched_tokens": 1068}).apply(production)
    assert engine_losses(
        bigger, production, {"throughput_tok_s": 98.0}, {"throughput_tok_s": 100.0}
    ) == ["engine limits: throughput 98 tok/s vs production 100 in the continuous replay"]
    assert (
        engine_losses(bigger, production, {"throughput_tok_s": 99.5}, {"throughput_tok_s": 100.0})
        == []
    )
    same = SettingsChange(params={}).apply(production)
    assert (
        engine_losses(same, production, {"throughput_tok_s": 50.0}, {"throughput_tok_s": 100.0})
        == []
    )


def test_recommend_reports_the_continuous_replay(tmp_path):
    import click

    from tailpilot.cli_tune import COMMANDS

    url = storage_url(str(tmp_path / "o.db"))
    tune(url, "r", 3, spec=small_spec())
    group = click.Group("tailpilot")
    for command in COMMANDS:
        group.add_command(command)
    out = CliRunner().invoke(group, ["recommend", "--study", "r", "--storage", url, "--no-store"])
    assert out.exit_code == 0, out.output
    assert "continuous replay of the whole trace" in out.output
    from tuner.studies.recommend import recommend

    s = recommend(open_storage(url), "r")
    cont = s["continuous"]
    assert cont["checked"] and set(cont["holdout"]) == set(cont["all"])
    chosen = cont["holdout"]["ttlt_p99"]
    if not s["is_production"]:
        assert chosen["value"] <= chosen["production"]  # never worse than production there

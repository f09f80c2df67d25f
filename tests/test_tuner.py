"""The tuner: search space from the settings model, objectives and constraints, studies end to end
(determinism, constraints, held-out validation, resume after Ctrl-C, NaN metrics), the CLI, and a
study shared by two processes on a real PostgreSQL server."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import click
import optuna
import pytest
from click.testing import CliRunner
from optuna.trial import TrialState
from postgres_support import postgres_server, postgres_url  # noqa: F401  (fixtures)

from scheduler.settings import PARAM_MODELS, POLICY_NAMES, EngineSettings, Settings
from tailpilot.cli_tune import COMMANDS
from tuner.studies import study as st
from tuner.studies.objectives import ConstraintError, parse_constraint, parse_objectives
from tuner.studies.optimize import make_pruner, tune
from tuner.studies.optuna_storage import open_storage, storage_url
from tuner.studies.recommend import paired_improvement, recommend
from tuner.studies.results import best_trials, is_feasible
from tuner.studies.samplers import make_sampler
from tuner.studies.search import SearchSpaceError, build_space, field_bounds
from tuner.studies.spec import SpecError, StudySpec, TuneError
from tuner.studies.windows import build_traces, nanmean

REPO = Path(__file__).resolve().parents[1]


def small_spec(**kw) -> StudySpec:
    """Four 60-s windows of the bundled Azure conv trace (one held out, three searched)."""
    base = dict(
        policies=["uniboost"], objectives=["ttlt_p99"], trim=(0.0, 240.0), window_s=60.0, seed=3
    )
    base.update(kw)
    return StudySpec(**base)


def run_study(tmp_path: Path, name: str, trials: int, spec: StudySpec, file: str = "optuna.db"):
    url = storage_url(str(tmp_path / file))
    outcome = tune(url, name, trials, spec=spec)
    storage = open_storage(url)
    return outcome, storage, optuna.load_study(study_name=name, storage=storage)


@pytest.fixture
def cli() -> click.Group:
    group = click.Group("tailpilot")
    for command in COMMANDS:
        group.add_command(command)
    return group


# ------------------------------------------------------------------------------ search space


def _inside_model(model, name: str, low: float, high: float) -> bool:
    b = field_bounds(model, name)
    ok_lo = b.lo is None or (low > b.lo if b.lo_open else low >= b.lo)
    ok_hi = b.hi is None or (high < b.hi if b.hi_open else high <= b.hi)
    return ok_lo and ok_hi


@pytest.mark.parametrize("policy", [p for p in POLICY_NAMES if p not in ("fcfs", "sarathi")])
def test_space_ranges_come_from_the_settings_model(policy):
    space = build_space([policy], Settings())
    assert space.policies == ("sarathi", policy)  # the production policy stays a candidate
    assert space.policy_dims[policy], f"nothing searched for {policy}"
    for dim in space.policy_dims[policy]:
        scope, name = dim.name.split(".", 1)
        assert scope == policy and name not in ("predictor", "sigma_noise", "sigma_spread")
        if dim.kind != "categorical":
            assert _inside_model(PARAM_MODELS[policy], name, dim.low, dim.high), dim
    for dim in space.engine_dims:
        if dim.kind != "categorical":
            assert _inside_model(
                EngineSettings, dim.name.removeprefix("engine."), dim.low, dim.high
            ), dim
    # Every sample is a valid settings document (min/max pairs repaired, vLLM's budget rule kept).
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
    for _ in range(30):
        settings = space.suggest(study.ask())
        assert settings.engine.max_num_batched_tokens >= settings.engine.max_num_seqs
        if settings.policy == policy and policy in ("sjf", "srpt", "tie"):
            assert settings.param("predictor") == "history"  # what a live replica has


def test_gamma_searched_over_its_whole_useful_range_on_a_log_scale_and_pins_respected():
    space = build_space(["uniboost"], Settings())
    gamma = next(d for d in space.policy_dims["uniboost"] if d.name == "uniboost.gamma")
    assert gamma.log and (gamma.low, gamma.high) == (1e-4, 10.0)  # 0.003-0.007 included (issue 22)
    prod = Settings.model_validate(
        {
            "policy": "uniboost",
            "params": {"gamma": 8, "gamma_ada": False},
            "pinned": ["gamma"],
            "engine": {"max_num_seqs": 256},
        }
    )
    space = build_space(["uniboost"], prod)
    names = {d.name for d in space.policy_dims["uniboost"]}
    assert "uniboost.gamma" not in names and "uniboost.alpha_s_per_token" in names
    assert space.policies == ("uniboost",)
    seqs = next(d for d in space.engine_dims if d.name == "engine.max_num_seqs")
    assert math.isclose(math.sqrt(seqs.low * seqs.high), 256, rel_tol=0.01)  # around production
    # The production settings are a point of the space (trial 0), pinned gamma kept.
    fixed = space.production_params()
    study = optuna.create_study()
    study.enqueue_trial(fixed)
    assert space.suggest(study.ask()) == prod


def test_range_fix_and_search_options_are_checked():
    with pytest.raises(
        SearchSpaceError, match=r"--range uniboost.gamma: low end 0 is outside .*\[1e-06, 1e\+06\]"
    ):
        build_space(["uniboost"], Settings(), ranges={"gamma": (0.0, 5.0, None)})
    with pytest.raises(SearchSpaceError, match="--fix gamm: not a parameter"):
        build_space(["uniboost"], Settings(), fixed={"gamm": 3})
    space = build_space(
        ["uniboost"],
        Settings(),
        ranges={"preempt_margin": (0.0, 2.0, None)},
        search=["gamma", "max_num_seqs"],
        fixed={"memguard": False},
    )
    assert [d.name for d in space.policy_dims["uniboost"]] == [
        "uniboost.preempt_margin",
        "uniboost.gamma",
    ]
    assert [d.name for d in space.engine_dims] == ["engine.max_num_seqs"]
    assert space.build("uniboost", {}, {}).param("memguard") is False


def test_constraint_grammar():
    c = parse_constraint("throughput>=0.99*baseline")
    assert (c.metric, c.op, c.scale, c.offset) == ("throughput_tok_s", ">=", 0.99, 0.0)
    assert c.value(990.0, 1000.0) == pytest.approx(0.0) and c.value(1000.0, 1000.0) < 0 < c.value(
        900.0, 1000.0
    )
    assert parse_constraint("ttft_p99 <= 2").value(2.5, math.nan) == pytest.approx(0.5)
    assert parse_constraint("ttlt_p99<=baseline+0.5").bound(10.0) == pytest.approx(10.5)
    assert parse_constraint("throughput>=99%baseline").scale == pytest.approx(0.99)
    assert (
        parse_constraint("ttft_p99<=2").value(math.nan, 1.0) == math.inf
    )  # undefined → infeasible
    for bad, msg in (
        ("throughput=>0.9", "expected METRIC"),
        ("thruput>=0.9*baseline", "unknown metric"),
        ("ttft_p99<=two", "cannot read the bound"),
        ("ttlt_slo_scale_99<=1", "--slo ttlt"),
    ):
        with pytest.raises(ConstraintError, match=msg) as err:
            parse_constraint(bad)
        assert repr(bad) in str(err.value)


def tune_x_args(tmp_path: Path) -> list[str]:
    """``tailpilot tune`` of study x (uniboost, P99 TTLT) with its files under tmp_path."""
    return [
        "tune",
        "--study",
        "x",
        "--storage",
        str(tmp_path / "o.db"),
        "--db",
        str(tmp_path / "tp.db"),
        "--policy",
        "uniboost",
        "--objective",
        "ttlt_p99",
    ]


def test_a_strict_comparison_is_refused_naming_the_constraint(tmp_path, cli):
    """``>`` silently meant ``>=``: now it is an error that names the constraint and the operator
    to use; a study defined before reads it as the inclusive bound it ran."""
    for text, use in (("throughput>0.99*baseline", "'>='"), ("ttft_p99 < 2", "'<='")):
        with pytest.raises(ConstraintError) as err:
            parse_constraint(text)
        assert repr(text) in str(err.value) and f"use {use}" in str(err.value)
    assert parse_constraint("ttft_p99<2", legacy=True).op == "<="
    assert parse_constraint("throughput>baseline", legacy=True).value(1.0, 1.0) == 0.0
    res = CliRunner().invoke(
        cli, [*tune_x_args(tmp_path), "--constraint", "throughput>0.99*baseline"]
    )
    assert res.exit_code == 2, res.output
    error = [line for line in res.output.splitlines() if line.startswith("Error:")]
    assert error == [
        "Error: --constraint: 'throughput>0.99*baseline': use '>=': a constraint's bound is "
        "inclusive (a strict '>' is not supported)"
    ]


def test_spec_errors_name_the_field_and_the_cli_its_flag(tmp_path, cli):
    for kw, field in (
        (dict(window_s=0.0), "window_s"),
        (dict(warmup_s=math.nan), "warmup_s"),
        (dict(holdout=1.0), "holdout"),
        (dict(mix=[("x.csv", 1.5)]), "mix"),
        (dict(slo={"ttl": 2.0}), "slo"),
        (dict(production={"policy": "nope"}), "production"),
    ):
        with pytest.raises(SpecError) as err:
            small_spec(**kw)
        assert err.value.field_name == field and str(err.value).startswith(f"{field}: ")
        assert "--" not in str(err.value)  # a library error names the field, not a flag
    with pytest.raises(SpecError, match=r"^traces: .*missing\.csv: no such file$"):
        small_spec(traces=[str(tmp_path / "missing.csv")]).normalize()
    base = tune_x_args(tmp_path)
    trace = tmp_path / "t.csv"
    trace.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0,10,10\n")
    for flags, says in (
        (["--mix", f"{trace}=1.5"], "--mix: fractions must be in (0, 1)"),
        (["--slo", "ttl=2"], "--slo: ttl=2: expected FAMILY=SECONDS"),
        (["--objective", "ttlt_slo_attainment"], "--objective: ttlt_slo_attainment: needs an SLO"),
    ):
        res = CliRunner().invoke(cli, [*base, *flags])
        assert res.exit_code == 2, res.output
        assert says in res.output and "Traceback" not in res.output


def test_objectives_named_from_metrics():
    assert parse_objectives(["ttlt_p99", "throughput"]) == [
        ("ttlt_p99", "minimize"),
        ("throughput_tok_s", "maximize"),
    ]
    with pytest.raises(ValueError, match=r"unknown metric 'ttlt_p98'; valid names: .*ttlt_p99"):
        parse_objectives(["ttlt_p98"])
    with pytest.raises(ValueError, match="not computed from a trace replay"):
        parse_objectives(["kv_usage"])


def test_paired_improvement_t_interval():
    # lower is better: baseline 10 everywhere, value 9 ± noise → ~+10%, CI around it
    r = paired_improvement([9.0, 8.5, 9.5, 9.0], [10.0, 10.0, 10.0, 10.0], "ttlt_p99")
    assert r["mean_change_pct"] == pytest.approx(10.0)
    geo = (1 - (0.9 * 0.85 * 0.95 * 0.9) ** 0.25) * 100
    assert r["improvement_pct"] == pytest.approx(geo)
    lo, hi = r["ci_pct"]
    assert 0 < lo < geo < hi < 20
    # One overloaded window must not swamp a consistent gain (every window improves).
    r = paired_improvement(
        [0.64, 0.73, 8.85, 0.49, 0.46], [1.01, 1.38, 51.8, 0.63, 1.03], "ttft_p95"
    )
    assert r["ci_pct"][0] > 0 and r["mean_change_pct"] > r["improvement_pct"] > 0
    up = paired_improvement([1100.0, 1210.0], [1000.0, 1100.0], "throughput")  # higher is better
    assert up["improvement_pct"] == pytest.approx(10.0)
    zero = paired_improvement([1.0, 3.0], [0.0, 2.0], "preemptions")  # no ratio: differences
    assert zero["ci_method"].startswith("t-interval of per-window differences")
    one = paired_improvement([9.0, math.nan], [10.0, 10.0], "ttlt_p99")
    assert one["n"] == 1 and all(math.isnan(x) for x in one["ci_pct"])


# ------------------------------------------------------------------------------ studies


@pytest.mark.slow
def test_same_seed_same_trials_and_best(tmp_path):
    out1, _, s1 = run_study(tmp_path, "a", 8, small_spec(), "one.db")
    out2, _, s2 = run_study(tmp_path, "a", 8, small_spec(), "two.db")
    assert out1.complete == out2.complete == 8
    assert [t.params for t in s1.trials] == [t.params for t in s2.trials]
    assert [t.values for t in s1.trials] == [t.values for t in s2.trials]
    assert out1.best == out2.best and out1.best is not None
    # Trial 0 is the production settings (sarathi, engine defaults) on the same windows.
    t0 = s1.trials[0]
    assert t0.user_attrs[st.ROLE_ATTR] == st.PRODUCTION
    assert t0.user_attrs[st.TRIAL_ATTR]["settings"] == Settings().to_dict()
    split = s1.user_attrs[st.ATTR_SPLIT]
    assert len(split["windows"]) == 4 and len(split["holdout"]) == 1
    for t in s1.trials:  # per-window values kept, never on a held-out window
        info = t.user_attrs[st.TRIAL_ATTR]
        assert set(info["windows"]) <= set(split["search"]) and not set(info["windows"]) & set(
            split["holdout"]
        )
        assert len(info["metrics"]["ttlt_p99"]) == len(info["windows"])
    # The study definition is stored: a different seed is a different study.
    _out3, _, s3 = run_study(tmp_path, "a", 8, small_spec(seed=4), "three.db")
    assert [t.params for t in s3.trials][1:] != [t.params for t in s1.trials][1:]


def test_constraint_is_respected(tmp_path):
    spec = small_spec(objectives=["ttft_p95"], constraints=["ttlt_p99<=1.0*baseline"], seed=5)
    _, storage, study = run_study(tmp_path, "c", 14, spec)
    _, ctx = st.load_context(storage, "c")
    complete = study.get_trials(states=(TrialState.COMPLETE,))
    infeasible = 0
    for t in complete:
        info = t.user_attrs[st.TRIAL_ATTR]
        x = nanmean(info["metrics"]["ttlt_p99"])
        b = nanmean([ctx.baseline[i]["ttlt_p99"] for i in info["windows"]])
        assert t.constraints["ttlt_p99<=1.0*baseline"] == pytest.approx(
            x - b
        )  # Optuna's set_constraint
        infeasible += t.constraints["ttlt_p99<=1.0*baseline"] > 0
    assert infeasible, "test needs some infeasible trials to mean anything"
    best = best_trials(study, ctx)[0]
    assert is_feasible(best)
    feasible_values = [
        t.value
        for t in complete
        if is_feasible(t) and not t.user_attrs[st.TRIAL_ATTR]["pruned_after"]
    ]
    assert best.value == min(feasible_values)
    summary = recommend(storage, "c")
    # The best trial is the first candidate; the recommendation is the first candidate that does
    # not lose the continuous replay (the best one here may, on this tiny trace).
    checked = summary["continuous"]["checked"]
    assert checked[0]["trial"] == best.number
    assert all(c["losses"] for c in checked[:-1])
    if summary["continuous"]["kept_production"]:
        assert summary["is_production"] and checked[-1]["losses"]
    else:
        assert summary["trial"] == checked[-1]["trial"] and not checked[-1]["losses"]
        assert (
            summary["search"]["metrics"]["ttlt_p99"]["value"]
            <= summary["search"]["metrics"]["ttlt_p99"]["baseline"] + 1e-9
        )


def test_two_objectives_give_a_pareto_front(tmp_path):
    spec = small_spec(objectives=["ttlt_p99", "ttft_p95"], population_size=4, seed=2)
    out, storage, study = run_study(tmp_path, "p", 8, spec)
    assert out.complete == 8
    assert [d.name for d in study.directions] == ["MINIMIZE", "MINIMIZE"]
    _, ctx = st.load_context(storage, "p")
    assert isinstance(make_sampler(ctx, 0), optuna.samplers.NSGAIISampler)
    assert isinstance(make_pruner(ctx), optuna.pruners.NopPruner)
    summary = recommend(storage, "p")
    front = {t["trial"] for t in summary["pareto_front"]}
    assert summary["trial"] in front
    for t in study.get_trials(states=(TrialState.COMPLETE,)):
        assert (
            t.user_attrs[st.TRIAL_ATTR]["pruned_after"] is None
        )  # no pruner with several objectives
    # The choice never regresses an objective when some front member does not.
    gains = [summary["search"]["metrics"][n]["improvement_pct"] for n in ("ttlt_p99", "ttft_p95")]
    assert min(gains) >= 0 or summary["is_production"]


def test_recommendation_validated_on_held_out_windows(tmp_path, cli):
    spec = small_spec(trim=(0.0, 300.0), holdout=0.4, constraints=["throughput>=0.99*baseline"])
    url = storage_url(str(tmp_path / "optuna.db"))
    tune(url, "h", 8, spec=spec)
    db = str(tmp_path / "tailpilot.db")
    res = CliRunner().invoke(
        cli, ["recommend", "--study", "h", "--storage", url, "--db", db, "--json"]
    )
    assert res.exit_code == 0, res.output
    s = json.loads(res.output)
    held, searched = s["holdout"]["windows"], s["search"]["windows"]
    assert len(held) == 2 and not set(held) & set(searched)
    m = s["holdout"]["metrics"]["ttlt_p99"]
    assert m["n"] == 2 and m["ci_pct"][0] <= m["improvement_pct"] <= m["ci_pct"][1]
    # The held-out numbers are replays of the recommended and the production settings.
    _, ctx = st.load_context(open_storage(url), "h")
    rec = Settings.model_validate(s["settings"])
    for k, i in enumerate(held):
        assert m["per_window"][k] == pytest.approx(ctx.run(rec, i)["ttlt_p99"])
        assert m["baseline_per_window"][k] == pytest.approx(ctx.run(Settings(), i)["ttlt_p99"])
    assert s["holdout"]["constraints"][0]["constraint"] == "throughput>=0.99*baseline"
    # Stored for the TUI.
    from storage.store import Store

    with Store.open(db) as store:
        info = store.tuner.latest_recommendation("h")
    assert info.settings == s["settings"] and info.summary["holdout"]["windows"] == held
    text = CliRunner().invoke(cli, ["recommend", "--study", "h", "--storage", url, "--no-store"])
    assert text.exit_code == 0 and "held-out windows (never searched): 2 windows" in text.output


def test_ctrl_c_leaves_a_study_that_resumes(tmp_path, cli, monkeypatch):
    url = storage_url(str(tmp_path / "optuna.db"))
    calls = {"n": 0}
    real = st.window_metrics

    def interrupt_on_the_eighth(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 8:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(st, "window_metrics", interrupt_on_the_eighth)
    args = [
        "tune",
        "--study",
        "r",
        "--storage",
        url,
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
        "3",
        "--trials",
        "6",
        "--no-progress",
    ]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 130, res.output
    assert "interrupted" in res.output and "run the same command to continue" in res.output
    study = optuna.load_study(study_name="r", storage=open_storage(url))
    n_complete = len(study.get_trials(states=(TrialState.COMPLETE,)))
    assert 0 < n_complete < 6 and study.get_trials(states=(TrialState.FAIL,))
    monkeypatch.setattr(st, "window_metrics", real)
    # Resuming needs no definition flags; conflicting ones are refused, naming the flag.
    bad = CliRunner().invoke(
        cli, ["tune", "--study", "r", "--storage", url, "--policy", "las", "--trials", "6"]
    )
    assert bad.exit_code == 2 and "--policy" in bad.output and "uniboost" in bad.output
    bad = CliRunner().invoke(
        cli, ["tune", "--study", "r", "--storage", url, "--window-s", "30", "--trials", "6"]
    )
    assert bad.exit_code == 2 and "--window-s" in bad.output
    ok = CliRunner().invoke(
        cli, ["tune", "--study", "r", "--storage", url, "--trials", "6", "--seed", "3", "--json"]
    )
    assert ok.exit_code == 0, ok.output
    assert json.loads(ok.output)["complete"] == 6
    study = optuna.load_study(study_name="r", storage=open_storage(url))
    assert len(study.get_trials(states=(TrialState.COMPLETE,))) == 6
    production = [
        t
        for t in study.trials
        if t.user_attrs.get(st.ROLE_ATTR) == st.PRODUCTION and t.state == TrialState.COMPLETE
    ]
    assert len(production) == 1


def test_nan_metric_windows_do_not_crash(tmp_path):
    # vidur format; window 1 (60-120 s) holds only single-token outputs: TBT is undefined there.
    rows = ["arrived_at,num_prefill_tokens,num_decode_tokens"]
    for k in range(240):
        t = k * 1.0
        rows.append(f"{t},{100 + k % 7},{1 if 60 <= t < 120 else 20 + k % 5}")
    path = tmp_path / "mixed.csv"
    path.write_text("\n".join(rows) + "\n")
    spec = small_spec(traces=[str(path)], trim=None, objectives=["tbt_p99"], holdout=0.25, seed=1)
    out, _, study = run_study(tmp_path, "n", 4, spec)
    assert out.complete == 4
    for t in study.get_trials(states=(TrialState.COMPLETE,)):
        assert math.isfinite(t.value)
    single = tmp_path / "single.csv"
    single.write_text(
        "\n".join(
            ["arrived_at,num_prefill_tokens,num_decode_tokens"]
            + [f"{k * 1.0},100,1" for k in range(240)]
        )
        + "\n"
    )
    with pytest.raises(TuneError, match="tbt_p99: undefined"):
        run_study(
            tmp_path,
            "n1",
            2,
            small_spec(traces=[str(single)], trim=None, objectives=["tbt_p99"]),
            "x.db",
        )


def test_cli_errors_and_storage_kept_apart(tmp_path, cli):
    db = str(tmp_path / "tailpilot.db")
    runner = CliRunner()
    res = runner.invoke(
        cli,
        [
            "tune",
            "--study",
            "x",
            "--storage",
            db,
            "--db",
            db,
            "--policy",
            "las",
            "--objective",
            "ttlt_p99",
        ],
    )
    assert res.exit_code == 2 and "keep Optuna's tables apart" in res.output
    from storage.store import Store

    Store.open(db).close()  # tailpilot's tables now exist there
    res = runner.invoke(
        cli, ["tune", "--study", "x", "--storage", db, "--policy", "las", "--objective", "ttlt_p99"]
    )
    assert res.exit_code == 2 and "holds tailpilot's tables" in res.output
    store = str(tmp_path / "o.db")
    res = runner.invoke(
        cli, ["tune", "--study", "x", "--storage", store, "--objective", "ttlt_p99"]
    )
    assert res.exit_code == 2 and "--policy is needed" in res.output
    res = runner.invoke(
        cli, ["tune", "--study", "x", "--storage", store, "--policy", "las", "--objective", "nope"]
    )
    assert res.exit_code == 2 and "unknown metric 'nope'" in res.output
    res = runner.invoke(
        cli,
        [
            "tune",
            "--study",
            "x",
            "--storage",
            store,
            "--policy",
            "las",
            "--objective",
            "ttlt_p99",
            "--constraint",
            "throughput>>1",
        ],
    )
    assert res.exit_code == 2 and "'throughput>>1'" in res.output
    res = runner.invoke(cli, ["recommend", "--study", "x", "--storage", str(tmp_path / "none.db")])
    assert res.exit_code == 2 and "does not exist" in res.output


def test_default_storage_is_a_separate_sqlite_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert storage_url(None) == f"sqlite:///{tmp_path / 'tailpilot-optuna.db'}"
    assert storage_url("postgresql://u@h/db") == "postgresql+psycopg://u@h/db"


# ------------------------------------------------------------------------------ many processes


@pytest.mark.slow
def test_two_processes_share_one_study_on_postgres(postgres_server, postgres_url):
    url = postgres_server.create_database("optuna_tune")
    cmd = [
        sys.executable,
        "-c",
        "from tailpilot.cli_tune import tune; tune()",
        "--study",
        "shared",
        "--storage",
        url,
        "--db",
        postgres_url,
        "--policy",
        "uniboost",
        "--objective",
        "ttlt_p99",
        "--constraint",
        "throughput>=0.99*baseline",
        "--from",
        "0",
        "--to",
        "240",
        "--window-s",
        "60",
        "--trials",
        "12",
        "--seed",
        "7",
        "--no-progress",
        "--json",
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [
        subprocess.Popen(
            cmd + extra, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        for extra in ([], ["--jobs", "2"])
    ]
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
        assert json.loads(out)["complete"] == 12
    study = optuna.load_study(study_name="shared", storage=open_storage(url))
    complete = study.get_trials(states=(TrialState.COMPLETE,))
    assert len(complete) == 12
    numbers = [t.number for t in study.trials]
    assert len(numbers) == len(set(numbers))
    assert sum(t.user_attrs.get(st.ROLE_ATTR) == st.PRODUCTION for t in complete) == 1
    # Optuna's tables live in their own database, never in tailpilot's.
    from sqlalchemy import create_engine, inspect

    engine = create_engine(postgres_url)
    try:
        assert "trials" not in inspect(engine).get_table_names()
    finally:
        engine.dispose()


def test_max_tokens_default_reaches_the_studys_traces():
    """Traces that record no cap get the study's fixed cap (never the true output length)."""
    default = build_traces(small_spec())[0]
    assert {r.max_tokens for r in default} == {4096}
    capped = build_traces(small_spec(max_tokens_default=300))[0]
    assert {r.max_tokens for r in capped} == {300}
    assert all(r.output_tokens <= 300 for r in capped) and capped.truncated > 0


def test_a_spec_field_holds_the_bounds_of_its_flag():
    """A definition read back from a study is held to what its flags would have allowed."""
    from tailpilot.study_options import SPEC_FLAGS

    command = COMMANDS[0]
    checked = []
    for param in command.params:
        if param.name not in SPEC_FLAGS or not isinstance(
            param.type, click.IntRange | click.FloatRange
        ):
            continue
        field = SPEC_FLAGS[param.name][0]
        kind = param.type
        bounds = field_bounds(StudySpec, field)
        assert (bounds.lo, bounds.lo_open, bounds.hi, bounds.hi_open) == (
            kind.min,
            kind.min_open,
            kind.max,
            kind.max_open,
        ), field
        checked.append(field)
    assert {"rate_scale", "window_s", "seed", "tenants", "num_gpu_blocks"} <= set(checked)


@pytest.mark.parametrize(
    ("field", "value"),
    [("rate_scale", -1.0), ("window_s", 0.001), ("population_size", 1), ("seed", -3)],
)
def test_a_stored_definition_edited_by_hand_is_refused_naming_the_field(field, value):
    study = optuna.create_study(study_name="edited")
    study.set_user_attr(st.ATTR_SPEC, {**small_spec().to_dict(), field: value})
    invalid = rf"^study edited: its stored definition is invalid \({field}: "
    with pytest.raises(TuneError, match=invalid):
        st.stored_spec(study)
    study.set_user_attr(st.ATTR_SPEC, ["not", "an", "object"])
    with pytest.raises(TuneError, match="not an object"):
        st.stored_spec(study)

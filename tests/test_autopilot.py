"""The autopilot's controller in the simulator: it sees only the past, decides deterministically,
and finds a better γ than the defaults where one exists."""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest

from scheduler.settings import Settings
from sim import traces
from sim.engine import SimResult
from tuner.autopilot.controller import AutopilotConfig, candidates, log_grid
from tuner.autopilot.replay import replay_with_autopilot
from tuner.autopilot.types import Decision, Observation

CONFIG = AutopilotConfig(
    gammas=(0.001, 0.01, 0.1, 1.0), interval_s=30.0, delay_s=30.0, window_s=300.0, min_requests=50
)


# The module's tests share their replays of the bundled window (deterministic: a test replays it
# twice and compares); on one xdist worker, each is made once.
pytestmark = pytest.mark.xdist_group("autopilot-bundled")


@functools.cache
def bundled_at(rate: float) -> traces.Trace:
    """The bundled 10-minute Azure conv window at ``rate`` times its rate."""
    return traces.scale_rate(traces.load_bundled(), rate)


@functools.cache
def replayed_at(rate: float) -> tuple[SimResult, list[Decision]]:
    """The autopilot's replay (under CONFIG) of the bundled window at ``rate``, made once."""
    return replay_with_autopilot(bundled_at(rate), config=CONFIG)


BUSY = 2.0  # the bundled window at twice its rate: queues build up


def decisions_until(trace, t: float, decisions=None) -> list[tuple]:
    """The decisions made up to ``t`` on ``trace`` (replayed unless its ``decisions`` are given)."""
    if decisions is None:
        _, decisions = replay_with_autopilot(trace, config=CONFIG)
    return [
        (
            d.at,
            d.choice,
            d.changed,
            tuple(sorted((n, f.ttft_p95, f.ttlt_p99) for n, f in d.figures.items())),
        )
        for d in decisions
        if d.at <= t
    ]


@pytest.mark.slow
def test_decisions_never_depend_on_the_future():
    """Change everything a controller could not know at time T — every later arrival, and the
    true output length of every request still in flight at T — and the decisions up to T stay
    the same. A controller that peeked at either would see different figures."""
    busy_window = bundled_at(BUSY)
    reqs = sorted(busy_window, key=lambda r: (r.arrival, r.id))
    assert [r.id for r in reqs] == [r.id for r in busy_window]
    t_cut = 330.0
    base, base_decisions = replayed_at(BUSY)  # the replay of ``reqs``: in that order already
    finished_by_cut = {c.id for c in base.completions if c.finished_at <= t_cut}
    changed = []
    for r in reqs:
        if r.arrival > t_cut:  # the future: other prompts and lengths
            changed.append(
                replace(
                    r,
                    prompt_tokens=r.prompt_tokens * 3 + 7,
                    output_tokens=r.output_tokens * 5 + 1,
                    max_tokens=max(r.max_tokens, r.output_tokens * 5 + 1),
                )
            )
        elif r.id not in finished_by_cut:  # in flight at the cut: a true length nobody knows yet
            longer = min(r.max_tokens, r.output_tokens * 4 + 50)
            changed.append(replace(r, output_tokens=max(longer, r.output_tokens)))
        else:
            changed.append(r)
    # The test is only sharp if the shadows replayed some of those by T (they arrived before
    # T - delay) while their lengths were still unknown.
    stale = [r for r in reqs if r.id not in finished_by_cut and r.arrival <= t_cut - CONFIG.delay_s]
    assert len(stale) > 20
    before = decisions_until(reqs, t_cut, base_decisions)
    after = decisions_until(changed, t_cut)
    assert len(before) >= 5 and any(d[3] for d in before)  # decisions with figures were made
    assert before == after


@pytest.mark.slow
def test_decisions_are_deterministic():
    busy_window = bundled_at(BUSY)
    assert decisions_until(busy_window, 1e9) == decisions_until(
        busy_window, 1e9, replayed_at(BUSY)[1]
    )


@pytest.mark.slow
def test_it_leaves_the_defaults_for_a_better_gamma_under_load():
    """At 1.5× the bundled window a fixed γ keeps every quantile within 2% of sarathi's with a P95
    TTFT well below the defaults' (0.69× vs 0.91×): the autopilot finds it."""
    busy = bundled_at(1.5)
    result, decisions = replayed_at(1.5)
    chosen = {d.choice for d in decisions}
    assert chosen - {"defaults"}, "never left the defaults"
    assert len(result.completions) + len(result.rejected) == len(busy)
    for d in decisions:
        if d.changed:
            assert d.figures[d.choice].feasible
            assert d.reason
        assert d.cpu_s >= 0.0


def test_candidates_keep_the_base_documents_parameters_and_engine():
    base = Settings.model_validate(
        {
            "policy": "uniboost",
            "params": {"memguard": False, "quant_ratio": 3.0},
            "engine": {"max_num_seqs": 64},
        }
    )
    options = candidates(base, AutopilotConfig(gammas=(0.01, 5.0)))
    # MemGuard off: its quantization bases change nothing and are not candidates
    assert set(options) == {
        "sarathi",
        "defaults",
        "gamma=0.01",
        "gamma=5",
        "tie:beta=0.1",
        "tie:beta=0.5",
    }
    g = options["gamma=5"]
    assert (
        g.params.gamma == 5.0
        and not g.params.gamma_ada
        and not g.params.memguard
        and g.params.quant_ratio == 3.0
    )
    assert g.params.gamma_min <= 5.0 <= g.params.gamma_max
    assert all(s.engine.max_num_seqs == 64 for s in options.values())


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="gammas"):
        AutopilotConfig(gammas=(0.0,))
    with pytest.raises(ValueError, match="interval_s"):
        AutopilotConfig(interval_s=0.1)


def test_the_default_grid_spans_a_thousandth_to_ten_with_three_points_a_decade():
    grid = log_grid(0.001, 10.0, 3)
    assert grid[0] == 0.001 and grid[-1] == 10.0 and len(grid) == 13


def test_an_observation_carries_no_output_length():
    assert "output_tokens" not in Observation.__dataclass_fields__
    from tuner.autopilot.types import Arrival

    assert "output_tokens" not in Arrival.__dataclass_fields__


def test_sim_and_compare_take_autopilot_and_print_its_decisions():
    import json

    from click.testing import CliRunner

    from tailpilot.cli import main

    run = CliRunner()
    res = run.invoke(
        main, ["sim", "--autopilot", "--from", "0", "--to", "180", "--rate-scale", "2", "--json"]
    )
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    pilot = doc["run"]["autopilot"]
    assert pilot["decisions"] and all(d["reason"] for d in pilot["decisions"])
    assert pilot["cpu_s_per_hour"] > 0 and doc["metrics"]["requests"] > 0
    res = run.invoke(
        main, ["compare", "--policy", "sarathi", "--autopilot", "--to", "120", "--json"]
    )
    assert res.exit_code == 0, res.output
    assert set(json.loads(res.output)["metrics"]) == {"sarathi", "autopilot"}


def test_sim_and_compare_replay_exported_settings_documents(tmp_path):
    """`sim --settings FILE` replays exactly the document; `compare --settings A,B` adds a column
    per file; a document given with --set is a usage error naming both."""
    import json

    from click.testing import CliRunner

    from tailpilot.cli import main

    small = tmp_path / "small-gamma.json"
    small.write_text(
        json.dumps({"policy": "uniboost", "params": {"gamma": 0.003, "gamma_ada": False}})
    )
    sarathi = tmp_path / "vllm.json"
    sarathi.write_text(json.dumps({"policy": "sarathi"}))
    run = CliRunner()
    window = ["--from", "0", "--to", "90", "--rate-scale", "1.5"]
    res = run.invoke(main, ["sim", "--settings", str(small), *window, "--json"])
    assert res.exit_code == 0, res.output
    by_file = json.loads(res.output)
    assert (
        by_file["settings"]["params"]["gamma"] == 0.003
        and not by_file["settings"]["params"]["gamma_ada"]
    )
    res = run.invoke(
        main,
        [
            "sim",
            "--policy",
            "uniboost",
            "--set",
            "gamma=0.003",
            "--set",
            "gamma_ada=off",
            *window,
            "--json",
        ],
    )
    assert (
        json.loads(res.output)["metrics"] == by_file["metrics"]
    )  # the same document, the same replay
    res = run.invoke(
        main,
        ["compare", "--policy", "sarathi", "--settings", f"{small},{sarathi}", *window, "--json"],
    )
    assert res.exit_code == 0, res.output
    metrics = json.loads(res.output)["metrics"]
    assert (
        set(metrics) == {"sarathi", "small-gamma", "vllm"} and metrics["vllm"] == metrics["sarathi"]
    )
    res = run.invoke(main, ["sim", "--settings", str(small), "--set", "gamma=1"])
    assert (
        res.exit_code == 2 and "--settings replays a whole document: leave out --set" in res.output
    )
    res = run.invoke(main, ["sim", "--settings", str(tmp_path / "missing.json")])
    assert (
        res.exit_code == 2
        and "missing.json: cannot read" in res.output
        and "Traceback" not in res.output
    )


def _axis(settings: Settings) -> float:
    """A candidate's place from size-first (small γ) to age-first (γ-Ada, then sarathi)."""
    if settings.policy != "uniboost":
        return float("inf")
    return 1e9 if settings.params.gamma_ada else settings.params.gamma


@pytest.mark.slow
def test_under_light_load_it_waits_on_the_smallest_gamma_among_ties():
    """With ``prefer_small`` and no margin for a move down, when every order serves the same the
    autopilot moves to the candidate that promotes short requests most; by default (a move down
    takes ``down_margin``, ties go to the most age-first) it does not."""
    light = traces.scale_rate(traces.load_bundled(), 0.5)
    _, decisions = replay_with_autopilot(
        light, config=CONFIG.model_copy(update={"prefer_small": True, "down_margin": 0.0})
    )
    judged = [d for d in decisions if d.figures]
    assert judged and judged[-1].choice == "gamma=0.001"
    first = next(d for d in decisions if d.changed)
    low = min(f.ttft_p95 for f in first.figures.values() if f.feasible)
    assert first.figures["gamma=0.001"].ttft_p95 <= (1 + CONFIG.tie) * low  # a tie, not a clear win
    _, plain = replay_with_autopilot(light, config=CONFIG)  # prefer_small off by default
    assert [d.choice for d in plain] != [d.choice for d in decisions]


@pytest.mark.slow
def test_a_move_towards_age_order_takes_the_margin_or_a_promise_break():
    """Moving up the axis flushes what a small γ held back: it is taken only for the hysteresis
    margin (the defaults' margin when leaving them), when the running choice broke the promise, or
    in overload (up to the defaults)."""
    options = candidates(Settings.model_validate({"policy": "uniboost"}), CONFIG)
    for rate in (1.5, 2.0, 3.0):
        _, decisions = replayed_at(rate)
        for d in decisions:
            if d.changed and _axis(options[d.choice]) > _axis(options[d.previous]):
                new, old = d.figures[d.choice], d.figures[d.previous]
                margin = CONFIG.leave_defaults if d.previous == "defaults" else CONFIG.hysteresis
                assert (
                    "breaks the promise" in d.reason
                    or (d.overload and d.choice == "defaults")
                    or new.ttft_p95 < (1 - margin) * old.ttft_p95
                ), d.reason

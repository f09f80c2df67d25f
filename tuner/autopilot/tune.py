"""The autopilot as something the tuner chooses: its own knobs tuned, and "keep the autopilot"
judged beside a recommendation (README, "The autopilot").

* :func:`tune_autopilot` searches ``AutopilotConfig``'s decision knobs with Optuna (TPE, seeded) on
  continuous replays of the given traces: each trial replays every trace whole with the autopilot
  (``replay_with_autopilot``) and is scored on its P95 TTFT as a ratio to sarathi's on the same
  requests, feasible only when it keeps the configuration's promise (``AutopilotConfig.promise``:
  every quantile within its slack of sarathi's, throughput above its floor) on every trace.
  Trial 0 is the default configuration, so the result is never worse than the defaults on the
  traces it was tuned on. ``tailpilot autopilot tune`` writes the
  configuration for ``record --autopilot-config``.
* :func:`autopilot_metrics` replays the traces with the autopilot, continuously: ``recommend
  --autopilot`` compares it with the settings it recommends on every request and reports "keep the
  autopilot" when it is no worse on any objective, better on one, and loses nothing to production
  (objectives and constraints, as any candidate).

Each autopilot replay runs one shadow simulator per candidate setting (about a dozen): a trial
costs about as much as a dozen plain replays of its traces.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import optuna

from scheduler.metrics import Completion, summarize
from scheduler.settings import Settings
from sim.engine import EngineConfig, simulate
from sim.traces import Trace
from tuner.autopilot.controller import AutopilotConfig
from tuner.autopilot.promise import QUANTILE_NAMES
from tuner.autopilot.replay import replay_with_autopilot
from tuner.studies.windows import completion_metrics

SARATHI = Settings.model_validate({"policy": "sarathi"})
# The decision knobs searched: (low, high, log scale). The candidate grid, the guards and the
# imputation history stay as configured.
KNOBS: dict[str, tuple[float, float, bool]] = {
    "leave_defaults": (0.0, 0.4, False),
    "hysteresis": (0.0, 0.4, False),
    "min_dwell_s": (0.0, 3_600.0, False),
    "window_s": (600.0, 7_200.0, True),
    "interval_s": (15.0, 600.0, True),
    "delay_s": (0.0, 600.0, False),
}


GUARDED = (*QUANTILE_NAMES, "throughput_tok_s")  # what the promise holds to sarathi's


def _figures(completions: Sequence[Any]) -> dict[str, float]:
    """Every quantile the promise holds and output tokens per second (first arrival to last
    finish)."""
    s = summarize(completions)
    return {k: float(s.get(k, math.nan)) for k in GUARDED}


def score(
    traces: Sequence[Trace],
    config: AutopilotConfig,
    base: Settings,
    engine: EngineConfig,
    references: Sequence[dict[str, float]],
) -> dict[str, Any]:
    """The autopilot's figures on ``traces`` as ratios to sarathi's (``references``): the mean P95
    TTFT ratio (lower is better), the worst ratio of every quantile and of throughput, and
    whether the configuration's promise holds on every trace."""
    ratios: dict[str, list[float]] = {k: [] for k in GUARDED}
    for trace, ref in zip(traces, references):
        result, _ = replay_with_autopilot(trace, base, config, engine)
        got = _figures(result.completions)
        for k in GUARDED:
            ratios[k].append(got[k] / ref[k])
    promise = config.promise
    worst = {k: max(v) for k, v in ratios.items() if k != "throughput_tok_s"}
    worst_tput = min(ratios["throughput_tok_s"])
    return {
        "ttft_p95_ratio": sum(ratios["ttft_p95"]) / len(ratios["ttft_p95"]),
        **{f"worst_{k}_ratio": v for k, v in worst.items()},
        "ttlt_p99_ratio": worst["ttlt_p99"],
        "throughput_ratio": worst_tput,
        "feasible": all(v <= 1.0 + promise.slack for v in worst.values())
        and worst_tput >= promise.throughput_floor,
    }


def references(traces: Sequence[Trace], engine: EngineConfig) -> list[dict[str, float]]:
    """sarathi's figures on each trace (the guard's reference)."""
    out = []
    for trace in traces:
        out.append(_figures(simulate(trace, SARATHI, engine).completions))
    return out


def tune_autopilot(
    traces: Sequence[Trace],
    *,
    trials: int = 20,
    seed: int = 0,
    base: Settings | None = None,
    engine: EngineConfig | None = None,
    start: AutopilotConfig | None = None,
) -> dict[str, Any]:
    """Search the autopilot's decision knobs (``KNOBS``) on ``traces``; returns the best feasible
    configuration (``config``, a dict of AutopilotConfig fields), its figures, the starting
    configuration's figures and the trials run. Deterministic for a seed."""
    if not traces or not any(len(t) for t in traces):
        raise ValueError("traces: nothing to tune on")
    base = base or Settings.model_validate({"policy": "uniboost"})
    engine = engine or EngineConfig()
    start = start or AutopilotConfig()
    refs = references(traces, engine)

    def config_of(params: dict[str, Any]) -> AutopilotConfig:
        return AutopilotConfig.model_validate({**start.model_dump(), **params})

    def objective(trial: optuna.Trial) -> float:
        params = {
            name: trial.suggest_float(name, lo, hi, log=log)
            for name, (lo, hi, log) in KNOBS.items()
        }
        got = score(traces, config_of(params), base, engine, refs)
        trial.set_user_attr("figures", got)
        # Optuna's constraints: ≤ 0 is feasible; one per quantile the promise holds.
        promise = start.promise
        for k in QUANTILE_NAMES:
            trial.set_constraint(f"{k}_ratio", got[f"worst_{k}_ratio"] - (1.0 + promise.slack))
        trial.set_constraint("throughput_ratio", promise.throughput_floor - got["throughput_ratio"])
        ratio: float = got["ttft_p95_ratio"]
        return ratio

    sampler = optuna.samplers.TPESampler(seed=seed)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="minimize", sampler=sampler)
    study.enqueue_trial(
        {name: min(max(getattr(start, name), lo), hi) for name, (lo, hi, _) in KNOBS.items()}
    )
    study.optimize(objective, n_trials=max(trials, 1))
    first = study.trials[0]
    feasible = [
        t for t in study.trials if t.value is not None and t.user_attrs["figures"]["feasible"]
    ]
    best = min(feasible, key=lambda t: (t.value, t.number)) if feasible else first
    return {
        "config": config_of(best.params).model_dump(mode="json"),
        "trial": best.number,
        "figures": best.user_attrs["figures"],
        "start": first.user_attrs["figures"],
        "trials": len(study.trials),
    }


def autopilot_metrics(
    traces: Sequence[Trace],
    production: Settings,
    engine: EngineConfig,
    names: Sequence[str],
    config: AutopilotConfig | None = None,
    slo: dict[str, float] | None = None,
) -> dict[str, float]:
    """The autopilot, starting from ``production``, replaying every trace whole: the figures
    ``names`` over every request (``recommend --autopilot`` judges "keep the autopilot" on them)."""
    done: list[Completion] = []
    for trace in traces:
        if len(trace):
            done += replay_with_autopilot(trace, production, config, engine)[0].completions
    return completion_metrics(done, names, slo)

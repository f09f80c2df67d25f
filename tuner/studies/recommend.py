"""A study's recommendation, validated on held-out windows (``tailpilot recommend``).

The recommended settings are the best feasible, fully evaluated trial (one objective) or, with
several objectives, a member of the feasible Pareto front: of those no worse than the production
settings on any objective, the one with the largest mean improvement (else the max-min member;
see ``tuner.studies.results.choose_recommendation``). The whole front is reported too. Before it is
recommended, a candidate is replayed continuously over the whole trace against production
(``tuner.studies.continuous``): one that loses there is passed over for the next, and if every
candidate loses, production is kept.

Improvements are paired per window: for each window, the recommended settings and the production
settings (trial 0) replay the same requests. The headline change is the geometric mean over
windows of the per-window ratio (positive = better, as ``scheduler.metrics.percent_change``),
with a t-interval (scipy.stats) over the windows' log ratios — the interval is over windows, the
unit of noise; the change of the means is reported beside it (see :func:`paired_improvement`).
Search windows are the ones the search selected on (optimistic); held-out windows were never run
by the search.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from optuna.storages import BaseStorage
from optuna.trial import TrialState

from scheduler.metrics import higher_is_better, percent_change
from scheduler.settings import Settings
from scheduler.validation import finite_or_none
from storage.strict_json import finite
from tuner.autopilot.tune import autopilot_metrics
from tuner.studies.continuous import losses, validate
from tuner.studies.results import best_trials, candidate_trials, ranked_candidates, trial_metrics
from tuner.studies.spec import TuneError
from tuner.studies.study import PRODUCTION, ROLE_ATTR, TRIAL_ATTR, TuneContext, load_context

CONFIDENCE = 0.95


def paired_improvement(
    values: Sequence[float], baseline: Sequence[float], name: str, confidence: float = CONFIDENCE
) -> dict[str, Any]:
    """How ``values`` compare with ``baseline``, window by window (positive = better).

    * ``value``, ``baseline``: means over the windows where both are defined;
    * ``mean_change_pct``: ``percent_change`` of those means (heavy windows weigh more);
    * ``improvement_pct`` and ``ci_pct``: the per-window change — the geometric mean of the
      per-window ratios value/baseline, as a % change — with a t-interval (scipy.stats) over the
      windows' log ratios. Every window counts the same, and one overloaded window cannot swamp
      the interval the way it swamps raw differences. Where a ratio is undefined (a value <= 0),
      the interval is a t-interval of the paired differences divided by the mean baseline and
      ``improvement_pct`` is ``mean_change_pct`` (``ci_method`` says which).
    """
    pairs = [
        (x, b)
        for x, b in zip(values, baseline)
        if x is not None and b is not None and math.isfinite(x) and math.isfinite(b)
    ]
    n = len(pairs)
    nan = math.nan
    out: dict[str, Any] = {
        "n": n,
        "value": nan,
        "baseline": nan,
        "improvement_pct": nan,
        "mean_change_pct": nan,
        "ci_pct": [nan, nan],
        "ci_method": None,
        "per_window": [finite_or_none(v) for v in values],
        "baseline_per_window": [finite_or_none(v) for v in baseline],
    }
    if n == 0:
        return out
    x = np.array([p[0] for p in pairs])
    b = np.array([p[1] for p in pairs])
    mx, mb = float(x.mean()), float(b.mean())
    better_high = higher_is_better(name)
    out.update(value=mx, baseline=mb, mean_change_pct=percent_change(mx, mb, name))

    def t_interval(d: np.ndarray) -> tuple[float, float]:
        # start-up cost: scipy.stats adds ~0.4 s to importing this module (python -X importtime),
        # which the tune command does for jsonable alone.
        from scipy import stats

        centre, sd = float(d.mean()), float(d.std(ddof=1))
        if sd == 0:
            return centre, centre
        lo, hi = stats.t.interval(confidence, len(d) - 1, loc=centre, scale=sd / math.sqrt(len(d)))
        return float(lo), float(hi)

    if np.all(x > 0) and np.all(b > 0):
        logs = np.log(x / b)
        sign = 1.0 if better_high else -1.0  # change = sign * (ratio - 1)

        def pct(log_ratio: float) -> float:
            return sign * (math.exp(log_ratio) - 1.0) * 100.0

        out["improvement_pct"] = pct(float(logs.mean())) if np.any(logs) else 0.0
        out["ci_method"] = "t-interval of per-window log ratios"
        if n >= 2:
            lo, hi = t_interval(logs)
            out["ci_pct"] = sorted([pct(lo), pct(hi)])
        return out
    out["improvement_pct"] = out["mean_change_pct"]
    out["ci_method"] = "t-interval of per-window differences / mean baseline"
    if n >= 2 and mb != 0:
        lo, hi = t_interval((x - b) if better_high else (b - x))
        out["ci_pct"] = [lo / abs(mb) * 100.0, hi / abs(mb) * 100.0]
    return out


def _metric_table(
    ctx: TuneContext,
    values: Mapping[int, Mapping[str, float]],
    baseline: Mapping[int, Mapping[str, float]],
    windows: Sequence[int],
) -> dict[str, Any]:
    return {
        name: paired_improvement(
            [values[i][name] for i in windows], [baseline[i][name] for i in windows], name
        )
        for name in ctx.tracked
    }


def recommend(storage: BaseStorage, name: str, *, with_autopilot: bool = False) -> dict[str, Any]:
    """Build the recommendation summary of study ``name`` (JSON-able; NaN where undefined).
    ``with_autopilot``: also judge "keep the autopilot" (``autopilot`` in the summary)."""
    study, ctx = load_context(storage, name)
    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    front = best_trials(study, ctx)
    if not front:
        feasible = len(candidate_trials(study))
        raise TuneError(
            f"study {name}: no feasible, fully evaluated trial among {len(complete)} complete "
            f"({feasible} feasible); run more trials or relax --constraint"
        )
    production = ctx.space.production_settings
    ranked = ranked_candidates(study, ctx)
    held = ctx.holdout
    held_base = ctx.run_many(production, held)

    def held_out_losses(candidate: Settings) -> list[str]:
        """Constraints the candidate breaks on the held-out windows: never recommended."""
        if not ctx.constraints:
            return []
        values = ctx.constraint_values(ctx.run_many(candidate, held), baseline=held_base)
        return [f"held-out windows: constraint {k} fails" for k, v in values.items() if v > 0]

    check = validate(
        ctx,
        [(t.number, Settings.model_validate(t.user_attrs[TRIAL_ATTR]["settings"])) for t in ranked],
        production,
        held_out_losses,
    )
    if check["chosen"] is None:  # every candidate lost the continuous replay: keep production
        chosen = next((t for t in complete if t.user_attrs.get(ROLE_ATTR) == PRODUCTION), ranked[0])
        settings = production
    else:
        chosen = next(t for t in ranked if t.number == check["chosen"])
        settings = Settings.model_validate(chosen.user_attrs[TRIAL_ATTR]["settings"])
    search_vals = (
        trial_metrics(chosen) if chosen.user_attrs.get(TRIAL_ATTR, {}).get("metrics") else {}
    )
    search_windows = list(search_vals)
    held_vals = ctx.run_many(settings, held)
    held_constraints = (
        ctx.constraint_values(held_vals, baseline=held_base) if ctx.constraints else {}
    )
    cont_metrics = next(
        (c["metrics"] for c in check["checked"] if c["trial"] == check["chosen"]),
        check["production"],
    )
    summary: dict[str, Any] = {
        "study": name,
        "trial": chosen.number,
        "is_production": chosen.user_attrs.get(ROLE_ATTR) == PRODUCTION
        or settings.to_dict() == production.to_dict(),
        "settings": settings.to_dict(),
        "production": production.to_dict(),
        "objectives": [{"name": n, "direction": d} for n, d in ctx.objectives],
        "constraints": list(ctx.spec.constraints),
        "trials_complete": len(complete),
        "gamma_hat": finite_or_none(ctx.gamma_hat),
        "confidence": CONFIDENCE,
        "search": {
            "windows": search_windows,
            "metrics": _metric_table(ctx, search_vals, ctx.baseline, search_windows),
        },
        "holdout": {
            "windows": list(held),
            "metrics": _metric_table(ctx, held_vals, held_base, held),
            "constraints": [
                {"constraint": k, "value": v, "feasible": v <= 0}
                for k, v in held_constraints.items()
            ],
        },
        "continuous": {
            "what": (
                "every trace replayed whole; held-out = the held-out windows' requests in that "
                "replay"
            ),
            "holdout": _continuous_table(
                ctx, cont_metrics["holdout"], check["production"]["holdout"]
            ),
            "all": _continuous_table(ctx, cont_metrics["all"], check["production"]["all"]),
            "checked": [{"trial": c["trial"], "losses": c["losses"]} for c in check["checked"]],
            "kept_production": check["chosen"] is None,
        },
        # What the study tuned on: each trace's source (a file, the bundled window, or the recording
        # and span as a db: URL) and what was replayed of it.
        "traces": [
            {
                "source": source or "bundled",
                "name": t.name,
                "requests": len(t),
                "span_s": t.requests[-1].arrival if len(t) else 0.0,
            }
            for source, t in zip(ctx.spec.traces, ctx.traces)
        ],
        "windows": {
            "window_s": ctx.spec.window_s,
            "warmup_s": ctx.spec.warmup_s,
            "count": len(ctx.windows),
            "labels": {str(w.index): w.label() for w in ctx.windows},
        },
    }
    if with_autopilot:
        summary["autopilot"] = keep_the_autopilot(
            ctx, production, cont_metrics["all"], check["production"]["all"]
        )
    if len(ctx.objectives) > 1:
        summary["pareto_front"] = [
            {
                "trial": t.number,
                "values": list(t.values),
                "settings": t.user_attrs[TRIAL_ATTR]["settings"],
            }
            for t in front
        ]
    return summary


def keep_the_autopilot(
    ctx: TuneContext,
    production: Settings,
    recommended: Mapping[str, float],
    base: Mapping[str, float],
) -> dict[str, Any]:
    """ "Keep the autopilot" as a candidate: the autopilot (default configuration, starting on
    production) replays every study trace whole; it is kept when it loses nothing to production
    (objectives and constraints, as any candidate) and, against the recommendation on every
    request, is no worse on any objective and better on one."""
    got = autopilot_metrics(ctx.traces, production, ctx.config, ctx.tracked, slo=ctx.spec.slo)
    lost = losses(ctx, got, base)
    worse = [n for n, d in ctx.objectives if _worse(got[n], recommended[n], d)]
    better = [n for n, d in ctx.objectives if _worse(recommended[n], got[n], d)]
    keep = not lost and not worse and bool(better)
    why = (
        "it beats the recommended settings on " + ", ".join(better)
        if keep
        else "; ".join(lost + [f"{n} worse than the recommendation" for n in worse])
        or "no better on any objective"
    )
    return {
        "keep": keep,
        "verdict": ("keep the autopilot: " if keep else "the recommended settings: ") + why,
        "metrics": {
            n: {"value": got[n], "recommended": recommended[n], "production": base[n]}
            for n in ctx.tracked
        },
    }


def _worse(a: float, b: float, direction: str) -> bool:
    return math.isfinite(a) and math.isfinite(b) and (a < b if direction == "maximize" else a > b)


def _continuous_table(
    ctx: TuneContext, values: Mapping[str, float], production: Mapping[str, float]
) -> dict[str, Any]:
    return {
        name: {
            "value": values[name],
            "production": production[name],
            "change_pct": percent_change(values[name], production[name], name),
        }
        for name in ctx.tracked
    }


# NaN/inf → None, recursively (strict JSON for stores and --json): one rule, storage's.
jsonable = finite

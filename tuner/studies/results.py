"""Reading a study's results: its feasible, fully evaluated trials, the best one (one objective)
or the feasible Pareto front (several), and the trial an operator would take from the front.
``tailpilot recommend`` (``tuner/studies/recommend.py``) and the TUI build on these.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from scheduler.metrics import percent_change
from tuner.studies.study import TRIAL_ATTR, TuneContext
from tuner.studies.windows import nanmean

# Optuna is imported inside the functions that use it: the TUI imports this module at start, and
# optuna would add ~40 ms to it (python -X importtime).
if TYPE_CHECKING:
    from optuna import Study
    from optuna.trial import FrozenTrial


def is_feasible(trial: FrozenTrial) -> bool:
    return all(v <= 0 for v in trial.constraints.values())


def candidate_trials(study: Study) -> list[FrozenTrial]:
    """COMPLETE, feasible, fully evaluated (not pruned) trials."""
    from optuna.trial import TrialState  # start-up cost: see the note above TYPE_CHECKING

    out = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        info = t.user_attrs.get(TRIAL_ATTR) or {}
        if info.get("pruned_after") is None and "settings" in info and is_feasible(t):
            out.append(t)
    return out


def best_trials(study: Study, ctx: TuneContext) -> list[FrozenTrial]:
    """Single objective: [the best feasible trial] (lowest number on ties). Several: the feasible
    Pareto front, ordered by trial number."""
    cands = candidate_trials(study)
    if not cands:
        return []
    dirs = [d for _, d in ctx.objectives]
    sign = np.array([1.0 if d == "minimize" else -1.0 for d in dirs])
    vals = np.array([[s * v for s, v in zip(sign, t.values)] for t in cands])
    if len(dirs) == 1:
        k = min(range(len(cands)), key=lambda j: (vals[j, 0], cands[j].number))
        return [cands[k]]
    front = []
    for j in range(len(cands)):
        dominated = np.any(np.all(vals <= vals[j], axis=1) & np.any(vals < vals[j], axis=1))
        if not dominated:
            front.append(cands[j])
    return sorted(front, key=lambda t: t.number)


def trial_metrics(trial: FrozenTrial) -> dict[int, dict[str, float]]:
    """A trial's per-window metrics from its user attributes (window index -> metric -> value)."""
    info = trial.user_attrs[TRIAL_ATTR]
    return {
        w: {m: (math.nan if vals[k] is None else vals[k]) for m, vals in info["metrics"].items()}
        for k, w in enumerate(info["windows"])
    }


def choose_recommendation(front: Sequence[FrozenTrial], ctx: TuneContext) -> FrozenTrial:
    """Of a Pareto front, the trial an operator would take: among the members that are no worse
    than the production settings on any objective (every % improvement >= 0), the one with the
    largest mean improvement; if every member gives something up, the one whose worst
    improvement is least bad (max-min). Ties → the lower trial number. One trial: that trial."""
    if len(front) == 1:
        return front[0]

    def gains(t: FrozenTrial) -> list[float]:
        m = trial_metrics(t)
        out = [
            percent_change(
                nanmean([m[i][n] for i in m]), nanmean([ctx.baseline[i][n] for i in m]), n
            )
            for n, _ in ctx.objectives
        ]
        return [g if math.isfinite(g) else -math.inf for g in out]

    scored = [(gains(t), t) for t in front]
    safe = [(g, t) for g, t in scored if min(g) >= 0]
    if safe:
        return min(safe, key=lambda gt: (-sum(gt[0]) / len(gt[0]), -min(gt[0]), gt[1].number))[1]
    return min(scored, key=lambda gt: (-min(gt[0]), -sum(gt[0]) / len(gt[0]), gt[1].number))[1]


def ranked_candidates(study: Study, ctx: TuneContext) -> list[FrozenTrial]:
    """Feasible, fully evaluated trials in the order ``recommend`` would take them: the chosen
    one (``choose_recommendation`` of the front) first; then, one objective, the rest by value;
    several, the rest of the front by the same rule."""
    front = best_trials(study, ctx)
    if not front:
        return []
    first = choose_recommendation(front, ctx)
    if len(ctx.objectives) == 1:
        sign = 1.0 if ctx.objectives[0][1] == "minimize" else -1.0
        rest = sorted(
            (t for t in candidate_trials(study) if t.number != first.number),
            key=lambda t: (sign * t.values[0], t.number),
        )
    else:
        rest = []
        others = [t for t in front if t.number != first.number]
        while others:
            nxt = choose_recommendation(others, ctx)
            rest.append(nxt)
            others = [t for t in others if t.number != nxt.number]
    return [first, *rest]


def best_summary(study: Study, ctx: TuneContext) -> dict[str, Any] | None:
    best = best_trials(study, ctx)
    if not best:
        return None
    t = choose_recommendation(best, ctx)
    return {
        "trial": t.number,
        "values": list(t.values),
        "settings": t.user_attrs[TRIAL_ATTR]["settings"],
        "pareto_size": len(best),
    }

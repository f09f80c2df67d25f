"""Continuous held-out validation: a recommendation replayed over the whole trace, not windows.

Windows, even warm ones, can hide what a setting does to a queue over an hour: a setting that
wins every 2-minute window may let a backlog build that only a continuous replay shows (the
README's first tuned result won its windows, P95 TTFT 2.2 s vs 11.2 s, and lost the continuous
replay of the same trace, 3,513 s vs 827 s). So ``recommend`` replays each candidate and the
production settings over every study trace from its first request to its last completion, and
measures the requests of the held-out windows in that replay (they were never searched) and all
requests. A candidate that is worse than production on any objective there, or breaks a
constraint there, is never recommended: the next candidate is tried, and if none holds,
production is kept and the summary says why.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from scheduler.settings import Settings
from sim.engine import Simulator
from tuner.studies.study import TuneContext
from tuner.studies.windows import completion_metrics

MAX_CANDIDATES = 5  # continuous replays are whole traces: check the best few, in preference order
# A candidate that changes the engine limits must keep this share of production's throughput in
# the continuous replay of every request (a token budget that wins tail windows can lose tokens/s
# over the hour: issue 22 saw a recommended budget of 1,068 lose 1.3% of throughput).
ENGINE_THROUGHPUT_FLOOR = 0.99


def continuous_metrics(ctx: TuneContext, settings: Settings) -> dict[str, dict[str, float]]:
    """Every study trace replayed whole under ``settings``: the tracked metrics of the held-out
    windows' requests (``holdout``) and of every request (``all``)."""
    held: dict[int, set[str]] = {}
    for i in ctx.holdout:
        w = ctx.windows[i]
        held.setdefault(w.trace_no, set()).update(w.measured)
    held_done, all_done = [], []
    for trace_no, trace in enumerate(ctx.traces):
        if not len(trace):
            continue
        done = Simulator(trace, settings, ctx.config).run().completions
        all_done += done
        ids = held.get(trace_no, set())
        held_done += [c for c in done if c.id in ids]
    return {
        "holdout": completion_metrics(held_done, ctx.tracked, ctx.spec.slo),
        "all": completion_metrics(all_done, ctx.tracked, ctx.spec.slo),
    }


def losses(
    ctx: TuneContext, values: Mapping[str, float], production: Mapping[str, float]
) -> list[str]:
    """Why ``values`` lose to ``production`` (empty: they do not): each objective that is worse,
    each constraint that fails, as a short phrase with the figures."""
    out = []
    for name, direction in ctx.objectives:
        x, b = values.get(name, math.nan), production.get(name, math.nan)
        if not math.isfinite(x) and math.isfinite(b):
            out.append(f"{name} undefined (production {b:.4g})")
        elif (
            math.isfinite(x) and math.isfinite(b) and (x < b if direction == "maximize" else x > b)
        ):
            out.append(f"{name} {x:.4g} vs production {b:.4g}")
    if ctx.constraints:
        for key, v in ctx.constraint_values({0: values}, baseline={0: production}).items():
            if v > 0:
                out.append(f"constraint {key} fails")
    return out


def engine_losses(
    candidate: Settings,
    production: Settings,
    values: Mapping[str, float],
    base: Mapping[str, float],
) -> list[str]:
    """A candidate with other engine limits than production's, judged on throughput in the
    continuous replay of every request."""
    if candidate.engine == production.engine:
        return []
    x, b = values.get("throughput_tok_s", math.nan), base.get("throughput_tok_s", math.nan)
    if math.isfinite(x) and math.isfinite(b) and x < ENGINE_THROUGHPUT_FLOOR * b:
        return [
            f"engine limits: throughput {x:.4g} tok/s vs production {b:.4g} in the continuous "
            "replay"
        ]
    return []


def validate(
    ctx: TuneContext,
    candidates: Sequence[tuple[int, Settings]],
    production: Settings,
    held_out_losses: Callable[[Settings], list[str]] | None = None,
) -> dict[str, Any]:
    """Continuous replays of ``candidates`` ((trial number, settings), best first; at most
    ``MAX_CANDIDATES``) against ``production``: the first that does not lose is ``chosen``
    (None: keep production). A candidate loses if it is worse on an objective or breaks a
    constraint in the continuous replay (its held-out requests, or all requests), if its engine
    limits lose throughput there, or if ``held_out_losses`` (the held-out windows) names a loss."""
    base = continuous_metrics(ctx, production)
    checked, chosen = [], None
    for number, settings in candidates[:MAX_CANDIDATES]:
        if settings.to_dict() == production.to_dict():
            checked.append({"trial": number, "losses": [], "metrics": base})
            chosen = number
            break
        got = continuous_metrics(ctx, settings)
        lost = losses(ctx, got["holdout"], base["holdout"])
        lost += [f"all requests: {why}" for why in losses(ctx, got["all"], base["all"])]
        lost += engine_losses(settings, production, got["all"], base["all"])
        if not lost and held_out_losses is not None:
            lost += held_out_losses(settings)
        checked.append({"trial": number, "losses": lost, "metrics": got})
        if not lost:
            chosen = number
            break
    return {"chosen": chosen, "production": base, "checked": checked}

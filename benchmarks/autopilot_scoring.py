"""Scoring of benchmarks/autopilot.py: the table's metrics over a trace and its second half, the
hindsight γ, the closure, and the issue's targets (README, "The autopilot")."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from benchmarks.autopilot_workloads import phase_of
from benchmarks.seed_claims import ratio
from scheduler.metrics import summarize
from scheduler.metrics.fairness import Terms, report
from scheduler.settings import SloFqParams
from sim import traces
from tuner.autopilot.promise import QUANTILE_NAMES, Figures, Promise, breaks
from tuner.closed_loop.whatif import LABELS  # the quantiles' names as an operator reads them

# The promise's quantiles (tuner.autopilot.promise) and throughput: every one is scored and guarded.
METRICS = (*QUANTILE_NAMES, "throughput_tok_s")
SCOPES = ("all", "second")
PROMISE = Promise()  # no SLO declared: every quantile within 2% of sarathi's
TTLT_SLACK = 1.0 + PROMISE.slack  # each quantile at most this times sarathi's
THROUGHPUT_FLOOR = PROMISE.throughput_floor  # throughput at least this times sarathi's
CLOSURE_TARGET = 0.75
HEADROOM = 0.05  # closure is a target where the defaults are this far above the best fixed γ
NEVER_WORSE = 0.02
SHIFT_MARGIN = 0.90  # on the shape shift the autopilot beats every fixed γ by 10%
PHASE_MARGIN = 1.10  # in each phase of the shift, within 10% of that phase's best fixed setting
PHASE_PREFIX = "phase:"  # a phase's scope: the requests whose id carries the phase's prefix
SHAPE_SHIFTS = ("shift", "shift_heldout")  # scored phase by phase
CORE_SHARE = 0.02  # the controller's CPU: at most 2% of one core


@dataclasses.dataclass
class JobResult:
    workload: str
    column: str
    scores: dict[str, dict[str, float]]  # scope -> metric -> value
    wall_s: float
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


def half_time(trace: traces.Trace) -> float:
    """The midpoint in time of the trace's arrivals.

    The second half is the requests that arrive at or after it.
    """
    return trace.requests[0].arrival + trace.duration / 2 if len(trace) else 0.0


def score(
    completions: list, t_half: float, slo: SloFqParams | None = None, *, phases: bool = False
) -> dict[str, dict[str, float]]:
    """The table's metrics over every completion and over those arriving at or after ``t_half``;
    with ``slo`` (declared tenants) also SCR and JFI, seed 003's definitions over the scope; with
    ``phases`` (the shape shift) also over each phase's requests (scope ``phase:<name>``)."""
    scopes: list[tuple[str, list]] = [
        ("all", completions),
        ("second", [c for c in completions if c.arrival >= t_half]),
    ]
    if phases:
        by_phase: dict[str, list] = {}
        for c in completions:
            by_phase.setdefault(PHASE_PREFIX + phase_of(c.id), []).append(c)
        scopes += sorted(by_phase.items(), key=lambda kv: min(c.arrival for c in kv[1]))
    out = {}
    for scope, done in scopes:
        m = summarize(done)
        out[scope] = {k: float(m[k]) for k in (*METRICS, "requests")}
        if slo is not None and done:
            span = max(c.finished_at for c in done) - min(c.arrival for c in done)
            rep = report(
                np.array([c.tenant for c in done], dtype=object),
                np.array([c.type for c in done], dtype=object),
                np.array([c.first_token_at - c.arrival for c in done]),
                np.array([c.finished_at - c.arrival for c in done]),
                np.array([c.prompt_tokens + c.output_tokens for c in done], dtype=float),
                Terms.of(slo),
                duration_s=max(span, 1.0),
            )
            out[scope]["scr"] = float(rep["scr"]) if rep["scr"] is not None else math.nan
            out[scope]["jfi"] = float(rep["jfi"]) if rep["jfi"] is not None else math.nan
    return out


def median_gamma(timeline: list[tuple[float, float]], end: float) -> float:
    """Time-weighted median of a γ timeline; NaN if empty.

    The timeline is (time, γ) samples, each held until the next.
    """
    if not timeline:
        return math.nan
    times = np.array([t for t, _ in timeline] + [max(end, timeline[-1][0])])
    values = np.array([g for _, g in timeline])
    weights = np.diff(times)
    if weights.sum() <= 0:
        return float(values[-1])
    order = np.argsort(values)
    cum = np.cumsum(weights[order])
    return float(values[order][np.searchsorted(cum, cum[-1] / 2)])


def keeps_promise(m: dict[str, float], sarathi: dict[str, float]) -> bool:
    """Every quantile ≤ 1.02× sarathi's and throughput ≥ 0.99× (the promise, no SLO declared):
    the autopilot's own judge (``tuner.autopilot.promise.breaks``) on whole-run figures."""
    return not breaks(PROMISE, Figures.of(m), Figures.of(sarathi))


def best_fixed(grid: dict[str, dict[str, float]], sarathi: dict[str, float]) -> str | None:
    """The hindsight setting: lowest P95 TTFT among the fixed settings (``fixed_label``) that
    keep the promise on every quantile (ties: the label first in order); None when none does."""
    feasible = [g for g, m in grid.items() if keeps_promise(m, sarathi)]
    return min(feasible, key=lambda g: (grid[g]["ttft_p95"], g)) if feasible else None


def closure(defaults: float, autopilot: float, best: float) -> float:
    """(defaults − autopilot) / (defaults − best fixed γ).

    NaN when the defaults already are the best.
    """
    gap = defaults - best
    return (defaults - autopilot) / gap if gap > 0 else math.nan


def fixed_label(column: str) -> str | None:
    """A fixed setting's label from its column: ``g=<γ>`` is "γ <γ>", ``fixed:<candidate>`` is
    the candidate's name (TIE at a fixed β, a MemGuard variant); None for any other column."""
    if column.startswith("g="):
        return f"γ {column.removeprefix('g=')}"
    if column.startswith("fixed:"):
        return column.removeprefix("fixed:")
    return None


def summarise(columns: dict[str, JobResult], trace: traces.Trace) -> dict[str, Any]:
    """Per scope: the shown columns' figures and ratios, the hindsight γ, the closure; plus cost."""
    out: dict[str, Any] = {}
    for scope in columns["sarathi"].scores:  # SCOPES, and each phase's where the trace has them
        sar = columns["sarathi"].scores[scope]
        grid = {
            label: r.scores[scope]
            for c, r in columns.items()
            if (label := fixed_label(c)) is not None
        }
        gammas = sorted((float(c[2:]), fixed_label(c)) for c in columns if c.startswith("g="))
        edges = {gammas[0][1], gammas[-1][1]} if gammas else set()
        winner = best_fixed(grid, sar)
        shown: dict[str, dict[str, float]] = {
            "sarathi": sar,
            "defaults": columns["defaults"].scores[scope],
        }
        if "slofq" in columns:
            shown["slofq"] = columns["slofq"].scores[scope]
        if winner is not None:
            shown["best fixed γ"] = grid[winner]
        if scope == "second" and "tuned" in columns:
            shown["tuned on 1st half"] = columns["tuned"].scores[scope]
        if "autopilot" in columns and columns["autopilot"].scores:
            shown["autopilot"] = columns["autopilot"].scores[scope]
        ratios = {name: {k: ratio(m[k], sar[k]) for k in METRICS} for name, m in shown.items()}
        entry: dict[str, Any] = {
            "figures": shown,
            "ratios": ratios,
            "best_gamma": winner,
            "at_grid_edge": winner in edges,
            "min_p95_any_gamma": min((m["ttft_p95"] for m in grid.values()), default=math.nan),
            "grid": dict(sorted(grid.items())),
        }
        if winner is not None and "autopilot" in ratios:
            r = ratios
            entry["closure"] = closure(
                r["defaults"]["ttft_p95"], r["autopilot"]["ttft_p95"], r["best fixed γ"]["ttft_p95"]
            )
        out[scope] = entry
    pilot = columns.get("autopilot")
    if pilot is not None:
        cost = {k: v for k, v in pilot.extra.items() if k != "cpu_s"}
        if "cpu_s" in pilot.extra:
            cpu = pilot.extra["cpu_s"]
            hours = trace.duration / 3600.0
            cost.update(
                cpu_per_decision_mean=float(np.mean(cpu)),
                cpu_per_decision_max=float(np.max(cpu)),
                cpu_per_hour=sum(cpu) / hours if hours > 0 else math.nan,
            )
            cost["core_share"] = cost["cpu_per_hour"] / 3600.0
        if "cpu_s" in pilot.extra and pilot.extra.get("judged"):
            # Per candidate: the cost over the candidates judged at a decision, on average (the
            # shadows running; decisions waiting for data or holding in overload judge fewer).
            judged = [n for n in pilot.extra["judged"] if n]
            cost["candidates_mean"] = float(np.mean(judged)) if judged else math.nan
            cost["cpu_per_candidate_hour"] = cost["cpu_per_hour"] / cost["candidates_mean"]
        out["autopilot"] = cost
    return out


def targets(workload: str, s: dict[str, Any]) -> list[tuple[str, bool | None, str]]:
    """(target, PASS/FAIL/None = not applicable, the figures) on the whole trace."""
    whole = s["all"]
    r = whole["ratios"]
    if "autopilot" not in r:
        note = s.get("autopilot", {}).get("error", "no autopilot column")
        return [("autopilot targets", None, note)]
    ap, de = r["autopilot"], r["defaults"]
    rows: list[tuple[str, bool | None, str]] = []
    figures = whole["figures"]
    if "scr" in figures["autopilot"]:  # the tenants' SLOs are the promise
        refs = [figures[n] for n in ("defaults", "slofq") if n in figures]
        best = max(refs, key=lambda m: (m["scr"], m["jfi"]))
        got = figures["autopilot"]
        rows.append(
            (
                "SCR >= the defaults' and slofq's",
                got["scr"] >= max(m["scr"] for m in refs) - 1e-9,
                f"{got['scr']:.3f} vs " + ", ".join(f"{m['scr']:.3f}" for m in refs),
            )
        )
        rows.append(
            (
                "JFI not lower (0.01)",
                got["jfi"] >= best["jfi"] - 0.01,
                f"{got['jfi']:.3f} vs {best['jfi']:.3f}",
            )
        )
    if whole["best_gamma"] is None:
        rows.append(("closure >= 0.75", None, "no fixed setting keeps the constraints"))
    else:
        best = r["best fixed γ"]["ttft_p95"]
        c = whole.get("closure", math.nan)
        headroom = de["ttft_p95"] - best
        figures = (
            f"closure {c:.2f} (defaults {de['ttft_p95']:.2f}x, best {best:.2f}x, "
            f"autopilot {ap['ttft_p95']:.2f}x)"
        )
        rows.append(
            (
                "closure >= 0.75",
                c >= CLOSURE_TARGET if headroom >= HEADROOM else None,
                figures
                if headroom >= HEADROOM
                else f"headroom {headroom:.2f} < {HEADROOM}: {figures}",
            )
        )
    rows.append(
        (
            "P95 TTFT <= defaults + 0.02",
            ap["ttft_p95"] <= de["ttft_p95"] + NEVER_WORSE,
            f"{ap['ttft_p95']:.3f}x vs {de['ttft_p95']:.3f}x",
        )
    )
    for q in QUANTILE_NAMES:
        rows.append((f"{LABELS[q]} <= 1.02x sarathi", ap[q] <= TTLT_SLACK, f"{ap[q]:.3f}x"))
    rows.append(
        (
            "throughput >= 0.99x sarathi",
            ap["throughput_tok_s"] >= THROUGHPUT_FLOOR,
            f"{ap['throughput_tok_s']:.4f}x",
        )
    )
    for scope, entry in s.items():
        if not scope.startswith(PHASE_PREFIX) or "autopilot" not in entry["figures"]:
            continue
        # That phase's best fixed setting: the lowest P95 TTFT of those keeping the promise on
        # the phase's own requests; where none keeps it there, the lowest of any.
        label = entry["best_gamma"]
        got = entry["figures"]["autopilot"]["ttft_p95"]
        best = entry["grid"][label]["ttft_p95"] if label else entry["min_p95_any_gamma"]
        rows.append(
            (
                f"{scope.removeprefix(PHASE_PREFIX)} phase: P95 TTFT <= 1.10x its best fixed",
                got <= PHASE_MARGIN * best,
                f"{got:.3g} s vs {best:.3g} s ({label or 'none keeps the promise; lowest of any'})"
                f" = {ratio(got, best):.2f}x",
            )
        )
    if workload in SHAPE_SHIFTS:
        p95, every = whole["figures"]["autopilot"]["ttft_p95"], whole["min_p95_any_gamma"]
        rows.append(
            (
                "P95 TTFT <= 0.90x every fixed setting (shape shift)",
                p95 <= SHIFT_MARGIN * every,
                f"{p95:.3g} s vs best of any fixed setting {every:.3g} s "
                f"({ratio(p95, every):.2f}x)",
            )
        )
    share = s.get("autopilot", {}).get("core_share")
    if share is not None:
        rows.append(
            (
                "controller CPU <= 2% of one core",
                share <= CORE_SHARE,
                f"{100 * share:.2f}% "
                f"({s['autopilot']['cpu_per_hour']:.1f} CPU s per hour of traffic)",
            )
        )
    return rows

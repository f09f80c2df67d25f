"""How many replicas keep SCR at target for this traffic and these SLOs? (``tailpilot capacity``)

    plan = capacity(trace, governance, settings, config, target=0.99)
    plan["replicas"], plan["rows"]          # the answer, and every count tried

The trace (a file, the bundled window, or a recording, scaled with ``--rate-scale``) is split
over ``n`` replicas in arrival order, round robin (what a balanced router approaches), and each
share is replayed through the simulator with the given settings and engine. The replicas'
completions together are judged per window of arrivals (``controlplane.governance.report``): the
SCR of each window, its mean and the fraction of windows at target. ``n`` is the smallest count
whose mean SCR meets the target, found by doubling then bisecting (SCR is not guaranteed to be
monotone in ``n``, so every count on the way is reported).

The KV bound (seed 003 §6: the allocatable budget is the least of compute and KV): per replica,
Little's law gives the KV tokens the traffic keeps resident — the arrival rate times the mean
time a request holds KV (its TTLT) times its mean context (prompt + output / 2) — against the
replica's KV capacity (blocks × block size). A count whose demand exceeds it is KV-bound: more
replicas, or shorter contexts, not a scheduler, fix it.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from scheduler.metrics import Completion
from scheduler.metrics.fairness import window_report
from scheduler.settings import Settings, SloFqParams
from sim import traces as tr
from sim.engine import EngineConfig, simulate


def split(trace: tr.Trace, n: int) -> list[tr.Trace]:
    """The trace's requests dealt to ``n`` replicas round robin in arrival order."""
    return [tr.Trace(f"{trace.name}#{i}/{n}", tuple(trace.requests[i::n])) for i in range(n)]


def evaluate(
    trace: tr.Trace,
    n: int,
    params: SloFqParams,
    settings: Settings,
    config: EngineConfig,
    *,
    window_s: float,
    target: float,
) -> dict[str, Any]:
    """SCR per window of ``n`` replicas serving the trace, and the KV bound per replica."""
    done: list[Completion] = []
    for share in split(trace, n):
        if len(share):
            done += simulate(share, settings, config).completions
    span = max((r.arrival for r in trace), default=0.0)
    windows = max(1, math.ceil(span / window_s))
    by_window: dict[
        int, list[Completion]
    ] = {}  # the completions of each window of arrivals, in one pass
    for c in done:
        by_window.setdefault(math.floor(c.arrival / window_s), []).append(c)
    scrs = []
    for w in range(windows):
        rows = by_window.get(w)
        if not rows:
            continue
        rep = window_report(rows, params, duration_s=window_s)
        if rep["scr"] is not None:
            scrs.append(rep["scr"])
    mean_scr = sum(scrs) / len(scrs) if scrs else None
    ttlt = float(np.mean([c.finished_at - c.arrival for c in done])) if done else 0.0
    context = float(np.mean([c.prompt_tokens + c.output_tokens / 2 for c in done])) if done else 0.0
    rate = len(trace) / max(span, 1e-9) / n
    kv_demand = rate * ttlt * context
    kv_capacity = config.num_gpu_blocks * config.block_size
    return {
        "replicas": n,
        "scr_mean": mean_scr,
        "windows_at_target": (sum(s >= target for s in scrs) / len(scrs)) if scrs else None,
        "windows": len(scrs),
        "requests": len(done),
        "lost": len(trace) - len(done),
        "kv_demand_tokens": kv_demand,
        "kv_capacity_tokens": kv_capacity,
        "kv_bound": kv_demand > kv_capacity,
    }


def capacity(
    trace: tr.Trace,
    params: SloFqParams,
    settings: Settings,
    config: EngineConfig,
    *,
    target: float = 0.99,
    window_s: float = 60.0,
    max_replicas: int = 64,
) -> dict[str, Any]:
    """The smallest replica count whose mean per-window SCR meets ``target`` (module docstring)."""
    if not 0.0 < target <= 1.0:
        raise ValueError(f"target must be in (0, 1], got {target!r}")
    if max_replicas < 1:
        raise ValueError(f"max_replicas must be >= 1, got {max_replicas!r}")
    tried: dict[int, dict[str, Any]] = {}

    def meets(n: int) -> bool:
        if n not in tried:
            tried[n] = evaluate(
                trace, n, params, settings, config, window_s=window_s, target=target
            )
        scr = tried[n]["scr_mean"]
        return scr is not None and scr >= target

    hi = 1
    while not meets(hi) and hi < max_replicas:
        hi = min(2 * hi, max_replicas)
    answer = None
    if meets(hi):
        lo = hi // 2  # fails (or 0)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if meets(mid):
                hi = mid
            else:
                lo = mid
        answer = hi
    return {
        "replicas": answer,
        "target": target,
        "window_s": window_s,
        "max_replicas": max_replicas,
        "policy": settings.policy,
        "requests": len(trace),
        "rows": [tried[n] for n in sorted(tried)],
    }


def format_plan(plan: dict[str, Any]) -> str:
    lines = [
        f"{'replicas':>8} {'mean SCR':>9} {'windows at target':>18} {'KV demand/capacity':>20}"
    ]
    for r in plan["rows"]:
        scr = "n/a" if r["scr_mean"] is None else f"{r['scr_mean']:.3f}"
        at = "n/a" if r["windows_at_target"] is None else f"{r['windows_at_target']:.0%}"
        kv = f"{r['kv_demand_tokens'] / max(r['kv_capacity_tokens'], 1):.2f}" + (
            " KV-bound" if r["kv_bound"] else ""
        )
        lines.append(f"{r['replicas']:>8} {scr:>9} {at:>18} {kv:>20}")
    if plan["replicas"] is None:
        lines.append(
            f"no count up to {plan['max_replicas']} keeps the mean SCR at {plan['target']:g} "
            f"({plan['policy']}, {plan['requests']} requests)"
        )
    else:
        lines.append(
            f"{plan['replicas']} replicas keep the mean per-window SCR at {plan['target']:g} or "
            f"above ({plan['policy']}, {plan['requests']} requests, {plan['window_s']:g}-s windows)"
        )
    return "\n".join(lines)

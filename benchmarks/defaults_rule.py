"""Candidate rules for uniboost's defaults (no controller attached), on continuous replays
(issue 22).

    python benchmarks/defaults_rule.py [--workloads conv1.0,...,sharegpt] [--jobs 1]
        [--rules today,scale0.3,scale0.1,scale0.03,...] [--json OUT] [--seed 0]

The autopilot (benchmarks/autopilot.py) found the best fixed γ, in hindsight, near 0.001 /s on
almost every workload while γ-Ada, the default, sits 3–60× above it. A fresh install runs the
defaults with no controller, so the question here is whether a *fixed rule* — γ-Ada with its
target scaled down (``ada_scale``), or fitted to another signal — beats today's defaults on every
workload, not just on average.

Every workload of benchmarks/autopilot.py (built by its own builders; ``heldout`` only when named:
it is kept for a single run after the designs are frozen) is replayed whole at vLLM's A100 engine
defaults under sarathi, today's defaults and every rule. Printed per workload: P95 TTFT, P99
TTFT, P99 TTLT and throughput as ratios to sarathi on the same requests, and γ-Ada's time-weighted
median γ. A rule is **robustly better** when on every workload

* P95 TTFT ≤ the defaults' + 0.02 (ratios to sarathi),
* P99 TTFT ≤ 1.05× the defaults',
* P99 TTLT ≤ 1.02× and throughput ≥ 0.99× sarathi's,

and its P95 TTFT is lower than the defaults' by more than 0.02 on at least one workload.
Reference rows (``ref:`` prefix: a fixed γ) are shown but never chosen. Deterministic: the
simulator and the workload builders are seeded.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

# Run as a script: the repository root goes on sys.path before the project's imports (E402).
REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# The autopilot benchmark's workloads, built alike.
from benchmarks.autopilot import build  # noqa: E402
from benchmarks.autopilot_workloads import NEW_WORKLOADS  # noqa: E402
from benchmarks.seed_claims import KNEE, ratio  # noqa: E402
from benchmarks.seed_claims import WORKLOADS as SEED_WORKLOADS  # noqa: E402
from scheduler.metrics import summarize  # noqa: E402
from scheduler.settings import Settings  # noqa: E402
from sim import traces  # noqa: E402
from sim.engine import simulate  # noqa: E402
from storage.strict_json import finite  # noqa: E402

ALL_WORKLOADS = (*SEED_WORKLOADS, *NEW_WORKLOADS)
# The held-out trace is scored once, after a design is frozen: choosing a default on it would
# spend it. Run it only by naming it.
HELD_OUT = frozenset({"heldout"})
DEFAULT_WORKLOADS = tuple(w for w in ALL_WORKLOADS if w not in HELD_OUT)
DEFAULT_TRACES = REPO / "traces"
METRICS = ("ttft_p95", "ttft_p99", "ttlt_p99", "throughput_tok_s")
LABELS = {
    "ttft_p95": "P95 TTFT",
    "ttft_p99": "P99 TTFT",
    "ttlt_p99": "P99 TTLT",
    "throughput_tok_s": "throughput",
}
NEVER_WORSE = 0.02  # P95 TTFT ratio: at most this above the defaults'
P99_TTFT_SLACK = 1.05  # P99 TTFT at most this times the defaults'
TTLT_SLACK = 1.02  # P99 TTLT at most this times sarathi's
THROUGHPUT_FLOOR = 0.99  # throughput at least this times sarathi's

UNIBOOST = "uniboost"
RULES: dict[str, dict[str, Any]] = {
    "sarathi": {"policy": "sarathi"},
    "today": {"policy": UNIBOOST},
    **{
        f"scale{s:g}": {"policy": UNIBOOST, "params": {"ada_scale": s}}
        for s in (0.7, 0.5, 0.3, 0.1, 0.03, 0.01)
    },
    # The written stage-4 signal: end-to-end latency, whose tail under a small γ is the starved
    # long requests' — it drifts to gamma_min, where the hindsight γ of most workloads sits.
    "sig=ttlt": {"policy": UNIBOOST, "params": {"ada_signal": "ttlt"}},
    "sig=ttft": {"policy": UNIBOOST, "params": {"ada_signal": "ttft"}},
    "ref:g=0.001": {"policy": UNIBOOST, "params": {"gamma": 0.001, "gamma_ada": False}},
    # A floor under γ-Ada: in sustained overload the FCFS-equivalent waits of its window grow with
    # the queue, it reads the growth as a long tail and takes γ to its bound (README, "The
    # defaults' floor").
    **{
        f"floor{g:g}": {"policy": UNIBOOST, "params": {"gamma_min": g}}
        for g in (0.001, 0.01, 0.0215, 0.0464, 0.1)
    },
}
DEFAULT_RULES = ("scale0.3", "scale0.1", "scale0.03", "sig=ttlt", "ref:g=0.001")


def median_gamma(timeline: list[tuple[float, float]], end: float) -> float:
    """Time-weighted median of γ-Ada's (time, γ) samples, each held until the next (NaN if none)."""
    if not timeline:
        return math.nan
    spans = sorted(
        (float(g), (timeline[i + 1][0] if i + 1 < len(timeline) else max(end, t)) - t)
        for i, (t, g) in enumerate(timeline)
    )
    total = sum(w for _, w in spans)
    if total <= 0:
        return float(timeline[-1][1])
    acc = 0.0
    for g, w in spans:
        acc += w
        if acc >= total / 2:
            return g
    return spans[-1][0]


def replay(job: tuple[str, str, traces.Trace]) -> tuple[str, str, dict[str, float], float]:
    """One continuous replay: (workload, rule, the metrics with γ-Ada's median γ, wall seconds)."""
    workload, rule, trace = job
    started = time.perf_counter()
    result = simulate(trace, Settings.model_validate(RULES[rule]))
    m = summarize(result.completions)
    out = {k: float(m[k]) for k in (*METRICS, "requests")}
    out["median_gamma"] = median_gamma(result.gamma_timeline, result.sim_time_s)
    out["rejected"] = float(len(result.rejected))
    return workload, rule, out, time.perf_counter() - started


def ratios(figures: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """Every rule's metrics over sarathi's on the same requests."""
    sar = figures["sarathi"]
    return {rule: {k: ratio(m[k], sar[k]) for k in METRICS} for rule, m in figures.items()}


def verdict(rule: str, by_workload: dict[str, dict[str, dict[str, float]]]) -> dict[str, Any]:
    """Whether ``rule`` is robustly better than today's defaults (module docstring), and why not."""
    failures, gains = [], {}
    for w, r in by_workload.items():
        c, d = r[rule], r["today"]
        if c["ttft_p95"] > d["ttft_p95"] + NEVER_WORSE:
            failures.append(
                f"{w}: P95 TTFT {c['ttft_p95']:.3f}x > "
                f"the defaults' {d['ttft_p95']:.3f}x + {NEVER_WORSE}"
            )
        if c["ttft_p99"] > P99_TTFT_SLACK * d["ttft_p99"]:
            failures.append(
                f"{w}: P99 TTFT {c['ttft_p99']:.2f}x > {P99_TTFT_SLACK} x the defaults' "
                f"{d['ttft_p99']:.2f}x = {P99_TTFT_SLACK * d['ttft_p99']:.2f}x"
            )
        if c["ttlt_p99"] > TTLT_SLACK:
            failures.append(f"{w}: P99 TTLT {c['ttlt_p99']:.3f}x sarathi > {TTLT_SLACK}")
        if c["throughput_tok_s"] < THROUGHPUT_FLOOR:
            failures.append(
                f"{w}: throughput {c['throughput_tok_s']:.4f}x sarathi < {THROUGHPUT_FLOOR}"
            )
        gains[w] = d["ttft_p95"] - c["ttft_p95"]
    better_somewhere = any(g > NEVER_WORSE for g in gains.values())
    if not better_somewhere:
        failures.append(f"P95 TTFT better than the defaults by > {NEVER_WORSE} nowhere")
    finite_gains = [g for g in gains.values() if math.isfinite(g)]
    return {
        "robust": not failures,
        "failures": failures,
        "p95_gain": gains,
        "mean_p95_gain": sum(finite_gains) / len(finite_gains) if finite_gains else math.nan,
        "min_p95_gain": min(finite_gains, default=math.nan),
        "max_p95_gain": max(finite_gains, default=math.nan),
    }


def markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def report(
    rules: list[str],
    figures: dict[str, dict[str, dict[str, float]]],
    by_workload: dict[str, dict[str, dict[str, float]]],
    verdicts: dict[str, dict[str, Any]],
) -> None:
    header = ["workload", "rule", *(LABELS[k] for k in METRICS), "median γ"]
    rows = []
    for w, r in by_workload.items():
        for rule in ("sarathi", "today", *rules):
            m, g = r[rule], figures[w][rule]["median_gamma"]
            cells = [f"{m[k]:.2f}x" if k != "throughput_tok_s" else f"{m[k]:.3f}x" for k in METRICS]
            rows.append([w, rule, *cells, "—" if not math.isfinite(g) else f"{g:.3g}"])
    print("\nRatios to sarathi on the same requests (continuous replays):\n")
    print(markdown(header, rows))
    print("\nP95 TTFT, ratio to sarathi (one column a rule):\n")
    cols = ["today", *rules]
    print(
        markdown(
            ["workload", *cols],
            [[w, *(f"{r[c]['ttft_p95']:.2f}x" for c in cols)] for w, r in by_workload.items()],
        )
    )
    print("\nVerdicts (robustly better than today's defaults?):")
    for rule in rules:
        v = verdicts[rule]
        tag = "reference, never chosen; " if rule.startswith("ref:") else ""
        head = "ROBUST" if v["robust"] else "no"
        print(
            f"{head:6s} {rule}: {tag}P95 TTFT gain over the defaults "
            f"mean {v['mean_p95_gain']:+.3f}, "
            f"min {v['min_p95_gain']:+.3f}, max {v['max_p95_gain']:+.3f}"
        )
        for f in v["failures"]:
            print(f"         - {f}")
    robust = [r for r in rules if verdicts[r]["robust"] and not r.startswith("ref:")]
    best = max(robust, key=lambda r: verdicts[r]["mean_p95_gain"]) if robust else None
    print(
        f"\nBest robust rule: {best or 'none'}"
        + (f" (mean P95 TTFT gain {verdicts[best]['mean_p95_gain']:+.3f})" if best else "")
    )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--workloads", default=",".join(DEFAULT_WORKLOADS))
    ap.add_argument("--rules", default=",".join(DEFAULT_RULES), help=f"known: {', '.join(RULES)}")
    ap.add_argument("--jobs", type=int, default=1, help="worker processes (1: in this process)")
    ap.add_argument("--traces", type=Path, default=DEFAULT_TRACES)
    ap.add_argument("--json", type=Path, help="also write every figure here")
    ap.add_argument("--knee", type=float, default=KNEE)
    ap.add_argument("--seed", type=int, default=0, help="the new workloads' seed")
    args = ap.parse_args()
    workloads = [w for w in args.workloads.split(",") if w]
    rules = [r for r in args.rules.split(",") if r and r not in ("sarathi", "today")]
    bad = [w for w in workloads if w not in ALL_WORKLOADS] + [r for r in rules if r not in RULES]
    if bad:
        raise SystemExit(f"unknown workloads or rules: {', '.join(bad)}")
    if args.jobs < 1:
        raise SystemExit("--jobs must be >= 1")
    started = time.perf_counter()
    cpu0 = time.process_time()
    pool = ProcessPoolExecutor(max_workers=args.jobs) if args.jobs > 1 else None
    mapper = pool.map if pool else map
    built: dict[str, traces.Trace] = {}
    for name, trace, how in mapper(
        build, [(w, args.traces, args.seed, args.knee) for w in workloads]
    ):
        built[name] = trace
        print(
            f"{name}: {len(trace)} requests, {trace.duration / 60:.1f} min, "
            f"{trace.rate:.2f} req/s ({how})",
            flush=True,
        )
    jobs = [(w, rule, built[w]) for w in workloads for rule in ("sarathi", "today", *rules)]
    figures: dict[str, dict[str, dict[str, float]]] = {w: {} for w in workloads}
    walls: dict[str, float] = {}
    for w, rule, m, wall in mapper(replay, jobs):
        figures[w][rule] = m
        walls[f"{w}/{rule}"] = wall
        print(
            f"  {w:10s} {rule:12s} P95 TTFT {m['ttft_p95']:9.3g} s  "
            f"median γ {m['median_gamma']:.3g}  ({wall:.0f} s)",
            flush=True,
        )
    if pool:
        pool.shutdown()
    by_workload = {w: ratios(figures[w]) for w in workloads}
    verdicts = {rule: verdict(rule, by_workload) for rule in rules}
    report(rules, figures, by_workload, verdicts)
    wall = time.perf_counter() - started
    load = os.getloadavg()
    print(
        f"\n{len(jobs)} replays in {wall:.0f} s wall, "
        f"{time.process_time() - cpu0:.0f} CPU s in this process "
        f"({args.jobs} worker{'s' if args.jobs > 1 else ''}); "
        f"load average now {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
    )
    if args.json:
        doc = {
            "workloads": workloads,
            "rules": {r: RULES[r] for r in ("sarathi", "today", *rules)},
            "figures": figures,
            "ratios": by_workload,
            "verdicts": verdicts,
            "replay_wall_s": walls,
            "wall_s": wall,
            "jobs": args.jobs,
            "seed": args.seed,
            "knee": args.knee,
        }
        args.json.write_text(json.dumps(finite(doc), indent=2))


if __name__ == "__main__":
    main()

"""What following the leader can reach online: an oracle with perfect shadows (issue 32's closure).

    python benchmarks/autopilot_leader.py [--workloads diurnal,conv1.0] [--jobs 2]

The autopilot's closure is measured against the best fixed setting *in hindsight* — chosen on the
whole run, future included. How much of that gap can a controller close that sees only the past?
This replays every fixed setting of the autopilot's candidate set (sarathi, the defaults, the γ
grid, the other knobs: the hindsight column's set, ``benchmarks/autopilot.py``) whole, and at
every minute lets an oracle choose among them on the past alone, with everything the autopilot
has to estimate given exactly:

- every candidate's latencies are its own whole replay's (a *perfect shadow*: run from the first
  request, true output lengths, no delay, no sampling of the window);
- a request still waiting at the decision counts with its wait so far (its TTFT and TTLT are
  ``min(event, now) − arrival``), as the autopilot counts what a small γ holds back;
- the window is the last hour of arrivals, the promise the autopilot's (every quantile — P50,
  P95, P99 TTFT; P50, P99 TTLT — within 1.02× sarathi's on the window), the objective the
  window's P95 TTFT.

Two rules: ``leader`` switches to the window's best keeping the promise whenever it changes;
``leader+margins`` only when the best beats the running choice by 5% and 10 minutes after its
last switch (the autopilot's ``down_margin`` and ``min_dwell_s``), or at once when the running
choice breaks the promise on the window. The chosen schedule is then replayed — one simulator,
settings switched live at the decision times (what the replica would have done) — and scored on
the whole run like the benchmark's columns: every quantile against sarathi's, and the closure
(defaults − leader) / (defaults − best fixed) on P95 TTFT. A closure the leader cannot reach
with perfect shadows is out of reach of a controller that follows the past, whatever its
estimates. Deterministic; a minute or two per workload on one core.
"""

from __future__ import annotations

import argparse
import math
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

# Run as a script: the repository root goes on sys.path before the project's imports (E402).
REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.autopilot import (  # noqa: E402
    DEFAULT_GRID,
    DEFAULT_TRACES,
    KNEE,
    build,
    fixed,
    other_knobs,
    replay_switched,
)
from benchmarks.autopilot_scoring import (  # noqa: E402
    METRICS,
    TTLT_SLACK,
    best_fixed,
    closure,
    half_time,
    keeps_promise,
    score,
)
from scheduler.metrics import Completion  # noqa: E402
from scheduler.settings import Settings  # noqa: E402
from sim import traces  # noqa: E402
from sim.engine import simulate  # noqa: E402
from tuner.autopilot.candidates import axis_rank  # noqa: E402
from tuner.autopilot.config import AutopilotConfig  # noqa: E402

# The autopilot's own defaults: a decision every interval_s on the last window_s; leader+margins
# takes its down_margin and min_dwell_s; --tie names its tie.
_AUTOPILOT = AutopilotConfig()
DECISION_S = _AUTOPILOT.interval_s
WINDOW_S = _AUTOPILOT.window_s
MARGIN = _AUTOPILOT.down_margin
DWELL_S = _AUTOPILOT.min_dwell_s
MIN_REQUESTS = 500  # a window with fewer arrivals is not judged (the autopilot's: judge_requests)
DEFAULT_WORKLOADS = "conv1.0,conv1.1,mix20,diurnal,shift,mooncake,bwb_servegen"
# Window figures: (column of the latency arrays, quantile) per promise quantile.
WINDOW_QUANTILES = {
    "ttft_p50": (0, 50),
    "ttft_p95": (0, 95),
    "ttft_p99": (0, 99),
    "ttlt_p50": (1, 50),
    "ttlt_p99": (1, 99),
}


def candidates() -> dict[str, dict[str, Any]]:
    """The hindsight column's fixed settings, with sarathi and the defaults."""
    out = {"sarathi": {"policy": "sarathi"}, "defaults": {"policy": "uniboost"}}
    out.update({f"γ {g:g}": fixed(g) for g in DEFAULT_GRID})
    out.update(other_knobs())
    return out


def replay_fixed(job: tuple[traces.Trace, str, dict[str, Any]]) -> tuple[str, list[Completion]]:
    """One candidate's whole replay: its completions by arrival."""
    trace, name, doc = job
    done = simulate(trace, Settings.model_validate(doc)).completions
    done.sort(key=lambda c: (c.arrival, c.id))
    return name, done


def latencies(done: list[Completion]) -> np.ndarray:
    """Completions by arrival as rows of (arrival, first token, finish)."""
    return np.array([(c.arrival, c.first_token_at, c.finished_at) for c in done])


def window_figures(
    times: np.ndarray, now: float, min_requests: int = MIN_REQUESTS
) -> dict[str, float] | None:
    """The promise's quantiles over the arrivals of the last ``WINDOW_S`` before ``now``, a
    request not yet served counting with its wait so far; None under ``min_requests``."""
    arrival = times[:, 0]
    lo, hi = np.searchsorted(arrival, [now - WINDOW_S, now], side="right")
    if hi - lo < min_requests:
        return None
    seen = times[lo:hi]
    waits = np.minimum(seen[:, 1:], now) - seen[:, :1]
    return {k: float(np.percentile(waits[:, col], q)) for k, (col, q) in WINDOW_QUANTILES.items()}


def keeps_on_window(m: dict[str, float], sarathi: dict[str, float]) -> bool:
    return all(m[k] <= TTLT_SLACK * sarathi[k] for k in WINDOW_QUANTILES)


def schedule_of(
    replays: dict[str, np.ndarray],
    end: float,
    margins: bool,
    *,
    min_requests: int = MIN_REQUESTS,
    delay_s: float = 0.0,
    tie: float = 0.0,
    ranks: dict[str, float] | None = None,
) -> list[tuple[float, str]]:
    """The oracle's choices, (time, candidate) at each switch, starting on the defaults; with
    ``delay_s`` the figures at a decision are those of ``delay_s`` before it (the autopilot's
    shadows run a minute behind the replica); with ``tie``, the autopilot's tie rule: among the
    candidates within ``tie`` of the best P95 the running one stays, else the most age-first
    (``ranks``: each candidate's place on the size-to-age axis) is taken."""
    schedule, current, last_switch = [(0.0, "defaults")], "defaults", -math.inf
    now = DECISION_S
    while now < end:
        seen = now - delay_s
        figures = {n: window_figures(t, seen, min_requests) for n, t in replays.items()}
        sarathi = figures["sarathi"]
        if sarathi is not None:
            fig = {n: f for n, f in figures.items() if f is not None}
            feasible = [n for n, f in fig.items() if keeps_on_window(f, sarathi)]
            best = min(feasible, key=lambda n: (fig[n]["ttft_p95"], n))
            if tie > 0 and ranks is not None:
                bar = (1.0 + tie) * fig[best]["ttft_p95"]
                tied = [n for n in feasible if fig[n]["ttft_p95"] <= bar]
                best = current if current in tied else max(tied, key=lambda n: (ranks[n], n))
            if margins and best != current:
                broken = current not in feasible
                dwelt = now - last_switch >= DWELL_S
                better = fig[best]["ttft_p95"] < (1.0 - MARGIN) * fig[current]["ttft_p95"]
                if not broken and not (dwelt and better):
                    best = current
            if best != current:
                schedule.append((now, best))
                current, last_switch = best, now
        now += DECISION_S
    return schedule


def ratio_row(m: dict[str, float], sarathi: dict[str, float]) -> str:
    return " ".join(f"{m[k] / sarathi[k]:.3f}" if sarathi[k] else "n/a" for k in METRICS)


def run(
    workload: str,
    root: Path,
    pool: ProcessPoolExecutor,
    min_requests: int,
    delay_s: float,
    tie: float,
) -> None:
    _, trace, how = build((workload, root, 0, KNEE))
    docs = candidates()
    done = dict(pool.map(replay_fixed, [(trace, n, d) for n, d in docs.items()]))
    replays = {n: latencies(d) for n, d in done.items()}
    t_half = half_time(trace)
    whole = {n: score(d, t_half)["all"] for n, d in done.items()}
    sarathi = whole["sarathi"]
    grid = {n: m for n, m in whole.items() if n not in ("sarathi", "defaults")}
    winner = best_fixed(grid, sarathi)
    p95 = {n: m["ttft_p95"] / sarathi["ttft_p95"] for n, m in whole.items()}
    print(f"\n{workload}: {how}")
    print(f"  quantiles vs sarathi: {' '.join(METRICS)}")
    print(f"  defaults            {ratio_row(whole['defaults'], sarathi)}")
    if winner is None:
        print("  no fixed setting keeps every quantile: no closure to measure")
        return
    print(f"  best fixed ({winner}) {ratio_row(whole[winner], sarathi)}")
    end = float(replays["sarathi"][:, 2].max())
    ranks = {n: axis_rank(Settings.model_validate(d)) for n, d in docs.items()}
    for margins in (False, True):
        rule = "leader+margins" if margins else "leader"
        schedule = schedule_of(
            replays,
            end,
            margins,
            min_requests=min_requests,
            delay_s=delay_s,
            tie=tie,
            ranks=ranks,
        )
        m = score(replay_switched(trace, [(t, docs[n]) for t, n in schedule]), t_half)["all"]
        kept = "kept" if keeps_promise(m, sarathi) else "BROKEN"
        gap = closure(p95["defaults"], m["ttft_p95"] / sarathi["ttft_p95"], p95[winner])
        gap_s = "n/a (no headroom)" if math.isnan(gap) else f"{gap:.2f}"
        print(
            f"  {rule:<19} {ratio_row(m, sarathi)}  every quantile {kept}, "
            f"closure {gap_s}, {len(schedule) - 1} switches"
        )
        shown = ", ".join(f"{t / 60:.0f}m {n}" for t, n in schedule[1:8])
        more = f" (+{len(schedule) - 8} more)" if len(schedule) > 8 else ""
        print(f"      {shown or 'no switch'}{more}")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--workloads", default=DEFAULT_WORKLOADS)
    ap.add_argument("--traces", type=Path, default=DEFAULT_TRACES)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument(
        "--min-requests",
        type=int,
        default=MIN_REQUESTS,
        help="a window with fewer arrivals is not judged (the autopilot's judge_requests: "
        f"{_AUTOPILOT.judge_requests})",
    )
    ap.add_argument(
        "--delay-s",
        type=float,
        default=0.0,
        help="judge on the figures of this long before each decision (the autopilot's: "
        f"{_AUTOPILOT.delay_s:g})",
    )
    ap.add_argument(
        "--tie",
        type=float,
        default=0.0,
        help="the autopilot's tie rule: within this fraction of the best, the most age-first "
        f"(its tie: {_AUTOPILOT.tie:g})",
    )
    args = ap.parse_args()
    ties = f"; ties within {args.tie:.0%} go to the most age-first" if args.tie else ""
    print(
        f"decisions every {DECISION_S:g} s on the last {WINDOW_S:g} s of arrivals (at least "
        f"{args.min_requests}, {args.delay_s:g} s late); margins rule: {MARGIN:.0%}, "
        f"{DWELL_S:g} s dwell{ties}"
    )
    with ProcessPoolExecutor(args.jobs) as pool:
        for workload in args.workloads.split(","):
            run(workload.strip(), args.traces, pool, args.min_requests, args.delay_s, args.tie)


if __name__ == "__main__":
    main()

"""Iterate on the autopilot quickly: the fixed columns (sarathi, defaults, the γ grid) of each
workload are replayed once and cached; only the autopilot is replayed per call.

    python benchmarks/autopilot_dev.py --workloads conv1.0,shift [--set key=value ...] [--cache DIR]

Prints, per workload, the whole-trace and second-half P95 TTFT ratios, the closure, the targets
and the autopilot's switches. A development aid: the benchmark of record is benchmarks/autopilot.py.
"""

from __future__ import annotations

import argparse
import pickle
import sys
import time
from collections import Counter
from pathlib import Path

# Run as a script: the repository root goes on sys.path before the project's imports (E402).
REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import autopilot as bench  # noqa: E402
from benchmarks import autopilot_scoring as scoring  # noqa: E402
from benchmarks.autopilot_workloads import slos_of  # noqa: E402
from scheduler.settings_change import parse_assignment  # noqa: E402
from tuner.autopilot.replay import replay_with_autopilot  # noqa: E402


def fixed_columns(
    workload: str, cache: Path, root: Path
) -> tuple[object, dict[str, scoring.JobResult]]:
    path = cache / f"{workload}.pkl"
    if path.exists():
        return pickle.loads(path.read_bytes())
    _name, trace, how = bench.build((workload, root, 0, bench.KNEE))
    jobs = [
        j
        for j in bench.jobs_for(
            workload, trace, bench.DEFAULT_GRID, tuned=False, autopilot=False, trials=0, seed=0
        )
    ]
    cols = {j.column: bench.run_job(j) for j in jobs}
    path.write_bytes(pickle.dumps(((trace, how), cols)))
    return (trace, how), cols


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--workloads", required=True)
    ap.add_argument("--set", action="append", default=[], help="AutopilotConfig field=JSON value")
    ap.add_argument("--cache", type=Path, default=Path("/tmp/autopilot-dev"))
    ap.add_argument("--traces", type=Path, default=bench.DEFAULT_TRACES)
    ap.add_argument("--verbose", "-v", action="count", default=0)
    args = ap.parse_args()
    args.cache.mkdir(parents=True, exist_ok=True)
    overrides = dict(parse_assignment(text) for text in args.set)
    for w in args.workloads.split(","):
        config = bench.autopilot_config(w).model_copy(update=overrides)
        (trace, _how), cols = fixed_columns(w, args.cache, args.traces)
        t0, c0 = time.perf_counter(), time.process_time()
        result, decisions = replay_with_autopilot(trace, config=config)
        wall = time.perf_counter() - t0
        cpu = [d.cpu_s for d in decisions]
        extra = {
            "decisions": len(decisions),
            "cpu_s": cpu,
            "judged": [len(d.figures) for d in decisions],
            "choices": dict(Counter(d.choice for d in decisions)),
            "switches": sum(d.changed for d in decisions),
            "replay_cpu_s": time.process_time() - c0,
        }
        cols = dict(cols)
        cols["autopilot"] = scoring.JobResult(
            w,
            "autopilot",
            scoring.score(
                result.completions,
                scoring.half_time(trace),
                slos_of(w),
                phases=w in scoring.SHAPE_SHIFTS,
            ),
            wall,
            extra,
        )
        s = scoring.summarise(cols, trace)
        r = s["all"]["ratios"]
        print(
            f"== {w} ({wall:.0f} s): defaults {r['defaults']['ttft_p95']:.3f} "
            f"best {r['best fixed γ']['ttft_p95']:.3f}"
            f" (γ {s['all']['best_gamma']}) autopilot {r['autopilot']['ttft_p95']:.3f} closure "
            f"{s['all'].get('closure', float('nan')):.2f} | "
            f"2nd half closure {s['second'].get('closure', float('nan')):.2f}"
            f" | P99 TTFT {r['autopilot']['ttft_p99']:.2f} "
            f"(2nd half P95 {s['second']['ratios']['autopilot']['ttft_p95']:.2f})"
            f" | ttlt {r['autopilot']['ttlt_p99']:.3f} thr {r['autopilot']['throughput_tok_s']:.4f}"
            f" | min any γ {s['all']['min_p95_any_gamma']:.3g}s "
            f"ap {s['all']['figures']['autopilot']['ttft_p95']:.3g}s"
            f" | controller {100 * s['autopilot'].get('core_share', float('nan')):.2f}% of a core"
            f" ({s['autopilot'].get('cpu_per_candidate_hour', float('nan')):.2f} CPU s per "
            "candidate per hour)"
        )
        for name, ok, fig in scoring.targets(w, s):
            if ok is False:
                print(f"   FAIL {name}: {fig}")
        sw = [(round(d.at / 60, 1), d.choice) for d in decisions if d.changed]
        print(f"   switches {sw}")
        if args.verbose:
            for d in decisions:
                print(f"   {d.at / 60:6.1f} {d.choice:12s} {d.reason}")
                if args.verbose > 1 and d.figures:
                    for n, f in sorted(d.figures.items(), key=lambda kv: kv[1].ttft_p95):
                        print(
                            f"          {n:28s} p95 {f.ttft_p95:.3f} p99 {f.ttft_p99:.3f} "
                            f"scr {f.scr} {'ok' if f.feasible else ','.join(f.broken)}"
                        )


if __name__ == "__main__":
    main()

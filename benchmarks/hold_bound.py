"""Does a hold-back bound buy a small γ its tail back? (issue 32, the knobs)

    python benchmarks/hold_bound.py [--workloads conv1.0,conv1.1,diurnal,shift]
        [--gammas 0.001,0.01,0.1,0.5] [--bounds 5,10,15,20,30,60] [--jobs 2]

uniboost's ``hold_bound_s`` makes a request that has waited that long since its arrival overdue:
ahead of every request that is not, overdue ones first come first served. The question for the
autopilot's candidate set is whether some fixed (γ, bound) keeps every quantile within 1.02× of
sarathi's (throughput ≥ 0.99×) at a lower P95 TTFT than the best unbounded γ does — the same
all-quantile guard as ``benchmarks/autopilot.py``'s hindsight column, on the same whole replays of
the same workloads. Prints, per workload, every (γ, bound) as ratios to sarathi, then the best
unbounded and the best bounded setting under the guard.
"""

from __future__ import annotations

import argparse
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

# Run as a script: the repository root goes on sys.path before the project's imports (E402).
REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import autopilot as bench  # noqa: E402
from benchmarks.autopilot_scoring import keeps_promise  # noqa: E402

QUANTILES = ("ttft_p50", "ttft_p95", "ttft_p99", "ttlt_p50", "ttlt_p99", "throughput_tok_s")
HEADERS = ("TTFT P50", "TTFT P95", "TTFT P99", "TTLT P50", "TTLT P99", "tok/s")


def settings_of(gamma: float | None, bound: float | None) -> dict[str, object]:
    if gamma is None:
        return {"policy": "sarathi"}
    return {
        "policy": "uniboost",
        "params": {"gamma": gamma, "gamma_ada": False, "hold_bound_s": bound},
    }


def replay(
    job: tuple[str, float | None, float | None],
) -> tuple[str, float | None, float | None, dict[str, float]]:
    workload, gamma, bound = job
    _name, trace, _how = bench.build((workload, bench.DEFAULT_TRACES, 0, bench.KNEE))
    result = bench.run_job(bench.Job(workload, "x", trace, settings_of(gamma, bound)))
    return workload, gamma, bound, result.scores["all"]


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--workloads", default="conv1.0,conv1.1,diurnal,shift")
    ap.add_argument("--gammas", type=floats, default=[0.001, 0.01, 0.1, 0.5])
    ap.add_argument("--bounds", type=floats, default=[5, 10, 15, 20, 30, 60])
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args()
    workloads = args.workloads.split(",")
    jobs: list[tuple[str, float | None, float | None]] = []
    for w in workloads:
        jobs.append((w, None, None))
        for g in args.gammas:
            jobs += [(w, g, b) for b in (None, *args.bounds)]
    with ProcessPoolExecutor(args.jobs) as pool:
        results = list(pool.map(replay, jobs))
    for w in workloads:
        rows = [(g, b, m) for ww, g, b, m in results if ww == w]
        sarathi = next(m for g, _b, m in rows if g is None)
        print(
            f"== {w}: sarathi P95 TTFT {sarathi['ttft_p95']:.3g} s, P99 {sarathi['ttft_p99']:.3g} s"
        )
        print("   γ        bound   " + " ".join(f"{h:>8}" for h in HEADERS) + "  keeps")
        best: dict[bool, tuple[float, float, float | None]] = {}
        for g, b, m in rows:
            if g is None:
                continue
            ratios = [m[q] / sarathi[q] for q in QUANTILES]
            kept = keeps_promise(m, sarathi)
            print(
                f"   {g:<8g} {'-' if b is None else f'{b:g} s':>6}  "
                + " ".join(f"{r:8.3f}" for r in ratios)
                + ("  yes" if kept else "")
            )
            bounded = b is not None
            if kept and (bounded not in best or ratios[1] < best[bounded][0]):
                best[bounded] = (ratios[1], g, b)
        for bounded, label in ((False, "unbounded"), (True, "bounded")):
            if bounded in best:
                p95, g, b = best[bounded]
                where = f"γ {g:g}" + (f", bound {b:g} s" if b is not None else "")
                print(f"   best {label} keeping every quantile: {where}, P95 TTFT {p95:.3f}×")
            else:
                print(f"   best {label} keeping every quantile: none")


if __name__ == "__main__":
    main()

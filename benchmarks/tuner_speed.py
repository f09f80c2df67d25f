"""Tuner speed: trials per minute on one core for the bundled 10-minute Azure conv window.

    python benchmarks/tuner_speed.py [--trials 100] [--policy uniboost] [--window-s 120]

A fresh study in a temporary SQLite storage (the default backend), `tailpilot tune`'s defaults:
the bundled window cut into 120-s windows (one held out, four searched per trial), TPE with the
WilcoxonPruner, objective ttlt_p99, constraint throughput>=0.99*baseline, policy and engine
parameters searched. Prints the set-up time (window building, the FCFS replay for γ̂ and the
baseline), then trials per minute overall and per block of trials (TPE's cost grows with the
history), and how much of a trial is simulation. Target (issue): >= 60 trials/min.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import tuner.studies.study as study_mod
from tuner.studies.optimize import run_worker
from tuner.studies.optuna_storage import open_storage, storage_url
from tuner.studies.spec import StudySpec
from tuner.studies.study import prepare


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--trials", type=int, default=100)
    ap.add_argument("--policy", default="uniboost")
    ap.add_argument("--window-s", type=float, default=120.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one core

    sim_s = [0.0]
    real = study_mod.window_metrics

    def timed(*a, **kw):
        t0 = time.perf_counter()
        try:
            return real(*a, **kw)
        finally:
            sim_s[0] += time.perf_counter() - t0

    study_mod.window_metrics = timed
    with tempfile.TemporaryDirectory() as tmp:
        url = storage_url(str(Path(tmp) / "tailpilot-optuna.db"))
        spec = StudySpec(
            policies=[args.policy],
            objectives=["ttlt_p99"],
            constraints=["throughput>=0.99*baseline"],
            window_s=args.window_s,
            seed=args.seed,
        )
        storage = open_storage(url)
        t0 = time.perf_counter()
        ctx = prepare(storage, "speed", spec)
        setup = time.perf_counter() - t0
        n_req = sum(len(w.trace) for w in ctx.windows)
        print(
            f"bundled Azure conv window: {n_req} requests in {len(ctx.windows)} windows "
            f"of {args.window_s:g} s; "
            f"{len(ctx.search)} searched per trial, {len(ctx.holdout)} held out"
        )
        print(f"set-up (windows, FCFS replay for gamma-hat, baseline): {setup:.2f} s")
        print(f"search space: {len(ctx.space.describe())} dimensions")
        marks: list[tuple[int, float, float]] = []
        start = time.perf_counter()
        cpu0 = time.process_time()
        sim_s[0] = 0.0

        def progress(done: int, total: int) -> None:
            if done and (done % 20 == 0 or done == total) and (not marks or marks[-1][0] != done):
                marks.append((done, time.perf_counter() - start, sim_s[0]))

        run_worker(storage, "speed", ctx, args.trials, progress=progress)
        wall = time.perf_counter() - start
        cpu = time.process_time() - cpu0
    print(f"\n{'trials':>9} {'trials/min':>11} {'sim share':>10}")
    prev = (0, 0.0, 0.0)
    for done, t, s in marks:
        dt = t - prev[1]
        print(
            f"{prev[0] + 1:>4}-{done:<4} {60 * (done - prev[0]) / dt:11.1f} "
            f"{(s - prev[2]) / dt:10.0%}"
        )
        prev = (done, t, s)
    print(
        f"\n{args.trials} trials in {wall:.1f} s on one core: "
        f"{60 * args.trials / wall:.1f} trials/min "
        f"(target >= 60); simulation {sim_s[0] / wall:.0%} of the time"
    )
    print(
        f"CPU time {cpu:.1f} s: {60 * args.trials / cpu:.1f} trials per CPU-minute "
        "(the wall figure is lower when other processes share the core)"
    )


if __name__ == "__main__":
    main()

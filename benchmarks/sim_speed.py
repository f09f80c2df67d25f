"""Simulator speed: replay the whole Azure conv trace (19,366 requests) at its recorded rate
through each policy, on one core.

    python benchmarks/sim_speed.py [--trace PATH] [--repeat N]
        [--step-by-step-policies fcfs,uniboost]

Prints, per policy: wall seconds per replay (best of N), simulated requests per second, steps,
and event-loop iterations; then the speed-up of event skipping over step-by-step mode.
Target (issue 2): ≤ 2 s per policy.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from scheduler.settings import POLICY_NAMES, Settings
from sim.engine import Simulator
from sim.traces import load_trace

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TRACE = REPO / "traces" / "azure2023" / "AzureLLMInferenceTrace_conv.csv"
# The comparison in seed 000 gives size-based baselines perfect predictions.
ORACLE = {"sjf", "srpt", "tie"}


def settings_for(policy: str) -> Settings:
    return Settings.model_validate(
        {"policy": policy, "params": {"predictor": "oracle"} if policy in ORACLE else {}}
    )


def replay(trace, policy: str, event_skipping: bool = True):
    sim = Simulator(trace, settings_for(policy), event_skipping=event_skipping)
    t0 = time.perf_counter()
    res = sim.run()
    return time.perf_counter() - t0, res


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--trace", default=str(DEFAULT_TRACE))
    ap.add_argument("--policies", default=",".join(POLICY_NAMES))
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--step-by-step-policies", default="fcfs,uniboost")
    args = ap.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one core
    trace = load_trace(args.trace)
    print(
        f"trace {trace.name}: {len(trace)} requests over {trace.duration:.0f} s "
        f"({trace.rate:.2f} req/s)"
    )
    print(
        f"{'policy':>10} {'wall_s':>7} {'req/s':>9} {'steps':>8} {'events':>7} {'preempt':>8} "
        f"{'ttlt_p99':>9}"
    )
    fast: dict[str, float] = {}
    for policy in args.policies.split(","):
        best, res = min((replay(trace, policy) for _ in range(args.repeat)), key=lambda x: x[0])
        fast[policy] = best
        m = res.metrics()
        print(
            f"{policy:>10} {best:7.2f} {len(trace) / best:9.0f} {res.steps:8d} {res.iterations:7d} "
            f"{res.preemptions:8d} {m['ttlt_p99']:9.2f}"
        )
    print(f"worst policy: {max(fast, key=fast.get)} at {max(fast.values()):.2f} s (target <= 2 s)")
    for policy in filter(None, args.step_by_step_policies.split(",")):
        slow, res = replay(trace, policy, event_skipping=False)
        print(
            f"step-by-step {policy}: {slow:.2f} s for {res.steps} steps; event skipping is "
            f"{slow / fast.get(policy, replay(trace, policy)[0]):.1f}x faster"
        )


if __name__ == "__main__":
    main()

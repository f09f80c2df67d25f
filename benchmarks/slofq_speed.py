"""How fast the simulator replays slofq against vtc (issue 23: within 2×), on the two
noisy-neighbour scenarios of ``benchmarks/noisy_neighbour.py``.

    python benchmarks/slofq_speed.py [--repeats 3] [--json OUT]

Per scenario and policy: the best of ``repeats`` replays, in CPU seconds of this process
(``time.process_time``: other processes on a shared machine slow the wall clock more than this)
and in wall seconds, with the simulator's iterations; then slofq / vtc. Replays alternate
between the policies so that a change in the machine's load hits both alike. The load average
is printed before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.noisy_neighbour import heavy_tenant
from scheduler.settings import Settings
from sim.engine import EngineConfig, Simulator
from sim.noisy import capacity, noisy_neighbour

POLICIES = ("vtc", "slofq")


def replay(trace, params: dict, policy: str) -> dict:
    """One replay: CPU and wall seconds, iterations, output tokens/s."""
    doc = {"policy": policy, "params": params if policy == "slofq" else {}}
    sim = Simulator(trace, Settings.model_validate(doc), EngineConfig())
    cpu0, wall0 = time.process_time(), time.perf_counter()
    res = sim.run()
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    end = max(c.finished_at for c in res.completions)
    return {
        "cpu_s": cpu,
        "wall_s": wall,
        "iterations": sim.iterations,
        "out_tok_s": sum(c.output_tokens for c in res.completions) / end,
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    cap = capacity(EngineConfig(), Settings(), seed=3)
    scenarios = {
        "heavy tenant (3 quiet + 1 at 10x, load 1.0, 180 s)": heavy_tenant(
            capacity_req_s=cap, seed=1
        ),
        "noisy neighbour (README: burst 10x, 240 s)": noisy_neighbour(capacity_req_s=cap, seed=3),
    }
    out = {}
    print(
        f"\n{'scenario':<52} {'policy':<6} {'CPU s':>6} {'wall s':>7} {'iterations':>10} "
        f"{'out tok/s':>9}"
    )
    for name, (trace, params) in scenarios.items():
        runs: dict[str, list[dict]] = {p: [] for p in POLICIES}
        for _ in range(args.repeats):
            for policy in POLICIES:
                runs[policy].append(replay(trace, params, policy))
        best = {
            p: {
                "cpu_s": min(r["cpu_s"] for r in rs),
                "wall_s": min(r["wall_s"] for r in rs),
                "iterations": rs[0]["iterations"],
                "out_tok_s": rs[0]["out_tok_s"],
            }
            for p, rs in runs.items()
        }
        for p in POLICIES:
            b = best[p]
            print(
                f"{name:<52} {p:<6} {b['cpu_s']:>6.2f} {b['wall_s']:>7.2f} {b['iterations']:>10} "
                f"{b['out_tok_s']:>9.0f}"
            )
        ratio_cpu = best["slofq"]["cpu_s"] / best["vtc"]["cpu_s"]
        ratio_wall = best["slofq"]["wall_s"] / best["vtc"]["wall_s"]
        print(f"{name:<52} slofq/vtc: {ratio_cpu:.2f}x CPU, {ratio_wall:.2f}x wall")
        out[name] = {
            "best": best,
            "ratio_cpu": ratio_cpu,
            "ratio_wall": ratio_wall,
            "requests": len(trace),
        }
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

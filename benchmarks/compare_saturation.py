"""`tailpilot compare` on the whole Azure conv trace, scaled until FCFS runs near saturation.

    python benchmarks/compare_saturation.py [--trace PATH] [--scales 0.8,0.9,1.0,1.1,1.2] [--at 1.1]

First a sweep of FCFS over rate scales (offered vs served rate, P99 TTFT/TTLT) shows where it
saturates; then every policy runs at the chosen scale and the Table-2-style comparison against
srpt (perfect predictions) is printed, positive = better.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from scheduler.settings import Settings
from sim.engine import simulate
from sim.traces import load_trace, scale_rate

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TRACE = REPO / "traces" / "azure2023" / "AzureLLMInferenceTrace_conv.csv"


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--trace", default=str(DEFAULT_TRACE))
    ap.add_argument("--scales", default="0.8,0.9,1.0,1.1,1.2,1.3")
    ap.add_argument("--at", type=float, default=1.1, help="rate scale for the comparison")
    ap.add_argument("--policies", default="fcfs,sarathi,sjf,srpt,las,uniboost,tie")
    args = ap.parse_args()
    trace = load_trace(args.trace)
    print(f"FCFS sweep on {trace.name} ({len(trace)} requests, recorded {trace.rate:.2f} req/s)")
    print(
        f"{'scale':>6} {'offered':>8} {'served':>7} {'ttft_p99':>9} {'ttlt_p50':>9} {'ttlt_p99':>9}"
    )
    fcfs = Settings(policy="fcfs")
    for scale in (float(x) for x in args.scales.split(",")):
        t = scale_rate(trace, scale)
        m = simulate(t, fcfs).metrics()
        print(
            f"{scale:6.2f} {t.rate:8.2f} {m['throughput_req_s']:7.2f} {m['ttft_p99']:9.2f} "
            f"{m['ttlt_p50']:9.2f} {m['ttlt_p99']:9.2f}"
        )
    print(f"\ncomparison at rate scale {args.at} ({trace.rate * args.at:.2f} req/s):", flush=True)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "tailpilot.cli",
            "compare",
            "--trace",
            args.trace,
            "--rate-scale",
            str(args.at),
            "--policy",
            args.policies,
            "--baseline",
            "srpt",
            "--jobs",
            "2",
            "--no-progress",
        ],
        check=True,
    )


if __name__ == "__main__":
    main()

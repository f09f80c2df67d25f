"""How late may a switch come on the shape shift? An oracle's bound for issue 32's phase target.

    python benchmarks/shift_late_switch.py [--traces traces] [--lags 0,1,2,3,5,10,13]

The ``shift`` workload (benchmarks/autopilot_workloads.py) serves chat, then long prompts, then
reasoning, 20 minutes each. In the reasoning phase the best fixed setting is a small γ; the issue
asks the autopilot to come within 10% of it on that phase's P95 TTFT. This replays the whole
trace on the long-prompt phase's best fixed setting and switches to the reasoning phase's best
fixed setting ``lag`` minutes after the reasoning phase's first arrival — an oracle that knows
both winners and when the shape changes — and prints the reasoning phase's P95 TTFT against that
fixed setting's. A controller that sees only the past needs some of the new shape's requests (and
their latencies under each candidate) before it can know; the lag at which even the oracle misses
the target bounds what any such controller can reach. Then a few whole schedules (γ and the
time each starts) beside the autopilot's own — what ran before the switch matters too.
Deterministic; ~30 s.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Run as a script: the repository root goes on sys.path before the project's imports (E402).
REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.autopilot import DEFAULT_TRACES, build, fixed, replay_switched  # noqa: E402
from benchmarks.autopilot_scoring import PHASE_MARGIN, PHASE_PREFIX, half_time, score  # noqa: E402
from benchmarks.seed_claims import KNEE  # noqa: E402

BEFORE_GAMMA = 0.5  # the long-prompt phase's best fixed setting (README, "The autopilot")
AFTER_GAMMA = 0.01  # the reasoning phase's


# Whole schedules, (start time s, γ) in order: the autopilot's on ``shift`` from minute 21
# (README: γ 1 through the long-prompt phase, γ 0.215 from minute 41, γ 0.001 from minute 50;
# before, γ-Ada and γ 10) and its parts changed one at a time.
SCHEDULES: dict[str, list[tuple[float, float]]] = {
    "γ 0.5, γ 0.01 at minute 50": [(0.0, 0.5), (3_000.0, 0.01)],
    "γ 0.5, γ 0.001 at minute 50": [(0.0, 0.5), (3_000.0, 0.001)],
    "γ 0.215, γ 0.001 at minute 50": [(0.0, 0.215), (3_000.0, 0.001)],
    "γ 1, γ 0.215 at 41, γ 0.01 at 50": [(0.0, 1.0), (2_460.0, 0.215), (3_000.0, 0.01)],
    "γ 1, γ 0.215 at 41, γ 0.001 at 50 (the autopilot's from minute 21)": [
        (0.0, 1.0),
        (2_460.0, 0.215),
        (3_000.0, 0.001),
    ],
}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--traces", type=Path, default=DEFAULT_TRACES)
    ap.add_argument("--lags", default="0,1,2,3,5,10,13", help="minutes after the change")
    args = ap.parse_args()
    _, trace, _ = build(("shift", args.traces, 0, KNEE))
    change = min(r.arrival for r in trace if r.id.startswith("reasoning"))
    phase = PHASE_PREFIX + "reasoning"

    def p95_of(schedule: list[tuple[float, float]]) -> float:
        on_gamma = [(start, fixed(gamma)) for start, gamma in schedule]
        return score(replay_switched(trace, on_gamma), half_time(trace), phases=True)[phase][
            "ttft_p95"
        ]

    def p95(gamma: float, switch_at: float | None = None) -> float:
        return p95_of([(0.0, gamma)] + ([] if switch_at is None else [(switch_at, AFTER_GAMMA)]))

    best = p95(AFTER_GAMMA)
    print(
        f"reasoning phase from t={change:.0f} s; its best fixed setting γ {AFTER_GAMMA:g}: "
        f"P95 TTFT {best:.2f} s (target: within {PHASE_MARGIN:.2f}x)"
    )
    never = p95(BEFORE_GAMMA)
    print(f"never switched (γ {BEFORE_GAMMA:g} throughout): {never:.2f} s = {never / best:.2f}x")
    header = f"switch to γ {AFTER_GAMMA:g}, minutes after the change"
    print(f"\n| {header} | reasoning P95 TTFT | vs its best fixed |")
    print("|---|---|---|")
    for lag in (float(x) for x in args.lags.split(",")):
        value = p95(BEFORE_GAMMA, change + 60.0 * lag)
        print(f"| {lag:g} | {value:.2f} s | {value / best:.2f}x |")
    print("\n| schedule | reasoning P95 TTFT | vs its best fixed |")
    print("|---|---|---|")
    for name, schedule in SCHEDULES.items():
        value = p95_of(schedule)
        print(f"| {name} | {value:.2f} s | {value / best:.2f}x |")


if __name__ == "__main__":
    main()

"""Where the defaults' own breaks on BWB traffic come from: work recomputed after preemptions.

    python benchmarks/kv_waste.py [--variants 1618:3,1618:19,1618:34,8080:16,8080:8]

Most promises the autopilot broke on the sweep (``benchmarks/autopilot_sweep.py``) were the
defaults' own, and most of those on BWB's long outputs above capacity, where preemptions throw
away a third of the tokens served. This replays sweep variants (``SEED:K``: variant K of the
sweep's master seed SEED, rebuilt exactly) under sarathi, the defaults and the settings that
change how the KV cache is shared — a KV victim waiting by its score instead of going first
(``victims_first`` off: it then finds less of its prefix in vLLM's prefix cache), the memory
victim by score instead of the newest decode, decode-first off, MemGuard off, an FCFS-like γ —
and prints for each the KV preemptions, the prompt tokens recomputed after them (share of all the
tokens served), and every quantile and the throughput against sarathi's on the whole run (the
sweep's scoring). The engine models vLLM's prefix cache (docs/engine.md#prefix-cache).
Deterministic; ~1.5 minutes a variant on one core.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.autopilot_scoring import METRICS, half_time, score  # noqa: E402
from benchmarks.autopilot_sweep import SHORT, broken_of, build, pools  # noqa: E402
from scheduler.settings import Settings  # noqa: E402
from sim.engine import simulate  # noqa: E402

SETTINGS: dict[str, dict] = {
    "sarathi": {"policy": "sarathi"},
    "defaults": {"policy": "uniboost"},
    "victims first off": {"policy": "uniboost", "params": {"victims_first": False}},
    "victim by score": {"policy": "uniboost", "params": {"kv_victim": "score"}},
    "decode-first off": {"policy": "uniboost", "params": {"decode_first": False}},
    "MemGuard off": {"policy": "uniboost", "params": {"memguard": False}},
    "gamma=10": {"policy": "uniboost", "params": {"gamma_ada": False, "gamma": 10.0}},
}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--variants", default="1618:3,1618:19,1618:34,8080:16,8080:8")
    ap.add_argument("--traces", type=Path, default=REPO / "traces")
    args = ap.parse_args()
    rows = pools(args.traces)
    for spec in args.variants.split(","):
        seed, k = (int(x) for x in spec.split(":"))
        trace, how = build(k, seed, rows)
        print(f"seed {seed} variant {k}: {how} ({len(trace)} requests)")
        half, reference = half_time(trace), None
        for name, doc in SETTINGS.items():
            result = simulate(trace, Settings.model_validate(doc))
            served = sum(c.prompt_tokens + c.output_tokens for c in result.completions)
            recomputed = sum(c.recomputed_tokens for c in result.completions)
            figures = score(result.completions, half)["all"]
            reference = reference or figures
            ratios = " ".join(f"{SHORT[m]} {figures[m] / reference[m]:.3f}" for m in METRICS)
            broke = ",".join(SHORT[m] for m in broken_of(figures, reference)) or "none"
            print(
                f"  {name:18s} preemptions {result.preemptions:6d}  recomputed {recomputed:9d} "
                f"({recomputed / served:6.2%} of the tokens served) | {ratios} | breaks {broke}"
            )


if __name__ == "__main__":
    main()

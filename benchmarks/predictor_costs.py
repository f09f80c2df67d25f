"""What length prediction costs: the history predictor's refit, and TIE's per-request moments.

    python benchmarks/predictor_costs.py [--keys 100] [--samples 2000] [--rounds 5]

Refit: the log-t maximum-likelihood fits of every key, as the plugin's background refit thread runs
them (never inside a scheduling step).
Fills a ``HistoryPredictor`` with ``--samples`` observed lengths for each of ``--keys`` fine keys
(tenant x type x prompt bucket; their coarser (tenant, type), (tenant,) and global keys are fitted
too) and prints the median and worst wall time of ``refit()`` over ``--rounds``. Target: < 1 s for
100 keys x 2,000 samples, so a refit every few seconds costs the replica little.

TIE moments: one scalar ``tie_moments`` call (the quadrature E and CVaR of a request's remaining
length), as TIE computes it when a request's prediction changes; mean over 2,000 calls.
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import numpy as np

from scheduler.policies.predictors import HistoryPredictor
from scheduler.policies.tie_math import tie_moments


def filled_predictor(keys: int, samples: int, seed: int = 9) -> HistoryPredictor:
    rng = np.random.default_rng(seed)
    h = HistoryPredictor(window=max(5000, samples))
    for k in range(keys):
        r = SimpleNamespace(
            id=f"r{k}",
            tenant=f"t{k // 10}",
            type=("chat", "batch")[k % 2],
            prompt_tokens=2 ** (3 + (k % 10) // 2),
            max_tokens=1_000_000,
            output_tokens=None,
            generated=0,
        )
        logs = rng.uniform(2, 7) + rng.uniform(0.2, 1.5) * rng.standard_t(3.5, samples)
        for n in np.exp(logs):
            h.observe(r, max(int(n), 1))
    return h


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", type=int, default=100)
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    h = filled_predictor(args.keys, args.samples)
    times, fitted = [], 0
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        fitted = h.refit()
        times.append(time.perf_counter() - t0)
    print(
        f"refit of {fitted} keys ({args.keys} fine keys x {args.samples} samples): "
        f"median {statistics.median(times) * 1000:.0f} ms, worst {max(times) * 1000:.0f} ms "
        f"over {args.rounds} rounds (target < 1000 ms)"
    )
    tie_moments(4.0, 0.8, 4096, 0.9)  # warm caches
    n = 2000
    t0 = time.perf_counter()
    for i in range(n):
        tie_moments(2.0 + 0.003 * i, 0.8, 4096, 0.9)
    print(f"tie_moments: {(time.perf_counter() - t0) / n * 1e6:.1f} us per call")


if __name__ == "__main__":
    main()

"""Store ingest speed: batched writes of completion rows and sample rows through
``RecordingRepository.write``.

    python benchmarks/storage_ingest.py [--rows 200000] [--batch 5000] [--samples 50000] [--url URL]

Writes ``--rows`` completions in batches of ``--batch`` (each batch one transaction, as the
collector flushes), then ``--samples`` sample rows (with their per-tenant group samples: three per
sample) the same way, into a fresh SQLite file in a temporary directory (or the store at
``--url``: use an empty database), and prints rows/s for each. Row objects are built before the
clock starts: this measures the store, not the row factory. Target (issue 4): >= 50,000
completion rows/s on SQLite.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from storage import Batch, CompletionRow, GroupSampleRow, LatencyPercentiles, SampleRow, Store

REPLICAS = [f"r{i}" for i in range(4)]
TENANTS = ("a", "b", "c")


def completion_batches(rows: int, batch: int) -> list[Batch]:
    out = []
    for start in range(0, rows, batch):
        comps = [
            CompletionRow(
                replica=REPLICAS[i % len(REPLICAS)],
                request_id=f"req-{i}",
                tenant=TENANTS[i % 3],
                type="chat",
                arrival_s=i * 0.01,
                first_token_s=i * 0.01 + 0.2,
                finished_s=i * 0.01 + 3.0,
                prompt_tokens=500 + i % 300,
                output_tokens=100 + i % 700,
                preemptions=i % 2,
            )
            for i in range(start, min(start + batch, rows))
        ]
        cursors = {r: start + batch for r in REPLICAS}
        out.append(Batch(completions=comps, cursors=cursors))
    return out


def sample_batches(rows: int, batch: int) -> list[Batch]:
    lat = LatencyPercentiles(*(0.1 * (k + 1) for k in range(12)))
    out = []
    for start in range(0, rows, batch):
        samples, groups = [], []
        for i in range(start, min(start + batch, rows)):
            replica = REPLICAS[i % len(REPLICAS)]
            t_ms = 1_700_000_000_000 + (i // len(REPLICAS)) * 1000
            samples.append(
                SampleRow(
                    replica=replica,
                    t_ms=t_ms,
                    healthy=True,
                    policy="uniboost",
                    settings_version=3,
                    waiting=i % 50,
                    running=32,
                    kv_usage=0.7,
                    kv_used_blocks=700,
                    kv_total_blocks=1000,
                    gamma_live=8.0,
                    beta_live=0.5,
                    throughput_tok_s=2500.0,
                    throughput_req_s=10.0,
                    preemptions_per_s=0.1,
                    latency=lat,
                )
            )
            groups += [
                GroupSampleRow(
                    replica=replica,
                    t_ms=t_ms,
                    kind="tenant",
                    group=g,
                    completed=5,
                    throughput_tok_s=800.0,
                    latency=lat,
                )
                for g in TENANTS
            ]
        out.append(Batch(samples=samples, group_samples=groups))
    return out


def timed_writes(store: Store, batches: list[Batch]) -> float:
    t0 = time.perf_counter()
    for b in batches:
        store.recordings.write("bench", b)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rows", type=int, default=200_000, help="completion rows")
    ap.add_argument(
        "--batch", type=int, default=5_000, help="rows per batch (one transaction each)"
    )
    ap.add_argument(
        "--samples", type=int, default=50_000, help="sample rows (plus 3 group samples each)"
    )
    ap.add_argument(
        "--url", default=None, help="store URL (default: a fresh SQLite file in a temp dir)"
    )
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        url = args.url or str(Path(tmp) / "bench.db")
        store = Store.open(url)
        store.recordings.ensure_replicas(
            "bench", [(r, f"http://{r}:8000", f"http://{r}:8001") for r in REPLICAS]
        )
        comps = completion_batches(args.rows, args.batch)
        secs = timed_writes(store, comps)
        print(
            f"completions: {args.rows:,} rows in {len(comps)} batches of {args.batch:,}: "
            f"{secs:.2f} s, {args.rows / secs:,.0f} rows/s"
        )
        secs = timed_writes(store, comps[: max(1, len(comps) // 10)])
        dup = sum(len(b.completions) for b in comps[: max(1, len(comps) // 10)])
        print(f"completions re-delivered (all duplicates): {dup:,} rows: {dup / secs:,.0f} rows/s")
        samples = sample_batches(args.samples, args.batch)
        secs = timed_writes(store, samples)
        total = sum(len(b) for b in samples)
        print(
            f"samples: {args.samples:,} sample rows (+{total - args.samples:,} group rows) "
            f"in {secs:.2f} s: "
            f"{args.samples / secs:,.0f} sample rows/s, {total / secs:,.0f} rows/s all told"
        )
        assert len(store.readings.completions("bench")) == args.rows, (
            "a completion was lost or duplicated"
        )
        store.close()


if __name__ == "__main__":
    main()

"""The collector's CPU cost: N twin replicas polled every second, rows written to SQLite.

    python benchmarks/collector_cpu.py [--replicas 64] [--interval 1] [--duration 60] [--warmup 5]
                                       [--rate-scale 16] [--speed 1] [--loop uvloop|asyncio]
                                       [--metrics-every 1] [--db URL]

The twins run in a separate process (``tuner.twins.cluster.start_twins``), so the CPU measured here
— ``time.process_time()`` of this process, every thread included (the store writes on a worker
thread) — is the collector's alone: HTTP polls of ``/tailpilot/v1/state`` and ``/metrics``,
parsing, the windowed percentiles per replica, tenant and type, and the batched store writes, as
``tailpilot record`` runs them. Measured over ``--duration`` seconds after ``--warmup`` seconds
(the first polls read each twin's backlog). Prints CPU as % of one core (target < 25 % for 64
replicas at 1 s), rows written per second, polls per second and failed polls.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

# Run as a script: the repository root goes on sys.path before the project's imports (E402).
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from controlplane.cluster import load_cluster_file  # noqa: E402
from controlplane.collector import Collector  # noqa: E402
from storage.store import Store  # noqa: E402

TWINS_SCRIPT = textwrap.dedent("""\
    import signal, sys, threading
    from sim import traces
    from tuner.twins.cluster import start_twins
    n, speed = int(sys.argv[1]), float(sys.argv[2])
    rate_scale, out = float(sys.argv[3]), sys.argv[4]
    trace = traces.assign_tenants_zipf(traces.load_bundled(), 4, seed=1)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    with start_twins(n, trace, speed=speed, rate_scale=rate_scale, token="bench") as cluster:
        cluster.write_cluster_yaml(out, "bench")
        print("ready", flush=True)
        done.wait()
""")


def start_twins_process(
    n: int, speed: float, rate_scale: float, cluster_file: Path
) -> subprocess.Popen:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            TWINS_SCRIPT,
            str(n),
            str(speed),
            str(rate_scale),
            str(cluster_file),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline()
    if line.strip() != "ready":
        proc.kill()
        raise SystemExit(f"the twins did not start (exit {proc.poll()})")
    return proc


async def measure(cluster, store, warmup: float, duration: float, metrics_every: int = 1) -> dict:
    collector = Collector(cluster, store, flush_interval_s=1.0, metrics_every=metrics_every)
    stop = asyncio.Event()
    task = asyncio.create_task(collector.run(stop))
    await asyncio.sleep(warmup)
    s0, cpu0, t0 = _counts(collector), time.process_time(), time.monotonic()
    await asyncio.sleep(duration)
    s1, cpu1, t1 = _counts(collector), time.process_time(), time.monotonic()
    stop.set()
    await task
    wall = t1 - t0
    delta = {k: s1[k] - s0[k] for k in s0}
    healthy = sum(v.health.healthy for v in collector.views.values())
    return {
        "wall_s": wall,
        "cpu_s": cpu1 - cpu0,
        "cpu_pct_one_core": 100 * (cpu1 - cpu0) / wall,
        "polls_per_s": delta["polls"] / wall,
        "failed_polls": delta["failed_polls"],
        "rows_per_s": delta["rows_written"] / wall,
        "completions_per_s": delta["completions_written"] / wall,
        "samples_per_s": delta["samples_written"] / wall,
        "batches": delta["batches"],
        "busy_retries": delta["busy_retries"],
        "healthy_at_end": healthy,
    }


def _counts(collector) -> dict:
    s = collector.stats
    return {
        "polls": s.polls,
        "failed_polls": s.failed_polls,
        "rows_written": s.rows_written,
        "completions_written": s.completions_written,
        "samples_written": s.samples_written,
        "batches": s.batches,
        "busy_retries": s.busy_retries,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--replicas", type=int, default=64)
    parser.add_argument("--interval", type=float, default=1.0, help="poll interval, s")
    parser.add_argument("--duration", type=float, default=60.0, help="measured seconds")
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument(
        "--rate-scale",
        type=float,
        default=16.0,
        help="arrival rate multiplier of the bundled trace (~4.8 req/s) for the whole cluster",
    )
    parser.add_argument("--speed", type=float, default=1.0, help="twin clock speed")
    parser.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    parser.add_argument(
        "--metrics-every",
        type=int,
        default=1,
        help="read /metrics every N polls (the replicas have the plugin; default 1)",
    )
    parser.add_argument("--db", help="store URL (default: a fresh SQLite file in a temp dir)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        cluster_file = Path(tmp) / "bench.yaml"
        twins = start_twins_process(args.replicas, args.speed, args.rate_scale, cluster_file)
        try:
            spec = load_cluster_file(cluster_file).cluster()
            cluster = spec.model_copy(update={"poll_interval_s": args.interval})
            store = Store.open(args.db or str(Path(tmp) / "bench.db"))
            if args.loop == "uvloop":
                import uvloop  # optional: only for --loop uvloop

                runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
            else:
                runner = asyncio.Runner()
            with runner:
                r = runner.run(
                    measure(cluster, store, args.warmup, args.duration, args.metrics_every)
                )
            store.close()
        finally:
            twins.terminate()
            twins.wait(timeout=30)
    print(
        f"collector: {args.replicas} replicas every {args.interval:g} s "
        f"(/metrics every {args.metrics_every}), "
        f"{args.loop}, {os.cpu_count()} CPUs, "
        f"measured {r['wall_s']:.1f} s after {args.warmup:g} s warm-up"
    )
    print(
        f"  CPU            {r['cpu_pct_one_core']:6.1f} % of one core ({r['cpu_s']:.2f} s)"
        "   target < 25 %"
    )
    print(
        f"  polls          {r['polls_per_s']:6.1f} /s  "
        f"({r['failed_polls']} failed; {r['healthy_at_end']} healthy at end)"
    )
    print(
        f"  rows written   {r['rows_per_s']:6.1f} /s  (completions {r['completions_per_s']:.1f}/s, "
        f"samples {r['samples_per_s']:.1f}/s, {r['batches']} batches, "
        f"{r['busy_retries']} busy retries)"
    )


if __name__ == "__main__":
    main()

"""What the live autopilot costs a cluster: one controller per replica, or one per pool.

    python benchmarks/autopilot_pools.py [--replicas 64] [--minutes 10] [--rate-scale 1.0]

``--replicas`` twins (simulated replicas with the plugin's control API, on loopback) serve the
bundled Azure conv window round-robin, its rate × ``--rate-scale`` (default: the number of
replicas, so each replica sees the window's own rate); a collector polls them and
the live autopilot (armed, the default configuration: every candidate knob, the search) steps
every 6 s of replica time, on a manual clock — the measurement is CPU, not the machine's speed.
Run twice on the same traffic: without ``pool`` in the cluster file (a controller, and its
shadows, per replica), then with every replica in one pool (one controller whose choice every
member runs). Prints the controllers' CPU seconds (their decisions' ``cpu_s``: observing, the
shadows' replays, projections and stress tests) per hour of traffic, per replica and in all, and
the ratio. The twins' own simulation and the HTTP polling are not the controller's and are not
counted.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

import yaml

# Run as a script: the repository root goes on sys.path before the project's imports (E402).
REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from controlplane.cluster import parse_cluster_file  # noqa: E402
from controlplane.collector import Collector  # noqa: E402
from controlplane.replica_http import PollingClient  # noqa: E402
from scheduler.settings import Settings  # noqa: E402
from sim.traces import load_bundled  # noqa: E402
from storage.store import Store  # noqa: E402
from tuner.autopilot.controller import AutopilotConfig  # noqa: E402
from tuner.autopilot.live import LiveAutopilot, LiveConfig  # noqa: E402
from tuner.twins.cluster import start_twins  # noqa: E402
from tuner.twins.replica import ManualClock, drive_on_manual_clock  # noqa: E402

TOKEN = "pools-benchmark"


def run(replicas: int, minutes: float, rate_scale: float, pooled: bool) -> dict[str, float]:
    """One run: the controllers' CPU seconds per hour of traffic (all, per replica), the
    number of controllers and of shadows running at the end, and the wall time."""
    os.environ["TAILPILOT_TOKEN"] = TOKEN
    clock = ManualClock()
    with tempfile.TemporaryDirectory() as tmp:
        store = Store.open(str(Path(tmp) / "pools.db"), clock=clock.now)
        twins = start_twins(
            replicas,
            load_bundled(),
            rate_scale=rate_scale,
            clock=clock,
            settings=Settings.model_validate({"policy": "uniboost"}),
            token=TOKEN,
        )
        doc = twins.cluster_doc("twins")
        if pooled:
            for replica in doc["clusters"][0]["replicas"]:
                replica["pool"] = "chat"
        cluster = parse_cluster_file(yaml.safe_dump(doc)).cluster()
        store.governance.set_control("autopilot", "twins", state="armed", who="benchmark")
        started = time.perf_counter()

        async def scenario() -> LiveAutopilot:
            client = PollingClient(cluster.timeout_s)
            collector = Collector(cluster, store, client=client, clock=clock.now)
            driver = LiveAutopilot(
                collector, store, AutopilotConfig(), LiveConfig(), clock=clock.now
            )
            collector.on_poll(driver.on_poll)
            try:
                end = clock.t + minutes * 60.0
                await drive_on_manual_clock(clock, twins, collector, driver, client, t_end=end)
                return driver
            finally:
                await client.aclose()

        try:
            driver = asyncio.run(scenario())
        finally:
            twins.stop()
            store.close()
    pilots = {id(rp.pilot): rp.pilot for rp in driver.pilots.values()}
    cpu = sum(d.cpu_s for p in pilots.values() for d in p.decisions)
    hours = minutes / 60.0
    return {
        "controllers": len(pilots),
        "shadows": sum(len(p.shadows) for p in pilots.values()),
        "cpu_per_hour": cpu / hours,
        "cpu_per_hour_per_replica": cpu / hours / replicas,
        "wall_s": time.perf_counter() - started,
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--replicas", type=int, default=64)
    ap.add_argument("--minutes", type=float, default=10.0, help="replica time to run")
    ap.add_argument(
        "--rate-scale",
        type=float,
        default=None,
        help="the trace's rate multiplier; it is split round-robin across the replicas "
        "[default: the number of replicas: each replica at the trace's recorded rate]",
    )
    args = ap.parse_args()
    if args.rate_scale is None:
        args.rate_scale = float(args.replicas)
    if args.replicas < 1 or args.minutes <= 0 or args.rate_scale <= 0:
        raise SystemExit("--replicas, --minutes and --rate-scale must be positive")
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    results = {}
    for pooled in (False, True):
        label = "one pool" if pooled else "per replica"
        r = run(args.replicas, args.minutes, args.rate_scale, pooled)
        results[label] = r
        print(
            f"{label:>11}: {r['controllers']:.0f} controllers, {r['shadows']:.0f} shadows, "
            f"controller CPU {r['cpu_per_hour']:.1f} s per hour of traffic "
            f"({r['cpu_per_hour_per_replica']:.2f} s per replica, "
            f"{100 * r['cpu_per_hour_per_replica'] / 3600:.3f}% of a core per replica); "
            f"{r['wall_s']:.0f} s wall"
        )
    ratio = results["per replica"]["cpu_per_hour"] / max(results["one pool"]["cpu_per_hour"], 1e-9)
    print(f"{args.replicas} replicas: one pool costs 1/{ratio:.1f} of a controller per replica")


if __name__ == "__main__":
    main()

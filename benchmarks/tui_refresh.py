"""How long one refresh of the TUI's cluster screen takes, and how responsive keys stay meanwhile.

    python benchmarks/tui_refresh.py [--replicas 64] [--refreshes 60] [--interval 1.0] [--json]
    python benchmarks/tui_refresh.py --twins 16 --refreshes 30     # real twins + collector instead

Default: synthetic snapshots of ``--replicas`` replicas, every cell of every row changing at each
refresh (the worst case for in-place updates), fed through the app's own path — a DataSource
whose ``next_snapshot()`` the app's pump awaits, exactly as it awaits the collector's queue.
``--twins N`` uses N twin replicas polled by the real collector instead (CPU-heavy: the twins
simulate in this process).

Refresh time = from the moment the app takes a snapshot until the screen has been refreshed
with it (``apply_snapshot`` + the compositor's next refresh, via ``call_after_refresh``).
Key latency = a cursor key (down/up) posted to the app at a random moment between refreshes until
the cursor has moved and the screen has been refreshed with it, measured while refreshes continue.
Headless (no terminal I/O), terminal 200x70.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from textual import events

from controlplane.cluster import ClusterSpec, ReplicaSpec
from controlplane.snapshot import ClusterSnapshot, Health, ReplicaSnapshot
from storage.rows import GroupSampleRow, LatencyPercentiles, SampleRow
from tui.app import TailpilotApp
from tui.sources import LiveSource
from tuner.twins.cluster import start_twins


class SyntheticSource:
    """A DataSource of random snapshots, one every ``interval`` seconds."""

    mode = "live"
    readonly = True  # nothing to change
    history_s = 600.0

    def __init__(self, n: int, interval: float, seed: int = 0) -> None:
        self.names = [f"replica-{i:03d}" for i in range(n)]
        self.cluster_name = "bench"
        self.interval = interval
        self.rng = random.Random(seed)
        self.histories: dict[str, list[SampleRow]] = {n: [] for n in self.names}
        self._latest: ClusterSnapshot | None = None
        self._first = True

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def _row(self, name: str, t_ms: int) -> SampleRow:
        r = self.rng
        base = r.uniform(0.05, 0.5)
        lat = LatencyPercentiles(
            ttft_p50=base,
            ttft_p90=base * 2,
            ttft_p95=base * 3,
            ttft_p99=base * r.uniform(4, 9),
            ttlt_p50=base * 20,
            ttlt_p90=base * 40,
            ttlt_p95=base * 50,
            ttlt_p99=base * r.uniform(60, 120),
            tbt_p50=0.02,
            tbt_p90=0.03,
            tbt_p95=0.04,
            tbt_p99=0.05,
        )
        healthy = r.random() > 0.02
        return SampleRow(
            replica=name,
            t_ms=t_ms,
            healthy=healthy,
            reason=None if healthy else "state: timeout after 2 s",
            policy=r.choice(("uniboost", "sarathi", "tie")),
            settings_version=r.randint(1, 9),
            waiting=r.randint(0, 200),
            running=r.randint(0, 128),
            kv_usage=r.random(),
            kv_used_blocks=r.randint(0, 25_000),
            kv_total_blocks=25_000,
            gamma_live=r.uniform(1, 200),
            throughput_tok_s=r.uniform(100, 3000),
            throughput_req_s=r.uniform(1, 30),
            preemptions_per_s=r.uniform(0, 3),
            latency=lat,
        )

    async def next_snapshot(self) -> ClusterSnapshot:
        if not self._first:
            await asyncio.sleep(self.interval)
        self._first = False
        t_ms = int(time.time() * 1000)
        reps = {}
        for name in self.names:
            row = self._row(name, t_ms)
            self.histories[name].append(row)
            groups = [
                GroupSampleRow(
                    name, t_ms, "tenant", f"t{i}", 10 * (i + 1), 100.0 * (i + 1), row.latency
                )
                for i in range(3)
            ]
            reps[name] = ReplicaSnapshot(
                name=name,
                health=Health(healthy=row.healthy, reason=row.reason),
                sample=row,
                groups=groups,
                settings={"policy": row.policy, "params": {}, "pinned": ["gamma"]},
                settings_version=row.settings_version,
                state=None,
                metrics={},
                cursor=0,
                window_completions=60,
            )
        self._latest = ClusterSnapshot("bench", t_ms, reps)
        return self._latest

    def current(self) -> ClusterSnapshot | None:
        return self._latest

    def history(self, replica: str, until_ms: int | None = None) -> list[SampleRow]:
        return self.histories.get(replica, [])[-600:]

    def kv_trail(self, replica: str, n: int) -> list[float]:
        return [r.kv_usage for r in self.histories.get(replica, [])[-n:]]

    async def audit(self, limit: int = 200) -> list[dict]:
        return []

    def status(self) -> str:
        return f"BENCH · {len(self.names)} synthetic replicas every {self.interval:g} s"


def pct(values: list[float], q: float) -> float:
    xs = sorted(values)
    if not xs:
        return float("nan")
    k = min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))
    return xs[k]


async def bench(source, cluster: ClusterSpec | None, refreshes: int, interval: float) -> dict:
    app = TailpilotApp(source, cluster)
    key_ms: list[float] = []
    rng = random.Random(1)
    async with app.run_test(size=(200, 70)) as pilot:
        while app.snapshots_applied < 2:
            await pilot.pause(0.05)
        app.refresh_ms.clear()
        app.apply_ms.clear()
        start = app.snapshots_applied
        direction = "down"
        while app.snapshots_applied - start < refreshes:
            await asyncio.sleep(rng.uniform(0.05, interval * 0.9))
            table = app.query_one("#cluster-table")
            before = table.cursor_row
            shown = asyncio.Event()
            t0 = time.perf_counter()
            app.post_message(events.Key(direction, None))
            while table.cursor_row == before and time.perf_counter() - t0 < 2.0:
                await asyncio.sleep(0.0005)
            app.call_after_refresh(shown.set)
            await shown.wait()
            key_ms.append((time.perf_counter() - t0) * 1000)
            after = table.cursor_row
            if after == before:  # at an end of the table: turn around
                direction = "up" if direction == "down" else "down"
        await pilot.pause(0.2)
        refresh_ms, apply_ms = list(app.refresh_ms), list(app.apply_ms)
    return {
        "replicas": len(source.current().replicas) if source.current() else None,
        "refreshes": len(refresh_ms),
        "refresh_ms_median": statistics.median(refresh_ms),
        "refresh_ms_p99": pct(refresh_ms, 99),
        "refresh_ms_max": max(refresh_ms),
        "apply_ms_median": statistics.median(apply_ms),
        "apply_ms_p99": pct(apply_ms, 99),
        "key_presses": len(key_ms),
        "key_ms_median": statistics.median(key_ms),
        "key_ms_p99": pct(key_ms, 99),
    }


async def with_twins(n: int, refreshes: int, interval: float) -> dict:
    with start_twins(n, speed=1.0, rate_scale=max(1.0, n / 2)) as twins:
        cluster = ClusterSpec(
            name="bench",
            poll_interval_s=interval,
            timeout_s=2.0,
            replicas=[
                ReplicaSpec(name=t.name, api_url=t.url, control_url=t.control_url) for t in twins
            ],
        )
        return await bench(
            LiveSource(cluster, None, refresh_s=interval), cluster, refreshes, interval
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=64)
    p.add_argument("--refreshes", type=int, default=60)
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    p.add_argument(
        "--twins", type=int, default=0, help="use N twin replicas + the collector instead"
    )
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    if a.twins:
        result = asyncio.run(with_twins(a.twins, a.refreshes, a.interval))
        result["source"] = f"{a.twins} twins + collector"
    else:
        result = asyncio.run(
            bench(SyntheticSource(a.replicas, a.interval), None, a.refreshes, a.interval)
        )
        result["source"] = "synthetic snapshots"
    if a.json:
        print(json.dumps(result, indent=2))
        return
    print(
        f"{result['source']}: {result['replicas']} replicas, {result['refreshes']} refreshes, "
        f"every {a.interval:g} s"
    )
    print(
        f"  refresh to screen: median {result['refresh_ms_median']:.1f} ms, "
        f"P99 {result['refresh_ms_p99']:.1f} ms, max {result['refresh_ms_max']:.1f} ms   "
        f"(apply alone: median {result['apply_ms_median']:.1f} ms)"
    )
    print(
        f"  key press while refreshing: median {result['key_ms_median']:.1f} ms, "
        f"P99 {result['key_ms_p99']:.1f} ms over {result['key_presses']} presses"
    )
    ok = result["refresh_ms_median"] <= 50.0
    print(f"  target median ≤ 50 ms: {'met' if ok else 'MISSED'}")


if __name__ == "__main__":
    main()

"""Helpers for tests that drive twins on a manual clock and poll them with a collector."""

from __future__ import annotations

import asyncio
import contextlib


def serve_all(twins, clock, step: float = 2.0, limit: float = 5000.0) -> float:
    """Advance every twin's clock by ``step`` until each has finished its whole trace (or the
    clock reaches ``limit``); returns the clock."""
    t = 0.0
    while any(tw.core.finished_total < len(tw._requests) for tw in twins) and t < limit:
        t += step
        clock.set(t)
        for tw in twins:
            tw.advance(t)
    return t


def poll_all(collector, polls: int = 1) -> None:
    """Poll every replica of the collector's cluster ``polls`` times, with a client of its own."""
    from controlplane.replica_http import make_client

    async def run() -> None:
        collector._client = make_client(collector.cluster)
        try:
            for _ in range(polls):
                for name in collector.views:
                    await collector.poll(name)
        finally:
            await collector._client.aclose()

    asyncio.run(run())


@contextlib.contextmanager
def governed_cluster(tmp_path, token: str = "gov-token"):
    """One twin that served a noisy-neighbour trace under fcfs (the quiet tenants miss their
    targets) and a governed cluster file naming it: yields (path, twin, trace)."""
    import yaml

    from scheduler.settings import Settings
    from sim.engine import EngineConfig
    from sim.noisy import noisy_neighbour
    from tuner.twins.cluster import start_twins
    from tuner.twins.replica import ManualClock

    trace, params = noisy_neighbour(
        capacity_req_s=30.0,
        duration_s=40.0,
        burst_from_s=5.0,
        burst_s=20.0,
        prompt_scale=0.5,
        output_scale=0.5,
    )
    clock = ManualClock()
    with start_twins(
        1,
        trace,
        clock=clock,
        config=EngineConfig(),
        loop=False,
        token=token,
        settings=Settings.model_validate({"policy": "fcfs", "engine": {"max_num_seqs": 32}}),
    ) as twins:
        twin = twins[0]
        serve_all(twins, clock, limit=3000.0)
        doc = twins.cluster_doc("gov")
        doc["clusters"][0].update(
            poll_interval_s=0.1,
            timeout_s=2.0,
            window_s=3600.0,
            governance={"tenants": params["tenants"]},
        )
        path = tmp_path / "gov.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        yield path, twin, trace

"""Helpers for tests that drive twins on a manual clock and poll them with a collector."""

from __future__ import annotations

import asyncio


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
    from controlplane.collector import make_client

    async def run() -> None:
        collector._client = make_client(collector.cluster)
        try:
            for _ in range(polls):
                for name in collector.views:
                    await collector.poll(name)
        finally:
            await collector._client.aclose()

    asyncio.run(run())

"""What the live autopilot's tests share: a small, quick controller configuration and a run of a
collector and the driver on twins, on a manual clock."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from scheduler.settings import Settings
from tuner.autopilot.promise import QUANTILE_NAMES, Figures

DEFAULTS = Settings.model_validate({"policy": "uniboost"})
# Small and quick: two fixed γ besides the defaults and sarathi, short windows, no dwell.
CONFIG = {
    "gammas": [0.01, 1.0],
    "interval_s": 30.0,
    "delay_s": 30.0,
    "window_s": 300.0,
    "min_requests": 100,
    "leave_defaults": 0.05,
    "hysteresis": 0.05,
    "min_dwell_s": 0.0,
}


def figures(**over: float) -> Figures:
    """A candidate's figures: every quantile 1 s and 100 tok/s but those given."""
    base = dict.fromkeys(QUANTILE_NAMES, 1.0)
    return Figures(**{**base, "throughput_tok_s": 100.0, **over})  # type: ignore[arg-type]


def run_live(
    clock: Any,
    twins: Sequence[Any],
    cluster: Any,
    store: Any,
    config: Any,
    live: Any,
    until: Callable[[Any], bool],
    t_end: float = 1200.0,
) -> Any:
    """A collector and the live autopilot (``config``, ``live``) on ``twins``, driven by
    ``tuner.twins.replica.drive_on_manual_clock`` until ``until(driver)`` or ``t_end``; the
    driver."""
    import asyncio

    from controlplane.collector import Collector
    from controlplane.replica_http import PollingClient
    from tuner.autopilot.live import LiveAutopilot
    from tuner.twins.replica import drive_on_manual_clock

    async def scenario() -> Any:
        client = PollingClient(cluster.timeout_s)
        collector = Collector(cluster, store, client=client, clock=clock.now)
        driver = LiveAutopilot(collector, store, config, live, clock=clock.now)
        collector.on_poll(driver.on_poll)
        try:
            await drive_on_manual_clock(
                clock, twins, collector, driver, client, t_end=t_end, until=until
            )
            return driver
        finally:
            await client.aclose()

    return asyncio.run(scenario())

"""What the live autopilot's tests share: a small, quick controller configuration and the loop
that drives twins, a collector and the driver on a manual clock."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from scheduler.settings import Settings

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


async def drive(
    clock: Any,
    twins: Sequence[Any],
    collector: Any,
    driver: Any,
    client: Any,
    until: Callable[[Any], bool],
    t_end: float = 1200.0,
) -> None:
    """``tuner.twin.drive_on_manual_clock`` until ``until(driver)`` or ``t_end``."""
    from tuner.twin import drive_on_manual_clock

    await drive_on_manual_clock(clock, twins, collector, driver, client, t_end=t_end, until=until)

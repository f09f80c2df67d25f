"""The one loop a cluster controller runs in.

The governor (``controlplane.governor``) and the autopilot (``tuner.autopilot.live``) are two
controllers of the same machine: each observes only the past (the collector's windows, the
replicas' answers), decides with a reason, and carries a decision out through the one settings
path (``controlplane.steering.apply_settings``: audited, under the controller's lease), steered by
its row of the control table (``storage.control``: armed, dry-run, paused, disarmed). What they
share beyond that is this host: a step every ``interval_s`` until ``stop``, a failed step logged
and tried again at the next tick (a busy store, a replica down never stops a controller), and,
when the host stops or is cancelled, the controller's ``close`` — the governor undoes what it
applied — run shielded and waited for at most ``close_timeout_s``. ``tests/test_layers.py``
fails on a second controller loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Protocol

from storage.control import ControllerName

__all__ = ["HostedController", "run_controller"]


class HostedController(Protocol):
    """A controller as its host sees it."""

    @property
    def name(self) -> ControllerName:
        """Its row of the control table, and its logger's name."""
        ...

    async def step(self) -> None:
        """One observation and decision: read the control row, decide, carry out or log, store
        the status."""
        ...

    async def close(self) -> None:
        """The host stops: what the controller must do before it goes (undo, close a client)."""
        ...


async def run_controller(
    controller: HostedController,
    stop: asyncio.Event,
    *,
    interval_s: float,
    close_timeout_s: float = 30.0,
) -> None:
    """Step ``controller`` every ``interval_s`` until ``stop`` is set; then (or cancelled) close
    it. The host's owner (the recorder, the TUI's live source) cancels it once its collector has
    stopped, possibly mid-close: the close runs shielded and is waited for, at most
    ``close_timeout_s``, whatever the cancellation."""
    log = logging.getLogger(f"tailpilot.{controller.name}")
    try:
        while not stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), interval_s)
            if stop.is_set():
                return
            try:
                await controller.step()
            except Exception:  # a failed step (busy store, a replica down) is retried next tick
                log.exception("%s step failed", controller.name)
    finally:
        closing = asyncio.ensure_future(controller.close())
        deadline = time.monotonic() + close_timeout_s
        while not closing.done() and time.monotonic() < deadline:
            with contextlib.suppress(asyncio.CancelledError, asyncio.TimeoutError):
                await asyncio.wait_for(
                    asyncio.shield(closing), max(0.0, deadline - time.monotonic())
                )
        if not closing.done():
            closing.cancel()
            log.error(
                "%s: close did not finish within %.0f s; its status lists what is left",
                controller.name,
                close_timeout_s,
            )
        elif not closing.cancelled() and closing.exception() is not None:
            log.error(
                "%s: close failed: %s; its status lists what is left",
                controller.name,
                closing.exception(),
            )

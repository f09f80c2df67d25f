"""What the TUI's tests share: waiting for what the app shows, not for a fixed time."""

from __future__ import annotations

import asyncio


async def wait_for(pilot, cond, timeout: float = 30.0, what: str = "condition"):
    """Let the app run until ``cond()`` is truthy and return its value; fail naming ``what``
    after ``timeout`` seconds — a deadline for an event, generous because a loaded machine
    (three test workers on two cores) runs the app's workers late."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not (value := cond()):
        if loop.time() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await pilot.pause(0.05)
    return value

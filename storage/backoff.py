"""Jittered exponential backoff, for writers that retry a locked or racing database.

Imports nothing beyond the standard library.
"""

from __future__ import annotations

import random
from collections.abc import Iterator


def backoff_delays(
    first_s: float, cap_s: float, rng: random.Random | None = None
) -> Iterator[float]:
    """Sleeps before each retry: ``first_s``, doubling up to ``cap_s``, each drawn in [½, 1] of the
    current step — jitter, so writers that collided do not retry in step."""
    uniform = (rng or random).uniform
    step = first_s
    while True:
        yield step * uniform(0.5, 1.0)
        step = min(step * 2.0, cap_s)

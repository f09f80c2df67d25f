"""Arrival processes for traces that record lengths but no times (length-only CSVs, length
distributions): Poisson, or Gamma inter-arrival gaps with a chosen coefficient of variation.
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np

ArrivalProcess = Literal["poisson", "gamma"]


def generate_arrivals(
    n: int,
    *,
    rate: float,
    process: ArrivalProcess = "poisson",
    cv: float = 1.0,
    seed: int | np.random.Generator = 0,
) -> np.ndarray:
    """`n` arrival times starting at 0.0, with mean inter-arrival gap 1/rate.

    "poisson": exponential gaps (CV 1; passing another `cv` is an error). "gamma": Gamma gaps with
    shape 1/cv**2 and scale cv**2/rate, so the gaps' coefficient of variation is `cv` (cv > 1 is
    burstier than Poisson, cv < 1 smoother; cv = 1 is Poisson).
    """
    if not (math.isfinite(rate) and rate > 0.0):
        raise ValueError(f"rate must be a finite positive req/s, got {rate}")
    if not (math.isfinite(cv) and cv > 0.0):
        raise ValueError(f"cv must be finite and > 0, got {cv}")
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    if process == "poisson":
        if cv != 1.0:
            raise ValueError(
                f"cv={cv} only applies to process='gamma' (Poisson arrivals have CV 1)"
            )
        gaps = rng.exponential(1.0 / rate, size=max(n - 1, 0))
    elif process == "gamma":
        shape = 1.0 / (cv * cv)
        gaps = rng.gamma(shape, 1.0 / (rate * shape), size=max(n - 1, 0))
    else:
        raise ValueError(f"process must be 'poisson' or 'gamma', got {process!r}")
    return np.concatenate(([0.0], np.cumsum(gaps)))[:n]

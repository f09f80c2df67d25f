"""SLO attainment: the fraction of requests within k × their SLO (:func:`slo_attainment`, the
curve over a grid of scales k), and the tightest scale a target fraction meets
(:func:`tightest_slo_scale`). The two agree exactly: both compare value / SLO with k.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

#: A grid of SLO scales k for attainment curves (0.1x .. 100x, log-spaced, 10 per decade).
DEFAULT_SLO_SCALES: np.ndarray = np.round(np.logspace(-1, 2, 31), 6)


def _normalised(values: np.ndarray | Sequence[float], slo: float | np.ndarray) -> np.ndarray:
    """Finite ``values / slo`` (unsorted; slo may be one number or one per request)."""
    x = np.asarray(values, dtype=np.float64).ravel()
    s = np.asarray(slo, dtype=np.float64)
    if s.ndim > 0:
        s = s.ravel()
        if s.shape != x.shape:
            raise ValueError("a per-request slo must have one entry per value")
    if np.any(~(s > 0)):
        raise ValueError(f"slo must be positive, got {slo!r}")
    # Compare value/slo with k rather than value with k*slo, so that the attainment curve
    # and tightest_slo_scale agree exactly (no rounding in k*slo).
    norm = x / s
    finite: np.ndarray = norm[np.isfinite(norm)]
    return finite


def _count_at_most(norm: np.ndarray, k: np.ndarray) -> np.ndarray:
    """How many entries of ``norm`` are ≤ each scale in ``k`` (same shape as ``k``)."""
    if k.size <= 16:  # a few O(n) scans beat an O(n log n) sort (summarize asks for one)
        flat = [np.count_nonzero(norm <= kk) for kk in k.ravel()]
        return np.array(flat, dtype=np.int64).reshape(k.shape)
    return np.searchsorted(np.sort(norm), k, side="right")


def slo_attainment(
    values: np.ndarray | Sequence[float],
    slo: float | np.ndarray,
    scales: float | Sequence[float] | np.ndarray = DEFAULT_SLO_SCALES,
) -> np.ndarray:
    """Fraction of requests with ``value ≤ k × slo`` for each ``k`` (shaped like ``scales``).

    ``slo`` is seconds, one number or one per request. Requests whose value is undefined
    (NaN) are excluded; no finite value → NaN everywhere. Non-decreasing in ``k``.
    """
    norm = _normalised(values, slo)
    k = np.asarray(scales, dtype=np.float64)
    if norm.size == 0:
        return np.full(k.shape, np.nan)
    return _count_at_most(norm, k) / norm.size


def _needed(n: int, target: float) -> int:
    """Smallest m with m / n >= target, using the same float comparison as the curve."""
    m = min(n, max(1, math.ceil(target * n)))
    while m > 1 and (m - 1) / n >= target:
        m -= 1
    while m < n and m / n < target:
        m += 1
    return m


def tightest_slo_scale(
    values: np.ndarray | Sequence[float],
    slo: float | np.ndarray,
    target: float = 0.99,
    scales: Sequence[float] | np.ndarray | None = None,
) -> float:
    """Smallest scale ``k`` whose attainment (see :func:`slo_attainment`) is ≥ ``target``.

    With ``scales=None`` the answer is exact: the m-th smallest value/slo, m = ⌈target·n⌉.
    With a grid, it is the smallest grid scale that reaches the target, or ``inf`` when none
    does (an orderable "worse than anything on the grid", unlike NaN). Empty input → NaN.
    """
    if not 0.0 < target <= 1.0:
        raise ValueError(f"target must be in (0, 1], got {target!r}")
    norm = _normalised(values, slo)
    if norm.size == 0:
        return math.nan
    if scales is None:
        m = _needed(norm.size, target)
        return float(np.partition(norm, m - 1)[m - 1])
    grid = np.sort(np.asarray(scales, dtype=np.float64).ravel())
    attained = _count_at_most(norm, grid) / norm.size
    hits = np.flatnonzero(attained >= target)
    return float(grid[hits[0]]) if hits.size else math.inf

"""The follow-the-leader oracle (benchmarks/autopilot_leader.py) sees only the past: what it
judges at a decision is unchanged by anything that happens after it."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import autopilot_leader as leader  # noqa: E402


def _replay(seed: int, n: int = 3_000, span_s: float = 1_800.0) -> np.ndarray:
    """Rows of (arrival, first token, finish) by arrival: waits of up to a minute."""
    rng = np.random.default_rng(seed)
    arrival = np.sort(rng.uniform(0.0, span_s, n))
    first = arrival + rng.exponential(5.0, n)
    return np.column_stack([arrival, first, first + rng.exponential(20.0, n)])


def test_a_decision_reads_no_event_after_it():
    times, now = _replay(1), 1_200.0
    seen = leader.window_figures(times, now)
    assert seen is not None
    future = times.copy()
    future[:, 1:] = np.where(future[:, 1:] > now, future[:, 1:] + 500.0, future[:, 1:])
    later = future[:, 0] > now  # arrivals after the decision, moved too
    future[later, 0] += 1.0
    assert leader.window_figures(future, now) == seen
    # A request still waiting counts with its wait so far: its first token at ``now`` at most.
    waiting = (times[:, 0] <= now) & (times[:, 1] > now)
    assert waiting.any()
    past = times.copy()
    past[times[:, 1] <= now, 1] += 50.0  # a change in the past is seen
    assert leader.window_figures(past, now) != seen


def test_the_schedule_is_the_same_whatever_comes_after_each_decision():
    """Cut every replay at a decision time t and re-run: the choices up to t are the same."""
    replays = {"sarathi": _replay(2), "defaults": _replay(3), "γ 0.1": _replay(4) * 0.9}
    end = 1_800.0
    full = leader.schedule_of(replays, end, margins=False)
    for t in (600.0, 1_200.0):
        cut = {
            n: np.where(r > t, r + 1_000.0, r)  # the future rewritten
            for n, r in replays.items()
        }
        cut = {n: r[np.argsort(r[:, 0], kind="stable")] for n, r in cut.items()}
        assert [s for s in leader.schedule_of(cut, end, margins=False) if s[0] <= t] == [
            s for s in full if s[0] <= t
        ]
    assert len(full) > 1  # it chose something: the test sees decisions, not none

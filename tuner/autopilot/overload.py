"""Overload: whether arrivals outrun what the replica serves, judged at each decision on the
reference's queue (age order: its queue is the backlog in arrival order).

"Sustained" when the reference would need longer than ``overload_drain_s`` to empty its queue
with no further arrival: the autopilot moves a choice below the defaults up to them and holds,
judged again every ``overload_recheck`` decisions (a deep queue is the costliest to project).
"Rising" when longer than ``overload_growth_s`` and longer than at the last decision (arrivals
above capacity right now): no move goes down the axis. "Standing" when, over the arrivals of the
last ``overload_standing_s``, the reference's median first-token wait exceeds
``overload_growth_s`` (``standing``): arrivals have kept up with capacity all that while, whether
or not the queue grew this minute. It bars the way into the choices below the defaults — a request
held back in a queue that never empties waits until it does — while a running choice already
below them is stress-tested as in rising overload and may still move down. README, "The
autopilot".
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from tuner.autopilot.config import AutopilotConfig

# The verdicts under which a running choice below the defaults is stress-tested every
# ``overload_recheck`` decisions (``OverloadWatch.running_verdict``).
RECHECKED = ("rising", "standing")


class OverloadWatch:
    """The overload verdicts of one autopilot's decisions, in order."""

    def __init__(self, config: AutopilotConfig) -> None:
        self._drain_s = config.overload_drain_s  # None: never judged overloaded
        self._growth_s = config.overload_growth_s
        self._recheck = config.overload_recheck
        self._standing_s = config.overload_standing_s  # None: a standing queue never judged
        self._drain: float | None = None  # at the last verdict, s the reference needs to empty
        self._sustained_for = 0  # decisions since sustained overload was last judged (0: not)
        self.rising = False  # the reference's drain time grew since the last verdict
        self._rechecked_for = 0  # decisions in a row judged in rising or standing overload
        # the running choice's last stress verdict while the load rose: (candidate, what it broke)
        self._running_verdict: tuple[str, tuple[str, ...]] = ("", ())

    def horizon(self, project_s: float) -> float:
        """How far to project the reference for a verdict: no further than sustained overload
        needs to be seen (its queue not empty by then)."""
        return project_s if self._drain_s is None else min(project_s, self._drain_s)

    def hold_this_decision(self) -> bool:
        """Whether this decision holds without a verdict: sustained overload was judged less
        than ``overload_recheck`` decisions ago, and it does not end within a few minutes. Counts
        the decision (call it once a decision)."""
        if self._sustained_for and self._sustained_for < self._recheck:
            self._sustained_for += 1
            return True
        return False

    def judge(
        self, busy: bool, drained_at: float | None, clock: float, standing: bool = False
    ) -> str:
        """This decision's verdict — "sustained", "standing", "rising" or "" — from the
        reference's queue: whether it is ``busy`` at ``clock``, when its projection emptied it
        (None: not within the horizon) and whether it has stood (``standing``)."""
        verdict = ""
        if self._drain_s is not None:
            drain = 0.0
            if busy:
                drain = math.inf if drained_at is None else drained_at - clock
            previous, self._drain = self._drain, drain
            self.rising = previous is not None and drain > previous
            if drain > self._drain_s:
                verdict = "sustained"
            elif standing and busy:
                verdict = "standing"
            elif drain > self._growth_s and self.rising:
                verdict = "rising"
        self._sustained_for = 1 if verdict == "sustained" else 0
        return verdict

    def standing(self, arrivals: np.ndarray, waits: np.ndarray, clock: float) -> bool:
        """Whether the reference's queue has stood: the median of ``waits`` (its first-token
        waits, a request still waiting counted with its wait so far) over the requests that
        arrived in the last ``overload_standing_s`` before ``clock`` (``arrivals``, in order)
        exceeds ``overload_growth_s``. Never while fewer than half of that span has arrivals."""
        if self._standing_s is None or not len(arrivals):
            return False
        first = int(np.searchsorted(arrivals, clock - self._standing_s, side="left"))
        if first == len(arrivals) or arrivals[first] > clock - self._standing_s / 2:
            return False
        return bool(np.median(waits[first:]) > self._growth_s)

    def running_verdict(
        self, verdict: str, current: str, test: Callable[[], tuple[str, ...]]
    ) -> tuple[str, ...]:
        """What the running choice ``current`` breaks under the stress test (``test`` runs it)
        while the load rises: in rising overload (``verdict``) run once every
        ``overload_recheck`` decisions, its verdict standing between, as sustained overload is
        judged — ten more minutes of arrivals above capacity make the deepest queues to project
        (on ``overload`` the rising minutes' stress tests were a third of the controller's CPU)."""
        of, last = self._running_verdict
        if verdict in RECHECKED and of == current and self._rechecked_for % self._recheck:
            broken = last
        else:
            broken = test()
        self._running_verdict = (current, broken)
        return broken

    def count_rechecked(self, verdict: str) -> None:
        """Count a judged decision's verdict for ``running_verdict``'s cadence: decisions in a row
        whose verdict is one the running choice is rechecked under (``RECHECKED``)."""
        self._rechecked_for = self._rechecked_for + 1 if verdict in RECHECKED else 0

"""The optional capabilities of a policy (``scheduler.policies.base.Policy``): what only some
policies want, each its own narrow interface. A policy class names the ones it has among its bases
(mypyc compiles a second base as a trait) and sets the matching flag on ``Policy``; an engine tests
the flag — a class attribute, ~40 ns — and then calls through the interface (an ``isinstance`` test
against a runtime-checkable Protocol measured 5.3 µs, on every step's path).
``tests/test_policies.py`` holds each flag to its interface, and ``Policy`` itself has none of
these methods.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import numpy as np
from mypy_extensions import mypyc_attr, trait

from scheduler.policies.base import INF, Policy, RequestState

__all__ = [
    "ApproxOffsets",
    "ChargesTokens",
    "CountsSteps",
    "RefusesArrivals",
    "Ticks",
    "next_tick_of",
    "refusal",
    "tick_if_due",
]


@mypyc_attr(allow_interpreted_subclasses=True)
@trait
class ChargesTokens:
    """Wants every generated token (vtc's and slofq's service counters): ``charges_tokens``."""

    def on_tokens(self, req: RequestState, new_tokens: int) -> None:
        """``new_tokens`` output tokens were generated for ``req``."""
        raise NotImplementedError


@mypyc_attr(allow_interpreted_subclasses=True)
@trait
class CountsSteps:
    """Wants every step's service (sjf's starvation counters, slofq's window budget):
    ``counts_steps``."""

    def on_steps(
        self, scheduled: Iterable[RequestState], unscheduled: Iterable[RequestState], steps: int
    ) -> None:
        """``steps`` identical steps ran: ``scheduled`` got service in each, ``unscheduled``
        none."""
        raise NotImplementedError

    def on_waiting_steps(self, waiting: Iterable[RequestState], steps: int) -> None:
        """``steps`` identical steps ran and every request in ``waiting`` (the engine's waiting
        queue) went without service: the engine's call, where ``on_steps`` gets the running
        requests only. A policy may count these lazily (sjf); by default they go to ``on_steps``."""
        self.on_steps((), waiting, steps)


@mypyc_attr(allow_interpreted_subclasses=True)
@trait
class Ticks:
    """Adapts on a clock (uniboost's γ-Ada, slofq's control step): ``ticks``. An engine calls
    ``tick`` at the top of the first step at or after ``next_tick``, and ends an event-skipping
    stretch there."""

    def next_tick(self) -> float:
        """Time of the next adaptation, or INF."""
        raise NotImplementedError

    def tick(self, now: float) -> None:
        """Adapt at ``now``: the engine's clock at the top of a step."""
        raise NotImplementedError


@mypyc_attr(allow_interpreted_subclasses=True)
@trait
class RefusesArrivals:
    """May turn an arrival away (slofq's per-tenant queue cap): asked only while the policy's
    ``refuses`` says it may under its settings."""

    def refuse(self, req: RequestState, now: float) -> str | None:
        """Why ``req`` is turned away on arrival, or None to queue it; asked before
        ``on_arrival``, which a refused request never gets."""
        raise NotImplementedError


@mypyc_attr(allow_interpreted_subclasses=True)
@trait
class ApproxOffsets:
    """Keeps its waiting queue in the ``"offsets"`` layout (``Policy.waiting_layout``: uniboost
    with γ-Ada, a group per prompt length): its flag is that layout."""

    def approx_offsets(self, values: np.ndarray) -> np.ndarray:
        """The offsets of an array of group values in this epoch, within a few ulps of the exact
        ones (numpy; the queue shortlists heads with them and decides on exact keys)."""
        raise NotImplementedError


def next_tick_of(policy: Policy) -> float:
    """``policy``'s next adaptation (``Ticks.next_tick``), INF for one that does not tick."""
    return cast(Ticks, policy).next_tick() if policy.ticks else INF


def tick_if_due(policy: Policy, now: float) -> bool:
    """Let ``policy`` adapt at the top of a step at ``now`` if its next tick is due (both
    engines' call); whether it ticked."""
    if next_tick_of(policy) > now:
        return False
    cast(Ticks, policy).tick(now)
    return True


def refusal(policy: Policy, req: RequestState, now: float) -> str | None:
    """Why ``policy`` turns the arriving ``req`` away (``RefusesArrivals.refuse``), or None to
    queue it — None at once for a policy that may not refuse under its settings (both engines'
    call, on every arrival's path)."""
    return cast(RefusesArrivals, policy).refuse(req, now) if policy.refuses else None

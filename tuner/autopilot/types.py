"""What the autopilot sees (``Arrival``, ``Observation``: never an output length not yet known) and
what it says (``Decision``: the choice, why, the figures it compared)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from scheduler.metrics import Completion
from scheduler.names import DEFAULT_TENANT, DEFAULT_TYPE
from tuner.autopilot.promise import QUANTILE_NAMES, Figures


@dataclass(frozen=True, slots=True)
class Arrival:
    """A request as the replica knows it on arrival: no output length."""

    id: str
    arrival: float
    prompt_tokens: int
    max_tokens: int
    tenant: str = DEFAULT_TENANT
    type: str = DEFAULT_TYPE


@dataclass(frozen=True, slots=True)
class Observation:
    """What happened since the previous observation, up to ``now``."""

    now: float
    arrivals: Sequence[Arrival] = ()
    completions: Sequence[Completion] = ()
    generated: Mapping[str, int] = field(
        default_factory=dict
    )  # tokens so far, per request in flight


def arrival_order(a: Arrival) -> tuple[float, str]:
    return a.arrival, a.id


@dataclass(slots=True)
class Decision:
    """One decision: what was chosen, why, and what it was predicted to do."""

    at: float
    choice: str
    settings: dict[str, Any]
    changed: bool
    reason: str
    figures: dict[str, Figures]
    requests: int  # in the comparison window
    cpu_s: float  # the controller's CPU time for this interval (shadows included)
    previous: str = ""  # what ran before this decision ("" when the same as ``choice``)
    # "sustained": the reference could not empty its queue within overload_drain_s;
    # "standing": its median first-token wait over the last overload_standing_s of arrivals is
    # over overload_growth_s; "rising": its queue takes longer than overload_growth_s to empty and
    # grows; "": none of these.
    overload: str = ""

    def predicted(self) -> dict[str, float | None]:
        """The predicted change of a switch: the chosen candidate's figures over the previous
        one's, minus one, on the window's requests (empty when nothing changed)."""
        new, old = self.figures.get(self.choice), self.figures.get(self.previous)
        if not self.changed or new is None or old is None:
            return {}
        pairs = {k: (new.value(k), old.value(k)) for k in (*QUANTILE_NAMES, "throughput_tok_s")}
        return {k: (a / b - 1.0 if b > 0 else None) for k, (a, b) in pairs.items()}

"""The trace model: `TraceRequest` (one request of a workload), `Trace` (an immutable,
arrival-sorted sequence of them) and `TraceError` (what every loader raises on bad input).

See docs/engine.md#requests for the fields and the package docstring (`sim.traces`) for how
loaders fill them.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from scheduler.errors import TailpilotError
from scheduler.names import DEFAULT_TENANT, DEFAULT_TYPE, REQUEST_TYPES

# The client cap given to requests whose source records none: one value for every request, so it
# tells a policy nothing about any request's length. Loaders take `max_tokens_default=` to change it
# (the command line's --max-tokens-default).
DEFAULT_MAX_TOKENS = 4096


# Arrivals are float seconds (from the trace's first request, or Unix times ~1.7e9 in a recording):
# at 1e11 s a float still resolves 15 µs, a step is ~10 ms; far past it a step's duration falls
# below a float's resolution and the simulator's clock could no longer move (1e50 hung it).
MAX_ARRIVAL_S = 1e11


class TraceError(TailpilotError, ValueError):
    """A trace file is missing, unreadable or malformed.

    The message is `<file>:<line>: <what is wrong>` for row-level problems (header = line 1), or
    `<file>: <what is wrong>` for problems with the file as a whole.
    """


@dataclass(slots=True, frozen=True)
class TraceRequest:
    """One request of a workload trace (docs/engine.md#requests).

    `output_tokens` is the true output length, `max_tokens` the client's cap; the simulator
    generates `min(output_tokens, max_tokens)` tokens. `max_tokens` never derives from the output
    length: sources without a cap get a fixed one (`DEFAULT_MAX_TOKENS`, or the loader's
    `max_tokens_default`). `truncated` marks a request whose source output was longer than its cap
    and was cut to it (by that default cap at load time, or by `cap_max_tokens`).
    """

    id: str
    arrival: float  # seconds, relative to the trace start
    prompt_tokens: int
    output_tokens: int
    max_tokens: int
    tenant: str = DEFAULT_TENANT
    type: str = DEFAULT_TYPE
    truncated: bool = False

    def __post_init__(self) -> None:
        # Cheap invariant checks: a bad request would otherwise surface deep in the simulator.
        if not 0.0 <= self.arrival <= MAX_ARRIVAL_S:  # False for NaN too
            raise TraceError(
                f"request {self.id!r}: arrival must be in [0, {MAX_ARRIVAL_S:g}] s, "
                f"got {self.arrival}"
            )
        if self.prompt_tokens < 1 or self.output_tokens < 1 or self.max_tokens < 1:
            raise ValueError(
                f"request {self.id!r}: token counts must be >= 1, got prompt={self.prompt_tokens} "
                f"output={self.output_tokens} max_tokens={self.max_tokens}"
            )
        if self.type not in REQUEST_TYPES:
            raise ValueError(
                f"request {self.id!r}: type must be one of {sorted(REQUEST_TYPES)}, "
                f"got {self.type!r}"
            )
        if not self.tenant:
            raise ValueError(f"request {self.id!r}: tenant must be a non-empty string")


@dataclass(slots=True, frozen=True)
class Trace:
    """An immutable workload: requests sorted by (arrival, id), ids unique.

    `skipped` counts source rows a loader dropped by design (e.g. BurstGPT failures); transforms
    carry it along so the provenance is not lost. `truncated` (a property) counts the requests
    whose output was cut to their cap (see `TraceRequest.truncated`).
    """

    name: str
    requests: tuple[TraceRequest, ...]
    skipped: int = 0

    def __post_init__(self) -> None:
        # Normalize here rather than trusting callers: every consumer may rely on the order.
        ordered = tuple(sorted(self.requests, key=_arrival_then_id))
        if len({r.id for r in ordered}) != len(ordered):
            counts = Counter(r.id for r in ordered)
            dup = next(i for i, c in counts.items() if c > 1)
            raise ValueError(f"trace {self.name!r}: duplicate request id {dup!r}")
        object.__setattr__(self, "requests", ordered)

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def truncated(self) -> int:
        """Requests whose source output was longer than their cap and was truncated to it."""
        return sum(1 for r in self.requests if r.truncated)

    def __iter__(self) -> Iterator[TraceRequest]:
        return iter(self.requests)

    @property
    def duration(self) -> float:
        """Last arrival minus first arrival, in seconds (0.0 for fewer than two requests)."""
        if len(self.requests) < 2:
            return 0.0
        return self.requests[-1].arrival - self.requests[0].arrival

    @property
    def rate(self) -> float:
        """Mean arrival rate in req/s: requests / duration, as in traces/README.md.

        0.0 for fewer than two requests (no rate can be observed); inf when two or more
        requests all arrive at the same instant.
        """
        if len(self.requests) < 2:
            return 0.0
        duration = self.duration
        return math.inf if duration == 0.0 else len(self.requests) / duration

    def arrivals(self) -> np.ndarray:
        """Arrival times as a float64 array (in trace order)."""
        return np.fromiter(
            (r.arrival for r in self.requests), dtype=np.float64, count=len(self.requests)
        )


def _arrival_then_id(r: TraceRequest) -> tuple[float, str]:
    return (r.arrival, r.id)

"""The per-request record (:class:`Completion`) and its columnar form (:class:`CompletionArrays`),
which every summary reads: build it once with :func:`to_arrays`.

Times are seconds on the run's clock; derived latencies are defined in the package docstring
(``scheduler.metrics``). NaN marks a value undefined for a request.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

import numpy as np


@dataclass(slots=True, frozen=True)
class Completion:
    """One finished request. Times in seconds on the run's clock; token counts are ints.

    ``scheduled_at`` is the *first* admission (a preempted request is re-admitted later, but
    queue time is measured to the first admission). ``recomputed_tokens`` counts tokens whose
    KV was thrown away by preemption and prefilled again.
    """

    id: str
    tenant: str
    type: str
    arrival: float
    scheduled_at: float
    first_token_at: float
    finished_at: float
    prompt_tokens: int
    output_tokens: int
    preemptions: int = 0
    recomputed_tokens: int = 0

    # The scalar properties mirror CompletionArrays' vectorised ones (tests keep them equal).
    @property
    def ttft(self) -> float:
        return self.first_token_at - self.arrival

    @property
    def ttlt(self) -> float:
        return self.finished_at - self.arrival

    @property
    def tbt(self) -> float:
        if self.output_tokens <= 1:
            return math.nan
        return (self.finished_at - self.first_token_at) / (self.output_tokens - 1)

    @property
    def ptl(self) -> float:
        if self.output_tokens <= 0:
            return math.nan
        return self.ttlt / self.output_tokens

    @property
    def queue(self) -> float:
        return self.scheduled_at - self.arrival


_STR_FIELDS = ("id", "tenant", "type")
_FLOAT_FIELDS = ("arrival", "scheduled_at", "first_token_at", "finished_at")
_INT_FIELDS = ("prompt_tokens", "output_tokens", "preemptions", "recomputed_tokens")


@dataclass(slots=True, frozen=True)
class CompletionArrays:
    """Columnar form of many completions: one 1-D numpy array per :class:`Completion` field.

    Build it once with :func:`to_arrays` (or directly from columns, e.g. in the simulator) and
    pass it to every summary: the summaries never loop over requests in Python.
    """

    id: np.ndarray
    tenant: np.ndarray
    type: np.ndarray
    arrival: np.ndarray
    scheduled_at: np.ndarray
    first_token_at: np.ndarray
    finished_at: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    preemptions: np.ndarray
    recomputed_tokens: np.ndarray

    def __post_init__(self) -> None:
        # Coerce dtypes once here so that every consumer can rely on them.
        for name in _STR_FIELDS:
            object.__setattr__(self, name, np.asarray(getattr(self, name), dtype=str))
        for name in _FLOAT_FIELDS:
            object.__setattr__(self, name, np.asarray(getattr(self, name), dtype=np.float64))
        for name in _INT_FIELDS:
            object.__setattr__(self, name, np.asarray(getattr(self, name), dtype=np.int64))
        lengths = {name: getattr(self, name).shape for name in _ALL_FIELDS}
        shapes = set(lengths.values())
        if len(shapes) != 1 or len(next(iter(shapes))) != 1:
            raise ValueError(f"CompletionArrays columns must be 1-D and of equal length: {lengths}")

    def __len__(self) -> int:
        return int(self.arrival.shape[0])

    @classmethod
    def empty(cls) -> CompletionArrays:
        # Lists are fine here: __post_init__ coerces every column to its numpy dtype.
        columns: dict[str, Any] = {name: [] for name in _ALL_FIELDS}
        return cls(**columns)

    def select(self, index: np.ndarray) -> CompletionArrays:
        """Rows picked by a boolean mask or an integer index array."""
        return CompletionArrays(**{name: getattr(self, name)[index] for name in _ALL_FIELDS})

    # Derived per-request columns (seconds). NaN marks "undefined for this request".
    @property
    def ttft(self) -> np.ndarray:
        ttft: np.ndarray = self.first_token_at - self.arrival
        return ttft

    @property
    def ttlt(self) -> np.ndarray:
        ttlt: np.ndarray = self.finished_at - self.arrival
        return ttlt

    # An undefined divisor is set to NaN so that the quotient is NaN without a warning
    # (this is also ~8x faster than np.divide(..., where=...)).
    @property
    def tbt(self) -> np.ndarray:
        gaps = self.output_tokens - 1.0
        gaps[gaps <= 0] = np.nan  # one token: no inter-token gap
        tbt: np.ndarray = (self.finished_at - self.first_token_at) / gaps
        return tbt

    @property
    def ptl(self) -> np.ndarray:
        tokens = self.output_tokens.astype(np.float64)
        tokens[tokens <= 0] = np.nan
        return self.ttlt / tokens

    @property
    def queue(self) -> np.ndarray:
        queue: np.ndarray = self.scheduled_at - self.arrival
        return queue


_ALL_FIELDS = _STR_FIELDS + _FLOAT_FIELDS + _INT_FIELDS

CompletionsLike = CompletionArrays | Iterable[Completion]


def to_arrays(completions: CompletionsLike) -> CompletionArrays:
    """Columnar copy of ``completions``; a :class:`CompletionArrays` is returned unchanged."""
    if isinstance(completions, CompletionArrays):
        return completions
    rows: Sequence[Completion] = (
        completions if isinstance(completions, Sequence) else list(completions)
    )
    n = len(rows)
    cols: dict[str, np.ndarray] = {}
    for name in _STR_FIELDS:
        cols[name] = np.array([getattr(c, name) for c in rows], dtype=str)
    for name in _FLOAT_FIELDS:
        cols[name] = np.fromiter(map(attrgetter(name), rows), dtype=np.float64, count=n)
    for name in _INT_FIELDS:
        cols[name] = np.fromiter(map(attrgetter(name), rows), dtype=np.int64, count=n)
    return CompletionArrays(**cols)

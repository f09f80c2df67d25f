"""A bounded log a reader pages through by cursor: the replica's completions and steps.

Each entry gets the next sequence number (``seq``) when it is appended; the oldest fall off past
``kept``. A reader asks for the entries at or after its cursor, at most a page, and is handed the
cursor to ask with next — past entries that fell off (it reads from the oldest kept), and never
past the end. Not thread-safe: the replica's core holds its lock around every call.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["PagedLog"]

Entry = TypeVar("Entry")


class PagedLog(Generic[Entry]):
    """Entries made by ``make(seq)`` at ``append``, the last ``kept`` of them kept."""

    def __init__(self, kept: int, seq_of: Callable[[Entry], int]) -> None:
        self._entries: deque[Entry] = deque(maxlen=kept)
        self._seq_of = seq_of
        self._seqs = itertools.count()

    def append(self, make: Callable[[int], Entry]) -> Entry:
        """Append the entry ``make`` builds with the next sequence number; return it."""
        entry = make(next(self._seqs))
        self._entries.append(entry)
        return entry

    @property
    def next_seq(self) -> int:
        """The sequence number the next entry gets (0 while empty)."""
        return self._seq_of(self._entries[-1]) + 1 if self._entries else 0

    def since(self, cursor: int, limit: int) -> tuple[list[Entry], int]:
        """Entries with ``seq >= cursor``, at most ``limit``, and the cursor to ask with next —
        without scanning the log: the seqs kept are consecutive, so the cursor's position is
        arithmetic (a poller that keeps up reads only the tail, from the right end)."""
        log = self._entries
        items: list[Entry] = []
        if log and limit > 0:
            start = max(cursor - self._seq_of(log[0]), 0)
            after = len(log) - start
            if 0 < after <= len(log) // 2:
                items = list(itertools.islice(reversed(log), after))
                items.reverse()
                items = items[:limit]
            elif after > 0:
                items = list(itertools.islice(log, start, start + limit))
        if items:
            return items, self._seq_of(items[-1]) + 1
        return items, max(cursor, self.next_seq)

"""The collector's writer: the rows its polls produced, stored as one :class:`storage.rows.Batch`
per flush, exactly once.

A replica's cursor is written in the same transaction as the completions it covers
(``Batch.cursors``); a batch the store refuses because it is busy (``StoreBusy``) is put back in
front of what arrived meanwhile and written with the next flush, never dropped. The last flush
(``final``) tries a busy store again (:data:`controlplane.retry.STORE_BUSY`) until its deadline,
then raises; any other store error ends the collector with the batch still pending.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from controlplane.poller import PollResult
from controlplane.retry import STORE_BUSY
from storage.rows import Batch


@dataclass
class CollectorStats:
    """The collector's counts since it started: polls, and rows written."""

    polls: int = 0
    failed_polls: int = 0
    batches: int = 0
    busy_retries: int = 0  # flushes the store refused (rows kept and retried)
    rows_written: int = 0  # samples + group samples + completions
    samples_written: int = 0
    group_samples_written: int = 0
    completions_written: int = 0  # completion rows handed to the store (re-deliveries included)
    pending_rows: int = 0
    breaker_trips: int = 0  # replicas' circuit-breaker trips written to the audit log


def _store_busy_types() -> tuple[type[BaseException], ...]:
    try:
        # Imported when a writer is made, not with this module (measured start-up cost):
        # storage.database loads sqlalchemy and alembic, ~0.25 s of importing the collector.
        from storage.database import StoreBusy
    except ImportError:
        return ()
    return (StoreBusy,)


class BatchWriter:
    """The rows polled and not yet stored (:attr:`pending`), written to ``store`` for the cluster
    named ``cluster`` by :meth:`flush`; its counts go to ``stats``."""

    def __init__(self, store: Any, cluster: str, stats: CollectorStats) -> None:
        self.store = store
        self.cluster = cluster
        self.stats = stats
        self.pending = Batch()
        self._inflight: Batch | None = None  # the batch a flush is writing
        self._busy = _store_busy_types()
        self._lock = asyncio.Lock()

    @property
    def pending_rows(self) -> int:
        """Rows polled and not yet stored (a batch the store is writing or refused included)."""
        return len(self.pending) + (len(self._inflight) if self._inflight is not None else 0)

    def add(self, replica: str, result: PollResult) -> None:
        """Queue one poll's rows (its completions and cursor only when its /state was read)."""
        p = self.pending
        p.samples.append(result.sample)
        p.group_samples.extend(result.groups)
        if result.cursor is not None:
            p.completions.extend(result.completions)
            p.cursors[replica] = result.cursor
            if result.instance is not None:
                p.instances[replica] = result.instance
        if result.settings_seen is not None:
            p.settings_seen.append(result.settings_seen)
        if result.breaker_trip is not None:
            p.settings_changes.append(result.breaker_trip)

    async def flush(self, *, final: bool = False, deadline_s: float = 60.0) -> int:
        """Write what is pending as one batch; returns the rows written (0 if the store was busy:
        the rows stay pending for the next flush). ``final`` writes until nothing is pending,
        trying a busy store again until ``deadline_s`` and then raising."""
        async with self._lock:
            if not final:
                try:
                    return await self._write_pending()
                except self._busy:
                    self.stats.pending_rows = len(self.pending)
                    return 0
            return await STORE_BUSY.replace(deadline_s=deadline_s).call_async(
                self._drain, on=self._busy
            )

    async def _drain(self) -> int:
        """Write batches until nothing is pending (rows polled meanwhile included); the rows of
        the last one."""
        while True:
            written = await self._write_pending()
            if not len(self.pending):
                return written

    async def _write_pending(self) -> int:
        """Write what is pending as one batch (nothing when nothing is); its rows. A batch the
        store refuses is put back in front of what arrived meanwhile, and the error raised."""
        batch, self.pending = self.pending, Batch()
        if not len(batch) and not batch.cursors:
            return 0
        self._inflight = batch
        try:
            try:
                await asyncio.to_thread(self.store.recordings.write, self.cluster, batch)
            finally:
                self._inflight = None
        except self._busy:
            self.stats.busy_retries += 1
            self._requeue(batch)
            raise
        except BaseException:
            self._requeue(batch)
            raise
        s = self.stats
        s.batches += 1
        s.samples_written += len(batch.samples)
        s.group_samples_written += len(batch.group_samples)
        s.completions_written += len(batch.completions)
        s.rows_written += len(batch)
        s.pending_rows = len(self.pending)
        return len(batch)

    def _requeue(self, batch: Batch) -> None:
        """Put a refused batch back in front of what arrived meanwhile (newer cursors win)."""
        self.pending = batch.followed_by(self.pending)

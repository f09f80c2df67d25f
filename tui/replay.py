"""A recording as the TUI's data source: seek, step, play/pause, on the same screens as a live
cluster (:class:`tui.sources.DataSource`).

:class:`ReplaySource` reads a recording through :class:`storage.store.Store`: ``seek(t_ms)`` gives
the snapshot as of ``t`` (``ReadingRepository.latest_samples(at_ms)``), ``step(±1)`` moves one
sample of the reference replica, ``play``/``pause`` at a speed. It is read-only by construction:
it has no way to reach a replica. :func:`parse_seek` reads where the operator asks to go.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import re
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, cast

from controlplane.governance import GovernanceReport
from controlplane.snapshot import ClusterSnapshot, Health, ReplicaSnapshot
from scheduler import contract
from storage.control import ControllerName
from storage.rows import GroupSampleRow, SampleRow
from tui.sources import (
    DEFAULT_HISTORY_S,
    ReplayError,
    fmt_offset,
    fmt_time,
    kept_verifications,
    latest_fidelity,
)

if TYPE_CHECKING:  # annotations only: the caller opens the store
    from storage.store import Store

if TYPE_CHECKING:  # annotations only: the caller opens the store
    pass


def pick_cluster(store: Store, cluster_name: str | None = None) -> str:
    """The cluster to replay: the named one, or the only one the store holds."""
    clusters = store.recordings.clusters()
    if cluster_name is not None:
        if cluster_name not in clusters:
            raise ReplayError(
                f"the recording has no cluster {cluster_name!r} "
                f"(it has: {', '.join(clusters) or 'none'})"
            )
        return cluster_name
    if not clusters:
        raise ReplayError("the recording holds no cluster")
    if len(clusters) > 1:
        raise ReplayError(
            f"the recording holds {len(clusters)} clusters ({', '.join(clusters)}); "
            f"name one with --cluster-name"
        )
    return clusters[0]


class _ReplicaCache:
    __slots__ = ("groups", "samples", "times")

    def __init__(self, samples: list[SampleRow], groups: list[GroupSampleRow]) -> None:
        self.samples = samples
        self.times = [s.t_ms for s in samples]
        self.groups: dict[int, list[GroupSampleRow]] = {}
        for g in groups:
            self.groups.setdefault(g.t_ms, []).append(g)


class ReplaySource:
    """A recording as a data source: seek, step, play/pause. Read-only by construction."""

    mode = "replay"
    readonly = True

    def __init__(
        self,
        store: Store,
        cluster_name: str | None = None,
        *,
        history_s: float = DEFAULT_HISTORY_S,
        speed: float = 1.0,
        start_ms: int | None = None,
        chunk_s: float = 900.0,
    ) -> None:
        self.store = store
        self.cluster_name = pick_cluster(store, cluster_name)
        rng = store.recordings.time_range(self.cluster_name)
        if rng is None:
            raise ReplayError(f"the recording holds no samples of cluster {self.cluster_name!r}")
        self.history_s = float(history_s)
        self.speed = float(speed)
        self.chunk_ms = int(chunk_s * 1000)
        self.replicas = [r.name for r in store.recordings.replicas(self.cluster_name)]
        # The step grid: the sample times of the replica with the most samples in the first chunk.
        self.ticks = self._load_ticks()
        if not self.ticks:
            raise ReplayError(
                f"the recording holds no raw samples of cluster {self.cluster_name!r}"
            )
        self.start_ms, self.end_ms = self.ticks[0], self.ticks[-1]
        self.position = self.start_ms if start_ms is None else self.clamp(start_ms)
        self.playing = False
        self._audit_all = store.settings_log.settings_changes(self.cluster_name, None, 100_000)
        # replica -> (times, documents)
        self._seen: dict[str, tuple[list[int], list[dict[str, Any]]]] = {}
        for row in store.settings_log.settings_seen(self.cluster_name):  # oldest first
            times, docs = self._seen.setdefault(row["replica"], ([], []))
            times.append(row["t_ms"])
            docs.append(row["settings"])
        self._cache: dict[str, _ReplicaCache] = {}
        self._cache_lo = self._cache_hi = 0
        self._wake = asyncio.Event()
        self._wake.set()  # the first snapshot is due at once
        self._latest: ClusterSnapshot | None = None
        self._play_task: asyncio.Task[None] | None = None

    def _load_ticks(self) -> list[int]:
        best: list[int] = []
        for name in self.replicas:
            times = [s.t_ms for s in self.store.readings.samples(self.cluster_name, name)]
            if len(times) > len(best):
                best = times
        return sorted(set(best))

    # --- positioning ---------------------------------------------------------------------------
    def clamp(self, t_ms: int) -> int:
        return int(min(max(t_ms, self.start_ms), self.end_ms))

    def seek(self, t_ms: int) -> int:
        """Show the recording as of ``t_ms`` (clamped to the recording); returns the position."""
        self.position = self.clamp(int(t_ms))
        self._wake.set()
        return self.position

    def step(self, n: int) -> int:
        """Move ``n`` samples (of the step grid) forward or back; returns the position."""
        if n > 0:
            i = bisect.bisect_right(self.ticks, self.position) + n - 1
        else:
            i = bisect.bisect_left(self.ticks, self.position) + n
        i = min(max(i, 0), len(self.ticks) - 1)
        self.position = self.ticks[i]
        self._wake.set()
        return self.position

    def set_playing(self, playing: bool) -> None:
        self.playing = bool(playing)
        if self.playing and self.position >= self.end_ms:
            self.position = self.start_ms
        if self.playing and (self._play_task is None or self._play_task.done()):
            self._play_task = asyncio.get_running_loop().create_task(
                self._play(), name="tailpilot-replay"
            )
        self._wake.set()

    def set_speed(self, factor: float) -> float:
        self.speed = float(min(max(self.speed * factor, 0.125), 256.0))
        return self.speed

    async def _play(self) -> None:
        while self.playing:
            i = bisect.bisect_right(self.ticks, self.position)
            if i >= len(self.ticks):
                self.playing = False
                self._wake.set()
                return
            gap = (self.ticks[i] - self.position) / 1000.0
            await asyncio.sleep(max(min(gap / self.speed, 5.0), 0.02))
            if self.playing:
                self.step(1)

    # --- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        self.playing = False
        if self._play_task is not None:
            self._play_task.cancel()
            with contextlib.suppress(BaseException):
                await self._play_task

    # --- data ----------------------------------------------------------------------------------
    async def next_snapshot(self) -> ClusterSnapshot:
        await self._wake.wait()
        self._wake.clear()
        snap = await asyncio.to_thread(self.snapshot_at, self.position)
        self._latest = snap
        return snap

    def current(self) -> ClusterSnapshot | None:
        return self._latest

    def _ensure_cache(self, pos: int) -> None:
        lo_needed = pos - int(self.history_s * 1000)
        if self._cache and self._cache_lo <= lo_needed and pos < self._cache_hi:
            return
        lo, hi = lo_needed - self.chunk_ms // 2, pos + self.chunk_ms
        cache = {}
        for name in self.replicas:
            cache[name] = _ReplicaCache(
                self.store.readings.samples(self.cluster_name, name, lo, hi),
                self.store.readings.group_samples(self.cluster_name, name, lo, hi),
            )
        self._cache, self._cache_lo, self._cache_hi = cache, lo, hi

    def settings_at(self, replica: str, t_ms: int) -> dict[str, Any] | None:
        """The replica's settings document as of ``t_ms``: the newest one the collector saw it run,
        else (a recording older than that record) the newest change applied through tailpilot's
        audit log; None if neither knows."""
        times, docs = self._seen.get(replica, ((), ()))
        i = bisect.bisect_right(times, t_ms)
        if i:
            return docs[i - 1]
        for row in self._audit_all:  # newest first
            if (
                row["replica"] == replica
                and row["t_ms"] <= t_ms
                and row["result"] == "applied"
                and row["new"]
            ):
                applied: dict[str, Any] = row["new"]
                return applied
        return None

    def snapshot_at(self, t_ms: int) -> ClusterSnapshot:
        """The cluster as recorded at ``t_ms``: each replica's newest sample at or before it."""
        rows = self.store.readings.latest_samples(self.cluster_name, at_ms=t_ms)
        self._ensure_cache(t_ms)
        replicas: dict[str, ReplicaSnapshot] = {}
        for name in sorted(rows):
            row = rows[name]
            cache = self._cache.get(name)
            groups = list(cache.groups.get(row.t_ms, ())) if cache is not None else []
            settings = self.settings_at(name, t_ms)
            replicas[name] = ReplicaSnapshot(
                name=name,
                health=Health(healthy=row.healthy, reason=row.reason, since=None, mode="replay"),
                sample=row,
                groups=groups,
                settings=settings,
                settings_version=row.settings_version,
                state=None,
                metrics={},
                cursor=0,
                window_completions=sum(g.completed for g in groups if g.kind == "tenant"),
                rejected=dict(row.rejected or {}),
                # The trips as recorded (the details of each are in the audit log).
                breaker=contract.Breaker(trips_total=row.breaker_trips)
                if row.breaker_trips is not None
                else None,
            )
        return ClusterSnapshot(
            cluster=self.cluster_name,
            t_ms=t_ms,
            replicas=replicas,
            governance=self.governance_at(t_ms),
        )

    def history(self, replica: str, until_ms: int | None = None) -> list[SampleRow]:
        until = self.position if until_ms is None else until_ms
        self._ensure_cache(until)
        cache = self._cache.get(replica)
        if cache is None:
            return []
        lo = until - int(self.history_s * 1000)
        i, j = bisect.bisect_left(cache.times, lo), bisect.bisect_right(cache.times, until)
        return cache.samples[i:j]

    def kv_trail(self, replica: str, n: int) -> list[float]:
        cache = self._cache.get(replica)
        if cache is None:
            return []
        j = bisect.bisect_right(cache.times, self.position)
        out = [s.kv_usage for s in cache.samples[max(0, j - 4 * n) : j] if s.kv_usage is not None]
        return out[-n:]

    async def audit(self, limit: int = 200) -> list[dict[str, Any]]:
        return [r for r in self._audit_all if r["t_ms"] <= self.position][:limit]

    async def fidelity(self) -> dict[str, dict[str, Any]]:
        # The reports made by the replay position: what an operator knew at that time.
        return await asyncio.to_thread(
            latest_fidelity, self.store, self.cluster_name, self.position
        )

    async def alert_events(self, limit: int = 200) -> list[dict[str, Any]]:
        return await asyncio.to_thread(
            self.store.governance.alert_events,
            self.cluster_name,
            until_ms=self.position + 1,
            limit=limit,
        )

    async def control(self, controller: ControllerName) -> dict[str, Any] | None:
        # A control row is not history: the audit panel shows what the controller did (who =
        # governor, autopilot).
        return None

    def governance_at(self, t_ms: int) -> GovernanceReport | None:
        """The newest governance window stored at or before ``t_ms``, with the alerts firing
        then (only the alerts when no window was stored by then: the views read every figure
        with ``get``)."""
        found = self.store.governance.windows(self.cluster_name, until_ms=t_ms + 1, limit=1)
        firing = {
            e["name"]: e["severity"]
            for e in self.store.governance.firing_alerts(self.cluster_name, at_ms=t_ms)
        }
        if not found and not firing:
            return None
        return cast(GovernanceReport, {**(found[0]["summary"] if found else {}), "alerts": firing})

    async def verifications(self) -> dict[tuple[str, int | None], dict[str, Any]]:
        return await asyncio.to_thread(
            kept_verifications, self.store, self.cluster_name, self.position
        )

    def status(self) -> str:
        state = "▶ playing" if self.playing else "⏸ paused"
        return (
            f"REPLAY {fmt_time(self.position)} UTC · "
            f"+{fmt_offset(self.position - self.start_ms)} of "
            f"{fmt_offset(self.end_ms - self.start_ms)} · {state} · {self.speed:g}x"
        )


# ------------------------------------------------------------------------------------------ seeking

_DURATION = re.compile(r"^(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s?)?$")


def _duration_ms(text: str) -> int | None:
    text = text.strip().lower()
    if not text:
        return None
    if ":" in text:  # mm:ss or h:mm:ss offset
        parts = text.split(":")
        if not all(p.replace(".", "", 1).isdigit() for p in parts) or len(parts) > 3:
            return None
        total = 0.0
        for p in parts:
            total = total * 60 + float(p)
        return int(total * 1000)
    m = _DURATION.match(text)
    if not m or not any(m.groups()):
        return None
    h, mi, s = (float(x) if x else 0.0 for x in m.groups())
    return int((h * 3600 + mi * 60 + s) * 1000)


def parse_seek(text: str, *, position_ms: int, start_ms: int, end_ms: int) -> int:
    """Where ``text`` asks to go, in ms since the epoch (not clamped).

    Accepted: ``+30s`` / ``-2m`` (relative to the position), ``@1:30`` / ``@90s`` (offset from the
    start of the recording), ``start`` / ``end``, an ISO time ``2023-11-14T22:15:00`` (UTC unless
    it names a zone), a UTC clock time ``22:15:00`` (on the recording's days), or epoch ms.
    Raises ValueError with what is accepted.
    """
    raw = text.strip()
    low = raw.lower()
    if low in ("start", "begin", "0"):
        return start_ms
    if low == "end":
        return end_ms
    if low[:1] in "+-" and (d := _duration_ms(low[1:])) is not None:
        return position_ms + (d if low[0] == "+" else -d)
    if low.startswith("@") and (d := _duration_ms(low[1:])) is not None:
        return start_ms + d
    if raw.isdigit() and len(raw) >= 12:
        return int(raw)
    if re.fullmatch(r"\d{1,2}:\d{2}(:\d{2}(\.\d+)?)?", raw):
        day = datetime.fromtimestamp(start_ms / 1000, tz=UTC)
        parts = [float(p) for p in raw.split(":")]
        h, m, s = [*parts, 0.0][:3]
        base = day.replace(hour=0, minute=0, second=0, microsecond=0).timestamp() * 1000
        t = int(base + (h * 3600 + m * 60 + s) * 1000)
        while t < start_ms - 12 * 3600 * 1000:
            t += 86_400_000
        return t
    with contextlib.suppress(ValueError):
        dt = datetime.fromisoformat(raw.replace(" ", "T", 1))
        if dt.tzinfo is None:
            dt = dt.replace(tzinfo=UTC)
        return int(dt.timestamp() * 1000)
    raise ValueError(
        f"cannot read {raw!r} as a time: use +30s / -2m, @1:30 (from the start), "
        f"22:15:00 (UTC), 2023-11-14T22:15:00, start or end"
    )

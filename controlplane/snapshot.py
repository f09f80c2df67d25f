"""What the collector knows of a cluster at one moment: the snapshot types the TUI, ``tailpilot
status`` and the Prometheus page read (``controlplane.collector.Collector.snapshot``,
``controlplane.poller.poll_once``).

They are plain data: a snapshot is built on the collector's event loop and read elsewhere (the
TUI's thread, a test), and nothing in it changes once made.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from controlplane.governance import GovernanceReport
from scheduler import contract
from storage.rows import GroupSampleRow, SampleRow


@dataclass(slots=True)
class Health:
    """A replica's health as its polls found it."""

    healthy: bool = False
    reason: str | None = "not polled yet"
    since: float | None = None  # collector clock, when this health state began
    failures: int = 0  # consecutive failed polls
    mode: str = "unknown"  # "plugin" | "metrics-only" | "unknown"
    last_ok: float | None = None  # collector clock of the last successful poll


@dataclass(slots=True)
class ReplicaSnapshot:
    """Everything known about one replica after its latest poll (what the TUI shows)."""

    name: str
    health: Health
    sample: SampleRow | None
    groups: list[GroupSampleRow]
    settings: dict[str, Any] | None  # the active settings document
    settings_version: int | None
    state: contract.State | None  # the last /state document, without its completions
    metrics: dict[str, float]  # the last parsed /metrics (logical names)
    cursor: int
    window_completions: int
    # What the collector could not store as this replica sent it, per reason
    # (storage.limits.REASONS).
    rejected: dict[str, int] = field(default_factory=dict)
    # The replica's circuit breaker as its last /state reported it (contract.Breaker), None when
    # not.
    breaker: contract.Breaker | None = None


@dataclass(slots=True)
class ClusterSnapshot:
    """Every replica of a cluster after its latest poll, and the cluster's governance figures."""

    cluster: str
    t_ms: int
    replicas: dict[str, ReplicaSnapshot]
    # The newest governance report (with its alerts), or None when the cluster is not governed.
    governance: GovernanceReport | None = None

"""What the collector hands the store: plain rows, one dataclass per kind.

This module is the contract between the collector (``controlplane.collector``), which fills these,
and the store (``storage.store``), which writes them in batches. It imports nothing from either, so
both sides and their tests can build rows without a database.

Times: samples are keyed by integer milliseconds since the epoch on the collector's clock;
per-request times are float seconds on the replica's own clock (a twin replica's clock may run
faster than the wall clock; latencies are differences on one clock, so they stay faithful).
Latency percentiles are in seconds, ``None`` when the window held no request.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

PERCENTILES: tuple[int, ...] = (50, 90, 95, 99)
LATENCIES: tuple[str, ...] = ("ttft", "ttlt", "tbt")
# Column names of the windowed tail percentiles, e.g. "ttft_p99" (the same names as
# metrics.METRICS).
PERCENTILE_FIELDS: tuple[str, ...] = tuple(f"{lat}_p{q}" for lat in LATENCIES for q in PERCENTILES)


@dataclass(slots=True)
class LatencyPercentiles:
    ttft_p50: float | None = None
    ttft_p90: float | None = None
    ttft_p95: float | None = None
    ttft_p99: float | None = None
    ttlt_p50: float | None = None
    ttlt_p90: float | None = None
    ttlt_p95: float | None = None
    ttlt_p99: float | None = None
    tbt_p50: float | None = None
    tbt_p90: float | None = None
    tbt_p95: float | None = None
    tbt_p99: float | None = None


@dataclass(slots=True)
class SampleRow:
    """One replica's state at one poll."""

    replica: str
    t_ms: int
    healthy: bool
    reason: str | None = (
        None  # why unhealthy ("timeout after 2.0 s", "HTTP 500", "bad JSON at ...")
    )
    policy: str | None = None
    settings_version: int | None = None
    waiting: int | None = None
    running: int | None = None
    kv_usage: float | None = None  # 0..1
    kv_used_blocks: int | None = None
    kv_total_blocks: int | None = None
    gamma_live: float | None = None
    beta_live: float | None = None
    throughput_tok_s: float | None = None  # output tokens/s over the window
    throughput_req_s: float | None = None
    preemptions_per_s: float | None = None
    latency: LatencyPercentiles = field(default_factory=LatencyPercentiles)
    breaker_trips: int | None = (
        None  # the replica's circuit-breaker trips since it started; None: not reported
    )
    # Values from the replica the collector could not store as sent, per reason
    # (storage.limits.REASONS), since the collector started; None when there were none.
    rejected: dict[str, int] | None = None


@dataclass(slots=True)
class GroupSampleRow:
    """The same window for one tenant or one request type of one replica."""

    replica: str
    t_ms: int
    kind: str  # "tenant" | "type"
    group: str
    completed: int  # requests in the window
    throughput_tok_s: float | None = None
    latency: LatencyPercentiles = field(default_factory=LatencyPercentiles)


@dataclass(slots=True)
class CompletionRow:
    """One finished request, as the replica's control API reported it."""

    replica: str
    request_id: str
    tenant: str
    type: str
    arrival_s: float
    first_token_s: float | None
    finished_s: float
    prompt_tokens: int
    output_tokens: int
    preemptions: int
    recomputed_tokens: int = 0
    reason: str = "finished"
    max_tokens: int | None = None  # the client's cap; None when the replica did not report it
    received_s: float | None = (
        None  # when the engine core got it (arrival_s: the API server); None: not reported
    )


@dataclass(slots=True)
class SettingsSeenRow:
    """A replica's settings document, seen at a new (instance, version)."""

    replica: str
    t_ms: int
    version: int | None
    instance: str | None
    settings: dict[str, Any]


# The audit rows the collector writes when a replica's circuit breaker trips (who, result).
BREAKER_WHO = "engine"
BREAKER_RESULT = "breaker"


@dataclass(slots=True)
class SettingsChangeRow:
    """An entry of the settings audit log written with a batch (the collector's: a replica's
    circuit breaker tripped, ``who="engine"``); ``SettingsLog.record_settings_change`` writes the
    others."""

    replica: str
    t_ms: int
    who: str
    result: str
    message: str | None = None
    version: int | None = None
    old: dict[str, Any] | None = None
    new: dict[str, Any] | None = None


@dataclass(slots=True)
class GovernanceRow:
    """A cluster's multi-tenant figures over one window (``controlplane.governance``'s
    ``GovernanceReport``, kept as JSON)."""

    t_ms: int
    summary: Mapping[str, Any]


@dataclass(slots=True)
class AlertRow:
    """A governance alert's transition: ``state`` "firing" (at ``severity``) or "resolved"."""

    t_ms: int
    name: str  # "scr" | "jfi" | "type_fairness"
    severity: str  # "warning" | "critical"
    state: str  # "firing" | "resolved"
    summary: dict[str, Any]  # the value, the threshold and the window's figures


@dataclass(slots=True)
class Batch:
    """Everything one collector flush writes, in one transaction.

    ``cursors`` maps replica name -> the control API cursor after the completions in this batch;
    storing it in the same transaction as the completions is what makes a restart lose and
    duplicate nothing. ``instances`` names the replica incarnation each cursor counts in, so a
    replica restarted while nothing recorded it is read again from 0.
    """

    samples: list[SampleRow] = field(default_factory=list)
    group_samples: list[GroupSampleRow] = field(default_factory=list)
    completions: list[CompletionRow] = field(default_factory=list)
    cursors: dict[str, int] = field(default_factory=dict)
    instances: dict[str, str] = field(
        default_factory=dict
    )  # replica -> the instance its cursor counts in
    settings_seen: list[SettingsSeenRow] = field(default_factory=list)
    settings_changes: list[SettingsChangeRow] = field(
        default_factory=list
    )  # audit rows (breaker trips)
    governance: list[GovernanceRow] = field(default_factory=list)  # cluster-level
    alerts: list[AlertRow] = field(default_factory=list)  # cluster-level

    def followed_by(self, newer: Batch) -> Batch:
        """This batch and a newer one as one: rows in order, the newer cursors (and instances)
        win."""
        merged = {}
        for f in fields(Batch):
            old, new = getattr(self, f.name), getattr(newer, f.name)
            merged[f.name] = old | new if isinstance(old, dict) else old + new
        return Batch(**merged)

    def __len__(self) -> int:
        return (
            len(self.samples)
            + len(self.group_samples)
            + len(self.completions)
            + len(self.settings_seen)
            + len(self.settings_changes)
            + len(self.governance)
            + len(self.alerts)
        )

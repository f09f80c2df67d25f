"""The cluster file's ``governance`` block — its tenants and types (what seed 003's figures judge
them by), the alert thresholds and the governor's — and the alerts the figures raise
(:class:`AlertEvaluator`). The figures themselves (SCR, JFI, type fairness, ω) are computed by
``scheduler.metrics.fairness.report``, their one implementation (docs/governance.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from scheduler.metrics.fairness import FairnessReport
from scheduler.settings import DEFAULT_TENANT_SLO, Name, SloFqParams, TenantSlo, check_shares

__all__ = [
    "ALERT_NAMES",
    "AlertEvaluator",
    "AlertThresholds",
    "GovernanceReport",
    "GovernanceSpec",
    "GovernorSpec",
]


class GovernanceReport(FairnessReport):
    """The cluster's governance figures as the collector publishes them (``Collector.governance``,
    the TUI's snapshot, the store's governance windows, the governor's input): the window's
    :class:`~scheduler.metrics.fairness.FairnessReport` and the alerts they raise."""

    alerts: dict[str, str]  # alert -> severity firing
    alerts_pending: dict[str, str]  # alert -> severity, its condition not yet held for for_s
    alert_values: dict[str, float]  # alert -> the figure it was last judged on
    t_ms: int


class AlertThresholds(BaseModel):
    """When the governance alerts fire (seed 003 §9 item 1 and inference 7), and how long a
    condition must hold before an alert fires (``for_s``) or resolves (``keep_firing_for_s``), as
    Prometheus rules' ``for`` and ``keep_firing_for``."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    scr_warning: float = Field(0.95, ge=0.0, le=1.0)
    scr_critical: float = Field(0.90, ge=0.0, le=1.0)
    jfi: float = Field(0.90, ge=0.0, le=1.0)
    type_fairness: float = Field(0.5, ge=0.0, le=100.0)
    # Half a default window below the threshold before firing, a whole one back above before
    # resolving: a figure over a 60-s window that dips for a poll or two is noise, not an incident.
    for_s: float = Field(30.0, ge=0.0, le=86_400.0)
    keep_firing_for_s: float = Field(60.0, ge=0.0, le=86_400.0)

    @field_validator("scr_critical")
    @classmethod
    def _critical_below_warning(cls, v: float, info: ValidationInfo) -> float:
        warning = info.data.get("scr_warning")
        if warning is not None and v > warning:
            raise ValueError(f"scr_critical ({v:g}) must not exceed scr_warning ({warning:g})")
        return v

    def threshold(self, alert: str, severity: str | None) -> float:
        """The figure below which ``alert`` fires at ``severity`` (SCR: warning or critical)."""
        if alert == "scr":
            return self.scr_critical if severity == "critical" else self.scr_warning
        return self.jfi if alert == "jfi" else self.type_fairness


class GovernorSpec(BaseModel):
    """Thresholds of the governor's emergency modes (the cluster file's ``governance.governor``;
    controlplane/governor.py acts on them)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    scr_below: float = Field(0.85, ge=0.0, le=1.0)
    jfi_below: float = Field(0.80, ge=0.0, le=1.0)
    type_fairness_below: float = Field(0.40, ge=0.0, le=100.0)
    type_sustain_s: float = Field(30.0, ge=0.0, le=86_400.0)
    throttle_fraction: float = Field(0.5, gt=0.0, le=1.0)
    dwell_s: float = Field(60.0, ge=0.0, le=86_400.0)
    # Throttle tenants even where a replica's tenant labels are the clients' own
    # (TAILPILOT_TENANT_SOURCE=client: anyone can name any tenant). Off: a throttle is applied
    # only where every replica's labels come from a signing gateway (or tenants are off).
    trust_client_labels: bool = False


class GovernanceSpec(BaseModel):
    """A cluster's tenants, types and alert thresholds (the cluster file's ``governance``)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    # Names and sizes as slofq's parameters take them (``params`` must not fail later).
    tenants: dict[Name, TenantSlo] = Field(default_factory=dict, max_length=10_000)
    default_tenant: TenantSlo = Field(
        default_factory=lambda: TenantSlo.model_validate(DEFAULT_TENANT_SLO)
    )
    type_shares: dict[Name, float] = Field(default_factory=dict, max_length=1_000)
    type_eta: float = Field(0.5, ge=0.0, le=1e6)
    alerts: AlertThresholds = Field(default_factory=AlertThresholds)
    governor: GovernorSpec = Field(default_factory=GovernorSpec)

    _shares = field_validator("type_shares")(check_shares)

    def params(self) -> SloFqParams:
        """The same tenants and types as slofq parameters (what the figures are judged by)."""
        return SloFqParams.model_validate(self.model_dump(exclude={"alerts", "governor"}))


# --------------------------------------------------------------------------------------------
# alerts
# --------------------------------------------------------------------------------------------

ALERT_NAMES = ("scr", "jfi", "type_fairness")
_FIGURE_OF = {"scr": "scr", "jfi": "jfi", "type_fairness": "type_fairness_min"}
_SEVERITIES = {"scr": ("warning", "critical"), "jfi": ("warning",), "type_fairness": ("warning",)}


@dataclass(slots=True)
class _Rule:
    """One alert at one severity, as a Prometheus rule: pending ``since`` the condition first
    held, firing after ``for_s``; once firing, resolving ``ok_since`` the condition last failed."""

    since: float | None = None
    firing: bool = False
    ok_since: float | None = None


class AlertEvaluator:
    """Each window's figures in, alert transitions out. Per alert and severity a rule like
    Prometheus's: its figure below the threshold for ``for_s`` fires it, back at or above it for
    ``keep_firing_for_s`` resolves it; an alert's severity is its most severe firing rule. A
    figure with no data (no request in the window) changes nothing. ``evaluate`` without ``now``
    judges the figures alone (no hold either way: ``tailpilot status``'s one-shot poll)."""

    def __init__(self, thresholds: AlertThresholds) -> None:
        self.thresholds = thresholds
        self.active: dict[str, str] = {}  # alert -> severity firing
        # alert -> the figure it was last judged on: kept through windows without data, as the
        # alert itself is (what the exported Prometheus rules compare with the thresholds)
        self.value: dict[str, float] = {}
        self.rules: dict[tuple[str, str], _Rule] = {}

    def severity(self, name: str, value: float) -> str | None:
        """The severity ``value`` calls for right now (no hold)."""
        t = self.thresholds
        if name == "scr":
            return (
                "critical"
                if value < t.scr_critical
                else "warning"
                if value < t.scr_warning
                else None
            )
        return "warning" if value < t.threshold(name, "warning") else None

    def pending(self) -> dict[str, str]:
        """Alerts whose condition holds but not yet for ``for_s``: alert -> severity."""
        out: dict[str, str] = {}
        for (name, sev), rule in self.rules.items():
            if rule.since is not None and not rule.firing:
                out[name] = sev
        return out

    def evaluate(
        self, figures: Mapping[str, Any], now: float | None = None
    ) -> list[dict[str, Any]]:
        """Transitions: dicts with name, severity, state ("firing" | "resolved") and summary."""
        hold, keep = (
            (0.0, 0.0)
            if now is None
            else (self.thresholds.for_s, self.thresholds.keep_firing_for_s)
        )
        t = 0.0 if now is None else now
        out = []
        for name in ALERT_NAMES:
            value = figures.get(_FIGURE_OF[name])
            if value is None:
                continue
            self.value[name] = value
            current = self.active.get(name)
            for sev in _SEVERITIES[name]:
                rule = self.rules.setdefault((name, sev), _Rule())
                if current is not None and _rank(name, sev) <= _rank(name, current):
                    rule.firing = True  # restored from the store, or set by an operator's tool
                if value < self.thresholds.threshold(name, sev):
                    rule.ok_since = None
                    rule.since = t if rule.since is None else rule.since
                    rule.firing = rule.firing or t - rule.since >= hold
                else:
                    rule.since = None
                    if rule.firing:
                        rule.ok_since = t if rule.ok_since is None else rule.ok_since
                        if t - rule.ok_since >= keep:
                            rule.firing, rule.ok_since = False, None
            firing = [sev for sev in _SEVERITIES[name] if self.rules[(name, sev)].firing]
            severity = firing[-1] if firing else None
            if severity == current:
                continue
            summary = {
                "value": value,
                "threshold": self.thresholds.threshold(name, severity or current),
                "figures": {
                    k: figures.get(k) for k in ("scr", "jfi", "jfi_seed", "type_fairness_min")
                },
                "missed": {
                    t_: f["missed"] for t_, f in figures.get("tenants", {}).items() if f["missed"]
                },
            }
            if severity is None:
                del self.active[name]
                out.append(
                    {"name": name, "severity": current, "state": "resolved", "summary": summary}
                )
            else:
                self.active[name] = severity
                out.append(
                    {"name": name, "severity": severity, "state": "firing", "summary": summary}
                )
        return out


def _rank(name: str, severity: str) -> int:
    return _SEVERITIES[name].index(severity)

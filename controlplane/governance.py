"""Seed 003's multi-tenant figures of a set of completions, against the tenants' SLOs and
commitments (a slofq settings document's, or a cluster file's ``governance`` block), and the
alerts they raise. The one implementation of SCR, JFI, type fairness and ω: the collector, the
store's governance windows, ``capacity``, the Prometheus page, the TUI and the tuner
(``scheduler.metrics.fairness_summary``) all read these. Definitions and a worked example:
docs/governance.md.

    report = window_report(completions, params, duration_s=10.0, waiting={"c": {"requests": 3, "waited_s": 12.0}})
    report["scr"], report["jfi"], report["jfi_seed"], report["type_fairness_min"], report["tenants"]["acme"]["omega"]

* **SCR** (SLO compliance ratio, the seed's): the fraction of tenants meeting *every* quantile
  target they have (TTFT, and TTLT where set). A tenant counts when it asked for something in the
  window: it has completions, or requests waiting (``waiting``). A tenant with waiting requests and
  no completion is judged on its wait so far, a lower bound of its latency: it misses a tail
  target (its highest TTFT/TTLT quantile) that wait already exceeds.
* **JFI** (what alerts and the governor act on): Jain's index over each tenant's service ratio
  x_j = min(1, served_j / E_j), where E_j is its entitlement capped by its demand: the window's
  served tokens shared by the tenants' weights (slofq's base weights: commitments, or weights, on
  one scale), each capped by what the tenant asked for (served + waiting), the share a capped
  tenant leaves redistributed (weighted max-min). JFI = 1 when every tenant got all it asked for
  or its share; it falls when a tenant with unmet demand got less than its share — "a tenant is
  being suppressed", what the seed says JFI is for.
* **JFI (seed)** ``jfi_seed``: the seed's literal figure, Jain's index over Û_j = served rate /
  committed rate (commit_tok_s; a tenant with a weight instead: its weight's share of the served
  rate). Reported beside JFI, never acted on: it reads < 1 whenever commitments and demands differ.
* **ω** = min(C_j / U_j, α) (seed 003's consumption protection; α = ``protection_alpha``, 4 when
  off): C_j the committed rate as above, U_j the served rate. ω < 1: the tenant uses more than its
  commitment (an over-consumer, ``over_consumers``).
* **Type fairness**: each type's share of the completed requests over its guaranteed share: its
  minimum share ρ_k (the explicit shares, else seed 003's (1/|T|) / (1 + η·p_k) from the types'
  shares p_k of the requests asked for), but never more than p_k itself (a type that asks for less
  than ρ_k is not starved). The requests asked for are the window's completions and, where known,
  those still waiting (``arrived``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from pydantic import BaseModel, ConfigDict, Field, field_validator

import numpy as np

from controlplane.governor import GovernorSpec
from scheduler.metrics import Completion, distribution_stats, jain_index
from scheduler.settings import DEFAULT_TENANT_SLO, QUANTILES, SloFqParams, TenantSlo, check_shares

DEFAULT_ALPHA = 4.0  # ω's cap where consumption protection is off (slofq's default protection_alpha)


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
    def _critical_below_warning(cls, v: float, info) -> float:
        warning = info.data.get("scr_warning")
        if warning is not None and v > warning:
            raise ValueError(f"scr_critical ({v:g}) must not exceed scr_warning ({warning:g})")
        return v

    def threshold(self, alert: str, severity: str | None) -> float:
        """The figure below which ``alert`` fires at ``severity`` (SCR: warning or critical)."""
        if alert == "scr":
            return self.scr_critical if severity == "critical" else self.scr_warning
        return self.jfi if alert == "jfi" else self.type_fairness


class GovernanceSpec(BaseModel):
    """A cluster's tenants, types and alert thresholds (the cluster file's ``governance``)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    tenants: dict[str, TenantSlo] = Field(default_factory=dict)
    default_tenant: TenantSlo = Field(default_factory=lambda: TenantSlo.model_validate(DEFAULT_TENANT_SLO))
    type_shares: dict[str, float] = Field(default_factory=dict)
    type_eta: float = Field(0.5, ge=0.0, le=1e6)
    alerts: AlertThresholds = Field(default_factory=AlertThresholds)
    governor: GovernorSpec = Field(default_factory=GovernorSpec)

    _shares = field_validator("type_shares")(check_shares)

    def params(self) -> SloFqParams:
        """The same tenants and types as slofq parameters (what the figures are judged by)."""
        return SloFqParams.model_validate(self.model_dump(exclude={"alerts", "governor"}))


def limits(params: SloFqParams, tenant: str) -> dict[str, float]:
    """The tenant's targets as metric limits (``ttft_p99`` → seconds)."""
    out: dict[str, float] = {}
    for family, slo in (("ttft", params.ttft_slo(tenant)), ("ttlt", params.tenant(tenant).ttlt)):
        if slo is not None:
            out.update({f"{family}_{q}": v for q, v in slo.targets().items()})
    return out


def minimum_shares(params: SloFqParams, arrived: Mapping[str, float]) -> dict[str, float]:
    """ρ_k: the explicit shares, else (1/|T|) / (1 + η·p_k) from ``arrived`` (requests per type)."""
    return _minimum_shares(params.type_shares, params.type_eta, arrived)


def _minimum_shares(explicit: Mapping[str, float], eta: float, arrived: Mapping[str, float]) -> dict[str, float]:
    if explicit:
        return dict(explicit)
    total = sum(arrived.values())
    if not total:
        return {}
    n = len(arrived)
    return {k: (1.0 / n) / (1.0 + eta * v / total) for k, v in arrived.items()}


@dataclass(frozen=True)
class Terms:
    """What the figures judge tenants and types by: per tenant its limits (``ttft_p99`` → s), its
    weight on one scale, its committed rate (tok/s, or None: a share of the served rate), ω's cap
    α, and the types' explicit minimum shares (else seed 003's formula with ``eta``)."""

    limits: Callable[[str], dict[str, float]]
    weight: Callable[[str], float]
    committed: Callable[[str], float | None]
    alpha: float = DEFAULT_ALPHA
    type_shares: Mapping[str, float] = field(default_factory=dict)
    eta: float = 0.5

    @classmethod
    def of(cls, params: SloFqParams) -> "Terms":
        """A slofq document's (or a cluster's ``governance``) tenants and types."""
        return cls(limits=lambda t: limits(params, t), weight=params.base_weight,
                   committed=lambda t: params.tenant(t).commit_tok_s,
                   alpha=params.protection_alpha or DEFAULT_ALPHA, type_shares=dict(params.type_shares),
                   eta=params.type_eta)


def water_fill(capacity: float, weights: Mapping[str, float], demands: Mapping[str, float]) -> dict[str, float]:
    """Weighted max-min fair shares of ``capacity``: each tenant its weight's share, never more
    than its demand, what a capped tenant leaves shared again among the others."""
    out = {t: 0.0 for t in demands}
    open_ = {t for t, d in demands.items() if d > 0}
    left = float(capacity)
    while open_ and left > 1e-12:
        total_w = sum(weights[t] for t in open_)
        capped = {t for t in open_ if demands[t] - out[t] <= left * weights[t] / total_w}
        if not capped:  # nobody is satisfied by its share: everyone gets it
            for t in open_:
                out[t] += left * weights[t] / total_w
            break
        for t in capped:
            left -= demands[t] - out[t]
            out[t] = demands[t]
        open_ -= capped
    return out


def completion_columns(completions: Iterable[Completion]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(tenant, type, TTFT, TTLT, tokens) of completions: the columns ``report`` takes."""
    done = list(completions)
    return (np.array([c.tenant for c in done], dtype=object), np.array([c.type for c in done], dtype=object),
            np.array([c.first_token_at - c.arrival for c in done], dtype=np.float64),
            np.array([c.finished_at - c.arrival for c in done], dtype=np.float64),
            np.array([c.prompt_tokens + c.output_tokens for c in done], dtype=np.float64))


def window_report(completions: Iterable[Completion], params: SloFqParams | Terms, *, duration_s: float,
                  arrived: Mapping[str, float] | None = None,
                  waiting: Mapping[str, Mapping[str, float]] | None = None) -> dict[str, Any]:
    """``report`` of ``completions`` (the requests of one window, ``duration_s`` long)."""
    return report(*completion_columns(completions), params, duration_s=duration_s, arrived=arrived, waiting=waiting)


def report(tenant: np.ndarray, rtype: np.ndarray, ttft: np.ndarray, ttlt: np.ndarray, tokens: np.ndarray,
           params: SloFqParams | Terms, *, duration_s: float, arrived: Mapping[str, float] | None = None,
           waiting: Mapping[str, Mapping[str, float]] | None = None) -> dict[str, Any]:
    """Per tenant and per type figures, SCR, JFI (and the seed's literal ``jfi_seed``), ω and type
    fairness of one window's requests, given as columns (tenant and type names, TTFT and TTLT in s
    — NaN where undefined — and tokens served, prompt + output). ``arrived``: requests per type
    asked for in the window (default: these requests' own types). ``waiting``: per tenant what is
    still queued at the window's end — ``requests`` (count), ``waited_s`` (how long the oldest has
    waited so far, a lower bound; 0 when unknown) and optionally ``tokens`` (else the tenant's, or
    the window's, mean tokens per completed request)."""
    terms = params if isinstance(params, Terms) else Terms.of(params)
    waiting = {t: w for t, w in (waiting or {}).items() if w.get("requests", 0) > 0}
    mean_tokens = float(tokens.mean()) if tokens.size else 1.0
    tenants: dict[str, dict[str, Any]] = {}
    for name in sorted(set(tenant.tolist()) | set(waiting)):
        rows = tenant == name
        n = int(rows.sum())
        ft, lt = distribution_stats(ttft[rows]), distribution_stats(ttlt[rows])
        figures = {**{f"ttft_{q}": _finite(ft[q]) for q in QUANTILES}, **{f"ttlt_{q}": _finite(lt[q]) for q in QUANTILES}}
        p50, p99 = figures["ttft_p50"], figures["ttft_p99"]
        figures["ttft_p99_p50"] = p99 / p50 if p50 and p99 is not None else None
        lim = terms.limits(name)
        queued = waiting.get(name, {})
        waited = float(queued.get("waited_s") or 0.0)
        if n:
            met = {k: figures[k] is not None and figures[k] <= v for k, v in lim.items()}  # type: ignore[operator]
        else:  # nothing completed: judged on the wait so far, a lower bound of its tail latency
            met = {k: not waited > v for k, v in _tail_limits(lim).items()}
        served = float(tokens[rows].sum())
        queued_tokens = float(queued.get("tokens", queued.get("requests", 0) * (served / n if n else mean_tokens)))
        tenants[name] = {**figures, "requests": n, "tok_s": served / duration_s, "served_tokens": served,
                         "waiting": int(queued.get("requests", 0)), "waited_s": waited if queued else None,
                         "starved": not n, "demand_tokens": served + queued_tokens, "limits": lim,
                         "missed": sorted(k for k, ok in met.items() if not ok), "compliant": all(met.values())}
    fair = _fairness(tenants, terms, duration_s)
    kinds = sorted(set(rtype.tolist()))
    served_k = {k: float((rtype == k).sum()) for k in kinds}
    asked = dict(arrived) if arrived is not None else dict(served_k)
    total, total_asked = sum(served_k.values()), sum(asked.values())
    rho = _minimum_shares(terms.type_shares, terms.eta, asked)
    guaranteed = {k: min(r, asked.get(k, 0.0) / total_asked) for k, r in rho.items() if total_asked}
    ratios = {k: (served_k.get(k, 0.0) / total) / g if total else None for k, g in guaranteed.items() if g > 0}
    types = {}
    for k in kinds:
        ft = distribution_stats(ttft[rtype == k])
        types[k] = {"share": served_k[k] / total if total else None, "minimum": rho.get(k), "ratio": ratios.get(k),
                    "ttft_p50": _finite(ft["p50"]), "ttft_p99": _finite(ft["p99"])}
    finite = [r for r in ratios.values() if r is not None]
    return {
        "requests": int(tenant.size), "duration_s": duration_s, "tenants": tenants, "types": types,
        "scr": (sum(t["compliant"] for t in tenants.values()) / len(tenants)) if tenants else None,
        **fair, "type_fairness": ratios, "type_fairness_min": min(finite) if finite else None,
    }


def _tail_limits(lim: Mapping[str, float]) -> dict[str, float]:
    """Each family's highest-quantile limit (``ttft_p99``, ``ttlt_p99``)."""
    out: dict[str, float] = {}
    for family in ("ttft", "ttlt"):
        given = [f"{family}_{q}" for q in QUANTILES if f"{family}_{q}" in lim]
        if given:
            out[given[-1]] = lim[given[-1]]
    return out


def _fairness(tenants: dict[str, dict[str, Any]], terms: Terms, duration_s: float) -> dict[str, Any]:
    """Fills each tenant's entitlement, service ratio, committed rate, Û and ω; returns the JFIs
    and the over-consumers."""
    if not tenants:
        return {"jfi": None, "jfi_seed": None, "over_consumers": []}
    served = {t: f["served_tokens"] for t, f in tenants.items()}
    weights = {t: terms.weight(t) for t in tenants}
    capacity = sum(served.values())  # what the cluster served in the window: the capacity shared
    entitled = water_fill(capacity, weights, {t: f["demand_tokens"] for t, f in tenants.items()})
    rate, total_w = capacity / duration_s, sum(weights.values())
    for t, f in tenants.items():
        committed = terms.committed(t)
        c = committed if committed is not None else weights[t] / total_w * rate  # a weight's share
        use = served[t] / duration_s
        f["entitled_tokens"] = entitled[t]
        f["service_ratio"] = min(1.0, served[t] / entitled[t]) if entitled[t] > 0 else None
        f["committed_tok_s"] = c
        f["normalised"] = use / c if c > 0 else None
        f["omega"] = min(c / use, terms.alpha) if use > 0 else terms.alpha
    ratios = [f["service_ratio"] for f in tenants.values() if f["service_ratio"] is not None]
    seed = [f["normalised"] for f in tenants.values() if f["normalised"] is not None]
    return {"jfi": _finite(jain_index(ratios)) if ratios else None,
            "jfi_seed": _finite(jain_index(seed)) if seed else None,
            "over_consumers": sorted(t for t, f in tenants.items() if f["omega"] < 1.0)}


def _finite(value: float) -> float | None:
    return float(value) if value is not None and math.isfinite(value) else None


__all__ = ["ALERT_NAMES", "AlertEvaluator", "AlertThresholds", "GovernanceSpec", "Terms",
           "completion_columns", "limits", "minimum_shares", "report", "water_fill", "window_report"]


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
            return "critical" if value < t.scr_critical else "warning" if value < t.scr_warning else None
        return "warning" if value < t.threshold(name, "warning") else None

    def pending(self) -> dict[str, str]:
        """Alerts whose condition holds but not yet for ``for_s``: alert -> severity."""
        out: dict[str, str] = {}
        for (name, sev), rule in self.rules.items():
            if rule.since is not None and not rule.firing:
                out[name] = sev
        return out

    def evaluate(self, figures: Mapping[str, Any], now: float | None = None) -> list[dict[str, Any]]:
        """Transitions: dicts with name, severity, state ("firing" | "resolved") and summary."""
        hold, keep = (0.0, 0.0) if now is None else (self.thresholds.for_s, self.thresholds.keep_firing_for_s)
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
            summary = {"value": value, "threshold": self.thresholds.threshold(name, severity or current),
                       "figures": {k: figures.get(k) for k in ("scr", "jfi", "jfi_seed", "type_fairness_min")},
                       "missed": {t_: f["missed"] for t_, f in figures.get("tenants", {}).items() if f["missed"]}}
            if severity is None:
                del self.active[name]
                out.append({"name": name, "severity": current, "state": "resolved", "summary": summary})
            else:
                self.active[name] = severity
                out.append({"name": name, "severity": severity, "state": "firing", "summary": summary})
        return out


def _rank(name: str, severity: str) -> int:
    return _SEVERITIES[name].index(severity)

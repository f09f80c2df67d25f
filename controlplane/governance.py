"""Seed 003's multi-tenant figures of a set of completions, against the tenants' SLOs and
commitments (a slofq settings document's, or a cluster file's ``governance`` block), and the
alerts they raise (docs/policies.md#slofq).

    report = window_report(completions, params, duration_s=10.0)
    report["scr"], report["jfi"], report["type_fairness_min"], report["tenants"]["acme"]["ttft_p99"]

* **SCR** (SLO compliance ratio): the fraction of tenants meeting *every* quantile target they
  have (TTFT, and TTLT where set); a tenant with no request in the window is not counted.
* **JFI**: Jain's index over the tenants' normalised throughput — tokens served (prompt +
  output) per second over their committed rate, or over their weight where they have none.
* **Type fairness**: each type's share of the completed requests over its guaranteed share: its
  minimum share ρ_k (the explicit shares, else seed 003's (1/|T|) / (1 + η·p_k) from the types'
  shares p_k of the requests asked for), but never more than p_k itself. The seed divides by ρ_k
  alone; then a type that simply asks for less than ρ_k would read as starved and raise the alert.
  The requests asked for are the window's completions and, where known, those still waiting
  (``arrived``).
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping

from pydantic import BaseModel, ConfigDict, Field, field_validator

import numpy as np

from controlplane.governor import GovernorSpec
from controlplane.metrics import Completion, distribution_stats, jain_index
from controlplane.settings import DEFAULT_TENANT_SLO, QUANTILES, SloFqParams, TenantSlo, check_shares

class AlertThresholds(BaseModel):
    """When the governance alerts fire (seed 003 §9 item 1 and inference 7)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    scr_warning: float = Field(0.95, ge=0.0, le=1.0)
    scr_critical: float = Field(0.90, ge=0.0, le=1.0)
    jfi: float = Field(0.90, ge=0.0, le=1.0)
    type_fairness: float = Field(0.5, ge=0.0, le=100.0)

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


def commitment(params: SloFqParams, tenant: str) -> float:
    """What a tenant's throughput is normalised by: its committed tokens/s, else its weight."""
    spec = params.tenant(tenant)
    if spec.commit_tok_s is not None:
        return spec.commit_tok_s
    return spec.weight if spec.weight is not None else 1.0


def minimum_shares(params: SloFqParams, arrived: Mapping[str, float]) -> dict[str, float]:
    """ρ_k: the explicit shares, else (1/|T|) / (1 + η·p_k) from ``arrived`` (requests per type)."""
    if params.type_shares:
        return dict(params.type_shares)
    total = sum(arrived.values())
    if not total:
        return {}
    n = len(arrived)
    return {k: (1.0 / n) / (1.0 + params.type_eta * v / total) for k, v in arrived.items()}


def window_report(completions: Iterable[Completion], params: SloFqParams, *, duration_s: float,
                  arrived: Mapping[str, float] | None = None) -> dict[str, Any]:
    """``report`` of ``completions`` (the requests of one window, ``duration_s`` long)."""
    done = list(completions)
    return report(np.array([c.tenant for c in done], dtype=object), np.array([c.type for c in done], dtype=object),
                  np.array([c.first_token_at - c.arrival for c in done], dtype=np.float64),
                  np.array([c.finished_at - c.arrival for c in done], dtype=np.float64),
                  np.array([c.prompt_tokens + c.output_tokens for c in done], dtype=np.float64),
                  params, duration_s=duration_s, arrived=arrived)


def report(tenant: np.ndarray, rtype: np.ndarray, ttft: np.ndarray, ttlt: np.ndarray, tokens: np.ndarray,
           params: SloFqParams, *, duration_s: float, arrived: Mapping[str, float] | None = None) -> dict[str, Any]:
    """Per tenant and per type figures, SCR, JFI and type fairness of one window's requests, given
    as columns (tenant and type names, TTFT and TTLT in s — NaN where undefined — and tokens
    served, prompt + output). ``arrived``: requests per type asked for in the window (default:
    these requests' own types)."""
    tenants: dict[str, dict[str, Any]] = {}
    for name in sorted(set(tenant.tolist())):
        rows = tenant == name
        ft, lt = distribution_stats(ttft[rows]), distribution_stats(ttlt[rows])
        figures = {**{f"ttft_{q}": _finite(ft[q]) for q in QUANTILES}, **{f"ttlt_{q}": _finite(lt[q]) for q in QUANTILES}}
        p50, p99 = figures["ttft_p50"], figures["ttft_p99"]
        figures["ttft_p99_p50"] = p99 / p50 if p50 and p99 is not None else None
        lim = limits(params, name)
        met = {k: figures[k] is not None and figures[k] <= v for k, v in lim.items()}  # type: ignore[operator]
        rate = float(tokens[rows].sum()) / duration_s
        tenants[name] = {**figures, "requests": int(rows.sum()), "tok_s": rate,
                         "normalised": rate / commitment(params, name), "limits": lim,
                         "missed": sorted(k for k, ok in met.items() if not ok), "compliant": all(met.values())}
    kinds = sorted(set(rtype.tolist()))
    served = {k: float((rtype == k).sum()) for k in kinds}
    asked = dict(arrived) if arrived is not None else dict(served)
    total, total_asked = sum(served.values()), sum(asked.values())
    rho = minimum_shares(params, asked)
    guaranteed = {k: min(r, asked.get(k, 0.0) / total_asked) for k, r in rho.items() if total_asked}
    ratios = {k: (served.get(k, 0.0) / total) / g if total else None for k, g in guaranteed.items() if g > 0}
    types = {}
    for k in kinds:
        ft = distribution_stats(ttft[rtype == k])
        types[k] = {"share": served[k] / total if total else None, "minimum": rho.get(k), "ratio": ratios.get(k),
                    "ttft_p50": _finite(ft["p50"]), "ttft_p99": _finite(ft["p99"])}
    finite = [r for r in ratios.values() if r is not None]
    return {
        "requests": int(tenant.size), "duration_s": duration_s, "tenants": tenants, "types": types,
        "scr": (sum(t["compliant"] for t in tenants.values()) / len(tenants)) if tenants else None,
        "jfi": _finite(jain_index([t["normalised"] for t in tenants.values()])) if tenants else None,
        "type_fairness": ratios, "type_fairness_min": min(finite) if finite else None,
    }


def _finite(value: float) -> float | None:
    return float(value) if value is not None and math.isfinite(value) else None


__all__ = ["ALERT_NAMES", "AlertEvaluator", "AlertThresholds", "GovernanceSpec", "commitment", "limits", "minimum_shares", "report", "window_report"]


# --------------------------------------------------------------------------------------------
# alerts
# --------------------------------------------------------------------------------------------

ALERT_NAMES = ("scr", "jfi", "type_fairness")
_FIGURE_OF = {"scr": "scr", "jfi": "jfi", "type_fairness": "type_fairness_min"}


class AlertEvaluator:
    """Each window's figures in, alert transitions out: an alert fires (or changes severity) when
    its figure crosses its threshold and resolves when it is back; a figure with no data (no
    request in the window) changes nothing."""

    def __init__(self, thresholds: AlertThresholds) -> None:
        self.thresholds = thresholds
        self.active: dict[str, str] = {}  # alert -> severity firing
        # alert -> the figure it was last judged on: kept through windows without data, as the
        # alert itself is (what the exported Prometheus rules compare with the thresholds)
        self.value: dict[str, float] = {}

    def severity(self, name: str, value: float) -> str | None:
        t = self.thresholds
        if name == "scr":
            return "critical" if value < t.scr_critical else "warning" if value < t.scr_warning else None
        return "warning" if value < t.threshold(name, "warning") else None

    def evaluate(self, figures: Mapping[str, Any]) -> list[dict[str, Any]]:
        """Transitions: dicts with name, severity, state ("firing" | "resolved") and summary."""
        out = []
        for name in ALERT_NAMES:
            value = figures.get(_FIGURE_OF[name])
            if value is None:
                continue
            self.value[name] = value
            severity, current = self.severity(name, value), self.active.get(name)
            if severity == current:
                continue
            summary = {"value": value, "threshold": self.thresholds.threshold(name, severity or current),
                       "figures": {k: figures.get(k) for k in ("scr", "jfi", "type_fairness_min")},
                       "missed": {t: f["missed"] for t, f in figures.get("tenants", {}).items() if f["missed"]}}
            if severity is None:
                del self.active[name]
                out.append({"name": name, "severity": current, "state": "resolved", "summary": summary})
            else:
                self.active[name] = severity
                out.append({"name": name, "severity": severity, "state": "firing", "summary": summary})
        return out

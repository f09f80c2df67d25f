"""The Grafana dashboard of a cluster (``tailpilot export --format grafana``): SCR, JFI and type
fairness (seed 003's checklist, coloured at the cluster's thresholds), tenants against their
targets, replicas, alerts, the governor.

The dashboard is one cluster's (its thresholds colour the governance panels) but reads every
series through its ``$cluster`` and ``$replica`` template variables (the cluster's name and all
replicas by default): :func:`~controlplane.monitoring.checks.check_dashboard` refuses a query
that does not filter on both wherever the series has the label. Every query names only series of
:data:`controlplane.series.SERIES` (checked at render time), and the dashboard is parsed back and
checked before it is returned.
"""

from __future__ import annotations

import json
from typing import Any

from controlplane.cluster import ClusterSpec
from controlplane.governance import AlertThresholds
from controlplane.monitoring.checks import (
    CLUSTER_VAR,
    GRAFANA_SCHEMA_VERSION,
    REPLICA_VAR,
    SAMPLES,
    check_dashboard,
    check_series,
    fit_name,
)

_DS = {"type": "prometheus", "uid": "${datasource}"}


def _thresholds(steps: list[tuple[float | None, str]]) -> dict[str, Any]:
    return {
        "mode": "absolute",
        "steps": [{"color": color, "value": value} for value, color in steps],
    }


class _Layout:
    """Panels placed left to right on Grafana's 24-column grid, a new row when one is full."""

    def __init__(self) -> None:
        self.panels: list[dict[str, Any]] = []
        self.x = self.y = self.row_h = 0

    def add(self, panel: dict[str, Any], w: int, h: int) -> None:
        if self.x + w > 24:
            self.x, self.y, self.row_h = 0, self.y + self.row_h, 0
        panel = {
            "id": len(self.panels) + 1,
            "gridPos": {"x": self.x, "y": self.y, "w": w, "h": h},
            "datasource": _DS,
            **panel,
        }
        self.panels.append(panel)
        self.x += w
        self.row_h = max(self.row_h, h)

    def row(self, title: str) -> None:
        if self.x:
            self.x, self.y, self.row_h = 0, self.y + self.row_h, 0
        self.panels.append(
            {
                "id": len(self.panels) + 1,
                "type": "row",
                "title": title,
                "collapsed": False,
                "gridPos": {"x": 0, "y": self.y, "w": 24, "h": 1},
                "panels": [],
            }
        )
        self.y += 1


def _targets(*queries: tuple[str, str]) -> list[dict[str, Any]]:
    return [
        {"refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend, "datasource": _DS}
        for i, (expr, legend) in enumerate(queries)
    ]


def _panel(
    kind: str,
    title: str,
    description: str,
    queries: list[tuple[str, str]],
    *,
    unit: str | None = None,
    thresholds: dict[str, Any] | None = None,
    min_: float | None = None,
    max_: float | None = None,
    **extra: Any,
) -> dict[str, Any]:
    defaults: dict[str, Any] = {}
    if unit:
        defaults["unit"] = unit
    if thresholds:
        defaults["thresholds"] = thresholds
        defaults["color"] = {"mode": "thresholds"}
    if min_ is not None:
        defaults["min"] = min_
    if max_ is not None:
        defaults["max"] = max_
    if kind == "timeseries" and thresholds:
        defaults["custom"] = {"thresholdsStyle": {"mode": "line+area"}}
    targets = _targets(*queries)
    if kind == "table":  # the values now, one row per series: instant queries merged into one table
        for t in targets:
            t.update(instant=True, range=False, format="table")
        extra.setdefault("transformations", [{"id": "merge", "options": {}}])
    return {
        "type": kind,
        "title": title,
        "description": description,
        "targets": targets,
        "fieldConfig": {"defaults": defaults, "overrides": extra.pop("overrides", [])},
        **extra,
    }


_C = f'cluster="${CLUSTER_VAR}"'
_R = f'replica=~"${REPLICA_VAR}"'
RATE_WINDOW = "$__rate_interval"  # Grafana's: at least four scrape intervals


def _q(series: str, **labels: str) -> str:
    """A selector of ``series`` on the dashboard's variables: ``$cluster`` always, ``$replica``
    where the series has a replica label, then ``labels``."""
    family = SAMPLES[series]
    inner = (
        [_C]
        + ([_R] if "replica" in family.labels else [])
        + [f'{k}="{v}"' for k, v in labels.items()]
    )
    return series + "{" + ", ".join(inner) + "}"


def _rate(series: str, by: str, **labels: str) -> str:
    return f"sum by ({by}) (rate({_q(series, **labels)}[{RATE_WINDOW}]))"


def _variables(cluster: ClusterSpec) -> list[dict[str, Any]]:
    """Datasource, then ``$cluster`` (this cluster by default, any recorder's on the datasource to
    pick) and ``$replica`` (all by default; the replicas of the picked cluster)."""

    def query(name: str, label: str, expr: str, **extra: Any) -> dict[str, Any]:
        return {
            "name": name,
            "label": label,
            "type": "query",
            "datasource": _DS,
            "refresh": 2,
            "sort": 1,
            "definition": expr,
            "query": expr,
            "hide": 0,
            **extra,
        }

    return [
        {
            "name": "datasource",
            "label": "Prometheus",
            "type": "datasource",
            "query": "prometheus",
            "current": {},
            "hide": 0,
        },
        query(
            CLUSTER_VAR,
            "Cluster",
            "label_values(tailpilot_window_seconds, cluster)",
            current={"text": cluster.name, "value": cluster.name},
            multi=False,
            includeAll=False,
        ),
        query(
            REPLICA_VAR,
            "Replica",
            f"label_values(tailpilot_replica_up{{{_C}}}, replica)",
            current={"text": ["All"], "value": ["$__all"]},
            multi=True,
            includeAll=True,
            allValue=".*",
        ),
    ]


_DASHED = {
    "matcher": {"id": "byRegexp", "options": ".* target$"},
    "properties": [{"id": "custom.lineStyle", "value": {"fill": "dash", "dash": [10, 10]}}],
}


def _figure_panels(lay: _Layout, a: AlertThresholds) -> None:
    """The governance row: SCR, JFI, type fairness (now and over time, coloured at the cluster's
    alert thresholds), the alerts firing and the governor."""
    # Seed 003 §9: SCR yellow below 0.95, red below 0.90; JFI and type fairness at their alerts.
    scr_t = _thresholds([(None, "red"), (a.scr_critical, "yellow"), (a.scr_warning, "green")])
    jfi_t = _thresholds([(None, "red"), (a.jfi, "green")])
    tf_t = _thresholds([(None, "red"), (a.type_fairness, "green")])
    lay.row("Governance (seed 003): SCR, JFI, type fairness")
    lay.add(
        _panel(
            "stat",
            "SCR",
            "Fraction of tenants meeting every quantile target over the window.",
            [(_q("tailpilot_scr_ratio"), "SCR")],
            unit="percentunit",
            thresholds=scr_t,
            min_=0,
            max_=1,
        ),
        4,
        5,
    )
    lay.add(
        _panel(
            "stat",
            "JFI",
            "Jain's index over each tenant's service per demand-capped entitlement "
            "(what the alert and the governor act on).",
            [(_q("tailpilot_jfi_ratio"), "JFI")],
            thresholds=jfi_t,
            min_=0,
            max_=1,
        ),
        4,
        5,
    )
    lay.add(
        _panel(
            "stat",
            "Type fairness (lowest)",
            "The lowest request type's share over its guaranteed share.",
            [(_q("tailpilot_type_fairness_min_ratio"), "lowest type")],
            thresholds=tf_t,
            min_=0,
        ),
        4,
        5,
    )
    lay.add(
        _panel(
            "stat",
            "Alerts firing",
            "tailpilot's governance alerts firing now (any severity); "
            "pending: condition holding, not yet for alerts.for_s.",
            [
                (f"sum({_q('tailpilot_alert_firing')})", "firing"),
                (f"sum({_q('tailpilot_alert_pending')})", "pending"),
            ],
            thresholds=_thresholds([(None, "green"), (1, "red")]),
        ),
        4,
        5,
    )
    lay.add(
        _panel(
            "stat",
            "Governor",
            "The governor's state (record --govern) and its emergency modes.",
            [
                (f"{_q('tailpilot_governor_state')} == 1", "{{state}}"),
                (f"{_q('tailpilot_governor_mode_active')} == 1", "mode {{mode}}"),
            ],
            options={
                "textMode": "name",
                "colorMode": "none",
                "reduceOptions": {"calcs": ["lastNotNull"]},
            },
        ),
        8,
        5,
    )
    lay.add(
        _panel(
            "timeseries",
            "SCR over time",
            f"Yellow below {a.scr_warning:g}, red below {a.scr_critical:g}.",
            [(_q("tailpilot_scr_ratio"), "SCR")],
            unit="percentunit",
            thresholds=scr_t,
            min_=0,
            max_=1,
        ),
        8,
        8,
    )
    lay.add(
        _panel(
            "timeseries",
            "JFI over time",
            f"The tenant-suppression alert fires below {a.jfi:g}; "
            "the seed's literal JFI (served per committed rate) is reported only.",
            [
                (_q("tailpilot_jfi_ratio"), "JFI"),
                (_q("tailpilot_jfi_seed_ratio"), "JFI (seed)"),
            ],
            thresholds=jfi_t,
            min_=0,
            max_=1,
        ),
        8,
        8,
    )
    lay.add(
        _panel(
            "timeseries",
            "Type fairness ratio per type",
            "A type's share over its guaranteed share; starvation alert below "
            f"{a.type_fairness:g}.",
            [(_q("tailpilot_type_fairness_ratio"), "{{type}}")],
            thresholds=tf_t,
            min_=0,
        ),
        8,
        8,
    )


def _tenant_panels(lay: _Layout) -> None:
    """The tenants row: each tenant's latency and tokens against its targets, its service per
    entitlement and ω, and a table of the tenants now."""
    lay.row("Tenants against their targets")
    lay.add(
        _panel(
            "timeseries",
            "TTFT P99 per tenant (dashed: target)",
            "Exact windowed percentiles.",
            [
                (
                    _q("tailpilot_tenant_latency_seconds", latency="ttft", percentile="p99"),
                    "{{tenant}}",
                ),
                (
                    _q("tailpilot_tenant_slo_seconds", latency="ttft", percentile="p99"),
                    "{{tenant}} target",
                ),
            ],
            unit="s",
            overrides=[_DASHED],
        ),
        12,
        8,
    )
    lay.add(
        _panel(
            "timeseries",
            "Tokens served per tenant (dashed: commitment)",
            "Prompt + output tokens per second of the selected replicas, beside each tenant's "
            "committed rate.",
            [
                (
                    f"{_rate('tailpilot_prompt_tokens_total', 'tenant')} + "
                    f"{_rate('tailpilot_output_tokens_total', 'tenant')}",
                    "{{tenant}}",
                ),
                (_q("tailpilot_tenant_committed_tokens_per_second"), "{{tenant}} target"),
            ],
            unit="short",
            min_=0,
            overrides=[_DASHED],
        ),
        12,
        8,
    )
    lay.add(
        _panel(
            "timeseries",
            "Service per entitlement (JFI's x) and ω",
            "min(1, served / demand-capped entitlement) per tenant; "
            "ω = min(committed / served, α), below 1 an over-consumer "
            "(whom the JFI mode throttles).",
            [
                (_q("tailpilot_tenant_service_ratio"), "x {{tenant}}"),
                (_q("tailpilot_tenant_omega_ratio"), "ω {{tenant}}"),
            ],
            min_=0,
        ),
        12,
        8,
    )
    lay.add(
        _panel(
            "table",
            "Tenants now",
            "Compliance, requests, and what waits (starved: waiting, none done).",
            [
                (_q("tailpilot_tenant_slo_compliant"), "compliant {{tenant}}"),
                (_q("tailpilot_tenant_requests"), "requests {{tenant}}"),
                (_q("tailpilot_tenant_waiting_requests"), "waiting {{tenant}}"),
                (_q("tailpilot_tenant_starved"), "starved {{tenant}}"),
            ],
            options={"showHeader": True},
        ),
        12,
        8,
    )


def _replica_panels(lay: _Layout) -> None:
    """The replicas row: latency, queue, KV cache, tokens, preemptions and refusals, γ and β, and
    what each replica runs."""
    lay.row("Replicas")
    lay.add(
        _panel(
            "timeseries",
            "TTFT P99 per replica",
            "Exact windowed percentile of completed requests.",
            [(_q("tailpilot_latency_seconds", latency="ttft", percentile="p99"), "{{replica}}")],
            unit="s",
        ),
        8,
        8,
    )
    lay.add(
        _panel(
            "timeseries",
            "Queue",
            "Waiting and running requests per replica.",
            [
                (_q("tailpilot_waiting_requests"), "waiting {{replica}}"),
                (_q("tailpilot_running_requests"), "running {{replica}}"),
            ],
        ),
        8,
        8,
    )
    lay.add(
        _panel(
            "timeseries",
            "KV cache in use",
            "Fraction of each replica's KV blocks in use.",
            [(_q("tailpilot_kv_usage_ratio"), "{{replica}}")],
            unit="percentunit",
            min_=0,
            max_=1,
        ),
        8,
        8,
    )
    lay.add(
        _panel(
            "timeseries",
            "Output tokens per second",
            "Output tokens of the requests completed per replica.",
            [(_rate("tailpilot_output_tokens_total", "replica"), "{{replica}}")],
            unit="short",
            min_=0,
        ),
        8,
        8,
    )
    lay.add(
        _panel(
            "timeseries",
            "Preemptions and refusals",
            "Per second: preemptions, and requests turned away at a "
            "tenant's queue cap (slofq's queue_cap; each also in the completions log as rejected).",
            [
                (_rate("tailpilot_preemptions_total", "replica"), "preempted {{replica}}"),
                (_rate("tailpilot_refused_requests_total", "replica"), "refused {{replica}}"),
            ],
            unit="short",
            min_=0,
        ),
        8,
        8,
    )
    lay.add(
        _panel(
            "timeseries",
            "Live γ and β",
            "The policy's live parameters (γ-Ada moves γ).",
            [(_q("tailpilot_gamma"), "γ {{replica}}"), (_q("tailpilot_beta"), "β {{replica}}")],
        ),
        8,
        8,
    )
    lay.add(
        _panel(
            "table",
            "Policy and settings version",
            "What each replica runs now.",
            [
                (_q("tailpilot_replica_info"), "{{replica}} {{policy}}"),
                (_q("tailpilot_settings_version"), "{{replica}} version"),
                (_q("tailpilot_replica_up"), "{{replica}} up"),
            ],
            options={"showHeader": True},
        ),
        24,
        8,
    )


def grafana_dashboard_doc(cluster: ClusterSpec) -> dict[str, Any]:
    """The dashboard of ``cluster`` as a dict (the JSON Grafana imports)."""
    name = cluster.name
    lay = _Layout()
    if cluster.governance is not None:
        _figure_panels(lay, cluster.governance.alerts)
        _tenant_panels(lay)
    _replica_panels(lay)
    exprs = [t["expr"] for p in lay.panels for t in p.get("targets", [])]
    check_series(exprs, "grafana")
    return {
        "uid": fit_name(f"tailpilot-{name}", "A-Za-z0-9_-", 40),
        "title": f"tailpilot — cluster {name}",
        "description": "tailpilot's recorder /metrics (tailpilot export --format grafana)",
        "tags": ["tailpilot", "vllm"],
        "timezone": "browser",
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": GRAFANA_SCHEMA_VERSION,
        "version": 1,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": _variables(cluster)},
        "annotations": {"list": []},
        "panels": lay.panels,
    }


def grafana_dashboard(cluster: ClusterSpec) -> str:
    doc = grafana_dashboard_doc(cluster)
    text = json.dumps(doc, indent=2, ensure_ascii=False) + "\n"
    check_dashboard(json.loads(text), cluster)
    return text

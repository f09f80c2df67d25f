"""Prometheus's side of the monitoring exports: the alert rules (a rule file, or the same groups as
a Prometheus Operator ``PrometheusRule``) and the ``ServiceMonitor`` that scrapes the recorder.

The governance rules fire exactly when the collector's own alert rules do
(``governance.AlertEvaluator``, rule by rule): SCR below the warning threshold, SCR below the
critical one (both fire while SCR is below critical, as Prometheus practice has it: an
Alertmanager inhibit rule keeps the warning quiet), JFI (the suppression-aware figure) and type
fairness (the lowest type's ratio) below theirs; each with ``for:`` and ``keep_firing_for:`` from
the cluster file's ``alerts.for_s`` and ``alerts.keep_firing_for_s``, over the figure each alert
was last judged on (``tailpilot_alert_value``). Rules over the replicas' counters use ``rate()``
or ``increase()``.
"""

from __future__ import annotations

from typing import Any

from controlplane import strict_yaml
from controlplane.cluster import ClusterSpec
from controlplane.monitoring.checks import (
    LABEL_VALUE,
    MonitoringExportError,
    check_duration,
    check_metadata,
    check_series,
    duration,
    k8s_name,
    label_value,
    seconds,
)

METRICS_PORT_NAME = "metrics"
RECORDER_LABELS = {"app.kubernetes.io/name": "tailpilot", "app.kubernetes.io/component": "recorder"}


def _num(value: float) -> str:
    """A threshold in PromQL, exactly (``:g`` would round 0.9999995 to 1)."""
    return repr(float(value))


def _sel(cluster: str, **labels: str) -> str:
    inner = ", ".join([f'cluster="{cluster}"'] + [f'{k}="{v}"' for k, v in labels.items()])
    return "{" + inner + "}"


# --- alert rules ---------------------------------------------------------------------------


def rule_groups(cluster: ClusterSpec, *, for_: str | None = None) -> list[dict[str, Any]]:
    """The alert rule groups of ``cluster`` (a ``ClusterSpec``); ``for_``: how long a governance
    figure must stay below its threshold before the alert fires (None: the cluster file's
    ``alerts.for_s``, as the collector's own alerts)."""
    name = cluster.name
    c = _sel(name)
    rules: list[dict[str, Any]] = []
    if for_ is not None:
        check_duration(for_, "for")

    def alert(
        alert_name: str,
        expr: str,
        severity: str,
        summary: str,
        description: str,
        hold: str | None = None,
        keep: str | None = None,
    ) -> None:
        rule: dict[str, Any] = {"alert": alert_name, "expr": expr}
        if hold:
            rule["for"] = hold
        if keep:
            rule["keep_firing_for"] = keep
        rule["labels"] = {"severity": severity, "cluster": name}
        rule["annotations"] = {"summary": summary, "description": description}
        rules.append(rule)

    gov = cluster.governance
    if gov is not None:
        a = gov.alerts
        hold = for_ if for_ is not None else duration(a.for_s)
        keep = duration(a.keep_firing_for_s)
        # On the figure each alert was last judged on (tailpilot_alert_value): like the recorder's
        # own alerts, a window without data changes nothing (tailpilot_scr_ratio itself goes
        # absent).
        value = {
            k: f"max without (alert) (tailpilot_alert_value{_sel(name, alert=k)})"
            for k in ("scr", "jfi", "type_fairness")
        }
        alert(
            "TailpilotSCRCritical",
            f"{value['scr']} < {_num(a.scr_critical)}",
            "critical",
            f"SLO compliance of cluster {name} below {a.scr_critical:g}",
            'SCR is {{ $value | printf "%.3f" }}: the fraction of tenants meeting every quantile '
            "target (tailpilot_tenant_slo_compliant says which do not).",
            hold,
            keep,
        )
        alert(
            "TailpilotSCRWarning",
            f"{value['scr']} < {_num(a.scr_warning)}",
            "warning",
            f"SLO compliance of cluster {name} below {a.scr_warning:g}",
            'SCR is {{ $value | printf "%.3f" }}: the fraction of tenants meeting every quantile '
            "target (also firing while TailpilotSCRCritical does: inhibit it there).",
            hold,
            keep,
        )
        alert(
            "TailpilotJFILow",
            f"{value['jfi']} < {_num(a.jfi)}",
            "warning",
            f"A tenant of cluster {name} is being suppressed (Jain's index below {a.jfi:g})",
            "Jain's index over service per demand-capped entitlement is "
            '{{ $value | printf "%.3f" }}: a tenant with unmet demand got less than its share '
            "(tailpilot_tenant_service_ratio; tailpilot_tenant_omega_ratio below 1: the "
            "over-consumers).",
            hold,
            keep,
        )
        alert(
            "TailpilotTypeFairnessLow",
            f"{value['type_fairness']} < {_num(a.type_fairness)}",
            "warning",
            f"A request type of cluster {name} is starved "
            f"(fairness ratio below {a.type_fairness:g})",
            'The lowest type\'s share over its guaranteed share is {{ $value | printf "%.3f" }} '
            "(tailpilot_type_fairness_ratio per type).",
            hold,
            keep,
        )
        alert(
            "TailpilotTenantMissesSLO",
            f"tailpilot_tenant_slo_compliant{c} == 0",
            "info",
            "Tenant {{ $labels.tenant }} misses a latency target",
            "tailpilot_tenant_latency_seconds against tailpilot_tenant_slo_seconds shows which "
            "percentile.",
            hold,
        )
        alert(
            "TailpilotGovernorModeActive",
            f"tailpilot_governor_mode_active{c} == 1",
            "info",
            "The governor's {{ $labels.mode }} emergency mode is applied on cluster " + name,
            "See `tailpilot governor status --cluster-name " + name + "` and the audit log.",
        )
    alert(
        "TailpilotReplicaDown",
        f"tailpilot_replica_up{c} == 0",
        "warning",
        "Replica {{ $labels.replica }} of cluster " + name + " does not answer",
        "The recorder's polls of the replica fail; `tailpilot status` gives the reason.",
        "1m",
    )
    alert(
        "TailpilotBreakerTripped",
        f"increase(tailpilot_breaker_trips_total{c}[15m]) > 0",
        "warning",
        "A policy raised in replica {{ $labels.replica }}'s engine step (cluster " + name + ")",
        "Its circuit breaker fell back to the previous settings (or vLLM's stock order): see the "
        "audit log's engine entries.",
    )
    alert(
        "TailpilotRequestsRefused",
        f"rate(tailpilot_refused_requests_total{c}[5m]) > 0",
        "info",
        "Replica {{ $labels.replica }} refuses requests at a tenant's queue cap",
        '{{ $value | printf "%.3f" }} requests/s turned away on arrival over 5 minutes '
        "(slofq's queue_cap).",
        "5m",
    )
    alert(
        "TailpilotRecorderAbsent",
        f"absent(tailpilot_window_seconds{c})",
        "critical",
        f"No tailpilot recorder reports cluster {name}",
        "Without the recorder's /metrics none of the governance alerts can fire.",
        "5m",
    )
    check_series([r["expr"] for r in rules], "prometheus-rules")
    return [{"name": f"tailpilot-{name}", "rules": rules}]


def _metadata(
    cluster: ClusterSpec, kind: str, namespace: str | None, labels: dict[str, str] | None
) -> dict[str, Any]:
    metadata: dict[str, Any] = {
        "name": k8s_name("tailpilot", kind, cluster.name),
        "labels": {
            **RECORDER_LABELS,
            "tailpilot/cluster": label_value(cluster.name),
            **(labels or {}),
        },
    }
    if namespace:
        metadata["namespace"] = namespace
    return metadata


def prometheus_rules(cluster: ClusterSpec, *, for_: str | None = None) -> str:
    doc = {"groups": rule_groups(cluster, for_=for_)}
    header = [
        f"Prometheus alert rules for tailpilot cluster {cluster.name} (tailpilot export --format "
        "prometheus-rules); load with rule_files:, check with `promtool check rules`."
    ]
    text = strict_yaml.dump(doc, header)
    _verify_groups(strict_yaml.load(text).get("groups"), doc["groups"], "prometheus-rules")
    return text


def prometheus_rule_crd(
    cluster: ClusterSpec,
    *,
    for_: str | None = None,
    namespace: str | None = None,
    labels: dict[str, str] | None = None,
) -> str:
    groups = rule_groups(cluster, for_=for_)
    doc = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": _metadata(cluster, "rules", namespace, labels),
        "spec": {"groups": groups},
    }
    header = [
        f"tailpilot's alert rules for cluster {cluster.name} as a Prometheus Operator "
        "PrometheusRule (--label release=NAME if your Prometheus selects rules by label)."
    ]
    text = strict_yaml.dump(doc, header)
    back = strict_yaml.load(text)
    if back != doc:
        raise MonitoringExportError(
            "prometheusrule: the rendering did not parse back; this is a bug"
        )
    check_metadata(back["metadata"], "prometheusrule")
    _verify_groups(back["spec"]["groups"], groups, "prometheusrule")
    return text


def _verify_groups(back: Any, groups: list[dict[str, Any]], fmt: str) -> None:
    if back != groups:
        raise MonitoringExportError(
            f"{fmt}: the rendering did not parse back to its rules; this is a bug"
        )
    for group in back:
        names = [r["alert"] for r in group["rules"]]
        if len(names) != len(set(names)):
            raise MonitoringExportError(f"{fmt}: duplicate alert names in group {group['name']}")


# --- ServiceMonitor ------------------------------------------------------------------------


def scrape_timeout(interval: str) -> str:
    """A scrape timeout for ``interval``: Prometheus's default 10 s, but never above the
    interval."""
    t = min(10.0, seconds(check_duration(interval, "interval")))
    return f"{int(t)}s" if t >= 1 and t == int(t) else f"{max(1, int(t * 1000))}ms"


def service_monitor_doc(
    cluster: ClusterSpec,
    *,
    namespace: str | None = None,
    interval: str = "15s",
    labels: dict[str, str] | None = None,
) -> dict[str, Any]:
    selector = {**RECORDER_LABELS, "tailpilot/cluster": label_value(cluster.name)}
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": _metadata(cluster, "recorder", namespace, labels),
        "spec": {
            "selector": {"matchLabels": selector},
            "endpoints": [
                {
                    "port": METRICS_PORT_NAME,
                    "path": "/metrics",
                    "interval": interval,
                    "scrapeTimeout": scrape_timeout(interval),
                }
            ],
        },
    }


def service_monitor(
    cluster: ClusterSpec,
    *,
    namespace: str | None = None,
    interval: str = "15s",
    labels: dict[str, str] | None = None,
) -> str:
    doc = service_monitor_doc(cluster, namespace=namespace, interval=interval, labels=labels)
    selected = ", ".join(f"{k}={v}" for k, v in doc["spec"]["selector"]["matchLabels"].items())
    header = [
        f"A ServiceMonitor for tailpilot's recorder of cluster {cluster.name}: it selects the "
        f"Service labelled {selected} and scrapes its port named {METRICS_PORT_NAME!r} (the "
        "recorder runs with `tailpilot record --metrics-port 9464 --metrics-host 0.0.0.0`). "
        "--label release=NAME if your Prometheus selects ServiceMonitors by label."
    ]
    text = strict_yaml.dump(doc, header)
    back = strict_yaml.load(text)
    if back != doc:
        raise MonitoringExportError(
            "servicemonitor: the rendering did not parse back; this is a bug"
        )
    check_metadata(back["metadata"], "servicemonitor")
    if not all(LABEL_VALUE.match(v) for v in back["spec"]["selector"]["matchLabels"].values()):
        raise MonitoringExportError(
            "servicemonitor: a selector label value is not a Kubernetes label value"
        )
    return text

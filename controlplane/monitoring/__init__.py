"""Monitoring exports of a cluster: Prometheus alert rules, a Grafana dashboard and a
ServiceMonitor for the recorder's ``/metrics`` (``tailpilot export --cluster FILE --format ...``).

    prometheus-rules   a rule file: seed 003's alerts at the cluster's thresholds, per cluster
    prometheusrule     the same groups as a Prometheus Operator ``PrometheusRule``
    grafana            a dashboard: SCR, JFI and type fairness (seed 003's checklist,
                       coloured at the thresholds), tenants against their targets, replicas,
                       alerts, the governor
    servicemonitor     a ``ServiceMonitor`` selecting the recorder's Service (port ``metrics``)

Every query names only series of :data:`controlplane.series.SERIES` (checked at render time), and
every rendering is parsed back and checked before it is returned; the tests also run ``promtool
check rules`` and ``promtool test rules`` on the rule file, and promtool's parser on every
dashboard query.

Modules
-------
* ``checks`` — :class:`MonitoringExportError` and what every rendering is checked against:
  Kubernetes names and labels, Prometheus durations, the served series, a whole dashboard;
* ``prometheus`` — the alert rules (a rule file or a ``PrometheusRule``) and the
  ``ServiceMonitor``;
* ``grafana`` — the dashboard.
"""

from __future__ import annotations

from controlplane.cluster import ClusterSpec
from controlplane.monitoring.checks import MonitoringExportError, check_duration, check_labels
from controlplane.monitoring.grafana import grafana_dashboard
from controlplane.monitoring.prometheus import (
    prometheus_rule_crd,
    prometheus_rules,
    service_monitor,
)

FORMATS = ("prometheus-rules", "prometheusrule", "grafana", "servicemonitor")


def render(
    cluster: ClusterSpec,
    fmt: str,
    *,
    namespace: str | None = None,
    for_: str | None = None,
    interval: str = "15s",
    labels: dict[str, str] | None = None,
) -> str:
    """``cluster`` in monitoring format ``fmt`` (one of :data:`FORMATS`), checked."""
    check_labels(labels or {})
    if fmt == "prometheus-rules":
        return prometheus_rules(cluster, for_=for_)
    if fmt == "prometheusrule":
        return prometheus_rule_crd(cluster, for_=for_, namespace=namespace, labels=labels)
    if fmt == "grafana":
        return grafana_dashboard(cluster)
    if fmt == "servicemonitor":
        return service_monitor(cluster, namespace=namespace, interval=interval, labels=labels)
    raise MonitoringExportError(f"unknown format {fmt!r} (valid: {', '.join(FORMATS)})")


__all__ = ["FORMATS", "MonitoringExportError", "check_duration", "check_labels", "render"]

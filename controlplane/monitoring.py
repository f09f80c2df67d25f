"""Monitoring exports of a cluster: Prometheus alert rules, a Grafana dashboard and a
ServiceMonitor for the recorder's ``/metrics`` (``tailpilot export --cluster FILE --format ...``).

    prometheus-rules   a rule file: seed 003's alerts at the cluster's thresholds, per cluster
    prometheusrule     the same groups as a Prometheus Operator ``PrometheusRule``
    grafana            a dashboard: SCR, JFI and type fairness (seed 003's checklist, coloured at the
                       thresholds), tenants against their targets, replicas, alerts, the governor
    servicemonitor     a ``ServiceMonitor`` selecting the recorder's Service (port ``metrics``)

The governance rules fire exactly when the collector's own alert rules do
(``governance.AlertEvaluator``, rule by rule): SCR below the warning threshold, SCR below the
critical one (both fire while SCR is below critical, as Prometheus practice has it: an
Alertmanager inhibit rule keeps the warning quiet), JFI (the suppression-aware figure) and type
fairness (the lowest type's ratio) below theirs; each with ``for:`` and ``keep_firing_for:`` from
the cluster file's ``alerts.for_s`` and ``alerts.keep_firing_for_s``, over the figure each alert
was last judged on (``tailpilot_alert_value``). Rules over the replicas' counters use ``rate()``
or ``increase()``. Every query here names only series of :data:`controlplane.exporter.SERIES`
(checked at render time), and every rendering is parsed back and checked before it is returned;
the tests also run ``promtool check rules`` and ``promtool test rules`` on the rule file, and
promtool's parser on every dashboard query.

The dashboard is one cluster's (its thresholds colour the governance panels) but reads every
series through its ``$cluster`` and ``$replica`` template variables (the cluster's name and all
replicas by default): :func:`check_dashboard` refuses a query that does not filter on both
wherever the series has the label.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any, NoReturn

from controlplane import strict_yaml
from controlplane.exporter import SERIES

FORMATS = ("prometheus-rules", "prometheusrule", "grafana", "servicemonitor")
METRICS_PORT_NAME = "metrics"
RECORDER_LABELS = {"app.kubernetes.io/name": "tailpilot", "app.kubernetes.io/component": "recorder"}
_METRIC = re.compile(r"\b(tailpilot_[a-z0-9_]+)\b")
# Prometheus's duration syntax: units largest first, each at most once (model.ParseDuration)
_DURATION = re.compile(
    r"^(?:[0-9]+y)?(?:[0-9]+w)?(?:[0-9]+d)?(?:[0-9]+h)?(?:[0-9]+m)?(?:[0-9]+s)?(?:[0-9]+ms)?$"
)
DNS_NAME = re.compile(
    r"^[a-z0-9](?:[-a-z0-9]{0,61}[a-z0-9])?$"
)  # a Kubernetes object name (RFC 1123 label)
LABEL_VALUE = re.compile(r"^(?:[A-Za-z0-9](?:[-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")
GRAFANA_UID = re.compile(r"^[A-Za-z0-9_-]{1,40}$")


def _fit(raw: str, allowed: str, limit: int, lower: bool = False) -> str:
    """``raw`` as a name of ``allowed`` characters, at most ``limit`` long; a short hash of the
    original is appended whenever it had to change (so two clusters never share a name)."""
    name = re.sub(f"[^{allowed}]+", "-", raw.lower() if lower else raw).strip("-_.")
    if name == raw and len(name) <= limit:
        return name
    digest = hashlib.sha256(raw.encode()).hexdigest()[:6]
    return f"{name[: limit - 7].rstrip('-_.')}-{digest}".lstrip("-")


def k8s_name(*parts: str) -> str:
    return _fit("-".join(parts), "a-z0-9-", 63, lower=True)


def label_value(value: str) -> str:
    return _fit(value, "A-Za-z0-9_.-", 63)


def _num(value: float) -> str:
    """A threshold in PromQL, exactly (``:g`` would round 0.9999995 to 1)."""
    return repr(float(value))


class MonitoringExportError(ValueError):
    """A cluster that cannot be exported this way, or a rendering that did not check out."""


def _sel(cluster: str, **labels: str) -> str:
    inner = ", ".join([f'cluster="{cluster}"'] + [f'{k}="{v}"' for k, v in labels.items()])
    return "{" + inner + "}"


_SAMPLES = {s.sample: s for s in SERIES.values()}  # a counter's samples carry _total
_SELECTOR = re.compile(r"\b(tailpilot_[a-z0-9_]+)\b(?:\s*\{([^}]*)\})?")
_MATCHER = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"\s*,?')
_RATE = re.compile(r"\b(?:rate|irate|increase)\(\s*$")


def metrics_in(expr: str) -> set[str]:
    """The ``tailpilot_*`` families an expression reads (a counter's ``_total`` sample as its family)."""
    return {_SAMPLES[n].name if n in _SAMPLES else n for n in _METRIC.findall(expr)}


def selectors(expr: str) -> list[tuple[str, dict[str, tuple[str, str]], bool]]:
    """Each ``tailpilot_*`` selector of ``expr``: (sample name, label -> (operator, value), whether
    it is the argument of rate(), irate() or increase())."""
    out = []
    for m in _SELECTOR.finditer(expr):
        matchers = {k: (op, v) for k, op, v in _MATCHER.findall(m.group(2) or "")}
        out.append((m.group(1), matchers, bool(_RATE.search(expr[: m.start()]))))
    return out


def _check_series(exprs: list[str], where: str) -> None:
    """Every query names samples the recorder serves, and reads counters through rate(),
    irate() or increase() and gauges never so."""
    problems: set[str] = set()
    for expr in exprs:
        for name, _, in_rate in selectors(expr):
            series = _SAMPLES.get(name)
            if series is None:
                problems.add(f"{name} (not served)")
            elif series.counter and not in_rate:
                problems.add(f"{name} (a counter outside rate()/increase())")
            elif not series.counter and in_rate:
                problems.add(f"{name} (a gauge inside rate()/increase())")
    if problems:
        raise MonitoringExportError(
            f"{where}: queries name series the recorder does not serve as used: {sorted(problems)}"
        )


def duration(seconds_: float) -> str | None:
    """``seconds_`` as Prometheus writes a duration (``30s``, ``1m30s``, ``1s500ms``); None for 0
    (no hold)."""
    ms = int(round(float(seconds_) * 1000))
    out = ""
    for unit, size in (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000), ("ms", 1)):
        n, ms = divmod(ms, size)
        out += f"{n}{unit}" if n else ""
    return out or None


def check_duration(value: str, field: str) -> str:
    """``value`` if it is a Prometheus duration (``30s``, ``1m30s``), else an error naming ``field``."""
    if (
        not isinstance(value, str)
        or not value
        or not _DURATION.match(value)
        or not any(ch in "123456789" for ch in value)
    ):
        raise MonitoringExportError(
            f"{field}: {value!r} is not a Prometheus duration such as 30s, 2m or 1h30m"
        )
    return value


# ---------------------------------------------------------------------------------------------
# alert rules
# ---------------------------------------------------------------------------------------------


def rule_groups(cluster: Any, *, for_: str | None = None) -> list[dict[str, Any]]:
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
        # own alerts, a window without data changes nothing (tailpilot_scr_ratio itself goes absent).
        value = {
            k: f"max without (alert) (tailpilot_alert_value{_sel(name, alert=k)})"
            for k in ("scr", "jfi", "type_fairness")
        }
        alert(
            "TailpilotSCRCritical",
            f"{value['scr']} < {_num(a.scr_critical)}",
            "critical",
            f"SLO compliance of cluster {name} below {a.scr_critical:g}",
            'SCR is {{ $value | printf "%.3f" }}: the fraction of tenants meeting every quantile target '
            "(tailpilot_tenant_slo_compliant says which do not).",
            hold,
            keep,
        )
        alert(
            "TailpilotSCRWarning",
            f"{value['scr']} < {_num(a.scr_warning)}",
            "warning",
            f"SLO compliance of cluster {name} below {a.scr_warning:g}",
            'SCR is {{ $value | printf "%.3f" }}: the fraction of tenants meeting every quantile target '
            "(also firing while TailpilotSCRCritical does: inhibit it there).",
            hold,
            keep,
        )
        alert(
            "TailpilotJFILow",
            f"{value['jfi']} < {_num(a.jfi)}",
            "warning",
            f"A tenant of cluster {name} is being suppressed (Jain's index below {a.jfi:g})",
            'Jain\'s index over service per demand-capped entitlement is {{ $value | printf "%.3f" }}: a '
            "tenant with unmet demand got less than its share (tailpilot_tenant_service_ratio; "
            "tailpilot_tenant_omega_ratio below 1: the over-consumers).",
            hold,
            keep,
        )
        alert(
            "TailpilotTypeFairnessLow",
            f"{value['type_fairness']} < {_num(a.type_fairness)}",
            "warning",
            f"A request type of cluster {name} is starved (fairness ratio below {a.type_fairness:g})",
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
            "tailpilot_tenant_latency_seconds against tailpilot_tenant_slo_seconds shows which percentile.",
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
        "Its circuit breaker fell back to the previous settings (or vLLM's stock order): see the audit "
        "log's engine entries.",
    )
    alert(
        "TailpilotRequestsRefused",
        f"rate(tailpilot_refused_requests_total{c}[5m]) > 0",
        "info",
        "Replica {{ $labels.replica }} refuses requests at a tenant's queue cap",
        '{{ $value | printf "%.3f" }} requests/s turned away on arrival over 5 minutes (slofq\'s queue_cap).',
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
    _check_series([r["expr"] for r in rules], "prometheus-rules")
    return [{"name": f"tailpilot-{name}", "rules": rules}]


def _metadata(
    cluster: Any, kind: str, namespace: str | None, labels: dict[str, str] | None
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


def check_labels(labels: dict[str, str]) -> dict[str, str]:
    """Extra metadata labels (``--label release=prom``): Kubernetes' rules for keys and values."""
    key = re.compile(
        r"^(?:[a-z0-9](?:[-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9](?:[-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
    )
    for k, v in labels.items():
        if not key.match(k):
            raise MonitoringExportError(f"label: {k!r} is not a Kubernetes label key")
        if not LABEL_VALUE.match(v):
            raise MonitoringExportError(
                f"label: {k}={v!r}: a label value is at most 63 characters of "
                "letters, digits, '-', '_' and '.', starting and ending with a letter or digit"
            )
    return labels


def prometheus_rules(cluster: Any, *, for_: str | None = None) -> str:
    doc = {"groups": rule_groups(cluster, for_=for_)}
    header = [
        f"Prometheus alert rules for tailpilot cluster {cluster.name} (tailpilot export --format "
        "prometheus-rules); load with rule_files:, check with `promtool check rules`."
    ]
    text = strict_yaml.dump(doc, header)
    _verify_groups(strict_yaml.load(text).get("groups"), doc["groups"], "prometheus-rules")
    return text


def prometheus_rule_crd(
    cluster: Any,
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
    _check_metadata(back["metadata"], "prometheusrule")
    _verify_groups(back["spec"]["groups"], groups, "prometheusrule")
    return text


def _check_metadata(metadata: dict[str, Any], fmt: str) -> None:
    if not DNS_NAME.match(metadata["name"]):
        raise MonitoringExportError(
            f"{fmt}: metadata.name {metadata['name']!r} is not a Kubernetes name"
        )
    check_labels(metadata["labels"])


def _verify_groups(back: Any, groups: list[dict[str, Any]], fmt: str) -> None:
    if back != groups:
        raise MonitoringExportError(
            f"{fmt}: the rendering did not parse back to its rules; this is a bug"
        )
    for group in back:
        names = [r["alert"] for r in group["rules"]]
        if len(names) != len(set(names)):
            raise MonitoringExportError(f"{fmt}: duplicate alert names in group {group['name']}")


# ---------------------------------------------------------------------------------------------
# Grafana
# ---------------------------------------------------------------------------------------------

GRAFANA_SCHEMA_VERSION = 39  # Grafana 10.x/11.x dashboards
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


CLUSTER_VAR, REPLICA_VAR = "cluster", "replica"
_C = f'cluster="${CLUSTER_VAR}"'
_R = f'replica=~"${REPLICA_VAR}"'
RATE_WINDOW = "$__rate_interval"  # Grafana's: at least four scrape intervals


def _q(series: str, **labels: str) -> str:
    """A selector of ``series`` on the dashboard's variables: ``$cluster`` always, ``$replica``
    where the series has a replica label, then ``labels``."""
    family = _SAMPLES[series]
    inner = (
        [_C]
        + ([_R] if "replica" in family.labels else [])
        + [f'{k}="{v}"' for k, v in labels.items()]
    )
    return series + "{" + ", ".join(inner) + "}"


def _rate(series: str, by: str, **labels: str) -> str:
    return f"sum by ({by}) (rate({_q(series, **labels)}[{RATE_WINDOW}]))"


def _variables(cluster: Any) -> list[dict[str, Any]]:
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


def grafana_dashboard_doc(cluster: Any) -> dict[str, Any]:
    """The dashboard of ``cluster`` as a dict (the JSON Grafana imports)."""
    name = cluster.name
    lay = _Layout()
    gov = cluster.governance
    if gov is not None:
        a = gov.alerts
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
                f"A type's share over its guaranteed share; starvation alert below {a.type_fairness:g}.",
                [(_q("tailpilot_type_fairness_ratio"), "{{type}}")],
                thresholds=tf_t,
                min_=0,
            ),
            8,
            8,
        )
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
                "Prompt + output tokens per second of the selected replicas, beside each tenant's committed "
                "rate.",
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
                "min(1, served / demand-capped entitlement) per tenant; ω = min(committed / served, α), "
                "below 1 an over-consumer (whom the JFI mode throttles).",
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
    exprs = [t["expr"] for p in lay.panels for t in p.get("targets", [])]
    _check_series(exprs, "grafana")
    return {
        "uid": _fit(f"tailpilot-{name}", "A-Za-z0-9_-", 40),
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


_DASHED = {
    "matcher": {"id": "byRegexp", "options": ".* target$"},
    "properties": [{"id": "custom.lineStyle", "value": {"fill": "dash", "dash": [10, 10]}}],
}


def grafana_dashboard(cluster: Any) -> str:
    doc = grafana_dashboard_doc(cluster)
    text = json.dumps(doc, indent=2, ensure_ascii=False) + "\n"
    check_dashboard(json.loads(text), cluster)
    return text


def dashboard_queries(doc: dict[str, Any]) -> list[str]:
    """Every query of a dashboard (rows' nested panels included)."""
    out: list[str] = []
    for panel in doc.get("panels", []):
        for p in [panel, *panel.get("panels", [])]:
            out += [t["expr"] for t in p.get("targets", [])]
    return out


def unfiltered(expr: str) -> list[str]:
    """The selectors of ``expr`` that do not filter on the dashboard's variables: ``$cluster``
    exactly, and ``$replica`` (as a regex: it may be several, or all) where the series has a
    replica label."""
    out = []
    for name, matchers, _ in selectors(expr):
        series = _SAMPLES.get(name)
        if matchers.get("cluster") != ("=", f"${CLUSTER_VAR}"):
            out.append(f'{name} (no cluster="${CLUSTER_VAR}")')
        if (
            series is not None
            and "replica" in series.labels
            and matchers.get("replica") != ("=~", f"${REPLICA_VAR}")
        ):
            out.append(f'{name} (no replica=~"${REPLICA_VAR}")')
    return out


def check_dashboard(doc: dict[str, Any], cluster: Any) -> None:
    """A loaded dashboard is whole: unique panel ids, panels on the grid without overlap, a query
    per panel naming only served series and filtering on the ``$cluster`` and ``$replica``
    variables (which it defines), and the cluster's thresholds on the governance panels."""

    def fail(what: str) -> NoReturn:
        raise MonitoringExportError(f"grafana: {what}")

    if doc.get("schemaVersion") != GRAFANA_SCHEMA_VERSION or not doc.get("title"):
        fail("schemaVersion or title missing")
    if not GRAFANA_UID.match(str(doc.get("uid", ""))):
        fail(
            f"uid {doc.get('uid')!r} is not a Grafana uid (at most 40 of letters, digits, '-' and '_')"
        )
    variables = {v.get("name"): v for v in (doc.get("templating") or {}).get("list") or []}
    for var in (CLUSTER_VAR, REPLICA_VAR):
        if (variables.get(var) or {}).get("type") != "query":
            fail(f"no ${var} template variable")
    if variables[CLUSTER_VAR].get("current", {}).get("value") != cluster.name:
        fail(f"$cluster does not default to the cluster {cluster.name!r}")
    if not (
        variables[REPLICA_VAR].get("includeAll") and variables[REPLICA_VAR].get("allValue") == ".*"
    ):
        fail("$replica cannot select all replicas")
    panels = doc.get("panels")
    if not isinstance(panels, list) or not panels:
        fail("no panels")
    ids = [p.get("id") for p in panels]
    if len(ids) != len(set(ids)):
        fail(f"duplicate panel ids {ids}")
    cells: set[tuple[int, int]] = set()
    for p in panels:
        g = p.get("gridPos") or {}
        if not (
            all(isinstance(g.get(k), int) for k in "xywh")
            and g["x"] >= 0
            and g["w"] > 0
            and g["x"] + g["w"] <= 24
            and g["y"] >= 0
            and g["h"] > 0
        ):
            fail(f"panel {p.get('title')!r} is off the 24-column grid: {g}")
        mine = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        if mine & cells:
            fail(f"panel {p.get('title')!r} overlaps another")
        cells |= mine
        if p.get("type") != "row" and not p.get("targets"):
            fail(f"panel {p.get('title')!r} has no query")
    queries = dashboard_queries(doc)
    _check_series(queries, "grafana")
    loose = sorted({x for q in queries for x in unfiltered(q)})
    if loose:
        fail(f"queries not filtered on the dashboard's variables: {loose}")
    gov = cluster.governance
    if gov is not None:
        by_title = {p.get("title"): p for p in panels}
        a = gov.alerts
        want = {
            "SCR": [None, a.scr_critical, a.scr_warning],
            "JFI": [None, a.jfi],
            "Type fairness (lowest)": [None, a.type_fairness],
        }
        for title, values in want.items():
            steps = (
                by_title.get(title, {})
                .get("fieldConfig", {})
                .get("defaults", {})
                .get("thresholds", {})
                .get("steps")
            )
            if [s.get("value") for s in steps or []] != values:
                fail(f"panel {title!r}: thresholds {steps} are not the cluster's {values}")


# ---------------------------------------------------------------------------------------------
# ServiceMonitor
# ---------------------------------------------------------------------------------------------


def seconds(duration: str) -> float:
    """A Prometheus duration in seconds (``check_duration`` first)."""
    scale = {
        "y": 365 * 86_400,
        "w": 7 * 86_400,
        "d": 86_400,
        "h": 3_600,
        "m": 60,
        "s": 1,
        "ms": 0.001,
    }
    return sum(int(n) * scale[u] for n, u in re.findall(r"([0-9]+)(ms|[ywdhms])", duration))


def scrape_timeout(interval: str) -> str:
    """A scrape timeout for ``interval``: Prometheus's default 10 s, but never above the interval."""
    t = min(10.0, seconds(check_duration(interval, "interval")))
    return f"{int(t)}s" if t >= 1 and t == int(t) else f"{max(1, int(t * 1000))}ms"


def service_monitor_doc(
    cluster: Any,
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
    cluster: Any,
    *,
    namespace: str | None = None,
    interval: str = "15s",
    labels: dict[str, str] | None = None,
) -> str:
    doc = service_monitor_doc(cluster, namespace=namespace, interval=interval, labels=labels)
    selected = ", ".join(f"{k}={v}" for k, v in doc["spec"]["selector"]["matchLabels"].items())
    header = [
        f"A ServiceMonitor for tailpilot's recorder of cluster {cluster.name}: it selects the Service "
        f"labelled {selected} and scrapes its port named {METRICS_PORT_NAME!r} (the recorder runs "
        "with `tailpilot record --metrics-port 9464 --metrics-host 0.0.0.0`). --label release=NAME "
        "if your Prometheus selects ServiceMonitors by label."
    ]
    text = strict_yaml.dump(doc, header)
    back = strict_yaml.load(text)
    if back != doc:
        raise MonitoringExportError(
            "servicemonitor: the rendering did not parse back; this is a bug"
        )
    _check_metadata(back["metadata"], "servicemonitor")
    if not all(LABEL_VALUE.match(v) for v in back["spec"]["selector"]["matchLabels"].values()):
        raise MonitoringExportError(
            "servicemonitor: a selector label value is not a Kubernetes label value"
        )
    return text


def render(
    cluster: Any,
    fmt: str,
    *,
    namespace: str | None = None,
    for_: str | None = None,
    interval: str = "15s",
    labels: dict[str, str] | None = None,
) -> str:
    """``cluster`` (a ``ClusterSpec``) in monitoring format ``fmt``, checked."""
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

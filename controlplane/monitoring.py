"""Monitoring exports of a cluster: Prometheus alert rules, a Grafana dashboard and a
ServiceMonitor for the recorder's ``/metrics`` (``tailpilot export --cluster FILE --format ...``).

    prometheus-rules   a rule file: seed 003's alerts at the cluster's thresholds, per cluster
    prometheusrule     the same groups as a Prometheus Operator ``PrometheusRule``
    grafana            a dashboard: SCR, JFI and type fairness (seed 003's checklist, coloured at the
                       thresholds), tenants against their targets, replicas, alerts, the governor
    servicemonitor     a ``ServiceMonitor`` selecting the recorder's Service (port ``metrics``)

The rules fire exactly when the collector's own alerts do (``governance.AlertEvaluator``): one
severity at a time — SCR warning is ``warning > SCR >= critical``, critical ``SCR < critical``;
JFI and type fairness (the lowest type's ratio) below their thresholds — over the same figures,
read from the ``tailpilot_*`` series (:data:`controlplane.exporter.SERIES`). Every query here
names only series of that table (checked at render time), and every rendering is parsed back and
checked before it is returned; the tests also run ``promtool check rules`` and ``promtool test
rules`` on the rule file, and promtool's parser on every dashboard query.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any, NoReturn

from controlplane import strict_yaml
from controlplane.export import _yaml
from controlplane.exporter import SERIES

FORMATS = ("prometheus-rules", "prometheusrule", "grafana", "servicemonitor")
METRICS_PORT_NAME = "metrics"
RECORDER_LABELS = {"app.kubernetes.io/name": "tailpilot", "app.kubernetes.io/component": "recorder"}
_METRIC = re.compile(r"\b(tailpilot_[a-z0-9_]+)\b")
# Prometheus's duration syntax: units largest first, each at most once (model.ParseDuration)
_DURATION = re.compile(r"^(?:[0-9]+y)?(?:[0-9]+w)?(?:[0-9]+d)?(?:[0-9]+h)?(?:[0-9]+m)?(?:[0-9]+s)?(?:[0-9]+ms)?$")
DNS_NAME = re.compile(r"^[a-z0-9](?:[-a-z0-9]{0,61}[a-z0-9])?$")  # a Kubernetes object name (RFC 1123 label)
LABEL_VALUE = re.compile(r"^(?:[A-Za-z0-9](?:[-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")
GRAFANA_UID = re.compile(r"^[A-Za-z0-9_-]{1,40}$")


def _fit(raw: str, allowed: str, limit: int, lower: bool = False) -> str:
    """``raw`` as a name of ``allowed`` characters, at most ``limit`` long; a short hash of the
    original is appended whenever it had to change (so two clusters never share a name)."""
    name = re.sub(f"[^{allowed}]+", "-", raw.lower() if lower else raw).strip("-_.")
    if name == raw and len(name) <= limit:
        return name
    digest = hashlib.sha256(raw.encode()).hexdigest()[:6]
    return f"{name[:limit - 7].rstrip('-_.')}-{digest}".lstrip("-")


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


def metrics_in(expr: str) -> set[str]:
    """The ``tailpilot_*`` families an expression reads (a counter's ``_total`` sample as its family)."""
    names = set(_METRIC.findall(expr))
    return {n[:-len("_total")] if n.endswith("_total") and SERIES.get(n[:-len("_total")], None) is not None
            and SERIES[n[:-len("_total")]].counter else n for n in names}


def check_duration(value: str, field: str) -> str:
    """``value`` if it is a Prometheus duration (``30s``, ``1m30s``), else an error naming ``field``."""
    if not isinstance(value, str) or not value or not _DURATION.match(value) \
            or not any(ch in "123456789" for ch in value):
        raise MonitoringExportError(f"{field}: {value!r} is not a Prometheus duration such as 30s, 2m or 1h30m")
    return value


def _check_series(exprs: list[str], where: str) -> None:
    unknown = sorted({m for e in exprs for m in metrics_in(e)} - set(SERIES))
    if unknown:
        raise MonitoringExportError(f"{where}: queries name series the recorder does not serve: {unknown}")


# ---------------------------------------------------------------------------------------------
# alert rules
# ---------------------------------------------------------------------------------------------


def rule_groups(cluster: Any, *, for_: str | None = None) -> list[dict[str, Any]]:
    """The alert rule groups of ``cluster`` (a ``ClusterSpec``); ``for_``: how long a governance
    figure must stay below its threshold before the alert fires (None: at once, as the collector)."""
    name = cluster.name
    c = _sel(name)
    rules: list[dict[str, Any]] = []
    if for_ is not None:
        check_duration(for_, "for")

    def alert(alert_name: str, expr: str, severity: str, summary: str, description: str,
              hold: str | None = None) -> None:
        rule: dict[str, Any] = {"alert": alert_name, "expr": expr}
        if hold:
            rule["for"] = hold
        rule["labels"] = {"severity": severity, "cluster": name}
        rule["annotations"] = {"summary": summary, "description": description}
        rules.append(rule)

    gov = cluster.governance
    if gov is not None:
        a = gov.alerts
        # On the figure each alert was last judged on (tailpilot_alert_value): like the recorder's
        # own alerts, a window without data changes nothing (tailpilot_scr itself goes absent).
        value = {k: f"max without (alert) (tailpilot_alert_value{_sel(name, alert=k)})"
                 for k in ("scr", "jfi", "type_fairness")}
        crit, warn = _num(a.scr_critical), _num(a.scr_warning)
        alert("TailpilotSCRCritical", f"{value['scr']} < {crit}", "critical",
              f"SLO compliance of cluster {name} below {a.scr_critical:g}",
              "SCR is {{ $value | printf \"%.3f\" }}: the fraction of tenants meeting every quantile target "
              "(tailpilot_tenant_slo_compliant says which do not).", for_)
        alert("TailpilotSCRWarning", f"{value['scr']} < {warn} >= {crit}", "warning",
              f"SLO compliance of cluster {name} below {a.scr_warning:g}",
              "SCR is {{ $value | printf \"%.3f\" }}: the fraction of tenants meeting every quantile target.", for_)
        alert("TailpilotJFILow", f"{value['jfi']} < {_num(a.jfi)}", "warning",
              f"Tenants of cluster {name} served unfairly (Jain's index below {a.jfi:g})",
              "Jain's index over throughput per commitment is {{ $value | printf \"%.3f\" }}: a tenant is "
              "being crowded out (tailpilot_tenant_normalised_throughput).", for_)
        alert("TailpilotTypeFairnessLow", f"{value['type_fairness']} < {_num(a.type_fairness)}", "warning",
              f"A request type of cluster {name} is starved (fairness ratio below {a.type_fairness:g})",
              "The lowest type's share over its guaranteed share is {{ $value | printf \"%.3f\" }} "
              "(tailpilot_type_fairness_ratio per type).", for_)
        alert("TailpilotTenantMissesSLO", f"tailpilot_tenant_slo_compliant{c} == 0", "info",
              "Tenant {{ $labels.tenant }} misses a latency target",
              "tailpilot_tenant_latency_seconds against tailpilot_tenant_slo_seconds shows which quantile.", for_)
        alert("TailpilotGovernorModeActive", f"tailpilot_governor_mode_active{c} == 1", "info",
              "The governor's {{ $labels.mode }} emergency mode is applied on cluster " + name,
              "See `tailpilot governor status --cluster-name " + name + "` and the audit log.")
    alert("TailpilotReplicaDown", f"tailpilot_replica_up{c} == 0", "warning",
          "Replica {{ $labels.replica }} of cluster " + name + " does not answer",
          "The recorder's polls of the replica fail; `tailpilot status` gives the reason.", "1m")
    alert("TailpilotRecorderAbsent", f"absent(tailpilot_window_seconds{c})", "critical",
          f"No tailpilot recorder reports cluster {name}",
          "Without the recorder's /metrics none of the governance alerts can fire.", "5m")
    _check_series([r["expr"] for r in rules], "prometheus-rules")
    return [{"name": f"tailpilot-{name}", "rules": rules}]


def _metadata(cluster: Any, kind: str, namespace: str | None, labels: dict[str, str] | None) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": k8s_name("tailpilot", kind, cluster.name),
                                "labels": {**RECORDER_LABELS, "tailpilot/cluster": label_value(cluster.name),
                                           **(labels or {})}}
    if namespace:
        metadata["namespace"] = namespace
    return metadata


def check_labels(labels: dict[str, str]) -> dict[str, str]:
    """Extra metadata labels (``--label release=prom``): Kubernetes' rules for keys and values."""
    key = re.compile(r"^(?:[a-z0-9](?:[-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9](?:[-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
    for k, v in labels.items():
        if not key.match(k):
            raise MonitoringExportError(f"label: {k!r} is not a Kubernetes label key")
        if not LABEL_VALUE.match(v):
            raise MonitoringExportError(f"label: {k}={v!r}: a label value is at most 63 characters of "
                                        "letters, digits, '-', '_' and '.', starting and ending with a letter or digit")
    return labels


def prometheus_rules(cluster: Any, *, for_: str | None = None) -> str:
    doc = {"groups": rule_groups(cluster, for_=for_)}
    text = _yaml(doc, [f"Prometheus alert rules for tailpilot cluster {cluster.name} (tailpilot export --format "
                       "prometheus-rules); load with rule_files:, check with `promtool check rules`."])
    _verify_groups(strict_yaml.load(text).get("groups"), doc["groups"], "prometheus-rules")
    return text


def prometheus_rule_crd(cluster: Any, *, for_: str | None = None, namespace: str | None = None,
                        labels: dict[str, str] | None = None) -> str:
    groups = rule_groups(cluster, for_=for_)
    doc = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
           "metadata": _metadata(cluster, "rules", namespace, labels), "spec": {"groups": groups}}
    text = _yaml(doc, [f"tailpilot's alert rules for cluster {cluster.name} as a Prometheus Operator "
                       "PrometheusRule (--label release=NAME if your Prometheus selects rules by label)."])
    back = strict_yaml.load(text)
    if back != doc:
        raise MonitoringExportError("prometheusrule: the rendering did not parse back; this is a bug")
    _check_metadata(back["metadata"], "prometheusrule")
    _verify_groups(back["spec"]["groups"], groups, "prometheusrule")
    return text


def _check_metadata(metadata: dict[str, Any], fmt: str) -> None:
    if not DNS_NAME.match(metadata["name"]):
        raise MonitoringExportError(f"{fmt}: metadata.name {metadata['name']!r} is not a Kubernetes name")
    check_labels(metadata["labels"])


def _verify_groups(back: Any, groups: list[dict[str, Any]], fmt: str) -> None:
    if back != groups:
        raise MonitoringExportError(f"{fmt}: the rendering did not parse back to its rules; this is a bug")
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
    return {"mode": "absolute", "steps": [{"color": color, "value": value} for value, color in steps]}


class _Layout:
    """Panels placed left to right on Grafana's 24-column grid, a new row when one is full."""

    def __init__(self) -> None:
        self.panels: list[dict[str, Any]] = []
        self.x = self.y = self.row_h = 0

    def add(self, panel: dict[str, Any], w: int, h: int) -> None:
        if self.x + w > 24:
            self.x, self.y, self.row_h = 0, self.y + self.row_h, 0
        panel = {"id": len(self.panels) + 1, "gridPos": {"x": self.x, "y": self.y, "w": w, "h": h},
                 "datasource": _DS, **panel}
        self.panels.append(panel)
        self.x += w
        self.row_h = max(self.row_h, h)

    def row(self, title: str) -> None:
        if self.x:
            self.x, self.y, self.row_h = 0, self.y + self.row_h, 0
        self.panels.append({"id": len(self.panels) + 1, "type": "row", "title": title, "collapsed": False,
                            "gridPos": {"x": 0, "y": self.y, "w": 24, "h": 1}, "panels": []})
        self.y += 1


def _targets(*queries: tuple[str, str]) -> list[dict[str, Any]]:
    return [{"refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend, "datasource": _DS}
            for i, (expr, legend) in enumerate(queries)]


def _panel(kind: str, title: str, description: str, queries: list[tuple[str, str]], *, unit: str | None = None,
           thresholds: dict[str, Any] | None = None, min_: float | None = None, max_: float | None = None,
           **extra: Any) -> dict[str, Any]:
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
    return {"type": kind, "title": title, "description": description, "targets": targets,
            "fieldConfig": {"defaults": defaults, "overrides": extra.pop("overrides", [])}, **extra}


def grafana_dashboard_doc(cluster: Any) -> dict[str, Any]:
    """The dashboard of ``cluster`` as a dict (the JSON Grafana imports)."""
    name = cluster.name
    c = _sel(name)
    lay = _Layout()
    gov = cluster.governance
    if gov is not None:
        a = gov.alerts
        # Seed 003 §9: SCR yellow below 0.95, red below 0.90; JFI and type fairness at their alerts.
        scr_t = _thresholds([(None, "red"), (a.scr_critical, "yellow"), (a.scr_warning, "green")])
        jfi_t = _thresholds([(None, "red"), (a.jfi, "green")])
        tf_t = _thresholds([(None, "red"), (a.type_fairness, "green")])
        lay.row("Governance (seed 003): SCR, JFI, type fairness")
        lay.add(_panel("stat", "SCR", "Fraction of tenants meeting every quantile target over the window.",
                       [(f"tailpilot_scr{c}", "SCR")], unit="percentunit", thresholds=scr_t, min_=0, max_=1), 4, 5)
        lay.add(_panel("stat", "JFI", "Jain's index over the tenants' throughput per commitment.",
                       [(f"tailpilot_jfi{c}", "JFI")], thresholds=jfi_t, min_=0, max_=1), 4, 5)
        lay.add(_panel("stat", "Type fairness (lowest)", "The lowest request type's share over its guaranteed share.",
                       [(f"tailpilot_type_fairness{c}", "lowest type")], thresholds=tf_t, min_=0), 4, 5)
        lay.add(_panel("stat", "Alerts firing", "tailpilot's governance alerts firing now (any severity).",
                       [(f"sum(tailpilot_alert_firing{c})", "firing")],
                       thresholds=_thresholds([(None, "green"), (1, "red")])), 4, 5)
        lay.add(_panel("stat", "Governor", "The governor's state (record --govern) and its emergency modes.",
                       [(f"tailpilot_governor_state{c} == 1", "{{state}}"),
                        (f"tailpilot_governor_mode_active{c} == 1", "mode {{mode}}")],
                       options={"textMode": "name", "colorMode": "none", "reduceOptions": {"calcs": ["lastNotNull"]}}),
                8, 5)
        lay.add(_panel("timeseries", "SCR over time", f"Yellow below {a.scr_warning:g}, red below {a.scr_critical:g}.",
                       [(f"tailpilot_scr{c}", "SCR")], unit="percentunit", thresholds=scr_t, min_=0, max_=1), 8, 8)
        lay.add(_panel("timeseries", "JFI over time", f"The tenant-suppression alert fires below {a.jfi:g}.",
                       [(f"tailpilot_jfi{c}", "JFI")], thresholds=jfi_t, min_=0, max_=1), 8, 8)
        lay.add(_panel("timeseries", "Type fairness ratio per type",
                       f"A type's share over its guaranteed share; starvation alert below {a.type_fairness:g}.",
                       [(f"tailpilot_type_fairness_ratio{c}", "{{type}}")], thresholds=tf_t, min_=0), 8, 8)
        lay.row("Tenants against their targets")
        lay.add(_panel("timeseries", "TTFT P99 per tenant (dashed: target)", "Exact windowed percentiles.",
                       [(f"tailpilot_tenant_latency_seconds{_sel(name, latency='ttft', quantile='0.99')}",
                         "{{tenant}}"),
                        (f"tailpilot_tenant_slo_seconds{_sel(name, latency='ttft', quantile='0.99')}",
                         "{{tenant}} target")], unit="s",
                       overrides=[{"matcher": {"id": "byRegexp", "options": ".* target$"},
                                   "properties": [{"id": "custom.lineStyle",
                                                   "value": {"fill": "dash", "dash": [10, 10]}}]}]), 12, 8)
        lay.add(_panel("timeseries", "Throughput per commitment", "Tokens served per second over each tenant's "
                       "committed rate (or weight): what JFI is computed from.",
                       [(f"tailpilot_tenant_normalised_throughput{c}", "{{tenant}}")]), 12, 8)
        lay.add(_panel("table", "Tenants now", "Compliance, requests and percentiles of the window.",
                       [(f"tailpilot_tenant_slo_compliant{c}", "compliant {{tenant}}"),
                        (f"tailpilot_tenant_requests{c}", "requests {{tenant}}")],
                       options={"showHeader": True}), 24, 6)
    lay.row("Replicas")
    lay.add(_panel("timeseries", "TTFT P99 per replica", "Exact windowed percentile of completed requests.",
                   [(f"tailpilot_latency_seconds{_sel(name, latency='ttft', quantile='0.99')}", "{{replica}}")],
                   unit="s"), 8, 8)
    lay.add(_panel("timeseries", "Queue", "Waiting and running requests per replica.",
                   [(f"tailpilot_waiting_requests{c}", "waiting {{replica}}"),
                    (f"tailpilot_running_requests{c}", "running {{replica}}")]), 8, 8)
    lay.add(_panel("timeseries", "KV cache in use", "Fraction of each replica's KV blocks in use.",
                   [(f"tailpilot_kv_usage_ratio{c}", "{{replica}}")], unit="percentunit", min_=0, max_=1), 8, 8)
    lay.add(_panel("timeseries", "Live γ and β", "The policy's live parameters (γ-Ada moves γ).",
                   [(f"tailpilot_gamma{c}", "γ {{replica}}"), (f"tailpilot_beta{c}", "β {{replica}}")]), 12, 8)
    lay.add(_panel("timeseries", "Refused on arrival", "Requests per second turned away at a tenant's queue "
                   "cap (slofq's queue_cap); each is also in the completions log as rejected.",
                   [(f"rate(tailpilot_refused_requests_total{c}[5m])", "{{replica}}")], unit="reqps", min_=0), 12, 8)
    lay.add(_panel("table", "Policy and settings version", "What each replica runs now.",
                   [(f"tailpilot_replica_info{c}", "{{replica}} {{policy}}"),
                    (f"tailpilot_settings_version{c}", "{{replica}} version"),
                    (f"tailpilot_replica_up{c}", "{{replica}} up")], options={"showHeader": True}), 12, 8)
    exprs = [t["expr"] for p in lay.panels for t in p.get("targets", [])]
    _check_series(exprs, "grafana")
    return {
        "uid": _fit(f"tailpilot-{name}", "A-Za-z0-9_-", 40), "title": f"tailpilot — cluster {name}",
        "description": "tailpilot's recorder /metrics (tailpilot export --format grafana)",
        "tags": ["tailpilot", "vllm"], "timezone": "browser", "editable": True, "graphTooltip": 1,
        "schemaVersion": GRAFANA_SCHEMA_VERSION, "version": 1, "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": [{"name": "datasource", "label": "Prometheus", "type": "datasource",
                                 "query": "prometheus", "current": {}, "hide": 0}]},
        "annotations": {"list": []},
        "panels": lay.panels,
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


def check_dashboard(doc: dict[str, Any], cluster: Any) -> None:
    """A loaded dashboard is whole: unique panel ids, panels on the grid without overlap, a query
    per panel naming only served series, and the cluster's thresholds on the governance panels."""
    def fail(what: str) -> NoReturn:
        raise MonitoringExportError(f"grafana: {what}")

    if doc.get("schemaVersion") != GRAFANA_SCHEMA_VERSION or not doc.get("title"):
        fail("schemaVersion or title missing")
    if not GRAFANA_UID.match(str(doc.get("uid", ""))):
        fail(f"uid {doc.get('uid')!r} is not a Grafana uid (at most 40 of letters, digits, '-' and '_')")
    panels = doc.get("panels")
    if not isinstance(panels, list) or not panels:
        fail("no panels")
    ids = [p.get("id") for p in panels]
    if len(ids) != len(set(ids)):
        fail(f"duplicate panel ids {ids}")
    cells: set[tuple[int, int]] = set()
    for p in panels:
        g = p.get("gridPos") or {}
        if not (all(isinstance(g.get(k), int) for k in "xywh") and 0 <= g["x"] and g["w"] > 0
                and g["x"] + g["w"] <= 24 and g["y"] >= 0 and g["h"] > 0):
            fail(f"panel {p.get('title')!r} is off the 24-column grid: {g}")
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        if mine & cells:
            fail(f"panel {p.get('title')!r} overlaps another")
        cells |= mine
        if p.get("type") != "row" and not p.get("targets"):
            fail(f"panel {p.get('title')!r} has no query")
    _check_series(dashboard_queries(doc), "grafana")
    gov = cluster.governance
    if gov is not None:
        by_title = {p.get("title"): p for p in panels}
        a = gov.alerts
        want = {"SCR": [None, a.scr_critical, a.scr_warning], "JFI": [None, a.jfi],
                "Type fairness (lowest)": [None, a.type_fairness]}
        for title, values in want.items():
            steps = by_title.get(title, {}).get("fieldConfig", {}).get("defaults", {}).get("thresholds", {}).get("steps")
            if [s.get("value") for s in steps or []] != values:
                fail(f"panel {title!r}: thresholds {steps} are not the cluster's {values}")


# ---------------------------------------------------------------------------------------------
# ServiceMonitor
# ---------------------------------------------------------------------------------------------


def seconds(duration: str) -> float:
    """A Prometheus duration in seconds (``check_duration`` first)."""
    scale = {"y": 365 * 86_400, "w": 7 * 86_400, "d": 86_400, "h": 3_600, "m": 60, "s": 1, "ms": 0.001}
    return sum(int(n) * scale[u] for n, u in re.findall(r"([0-9]+)(ms|[ywdhms])", duration))


def scrape_timeout(interval: str) -> str:
    """A scrape timeout for ``interval``: Prometheus's default 10 s, but never above the interval."""
    t = min(10.0, seconds(check_duration(interval, "interval")))
    return f"{int(t)}s" if t >= 1 and t == int(t) else f"{max(1, int(t * 1000))}ms"


def service_monitor_doc(cluster: Any, *, namespace: str | None = None, interval: str = "15s",
                        labels: dict[str, str] | None = None) -> dict[str, Any]:
    selector = {**RECORDER_LABELS, "tailpilot/cluster": label_value(cluster.name)}
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
            "metadata": _metadata(cluster, "recorder", namespace, labels),
            "spec": {"selector": {"matchLabels": selector},
                     "endpoints": [{"port": METRICS_PORT_NAME, "path": "/metrics", "interval": interval,
                                    "scrapeTimeout": scrape_timeout(interval)}]}}


def service_monitor(cluster: Any, *, namespace: str | None = None, interval: str = "15s",
                    labels: dict[str, str] | None = None) -> str:
    doc = service_monitor_doc(cluster, namespace=namespace, interval=interval, labels=labels)
    selected = ", ".join(f"{k}={v}" for k, v in doc["spec"]["selector"]["matchLabels"].items())
    text = _yaml(doc, [f"A ServiceMonitor for tailpilot's recorder of cluster {cluster.name}: it selects the Service "
                       f"labelled {selected} and scrapes its port named {METRICS_PORT_NAME!r} (the recorder runs "
                       "with `tailpilot record --metrics-port 9464 --metrics-host 0.0.0.0`). --label release=NAME "
                       "if your Prometheus selects ServiceMonitors by label."])
    back = strict_yaml.load(text)
    if back != doc:
        raise MonitoringExportError("servicemonitor: the rendering did not parse back; this is a bug")
    _check_metadata(back["metadata"], "servicemonitor")
    if not all(LABEL_VALUE.match(v) for v in back["spec"]["selector"]["matchLabels"].values()):
        raise MonitoringExportError("servicemonitor: a selector label value is not a Kubernetes label value")
    return text


def render(cluster: Any, fmt: str, *, namespace: str | None = None, for_: str | None = None,
           interval: str = "15s", labels: dict[str, str] | None = None) -> str:
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

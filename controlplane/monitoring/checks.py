"""What every monitoring rendering is checked against: the names Kubernetes and Grafana accept,
Prometheus's durations, the recorder's series as the queries read them, and a whole Grafana
dashboard.

A query may name only samples the recorder serves (:data:`controlplane.series.SERIES`), read a
counter only through ``rate()``, ``irate()`` or ``increase()`` and a gauge never so
(:func:`check_series`); a dashboard's queries also filter on its ``$cluster`` and ``$replica``
variables (:func:`check_dashboard`). A rendering that fails a check raises
:class:`MonitoringExportError`.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any, NoReturn

from controlplane.cluster import ClusterSpec
from controlplane.governance import AlertThresholds
from controlplane.series import SERIES, Series
from scheduler.errors import TailpilotError

_METRIC = re.compile(r"\b(tailpilot_[a-z0-9_]+)\b")
# Prometheus's duration syntax: units largest first, each at most once (model.ParseDuration)
_DURATION = re.compile(
    r"^(?:[0-9]+y)?(?:[0-9]+w)?(?:[0-9]+d)?(?:[0-9]+h)?(?:[0-9]+m)?(?:[0-9]+s)?(?:[0-9]+ms)?$"
)
# A Kubernetes object name (RFC 1123 label)
DNS_NAME = re.compile(r"^[a-z0-9](?:[-a-z0-9]{0,61}[a-z0-9])?$")
LABEL_VALUE = re.compile(r"^(?:[A-Za-z0-9](?:[-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")
_LABEL_KEY = re.compile(
    r"^(?:[a-z0-9](?:[-a-z0-9.]{0,251}[a-z0-9])?/)?"
    r"[A-Za-z0-9](?:[-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)
GRAFANA_UID = re.compile(r"^[A-Za-z0-9_-]{1,40}$")
GRAFANA_SCHEMA_VERSION = 39  # Grafana 10.x/11.x dashboards
# The dashboard's template variables: every query filters on both (check_dashboard)
CLUSTER_VAR, REPLICA_VAR = "cluster", "replica"


class MonitoringExportError(TailpilotError, ValueError):
    """A cluster that cannot be exported this way, or a rendering that did not check out."""


# --- names ---------------------------------------------------------------------------------


def fit_name(raw: str, allowed: str, limit: int, lower: bool = False) -> str:
    """``raw`` as a name of ``allowed`` characters, at most ``limit`` long; a short hash of the
    original is appended whenever it had to change (so two clusters never share a name)."""
    name = re.sub(f"[^{allowed}]+", "-", raw.lower() if lower else raw).strip("-_.")
    if name == raw and len(name) <= limit:
        return name
    digest = hashlib.sha256(raw.encode()).hexdigest()[:6]
    return f"{name[: limit - 7].rstrip('-_.')}-{digest}".lstrip("-")


def k8s_name(*parts: str) -> str:
    return fit_name("-".join(parts), "a-z0-9-", 63, lower=True)


def label_value(value: str) -> str:
    return fit_name(value, "A-Za-z0-9_.-", 63)


def check_labels(labels: dict[str, str]) -> dict[str, str]:
    """Extra metadata labels (``--label release=prom``): Kubernetes' rules for keys and values."""
    for k, v in labels.items():
        if not _LABEL_KEY.match(k):
            raise MonitoringExportError(f"label: {k!r} is not a Kubernetes label key")
        if not LABEL_VALUE.match(v):
            raise MonitoringExportError(
                f"label: {k}={v!r}: a label value is at most 63 characters of "
                "letters, digits, '-', '_' and '.', starting and ending with a letter or digit"
            )
    return labels


def check_metadata(metadata: dict[str, Any], fmt: str) -> None:
    """A rendered object's ``metadata``: a Kubernetes name, Kubernetes labels."""
    if not DNS_NAME.match(metadata["name"]):
        raise MonitoringExportError(
            f"{fmt}: metadata.name {metadata['name']!r} is not a Kubernetes name"
        )
    check_labels(metadata["labels"])


# --- durations -----------------------------------------------------------------------------


def duration(seconds_: float) -> str | None:
    """``seconds_`` as Prometheus writes a duration (``30s``, ``1m30s``, ``1s500ms``); None for 0
    (no hold)."""
    ms = round(float(seconds_) * 1000)
    out = ""
    for unit, size in (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000), ("ms", 1)):
        n, ms = divmod(ms, size)
        out += f"{n}{unit}" if n else ""
    return out or None


def check_duration(value: str, field: str) -> str:
    """``value`` if it is a Prometheus duration (``30s``, ``1m30s``), else an error naming
    ``field``."""
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


# --- the recorder's series in queries ------------------------------------------------------

SAMPLES: dict[str, Series] = {s.sample: s for s in SERIES.values()}
"""Each family by the name its samples have on the page (a counter's carry ``_total``)."""
_SELECTOR = re.compile(r"\b(tailpilot_[a-z0-9_]+)\b(?:\s*\{([^}]*)\})?")
_MATCHER = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"\s*,?')
_RATE = re.compile(r"\b(?:rate|irate|increase)\(\s*$")


def metrics_in(expr: str) -> set[str]:
    """The ``tailpilot_*`` families an expression reads (a counter's ``_total`` sample as its
    family)."""
    return {SAMPLES[n].name if n in SAMPLES else n for n in _METRIC.findall(expr)}


def selectors(expr: str) -> list[tuple[str, dict[str, tuple[str, str]], bool]]:
    """Each ``tailpilot_*`` selector of ``expr``: (sample name, label -> (operator, value), whether
    it is the argument of rate(), irate() or increase())."""
    out = []
    for m in _SELECTOR.finditer(expr):
        matchers = {k: (op, v) for k, op, v in _MATCHER.findall(m.group(2) or "")}
        out.append((m.group(1), matchers, bool(_RATE.search(expr[: m.start()]))))
    return out


def check_series(exprs: list[str], where: str) -> None:
    """Every query names samples the recorder serves, and reads counters through rate(),
    irate() or increase() and gauges never so."""
    problems: set[str] = set()
    for expr in exprs:
        for name, _, in_rate in selectors(expr):
            series = SAMPLES.get(name)
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


# --- the Grafana dashboard ------------------------------------------------------------------


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
        series = SAMPLES.get(name)
        if matchers.get("cluster") != ("=", f"${CLUSTER_VAR}"):
            out.append(f'{name} (no cluster="${CLUSTER_VAR}")')
        if (
            series is not None
            and "replica" in series.labels
            and matchers.get("replica") != ("=~", f"${REPLICA_VAR}")
        ):
            out.append(f'{name} (no replica=~"${REPLICA_VAR}")')
    return out


def _fail(what: str) -> NoReturn:
    raise MonitoringExportError(f"grafana: {what}")


def _check_variables(doc: dict[str, Any], cluster: ClusterSpec) -> None:
    """The ``$cluster`` and ``$replica`` query variables: this cluster by default, and all
    replicas selectable."""
    variables = {v.get("name"): v for v in (doc.get("templating") or {}).get("list") or []}
    for var in (CLUSTER_VAR, REPLICA_VAR):
        if (variables.get(var) or {}).get("type") != "query":
            _fail(f"no ${var} template variable")
    if variables[CLUSTER_VAR].get("current", {}).get("value") != cluster.name:
        _fail(f"$cluster does not default to the cluster {cluster.name!r}")
    if not (
        variables[REPLICA_VAR].get("includeAll") and variables[REPLICA_VAR].get("allValue") == ".*"
    ):
        _fail("$replica cannot select all replicas")


def _check_grid(panels: list[dict[str, Any]]) -> None:
    """Unique panel ids, every panel on the 24-column grid without overlap, a query per panel
    (rows aside)."""
    ids = [p.get("id") for p in panels]
    if len(ids) != len(set(ids)):
        _fail(f"duplicate panel ids {ids}")
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
            _fail(f"panel {p.get('title')!r} is off the 24-column grid: {g}")
        mine = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        if mine & cells:
            _fail(f"panel {p.get('title')!r} overlaps another")
        cells |= mine
        if p.get("type") != "row" and not p.get("targets"):
            _fail(f"panel {p.get('title')!r} has no query")


def _check_thresholds(panels: list[dict[str, Any]], a: AlertThresholds) -> None:
    """The governance stat panels are coloured at the cluster's alert thresholds."""
    by_title = {p.get("title"): p for p in panels}
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
            _fail(f"panel {title!r}: thresholds {steps} are not the cluster's {values}")


def check_dashboard(doc: dict[str, Any], cluster: ClusterSpec) -> None:
    """A loaded dashboard is whole: unique panel ids, panels on the grid without overlap, a query
    per panel naming only served series and filtering on the ``$cluster`` and ``$replica``
    variables (which it defines), and the cluster's thresholds on the governance panels."""
    if doc.get("schemaVersion") != GRAFANA_SCHEMA_VERSION or not doc.get("title"):
        _fail("schemaVersion or title missing")
    if not GRAFANA_UID.match(str(doc.get("uid", ""))):
        _fail(
            f"uid {doc.get('uid')!r} is not a Grafana uid "
            "(at most 40 of letters, digits, '-' and '_')"
        )
    _check_variables(doc, cluster)
    panels = doc.get("panels")
    if not isinstance(panels, list) or not panels:
        _fail("no panels")
    _check_grid(panels)
    queries = dashboard_queries(doc)
    check_series(queries, "grafana")
    loose = sorted({x for q in queries for x in unfiltered(q)})
    if loose:
        _fail(f"queries not filtered on the dashboard's variables: {loose}")
    if cluster.governance is not None:
        _check_thresholds(panels, cluster.governance.alerts)

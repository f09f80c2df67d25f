"""The recorder's Prometheus page: ``tailpilot_*`` series read from a live collector at scrape time
(``tailpilot record --metrics-port 9464``; README, "Prometheus and Grafana").

    exporter = MetricsServer(collector, host="127.0.0.1", port=9464)
    await exporter.start()          # GET /metrics on the recorder's own event loop
    ...
    await exporter.stop()

Every figure is the collector's own — the exact windowed percentiles it computes from the replicas'
completions (never a histogram's estimate), the governance report (SCR, JFI, type fairness, per
tenant and type) and the governor's last status — so Prometheus, ``tailpilot status --json`` and the
TUI agree. A figure without data (no request in the window) is left out, not written as NaN.

:data:`SERIES` names every family and its labels; ``tailpilot export prometheus-rules`` and
``grafana`` build their queries from it, and the tests check both against a real scrape.

The page is served on the collector's event loop (aiohttp) and rendered synchronously, so a
scrape reads the collector's state between two of its steps, never while a poll is changing it;
a request body is refused, and only ``GET /metrics`` (and ``/``) exist.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily

from controlplane.settings import QUANTILES
from storage.rows import LATENCIES, PERCENTILES

DEFAULT_PORT = 9464  # the port prometheus_client's own exporters use by convention


@dataclass(frozen=True, slots=True)
class Series:
    name: str
    labels: tuple[str, ...]
    doc: str


def _series(*rows: tuple[str, str, str]) -> dict[str, Series]:
    return {name: Series(name, tuple(labels.split()) if labels else (), doc) for name, labels, doc in rows}


R = "cluster replica"
SERIES: dict[str, Series] = _series(
    # per replica (the collector's latest poll)
    ("tailpilot_replica_up", R, "1 when the replica answered its last poll, else 0."),
    ("tailpilot_replica_info", f"{R} policy mode", "1, labelled with the replica's policy and mode (plugin | metrics-only)."),
    ("tailpilot_settings_version", R, "Version of the replica's active settings document."),
    ("tailpilot_gamma", R, "Live γ of the replica's policy (its adaptive value where it adapts)."),
    ("tailpilot_beta", R, "Live β of the replica's policy."),
    ("tailpilot_waiting_requests", R, "Requests waiting in the replica's queue."),
    ("tailpilot_running_requests", R, "Requests in the replica's running batch."),
    ("tailpilot_kv_usage_ratio", R, "Fraction of the replica's KV cache in use (0..1)."),
    ("tailpilot_throughput_tokens_per_second", R, "Output tokens per second over the window."),
    ("tailpilot_preemptions_per_second", R, "Preemptions per second over the window."),
    ("tailpilot_latency_seconds", f"{R} latency quantile",
     "Exact percentile of the window's completed requests (latency: ttft | ttlt | tbt)."),
    ("tailpilot_group_latency_seconds", f"{R} kind group latency quantile",
     "Exact percentile per tenant or request type (kind) of the replica's window."),
    ("tailpilot_group_requests", f"{R} kind group", "Requests completed in the window per tenant or type."),
    ("tailpilot_window_seconds", "cluster", "Length of the rolling window every windowed figure covers."),
    # governance (over every replica's window together)
    ("tailpilot_scr", "cluster", "SLO compliance ratio: the fraction of tenants meeting every quantile target."),
    ("tailpilot_jfi", "cluster", "Jain's fairness index over the tenants' throughput per commitment."),
    ("tailpilot_type_fairness", "cluster", "The lowest request type's share over its guaranteed share."),
    ("tailpilot_governance_requests", "cluster", "Requests the governance figures were computed from."),
    ("tailpilot_tenant_latency_seconds", "cluster tenant latency quantile",
     "Exact percentile of the tenant's requests across the cluster (latency: ttft | ttlt)."),
    ("tailpilot_tenant_slo_seconds", "cluster tenant latency quantile", "The tenant's target for that percentile."),
    ("tailpilot_tenant_slo_compliant", "cluster tenant", "1 when the tenant meets every target it has, else 0."),
    ("tailpilot_tenant_requests", "cluster tenant", "The tenant's requests in the window."),
    ("tailpilot_tenant_throughput_tokens_per_second", "cluster tenant", "Tokens served (prompt + output) per second."),
    ("tailpilot_tenant_normalised_throughput", "cluster tenant", "Throughput over the tenant's commitment (or weight)."),
    ("tailpilot_type_share", "cluster type", "The type's share of the window's completed requests."),
    ("tailpilot_type_minimum_share", "cluster type", "The type's minimum share ρ_k."),
    ("tailpilot_type_fairness_ratio", "cluster type", "The type's share over its guaranteed share."),
    ("tailpilot_alert_firing", "cluster alert severity", "1 while the alert fires at this severity, else 0."),
    ("tailpilot_alert_threshold", "cluster alert severity", "The figure below which the alert fires at this severity."),
    # the governor (when it runs in this recorder)
    ("tailpilot_governor_state", "cluster state", "1 for the governor's state (armed | dry-run | disarmed), else 0."),
    ("tailpilot_governor_paused", "cluster", "1 while an operator has paused the governor."),
    ("tailpilot_governor_mode_active", "cluster mode", "1 while the emergency mode (scr | jfi | type) is in force."),
    ("tailpilot_governor_mode_dry_run", "cluster mode", "1 while the mode is only logged (entered in dry-run)."),
)
QUANTILE_LABEL = {f"p{q}": f"{q / 100:g}" for q in PERCENTILES}  # "p99" -> "0.99"
ALERT_SEVERITIES = {"scr": ("warning", "critical"), "jfi": ("warning",), "type_fairness": ("warning",)}


def _finite(value: Any) -> float | None:
    if value is None or isinstance(value, bool):
        return None
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if value == value and abs(value) != float("inf") else None


class _Families:
    """The families of one scrape, filled by name; samples without a value are left out."""

    def __init__(self) -> None:
        self.families = {s.name: GaugeMetricFamily(s.name, s.doc, labels=list(s.labels)) for s in SERIES.values()}

    def add(self, name: str, labels: tuple[str, ...], value: Any) -> None:
        v = _finite(value)
        if v is not None:
            self.families[name].add_metric(list(labels), v)

    def __iter__(self) -> Iterator[GaugeMetricFamily]:
        return (f for f in self.families.values() if f.samples)


class ClusterMetrics:
    """A prometheus_client collector over a :class:`controlplane.collector.Collector`."""

    def __init__(self, collector: Any) -> None:
        self.collector = collector

    def collect(self) -> Iterator[GaugeMetricFamily]:
        c = self.collector
        cluster = c.cluster.name
        out = _Families()
        out.add("tailpilot_window_seconds", (cluster,), c.cluster.window_s)
        for name, view in c.views.items():
            self._replica(out, cluster, name, view)
        if c.governance is not None:
            self._governance(out, cluster, c.governance, c.cluster.governance)
        if getattr(c, "governor_status", None) is not None:
            self._governor(out, cluster, c.governor_status)
        return iter(out)

    @staticmethod
    def _replica(out: _Families, cluster: str, name: str, view: Any) -> None:
        key = (cluster, name)
        out.add("tailpilot_replica_up", key, 1.0 if view.health.healthy else 0.0)
        row = view.sample
        if row is None or not row.healthy:
            return
        if row.policy:
            out.add("tailpilot_replica_info", (*key, row.policy, view.health.mode), 1.0)
        for series, value in (("tailpilot_settings_version", row.settings_version),
                              ("tailpilot_gamma", row.gamma_live), ("tailpilot_beta", row.beta_live),
                              ("tailpilot_waiting_requests", row.waiting), ("tailpilot_running_requests", row.running),
                              ("tailpilot_kv_usage_ratio", row.kv_usage),
                              ("tailpilot_throughput_tokens_per_second", row.throughput_tok_s),
                              ("tailpilot_preemptions_per_second", row.preemptions_per_s)):
            out.add(series, key, value)
        for lat in LATENCIES:
            for q in PERCENTILES:
                out.add("tailpilot_latency_seconds", (*key, lat, QUANTILE_LABEL[f"p{q}"]),
                        getattr(row.latency, f"{lat}_p{q}"))
        for g in view.groups:
            out.add("tailpilot_group_requests", (*key, g.kind, g.group), g.completed)
            for lat in LATENCIES:
                for q in PERCENTILES:
                    out.add("tailpilot_group_latency_seconds", (*key, g.kind, g.group, lat, QUANTILE_LABEL[f"p{q}"]),
                            getattr(g.latency, f"{lat}_p{q}"))

    @staticmethod
    def _governance(out: _Families, cluster: str, g: dict[str, Any], spec: Any) -> None:
        key = (cluster,)
        out.add("tailpilot_scr", key, g.get("scr"))
        out.add("tailpilot_jfi", key, g.get("jfi"))
        out.add("tailpilot_type_fairness", key, g.get("type_fairness_min"))
        out.add("tailpilot_governance_requests", key, g.get("requests"))
        for tenant, f in sorted(g.get("tenants", {}).items()):
            t = (cluster, tenant)
            for lat in ("ttft", "ttlt"):
                for q in QUANTILES:
                    out.add("tailpilot_tenant_latency_seconds", (*t, lat, QUANTILE_LABEL[q]), f.get(f"{lat}_{q}"))
            for metric, limit in sorted(f.get("limits", {}).items()):
                lat, q = metric.split("_", 1)
                out.add("tailpilot_tenant_slo_seconds", (*t, lat, QUANTILE_LABEL[q]), limit)
            out.add("tailpilot_tenant_slo_compliant", t, 1.0 if f.get("compliant") else 0.0)
            out.add("tailpilot_tenant_requests", t, f.get("requests"))
            out.add("tailpilot_tenant_throughput_tokens_per_second", t, f.get("tok_s"))
            out.add("tailpilot_tenant_normalised_throughput", t, f.get("normalised"))
        for kind, f in sorted(g.get("types", {}).items()):
            t = (cluster, kind)
            out.add("tailpilot_type_share", t, f.get("share"))
            out.add("tailpilot_type_minimum_share", t, f.get("minimum"))
            out.add("tailpilot_type_fairness_ratio", t, f.get("ratio"))
        from controlplane.governance import AlertEvaluator

        firing = g.get("alerts") or {}
        thresholds = AlertEvaluator(spec.alerts) if spec is not None else None
        for alert, severities in ALERT_SEVERITIES.items():
            for severity in severities:
                out.add("tailpilot_alert_firing", (cluster, alert, severity), 1.0 if firing.get(alert) == severity else 0.0)
                if thresholds is not None:
                    out.add("tailpilot_alert_threshold", (cluster, alert, severity),
                            thresholds.threshold(alert, severity))

    @staticmethod
    def _governor(out: _Families, cluster: str, status: dict[str, Any]) -> None:
        from controlplane.governor import MODES, STATES

        for state in STATES:
            out.add("tailpilot_governor_state", (cluster, state), 1.0 if status.get("state") == state else 0.0)
        out.add("tailpilot_governor_paused", (cluster,), 1.0 if status.get("paused") else 0.0)
        active, dry = status.get("active") or {}, set(status.get("dry") or ())
        for mode in MODES:
            out.add("tailpilot_governor_mode_active", (cluster, mode.name), 1.0 if mode.name in active else 0.0)
            out.add("tailpilot_governor_mode_dry_run", (cluster, mode.name), 1.0 if mode.name in dry else 0.0)


def render(collector: Any) -> bytes:
    """The Prometheus text page of ``collector`` now."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ClusterMetrics(collector))  # type: ignore[arg-type]
    return generate_latest(registry)


class MetricsServer:
    """``GET /metrics`` of a collector, served on the running event loop (aiohttp)."""

    def __init__(self, collector: Any, *, host: str = "127.0.0.1", port: int = DEFAULT_PORT) -> None:
        self.collector = collector
        self.host, self.port = host, port
        self._runner: Any = None

    async def start(self) -> int:
        """Listen; returns the port (the one picked when ``port`` was 0)."""
        from aiohttp import web

        app = web.Application(client_max_size=1024)  # a scrape sends no body
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/", self._index)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, backlog=16)
        await site.start()
        sockets = getattr(site._server, "sockets", None) or []
        if sockets:
            self.port = sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _metrics(self, request: Any) -> Any:
        from aiohttp import web

        body = render(self.collector)  # synchronous: the collector cannot change under it
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _index(self, request: Any) -> Any:
        from aiohttp import web

        return web.Response(text=f"tailpilot recorder of cluster {self.collector.cluster.name}: /metrics\n")

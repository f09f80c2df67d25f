"""The recorder's Prometheus page: ``tailpilot_*`` series read from a live collector at scrape time
(``tailpilot record --metrics-port 9464``; README, "Prometheus and Grafana"; every series and the
renames of this version in docs/metrics.md).

    exporter = MetricsServer(collector, host="127.0.0.1", port=9464)
    await exporter.start()          # GET /metrics (and /health) on a bounded server thread
    ...
    await exporter.stop()

Every windowed figure is the collector's own — the exact windowed percentiles it computes from
the replicas' completions (never a histogram's estimate), the governance report (SCR, both JFIs,
type fairness, ω, per tenant and type) and the governor's last status — so Prometheus, ``tailpilot
status --json`` and the TUI agree. A figure without data (no request in the window) is left out,
not written as NaN. The page follows Prometheus's conventions (``promtool check metrics`` finds
nothing; the tests run it on a real page):

* Counts are counters (``_total``), for ``rate()``: completed requests, prompt and output tokens
  per replica and tenant (:class:`CompletionCounters`: what this recorder read since it started),
  and the replica's own preemptions, refusals and breaker trips (since the replica started).
  Tokens have one definition per name: ``prompt`` and ``output`` apart, never a mix.
* Percentiles are gauges labelled ``percentile="p99"``: ``quantile`` is reserved for summaries,
  and a windowed exact percentile beside its target is not one.
* Units are suffixes (``_seconds``, ``_ratio``, ``_tokens_total``, ``_requests``).
* A replica that did not answer its last poll has only ``tailpilot_replica_up 0`` and the
  recorder's own counts on the page, none of its last answer's figures. The governance figures
  are over every replica's window: ``tailpilot_governance_stale_replicas`` counts the down ones
  whose last window still counts in them, and with no replica up they are left out.

:data:`controlplane.series.SERIES` names every family and its labels (``tailpilot export
prometheus-rules`` and ``grafana`` build their queries from it, and the tests check both against a
real scrape); :data:`controlplane.series.RENAMED` maps the names of the previous version to these.

Tenant names come from clients, so the page labels at most
:data:`~scheduler.names.MAX_GROUPS_PER_WINDOW` of them: the cluster file's tenants first, then the
busiest; ``tailpilot_tenants_omitted`` counts the rest. Request-type names likewise
(:data:`~scheduler.names.MAX_GROUPS_PER_WINDOW`, ``tailpilot_types_omitted``); each replica's window
already folds names past the bounds of scheduler.names into one "other" group, and the counters fold
names past the same bounds (first come) into "other" for good, so that a counter never vanishes.

``tailpilot_ingest_rejected_total`` counts, per replica and reason, what the collector could not
store as a replica sent it (storage.limits.REASONS); ``tailpilot_breaker_trips_total`` is each
replica's own count of its circuit breaker's trips.

Served by the control API's own server (``scheduler.plugin.api.ControlServer``: bounded
connections, header and idle deadlines, rate limits; only ``GET /metrics`` and ``/health``).
The page is rendered on the collector's event loop — the scrape thread asks the loop and waits —
so it never reads the collector while a poll is changing it; a rendering is reused for
:data:`CACHE_S`, so scrapes cost the collector at most one rendering that often.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from controlplane.collector import Collector
from controlplane.governance import GovernanceReport, GovernanceSpec
from controlplane.governor import MODES, modes
from controlplane.poller import PollResult, ReplicaView
from controlplane.series import ALERT_SEVERITIES, SERIES
from scheduler.names import MAX_GROUPS_PER_WINDOW, fold_name
from scheduler.plugin.admission import Limits
from scheduler.plugin.api import ControlServer
from scheduler.plugin.request import HTTPError
from scheduler.settings import QUANTILES
from scheduler.validation import finite_or_none
from storage.control import CONTROL_STATES
from storage.limits import REASONS
from storage.rows import LATENCIES, PERCENTILES

DEFAULT_PORT = 9464  # the port prometheus_client's own exporters use by convention
CACHE_S = 0.5  # a rendering serves the scrapes of this long
RENDER_TIMEOUT_S = 5.0  # a scrape waits this long for the collector's loop, then gets 503


def _label(value: str) -> str:
    """A label value the text format can carry (a lone surrogate from a client would fail the
    page)."""
    try:
        value.encode("utf-8")
        return value
    except UnicodeEncodeError:
        return value.encode("utf-8", "replace").decode("utf-8")


class _Families:
    """The families of one scrape, filled by name; samples without a value are left out."""

    def __init__(self) -> None:
        self.families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {
            s.name: (CounterMetricFamily if s.counter else GaugeMetricFamily)(
                s.name, s.doc, labels=list(s.labels)
            )
            for s in SERIES.values()
        }

    def add(self, name: str, labels: tuple[str, ...], value: Any) -> None:
        v = finite_or_none(value)
        if v is not None:
            self.families[name].add_metric([_label(x) for x in labels], v)

    def __iter__(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        return (f for f in self.families.values() if f.samples)


class CompletionCounters:
    """Per replica and tenant the completed requests and their prompt and output tokens, and per
    replica and type the requests, that a collector read since this was attached (its
    ``on_poll``): the page's counters. A request refused on arrival was never served and is not
    counted (``tailpilot_refused_requests_total`` counts it). Names past ``max_names`` per kind
    (the cluster file's always kept apart) are counted under "other" from then on, so a label
    set, once shown, only grows."""

    def __init__(self, collector: Collector, max_names: int = MAX_GROUPS_PER_WINDOW) -> None:
        spec = collector.cluster.governance
        self._reserved = {
            "tenant": frozenset(spec.tenants if spec is not None else ()),
            "type": frozenset(spec.type_shares if spec is not None else ()),
        }
        self._max = max_names
        self._names: dict[str, set[str]] = {"tenant": set(), "type": set()}
        self.tenants: dict[
            tuple[str, str], list[int]
        ] = {}  # (replica, tenant) -> [requests, prompt, output]
        self.types: dict[tuple[str, str], int] = {}  # (replica, type) -> requests
        # replica -> whether its last poll read its /state (its own counters are then current,
        # even when its /metrics failed and it counts as down)
        self.state_read: dict[str, bool] = {}
        collector.on_poll(self.observe)

    def _name(self, kind: str, name: str) -> str:
        names = self._names[kind]
        group = fold_name(name, names, self._reserved[kind], self._max)
        names.add(group)
        return group

    def observe(self, replica: str, result: PollResult) -> None:
        """Count one poll's new completions (``collector.on_poll``'s listener)."""
        self.state_read[replica] = result.cursor is not None
        for row in result.completions:
            if row.reason == "rejected":
                continue
            counts = self.tenants.setdefault((replica, self._name("tenant", row.tenant)), [0, 0, 0])
            counts[0] += 1
            counts[1] += int(row.prompt_tokens)
            counts[2] += int(row.output_tokens)
            key = (replica, self._name("type", row.type))
            self.types[key] = self.types.get(key, 0) + 1


_COUNTERS: weakref.WeakKeyDictionary[Any, CompletionCounters] = weakref.WeakKeyDictionary()


def completion_counters(collector: Collector) -> CompletionCounters:
    """The collector's :class:`CompletionCounters`, attached on the first call (they count the
    completions read from then on: the recorder attaches them before its first poll)."""
    counters = _COUNTERS.get(collector)
    if counters is None:
        counters = _COUNTERS[collector] = CompletionCounters(collector)
    return counters


class ClusterMetrics:
    """A prometheus_client collector over a :class:`controlplane.collector.Collector`."""

    def __init__(self, collector: Collector) -> None:
        self.collector = collector
        self.counters = completion_counters(collector)

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        c = self.collector
        cluster = c.cluster.name
        out = _Families()
        out.add("tailpilot_window_seconds", (cluster,), c.cluster.window_s)
        shown, omitted = labelled_tenants(c)
        out.add("tailpilot_tenants_omitted", (cluster,), omitted)
        types, types_omitted = labelled_groups(c, "type", MAX_GROUPS_PER_WINDOW)
        out.add("tailpilot_types_omitted", (cluster,), types_omitted)
        for name, view in c.views.items():
            self._replica(out, cluster, name, view, shown, types)
            # Whether its last poll read its /state: the listener knows; before it was attached,
            # the sample says (only a /state answer gives it a policy)
            read = self.counters.state_read.get(
                name, view.sample is not None and view.sample.policy is not None
            )
            self._replica_counters(out, cluster, name, view, read)
        self._completions(out, cluster)
        up = sum(1 for v in c.views.values() if v.health.healthy)
        # A down replica's window is its last answer's: still in the figures, no longer refreshed.
        stale = sum(1 for v in c.views.values() if not v.health.healthy and len(v.window))
        if c.governance is not None and up:  # with no replica up, no figure is current
            self._governance(out, cluster, c.governance, c.cluster.governance, shown, types, stale)
        elif c.governance is not None:
            self._alert_states(out, cluster, c.governance, c.cluster.governance)
        status = getattr(c, "governor_status", None)
        if status is not None:
            self._governor(out, cluster, status)
        return iter(out)

    def _completions(self, out: _Families, cluster: str) -> None:
        for (replica, tenant), (requests, prompt, output) in sorted(self.counters.tenants.items()):
            key = (cluster, replica, tenant)
            out.add("tailpilot_requests_completed", key, requests)
            out.add("tailpilot_prompt_tokens", key, prompt)
            out.add("tailpilot_output_tokens", key, output)
        for (replica, kind), requests in sorted(self.counters.types.items()):
            out.add("tailpilot_type_requests_completed", (cluster, replica, kind), requests)

    @staticmethod
    def _replica(
        out: _Families,
        cluster: str,
        name: str,
        view: ReplicaView,
        shown: set[str],
        types: set[str],
    ) -> None:
        key = (cluster, name)
        out.add("tailpilot_replica_up", key, 1.0 if view.health.healthy else 0.0)
        for reason in REASONS:  # the recorder's own count: true whether the replica answers or not
            out.add("tailpilot_ingest_rejected", (*key, reason), view.rejected.get(reason, 0))
        row = view.sample
        if row is None or not row.healthy or not view.health.healthy:
            return  # its last answer is not now: nothing of it on the page (replica_up says so)
        if row.policy:
            out.add("tailpilot_replica_info", (*key, row.policy, view.health.mode), 1.0)
        for series, value in (
            ("tailpilot_settings_version", row.settings_version),
            ("tailpilot_gamma", row.gamma_live),
            ("tailpilot_beta", row.beta_live),
            ("tailpilot_waiting_requests", row.waiting),
            ("tailpilot_running_requests", row.running),
            ("tailpilot_kv_usage_ratio", row.kv_usage),
        ):
            out.add(series, key, value)
        for lat in LATENCIES:
            for q in PERCENTILES:
                out.add(
                    "tailpilot_latency_seconds",
                    (*key, lat, f"p{q}"),
                    getattr(row.latency, f"{lat}_p{q}"),
                )
        for g in view.groups:
            if g.group not in (shown if g.kind == "tenant" else types):
                continue
            out.add("tailpilot_group_requests", (*key, g.kind, g.group), g.completed)
            for lat in LATENCIES:
                for q in PERCENTILES:
                    out.add(
                        "tailpilot_group_latency_seconds",
                        (*key, g.kind, g.group, lat, f"p{q}"),
                        getattr(g.latency, f"{lat}_p{q}"),
                    )

    @staticmethod
    def _replica_counters(
        out: _Families, cluster: str, name: str, view: ReplicaView, state_read: bool
    ) -> None:
        """The replica's own counters since it started: from the /state its last poll read (the
        plugin's), else from vLLM's /metrics while it answers; none from an older answer."""
        key = (cluster, name)
        state = view.state
        if view.health.mode == "plugin":
            if not state_read or state is None:
                return
            preemptions = state.preemptions_total
            out.add(
                "tailpilot_preemptions",
                key,
                preemptions if preemptions is not None else view.metrics.get("preemptions_total"),
            )
            out.add("tailpilot_refused_requests", key, state.refused_total)
            if state.breaker is not None:
                out.add("tailpilot_breaker_trips", key, state.breaker.trips_total)
        elif view.health.healthy:
            out.add("tailpilot_preemptions", key, view.metrics.get("preemptions_total"))

    @classmethod
    def _governance(
        cls,
        out: _Families,
        cluster: str,
        g: GovernanceReport,
        spec: GovernanceSpec | None,
        shown: set[str],
        types: set[str],
        stale: int,
    ) -> None:
        key = (cluster,)
        if g.get("t_ms") is not None:
            out.add("tailpilot_governance_timestamp_seconds", key, g["t_ms"] / 1000.0)
        out.add("tailpilot_governance_stale_replicas", key, stale)
        out.add("tailpilot_governance_requests", key, g.get("requests"))
        out.add("tailpilot_scr_ratio", key, g.get("scr"))
        out.add("tailpilot_jfi_ratio", key, g.get("jfi"))
        out.add("tailpilot_jfi_seed_ratio", key, g.get("jfi_seed"))
        out.add("tailpilot_type_fairness_min_ratio", key, g.get("type_fairness_min"))
        for tenant, f in sorted(g.get("tenants", {}).items()):
            if tenant not in shown:
                continue
            t = (cluster, tenant)
            for lat in ("ttft", "ttlt"):
                for q in QUANTILES:
                    out.add("tailpilot_tenant_latency_seconds", (*t, lat, q), f.get(f"{lat}_{q}"))
            for metric, limit in sorted(f.get("limits", {}).items()):
                lat, q = metric.split("_", 1)
                out.add("tailpilot_tenant_slo_seconds", (*t, lat, q), limit)
            out.add("tailpilot_tenant_slo_compliant", t, 1.0 if f.get("compliant") else 0.0)
            for series, k in (
                ("tailpilot_tenant_requests", "requests"),
                ("tailpilot_tenant_waiting_requests", "waiting"),
                ("tailpilot_tenant_waited_seconds", "waited_s"),
                ("tailpilot_tenant_window_served_tokens", "served_tokens"),
                ("tailpilot_tenant_window_demand_tokens", "demand_tokens"),
                ("tailpilot_tenant_window_entitled_tokens", "entitled_tokens"),
                ("tailpilot_tenant_service_ratio", "service_ratio"),
                ("tailpilot_tenant_committed_tokens_per_second", "committed_tok_s"),
                ("tailpilot_tenant_normalised_throughput_ratio", "normalised"),
                ("tailpilot_tenant_omega_ratio", "omega"),
            ):
                out.add(series, t, f.get(k))
            if "starved" in f:
                out.add("tailpilot_tenant_starved", t, 1.0 if f["starved"] else 0.0)
        for kind, kf in sorted(g.get("types", {}).items()):
            if kind not in types:
                continue
            t = (cluster, kind)
            out.add("tailpilot_type_share_ratio", t, kf.get("share"))
            out.add("tailpilot_type_minimum_share_ratio", t, kf.get("minimum"))
            out.add("tailpilot_type_fairness_ratio", t, kf.get("ratio"))
        for alert, value in sorted((g.get("alert_values") or {}).items()):
            out.add("tailpilot_alert_value", (cluster, alert), value)
        cls._alert_states(out, cluster, g, spec)

    @staticmethod
    def _alert_states(
        out: _Families, cluster: str, g: GovernanceReport, spec: GovernanceSpec | None
    ) -> None:
        """The collector's alerts (its state, not a figure: shown whether or not a replica is
        up)."""
        firing, pending = g.get("alerts") or {}, g.get("alerts_pending") or {}
        thresholds = spec.alerts if spec is not None else None
        for alert, severities in ALERT_SEVERITIES.items():
            for severity in severities:
                key = (cluster, alert, severity)
                out.add(
                    "tailpilot_alert_firing", key, 1.0 if firing.get(alert) == severity else 0.0
                )
                out.add(
                    "tailpilot_alert_pending", key, 1.0 if pending.get(alert) == severity else 0.0
                )
                if thresholds is not None:
                    out.add("tailpilot_alert_threshold", key, thresholds.threshold(alert, severity))

    @staticmethod
    def _governor(out: _Families, cluster: str, status: dict[str, Any]) -> None:
        for state in CONTROL_STATES:
            out.add(
                "tailpilot_governor_state",
                (cluster, state),
                1.0 if status.get("state") == state else 0.0,
            )
        out.add("tailpilot_governor_paused", (cluster,), 1.0 if status.get("paused") else 0.0)
        applied, dry = modes(
            status
        )  # a mode decided in dry-run was never applied: dry-run, not active
        for mode in MODES:
            out.add(
                "tailpilot_governor_mode_active",
                (cluster, mode.name),
                1.0 if mode.name in applied else 0.0,
            )
            out.add(
                "tailpilot_governor_mode_dry_run",
                (cluster, mode.name),
                1.0 if mode.name in dry else 0.0,
            )


def labelled_tenants(
    collector: Collector, limit: int = MAX_GROUPS_PER_WINDOW
) -> tuple[set[str], int]:
    """(the tenants the page labels, how many it leaves off): the cluster file's tenants, then the
    most requests in the window (ties by name), ``limit`` in all."""
    return labelled_groups(collector, "tenant", limit)


def labelled_groups(collector: Collector, kind: str, limit: int) -> tuple[set[str], int]:
    """(the tenants or request types (``kind``) the page labels, how many it leaves off): those
    the cluster file names, then the most requests in the window (ties by name), ``limit`` in
    all."""
    counts: dict[str, float] = {}
    for view in collector.views.values():
        for g in view.groups:
            if g.kind == kind:
                counts[g.group] = counts.get(g.group, 0.0) + g.completed
    report = collector.governance  # the window's groups too
    if report is not None and kind == "tenant":
        for group, f in report["tenants"].items():
            counts.setdefault(group, float(f.get("requests") or 0))
    elif report is not None and kind == "type":  # a type's figures count no requests
        for group in report["types"]:
            counts.setdefault(group, 0.0)
    spec = collector.cluster.governance
    listed = (spec.tenants if kind == "tenant" else spec.type_shares) if spec is not None else {}
    named = [t for t in listed if t in counts]
    rest = sorted((t for t in counts if t not in set(named)), key=lambda t: (-counts[t], t))
    shown = (named + rest)[:limit]
    return set(shown), len(counts) - len(shown)


def render(collector: Collector) -> bytes:
    """The Prometheus text page of ``collector`` now."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ClusterMetrics(collector))
    return generate_latest(registry)


class _Page:
    """The control server's target: ``/metrics`` rendered on the collector's loop (cached), and
    ``/health``; the control endpoints do not exist here."""

    def __init__(self, collector: Collector, loop: asyncio.AbstractEventLoop) -> None:
        self.collector, self.loop = collector, loop
        self._lock = threading.Lock()  # one rendering at a time; the others wait for its result
        self._page: tuple[float, bytes] | None = None

    def api_metrics(self) -> tuple[bytes, str]:
        with self._lock:
            if self._page is None or time.monotonic() - self._page[0] > CACHE_S:
                future = asyncio.run_coroutine_threadsafe(self._render(), self.loop)
                try:
                    self._page = (time.monotonic(), future.result(RENDER_TIMEOUT_S))
                except Exception as err:  # a stalled or stopping loop: say so, do not hang
                    future.cancel()
                    raise HTTPError(
                        503,
                        f"the recorder could not render its page: {type(err).__name__}",
                        headers={"Retry-After": "1"},
                    ) from None
            return self._page[1], CONTENT_TYPE_LATEST

    async def _render(self) -> bytes:
        return render(self.collector)

    def api_health(self) -> bool:
        return True

    def _absent(self, *args: Any) -> dict[str, Any]:
        raise HTTPError(404, "this is tailpilot's recorder: only /metrics and /health")

    api_state = api_settings = api_put_settings = api_steps = _absent


class MetricsServer:
    """``GET /metrics`` of a collector on the control API's bounded server (a daemon thread)."""

    def __init__(
        self, collector: Collector, *, host: str = "127.0.0.1", port: int = DEFAULT_PORT
    ) -> None:
        self.collector = collector
        self.host, self.port = host, port
        self._server: Any = None
        completion_counters(collector)  # counting from the first poll on, before the first scrape

    async def start(self) -> int:
        """Listen (OSError when the address is taken); returns the port (the one picked for 0)."""
        # Prometheus never sends the page's (random) token: nothing is kept back for token holders.
        limits = Limits(
            max_connections=16, rate_per_connection=5.0, rate_total=50.0, token_reserve=0.0
        )
        # A random token: nothing here takes writes, and the server would warn without one.
        self._server = ControlServer(
            _Page(self.collector, asyncio.get_running_loop()),
            host=self.host,
            port=self.port,
            token=secrets.token_hex(16),
            limits=limits,
        ).start()
        self.port = self._server.port
        return self.port

    async def stop(self) -> None:
        if self._server is not None:
            await asyncio.to_thread(self._server.stop)
            self._server = None

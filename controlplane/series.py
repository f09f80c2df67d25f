"""The recorder's Prometheus series: every ``tailpilot_*`` family the page serves, with its labels
and help text (:data:`SERIES`; docs/metrics.md lists them), which are counters, the renames of
this version (:data:`RENAMED`) and the alert severities the alert series are labelled with.

The page (:mod:`controlplane.exporter`) fills these families; ``tailpilot export
prometheus-rules`` and ``grafana`` (:mod:`controlplane.monitoring`) build their queries from
them, and the tests check both against a real scrape. Kept apart from the page so that the
exports read the names without loading the page's server.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.names import MAX_GROUPS_PER_WINDOW


@dataclass(frozen=True, slots=True)
class Series:
    """One family of the page: its name (a counter's without ``_total``: its samples carry it),
    labels and help text."""

    name: str
    labels: tuple[str, ...]
    doc: str
    counter: bool = False  # a count (exposed as NAME_total, for rate()), else a gauge

    @property
    def sample(self) -> str:
        """The name its samples have on the page."""
        return f"{self.name}_total" if self.counter else self.name


COUNTERS = {
    "tailpilot_refused_requests",
    "tailpilot_breaker_trips",
    "tailpilot_ingest_rejected",
    "tailpilot_preemptions",
    "tailpilot_requests_completed",
    "tailpilot_prompt_tokens",
    "tailpilot_output_tokens",
    "tailpilot_type_requests_completed",
}


def _series(*rows: tuple[str, str, str]) -> dict[str, Series]:
    return {
        name: Series(name, tuple(labels.split()) if labels else (), doc, name in COUNTERS)
        for name, labels, doc in rows
    }


R = "cluster replica"
SERIES: dict[str, Series] = _series(
    # per replica: the collector's latest poll, only while the replica answers it
    (
        "tailpilot_replica_up",
        R,
        "1 when the replica answered its last poll, else 0 (its other figures are then left out).",
    ),
    (
        "tailpilot_replica_info",
        f"{R} policy mode",
        "1, labelled with the replica's policy and mode (plugin | metrics-only).",
    ),
    ("tailpilot_settings_version", R, "Version of the replica's active settings document."),
    ("tailpilot_gamma", R, "Live γ of the replica's policy (its adaptive value where it adapts)."),
    ("tailpilot_beta", R, "Live β of the replica's policy."),
    ("tailpilot_waiting_requests", R, "Requests waiting in the replica's queue."),
    ("tailpilot_running_requests", R, "Requests in the replica's running batch."),
    ("tailpilot_kv_usage_ratio", R, "Fraction of the replica's KV cache in use (0..1)."),
    ("tailpilot_preemptions", R, "Preemptions since the replica started (its own count)."),
    (
        "tailpilot_refused_requests",
        R,
        "Requests the replica turned away on arrival (a tenant's queue cap), since it started.",
    ),
    (
        "tailpilot_breaker_trips",
        R,
        "Times a policy raised inside the replica's engine step and its circuit breaker fell back,"
        " since it started.",
    ),
    (
        "tailpilot_latency_seconds",
        f"{R} latency percentile",
        "Exact percentile (p50 | p90 | p95 | p99) of the window's completed requests"
        " (latency: ttft | ttlt | tbt).",
    ),
    (
        "tailpilot_group_latency_seconds",
        f"{R} kind group latency percentile",
        "Exact percentile per tenant or request type (kind) of the replica's window.",
    ),
    (
        "tailpilot_group_requests",
        f"{R} kind group",
        "Requests completed in the window per tenant or type.",
    ),
    # per replica: the recorder's own counts, kept while the replica is down (they do not change
    # then)
    (
        "tailpilot_ingest_rejected",
        f"{R} reason",
        "Values from the replica the recorder could not store as sent (an entry skipped or a field"
        " nulled), by reason.",
    ),
    (
        "tailpilot_requests_completed",
        f"{R} tenant",
        "Completed requests the recorder read from the replica since the recorder started"
        " (refusals not counted).",
    ),
    ("tailpilot_prompt_tokens", f"{R} tenant", "Prompt tokens of those completed requests."),
    ("tailpilot_output_tokens", f"{R} tenant", "Output tokens of those completed requests."),
    (
        "tailpilot_type_requests_completed",
        f"{R} type",
        "Those completed requests per request type.",
    ),
    # the cluster
    (
        "tailpilot_window_seconds",
        "cluster",
        "Length of the rolling window every windowed figure covers.",
    ),
    (
        "tailpilot_tenants_omitted",
        "cluster",
        f"Tenants left off this page (at most {MAX_GROUPS_PER_WINDOW} are labelled).",
    ),
    (
        "tailpilot_types_omitted",
        "cluster",
        f"Request types left off this page (at most {MAX_GROUPS_PER_WINDOW} are labelled).",
    ),
    # governance (over every replica's window together; docs/governance.md)
    (
        "tailpilot_governance_timestamp_seconds",
        "cluster",
        "When the governance figures were computed (Unix time).",
    ),
    (
        "tailpilot_governance_stale_replicas",
        "cluster",
        "Replicas down whose last window still counts in the governance figures, unrefreshed"
        " (0: all current).",
    ),
    (
        "tailpilot_governance_requests",
        "cluster",
        "Requests the governance figures were computed from.",
    ),
    (
        "tailpilot_scr_ratio",
        "cluster",
        "SLO compliance ratio: the fraction of tenants meeting every quantile target.",
    ),
    (
        "tailpilot_jfi_ratio",
        "cluster",
        "Jain's index over each tenant's service per demand-capped entitlement (what alerts and"
        " the governor act on).",
    ),
    (
        "tailpilot_jfi_seed_ratio",
        "cluster",
        "Seed 003's literal JFI, over served rate per committed rate (reported only).",
    ),
    (
        "tailpilot_type_fairness_min_ratio",
        "cluster",
        "The lowest request type's share over its guaranteed share.",
    ),
    (
        "tailpilot_tenant_latency_seconds",
        "cluster tenant latency percentile",
        "Exact percentile (p50 | p90 | p99) of the tenant's requests across the cluster"
        " (latency: ttft | ttlt).",
    ),
    (
        "tailpilot_tenant_slo_seconds",
        "cluster tenant latency percentile",
        "The tenant's target for that percentile.",
    ),
    (
        "tailpilot_tenant_slo_compliant",
        "cluster tenant",
        "1 when the tenant meets every target it has, else 0.",
    ),
    (
        "tailpilot_tenant_requests",
        "cluster tenant",
        "The tenant's requests completed in the window.",
    ),
    (
        "tailpilot_tenant_waiting_requests",
        "cluster tenant",
        "The tenant's requests waiting on the replicas that answer.",
    ),
    (
        "tailpilot_tenant_waited_seconds",
        "cluster tenant",
        "How long the tenant has had requests waiting without its queue shrinking (a lower bound"
        " of its oldest wait).",
    ),
    (
        "tailpilot_tenant_starved",
        "cluster tenant",
        "1 when the tenant has requests waiting and none completed in the window.",
    ),
    (
        "tailpilot_tenant_window_served_tokens",
        "cluster tenant",
        "Tokens (prompt + output) served to the tenant in the window.",
    ),
    (
        "tailpilot_tenant_window_demand_tokens",
        "cluster tenant",
        "Tokens the tenant asked for in the window (served + waiting).",
    ),
    (
        "tailpilot_tenant_window_entitled_tokens",
        "cluster tenant",
        "The tenant's share of the window's served tokens by weight, capped by its demand.",
    ),
    (
        "tailpilot_tenant_service_ratio",
        "cluster tenant",
        "min(1, served / entitled): the tenant's x in the JFI.",
    ),
    (
        "tailpilot_tenant_committed_tokens_per_second",
        "cluster tenant",
        "The tenant's committed rate (commit_tok_s; for a weight, its share of the served rate).",
    ),
    (
        "tailpilot_tenant_normalised_throughput_ratio",
        "cluster tenant",
        "Served rate over committed rate: the tenant's x in the seed's JFI.",
    ),
    (
        "tailpilot_tenant_omega_ratio",
        "cluster tenant",
        "ω = min(committed / served, α); below 1: an over-consumer.",
    ),
    (
        "tailpilot_type_share_ratio",
        "cluster type",
        "The type's share of the window's completed requests.",
    ),
    ("tailpilot_type_minimum_share_ratio", "cluster type", "The type's minimum share ρ_k."),
    (
        "tailpilot_type_fairness_ratio",
        "cluster type",
        "The type's share over its guaranteed share.",
    ),
    (
        "tailpilot_alert_firing",
        "cluster alert severity",
        "1 while the alert fires at this severity, else 0.",
    ),
    (
        "tailpilot_alert_pending",
        "cluster alert severity",
        "1 while the alert's condition holds at this severity but not yet for alerts.for_s,"
        " else 0.",
    ),
    (
        "tailpilot_alert_value",
        "cluster alert",
        "The figure the alert was last judged on (kept through windows without data, as the alert"
        " is).",
    ),
    (
        "tailpilot_alert_threshold",
        "cluster alert severity",
        "The figure below which the alert fires at this severity.",
    ),
    # the governor (when it runs in this recorder)
    (
        "tailpilot_governor_state",
        "cluster state",
        "1 for the governor's state (armed | dry-run | disarmed), else 0.",
    ),
    ("tailpilot_governor_paused", "cluster", "1 while an operator has paused the governor."),
    (
        "tailpilot_governor_mode_active",
        "cluster mode",
        "1 while the emergency mode (scr | jfi | type) is applied.",
    ),
    (
        "tailpilot_governor_mode_dry_run",
        "cluster mode",
        "1 while the mode is only logged (decided in dry-run, not applied).",
    ),
)
# The previous version's names (a sample's name, as on the page) -> this version's (None: gone,
# with what replaces it in docs/metrics.md). Dashboards and rules written against them need these.
RENAMED: dict[str, str | None] = {
    "tailpilot_scr": "tailpilot_scr_ratio",
    "tailpilot_jfi": "tailpilot_jfi_ratio",
    "tailpilot_type_fairness": "tailpilot_type_fairness_min_ratio",
    "tailpilot_type_share": "tailpilot_type_share_ratio",
    "tailpilot_type_minimum_share": "tailpilot_type_minimum_share_ratio",
    "tailpilot_tenant_normalised_throughput": "tailpilot_tenant_normalised_throughput_ratio",
    "tailpilot_preemptions_per_second": "tailpilot_preemptions_total",
    "tailpilot_throughput_tokens_per_second": "tailpilot_output_tokens_total",
    "tailpilot_tenant_throughput_tokens_per_second": None,
}
ALERT_SEVERITIES = {
    "scr": ("warning", "critical"),
    "jfi": ("warning",),
    "type_fairness": ("warning",),
}

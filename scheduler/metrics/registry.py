"""The metric table: every metric name a summary, the tuner or a cluster file's SLOs may use,
with its description, unit and direction (:data:`METRICS`, the one place names are defined),
the aliases accepted for some, and the helpers that validate a name and compare two values.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Literal, NamedTuple

from scheduler.errors import TailpilotError

#: (key suffix, percentile) pairs reported for every latency family.
PERCENTILES: tuple[tuple[str, float], ...] = (
    ("p50", 50.0),
    ("p90", 90.0),
    ("p95", 95.0),
    ("p99", 99.0),
    ("p999", 99.9),
)
STAT_SUFFIXES: tuple[str, ...] = (*(s for s, _ in PERCENTILES), "mean")

#: Latency families: key prefix -> (description, unit).
_LATENCY_INFO: dict[str, tuple[str, str]] = {
    "ttft": ("time to first token (first token - arrival)", "s"),
    "ttlt": ("time to last token, end-to-end latency (finish - arrival)", "s"),
    "tbt": (
        "time between tokens: mean inter-token gap after the first token "
        "(single-token requests excluded)",
        "s",
    ),
    "ptl": ("per-token latency: TTLT / output tokens", "s/token"),
    "queue": ("queue time: first admission - arrival", "s"),
}
LATENCY_BASES: tuple[str, ...] = tuple(_LATENCY_INFO)

_STAT_WORDS = {
    "p50": "P50 (median)",
    "p90": "P90",
    "p95": "P95",
    "p99": "P99",
    "p999": "P99.9",
    "mean": "mean",
}


class MetricInfo(NamedTuple):
    description: str
    unit: str
    higher_is_better: bool


def _build_metrics() -> dict[str, MetricInfo]:
    table: dict[str, MetricInfo] = {}
    for base, (desc, unit) in _LATENCY_INFO.items():
        for suffix in STAT_SUFFIXES:
            table[f"{base}_{suffix}"] = MetricInfo(f"{_STAT_WORDS[suffix]} {desc}", unit, False)
        # Only present in a summary when summarize() is given an SLO for this family.
        table[f"{base}_slo_attainment"] = MetricInfo(
            f"fraction of requests whose {base.upper()} meets its SLO", "fraction", True
        )
        table[f"{base}_slo_scale_99"] = MetricInfo(
            f"smallest k such that 99% of requests meet k x the {base.upper()} SLO "
            "(how much tighter an SLO the policy holds at 99%)",
            "x",
            False,
        )
    table.update(
        {
            "ttft_p99_p50": MetricInfo("TTFT P99 / P50 ratio (tail spread)", "ratio", False),
            "ttlt_p99_p50": MetricInfo("TTLT P99 / P50 ratio (tail spread)", "ratio", False),
            "throughput_tok_s": MetricInfo(
                "output tokens per second over the window", "tok/s", True
            ),
            "throughput_req_s": MetricInfo(
                "completed requests per second over the window", "req/s", True
            ),
            "requests": MetricInfo("completed requests", "count", True),
            "output_tokens": MetricInfo("output tokens generated", "tokens", True),
            "prompt_tokens": MetricInfo("prompt tokens of completed requests", "tokens", True),
            "preemptions": MetricInfo("preemptions, all causes", "count", False),
            "recomputed_tokens": MetricInfo(
                "tokens prefilled again after preemption", "tokens", False
            ),
            "duration_s": MetricInfo("window length used for throughput", "s", False),
            # Fairness (fairness_summary and the functions below).
            "slo_compliance_ratio": MetricInfo(
                "SCR: fraction of tenants meeting every one of their SLOs", "fraction", True
            ),
            "jain_index": MetricInfo(
                "JFI: Jain's index over tenants' service / entitlement capped by demand "
                "(docs/governance.md)",
                "index",
                True,
            ),
            "jain_index_seed": MetricInfo(
                "seed 003's literal JFI over tenants' throughput / commitment "
                "(reported, not acted on)",
                "index",
                True,
            ),
            "type_share_ratio_min": MetricInfo(
                "smallest (actual share / guaranteed share) over request types", "ratio", True
            ),
            # Reported by the live collector, not computed from completions.
            "kv_usage": MetricInfo(
                "fraction of KV-cache blocks in use (informational)", "fraction", False
            ),
        }
    )
    return table


#: name -> (description, unit, higher_is_better). The one place metric names are defined.
METRICS: dict[str, MetricInfo] = _build_metrics()

#: Short names accepted wherever a metric name is (docs/engine.md#tuner uses some of them).
METRIC_ALIASES: dict[str, str] = {
    "throughput": "throughput_tok_s",
    "slo_scale_99": "ttlt_slo_scale_99",
    "scr": "slo_compliance_ratio",
    "jfi": "jain_index",
}


class UnknownMetricError(TailpilotError, KeyError, ValueError):
    """An unknown metric name. Is both a KeyError and a ValueError so either catch works."""

    def __str__(self) -> str:  # KeyError would repr() the message; show it plainly.
        return str(self.args[0]) if self.args else ""


def validate_metric(name: str) -> str:
    """Canonical name for ``name`` (aliases resolved); UnknownMetricError listing valid names."""
    if name in METRICS:
        return name
    if name in METRIC_ALIASES:
        return METRIC_ALIASES[name]
    valid = ", ".join(sorted(METRICS) + sorted(METRIC_ALIASES))
    raise UnknownMetricError(f"unknown metric {name!r}; valid names: {valid}")


def higher_is_better(name: str) -> bool:
    return METRICS[validate_metric(name)].higher_is_better


def metric_direction(name: str) -> Literal["maximize", "minimize"]:
    """``"maximize"`` or ``"minimize"`` (Optuna's spelling) for a metric name."""
    return "maximize" if higher_is_better(name) else "minimize"


def metric_value(summary: Mapping[str, float], name: str) -> float:
    """Look a (possibly aliased) metric up in a summary dict, with a helpful error."""
    canonical = validate_metric(name)
    try:
        return summary[canonical]
    except KeyError:
        hint = ""
        if canonical.endswith(("_slo_attainment", "_slo_scale_99")):
            base = canonical.split("_slo_")[0]
            hint = f" (pass slo={{{base!r}: <seconds>}} to summarize)"
        raise KeyError(f"metric {canonical!r} is not in this summary{hint}") from None


def percent_change(value: float, baseline: float, name: str) -> float:
    """Relative change of ``value`` against ``baseline`` in percent, **positive = better**.

    Lower-is-better metrics: (baseline − value) / baseline × 100; higher-is-better metrics:
    (value − baseline) / baseline × 100 (Table 2's convention in seed 000). Dividing by
    |baseline| keeps "positive = better" even for a negative baseline. NaN when undefined.
    """
    better_high = higher_is_better(name)
    if not (math.isfinite(value) and math.isfinite(baseline)):
        return math.nan
    if value == baseline:
        return 0.0
    if baseline == 0:
        return math.nan
    delta = (value - baseline) if better_high else (baseline - value)
    return delta / abs(baseline) * 100.0

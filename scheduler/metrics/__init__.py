"""Request-level metrics (docs/engine.md#metrics): the one package used by the simulator, the
collector, the TUI and the tuner.

Units
-----
* Every time and every latency is in **seconds** (simulated or wall clock; one clock per run).
* ``ptl`` (per-token latency) is seconds per output token.
* Throughput is output tokens per second (``throughput_tok_s``) and requests per second
  (``throughput_req_s``).
* Counts (``requests``, ``output_tokens``, ``preemptions`` ...) are plain numbers, returned as
  floats so that a summary is a uniform ``dict[str, float]``.

Per request (see :class:`Completion`)
-------------------------------------
* TTFT  = first_token_at − arrival
* TTLT  = finished_at − arrival                    (end-to-end latency)
* TBT   = (finished_at − first_token_at) / (output_tokens − 1)
          the mean inter-token gap after the first token; undefined for a single-token request
* PTL   = TTLT / output_tokens                     (undefined for zero output tokens)
* queue = scheduled_at − arrival                   (time until first admission)

An undefined per-request value is NaN and is left out of that metric's statistics only.

Summaries are vectorised over a columnar :class:`CompletionArrays` (built once by
:func:`to_arrays`): summarising 20k completions costs a couple of milliseconds, most of it
in five ``np.partition`` calls (one per latency family); there is no per-request Python loop.

Percentiles use numpy's default (``linear``) method and are exact: no histogram buckets.

Modules
-------
* ``completions`` — :class:`Completion`, :class:`CompletionArrays`, :func:`to_arrays`;
* ``registry`` — the metric table (:data:`METRICS`), name validation, directions,
  ``percent_change``;
* ``summary`` — :func:`distribution_stats`, :func:`summarize`, :func:`summarize_by`;
* ``slo`` — SLO attainment curves and the tightest SLO scale met;
* ``fairness_measures`` — Jain's index, normalised throughput, SLO compliance, shares;
* ``fairness`` — seed 003's figures (SCR, the suppression-aware JFI beside the seed's literal
  one, type fairness, ω): their one implementation, ``fairness.report`` (docs/governance.md),
  which :func:`fairness_summary` calls;
* ``windowed`` — :class:`WindowedPercentiles` (the live collector's and γ-Ada's).
"""

from scheduler.metrics.completions import Completion, CompletionArrays, to_arrays
from scheduler.metrics.fairness import fairness_summary
from scheduler.metrics.fairness_measures import (
    jain_index,
    normalised_throughput,
    shares,
    slo_compliance,
    slo_compliance_ratio,
    tenant_jain_index,
    type_share_ratio,
)
from scheduler.metrics.registry import (
    LATENCY_BASES,
    METRIC_ALIASES,
    METRICS,
    PERCENTILES,
    STAT_SUFFIXES,
    MetricInfo,
    UnknownMetricError,
    higher_is_better,
    metric_direction,
    metric_value,
    percent_change,
    validate_metric,
)
from scheduler.metrics.slo import DEFAULT_SLO_SCALES, slo_attainment, tightest_slo_scale
from scheduler.metrics.summary import distribution_stats, latency_columns, summarize, summarize_by
from scheduler.metrics.windowed import WindowedPercentiles

__all__ = [
    "DEFAULT_SLO_SCALES",
    "LATENCY_BASES",
    "METRICS",
    "METRIC_ALIASES",
    "PERCENTILES",
    "STAT_SUFFIXES",
    "Completion",
    "CompletionArrays",
    "MetricInfo",
    "UnknownMetricError",
    "WindowedPercentiles",
    "distribution_stats",
    "fairness_summary",
    "higher_is_better",
    "jain_index",
    "latency_columns",
    "metric_direction",
    "metric_value",
    "normalised_throughput",
    "percent_change",
    "shares",
    "slo_attainment",
    "slo_compliance",
    "slo_compliance_ratio",
    "summarize",
    "summarize_by",
    "tenant_jain_index",
    "tightest_slo_scale",
    "to_arrays",
    "type_share_ratio",
    "validate_metric",
]

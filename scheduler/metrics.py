"""Request-level metrics (docs/engine.md#metrics): the one module used by the simulator, the collector,
the TUI and the tuner.

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

Fairness: ``jain_index`` and the helpers below are the primitives; seed 003's figures (SCR, the
suppression-aware JFI beside the seed's literal one, type fairness, ω) have one implementation,
``controlplane.governance.report`` (docs/governance.md), which :func:`fairness_summary` calls.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, Iterable, Literal, Mapping, NamedTuple, Sequence, Union

import numpy as np

__all__ = [
    "Completion",
    "CompletionArrays",
    "to_arrays",
    "PERCENTILES",
    "LATENCY_BASES",
    "STAT_SUFFIXES",
    "DEFAULT_SLO_SCALES",
    "MetricInfo",
    "METRICS",
    "METRIC_ALIASES",
    "UnknownMetricError",
    "validate_metric",
    "metric_direction",
    "higher_is_better",
    "metric_value",
    "percent_change",
    "distribution_stats",
    "latency_columns",
    "summarize",
    "summarize_by",
    "slo_attainment",
    "tightest_slo_scale",
    "jain_index",
    "normalised_throughput",
    "tenant_jain_index",
    "slo_compliance",
    "slo_compliance_ratio",
    "shares",
    "type_share_ratio",
    "fairness_summary",
    "WindowedPercentiles",
]

NAN = float("nan")


# --------------------------------------------------------------------------------------
# Per-request record
# --------------------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class Completion:
    """One finished request. Times in seconds on the run's clock; token counts are ints.

    ``scheduled_at`` is the *first* admission (a preempted request is re-admitted later, but
    queue time is measured to the first admission). ``recomputed_tokens`` counts tokens whose
    KV was thrown away by preemption and prefilled again.
    """

    id: str
    tenant: str
    type: str
    arrival: float
    scheduled_at: float
    first_token_at: float
    finished_at: float
    prompt_tokens: int
    output_tokens: int
    preemptions: int = 0
    recomputed_tokens: int = 0

    # The scalar properties mirror CompletionArrays' vectorised ones (tests keep them equal).
    @property
    def ttft(self) -> float:
        return self.first_token_at - self.arrival

    @property
    def ttlt(self) -> float:
        return self.finished_at - self.arrival

    @property
    def tbt(self) -> float:
        if self.output_tokens <= 1:
            return NAN
        return (self.finished_at - self.first_token_at) / (self.output_tokens - 1)

    @property
    def ptl(self) -> float:
        if self.output_tokens <= 0:
            return NAN
        return self.ttlt / self.output_tokens

    @property
    def queue(self) -> float:
        return self.scheduled_at - self.arrival


_STR_FIELDS = ("id", "tenant", "type")
_FLOAT_FIELDS = ("arrival", "scheduled_at", "first_token_at", "finished_at")
_INT_FIELDS = ("prompt_tokens", "output_tokens", "preemptions", "recomputed_tokens")


@dataclass(slots=True, frozen=True)
class CompletionArrays:
    """Columnar form of many completions: one 1-D numpy array per :class:`Completion` field.

    Build it once with :func:`to_arrays` (or directly from columns, e.g. in the simulator) and
    pass it to every summary: the summaries never loop over requests in Python.
    """

    id: np.ndarray
    tenant: np.ndarray
    type: np.ndarray
    arrival: np.ndarray
    scheduled_at: np.ndarray
    first_token_at: np.ndarray
    finished_at: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    preemptions: np.ndarray
    recomputed_tokens: np.ndarray

    def __post_init__(self) -> None:
        # Coerce dtypes once here so that every consumer can rely on them.
        for name in _STR_FIELDS:
            object.__setattr__(self, name, np.asarray(getattr(self, name), dtype=str))
        for name in _FLOAT_FIELDS:
            object.__setattr__(self, name, np.asarray(getattr(self, name), dtype=np.float64))
        for name in _INT_FIELDS:
            object.__setattr__(self, name, np.asarray(getattr(self, name), dtype=np.int64))
        lengths = {name: getattr(self, name).shape for name in _ALL_FIELDS}
        shapes = set(lengths.values())
        if len(shapes) != 1 or len(next(iter(shapes))) != 1:
            raise ValueError(f"CompletionArrays columns must be 1-D and of equal length: {lengths}")

    def __len__(self) -> int:
        return int(self.arrival.shape[0])

    @classmethod
    def empty(cls) -> "CompletionArrays":
        # Lists are fine here: __post_init__ coerces every column to its numpy dtype.
        columns: dict[str, Any] = {name: [] for name in _ALL_FIELDS}
        return cls(**columns)

    def select(self, index: np.ndarray) -> "CompletionArrays":
        """Rows picked by a boolean mask or an integer index array."""
        return CompletionArrays(**{name: getattr(self, name)[index] for name in _ALL_FIELDS})

    # Derived per-request columns (seconds). NaN marks "undefined for this request".
    @property
    def ttft(self) -> np.ndarray:
        return self.first_token_at - self.arrival

    @property
    def ttlt(self) -> np.ndarray:
        return self.finished_at - self.arrival

    # An undefined divisor is set to NaN so that the quotient is NaN without a warning
    # (this is also ~8x faster than np.divide(..., where=...)).
    @property
    def tbt(self) -> np.ndarray:
        gaps = self.output_tokens - 1.0
        gaps[gaps <= 0] = np.nan  # one token: no inter-token gap
        return (self.finished_at - self.first_token_at) / gaps

    @property
    def ptl(self) -> np.ndarray:
        tokens = self.output_tokens.astype(np.float64)
        tokens[tokens <= 0] = np.nan
        return self.ttlt / tokens

    @property
    def queue(self) -> np.ndarray:
        return self.scheduled_at - self.arrival


_ALL_FIELDS = _STR_FIELDS + _FLOAT_FIELDS + _INT_FIELDS

CompletionsLike = Union[CompletionArrays, Iterable[Completion]]


def to_arrays(completions: CompletionsLike) -> CompletionArrays:
    """Columnar copy of ``completions``; a :class:`CompletionArrays` is returned unchanged."""
    if isinstance(completions, CompletionArrays):
        return completions
    rows: Sequence[Completion] = (
        completions if isinstance(completions, Sequence) else list(completions)
    )
    n = len(rows)
    cols: dict[str, np.ndarray] = {}
    for name in _STR_FIELDS:
        cols[name] = np.array([getattr(c, name) for c in rows], dtype=str)
    for name in _FLOAT_FIELDS:
        cols[name] = np.fromiter(map(attrgetter(name), rows), dtype=np.float64, count=n)
    for name in _INT_FIELDS:
        cols[name] = np.fromiter(map(attrgetter(name), rows), dtype=np.int64, count=n)
    return CompletionArrays(**cols)


# --------------------------------------------------------------------------------------
# The metric table
# --------------------------------------------------------------------------------------

#: (key suffix, percentile) pairs reported for every latency family.
PERCENTILES: tuple[tuple[str, float], ...] = (
    ("p50", 50.0),
    ("p90", 90.0),
    ("p95", 95.0),
    ("p99", 99.0),
    ("p999", 99.9),
)
STAT_SUFFIXES: tuple[str, ...] = tuple(s for s, _ in PERCENTILES) + ("mean",)
_Q_VALUES = np.array([q for _, q in PERCENTILES])

#: Latency families: key prefix -> (description, unit).
_LATENCY_INFO: dict[str, tuple[str, str]] = {
    "ttft": ("time to first token (first token - arrival)", "s"),
    "ttlt": ("time to last token, end-to-end latency (finish - arrival)", "s"),
    "tbt": ("time between tokens: mean inter-token gap after the first token "
            "(single-token requests excluded)", "s"),
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

#: A grid of SLO scales k for attainment curves (0.1x .. 100x, log-spaced, 10 per decade).
DEFAULT_SLO_SCALES: np.ndarray = np.round(np.logspace(-1, 2, 31), 6)


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
            f"fraction of requests whose {base.upper()} meets its SLO", "fraction", True)
        table[f"{base}_slo_scale_99"] = MetricInfo(
            f"smallest k such that 99% of requests meet k x the {base.upper()} SLO "
            "(how much tighter an SLO the policy holds at 99%)", "x", False)
    table.update({
        "ttft_p99_p50": MetricInfo("TTFT P99 / P50 ratio (tail spread)", "ratio", False),
        "ttlt_p99_p50": MetricInfo("TTLT P99 / P50 ratio (tail spread)", "ratio", False),
        "throughput_tok_s": MetricInfo("output tokens per second over the window", "tok/s", True),
        "throughput_req_s": MetricInfo("completed requests per second over the window", "req/s",
                                       True),
        "requests": MetricInfo("completed requests", "count", True),
        "output_tokens": MetricInfo("output tokens generated", "tokens", True),
        "prompt_tokens": MetricInfo("prompt tokens of completed requests", "tokens", True),
        "preemptions": MetricInfo("preemptions, all causes", "count", False),
        "recomputed_tokens": MetricInfo("tokens prefilled again after preemption", "tokens", False),
        "duration_s": MetricInfo("window length used for throughput", "s", False),
        # Fairness (fairness_summary and the functions below).
        "slo_compliance_ratio": MetricInfo(
            "SCR: fraction of tenants meeting every one of their SLOs", "fraction", True),
        "jain_index": MetricInfo(
            "JFI: Jain's index over tenants' service / entitlement capped by demand "
            "(docs/governance.md)", "index", True),
        "jain_index_seed": MetricInfo(
            "seed 003's literal JFI over tenants' throughput / commitment (reported, not acted on)",
            "index", True),
        "type_share_ratio_min": MetricInfo(
            "smallest (actual share / guaranteed share) over request types", "ratio", True),
        # Reported by the live collector, not computed from completions.
        "kv_usage": MetricInfo("fraction of KV-cache blocks in use (informational)", "fraction",
                               False),
    })
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


class UnknownMetricError(KeyError, ValueError):
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
        return NAN
    if value == baseline:
        return 0.0
    if baseline == 0:
        return NAN
    delta = (value - baseline) if better_high else (baseline - value)
    return delta / abs(baseline) * 100.0


# --------------------------------------------------------------------------------------
# Summaries
# --------------------------------------------------------------------------------------


def _linear_percentiles(x: np.ndarray, fractions: np.ndarray) -> np.ndarray:
    """numpy's default ("linear") percentiles of a non-empty finite 1-D array, bit for bit.

    The cost is one ``partition`` at the needed ranks; this skips ``np.percentile``'s extra
    copy and generic bookkeeping (~15% of its time at 20k values, and summaries call it five
    times). ``x`` is partitioned in place. The interpolation replicates numpy's ``_lerp``;
    a test checks equality with ``np.percentile``.
    """
    n = x.size
    virtual = (n - 1) * fractions
    below = np.floor(virtual)
    lo = below.astype(np.intp)
    hi = np.minimum(lo + 1, n - 1)
    lo = np.minimum(lo, n - 1)
    x.partition(np.unique(np.concatenate((lo, hi))))
    a, b = x[lo], x[hi]
    t = virtual - below
    diff = b - a
    result = a + diff * t
    # numpy interpolates from the nearer end, which keeps results monotone and within [a, b].
    np.subtract(b, diff * (1 - t), out=result, where=t >= 0.5)
    return result


_FRACTIONS = _Q_VALUES / 100.0  # the same division np.percentile does


def distribution_stats(values: np.ndarray | Sequence[float]) -> dict[str, float]:
    """P50/P90/P95/P99/P99.9 and mean of the finite entries (keys ``p50`` .. ``mean``).

    Percentiles equal ``np.percentile(x, q)`` (default linear method). NaN (undefined)
    entries are dropped; no finite entry → every value NaN.
    """
    x = np.asarray(values, dtype=np.float64).ravel()
    x = x[np.isfinite(x)]  # a fresh copy, so partitioning it in place is safe
    if x.size == 0:
        return {suffix: NAN for suffix in STAT_SUFFIXES}
    mean = float(x.mean())
    qs = _linear_percentiles(x, _FRACTIONS)
    stats = {suffix: float(q) for (suffix, _), q in zip(PERCENTILES, qs)}
    stats["mean"] = mean
    return stats


def latency_columns(data: CompletionsLike) -> dict[str, np.ndarray]:
    """Per-request latency arrays (seconds) keyed by family: ttft, ttlt, tbt, ptl, queue."""
    a = to_arrays(data)
    return {base: getattr(a, base) for base in LATENCY_BASES}


def _window_s(a: CompletionArrays, duration_s: float | None) -> float:
    """Throughput window: ``duration_s`` if given, else first arrival → last finish."""
    if duration_s is not None:
        if not (math.isfinite(duration_s) and duration_s > 0):
            raise ValueError(f"duration_s must be a positive number of seconds, got {duration_s!r}")
        return float(duration_s)
    if len(a) == 0:
        return NAN
    span = float(np.nanmax(a.finished_at) - np.nanmin(a.arrival))
    return span if span > 0 else NAN


def _ratio(num: float, den: float) -> float:
    return num / den if (math.isfinite(num) and math.isfinite(den) and den > 0) else NAN


def summarize(
    data: CompletionsLike,
    *,
    duration_s: float | None = None,
    slo: Mapping[str, float] | None = None,
) -> dict[str, float]:
    """Summary of a set of completions (units: seconds; see the module docstring).

    Keys: ``{ttft,ttlt,tbt,ptl,queue}_{p50,p90,p95,p99,p999,mean}``, ``ttft_p99_p50``,
    ``ttlt_p99_p50``, ``throughput_tok_s``, ``throughput_req_s``, ``requests``,
    ``output_tokens``, ``prompt_tokens``, ``preemptions``, ``recomputed_tokens``,
    ``duration_s``. Throughput is over ``duration_s`` (default: first arrival → last finish).

    ``slo`` maps a latency family to an SLO in seconds (e.g. ``{"ttft": 0.5, "ttlt": 20}``)
    and adds ``{family}_slo_attainment`` (fraction meeting 1× the SLO) and
    ``{family}_slo_scale_99`` (:func:`tightest_slo_scale` at 99%).

    Empty input gives NaN statistics and zero counts, never an exception.
    """
    a = to_arrays(data)
    columns = latency_columns(a)
    out: dict[str, float] = {}
    for base, values in columns.items():
        for suffix, value in distribution_stats(values).items():
            out[f"{base}_{suffix}"] = value
    out["ttft_p99_p50"] = _ratio(out["ttft_p99"], out["ttft_p50"])
    out["ttlt_p99_p50"] = _ratio(out["ttlt_p99"], out["ttlt_p50"])

    window = _window_s(a, duration_s)
    n_out = float(a.output_tokens.sum())
    out["throughput_tok_s"] = _ratio(n_out, window)
    out["throughput_req_s"] = _ratio(float(len(a)), window)
    out["requests"] = float(len(a))
    out["output_tokens"] = n_out
    out["prompt_tokens"] = float(a.prompt_tokens.sum())
    out["preemptions"] = float(a.preemptions.sum())
    out["recomputed_tokens"] = float(a.recomputed_tokens.sum())
    out["duration_s"] = window

    for base, limit in (slo or {}).items():
        if base not in columns:
            raise ValueError(
                f"slo key {base!r} is not a latency family; use one of {LATENCY_BASES}")
        out[f"{base}_slo_attainment"] = float(slo_attainment(columns[base], limit, 1.0))
        out[f"{base}_slo_scale_99"] = tightest_slo_scale(columns[base], limit, 0.99)
    return out


_GROUP_KEYS = ("tenant", "type")


def _groups(a: CompletionArrays, key: str) -> dict[str, np.ndarray]:
    """Group name → integer row index, sorted by name."""
    if key not in _GROUP_KEYS:
        raise ValueError(f"group key must be one of {_GROUP_KEYS}, got {key!r}")
    names, inverse = np.unique(getattr(a, key), return_inverse=True)
    order = np.argsort(inverse, kind="stable")
    bounds = np.searchsorted(inverse[order], np.arange(len(names) + 1))
    return {str(name): order[bounds[i]:bounds[i + 1]] for i, name in enumerate(names)}


def summarize_by(
    data: CompletionsLike,
    key: str = "tenant",
    *,
    duration_s: float | None = None,
    slo: Mapping[str, float] | None = None,
) -> dict[str, dict[str, float]]:
    """:func:`summarize` per tenant or per request type.

    Every group's throughput is measured over the **same** window — ``duration_s``, or the
    whole input's first arrival → last finish — so group throughputs add up to the total and
    a tenant that only sent one short burst is not credited with a high rate (which would
    make the Jain index meaningless).
    """
    a = to_arrays(data)
    if len(a) == 0:
        return {}
    window = _window_s(a, duration_s)
    window_arg = window if math.isfinite(window) else None
    result: dict[str, dict[str, float]] = {}
    for name, rows in _groups(a, key).items():
        result[name] = summarize(a.select(rows), duration_s=window_arg, slo=slo)
        if window_arg is None:  # degenerate zero-length window: keep throughput undefined
            result[name]["throughput_tok_s"] = NAN
            result[name]["throughput_req_s"] = NAN
            result[name]["duration_s"] = NAN
    return result


# --------------------------------------------------------------------------------------
# SLO attainment
# --------------------------------------------------------------------------------------


def _normalised(values: np.ndarray | Sequence[float], slo: float | np.ndarray) -> np.ndarray:
    """Finite ``values / slo`` (unsorted; slo may be one number or one per request)."""
    x = np.asarray(values, dtype=np.float64).ravel()
    s = np.asarray(slo, dtype=np.float64)
    if s.ndim > 0:
        s = s.ravel()
        if s.shape != x.shape:
            raise ValueError("a per-request slo must have one entry per value")
    if np.any(~(s > 0)):
        raise ValueError(f"slo must be positive, got {slo!r}")
    # Compare value/slo with k rather than value with k*slo, so that the attainment curve
    # and tightest_slo_scale agree exactly (no rounding in k*slo).
    norm = x / s
    return norm[np.isfinite(norm)]


def _count_at_most(norm: np.ndarray, k: np.ndarray) -> np.ndarray:
    """How many entries of ``norm`` are ≤ each scale in ``k`` (same shape as ``k``)."""
    if k.size <= 16:  # a few O(n) scans beat an O(n log n) sort (summarize asks for one)
        flat = [np.count_nonzero(norm <= kk) for kk in k.ravel()]
        return np.array(flat, dtype=np.int64).reshape(k.shape)
    return np.searchsorted(np.sort(norm), k, side="right")


def slo_attainment(
    values: np.ndarray | Sequence[float],
    slo: float | np.ndarray,
    scales: float | Sequence[float] | np.ndarray = DEFAULT_SLO_SCALES,
) -> np.ndarray:
    """Fraction of requests with ``value ≤ k × slo`` for each ``k`` (shaped like ``scales``).

    ``slo`` is seconds, one number or one per request. Requests whose value is undefined
    (NaN) are excluded; no finite value → NaN everywhere. Non-decreasing in ``k``.
    """
    norm = _normalised(values, slo)
    k = np.asarray(scales, dtype=np.float64)
    if norm.size == 0:
        return np.full(k.shape, np.nan)
    return _count_at_most(norm, k) / norm.size


def _needed(n: int, target: float) -> int:
    """Smallest m with m / n >= target, using the same float comparison as the curve."""
    m = min(n, max(1, math.ceil(target * n)))
    while m > 1 and (m - 1) / n >= target:
        m -= 1
    while m < n and m / n < target:
        m += 1
    return m


def tightest_slo_scale(
    values: np.ndarray | Sequence[float],
    slo: float | np.ndarray,
    target: float = 0.99,
    scales: Sequence[float] | np.ndarray | None = None,
) -> float:
    """Smallest scale ``k`` whose attainment (see :func:`slo_attainment`) is ≥ ``target``.

    With ``scales=None`` the answer is exact: the m-th smallest value/slo, m = ⌈target·n⌉.
    With a grid, it is the smallest grid scale that reaches the target, or ``inf`` when none
    does (an orderable "worse than anything on the grid", unlike NaN). Empty input → NaN.
    """
    if not 0.0 < target <= 1.0:
        raise ValueError(f"target must be in (0, 1], got {target!r}")
    norm = _normalised(values, slo)
    if norm.size == 0:
        return NAN
    if scales is None:
        m = _needed(norm.size, target)
        return float(np.partition(norm, m - 1)[m - 1])
    grid = np.sort(np.asarray(scales, dtype=np.float64).ravel())
    attained = _count_at_most(norm, grid) / norm.size
    hits = np.flatnonzero(attained >= target)
    return float(grid[hits[0]]) if hits.size else math.inf


# --------------------------------------------------------------------------------------
# Fairness
# --------------------------------------------------------------------------------------


def jain_index(values: np.ndarray | Sequence[float]) -> float:
    """Jain's fairness index ``(Σx)² / (n Σx²)``: 1 for equal values, 1/n for one-hot.

    Empty input, or all zeros (0/0), → NaN. Negative or non-finite values → ValueError.
    """
    x = np.asarray(values, dtype=np.float64).ravel()
    if x.size == 0:
        return NAN
    if not np.all(np.isfinite(x)) or np.any(x < 0):
        raise ValueError("jain_index needs finite, non-negative values")
    sum_sq = float(np.dot(x, x))
    if sum_sq == 0.0:
        return NAN
    return float(x.sum()) ** 2 / (x.size * sum_sq)


def normalised_throughput(
    per_tenant_throughput: Mapping[str, float],
    weights: Mapping[str, float] | None = None,
) -> dict[str, float]:
    """Throughput / weight per tenant (weights default to 1).

    A tenant named in ``weights`` but absent from the throughputs counts as 0: a fully starved
    tenant is the least fair outcome, and leaving it out would hide it.
    """
    weights = weights or {}
    out: dict[str, float] = {}
    for tenant in sorted(set(per_tenant_throughput) | set(weights)):
        w = float(weights.get(tenant, 1.0))
        if not (math.isfinite(w) and w > 0):
            raise ValueError(f"weight of tenant {tenant!r} must be positive, got {w!r}")
        out[tenant] = float(per_tenant_throughput.get(tenant, 0.0)) / w
    return out


def tenant_jain_index(
    per_tenant_metrics: Mapping[str, Mapping[str, float]],
    weights: Mapping[str, float] | None = None,
    *,
    metric: str = "throughput_tok_s",
) -> float:
    """Jain's index over tenants' normalised throughput, from :func:`summarize_by` output."""
    metric = validate_metric(metric)
    throughput = {t: m[metric] for t, m in per_tenant_metrics.items()}
    return jain_index(list(normalised_throughput(throughput, weights).values()))


def slo_compliance(
    per_tenant_metrics: Mapping[str, Mapping[str, float]],
    slos: Mapping[str, float],
    *,
    tenant_slos: Mapping[str, Mapping[str, float]] | None = None,
) -> dict[str, bool]:
    """Per tenant: does it meet **every** SLO (Π_q 1[P_q ≤ s_q])?

    ``slos`` maps a metric name (e.g. ``"ttft_p99"``) to its limit for every tenant;
    ``tenant_slos`` overrides or adds limits per tenant (seed 003's per-tenant vectors).
    A lower-is-better metric must be ≤ its limit, a higher-is-better one ≥ it. A NaN value
    (no data for that quantile) counts as a violation: compliance has to be shown.
    """
    tenant_slos = tenant_slos or {}
    result: dict[str, bool] = {}
    for tenant, metrics in per_tenant_metrics.items():
        limits = {**slos, **tenant_slos.get(tenant, {})}
        if not limits:
            raise ValueError(f"no SLOs given for tenant {tenant!r}")
        ok = True
        for name, limit in limits.items():
            canonical = validate_metric(name)
            value = metric_value(metrics, canonical)
            if METRICS[canonical].higher_is_better:
                ok = ok and bool(value >= limit)  # NaN >= x is False
            else:
                ok = ok and bool(value <= limit)
        result[tenant] = ok
    return result


def slo_compliance_ratio(
    per_tenant_metrics: Mapping[str, Mapping[str, float]],
    slos: Mapping[str, float],
    *,
    tenant_slos: Mapping[str, Mapping[str, float]] | None = None,
) -> float:
    """SCR = mean over tenants of Π_q 1[P_q ≤ s_q] (see :func:`slo_compliance`).

    No tenants → NaN."""
    flags = slo_compliance(per_tenant_metrics, slos, tenant_slos=tenant_slos)
    if not flags:
        return NAN
    return sum(flags.values()) / len(flags)


_SHARE_WEIGHTS = ("output_tokens", "prompt_tokens", "tokens", "requests")


def shares(
    data: CompletionsLike, *, key: str = "type", weight: str = "output_tokens"
) -> dict[str, float]:
    """Each group's share of the served work (shares sum to 1).

    ``weight``: ``output_tokens`` (default), ``prompt_tokens``, ``tokens`` (both) or
    ``requests``. Empty input → {}; zero total work → NaN shares.
    """
    if weight not in _SHARE_WEIGHTS:
        raise ValueError(f"weight must be one of {_SHARE_WEIGHTS}, got {weight!r}")
    a = to_arrays(data)
    if len(a) == 0:
        return {}
    if key not in _GROUP_KEYS:
        raise ValueError(f"group key must be one of {_GROUP_KEYS}, got {key!r}")
    if weight == "requests":
        w = np.ones(len(a))
    elif weight == "tokens":
        w = (a.prompt_tokens + a.output_tokens).astype(np.float64)
    else:
        w = getattr(a, weight).astype(np.float64)
    names, inverse = np.unique(getattr(a, key), return_inverse=True)
    per_group = np.bincount(inverse, weights=w, minlength=len(names))
    total = per_group.sum()
    if total <= 0:
        return {str(n): NAN for n in names}
    return {str(n): float(v / total) for n, v in zip(names, per_group)}


def type_share_ratio(
    actual_shares: Mapping[str, float], guaranteed_shares: Mapping[str, float]
) -> dict[str, float]:
    """actual share / guaranteed share for each type with a guarantee.

    A guaranteed type that got nothing has ratio 0 (it starved); a zero guarantee gives NaN
    (nothing to measure against).
    """
    out: dict[str, float] = {}
    for kind, guaranteed in guaranteed_shares.items():
        g = float(guaranteed)
        if not math.isfinite(g) or g < 0:
            raise ValueError(f"guaranteed share of {kind!r} must be >= 0, got {guaranteed!r}")
        out[kind] = float(actual_shares.get(kind, 0.0)) / g if g > 0 else NAN
    return out


def fairness_summary(
    data: CompletionsLike,
    *,
    slos: Mapping[str, float] | None = None,
    tenant_slos: Mapping[str, Mapping[str, float]] | None = None,
    weights: Mapping[str, float] | None = None,
    guaranteed_shares: Mapping[str, float] | None = None,
    duration_s: float | None = None,
    waiting: Mapping[str, Mapping[str, float]] | None = None,
    until: float | None = None,
) -> dict[str, float]:
    """Seed 003's figures of ``data``, computed by the governance report (one implementation:
    ``controlplane.governance.report``, docs/governance.md): ``jain_index`` (the suppression-aware
    JFI) and ``jain_index_seed`` (the seed's literal one) always; ``slo_compliance_ratio`` when SLOs
    are given (TTFT/TTLT P50/P90/P99 limits); ``type_share_ratio_min`` when guaranteed shares are.

    ``weights``: each tenant's weight (default 1). ``waiting``: per tenant what still waits at the
    window's end (as ``report`` takes it). ``until``: the window's end — a request not finished by
    then counts as still waiting (its tokens as demand, its wait so far as a lower bound), as the
    live collector would have seen it. Figures without data are NaN."""
    from controlplane.governance import Terms, completion_columns, report  # noqa: PLC0415 (it imports this module)

    rows = _as_completions(data)
    queued: dict[str, dict[str, float]] = {t: dict(w) for t, w in (waiting or {}).items()}
    everything = list(rows)
    if until is not None:
        late = [c for c in rows if c.finished_at > until]
        rows = [c for c in rows if c.finished_at <= until]
        for c in late:
            w = queued.setdefault(c.tenant, {"requests": 0, "waited_s": 0.0, "tokens": 0.0})
            w["requests"] = w.get("requests", 0) + 1
            w["tokens"] = w.get("tokens", 0.0) + c.prompt_tokens + c.output_tokens
            if c.first_token_at > until:
                w["waited_s"] = max(w.get("waited_s") or 0.0, until - c.arrival)
    for name in (slos or {}):
        _fairness_limit(name)
    for per in (tenant_slos or {}).values():
        for name in per:
            _fairness_limit(name)
    weights = dict(weights or {})
    terms = Terms(limits=lambda t: {**(slos or {}), **(tenant_slos or {}).get(t, {})},
                  weight=lambda t: float(weights.get(t, 1.0)), committed=lambda t: None,
                  type_shares=dict(guaranteed_shares or {}))
    window = _window_s(to_arrays(rows), duration_s) if rows else (duration_s or NAN)
    if until is not None and duration_s is None and rows:
        window = until - min(c.arrival for c in rows)
    rep = report(*completion_columns(rows), terms, duration_s=window if window and window > 0 else 1.0,
                 arrived=_asked_types(rows, everything if until is not None else ()), waiting=queued)
    out = {"jain_index": _nan(rep["jfi"]), "jain_index_seed": _nan(rep["jfi_seed"])}
    if slos or tenant_slos:
        out["slo_compliance_ratio"] = _nan(rep["scr"])
    if guaranteed_shares:
        out["type_share_ratio_min"] = _nan(rep["type_fairness_min"])
    return out


def _as_completions(data: CompletionsLike) -> list[Completion]:
    if not isinstance(data, CompletionArrays):
        return list(data)
    cols = [getattr(data, f) for f in ("id", "tenant", "type", "arrival", "scheduled_at", "first_token_at",
                                       "finished_at", "prompt_tokens", "output_tokens")]
    return [Completion(str(i), str(t), str(k), float(a), float(s), float(f), float(e), int(p), int(o))
            for i, t, k, a, s, f, e, p, o in zip(*cols)]


def _fairness_limit(name: str) -> None:
    family, _, q = name.partition("_")
    if family not in ("ttft", "ttlt") or q not in ("p50", "p90", "p99"):
        raise ValueError(f"SCR is judged on TTFT/TTLT P50/P90/P99 limits (ttft_p99 ...), not {name!r}")


def _asked_types(served: Sequence[Completion], all_rows: Any) -> dict[str, float] | None:
    """Requests per type asked for: every row when a window's end cut some off, else None
    (the served ones)."""
    if not all_rows:
        return None
    out: dict[str, float] = {}
    for c in all_rows:
        out[c.type] = out.get(c.type, 0.0) + 1.0
    return out


def _nan(value: float | None) -> float:
    return NAN if value is None else float(value)


# --------------------------------------------------------------------------------------
# Sliding-window percentiles (live collector, γ-Ada)
# --------------------------------------------------------------------------------------


def _percentile_key(q: float) -> str:
    """50 → 'p50', 99.9 → 'p999' (the same spelling as summary keys)."""
    return "p" + f"{q:g}".replace(".", "")


class WindowedPercentiles:
    """The last ``capacity`` values in a numpy ring buffer, with exact percentiles.

    Used by the live collector and by γ-Ada (P95/P99 over the last ``ada_window`` finished
    requests). Non-finite values are dropped on insert. Thread-safe: the engine thread adds
    while an HTTP or TUI thread reads.
    """

    DEFAULT_QUANTILES: tuple[float, ...] = (50.0, 90.0, 95.0, 99.0)

    def __init__(self, capacity: int) -> None:
        if int(capacity) != capacity or capacity < 1:
            raise ValueError(f"capacity must be a positive integer, got {capacity!r}")
        self._buf = np.empty(int(capacity), dtype=np.float64)
        self._next = 0  # slot the next value goes to
        self._count = 0  # valid values held (≤ capacity); until full they are _buf[:_count]
        self._seen = 0  # values ever accepted (for "after ada_min_samples" rules)
        self._lock = threading.Lock()

    @property
    def capacity(self) -> int:
        return int(self._buf.shape[0])

    @property
    def total_seen(self) -> int:
        return self._seen

    def __len__(self) -> int:
        return self._count

    def add(self, value: float) -> None:
        if not math.isfinite(value):
            return
        with self._lock:
            self._buf[self._next] = value
            self._next = (self._next + 1) % self.capacity
            self._count = min(self._count + 1, self.capacity)
            self._seen += 1

    def extend(self, values: Iterable[float] | np.ndarray) -> None:
        v = np.asarray(values if isinstance(values, np.ndarray) else list(values),
                       dtype=np.float64).ravel()
        v = v[np.isfinite(v)]
        k, cap = v.size, self.capacity
        if k == 0:
            return
        with self._lock:
            self._seen += k
            if k >= cap:  # only the newest `cap` values survive
                self._buf[:] = v[-cap:]
                self._next, self._count = 0, cap
                return
            first = min(k, cap - self._next)  # up to the end of the buffer ...
            self._buf[self._next:self._next + first] = v[:first]
            self._buf[:k - first] = v[first:]  # ... and the rest wraps to the front
            self._next = (self._next + k) % cap
            self._count = min(self._count + k, cap)

    def clear(self) -> None:
        with self._lock:
            self._next = self._count = self._seen = 0

    def values(self) -> np.ndarray:
        """A copy of the held values, oldest first."""
        with self._lock:
            if self._count < self.capacity:
                return self._buf[:self._count].copy()
            return np.concatenate((self._buf[self._next:], self._buf[:self._next]))

    def percentiles(self, qs: Sequence[float] = DEFAULT_QUANTILES) -> dict[str, float]:
        """Exact percentiles of the held values, keyed ``p50``, ``p90`` ... (NaN when empty)."""
        keys = [_percentile_key(q) for q in qs]
        with self._lock:
            if self._count == 0:
                return {k: NAN for k in keys}
            # Order does not matter for percentiles, so no need to unroll the ring.
            result = np.percentile(self._buf[:self._count], list(qs))
        return {k: float(v) for k, v in zip(keys, np.atleast_1d(result))}

    def percentile(self, q: float) -> float:
        return self.percentiles((q,))[_percentile_key(q)]

"""The measures of fairness (docs/governance.md): Jain's index, throughput normalised by weight,
SLO compliance and its ratio, each group's share of the served work and a type's share over its
guarantee — plain functions of figures or completions, which seed 003's figures
(``scheduler.metrics.fairness``), the TUI and the tuner build on."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from scheduler.metrics.completions import CompletionsLike, to_arrays
from scheduler.metrics.registry import METRICS, metric_value, validate_metric
from scheduler.metrics.summary import GROUP_KEYS


def jain_index(values: np.ndarray | Sequence[float]) -> float:
    """Jain's fairness index ``(Σx)² / (n Σx²)``: 1 for equal values, 1/n for one-hot.

    Empty input, or all zeros (0/0), → NaN. Negative or non-finite values → ValueError.
    """
    x = np.asarray(values, dtype=np.float64).ravel()
    if x.size == 0:
        return math.nan
    if not np.all(np.isfinite(x)) or np.any(x < 0):
        raise ValueError("jain_index needs finite, non-negative values")
    sum_sq = float(np.dot(x, x))
    if sum_sq == 0.0:
        return math.nan
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
        return math.nan
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
    if key not in GROUP_KEYS:
        raise ValueError(f"group key must be one of {GROUP_KEYS}, got {key!r}")
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
        return {str(n): math.nan for n in names}
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
        out[kind] = float(actual_shares.get(kind, 0.0)) / g if g > 0 else math.nan
    return out

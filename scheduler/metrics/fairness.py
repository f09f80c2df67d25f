"""Fairness across tenants and request types: seed 003's multi-tenant figures of a set of
completions (on the measures of ``scheduler.metrics.fairness_measures``), judged against
the tenants' SLOs and commitments (a slofq settings document's, or a cluster file's ``governance``
block). :func:`report` is the one implementation of SCR, JFI, type fairness and ω: the collector,
the store's governance windows, ``capacity``, the Prometheus page, the TUI, the tuner
(:func:`fairness_summary`) and slofq (its minimum shares, :func:`minimum_shares`) all read these.
Definitions and a worked example: docs/governance.md.

    report = window_report(
        completions, params, duration_s=10.0, waiting={"c": {"requests": 3, "waited_s": 12.0}}
    )
    report["scr"], report["jfi"], report["jfi_seed"], report["type_fairness_min"]
    report["tenants"]["acme"]["omega"]

* **SCR** (SLO compliance ratio, the seed's): the fraction of tenants meeting *every* quantile
  target they have (TTFT, and TTLT where set). A tenant counts when it asked for something in the
  window: it has completions, or requests waiting (``waiting``). A tenant with waiting requests and
  no completion is judged on its wait so far, a lower bound of its latency: it misses a tail
  target (its highest TTFT/TTLT quantile) that wait already exceeds.
* **JFI** (what alerts and the governor act on): Jain's index over each tenant's service ratio
  x_j = min(1, served_j / E_j), where E_j is its entitlement capped by its demand: the window's
  served tokens shared by the tenants' weights (slofq's base weights: commitments, or weights, on
  one scale), each capped by what the tenant asked for (served + waiting), the share a capped
  tenant leaves redistributed (weighted max-min). JFI = 1 when every tenant got all it asked for
  or its share; it falls when a tenant with unmet demand got less than its share — "a tenant is
  being suppressed", what the seed says JFI is for.
* **JFI (seed)** ``jfi_seed``: the seed's literal figure, Jain's index over Û_j = served rate /
  committed rate (commit_tok_s; a tenant with a weight instead: its weight's share of the served
  rate). Reported beside JFI, never acted on: it reads < 1 whenever commitments and demands differ.
* **ω** = min(C_j / U_j, α) (seed 003's consumption protection; α = ``protection_alpha``, 4 when
  off): C_j the committed rate as above, U_j the served rate. ω < 1: the tenant uses more than its
  commitment (an over-consumer, ``over_consumers``).
* **Type fairness**: each type's share of the completed requests over its guaranteed share: its
  minimum share ρ_k (the explicit shares, else seed 003's (1/|T|) / (1 + η·p_k) from the types'
  shares p_k of the requests asked for), but never more than p_k itself (a type that asks for less
  than ρ_k is not starved). The requests asked for are the window's completions and, where known,
  those still waiting (``arrived``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NotRequired, TypedDict, cast

import numpy as np

from scheduler.metrics.completions import Completion, CompletionArrays, CompletionsLike, to_arrays
from scheduler.metrics.fairness_measures import jain_index
from scheduler.metrics.summary import distribution_stats, throughput_window_s
from scheduler.settings import QUANTILES, SloFqParams
from scheduler.validation import finite_or_none


class TenantFigures(TypedDict):
    """One tenant's figures over a window (:func:`report`'s ``tenants``): its latency quantiles
    (s; None where it completed nothing), what it was served and still waits for, its SLO verdict
    and, for the tenants judged (``governed``), its share of the capacity."""

    ttft_p50: float | None
    ttft_p90: float | None
    ttft_p99: float | None
    ttlt_p50: float | None
    ttlt_p90: float | None
    ttlt_p99: float | None
    ttft_p99_p50: float | None
    requests: int
    tok_s: float
    served_tokens: float
    waiting: int
    waited_s: float | None
    starved: bool
    demand_tokens: float
    limits: dict[str, float]
    missed: list[str]
    compliant: bool
    governed: bool
    # Filled for the governed tenants (``_fairness``).
    entitled_tokens: NotRequired[float]
    service_ratio: NotRequired[float | None]
    committed_tok_s: NotRequired[float]
    normalised: NotRequired[float | None]
    omega: NotRequired[float]


class TypeFigures(TypedDict):
    """One request type's figures over a window (:func:`report`'s ``types``)."""

    share: float | None
    minimum: float | None
    ratio: float | None
    ttft_p50: float | None
    ttft_p99: float | None


class FairnessReport(TypedDict):
    """Seed 003's multi-tenant figures of one window (:func:`report`): per tenant and per type,
    SCR, JFI (and the seed's literal ``jfi_seed``), the over-consumers and type fairness. The
    collector adds its alerts (``controlplane.governance.GovernanceReport``); the store keeps it
    as JSON."""

    requests: int
    duration_s: float
    tenants: dict[str, TenantFigures]
    types: dict[str, TypeFigures]
    scr: float | None
    jfi: float | None
    jfi_seed: float | None
    over_consumers: list[str]
    type_fairness: dict[str, float | None]
    type_fairness_min: float | None


# --------------------------------------------------------------------------------------
# Seed 003's figures
# --------------------------------------------------------------------------------------

DEFAULT_ALPHA = (
    4.0  # ω's cap where consumption protection is off (slofq's default protection_alpha)
)


def limits(params: SloFqParams, tenant: str) -> dict[str, float]:
    """The tenant's targets as metric limits (``ttft_p99`` → seconds)."""
    out: dict[str, float] = {}
    for family, slo in (("ttft", params.ttft_slo(tenant)), ("ttlt", params.tenant(tenant).ttlt)):
        if slo is not None:
            out.update({f"{family}_{q}": v for q, v in slo.targets().items()})
    return out


def minimum_shares(params: SloFqParams, arrived: Mapping[str, float]) -> dict[str, float]:
    """ρ_k: the explicit shares, else (1/|T|) / (1 + η·p_k) from ``arrived`` (requests per type)."""
    return _minimum_shares(params.type_shares, params.type_eta, arrived)


def _minimum_shares(
    explicit: Mapping[str, float], eta: float, arrived: Mapping[str, float]
) -> dict[str, float]:
    if explicit:
        return dict(explicit)
    total = sum(arrived.values())
    if not total:
        return {}
    n = len(arrived)
    return {k: (1.0 / n) / (1.0 + eta * v / total) for k, v in arrived.items()}


@dataclass(frozen=True)
class Terms:
    """What the figures judge tenants and types by: per tenant its limits (``ttft_p99`` → s), its
    weight on one scale, its committed rate (tok/s, or None: a share of the served rate), ω's cap
    α, and the types' explicit minimum shares (else seed 003's formula with ``eta``)."""

    limits: Callable[[str], dict[str, float]]
    weight: Callable[[str], float]
    committed: Callable[[str], float | None]
    alpha: float = DEFAULT_ALPHA
    type_shares: Mapping[str, float] = field(default_factory=dict)
    eta: float = 0.5

    @classmethod
    def of(cls, params: SloFqParams) -> Terms:
        """A slofq document's (or a cluster's ``governance``) tenants and types."""
        return cls(
            limits=lambda t: limits(params, t),
            weight=params.base_weight,
            committed=lambda t: params.tenant(t).commit_tok_s,
            alpha=params.protection_alpha or DEFAULT_ALPHA,
            type_shares=dict(params.type_shares),
            eta=params.type_eta,
        )


def water_fill(
    capacity: float, weights: Mapping[str, float], demands: Mapping[str, float]
) -> dict[str, float]:
    """Weighted max-min fair shares of ``capacity``: each tenant its weight's share, never more
    than its demand, what a capped tenant leaves shared again among the others."""
    out = {t: 0.0 for t in demands}
    open_ = {t for t, d in demands.items() if d > 0}
    left = float(capacity)
    while open_ and left > 1e-12:
        total_w = sum(weights[t] for t in open_)
        capped = {t for t in open_ if demands[t] - out[t] <= left * weights[t] / total_w}
        if not capped:  # nobody is satisfied by its share: everyone gets it
            for t in open_:
                out[t] += left * weights[t] / total_w
            break
        for t in capped:
            left -= demands[t] - out[t]
            out[t] = demands[t]
        open_ -= capped
    return out


def completion_columns(
    completions: Iterable[Completion],
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(tenant, type, TTFT, TTLT, tokens) of completions: the columns ``report`` takes."""
    done = list(completions)
    return (
        np.array([c.tenant for c in done], dtype=object),
        np.array([c.type for c in done], dtype=object),
        np.array([c.first_token_at - c.arrival for c in done], dtype=np.float64),
        np.array([c.finished_at - c.arrival for c in done], dtype=np.float64),
        np.array([c.prompt_tokens + c.output_tokens for c in done], dtype=np.float64),
    )


def window_report(
    completions: Iterable[Completion],
    params: SloFqParams | Terms,
    *,
    duration_s: float,
    arrived: Mapping[str, float] | None = None,
    waiting: Mapping[str, Mapping[str, float]] | None = None,
) -> FairnessReport:
    """``report`` of ``completions`` (the requests of one window, ``duration_s`` long)."""
    return report(
        *completion_columns(completions),
        params,
        duration_s=duration_s,
        arrived=arrived,
        waiting=waiting,
    )


def report(
    tenant: np.ndarray,
    rtype: np.ndarray,
    ttft: np.ndarray,
    ttlt: np.ndarray,
    tokens: np.ndarray,
    params: SloFqParams | Terms,
    *,
    duration_s: float,
    arrived: Mapping[str, float] | None = None,
    waiting: Mapping[str, Mapping[str, float]] | None = None,
    governed: Collection[str] | None = None,
) -> FairnessReport:
    """Per tenant and per type figures, SCR, JFI (and the seed's literal ``jfi_seed``), ω and type
    fairness of one window's requests, given as columns (tenant and type names, TTFT and TTLT in s
    — NaN where undefined — and tokens served, prompt + output). ``arrived``: requests per type
    asked for in the window (default: these requests' own types). ``waiting``: per tenant what is
    still queued at the window's end — ``requests`` (count), ``waited_s`` (how long the oldest has
    waited so far, a lower bound; 0 when unknown) and optionally ``tokens`` (else the tenant's, or
    the window's, mean tokens per completed request). ``governed``: the tenants SCR, JFI and the
    over-consumers are judged over (None: every one); the others are shown (``governed`` False)
    but drive nothing — tenants nobody declared cannot pull the figures an operator acts on."""
    terms = params if isinstance(params, Terms) else Terms.of(params)
    waiting = {t: w for t, w in (waiting or {}).items() if w.get("requests", 0) > 0}
    mean_tokens = float(tokens.mean()) if tokens.size else 1.0
    tenants: dict[str, TenantFigures] = {}
    for name in sorted(set(tenant.tolist()) | set(waiting)):
        rows = tenant == name
        n = int(rows.sum())
        ft, lt = distribution_stats(ttft[rows]), distribution_stats(ttlt[rows])
        figures: dict[str, float | None] = {
            **{f"ttft_{q}": finite_or_none(ft[q]) for q in QUANTILES},
            **{f"ttlt_{q}": finite_or_none(lt[q]) for q in QUANTILES},
        }
        p50, p99 = figures["ttft_p50"], figures["ttft_p99"]
        figures["ttft_p99_p50"] = p99 / p50 if p50 and p99 is not None else None
        lim = terms.limits(name)
        queued = waiting.get(name, {})
        waited = float(queued.get("waited_s") or 0.0)
        if n:
            met = {k: (got := figures[k]) is not None and got <= v for k, v in lim.items()}
        else:  # nothing completed: judged on the wait so far, a lower bound of its tail latency
            met = {k: not waited > v for k, v in _tail_limits(lim).items()}
        served = float(tokens[rows].sum())
        queued_tokens = float(
            queued.get("tokens", queued.get("requests", 0) * (served / n if n else mean_tokens))
        )
        tenants[name] = cast(
            TenantFigures,
            {
                **figures,
                "requests": n,
                "tok_s": served / duration_s,
                "served_tokens": served,
                "waiting": int(queued.get("requests", 0)),
                "waited_s": waited if queued else None,
                "starved": not n,
                "demand_tokens": served + queued_tokens,
                "limits": lim,
                "missed": sorted(k for k, ok in met.items() if not ok),
                "compliant": all(met.values()),
                "governed": governed is None or name in governed,
            },
        )
    counted = {t: f for t, f in tenants.items() if f["governed"]}
    jfi, jfi_seed, over_consumers = _fairness(counted, terms, duration_s)
    kinds = sorted(set(rtype.tolist()))
    served_k = {k: float((rtype == k).sum()) for k in kinds}
    asked = dict(arrived) if arrived is not None else dict(served_k)
    total, total_asked = sum(served_k.values()), sum(asked.values())
    rho = _minimum_shares(terms.type_shares, terms.eta, asked)
    guaranteed = {k: min(r, asked.get(k, 0.0) / total_asked) for k, r in rho.items() if total_asked}
    ratios = {
        k: (served_k.get(k, 0.0) / total) / g if total else None
        for k, g in guaranteed.items()
        if g > 0
    }
    types: dict[str, TypeFigures] = {}
    for k in kinds:
        ft = distribution_stats(ttft[rtype == k])
        types[k] = {
            "share": served_k[k] / total if total else None,
            "minimum": rho.get(k),
            "ratio": ratios.get(k),
            "ttft_p50": finite_or_none(ft["p50"]),
            "ttft_p99": finite_or_none(ft["p99"]),
        }
    finite = [r for r in ratios.values() if r is not None]
    return {
        "requests": int(tenant.size),
        "duration_s": duration_s,
        "tenants": tenants,
        "types": types,
        "scr": (sum(t["compliant"] for t in counted.values()) / len(counted)) if counted else None,
        "jfi": jfi,
        "jfi_seed": jfi_seed,
        "over_consumers": over_consumers,
        "type_fairness": ratios,
        "type_fairness_min": min(finite) if finite else None,
    }


def _tail_limits(lim: Mapping[str, float]) -> dict[str, float]:
    """Each family's highest-quantile limit (``ttft_p99``, ``ttlt_p99``)."""
    out: dict[str, float] = {}
    for family in ("ttft", "ttlt"):
        given = [f"{family}_{q}" for q in QUANTILES if f"{family}_{q}" in lim]
        if given:
            out[given[-1]] = lim[given[-1]]
    return out


def _fairness(
    tenants: dict[str, TenantFigures], terms: Terms, duration_s: float
) -> tuple[float | None, float | None, list[str]]:
    """Fills each tenant's entitlement, service ratio, committed rate, Û and ω; returns the JFI,
    the seed's JFI and the over-consumers."""
    if not tenants:
        return None, None, []
    served = {t: f["served_tokens"] for t, f in tenants.items()}
    weights = {t: terms.weight(t) for t in tenants}
    capacity = sum(served.values())  # what the cluster served in the window: the capacity shared
    entitled = water_fill(capacity, weights, {t: f["demand_tokens"] for t, f in tenants.items()})
    rate, total_w = capacity / duration_s, sum(weights.values())
    for t, f in tenants.items():
        committed = terms.committed(t)
        c = committed if committed is not None else weights[t] / total_w * rate  # a weight's share
        use = served[t] / duration_s
        f["entitled_tokens"] = entitled[t]
        f["service_ratio"] = min(1.0, served[t] / entitled[t]) if entitled[t] > 0 else None
        f["committed_tok_s"] = c
        f["normalised"] = use / c if c > 0 else None
        f["omega"] = min(c / use, terms.alpha) if use > 0 else terms.alpha
    ratios = [f["service_ratio"] for f in tenants.values() if f["service_ratio"] is not None]
    seed = [f["normalised"] for f in tenants.values() if f["normalised"] is not None]
    return (
        finite_or_none(jain_index(ratios)) if ratios else None,
        finite_or_none(jain_index(seed)) if seed else None,
        sorted(t for t, f in tenants.items() if f["omega"] < 1.0),
    )


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
    """Seed 003's figures of ``data``, computed by :func:`report` (their one implementation,
    docs/governance.md): ``jain_index`` (the suppression-aware
    JFI) and ``jain_index_seed`` (the seed's literal one) always; ``slo_compliance_ratio`` when SLOs
    are given (TTFT/TTLT P50/P90/P99 limits); ``type_share_ratio_min`` when guaranteed shares are.

    ``weights``: each tenant's weight (default 1). ``waiting``: per tenant what still waits at the
    window's end (as ``report`` takes it). ``until``: the window's end — a request not finished by
    then counts as still waiting (its tokens as demand, its wait so far as a lower bound), as the
    live collector would have seen it. Figures without data are NaN."""
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
    for name in slos or {}:
        _fairness_limit(name)
    for per in (tenant_slos or {}).values():
        for name in per:
            _fairness_limit(name)
    weights = dict(weights or {})
    terms = Terms(
        limits=lambda t: {**(slos or {}), **(tenant_slos or {}).get(t, {})},
        weight=lambda t: float(weights.get(t, 1.0)),
        committed=lambda t: None,
        type_shares=dict(guaranteed_shares or {}),
    )
    window = throughput_window_s(to_arrays(rows), duration_s) if rows else (duration_s or math.nan)
    if until is not None and duration_s is None and rows:
        window = until - min(c.arrival for c in rows)
    rep = report(
        *completion_columns(rows),
        terms,
        duration_s=window if window and window > 0 else 1.0,
        arrived=_asked_types(rows, everything if until is not None else ()),
        waiting=queued,
    )
    out = {"jain_index": _nan(rep["jfi"]), "jain_index_seed": _nan(rep["jfi_seed"])}
    if slos or tenant_slos:
        out["slo_compliance_ratio"] = _nan(rep["scr"])
    if guaranteed_shares:
        out["type_share_ratio_min"] = _nan(rep["type_fairness_min"])
    return out


def _as_completions(data: CompletionsLike) -> list[Completion]:
    if not isinstance(data, CompletionArrays):
        return list(data)
    cols = [
        getattr(data, f)
        for f in (
            "id",
            "tenant",
            "type",
            "arrival",
            "scheduled_at",
            "first_token_at",
            "finished_at",
            "prompt_tokens",
            "output_tokens",
        )
    ]
    return [
        Completion(str(i), str(t), str(k), float(a), float(s), float(f), float(e), int(p), int(o))
        for i, t, k, a, s, f, e, p, o in zip(*cols)
    ]


def _fairness_limit(name: str) -> None:
    family, _, q = name.partition("_")
    if family not in ("ttft", "ttlt") or q not in ("p50", "p90", "p99"):
        raise ValueError(
            f"SCR is judged on TTFT/TTLT P50/P90/P99 limits (ttft_p99 ...), not {name!r}"
        )


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
    return math.nan if value is None else float(value)

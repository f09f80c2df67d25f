"""The autopilot's promise: what it keeps and, within that, what it wins (issue 32).

One document (``Promise``, a field of ``AutopilotConfig``; the cluster file's governance block
fills ``slo``) says both the guard and the objective:

* **No SLO declared** — no quantile an operator watches is worse than the reference's (vLLM's own
  order, sarathi) by more than ``slack``: P50, P95, P99 TTFT and P50, P99 TTLT each ≤ (1 +
  ``slack``) × the reference's, throughput ≥ ``throughput_floor`` × its; within that, the lowest
  ``objective`` (P95 TTFT).
* **Seed 003's per-tenant, per-type multi-quantile SLOs declared** (``slo``, the governance
  block's tenants and types) — the highest SCR (the share of tenants meeting every one of their
  quantile targets), then the highest JFI (Jain's index of the tenants' service ratios), then the
  objective; a candidate is kept only if its SCR is at least the best of the references' (sarathi,
  the defaults, slofq) and its JFI not lower than that reference's by more than ``jfi_slack``.

``Figures`` are one candidate's numbers over the comparison window's requests; ``judge`` marks
each feasible against the reference's and ``rank_key`` orders the feasible ones (smaller is
better). Both are pure: the autopilot, its benchmark and its tests use the same two functions.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from scheduler.metrics.fairness import Terms, report
from scheduler.settings import SloFqParams

# The quantiles the promise holds, as (name, family, percentile).
QUANTILES: tuple[tuple[str, str, float], ...] = (
    ("ttft_p50", "ttft", 50.0),
    ("ttft_p95", "ttft", 95.0),
    ("ttft_p99", "ttft", 99.0),
    ("ttlt_p50", "ttlt", 50.0),
    ("ttlt_p99", "ttlt", 99.0),
)
QUANTILE_NAMES = tuple(name for name, _, _ in QUANTILES)
Objective = Literal["ttft_p50", "ttft_p95", "ttft_p99", "ttlt_p50", "ttlt_p99"]


class Promise(BaseModel):
    """What the autopilot promises the operator (errors name the field)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    # Each quantile may be at most this fraction worse than the reference's.
    slack: float = Field(0.02, ge=0.0, le=1.0)
    throughput_floor: float = Field(0.99, ge=0.0, le=1.0)
    objective: Objective = "ttft_p95"
    # Seed 003's tenants and types (a slofq document's parameters; the cluster file's governance
    # block): set, the promise is the SLOs' (SCR, then JFI, then the objective).
    slo: SloFqParams | None = None
    jfi_slack: float = Field(0.01, ge=0.0, le=1.0)

    def describe(self) -> str:
        """One line an operator reads: which promise holds."""
        if self.slo is not None:
            n = len(self.slo.tenants)
            return (
                f"tenants' SLOs ({n} declared): SCR at least the defaults' and slofq's, JFI not "
                f"lower, then the lowest {_label(self.objective)}"
            )
        return (
            f"every quantile (TTFT P50/P95/P99, TTLT P50/P99) within {self.slack:.0%} of "
            f"sarathi's, throughput ≥ {self.throughput_floor:.0%}; then the lowest "
            f"{_label(self.objective)}"
        )


def _label(metric: str) -> str:
    family, q = metric.split("_")
    return f"{q.upper()} {family.upper()}"


@dataclass(frozen=True, slots=True)
class Figures:
    """One candidate over the window's requests (latencies in s; a request not finished yet
    counts with its projected latency, ``projected`` of them)."""

    ttft_p50: float
    ttft_p95: float
    ttft_p99: float
    ttlt_p50: float
    ttlt_p99: float
    throughput_tok_s: float
    projected: int = 0
    scr: float | None = None
    jfi: float | None = None
    feasible: bool = True
    broken: tuple[str, ...] = ()  # what breaks the promise against the reference

    def value(self, name: str) -> float:
        return float(getattr(self, name))

    @classmethod
    def of(cls, metrics: Mapping[str, float]) -> Figures:
        """A whole run's figures from a metrics table (``scheduler.metrics.summarize``'s keys)."""
        return cls(
            **{k: float(metrics[k]) for k in QUANTILE_NAMES},  # type: ignore[arg-type]
            throughput_tok_s=float(metrics["throughput_tok_s"]),
        )


def figures_of(
    ttft: np.ndarray,
    ttlt: np.ndarray,
    tokens_per_s: float,
    projected: int = 0,
    *,
    slo: SloFqParams | None = None,
    tenants: np.ndarray | None = None,
    types: np.ndarray | None = None,
    tokens: np.ndarray | None = None,
    window_s: float = 1.0,
) -> Figures:
    """The promise's figures of one candidate from per-request TTFT/TTLT arrays (and, with SLOs,
    each request's tenant, type and tokens)."""
    values = {}
    for family, data in (("ttft", ttft), ("ttlt", ttlt)):
        # One partition per family for all its quantiles (the same values as one call each).
        wanted = [(name, q) for name, fam, q in QUANTILES if fam == family]
        found = np.percentile(data, [q for _, q in wanted]) if data.size else None
        for k, (name, _) in enumerate(wanted):
            values[name] = float(found[k]) if found is not None else math.nan
    scr = jfi = None
    if slo is not None and tenants is not None and types is not None and tokens is not None:
        rep = report(tenants, types, ttft, ttlt, tokens, Terms.of(slo), duration_s=window_s)
        scr, jfi = rep["scr"], rep["jfi"]
    return Figures(
        ttft_p50=values["ttft_p50"],
        ttft_p95=values["ttft_p95"],
        ttft_p99=values["ttft_p99"],
        ttlt_p50=values["ttlt_p50"],
        ttlt_p99=values["ttlt_p99"],
        throughput_tok_s=tokens_per_s,
        projected=projected,
        scr=scr,
        jfi=jfi,
    )


def sampling_slack(requests: int, noise: float) -> dict[str, float]:
    """Per quantile, how far a window's estimate of it may stray by chance: ``noise`` over the
    square root of the requests beyond it (a P99 over 500 requests rests on 5 of them)."""
    out = {}
    for name, _, q in QUANTILES:
        beyond = max(1.0, requests * (1.0 - q / 100.0))
        out[name] = noise / math.sqrt(beyond)
    return out


def breaks(
    promise: Promise,
    f: Figures,
    ref: Figures,
    loosen: float = 0.0,
    per_quantile: Mapping[str, float] | None = None,
) -> tuple[str, ...]:
    """The quantiles (and throughput) on which ``f`` is worse than ``ref`` beyond the promise's
    slack (plus ``loosen``, plus ``per_quantile``'s entry): empty when it keeps it."""
    extra = per_quantile or {}
    out = [
        name
        for name in QUANTILE_NAMES
        if f.value(name) > (1.0 + promise.slack + loosen + extra.get(name, 0.0)) * ref.value(name)
    ]
    if f.throughput_tok_s < (promise.throughput_floor - loosen) * ref.throughput_tok_s:
        out.append("throughput")
    return tuple(out)


def judge(
    promise: Promise, figures: Mapping[str, Figures], reference: str, slo_refs: tuple[str, ...]
) -> dict[str, Figures]:
    """``figures`` with ``feasible``/``broken`` set: without SLOs against ``reference``'s
    quantiles; with SLOs against the best SCR (and its JFI) of the ``slo_refs`` present."""
    ref = figures[reference]
    if promise.slo is None:
        return {n: _mark(f, breaks(promise, f, ref)) for n, f in figures.items()}
    refs = [figures[n] for n in slo_refs if n in figures and figures[n].scr is not None]
    best = max(refs, key=lambda f: (f.scr or 0.0, f.jfi or 0.0), default=None)
    out = {}
    for name, f in figures.items():
        broken: list[str] = []
        if best is not None:
            if (f.scr or 0.0) < (best.scr or 0.0) - 1e-9:
                broken.append("scr")
            if best.jfi is not None and (f.jfi or 0.0) < best.jfi - promise.jfi_slack:
                broken.append("jfi")
        out[name] = _mark(f, tuple(broken))
    return out


def _mark(f: Figures, broken: tuple[str, ...]) -> Figures:
    return replace(f, feasible=not broken, broken=broken)


def rank_key(promise: Promise, f: Figures) -> tuple[float, ...]:
    """Smaller is better: the objective; with SLOs first −SCR and −JFI (to two decimals: a JFI
    differing in the third decimal is a tie, decided by the objective)."""
    objective = f.value(promise.objective)
    if promise.slo is None:
        return (objective,)
    return (-(f.scr or 0.0), -round(f.jfi or 0.0, 2), objective)


def margin(f: Figures, ref: Figures) -> float:
    """``f``'s quantiles against ``ref``'s as one number: the geometric mean of their ratios over
    the promise's quantiles (below 1: ahead of the reference overall; lower is more margin)."""
    logs = [
        math.log(f.value(q) / ref.value(q))
        for q in QUANTILE_NAMES
        if ref.value(q) > 0 and f.value(q) > 0
    ]
    return math.exp(sum(logs) / len(logs)) if logs else 1.0


def most_margin(
    names: Sequence[str], figures: Mapping[str, Figures], ref: Figures, step: float
) -> list[str]:
    """Those of ``names`` with the most margin on the promise (``margin``, counted in ``step``s:
    closer than a step is a tie), in their given order. Candidates tied on the objective may
    differ on the other quantiles — a P95 tie can hide a P99 one of them pays in the next burst."""
    steps = {n: math.floor(margin(figures[n], ref) / step) for n in names}
    least = min(steps.values(), default=0)
    return [n for n in names if steps[n] == least]

"""What-if before apply, verify after (``tailpilot set --preview``, ``tailpilot verify``).

    p = predict(store, "prod", "a100-0", current, proposed, minutes=10)
    print(format_prediction(p))    # "P95 TTFT −62% (±9% on this replica)" ...

**Predict.** The replica's last ``minutes`` of recorded traffic (the requests the store received
then, as ``tuner.closed_loop.recorded`` turns them into a trace), preceded by ``warmup_s`` of the
traffic before it, is replayed twice with the replica's engine
(``tuner.closed_loop.replica_facts.replica_engine``): under the current and under the proposed
settings, the same requests. The figures are those of the requests that arrived after the warm-up
(so neither run starts from an empty engine), and the change is proposed / current − 1. The band
beside each is the replica's newest fidelity error band (``tuner.closed_loop.fidelity``): how far
the simulator has been off on this replica.

**Verify.** Once ``minutes`` have passed since an applied change, the traffic that actually came
after it is known. It is replayed under the *old* settings (the counterfactual: what would have
happened without the change) with the same warm-up; the realized change is the replica's real
figures over that counterfactual, minus one — a change judged on the traffic that came, not on
before/after windows with different load. It is shown beside the prediction, with the band.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from scheduler.errors import TailpilotError
from scheduler.metrics import Completion
from scheduler.settings import Settings
from sim import traces as tr
from sim.engine import EngineConfig, simulate
from storage.rows import CompletionRow
from tuner.closed_loop.fidelity import Replay, relative_change, summary_of
from tuner.closed_loop.recorded import (
    as_completion,
    engine_arrival_s,
    rows_to_trace,
    store_lag_s,
    with_front_end,
)
from tuner.closed_loop.replica_facts import replica_engine

if TYPE_CHECKING:  # the caller's open store (storage.store costs ~0.4 s to import)
    from storage.store import Store

METRICS = ("ttft_p50", "ttft_p95", "ttft_p99", "ttlt_p50", "ttlt_p99", "throughput_tok_s")
DEFAULT_MINUTES = 10.0
DEFAULT_WARMUP_S = 120.0
LABELS = {
    "ttft_p50": "P50 TTFT",
    "ttft_p95": "P95 TTFT",
    "ttft_p99": "P99 TTFT",
    "ttlt_p50": "P50 TTLT",
    "ttlt_p99": "P99 TTLT",
    "throughput_tok_s": "throughput",
}


class WhatIfError(TailpilotError, ValueError):
    """Nothing to predict or verify on (no recorded traffic, no prediction); says why."""


def _figures(
    completions: Iterable[Completion], ids: set[str], span_s: float
) -> dict[str, float | None]:
    """METRICS of the span's requests (``ids``) among ``completions``."""
    return summary_of([c for c in completions if c.id in ids], span_s, METRICS)


def _band(store: Store, cluster: str, replica: str) -> float | None:
    reports = store.tuner.latest_fidelity(cluster, replica)
    band: float | None = reports[0]["summary"].get("band") if reports else None
    return band


def _traffic(
    store: Store, cluster: str, replica: str, since_ms: int, until_ms: int | None, warmup_s: float
) -> tuple[tr.Trace | None, set[str], float, float, list[CompletionRow]]:
    """(trace, ids of the span's requests, span length in s, the span's start on the trace's
    clock, the stored rows of the trace's requests): the span is the requests that arrived at the
    engine from ``since_ms`` (the store's clock) until ``until_ms`` (None: now); the trace holds
    them, the ``warmup_s`` of arrivals before, and every stored request that arrived after the span
    (they shared the engine with the span's last requests). Arrivals are the engine's; the store's
    clock is mapped onto the engine's by the median lag between a request finishing and the store
    receiving it."""
    slack_ms = int(warmup_s * 1000) + 600_000  # requests that finished well after they arrived
    rows = store.readings.completions(cluster, replica, stored_since_ms=since_ms - slack_ms)
    if not rows:
        return None, set(), 0.0, 0.0, []
    lag = store_lag_s(store, cluster, replica, rows)
    lo = since_ms / 1000.0 + lag
    hi = math.inf if until_ms is None else until_ms / 1000.0 + lag
    kept = [r for r in rows if lo - warmup_s <= r.arrival_s]
    span_ids = {r.request_id for r in kept if lo <= r.arrival_s < hi}
    if not span_ids:
        return None, set(), 0.0, 0.0, []
    trace = rows_to_trace(kept, f"{replica}@{since_ms}")
    t0 = min(engine_arrival_s(r) for r in kept)  # the trace's origin
    span_s = min(hi, max(r.arrival_s for r in kept)) - lo
    return trace, span_ids, max(span_s, 1.0), lo - t0, kept


def _run(
    trace: tr.Trace,
    rows: Sequence[CompletionRow],
    settings: Settings,
    config: EngineConfig,
    limits: dict[str, Any],
    switch: tuple[float, Settings] | None = None,
) -> list[Completion]:
    """The trace's completions under ``settings`` (switching to ``switch[1]`` at ``switch[0]`` s),
    with the replica's engine limits, each with its recorded front-end hop (``rows``) added back."""

    def with_limits(s: Settings) -> Settings:
        doc = s.to_dict()
        doc["engine"] = {**doc["engine"], **limits}
        return Settings.model_validate(doc)

    if switch is None:
        done = simulate(trace, with_limits(settings), config).completions
    else:
        done = (
            Replay(trace, with_limits(settings), config, [(switch[0], with_limits(switch[1]))])
            .run()
            .completions
        )
    return with_front_end(done, rows)


def predict(
    store: Store,
    cluster: str,
    replica: str,
    current: Settings,
    proposed: Settings,
    *,
    now_ms: int,
    minutes: float = DEFAULT_MINUTES,
    warmup_s: float = DEFAULT_WARMUP_S,
    engine_facts: dict[str, Any] | None = None,
    step_model: str | None = None,
) -> dict[str, Any]:
    """The predicted change of ``proposed`` over ``current`` on the replica's last ``minutes``."""
    since = now_ms - int(minutes * 60_000)
    trace, ids, span_s, _, rows = _traffic(store, cluster, replica, since, now_ms, warmup_s)
    if trace is None or not ids:
        raise WhatIfError(
            f"replica {replica!r}: no traffic recorded in the last {minutes:g} min to predict on "
            "(record the cluster: tailpilot record / the TUI with --db)"
        )
    config, limits = replica_engine(store, cluster, replica, engine_facts, step_model)
    cur = _figures(_run(trace, rows, current, config, limits), ids, span_s)
    new = _figures(_run(trace, rows, proposed, config, limits), ids, span_s)
    return {
        "replica": replica,
        "cluster": cluster,
        "t_ms": now_ms,
        "minutes": minutes,
        "warmup_s": warmup_s,
        "requests": len(ids),
        "step_model": config.step_model.name,
        "band": _band(store, cluster, replica),
        "current": current.to_dict(),
        "proposed": proposed.to_dict(),
        "metrics": {
            k: {"current": cur[k], "proposed": new[k], "change": relative_change(new[k], cur[k])}
            for k in METRICS
        },
    }


def verify(
    store: Store,
    prediction: dict[str, Any],
    *,
    now_ms: int,
    engine_facts: dict[str, Any] | None = None,
    step_model: str | None = None,
) -> dict[str, Any]:
    """Realized vs predicted for one stored prediction (``TunerResults.predictions``' dict);
    ``ready`` False until ``minutes`` have passed since the change."""
    cluster, replica = prediction["cluster"], prediction["replica"]
    summary = prediction["summary"]
    applied_ms = prediction["t_ms"]
    minutes = summary["minutes"]
    out: dict[str, Any] = {
        "id": prediction["id"],
        "replica": replica,
        "applied_ms": applied_ms,
        "minutes": minutes,
        "predicted": {k: v["change"] for k, v in summary["metrics"].items()},
        "band": _band(store, cluster, replica),
    }
    due = applied_ms + int(minutes * 60_000)
    if now_ms < due:
        return {**out, "ready": False, "due_ms": due}
    trace, ids, span_s, change_s, rows = _traffic(
        store, cluster, replica, applied_ms, due, summary["warmup_s"]
    )
    if trace is None or not ids:
        return {**out, "ready": True, "requests": 0, "note": "no traffic came after the change"}
    config, limits = replica_engine(store, cluster, replica, engine_facts, step_model)
    t0 = min(engine_arrival_s(r) for r in rows)  # the trace's origin
    real = _figures([as_completion(r, t0) for r in rows if r.request_id in ids], ids, span_s)
    old = Settings.model_validate(summary["current"])
    new = Settings.model_validate(summary["proposed"])
    counterfactual = _figures(_run(trace, rows, old, config, limits), ids, span_s)
    # The model's own account of what happened: the warm-up under the old settings, the new ones
    # from the change on. Its distance from the real figures is the model's error on this traffic.
    simulated_new = _figures(
        _run(trace, rows, old, config, limits, switch=(change_s, new)), ids, span_s
    )
    return {
        **out,
        "ready": True,
        "requests": len(ids),
        "metrics": {
            k: {
                "real": real[k],
                "counterfactual": counterfactual[k],
                "simulated_new": simulated_new[k],
                "realized": relative_change(real[k], counterfactual[k]),
                "predicted": summary["metrics"][k]["change"],
            }
            for k in METRICS
        },
    }


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{v:+.0%}"


def format_prediction(p: dict[str, Any]) -> str:
    """``replica: P95 TTFT −62% (±9% on this replica), ...`` and the figures."""
    band = (
        "fidelity not measured on this replica"
        if p["band"] is None
        else f"±{p['band']:.0%} on this replica"
    )
    lines = [
        f"{p['replica']}: predicted on its last {p['minutes']:g} min ({p['requests']} requests, "
        f"warm {p['warmup_s']:g} s before; step model {p['step_model']}); {band}"
    ]
    for k, m in p["metrics"].items():
        lines.append(
            f"  {LABELS[k]:<11} {_pct(m['change']):>6}   {_num(m['current'])} -> "
            f"{_num(m['proposed'])}"
        )
    return "\n".join(lines)


def format_verification(v: dict[str, Any]) -> str:
    if not v["ready"]:
        return (
            f"{v['replica']}: change {v['id']} not ready to verify "
            f"(its {v['minutes']:g} min end later)"
        )
    if not v.get("requests"):
        return f"{v['replica']}: change {v['id']}: {v.get('note', 'no traffic')}"
    band = "" if v["band"] is None else f" (±{v['band']:.0%} on this replica)"
    lines = [
        f"{v['replica']}: change {v['id']}, {v['requests']} requests in the {v['minutes']:g} min "
        f"after it{band}",
        f"  {'':<11} {'predicted':>9} {'realized':>9}   real vs counterfactual (old settings, same "
        "traffic)",
    ]
    for k, m in v["metrics"].items():
        lines.append(
            f"  {LABELS[k]:<11} {_pct(m['predicted']):>9} {_pct(m['realized']):>9}   "
            f"{_num(m['real'])} vs {_num(m['counterfactual'])}"
        )
    return "\n".join(lines)


def _num(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.3g}"

"""How faithfully does the simulator replay *this* replica? (``tailpilot fidelity``)

    report = fidelity(store, cluster="prod", replica="a100-0", recording="peak")
    report["overall"]["errors"]["ttft_p99"]     # sim / real − 1 over the span

A recorded span of one replica (``tuner.closed_loop.recorded``: the engine core's arrivals and
lengths) is replayed through the simulator with the settings that were in force (the collector's
record of every settings version the replica ran, ``settings_seen``; a change inside the span is
applied at the time it was first seen) and the replica's engine: its calibrated step-time model
(``calibrated/<replica>`` when saved, else the one named) and its block size, KV blocks and limits
(read from the replica when it answers, else from the settings document and the stored samples).
Then, per window of arrivals and over the span, the simulated and the real requests — the same
requests, matched by id — are compared, each simulated request with its recorded front-end hop
(API server to engine core, which no scheduler changes) added back, as the real figures have it:

* P50/P99 TTFT and TTLT, throughput (output tokens/s of the requests finishing in the window) and
  preemptions, each as sim, real and the error sim / real − 1;
* the decision diff (seed 003 §9 item 10): how differently the two ordered the same requests —
  Spearman's and Kendall's rank correlation of first-token times, how many requests a later
  arrival overtook (first token before theirs) in each, and how many requests were preempted a
  different number of times;
* the windows where they diverge most (largest |error| of P99 TTFT or TTLT, lowest rank
  correlation).

The error band (``band``: the largest |error| of the P50/P99 latencies over the span) is what the
TUI and ``set --preview`` show next to a prediction for this replica.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from scheduler.errors import TailpilotError
from scheduler.metrics import Completion, summarize
from scheduler.settings import Settings
from scheduler.settings_change import SettingsChange
from sim import traces as tr
from sim.engine import EngineConfig, Simulator
from tuner.closed_loop.recorded import (
    DB_ENV,
    RecordedSpan,
    engine_arrival_s,
    load_recorded,
    store_lag_s,
    with_front_end,
)
from tuner.closed_loop.replica_facts import replica_engine

if TYPE_CHECKING:  # the caller's open store (storage.store costs ~0.4 s to import)
    from storage.store import Store

LATENCIES = ("ttft_p50", "ttft_p99", "ttlt_p50", "ttlt_p99")
FIGURES = (*LATENCIES, "throughput_tok_s", "preemptions")
DEFAULT_WINDOW_S = 60.0
MIN_WINDOW_REQUESTS = 5  # a window with fewer real requests is reported but not ranked

#: One request as the report compares it: (arrival, first token or None, finish, output tokens,
#: preemptions), times relative to one origin.
FigureRow = tuple[float, float | None, float, int, int]


class FidelityError(TailpilotError, ValueError):
    """The span cannot be replayed (no settings recorded, no requests, ...); the message says
    why."""


def relative_change(value: float | None, base: float | None) -> float | None:
    """value / base − 1 (None where either is missing or base is 0)."""
    if value is None or base is None or base == 0:
        return None
    return value / base - 1.0


def summary_of(
    completions: Iterable[Completion], span_s: float, keys: Sequence[str]
) -> dict[str, float | None]:
    """``keys`` of ``scheduler.metrics.summarize`` over ``span_s`` seconds (> 0), None where
    undefined (no request)."""
    s = summarize(completions, duration_s=span_s)
    return {k: s[k] if math.isfinite(s[k]) else None for k in keys}


def figures(rows: Sequence[FigureRow], span_s: float) -> dict[str, float | None]:
    """P50/P99 TTFT and TTLT, throughput and preemptions of (arrival, first token, finish,
    output tokens, preemptions) rows, times relative to one origin; ``span_s`` the window length."""
    done = [
        Completion(
            id=str(i),
            tenant="",
            type="",
            arrival=a,
            scheduled_at=math.nan,
            first_token_at=math.nan if f is None else f,
            finished_at=e,
            prompt_tokens=0,
            output_tokens=n,
            preemptions=p,
        )
        for i, (a, f, e, n, p) in enumerate(rows)
    ]
    return summary_of(done, span_s, FIGURES)


def compare(
    real: dict[str, float | None], sim: dict[str, float | None]
) -> dict[str, dict[str, float | None]]:
    return {
        "real": real,
        "sim": sim,
        "errors": {k: relative_change(sim[k], real[k]) for k in FIGURES},
    }


def decision_diff(
    real_first: np.ndarray,
    sim_first: np.ndarray,
    arrivals: np.ndarray,
    real_pre: np.ndarray,
    sim_pre: np.ndarray,
) -> dict[str, Any]:
    """How differently two runs ordered the same requests (first-token times, preemptions)."""
    # start-up cost: scipy.stats adds ~0.4 s to importing this module (python -X importtime),
    # which tuner.closed_loop.whatif (the autopilot, set --preview) imports for its replay helpers.
    from scipy import stats

    n = len(arrivals)
    out: dict[str, Any] = {"requests": int(n)}
    if n >= 3 and np.ptp(real_first) > 0 and np.ptp(sim_first) > 0:
        out["spearman"] = float(stats.spearmanr(real_first, sim_first).statistic)
        out["kendall"] = float(stats.kendalltau(real_first, sim_first).statistic)
    else:
        out["spearman"] = out["kendall"] = None
    out["overtaken_real"] = _overtaken(arrivals, real_first)
    out["overtaken_sim"] = _overtaken(arrivals, sim_first)
    out["preemptions_per_request_real"] = float(real_pre.mean()) if n else None
    out["preemptions_per_request_sim"] = float(sim_pre.mean()) if n else None
    out["preemptions_differ"] = int(np.count_nonzero(real_pre != sim_pre))
    return out


def _overtaken(arrivals: np.ndarray, first: np.ndarray) -> int:
    """Requests whose first token came after that of some later arrival."""
    order = np.argsort(arrivals, kind="stable")
    later_min = np.minimum.accumulate(first[order][::-1])[::-1]  # earliest first token from here on
    # request i (in arrival order) is overtaken if a later one got its first token earlier
    return int(np.count_nonzero(first[order][:-1] > later_min[1:])) if len(order) > 1 else 0


# --------------------------------------------------------------------------------------------
# the settings and the engine of the span
# --------------------------------------------------------------------------------------------


def settings_timeline(
    seen: Sequence[dict[str, Any]], start_ms: int | None
) -> list[tuple[int | None, Settings]]:
    """[(t_ms, settings)] in force from ``start_ms`` on: the last document seen at or before it
    (t None), then every later one. FidelityError when none was seen."""
    docs = sorted(seen, key=lambda r: r["t_ms"])
    if start_ms is None:  # everything stored: from the first document seen
        start_ms = docs[0]["t_ms"] if docs else 0
    before = [r for r in docs if r["t_ms"] <= start_ms]
    after = [r for r in docs if r["t_ms"] > start_ms]
    first = before[-1] if before else (after.pop(0) if after else None)
    if first is None:
        raise FidelityError(
            "no settings document of this replica was recorded (the collector stores "
            "each version it sees): nothing says what the replica ran"
        )
    out: list[tuple[int | None, Settings]] = [(None, Settings.model_validate(first["settings"]))]
    out += [(r["t_ms"], Settings.model_validate(r["settings"])) for r in after]
    return out


class Replay(Simulator):
    """A replay that switches settings at given simulated times (a change recorded in the span)."""

    def __init__(
        self,
        trace: tr.Trace | Sequence[tr.TraceRequest],
        settings: Settings,
        config: EngineConfig | None,
        changes: list[tuple[float, Settings]],
    ) -> None:
        super().__init__(trace, settings, config)
        self._changes = sorted(changes, key=lambda c: c[0])

    def _step(self) -> None:
        while self._changes and self.now >= self._changes[0][0]:
            self.apply_settings(self._changes.pop(0)[1])
        super()._step()


# --------------------------------------------------------------------------------------------
# the report
# --------------------------------------------------------------------------------------------


def fidelity(
    store: Store,
    *,
    cluster: str | None = None,
    replica: str,
    recording: str | None = None,
    start_s: float | None = None,
    end_s: float | None = None,
    window_s: float = DEFAULT_WINDOW_S,
    step_model: str | None = None,
    engine_facts: dict[str, Any] | None = None,
    db: str | None = None,
) -> dict[str, Any]:
    """Replay ``replica``'s recorded span and compare (see the module docstring). ``engine_facts``:
    the replica's block size, KV blocks and limits
    (``tuner.closed_loop.replica_facts.fetch_engine_facts``); None reads what the store knows.
    ``db`` is only used to name the span in the report."""
    if not (window_s > 0 and math.isfinite(window_s)):
        raise FidelityError(f"window_s must be a positive number of seconds, got {window_s!r}")
    span = RecordedSpan(
        db=db or os.environ.get(DB_ENV),
        recording=recording,
        cluster=cluster,
        replicas=(replica,),
        start_s=start_s,
        end_s=end_s,
    )
    if cluster is None:
        found = [
            c
            for c in store.recordings.clusters()
            if any(r.name == replica for r in store.recordings.replicas(c))
        ]
        if len(found) != 1:
            raise FidelityError(
                f"replica {replica!r} is in {len(found)} clusters ({', '.join(found) or 'none'}): "
                "name the cluster"
            )
        cluster = found[0]
        span = replace(span, cluster=cluster)
    trace = _load(store, span)
    # The recording's start (store clock) decides which settings were in force at first.
    rec = [r for r in store.recordings.all(cluster) if r.name == recording] if recording else []
    start_ms = rec[-1].started_ms if rec else None
    timeline = settings_timeline(store.settings_log.settings_seen(cluster, replica), start_ms)

    real = {c.request_id: c for c in store.readings.completions(cluster, replica)}
    rows = [real[r.id] for r in trace if r.id in real]
    if not rows:
        raise FidelityError(
            f"replica {replica!r}: no recorded completion matches the span's requests"
        )
    t0 = min(c.arrival_s for c in rows)
    t0_trace = min(engine_arrival_s(c) for c in rows)  # the trace's origin (engine-core arrivals)
    # Settings changes inside the span: at the replica-clock time they were first seen (the
    # collector's clock mapped by the median offset between finish times and the store's clock).
    offset = store_lag_s(store, cluster, replica, rows)
    changes = [
        (t_ms / 1000.0 + offset - t0_trace, s) for t_ms, s in timeline[1:] if t_ms is not None
    ]

    config, limits = replica_engine(store, cluster, replica, engine_facts, step_model)
    model = config.step_model
    # Every document runs with the engine the replica ran: its first document's limits, overlaid
    # by what the replica reported of its engine.
    engine = {**timeline[0][1].engine.model_dump(), **limits}
    on_engine = SettingsChange(engine=engine)
    settings = on_engine.apply(timeline[0][1])
    changes = [(t, on_engine.apply(s)) for t, s in changes]
    sim = Replay(trace, settings, config, changes).run()
    # The front-end hop (API server to engine core) put back, so latencies compare like with like.
    simulated = {c.id: c for c in with_front_end(sim.completions, rows)}
    shift = t0_trace - t0  # the trace's clock onto the real rows' one

    matched = [c for c in rows if c.request_id in simulated]
    real_rows: list[FigureRow] = [
        (
            c.arrival_s - t0,
            None if c.first_token_s is None else c.first_token_s - t0,
            c.finished_s - t0,
            c.output_tokens,
            c.preemptions,
        )
        for c in matched
    ]
    sim_rows: list[FigureRow] = [
        (
            s.arrival + shift,
            s.first_token_at + shift,
            s.finished_at + shift,
            s.output_tokens,
            s.preemptions,
        )
        for s in (simulated[c.request_id] for c in matched)
    ]
    span_s = max(r[0] for r in real_rows) + 1e-9
    windows: list[dict[str, Any]] = []
    n_windows = max(1, math.ceil(span_s / window_s))
    for w in range(n_windows):
        lo, hi = w * window_s, (w + 1) * window_s
        idx = [i for i, r in enumerate(real_rows) if lo <= r[0] < hi]
        if not idx:
            continue
        rw = [real_rows[i] for i in idx]
        sw = [sim_rows[i] for i in idx]
        entry = {
            "start_s": lo,
            "requests": len(idx),
            **compare(figures(rw, window_s), figures(sw, window_s)),
            "decision": _diff([real_rows[i] for i in idx], [sim_rows[i] for i in idx]),
        }
        windows.append(entry)
    whole = span_s if span_s > 0 else 1.0
    errors = compare(figures(real_rows, whole), figures(sim_rows, whole))
    overall: dict[str, Any] = {**errors, "decision": _diff(real_rows, sim_rows)}
    band = max(
        (abs(v) for k, v in errors["errors"].items() if k in LATENCIES and v is not None),
        default=None,
    )
    ranked = sorted(
        (w for w in windows if w["requests"] >= MIN_WINDOW_REQUESTS), key=_divergence, reverse=True
    )
    return {
        "cluster": cluster,
        "replica": replica,
        "span": span.url(),
        "requests": len(matched),
        "unmatched": len(trace) - len(matched),
        "window_s": window_s,
        "settings": [
            {"from_s": None if i == 0 else round(changes[i - 1][0], 3), "policy": s.policy}
            for i, (_, s) in enumerate(timeline)
        ],
        "step_model": model.name,
        "engine": {
            **engine,
            "block_size": config.block_size,
            "num_gpu_blocks": config.num_gpu_blocks,
            "prefix_caching": config.prefix_caching,
        },
        "overall": overall,
        "band": band,
        "windows": windows,
        "divergent_windows": [w["start_s"] for w in ranked[:3]],
    }


def _diff(real_rows: Sequence[FigureRow], sim_rows: Sequence[FigureRow]) -> dict[str, Any]:
    arrivals = np.array([r[0] for r in real_rows], float)
    real_first = np.array([r[1] if r[1] is not None else r[2] for r in real_rows], float)
    sim_first = np.array([s[1] if s[1] is not None else s[2] for s in sim_rows], float)
    return decision_diff(
        real_first,
        sim_first,
        arrivals,
        np.array([r[4] for r in real_rows]),
        np.array([s[4] for s in sim_rows]),
    )


def _divergence(window: dict[str, Any]) -> float:
    errors = [
        abs(window["errors"][k])
        for k in ("ttft_p99", "ttlt_p99")
        if window["errors"][k] is not None
    ]
    rho = window["decision"]["spearman"]
    return max(errors, default=0.0) + (0.0 if rho is None else max(0.0, 1.0 - rho))


def _load(store: Store, span: RecordedSpan) -> tr.Trace:
    """The span's trace from an open store (load_recorded opens its own, by URL)."""
    try:
        return load_recorded(span, store=store)
    except tr.TraceError as err:
        raise FidelityError(str(err)) from None


def format_report(report: dict[str, Any]) -> str:
    """The table ``tailpilot fidelity`` prints."""

    def pct(v: float | None) -> str:
        return "   n/a" if v is None else f"{v:+6.1%}"

    def num(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.3g}"

    o = report["overall"]
    d = o["decision"]
    lines = [
        f"fidelity of {report['cluster']}/{report['replica']}: {report['requests']} requests of "
        f"{report['span']}",
        f"  replayed with {', '.join(s['policy'] for s in report['settings'])}, step model "
        f"{report['step_model']}, engine {report['engine']}",
        f"  {'window':>8} {'req':>5} " + " ".join(f"{k:>16}" for k in FIGURES),
    ]
    for w in [*report["windows"], {"start_s": None, "requests": report["requests"], **o}]:
        label = "all" if w["start_s"] is None else f"{w['start_s']:.0f}s"
        cells = [f"{num(w['sim'][k])}/{num(w['real'][k])} {pct(w['errors'][k])}" for k in FIGURES]
        lines.append(f"  {label:>8} {w['requests']:>5} " + " ".join(f"{c:>16}" for c in cells))
    lines.append("  (cells: sim/real error)")
    lines.append(
        f"decision diff: Spearman {num(d['spearman'])}, Kendall {num(d['kendall'])} over "
        f"first-token times; overtaken by a later arrival: {d['overtaken_real']} real, "
        f"{d['overtaken_sim']} sim; preemptions per request "
        f"{num(d['preemptions_per_request_real'])} real, {num(d['preemptions_per_request_sim'])} "
        f"sim ({d['preemptions_differ']} requests differ)"
    )
    if report["divergent_windows"]:
        lines.append(
            "diverging most: " + ", ".join(f"{s:.0f}s" for s in report["divergent_windows"])
        )
    band = report["band"]
    lines.append(
        f"error band on this replica: ±{band:.0%} (largest |error| of P50/P99 TTFT and TTLT)"
        if band is not None
        else "error band: n/a"
    )
    return "\n".join(lines)

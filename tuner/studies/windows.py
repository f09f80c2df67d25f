"""A study's windows: the traces cut into consecutive windows, each replayed after a warm-up of
the arrivals before it (only its own requests measured), the seeded load-stratified held-out
split, a fingerprint of them, and the metrics of one window's replay.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from scheduler.metrics import fairness_summary, summarize
from scheduler.settings import Settings
from sim import traces as tr
from sim.engine import EngineConfig, Simulator
from tuner.closed_loop import recorded
from tuner.studies.spec import DEFAULT_MAX_WINDOWS, StudySpec, TuneError


@dataclass(frozen=True)
class Window:
    index: int  # position in the study's window list (the pruner's step)
    source: str  # trace name
    start_s: float  # start within the transformed trace
    trace: tr.Trace  # the warm-up's arrivals, then the window's
    measured: frozenset[str] = frozenset()  # ids of the window's own requests (the metrics' scope)
    trace_no: int = 0  # which of the study's traces

    def label(self) -> str:
        return f"w{self.index}({self.source}@{self.start_s:g}s, {len(self.measured)} req)"


def build_traces(spec: StudySpec) -> list[tr.Trace]:
    """Load and transform each trace file (in the order of the transforms,
    docs/engine.md#traces)."""
    out = []
    for path in spec.traces:
        try:
            cap = spec.max_tokens_default or tr.DEFAULT_MAX_TOKENS
            trace = recorded.load_any(path, seed=spec.seed, max_tokens_default=cap)
            trace = tr.transform(trace, window=spec.trim)
            if spec.mix and len(trace):
                parts: list[tuple[tr.Trace, float]] = []
                for i, (mpath, frac) in enumerate(spec.mix):
                    part = tr.load_trace(
                        mpath,
                        n=len(trace),
                        rate=trace.rate or 1.0,
                        seed=spec.seed + i,
                        max_tokens_default=cap,
                    )
                    parts.append((part, frac))
                rest = 1.0 - math.fsum(f for _, f in parts)
                trace = tr.mix(
                    [(trace, rest), *parts],
                    seed=spec.seed,
                    name=trace.name + "+" + "+".join(f"{f:g}*{p.name}" for p, f in parts),
                )
            # The rest in the command line's order (after the mix, which scales with the trace).
            trace = tr.transform(
                trace,
                rate_scale=spec.rate_scale,
                rate=spec.target_rate,
                max_tokens_cap=spec.max_tokens_cap,
                tenants=spec.tenants,
                seed=spec.seed,
            )
        except tr.TraceError as err:
            raise TuneError(str(err)) from None
        out.append(trace)
    return out


def build_windows(spec: StudySpec, traces: Sequence[tr.Trace] | None = None) -> list[Window]:
    """Consecutive ``window_s`` windows of every trace; a short last window (under half a window)
    and windows with fewer than ``min_requests`` requests are dropped."""
    windows: list[Window] = []
    w, warm = spec.window_s, spec.warmup_s
    for trace_no, trace in enumerate(traces if traces is not None else build_traces(spec)):
        if not len(trace):
            continue
        end = trace.requests[-1].arrival
        n = int(end // w) + 1
        for k in range(n):
            start = k * w
            if k == n - 1 and end - start < 0.5 * w and n > 1:
                break
            measured = frozenset(r.id for r in trace if start <= r.arrival < start + w)
            if len(measured) < spec.min_requests:
                continue
            begin = max(0.0, start - warm)
            win = tr.time_window(trace, begin, start + w - begin)
            windows.append(Window(len(windows), trace.name, start, win, measured, trace_no))
    return windows


def _stratified(order: Sequence[int], k: int, rng: np.random.Generator) -> list[int]:
    """``k`` of ``order`` (windows sorted by load), one drawn at random from each of ``k``
    consecutive strata, so the pick spans light to heavy windows."""
    edges = np.linspace(0, len(order), k + 1)
    picks = []
    for j in range(k):
        lo, hi = round(edges[j]), round(edges[j + 1])
        picks.append(order[int(rng.integers(lo, max(hi, lo + 1)))])
    return sorted(picks)


def split_windows(
    spec: StudySpec, n: int, load: Sequence[int] | None = None
) -> tuple[list[int], list[int]]:
    """(search, held-out) window indices. The held-out windows are a seeded choice stratified by
    load (prompt + output tokens per window): with windows ranked by load, one is drawn from each of
    ``n_holdout`` consecutive strata, so validation sees light and heavy windows alike. K search
    windows are chosen from the rest the same way (all of them when K is not smaller)."""
    if n < 2:
        raise TuneError(
            f"the trace gives {n} window(s) of {spec.window_s:g} s with >= {spec.min_requests} "
            "requests; need at least 2 (one is held out): lower --window-s or use a longer trace"
        )
    rng = np.random.default_rng([spec.seed, 0x5EED])
    load = list(load) if load is not None else [0] * n
    order = sorted(range(n), key=lambda i: (load[i], i))
    n_hold = min(n - 1, max(1, round(spec.holdout * n)))
    held = _stratified(order, n_hold, rng)
    rest = [i for i in order if i not in set(held)]
    k = min(spec.windows or DEFAULT_MAX_WINDOWS, len(rest))
    search = sorted(rest) if k == len(rest) else _stratified(rest, k, rng)
    return search, held


def window_load(w: Window) -> int:
    """Tokens a window asks for (prompt + output): the load the held-out split is stratified on."""
    return sum(r.prompt_tokens + r.output_tokens for r in w.trace if r.id in w.measured)


def fingerprint(windows: Sequence[Window]) -> str:
    h = hashlib.sha256()
    for w in windows:
        h.update(f"{w.index}|{w.source}|{w.start_s!r}|{len(w.trace)}\n".encode())
        for r in w.trace:
            h.update(
                f"{r.id},{r.arrival!r},{r.prompt_tokens},{r.output_tokens},{r.max_tokens},"
                f"{r.tenant},{r.type}{'' if r.id in w.measured else ',warm-up'}\n".encode()
            )
    return h.hexdigest()


# --------------------------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------------------------


def window_metrics(
    settings: Settings,
    window: Window,
    config: EngineConfig,
    names: Sequence[str],
    slo: Mapping[str, float] | None = None,
) -> dict[str, float]:
    """Replay one window (warm-up first) under ``settings``; the named metrics of the window's own
    requests (NaN when undefined)."""
    result = Simulator(window.trace, settings, config).run()
    # JFI judges who was served by the time the window's arrivals end (what a live collector
    # would have seen then): a request still unfinished counts as waiting demand.
    end = max((r.arrival for r in window.trace if r.id in window.measured), default=None)
    return completion_metrics(
        [c for c in result.completions if c.id in window.measured], names, slo, until=end
    )


def completion_metrics(
    completions: Sequence[Any],
    names: Sequence[str],
    slo: Mapping[str, float] | None = None,
    *,
    until: float | None = None,
) -> dict[str, float]:
    """The named metrics of ``completions`` (NaN when undefined). ``until``: the window's end, for
    the fairness figures (``scheduler.metrics.fairness_summary``)."""
    summary = summarize(completions, slo=slo or None)
    if any(n in ("jain_index", "jain_index_seed") for n in names):
        summary.update(fairness_summary(completions, until=until))
    return {n: float(summary.get(n, math.nan)) for n in names}


def nanmean(values: Sequence[float]) -> float:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return math.fsum(finite) / len(finite) if finite else math.nan


def worst(direction: str) -> float:
    return math.inf if direction == "minimize" else -math.inf

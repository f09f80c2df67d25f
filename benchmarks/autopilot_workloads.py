"""Workloads the autopilot is scored on and never tuned on (issue 22), built from traces/ files.

* ``shift``: a change of shape mid-trace, three phases back to back in time: chat (Azure conv
  lengths), long prompts (arXiv summarisation lengths), reasoning (ServeGen DeepSeek-R1 lengths).
  Each phase has Gamma arrivals (CV ``SHIFT_CV``) and its own load at its own knee (seed_claims'
  ``near_saturation``, measured on the phase alone), and lasts ``phase_s`` seconds (20 minutes by
  default); the next phase's first request arrives one mean gap after the last one of the phase
  before, so the engine never idles between phases.
* ``diurnal``: a day compressed: Azure conv's own requests (arrivals and lengths, in order) with
  time warped so the load follows ``low + (high - low) * sin^2(pi t / T)`` times the knee of the
  same requests at a steady rate — from 0.4 of the knee up to 1.05 at the middle and back, over
  ``period_s`` (60 minutes). The warp keeps the trace's own burstiness (gaps scale with the local
  rate).
* ``sharegpt``: ShareGPT lengths (etalon's 8k-filtered sample: long multi-turn prompts, medium
  outputs) with Gamma arrivals of CV 2, near saturation, ``duration_s`` (60 minutes).
* ``overload`` (issue 32): sustained overload — Azure conv requests, ten minutes at the knee, then
  twenty minutes of arrivals at ``OVERLOAD_FACTOR`` × the replica's capacity, then none: the queue
  drains for long after the last arrival.
* ``bursts`` (issue 32): transient overload — ShareGPT lengths, six ten-minute periods each of
  eight minutes at 0.6 × capacity and a two-minute burst at ``BURST_FACTOR`` × capacity.
* ``tenants`` (issue 32): three tenants (Zipf, Azure conv at its recorded rate) with declared
  per-tenant multi-quantile SLOs (``TENANT_SLOS``): the promise is theirs (SCR, then JFI).
* ``heldout``: the trace nobody tuned the controller on — added before any tuning of it and run
  once, after its design was frozen. arXiv summarisation lengths (long prompts, short outputs)
  with bursty Gamma-renewal arrivals (CV ``HELDOUT_CV``), near saturation, ``duration_s`` (60
  minutes), from a seed offset (``HELDOUT_SEED``) no other workload uses.

Every builder is deterministic for its ``seed``. "Near saturation" is seed_claims' definition:
the load at which vLLM's default scheduler's P95 TTFT is ``knee`` times its light-load value.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

# Run as a script: the repository root goes on sys.path before the project's imports (E402).
REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.seed_claims import KNEE, capacity, near_saturation  # noqa: E402
from scheduler.settings import SloFqParams  # noqa: E402
from sim import traces  # noqa: E402

NEW_WORKLOADS = (
    "shift",
    "diurnal",
    "sharegpt",
    "heldout",
    "heldout2",
    "overload",
    "bursts",
    "tenants",
)
OVERLOAD_FACTOR = 1.5  # sustained overload: arrivals at this multiple of the replica's capacity
BURST_FACTOR = 2.5  # transient overload: each burst at this multiple of capacity
# The multi-tenant workload's declared SLOs (seed 003's per-tenant, per-quantile targets; the
# governance block's format): an interactive tenant, a standard one, a batch one.
TENANT_SLOS: dict[str, dict[str, object]] = {
    "t0": {"weight": 2.0, "ttft": {"p50": 1.0, "p99": 10.0}},
    "t1": {"weight": 1.0, "ttft": {"p50": 0.5, "p90": 2.0, "p99": 5.0}},
    "t2": {"weight": 1.0, "ttlt": {"p99": 120.0}},
}
SHIFT_CV = 1.5  # Gamma arrivals' coefficient of variation in every shift phase
SHAREGPT_CV = 2.0
HELDOUT_CV = 3.0
HELDOUT_SEED = 9_173  # added to the workload seed: a draw no other workload (or tuning) uses
HELDOUT2_CV = 2.5
HELDOUT2_SEED = 31_337  # heldout2's own draw
PILOT_REQUESTS = 1000  # requests of the burst replay that sizes a phase before its knee is found


@dataclasses.dataclass(frozen=True)
class Sources:
    """The files the new workloads draw from (traces/ in the repository by default)."""

    conv: Path
    arxiv: Path
    sharegpt: Path
    reasoning_pmf: Path

    @classmethod
    def under(cls, root: Path) -> Sources:
        return cls(
            conv=root / "azure2023" / "AzureLLMInferenceTrace_conv.csv",
            arxiv=root
            / "lengths_only"
            / "arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv",
            sharegpt=root / "lengths_only" / "sharegpt_8k_filtered_stats_llama2_tokenizer.csv",
            reasoning_pmf=root / "servegen_derived" / "servegen_deepseek_r1_length_pmf.csv",
        )


@dataclasses.dataclass(frozen=True)
class Phase:
    """One stretch of a built workload: which requests (id prefix), when, at what load."""

    name: str
    start_s: float
    end_s: float  # last arrival of the phase
    requests: int
    load: float  # utilisation of the phase's own mix (near_saturation's load)


# --------------------------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------------------------


def resample(source: traces.Trace, n: int, *, cv: float, seed: int, prefix: str) -> traces.Trace:
    """``n`` requests with ``source``'s (prompt, output, cap, tenant, type) rows drawn in a seeded
    random order without replacement (reshuffled when exhausted) and Gamma arrivals of mean rate 1
    and coefficient of variation ``cv``; ids ``<prefix>-NNNNNN``."""
    if not len(source):
        raise ValueError(f"resample: source trace {source.name!r} has no requests")
    rng = np.random.default_rng(seed)
    rounds = -(-n // len(source))
    picks = np.concatenate([rng.permutation(len(source)) for _ in range(rounds)])[:n]
    arrivals = traces.generate_arrivals(n, rate=1.0, process="gamma", cv=cv, seed=rng)
    width = max(6, len(str(n - 1)))
    rows = source.requests
    return traces.Trace(
        f"{prefix}({source.name})",
        tuple(
            dataclasses.replace(rows[k], id=f"{prefix}-{j:0{width}d}", arrival=float(a))
            for j, (k, a) in enumerate(zip(picks.tolist(), arrivals.tolist()))
        ),
    )


def saturated_for(
    make: Callable[[int], traces.Trace], seconds: float, knee: float = KNEE
) -> tuple[traces.Trace, float]:
    """A trace from ``make(n)`` (n requests at mean rate about 1/s) that lasts ``seconds`` at the
    load where sarathi reaches its knee; returns it and that load.

    The knee is found (``near_saturation``) on a trace already about ``seconds`` long, so that the
    queue it measures has the same time to build as the final one; a burst replay of a pilot sizes
    that trace first. The final trace runs at that load of its own capacity."""
    pilot = make(PILOT_REQUESTS)
    guess_n = max(2, math.ceil(0.8 * capacity(pilot) * seconds))
    scaled, load = near_saturation(make(guess_n), knee)
    n = max(2, math.ceil(scaled.rate * seconds))
    for _ in range(10):
        final = make(n)
        rate = load * capacity(final)
        if n / rate >= seconds:  # scaled to ``rate`` it lasts n / rate
            return traces.scale_rate(final, rate / final.rate), load
        n = math.ceil(rate * seconds)  # its own capacity came out higher: a few more requests
    raise RuntimeError(f"saturated_for: could not size a {seconds:g} s trace at load {load:.2f}")


def concatenate(parts: list[traces.Trace], name: str) -> traces.Trace:
    """The parts one after the other in time: each part's first request arrives one mean gap of
    that part after the previous part's last request (no idle stretch between them)."""
    requests: list[traces.TraceRequest] = []
    offset = 0.0
    for k, part in enumerate(parts):
        if k:
            offset = requests[-1].arrival + 1.0 / part.rate
        requests += [dataclasses.replace(r, arrival=r.arrival + offset) for r in part]
    return traces.Trace(name, tuple(requests))


def back_to_back(
    makers: list[tuple[str, Callable[[int], traces.Trace]]],
    phase_s: float,
    knee: float,
    name: str,
) -> tuple[traces.Trace, list[Phase]]:
    """A shape shift: each ``(phase, make)`` sized to ``phase_s`` at its own knee
    (``saturated_for``), the phases one after the other (``concatenate``)."""
    parts, loads = [], {}
    for phase, make in makers:
        part, loads[phase] = saturated_for(make, phase_s, knee)
        parts.append(part)
    trace = concatenate(parts, name)
    return trace, phases_of(trace, loads)


def describe_phases(phases: list[Phase]) -> str:
    """A shape shift's one-line description: its phases, when, at what load."""
    how = "; ".join(
        f"{p.name} {p.start_s / 60:.0f}-{p.end_s / 60:.0f} min load {p.load:.2f}" for p in phases
    )
    return f"Gamma CV {SHIFT_CV:g} arrivals, each phase at its knee: {how}"


def phase_of(request_id: str) -> str:
    """A built workload's phase of a request: its id's prefix (``chat-17`` is in ``chat``)."""
    return request_id.rsplit("-", 1)[0]


def phases_of(trace: traces.Trace, loads: dict[str, float]) -> list[Phase]:
    """The phases of a concatenated trace, by id prefix (in time order)."""
    spans: dict[str, list[float]] = {}
    for r in trace:
        spans.setdefault(phase_of(r.id), []).append(r.arrival)
    return [
        Phase(p, min(a), max(a), len(a), loads.get(p, math.nan))
        for p, a in sorted(spans.items(), key=lambda kv: min(kv[1]))
    ]


def load_curve(t: np.ndarray, period_s: float, low: float, high: float) -> np.ndarray:
    """The diurnal load, as a fraction of the knee: ``low`` at 0 and at ``period_s``, ``high`` in
    the middle, smooth (``sin^2``) in between."""
    return low + (high - low) * np.sin(np.pi * t / period_s) ** 2


def curve_integral(t: np.ndarray, period_s: float, low: float, high: float) -> np.ndarray:
    """∫0^t ``load_curve``: the expected arrivals by ``t`` per unit of the knee's rate."""
    # ∫0^t sin^2(pi u / T) du = t/2 - T sin(2 pi t / T) / (4 pi)
    return low * t + (high - low) * (
        t / 2 - period_s * np.sin(2 * np.pi * t / period_s) / (4 * np.pi)
    )


# --------------------------------------------------------------------------------------------
# The workloads
# --------------------------------------------------------------------------------------------


def build_shift(
    sources: Sources,
    *,
    phase_s: float = 1200.0,
    seed: int = 0,
    knee: float = KNEE,
    cv: float = SHIFT_CV,
) -> tuple[traces.Trace, list[Phase]]:
    """chat → long prompts → reasoning, ``phase_s`` seconds each, each phase at its own knee."""
    conv = traces.load_trace(sources.conv)
    arxiv = traces.load_lengths(sources.arxiv, rate=1.0)

    def reasoning(n: int) -> traces.Trace:
        return traces.load_servegen_reasoning(
            sources.reasoning_pmf,
            n=n,
            rate=1.0,
            process="gamma",
            cv=cv,
            seed=seed + 3,
            prefix="reasoning",
        )

    makers: list[tuple[str, Callable[[int], traces.Trace]]] = [
        ("chat", lambda n: resample(conv, n, cv=cv, seed=seed + 1, prefix="chat")),
        ("longprompt", lambda n: resample(arxiv, n, cv=cv, seed=seed + 2, prefix="longprompt")),
        ("reasoning", reasoning),
    ]
    return back_to_back(makers, phase_s, knee, "shift(chat>longprompt>reasoning)")


def build_diurnal(
    sources: Sources,
    *,
    period_s: float = 3600.0,
    low: float = 0.4,
    high: float = 1.05,
    knee: float = KNEE,
) -> tuple[traces.Trace, float]:
    """Azure conv's requests in order, time-warped so the load follows ``load_curve`` (a fraction
    of the knee of the same requests at a steady rate) over ``period_s``; returns the trace and
    the knee's load. Deterministic (no random draw)."""
    conv = traces.load_trace(sources.conv)
    # The knee of the steady trace, measured on about as many requests as the day will hold.
    mean_level = low + (high - low) / 2
    head = conv.requests[: max(2, min(len(conv), math.ceil(conv.rate * period_s * mean_level)))]
    steady = traces.Trace(conv.name, head)
    scaled, knee_load = near_saturation(steady, knee)
    knee_rate = scaled.rate  # requests/s at the knee
    n = math.floor(knee_rate * float(curve_integral(np.array(period_s), period_s, low, high)))
    if n > len(conv):
        raise ValueError(
            f"diurnal: the day needs {n} requests but {sources.conv} has {len(conv)}; "
            "shorten period_s"
        )
    source = conv.requests[:n]
    # Operational time: the source's arrivals stretched onto [0, Λ(T)], Λ the expected count;
    # the arrival at operational time s happens at Λ^-1(s).
    span = source[-1].arrival or 1.0
    grid = np.linspace(0.0, period_s, 200_001)
    expected = knee_rate * curve_integral(grid, period_s, low, high)
    operational = np.array([r.arrival for r in source]) * (expected[-1] / span)
    times = np.interp(operational, expected, grid)
    requests = tuple(dataclasses.replace(r, arrival=float(t)) for r, t in zip(source, times))
    return traces.Trace(f"diurnal({conv.name})", requests), knee_load


def build_sharegpt(
    sources: Sources,
    *,
    duration_s: float = 3600.0,
    seed: int = 0,
    knee: float = KNEE,
    cv: float = SHAREGPT_CV,
) -> tuple[traces.Trace, float]:
    """ShareGPT lengths with Gamma arrivals (CV ``cv``) near saturation, ``duration_s`` long."""
    lengths = traces.load_lengths(sources.sharegpt, rate=1.0)
    return saturated_for(
        lambda n: resample(lengths, n, cv=cv, seed=seed + 4, prefix="sharegpt"), duration_s, knee
    )


def build_heldout(
    sources: Sources,
    *,
    duration_s: float = 3600.0,
    seed: int = 0,
    knee: float = KNEE,
    cv: float = HELDOUT_CV,
) -> tuple[traces.Trace, float]:
    """arXiv summarisation lengths with bursty Gamma arrivals (CV ``cv``) near saturation,
    ``duration_s`` long: the held-out trace (never used to tune the controller)."""
    lengths = traces.load_lengths(sources.arxiv, rate=1.0)
    return saturated_for(
        lambda n: resample(lengths, n, cv=cv, seed=seed + HELDOUT_SEED, prefix="heldout"),
        duration_s,
        knee,
    )


def build_heldout2(
    sources: Sources,
    *,
    duration_s: float = 3600.0,
    seed: int = 0,
    knee: float = KNEE,
    cv: float = HELDOUT2_CV,
) -> tuple[traces.Trace, float]:
    """The second held-out trace, built after ``prefer_small`` was turned off on ``heldout``'s
    evidence (so ``heldout`` is no longer unseen): half arXiv summarisation lengths, half Azure
    conv requests, drawn together with bursty Gamma arrivals (CV ``cv``) near saturation."""
    arxiv = traces.load_lengths(sources.arxiv, rate=1.0)
    conv = traces.load_trace(sources.conv)
    n = min(len(arxiv), len(conv))
    mixed = traces.Trace("arxiv+conv", tuple(arxiv.requests[:n]) + tuple(conv.requests[:n]))
    return saturated_for(
        lambda m: resample(mixed, m, cv=cv, seed=seed + HELDOUT2_SEED, prefix="heldout2"),
        duration_s,
        knee,
    )


def at_capacity_multiple(
    make: Callable[[int], traces.Trace], factor: float, seconds: float
) -> traces.Trace:
    """``seconds`` of ``make``'s requests arriving at ``factor`` × their own capacity."""
    rate = factor * capacity(make(PILOT_REQUESTS))
    part = make(max(2, math.ceil(rate * seconds)))
    return traces.scale_rate(part, rate / part.rate)


def build_overload(
    sources: Sources,
    *,
    seed: int = 0,
    knee: float = KNEE,
    lead_s: float = 600.0,
    over_s: float = 1200.0,
    factor: float = OVERLOAD_FACTOR,
) -> tuple[traces.Trace, float]:
    """Azure conv: ``lead_s`` at the knee, then ``over_s`` at ``factor`` × capacity."""
    conv = traces.load_trace(sources.conv)
    lead, load = saturated_for(
        lambda n: resample(conv, n, cv=SHIFT_CV, seed=seed + 5, prefix="lead"), lead_s, knee
    )
    over = at_capacity_multiple(
        lambda n: resample(conv, n, cv=SHIFT_CV, seed=seed + 6, prefix="over"), factor, over_s
    )
    return concatenate([lead, over], f"overload(conv, x{factor:g} capacity)"), load


def build_bursts(
    sources: Sources,
    *,
    seed: int = 0,
    periods: int = 6,
    base_s: float = 480.0,
    burst_s: float = 120.0,
    factor: float = BURST_FACTOR,
) -> traces.Trace:
    """ShareGPT lengths: ``periods`` × (``base_s`` at 0.6 × capacity, ``burst_s`` at ``factor``)."""
    lengths = traces.load_lengths(sources.sharegpt, rate=1.0)
    parts = []
    for k in range(periods):
        for tag, level, span in (("base", 0.6, base_s), ("burst", factor, burst_s)):
            prefix = f"{tag}{k}"
            parts.append(
                at_capacity_multiple(
                    lambda n, p=prefix, d=seed + 7 + 2 * k + (tag == "burst"): resample(
                        lengths, n, cv=1.0, seed=d, prefix=p
                    ),
                    level,
                    span,
                )
            )
    return concatenate(parts, f"bursts(sharegpt, x{factor:g} capacity)")


def slos_of(workload: str) -> SloFqParams | None:
    """The SLOs a workload declares (the autopilot's promise is then theirs), or None."""
    return tenant_slos() if workload == "tenants" else None


def tenant_slos() -> SloFqParams:
    """The ``tenants`` workload's declared SLOs, as the governance block's parameters."""
    return SloFqParams.model_validate({"tenants": TENANT_SLOS})


def build_tenants(sources: Sources) -> tuple[traces.Trace, str]:
    conv = traces.load_trace(sources.conv)
    return traces.assign_tenants_zipf(conv, 3, seed=11), "Azure conv, 3 Zipf tenants"


def build_new_workload(
    name: str, root: Path, *, seed: int = 0, knee: float = KNEE, scale_s: float = 1.0
) -> tuple[traces.Trace, str]:
    """One of ``NEW_WORKLOADS`` and a one-line description (``scale_s`` shortens every duration,
    for quick looks)."""
    sources = Sources.under(root)
    if name == "shift":
        trace, phases = build_shift(sources, phase_s=1200.0 * scale_s, seed=seed, knee=knee)
        return trace, describe_phases(phases)
    if name == "diurnal":
        trace, knee_load = build_diurnal(sources, period_s=3600.0 * scale_s, knee=knee)
        return (
            trace,
            f"Azure conv time-warped, load 0.40 -> 1.05 -> 0.40 of the knee (load {knee_load:.2f})",
        )
    if name == "sharegpt":
        trace, load = build_sharegpt(sources, duration_s=3600.0 * scale_s, seed=seed, knee=knee)
        return (
            trace,
            f"ShareGPT lengths, Gamma CV {SHAREGPT_CV:g} arrivals, "
            f"load {load:.2f} (near saturation)",
        )
    if name == "heldout":
        trace, load = build_heldout(sources, duration_s=3600.0 * scale_s, seed=seed, knee=knee)
        return trace, (
            f"held out (never tuned on): arXiv lengths, Gamma CV {HELDOUT_CV:g} arrivals, "
            f"load {load:.2f} (near saturation)"
        )
    if name == "heldout2":
        trace, load = build_heldout2(sources, duration_s=3600.0 * scale_s, seed=seed, knee=knee)
        return trace, (
            f"held out, second (never tuned on): half arXiv lengths, half Azure conv, Gamma CV "
            f"{HELDOUT2_CV:g} arrivals, load {load:.2f} (near saturation)"
        )
    if name == "overload":
        trace, load = build_overload(sources, seed=seed, knee=knee, over_s=1200.0 * scale_s)
        return trace, (
            f"sustained overload: Azure conv, 10 min at the knee (load {load:.2f}), then 20 min "
            f"at {OVERLOAD_FACTOR:g}x capacity, then no arrival"
        )
    if name == "bursts":
        trace = build_bursts(sources, seed=seed)
        return trace, (
            f"transient overload: ShareGPT lengths, 8 min at 0.6x capacity then 2 min at "
            f"{BURST_FACTOR:g}x, six times"
        )
    if name == "tenants":
        trace, how = build_tenants(sources)
        return trace, f"{how} with declared SLOs {TENANT_SLOS}"
    raise ValueError(f"unknown workload {name!r}; known: {', '.join(NEW_WORKLOADS)}")

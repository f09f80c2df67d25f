"""Workloads the autopilot has never seen, frozen before they were run.

Built from public traces the project had never used until this file (issue 32: "at least two
workloads you build from public traces the project has never used, frozen (file hash in the
README) before any design decision and run once"):

* ``mooncake``: the Mooncake FAST'25 *conversation* trace (kvcache-ai/Mooncake,
  ``FAST25-release/traces/conversation_trace.jsonl``: one hour of a production chat service,
  real arrival times, long prompts). Requests whose prompt and output do not fit Llama-3-8B's
  8,192-token context are dropped (a vLLM server refuses them with 400), the rest keep their
  recorded arrival times, scaled in time so the load is at the knee (seed_claims'
  ``near_saturation``).
* ``bwb_servegen``: BWB document translation lengths (etalon's sample: decode-heavy, outputs longer
  than prompts) with arrivals that follow the first day of ServeGen's ``m-large`` rate profile
  (144 ten-minute windows, compressed into ``DAY_S``): a Gamma renewal process (CV
  ``BWB_CV``) in operational time, mapped through the profile's cumulative rate, its mean rate at
  the knee of the same lengths at a steady rate — so the day's peaks run above capacity
  (transient overload) and its troughs well below.

* ``shift_heldout``: a second change of shape, built after the change-of-shape watch was designed
  and tuned on ``shift`` (``tuner.autopilot.shape``: its threshold and window chosen there), and
  frozen before it was run: ShareGPT → the Mooncake conversation rows that fit 8,192 tokens →
  BWB translation, 20 minutes each at its own knee (Gamma arrivals, CV ``SHIFT_CV``, seed
  ``SHIFT_HELDOUT_SEED``) — other sources, another order and other prompt-length steps than
  ``shift``'s (chat → arXiv long prompts → reasoning).

All are deterministic (no draw for ``mooncake``; fixed seeds for the others).
``digest`` hashes a built trace (ids, arrivals, lengths, caps) — the figure the README records, so
a later change to a builder shows. Source files and their SHA-256 are in traces/README.md.
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import math
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

# Run as a script: the repository root goes on sys.path before the project's imports (E402).
REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.autopilot_workloads import (  # noqa: E402
    SHIFT_CV,
    Phase,
    back_to_back,
    describe_phases,
    resample,
)
from benchmarks.seed_claims import KNEE, near_saturation  # noqa: E402
from sim import traces  # noqa: E402

FROZEN_WORKLOADS = ("mooncake", "bwb_servegen", "shift_heldout")
CONTEXT_TOKENS = 8_192  # Llama-3-8B's context: a longer request is refused by the server
DAY_S = 3_600.0  # ServeGen's 24 hours compressed into one
BWB_CV = 2.0
BWB_SEED = 52_021  # a draw no other workload uses
PROFILE_MODEL = "m-large"
PROFILE_WINDOWS = 144  # day 1 of the 14
SHIFT_HELDOUT_SEED = 64_109  # shift_heldout's own draw
SHIFT_HELDOUT_PHASE_S = 1_200.0


def mooncake_fitting(root: Path) -> tuple[traces.Trace, int]:
    """The Mooncake conversation rows that fit 8,192 tokens, time 0 at the first, and how many
    rows the trace has."""
    source = traces.load_mooncake(root / "mooncake" / "conversation_trace.jsonl", prefix="mc")
    kept = tuple(r for r in source if r.prompt_tokens + r.output_tokens <= CONTEXT_TOKENS)
    t0 = kept[0].arrival
    fitting = traces.Trace(
        "mooncake-conv(<=8192)",
        tuple(dataclasses.replace(r, arrival=r.arrival - t0) for r in kept),
    )
    return fitting, len(source)


def build_shift_heldout(root: Path, knee: float = KNEE) -> tuple[traces.Trace, list[Phase]]:
    """ShareGPT → Mooncake conversation → BWB translation, ``SHIFT_HELDOUT_PHASE_S`` each, each
    phase at its own knee."""
    sharegpt = traces.load_lengths(
        root / "lengths_only" / "sharegpt_8k_filtered_stats_llama2_tokenizer.csv", rate=1.0
    )
    mooncake, _ = mooncake_fitting(root)
    bwb = traces.load_lengths(
        root / "lengths_only" / "bwb_stats_llama2_tokenizer_filtered_v2.csv", rate=1.0
    )
    sources = (("sharegpt", sharegpt), ("mooncake", mooncake), ("bwb", bwb))

    def maker(k: int, name: str, rows: traces.Trace) -> Callable[[int], traces.Trace]:
        return lambda n: resample(rows, n, cv=SHIFT_CV, seed=SHIFT_HELDOUT_SEED + k, prefix=name)

    makers = [(name, maker(k, name, rows)) for k, (name, rows) in enumerate(sources)]
    return back_to_back(makers, SHIFT_HELDOUT_PHASE_S, knee, "shift_heldout(sharegpt>mooncake>bwb)")


def build_mooncake(root: Path, knee: float = KNEE) -> tuple[traces.Trace, str]:
    fitting, rows = mooncake_fitting(root)
    scaled, load = near_saturation(fitting, knee)
    return scaled, (
        f"Mooncake conversation trace, real arrivals, {len(fitting)} of {rows} requests fit "
        f"8,192 tokens, time-scaled x{scaled.rate / fitting.rate:.3g} to load {load:.2f} "
        "(near saturation)"
    )


def profile_rates(path: Path) -> np.ndarray:
    """Day 1 of ``PROFILE_MODEL``'s 10-minute rates, in window order."""
    with path.open(newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["model"] == PROFILE_MODEL]
    rows.sort(key=lambda r: float(r["window_start_s"]))
    return np.array([float(r["total_rate_rps"]) for r in rows[:PROFILE_WINDOWS]])


def build_bwb_servegen(root: Path, knee: float = KNEE) -> tuple[traces.Trace, str]:
    lengths = traces.load_lengths(
        root / "lengths_only" / "bwb_stats_llama2_tokenizer_filtered_v2.csv", rate=1.0
    )
    # The knee of a steady replay of the same lengths, on about as many requests as the day holds.
    probe = resample(lengths, 4_000, cv=BWB_CV, seed=BWB_SEED, prefix="bwbknee")
    steady, knee_load = near_saturation(probe, knee)
    knee_rate = steady.rate
    rates = profile_rates(root / "servegen_derived" / "servegen_rate_profile_10min.csv")
    shape = rates / rates.mean()  # mean 1: the day's mean rate is the knee's
    width = DAY_S / len(shape)
    cumulative = np.concatenate([[0.0], np.cumsum(shape * width * knee_rate)])
    n = math.floor(cumulative[-1])
    source = resample(lengths, n, cv=BWB_CV, seed=BWB_SEED + 1, prefix="bwb")
    # Operational time: the renewal arrivals stretched onto [0, Λ(T)]; the one at s happens at
    # Λ^-1(s) (Λ piecewise linear: the rate is constant within a window).
    operational = np.array([r.arrival for r in source]) * (
        cumulative[-1] / source.requests[-1].arrival
    )
    edges = np.arange(len(shape) + 1) * width
    times = np.interp(operational, cumulative, edges)
    trace = traces.Trace(
        "bwb+servegen(m-large day 1)",
        tuple(dataclasses.replace(r, arrival=float(t)) for r, t in zip(source, times)),
    )
    return trace, (
        f"BWB translation lengths, arrivals following ServeGen {PROFILE_MODEL}'s day 1 "
        f"(peak/mean {shape.max():.2f}, min/mean {shape.min():.2f}) over {DAY_S / 60:.0f} min, "
        f"Gamma CV {BWB_CV:g}, mean at the knee (load {knee_load:.2f})"
    )


def build_frozen_workload(name: str, root: Path, knee: float = KNEE) -> tuple[traces.Trace, str]:
    if name == "mooncake":
        return build_mooncake(root, knee)
    if name == "bwb_servegen":
        return build_bwb_servegen(root, knee)
    if name == "shift_heldout":
        trace, phases = build_shift_heldout(root, knee)
        return trace, describe_phases(phases)
    raise ValueError(f"unknown workload {name!r}; known: {', '.join(FROZEN_WORKLOADS)}")


def digest(trace: traces.Trace) -> str:
    """SHA-256 of a trace's requests (id, arrival to the microsecond, lengths, cap), in order."""
    h = hashlib.sha256()
    for r in trace:
        h.update(
            f"{r.id},{r.arrival:.6f},{r.prompt_tokens},{r.output_tokens},{r.max_tokens}\n".encode()
        )
    return h.hexdigest()


if __name__ == "__main__":
    for workload in FROZEN_WORKLOADS:
        built, how = build_frozen_workload(workload, REPO / "traces")
        span = built.requests[-1].arrival - built.requests[0].arrival
        print(f"{workload}: {len(built)} requests over {span / 60:.1f} min; {how}")
        print(f"  sha256 {digest(built)}")

"""The autopilot benchmark's workloads (benchmarks/autopilot_workloads.py) and the pieces of its
scoring (benchmarks/autopilot_scoring.py) that decide a column: small sizes, real loaders on the
bundled Azure window, the test fixtures and files written into ``tmp_path``."""

from __future__ import annotations

import csv
import itertools
import math
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import autopilot as bench  # noqa: E402
from benchmarks import autopilot_scoring as scoring  # noqa: E402
from benchmarks import autopilot_workloads as wl  # noqa: E402
from benchmarks.seed_claims import capacity  # noqa: E402
from scheduler.metrics import Completion  # noqa: E402
from sim import traces  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures" / "traces"
PHASE_S = 60.0


def _long_prompts_csv(path: Path, rows: int = 300) -> Path:
    """An arXiv-like length-only file: long prompts, short outputs (distinct pairs, seeded)."""
    rng = np.random.default_rng(5)
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["num_prefill_tokens", "num_decode_tokens"])
        for _ in range(rows):
            w.writerow([int(rng.integers(1500, 6000)), int(rng.integers(20, 300))])
    return path


def _pairs_of(path: Path) -> set[tuple[int, int]]:
    with path.open(newline="") as f:
        return {
            (int(r["num_prefill_tokens"]), int(r["num_decode_tokens"])) for r in csv.DictReader(f)
        }


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> wl.Sources:
    tmp = tmp_path_factory.mktemp("autopilot-sources")
    return wl.Sources(
        conv=traces.bundled_trace_path(),
        arxiv=_long_prompts_csv(tmp / "long.csv"),
        sharegpt=FIXTURES / "sharegpt_lengths_head.csv",
        reasoning_pmf=FIXTURES / "servegen_r1_pmf_small.csv",
    )


@pytest.fixture(scope="module")
def shift(sources) -> tuple[traces.Trace, list[wl.Phase]]:
    return wl.build_shift(sources, phase_s=PHASE_S, seed=3)


def _phase(trace: traces.Trace, name: str) -> list[traces.TraceRequest]:
    return [r for r in trace if r.id.startswith(name + "-")]


def test_shift_runs_chat_then_long_prompts_then_reasoning_back_to_back(shift, sources):
    trace, phases = shift
    assert [p.name for p in phases] == ["chat", "longprompt", "reasoning"]
    assert sum(p.requests for p in phases) == len(trace)
    for p in phases:
        assert p.end_s - p.start_s >= PHASE_S * (1 - 1e-9), p  # each phase lasts its full length
    for before, after in itertools.pairwise(phases):
        gap = after.start_s - before.end_s
        mean_gap = (after.end_s - after.start_s) / (after.requests - 1)
        assert 0 < gap <= 1.01 * mean_gap  # no overlap, and no idle stretch between phases
    conv_pairs = {(r.prompt_tokens, r.output_tokens) for r in traces.load_bundled()}
    assert {(r.prompt_tokens, r.output_tokens) for r in _phase(trace, "chat")} <= conv_pairs
    assert {(r.prompt_tokens, r.output_tokens) for r in _phase(trace, "longprompt")} <= _pairs_of(
        sources.arxiv
    )
    reasoning = _phase(trace, "reasoning")
    assert {r.type for r in reasoning} == {"reasoning"}
    assert {r.prompt_tokens for r in reasoning} <= {16, 256, 4096}
    assert {r.output_tokens for r in reasoning} <= {300, 2000}


def test_shift_loads_each_phase_against_its_own_capacity(shift):
    """Long prompts cost far more per request than chat: one common rate would put the phases at
    very different loads. Each phase's rate over its own capacity is the load its knee gave."""
    trace, phases = shift
    for p in phases:
        part = traces.Trace(p.name, tuple(_phase(trace, p.name)))
        assert 0.3 <= p.load <= 1.2
        assert part.rate / capacity(part) == pytest.approx(p.load, rel=1e-6), p
    rates = [len(_phase(trace, p.name)) / (p.end_s - p.start_s) for p in phases]
    assert rates[0] > 2 * rates[1]  # chat requests are much cheaper than long prompts


def test_shift_is_deterministic_for_a_seed(shift, sources):
    trace, _ = shift
    again, _ = wl.build_shift(sources, phase_s=PHASE_S, seed=3)
    assert again.requests == trace.requests
    other, _ = wl.build_shift(sources, phase_s=PHASE_S, seed=4)
    assert [r.arrival for r in other] != [r.arrival for r in trace]


def test_diurnal_load_rises_and_falls_on_the_source_requests_in_order(sources):
    period = 300.0
    trace, knee_load = wl.build_diurnal(sources, period_s=period)
    assert 0.3 <= knee_load <= 1.2
    source = traces.load_trace(sources.conv).requests[: len(trace)]
    assert [(r.id, r.prompt_tokens, r.output_tokens) for r in trace] == [
        (r.id, r.prompt_tokens, r.output_tokens) for r in source
    ]
    arrivals = trace.arrivals()
    assert arrivals[-1] <= period and arrivals[-1] >= 0.95 * period
    # The warp: a request's share of the day's expected arrivals is its share of the source's span.
    share = wl.curve_integral(arrivals, period, 0.4, 1.05) / wl.curve_integral(
        np.array(period), period, 0.4, 1.05
    )
    assert share == pytest.approx(
        np.array([r.arrival for r in source]) / source[-1].arrival, abs=1e-4
    )
    counts = np.histogram(arrivals, bins=np.linspace(0.0, period, 6))[0]
    assert counts[2] > 2 * counts[0] and counts[2] > 2 * counts[4]  # 1.05 of the knee vs about 0.4


def test_sharegpt_has_gamma_cv2_arrivals_near_saturation(sources):
    trace, load = wl.build_sharegpt(sources, duration_s=300.0, seed=1)
    assert trace.duration >= 300.0 * (1 - 1e-9)
    assert 0.3 <= load <= 1.2
    assert trace.rate / capacity(trace) == pytest.approx(load, rel=1e-6)
    assert {(r.prompt_tokens, r.output_tokens) for r in trace} <= _pairs_of(sources.sharegpt)
    gaps = np.diff(trace.arrivals())
    assert 1.6 < gaps.std() / gaps.mean() < 2.5  # Poisson arrivals would give about 1


def test_heldout_is_bursty_arxiv_near_saturation_from_its_own_draw(sources):
    """The trace nobody tuned on: arXiv lengths, Gamma CV 3 arrivals, near saturation, from a
    seed offset no other workload draws from (its order differs from a plain resample's)."""
    trace, load = wl.build_heldout(sources, duration_s=300.0, seed=1)
    assert trace.duration >= 300.0 * (1 - 1e-9)
    assert 0.3 <= load <= 1.2
    assert trace.rate / capacity(trace) == pytest.approx(load, rel=1e-6)
    assert {(r.prompt_tokens, r.output_tokens) for r in trace} <= _pairs_of(sources.arxiv)
    gaps = np.diff(trace.arrivals())
    assert 2.3 < gaps.std() / gaps.mean() < 3.8
    assert "heldout" in wl.NEW_WORKLOADS and all(r.id.startswith("heldout-") for r in trace)
    plain = wl.resample(
        traces.load_lengths(sources.arxiv, rate=1.0), 50, cv=wl.HELDOUT_CV, seed=1, prefix="heldout"
    )
    assert [r.prompt_tokens for r in plain] != [r.prompt_tokens for r in trace.requests[:50]]
    again, _ = wl.build_heldout(sources, duration_s=300.0, seed=1)
    assert again.requests == trace.requests


def test_resample_draws_every_row_before_repeating_one():
    rows = tuple(traces.TraceRequest(f"s-{k}", float(k), 100 + k, 10 + k, 4096) for k in range(10))
    source = traces.Trace("src", rows)
    out = wl.resample(source, 25, cv=2.0, seed=0, prefix="x")
    picks = [r.prompt_tokens - 100 for r in out]
    assert sorted(picks[:10]) == list(range(10)) and sorted(picks[10:20]) == list(range(10))
    assert len({r.id for r in out}) == 25 and all(r.id.startswith("x-") for r in out)
    assert out.requests == wl.resample(source, 25, cv=2.0, seed=0, prefix="x").requests


# --- the benchmark's scoring --------------------------------------------------------------------


def _m(p95: float, ttlt: float, thr: float, **other: float) -> dict[str, float]:
    base = {"ttft_p50": 1.0, "ttft_p95": p95, "ttft_p99": p95, "ttlt_p50": 10.0}
    return {**base, "ttlt_p99": ttlt, "throughput_tok_s": thr, **other}


def test_hindsight_gamma_is_the_lowest_p95_that_keeps_every_quantile_and_throughput():
    sarathi = _m(10.0, 100.0, 1000.0)
    grid = {
        0.001: _m(1.0, 103.0, 1000.0),  # best P95, but P99 TTLT 1.03x: out
        0.0015: _m(1.0, 100.0, 1000.0, ttft_p50=1.03),  # P50 TTFT 1.03x: out
        0.0018: _m(1.0, 100.0, 1000.0, ttft_p99=10.3),  # P99 TTFT 1.03x: out
        0.0019: _m(1.0, 100.0, 1000.0, ttlt_p50=10.3),  # P50 TTLT 1.03x: out
        0.002: _m(2.0, 101.0, 985.0),  # throughput 0.985x: out
        0.005: _m(3.0, 102.0, 990.0),  # exactly at both bounds: in
        0.01: _m(3.0, 90.0, 1000.0),  # ties on P95: the smaller γ wins
        1.0: _m(9.0, 100.0, 1000.0),
    }
    assert scoring.best_fixed(grid, sarathi) == 0.005
    assert scoring.best_fixed({0.001: grid[0.001]}, sarathi) is None
    assert scoring.closure(0.9, 0.4, 0.2) == pytest.approx(5 / 7)
    assert math.isnan(scoring.closure(0.8, 0.7, 0.8))


def test_second_half_scores_only_requests_arriving_after_the_midpoint():
    trace = traces.Trace(
        "t", tuple(traces.TraceRequest(f"r-{k}", float(k), 10, 5, 4096) for k in range(11))
    )
    assert scoring.half_time(trace) == 5.0
    done = [
        Completion(
            r.id,
            "default",
            "chat",
            r.arrival,
            r.arrival,
            r.arrival + (1.0 if r.arrival < 5 else 9.0),
            r.arrival + 10.0,
            10,
            5,
        )
        for r in trace
    ]
    scores = scoring.score(done, scoring.half_time(trace))
    assert scores["all"]["requests"] == 11 and scores["second"]["requests"] == 6
    assert scores["second"]["ttft_p95"] == pytest.approx(9.0)


def test_the_shift_is_scored_phase_by_phase_and_each_phase_judged_on_its_own_best():
    def done(prefix: str, k: int, ttft: float) -> Completion:
        arrival = float(k)
        return Completion(
            f"{prefix}-{k}",
            "default",
            "chat",
            arrival,
            arrival,
            arrival + ttft,
            arrival + 20.0,
            10,
            5,
        )

    # chat first (a small TTFT), long prompts after (a large one): each phase its own scope.
    completions = [done("chat", k, 1.0) for k in range(10)]
    completions += [done("longprompt", k, 8.0) for k in range(10, 20)]
    scores = scoring.score(completions, 10.0, phases=True)
    assert list(scores) == ["all", "second", "phase:chat", "phase:longprompt"]
    assert scores["phase:chat"]["requests"] == 10
    assert scores["phase:chat"]["ttft_p95"] == pytest.approx(1.0)
    assert scores["phase:longprompt"]["ttft_p95"] == pytest.approx(8.0)
    assert "phase:chat" not in scoring.score(completions, 10.0)

    # The targets: in each phase, within 10% of the best fixed setting that keeps the promise
    # there — here γ 0.1 in chat and γ 1 in long prompts (γ 0.1 breaks P99 there).
    def figures(p95: float, p99: float = 10.0) -> dict[str, float]:
        m = dict.fromkeys(scoring.METRICS, 10.0)
        m.update(ttft_p95=p95, ttft_p99=p99, throughput_tok_s=1000.0)
        return m

    def columns(per_phase: dict[str, dict[str, dict[str, float]]]) -> dict:
        out = {}
        for column in ("sarathi", "defaults", "g=0.1", "g=1", "autopilot"):
            by_scope = {s: figures(5.0) for s in ("all", "second")}
            by_scope.update({s: per_phase[s][column] for s in per_phase})
            out[column] = scoring.JobResult("shift", column, by_scope, 0.0)
        return out

    phases = {
        "phase:chat": {
            "sarathi": figures(5.0),
            "defaults": figures(4.0),
            "g=0.1": figures(2.0),
            "g=1": figures(3.0),
            "autopilot": figures(2.1),
        },
        "phase:longprompt": {
            "sarathi": figures(5.0),
            "defaults": figures(4.0),
            "g=0.1": figures(1.0, 99.0),
            "g=1": figures(3.0),
            "autopilot": figures(3.5),
        },
    }
    summary = scoring.summarise(columns(phases), traces.Trace("t", ()))
    assert summary["phase:chat"]["best_gamma"] == "γ 0.1"
    assert summary["phase:longprompt"]["best_gamma"] == "γ 1"
    verdicts = {name: ok for name, ok, _ in scoring.targets("shift", summary)}
    assert verdicts["chat phase: P95 TTFT <= 1.10x its best fixed"] is True  # 2.1 <= 2.2
    assert verdicts["longprompt phase: P95 TTFT <= 1.10x its best fixed"] is False  # 3.5 > 3.3


def test_first_half_file_replays_the_same_requests(tmp_path):
    rows = (
        traces.TraceRequest("a-1", 0.1 + 0.2, 300, 40, 512, "t1", "reasoning"),
        traces.TraceRequest("a-2", 1 / 3, 20, 4096, 4096, "default", "chat", truncated=True),
    )
    path = tmp_path / "half.csv"
    bench.write_vidur(traces.Trace("t", rows), path)
    back = traces.load_vidur(path)
    assert [
        (r.arrival, r.prompt_tokens, r.output_tokens, r.max_tokens, r.tenant, r.type) for r in back
    ] == [
        (
            r.arrival - rows[0].arrival,
            r.prompt_tokens,
            r.output_tokens,
            r.max_tokens,
            r.tenant,
            r.type,
        )
        for r in rows
    ]

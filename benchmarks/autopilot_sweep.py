"""The autopilot on seeded random traffic nobody tuned it on: does its promise hold?

    python benchmarks/autopilot_sweep.py [--variants N] [--seed S] [--only K] [--traces DIR]
        [--set key=JSON ...] [--defaults-only [--param name=JSON ...]]

Each variant is drawn from ``numpy.random.default_rng([S, K])`` (so ``--only K`` rebuilds variant
K of seed S alone): a source — Azure code or conv requests, ShareGPT, arXiv or BWB lengths,
ServeGen DeepSeek-R1 reasoning lengths, or an even mix of two of these — a load of 0.7–1.4 × the
replica's capacity for that mix (seed_claims' ``capacity``, via the workloads'
``at_capacity_multiple``), Gamma arrivals of CV 1–4, 20–60 minutes of arrivals, and, for some
variants, a step halfway: a new load, or a new source at the same load. Requests are resampled
from the source (``resample``) and replayed whole at vLLM's A100 engine defaults under sarathi,
the defaults (uniboost) and the autopilot (default ``AutopilotConfig``).

One line per variant: the autopilot's ratio to sarathi on TTFT P50/P95/P99, TTLT P50/P99 and
throughput, the defaults' P95 TTFT ratio, whether the promise held — every quantile ≤ 1.02×
sarathi's and throughput ≥ 0.99× (``keeps_promise``), P95 TTFT ≤ the defaults' + 0.02 — and the
autopilot's switches (minute: from > to). A summary of the broken promises ends the run.
Scoring is benchmarks/autopilot_scoring.py's, on the whole run. One process; about 20 minutes
for the default 100 variants on one core (about 11 s a variant; ``-v``: each switch's reason;
``--set``: an ``AutopilotConfig`` field for the autopilot's runs, as ``autopilot_dev.py`` takes it —
an A/B of a rule in one sitting; ``--defaults-only``: no autopilot, the defaults run in its place
with ``--param``'s uniboost parameters changed — how the defaults' own rules are checked on
traffic nobody tuned on, README "γ-Ada's floor").
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

# Run as a script: the repository root goes on sys.path before the project's imports (E402).
REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.autopilot_scoring import (  # noqa: E402
    METRICS,
    NEVER_WORSE,
    PROMISE,
    half_time,
    keeps_promise,
    score,
)
from benchmarks.autopilot_workloads import (  # noqa: E402
    Sources,
    at_capacity_multiple,
    concatenate,
    resample,
)
from benchmarks.seed_claims import ratio  # noqa: E402
from scheduler.settings import Settings  # noqa: E402
from scheduler.settings_change import parse_assignment  # noqa: E402
from sim import traces  # noqa: E402
from sim.engine import simulate  # noqa: E402
from tuner.autopilot.config import AutopilotConfig  # noqa: E402
from tuner.autopilot.promise import Figures, breaks  # noqa: E402
from tuner.autopilot.replay import replay_with_autopilot  # noqa: E402

BASES = ("code", "conv", "sharegpt", "arxiv", "bwb", "reasoning")
KINDS = (*BASES, "mix")
REASONING_POOL = 20_000  # ServeGen draws resampled like the other sources' rows
THROUGHPUT = "throughput_tok_s"
VS_DEFAULTS = "vs_defaults"  # P95 TTFT ratio more than NEVER_WORSE above the defaults'
SHORT = {"ttft_p50": "TTFT50", "ttft_p95": "TTFT95", "ttft_p99": "TTFT99", "ttlt_p50": "TTLT50"}
SHORT |= {"ttlt_p99": "TTLT99", THROUGHPUT: "thr", VS_DEFAULTS: "TTFT95-vs-defaults"}


def pools(root: Path) -> dict[str, traces.Trace]:
    """Each base source's rows (lengths, caps; arrivals are redrawn by ``resample``)."""
    s = Sources.under(root)
    lengths = root / "lengths_only"
    return {
        "code": traces.load_trace(root / "azure2023" / "AzureLLMInferenceTrace_code.csv"),
        "conv": traces.load_trace(s.conv),
        "sharegpt": traces.load_lengths(s.sharegpt, rate=1.0),
        "arxiv": traces.load_lengths(s.arxiv, rate=1.0),
        "bwb": traces.load_lengths(
            lengths / "bwb_stats_llama2_tokenizer_filtered_v2.csv", rate=1.0
        ),
        "reasoning": traces.load_servegen_reasoning(
            s.reasoning_pmf, n=REASONING_POOL, rate=1.0, seed=0
        ),
    }


def source(rows: dict[str, traces.Trace], rng: np.random.Generator) -> tuple[str, traces.Trace]:
    """A drawn source: one base, or an even mix of two (equal row counts, drawn together)."""
    kind = str(rng.choice(KINDS))
    if kind != "mix":
        return kind, rows[kind]
    a, b = (str(x) for x in rng.choice(BASES, size=2, replace=False))
    n = min(len(rows[a]), len(rows[b]))
    return f"{a}+{b}", traces.Trace(f"{a}+{b}", rows[a].requests[:n] + rows[b].requests[:n])


def build(k: int, seed: int, rows: dict[str, traces.Trace]) -> tuple[traces.Trace, str]:
    """Variant ``k`` of master seed ``seed``: the trace and a one-line description."""
    rng = np.random.default_rng([seed, k])
    name, pool = source(rows, rng)
    load = float(rng.uniform(0.7, 1.4))
    cv = float(rng.uniform(1.0, 4.0))
    minutes = float(rng.uniform(20.0, 60.0))
    step = str(rng.choice(["none", "none", "load", "source"]))  # half of them steady
    halves = [(name, pool, load), (name, pool, load)]
    if step == "load":
        halves[1] = (name, pool, float(rng.uniform(0.7, 1.4)))
    elif step == "source":
        while (other := source(rows, rng))[0] == name:
            pass
        halves[1] = (*other, load)
    if step == "none":
        halves = halves[:1]
    span = 60.0 * minutes / len(halves)
    parts = []
    for j, (_, rows_j, load_j) in enumerate(halves):
        draw = int(rng.integers(2**31))

        def make(n: int, rows_j=rows_j, draw=draw, j=j) -> traces.Trace:
            return resample(rows_j, n, cv=cv, seed=draw, prefix=f"v{k}h{j}")

        parts.append(at_capacity_multiple(make, load_j, span))
    trace = concatenate(parts, f"variant{k}")
    how = f"{name} x{load:.2f} cap, CV {cv:.1f}, {minutes:.0f} min"
    if step != "none":
        how += f", then {halves[1][0]} x{halves[1][2]:.2f} at {minutes / 2:.0f} min"
    return trace, how


def fixed(
    trace: traces.Trace, policy: str, params: dict[str, Any] | None = None
) -> dict[str, float]:
    """The whole run's figures of ``policy`` with its default parameters (``params`` changed)."""
    result = simulate(trace, Settings.model_validate({"policy": policy, "params": params or {}}))
    return score(result.completions, half_time(trace))["all"]


def broken_of(m: dict[str, float], sar: dict[str, float]) -> list[str]:
    """What the benchmark's judge (``keeps_promise``) finds broken, named as in METRICS."""
    names = breaks(PROMISE, Figures.of(m), Figures.of(sar))
    assert bool(names) != keeps_promise(m, sar)
    return [k for k in METRICS if k in names or (k == THROUGHPUT and "throughput" in names)]


def run_variant(
    k: int,
    seed: int,
    rows: dict[str, traces.Trace],
    config: AutopilotConfig | None = None,
    defaults_only: dict[str, Any] | None = None,
) -> dict:
    """Variant ``k`` under sarathi, the defaults and the autopilot — or, with ``defaults_only``
    (the defaults' parameters to change, maybe none), the defaults in the autopilot's place."""
    started = time.perf_counter()
    trace, how = build(k, seed, rows)
    sar, dflt = fixed(trace, "sarathi"), fixed(trace, "uniboost")
    if defaults_only is None:
        result, decisions = replay_with_autopilot(trace, config=config)
        ap = score(result.completions, half_time(trace))["all"]
    else:  # with no parameter changed, the defaults' run above
        ap = fixed(trace, "uniboost", defaults_only) if defaults_only else dflt
        decisions = []
    r = {m: ratio(ap[m], sar[m]) for m in METRICS}
    d95 = ratio(dflt["ttft_p95"], sar["ttft_p95"])
    broken = {m: r[m] for m in broken_of(ap, sar)}
    if r["ttft_p95"] > d95 + NEVER_WORSE:
        broken[VS_DEFAULTS] = r["ttft_p95"] - d95
    return {
        "k": k,
        "how": how,
        "requests": len(trace),
        "ratios": r,
        "defaults_p95": d95,
        "defaults_broke": broken_of(dflt, sar),
        "broken": broken,
        "switches": [d for d in decisions if d.changed],
        "wall_s": time.perf_counter() - started,
    }


def line(v: dict) -> str:
    figures = " ".join(f"{SHORT[m]} {x:.3f}" for m, x in v["ratios"].items())
    verdict = "BROKE " + ",".join(SHORT[m] for m in v["broken"]) if v["broken"] else "held"
    own = ",".join(SHORT[m] for m in v["defaults_broke"]) or "none"
    sw = [f"{d.at / 60:.1f}m:{d.previous or '?'}>{d.choice}" for d in v["switches"]]
    return (
        f"#{v['k']:<3d} {v['how']} ({v['requests']} req, {v['wall_s']:.0f} s) | ap/sarathi "
        f"{figures} | defaults TTFT95 {v['defaults_p95']:.3f} (defaults break {own}) | "
        f"{verdict} | {len(sw)} switches: {' '.join(sw) or 'none'}"
    )


def summary(done: list[dict]) -> None:
    print(f"\n{sum(not v['broken'] for v in done)}/{len(done)} variants kept every promise")
    for m in (*METRICS, VS_DEFAULTS):
        hit = [v for v in done if m in v["broken"]]
        if not hit:
            continue
        worst = (min if m == THROUGHPUT else max)(hit, key=lambda v: v["broken"][m])
        x = worst["broken"][m]
        how = f"+{x:.3f} over the defaults' ratio" if m == VS_DEFAULTS else f"{x:.3f}x sarathi"
        print(f"  {SHORT[m]}: broken in {len(hit)}, worst {how} (#{worst['k']})")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--variants", type=int, default=100)
    ap.add_argument("--seed", type=int, default=20_240)
    ap.add_argument("--only", type=int, default=None, help="rerun variant K alone")
    ap.add_argument("--traces", type=Path, default=REPO / "traces")
    ap.add_argument("-v", "--verbose", action="store_true", help="each switch's reason")
    ap.add_argument("--set", action="append", default=[], help="AutopilotConfig field=JSON value")
    ap.add_argument(
        "--defaults-only",
        action="store_true",
        help="no autopilot: the defaults (with any --param) in its place, ~2 s a variant",
    )
    ap.add_argument(
        "--param", action="append", default=[], help="with --defaults-only: uniboost name=JSON"
    )
    args = ap.parse_args()
    if args.param and not args.defaults_only:
        ap.error("--param changes the defaults run in the autopilot's place: add --defaults-only")
    overrides = dict(parse_assignment(text) for text in args.set)
    config = AutopilotConfig.model_validate(overrides) if overrides else None
    defaults_only = dict(parse_assignment(t) for t in args.param) if args.defaults_only else None
    print(f"master seed {args.seed}" + "".join(f" {t}" for t in (*args.set, *args.param)))
    if defaults_only is not None:
        print("defaults only: 'ap/sarathi' below is the defaults' run with the parameters above")
    rows = pools(args.traces)
    done = []
    started = time.perf_counter()
    for k in [args.only] if args.only is not None else range(args.variants):
        done.append(run_variant(k, args.seed, rows, config, defaults_only))
        print(line(done[-1]), flush=True)
        if args.verbose:
            for d in done[-1]["switches"]:
                print(f"      {d.at / 60:6.1f} min {d.previous or '?'} > {d.choice}: {d.reason}")
    summary(done)
    print(f"wall {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()

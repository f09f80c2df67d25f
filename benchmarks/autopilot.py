"""The autopilot against every fixed choice, on continuous replays (issue 22).

    python benchmarks/autopilot.py [--workloads conv1.0,...,shift,diurnal,sharegpt] [--jobs 2]
        [--json OUT] [--grid 0.001,0.002,...,10] [--trials 40] [--no-tuned] [--seed 0]

Every workload is replayed whole — first request to last completion, never windows from an empty
engine — at vLLM's A100 engine defaults (the simulator's defaults). Columns, each also as a ratio
to sarathi on the same requests:

1. ``sarathi``: vLLM's default scheduler;
2. ``defaults``: uniboost with its default parameters (γ-Ada on);
3. ``best fixed γ (hindsight)``: every fixed setting of the autopilot's candidate set — uniboost,
   γ-Ada off, γ over ``--grid`` (default 0.001–10 /s, 1-2-5 per decade), and the other knobs'
   candidates (TIE at a fixed β, MemGuard's other quantization bases: ``fixed:<name>`` columns);
   the winner is the lowest P95 TTFT among those keeping every quantile within 1.02× and
   throughput ≥ 0.99× sarathi's, chosen on the very requests being scored;
4. ``tuned on 1st half``: ``tailpilot tune`` (library form: uniboost and the engine limits,
   ``--trials`` trials, objective ttft_p95, constraints P99 TTLT ≤ 1.02× and throughput ≥ 0.99×
   the production settings = sarathi) on the requests arriving in the first half of the trace,
   then ``tailpilot recommend``; the recommended settings replay the whole trace (warm) and are
   scored on the requests arriving in the second half only;
5. ``autopilot``: ``tuner.autopilot.replay.replay_with_autopilot`` — omitted, with a note, when that
   module does not import. Its decisions' ``cpu_s`` give the controller's CPU seconds per decision
   and per hour of traffic.

Two tables per workload: the whole trace (columns 1, 2, 3, 5) and the second half (arrivals after
the trace's midpoint in time; every column scored on the same requests, the hindsight γ chosen
again on them; column 4 only here). Closure = (defaults − autopilot) / (defaults − best fixed γ) on
the P95 TTFT ratio. The issue's targets are checked on the whole trace and printed PASS/FAIL.

Workloads: seed_claims' six (``conv1.0``, ``conv1.1``, ``code``, ``mix20``, ``mix70``,
``longprompt``) and four built for this benchmark (``shift``, ``diurnal``, ``sharegpt``, and
``heldout`` — added before the controller was tuned and run once after its design was frozen:
benchmarks/autopilot_workloads.py). ``benchmarks/autopilot_dev.py`` caches the fixed columns and
replays only the autopilot, for iterating on the controller. Deterministic for a seed (one tuning
worker per workload).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import os
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

# Run as a script: the repository root goes on sys.path before the project's imports (E402).
REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.autopilot_frozen import FROZEN_WORKLOADS, build_frozen_workload  # noqa: E402
from benchmarks.autopilot_report import report  # noqa: E402
from benchmarks.autopilot_scoring import (  # noqa: E402
    SHAPE_SHIFTS,
    THROUGHPUT_FLOOR,
    TTLT_SLACK,
    JobResult,
    half_time,
    median_gamma,
    score,
    summarise,
)
from benchmarks.autopilot_workloads import NEW_WORKLOADS, build_new_workload, slos_of  # noqa: E402
from benchmarks.seed_claims import KNEE, build_workload  # noqa: E402
from benchmarks.seed_claims import WORKLOADS as SEED_WORKLOADS  # noqa: E402
from scheduler.settings import Settings  # noqa: E402
from sim import traces  # noqa: E402
from sim.engine import EngineConfig, Simulator, simulate  # noqa: E402
from storage.strict_json import finite  # noqa: E402
from tuner.studies.optimize import tune  # noqa: E402
from tuner.studies.optuna_storage import open_storage, storage_url  # noqa: E402
from tuner.studies.recommend import recommend  # noqa: E402
from tuner.studies.spec import StudySpec, TuneError  # noqa: E402

WORKLOADS = (*SEED_WORKLOADS, *NEW_WORKLOADS, *FROZEN_WORKLOADS)
DEFAULT_TRACES = REPO / "traces"
DEFAULT_GRID = (*(m * 10.0**e for e in range(-3, 1) for m in (1, 2, 5)), 10.0)
TUNE_CONSTRAINTS = [f"ttlt_p99<={TTLT_SLACK}*baseline", f"throughput>={THROUGHPUT_FLOOR}*baseline"]


@dataclasses.dataclass
class Job:
    workload: str
    column: str  # "sarathi", "defaults", "g=<γ>", "fixed:<candidate>", "tuned", "autopilot"
    trace: traces.Trace
    settings: dict[str, Any] | None = None  # replayed as is (None: the column's own procedure)
    trials: int = 0
    seed: int = 0


# --------------------------------------------------------------------------------------------
# Scoring
# --------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------
# The columns (run in worker processes)
# --------------------------------------------------------------------------------------------


def write_vidur(trace: traces.Trace, path: Path) -> None:
    """``trace`` as a vidur CSV (the tuner reads files): arrival, lengths, cap, tenant, type."""
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(
            [
                "arrived_at",
                "num_prefill_tokens",
                "num_decode_tokens",
                "max_tokens",
                "tenant",
                "type",
            ]
        )
        for r in trace:
            w.writerow(
                [repr(r.arrival), r.prompt_tokens, r.output_tokens, r.max_tokens, r.tenant, r.type]
            )


def tune_first_half(trace: traces.Trace, trials: int, seed: int) -> tuple[Settings, dict[str, Any]]:
    """``tailpilot tune`` + ``recommend`` on the requests arriving before the midpoint; the
    recommended settings and what the study did."""
    first = traces.Trace(
        trace.name + "|first-half", tuple(r for r in trace if r.arrival < half_time(trace))
    )
    with tempfile.TemporaryDirectory(prefix="autopilot-bench-") as tmp:
        path = Path(tmp) / "first_half.csv"
        write_vidur(first, path)
        spec = StudySpec(
            policies=["uniboost"],
            objectives=["ttft_p95"],
            constraints=list(TUNE_CONSTRAINTS),
            traces=[str(path)],
            seed=seed,
        )
        url = storage_url(str(Path(tmp) / "optuna.db"))
        started = time.perf_counter()
        outcome = tune(url, "autopilot-bench", trials, spec=spec)
        tune_s = time.perf_counter() - started
        info: dict[str, Any] = {"trials": outcome.complete, "tune_s": tune_s}
        try:
            summary = recommend(open_storage(url), "autopilot-bench")
        except TuneError as err:  # no feasible trial: production (sarathi) stays
            info.update(note=str(err), recommend_s=time.perf_counter() - started - tune_s)
            return Settings(), info
        info.update(
            trial=summary["trial"],
            is_production=summary["is_production"],
            gamma_hat=summary["gamma_hat"],
            recommend_s=time.perf_counter() - started - tune_s,
        )
        return Settings.model_validate(summary["settings"]), info


def run_job(job: Job) -> JobResult:
    started = time.perf_counter()
    trace, t_half = job.trace, half_time(job.trace)
    extra: dict[str, Any] = {}
    if job.column == "autopilot":
        # Optional: the column is omitted when tuner.autopilot.controller does not import
        # (autopilot_available).
        from tuner.autopilot.replay import replay_with_autopilot

        cpu0 = time.process_time()
        try:
            result, decisions = replay_with_autopilot(trace, config=autopilot_config(job.workload))
        except Exception as err:  # a broken controller is reported in its column, not fatal
            return JobResult(
                job.workload,
                job.column,
                {},
                time.perf_counter() - started,
                {"error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"},
            )
        extra["replay_cpu_s"] = time.process_time() - cpu0
        extra["decisions"] = len(decisions)
        # Reported only when every decision carries the field (the controller's API may change).
        cpu = [
            float(c) for d in decisions if isinstance(c := getattr(d, "cpu_s", None), int | float)
        ]
        if decisions and len(cpu) == len(decisions):
            extra["cpu_s"] = cpu
            extra["judged"] = [len(getattr(d, "figures", None) or {}) for d in decisions]
        choices = [c for d in decisions if isinstance(c := getattr(d, "choice", None), str)]
        if len(choices) == len(decisions):
            extra["choices"] = dict(sorted(Counter(choices).items()))
        extra["switches"] = sum(1 for d in decisions if getattr(d, "changed", False))
    else:
        settings = Settings.model_validate(job.settings) if job.settings is not None else None
        if job.column == "tuned":
            settings, extra = tune_first_half(trace, job.trials, job.seed)
            extra["settings"] = settings.to_dict()
        assert settings is not None  # every other column names its settings
        result = simulate(trace, settings)
    if (
        job.column != "autopilot"
    ):  # the timeline holds γ-Ada's ticks only: the controller's γ is in its choices
        extra["median_gamma"] = median_gamma(result.gamma_timeline, result.sim_time_s)
    extra["rejected"] = len(result.rejected)
    return JobResult(
        job.workload,
        job.column,
        score(
            result.completions,
            t_half,
            slos_of(job.workload),
            phases=job.workload in SHAPE_SHIFTS,
        ),
        time.perf_counter() - started,
        extra,
    )


def autopilot_config(workload: str) -> Any:
    """The autopilot's configuration for a workload: the defaults, with the workload's declared
    SLOs as the promise where it declares them."""
    from tuner.autopilot.controller import AutopilotConfig
    from tuner.autopilot.promise import Promise

    slo = slos_of(workload)
    return AutopilotConfig() if slo is None else AutopilotConfig(promise=Promise(slo=slo))


def fixed(gamma: float) -> dict[str, Any]:
    return {"policy": "uniboost", "params": {"gamma": gamma, "gamma_ada": False}}


def replay_switched(trace: traces.Trace, schedule: list[tuple[float, dict[str, Any]]]) -> list:
    """``trace`` on one simulator whose settings are switched live as ``schedule`` says ((start
    time s, settings document) in order, the first from the start): what a replica switched
    at those times would have served. The oracles' replay (shift_late_switch, autopilot_leader)."""
    requests = sorted(trace, key=lambda r: (r.arrival, r.id))
    sim = Simulator(requests, Settings.model_validate(schedule[0][1]), EngineConfig())
    completions: list = []
    for start, doc in schedule[1:]:
        sim.advance_to(start)
        completions += sim.drain()[0]
        sim.apply_settings(Settings.model_validate(doc))
    sim.advance_to(math.inf)
    return completions + sim.drain()[0]


def other_knobs() -> dict[str, dict[str, Any]]:
    """The autopilot's candidates beyond the γ grid, sarathi and the defaults (TIE at a fixed
    β, MemGuard's other quantization bases): fixed settings of the hindsight column too."""
    from tuner.autopilot.controller import AutopilotConfig, candidates

    options = candidates(Settings.model_validate({"policy": "uniboost"}), AutopilotConfig())
    return {
        n: s.to_dict()
        for n, s in options.items()
        if n not in ("sarathi", "defaults", "slofq")
        and not (n.startswith("gamma=") and "," not in n)
    }


def jobs_for(
    workload: str,
    trace: traces.Trace,
    grid: tuple[float, ...],
    *,
    tuned: bool,
    autopilot: bool,
    trials: int,
    seed: int,
) -> list[Job]:
    """A workload's replays, slowest first (the pool then finishes together)."""
    jobs = []
    if tuned:
        jobs.append(Job(workload, "tuned", trace, trials=trials, seed=seed))
    if autopilot:
        jobs.append(Job(workload, "autopilot", trace))
    jobs.append(Job(workload, "sarathi", trace, {"policy": "sarathi"}))
    jobs.append(Job(workload, "defaults", trace, {"policy": "uniboost"}))
    jobs += [Job(workload, f"g={g:g}", trace, fixed(g)) for g in grid]
    jobs += [Job(workload, f"fixed:{n}", trace, s) for n, s in other_knobs().items()]
    slo = slos_of(workload)
    if slo is not None:  # token-level fair queueing with the declared tenants: an SLO reference
        jobs.append(Job(workload, "slofq", trace, {"policy": "slofq", "params": slo.model_dump()}))
    return jobs


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def build(args: tuple[str, Path, int, float]) -> tuple[str, traces.Trace, str]:
    name, root, seed, knee = args
    if name in FROZEN_WORKLOADS:
        trace, how = build_frozen_workload(name, root, knee)
    elif name in NEW_WORKLOADS:
        trace, how = build_new_workload(name, root, seed=seed, knee=knee)
    else:
        trace, how = build_workload(name, root, knee)
    return name, trace, how


def parse_grid(text: str) -> tuple[float, ...]:
    try:
        grid = tuple(sorted({float(g) for g in text.split(",") if g.strip()}))
    except ValueError:
        raise SystemExit(f"--grid {text!r}: expected comma-separated γ values in 1/s") from None
    if not grid or any(not (math.isfinite(g) and g > 0) for g in grid):
        raise SystemExit(f"--grid {text!r}: expected positive finite γ values in 1/s")
    return grid


def autopilot_available() -> str | None:
    """None when ``tuner.autopilot.replay.replay_with_autopilot`` imports.

    Else why the column is omitted.
    """
    try:
        # The probe itself: whether the optional column's module imports (the name is unused).
        from tuner.autopilot.replay import replay_with_autopilot  # noqa: F401
    except ImportError as err:
        return f"autopilot column omitted: tuner.autopilot.controller does not import ({err})"
    return None


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument(
        "--traces",
        type=Path,
        default=DEFAULT_TRACES,
        help="the traces folder (traces/ in the repository)",
    )
    ap.add_argument("--json", type=Path, help="also write every figure here")
    ap.add_argument(
        "--grid",
        default=",".join(f"{g:g}" for g in DEFAULT_GRID),
        help="fixed γ values (1/s) for the hindsight column",
    )
    ap.add_argument("--trials", type=int, default=40, help="tuner trials on each first half")
    ap.add_argument(
        "--no-tuned",
        action="store_true",
        help="skip the tuned-on-the-first-half column (the slowest)",
    )
    ap.add_argument(
        "--knee", type=float, default=KNEE, help="near saturation, as in benchmarks/seed_claims.py"
    )
    ap.add_argument("--seed", type=int, default=0, help="the new workloads' and the tuner's seed")
    args = ap.parse_args()
    workloads = [w for w in args.workloads.split(",") if w]
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown:
        raise SystemExit(
            f"--workloads: unknown {', '.join(unknown)}; known: {', '.join(WORKLOADS)}"
        )
    if args.jobs < 1 or args.trials < 1:
        raise SystemExit("--jobs and --trials must be >= 1")
    grid = parse_grid(args.grid)
    autopilot_note = autopilot_available()
    if autopilot_note:
        print(autopilot_note)
    started = time.perf_counter()
    built: dict[str, tuple[traces.Trace, str]] = {}
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        for name, trace, how in pool.map(
            build, [(w, args.traces, args.seed, args.knee) for w in workloads]
        ):
            built[name] = (trace, how)
            print(
                f"{name}: {len(trace)} requests, {trace.duration / 60:.1f} min, "
                f"{trace.rate:.2f} req/s ({how})",
                flush=True,
            )
        jobs = [
            j
            for w in workloads
            for j in jobs_for(
                w,
                built[w][0],
                grid,
                tuned=not args.no_tuned,
                autopilot=autopilot_note is None,
                trials=args.trials,
                seed=args.seed,
            )
        ]
        jobs.sort(key=lambda j: {"tuned": 0, "autopilot": 1}.get(j.column, 2))  # slowest first
        results: dict[str, dict[str, JobResult]] = {w: {} for w in workloads}
        for res in pool.map(run_job, jobs):
            results[res.workload][res.column] = res
    summaries = {w: summarise(results[w], built[w][0]) for w in workloads}
    report(built, summaries, results, autopilot_note)
    wall = time.perf_counter() - started
    print(f"\n{len(jobs)} runs (replays and tunings) in {wall:.0f} s wall ({args.jobs} processes)")
    if args.json:
        doc = {
            "grid": list(grid),
            "trials": None if args.no_tuned else args.trials,
            "seed": args.seed,
            "knee": args.knee,
            "wall_s": wall,
            "autopilot_note": autopilot_note,
            "workloads": {
                w: {
                    "requests": len(built[w][0]),
                    "duration_s": built[w][0].duration,
                    "description": built[w][1],
                    "summary": summaries[w],
                    "columns": {c: {"wall_s": r.wall_s, **r.extra} for c, r in results[w].items()},
                }
                for w in workloads
            },
        }
        args.json.write_text(json.dumps(finite(doc), indent=2))


if __name__ == "__main__":
    main()

"""What tuning buys: the recommended settings against vLLM's default and UNIBOOST's defaults, on
held-out windows, with Azure conv mixed with reasoning-length requests near saturation.

    python benchmarks/tuner_recommendation.py [--trials 150] [--workers 2] [--reasoning 0.2]
        [--scale 0.9] [--window-s 240] [--trace PATH] [--reasoning-pmf PATH]

1. Workload: the whole Azure conv trace (CC BY 4.0), with a fraction of its requests replaced by
   reasoning requests whose lengths follow the ServeGen DeepSeek-R1 distribution (sim.traces.mix).
2. Load: the arrival rate is scaled by `--scale` (default 0.9). A sweep of `sarathi` (vLLM's
   default) over the same windows is printed first: at 0.9 its P95 TTFT is several times its
   light-load value and climbs steeply with load, i.e. the replica runs near saturation (its
   `max_num_seqs` seats are full of long reasoning decodes).
3. `tailpilot tune` (library form): policy uniboost + engine limits, objectives ttlt_p99 and
   ttft_p95 (NSGA-II; the recommendation is the Pareto-front member with the largest mean gain among
   those that regress neither objective),
   constraint throughput>=0.99*baseline, production = sarathi with the engine defaults, windows of
   `--window-s` seconds, `--holdout` of them (stratified by load) held out.
   Windows are warm (``--warmup-s``, the 120 s before each window replayed and not measured).
4. `tailpilot recommend` (which replays the best candidates continuously over the whole trace and
   passes over any that lose to production there), then a markdown table on the held-out windows:
   mean over windows of each window's P99 TTLT and P95 TTFT for sarathi, uniboost with its
   default parameters and the tuned settings, with the per-window % change (geometric mean of
   the per-window ratios, positive = better) and a 95% t-interval over windows.

With one worker the study is reproducible (same seed, same trials); with several the trial order
depends on timing, so the figures vary a little from run to run.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

from scheduler.metrics import percent_change
from scheduler.settings import Settings
from tuner.studies.continuous import continuous_metrics
from tuner.studies.optimize import tune
from tuner.studies.optuna_storage import open_storage, storage_url
from tuner.studies.recommend import jsonable, paired_improvement, recommend
from tuner.studies.spec import StudySpec
from tuner.studies.study import load_context
from tuner.studies.windows import build_traces, build_windows, nanmean, window_metrics

REPO = Path(__file__).resolve().parents[1]
TRACES = REPO / "traces"
DEFAULT_TRACE = TRACES / "azure2023" / "AzureLLMInferenceTrace_conv.csv"
DEFAULT_PMF = TRACES / "servegen_derived" / "servegen_deepseek_r1_length_pmf.csv"
METRICS = (("ttlt_p99", "P99 TTLT (s)"), ("ttft_p95", "P95 TTFT (s)"))


def sweep(base: dict, scales: list[float], window_s: float) -> None:
    """sarathi over all windows at several rate scales: where the knee is."""
    print(f"sarathi (vLLM default) by rate scale, mean over {window_s:g}-s windows:")
    print(f"{'scale':>6} {'req/s':>6} {'P95 TTFT':>9} {'P99 TTLT':>9} {'P50 TTLT':>9}")
    config = None
    for scale in scales:
        spec = StudySpec(
            policies=["uniboost"],
            objectives=["ttlt_p99"],
            rate_scale=scale,
            window_s=window_s,
            **base,
        )
        spec.normalize()
        config = config or spec.engine_config()
        (trace,) = build_traces(spec)
        windows = build_windows(spec, [trace])
        m = [
            window_metrics(Settings(), w, config, ["ttft_p95", "ttlt_p99", "ttlt_p50"])
            for w in windows
        ]
        mean = {k: nanmean([x[k] for x in m]) for k in m[0]}
        print(
            f"{scale:6.2f} {trace.rate:6.2f} {mean['ttft_p95']:9.2f} {mean['ttlt_p99']:9.1f} "
            f"{mean['ttlt_p50']:9.2f}"
        )


def cell(m: dict) -> str:
    if m["improvement_pct"] is None or not math.isfinite(m["improvement_pct"]):
        return "—"
    lo, hi = m["ci_pct"]
    if lo is None or not math.isfinite(lo):
        return f"{m['improvement_pct']:+.1f}%"
    return f"{m['improvement_pct']:+.1f}% [{lo:+.1f}, {hi:+.1f}]"


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--trace", default=str(DEFAULT_TRACE))
    ap.add_argument("--reasoning-pmf", default=str(DEFAULT_PMF))
    ap.add_argument("--reasoning", type=float, default=0.2, help="fraction of reasoning requests")
    ap.add_argument("--scale", type=float, default=0.9, help="arrival-rate scale")
    ap.add_argument(
        "--sweep", default="0.5,0.7,0.8,0.9,1.0", help="scales of the sarathi sweep ('' = none)"
    )
    ap.add_argument("--trials", type=int, default=150)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--window-s", type=float, default=240.0)
    ap.add_argument("--holdout", type=float, default=0.3)
    ap.add_argument("--warmup-s", type=float, default=120.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--storage", help="Optuna storage (default: a temporary SQLite file)")
    ap.add_argument("--json", help="also write the recommendation summary here")
    args = ap.parse_args()

    base = dict(traces=[args.trace], mix=[(args.reasoning_pmf, args.reasoning)], seed=args.seed)
    scale = args.scale
    if args.sweep:
        sweep(base, [float(x) for x in args.sweep.split(",")], args.window_s)
    spec = StudySpec(
        policies=["uniboost"],
        objectives=["ttlt_p99", "ttft_p95"],
        constraints=["throughput>=0.99*baseline"],
        rate_scale=scale,
        window_s=args.window_s,
        holdout=args.holdout,
        warmup_s=args.warmup_s,
        **base,
    )
    with tempfile.TemporaryDirectory() as tmp:
        url = storage_url(args.storage or str(Path(tmp) / "tailpilot-optuna.db"))
        t0 = time.perf_counter()
        outcome = tune(url, "bench", args.trials, spec=spec, workers=args.workers, log=print)
        tune_s = time.perf_counter() - t0
        storage = open_storage(url)
        summary = jsonable(recommend(storage, "bench"))
        _, ctx = load_context(storage, "bench")
        held = ctx.holdout
        runs = {
            "sarathi (vLLM default)": ctx.run_many(Settings(), held),
            "uniboost, defaults": ctx.run_many(Settings(policy="uniboost"), held),
            f"tuned (trial #{summary['trial']})": ctx.run_many(
                Settings.model_validate(summary["settings"]), held
            ),
        }
    (trace,) = build_traces(spec)
    print(
        f"\nworkload: {trace.name}, {len(trace)} requests at {trace.rate:.2f} req/s "
        f"(rate x{scale:.3f}); {len(ctx.windows)} windows of {args.window_s:g} s, "
        f"{len(ctx.search)} searched, {len(held)} held out {held}"
    )
    print(
        f"study: {outcome.complete} trials with {args.workers} worker(s) in {tune_s:.0f} s; "
        f"gamma-hat {summary['gamma_hat']:.4g} /s"
    )
    print("recommended: " + json.dumps(summary["settings"]))
    for metric, label in METRICS:
        print(
            f"search windows (optimistic), {label} vs sarathi: "
            f"{cell(summary['search']['metrics'][metric])}"
        )
    if summary.get("pareto_front"):
        print(f"Pareto front: {len(summary['pareto_front'])} trials")
    print()

    names = list(runs)
    ref_sarathi, ref_uniboost = runs[names[0]], runs[names[1]]
    header = ["settings"]
    for _, label in METRICS:
        header += [label, "vs sarathi", "vs uniboost defaults"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for name, vals in runs.items():
        row = [name]
        for metric, _ in METRICS:
            xs = [vals[i][metric] for i in held]
            vs_s = paired_improvement(xs, [ref_sarathi[i][metric] for i in held], metric)
            vs_u = paired_improvement(xs, [ref_uniboost[i][metric] for i in held], metric)
            row += [
                f"{vs_s['value']:.2f}",
                "—" if vals is ref_sarathi else cell(jsonable(vs_s)),
                "—" if vals is ref_uniboost else cell(jsonable(vs_u)),
            ]
        print("| " + " | ".join(row) + " |")
    print(
        f"\nValues: mean over {len(held)} held-out windows of {args.window_s:g} s "
        "of each window's percentile. "
        "Change: geometric mean over those windows of the per-window ratio, positive = better, "
        "[95% t-interval over windows]."
    )
    cont = summary["continuous"]
    defaults = jsonable(continuous_metrics(ctx, Settings(policy="uniboost")))
    print(
        "\nContinuous replay of the whole trace (what production would see), "
        "recommended vs production:"
    )
    for part in ("holdout", "all"):
        cells = [
            f"{label} {cont[part][m]['value']:.2f} vs {cont[part][m]['production']:.2f} "
            f"({cont[part][m]['change_pct']:+.1f}%)"
            for m, label in METRICS
        ]
        print(f"  {part + ' requests':18s} " + "; ".join(cells))
    for part in ("holdout", "all"):
        cells = [
            f"{label} {cont[part][m]['value']:.2f} vs {defaults[part][m]:.2f} "
            f"({percent_change(cont[part][m]['value'], defaults[part][m], m):+.1f}%)"
            for m, label in METRICS
        ]
        print(f"  vs uniboost defaults, {part + ' requests':18s} " + "; ".join(cells))
    for c in cont["checked"]:
        if c["losses"]:
            print(f"  trial #{c['trial']} passed over: {'; '.join(c['losses'])}")
    if cont["kept_production"]:
        print("  every candidate lost the continuous replay: production kept")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()

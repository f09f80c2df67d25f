"""Simulated runs: ``sim``, ``compare`` and ``capacity``.

    tailpilot sim --trace FILE --policy uniboost --set gamma=0.05 --json
    tailpilot compare --trace FILE --policy fcfs,sarathi,sjf,srpt,las,uniboost,tie \\
        --baseline sarathi
    tailpilot capacity --cluster clusters.yaml --rate-scale 4 [--target 0.99]

Without ``--trace`` (or ``--recording``) they run on the bundled Azure conv window (10 minutes,
CC BY 4.0).
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from click.core import ParameterSource
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from controlplane.views import fmt_figure, wide_console
from scheduler.settings import Settings
from tailpilot import options
from tailpilot.cli_cluster import load_cluster
from tailpilot.cli_common import POLICY, FiniteFloatRange, echo_json
from tailpilot.cli_trace import (
    EngineRequest,
    TraceRequest,
    engine_options,
    load_trace,
    settings_file_or_exit,
    settings_or_exit,
    trace_options,
)

if TYPE_CHECKING:  # the simulator loads only when a command runs (start-up cost)
    from sim.engine import EngineConfig, SimResult
    from sim.traces import Trace

# Metrics shown in the compare table, in Table 2's spirit (seed 000): tails first.
COMPARE_METRICS = (
    "ttlt_mean",
    "ttlt_p50",
    "ttlt_p95",
    "ttlt_p99",
    "ttft_mean",
    "ttft_p95",
    "ttft_p99",
    "tbt_p99",
    "throughput_tok_s",
    "preemptions",
)
# (label, metrics, run facts) of one simulated run.
Outcome = tuple[str, dict[str, float], dict[str, Any]]


@dataclass(frozen=True)
class Run:
    """One simulation to run (picklable: ``compare --jobs`` hands it to a process pool)."""

    label: str
    trace: Trace
    settings: dict[str, Any]  # the settings document
    config: EngineConfig
    event_skipping: bool = True
    show_progress: bool = False


def run_policy(run: Run) -> Outcome:
    """Replay the trace under the run's settings (module-level so a process pool can call it)."""
    from sim.engine import Simulator  # start-up cost

    simulator = Simulator(
        run.trace,
        Settings.model_validate(run.settings),
        run.config,
        event_skipping=run.event_skipping,
    )
    if not run.show_progress:
        return run.label, (result := simulator.run()).metrics(), run_info(result, run.trace)
    with Progress(
        TextColumn(f"{run.label:>10}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    ) as bar:
        task = bar.add_task(run.label, total=len(run.trace))
        result = simulator.run(progress=lambda done, total: bar.update(task, completed=done))
    return run.label, result.metrics(), run_info(result, run.trace)


def run_info(result: SimResult, trace: Trace) -> dict[str, Any]:
    return {
        "wall_s": result.wall_s,
        "steps": result.steps,
        "iterations": result.iterations,
        "sim_time_s": result.sim_time_s,
        "requests": len(trace),
    }


def run_autopilot(run: Run) -> Outcome:
    """Replay with the autopilot choosing the settings (tuner.autopilot.controller), starting from
    the run's settings; the run facts carry its decisions."""
    from tuner.autopilot.replay import replay_with_autopilot  # start-up cost

    trace = run.trace
    result, decisions = replay_with_autopilot(
        trace, Settings.model_validate(run.settings), engine=run.config
    )
    cpu = sum(d.cpu_s for d in decisions)
    hours = max(result.sim_time_s - (min((r.arrival for r in trace), default=0.0)), 1e-9) / 3600.0
    info = {
        **run_info(result, trace),
        "autopilot": {
            "cpu_s": cpu,
            "cpu_s_per_decision": cpu / len(decisions) if decisions else None,
            "cpu_s_per_hour": cpu / hours,
            "final": result.settings.to_dict(),
            "decisions": [
                {
                    "at": d.at,
                    "choice": d.choice,
                    "changed": d.changed,
                    "reason": d.reason,
                    "requests": d.requests,
                    "cpu_s": d.cpu_s,
                }
                for d in decisions
            ],
        },
    }
    return run.label, result.metrics(), info


Task = tuple[Callable[[Run], Outcome], Run]


def call(task: Task) -> Outcome:
    runner, run = task
    return runner(run)


def batch_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """What only a batch simulation takes (``sim``, ``compare``)."""
    return options.stack(
        click.option(
            "--step-by-step", is_flag=True, help="Disable event skipping (slow; for checking)."
        ),
        options.progress(),
        click.option(
            "--predictor",
            type=click.Choice(["oracle", "history"]),
            default="oracle",
            show_default=True,
            help="Length predictor for sjf/srpt/tie (oracle = true lengths, as in the papers' "
            "baselines).",
        ),
    )(fn)


def show_progress(flag: bool | None, n: int) -> bool:
    if flag is not None:
        return flag
    return sys.stderr.isatty() and n >= 2000


# --------------------------------------------------------------------------------------------
@click.command()
@options.policy(
    default="uniboost",
    help="The policy to replay [default: uniboost: the simulator is where a tail-aware policy is "
    "tried, and --autopilot starts from its settings].",
)
@options.assignments()
@options.pins()
@options.json_output("the metrics")
@options.autopilot(
    help="Let the autopilot choose γ while it replays (starting from --policy's settings); "
    "prints its decisions too."
)
@options.settings_file(
    help="Replay this settings document (e.g. from `tailpilot export`) instead of "
    "--policy/--set/--pin."
)
@trace_options
@engine_options
@batch_options
def sim(
    policy: str,
    assignments: tuple[str, ...],
    pins: tuple[str, ...],
    as_json: bool,
    autopilot: bool,
    settings_file: str | None,
    trace_request: TraceRequest,
    engine: EngineRequest,
    step_by_step: bool,
    progress: bool | None,
    predictor: str,
) -> None:
    """Replay a trace through the engine simulator under one policy and print its metrics."""
    if settings_file:
        ctx = click.get_current_context()
        given = [
            flag
            for flag, param in (("--policy", "policy"), ("--set", "assignments"), ("--pin", "pins"))
            if ctx.get_parameter_source(param) == ParameterSource.COMMANDLINE
        ]
        if given:
            raise click.UsageError(
                f"--settings replays a whole document: leave out {', '.join(given)}"
            )
        settings = settings_file_or_exit(settings_file)
        policy = settings.policy
    else:
        settings = settings_or_exit(policy, assignments, pins, engine.limits(), predictor)
    trace = load_trace(trace_request)
    run = Run(
        policy,
        trace,
        settings.to_dict(),
        engine.config(),
        not step_by_step,
        show_progress(progress, len(trace)),
    )
    _, metrics, info = (run_autopilot if autopilot else run_policy)(run)
    if as_json:
        echo_json(
            {"trace": trace.name, "settings": settings.to_dict(), "metrics": metrics, "run": info},
            default=float,
        )
        return
    from scheduler.metrics import METRICS  # start-up cost (numpy)

    table = Table(title=f"{policy} on {trace.name} ({len(trace)} requests)")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_column("unit")
    for name, value in metrics.items():
        unit = METRICS[name][1] if name in METRICS else ""
        table.add_row(name, fmt_figure(value), unit)
    wide_console().print(table)
    click.echo(
        f"simulated {info['sim_time_s']:.1f} s in {info['wall_s']:.2f} s wall "
        f"({info['steps']} steps in {info['iterations']} events)"
    )
    if autopilot:
        print_decisions(info["autopilot"])


def print_decisions(pilot: dict[str, Any]) -> None:
    table = Table(title="autopilot decisions (changes only)")
    for column in ("t (s)", "choice", "why"):
        table.add_column(column)
    for d in pilot["decisions"]:
        if d["changed"]:
            table.add_row(f"{d['at']:.0f}", d["choice"], d["reason"])
    wide_console().print(table)
    per = pilot["cpu_s_per_decision"]
    changes = sum(d["changed"] for d in pilot["decisions"])
    click.echo(
        f"{len(pilot['decisions'])} decisions, {changes} changes; "
        f"controller CPU {pilot['cpu_s']:.1f} s ({per or 0:.3f} s per decision, "
        f"{pilot['cpu_s_per_hour']:.1f} s per hour of traffic)"
    )


# --------------------------------------------------------------------------------------------
@click.command()
@options.policies(
    default="fcfs,sarathi,sjf,srpt,las,uniboost,tie",
    help="The policies to run, comma-separated.",
)
@options.renamed("--policies", "--policy", "policies")
@click.option(
    "--baseline",
    type=POLICY,
    default="sarathi",
    show_default=True,
    help="Policy the others are compared against (added to --policy if missing, with a note).",
)
@options.assignments(
    metavar="POLICY.NAME=VALUE",
    help="Set a parameter of one policy, e.g. uniboost.gamma=0.05 (repeatable).",
)
@options.jobs(help="Policies simulated in parallel.")
@options.json_output("metrics and changes")
@options.autopilot(help="Add a column: the autopilot choosing γ (from uniboost's defaults).")
@click.option(
    "--settings",
    "settings_files",
    metavar="A.json,B.json",
    help="Add a column per settings document (e.g. from `tailpilot export`), named by its file.",
)
@trace_options
@engine_options
@batch_options
def compare(
    policies: list[str],
    baseline: str,
    assignments: tuple[str, ...],
    jobs: int,
    as_json: bool,
    autopilot: bool,
    settings_files: str | None,
    trace_request: TraceRequest,
    engine: EngineRequest,
    step_by_step: bool,
    progress: bool | None,
    predictor: str,
) -> None:
    """Run several policies on one trace; print each one's metrics and % change vs the baseline
    (positive = better), in the layout of Table 2 of the UNIBOOST paper."""
    names = list(policies)
    if baseline not in names:
        names.insert(0, baseline)
        click.echo(f"note: the baseline {baseline} is not in --policy; comparing it too", err=True)
    per_policy = _assignments_per_policy(names, assignments)
    limits = engine.limits()
    docs = {n: settings_or_exit(n, per_policy[n], (), limits, predictor).to_dict() for n in names}
    trace = load_trace(trace_request)
    config = engine.config()
    show = show_progress(progress, len(trace)) and jobs == 1
    for path in filter(None, (p.strip() for p in (settings_files or "").split(","))):
        label = Path(path).stem
        while label in docs:
            label += "'"
        docs[label] = settings_file_or_exit(path).to_dict()
        names.append(label)
    tasks: list[Task] = [
        (run_policy, Run(n, trace, docs[n], config, not step_by_step, show)) for n in names
    ]
    if autopilot:
        start = settings_or_exit("uniboost", per_policy.get("uniboost", []), (), limits)
        names.append("autopilot")
        tasks.append(
            (run_autopilot, Run("autopilot", trace, start.to_dict(), config, not step_by_step))
        )
    if jobs > 1:
        # No more processes than policies: a large --jobs must not fork that many interpreters.
        with ProcessPoolExecutor(max_workers=min(jobs, len(tasks))) as pool:
            results = list(pool.map(call, tasks))
    else:
        results = [call(t) for t in tasks]
    _report_compare(trace, baseline, names, results, as_json)


def _assignments_per_policy(
    names: Sequence[str], assignments: Sequence[str]
) -> dict[str, list[str]]:
    """``--set POLICY.NAME=VALUE`` split per compared policy."""
    per_policy: dict[str, list[str]] = {n: [] for n in names}
    for item in assignments:
        head, _, rest = item.partition(".")
        if head not in per_policy or not rest:
            raise click.BadParameter(
                f"{item!r}: expected POLICY.NAME=VALUE for a compared policy", param_hint="--set"
            )
        per_policy[head].append(rest)
    return per_policy


def _report_compare(
    trace: Trace, baseline: str, names: list[str], results: list[Outcome], as_json: bool
) -> None:
    from scheduler.metrics import percent_change  # start-up cost (numpy)

    metrics = {label: m for label, m, _ in results}
    info = {label: i for label, _, i in results}
    base = metrics[baseline]
    changes = {
        n: {k: percent_change(metrics[n][k], base[k], k) for k in COMPARE_METRICS} for n in names
    }
    if as_json:  # an undefined change (against a zero baseline) is null
        echo_json(
            {
                "trace": trace.name,
                "requests": len(trace),
                "baseline": baseline,
                "metrics": metrics,
                "change_pct": changes,
                "runs": info,
            },
            default=float,
        )
        return
    table = Table(
        title=f"{trace.name}: {len(trace)} requests; % change vs {baseline} (positive = better)"
    )
    table.add_column("policy")
    for k in COMPARE_METRICS:
        table.add_column(k, justify="right")

    def change_cell(change: float) -> str:
        # Undefined against a zero or missing baseline (no request finished, none preempted):
        # said in words, never "+nan%".
        return f"{change:+.1f}%" if math.isfinite(change) else "n/a (baseline 0)"

    for n in names:
        cells = [
            change_cell(changes[n][k]) if n != baseline else fmt_figure(base[k])
            for k in COMPARE_METRICS
        ]
        table.add_row(n + (" (abs)" if n == baseline else ""), *cells)
    wide_console().print(table)
    total_wall = sum(i["wall_s"] for i in info.values())
    click.echo(f"{len(names)} policies simulated in {total_wall:.2f} s wall")


# --------------------------------------------------------------------------------------------
@click.command()
@options.cluster_file(
    help="Cluster file whose governance block gives the tenants, their commitments and SLOs."
)
@options.cluster_name()
@options.policy(
    default="slofq",
    help="The replicas' policy [default: slofq: the plan keeps the governance block's SLOs, and "
    "slofq takes its tenants as its parameters].",
)
@options.assignments()
@click.option(
    "--target",
    type=FiniteFloatRange(0, 1, min_open=True),
    metavar="SCR",
    default=0.99,
    show_default=True,
    help="The mean per-window SCR to keep.",
)
@options.window_length(help="Judge SCR per window of this many seconds of arrivals.")
@click.option(
    "--max-replicas",
    type=click.IntRange(1, 4096),
    default=64,
    show_default=True,
    metavar="N",
    help="The most replicas to try.",
)
@options.json_output("the plan")
@trace_options
@engine_options
def capacity(
    cluster_file: str,
    cluster_name: str | None,
    policy: str,
    assignments: tuple[str, ...],
    target: float,
    window_s: float,
    max_replicas: int,
    as_json: bool,
    trace_request: TraceRequest,
    engine: EngineRequest,
) -> None:
    """How many replicas keep SCR at --target for this traffic and the cluster's SLOs (by
    simulation)."""
    from tuner.closed_loop.capacity import capacity as plan_capacity  # start-up cost
    from tuner.closed_loop.capacity import format_plan  # start-up cost

    cluster = load_cluster(cluster_file, cluster_name)
    if cluster.governance is None:
        raise click.UsageError(
            f"cluster {cluster.name!r} has no governance block: no tenants or SLOs to keep"
        )
    params = cluster.governance.params()
    base = (
        [f"{k}={json.dumps(v)}" for k, v in params.model_dump().items()]
        if policy == "slofq"
        else []
    )
    settings = settings_or_exit(policy, (*base, *assignments), (), engine.limits(), "history")
    trace = load_trace(trace_request)
    plan = plan_capacity(
        trace,
        params,
        settings,
        engine.config(),
        target=target,
        window_s=window_s,
        max_replicas=max_replicas,
    )
    if as_json:
        echo_json(plan, default=float)
    else:
        click.echo(format_plan(plan))
    if plan["replicas"] is None:
        sys.exit(1)


COMMANDS = (sim, compare, capacity)

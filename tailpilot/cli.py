"""The ``tailpilot`` command line.

    tailpilot sim --trace FILE --policy uniboost --set gamma=0.05 --json
    tailpilot compare --trace FILE --policies fcfs,sarathi,sjf,srpt,las,uniboost,tie --baseline sarathi
    tailpilot twin --replicas 4 --speed 10 --rate-scale 4 --cluster-out twins.yaml

Without ``--trace`` both run on the bundled Azure conv window (10 minutes, CC BY 4.0).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, cast

import click

from scheduler.settings import (
    POLICY_NAMES,
    EngineSettings,
    Settings,
    describe_error,
    settings_from_cli,
)
from tailpilot.cli_common import (
    GPU_BLOCKS,
    POSITIVE,
    SEED,
    STEP_MODEL,
    TENANTS,
    TIME_SPAN,
    TOKENS,
    TRACE_PARSE_ERRORS,
    FiniteFloatRange,
    echo_json,
    json_text,
    unreadable_trace,
)

PREDICTED_POLICIES = ("sjf", "srpt", "tie")

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


def _load_trace(
    path: str | None,
    rate_scale: float | None,
    target_rate: float | None,
    span: tuple[float, float] | None,
    cap: int | None,
    tenants: int | None,
    seed: int,
):
    from sim import traces

    # --max-tokens-default is not passed through the commands' signatures: its callback keeps it in
    # the command's context (see ``trace_options``).
    ctx = click.get_current_context(silent=True)
    default_cap = (
        ctx.meta.get(_MAX_TOKENS_DEFAULT_KEY) if ctx is not None else None
    ) or traces.DEFAULT_MAX_TOKENS
    recording = ctx.meta.get(_RECORDING_KEY) if ctx is not None else None
    if recording is not None:
        if path is not None:
            raise click.UsageError("give --trace or --recording, not both")
        from tuner.recorded import RecordedSpan

        path = RecordedSpan(recording=recording).url()
    if path in (None, "bundled"):
        trace = traces.load_bundled(max_tokens_default=default_cap)
    elif path.startswith("db:"):
        from tuner.recorded import load_recorded, parse_url

        trace = load_recorded(parse_url(path), max_tokens_default=default_cap)
    else:
        # A length-only trace has no arrival times: --target-rate gives it Poisson arrivals.
        generate = {"rate": target_rate} if target_rate else {}
        try:
            trace = traces.load_trace(path, seed=seed, max_tokens_default=default_cap, **generate)
        except traces.ArrivalsNeeded as err:
            if err.needs == ("rate",):
                raise click.UsageError(
                    f"{path}: lengths without arrival times: give --target-rate REQ_PER_S "
                    "(Poisson arrivals at that rate)"
                ) from None
            raise click.UsageError(
                f"{path}: a length distribution, not requests: sample it from Python "
                "(sim.traces.load_servegen_reasoning) or mix it into a trace "
                "(tailpilot tune --mix FILE=FRACTION)"
            ) from None
    trace = traces.transform(
        trace,
        window=span,
        rate_scale=rate_scale,
        rate=target_rate,
        max_tokens_cap=cap,
        tenants=tenants,
        seed=seed,
    )
    if len(trace) == 0:
        raise click.UsageError("the trace is empty after the transforms")
    if trace.truncated:
        # On stderr, so --json output stays one document.
        click.echo(
            f"note: {trace.truncated} of {len(trace)} requests of {trace.name} had outputs longer than "
            f"their max_tokens cap and were truncated to it (cap for requests the trace records none: "
            f"{default_cap}; --max-tokens-default N to change it)",
            err=True,
        )
    return trace


_MAX_TOKENS_DEFAULT_KEY = "tailpilot.max_tokens_default"
_RECORDING_KEY = "tailpilot.recording"


def _engine_limit(name: str) -> click.IntRange:
    """The range the settings document allows an engine limit (``EngineSettings``), so that the
    option refuses what the document would, naming the option instead of ``engine.<name>``."""
    from annotated_types import Ge, Le

    low: int | None = None
    high: int | None = None
    for bound in EngineSettings.model_fields[name].metadata:
        if isinstance(bound, Ge):
            low = cast(int, bound.ge)  # an int field: its bounds are ints
        elif isinstance(bound, Le):
            high = cast(int, bound.le)
    return click.IntRange(low, high)


def _remember_max_tokens_default(
    ctx: click.Context, param: click.Parameter, value: int | None
) -> int | None:
    if value is not None:
        ctx.meta[_MAX_TOKENS_DEFAULT_KEY] = value
    return value


def _remember_recording(
    ctx: click.Context, param: click.Parameter, value: str | None
) -> str | None:
    if value is not None:
        ctx.meta[_RECORDING_KEY] = value
    return value


def _engine_config(num_gpu_blocks: int | None, step_model: str | None):
    from sim.engine import EngineConfig
    from sim.stepmodel import get_model

    kw: dict[str, Any] = {}
    if num_gpu_blocks:
        kw["num_gpu_blocks"] = num_gpu_blocks
    if step_model:
        kw["step_model"] = get_model(step_model)
    return EngineConfig(**kw)


def _run_one(args: tuple) -> tuple[str, dict[str, float], dict[str, Any]]:
    """Run one simulation (module-level so a process pool can call it)."""
    from sim.engine import Simulator

    label, trace, settings_doc, config, event_skipping, show_progress = args
    settings = Settings.model_validate(settings_doc)
    sim = Simulator(trace, settings, config, event_skipping=event_skipping)
    if show_progress:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        with Progress(
            TextColumn(f"{label:>10}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TimeElapsedColumn(),
            console=_stderr_console(),
            transient=True,
        ) as bar:
            task = bar.add_task(label, total=len(trace))
            result = sim.run(progress=lambda done, total: bar.update(task, completed=done))
    else:
        result = sim.run()
    return label, result.metrics(), _run_info(result, trace)


def _run_info(result, trace) -> dict[str, Any]:
    return {
        "wall_s": result.wall_s,
        "steps": result.steps,
        "iterations": result.iterations,
        "sim_time_s": result.sim_time_s,
        "requests": len(trace),
    }


def _call(task: tuple) -> tuple[str, dict[str, float], dict[str, Any]]:
    fn, args = task
    return fn(args)


def _run_autopilot(args: tuple) -> tuple[str, dict[str, float], dict[str, Any]]:
    """Replay with the autopilot choosing the settings (tuner.autopilot); ``info`` carries its
    decisions. Same arguments as ``_run_one`` (the settings document is the starting point)."""
    from tuner.autopilot import replay_with_autopilot

    label, trace, settings_doc, config, _, _ = args
    result, decisions = replay_with_autopilot(
        trace, Settings.model_validate(settings_doc), engine=config
    )
    cpu = sum(d.cpu_s for d in decisions)
    hours = max(result.sim_time_s - (min((r.arrival for r in trace), default=0.0)), 1e-9) / 3600.0
    info = {
        **_run_info(result, trace),
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
    return label, result.metrics(), info


def _settings_file_or_exit(path: str) -> Settings:
    from controlplane.export import ExportError, load_settings_file

    try:
        return load_settings_file(path)
    except ExportError as err:
        raise click.BadParameter(str(err), param_hint="--settings") from None
    except RecursionError:
        raise click.BadParameter(f"{path}: nested too deeply", param_hint="--settings") from None


def _stderr_console():
    from rich.console import Console

    return Console(stderr=True)


def _settings_or_exit(
    policy: str, assignments, pins, engine: dict, predictor: str = "oracle"
) -> Settings:
    assignments = list(assignments)
    if policy in PREDICTED_POLICIES and not any(
        a.split("=", 1)[0].strip() == "predictor" for a in assignments
    ):
        assignments.insert(0, f"predictor={predictor}")
    try:
        return settings_from_cli(policy, assignments, list(pins), engine)
    except ValueError as err:  # pydantic's ValidationError is a ValueError
        raise click.UsageError(describe_error(err)) from None
    except RecursionError:  # a JSON value past Python's recursion limit
        raise click.BadParameter("a value nested too deeply", param_hint="--set") from None


# Option groups: what picks and shapes a trace, what sizes the simulated engine, and what only a
# batch simulation takes. ``sim``/``compare`` take all three; ``twin`` the first two.
trace_options = [
    click.option(
        "--trace",
        "trace_path",
        metavar="FILE",
        help="Trace file (any supported format), or a recording as db:[STORE]#recording=NAME[&replicas=R]"
        "[&from=S&to=S]; default: the bundled Azure conv window.",
    ),
    click.option(
        "--recording",
        expose_value=False,
        callback=_remember_recording,
        metavar="NAME",
        help="Replay a recording of the cluster's own traffic (in $TAILPILOT_DB or ./tailpilot.db).",
    ),
    click.option("--rate-scale", type=POSITIVE, help="Multiply the arrival rate by X (> 0)."),
    click.option(
        "--target-rate", type=POSITIVE, help="Rescale arrivals to this many requests/s (> 0)."
    ),
    click.option(
        "--window",
        type=TIME_SPAN,
        metavar="START:DUR",
        help="Keep arrivals in [START, START+DUR) seconds.",
    ),
    click.option(
        "--max-tokens-cap",
        "cap",
        type=TOKENS,
        metavar="N",
        help="Cap every request's output at N tokens.",
    ),
    click.option(
        "--max-tokens-default",
        type=TOKENS,
        expose_value=False,
        callback=_remember_max_tokens_default,
        metavar="N",
        help="max_tokens of requests whose trace records no cap (longer outputs are truncated to it) "
        "[default: 4096].",
    ),
    click.option("--tenants", type=TENANTS, metavar="N", help="Assign N Zipf-distributed tenants."),
    click.option(
        "--seed",
        type=SEED,
        default=0,
        show_default=True,
        help="Seed for generated arrivals and tenants.",
    ),
]
engine_options = [
    click.option(
        "--max-num-seqs",
        type=_engine_limit("max_num_seqs"),
        help="Engine: max running sequences (default: vLLM's for the step model's GPU, A100 256, H100/H200 1,024).",
    ),
    click.option(
        "--max-num-batched-tokens",
        type=_engine_limit("max_num_batched_tokens"),
        help="Engine: token budget per step (default: vLLM's for the step model's GPU, A100 2,048, H100/H200 8,192).",
    ),
    click.option(
        "--long-prefill-token-threshold",
        type=_engine_limit("long_prefill_token_threshold"),
        help="Engine: max prefill chunk (0 = off).",
    ),
    click.option(
        "--num-gpu-blocks",
        type=GPU_BLOCKS,
        help="KV cache size in blocks of 16 tokens (default 25,000).",
    ),
    click.option(
        "--step-model",
        type=STEP_MODEL,
        metavar="NAME",
        help="Step-time coefficient set (default a100-80gb/llama-3-8b/tp1).",
    ),
]
batch_options = [
    click.option(
        "--step-by-step", is_flag=True, help="Disable event skipping (slow; for checking)."
    ),
    click.option(
        "--progress/--no-progress", default=None, help="Progress bar (default: on a terminal)."
    ),
    click.option(
        "--predictor",
        type=click.Choice(["oracle", "history"]),
        default="oracle",
        show_default=True,
        help="Length predictor for sjf/srpt/tie (oracle = true lengths, as in the papers' baselines).",
    ),
]


def with_options(*groups):
    def decorate(fn):
        for opt in reversed([o for group in groups for o in group]):
            fn = opt(fn)
        return fn

    return decorate


with_trace_options = with_options(trace_options, engine_options, batch_options)


def _engine_dict(kw: dict, step_model: str | None) -> dict:
    """The engine limits given on the command line, over vLLM's defaults for the step model's GPU."""
    from sim.stepmodel import DEFAULT_MODEL_NAME, engine_defaults

    given = {
        k: kw[k]
        for k in ("max_num_seqs", "max_num_batched_tokens", "long_prefill_token_threshold")
        if kw.get(k) is not None
    }
    return {**engine_defaults(step_model or DEFAULT_MODEL_NAME), **given}


class _Main(click.Group):
    """The ``tailpilot`` group: a store that fails mid-command (a damaged file, a lock held too long)
    ends the command with a one-line error instead of a traceback, whichever command it was."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except Exception as err:
            store = sys.modules.get(
                "storage.database"
            )  # not imported: it raised nothing (and stays unloaded)
            if store is not None and isinstance(err, store.StoreError):
                raise click.ClickException(str(err)) from None
            raise


@click.group(cls=_Main)
@click.version_option(package_name="tailpilot")
def main() -> None:
    """tailpilot: tail-aware scheduling for vLLM clusters."""


@main.command()
@click.option("--policy", type=click.Choice(POLICY_NAMES), default="uniboost", show_default=True)
@click.option(
    "--set",
    "assignments",
    multiple=True,
    metavar="NAME=VALUE",
    help="Set a policy parameter (repeatable).",
)
@click.option(
    "--pin", "pins", multiple=True, metavar="NAME", help="Pin a parameter (no adaptation)."
)
@click.option("--json", "as_json", is_flag=True, help="Print the metrics as JSON.")
@click.option(
    "--autopilot",
    is_flag=True,
    help="Let the autopilot choose γ while it replays (starting from --policy's settings); "
    "prints its decisions too.",
)
@click.option(
    "--settings",
    "settings_file",
    metavar="FILE",
    type=click.Path(dir_okay=False),
    help="Replay this settings document (e.g. from `tailpilot export`) instead of --policy/--set/--pin.",
)
@with_trace_options
def sim(
    policy,
    assignments,
    pins,
    as_json,
    autopilot,
    settings_file,
    trace_path,
    rate_scale,
    target_rate,
    window,
    cap,
    tenants,
    seed,
    num_gpu_blocks,
    step_model,
    step_by_step,
    progress,
    predictor,
    **engine,
):
    """Replay a trace through the engine simulator under one policy and print its metrics."""
    if settings_file:
        ctx = click.get_current_context()
        given = [
            flag
            for flag, param in (("--policy", "policy"), ("--set", "assignments"), ("--pin", "pins"))
            if ctx.get_parameter_source(param) == click.core.ParameterSource.COMMANDLINE
        ]
        if given:
            raise click.UsageError(
                f"--settings replays a whole document: leave out {', '.join(given)}"
            )
        settings = _settings_file_or_exit(settings_file)
        policy = settings.policy
    else:
        settings = _settings_or_exit(
            policy, assignments, pins, _engine_dict(engine, step_model), predictor
        )
    trace = _load_trace_or_exit(trace_path, rate_scale, target_rate, window, cap, tenants, seed)
    config = _engine_config(num_gpu_blocks, step_model)
    show = _show_progress(progress, len(trace))
    run = _run_autopilot if autopilot else _run_one
    _, metrics, info = run((policy, trace, settings.to_dict(), config, not step_by_step, show))
    if as_json:
        echo_json(
            {"trace": trace.name, "settings": settings.to_dict(), "metrics": metrics, "run": info},
            default=float,
        )
        return
    from rich.table import Table

    from scheduler.metrics import METRICS

    table = Table(title=f"{policy} on {trace.name} ({len(trace)} requests)")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_column("unit")
    for name, value in metrics.items():
        unit = METRICS[name][1] if name in METRICS else ""
        table.add_row(name, _fmt(value), unit)
    _console().print(table)
    click.echo(
        f"simulated {info['sim_time_s']:.1f} s in {info['wall_s']:.2f} s wall "
        f"({info['steps']} steps in {info['iterations']} events)"
    )
    if autopilot:
        _print_decisions(info["autopilot"])


def _print_decisions(pilot: dict[str, Any]) -> None:
    from rich.table import Table

    table = Table(title="autopilot decisions (changes only)")
    for column in ("t (s)", "choice", "why"):
        table.add_column(column)
    for d in pilot["decisions"]:
        if d["changed"]:
            table.add_row(f"{d['at']:.0f}", d["choice"], d["reason"])
    _console().print(table)
    per = pilot["cpu_s_per_decision"]
    click.echo(
        f"{len(pilot['decisions'])} decisions, {sum(d['changed'] for d in pilot['decisions'])} changes; "
        f"controller CPU {pilot['cpu_s']:.1f} s ({per or 0:.3f} s per decision, "
        f"{pilot['cpu_s_per_hour']:.1f} s per hour of traffic)"
    )


@main.command()
@click.option(
    "--policies",
    default="fcfs,sarathi,sjf,srpt,las,uniboost,tie",
    show_default=True,
    help="Comma-separated policy names.",
)
@click.option(
    "--baseline",
    default="sarathi",
    show_default=True,
    help="Policy the others are compared against (added to --policies if missing, with a note).",
)
@click.option(
    "--set",
    "assignments",
    multiple=True,
    metavar="POLICY.NAME=VALUE",
    help="Set a parameter of one policy, e.g. uniboost.gamma=0.05 (repeatable).",
)
@click.option(
    "--jobs",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Policies simulated in parallel.",
)
@click.option("--json", "as_json", is_flag=True, help="Print metrics and changes as JSON.")
@click.option(
    "--autopilot",
    is_flag=True,
    help="Add a column: the autopilot choosing γ (from uniboost's defaults).",
)
@click.option(
    "--settings",
    "settings_files",
    metavar="A.json,B.json",
    help="Add a column per settings document (e.g. from `tailpilot export`), named by its file.",
)
@with_trace_options
def compare(
    policies,
    baseline,
    assignments,
    jobs,
    as_json,
    autopilot,
    settings_files,
    trace_path,
    rate_scale,
    target_rate,
    window,
    cap,
    tenants,
    seed,
    num_gpu_blocks,
    step_model,
    step_by_step,
    progress,
    predictor,
    **engine,
):
    """Run several policies on one trace; print each one's metrics and % change vs the baseline
    (positive = better), in the layout of Table 2 of the UNIBOOST paper."""
    from scheduler.metrics import percent_change

    names = [p.strip() for p in policies.split(",") if p.strip()]
    for n in names:
        if n not in POLICY_NAMES:
            raise click.BadParameter(
                f"unknown policy {n!r} (valid: {', '.join(POLICY_NAMES)})", param_hint="--policies"
            )
    if baseline not in names:
        names.insert(0, baseline)
        click.echo(
            f"note: the baseline {baseline} is not in --policies; comparing it too", err=True
        )
    per_policy: dict[str, list[str]] = {n: [] for n in names}
    for item in assignments:
        head, _, rest = item.partition(".")
        if head not in per_policy or not rest:
            raise click.BadParameter(
                f"{item!r}: expected POLICY.NAME=VALUE for a compared policy", param_hint="--set"
            )
        per_policy[head].append(rest)
    docs = {
        n: _settings_or_exit(
            n, per_policy[n], (), _engine_dict(engine, step_model), predictor
        ).to_dict()
        for n in names
    }
    trace = _load_trace_or_exit(trace_path, rate_scale, target_rate, window, cap, tenants, seed)
    config = _engine_config(num_gpu_blocks, step_model)
    show = _show_progress(progress, len(trace)) and jobs == 1
    for path in filter(None, (p.strip() for p in (settings_files or "").split(","))):
        label = Path(path).stem
        while label in docs:
            label += "'"
        docs[label] = _settings_file_or_exit(path).to_dict()
        names.append(label)
    tasks = [(_run_one, (n, trace, docs[n], config, not step_by_step, show)) for n in names]
    if autopilot:
        start = _settings_or_exit(
            "uniboost", per_policy.get("uniboost", []), (), _engine_dict(engine, step_model)
        )
        names.append("autopilot")
        tasks.append(
            (_run_autopilot, ("autopilot", trace, start.to_dict(), config, not step_by_step, False))
        )
    if jobs > 1:
        from concurrent.futures import ProcessPoolExecutor

        # No more processes than policies: a large --jobs must not fork that many interpreters.
        with ProcessPoolExecutor(max_workers=min(jobs, len(tasks))) as pool:
            results = list(pool.map(_call, tasks))
    else:
        results = [_call(t) for t in tasks]
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
    from rich.table import Table

    table = Table(
        title=f"{trace.name}: {len(trace)} requests; % change vs {baseline} (positive = better)"
    )
    table.add_column("policy")
    for k in COMPARE_METRICS:
        table.add_column(k, justify="right")
    for n in names:
        cells = [
            f"{changes[n][k]:+.1f}%" if n != baseline else _fmt(base[k]) for k in COMPARE_METRICS
        ]
        table.add_row(n + (" (abs)" if n == baseline else ""), *cells)
    _console().print(table)
    total_wall = sum(i["wall_s"] for i in info.values())
    click.echo(f"{len(names)} policies simulated in {total_wall:.2f} s wall")


@main.command()
@click.option(
    "--cluster",
    "cluster_file",
    required=True,
    metavar="FILE",
    type=click.Path(dir_okay=False),
    help="Cluster file whose governance block gives the tenants, their commitments and SLOs.",
)
@click.option("--cluster-name", metavar="NAME", help="Which cluster of the file.")
@click.option(
    "--policy",
    type=click.Choice(POLICY_NAMES),
    default="slofq",
    show_default=True,
    help="The replicas' policy (slofq takes the governance block's tenants as its parameters).",
)
@click.option(
    "--set",
    "assignments",
    multiple=True,
    metavar="NAME=VALUE",
    help="Set a policy parameter (repeatable).",
)
@click.option(
    "--target",
    type=FiniteFloatRange(0, 1, min_open=True),
    default=0.99,
    show_default=True,
    help="The mean per-window SCR to keep.",
)
@click.option(
    "--window-s",
    type=FiniteFloatRange(min=1),
    default=60.0,
    show_default=True,
    help="Judge SCR per window of this many seconds of arrivals.",
)
@click.option("--max-replicas", type=click.IntRange(1, 4096), default=64, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@with_options(trace_options, engine_options)
def capacity(
    cluster_file,
    cluster_name,
    policy,
    assignments,
    target,
    window_s,
    max_replicas,
    as_json,
    trace_path,
    rate_scale,
    target_rate,
    window,
    cap,
    tenants,
    seed,
    num_gpu_blocks,
    step_model,
    **engine,
):
    """How many replicas keep SCR at --target for this traffic and the cluster's SLOs (by simulation)."""
    from tailpilot.cli_cluster import load_cluster
    from tuner.capacity import capacity as plan_capacity
    from tuner.capacity import format_plan

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
    settings = _settings_or_exit(
        policy, (*base, *assignments), (), _engine_dict(engine, step_model), "history"
    )
    trace = _load_trace_or_exit(trace_path, rate_scale, target_rate, window, cap, tenants, seed)
    plan = plan_capacity(
        trace,
        params,
        settings,
        _engine_config(num_gpu_blocks, step_model),
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


@main.command()
@click.option(
    "--replicas",
    "-n",
    type=click.IntRange(1, 4096),
    default=2,
    show_default=True,
    help="Number of simulated replicas (twin-0, twin-1, ...).",
)
@click.option(
    "--speed",
    type=POSITIVE,
    default=1.0,
    show_default=True,
    help="Replica clock speed (10 = ten simulated seconds per wall second).",
)
@click.option(
    "--policy",
    type=click.Choice(POLICY_NAMES),
    default="sarathi",
    show_default=True,
    help="Start-up policy (sarathi = vLLM's own behaviour, as a plugin without a settings file).",
)
@click.option(
    "--set",
    "assignments",
    multiple=True,
    metavar="NAME=VALUE",
    help="Set a policy parameter (repeatable).",
)
@click.option(
    "--pin", "pins", multiple=True, metavar="NAME", help="Pin a parameter (no adaptation)."
)
@click.option(
    "--host", default="127.0.0.1", show_default=True, help="Address the replicas listen on."
)
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=0,
    show_default=True,
    help="First port (replica i listens on PORT+i); 0 = ephemeral ports.",
)
@click.option(
    "--token",
    envvar="TAILPILOT_TOKEN",
    help="Bearer token for writes [env TAILPILOT_TOKEN]; default: a random one, printed.",
)
@click.option(
    "--loop/--no-loop",
    default=True,
    show_default=True,
    help="Replay the trace again when it runs out.",
)
@click.option(
    "--cluster-out",
    type=click.Path(dir_okay=False, writable=True),
    help="Write a cluster YAML for the twins here.",
)
@click.option(
    "--cluster-name", default="twins", show_default=True, help="Cluster name in the YAML."
)
@with_options(trace_options, engine_options)
def twin(
    replicas,
    trace_path,
    speed,
    rate_scale,
    target_rate,
    window,
    cap,
    tenants,
    seed,
    policy,
    assignments,
    pins,
    num_gpu_blocks,
    step_model,
    host,
    port,
    token,
    loop,
    cluster_out,
    cluster_name,
    **engine,
):
    """Start simulated replicas serving the control API and vLLM's /metrics, fed by a trace in
    (accelerated) real time, until Ctrl-C or SIGTERM. Rate options apply to the whole trace,
    before it is split round-robin across the replicas."""
    import secrets
    import signal
    import threading

    from tuner.twin import start_twins

    if port and port + replicas - 1 > 65535:
        raise click.BadParameter(
            f"ports {port}..{port + replicas - 1} exceed 65535", param_hint="--port"
        )
    settings = _settings_or_exit(
        policy, assignments, pins, _engine_dict(engine, step_model), "history"
    )
    trace = _load_trace_or_exit(trace_path, rate_scale, target_rate, window, cap, tenants, seed)
    generated = token is None
    token = token or secrets.token_urlsafe(16)
    try:
        cluster = start_twins(
            replicas,
            trace,
            speed=speed,
            settings=settings,
            host=host,
            port=port,
            loop=loop,
            seed=seed,
            token=token,
            config=_engine_config(num_gpu_blocks, step_model),
            cluster_name=cluster_name,
        )
    except OSError as err:
        raise click.ClickException(f"cannot listen: {err}") from None
    except ValueError as err:
        raise click.UsageError(describe_error(err)) from None
    done = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: done.set())
    try:
        click.echo(
            f"{len(cluster)} twin replicas of {trace.name} ({len(trace)} requests"
            f"{', looping' if loop else ''}) at speed {speed:g}, policy {settings.policy}:"
        )
        for r in cluster:
            click.echo(f"  {r.name}  {r.url}")
        if cluster_out:
            cluster.write_cluster_yaml(cluster_out, cluster_name)
            click.echo(f"cluster file: {cluster_out}")
        if generated:
            click.echo(f"writes need the token: export TAILPILOT_TOKEN={token}")
        click.echo("Ctrl-C to stop.")
        try:
            while not done.wait(0.5):
                pass
        except KeyboardInterrupt:
            pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        cluster.stop()
    click.echo("stopped.")


def _load_trace_or_exit(path: str | None, *args):
    from sim.traces import TraceError

    try:
        return _load_trace(path, *args)
    except TraceError as err:
        raise click.UsageError(str(err)) from None
    except TRACE_PARSE_ERRORS as err:
        raise unreadable_trace(path, err) from None


def _show_progress(flag: bool | None, n: int) -> bool:
    if flag is not None:
        return flag
    return sys.stderr.isatty() and n >= 2000


def _console():
    from controlplane.views import wide_console

    return wide_console()


def _fmt(v: float) -> str:
    from controlplane.views import fmt_figure

    return fmt_figure(v)


@main.command()
@click.option(
    "--out",
    type=click.Path(dir_okay=False, writable=True),
    help="Write the schema here instead of printing it.",
)
def schema(out):
    """The JSON Schema of every control-API document (state, completion, steps, settings, error):
    what the plugin and the twins send and the collector reads (scheduler/contract.py)."""
    from scheduler.contract import json_schema

    text = json_text(json_schema(), sort_keys=True, ensure_ascii=False) + "\n"
    if out:
        Path(out).write_text(text, encoding="utf-8")
    else:
        click.echo(text, nl=False)


from tailpilot.cli_cluster import COMMANDS as _CLUSTER_COMMANDS  # noqa: E402 (after main exists)
from tailpilot.cli_export import COMMANDS as _EXPORT_COMMANDS  # noqa: E402
from tailpilot.cli_loop import COMMANDS as _LOOP_COMMANDS  # noqa: E402
from tailpilot.cli_tune import COMMANDS as _TUNE_COMMANDS  # noqa: E402

for _command in (*_CLUSTER_COMMANDS, *_TUNE_COMMANDS, *_EXPORT_COMMANDS, *_LOOP_COMMANDS):
    main.add_command(_command)

if __name__ == "__main__":  # pragma: no cover
    main()

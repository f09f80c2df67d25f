"""Simulated replicas: ``twin`` (serve them) and ``demo`` (serve, record and show them).

    tailpilot twin --replicas 4 --speed 10 --rate-scale 4 --cluster-out twins.yaml
    tailpilot demo                      # twin replicas on the bundled trace, recorded, shown live

A twin is the engine simulator run in (accelerated) real time behind the same control API and
``/metrics`` as a vLLM replica running the plugin (``tuner.twins.replica``). The demo also runs what
``tailpilot record --autopilot --govern`` runs (below ``demo``): the autopilot, armed on one
replica and dry-run on the others, and the governor (dry-run) over a governance block of the
demo's tenants.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import os
import secrets
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Coroutine, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from rich.console import Group
from rich.live import Live
from rich.text import Text

from controlplane.views import status_table, wide_console
from scheduler.settings import Settings, describe_error
from tailpilot import options
from tailpilot.cli_cluster import open_store, snapshot_rows
from tailpilot.cli_common import OUT_FILE, POSITIVE
from tailpilot.cli_trace import (
    EngineRequest,
    TraceRequest,
    engine_options,
    load_trace,
    settings_or_exit,
    trace_options,
)

if TYPE_CHECKING:  # the operator's modules load only when a command runs (start-up cost)
    from controlplane.cluster import ClusterSpec
    from controlplane.governance import GovernanceSpec
    from sim.traces import Trace
    from tuner.autopilot.controller import AutopilotConfig
    from tuner.autopilot.live import LiveConfig

log = logging.getLogger("tailpilot.demo")

DEMO_TOKEN_ENV = "TAILPILOT_DEMO_TOKEN"
DEMO_CLUSTER_FILE = "tailpilot-demo.yaml"
# Side by side by default, so the first screen compares vLLM's default with the tail-aware
# policies on the same traffic (tie on the history predictor: what a live replica can run).
DEMO_POLICIES = (
    {"policy": "sarathi"},
    {"policy": "uniboost"},
    {"policy": "tie", "params": {"predictor": "history"}},
    {"policy": "vtc"},
)


# --------------------------------------------------------------------------------------------
@click.command()
@options.replica_count()
@options.speed()
@options.policy(
    default="sarathi",
    help="Start-up policy [default: sarathi: a twin stands in for a vLLM replica, and sarathi is "
    "vLLM's own behaviour, as the plugin without a settings file].",
)
@options.assignments()
@options.pins()
@click.option(
    "--host", default="127.0.0.1", show_default=True, help="Address the replicas listen on."
)
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    metavar="PORT",
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
    type=OUT_FILE,
    metavar="FILE",
    help="Write a cluster file (YAML) for the twins here.",
)
@options.cluster_name(
    default="twins",
    help="The name of the twins' cluster (in --cluster-out's file and what the twins report).",
)
@trace_options
@engine_options
def twin(
    n_replicas: int,
    speed: float,
    policy: str,
    assignments: tuple[str, ...],
    pins: tuple[str, ...],
    host: str,
    port: int,
    token: str | None,
    loop: bool,
    cluster_out: str | None,
    cluster_name: str,
    trace_request: TraceRequest,
    engine: EngineRequest,
) -> None:
    """Start simulated replicas serving the control API and vLLM's /metrics, fed by a trace in
    (accelerated) real time, until Ctrl-C or SIGTERM. Rate options apply to the whole trace,
    before it is split round-robin across the replicas."""
    from tuner.twins.cluster import start_twins  # start-up cost

    if port and port + n_replicas - 1 > 65535:
        raise click.BadParameter(
            f"ports {port}..{port + n_replicas - 1} exceed 65535", param_hint="--port"
        )
    settings = settings_or_exit(policy, assignments, pins, engine.limits(), "history")
    trace = load_trace(trace_request)
    generated = token is None
    token = token or secrets.token_urlsafe(16)
    try:
        cluster = start_twins(
            n_replicas,
            trace,
            speed=speed,
            settings=settings,
            host=host,
            port=port,
            loop=loop,
            seed=trace_request.seed,
            token=token,
            config=engine.config(),
            cluster_name=cluster_name,
        )
    except OSError as err:
        ports = (
            "ephemeral ports"
            if not port
            else f"port {port}" + (f"..{port + n_replicas - 1}" if n_replicas > 1 else "")
        )
        raise click.ClickException(
            f"cannot listen on {host}, {ports}: {err.strerror or err} (another process holds it? "
            "--port 0 takes free ones)"
        ) from None
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
            # With a governance block for the trace's busiest tenants (the demo's): governance and
            # the governor can be tried on twins (record --govern refuses a cluster without one).
            governance = demo_governance(trace, 1.0).model_dump(mode="json", exclude_defaults=True)
            cluster.write_cluster_yaml(cluster_out, cluster_name, governance=governance)
            click.echo(f"cluster file: {cluster_out} (with a governance block for its tenants)")
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


# --------------------------------------------------------------------------------------------
@click.command()
@options.replica_count()
@options.trace(
    help="Trace to replay, or a recording's db: URL [default: the bundled Azure conv window]."
)
@options.speed(help="Replica clock speed (2 = twice real time).")
@options.rate_scale(
    help="Multiply the trace's arrival rate by X [default: 1.5 × replicas: every replica queues]."
)
@options.policy(
    help="Start every replica on this policy [default: side by side — sarathi (vLLM's default), "
    "uniboost, tie, vtc, round-robin]."
)
@options.database(
    default="tailpilot-demo.db",
    help="Where the demo records (a SQLite path or URL) [default: tailpilot-demo.db: its own "
    "file, never a real cluster's database].",
)
@click.option(
    "--duration",
    type=POSITIVE,
    metavar="SECONDS",
    help="Stop after this many seconds [default: until q / Ctrl-C (or SIGTERM with --no-tui)].",
)
@click.option(
    "--no-tui",
    is_flag=True,
    help="Print a status table, the autopilot's report and the tenants' figures instead of "
    "opening the TUI.",
)
def demo(
    n_replicas: int,
    trace_path: str | None,
    speed: float,
    rate_scale: float | None,
    policy: str | None,
    db: str,
    duration: float | None,
    no_tui: bool,
) -> None:
    """Start twin replicas on a trace, record them into SQLite and show them live, with the
    autopilot (armed on one uniboost replica, dry-run on the others) and the governor (dry-run,
    over the tenants' SLOs) running on them as `tailpilot record --autopilot --govern` runs
    them."""
    from controlplane.cluster import (
        ClusterFile,
        ClusterSpec,
        ReplicaSpec,
        dump_cluster_file,
    )  # start-up cost
    from sim import traces  # start-up cost
    from tuner.twins.cluster import start_twins  # start-up cost

    trace = load_trace(TraceRequest(path=trace_path))
    if len({r.tenant for r in trace}) == 1:  # three Zipf tenants: the fairness views show them
        trace = traces.assign_tenants_zipf(trace, 3, seed=0)
    os.environ.setdefault(DEMO_TOKEN_ENV, secrets.token_hex(16))
    settings = [
        Settings.model_validate(d) for d in ([{"policy": policy}] if policy else DEMO_POLICIES)
    ]
    # The bundled window is about one A100's load; at 1.5× per replica queues build and tails show.
    scale = rate_scale if rate_scale is not None else 1.5 * n_replicas
    with start_twins(
        n_replicas,
        trace,
        speed=speed,
        rate_scale=scale,
        settings=settings,
        token=os.environ[DEMO_TOKEN_ENV],
        cluster_name="demo",
    ) as twins:
        cluster = ClusterSpec(
            name="demo",
            window_s=60.0,
            # The twins answer from threads of this process, beside the collector and the
            # autopilot's projections: on a loaded machine (CI: a vLLM engine on the other core)
            # an answer took over the 2 s default and the replica read unhealthy for a poll.
            timeout_s=DEMO_TIMEOUT_S,
            slos={"ttft_p99": 2.0, "ttlt_p99": 60.0},
            governance=demo_governance(trace, scale),
            replicas=[
                ReplicaSpec(name=r.name, api_url=r.url, control_url=r.url, token_env=DEMO_TOKEN_ENV)
                for r in twins.replicas
            ],
        )
        Path(DEMO_CLUSTER_FILE).write_text(dump_cluster_file(ClusterFile(clusters=[cluster])))
        starts = {r.name: settings[i % len(settings)].policy for i, r in enumerate(twins.replicas)}
        armed = armed_replica(starts)
        controllers = demo_controllers([armed] if armed else [])
        what = (
            f"tailpilot demo: {n_replicas} twin replicas of {trace.name} at speed {speed:g} "
            f"(policies {', '.join(_policies_of(settings, n_replicas))}), recording into {db} "
            f"(cluster file {DEMO_CLUSTER_FILE}, with the tenants' SLOs); "
            f"{_controllers_text(armed, starts)}"
        )
        if not no_tui and _tui_available():
            click.echo(what, err=True)
            from tui import run_tui  # optional dependency (textual), checked by _tui_available

            run_tui(
                cluster, db_url=db, readonly=False, duration_s=duration, controllers=controllers
            )
        else:
            _announce_table(what, duration)
            _demo_table(cluster, db, duration, controllers)


def _policies_of(settings: list[Settings], n: int) -> list[str]:
    """The policies the ``n`` replicas start on (settings are taken round-robin), each once."""
    return list(dict.fromkeys(settings[i % len(settings)].policy for i in range(n)))


def _controllers_text(armed: str | None, starts: Mapping[str, str]) -> str:
    """What the demo says it runs beside the replicas: where the autopilot is armed, and the
    governor."""
    dry = [n for n, p in starts.items() if p in STEERED and n != armed]
    pilot = (
        f"the autopilot armed on {armed}"
        + (f" (dry-run on {', '.join(dry)})" if dry else "")
        + f", deciding every {DEMO_PACING['interval_s']:g} s (the demo's pacing)"
        if armed
        else "the autopilot in dry-run (no uniboost or sarathi replica to arm it on)"
    )
    return f"{pilot}; the governor in dry-run"


def _tui_available() -> bool:
    """Whether the TUI can open: its optional dependency installed and a terminal to draw on
    (``tui.main.on_a_terminal``, the condition ``run_tui`` itself holds to)."""
    if importlib.util.find_spec("textual") is None:
        return False
    from tui.main import on_a_terminal  # optional dependency (textual), present

    return on_a_terminal()


def _announce_table(what: str, duration: float | None) -> None:
    """Say once, at start, what the demo does and where its output goes: off a terminal the
    status table shows only when the demo stops, and nothing else would be printed before."""
    until = f"after {duration:g} s" if duration else "at Ctrl-C or SIGTERM"
    where = (
        "a status table redrawn every second"
        if sys.stdout.isatty()
        else f"no terminal: the status table is printed when it stops ({until})"
    )
    click.echo(
        f"{what}; {where}. Watch it from another terminal: tailpilot tui --cluster "
        f"{DEMO_CLUSTER_FILE} --readonly"
    )
    sys.stdout.flush()


def _demo_table(
    cluster: ClusterSpec, db: str, duration: float | None, controllers: Sequence[Controller] = ()
) -> None:
    """Record the cluster with the controllers running beside the collector; redraw the status
    table, the autopilot's report, the tenants' figures and the governor's state once a second."""
    from controlplane.collector import Collector  # start-up cost

    store = open_store(db)
    console = wide_console()  # piped (no terminal): a wide table, not one cut to 80 columns

    async def main() -> None:
        collector = Collector(cluster, store)
        stop = asyncio.Event()
        task = asyncio.create_task(collector.run(stop))
        running = [asyncio.create_task(c(collector, store, stop)) for c in controllers]
        end = time.monotonic() + duration if duration else None

        async def view() -> Group:
            rows, pinned = snapshot_rows(collector.snapshot().replicas.values())
            pilot, governor = await asyncio.gather(
                asyncio.to_thread(store.governance.control, "autopilot", cluster.name),
                asyncio.to_thread(store.governance.control, "governor", cluster.name),
            )
            return Group(
                status_table(rows, pinned, title=f"tailpilot demo — {db}"),
                *demo_report(
                    pilot if controllers else None,
                    governor if controllers else None,
                    collector.governance,
                ),
            )

        ended = asyncio.Event()  # SIGTERM: stop as at the end of --duration (the last view shown)
        with contextlib.suppress(NotImplementedError, RuntimeError):
            asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, ended.set)
        with Live(refresh_per_second=2, console=console) as live:
            try:
                while not ended.is_set() and (end is None or time.monotonic() < end):
                    wait = 1.0 if end is None else max(0.0, min(1.0, end - time.monotonic()))
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(ended.wait(), wait)
                    live.update(await view())
            finally:
                # The last view, what is printed off a terminal: taken while the controllers still
                # run (stopping, the governor forgets its dry-run modes).
                try:
                    last = await view()
                finally:
                    stop.set()
                    await task
                    await asyncio.gather(*running, return_exceptions=True)
                live.update(last)

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
    finally:
        store.close()


# --------------------------------------------------------------------------------------------
# What the demo runs beside its collector, as `tailpilot record --autopilot --govern` runs them
# (controllers: called with the collector, the store and the stop event, as the recorder's tasks),
# in the TUI's event loop or beside --no-tui's collector: the autopilot, armed on one replica and
# dry-run on the others, and the governor (dry-run) over the demo's tenants and their SLOs.
#
# One replica armed, the others dry-run: the autopilot's state is one control row per cluster
# (tuner.autopilot.live: armed | dry-run | disarmed, steered by `tailpilot autopilot` and the TUI's
# O). The demo runs it as `record --autopilot` does, with LiveConfig.armed_replicas naming the one
# replica that applies its decisions while the row says armed; every other replica's are carried
# out as in dry-run (the audit log, result dry-run; nothing sent). The row's dry-run and disarmed
# hold for every replica. The demo arms the first uniboost replica and leaves the sarathi one
# (vLLM's own order, the reference the others are compared with) on dry-run.
# --------------------------------------------------------------------------------------------
STEERED = ("uniboost", "sarathi")  # the policies the autopilot steers (tuner.autopilot.live)
# The autopilot's pacing in the demo, so that its decisions show within the first half minute
# (record --autopilot's defaults: interval_s 60, delay_s 60, min_requests 1,000).
DEMO_PACING: dict[str, float] = {"interval_s": 10.0, "delay_s": 10.0, "min_requests": 50}
# The demo's tenants, most requests first: commitment as a share of the tenant's own demand, and
# seed 003's multi-quantile SLOs (TTFT, TTLT). With every replica busy (the demo's 1.5× load) the
# commitments add up to about what the cluster serves, and the busiest tenant, committed half its
# demand, is the over-consumer (ω < 1). Its TTFT targets are a premium tenant's, tighter than the
# side-by-side lineup serves (P90 ~0.5 s, P99 ~1.1 s on the bundled trace): it misses them, SCR
# reads 2/3, the SCR alert fires and the governor (dry-run) says what it would do.
DEMO_TENANTS: tuple[tuple[float, dict[str, float], dict[str, float] | None], ...] = (
    (0.5, {"p50": 0.25, "p90": 0.4, "p99": 0.8}, {"p99": 60.0}),
    (0.8, {"p50": 1.0, "p90": 2.0, "p99": 4.0}, None),
    (1.0, {"p99": 10.0}, {"p99": 120.0}),
)
DEMO_WHO = "tailpilot demo"
DEMO_TIMEOUT_S = 5.0  # one poll's limit on the in-process twins (the cluster default: 2 s)
Controller = Callable[[Any, Any, asyncio.Event], Coroutine[Any, Any, None]]


def armed_replica(starts: Mapping[str, str]) -> str | None:
    """The replica the demo arms the autopilot on (replica -> start-up policy): the first running
    uniboost, else the first running sarathi (the policies it steers), else None."""
    for wanted in ("uniboost", "sarathi"):
        for name, policy in starts.items():
            if policy == wanted:
                return name
    return None


def demo_governance(trace: Trace, rate_scale: float) -> GovernanceSpec:
    """The demo's governance block: its (up to) three busiest tenants, each with a commitment sized
    on its demand in ``trace`` at ``rate_scale`` (prompt + output tokens/s, two significant digits)
    and its SLOs (``DEMO_TENANTS``); any other tenant is the default tenant. The alerts' and the
    governor's thresholds are the defaults (docs/governance.md)."""
    from controlplane.governance import GovernanceSpec  # start-up cost

    tokens: Counter[str] = Counter()
    for r in trace:
        tokens[r.tenant] += r.prompt_tokens + r.output_tokens
    span = max(trace.duration, 1.0) / rate_scale
    tenants: dict[str, Any] = {}
    for (name, n), (share, ttft, ttlt) in zip(tokens.most_common(), DEMO_TENANTS, strict=False):
        commit = max(share * n / span, 1.0)
        tenants[name] = {"commit_tok_s": float(f"{commit:.2g}"), "ttft": ttft}
        if ttlt is not None:
            tenants[name]["ttlt"] = ttlt
    return GovernanceSpec.model_validate({"tenants": tenants})


def demo_controllers(
    armed: Collection[str],
    *,
    config: AutopilotConfig | None = None,
    live: LiveConfig | None = None,
) -> list[Controller]:
    """The autopilot (armed on ``armed``; ``config`` by default the demo's pacing, ``live`` the
    driver's defaults) and the governor (dry-run)."""
    from controlplane.governor_live import governor_task  # start-up cost
    from tuner.autopilot.controller import AutopilotConfig  # start-up cost

    return [
        autopilot_controller(
            armed, config or AutopilotConfig.model_validate(DEMO_PACING), live=live
        ),
        governor_task("dry-run", who=DEMO_WHO),
    ]


def autopilot_controller(
    armed: Collection[str],
    config: AutopilotConfig | None = None,
    *,
    live: LiveConfig | None = None,
) -> Controller:
    """The autopilot as ``tailpilot record --autopilot --arm`` runs it (``run_autopilot``), armed
    on the ``armed`` replicas only (``LiveConfig.armed_replicas``). Its control row is set to
    armed and not paused first, and the last run's report cleared: the screen shows this run's
    decisions only."""

    async def controller(collector: Any, store: Any, stop: asyncio.Event) -> None:
        from tuner.autopilot.live import LiveConfig, run_autopilot  # start-up cost

        await asyncio.to_thread(
            store.governance.set_control,
            "autopilot",
            collector.cluster.name,
            state="armed",
            paused=False,
            status={},
            who=DEMO_WHO,
        )
        only = (live or LiveConfig()).model_copy(update={"armed_replicas": tuple(sorted(armed))})
        await run_autopilot(collector, store, stop, config=config, live=only)

    return controller


def demo_report(
    autopilot: Mapping[str, Any] | None,
    governor: Mapping[str, Any] | None,
    governance: Mapping[str, Any] | None,
) -> list[Text]:
    """What ``demo --no-tui`` prints under its table: the autopilot's control row as ``tailpilot
    autopilot status`` prints it (with where it is armed, the promise it keeps when its report
    gives one, and the demo's pacing), the tenants' figures as ``tailpilot status`` prints them,
    and the governor's state as ``tailpilot governor status`` does."""
    from controlplane.governor import modes_text  # start-up cost
    from controlplane.views import governance_lines  # start-up cost
    from tuner.autopilot.records import status_lines  # start-up cost

    out: list[Text] = []
    if autopilot is not None:
        status = autopilot.get("status") or {}
        lines = status_lines(dict(autopilot))
        out.append(Text(lines[0], style="bold"))
        armed = status.get("armed_replicas")
        if autopilot.get("state") == "armed" and isinstance(armed, list):
            out.append(
                Text(
                    f"  armed on {', '.join(armed) or 'no replica'} only; the others are dry-run "
                    "(their 'running' is what it would run: nothing is sent)"
                )
            )
        promise = status.get("promise")
        if promise and not any(promise in line for line in lines):  # status_lines may say it
            out.append(Text(f"  keeps: {promise}"))
        if status.get("cadence"):
            out.append(Text(f"  {status['cadence']} (the demo's pacing)", style="dim"))
        if not status.get("t_ms"):
            out.append(Text("  no report yet (it reports every 5 s)", style="dim"))
        out.extend(Text(line) for line in lines[1:])
    if governance:
        out.append(Text("tenants (their SLOs are in the cluster file):", style="bold"))
        out.extend(governance_lines(governance))
    else:
        out.append(Text("tenants: no figures yet (the collector's first window)", style="dim"))
    if governor is not None:
        status = governor.get("status") or {}
        out.append(
            Text(
                f"governor of {governor.get('cluster')}: {governor.get('state')}"
                f"{' (paused)' if governor.get('paused') else ''} · {modes_text(status)}",
                style="bold",
            )
        )
        if status.get("held"):
            out.append(Text(f"  held: {status['held']}"))
        out.extend(Text(f"  last: {line}") for line in (status.get("last") or [])[-3:])
    return out


COMMANDS: tuple[Any, ...] = (twin, demo)

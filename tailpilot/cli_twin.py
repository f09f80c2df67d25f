"""Simulated replicas: ``twin`` (serve them) and ``demo`` (serve, record and show them).

    tailpilot twin --replicas 4 --speed 10 --rate-scale 4 --cluster-out twins.yaml
    tailpilot demo                      # twin replicas on the bundled trace, recorded, shown live

A twin is the engine simulator run in (accelerated) real time behind the same control API and
``/metrics`` as a vLLM replica running the plugin (``tuner.twin``).
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import secrets
import signal
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from rich.live import Live

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
    from tuner.twin import start_twins  # start-up cost

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
    help="Stop after this many seconds [default: until q / Ctrl-C].",
)
@click.option("--no-tui", is_flag=True, help="Print a status table instead of opening the TUI.")
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
    """Start twin replicas on a trace, record them into SQLite and show them live."""
    from controlplane.cluster import (
        ClusterFile,
        ClusterSpec,
        ReplicaSpec,
        dump_cluster_file,
    )  # start-up cost
    from sim import traces  # start-up cost
    from tuner.twin import start_twins  # start-up cost

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
            slos={"ttft_p99": 2.0, "ttlt_p99": 60.0},
            replicas=[
                ReplicaSpec(name=r.name, api_url=r.url, control_url=r.url, token_env=DEMO_TOKEN_ENV)
                for r in twins.replicas
            ],
        )
        Path(DEMO_CLUSTER_FILE).write_text(dump_cluster_file(ClusterFile(clusters=[cluster])))
        in_tui = not no_tui and _tui_available()
        what = (
            f"tailpilot demo: {n_replicas} twin replicas of {trace.name} at speed {speed:g} "
            f"(policies {', '.join(_policies_of(settings, n_replicas))}), recording into {db} "
            f"(cluster file {DEMO_CLUSTER_FILE})"
        )
        if in_tui:
            click.echo(what, err=True)
            from tui import run_tui  # optional dependency (textual), checked by _tui_available

            run_tui(cluster, db_url=db, readonly=False, duration_s=duration)
        else:
            _announce_table(what, duration)
            _demo_table(cluster, db, duration)


def _policies_of(settings: list[Settings], n: int) -> list[str]:
    """The policies the ``n`` replicas start on (settings are taken round-robin), each once."""
    return list(dict.fromkeys(settings[i % len(settings)].policy for i in range(n)))


def _tui_available() -> bool:
    """Whether the TUI can open: its optional dependency installed and a terminal to draw on."""
    return importlib.util.find_spec("textual") is not None and sys.stdout.isatty()


def _announce_table(what: str, duration: float | None) -> None:
    """Say once, at start, what the demo does and where its output goes: off a terminal the
    status table shows only when the demo stops, and nothing else would be printed before."""
    until = f"after {duration:g} s" if duration else "at Ctrl-C"
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


def _demo_table(cluster: ClusterSpec, db: str, duration: float | None) -> None:
    """Record the cluster and redraw the status table once a second."""
    from controlplane.collector import Collector  # start-up cost

    store = open_store(db)
    console = wide_console()  # piped (no terminal): a wide table, not one cut to 80 columns

    async def main() -> None:
        collector = Collector(cluster, store)
        stop = asyncio.Event()
        task = asyncio.create_task(collector.run(stop))
        end = time.monotonic() + duration if duration else None
        with Live(refresh_per_second=2, console=console) as live:
            try:
                while end is None or time.monotonic() < end:
                    await asyncio.sleep(1.0)
                    rows, pinned = snapshot_rows(collector.snapshot().replicas.values())
                    live.update(status_table(rows, pinned, title=f"tailpilot demo — {db}"))
            finally:
                stop.set()
                await task

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
    finally:
        store.close()


COMMANDS: tuple[Any, ...] = (twin, demo)

"""The headless recorder and the controllers it runs: ``record``, ``governor`` and ``autopilot``.

    tailpilot record --cluster clusters.yaml --db sqlite:///tailpilot.db [--recording incident-42]
    tailpilot governor status --cluster clusters.yaml --db tailpilot.db   # or --cluster-name prod
    tailpilot autopilot arm --cluster-name prod --db tailpilot.db

``record`` is the one entry point of the recorder (``controlplane.recorder.run_recorder``): it
polls every replica, writes to the database until SIGTERM or Ctrl-C, flushes, and prints its
statistics as one JSON line. The governor and the autopilot run inside it (``--govern``,
``--autopilot``); ``governor`` and ``autopilot`` steer them through the database.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from pydantic import ValidationError

from scheduler.plugin.wire import parse_json_body, read_capped
from scheduler.settings import describe_error
from storage.control import CONTROL_ACTIONS, ControllerName
from tailpilot import options
from tailpilot.cli_cluster import known_cluster, load_cluster, open_store
from tailpilot.cli_common import (
    POSITIVE,
    TRACE_PARSE_ERRORS,
    FiniteFloatRange,
    echo_json,
    json_text,
    unreadable_trace,
)

if TYPE_CHECKING:  # the operator's modules load only when a command runs (start-up cost)
    from controlplane.cluster import ClusterSpec
    from controlplane.collector import Collector
    from controlplane.recorder import Task
    from storage.store import Store

LOG_FORMAT = "%(asctime)s %(levelname)s %(message)s"
MAX_CONFIG_BYTES = 1024 * 1024  # an autopilot configuration: a few hundred bytes


def configure_logging(quiet: bool, verbose: bool) -> None:
    """The recorder's log on stderr: its own lines (start, health changes, retention) at INFO,
    warnings only with ``quiet``; Alembic's line per migration step only with ``verbose`` (every
    start would otherwise open with them)."""
    if quiet and verbose:
        raise click.UsageError("give --quiet or --verbose, not both")
    logging.basicConfig(
        level=logging.WARNING if quiet else logging.INFO, format=LOG_FORMAT, stream=sys.stderr
    )
    logging.getLogger("alembic").setLevel(logging.INFO if verbose else logging.WARNING)


def recording_name(recording: str | None, old_name: str | None) -> str | None:
    """--recording, or the old ``--name`` spelling of it (with a note on stderr)."""
    if old_name is None:
        return recording
    if recording is not None:
        raise click.UsageError("--name is the old --recording: give one of them")
    click.echo(f"note: --name is now --recording {old_name} (docs/cli.md)", err=True)
    return old_name


# --------------------------------------------------------------------------------------------
@click.command()
@options.cluster_file()
@options.cluster_name()
@options.database()
@options.recording(help="Also make this run a named recording NAME (retention keeps it).")
@click.option("--name", "old_name", hidden=True, metavar="NAME")  # the old --recording
@click.option(
    "--raw-hours",
    type=FiniteFloatRange(0, 10 * 365 * 24, min_open=True),
    metavar="HOURS",
    help="Retention: keep raw samples this many hours, then 1-minute rollups.",
)
@click.option(
    "--govern",
    is_flag=True,
    help="Also run the governor (the cluster's emergency modes); dry-run unless --arm.",
)
@options.autopilot(
    help="Also run the autopilot (chooses each uniboost/sarathi replica's γ online); dry-run "
    "unless --arm."
)
@click.option(
    "--autopilot-config",
    type=click.Path(dir_okay=False, exists=True),
    metavar="FILE",
    help='--autopilot: its knobs, a JSON object of AutopilotConfig fields (README, "The '
    'autopilot").',
)
@click.option(
    "--arm",
    is_flag=True,
    help="Arm the controllers started with --govern / --autopilot (they apply "
    "their changes; without it they only write them to the audit log).",
)
@click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    metavar="PORT",
    help="Serve the tailpilot_* Prometheus page at :PORT/metrics (0: any free port; 9464 by "
    "convention).",
)
@click.option(
    "--metrics-host",
    default="127.0.0.1",
    show_default=True,
    help="Address the Prometheus page listens on (0.0.0.0 in a pod).",
)
@click.option(
    "--flush-interval",
    type=POSITIVE,
    default=1.0,
    show_default=True,
    metavar="SECONDS",
    help="Write what was polled to the database this often.",
)
@click.option(
    "--metrics-every",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    metavar="N",
    help="Read /metrics of plugin replicas every N polls.",
)
@click.option("--quiet", "-q", is_flag=True, help="Log warnings and errors only.")
@click.option(
    "--verbose", "-v", is_flag=True, help="Also log the database's migration steps (Alembic)."
)
def record(
    cluster_file: str,
    cluster_name: str | None,
    db: str | None,
    recording: str | None,
    old_name: str | None,
    raw_hours: float | None,
    govern: bool,
    autopilot: bool,
    autopilot_config: str | None,
    arm: bool,
    metrics_port: int | None,
    metrics_host: str,
    flush_interval: float,
    metrics_every: int,
    quiet: bool,
    verbose: bool,
) -> None:
    """Record the cluster into the database until SIGTERM or Ctrl-C (headless collector), then
    print the run's statistics as one JSON line. Exit status 0 after a clean stop, 1 when the
    database refused a write (what was committed before is intact), 2 for bad input."""
    from controlplane.recorder import run_recorder  # start-up cost

    recording = recording_name(recording, old_name)
    configure_logging(quiet, verbose)
    cluster = load_cluster(cluster_file, cluster_name)
    if arm and not (govern or autopilot):
        raise click.UsageError("--arm goes with --govern or --autopilot")
    if autopilot_config and not autopilot:
        raise click.UsageError("--autopilot-config goes with --autopilot")
    state = "armed" if arm else "dry-run"
    tasks = [autopilot_task(autopilot_config, state)] if autopilot else []
    if govern and cluster.governance is None:
        raise click.UsageError(
            f"cluster {cluster.name!r} has no governance block: nothing to govern"
        )
    retention = None
    if raw_hours is not None:
        from storage.retention import RetentionSettings  # start-up cost

        retention = RetentionSettings(raw_sample_hours=raw_hours)
    if metrics_port:  # a busy port is refused before the database is created or opened
        _check_port(metrics_host, metrics_port)
    open_store(db).close()  # a bad URL is a usage error before anything starts
    try:
        stats = run_recorder(
            cluster,
            db or os.environ.get(options.DB_ENV),
            recording_name=recording,
            retention=retention,
            flush_interval_s=flush_interval,
            metrics_every=metrics_every,
            govern=state if govern else None,
            metrics=(metrics_host, metrics_port) if metrics_port is not None else None,
            tasks=tasks,
        )
    except OSError as err:
        if metrics_port is None:
            raise
        raise click.ClickException(
            f"cannot serve /metrics on {metrics_host}:{metrics_port}: {err.strerror or err}"
        ) from None
    echo_json(stats.as_dict(), default=str, indent=None)


def _check_port(host: str, port: int) -> None:
    """ClickException naming the address when ``host:port`` cannot be listened on now (the
    recorder binds it again when it starts: a port taken in between is still named then)."""
    import socket  # start-up cost: only with --metrics-port

    try:
        with socket.create_server((host, port)):
            pass
    except OSError as err:
        raise click.ClickException(
            f"cannot serve /metrics on {host}:{port}: {err.strerror or err}"
        ) from None


def autopilot_task(config_file: str | None, state: str) -> Task:
    """The recorder task that runs the autopilot, its control row set to ``state`` first; a bad
    config file is a usage error naming the field before anything starts."""
    from tuner.autopilot.controller import AutopilotConfig  # start-up cost

    config = None
    if config_file:
        try:
            data = read_capped(config_file, MAX_CONFIG_BYTES, "autopilot configuration")
            parse_json_body(data)  # a key given twice, NaN, bad JSON: refused, never "the last"
            # Strict: "60" is not a number and "yes" not a boolean.
            config = AutopilotConfig.model_validate_json(data, strict=True)
        except ValidationError as err:
            raise click.BadParameter(describe_error(err), param_hint="--autopilot-config") from None
        except (OSError, ValueError) as err:
            why = (
                (err.strerror or err)
                if isinstance(err, OSError)
                else str(err).removeprefix("body: ")
            )
            raise click.BadParameter(
                f"{config_file}: {why}", param_hint="--autopilot-config"
            ) from None

    async def task(collector: Collector, store: Store, stop: asyncio.Event) -> None:
        from tuner.autopilot.live import run_autopilot  # start-up cost

        await asyncio.to_thread(
            store.governance.set_control,
            "autopilot",
            collector.cluster.name,
            state=state,
            who="autopilot start",
        )
        await run_autopilot(collector, store, stop, config=config)

    return task


# --------------------------------------------------------------------------------------------
def steered_cluster_options(what: str) -> options.Decorator:
    """How ``governor`` and ``autopilot`` name the cluster they steer: by its file, as every
    cluster command does, or by its name alone (the database knows it)."""
    return options.stack(
        options.cluster_file(
            required=False, help=f"The cluster file of the cluster {what} runs on."
        ),
        options.cluster_name(
            help=f"The cluster {what} runs on, by name: which cluster of --cluster, or, without "
            "it, as the database recorded it."
        ),
    )


def steered_cluster(
    cluster_file: str | None, cluster_name: str | None
) -> tuple[str, str, ClusterSpec | None]:
    """(the steered cluster's name, the option that named it, the cluster file's cluster when a
    file named it)."""
    if cluster_file is not None:
        cluster = load_cluster(cluster_file, cluster_name)
        return cluster.name, "--cluster", cluster
    if cluster_name is not None:
        return cluster_name, "--cluster-name", None
    raise click.UsageError(
        "name the cluster: --cluster FILE, or --cluster-name NAME as the database recorded it"
    )


def caller(who: str | None) -> str:
    return who or f"cli:{os.environ.get('USER', 'unknown')}"


# --------------------------------------------------------------------------------------------
# The cluster's controllers (the governor, the autopilot) share one control table and one command
# shape: ``tailpilot governor|autopilot status|arm|dry-run|pause|resume|disarm``.
CONTROL_HELP = {
    "status": "Its state, what it last decided and why.",
    "arm": "Apply its decisions through the control API (audited, verified).",
    "dry-run": "Only write its decisions to the audit log (the default).",
    "pause": "Hold it: it keeps watching and applies nothing.",
    "resume": "Undo pause.",
    "disarm": "Stop it.",
}


@click.group()
def governor() -> None:
    """The governor of a cluster (it runs in `tailpilot record --govern`): status, arm, dry-run,
    disarm [--keep], pause, resume. Disarm, pause and dry-run undo every change the governor
    applied, at its next evaluation (`disarm --keep` keeps them, and `status` says so). The
    cluster must be one the database has recorded, and the database must exist: a mistyped name
    or path is an error (exit 2), never a new control row or a new, empty database."""


@click.group()
def autopilot() -> None:
    """The autopilot: steer the one running in `tailpilot record --autopilot` (status, arm,
    dry-run, disarm, pause, resume), or tune its own knobs on traces (tune). Disarm drops its
    simulators (arming starts them afresh)."""


def _governor_has_governance(name: str, cluster_file: str | None, cluster: ClusterSpec) -> None:
    """A governor with nothing to govern is not armed (nor put in dry-run): its cluster file
    declares no governance block."""
    if cluster.governance is None:
        raise click.UsageError(
            f"cluster {name!r} has no governance block in {cluster_file}: the governor has no "
            "tenants or SLOs to keep (add governance: — README, 'Governance' — and run "
            "tailpilot record --govern)"
        )


def _governor_has_figures(name: str, store: Store) -> None:
    """Likewise when the cluster is named without its file: the database has recorded no
    governance figures of it."""
    if not store.governance.windows(name, limit=1):
        raise click.UsageError(
            f"cluster {name!r} has no governance figures recorded: the governor has nothing "
            "to govern (its cluster file needs a governance: block, and tailpilot record "
            "--govern records them)"
        )


def _governor_lines(row: dict[str, Any], keep: bool) -> list[str]:
    from controlplane.governor import modes, modes_text  # start-up cost

    status = row.get("status") or {}
    lines = [
        f"governor of {row['cluster']}: {row['state']}{' (paused)' if row['paused'] else ''}"
        f"{'' if not row.get('who') else ' · set by ' + str(row['who'])}; {modes_text(status)}"
    ]
    applied, _ = modes(status)
    if applied and (row["paused"] or (row["state"] != "armed" and not keep)):
        lines.append(f"  undoing {', '.join(applied)} at the governor's next evaluation")
    elif applied and keep:
        lines.append(f"  keeping {', '.join(applied)} applied (disarm without --keep undoes them)")
    lines.extend(f"  last: {line}" for line in status.get("last") or [])
    return lines


def _autopilot_lines(row: dict[str, Any], keep: bool) -> list[str]:
    from tuner.autopilot.records import status_lines  # start-up cost

    return status_lines(row)


def control_command(group: click.Group, controller: ControllerName, action: str) -> click.Command:
    """``tailpilot CONTROLLER ACTION``: set (or, for status, read) the controller's control row.
    The governor's disarm takes ``--keep`` (keep the changes it applied); its arm and dry-run
    need a cluster it can govern."""
    is_governor = controller == "governor"
    keeps = is_governor and action == "disarm"

    def command(
        cluster_file: str | None,
        cluster_name: str | None,
        db: str | None,
        who: str | None,
        as_json: bool,
        keep: bool = False,
    ) -> None:
        name, option, cluster = steered_cluster(cluster_file, cluster_name)
        steers = is_governor and action in ("arm", "dry-run")
        if steers and cluster is not None:
            _governor_has_governance(name, cluster_file, cluster)
        store = open_store(db, must_exist=True)  # a mistyped path is an error, never a new file
        try:
            known_cluster(store, name, option)  # ... and a mistyped cluster, never a new row
            if steers and cluster is None:
                _governor_has_figures(name, store)
            changes = dict(CONTROL_ACTIONS[action])
            if is_governor and action in ("disarm", "arm", "dry-run"):
                # The governor reads the keep flag in its status at its next evaluation.
                status = store.governance.control(controller, name).get("status") or {}
                changes["status"] = {**status, "keep": keep}
            row = (
                store.governance.set_control(controller, name, who=caller(who), **changes)
                if changes
                else store.governance.control(controller, name)
            )
        finally:
            store.close()
        if as_json:
            echo_json(row, default=str, indent=None)
            return
        show = _governor_lines if is_governor else _autopilot_lines
        for line in show(row, keep):
            click.echo(line)

    help_text = CONTROL_HELP[action]
    if is_governor and action == "disarm":
        help_text += (
            " Every change it applied is undone at its next evaluation (--keep keeps them)."
        )
    decorators: list[Any] = [
        group.command(name=action, help=help_text),
        steered_cluster_options(f"the {controller}"),
        options.database(),
        options.who(help=f"Name in the {controller}'s control row [default: $USER]."),
        options.json_output("the control row"),
    ]
    if keeps:
        decorators.append(
            click.option(
                "--keep",
                is_flag=True,
                help="Keep the changes the governor applied (by default disarm, pause and a "
                "recorder stop undo them).",
            )
        )
    decorated: Any = command
    for decorate in reversed(decorators):
        decorated = decorate(decorated)
    assert isinstance(decorated, click.Command)
    return decorated


for _action in CONTROL_ACTIONS:
    control_command(governor, "governor", _action)
    control_command(autopilot, "autopilot", _action)


@autopilot.command(name="tune")
@options.trace(
    several=True,
    help="Traces to tune on, comma-separated [default: the bundled Azure conv window].",
)
@options.trials(default=20, maximum=10_000, help="Trials to run.")
@options.seed(help="Seed of the sampler and of generated arrivals.")
@options.out_file(help="Write the configuration here (for `record --autopilot-config FILE`).")
@options.json_output("the result")
def autopilot_tune(
    trace_paths: str | None, trials: int, seed: int, out: str | None, as_json: bool
) -> None:
    """Tune the autopilot's own knobs (margins, dwell, window, interval, delay) on continuous
    replays of the traces: P95 TTFT against sarathi's, with the P99 TTLT and throughput guards."""
    from sim import traces as tr  # start-up cost
    from tuner.autopilot.tune import tune_autopilot  # start-up cost

    loaded = []
    for path in [p.strip() for p in (trace_paths or "bundled").split(",") if p.strip()]:
        try:
            loaded.append(
                tr.load_bundled() if path == "bundled" else tr.load_trace(path, seed=seed)
            )
        except (tr.TraceError, OSError) as err:
            raise click.BadParameter(str(err), param_hint="--trace") from None
        except TRACE_PARSE_ERRORS as err:
            raise unreadable_trace(path, err) from None
    result = tune_autopilot(loaded, trials=trials, seed=seed)
    if out:
        Path(out).write_text(json_text(result["config"], indent=2) + "\n", encoding="utf-8")
    if as_json:
        echo_json(result)
        return
    f, s0 = result["figures"], result["start"]
    click.echo(
        f"{result['trials']} trials; best #{result['trial']}: P95 TTFT "
        f"{f['ttft_p95_ratio']:.3f}x sarathi (default configuration "
        f"{s0['ttft_p95_ratio']:.3f}x), P99 TTLT {f['ttlt_p99_ratio']:.3f}x, "
        f"throughput {f['throughput_ratio']:.3f}x"
    )
    click.echo("config: " + json_text(result["config"]) + (f" (written to {out})" if out else ""))


COMMANDS: tuple[click.Command, ...] = (record, governor, autopilot)

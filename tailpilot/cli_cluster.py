"""Commands that talk to a cluster: ``record``, ``status``, ``set`` and ``demo``.

    tailpilot status --cluster clusters.yaml [--json]
    tailpilot set --cluster clusters.yaml --replica a100-0 --policy uniboost --set gamma=0.05 --pin gamma
    tailpilot record --cluster clusters.yaml --db sqlite:///tailpilot.db
    tailpilot demo                      # twin replicas on the bundled trace, recorded, shown live

Everything here is a thin layer over the library (``controlplane.collector``,
``controlplane.recorder``, ``tuner.twin``, ``storage``), so what the CLI prints is reachable from
Python too. Exit status: 0 on success, 1 when a replica refused or could not be reached or a
command did not do what was asked (``set --preview`` not confirmed), 2 for bad input (click's usage
errors: an unknown cluster, replica or database file, a value out of range).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import sys
import time
from pathlib import Path

import click

from scheduler.settings import POLICY_NAMES, Settings, describe_error, parse_assignment
from tailpilot.cli_common import (
    POSITIVE,
    TRACE_PARSE_ERRORS,
    FiniteFloatRange,
    echo_json,
    json_text,
    unreadable_trace,
)

DB_ENV = "TAILPILOT_DB"  # default database URL when --db is not given

cluster_options = [
    click.option(
        "--cluster",
        "cluster_file",
        required=True,
        metavar="FILE",
        type=click.Path(dir_okay=False),
        help="Cluster file (YAML) listing the replicas.",
    ),
    click.option(
        "--cluster-name",
        metavar="NAME",
        help="Which cluster of the file (needed when it has several).",
    ),
]


def with_cluster_options(fn):
    for opt in reversed(cluster_options):
        fn = opt(fn)
    return fn


def load_cluster(cluster_file: str, cluster_name: str | None):
    from controlplane.cluster import ClusterFileError, load_cluster_file

    try:
        return load_cluster_file(cluster_file).cluster(cluster_name)
    except ClusterFileError as err:
        raise click.UsageError(str(err)) from None
    except KeyError as err:
        raise click.BadParameter(str(err.args[0]), param_hint="--cluster-name") from None


def open_store(db: str | None, *, must_exist: bool = False):
    """The store at ``db`` (default ``$TAILPILOT_DB`` or ./tailpilot.db). ``must_exist``: the command
    only reads, so a SQLite file that does not exist is a usage error naming --db and the path
    (opening it would create an empty database) instead of a new, empty store."""
    from storage.database import StoreOpenError
    from storage.store import Store

    url = db or os.environ.get(DB_ENV)
    if must_exist:
        require_database(url, "--db")
    try:
        return Store.open(url)
    except StoreOpenError as err:
        raise click.UsageError(str(err)) from None


def require_database(url: str | None, option: str) -> None:
    """BadParameter on ``option`` naming the path when ``url`` is a SQLite file that does not exist
    (``storage.engine.require_existing``): what a command that only reads checks before opening."""
    from storage.engine import DatabaseMissing, require_existing

    try:
        require_existing(url)
    except DatabaseMissing as err:
        hint = f" (give {option} URL or set ${DB_ENV})" if option == "--db" else ""
        raise click.BadParameter(f"{err}{hint}", param_hint=option) from None


def known_cluster(store, cluster_name: str) -> None:
    """BadParameter on --cluster-name unless the store has recorded ``cluster_name``; it lists the
    clusters the store knows (or says it knows none)."""
    from storage.engine import is_sqlite, redact

    known = store.recordings.clusters()
    if cluster_name in known:
        return
    url = store.database.engine.url
    where = url.database if is_sqlite(url) else redact(url)
    if not known:
        raise click.BadParameter(
            f"no cluster {cluster_name!r}: {where} has no cluster recorded "
            "(tailpilot record --cluster FILE records one)",
            param_hint="--cluster-name",
        )
    shown = ", ".join(known[:20]) + (f", ... ({len(known)} in all)" if len(known) > 20 else "")
    raise click.BadParameter(
        f"no cluster {cluster_name!r} in {where} (known: {shown})", param_hint="--cluster-name"
    )


def _unhealthy_row(name: str, reason: str | None):
    from storage.rows import SampleRow

    return SampleRow(replica=name, t_ms=int(time.time() * 1000), healthy=False, reason=reason)


def snapshot_rows(snapshots) -> tuple[list, dict[str, list[str]]]:
    """(SampleRow per replica, pinned parameters per replica) from collector snapshots."""
    rows, pinned = [], {}
    for snap in snapshots:
        row = (
            snap.sample
            if snap.sample is not None
            else _unhealthy_row(snap.name, snap.health.reason)
        )
        if not snap.health.healthy:
            row.healthy, row.reason = False, snap.health.reason
        rows.append(row)
        pinned[snap.name] = list((snap.settings or {}).get("pinned", []))
    return rows, pinned


# --------------------------------------------------------------------------------------------
@click.command()
@with_cluster_options
@click.option("--json", "as_json", is_flag=True, help="Print the state as JSON.")
def status(cluster_file, cluster_name, as_json):
    """Poll every replica once and print the cluster's live state."""
    from controlplane.collector import poll_cluster_once
    from controlplane.views import governance_lines, sample_json, status_table

    cluster = load_cluster(cluster_file, cluster_name)
    # With completions: the replica's recent ones give the window's exact percentiles in one poll.
    snap = asyncio.run(poll_cluster_once(cluster))
    rows, pinned = snapshot_rows(list(snap.replicas.values()))
    if as_json:
        doc = sample_json(rows)
        doc["cluster"] = cluster.name
        for rep in doc["replicas"]:
            rep["pinned"] = pinned.get(rep["replica"], [])
        doc["governance"] = snap.governance
        echo_json(doc, default=str)
    else:
        from controlplane.views import wide_console

        console = wide_console()
        console.print(status_table(rows, pinned, title=f"cluster {cluster.name}"))
        for line in governance_lines(snap.governance):
            console.print(line)
    if not all(r.healthy for r in rows):
        sys.exit(1)


# --------------------------------------------------------------------------------------------
def build_change(
    policy: str | None, assignments: tuple[str, ...], pins: tuple[str, ...], unpins: tuple[str, ...]
):
    """A function from a replica's current settings to the new ones (raises ValueError on bad input)."""
    parsed = [parse_assignment(a) for a in assignments]

    def change(current: Settings) -> Settings:
        new_policy = policy or current.policy
        doc = current.to_dict()
        if new_policy != current.policy:  # another policy: its defaults, then the flags
            doc.update(policy=new_policy, params={}, pinned=[])
        for name, value in parsed:
            if name.startswith("engine.") or name in doc["engine"]:
                doc["engine"][name.removeprefix("engine.")] = value
            else:
                doc["params"][name] = value
        doc["pinned"] = sorted((set(doc["pinned"]) | set(pins)) - set(unpins))
        return Settings.model_validate(doc)

    return change


@click.command(name="set")
@with_cluster_options
@click.option(
    "--replica", "replicas", multiple=True, metavar="NAME", help="Replica to change (repeatable)."
)
@click.option("--all", "all_replicas", is_flag=True, help="Change every replica of the cluster.")
@click.option("--policy", type=click.Choice(POLICY_NAMES), help="Switch to this policy.")
@click.option(
    "--set",
    "assignments",
    multiple=True,
    metavar="NAME=VALUE",
    help="Set a parameter (or engine.max_num_seqs=...) (repeatable).",
)
@click.option(
    "--pin",
    "pins",
    multiple=True,
    metavar="NAME",
    help="Pin a parameter: adaptation leaves it alone.",
)
@click.option("--unpin", "unpins", multiple=True, metavar="NAME", help="Unpin a parameter.")
@click.option(
    "--db", metavar="URL", help=f"Database for the audit log (default ${DB_ENV} or ./tailpilot.db)."
)
@click.option("--who", default=None, help="Name in the audit log (default: $USER).")
@click.option(
    "--wait",
    "wait_s",
    type=FiniteFloatRange(0, 300),
    default=5.0,
    show_default=True,
    metavar="SECONDS",
    help="How long to wait for each replica to run the new settings.",
)
@click.option(
    "--preview",
    is_flag=True,
    help="First predict the change on each replica's last --minutes of recorded traffic (replayed "
    "warm, current vs proposed settings), show it with the simulator's error band on that "
    "replica, and ask before applying; the prediction is kept for `tailpilot verify`.",
)
@click.option(
    "--minutes",
    type=FiniteFloatRange(0.5, 7 * 24 * 60),
    default=10.0,
    show_default=True,
    help="--preview: minutes of recorded traffic to predict on (and to verify on afterwards).",
)
@click.option("--yes", is_flag=True, help="--preview: apply without asking.")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
def set_command(
    cluster_file,
    cluster_name,
    replicas,
    all_replicas,
    policy,
    assignments,
    pins,
    unpins,
    db,
    who,
    wait_s,
    preview,
    minutes,
    yes,
    as_json,
):
    """Change replicas' settings through the control API, wait until they run them, and audit the change.

    Exit status 0 when every replica runs the new settings, 3 when all accepted them but some have
    not applied them yet (staged: a replica applies a document at its next scheduling step), 1 when
    any refused them or could not be reached, or nothing was applied (--preview without a
    prediction, or not confirmed)."""
    from controlplane.steering import apply_settings

    if bool(replicas) == all_replicas:
        raise click.UsageError("name replicas with --replica NAME (repeatable) or use --all")
    if not (policy or assignments or pins or unpins):
        raise click.UsageError("nothing to change: give --policy, --set, --pin or --unpin")
    try:
        change = build_change(policy, assignments, pins, unpins)
    except ValueError as err:
        raise click.UsageError(describe_error(err)) from None
    except RecursionError:  # a JSON value past Python's recursion limit
        raise click.BadParameter("a value nested too deeply", param_hint="--set") from None
    cluster = load_cluster(cluster_file, cluster_name)
    for name in replicas:
        try:
            cluster.replica(name)
        except KeyError as err:
            raise click.BadParameter(str(err.args[0]), param_hint="--replica") from None
    store = open_store(db)
    names = [r.name for r in cluster.replicas] if all_replicas else list(replicas)
    try:
        predictions = {}
        if preview:
            predictions = _preview(cluster, names, change, store, minutes, as_json)
            if not predictions:  # each replica's reason is on stderr above
                raise click.ClickException("not applied: no replica could be previewed")
            # Not applied is not what was asked: exit 1 (ClickException), never 0.
            if not yes:
                if not sys.stdin.isatty():
                    raise click.ClickException("not applied: confirm on a terminal, or give --yes")
                if not click.confirm("apply these settings?", default=False):
                    raise click.ClickException("not applied: declined at the prompt")
        applied_ms = int(time.time() * 1000)
        results = asyncio.run(
            apply_settings(
                cluster, names, change, store, who or os.environ.get("USER") or "cli", wait_s=wait_s
            )
        )
        for r in results:
            if r.ok and r.replica in predictions:  # kept with the change, for `tailpilot verify`
                predictions[r.replica]["prediction_id"] = store.tuner.store_prediction(
                    cluster.name,
                    r.replica,
                    predictions[r.replica],
                    t_ms=applied_ms,
                    version=r.version,
                )
    finally:
        store.close()
    if as_json:
        echo_json(
            [
                {
                    "replica": r.replica,
                    "result": r.result,
                    "message": r.message,
                    "version": r.version,
                    "settings": r.new,
                    "restart_required": r.restart_required,
                    **({"prediction": predictions[r.replica]} if r.replica in predictions else {}),
                }
                for r in results
            ]
        )
    else:
        colour = {"applied": {"fg": "green"}, "staged": {"fg": "yellow"}}
        for r in results:
            word = click.style(r.result, **colour.get(r.result, {"fg": "red", "bold": True}))
            click.echo(f"{r.replica}: {word}: {r.message}")
    if not all(r.ok for r in results):
        sys.exit(1)
    if any(r.result == "staged" for r in results):
        sys.exit(3)


def _preview(cluster, names, change, store, minutes: float, as_json: bool) -> dict[str, dict]:
    """Each target's prediction (printed unless --json); {} when none could be made."""
    import json

    import httpx

    from controlplane.http import get_sync, sync_client
    from controlplane.replica_http import MAX_STATE_BYTES, control_base
    from scheduler.contract import SettingsAnswer, read
    from storage.strict_json import finite
    from tuner.calibrate import ReplicaUnreachable, fetch_engine_facts
    from tuner.whatif import WhatIfError, format_prediction, predict

    out = {}
    for name in names:
        spec = cluster.replica(name)
        try:
            with sync_client(cluster.timeout_s) as client:
                answer = get_sync(
                    client, control_base(spec) + "/settings", MAX_STATE_BYTES, "GET settings"
                )
            current = Settings.model_validate(
                read(SettingsAnswer, json.loads(answer.content)).settings
            )
            proposed = change(current)
            proposed = (
                proposed if isinstance(proposed, Settings) else Settings.model_validate(proposed)
            )
        except (httpx.HTTPError, ValueError) as err:
            click.echo(f"{name}: no preview: cannot read its settings ({err})", err=True)
            continue
        try:
            facts = fetch_engine_facts(spec.control_url, timeout=cluster.timeout_s)
        except ReplicaUnreachable:
            facts = None
        try:
            p = finite(
                predict(
                    store,
                    cluster.name,
                    name,
                    current,
                    proposed,
                    now_ms=int(time.time() * 1000),
                    minutes=minutes,
                    engine_facts=facts,
                )
            )
        except WhatIfError as err:
            click.echo(f"{name}: no preview: {err}", err=True)
            continue
        out[name] = p
        if not as_json:
            click.echo(format_prediction(p))
    return out


@click.command()
@with_cluster_options
@click.option(
    "--db",
    metavar="URL",
    help=f"Database URL or SQLite path (default ${DB_ENV} or ./tailpilot.db).",
)
@click.option(
    "--replica", "replicas", multiple=True, metavar="NAME", help="Only these replicas (repeatable)."
)
@click.option("--json", "as_json", is_flag=True, help="Print the verifications as JSON.")
def verify(cluster_file, cluster_name, db, replicas, as_json):
    """Realized vs predicted for every change applied with a prediction (`set --preview`): once its
    window has passed, the traffic that came after the change is replayed under the old settings
    (the counterfactual) and the replica's real figures are compared with it."""
    from storage.strict_json import finite
    from tuner.whatif import format_verification
    from tuner.whatif import verify as run_verify

    cluster = load_cluster(cluster_file, cluster_name)
    for name in replicas:
        try:
            cluster.replica(name)
        except KeyError as err:
            raise click.BadParameter(str(err.args[0]), param_hint="--replica") from None
    store = open_store(db, must_exist=True)  # it only reads: a mistyped path creates nothing
    try:
        kept = [
            p
            for p in store.tuner.predictions(cluster.name)
            if not replicas or p["replica"] in replicas
        ]
        now_ms = int(time.time() * 1000)
        out = [finite(run_verify(store, p, now_ms=now_ms)) for p in kept]
    finally:
        store.close()
    if as_json:
        echo_json(out)
        return
    if not out:
        click.echo("no change was applied with a prediction (tailpilot set --preview)")
    for v in out:
        click.echo(format_verification(v))


# --------------------------------------------------------------------------------------------
@click.command()
@with_cluster_options
@click.option(
    "--db",
    metavar="URL",
    help=f"Database URL or SQLite path (default ${DB_ENV} or ./tailpilot.db).",
)
@click.option(
    "--name", "recording_name", metavar="NAME", help="Also mark the run as a named recording."
)
@click.option(
    "--raw-hours",
    type=FiniteFloatRange(0, 10 * 365 * 24, min_open=True),
    help="Retention: keep raw samples this many hours, then 1-minute rollups.",
)
@click.option(
    "--govern",
    is_flag=True,
    help="Also run the governor (the cluster's emergency modes); dry-run unless --arm.",
)
@click.option(
    "--autopilot",
    is_flag=True,
    help="Also run the autopilot (chooses each uniboost/sarathi replica's γ online); dry-run unless --arm.",
)
@click.option(
    "--autopilot-config",
    type=click.Path(dir_okay=False, exists=True),
    metavar="FILE",
    help='--autopilot: its knobs, a JSON object of AutopilotConfig fields (README, "The autopilot").',
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
    help="Serve the tailpilot_* Prometheus page at :PORT/metrics (0: any free port; 9464 by convention).",
)
@click.option(
    "--metrics-host",
    default="127.0.0.1",
    show_default=True,
    help="Address the Prometheus page listens on (0.0.0.0 in a pod).",
)
def record(
    cluster_file,
    cluster_name,
    db,
    recording_name,
    raw_hours,
    govern,
    autopilot,
    autopilot_config,
    arm,
    metrics_port,
    metrics_host,
):
    """Record the cluster into the database until SIGTERM or Ctrl-C (headless collector)."""
    import logging

    from controlplane.recorder import run_recorder

    cluster = load_cluster(cluster_file, cluster_name)
    if arm and not (govern or autopilot):
        raise click.UsageError("--arm goes with --govern or --autopilot")
    if autopilot_config and not autopilot:
        raise click.UsageError("--autopilot-config goes with --autopilot")
    tasks = [autopilot_task(autopilot_config, "armed" if arm else "dry-run")] if autopilot else []
    if govern and cluster.governance is None:
        raise click.UsageError(
            f"cluster {cluster.name!r} has no governance block: nothing to govern"
        )
    retention = None
    if raw_hours is not None:
        from storage.retention import RetentionSettings

        retention = RetentionSettings(raw_sample_hours=raw_hours)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    open_store(db).close()  # a bad URL is a usage error before anything starts
    try:
        stats = run_recorder(
            cluster,
            db or os.environ.get(DB_ENV),
            recording_name=recording_name,
            retention=retention,
            govern=("armed" if arm else "dry-run") if govern else None,
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


def autopilot_task(config_file: str | None, state: str):
    """The recorder task that runs the autopilot, its control row set to ``state`` first; a bad
    config file is a usage error naming the field before anything starts."""
    from pydantic import ValidationError

    from tuner.autopilot import AutopilotConfig

    try:
        config = (
            AutopilotConfig.model_validate_json(Path(config_file).read_bytes())
            if config_file
            else None
        )
    except ValidationError as err:
        raise click.BadParameter(describe_error(err), param_hint="--autopilot-config") from None

    async def task(collector, store, stop):
        import asyncio

        from tuner.autopilot_live import run_autopilot

        await asyncio.to_thread(
            store.governance.set_autopilot_control,
            collector.cluster.name,
            state=state,
            who="autopilot start",
        )
        await run_autopilot(collector, store, stop, config=config)

    return task


@click.group()
def autopilot():
    """The autopilot: steer the one running in `tailpilot record --autopilot` (status, arm, dry-run,
    disarm, pause, resume), or tune its own knobs on traces (tune)."""


AUTOPILOT_ACTIONS = {
    "status": "Its state, each replica's choice and why, and its last decisions.",
    "arm": "Apply its decisions through the control API (audited, verified).",
    "dry-run": "Only write its decisions to the audit log (the default).",
    "disarm": "Stop it (its simulators are dropped; arming starts them afresh).",
    "pause": "Hold it: it keeps watching and applies nothing.",
    "resume": "Undo pause.",
}


def _autopilot_control(action: str):
    @autopilot.command(name=action, help=AUTOPILOT_ACTIONS[action])
    @click.option(
        "--cluster-name",
        "cluster_name",
        required=True,
        metavar="NAME",
        help="The cluster it runs on.",
    )
    @click.option(
        "--db",
        metavar="URL",
        help=f"Database URL or SQLite path (default ${DB_ENV} or ./tailpilot.db).",
    )
    @click.option(
        "--who", default=None, help="Name in the autopilot's control row (default: $USER)."
    )
    @click.option("--json", "as_json", is_flag=True, help="Print the control row as JSON.")
    def command(cluster_name, db, who, as_json):
        from tuner.autopilot_live import CONTROL_ACTIONS, status_lines

        store = open_store(
            db, must_exist=True
        )  # a mistyped path or cluster is an error, never a new row
        try:
            known_cluster(store, cluster_name)
            changes = CONTROL_ACTIONS.get(action)
            row = (
                store.governance.set_autopilot_control(
                    cluster_name, who=who or f"cli:{os.environ.get('USER', 'unknown')}", **changes
                )
                if changes
                else store.governance.autopilot_control(cluster_name)
            )
        finally:
            store.close()
        if as_json:
            echo_json(row, default=str, indent=None)
        else:
            for line in status_lines(row):
                click.echo(line)

    return command


for _action in AUTOPILOT_ACTIONS:
    _autopilot_control(_action)


@autopilot.command(name="tune")
@click.option(
    "--trace",
    "trace_paths",
    multiple=True,
    metavar="FILE",
    help="A trace to tune on (repeatable; default the bundled Azure conv window).",
)
@click.option("--trials", type=click.IntRange(1, 10_000), default=20, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--out",
    type=click.Path(dir_okay=False, writable=True),
    metavar="FILE",
    help="Write the configuration here (for `record --autopilot-config FILE`).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def autopilot_tune(trace_paths, trials, seed, out, as_json):
    """Tune the autopilot's own knobs (margins, dwell, window, interval, delay) on continuous replays
    of the traces: P95 TTFT against sarathi's, with the P99 TTLT and throughput guards."""
    from sim import traces as tr
    from tuner.autopilot_tune import tune_autopilot

    loaded = []
    for path in trace_paths or ("bundled",):
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
        f"{result['trials']} trials; best #{result['trial']}: P95 TTFT {f['ttft_p95_ratio']:.3f}x sarathi "
        f"(default configuration {s0['ttft_p95_ratio']:.3f}x), P99 TTLT {f['ttlt_p99_ratio']:.3f}x, "
        f"throughput {f['throughput_ratio']:.3f}x"
    )
    click.echo("config: " + json_text(result["config"]) + (f" (written to {out})" if out else ""))


@click.command()
@click.argument(
    "action", type=click.Choice(["status", "arm", "dry-run", "disarm", "pause", "resume"])
)
@click.option(
    "--cluster-name", "cluster_name", required=True, metavar="NAME", help="The governed cluster."
)
@click.option(
    "--db",
    metavar="URL",
    help=f"Database URL or SQLite path (default ${DB_ENV} or ./tailpilot.db).",
)
@click.option("--who", default=None, help="Name in the governor's control row (default: $USER).")
@click.option("--json", "as_json", is_flag=True, help="Print the control row as JSON.")
@click.option(
    "--keep",
    is_flag=True,
    help="With disarm: keep the changes the governor applied (by default "
    "disarm, pause and a recorder stop undo them).",
)
def governor(action, cluster_name, db, who, as_json, keep):
    """Steer the governor of a cluster (it runs in `tailpilot record --govern`): status, arm,
    dry-run, disarm [--keep], pause, resume. Disarm, pause and dry-run undo every change the
    governor applied, at its next evaluation (`disarm --keep` keeps them, and `status` says so).
    The cluster must be one the database has recorded, and the database must exist: a mistyped
    name or path is an error (exit 2), never a new control row or a new, empty database."""
    if keep and action != "disarm":
        raise click.UsageError("--keep goes with disarm only")
    store = open_store(db, must_exist=True)
    try:
        known_cluster(store, cluster_name)
        who = who or f"cli:{os.environ.get('USER', 'unknown')}"
        from controlplane.governor import CONTROL_ACTIONS

        changes = dict(CONTROL_ACTIONS.get(action) or {})
        if action in (
            "disarm",
            "arm",
            "dry-run",
        ):  # the keep flag lives in the status the governor reads
            changes["status"] = {
                **(store.governance.governor_control(cluster_name).get("status") or {}),
                "keep": keep,
            }
        row = (
            store.governance.set_governor_control(cluster_name, who=who, **changes)
            if changes
            else store.governance.governor_control(cluster_name)
        )
    finally:
        store.close()
    if as_json:
        echo_json(row, default=str, indent=None)
    else:
        from controlplane.governor import modes, modes_text

        status = row.get("status") or {}
        click.echo(
            f"governor of {cluster_name}: {row['state']}{' (paused)' if row['paused'] else ''}"
            f"{'' if not row.get('who') else ' · set by ' + str(row['who'])}; {modes_text(status)}"
        )
        applied, _ = modes(status)
        if applied and (row["paused"] or (row["state"] != "armed" and not keep)):
            click.echo(f"  undoing {', '.join(applied)} at the governor's next evaluation")
        elif applied and keep:
            click.echo(
                f"  keeping {', '.join(applied)} applied (disarm without --keep undoes them)"
            )
        for line in status.get("last") or []:
            click.echo(f"  last: {line}")


# --------------------------------------------------------------------------------------------
@click.command()
@click.option(
    "--cluster",
    "cluster_file",
    metavar="FILE",
    type=click.Path(dir_okay=False),
    help="Cluster file (YAML); with --replay it only supplies SLOs and the window.",
)
@click.option("--cluster-name", metavar="NAME", help="Which cluster of the file or recording.")
@click.option(
    "--db", metavar="URL", help="Record into this database while watching (SQLite path or URL)."
)
@click.option(
    "--readonly",
    is_flag=True,
    help="Watch only: every action that changes the cluster is disabled.",
)
@click.option(
    "--replay",
    metavar="FILE",
    help="Open a recording (the recorder's database) instead of a live cluster.",
)
@click.option(
    "--optuna-storage",
    metavar="URL",
    help="Optuna storage for the tuner panel (5): URL or SQLite path; default ./tailpilot-optuna.db if it exists.",
)
def tui(cluster_file, cluster_name, db, readonly, replay, optuna_storage):
    """The operator TUI: live cluster view, policy switching and pinning, replay."""
    from storage.database import StoreOpenError
    from storage.engine import DatabaseMissing
    from tui import run_tui
    from tui.sources import ReplayError

    if not cluster_file and not replay:
        raise click.UsageError("give --cluster FILE (live) or --replay FILE (a recording)")
    if replay is not None:  # a replay only reads: a mistyped path must not become an empty database
        require_database(replay, "--replay")
    cluster = load_cluster(cluster_file, cluster_name) if cluster_file else None
    try:
        run_tui(
            cluster,
            db_url=db,
            readonly=readonly,
            replay=replay,
            cluster_name=cluster_name,
            optuna_storage=optuna_storage,
        )
    except (ReplayError, StoreOpenError) as err:
        raise click.UsageError(str(err)) from None
    except DatabaseMissing as err:  # removed since the check above
        raise click.BadParameter(str(err), param_hint="--replay") from None


# --------------------------------------------------------------------------------------------
@click.command()
@click.option(
    "--replicas",
    "n",
    type=click.IntRange(1, 256),
    default=4,
    show_default=True,
    help="Twin replicas to start.",
)
@click.option(
    "--trace",
    "trace_path",
    metavar="FILE",
    help="Trace to replay (default: the bundled Azure conv window).",
)
@click.option(
    "--speed",
    type=FiniteFloatRange(min=0.01),
    default=1.0,
    show_default=True,
    help="Replica clock speed (2 = twice real time).",
)
@click.option(
    "--rate-scale",
    type=FiniteFloatRange(min=0.01),
    default=None,
    help="Multiply the trace's arrival rate (default 1.5 × replicas: every replica queues).",
)
@click.option(
    "--policy",
    type=click.Choice(POLICY_NAMES),
    default=None,
    help="Start every replica on this policy [default: side by side — sarathi (vLLM's default), "
    "uniboost, tie, vtc, round-robin].",
)
@click.option(
    "--db",
    default="tailpilot-demo.db",
    show_default=True,
    metavar="URL",
    help="Where the demo records (a SQLite path or URL).",
)
@click.option(
    "--duration", type=POSITIVE, help="Stop after this many seconds (default: until q / Ctrl-C)."
)
@click.option("--no-tui", is_flag=True, help="Print a status table instead of opening the TUI.")
def demo(n, trace_path, speed, rate_scale, policy, db, duration, no_tui):
    """Start twin replicas on a trace, record them into SQLite and show them live."""
    from controlplane.cluster import ClusterFile, ClusterSpec, ReplicaSpec
    from sim import traces
    from tuner.twin import start_twins

    try:
        trace = traces.load_bundled() if trace_path is None else traces.load_trace(trace_path)
    except traces.TraceError as err:
        raise click.UsageError(str(err)) from None
    except TRACE_PARSE_ERRORS as err:
        raise unreadable_trace(trace_path, err) from None
    if (
        len({r.tenant for r in trace}) == 1
    ):  # three Zipf tenants, so the fairness views have something to show
        trace = traces.assign_tenants_zipf(trace, 3, seed=0)
    token_env = "TAILPILOT_DEMO_TOKEN"
    os.environ.setdefault(token_env, secrets.token_hex(16))
    # Side by side by default, so the first screen compares vLLM's default with the tail-aware
    # policies on the same traffic (tie on the history predictor: what a live replica can run).
    settings = (
        [Settings.model_validate({"policy": policy})]
        if policy
        else [Settings.model_validate(d) for d in DEMO_POLICIES]
    )
    # The bundled window is about one A100's load; at 1.5× per replica queues build and tails show.
    scale = rate_scale if rate_scale is not None else 1.5 * n
    with start_twins(
        n,
        trace,
        speed=speed,
        rate_scale=scale,
        settings=settings,
        token=os.environ[token_env],
        cluster_name="demo",
    ) as twins:
        cluster = ClusterSpec(
            name="demo",
            window_s=60.0,
            slos={"ttft_p99": 2.0, "ttlt_p99": 60.0},
            replicas=[
                ReplicaSpec(name=r.name, api_url=r.url, control_url=r.url, token_env=token_env)
                for r in twins.replicas
            ],
        )
        Path("tailpilot-demo.yaml").write_text(_dump(ClusterFile(clusters=[cluster])))
        click.echo(
            f"{n} twin replicas up (cluster file: tailpilot-demo.yaml, database: {db})", err=True
        )
        if no_tui or not _tui_available():
            _demo_table(cluster, db, duration)
        else:
            from tui import run_tui

            run_tui(cluster, db_url=db, readonly=False, duration_s=duration)


DEMO_POLICIES = (
    {"policy": "sarathi"},
    {"policy": "uniboost"},
    {"policy": "tie", "params": {"predictor": "history"}},
    {"policy": "vtc"},
)


def _dump(clusters) -> str:
    from controlplane.cluster import dump_cluster_file

    return dump_cluster_file(clusters)


def _tui_available() -> bool:
    try:
        from tui import run_tui  # noqa: F401
    except ImportError:
        return False
    return sys.stdout.isatty()


def _demo_table(cluster, db: str, duration: float | None) -> None:
    """Record the cluster and redraw the status table once a second."""
    from rich.live import Live

    from controlplane.collector import Collector
    from controlplane.views import status_table, wide_console

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


COMMANDS = (status, set_command, verify, record, governor, autopilot, tui, demo)

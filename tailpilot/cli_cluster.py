"""Commands that talk to a live cluster: ``status``, ``set``, ``verify`` and ``tui``.

    tailpilot status --cluster clusters.yaml [--json]
    tailpilot set --cluster clusters.yaml --replica a100-0 --policy uniboost --set gamma=0.05 \\
        --pin gamma
    tailpilot verify --cluster clusters.yaml
    tailpilot tui --cluster clusters.yaml [--db tailpilot.db] [--readonly]

Everything here is a thin layer over the library (``controlplane.collector``,
``controlplane.steering``, ``tuner.closed_loop.whatif``, ``storage``), so what the CLI prints is
reachable from Python too. Exit status: 0 on success, 1 when a replica refused or could not be
reached or a command did not do what was asked (``set --preview`` not confirmed), 2 for bad input
(click's usage errors: an unknown cluster, replica or database file, a value out of range). What
every command that names a cluster or a database shares: :func:`load_cluster`,
:func:`open_store`.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import click

from controlplane.views import governance_lines, sample_json, status_table, wide_console
from scheduler.settings import Settings, describe_error
from scheduler.settings_change import SettingsChange
from tailpilot import options
from tailpilot.cli_common import FiniteFloatRange, echo_json

if TYPE_CHECKING:  # the operator's modules load only when a command runs (start-up cost)
    from controlplane.cluster import ClusterSpec
    from controlplane.snapshot import ReplicaSnapshot
    from controlplane.steering import ApplyResult
    from storage.rows import SampleRow
    from storage.store import Store


# ``tui --replay`` given alone (``--db`` names the recording); ``--replay DB`` is the old spelling.
REPLAY_DB = "\0db"


def load_cluster(cluster_file: str, cluster_name: str | None) -> ClusterSpec:
    """The cluster ``cluster_name`` of the file (its only one when None); a usage error names the
    file's problem, or the unknown name and the known ones."""
    from controlplane.cluster import ClusterFileError, load_cluster_file  # start-up cost

    try:
        return load_cluster_file(cluster_file).cluster(cluster_name)
    except ClusterFileError as err:
        raise click.UsageError(str(err)) from None
    except KeyError as err:
        raise click.BadParameter(str(err.args[0]), param_hint="--cluster-name") from None


def open_store(db: str | None, *, must_exist: bool = False) -> Store:
    """The store at ``db`` (default ``$TAILPILOT_DB`` or ./tailpilot.db). ``must_exist``: the
    command only reads, so a SQLite file that does not exist is a usage error naming --db and the
    path (opening it would create an empty database) instead of a new, empty store."""
    from storage.database import StoreOpenError  # start-up cost
    from storage.store import Store  # start-up cost

    url = db or os.environ.get(options.DB_ENV)
    if must_exist:
        require_database(url, "--db")
    try:
        return Store.open(url)
    except StoreOpenError as err:
        raise click.UsageError(str(err)) from None


def require_database(url: str | None, option: str) -> None:
    """BadParameter on ``option`` naming the path when ``url`` is a SQLite file that does not
    exist (``storage.engine.require_existing``): what a command that only reads checks before
    opening."""
    from storage.engine import DatabaseMissing, require_existing  # start-up cost

    try:
        require_existing(url)
    except DatabaseMissing as err:
        hint = f" (give {option} URL or set ${options.DB_ENV})" if option == "--db" else ""
        raise click.BadParameter(f"{err}{hint}", param_hint=option) from None


def known_cluster(store: Store, cluster_name: str, option: str = "--cluster-name") -> None:
    """BadParameter on ``option`` unless the store has recorded ``cluster_name``; it lists the
    clusters the store knows (or says it knows none)."""
    from storage.engine import is_sqlite, redact  # start-up cost

    known = store.recordings.clusters()
    if cluster_name in known:
        return
    url = store.database.engine.url
    where = url.database if is_sqlite(url) else redact(url)
    if not known:
        raise click.BadParameter(
            f"no cluster {cluster_name!r}: {where} has no cluster recorded "
            "(tailpilot record --cluster FILE records one)",
            param_hint=option,
        )
    shown = ", ".join(known[:20]) + (f", ... ({len(known)} in all)" if len(known) > 20 else "")
    raise click.BadParameter(
        f"no cluster {cluster_name!r} in {where} (known: {shown})", param_hint=option
    )


def _unhealthy_row(name: str, reason: str | None) -> SampleRow:
    from storage.rows import SampleRow  # start-up cost

    return SampleRow(replica=name, t_ms=int(time.time() * 1000), healthy=False, reason=reason)


def snapshot_rows(
    snapshots: Iterable[ReplicaSnapshot],
) -> tuple[list[SampleRow], dict[str, list[str]]]:
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
@options.cluster_file()
@options.cluster_name()
@options.json_output("the state")
def status(cluster_file: str, cluster_name: str | None, as_json: bool) -> None:
    """Poll every replica once and print the cluster's live state."""
    from controlplane.collector import poll_cluster_once  # start-up cost

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
        console = wide_console()
        console.print(status_table(rows, pinned, title=f"cluster {cluster.name}"))
        for line in governance_lines(snap.governance):
            console.print(line)
    if not all(r.healthy for r in rows):
        sys.exit(1)


# --------------------------------------------------------------------------------------------
@click.command(name="set")
@options.cluster_file()
@options.cluster_name()
@options.replica(help="Replica to change (repeatable).")
@click.option("--all", "all_replicas", is_flag=True, help="Change every replica of the cluster.")
@options.policy(help="Switch to this policy.")
@options.assignments(help="Set a parameter (or engine.max_num_seqs=...) (repeatable).")
@options.pins()
@click.option("--unpin", "unpins", multiple=True, metavar="NAME", help="Unpin a parameter.")
@options.database(
    help=f"Database for the audit log [default: ${options.DB_ENV}, else ./tailpilot.db]."
)
@options.who()
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
    metavar="MINUTES",
    default=10.0,
    show_default=True,
    help="--preview: minutes of recorded traffic to predict on (and to verify on afterwards).",
)
@click.option("--yes", is_flag=True, help="--preview: apply without asking.")
@options.json_output("the results")
def set_command(
    cluster_file: str,
    cluster_name: str | None,
    replicas: tuple[str, ...],
    all_replicas: bool,
    policy: str | None,
    assignments: tuple[str, ...],
    pins: tuple[str, ...],
    unpins: tuple[str, ...],
    db: str | None,
    who: str | None,
    wait_s: float,
    preview: bool,
    minutes: float,
    yes: bool,
    as_json: bool,
) -> None:
    """Change replicas' settings through the control API, wait until they run them, and audit the
    change.

    Exit status 0 when every replica runs the new settings, 3 when all accepted them but some have
    not applied them yet (staged: a replica applies a document at its next scheduling step), 1 when
    any refused them or could not be reached, or nothing was applied (--preview without a
    prediction, or not confirmed)."""
    from controlplane.steering import apply_settings  # start-up cost

    if bool(replicas) == all_replicas:
        raise click.UsageError("name replicas with --replica NAME (repeatable) or use --all")
    if not (policy or assignments or pins or unpins):
        raise click.UsageError("nothing to change: give --policy, --set, --pin or --unpin")
    try:
        change = SettingsChange.parse(policy, assignments, pins, unpins)
    except ValueError as err:
        raise click.UsageError(describe_error(err)) from None
    except RecursionError:  # a JSON value past Python's recursion limit
        raise click.BadParameter("a value nested too deeply", param_hint="--set") from None
    cluster = load_cluster(cluster_file, cluster_name)
    check_replicas(cluster, replicas)
    store = open_store(db)
    names = [r.name for r in cluster.replicas] if all_replicas else list(replicas)
    try:
        predictions: dict[str, dict[str, Any]] = {}
        if preview:
            predictions = _preview(cluster, names, change, store, minutes, as_json)
            _confirm(bool(predictions), yes)
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
    _report_set(results, predictions, as_json)


def check_replicas(cluster: ClusterSpec, replicas: Iterable[str]) -> None:
    """BadParameter on --replica for a name the cluster does not have."""
    for name in replicas:
        try:
            cluster.replica(name)
        except KeyError as err:
            raise click.BadParameter(str(err.args[0]), param_hint="--replica") from None


def _confirm(predicted: bool, yes: bool) -> None:
    """Go on after a preview only with a prediction and a yes (--yes, or at the prompt). Not
    applied is not what was asked: exit 1 (ClickException), never 0."""
    if not predicted:  # each replica's reason is on stderr above
        raise click.ClickException("not applied: no replica could be previewed")
    if yes:
        return
    if not sys.stdin.isatty():
        raise click.ClickException("not applied: confirm on a terminal, or give --yes")
    if not click.confirm("apply these settings?", default=False):
        raise click.ClickException("not applied: declined at the prompt")


def _report_set(
    results: list[ApplyResult], predictions: dict[str, dict[str, Any]], as_json: bool
) -> None:
    """Each replica's result; exit 1 when any failed, 3 when some only staged the change."""
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
        colour: dict[str, dict[str, Any]] = {"applied": {"fg": "green"}, "staged": {"fg": "yellow"}}
        for r in results:
            word = click.style(r.result, **colour.get(r.result, {"fg": "red", "bold": True}))
            click.echo(f"{r.replica}: {word}: {r.message}", err=_invalid_here(r))
    failed = [r for r in results if not r.ok]
    if failed and all(_invalid_here(r) for r in failed):
        sys.exit(2)  # the input: a value no replica's policy takes, refused before sending
    if failed:
        sys.exit(1)
    if any(r.result == "staged" for r in results):
        sys.exit(3)


def _invalid_here(r: ApplyResult) -> bool:
    """Refused before anything was sent: the change makes a document the model refuses (an
    input error, like a usage error: exit 2, on stderr)."""
    return r.result == "rejected" and r.status is None


def _preview(
    cluster: ClusterSpec,
    names: list[str],
    change: SettingsChange,
    store: Store,
    minutes: float,
    as_json: bool,
) -> dict[str, dict[str, Any]]:
    """Each target's prediction (printed unless --json); {} when none could be made."""
    from controlplane.http import TRANSPORT_ERRORS, get_sync, sync_client  # start-up cost
    from controlplane.replica_http import MAX_STATE_BYTES, control_base  # start-up cost
    from scheduler.contract import SettingsAnswer, read  # start-up cost
    from storage.strict_json import finite  # start-up cost
    from tuner.closed_loop.replica_facts import (  # start-up cost
        ReplicaUnreachable,
        fetch_engine_facts,
    )
    from tuner.closed_loop.whatif import WhatIfError, format_prediction, predict  # start-up cost

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
            proposed = change.apply(current)
        except (*TRANSPORT_ERRORS, ValueError) as err:  # type: ignore[misc]  # mypy reads no starred tuple
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
@options.cluster_file()
@options.cluster_name()
@options.database()
@options.replica(help="Only these replicas (repeatable).")
@options.json_output("the verifications")
def verify(
    cluster_file: str,
    cluster_name: str | None,
    db: str | None,
    replicas: tuple[str, ...],
    as_json: bool,
) -> None:
    """Realized vs predicted for every change applied with a prediction (`set --preview`): once its
    window has passed, the traffic that came after the change is replayed under the old settings
    (the counterfactual) and the replica's real figures are compared with it."""
    from storage.strict_json import finite  # start-up cost
    from tuner.closed_loop.whatif import format_verification  # start-up cost
    from tuner.closed_loop.whatif import verify as run_verify  # start-up cost

    cluster = load_cluster(cluster_file, cluster_name)
    check_replicas(cluster, replicas)
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
@options.cluster_file(
    required=False,
    help="Cluster file (YAML) of the live cluster; with --replay it only supplies SLOs and the "
    "window.",
)
@options.cluster_name(help="Which cluster of the file or of the recording.")
@options.database(
    help="tailpilot's database: live, record into it while watching [default: record nothing]; "
    f"with --replay, the recording to open [default: ${options.DB_ENV}, else ./tailpilot.db].",
)
@options.readonly()
@click.option(
    "--replay",
    is_flag=False,
    flag_value=REPLAY_DB,
    default=None,
    metavar="",
    help="Open --db's recording instead of a live cluster (read only).",
)
@options.optuna_storage(
    help="Optuna storage for the tuner panel (5): URL or SQLite path [default: "
    "./tailpilot-optuna.db if it exists]."
)
def tui(
    cluster_file: str | None,
    cluster_name: str | None,
    db: str | None,
    readonly: bool,
    replay: str | None,
    storage: str | None,
) -> None:
    """The operator TUI: live cluster view, policy switching and pinning, replay."""
    from storage.database import StoreOpenError  # start-up cost
    from storage.engine import DEFAULT_SQLITE_FILE, DatabaseMissing  # start-up cost
    from tui import run_tui  # start-up cost (textual)
    from tui.main import NoTerminal  # start-up cost (textual)
    from tui.sources import ReplayError  # start-up cost (textual)

    if replay == "":  # --replay= : the flag, as given alone
        replay = REPLAY_DB
    if replay is not None and replay != REPLAY_DB:  # the old spelling: --replay DB
        if db is not None and os.path.abspath(db) != os.path.abspath(replay):
            raise click.UsageError(f"--replay {replay} and --db {db} name two databases")
        click.echo(f"note: --replay {replay} is now --replay --db {replay} (docs/cli.md)", err=True)
        db = replay
    if replay is not None:
        replay = db or os.environ.get(options.DB_ENV) or DEFAULT_SQLITE_FILE
        db = None  # a replay records nothing
    if not cluster_file and not replay:
        raise click.UsageError("give --cluster FILE (live) or --replay (a recording in --db)")
    if replay is not None:  # a replay only reads: a mistyped path must not become an empty database
        require_database(replay, "--db")
    cluster = load_cluster(cluster_file, cluster_name) if cluster_file else None
    try:
        run_tui(
            cluster,
            db_url=db,
            readonly=readonly,
            replay=replay,
            cluster_name=cluster_name,
            optuna_storage=storage,
        )
    except (ReplayError, StoreOpenError, NoTerminal) as err:
        raise click.UsageError(str(err)) from None
    except DatabaseMissing as err:  # removed since the check above
        raise click.BadParameter(str(err), param_hint="--db") from None


COMMANDS: tuple[click.Command, ...] = (status, set_command, verify, tui)

"""The closed loop: ``tailpilot fidelity`` (how faithfully the simulator replays a replica).

    tailpilot fidelity --replica a100-0 --recording peak [--window-s 60] [--json] [--no-store]

A thin layer over ``tuner.fidelity``. Exit status: 0 with a report, 2 on a usage error (no such
replica, recording or settings record).
"""

from __future__ import annotations

import sys

import click

from tailpilot.cli_cluster import DB_ENV, open_store
from tailpilot.cli_common import STEP_MODEL, FiniteFloatRange, echo_json


@click.command()
@click.option(
    "--db",
    metavar="URL",
    help=f"The store that recorded the replica (default ${DB_ENV} or ./tailpilot.db).",
)
@click.option("--replica", required=True, metavar="NAME", help="The replica to check.")
@click.option(
    "--cluster-name", metavar="NAME", help="Its cluster (needed when the name is in several)."
)
@click.option(
    "--recording", metavar="NAME", help="The recorded span to replay (default: everything stored)."
)
@click.option(
    "--from",
    "start_s",
    type=FiniteFloatRange(min=0),
    metavar="S",
    help="Seconds from the span's first arrival to start at.",
)
@click.option(
    "--to", "end_s", type=FiniteFloatRange(min=0), metavar="S", help="... and to stop at."
)
@click.option(
    "--window-s",
    type=FiniteFloatRange(min=1),
    default=60.0,
    show_default=True,
    help="Compare per window of this many seconds of arrivals.",
)
@click.option(
    "--step-model",
    type=STEP_MODEL,
    metavar="SETNAME",
    help="Step-time model (default: calibrated/<replica> if `tailpilot calibrate` saved one).",
)
@click.option(
    "--live/--no-live",
    default=True,
    show_default=True,
    help="Read the replica's block size and KV blocks from its control API if it answers.",
)
@click.option(
    "--store/--no-store",
    "keep",
    default=True,
    show_default=True,
    help="Keep the report in the store (the TUI shows the newest per replica).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def fidelity(
    db, replica, cluster_name, recording, start_s, end_s, window_s, step_model, live, keep, as_json
):
    """Replay a replica's recorded traffic with the settings it ran and its calibrated engine, and
    compare with what it really did: per window sim vs real P50/P99 TTFT and TTLT, throughput and
    preemptions with their errors; how differently the two ordered the same requests; the windows
    where they diverge most; and the error band to expect from the simulator on this replica."""
    from storage.strict_json import finite
    from tuner.calibrate import (
        CalibrationError,
        ReplicaUnreachable,
        fetch_engine_facts,
        replica_control_url,
    )
    from tuner.fidelity import FidelityError, format_report
    from tuner.fidelity import fidelity as run_fidelity

    store = open_store(db, must_exist=True)
    try:
        facts = None
        if live:
            try:
                _, control = replica_control_url(store, replica, cluster_name)
                facts = fetch_engine_facts(control, timeout=5.0)
            except (CalibrationError, ReplicaUnreachable) as err:
                click.echo(
                    f"note: engine facts not read live ({err}); using what the store knows",
                    err=True,
                )
        try:
            report = run_fidelity(
                store,
                cluster=cluster_name,
                replica=replica,
                recording=recording,
                start_s=start_s,
                end_s=end_s,
                window_s=window_s,
                step_model=step_model,
                engine_facts=facts,
                db=db,
            )
        except FidelityError as err:
            raise click.UsageError(str(err)) from None
        report = finite(report)
        if keep:
            report["stored_id"] = store.tuner.store_fidelity(
                report["cluster"], replica, report["span"], report
            )
    finally:
        store.close()
    if as_json:
        echo_json(report)
    else:
        click.echo(format_report(report))
    sys.stdout.flush()


COMMANDS = (fidelity,)

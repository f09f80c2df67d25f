"""The closed loop: ``tailpilot fidelity`` (how faithfully the simulator replays a replica).

    tailpilot fidelity --replica a100-0 --recording peak [--from S --to S] [--window-s 60] [--json]

A thin layer over ``tuner.closed_loop.fidelity``. Exit status: 0 with a report, 2 on a usage error
(no such replica, recording or settings record).
"""

from __future__ import annotations

import sys

import click

from storage.strict_json import finite
from tailpilot import options
from tailpilot.cli_cluster import open_store
from tailpilot.cli_common import echo_json


@click.command()
@options.database(
    help=f"The store that recorded the replica [default: ${options.DB_ENV}, else ./tailpilot.db]."
)
@options.replica(several=False, required=True, help="The replica to check.")
@options.cluster_name(help="Its cluster (needed when the name is in several).")
@options.recording(help="The recorded span to replay [default: everything stored].")
@options.span_bounds(what="the recorded span")
@options.window_length(help="Compare per window of this many seconds of arrivals.")
@options.step_model(
    help="Step-time coefficient set [default: calibrated/<replica> if `tailpilot calibrate` saved "
    "one]."
)
@click.option(
    "--live/--no-live",
    default=True,
    show_default=True,
    help="Read the replica's block size and KV blocks from its control API if it answers.",
)
@options.keep_result(help="Keep the report in the store (the TUI shows the newest per replica).")
@options.json_output("the report")
def fidelity(
    db: str | None,
    replica: str,
    cluster_name: str | None,
    recording: str | None,
    start_s: float | None,
    end_s: float | None,
    window_s: float,
    step_model: str | None,
    live: bool,
    keep: bool,
    as_json: bool,
) -> None:
    """Replay a replica's recorded traffic with the settings it ran and its calibrated engine, and
    compare with what it really did: per window sim vs real P50/P99 TTFT and TTLT, throughput and
    preemptions with their errors; how differently the two ordered the same requests; the windows
    where they diverge most; and the error band to expect from the simulator on this replica."""
    from tuner.closed_loop.fidelity import FidelityError, format_report  # start-up cost
    from tuner.closed_loop.fidelity import fidelity as run_fidelity  # start-up cost
    from tuner.closed_loop.replica_facts import (
        CalibrationError,
        ReplicaUnreachable,
        fetch_engine_facts,
        replica_control_url,
    )  # start-up cost

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


COMMANDS: tuple[click.Command, ...] = (fidelity,)

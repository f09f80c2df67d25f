"""``tailpilot tune`` and ``tailpilot recommend`` (docs/engine.md#tuner): Optuna studies over a
policy's and the engine's settings on trace windows, and their validated recommendation.

    tailpilot tune --study conv-ub --policy uniboost --objective ttlt_p99 \\
        --constraint "throughput>=0.99*baseline" --trials 200 [--trace FILE[,FILE]] [--jobs 4]
    tailpilot tune --study conv-ub --trials 400     # resume/extend: the study keeps its definition
    tailpilot recommend --study conv-ub [--json]    # best settings, validated on held-out windows

Storage: ``--storage URL`` (an Optuna RDB URL — PostgreSQL for several machines — a SQLite path,
or a journal file: ``journal:PATH`` or a path ending ``.journal``/``.log``, Optuna's
JournalStorage, no database needed); default the SQLite file ``tailpilot-optuna.db``, never
tailpilot's own database. Several ``tailpilot tune`` processes with the same ``--storage`` and
``--study`` share one study, each trial with its own sampler stream. A URL the tuner cannot use is
a usage error (exit 2) naming its scheme.
The library behind these commands is :mod:`tuner.studies.study` (a study's definition and context),
:mod:`tuner.studies.optimize` (running it) and :mod:`tuner.studies.recommend`. Its errors name a
study field (``window_s``); these commands name the field's flag instead (``--window-s``;
``tailpilot.study_options``).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from tailpilot import options
from tailpilot.cli_cluster import open_store
from tailpilot.cli_common import echo_json
from tailpilot.recommend_view import print_recommendation
from tailpilot.study_options import (
    conflict_error,
    given_fields,
    new_spec,
    recorded_trace,
    spec_error,
    spec_value,
    study_definition_options,
    study_span,
)

if TYPE_CHECKING:  # the tuner's modules load only when a command runs (start-up cost)
    from tuner.studies.optimize import TuneOutcome


def _storage_or_exit(storage: str | None, db: str | None, *, must_exist: bool = False) -> str:
    """The storage URL of ``--storage``, or a usage error (exit 2, one line) when the tuner cannot
    use it: an unknown scheme, tailpilot's own database, a file that is not there to read."""
    from tuner.studies.optuna_storage import (  # start-up cost
        check_storage_separate,
        storage_file,
        storage_url,
    )
    from tuner.studies.spec import TuneError  # start-up cost

    try:
        url = storage_url(storage)
    except TuneError as err:
        raise click.UsageError(str(err)) from None
    path = storage_file(url)
    if must_exist and path is not None and not Path(path).exists():
        raise click.UsageError(f"--storage: {path} does not exist (no study stored there)")
    try:
        check_storage_separate(url, db or os.environ.get(options.DB_ENV))
    except TuneError as err:
        raise click.UsageError(str(err)) from None
    return url


def _check_study_name(study_name: str) -> None:
    """A usage error naming --study for a name no storage can keep (bytes that are not UTF-8),
    before anything is opened."""
    from tuner.studies.lookup import check_study_name  # start-up cost
    from tuner.studies.spec import TuneError  # start-up cost

    try:
        check_study_name(study_name)
    except TuneError as err:
        raise click.UsageError(str(err)) from None


ProgressCallback = Callable[[int, int], None]


def _progress_bar(
    show: bool,
) -> tuple[contextlib.AbstractContextManager[Any], ProgressCallback | None]:
    """(context manager, callback(complete, total)) for a rich progress bar on stderr."""
    if not show:
        return contextlib.nullcontext(), None
    bar = Progress(
        TextColumn("trials"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=False,
    )
    task: dict[str, TaskID | None] = {"id": None}

    def update(complete: int, total: int) -> None:
        task_id = task["id"]
        if task_id is None:
            task_id = task["id"] = bar.add_task("trials", total=total)
        bar.update(task_id, completed=complete, total=total)

    return bar, update


@click.command()
@options.study(help="Study name (created, joined or resumed).")
@options.optuna_storage(
    help="Optuna storage: RDB URL (postgresql://... for many machines), SQLite path, or journal "
    "file (journal:PATH, or PATH.journal / PATH.log; no database) [default: "
    "./tailpilot-optuna.db]."
)
@options.trials(
    default=100,
    help="Complete trials the study should hold in total (a resumed study continues up to this).",
)
@options.jobs(help="Local worker processes on the same storage.")
@options.renamed("--workers", "--jobs", "jobs")
@study_definition_options
@options.database(
    help=f"tailpilot's database, where --recording is [default: ${options.DB_ENV}, else "
    "./tailpilot.db]; the storage must differ from it."
)
@options.progress()
@options.json_output("the outcome")
@click.pass_context
def tune(
    ctx: click.Context,
    study_name: str,
    storage: str | None,
    trials: int,
    jobs: int,
    db: str | None,
    progress: bool | None,
    as_json: bool,
    **kw: Any,
) -> None:
    """Search a policy's and the engine's settings with Optuna on trace windows.

    Trial 0 is the production settings; each trial replays K search windows (a pruner stops
    hopeless ones); held-out windows are kept for `tailpilot recommend`. Ctrl-C keeps the study:
    run the same command to continue.
    """
    from tuner.studies.lookup import study_exists  # start-up cost
    from tuner.studies.optimize import tune as run_tune  # start-up cost
    from tuner.studies.optuna_storage import open_storage, storage_exists  # start-up cost
    from tuner.studies.spec import SpecError, StudyConflict, TuneError  # start-up cost

    _check_study_name(study_name)
    url = _storage_or_exit(storage, db)
    trim = study_span(kw.pop("start_s"), kw.pop("end_s"), kw.pop("window"))
    recorded = kw["recording"] is not None
    recorded_trace(kw, db)
    given = given_fields(ctx, kw)
    # With --recording, errors about the study's traces name --recording, not --trace.
    traces_flag = "--recording" if recorded else None
    if recorded:
        given["traces"] = spec_value("trace_paths", kw["trace_paths"], flag=traces_flag)
    if trim is not None:
        given["trim"] = trim
    try:
        # Opening a storage file creates it: where there is none, there is no study either, and
        # the new study's definition is checked (run_tune) before the file is made.
        exists = storage_exists(url) and study_exists(open_storage(url), study_name)
    except TuneError as err:
        raise click.UsageError(str(err)) from None
    spec = None if exists else new_spec(study_name, given, traces_flag=traces_flag)
    show = progress if progress is not None else sys.stderr.isatty()
    bar, update = _progress_bar(show and not as_json)
    log = (lambda m: None) if as_json else (lambda m: click.echo(m, err=True))
    try:
        with bar:
            outcome = run_tune(
                url,
                study_name,
                trials,
                spec=spec,
                given=given,
                workers=jobs,
                progress=update,
                log=log,
            )
    except StudyConflict as err:
        raise conflict_error(err, study_name, traces_flag=traces_flag) from None
    except SpecError as err:
        raise spec_error(err, traces_flag=traces_flag) from None
    except TuneError as err:
        raise click.UsageError(str(err)) from None
    except KeyboardInterrupt:
        click.echo("interrupted while setting the study up; run the same command again", err=True)
        sys.exit(130)
    _report_tune(outcome, storage, as_json)
    if outcome.interrupted:
        sys.exit(130)


def _report_tune(outcome: TuneOutcome, storage: str | None, as_json: bool) -> None:
    from tuner.studies.optuna_storage import redact  # start-up cost
    from tuner.studies.recommend import jsonable  # start-up cost

    if as_json:
        echo_json(jsonable(asdict(outcome)))
        return
    state = "interrupted" if outcome.interrupted else "done"
    click.echo(
        f"study {outcome.study}: {outcome.complete} of {outcome.requested} trials complete "
        f"({state})"
    )
    if outcome.best:
        vals = ", ".join(f"{v:.4g}" for v in outcome.best["values"])
        extra = (
            f" (Pareto front of {outcome.best['pareto_size']})"
            if outcome.best["pareto_size"] > 1
            else ""
        )
        click.echo(f"best trial #{outcome.best['trial']}{extra}: {vals}")
        click.echo("  " + json.dumps(outcome.best["settings"]))
    where = f" --storage {redact(storage) if '://' in storage else storage}" if storage else ""
    if outcome.interrupted:
        click.echo(
            "run the same command to continue; "
            f"`tailpilot recommend --study {outcome.study}{where}` reads it now"
        )
    else:
        click.echo(f"next: tailpilot recommend --study {outcome.study}{where}")


@click.command()
@options.study()
@options.optuna_storage()
@options.database(
    help=f"Store the recommendation here [default: ${options.DB_ENV}, else ./tailpilot.db]."
)
@options.keep_result(help="Keep the recommendation in --db (the TUI shows it).")
@options.autopilot(
    dest="with_autopilot",
    help="Also judge keeping the autopilot (it replays every trace whole, choosing online) "
    "against the recommendation; about a dozen replays of the traces more.",
)
@options.json_output("the recommendation")
def recommend(
    study_name: str,
    storage: str | None,
    db: str | None,
    keep: bool,
    with_autopilot: bool,
    as_json: bool,
) -> None:
    """The study's best settings (or Pareto front) and their improvement over the production
    settings on search and on held-out windows, with confidence intervals over windows; stored
    so the TUI shows it."""
    from tuner.studies.optuna_storage import open_storage  # start-up cost
    from tuner.studies.recommend import jsonable  # start-up cost
    from tuner.studies.recommend import recommend as build  # start-up cost
    from tuner.studies.spec import TuneError  # start-up cost

    _check_study_name(study_name)
    url = _storage_or_exit(storage, db, must_exist=True)
    try:
        summary = jsonable(build(open_storage(url), study_name, with_autopilot=with_autopilot))
    except TuneError as err:
        raise click.UsageError(str(err)) from None
    if keep:
        store = open_store(db)
        try:
            summary["stored_id"] = store.tuner.store_recommendation(
                study_name, summary["settings"], summary
            )
        finally:
            store.close()
    if as_json:
        echo_json(summary)
        return
    print_recommendation(summary)


COMMANDS: tuple[click.Command, ...] = (tune, recommend)

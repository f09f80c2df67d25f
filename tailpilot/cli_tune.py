"""``tailpilot tune`` and ``tailpilot recommend`` (docs/engine.md#tuner): Optuna studies over a policy's and
the engine's settings on trace windows, and their validated recommendation.

    tailpilot tune --study conv-ub --policy uniboost --objective ttlt_p99 \\
        --constraint "throughput>=0.99*baseline" --trials 200 [--trace FILE[,FILE]] [--workers 4]
    tailpilot tune --study conv-ub --trials 400           # resume/extend: the study keeps its definition
    tailpilot recommend --study conv-ub [--json]          # best settings, validated on held-out windows

Storage: ``--storage URL`` (an Optuna RDB URL — PostgreSQL for several machines — a SQLite path,
or a journal file: ``journal:PATH`` or a path ending ``.journal``/``.log``, Optuna's JournalStorage,
no database needed); default the SQLite file ``tailpilot-optuna.db``, never tailpilot's own
database. Several ``tailpilot tune`` processes with the same ``--storage`` and ``--study`` share
one study, each trial with its own sampler stream. A URL the tuner cannot use is a usage error
(exit 2) naming its scheme.
The library behind these commands is :mod:`tuner.study` (a study's definition and context),
:mod:`tuner.optimize` (running it) and :mod:`tuner.recommend`. Its errors name a study field
(``window_s``); these commands name the field's flag instead (``--window-s``, ``_SPEC_FLAGS``).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from click.core import ParameterSource

from scheduler.settings import POLICY_NAMES, Settings, describe_error, parse_assignment
from tailpilot.cli_cluster import DB_ENV
from tailpilot.cli_common import (
    GPU_BLOCKS,
    NON_NEGATIVE,
    POSITIVE,
    SEED,
    STEP_MODEL,
    TENANTS,
    TIME_SPAN,
    TOKENS,
    FiniteFloatRange,
    echo_json,
)

if TYPE_CHECKING:  # the tuner's modules load only when a command runs
    from tuner.spec import SpecError, StudyConflict, StudySpec

# CLI parameter -> (StudySpec field, flag as the user typed it).
_SPEC_FLAGS: dict[str, tuple[str, str]] = {
    "policies": ("policies", "--policy"),
    "objectives": ("objectives", "--objective"),
    "constraints": ("constraints", "--constraint"),
    "production": ("production", "--production"),
    "trace_paths": ("traces", "--trace"),
    "mix": ("mix", "--mix"),
    "window": ("trim", "--window"),
    "rate_scale": ("rate_scale", "--rate-scale"),
    "target_rate": ("target_rate", "--target-rate"),
    "cap": ("max_tokens_cap", "--max-tokens-cap"),
    "max_tokens_default": ("max_tokens_default", "--max-tokens-default"),
    "tenants": ("tenants", "--tenants"),
    "seed": ("seed", "--seed"),
    "window_s": ("window_s", "--window-s"),
    "warmup_s": ("warmup_s", "--warmup-s"),
    "windows": ("windows", "--windows"),
    "holdout": ("holdout", "--holdout"),
    "slo": ("slo", "--slo"),
    "ranges": ("ranges", "--range"),
    "fix": ("fixed", "--fix"),
    "search_params": ("search", "--search"),
    "tune_engine": ("tune_engine", "--engine/--no-engine"),
    "num_gpu_blocks": ("num_gpu_blocks", "--num-gpu-blocks"),
    "step_model": ("step_model", "--step-model"),
    "no_pruner": ("pruner", "--no-pruner"),
    "population": ("population_size", "--population"),
}


def _split(text: str | None) -> list[str]:
    return [p.strip() for p in (text or "").split(",") if p.strip()]


def _policy_names(value: str) -> list[str]:
    names = _split(value)
    for n in names:
        if n not in POLICY_NAMES:
            raise ValueError(f"unknown policy {n!r} (valid: {', '.join(POLICY_NAMES)})")
    return names


def _range_texts(value: tuple[str, ...]) -> list[str]:
    """Parsed now, so a malformed span never becomes a study's definition."""
    from tuner.search import parse_range  # the tuner's modules load only when a command runs

    for item in value:
        parse_range(item)
    return list(value)


def _production_doc(value: str) -> dict[str, Any]:
    try:
        doc = json.loads(Path(value).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{value}: {err}") from None
    except RecursionError:  # JSON nested past Python's recursion limit
        raise ValueError(f"{value}: not JSON: nested too deeply") from None
    try:
        return Settings.model_validate(doc).to_dict()
    except ValueError as err:
        raise ValueError(f"{value}: {describe_error(err)}") from None


def _trace_list(value: str) -> list[str | None]:
    from tuner.recorded import canonical, is_recorded, split_traces

    return [
        None if p == "bundled" else canonical(p) if is_recorded(p) else str(Path(p).resolve())
        for p in split_traces(value)
    ] or [None]


def _mix_list(value: tuple[str, ...]) -> list[tuple[str, float]]:
    out = []
    for item in value:
        path, sep, frac = item.rpartition("=")
        if not sep or not path:
            raise ValueError(
                f"{item!r}: expected FILE=FRACTION (e.g. servegen_deepseek_r1_length_pmf.csv=0.2)"
            )
        out.append((str(Path(path).resolve()), float(frac)))
    return out


def _slo_doc(value: tuple[str, ...]) -> dict[str, float]:
    slo: dict[str, float] = {}
    for item in value:
        fam, sep, secs = item.partition("=")
        if not sep:
            raise ValueError(f"{item!r}: expected FAMILY=SECONDS (e.g. ttlt=20)")
        slo[fam.strip()] = float(secs)
    return slo


def _fixed_values(value: tuple[str, ...]) -> dict[str, Any]:
    try:
        return dict(parse_assignment(item) for item in value)
    except RecursionError:  # a JSON value past Python's recursion limit
        raise ValueError("a value nested too deeply") from None


def _step_model_doc(value: str) -> dict[str, Any]:
    """A known name (STEP_MODEL checked it) -> its coefficients."""
    from sim.stepmodel import get_model

    return get_model(value).as_dict()


# CLI parameter -> its value as the StudySpec field's (ValueError: refused); others pass as given.
_SPEC_CONVERT: dict[str, Callable[[Any], Any]] = {
    "policies": _policy_names,
    "ranges": _range_texts,
    "objectives": list,
    "constraints": list,
    "production": _production_doc,
    "trace_paths": _trace_list,
    "mix": _mix_list,
    "window": tuple,  # already (start, duration): TIME_SPAN converted it
    "slo": _slo_doc,
    "fix": _fixed_values,
    "search_params": lambda value: _split(value) or None,
    "step_model": _step_model_doc,
    "no_pruner": lambda value: not value,
}


def _spec_value(param: str, value: Any) -> Any:
    """A CLI value converted to its StudySpec field value (UsageError naming the flag)."""
    flag = _SPEC_FLAGS[param][1]
    try:
        return _SPEC_CONVERT.get(param, lambda v: v)(value)
    except ValueError as err:
        raise click.BadParameter(
            str(err).removeprefix(f"{flag} "), param_hint=flag
        ) from None  # named once


def _given(ctx: click.Context, kw: dict[str, Any]) -> dict[str, Any]:
    """Spec fields the user set on the command line (or by environment), converted."""
    out = {}
    for param in _SPEC_FLAGS:
        source = ctx.get_parameter_source(param)
        if source in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT):
            value = kw[param]
            if value in ((), None) and param not in ("no_pruner", "tune_engine"):
                continue
            out[_SPEC_FLAGS[param][0]] = _spec_value(param, value)
    return out


def _storage_or_exit(storage: str | None, db: str | None, *, must_exist: bool = False) -> str:
    """The storage URL of ``--storage``, or a usage error (exit 2, one line) when the tuner cannot
    use it: an unknown scheme, tailpilot's own database, a file that is not there to read."""
    from tuner.optuna_storage import check_storage_separate, storage_file, storage_url
    from tuner.spec import TuneError

    try:
        url = storage_url(storage)
    except TuneError as err:
        raise click.UsageError(str(err)) from None
    path = storage_file(url)
    if must_exist and path is not None and not Path(path).exists():
        raise click.UsageError(f"--storage: {path} does not exist (no study stored there)")
    try:
        check_storage_separate(url, db or os.environ.get(DB_ENV))
    except TuneError as err:
        raise click.UsageError(str(err)) from None
    return url


def _progress_bar(show: bool):
    """(context manager, callback(complete, total)) for a rich progress bar on stderr."""
    import contextlib

    if not show:
        return contextlib.nullcontext(), None
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
@click.option(
    "--study",
    "study_name",
    required=True,
    metavar="NAME",
    help="Study name (created, joined or resumed).",
)
@click.option(
    "--storage",
    metavar="URL",
    help="Optuna storage: RDB URL (postgresql://... for many machines), SQLite path, "
    "or journal file (journal:PATH, or PATH.journal / PATH.log; no database) [default: ./tailpilot-optuna.db].",
)
@click.option(
    "--trials",
    type=click.IntRange(min=1),
    default=100,
    show_default=True,
    help="Complete trials the study should hold in total (a resumed study continues up to this).",
)
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Local worker processes on the same storage.",
)
@click.option(
    "--policy",
    "policies",
    metavar="NAME[,NAME]",
    help="Policy (or policies) to tune; needed to create a study.",
)
@click.option(
    "--objective",
    "objectives",
    multiple=True,
    metavar="METRIC",
    help="Metric to optimise (repeatable; several → NSGA-II Pareto front), e.g. ttlt_p99.",
)
@click.option(
    "--constraint",
    "constraints",
    multiple=True,
    metavar="EXPR",
    help='e.g. "throughput>=0.99*baseline" or "ttft_p99<=2.0" (baseline = production settings).',
)
@click.option(
    "--production",
    type=click.Path(exists=True, dir_okay=False),
    metavar="FILE",
    help="Current production settings JSON (trial 0 and the baseline) [default: sarathi, vLLM's behaviour].",
)
@click.option(
    "--trace",
    "trace_paths",
    metavar="FILE[,FILE]",
    help="Trace file(s), or one recording as db:[STORE]#recording=NAME[&replicas=R][&from=S&to=S]; "
    "default: the bundled Azure conv window.",
)
@click.option(
    "--recording",
    metavar="NAME",
    help="Tune on a recording of the cluster's own traffic in --db (the same as --trace db:DB#recording=NAME).",
)
@click.option(
    "--mix",
    multiple=True,
    metavar="FILE=FRACTION",
    help="Mix FRACTION of requests from FILE (e.g. the ServeGen reasoning PMF) into each trace (repeatable).",
)
@click.option(
    "--window",
    type=TIME_SPAN,
    metavar="START:DUR",
    help="Keep arrivals in [START, START+DUR) seconds first.",
)
@click.option("--rate-scale", type=POSITIVE, help="Multiply the arrival rate by X (> 0).")
@click.option(
    "--target-rate", type=POSITIVE, help="Rescale arrivals to this many requests/s (> 0)."
)
@click.option(
    "--max-tokens-cap",
    "cap",
    type=TOKENS,
    metavar="N",
    help="Cap every request's output at N tokens.",
)
@click.option(
    "--max-tokens-default",
    type=TOKENS,
    metavar="N",
    help="max_tokens of requests whose trace records no cap (longer outputs are truncated to it) "
    "[default: 4096].",
)
@click.option("--tenants", type=TENANTS, metavar="N", help="Assign N Zipf-distributed tenants.")
@click.option(
    "--seed",
    type=SEED,
    default=0,
    show_default=True,
    help="Seed: held-out split, sampler, generated arrivals.",
)
@click.option(
    "--window-s", type=POSITIVE, default=120.0, show_default=True, help="Window length in seconds."
)
@click.option(
    "--warmup-s",
    type=NON_NEGATIVE,
    default=120.0,
    show_default=True,
    help="Seconds of arrivals replayed before each window and not measured (0: windows start empty).",
)
@click.option(
    "--windows",
    type=click.IntRange(min=1),
    help="Search windows per trial (K) [default: all, up to 12].",
)
@click.option(
    "--holdout",
    type=FiniteFloatRange(0, 1, min_open=True, max_open=True),
    default=0.25,
    show_default=True,
    help="Fraction of windows held out for validation.",
)
@click.option(
    "--slo",
    multiple=True,
    metavar="FAMILY=SECONDS",
    help="SLO for *_slo_* metrics, e.g. ttlt=20 (repeatable).",
)
@click.option(
    "--range",
    "ranges",
    multiple=True,
    metavar="NAME=LO:HI[:log]",
    help="Override a parameter's search span.",
)
@click.option(
    "--fix", multiple=True, metavar="NAME=VALUE", help="Fix a parameter instead of searching it."
)
@click.option(
    "--search", "search_params", metavar="NAME[,NAME]", help="Search only these parameters."
)
@click.option(
    "--engine/--no-engine",
    "tune_engine",
    default=True,
    show_default=True,
    help="Also search max_num_seqs, max_num_batched_tokens, long_prefill_token_threshold.",
)
@click.option(
    "--num-gpu-blocks",
    type=GPU_BLOCKS,
    help="KV cache size in blocks of 16 tokens (default 25,000).",
)
@click.option(
    "--step-model",
    type=STEP_MODEL,
    metavar="NAME",
    help="Step-time coefficient set (default a100-80gb/llama-3-8b/tp1).",
)
@click.option(
    "--no-pruner", is_flag=True, help="Run every window of every trial (no WilcoxonPruner)."
)
@click.option(
    "--population",
    type=click.IntRange(min=2),
    default=20,
    show_default=True,
    help="NSGA-II population (several objectives).",
)
@click.option(
    "--db",
    metavar="URL",
    help=f"tailpilot's database (default ${DB_ENV}); the storage must differ from it.",
)
@click.option(
    "--progress/--no-progress", default=None, help="Progress bar (default: on a terminal)."
)
@click.option("--json", "as_json", is_flag=True, help="Print the outcome as JSON.")
@click.pass_context
def tune(ctx, study_name, storage, trials, workers, db, progress, as_json, **kw):
    """Search a policy's and the engine's settings with Optuna on trace windows.

    Trial 0 is the production settings; each trial replays K search windows (a pruner stops
    hopeless ones); held-out windows are kept for `tailpilot recommend`. Ctrl-C keeps the study:
    run the same command to continue.
    """
    from tuner.optimize import tune as run_tune
    from tuner.optuna_storage import open_storage
    from tuner.spec import SpecError, StudyConflict, TuneError
    from tuner.study import study_exists

    url = _storage_or_exit(storage, db)
    recording = kw.pop("recording")
    if recording is not None:
        from tuner.recorded import RecordedSpan

        if kw["trace_paths"]:
            raise click.UsageError("give --trace or --recording, not both")
        kw["trace_paths"] = RecordedSpan(db=db, recording=recording).url()
        ctx.params["trace_paths"] = kw["trace_paths"]
    given = _given(ctx, kw)
    if recording is not None:
        given["traces"] = _spec_value("trace_paths", kw["trace_paths"])
    try:
        exists = study_exists(open_storage(url), study_name)
    except TuneError as err:
        raise click.UsageError(str(err)) from None
    spec = None if exists else _new_spec(study_name, given)
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
                workers=workers,
                progress=update,
                log=log,
            )
    except StudyConflict as err:
        raise _conflict_error(err, study_name) from None
    except SpecError as err:
        raise _spec_error(err) from None
    except TuneError as err:
        raise click.UsageError(str(err)) from None
    except KeyboardInterrupt:
        click.echo("interrupted while setting the study up; run the same command again", err=True)
        sys.exit(130)
    _report_tune(outcome, url, storage, as_json)
    if outcome.interrupted:
        sys.exit(130)


def _new_spec(study_name: str, given: dict[str, Any]) -> StudySpec:
    """The definition of a study to create from the flags given (UsageError naming a flag)."""
    from tuner.spec import SpecError, StudySpec

    for need in ("policies", "objectives"):
        if need not in given:
            raise click.UsageError(
                f"study {study_name!r} does not exist yet: {_flag_of(need)} is needed to create it"
            )
    try:
        spec = StudySpec(**given)
    except SpecError as err:
        raise _spec_error(err) from None
    if not given["policies"]:
        raise click.BadParameter("give at least one policy", param_hint="--policy")
    return spec


def _spec_error(err: SpecError) -> click.UsageError:
    """A refused StudySpec field, named by its flag (``window_s: ...`` -> ``--window-s: ...``)."""
    return click.UsageError(err.naming(_flag_of(err.field_name)))


def _conflict_error(err: StudyConflict, study_name: str) -> click.UsageError:
    """A flag whose value differs from the study's stored definition."""
    why = ""
    if err.field_name == "seed":  # the seed fixes the windows and the split, not a worker's stream
        why = (
            " (the seed fixes the study's windows and held-out split; every trial already draws its "
            "own sampler stream, so a joining worker needs no seed of its own)"
        )
    return click.UsageError(
        f"{_flag_of(err.field_name)} {_show(err.given)} conflicts with study {study_name!r}, "
        f"which was created with {_show(err.stored)}{why}; drop the flag to resume or join, "
        "or use a new --study"
    )


def _flag_of(field_name: str) -> str:
    for spec_field, flag in _SPEC_FLAGS.values():
        if spec_field == field_name:
            return flag
    return field_name


def _show(value: Any) -> str:
    if isinstance(value, (list, tuple)) and len(value) == 1:
        value = value[0]
    return json.dumps(value) if isinstance(value, (dict, list)) else repr(value)


def _report_tune(outcome, url: str, storage: str | None, as_json: bool) -> None:
    from dataclasses import asdict

    from tuner.recommend import jsonable

    if as_json:
        echo_json(jsonable(asdict(outcome)))
        return
    state = "interrupted" if outcome.interrupted else "done"
    click.echo(
        f"study {outcome.study}: {outcome.complete} of {outcome.requested} trials complete ({state})"
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
    from tuner.optuna_storage import redact

    where = f" --storage {redact(storage) if '://' in storage else storage}" if storage else ""
    if outcome.interrupted:
        click.echo(
            f"run the same command to continue; `tailpilot recommend --study {outcome.study}{where}` reads it now"
        )
    else:
        click.echo(f"next: tailpilot recommend --study {outcome.study}{where}")


@click.command()
@click.option("--study", "study_name", required=True, metavar="NAME")
@click.option(
    "--storage",
    metavar="URL",
    help="Optuna storage of the study: RDB URL, SQLite path or journal:PATH "
    "[default: ./tailpilot-optuna.db].",
)
@click.option(
    "--db",
    metavar="URL",
    help=f"Store the recommendation here (default ${DB_ENV} or ./tailpilot.db).",
)
@click.option("--no-store", is_flag=True, help="Only print; do not store the recommendation.")
@click.option(
    "--autopilot",
    "with_autopilot",
    is_flag=True,
    help="Also judge keeping the autopilot (it replays every trace whole, choosing online) against "
    "the recommendation; about a dozen replays of the traces more.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the recommendation as JSON.")
def recommend(study_name, storage, db, no_store, with_autopilot, as_json):
    """The study's best settings (or Pareto front) and their improvement over the production
    settings on search and on held-out windows, with confidence intervals over windows; stored
    so the TUI shows it."""
    from tuner.optuna_storage import open_storage
    from tuner.recommend import jsonable
    from tuner.recommend import recommend as build
    from tuner.spec import TuneError

    url = _storage_or_exit(storage, db, must_exist=True)
    try:
        summary = jsonable(build(open_storage(url), study_name, with_autopilot=with_autopilot))
    except TuneError as err:
        raise click.UsageError(str(err)) from None
    if not no_store:
        from tailpilot.cli_cluster import open_store

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
    _print_recommendation(summary)


def _ci(m: dict) -> str:
    lo, hi = m.get("ci_pct") or (None, None)
    imp = m.get("improvement_pct")
    if imp is None:
        return "—"
    text = f"{imp:+.1f}%"
    if lo is not None and hi is not None:
        text += f" [{lo:+.1f}, {hi:+.1f}]"
    return text


def _fmt(v: Any) -> str:
    from controlplane.views import fmt_figure

    return fmt_figure(v)


def _print_recommendation(s: dict) -> None:
    from rich.table import Table

    from controlplane.views import wide_console

    console = wide_console()
    pct = int(round(s["confidence"] * 100))
    head = (
        "keep the production settings (nothing beat them)"
        if s["is_production"]
        else f"trial #{s['trial']}"
    )
    console.print(
        f"[bold]study {s['study']}[/]: {s['trials_complete']} complete trials; recommendation: {head}"
    )
    for t in s.get("traces", []):
        console.print(
            f"tuned on {t['source']} ({t['requests']:,} requests over {t['span_s']:,.0f} s)",
            markup=False,
        )
    for part, title in (
        ("search", "search windows (selected on; optimistic)"),
        ("holdout", "held-out windows (never searched)"),
    ):
        block = s[part]
        table = Table(
            title=f"{title}: {len(block['windows'])} windows; vs production, positive = better"
        )
        table.add_column("metric")
        table.add_column("production (mean)", justify="right")
        table.add_column("recommended (mean)", justify="right")
        table.add_column("change of means", justify="right")
        table.add_column(f"per-window change [{pct}% CI]", justify="right")
        for name, m in block["metrics"].items():
            mean_change = m.get("mean_change_pct")
            table.add_row(
                name,
                _fmt(m["baseline"]),
                _fmt(m["value"]),
                "—" if mean_change is None else f"{mean_change:+.1f}%",
                _ci(m),
            )
        console.print(table)
    console.print(
        "per-window change: geometric mean over windows of recommended/production, with a "
        "t-interval over windows"
    )
    if s.get("continuous"):
        _print_continuous(console, s["continuous"])
    _print_constraints(console, s["holdout"].get("constraints", []))
    if s.get("pareto_front"):
        console.print(
            f"Pareto front: {len(s['pareto_front'])} trials "
            f"({', '.join('#' + str(t['trial']) for t in s['pareto_front'])})"
        )
    console.print("settings: " + json.dumps(s["settings"]))
    if s.get("autopilot"):
        console.print(
            f"autopilot on the continuous replay: {s['autopilot']['verdict']}", markup=False
        )
    if "stored_id" in s:
        console.print(f"stored as recommendation {s['stored_id']} (the TUI shows it)")


def _print_continuous(console, cont: dict) -> None:
    """The continuous replay of the whole trace: production vs the recommendation, and the
    candidates passed over."""
    from rich.table import Table

    table = Table(
        title="continuous replay of the whole trace (what production would see); vs production"
    )
    table.add_column("metric")
    for col in (
        "production, held-out requests",
        "recommended",
        "change",
        "production, all requests",
        "recommended",
        "change",
    ):
        table.add_column(col, justify="right")
    for name, h in cont["holdout"].items():
        a = cont["all"][name]
        table.add_row(
            name,
            *(
                cell
                for m in (h, a)
                for cell in (
                    _fmt(m["production"]),
                    _fmt(m["value"]),
                    "—" if m["change_pct"] is None else f"{m['change_pct']:+.1f}%",
                )
            ),
        )
    console.print(table)
    for c in cont["checked"]:
        if c["losses"]:
            console.print(
                f"trial #{c['trial']} passed over: it loses the continuous replay "
                f"({'; '.join(c['losses'])})"
            )
    if cont["kept_production"]:
        console.print(
            "every candidate checked lost the continuous replay: keep the production settings"
        )


def _print_constraints(console, constraints: list[dict]) -> None:
    for c in constraints:
        # The value is how far the left side is past its bound (Optuna's convention): <= 0 holds.
        v = c["value"]
        if v is None:
            detail = "undefined on these windows"
        elif c["feasible"]:
            detail = f"with {_fmt(-v)} to spare"
        else:
            detail = f"by {_fmt(v)} over the bound"
        ok = "holds" if c["feasible"] else "VIOLATED"
        console.print(f"constraint {c['constraint']} on held-out windows: {ok} ({detail})")


COMMANDS = (tune, recommend)

"""The options that define a study (``tuner.studies.spec.StudySpec``) and how their values become
its
fields: given when ``tailpilot tune`` creates a study, checked against its stored definition when
it resumes or joins one. The tuner's errors name a field (``window_s``); these name the field's
flag instead (``--window-s``, :data:`SPEC_FLAGS`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from click.core import ParameterSource

from scheduler.settings import Settings, describe_error
from scheduler.settings_change import parse_assignment
from tailpilot import options
from tailpilot.cli_common import NON_NEGATIVE, FiniteFloatRange, KeyValue
from tailpilot.cli_trace import old_window_option, span_or_exit

if TYPE_CHECKING:  # the tuner's modules load only when a command runs (start-up cost)
    from tuner.studies.spec import SpecError, StudyConflict, StudySpec

# CLI parameter -> (StudySpec field, flag as the user typed it).
SPEC_FLAGS: dict[str, tuple[str, str]] = {
    "policies": ("policies", "--policy"),
    "objectives": ("objectives", "--objective"),
    "constraints": ("constraints", "--constraint"),
    "production": ("production", "--production"),
    "trace_paths": ("traces", "--trace"),
    "mix": ("mix", "--mix"),
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
# The fraction's and the seconds' ranges are the study's to check: its errors name the field.
MIX = KeyValue("FILE=FRACTION", "servegen_deepseek_r1_length_pmf.csv=0.2", click.FLOAT, last=True)
SLO = KeyValue("FAMILY=SECONDS", "ttlt=20", click.FLOAT)
# StudySpec fields set from more than one flag.
FIELD_FLAGS = {"trim": "--from/--to"}


def _split(text: str | None) -> list[str]:
    return [p.strip() for p in (text or "").split(",") if p.strip()]


def _range_texts(value: tuple[str, ...]) -> list[str]:
    """Parsed now, so a malformed span never becomes a study's definition."""
    from tuner.studies.search import parse_range  # start-up cost

    for item in value:
        parse_range(item)
    return list(value)


def _production_doc(value: str) -> dict[str, Any]:
    # Read as the plugin reads its settings file: a regular file, capped (a FIFO or /dev/zero
    # hung or exhausted memory), strict JSON.
    from scheduler.plugin.wire import parse_json_file  # start-up cost

    try:
        doc = parse_json_file(value)
    except OSError as err:
        raise ValueError(f"{value}: cannot read: {err.strerror or err}") from None
    except ValueError as err:
        raise ValueError(f"{value}: {err}") from None
    try:
        return Settings.model_validate(doc).to_dict()
    except ValueError as err:
        raise ValueError(f"{value}: {describe_error(err)}") from None


def _trace_list(value: str) -> list[str | None]:
    from tuner.closed_loop.recorded import canonical, is_recorded, split_traces  # start-up cost

    return [
        None if p == "bundled" else canonical(p) if is_recorded(p) else str(Path(p).resolve())
        for p in split_traces(value)
    ] or [None]


def _mix_list(value: tuple[tuple[str, float], ...]) -> list[tuple[str, float]]:
    return [(str(Path(path).resolve()), fraction) for path, fraction in value]


def _slo_doc(value: tuple[tuple[str, float], ...]) -> dict[str, float]:
    return {family.strip(): seconds for family, seconds in value}


def _fixed_values(value: tuple[str, ...]) -> dict[str, Any]:
    try:
        return dict(parse_assignment(item) for item in value)
    except RecursionError:  # a JSON value past Python's recursion limit
        raise ValueError("a value nested too deeply") from None


def _step_model_doc(value: str) -> dict[str, Any]:
    """A known name (STEP_MODEL checked it) -> its coefficients."""
    from sim.stepmodel import get_model  # start-up cost

    return get_model(value).as_dict()


# CLI parameter -> its value as the StudySpec field's (ValueError: refused); others pass as given.
SPEC_CONVERT: dict[str, Callable[[Any], Any]] = {
    "policies": list,  # already names: POLICY_LIST checked them
    "ranges": _range_texts,
    "objectives": list,
    "constraints": list,
    "production": _production_doc,
    "trace_paths": _trace_list,
    "mix": _mix_list,
    "slo": _slo_doc,
    "fix": _fixed_values,
    "search_params": lambda value: _split(value) or None,
    "step_model": _step_model_doc,
    "no_pruner": lambda value: not value,
}


def spec_value(param: str, value: Any, *, flag: str | None = None) -> Any:
    """A CLI value converted to its StudySpec field value (UsageError naming the flag: ``flag``
    when another flag gave the value, as --recording gives the traces)."""
    flag = flag or SPEC_FLAGS[param][1]
    try:
        return SPEC_CONVERT.get(param, lambda v: v)(value)
    except ValueError as err:
        raise click.BadParameter(
            str(err).removeprefix(f"{flag} "), param_hint=flag
        ) from None  # named once


def given_fields(ctx: click.Context, kw: dict[str, Any]) -> dict[str, Any]:
    """Spec fields the user set on the command line (or by environment), converted."""
    out = {}
    for param in SPEC_FLAGS:
        source = ctx.get_parameter_source(param)
        if source in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT):
            value = kw[param]
            if value in ((), None) and param not in ("no_pruner", "tune_engine"):
                continue
            out[SPEC_FLAGS[param][0]] = spec_value(param, value)
    return out


def study_span(
    start_s: float | None, end_s: float | None, window: tuple[float, float] | None
) -> tuple[float, float] | None:
    """The study's span (StudySpec.trim: start and length) from --from/--to; a study keeps both
    ends, so --from needs --to."""
    start_s, end_s = span_or_exit(start_s, end_s, window)
    if start_s is None and end_s is None:
        return None
    if end_s is None:
        raise click.UsageError("--from needs --to in tune: a study keeps its span's both ends")
    start = start_s or 0.0
    return (start, end_s - start)


def recorded_trace(kw: dict[str, Any], db: str | None) -> None:
    """--recording (with --replica) as the ``db:`` URL --trace would give: one way to name it."""
    recording, replicas = kw.pop("recording"), tuple(kw.pop("replicas"))
    if recording is None:
        if replicas:
            raise click.UsageError(
                "--replica goes with --recording (a db: URL names its replicas=)"
            )
        return
    from tuner.closed_loop.recorded import RecordedSpan  # start-up cost

    if kw["trace_paths"]:
        raise click.UsageError("give --trace or --recording, not both")
    kw["trace_paths"] = RecordedSpan(db=db, recording=recording, replicas=replicas).url()


def study_definition_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The options that define a study (``StudySpec``): given when it is created, checked against
    its definition when it is resumed or joined."""
    return options.stack(
        options.policies(help="Policy (or policies) to tune; needed to create a study."),
        click.option(
            "--objective",
            "objectives",
            multiple=True,
            metavar="METRIC",
            help="Metric to optimise (repeatable; several → NSGA-II Pareto front), e.g. ttlt_p99.",
        ),
        click.option(
            "--constraint",
            "constraints",
            multiple=True,
            metavar="EXPR",
            help='e.g. "throughput>=0.99*baseline" or "ttft_p99<=2.0" (baseline = production '
            "settings).",
        ),
        click.option(
            "--production",
            type=click.Path(exists=True, dir_okay=False),
            metavar="FILE",
            help="Current production settings JSON (trial 0 and the baseline) [default: sarathi, "
            "vLLM's behaviour].",
        ),
        options.trace(several=True),
        options.recording(
            help="Tune on a recording of the cluster's own traffic in --db (the same as --trace "
            "db:DB#recording=NAME); one still running is tuned on as far as it is stored now "
            "(the study pins that span: requests recorded later are not part of it)."
        ),
        options.replica(
            help="With --recording: the replica whose traffic to tune on (repeatable: merged); "
            "needed when the recording has several."
        ),
        click.option(
            "--mix",
            multiple=True,
            type=MIX,
            metavar="FILE=FRACTION",
            help="Mix FRACTION of requests from FILE (e.g. the ServeGen reasoning PMF) into each "
            "trace (repeatable).",
        ),
        options.span_bounds(what="each trace"),
        old_window_option(),
        options.rate_scale(),
        options.target_rate(),
        options.max_tokens_cap(),
        options.max_tokens_default(),
        options.tenants(),
        options.seed(help="Seed: held-out split, sampler, generated arrivals."),
        options.window_length(
            default=120.0,
            help="Window length [default: 120: trials are compared on each window's tail "
            "percentiles, and twice the SLO window gives them twice the requests].",
        ),
        click.option(
            "--warmup-s",
            type=NON_NEGATIVE,
            default=120.0,
            show_default=True,
            metavar="SECONDS",
            help="Seconds of arrivals replayed before each window and not measured (0: windows "
            "start empty).",
        ),
        click.option(
            "--windows",
            type=click.IntRange(min=1),
            metavar="K",
            help="Search windows per trial (K) [default: all, up to 12].",
        ),
        click.option(
            "--holdout",
            type=FiniteFloatRange(0, 1, min_open=True, max_open=True),
            metavar="FRACTION",
            default=0.25,
            show_default=True,
            help="Fraction of windows held out for validation.",
        ),
        click.option(
            "--slo",
            multiple=True,
            type=SLO,
            metavar="FAMILY=SECONDS",
            help="SLO for *_slo_* metrics, e.g. ttlt=20 (repeatable).",
        ),
        click.option(
            "--range",
            "ranges",
            multiple=True,
            metavar="NAME=LO:HI[:log]",
            help="Override a parameter's search span.",
        ),
        click.option(
            "--fix",
            multiple=True,
            metavar="NAME=VALUE",
            help="Fix a parameter instead of searching it.",
        ),
        click.option(
            "--search", "search_params", metavar="NAME[,NAME]", help="Search only these parameters."
        ),
        click.option(
            "--engine/--no-engine",
            "tune_engine",
            default=True,
            show_default=True,
            help="Also search max_num_seqs, max_num_batched_tokens, long_prefill_token_threshold.",
        ),
        options.num_gpu_blocks(),
        options.step_model(),
        click.option(
            "--no-pruner", is_flag=True, help="Run every window of every trial (no WilcoxonPruner)."
        ),
        click.option(
            "--population",
            type=click.IntRange(min=2),
            metavar="N",
            default=20,
            show_default=True,
            help="NSGA-II population (several objectives).",
        ),
    )(fn)


def new_spec(
    study_name: str, given: dict[str, Any], *, traces_flag: str | None = None
) -> StudySpec:
    """The definition of a study to create from the flags given (UsageError naming a flag;
    ``traces_flag``: the flag that gave the traces when not --trace)."""
    from tuner.studies.spec import SpecError, StudySpec  # start-up cost

    for need in ("policies", "objectives"):
        if need not in given:
            raise click.UsageError(
                f"study {study_name!r} does not exist yet: {flag_of(need)} is needed to create it"
            )
    try:
        spec = StudySpec(**given)
    except SpecError as err:
        raise spec_error(err, traces_flag=traces_flag) from None
    if not given["policies"]:
        raise click.BadParameter("give at least one policy", param_hint="--policy")
    return spec


def spec_error(err: SpecError, *, traces_flag: str | None = None) -> click.UsageError:
    """A refused StudySpec field, named by its flag (``window_s: ...`` -> ``--window-s: ...``;
    the traces by ``traces_flag`` when given: --recording sets them too)."""
    return click.UsageError(err.naming(flag_of(err.field_name, traces_flag=traces_flag)))


def conflict_error(
    err: StudyConflict, study_name: str, *, traces_flag: str | None = None
) -> click.UsageError:
    """A flag whose value differs from the study's stored definition (``traces_flag``: the flag
    that gave the traces when not --trace)."""
    why = ""
    if err.field_name == "seed":  # the seed fixes the windows and the split, not a worker's stream
        why = (
            " (the seed fixes the study's windows and held-out split; every trial already draws "
            "its own sampler stream, so a joining worker needs no seed of its own)"
        )
    return click.UsageError(
        f"{flag_of(err.field_name, traces_flag=traces_flag)} {_show(err.given)} conflicts with "
        f"study {study_name!r}, "
        f"which was created with {_show(err.stored)}{why}; drop the flag to resume or join, "
        "or use a new --study"
    )


def flag_of(field_name: str, *, traces_flag: str | None = None) -> str:
    """The flag that sets StudySpec field ``field_name`` (the field's name when none does);
    ``traces_flag``: the flag that set the traces, when not --trace (--recording)."""
    if field_name == "traces" and traces_flag:
        return traces_flag
    for spec_field, flag in SPEC_FLAGS.values():
        if spec_field == field_name:
            return flag
    return FIELD_FLAGS.get(field_name, field_name)


def _show(value: Any) -> str:
    if isinstance(value, (list, tuple)) and len(value) == 1:
        value = value[0]
    return json.dumps(value) if isinstance(value, (dict, list)) else repr(value)

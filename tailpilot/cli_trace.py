"""What ``sim``, ``compare``, ``capacity`` and ``twin`` share: choosing and shaping a trace, sizing
the simulated engine, and the settings document it runs.

    tailpilot sim --trace FILE --from 60 --to 660 --rate-scale 1.5
    tailpilot sim --recording peak --replica a100-0 [--db URL] [--from 0 --to 600]

A recording is named the same way everywhere (``tune`` and ``fidelity`` too): ``--recording NAME``
in ``--db``, ``--replica NAME`` (repeatable) for a span with several replicas, ``--from``/``--to``
for a part of it: the fields of a ``db:[STORE]#recording=NAME&replicas=R&from=S&to=S`` URL, which
``--trace`` takes as well. The trace options reach a command as one :class:`TraceRequest`
(``trace_request``), the engine options as one :class:`EngineRequest` (``engine``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import click
from annotated_types import Ge, Le

from scheduler.settings import PREDICTED_POLICIES, EngineSettings, Settings, describe_error
from scheduler.settings_change import settings_from_cli, split_assignment
from tailpilot import options
from tailpilot.cli_common import TIME_SPAN, TRACE_PARSE_ERRORS, unreadable_trace

if TYPE_CHECKING:  # the simulator loads only when a command runs (start-up cost)
    from sim.engine import EngineConfig
    from sim.traces import Trace


@dataclass(frozen=True)
class TraceRequest:
    """What the trace options name: the source (a trace file, a ``db:`` URL, a recording, or the
    bundled window when none), the part of it to keep, and the transforms, in their one order
    (``sim.traces.transform``)."""

    path: str | None = None
    recording: str | None = None
    replicas: tuple[str, ...] = ()
    db: str | None = None
    start_s: float | None = None
    end_s: float | None = None
    rate_scale: float | None = None
    target_rate: float | None = None
    max_tokens_cap: int | None = None
    max_tokens_default: int | None = None
    tenants: int | None = None
    seed: int = 0

    def source(self) -> str | None:
        """The trace file or ``db:`` URL to load (None: the bundled window); a usage error when
        the options contradict each other."""
        if self.recording is None:
            if self.replicas:
                raise click.UsageError(
                    "--replica goes with --recording (a db: URL names its replicas=)"
                )
            if self.db is not None:
                raise click.UsageError("--db goes with --recording (a db: URL names its database)")
            return self.path
        if self.path is not None:
            raise click.UsageError("give --trace or --recording, not both")
        from tuner.closed_loop.recorded import RecordedSpan  # start-up cost

        return RecordedSpan(db=self.db, recording=self.recording, replicas=self.replicas).url()

    def window(self, last_arrival_s: float) -> tuple[float, float] | None:
        """``(start, duration)`` for ``sim.traces.transform`` from --from/--to (None: the whole
        trace); without --to the window runs past the last arrival."""
        if self.start_s is None and self.end_s is None:
            return None
        start = self.start_s or 0.0
        end = self.end_s if self.end_s is not None else last_arrival_s + 1.0
        if end <= start:
            raise click.UsageError(
                f"--from {start:g}: the trace ends {last_arrival_s:g} s after its first arrival"
            )
        return (start, end - start)


def span_or_exit(
    start_s: float | None, end_s: float | None, window: tuple[float, float] | None
) -> tuple[float | None, float | None]:
    """--from/--to, or the old ``--window START:DUR`` spelling turned into them (with a note on
    stderr); a usage error when --to is not after --from, or both spellings are given."""
    if window is not None:
        if start_s is not None or end_s is not None:
            raise click.UsageError("--window START:DUR is the old --from/--to: give one of them")
        start_s, end_s = window[0], window[0] + window[1]
        click.echo(
            f"note: --window is now --from {start_s:g} --to {end_s:g} (docs/cli.md)", err=True
        )
    if start_s is not None and end_s is not None and end_s <= start_s:
        raise click.BadParameter(f"{end_s:g} is not after --from {start_s:g}", param_hint="--to")
    return start_s, end_s


def old_window_option() -> options.Decorator:
    """The hidden ``--window START:DUR``: the README's old spelling of --from/--to, still read."""
    return click.option("--window", type=TIME_SPAN, metavar="START:DUR", hidden=True)


TRACE_PARAMS = (
    "trace_path",
    "recording",
    "replicas",
    "db",
    "start_s",
    "end_s",
    "window",
    "rate_scale",
    "target_rate",
    "cap",
    "max_tokens_default",
    "tenants",
    "seed",
)


def trace_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The trace options, handed to ``fn`` as one :class:`TraceRequest` (``trace_request``)."""

    @functools.wraps(fn)
    def command(**kwargs: Any) -> Any:
        given = {name: kwargs.pop(name) for name in TRACE_PARAMS}
        start_s, end_s = span_or_exit(given["start_s"], given["end_s"], given["window"])
        request = TraceRequest(
            path=given["trace_path"],
            recording=given["recording"],
            replicas=tuple(given["replicas"]),
            db=given["db"],
            start_s=start_s,
            end_s=end_s,
            rate_scale=given["rate_scale"],
            target_rate=given["target_rate"],
            max_tokens_cap=given["cap"],
            max_tokens_default=given["max_tokens_default"],
            tenants=given["tenants"],
            seed=given["seed"],
        )
        return fn(trace_request=request, **kwargs)

    return options.stack(
        options.trace(),
        options.recording(),
        options.replica(
            help="With --recording: the replica whose traffic to replay (repeatable: "
            "merged); needed when the recording has several."
        ),
        options.database(
            help="With --recording: the database holding it "
            f"[default: ${options.DB_ENV}, else ./tailpilot.db]."
        ),
        options.span_bounds(),
        old_window_option(),
        options.rate_scale(),
        options.target_rate(),
        options.max_tokens_cap(),
        options.max_tokens_default(),
        options.tenants(),
        options.seed(),
    )(command)


def load_trace(request: TraceRequest) -> Trace:
    """The trace the options name, transformed; a one-line usage error for what cannot be loaded
    (an unknown format, a bad line, an empty result)."""
    from sim.traces import TraceError  # start-up cost

    path = request.source()
    try:
        return _load_trace(request, path)
    except TraceError as err:
        raise click.UsageError(str(err)) from None
    except TRACE_PARSE_ERRORS as err:
        raise unreadable_trace(path, err) from None


def _load_trace(request: TraceRequest, path: str | None) -> Trace:
    from sim import traces  # start-up cost
    from tuner.closed_loop.recorded import load_recorded, parse_url  # start-up cost

    default_cap = request.max_tokens_default or traces.DEFAULT_MAX_TOKENS
    if path in (None, "bundled"):
        trace = traces.load_bundled(max_tokens_default=default_cap)
    elif path.startswith("db:"):
        trace = load_recorded(parse_url(path), max_tokens_default=default_cap)
    else:
        trace = _load_file(path, request, default_cap)
    last = max((r.arrival for r in trace), default=0.0)
    try:
        trace = traces.transform(
            trace,
            window=request.window(last),
            rate_scale=request.rate_scale,
            rate=request.target_rate,
            max_tokens_cap=request.max_tokens_cap,
            tenants=request.tenants,
            seed=request.seed,
        )
    except ValueError as err:  # what the options ask cannot be done to this trace
        raise click.UsageError(f"{trace.name}: {err}") from None
    if len(trace) == 0:
        raise click.UsageError("the trace is empty after the transforms")
    if trace.truncated:
        # On stderr, so --json output stays one document.
        click.echo(
            f"note: {trace.truncated} of {len(trace)} requests of {trace.name} had outputs longer "
            "than their max_tokens cap and were truncated to it (cap for requests the trace "
            f"records none: {default_cap}; --max-tokens-default N to change it)",
            err=True,
        )
    return trace


def _load_file(path: str, request: TraceRequest, default_cap: int) -> Trace:
    from sim import traces  # start-up cost

    # A length-only trace has no arrival times: --target-rate gives it Poisson arrivals.
    generate = {"rate": request.target_rate} if request.target_rate else {}
    try:
        return traces.load_trace(
            path, seed=request.seed, max_tokens_default=default_cap, **generate
        )
    except traces.ArrivalsNeeded as err:
        if err.needs == ("rate",):
            raise click.UsageError(
                f"{path}: lengths without arrival times: give --target-rate REQ_PER_S "
                "(Poisson arrivals at that rate)"
            ) from None
        raise click.UsageError(
            f"{path}: a length distribution, not requests: sample it from Python "
            "(sim.traces.load_servegen_reasoning) or mix it into a trace "
            "(tailpilot tune --mix FILE=FRACTION)"
        ) from None


# --- the simulated engine ---------------------------------------------------------------------
def engine_limit(name: str) -> click.IntRange:
    """The range the settings document allows an engine limit (``EngineSettings``), so that the
    option refuses what the document would, naming the option instead of ``engine.<name>``."""
    low: int | None = None
    high: int | None = None
    for bound in EngineSettings.model_fields[name].metadata:
        if isinstance(bound, Ge):
            low = cast(int, bound.ge)  # an int field: its bounds are ints
        elif isinstance(bound, Le):
            high = cast(int, bound.le)
    return click.IntRange(low, high)


ENGINE_LIMITS = ("max_num_seqs", "max_num_batched_tokens", "long_prefill_token_threshold")


@dataclass(frozen=True)
class EngineRequest:
    """The engine options: live limits (the settings document's engine block) and replica facts
    (KV blocks, the step-time model)."""

    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    long_prefill_token_threshold: int | None = None
    num_gpu_blocks: int | None = None
    step_model: str | None = None
    no_enable_prefix_caching: bool = False  # vLLM's flag: a victim recomputes all of its prefix

    def limits(self) -> dict[str, int]:
        """The limits given on the command line, over vLLM's defaults for the step model's GPU."""
        from sim.stepmodel import DEFAULT_MODEL_NAME, engine_defaults  # start-up cost

        given = {k: getattr(self, k) for k in ENGINE_LIMITS if getattr(self, k) is not None}
        return {**engine_defaults(self.step_model or DEFAULT_MODEL_NAME), **given}

    def config(self) -> EngineConfig:
        from sim.engine import EngineConfig  # start-up cost
        from sim.stepmodel import get_model  # start-up cost

        kw: dict[str, Any] = {}
        if self.num_gpu_blocks:
            kw["num_gpu_blocks"] = self.num_gpu_blocks
        if self.step_model:
            kw["step_model"] = get_model(self.step_model)
        if self.no_enable_prefix_caching:
            kw["prefix_caching"] = False
        return EngineConfig(**kw)


def engine_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The engine options, handed to ``fn`` as one :class:`EngineRequest` (``engine``)."""
    names = (*ENGINE_LIMITS, "num_gpu_blocks", "step_model", "no_enable_prefix_caching")

    @functools.wraps(fn)
    def command(**kwargs: Any) -> Any:
        engine = EngineRequest(**{name: kwargs.pop(name) for name in names})
        return fn(engine=engine, **kwargs)

    return options.stack(
        click.option(
            "--max-num-seqs",
            type=engine_limit("max_num_seqs"),
            metavar="N",
            help="Engine: max running sequences [default: vLLM's for the step model's GPU, A100 "
            "256, H100/H200 1,024].",
        ),
        click.option(
            "--max-num-batched-tokens",
            type=engine_limit("max_num_batched_tokens"),
            metavar="N",
            help="Engine: token budget per step [default: vLLM's for the step model's GPU, A100 "
            "2,048, H100/H200 8,192].",
        ),
        click.option(
            "--long-prefill-token-threshold",
            type=engine_limit("long_prefill_token_threshold"),
            metavar="N",
            help="Engine: max prefill chunk (0 = off).",
        ),
        options.num_gpu_blocks(),
        options.step_model(),
        click.option(
            "--no-enable-prefix-caching",
            is_flag=True,
            help="Engine: as vLLM run with this flag — a preempted request recomputes its whole "
            "prefix [default: vLLM's prefix cache, on: a victim readmitted before its freed "
            "blocks are reused finds them].",
        ),
    )(command)


# --- the settings document --------------------------------------------------------------------
def settings_or_exit(
    policy: str,
    assignments: Sequence[str],
    pins: Sequence[str],
    engine: dict[str, int],
    predictor: str = "oracle",
) -> Settings:
    """The settings document of --policy/--set/--pin over ``engine``'s limits; a policy that reads
    a length predictor gets ``predictor`` unless --set names one. A usage error names the field."""
    given = list(assignments)
    if policy in PREDICTED_POLICIES and not any(
        (parts := split_assignment(a, strip=True)) is not None and parts[0] == "predictor"
        for a in given
    ):
        given.insert(0, f"predictor={predictor}")
    try:
        return settings_from_cli(policy, given, list(pins), engine)
    except ValueError as err:  # pydantic's ValidationError is a ValueError
        raise click.UsageError(describe_error(err)) from None
    except RecursionError:  # a JSON value past Python's recursion limit
        raise click.BadParameter("a value nested too deeply", param_hint="--set") from None


def settings_file_or_exit(path: str, option: str = "--settings") -> Settings:
    """The settings document in the file at ``path`` (``tailpilot export``'s format)."""
    from controlplane.export import ExportError, load_settings_file  # start-up cost

    try:
        return load_settings_file(path)
    except ExportError as err:
        raise click.BadParameter(str(err), param_hint=option) from None
    except RecursionError:
        raise click.BadParameter(f"{path}: nested too deeply", param_hint=option) from None

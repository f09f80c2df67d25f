"""What every ``tailpilot`` command shares: parameter types that refuse what makes no sense, and
strict JSON output.

The types turn a bad value into click's own one-line usage error naming the option and the allowed
range (exit 2) before anything runs, instead of a traceback from deep in the simulator:

    --rate-scale 0     Error: Invalid value for '--rate-scale': 0.0 is not in the range x>0.
    --rate-scale nan   Error: Invalid value for '--rate-scale': nan is not a finite number in the
                       range x>0.
    --step-model x     Error: Invalid value for '--step-model': unknown step-time model 'x'; known:
                       ...

One object per kind of value (``POSITIVE``, ``WINDOW_LENGTH``, ``REPLICA_COUNT``, ``POLICY``, ...):
an option spelled the same in two commands takes the same type there (``tailpilot.options``,
docs/cli.md; tests/test_cli_vocabulary.py checks it).

Every ``--json`` output goes through :func:`echo_json`: strict JSON (RFC 8259), so a figure that is
undefined (a percent change against a zero baseline, a percentile of no requests) is ``null``,
never the bare ``NaN`` or ``Infinity`` that Python's ``json`` writes and JSON parsers refuse.
"""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from scheduler.settings import POLICY_NAMES
from scheduler.settings_change import split_assignment
from storage.strict_json import finite

# Bounds that keep derived values inside what the simulator, numpy and the store take: seeds feed
# numpy's and Optuna's generators (below 2**32 even after the tuner adds its per-worker offset),
# token counts and KV blocks fit the store's integer columns, tenants an array per tenant.
MAX_SEED = 2**31 - 1
MAX_TOKENS = 2**31 - 1
MAX_GPU_BLOCKS = 2**31 - 1
MAX_TENANTS = 1_000_000
MAX_REPLICAS = 4096  # twin replicas in one process: ports and threads, not the simulator, bound it


class FiniteFloatRange(click.FloatRange):
    """``click.FloatRange`` that also refuses NaN and ±Infinity.

    ``float("nan")`` compares false with every bound, so a plain FloatRange lets ``nan`` through
    (and ``inf`` whenever there is no upper bound); here both are usage errors naming the range.
    """

    name = "finite float range"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(
                f"{number} is not a finite number in the range {describe_range(self)}.", param, ctx
            )
        return number


def describe_range(kind: click.FloatRange | click.IntRange) -> str:
    """The range as click's own messages write it (``x>0``, ``0<=x<=300``, ``x>=1``)."""
    lower = "<" if kind.min_open else "<="
    upper = "<" if kind.max_open else "<="
    if kind.min is None:
        return f"x{upper}{kind.max}"
    if kind.max is None:
        return f"x>{'' if kind.min_open else '='}{kind.min}"
    return f"{kind.min}{lower}x{upper}{kind.max}"


# Common shapes of a number option.
POSITIVE = FiniteFloatRange(min=0, min_open=True)  # a rate, a factor, a speed, a duration
NON_NEGATIVE = FiniteFloatRange(min=0)
SEED = click.IntRange(0, MAX_SEED)
TOKENS = click.IntRange(1, MAX_TOKENS)
TENANTS = click.IntRange(1, MAX_TENANTS)
GPU_BLOCKS = click.IntRange(1, MAX_GPU_BLOCKS)
REPLICA_COUNT = click.IntRange(1, MAX_REPLICAS)
# --from/--to: seconds from a trace's first arrival (every loader re-zeroes arrivals).
SECONDS_INTO = FiniteFloatRange(min=0)
# --window-s: the length of the windows a trace is judged in; below a second no percentile or SLO
# ratio means anything.
WINDOW_LENGTH = FiniteFloatRange(min=1)
POLICY = click.Choice(POLICY_NAMES)
FILE = click.Path(dir_okay=False)  # read; whether it exists is the loader's error, naming it


class OutFile(click.Path):
    """A file a command will write, checked before any work (a tune that ran for an hour must not
    lose its result to a typo): its folder exists and is writable, and the path is not a device,
    a FIFO or a directory (writing there replaced a device node with a regular file)."""

    def __init__(self) -> None:
        super().__init__(dir_okay=False, writable=True)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        path = Path(os.fsdecode(super().convert(value, param, ctx)))
        folder = path.parent
        if path.exists() and not path.is_file():
            self.fail(
                f"{value}: not a regular file (a device, a FIFO, ...); give a file", param, ctx
            )
        if not folder.is_dir():
            self.fail(f"{value}: folder {folder} does not exist", param, ctx)
        if not os.access(folder, os.W_OK | os.X_OK):
            self.fail(f"{value}: folder {folder} is not writable (read-only?)", param, ctx)
        return str(path)


OUT_FILE = OutFile()


class AuditName(click.ParamType[str, Any]):
    """A name stored in the audit log and printed by every reader of it (``--who``): the rules of
    a tenant name (``scheduler.settings.name_problem``: no control characters — a terminal escape
    sequence would be replayed on every screen that shows the log — at most 100 characters)."""

    name = "NAME"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        from scheduler.settings import name_problem  # start-up cost (pydantic)
        from scheduler.validation import readable  # start-up cost (pydantic)

        text = str(value)
        problem = name_problem(text)
        if problem is not None:
            self.fail(f'"{readable(text)}": {problem}', param, ctx)
        return text


AUDIT_NAME = AuditName()


class PolicyList(click.ParamType[list[str], Any]):
    """Comma-separated policy names (``fcfs,sarathi,uniboost``), converted to a list; an unknown
    name is a usage error listing the known ones."""

    name = "policy list"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> list[str]:
        if isinstance(value, list):  # a default, or a value converted before
            return value
        names = [part.strip() for part in str(value).split(",") if part.strip()]
        for name in names:
            if name not in POLICY_NAMES:
                self.fail(f"unknown policy {name!r} (valid: {', '.join(POLICY_NAMES)})", param, ctx)
        return names


class StepModelName(click.ParamType[str, Any]):
    """The name of a step-time coefficient set (``sim.stepmodel.get_model``): a built-in one or one
    ``tailpilot calibrate`` saved. Converts to the name; an unknown one is a usage error listing
    the known names."""

    name = "step model"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        from sim.stepmodel import get_model  # start-up cost

        try:
            get_model(value)
        except ValueError as err:
            self.fail(str(err), param, ctx)
        return str(value)


class TimeSpan(click.ParamType[tuple[float, float], Any]):
    """``START:DURATION`` in seconds (finite, DURATION > 0), converted to ``(start, duration)``:
    the old ``--window`` spelling of ``--from START --to START+DURATION``."""

    name = "START:DUR"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> tuple[float, float]:
        if isinstance(value, tuple):  # a default, or a value converted before
            return (float(value[0]), float(value[1]))
        try:
            start, duration = (float(part) for part in str(value).split(":"))
        except ValueError:
            self.fail(f"{value!r}: expected START:DURATION in seconds", param, ctx)
        if not (math.isfinite(start) and math.isfinite(duration) and duration > 0):
            self.fail(
                f"{value!r}: START must be a finite number of seconds and DURATION finite and > 0",
                param,
                ctx,
            )
        return (start, duration)


class KeyValue(click.ParamType[tuple[str, Any], Any]):
    """``KEY=VALUE`` (``--mix FILE=FRACTION``, ``--slo FAMILY=SECONDS``, ``--label KEY=VALUE``),
    converted to ``(key, value)`` with the value converted by ``value_type``; without an ``=`` (or
    a key) a usage error shows the expected form and ``example``. ``last``: split at the last
    ``=``, since a file path may hold one."""

    def __init__(
        self,
        form: str,
        example: str,
        value_type: click.ParamType[Any, Any] = click.STRING,
        *,
        last: bool = False,
    ) -> None:
        self.name = form
        self.example = example
        self.value_type = value_type
        self.last = last

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> tuple[str, Any]:
        if isinstance(value, tuple):  # a default, or a value converted before
            return (str(value[0]), value[1])
        text = str(value)
        parts = split_assignment(text, last=self.last)
        if parts is None:
            self.fail(f"{text!r}: expected {self.name} (e.g. {self.example})", param, ctx)
        key, raw = parts
        return (key, self.value_type.convert(raw, param, ctx))


POLICY_LIST = PolicyList()
STEP_MODEL = StepModelName()
TIME_SPAN = TimeSpan()

# What trace loaders raise besides ``sim.traces.TraceError`` on a file they cannot parse: JSON
# nested past Python's recursion limit (the Mooncake loader), a CSV field past the csv module's
# limit.
TRACE_PARSE_ERRORS = (RecursionError, csv.Error)


def unreadable_trace(path: str | None, err: BaseException) -> click.UsageError:
    """The one-line usage error for a trace file that raised one of ``TRACE_PARSE_ERRORS``."""
    reason = "nested too deeply" if isinstance(err, RecursionError) else str(err)
    return click.UsageError(f"{path}: not a trace tailpilot can read ({reason})")


def json_text(
    doc: Any,
    *,
    default: Callable[[Any], Any] | None = None,
    indent: int | None = 2,
    **dumps_options: Any,
) -> str:
    """``doc`` as strict JSON text: every NaN and ±Infinity, at any depth and also in what
    ``default`` returns for an object JSON cannot hold, becomes null
    (``storage.strict_json.finite``); ``dumps_options`` go to ``json.dumps`` (``sort_keys``,
    ``ensure_ascii``)."""

    def convert(obj: Any) -> Any:
        assert default is not None  # only passed to json.dumps when there is one
        return finite(default(obj))

    return json.dumps(
        finite(doc),
        indent=indent,
        allow_nan=False,
        default=None if default is None else convert,
        **dumps_options,
    )


def echo_json(
    doc: Any, *, default: Callable[[Any], Any] | None = None, indent: int | None = 2
) -> None:
    """Print ``doc`` as strict JSON (:func:`json_text`) on standard output: the one way a command's
    ``--json`` output is written."""
    click.echo(json_text(doc, default=default, indent=indent))

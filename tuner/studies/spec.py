"""A study's definition (``StudySpec``): traces and transforms, windows, split, objectives,
constraints, production settings, engine and seed — JSON-able and kept in the study, so a resuming
``tune``, another machine's worker and ``recommend`` rebuild exactly the same study.

A ``StudySpec`` is a pydantic model: constructing one checks every field that needs nothing but
its value (types, the window length, the split, the mix fractions, SLOs, the production settings,
the step-time model); :meth:`StudySpec.normalize` adds what needs the files or other fields (trace
paths and their digests, objectives and constraints against the SLOs). Either raises
:class:`SpecError`, which names the *field* (``window_s: Input should be greater than 0``); the
CLI names its flag instead.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from scheduler.errors import TailpilotError
from scheduler.metrics import LATENCY_BASES
from scheduler.settings import Settings, describe_error
from scheduler.validation import describe_validation, field_path
from sim import traces as tr
from sim.engine import EngineConfig
from sim.stepmodel import DEFAULT_MODEL_NAME, StepTimeModel, get_model
from tuner.closed_loop import recorded
from tuner.studies.objectives import Constraint, parse_constraint, parse_objectives

SPEC_VERSION = 1
DEFAULT_STORAGE_FILE = "tailpilot-optuna.db"
DEFAULT_WINDOW_S = 120.0
DEFAULT_WARMUP_S = 120.0  # arrivals replayed before each window and not measured
DEFAULT_HOLDOUT = 0.25
DEFAULT_MAX_WINDOWS = 12  # search windows per trial when --windows is not given
DEFAULT_MIN_REQUESTS = 20
# The CLI's bounds for the same flags (tests/test_tuner.py holds the two equal).
MAX_INT32 = 2**31 - 1  # seeds, token caps, KV blocks
MAX_TENANTS = 1_000_000


class TuneError(TailpilotError, ValueError):
    """A study that cannot be set up or resumed; the message names the field, option or file."""


class StudyConflict(TuneError):
    def __init__(self, field_name: str, given: Any, stored: Any) -> None:
        self.field_name, self.given, self.stored = field_name, given, stored
        super().__init__(f"{field_name}: {given!r} differs from the study's {stored!r}")


class SpecError(TuneError):
    """A :class:`StudySpec` field that is not valid. The message is ``PATH: PROBLEM``
    (``scheduler.validation.describe_validation``'s form); ``field_name`` is the field PATH
    starts with, so a caller can name the field its own way (:meth:`naming`)."""

    def __init__(self, field_name: str, problem: str, path: str | None = None) -> None:
        self.field_name = field_name
        super().__init__(f"{path or field_name}: {problem}")

    @classmethod
    def from_validation(cls, err: ValidationError) -> SpecError:
        """The first invalid field of a failed ``StudySpec`` validation."""
        loc = err.errors()[0]["loc"]
        path = field_path(loc, "spec")
        problem = describe_validation(err, root="spec", first_only=True).removeprefix(f"{path}: ")
        return cls(str(loc[0]) if loc else "spec", problem, path)

    def naming(self, label: str) -> str:
        """The message with the field called ``label`` (the CLI passes the field's flag)."""
        return label + str(self)[len(self.field_name) :]


# --------------------------------------------------------------------------------------------
# The study definition
# --------------------------------------------------------------------------------------------

_BUNDLED: list[str | None] = [None]  # the default traces: the bundled window


class StudySpec(BaseModel):
    """Everything that fixes a study's windows, space and scoring (JSON-able; kept in the study).

    Constructing one validates each field on its own (:class:`SpecError` naming the first invalid
    field); :meth:`normalize` completes the definition before a study is created from it.
    """

    model_config = ConfigDict(extra="forbid")

    policies: list[str]
    objectives: list[str]
    constraints: list[str] = Field(default_factory=list)
    traces: list[str | None] = Field(
        default_factory=lambda: _BUNDLED.copy()
    )  # None = the bundled window
    trim: tuple[float, float] | None = None  # keep arrivals in [start, start+dur) first
    mix: list[tuple[str, float]] = Field(default_factory=list)  # (file, fraction) mixed in
    # The bounds are the CLI's (tailpilot/cli_common.py): a definition read back from a study
    # (its JSON may have been edited by hand) is held to what the flags would have allowed.
    rate_scale: float | None = Field(None, gt=0, allow_inf_nan=False)
    target_rate: float | None = Field(None, gt=0, allow_inf_nan=False)
    max_tokens_cap: int | None = Field(None, ge=1, le=MAX_INT32)
    max_tokens_default: int | None = Field(None, ge=1, le=MAX_INT32)  # None: DEFAULT_MAX_TOKENS
    tenants: int | None = Field(None, ge=1, le=MAX_TENANTS)
    seed: int = Field(0, ge=0, le=MAX_INT32)
    # Below a second no percentile or SLO ratio of a window means anything.
    window_s: float = Field(DEFAULT_WINDOW_S, ge=1, allow_inf_nan=False)
    warmup_s: float = Field(DEFAULT_WARMUP_S, ge=0, allow_inf_nan=False)
    holdout: float = Field(DEFAULT_HOLDOUT, gt=0, lt=1)
    windows: int | None = Field(
        None, ge=1
    )  # K search windows per trial (None: all, up to DEFAULT_MAX_WINDOWS)
    min_requests: int = Field(DEFAULT_MIN_REQUESTS, ge=0)
    production: dict[str, Any] = Field(default_factory=lambda: Settings().to_dict())
    slo: dict[str, float] = Field(default_factory=dict)
    ranges: list[str] = Field(default_factory=list)  # NAME=LO:HI[:log]
    fixed: dict[str, Any] = Field(default_factory=dict)
    search: list[str] | None = None
    tune_engine: bool = True
    num_gpu_blocks: int | None = Field(None, ge=1, le=MAX_INT32)
    step_model: dict[str, Any] = Field(
        default_factory=lambda: get_model(DEFAULT_MODEL_NAME).as_dict()
    )
    pruner: bool = True
    population_size: int = Field(20, ge=2)  # NSGA-II
    # Filled by normalize(): file digests, so a changed file is caught on resume.
    trace_digests: list[str | None] = Field(default_factory=list)
    mix_digests: list[str | None] = Field(default_factory=list)
    version: int = SPEC_VERSION

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as err:
            raise SpecError.from_validation(err) from None

    # -- field checks (run on construction)
    @field_validator("mix")
    @classmethod
    def _mix_fractions(cls, mix: list[tuple[str, float]]) -> list[tuple[str, float]]:
        fractions = [f for _, f in mix]
        if any(not 0 < f < 1 for f in fractions) or math.fsum(fractions) >= 1:
            raise ValueError(f"fractions must be in (0, 1) and sum below 1, got {fractions}")
        return mix

    @field_validator("slo")
    @classmethod
    def _slo_families(cls, slo: dict[str, float]) -> dict[str, float]:
        for family, seconds in slo.items():
            if family not in LATENCY_BASES or not seconds > 0:
                raise ValueError(
                    f"{family}={seconds:g}: expected FAMILY=SECONDS with FAMILY one of "
                    f"{', '.join(LATENCY_BASES)} and SECONDS > 0"
                )
        return slo

    @field_validator("production")
    @classmethod
    def _production_settings(cls, doc: dict[str, Any]) -> dict[str, Any]:
        """The canonical settings document (one line naming the settings' invalid fields)."""
        try:
            return Settings.model_validate(doc).to_dict()
        except ValueError as err:
            raise ValueError(describe_error(err)) from None

    @field_validator("step_model")
    @classmethod
    def _step_model(cls, coefficients: dict[str, Any]) -> dict[str, Any]:
        StepTimeModel.from_dict(coefficients)
        return coefficients

    # -- (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        d = copy.deepcopy(self.model_dump())
        d["trim"] = list(self.trim) if self.trim else None
        d["mix"] = [[p, f] for p, f in self.mix]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> StudySpec:
        d = dict(d)
        unknown = set(d) - set(cls.model_fields)
        if unknown:
            raise TuneError(
                f"the study was written by a newer tailpilot (unknown fields {sorted(unknown)})"
            )
        # Studies written before warm windows replayed each window from an empty engine.
        d.setdefault("warmup_s", 0.0)
        return cls(**d)

    def normalize(self) -> StudySpec:
        """Complete the definition: absolute paths (files must exist), recorded spans pinned
        (``tuner.closed_loop.recorded.pin``: a recording still growing is replayed up to where it
        stood), canonical metric names, constraints checked against the SLOs, file digests."""
        try:
            self.traces = [
                None
                if p in (None, "bundled")
                else recorded.pin(recorded.canonical(p))
                if recorded.is_recorded(p)
                else str(Path(p).resolve())
                for p in self.traces
            ] or [None]
        except tr.TraceError as err:
            raise SpecError("traces", str(err)) from None
        self.mix = [(str(Path(p).resolve()), f) for p, f in self.mix]
        for name, paths in (
            ("traces", filter(None, self.traces)),
            ("mix", (p for p, _ in self.mix)),
        ):
            for p in paths:
                if not recorded.is_recorded(p) and not Path(p).is_file():
                    raise SpecError(name, f"{p}: no such file")
        try:
            self.objectives = [n for n, _ in parse_objectives(self.objectives, self.slo)]
        except ValueError as err:
            raise SpecError("objectives", str(err)) from None
        try:
            self.constraints = [parse_constraint(c, self.slo).text for c in self.constraints]
        except ValueError as err:
            raise SpecError("constraints", str(err)) from None
        try:
            self.trace_digests = [None if p is None else file_digest(p) for p in self.traces]
        except tr.TraceError as err:
            raise SpecError("traces", str(err)) from None
        self.mix_digests = [file_digest(p) for p, _ in self.mix]
        return self

    # -- derived
    @property
    def multi_objective(self) -> bool:
        return len(self.objectives) > 1

    def objective_dirs(self) -> list[tuple[str, Literal["maximize", "minimize"]]]:
        return parse_objectives(self.objectives, self.slo)

    def parsed_constraints(self) -> list[Constraint]:
        # A stored study may hold a strict comparison from before they were refused: it ran as
        # the inclusive one, and reads so.
        return [parse_constraint(c, self.slo, legacy=True) for c in self.constraints]

    def engine_config(self) -> EngineConfig:
        kw: dict[str, Any] = {"step_model": StepTimeModel.from_dict(self.step_model)}
        if self.num_gpu_blocks:
            kw["num_gpu_blocks"] = self.num_gpu_blocks
        return EngineConfig(**kw)


def file_digest(path: str) -> str:
    """SHA-256 of a trace file, or of a recorded span's requests (``db:`` URL)."""
    return recorded.source_digest(path)

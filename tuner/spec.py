"""A study's definition (``StudySpec``): traces and transforms, windows, split, objectives,
constraints, production settings, engine and seed — JSON-able and kept in the study, so a resuming
``tune``, another machine's worker and ``recommend`` rebuild exactly the same study.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping

from scheduler.settings import Settings
from sim import traces as tr
from sim.engine import EngineConfig
from sim.stepmodel import DEFAULT_MODEL_NAME, StepTimeModel, get_model
from tuner import recorded
from tuner.search import (
    Constraint,
    parse_constraint,
    parse_objectives,
)

SPEC_VERSION = 1
DEFAULT_STORAGE_FILE = "tailpilot-optuna.db"
DEFAULT_WINDOW_S = 120.0
DEFAULT_WARMUP_S = 120.0  # arrivals replayed before each window and not measured
DEFAULT_HOLDOUT = 0.25
DEFAULT_MAX_WINDOWS = 12  # search windows per trial when --windows is not given
DEFAULT_MIN_REQUESTS = 20


class TuneError(ValueError):
    """A study that cannot be set up or resumed; the message names the flag or file."""


class StudyConflict(TuneError):
    def __init__(self, field_name: str, given: Any, stored: Any) -> None:
        self.field_name, self.given, self.stored = field_name, given, stored
        super().__init__(f"{field_name}: {given!r} differs from the study's {stored!r}")


# --------------------------------------------------------------------------------------------
# The study definition
# --------------------------------------------------------------------------------------------


@dataclass
class StudySpec:
    """Everything that fixes a study's windows, space and scoring (JSON-able; kept in the study)."""

    policies: list[str]
    objectives: list[str]
    constraints: list[str] = field(default_factory=list)
    traces: list[str | None] = field(default_factory=lambda: [None])  # None = the bundled window
    trim: tuple[float, float] | None = None  # keep arrivals in [start, start+dur) first
    mix: list[tuple[str, float]] = field(default_factory=list)  # (file, fraction) mixed in
    rate_scale: float | None = None
    target_rate: float | None = None
    max_tokens_cap: int | None = None
    max_tokens_default: int | None = None  # None: tr.DEFAULT_MAX_TOKENS
    tenants: int | None = None
    seed: int = 0
    window_s: float = DEFAULT_WINDOW_S
    warmup_s: float = DEFAULT_WARMUP_S
    holdout: float = DEFAULT_HOLDOUT
    windows: int | None = None  # K search windows per trial (None: all, up to DEFAULT_MAX_WINDOWS)
    min_requests: int = DEFAULT_MIN_REQUESTS
    production: dict[str, Any] = field(default_factory=lambda: Settings().to_dict())
    slo: dict[str, float] = field(default_factory=dict)
    ranges: list[str] = field(default_factory=list)  # NAME=LO:HI[:log]
    fixed: dict[str, Any] = field(default_factory=dict)
    search: list[str] | None = None
    tune_engine: bool = True
    num_gpu_blocks: int | None = None
    step_model: dict[str, Any] = field(default_factory=lambda: get_model(DEFAULT_MODEL_NAME).as_dict())
    pruner: bool = True
    population_size: int = 20  # NSGA-II
    # Filled by normalize(): file digests, so a changed file is caught on resume.
    trace_digests: list[str | None] = field(default_factory=list)
    mix_digests: list[str | None] = field(default_factory=list)
    version: int = SPEC_VERSION

    # -- (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["trim"] = list(self.trim) if self.trim else None
        d["mix"] = [[p, f] for p, f in self.mix]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "StudySpec":
        d = dict(d)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise TuneError(f"the study was written by a newer tailpilot (unknown fields {sorted(unknown)})")
        # Studies written before warm windows replayed each window from an empty engine.
        d.setdefault("warmup_s", 0.0)
        if d.get("trim"):
            d["trim"] = tuple(d["trim"])
        d["mix"] = [(p, float(f)) for p, f in d.get("mix", [])]
        return cls(**d)

    def normalize(self) -> "StudySpec":
        """Validate; absolute paths, canonical metric names and settings; file digests."""
        self.traces = [None if p in (None, "bundled") else recorded.canonical(p) if recorded.is_recorded(p)
                       else str(Path(p).resolve()) for p in self.traces] or [None]
        self.mix = [(str(Path(p).resolve()), float(f)) for p, f in self.mix]
        for p in [*filter(None, self.traces), *(p for p, _ in self.mix)]:
            if not recorded.is_recorded(p) and not Path(p).is_file():
                raise TuneError(f"--trace/--mix {p}: no such file")
        total = math.fsum(f for _, f in self.mix)
        if any(not (0 < f < 1) for _, f in self.mix) or total >= 1:
            raise TuneError(f"--mix: fractions must be in (0, 1) and sum below 1, got {[f for _, f in self.mix]}")
        if not (self.window_s > 0 and math.isfinite(self.window_s)):
            raise TuneError(f"--window-s {self.window_s}: must be a positive number of seconds")
        if not (self.warmup_s >= 0 and math.isfinite(self.warmup_s)):
            raise TuneError(f"--warmup-s {self.warmup_s}: must be a number of seconds >= 0")
        if not 0 < self.holdout < 1:
            raise TuneError(f"--holdout {self.holdout}: must be a fraction in (0, 1)")
        if self.windows is not None and self.windows < 1:
            raise TuneError(f"--windows {self.windows}: must be >= 1")
        try:
            self.production = Settings.model_validate(self.production).to_dict()
        except ValueError as err:
            from scheduler.settings import describe_error

            raise TuneError(f"--production: {describe_error(err)}") from None
        from scheduler.metrics import LATENCY_BASES

        self.slo = {k: float(v) for k, v in self.slo.items()}
        for family, seconds in self.slo.items():
            if family not in LATENCY_BASES or not seconds > 0:
                raise TuneError(f"--slo {family}={seconds:g}: expected FAMILY=SECONDS with FAMILY one of "
                                f"{', '.join(LATENCY_BASES)} and SECONDS > 0")
        try:
            self.objectives = [n for n, _ in parse_objectives(self.objectives, self.slo)]
            self.constraints = [parse_constraint(c, self.slo).text for c in self.constraints]
        except ValueError as err:
            raise TuneError(str(err)) from None
        StepTimeModel.from_dict(self.step_model)
        try:
            self.trace_digests = [None if p is None else file_digest(p) for p in self.traces]
        except tr.TraceError as err:
            raise TuneError(str(err)) from None
        self.mix_digests = [file_digest(p) for p, _ in self.mix]
        return self

    # -- derived
    @property
    def multi_objective(self) -> bool:
        return len(self.objectives) > 1

    def objective_dirs(self) -> list[tuple[str, Literal["maximize", "minimize"]]]:
        return parse_objectives(self.objectives, self.slo)

    def parsed_constraints(self) -> list[Constraint]:
        return [parse_constraint(c, self.slo) for c in self.constraints]

    def engine_config(self) -> EngineConfig:
        kw: dict[str, Any] = {"step_model": StepTimeModel.from_dict(self.step_model)}
        if self.num_gpu_blocks:
            kw["num_gpu_blocks"] = self.num_gpu_blocks
        return EngineConfig(**kw)


def file_digest(path: str) -> str:
    """SHA-256 of a trace file, or of a recorded span's requests (``db:`` URL)."""
    return recorded.source_digest(path)

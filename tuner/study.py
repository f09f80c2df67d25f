"""Optuna studies over policy and engine settings (docs/engine.md#tuner): ``tailpilot tune``.

A study is *trace windows × policy × search space × objective(s) × constraints*:

* **Windows.** The (transformed) trace files are cut into consecutive windows of ``window_s``
  seconds; each window is replayed on its own, to completion, after a **warm-up**: the
  ``warmup_s`` seconds of arrivals before it are replayed first and left out of its metrics, so
  a window starts from the queue and KV state its traffic leaves, not from an empty engine (a
  window cut from an empty engine hides overload and queue build-up). A seeded
  choice of them (``holdout`` fraction, at least one; stratified by load so light and heavy
  windows are both held out) is never run by the search; ``recommend`` validates on them. Each
  trial replays its K search windows in order, reporting each window's objective to the pruner
  with the window's index as step. A trial's objective is the mean over its windows of the
  per-window metric (windows where it is undefined are skipped; none defined → the worst value).
* **Trial 0** is the production settings (``--production``; default ``sarathi`` with the engine
  defaults, vLLM's own behaviour), enqueued so every suggestion is measured against it on the
  same windows. Its per-window metrics are also the **baseline** of relative constraints
  (``throughput>=0.99*baseline``); they are computed once, when the study is prepared, and kept
  in the study.
* **Samplers.** One objective: TPE (multivariate, grouped for the conditional policy choice,
  constant liar for parallel workers) with the WilcoxonPruner over windows; a pruned trial
  returns the mean of the windows it ran (Optuna's documented workaround) and is marked
  ``pruned_after``. Several objectives: NSGA-II. Constraints go through ``trial.set_constraint``
  (Optuna ≥ 5), which both samplers read.
* **Definition kept in the study.** The study's user attributes hold the full definition (trace
  files with their SHA-256, transforms, window length, split, objectives, constraints,
  production settings, engine config with the step-time coefficients, seed), the derived search
  space, γ̂ and the baseline, plus a fingerprint of the windows. A resuming ``tune``, a worker on
  another machine and ``recommend`` rebuild exactly the same windows from it (and refuse when a
  trace file changed).
* **Many workers.** Each worker (a local process of ``--workers``, or a ``tailpilot tune`` on
  another machine using the same ``--storage``) runs ``study.optimize`` one trial at a time on
  the same RDB storage until the study holds ``n_trials`` COMPLETE trials. Before a trial the
  worker checks the counts (and waits while the remaining slots are all taken by running trials),
  and a trial that finds ``n_trials`` earlier complete-or-running trials ends as FAIL (user attr
  ``excess``) without running, so the number of complete trials is exactly ``n_trials``.
  Heartbeats fail the trials of crashed workers.
* **Determinism.** The simulator is deterministic, so one worker with the same seed gives the
  same trials and the same best trial. A resumed worker seeds its sampler with ``seed`` plus the
  number of finished trials (a fresh stream, still reproducible).

Keep Optuna's tables away from tailpilot's database: the default storage is the SQLite file
``tailpilot-optuna.db``; ``check_storage_separate`` refuses the tailpilot database itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
import multiprocessing
import os
import random
import signal
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from controlplane.metrics import fairness_summary, summarize
from controlplane.settings import Settings
from sim import traces as tr
from sim.engine import EngineConfig, Simulator
from tuner.search import (
    Constraint,
    SearchSpace,
    build_space,
    parse_constraint,
    parse_objectives,
    parse_range,
    tracked_metrics,
)
from sim.stepmodel import DEFAULT_MODEL_NAME, StepTimeModel, get_model

SPEC_VERSION = 1
DEFAULT_STORAGE_FILE = "tailpilot-optuna.db"
DEFAULT_WINDOW_S = 120.0
DEFAULT_WARMUP_S = 120.0  # arrivals replayed before each window and not measured
DEFAULT_HOLDOUT = 0.25
DEFAULT_MAX_WINDOWS = 12  # search windows per trial when --windows is not given
DEFAULT_MIN_REQUESTS = 20
HEARTBEAT_S = 10
GRACE_S = 40
ATTR_SPEC = "tailpilot:spec"
ATTR_SPACE = "tailpilot:space"
ATTR_GAMMA_HAT = "tailpilot:gamma_hat"
ATTR_BASELINE = "tailpilot:baseline"
ATTR_FINGERPRINT = "tailpilot:fingerprint"
ATTR_SPLIT = "tailpilot:split"
TRIAL_ATTR = "tailpilot"
ROLE_ATTR = "tailpilot_role"
PRODUCTION = "production"
INFEASIBLE = 1e12  # constraint value for an undefined (NaN) metric: Optuna refuses NaN


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
        self.traces = [None if p in (None, "bundled") else str(Path(p).resolve()) for p in self.traces] or [None]
        self.mix = [(str(Path(p).resolve()), float(f)) for p, f in self.mix]
        for p in [*filter(None, self.traces), *(p for p, _ in self.mix)]:
            if not Path(p).is_file():
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
            from controlplane.settings import describe_error

            raise TuneError(f"--production: {describe_error(err)}") from None
        from controlplane.metrics import LATENCY_BASES

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
        self.trace_digests = [None if p is None else file_digest(p) for p in self.traces]
        self.mix_digests = [file_digest(p) for p, _ in self.mix]
        return self

    # -- derived
    @property
    def multi_objective(self) -> bool:
        return len(self.objectives) > 1

    def objective_dirs(self) -> list[tuple[str, str]]:
        return parse_objectives(self.objectives, self.slo)

    def parsed_constraints(self) -> list[Constraint]:
        return [parse_constraint(c, self.slo) for c in self.constraints]

    def engine_config(self) -> EngineConfig:
        kw: dict[str, Any] = {"step_model": StepTimeModel.from_dict(self.step_model)}
        if self.num_gpu_blocks:
            kw["num_gpu_blocks"] = self.num_gpu_blocks
        return EngineConfig(**kw)


def file_digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# --------------------------------------------------------------------------------------------
# Windows
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Window:
    index: int  # position in the study's window list (the pruner's step)
    source: str  # trace name
    start_s: float  # start within the transformed trace
    trace: tr.Trace  # the warm-up's arrivals, then the window's
    measured: frozenset[str] = frozenset()  # ids of the window's own requests (the metrics' scope)
    trace_no: int = 0  # which of the study's traces

    def label(self) -> str:
        return f"w{self.index}({self.source}@{self.start_s:g}s, {len(self.measured)} req)"


def build_traces(spec: StudySpec) -> list[tr.Trace]:
    """Load and transform each trace file (in the order of the transforms, docs/engine.md#traces)."""
    out = []
    for path in spec.traces:
        try:
            cap = spec.max_tokens_default or tr.DEFAULT_MAX_TOKENS
            trace = (tr.load_bundled(max_tokens_default=cap) if path is None
                     else tr.load_trace(path, seed=spec.seed, max_tokens_default=cap))
            trace = tr.transform(trace, window=spec.trim)
            if spec.mix and len(trace):
                parts: list[tuple[tr.Trace, float]] = []
                for i, (mpath, frac) in enumerate(spec.mix):
                    part = tr.load_trace(mpath, n=len(trace), rate=trace.rate or 1.0, seed=spec.seed + i,
                                         max_tokens_default=cap)
                    parts.append((part, frac))
                rest = 1.0 - math.fsum(f for _, f in parts)
                trace = tr.mix([(trace, rest), *parts], seed=spec.seed,
                               name=trace.name + "+" + "+".join(f"{f:g}*{p.name}" for p, f in parts))
            # The rest in the command line's order (after the mix, which scales with the trace).
            trace = tr.transform(trace, rate_scale=spec.rate_scale, rate=spec.target_rate,
                                 max_tokens_cap=spec.max_tokens_cap, tenants=spec.tenants, seed=spec.seed)
        except tr.TraceError as err:
            raise TuneError(str(err)) from None
        out.append(trace)
    return out


def build_windows(spec: StudySpec, traces: Sequence[tr.Trace] | None = None) -> list[Window]:
    """Consecutive ``window_s`` windows of every trace; a short last window (under half a window)
    and windows with fewer than ``min_requests`` requests are dropped."""
    windows: list[Window] = []
    w, warm = spec.window_s, spec.warmup_s
    for trace_no, trace in enumerate(traces if traces is not None else build_traces(spec)):
        if not len(trace):
            continue
        end = trace.requests[-1].arrival
        n = int(end // w) + 1
        for k in range(n):
            start = k * w
            if k == n - 1 and end - start < 0.5 * w and n > 1:
                break
            measured = frozenset(r.id for r in trace if start <= r.arrival < start + w)
            if len(measured) < spec.min_requests:
                continue
            begin = max(0.0, start - warm)
            win = tr.time_window(trace, begin, start + w - begin)
            windows.append(Window(len(windows), trace.name, start, win, measured, trace_no))
    return windows


def _stratified(order: Sequence[int], k: int, rng: np.random.Generator) -> list[int]:
    """``k`` of ``order`` (windows sorted by load), one drawn at random from each of ``k``
    consecutive strata, so the pick spans light to heavy windows."""
    edges = np.linspace(0, len(order), k + 1)
    picks = []
    for j in range(k):
        lo, hi = int(round(edges[j])), int(round(edges[j + 1]))
        picks.append(order[int(rng.integers(lo, max(hi, lo + 1)))])
    return sorted(picks)


def split_windows(spec: StudySpec, n: int, load: Sequence[int] | None = None) -> tuple[list[int], list[int]]:
    """(search, held-out) window indices. The held-out windows are a seeded choice stratified by
    load (prompt + output tokens per window): with windows ranked by load, one is drawn from each of
    ``n_holdout`` consecutive strata, so validation sees light and heavy windows alike. K search
    windows are chosen from the rest the same way (all of them when K is not smaller)."""
    if n < 2:
        raise TuneError(f"the trace gives {n} window(s) of {spec.window_s:g} s with >= {spec.min_requests} "
                        "requests; need at least 2 (one is held out): lower --window-s or use a longer trace")
    rng = np.random.default_rng([spec.seed, 0x5EED])
    load = list(load) if load is not None else [0] * n
    order = sorted(range(n), key=lambda i: (load[i], i))
    n_hold = min(n - 1, max(1, int(round(spec.holdout * n))))
    held = _stratified(order, n_hold, rng)
    rest = [i for i in order if i not in set(held)]
    k = min(spec.windows or DEFAULT_MAX_WINDOWS, len(rest))
    search = sorted(rest) if k == len(rest) else _stratified(rest, k, rng)
    return search, held


def window_load(w: Window) -> int:
    """Tokens a window asks for (prompt + output): the load the held-out split is stratified on."""
    return sum(r.prompt_tokens + r.output_tokens for r in w.trace if r.id in w.measured)


def fingerprint(windows: Sequence[Window]) -> str:
    h = hashlib.sha256()
    for w in windows:
        h.update(f"{w.index}|{w.source}|{w.start_s!r}|{len(w.trace)}\n".encode())
        for r in w.trace:
            h.update(f"{r.id},{r.arrival!r},{r.prompt_tokens},{r.output_tokens},{r.max_tokens},"
                     f"{r.tenant},{r.type}{'' if r.id in w.measured else ',warm-up'}\n".encode())
    return h.hexdigest()


# --------------------------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------------------------


def window_metrics(settings: Settings, window: Window, config: EngineConfig, names: Sequence[str],
                   slo: Mapping[str, float] | None = None) -> dict[str, float]:
    """Replay one window (warm-up first) under ``settings``; the named metrics of the window's own
    requests (NaN when undefined)."""
    result = Simulator(window.trace, settings, config).run()
    return completion_metrics([c for c in result.completions if c.id in window.measured], names, slo)


def completion_metrics(completions: Sequence[Any], names: Sequence[str],
                       slo: Mapping[str, float] | None = None) -> dict[str, float]:
    """The named metrics of ``completions`` (NaN when undefined)."""
    summary = summarize(completions, slo=slo or None)
    if any(n in ("jain_index",) for n in names):
        summary.update(fairness_summary(completions))
    return {n: float(summary.get(n, math.nan)) for n in names}


def nanmean(values: Sequence[float]) -> float:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return math.fsum(finite) / len(finite) if finite else math.nan


def worst(direction: str) -> float:
    return math.inf if direction == "minimize" else -math.inf


@dataclass
class TuneContext:
    """A study's definition rebuilt in this process: windows, space, baseline. Build once."""

    spec: StudySpec
    space: SearchSpace
    windows: list[Window]
    search: list[int]
    holdout: list[int]
    gamma_hat: float
    baseline: dict[int, dict[str, float]]  # search window -> production's tracked metrics
    config: EngineConfig = field(init=False)
    objectives: list[tuple[str, str]] = field(init=False)
    constraints: list[Constraint] = field(init=False)
    tracked: list[str] = field(init=False)

    def __post_init__(self) -> None:
        self.config = self.spec.engine_config()
        self.objectives = self.spec.objective_dirs()
        self.constraints = self.spec.parsed_constraints()
        self.tracked = tracked_metrics(self.objectives, self.constraints)

    def run(self, settings: Settings, index: int) -> dict[str, float]:
        return window_metrics(settings, self.windows[index], self.config, self.tracked, self.spec.slo)

    def run_many(self, settings: Settings, indices: Sequence[int]) -> dict[int, dict[str, float]]:
        return {i: self.run(settings, i) for i in indices}

    def aggregate(self, per_window: Mapping[int, Mapping[str, float]], name: str) -> float:
        return nanmean([per_window[i][name] for i in per_window])

    def objective_values(self, per_window: Mapping[int, Mapping[str, float]]) -> list[float]:
        out = []
        for name, direction in self.objectives:
            v = self.aggregate(per_window, name)
            out.append(v if math.isfinite(v) else worst(direction))
        return out

    def constraint_values(self, per_window: Mapping[int, Mapping[str, float]],
                          baseline: Mapping[int, Mapping[str, float]] | None = None) -> dict[str, float]:
        """Constraint values over the windows in ``per_window`` (the baseline on the same ones)."""
        baseline = self.baseline if baseline is None else baseline
        out = {}
        for c in self.constraints:
            x = self.aggregate(per_window, c.metric)
            b = nanmean([baseline[i][c.metric] for i in per_window]) if c.relative else math.nan
            v = c.value(x, b)
            out[c.key] = v if math.isfinite(v) else INFEASIBLE
        return out


def estimate_gamma(spec: StudySpec, windows: Sequence[Window], indices: Sequence[int],
                   config: EngineConfig) -> float:
    """γ̂ = ln 5 / (t99 − t95) of TTLT, pooled over an FCFS replay of the search windows
    (docs/policies.md#uniboost); NaN when the tail is degenerate."""
    fcfs = Settings.model_validate({"policy": "fcfs", "engine": spec.production["engine"]})
    ttlt = []
    for i in indices:
        res = Simulator(windows[i].trace, fcfs, config).run()
        ttlt.extend(c.finished_at - c.arrival for c in res.completions if c.id in windows[i].measured)
    if len(ttlt) < 20:
        return math.nan
    t95, t99 = np.percentile(np.asarray(ttlt), [95, 99])
    gap = float(t99 - t95)
    return math.log(5.0) / gap if gap > 0 else math.nan


# --------------------------------------------------------------------------------------------
# Storage
# --------------------------------------------------------------------------------------------

TAILPILOT_TABLES = frozenset({"replicas", "samples", "completions", "recommendations", "settings_changes"})


def storage_url(raw: str | None) -> str:
    """``None`` → ``sqlite:///<cwd>/tailpilot-optuna.db``; a path → SQLite; ``postgresql://`` →
    psycopg 3."""
    if raw is None or raw == "":
        return f"sqlite:///{Path.cwd() / DEFAULT_STORAGE_FILE}"
    if "://" not in raw:
        return f"sqlite:///{Path(raw).resolve()}"
    for prefix in ("postgresql://", "postgres://"):
        if raw.startswith(prefix):
            return "postgresql+psycopg://" + raw[len(prefix):]
    return raw


def _same_database(a: str, b: str) -> bool:
    from sqlalchemy.engine import make_url

    try:
        ua, ub = make_url(a), make_url(b)
    except Exception:  # noqa: BLE001 - unparsable: let the open fail later
        return False
    if ua.get_backend_name() != ub.get_backend_name():
        return False
    if ua.get_backend_name() == "sqlite":
        da, db = ua.database or "", ub.database or ""
        return bool(da) and da != ":memory:" and Path(da).resolve() == Path(db).resolve()
    return (ua.host, ua.port, ua.database) == (ub.host, ub.port, ub.database)


def check_storage_separate(url: str, db_url: str | None) -> None:
    """Refuse to put Optuna's tables into tailpilot's database (both use alembic_version).
    ``db_url``: tailpilot's database (None: its default, ./tailpilot.db)."""
    from storage.engine import DEFAULT_SQLITE_FILE

    db_url = db_url or DEFAULT_SQLITE_FILE
    if db_url is not None:
        db = db_url if "://" in db_url else f"sqlite:///{Path(db_url).resolve()}"
        if _same_database(url, db):
            raise TuneError(f"--storage is tailpilot's database ({db_url}); keep Optuna's tables apart: "
                            f"use another database (default: the SQLite file {DEFAULT_STORAGE_FILE})")
    from sqlalchemy import create_engine, inspect

    if url.startswith("sqlite:///") and not Path(url.removeprefix("sqlite:///")).exists():
        return
    engine = create_engine(url)
    try:
        tables = set(inspect(engine).get_table_names())
    except Exception as err:  # noqa: BLE001
        raise TuneError(f"--storage {_redact(url)}: cannot connect: {err}") from None
    finally:
        engine.dispose()
    clash = tables & TAILPILOT_TABLES
    if clash:
        raise TuneError(f"--storage {_redact(url)} holds tailpilot's tables ({', '.join(sorted(clash))}); "
                        "keep Optuna's tables in a separate database")


def _redact(url: str) -> str:
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001
        return url


def open_storage(url: str):
    import optuna

    quiet_optuna()
    kw: dict[str, Any] = {}
    if url.startswith("sqlite"):
        kw["engine_kwargs"] = {"connect_args": {"timeout": 60}}
    else:
        kw["engine_kwargs"] = {"pool_pre_ping": True}
    # Workers starting together on an empty database race to create Optuna's schema (PostgreSQL:
    # "duplicate key ... pg_type"); the loser finds the tables on a second try.
    for attempt in range(6):
        try:
            storage = optuna.storages.RDBStorage(url, heartbeat_interval=HEARTBEAT_S, grace_period=GRACE_S, **kw)
            break
        except Exception as err:  # noqa: BLE001 - any driver error: say which storage
            if attempt == 5 or not _transient_open_error(err):
                raise TuneError(f"--storage {_redact(url)}: cannot open: {err}") from None
            time.sleep(0.2 * 2 ** attempt * (0.5 + random.random()))
    if url.startswith("sqlite"):
        _sqlite_wal(storage.engine)
    return storage


def _transient_open_error(err: Exception) -> bool:
    text = str(err).lower()
    return any(k in text for k in ("duplicate key", "already exists", "database is locked", "deadlock",
                                   "could not serialize", "unique constraint"))


def _sqlite_wal(engine) -> None:
    """WAL with synchronous=NORMAL: a commit without an fsync (Optuna commits every suggested
    parameter and report; at ~10 ms per fsync that would cost more than the simulation)."""
    from sqlalchemy import event

    from storage.engine import sqlite_pragmas

    @event.listens_for(engine, "connect")
    def _pragmas(dbapi_conn, _record) -> None:  # pragma: no cover - exercised via the engine
        sqlite_pragmas(dbapi_conn)

    engine.dispose()  # connections opened before the listener reconnect with the pragmas


def quiet_optuna() -> None:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    warnings.filterwarnings("ignore", message="Argument ``heartbeat_interval`` is an experimental")
    warnings.filterwarnings("ignore", message="Fixed parameter .* is out of range")
    warnings.filterwarnings("ignore", message=".*WilcoxonPruner.*")


# --------------------------------------------------------------------------------------------
# Preparing and loading a study
# --------------------------------------------------------------------------------------------


def _load_study(storage, name: str, spec: StudySpec | None = None, sampler=None, pruner=None):
    import optuna

    if spec is not None:
        directions = [d for _, d in spec.objective_dirs()]
        return optuna.create_study(storage=storage, study_name=name, directions=directions,
                                   sampler=sampler, pruner=pruner, load_if_exists=True)
    try:
        return optuna.load_study(study_name=name, storage=storage, sampler=sampler, pruner=pruner)
    except KeyError:
        raise TuneError(f"--study {name}: no such study in this storage") from None


def study_exists(storage, name: str) -> bool:
    import optuna

    try:
        storage.get_study_id_from_name(name)
        return True
    except KeyError:
        return False
    except optuna.exceptions.StorageInternalError:
        return False


def stored_spec(study) -> StudySpec | None:
    raw = study.user_attrs.get(ATTR_SPEC)
    return None if raw is None else StudySpec.from_dict(raw)


def _resolve_spec(study, spec: StudySpec | None, given: Mapping[str, Any]) -> StudySpec:
    stored = stored_spec(study)
    if stored is None:
        if spec is None:
            raise TuneError(f"--study {study.study_name}: the study has no tailpilot definition "
                            "(not created by tailpilot tune?); give --objective and --policy to create it")
        return spec
    for key, value in given.items():
        theirs = getattr(stored, key)
        if _canon(key, value) != _canon(key, theirs):
            raise StudyConflict(key, value, theirs)
    return stored


def _canon(key: str, value: Any) -> Any:
    """Comparable form of a spec field (paths resolved, metric aliases resolved)."""
    if key == "traces":
        return [None if p in (None, "bundled") else str(Path(p).resolve()) for p in value] or [None]
    if key == "mix":
        return [(str(Path(p).resolve()), float(f)) for p, f in value]
    if key == "objectives":
        from controlplane.metrics import validate_metric

        try:
            return [validate_metric(n) for n in value]
        except KeyError:
            return list(value)
    if key == "production":
        return Settings.model_validate(value).to_dict()
    if key == "trim":
        return tuple(value) if value else None
    if isinstance(value, tuple):
        return list(value)
    return value


def prepare(storage, name: str, spec: StudySpec | None = None, given: Mapping[str, Any] | None = None,
            log: Callable[[str], None] | None = None) -> TuneContext:
    """Create (or join/resume) study ``name`` and return this process's context.

    ``spec``: the definition for a new study (ignored, except for conflict checks, when the study
    exists). ``given``: the spec fields the user set explicitly; a resumed study whose stored value
    differs raises :class:`StudyConflict` naming the field.
    """
    quiet_optuna()
    log = log or (lambda _m: None)
    if spec is not None:
        spec.normalize()
    # One process at a time sets a study up (definition, baseline, trial 0); the others wait and
    # then find everything stored.
    with _setup_lock(storage, name):
        exists = study_exists(storage, name)
        if exists:
            study = _load_study(storage, name)
            if given is None and spec is not None:  # a library caller: its whole definition must agree
                given = {k: getattr(spec, k) for k in _DEFINING}
            spec = _resolve_spec(study, spec, dict(given or {}))
        elif spec is None:
            raise TuneError(f"--study {name}: no such study; give --policy and --objective to create it")
        else:
            study = _load_study(storage, name, spec)
            if stored_spec(study) is None:
                study.set_user_attr(ATTR_SPEC, spec.to_dict())
            # Without a lock (other backends) two processes may create it at once: the first
            # definition wins, and the others must agree with it.
            spec = _resolve_spec(study, spec, {k: getattr(spec, k) for k in _DEFINING})
        return _context(study, spec, log)


_DEFINING = ("policies", "objectives", "constraints", "traces", "mix", "trim", "rate_scale", "target_rate",
             "max_tokens_cap", "max_tokens_default", "tenants", "seed", "window_s", "holdout", "windows", "production", "slo",
             "ranges", "fixed", "search", "tune_engine", "num_gpu_blocks", "step_model", "pruner")


@contextlib.contextmanager
def _setup_lock(storage, name: str):
    """A lock across processes for setting study ``name`` up: a PostgreSQL advisory lock, or a
    ``flock`` beside a SQLite file; other backends go without (the objective still refuses a
    second production trial)."""
    url = str(getattr(storage, "url", ""))
    key = int.from_bytes(hashlib.sha256(f"tailpilot-tune:{name}".encode()).digest()[:8], "big", signed=True)
    if url.startswith("postgresql"):
        from sqlalchemy import text

        with storage.engine.connect() as conn:
            conn.execute(text("SELECT pg_advisory_lock(:k)"), {"k": key})
            conn.commit()
            try:
                yield
            finally:
                conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": key})
                conn.commit()
        return
    path = url.removeprefix("sqlite:///") if url.startswith("sqlite:///") else None
    if path and path != ":memory:":
        import fcntl

        with open(f"{path}.tailpilot-lock", "a+") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)
        return
    yield


def _context(study, spec: StudySpec, log: Callable[[str], None], enqueue: bool = True) -> TuneContext:
    _check_digests(spec)
    windows = build_windows(spec)
    search, held = split_windows(spec, len(windows), [window_load(w) for w in windows])
    attrs = study.user_attrs
    fp = fingerprint(windows)
    if ATTR_FINGERPRINT in attrs and attrs[ATTR_FINGERPRINT] != fp:
        raise TuneError(f"study {study.study_name}: the windows rebuilt here differ from the study's "
                        "(different tailpilot version or trace loader?)")
    if ATTR_FINGERPRINT not in attrs:
        study.set_user_attr(ATTR_FINGERPRINT, fp)
        study.set_user_attr(ATTR_SPLIT, {"search": search, "holdout": held, "windows": [
            {"index": w.index, "source": w.source, "start_s": w.start_s, "requests": len(w.measured),
             "warmup_requests": len(w.trace) - len(w.measured)} for w in windows]})
    config = spec.engine_config()
    if ATTR_GAMMA_HAT in attrs:
        gamma_hat = _num(attrs[ATTR_GAMMA_HAT])
    else:
        gamma_hat = estimate_gamma(spec, windows, search, config) if _wants_gamma(spec) else math.nan
        study.set_user_attr(ATTR_GAMMA_HAT, None if not math.isfinite(gamma_hat) else gamma_hat)
        if math.isfinite(gamma_hat):
            log(f"gamma-hat from an FCFS replay of the search windows: {gamma_hat:.4g} /s")
    if ATTR_SPACE in attrs:
        space = SearchSpace.from_dict(attrs[ATTR_SPACE])
    else:
        try:
            ranges = dict(parse_range(r) for r in spec.ranges)
            space = build_space(spec.policies, Settings.model_validate(spec.production), gamma_hat=gamma_hat,
                                ranges=ranges, fixed=spec.fixed, search=spec.search, tune_engine=spec.tune_engine)
        except ValueError as err:
            raise TuneError(str(err)) from None
        study.set_user_attr(ATTR_SPACE, space.to_dict())
    ctx = TuneContext(spec, space, windows, search, held, gamma_hat, {})
    if ATTR_BASELINE in attrs:
        ctx.baseline = {int(k): {m: _num(v) for m, v in d.items()} for k, d in attrs[ATTR_BASELINE].items()}
    else:
        ctx.baseline = ctx.run_many(space.production_settings, search)
        for name, _ in ctx.objectives:
            if not any(math.isfinite(ctx.baseline[i][name]) for i in search):
                raise TuneError(f"--objective {name}: undefined (NaN) on every search window for the production "
                                "settings; pick another metric")
        study.set_user_attr(ATTR_BASELINE, {str(i): {m: _json_num(v) for m, v in d.items()}
                                            for i, d in ctx.baseline.items()})
    if enqueue:
        _ensure_production_trial(study, ctx)
    return ctx


def _wants_gamma(spec: StudySpec) -> bool:
    from controlplane.settings import PARAM_MODELS

    return any("gamma" in PARAM_MODELS[p].model_fields for p in spec.policies)


def _check_digests(spec: StudySpec) -> None:
    for path, digest in [*zip(spec.traces, spec.trace_digests), *zip((p for p, _ in spec.mix), spec.mix_digests)]:
        if path is None or digest is None:
            continue
        if not Path(path).is_file():
            raise TuneError(f"trace file {path} of this study is missing here")
        if file_digest(path) != digest:
            raise TuneError(f"trace file {path} changed since the study was created (SHA-256 differs)")


def _num(v: Any) -> float:
    return math.nan if v is None else float(v)


def _json_num(v: float) -> float | None:
    return None if v is None or not math.isfinite(v) else float(v)


def _ensure_production_trial(study, ctx: TuneContext) -> None:
    """Enqueue the production settings unless a production trial is waiting, running or done."""
    from optuna.trial import TrialState

    for t in study.get_trials(deepcopy=False, states=(TrialState.WAITING, TrialState.RUNNING, TrialState.COMPLETE)):
        if t.user_attrs.get(ROLE_ATTR) == PRODUCTION:
            return
    study.enqueue_trial(ctx.space.production_params(), user_attrs={ROLE_ATTR: PRODUCTION})


def load_context(storage, name: str, *, enqueue: bool = False) -> tuple[Any, TuneContext]:
    """(study, context) of an existing study, rebuilt from its stored definition. ``enqueue``:
    re-enqueue the production trial if it has none (a worker joining); readers leave it alone."""
    quiet_optuna()
    study = _load_study(storage, name)
    spec = stored_spec(study)
    if spec is None:
        raise TuneError(f"--study {name}: not a tailpilot study (no stored definition)")
    if enqueue:
        with _setup_lock(storage, name):
            return study, _context(study, spec, lambda _m: None)
    return study, _context(study, spec, lambda _m: None, enqueue=False)


# --------------------------------------------------------------------------------------------
# The objective and the worker loop
# --------------------------------------------------------------------------------------------


class ExcessTrial(Exception):
    """This trial would exceed the requested number of complete trials (another worker took the slot)."""


def make_sampler(ctx: TuneContext, seed: int):
    import optuna

    if ctx.spec.multi_objective:
        return optuna.samplers.NSGAIISampler(seed=seed, population_size=ctx.spec.population_size)
    return optuna.samplers.TPESampler(seed=seed, multivariate=True, group=True, constant_liar=True)


def make_pruner(ctx: TuneContext):
    import optuna

    if ctx.spec.multi_objective or not ctx.spec.pruner:
        return optuna.pruners.NopPruner()
    return optuna.pruners.WilcoxonPruner(p_threshold=0.1, n_startup_steps=2)


class Objective:
    """``study.optimize``'s objective for one process (windows built once, in ``ctx``)."""

    def __init__(self, ctx: TuneContext, n_trials: int) -> None:
        self.ctx = ctx
        self.n_trials = n_trials
        self.check_rank = False  # set by the worker loop near the end of the study

    def __call__(self, trial) -> float | list[float]:
        from optuna.trial import TrialState

        ctx = self.ctx
        if self.check_rank:
            earlier = [t for t in trial.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.RUNNING))
                       if t.number < trial.number]
            if len(earlier) >= self.n_trials:
                trial.set_user_attr("excess", True)
                raise ExcessTrial(f"trial {trial.number}: {self.n_trials} trials already complete or running")
        production = trial.user_attrs.get(ROLE_ATTR) == PRODUCTION
        if production and any(t.number < trial.number and t.user_attrs.get(ROLE_ATTR) == PRODUCTION
                              for t in trial.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.RUNNING))):
            trial.set_user_attr("excess", True)
            raise ExcessTrial(f"trial {trial.number}: a production trial already ran")
        if production:
            ctx.space.suggest(trial)  # record the production values as this trial's params
            settings = ctx.space.production_settings
        else:
            settings = ctx.space.suggest(trial)
        single = not ctx.spec.multi_objective
        obj_name = ctx.objectives[0][0]
        per_window: dict[int, dict[str, float]] = {}
        pruned_after = None
        for i in ctx.search:
            m = ctx.baseline[i] if production else ctx.run(settings, i)
            per_window[i] = m
            if single:
                v = m[obj_name]
                if math.isfinite(v):
                    trial.report(v, i)
                    if not production and len(per_window) < len(ctx.search) and trial.should_prune():
                        pruned_after = len(per_window)
                        break
        for key, value in ctx.constraint_values(per_window).items():
            trial.set_constraint(key, value)
        run = list(per_window)
        trial.set_user_attr(TRIAL_ATTR, {
            "settings": settings.to_dict(),
            "windows": run,
            "metrics": {n: [_json_num(per_window[i][n]) for i in run] for n in ctx.tracked},
            "pruned_after": pruned_after,
        })
        values = ctx.objective_values(per_window)
        return values[0] if single else values


def _counts(study) -> tuple[int, int]:
    from optuna.trial import TrialState

    complete = running = 0
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.RUNNING)):
        if t.state == TrialState.COMPLETE:
            complete += 1
        else:
            running += 1
    return complete, running


def _finished(study) -> int:
    from optuna.trial import TrialState

    return len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.FAIL, TrialState.PRUNED)))


def run_worker(storage, name: str, ctx: TuneContext, n_trials: int, *, worker: int = 0,
               progress: Callable[[int, int], None] | None = None, poll_s: float = 0.5,
               should_stop: Callable[[], bool] | None = None) -> int:
    """Run trials of study ``name`` until it has ``n_trials`` complete ones (or ``should_stop()``);
    returns how many this worker ran. KeyboardInterrupt propagates (the running trial is marked
    FAIL)."""
    import optuna

    quiet_optuna()
    probe = _load_study(storage, name)
    seed = ctx.spec.seed + 1_000_003 * worker + _finished(probe)
    study = _load_study(storage, name, sampler=make_sampler(ctx, seed), pruner=make_pruner(ctx))
    objective = Objective(ctx, n_trials)
    done = 0
    while True:
        complete, running = _counts(study)
        if progress:
            progress(complete, n_trials)
        if complete >= n_trials or (should_stop is not None and should_stop()):
            return done
        remaining = n_trials - complete - running
        if remaining <= 0:
            optuna.storages.fail_stale_trials(study)
            time.sleep(poll_s)
            continue
        objective.check_rank = remaining <= 2 * (running + 1) + 2
        study.optimize(objective, n_trials=1, catch=(ExcessTrial,))
        done += 1


def _worker_entry(url: str, name: str, n_trials: int, worker: int, parent: int) -> None:
    """A spawned worker process: rebuild the context from the stored definition and optimize;
    stop after the current trial if the parent process is gone."""
    try:
        storage = open_storage(url)
        _, ctx = load_context(storage, name, enqueue=True)
        run_worker(storage, name, ctx, n_trials, worker=worker, should_stop=lambda: os.getppid() != parent)
    except KeyboardInterrupt:
        os._exit(130)


@dataclass
class TuneOutcome:
    study: str
    storage: str
    complete: int
    requested: int
    interrupted: bool
    best: dict[str, Any] | None


def tune(url: str, name: str, n_trials: int, *, spec: StudySpec | None = None,
         given: Mapping[str, Any] | None = None, workers: int = 1,
         progress: Callable[[int, int], None] | None = None,
         log: Callable[[str], None] | None = None) -> TuneOutcome:
    """Create or resume study ``name`` at storage ``url`` and run it to ``n_trials`` complete trials.

    ``workers > 1`` spawns that many local processes on the same storage (use a server database
    for many workers; SQLite serialises writers). Ctrl-C stops cleanly: the study keeps its
    complete trials and the same call resumes it.
    """
    if n_trials < 1:
        raise TuneError(f"--trials {n_trials}: must be >= 1")
    if workers < 1:
        raise TuneError(f"--workers {workers}: must be >= 1")
    log = log or (lambda _m: None)
    storage = open_storage(url)
    ctx = prepare(storage, name, spec, given, log)
    log(f"study {name}: {len(ctx.windows)} windows of {ctx.spec.window_s:g} s, search on {len(ctx.search)} "
        f"{ctx.search}, held out {ctx.holdout}")
    interrupted = False
    try:
        if workers == 1:
            run_worker(storage, name, ctx, n_trials, progress=progress)
        else:
            _run_processes(url, name, n_trials, workers, storage, progress)
    except KeyboardInterrupt:
        interrupted = True
    study = _load_study(storage, name)
    complete, _ = _counts(study)
    return TuneOutcome(name, _redact(url), complete, n_trials, interrupted, best_summary(study, ctx))


def _run_processes(url: str, name: str, n_trials: int, workers: int, storage, progress) -> None:
    mp = multiprocessing.get_context("spawn")
    procs = [mp.Process(target=_worker_entry, args=(url, name, n_trials, k, os.getpid()), name=f"tailpilot-tune-{k}")
             for k in range(workers)]
    for p in procs:
        p.start()
    study = _load_study(storage, name)
    try:
        while any(p.is_alive() for p in procs):
            if progress:
                progress(_counts(study)[0], n_trials)
            time.sleep(0.5)
    except KeyboardInterrupt:
        # A terminal's Ctrl-C reaches the workers too; forward it to any that did not get it.
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and any(p.is_alive() for p in procs):
            time.sleep(0.1)
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGINT)
        for p in procs:
            p.join(timeout=15)
            if p.is_alive():
                p.terminate()
        raise
    failed = [p for p in procs if p.exitcode not in (0, 130, -signal.SIGINT)]
    if progress:
        progress(_counts(study)[0], n_trials)
    if failed:
        raise TuneError(f"{len(failed)} worker process(es) failed (exit codes "
                        f"{', '.join(str(p.exitcode) for p in failed)})")


# --------------------------------------------------------------------------------------------
# Reading results
# --------------------------------------------------------------------------------------------


def is_feasible(trial) -> bool:
    return all(v <= 0 for v in trial.constraints.values())


def candidate_trials(study) -> list:
    """COMPLETE, feasible, fully evaluated (not pruned) trials."""
    from optuna.trial import TrialState

    out = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        info = t.user_attrs.get(TRIAL_ATTR) or {}
        if info.get("pruned_after") is None and "settings" in info and is_feasible(t):
            out.append(t)
    return out


def best_trials(study, ctx: TuneContext) -> list:
    """Single objective: [the best feasible trial] (lowest number on ties). Several: the feasible
    Pareto front, ordered by trial number."""
    cands = candidate_trials(study)
    if not cands:
        return []
    dirs = [d for _, d in ctx.objectives]
    sign = np.array([1.0 if d == "minimize" else -1.0 for d in dirs])
    vals = np.array([[s * v for s, v in zip(sign, t.values)] for t in cands])
    if len(dirs) == 1:
        k = min(range(len(cands)), key=lambda j: (vals[j, 0], cands[j].number))
        return [cands[k]]
    front = []
    for j in range(len(cands)):
        dominated = np.any(np.all(vals <= vals[j], axis=1) & np.any(vals < vals[j], axis=1))
        if not dominated:
            front.append(cands[j])
    return sorted(front, key=lambda t: t.number)


def trial_metrics(trial) -> dict[int, dict[str, float]]:
    """A trial's per-window metrics from its user attributes (window index -> metric -> value)."""
    info = trial.user_attrs[TRIAL_ATTR]
    return {w: {m: (math.nan if vals[k] is None else vals[k]) for m, vals in info["metrics"].items()}
            for k, w in enumerate(info["windows"])}


def choose_recommendation(front: list, ctx: TuneContext) -> Any:
    """Of a Pareto front, the trial an operator would take: among the members that are no worse
    than the production settings on any objective (every % improvement >= 0), the one with the
    largest mean improvement; if every member gives something up, the one whose worst
    improvement is least bad (max-min). Ties → the lower trial number. One trial: that trial."""
    from controlplane.metrics import percent_change

    if len(front) == 1:
        return front[0]

    def gains(t) -> list[float]:
        m = trial_metrics(t)
        out = [percent_change(nanmean([m[i][n] for i in m]), nanmean([ctx.baseline[i][n] for i in m]), n)
               for n, _ in ctx.objectives]
        return [g if math.isfinite(g) else -math.inf for g in out]

    scored = [(gains(t), t) for t in front]
    safe = [(g, t) for g, t in scored if min(g) >= 0]
    if safe:
        return min(safe, key=lambda gt: (-sum(gt[0]) / len(gt[0]), -min(gt[0]), gt[1].number))[1]
    return min(scored, key=lambda gt: (-min(gt[0]), -sum(gt[0]) / len(gt[0]), gt[1].number))[1]


def ranked_candidates(study, ctx: TuneContext) -> list:
    """Feasible, fully evaluated trials in the order ``recommend`` would take them: the chosen
    one (``choose_recommendation`` of the front) first; then, one objective, the rest by value;
    several, the rest of the front by the same rule."""
    front = best_trials(study, ctx)
    if not front:
        return []
    first = choose_recommendation(front, ctx)
    if len(ctx.objectives) == 1:
        sign = 1.0 if ctx.objectives[0][1] == "minimize" else -1.0
        rest = sorted((t for t in candidate_trials(study) if t.number != first.number),
                      key=lambda t: (sign * t.values[0], t.number))
    else:
        rest = []
        others = [t for t in front if t.number != first.number]
        while others:
            nxt = choose_recommendation(others, ctx)
            rest.append(nxt)
            others = [t for t in others if t.number != nxt.number]
    return [first, *rest]


def best_summary(study, ctx: TuneContext) -> dict[str, Any] | None:
    best = best_trials(study, ctx)
    if not best:
        return None
    t = choose_recommendation(best, ctx)
    return {"trial": t.number, "values": list(t.values), "settings": t.user_attrs[TRIAL_ATTR]["settings"],
            "pareto_size": len(best)}

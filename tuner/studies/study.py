"""Optuna studies over policy and engine settings (docs/engine.md#tuner): what a study is, how it
is prepared (created, joined or resumed) and how a process rebuilds its context.

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
  in the study. A worker pops and runs it under the setup lock (SQLite ignores ``SELECT ... FOR
  UPDATE``: two workers released together both popped it, and one crashed telling a COMPLETE
  trial).
* **Definition kept in the study.** The study's user attributes hold the full definition (trace
  files with their SHA-256, transforms, window length, split, objectives, constraints,
  production settings, engine config with the step-time coefficients, seed), the derived search
  space, γ̂ and the baseline, plus a fingerprint of the windows. A resuming ``tune``, a worker on
  another machine and ``recommend`` rebuild exactly the same windows from it (and refuse when a
  trace file changed). A recording still running is pinned where it stood when the study was
  created (``tuner.closed_loop.recorded.pin``): the recorder appending requests afterwards changes
  nothing the study replays, while a request changed inside that span is refused like a changed
  file.
* **Checked before it is stored.** A new study's context is derived whole (:func:`draft`) before
  ``tune`` opens a storage file, so a refused definition leaves no database or journal behind.

Rooms: the definition is ``tuner/studies/spec.py``, the windows and their replay
``tuner/studies/windows.py``, where a study lives ``tuner/studies/optuna_storage.py``, a study
found by its name ``tuner/studies/lookup.py``; this module
prepares a study and rebuilds its context; ``tuner/studies/optimize.py`` runs its workers (``tune``:
samplers, streams, many workers, Ctrl-C) and ``tuner/studies/results.py`` reads its results
(``tuner/studies/recommend.py`` and ``tuner/studies/continuous.py`` build on them).

Keep Optuna's tables away from tailpilot's database: the default storage is the SQLite file
``tailpilot-optuna.db``; ``check_storage_separate`` refuses the tailpilot database itself.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

import numpy as np

from scheduler.metrics import validate_metric
from scheduler.settings import PARAM_MODELS, Settings
from scheduler.validation import finite_or_none
from sim.engine import EngineConfig, Simulator
from sim.traces import Trace, TraceError
from tuner.closed_loop import recorded
from tuner.studies.lookup import check_study_name, load_study, no_such_study, study_exists
from tuner.studies.objectives import Constraint, tracked_metrics
from tuner.studies.optuna_storage import (
    quiet_optuna,
    storage_file,
    url_of,
)
from tuner.studies.search import SearchSpace, build_space, parse_range
from tuner.studies.spec import SpecError, StudyConflict, StudySpec, TuneError, file_digest
from tuner.studies.windows import (
    Window,
    build_traces,
    build_windows,
    fingerprint,
    nanmean,
    split_windows,
    window_load,
    window_metrics,
    worst,
)

# Optuna is imported inside the functions that use it: the TUI imports this module at start, and
# optuna would add ~40 ms to it (python -X importtime); sqlalchemy, ~0.2 s, likewise.
if TYPE_CHECKING:
    from optuna import Study
    from optuna.storages import BaseStorage, RDBStorage

ATTR_SPEC = "tailpilot:spec"
ATTR_SPACE = "tailpilot:space"
ATTR_GAMMA_HAT = "tailpilot:gamma_hat"
ATTR_BASELINE = "tailpilot:baseline"
ATTR_FINGERPRINT = "tailpilot:fingerprint"
ATTR_SPLIT = "tailpilot:split"
TRIAL_ATTR = "tailpilot"
ROLE_ATTR = "tailpilot_role"
OWNER_ATTR = (
    "tailpilot_worker"  # "HOST:PID" of the process running the trial (journal: no heartbeats)
)
PRODUCTION = "production"
INFEASIBLE = 1e12  # constraint value for an undefined (NaN) metric: Optuna refuses NaN


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
    objectives: list[tuple[str, Literal["maximize", "minimize"]]] = field(init=False)
    constraints: list[Constraint] = field(init=False)
    tracked: list[str] = field(init=False)

    def __post_init__(self) -> None:
        self.config = self.spec.engine_config()
        self.objectives = self.spec.objective_dirs()
        self.constraints = self.spec.parsed_constraints()
        self.tracked = tracked_metrics(self.objectives, self.constraints)

    @functools.cached_property
    def traces(self) -> list[Trace]:
        """The study's traces, whole (loaded once: continuous replays run on them)."""
        return build_traces(self.spec)

    def run(self, settings: Settings, index: int) -> dict[str, float]:
        return window_metrics(
            settings, self.windows[index], self.config, self.tracked, self.spec.slo
        )

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

    def constraint_values(
        self,
        per_window: Mapping[int, Mapping[str, float]],
        baseline: Mapping[int, Mapping[str, float]] | None = None,
    ) -> dict[str, float]:
        """Constraint values over the windows in ``per_window`` (the baseline on the same ones)."""
        baseline = self.baseline if baseline is None else baseline
        out = {}
        for c in self.constraints:
            x = self.aggregate(per_window, c.metric)
            b = nanmean([baseline[i][c.metric] for i in per_window]) if c.relative else math.nan
            v = c.value(x, b)
            out[c.key] = v if math.isfinite(v) else INFEASIBLE
        return out


def estimate_gamma(
    spec: StudySpec, windows: Sequence[Window], indices: Sequence[int], config: EngineConfig
) -> float:
    """γ̂ = ln 5 / (t99 − t95) of TTLT, pooled over an FCFS replay of the search windows
    (docs/policies.md#uniboost); NaN when the tail is degenerate."""
    fcfs = Settings.model_validate({"policy": "fcfs", "engine": spec.production["engine"]})
    ttlt: list[float] = []
    for i in indices:
        res = Simulator(windows[i].trace, fcfs, config).run()
        ttlt.extend(
            c.finished_at - c.arrival for c in res.completions if c.id in windows[i].measured
        )
    if len(ttlt) < 20:
        return math.nan
    t95, t99 = np.percentile(np.asarray(ttlt), [95, 99])
    gap = float(t99 - t95)
    return math.log(5.0) / gap if gap > 0 else math.nan


# --------------------------------------------------------------------------------------------
# Preparing and loading a study
# --------------------------------------------------------------------------------------------


def stored_spec(study: Study) -> StudySpec | None:
    """The definition the study was created with (None: not a tailpilot study); a definition the
    CLI could not have written (edited by hand in the study's storage) is a :class:`TuneError`."""
    raw = study.user_attrs.get(ATTR_SPEC)
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise TuneError(f"study {study.study_name}: its stored definition is not an object")
    try:
        return StudySpec.from_dict(raw)
    except SpecError as err:
        raise TuneError(
            f"study {study.study_name}: its stored definition is invalid ({err}); "
            "was it edited outside tailpilot? Create a new study"
        ) from None


def _resolve_spec(study: Study, spec: StudySpec | None, given: Mapping[str, Any]) -> StudySpec:
    stored = stored_spec(study)
    if stored is None:
        if spec is None:
            raise TuneError(
                f"--study {study.study_name}: the study has no tailpilot definition "
                "(not created by tailpilot tune?); give --objective and --policy to create it"
            )
        return spec
    for key, value in given.items():
        theirs = getattr(stored, key)
        if _canon(key, value) != _canon(key, theirs):
            raise StudyConflict(key, value, theirs)
    return stored


def _canon(key: str, value: Any) -> Any:
    """Comparable form of a spec field (paths resolved, metric aliases resolved)."""
    if key == "traces":
        # A study's recording is pinned where it stood when the study was created
        # (``recorded.pin``); the recording as the user names it again is the same trace.
        return [_canon_trace(p) for p in value] or [None]
    if key == "mix":
        return [(str(Path(p).resolve()), float(f)) for p, f in value]
    if key == "objectives":
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


def _canon_trace(path: str | None) -> str | None:
    if path in (None, "bundled"):
        return None
    if recorded.is_recorded(path):
        try:
            return recorded.unpinned(recorded.canonical(path))
        except TraceError:  # a URL edited by hand in the study: compared as written
            return path
    return str(Path(path).resolve())


def prepare(
    storage: BaseStorage,
    name: str,
    spec: StudySpec | None = None,
    given: Mapping[str, Any] | None = None,
    log: Callable[[str], None] | None = None,
    drafted: Draft | None = None,
) -> TuneContext:
    """Create (or join/resume) study ``name`` and return this process's context.

    ``spec``: the definition for a new study (ignored, except for conflict checks, when the study
    exists). ``given``: the spec fields the user set explicitly; a resumed study whose stored value
    differs raises :class:`StudyConflict` naming the field. ``drafted``: :func:`draft` of ``spec``,
    made before the storage was opened; a new study stores it instead of deriving it again.
    """
    quiet_optuna()
    check_study_name(name)
    log = log or (lambda _m: None)
    if drafted is not None:
        spec = drafted.ctx.spec  # normalized by draft()
    elif spec is not None:
        spec.normalize()
    # One process at a time sets a study up (definition, baseline, trial 0); the others wait and
    # then find everything stored.
    with setup_lock(storage, name):
        exists = study_exists(storage, name)
        if exists:
            study = load_study(storage, name)
            if (
                given is None and spec is not None
            ):  # a library caller: its whole definition must agree
                given = {k: getattr(spec, k) for k in _DEFINING}
            spec = _resolve_spec(study, spec, dict(given or {}))
        elif spec is None:
            raise TuneError(no_such_study(storage, name))
        else:
            study = load_study(storage, name, spec)
            if stored_spec(study) is None:
                study.set_user_attr(ATTR_SPEC, spec.to_dict())
            # Without a lock (other backends) two processes may create it at once: the first
            # definition wins, and the others must agree with it.
            spec = _resolve_spec(study, spec, {k: getattr(spec, k) for k in _DEFINING})
            try:
                return _context(study, spec, log, drafted=drafted)
            except TuneError:
                _discard_new_study(storage, study)
                raise
        return _context(study, spec, log)


@dataclass
class Draft:
    """A new study's context derived from its definition alone (:func:`draft`), and the user
    attributes that keep it in the study."""

    ctx: TuneContext
    attrs: dict[str, Any]


def draft(spec: StudySpec, log: Callable[[str], None] | None = None) -> Draft:
    """Everything a new study derives from ``spec`` — the definition normalized (files found,
    recordings pinned and digested), windows and split, γ̂, search space, the production
    baseline — with every check that can refuse it, before any storage is opened: ``tune`` with
    a bad definition leaves no database or journal behind. :func:`prepare` stores it."""
    spec.normalize()
    return Draft(*_derive(spec, {}, "(new)", log or (lambda _m: None)))


def _discard_new_study(storage: BaseStorage, study: Study) -> None:
    """Delete ``study``, created by this very call, whose setup refused its definition (a --range
    outside the model's bounds, a --fix the settings refuse, an objective undefined on every
    window). Kept, the stored definition would be refused again on every later run of the command,
    corrected flags or not (they would conflict with it). A study holding a trial is never
    deleted."""
    import optuna  # start-up cost: see the note above TYPE_CHECKING

    if not study.trials:
        optuna.delete_study(study_name=study.study_name, storage=storage)


_DEFINING = (
    "policies",
    "objectives",
    "constraints",
    "traces",
    "mix",
    "trim",
    "rate_scale",
    "target_rate",
    "max_tokens_cap",
    "max_tokens_default",
    "tenants",
    "seed",
    "window_s",
    "holdout",
    "windows",
    "production",
    "slo",
    "ranges",
    "fixed",
    "search",
    "tune_engine",
    "num_gpu_blocks",
    "step_model",
    "pruner",
)


@contextlib.contextmanager
def setup_lock(storage: BaseStorage, name: str) -> Iterator[None]:
    """A lock across processes for setting study ``name`` up: a PostgreSQL advisory lock, or a
    ``flock`` beside a SQLite or journal file; other backends go without (the objective still
    refuses a second production trial)."""
    url = url_of(storage)
    key = int.from_bytes(
        hashlib.sha256(f"tailpilot-tune:{name}".encode()).digest()[:8], "big", signed=True
    )
    if url.startswith("postgresql"):
        from sqlalchemy import text  # start-up cost: see the note above TYPE_CHECKING

        engine = cast("RDBStorage", storage).engine  # a PostgreSQL URL is an RDB storage's
        with engine.connect() as conn:
            conn.execute(text("SELECT pg_advisory_lock(:k)"), {"k": key})
            conn.commit()
            try:
                yield
            finally:
                conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": key})
                conn.commit()
        return
    path = storage_file(url)
    if path:
        import fcntl  # POSIX only: the module still imports where there is no fcntl

        with open(f"{path}.tailpilot-lock", "a+") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)
        return
    yield


_DERIVED = (ATTR_FINGERPRINT, ATTR_SPLIT, ATTR_GAMMA_HAT, ATTR_SPACE, ATTR_BASELINE)


def _context(
    study: Study,
    spec: StudySpec,
    log: Callable[[str], None],
    enqueue: bool = True,
    drafted: Draft | None = None,
) -> TuneContext:
    attrs = study.user_attrs
    if (
        drafted is not None
        and not any(k in attrs for k in _DERIVED)
        and drafted.ctx.spec.to_dict() == spec.to_dict()  # not another process's definition
    ):
        ctx, new = drafted.ctx, drafted.attrs  # derived (and its traces checked) a moment ago
    else:
        _check_digests(spec)
        ctx, new = _derive(spec, attrs, study.study_name, log)
    # Stored together once everything is derived: a definition refused half-way stores nothing.
    for key, value in new.items():
        study.set_user_attr(key, value)
    if enqueue:
        _ensure_production_trial(study, ctx)
    return ctx


def _derive(
    spec: StudySpec, attrs: Mapping[str, Any], study_name: str, log: Callable[[str], None]
) -> tuple[TuneContext, dict[str, Any]]:
    """The context of ``spec``, taking what the study's user attributes ``attrs`` already hold
    and deriving the rest; (context, the attributes to add)."""
    new: dict[str, Any] = {}
    windows = build_windows(spec)
    search, held = split_windows(spec, len(windows), [window_load(w) for w in windows])
    fp = fingerprint(windows)
    if ATTR_FINGERPRINT in attrs and attrs[ATTR_FINGERPRINT] != fp:
        raise TuneError(
            f"study {study_name}: the windows rebuilt here differ from the study's "
            "(different tailpilot version or trace loader?)"
        )
    if ATTR_FINGERPRINT not in attrs:
        new[ATTR_FINGERPRINT] = fp
        new[ATTR_SPLIT] = {
            "search": search,
            "holdout": held,
            "windows": [
                {
                    "index": w.index,
                    "source": w.source,
                    "start_s": w.start_s,
                    "requests": len(w.measured),
                    "warmup_requests": len(w.trace) - len(w.measured),
                }
                for w in windows
            ],
        }
    config = spec.engine_config()
    if ATTR_GAMMA_HAT in attrs:
        gamma_hat = _num(attrs[ATTR_GAMMA_HAT])
    else:
        gamma_hat = (
            estimate_gamma(spec, windows, search, config) if _wants_gamma(spec) else math.nan
        )
        new[ATTR_GAMMA_HAT] = None if not math.isfinite(gamma_hat) else gamma_hat
        if math.isfinite(gamma_hat):
            log(f"gamma-hat from an FCFS replay of the search windows: {gamma_hat:.4g} /s")
    if ATTR_SPACE in attrs:
        space = SearchSpace.from_dict(attrs[ATTR_SPACE])
    else:
        try:
            ranges = dict(parse_range(r) for r in spec.ranges)
            space = build_space(
                spec.policies,
                Settings.model_validate(spec.production),
                ranges=ranges,
                fixed=spec.fixed,
                search=spec.search,
                tune_engine=spec.tune_engine,
            )
        except ValueError as err:
            raise TuneError(str(err)) from None
        new[ATTR_SPACE] = space.to_dict()
    ctx = TuneContext(spec, space, windows, search, held, gamma_hat, {})
    if ATTR_BASELINE in attrs:
        ctx.baseline = {
            int(k): {m: _num(v) for m, v in d.items()} for k, d in attrs[ATTR_BASELINE].items()
        }
    else:
        ctx.baseline = ctx.run_many(space.production_settings, search)
        for name, _ in ctx.objectives:
            if not any(math.isfinite(ctx.baseline[i][name]) for i in search):
                raise SpecError(
                    "objectives",
                    f"{name}: undefined (NaN) on every search window for the "
                    "production settings; pick another metric",
                )
        new[ATTR_BASELINE] = {
            str(i): {m: finite_or_none(v) for m, v in d.items()} for i, d in ctx.baseline.items()
        }
    return ctx, new


def _wants_gamma(spec: StudySpec) -> bool:
    return any("gamma" in PARAM_MODELS[p].model_fields for p in spec.policies)


def _check_digests(spec: StudySpec) -> None:
    for path, digest in [
        *zip(spec.traces, spec.trace_digests),
        *zip((p for p, _ in spec.mix), spec.mix_digests),
    ]:
        if path is None or digest is None:
            continue
        if recorded.is_recorded(path):
            try:
                now = file_digest(path)
            except TraceError as err:
                raise TuneError(f"recorded trace of this study: {err}") from None
            if now != digest:
                raise TuneError(
                    f"recorded trace {path} changed since the study was created (requests "
                    "inside the span it tuned on differ: deleted, or stored late)"
                )
            continue
        if not Path(path).is_file():
            raise TuneError(f"trace file {path} of this study is missing here")
        if file_digest(path) != digest:
            raise TuneError(
                f"trace file {path} changed since the study was created (SHA-256 differs)"
            )


def _num(v: Any) -> float:
    return math.nan if v is None else float(v)


def _ensure_production_trial(study: Study, ctx: TuneContext) -> None:
    """Enqueue the production settings unless a production trial is waiting, running or done."""
    from optuna.trial import TrialState  # start-up cost: see the note above TYPE_CHECKING

    for t in study.get_trials(
        deepcopy=False, states=(TrialState.WAITING, TrialState.RUNNING, TrialState.COMPLETE)
    ):
        if t.user_attrs.get(ROLE_ATTR) == PRODUCTION:
            return
    study.enqueue_trial(ctx.space.production_params(), user_attrs={ROLE_ATTR: PRODUCTION})


def load_context(
    storage: BaseStorage, name: str, *, enqueue: bool = False
) -> tuple[Study, TuneContext]:
    """(study, context) of an existing study, rebuilt from its stored definition. ``enqueue``:
    re-enqueue the production trial if it has none (a worker joining); readers leave it alone."""
    quiet_optuna()
    study = load_study(storage, name)
    spec = stored_spec(study)
    if spec is None:
        raise TuneError(f"--study {name}: not a tailpilot study (no stored definition)")
    if enqueue:
        with setup_lock(storage, name):
            return study, _context(study, spec, lambda _m: None)
    return study, _context(study, spec, lambda _m: None, enqueue=False)

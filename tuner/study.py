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
  in the study. A worker pops and runs it under the setup lock (SQLite ignores ``SELECT ... FOR
  UPDATE``: two workers released together both popped it, and one crashed telling a COMPLETE
  trial).
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
  the same storage (RDB, or a journal file) until the study holds ``n_trials`` COMPLETE trials. Before a trial the
  worker checks the counts (and waits while the remaining slots are all taken by running trials),
  and a trial that finds ``n_trials`` earlier complete-or-running trials ends as FAIL (user attr
  ``excess``) without running, so the number of complete trials is exactly ``n_trials``.
  Heartbeats fail the trials of crashed workers (RDB); on a journal, which has none, a worker
  fails the running trials of dead workers of its own host.
* **Sampler streams.** A worker seeds its sampler with ``seed`` (+ 1,000,003 × its local worker
  index) + the number of finished trials, and keeps that stream while its trials are numbered
  one after another from where the study stood when it started (nothing running then): a worker
  alone. Two workers that started at the same moment saw the same count and drew identical
  suggestions (issue 23: 9 distinct parameter sets in 14 trials); so as soon as a worker's trial
  number shows another process in the study (or one was running when it started), every further
  trial of it draws from ``trial_seed(seed, trial number)``. The storage hands out trial numbers
  once, so no two trials share a stream, on any backend, without any coordination.
* **Determinism.** The simulator is deterministic, so one worker with the same seed gives the
  same trials and the same best trial (the same as before per-trial streams existed). A resumed
  worker starts a fresh stream (``seed`` plus the finished count), still reproducible.

Rooms: the definition is ``tuner/spec.py``, the windows and their replay ``tuner/windows.py``,
where a study lives ``tuner/optuna_storage.py``; this module prepares a study, runs its workers and
reads its results (``tuner/recommend.py`` and ``tuner/continuous.py`` build on them).

Keep Optuna's tables away from tailpilot's database: the default storage is the SQLite file
``tailpilot-optuna.db``; ``check_storage_separate`` refuses the tailpilot database itself.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
import multiprocessing
import os
import signal
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Mapping, Sequence

import numpy as np

from scheduler.settings import Settings
from sim.engine import EngineConfig, Simulator
from sim.traces import Trace, TraceError
from tuner import recorded
from tuner.search import (
    Constraint,
    SearchSpace,
    build_space,
    parse_range,
    tracked_metrics,
)
# The study's parts, imported here for callers of the study's API (tuner.study.X keeps working).
from tuner.optuna_storage import (GRACE_S, HEARTBEAT_S, TAILPILOT_TABLES, _redact,  # noqa: F401
                                  check_storage_separate, is_journal, open_storage, quiet_optuna, storage_file,
                                  storage_url, url_of)
from tuner.spec import (DEFAULT_HOLDOUT, DEFAULT_MAX_WINDOWS, DEFAULT_MIN_REQUESTS,  # noqa: F401
                        DEFAULT_STORAGE_FILE, DEFAULT_WARMUP_S, DEFAULT_WINDOW_S, SPEC_VERSION, StudyConflict,
                        StudySpec, TuneError, file_digest)
from tuner.windows import (Window, build_traces, build_windows, completion_metrics, fingerprint,  # noqa: F401
                           nanmean, split_windows, window_load, window_metrics, worst)

ATTR_SPEC = "tailpilot:spec"
ATTR_SPACE = "tailpilot:space"
ATTR_GAMMA_HAT = "tailpilot:gamma_hat"
ATTR_BASELINE = "tailpilot:baseline"
ATTR_FINGERPRINT = "tailpilot:fingerprint"
ATTR_SPLIT = "tailpilot:split"
TRIAL_ATTR = "tailpilot"
ROLE_ATTR = "tailpilot_role"
OWNER_ATTR = "tailpilot_worker"  # "HOST:PID" of the process running the trial (journal: no heartbeats)
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
    ttlt: list[float] = []
    for i in indices:
        res = Simulator(windows[i].trace, fcfs, config).run()
        ttlt.extend(c.finished_at - c.arrival for c in res.completions if c.id in windows[i].measured)
    if len(ttlt) < 20:
        return math.nan
    t95, t99 = np.percentile(np.asarray(ttlt), [95, 99])
    gap = float(t99 - t95)
    return math.log(5.0) / gap if gap > 0 else math.nan


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
        from scheduler.metrics import validate_metric

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
            try:
                return _context(study, spec, log)
            except TuneError:
                _discard_new_study(storage, study)
                raise
        return _context(study, spec, log)


def _discard_new_study(storage, study) -> None:
    """Delete ``study``, created by this very call, whose setup refused its definition (a --range
    outside the model's bounds, a --fix the settings refuse, an objective undefined on every
    window). Kept, the stored definition would be refused again on every later run of the command,
    corrected flags or not (they would conflict with it). A study holding a trial is never deleted."""
    import optuna

    if not study.trials:
        optuna.delete_study(study_name=study.study_name, storage=storage)


_DEFINING = ("policies", "objectives", "constraints", "traces", "mix", "trim", "rate_scale", "target_rate",
             "max_tokens_cap", "max_tokens_default", "tenants", "seed", "window_s", "holdout", "windows", "production", "slo",
             "ranges", "fixed", "search", "tune_engine", "num_gpu_blocks", "step_model", "pruner")


@contextlib.contextmanager
def _setup_lock(storage, name: str):
    """A lock across processes for setting study ``name`` up: a PostgreSQL advisory lock, or a
    ``flock`` beside a SQLite or journal file; other backends go without (the objective still
    refuses a second production trial)."""
    url = url_of(storage)
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
    path = storage_file(url)
    if path:
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
            space = build_space(spec.policies, Settings.model_validate(spec.production),
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
    from scheduler.settings import PARAM_MODELS

    return any("gamma" in PARAM_MODELS[p].model_fields for p in spec.policies)


def _check_digests(spec: StudySpec) -> None:
    for path, digest in [*zip(spec.traces, spec.trace_digests), *zip((p for p, _ in spec.mix), spec.mix_digests)]:
        if path is None or digest is None:
            continue
        if recorded.is_recorded(path):
            try:
                now = file_digest(path)
            except TraceError as err:
                raise TuneError(f"recorded trace of this study: {err}") from None
            if now != digest:
                raise TuneError(f"recorded trace {path} changed since the study was created (its requests differ)")
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
    """The study's sampler seeded ``seed``: TPE for one objective, NSGA-II for several."""
    import optuna

    if ctx.spec.multi_objective:
        return optuna.samplers.NSGAIISampler(seed=seed, population_size=ctx.spec.population_size)
    return optuna.samplers.TPESampler(seed=seed, multivariate=True, group=True, constant_liar=True)


def trial_seed(seed: int, number: int) -> int:
    """The sampler seed of trial ``number`` in a study seeded ``seed`` (32 bits of a hash: studies
    with neighbouring seeds do not share streams shifted by one trial)."""
    digest = hashlib.sha256(f"tailpilot-sampler:{seed}:{number}".encode()).digest()
    return int.from_bytes(digest[:4], "big")


def stream_sampler(ctx: TuneContext, seed: int, process_seed: int, expected: int | None):
    """A worker's sampler (module docstring, "Sampler streams"): ``make_sampler(ctx,
    process_seed)`` while its trials are numbered ``expected``, ``expected + 1``, …; from the first
    trial that is not (or from the start when ``expected`` is None), before each trial
    ``make_sampler(ctx, trial_seed(seed, number))``. Optuna's samplers keep nothing between
    trials that the storage does not hold, so a fresh one per trial samples as a long-lived one."""
    return _stream_sampler_class()(functools.partial(make_sampler, ctx), seed, process_seed, expected)


@functools.cache
def _stream_sampler_class():
    import optuna

    class StreamSampler(optuna.samplers.BaseSampler):
        """Delegates to the worker's own sampler, or to one rebuilt per trial (``stream_sampler``);
        one trial at a time per process (``study.optimize`` with ``n_jobs=1``)."""

        def __init__(self, factory: Callable[[int], Any], seed: int, process_seed: int,
                     expected: int | None) -> None:
            self.factory, self.seed, self.expected = factory, seed, expected
            self.inner = factory(process_seed)

        def before_trial(self, study, trial) -> None:
            if self.expected is not None and trial.number == self.expected:
                self.expected += 1  # still alone: today's stream, reproducible
            else:
                self.expected = None  # another process took a number: never share a stream
                self.inner = self.factory(trial_seed(self.seed, trial.number))
            self.inner.before_trial(study, trial)

        def infer_relative_search_space(self, study, trial):
            return self.inner.infer_relative_search_space(study, trial)

        def sample_relative(self, study, trial, search_space):
            return self.inner.sample_relative(study, trial, search_space)

        def sample_independent(self, study, trial, param_name, param_distribution):
            return self.inner.sample_independent(study, trial, param_name, param_distribution)

        def after_trial(self, study, trial, state, values) -> None:
            self.inner.after_trial(study, trial, state, values)

        def reseed_rng(self) -> None:
            self.inner.reseed_rng()

    return StreamSampler


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
        trial.set_user_attr(OWNER_ATTR, f"{socket.gethostname()}:{os.getpid()}")
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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def fail_dead_local_trials(study) -> list[int]:
    """Mark FAIL the RUNNING trials whose worker ran on this host and has exited (what heartbeats
    do on an RDB storage; a journal has none). Trials of other hosts are left alone: their
    liveness cannot be seen from here. Returns the failed trials' numbers."""
    from optuna.trial import TrialState

    host, failed = socket.gethostname(), []
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        owner_host, _, pid = str(t.user_attrs.get(OWNER_ATTR, "")).rpartition(":")
        if owner_host == host and pid.isdigit() and not _alive(int(pid)):
            try:
                study.tell(t.number, state=TrialState.FAIL)
            except (RuntimeError, ValueError):  # finished meanwhile (another worker got there first)
                continue
            failed.append(t.number)
    return failed


def _finished(study) -> int:
    from optuna.trial import TrialState

    return len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.FAIL, TrialState.PRUNED)))


def _run_waiting_production(storage, name: str, study, objective: Objective) -> int:
    """Pop and run the waiting production trial, if any, under the setup lock (it takes no time:
    its metrics are the baseline), so no two workers pop it. Returns the trials run (0 or 1)."""
    from optuna.trial import TrialState

    with _setup_lock(storage, name):
        if not any(t.user_attrs.get(ROLE_ATTR) == PRODUCTION
                   for t in study.get_trials(deepcopy=False, states=(TrialState.WAITING,))):
            return 0
        study.optimize(objective, n_trials=1, catch=(ExcessTrial,))
        return 1


def run_worker(storage, name: str, ctx: TuneContext, n_trials: int, *, worker: int = 0,
               progress: Callable[[int, int], None] | None = None, poll_s: float = 0.5,
               should_stop: Callable[[], bool] | None = None) -> int:
    """Run trials of study ``name`` until it has ``n_trials`` complete ones (or ``should_stop()``);
    returns how many this worker ran. KeyboardInterrupt propagates (the running trial is marked
    FAIL). ``worker``: the index of a local worker process (its stream's offset)."""
    import optuna
    from optuna.trial import TrialState

    quiet_optuna()
    no_heartbeat = isinstance(storage, optuna.storages.JournalStorage)
    probe = _load_study(storage, name)
    if no_heartbeat:
        fail_dead_local_trials(probe)
    trials = probe.get_trials(deepcopy=False)
    waiting = [t.number for t in trials if t.state == TrialState.WAITING]
    alone = not any(t.state == TrialState.RUNNING for t in trials)
    expected = (min(waiting) if waiting else len(trials)) if alone else None
    process_seed = ctx.spec.seed + 1_000_003 * worker + _finished(probe)
    study = _load_study(storage, name, sampler=stream_sampler(ctx, ctx.spec.seed, process_seed, expected),
                        pruner=make_pruner(ctx))
    objective = Objective(ctx, n_trials)
    done = _run_waiting_production(storage, name, study, objective)
    while True:
        complete, running = _counts(study)
        if progress:
            progress(complete, n_trials)
        if complete >= n_trials or (should_stop is not None and should_stop()):
            return done
        remaining = n_trials - complete - running
        if remaining <= 0:
            if no_heartbeat:
                fail_dead_local_trials(study)
            else:
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
                assert p.pid is not None  # a started process has one
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
    from scheduler.metrics import percent_change

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

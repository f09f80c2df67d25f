"""Running a study (docs/engine.md#tuner): the objective, the samplers and their streams, the
worker loop, and :func:`tune`, which runs one worker in this process or several local worker
processes. What a study is — windows, trial 0, the definition kept in the study — is
``tuner/studies/study.py``'s docstring.

* **Samplers.** One objective: TPE (multivariate, grouped for the conditional policy choice,
  constant liar for parallel workers) with the WilcoxonPruner over windows; a pruned trial
  returns the mean of the windows it ran (Optuna's documented workaround) and is marked
  ``pruned_after``. Several objectives: NSGA-II. Constraints go through ``trial.set_constraint``
  (Optuna ≥ 5), which both samplers read.
* **Many workers.** Each worker (a local process of ``--workers``, or a ``tailpilot tune`` on
  another machine using the same ``--storage``) runs ``study.optimize`` one trial at a time on
  the same storage (RDB, or a journal file) until the study holds ``n_trials`` COMPLETE trials.
  Before a trial the worker checks the counts (and waits while the remaining slots are all taken by
  running trials), and a trial that finds ``n_trials`` earlier complete-or-running trials ends as
  FAIL (user attr ``excess``) without running and without Optuna's warning and traceback (the
  counts were read before the trial had its number: another worker took the slot), so the number
  of complete trials is exactly ``n_trials``. Heartbeats fail the trials of crashed workers
  (RDB); on a journal, which has none, a worker fails the running trials of dead workers of its
  own host.
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
* **Ctrl-C.** The running trial of each worker is marked FAIL and the study keeps its complete
  trials; the same call resumes it. ``tune`` reports the interruption once: the warnings (one
  with a traceback) Optuna logs for a trial a KeyboardInterrupt stopped are dropped.
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import FrameType
from typing import Any

import optuna
from optuna.storages import BaseStorage
from optuna.trial import TrialState

from scheduler.errors import FAILED, TailpilotError
from scheduler.validation import finite_or_none
from tuner.studies.lookup import check_study_name, load_study, study_exists
from tuner.studies.optuna_storage import open_storage, quiet_optuna, redact, storage_exists
from tuner.studies.results import best_summary
from tuner.studies.samplers import StreamSampler, stream_sampler
from tuner.studies.spec import StudySpec, TuneError
from tuner.studies.study import (
    OWNER_ATTR,
    PRODUCTION,
    ROLE_ATTR,
    TRIAL_ATTR,
    TuneContext,
    draft,
    load_context,
    prepare,
    setup_lock,
)

# Where Optuna logs "Trial N failed ..." (optuna/study/_optimize.py's logger).
OPTUNA_TRIAL_LOG = "optuna.study._optimize"


class ExcessTrial(TailpilotError):
    """This trial would exceed the requested number of complete trials (another worker took the
    slot)."""

    exit_code = FAILED


def make_pruner(ctx: TuneContext) -> optuna.pruners.BasePruner:
    if ctx.spec.multi_objective or not ctx.spec.pruner:
        return optuna.pruners.NopPruner()
    # The pruner imports scipy.stats at its first prune, inside a trial: a Ctrl-C landing in that
    # import surfaces as "ImportError: initialization failed" (a C extension's init interrupted),
    # which the trial logs as a failure with its traceback. Imported here, before any trial, an
    # interrupt there ends the worker quietly as any other (_worker_entry).
    import scipy.stats  # noqa: F401

    return optuna.pruners.WilcoxonPruner(p_threshold=0.1, n_startup_steps=2)


class Objective:
    """``study.optimize``'s objective for one process (windows built once, in ``ctx``)."""

    def __init__(self, ctx: TuneContext, n_trials: int) -> None:
        self.ctx = ctx
        self.n_trials = n_trials
        self.interrupted: int | None = None  # the trial a KeyboardInterrupt stopped
        self.excess: set[int] = set()  # trials this process refused (ExcessTrial)

    def __call__(self, trial: optuna.Trial) -> float | list[float]:
        try:
            return self._evaluate(trial)
        except KeyboardInterrupt:
            self.interrupted = trial.number
            raise

    def quiet_interrupted(self, record: logging.LogRecord) -> bool:
        """A logging filter: drop Optuna's "Trial N failed ..." warnings (one with a traceback)
        of the interrupted trial (``tune`` reports the interruption; each worker would print a
        traceback) and of the trials refused as excess (a slot another worker took first: the
        study goes on as it should, nothing failed)."""
        message = record.getMessage()
        quiet = [*self.excess, *([] if self.interrupted is None else [self.interrupted])]
        return not any(message.startswith(f"Trial {number} failed") for number in quiet)

    def _evaluate(self, trial: optuna.Trial) -> float | list[float]:
        ctx = self.ctx
        trial.set_user_attr(OWNER_ATTR, f"{socket.gethostname()}:{os.getpid()}")
        production = trial.user_attrs.get(ROLE_ATTR) == PRODUCTION
        self._refuse_excess(trial, production)
        if production:
            ctx.space.suggest(trial)  # record the production values as this trial's params
            settings = ctx.space.production_settings
        else:
            settings = ctx.space.suggest(trial)
        # The production settings drawn again (nothing else left to draw) replay as trial 0 did:
        # the simulator is deterministic, so its windows' metrics are the baseline's.
        baseline = production or settings.to_dict() == ctx.space.production_settings.to_dict()
        single = not ctx.spec.multi_objective
        obj_name = ctx.objectives[0][0]
        per_window: dict[int, dict[str, float]] = {}
        pruned_after = None
        for i in ctx.search:
            m = ctx.baseline[i] if baseline else ctx.run(settings, i)
            per_window[i] = m
            if single:
                v = m[obj_name]
                if math.isfinite(v):
                    trial.report(v, i)
                    if (
                        not production
                        and len(per_window) < len(ctx.search)
                        and trial.should_prune()
                    ):
                        pruned_after = len(per_window)
                        break
        for key, value in ctx.constraint_values(per_window).items():
            trial.set_constraint(key, value)
        run = list(per_window)
        trial.set_user_attr(
            TRIAL_ATTR,
            {
                "settings": settings.to_dict(),
                "windows": run,
                "metrics": {
                    n: [finite_or_none(per_window[i][n]) for i in run] for n in ctx.tracked
                },
                "pruned_after": pruned_after,
            },
        )
        values = ctx.objective_values(per_window)
        return values[0] if single else values

    def _refuse_excess(self, trial: optuna.Trial, production: bool) -> None:
        """ExcessTrial when this is a second production trial, or another trial while the study
        already holds ``n_trials`` earlier complete-or-running trials.

        Checked on every trial, not only near the end: the worker loop's counts are read before
        the trial has its number, and workers that read them at the same moment each saw the
        same free slots (with more workers than free slots, the study ended with more than
        ``n_trials`` complete trials). Only the trial's number orders the workers, so the check
        is exact only here; it reads the trials the loop's count reads anyway."""
        earlier = [
            t
            for t in trial.study.get_trials(
                deepcopy=False, states=(TrialState.COMPLETE, TrialState.RUNNING)
            )
            if t.number < trial.number
        ]
        if production:
            # Trial 0 is the study's reference whatever the count (a resumed study whose first
            # production trial failed runs it again); only a second one is refused.
            if any(t.user_attrs.get(ROLE_ATTR) == PRODUCTION for t in earlier):
                self._refuse(trial, "a production trial already ran")
        elif len(earlier) >= self.n_trials:
            self._refuse(trial, f"{self.n_trials} trials already complete or running")

    def _refuse(self, trial: optuna.Trial, why: str) -> None:
        """End ``trial`` as FAIL (user attr ``excess``) without running it, quietly."""
        self.excess.add(trial.number)
        trial.set_user_attr("excess", True)
        raise ExcessTrial(f"trial {trial.number}: {why}")


def _counts(study: optuna.Study) -> tuple[int, int]:
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


def fail_dead_local_trials(study: optuna.Study) -> list[int]:
    """Mark FAIL the RUNNING trials whose worker ran on this host and has exited (what heartbeats
    do on an RDB storage; a journal has none). Trials of other hosts are left alone: their
    liveness cannot be seen from here. Returns the failed trials' numbers."""
    host, failed = socket.gethostname(), []
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        owner_host, _, pid = str(t.user_attrs.get(OWNER_ATTR, "")).rpartition(":")
        if owner_host == host and pid.isdigit() and not _alive(int(pid)):
            try:
                study.tell(t.number, state=TrialState.FAIL)
            except (
                RuntimeError,
                ValueError,
            ):  # finished meanwhile (another worker got there first)
                continue
            failed.append(t.number)
    return failed


def _finished(study: optuna.Study) -> int:
    return len(
        study.get_trials(
            deepcopy=False, states=(TrialState.COMPLETE, TrialState.FAIL, TrialState.PRUNED)
        )
    )


def _run_waiting_production(
    storage: BaseStorage, name: str, study: optuna.Study, objective: Objective
) -> int:
    """Pop and run the waiting production trial, if any, under the setup lock (it takes no time:
    its metrics are the baseline), so no two workers pop it. Returns the trials run (0 or 1)."""
    with setup_lock(storage, name):
        if not any(
            t.user_attrs.get(ROLE_ATTR) == PRODUCTION
            for t in study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
        ):
            return 0
        study.optimize(objective, n_trials=1, catch=(ExcessTrial,))
        return 0 if objective.excess else 1


def run_worker(
    storage: BaseStorage,
    name: str,
    ctx: TuneContext,
    n_trials: int,
    *,
    worker: int = 0,
    progress: Callable[[int, int], None] | None = None,
    poll_s: float = 0.5,
    should_stop: Callable[[], bool] | None = None,
) -> int:
    """Run trials of study ``name`` until it has ``n_trials`` complete ones (or ``should_stop()``);
    returns how many this worker ran. KeyboardInterrupt propagates (the running trial is marked
    FAIL, without Optuna's warnings about it). ``worker``: the index of a local worker process
    (its stream's offset)."""
    quiet_optuna()
    study = load_study(
        storage, name, sampler=_worker_sampler(storage, name, ctx, worker), pruner=make_pruner(ctx)
    )
    objective = Objective(ctx, n_trials)
    trial_log, quiet = logging.getLogger(OPTUNA_TRIAL_LOG), objective.quiet_interrupted
    trial_log.addFilter(quiet)
    try:
        done = _run_waiting_production(storage, name, study, objective)
        while True:
            complete, running = _counts(study)
            if progress:
                progress(complete, n_trials)
            if complete >= n_trials or (should_stop is not None and should_stop()):
                return done
            remaining = n_trials - complete - running
            if remaining <= 0:
                _fail_dead_trials(storage, study)
                time.sleep(poll_s)
                continue
            refused = len(objective.excess)
            study.optimize(objective, n_trials=1, catch=(ExcessTrial,))
            if len(objective.excess) == refused:  # a refused trial ran nothing
                done += 1
    finally:
        trial_log.removeFilter(quiet)


def _worker_sampler(
    storage: BaseStorage, name: str, ctx: TuneContext, worker: int
) -> StreamSampler:
    """This worker's sampler (module docstring, "Sampler streams"), from where the study stands
    now (a journal's dead local workers' trials failed first)."""
    probe = load_study(storage, name)
    if isinstance(storage, optuna.storages.JournalStorage):
        fail_dead_local_trials(probe)
    trials = probe.get_trials(deepcopy=False)
    waiting = [t.number for t in trials if t.state == TrialState.WAITING]
    alone = not any(t.state == TrialState.RUNNING for t in trials)
    expected = (min(waiting) if waiting else len(trials)) if alone else None
    process_seed = ctx.spec.seed + 1_000_003 * worker + _finished(probe)
    return stream_sampler(ctx, ctx.spec.seed, process_seed, expected)


def _fail_dead_trials(storage: BaseStorage, study: optuna.Study) -> None:
    """Fail the trials of dead workers: stale heartbeats (RDB), or dead local processes (a journal
    has no heartbeats)."""
    if isinstance(storage, optuna.storages.JournalStorage):
        fail_dead_local_trials(study)
    else:
        optuna.storages.fail_stale_trials(study)


def exit_quietly_on_interrupt() -> list[int]:
    """Make Ctrl-C end this (worker) process with status 130 and nothing printed; the list the
    SIGINT handler appends to, for the caller's ``except`` to tell an interrupt from an error.

    The handler raises KeyboardInterrupt, so that Optuna marks the running trial failed on its
    way out. Python runs the handler between any two bytecodes, also inside a weakref or garbage
    collector callback (SQLAlchemy's registry has some), where an exception cannot propagate:
    Python prints it as "Exception ignored in ..." with a traceback and goes on, the interrupt
    lost. The unraisable hook ends the process there instead, as the interrupt would have.
    """
    interrupted: list[int] = []

    def on_sigint(signum: int, frame: FrameType | None) -> None:
        interrupted.append(signum)
        raise KeyboardInterrupt

    def on_unraisable(unraisable: sys.UnraisableHookArgs) -> None:
        if interrupted and isinstance(unraisable.exc_value, KeyboardInterrupt):
            os._exit(130)
        sys.__unraisablehook__(unraisable)

    signal.signal(signal.SIGINT, on_sigint)
    sys.unraisablehook = on_unraisable
    return interrupted


def _worker_entry(url: str, name: str, n_trials: int, worker: int, parent: int) -> None:
    """A spawned worker process: rebuild the context from the stored definition and optimize;
    stop after the current trial if the parent process is gone. Ctrl-C (or the parent's SIGINT)
    ends it with status 130 and nothing printed, also when the interrupt surfaces as another
    exception (it can land inside Optuna's bookkeeping of a trial): the parent reports it."""
    interrupted = exit_quietly_on_interrupt()
    try:
        storage = open_storage(url)
        _, ctx = load_context(storage, name, enqueue=True)
        run_worker(
            storage, name, ctx, n_trials, worker=worker, should_stop=lambda: os.getppid() != parent
        )
    except BaseException:
        if interrupted:
            os._exit(130)
        raise


@dataclass
class TuneOutcome:
    study: str
    storage: str
    complete: int
    requested: int
    interrupted: bool
    best: dict[str, Any] | None


def tune(
    url: str,
    name: str,
    n_trials: int,
    *,
    spec: StudySpec | None = None,
    given: Mapping[str, Any] | None = None,
    workers: int = 1,
    progress: Callable[[int, int], None] | None = None,
    log: Callable[[str], None] | None = None,
) -> TuneOutcome:
    """Create or resume study ``name`` at storage ``url`` and run it to ``n_trials`` complete
    trials.

    ``workers > 1`` spawns that many local processes on the same storage (use a server database
    for many workers; SQLite serialises writers). Ctrl-C stops cleanly: the study keeps its
    complete trials and the same call resumes it.
    """
    if n_trials < 1:
        raise TuneError(f"--trials {n_trials}: must be >= 1")
    if workers < 1:
        raise TuneError(f"--workers {workers}: must be >= 1")
    check_study_name(name)
    log = log or (lambda _m: None)
    # A new study's definition is checked whole (traces read, windows cut, baseline replayed)
    # before a storage file is opened, which creates it: a refused definition leaves none behind.
    storage = open_storage(url) if storage_exists(url) else None
    new_study = spec is not None and (storage is None or not study_exists(storage, name))
    prepared = draft(spec, log) if new_study and spec is not None else None
    storage = storage or open_storage(url)
    ctx = prepare(storage, name, spec, given, log, drafted=prepared)
    log(
        f"study {name}: {len(ctx.windows)} windows of {ctx.spec.window_s:g} s, search on "
        f"{len(ctx.search)} {ctx.search}, held out {ctx.holdout}"
    )
    interrupted = False
    try:
        if workers == 1:
            run_worker(storage, name, ctx, n_trials, progress=progress)
        else:
            _run_processes(url, name, n_trials, workers, storage, progress)
    except KeyboardInterrupt:
        interrupted = True
    study = load_study(storage, name)
    complete, _ = _counts(study)
    return TuneOutcome(name, redact(url), complete, n_trials, interrupted, best_summary(study, ctx))


def _run_processes(
    url: str,
    name: str,
    n_trials: int,
    workers: int,
    storage: BaseStorage,
    progress: Callable[[int, int], None] | None,
) -> None:
    mp = multiprocessing.get_context("spawn")
    procs = [
        mp.Process(
            target=_worker_entry,
            args=(url, name, n_trials, k, os.getpid()),
            name=f"tailpilot-tune-{k}",
        )
        for k in range(workers)
    ]
    for p in procs:
        p.start()
    study = load_study(storage, name)
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
        raise TuneError(
            f"{len(failed)} worker process(es) failed (exit codes "
            f"{', '.join(str(p.exitcode) for p in failed)})"
        )

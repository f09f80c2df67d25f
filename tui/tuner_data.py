"""What the tuner panel shows, read from an Optuna storage (blocking: call from a worker thread).

Plain dataclasses out, so the render functions (``tui.tuner_render``) stay pure and testable. The
feasible front and the best trial come from :func:`tuner.studies.results.best_trials` (the same rule
``tailpilot recommend`` uses); the recommendation from the tailpilot store
(``TunerResults.latest_recommendation``) when one was stored, else
:func:`tuner.studies.recommend.recommend`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, TypeGuard

from scheduler.settings import Settings
from scheduler.validation import finite_or_none
from tuner.studies import optuna_storage
from tuner.studies import study as st
from tuner.studies.optuna_storage import storage_url
from tuner.studies.results import best_trials, is_feasible
from tuner.studies.spec import DEFAULT_STORAGE_FILE, TuneError

if TYPE_CHECKING:  # annotations only: optuna itself is imported where a storage is read
    import optuna
    from optuna.storages import BaseStorage
    from optuna.trial import FrozenTrial

    from storage.store import Store


@dataclass(frozen=True)
class TrialInfo:
    number: int
    state: str  # "complete", "pruned@2" (pruned after 2 windows), "fail", "running", "waiting"
    values: tuple[float, ...] | None
    feasible: bool
    candidate: bool  # complete, feasible, fully evaluated: may be recommended
    production: bool
    # Optuna's params (policy, uniboost.gamma, ...)
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StudyInfo:
    name: str
    policies: tuple[str, ...]
    objectives: tuple[tuple[str, str], ...]  # (metric, "minimize" | "maximize")
    constraints: tuple[str, ...]
    complete: int
    pruned: int
    failed: int
    running: int
    front: tuple[int, ...]  # trial numbers: the best (one objective) or the feasible Pareto front
    best_values: tuple[float, ...] | None  # one objective: the best trial's value
    tailpilot: bool = True  # created by tailpilot tune (has its definition)


@dataclass(frozen=True)
class StudyDetail:
    info: StudyInfo
    trials: tuple[TrialInfo, ...]


@dataclass(frozen=True)
class RecInfo:
    """A recommendation and where it came from."""

    summary: dict[str, Any] | None
    source: str  # "stored" | "computed" | "none"
    stored_id: int | None = None
    created_ms: int | None = None
    error: str | None = None


# ------------------------------------------------------------------------------------ storage


def resolve_storage(raw: str | None, cwd: Path | None = None) -> tuple[str | None, str | None]:
    """(URL, None) to open, or (None, why not): the default ``tailpilot-optuna.db`` only when it
    exists; a path that does not exist is not created (opening would create an empty storage)."""
    cwd = cwd or Path.cwd()
    if raw in (None, ""):
        path = cwd / DEFAULT_STORAGE_FILE
        if not path.exists():
            return None, (
                f"no Optuna storage: ./{DEFAULT_STORAGE_FILE} does not exist here.\n"
                "Create a study with e.g.\n"
                "  tailpilot tune --study conv-ub --policy uniboost --objective ttlt_p99 "
                "--trials 50\n"
                "or point the TUI at a storage with --storage URL."
            )
        return storage_url(str(path)), None
    if "://" not in raw and not Path(raw).exists():
        return (
            None,
            f"no Optuna storage at {raw}: no such file "
            f"(create it with tailpilot tune --storage {raw})",
        )
    return storage_url(raw), None


def open_storage(url: str) -> BaseStorage:
    return optuna_storage.open_storage(url)


# ------------------------------------------------------------------------------------ studies


def _objectives(study: optuna.Study) -> tuple[tuple[str, str], ...]:
    spec = study.user_attrs.get(st.ATTR_SPEC) or {}
    names = list(spec.get("objectives") or [])
    dirs = ["minimize" if d.name == "MINIMIZE" else "maximize" for d in study.directions]
    if len(names) != len(dirs):
        names = [f"objective {i}" for i in range(len(dirs))]
    return tuple(zip(names, dirs))


def _trial_info(t: FrozenTrial) -> TrialInfo:
    from optuna.trial import TrialState  # start-up cost: see list_studies

    info = t.user_attrs.get(st.TRIAL_ATTR) or {}
    pruned_after = info.get("pruned_after")
    if t.state == TrialState.COMPLETE:
        state = "complete" if pruned_after is None else f"pruned@{pruned_after}"
    elif t.state == TrialState.PRUNED:
        state = "pruned"
    else:
        state = t.state.name.lower()
    feasible = is_feasible(t) if t.state == TrialState.COMPLETE else False
    candidate = (
        t.state == TrialState.COMPLETE and pruned_after is None and "settings" in info and feasible
    )
    values = tuple(float(v) for v in t.values) if t.values is not None else None
    return TrialInfo(
        t.number,
        state,
        values,
        feasible,
        candidate,
        t.user_attrs.get(st.ROLE_ATTR) == st.PRODUCTION,
        dict(t.params),
    )


def study_info(study: optuna.Study, trials: Sequence[FrozenTrial] | None = None) -> StudyInfo:
    """One study's row: definition, trial counts, best trial(s) (feasible, fully evaluated)."""
    from optuna.trial import TrialState  # start-up cost: see list_studies

    trials = study.get_trials(deepcopy=False) if trials is None else trials
    spec = study.user_attrs.get(st.ATTR_SPEC) or {}
    objectives = _objectives(study)
    complete = pruned = failed = running = 0
    for t in trials:
        pa = (t.user_attrs.get(st.TRIAL_ATTR) or {}).get("pruned_after")
        if t.state == TrialState.COMPLETE and pa is None:
            complete += 1
        elif t.state == TrialState.PRUNED or (t.state == TrialState.COMPLETE and pa is not None):
            pruned += 1
        elif t.state == TrialState.FAIL:
            failed += 1
        elif t.state in (TrialState.RUNNING, TrialState.WAITING):
            running += 1
    stand_in = SimpleNamespace(objectives=list(objectives))
    front = best_trials(study, stand_in) if objectives else []  # type: ignore[arg-type]  # reads only .objectives
    best = (
        tuple(float(v) for v in front[0].values)
        if len(front) == 1 and len(objectives) == 1
        else None
    )
    return StudyInfo(
        study.study_name,
        tuple(spec.get("policies") or ()),
        objectives,
        tuple(spec.get("constraints") or ()),
        complete,
        pruned,
        failed,
        running,
        tuple(t.number for t in front),
        best,
        tailpilot=bool(spec),
    )


def list_studies(storage: BaseStorage) -> list[StudyInfo]:
    """Every study in the storage, by name."""
    # Imported when the tuner panel first reads a storage, not with the TUI (measured start-up
    # cost: optuna and tuner.studies.recommend add ~0.2 s to the TUI's ~1.5 s).
    import optuna

    out = []
    for s in sorted(
        optuna.get_all_study_summaries(storage, include_best_trial=False),
        key=lambda s: s.study_name,
    ):
        study = optuna.load_study(study_name=s.study_name, storage=storage)
        out.append(study_info(study))
    return out


def study_detail(storage: BaseStorage, name: str) -> StudyDetail:
    import optuna  # start-up cost: see list_studies

    study = optuna.load_study(study_name=name, storage=storage)
    trials = study.get_trials(deepcopy=False)
    return StudyDetail(
        study_info(study, trials),
        tuple(_trial_info(t) for t in sorted(trials, key=lambda t: t.number)),
    )


# ----------------------------------------------------------------------------- recommendation


def load_recommendation(storage: BaseStorage, name: str, store: Store | None = None) -> RecInfo:
    """The stored recommendation of ``name`` (newest) if the store has one, else computed with
    :func:`tuner.studies.recommend.recommend` (replays the held-out windows: seconds to minutes)."""
    from tuner.studies.recommend import jsonable, recommend  # start-up cost: see list_studies

    if store is not None:
        try:
            rec = store.tuner.latest_recommendation(name)
        except Exception:
            rec = None
        if rec is not None:
            summary = dict(rec.summary or {})
            summary.setdefault("settings", rec.settings)
            summary["settings"] = rec.settings
            return RecInfo(summary, "stored", rec.id, rec.created_ms)
    try:
        return RecInfo(
            jsonable(recommend(storage, name)), "computed", created_ms=int(time.time() * 1000)
        )
    except TuneError as err:
        return RecInfo(None, "none", error=str(err))


def recommended_settings(rec: RecInfo | None) -> Settings | None:
    if rec is None or rec.summary is None or not rec.summary.get("settings"):
        return None
    return Settings.model_validate(rec.summary["settings"])


def finite(v: Any) -> TypeGuard[float]:
    """Whether ``v`` is a finite number (:func:`scheduler.validation.finite_or_none`'s rule)."""
    return finite_or_none(v) is not None

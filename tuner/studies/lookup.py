"""A study found by its name in a storage: loaded (or created with a definition's directions),
whether it exists, which studies a storage holds, and the message when it is missing — which
studies are there (a typo shows) and how to create this one. Every command that takes
``--study`` goes through here, so a name is checked once and a missing study reads the same
everywhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from tuner.studies.optuna_storage import open_storage, redact, storage_exists, url_of
from tuner.studies.spec import StudySpec, TuneError

# Optuna is imported inside the functions that use it (start-up cost: tuner.studies.study).
if TYPE_CHECKING:
    from optuna import Study
    from optuna.pruners import BasePruner
    from optuna.samplers import BaseSampler
    from optuna.storages import BaseStorage


def load_study(
    storage: BaseStorage,
    name: str,
    spec: StudySpec | None = None,
    sampler: BaseSampler | None = None,
    pruner: BasePruner | None = None,
) -> Study:
    """Optuna's study ``name``: created (or joined) with ``spec``'s directions, else loaded
    (:class:`TuneError` when there is none)."""
    import optuna  # start-up cost: see the note above TYPE_CHECKING

    check_study_name(name)
    if spec is not None:
        directions = [d for _, d in spec.objective_dirs()]
        return optuna.create_study(
            storage=storage,
            study_name=name,
            directions=directions,
            sampler=sampler,
            pruner=pruner,
            load_if_exists=True,
        )
    try:
        return optuna.load_study(study_name=name, storage=storage, sampler=sampler, pruner=pruner)
    except KeyError:
        raise TuneError(no_such_study(storage, name)) from None


def check_study_name(name: str) -> None:
    """Refuse a study name that is not text (bytes that are not UTF-8 reach Python as lone
    surrogates, which no storage can encode: SQLAlchemy raised UnicodeEncodeError mid-query)."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raw = name.encode("utf-8", "surrogateescape")
        raise TuneError(
            f"--study {raw!r}: not UTF-8 text; a study name is stored as text: use letters, "
            "digits, '-' and '_'"
        ) from None


def study_names(storage: BaseStorage) -> list[str]:
    """The names of the studies ``storage`` holds, sorted."""
    return sorted(s.study_name for s in storage.get_all_studies())


MAX_NAMES_SHOWN = 20  # a storage shared by a team may hold hundreds of studies


def no_such_study(storage: BaseStorage, name: str) -> str:
    """The message for study ``name`` missing from ``storage``: which studies it does hold (a
    typo shows) and how to create this one."""
    return _missing(redact(url_of(storage)) or "this storage", name, study_names(storage))


def missing_study_message(url: str, name: str) -> str | None:
    """Why study ``name`` is not in the storage at ``url`` (``optuna_storage.storage_url``'s form)
    — the studies it holds and how to create this one — or None when it is there. A storage file
    that does not exist is not created. For commands that read a study's results from elsewhere
    (``tailpilot export --study`` reads tailpilot's database) to tell "no such study" apart from
    "not recommended yet"."""
    check_study_name(name)
    if not storage_exists(url):
        return _missing(redact(url), name, [], missing_file=True)
    storage = open_storage(url)
    if study_exists(storage, name):
        return None
    return no_such_study(storage, name)


def _missing(where: str, name: str, names: Sequence[str], *, missing_file: bool = False) -> str:
    if missing_file:
        held = "the storage does not exist yet"
    elif not names:
        held = "it holds no study"
    else:
        shown = ", ".join(names[:MAX_NAMES_SHOWN])
        more = len(names) - MAX_NAMES_SHOWN
        held = f"studies there: {shown}" + (f" and {more} more" if more > 0 else "")
    return (
        f"--study {name}: no such study in {where} ({held}); create it with `tailpilot tune "
        f"--study {name} --policy POLICY --objective METRIC` (and the same --storage)"
    )


def study_exists(storage: BaseStorage, name: str) -> bool:
    import optuna  # start-up cost: see the note above TYPE_CHECKING

    check_study_name(name)
    try:
        storage.get_study_id_from_name(name)
        return True
    except KeyError:
        return False
    except optuna.exceptions.StorageInternalError:
        return False

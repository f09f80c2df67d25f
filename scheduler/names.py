"""Tenant and request-type names: their bound, their defaults, the cap of names kept apart per
window and the fold of the rest — one owner for the engine, the control API, the recorder and the
page (no project imports: every floor may use it, ``tests/test_layers.py``).

Names come from clients and from documents and end up in ``/state``, in the recorder's database
and on the TUI. The engine validates and cleans them (``scheduler.settings.name_problem``,
``clean_name``); the recorder folds any past the bound, and past its cap of names per window,
into "other" (:func:`fold_name`) — the same bound, so a name the engine governs by is
always recorded and shown by that name.
"""

from __future__ import annotations

from collections.abc import Collection

#: The longest tenant or type name (characters); the type column's width in the store.
NAME_MAX_CHARS = 100
#: The tenant of a request whose client names none.
DEFAULT_TENANT = "default"
#: A request that names no type is a chat request — in the engine, the simulator's traces, the
#: control API's documents and the collector's rows alike.
DEFAULT_TYPE = "chat"
#: The request types the engine knows (a client's ``type``); any other is served as chat.
REQUEST_TYPES: frozenset[str] = frozenset({"chat", "completion", "reasoning", "batch", "embed"})


def request_type(name: str) -> str:
    """The type a request is served and replayed as: ``name`` if the engine knows it, else
    :data:`DEFAULT_TYPE` — the plugin's rule for what a client sends, and the autopilot's for
    what a replica reports."""
    return name if name in REQUEST_TYPES else DEFAULT_TYPE


# A tenant or request-type name longer than NAME_MAX_CHARS (the engine's bound too) is folded
# into OTHER_GROUP (storage.limits.group_name). Real names are short identifiers (an API key's
# owner, "chat"); 100 is the type column's width (TYPE_CHARS; the tenant column's is 200), so a
# name that fits fits every column and label it is written to.
#: Distinct tenant (and, separately, type) names one replica's window keeps apart; completions of
#: any further name count under OTHER_GROUP. It is the Prometheus page's tenant cap too: the figures
#: per group are one row per group per poll in the store, so a client sending a new name on every
#: request must not multiply the rows (or the series) with them.
MAX_GROUPS_PER_WINDOW = 100
#: The group that holds everything beyond those bounds (a legitimate tenant named "other" shares
#: it).
OTHER_GROUP = "other"


def fold_name(
    name: str,
    kept: Collection[str],
    declared: Collection[str] = (),
    cap: int = MAX_GROUPS_PER_WINDOW,
) -> str:
    """The group a (valid) tenant or type name counts under, given the names already ``kept``
    apart: its own when kept already or ``declared`` (the cluster file's tenants and types: always
    kept apart, never counted against the cap), or while fewer than ``cap`` undeclared names are
    kept; else :data:`OTHER_GROUP`. The one rule of the window, the /state counts and the page."""
    if name in kept or name in declared:
        return name
    small, large = (kept, declared) if len(kept) <= len(declared) else (declared, kept)
    undeclared = len(kept) - (OTHER_GROUP in kept) - sum(1 for d in small if d in large)
    return name if undeclared < cap else OTHER_GROUP


__all__ = [
    "DEFAULT_TENANT",
    "DEFAULT_TYPE",
    "MAX_GROUPS_PER_WINDOW",
    "NAME_MAX_CHARS",
    "OTHER_GROUP",
    "REQUEST_TYPES",
    "fold_name",
    "request_type",
]

"""Tenant and request-type names: their bound and defaults, one owner for the engine, the control
API, the recorder and the page (no imports: every floor may use it, ``tests/test_layers.py``).

Names come from clients and from documents and end up in ``/state``, in the recorder's database
and on the TUI. The engine validates and cleans them (``scheduler.settings.name_problem``,
``clean_name``); the recorder folds any past the bound, and past its cap of names per window,
into "other" (``storage.limits.fold_name``) — the same bound, so a name the engine governs by is
always recorded and shown by that name.
"""

#: The longest tenant or type name (characters); the type column's width in the store.
NAME_MAX_CHARS = 100
#: The tenant of a request whose client names none.
DEFAULT_TENANT = "default"
#: A request that names no type is a chat request — in the engine, the simulator's traces, the
#: control API's documents and the collector's rows alike.
DEFAULT_TYPE = "chat"

__all__ = ["DEFAULT_TENANT", "DEFAULT_TYPE", "NAME_MAX_CHARS"]

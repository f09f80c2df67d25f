"""The scheduler: what runs inside vLLM's process, and the library the simulator shares with it.

- ``scheduler.policies`` — the policy library (uniboost, TIE, slofq, sarathi, …) over one queue;
- ``scheduler.settings`` — the settings model every layer reads and writes, and
  ``scheduler.settings_change`` — a change of it, the one path every change takes;
- ``scheduler.names`` — the bound and defaults of tenant and type names (engine and recorder);
- ``scheduler.contract`` / ``scheduler.validation`` — the control API's typed documents;
- ``scheduler.metrics`` — completions, summaries and percentiles (the metric core);
- ``scheduler.plugin`` — the vLLM scheduler subclass and its control API server.

Nothing here imports the operator side (``controlplane``, ``storage``, ``tuner``, ``tui``, the
CLI) or the simulator; the base install (numpy, scipy, pydantic, mypy_extensions) is all it
needs. ``scheduler.compiled`` checks, before any policy module loads, that an optional compiled
core was built from the sources beside it.
"""

from scheduler.compiled import check as _check_compiled_core

_check_compiled_core()  # a compiled core built from other sources would run old code silently

# The rooms other floors may use (tests/test_layers.py: an import from another floor names one).
__all__ = [
    "compiled",
    "contract",
    "errors",
    "metrics",
    "names",
    "plugin",
    "policies",
    "settings",
    "settings_change",
    "validation",
]

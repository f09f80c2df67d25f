"""The one base of every error tailpilot raises on purpose, and what the command line answers it
with.

Each module keeps its own error classes (a trace's ``TraceError``, the store's ``StoreError``, the
tuner's ``TuneError``, ...) — each derives from :class:`TailpilotError` and keeps the builtin it
always was (``ValueError``, ``RuntimeError``, ...) so existing ``except`` clauses still hold. The
command line (``tailpilot.cli``) ends a command that lets one through with a one-line message and
its ``exit_code`` (docs/cli.md, "Exit status"): 2 bad input (the default), 1 something outside
tailpilot refused or failed — a replica, a database. This module imports nothing: every floor may
use it, ``storage`` included (``tests/test_layers.py``).
"""

from __future__ import annotations

__all__ = ["FAILED", "INPUT", "TailpilotError"]

INPUT = 2  # bad input: a file, an option, a definition that cannot be used
FAILED = 1  # a replica refused or could not be reached, a database refused, nothing to do it with


class TailpilotError(Exception):
    """Every error tailpilot raises on purpose; ``exit_code`` is the command line's status."""

    exit_code: int = INPUT

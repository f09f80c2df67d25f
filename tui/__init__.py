"""tailpilot's operator TUI (Textual). ``run_tui`` is what ``tailpilot tui`` and ``tailpilot demo``
call; see :mod:`tui.main`."""

from __future__ import annotations

from typing import Any


def run_tui(cluster: Any = None, **kw: Any) -> None:
    """Run the TUI until the operator quits; see :func:`tui.main.run_tui` for the options."""
    from tui.main import run_tui as _run

    _run(cluster, **kw)


__all__ = ["run_tui"]

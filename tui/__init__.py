"""tailpilot's operator TUI (Textual). ``run_tui`` is what ``tailpilot tui`` and ``tailpilot demo``
call; see :mod:`tui.main`."""

from __future__ import annotations

from tui.main import run_tui

__all__ = ["run_tui"]

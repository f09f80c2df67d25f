"""The autopilot block of the alerts panel: its state, why it holds, per replica the candidate it
runs and why, and its last decisions (``autopilot_render``). Hidden where there is no control row
to show (replay, a live view without a store)."""

from __future__ import annotations

from typing import Any

from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Static

from tui import autopilot_render as AR


class AutopilotPanel(VerticalScroll):
    """Scrolls when a large cluster's lines do not fit (its height is capped in app.tcss)."""

    def compose(self) -> ComposeResult:
        yield Static("", id="autopilot-body")

    def update_from(self, control: dict[str, Any] | None, now_ms: int | None = None) -> None:
        """Show ``control`` (``Store.autopilot_control``'s row) as of ``now_ms``; None hides the block."""
        self.set_class(control is not None, "-shown")
        self.query_one("#autopilot-body", Static).update(AR.autopilot_renderable(control, now_ms))

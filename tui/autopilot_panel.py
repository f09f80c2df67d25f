"""The autopilot block of the alerts panel: its state, why it holds, per replica the candidate it
runs and why, and its last decisions (``autopilot_render``). Hidden where there is no control row
to show (replay, a live view without a store). It shows its reactive ``data``, set by the alerts
panel."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.reactive import var
from textual.widgets import Static

from tui import autopilot_render as AR


@dataclass(frozen=True)
class AutopilotData:
    """The autopilot's control row (``GovernanceRepository.control("autopilot")``; None: none)
    as of ``now_ms``."""

    control: Mapping[str, Any] | None
    now_ms: int | None = None


class AutopilotPanel(VerticalScroll):
    """Scrolls when a large cluster's lines do not fit (its height is capped in app.tcss)."""

    data: var[AutopilotData | None] = var(None, init=False, always_update=True)
    """What the block shows; a None control row hides it."""

    def compose(self) -> ComposeResult:
        yield Static("", id="autopilot-body")

    def watch_data(self, data: AutopilotData | None) -> None:
        if data is None:
            return
        self.set_class(data.control is not None, "-shown")
        self.query_one("#autopilot-body", Static).update(
            AR.autopilot_renderable(data.control, data.now_ms)
        )

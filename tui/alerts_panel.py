"""The alerts panel: the cluster's governance figures per tenant and type, the governor and the
autopilot (the cluster's automatic controllers), and the alert history. It shows its reactive
``data``, set by the app."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.reactive import var
from textual.widgets import DataTable, Static

from tui.alerts_render import (
    ALERT_EVENT_COLUMNS,
    GOVERNANCE_COLUMNS,
    alert_event_row,
    governance_rows,
    governance_summary,
    governor_line,
)
from tui.autopilot_panel import AutopilotData, AutopilotPanel
from tui.widgets import AutoSizedTable, fill_table


@dataclass(frozen=True)
class AlertsData:
    """The window's governance figures, the alert history and the two control rows (None: not
    known here; the autopilot's block is then hidden) as of ``now_ms``."""

    governance: Mapping[str, Any] | None
    events: Sequence[Mapping[str, Any]]
    governor: Mapping[str, Any] | None = None
    autopilot: Mapping[str, Any] | None = None
    now_ms: int | None = None


class AlertsPanel(Vertical):
    data: var[AlertsData | None] = var(None, init=False, always_update=True)
    """What the panel shows; every one re-renders."""

    def compose(self) -> ComposeResult:
        yield Static(Text("governance", style="bold"), id="alerts-title", classes="title")
        yield Static("", id="alerts-figures")
        yield Static("", id="alerts-governor")
        yield AutopilotPanel(id="alerts-autopilot")
        yield AutoSizedTable(id="alerts-tenants", cursor_type="row", zebra_stripes=True)
        yield Static(Text("alert history (newest first)", style="bold"), classes="title")
        yield AutoSizedTable(id="alerts-history", cursor_type="row", zebra_stripes=True)

    def on_mount(self) -> None:
        t = self.query_one("#alerts-tenants", DataTable)
        for key, label, width in GOVERNANCE_COLUMNS:
            t.add_column(label, key=key, width=width)
        h = self.query_one("#alerts-history", DataTable)
        for key, label, width in ALERT_EVENT_COLUMNS:
            h.add_column(label, key=key, width=width)

    def watch_data(self, data: AlertsData | None) -> None:
        if data is None:
            return
        self.query_one("#alerts-figures", Static).update(governance_summary(data.governance))
        self.query_one("#alerts-governor", Static).update(governor_line(data.governor))
        self.query_one(AutopilotPanel).data = AutopilotData(data.autopilot, data.now_ms)
        fill_table(self.query_one("#alerts-tenants", DataTable), governance_rows(data.governance))
        fill_table(
            self.query_one("#alerts-history", DataTable),
            [alert_event_row(e) for e in data.events],
        )

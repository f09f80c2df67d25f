"""The audit panel: every settings change, who made it and what came of it.

It shows its reactive ``data`` (the audit log and the changes' verifications), set by the app.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.reactive import var
from textual.widgets import (
    DataTable,
    Static,
)

from tui import render as R
from tui.widgets import AutoSizedTable, fill_table


@dataclass(frozen=True)
class AuditData:
    """The settings audit log as the audit panel shows it."""

    rows: Sequence[Mapping[str, Any]]  # newest first (``SettingsLog.settings_changes``' dicts)
    note: str | None = None  # said beside the title (where the log is partial)
    # (replica, settings version) -> the change's verification: predicted and realized P95 TTFT.
    verifications: Mapping[tuple[Any, Any], Mapping[str, Any]] = field(default_factory=dict)


class AuditPanel(Vertical):
    data: var[AuditData | None] = var(None, init=False, always_update=True)
    """What the panel shows; every one re-renders."""

    def compose(self) -> ComposeResult:
        yield Static(
            Text("settings audit log (newest first)", style="bold"),
            id="audit-title",
            classes="title",
        )
        yield AutoSizedTable(id="audit-table", cursor_type="row", zebra_stripes=True)

    def on_mount(self) -> None:
        t = self.query_one(DataTable)
        t.add_column("time (UTC)", key="t", width=19)
        t.add_column("replica", key="replica", width=12)
        t.add_column("who", key="who", width=12)
        t.add_column("result", key="result", width=8)
        t.add_column("ver", key="version", width=4)
        t.add_column("change", key="change", width=50)
        t.add_column("P95 TTFT predicted → realized", key="verified", width=30)
        t.add_column("message", key="message")

    def watch_data(self, data: AuditData | None) -> None:
        if data is None:
            return
        verifications = data.verifications
        fill_table(
            self.query_one(DataTable),
            [
                R.audit_row(
                    a,
                    verifications.get((a.get("replica"), a.get("version")))
                    if a.get("result") in ("applied", "staged")
                    else None,
                )
                for a in data.rows
            ],
        )
        title = Text("settings audit log (newest first)", style="bold")
        title.append(f" · {len(data.rows)} entries")
        if data.note:
            title.append(f" · {data.note}", style="yellow")
        self.query_one("#audit-title", Static).update(title)

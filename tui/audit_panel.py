"""The audit panel: every settings change, who made it and what came of it."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import (
    DataTable,
    Static,
)

from tui import render as R
from tui.widgets import AutoSizedTable, fill_table


class AuditPanel(Vertical):
    def compose(self) -> ComposeResult:
        yield Static(Text("settings audit log (newest first)", style="bold"), id="audit-title", classes="title")
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

    def update_from(self, rows: list[dict[str, Any]], note: str | None = None,
                    verifications: dict[tuple[Any, Any], dict[str, Any]] | None = None) -> None:
        verifications = verifications or {}
        fill_table(self.query_one(DataTable),
                   [R.audit_row(a, verifications.get((a.get("replica"), a.get("version")))
                                if a.get("result") in ("applied", "staged") else None) for a in rows])
        title = Text("settings audit log (newest first)", style="bold")
        title.append(f" · {len(rows)} entries")
        if note:
            title.append(f" · {note}", style="yellow")
        self.query_one("#audit-title", Static).update(title)

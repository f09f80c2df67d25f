"""The cluster panel: one row per replica, sortable and filterable, with totals."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.widgets import (
    Input,
    Static,
)

from controlplane.collector import ClusterSnapshot, ReplicaSnapshot
from tui import render as R
from tui.widgets import ClusterTable

if TYPE_CHECKING:
    from tui.app import TailpilotApp

class FilterInput(Input):
    BINDINGS = [Binding("escape", "done", "Done", show=False)]

    def action_done(self) -> None:
        self.post_message(self.Submitted(self, self.value))


class ClusterPanel(Vertical):
    """A row per replica, updated in place; sortable; ``/`` filters."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.filter_text = ""
        self.sort_column: str | None = None
        self.sort_reverse = False

    def compose(self) -> ComposeResult:
        yield FilterInput(placeholder="filter: words in name, policy, health, reason (esc: done)", id="filter")
        yield Static("", id="table-title", classes="title")
        yield ClusterTable([(c.key, c.label, c.width, c.right) for c in R.COLUMNS], id="cluster-table")
        yield Static(R.totals_text(None), id="totals")

    def on_mount(self) -> None:
        self._update_title()

    @property
    def table(self) -> ClusterTable:
        return self.query_one("#cluster-table", ClusterTable)

    def _update_title(self) -> None:
        text = Text("replicas", style="bold")
        if self.sort_column:
            label = next(c.label for c in R.COLUMNS if c.key == self.sort_column)
            text.append(f" · sorted by {label} {'↓' if self.sort_reverse else '↑'}")
        if self.filter_text:
            text.append(f" · filter “{self.filter_text}”", style="yellow")
        text.append(" · * = pinned · ● = selected · enter: open · space: select", style="dim")
        self.query_one("#table-title", Static).update(text)

    def visible_rows(self, snap: ClusterSnapshot) -> list[ReplicaSnapshot]:
        """The replicas the table shows: filtered, in the chosen sort order."""
        rows = [rs for _, rs in sorted(snap.replicas.items()) if R.matches_filter(rs, self.filter_text)]
        if self.sort_column:
            key = R.sort_key(self.sort_column)
            rows.sort(key=key, reverse=self.sort_reverse)
            rows.sort(key=lambda rs: key(rs)[0])  # stable: replicas without a value last either way
        return rows

    def update_from(self, app: "TailpilotApp", snap: ClusterSnapshot, *, rebuild: bool = False) -> None:
        rows = self.visible_rows(snap)
        names = [rs.name for rs in rows]
        cells = {rs.name: R.cluster_row(rs, app.source.kv_trail(rs.name, R.SPARK_LEN), rs.name in app.selected)
                 for rs in rows}
        self.table.set_rows(names, cells, keep_cursor_on=app.current_replica)
        self.query_one("#totals", Static).update(R.totals_text(snap, shown=len(names)))

    def set_sort(self, column: str | None, reverse: bool | None = None) -> None:
        if column == self.sort_column and reverse is None:
            self.sort_reverse = not self.sort_reverse
        else:
            self.sort_column = column
            if reverse is not None:
                self.sort_reverse = reverse
        self._update_title()

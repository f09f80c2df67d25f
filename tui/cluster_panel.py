"""The cluster panel: one row per replica, sortable and filterable, with totals.

It shows its reactive data: ``data`` (each snapshot with the replicas' KV trails), set by the app,
and ``selected`` and ``cursor_replica``, bound to the app's selection and current replica
(``data_bind``); the filter (``/``) and the sort order are its own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.reactive import var
from textual.widgets import (
    Input,
    Static,
)

from controlplane.snapshot import ClusterSnapshot, ReplicaSnapshot
from tui import render as R
from tui.widgets import ClusterTable


@dataclass(frozen=True)
class ClusterData:
    """One snapshot as the cluster panel shows it."""

    snapshot: ClusterSnapshot
    kv_trails: Mapping[str, Sequence[float]]  # replica -> its last KV usages (the sparkline)


class FilterInput(Input):
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "done", "Done", show=False)]

    def action_done(self) -> None:
        self.post_message(self.Submitted(self, self.value))


class ClusterPanel(Vertical):
    """A row per replica, updated in place; sortable; ``/`` filters."""

    data: var[ClusterData | None] = var(None, init=False, always_update=True)
    """The newest snapshot; every one re-renders (the table re-renders only the changed rows)."""
    selected: var[frozenset[str]] = var(frozenset(), init=False)
    """The selected replicas (marked ●)."""
    cursor_replica: var[str | None] = var(None, init=False)
    """The replica the cursor stays on when the rows change (the app's current replica)."""
    filter_text: var[str] = var("", init=False)
    """Words a shown replica matches (``render.matches_filter``); "" shows every replica."""
    sort: var[tuple[str | None, bool]] = var((None, False), init=False)
    """(the column the rows are sorted by, None: by name; descending)."""

    def compose(self) -> ComposeResult:
        yield FilterInput(
            placeholder="filter: words in name, policy, health, reason (esc: done)", id="filter"
        )
        yield Static("", id="table-title", classes="title")
        yield ClusterTable(
            [(c.key, c.label, c.width, c.right) for c in R.COLUMNS], id="cluster-table"
        )
        yield Static(R.totals_text(None), id="totals")

    def on_mount(self) -> None:
        self._show_title()

    @property
    def table(self) -> ClusterTable:
        return self.query_one("#cluster-table", ClusterTable)

    @property
    def sort_column(self) -> str | None:
        return self.sort[0]

    @property
    def sort_reverse(self) -> bool:
        return self.sort[1]

    # --- the data --------------------------------------------------------------------------
    def watch_data(self) -> None:
        self._show_rows()

    def watch_selected(self) -> None:
        self._show_rows()

    def watch_filter_text(self) -> None:
        self._show_title()
        self._show_rows()

    def watch_sort(self) -> None:
        self._show_title()
        self._show_rows()

    def _show_title(self) -> None:
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
        rows = [
            rs for _, rs in sorted(snap.replicas.items()) if R.matches_filter(rs, self.filter_text)
        ]
        if self.sort_column:
            key = R.sort_key(self.sort_column)
            rows.sort(key=key, reverse=self.sort_reverse)
            rows.sort(key=lambda rs: key(rs)[0])  # stable: replicas without a value last either way
        return rows

    def _show_rows(self) -> None:
        data = self.data
        if data is None:
            return
        rows = self.visible_rows(data.snapshot)
        names = [rs.name for rs in rows]
        cells = {
            rs.name: R.cluster_row(rs, data.kv_trails.get(rs.name, ()), rs.name in self.selected)
            for rs in rows
        }
        self.table.set_rows(names, cells, keep_cursor_on=self.cursor_replica)
        self.query_one("#totals", Static).update(R.totals_text(data.snapshot, shown=len(names)))

    # --- sorting and filtering -------------------------------------------------------------
    def set_sort(self, column: str | None, reverse: bool | None = None) -> None:
        """Sort by ``column`` (None: by name); the same column again flips the order, unless
        ``reverse`` says which."""
        if column == self.sort_column and reverse is None:
            self.sort = (column, not self.sort_reverse)
        else:
            self.sort = (column, self.sort_reverse if reverse is None else reverse)

    def sort_next(self) -> None:
        """``s``: the next sortable column, in the same direction."""
        cols = R.SORTABLE
        nxt = (
            cols[(cols.index(self.sort_column) + 1) % len(cols)]
            if self.sort_column in cols
            else cols[0]
        )
        self.set_sort(nxt, reverse=self.sort_reverse)

    def reverse_sort(self) -> None:
        """``r``: the other direction (by name when unsorted)."""
        self.set_sort(self.sort_column or "replica", reverse=not self.sort_reverse)

    @on(ClusterTable.HeaderSelected, "#cluster-table")
    def _header_selected(self, event: ClusterTable.HeaderSelected) -> None:
        if event.column_key in R.SORTABLE:
            self.set_sort(event.column_key)

    def open_filter(self) -> None:
        """``/``: show the filter and type into it."""
        f = self.query_one("#filter", FilterInput)
        f.add_class("-shown")
        f.focus()

    @on(Input.Changed, "#filter")
    def _filter_changed(self, event: Input.Changed) -> None:
        self.filter_text = event.value.strip()

    @on(Input.Submitted, "#filter")
    def _filter_done(self, event: Input.Submitted) -> None:
        f = self.query_one("#filter", FilterInput)
        if not f.value.strip():
            f.remove_class("-shown")
        self.table.focus()

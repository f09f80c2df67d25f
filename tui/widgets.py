"""``ClusterTable``: the cluster screen's table, a Line-API widget that re-renders only the rows
whose cells changed.

Textual's DataTable keys its cell render cache on a table-wide update counter, so a single
``update_cell`` re-renders every visible cell (≈0.15 ms each: 64 replicas × 12 columns ≈ 110 ms a
refresh). Here each row is rendered once into a ``Strip`` and cached by (cells, cursor, stripe,
width): a refresh re-renders only the rows whose values changed, and moving the cursor only the
two rows involved. Fixed column widths (numbers right-aligned), a fixed header row (click to
sort), a cursor row, zebra stripes, vertical scrolling.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import repeat
from typing import Any, ClassVar

from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual.binding import Binding, BindingType
from textual.events import Click, Idle
from textual.geometry import Size
from textual.message import Message
from textual.scroll_view import ScrollView
from textual.strip import Strip
from textual.widgets import DataTable

from tui.render import Cell, Row

PAD = 1  # blanks on each side of a cell


class ClusterTable(ScrollView, can_focus=True):
    """Rows keyed by replica name; cells are ``str`` or rich ``Text``, one per column."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("up", "cursor(-1)", "Up", show=False),
        Binding("down", "cursor(1)", "Down", show=False),
        Binding("pageup", "page(-1)", "Page up", show=False),
        Binding("pagedown", "page(1)", "Page down", show=False),
        Binding("home", "jump(0)", "First", show=False),
        Binding("end", "jump(-1)", "Last", show=False),
        Binding("enter", "select", "Open", show=False),
    ]
    COMPONENT_CLASSES: ClassVar[set[str]] = {
        "cluster-table--header",
        "cluster-table--cursor",
        "cluster-table--even-row",
    }
    DEFAULT_CSS = """
    ClusterTable { background: $surface; }
    ClusterTable > .cluster-table--header { background: $panel; color: $foreground;
                                            text-style: bold; }
    ClusterTable > .cluster-table--cursor { background: $block-cursor-blurred-background; }
    ClusterTable:focus > .cluster-table--cursor { background: $block-cursor-background;
                                                   color: $block-cursor-foreground; }
    ClusterTable > .cluster-table--even-row { background: $surface-lighten-1 40%; }
    """

    class RowHighlighted(Message):
        def __init__(self, table: ClusterTable, row_key: str) -> None:
            super().__init__()
            self.table, self.row_key = table, row_key

        @property
        def control(self) -> ClusterTable:
            return self.table

    class RowSelected(RowHighlighted):
        pass

    class HeaderSelected(Message):
        def __init__(self, table: ClusterTable, column_key: str) -> None:
            super().__init__()
            self.table, self.column_key = table, column_key

        @property
        def control(self) -> ClusterTable:
            return self.table

    def __init__(self, columns: Sequence[tuple[str, str, int, bool]], **kw: Any) -> None:
        """``columns``: (key, label, width, right_aligned)."""
        super().__init__(**kw)
        self.columns = list(columns)
        self.column_keys = [c[0] for c in columns]
        self._col_index = {k: i for i, k in enumerate(self.column_keys)}
        self.order: list[str] = []
        self.cells: dict[str, Row] = {}
        self.cursor_row = 0
        # row key -> (cache key, strip)
        self._strips: dict[str, tuple[tuple[object, ...], Strip]] = {}
        self._header: tuple[tuple[object, ...], Strip] | None = None
        self.renders = 0  # rows rendered (not served from the cache), for tests and benchmarks

    # --- data ------------------------------------------------------------------------------
    @property
    def row_count(self) -> int:
        return len(self.order)

    @property
    def cursor_key(self) -> str | None:
        return self.order[self.cursor_row] if 0 <= self.cursor_row < len(self.order) else None

    def get_cell(self, row_key: str, column_key: str) -> Any:
        return self.cells[row_key][self._col_index[column_key]]

    def set_rows(
        self, order: list[str], cells: dict[str, Row], *, keep_cursor_on: str | None = None
    ) -> None:
        """Show ``order`` (row keys, top to bottom) with ``cells``; only changed rows re-render."""
        old_key = keep_cursor_on if keep_cursor_on is not None else self.cursor_key
        changed_order = order != self.order
        self.order, self.cells = list(order), cells
        for key in [k for k in self._strips if k not in cells]:
            del self._strips[key]
        if changed_order:
            self.virtual_size = Size(self._total_width(), len(order) + 1)
            if old_key in cells:
                self.cursor_row = self.order.index(old_key)
            self.cursor_row = min(max(self.cursor_row, 0), max(len(order) - 1, 0))
            self._scroll_cursor_into_view()
        self.refresh()
        new_key = self.cursor_key
        if new_key is not None and new_key != old_key:
            # Sent by the table whoever set the rows: Textual stops a message at the parent that
            # sent it, and the cluster panel sets them (the app must hear of the new cursor).
            self.post_message(self.RowHighlighted(self, new_key).set_sender(self))

    def move_cursor(self, row: int) -> None:
        if not self.order:
            return
        row = min(max(row, 0), len(self.order) - 1)
        if row != self.cursor_row:
            self.cursor_row = row
            self.refresh()
            self.post_message(self.RowHighlighted(self, self.order[row]).set_sender(self))
        self._scroll_cursor_into_view()

    def _scroll_cursor_into_view(self) -> None:
        visible = max(self.size.height - 1, 1)
        top = int(self.scroll_y)
        if self.cursor_row < top:
            self.scroll_to(y=self.cursor_row, animate=False)
        elif self.cursor_row >= top + visible:
            self.scroll_to(y=self.cursor_row - visible + 1, animate=False)

    # --- actions ---------------------------------------------------------------------------
    def action_cursor(self, delta: int) -> None:
        self.move_cursor(self.cursor_row + int(delta))

    def action_page(self, direction: int) -> None:
        self.move_cursor(self.cursor_row + int(direction) * max(self.size.height - 2, 1))

    def action_jump(self, where: int) -> None:
        self.move_cursor(0 if int(where) == 0 else len(self.order) - 1)

    def action_select(self) -> None:
        key = self.cursor_key
        if key is not None:
            self.post_message(self.RowSelected(self, key))

    def on_click(self, event: Click) -> None:
        if event.y == 0:
            x = 0
            for key, _label, width, _right in self.columns:
                x += width + 2 * PAD
                if event.x < x:
                    self.post_message(self.HeaderSelected(self, key))
                    return
            return
        row = int(self.scroll_y) + event.y - 1
        if 0 <= row < len(self.order):
            if row == self.cursor_row:
                self.action_select()
            else:
                self.move_cursor(row)

    # --- rendering -------------------------------------------------------------------------
    def _total_width(self) -> int:
        return sum(w + 2 * PAD for _k, _l, w, _r in self.columns)

    def _render_cells(self, cells: Sequence[Any], base: Style) -> Strip:
        console = self.app.console
        segments: list[Segment] = []
        for (_key, _label, width, right), cell in zip(self.columns, cells):
            text = cell.copy() if isinstance(cell, Text) else Text(str(cell))
            text.truncate(width, overflow="ellipsis")
            text.align("right" if right else "left", width)
            segments.append(Segment(" " * PAD, base))
            segments.extend(Segment.apply_style(text.render(console), base))
            segments.append(Segment(" " * PAD, base))
        return Strip(segments, self._total_width())

    def render_line(self, y: int) -> Strip:
        width = self.size.width
        if y == 0:
            style = self.get_component_rich_style("cluster-table--header")
            header_key = (tuple(label for _k, label, _w, _r in self.columns), style, width)
            if self._header is None or self._header[0] != header_key:
                labels = [Text(label, style=style) for _k, label, _w, _r in self.columns]
                self._header = (
                    header_key,
                    self._render_cells(labels, style)
                    .extend_cell_length(width, style)
                    .crop(0, width),
                )
            return self._header[1]
        row = int(self.scroll_y) + y - 1
        base_style = self.rich_style
        if not (0 <= row < len(self.order)):
            return Strip.blank(width, base_style)
        name = self.order[row]
        cells = self.cells[name]
        cursor = row == self.cursor_row
        even = row % 2 == 1
        if cursor:
            style = base_style + self.get_component_rich_style("cluster-table--cursor")
        elif even:
            style = base_style + self.get_component_rich_style("cluster-table--even-row")
        else:
            style = base_style
        key = (cells, cursor, even, width, style, self.has_focus)
        cached = self._strips.get(name)
        if cached is not None and cached[0] == key:
            return cached[1]
        self.renders += 1
        strip = self._render_cells(cells, style).extend_cell_length(width, style).crop(0, width)
        self._strips[name] = (key, strip)
        return strip

    def on_resize(self) -> None:
        self.virtual_size = Size(self._total_width(), len(self.order) + 1)
        self._header = None
        self._scroll_cursor_into_view()

    def on_focus(self) -> None:
        self.refresh()

    def on_blur(self) -> None:
        self.refresh()


class AutoSizedTable(DataTable[Cell]):
    """A DataTable whose columns, once re-measured, are what the screen shows.

    DataTable measures new rows on its next idle. A frame painted before that (likely on a busy
    machine) caches its lines at the old column widths, and those lines stay cached — truncated
    cells — until the cursor moves or the table resizes (Textual 8.2). After an idle that
    measured new rows, drop the line cache and repaint."""

    def _on_idle(self, event: Idle) -> None:  # type: ignore[override]  # Textual dispatches sync handlers too
        # Textual calls every class's _on_idle, this one first: DataTable's measures next, and
        # call_next runs once the idle handlers are done.
        if getattr(self, "_require_update_dimensions", False) and hasattr(self, "_clear_caches"):
            self.call_next(self._repaint_measured)

    def _repaint_measured(self) -> None:
        self._clear_caches()
        self.refresh()


def fill_table(
    table: DataTable[Cell], rows: Iterable[Sequence[Cell]], keys: Iterable[str] | None = None
) -> None:
    """Replace a DataTable's rows. DataTable sizes its columns on its next idle, and an idle only
    follows a message the table itself processes; rows added from another widget's handler or a
    worker post none, so the columns could stay sized to their headers until the next key or
    timer. ``check_idle`` posts one."""
    table.clear()
    for row, key in zip(rows, repeat(None) if keys is None else keys):
        table.add_row(*row, key=key)
    table.check_idle()

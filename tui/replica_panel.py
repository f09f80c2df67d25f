"""The replica panel: percentile plots, queue and KV, γ/β live, per-tenant and per-type tables."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Grid, Horizontal, Vertical
from textual.widgets import (
    DataTable,
    Static,
)
from textual_plotext import PlotextPlot

from controlplane.collector import ClusterSnapshot
from tui import render as R
from tui.widgets import AutoSizedTable, fill_table

if TYPE_CHECKING:
    from tui.app import TailpilotApp

class ReplicaPanel(Vertical):
    PLOTS = 6

    def compose(self) -> ComposeResult:
        yield Static(R.replica_header(None), id="replica-header")
        yield Static(R.fidelity_line(None), id="fidelity-line")
        yield Static("", id="down-banner")
        with Grid(id="plots"):
            for i in range(self.PLOTS):
                yield PlotextPlot(id=f"plot-{i}")
        with Horizontal(id="replica-tables"):
            with Vertical(id="tenant-box"):
                yield Static(Text("per tenant (the window)", style="bold"), classes="title")
                yield Static("", id="fairness")
                yield AutoSizedTable(id="tenant-table", cursor_type="none", zebra_stripes=True)
            with Vertical(id="type-box"):
                yield Static(Text("per request type (the window)", style="bold"), classes="title")
                yield AutoSizedTable(id="type-table", cursor_type="none", zebra_stripes=True)

    def on_mount(self) -> None:
        t = self.query_one("#tenant-table", DataTable)
        t.add_columns("tenant", "reqs", "tok/s", "TTFT p99", "TTLT p99", "TBT p99", "SLO")
        y = self.query_one("#type-table", DataTable)
        y.add_columns("type", "reqs", "req share", "token share", "TTLT p99")

    def update_from(self, app: "TailpilotApp", snap: ClusterSnapshot) -> None:
        name = app.current_replica
        rs = snap.replicas.get(name) if name else None
        window = app.cluster.window_s if app.cluster is not None else None
        self.query_one("#replica-header", Static).update(R.replica_header(rs, window))
        self.show_fidelity(app)
        banner = self.query_one("#down-banner", Static)
        if rs is not None and not rs.health.healthy:
            banner.update(f"UNHEALTHY: {rs.health.reason or 'unknown reason'} — last good numbers are not shown")
            banner.add_class("-shown")
        else:
            banner.remove_class("-shown")
        history = app.source.history(name, snap.t_ms) if name else []
        markers = R.change_markers(history, app.audit_cache, name)
        span = app.source.history_s
        for i, series in enumerate(R.replica_series(history, snap.t_ms, markers)):
            self._draw(self.query_one(f"#plot-{i}", PlotextPlot), series, span)
        slos = app.cluster.slos if app.cluster is not None else {}
        rows, summary = R.tenant_table(rs.groups if rs else [], slos, snap.governance)
        self.query_one("#fairness", Static).update(summary)
        fill_table(self.query_one("#tenant-table", DataTable), rows)
        fill_table(self.query_one("#type-table", DataTable), R.type_share_rows(rs.groups if rs else []))

    def show_fidelity(self, app: "TailpilotApp") -> None:
        name = app.current_replica
        self.query_one("#fidelity-line", Static).update(R.fidelity_line(app.fidelity_cache.get(name) if name else None))

    @staticmethod
    def _draw(plot: PlotextPlot, s: R.Series, span_s: float) -> None:
        plt = plot.plt
        plt.clear_data()
        plt.clear_figure()
        plt.title(s.title)
        any_data = False
        for label, ys in s.lines.items():
            pts = [(x, y) for x, y in zip(s.x, ys) if y is not None]
            if pts:
                any_data = True
                plt.plot([p[0] for p in pts], [p[1] for p in pts], label=label, marker="braille")
        lo = max(-span_s, min(s.x)) if s.x else -span_s
        for m in s.markers:
            if m >= lo:
                plt.vline(m, "red")
        plt.xlim(min(lo, -1.0), 0)
        plt.xlabel("seconds before now" if s.x else "")
        if not any_data:
            plt.title(s.title + " — no data")
        plot.refresh()

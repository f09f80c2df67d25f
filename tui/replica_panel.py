"""The replica panel: percentile plots, queue and KV, γ/β live, per-tenant and per-type tables.

It shows its reactive data, set by the app while the panel is shown: ``data`` (a snapshot, the
replica and its history) and ``fidelity`` (the replica's newest fidelity report).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Grid, Horizontal, Vertical
from textual.reactive import var
from textual.widgets import (
    DataTable,
    Static,
)
from textual_plotext import PlotextPlot

from controlplane.snapshot import ClusterSnapshot
from storage.rows import SampleRow
from tui import render as R
from tui.widgets import AutoSizedTable, fill_table


@dataclass(frozen=True)
class ReplicaData:
    """One snapshot of one replica as the replica panel shows it."""

    snapshot: ClusterSnapshot
    replica: str | None  # None: the cluster has no replica
    history: Sequence[SampleRow]  # the replica's samples of the plots' span, oldest first
    audit: Sequence[Mapping[str, Any]]  # the settings audit log (its changes mark the plots)


class ReplicaPanel(Vertical):
    """``ReplicaPanel(window_s=..., slos=..., history_s=...)``: the cluster's window and SLOs
    (None, {}: not known) and the span of the plots in seconds."""

    PLOTS = 6

    data: var[ReplicaData | None] = var(None, init=False, always_update=True)
    """What the panel shows; every one re-renders."""
    fidelity: var[dict[str, Any] | None] = var(None, init=False)
    """The shown replica's newest fidelity report (``TunerResults.latest_fidelity``), None: not
    measured."""

    def __init__(
        self,
        *,
        window_s: float | None = None,
        slos: Mapping[str, float] | None = None,
        history_s: float,
        **kw: Any,
    ) -> None:
        super().__init__(**kw)
        self.window_s = window_s
        self.slos: Mapping[str, float] = slos or {}
        self.history_s = history_s

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

    def watch_data(self, data: ReplicaData | None) -> None:
        if data is None:
            return
        snap, name = data.snapshot, data.replica
        rs = snap.replicas.get(name) if name else None
        self.query_one("#replica-header", Static).update(R.replica_header(rs, self.window_s))
        banner = self.query_one("#down-banner", Static)
        if rs is not None and not rs.health.healthy:
            banner.update(
                f"UNHEALTHY: {rs.health.reason or 'unknown reason'} — "
                "last good numbers are not shown"
            )
            banner.add_class("-shown")
        else:
            banner.remove_class("-shown")
        markers = R.change_markers(data.history, data.audit, name)
        for i, series in enumerate(R.replica_series(data.history, snap.t_ms, markers)):
            self._draw(self.query_one(f"#plot-{i}", PlotextPlot), series, self.history_s)
        rows, summary = R.tenant_table(rs.groups if rs else [], self.slos, snap.governance)
        self.query_one("#fairness", Static).update(summary)
        fill_table(self.query_one("#tenant-table", DataTable), rows)
        fill_table(
            self.query_one("#type-table", DataTable), R.type_share_rows(rs.groups if rs else [])
        )

    def watch_fidelity(self, report: dict[str, Any] | None) -> None:
        self.query_one("#fidelity-line", Static).update(R.fidelity_line(report))

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

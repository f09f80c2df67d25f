"""The operator TUI (Textual): live cluster view, replica drill-down, policy switching and
pinning, audit log, and replay of recordings on the same screens.

Data flow: one pump task awaits ``source.next_snapshot()`` and applies each snapshot before it
reads the next (refreshes never overlap); the cluster table is updated cell by cell in place.
Polling happens in the collector (asyncio, in this event loop), store reads in threads, settings
changes in workers: nothing the operator presses waits on the network.
"""

from __future__ import annotations

import getpass
import logging
import time
from collections import deque
from typing import Any, Iterable

from rich.text import Text
from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import (
    Button,
    Checkbox,
    ContentSwitcher,
    DataTable,
    Footer,
    Input,
    Label,
    OptionList,
    Select,
    SelectionList,
    Static,
)
from textual.widgets.option_list import Option
from textual_plotext import PlotextPlot

from controlplane.cluster import ClusterSpec
from controlplane.collector import ClusterSnapshot, ReplicaSnapshot
from controlplane.settings import POLICY_NAMES
from tui import keys as K
from tui import render as R
from tui.edits import (
    FieldSpec,
    RecommendationEdit,
    SettingsEdit,
    current_settings,
    field_errors,
    field_text,
    parse_field,
    pin_edit,
    policy_fields,
    settings_diff,
    try_apply,
)
from tui.sources import DataSource, fmt_time, parse_seek
from tui.tuner_panel import TunerPanel
from tui.widgets import AutoSizedTable, ClusterTable, fill_table

log = logging.getLogger(__name__)

CSS = """
Screen { layout: vertical; }
#topbar { height: 1; background: $panel; color: $text; }
#panels { height: 1fr; }
#cluster-table { height: 1fr; }
.title { height: 1; padding: 0 1; }
#totals { height: auto; min-height: 1; padding: 0 1; background: $boost; }
#filter { display: none; }
#filter.-shown { display: block; }
#replica-header { height: auto; padding: 0 1; }
#down-banner { display: none; background: $error; color: $text; padding: 0 1; }
#down-banner.-shown { display: block; }
#plots { grid-size: 3 2; height: 2fr; }
#plots PlotextPlot { height: 1fr; }
#replica-tables { height: 1fr; }
#tenant-box { width: 3fr; }
#type-box { width: 2fr; }
#tenant-table, #type-table { height: 1fr; }
#fairness { height: auto; padding: 0 1; }
#policy-banner { height: auto; padding: 0 1; }
#policy-banner.-readonly { background: $error 40%; }
#targets-box { width: 30; border-right: solid $panel; }
#targets { height: 1fr; }
#editor { width: 1fr; padding: 0 1; }
#policy-row { height: 1; margin-bottom: 1; }
#policy-row Label { width: 20; text-style: bold; }
#policy-select { width: 24; }
#form { height: 1fr; }
.form-row { height: 1; }
.form-row .fname { width: 20; }
.form-row Input { width: 24; }
.form-row Select { width: 24; }
.form-row .fvalue { width: 24; }
.form-row .fpin { width: 9; margin-left: 1; }
.form-row .fhint { width: 1fr; padding: 0 0 0 1; color: $text-muted; }
.form-row .fhint.-error { color: $error; text-style: bold; }
Input.-invalid { border: tall $error; }
#preview { height: auto; max-height: 12; padding: 0 1; border-top: solid $panel; }
#last-result { height: auto; max-height: 8; padding: 0 1; }
#audit-table { height: 1fr; }
ConfirmScreen, HelpScreen, SeekScreen, PolicyPickScreen { align: center middle; }
#dialog { width: 90; height: auto; max-height: 90%; border: thick $warning; background: $surface; padding: 1 2; }
#dialog-body { height: auto; max-height: 30; }
#dialog-buttons { height: 3; align: right middle; }
#dialog-buttons Button { margin-left: 2; width: auto; }
#help { width: 110; height: 90%; border: thick $primary; background: $surface; padding: 0 1; }
#seek-error { color: $error; height: auto; }
"""


# ---------------------------------------------------------------------------------------- dialogs


class ConfirmScreen(ModalScreen[bool]):
    """Every cluster change passes here: the diff per replica, apply or cancel."""

    BINDINGS = K.bindings(scope="confirm")

    def __init__(self, title: str, plans: list[dict[str, Any]]) -> None:
        super().__init__()
        self.title_text = title
        self.plans = plans

    def compose(self) -> ComposeResult:
        sendable = sum(1 for p in self.plans if not p.get("error"))
        with Vertical(id="dialog"):
            yield Static(Text(self.title_text, style="bold"), id="dialog-title")
            with VerticalScroll(id="dialog-body"):
                yield Static(R.diff_renderable(self.plans), id="dialog-diff")
            with Horizontal(id="dialog-buttons"):
                yield Button(f"Apply to {sendable} replica(s) \\[y]", id="yes", variant="warning",
                             disabled=sendable == 0)
                yield Button("Cancel \\[n/esc]", id="no")

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()

    def action_confirm(self) -> None:
        if any(not p.get("error") for p in self.plans):
            self.dismiss(True)

    def action_cancel(self) -> None:
        self.dismiss(False)

    @on(Button.Pressed, "#yes")
    def _yes(self) -> None:
        self.action_confirm()

    @on(Button.Pressed, "#no")
    def _no(self) -> None:
        self.dismiss(False)


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,question_mark,q", "close", "Close", show=False)]

    def __init__(self, readonly: bool, mode: str) -> None:
        super().__init__()
        self.readonly, self.mode = readonly, mode

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help"):
            head = Text("tailpilot — keys", style="bold")
            if self.readonly:
                head.append("   READ-ONLY: cluster changes are refused", style="bold white on red")
            head.append("\nEvery key is also a command in the palette (ctrl+p). Capital letters change the "
                        "cluster and always ask for confirmation with the diff first.", style="dim")
            head.append("\nesc, ? or q closes this help.", style="bold")
            yield Static(head)
            yield Static(R.help_table(K.help_rows(readonly=self.readonly, mode=self.mode)), id="help-table")

    def action_close(self) -> None:
        self.dismiss(None)


class SeekScreen(ModalScreen["int | None"]):
    BINDINGS = [Binding("escape", "cancel", "Cancel", show=False)]

    def __init__(self, position_ms: int, start_ms: int, end_ms: int) -> None:
        super().__init__()
        self.position_ms, self.start_ms, self.end_ms = position_ms, start_ms, end_ms

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Static(Text.assemble(("Seek", "bold"), f"  recording {fmt_time(self.start_ms)} – "
                                       f"{fmt_time(self.end_ms)} UTC, now {fmt_time(self.position_ms)}"))
            yield Input(placeholder="+30s, -2m, @1:30 (from start), 22:15:00 (UTC), ISO time, start, end",
                        id="seek-input")
            yield Static("", id="seek-error")

    @on(Input.Submitted, "#seek-input")
    def _submit(self, event: Input.Submitted) -> None:
        try:
            t = parse_seek(event.value, position_ms=self.position_ms, start_ms=self.start_ms, end_ms=self.end_ms)
        except ValueError as err:
            self.query_one("#seek-error", Static).update(str(err))
            return
        self.dismiss(t)

    def action_cancel(self) -> None:
        self.dismiss(None)


class PolicyPickScreen(ModalScreen["str | None"]):
    BINDINGS = [Binding("escape", "cancel", "Cancel", show=False)]

    def __init__(self, targets: list[str], current: dict[str, str | None]) -> None:
        super().__init__()
        self.targets, self.current = targets, current

    def compose(self) -> ComposeResult:
        now = sorted({p for p in self.current.values() if p})
        with Vertical(id="dialog"):
            yield Static(Text.assemble(("Switch policy", "bold"), f" of {', '.join(self.targets)}"
                                       f" (now: {', '.join(now) or 'unknown'})"))
            yield OptionList(*[Option(f"{p}{'  (current)' if p in now else ''}", id=p) for p in POLICY_NAMES],
                             id="policy-options")

    def on_mount(self) -> None:
        opts = self.query_one(OptionList)
        now = [p for p in self.current.values() if p]
        if now and now[0] in POLICY_NAMES:
            opts.highlighted = POLICY_NAMES.index(now[0])
        opts.focus()

    @on(OptionList.OptionSelected)
    def _picked(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(event.option.id)

    def action_cancel(self) -> None:
        self.dismiss(None)


# ---------------------------------------------------------------------------------------- panels


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

    def visible(self, snap: ClusterSnapshot) -> list[ReplicaSnapshot]:
        rows = [rs for _, rs in sorted(snap.replicas.items()) if R.matches_filter(rs, self.filter_text)]
        if self.sort_column:
            key = R.sort_key(self.sort_column)
            rows.sort(key=key, reverse=self.sort_reverse)
            rows.sort(key=lambda rs: key(rs)[0])  # stable: replicas without a value last either way
        return rows

    def update_from(self, app: "TailpilotApp", snap: ClusterSnapshot, *, rebuild: bool = False) -> None:
        rows = self.visible(snap)
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


class ReplicaPanel(Vertical):
    PLOTS = 6

    def compose(self) -> ComposeResult:
        yield Static(R.replica_header(None), id="replica-header")
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
        weights = None
        if rs is not None and rs.settings and rs.settings.get("policy") == "vtc":
            weights = (rs.settings.get("params") or {}).get("weights") or None
        rows, summary = R.tenant_table(rs.groups if rs else [], slos, weights)
        self.query_one("#fairness", Static).update(summary)
        fill_table(self.query_one("#tenant-table", DataTable), rows)
        fill_table(self.query_one("#type-table", DataTable), R.type_share_rows(rs.groups if rs else []))

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


class PolicyPanel(Vertical):
    """Switch, edit and pin: one input per parameter of the chosen policy, validated inline by
    the settings model; ``A`` (or enter in a field) opens the confirmation with the diff."""

    BINDINGS = [Binding("escape", "leave_form", "Leave the form", show=False)]

    def action_leave_form(self) -> None:
        self.query_one("#targets", SelectionList).focus()

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.fields: list[FieldSpec] = []
        self.initial: dict[str, Any] = {}
        self.initial_pins: set[str] = set()
        self.form_policy: str | None = None
        self.reference: str | None = None
        self.ref_policy: str | None = None  # the reference replica's policy (from its settings or samples)
        self.error: str | None = None
        self._gen = 0
        self._syncing = False
        self.form_version: int | None = None  # the reference's settings version the form was built from
        self.reload_after_apply = False
        self._loading = False

    def compose(self) -> ComposeResult:
        yield Static("", id="policy-banner")
        with Horizontal():
            with Vertical(id="targets-box"):
                yield Static(Text("targets (space: toggle)", style="bold"))
                yield SelectionList[str](id="targets", compact=True)
            with Vertical(id="editor"):
                with Horizontal(id="policy-row"):
                    yield Label("policy")
                    yield Select([(p, p) for p in POLICY_NAMES], allow_blank=False, value="sarathi",
                                 id="policy-select", compact=True)
                yield VerticalScroll(id="form")
                yield Static("", id="preview")
                yield Static("", id="last-result")

    @property
    def app_(self) -> "TailpilotApp":
        return self.app  # type: ignore[return-value]

    # --- loading ---------------------------------------------------------------------------
    def sync_targets(self) -> None:
        app = self.app_
        snap = app.snapshot
        names = sorted(snap.replicas) if snap else [r.name for r in (app.cluster.replicas if app.cluster else [])]
        sel = self.query_one("#targets", SelectionList)
        self._syncing = True
        try:
            if [str(sel.get_option_at_index(i).value) for i in range(sel.option_count)] != names:
                sel.clear_options()
                sel.add_options([(n, n, n in app.selected) for n in names])
            else:
                for n in names:
                    if (n in app.selected) != (n in sel.selected):
                        (sel.select if n in app.selected else sel.deselect)(n)
        finally:
            self._syncing = False
        self._update_banner()

    def on_snapshot(self) -> None:
        """A new snapshot while the panel is shown: keep the targets in sync, and rebuild the form
        when the reference replica's settings changed — at once after our own apply or when
        nothing is staged; otherwise only say so (staged edits are never thrown away)."""
        self.sync_targets()
        app = self.app_
        rs = app.snapshot.replicas.get(self.reference) if (app.snapshot and self.reference) else None
        if rs is None or self.form_policy is None or self._loading:
            return
        if rs.settings_version != self.form_version and rs.settings is not None:
            if self.reload_after_apply or self.current_edit().empty:
                self.reload_after_apply = False
                self._loading = True
                app.run_worker(self._reload(), group="policy-load", exit_on_error=False)
            else:
                self._update_banner()

    async def _reload(self) -> None:
        try:
            await self.load(force=True)
        finally:
            self._loading = False

    def _update_banner(self) -> None:
        app = self.app_
        targets = app.targets()
        banner = self.query_one("#policy-banner", Static)
        text = Text()
        if app.readonly:
            text.append(" READ-ONLY ", style="bold white on red")
            text.append(f" {app.readonly_reason()}: switching, editing and pinning are disabled.  ")
            banner.add_class("-readonly")
        how = "selection" if app.selected else "cursor replica; select several with space"
        text.append(f"targets: {', '.join(targets) or 'none'} ({how})")
        if self.reference:
            rs = app.snapshot.replicas.get(self.reference) if app.snapshot else None
            v = rs.settings_version if rs else None
            if self.reference_settings() is None:
                text.append(f" │ {self.reference}'s settings are unknown: the form shows the defaults", style="yellow")
            else:
                text.append(f" │ form shows {self.reference}'s settings (v{self.form_version})")
                if v is not None and self.form_version is not None and v != self.form_version:
                    text.append(f" — the replica is now at v{v}: apply re-reads it (If-Match)", style="yellow")
        banner.update(text)

    async def load(self, *, force: bool = False) -> None:
        """(Re)build the form from the first target's current settings."""
        app = self.app_
        self.sync_targets()
        targets = app.targets()
        ref = targets[0] if targets else None
        rs = app.snapshot.replicas.get(ref) if (app.snapshot and ref) else None
        settings = current_settings(rs.settings) if rs else None
        known = settings.policy if settings else (R.policy_of(rs) if rs else None)
        policy = known or "sarathi"
        if not force and ref == self.reference and known == self.ref_policy and self.form_policy is not None:
            self._update_banner()
            return
        self.reference, self.ref_policy = ref, known
        select = self.query_one("#policy-select", Select)
        if select.value != policy:
            self._syncing = True
            select.value = policy
            self._syncing = False
        await self._build_form(policy)
        self._update_banner()

    def reference_settings(self):
        app = self.app_
        rs = app.snapshot.replicas.get(self.reference) if (app.snapshot and self.reference) else None
        return current_settings(rs.settings) if rs else None

    async def _build_form(self, policy: str) -> None:
        ref = self.reference_settings()
        app = self.app_
        rs = app.snapshot.replicas.get(self.reference) if (app.snapshot and self.reference) else None
        self.form_version = rs.settings_version if rs is not None else None
        self.form_policy = policy
        self.fields = policy_fields(policy)
        same = ref is not None and ref.policy == policy
        self.initial = {f.name: (ref.param(f.name) if same else f.default) for f in self.fields}
        self.initial_pins = set(ref.pinned) if same else set()
        self._gen += 1
        form = self.query_one("#form", VerticalScroll)
        await form.remove_children()
        rows = []
        disabled = self.app_.readonly
        for f in self.fields:
            wid = f"f{self._gen}-{f.name}"
            value = self.initial[f.name]
            if f.kind == "bool":
                widget = Checkbox("on", value=bool(value), id=wid, disabled=disabled, compact=True,
                                  classes="fvalue")
            elif f.kind == "choice":
                widget = Select([(c, c) for c in f.choices], value=str(value), allow_blank=False, id=wid,
                                disabled=disabled, compact=True)
            else:
                widget = Input(value=field_text(f, value), id=wid, disabled=disabled, compact=True)
            label = Label(f.name + (" ~" if f.adaptive else ""), classes="fname")
            pin = Checkbox("pin", value=f.name in self.initial_pins, id=f"p{self._gen}-{f.name}", disabled=disabled,
                           compact=True, classes="fpin")
            hint = Static(f.hint + ("; adapts live unless pinned" if f.adaptive else ""), classes="fhint",
                          id=f"h{self._gen}-{f.name}")
            rows.append(Horizontal(label, widget, pin, hint, classes="form-row"))
        if not rows:
            rows.append(Static(Text(f"{policy} has no parameters.", style="dim")))
        await form.mount_all(rows)
        self.revalidate()

    # --- editing ---------------------------------------------------------------------------
    def _value_of(self, f: FieldSpec) -> Any:
        w = self.query_one(f"#f{self._gen}-{f.name}")
        if isinstance(w, Checkbox):
            return w.value
        if isinstance(w, Select):
            return w.value
        return parse_field(f, w.value)  # type: ignore[union-attr]

    def current_edit(self) -> SettingsEdit:
        params = {}
        pins = set()
        for f in self.fields:
            v = self._value_of(f)
            if v != self.initial[f.name] or type(v) is str and not isinstance(self.initial[f.name], str):
                params[f.name] = v
            if self.query_one(f"#p{self._gen}-{f.name}", Checkbox).value:
                pins.add(f.name)
        policy = self.form_policy if self.form_policy != self.ref_policy else None
        return SettingsEdit(policy=policy, params=params, pin=frozenset(pins - self.initial_pins),
                            unpin=frozenset(self.initial_pins - pins))

    def revalidate(self) -> None:
        """Run the edit through the settings model; mark the fields it names."""
        from controlplane.settings import Settings

        if not self.fields and self.form_policy is None:
            return
        edit = self.current_edit()
        ref = self.reference_settings() or Settings()
        new, err = try_apply(edit, ref)
        self.error = err
        errors = field_errors(err, [f.name for f in self.fields])
        for f in self.fields:
            hint = self.query_one(f"#h{self._gen}-{f.name}", Static)
            w = self.query_one(f"#f{self._gen}-{f.name}")
            if f.name in errors:
                hint.update(f"✗ {errors[f.name]}")
                hint.add_class("-error")
                w.add_class("-invalid")
            else:
                hint.update(f.hint + ("; adapts live unless pinned" if f.adaptive else ""))
                hint.remove_class("-error")
                w.remove_class("-invalid")
        preview = Text()
        if err:
            preview.append("✗ invalid: ", style="bold red")
            preview.append(err, style="red")
        elif edit.empty:
            preview.append("no changes staged", style="dim")
        else:
            preview.append(f"staged for {len(self.app_.targets())} replica(s): ", style="bold")
            preview.append(edit.describe())
            rows = settings_diff(ref.to_dict(), new.to_dict()) if new else []
            for fld, a, b in rows:
                preview.append(f"\n  {fld}: ")
                preview.append(a, style="red")
                preview.append(" → ")
                preview.append(b, style="green")
            preview.append("\npress A to review and apply", style="bold yellow" if not self.app_.readonly else "dim")
        self.query_one("#preview", Static).update(preview)

    @on(Input.Changed)
    @on(Checkbox.Changed)
    def _field_changed(self, event) -> None:
        wid = event.control.id or ""
        if wid.startswith((f"f{self._gen}-", f"p{self._gen}-")):
            self.revalidate()

    @on(Input.Submitted)
    def _field_submitted(self, event: Input.Submitted) -> None:
        if event.input.id and event.input.id.startswith(f"f{self._gen}-"):
            event.stop()
            if self.app_.readonly:
                self.app_.refuse(K.KEYS_BY_ACTION["apply_edits"])
            else:
                self.app_.action_apply_edits()

    @on(Select.Changed)
    async def _select_changed(self, event: Select.Changed) -> None:
        if event.select.id == "policy-select":
            if self._syncing or event.value == self.form_policy or event.value is Select.BLANK:
                return
            await self._build_form(str(event.value))
        elif event.select.id and event.select.id.startswith(f"f{self._gen}-"):
            self.revalidate()

    @on(SelectionList.SelectedChanged, "#targets")
    async def _targets_changed(self, event: SelectionList.SelectedChanged) -> None:
        if self._syncing:
            return
        self.app_.selected = set(str(v) for v in event.selection_list.selected)
        self.app_.refresh_selection_marks()
        await self.load()

    def show_results(self, results: Iterable[Any]) -> None:
        self.query_one("#last-result", Static).update(R.apply_results(results))

    def focus_form(self) -> None:
        for w in self.query("#form Input, #form Checkbox, #form Select"):
            if not w.disabled:
                w.focus()
                return
        self.query_one("#policy-select", Select).focus()


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
        t.add_column("change", key="change", width=60)
        t.add_column("message", key="message")

    def update_from(self, rows: list[dict[str, Any]], note: str | None = None) -> None:
        fill_table(self.query_one(DataTable), [R.audit_row(a) for a in rows])
        title = Text("settings audit log (newest first)", style="bold")
        title.append(f" · {len(rows)} entries")
        if note:
            title.append(f" · {note}", style="yellow")
        self.query_one("#audit-title", Static).update(title)


# ---------------------------------------------------------------------------------------- the app


class TailpilotApp(App):
    """``TailpilotApp(source, cluster_spec, readonly=..., store=...)``."""

    TITLE = "tailpilot"
    CSS = CSS
    BINDINGS = K.bindings()
    COMMANDS = App.COMMANDS | {K.KeyCommands}
    ENABLE_COMMAND_PALETTE = True

    def __init__(self, source: DataSource, cluster_spec: ClusterSpec | None = None, *, readonly: bool = False,
                 store: Any | None = None, who: str | None = None, optuna_storage: str | None = None) -> None:
        super().__init__()
        self.optuna_storage = optuna_storage  # None: ./tailpilot-optuna.db if it exists
        self.source = source
        self.cluster = cluster_spec
        self.store = store
        self.mode_name = source.mode
        self._readonly_flag = bool(readonly)
        self.who = who or f"tui:{_user()}"
        self.snapshot: ClusterSnapshot | None = None
        self.selected: set[str] = set()
        self.current_replica: str | None = None
        self.panel = "cluster"
        self.paused = False
        self.audit_cache: list[dict[str, Any]] = []
        self.last_results: list[Any] = []
        self.snapshots_applied = 0
        self.apply_ms: deque[float] = deque(maxlen=10_000)
        self.refresh_ms: deque[float] = deque(maxlen=10_000)
        self.refused: list[str] = []  # actions refused as read-only (for tests and the log)
        self._audit_every = 10
        self.exit_after_s: float | None = None  # run_tui(duration_s=...): quit on its own

    # --- state ---------------------------------------------------------------------------------
    @property
    def readonly(self) -> bool:
        return self._readonly_flag or bool(getattr(self.source, "readonly", False))

    def readonly_reason(self) -> str:
        if self._readonly_flag:
            return "--readonly"
        return "replay is read-only"

    def targets(self) -> list[str]:
        """What P, N and A act on: the selection, else the replica under the cursor."""
        if self.selected:
            names = set(self.snapshot.replicas) if self.snapshot else self.selected
            return sorted(n for n in self.selected if n in names)
        return [self.current_replica] if self.current_replica else []

    # --- layout --------------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield Static(self._topbar_text(), id="topbar")
        with ContentSwitcher(initial="cluster", id="panels"):
            yield ClusterPanel(id="cluster")
            yield ReplicaPanel(id="replica")
            yield PolicyPanel(id="policy")
            yield AuditPanel(id="audit")
            yield TunerPanel(self.optuna_storage, id="tuner")
        yield Footer()

    async def on_mount(self) -> None:
        self.query_one("#cluster-table").focus()
        try:
            await self.source.start()
        except Exception as err:  # noqa: BLE001 - shown, never a crash
            log.exception("source failed to start")
            self.notify(f"could not start: {err}", severity="error", timeout=30)
        self._pump()
        self.reload_audit()
        if self.exit_after_s:
            self.set_timer(self.exit_after_s, self.exit)

    async def on_unmount(self) -> None:
        await self.source.stop()

    @work(exclusive=True, group="pump", exit_on_error=False)
    async def _pump(self) -> None:
        while True:
            snap = await self.source.next_snapshot()
            if self.paused and self.mode_name == "live":
                continue
            try:
                self.apply_snapshot(snap)
            except Exception as err:  # noqa: BLE001 - a rendering bug must not kill the live view
                log.exception("applying a snapshot failed")
                self.notify(f"display error: {type(err).__name__}: {err}", severity="error")

    def apply_snapshot(self, snap: ClusterSnapshot) -> None:
        """Put one snapshot on the screen (synchronously; the render follows)."""
        t0 = time.perf_counter()
        first = self.snapshot is None
        self.snapshot = snap
        if self.current_replica is None or self.current_replica not in snap.replicas:
            self.current_replica = min(snap.replicas) if snap.replicas else None
        self.query_one(ClusterPanel).update_from(self, snap)
        if self.panel == "replica":
            self.query_one(ReplicaPanel).update_from(self, snap)
        elif self.panel == "policy":
            self.query_one(PolicyPanel).on_snapshot()
        self.snapshots_applied += 1
        if self.mode_name == "replay" or self.snapshots_applied % self._audit_every == 0 or first:
            self.reload_audit()
        self._update_topbar()
        self.apply_ms.append((time.perf_counter() - t0) * 1000)
        self.call_after_refresh(lambda: self.refresh_ms.append((time.perf_counter() - t0) * 1000))

    def _topbar_text(self) -> Text:
        t = Text(" tailpilot ", style="bold reverse")
        name = getattr(self.source, "cluster_name", "?")
        t.append(f" cluster {name} ", style="bold")
        t.append(f"│ {self.source.status()} ")
        snap = self.snapshot
        if snap is not None:
            ok = sum(1 for rs in snap.replicas.values() if rs.health.healthy)
            t.append("│ ")
            t.append(f"{ok}/{len(snap.replicas)} healthy", style="green" if ok == len(snap.replicas) else "bold red")
            if self.mode_name == "live":
                t.append(f" · updated {time.strftime('%H:%M:%S', time.localtime(snap.t_ms / 1000))}")
        t.append(f" │ panel {self.panel} ")
        if self.selected:
            t.append(f"│ {len(self.selected)} selected ", style="magenta")
        if self.paused and self.mode_name == "live":
            t.append(" PAUSED ", style="bold black on yellow")
            t.append(" ")
        if self.readonly:
            t.append(" READ-ONLY ", style="bold white on red")
        return t

    def _update_topbar(self) -> None:
        self.query_one("#topbar", Static).update(self._topbar_text())

    # --- bindings ------------------------------------------------------------------------------
    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        k = K.KEYS_BY_ACTION.get(action)
        if k is None:
            return True
        if not K.key_available(k, mode=self.mode_name, panel=self.panel):
            return False
        if k.changes_cluster and self.readonly:
            # Live --readonly: greyed in the footer (the key exists, this session may not use it);
            # replay: hidden (history cannot be changed). Pressing it is refused in on_key.
            return False if self.mode_name == "replay" else None
        return True

    def on_key(self, event) -> None:
        k = K.KEYS_BY_KEY.get(event.key)
        if k is not None and k.changes_cluster and self.readonly and not isinstance(self.screen, ModalScreen):
            self.refuse(k)
            event.stop()

    def refuse(self, k: K.Key) -> None:
        self.refused.append(k.action_name)
        self.notify(f"{k.display}: {k.description.split(' (')[0].lower()} — refused: {self.readonly_reason()}",
                    title="read-only", severity="warning")

    async def invoke_key(self, k: K.Key) -> None:
        """Run a key's action from the command palette, with the same checks as the key."""
        if k.changes_cluster and self.readonly:
            self.refuse(k)
            return
        await self.run_action(k.action)

    # --- general actions -----------------------------------------------------------------------
    def action_help(self) -> None:
        self.push_screen(HelpScreen(self.readonly, self.mode_name))

    async def action_quit(self) -> None:
        self.exit()

    def action_toggle_pause(self) -> None:
        if self.mode_name == "replay":
            src = self.source
            src.set_playing(not src.playing)  # type: ignore[attr-defined]
        else:
            self.paused = not self.paused
            if not self.paused and self.source.current() is not None:
                self.apply_snapshot(self.source.current())  # type: ignore[arg-type]
        self._update_topbar()

    def action_filter(self) -> None:
        if self.panel != "cluster":
            self.action_panel("cluster")
        f = self.query_one("#filter", FilterInput)
        f.add_class("-shown")
        f.focus()

    @on(Input.Changed, "#filter")
    def _filter_changed(self, event: Input.Changed) -> None:
        panel = self.query_one(ClusterPanel)
        panel.filter_text = event.value.strip()
        panel._update_title()
        if self.snapshot is not None:
            panel.update_from(self, self.snapshot)

    @on(Input.Submitted, "#filter")
    def _filter_done(self, event: Input.Submitted) -> None:
        f = self.query_one("#filter", FilterInput)
        if not f.value.strip():
            f.remove_class("-shown")
        self.query_one("#cluster-table").focus()

    def action_panel(self, name: str) -> None:
        if name not in K.PANELS:
            return
        self.panel = name
        self.query_one("#panels", ContentSwitcher).current = name
        snap = self.snapshot
        if name == "cluster":
            self.query_one("#cluster-table").focus()
        elif name == "replica" and snap is not None:
            self.query_one(ReplicaPanel).update_from(self, snap)
        elif name == "policy":
            self.run_worker(self.query_one(PolicyPanel).load(), group="policy-load", exit_on_error=False)
        elif name == "audit":
            self.query_one("#audit-table", DataTable).focus()
            self.reload_audit()
        elif name == "tuner":
            panel = self.query_one(TunerPanel)
            self.query_one("#studies-table", DataTable).focus()
            self.run_worker(panel.load(), group="tuner-load", exclusive=True, exit_on_error=False)
        self._update_topbar()
        self.refresh_bindings()

    # --- cluster view --------------------------------------------------------------------------
    @on(ClusterTable.RowHighlighted, "#cluster-table")
    def _row_highlighted(self, event: ClusterTable.RowHighlighted) -> None:
        if isinstance(event, ClusterTable.RowSelected):
            return
        self.current_replica = event.row_key

    @on(ClusterTable.RowSelected, "#cluster-table")
    def _row_selected(self, event: ClusterTable.RowSelected) -> None:
        self.current_replica = event.row_key
        self.action_panel("replica")

    @on(ClusterTable.HeaderSelected, "#cluster-table")
    def _header_selected(self, event: ClusterTable.HeaderSelected) -> None:
        key = event.column_key
        if key in R.SORTABLE:
            self.query_one(ClusterPanel).set_sort(key)
            self._rerender_cluster()

    def action_open_replica(self) -> None:
        self.action_panel("replica")

    def _rerender_cluster(self) -> None:
        if self.snapshot is not None:
            self.query_one(ClusterPanel).update_from(self, self.snapshot)

    def action_sort_next(self) -> None:
        panel = self.query_one(ClusterPanel)
        cols = R.SORTABLE
        nxt = cols[(cols.index(panel.sort_column) + 1) % len(cols)] if panel.sort_column in cols else cols[0]
        panel.set_sort(nxt, reverse=panel.sort_reverse)
        self._rerender_cluster()

    def action_sort_reverse(self) -> None:
        panel = self.query_one(ClusterPanel)
        panel.set_sort(panel.sort_column or "replica", reverse=not panel.sort_reverse)
        self._rerender_cluster()

    def action_toggle_select(self) -> None:
        name = self.current_replica
        if name is None:
            return
        self.selected ^= {name}
        self.refresh_selection_marks()

    def action_select_all(self) -> None:
        snap = self.snapshot
        if snap is None:
            return
        panel = self.query_one(ClusterPanel)
        shown = [rs.name for rs in panel.visible(snap)]
        self.selected = set() if set(shown) <= self.selected else set(shown)
        self.refresh_selection_marks()

    def refresh_selection_marks(self) -> None:
        self._rerender_cluster()
        if self.panel == "policy":
            self.query_one(PolicyPanel).sync_targets()
        self._update_topbar()

    # --- replay --------------------------------------------------------------------------------
    def action_step(self, n: int) -> None:
        src = self.source
        if self.mode_name != "replay":
            return
        src.set_playing(False)  # type: ignore[attr-defined]
        src.step(int(n))  # type: ignore[attr-defined]
        self._update_topbar()

    def action_seek(self) -> None:
        if self.mode_name != "replay":
            return
        src = self.source

        def done(t: int | None) -> None:
            if t is not None:
                src.set_playing(False)  # type: ignore[attr-defined]
                src.seek(t)  # type: ignore[attr-defined]
                self._update_topbar()

        self.push_screen(SeekScreen(src.position, src.start_ms, src.end_ms), done)  # type: ignore[attr-defined]

    def action_speed(self, factor: float) -> None:
        if self.mode_name == "replay":
            speed = self.source.set_speed(float(factor))  # type: ignore[attr-defined]
            self.notify(f"replay speed {speed:g}x", timeout=2)
            self._update_topbar()

    # --- audit ---------------------------------------------------------------------------------
    @work(exclusive=True, group="audit", exit_on_error=False)
    async def reload_audit(self) -> None:
        try:
            rows = await self.source.audit(200)
        except Exception as err:  # noqa: BLE001
            log.warning("audit log unavailable: %s", err)
            return
        self.audit_cache = rows
        if self.panel == "audit":
            note = None
            if self.mode_name == "live" and getattr(self.source, "store", None) is None:
                note = "no --db: this session's changes only"
            self.query_one(AuditPanel).update_from(rows, note)

    # --- cluster changes -----------------------------------------------------------------------
    def _plans(self, edits: dict[str, SettingsEdit]) -> list[dict[str, Any]]:
        plans = []
        snap = self.snapshot
        for name, edit in edits.items():
            rs = snap.replicas.get(name) if snap else None
            cur = current_settings(rs.settings) if rs else None
            plan: dict[str, Any] = {"replica": name, "version": rs.settings_version if rs else None,
                                    "edit": edit.describe()}
            if cur is None:
                plan["old"] = None
            else:
                new, err = try_apply(edit, cur)
                plan["old"] = cur.to_dict()
                if err:
                    plan["error"] = err
                else:
                    plan["new"] = new.to_dict()  # type: ignore[union-attr]
                    if isinstance(edit, RecommendationEdit):
                        plan["kept_pins"] = edit.kept_pins(cur)
            plans.append(plan)
        return plans

    def confirm_and_apply(self, title: str, edits: dict[str, Any]) -> None:
        if self.readonly:
            return
        if not edits:
            self.notify("no target replica: move the cursor to one or select some with space", severity="warning")
            return
        plans = self._plans(edits)

        def done(ok: bool | None) -> None:
            if ok:
                sendable = {p["replica"]: edits[p["replica"]] for p in plans if not p.get("error")}
                self.apply_changes(sendable)

        self.push_screen(ConfirmScreen(title, plans), done)

    @work(group="apply", exit_on_error=False)
    async def apply_changes(self, edits: dict[str, SettingsEdit]) -> None:
        """Send the changes (GET, PUT If-Match, read back, audit row) without blocking the UI."""
        if self.readonly or not hasattr(self.source, "apply"):
            return
        self.notify(f"applying to {', '.join(edits)}…", timeout=3)
        try:
            results = await self.source.apply(edits, self.who)  # type: ignore[attr-defined]
        except Exception as err:  # noqa: BLE001
            log.exception("apply failed")
            self.notify(f"apply failed: {type(err).__name__}: {err}", severity="error", timeout=15)
            return
        self.last_results = results
        if any(r.ok for r in results):
            self.query_one(PolicyPanel).reload_after_apply = True
        for r in results:
            sev = "information" if r.ok else ("warning" if r.result == "rejected" else "error")
            self.notify(f"{r.replica}: {r.message}", title=r.result, severity=sev, timeout=8)
        self.query_one(PolicyPanel).show_results(results)
        self.query_one(TunerPanel).show_results(results)
        self.reload_audit()  # the form rebuilds when the next snapshot brings the new version

    def action_switch_policy(self) -> None:
        targets = self.targets()
        if not targets:
            self.notify("no target replica", severity="warning")
            return
        snap = self.snapshot
        current = {n: (R.policy_of(snap.replicas[n]) if snap and n in snap.replicas else None) for n in targets}

        def picked(policy: str | None) -> None:
            if policy:
                self.confirm_and_apply(f"Switch {len(targets)} replica(s) to {policy}?",
                                       {n: SettingsEdit(policy=policy) for n in targets})

        self.push_screen(PolicyPickScreen(targets, current), picked)

    async def action_edit_params(self) -> None:
        self.action_panel("policy")
        panel = self.query_one(PolicyPanel)
        await panel.load(force=True)
        panel.focus_form()

    def action_toggle_pin(self) -> None:
        snap = self.snapshot
        edits: dict[str, SettingsEdit] = {}
        skipped = []
        for name in self.targets():
            rs = snap.replicas.get(name) if snap else None
            if rs is None:
                continue
            s = rs.sample
            live = {"gamma": s.gamma_live if s else None, "beta": s.beta_live if s else None}
            edit, what = pin_edit(current_settings(rs.settings), R.policy_of(rs), live)
            if edit is None:
                skipped.append(f"{name}: {what}")
            else:
                edits[name] = edit
        if skipped:
            self.notify("; ".join(skipped), severity="warning")
        if edits:
            self.confirm_and_apply("Pin / unpin the adaptive parameter?", edits)

    def action_apply_edits(self) -> None:
        panel = self.query_one(PolicyPanel)
        if panel.form_policy is None:
            return
        if panel.error:
            self.notify(f"not valid: {panel.error}", severity="error")
            return
        edit = panel.current_edit()
        if edit.empty:
            self.notify("no changes staged", severity="warning")
            return
        targets = self.targets()
        self.confirm_and_apply(f"Apply {edit.describe()} to {len(targets)} replica(s)?",
                               {n: edit for n in targets})

    def action_apply_recommendation(self) -> None:
        """``R`` in the tuner panel: the shown recommendation to the selected replicas (all when
        none is selected), pinned parameters kept, through the confirmation with the diff."""
        panel = self.query_one(TunerPanel)
        rec = panel.current_rec()
        if rec is None or rec.summary is None or not rec.summary.get("settings"):
            why = "still computing" if rec is None and panel.study else (rec.error if rec else "no study selected")
            self.notify(f"no recommendation to apply: {why}", severity="warning")
            return
        known = sorted(self.snapshot.replicas) if self.snapshot else (
            [r.name for r in self.cluster.replicas] if self.cluster else [])
        targets = sorted(n for n in self.selected if n in known) if self.selected else known
        s = rec.summary
        edit = RecommendationEdit(dict(s["settings"]), study=str(s.get("study") or panel.study or ""),
                                  trial=s.get("trial"))
        which = "selected" if self.selected else "all"
        self.confirm_and_apply(f"Apply the recommendation of study {edit.study} (trial {edit.trial}) to "
                               f"{len(targets)} replica(s) ({which})? Pinned parameters are kept.",
                               {n: edit for n in targets})



def _user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # noqa: BLE001
        return "operator"

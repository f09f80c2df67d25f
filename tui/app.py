"""The operator TUI (Textual): live cluster view, replica drill-down, policy switching and
pinning, audit log, the governor and the autopilot, and replay of recordings on the same screens.

The app is thin: each panel is its own module (``cluster_panel``, ``replica_panel``,
``policy_panel``, ``audit_panel``, ``tuner_panel``, ``alerts_panel`` with ``autopilot_panel``),
the modal screens are ``dialogs``, steering the governor and the autopilot ``controllers``,
changing settings through the confirm dialog ``changes``, the styles ``app.tcss``, the keys one
table (``keys``), and what a panel shows is a pure render function (``render``,
``alerts_render``, ``dialog_render``, ``autopilot_render``, ``tuner_render``). The data comes
from ``sources`` (live) or ``replay`` (a recording).

Data flow: one pump task awaits ``source.next_snapshot()`` and applies each snapshot before it
reads the next (refreshes never overlap); the cluster table is updated cell by cell in place.
Attributes down, messages up: the app sets each panel's reactive data (the selection and the
current replica are the app's reactives, bound to the panels with ``data_bind``), and a panel asks
the app for what only the app may do with a message (``PolicyPanel.ApplyRequested``).
Polling happens in the collector (asyncio, in this event loop), store reads in threads, settings
changes in workers: nothing the operator presses waits on the network.
"""

from __future__ import annotations

import getpass
import logging
import time
from collections import deque
from collections.abc import Set
from typing import Any

from rich.text import Text
from textual import events, on, work
from textual.app import App, ComposeResult
from textual.reactive import var
from textual.screen import ModalScreen
from textual.widgets import (
    ContentSwitcher,
    DataTable,
    Footer,
    Static,
)

from controlplane.cluster import ClusterSpec
from controlplane.snapshot import ClusterSnapshot
from controlplane.steering import ApplyResult
from controlplane.views import alert_text
from tui import keys as K
from tui import render as R
from tui.alerts_panel import AlertsPanel
from tui.audit_panel import AuditData, AuditPanel
from tui.changes import ChangeActions
from tui.cluster_panel import ClusterData, ClusterPanel
from tui.controllers import ControllerActions
from tui.dialogs import HelpScreen, SeekScreen
from tui.edits import RecommendationEdit, edit_targets
from tui.policy_panel import PolicyPanel
from tui.replay import ReplaySource
from tui.replica_panel import ReplicaData, ReplicaPanel
from tui.sources import DataSource
from tui.tuner_panel import TunerPanel
from tui.widgets import ClusterTable

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------- the app


class TailpilotApp(ControllerActions, ChangeActions, App[None]):
    """``TailpilotApp(source, cluster_spec, readonly=..., store=...)``."""

    TITLE = "tailpilot"
    CSS_PATH = "app.tcss"
    BINDINGS = K.bindings()
    COMMANDS = App.COMMANDS | {K.KeyCommands}
    ENABLE_COMMAND_PALETTE = True

    selected: var[frozenset[str]] = var(frozenset())
    """The replicas selected with space (P, N and A act on them; the cluster panel marks them)."""
    current_replica: var[str | None] = var(None)
    """The replica under the cluster table's cursor (the replica panel shows it)."""

    def __init__(
        self,
        source: DataSource,
        cluster_spec: ClusterSpec | None = None,
        *,
        readonly: bool = False,
        store: Any | None = None,
        who: str | None = None,
        optuna_storage: str | None = None,
    ) -> None:
        super().__init__()
        self.optuna_storage = optuna_storage  # None: ./tailpilot-optuna.db if it exists
        self.source = source
        self.cluster = cluster_spec
        self.store = store
        self.mode_name = source.mode
        self._readonly_flag = bool(readonly)
        self.who = who or f"tui:{_user()}"
        self.snapshot: ClusterSnapshot | None = None
        self.panel = "cluster"
        self.paused = False
        self.audit_cache: list[dict[str, Any]] = []
        self.fidelity_cache: dict[str, dict[str, Any]] = {}  # replica -> newest fidelity report
        self.verification_cache: dict[
            tuple[str, Any], dict[str, Any]
        ] = {}  # (replica, version) -> verify
        self.last_results: list[ApplyResult] = []
        self.snapshots_applied = 0
        self.apply_ms: deque[float] = deque(maxlen=10_000)
        self.refresh_ms: deque[float] = deque(maxlen=10_000)
        self.refused: list[str] = []  # actions refused as read-only (for tests and the log)
        self._audit_every = 10
        self.exit_after_s: float | None = None  # run_tui(duration_s=...): quit on its own
        self.controls = {}  # the governor's and the autopilot's control rows (the strip)

    # --- state ---------------------------------------------------------------------------------
    @property
    def readonly(self) -> bool:
        return self._readonly_flag or bool(getattr(self.source, "readonly", False))

    def readonly_reason(self) -> str:
        if self._readonly_flag:
            return "--readonly"
        return "replay is read-only"

    def validate_selected(self, names: Set[str]) -> frozenset[str]:
        # Any set may be assigned; a frozen one, so that only assigning a new one changes it.
        return frozenset(names)

    def targets(self) -> list[str]:
        """What P, N and A act on: the selection, else the replica under the cursor."""
        return edit_targets(
            self.selected, self.current_replica, self.snapshot.replicas if self.snapshot else None
        )

    # --- layout --------------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield Static(self._topbar_text(), id="topbar")
        yield Static("", id="alertbar")  # the firing governance alerts, on every panel
        # What steers the cluster, on every panel while a controller reports (the demo's first
        # screen): the autopilot's choices and promise, the tenants' SCR and JFI, the governor.
        yield Static("", id="controlsbar")
        with ContentSwitcher(initial="cluster", id="panels"):
            yield ClusterPanel(id="cluster").data_bind(
                TailpilotApp.selected, cursor_replica=TailpilotApp.current_replica
            )
            yield ReplicaPanel(
                window_s=self.cluster.window_s if self.cluster else None,
                slos=self.cluster.slos if self.cluster else None,
                history_s=self.source.history_s,
                id="replica",
            )
            yield PolicyPanel(
                replicas=[r.name for r in self.cluster.replicas] if self.cluster else [],
                readonly_reason=self.readonly_reason() if self.readonly else None,
                id="policy",
            ).data_bind(TailpilotApp.selected, TailpilotApp.current_replica)
            yield AuditPanel(id="audit")
            yield TunerPanel(self.optuna_storage, store=self.store, id="tuner")
            yield AlertsPanel(id="alerts")
        yield Footer()

    async def on_mount(self) -> None:
        self.query_one("#cluster-table").focus()
        try:
            await self.source.start()
        except Exception as err:
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
            if not self.is_running:  # the app is closing: its panels are being taken down
                return
            if self.paused and self.mode_name == "live":
                continue
            try:
                self.apply_snapshot(snap)
            except Exception as err:
                log.exception("applying a snapshot failed")
                self.notify(f"display error: {type(err).__name__}: {err}", severity="error")

    def apply_snapshot(self, snap: ClusterSnapshot) -> None:
        """Put one snapshot on the screen (synchronously; the render follows)."""
        t0 = time.perf_counter()
        first = self.snapshot is None
        self.snapshot = snap
        if self.current_replica is None or self.current_replica not in snap.replicas:
            self.current_replica = min(snap.replicas) if snap.replicas else None
        trails = {name: self.source.kv_trail(name, R.SPARK_LEN) for name in snap.replicas}
        self.query_one(ClusterPanel).data = ClusterData(snap, trails)
        policy = self.query_one(PolicyPanel)
        policy.snapshot = snap  # also while hidden: the panel reads it when shown
        if self.panel == "replica":
            self._show_replica(snap)
        elif self.panel == "policy":
            policy.follow_snapshot()
        bar = self.query_one("#alertbar", Static)
        bar.update(alert_text(snap.governance))
        bar.set_class(bool(snap.governance and snap.governance.get("alerts")), "-firing")
        bar.set_class(snap.governance is not None, "-shown")
        self.show_controls()
        if self.panel == "alerts":
            self.reload_alerts()
        if first or self.snapshots_applied % self._controls_every == 0:
            self.reload_controls()
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
            t.append(
                f"{ok}/{len(snap.replicas)} healthy",
                style="green" if ok == len(snap.replicas) else "bold red",
            )
            if self.mode_name == "live":
                t.append(
                    f" · updated {time.strftime('%H:%M:%S', time.localtime(snap.t_ms / 1000))}"
                )
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

    def on_key(self, event: events.Key) -> None:
        k = K.KEYS_BY_KEY.get(event.key)
        if (
            k is not None
            and k.changes_cluster
            and self.readonly
            and not isinstance(self.screen, ModalScreen)
        ):
            self.refuse(k)
            event.stop()

    def refuse(self, k: K.Key) -> None:
        self.refused.append(k.action_name)
        self.notify(
            f"{k.display}: {k.description.split(' (')[0].lower()} — "
            f"refused: {self.readonly_reason()}",
            title="read-only",
            severity="warning",
        )

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
        replay = self._replay()
        if replay is not None:
            replay.set_playing(not replay.playing)
        else:
            self.paused = not self.paused
            current = self.source.current()
            if not self.paused and current is not None:
                self.apply_snapshot(current)
        self._update_topbar()

    def action_filter(self) -> None:
        if self.panel != "cluster":
            self.action_panel("cluster")
        self.query_one(ClusterPanel).open_filter()

    def action_panel(self, name: str) -> None:
        if name not in K.PANELS:
            return
        self.panel = name
        self.query_one("#panels", ContentSwitcher).current = name
        snap = self.snapshot
        if name == "cluster":
            self.query_one("#cluster-table").focus()
        elif name == "replica" and snap is not None:
            self._show_replica(snap)
        elif name == "policy":
            self.run_worker(
                self.query_one(PolicyPanel).load(), group="policy-load", exit_on_error=False
            )
        elif name == "audit":
            self.query_one("#audit-table", DataTable).focus()
            self.reload_audit()
        elif name == "alerts":
            self.query_one("#alerts-tenants", DataTable).focus()
            self.reload_alerts()
        elif name == "tuner":
            panel = self.query_one(TunerPanel)
            self.query_one("#studies-table", DataTable).focus()
            self.run_worker(panel.load(), group="tuner-load", exclusive=True, exit_on_error=False)
        self.show_controls()
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

    def action_open_replica(self) -> None:
        self.action_panel("replica")

    def action_sort_next(self) -> None:
        self.query_one(ClusterPanel).sort_next()

    def action_sort_reverse(self) -> None:
        self.query_one(ClusterPanel).reverse_sort()

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
        shown = [rs.name for rs in panel.visible_rows(snap)]
        self.selected = frozenset() if set(shown) <= self.selected else frozenset(shown)
        self.refresh_selection_marks()

    def refresh_selection_marks(self) -> None:
        """After the selection changed (the cluster panel's marks follow its bound ``selected``)."""
        if self.panel == "policy":
            self.query_one(PolicyPanel).sync_targets()
        self._update_topbar()

    # --- replay --------------------------------------------------------------------------------
    def _replay(self) -> ReplaySource | None:
        """The source when it is a recording (seek, step, play), else None."""
        return self.source if isinstance(self.source, ReplaySource) else None

    def action_step(self, n: int) -> None:
        src = self._replay()
        if src is None:
            return
        src.set_playing(False)
        src.step(int(n))
        self._update_topbar()

    def action_seek(self) -> None:
        src = self._replay()
        if src is None:
            return

        def done(t: int | None) -> None:
            if t is not None:
                src.set_playing(False)
                src.seek(t)
                self._update_topbar()

        self.push_screen(SeekScreen(src.position, src.start_ms, src.end_ms), done)

    def action_speed(self, factor: float) -> None:
        src = self._replay()
        if src is not None:
            speed = src.set_speed(float(factor))
            self.notify(f"replay speed {speed:g}x", timeout=2)
            self._update_topbar()

    # --- audit ---------------------------------------------------------------------------------
    @work(exclusive=True, group="audit", exit_on_error=False)
    async def reload_audit(self) -> None:
        try:
            rows = await self.source.audit(200)
        except Exception as err:
            log.warning("audit log unavailable: %s", err)
            return
        self.audit_cache = rows
        await self._reload_fidelity()
        if self.panel == "audit":
            note = None
            if self.mode_name == "live" and getattr(self.source, "store", None) is None:
                note = "no --db: this session's changes only"
            panel = self.query_one(AuditPanel)
            panel.data = AuditData(rows, note, self.verification_cache)
            try:  # replays: shown when done, the table first
                self.verification_cache = await self.source.verifications()
            except Exception as err:
                log.warning("verifications unavailable: %s", err)
                return
            panel.data = AuditData(rows, note, self.verification_cache)

    async def _reload_fidelity(self) -> None:
        # Reloaded with the audit log (same cadence: fidelity reports are rare).
        try:
            self.fidelity_cache = await self.source.fidelity()
        except Exception as err:
            log.warning("fidelity reports unavailable: %s", err)
            return
        if self.panel == "replica":
            name = self.current_replica
            self.query_one(ReplicaPanel).fidelity = self.fidelity_cache.get(name) if name else None

    def _show_replica(self, snap: ClusterSnapshot) -> None:
        """The replica panel: the current replica in ``snap``, its history and fidelity report."""
        name = self.current_replica
        panel = self.query_one(ReplicaPanel)
        panel.fidelity = self.fidelity_cache.get(name) if name else None
        panel.data = ReplicaData(
            snap, name, self.source.history(name, snap.t_ms) if name else [], self.audit_cache
        )

    # --- cluster changes -----------------------------------------------------------------------
    @on(PolicyPanel.SelectionChanged)
    def _policy_selection_changed(self, event: PolicyPanel.SelectionChanged) -> None:
        self.selected = event.selected
        self.refresh_selection_marks()

    @on(PolicyPanel.ApplyRequested)
    def _policy_apply_requested(self, event: PolicyPanel.ApplyRequested) -> None:
        if self.readonly:
            self.refuse(K.KEYS_BY_ACTION["apply_edits"])
        else:
            self.action_apply_edits()

    async def action_edit_params(self) -> None:
        self.action_panel("policy")
        panel = self.query_one(PolicyPanel)
        await panel.load(force=True)
        panel.focus_form()

    def action_apply_recommendation(self) -> None:
        """``R`` in the tuner panel: the shown recommendation to the selected replicas (all when
        none is selected), pinned parameters kept, through the confirmation with the diff."""
        panel = self.query_one(TunerPanel)
        rec = panel.current_rec()
        if rec is None or rec.summary is None or not rec.summary.get("settings"):
            why = (
                "still computing"
                if rec is None and panel.study
                else (rec.error if rec else "no study selected")
            )
            self.notify(f"no recommendation to apply: {why}", severity="warning")
            return
        known = (
            sorted(self.snapshot.replicas)
            if self.snapshot
            else ([r.name for r in self.cluster.replicas] if self.cluster else [])
        )
        targets = sorted(n for n in self.selected if n in known) if self.selected else known
        s = rec.summary
        edit = RecommendationEdit(
            dict(s["settings"]),
            study=str(s.get("study") or panel.study or ""),
            trial=s.get("trial"),
        )
        which = "selected" if self.selected else "all"
        self.confirm_and_apply(
            f"Apply the recommendation of study {edit.study} (trial {edit.trial}) to "
            f"{len(targets)} replica(s) ({which})? Pinned parameters are kept.",
            {n: edit for n in targets},
        )


def _user() -> str:
    try:
        return getpass.getuser()
    except Exception:
        return "operator"

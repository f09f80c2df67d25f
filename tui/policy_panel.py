"""The policy panel: switch a policy, edit and pin parameters for one, several or all replicas.

It shows its reactive data: ``snapshot`` and ``last_results``, set by the app, and ``selected`` and
``current_replica``, bound to the app's (``data_bind``); ``targets`` is computed from them as the
app computes its own (``edits.edit_targets``). What the operator asks for goes to the app as
messages: :class:`PolicyPanel.SelectionChanged` (the targets list) and
:class:`PolicyPanel.ApplyRequested` (enter in a field).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, ClassVar

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.message import Message
from textual.reactive import var
from textual.widget import Widget
from textual.widgets import (
    Checkbox,
    Input,
    Label,
    Select,
    SelectionList,
    Static,
)

from controlplane.snapshot import ClusterSnapshot, ReplicaSnapshot
from scheduler.settings import POLICY_NAMES, Settings
from tui import render as R
from tui.edits import (
    FieldSpec,
    SettingsChange,
    current_settings,
    edit_targets,
    field_errors,
    field_text,
    parse_field,
    policy_fields,
    settings_diff,
    try_apply,
)


class PolicyPanel(Vertical):
    """Switch, edit and pin: one input per parameter of the chosen policy, validated inline by
    the settings model; ``A`` (or enter in a field) opens the confirmation with the diff.

    ``PolicyPanel(replicas=..., readonly_reason=...)``: the cluster file's replicas (the targets
    before the first snapshot) and why this session cannot change the cluster (None: it can).
    """

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "leave_form", "Leave the form", show=False)
    ]

    class SelectionChanged(Message):
        """The operator changed the selection in the targets list: the app's to make (the
        panel's ``selected`` follows at once, until the app's binding sets it)."""

        def __init__(self, selected: frozenset[str]) -> None:
            super().__init__()
            self.selected = selected

    class ApplyRequested(Message):
        """Enter in a field of the form: review and apply the staged edit (as ``A``)."""

    snapshot: var[ClusterSnapshot | None] = var(None, init=False, always_update=True)
    """The newest snapshot (the replicas and their settings)."""
    selected: var[frozenset[str]] = var(frozenset(), init=False)
    """The selected replicas."""
    current_replica: var[str | None] = var(None, init=False)
    """The replica under the cluster table's cursor (the target when none is selected)."""
    targets: var[tuple[str, ...]] = var(())
    """What an edit goes to (computed)."""
    last_results: var[Sequence[Any]] = var((), init=False, always_update=True)
    """What the last apply did, per replica (``ApplyResult``s)."""

    def action_leave_form(self) -> None:
        self.query_one("#targets", SelectionList).focus()

    def __init__(
        self, *, replicas: Sequence[str] = (), readonly_reason: str | None = None, **kw: Any
    ) -> None:
        super().__init__(**kw)
        self.cluster_replicas = tuple(replicas)
        self.readonly_reason = readonly_reason
        self.fields: list[FieldSpec] = []
        self.initial: dict[str, Any] = {}
        self.initial_pins: set[str] = set()
        self.form_policy: str | None = None
        self.reference: str | None = None
        self.ref_policy: str | None = (
            None  # the reference replica's policy (from its settings or samples)
        )
        self.error: str | None = None
        self._gen = 0
        self._syncing = False
        self.form_version: int | None = (
            None  # the reference's settings version the form was built from
        )
        self.reload_after_apply = False
        self._loading = False
        # One rebuild at a time: the form is rebuilt from several places (opening the panel, E,
        # the policy select, a new settings version), and a second rebuild's remove_children
        # must never remove the rows a first one is still mounting (a half-mounted Select
        # raises NoMatches in its own on_mount, which takes the app down).
        self._form_lock = asyncio.Lock()

    def compose(self) -> ComposeResult:
        yield Static("", id="policy-banner")
        with Horizontal():
            with Vertical(id="targets-box"):
                yield Static(Text("targets (space: toggle)", style="bold"))
                yield SelectionList[str](id="targets", compact=True)
            with Vertical(id="editor"):
                with Horizontal(id="policy-row"):
                    yield Label("policy")
                    yield Select(
                        [(p, p) for p in POLICY_NAMES],
                        allow_blank=False,
                        value="sarathi",
                        id="policy-select",
                        compact=True,
                    )
                yield VerticalScroll(id="form")
                yield Static("", id="preview")
                yield Static("", id="last-result")

    # --- the data --------------------------------------------------------------------------
    def compute_targets(self) -> tuple[str, ...]:
        snap = self.snapshot
        return tuple(
            edit_targets(self.selected, self.current_replica, snap.replicas if snap else None)
        )

    def watch_last_results(self, results: Sequence[Any]) -> None:
        if any(r.ok for r in results):
            self.reload_after_apply = (
                True  # rebuild the form when the new version arrives, edits or not
            )
        self.query_one("#last-result", Static).update(R.apply_results(results))

    def _replica(self, name: str | None) -> ReplicaSnapshot | None:
        snap = self.snapshot
        return snap.replicas.get(name) if snap is not None and name else None

    # --- loading ---------------------------------------------------------------------------
    def sync_targets(self) -> None:
        snap = self.snapshot
        names = sorted(snap.replicas) if snap else list(self.cluster_replicas)
        sel = self.query_one("#targets", SelectionList)
        self._syncing = True
        try:
            if [str(sel.get_option_at_index(i).value) for i in range(sel.option_count)] != names:
                sel.clear_options()
                sel.add_options([(n, n, n in self.selected) for n in names])
            else:
                for n in names:
                    if (n in self.selected) != (n in sel.selected):
                        (sel.select if n in self.selected else sel.deselect)(n)
        finally:
            self._syncing = False
        self._update_banner()

    def follow_snapshot(self) -> None:
        """After each new ``snapshot`` while the panel is shown: keep the targets in sync, and
        rebuild the form when the reference replica's settings changed — at once after our own apply
        or when nothing is staged; otherwise only say so (staged edits are never thrown away)."""
        self.sync_targets()
        rs = self._replica(self.reference)
        if rs is None or self.form_policy is None or self._loading or self.building:
            return  # the next snapshot looks again once the rebuild under way is done
        if rs.settings_version != self.form_version and rs.settings is not None:
            if self.reload_after_apply or self.current_edit().empty:
                self.reload_after_apply = False
                self._loading = True
                self.run_worker(self._reload(), group="policy-load", exit_on_error=False)
            else:
                self._update_banner()

    async def _reload(self) -> None:
        try:
            await self.load(force=True)
        finally:
            self._loading = False

    def _update_banner(self) -> None:
        targets = self.targets
        banner = self.query_one("#policy-banner", Static)
        text = Text()
        if self.readonly_reason is not None:
            text.append(" READ-ONLY ", style="bold white on red")
            text.append(f" {self.readonly_reason}: switching, editing and pinning are disabled.  ")
            banner.add_class("-readonly")
        how = "selection" if self.selected else "cursor replica; select several with space"
        text.append(f"targets: {', '.join(targets) or 'none'} ({how})")
        if self.reference:
            rs = self._replica(self.reference)
            v = rs.settings_version if rs else None
            if self.reference_settings() is None:
                text.append(
                    f" │ {self.reference}'s settings are unknown: the form shows the defaults",
                    style="yellow",
                )
            else:
                text.append(f" │ form shows {self.reference}'s settings (v{self.form_version})")
                if v is not None and self.form_version is not None and v != self.form_version:
                    text.append(
                        f" — the replica is now at v{v}: apply re-reads it (If-Match)",
                        style="yellow",
                    )
        banner.update(text)

    async def load(self, *, force: bool = False) -> None:
        """(Re)build the form from the first target's current settings."""
        self.sync_targets()
        targets = self.targets
        ref = targets[0] if targets else None
        rs = self._replica(ref)
        settings = current_settings(rs.settings) if rs else None
        known = settings.policy if settings else (R.policy_of(rs) if rs else None)
        policy = known or "sarathi"
        if (
            not force
            and ref == self.reference
            and known == self.ref_policy
            and self.form_policy is not None
        ):
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

    def reference_settings(self) -> Settings | None:
        rs = self._replica(self.reference)
        return current_settings(rs.settings) if rs else None

    @property
    def building(self) -> bool:
        """Whether the form is being rebuilt (its fields are not all there to read)."""
        return self._form_lock.locked()

    async def _build_form(self, policy: str) -> None:
        async with self._form_lock:
            await self._build_form_locked(policy)

    async def _build_form_locked(self, policy: str) -> None:
        ref = self.reference_settings()
        rs = self._replica(self.reference)
        self.form_version = rs.settings_version if rs is not None else None
        self.form_policy = policy
        self.fields = policy_fields(policy)
        same = ref if ref is not None and ref.policy == policy else None  # its values shown
        self.initial = {
            f.name: (same.param(f.name) if same is not None else f.default) for f in self.fields
        }
        self.initial_pins = set(same.pinned) if same is not None else set()
        self._gen += 1
        form = self.query_one("#form", VerticalScroll)
        await form.remove_children()
        rows: list[Widget] = []
        disabled = self.readonly_reason is not None
        for f in self.fields:
            wid = f"f{self._gen}-{f.name}"
            value = self.initial[f.name]
            widget: Widget
            if f.kind == "bool":
                widget = Checkbox(
                    "on",
                    value=bool(value),
                    id=wid,
                    disabled=disabled,
                    compact=True,
                    classes="fvalue",
                )
            elif f.kind == "choice":
                widget = Select(
                    [(c, c) for c in f.choices],
                    value=str(value),
                    allow_blank=False,
                    id=wid,
                    disabled=disabled,
                    compact=True,
                )
            else:
                widget = Input(value=field_text(f, value), id=wid, disabled=disabled, compact=True)
            label = Label(f.name + (" ~" if f.adaptive else ""), classes="fname")
            pin = Checkbox(
                "pin",
                value=f.name in self.initial_pins,
                id=f"p{self._gen}-{f.name}",
                disabled=disabled,
                compact=True,
                classes="fpin",
            )
            hint = Static(
                f.hint + ("; adapts live unless pinned" if f.adaptive else ""),
                classes="fhint",
                id=f"h{self._gen}-{f.name}",
            )
            rows.append(Horizontal(label, widget, pin, hint, classes="form-row"))
        if not rows:
            rows.append(Static(Text(f"{policy} has no parameters.", style="dim")))
        await form.mount_all(rows)
        self._revalidate()

    # --- editing ---------------------------------------------------------------------------
    def _value_of(self, f: FieldSpec) -> Any:
        w = self.query_one(f"#f{self._gen}-{f.name}")
        if isinstance(w, Checkbox):
            return w.value
        if isinstance(w, Select):
            return w.value
        assert isinstance(w, Input)  # the form's third kind of value widget
        return parse_field(f, w.value)

    def current_edit(self) -> SettingsChange:
        params = {}
        pins = set()
        for f in self.fields:
            v = self._value_of(f)
            if v != self.initial[f.name] or (
                type(v) is str and not isinstance(self.initial[f.name], str)
            ):
                params[f.name] = v
            if self.query_one(f"#p{self._gen}-{f.name}", Checkbox).value:
                pins.add(f.name)
        policy = self.form_policy if self.form_policy != self.ref_policy else None
        return SettingsChange(
            policy=policy,
            params=params,
            pin=frozenset(pins - self.initial_pins),
            unpin=frozenset(self.initial_pins - pins),
        )

    def revalidate(self) -> None:
        """Run the edit through the settings model; mark the fields it names."""
        if (not self.fields and self.form_policy is None) or self.building:
            return  # the rebuild validates the form it mounts
        self._revalidate()

    def _revalidate(self) -> None:
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
            preview.append(f"staged for {len(self.targets)} replica(s): ", style="bold")
            preview.append(edit.describe())
            rows = settings_diff(ref.to_dict(), new.to_dict()) if new else []
            for fld, a, b in rows:
                preview.append(f"\n  {fld}: ")
                preview.append(a, style="red")
                preview.append(" → ")
                preview.append(b, style="green")
            preview.append(
                "\npress A to review and apply",
                style="bold yellow" if self.readonly_reason is None else "dim",
            )
        self.query_one("#preview", Static).update(preview)

    @on(Input.Changed)
    @on(Checkbox.Changed)
    def _field_changed(self, event: Input.Changed | Checkbox.Changed) -> None:
        wid = event.control.id or ""
        if wid.startswith((f"f{self._gen}-", f"p{self._gen}-")):
            self.revalidate()

    @on(Input.Submitted)
    def _field_submitted(self, event: Input.Submitted) -> None:
        if event.input.id and event.input.id.startswith(f"f{self._gen}-"):
            event.stop()
            self.post_message(self.ApplyRequested())

    @on(Select.Changed)
    async def _select_changed(self, event: Select.Changed) -> None:
        if event.select.id == "policy-select":
            if self._syncing or event.value == self.form_policy or event.value is Select.BLANK:
                return
            await self._build_form(str(event.value))
        elif event.select.id and event.select.id.startswith(f"f{self._gen}-"):
            self.revalidate()

    @on(SelectionList.SelectedChanged, "#targets")
    async def _targets_changed(self, event: SelectionList.SelectedChanged[str]) -> None:
        if self._syncing:
            return
        # The app selects them (and binds its selection back here); the form follows at once.
        self.selected = frozenset(str(v) for v in event.selection_list.selected)
        self.post_message(self.SelectionChanged(self.selected))
        await self.load()

    def focus_form(self) -> None:
        for w in self.query("#form Input, #form Checkbox, #form Select"):
            if not w.disabled:
                w.focus()
                return
        self.query_one("#policy-select", Select).focus()

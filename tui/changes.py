"""The app's side of changing the cluster: ``P`` (switch policy), ``N`` (pin / unpin the adaptive
parameter), ``A`` (apply the policy panel's edits) and the tuner panel's ``R`` all go through one
confirm dialog (each replica's settings diff and, live, the what-if of the change on its recorded
traffic), then one apply worker (GET, PUT If-Match, read back, audit row) that never blocks the UI.

A mixin of :class:`tui.app.TailpilotApp` (kept apart so the app stays thin), like
:mod:`tui.controllers`: it uses the app's ``source``, ``snapshot``, ``who``, ``readonly``,
``targets()`` and ``reload_audit()``, and Textual's ``notify`` / ``push_screen`` / ``query_one``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from textual import work
from textual.notifications import SeverityLevel

from controlplane.snapshot import ClusterSnapshot
from controlplane.steering import ApplyResult
from tui import render as R
from tui.dialogs import ConfirmScreen, PolicyPickScreen
from tui.edits import (
    Edit,
    RecommendationEdit,
    SettingsChange,
    current_settings,
    pin_edit,
    try_apply,
)
from tui.policy_panel import PolicyPanel
from tui.sources import DataSource, LiveSource
from tui.tuner_panel import TunerPanel

log = logging.getLogger(__name__)

if TYPE_CHECKING:  # the mixin's methods run on the app: type-check them as the app's
    from textual.app import App
    from textual.worker import Worker

    _AppBase = App[None]
else:
    _AppBase = object

PREVIEW_MINUTES = 10.0  # the confirm dialog's what-if replays each replica's last this many minutes


class ChangeActions(_AppBase):
    """confirm_and_apply, apply_changes and the keys that change settings (P, N, A) of the app."""

    source: DataSource
    snapshot: ClusterSnapshot | None
    who: str
    last_results: list[ApplyResult]

    if TYPE_CHECKING:  # the app's, used here

        @property
        def readonly(self) -> bool: ...

        def targets(self) -> list[str]: ...

        def reload_audit(self) -> Worker[None]: ...

    def _plans(self, edits: Mapping[str, Edit]) -> list[dict[str, Any]]:
        """What the confirm dialog shows per target: the settings now and after the edit, or why
        the edit is not sent."""
        plans = []
        snap = self.snapshot
        for name, edit in edits.items():
            rs = snap.replicas.get(name) if snap else None
            cur = current_settings(rs.settings) if rs else None
            plan: dict[str, Any] = {
                "replica": name,
                "version": rs.settings_version if rs else None,
                "edit": edit.describe(),
            }
            if cur is None:
                plan["old"] = None
            else:
                new, err = try_apply(edit, cur)
                plan["old"] = cur.to_dict()
                if err:
                    plan["error"] = err
                else:
                    assert new is not None  # try_apply gives a document or an error
                    plan["new"] = new.to_dict()
                    if isinstance(edit, RecommendationEdit):
                        plan["kept_pins"] = edit.kept_pins(cur)
            plans.append(plan)
        return plans

    def confirm_and_apply(self, title: str, edits: Mapping[str, Edit]) -> None:
        """The confirm dialog (each replica's diff, and live its what-if); the edits go out when
        the operator confirms."""
        if self.readonly:
            return
        if not edits:
            self.notify(
                "no target replica: move the cursor to one or select some with space",
                severity="warning",
            )
            return
        plans = self._plans(edits)
        predictions: dict[str, Any] = {}
        what_if = isinstance(self.source, LiveSource)  # a what-if needs the recorded traffic

        def done(ok: bool | None) -> None:
            if ok:
                sendable = {p["replica"]: edits[p["replica"]] for p in plans if not p.get("error")}
                self.apply_changes(sendable, predictions)

        screen = ConfirmScreen(title, plans, PREVIEW_MINUTES if what_if else None)
        self.push_screen(screen, done)
        if what_if:
            self._predict(screen, plans, predictions)

    @work(group="predict", exit_on_error=False)
    async def _predict(
        self, screen: ConfirmScreen, plans: list[dict[str, Any]], into: dict[str, Any]
    ) -> None:
        """The what-if of the confirm dialog, off the UI thread; kept with the change if applied."""
        source = self.source
        assert isinstance(source, LiveSource), "confirm_and_apply predicts only live"
        try:
            found = await source.predict(plans, PREVIEW_MINUTES)
        except Exception as err:
            log.warning("what-if failed: %s", err)
            found = {p["replica"]: f"{type(err).__name__}: {err}" for p in plans}
        into.update(found)
        screen.show_preview(found)

    @work(group="apply", exit_on_error=False)
    async def apply_changes(
        self, edits: Mapping[str, Edit], predictions: dict[str, Any] | None = None
    ) -> None:
        """Send the changes (GET, PUT If-Match, read back, audit row) without blocking the UI."""
        source = self.source
        if self.readonly or not isinstance(source, LiveSource):
            return
        self.notify(f"applying to {', '.join(edits)}…", timeout=3)
        applied_ms = int(source.clock() * 1000)
        try:
            results = await source.apply(edits, self.who)
            if predictions:
                await source.keep_predictions(results, predictions, applied_ms)
        except Exception as err:
            log.exception("apply failed")
            self.notify(f"apply failed: {type(err).__name__}: {err}", severity="error", timeout=15)
            return
        self.last_results = results
        for r in results:
            sev: SeverityLevel = (
                "information" if r.ok else ("warning" if r.result == "rejected" else "error")
            )
            self.notify(f"{r.replica}: {r.message}", title=r.result, severity=sev, timeout=8)
        self.query_one(PolicyPanel).last_results = results
        self.query_one(TunerPanel).last_results = results
        self.reload_audit()  # the form rebuilds when the next snapshot brings the new version

    def action_switch_policy(self) -> None:
        targets = self.targets()
        if not targets:
            self.notify("no target replica", severity="warning")
            return
        snap = self.snapshot
        current = {
            n: (R.policy_of(snap.replicas[n]) if snap and n in snap.replicas else None)
            for n in targets
        }

        def picked(policy: str | None) -> None:
            if policy:
                self.confirm_and_apply(
                    f"Switch {len(targets)} replica(s) to {policy}?",
                    {n: SettingsChange(policy=policy) for n in targets},
                )

        self.push_screen(PolicyPickScreen(targets, current), picked)

    def action_toggle_pin(self) -> None:
        snap = self.snapshot
        edits: dict[str, SettingsChange] = {}
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
        if panel.building:
            self.notify("the form is being rebuilt: apply again in a moment", severity="warning")
            return
        if panel.error:
            self.notify(f"not valid: {panel.error}", severity="error")
            return
        edit = panel.current_edit()
        if edit.empty:
            self.notify("no changes staged", severity="warning")
            return
        targets = self.targets()
        self.confirm_and_apply(
            f"Apply {edit.describe()} to {len(targets)} replica(s)?", {n: edit for n in targets}
        )

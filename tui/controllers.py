"""The app's side of the cluster's automatic controllers (the governor, the autopilot): the alerts
panel's data, the strip above every panel (``#controlsbar``: what steers the cluster, while a
controller reports), and ``G`` / ``O``, which steer a controller through its control row in the
store.

A mixin of :class:`tui.app.TailpilotApp` (kept apart so the app stays thin): it uses the app's
``source``, ``snapshot``, ``who`` and Textual's ``notify`` / ``push_screen`` / ``run_worker``.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from textual import work
from textual.widgets import Static

from controlplane.snapshot import ClusterSnapshot
from storage.control import ControllerName
from tui.alerts_panel import AlertsData, AlertsPanel
from tui.autopilot_render import controls_brief
from tui.dialogs import AutopilotScreen, GovernorScreen
from tui.sources import DataSource, LiveSource

log = logging.getLogger(__name__)

if TYPE_CHECKING:  # the mixin's methods run on the app: type-check them as the app's
    from textual.app import App

    _AppBase = App[None]
else:
    _AppBase = object

# The controllers steered through a control row in the store, and where one exists.
STEERED: dict[ControllerName, str] = {
    "governor": "a cluster with a governance block, live with --db",
    "autopilot": (
        "it is steered through the store (live with --db); it runs in tailpilot record --autopilot"
    ),
}


class ControllerActions(_AppBase):
    """reload_alerts, the controls strip (reload_controls, show_controls), action_governor (G) and
    action_autopilot (O) of the app."""

    source: DataSource
    snapshot: ClusterSnapshot | None
    who: str
    panel: str
    # The control rows the strip shows, read again every ``_controls_every`` snapshots (the
    # controllers report every few seconds); the app starts it empty.
    controls: dict[str, dict[str, Any] | None]
    _controls_every = 2

    async def _control_rows(self) -> dict[str, dict[str, Any] | None]:
        """The governor's and the autopilot's control rows (None: none here)."""
        controls: dict[str, dict[str, Any] | None] = {}
        for what in STEERED:
            try:
                controls[what] = await self.source.control(what)
            except Exception as err:
                log.warning("%s state unavailable: %s", what, err)
                controls[what] = None
        return controls

    @work(exclusive=True, group="controls", exit_on_error=False)
    async def reload_controls(self) -> None:
        """Read the control rows again and redraw the strip."""
        self.controls = await self._control_rows()
        self.show_controls()

    def show_controls(self) -> None:
        """The strip: shown while the autopilot or the governor reports (``controls_brief``),
        except on the alerts panel, which shows them in full."""
        snap = self.snapshot
        brief = controls_brief(
            self.controls.get("autopilot"),
            self.controls.get("governor"),
            snap.governance if snap else None,
            self._now_ms(),
        )
        bar = self.query_one("#controlsbar", Static)
        bar.set_class(brief is not None and self.panel != "alerts", "-shown")
        if brief is not None:
            bar.update(brief)

    @work(exclusive=True, group="alerts", exit_on_error=False)
    async def reload_alerts(self) -> None:
        """The alerts panel: the snapshot's governance figures, the stored alert history and the
        governor's and the autopilot's control rows."""
        try:
            events = await self.source.alert_events(200)
        except Exception as err:
            log.warning("alert history unavailable: %s", err)
            events = []
        controls = await self._control_rows()
        self.controls = controls
        self.show_controls()
        snap = self.snapshot
        self.query_one(AlertsPanel).data = AlertsData(
            snap.governance if snap else None,
            events,
            controls["governor"],
            controls["autopilot"],
            self._now_ms(),
        )

    def _now_ms(self) -> int:
        """The source's clock (a live source's is injectable), for how old a controller's report
        is."""
        return int(getattr(self.source, "clock", time.time)() * 1000)

    async def action_governor(self) -> None:
        await self._open_steering("governor", GovernorScreen)

    async def action_autopilot(self) -> None:
        await self._open_steering(
            "autopilot", lambda control: AutopilotScreen(control, self._now_ms())
        )

    async def _open_steering(self, what: ControllerName, screen: Any) -> None:
        """G / O: the controller's control row in a dialog; the operator's pick goes to the
        store."""
        try:
            control = await self.source.control(what)
        except Exception as err:
            self.notify(f"{what} state unavailable: {err}", severity="error")
            return
        if control is None:
            self.notify(f"no {what} here: {STEERED[what]}", severity="warning")
            return

        def picked(choice: str | None) -> None:
            if choice:
                self.run_worker(self._steer(what, choice), group=what, exit_on_error=False)

        self.push_screen(screen(control), picked)

    async def _steer(self, what: ControllerName, choice: str) -> None:
        # Only a live source has a control row to steer (_open_steering found one).
        assert isinstance(self.source, LiveSource), "a replay has no control row"
        row = await self.source.steer(what, choice, self.who)
        self.notify(f"{what}: {choice} ({row['state']}{', paused' if row['paused'] else ''})")
        self.reload_alerts()
        self.reload_controls()

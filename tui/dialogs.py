"""The modal screens: confirm a cluster change (with its diff), help, seek, pick a policy, steer
the governor or the autopilot."""

from __future__ import annotations

from typing import Any, ClassVar

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import (
    Button,
    Input,
    OptionList,
    Static,
)
from textual.widgets.option_list import Option

from scheduler.settings import POLICY_NAMES
from tui import autopilot_render as AR
from tui import keys as K
from tui.alerts_render import governor_line
from tui.dialog_render import diff_renderable, help_table, preview_renderable
from tui.replay import parse_seek
from tui.sources import fmt_time


class ConfirmScreen(ModalScreen[bool]):
    """Every cluster change passes here: the diff per replica, apply or cancel."""

    BINDINGS = K.bindings(scope="confirm")

    def __init__(
        self, title: str, plans: list[dict[str, Any]], preview_minutes: float | None = None
    ) -> None:
        super().__init__()
        self.title_text = title
        self.plans = plans
        self.preview_minutes = preview_minutes  # None: no what-if (no recorded traffic to replay)

    def compose(self) -> ComposeResult:
        sendable = sum(1 for p in self.plans if not p.get("error"))
        with Vertical(id="dialog"):
            yield Static(Text(self.title_text, style="bold"), id="dialog-title")
            with VerticalScroll(id="dialog-body"):
                yield Static(diff_renderable(self.plans), id="dialog-diff")
                if self.preview_minutes is not None:
                    yield Static(
                        preview_renderable(None, self.preview_minutes), id="dialog-preview"
                    )
            with Horizontal(id="dialog-buttons"):
                yield Button(
                    f"Apply to {sendable} replica(s) \\[y]",
                    id="yes",
                    variant="warning",
                    disabled=sendable == 0,
                )
                yield Button("Cancel \\[n/esc]", id="no")

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()

    def show_preview(self, predictions: dict[str, Any]) -> None:
        """The what-if predictions arrived (computed off the UI thread)."""
        if self.preview_minutes is not None and self.is_attached:
            self.query_one("#dialog-preview", Static).update(
                preview_renderable(predictions, self.preview_minutes)
            )

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
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape,question_mark,q", "close", "Close", show=False)
    ]

    def __init__(self, readonly: bool, mode: str) -> None:
        super().__init__()
        self.readonly, self.mode = readonly, mode

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help"):
            head = Text("tailpilot — keys", style="bold")
            if self.readonly:
                head.append("   READ-ONLY: cluster changes are refused", style="bold white on red")
            head.append(
                "\nEvery key is also a command in the palette (ctrl+p). Capital letters change the "
                "cluster and always ask for confirmation with the diff first.",
                style="dim",
            )
            head.append("\nesc, ? or q closes this help.", style="bold")
            yield Static(head)
            yield Static(
                help_table(K.help_rows(readonly=self.readonly, mode=self.mode)), id="help-table"
            )

    def action_close(self) -> None:
        self.dismiss(None)


class SeekScreen(ModalScreen["int | None"]):
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "cancel", "Cancel", show=False)]

    def __init__(self, position_ms: int, start_ms: int, end_ms: int) -> None:
        super().__init__()
        self.position_ms, self.start_ms, self.end_ms = position_ms, start_ms, end_ms

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Static(
                Text.assemble(
                    ("Seek", "bold"),
                    f"  recording {fmt_time(self.start_ms)} – "
                    f"{fmt_time(self.end_ms)} UTC, now {fmt_time(self.position_ms)}",
                )
            )
            yield Input(
                placeholder="+30s, -2m, @1:30 (from start), 22:15:00 (UTC), ISO time, start, end",
                id="seek-input",
            )
            yield Static("", id="seek-error")

    @on(Input.Submitted, "#seek-input")
    def _submit(self, event: Input.Submitted) -> None:
        try:
            t = parse_seek(
                event.value,
                position_ms=self.position_ms,
                start_ms=self.start_ms,
                end_ms=self.end_ms,
            )
        except ValueError as err:
            self.query_one("#seek-error", Static).update(str(err))
            return
        self.dismiss(t)

    def action_cancel(self) -> None:
        self.dismiss(None)


class PolicyPickScreen(ModalScreen["str | None"]):
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "cancel", "Cancel", show=False)]

    def __init__(self, targets: list[str], current: dict[str, str | None]) -> None:
        super().__init__()
        self.targets, self.current = targets, current

    def compose(self) -> ComposeResult:
        now = sorted({p for p in self.current.values() if p})
        with Vertical(id="dialog"):
            yield Static(
                Text.assemble(
                    ("Switch policy", "bold"),
                    f" of {', '.join(self.targets)} (now: {', '.join(now) or 'unknown'})",
                )
            )
            yield OptionList(
                *[Option(f"{p}{'  (current)' if p in now else ''}", id=p) for p in POLICY_NAMES],
                id="policy-options",
            )

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


GOVERNOR_CHOICES = {
    "pause": "pause (decide nothing until resumed)",
    "resume": "resume",
    "arm": "arm (apply its modes)",
    "dry-run": "dry-run (log its decisions only)",
    "disarm": "disarm (off)",
}
AUTOPILOT_CHOICES = {
    "arm": "arm (carry its decisions out through the control API, who = autopilot)",
    "dry-run": "dry-run (its decisions in the audit log only)",
    "disarm": "disarm (off: its controllers are dropped, arming starts them afresh)",
    "pause": "pause (its shadows keep running, nothing is applied until resumed)",
    "resume": "resume",
}


class SteerScreen(ModalScreen["str | None"]):
    """Steer one of the cluster's automatic controllers through its control row: the operator picks
    one of ``choices`` (pause or resume, whichever applies; the current state marked)."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "cancel", "Cancel", show=False)]

    def __init__(
        self,
        title: str,
        head: Text,
        choices: dict[str, str],
        control: dict[str, Any],
        options_id: str,
    ) -> None:
        super().__init__()
        self.title_text, self.head, self.choices = title, head, choices
        self.control, self.options_id = control, options_id

    def compose(self) -> ComposeResult:
        state = self.control.get("state")
        skip = "pause" if self.control.get("paused") else "resume"
        with Vertical(id="dialog"):
            yield Static(Text.assemble((self.title_text, "bold"), "  ", self.head))
            yield OptionList(
                *[
                    Option(f"{label}{'  (now)' if key == state else ''}", id=key)
                    for key, label in self.choices.items()
                    if key != skip
                ],
                id=self.options_id,
            )

    def on_mount(self) -> None:
        self.query_one(OptionList).focus()

    @on(OptionList.OptionSelected)
    def _picked(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(event.option.id)

    def action_cancel(self) -> None:
        self.dismiss(None)


class GovernorScreen(SteerScreen):
    """Steer the cluster's governor: the operator picks pause/resume, arm, dry-run or disarm."""

    def __init__(self, control: dict[str, Any]) -> None:
        super().__init__(
            "Governor", governor_line(control), GOVERNOR_CHOICES, control, "governor-options"
        )


class AutopilotScreen(SteerScreen):
    """Steer the cluster's autopilot: arm, dry-run, disarm, pause or resume."""

    def __init__(self, control: dict[str, Any], now_ms: int | None = None) -> None:
        super().__init__(
            "Autopilot",
            AR.autopilot_line(control, now_ms),
            AUTOPILOT_CHOICES,
            control,
            "autopilot-options",
        )

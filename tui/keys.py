"""The one key table of the TUI.

Every key the operator can press is a row of :data:`KEYS`. The app's ``BINDINGS``
(:func:`bindings`), the help screen (:func:`help_rows`) and the command palette
(:class:`KeyCommands`) are all generated from it, so the three can never disagree.

Conventions (operator tools: top, htop, k9s, Dolphie): ``?`` help, ``q`` quit, ``p`` pause,
``/`` filter, number keys for panels, and **capital letters for anything that changes the
cluster** — those always open a confirmation showing the settings diff first, and are refused
(greyed in the footer, a notification when pressed) under ``--readonly`` and in replay.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any

from textual.binding import Binding, BindingType
from textual.command import DiscoveryHit, Hit, Hits, Provider

PANELS = ("cluster", "replica", "policy", "audit", "tuner", "alerts")  # number keys 1..6
GROUPS = ("General", "Panels", "Cluster view", "Replay", "Cluster changes", "Confirmation dialog")


@dataclass(frozen=True, slots=True)
class Key:
    """One row of the key table."""

    key: str  # Textual key name ("question_mark", "P", "left_square_bracket")
    display: str  # what the operator sees ("?", "P", "[")
    action: str  # the app action, possibly with arguments ("panel('cluster')")
    description: str
    group: str
    changes_cluster: bool = False  # capital letter + confirmation; refused when read-only
    screens: tuple[str, ...] = ()  # panels where the key applies; () = everywhere
    modes: tuple[str, ...] = ("live", "replay")  # data sources where the key applies
    footer: bool = False  # shown in the footer
    bind: bool = True  # False: handled by a widget or by Textual itself (documented here only)
    palette: bool = True  # offered in the command palette
    scope: str = "app"  # "app": the app's bindings; "confirm": the confirmation dialog's
    label: str = ""  # short footer label (default: the description's first words)

    @property
    def action_name(self) -> str:
        return self.action.split("(", 1)[0]


KEYS: tuple[Key, ...] = (
    # General
    Key("question_mark", "?", "help", "Help: every key", "General", footer=True, label="Help"),
    Key("q", "q", "quit", "Quit", "General", footer=True, label="Quit"),
    Key(
        "p",
        "p",
        "toggle_pause",
        "Pause / resume (live: stop applying snapshots; replay: playback)",
        "General",
        footer=True,
        label="Pause",
    ),
    Key(
        "slash",
        "/",
        "filter",
        "Filter replicas by name, policy, health or reason",
        "General",
        screens=("cluster",),
        footer=True,
        label="Filter",
    ),
    Key(
        "ctrl+p",
        "ctrl+p",
        "command_palette",
        "Command palette",
        "General",
        bind=False,
        palette=False,
    ),
    # Panels
    Key("1", "1", "panel('cluster')", "Cluster panel", "Panels", footer=True, label="Cluster"),
    Key(
        "2",
        "2",
        "panel('replica')",
        "Replica panel (the replica under the cursor)",
        "Panels",
        footer=True,
        label="Replica",
    ),
    Key(
        "3",
        "3",
        "panel('policy')",
        "Policy panel: switch, edit, pin",
        "Panels",
        footer=True,
        label="Policy",
    ),
    Key(
        "4",
        "4",
        "panel('audit')",
        "Audit log of settings changes",
        "Panels",
        footer=True,
        label="Audit",
    ),
    Key(
        "5",
        "5",
        "panel('tuner')",
        "Tuner panel: studies, trials, Pareto front, recommendation",
        "Panels",
        label="Tuner",
    ),
    Key(
        "6",
        "6",
        "panel('alerts')",
        "Alerts panel: SCR, JFI, type fairness per tenant and type; the governor "
        "and the autopilot; alert history",
        "Panels",
        label="Alerts",
    ),
    # Cluster view
    Key(
        "enter",
        "enter",
        "open_replica",
        "Open the replica under the cursor",
        "Cluster view",
        screens=("cluster",),
        bind=False,
        palette=False,
    ),
    Key(
        "s",
        "s",
        "sort_next",
        "Sort by the next column (or click a header)",
        "Cluster view",
        screens=("cluster",),
        label="Sort",
    ),
    Key(
        "r",
        "r",
        "sort_reverse",
        "Reverse the sort order",
        "Cluster view",
        screens=("cluster",),
        label="Reverse",
    ),
    Key(
        "space",
        "space",
        "toggle_select",
        "Select / unselect the replica (targets of P, N, A)",
        "Cluster view",
        screens=("cluster",),
        label="Select",
    ),
    Key(
        "asterisk",
        "*",
        "select_all",
        "Select all (shown) replicas / none",
        "Cluster view",
        screens=("cluster", "policy"),
        label="All",
    ),
    # Replay
    Key(
        "left_square_bracket",
        "[",
        "step(-1)",
        "Step back one sample",
        "Replay",
        modes=("replay",),
        footer=True,
        label="Back",
    ),
    Key(
        "right_square_bracket",
        "]",
        "step(1)",
        "Step forward one sample",
        "Replay",
        modes=("replay",),
        footer=True,
        label="Fwd",
    ),
    Key("g", "g", "seek", "Seek to a time", "Replay", modes=("replay",), footer=True, label="Seek"),
    Key(
        "less_than_sign",
        "<",
        "speed(0.5)",
        "Play slower",
        "Replay",
        modes=("replay",),
        label="Slower",
    ),
    Key(
        "greater_than_sign",
        ">",
        "speed(2.0)",
        "Play faster",
        "Replay",
        modes=("replay",),
        label="Faster",
    ),
    # Cluster changes: capital letters, always through a confirmation with the diff.
    Key(
        "P",
        "P",
        "switch_policy",
        "Switch the policy of the targets (selection, else the cursor replica)",
        "Cluster changes",
        changes_cluster=True,
        footer=True,
        label="Switch",
    ),
    Key(
        "E",
        "E",
        "edit_params",
        "Edit / pin parameters of the targets in the policy panel",
        "Cluster changes",
        changes_cluster=True,
        footer=True,
        label="Edit",
    ),
    Key(
        "N",
        "N",
        "toggle_pin",
        "Pin the live γ (uniboost) or β (tie) at its current value / unpin it",
        "Cluster changes",
        changes_cluster=True,
        footer=True,
        label="Pin",
    ),
    Key(
        "A",
        "A",
        "apply_edits",
        "Apply the policy panel's edits to its targets (enter in a field too)",
        "Cluster changes",
        changes_cluster=True,
        screens=("policy",),
        footer=True,
        label="Apply",
    ),
    Key(
        "G",
        "G",
        "governor",
        "Steer the governor: pause / resume, arm, dry-run, disarm (a governed cluster, --db)",
        "Cluster changes",
        changes_cluster=True,
        screens=("alerts",),
        footer=True,
        label="Governor",
    ),
    Key(
        "O",
        "O",
        "autopilot",
        "Steer the autopilot: arm, dry-run, disarm, pause / resume (live, --db)",
        "Cluster changes",
        changes_cluster=True,
        screens=("alerts",),
        footer=True,
        label="Autopilot",
    ),
    Key(
        "R",
        "R",
        "apply_recommendation",
        "Apply the tuner's recommendation to the selected replicas (all when none is selected); "
        "pinned parameters are kept",
        "Cluster changes",
        changes_cluster=True,
        screens=("tuner",),
        footer=True,
        label="Apply rec",
    ),
    # The confirmation every cluster change passes through.
    Key(
        "y",
        "y",
        "confirm",
        "Apply the change shown in the dialog",
        "Confirmation dialog",
        scope="confirm",
        palette=False,
        label="Apply",
    ),
    Key(
        "n,escape",
        "n / esc",
        "cancel",
        "Cancel: nothing is sent",
        "Confirmation dialog",
        scope="confirm",
        palette=False,
        label="Cancel",
    ),
)

KEYS_BY_KEY: dict[str, Key] = {k.key: k for k in KEYS if k.scope == "app"}
KEYS_BY_ACTION: dict[str, Key] = {k.action_name: k for k in KEYS if k.bind and k.scope == "app"}
CLUSTER_CHANGING_ACTIONS: frozenset[str] = frozenset(
    k.action_name for k in KEYS if k.changes_cluster
)


def bindings(keys: Iterable[Key] = KEYS, *, scope: str = "app") -> list[BindingType]:
    """``BINDINGS`` of the app (``scope="app"``) or of the confirmation dialog, from the table."""
    return [
        Binding(k.key, k.action, _short(k), show=k.footer or scope != "app", key_display=k.display)
        for k in keys
        if k.bind and k.scope == scope
    ]


def _short(k: Key) -> str:
    """A footer label: the key's own, or the description up to its first colon / parenthesis."""
    if k.label:
        return k.label
    text = k.description
    for sep in (":", " (", ","):
        text = text.split(sep, 1)[0]
    words = text.split()
    return " ".join(words[:3])


def key_available(k: Key, *, mode: str, panel: str | None = None) -> bool:
    """Whether a key applies in this data source mode and panel (independently of read-only)."""
    if mode not in k.modes:
        return False
    return not k.screens or panel is None or panel in k.screens


def help_rows(*, readonly: bool, mode: str) -> list[tuple[str, list[tuple[str, str, str]]]]:
    """(group, [(key, description, note)]) for the help screen, in table order.

    ``note`` says why a key does nothing here: "read-only" for cluster changes under
    ``--readonly`` or replay, "replay only" for replay keys in live mode, or the panels a key
    applies to.
    """
    out: list[tuple[str, list[tuple[str, str, str]]]] = []
    for group in GROUPS:
        rows = []
        for k in KEYS:
            if k.group != group:
                continue
            notes = []
            if k.changes_cluster:
                notes.append("REFUSED: read-only" if readonly else "asks for confirmation")
            if mode not in k.modes:
                notes.append(f"{'/'.join(k.modes)} only")
            if k.screens:
                notes.append(f"in {'/'.join(k.screens)}")
            rows.append((k.display, k.description, "; ".join(notes)))
        if rows:
            out.append((group, rows))
    return out


class KeyCommands(Provider):
    """Command palette provider: every key of the table as a command (same action, same checks)."""

    def _commands(self) -> list[tuple[str, Key]]:
        app = self.app
        readonly = bool(getattr(app, "readonly", False))
        mode = getattr(app, "mode_name", "live")
        out = []
        for k in KEYS:
            if not k.palette or k.scope != "app" or mode not in k.modes:
                continue
            label = f"{k.description}"
            if k.changes_cluster and readonly:
                label += "  [read-only: refused]"
            out.append((label, k))
        return out

    def _runner(self, k: Key) -> Callable[[], Awaitable[Any]]:
        invoke = getattr(self.app, "invoke_key", None)
        if invoke is not None:
            return partial(invoke, k)
        return partial(self.app.run_action, k.action)

    async def discover(self) -> Hits:
        for label, k in self._commands():
            yield DiscoveryHit(label, self._runner(k), help=f"key: {k.display}")

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for label, k in self._commands():
            score = matcher.match(f"{label} {k.display}")
            if score > 0:
                yield Hit(
                    score,
                    matcher.highlight(label),
                    self._runner(k),
                    text=label,
                    help=f"key: {k.display}",
                )

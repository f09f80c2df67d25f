"""What the modal dialogs show, as pure functions: the confirm dialog's diff of each replica's
settings and its what-if preview, and the help screen's key table. No widgets, no I/O."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from tui.edits import settings_diff
from tuner.closed_loop.whatif import LABELS


def preview_renderable(predictions: dict[str, Any] | None, minutes: float) -> Text:
    """The what-if block of the confirm dialog: per replica the predicted change of each figure
    with the simulator's error band on that replica, or why there is no prediction."""
    if predictions is None:
        return Text(
            f"predicting on each replica's last {minutes:g} min of recorded traffic…", style="dim"
        )

    out = Text()
    for name, p in predictions.items():
        if isinstance(p, str):
            out.append(f"{name}: no prediction: {p}\n", style="dim")
            continue
        band = (
            "fidelity not measured here"
            if p.get("band") is None
            else f"±{p['band']:.0%} on this replica"
        )
        out.append(f"{name}", style="bold")
        out.append(
            f" — predicted on its last {p['minutes']:g} min ({p['requests']} requests), {band}\n",
            style="dim",
        )
        for key, m in p["metrics"].items():
            change = m.get("change")
            text = "n/a" if change is None else f"{change:+.0%}"
            style = (
                ""
                if change is None
                else ("green" if (change < 0) != (key == "throughput_tok_s") else "red")
            )
            out.append(f"  {LABELS[key]:<11} ")
            out.append(f"{text:>6}", style=style)
            out.append("\n")
    return out


def diff_renderable(plans: Sequence[Mapping[str, Any]]) -> Group:
    """The confirmation dialog's body: per replica, the fields that will change."""
    parts: list[Any] = []
    for p in plans:
        head = Text(p["replica"], style="bold")
        if p.get("version") is not None:
            head.append(f"  (settings v{p['version']})", style="dim")
        parts.append(head)
        if p.get("error"):
            parts.append(Text(f"  not sent: {p['error']}", style="bold red"))
            continue
        if p.get("old") is None:
            parts.append(
                Text(
                    f"  current settings unknown: {p.get('edit', '')} will be applied to what the "
                    f"replica reports",
                    style="yellow",
                )
            )
            continue
        rows = settings_diff(p["old"], p["new"])
        if not rows:
            parts.append(Text("  no change", style="dim"))
        for f, a, b in rows:
            line = Text(f"  {f}: ")
            line.append(a, style="red")
            line.append(" → ")
            line.append(b, style="green")
            parts.append(line)
        for name, kept, rec in p.get("kept_pins") or ():
            line = Text(f"  params.{name}: {kept} ", style="cyan")
            line.append(f"kept: pinned (recommended {rec} not applied)", style="bold cyan")
            parts.append(line)
    return Group(*parts)


def help_table(groups: Sequence[tuple[str, list[tuple[str, str, str]]]]) -> Table:
    table = Table(expand=True, show_edge=False, box=None, padding=(0, 1))
    table.add_column("key", style="bold cyan", width=8)
    table.add_column("does")
    table.add_column("note", style="dim")
    for group, rows in groups:
        table.add_row("", Text(group, style="bold underline"), "")
        for key, desc, note in rows:
            style = "bold red" if note.startswith("REFUSED") else "dim"
            table.add_row(key, desc, Text(note, style=style))
    return table

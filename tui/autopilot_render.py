"""The autopilot's control row as the TUI shows it: pure functions, no widgets, no I/O.

The row is ``GovernanceRepository.autopilot_control``'s (written by ``tuner.autopilot_live`` inside
``tailpilot record --autopilot``): the operator's state and pause flag, and the driver's last
``status`` — why nothing is applied (``held``), per replica the candidate it runs, why its last
decision was or was not carried out (``note``) and its recent decisions with their predicted change.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from tui.sources import fmt_clock

DECISIONS_SHOWN = 3  # per replica, newest first (the status keeps more)
# A report older than this says the driver may have stopped: it writes one every tick (5 s by
# default).
STALE_MS = 60_000
STATE_STYLES = {"armed": "bold red", "dry-run": "yellow", "disarmed": "dim"}


def _pct(value: Any) -> str:
    return (
        "n/a"
        if not isinstance(value, (int, float)) or not math.isfinite(value)
        else f"{value:+.0%}"
    )


def _age(ms: int) -> str:
    s = max(ms, 0) // 1000
    return f"{s} s" if s < 120 else (f"{s // 60} min" if s < 7200 else f"{s // 3600} h")


def autopilot_line(control: Mapping[str, Any] | None, now_ms: int | None = None) -> Text:
    """The head line: state, pause, who set it, why it holds, and how fresh its last report is."""
    if not control:
        return Text("autopilot: not known here (live with --db)", style="dim")
    state = str(control.get("state", "?"))
    out = Text("autopilot: ", style="bold")
    out.append(state, style=STATE_STYLES.get(state, ""))
    if control.get("paused"):
        out.append(" (paused)", style="bold yellow")
    if control.get("who"):
        out.append(f" · set by {control['who']}", style="dim")
    status = control.get("status") or {}
    held = status.get("held")
    if held and held != "disarmed":  # disarmed is the state itself, already shown
        out.append(f" · held: {held}", style="yellow")
    t_ms = status.get("t_ms")
    if not isinstance(t_ms, int):
        out.append(" · no report yet (it runs in tailpilot record --autopilot)", style="dim")
    elif now_ms is not None and now_ms - t_ms > STALE_MS:
        out.append(
            f" · last report {fmt_clock(t_ms)} UTC, {_age(now_ms - t_ms)} ago: is tailpilot record "
            "--autopilot still running?",
            style="bold yellow",
        )
    else:
        out.append(f" · report {fmt_clock(t_ms)} UTC", style="dim")
    return out


def replica_line(name: str, r: Mapping[str, Any]) -> Text:
    """One replica: the candidate it runs and why the last decision was (not) carried out, or why
    it has no controller."""
    out = Text(f"  {name}  ", style="bold")
    if "choice" not in r:
        out.append(str(r.get("note") or "no controller"), style="dim")
        return out
    out.append("running ")
    out.append(str(r["choice"]), style="bold cyan")
    out.append(f" · {r.get('note') or 'no decision yet'}")
    extra = []
    if r.get("pending_verifications"):
        extra.append(f"{r['pending_verifications']} switch(es) awaiting verification")
    if r.get("worse_in_row"):
        extra.append(f"{r['worse_in_row']} worse than predicted in a row")
    if r.get("late"):
        extra.append(f"{r['late']} requests seen too late to replay")
    verified = r.get("verifications") or []
    if verified:
        v = verified[-1]
        if "realized" in v:
            extra.append(
                f"last verified: {v.get('verdict')} (P95 TTFT {_pct(v.get('realized'))} realized, "
                f"{_pct(v.get('predicted'))} predicted)"
            )
        else:
            extra.append(f"last verified: {v.get('verdict')}")
    if extra:
        out.append(" · " + " · ".join(extra), style="dim")
    return out


def decision_cells(name: str, d: Mapping[str, Any]) -> tuple[Any, ...]:
    """One decision as table cells: replica, controller time, switch/keep, choice, predicted P95
    TTFT change, requests compared, reason."""
    changed = bool(d.get("changed"))
    move = (
        f"{d.get('previous')} → {d.get('choice')}"
        if changed and d.get("previous")
        else str(d.get("choice"))
    )
    p95 = (d.get("predicted") or {}).get("ttft_p95")
    style = "" if not isinstance(p95, (int, float)) else ("green" if p95 < 0 else "red")
    t = d.get("t")
    return (
        name,
        "—" if not isinstance(t, (int, float)) else f"{t:.0f}",
        Text("switch", style="bold") if changed else Text("keep", style="dim"),
        move,
        Text(_pct(p95) if changed else "—", style=style),
        str(d.get("requests", "—")),
        str(d.get("reason", "")),
    )


def autopilot_renderable(
    control: Mapping[str, Any] | None, now_ms: int | None = None, shown: int = DECISIONS_SHOWN
) -> Group:
    """The whole block: the head line, a line per replica, the last ``shown`` decisions of each."""
    parts: list[Any] = [autopilot_line(control, now_ms)]
    replicas = ((control or {}).get("status") or {}).get("replicas") or {}
    rows: list[tuple[Any, ...]] = []
    for name in sorted(replicas):
        r = replicas[name]
        parts.append(replica_line(name, r))
        rows.extend(decision_cells(name, d) for d in reversed((r.get("last") or [])[-shown:]))
    if rows:
        table = Table(
            box=None, padding=(0, 1), show_edge=False, header_style="bold dim", expand=False
        )
        for label, kw in (
            ("replica", {}),
            ("t (s)", {"justify": "right"}),
            ("", {}),
            ("choice", {}),
            ("P95 TTFT pred.", {"justify": "right"}),
            ("requests", {"justify": "right"}),
            ("reason", {"overflow": "ellipsis", "no_wrap": True}),
        ):
            table.add_column(label, **kw)
        for row in rows:
            table.add_row(*row)
        parts.append(table)
    return Group(*parts)

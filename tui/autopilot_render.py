"""The autopilot's control row as the TUI shows it: pure functions, no widgets, no I/O.

The row is the store's autopilot control row (written by ``tuner.autopilot.live`` inside
``tailpilot record --autopilot`` or ``tailpilot demo``): the operator's state and pause flag, and
the driver's last ``status`` — why nothing is applied (``held``), per replica the candidate it runs,
why its last decision was or was not carried out (``note``) and its recent decisions with their
predicted change; when the report gives them, the promise it keeps (``promise``: one line), the
replicas it is armed on while the others run dry (``armed_replicas``: the demo's) and how often it
decides (``cadence``).

``controls_brief`` is the strip above every panel (the app's ``#controlsbar``): the autopilot's head
line, its promise and each steered replica's last decision, then the tenants' SCR and JFI with the
governor's state — shown while a controller reports, so the first screen says what steers the
cluster.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from controlplane.governor import modes_text
from controlplane.views import figures_text
from tui.sources import fmt_clock

DECISIONS_SHOWN = 3  # per replica, newest first (the status keeps more)
# A report older than this says the driver may have stopped: it writes one every tick (5 s by
# default).
STALE_MS = 60_000
STATE_STYLES = {"armed": "bold red", "dry-run": "yellow", "disarmed": "dim"}
# The strip above the panels shows a controller whose last report is at most this old (a report
# from last week is the alerts panel's to show, with its age).
BRIEF_MAX_AGE_MS = 3_600_000


def _pct(value: Any) -> str:
    return (
        "n/a"
        if not isinstance(value, (int, float)) or not math.isfinite(value)
        else f"{value:+.0%}"
    )


def _age(ms: int) -> str:
    s = max(ms, 0) // 1000
    return f"{s} s" if s < 120 else (f"{s // 60} min" if s < 7200 else f"{s // 3600} h")


def armed_only(control: Mapping[str, Any] | None) -> list[str] | None:
    """The replicas an armed autopilot applies its decisions on while the others run dry (its
    report's ``armed_replicas``), None when armed everywhere (or not armed)."""
    if not control or control.get("state") != "armed":
        return None
    armed = (control.get("status") or {}).get("armed_replicas")
    return [str(n) for n in armed] if isinstance(armed, list) else None


def autopilot_line(control: Mapping[str, Any] | None, now_ms: int | None = None) -> Text:
    """The head line: state (and where it is armed), pause, who set it, why it holds, and how
    fresh its last report is."""
    if not control:
        return Text("autopilot: not known here (live with --db)", style="dim")
    state = str(control.get("state", "?"))
    out = Text("autopilot: ", style="bold")
    out.append(state, style=STATE_STYLES.get(state, ""))
    only = armed_only(control)
    if only is not None:
        out.append(f" on {', '.join(only) or 'no replica'} only", style=STATE_STYLES["armed"])
        out.append(", dry-run on the others", style=STATE_STYLES["dry-run"])
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


def promise_lines(control: Mapping[str, Any] | None) -> list[Text]:
    """The promise the autopilot keeps and how often it decides, when its report says so."""
    status = (control or {}).get("status") or {}
    out = []
    if status.get("promise"):
        line = Text("  keeps: ", style="bold")
        line.append(str(status["promise"]))
        out.append(line)
    if status.get("cadence"):
        out.append(Text(f"  {status['cadence']}", style="dim"))
    return out


def replica_line(name: str, r: Mapping[str, Any], armed: list[str] | None = None) -> Text:
    """One replica: the candidate it runs and why the last decision was (not) carried out, or why
    it has no controller; ``armed`` (the replicas an armed autopilot applies on, the others
    running dry) tags a steered replica with which it is."""
    out = Text(f"  {name}  ", style="bold")
    if "choice" not in r:
        out.append(str(r.get("note") or "no controller"), style="dim")
        return out
    verb = "running "
    if armed is not None:  # a dry-run replica runs its own settings: the choice is what it would
        mode = "armed" if name in armed else "dry-run"
        out.append(f"[{mode}] ", style=STATE_STYLES[mode])
        verb = "running " if mode == "armed" else "chooses "
    out.append(verb)
    out.append(str(r["choice"]), style="bold cyan")
    keeps = r.get("keeps")  # whether the choice kept the promise on the last window judged
    if keeps is not None:
        out.append(
            " · keeps the promise" if keeps else " · breaks the promise",
            style="green" if keeps else "bold red",
        )
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
    parts: list[Any] = [autopilot_line(control, now_ms), *promise_lines(control)]
    replicas = ((control or {}).get("status") or {}).get("replicas") or {}
    armed = armed_only(control)
    rows: list[tuple[Any, ...]] = []
    for name in sorted(replicas):
        r = replicas[name]
        parts.append(replica_line(name, r, armed))
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


# ------------------------------------------------------------------------------ the strip


def _reported_ms(control: Mapping[str, Any] | None) -> int | None:
    t_ms = ((control or {}).get("status") or {}).get("t_ms")
    return t_ms if isinstance(t_ms, int) else None


def _fresh(control: Mapping[str, Any] | None, now_ms: int | None) -> bool:
    t_ms = _reported_ms(control)
    return t_ms is not None and (now_ms is None or now_ms - t_ms <= BRIEF_MAX_AGE_MS)


def switch_text(d: Mapping[str, Any]) -> Text:
    """A switch in a few words: "defaults → gamma=0.1 (P95 TTFT -12% predicted)"."""
    out = Text(f"{d.get('previous') or '?'} → {d.get('choice')}")
    p95 = (d.get("predicted") or {}).get("ttft_p95")
    if isinstance(p95, (int, float)) and math.isfinite(p95):
        out.append(f" (P95 TTFT {_pct(p95)} predicted)", style="green" if p95 < 0 else "red")
    return out


def controls_brief(
    autopilot: Mapping[str, Any] | None,
    governor: Mapping[str, Any] | None,
    governance: Mapping[str, Any] | None,
    now_ms: int | None = None,
) -> Text | None:
    """The strip above every panel while a controller reports (its last report at most
    ``BRIEF_MAX_AGE_MS`` old): the autopilot's head line, the promise it keeps, each steered
    replica's choice, why (its last decision's note) and its newest switch; then the tenants' SCR
    and JFI (the collector's ``governance`` report) and the governor's state. One line each, cut
    at the width. None when neither reports (nothing to show: the strip is hidden)."""
    pilot = _fresh(autopilot, now_ms)
    governed = _fresh(governor, now_ms)
    if not pilot and not governed:
        return None
    out = Text()  # one line each: the strip does not wrap (app.tcss)
    if pilot:
        assert autopilot is not None  # fresh: a report was read
        out.append_text(autopilot_line(autopilot, now_ms))
        out.append("  (6: details)", style="dim")
        for line in promise_lines(autopilot):
            out.append("\n")
            out.append_text(line)
        replicas = (autopilot.get("status") or {}).get("replicas") or {}
        armed = armed_only(autopilot)
        idle = []
        for name in sorted(replicas):
            r = replicas[name]
            if "choice" not in r:
                idle.append(name)
                continue
            brief = {"choice": r["choice"], "keeps": r.get("keeps"), "note": r.get("note")}
            line = replica_line(name, brief, armed)
            switches = [d for d in r.get("last") or [] if d.get("changed")]
            if switches:
                line.append(" · last switch: ")
                line.append_text(switch_text(switches[-1]))
            out.append("\n")
            out.append_text(line)
        if idle:
            out.append(f"\n  not steered: {', '.join(idle)} (6: why)", style="dim")
    if governance or governed:
        if pilot:
            out.append("\n")
        out.append("tenants: ", style="bold")
        out.append(figures_text(governance, " · ") if governance else "no figures yet")
        if governed:
            assert governor is not None  # fresh: a report was read
            state = str(governor.get("state", "?"))
            out.append("\ngovernor: ", style="bold")
            out.append(state, style=STATE_STYLES.get(state, ""))
            if governor.get("paused"):
                out.append(" (paused)", style="bold yellow")
            out.append(f" · {modes_text(governor.get('status'))}")
    return out

"""The governance view as pure functions: the alerts panel's figures, per-tenant and per-type rows,
the governor's line and the alert history's rows (the alert bar is ``controlplane.views``'
``alert_text``). No widgets, no I/O."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rich.text import Text

from controlplane.governor import modes_text
from controlplane.views import (
    ALERT_LABELS,
    alert_text,
    figures_text,
    fmt_figure,
    fmt_number,
    fmt_percent,
    fmt_seconds,
    fmt_target,
    governance_notes,
    governor_notes,
    omega_text,
    waiting_text,
)
from tui.render import Row
from tui.sources import fmt_time

GOVERNANCE_COLUMNS = (
    ("who", "tenant / type", 14),
    ("p50", "TTFT P50", 11),
    ("p90", "TTFT P90", 11),
    ("p99", "TTFT P99", 11),
    ("ttlt", "TTLT P99", 11),
    ("tok", "tok/s", 8),
    ("x", "served/ent", 10),
    ("norm", "use/commit", 10),
    ("omega", "ω", 9),
    ("waiting", "waiting", 17),
    ("slo", "SLO", 26),
)
ALERT_EVENT_COLUMNS = (
    ("t", "time (UTC)", 19),
    ("alert", "alert", 14),
    ("state", "state", 9),
    ("severity", "severity", 9),
    ("value", "value", 8),
    ("threshold", "threshold", 9),
    ("missed", "tenants missing targets", 40),
)


def governance_summary(g: Mapping[str, Any] | None) -> Text:
    """The alert line (firing, then pending), SCR / JFI / JFI (seed) / type fairness, and the
    over-consumers and starved tenants (what ``tailpilot status`` prints first)."""
    if not g:
        return Text(
            "not governed: add a governance block to the cluster file (tenants, SLOs, alerts)",
            style="dim",
        )
    out = alert_text(g)
    out.append("\n" + figures_text(g, " · "))
    notes = governance_notes(g)
    if notes is not None:
        out.append("\n")
        out.append_text(notes)
    return out


def governance_rows(g: Mapping[str, Any] | None) -> list[Row]:
    """A row per tenant (figures against its targets, JFI's x served/entitled, JFI (seed)'s x
    use/commit, ω with over-consumers marked, what still waits), then one per request type."""
    if not g:
        return []
    rows: list[Row] = []
    for tenant, f in sorted((g.get("tenants") or {}).items()):
        slo = (
            Text("meets", style="green")
            if f.get("compliant")
            else Text("misses " + ", ".join(f.get("missed") or []), style="bold red")
        )
        rows.append(
            (
                tenant,
                fmt_target(f, "ttft_p50"),
                fmt_target(f, "ttft_p90"),
                fmt_target(f, "ttft_p99"),
                fmt_target(f, "ttlt_p99"),
                fmt_number(f.get("tok_s")),
                fmt_figure(f.get("service_ratio"), 3),
                fmt_figure(f.get("normalised"), 3),
                omega_text(g, tenant),
                waiting_text(f),
                slo,
            )
        )
    for kind, f in sorted((g.get("types") or {}).items()):
        ratio = f.get("ratio")
        share = Text(
            "—" if ratio is None else f"{fmt_percent(f.get('share'))} = {ratio:.2f}× its min share",
            style="dim" if ratio is None else ("bold red" if ratio < 0.5 else ""),
        )
        rows.append(
            (
                Text(f"type {kind}", style="italic"),
                fmt_seconds(f.get("ttft_p50")),
                "",
                fmt_seconds(f.get("ttft_p99")),
                "",
                "",
                "",
                "",
                "",
                "",
                share,
            )
        )
    return rows


def governor_line(control: Mapping[str, Any] | None) -> Text:
    """The governor's state, who set it, its active modes (and whether kept after ``disarm
    --keep``), the tenants they throttle, why a mode was held back, and its last decision."""
    if not control:
        return Text("governor: not known here (live with --db)", style="dim")
    state = control.get("state", "?")
    out = Text("governor: ")
    out.append(state, style={"armed": "bold red", "dry-run": "yellow"}.get(state, "dim"))
    if control.get("paused"):
        out.append(" (paused)", style="bold yellow")
    if control.get("who"):
        out.append(f" · set by {control['who']}", style="dim")
    status = control.get("status") or {}
    out.append(f" · {modes_text(status)}")
    for note in governor_notes(status):
        out.append(f" · {note}", style="bold yellow" if note.startswith("held") else "")
    if status.get("last"):
        out.append(f" · last: {status['last'][-1]}", style="dim")
    return out


def alert_event_row(e: Mapping[str, Any]) -> Row:
    s = e.get("summary") or {}
    firing = e.get("state") == "firing"
    style = ("bold red" if e.get("severity") == "critical" else "yellow") if firing else "green"
    missed = "; ".join(f"{t}: {', '.join(m)}" for t, m in sorted((s.get("missed") or {}).items()))
    return (
        fmt_time(e.get("t_ms")),
        ALERT_LABELS.get(e.get("name", ""), e.get("name", "?")),
        Text(e.get("state", "?"), style=style),
        e.get("severity") or "—",
        fmt_figure(s.get("value"), 3),
        fmt_figure(s.get("threshold"), 3),
        missed or "—",
    )

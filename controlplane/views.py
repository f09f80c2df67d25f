"""Pure render functions over collector rows: the cluster table of ``tailpilot status`` and
``tailpilot demo``, and the same data as JSON. No I/O here — the TUI, the CLI and the tests all
render the same rows the same way.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from scheduler import contract
from storage.rows import SampleRow


def wide_console(min_width: int = 160) -> Console:
    """The terminal's console, or a wide one when output is piped (tables must not wrap in logs)."""
    console = Console()
    return (
        console if console.is_terminal and console.width >= min_width else Console(width=min_width)
    )


def fmt_seconds(v: float | None) -> str:
    """Latency for a narrow column: 850ms, 3.21s, 4m12s."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "—"
    if v < 1.0:
        return f"{v * 1000:.0f}ms"
    if v < 100.0:
        return f"{v:.2f}s"
    if v < 3600.0:
        return f"{int(v // 60)}m{int(v % 60):02d}s"
    return f"{v / 3600:.1f}h"


def fmt_figure(v: object, sig: int = 4, grouped: bool = True) -> str:
    """A figure for a table: "—" when missing or not finite (None, NaN, ±inf), on/off for booleans,
    ``sig`` significant digits, and (``grouped``) whole numbers from 1,000 with separators."""
    if v is None or isinstance(v, str):
        return "—" if v is None else v
    if isinstance(v, bool):
        return "on" if v else "off"
    if not isinstance(v, (int, float)) or not math.isfinite(v):
        return "—"
    if isinstance(v, int) and not grouped:
        return str(v)
    if grouped and abs(v) >= 1000:
        return f"{v:,.0f}"
    return f"{v:.{sig}g}"


def fmt_number(v: float | int | None, digits: int = 0) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "—"
    return f"{v:,.{digits}f}"


def fmt_percent(v: float | None) -> str:
    return "—" if v is None else f"{v * 100:.0f}%"


def fmt_gamma(value: float | None, pinned: bool) -> str:
    """γ with a trailing ``*`` when the operator pinned it (no emoji: terminal widths vary)."""
    if value is None:
        return "—"
    return f"{value:.3g}{'*' if pinned else ''}"


def cluster_totals(rows: Sequence[SampleRow]) -> dict[str, float | int | None]:
    """Sums over healthy replicas (a down replica's last numbers would double-count)."""
    healthy = [r for r in rows if r.healthy]

    def total(attr: str) -> float | None:
        vals = [getattr(r, attr) for r in healthy if getattr(r, attr) is not None]
        return sum(vals) if vals else None

    used = total("kv_used_blocks")
    cap = total("kv_total_blocks")
    return {
        "replicas": len(rows),
        "healthy": len(healthy),
        "waiting": total("waiting"),
        "running": total("running"),
        "kv_usage": (used / cap) if used is not None and cap else None,
        "throughput_tok_s": total("throughput_tok_s"),
        "throughput_req_s": total("throughput_req_s"),
        "preemptions_per_s": total("preemptions_per_s"),
    }


def breaker_note(trips: int | None, breaker: contract.Breaker | None = None) -> str | None:
    """A note like ``breaker tripped 2× (last: ValueError: ...; v3 → vLLM's stock order)`` when the
    replica's circuit breaker has tripped (``breaker``: the /state document's, for the details),
    else None."""
    if not trips:
        return None
    note = f"breaker tripped {trips}×"
    if breaker is not None:
        failed, fallback = breaker.failed_version, breaker.fallback_version
        to = f"v{fallback}" if fallback is not None else "vLLM's stock order"
        last = breaker.last_error or "no error reported"
        note += f" (last: {last}; v{failed if failed is not None else '?'} → {to})"
    return note


def rejected_note(rejected: Mapping[str, int] | None) -> str | None:
    """A note like ``not stored as sent: duplicate_id 1, out_of_range 2`` (storage.limits.REASONS),
    else None."""
    if not rejected:
        return None
    return "not stored as sent: " + ", ".join(
        f"{reason} {n:,}" for reason, n in sorted(rejected.items()) if n
    )


def replica_notes(r: SampleRow) -> list[str]:
    """What ``tailpilot status`` says about a replica beside its health: its circuit breaker's
    trips and what the collector could not store as the replica sent it."""
    return [n for n in (breaker_note(r.breaker_trips), rejected_note(r.rejected)) if n]


COLUMNS = (
    "replica",
    "health",
    "policy",
    "γ",
    "wait",
    "run",
    "KV",
    "TTFT p50/p95/p99",
    "TTLT p50/p95/p99",
    "preempt/s",
    "tok/s",
)


def status_table(
    rows: Sequence[SampleRow],
    pinned: Mapping[str, Iterable[str]] | None = None,
    title: str | None = None,
) -> Table:
    """One row per replica plus cluster totals; unhealthy replicas show their reason."""
    pinned = pinned or {}
    table = Table(title=title, expand=False)
    for name in COLUMNS:
        table.add_column(
            name, justify="left" if name in ("replica", "health", "policy") else "right"
        )
    for r in sorted(rows, key=lambda r: r.replica):
        lat = r.latency
        health = (
            Text("ok", style="green")
            if r.healthy
            else Text(f"DOWN: {r.reason or '?'}", style="bold red")
        )
        for note in replica_notes(r):
            health.append(f"; {note}", style="yellow")
        table.add_row(
            r.replica,
            health,
            r.policy or "—",
            fmt_gamma(r.gamma_live, "gamma" in set(pinned.get(r.replica, ()))),
            fmt_number(r.waiting),
            fmt_number(r.running),
            fmt_percent(r.kv_usage),
            "/".join(fmt_seconds(x) for x in (lat.ttft_p50, lat.ttft_p95, lat.ttft_p99)),
            "/".join(fmt_seconds(x) for x in (lat.ttlt_p50, lat.ttlt_p95, lat.ttlt_p99)),
            fmt_number(r.preemptions_per_s, 1),
            fmt_number(r.throughput_tok_s),
        )
    t = cluster_totals(rows)
    table.add_section()
    table.add_row(
        "cluster",
        f"{t['healthy']}/{t['replicas']} ok",
        "",
        "",
        fmt_number(t["waiting"]),
        fmt_number(t["running"]),
        fmt_percent(t["kv_usage"]),
        "",
        "",
        fmt_number(t["preemptions_per_s"], 1),
        fmt_number(t["throughput_tok_s"]),
    )
    return table


def sample_json(rows: Sequence[SampleRow]) -> dict[str, Any]:
    """The status document of ``tailpilot status --json``: every replica row and the totals."""
    return {
        "replicas": [asdict(r) for r in sorted(rows, key=lambda r: r.replica)],
        "totals": cluster_totals(rows),
    }


ALERT_LABELS = {"scr": "SCR", "jfi": "JFI", "type_fairness": "type fairness"}


def _alert_figures(governance: Mapping[str, Any]) -> dict[str, object]:
    # The figure each alert judges: JFI's alert acts on the suppression-aware ``jfi``, never
    # ``jfi_seed`` (docs/governance.md).
    return {
        "scr": governance.get("scr"),
        "jfi": governance.get("jfi"),
        "type_fairness": governance.get("type_fairness_min"),
    }


def _ordered(alerts: Mapping[str, str]) -> list[tuple[str, str]]:
    return sorted(alerts.items(), key=lambda kv: (kv[1] != "critical", kv[0]))


def alert_text(governance: Mapping[str, Any] | None) -> Text:
    """One line: the firing governance alerts with their figures (the TUI's alert bar), or
    "no alerts"; then the pending ones (condition holding, not yet for ``alerts.for_s``); empty
    when the cluster is not governed."""
    if not governance:
        return Text("")
    firing = governance.get("alerts") or {}
    pending = {
        k: v for k, v in (governance.get("alerts_pending") or {}).items() if firing.get(k) != v
    }
    figure = _alert_figures(governance)
    if not firing:
        out = Text("governance: no alerts", style="green")
    else:
        out = Text("ALERT ", style="bold")
        for i, (name, severity) in enumerate(_ordered(firing)):
            if i:
                out.append("  ")
            out.append(
                f"{ALERT_LABELS.get(name, name)} {fmt_figure(figure.get(name), 3)} ({severity})",
                style="bold red" if severity == "critical" else "yellow",
            )
    if pending:
        out.append("   pending: ", style="dim")
        out.append(
            ", ".join(
                f"{ALERT_LABELS.get(n, n)} {fmt_figure(figure.get(n), 3)} ({sev})"
                for n, sev in _ordered(pending)
            ),
            style="yellow",
        )
    return out


def figures_text(governance: Mapping[str, Any], sep: str = "   ") -> str:
    """SCR, JFI beside JFI (seed), type fairness and the request count, as one line. JFI is the
    suppression-aware figure the alerts and the governor act on; JFI (seed) the seed's literal
    one, reported only."""
    return sep.join(
        (
            f"SCR {fmt_figure(governance.get('scr'), 3)}",
            f"JFI {fmt_figure(governance.get('jfi'), 3)}",
            f"JFI (seed) {fmt_figure(governance.get('jfi_seed'), 3)}",
            f"type fairness (min) {fmt_figure(governance.get('type_fairness_min'), 3)}",
            f"{governance.get('requests', 0)} requests in the window",
        )
    )


def is_over_consumer(governance: Mapping[str, Any], tenant: str) -> bool:
    """ω < 1: the tenant uses more than its commitment (the report's ``over_consumers``; an older
    stored window without it: from ω itself)."""
    over = governance.get("over_consumers")
    if over is not None:
        return tenant in over
    omega = ((governance.get("tenants") or {}).get(tenant) or {}).get("omega")
    return omega is not None and omega < 1.0


def omega_text(governance: Mapping[str, Any], tenant: str) -> Text:
    """A tenant's ω = min(C/U, α), "0.4 over" (bold) for an over-consumer; "—" when not reported."""
    omega = ((governance.get("tenants") or {}).get(tenant) or {}).get("omega")
    if omega is None:
        return Text("—", style="dim")
    if is_over_consumer(governance, tenant):
        return Text(f"{fmt_figure(omega, 2)} over", style="bold yellow")
    return Text(fmt_figure(omega, 2))


def waiting_text(figures: Mapping[str, Any]) -> Text:
    """What a tenant still has waiting at the window's end: "3 ≥12.00s" (its requests waiting, and
    how long at least they have waited), "starved …" in red when nothing of it completed; "—" when
    nothing waits."""
    if not figures.get("waiting"):
        return Text("—", style="dim")
    text = _waiting(figures).replace(" waiting", "")
    if figures.get("starved"):
        return Text(f"starved {text}", style="bold red")
    return Text(text)


def _waiting(figures: Mapping[str, Any]) -> str:
    """ "3 waiting ≥12.00s": a tenant's requests waiting, and a lower bound of how long."""
    waited = figures.get("waited_s")
    return f"{figures.get('waiting') or 0:,} waiting" + (
        f" ≥{fmt_seconds(waited)}" if waited else ""
    )


def governance_notes(governance: Mapping[str, Any]) -> Text | None:
    """One line naming the over-consumers (ω < 1) and the starved tenants (requests waiting,
    nothing completed), or None when there are neither."""
    tenants = governance.get("tenants") or {}
    over = sorted(t for t in tenants if is_over_consumer(governance, t))
    starved = sorted(t for t, f in tenants.items() if f.get("starved") and f.get("waiting"))
    if not over and not starved:
        return None
    out = Text()
    if over:
        out.append("over-consumers (ω < 1): ", style="bold yellow")
        out.append(", ".join(f"{t} ω {fmt_figure(tenants[t].get('omega'), 2)}" for t in over))
    if starved:
        if over:
            out.append("   ")
        out.append("starved: ", style="bold red")
        out.append(", ".join(f"{t} ({_waiting(tenants[t])})" for t in starved))
    return out


def fmt_target(figures: Mapping[str, Any], key: str) -> str:
    """A tenant's figure against its target, "2.40s/1.00s" (the figure alone without a target)."""
    value = fmt_seconds(figures.get(key))
    limit = (figures.get("limits") or {}).get(key)
    return value if limit is None else f"{value}/{fmt_seconds(limit)}"


def governance_lines(governance: Mapping[str, Any] | None) -> list[Text]:
    """What ``tailpilot status`` prints under the table: the alert line (firing, then pending), SCR,
    JFI and JFI (seed), type fairness, the over-consumers and starved tenants, and per tenant its
    TTFT quantiles against its targets, throughput, service ratio (JFI's x), ω and what waits."""
    if not governance:
        return []
    lines = [alert_text(governance), Text(figures_text(governance))]
    notes = governance_notes(governance)
    if notes is not None:
        lines.append(notes)
    for tenant, f in sorted((governance.get("tenants") or {}).items()):
        cells = "  ".join(
            f"{q.replace('_', ' ').upper()} {fmt_target(f, q)}"
            for q in ("ttft_p50", "ttft_p90", "ttft_p99")
        )
        line = Text(
            f"  {tenant}: {cells}   {fmt_number(f.get('tok_s'))} tok/s   "
            f"served/entitled {fmt_figure(f.get('service_ratio'), 3)}   ω "
        )
        line.append_text(omega_text(governance, tenant))
        if f.get("waiting"):
            line.append("   waiting ")
            line.append_text(waiting_text(f))
        line.append_text(
            Text("   meets", style="green")
            if f.get("compliant")
            else Text("   misses " + ", ".join(f.get("missed", [])), style="red")
        )
        lines.append(line)
    return lines


def governor_notes(status: Mapping[str, Any] | None) -> list[str]:
    """What a governor's status says beyond its modes (``modes_text`` covers those and changes
    kept after ``disarm --keep``): the tenants each active mode throttles, and why a mode whose
    figure is low was not entered (``held``)."""
    status = status or {}
    active = status.get("active") or {}
    notes = [
        f"{mode} throttles {', '.join(tenants)}"
        for mode, tenants in sorted((status.get("targets") or {}).items())
        if tenants and mode in active
    ]
    if status.get("held"):
        notes.append(f"held: {status['held']}")
    return notes

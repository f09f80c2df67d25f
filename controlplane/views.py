"""Pure render functions over collector rows: the cluster table of ``tailpilot status`` and
``tailpilot demo``, and the same data as JSON. No I/O here — the TUI, the CLI and the tests all
render the same rows the same way.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Iterable, Mapping, Sequence

from rich.console import Console
from rich.table import Table
from rich.text import Text

from storage.rows import SampleRow


def wide_console(min_width: int = 160) -> Console:
    """The terminal's console, or a wide one when output is piped (tables must not wrap in logs)."""
    console = Console()
    return console if console.is_terminal and console.width >= min_width else Console(width=min_width)


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
    return {"replicas": len(rows), "healthy": len(healthy), "waiting": total("waiting"),
            "running": total("running"), "kv_usage": (used / cap) if used is not None and cap else None,
            "throughput_tok_s": total("throughput_tok_s"), "throughput_req_s": total("throughput_req_s"),
            "preemptions_per_s": total("preemptions_per_s")}


def breaker_note(trips: int | None, breaker: Mapping | None = None) -> str | None:
    """A note like ``breaker tripped 2× (last: ValueError: ...; v3 → vLLM's stock order)`` when the
    replica's circuit breaker has tripped (``breaker``: the /state document's, for the details), else None."""
    if not trips:
        return None
    note = f"breaker tripped {trips}×"
    if breaker:
        failed, fallback = breaker.get("failed_version"), breaker.get("fallback_version")
        to = f"v{fallback}" if fallback is not None else "vLLM's stock order"
        last = breaker.get("last_error") or "no error reported"
        note += f" (last: {last}; v{failed if failed is not None else '?'} → {to})"
    return note


def rejected_note(rejected: Mapping[str, int] | None) -> str | None:
    """A note like ``not stored as sent: duplicate_id 1, out_of_range 2`` (storage.limits.REASONS), else None."""
    if not rejected:
        return None
    return "not stored as sent: " + ", ".join(f"{reason} {n:,}" for reason, n in sorted(rejected.items()) if n)


def replica_notes(r: SampleRow) -> list[str]:
    """What ``tailpilot status`` says about a replica beside its health: its circuit breaker's
    trips and what the collector could not store as the replica sent it."""
    return [n for n in (breaker_note(r.breaker_trips), rejected_note(r.rejected)) if n]


COLUMNS = ("replica", "health", "policy", "γ", "wait", "run", "KV", "TTFT p50/p95/p99", "TTLT p50/p95/p99",
           "preempt/s", "tok/s")


def status_table(rows: Sequence[SampleRow], pinned: Mapping[str, Iterable[str]] | None = None,
                 title: str | None = None) -> Table:
    """One row per replica plus cluster totals; unhealthy replicas show their reason."""
    pinned = pinned or {}
    table = Table(title=title, expand=False)
    for name in COLUMNS:
        table.add_column(name, justify="left" if name in ("replica", "health", "policy") else "right")
    for r in sorted(rows, key=lambda r: r.replica):
        lat = r.latency
        health = Text("ok", style="green") if r.healthy else Text(f"DOWN: {r.reason or '?'}", style="bold red")
        for note in replica_notes(r):
            health.append(f"; {note}", style="yellow")
        table.add_row(
            r.replica, health, r.policy or "—",
            fmt_gamma(r.gamma_live, "gamma" in set(pinned.get(r.replica, ()))),
            fmt_number(r.waiting), fmt_number(r.running), fmt_percent(r.kv_usage),
            "/".join(fmt_seconds(x) for x in (lat.ttft_p50, lat.ttft_p95, lat.ttft_p99)),
            "/".join(fmt_seconds(x) for x in (lat.ttlt_p50, lat.ttlt_p95, lat.ttlt_p99)),
            fmt_number(r.preemptions_per_s, 1), fmt_number(r.throughput_tok_s))
    t = cluster_totals(rows)
    table.add_section()
    table.add_row("cluster", f"{t['healthy']}/{t['replicas']} ok", "", "", fmt_number(t["waiting"]),
                  fmt_number(t["running"]), fmt_percent(t["kv_usage"]), "", "",
                  fmt_number(t["preemptions_per_s"], 1), fmt_number(t["throughput_tok_s"]))
    return table


def sample_json(rows: Sequence[SampleRow]) -> dict:
    """The status document of ``tailpilot status --json``: every replica row and the totals."""
    return {"replicas": [asdict(r) for r in sorted(rows, key=lambda r: r.replica)],
            "totals": cluster_totals(rows)}


ALERT_LABELS = {"scr": "SCR", "jfi": "JFI", "type_fairness": "type fairness"}


def alert_text(governance: Mapping | None) -> Text:
    """One line: the firing governance alerts with their figures (the TUI's alert bar), or
    "no alerts"; empty when the cluster is not governed."""
    if not governance:
        return Text("")
    firing = governance.get("alerts") or {}
    if not firing:
        return Text("governance: no alerts", style="green")
    figure = {"scr": governance.get("scr"), "jfi": governance.get("jfi"),
              "type_fairness": governance.get("type_fairness_min")}
    out = Text("ALERT ", style="bold")
    for i, (name, severity) in enumerate(sorted(firing.items(), key=lambda kv: (kv[1] != "critical", kv[0]))):
        if i:
            out.append("  ")
        value = figure.get(name)
        out.append(f"{ALERT_LABELS.get(name, name)} {fmt_figure(value, 3)} ({severity})",
                   style="bold red" if severity == "critical" else "yellow")
    return out


def fmt_target(figures: Mapping, key: str) -> str:
    """A tenant's figure against its target, "2.40s/1.00s" (the figure alone without a target)."""
    value = fmt_seconds(figures.get(key))
    limit = (figures.get("limits") or {}).get(key)
    return value if limit is None else f"{value}/{fmt_seconds(limit)}"


def governance_lines(governance: Mapping | None) -> list[Text]:
    """What ``tailpilot status`` prints under the table: the alert line, SCR, JFI, type fairness
    and each tenant's TTFT quantiles against its targets."""
    if not governance:
        return []
    lines = [alert_text(governance),
             Text(f"SCR {fmt_figure(governance.get('scr'), 3)}   JFI {fmt_figure(governance.get('jfi'), 3)}   "
                  f"type fairness (min) {fmt_figure(governance.get('type_fairness_min'), 3)}   over "
                  f"{governance.get('requests', 0)} requests")]
    for tenant, f in sorted((governance.get("tenants") or {}).items()):
        cells = "  ".join(f"{q.replace('_', ' ').upper()} {fmt_target(f, q)}" for q in ("ttft_p50", "ttft_p90", "ttft_p99"))
        verdict = Text(" meets", style="green") if f.get("compliant") else Text(
            " misses " + ", ".join(f.get("missed", [])), style="red")
        lines.append(Text(f"  {tenant}: {cells}   {fmt_number(f.get('tok_s'))} tok/s") + verdict)
    return lines

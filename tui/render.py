"""Panels as pure functions: snapshots and histories in, cells, rich renderables and plot series
out. No widgets, no I/O — testable without a running app. Reuses controlplane.views' formatters
and scheduler.metrics' fairness helpers.

Here: the cluster table, the replica panel and the audit log's rows. The alerts panel's are
``tui.alerts_render``, the dialogs' ``tui.dialog_render``, the autopilot's
``tui.autopilot_render`` and the tuner panel's ``tui.tuner_render``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rich.text import Text

from controlplane.snapshot import ClusterSnapshot, ReplicaSnapshot
from controlplane.views import (
    breaker_note,
    cluster_totals,
    fmt_figure,
    fmt_gamma,
    fmt_number,
    fmt_percent,
    fmt_seconds,
    rejected_note,
)
from scheduler.metrics import slo_compliance
from scheduler.settings_change import fmt_value
from storage.rows import PERCENTILE_FIELDS, GroupSampleRow, SampleRow
from tui.edits import diff_summary
from tui.sources import fmt_time

Cell = str | Text
"""A table cell: plain text, or styled."""
Row = tuple[Cell, ...]
"""A table row's cells, in its columns' order."""

NAN = float("nan")
SPARK_BLOCKS = "▁▂▃▄▅▆▇█"
SPARK_LEN = 10


def sparkline(
    values: Sequence[float], width: int = SPARK_LEN, lo: float = 0.0, hi: float = 1.0
) -> str:
    """A unicode block sparkline of the last ``width`` values on a fixed [lo, hi] scale."""
    vals = [v for v in values if v is not None and math.isfinite(v)][-width:]
    if not vals:
        return " " * width
    span = (hi - lo) or 1.0
    out = []
    for v in vals:
        x = min(max((v - lo) / span, 0.0), 1.0)
        out.append(SPARK_BLOCKS[min(int(x * len(SPARK_BLOCKS)), len(SPARK_BLOCKS) - 1)])
    return "".join(out).rjust(width)


def fmt_triplet(a: float | None, b: float | None, c: float | None) -> str:
    return "/".join(fmt_seconds(x) for x in (a, b, c))


# ------------------------------------------------------------------------------ cluster table


@dataclass(frozen=True)
class Column:
    key: str
    label: str
    width: int
    sort: Callable[[ReplicaSnapshot], Any]  # sort value (None sorts last)
    right: bool = True


def _attr(name: str) -> Callable[[ReplicaSnapshot], Any]:
    return lambda rs: getattr(rs.sample, name, None) if rs.sample is not None else None


def _lat(name: str) -> Callable[[ReplicaSnapshot], Any]:
    return lambda rs: getattr(rs.sample.latency, name, None) if rs.sample is not None else None


def _live_adaptive(rs: ReplicaSnapshot) -> float | None:
    s = rs.sample
    if s is None:
        return None
    return s.gamma_live if s.gamma_live is not None else s.beta_live


COLUMNS: tuple[Column, ...] = (
    Column("sel", " ", 1, lambda rs: 0, right=False),
    Column("replica", "replica", 12, lambda rs: rs.name, right=False),
    Column(
        "health", "health", 20, lambda rs: (rs.health.healthy, rs.health.reason or ""), right=False
    ),
    Column("policy", "policy", 9, lambda rs: policy_of(rs) or "", right=False),
    Column("gamma", "γ/β live", 8, _live_adaptive),
    Column("waiting", "wait", 5, _attr("waiting")),
    Column("running", "run", 5, _attr("running")),
    Column("kv", "KV usage", 15, _attr("kv_usage"), right=False),
    Column("ttft", "TTFT p50/p95/p99", 20, _lat("ttft_p99")),
    Column("ttlt", "TTLT p50/p95/p99", 20, _lat("ttlt_p99")),
    Column("preempt", "pre/s", 6, _attr("preemptions_per_s")),
    Column("tok_s", "tok/s", 7, _attr("throughput_tok_s")),
)
COLUMN_KEYS = tuple(c.key for c in COLUMNS)
SORTABLE = tuple(c.key for c in COLUMNS if c.key != "sel")


def policy_of(rs: ReplicaSnapshot) -> str | None:
    if rs.sample is not None and rs.sample.policy:
        return rs.sample.policy
    if rs.settings:
        return rs.settings.get("policy")
    return None


def pinned_of(rs: ReplicaSnapshot) -> set[str]:
    return set((rs.settings or {}).get("pinned") or ())


def health_cell(rs: ReplicaSnapshot, width: int = 20) -> Text:
    h = rs.health
    if rs.sample is None and h.reason == "not polled yet":
        return Text("… not polled yet", style="dim")
    if not h.healthy:
        reason = h.reason or "unknown reason"
        return Text(f"DOWN {reason}"[:width], style="bold red")
    if h.reason:  # healthy with a remark (metrics only)
        return Text(f"ok {h.reason}"[:width], style="yellow")
    return Text("ok", style="green")


def adaptive_cell(rs: ReplicaSnapshot) -> str:
    s = rs.sample
    if s is None:
        return "—"
    pins = pinned_of(rs)
    if s.gamma_live is not None:
        return fmt_gamma(s.gamma_live, "gamma" in pins)
    if s.beta_live is not None:
        return "β" + fmt_gamma(s.beta_live, "beta" in pins)
    return "—"


def cluster_row(rs: ReplicaSnapshot, kv_trail: Sequence[float] = (), selected: bool = False) -> Row:
    """The cells of one replica's row, in :data:`COLUMNS` order."""
    s = rs.sample
    sel = Text("●", style="bold magenta") if selected else " "
    name = rs.name
    if s is None:
        return (
            sel,
            name,
            health_cell(rs),
            policy_of(rs) or "—",
            "—",
            "—",
            "—",
            "—",
            "—",
            "—",
            "—",
            "—",
        )
    dim = not rs.health.healthy
    lat = s.latency

    def cell(text: str) -> Text | str:
        return Text(text, style="dim") if dim else text

    kv = f"{fmt_percent(s.kv_usage):>4} {sparkline(kv_trail)}"
    return (
        sel,
        name,
        health_cell(rs),
        policy_of(rs) or "—",
        cell(adaptive_cell(rs)),
        cell(fmt_number(s.waiting)),
        cell(fmt_number(s.running)),
        cell(kv),
        cell(fmt_triplet(lat.ttft_p50, lat.ttft_p95, lat.ttft_p99)),
        cell(fmt_triplet(lat.ttlt_p50, lat.ttlt_p95, lat.ttlt_p99)),
        cell(fmt_number(s.preemptions_per_s, 1)),
        cell(fmt_number(s.throughput_tok_s)),
    )


def sort_key(column: str) -> Callable[[ReplicaSnapshot], tuple[bool, Any, str]]:
    """A key for sorting replicas by ``column``; missing values sort last, ties by name."""
    col = next(c for c in COLUMNS if c.key == column)

    def key(rs: ReplicaSnapshot) -> tuple[bool, Any, str]:
        v = col.sort(rs)
        missing = v is None or (isinstance(v, float) and math.isnan(v))
        return (missing, 0 if missing else v, rs.name)

    return key


def matches_filter(rs: ReplicaSnapshot, text: str) -> bool:
    """``/`` filter: every word must appear in the name, policy, health or reason."""
    words = text.lower().split()
    if not words:
        return True
    hay = " ".join(
        x
        for x in (
            rs.name,
            policy_of(rs) or "",
            "ok" if rs.health.healthy else "down unhealthy",
            rs.health.reason or "",
        )
        if x
    ).lower()
    return all(w in hay for w in words)


def totals_text(snap: ClusterSnapshot | None, shown: int | None = None) -> Text:
    """The cluster totals line under the table (sums over healthy replicas)."""
    if snap is None:
        return Text("waiting for the first snapshot…", style="dim")
    rows = [rs.sample for rs in snap.replicas.values() if rs.sample is not None]
    t = cluster_totals(rows)
    unpolled = sum(1 for rs in snap.replicas.values() if rs.sample is None)
    worst = [r.latency.ttlt_p99 for r in rows if r.healthy and r.latency.ttlt_p99 is not None]
    worst_ft = [r.latency.ttft_p99 for r in rows if r.healthy and r.latency.ttft_p99 is not None]
    healthy_style = "green" if t["healthy"] == len(snap.replicas) else "bold red"
    out = Text("cluster ", style="bold")
    out.append(f"{t['healthy']}/{len(snap.replicas)} healthy", style=healthy_style)
    if unpolled:
        out.append(f" ({unpolled} not polled yet)", style="dim")
    out.append(
        f" │ waiting {fmt_number(t['waiting'])} │ running {fmt_number(t['running'])}"
        f" │ KV {fmt_percent(t['kv_usage'])}"
        f" │ worst TTFT p99 {fmt_seconds(max(worst_ft) if worst_ft else None)}"
        f" │ worst TTLT p99 {fmt_seconds(max(worst) if worst else None)}"
        f" │ {fmt_number(t['preemptions_per_s'], 1)} preempt/s"
        f" │ {fmt_number(t['throughput_tok_s'])} tok/s"
        f" │ {fmt_number(t['throughput_req_s'], 1)} req/s"
    )
    if shown is not None and shown != len(snap.replicas):
        out.append(f" │ showing {shown} of {len(snap.replicas)}", style="yellow")
    return out


# ------------------------------------------------------------------------------ replica panel


def fidelity_line(report: dict[str, Any] | None) -> Text:
    """How far to trust the simulator on this replica: its newest fidelity report's error band."""
    if report is None:
        return Text(
            "simulator fidelity: not measured on this replica (tailpilot fidelity --replica NAME)",
            style="dim",
        )
    summary = report["summary"]
    band = summary.get("band")
    rho = (summary.get("overall") or {}).get("decision", {}).get("spearman")
    out = Text("simulator on this replica: ", style="bold")
    out.append("n/a" if band is None else f"±{band:.0%}", style="bold")
    spearman = "n/a" if rho is None else f"{rho:.2f}"
    out.append(
        f" (largest P50/P99 latency error; order Spearman {spearman}; "
        f"{summary.get('requests', 0):,} requests of {report['span']}, "
        f"{fmt_time(report['created_ms'])} UTC)",
        style="dim",
    )
    return out


def replica_header(rs: ReplicaSnapshot | None, window_s: float | None = None) -> Text:
    if rs is None:
        return Text("no replica selected — pick one in the cluster panel (1)", style="dim")
    out = Text(rs.name, style="bold")
    out.append("  ")
    out.append_text(health_cell(rs, 200))
    pol = policy_of(rs)
    out.append(f"  │ policy {pol or '—'}")
    if rs.settings_version is not None:
        out.append(f" (settings v{rs.settings_version})")
    pending = None if rs.state is None else rs.state.pending_version
    if isinstance(pending, int):  # staged by a PUT; the replica applies it at its next engine step
        out.append(f" v{pending} staged", style="yellow")
    s = rs.sample
    if s is not None:
        if s.gamma_live is not None:
            out.append(
                f" │ γ live {s.gamma_live:.4g}" + (" (pinned)" if "gamma" in pinned_of(rs) else "")
            )
        if s.beta_live is not None:
            out.append(
                f" │ β live {s.beta_live:.4g}" + (" (pinned)" if "beta" in pinned_of(rs) else "")
            )
        out.append(f" │ sample {fmt_time(s.t_ms)} UTC")
    if window_s:
        out.append(f" │ window {window_s:g} s")
    out.append(" │ red lines: settings changes", style="red")
    if rs.settings:
        params = rs.settings.get("params") or {}
        shown = ", ".join(f"{k}={fmt_value(v)}" for k, v in params.items())
        pins = rs.settings.get("pinned") or []
        line = f"\nsettings: {shown or 'no parameters'}"
        if pins:
            line += f" │ pinned: {', '.join(pins)}"
        out.append(line, style="dim")
    for note in replica_notes(rs):
        out.append(f"\n{note}", style="bold yellow")
    return out


def replica_notes(rs: ReplicaSnapshot) -> list[str]:
    """The replica's circuit-breaker trips (with the last error and the versions) and what the
    collector could not store as it sent it: lines under the replica's header, none when all is
    well."""
    trips = None if rs.breaker is None else rs.breaker.trips_total
    return [
        n
        for n in (
            breaker_note(trips if isinstance(trips, int) else None, rs.breaker),
            rejected_note(rs.rejected),
        )
        if n
    ]


@dataclass
class Series:
    """One plot: x in seconds relative to the snapshot time, named y series (None = gap)."""

    title: str
    x: list[float]
    lines: dict[str, list[float | None]]
    markers: list[float]  # x of policy / settings changes
    ylabel: str = ""


def change_markers(
    history: Sequence[SampleRow],
    audit: Iterable[Mapping[str, Any]] = (),
    replica: str | None = None,
) -> list[int]:
    """t_ms of policy or settings-version changes: from the samples themselves, plus applied
    audit rows of ``replica`` inside the history's span."""
    out: list[int] = []
    prev: tuple[str | None, int | None] | None = None
    for row in history:
        if row.policy is None and row.settings_version is None:
            continue
        cur = (row.policy, row.settings_version)
        if prev is not None and cur != prev:
            out.append(row.t_ms)
        prev = cur
    if history:
        lo, hi = history[0].t_ms, history[-1].t_ms
        for a in audit:
            # an audited change shows in the samples at the next poll: mark once
            if (
                (replica is None or a.get("replica") == replica)
                and a.get("result") == "applied"
                and lo <= a["t_ms"] <= hi
                and not any(abs(a["t_ms"] - t) <= 5_000 and t >= a["t_ms"] for t in out)
            ):
                out.append(int(a["t_ms"]))
    return sorted(set(out))


def replica_series(
    history: Sequence[SampleRow], now_ms: int, markers_ms: Sequence[int] = ()
) -> list[Series]:
    """The replica panel's plots from a sample history."""
    x = [(r.t_ms - now_ms) / 1000.0 for r in history]
    marks = [(t - now_ms) / 1000.0 for t in markers_ms]

    def col(fn: Callable[[SampleRow], float | None]) -> list[float | None]:
        return [fn(r) if r.healthy else None for r in history]

    has_beta = any(r.beta_live is not None for r in history) and not any(
        r.gamma_live is not None for r in history
    )
    return [
        Series(
            "TTFT (s)",
            x,
            {
                "p50": col(lambda r: r.latency.ttft_p50),
                "p95": col(lambda r: r.latency.ttft_p95),
                "p99": col(lambda r: r.latency.ttft_p99),
            },
            marks,
        ),
        Series(
            "TTLT (s)",
            x,
            {
                "p50": col(lambda r: r.latency.ttlt_p50),
                "p95": col(lambda r: r.latency.ttlt_p95),
                "p99": col(lambda r: r.latency.ttlt_p99),
            },
            marks,
        ),
        Series(
            "queue depth",
            x,
            {"waiting": col(lambda r: r.waiting), "running": col(lambda r: r.running)},
            marks,
        ),
        Series(
            "KV usage (%)",
            x,
            {"kv": col(lambda r: None if r.kv_usage is None else 100 * r.kv_usage)},
            marks,
        ),
        Series(
            "live β" if has_beta else "live γ",
            x,
            {"β" if has_beta else "γ": col(lambda r: r.beta_live if has_beta else r.gamma_live)},
            marks,
        ),
        Series("throughput", x, {"tok/s": col(lambda r: r.throughput_tok_s)}, marks),
    ]


def _tenant_metrics(g: GroupSampleRow, slos: Mapping[str, float]) -> dict[str, float]:
    m = {
        f: (getattr(g.latency, f) if getattr(g.latency, f) is not None else NAN)
        for f in PERCENTILE_FIELDS
    }
    m["throughput_tok_s"] = g.throughput_tok_s if g.throughput_tok_s is not None else NAN
    m["requests"] = float(g.completed)
    for name in slos:
        m.setdefault(name, NAN)  # a quantile the window does not give: not shown compliant
    return m


def tenant_table(
    groups: Sequence[GroupSampleRow],
    slos: Mapping[str, float],
    governance: Mapping[str, Any] | None = None,
) -> tuple[list[Row], Text]:
    """(rows, summary) of the replica's per-tenant table: P99s, throughput, SLO; the summary gives
    the replica's SCR against the cluster file's ``slos`` and the cluster's JFI and JFI (seed)
    from ``governance`` (the collector's report: one implementation, never recomputed here)."""
    tenants = sorted((g for g in groups if g.kind == "tenant"), key=lambda g: g.group)
    per = {g.group: _tenant_metrics(g, slos) for g in tenants}
    ok: dict[str, bool] = slo_compliance(per, slos) if slos and per else {}
    rows: list[Row] = []
    for g in tenants:
        lat = g.latency
        slo = (
            "—"
            if not slos
            else Text("meets", style="green")
            if ok.get(g.group)
            else Text("MISSES", style="bold red")
        )
        rows.append(
            (
                g.group,
                fmt_number(g.completed),
                fmt_number(g.throughput_tok_s),
                fmt_seconds(lat.ttft_p99),
                fmt_seconds(lat.ttlt_p99),
                fmt_seconds(lat.tbt_p99),
                slo,
            )
        )
    summary = Text()
    if not per:
        summary.append("no completions in the window", style="dim")
    elif slos:
        scr = sum(ok.values()) / len(ok)
        summary.append(f"SCR {scr:.2f}", style="green" if scr >= 1 else "bold red")
        summary.append(
            f" ({sum(ok.values())}/{len(ok)} tenants meet "
            + ", ".join(
                f"{k} ≤ {fmt_seconds(v) if k[:4] in ('ttft', 'ttlt', 'tbt_') else v}"
                for k, v in slos.items()
            )
            + ")"
        )
    else:
        summary.append("SCR — (no slos in the cluster file)", style="dim")
    summary.append(" │ ")
    if governance:
        summary.append(
            f"cluster: JFI {fmt_figure(governance.get('jfi'), 3)} · "
            f"JFI (seed) {fmt_figure(governance.get('jfi_seed'), 3)}"
        )
    else:
        summary.append("JFI — (not governed)", style="dim")
    return rows, summary


def type_share_rows(groups: Sequence[GroupSampleRow]) -> list[Row]:
    """Per request type: requests, their share, output-token share (of the window)."""
    types_ = sorted((g for g in groups if g.kind == "type"), key=lambda g: g.group)
    n = sum(g.completed for g in types_)
    tok = sum(g.throughput_tok_s or 0.0 for g in types_)
    rows: list[Row] = []
    for g in types_:
        rows.append(
            (
                g.group,
                fmt_number(g.completed),
                fmt_percent(g.completed / n if n else None),
                fmt_percent((g.throughput_tok_s or 0.0) / tok if tok else None),
                fmt_seconds(g.latency.ttlt_p99),
            )
        )
    return rows


# ------------------------------------------------------------------------------------- audit / diff


# An apply's outcome: active, accepted but not active yet, refused; anything else failed.
RESULT_STYLES = {"applied": "green", "staged": "cyan", "rejected": "yellow"}


def audit_row(a: Mapping[str, Any], verification: Mapping[str, Any] | None = None) -> Row:
    result = a.get("result") or "?"
    style = RESULT_STYLES.get(result, "bold red")
    change = (
        breaker_change(a.get("new"))
        if result == "breaker"
        else diff_summary(a.get("old"), a.get("new"))
    )
    return (
        f"{fmt_time(a.get('t_ms'))}",
        a.get("replica") or "—",
        a.get("who") or "—",
        Text(result, style=style),
        "—" if a.get("version") is None else str(a["version"]),
        change,
        verification_cell(verification),
        a.get("message") or "",
    )


def breaker_change(new: Mapping[str, Any] | None) -> str:
    """A circuit-breaker trip's change (the collector's audit row): the settings version that raised
    and what the engine fell back to."""
    new = new or {}
    failed, fallback = new.get("failed_version"), new.get("fallback_version")
    to = f"v{fallback}" if fallback is not None else "vLLM's stock order"
    return f"v{failed if failed is not None else '?'} → {to} (trip {new.get('trips_total', '?')})"


def verification_cell(v: Mapping[str, Any] | None) -> Text:
    """P95 TTFT predicted → realized (tuner.closed_loop.whatif.verify), "due HH:MM:SS" before its
    window ends, "—" for a change made without a prediction."""
    if v is None:
        return Text("—", style="dim")
    predicted = v["predicted"].get("ttft_p95")
    head = "n/a" if predicted is None else f"{predicted:+.0%}"
    if not v["ready"]:
        return Text(f"{head} → due {fmt_time(v['due_ms'])[11:]}", style="dim")
    realized = (v.get("metrics") or {}).get("ttft_p95", {}).get("realized")
    out = Text(f"{head} → ")
    out.append("n/a" if realized is None else f"{realized:+.0%}", style="bold")
    if v.get("band") is not None:
        out.append(f" (±{v['band']:.0%})", style="dim")
    return out


def apply_results(results: Iterable[Any]) -> Text:
    """What the last apply did, per replica (``collector.ApplyResult``): the policy panel and the
    tuner panel show the same lines."""
    text = Text("last apply:\n", style="bold")
    for r in results:
        style = RESULT_STYLES.get(r.result, "bold red")
        text.append(f"  {r.replica}: ", style="bold")
        text.append(f"{r.result} — {r.message}\n", style=style)
    return text

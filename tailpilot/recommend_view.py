"""How ``tailpilot recommend`` prints a recommendation (``tuner.studies.recommend.recommend``'s
summary): the search and held-out windows, the continuous replay, the constraints, the settings."""

from __future__ import annotations

import json
from typing import Any

from rich.console import Console
from rich.table import Table

from controlplane.views import fmt_figure, wide_console


def print_recommendation(s: dict[str, Any]) -> None:
    """The whole summary, on a wide console (a piped run gets every column)."""
    console = wide_console()
    head = (
        "keep the production settings (nothing beat them)"
        if s["is_production"]
        else f"trial #{s['trial']}"
    )
    console.print(
        f"[bold]study {s['study']}[/]: {s['trials_complete']} complete trials; "
        f"recommendation: {head}"
    )
    for t in s.get("traces", []):
        console.print(
            f"tuned on {t['source']} ({t['requests']:,} requests over {t['span_s']:,.0f} s)",
            markup=False,
        )
    pct = round(s["confidence"] * 100)
    for part, title in (
        ("search", "search windows (selected on; optimistic)"),
        ("holdout", "held-out windows (never searched)"),
    ):
        console.print(_window_table(s[part], title, pct))
    console.print(
        "per-window change: geometric mean over windows of recommended/production, with a "
        "t-interval over windows"
    )
    if s.get("continuous"):
        print_continuous(console, s["continuous"])
    print_constraints(console, s["holdout"].get("constraints", []))
    if s.get("pareto_front"):
        console.print(
            f"Pareto front: {len(s['pareto_front'])} trials "
            f"({', '.join('#' + str(t['trial']) for t in s['pareto_front'])})"
        )
    console.print("settings: " + json.dumps(s["settings"]))
    if s.get("autopilot"):
        console.print(
            f"autopilot on the continuous replay: {s['autopilot']['verdict']}", markup=False
        )
    if "stored_id" in s:
        console.print(f"stored as recommendation {s['stored_id']} (the TUI shows it)")


def _window_table(block: dict[str, Any], title: str, pct: int) -> Table:
    table = Table(
        title=f"{title}: {len(block['windows'])} windows; vs production, positive = better"
    )
    table.add_column("metric")
    table.add_column("production (mean)", justify="right")
    table.add_column("recommended (mean)", justify="right")
    table.add_column("change of means", justify="right")
    table.add_column(f"per-window change [{pct}% CI]", justify="right")
    for name, m in block["metrics"].items():
        mean_change = m.get("mean_change_pct")
        table.add_row(
            name,
            fmt_figure(m["baseline"]),
            fmt_figure(m["value"]),
            "—" if mean_change is None else f"{mean_change:+.1f}%",
            _ci(m),
        )
    return table


def _ci(m: dict[str, Any]) -> str:
    lo, hi = m.get("ci_pct") or (None, None)
    imp = m.get("improvement_pct")
    if imp is None:
        return "—"
    text = f"{imp:+.1f}%"
    if lo is not None and hi is not None:
        text += f" [{lo:+.1f}, {hi:+.1f}]"
    return text


def print_continuous(console: Console, cont: dict[str, Any]) -> None:
    """The continuous replay of the whole trace: production vs the recommendation, and the
    candidates passed over."""
    table = Table(
        title="continuous replay of the whole trace (what production would see); vs production"
    )
    table.add_column("metric")
    for col in (
        "production, held-out requests",
        "recommended",
        "change",
        "production, all requests",
        "recommended",
        "change",
    ):
        table.add_column(col, justify="right")
    for name, h in cont["holdout"].items():
        a = cont["all"][name]
        table.add_row(
            name,
            *(
                cell
                for m in (h, a)
                for cell in (
                    fmt_figure(m["production"]),
                    fmt_figure(m["value"]),
                    "—" if m["change_pct"] is None else f"{m['change_pct']:+.1f}%",
                )
            ),
        )
    console.print(table)
    for c in cont["checked"]:
        if c["losses"]:
            console.print(
                f"trial #{c['trial']} passed over: it loses the continuous replay "
                f"({'; '.join(c['losses'])})"
            )
    if cont["kept_production"]:
        console.print(
            "every candidate checked lost the continuous replay: keep the production settings"
        )


def print_constraints(console: Console, constraints: list[dict[str, Any]]) -> None:
    for c in constraints:
        # The value is how far the left side is past its bound (Optuna's convention): <= 0 holds.
        v = c["value"]
        if v is None:
            detail = "undefined on these windows"
        elif c["feasible"]:
            detail = f"with {fmt_figure(-v)} to spare"
        else:
            detail = f"by {fmt_figure(v)} over the bound"
        ok = "holds" if c["feasible"] else "VIOLATED"
        console.print(f"constraint {c['constraint']} on held-out windows: {ok} ({detail})")

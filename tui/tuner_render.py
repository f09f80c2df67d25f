"""The tuner panel as pure functions: ``tui.tuner_data`` records in, table cells, plot series and
rich renderables out. No widgets, no I/O."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from controlplane.views import fmt_figure
from scheduler.settings_change import fmt_value
from tui.edits import settings_diff
from tui.render import Row
from tui.sources import fmt_time
from tui.tuner_data import RecInfo, StudyDetail, StudyInfo, TrialInfo, finite

STUDY_COLUMNS = ("study", "policies", "objectives", "complete", "pruned", "failed", "best")
# Parameters shown first in the trials table (the adaptive ones and vLLM's two knobs).
KEY_PARAMS = ("gamma", "beta", "max_num_seqs", "max_num_batched_tokens")
SHORT = {
    "max_num_seqs": "seqs",
    "max_num_batched_tokens": "tokens",
    "long_prefill_token_threshold": "lp_thresh",
    "long_prefill_chunking": "lp_chunk",
    "alpha_s_per_token": "alpha",
}


def fmt_num(v: Any) -> str:
    return fmt_figure(v, sig=5, grouped=False)


def fmt_pct(v: Any) -> str:
    return f"{v:+.1f}%" if finite(v) else "—"


def objectives_text(objectives: Sequence[tuple[str, str]]) -> str:
    return ", ".join(f"{n} {'↓' if d == 'minimize' else '↑'}" for n, d in objectives) or "—"


def study_row(s: StudyInfo) -> Row:
    if s.best_values is not None:
        best = ", ".join(fmt_num(v) for v in s.best_values)
    elif len(s.objectives) > 1 and s.front:
        best = f"front of {len(s.front)}"
    else:
        best = "— (none feasible)"
    name = s.name if s.tailpilot else f"{s.name} (not tailpilot)"
    return (
        name,
        ",".join(s.policies) or "—",
        objectives_text(s.objectives),
        str(s.complete),
        str(s.pruned),
        str(s.failed) + (f" +{s.running} running" if s.running else ""),
        best,
    )


def trial_columns(objectives: Sequence[tuple[str, str]]) -> list[str]:
    return ["#", "state", *[n for n, _ in objectives], "policy", "key params"]


def key_params(params: Mapping[str, Any], limit: int = 6) -> str:
    """``γ=0.289 seqs=150 tokens=1050 …`` from Optuna's params (``uniboost.gamma``,
    ``engine.x``)."""
    flat: dict[str, Any] = {}
    for k, v in params.items():
        if k == "policy":
            continue
        flat[k.split(".", 1)[1] if "." in k else k] = v
    order = [k for k in KEY_PARAMS if k in flat] + [k for k in flat if k not in KEY_PARAMS]
    words = [
        f"{ {'gamma': 'γ', 'beta': 'β'}.get(k, SHORT.get(k, k)) }={fmt_num(flat[k])}"
        for k in order[:limit]
    ]
    if len(order) > limit:
        words.append(f"+{len(order) - limit}")
    return " ".join(words)


def trial_row(t: TrialInfo, n_objectives: int, front: Sequence[int] = ()) -> Row:
    mark = "★" if t.number in front else ("·" if t.production else "")
    number = Text(f"{t.number}{mark}", style="bold green" if t.number in front else "")
    state_style = {"complete": "green", "fail": "red", "running": "yellow"}.get(t.state, "dim")
    state = t.state if t.feasible or t.state != "complete" else "infeasible"
    vals: list[float | None] = list((t.values or ())[:n_objectives])
    vals += [None] * (n_objectives - len(vals))
    policy = str(t.params.get("policy", "—")) + (" (prod)" if t.production else "")
    return (
        number,
        Text(state, style=state_style if state != "infeasible" else "yellow"),
        *[fmt_num(v) for v in vals],
        policy,
        key_params(t.params),
    )


def trial_rows(d: StudyDetail) -> list[Row]:
    n = len(d.info.objectives)
    return [trial_row(t, n, d.info.front) for t in d.trials]


# ------------------------------------------------------------------------------------- plot


@dataclass(frozen=True)
class TunerPlot:
    """What the plot shows: a Pareto scatter (two objectives) or the best-so-far curve (one)."""

    kind: str  # "pareto" | "best" | "none"
    title: str
    xlabel: str = ""
    ylabel: str = ""
    series: dict[str, tuple[list[float], list[float]]] = field(
        default_factory=dict
    )  # label -> (x, y)


def tuner_plot(d: StudyDetail | None) -> TunerPlot:
    if d is None:
        return TunerPlot("none", "no study selected")
    objs = d.info.objectives
    # (trial, its values): the complete, feasible trials whose values are all finite
    done = [
        (t, t.values)
        for t in d.trials
        if t.values is not None
        and t.state == "complete"
        and t.feasible
        and all(finite(v) for v in t.values)
    ]
    if len(objs) == 2:
        (xn, xd), (yn, yd) = objs
        front = [(t, vs) for t, vs in done if t.number in d.info.front]
        rest = [(t, vs) for t, vs in done if t.number not in d.info.front]
        series = {}
        if rest:
            series["feasible"] = ([vs[0] for _t, vs in rest], [vs[1] for _t, vs in rest])
        if front:
            front.sort(key=lambda tv: tv[1][0])
            series["Pareto front"] = ([vs[0] for _t, vs in front], [vs[1] for _t, vs in front])
        arrow = {"minimize": "↓", "maximize": "↑"}
        return TunerPlot(
            "pareto",
            f"{len(done)} feasible trials, front of {len(front)}",
            f"{xn} {arrow[xd]}",
            f"{yn} {arrow[yd]}",
            series,
        )
    if len(objs) == 1:
        name, direction = objs[0]
        xs, ys, best = [], [], None
        for t, vs in sorted(done, key=lambda tv: tv[0].number):
            v = vs[0]
            best = (
                v if best is None else (min(best, v) if direction == "minimize" else max(best, v))
            )
            xs.append(float(t.number))
            ys.append(best)
        series = {"best so far": (xs, ys)} if xs else {}
        if xs:
            series["trial"] = ([float(t.number) for t, _vs in done], [vs[0] for _t, vs in done])
        return TunerPlot(
            "best", f"{name}: best so far ({len(done)} feasible trials)", "trial", name, series
        )
    return TunerPlot("none", f"{len(objs)} objectives: no plot")


# ----------------------------------------------------------------------------- recommendation


def _improvement_table(summary: Mapping[str, Any]) -> Table:
    table = Table(box=None, padding=(0, 1), show_edge=False, expand=False)
    table.add_column("metric", style="bold")
    table.add_column("search", justify="right")
    table.add_column("95% CI", justify="right", style="dim")
    table.add_column("held-out", justify="right")
    table.add_column("95% CI", justify="right", style="dim")
    search = (summary.get("search") or {}).get("metrics") or {}
    held = (summary.get("holdout") or {}).get("metrics") or {}
    objectives = [o["name"] for o in summary.get("objectives") or []]
    names = objectives + [n for n in list(search) + list(held) if n not in objectives]
    seen = set()
    for n in names:
        if n in seen:
            continue
        seen.add(n)
        cells: list[Text | str] = []
        for part in (search.get(n) or {}, held.get(n) or {}):
            imp = part.get("improvement_pct")
            ci = part.get("ci_pct") or [None, None]
            style = (
                "green" if finite(imp) and imp > 0 else ("red" if finite(imp) and imp < 0 else "")
            )
            cells.append(Text(fmt_pct(imp), style=style))
            cells.append(
                f"[{fmt_pct(ci[0])}, {fmt_pct(ci[1])}]" if finite(ci[0]) and finite(ci[1]) else "—"
            )
        table.add_row(n + (" *" if n in objectives else ""), *cells)
    return table


def recommendation_renderable(rec: RecInfo | None, *, loading: bool = False) -> Group:
    """The recommendation: where it comes from, the settings (as a diff from the production
    settings), and the improvements on the search and held-out windows with their intervals."""
    if loading or rec is None:
        return Group(
            Text("recommendation: computing (replaying the held-out windows)…", style="yellow")
        )
    if rec.summary is None:
        return Group(
            Text("no recommendation: ", style="bold yellow"), Text(rec.error or "—", style="yellow")
        )
    s = rec.summary
    head = Text("recommendation", style="bold")
    head.append(f": trial {s.get('trial', '?')}")
    if rec.source == "stored":
        head.append(f" · stored #{rec.stored_id} at {fmt_time(rec.created_ms)} UTC", style="dim")
    else:
        head.append(" · computed now (not stored; `tailpilot recommend` stores it)", style="dim")
    parts: list[Any] = [head]
    if s.get("is_production"):
        parts.append(
            Text("  the production settings are the best found: nothing to change", style="yellow")
        )
    settings = s.get("settings") or {}
    prod = s.get("production") or {}
    rows = settings_diff(
        prod, settings
    )  # no production known: the parameters that differ from defaults
    line = Text(f"  policy {settings.get('policy', '?')}", style="bold")
    if prod and prod.get("policy") != settings.get("policy"):
        line.append(f" (production: {prod.get('policy')}; parameters vs its defaults)", style="dim")
    if settings.get("pinned"):
        line.append(f", pinned {fmt_value(settings['pinned'])}")
    parts.append(line)
    changes = Text("  ")
    for i, (f, a, b) in enumerate(r for r in rows if r[0] != "policy"):
        if i:
            changes.append(", ")
        changes.append(f"{f.split('.', 1)[-1]} ")
        if a not in ("default", "—"):
            changes.append(a, style="dim")
            changes.append("→")
        changes.append(b, style="green")
    if not [r for r in rows if r[0] != "policy"]:
        changes.append(
            "= the production settings" if prod else "the policy's defaults", style="dim"
        )
    parts.append(changes)
    nw = len((s.get("search") or {}).get("windows") or [])
    nh = len((s.get("holdout") or {}).get("windows") or [])
    parts.append(
        Text(
            f"change vs production (+ = better; * objective; {nw} search / {nh} held-out windows):",
            style="bold",
        )
    )
    parts.append(_improvement_table(s))
    for c in (s.get("holdout") or {}).get("constraints") or []:
        ok = c.get("feasible")
        parts.append(
            Text(
                f"  held-out {c.get('constraint')}: {'met' if ok else 'VIOLATED'}",
                style="green" if ok else "bold red",
            )
        )
    parts.append(
        Text(
            "R: apply to the selected replicas (all when none is selected); "
            "pinned parameters are kept",
            style="dim",
        )
    )
    return Group(*parts)


def tuner_title(url: str | None, studies: int | None, message: str | None = None) -> Text:
    t = Text("tuner", style="bold")
    if url:
        t.append(f" · {redact(url)}")
    if studies is not None:
        t.append(f" · {studies} stud{'y' if studies == 1 else 'ies'}")
    if message:
        t.append(f" · {message}", style="yellow")
    t.append(" · ↑↓ pick a study · R apply", style="dim")
    return t


def redact(url: str) -> str:
    """What the title shows of a storage URL: a SQLite file's name, a server URL without its
    password."""
    if url.startswith("sqlite:///"):
        return "sqlite " + url.rsplit("/", 1)[-1]
    if "@" in url and "://" in url:
        scheme, rest = url.split("://", 1)
        creds, host = rest.rsplit("@", 1)
        user = creds.split(":", 1)[0]
        return f"{scheme}://{user}:***@{host}"
    return url

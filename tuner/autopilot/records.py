"""How the live autopilot records a decision (``tuner.autopilot.live``): the note its audit row
carries, the stored prediction ``tailpilot verify`` and the step back judge, the row its status
keeps, and how the CLI reads that status (``status_lines``).
"""

from __future__ import annotations

import math
from typing import Any

from scheduler.settings import Settings
from tuner.autopilot.types import Decision
from tuner.closed_loop.whatif import METRICS as WHATIF_METRICS

#: The autopilot's name in the audit log and on its stored predictions.
WHO = "autopilot"


def _pct(value: float | None) -> str:
    return "n/a" if value is None or not math.isfinite(value) else f"{value:+.0%}"


def decision_note(decision: Decision) -> str:
    """One line for the audit log: the switch, why, and its predicted change."""
    p = decision.predicted()
    return (
        f"autopilot: {decision.previous} -> {decision.choice}: {decision.reason}; predicted P95 "
        f"TTFT {_pct(p.get('ttft_p95'))}, P99 TTFT {_pct(p.get('ttft_p99'))}, P99 TTLT "
        f"{_pct(p.get('ttlt_p99'))}, throughput {_pct(p.get('throughput_tok_s'))} over "
        f"{decision.requests} requests"
    )


def decision_summary(
    decision: Decision,
    replica: str,
    cluster: str,
    current: Settings,
    proposed: dict[str, Any],
    t_ms: int,
    minutes: float,
    band: float | None,
) -> dict[str, Any]:
    """A switch as a stored prediction (``tuner.closed_loop.whatif``'s shape), so ``tailpilot
    verify`` and the step back judge it like any previewed change: ``proposed`` is the document
    the replica was sent (``ApplyResult.new``)."""
    old, new = decision.figures[decision.previous], decision.figures[decision.choice]
    predicted = decision.predicted()
    # Every figure the what-if keeps: the promise's quantiles and throughput, as shadows saw them.
    metrics = {
        k: {
            "current": getattr(old, k, None),
            "proposed": getattr(new, k, None),
            "change": predicted.get(k),
        }
        for k in WHATIF_METRICS
    }
    return {
        "replica": replica,
        "cluster": cluster,
        "t_ms": t_ms,
        "minutes": minutes,
        "warmup_s": 120.0,
        "requests": decision.requests,
        "step_model": "autopilot shadows",
        "band": band,
        "who": WHO,
        "current": current.to_dict(),
        "proposed": proposed,
        "metrics": metrics,
    }


def decision_row(decision: Decision, now: float) -> dict[str, Any]:
    """A decision as the status keeps it (JSON)."""
    return {
        "t": round(now, 3),
        "choice": decision.choice,
        "previous": decision.previous or None,
        "changed": decision.changed,
        "reason": decision.reason,
        "requests": decision.requests,
        "cpu_s": round(decision.cpu_s, 4),
        "predicted": {
            k: (None if v is None else round(v, 4)) for k, v in decision.predicted().items()
        },
    }


def status_lines(row: dict[str, Any]) -> list[str]:
    """The control row as the CLI prints it (``tailpilot autopilot status``)."""
    status = row.get("status") or {}
    head = (
        f"autopilot of {row['cluster']}: {row['state']}{' (paused)' if row.get('paused') else ''}"
        f"{'' if not row.get('who') else ' · set by ' + str(row['who'])}"
    )
    if status.get("held") and status["held"] != "disarmed":
        head += f"; held: {status['held']}"
    lines = [head]
    if status.get("promise"):
        lines.append(f"  promise: {status['promise']}")
    # Armed on a replica, the choice is what it runs; otherwise only what the autopilot would run.
    armed = row.get("state") == "armed" and not row.get("paused")
    only = status.get("armed_replicas")
    if armed and only is not None:
        lines.append(f"  armed on {', '.join(only) or 'no replica'} only; the others dry-run")
    for name, r in sorted((status.get("replicas") or {}).items()):
        steers = armed and (only is None or name in only) and not r.get("lease")
        runs = "running" if steers else "would run"
        if "choice" not in r:
            lines.append(f"  {name}: {r.get('note', '')}")
            continue
        kept = {True: " · keeps the promise", False: " · breaks the promise"}.get(
            r.get("keeps"), ""
        )
        if r.get("overload"):
            kept += f" · overload ({r['overload']})"
        lines.append(f"  {name}: {runs} {r['choice']}{kept} · {r.get('note') or 'no decision yet'}")
        for d in (r.get("last") or [])[-3:]:
            lines.append(
                f"    t={d['t']:.0f} {'switch' if d['changed'] else 'keep'} {d['choice']}: "
                f"{d['reason']}"
            )
    return lines

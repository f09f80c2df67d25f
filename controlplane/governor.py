"""The governor: seed 003's emergency modes on a governed cluster (``tailpilot govern``,
``tailpilot record --govern``; docs in the README, "Multi-tenant governance").

Each mode is a named settings change of the replicas that run ``slofq``, entered when its figure
(the collector's governance report over its window) falls below a threshold and undone when the
figure is back at its alert threshold and the mode has held for ``dwell_s``:

=============  ===========================  =======================================  ============
mode           enters when                  change                                   undone at
=============  ===========================  =======================================  ============
``scr``        SCR < 0.85                   ``quantiles: p99`` (single-quantile P99)  SCR ≥ 0.95
``jfi``        JFI < 0.80                   ``throttle``: tenants weighing less than  JFI ≥ 0.90
                                            the mean, to 50% of their use
``type``       type fairness < 0.40 for     ``type_isolation: hard``                  ≥ 0.50
               ``type_sustain_s``
=============  ===========================  =======================================  ============

Priority SCR > JFI > type (seed 003 §9): when several trigger at once they are entered in that
order. A parameter the replica pins is never moved (the decision says so). Undoing restores the
value the mode replaced, unless someone changed it meanwhile. Every decision goes through the
same path as an operator's change (``controlplane.steering.apply_settings``: If-Match, read back,
audit row) with who = ``governor`` and the figures that triggered it; in ``dry-run`` (the default)
the decision is only written to the audit log (result ``dry-run``); ``disarmed`` or ``paused``
decides nothing. The state is kept in the store (``Store.governor_control``), so the TUI and
``tailpilot governor pause|resume|arm|disarm|dry-run`` steer a governor running elsewhere.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict, Field

from controlplane.settings import Settings

STATES = ("armed", "dry-run", "disarmed")
WHO = "governor"
# What the operator's commands change in the control row (``tailpilot governor``, the TUI's G).
CONTROL_ACTIONS: dict[str, dict[str, Any]] = {
    "pause": {"paused": True}, "resume": {"paused": False}, "arm": {"state": "armed"},
    "dry-run": {"state": "dry-run"}, "disarm": {"state": "disarmed"}}


class GovernorSpec(BaseModel):
    """Thresholds of the emergency modes (the cluster file's ``governance.governor``)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    scr_below: float = Field(0.85, ge=0.0, le=1.0)
    jfi_below: float = Field(0.80, ge=0.0, le=1.0)
    type_fairness_below: float = Field(0.40, ge=0.0, le=100.0)
    type_sustain_s: float = Field(30.0, ge=0.0, le=86_400.0)
    throttle_fraction: float = Field(0.5, gt=0.0, le=1.0)
    dwell_s: float = Field(60.0, ge=0.0, le=86_400.0)


@dataclass(frozen=True, slots=True)
class Mode:
    name: str
    figure: str  # the governance report's key
    param: str  # the slofq parameter it sets


MODES = (Mode("scr", "scr", "quantiles"), Mode("jfi", "jfi", "throttle"),
         Mode("type", "type_fairness_min", "type_isolation"))


@dataclass(slots=True)
class Decision:
    mode: str
    action: str  # "enter" | "exit"
    figures: dict[str, Any]
    reason: str

    def note(self) -> str:
        shown = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in self.figures.items()}
        return f"governor {self.action}s {self.mode} mode: {self.reason}; figures {json.dumps(shown)}"


@dataclass(slots=True)
class Governor:
    """Decides mode changes from successive governance reports (``decide``) and makes each mode's
    settings change per replica (``change``); keeps what it replaced to undo it."""

    spec: GovernorSpec
    exit_at: dict[str, float]  # mode -> the figure at which it is undone (the alert thresholds)
    active: dict[str, float] = field(default_factory=dict)  # mode -> since (s)
    dry: set[str] = field(default_factory=set)  # active modes entered in dry-run (never applied)
    below_since: dict[str, float] = field(default_factory=dict)  # type: when it first fell below
    replaced: dict[tuple[str, str], Any] = field(default_factory=dict)  # (mode, replica) -> old value

    @classmethod
    def for_cluster(cls, governance) -> "Governor":
        a = governance.alerts
        return cls(governance.governor, {"scr": a.scr_warning, "jfi": a.jfi, "type": a.type_fairness})

    def enter_below(self, mode: str) -> float:
        s = self.spec
        return {"scr": s.scr_below, "jfi": s.jfi_below, "type": s.type_fairness_below}[mode]

    def decide(self, figures: dict[str, Any], now: float) -> list[Decision]:
        """The mode changes these figures call for, in priority order."""
        shown = {k: figures.get(k) for k in ("scr", "jfi", "type_fairness_min")}
        out = []
        for mode in MODES:
            value = figures.get(mode.figure)
            if value is None or (isinstance(value, float) and math.isnan(value)):
                continue
            below = value < self.enter_below(mode.name)
            if mode.name == "type":  # sustained: a short dip of a minority type is noise
                if below:
                    self.below_since.setdefault("type", now)
                else:
                    self.below_since.pop("type", None)
                below = below and now - self.below_since.get("type", now) >= self.spec.type_sustain_s
            if mode.name not in self.active and below:
                out.append(Decision(mode.name, "enter", shown, f"{mode.figure} {value:.3g} < "
                                                               f"{self.enter_below(mode.name):g}"))
            elif mode.name in self.active and value >= self.exit_at[mode.name]:
                held = now - self.active[mode.name]
                if held >= self.spec.dwell_s:
                    out.append(Decision(mode.name, "exit", shown, f"{mode.figure} {value:.3g} >= "
                                                                  f"{self.exit_at[mode.name]:g} after {held:.0f} s"))
        return out

    def record(self, decision: Decision, now: float, *, dry: bool = False) -> None:
        """The decision was carried out (``dry``: in dry-run, would have been)."""
        if decision.action == "enter":
            self.active[decision.mode] = now
            if dry:
                self.dry.add(decision.mode)
        else:
            self.active.pop(decision.mode, None)
            self.dry.discard(decision.mode)

    def armed(self) -> None:
        """Armed now: modes entered in dry-run were never applied — decide them again."""
        for mode in self.dry:
            self.active.pop(mode, None)
        self.dry.clear()

    def change(self, decision: Decision, replica: str) -> "Change":
        """The settings change of ``decision`` for ``replica``: a function of the replica's current
        settings (None from it: nothing to do there); ``commit`` it once the replica took it."""
        return Change(self, decision, replica, next(m for m in MODES if m.name == decision.mode))

    def commit(self, change: "Change") -> None:
        """The replica took ``change``: remember what entering replaced (to undo it), or forget it."""
        key = (change.mode.name, change.replica)
        if change.decision.action == "enter" and change.sent:
            self.replaced[key] = change.old
        elif change.decision.action == "exit" and change.sent:
            self.replaced.pop(key, None)

    def state(self) -> dict[str, Any]:
        """What a restarted governor needs to go on (kept in the control row's status)."""
        return {"active": dict(self.active), "dry": sorted(self.dry),
                "replaced": [[m, r, v] for (m, r), v in sorted(self.replaced.items())]}

    def restore(self, status: dict[str, Any] | None) -> None:
        status = status or {}
        self.active = {m: float(t) for m, t in (status.get("active") or {}).items()}
        self.dry = set(status.get("dry") or ())
        self.replaced = {(m, r): v for m, r, v in status.get("replaced") or ()}

    def _entered_value(self, mode: Mode, current: Settings) -> Any:
        if mode.name == "scr":
            return "p99"
        if mode.name == "type":
            return "hard"
        p = current.params  # jfi: the tenants weighing less than the mean, throttled
        weights = {t: p.base_weight(t) for t in p.tenants}  # weights and commitments on one scale
        if not weights:
            return dict(p.throttle)
        mean = sum(weights.values()) / len(weights)
        return {**p.throttle, **{t: self.spec.throttle_fraction for t, w in weights.items() if w < mean}}


def modes(status: dict[str, Any] | None) -> tuple[list[str], list[str]]:
    """(applied, dry-run) modes of a governor's status: a mode decided in dry-run was only logged."""
    status = status or {}
    dry = set(status.get("dry") or ())
    active = list(status.get("active") or {})
    return [m for m in active if m not in dry], [m for m in active if m in dry]


def modes_text(status: dict[str, Any] | None) -> str:
    """"active modes: scr" (and ", dry-run only: jfi"): what the CLI and the TUI print."""
    applied, dry = modes(status)
    return f"active modes: {', '.join(applied) or 'none'}" + (f", dry-run only: {', '.join(dry)}" if dry else "")


_UNSET = object()


@dataclass(slots=True)
class Change:
    """One mode's settings change for one replica (``Governor.change``)."""

    gov: Governor
    decision: Decision
    replica: str
    mode: Mode
    old: Any = _UNSET
    sent: bool = False  # it produced a document (set by calling it)

    def __call__(self, current: Settings) -> Settings | None:
        self.sent = False
        if current.policy != "slofq" or current.is_pinned(self.mode.param):
            return None  # the modes are slofq's parameters; a pinned one is never moved
        old = getattr(current.params, self.mode.param)
        entered = self.gov._entered_value(self.mode, current)
        key = (self.mode.name, self.replica)
        if self.decision.action == "enter":
            if entered == old:
                return None
            new = entered
        elif key not in self.gov.replaced or old != entered:
            return None  # not ours to undo, or changed since by someone else
        else:
            new = self.gov.replaced[key]
        self.old, self.sent = old, True
        return current.replace(params={self.mode.param: new})


# --------------------------------------------------------------------------------------------
# running it
# --------------------------------------------------------------------------------------------


async def governor_step(gov: Governor, collector: Any, store: Any, now: float) -> list[dict[str, Any]]:
    """One evaluation: read the control row, decide on the collector's newest figures, carry the
    decisions out (armed) or log them (dry-run); store the governor's status. Returns what was
    done: dicts with the decision and each replica's result."""
    import asyncio

    from controlplane.steering import apply_settings

    cluster = collector.cluster
    ctl = await asyncio.to_thread(store.governor_control, cluster.name)
    figures = collector.governance
    done: list[dict[str, Any]] = []
    if ctl["state"] == "armed":
        gov.armed()
    if figures is not None and ctl["state"] != "disarmed" and not ctl["paused"]:
        for decision in gov.decide(figures, now):
            outcome: dict[str, Any] = {"mode": decision.mode, "action": decision.action, "note": decision.note(),
                                       "state": ctl["state"], "replicas": {}}
            for spec in cluster.replicas:
                change = gov.change(decision, spec.name)
                if ctl["state"] == "armed":
                    [res] = await apply_settings(cluster, [spec.name], change, store, who=WHO, note=decision.note())
                    outcome["replicas"][spec.name] = res.result
                    if res.ok:
                        gov.commit(change)
                else:  # dry-run: what would be sent, in the audit log only
                    current = (collector.views[spec.name].state or {}).get("settings")
                    outcome["replicas"][spec.name] = await asyncio.to_thread(
                        _log_dry_run, store, cluster.name, spec.name, current, change, decision)
            gov.record(decision, now, dry=ctl["state"] != "armed")
            done.append(outcome)
    status = {**gov.state(), "t_ms": int(now * 1000),
              "last": [d["note"] for d in done] or (ctl.get("status") or {}).get("last", [])}
    await asyncio.to_thread(store.set_governor_control, cluster.name, status=status)
    collector.governor_status = {**status, "state": ctl["state"], "paused": bool(ctl["paused"])}
    return done


def _log_dry_run(store: Any, cluster: str, replica: str, current: dict[str, Any] | None,
                 change: Callable[[Settings], Settings | None], decision: Decision) -> str:
    new = change(Settings.model_validate(current)) if current is not None else None
    result = "dry-run" if new is not None else "skipped"
    store.record_settings_change(cluster, replica, who=WHO, old=current, new=None if new is None else new.to_dict(),
                                 result=result, message=f"{decision.note()}; "
                                 + ("not sent (dry-run)" if new is not None else "nothing to change"))
    return result


async def run_governor(collector: Any, store: Any, stop: Any, *, interval_s: float = 1.0,
                       clock: Callable[[], float] | None = None) -> None:
    """Evaluate every ``interval_s`` until ``stop`` (an asyncio.Event) is set (``record --govern``)."""
    import asyncio
    import contextlib
    import logging
    import time

    log = logging.getLogger("tailpilot.governor")
    clock = clock or time.time
    gov = Governor.for_cluster(collector.cluster.governance)
    # A restarted governor goes on where it stopped: its modes, and what they replaced (to undo).
    gov.restore((await asyncio.to_thread(store.governor_control, collector.cluster.name)).get("status"))
    while not stop.is_set():
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), interval_s)
        if stop.is_set():
            return
        try:
            for outcome in await governor_step(gov, collector, store, clock()):
                log.warning("%s (%s): %s", outcome["note"], outcome["state"], outcome["replicas"])
        except Exception:  # a failed evaluation (busy store, a replica down) is retried next time
            log.exception("governor step failed")

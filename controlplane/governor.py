"""The governor: seed 003's emergency modes on a governed cluster (``tailpilot govern``,
``tailpilot record --govern``; docs in the README, "Multi-tenant governance").

Each mode is a named settings change of the replicas that run ``slofq``, entered when its figure
(the collector's governance report over its window) falls below a threshold and undone when the
figure is back at its alert threshold and the mode has held for ``dwell_s``:

=============  ===========================  =======================================  ============
mode           enters when                  change                                   undone at
=============  ===========================  =======================================  ============
``scr``        SCR < 0.85                   ``quantiles: p99`` (single-quantile P99)  SCR ≥ 0.95
``jfi``        JFI < 0.80 and a tenant      ``throttle``: the over-consumers (ω =     JFI ≥ 0.90
               uses more than its           min(C/U, α) < 1), to 50% of their use;
               commitment                   never a tenant within its commitment
``type``       type fairness < 0.40 for     ``type_isolation: hard``                  ≥ 0.50
               ``type_sustain_s``
=============  ===========================  =======================================  ============

JFI is the suppression-aware figure (controlplane/governance.py, docs/governance.md). Priority SCR >
JFI > type (seed 003 §9): when several trigger at once they are entered in that order. A parameter
the replica pins is never moved (the decision says so). Undoing restores the value the mode
replaced, unless someone changed it meanwhile; a mode stays active (and is undone again at the next
evaluation) until every replica it changed has taken the undo. Every decision goes through the same
path as an operator's change (the host's ``carry_out``, then
``controlplane.steering.apply_settings``: If-Match, read back, audit row) with who = ``governor``,
the figures that triggered it and the victims' P99 TTFT (the tenants it protects: entering, over the
window before; leaving, over the window since); in ``dry-run`` (the default) the decision is only
written to the audit log (result ``dry-run``). ``disarmed``, ``paused``, ``dry-run`` after ``armed``
and the end of the recorder undo every change the governor made (``governor disarm --keep``: kept,
and the status says so). The state is kept in the store (its control row, ``storage.control``), so
the TUI and ``tailpilot governor pause|resume|arm|disarm|dry-run`` steer a governor running
elsewhere; the controller host (``controlplane.controller_host``) reads that row each tick, stores
the status ``controlplane.governor_live`` returns (this module is the rule; that one runs it beside
a collector), and holds the controllers ranked below the governor while a mode is applied (the
status's ``overrides``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from controlplane.governance import GovernanceSpec, GovernorSpec
from controlplane.steering import LeaseKeeper
from scheduler.metrics.fairness import FairnessReport, TenantFigures
from scheduler.settings import Settings
from scheduler.settings_change import SettingsChange

WHO = "governor"


@dataclass(frozen=True, slots=True)
class Mode:
    name: str
    figure: str  # the governance report's key
    param: str  # the slofq parameter it sets


MODES = (
    Mode("scr", "scr", "quantiles"),
    Mode("jfi", "jfi", "throttle"),
    Mode("type", "type_fairness_min", "type_isolation"),
)


@dataclass(slots=True)
class Decision:
    mode: str
    action: str  # "enter" | "exit"
    figures: dict[str, Any]
    reason: str
    targets: tuple[str, ...] = ()  # jfi: the tenants throttled
    # The tenants the mode protects -> their P99 TTFT (s) over the window before entering, and
    # (leaving) over the window since.
    before: dict[str, float | None] = field(default_factory=dict)
    after: dict[str, float | None] = field(default_factory=dict)

    def note(self) -> str:
        shown = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in self.figures.items()}
        text = f"governor {self.action}s {self.mode} mode: {self.reason}"
        if self.targets:
            text += f"; throttles {', '.join(self.targets)}"
        if self.before:
            victims = ", ".join(
                f"{t} {_s(v)}" + (f" -> {_s(self.after.get(t))}" if self.action == "exit" else "")
                for t, v in sorted(self.before.items())
            )
            when = "before -> since" if self.action == "exit" else "before"
            text += f"; victims' P99 TTFT {when}: {victims}"
        return f"{text}; figures {json.dumps(shown)}"


def _s(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.3g} s"


# The figures a decision's audit row shows.
SHOWN = ("scr", "jfi", "jfi_seed", "type_fairness_min")


def _figure(figures: FairnessReport, name: str) -> float | None:
    """The window's figure ``name`` (None: no data, or NaN)."""
    value = figures.get(name)
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        return None
    return value


def _ttft_p99(tenants: dict[str, TenantFigures], tenant: str) -> float | None:
    figures = tenants.get(tenant)
    return None if figures is None else figures.get("ttft_p99")


def victims(
    mode: str, figures: FairnessReport, targets: tuple[str, ...] = ()
) -> dict[str, float | None]:
    """The tenants a mode protects, with their P99 TTFT in ``figures``: the JFI mode's are every
    tenant it does not throttle; the SCR mode's the tenants missing a target; the type mode's none
    (it protects types)."""
    tenants = figures.get("tenants") or {}
    if mode == "jfi":
        return {t: f.get("ttft_p99") for t, f in tenants.items() if t not in targets}
    if mode == "scr":
        return {t: f.get("ttft_p99") for t, f in tenants.items() if f.get("missed")}
    return {}


@dataclass(slots=True)
class Governor:
    """Decides mode changes from successive governance reports (``decide``) and makes each mode's
    settings change per replica (``change``); keeps what it replaced to undo it."""

    spec: GovernorSpec
    exit_at: dict[str, float]  # mode -> the figure at which it is undone (the alert thresholds)
    active: dict[str, float] = field(default_factory=dict)  # mode -> since (s)
    dry: set[str] = field(default_factory=set)  # active modes entered in dry-run (never applied)
    below_since: dict[str, float] = field(default_factory=dict)  # type: when it first fell below
    replaced: dict[tuple[str, str], Any] = field(
        default_factory=dict
    )  # (mode, replica) -> old value
    targets: dict[str, list[str]] = field(default_factory=dict)  # mode -> the tenants it throttles
    before: dict[str, dict[str, float | None]] = field(
        default_factory=dict
    )  # mode -> victims' P99 TTFT
    held: str | None = None  # why a mode whose figure is low is not entered (nobody to throttle)
    # One owner per knob: this governor's lease on each replica (a second governor on the same
    # replicas sees it and dry-runs there, naming the holder).
    leases: LeaseKeeper = field(default_factory=lambda: LeaseKeeper("governor"))

    @classmethod
    def for_cluster(cls, governance: GovernanceSpec) -> Governor:
        a = governance.alerts
        return cls(
            governance.governor, {"scr": a.scr_warning, "jfi": a.jfi, "type": a.type_fairness}
        )

    def enter_below(self, mode: str) -> float:
        s = self.spec
        return {"scr": s.scr_below, "jfi": s.jfi_below, "type": s.type_fairness_below}[mode]

    def decide(self, figures: FairnessReport, now: float) -> list[Decision]:
        """The mode changes these figures call for, in priority order."""
        shown = {k: figures.get(k) for k in SHOWN}
        out = []
        self.held = None
        for mode in MODES:
            value = _figure(figures, mode.figure)
            if value is None:
                continue
            below = value < self.enter_below(mode.name)
            if mode.name == "type":  # sustained: a short dip of a minority type is noise
                if below:
                    self.below_since.setdefault("type", now)
                else:
                    self.below_since.pop("type", None)
                below = (
                    below and now - self.below_since.get("type", now) >= self.spec.type_sustain_s
                )
            if mode.name not in self.active and below:
                reason = f"{mode.figure} {value:.3g} < {self.enter_below(mode.name):g}"
                targets: tuple[str, ...] = ()
                if mode.name == "jfi":
                    # Seed 003's low-weight tenants: ω = min(C/U, α) low, i.e. using more than their
                    # commitment. A tenant within its commitment is never throttled.
                    targets = tuple(over_consumers(figures))
                    if not targets:
                        self.held = (
                            f"{reason}, but no tenant uses more than its commitment: "
                            "nobody to throttle"
                        )
                        continue
                out.append(
                    Decision(
                        mode.name,
                        "enter",
                        shown,
                        reason,
                        targets,
                        victims(mode.name, figures, targets),
                    )
                )
            elif mode.name in self.active and value >= self.exit_at[mode.name]:
                held = now - self.active[mode.name]
                if held >= self.spec.dwell_s:
                    out.append(
                        self._exit(
                            mode.name,
                            figures,
                            f"{mode.figure} {value:.3g} >= "
                            f"{self.exit_at[mode.name]:g} after {held:.0f} s",
                        )
                    )
        return out

    def _exit(self, mode: str, figures: FairnessReport | None, reason: str) -> Decision:
        if figures is None:  # no report this tick: the exit is recorded without figures
            shown, tenants = dict.fromkeys(SHOWN), {}
        else:
            shown, tenants = {k: figures.get(k) for k in SHOWN}, figures.get("tenants") or {}
        before = dict(self.before.get(mode) or {})
        after = {t: _ttft_p99(tenants, t) for t in before}
        return Decision(
            mode, "exit", shown, reason, tuple(self.targets.get(mode) or ()), before, after
        )

    def undo_all(self, figures: FairnessReport | None, reason: str) -> list[Decision]:
        """Exit decisions for every mode applied (not merely decided in dry-run), the last
        entered first: what ``disarm``, ``pause`` and a recorder stop carry out."""
        applied = [
            m.name for m in reversed(MODES) if m.name in self.active and m.name not in self.dry
        ]
        return [self._exit(m, figures, reason) for m in applied]

    def applied(self) -> list[str]:
        """The modes whose changes are on replicas now (entered armed, not undone)."""
        return [m for m in self.active if m not in self.dry]

    def record(self, decision: Decision, now: float, *, dry: bool = False) -> None:
        """The decision was carried out (``dry``: in dry-run, would have been)."""
        if decision.action == "enter":
            self.active[decision.mode] = now
            self.targets[decision.mode] = list(decision.targets)
            self.before[decision.mode] = dict(decision.before)
            if dry:
                self.dry.add(decision.mode)
        else:
            self.active.pop(decision.mode, None)
            self.dry.discard(decision.mode)
            self.targets.pop(decision.mode, None)
            self.before.pop(decision.mode, None)

    def undone(self, mode: str) -> bool:
        """No replica still holds a change of ``mode`` to undo."""
        return not any(m == mode for m, _ in self.replaced)

    def forget_dry(self) -> None:
        """Drop the modes entered in dry-run (never applied): armed, they are decided again;
        disarmed, paused or stopped, they are gone."""
        for mode in self.dry:
            self.active.pop(mode, None)
        self.dry.clear()

    def change(self, decision: Decision, replica: str) -> Change:
        """The settings change of ``decision`` for ``replica``: a function of the replica's current
        settings (None from it: nothing to do there); ``commit`` it once the replica took it."""
        mode = next(m for m in MODES if m.name == decision.mode)
        return Change(
            decision,
            replica,
            mode,
            self.spec.throttle_fraction,
            self.replaced.get((mode.name, replica), _UNSET),
        )

    def commit(self, change: Change, result: str, before: Mapping[str, Any] | None) -> None:
        """The replica answered ``change`` with ``result`` (steering's ``ApplyResult``; ``before``
        its settings document when the change was made of it, ``ApplyResult.old``): remember what
        entering replaced (to undo it), or forget it once undone — or once there is nothing of
        ours left to undo there (``skipped``: someone changed the parameter since, or the replica
        left slofq). Accepted (applied or staged) means the change made a document and it was
        sent."""
        key = (change.mode.name, change.replica)
        ok = result in ("applied", "staged")
        if change.decision.action == "enter" and ok and before is not None:
            self.replaced[key] = (before.get("params") or {}).get(change.mode.param)
        elif change.decision.action == "exit" and (ok or result == "skipped"):
            self.replaced.pop(key, None)

    def state(self) -> dict[str, Any]:
        """What a restarted governor needs to go on (kept in the control row's status)."""
        applied = [m for m in self.active if m not in self.dry]
        return {
            "active": dict(self.active),
            "dry": sorted(self.dry),
            "replaced": [[m, r, v] for (m, r), v in sorted(self.replaced.items())],
            "targets": {m: list(t) for m, t in self.targets.items()},
            "before": {m: dict(b) for m, b in self.before.items()},
            "held": self.held,
            # What the host's arbiter reads: while a mode is applied, the controllers ranked
            # below the governor (the autopilot) are held.
            "overrides": f"emergency mode {', '.join(applied)}" if applied else None,
            # the lease holder's name: a restarted governor of this control row is the same
            # owner (it undoes what it applied), another recorder's is not
            "holder": self.leases.holder,
        }

    def restore(self, status: dict[str, Any] | None) -> None:
        status = status or {}
        self.active = {m: float(t) for m, t in (status.get("active") or {}).items()}
        self.dry = set(status.get("dry") or ())
        self.replaced = {(m, r): v for m, r, v in status.get("replaced") or ()}
        self.targets = {m: list(t) for m, t in (status.get("targets") or {}).items()}
        self.before = {m: dict(b) for m, b in (status.get("before") or {}).items()}
        holder = status.get("holder")
        if isinstance(holder, str) and holder:
            self.leases.holder = holder


def over_consumers(figures: FairnessReport) -> list[str]:
    """The tenants using more than their commitment in ``figures`` (ω = min(C/U, α) < 1)."""
    if figures.get("over_consumers") is not None:
        return list(figures["over_consumers"])
    return sorted(
        t
        for t, f in (figures.get("tenants") or {}).items()
        if f.get("omega") is not None and f["omega"] < 1.0
    )


def modes(status: dict[str, Any] | None) -> tuple[list[str], list[str]]:
    """(applied, dry-run) modes of a governor's status: a mode decided in dry-run was only
    logged."""
    status = status or {}
    dry = set(status.get("dry") or ())
    active = list(status.get("active") or {})
    return [m for m in active if m not in dry], [m for m in active if m in dry]


def modes_text(status: dict[str, Any] | None) -> str:
    """ "active modes: scr" (and ", dry-run only: jfi"; "kept after disarm" when ``disarm --keep``
    left them applied): what the CLI and the TUI print."""
    applied, dry = modes(status)
    held = {m for m, _, _ in (status or {}).get("replaced") or ()}
    # A mode entered armed that no replica took (pinned everywhere, not slofq, refused) is listed
    # as such: active, but changing nothing.
    shown = [
        m if "replaced" not in (status or {}) or m in held else f"{m} (on no replica)"
        for m in applied
    ]
    text = f"active modes: {', '.join(shown) or 'none'}" + (
        f", dry-run only: {', '.join(dry)}" if dry else ""
    )
    if applied and (status or {}).get("keep"):
        text += (
            " (kept after disarm: undone only when re-armed and recovered, or disarmed without"
            " --keep)"
        )
    return text


_UNSET = object()


def entered_value(
    mode: Mode, current: Settings, targets: tuple[str, ...], throttle_fraction: float
) -> Any:
    """The value ``mode`` sets its parameter to on a replica running ``current``."""
    if mode.name == "scr":
        return "p99"
    if mode.name == "type":
        return "hard"
    # jfi: the over-consumers the decision names, throttled (an operator's own throttle of a
    # tenant is kept where it is tighter)
    p = current.params
    return {
        **p.throttle,
        **{t: min(throttle_fraction, p.throttle.get(t, 1.0)) for t in targets},
    }


@dataclass(frozen=True, slots=True)
class Change:
    """One mode's settings change for one replica (``Governor.change``): everything it needs of
    the governor is copied in when it is made — steering carries it and calls ``apply`` with the
    replica's settings as they are when it is sent; it keeps nothing of the call (what entering
    replaced is read from steering's answer: ``Governor.commit``)."""

    decision: Decision
    replica: str
    mode: Mode
    throttle_fraction: float
    undo_to: Any = _UNSET  # what entering the mode replaced on this replica (exit: restored)

    def apply(self, current: Settings) -> Settings | None:
        if current.policy != "slofq" or current.is_pinned(self.mode.param):
            return None  # the modes are slofq's parameters; a pinned one is never moved
        old = getattr(current.params, self.mode.param)
        entered = entered_value(self.mode, current, self.decision.targets, self.throttle_fraction)
        if self.decision.action == "enter":
            if entered == old:
                return None
            new = entered
        elif self.undo_to is _UNSET or old != entered:
            return None  # not ours to undo, or changed since by someone else
        else:
            new = self.undo_to
        return SettingsChange(params={self.mode.param: new}).apply(current)

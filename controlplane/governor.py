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

JFI is the suppression-aware figure (controlplane/governance.py, docs/governance.md). Priority
SCR > JFI > type (seed 003 §9): when several trigger at once they are entered in that order. A
parameter the replica pins is never moved (the decision says so). Undoing restores the value the
mode replaced, unless someone changed it meanwhile; a mode stays active (and is undone again at
the next evaluation) until every replica it changed has taken the undo. Every decision goes
through the same path as an operator's change (``controlplane.steering.apply_settings``:
If-Match, read back, audit row) with who = ``governor``, the figures that triggered it and the
victims' P99 TTFT (the tenants it protects: entering, over the window before; leaving, over the
window since); in ``dry-run`` (the default) the decision is only written to the audit log
(result ``dry-run``). ``disarmed``, ``paused``, ``dry-run`` after ``armed`` and the end of the
recorder undo every change the governor made (``governor disarm --keep``: kept, and the status
says so). The state is kept in the store (its control row, ``storage.control``), so the TUI and
``tailpilot governor pause|resume|arm|disarm|dry-run`` steer a governor running elsewhere; the
controller host (``controlplane.controller_host``) reads that row each tick, stores the status
this module returns, and holds the controllers ranked below the governor while a mode is applied
(the status's ``overrides``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Literal

from controlplane.controller_host import ControlRow, read_control, run_controller, tick
from controlplane.governance import GovernanceSpec, GovernorSpec
from controlplane.steering import LeaseKeeper, apply_settings, record_dry_run
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


def victims(
    mode: str, figures: dict[str, Any], targets: tuple[str, ...] = ()
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

    def decide(self, figures: dict[str, Any], now: float) -> list[Decision]:
        """The mode changes these figures call for, in priority order."""
        shown = {k: figures.get(k) for k in ("scr", "jfi", "jfi_seed", "type_fairness_min")}
        out = []
        self.held = None
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

    def _exit(self, mode: str, figures: dict[str, Any] | None, reason: str) -> Decision:
        shown = {k: (figures or {}).get(k) for k in ("scr", "jfi", "jfi_seed", "type_fairness_min")}
        before = dict(self.before.get(mode) or {})
        tenants = (figures or {}).get("tenants") or {}
        after = {t: (tenants.get(t) or {}).get("ttft_p99") for t in before}
        return Decision(
            mode, "exit", shown, reason, tuple(self.targets.get(mode) or ()), before, after
        )

    def undo_all(self, figures: dict[str, Any] | None, reason: str) -> list[Decision]:
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
        return Change(self, decision, replica, next(m for m in MODES if m.name == decision.mode))

    def commit(self, change: Change, result: str = "applied") -> None:
        """The replica answered ``change`` with ``result``: remember what entering replaced (to
        undo it), or forget it once undone — or once there is nothing of ours left to undo there
        (``skipped``: someone changed the parameter since, or the replica left slofq)."""
        key = (change.mode.name, change.replica)
        ok = result in ("applied", "staged")
        if change.decision.action == "enter" and change.sent and ok:
            self.replaced[key] = change.old
        elif change.decision.action == "exit" and ((change.sent and ok) or result == "skipped"):
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

    def _entered_value(self, mode: Mode, current: Settings, targets: tuple[str, ...]) -> Any:
        if mode.name == "scr":
            return "p99"
        if mode.name == "type":
            return "hard"
        # jfi: the over-consumers the decision names, throttled (an operator's own throttle of a
        # tenant is kept where it is tighter)
        p = current.params
        return {
            **p.throttle,
            **{t: min(self.spec.throttle_fraction, p.throttle.get(t, 1.0)) for t in targets},
        }


def over_consumers(figures: dict[str, Any]) -> list[str]:
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


@dataclass(slots=True)
class Change:
    """One mode's settings change for one replica (``Governor.change``)."""

    gov: Governor
    decision: Decision
    replica: str
    mode: Mode
    old: Any = _UNSET
    sent: bool = False  # it produced a document (set by calling it)

    def apply(self, current: Settings) -> Settings | None:
        self.sent = False
        if current.policy != "slofq" or current.is_pinned(self.mode.param):
            return None  # the modes are slofq's parameters; a pinned one is never moved
        old = getattr(current.params, self.mode.param)
        entered = self.gov._entered_value(self.mode, current, self.decision.targets)
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
        return SettingsChange(params={self.mode.param: new}).apply(current)


# --------------------------------------------------------------------------------------------
# running it
# --------------------------------------------------------------------------------------------


async def governor_step(
    gov: Governor, collector: Any, store: Any, now: float
) -> list[dict[str, Any]]:
    """One evaluation at ``now`` through the controller host's tick (its control row read, its
    status stored): see :meth:`_HostedGovernor.step`. Returns what was done: dicts with the
    decision and each replica's result."""
    hosted = _HostedGovernor(gov, collector, store, lambda: now)
    await tick(hosted)
    return hosted.done


async def _evaluate(
    gov: Governor, collector: Any, store: Any, now: float, row: ControlRow
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Decide on the collector's newest figures and carry the decisions out (armed) or log them
    (dry-run); disarmed (unless ``--keep``), paused, or dry-run with modes applied: undo them.
    Returns what was done and the status to store."""
    cluster = collector.cluster
    figures = collector.governance
    keep = row.state == "disarmed" and bool((row.status or {}).get("keep"))
    done: list[dict[str, Any]] = []
    if row.state == "armed":
        gov.forget_dry()
    if not row.acting:
        why = "paused" if row.paused else row.state
        if not keep:
            for decision in gov.undo_all(
                figures, f"{why}: every change the governor made is undone"
            ):
                done.append(await _carry_out(gov, collector, store, decision, now, armed=True))
        if row.held is not None:  # disarmed or paused
            gov.forget_dry()
        # Given back once the undo went out (it is sent under the lease): another governor may
        # steer these replicas at once instead of after the lease's expiry.
        for name in list(gov.leases.until):
            await gov.leases.release(cluster, name)
    if figures is not None and row.held is None:
        for decision in gov.decide(figures, now):
            done.append(
                await _carry_out(gov, collector, store, decision, now, armed=row.state == "armed")
            )
    return done, _status(gov, collector, row, now, done, keep=keep)


def _status(
    gov: Governor,
    collector: Any,
    row: ControlRow,
    now: float,
    done: list[dict[str, Any]],
    *,
    keep: bool,
) -> dict[str, Any]:
    """The status the host stores in the governor's row (what a restart needs, the newest
    outcomes), also published on the collector for its /metrics page."""
    status = {
        **gov.state(),
        "t_ms": int(now * 1000),
        "keep": keep,
        "last": [d["note"] for d in done] or (row.status or {}).get("last", []),
    }
    collector.governor_status = {**status, "state": row.state, "paused": row.paused}
    return status


async def _carry_out(
    gov: Governor, collector: Any, store: Any, decision: Decision, now: float, *, armed: bool
) -> dict[str, Any]:
    """Apply ``decision`` on every replica (armed) or log it (dry-run); record it. An exit is
    recorded only once every replica holding a change of the mode took the undo (else it is
    tried again at the next evaluation)."""
    cluster = collector.cluster
    outcome: dict[str, Any] = {
        "mode": decision.mode,
        "action": decision.action,
        "note": decision.note(),
        "state": "armed" if armed else "dry-run",
        "replicas": {},
    }
    forgeable = forgeable_labels(gov, collector, decision)
    if forgeable:
        outcome["note"] += (
            f"; not applied: the tenant labels of {', '.join(forgeable)} are the clients' own "
            "(TAILPILOT_TENANT_SOURCE=client), and a throttle never rests on evidence a client can "
            "forge — sign them at a gateway or set governance.governor.trust_client_labels"
        )
    dry = not armed or bool(forgeable) or (decision.action == "exit" and decision.mode in gov.dry)
    for spec in cluster.replicas:
        change = gov.change(decision, spec.name)
        other = None if dry else await gov.leases.hold(cluster, spec.name, now)
        if not dry and other is None:
            if decision.action == "exit" and (decision.mode, spec.name) not in gov.replaced:
                outcome["replicas"][spec.name] = "skipped"  # nothing of ours there
                continue
            [res] = await apply_settings(
                cluster, [spec.name], change, store, who=WHO, note=decision.note(), lease=gov.leases
            )
            outcome["replicas"][spec.name] = res.result
            gov.commit(change, res.result)
            continue
        # Dry-run, or another governor steers this replica: what would be sent, in the audit log.
        logged = await asyncio.to_thread(
            record_dry_run,
            store,
            cluster.name,
            spec.name,
            change,
            _settings_of(collector, spec.name),
            who=WHO,
            note=decision.note(),
        )
        outcome["replicas"][spec.name] = (
            logged if other is None else f"{logged} (not ours to steer: {other})"
        )
    if decision.action == "enter" or dry or gov.undone(decision.mode):
        gov.record(decision, now, dry=dry and decision.action == "enter")
    else:
        outcome["note"] += "; not undone everywhere yet: tried again at the next evaluation"
    return outcome


def _settings_of(collector: Any, replica: str) -> dict[str, Any] | None:
    """The settings document ``replica`` reported at its last poll (None: none read)."""
    state = collector.views[replica].state
    return None if state is None else state.settings


def forgeable_labels(gov: Governor, collector: Any, decision: Decision) -> list[str]:
    """The replicas whose tenant labels any client can set, when ``decision`` throttles tenants
    and the operator has not said to trust such labels (empty: nothing forgeable to act on). A
    replica that does not say where its labels come from counts as the clients'."""
    if decision.mode != "jfi" or decision.action != "enter" or gov.spec.trust_client_labels:
        return []
    return sorted(
        name
        for name, view in collector.views.items()
        if view.state is None or (view.state.tenant_source or "client") == "client"
    )


@dataclass(slots=True)
class _HostedGovernor:
    """The governor as the controller host runs it: an evaluation each tick, the undo of every
    change it made at the stop."""

    gov: Governor
    collector: Any
    store: Any
    clock: Callable[[], float]
    name: Literal["governor"] = "governor"
    done: list[dict[str, Any]] = field(default_factory=list)  # the last step's outcomes

    @property
    def cluster_name(self) -> str:
        return str(self.collector.cluster.name)

    async def step(self, row: ControlRow) -> dict[str, Any]:
        self.done, status = await _evaluate(self.gov, self.collector, self.store, self.clock(), row)
        log = logging.getLogger("tailpilot.governor")
        for outcome in self.done:
            log.warning("%s (%s): %s", outcome["note"], outcome["state"], outcome["replicas"])
        return status

    async def close(self, row: ControlRow) -> dict[str, Any] | None:
        # The recorder stops: nothing will watch the modes any more, so none stays applied
        # (unless disarmed with --keep); the status lists what is left if this fails.
        return await stop_governor(self.gov, self.collector, self.store, self.clock(), row)


async def run_governor(
    collector: Any,
    store: Any,
    stop: Any,
    *,
    interval_s: float = 1.0,
    clock: Callable[[], float] | None = None,
    undo_timeout_s: float = 30.0,
) -> None:
    """Evaluate every ``interval_s`` until ``stop`` (an asyncio.Event) is set (``record --govern``);
    then (or cancelled) undo every change it made, unless disarmed with ``--keep`` — in the one
    controller loop (``controlplane.controller_host``)."""
    gov = Governor.for_cluster(collector.cluster.governance)
    # A restarted governor goes on where it stopped: its modes, and what they replaced (to undo).
    row = await asyncio.to_thread(read_control, store, "governor", collector.cluster.name)
    gov.restore(row.status)
    hosted = _HostedGovernor(gov, collector, store, clock or time.time)
    await run_controller(hosted, stop, interval_s=interval_s, close_timeout_s=undo_timeout_s)


def governor_task(
    state: str | None, *, interval_s: float = 1.0, who: str = "governor start"
) -> Callable[[Any, Any, asyncio.Event], Coroutine[Any, Any, None]]:
    """The governor as a controller run beside a collector (the recorder's ``tasks``, the TUI's
    live source): its control row set to ``state`` first ("armed" | "dry-run"; None keeps the
    stored state), then :func:`run_governor` until ``stop``. The cluster must have a governance
    block."""

    async def task(collector: Any, store: Any, stop: asyncio.Event) -> None:
        if collector.cluster.governance is None:
            raise ValueError(
                f"cluster {collector.cluster.name!r} has no governance block: nothing to govern"
            )
        if state:
            await asyncio.to_thread(
                store.governance.set_control,
                "governor",
                collector.cluster.name,
                state=state,
                who=who,
            )
        await run_governor(collector, store, stop, interval_s=interval_s)

    return task


async def stop_governor(
    gov: Governor, collector: Any, store: Any, now: float, row: ControlRow
) -> dict[str, Any] | None:
    """Undo every change ``gov`` made (unless the governor is disarmed with ``--keep``): what a
    recorder stop does. Returns the status to store (None: left as it is)."""
    if row.state == "disarmed" and (row.status or {}).get("keep"):
        return None
    done = [
        await _carry_out(gov, collector, store, d, now, armed=True)
        for d in gov.undo_all(
            collector.governance, "the recorder stopped: every change the governor made is undone"
        )
    ]
    gov.forget_dry()
    return _status(gov, collector, row, now, done, keep=False)

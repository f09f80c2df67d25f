"""The governor, live: its evaluations hosted by the controller host
(``controlplane.controller_host``) — the control row read each tick, the decisions of
``controlplane.governor.Governor`` carried out through steering (armed) or written to the audit
(dry-run), its status stored — for ``tailpilot record --govern`` (armed, in dry-run or paused
by ``tailpilot governor``).

The decision rule (the modes, when each is entered and undone, the change each makes) is
``controlplane.governor``; this module is how it runs beside a collector.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Literal

from controlplane.controller_host import ControlRow, carry_out, run_controller, tick
from controlplane.governor import WHO, Decision, Governor


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
        if not dry and decision.action == "exit" and (decision.mode, spec.name) not in gov.replaced:
            outcome["replicas"][spec.name] = "skipped"  # nothing of ours there
            continue
        done = await carry_out(
            cluster,
            spec.name,
            change,
            store,
            who=WHO,
            note=decision.note(),
            leases=gov.leases,
            now=now,
            act=not dry,
            current=_settings_of(collector, spec.name),
        )
        if done.sent is not None:
            gov.commit(change, done.result, done.sent.old)
        # Dry-run, or another governor steers this replica: what would be sent is in the audit.
        outcome["replicas"][spec.name] = (
            done.result
            if done.steered_by is None
            else f"{done.result} (not ours to steer: {done.steered_by})"
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
    # A restarted governor (``run_governor``) takes the stored modes over at its first step or
    # its close; one stepped on its own (``governor_step``) is given the governor as it stands.
    restore: bool = False

    @property
    def cluster_name(self) -> str:
        return str(self.collector.cluster.name)

    def _restore(self, row: ControlRow) -> None:
        """A restarted governor goes on where it stopped: its modes, and what they replaced (to
        undo). Done from the row the host reads for the first step or the close — a governor
        cancelled before its first step still undoes what a previous run left applied."""
        if self.restore:
            self.gov.restore(row.status)
            self.restore = False

    async def step(self, row: ControlRow) -> dict[str, Any]:
        self._restore(row)
        self.done, status = await _evaluate(self.gov, self.collector, self.store, self.clock(), row)
        log = logging.getLogger("tailpilot.governor")
        for outcome in self.done:
            log.warning("%s (%s): %s", outcome["note"], outcome["state"], outcome["replicas"])
        return status

    async def close(self, row: ControlRow) -> dict[str, Any] | None:
        # The recorder stops: nothing will watch the modes any more, so none stays applied
        # (unless disarmed with --keep); the status lists what is left if this fails.
        self._restore(row)
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
    # Nothing awaited before the host's loop: a cancellation from here on still closes it.
    hosted = _HostedGovernor(gov, collector, store, clock or time.time, restore=True)
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

"""The one machine a cluster controller runs in.

The governor (``controlplane.governor``) and the autopilot (``tuner.autopilot.live``) are two
controllers of the same machine: each observes only the past (the collector's windows, the
replicas' answers), decides with a reason, and carries a decision out through the one settings
path (``controlplane.steering.apply_settings``: audited, under the controller's lease). What they
share is this host:

* **the control row**: each tick the host reads the controller's row of the control table
  (``storage.control``: armed, dry-run, disarmed, paused, who) and hands it to the controller as a
  :class:`ControlRow`; the status the controller returns is what the host stores in that row (the
  CLI's and the TUI's ``status`` read it). A controller never reads or writes its row itself.
* **precedence** (:data:`PRECEDENCE`, :func:`read_control`): a controller is *held* while one
  ranked above it says it overrides (the governor in an emergency mode holds the autopilot) —
  ``ControlRow.held`` names why, together with disarmed and paused;
* **the loop** (:func:`run_controller`): a step every ``interval_s`` until ``stop``, a failed step
  logged and tried again at the next tick (a busy store, a replica down never stops a
  controller), and, when the host stops or is cancelled, the controller's ``close`` — the
  governor undoes what it applied — run shielded and waited for at most ``close_timeout_s``, its
  status stored like a step's. ``tests/test_layers.py`` fails on a second controller loop;
* **carrying a change out** (:func:`carry_out`): a controller decides *what* (a change with
  ``apply(current)``) and *why*; the host decides whether it is sent — acting (armed, not held,
  the replica this controller's to steer) and this controller's lease on the replica, through
  ``apply_settings`` (If-Match, read back, the audit row) — or written to the audit with result
  ``dry-run`` and nothing sent (dry-run, or another controller holds the replica's lease). No
  controller calls steering itself (``tests/test_layers.py``);
* **verify and step back** (``controlplane.verification.Ledger``): a change applied with a
  predicted effect is verified once due, and repeated misses tell the controller to step back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol

from controlplane.cluster import ClusterSpec
from controlplane.steering import ApplyResult, Change, LeaseKeeper, apply_settings, record_dry_run
from storage.control import ControllerName

__all__ = [
    "PRECEDENCE",
    "ControlRow",
    "HostedController",
    "Outcome",
    "carry_out",
    "read_control",
    "run_controller",
    "tick",
]

# Who arbitrates first: a controller is held while one before it here overrides (its status's
# ``overrides`` names what, e.g. the governor's "emergency mode scr").
PRECEDENCE: tuple[ControllerName, ...] = ("governor", "autopilot")


@dataclass(frozen=True, slots=True)
class ControlRow:
    """A controller's row of the control table as its host read it at this tick."""

    controller: ControllerName
    cluster: str
    state: str  # "armed" | "dry-run" | "disarmed"
    paused: bool
    who: str | None  # who set the state or the pause last
    status: dict[str, Any] | None  # what the controller stored at its last tick
    # "the governor's emergency mode scr is active (...)": a controller ranked above overrides.
    outranked: str | None = None

    @property
    def held(self) -> str | None:
        """Why this controller's decisions are not carried out now, beyond dry-run: disarmed,
        paused, or outranked (None: nothing holds it)."""
        if self.state == "disarmed":
            return "disarmed"
        if self.paused:
            return f"paused by {self.who or 'an operator'}"
        return self.outranked

    @property
    def acting(self) -> bool:
        """Armed and not held: its decisions go to the replicas."""
        return self.state == "armed" and self.held is None


class _ControlStore(Protocol):
    def control(self, controller: ControllerName, cluster: str) -> dict[str, Any]: ...

    def set_control(
        self, controller: ControllerName, cluster: str, *, status: dict[str, Any] | None = ...
    ) -> dict[str, Any]: ...


class _Store(Protocol):
    @property
    def governance(self) -> _ControlStore: ...


class HostedController(Protocol):
    """A controller as its host sees it."""

    @property
    def name(self) -> ControllerName:
        """Its row of the control table, and its logger's name."""
        ...

    @property
    def cluster_name(self) -> str:
        """The cluster whose row it is."""
        ...

    @property
    def store(self) -> Any:
        """The store holding the control table (``Store``)."""
        ...

    async def step(self, row: ControlRow) -> dict[str, Any]:
        """One observation and decision under ``row``: decide, carry out (``row.acting``) or log;
        returns the status the host stores in the row."""
        ...

    async def close(self, row: ControlRow) -> dict[str, Any] | None:
        """The host stops: what the controller must do before it goes (undo, close a client);
        returns a status to store, or None to leave the row's as it is."""
        ...


def _outranked(name: ControllerName, rows: dict[ControllerName, dict[str, Any]]) -> str | None:
    for above in PRECEDENCE[: PRECEDENCE.index(name)]:
        overrides = (rows[above].get("status") or {}).get("overrides")
        if overrides:
            return f"the {above}'s {overrides} is active (the {above} arbitrates first)"
    return None


def read_control(store: _Store, name: ControllerName, cluster: str) -> ControlRow:
    """``name``'s control row of ``cluster``, with what outranks it (blocking: the store's read)."""
    rows = {
        c: store.governance.control(c, cluster) for c in PRECEDENCE[: PRECEDENCE.index(name) + 1]
    }
    own = rows[name]
    return ControlRow(
        controller=name,
        cluster=cluster,
        state=own["state"],
        paused=bool(own["paused"]),
        who=own.get("who"),
        status=own.get("status"),
        outranked=_outranked(name, rows),
    )


@dataclass(frozen=True, slots=True)
class Outcome:
    """What became of one controller's change on one replica (:func:`carry_out`)."""

    result: str  # the audit row's: applied, staged, rejected, error (sent); dry-run, skipped
    sent: ApplyResult | None = None  # steering's answer, when it was sent
    steered_by: str | None = None  # why the replica is not this controller's to steer now


async def carry_out(
    cluster: ClusterSpec,
    replica: str,
    change: Change,
    store: Any,
    *,
    who: str,
    note: str,
    leases: LeaseKeeper,
    now: float,
    act: bool,
    current: dict[str, Any] | None,
    steered_by: str | None = None,
) -> Outcome:
    """The one way a controller's change reaches a replica. ``act`` (the row armed and not held,
    the replica one the controller acts on): under the controller's lease, taken or renewed here,
    through ``apply_settings`` with ``who`` and ``note`` in the audit row. Otherwise — or when
    the lease is another's (``steered_by``: already known to the caller, or found here) — the
    change applied to ``current`` (the document the replica last reported) is written to the
    audit with result ``dry-run``, and nothing is sent."""
    if act and steered_by is None:
        steered_by = await leases.hold(cluster, replica, now)
        if steered_by is None:
            [res] = await apply_settings(
                cluster, [replica], change, store, who=who, note=note, lease=leases
            )
            return Outcome(res.result, res)
    logged = await asyncio.to_thread(
        record_dry_run,
        store,
        cluster.name,
        replica,
        change,
        current,
        who=who,
        note=note,
        reason=steered_by or "dry-run",
    )
    return Outcome(logged, None, steered_by)


async def _row(controller: HostedController) -> ControlRow:
    return await asyncio.to_thread(
        read_control, controller.store, controller.name, controller.cluster_name
    )


async def _store_status(controller: HostedController, status: dict[str, Any]) -> None:
    await asyncio.to_thread(
        controller.store.governance.set_control,
        controller.name,
        controller.cluster_name,
        status=status,
    )


async def tick(controller: HostedController) -> dict[str, Any]:
    """One step of ``controller``: its row read, the step, the status it returns stored."""
    status = await controller.step(await _row(controller))
    await _store_status(controller, status)
    return status


async def _close(controller: HostedController) -> None:
    status = await controller.close(await _row(controller))
    if status is not None:
        await _store_status(controller, status)


async def run_controller(
    controller: HostedController,
    stop: asyncio.Event,
    *,
    interval_s: float,
    close_timeout_s: float = 30.0,
) -> None:
    """Step ``controller`` every ``interval_s`` until ``stop`` is set; then (or cancelled) close
    it. The host's owner (the recorder, the TUI's live source) cancels it once its collector has
    stopped, possibly mid-close: the close runs shielded and is waited for, at most
    ``close_timeout_s``, whatever the cancellation."""
    log = logging.getLogger(f"tailpilot.{controller.name}")
    try:
        while not stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), interval_s)
            if stop.is_set():
                return
            try:
                await tick(controller)
            except Exception:  # a failed step (busy store, a replica down) is retried next tick
                log.exception("%s step failed", controller.name)
    finally:
        closing = asyncio.ensure_future(_close(controller))
        deadline = time.monotonic() + close_timeout_s
        while not closing.done() and time.monotonic() < deadline:
            with contextlib.suppress(asyncio.CancelledError, asyncio.TimeoutError):
                await asyncio.wait_for(
                    asyncio.shield(closing), max(0.0, deadline - time.monotonic())
                )
        if not closing.done():
            closing.cancel()
            log.error(
                "%s: close did not finish within %.0f s; its status lists what is left",
                controller.name,
                close_timeout_s,
            )
        elif not closing.cancelled() and closing.exception() is not None:
            log.error(
                "%s: close failed: %s; its status lists what is left",
                controller.name,
                closing.exception(),
            )

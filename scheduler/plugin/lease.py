"""Who may steer a replica's knobs: one lease per kind of controller (issue 33).

Two recorders arming the autopilot on one replica used to fight — γ flipped between their choices
every few seconds, and ``If-Match`` only ordered the writes. A controller (``autopilot``,
``governor``) now takes the replica's lease for its kind before it changes anything, and renews it
while it runs (``PUT /tailpilot/v1/lease``); a settings document it sends names its lease
(``X-Tailpilot-Lease: <kind> <holder>``) and is refused with 409 while another holder's lease of
that kind is live. A second controller of the same kind thus sees the first and stays in dry-run,
saying who holds the replica until when. An operator's own change (no lease header) is never
refused: it is the new base the controllers work on.

Bounded: one lease per kind (two kinds), holders of at most ``MAX_HOLDER`` characters, a lease of
at most ``MAX_TTL_S``; the replica's own clock decides expiry.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from scheduler.errors import FAILED, TailpilotError

CONTROLLER_KINDS = ("autopilot", "governor")
MAX_HOLDER = 100
MAX_TTL_S = 600.0
LEASE_HEADER = "X-Tailpilot-Lease"
_HOLDER = re.compile(r"[A-Za-z0-9._:@+-]{1,100}")


class LeaseConflict(TailpilotError):
    """Another holder's lease of this kind is live (HTTP 409)."""

    exit_code = FAILED


@dataclass(frozen=True, slots=True)
class Lease:
    kind: str
    holder: str
    expires_at: float  # the replica's clock


def check_kind(kind: object) -> str:
    if not isinstance(kind, str) or kind not in CONTROLLER_KINDS:
        raise ValueError(f"controller: expected one of {', '.join(CONTROLLER_KINDS)}, got {kind!r}")
    return kind


def check_holder(holder: object) -> str:
    if not isinstance(holder, str) or not _HOLDER.fullmatch(holder):
        shown = holder[:40] if isinstance(holder, str) else holder
        raise ValueError(
            f"holder: 1–{MAX_HOLDER} characters of letters, digits and ._:@+-, got {shown!r}"
        )
    return holder


def parse_lease_header(value: str | None) -> tuple[str, str] | None:
    """``X-Tailpilot-Lease: <kind> <holder>`` as (kind, holder); None when absent. ValueError
    names what is wrong."""
    if value is None:
        return None
    kind, _, holder = value.strip().partition(" ")
    return check_kind(kind), check_holder(holder.strip())


class Leases:
    """The replica's leases, one per controller kind."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._held: dict[str, Lease] = {}

    def take(self, doc: dict[str, Any]) -> dict[str, Any]:
        """Take or renew the lease a ``PUT /lease`` document asks for: ``controller`` (a kind),
        ``holder``, ``ttl_s`` (1–600; 0 releases a lease this holder holds). LeaseConflict while
        another holder's is live; ValueError naming the field for a bad document."""
        unknown = set(doc) - {"controller", "holder", "ttl_s"}
        if unknown:
            raise ValueError(f"{sorted(unknown)[0]}: unknown field (controller, holder, ttl_s)")
        kind, holder = check_kind(doc.get("controller")), check_holder(doc.get("holder"))
        ttl = doc.get("ttl_s")
        if isinstance(ttl, bool) or not isinstance(ttl, int | float) or not 0 <= ttl <= MAX_TTL_S:
            raise ValueError(
                f"ttl_s: expected a number of seconds in [0, {MAX_TTL_S:g}], got {ttl!r}"
            )
        now = self._clock()
        with self._lock:
            held = self._held.get(kind)
            if held is not None and held.holder != holder and held.expires_at > now:
                raise LeaseConflict(self._describe(held, now))
            if ttl == 0:
                self._held.pop(kind, None)
                return {"controller": kind, "holder": None, "expires_in_s": 0.0}
            lease = self._held[kind] = Lease(kind, holder, now + float(ttl))
        return {"controller": kind, "holder": holder, "expires_in_s": lease.expires_at - now}

    def check(self, lease: tuple[str, str] | None) -> None:
        """A settings document sent under ``lease`` (kind, holder): LeaseConflict unless that
        holder holds the kind's lease now, or nobody does. None (an operator) always passes."""
        if lease is None:
            return
        kind, holder = lease
        now = self._clock()
        with self._lock:
            held = self._held.get(kind)
            if held is None or held.expires_at <= now:
                self._held[kind] = Lease(kind, holder, now + MAX_TTL_S / 10)
                return
            if held.holder != holder:
                raise LeaseConflict(self._describe(held, now))

    def as_dict(self) -> dict[str, dict[str, Any]]:
        """The live leases for ``/state``: kind → holder and seconds left."""
        now = self._clock()
        with self._lock:
            return {
                k: {"holder": v.holder, "expires_in_s": round(v.expires_at - now, 3)}
                for k, v in self._held.items()
                if v.expires_at > now
            }

    @staticmethod
    def _describe(held: Lease, now: float) -> str:
        return (
            f"the {held.kind} lease is held by {held.holder} for "
            f"{held.expires_at - now:.0f} s more: another {held.kind} steers this replica"
        )

"""One replica's controller and what the live driver keeps beside it (``ReplicaPilot``), and how
what the replica reports — its completions, its requests in flight — becomes the controller's
``Observation``: on the controller's clock, each arrival once, nothing from after the replica's
own clock, never an output length of a request in flight."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from controlplane.verification import Ledger
from scheduler.contract import Inflight
from scheduler.metrics import Completion
from sim.traces import DEFAULT_MAX_TOKENS  # a request whose client (or replica) gave no cap
from storage.rows import CompletionRow
from tuner.autopilot.config import AutopilotConfig
from tuner.autopilot.controller import Autopilot
from tuner.autopilot.types import Arrival, Decision, Observation

# Slack on the replica's clock: an arrival this far after it is refused; a clock this far behind
# the last one seen has stepped back.
FUTURE_SLACK_S = 5.0


@dataclass(slots=True)
class ReplicaPilot:
    """One replica's controller and what the live driver keeps beside it."""

    name: str
    instance: str | None
    origin: float  # the replica-clock second the controller's time 0 stands for
    pilot: Autopilot
    seen: dict[str, float] = field(default_factory=dict)  # request id -> arrival (replica clock)
    completions: list[CompletionRow] = field(default_factory=list)  # polled since the last tick
    last: deque[dict[str, Any]] = field(default_factory=deque)  # recent decisions, for the status
    # Applied switches awaiting verification, and the verdicts (controlplane.verification).
    ledger: Ledger = field(default_factory=Ledger)
    note: str = ""  # why the last decision was or was not carried out
    future: int = 0  # requests reported as arriving after the replica's own clock: refused
    follows: str | None = None  # the pool's first replica, whose controller this one follows
    followed: Decision | None = None  # the last of its decisions carried out here
    clock: float | None = None  # the latest replica time seen (controller seconds)

    def observation(self, inflight: Inflight, now: float, config: AutopilotConfig) -> Observation:
        """What came since the last tick, on the controller's clock: arrivals first seen now (in a
        completion or in flight), completions with their lengths, tokens so far of those in
        flight."""
        arrivals: list[Arrival] = []

        def arrive(
            rid: str, arrival: float, prompt: int, cap: int | None, tenant: str, rtype: str
        ) -> None:
            if rid in self.seen:
                return
            if arrival - self.origin > now + FUTURE_SLACK_S:
                # A request cannot have arrived after the replica's own clock: made up, or a
                # clock gone wrong. Refused (and counted), so it never takes memory.
                self.future += 1
                return
            self.seen[rid] = arrival
            arrivals.append(
                Arrival(
                    rid,
                    max(arrival - self.origin, 0.0),
                    max(prompt, 1),
                    max(cap or DEFAULT_MAX_TOKENS, 1),
                    tenant,
                    rtype,
                )
            )

        completions: list[Completion] = []
        for row in self.completions:
            if row.reason == "rejected":
                continue  # refused on arrival: it never took a seat
            arrive(
                row.request_id,
                row.arrival_s,
                row.prompt_tokens,
                row.max_tokens,
                row.tenant,
                row.type,
            )
            completions.append(
                Completion(
                    id=row.request_id,
                    tenant=row.tenant,
                    type=row.type,
                    arrival=row.arrival_s - self.origin,
                    scheduled_at=math.nan,
                    first_token_at=math.nan,
                    finished_at=row.finished_s - self.origin,
                    prompt_tokens=row.prompt_tokens,
                    output_tokens=row.output_tokens,
                )
            )
        self.completions = []
        for r in inflight.requests:
            arrive(r.id, r.arrival, r.prompt_tokens, r.max_tokens, r.tenant, r.type)
        # Forget ids long past every window: the map stays bounded on a replica that runs for
        # months.
        horizon = now + self.origin - config.window_s - config.delay_s - 600.0
        if len(self.seen) > 4 * config.min_requests:
            self.seen = {rid: t for rid, t in self.seen.items() if t >= horizon}
        return Observation(
            now, arrivals, completions, {r.id: r.generated for r in inflight.requests}
        )

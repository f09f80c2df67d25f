"""Did a controller's change do what it predicted? The controller machine's check of every change
applied with a predicted effect (``controlplane.controller_host``), and when to step back.

A controller that applies a change with a prediction (the autopilot's switches: the predicted
P95 TTFT change over the window it judged, stored as a prediction row) hands the prediction to
the replica's :class:`Ledger`. ``verify_ms`` after the change, the verifier — in a live cluster
``tuner.closed_loop.whatif.verify``: the traffic that came since replayed under the previous
settings, the counterfactual — reports the realized change once that traffic is recorded. Worse
than predicted by more than the band (the replica's fidelity band, else the controller's default)
``step_back_after`` times in a row, :meth:`Ledger.check` returns a :class:`Miss`: the controller
steps back (to what is its own to say) and the ledger starts afresh. ``tailpilot verify``, the
TUI and ``autopilot status`` read the verdicts.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Ledger", "Miss", "Verifier"]

# (store, prediction, now in ms) -> the verification: "ready", and the realized and predicted
# change per metric, the band.
Verifier = Callable[[Any, dict[str, Any], int], dict[str, Any]]

VERDICTS_KEPT = 10  # per replica, in the status


@dataclass(frozen=True, slots=True)
class Miss:
    """The last of ``step_back_after`` verifications in a row whose realized P95 TTFT change was
    worse than predicted by more than the band."""

    realized: float
    predicted: float
    band: float


@dataclass(slots=True)
class Ledger:
    """One replica's applied changes awaiting verification and the verdicts so far."""

    pending: list[dict[str, Any]] = field(default_factory=list)
    verdicts: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=VERDICTS_KEPT))
    worse_in_row: int = 0

    def expect(self, prediction: dict[str, Any]) -> None:
        """A change was applied: ``prediction`` (its id, ``t_ms`` and summary) is verified later."""
        self.pending.append(prediction)

    async def check(
        self,
        verifier: Verifier,
        store: Any,
        now_ms: int,
        *,
        verify_ms: int,
        band: float,
        step_back_after: int,
    ) -> Miss | None:
        """Verify the changes applied ``verify_ms`` or more before ``now_ms`` whose traffic is
        recorded (the verifier runs in a thread: it replays traffic); a :class:`Miss` when the
        last ``step_back_after`` in a row were worse than predicted by more than the band (the
        verification's own, else ``band``) — the ledger is then cleared."""
        for prediction in [p for p in self.pending if now_ms >= p["t_ms"] + verify_ms]:
            v = await asyncio.to_thread(verifier, store, prediction, now_ms)
            if not v.get("ready"):
                continue
            self.pending.remove(prediction)
            m = (v.get("metrics") or {}).get("ttft_p95") or {}
            realized, predicted = m.get("realized"), m.get("predicted")
            if realized is None or predicted is None:
                self.verdicts.append({"id": prediction["id"], "verdict": "no traffic to verify on"})
                continue
            margin = float(v["band"]) if v.get("band") is not None else band
            worse = realized > predicted + margin
            self.worse_in_row = self.worse_in_row + 1 if worse else 0
            self.verdicts.append(
                {
                    "id": prediction["id"],
                    "predicted": round(predicted, 4),
                    "realized": round(realized, 4),
                    "band": margin,
                    "verdict": "worse than predicted" if worse else "as predicted",
                }
            )
            if self.worse_in_row >= step_back_after:
                # The rest of what was pending was applied from the settings stepped back from.
                self.worse_in_row = 0
                self.pending.clear()
                return Miss(realized, predicted, margin)
        return None

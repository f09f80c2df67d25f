"""What a replay returns: the completions, the rejected ids and the engine's counters."""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.metrics import Completion, summarize
from scheduler.settings import Settings


@dataclass
class SimResult:
    """One replay's outcome: its completions (in finishing order) and rejected request ids, the
    settings it ran under at the end, and the engine's counters (docs/engine.md)."""

    settings: Settings
    completions: list[Completion]
    rejected: list[str]
    steps: int
    iterations: int  # loop iterations: steps, or stretches of steps when event skipping
    sim_time_s: float
    wall_s: float
    preemptions: int
    policy_preemptions: int
    recomputed_tokens: int
    gamma_timeline: list[tuple[float, float]]

    def metrics(self) -> dict[str, float]:
        """``scheduler.metrics.summarize`` of the completions, plus policy preemptions and
        rejections."""
        m = summarize(self.completions)
        m["policy_preemptions"] = float(self.policy_preemptions)
        m["rejected"] = float(len(self.rejected))
        return m

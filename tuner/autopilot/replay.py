"""The autopilot in the simulator: ``tailpilot sim --autopilot``, ``compare --autopilot`` and the
benchmark replay a trace with the controller choosing the settings as it goes, shown at each
decision only what a live replica would know by then
(``tuner.autopilot.controller.Observation``)."""

from __future__ import annotations

import time
from collections.abc import Sequence

from scheduler.metrics import Completion
from scheduler.settings import Settings
from sim.engine import EngineConfig, SimResult, Simulator
from sim.traces import Trace, TraceRequest
from tuner.autopilot.controller import Autopilot, AutopilotConfig
from tuner.autopilot.types import Arrival, Decision, Observation


def replay_with_autopilot(
    trace: Trace | Sequence[TraceRequest],
    base: Settings | None = None,
    config: AutopilotConfig | None = None,
    engine: EngineConfig | None = None,
) -> tuple[SimResult, list[Decision]]:
    """Replay ``trace`` with the autopilot choosing the settings every ``interval_s``: the
    replica starts on ``base`` (default: uniboost's defaults); at each decision the controller
    is shown only what a live replica would know by then. Returns the replay's result (its
    settings: the last applied) and the decisions."""
    base = base or Settings.model_validate({"policy": "uniboost"})
    config = config or AutopilotConfig()
    engine = engine or EngineConfig()
    requests = sorted(trace, key=lambda r: (r.arrival, r.id))
    sim = Simulator(requests, base, engine)
    pilot = Autopilot(base, config, engine)  # running the candidate ``base`` is, if any
    t_start = time.perf_counter()
    completions: list[Completion] = []
    held: list[Completion] = []  # finished after the observation's time: shown at the next
    rejected_ids: list[str] = []
    next_arrival = 0
    t = requests[0].arrival if requests else 0.0
    end = requests[-1].arrival if requests else 0.0
    while True:
        t += config.interval_s
        sim.advance_to(t)
        new: list[Arrival] = []
        while next_arrival < len(requests) and requests[next_arrival].arrival <= t:
            r = requests[next_arrival]
            new.append(Arrival(r.id, r.arrival, r.prompt_tokens, r.max_tokens, r.tenant, r.type))
            next_arrival += 1
        done, rejected = sim.drain()
        completions += done
        rejected_ids += rejected
        # A step that started before t may end after it: its completions are not known at t.
        done = [*held, *done]
        held = [c for c in done if c.finished_at > t]
        done = [c for c in done if c.finished_at <= t]
        generated = {s.id: s.generated for s in [*sim.running, *sim.waiting] if s.generated}
        decision = pilot.observe(Observation(t, new, done, generated))
        if decision is not None and decision.changed:
            sim.apply_settings(pilot.options[decision.choice])
        if t > end and not sim.running and not len(sim.waiting):
            break
    result = sim.result(completions, rejected_ids, time.perf_counter() - t_start)
    return result, pilot.decisions

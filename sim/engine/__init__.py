"""The engine simulator: one vLLM v1 replica's scheduling steps replayed on a trace
(docs/engine.md).

``simulate(trace, settings, config)`` replays a whole trace and returns a `SimResult`; a
`Simulator` can also be driven live (``advance_to``, ``apply_settings``), as the twin replicas do.

Modules: `simulator` (the `Simulator` loop and `simulate`), `step` (what one step decided and the
event-skipping time arithmetic), `config` (`EngineConfig`, the replica's fixed facts), `result`
(`SimResult`), `books` (`EngineBooks`, the simulator's base: the running batch, the KV blocks,
policy and memory preemption, the contended serve, the books checked). This package's namespace
is the public API: import from `sim.engine`.
"""

from sim.engine.config import EngineConfig
from sim.engine.result import SimResult
from sim.engine.simulator import Simulator, simulate

__all__ = ["EngineConfig", "SimResult", "Simulator", "simulate"]

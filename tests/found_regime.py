"""The regime the autopilot's scenario tests were found in: the engine before it modelled vLLM's
prefix cache (``EngineConfig(prefix_caching=False)``), with uniboost's KV victims waiting by their
score (``victims_first`` off) — README, "Where the defaults' own breaks on BWB came from".

A scenario is a trace *and* an engine. On today's engine these sweep variants play out otherwise
(sarathi readmits its victims into their cached prefixes, the defaults now too, and the breaks the
variants were chosen for are gone or moved), so the tests of the autopilot's mechanisms found on
them replay them where they were found: each still fails with its mechanism off."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any
from unittest import mock

from benchmarks import autopilot_sweep as sweep
from benchmarks import seed_claims
from benchmarks.autopilot_workloads import build_new_workload
from scheduler.settings import Settings
from sim.engine import EngineConfig, SimResult, simulate
from sim.traces import TraceRequest
from tuner.autopilot.controller import AutopilotConfig
from tuner.autopilot.replay import replay_with_autopilot
from tuner.autopilot.types import Decision

CACHELESS = EngineConfig(prefix_caching=False)
REPO = Path(__file__).resolve().parents[1]


def _cacheless_simulate(trace: Any, settings: Settings, config: Any = None, **kw: Any) -> SimResult:
    return simulate(trace, settings, config or CACHELESS, **kw)


def sweep_variant(k: int, seed: int) -> Sequence[TraceRequest]:
    """The sweep's variant ``k`` of ``seed``, its loads measured on the engine found."""
    with mock.patch.object(seed_claims, "simulate", _cacheless_simulate):
        return sweep.build(k, seed, sweep.pools(REPO / "traces"))[0]


def new_workload(name: str) -> Sequence[TraceRequest]:
    """The autopilot benchmark's workload ``name``, its load measured on the engine found."""
    with mock.patch.object(seed_claims, "simulate", _cacheless_simulate):
        return build_new_workload(name, REPO / "traces")[0]


def settings(policy: str) -> Settings:
    """``policy`` at its defaults, uniboost's KV victims waiting by their score."""
    params = {"victims_first": False} if policy == "uniboost" else {}
    return Settings.model_validate({"policy": policy, "params": params})


def replay(
    trace: Sequence[TraceRequest], config: AutopilotConfig | None = None
) -> tuple[SimResult, list[Decision]]:
    """The autopilot's replay from the defaults, in the regime found."""
    return replay_with_autopilot(trace, base=settings("uniboost"), config=config, engine=CACHELESS)


def run(trace: Sequence[TraceRequest], policy: str) -> SimResult:
    return simulate(trace, settings(policy), CACHELESS)


def fixed(trace: Sequence[TraceRequest], policy: str) -> dict[str, float]:
    """The whole run's figures of ``policy`` (``sweep.fixed``), in the regime found."""
    return sweep.score(run(trace, policy).completions, sweep.half_time(trace))["all"]

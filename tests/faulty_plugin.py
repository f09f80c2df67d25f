"""A plugin scheduler with an injected fault, for the circuit breaker's end-to-end test.

The settings model refuses every document known to make a policy raise, so a real server cannot
be made to fail on demand: this module (loaded by vLLM through ``--scheduler-cls
faulty_plugin.FaultyScheduler``, with ``tests/`` on ``PYTHONPATH``) makes uniboost raise whenever
it weighs a request of tenant ``boom`` — a subclass put where the engine builds its policies (a
compiled policy's methods cannot be patched). Everything else is the real plugin.
"""

from __future__ import annotations

from scheduler.plugin.vllm import TailpilotScheduler
from scheduler.policies import POLICY_CLASSES
from scheduler.policies.base import RequestState
from scheduler.policies.boost import UniBoost

FAULTY_TENANT = "boom"


class FaultyUniBoost(UniBoost):
    """UniBoost, raising when it weighs a request of tenant ``boom``."""

    def work_tokens(self, req: RequestState) -> float:
        if req.tenant == FAULTY_TENANT:
            raise RuntimeError(
                f"injected fault: uniboost weighed a request of tenant {FAULTY_TENANT!r}"
            )
        return super().work_tokens(req)


POLICY_CLASSES["uniboost"] = FaultyUniBoost


class FaultyScheduler(TailpilotScheduler):
    """``TailpilotScheduler`` in a process where uniboost raises for tenant ``boom``."""

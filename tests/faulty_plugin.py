"""A plugin scheduler with an injected fault, for the circuit breaker's end-to-end test.

The settings model refuses every document known to make a policy raise, so a real server cannot
be made to fail on demand: this module (loaded by vLLM through ``--scheduler-cls
faulty_plugin.FaultyScheduler``, with ``tests/`` on ``PYTHONPATH``) makes uniboost raise whenever
it weighs a request of tenant ``boom``. Everything else is the real plugin.
"""

from __future__ import annotations

from scheduler.plugin.vllm import TailpilotScheduler
from scheduler.policies.boost import UniBoost

FAULTY_TENANT = "boom"
_work_tokens = UniBoost.work_tokens


def _faulty_work_tokens(self, req):
    if req.tenant == FAULTY_TENANT:
        raise RuntimeError(
            f"injected fault: uniboost weighed a request of tenant {FAULTY_TENANT!r}"
        )
    return _work_tokens(self, req)


UniBoost.work_tokens = _faulty_work_tokens  # type: ignore[method-assign]


class FaultyScheduler(TailpilotScheduler):
    """``TailpilotScheduler`` in a process where uniboost raises for tenant ``boom``."""

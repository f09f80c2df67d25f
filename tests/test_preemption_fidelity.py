"""The simulator's KV preemption is vLLM's: where preemption dominates (a deep queue of long
outputs, a KV cache far smaller than what the seats grow to), vLLM's own scheduler and KV cache
manager, driven in this process (tests/plugin_harness.py), and the simulator under sarathi take
the same steps, preempt as often and throw away as many tokens (``benchmarks/
preemption_fidelity.py``; prefix caching off — the simulator has no prefix cache, README)."""

from __future__ import annotations

import pytest

from benchmarks import preemption_fidelity as fidelity

pytestmark = pytest.mark.vllm_in_process


def test_the_simulator_preempts_and_recomputes_as_vllms_scheduler_does():
    reqs = fidelity.workload(60, seed=4)
    real = fidelity.served_by_vllm(reqs, blocks=200, prefix_caching=False)
    simulated = fidelity.served_by_simulator(reqs, blocks=200)
    # The regime is the one the claim is about: over a third of the tokens scheduled are
    # prompts computed again.
    scheduled = real.recomputed + fidelity.needed(reqs)
    assert real.preemptions >= 50 and real.recomputed > scheduled / 3
    assert simulated.steps == pytest.approx(real.steps, rel=0.01)
    assert simulated.preemptions == pytest.approx(real.preemptions, rel=0.02)
    assert simulated.recomputed == pytest.approx(real.recomputed, rel=0.02)

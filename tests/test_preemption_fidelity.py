"""The simulator's KV preemption is vLLM's: where preemption dominates (a deep queue of long
outputs, a KV cache far smaller than what the seats grow to), vLLM's own scheduler and KV cache
manager, driven in this process (tests/plugin_harness.py), and the simulator under sarathi take
the same steps, preempt as often and throw away as many tokens (``benchmarks/
preemption_fidelity.py``), with vLLM's prefix cache on (its default: a readmitted victim finds the
blocks of its prefix nobody took since) and off."""

from __future__ import annotations

import pytest

from benchmarks import preemption_fidelity as fidelity

pytestmark = pytest.mark.vllm_in_process


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["cache", "no-cache"])
def test_the_simulator_preempts_and_recomputes_as_vllms_scheduler_does(prefix_caching):
    reqs = fidelity.workload(60, seed=4)
    real = fidelity.served_by_vllm(reqs, blocks=200, prefix_caching=prefix_caching)
    simulated = fidelity.served_by_simulator(reqs, blocks=200, prefix_caching=prefix_caching)
    # The regime is the one the claim is about: preemptions throw away a large share of the
    # tokens scheduled (over a third without the cache, over a sixth with it).
    scheduled = real.recomputed + fidelity.needed(reqs)
    assert real.preemptions >= 50 and real.recomputed > scheduled / (6 if prefix_caching else 3)
    assert simulated.steps == pytest.approx(real.steps, rel=0.01)
    assert simulated.preemptions == pytest.approx(real.preemptions, rel=0.02)
    assert simulated.recomputed == pytest.approx(real.recomputed, rel=0.02)

"""The engine's prefix cache as it serves preempted requests (docs/engine.md#prefix-cache): vLLM's
free queue, where allocations take the head and a victim's freed blocks join the tail last block
first, so the head eats a victim's prefix from its end. The books are driven by hand here; that
whole runs match vLLM's own scheduler is tests/test_preemption_fidelity.py's, and a victim
preempted for a seat finding its prefix is tests/test_preemption_rules.py's."""

from __future__ import annotations

import dataclasses

from scheduler.policies import RequestState
from scheduler.settings import Settings
from sim.engine import EngineConfig, Simulator

BLOCK = 4
CONFIG = EngineConfig(num_gpu_blocks=10, block_size=BLOCK)


def books(config: EngineConfig = CONFIG) -> Simulator:
    return Simulator([], Settings(), config, check_invariants=True)


def running(sim: Simulator, rid: str, computed: int, held: int) -> RequestState:
    """A running request that has computed ``computed`` prompt tokens in ``held`` blocks taken
    from the free queue's head."""
    req = RequestState(id=rid, arrival=0.0, prompt_tokens=100, max_tokens=10, output_tokens=10)
    req.status, req.computed_tokens = "running", computed
    sim.running.append(req)
    sim.blocks[rid] = held
    sim.free_blocks -= held
    return req


def take_from_head(sim: Simulator, rid: str, blocks: int) -> None:
    sim.blocks[rid] = sim.blocks.get(rid, 0) + blocks
    sim.free_blocks -= blocks


def test_a_victim_finds_the_full_blocks_of_its_prefix_the_head_has_not_taken():
    sim = books()
    victim = running(sim, "victim", computed=14, held=4)  # 3 full blocks and a partial one
    running(sim, "other", computed=0, held=0)
    sim.preempt(victim, by_policy=False)
    assert victim.status == "waiting" and sim.free_blocks == 10
    # Nobody has taken a block since: all 3 full blocks hit (12 tokens), not the partial one.
    assert sim.cached_tokens(victim) == 12
    # The head takes the 6 blocks never used, then the victim's partial block, then its prefix
    # from the end: 8 blocks leave it blocks 0 and 1.
    take_from_head(sim, "other", 8)
    assert sim.cached_tokens(victim) == 8
    take_from_head(sim, "other", 2)
    assert sim.cached_tokens(victim) == 0


def test_a_hit_leaves_the_middle_of_the_queue_and_is_not_recomputed():
    sim = books()
    victim = running(sim, "victim", computed=14, held=4)
    sim.preempt(victim, by_policy=False)
    assert victim.recomputed_tokens == sim.recomputed_tokens == 14
    cached = sim.cached_tokens(victim)
    sim.take_cached(victim, cached)
    take_from_head(sim, "victim", sim._blocks_for(cached + 2))  # its blocks: the hits + a chunk
    assert victim.computed_tokens == 12
    assert victim.recomputed_tokens == sim.recomputed_tokens == 2  # the partial block's tokens
    # The head steps over the hits: the 6 blocks after them are the next it takes, and the
    # blocks ever taken from it add up with the free ones and the hits.
    take_from_head(sim, "other", sim.free_blocks)
    assert sim._free_queue_head() == sim._appended and not sim._holes
    sim.check_books()


def test_a_hit_stops_one_token_short_of_the_sequence():
    # A victim whose every token is in full blocks recomputes its last block for the logits.
    sim = books()
    victim = running(sim, "victim", computed=16, held=4)
    victim.prompt_tokens = 16
    sim.preempt(victim, by_policy=False)
    assert sim.cached_tokens(victim) == 12


def test_a_finished_requests_blocks_are_no_ones_cache():
    sim = books()
    done = running(sim, "done", computed=16, held=4)
    done.generated = done.output_tokens = 1
    done.scheduled_at = done.first_token_at = 0.0
    sim._finish(done)
    assert sim._cached == {} and sim.free_blocks == 10


def test_without_prefix_caching_a_victim_recomputes_all_of_it():
    sim = books(dataclasses.replace(CONFIG, prefix_caching=False))
    victim = running(sim, "victim", computed=14, held=4)
    sim.preempt(victim, by_policy=False)
    assert sim.cached_tokens(victim) == 0


def test_a_fork_mid_run_keeps_the_cache():
    """The autopilot forks a simulator by pickling it: a fork taken while victims wait for their
    cached prefixes replays the rest exactly as the original does."""
    import pickle

    from benchmarks import preemption_fidelity as fidelity

    trace = fidelity.as_trace(fidelity.workload(60, seed=4))
    sim = Simulator(trace, Settings(), EngineConfig(num_gpu_blocks=199, block_size=16))
    sim.advance_to(60.0)
    assert sim._cached  # victims waiting with prefixes in the cache
    fork = pickle.loads(pickle.dumps(sim))
    original, forked = sim.run(), fork.run()
    assert forked.recomputed_tokens == original.recomputed_tokens
    assert [c.finished_at for c in forked.completions] == [
        c.finished_at for c in original.completions
    ]

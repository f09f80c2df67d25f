"""The simulator's books, checked (``Simulator(check_invariants=True)`` after every loop
iteration, and ``Simulator.recover`` after replacing a policy that raised)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sim.engine.simulator import Simulator


def check_books(sim: Simulator) -> None:
    """Raise AssertionError unless the KV blocks held and free add up to the capacity, every
    running request holds the blocks its computed tokens fill, and the waiting queue is in
    order."""
    held = sum(sim.blocks.values())
    assert held + sim.free_blocks == sim.config.num_gpu_blocks, "KV block accounting broken"
    assert sim.free_blocks >= 0, "KV blocks over capacity"
    bs = sim.config.block_size
    for r in sim.running:
        assert sim.blocks.get(r.id, 0) >= -(-r.computed_tokens // bs), f"{r.id} lacks KV"
    sim.waiting.check_order()

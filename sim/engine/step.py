"""What one scheduling step decided (`StepPlan`), the cheap way to decide it when nothing contends
(`serve_uncontended`), and what it and a stretch of identical steps cost.

Event skipping: when a step is a pure decode step that admitted and preempted nothing, the steps
after it are identical until the next event, and the simulator advances them as one. Decode step j
of a stretch costs ``t0 + e·n·j`` (the KV context grows by n tokens a step), so K steps take
``K·t0 + e·n·K(K−1)/2``; this module is that arithmetic.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from mypy_extensions import mypyc_attr

from scheduler.policies import RequestState
from sim.stepmodel import StepTimeModel


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
@dataclass(slots=True, init=False)
class StepPlan:
    """What one step decided. Decodes (one token each, the common case) are kept apart from
    prefill chunks so that applying the step can take a short path for them; each part is in
    service order."""

    # Requests that decode one token this step; requests given a prefill chunk (the prompt, or a
    # recompute) -> its tokens.
    decodes: list[RequestState]
    chunks: dict[RequestState, int]
    preempted: bool
    memory_preempted: bool
    admitted: bool
    kv_blocked: bool  # admission stopped because the next request could not get blocks
    admission_blocked: bool  # admission stopped by seats, budget or KV
    prefill_tokens: int
    sum_prefill_sq: int
    sum_kv_context: int  # over the decodes

    # Written out (init=False), with every field's starting value: mypyc compiles a method of the
    # class body, while the dataclass decorator's generated __init__ runs interpreted (one plan a
    # step: 2.6% of a uniboost replay, perf).
    def __init__(self) -> None:
        self.decodes = []
        self.chunks = {}
        self.preempted = False
        self.memory_preempted = False
        self.admitted = False
        self.kv_blocked = False
        self.admission_blocked = False
        self.prefill_tokens = 0
        self.sum_prefill_sq = 0
        self.sum_kv_context = 0

    @property
    def decode_seqs(self) -> int:
        """Requests decoding one token in this step."""
        return len(self.decodes)

    def serves(self) -> bool:
        """Whether the step gives any request tokens."""
        return bool(self.decodes or self.chunks)

    def duration(self, model: StepTimeModel) -> float:
        """This step's duration under ``model``, in seconds."""
        return model.step_time(
            self.prefill_tokens, self.sum_prefill_sq, self.decode_seqs, self.sum_kv_context
        )

    def stretch_time(self, model: StepTimeModel, k: int) -> float:
        """Duration of ``k`` identical steps starting with this one (a pure decode step's KV
        context grows by ``decode_seqs`` tokens a step)."""
        t0 = self.duration(model)
        if k == 1:
            return t0
        return k * t0 + model.e * self.decode_seqs * k * (k - 1) / 2.0

    def steps_until(self, model: StepTimeModel, now: float, t_event: float) -> int:
        """Smallest k ≥ 1 such that the step after k of these, started at ``now``, starts at or
        after ``t_event``."""
        remaining = t_event - now
        if remaining <= 0:
            return 1
        t0, g = self.duration(model), model.e * self.decode_seqs
        # Solve k·t0 + g·k(k−1)/2 = remaining for k, then fix up rounding by direct evaluation.
        if g > 0:
            b = t0 - g / 2.0
            k = math.ceil((-b + math.sqrt(b * b + 2.0 * g * remaining)) / g)
        else:
            k = math.ceil(remaining / t0)
        k = max(1, k)
        while k > 1 and now + self.stretch_time(model, k - 1) >= t_event:
            k -= 1
        while now + self.stretch_time(model, k) < t_event:
            k += 1
        return k


def serve_uncontended(
    step: StepPlan,
    running: Sequence[RequestState],
    blocks: dict[str, int],
    free_blocks: int,
    block_size: int,
    token_budget: int,
    long_prefill_threshold: int,
) -> tuple[int, int] | None:
    """Give every running request its tokens and blocks, in any order: fill ``step`` and grow
    ``blocks`` (KV blocks held per request id), and return (the token budget left, the free blocks
    left). Return None, touching nothing, if ``token_budget`` or ``free_blocks`` do not cover them
    all: the running order then matters, and the simulator serves them in it."""
    bs, lpt, free = block_size, long_prefill_threshold, free_blocks
    decodes: list[RequestState] = []
    chunks: dict[RequestState, int] = {}
    grown: list[tuple[str, int]] = []  # (request id, blocks it will hold)
    sum_ctx = prefill = prefill_sq = 0
    for req in running:
        c, g = req.computed_tokens, req.generated
        n = req.prompt_tokens + g - c
        if n == 1 and g:  # a decode: one token, which needs a new block every bs tokens
            decodes.append(req)
            sum_ctx += c + 1
            if c % bs:  # fits in the blocks it holds
                continue
        else:  # a prefill chunk (the prompt, or a recompute)
            if 0 < lpt < n:
                n = lpt
            chunks[req] = n
            prefill += n
            prefill_sq += n * n
            if (c + n - 1) // bs < (c + bs - 1) // bs:  # fits in the blocks it holds
                continue
        held = blocks.get(req.id, 0)
        need = -(-(c + n) // bs) - held
        free -= need
        grown.append((req.id, held + need))
    # Budget and free blocks only shrink above, so checking them once at the end is enough.
    budget = token_budget - len(decodes) - prefill
    if budget < 0 or free < 0:
        return None
    for rid, held in grown:
        blocks[rid] = held
    step.decodes, step.chunks, step.sum_kv_context = decodes, chunks, sum_ctx
    step.prefill_tokens, step.sum_prefill_sq = prefill, prefill_sq
    return budget, free


def kv_safe_steps(running: Sequence[RequestState], free_blocks: int, block_size: int) -> int:
    """Pure decode steps of ``running`` (counting the first, already allocated) before some
    decode needs a block beyond the ``free_blocks``."""
    bs = block_size
    # Step j ≥ 1 of the stretch computes token index c+j; it needs a new block iff (c+j) % bs == 0.
    # Request r first needs one at step first_r in 1..bs, then every bs steps: the free blocks
    # last `rounds` whole rounds and then the `rem` requests with the earliest first_r. The
    # answer is the (rem+1)-th smallest first_r, found by counting them (no sort of the batch).
    counts = [0] * (bs + 1)
    for r in running:
        counts[((-r.computed_tokens) % bs) or bs] += 1
    rounds, rem = divmod(free_blocks, len(running))
    seen = 0
    for first in range(1, bs + 1):
        seen += counts[first]
        if seen > rem:
            break
    return rounds * bs + first

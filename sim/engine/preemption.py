"""Preemption by recompute in the simulator (docs/engine.md#preemption): the policy's preemptions
for better-keyed waiting requests before a step is served, and serving the running requests in
running order when they contend, where a request short of a KV block preempts the policy's memory
victim. Functions of the `Simulator` whose books they change; it calls each at most once a step,
``preempt`` once a preempted request."""

from __future__ import annotations

from typing import TYPE_CHECKING

from scheduler.policies import Policy, PreemptivePolicy, RequestState
from scheduler.policies.preemption import plan_preemptions
from sim.engine.step import StepPlan

if TYPE_CHECKING:
    from sim.engine.simulator import Simulator


def preempt(sim: Simulator, req: RequestState, by_policy: bool, requeue: bool = True) -> None:
    """Preempt ``req`` by recompute: its KV blocks freed, its computed tokens dropped, and (with
    ``requeue``) back to the front of the waiting queue."""
    sim.leave_running(req)
    sim.free_blocks += sim.blocks.pop(req.id, 0)
    sim.recomputed_tokens += req.note_preemption(sim.now, by_policy)
    req.computed_tokens = 0
    sim.preemptions += 1
    sim.policy_preemptions += by_policy
    if requeue:
        _requeue(sim, req, by_policy)


def _requeue(sim: Simulator, req: RequestState, by_policy: bool) -> None:
    sim.waiting.push(req, sim.now, front=True)  # recompute: back to the front (stock order)
    sim.policy.on_preempt(req, sim.now, by_policy)


def preempt_for_waiting(sim: Simulator, now: float) -> bool:
    """Preempt running requests for better-keyed waiting ones that cannot otherwise fit."""
    eng, policy = sim.settings.engine, sim.policy
    if not isinstance(policy, PreemptivePolicy):
        return False

    def ordered_running() -> list[RequestState]:
        sim.sort_running(now)
        return sim.running

    victims = plan_preemptions(
        policy,
        sim.waiting.ordered(now),
        ordered_running,
        now=now,
        seats=eng.max_num_seqs - len(sim.running),
        free_blocks=sim.free_blocks,
        budget=eng.max_num_batched_tokens,
        chunk=sim.prefill_chunk,
        blocks_needed=sim.admission_blocks,
        held_blocks=lambda r: sim.blocks.get(r.id, 0),
        max_seats=eng.max_num_seqs,
        total_blocks=sim.config.num_gpu_blocks,
    )
    for victim in victims:
        preempt(sim, victim, by_policy=True)
    return bool(victims)


def _budget_order(policy: Policy, running: list[RequestState]) -> list[RequestState]:
    """The order the token budget goes in: the running list itself, or under ``decode_first``
    a copy with the decodes (in running order) before the prefill chunks (in running order)."""
    if not policy.decode_first or policy.running_order_is_budget_order:
        return running
    # Prefill chunks (prompts, recomputes) are few: find them, then the decodes are the rest.
    chunked = [
        r
        for r in running
        if not (r.generated and r.computed_tokens == r.prompt_tokens + r.generated - 1)
    ]
    if not 0 < len(chunked) < len(running):
        return running  # all decodes, or none: the running order is the budget order
    if len(chunked) == 1:
        first = chunked[0]
        order = [r for r in running if r is not first]
    else:
        chunked_set = set(chunked)  # RequestState hashes by identity
        order = [r for r in running if r not in chunked_set]
    return order + chunked


def serve_in_running_order(sim: Simulator, step: StepPlan) -> int:
    """Serve the running requests in running order, preempting on KV shortage
    (docs/engine.md#budget-order).

    Under ``decode_first`` the budget goes to decodes before prefill chunks (each group in
    running order), while the memory-pressure victim still comes from the running order."""
    policy, eng, running, blocks = sim.policy, sim.settings.engine, sim.running, sim.blocks
    budget = eng.max_num_batched_tokens
    bs, lpt = sim.config.block_size, eng.long_prefill_token_threshold
    decodes, chunks = step.decodes, step.chunks
    sum_ctx = prefill = prefill_sq = 0
    order = _budget_order(policy, running)  # the running list itself, or a reordered copy of it
    i, end = 0, len(order)  # only the preemptions below shrink it
    while i < end and budget > 0:
        req = order[i]
        c, g = req.computed_tokens, req.generated
        n = req.prompt_tokens + g - c
        if n == 1 and g and c % bs:  # a decode within the blocks it holds: the common case
            decodes.append(req)
            sum_ctx += c + 1
            budget -= 1
            i += 1
            continue
        decode = n == 1 and g > 0  # else a prefill chunk (the prompt, or a recompute)
        if not decode:
            if 0 < lpt < n:
                n = lpt
            if n > budget:
                n = budget
        if (c + n - 1) // bs >= (c + bs - 1) // bs:  # crosses into a block it does not hold
            held = blocks.get(req.id, 0)
            need = -(-(c + n) // bs) - held
            while need > sim.free_blocks:
                victim = policy.memory_victim(running)
                vi = order.index(victim)
                if victim in chunks:  # already served this step: take its service back
                    vn = chunks.pop(victim)
                    budget += vn
                    prefill -= vn
                    prefill_sq -= vn * vn
                elif victim in decodes:
                    decodes.remove(victim)
                    budget += 1
                    sum_ctx -= victim.computed_tokens + 1
                preempt(sim, victim, by_policy=False)
                if order is not running:
                    order.remove(victim)
                end -= 1
                step.memory_preempted = True
                if victim is req:
                    break
                if vi < i:
                    i -= 1
            else:
                sim.free_blocks -= need
                blocks[req.id] = held + need
            if req.status == "waiting":  # it was its own victim: running[i] is the next one
                continue
        if decode:
            decodes.append(req)
            sum_ctx += c + 1
        else:
            chunks[req] = n
            prefill += n
            prefill_sq += n * n
        budget -= n
        i += 1
    step.sum_kv_context = sum_ctx
    step.prefill_tokens, step.sum_prefill_sq = prefill, prefill_sq
    return budget

"""The engine's books and what moves them (docs/engine.md#preemption): the running batch in the
policy's running order, the KV blocks each running request holds and those free, the blocks and
tokens an admission takes, a request leaving the batch, and preemption by recompute — the
policy's preemptions for better-keyed waiting requests before a step is served, and serving the
running requests in running order when they contend, where a request short of a KV block preempts
the policy's memory victim. ``EngineBooks`` is the `Simulator`'s base: the simulator is these
books plus the loop that drives them (``sim.engine.simulator``), which calls each of the two
preemption passes at most once a step."""

from __future__ import annotations

from mypy_extensions import mypyc_attr

from scheduler.policies import Policy, PreemptivePolicy, RequestState
from scheduler.policies.preemption import plan_preemptions
from scheduler.policies.queue import WaitingQueue
from scheduler.settings import Settings
from sim.engine.config import EngineConfig
from sim.engine.step import StepPlan


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


# Serializable and open to Python subclasses, as the Simulator that extends it.
@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
class EngineBooks:
    """The books of one replica's engine (module docstring); the `Simulator` sets every one of
    them in its ``__init__``."""

    config: EngineConfig
    settings: Settings
    policy: Policy
    now: float
    waiting: WaitingQueue
    running: list[RequestState]
    # running[:_settled] is still in the order the policy last gave it (sort_running)
    _settled: int
    _running_sorted: bool  # set at the top of every step
    blocks: dict[str, int]  # KV blocks held per request id
    free_blocks: int
    preemptions: int
    policy_preemptions: int
    recomputed_tokens: int

    # --- sizes -------------------------------------------------------------------------------
    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.config.block_size)

    def admission_blocks(self, req: RequestState, chunk: int) -> int:
        """Free blocks a waiting request needs to be admitted with ``chunk`` tokens."""
        tokens = req.prompt_tokens + req.generated if self.config.reserve_full_sequence else chunk
        return self._blocks_for(max(tokens, chunk))

    def prefill_chunk(self, req: RequestState, budget: int) -> int:
        """The tokens ``req`` gets next out of ``budget``: the rest of its prefill, capped by the
        long-prefill threshold."""
        n = req.prompt_tokens + req.generated - req.computed_tokens  # remaining_prefill, inlined
        lpt = self.settings.engine.long_prefill_token_threshold
        if 0 < lpt < n:
            n = lpt
        return min(n, budget)

    # --- the running batch -------------------------------------------------------------------
    def leave_running(self, req: RequestState) -> None:
        """Take a finished or preempted request out of the running list."""
        i = self.running.index(req)
        del self.running[i]
        if i < self._settled:
            self._settled -= 1

    def sort_running(self, now: float) -> None:
        """Have the policy order the running list, once a step at most."""
        if not self._running_sorted:
            # running[:_settled] is in the order the policy gave it last (completions and
            # preemptions only removed from it); admissions since were appended after it.
            self.running = self.policy.reorder_running(self.running, self._settled, now)
            self._settled = len(self.running)
            self._running_sorted = True

    def check_books(self) -> None:
        """Raise AssertionError unless the KV blocks held and free add up to the capacity, every
        running request holds the blocks its computed tokens fill, and the waiting queue is in
        order (after every loop iteration with ``check_invariants``, and after ``recover``)."""
        held = sum(self.blocks.values())
        assert held + self.free_blocks == self.config.num_gpu_blocks, "KV block accounting broken"
        assert self.free_blocks >= 0, "KV blocks over capacity"
        bs = self.config.block_size
        for r in self.running:
            assert self.blocks.get(r.id, 0) >= -(-r.computed_tokens // bs), f"{r.id} lacks KV"
        self.waiting.check_order()

    # --- preemption by recompute -------------------------------------------------------------
    def preempt(self, req: RequestState, by_policy: bool, requeue: bool = True) -> None:
        """Preempt ``req`` by recompute: its KV blocks freed, its computed tokens dropped, and (with
        ``requeue``) back to the front of the waiting queue."""
        self.leave_running(req)
        self.free_blocks += self.blocks.pop(req.id, 0)
        self.recomputed_tokens += req.note_preemption(self.now, by_policy)
        req.computed_tokens = 0
        self.preemptions += 1
        self.policy_preemptions += by_policy
        if requeue:
            self._requeue(req, by_policy)

    def _requeue(self, req: RequestState, by_policy: bool) -> None:
        self.waiting.push(req, self.now, front=True)  # recompute: back to the front (stock order)
        self.policy.on_preempt(req, self.now, by_policy)

    def preempt_for_waiting(self, now: float) -> bool:
        """Preempt running requests for better-keyed waiting ones that cannot otherwise fit."""
        eng, policy = self.settings.engine, self.policy
        if not isinstance(policy, PreemptivePolicy):
            return False

        def ordered_running() -> list[RequestState]:
            self.sort_running(now)
            return self.running

        victims = plan_preemptions(
            policy,
            self.waiting.ordered(now),
            ordered_running,
            now=now,
            seats=eng.max_num_seqs - len(self.running),
            free_blocks=self.free_blocks,
            budget=eng.max_num_batched_tokens,
            chunk=self.prefill_chunk,
            blocks_needed=self.admission_blocks,
            held_blocks=lambda r: self.blocks.get(r.id, 0),
            max_seats=eng.max_num_seqs,
            total_blocks=self.config.num_gpu_blocks,
        )
        for victim in victims:
            self.preempt(victim, by_policy=True)
        return bool(victims)

    def serve_in_running_order(self, step: StepPlan) -> int:
        """Serve the running requests in running order, preempting on KV shortage
        (docs/engine.md#budget-order).

        Under ``decode_first`` the budget goes to decodes before prefill chunks (each group in
        running order), while the memory-pressure victim still comes from the running order."""
        policy, eng, running, blocks = self.policy, self.settings.engine, self.running, self.blocks
        budget = eng.max_num_batched_tokens
        bs, lpt = self.config.block_size, eng.long_prefill_token_threshold
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
                while need > self.free_blocks:
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
                    self.preempt(victim, by_policy=False)
                    if order is not running:
                        order.remove(victim)
                    end -= 1
                    step.memory_preempted = True
                    if victim is req:
                        break
                    if vi < i:
                        i -= 1
                else:
                    self.free_blocks -= need
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

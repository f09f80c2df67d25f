"""The engine's books and what moves them (docs/engine.md#preemption): the running batch in the
policy's running order, the KV blocks each running request holds and those free, the blocks and
tokens an admission takes, a request leaving the batch, and preemption by recompute — the
policy's preemptions for better-keyed waiting requests before a step is served, and serving the
running requests in running order when they contend, where a request short of a KV block preempts
the policy's memory victim. ``EngineBooks`` is the `Simulator`'s base: the simulator is these
books plus the loop that drives them (``sim.engine.simulator``), which calls each of the two
preemption passes at most once a step."""

from __future__ import annotations

from bisect import insort

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
    # vLLM's prefix cache as it serves preempted requests (docs/engine.md#prefix-cache). The free
    # blocks are vLLM's free queue: allocations take its head, freed blocks join its tail (a
    # request's last block first), and a full block keeps its hash until it is taken. Positions
    # count the blocks ever appended to the tail; nothing tracks single blocks. Only the books'
    # totals move on the hot paths: the head's position is worked out when a victim asks.
    _appended: int  # blocks ever appended to the free queue (the initial free blocks included)
    _hit_blocks: int  # blocks ever taken out of its middle by a cache hit
    _head: int  # the head's position when last worked out
    _head_popped: int  # blocks taken from the head up to _head
    _holes: list[tuple[int, int]]  # [start, end) positions taken by hits, at or past _head
    # a waiting victim -> (position of its last full block, its full blocks): block i of its
    # prefix sits at position + full − 1 − i, so the head takes its prefix from the end
    _cached: dict[str, tuple[int, int]]

    def init_free_queue(self) -> None:
        """Every block free and no hash kept: an empty engine."""
        self._appended = self.config.num_gpu_blocks
        self._hit_blocks = self._head = self._head_popped = 0
        self._holes = []
        self._cached = {}

    # --- sizes -------------------------------------------------------------------------------
    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.config.block_size)

    def admission_blocks(self, req: RequestState, chunk: int, cached: int = -1) -> int:
        """Free blocks a waiting request needs to be admitted with ``chunk`` tokens past the
        ``cached`` tokens it finds in the prefix cache (looked up when not given): the blocks it
        hits come out of the free queue too. With ``reserve_full_sequence`` its whole sequence
        must fit, hits included, as vLLM's admission gate counts it."""
        if cached < 0:
            cached = self.cached_tokens(req)
        tokens = cached + chunk
        if self.config.reserve_full_sequence:
            tokens = max(tokens, req.prompt_tokens + req.generated)
        return self._blocks_for(tokens)

    def prefill_chunk(self, req: RequestState, budget: int, cached: int = -1) -> int:
        """The tokens ``req`` gets next out of ``budget``: the rest of its prefill past the
        ``cached`` tokens a waiting request finds in the prefix cache (looked up when not given),
        capped by the long-prefill threshold."""
        if cached < 0:
            cached = self.cached_tokens(req)  # 0 for a running request: it has no entry
        # remaining_prefill, inlined
        n = req.prompt_tokens + req.generated - req.computed_tokens - cached
        lpt = self.settings.engine.long_prefill_token_threshold
        if 0 < lpt < n:
            n = lpt
        return min(n, budget)

    # --- the prefix cache ---------------------------------------------------------------------
    def _free_queue_head(self) -> int:
        """The free queue's head position now: as many blocks past the last one worked out as
        were taken from the head since, stepping over the holes hits left."""
        popped = self._appended - self._hit_blocks - self.free_blocks
        to_pop = popped - self._head_popped
        head, holes = self._head, self._holes
        while to_pop > 0:
            if holes and holes[0][0] < head + to_pop:
                start, end = holes.pop(0)
                to_pop -= start - head
                head = end
            else:
                head += to_pop
                to_pop = 0
        while holes and holes[0][0] <= head:  # a hole at the head: the head is past it
            head = max(head, holes.pop(0)[1])
        self._head, self._head_popped = head, popped
        return head

    def cached_tokens(self, req: RequestState) -> int:
        """Tokens of a waiting victim's prefix still in the prefix cache: its full blocks the
        free queue's head has not taken, capped, as vLLM's lookup is, one token short of its
        sequence (the last one is recomputed for its logits) in whole blocks."""
        if not self._cached:
            return 0
        entry = self._cached.get(req.id)
        if entry is None:
            return 0
        first, full = entry
        left = first + full - self._free_queue_head()
        if left <= 0:
            return 0
        bs = self.config.block_size
        hit_blocks = min(left, full, (req.prompt_tokens + req.generated - 1) // bs)
        return hit_blocks * bs

    def take_cached(self, req: RequestState, cached: int) -> None:
        """Admit ``req`` with its ``cached`` tokens found in the prefix cache: their blocks leave
        the free queue's middle (the caller counts them in the blocks it takes), they count as
        computed, and they are not recomputed after all."""
        first, full = self._cached.pop(req.id)
        if cached:
            hit_blocks = cached // self.config.block_size
            end = first + full
            insort(self._holes, (end - hit_blocks, end))
            self._hit_blocks += hit_blocks
            req.computed_tokens = cached
            req.recomputed_tokens -= cached
            self.recomputed_tokens -= cached

    def _free_to_queue(self, req_id: str, held: int, full: int) -> None:
        """Append a request's ``held`` blocks to the free queue's tail, last block first; the
        first ``full`` of them keep their hashes for ``req_id``'s readmission (0: it finished)."""
        full = min(full, held)
        if full and self.config.prefix_caching:
            # Blocks past its full ones (a partial block, or a reservation) go first, unhashed.
            self._cached[req_id] = (self._appended + held - full, full)
        self._appended += held

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
        popped = self._appended - self._hit_blocks - self.free_blocks
        assert popped >= self._head_popped, "free queue's head moved back"
        bs = self.config.block_size
        for r in self.running:
            assert self.blocks.get(r.id, 0) >= -(-r.computed_tokens // bs), f"{r.id} lacks KV"
        self.waiting.check_order()

    # --- preemption by recompute -------------------------------------------------------------
    def preempt(self, req: RequestState, by_policy: bool, requeue: bool = True) -> None:
        """Preempt ``req`` by recompute: its KV blocks freed, its computed tokens dropped, and (with
        ``requeue``) back to the front of the waiting queue."""
        self.leave_running(req)
        held = self.blocks.pop(req.id, 0)
        self.free_blocks += held
        full = req.computed_tokens // self.config.block_size if requeue else 0
        self._free_to_queue(req.id, held, full)
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

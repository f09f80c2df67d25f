"""Policy-driven preemption (docs/policies.md): which running requests to preempt for waiting ones.

Shared by the simulator and the vLLM plugin so the rule exists once. A running request R is
preempted for a waiting request W only when (a) W cannot be admitted otherwise (no free seat or
not enough free KV blocks), (b) W's key beats R's by the policy's margin, and (c) R is outside its
guard; the victim is the worst-keyed eligible running request. Only waiting requests that this
step's token budget can reach are considered.

Only a ``PreemptivePolicy`` preempts. It may spare work (``victim_margin``, ``preempts_for_seats``,
``preemptions_per_step``, ``preemption_utilisation_limit``): UniBoost can ask W to beat R by R's
recompute time, refuse to preempt when only a seat is short, cap the preemptions per step, and
preempt only while the batch is below a utilisation (seed 003: a recompute costs most when the
batch is full).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from scheduler.policies.base import PreemptivePolicy, RequestState


def preemption_allowed(
    policy: PreemptivePolicy, seats: int, max_seats: int, free_blocks: int, total_blocks: int
) -> bool:
    """Whether the batch is below the policy's utilisation limit, the larger of the seats and the
    KV blocks in use (``seats`` and ``free_blocks`` are what is free of ``max_seats`` and
    ``total_blocks``): policy preemption happens only then."""
    utilisation = max((max_seats - seats) / max_seats, 1.0 - free_blocks / max(total_blocks, 1))
    return utilisation < policy.preemption_utilisation_limit()


def plan_preemptions(
    policy: PreemptivePolicy,
    waiting: Sequence[RequestState],
    running: Callable[[], Sequence[RequestState]],
    *,
    now: float,
    seats: int,
    free_blocks: int,
    budget: int,
    chunk: Callable[[RequestState, int], int],
    blocks_needed: Callable[[RequestState, int], int],
    held_blocks: Callable[[RequestState], int],
    max_seats: int,
    total_blocks: int,
) -> list[RequestState]:
    """Victims, in the order to preempt them. ``running()`` gives the running requests in running
    order (best first); it is called only if a victim is needed, since ordering costs a sort.
    Nothing is mutated — the caller preempts the victims. ``seats`` and ``free_blocks`` are what is
    free of ``max_seats`` and ``total_blocks``."""
    if not waiting:
        return []
    if not preemption_allowed(policy, seats, max_seats, free_blocks, total_blocks):
        return []
    candidates: list[RequestState] | None = None
    victims: list[RequestState] = []
    cap = policy.preemptions_per_step() or float("inf")
    for_seats = policy.preempts_for_seats()
    for w in policy.admission_order(waiting, now):
        if budget <= 0:
            break  # admission cannot reach further down the queue this step
        n = chunk(w, budget)
        budget -= n
        need = blocks_needed(w, n)  # the engine's admission gate (first chunk, or whole sequence)
        if not for_seats and seats < 1 and need <= free_blocks:
            break  # only a seat is short: wait for one to free rather than throw KV away
        # Victims for w are only worth preempting if together they make w fit.
        mine: list[RequestState] = []
        seats_w, free_w = seats, free_blocks
        while seats_w < 1 or need > free_w:
            if len(victims) + len(mine) >= cap:
                break
            if candidates is None:
                candidates = list(running())
            others = [c for c in candidates if c not in mine] if mine else candidates
            victim = policy.policy_victim(w, others, now)
            if victim is None:
                break
            mine.append(victim)
            seats_w += 1
            free_w += held_blocks(victim)
        if seats_w < 1 or need > free_w:
            break
        for victim in mine:
            assert candidates is not None  # victims come from it
            candidates.remove(victim)
        victims += mine
        seats, free_blocks = seats_w - 1, free_w - need
    return victims

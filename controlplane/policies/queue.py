"""The waiting queue, kept in policy order incrementally.

Sorting every waiting request at every step costs O(n log n) per step, which near saturation
(thousands waiting) dominates both the simulator and vLLM's scheduling step. Every policy's
waiting keys are stable while a request waits, except when the policy moves to a new *epoch*
(γ or β changed, the predictor refitted, a starvation promotion). So the queue inserts with
bisect and re-sorts only when the epoch changes. Policies that do not reorder (sarathi) keep
vLLM's own order: arrivals at the back, preempted requests at the front.
"""

from __future__ import annotations

from bisect import insort
from typing import Iterable, Iterator

from controlplane.policies.base import Policy, RequestState


class WaitingQueue:
    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self._items: list[RequestState] = []
        self._epoch: int | None = None
        self._now = 0.0

    def set_policy(self, policy: Policy) -> None:
        """A settings switch: same requests, new order from the next step on."""
        self.policy = policy
        self._epoch = None

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def __iter__(self) -> Iterator[RequestState]:
        return iter(self._items)

    def _key(self, req: RequestState) -> tuple:
        return self.policy.key(req, self._now)

    def ordered(self, now: float) -> list[RequestState]:
        """The waiting requests in policy order (the list itself: do not mutate)."""
        policy = self.policy
        if not policy.reorders_waiting:
            return self._items
        self._now = now
        if self._epoch != policy.epoch:
            self._items.sort(key=policy.sort_key(now))
            self._epoch = policy.epoch
        elif policy.moved:
            # A few requests changed key (a starvation promotion): move just those.
            for req in policy.moved:
                if req.status == "waiting":
                    self._items.remove(req)
                    insort(self._items, req, key=self._key)
        policy.moved.clear()
        return self._items

    def push(self, req: RequestState, now: float, *, front: bool = False) -> None:
        """Add an arrival (``front=False``) or a preempted request (``front=True``)."""
        req.status = "waiting"
        if not self.policy.reorders_waiting:
            if front:
                self._items.insert(0, req)
            else:
                self._items.append(req)
            return
        self.ordered(now)  # bring the order up to date before bisecting into it
        self._now = now
        insort(self._items, req, key=self._key)

    def remove(self, admitted: Iterable[RequestState]) -> None:
        """Drop admitted requests; usually a prefix of the order, which is cheap."""
        admitted = list(admitted)
        if not admitted:
            return
        k = len(admitted)
        if all(a is b for a, b in zip(admitted, self._items[:k])):
            del self._items[:k]
        else:
            gone = {id(r) for r in admitted}
            self._items = [r for r in self._items if id(r) not in gone]

"""The waiting queue, kept in policy order incrementally.

Sorting every waiting request at every step costs O(n log n) per step, which near saturation
(thousands waiting) dominates both the simulator and vLLM's scheduling step. Every policy's
waiting keys are stable while a request waits, except when the policy moves to a new *epoch*
(γ or β changed, the predictor refitted, a starvation promotion). So the queue inserts with
bisect and re-sorts only when the epoch changes. Policies that do not reorder (sarathi) keep
vLLM's own order: arrivals at the back, preempted requests at the front.

Each request carries the key it was filed under (``RequestState.queue_key``), so a binary search
compares stored tuples instead of calling the policy's key function at every probe, and a request
whose key changed is found by bisecting for its old key rather than by scanning the queue.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from operator import attrgetter
from typing import Iterable, Iterator

from controlplane.policies.base import Policy, RequestState

_filed_key = attrgetter("queue_key")


class WaitingQueue:
    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self._items: list[RequestState] = []
        self._epoch: int | None = None

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

    def ordered(self, now: float) -> list[RequestState]:
        """The waiting requests in policy order (the list itself: do not mutate)."""
        policy = self.policy
        if not policy.reorders_waiting:
            return self._items
        if self._epoch != policy.epoch:
            items, key = self._items, policy.sort_key(now)
            for req in items:
                req.queue_key = key(req)
            items.sort(key=_filed_key)
            self._epoch = policy.epoch
        elif policy.moved:
            self._refile([req for req in policy.moved if req.status == "waiting"], now)
        policy.moved.clear()
        return self._items

    def _refile(self, moved: list[RequestState], now: float) -> None:
        """Move requests whose own key changed (a starvation promotion) to their new places.

        All of them leave first, found under the keys they were filed by, so every binary search
        runs over a list that is in order; then each is filed under its new key."""
        items, key = self._items, self.policy.key
        moved = list(dict.fromkeys(moved))  # a request promoted twice moves once
        for req in moved:
            i = bisect_left(items, req.queue_key, key=_filed_key)
            if i == len(items) or items[i] is not req:  # keys end in the id, so this is a bug
                raise AssertionError(f"waiting queue lost track of {req.id}")
            del items[i]
        for req in moved:
            req.queue_key = key(req, now)
            insort(items, req, key=_filed_key)

    def check_order(self) -> None:
        """Assert the queue is in the order of the keys its requests were filed by (for tests)."""
        if self.policy.reorders_waiting and self._epoch == self.policy.epoch:
            keys = [req.queue_key for req in self._items]
            assert all(a <= b for a, b in zip(keys, keys[1:])), "waiting queue out of policy order"

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
        req.queue_key = self.policy.key(req, now)
        insort(self._items, req, key=_filed_key)

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

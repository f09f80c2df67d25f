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

        They are taken out and re-inserted one at a time, and each binary search already sees the
        requests still to move under their new keys at their old places. That is how the queue
        has always re-filed them (when the key function was called at every probe); keep it, or
        orders (and simulation results) change in the rare case a search probes such a request."""
        items = self._items
        old_keys = [req.queue_key for req in moved]
        for req in moved:
            req.queue_key = self.policy.key(req, now)
        for req, old_key in zip(moved, old_keys):
            new_key, req.queue_key = req.queue_key, old_key  # find it where it was filed
            i = bisect_left(items, old_key, key=_filed_key)
            if i == len(items) or items[i] is not req:  # the search was misled (see above): scan
                i = items.index(req)
            del items[i]
            req.queue_key = new_key
            insort(items, req, key=_filed_key)

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

"""The waiting queue, kept in policy order incrementally.

Sorting every waiting request at every step costs O(n log n) per step, which near saturation
(thousands waiting) dominates both the simulator and vLLM's scheduling step. Every policy's
waiting keys are stable while a request waits, except when the policy moves to a new *epoch*
(γ or β changed, the predictor refitted) or one request's own key moves (a starvation promotion,
``Policy.moved``). Policies that do not reorder (sarathi) keep vLLM's own order: arrivals at the
back, preempted requests at the front.

Each request carries the key it was filed under (``RequestState.queue_key``), so a binary search
compares stored tuples instead of calling the policy's key function at every probe, and a request
whose key changed is found by bisecting for its old key rather than by scanning the queue.

Two layouts (``Policy.waiting_layout``):

* plain: one list in key order, inserted into by bisection and re-keyed and re-sorted when the
  epoch changes. Right when epochs are rare (fcfs, las, distboost, uniboost with γ fixed).
* grouped: with γ-Ada (a new epoch every few seconds), adaptive β or history refits, a deep
  queue re-keyed every epoch costs O(n) key calls per epoch (uniboost at 10,000 waiting: minutes
  per replay). But admission only ever reads the head of the order, and a policy's keys have
  structure: the requests of a *group* (``Policy.wait_group``: same work for uniboost, same
  prediction for sjf/srpt/tie, same tenant for vtc) are in arrival order in every epoch. So the
  queue keeps each group in (arrival, id) order and materializes the global order lazily: a
  *prefix* of the order (``_items``, usually the one or two requests admission looks at) is kept
  in key order, the rest stays in the groups and is merged on demand. A new epoch puts the prefix
  back into the groups and re-keys only what a merge needs: each group's head (a heap: sjf, srpt,
  tie, vtc), or, for uniboost's thousands of groups (one per prompt length), one vectorized pass
  over the groups' offsets that shortlists the head, whose exact key then decides
  (``"offsets"``; both in ``scheduler.policies.queue_groups``). ``ordered()`` returns a lazy
  sequence (``_Ordered``): index 0 and iteration pull from the groups as far as they are read.

Whatever the layout, the order is exactly the sort of the waiting requests by their keys
``(score, arrival, id)`` in the current epoch (``check_order``; tests/test_deep_queue.py).
"""

from __future__ import annotations

import itertools
from bisect import bisect_left, insort
from collections.abc import Hashable, Iterable, Iterator, Sequence
from operator import attrgetter
from typing import overload

from mypy_extensions import mypyc_attr

from scheduler.policies.base import Policy, RequestState
from scheduler.policies.queue_groups import Groups, make_index

_filed_key = attrgetter("queue_key")
_arrival_id = attrgetter("arrival", "id")
_PULL_ALL_AFTER = 64  # an iteration that reads this far materializes the whole order at once


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
class WaitingQueue:
    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self._items: list[RequestState] = []  # plain: every waiting request; grouped: the prefix
        self._epoch: int | None = None
        self._index: Groups | None = make_index(policy)
        self._n = 0  # grouped: requests waiting (prefix and groups)
        self._now = 0.0  # grouped: the time of the last ordered() (keys pulled later use it)
        self._view = _Ordered(self)
        # Who is waiting, kept apart from the ordered structures and updated before them: if a
        # policy raises half-way through filing or taking a request, ``reset`` rebuilds the queue
        # from this (the plugin's circuit breaker) instead of trusting a half-updated index.
        self._members: dict[str, RequestState] = {}

    def reset(self, policy: Policy) -> None:
        """Rebuild the queue for ``policy`` from its members alone, in (arrival, id) order: the
        circuit breaker's way back after a policy raised inside a queue operation."""
        self._refile_all(policy, sorted(self._members.values(), key=_arrival_id))

    def set_policy(self, policy: Policy) -> None:
        """A settings switch: same requests, new order from the next step on."""
        self._refile_all(policy, self.in_order())

    def _refile_all(self, policy: Policy, reqs: list[RequestState]) -> None:
        self.policy = policy
        self._index = make_index(policy)
        self._items[:] = reqs  # grouped: an unordered "prefix" that the next ordered() files
        for req in reqs:
            req.queue_prefix, req.queue_group = True, None
        self._n = len(reqs)
        self._epoch = None

    def __len__(self) -> int:
        return len(self._items) if self._index is None else self._n

    @property
    def _groups(self) -> Groups:
        """The grouped index (only called in a grouped layout)."""
        assert self._index is not None
        return self._index

    def __bool__(self) -> bool:
        return bool(self._items) if self._index is None else self._n > 0

    def __iter__(self) -> Iterator[RequestState]:
        """Every waiting request: in queue order for the plain layout; for a grouped one the
        materialized prefix, then the rest in no particular order (``in_order()`` for the order).
        A snapshot, taken without changing the queue (the plugin's control API reads it from
        its own thread)."""
        index = self._index
        if index is None:
            return iter(self._items)
        snapshot = list(self._items)
        for group in list(index.groups.values()):
            snapshot += group
        return iter(snapshot)

    def in_order(self) -> list[RequestState]:
        """Every waiting request in queue order, as filed (a grouped layout materializes it)."""
        if self._index is not None:
            self.ordered(self._now)
            self._pull_all()
        return list(self._items)

    def ordered(self, now: float) -> Sequence[RequestState]:
        """The waiting requests in policy order: the list itself for the plain layout (do not
        mutate), a lazy read-only sequence for a grouped one (read it before changing the queue)."""
        policy = self.policy
        index = self._index
        if index is None:
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
        self._now = now
        if policy.moved:  # a moved request may change group: refile it, whatever the epoch
            moved = [req for req in dict.fromkeys(policy.moved) if req.status == "waiting"]
            policy.moved.clear()
            if self._epoch == policy.epoch:
                for req in moved:
                    self._take(req)
                for req in moved:
                    self._file(req, now)
            else:
                for req in moved:
                    if not req.queue_prefix:  # the re-key below refiles the prefix
                        index.discard(req)
                        self._items.append(req)
                        req.queue_prefix = True
                    req.queue_group = None  # its group may have changed
        if self._epoch != policy.epoch:
            self._rekey(now)
        return self._view

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

    # --- grouped layouts ----------------------------------------------------------------------
    def _rekey(self, now: float) -> None:
        """A new epoch: the prefix goes back to its groups (it is their fronts) and the merge is
        rebuilt from the groups' heads."""
        index, items = self._groups, self._items
        for req in items:
            req.queue_prefix = False
            index.add(req, None, req.queue_group)
        items.clear()
        index.rekey(now)
        self._epoch = self.policy.epoch

    def _file(self, req: RequestState, now: float) -> None:
        """File a request under its current key: into the prefix if it sorts before the prefix's
        last request (the prefix stays the order's first requests), else into its group."""
        key = req.queue_key = self.policy.key(req, now)
        items = self._items
        if items and key < items[-1].queue_key:
            insort(items, req, key=_filed_key)
            req.queue_prefix, req.queue_group = True, None
        else:
            self._groups.add(req, key)

    def _take(self, req: RequestState) -> None:
        """Take a request out of the prefix or its group (not counted: the caller does)."""
        if req.queue_prefix:
            req.queue_prefix = False
            items = self._items
            i = bisect_left(items, req.queue_key, key=_filed_key)
            if i < len(items) and items[i] is req:
                del items[i]
            else:  # a prefix not filed yet (set_policy): found by identity
                items.remove(req)
        else:
            self._groups.discard(req)

    def _pull(self) -> bool:
        """Extend the prefix by the next request of the order; False when none is left."""
        req = self._groups.pop_min(self._now)
        if req is None:
            return False
        req.queue_prefix = True
        self._items.append(req)
        return True

    def _pull_all(self) -> None:
        """Materialize the whole order (a full iteration): every key once, one sort."""
        rest = self._groups.drain(self._now)
        for req in rest:
            req.queue_prefix = True
        self._items.extend(rest)

    def _by_group(self) -> dict[Hashable, list[RequestState]]:
        """Every waiting request in its group's list, in (arrival, id) order (vtc's tenants)."""
        items = self._items
        if items:
            for req in items:
                req.queue_prefix = False
                self._groups.add(req, req.queue_key, req.queue_group)
            items.clear()
        return self._groups.groups

    # --- changes ------------------------------------------------------------------------------
    def check_order(self) -> None:
        """Assert the queue is in policy order (for tests): plain, the keys it was filed by are
        in order; grouped, the prefix is in key order, every group in (arrival, id) order whose
        keys, freshly computed, are in order too and above the prefix's (so the merge yields the
        sort of all keys)."""
        policy = self.policy
        if self._index is None:
            if policy.reorders_waiting and self._epoch == policy.epoch:
                keys = [req.queue_key for req in self._items]
                assert all(a <= b for a, b in itertools.pairwise(keys)), (
                    "waiting queue out of policy order"
                )
            return
        if self._epoch != policy.epoch or policy.moved:
            return  # the next ordered() re-keys
        now, key = self._now, policy.key
        prefix = [key(req, now) for req in self._items]
        assert prefix == [req.queue_key for req in self._items], "stale key in the waiting prefix"
        assert all(a < b for a, b in itertools.pairwise(prefix)), (
            "waiting prefix out of policy order"
        )
        assert all(req.queue_prefix for req in self._items)
        count = len(self._items)
        for gid, group in self._groups.groups.items():
            assert group, f"empty group {gid!r}"
            assert all(
                policy.wait_group(req) == gid and req.queue_group == gid and not req.queue_prefix
                for req in group
            ), f"request filed in the wrong group {gid!r}"
            order = [_arrival_id(req) for req in group]
            assert all(a < b for a, b in itertools.pairwise(order)), (
                f"group {gid!r} out of arrival order"
            )
            keys = [key(req, now) for req in group]
            assert all(a < b for a, b in itertools.pairwise(keys)), (
                f"group {gid!r}: keys not in arrival order"
            )
            assert not prefix or prefix[-1] < keys[0], f"group {gid!r} sorts into the prefix"
            count += len(group)
        assert count == self._n, "waiting queue lost count"
        self._groups.check()

    def member(self, req_id: str) -> RequestState | None:
        """The waiting request ``req_id``, or None when it is not waiting."""
        return self._members.get(req_id)

    def push(self, req: RequestState, now: float, *, front: bool = False) -> None:
        """Add an arrival (``front=False``) or a preempted request (``front=True``)."""
        reorders = self.policy.reorders_waiting
        if reorders:
            # Bring the order up to date before bisecting into it — before ``req`` is a member:
            # a policy told of a preemption before the push (the plugin: vLLM requeues the
            # victim after) may have noted ``req`` as moved, and it is not filed yet.
            self.ordered(now)
        req.status = "waiting"
        self._members[req.id] = req
        if not reorders:
            if front:
                self._items.insert(0, req)
            else:
                self._items.append(req)
            return
        if self._index is not None:
            self._n += 1
            self._file(req, now)
            return
        req.queue_key = self.policy.key(req, now)
        insort(self._items, req, key=_filed_key)

    def remove(self, admitted: Iterable[RequestState]) -> None:
        """Drop admitted requests; usually a prefix of the order, which is cheap."""
        admitted = list(admitted)
        if not admitted:
            return
        members = self._members
        for req in admitted:
            members.pop(req.id, None)
        if self._index is not None:
            for req in admitted:
                self._take(req)
            self._n -= len(admitted)
            return
        k = len(admitted)
        if all(a is b for a, b in zip(admitted, self._items[:k])):
            del self._items[:k]
        else:
            gone = {id(r) for r in admitted}
            self._items = [r for r in self._items if id(r) not in gone]


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
class _Ordered(Sequence[RequestState]):
    """A grouped queue's order, read lazily: what is read is materialized in the prefix."""

    def __init__(self, queue: WaitingQueue) -> None:
        self._q = queue

    def __len__(self) -> int:
        return self._q._n

    def __bool__(self) -> bool:
        return self._q._n > 0

    def __iter__(self) -> Iterator[RequestState]:
        q = self._q
        items = q._items
        i = 0
        while True:
            if i < len(items):
                yield items[i]
                i += 1
            elif i >= _PULL_ALL_AFTER:
                q._pull_all()
                if i >= len(items):
                    return
            elif not q._pull():
                return

    @overload
    def __getitem__(self, i: int) -> RequestState: ...

    @overload
    def __getitem__(self, i: slice) -> list[RequestState]: ...

    def __getitem__(self, i: int | slice) -> RequestState | list[RequestState]:
        q = self._q
        if isinstance(i, slice) or i < 0:
            return list(self)[i]
        while len(q._items) <= i:
            if not q._pull():
                raise IndexError("waiting index out of range")
        return q._items[i]

    def by_group(self) -> dict[Hashable, list[RequestState]]:
        """Every waiting request by group, each list in (arrival, id) order. Read-only, and only
        until the queue changes."""
        return self._q._by_group()

"""The grouped waiting queue's index: the requests outside its materialized prefix, by group.

``scheduler.policies.queue`` explains the layouts. Within a group (``Policy.wait_group``) the
requests are kept in (arrival, id) order, which is the group's key order in every epoch, so the
next request of the whole order is always one of the groups' heads: ``Groups`` finds it with a
heap of the heads' keys (``"groups"``), ``OffsetGroups`` with one vectorized pass over
uniboost's per-group offsets (``"offsets"``).
"""

from __future__ import annotations

import itertools
from bisect import bisect_left
from collections.abc import Hashable, Iterator
from heapq import heapify, heappop, heappush
from operator import attrgetter
from typing import cast

import numpy as np
from mypy_extensions import mypyc_attr

from scheduler.policies.base import NO_KEY, Key, Policy, RequestState
from scheduler.policies.capabilities import ApproxOffsets

_filed_key = attrgetter("queue_key")
_arrival_id = attrgetter("arrival", "id")


def make_index(policy: Policy) -> Groups | None:
    """The index for ``policy``'s grouped waiting layout; None for the plain list."""
    layout_of = getattr(policy, "waiting_layout", None)  # a duck-typed policy keeps the plain list
    layout = layout_of() if layout_of is not None and policy.reorders_waiting else None
    if layout is None:
        return None
    if layout == "groups":
        return Groups(policy)
    if layout == "offsets":
        return OffsetGroups(policy)
    raise ValueError(f"policy {policy.name}: unknown waiting layout {layout!r}")


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
class Groups:
    """The requests of a grouped queue outside its prefix: per group, a list in (arrival, id)
    order, which is the group's key order in every epoch; across groups, a heap of the heads'
    keys (entries go stale when a head leaves and are skipped when they surface)."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.groups: dict[Hashable, list[RequestState]] = {}
        self._heap: list[tuple[Key, int, RequestState, Hashable]] = []  # (key, seq, head, group)
        self._seq = itertools.count()
        # Groups whose new head has no heap entry yet (no key at hand).
        self._dirty: list[Hashable] = []

    def members(self) -> Iterator[RequestState]:
        for group in self.groups.values():
            yield from group

    def add(self, req: RequestState, key: Key | None = None, gid: Hashable = None) -> None:
        """File ``req`` in its group (``gid`` if known, else ``wait_group``); ``key`` is its key in
        this epoch if known (a new head then enters the merge at once)."""
        if gid is None:
            gid = req.queue_group = self.policy.wait_group(req)
        group = self.groups.get(gid)
        if group is None:
            self.groups[gid] = [req]
            self._new_head(gid, req, key)
            return
        last = group[-1]
        if req.arrival > last.arrival or (req.arrival == last.arrival and req.id > last.id):
            group.append(req)  # the usual arrival: latest in its group
            return
        i = bisect_left(group, (req.arrival, req.id), key=_arrival_id)
        group.insert(i, req)
        if i == 0:
            self._new_head(gid, req, key)

    def discard(self, req: RequestState) -> None:
        gid = req.queue_group
        group = self.groups[gid]
        i = bisect_left(group, (req.arrival, req.id), key=_arrival_id)
        if i == len(group) or group[i] is not req:
            raise AssertionError(f"waiting queue lost track of {req.id}")
        del group[i]
        if not group:
            self._drop_group(gid)
        elif i == 0:
            self._new_head(gid, group[0], None)

    def _new_head(self, gid: Hashable, head: RequestState, key: Key | None) -> None:
        if key is None:
            self._dirty.append(gid)
        else:
            heappush(self._heap, (key, next(self._seq), head, gid))

    def _drop_group(self, gid: Hashable) -> None:
        del self.groups[gid]
        if not self.groups:
            # Every entry left is stale (no group holds its head): drop them rather than carry
            # them (and the requests they hold) into every copy of the queue — a shadow's fork
            # pickled thousands of them, 50 ms a copy of a slofq shadow.
            self._heap.clear()

    def rekey(self, now: float) -> None:
        """A new epoch: key every group's head afresh."""
        key, seq = self.policy.key, self._seq
        heap: list[tuple[Key, int, RequestState, Hashable]] = []
        for gid, group in self.groups.items():
            head = group[0]
            k = head.queue_key = key(head, now)
            heap.append((k, next(seq), head, gid))
        heapify(heap)
        self._heap = heap
        self._dirty.clear()

    def _flush_dirty(self, now: float) -> None:
        key, groups = self.policy.key, self.groups
        for gid in self._dirty:
            group = groups.get(gid)
            if group:
                head = group[0]
                k = head.queue_key = key(head, now)
                heappush(self._heap, (k, next(self._seq), head, gid))
        self._dirty.clear()

    def pop_min(self, now: float) -> RequestState | None:
        """Take the request with the least key out of its group (its queue_key set)."""
        if self._dirty:
            self._flush_dirty(now)
        heap, groups = self._heap, self.groups
        while heap:
            k, _, head, gid = heappop(heap)
            group = groups.get(gid)
            if group is None or group[0] is not head or head.queue_key != k:
                continue  # stale: that head left, or a newer entry holds its key
            del group[0]
            if group:
                nxt = group[0]
                nk = nxt.queue_key = self.policy.key(nxt, now)
                heappush(heap, (nk, next(self._seq), nxt, gid))
            else:
                self._drop_group(gid)
            return head
        return None

    def drain(self, now: float) -> list[RequestState]:
        """Every request, out of the groups, in key order (each keyed once)."""
        key = self.policy.key
        out: list[RequestState] = []
        for group in self.groups.values():
            for req in group:
                req.queue_key = key(req, now)
            out += group
        out.sort(key=_filed_key)
        self.groups.clear()
        self._heap.clear()
        self._dirty.clear()
        return out

    def check(self) -> None:
        pass


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
class OffsetGroups(Groups):
    """uniboost's groups: one per work value w (``wait_group``), score = arrival − b_γ(w).

    A group per distinct prompt length means thousands of groups, too many to re-key on every γ
    change. Instead each group has a slot in three arrays (head arrival, w, offset) and the head
    of the order is found by one vectorized pass: approximate keys ``arrival − approx_offsets(w)``
    (``ApproxOffsets``; numpy, within 2⁻⁴⁰ relative of the exact float keys), then the exact keys
    (``Policy.key``) of the heads whose approximate key is within twice that error of the least
    decide. A new epoch recomputes the offsets array, nothing per request."""

    # Error bound of an approximate key relative to |arrival| + |offset|: numpy's log/expm1 and
    # the C library's differ by a few ulps (2⁻⁵⁰); this leaves 2⁶ of margin.
    _REL = 2.0**-44
    _SCAN = 24  # up to this many groups, comparing the heads' exact keys is cheaper than numpy

    def __init__(self, policy: Policy) -> None:
        super().__init__(policy)
        self._offsets = cast(ApproxOffsets, policy)  # its layout says it is one
        self._slot: dict[Hashable, int] = {}
        self._gids: list[Hashable] = []  # slot -> group (None: free)
        self._free: list[int] = []
        self._arrival = np.full(16, np.inf)  # head arrival per slot, inf when free
        self._value = np.ones(16)  # group value (w) per slot
        self._offset = np.zeros(16)  # approx offset per slot, this epoch
        self._approx = np.full(16, np.inf)  # arrival − offset per slot, kept up to date
        self._all_stale = True  # a new epoch: no offset computed yet
        self._stale: list[int] = []  # new slots whose offset is not computed yet
        self._amax = 0.0  # bound on |arrival| of every head seen
        self._omax = 0.0  # bound on |offset| of every slot this epoch

    def _set_head(self, slot: int, arrival: float) -> None:
        self._arrival[slot] = arrival
        self._approx[slot] = arrival - self._offset[slot]  # fixed by _refresh if stale
        if abs(arrival) > self._amax:
            self._amax = abs(arrival)

    def _new_head(self, gid: Hashable, head: RequestState, key: Key | None) -> None:
        slot = self._slot.get(gid)
        if slot is None:
            slot = self._free.pop() if self._free else self._grow()
            self._slot[gid] = slot
            self._gids[slot] = gid
            self._value[slot] = cast(float, gid)  # the offsets layout's groups are floats (w)
            self._stale.append(slot)
        self._set_head(slot, head.arrival)

    def _grow(self) -> int:
        slot = len(self._gids)
        self._gids.append(None)
        if slot == len(self._arrival):
            n = len(self._arrival)
            self._arrival = np.concatenate([self._arrival, np.full(n, np.inf)])
            self._value = np.concatenate([self._value, np.ones(n)])
            self._offset = np.concatenate([self._offset, np.zeros(n)])
            self._approx = np.concatenate([self._approx, np.full(n, np.inf)])
        return slot

    def _drop_group(self, gid: Hashable) -> None:
        del self.groups[gid]
        slot = self._slot.pop(gid)
        self._gids[slot] = None
        self._arrival[slot] = np.inf
        self._approx[slot] = np.inf
        self._free.append(slot)

    def rekey(self, now: float) -> None:
        # The offsets are computed when a merge needs them (_refresh): a shallow queue never does.
        self._all_stale = True
        self._stale.clear()
        self._omax = 0.0

    def _refresh(self) -> None:
        if self._all_stale:  # a new epoch: every slot
            self._offset = offsets = self._offsets.approx_offsets(self._value)
            self._approx = self._arrival - offsets
            self._all_stale = False
        else:
            stale = np.array(self._stale, dtype=np.intp)
            offsets = self._offsets.approx_offsets(self._value[stale])
            self._offset[stale] = offsets
            self._approx[stale] = self._arrival[stale] - offsets
        self._stale.clear()
        if len(offsets):
            self._omax = max(self._omax, float(np.abs(offsets).max()))

    def pop_min(self, now: float) -> RequestState | None:
        groups = self.groups
        if not groups:
            return None
        key = self.policy.key
        best: RequestState | None = None
        best_key: Key = NO_KEY
        best_gid: Hashable = None
        if len(groups) <= self._SCAN:  # a shallow queue: the exact keys of the heads, no numpy
            for gid, group in groups.items():
                head = group[0]
                k = key(head, now)
                if best is None or k < best_key:
                    best, best_key, best_gid = head, k, gid
        else:
            if self._all_stale or self._stale:
                self._refresh()
            approx = self._approx
            # The ufunc and the array method themselves: ndarray.min and np.flatnonzero go
            # through numpy's Python wrappers (a pop a step: 3% of a deep-queue replay, perf).
            least = np.minimum.reduce(approx)
            tol = 2.0 * self._REL * (self._amax + self._omax) + 1e-290
            shortlist = (approx <= least + tol).nonzero()[0]
            gids = self._gids
            for slot in shortlist.tolist():
                gid = gids[slot]
                head = groups[gid][0]
                k = key(head, now)
                if best is None or k < best_key:
                    best, best_key, best_gid = head, k, gid
        assert best is not None  # groups is not empty
        best.queue_key = best_key
        group = groups[best_gid]
        del group[0]
        if group:
            self._set_head(self._slot[best_gid], group[0].arrival)
        else:
            self._drop_group(best_gid)
        return best

    def drain(self, now: float) -> list[RequestState]:
        out = super().drain(now)
        self._slot.clear()
        self._gids.clear()
        self._free.clear()
        self._arrival[:] = np.inf
        self._approx[:] = np.inf
        self._stale.clear()
        return out

    def check(self) -> None:
        for gid, group in self.groups.items():
            slot = self._slot[gid]
            assert self._gids[slot] == gid and self._arrival[slot] == group[0].arrival, (
                f"slot of {gid!r}"
            )
            if not self._all_stale and slot not in self._stale:
                assert self._approx[slot] == self._arrival[slot] - self._offset[slot], (
                    f"approx of {gid!r}"
                )
        assert len(self._slot) == len(self.groups)
        assert np.isinf(self._approx[[i for i, g in enumerate(self._gids) if g is None]]).all()

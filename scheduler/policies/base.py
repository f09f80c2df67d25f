"""What every policy sees and does.

A policy changes three things only (docs/engine.md#scheduling-step): the order of the waiting
queue, the order of the running list (which fixes budget priority and the memory-pressure
victim), and whether a running request may be preempted for a waiting one. Everything else —
token budget, KV blocks, chunked prefill — belongs to the engine (vLLM, or the simulator in
``sim.engine``), which calls the hooks below. The same classes run in both; nothing here imports
vLLM.

Every ordering key is ``(score, arrival, id)``: lower is served first, and ties break on
arrival then id so every run is deterministic.
"""

from __future__ import annotations

import itertools
import math
from abc import abstractmethod
from bisect import insort
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, ClassVar, Protocol

import numpy as np
from mypy_extensions import mypyc_attr
from pydantic import BaseModel

from scheduler.names import DEFAULT_TENANT, DEFAULT_TYPE
from scheduler.policies.predictors import HistoryPredictor, LengthPredictor
from scheduler.settings import Settings

INF = math.inf
_epochs = itertools.count()

#: A policy's ordering key ``(score, arrival, id)``: lower is served first.
Key = tuple[float, float, str]
#: What ``RequestState.key_value`` and ``queue_key`` hold before a policy or the waiting queue
#: sets them: a key after every real one. A cached key is read only while ``score_epoch`` names
#: the policy's epoch (-1 names none); the queue finds a request it has not filed by identity.
NO_KEY: Key = (INF, INF, "")
#: A key function over requests, as ``sorted`` and ``insort`` take it.
SortKey = Callable[["RequestState"], Key]
#: A running-order key function: ``Key``, or a tuple that refines it (MemGuard's guard flag,
#: slofq's throttled flag), compared as a tuple.
RunningSortKey = Callable[["RequestState"], tuple[object, ...]]


def new_epoch() -> int:
    """A process-unique number: bump a policy's epoch whenever all its scores change (γ moved)."""
    return next(_epochs)


arrival_order = attrgetter("arrival", "id")


# Every class of the library is so marked for the compiled core (scheduler.compiled): it pickles
# (the autopilot forks a shadow by pickling it) and Python code may subclass it.
@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
@dataclass(slots=True, eq=False)
class RequestState:
    """One request as the scheduler tracks it (docs/engine.md#requests)."""

    id: str
    arrival: float
    prompt_tokens: int
    max_tokens: int
    tenant: str = DEFAULT_TENANT
    type: str = DEFAULT_TYPE
    # True output length: the simulator knows it, a policy never reads it (the oracle
    # predictor, which exists for comparison only, is the one exception).
    output_tokens: int | None = None

    status: str = "new"  # new | waiting | leaving | running | finished (kept by the engine)
    computed_tokens: int = 0  # prefix whose KV exists
    generated: int = 0  # output tokens so far
    attained: int = 0  # service received: prompt tokens prefilled (high-water) + generated
    preemptions: int = 0
    policy_preemptions: int = 0
    recomputed_tokens: int = 0  # tokens whose KV was thrown away by preemptions
    received_at: float | None = (
        None  # when the engine core received it (arrival is the API server's)
    )
    enqueued_at: float = 0.0  # when it last entered the waiting queue
    scheduled_at: float | None = None  # first admission
    first_token_at: float | None = None
    finished_at: float | None = None

    # Policy bookkeeping (kept here so a request carries its own state across policy switches).
    unscheduled_steps: int = 0  # sjf: consecutive steps without service
    quantum_left: int = 0  # sjf: steps of starvation priority left
    guard_tokens: int = 0  # uniboost MemGuard: not policy-preemptible before attained reaches this
    las_base: int = 0  # las: attained tokens at the last starvation promotion
    overdue: bool = False  # uniboost: waited past the hold-back bound (hold_bound_s)
    readmit_first: bool = False  # uniboost victims_first: preempted for KV, not readmitted yet
    cache_key: Any = None  # policies cache per-request derived values (predictions) here
    # The value cache_key names, whose type the key's tag fixes (size.predicted_total: a float;
    # Tie.moments: a pair or None): each reader narrows it where it reads its own tag.
    cache_value: Any = None
    # Score cache: valid while the policy's epoch is unchanged and attained < score_until.
    score_epoch: int = -1
    score_until: int = 0
    score_value: float = 0.0
    key_value: Key = NO_KEY  # (score_value, arrival, id), cached alongside
    queue_key: Key = NO_KEY  # the key the waiting queue filed it under (scheduler.policies.queue)
    queue_group: Hashable = None  # grouped layouts: its group (None: not known under this policy)
    queue_prefix: bool = False  # grouped layouts: in the queue's materialized prefix
    # sjf in the simulator counts waiting steps lazily (Sjf.on_waiting_steps): while the request
    # waits, its unscheduled steps are the policy's step clock minus wait_mark; wait_seq names
    # the wait (a request can wait several times).
    wait_mark: int = 0
    wait_seq: int = -1
    # The key that placed it in the running order (Policy.reorder_running; a policy's own shape).
    running_key: tuple[object, ...] = ()

    @property
    def total_tokens(self) -> int:
        """Tokens whose KV must exist before the next token can be sampled."""
        return self.prompt_tokens + self.generated

    @property
    def remaining_prefill(self) -> int:
        return self.total_tokens - self.computed_tokens

    @property
    def in_decode(self) -> bool:
        return self.generated > 0 and self.computed_tokens == self.total_tokens - 1

    def note_preemption(self, now: float, by_policy: bool) -> int:
        """Count a recompute preemption; returns the tokens of KV it threw away. The caller frees
        the blocks and resets ``computed_tokens`` (vLLM does that itself on a live replica)."""
        wasted = self.computed_tokens
        self.recomputed_tokens += wasted
        self.preemptions += 1
        if by_policy:
            self.policy_preemptions += 1
        self.enqueued_at = now
        return wasted

    def note_progress(self) -> None:
        """Update attained service after computed/generated moved (never counts recomputation)."""
        done = min(self.computed_tokens, self.prompt_tokens) + self.generated
        if done > self.attained:
            self.attained = done


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
@dataclass(slots=True)
class EngineView:
    """What a policy may know about the engine it runs in."""

    max_num_seqs: int


class OrderedWaiting(Protocol):
    """The waiting queue as a policy reads it at the top of a step (``Policy.before_step``): how
    many wait, and their order. The simulator passes its ``scheduler.policies.queue.WaitingQueue``
    (whose groups a policy may keep), vLLM's plugin the ordered requests themselves."""

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[RequestState]: ...

    def ordered(self, now: float) -> Sequence[RequestState]: ...


# Not an ``ABC``: the abstract methods are enforced by the type checker. mypyc compiles this
# library, and a compiled class that pickles (``serializable``: the autopilot forks shadows by
# pickling) under ABC's metaclass never runs its ``__init__``.
@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
class Policy:
    """A scheduling policy: what the simulator's engine and the vLLM plugin ask of every policy.

    One method is a policy's own: :meth:`score` (its order; ties break on arrival, then id).
    Everything else has a default a policy overrides where it differs — the running order, the
    admission order, the memory-pressure victim (the last running), the engine's events, event
    skipping's bounds, the waiting queue's layout, live state. Policy-driven preemption is a
    capability of its own, :class:`PreemptivePolicy`: an engine preempts for a better-keyed
    waiting request only under a policy that is one (``isinstance``); so are the hooks only some
    policies want — every token (:class:`ChargesTokens`), every step's service
    (:class:`CountsSteps`), a clock (:class:`Ticks`), turning an arrival away
    (:class:`RefusesArrivals`) — each behind a flag an engine tests before it calls: a class
    attribute, where a call on every step's path to a hook that does nothing was not free."""

    name: ClassVar[str] = "base"
    # True on PreemptivePolicy (below) and so on every policy that is one: the engines' per-step
    # test, cheaper than isinstance on an abstract class.
    preemptive: ClassVar[bool] = False
    reorders_running: ClassVar[bool] = True  # sarathi keeps vLLM's running order untouched
    reorders_waiting: ClassVar[bool] = True
    # The optional capabilities (scheduler.policies.capabilities: ChargesTokens, CountsSteps,
    # Ticks): set by a policy that is one.
    charges_tokens: ClassVar[bool] = False  # wants on_tokens (vtc, slofq)
    counts_steps: ClassVar[bool] = False  # wants on_steps (sjf's starvation counters, slofq)
    ticks: ClassVar[bool] = False  # adapts on a clock: next_tick / tick (γ-Ada, slofq's control)
    # May hold waiting requests back (backpressure): admission_order then yields none of them,
    # and an engine with nothing else to do waits for next_tick instead of stalling.
    gates_admission: ClassVar[bool] = False
    # Running decodes take the step's budget before prefill chunks, whatever their keys; the
    # running order still fixes the prefill order and the memory-pressure victim.
    decode_first = False
    # Set when ``order_running`` already puts every decode before every prefill chunk: the
    # simulator then serves the running list as it stands instead of partitioning it again.
    running_order_is_budget_order = False
    # Set by a policy whose running order is plain key order (``order_running`` not overridden)
    # and whose ``key`` caches every key it computes (``cache_key``): ``reorder_running`` can then
    # keep the running list in order by moving only the requests whose key changed.
    incremental_running_order = False
    # Set by a policy whose waiting keys depend on a request only through its arrival and its
    # prediction (the predictor's inputs and max_tokens), so that the waiting queue may group them
    # (``wait_group``): sjf and srpt refine the default group (starvation; tokens generated) in
    # scheduler.policies.size; tie's key (scheduler.policies.tie) is ``ln(E + β·CVaR) − (arrival −
    # t_ref)·ln(decay)/τ`` with (E, CVaR) a function of the predicted distribution, max_tokens,
    # alpha and nu.
    keys_by_prediction: ClassVar[bool] = False
    # The settings document's params model; each policy narrows it to its own (UniBoostParams...).
    params: BaseModel

    def __init__(self, settings: Settings, predictor: LengthPredictor | None = None) -> None:
        self.settings = settings
        self.params = settings.params
        self.predictor = predictor
        self.view = EngineView(max_num_seqs=settings.engine.max_num_seqs)
        # Waiting keys are stable within an epoch; a new epoch makes the queue re-sort.
        self.epoch = new_epoch()
        self.moved: list[RequestState] = []  # waiting requests whose own key changed (re-insert)
        self._predictor_version = getattr(predictor, "version", 0)
        self.prediction_group = prediction_group_fn(predictor) if self.keys_by_prediction else None

    # --- ordering -------------------------------------------------------------------------
    @abstractmethod
    def score(self, req: RequestState, now: float) -> float:
        """The request's place in this policy's order at ``now``: lower goes first."""

    def key(self, req: RequestState, now: float) -> Key:
        return (self.score(req, now), req.arrival, req.id)

    def cached_key(self, req: RequestState) -> Key | None:
        """The request's cached key if still valid (same epoch, attained below its bound)."""
        if req.score_epoch == self.epoch and req.attained < req.score_until:
            return req.key_value
        return None

    def cache_key(self, req: RequestState, score: float, until: int) -> Key:
        req.score_epoch, req.score_until, req.score_value = self.epoch, until, score
        req.key_value = key = (score, req.arrival, req.id)
        return key

    def sort_key(self, now: float) -> SortKey:
        """A key function for sorting: the cached key when valid, inline (this runs per request
        per step), else ``key``."""
        epoch, key = self.epoch, self.key

        def fast(r: RequestState) -> Key:
            if r.score_epoch == epoch and r.attained < r.score_until:
                return r.key_value
            return key(r, now)

        return fast

    def order_running(self, running: Sequence[RequestState], now: float) -> list[RequestState]:
        if not self.reorders_running:
            return list(running)
        return sorted(running, key=self.sort_key(now))

    def running_sort_key(self, now: float) -> RunningSortKey:
        """The key function ``order_running`` sorts by (``reorder_running`` inserts by it)."""
        return self.sort_key(now)

    def reorder_running(
        self, running: list[RequestState], settled: int, now: float
    ) -> list[RequestState]:
        """``order_running`` for a list whose first ``settled`` requests are in the order this
        method returned last time (though their keys may have changed since) and whose other
        requests are new (just admitted).

        Near saturation only a few running keys change from one step to the next (LAS: a level
        crossing), yet sorting the nearly sorted list would still cost O(n log n) comparisons of
        keys. With ``incremental_running_order`` the new requests and those whose key changed are
        taken out and put back by binary search; the result is the same list ``order_running``
        returns, since keys are unique (they end in the request id). An implementation may
        reorder ``running`` in place and return it: the engine keeps what it returns."""
        if not self.incremental_running_order:
            return self.order_running(running, now)
        epoch = self.epoch
        head = list(running[:settled])
        # A request keeps its place while its cached key is valid and is the key it was placed by.
        moved = [
            r
            for r in head
            if not (
                r.score_epoch == epoch
                and r.attained < r.score_until
                and r.key_value is r.running_key
            )
        ]
        stale = len(moved)
        moved += running[settled:]
        if 8 * len(moved) > len(running):  # many (a new epoch, a first call): sort them all
            head = self.order_running(running, now)
            for r in head:
                r.running_key = r.key_value
            return head
        for r in moved[:stale]:
            head.remove(r)
        key = self.running_sort_key(now)
        for r in moved:
            insort(head, r, key=key)
            r.running_key = r.key_value
        return head

    def admission_order(
        self, waiting: Sequence[RequestState], now: float
    ) -> Iterator[RequestState]:
        """Waiting requests (already in queue order) in the order admission should try them;
        VTC re-picks the tenant after each admission."""
        return iter(waiting)

    # --- how the waiting queue keeps this order (scheduler.policies.queue) ----------------
    def waiting_layout(self) -> str | None:
        """How the waiting queue keeps this policy's order when a new epoch re-keys it:

        * ``None``: one list in key order, re-keyed and re-sorted on a new epoch (right when
          epochs are rare or never come: fcfs, las, distboost, uniboost with γ fixed);
        * ``"groups"``: ``wait_group(req)`` names a group inside which keys run in (arrival, id)
          order in every epoch, and a waiting request stays in its group until its own key moves
          (``moved``). The queue keeps each group in arrival order and merges the groups by their
          heads' keys, so a new epoch re-keys only the heads (one per group);
        * ``"offsets"``: ``"groups"`` whose score is ``arrival − offset(wait_group(req))`` (a float
          group value), the policy an ``ApproxOffsets`` (``scheduler.policies.capabilities``)
          computing the offsets of an array of group values to within a few ulps (numpy; the
          queue allows 2⁻⁴³ of |arrival| + |offset|): the queue
          shortlists the head by one vectorized pass over the groups and compares exact keys only
          on the shortlist (thousands of groups, one per prompt length: uniboost with γ-Ada).

        Predicted-length policies (sjf, srpt, tie) group by what their predictor's prediction
        depends on when that is known (``prediction_group``); with a per-request prediction
        (the oracle) a group would hold one request, and the plain list is kept."""
        return "groups" if self.prediction_group is not None else None

    def wait_group(self, req: RequestState) -> Hashable:
        """The request's group under ``waiting_layout`` (see there); only called for a grouped
        layout.

        Default (``keys_by_prediction`` policies): a key that depends on the request only through
        its arrival, its prediction and ``max_tokens``; the prediction is fixed by the predictor's
        inputs (``prediction_group_fn``)."""
        # A grouped layout only for keys_by_prediction policies.
        assert self.prediction_group is not None
        return (self.prediction_group(req), req.max_tokens)

    def before_step(self, waiting: Sequence[RequestState] | OrderedWaiting, now: float) -> None:
        """Refresh adaptive state at the top of a step: ``waiting`` is the waiting requests in
        queue order, or (the simulator) the waiting queue itself, whose ``ordered`` gives them."""
        # Not getattr(predictor, "version", 0): with no predictor it raises and formats an
        # AttributeError on every step (2.6% of a uniboost replay, perf).
        predictor = self.predictor
        version = predictor.version if predictor is not None else 0
        if version != self._predictor_version:  # the predictor refitted: every prediction moved
            self._predictor_version = version
            self.epoch = new_epoch()

    # --- memory pressure -------------------------------------------------------------------
    def memory_victim(self, running: Sequence[RequestState]) -> RequestState:
        """Victim when a running request cannot get a KV block; ``running`` is in running order."""
        return running[-1]

    # --- events from the engine -----------------------------------------------------------
    # Whether this policy (a RefusesArrivals, below) may turn an arrival away under its settings
    # now (engines skip asking otherwise: it is on every arrival's path).
    refuses = False

    def on_arrival(self, req: RequestState, now: float) -> None:
        pass

    def on_admit(self, req: RequestState, now: float, prefill_tokens: int) -> None:
        pass

    def on_preempt(self, req: RequestState, now: float, by_policy: bool) -> None:
        pass

    def on_finish(self, req: RequestState, now: float) -> None:
        pass

    def detach(self, waiting: Iterable[RequestState]) -> None:
        """The engine is switching away from this policy: write back any state kept lazily."""

    # --- event skipping -------------------------------------------------------------------
    def next_time_event(self, waiting: Sequence[RequestState], now: float) -> float:
        """Earliest time at which the waiting order may change by itself (starvation), or INF."""
        return INF

    def steady_steps(
        self,
        running: Sequence[RequestState],
        waiting: Sequence[RequestState],
        now: float,
        kv_blocked: bool,
        can_preempt: bool = True,
    ) -> float:
        """How many more pure-decode steps keep every decision of this step the same.

        Called only when nothing was admitted or preempted this step and every running request
        decoded one token. Must be conservative: too small only costs speed. ``kv_blocked`` says
        admission stopped on KV blocks (so a change in waiting order could unblock it);
        ``can_preempt`` False says no policy preemption can happen before the stretch ends (the
        engine's judgement: see ``sim.engine.simulator.Simulator._steady_steps``), so a bound
        that only waits for a preemption to become possible need not hold the stretch.
        """
        return INF

    def attach(
        self, waiting: Sequence[RequestState], running: Sequence[RequestState], now: float
    ) -> None:
        """Take over a live replica's queues after a settings switch (rebuild derived state)."""

    # --- live state -----------------------------------------------------------------------
    def live_state(self) -> dict[str, Any]:
        """Adaptive values for the control API (γ, β)."""
        return {}

    def adopt_live_state(self, previous: Policy) -> None:
        """Carry adaptive state across a settings switch of the same policy (unless pinned)."""


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
class PreemptivePolicy(Policy):
    """The capability of policy-driven preemption (srpt, las, uniboost, slofq): before a step,
    the engine preempts running requests for better-keyed waiting ones that cannot otherwise get
    a seat or KV blocks (``scheduler.policies.preemption.plan_preemptions``), within the guards
    below."""

    preemptive = True

    def policy_preemptible(self, req: RequestState) -> bool:
        """Outside its guard (MemGuard, TRAIL limit): may be preempted by policy."""
        return True

    def policy_victim(
        self, waiting_req: RequestState, running: Sequence[RequestState], now: float
    ) -> RequestState | None:
        """The running request to preempt so ``waiting_req`` can be admitted, or None.

        ``running`` is in running order (best first), so the worst eligible is found from the end.
        """
        cand = self.worst_preemptible(running, now)
        if cand is None:
            return None
        w_key, r_key, margin = (
            self.key(waiting_req, now),
            self.key(cand, now),
            self.victim_margin(cand),
        )
        better = (w_key < r_key) if margin == 0 else (w_key[0] + margin < r_key[0])
        return cand if better else None

    def worst_preemptible(self, running: Sequence[RequestState], now: float) -> RequestState | None:
        """The request policy preemption would take first: the last one outside its guard in
        running order (best first)."""
        for cand in reversed(running):
            if self.policy_preemptible(cand):
                return cand
        return None

    def preemption_utilisation_limit(self) -> float:
        """Policy preemption only while the batch's utilisation is below this (inf: always)."""
        return INF

    def preempt_margin(self) -> float:
        margin: float = getattr(self.params, "preempt_margin", 0.0)  # preemptive policies' params
        return margin

    def victim_margin(self, victim: RequestState) -> float:
        """How far (score units) a waiting request must beat ``victim`` to preempt it."""
        return self.preempt_margin()

    def preempts_for_seats(self) -> bool:
        """Whether a missing sequence slot alone (KV has room) justifies a preemption."""
        return True

    def preemptions_per_step(self) -> int:
        """The most policy preemptions in one step (0: no limit)."""
        return 0


def prediction_group_fn(
    predictor: LengthPredictor | None,
) -> Callable[[RequestState], Hashable] | None:
    """A function naming what ``predictor``'s predictions for a request depend on (besides
    ``max_tokens``, which caps them), or None when each request gets its own (the oracle).

    The history predictor predicts from the finest fitted key of (tenant, type, prompt bucket),
    falling back to coarser keys of the same request: the finest key fixes the prediction."""
    if type(predictor) is HistoryPredictor:
        return _finest_history_key
    return None


def _finest_history_key(req: RequestState) -> Hashable:
    """The history predictor's finest key of ``req`` (a module function, not a closure: a policy
    holding it is copied by pickling — the autopilot's shadow forks)."""
    return HistoryPredictor.keys_for(req)[0]


def boost(w: float, gamma: float) -> float:
    """γ-Boost b_γ(w) = -ln(1 - e^{-γw})/γ, stable via expm1; w ≤ 0 gets the cap
    (docs/policies.md#uniboost)."""
    x = gamma * w
    if x <= 0.0:
        return 1e9
    if x > 700.0:  # e^{-x} underflows; -ln(1-ε) ≈ ε
        return math.exp(-x) / gamma
    return -math.log(-math.expm1(-x)) / gamma


def quantize(tokens: int, base: int, ratio: float) -> float:
    """MemGuard's geometric bucket: base·ratio^⌊log_ratio(tokens/base)⌋, or 0 below base."""
    if tokens < base:
        return 0.0
    k = math.floor(math.log(tokens / base, ratio) + 1e-12)
    q = base * ratio**k
    if q > tokens:  # guard the float floor at exact powers
        q /= ratio
    return q


def next_threshold(tokens: int, base: int, ratio: float) -> int:
    """Smallest MemGuard threshold strictly above ``tokens`` (in tokens)."""
    if tokens < base:
        return base
    q = quantize(tokens, base, ratio) * ratio
    t = math.ceil(q)
    while t <= tokens:
        q *= ratio
        t = math.ceil(q)
    return t


def boost_array(w: np.ndarray, gamma: float) -> np.ndarray:
    """``boost`` over an array with numpy's log/expm1: within a few ulps of ``boost`` (not
    bit-equal; the waiting queue uses it only to shortlist, see ``Policy.approx_offsets``)."""
    x = gamma * w
    with np.errstate(all="ignore"):
        b = -np.log(-np.expm1(-x)) / gamma
        b = np.where(x > 700.0, np.exp(-x) / gamma, b)
    return np.where(x <= 0.0, 1e9, b)

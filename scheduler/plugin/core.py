"""The engine-independent half of a replica's scheduler plugin.

``ReplicaCore`` owns everything the control API reads and writes — the active settings and their
version, the policy built from them, per-request state, counters, the completions log and the
step log — and the settings switch: a validated document is staged under a lock and swapped in by
one reference assignment at the top of the next scheduling step, so requests in flight keep their
KV and progress and only the ordering changes. The vLLM scheduler subclasses (``plugin.vllm``)
and the simulated twin replicas drive the same core, so the API cannot tell them apart.
"""

from __future__ import annotations

import contextlib
import functools
import heapq
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from scheduler.contract import BREAKER_ERROR_CHARS, INFLIGHT_LIMIT
from scheduler.errors import FAILED, TailpilotError
from scheduler.plugin.env import SETTINGS_FILE_ENV, PluginEnv
from scheduler.plugin.lease import Leases
from scheduler.plugin.paged_log import PagedLog
from scheduler.plugin.wire import parse_json_file
from scheduler.policies import Policy, RequestState, make_policy
from scheduler.policies.capabilities import refusal, tick_if_due
from scheduler.policies.predictors import HistoryPredictor
from scheduler.policies.queue import WaitingQueue
from scheduler.settings import PREDICTED_POLICIES, RESTART_REQUIRED_ENGINE_FIELDS, Settings
from scheduler.settings_change import SettingsChange, with_engine

log = logging.getLogger("tailpilot.plugin")

REFIT_INTERVAL_S = 10.0  # history predictor refit period, on its own thread
COMPLETIONS_KEPT = 100_000  # per-request completions kept for readers behind the cursor
STEPS_KEPT = 20_000  # step-log entries kept for calibration
# Entries per /state or /steps answer: a poller pages through a backlog instead of making the
# engine's process serialise megabytes at once (1,000 completions are ~200 KB of JSON).
PAGE_LIMIT = 1_000
# One completions-log entry, in order (what ``/state`` serves per finished request). ``max_tokens``
# is the client's cap on the request (what a recorded trace needs instead of the output length);
# ``received_at`` when the engine core got it (``arrival`` is the API server's, before tokenising
# and the hop to the core: a replay starts a request at ``received_at``).
COMPLETION_KEYS = (
    "seq",
    "id",
    "tenant",
    "type",
    "arrival",
    "received_at",
    "scheduled_at",
    "first_token_at",
    "finished_at",
    "prompt_tokens",
    "output_tokens",
    "max_tokens",
    "preemptions",
    "recomputed_tokens",
    "reason",
)


class SettingsConflict(TailpilotError):
    """``If-Match`` named a version that is no longer current."""

    exit_code = FAILED


@dataclass(slots=True)
class Breaker:
    """The circuit breaker's counters (``/state``'s ``breaker``; ``contract.Breaker``).

    A policy that raises inside the engine's step never stops the engine: the core replaces it
    with the last settings that completed a step (else vLLM's stock order, sarathi) and counts
    it here. The settings model is meant to refuse every document that could raise
    (tests/test_settings_safety.py); this is the last line, for what no bound foresaw."""

    trips_total: int = 0
    last_error: str | None = None
    last_at: float | None = None
    failed_version: int | None = None
    fallback_version: int | None = None  # of the document restored; None: the stock order

    def as_dict(self) -> dict[str, Any]:
        return {
            "trips_total": self.trips_total,
            "last_error": self.last_error,
            "last_at": self.last_at,
            "failed_version": self.failed_version,
            "fallback_version": self.fallback_version,
        }


@dataclass(slots=True)
class StepRecord:
    """One scheduling step's duration and batch composition (what calibration fits)."""

    seq: int
    started: float  # wall clock, s
    duration_s: float
    prefill_tokens: int
    sum_prefill_sq: int
    decode_seqs: int
    sum_kv_context: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "started": self.started,
            "duration_s": self.duration_s,
            "prefill_tokens": self.prefill_tokens,
            "sum_prefill_sq": self.sum_prefill_sq,
            "decode_seqs": self.decode_seqs,
            "sum_kv_context": self.sum_kv_context,
        }


def _numbered(record: dict[str, Any], seq: int) -> dict[str, Any]:
    """A completions-log entry: ``record`` with its ``seq`` first (``COMPLETION_KEYS``' order)."""
    return {"seq": seq, **record}


def load_startup_settings(
    engine_defaults: dict[str, int] | None = None, env: PluginEnv | None = None
) -> Settings:
    """Settings named by ``$TAILPILOT_SETTINGS_FILE`` (a JSON document), else vLLM's behaviour."""
    path = (env or PluginEnv.read()).settings_file
    if not path:
        return Settings.model_validate({"policy": "sarathi", "engine": engine_defaults or {}})
    try:
        doc = parse_json_file(path)
    except (OSError, ValueError) as err:
        raise ValueError(f"{SETTINGS_FILE_ENV}={path}: cannot read settings: {err}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{SETTINGS_FILE_ENV}={path}: expected a settings object")
    return Settings.model_validate(with_engine(doc, engine_defaults or {}))


class ReplicaCore:
    def __init__(
        self,
        settings: Settings,
        *,
        replica: str = "replica",
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.replica = replica
        self.clock = clock
        # Where its requests' tenants come from (scheduler.plugin.tenancy): the plugin sets it from
        # TAILPILOT_TENANT_SOURCE; a twin's feeder labels its own requests, as a gateway would.
        self.tenant_source: str = "client"
        # Names this incarnation: a collector whose cursor belongs to another instance reads from 0
        # (the counters alone cannot tell a restart that has since completed more than the cursor).
        self.instance = uuid.uuid4().hex
        self._lock = threading.Lock()  # guards staging and the logs; the step itself is lock-free
        # Held by the engine thread inside the scheduler's entry points (schedule, add_request,
        # update_from_output, finish_requests) so the API thread can apply a staged document to
        # an idle engine, which does not step until new work arrives. Uncontended: ~0.1 µs.
        self.engine_lock = threading.RLock()
        self.settings = settings
        self.version = 1  # of the newest document: the staged one if any, else the active one
        self.active_version = 1  # of ``self.settings``, the document the steps run with
        self._pending: Settings | None = None
        # The staged document's policy, built when it was staged (a document that cannot build is
        # refused then, never inside a step): the step that takes it only adopts the live state.
        self._pending_policy: Policy | None = None
        # The history predictor survives policy switches: what it learned stays useful.
        self.predictor = HistoryPredictor()
        self.policy: Policy = self._build(settings)
        self.waiting = WaitingQueue(self.policy)
        self.states: dict[str, RequestState] = {}
        self.preemptions_total = 0
        self.refused_total = 0  # requests the policy turned away on arrival (slofq's queue cap)
        self.recomputed_tokens_total = 0
        self.finished_total = 0
        self.steps_total = 0
        self.completions_log: PagedLog[dict[str, Any]] = PagedLog(
            COMPLETIONS_KEPT, lambda entry: int(entry["seq"])
        )
        self.steps_log: PagedLog[StepRecord] = PagedLog(STEPS_KEPT, lambda entry: entry.seq)
        self.breaker = Breaker()
        # The last two documents that completed a step, with their versions: the breaker restores
        # the newest of them that is not the one that failed.
        self._good: tuple[Settings, int] | None = None
        self._good_before: tuple[Settings, int] | None = None
        self.leases = Leases(clock)  # who may steer the knobs (scheduler.plugin.lease)

    def start_refit_thread(self, interval_s: float = REFIT_INTERVAL_S) -> threading.Thread:
        """Refit the history predictor on a timer, never inside the scheduling step
        (docs/policies.md#predictors). A refit bumps the predictor's version; the policy re-sorts
        at the next step."""
        stop = self._refit_stop = threading.Event()

        def loop() -> None:
            while not stop.wait(interval_s):
                # A failed fit keeps the previous one; never kill the engine.
                with contextlib.suppress(Exception):
                    self.predictor.refit()

        thread = threading.Thread(target=loop, name="tailpilot-refit", daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        if getattr(self, "_refit_stop", None) is not None:
            self._refit_stop.set()

    # --- settings ---------------------------------------------------------------------------
    def _build(self, settings: Settings) -> Policy:
        predictor = self.predictor if settings.policy in PREDICTED_POLICIES else None
        if hasattr(settings.params, "predictor") and settings.params.predictor == "oracle":
            raise ValueError(
                "params.predictor: 'oracle' needs true lengths, which only the simulator has; "
                "use 'history' on a live replica"
            )
        return make_policy(settings, predictor)

    def settings_doc(self) -> dict[str, Any]:
        with self._lock:
            settings, version = (self._pending or self.settings), self.version
        return {"settings": settings.to_dict(), "version": version, "replica": self.replica}

    def put_settings(
        self,
        doc: dict[str, Any],
        if_match: int | None = None,
        lease: tuple[str, str] | None = None,
    ) -> dict[str, Any]:
        """Validate and stage a settings document; it applies at the start of the next step.

        Raises pydantic's ValidationError (or ValueError) for a bad document, SettingsConflict
        for a stale ``If-Match`` and LeaseConflict when a controller sends it under ``lease``
        (kind, holder) while another holds that kind's lease; either way nothing changes.
        """
        with self._lock:
            current = self._pending or self.settings
        new = SettingsChange.whole(doc).apply(current)  # the engine fields it omits: ours
        built = self._build(new)  # fail now, not inside the scheduling step
        with self._lock:
            if if_match is not None and if_match != self.version:
                raise SettingsConflict(
                    f"If-Match {if_match} does not match the current version {self.version}"
                )
            self.leases.check(lease)
            current = self._pending or self.settings
            self._pending, self._pending_policy = new, built
            self.version += 1
            version = self.version
        restart = [
            f
            for f in RESTART_REQUIRED_ENGINE_FIELDS
            if getattr(new.engine, f) != getattr(current.engine, f)
        ]
        return {
            "settings": new.to_dict(),
            "version": version,
            "replica": self.replica,
            "restart_required": restart,
        }

    def take_pending(self) -> Settings | None:
        """Make the staged settings the active document and return them (None if none is staged).

        ``begin_step`` swaps in the policy built when they were staged; a driver that schedules
        with its own policy (the simulated twin replica hands them to its simulator) applies them
        itself."""
        staged = self._take_staged()
        return None if staged is None else staged[0]

    def _take_staged(self) -> tuple[Settings, Policy] | None:
        """``take_pending``, with the policy built when the document was staged."""
        if self._pending is None:
            return None
        with self._lock:
            new, built = self._pending, self._pending_policy
            if new is None or built is None:  # staged together: taken by another thread
                return None
            self._pending = self._pending_policy = None
            self.settings, self.active_version = new, self.version
        return new, built

    def apply_if_idle(self, now: float, wait_s: float = 1.0) -> bool:
        """Apply a staged document now if no request is in the engine (an idle vLLM engine runs no
        step that would). False if nothing is staged, work is in flight (the next step applies it)
        or the engine thread kept its lock for ``wait_s``."""
        if self._pending is None or not self.engine_lock.acquire(timeout=wait_s):
            return False
        try:
            if self._pending is None or self.states:
                return False
            self.begin_step(now)
            return True
        finally:
            self.engine_lock.release()

    def begin_step(self, now: float) -> Policy:
        """Top of a scheduling step: swap in staged settings (one reference assignment)."""
        staged = self._take_staged()
        if staged is not None:
            self.policy.detach(self.waiting)  # write back what the old policy kept lazily (sjf)
            policy = staged[1]
            policy.adopt_live_state(self.policy)
            policy.attach(
                self.waiting.in_order(),
                [s for s in self.states.values() if s.status == "running"],
                now,
            )
            self.waiting.set_policy(policy)
            self.policy = policy
        policy = self.policy
        tick_if_due(policy, now)
        return policy

    # --- the circuit breaker ------------------------------------------------------------------
    def step_succeeded(self) -> None:
        """A step ran to its end on the active document: the breaker may restore it later."""
        if self._good is None or self._good[1] != self.active_version:
            self._good_before, self._good = self._good, (self.settings, self.active_version)

    def note_trip(self, err: BaseException, now: float, *, stock: bool = False) -> Settings:
        """Count a policy failure and make the fallback document the active one (under a new
        version; a document staged meanwhile stays staged and newest). Returns the fallback: the
        last document that completed a step, unless that is the one that failed, else sarathi
        (vLLM's own order) with the same engine limits. A driver that schedules with its own
        policy (the simulated twin) hands it to its simulator; the plugin calls ``trip``.
        ``stock``: the restored document failed too; forget it and take the stock order."""
        failed = self.active_version
        if stock:
            self._good = self._good_before = None
        good = [g for g in (self._good, self._good_before) if g is not None and g[1] != failed]
        # The restored document leaves the list: should it fail too, the next one (or the stock
        # order) follows; it re-enters, under its new version, once it completes a step.
        self._good, self._good_before = (good[1] if len(good) > 1 else None), None
        if good:
            fallback, fallback_version = good[0]
        else:
            fallback = Settings.model_validate(
                {"policy": "sarathi", "engine": self.settings.engine.model_dump()}
            )
            fallback_version = None
        text = f"{type(err).__name__}: {err}"[:BREAKER_ERROR_CHARS]
        with self._lock:
            breaker = self.breaker
            breaker.trips_total += 1
            breaker.last_error, breaker.last_at = text, now
            breaker.failed_version, breaker.fallback_version = failed, fallback_version
            self.version += 1
            self.settings, self.active_version = fallback, self.version
            if self._pending is not None:
                self.version += 1  # the staged document stays the newest
        what = (
            f"settings version {fallback_version}"
            if fallback_version is not None
            else "vLLM's stock order"
        )
        log.error(
            "tailpilot: the %s policy of settings version %d raised inside the engine's step (%s); "
            "the engine carries on under %s, now version %d (trip %d)",
            self.policy.name,
            failed,
            text,
            what,
            self.active_version,
            breaker.trips_total,
            exc_info=err,
        )
        return fallback

    def trip(self, err: BaseException, now: float) -> Policy:
        """A policy raised inside the engine's step: replace it (``note_trip``), rebuild the
        waiting queue from its members (a half-finished queue operation is not trusted) and
        return the policy the engine now runs. Falls back to the stock order if the restored
        document fails to build or attach too."""
        running = [s for s in self.states.values() if s.status == "running"]

        def run_on(fallback: Settings) -> Policy:
            policy = self._build(fallback)
            self.waiting.reset(policy)
            policy.attach(self.waiting.in_order(), running, now)
            return policy

        try:
            policy = run_on(self.note_trip(err, now))
        except Exception as again:  # the restored document fails here too: the stock order cannot
            policy = run_on(self.note_trip(again, now, stock=True))
        self.policy = policy
        return policy

    # --- requests ---------------------------------------------------------------------------
    def track(self, state: RequestState, now: float) -> None:
        self.states[state.id] = state
        state.enqueued_at = now
        if state.received_at is None:
            state.received_at = now
        try:
            self.policy.on_arrival(state, now)
        except Exception as err:
            self.trip(err, now)

    def note_preemption(self, state: RequestState, now: float, by_policy: bool) -> None:
        self.preemptions_total += 1
        self.recomputed_tokens_total += state.note_preemption(now, by_policy)

    def refuse(self, state: RequestState, now: float) -> str | None:
        """The policy's reason to turn ``state`` away on arrival (a tenant's queue cap), logged as
        a completion with reason ``rejected``; None: track it as usual."""
        try:
            why = refusal(self.policy, state, now)
        except Exception as err:
            self.trip(err, now)
            return None
        if why is not None:
            self.refused_total += 1
            if state.received_at is None:
                state.received_at = now
            state.status = "finished"
            state.finished_at = now
            self._log_finished(state, now, "rejected")
        return why

    def finish(self, state: RequestState, now: float, reason: str = "finished") -> None:
        self.states.pop(state.id, None)
        state.status = "finished"
        state.finished_at = now
        try:
            self.policy.on_finish(state, now)
        except Exception as err:
            self.trip(err, now)
        if reason == "finished" and state.generated > 0:
            self.predictor.observe(state, state.generated)
        self._log_finished(state, now, reason)

    def _log_finished(self, state: RequestState, now: float, reason: str) -> None:
        self.log_completions(
            [
                {
                    "id": state.id,
                    "tenant": state.tenant,
                    "type": state.type,
                    "arrival": state.arrival,
                    "received_at": state.received_at,
                    "scheduled_at": state.scheduled_at,
                    "first_token_at": state.first_token_at,
                    "finished_at": now,
                    "prompt_tokens": state.prompt_tokens,
                    "output_tokens": state.generated,
                    "max_tokens": state.max_tokens,
                    "preemptions": state.preemptions,
                    "recomputed_tokens": state.recomputed_tokens,
                    "reason": reason,
                }
            ]
        )

    def log_completions(self, records: Iterable[dict[str, Any]]) -> None:
        """Append finished requests to the completions log (each gets the next ``seq``) and count
        them. A record has the keys of ``COMPLETION_KEYS`` other than ``seq``."""
        with self._lock:
            for record in records:
                self.finished_total += 1
                self.completions_log.append(functools.partial(_numbered, record))

    def record_step(
        self,
        started: float,
        duration_s: float,
        prefill_tokens: int,
        sum_prefill_sq: int,
        decode_seqs: int,
        sum_kv_context: int,
    ) -> None:
        with self._lock:
            self.steps_total += 1
            self.steps_log.append(
                lambda seq: StepRecord(
                    seq,
                    started,
                    duration_s,
                    prefill_tokens,
                    sum_prefill_sq,
                    decode_seqs,
                    sum_kv_context,
                )
            )

    # --- what the control API reads -----------------------------------------------------------
    def completions_since(
        self, cursor: int, limit: int = PAGE_LIMIT
    ) -> tuple[list[dict[str, Any]], int]:
        with self._lock:
            return self.completions_log.since(cursor, limit)

    def steps_since(self, cursor: int, limit: int = PAGE_LIMIT) -> tuple[list[dict[str, Any]], int]:
        with self._lock:
            items, next_cursor = self.steps_log.since(cursor, limit)
        return [s.as_dict() for s in items], next_cursor

    def inflight(
        self, limit: int = INFLIGHT_LIMIT, requests: Iterable[RequestState] | None = None
    ) -> dict[str, Any]:
        """The ``/inflight`` document: the oldest ``limit`` requests in flight (by default the
        core's own; a twin passes its simulator's), with what the replica knows of each. Costs
        O(n log limit) in the requests held: a snapshot list, then a bounded heap."""
        held = list(self.states.values()) if requests is None else list(requests)
        oldest = heapq.nsmallest(
            max(0, min(limit, INFLIGHT_LIMIT)), held, key=lambda s: (s.arrival, s.id)
        )
        return {
            "instance": self.instance,
            "time": self.clock(),
            "total": len(held),
            "requests": [
                {
                    "id": s.id,
                    "tenant": s.tenant,
                    "type": s.type,
                    "arrival": s.arrival,
                    "received_at": s.received_at,
                    "prompt_tokens": s.prompt_tokens,
                    "max_tokens": s.max_tokens,
                    "generated": s.generated,
                    "status": s.status,
                }
                for s in oldest
            ],
        }

    def state(
        self,
        cursor: int | None,
        kv: dict[str, Any],
        *,
        waiting: Sequence[RequestState] | None = None,
        running: int | None = None,
        live: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The ``/state`` document; completions only when a ``cursor`` is given, at most a page
        (``more`` says another follows at ``next_cursor``). A driver that keeps its own queues and
        policy (the simulated twin replica) passes ``waiting`` (in queue order), the ``running``
        count and the policy's ``live`` state; by default they are the core's own."""
        if running is None:
            running = sum(1 for s in list(self.states.values()) if s.status == "running")
        waiting = list(self.waiting) if waiting is None else waiting
        by_tenant: dict[str, int] = {}
        by_type: dict[str, int] = {}
        for s in waiting:
            by_tenant[s.tenant] = by_tenant.get(s.tenant, 0) + 1
            by_type[s.type] = by_type.get(s.type, 0) + 1
        completions: list[dict[str, Any]]
        if cursor is None:
            completions, next_cursor = [], self.completions_log.next_seq
        else:
            completions, next_cursor = self.completions_since(cursor)
        live = self.policy.live_state() if live is None else live
        return {
            "replica": self.replica,
            "instance": self.instance,
            "time": self.clock(),
            "policy": self.settings.policy,
            # The active document and its version (they always match); a staged one shows only as
            # its version until the next step applies it.
            "settings": self.settings.to_dict(),
            "settings_version": self.active_version,
            "pending_version": self.version if self.version != self.active_version else None,
            "waiting": len(waiting),
            "running": running,
            "waiting_by_tenant": by_tenant,
            "tenant_source": self.tenant_source,
            "waiting_by_type": by_type,
            "kv": kv,
            "gamma_live": live.get("gamma"),
            "beta_live": live.get("beta"),
            "live": live,
            "preemptions_total": self.preemptions_total,
            "recomputed_tokens_total": self.recomputed_tokens_total,
            "refused_total": self.refused_total,
            "finished_total": self.finished_total,
            "steps_total": self.steps_total,
            "completions": completions,
            "next_cursor": next_cursor,
            "more": next_cursor < self.completions_log.next_seq,
            "breaker": self.breaker.as_dict(),
            "leases": self.leases.as_dict(),
        }

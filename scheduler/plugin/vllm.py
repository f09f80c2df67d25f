"""tailpilot's scheduler classes for vLLM 0.32–0.33, chosen with ``--scheduler-cls``:

    scheduler.plugin.vllm.TailpilotScheduler       CPU, or GPU without async scheduling
    scheduler.plugin.vllm.TailpilotAsyncScheduler  GPU default (async scheduling on)

Both subclass the stock scheduler and change only what docs/engine.md#scheduling-step lets a
policy change, using the same policy library as the simulator:
  * the waiting queue is a ``RequestQueue`` kept in policy order (``PolicyRequestQueue``);
  * the running list is reordered at the top of every step, so budget priority follows the policy
    and the stock memory-pressure victim (``running[-1]``) is the policy's worst request;
  * before the stock step runs, policy-driven preemption (srpt, las, uniboost) preempts running
    requests for waiting ones through vLLM's own ``_preempt_request``.
Settings arrive through the control API (``plugin.api``) and are swapped in at the top of a step.

Typing: mypy does not follow vLLM's modules (its private v1 scheduler changes with minor
releases), so vLLM's classes and objects (``Request``, the scheduler's output) are ``Any`` here;
``_StockScheduler`` declares what the mixin uses of the stock scheduler, for the type checker
only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, cast

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.request_queue import RequestQueue, SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request

from scheduler.names import DEFAULT_TYPE, request_type
from scheduler.plugin.api import ControlServer, token_from_env
from scheduler.plugin.core import ReplicaCore, load_startup_settings
from scheduler.plugin.env import HOST_ENV, PORT_ENV, PluginEnv, PluginEnvError
from scheduler.policies import Policy, PreemptivePolicy, RequestState
from scheduler.policies.capabilities import ChargesTokens, CountsSteps
from scheduler.policies.preemption import plan_preemptions
from scheduler.policies.queue import WaitingQueue

log = logging.getLogger("tailpilot.plugin")
REFUSAL_LOG_S = 10.0  # at most one refusal message per tenant this often (with the count between)


class PolicyRequestQueue(RequestQueue):
    """vLLM's waiting queue, backed by tailpilot's policy-ordered ``WaitingQueue``.

    vLLM peeks the head, tries to allocate, then pops: the popped request is the peeked one
    because nothing reorders the queue between the two calls.

    These methods run inside vLLM's ``schedule()``, where an exception would stop the engine: a
    policy that raises in them trips the circuit breaker (``ReplicaCore.trip``: the queue is
    rebuilt from its members under the fallback policy) and the operation is answered from the
    rebuilt queue. Membership is recorded before the policy is asked, so a push or a removal
    that failed half-way is already complete in the rebuilt queue.
    """

    def __init__(self, plugin: TailpilotMixin) -> None:
        self.plugin = plugin

    def _queue(self) -> WaitingQueue:
        return self.plugin.tp_core.waiting

    def _state(self, request: Request) -> RequestState:
        return self.plugin._tp_state_for(request)

    def add_request(self, request: Request) -> None:
        self._push(request, front=False)

    def prepend_request(self, request: Request) -> None:
        self._push(request, front=True)

    def _push(self, request: Request, front: bool) -> None:
        state = self._state(request)
        try:
            self._queue().push(state, self.plugin._tp_now, front=front)
        except Exception as err:  # the member is recorded already: the rebuilt queue holds it
            self.plugin._tp_trip(err)

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        for request in requests:
            self.prepend_request(request)

    def peek_request(self) -> Request:
        head = self._head()
        if head is None:
            raise IndexError("peek from an empty queue (or every request held back)")
        return self.plugin._tp_requests[head.id]

    def _head(self) -> RequestState | None:
        """The request admission would take next; None when the queue is empty or the policy
        holds every waiting request back (backpressure)."""
        try:
            return self._policy_head()
        except Exception as err:
            self.plugin._tp_trip(err)
            return self._policy_head()

    def _policy_head(self) -> RequestState | None:
        core, now = self.plugin.tp_core, self.plugin._tp_now
        ordered = core.waiting.ordered(now)
        if not ordered:
            return None
        return next(core.policy.admission_order(ordered, now), None)

    def remove_states(self, states: list[RequestState]) -> None:
        try:
            self._queue().remove(states)
        except Exception as err:  # the members are already gone: the rebuilt queue lacks them
            self.plugin._tp_trip(err)

    def pop_request(self) -> Request:
        request = self.peek_request()
        state = self._state(request)
        self.remove_states([state])
        # vLLM also pops requests it only sets aside for this step (skip_request: grammar still
        # compiling, KV still loading, stale async output) and prepends them back: not admissions.
        stale: int = getattr(request, "num_stale_output_tokens", 0)  # not in every vLLM release
        if not (
            self.plugin._is_blocked_waiting_status(request.status)
            or (stale and not request.drop_stale_output)
        ):
            self.plugin._tp_admitted(state)
        return request

    def remove_request(self, request: Request) -> None:
        self.remove_requests([request])

    def remove_requests(self, requests: Iterable[Request]) -> None:
        states = [self.plugin.tp_core.states.get(r.request_id) for r in requests]
        leaving = [s for s in states if s is not None and s.status == "waiting"]
        self.remove_states(leaving)
        # vLLM removes requests from the queue only to finish them (aborts, stops): _free_request
        # follows and must not take them out a second time (a grouped queue, vtc's and slofq's,
        # refuses to remove what it no longer holds).
        for s in leaving:
            s.status = "leaving"

    def __bool__(self) -> bool:
        # vLLM admits while this is true: false when every waiting request is held back, so the
        # step goes on without admitting (len() still counts them: the engine keeps stepping).
        if self.plugin.tp_core.policy.gates_admission:
            return self._head() is not None
        return bool(self._queue())

    def __len__(self) -> int:
        return len(self._queue())

    def __iter__(self) -> Iterator[Request]:
        requests = self.plugin._tp_requests
        try:
            order = list(self._queue().ordered(self.plugin._tp_now))
        except Exception as err:
            self.plugin._tp_trip(err)
            order = list(self._queue().ordered(self.plugin._tp_now))
        return iter([requests[s.id] for s in order])


if TYPE_CHECKING:

    class _StockScheduler:
        """What ``TailpilotMixin`` uses of vLLM's ``Scheduler`` (and ``AsyncScheduler``), its
        mixin partner; vLLM's own objects are ``Any`` (module docstring)."""

        vllm_config: Any
        scheduler_config: Any
        cache_config: Any
        policy: Any  # SchedulingPolicy
        requests: dict[str, Any]  # request id -> Request
        running: list[Any]  # Request
        block_size: int
        max_num_running_reqs: int
        max_num_scheduled_tokens: int
        scheduler_reserve_full_isl: bool
        kv_cache_manager: Any

        def add_request(self, request: Any) -> None: ...
        def finish_requests(self, *args: Any, **kwargs: Any) -> Any: ...
        def schedule(self, *args: Any, **kwargs: Any) -> Any: ...
        def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any: ...
        def get_request_counts(self) -> tuple[int, int]: ...
        def shutdown(self) -> None: ...
        def _preempt_request(
            self, request: Any, timestamp: float, *args: Any, **kwargs: Any
        ) -> None: ...
        def _free_request(self, request: Any, *args: Any, **kwargs: Any) -> Any: ...
        @staticmethod
        def _is_blocked_waiting_status(status: Any) -> bool: ...

else:
    _StockScheduler = object  # at run time the mixin's partner is the real scheduler (MRO)


class TailpilotMixin(_StockScheduler):
    """The plugin's behaviour; mixed into the stock and the async scheduler alike."""

    waiting: PolicyRequestQueue  # replaces the stock queue (_tp_init)

    def _tp_init(self) -> None:
        cfg = self.vllm_config
        sched = cfg.scheduler_config
        engine = {
            "max_num_seqs": sched.max_num_seqs,
            "max_num_batched_tokens": sched.max_num_batched_tokens,
            "long_prefill_token_threshold": sched.long_prefill_token_threshold or 0,
        }
        rank = cfg.parallel_config.data_parallel_rank or 0
        env = PluginEnv.read()  # every TAILPILOT_* variable, validated once: bad ones stop start-up
        self._tp_identity = env.identity()  # who may name a tenant
        replica = env.replica + (f"-dp{rank}" if rank else "")
        self._tp_now = time.time()
        self._tp_requests: dict[str, Request] = {}
        self._tp_policy_victim = False  # set while the plugin itself preempts (policy-driven)
        self._tp_inflight: dict[int, tuple[float, float, tuple[int, int, int, int]]] = {}
        self._tp_refused: set[str] = set()  # refused on arrival, until vLLM's error path frees them
        # tenant -> [last logged (s), refused since]
        self._tp_refusal_log: dict[str, list[float]] = {}
        self.tp_core = ReplicaCore(load_startup_settings(engine, env), replica=replica)
        self.tp_core.tenant_source = self._tp_identity.source
        self.waiting = PolicyRequestQueue(self)
        self._tp_stock_policy = self.policy  # vLLM's, restored when decode_first is off
        self.tp_server: ControlServer | None = None
        port = env.api_port
        if port >= 0:  # a negative port disables the API (in-process tests drive the core directly)
            port = port + rank if port else 0
            try:
                server = ControlServer(
                    self, host=env.api_host, port=port, token=token_from_env(env)
                )
            except OSError as err:  # a start-up error the operator can act on, not a traceback
                raise PluginEnvError(
                    f"{HOST_ENV}={env.api_host!r} {PORT_ENV}={port}: the control API cannot "
                    f"listen there ({err.strerror or err}); choose a free port, 0 for any free "
                    "one, or a negative one to run without the API"
                ) from err
            self.tp_server = server.start()
        self.tp_core.start_refit_thread()

    # --- request bookkeeping -----------------------------------------------------------------
    def _tp_state_for(self, request: Request) -> RequestState:
        state = self.tp_core.states.get(request.request_id)
        if state is None:
            state = self._tp_new_state(request)
            self._tp_requests[request.request_id] = request
            self.tp_core.track(state, self._tp_now)
        return state

    def _tp_new_state(self, request: Request) -> RequestState:
        params = request.sampling_params
        extra = (getattr(params, "extra_args", None) or {}) if params is not None else {}
        rtype = str(extra.get("type", DEFAULT_TYPE))
        return RequestState(
            id=request.request_id,
            arrival=request.arrival_time,
            prompt_tokens=request.num_prompt_tokens,
            max_tokens=request.max_tokens or 1,
            # As the operator configured (TAILPILOT_TENANT_SOURCE): made storable and bounded,
            # never a reason to refuse.
            tenant=self._tp_identity.tenant_of(extra),
            type=request_type(rtype),
        )

    def _tp_refuse(self, request: Request) -> bool:
        """Turn a new request away when the policy says so (slofq's per-tenant queue cap): vLLM's
        own error path ends it at the next step's output (the client gets vLLM's error answer);
        the reason goes to the log and the completions log (reason ``rejected``)."""
        errors = getattr(self, "grammar_compile_error_reqs", None)
        if errors is None or request.resumable or request.request_id in self.requests:
            return False  # a vLLM without that path, a streaming session, or a known request
        state = self._tp_new_state(request)
        why = self.tp_core.refuse(state, self._tp_now)
        if why is None:
            return False
        self._tp_log_refusal(state.tenant, request.request_id, why)
        self.requests[request.request_id] = request  # what finish_requests looks up
        errors.add(request.request_id)
        self._tp_refused.add(request.request_id)
        return True

    def _tp_log_refusal(self, tenant: str, request_id: str, why: str) -> None:
        # Refused clients retry (vLLM answers them with an error): one line per tenant per
        # REFUSAL_LOG_S, not one per request, in the engine's log.
        entry = self._tp_refusal_log.get(tenant)
        if entry is not None and self._tp_now - entry[0] < REFUSAL_LOG_S:
            entry[1] += 1
            return
        more = (
            f" ({entry[1]} more of this tenant's since the last message)"
            if entry and entry[1]
            else ""
        )
        log.warning("tailpilot refused request %s: %s%s", request_id, why, more)
        if len(self._tp_refusal_log) >= 1024:  # tenant names come from clients
            self._tp_refusal_log.clear()
        self._tp_refusal_log[tenant] = [self._tp_now, 0]

    def get_request_counts(self) -> tuple[int, int]:
        # A refused request is finished by the next step's update_from_output: count it as
        # waiting so an otherwise idle engine still takes that step.
        running, waiting = super().get_request_counts()
        return running, waiting + len(self._tp_refused)

    def _tp_admitted(self, state: RequestState) -> None:
        state.status = "running"
        if state.scheduled_at is None:
            state.scheduled_at = self._tp_now
        try:
            self.tp_core.policy.on_admit(state, self._tp_now, 0)
        except Exception as err:
            self._tp_trip(err)

    def _tp_trip(self, err: BaseException) -> None:
        """A policy raised inside one of vLLM's scheduler entry points: fall back
        (``ReplicaCore.trip``) and go on; vLLM's own state is untouched by the policy, so the step
        completes."""
        self.tp_core.trip(err, self._tp_now)

    def _tp_sync(self, request: Request, state: RequestState) -> None:
        generated = request.num_output_tokens
        if generated > state.generated:
            policy = self.tp_core.policy
            if policy.charges_tokens:
                try:
                    cast(ChargesTokens, policy).on_tokens(state, generated - state.generated)
                except Exception as err:
                    self._tp_trip(err)
            if state.first_token_at is None:
                state.first_token_at = self._tp_now
            state.generated = generated
        state.computed_tokens = request.num_computed_tokens
        state.note_progress()

    # --- the scheduling step ------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        with self.tp_core.engine_lock:
            self._tp_now = time.time()
            if not (self.tp_core.policy.refuses and self._tp_refuse(request)):
                super().add_request(request)

    # The entry points pass vLLM's arguments through unchanged (they differ between releases).
    def finish_requests(self, *args: Any, **kwargs: Any) -> Any:
        with self.tp_core.engine_lock:
            return super().finish_requests(*args, **kwargs)

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        with self.tp_core.engine_lock:
            return self._tp_schedule(*args, **kwargs)

    def _tp_schedule(self, *args: Any, **kwargs: Any) -> Any:
        now = self._tp_now = time.time()
        for attempt in range(3):  # the failing document, the last good one, the stock order
            try:
                self._tp_prepare_step(now)
                break
            except Exception as err:
                if attempt == 2:
                    raise  # the stock order raised: a bug of the plugin's own, not of a policy
                self._tp_trip(err)
        started = time.perf_counter()
        output = super().schedule(*args, **kwargs)
        self._tp_inflight[id(output)] = (now, started, self._tp_composition(output))
        policy = self.tp_core.policy  # a breaker trip inside the stock step replaced it
        if policy.counts_steps:  # sjf's starvation counters
            try:
                self._tp_count_steps(policy, output)
            except Exception as err:
                self._tp_trip(err)
        self.tp_core.step_succeeded()
        return output

    def _tp_count_steps(self, policy: Policy, output: Any) -> None:
        states = self.tp_core.states
        served = output.num_scheduled_tokens
        scheduled = [states[r] for r in served if r in states]
        idle = [states[r.request_id] for r in self.running if r.request_id not in served]
        counter = cast(CountsSteps, policy)
        counter.on_steps(scheduled, idle, 1)
        # Counted lazily: no pass over a deep queue.
        counter.on_waiting_steps(self.tp_core.waiting, 1)

    def _tp_prepare_step(self, now: float) -> None:
        """The step's policy work before vLLM's own step: staged settings, the running order and
        policy-driven preemption."""
        core = self.tp_core
        policy = core.begin_step(now)
        lpt = core.settings.engine.long_prefill_token_threshold
        if self.scheduler_config.long_prefill_token_threshold != lpt:
            # vLLM reads the threshold from its scheduler config at every step, so it applies live.
            self.scheduler_config.long_prefill_token_threshold = lpt
        states = core.states
        if self._tp_inflight:  # async scheduling: the previous step's output is not processed yet
            for request in self.running:
                self._tp_sync(request, states[request.request_id])
        # Otherwise update_from_output has already synced every request that moved.
        ordered = [states[request.request_id] for request in self.running]
        policy.view.max_num_seqs = self.max_num_running_reqs
        policy.before_step(core.waiting.ordered(now), now)
        decode_first = policy.decode_first and policy.reorders_running
        # Only the memory-pressure victim choice reads it (the queues were built at start-up).
        self.policy = SchedulingPolicy.PRIORITY if decode_first else self._tp_stock_policy
        if policy.reorders_running and len(ordered) > 1:
            ordered = policy.order_running(ordered, now)
            self._tp_set_running(ordered, decode_first)
        if isinstance(policy, PreemptivePolicy) and core.waiting:
            self._tp_policy_preemptions(now, ordered, policy)

    def _tp_set_running(self, ordered: list[RequestState], decode_first: bool) -> None:
        """Put vLLM's running list in the policy's order: the order vLLM gives out the token
        budget, and running[-1] its memory-pressure victim. Under ``decode_first`` the budget goes
        to decodes before prefill chunks, so the victim can no longer be running[-1]: vLLM's
        priority mode picks max(priority) instead, and each request's priority is its rank."""
        requests = self._tp_requests
        if not decode_first:
            self.running[:] = [requests[s.id] for s in ordered]
            return
        decodes: list[Any] = []  # Request
        prefills: list[Any] = []
        for rank, state in enumerate(ordered):
            request = requests[state.id]
            request.priority = rank
            computed = request.num_computed_tokens
            if computed >= request.num_prompt_tokens and computed >= request.num_tokens - 1:
                decodes.append(request)
            else:
                prefills.append(request)  # a prompt, or a recompute after preemption
        self.running[:] = decodes + prefills

    def _tp_policy_preemptions(
        self, now: float, ordered: list[RequestState], policy: PreemptivePolicy
    ) -> None:
        core = self.tp_core
        bs = self.block_size
        lpt = self.scheduler_config.long_prefill_token_threshold or 0

        def chunk(state: RequestState, budget: int) -> int:
            n = state.prompt_tokens + state.generated - state.computed_tokens
            return min(lpt if 0 < lpt < n else n, budget)

        # vLLM's admission gate: the whole sequence must fit.
        full = self.scheduler_reserve_full_isl

        def blocks_needed(state: RequestState, n: int) -> int:
            tokens = max(n, state.prompt_tokens + state.generated) if full else n
            return -(-tokens // bs)

        pool = self.kv_cache_manager.block_pool
        victims = plan_preemptions(
            policy,
            core.waiting.ordered(now),
            lambda: ordered,
            now=now,
            seats=self.max_num_running_reqs - len(self.running),
            free_blocks=pool.get_num_free_blocks(),
            budget=self.max_num_scheduled_tokens,
            chunk=chunk,
            blocks_needed=blocks_needed,
            held_blocks=lambda s: -(-s.computed_tokens // bs),
            max_seats=self.max_num_running_reqs,
            total_blocks=pool.num_gpu_blocks,
        )
        for state in victims:
            request = self._tp_requests[state.id]
            self.running.remove(request)
            ordered.remove(state)
            self._tp_policy_victim = True
            self._preempt_request(request, time.monotonic())
        self._tp_policy_victim = False

    def _tp_composition(self, output: Any) -> tuple[int, int, int, int]:
        prefill = prefill_sq = decodes = context = 0
        for req_id, n in output.num_scheduled_tokens.items():
            request = self.requests.get(req_id)
            if request is None:
                continue
            if n == 1 and request.num_output_tokens > 0:
                decodes += 1
                context += request.num_computed_tokens  # already advanced by this step
            else:
                prefill += n
                prefill_sq += n * n
        return prefill, prefill_sq, decodes, context

    def _preempt_request(
        self, request: Request, timestamp: float, *args: Any, **kwargs: Any
    ) -> None:
        state = self.tp_core.states.get(request.request_id)
        if state is not None:
            state.computed_tokens = request.num_computed_tokens
            self.tp_core.note_preemption(state, self._tp_now, self._tp_policy_victim)
            try:
                self.tp_core.policy.on_preempt(state, self._tp_now, self._tp_policy_victim)
            except Exception as err:
                self._tp_trip(err)
        super()._preempt_request(request, timestamp, *args, **kwargs)
        if state is not None:
            state.computed_tokens = request.num_computed_tokens  # 0: its KV is gone

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        with self.tp_core.engine_lock:
            return self._tp_update_from_output(scheduler_output, model_runner_output)

    def _tp_update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        self._tp_now = time.time()
        states = self.tp_core.states
        result = super().update_from_output(scheduler_output, model_runner_output)
        for req_id in scheduler_output.num_scheduled_tokens:
            request, state = self.requests.get(req_id), states.get(req_id)
            if request is not None and state is not None:
                self._tp_sync(request, state)
        inflight = self._tp_inflight.pop(id(scheduler_output), None)
        if inflight is not None:
            wall, started, comp = inflight
            self.tp_core.record_step(wall, time.perf_counter() - started, *comp)
        return result

    def _free_request(self, request: Request, *args: Any, **kwargs: Any) -> Any:
        state = self.tp_core.states.get(request.request_id)
        if state is not None:
            self._tp_now = time.time()
            self._tp_sync(request, state)
            reason = (
                "finished"
                if request.status.name.startswith("FINISHED_")
                and request.status.name not in ("FINISHED_ABORTED", "FINISHED_ERROR")
                else request.status.name.lower()
            )
            if state.status == "waiting":
                self.waiting.remove_states([state])
            self.tp_core.finish(state, self._tp_now, reason)
        self._tp_requests.pop(request.request_id, None)
        self._tp_refused.discard(request.request_id)
        return super()._free_request(request, *args, **kwargs)

    # --- the control API's view -------------------------------------------------------------------
    def _tp_kv(self) -> dict[str, Any]:
        pool = self.kv_cache_manager.block_pool
        total = pool.num_gpu_blocks - 1  # block 0 is vLLM's null block
        used = total - pool.get_num_free_blocks()
        return {
            "used_blocks": used,
            "total_blocks": total,
            "usage": used / total if total else 0.0,
            "block_size": self.block_size,
            "prefix_caching": bool(self.cache_config.enable_prefix_caching),
        }

    def api_state(self, cursor: int | None) -> dict[str, Any]:
        return self.tp_core.state(cursor, self._tp_kv())

    def api_inflight(self, limit: int) -> dict[str, Any]:
        return self.tp_core.inflight(limit)

    def api_settings(self) -> dict[str, Any]:
        return self.tp_core.settings_doc()

    def api_lease(self, doc: dict[str, Any]) -> dict[str, Any]:
        return self.tp_core.leases.take(doc)

    def api_put_settings(
        self, doc: dict[str, Any], if_match: int | None, lease: tuple[str, str] | None = None
    ) -> dict[str, Any]:
        answer = self.tp_core.put_settings(doc, if_match, lease)
        self.tp_core.apply_if_idle(time.time())  # an idle engine would wait for the next request
        return answer

    def api_steps(self, cursor: int) -> dict[str, Any]:
        steps, next_cursor = self.tp_core.steps_since(cursor)
        return {"replica": self.tp_core.replica, "steps": steps, "next_cursor": next_cursor}

    def shutdown(self) -> None:
        self.tp_core.stop()
        if self.tp_server is not None:
            self.tp_server.stop()
            self.tp_server = None
        super().shutdown()


class TailpilotScheduler(TailpilotMixin, Scheduler):
    """The stock scheduler running tailpilot's policies (CPU; GPU without async scheduling)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # vLLM's constructor arguments
        super().__init__(*args, **kwargs)
        self._tp_init()


class TailpilotAsyncScheduler(TailpilotMixin, AsyncScheduler):
    """The async scheduler (vLLM's GPU default) running tailpilot's policies."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # vLLM's constructor arguments
        super().__init__(*args, **kwargs)
        self._tp_init()

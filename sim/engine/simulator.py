"""Trace-replay simulator of one vLLM v1 replica (docs/engine.md#scheduling-step), the tuner's
inner loop.

One scheduling step, top to bottom (``Simulator._step``):
  1. arrivals join the waiting queue; periodic policy ticks (γ-Ada) and predictor refits run;
  2. the policy orders the running list and may preempt running requests for waiting ones;
  3. running requests, in running order, get ``min(remaining prefill or 1, budget, threshold)``
     tokens and the KV blocks those need; when a block is missing the policy's memory victim is
     preempted by recompute (its KV freed, back to the front of waiting). 2's preemptions and 3
     under contention are the engine's books' (``sim.engine.books.EngineBooks``);
  4. only if nothing was preempted in 3, waiting requests are admitted in the policy's order while
     budget, ``max_num_seqs`` and KV allow; the first that cannot get blocks stops admission;
  5. the step takes the step-time model's time; a request whose prefill completes emits a token.

Event skipping: when a step is a pure decode step that admitted and preempted nothing, the steps
after it are identical until the next arrival, completion, KV exhaustion, policy threshold or
tick. They are advanced as one event: decode step j of a stretch costs ``t0 + e·n·j`` (the KV
context grows by n tokens a step), so K steps take ``K·t0 + e·n·K(K−1)/2`` (``sim.engine.step``).
``event_skipping=False`` runs the same code one step at a time, for checking.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, cast

from mypy_extensions import mypyc_attr

from scheduler.metrics import Completion
from scheduler.policies import RequestState, make_policy
from scheduler.policies.base import INF, PreemptivePolicy, arrival_order
from scheduler.policies.capabilities import (
    ChargesTokens,
    CountsSteps,
    next_tick_of,
    refusal,
    tick_if_due,
)
from scheduler.policies.predictors import LengthPredictor
from scheduler.policies.preemption import preemption_allowed
from scheduler.policies.queue import WaitingQueue
from scheduler.settings import PREDICTED_POLICIES, Settings
from sim.engine.books import EngineBooks
from sim.engine.config import EngineConfig
from sim.engine.result import SimResult
from sim.engine.step import StepPlan, kv_safe_steps, serve_uncontended
from sim.traces import Trace, TraceRequest


# Tests subclass it (a clock, a switch mid-run); the autopilot forks it by pickling.
@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
class Simulator(EngineBooks):
    """One replica replaying ``trace`` under ``settings`` on ``config``'s hardware.

    ``run()`` replays the whole trace; ``advance_to``, ``apply_settings``, ``recover``,
    ``extend_arrivals`` and ``drain`` drive it live (the twin replicas). ``event_skipping=False``
    runs one step per loop iteration; ``check_invariants`` checks the KV books after every one.
    """

    def __init__(
        self,
        trace: Trace | Sequence[TraceRequest],
        settings: Settings,
        config: EngineConfig | None = None,
        *,
        event_skipping: bool = True,
        predictor: LengthPredictor | None = None,
        check_invariants: bool = False,
    ) -> None:
        self.config = config or EngineConfig()
        self.settings = settings
        self.event_skipping = event_skipping
        self.check_invariants = check_invariants
        self.policy = make_policy(settings, predictor)
        self.predictor = self.policy.predictor
        self._pending_settings: Settings | None = None

        reqs = sorted(trace, key=lambda r: (r.arrival, r.id))
        self.arrivals: list[TraceRequest] = reqs
        self.next_arrival = 0  # index into arrivals
        self.now = reqs[0].arrival if reqs else 0.0
        self.waiting = WaitingQueue(self.policy)
        self.running = []
        self._settled = 0
        self.blocks = {}
        self.free_blocks = self.config.num_gpu_blocks
        self.init_free_queue()
        self.completions: list[Completion] = []
        self.rejected: list[str] = []
        self.refused = 0  # of those, turned away by the policy (a tenant's queue cap)
        self.steps = 0
        self._idle_iterations = 0
        self._was_contended = False
        self.iterations = 0
        self.preemptions = 0
        self.policy_preemptions = 0
        self.recomputed_tokens = 0
        self.next_refit = self.now + self.config.refit_interval_s
        self.gamma_timeline: list[tuple[float, float]] = []
        self._horizon = INF  # advance_to's bound: no stretch of steps runs past it
        # Called once per loop iteration with (start time, prefill tokens, Σ prefill², decode
        # sequences, Σ KV context, steps in the stretch): a live twin's step log and metrics.
        self.step_listener: Callable[[float, int, int, int, int, int], None] | None = None

    # --- live control (the twin replicas use this exactly as the plugin does) -------------
    def apply_settings(self, settings: Settings) -> None:
        """Switch settings atomically at the start of the next step; nothing in flight is lost."""
        self._pending_settings = settings

    def _switch_settings(self) -> None:
        settings, self._pending_settings = self._pending_settings, None
        assert settings is not None  # only called with a switch pending
        new = make_policy(settings, self._kept_predictor(settings))
        new.adopt_live_state(self.policy)
        waiting = self.waiting.in_order()
        self.policy.detach(waiting)
        new.attach(waiting, self.running, self.now)
        self._settled = 0
        self.waiting.set_policy(new)
        self.policy, self.settings = new, settings
        self.predictor = new.predictor or self.predictor

    def _kept_predictor(self, settings: Settings) -> LengthPredictor | None:
        """The predictor a new policy takes over (what it learned stays useful), if it ranks by
        one."""
        return self.predictor if settings.policy in PREDICTED_POLICIES and self.predictor else None

    def recover(self, settings: Settings) -> None:
        """Replace a policy that raised inside a step with ``settings`` (the twin's circuit
        breaker, as the plugin's ``ReplicaCore.trip``): a fresh policy, the waiting queue rebuilt
        from its members, the running requests attached; anything staged is dropped (the caller
        stages it again). Raises AssertionError if the engine's own books no longer add up."""
        self._pending_settings = None
        policy = make_policy(settings, self._kept_predictor(settings))
        self.waiting.reset(policy)
        policy.attach(self.waiting.in_order(), self.running, self.now)
        self._settled = 0
        self.policy, self.settings = policy, settings
        self.check_books()

    def advance_to(self, t: float) -> int:
        """Run the steps that start before ``t`` (a live twin replica calls this with its clock);
        an idle engine's clock moves to ``t``. Returns the number of loop iterations run.

        Stretches of identical steps stop at ``t`` so a settings change staged meanwhile applies
        at the first step after it, as on a real replica."""
        self._horizon = t
        start = self.iterations
        try:
            while self.now < t:
                if not self.waiting and not self.running:
                    if (
                        self.next_arrival >= len(self.arrivals)
                        or self.arrivals[self.next_arrival].arrival > t
                    ):
                        self.now = t
                        break
                    self.now = max(self.now, self.arrivals[self.next_arrival].arrival)
                self._step()
        finally:
            self._horizon = INF
        return self.iterations - start

    def extend_arrivals(self, requests: Iterable[TraceRequest]) -> None:
        """Append requests that arrive no earlier than every request already queued (a looping
        trace feeding a live twin)."""
        new = sorted(requests, key=lambda r: (r.arrival, r.id))
        if (
            new
            and self.arrivals
            and (new[0].arrival, new[0].id) < (self.arrivals[-1].arrival, self.arrivals[-1].id)
        ):
            raise ValueError(
                f"request {new[0].id} arrives at {new[0].arrival} before the last queued "
                f"request ({self.arrivals[-1].arrival})"
            )
        self.arrivals.extend(new)

    def revise_lengths(self, lengths: Mapping[str, int]) -> int:
        """Give requests already handed over a new output length (a live replay hands a request
        still in flight on the replica an imputed length, and learns its true one when the
        replica completes it). One not yet admitted arrives with it; one waiting or running runs
        to it, or stops at its next token when it has generated that many already; one finished
        here keeps its past. A length is capped as on arrival (``max_tokens``) and to what the KV
        cache can ever hold: a request that could not fit would wait forever. Returns how many
        requests were revised."""
        if not lengths:
            return 0
        revised = 0
        for i in range(self.next_arrival, len(self.arrivals)):
            queued = self.arrivals[i]
            new_length = lengths.get(queued.id)
            if new_length is not None:
                self.arrivals[i] = dataclasses.replace(queued, output_tokens=new_length)
                revised += 1
        kv_tokens = self.config.num_gpu_blocks * self.config.block_size
        in_engine = [req for req in self.running if req.id in lengths]
        for rid in lengths:
            req = self.waiting.member(rid)
            if req is not None:
                in_engine.append(req)
        for req in in_engine:
            target = min(lengths[req.id], req.max_tokens, kv_tokens - req.prompt_tokens)
            req.output_tokens = max(target, req.generated + 1)
            revised += 1
        return revised

    def drain(self) -> tuple[list[Completion], list[str]]:
        """Hand over (and forget) the completions and rejected ids so far, and drop the arrivals
        already admitted: what a simulator that runs for days must not keep."""
        done, self.completions = self.completions, []
        rejected, self.rejected = self.rejected, []
        if self.next_arrival:
            del self.arrivals[: self.next_arrival]
            self.next_arrival = 0
        return done, rejected

    # --- the loop -------------------------------------------------------------------------
    def run(self, progress: Callable[[int, int], None] | None = None) -> SimResult:
        t_start = time.perf_counter()
        total = len(self.arrivals)
        report_every = max(1, total // 200)
        last_reported = 0
        while self.next_arrival < total or self.waiting or self.running:
            if not self.waiting and not self.running:
                self.now = max(self.now, self.arrivals[self.next_arrival].arrival)
            self._step()
            if progress and len(self.completions) - last_reported >= report_every:
                last_reported = len(self.completions)
                progress(last_reported + len(self.rejected), total)
        if progress:
            progress(total, total)
        return self.result(self.completions, self.rejected, time.perf_counter() - t_start)

    def result(
        self, completions: list[Completion], rejected: list[str], wall_s: float
    ) -> SimResult:
        """The run's result with these completions and rejections (a driver that drained them as
        it went hands back what it collected) and the engine's own counters."""
        return SimResult(
            settings=self.settings,
            completions=completions,
            rejected=rejected,
            steps=self.steps,
            iterations=self.iterations,
            sim_time_s=self.now,
            wall_s=wall_s,
            preemptions=self.preemptions,
            policy_preemptions=self.policy_preemptions,
            recomputed_tokens=self.recomputed_tokens,
            gamma_timeline=self.gamma_timeline,
        )

    def _admit_arrivals(self) -> None:
        bs, cap = self.config.block_size, self.config.num_gpu_blocks
        while (
            self.next_arrival < len(self.arrivals)
            and self.arrivals[self.next_arrival].arrival <= self.now
        ):
            t = self.arrivals[self.next_arrival]
            self.next_arrival += 1
            target = min(t.output_tokens, t.max_tokens)
            if -(-(t.prompt_tokens + target) // bs) > cap:
                self.rejected.append(t.id)  # could never fit in KV: vLLM rejects it up front too
                continue
            req = RequestState(
                id=t.id,
                arrival=t.arrival,
                prompt_tokens=t.prompt_tokens,
                max_tokens=t.max_tokens,
                tenant=t.tenant,
                type=t.type,
                output_tokens=target,
                enqueued_at=self.now,
            )
            if refusal(self.policy, req, self.now) is not None:
                self.rejected.append(t.id)  # the tenant's queue cap (slofq): turned away on arrival
                self.refused += 1
                continue
            self.waiting.push(req, self.now)
            self.policy.on_arrival(req, self.now)

    def _step(self) -> None:
        now = self.now
        if self._pending_settings is not None:
            self._switch_settings()
        self._admit_arrivals()
        if not self.waiting and not self.running:
            return  # every arrival so far was rejected
        policy = self.policy
        if tick_if_due(policy, now) and hasattr(policy, "gamma"):
            self.gamma_timeline.append((now, policy.gamma))
        if self.predictor is not None and now >= self.next_refit:
            self.predictor.refit()
            self.next_refit = now + self.config.refit_interval_s
        policy.before_step(self.waiting, now)

        step = self._schedule(now)
        if not step.serves() and not step.preempted:
            # Every waiting request is held back (backpressure) and nothing runs: the engine idles
            # until the policy's next tick or the next arrival, whichever is first.
            t = min(next_tick_of(policy), self._horizon)
            if self.next_arrival < len(self.arrivals):
                t = min(t, self.arrivals[self.next_arrival].arrival)
            if not now < t < INF:
                raise RuntimeError(
                    f"simulator stalled at t={now:.6f}: {policy.name} holds every waiting request "
                    f"back and names no time to try again"
                )
            self.now = t
            return
        if step.serves():
            self._idle_iterations = 0
        else:  # preempting without serving anyone: bounded, or it is a livelock worth a loud error
            self._idle_iterations += 1
            if self._idle_iterations > 10_000:
                raise RuntimeError(
                    f"simulator livelock at t={now:.6f}: {self._idle_iterations} steps without "
                    f"service (policy {policy.name}, waiting={len(self.waiting)}, "
                    f"running={len(self.running)}, free_blocks={self.free_blocks})"
                )
        n_steps = self._steady_steps(step, now) if self.event_skipping else 1
        if self.step_listener is not None:
            self.step_listener(
                now,
                step.prefill_tokens,
                step.sum_prefill_sq,
                step.decode_seqs,
                step.sum_kv_context,
                n_steps,
            )
        self._advance(step, n_steps)
        self.iterations += 1
        if self.check_invariants:
            self.check_books()

    # --- deciding one step ------------------------------------------------------------------
    def _schedule(self, now: float) -> StepPlan:
        policy, eng = self.policy, self.settings.engine
        self._running_sorted = not policy.reorders_running
        step: StepPlan = StepPlan()
        step.preempted = bool(self.waiting) and policy.preemptive and self.preempt_for_waiting(now)
        # The running order only matters when the running requests do not all get their tokens
        # and blocks; try the cheap unordered pass first and sort only if it finds contention.
        # (Under sustained contention skip the attempt: it would fail again.)
        budget = None
        if not self._running_sorted and not self._was_contended:
            served = serve_uncontended(
                step,
                self.running,
                self.blocks,
                self.free_blocks,
                self.config.block_size,
                eng.max_num_batched_tokens,
                eng.long_prefill_token_threshold,
            )
            if served is not None:
                budget, self.free_blocks = served
        if budget is None:
            self.sort_running(now)
            budget = self.serve_in_running_order(step)
            self._was_contended = budget <= 0 or step.memory_preempted
        else:
            self._was_contended = False
        memory_preempted = step.memory_preempted
        step.preempted = step.preempted or memory_preempted
        running, blocks = self.running, self.blocks
        if not memory_preempted and self.waiting:
            admitted: list[RequestState] = []
            for w in policy.admission_order(self.waiting.ordered(now), now):
                if len(running) >= eng.max_num_seqs or budget == 0:
                    step.admission_blocked = True
                    break
                cached = self.cached_tokens(w)  # a victim's prefix found in the prefix cache
                n = self.prefill_chunk(w, budget, cached)
                if self.admission_blocks(w, n, cached) > self.free_blocks:
                    step.admission_blocked = step.kv_blocked = True
                    break
                if w.id in self._cached:
                    self.take_cached(w, cached)
                need = self._blocks_for(cached + n)
                self.free_blocks -= need
                blocks[w.id] = need
                running.append(w)
                step.chunks[w] = n
                step.prefill_tokens += n  # an admission is always a prefill (prompt or recompute)
                step.sum_prefill_sq += n * n
                budget -= n
                admitted.append(w)
                w.status = "running"
                policy.on_admit(w, now, n)
                if w.scheduled_at is None:
                    w.scheduled_at = now
            if admitted:
                step.admitted = True
                self.waiting.remove(admitted)

        if (
            not step.serves()
            and not step.preempted
            and not (policy.gates_admission and not running)
        ):
            raise RuntimeError(
                f"simulator stalled at t={now:.6f}: nothing schedulable "
                f"(waiting={len(self.waiting)}, free_blocks={self.free_blocks})"
            )
        return step

    # --- event skipping -------------------------------------------------------------------
    def _steady_steps(self, step: StepPlan, now: float) -> int:
        """How many identical steps, starting with this one, can run as one event."""
        running = self.running
        if (
            step.preempted
            or step.admitted
            or step.prefill_tokens
            or not running
            or step.decode_seqs != len(running)
            or (self.waiting and not step.admission_blocked)
        ):
            return 1
        can_preempt = self._preemption_possible()
        if (
            can_preempt
            and len(running) < self.settings.engine.max_num_seqs
            and not self._head_short_of_blocks(now)
        ):
            # With a seat free and the head of admission fitting the free blocks by the victim
            # search's count (admission itself stopped short of it, on its own gate), the decode
            # steps shrink the free blocks until the head needs a victim: decide step by step.
            # A head short already found no victims that make it fit, and in a stretch that
            # stays so: the free blocks plus a victim's only shrink and the keys hold.
            return 1
        # The stretch ends with a completion (float: it meets INF below). Every running request
        # decodes in this step: the decodes are the running requests.
        # (Every request the simulator admits knows its true length, _admit_arrivals: the
        # ``output_tokens`` reads below are ints; the ignores say so without a cast per step.)
        k: float = float(min(r.output_tokens - r.generated for r in step.decodes))  # type: ignore[operator]
        if k <= 1:
            return 1
        k = min(k, kv_safe_steps(self.running, self.free_blocks, self.config.block_size))
        waiting = self.waiting.ordered(now)
        k = min(k, self.policy.steady_steps(running, waiting, now, step.kv_blocked, can_preempt))
        t_event = min(next_tick_of(self.policy), self._horizon)
        if self.next_arrival < len(self.arrivals):
            t_event = min(t_event, self.arrivals[self.next_arrival].arrival)
        if self.predictor is not None:
            t_event = min(t_event, self.next_refit)
        if self.waiting:
            t_event = min(t_event, self.policy.next_time_event(waiting, now))
        if t_event < INF and k > 1:
            k = min(k, step.steps_until(self.config.step_model, self.now, t_event))
        return max(1, int(k))

    def _preemption_possible(self) -> bool:
        """Whether a policy preemption can happen in the steps after this one while they stay
        pure decode steps: someone waits, the policy preempts, and the batch is below its
        utilisation limit (``plan_preemptions``' first gate). Such steps keep the seats and only
        take blocks, so a batch at the limit now stays at it until the stretch ends (deep queues:
        a KV-full batch)."""
        policy = self.policy
        if not self.waiting or not isinstance(policy, PreemptivePolicy):
            return False
        max_seats = self.settings.engine.max_num_seqs
        return preemption_allowed(
            policy,
            max_seats - len(self.running),
            max_seats,
            self.free_blocks,
            self.config.num_gpu_blocks,
        )

    def _head_short_of_blocks(self, now: float) -> bool:
        """Whether the first request in the policy's admission order needed more blocks than
        were free when this step's victims were searched for (``plan_preemptions``' count: its
        first chunk out of a whole step's budget). The decodes of this step have taken a block
        each at most since: they are given back."""
        head = next(iter(self.policy.admission_order(self.waiting.ordered(now), now)), None)
        if head is None:
            return False
        chunk = self.prefill_chunk(head, self.settings.engine.max_num_batched_tokens)
        return self.admission_blocks(head, chunk) > self.free_blocks + len(self.running)

    # --- applying steps ---------------------------------------------------------------------
    def _advance(self, step: StepPlan, k: int) -> None:
        self.now += step.stretch_time(self.config.step_model, k)
        self.steps += k
        policy = self.policy
        finished = self._apply_step(step) if k == 1 else self._apply_stretch(step, k)
        if policy.counts_steps:
            counter = cast(CountsSteps, policy)
            scheduled = step.decodes + list(step.chunks)
            # The served are running requests, each once: as many as the batch is all of it (the
            # common case; no set of the batch a step: 5.8% of a slofq replay, perf).
            unscheduled: list[RequestState] = []
            if len(scheduled) < len(self.running):
                served = set(scheduled)
                unscheduled = [r for r in self.running if r not in served]
            counter.on_steps(scheduled, unscheduled, k)
            # sjf counts these lazily: no pass over the queue.
            counter.on_waiting_steps(self.waiting, k)
        # Same-time completions in a canonical order, whatever order the running list was in.
        finished.sort(key=arrival_order)
        for req in finished:
            self._finish(req)

    # The hot loops of _advance: locals instead of repeated attribute reads. Decodes go before
    # prefill chunks, not in service order; that changes nothing: each update touches its own
    # request, VTC charges the same amount for every token of a tenant, and _advance sorts the
    # completions.
    def _apply_step(self, step: StepPlan) -> list[RequestState]:
        """Give one step's tokens (the clock already moved to its end); return the requests it
        finished."""
        now, policy = self.now, self.policy
        finished: list[RequestState] = []
        charger = cast(ChargesTokens, policy) if policy.charges_tokens else None
        for req in step.decodes:
            c = req.computed_tokens + 1
            g = req.generated + 1
            req.computed_tokens, req.generated = c, g
            if charger is not None:
                charger.on_tokens(req, 1)
            req.attained = c + 1  # prompt + output, above any earlier value (note_progress)
            target = req.output_tokens  # the true length (the engine knows it, policies do not)
            assert target is not None  # narrowed: compiled, an unboxed int comparison
            if g >= target:
                finished.append(req)
        for req, n in step.chunks.items():
            c = req.computed_tokens + n
            req.computed_tokens = c
            p, g = req.prompt_tokens, req.generated
            if c == p + g:  # prefill complete: sample a token
                g += 1
                req.generated = g
                if charger is not None:
                    charger.on_tokens(req, 1)
                if req.first_token_at is None:
                    req.first_token_at = now
            done = (c if c < p else p) + g
            if done > req.attained:  # RequestState.note_progress, inlined
                req.attained = done
            target = req.output_tokens
            assert target is not None
            if g >= target:
                finished.append(req)
        return finished

    def _apply_stretch(self, step: StepPlan, k: int) -> list[RequestState]:
        """Give a stretch of ``k`` pure decode steps their tokens (one each a step) and the blocks
        those fill; return the requests it finished."""
        policy, bs, blocks = self.policy, self.config.block_size, self.blocks
        finished: list[RequestState] = []
        charger = cast(ChargesTokens, policy) if policy.charges_tokens else None
        for req in step.decodes:
            c = req.computed_tokens + k
            g = req.generated + k
            req.computed_tokens, req.generated = c, g
            if charger is not None:
                charger.on_tokens(req, k)
            held = blocks[req.id]
            need = -(-c // bs) - held
            if need > 0:
                self.free_blocks -= need
                blocks[req.id] = held + need
            req.attained = c + 1
            target = req.output_tokens
            assert target is not None
            if g >= target:
                finished.append(req)
        return finished

    def _finish(self, req: RequestState) -> None:
        now = self.now
        req.finished_at = now
        req.status = "finished"
        self.leave_running(req)
        held = self.blocks.pop(req.id)
        self.free_blocks += held
        self._free_to_queue(req.id, held, 0)
        self.policy.on_finish(req, now)
        if self.predictor is not None:
            self.predictor.observe(req, req.generated)
        # A finished request was admitted and sampled its first token.
        assert req.scheduled_at is not None and req.first_token_at is not None
        self.completions.append(
            Completion(
                id=req.id,
                tenant=req.tenant,
                type=req.type,
                arrival=req.arrival,
                scheduled_at=req.scheduled_at,
                first_token_at=req.first_token_at,
                finished_at=now,
                prompt_tokens=req.prompt_tokens,
                output_tokens=req.generated,
                preemptions=req.preemptions,
                recomputed_tokens=req.recomputed_tokens,
            )
        )


def simulate(
    trace: Trace | Sequence[TraceRequest],
    settings: Settings,
    config: EngineConfig | None = None,
    **kw: Any,
) -> SimResult:
    """Replay ``trace`` under ``settings`` and return the result (``kw``: ``Simulator``'s
    keyword arguments)."""
    return Simulator(trace, settings, config, **kw).run()

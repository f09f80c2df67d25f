"""One replica as the collector sees it, and one poll of it folded into that view.

:class:`ReplicaView` holds a replica's health, its last /state and /metrics, its cursor in the
completions log, the request ids it read last and its rolling window (``controlplane.window``);
:meth:`ReplicaView.build` folds one poll's answers into it and gives the poll's rows
(:class:`PollResult`), which the collector's writer stores. :func:`poll_view` is one poll:
/state (paged, ``controlplane.replica_http.fetch_state``) and /metrics concurrently, every
failure a one-line reason on the replica's sample. :func:`poll_once` polls a cluster once,
without a store (``tailpilot status``).

A replica's restart (its instance changed, its counters went backwards, or it has fewer
completions than the cursor) is read again from cursor 0; a replica without the tailpilot plugin
(its control API answers 404) still gives a sample from /metrics alone.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from controlplane.cluster import ClusterSpec, ReplicaSpec
from controlplane.prom import MetricsFormatError
from controlplane.replica_http import (
    MAX_PAGES_PER_POLL,
    STATE_PAGE_LIMIT,
    HttpFailure,
    PollingClient,
    StateAnswer,
    StateFormatError,
    control_base,
    count_into,
    fetch_metrics,
    fetch_state,
    get_answer,
    make_client,
    opt_int,
    read_json,
    read_state,
)
from controlplane.snapshot import Health, ReplicaSnapshot
from controlplane.window import CounterRate, ReplicaWindow, latency_percentiles
from scheduler import contract
from scheduler.validation import finite_or_none
from storage import limits
from storage.rows import (
    BREAKER_RESULT,
    BREAKER_WHO,
    CompletionRow,
    GroupSampleRow,
    SampleRow,
    SettingsChangeRow,
    SettingsSeenRow,
)

#: Request ids of a replica remembered to count the completions that repeat one (the store keeps
#: the first of an id and drops the rest). One poll's most pages (16 x 1,000): a repeat within a
#: poll, or from the poll before, is always caught; ~1 MB per replica (hashes, not the ids).
RECENT_IDS_REMEMBERED = MAX_PAGES_PER_POLL * STATE_PAGE_LIMIT


@dataclass(slots=True)
class PollResult:
    """What one poll of one replica produced (rows for the writer)."""

    sample: SampleRow
    groups: list[GroupSampleRow]
    completions: list[CompletionRow]
    cursor: int | None  # the cursor after ``completions``; None when the state poll failed
    instance: str | None = None  # the replica instance ``cursor`` counts in, when it reports one
    # The settings document, when its version or instance is new.
    settings_seen: SettingsSeenRow | None = None
    # An audit row, when the replica's breaker tripped again.
    breaker_trip: SettingsChangeRow | None = None


class ReplicaView:
    """One replica as the collector sees it: health, last documents, cursor and window.

    State documents reach it as ``replica_http.read_state`` returns them, already read through
    ``contract.State`` (every field of its type, or null) and fitted to what the store holds
    (``storage.limits``): they are used as they are. Only the /metrics numbers are checked here."""

    def __init__(
        self,
        spec: ReplicaSpec,
        window_s: float,
        cursor: int = 0,
        instance: str | None = None,
        reserved: Mapping[str, Iterable[str]] | None = None,
    ) -> None:
        self.spec = spec
        self.name = spec.name
        self.window_s = float(window_s)
        self.health = Health()
        self.state: contract.State | None = None  # last /state document, without completions
        self.metrics: dict[str, float] = {}
        self.metrics_error: str | None = None  # the last /metrics poll's error
        self.cursor = int(cursor)
        self.instance = instance  # the replica incarnation ``cursor`` counts in (None: not known)
        # (instance, version) last stored.
        self._settings_key: tuple[str | None, int | None] | None = None
        # The cluster file's tenants and types: kept apart whatever the number of other names.
        self.declared: Mapping[str, Collection[str]] = {
            kind: frozenset(names) for kind, names in (reserved or {}).items()
        }
        self.window = ReplicaWindow(reserved=self.declared)
        self.sample: SampleRow | None = None
        self.groups: list[GroupSampleRow] = []
        self.polls = 0
        self.restarts = 0
        # Completions-log entries left out (malformed, unstorable, repeated).
        self.skipped_completions = 0
        # Values not stored as sent, per reason (storage.limits.REASONS): an entry skipped or a
        # field nulled.
        self.rejected: dict[str, int] = {}
        # Hashes of the newest request ids read (RECENT_IDS_REMEMBERED), to count repeats.
        self._recent_ids: deque[int] = deque()
        self._recent_set: set[int] = set()
        # (instance, trips) of the breaker's newest trip written to the audit log; None: none known.
        self.breaker_recorded: tuple[str | None, int] | None = None
        self.last_restart: tuple[float, str] | None = None  # (collector clock, why)
        # The replica's clock: since when the window is complete.
        self._coverage_start: float | None = None
        self._resumed = cursor > 0
        self._last_finished_total: int | None = None
        self._last_steps_total: int | None = None
        self._preemptions = CounterRate()
        self._gen_tokens = CounterRate()
        self._requests = CounterRate()

    # --- the state document -----------------------------------------------------------------
    def restarted(self, doc: contract.State) -> str | None:
        """Why ``doc`` shows the replica restarted since the last poll (None if it did not)."""
        finished, steps = doc.finished_total, doc.steps_total
        instance = doc.instance or None
        if instance is not None and self.instance is not None and instance != self.instance:
            return f"instance changed from {self.instance} to {instance}"
        if finished is not None and finished < self.cursor:
            return f"finished_total {finished} < cursor {self.cursor}"
        if doc.next_cursor < self.cursor:
            return f"next_cursor {doc.next_cursor} < cursor {self.cursor}"
        if (
            finished is not None
            and self._last_finished_total is not None
            and finished < self._last_finished_total
        ):
            return f"finished_total went back from {self._last_finished_total} to {finished}"
        if (
            steps is not None
            and self._last_steps_total is not None
            and steps < self._last_steps_total
        ):
            return f"steps_total went back from {self._last_steps_total} to {steps}"
        return None

    def reset_for_restart(self) -> None:
        self.restarts += 1
        self.cursor = 0
        self.window.clear()
        self._coverage_start = None
        self._resumed = False
        self._last_finished_total = self._last_steps_total = None
        for rate in (self._preemptions, self._gen_tokens, self._requests):
            rate.clear()

    def _remember_counters(self, doc: contract.State) -> None:
        self._last_finished_total = doc.finished_total
        self._last_steps_total = doc.steps_total

    # --- building rows ----------------------------------------------------------------------
    def build(
        self,
        t: float,
        answer: StateAnswer | None,
        metrics: dict[str, float] | None,
        errors: list[str],
        no_plugin: str | None,
    ) -> PollResult:
        """Fold one poll's answers into the view and return its rows. ``t`` is the collector
        clock."""
        t_ms = round(t * 1000)
        self.polls += 1
        state: contract.State | None = None
        completions: list[CompletionRow] = []
        if answer is not None and answer.doc is not None:
            if answer.restarted:
                self.reset_for_restart()
                self.last_restart = (t, answer.restarted)
            self.cursor = answer.cursor
            self.instance = answer.doc.instance or self.instance
            state, completions = answer.doc, answer.completions
            self._remember_ids(answer.ids)
        if metrics is not None:
            self.metrics = metrics
        m = metrics or {}
        row = SampleRow(
            replica=self.name,
            t_ms=t_ms,
            healthy=not errors,
            reason="; ".join(errors) if errors else None,
        )
        groups: list[GroupSampleRow] = []
        seen: SettingsSeenRow | None = None
        trip: SettingsChangeRow | None = None
        if state is not None:
            # Kept without its page of completions (they are in the window and the store).
            self.state = state.model_copy(update={"completions": []})
            self._remember_counters(state)
            seen = self._settings_seen(state, t_ms)
            trip = self._breaker_trip(state.breaker, t_ms)
            now_r = state.time
            if now_r is None:  # a document without a clock: fall back to the newest finish / ours
                now_r = max([c.finished_s for c in completions] + [t])
            if self._coverage_start is None:
                if self._resumed or not completions:
                    self._coverage_start = now_r
                else:
                    self._coverage_start = min(now_r, min(c.arrival_s for c in completions))
            # Trimmed first too: names that left the window free their place in its cap before
            # new ones come.
            self.window.trim(now_r - self.window_s)
            self.window.add(completions)
            self.window.trim(now_r - self.window_s)
            duration = min(self.window_s, now_r - self._coverage_start)
            groups = self._fill_from_state(row, state, now_r, duration, t_ms)
        elif metrics is not None:  # no plugin, or its control API failed this time
            row.waiting = opt_int(m.get("waiting"))
            row.running = opt_int(m.get("running"))
            row.kv_usage = kv_usage_of(m)
            if no_plugin:  # counter rates on our clock (a plugin replica's are on its own clock)
                row.preemptions_per_s = self._preemptions.add(
                    t, m.get("preemptions_total"), self.window_s
                )
                row.throughput_tok_s = self._gen_tokens.add(
                    t, m.get("generation_tokens_total"), self.window_s
                )
                row.throughput_req_s = self._requests.add(t, m.get("requests_total"), self.window_s)
        if no_plugin and not errors:
            row.reason = no_plugin
        for reason in limits.fit_sample(row):
            count_into(self.rejected, reason)
        row.rejected = dict(self.rejected) or None  # a copy: the row is written later, off the loop
        self.set_health(
            t,
            row.healthy,
            row.reason,
            "metrics-only" if no_plugin else ("plugin" if state is not None else self.health.mode),
        )
        self.sample, self.groups = row, groups
        return PollResult(
            row,
            groups,
            completions,
            self.cursor if state is not None else None,
            self.instance if state is not None else None,
            seen,
            trip,
        )

    # --- counts, request ids, the circuit breaker ---------------------------------------------
    def count(self, rejected: Mapping[str, int], skipped: int = 0) -> None:
        """Add what one answer held that could not be stored as sent (per reason), and the
        completions-log entries it left out."""
        for reason, n in rejected.items():
            count_into(self.rejected, reason, n)
        self.skipped_completions += skipped

    def seen_id(self, key: int) -> bool:
        """Whether a request id (its hash) was among the newest read."""
        return key in self._recent_set

    def _remember_ids(self, keys: list[int]) -> None:
        ids, members = self._recent_ids, self._recent_set
        for key in keys:
            ids.append(key)
            members.add(key)
        while len(ids) > RECENT_IDS_REMEMBERED:
            members.discard(ids.popleft())

    def _breaker_trip(
        self, breaker: contract.Breaker | None, t_ms: int
    ) -> SettingsChangeRow | None:
        """An audit row when the replica's breaker tripped since the newest trip recorded (its
        counter starts again with each instance); None otherwise."""
        trips = None if breaker is None else breaker.trips_total
        if breaker is None or not isinstance(trips, int):
            return None
        recorded = self.breaker_recorded
        before = 0
        if recorded is not None and (
            recorded[0] == self.instance or None in (recorded[0], self.instance)
        ):
            # Fewer: a restart without an instance.
            before = recorded[1] if recorded[1] <= trips else 0
        self.breaker_recorded = (self.instance, trips)
        if trips <= before:
            return None
        new = trips - before
        failed, fallback = breaker.failed_version, breaker.fallback_version
        to = f"settings v{fallback}" if fallback is not None else "vLLM's stock order"
        message = (
            "a policy raised in the engine's step "
            f"({breaker.last_error or 'no error reported'}); "
            f"settings v{failed if failed is not None else '?'} replaced by {to} "
            f"({new} new trip{'s' if new > 1 else ''}, {trips} since the replica started)"
        )
        version = failed if limits.int_problem(failed, limits.VERSION_RANGE) is None else None
        return SettingsChangeRow(
            replica=self.name,
            t_ms=t_ms,
            who=BREAKER_WHO,
            result=BREAKER_RESULT,
            message=message,
            version=version,
            new={
                "trips_total": trips,
                "new_trips": new,
                "instance": self.instance,
                "failed_version": failed,
                "fallback_version": fallback,
                "last_error": breaker.last_error,
                "last_at": breaker.last_at,
            },
        )

    def _settings_seen(self, state: contract.State, t_ms: int) -> SettingsSeenRow | None:
        """The settings document as a row when this (instance, version) was not stored yet."""
        settings, version = state.settings, state.settings_version
        if limits.int_problem(version, limits.VERSION_RANGE) is not None:
            # Counted where the sample nulls it (the same figure, the same column type).
            version = None
        key = (self.instance, version)
        if settings is None or key == self._settings_key:
            return None
        self._settings_key = key
        return SettingsSeenRow(self.name, t_ms, key[1], key[0], settings)

    def _fill_from_state(
        self, row: SampleRow, s: contract.State, now_r: float, duration: float, t_ms: int
    ) -> list[GroupSampleRow]:
        m = self.metrics
        kv = s.kv or contract.KvState()
        row.policy = s.policy
        row.settings_version = s.settings_version
        row.waiting, row.running = s.waiting, s.running
        row.kv_used_blocks, row.kv_total_blocks = kv.used_blocks, kv.total_blocks
        row.kv_usage = kv.usage
        if row.kv_usage is None:
            row.kv_usage = kv_usage_of(m)
        row.gamma_live, row.beta_live = s.gamma_live, s.beta_live
        preemptions: float | None = s.preemptions_total
        if preemptions is None:
            preemptions = finite_or_none(m.get("preemptions_total"))
        row.preemptions_per_s = self._preemptions.add(now_r, preemptions, self.window_s)
        w = self.window
        if duration > 0:
            row.throughput_tok_s = float(w.out_tokens.sum()) / duration
            row.throughput_req_s = len(w) / duration
        row.latency = latency_percentiles(w.ttft, w.ttlt, w.tbt)
        row.breaker_trips = None if s.breaker is None else s.breaker.trips_total
        groups: list[GroupSampleRow] = []
        if len(w) == 0:
            return groups
        for kind, codes in (("tenant", w.tenant), ("type", w.type)):
            names = w.names(kind)
            for code in np.unique(codes):
                sel = codes == code
                tokens = float(w.out_tokens[sel].sum())
                groups.append(
                    GroupSampleRow(
                        replica=self.name,
                        t_ms=t_ms,
                        kind=kind,
                        group=names[int(code)],
                        completed=int(sel.sum()),
                        throughput_tok_s=tokens / duration if duration > 0 else None,
                        latency=latency_percentiles(w.ttft[sel], w.ttlt[sel], w.tbt[sel]),
                    )
                )
        return groups

    def set_health(self, t: float, healthy: bool, reason: str | None, mode: str) -> None:
        """Record how a poll at ``t`` (the collector's clock) found the replica."""
        h = self.health
        if healthy != h.healthy or h.since is None:
            h.since = t
        h.healthy, h.reason, h.mode = healthy, reason, mode
        if healthy:
            h.failures, h.last_ok = 0, t
        else:
            h.failures += 1

    def snapshot(self) -> ReplicaSnapshot:
        state = self.state
        return ReplicaSnapshot(
            name=self.name,
            health=replace(self.health),
            sample=self.sample,
            groups=list(self.groups),
            settings=None if state is None else state.settings,
            settings_version=None if state is None else state.settings_version,
            state=state,
            metrics=dict(self.metrics),
            cursor=self.cursor,
            window_completions=len(self.window),
            rejected=dict(self.rejected),
            breaker=None if state is None else state.breaker,
        )


async def poll_view(
    client: PollingClient,
    view: ReplicaView,
    timeout_s: float,
    clock: Callable[[], float],
    *,
    with_completions: bool = True,
    metrics_every: int = 1,
) -> PollResult:
    """One poll of one replica: /state and /metrics concurrently, folded into ``view``.

    ``metrics_every`` > 1 reads /metrics of a replica with the plugin only every that many polls
    (its sample comes from /state; /metrics is then a check that vLLM's API server is up); the
    last metrics answer, or its error, stands in between."""
    due = (
        metrics_every <= 1
        or view.health.mode != "plugin"
        or not view.health.healthy
        or view.metrics_error is not None
        or view.polls % metrics_every == 0
    )

    async def metrics_part() -> dict[str, float] | None:
        return await fetch_metrics(client, view.spec, timeout_s) if due else None

    async def state_part() -> StateAnswer:
        if with_completions:
            return await fetch_state(client, view, timeout_s)
        resp = await get_answer(
            client,
            control_base(view.spec) + "/state",
            "state",
            timeout_s,  # no cursor: no completions
            token=view.spec.token(),
        )
        rejected: dict[str, int] = {}
        doc = read_state(
            read_json(resp, "state", lambda: count_into(rejected, limits.NON_FINITE)),
            rejected,
            view.declared,
        )
        view.count(rejected)
        return StateAnswer(doc, [], view.cursor, rejected=rejected)

    state_res, metrics_res = await asyncio.gather(
        state_part(), metrics_part(), return_exceptions=True
    )
    errors: list[str] = []
    no_plugin: str | None = None
    answer = None
    if isinstance(state_res, BaseException):
        if isinstance(state_res, HttpFailure) and state_res.status == 404:
            no_plugin = "metrics only: no tailpilot control API (state: HTTP 404)"
        elif isinstance(state_res, (HttpFailure, StateFormatError)):
            errors.append(str(state_res))
        else:
            raise state_res
    else:
        answer = state_res
    metrics = None
    if isinstance(metrics_res, BaseException):
        if isinstance(metrics_res, (HttpFailure, MetricsFormatError)):
            errors.append(str(metrics_res))
            view.metrics_error = str(metrics_res)
        else:
            raise metrics_res
    elif due:
        metrics, view.metrics_error = metrics_res, None
    else:
        metrics = view.metrics
    if no_plugin and metrics is None:
        errors.insert(0, "state: HTTP 404 (no tailpilot control API)")
    return view.build(clock(), answer, metrics, errors, no_plugin)


def kv_usage_of(metrics: Mapping[str, Any]) -> float | None:
    """KV usage off a replica's metrics page: a fraction, or None (missing, NaN, out of 0..1)."""
    usage = finite_or_none(metrics.get("kv_usage"))
    return usage if limits.fraction_problem(usage) is None else None


def reserved_groups(cluster: ClusterSpec) -> dict[str, tuple[str, ...]]:
    """The tenants and types the cluster file names: each window keeps them apart whatever the
    count."""
    gov = cluster.governance
    return {"tenant": tuple(gov.tenants), "type": tuple(gov.type_shares)} if gov is not None else {}


async def poll_once(
    cluster: ClusterSpec,
    *,
    client: PollingClient | None = None,
    with_completions: bool = False,
    clock: Callable[[], float] = time.time,
) -> list[ReplicaSnapshot]:
    """One concurrent poll of every replica, no store (``tailpilot status``).

    Without ``with_completions`` the completions are not downloaded (the state is read past the
    end of the log), so the latency percentiles are empty; with it, every completion the replica
    still holds is read and the window percentiles are computed as the collector would.
    """
    return [v.snapshot() for v in await poll_views(cluster, client, with_completions, clock)]


async def poll_views(
    cluster: ClusterSpec,
    client: PollingClient | None,
    with_completions: bool,
    clock: Callable[[], float],
) -> list[ReplicaView]:
    """A view of every replica of ``cluster``, each polled once, concurrently (``client`` made and
    closed here when None)."""
    own = client is None
    client = client or make_client(cluster)
    try:
        views = [
            ReplicaView(r, cluster.window_s, reserved=reserved_groups(cluster))
            for r in cluster.replicas
        ]
        await asyncio.gather(
            *(
                poll_view(client, v, cluster.timeout_s, clock, with_completions=with_completions)
                for v in views
            )
        )
        return views
    finally:
        if own:
            await client.aclose()

"""Reading a replica for calibration: its step log (paged, bounded, rate limits waited out), its
engine facts (block size, KV blocks, limits) as the simulator's engine, and where the store says
its control API is. The fitting itself is :mod:`tuner.closed_loop.calibrate`."""

from __future__ import annotations

import json
from functools import partial
from typing import TYPE_CHECKING, Any

from scheduler.errors import FAILED, TailpilotError
from sim.stepmodel import DEFAULT_MODEL_NAME, StepTimeModel, get_model, list_models

if TYPE_CHECKING:  # names for annotations; their modules load where a function needs them
    from controlplane.http import Answer, SyncClient
    from scheduler.contract import State
    from sim.engine import EngineConfig
    from storage.store import Store

STEPS_PATH = "/tailpilot/v1/steps"
MAX_STEPS = 200_000  # a plugin keeps 20,000; a safety bound on paging a log that keeps growing


class CalibrationError(TailpilotError, RuntimeError):
    """Calibration cannot proceed; the message says why and what to do."""

    exit_code = FAILED


class ReplicaUnreachable(CalibrationError):
    """The control API did not answer (connection refused, timeout, not a tailpilot replica)."""


# ---------------------------------------------------------------------------------------------
# reading the step log
# ---------------------------------------------------------------------------------------------


def steps_url(control_url: str) -> str:
    """The steps endpoint of a control URL given as ``http://host:port`` or ``.../tailpilot/v1``."""
    base = control_url.rstrip("/")
    if base.endswith("/tailpilot/v1"):
        base = base[: -len("/tailpilot/v1")]
    return base + STEPS_PATH


def fetch_steps(
    control_url: str,
    *,
    timeout: float = 10.0,
    max_steps: int = MAX_STEPS,
    client: SyncClient | None = None,
) -> list[dict[str, Any]]:
    """Every step the replica still keeps, oldest first, paging ``?cursor=N`` from 0 until a page
    comes back empty (or ``max_steps`` were read). Raises :class:`ReplicaUnreachable`."""
    return fetch_step_log(control_url, timeout=timeout, max_steps=max_steps, client=client)[1]


MAX_RATE_LIMITED = 60  # 429 answers waited out while paging one step log (controlplane.retry)


def _get_bounded(
    client: SyncClient, url: str, limit: int, params: dict[str, Any] | None = None
) -> Answer:
    """GET ``url`` reading at most ``limit`` bytes of the answer (streamed: an answer that never
    ends costs no memory). Raises ReplicaUnreachable for a larger one."""
    # Replica reads only: aiohttp, tenacity and the contract's models cost ~0.4 s of start-up to
    # `tailpilot sim`, whatif and fidelity, which import this module for replica_engine.
    from controlplane.http import AnswerTooLarge, get_sync

    try:
        return get_sync(client, url, limit, url, params)
    except AnswerTooLarge as err:
        raise ReplicaUnreachable(str(err)) from None


def _text(body: bytes, n: int) -> str:
    return body[:n].decode("utf-8", "replace")


def _step_page(url: str, answer: Answer) -> tuple[list[dict[str, Any]], int, dict[str, Any]]:
    """(the steps, the next cursor, the whole page) of one step-log page answer; raises
    :class:`ReplicaUnreachable` for an answer that is not one."""
    status, body = answer.status_code, answer.content
    if status == 404:
        raise ReplicaUnreachable(
            f"{url} answered 404: not a tailpilot control API (or one without "
            "a step log); give the control URL, not vLLM's API URL"
        )
    if status != 200:
        raise ReplicaUnreachable(f"{url} answered HTTP {status}: {_text(body, 300)}")
    try:
        page = json.loads(body)
        items, next_cursor = page["steps"], int(page["next_cursor"])
    except (ValueError, KeyError, TypeError):
        raise ReplicaUnreachable(
            f"{url} did not answer a step-log page ({_text(body, 200)!r})"
        ) from None
    return items, next_cursor, page


def fetch_step_log(
    control_url: str,
    *,
    timeout: float = 10.0,
    max_steps: int = MAX_STEPS,
    client: SyncClient | None = None,
) -> tuple[str | None, list[dict[str, Any]]]:
    """(the replica's name as its API reports it, :func:`fetch_steps`)."""
    # Replica reads only (start-up cost, see _get_bounded):
    from controlplane.http import TRANSPORT_ERRORS, sync_client  # aiohttp
    from controlplane.replica_http import MAX_STEPS_BYTES  # aiohttp, the contract's models
    from controlplane.retry import STEP_LOG_RATE_LIMITED, rate_limited  # tenacity

    url = steps_url(control_url)
    own = client is None
    http = sync_client(timeout) if client is None else client
    steps: list[dict[str, Any]] = []
    replica: str | None = None
    cursor, refused = 0, 0

    def count_refusal(_state: object) -> None:
        nonlocal refused
        refused += 1

    try:
        while len(steps) < max_steps:
            # The replica rate-limits its readers (it serves them from the engine's process): a
            # 429 is waited out as its Retry-After asks, MAX_RATE_LIMITED times in all.
            policy = STEP_LOG_RATE_LIMITED.replace(attempts=MAX_RATE_LIMITED - refused + 1)
            try:
                answer = policy.call(
                    partial(_get_bounded, http, url, MAX_STEPS_BYTES, {"cursor": cursor}),
                    again=rate_limited,
                    before_sleep=count_refusal,
                )
            except TRANSPORT_ERRORS as err:
                raise ReplicaUnreachable(
                    f"cannot reach the control API at {url}: "
                    f"{type(err).__name__}: {err or 'no answer'}"
                ) from None
            items, next_cursor, page = _step_page(url, answer)
            replica = page.get("replica", replica) if isinstance(page, dict) else replica
            if not items or next_cursor <= cursor:
                break
            steps.extend(items)
            cursor = next_cursor
    finally:
        if own:
            http.close()
    return replica, steps[:max_steps]


def fetch_engine_facts(
    control_url: str, *, timeout: float = 10.0, client: SyncClient | None = None
) -> dict[str, Any]:
    """The replica's block size, KV blocks and engine limits from its ``/state`` (the keys a
    replica does not report are left out). Raises :class:`ReplicaUnreachable`."""
    # Replica reads only (start-up cost, see _get_bounded):
    from controlplane.http import TRANSPORT_ERRORS, sync_client  # aiohttp
    from controlplane.replica_http import MAX_STATE_BYTES  # aiohttp, the contract's models
    from scheduler.contract import State, read  # the contract's models (~0.15 s)

    url = steps_url(control_url).removesuffix("/steps") + "/state"
    own = client is None
    http = sync_client(timeout) if client is None else client
    try:
        answer = _get_bounded(http, url, MAX_STATE_BYTES)
        if answer.status_code != 200:
            raise ReplicaUnreachable(
                f"{url} answered HTTP {answer.status_code}: {_text(answer.content, 200)}"
            )
        state: State = read(State, json.loads(answer.content))
    except TRANSPORT_ERRORS as err:
        raise ReplicaUnreachable(
            f"cannot reach {url}: {type(err).__name__}: {err or 'no answer'}"
        ) from None
    except ValueError as err:
        raise ReplicaUnreachable(f"{url} did not answer a state document: {err}") from None
    finally:
        if own:
            http.close()
    return _engine_facts(state)


def _engine_facts(state: State) -> dict[str, Any]:
    """The block size, KV blocks, prefix caching and engine limits a state document reports."""
    facts: dict[str, Any] = {}
    if state.kv is not None:
        if state.kv.block_size:
            facts["block_size"] = state.kv.block_size
        if state.kv.total_blocks:
            facts["num_gpu_blocks"] = state.kv.total_blocks
        if state.kv.prefix_caching is not None:
            facts["prefix_caching"] = state.kv.prefix_caching
    engine = (state.settings or {}).get("engine") or {}
    for key in ("max_num_seqs", "max_num_batched_tokens", "long_prefill_token_threshold"):
        if isinstance(engine.get(key), int):
            facts[key] = engine[key]
    return facts


def engine_config(
    facts: dict[str, Any], model: StepTimeModel
) -> tuple[EngineConfig, dict[str, Any]]:
    """(EngineConfig, engine settings) for replaying the replica ``facts`` describe with ``model``:
    its block size, KV blocks and prefix caching, its limits (the simulator's defaults where it
    reported none)."""
    # Replays only: the engine's import costs ~0.5 s of start-up to `tailpilot calibrate`.
    from sim.engine import EngineConfig

    kw: dict[str, Any] = {"step_model": model}
    for key in ("block_size", "num_gpu_blocks", "prefix_caching"):
        if key in facts:
            kw[key] = facts[key]
    limits: dict[str, Any] = {
        k: facts[k]
        for k in ("max_num_seqs", "max_num_batched_tokens", "long_prefill_token_threshold")
        if k in facts
    }
    return EngineConfig(**kw), limits


def replica_engine(
    store: Store,
    cluster: str,
    replica: str,
    facts: dict[str, Any] | None = None,
    step_model: str | None = None,
) -> tuple[EngineConfig, dict[str, Any]]:
    """(EngineConfig, engine limits) for replaying ``replica``: the named step model, else its
    calibrated one (``calibrated/<replica>``) if saved, else the default; its engine ``facts``
    (:func:`fetch_engine_facts`), the KV blocks its newest stored sample reports where the facts
    have none."""
    name = step_model or (
        f"calibrated/{replica}" if f"calibrated/{replica}" in list_models() else DEFAULT_MODEL_NAME
    )
    facts = dict(facts or {})
    if "num_gpu_blocks" not in facts:
        latest = store.readings.latest_samples(cluster).get(replica)
        if latest is not None and latest.kv_total_blocks:
            facts["num_gpu_blocks"] = latest.kv_total_blocks
    return engine_config(facts, get_model(name))


# ---------------------------------------------------------------------------------------------
# finding a replica in the store
# ---------------------------------------------------------------------------------------------


def replica_control_url(store: Store, replica: str, cluster: str | None = None) -> tuple[str, str]:
    """(cluster, control URL) of ``replica`` as the store knows it (``tailpilot record`` registers
    replicas). Without ``cluster`` the name must be unique across clusters."""
    clusters = [cluster] if cluster else store.recordings.clusters()
    found = [(c, r) for c in clusters for r in store.recordings.replicas(c) if r.name == replica]
    if not found:
        where = f"cluster {cluster!r}" if cluster else "any cluster"
        known = sorted(
            f"{c}/{r.name}"
            for c in store.recordings.clusters()
            for r in store.recordings.replicas(c)
        )
        raise CalibrationError(
            f"replica {replica!r} is not in the store ({where}); known: "
            f"{', '.join(known) or 'none (run `tailpilot record` first)'}"
        )
    if len(found) > 1:
        raise CalibrationError(
            f"replica {replica!r} is in several clusters "
            f"({', '.join(c for c, _ in found)}); name one with --cluster-name"
        )
    c, info = found[0]
    if not info.control_url:
        raise CalibrationError(
            f"the store has no control URL for replica {replica!r} of cluster {c!r}"
        )
    return c, info.control_url

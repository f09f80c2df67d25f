"""The control API's documents: one typed contract for the plugin, the twin and the collector.

``ReplicaCore`` (the plugin and the twin replicas) sends these documents; the collector reads them
through the same models. Producers are held to the models strictly (tests validate what the
plugin and the twin send). A reader is lenient where a replica's fault must not stop the
recording: read with ``context={"lenient": True}`` an optional field of the wrong type or a
non-finite number becomes null, while the fields a reader cannot do without (``completions``,
``next_cursor``) still fail, naming the field. The JSON Schema of every document is
``tailpilot schema`` (committed as docs/control-api.schema.json); docs/control-api.md describes
them.

Imports only pydantic: the plugin loads this module inside vLLM's process.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    WrapValidator,
)

from scheduler.names import DEFAULT_TENANT, DEFAULT_TYPE
from scheduler.validation import describe_validation

API_VERSION = 1
# Characters of a breaker's last error a replica sends and a reader keeps (an exception's text may
# quote a tenant's data: a line, not a dump).
BREAKER_ERROR_CHARS = 300
# Requests one /inflight answer lists at most (the oldest): about 200 bytes each.
INFLIGHT_LIMIT = 1_000


def _lenient(value: Any, handler: ValidatorFunctionWrapHandler, info: ValidationInfo) -> Any:
    """Strict validation, except that a lenient reader takes a bad value as null."""
    if (
        isinstance(value, float)
        and not math.isfinite(value)
        and info.context
        and info.context.get("lenient")
    ):
        return None
    try:
        return handler(value)
    except ValidationError:
        if info.context and info.context.get("lenient"):
            return None
        raise


def _finite(value: Any, handler: ValidatorFunctionWrapHandler, info: ValidationInfo) -> Any:
    out = handler(value)
    if isinstance(out, float) and not math.isfinite(out):
        raise ValueError("must be a finite number")
    return out


# Optional values a lenient reader may find broken (→ null); producers must send them right.
OptInt = Annotated[int | None, WrapValidator(_lenient)]
OptFloat = Annotated[float | None, WrapValidator(_lenient), WrapValidator(_finite)]
OptStr = Annotated[str | None, WrapValidator(_lenient)]
OptObject = Annotated[dict[str, Any] | None, WrapValidator(_lenient)]
OptCounts = Annotated[dict[str, int] | None, WrapValidator(_lenient)]  # counts by tenant or type
OptBool = Annotated[bool | None, WrapValidator(_lenient)]
Time = Annotated[float, WrapValidator(_finite)]


class _Doc(BaseModel):
    # A newer replica may add fields: readers keep and ignore them. Booleans are never numbers.
    model_config = ConfigDict(extra="allow", strict=True, ser_json_inf_nan="null")


class Completion(_Doc):
    """One finished request in a replica's completions log (engine-side timestamps, seconds).
    A reader validates each entry on its own, not leniently: a broken entry is skipped whole (and
    counted), never stored half-null. Integral floats (``64.0``) are taken as integers."""

    model_config = ConfigDict(extra="allow", strict=False, ser_json_inf_nan="null")

    seq: OptInt = Field(
        None, ge=0, description="position in the replica's completions log (always sent)"
    )
    id: str
    tenant: str = DEFAULT_TENANT
    type: str = DEFAULT_TYPE
    arrival: Time = Field(description="when the API server got it")
    received_at: OptFloat = Field(
        None, description="when the engine core got it (null: not recorded)"
    )
    scheduled_at: OptFloat = Field(None, description="first admission")
    first_token_at: OptFloat = None
    finished_at: Time
    prompt_tokens: int = Field(0, ge=0)
    output_tokens: int = Field(0, ge=0)
    max_tokens: OptInt = Field(None, description="the client's cap (null: not recorded)")
    preemptions: int = Field(0, ge=0)
    recomputed_tokens: int = Field(0, ge=0)
    reason: str = Field("finished", description="finished, aborted, length, ...")


class KvState(_Doc):
    used_blocks: OptInt = None
    total_blocks: OptInt = None
    usage: OptFloat = Field(None, description="used / total, 0..1")
    block_size: OptInt = Field(None, description="tokens per KV block")
    prefix_caching: OptBool = Field(
        None,
        description="vLLM's enable_prefix_caching: a preempted request's freed blocks keep their "
        "hashes until reused (null: not reported)",
    )


class Breaker(_Doc):
    """The plugin's circuit breaker: a policy that raised inside the engine's step was replaced by
    the last settings that ran (else vLLM's stock scheduler) instead of stopping the engine."""

    trips_total: OptInt = Field(
        None, description="times a policy raised inside a step and was replaced"
    )
    last_error: OptStr = Field(
        None,
        description=f"the last failure, 'ExceptionType: message' "
        f"(at most {BREAKER_ERROR_CHARS} chars)",
    )
    last_at: OptFloat = Field(None, description="when it last tripped (replica clock, s)")
    failed_version: OptInt = Field(None, description="the settings version that raised")
    fallback_version: OptInt = Field(
        None, description="the version fallen back to (null: vLLM's stock order)"
    )


class State(_Doc):
    """``GET /state[?cursor=N]``: the replica's queue, KV, live policy state and, for a cursor, a
    page of completions since it."""

    replica: OptStr = None
    instance: OptStr = Field(
        None, description="a fresh id per process start; the cursor counts in it"
    )
    time: OptFloat = Field(None, description="the replica's clock, seconds")
    policy: OptStr = None
    settings: OptObject = Field(None, description="the active settings document")
    settings_version: OptInt = None
    pending_version: OptInt = Field(
        None, description="a staged document's version, until a step applies it"
    )
    waiting: OptInt = None
    running: OptInt = None
    waiting_by_tenant: OptCounts = None
    waiting_by_type: OptCounts = None
    tenant_source: OptStr = Field(
        None,
        description="who names a request's tenant: client (its own label), gateway (a "
        "signed label), none (every request 'default')",
    )
    kv: Annotated[KvState | None, WrapValidator(_lenient)] = None
    gamma_live: OptFloat = None
    beta_live: OptFloat = None
    live: OptObject = Field(None, description="the policy's adaptive state (γ, β, counters)")
    preemptions_total: OptInt = None
    recomputed_tokens_total: OptInt = None
    refused_total: OptInt = Field(
        None, description="requests refused on arrival (a tenant's queue cap)"
    )
    finished_total: OptInt = None
    steps_total: OptInt = None
    # Raw entries: a reader validates each as a Completion on its own, so one broken entry is
    # skipped (and counted) instead of losing the page.
    completions: list[Any] = Field(
        description="Completion documents since the cursor, in seq order"
    )
    next_cursor: int = Field(ge=0, description="the cursor for the next page")
    more: OptBool = Field(None, description="another page follows at next_cursor")
    speed: OptFloat = Field(None, description="twin replicas: clock speed")
    breaker: Annotated[Breaker | None, WrapValidator(_lenient)] = Field(
        None, description="the circuit breaker's counters (absent: never built)"
    )
    leases: OptObject = Field(
        None,
        description="the controllers' live leases: kind (autopilot, governor) -> holder and "
        "expires_in_s (scheduler.plugin.lease)",
    )


class LeaseAnswer(_Doc):
    """The answer to ``PUT /lease``: who holds the kind's lease now, for how long (seconds; 0 and
    no holder: released)."""

    controller: str
    holder: str | None = None
    expires_in_s: float = Field(ge=0.0)


class Step(_Doc):
    """One engine step, for calibrating the simulator's step-time model."""

    seq: int = Field(ge=0)
    started: Time
    duration_s: Time
    prefill_tokens: int = Field(ge=0)
    sum_prefill_sq: int = Field(ge=0)
    decode_seqs: int = Field(ge=0)
    sum_kv_context: int = Field(ge=0)


class StepsPage(_Doc):
    """``GET /steps?cursor=N``."""

    steps: list[Step]
    next_cursor: int = Field(ge=0)
    more: bool | None = None


class SettingsAnswer(_Doc):
    """``GET /settings`` and the answer to ``PUT /settings``."""

    settings: dict[str, Any]
    version: int = Field(ge=0)
    replica: OptStr = None
    restart_required: list[str] | None = Field(
        None, description="PUT only: engine fields that need a restart"
    )


class InflightRequest(_Doc):
    """One request the replica holds (waiting or running): what it knows of it — never its output
    length, which nobody knows before it finishes."""

    id: str
    tenant: str = DEFAULT_TENANT
    type: str = DEFAULT_TYPE
    arrival: Time = Field(description="when the API server got it")
    received_at: OptFloat = Field(None, description="when the engine core got it")
    prompt_tokens: int = Field(0, ge=0)
    max_tokens: OptInt = Field(None, description="the client's cap")
    generated: int = Field(0, ge=0, description="output tokens so far")
    status: OptStr = Field(None, description="waiting | running | ...")


class Inflight(_Doc):
    """``GET /inflight[?limit=N]``: the requests in flight, oldest first (at most ``limit``,
    default and most ``INFLIGHT_LIMIT``), for a controller that replays the replica's traffic."""

    instance: OptStr = None
    time: OptFloat = Field(None, description="the replica's clock, seconds")
    total: int = Field(ge=0, description="requests in flight, listed or not")
    requests: list[InflightRequest]


class ErrorAnswer(_Doc):
    """Every 4xx/5xx answer."""

    error: str


DOCUMENTS: dict[str, type[BaseModel]] = {
    "state": State,
    "breaker": Breaker,
    "completion": Completion,
    "steps": StepsPage,
    "step": Step,
    "settings": SettingsAnswer,
    "lease": LeaseAnswer,
    "inflight": Inflight,
    "error": ErrorAnswer,
}


def read(model: type[BaseModel], doc: Any, *, lenient: bool = True) -> Any:
    """``doc`` as ``model``: lenient (a reader's view) or strict (what a producer must send).
    Raises ValidationError naming the field."""
    return model.model_validate(doc, context={"lenient": lenient})


def describe(err: ValidationError) -> str:
    """A one-line message naming the first bad field: ``next_cursor: Input should be ...``."""
    return describe_validation(err, first_only=True)


def json_schema() -> dict[str, Any]:
    """The JSON Schema of every control-API document, keyed by document name."""
    return {
        "api_version": API_VERSION,
        "documents": {name: model.model_json_schema() for name, model in DOCUMENTS.items()},
    }

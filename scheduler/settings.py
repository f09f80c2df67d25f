"""The one settings model (docs/policies.md#settings-document), shared by the plugin, the control
API, the simulator, the TUI, the tuner and export.

A settings document names a policy, that policy's parameters, which parameters are pinned
(never moved by adaptation or by an applied recommendation) and the engine limits:

    {"policy": "uniboost", "params": {"gamma": 8.0}, "pinned": ["gamma"],
     "engine": {"max_num_seqs": 256, "max_num_batched_tokens": 2048,
                "long_prefill_token_threshold": 0}}

Every error names the field it is about (``params.gamma``, ``engine.max_num_seqs``, ...).
"""

from __future__ import annotations

import itertools
import json
from functools import cached_property
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from scheduler.names import DEFAULT_TENANT, NAME_MAX_CHARS
from scheduler.validation import (
    describe_validation,
    field_path,
    is_control,
    join_errors,
    readable,
)

POLICY_NAMES = (
    "fcfs",
    "sarathi",
    "sjf",
    "srpt",
    "las",
    "distboost",
    "uniboost",
    "tie",
    "vtc",
    "slofq",
)
PolicyName = Literal[
    "fcfs", "sarathi", "sjf", "srpt", "las", "distboost", "uniboost", "tie", "vtc", "slofq"
]
PredictorName = Literal["oracle", "history"]


# Safe bounds: every document the model accepts must run (issue 21). The policies compute in
# float64 seconds and tokens; within these ranges every product and quotient stays finite and
# every float-to-int conversion in range, whatever the other parameters
# (tests/test_settings_safety.py steps vLLM's scheduler and the simulator through each policy's
# whole schema, extremes and sequences of switches included).
MIN_DURATION_S = (
    1e-3  # finer than any engine step (~10 ms); a 5e-324 s interval ticks every step for ever
)
MAX_DURATION_S = 86_400.0  # a day: longer spans mean "never"
MIN_S_PER_TOKEN = 1e-9  # an A100 prefills a token in ~70 µs; 1 ns keeps score / cost below 1e17
MAX_TOKENS = 10_000_000  # longer than any model's context; token margins beyond it mean "never"
MIN_SHARE = 1e-6  # weights, throttles, shares and rates: ratios of them stay within 1e±12
MAX_WEIGHT = 1e6
GAMMA_MIN_SAFE, GAMMA_MAX_SAFE = 1e-6, 1e6  # 1/s: b_γ(w) stays finite for w >= MIN_S_PER_TOKEN
# The useful range of γ (1/s): γ-Ada's clamps by default, and the autopilot's grid.
GAMMA_USEFUL_MIN, GAMMA_USEFUL_MAX = 0.001, 10.0
# Scores are seconds (arrival − boost, boosts capped at 1e9 s): a margin of 1e12 already means
# "never preempt", and score + margin stays exact enough to compare.
MAX_SCORE_MARGIN = 1e12


# Tenant and request-type names (bound and defaults: scheduler.names) must be text every reader
# can carry: /state, the recorder's database, the TUI.


def _unreadable(ch: str) -> bool:
    """A control character or a lone surrogate (UTF-8, JSON readers and databases refuse it)."""
    return is_control(ch) or "\ud800" <= ch <= "\udfff"


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot be a tenant or type name, None when it can."""
    if not name:
        return "must not be empty"
    if len(name) > NAME_MAX_CHARS:
        return f"{len(name)} characters, over the limit of {NAME_MAX_CHARS}"
    bad = next((ch for ch in name if _unreadable(ch)), None)
    if bad is not None:
        return f"holds U+{ord(bad):04X} (no control characters or lone surrogates)"
    return None


def _check_name(name: str) -> str:
    if (problem := name_problem(name)) is not None:
        raise ValueError(f'name "{readable(name)}": {problem}')
    return name


# A tenant or type name in a settings document (a key of weights, tenants, throttle, type_shares).
Name = Annotated[str, AfterValidator(_check_name)]


def clean_name(raw: object, default: str = DEFAULT_TENANT) -> str:
    """A client's tenant (or type) label as a name every reader can carry: missing or empty is
    ``default``; control characters and lone surrogates become U+FFFD; cut to ``NAME_MAX_CHARS``.
    The engine never refuses a request over its label."""
    name = default if raw is None else str(raw)[:NAME_MAX_CHARS]
    if not name:
        return default
    if name_problem(name) is None:
        return name
    return "".join("\ufffd" if _unreadable(ch) else ch for ch in name)


class _Strict(BaseModel):
    # strict: a string or a boolean is never taken for a number ("5", true); finite: NaN and
    # Infinity would reach /state, and JSON readers (PostgreSQL's jsonb among them) refuse them.
    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, frozen=True, strict=True, allow_inf_nan=False
    )


class NoParams(_Strict):
    """fcfs and sarathi have no parameters."""


class PreemptiveParams(_Strict):
    # Hysteresis for policy-driven preemption, in score units (docs/policies.md, condition (b)).
    preempt_margin: float = Field(0.0, ge=0.0, le=MAX_SCORE_MARGIN)


class PredictedParams(_Strict):
    """What the policies ranking by predicted output length (sjf, srpt, tie) share."""

    predictor: PredictorName = "history"
    # The simulator's oracle only: each request gets a log-t length distribution around its true
    # length, of log-scale σᵢ with mean sigma_noise, spread across requests by sigma_spread
    # (0: the same σ for every request).
    sigma_noise: float = Field(0.0, ge=0.0, le=5.0)
    sigma_spread: float = Field(0.0, ge=0.0, le=5.0)


class SjfParams(PredictedParams):
    starve_steps: int = Field(200, ge=1, le=1_000_000)
    quantum_steps: int = Field(10, ge=1, le=1_000_000)


class SrptParams(PredictedParams):
    c: float = Field(0.6, gt=0.0, le=10.0)
    # srpt's preemption hysteresis: scores are tokens, so the margin is too.
    margin_tokens: int = Field(0, ge=0, le=MAX_TOKENS)


class LasParams(PreemptiveParams):
    q0_s: float = Field(0.01, ge=MIN_DURATION_S, le=100.0)
    starve_s: float = Field(3.0, ge=MIN_DURATION_S, le=MAX_DURATION_S)
    alpha_s_per_token: float = Field(64e-6, ge=MIN_S_PER_TOKEN, le=1.0)


# γ is a tail decay rate in 1/s (seed 000/002): the FCFS response-time tail P(T > t) ~ e^{-γt}.
# Measured near saturation: ≈ 0.05–0.15 /s for chat and code, ≈ 0.007–0.02 /s for reasoning mixes.
GAMMA_DEFAULT = 0.1
# γ-Ada's floor, gamma_min's default. Its fit reads the tail of a queue that empties now and then;
# in sustained overload the FCFS-equivalent waits of its window grow with the queue (and the
# drain rate they divide by falls as short prompts are admitted first), the growth reads as a
# long tail, and with no floor γ went down to 0.001 /s: long prompts held back behind newer short
# ones for the rest of the overload (README, "γ-Ada's floor": the defaults broke one of sarathi's
# quantiles on 17 of 100 random variants, 9 with this floor; the README's workloads never reach it).
GAMMA_ADA_FLOOR = 0.0464


class DistBoostParams(_Strict):
    gamma: float = Field(GAMMA_DEFAULT, ge=GAMMA_MIN_SAFE, le=GAMMA_MAX_SAFE)
    alpha_s_per_token: float = Field(64e-6, ge=MIN_S_PER_TOKEN, le=1.0)


class UniBoostParams(PreemptiveParams):
    gamma: float = Field(GAMMA_DEFAULT, ge=GAMMA_MIN_SAFE, le=GAMMA_MAX_SAFE)
    alpha_s_per_token: float = Field(64e-6, ge=MIN_S_PER_TOKEN, le=1.0)
    memguard: bool = True
    quant_base_tokens: int = Field(256, ge=1, le=1_000_000)
    quant_ratio: float = Field(2.0, gt=1.0, le=64.0)
    gamma_ada: bool = True
    gamma_min: float = Field(GAMMA_ADA_FLOOR, ge=GAMMA_MIN_SAFE, le=GAMMA_MAX_SAFE)
    gamma_max: float = Field(GAMMA_USEFUL_MAX, ge=GAMMA_MIN_SAFE, le=GAMMA_MAX_SAFE)
    ada_ema: float = Field(0.3, gt=0.0, le=1.0)
    ada_interval_s: float = Field(5.0, ge=MIN_DURATION_S, le=MAX_DURATION_S)
    ada_window: int = Field(2000, ge=10, le=1_000_000)
    ada_min_samples: int = Field(200, ge=1, le=1_000_000)
    # γ is re-applied (a new epoch: every waiting key re-derived) only once its smoothed value has
    # moved this fraction away from the applied one; 0 re-applies at every tick.
    ada_deadband: float = Field(0.02, ge=0.0, le=1.0)
    # Multiplies γ-Ada's target γ, the fitted slope ln 5 / (t99 − t95), before smoothing and
    # clamping (1: the slope itself). Positive and within the share bounds, so the product stays
    # finite or +inf (clamped to gamma_max), never 0 · inf.
    ada_scale: float = Field(1.0, ge=MIN_SHARE, le=MAX_WEIGHT)
    # What γ-Ada fits its tail slope to. "fcfs_wait": each arrival's FCFS-equivalent wait (the
    # prompt and recompute tokens queued ahead of it over the recent admission rate) — the FCFS
    # tail whose decay rate the theory asks for, and the same whichever order is served, so γ
    # cannot feed on the starvation it causes. "ttlt"/"ttft": the served requests' own latencies
    # (the written stage-4 rule is "ttlt", end-to-end; under a small γ its tail is the starved long
    # requests' and γ spirals down to gamma_min — README, "γ-Ada's signal").
    ada_signal: Literal["fcfs_wait", "ttlt", "ttft"] = "fcfs_wait"
    # Running decodes take the step's token budget before any prefill chunk (seed stage 1,
    # Sarathi); the score still decides admission and preemption victims.
    decode_first: bool = True
    # The hold-back bound: a request waiting this long since its arrival is overdue and goes
    # ahead of every request that is not, overdue requests in arrival order (FCFS among them),
    # and stays ahead until it finishes — however small γ, no request waits behind newer short
    # ones for longer than this (None: no bound, γ alone decides).
    hold_bound_s: float | None = Field(None, ge=MIN_DURATION_S, le=MAX_DURATION_S)
    # Policy preemption that does not waste work (recompute throws the victim's KV away):
    # preempt when the only shortage is a sequence slot (KV has room), or only for KV;
    preempt_for_seats: bool = True
    # the waiting request must beat the victim by the victim's own recompute time, α·(prompt +
    # generated) seconds, on top of preempt_margin;
    preempt_recompute_cost: bool = False
    # at most this many policy preemptions per step (0: no limit);
    preempt_per_step: int = Field(0, ge=0, le=1_000_000)
    # only while the batch is less full than this: the larger of the seats and the KV blocks in
    # use (seed 003 §3: "only below 80% batch utilisation"; a recompute costs most when it is full;
    # None: whatever the utilisation).
    preempt_max_utilisation: float | None = Field(0.8, gt=0.0, le=1.0)
    # who is the memory-pressure victim: "score" the worst-scored (MemGuard: unguarded first),
    # which is the request with the most attained work, the costliest to recompute; "newest" the
    # last-arrived decode, as stage 1 and vLLM do (prefills still by score, after decodes;
    # decode_first only — without it the running order is the budget order and stays by score).
    kv_victim: Literal["score", "newest"] = "newest"
    # A request preempted for KV goes back ahead of every waiting request (among such, by
    # arrival), as vLLM's own scheduler puts it back at the front: readmitted soon, it finds the
    # blocks of its prefix still in vLLM's prefix cache instead of recomputing them
    # (docs/policies.md#victims-first). False: it waits by its score like any other request (the
    # defaults until the engine modelled the cache: README, "Victims first").
    victims_first: bool = True

    @model_validator(mode="after")
    def _clamps_ordered(self) -> UniBoostParams:
        if self.gamma_min > self.gamma_max:
            raise ValueError(
                f"gamma_min ({self.gamma_min}) must not exceed gamma_max ({self.gamma_max})"
            )
        return self


class TieParams(PredictedParams):
    alpha: float = Field(0.9, gt=0.0, lt=1.0)
    beta: float = Field(0.1, ge=0.0, le=1.0)
    beta_min: float = Field(0.1, ge=0.0, le=1.0)
    beta_max: float = Field(0.5, ge=0.0, le=1.0)
    decay: float = Field(0.9, gt=0.0, le=1.0)
    tau_s: float = Field(30.0, ge=MIN_DURATION_S, le=MAX_DURATION_S)
    nu: float = Field(3.5, gt=1.0, le=1000.0)

    @model_validator(mode="after")
    def _clamps_ordered(self) -> TieParams:
        if self.beta_min > self.beta_max:
            raise ValueError(
                f"beta_min ({self.beta_min}) must not exceed beta_max ({self.beta_max})"
            )
        return self


class VtcParams(_Strict):
    weights: dict[Name, float] = Field(default_factory=dict, max_length=10_000)
    input_price: float = Field(1.0, ge=0.0, le=1e6)
    output_price: float = Field(2.0, ge=0.0, le=1e6)

    @field_validator("weights")
    @classmethod
    def _positive_weights(cls, weights: dict[str, float]) -> dict[str, float]:
        for tenant, w in weights.items():
            if not MIN_SHARE <= w <= MAX_WEIGHT:
                raise ValueError(
                    f"weight of tenant {tenant!r} must be in [{MIN_SHARE:g}, {MAX_WEIGHT:g}], "
                    f"got {w}"
                )
        return weights


QUANTILES = ("p50", "p90", "p99")


class QuantileSlo(_Strict):
    """Latency targets in seconds per quantile (seed 003: s_{j,50}, s_{j,90}, s_{j,99}); at least
    one, never a lower quantile above a higher one."""

    p50: float | None = Field(None, ge=MIN_DURATION_S, le=MAX_DURATION_S)
    p90: float | None = Field(None, ge=MIN_DURATION_S, le=MAX_DURATION_S)
    p99: float | None = Field(None, ge=MIN_DURATION_S, le=MAX_DURATION_S)

    @model_validator(mode="after")
    def _ordered(self) -> QuantileSlo:
        given = [(q, getattr(self, q)) for q in QUANTILES if getattr(self, q) is not None]
        if not given:
            raise ValueError("give at least one of p50, p90, p99 (seconds)")
        for (q1, v1), (q2, v2) in itertools.pairwise(given):
            if v1 > v2:
                raise ValueError(f"{q1} ({v1:g} s) must not exceed {q2} ({v2:g} s)")
        return self

    def targets(self) -> dict[str, float]:
        return {q: v for q in QUANTILES if (v := getattr(self, q)) is not None}


class TenantSlo(_Strict):
    """One tenant's share and SLOs (docs/policies.md#slofq)."""

    weight: float | None = Field(None, ge=MIN_SHARE, le=MAX_WEIGHT)
    # A committed token rate C_j (prompt + output tokens/s): the weight is proportional to it.
    commit_tok_s: float | None = Field(None, ge=1e-3, le=1e9)
    ttft: QuantileSlo | None = None
    ttlt: QuantileSlo | None = None
    # At most this many of the tenant's requests wait in the queue; a further one is refused on
    # arrival with the reason (off by default: backpressure holds requests, it never drops them).
    queue_cap: int | None = Field(None, ge=1, le=1_000_000)

    @model_validator(mode="after")
    def _one_share(self) -> TenantSlo:
        if self.weight is not None and self.commit_tok_s is not None:
            raise ValueError("give weight or commit_tok_s, not both")
        return self


def check_shares(shares: dict[str, float]) -> dict[str, float]:
    """Minimum type shares: each in (0, 1], at most 1 together."""
    for rtype, rho in shares.items():
        if not MIN_SHARE <= rho <= 1.0:
            raise ValueError(f"share of type {rtype!r} must be in [{MIN_SHARE:g}, 1], got {rho}")
    if sum(shares.values()) > 1.0 + 1e-9:
        raise ValueError(f"shares add up to {sum(shares.values()):g}; at most 1")
    return shares


DEFAULT_TENANT_SLO = {"ttft": {"p50": 1.0, "p90": 2.0, "p99": 4.0}}


class SloFqParams(_Strict):
    # Tenants by name; any other tenant is ``default_tenant``.
    tenants: dict[Name, TenantSlo] = Field(default_factory=dict, max_length=10_000)
    default_tenant: TenantSlo = Field(
        default_factory=lambda: TenantSlo.model_validate(DEFAULT_TENANT_SLO)
    )
    # "multi": a request's deadline is its tenant's tightest TTFT target missed in the sliding
    # window (else P99); "p99": always the P99 target (the governor's single-quantile mode).
    quantiles: Literal["multi", "p99"] = "multi"
    slo_window_s: float = Field(10.0, ge=MIN_DURATION_S, le=MAX_DURATION_S)
    # Token-level fair queue: counters in engine-seconds per unit of weight, prefill and decode
    # priced by the default step model (s per prefill token: b; per decoded token: d + e·1024).
    prefill_cost_s: float = Field(6.7e-5, ge=0.0, le=1.0)
    decode_cost_s: float = Field(1.12e-4, ge=0.0, le=1.0)
    # A tenant is within its fair share while its counter is at most this far ahead of the
    # least-served backlogged tenant's; among those the earliest deadline goes first.
    fair_lag_s: float = Field(0.5, ge=0.0, le=MAX_DURATION_S)
    # Consumption protection: a committed tenant's weight times min(C_j / U_j, alpha), U_j its
    # use over the window (None: off).
    protection_alpha: float | None = Field(4.0, ge=1.0, le=1e6)
    protection_window_s: float = Field(30.0, ge=MIN_DURATION_S, le=MAX_DURATION_S)
    # Request types: a minimum share rho_k of the served tokens per window. Explicit, or (empty)
    # rho_k = (1/|T|) / (1 + eta·p_k) from the observed shares p_k. "soft" lends unused reserve,
    # "hard" does not (no type takes more than 1 − the others' reserves), "off" ignores types.
    type_shares: dict[Name, float] = Field(default_factory=dict, max_length=1_000)
    type_eta: float = Field(0.5, ge=0.0, le=1e6)
    type_isolation: Literal["off", "soft", "hard"] = "soft"
    type_window_s: float = Field(10.0, ge=MIN_DURATION_S, le=MAX_DURATION_S)
    # Backpressure: a token bucket per tenant gating admission, its rate scaled every
    # bp_interval_s by s_99 / P99 (window P99 of TTFT and waiting ages) while the tenant is over
    # its P99 target and over its entitlement; nothing is dropped.
    backpressure: bool = True
    bp_interval_s: float = Field(0.1, ge=MIN_DURATION_S, le=60.0)
    bp_min_tok_s: float = Field(1.0, ge=1e-3, le=1e9)
    bp_burst_s: float = Field(1.0, ge=MIN_DURATION_S, le=3_600.0)
    # An empty bucket holds a tenant back only while another tenant has requests waiting; with
    # no one else waiting the capacity is lent (false: held whatever, not work-conserving).
    bp_lend: bool = True
    # Operator or governor throttles: tenant -> fraction (0, 1] of its use rate when set.
    throttle: dict[Name, float] = Field(default_factory=dict, max_length=10_000)
    preempt_margin: float = Field(0.0, ge=0.0, le=MAX_SCORE_MARGIN)
    # Policy preemption only while the batch is less full than this (seed 003 §5; None: always).
    preempt_max_utilisation: float | None = Field(0.8, gt=0.0, le=1.0)

    _shares = field_validator("type_shares")(check_shares)

    @field_validator("throttle")
    @classmethod
    def _fractions(cls, throttle: dict[str, float]) -> dict[str, float]:
        for tenant, f in throttle.items():
            if not MIN_SHARE <= f <= 1.0:
                raise ValueError(
                    f"throttle of tenant {tenant!r} must be in [{MIN_SHARE:g}, 1], got {f}"
                )
        return throttle

    def tenant(self, name: str) -> TenantSlo:
        return self.tenants.get(name, self.default_tenant)

    def ttft_slo(self, name: str) -> QuantileSlo | None:
        """The tenant's TTFT targets: its own, else ``default_tenant``'s (TTLT has no default)."""
        return self.tenant(name).ttft or self.default_tenant.ttft

    def base_weight(self, name: str) -> float:
        """ω_j before protection: ``weight``; with ``commit_tok_s`` seed 003's C_j / ΣC, scaled so
        the mean commitment weighs 1 (like ``weight: 1``); else 1."""
        spec = self.tenant(name)
        if spec.weight is not None:
            return spec.weight
        if spec.commit_tok_s is not None:
            return spec.commit_tok_s / self._mean_commit
        return 1.0

    @cached_property
    def _mean_commit(self) -> float:  # the document is frozen: computed once, not per token
        commits = [t.commit_tok_s for t in self.tenants.values() if t.commit_tok_s is not None]
        return sum(commits) / len(commits) if commits else 1.0


PARAM_MODELS: dict[str, type[_Strict]] = {
    "fcfs": NoParams,
    "sarathi": NoParams,
    "sjf": SjfParams,
    "srpt": SrptParams,
    "las": LasParams,
    "distboost": DistBoostParams,
    "uniboost": UniBoostParams,
    "tie": TieParams,
    "vtc": VtcParams,
    "slofq": SloFqParams,
}
# The policies that read a length predictor: those whose parameters name one (the one definition:
# the simulator, the plugin's switch and the CLI's --predictor read it).
PREDICTED_POLICIES: frozenset[str] = frozenset(
    name for name, model in PARAM_MODELS.items() if "predictor" in model.model_fields
)

# Which parameters adaptation may move; only these are meaningful to pin besides any other
# parameter (pinning a static parameter is allowed: it guards against applied recommendations).
ADAPTIVE_PARAMS = {"uniboost": ("gamma",), "tie": ("beta",)}


class EngineSettings(_Strict):
    """Engine limits the scheduler works within (vLLM's scheduler config). The defaults are vLLM's
    for an A100, the default step model's GPU (``sim.stepmodel.engine_defaults`` has the rest)."""

    max_num_seqs: int = Field(256, ge=1, le=65_536)
    max_num_batched_tokens: int = Field(2048, ge=1, le=1 << 22)
    # 0 = off; otherwise a prefill chunk never exceeds this many tokens.
    long_prefill_token_threshold: int = Field(0, ge=0, le=1 << 22)


# Engine fields vLLM cannot change without a restart; the control API reports them as such.
RESTART_REQUIRED_ENGINE_FIELDS = ("max_num_seqs", "max_num_batched_tokens")


def _prefix_errors(prefix: str, err: ValidationError) -> str:
    parts = []
    for e in err.errors():
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown parameter"
        parts.append(f"{field_path((prefix, *e['loc']))}: {msg}")
    return join_errors(parts)


# The largest settings document, as a client sends it (``json.dumps`` with its default
# separators): the model refuses a larger one, a replica's PUT takes a body up to this size
# (``scheduler.plugin.admission.Limits.max_body``) and export refuses to write one — so a document
# the tools accept is one every replica accepts (800 tenants' weights once passed the model and
# export, and every later PUT to that replica got 413). A typical document is ~1 KiB.
MAX_DOCUMENT_BYTES = 64 * 1024


class Settings(BaseModel):
    """A validated settings document. Immutable: a changed copy is a
    ``scheduler.settings_change.SettingsChange`` applied to it (the one path a change takes)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    policy: PolicyName = "sarathi"
    params: Any = Field(default_factory=dict)
    pinned: tuple[str, ...] = ()
    engine: EngineSettings = Field(default_factory=EngineSettings)

    @model_validator(mode="before")
    @classmethod
    def _validate_params(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        policy = data.get("policy", "sarathi")
        model = PARAM_MODELS.get(policy) if isinstance(policy, str) else None
        if model is None:
            return data  # the Literal on `policy` reports the unknown name
        raw = data.get("params")
        if raw is None:  # absent or null: the policy's defaults (0, "", [] or false are errors)
            raw = {}
        if isinstance(raw, BaseModel):
            raw = raw.model_dump()
        if not isinstance(raw, dict):
            raise ValueError(f"params: must be an object, got {type(raw).__name__}")
        try:
            data["params"] = model.model_validate(raw)
        except ValidationError as err:
            raise ValueError(_prefix_errors("params", err)) from None
        pinned = data.get("pinned")
        if pinned is None:
            pinned = ()
        if not isinstance(pinned, (list, tuple)) or not all(isinstance(p, str) for p in pinned):
            raise ValueError("pinned: must be a list of parameter names")
        for name in pinned:
            if name not in model.model_fields:
                valid = ", ".join(model.model_fields) or "none"
                raise ValueError(
                    f"pinned: {name!r} is not a parameter of {policy} (valid: {valid})"
                )
        data["pinned"] = tuple(dict.fromkeys(pinned))
        return data

    @model_validator(mode="after")
    def _fits_a_put(self) -> Settings:
        size = len(json.dumps(self.to_dict()).encode())
        if size > MAX_DOCUMENT_BYTES:
            raise ValueError(
                f"document: {size} bytes as JSON, over the {MAX_DOCUMENT_BYTES} a replica's PUT "
                "accepts (fewer tenants or weights)"
            )
        return self

    def param(self, name: str) -> Any:
        return getattr(self.params, name)

    def is_pinned(self, name: str) -> bool:
        return name in self.pinned

    def to_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "params": self.params.model_dump(),
            "pinned": list(self.pinned),
            "engine": self.engine.model_dump(),
        }


def describe_error(err: Exception) -> str:
    """One line naming each invalid field, for CLI messages and API answers."""
    if isinstance(err, ValidationError):
        return describe_validation(err, root="settings")
    return str(err)

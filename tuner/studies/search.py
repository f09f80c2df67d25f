"""The tuner's search space (docs/engine.md#tuner); its objectives and constraints are
``tuner/studies/objectives.py``.

Search space
------------
Every range is derived from the one settings model (``scheduler.settings``): a parameter's
bounds are its pydantic ``Field`` constraints (``gt/ge/lt/le``), and the searched span is a
window *inside* those bounds around a centre — the production value when the production settings
run the same policy, else the model's default (γ: the FCFS tail estimate γ̂,
docs/policies.md#uniboost):

* γ → log scale over ``GAMMA_RANGE`` (1e-4 .. 10 /s);
* positive centre  → log scale, ``[centre / SPAN, centre · SPAN]`` (SPAN = 4) clipped to
  the bounds (an open bound ``gt``/``lt`` is stepped inside by 0.1% of the span);
* zero centre, both bounds finite → linear over the bounds;
* zero centre and no upper bound, or a margin whose bound is only a safety limit
  (``preempt_margin``, ``margin_tokens``) → not searched unless ``--range`` gives a span;
* ``bool`` → categorical ``[False, True]``; strings, literals and dicts are never searched.

Not searched: ``predictor`` (the tuner replays with the ``history`` predictor, the only one a
live replica has) and ``sigma_noise`` (an oracle-noise knob of the simulator); an adaptive
parameter (``ADAPTIVE_PARAMS``) only when the model has a switch for its adaptation
(``gamma`` has ``gamma_ada``; TIE's ``beta`` is overwritten by adaptive β unless pinned); and
parameters the production settings pin (docs/policies.md#settings-document: recommendations never
move them).

Engine fields (``EngineSettings``) are searched the same way around the production engine;
``long_prefill_token_threshold`` (0 = off) is an on/off switch plus a log-scaled chunk size.

Parameter names are ``<policy>.<name>`` and ``engine.<field>``; with more than one candidate
policy (the production policy is always a candidate, so trial 0 can be the production settings),
``policy`` is a categorical parameter and the policy parameters are conditional on it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from annotated_types import Ge, Gt, Le, Lt
from pydantic import BaseModel

from scheduler.errors import TailpilotError
from scheduler.settings import (
    ADAPTIVE_PARAMS,
    PARAM_MODELS,
    EngineSettings,
    Settings,
    describe_error,
)
from scheduler.settings_change import split_assignment

if TYPE_CHECKING:  # the trials come from Optuna, which this module does not need to import
    from optuna import Trial

SPAN = 4.0  # log-scaled ranges reach centre/SPAN .. centre*SPAN
# γ is searched over its whole useful range on a log scale, not around an estimate: the FCFS tail
# estimate γ̂ missed the winners by 3-60x on unseen traces (issue 22), and the best fixed γ of the
# autopilot benchmark lies at 0.001-0.2 /s. Below 1e-4 /s the order is size order for any request
# mix, above 10 /s it is arrival order (benchmarks/autopilot.py).
GAMMA_RANGE = (1e-4, 10.0)
SIM_ONLY_PARAMS = frozenset({"predictor", "sigma_noise", "sigma_spread"})
# Margins default to 0 and their upper bounds are safety limits (scheduler.settings: a margin of
# 1e12 s means "never preempt"), not a scale to search on: searched only when --range gives one.
UNSCALED_PARAMS = frozenset({"preempt_margin", "margin_tokens"})
# Searched only when --range gives a range: γ-Ada's ada_scale moves the same γ that is already
# searched over its whole range (benchmarks/defaults_rule.py measured what it does).
RANGE_ONLY_PARAMS = frozenset({"ada_scale"})
ENGINE_PREFIX = "engine."
THRESHOLD = "long_prefill_token_threshold"
CHUNKING_SWITCH = "engine.long_prefill_chunking"  # the on/off half of the threshold
POLICY_PARAM = "policy"


class SearchSpaceError(TailpilotError, ValueError):
    """A bad --range/--fix/--search, naming the option and the parameter."""


# --------------------------------------------------------------------------------------------
# Dimensions
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Dim:
    """One searched parameter: float/int (low, high, log) or categorical (choices)."""

    name: str
    kind: str  # "float" | "int" | "categorical"
    low: float | None = None
    high: float | None = None
    log: bool = False
    choices: tuple[Any, ...] = ()

    def suggest(self, trial: Trial) -> Any:
        if self.kind in ("float", "int"):
            # A numeric dimension always has both ends.
            assert self.low is not None and self.high is not None
            if self.kind == "float":
                return trial.suggest_float(self.name, self.low, self.high, log=self.log)
            return trial.suggest_int(self.name, int(self.low), int(self.high), log=self.log)
        return trial.suggest_categorical(self.name, list(self.choices))

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "kind": self.kind}
        if self.kind == "categorical":
            d["choices"] = list(self.choices)
        else:
            d.update(low=self.low, high=self.high, log=self.log)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Dim:
        return cls(
            name=d["name"],
            kind=d["kind"],
            low=d.get("low"),
            high=d.get("high"),
            log=bool(d.get("log", False)),
            choices=tuple(d.get("choices", ())),
        )

    def describe(self) -> str:
        if self.kind == "categorical":
            return f"{self.name} in {list(self.choices)}"
        fmt = (lambda v: f"{int(v)}") if self.kind == "int" else (lambda v: f"{v:.4g}")
        return f"{self.name} in [{fmt(self.low)}, {fmt(self.high)}]{' log' if self.log else ''}"


@dataclass(frozen=True)
class Bounds:
    lo: float | None
    hi: float | None
    lo_open: bool
    hi_open: bool


def field_bounds(model: type[BaseModel], name: str) -> Bounds:
    """The ``gt/ge/lt/le`` constraints of a pydantic field."""
    lo = hi = None
    lo_open = hi_open = False
    for m in model.model_fields[name].metadata:
        if isinstance(m, Ge):
            lo, lo_open = float(m.ge), False  # type: ignore[arg-type]  # typed SupportsGe; a number here
        elif isinstance(m, Gt):
            lo, lo_open = float(m.gt), True  # type: ignore[arg-type]  # typed SupportsGt; a number here
        elif isinstance(m, Le):
            hi, hi_open = float(m.le), False  # type: ignore[arg-type]  # typed SupportsLe; a number here
        elif isinstance(m, Lt):
            hi, hi_open = float(m.lt), True  # type: ignore[arg-type]  # typed SupportsLt; a number here
    return Bounds(lo, hi, lo_open, hi_open)


def _admits(b: Bounds, v: float) -> bool:
    if b.lo is not None and (v < b.lo or (b.lo_open and v == b.lo)):
        return False
    return not (b.hi is not None and (v > b.hi or (b.hi_open and v == b.hi)))


def numeric_dim(
    name: str,
    kind: str,
    bounds: Bounds,
    centre: float,
    override: tuple[float, float, bool | None] | None = None,
    span: float = SPAN,
) -> Dim | None:
    """A float/int dimension inside ``bounds`` around ``centre`` (see the module docstring)."""
    if override is not None:
        lo, hi, log = _checked_override(name, bounds, override)
    else:
        centred = _centred_span(bounds, centre, span)
        if centred is None:
            return None  # no scale to search on without --range
        lo, hi, log = centred
    if kind == "int":
        lo = math.floor(lo) + 1 if (bounds.lo_open and lo == bounds.lo) else math.ceil(lo)
        hi = math.ceil(hi) - 1 if (bounds.hi_open and hi == bounds.hi) else math.floor(hi)
        if log and lo < 1:
            lo = 1
    if not lo < hi:
        return None
    return Dim(
        name,
        kind,
        float(lo) if kind == "float" else int(lo),
        float(hi) if kind == "float" else int(hi),
        bool(log),
    )


def _checked_override(
    name: str, bounds: Bounds, override: tuple[float, float, bool | None]
) -> tuple[float, float, bool]:
    """A ``--range`` span, refused unless inside the model's bounds; its scale (log when not given
    and the span covers two decades)."""
    lo, hi, log = override
    for v, side in ((lo, "low"), (hi, "high")):
        if not _admits(bounds, v):
            raise SearchSpaceError(
                f"--range {name}: {side} end {v:g} is outside the settings model's bounds "
                f"[{_fmt_bound(bounds.lo, bounds.lo_open, True)}, "
                f"{_fmt_bound(bounds.hi, bounds.hi_open, False)}]"
            )
    if not lo < hi:
        raise SearchSpaceError(f"--range {name}: low ({lo:g}) must be below high ({hi:g})")
    if log is None:
        log = lo > 0 and hi / lo >= 100
    if log and lo <= 0:
        raise SearchSpaceError(f"--range {name}: a log range needs low > 0")
    return lo, hi, log


def _centred_span(bounds: Bounds, centre: float, span: float) -> tuple[float, float, bool] | None:
    """``[centre / span, centre * span]`` on a log scale (a zero centre: the bounds, linear),
    clipped to the bounds; None when there is no scale to search on."""
    if centre > 0:
        lo, hi, log = centre / span, centre * span, True
    elif bounds.lo is not None and bounds.hi is not None:
        lo, hi, log = bounds.lo, bounds.hi, False
    else:
        return None
    if bounds.lo is not None and lo <= bounds.lo:
        lo = bounds.lo
        if bounds.lo_open:  # step inside an open bound, by a sliver of the searched span
            lo = lo + 1e-3 * (min(hi, bounds.hi if bounds.hi is not None else hi) - lo)
    if bounds.hi is not None and hi >= bounds.hi:
        hi = bounds.hi
        if bounds.hi_open:
            hi = hi - 1e-3 * (hi - lo)
    if lo <= 0:
        log = False
    return lo, hi, log


def _fmt_bound(v: float | None, open_: bool, lower: bool) -> str:
    if v is None:
        return "-inf" if lower else "inf"
    return f"{'>' if open_ else ''}{v:g}" if lower else f"{'<' if open_ else ''}{v:g}"


def _kind_of(model: type[BaseModel], name: str) -> str | None:
    ann = model.model_fields[name].annotation
    if ann is bool:
        return "bool"
    if ann is int:
        return "int"
    if ann is float:
        return "float"
    return None  # literals, strings, dicts: not searched


def _is_searchable_param(policy: str, name: str) -> bool:
    if name in SIM_ONLY_PARAMS:
        return False
    model = PARAM_MODELS[policy]
    if name in ADAPTIVE_PARAMS.get(policy, ()) and f"{name}_ada" not in model.model_fields:
        return False  # adaptation overwrites it and cannot be switched off in the search
    return _kind_of(model, name) is not None


# --------------------------------------------------------------------------------------------
# The space
# --------------------------------------------------------------------------------------------


@dataclass
class SearchSpace:
    """Candidate policies, per-policy dimensions, engine dimensions and fixed values."""

    policies: tuple[str, ...]  # candidates; the production policy first
    production: dict[str, Any]  # the production settings document
    policy_dims: dict[str, list[Dim]] = field(default_factory=dict)
    engine_dims: list[Dim] = field(default_factory=list)
    fixed: dict[str, dict[str, Any]] = field(default_factory=dict)  # policy -> {param: value}
    fixed_engine: dict[str, Any] = field(default_factory=dict)

    # -- serialisation (kept in the study's user attributes)
    def to_dict(self) -> dict[str, Any]:
        return {
            "policies": list(self.policies),
            "production": self.production,
            "policy_dims": {p: [d.to_dict() for d in ds] for p, ds in self.policy_dims.items()},
            "engine_dims": [d.to_dict() for d in self.engine_dims],
            "fixed": self.fixed,
            "fixed_engine": self.fixed_engine,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SearchSpace:
        return cls(
            policies=tuple(d["policies"]),
            production=dict(d["production"]),
            policy_dims={p: [Dim.from_dict(x) for x in ds] for p, ds in d["policy_dims"].items()},
            engine_dims=[Dim.from_dict(x) for x in d["engine_dims"]],
            fixed={p: dict(v) for p, v in d["fixed"].items()},
            fixed_engine=dict(d["fixed_engine"]),
        )

    def describe(self) -> list[str]:
        lines = []
        if len(self.policies) > 1:
            lines.append(f"{POLICY_PARAM} in {list(self.policies)}")
        for p in self.policies:
            lines.extend(d.describe() for d in self.policy_dims.get(p, []))
        lines.extend(d.describe() for d in self.engine_dims)
        return lines

    @property
    def production_settings(self) -> Settings:
        return Settings.model_validate(self.production)

    # -- sampling
    def suggest(self, trial: Trial) -> Settings:
        """Ask ``trial`` for every dimension and build the (validated, repaired) settings."""
        policy = self.policies[0]
        if len(self.policies) > 1:
            policy = trial.suggest_categorical(POLICY_PARAM, list(self.policies))
        values = {d.name: d.suggest(trial) for d in self.policy_dims.get(policy, [])}
        engine: dict[str, Any] = {d.name: None for d in self.engine_dims}
        for d in self.engine_dims:
            if d.name == f"{ENGINE_PREFIX}{THRESHOLD}":
                continue  # conditional on the switch, below
            engine[d.name] = d.suggest(trial)
        thr = next((d for d in self.engine_dims if d.name == f"{ENGINE_PREFIX}{THRESHOLD}"), None)
        if thr is not None:
            engine[thr.name] = thr.suggest(trial) if engine.get(CHUNKING_SWITCH) else 0
        return self.build(policy, values, engine)

    def build(self, policy: str, values: Mapping[str, Any], engine: Mapping[str, Any]) -> Settings:
        prod = self.production
        same = policy == prod["policy"]
        params = dict(prod["params"]) if same else {}
        params.update(self.fixed.get(policy, {}))
        for name, v in values.items():
            params[name.split(".", 1)[1]] = v
        _repair_min_max(params)
        eng = dict(prod["engine"])
        eng.update(self.fixed_engine)
        for name, v in engine.items():
            if name == CHUNKING_SWITCH or v is None:
                continue
            eng[name.removeprefix(ENGINE_PREFIX)] = v
        # vLLM refuses max_num_batched_tokens < max_num_seqs at start-up.
        eng["max_num_batched_tokens"] = max(eng["max_num_batched_tokens"], eng["max_num_seqs"])
        pinned = list(prod.get("pinned", ())) if same else []
        return Settings.model_validate(
            {"policy": policy, "params": params, "pinned": pinned, "engine": eng}
        )

    def production_params(self) -> dict[str, Any]:
        """The production settings as values of this space (enqueued as trial 0)."""
        prod = self.production
        out: dict[str, Any] = {}
        if len(self.policies) > 1:
            out[POLICY_PARAM] = prod["policy"]
        for d in self.policy_dims.get(prod["policy"], []):
            out[d.name] = prod["params"][d.name.split(".", 1)[1]]
        for d in self.engine_dims:
            if d.name == CHUNKING_SWITCH:
                out[d.name] = prod["engine"][THRESHOLD] > 0
            elif d.name == f"{ENGINE_PREFIX}{THRESHOLD}":
                if prod["engine"][THRESHOLD] > 0:
                    out[d.name] = prod["engine"][THRESHOLD]
            else:
                out[d.name] = prod["engine"][d.name.removeprefix(ENGINE_PREFIX)]
        return out


def _repair_min_max(params: dict[str, Any]) -> None:
    """Swap ``X_min``/``X_max`` pairs sampled out of order (the model requires min <= max)."""
    for name in list(params):
        if name.endswith("_min"):
            hi_name = name[:-4] + "_max"
            if hi_name in params and params[name] > params[hi_name]:
                params[name], params[hi_name] = params[hi_name], params[name]


def _split_name(raw: str, policies: Sequence[str], option: str) -> tuple[str, str]:
    """``gamma`` / ``uniboost.gamma`` / ``engine.max_num_seqs`` / ``max_num_seqs`` → (scope,
    name)."""
    if raw.startswith(ENGINE_PREFIX):
        name = raw.removeprefix(ENGINE_PREFIX)
        if name not in EngineSettings.model_fields:
            raise SearchSpaceError(
                f"{option} {raw}: unknown engine field (valid: "
                f"{', '.join(EngineSettings.model_fields)})"
            )
        return "engine", name
    if "." in raw:
        scope, name = raw.split(".", 1)
        if scope not in policies:
            raise SearchSpaceError(
                f"{option} {raw}: {scope!r} is not a candidate policy ({', '.join(policies)})"
            )
        if name not in PARAM_MODELS[scope].model_fields:
            valid = ", ".join(PARAM_MODELS[scope].model_fields) or "none"
            raise SearchSpaceError(
                f"{option} {raw}: {name!r} is not a parameter of {scope} (valid: {valid})"
            )
        return scope, name
    if raw in EngineSettings.model_fields:
        return "engine", raw
    owners = [p for p in policies if raw in PARAM_MODELS[p].model_fields]
    if not owners:
        valid_names = sorted(
            {n for p in policies for n in PARAM_MODELS[p].model_fields}
            | set(EngineSettings.model_fields)
        )
        raise SearchSpaceError(
            f"{option} {raw}: not a parameter of {', '.join(policies)} nor an engine field "
            f"(valid: {', '.join(valid_names)})"
        )
    if len(owners) > 1:
        raise SearchSpaceError(
            f"{option} {raw}: ambiguous, say which policy "
            f"({', '.join(o + '.' + raw for o in owners)})"
        )
    return owners[0], raw


def parse_range(text: str) -> tuple[str, tuple[float, float, bool | None]]:
    """``NAME=LO:HI[:log|:linear]`` → (NAME, (lo, hi, log or None))."""
    assignment = split_assignment(text, strip=True)
    if assignment is None:
        raise SearchSpaceError(f"--range {text!r}: expected NAME=LOW:HIGH[:log|:linear]")
    name, spec = assignment
    parts = spec.split(":")
    if len(parts) not in (2, 3):
        raise SearchSpaceError(f"--range {text!r}: expected NAME=LOW:HIGH[:log|:linear]")
    try:
        lo, hi = float(parts[0]), float(parts[1])
    except ValueError:
        raise SearchSpaceError(f"--range {text!r}: LOW and HIGH must be numbers") from None
    if not (math.isfinite(lo) and math.isfinite(hi)):  # nan compares false with every bound
        raise SearchSpaceError(f"--range {text!r}: LOW and HIGH must be finite numbers")
    log = None
    if len(parts) == 3:
        if parts[2] not in ("log", "linear"):
            raise SearchSpaceError(f"--range {text!r}: the scale must be 'log' or 'linear'")
        log = parts[2] == "log"
    return name, (lo, hi, log)


@dataclass
class _Overrides:
    """``--range``/``--fix``/``--search`` resolved to (scope, name) pairs, scope a policy or
    "engine"."""

    ranges: dict[tuple[str, str], tuple[float, float, bool | None]]
    fixed: dict[
        str, dict[str, Any]
    ]  # policy -> {param: value} (shared with the space: it gains defaults)
    fixed_engine: dict[str, Any]
    only: set[tuple[str, str]] | None  # --search: only these (None: everything)

    @classmethod
    def resolve(
        cls,
        candidates: Sequence[str],
        ranges: Mapping[str, tuple[float, float, bool | None]],
        fixed: Mapping[str, Any],
        search: Sequence[str] | None,
    ) -> _Overrides:
        resolved = {_split_name(raw, candidates, "--range"): r for raw, r in ranges.items()}
        fixed_by: dict[str, dict[str, Any]] = {}
        fixed_engine: dict[str, Any] = {}
        for raw, v in fixed.items():
            scope, name = _split_name(raw, candidates, "--fix")
            (fixed_engine if scope == "engine" else fixed_by.setdefault(scope, {}))[name] = v
        only = (
            None if search is None else {_split_name(raw, candidates, "--search") for raw in search}
        )
        return cls(resolved, fixed_by, fixed_engine, only)

    def wanted(self, scope: str, name: str) -> bool:
        """Searched unless ``--search`` leaves it out (a ``--range`` always counts as asking for
        it)."""
        return (scope, name) in self.ranges or self.only is None or (scope, name) in self.only


def build_space(
    policies: Sequence[str],
    production: Settings,
    *,
    ranges: Mapping[str, tuple[float, float, bool | None]] | None = None,
    fixed: Mapping[str, Any] | None = None,
    search: Sequence[str] | None = None,
    tune_engine: bool = True,
) -> SearchSpace:
    """Derive the search space for ``policies`` (tuned) around ``production``.

    ``ranges``: explicit spans by parameter name (checked against the model's bounds);
    ``fixed``: values that are set, not searched; ``search``: if given, only these parameters
    are searched (others keep production/default values).
    """
    for p in policies:
        if p not in PARAM_MODELS:
            raise SearchSpaceError(
                f"--policy {p}: unknown policy (valid: {', '.join(PARAM_MODELS)})"
            )
    prod_doc = production.to_dict()
    candidates = tuple(dict.fromkeys([production.policy, *policies]))
    over = _Overrides.resolve(candidates, dict(ranges or {}), dict(fixed or {}), search)
    space = SearchSpace(
        policies=candidates, production=prod_doc, fixed=over.fixed, fixed_engine=over.fixed_engine
    )
    for p in candidates:
        space.policy_dims[p] = _policy_dims(p, p in policies, production, over)
    space.engine_dims = _engine_dims(prod_doc["engine"], over, tune_engine)
    # A fixed value must itself be valid: build the settings once per policy.
    for p in candidates:
        try:
            space.build(p, {}, {})
        except ValueError as err:
            raise SearchSpaceError(
                f"--fix: {describe_error(err)}"
            ) from None  # one line, no input values
    return space


def _policy_dims(p: str, tuned: bool, production: Settings, over: _Overrides) -> list[Dim]:
    """The searched parameters of candidate policy ``p`` (none unless ``tuned``), around the
    production values when it is the production policy, else around the model's defaults."""
    model = PARAM_MODELS[p]
    is_production = p == production.policy
    base = production.to_dict()["params"] if is_production else model().model_dump()
    pinned = set(production.pinned) if is_production else set()
    if tuned and "predictor" in model.model_fields and not is_production:
        over.fixed.setdefault(p, {}).setdefault("predictor", "history")
    dims = []
    for name in model.model_fields:
        if not tuned or name in pinned or name in over.fixed.get(p, {}):
            if (p, name) in over.ranges and name in pinned:
                raise SearchSpaceError(f"--range {p}.{name}: the production settings pin it")
            continue
        dim = _policy_dim(p, name, base, over)
        if dim is not None:
            dims.append(dim)
    return dims


def _policy_dim(p: str, name: str, base: Mapping[str, Any], over: _Overrides) -> Dim | None:
    """Policy ``p``'s parameter ``name`` as a dimension around ``base[name]``, or None when it is
    not searched."""
    if not over.wanted(p, name):
        return None
    given = over.ranges.get((p, name))
    if not _is_searchable_param(p, name):
        if given is not None:
            raise SearchSpaceError(f"--range {p}.{name}: this parameter is not searchable")
        return None
    model = PARAM_MODELS[p]
    kind = _kind_of(model, name)
    assert kind is not None  # _is_searchable_param checked it
    if kind == "bool":
        return Dim(f"{p}.{name}", "categorical", choices=(False, True))
    centre = float(base[name])
    if given is None and ((name in UNSCALED_PARAMS and centre == 0) or name in RANGE_ONLY_PARAMS):
        return None
    if name == "gamma" and given is None:
        given = (*GAMMA_RANGE, True)
    return numeric_dim(f"{p}.{name}", kind, field_bounds(model, name), centre, given, SPAN)


def _engine_dims(prod_engine: Mapping[str, Any], over: _Overrides, tune_engine: bool) -> list[Dim]:
    """The searched engine fields around the production engine (``tune_engine=False``: only those
    a ``--range`` names)."""
    dims: list[Dim] = []
    for name in EngineSettings.model_fields:
        if name in over.fixed_engine or not over.wanted("engine", name):
            continue
        given = over.ranges.get(("engine", name))
        if not tune_engine and given is None:
            continue
        kind = _kind_of(EngineSettings, name)
        assert kind is not None  # the engine fields are all ints
        bounds = field_bounds(EngineSettings, name)
        if name == THRESHOLD:
            # 0 = off: an on/off switch, and a chunk size around the production one (or a
            # quarter of the production token budget when chunking is off in production).
            current = prod_engine[THRESHOLD] or max(1, prod_engine["max_num_batched_tokens"] // 4)
            lo_b = Bounds(max(bounds.lo or 0, 1.0), bounds.hi, False, bounds.hi_open)
            dim = numeric_dim(f"{ENGINE_PREFIX}{name}", kind, lo_b, float(current), given)
            if dim is not None:
                dims.extend([Dim(CHUNKING_SWITCH, "categorical", choices=(False, True)), dim])
            continue
        dim = numeric_dim(f"{ENGINE_PREFIX}{name}", kind, bounds, float(prod_engine[name]), given)
        if dim is not None:
            dims.append(dim)
    return dims

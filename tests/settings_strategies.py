"""Hypothesis strategies over the whole settings schema, extremes included.

Derived from the pydantic models themselves (``scheduler.settings.PARAM_MODELS`` and
``EngineSettings``), so a parameter added later is covered without touching the tests: every
numeric field draws its declared bounds, values just inside them and ordinary values; a field
without an upper bound draws huge numbers (what an attacker would send). Documents may be
invalid (the model refuses them: that is fine); what matters is that every *accepted* document
runs.
"""

from __future__ import annotations

import math
import types
import typing
from typing import Any, Literal

import annotated_types
from hypothesis import strategies as st
from pydantic.fields import FieldInfo

from scheduler.settings import PARAM_MODELS, EngineSettings, QuantileSlo, TenantSlo

HUGE_INTS = [2**63, 2**64 + 1, 10**30, 10**400]
HUGE_FLOATS = [1e300, 1.7976931348623157e308]
TINY_FLOATS = [5e-324, 2.2250738585072014e-308, 1e-300, 1e-12]
TENANTS = ["t0", "t1", "t2", "default"]
TYPES = ["chat", "reasoning", "batch"]


def _bounds(info: FieldInfo) -> tuple[float | None, float | None, bool, bool]:
    lo = hi = None
    lo_open = hi_open = False
    for m in info.metadata:
        if isinstance(m, annotated_types.Ge):
            lo = m.ge
        elif isinstance(m, annotated_types.Gt):
            lo, lo_open = m.gt, True
        elif isinstance(m, annotated_types.Le):
            hi = m.le
        elif isinstance(m, annotated_types.Lt):
            hi, hi_open = m.lt, True
    return lo, hi, lo_open, hi_open


def _number(kind: type, info: FieldInfo) -> st.SearchStrategy[Any]:
    lo, hi, lo_open, hi_open = _bounds(info)
    if kind is int:
        lo_i = int(lo) + (1 if lo_open else 0) if lo is not None else -(2**70)
        edges = [lo_i, lo_i + 1]
        if hi is not None:
            hi_i = int(hi) - (1 if hi_open else 0)
            edges += [hi_i, hi_i - 1]
            ordinary = st.integers(lo_i, hi_i)
        else:
            edges += HUGE_INTS
            ordinary = st.integers(lo_i, lo_i + 10_000)
        return st.one_of(st.sampled_from(edges), ordinary)
    lo_f = float(lo) if lo is not None else -1e308
    hi_f = float(hi) if hi is not None else 1.7976931348623157e308
    edges = [lo_f, hi_f]
    if lo_open:
        edges += [math.nextafter(lo_f, math.inf)] + [lo_f + t for t in TINY_FLOATS]
    if hi_open:
        edges += [math.nextafter(hi_f, -math.inf)]
    if hi is None:
        edges += HUGE_FLOATS
    ordinary = st.floats(lo_f, hi_f, exclude_min=lo_open, exclude_max=hi_open, allow_nan=False)
    return st.one_of(st.sampled_from(edges), ordinary)


def _quantile_slo() -> st.SearchStrategy[dict]:
    target = _number(float, QuantileSlo.model_fields["p50"])
    return st.dictionaries(st.sampled_from(["p50", "p90", "p99"]), target, min_size=1, max_size=3)


def _tenant_slo() -> st.SearchStrategy[dict]:
    fields = TenantSlo.model_fields
    return st.fixed_dictionaries(
        {},
        optional={
            "weight": _number(float, fields["weight"]),
            "commit_tok_s": _number(float, fields["commit_tok_s"]),
            "ttft": _quantile_slo(),
            "ttlt": _quantile_slo(),
            "queue_cap": _number(int, fields["queue_cap"]),
        },
    )


def _fraction_map(keys: list[str]) -> st.SearchStrategy[dict]:
    share = st.one_of(st.sampled_from([1.0, 1e-300, 5e-324, 0.5]), st.floats(1e-12, 1.0))
    return st.dictionaries(st.sampled_from(keys), share, max_size=len(keys))


# Fields whose type is a mapping: the schema says what each value is.
SPECIAL: dict[str, st.SearchStrategy[Any]] = {
    "weights": st.dictionaries(
        st.sampled_from(TENANTS),
        st.one_of(
            st.sampled_from([1e-300, 5e-324, 1e300, 1.7976931348623157e308]), st.floats(1e-3, 1e3)
        ),
    ),
    "tenants": st.dictionaries(st.sampled_from(TENANTS), _tenant_slo(), max_size=3),
    "default_tenant": _tenant_slo(),
    "throttle": _fraction_map(TENANTS),
    "type_shares": _fraction_map(TYPES),
}


def field_strategy(name: str, info: FieldInfo) -> st.SearchStrategy[Any]:
    if name in SPECIAL:
        return SPECIAL[name]
    annotation = info.annotation
    optional = False
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        optional = len(args) < len(typing.get_args(annotation))
        annotation = args[0]
    if typing.get_origin(annotation) is Literal:
        strategy: st.SearchStrategy[Any] = st.sampled_from(typing.get_args(annotation))
    elif annotation is bool:
        strategy = st.booleans()
    elif annotation in (int, float):
        strategy = _number(annotation, info)
    else:
        raise NotImplementedError(f"no strategy for field {name}: {annotation!r}")
    return st.one_of(st.none(), strategy) if optional else strategy


def params_strategy(policy: str) -> st.SearchStrategy[dict]:
    model = PARAM_MODELS[policy]
    optional = {name: field_strategy(name, info) for name, info in model.model_fields.items()}
    if "predictor" in optional:
        optional["predictor"] = st.just("history")  # a live replica refuses the oracle
    return st.fixed_dictionaries({}, optional=optional)


def engine_strategy(fixed: dict[str, int] | None = None) -> st.SearchStrategy[dict]:
    """The engine block; ``fixed`` fields (what a replica cannot change live) are left out."""
    fields = {
        name: field_strategy(name, info)
        for name, info in EngineSettings.model_fields.items()
        if name not in (fixed or {})
    }
    return st.fixed_dictionaries({}, optional=fields)


@st.composite
def documents(draw, policies: tuple[str, ...] = tuple(PARAM_MODELS)) -> dict:
    """One settings document of any policy, extremes included (it may be invalid)."""
    policy = draw(st.sampled_from(policies))
    params = draw(params_strategy(policy))
    pinnable = list(PARAM_MODELS[policy].model_fields)
    pinned = draw(st.lists(st.sampled_from(pinnable), max_size=2, unique=True)) if pinnable else []
    doc: dict[str, Any] = {"policy": policy, "params": params, "pinned": pinned}
    engine = draw(engine_strategy({"max_num_seqs": 0, "max_num_batched_tokens": 0}))
    if engine:
        doc["engine"] = engine
    return doc

"""The tuner's objectives and constraints (docs/engine.md#tuner): metric names checked against
what a trace replay computes, and the constraint grammar

    METRIC (<=|>=) NUMBER
    | METRIC (<=|>=) [FACTOR*]baseline[*FACTOR][(+|-)OFFSET]
    | METRIC (<=|>=) PCT%baseline

(``baseline``: the production settings' value on the same windows). A bound is inclusive; a
strict ``<``/``>`` is refused. Errors name the offending metric or constraint (the caller names
the field or flag it came from).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from scheduler.errors import TailpilotError
from scheduler.metrics import METRICS, metric_direction, validate_metric

#: Metrics a replay summary does not hold (live-only, or need inputs a replay lacks).
REPLAY_UNAVAILABLE = frozenset({"kv_usage", "slo_compliance_ratio", "type_share_ratio_min"})
FAIRNESS_METRICS = frozenset({"jain_index"})


def parse_objectives(
    names: Sequence[str], slo: Mapping[str, float] | None = None
) -> list[tuple[str, Literal["maximize", "minimize"]]]:
    """Canonical (name, direction) per objective; UnknownMetricError lists valid names."""
    if not names:
        raise ValueError("give at least one objective")
    out: list[tuple[str, Literal["maximize", "minimize"]]] = []
    for raw in names:
        name = check_replay_metric(raw, slo)
        if any(name == n for n, _ in out):
            raise ValueError(f"{raw}: given twice")
        out.append((name, metric_direction(name)))
    return out


def check_replay_metric(raw: str, slo: Mapping[str, float] | None) -> str:
    """The canonical name of metric ``raw``; ValueError (``RAW: why``) when a trace replay cannot
    compute it (unknown, live-only, or an SLO metric without its SLO)."""
    try:
        name = validate_metric(raw)
    except KeyError as err:
        raise ValueError(f"{raw}: {err}") from None
    if name in REPLAY_UNAVAILABLE:
        raise ValueError(f"{raw}: {name} is not computed from a trace replay")
    if name.endswith(("_slo_attainment", "_slo_scale_99")):
        base = name.split("_slo_")[0]
        if not slo or base not in slo:
            raise ValueError(f"{raw}: needs an SLO for {base} (--slo {base}=SECONDS)")
    return name


# --------------------------------------------------------------------------------------------
# Constraints: METRIC (<=|>=) NUMBER | [NUMBER*]baseline[*NUMBER][(+|-)NUMBER]
# --------------------------------------------------------------------------------------------

_NUM = r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?"
_CONSTRAINT = re.compile(
    r"^\s*(?P<metric>[A-Za-z_][A-Za-z0-9_]*)\s*(?P<op><=|>=|<|>)\s*(?P<rhs>.+?)\s*$"
)
_RHS_NUMBER = re.compile(rf"^(?P<num>{_NUM})$")
_RHS_BASELINE = re.compile(
    rf"^(?:(?P<pre>{_NUM})\s*\*\s*)?baseline(?:\s*\*\s*(?P<post>{_NUM}))?(?:\s*(?P<sign>[+-])\s*(?P<add>{_NUM}))?$"
)
_RHS_PERCENT = re.compile(rf"^(?P<pct>{_NUM})\s*%\s*(?:of\s+|\*\s*)?baseline$")


class ConstraintError(TailpilotError, ValueError):
    pass


@dataclass(frozen=True)
class Constraint:
    """``metric op rhs``; rhs = ``scale * baseline + offset`` (relative) or ``offset``."""

    text: str
    metric: str
    op: str  # "<=" or ">=" (bounds are inclusive; parse_constraint refuses "<" and ">")
    scale: float | None  # None: absolute bound
    offset: float

    @property
    def relative(self) -> bool:
        return self.scale is not None

    def bound(self, baseline: float) -> float:
        return self.offset if self.scale is None else self.scale * baseline + self.offset

    def value(self, x: float, baseline: float) -> float:
        """Optuna's convention: <= 0 is feasible. An undefined (NaN) value is infeasible (inf)."""
        bound = self.bound(baseline)
        if not (math.isfinite(x) and math.isfinite(bound)):
            return math.inf
        return x - bound if self.op == "<=" else bound - x

    @property
    def key(self) -> str:
        return self.text


def parse_constraint(
    text: str, slo: Mapping[str, float] | None = None, *, legacy: bool = False
) -> Constraint:
    """Parse ``throughput>=0.99*baseline``, ``ttft_p99<=2.0``, ``ttlt_p99<=baseline+0.5``,
    ``throughput>=99%baseline``. Errors name the constraint.

    A bound is inclusive: a strict ``<``/``>`` is refused, saying to use ``<=``/``>=``.
    ``legacy``: read a strict comparison as the inclusive one instead (studies defined before strict
    comparisons were refused hold them, and ran them so).
    """
    m = _CONSTRAINT.match(text)
    if not m:
        raise ConstraintError(
            f"{text!r}: expected METRIC<=BOUND or METRIC>=BOUND, "
            "BOUND a number or [FACTOR*]baseline[+OFFSET] (e.g. throughput>=0.99*baseline)"
        )
    try:
        metric = check_replay_metric(m["metric"], slo)
    except ValueError as err:
        raise ConstraintError(f"{text!r}: {err}") from None
    scale, offset = _parse_bound(text, m["rhs"].strip())
    op = m["op"]
    if op in ("<", ">"):
        if not legacy:
            raise ConstraintError(
                f"{text!r}: use {op + '='!r}: a constraint's bound is inclusive (a strict "
                f"{op!r} is not supported)"
            )
        op += "="
    return Constraint(text.strip(), metric, op, scale, offset)


def _parse_bound(text: str, rhs: str) -> tuple[float | None, float]:
    """A constraint's right-hand side as (scale of the baseline or None: absolute, offset)."""
    if (n := _RHS_NUMBER.match(rhs)) is not None:
        return None, float(n["num"])
    if (p := _RHS_PERCENT.match(rhs)) is not None:
        return float(p["pct"]) / 100.0, 0.0
    if (b := _RHS_BASELINE.match(rhs)) is not None:
        if b["pre"] is not None and b["post"] is not None:
            raise ConstraintError(f"{text!r}: give the baseline factor once")
        scale = float(b["pre"] or b["post"] or 1.0)
        add = float(b["add"]) * (-1 if b["sign"] == "-" else 1) if b["add"] is not None else 0.0
        return scale, add
    raise ConstraintError(
        f"{text!r}: cannot read the bound {rhs!r}; use a number or "
        "[FACTOR*]baseline[+OFFSET] (e.g. 0.99*baseline)"
    )


def tracked_metrics(
    objectives: Sequence[tuple[str, str]], constraints: Sequence[Constraint]
) -> list[str]:
    """Metrics kept per window for every trial: objectives, constraint metrics and the headline
    tails."""
    names = [n for n, _ in objectives] + [c.metric for c in constraints]
    names += ["ttlt_p99", "ttft_p95", "ttft_p99", "throughput_tok_s"]
    return [n for n in dict.fromkeys(names) if n in METRICS]

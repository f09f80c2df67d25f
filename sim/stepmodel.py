"""Step-time model of a vLLM-v1 engine step (docs/engine.md#step-time-model).

    t = a + b·prefill_tokens + c·Σ prefill_len² + d·decode_seqs + e·Σ kv_context      [seconds]

* ``prefill_tokens``  — prompt tokens computed in the step (sum of the scheduled chunk lengths);
* ``Σ prefill_len²``  — sum over the step's prefill chunks of chunk_length² (causal attention);
* ``decode_seqs``     — number of requests decoding one token in the step;
* ``Σ kv_context``    — sum over the decoding requests of the KV tokens each one attends to.

Coefficient sets are kept per (GPU, model, TP) in :data:`COEFFICIENT_SETS`.  The default set
(A100-80GB, Llama-3-8B, TP1) is derived below from public hardware and model facts (written out
next to the coefficients, with their sources) and the measured vidur profile
``traces/profiles/vidur_a100_llama3_8b_mlp.csv``; every coefficient says which fact it comes
from.  ``benchmarks/derive_step_coefficients.py`` recomputes the two profile-based coefficients
(b, d) from the CSV.  For a live deployment the
ground truth is the replica's own step log: :func:`fit_step_model` fits all five coefficients
to it (what ``tailpilot calibrate`` does).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

import numpy as np

from scheduler.errors import TailpilotError

__all__ = [
    "COEFFICIENTS",
    "COEFFICIENT_SETS",
    "COEF_MEANING",
    "DEFAULT_MODEL_NAME",
    "MIN_FIT_ROWS",
    "USER_DIR_ENV",
    "VLLM_ENGINE_DEFAULTS",
    "StepFitError",
    "StepTimeModel",
    "engine_defaults",
    "fit_step_model",
    "get_model",
    "list_models",
    "load_model",
    "register",
    "save_model",
    "save_user_model",
    "user_model_path",
    "user_models_dir",
]

#: Coefficient field names, in the order of the model's terms.
COEFFICIENTS: tuple[str, ...] = ("a", "b", "c", "d", "e")

#: What each coefficient multiplies, as a unit ("s per prefill token"): for error messages and
#: reports.
COEF_MEANING: dict[str, str] = {
    "a": "s per step",
    "b": "s per prefill token",
    "c": "s per prefill-chunk token²",
    "d": "s per decode sequence",
    "e": "s per decode KV-context token",
}

_FORMAT = "tailpilot-step-time-model/1"


# ---------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StepTimeModel:
    """Coefficients of the linear step-time model; all non-negative and finite."""

    a: float  # s       fixed cost per step (weights streamed once, launch overheads)
    b: float  # s/token per prefill token (linear layers)
    c: float  # s/token² per Σ prefill_len² (causal attention inside a chunk)
    d: float  # s/seq   per decoding sequence
    e: float  # s/token per KV-context token read by decoding sequences
    name: str = "custom"
    source: str = "user-supplied"

    def __post_init__(self) -> None:
        for key in COEFFICIENTS:
            raw = getattr(self, key)
            if isinstance(raw, bool) or not isinstance(raw, (int, float, np.floating, np.integer)):
                raise TypeError(f"StepTimeModel.{key} must be a number, got {raw!r}")
            value = float(raw)
            if not math.isfinite(value) or value < 0.0:
                raise ValueError(
                    f"StepTimeModel.{key} ({COEF_MEANING[key]}) must be finite and "
                    f">= 0, got {raw!r}"
                )
            object.__setattr__(self, key, value)  # store plain floats (fast inner-loop arithmetic)
        if not isinstance(self.name, str) or not self.name:
            raise ValueError("StepTimeModel.name must be a non-empty string")
        if not isinstance(self.source, str):
            raise TypeError("StepTimeModel.source must be a string")

    def step_time(
        self,
        prefill_tokens: float,
        sum_prefill_sq: float,
        decode_seqs: float,
        sum_kv_context: float,
    ) -> float:
        """Duration of one engine step in seconds (plain float arithmetic, no checks)."""
        return (
            self.a
            + self.b * prefill_tokens
            + self.c * sum_prefill_sq
            + self.d * decode_seqs
            + self.e * sum_kv_context
        )

    def batch_time(
        self, prefill_chunk_lens: Sequence[int] = (), decode_kv_contexts: Sequence[int] = ()
    ) -> float:
        """Convenience: step time from the chunk lengths and the decoders' KV context lengths."""
        return self.step_time(
            sum(prefill_chunk_lens),
            sum(n * n for n in prefill_chunk_lens),
            len(decode_kv_contexts),
            sum(decode_kv_contexts),
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "source": self.source,
            **{key: getattr(self, key) for key in COEFFICIENTS},
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepTimeModel:
        if not isinstance(data, dict):
            raise TypeError(f"expected a dict, got {type(data).__name__}")
        missing = [key for key in COEFFICIENTS if key not in data]
        if missing:
            raise ValueError(f"step-time model is missing coefficient(s) {', '.join(missing)}")
        unknown = sorted(set(data) - set(COEFFICIENTS) - {"name", "source"})
        if unknown:
            raise ValueError(f"step-time model has unknown key(s) {', '.join(unknown)}")
        return cls(
            **{key: data[key] for key in COEFFICIENTS},
            name=data.get("name", "custom"),
            source=data.get("source", "user-supplied"),
        )


# ---------------------------------------------------------------------------------------------
# Facts (sources inline; the profile: traces/README.md)
# ---------------------------------------------------------------------------------------------

# Hardware.
A100_PEAK_BF16_FLOPS = 312e12  # A100-SXM dense bf16 peak
A100_HBM_BYTES_PER_S = 2.039e12  # A100-SXM 80GB HBM2e
A100_MFU_PREFILL = 0.38  # BLIS hardware_config.json, "calibrated per Discussion #589"
A100_MFU_DECODE = 0.18  # idem
H100_PEAK_BF16_FLOPS = 989.5e12  # H100-SXM dense bf16 peak
H100_HBM_BYTES_PER_S = 3.35e12  # H100-SXM HBM3
H100_MFU_PREFILL = 0.45  # BLIS
H100_MFU_DECODE = 0.30  # BLIS

# Llama-3-8B shape.
LLAMA3_8B_LAYERS = 32
LLAMA3_8B_HIDDEN = 4096
LLAMA3_8B_KV_BYTES_PER_TOKEN = (
    2 * 32 * 8 * 128 * 2
)  # (K,V) × layers × KV heads × head dim × bf16 = 128 KiB
LLAMA3_8B_WEIGHT_BYTES = 16.06e9  # ≈ 8.03 B parameters × 2 bytes (bf16), the notes' "≈ 16 GB"

# DistServe analytic fit, OPT-13B on A100-80G, vLLM backend (decode, batch < 95), in seconds.
DISTSERVE_DECODE_INTERCEPT_S = 19.56e-3
DISTSERVE_DECODE_PER_CTX_TOKEN_S = 4.94e-4 * 1e-3
DISTSERVE_DECODE_PER_SEQ_S = 0.0506e-3
OPT13B_KV_BYTES_PER_TOKEN = 2 * 40 * 5120 * 2  # (K,V) × 40 layers × hidden 5120 × fp16 = 800 KiB
OPT13B_WEIGHT_BYTES = 12.85e9 * 2  # ≈ 12.85 B parameters × 2 bytes = 25.7 GB

# Achieved HBM fraction: DistServe's measured 4.94e-4 ms per context token against the roofline
# 819,200 B / 2.039 TB/s = 4.018e-4 ms  →  4.018 / 4.94 = 0.813 of peak bandwidth achieved while
# streaming KV (and weights) in decode.  Reused for weights (a) and KV (e), and for H100.
ACHIEVED_HBM_FRACTION = (
    OPT13B_KV_BYTES_PER_TOKEN / A100_HBM_BYTES_PER_S
) / DISTSERVE_DECODE_PER_CTX_TOKEN_S

# Cross-checks of a and d: DistServe's OPT-13B decode intercept and per-sequence slope scaled by
# the weight size ratio 16.06 / 25.7 GB (= parameter ratio 8.03 / 12.85 B).
DISTSERVE_SCALED_INTERCEPT_S = (
    DISTSERVE_DECODE_INTERCEPT_S * LLAMA3_8B_WEIGHT_BYTES / OPT13B_WEIGHT_BYTES
)  # 12.2 ms
DISTSERVE_SCALED_PER_SEQ_S = (
    DISTSERVE_DECODE_PER_SEQ_S * LLAMA3_8B_WEIGHT_BYTES / OPT13B_WEIGHT_BYTES
)  # 3.16e-5 s


def _causal_attention_flops_per_len_sq(hidden: int, layers: int) -> float:
    """FLOPs per l² of causal self-attention in a prefill chunk of l tokens.

    QKᵀ and PV are two matmuls of 2·l²·d_model FLOPs each per layer (2 FLOPs per MAC, all query
    heads: d_model = 32 × 128); causal masking halves them:  2·2·l²·d_model·layers / 2.
    """
    return 2 * 2 * hidden * layers / 2


# ---------------------------------------------------------------------------------------------
# Default: A100-80GB (SXM) / Llama-3-8B / TP1
# ---------------------------------------------------------------------------------------------

# b, d: least-squares slopes of the measured vidur profile (TP1), model time per step = 32 ×
# (sum of the medians of the nine per-layer ops) + the embedding gather once; recomputed by
# benchmarks/derive_step_coefficients.py.
_A100_B_PROFILE = 6.657e-5  # slope over 256..8192 tokens (289 token counts; 0.0666 ms/token)
_A100_D_PROFILE_LAYERS = 2.909e-5  # slope over 1..128 tokens (19 token counts; 0.0291 ms/token)
_A100_D_LM_HEAD = 2.01e-6  # LM head (128256×4096 = 525.3 M params = 2.409 × the layer's 218.1 M
#                            linear params) × the measured 1..128 slope of the layer's 4 GEMMs

_A100_A = LLAMA3_8B_WEIGHT_BYTES / (ACHIEVED_HBM_FRACTION * A100_HBM_BYTES_PER_S)
_A100_B = _A100_B_PROFILE
_A100_C = _causal_attention_flops_per_len_sq(LLAMA3_8B_HIDDEN, LLAMA3_8B_LAYERS) / (
    A100_MFU_PREFILL * A100_PEAK_BF16_FLOPS
)
_A100_D = _A100_D_PROFILE_LAYERS + _A100_D_LM_HEAD
_A100_E = LLAMA3_8B_KV_BYTES_PER_TOKEN / (ACHIEVED_HBM_FRACTION * A100_HBM_BYTES_PER_S)

A100_LLAMA3_8B_TP1 = StepTimeModel(
    # a = 16.06 GB of bf16 weights streamed once per step at 0.813 × 2.039 TB/s → 9.68 ms.
    #     Cross-checks: DistServe's 19.56 ms intercept × (16.06 / 25.7 GB) = 12.2 ms (includes
    #     their framework overhead); the vidur profile's non-attention time at 1 token is
    #     32 × 0.303 ms = 9.7 ms (LM head and attention kernels excluded).
    a=_A100_A,
    # b = 6.657e-5 s/token: linear fit of the vidur profile (32 × per-layer op medians + emb,
    #     TP1) over 256..8192 tokens.  LM head not added: a prefill chunk samples at most one
    #     token (≈ 1 GFLOP ≈ 9 µs at MFU 0.38), < 0.01 % of a 2048-token chunk.
    b=_A100_B,
    # c = 2·2·l²·d_model·layers/2 = 262,144 FLOP per l² (d_model 4096, 32 layers) at prefill
    #     MFU 0.38 × 312 TFLOP/s = 118.6 TFLOP/s → 2.211e-9 s/token² (a 2048 chunk: 9.3 ms).
    c=_A100_C,
    # d = 2.909e-5 s/seq (profile slope over 1..128 tokens, 32 layers + emb) + 2.01e-6 s/seq
    #     (LM head for the sampled token) = 3.110e-5 s/seq.  Cross-check: DistServe's
    #     0.0506 ms/seq × (8.03 / 12.85 B params) = 3.16e-5 s/seq.
    d=_A100_D,
    # e = 128 KiB of KV per context token at 0.813 × 2.039 TB/s → 7.90e-8 s/token (equivalently
    #     DistServe's 4.94e-4 ms/token × 131,072 / 819,200 B).
    e=_A100_E,
    name="a100-80gb/llama-3-8b/tp1",
    source=(
        "derived: vidur A100 profile (b, d), attention FLOPs at MFU 0.38 (c), weights/KV at "
        "0.813 of 2.039 TB/s from the DistServe OPT-13B fit (a, e); sim/stepmodel.py facts"
    ),
)

# ---------------------------------------------------------------------------------------------
# H100-SXM / Llama-3-8B / TP1 — DERIVED BY ROOFLINE SCALING OF THE A100 SET, NOT MEASURED.
# ---------------------------------------------------------------------------------------------

# Compute terms scale with the achieved FLOP/s (peak × the notes' BLIS MFU), memory terms with
# the HBM bandwidth at the same achieved fraction 0.813 (no H100 measurement to refine it).
_H100_PREFILL_SPEEDUP = (H100_MFU_PREFILL * H100_PEAK_BF16_FLOPS) / (
    A100_MFU_PREFILL * A100_PEAK_BF16_FLOPS
)  # 3.756
_H100_DECODE_SPEEDUP = (H100_MFU_DECODE * H100_PEAK_BF16_FLOPS) / (
    A100_MFU_DECODE * A100_PEAK_BF16_FLOPS
)  # 5.286

H100_LLAMA3_8B_TP1 = StepTimeModel(
    # a = 16.06 GB of weights at 0.813 × 3.35 TB/s → 5.89 ms.
    a=LLAMA3_8B_WEIGHT_BYTES / (ACHIEVED_HBM_FRACTION * H100_HBM_BYTES_PER_S),
    # b = A100 profile slope / (0.45 × 989.5 TFLOP/s ÷ 0.38 × 312 TFLOP/s = 3.756)
    #   → 1.773e-5 s/token.
    b=_A100_B / _H100_PREFILL_SPEEDUP,
    # c = 262,144 FLOP per l² at 0.45 × 989.5 TFLOP/s → 5.887e-10 s/token².
    c=(
        _causal_attention_flops_per_len_sq(LLAMA3_8B_HIDDEN, LLAMA3_8B_LAYERS)
        / (H100_MFU_PREFILL * H100_PEAK_BF16_FLOPS)
    ),
    # d = A100 per-sequence cost / (0.30 × 989.5 ÷ 0.18 × 312 = 5.286) → 5.88e-6 s/seq.
    d=_A100_D / _H100_DECODE_SPEEDUP,
    # e = 128 KiB of KV per context token at 0.813 × 3.35 TB/s → 4.81e-8 s/token.
    e=LLAMA3_8B_KV_BYTES_PER_TOKEN / (ACHIEVED_HBM_FRACTION * H100_HBM_BYTES_PER_S),
    name="h100-sxm/llama-3-8b/tp1",
    source=(
        "roofline-scaled from the A100 set with the notes' H100 numbers (989.5 TFLOP/s, "
        "3.35 TB/s, MFU 0.45/0.30); NOT measured - calibrate on a live replica"
    ),
)

# ---------------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------------

DEFAULT_MODEL_NAME = "a100-80gb/llama-3-8b/tp1"

COEFFICIENT_SETS: dict[str, StepTimeModel] = {
    A100_LLAMA3_8B_TP1.name: A100_LLAMA3_8B_TP1,
    H100_LLAMA3_8B_TP1.name: H100_LLAMA3_8B_TP1,
}


# vLLM 0.32/0.33's OpenAI-server engine defaults by device (vllm/engine/arg_utils.py,
# `get_batch_defaults`): (max_num_seqs, max_num_batched_tokens). A100s and other GPUs under
# 70 GiB get 256/2,048; H100/H200 (≥ 70 GiB, not an A100) 1,024/8,192; ≥ 160 GiB (B200)
# 1,024/16,384; the CPU build 128/2,048.
VLLM_ENGINE_DEFAULTS: dict[str, tuple[int, int]] = {
    "a100": (256, 2048),
    "h100": (1024, 8192),
    "h200": (1024, 8192),
    "b200": (1024, 16384),
    "cpu": (128, 2048),
}


def engine_defaults(model: StepTimeModel | str) -> dict[str, int]:
    """vLLM's default ``max_num_seqs`` and ``max_num_batched_tokens`` for the device a step model
    describes, read from its name (``a100-80gb/...``, ``h100-sxm/...``); a model of unknown
    device (a calibrated one, say) gets the A100's, vLLM's own fallback for GPUs."""
    name = model if isinstance(model, str) else model.name
    device = name.split("/")[0].lower()
    for key, (seqs, tokens) in VLLM_ENGINE_DEFAULTS.items():
        if device.startswith(key):
            return {"max_num_seqs": seqs, "max_num_batched_tokens": tokens}
    seqs, tokens = VLLM_ENGINE_DEFAULTS["a100"]
    return {"max_num_seqs": seqs, "max_num_batched_tokens": tokens}


def get_model(name: str = DEFAULT_MODEL_NAME) -> StepTimeModel:
    """The coefficient set called ``name``: a registered one, else one saved in the user directory
    (:func:`save_user_model`, what ``tailpilot calibrate`` writes); ValueError listing the known
    names."""
    try:
        return COEFFICIENT_SETS[name]
    except (KeyError, TypeError):
        pass
    if isinstance(name, str) and name:
        path = user_model_path(name)
        if path.is_file():
            model = load_model(path)
            if model.name != name:
                raise ValueError(f"{path}: holds step-time model {model.name!r}, not {name!r}")
            return model
    known = ", ".join(list_models())
    raise ValueError(f"unknown step-time model {name!r}; known: {known}") from None


def register(model: StepTimeModel, *, overwrite: bool = False) -> StepTimeModel:
    """Add a (calibrated) coefficient set under ``model.name``.

    Registering an identical model again is a no-op; replacing a different one needs
    ``overwrite=True``.
    """
    if not isinstance(model, StepTimeModel):
        raise TypeError(f"expected a StepTimeModel, got {type(model).__name__}")
    existing = COEFFICIENT_SETS.get(model.name)
    if existing is not None and existing != model and not overwrite:
        raise ValueError(
            f"a different step-time model is already registered as {model.name!r}; "
            "pass overwrite=True to replace it"
        )
    COEFFICIENT_SETS[model.name] = model
    return model


def save_model(model: StepTimeModel, path: str | os.PathLike[str]) -> None:
    """Write ``model`` as JSON (atomically: a temporary file renamed over ``path``)."""
    doc = {"format": _FORMAT, **model.as_dict()}
    path = os.fspath(path)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, indent=2, allow_nan=False)
        fh.write("\n")
    os.replace(tmp, path)


def load_model(path: str | os.PathLike[str]) -> StepTimeModel:
    """Read a model written by :func:`save_model` (it is not registered; see :func:`register`).
    ValueError naming the file when it cannot be read or is not such a document."""
    try:
        with open(os.fspath(path), encoding="utf-8") as fh:
            doc = json.load(fh)
    except OSError as err:
        raise ValueError(f"{os.fspath(path)}: cannot read: {err.strerror or err}") from None
    except (
        ValueError,
        RecursionError,
    ) as err:  # not JSON (nor UTF-8), or nested past the recursion limit
        reason = "nested too deeply" if isinstance(err, RecursionError) else str(err)
        raise ValueError(f"{os.fspath(path)}: not JSON: {reason}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{os.fspath(path)}: not a step-time model document")
    fmt = doc.pop("format", None)
    if fmt != _FORMAT:
        raise ValueError(f"{os.fspath(path)}: unsupported format {fmt!r} (expected {_FORMAT!r})")
    return StepTimeModel.from_dict(doc)


# ---------------------------------------------------------------------------------------------
# User directory of named coefficient sets (calibrated ones)
# ---------------------------------------------------------------------------------------------

#: tailpilot's data directory; step-time models live in ``<it>/step-models/``.  Default:
#: ``$XDG_DATA_HOME/tailpilot`` or ``~/.local/share/tailpilot``.
USER_DIR_ENV = "TAILPILOT_HOME"


def user_models_dir() -> Path:
    """Where named coefficient sets saved by :func:`save_user_model` live (read at every call,
    so a changed ``$TAILPILOT_HOME`` takes effect at once)."""
    home = os.environ.get(USER_DIR_ENV)
    if not home:
        data = os.environ.get("XDG_DATA_HOME") or os.path.join(
            os.path.expanduser("~"), ".local", "share"
        )
        home = os.path.join(data, "tailpilot")
    return Path(home).expanduser() / "step-models"


def user_model_path(name: str) -> Path:
    """The file of the set called ``name``: every character outside ``[A-Za-z0-9._-]`` is
    %-escaped, so ``calibrated/replica-a`` is ``calibrated%2Freplica-a.json`` (one file per
    name, no sub-folders, reversible)."""
    if not isinstance(name, str) or not name:
        raise ValueError("a step-time model name must be a non-empty string")
    safe = quote(name, safe="")
    if safe.startswith("."):  # no hidden files, no "." / ".."
        safe = "%2E" + safe[1:]
    return user_models_dir() / f"{safe}.json"


def save_user_model(model: StepTimeModel, *, overwrite: bool = True) -> Path:
    """Save ``model`` under its name in the user directory, where :func:`get_model` (and so the
    simulator, ``--step-model`` and the tuner) finds it; returns the file.  A built-in set's name
    is refused; an existing user set is replaced unless ``overwrite=False``."""
    if not isinstance(model, StepTimeModel):
        raise TypeError(f"expected a StepTimeModel, got {type(model).__name__}")
    if model.name in COEFFICIENT_SETS:
        raise ValueError(f"{model.name!r} is a registered coefficient set; save under another name")
    path = user_model_path(model.name)
    if path.exists() and not overwrite:
        raise ValueError(f"a step-time model {model.name!r} is already saved at {path}")
    path.parent.mkdir(parents=True, exist_ok=True)
    save_model(model, path)
    return path


def list_models() -> list[str]:
    """Names of every usable set: the registered ones, then those in the user directory (files
    that cannot be read are skipped)."""
    names = sorted(COEFFICIENT_SETS)
    folder = user_models_dir()
    if folder.is_dir():
        user = set()
        for path in folder.glob("*.json"):
            name = unquote(path.name[: -len(".json")])
            if name not in COEFFICIENT_SETS and user_model_path(name) == path:
                user.add(name)
        names += sorted(user)
    return names


# ---------------------------------------------------------------------------------------------
# Calibration
# ---------------------------------------------------------------------------------------------

MIN_FIT_ROWS = 5

_COLUMN_WHAT = {
    "b": "prefill tokens",
    "c": "prefill chunks (Σ prefill_len²)",
    "d": "decoding sequences",
    "e": "decode KV context",
}


class StepFitError(TailpilotError, ValueError):
    """The step log cannot determine the coefficients (too few rows, bad values, collinearity)."""


def fit_step_model(
    rows: Iterable[Sequence[float]],
    name: str,
    source: str,
    *,
    default: StepTimeModel | None = None,
    relative: bool = True,
    strict: bool = False,
) -> tuple[StepTimeModel, dict[str, Any]]:
    """Fit the five coefficients to observed steps by non-negative least squares.

    ``rows``: (duration_s, prefill_tokens, sum_prefill_sq, decode_seqs, sum_kv_context) per step.
    Columns are scaled to unit maximum before the fit (they span ~10 orders of magnitude); with
    ``relative`` (default) each row is weighted by 1/duration, i.e. relative errors are minimised,
    so short decode steps count as much as long prefill steps.

    A term never exercised by the log (e.g. no prefill at all → b and c) cannot be determined:
    it is kept at ``default``'s value (0 without a default), subtracted from the durations, and
    named in ``report["undetermined"]``; with ``strict=True`` it raises instead.  Terms that are
    exercised but linearly dependent (e.g. every prefill chunk has the same length, so b and c
    and a cannot be told apart) raise :class:`StepFitError` naming them.

    Returns the model and a report ``{n, rmse_s, mape, r2, a, b, c, d, e, undetermined,
    at_zero, relative}``.
    """
    # Measured start-up cost: scipy.optimize adds ~120 ms to every importer of sim.engine, and
    # only fitting needs it.
    from scipy.optimize import nnls

    try:
        data = np.asarray([tuple(r) for r in rows], dtype=float)
    except (TypeError, ValueError) as exc:
        raise StepFitError(f"step rows must be 5 numbers each: {exc}") from None
    n = len(data)
    if n < MIN_FIT_ROWS:
        raise StepFitError(f"need at least {MIN_FIT_ROWS} steps to fit the 5 coefficients, got {n}")
    if data.ndim != 2 or data.shape[1] != 5:
        raise StepFitError(
            "each step row must be (duration_s, prefill_tokens, sum_prefill_sq, "
            f"decode_seqs, sum_kv_context); got rows of shape {data.shape[1:]}"
        )
    bad = ~np.isfinite(data).all(axis=1) | (data < 0).any(axis=1) | (data[:, 0] <= 0)
    if bad.any():
        first = int(np.flatnonzero(bad)[0])
        raise StepFitError(
            f"{int(bad.sum())} step row(s) have a non-finite or negative value or a "
            f"duration <= 0 (first: row {first}: {data[first].tolist()})"
        )

    y = data[:, 0]
    design = np.column_stack([np.ones(n), data[:, 1:]])

    undetermined: dict[str, str] = {}
    fixed_values: dict[str, float] = {}
    for j, key in enumerate(COEFFICIENTS[1:], start=1):
        if not np.any(design[:, j] > 0):
            kept = getattr(default, key) if default is not None else 0.0
            undetermined[key] = (
                f"{key} ({COEF_MEANING[key]}) cannot be determined: no step in the "
                f"log has {_COLUMN_WHAT[key]}; kept at "
                f"{'the default' if default is not None else '0'} ({kept:.4g})"
            )
            fixed_values[key] = kept
    if undetermined and strict:
        raise StepFitError("; ".join(undetermined.values()))

    free = [j for j, key in enumerate(COEFFICIENTS) if key not in fixed_values]
    target = y - sum(design[:, COEFFICIENTS.index(k)] * v for k, v in fixed_values.items())
    weights = 1.0 / y if relative else np.ones(n)
    matrix = design[:, free] * weights[:, None]
    scale = np.abs(matrix).max(axis=0)
    matrix = matrix / scale

    # Rank check on the scaled, weighted design: exact dependences (same chunk length every time,
    # constant batch, ...) show up as singular values ~1e-16 of the largest.
    _, sing, vt = np.linalg.svd(matrix, full_matrices=False)
    tol = sing[0] * 1e-9
    rank = int(np.sum(sing > tol))
    if rank < len(free):
        null = vt[rank:]
        involved = [
            COEFFICIENTS[free[i]] for i in range(len(free)) if np.any(np.abs(null[:, i]) > 1e-6)
        ]
        raise StepFitError(
            f"coefficients {', '.join(involved)} cannot be separated: their columns are linearly "
            f"dependent in this step log (rank {rank} of {len(free)}; e.g. every prefill chunk has "
            "the same length or every decode batch the same size/context). Record steps with "
            "more varied batches."
        )

    sol, _ = nnls(matrix, target * weights)
    coef = dict(fixed_values)
    for i, j in enumerate(free):
        coef[COEFFICIENTS[j]] = float(sol[i] / scale[i])
    at_zero = [COEFFICIENTS[j] for i, j in enumerate(free) if sol[i] == 0.0]

    model = StepTimeModel(**{k: coef[k] for k in COEFFICIENTS}, name=name, source=source)
    pred = design @ np.array([coef[k] for k in COEFFICIENTS])
    resid = pred - y
    ss_res = float(np.sum(resid**2))
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    report = {
        "n": n,
        "rmse_s": math.sqrt(ss_res / n),
        "mape": float(np.mean(np.abs(resid) / y)),
        "r2": 1.0 - ss_res / ss_tot if ss_tot > 0 else (1.0 if ss_res == 0 else 0.0),
        **{k: coef[k] for k in COEFFICIENTS},
        "undetermined": undetermined,
        "at_zero": at_zero,
        "relative": relative,
    }
    return model, report

"""Tests for sim/stepmodel.py (docs/engine.md#step-time-model step-time model)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from sim.stepmodel import (
    COEFFICIENT_SETS,
    DEFAULT_MODEL_NAME,
    StepFitError,
    StepTimeModel,
    fit_step_model,
    get_model,
    load_model,
    register,
    save_model,
)

# Facts restated here from sim/stepmodel.py's sources so the checks below are independent of the
# constants in sim/stepmodel.py.
A100_FLOPS = 312e12
A100_BW = 2.039e12
LAYERS, HIDDEN, KV_HEADS, HEAD_DIM, FFN, VOCAB = 32, 4096, 8, 128, 14336, 128256


def _kv_bytes_per_token() -> int:
    return 2 * LAYERS * KV_HEADS * HEAD_DIM * 2


def _linear_params_per_layer() -> int:
    return HIDDEN * (HIDDEN + 2 * KV_HEADS * HEAD_DIM) + HIDDEN * HIDDEN + 3 * HIDDEN * FFN


def _weight_bytes_streamed() -> int:
    # all 32 layers' linear weights + the LM head (the embedding table is only gathered)
    return 2 * (LAYERS * _linear_params_per_layer() + VOCAB * HIDDEN)


# --------------------------------------------------------------------------------------------
# sanity ranges of the default set
# --------------------------------------------------------------------------------------------


def test_default_is_registered():
    model = get_model()
    assert model.name == DEFAULT_MODEL_NAME == "a100-80gb/llama-3-8b/tp1"
    assert COEFFICIENT_SETS[DEFAULT_MODEL_NAME] is model
    assert model.source


def test_pure_decode_step_32_seqs_1000_context_is_10_to_30_ms():
    model = get_model(DEFAULT_MODEL_NAME)
    seqs, ctx = 32, 1000
    t = model.step_time(0, 0, seqs, seqs * ctx)
    assert 0.010 <= t <= 0.030, t
    # Memory roofline: the step reads the weights and all 32 000 tokens of KV at least once, so it
    # cannot be faster than that at the full HBM bandwidth.
    roofline = (_weight_bytes_streamed() + seqs * ctx * _kv_bytes_per_token()) / A100_BW
    assert roofline > 0.009  # ~9.4 ms: the bound itself is meaningful
    assert t >= roofline, (t, roofline)


def test_2048_token_prefill_chunk_is_100_to_250_ms():
    model = get_model(DEFAULT_MODEL_NAME)
    n = 2048
    t = model.step_time(n, n * n, 0, 0)
    assert 0.100 <= t <= 0.250, t
    # Compute roofline: 2 FLOPs per parameter per token in the linear layers, plus causal attention
    # (QKᵀ and PV, 2 FLOPs per MAC, halved by the mask), at the full 312 TFLOP/s.
    flops = 2 * LAYERS * _linear_params_per_layer() * n + 2 * 2 * n * n * HIDDEN * LAYERS / 2
    assert t >= flops / A100_FLOPS, (t, flops / A100_FLOPS)
    # ... and an implied utilisation that is plausible for large GEMMs (notes: 0.38 .. ~0.66).
    assert 0.3 <= (flops / A100_FLOPS) / t <= 0.8


def test_batch_time_matches_step_time_terms():
    model = get_model()
    chunks, ctxs = [512, 1024], [10, 20, 30]
    expected = model.a + model.b * 1536 + model.c * (512**2 + 1024**2) + model.d * 3 + model.e * 60
    assert model.batch_time(chunks, ctxs) == pytest.approx(expected, rel=1e-12)
    assert model.batch_time() == pytest.approx(model.a)


def test_default_c_and_e_follow_the_stated_formulas():
    model = get_model()
    # c: causal attention FLOPs per l² at prefill MFU 0.38 of 312 TFLOP/s.
    assert model.c == pytest.approx(2 * 2 * HIDDEN * LAYERS / 2 / (0.38 * A100_FLOPS), rel=1e-9)
    # e: 128 KiB per context token at the bandwidth fraction implied by DistServe's OPT-13B fit.
    frac = (2 * 40 * 5120 * 2 / A100_BW) / 4.94e-7
    assert 0.75 < frac < 0.85
    assert model.e == pytest.approx(_kv_bytes_per_token() / (frac * A100_BW), rel=1e-9)
    # a: ≈ 16 GB of weights at that fraction, within 30 % of DistServe's intercept scaled by size.
    assert model.a == pytest.approx(16.06e9 / (frac * A100_BW), rel=1e-9)
    assert model.a == pytest.approx(19.56e-3 * 16.06 / 25.7, rel=0.3)
    # d: close to DistServe's 0.0506 ms/seq scaled by parameter count 8.03 / 12.85.
    assert model.d == pytest.approx(0.0506e-3 * 8.03 / 12.85, rel=0.1)


def test_h100_set_is_faster_in_every_term_and_marked_derived():
    a100, h100 = get_model(), get_model("h100-sxm/llama-3-8b/tp1")
    for key in "abcde":
        assert 0 < getattr(h100, key) < getattr(a100, key), key
    assert "not measured" in h100.source.lower()
    # memory-bound terms scale exactly with HBM bandwidth
    assert h100.e / a100.e == pytest.approx(2.039 / 3.35, rel=1e-9)
    assert h100.a / a100.a == pytest.approx(2.039 / 3.35, rel=1e-9)


# --------------------------------------------------------------------------------------------
# registry and persistence
# --------------------------------------------------------------------------------------------


def test_unknown_name_lists_known_names():
    with pytest.raises(ValueError) as info:
        get_model("tpu-v5/llama-3-8b/tp1")
    msg = str(info.value)
    assert "tpu-v5/llama-3-8b/tp1" in msg
    for name in COEFFICIENT_SETS:
        assert name in msg


def test_register_adds_and_protects_names():
    model = StepTimeModel(0.01, 1e-5, 1e-9, 1e-5, 1e-8, name="test/register/tp1", source="t")
    try:
        assert register(model) is model
        assert get_model("test/register/tp1") is model
        register(model)  # identical: no-op
        other = StepTimeModel(0.02, 1e-5, 1e-9, 1e-5, 1e-8, name="test/register/tp1", source="t")
        with pytest.raises(ValueError, match="already registered"):
            register(other)
        register(other, overwrite=True)
        assert get_model("test/register/tp1").a == 0.02
    finally:
        COEFFICIENT_SETS.pop("test/register/tp1", None)


def test_json_round_trip(tmp_path):
    original = get_model("h100-sxm/llama-3-8b/tp1")
    path = tmp_path / "model.json"
    save_model(original, path)
    doc = json.loads(path.read_text())
    assert doc["name"] == original.name and doc["c"] == original.c
    loaded = load_model(path)
    assert loaded == original
    assert loaded.as_dict() == original.as_dict()
    assert StepTimeModel.from_dict(original.as_dict()) == original


def test_load_rejects_bad_documents(tmp_path):
    path = tmp_path / "bad.json"
    doc = {"format": "tailpilot-step-time-model/1", **get_model().as_dict()}
    doc["e"] = -1.0
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="e"):
        load_model(path)
    del doc["e"]
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="missing"):
        load_model(path)
    path.write_text(json.dumps(get_model().as_dict()))  # no format marker
    with pytest.raises(ValueError, match="format"):
        load_model(path)


def test_model_rejects_negative_or_nonfinite_coefficients():
    with pytest.raises(ValueError):
        StepTimeModel(-0.01, 0, 0, 0, 0)
    with pytest.raises(ValueError):
        StepTimeModel(0.01, math.nan, 0, 0, 0)
    m = StepTimeModel(1, 0, 0, 0, 0)
    assert isinstance(m.a, float)
    with pytest.raises(AttributeError):
        m.a = 2.0  # frozen


# --------------------------------------------------------------------------------------------
# calibration fit
# --------------------------------------------------------------------------------------------


def _synthetic_log(
    model: StepTimeModel,
    seed: int,
    n: int = 2000,
    noise: float = 0.01,
    prefill: bool = True,
    decode: bool = True,
) -> list[tuple]:
    """Random steps: ~60 % decode-only, ~20 % prefill-only, ~20 % mixed; 1 % multiplicative
    noise."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        kind = rng.random()
        has_prefill = prefill and (kind >= 0.6 or not decode)
        has_decode = decode and (kind < 0.8 or not prefill)
        chunks = (
            np.exp(rng.uniform(np.log(16), np.log(8192), size=rng.integers(1, 4))).astype(int)
            if has_prefill
            else np.zeros(0, dtype=int)
        )
        if has_decode:
            level = np.exp(rng.uniform(np.log(16), np.log(8000)))  # phase-dependent context length
            ctxs = rng.integers(1, int(2 * level) + 1, size=rng.integers(1, 257))
        else:
            ctxs = np.zeros(0, dtype=int)
        # true time from the formula, computed here term by term
        sq = float(np.sum(chunks.astype(float) ** 2))
        t = (
            model.a
            + model.b * chunks.sum()
            + model.c * sq
            + model.d * len(ctxs)
            + model.e * ctxs.sum()
        )
        t *= 1.0 + noise * rng.standard_normal()
        rows.append((t, int(chunks.sum()), sq, len(ctxs), int(ctxs.sum())))
    return rows


@pytest.mark.parametrize("truth_name", ["a100-80gb/llama-3-8b/tp1", "h100-sxm/llama-3-8b/tp1"])
def test_fit_recovers_known_coefficients_within_5_percent(truth_name):
    truth = get_model(truth_name)
    rows = _synthetic_log(truth, seed=7)
    fitted, report = fit_step_model(rows, "fitted", "synthetic")
    assert fitted.name == "fitted" and fitted.source == "synthetic"
    for key in "abcde":
        assert getattr(fitted, key) == pytest.approx(getattr(truth, key), rel=0.05), key
        assert report[key] == getattr(fitted, key)
    assert report["n"] == len(rows)
    assert report["mape"] < 0.02  # ≈ 0.8 % for 1 % Gaussian noise
    assert report["r2"] > 0.99
    durations = np.array([r[0] for r in rows])
    # 1 % multiplicative noise → RMSE ≈ 1 % of the RMS duration
    assert 0.005 < report["rmse_s"] / np.sqrt(np.mean(durations**2)) < 0.015
    assert report["undetermined"] == {}


def test_fit_accepts_a_generator_and_is_unweighted_on_request():
    truth = StepTimeModel(0.02, 5e-5, 3e-9, 4e-5, 1e-7)
    rows = _synthetic_log(truth, seed=3, n=500, noise=0.0)
    fitted, report = fit_step_model((r for r in rows), "g", "gen", relative=False)
    for key in "abcde":
        assert getattr(fitted, key) == pytest.approx(getattr(truth, key), rel=1e-6), key
    assert report["relative"] is False and report["mape"] < 1e-6


def test_fit_needs_five_rows():
    rows = _synthetic_log(get_model(), seed=1, n=4)
    with pytest.raises(StepFitError, match="at least 5"):
        fit_step_model(rows, "x", "y")
    with pytest.raises(ValueError):  # StepFitError is a ValueError
        fit_step_model([], "x", "y")


def test_fit_rejects_bad_rows():
    rows = _synthetic_log(get_model(), seed=1, n=10)
    rows[3] = (-0.01, *rows[3][1:])
    with pytest.raises(StepFitError, match="row 3"):
        fit_step_model(rows, "x", "y")
    with pytest.raises(StepFitError, match=r"5 numbers|shape"):
        fit_step_model([(0.01, 1, 1)] * 10, "x", "y")


def test_fit_without_prefill_keeps_b_and_c_at_default_and_says_so():
    truth = get_model()
    rows = _synthetic_log(truth, seed=11, n=800, prefill=False)
    default = get_model("h100-sxm/llama-3-8b/tp1")
    fitted, report = fit_step_model(rows, "decode-only", "synthetic", default=default)
    assert set(report["undetermined"]) == {"b", "c"}
    assert "prefill" in report["undetermined"]["b"]
    assert fitted.b == default.b and fitted.c == default.c
    for key in "ade":
        assert getattr(fitted, key) == pytest.approx(getattr(truth, key), rel=0.05), key
    # without a default the undeterminable terms stay 0
    fitted0, _ = fit_step_model(rows, "decode-only", "synthetic")
    assert fitted0.b == 0.0 and fitted0.c == 0.0
    with pytest.raises(StepFitError, match=r"\bb\b.*cannot be determined"):
        fit_step_model(rows, "decode-only", "synthetic", strict=True)


def test_fit_without_decode_names_d_and_e():
    rows = _synthetic_log(get_model(), seed=5, n=300, decode=False)
    _, report = fit_step_model(rows, "prefill-only", "synthetic")
    assert set(report["undetermined"]) == {"d", "e"}


def test_fit_collinear_columns_raise_naming_them():
    # every step: one 2048-token chunk, so prefill_tokens and Σ l² are constant like the intercept
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(50):
        b = int(rng.integers(1, 200))
        ctx = int(rng.integers(100, 100_000))
        rows.append((0.1 + 1e-5 * b + 1e-8 * ctx, 2048, 2048.0**2, b, ctx))
    with pytest.raises(StepFitError) as info:
        fit_step_model(rows, "x", "y")
    msg = str(info.value)
    assert "a, b, c" in msg and "linearly dependent" in msg

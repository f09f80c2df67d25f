#!/usr/bin/env python3
"""Re-derive the profile-based step-time coefficients (b, d) from the measured vidur profile.

The default A100-80GB / Llama-3-8B / TP1 coefficient set in ``sim/stepmodel.py`` hard-codes
``b`` (seconds per prefill token) and ``d`` (seconds per decode sequence) so that the package
never needs the profile at run time.  This script recomputes both by least squares from
``vidur_a100_llama3_8b_mlp.csv`` (measured per-layer non-attention op times, milliseconds per
layer) and prints them next to the hard-coded values with the relative difference.

Method (the same one the comments in ``sim/stepmodel.py`` describe):

* per token count (TP as given, default 1), the per-layer time is the sum of the op medians of
  the nine per-layer ops (input_layernorm, attn_pre_proj, attn_rope, attn_post_proj,
  post_attention_layernorm, mlp_up_proj, mlp_act, mlp_down_proj, add); rows repeated for the
  same token count are averaged;
* model time = 32 layers x per-layer time + the ``emb`` op once (the embedding gather runs once
  per step, not once per layer);
* b = least-squares slope of model time over the chunked-prefill range (default 256..8192 tokens);
* d = least-squares slope over the decode-batch range (default 1..128 tokens), plus the LM head
  for the one token every decoding sequence samples: the LM head is a GEMM with
  vocab x hidden = 525.3 M parameters, 2.409x the layer's 218.1 M linear parameters, so its
  per-token slope is taken as 2.409 x the measured slope of the layer's four GEMMs
  (attn_pre_proj, attn_post_proj, mlp_up_proj, mlp_down_proj).

Usage (from the repository root)::

    .venv/bin/python benchmarks/derive_step_coefficients.py [PROFILE_CSV] [--tp 1]
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

# Run as a script: the repository root goes on sys.path before the project's import (E402).
REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from sim.stepmodel import DEFAULT_MODEL_NAME, get_model  # noqa: E402

DEFAULT_PROFILE = REPO_ROOT / "traces" / "profiles" / "vidur_a100_llama3_8b_mlp.csv"

PER_LAYER_OPS = (
    "input_layernorm",
    "attn_pre_proj",
    "attn_rope",
    "attn_post_proj",
    "post_attention_layernorm",
    "mlp_up_proj",
    "mlp_act",
    "mlp_down_proj",
    "add",
)
GEMM_OPS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")
ONCE_PER_STEP_OPS = ("emb",)

N_LAYERS = 32
HIDDEN = 4096
VOCAB = 128256
LAYER_LINEAR_PARAMS = (
    HIDDEN * (HIDDEN + 2 * 8 * 128)  # fused QKV projection (32 query heads, 8 KV heads of 128)
    + HIDDEN * HIDDEN  # output projection
    + 3 * HIDDEN * 14336  # gated MLP: gate, up, down
)
LM_HEAD_PARAMS = VOCAB * HIDDEN
LM_HEAD_TO_LAYER_GEMMS = LM_HEAD_PARAMS / LAYER_LINEAR_PARAMS

MS = 1e-3


def op_median(row: dict[str, str], op: str) -> float:
    """The median time (ms) of the profiled operation ``op`` in one profile row."""
    return float(row[f"time_stats.{op}.median"])


def load_profile(path: Path, tp: int) -> dict[str, dict[int, float]]:
    """Per token count: per-layer op time, embedding time and GEMM time (ms), duplicates
    averaged."""
    layer: dict[int, list[float]] = defaultdict(list)
    once: dict[int, list[float]] = defaultdict(list)
    gemm: dict[int, list[float]] = defaultdict(list)
    with path.open(newline="") as fh:
        for row in csv.DictReader(fh):
            if int(row["num_tensor_parallel_workers"]) != tp:
                continue
            n = int(row["num_tokens"])
            layer[n].append(sum(op_median(row, op) for op in PER_LAYER_OPS))
            once[n].append(sum(op_median(row, op) for op in ONCE_PER_STEP_OPS))
            gemm[n].append(sum(op_median(row, op) for op in GEMM_OPS))
    if not layer:
        raise SystemExit(f"{path}: no rows with num_tensor_parallel_workers == {tp}")
    return {
        "layer": {n: float(np.mean(v)) for n, v in layer.items()},
        "once": {n: float(np.mean(v)) for n, v in once.items()},
        "gemm": {n: float(np.mean(v)) for n, v in gemm.items()},
    }


def linear_fit(points: dict[int, float], lo: int, hi: int) -> tuple[float, float, int, float]:
    """Least-squares (intercept, slope) over lo <= n <= hi; also the point count and the max
    relative error."""
    ns = np.array(sorted(n for n in points if lo <= n <= hi), dtype=float)
    if len(ns) < 2:
        raise SystemExit(f"fewer than two token counts in [{lo}, {hi}]")
    y = np.array([points[int(n)] for n in ns])
    design = np.column_stack([np.ones_like(ns), ns])
    (intercept, slope), *_ = np.linalg.lstsq(design, y, rcond=None)
    max_rel = float(np.max(np.abs(design @ np.array([intercept, slope]) - y) / y))
    return float(intercept), float(slope), len(ns), max_rel


def derive(path: Path, tp: int = 1, prefill_range=(256, 8192), decode_range=(1, 128)) -> dict:
    prof = load_profile(path, tp)
    model_ms = {n: N_LAYERS * prof["layer"][n] + prof["once"][n] for n in prof["layer"]}
    b_icpt, b_slope, b_n, b_err = linear_fit(model_ms, *prefill_range)
    d_icpt, d_slope, d_n, d_err = linear_fit(model_ms, *decode_range)
    _, gemm_slope, _, _ = linear_fit(prof["gemm"], *decode_range)
    lm_head_ms = LM_HEAD_TO_LAYER_GEMMS * gemm_slope
    return {
        "b": b_slope * MS,
        "b_intercept_s": b_icpt * MS,
        "b_points": b_n,
        "b_max_rel_err": b_err,
        "d_layers": d_slope * MS,
        "d_lm_head": lm_head_ms * MS,
        "d": (d_slope + lm_head_ms) * MS,
        "d_intercept_s": d_icpt * MS,
        "d_points": d_n,
        "d_max_rel_err": d_err,
        "prefill_range": prefill_range,
        "decode_range": decode_range,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "profile",
        nargs="?",
        type=Path,
        default=DEFAULT_PROFILE,
        help="vidur mlp.csv profile (default: %(default)s)",
    )
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (default 1)")
    parser.add_argument(
        "--prefill-range",
        type=int,
        nargs=2,
        default=(256, 8192),
        metavar=("LO", "HI"),
        help="token counts for the b fit (default 256 8192)",
    )
    parser.add_argument(
        "--decode-range",
        type=int,
        nargs=2,
        default=(1, 128),
        metavar=("LO", "HI"),
        help="token counts for the d fit (default 1 128)",
    )
    args = parser.parse_args(argv)
    r = derive(args.profile.resolve(), args.tp, tuple(args.prefill_range), tuple(args.decode_range))
    hard = get_model(DEFAULT_MODEL_NAME)

    print(f"profile: {args.profile.resolve()}  (TP{args.tp})")
    print(
        f"b fit over {r['prefill_range'][0]}..{r['prefill_range'][1]} tokens: "
        f"{r['b_points']} token counts, intercept {r['b_intercept_s'] * 1e3:.3f} ms, "
        f"max rel. residual {r['b_max_rel_err']:.1%}"
    )
    print(
        f"d fit over {r['decode_range'][0]}..{r['decode_range'][1]} tokens: {r['d_points']} token "
        f"counts, intercept {r['d_intercept_s'] * 1e3:.3f} ms, "
        f"max rel. residual {r['d_max_rel_err']:.1%}"
    )
    print(
        f"  d = layers+emb {r['d_layers']:.4e} s + LM head {r['d_lm_head']:.4e} s "
        f"({LM_HEAD_TO_LAYER_GEMMS:.3f} x layer GEMM slope)"
    )
    print()
    print(f"{'coef':<5}{'refit from CSV':>16}{'hard-coded':>14}{'rel. diff':>11}   unit")
    for key, unit in (("b", "s/prefill token"), ("d", "s/decode seq")):
        refit, coded = r[key], getattr(hard, key)
        print(f"{key:<5}{refit:>16.5e}{coded:>14.5e}{(coded - refit) / refit:>+11.2%}   {unit}")
    if args.tp != 1:
        print("(note: the hard-coded set is TP1; a different --tp is not expected to match)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
